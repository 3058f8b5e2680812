#!/usr/bin/python3
"""Kiln's ES256 tokens against an independent JWT implementation (Debian's python3-jwt).

A token Kiln issues must verify with PyJWT against Kiln's JWKS; tokens PyJWT signs with its own
key must verify in Kiln when that key is in the JWKS; and tokens forged with a wrong key, with
alg "none", with HS256 keyed by Kiln's public key, or with a DER signature must be refused.

usage: test_interop.py <path to auth_interop_tool>
"""
import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import jwt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

TOOL = None
ISSUER = "https://kiln.test"


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def thumbprint(x, y):
    """RFC 7638 thumbprint of a P-256 public key."""
    canon = json.dumps({"crv": "P-256", "kty": "EC", "x": x, "y": y},
                       separators=(",", ":"), sort_keys=True)
    return b64url(hashlib.sha256(canon.encode()).digest())


def jwk_of(private_key):
    nums = private_key.public_key().public_numbers()
    x = b64url(nums.x.to_bytes(32, "big"))
    y = b64url(nums.y.to_bytes(32, "big"))
    return {"kty": "EC", "crv": "P-256", "x": x, "y": y, "kid": thumbprint(x, y),
            "use": "sig", "alg": "ES256"}


def claims(**over):
    now = int(time.time())
    c = {"iss": ISSUER, "aud": "kiln-api", "sub": "key_py", "tid": "tn_py",
         "scope": "sandbox:read", "iat": now, "exp": now + 300, "jti": "jti_py"}
    c.update(over)
    return c


def raw_token(header, payload, sig=b""):
    head = b64url(json.dumps(header).encode())
    body = b64url(json.dumps(payload).encode())
    return "%s.%s.%s" % (head, body, b64url(sig)), ("%s.%s" % (head, body)).encode()


class Interop(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        out = subprocess.run([TOOL, "issue"], check=True, capture_output=True, text=True).stdout
        cls.issued = json.loads(out)
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def kiln_verify(self, token, jwks=None, aud="kiln-api"):
        path = os.path.join(self.tmp.name, "jwks.json")
        with open(path, "w") as f:
            f.write(jwks if jwks is not None else self.issued["jwks"])
        r = subprocess.run([TOOL, "verify", path, aud], input=token, capture_output=True,
                           text=True)
        self.assertIn(r.returncode, (0, 1), r.stderr)
        return r.stdout.strip()

    def test_kiln_token_verifies_with_pyjwt_against_the_jwks(self):
        token, kid = self.issued["token"], self.issued["kid"]
        header = jwt.get_unverified_header(token)
        self.assertEqual(header["alg"], "ES256")
        self.assertEqual(header["kid"], kid)
        keyset = jwt.PyJWKSet.from_json(self.issued["jwks"])
        [key] = [k for k in keyset.keys if k.key_id == kid]
        got = jwt.decode(token, key.key, algorithms=["ES256"], audience="kiln-api",
                         issuer=ISSUER, options={"require": ["exp", "iat", "jti", "sub"]})
        self.assertEqual(got["sub"], "key_interop")
        self.assertEqual(got["tid"], "tn_interop")
        self.assertEqual(got["scope"], "sandbox:read keys:write")
        self.assertLessEqual(got["exp"] - got["iat"], 300)
        # JOSE signatures are raw r||s, 64 bytes for P-256, not DER.
        self.assertEqual(len(b64url_decode(token.split(".")[2])), 64)
        # The wrong audience fails in PyJWT too.
        with self.assertRaises(jwt.InvalidAudienceError):
            jwt.decode(token, key.key, algorithms=["ES256"], audience="kiln-node")

    def test_kid_is_the_rfc7638_thumbprint(self):
        [k] = json.loads(self.issued["jwks"])["keys"]
        self.assertEqual(k["kid"], thumbprint(k["x"], k["y"]))
        self.assertEqual(set(k), {"kty", "crv", "x", "y", "kid", "use", "alg"})

    def test_kiln_verifies_its_own_token_through_the_jwks(self):
        self.assertEqual(self.kiln_verify(self.issued["token"]),
                         "ok key_interop tn_interop sandbox:read keys:write")
        self.assertEqual(self.kiln_verify(self.issued["token"], aud="kiln-node"),
                         "refused wrong_aud")

    def test_kiln_verifies_pyjwt_tokens_signed_by_a_published_key(self):
        priv = ec.generate_private_key(ec.SECP256R1())
        jwk = jwk_of(priv)
        jwks = json.dumps({"keys": [jwk]})
        token = jwt.encode(claims(), priv, algorithm="ES256", headers={"kid": jwk["kid"]})
        self.assertEqual(self.kiln_verify(token, jwks), "ok key_py tn_py sandbox:read")
        expired = jwt.encode(claims(iat=int(time.time()) - 600, exp=int(time.time()) - 300),
                             priv, algorithm="ES256", headers={"kid": jwk["kid"]})
        self.assertEqual(self.kiln_verify(expired, jwks), "refused expired")
        missing = claims()
        del missing["tid"]
        token = jwt.encode(missing, priv, algorithm="ES256", headers={"kid": jwk["kid"]})
        self.assertEqual(self.kiln_verify(token, jwks), "refused bad_claims")

    def test_token_forged_with_a_wrong_key_is_refused(self):
        wrong = ec.generate_private_key(ec.SECP256R1())
        token = jwt.encode(claims(scope="admin"), wrong, algorithm="ES256",
                           headers={"kid": self.issued["kid"]})
        self.assertEqual(self.kiln_verify(token), "refused bad_signature")
        # The wrong key under its own kid is simply unknown.
        token = jwt.encode(claims(), wrong, algorithm="ES256",
                           headers={"kid": jwk_of(wrong)["kid"]})
        self.assertEqual(self.kiln_verify(token), "refused unknown_kid")

    def test_alg_none_is_refused(self):
        for alg in ("none", "None", "NONE"):
            token, _ = raw_token({"alg": alg, "typ": "JWT", "kid": self.issued["kid"]},
                                 claims(scope="admin"))
            self.assertEqual(self.kiln_verify(token), "refused bad_alg")

    def test_hs256_keyed_with_the_public_key_is_refused(self):
        pem = self.issued["public_pem"]
        for secret in (pem.encode(), pem.strip().encode()):
            for alg, digest in (("HS256", hashlib.sha256), ("HS512", hashlib.sha512)):
                token, signing_input = raw_token(
                    {"alg": alg, "typ": "JWT", "kid": self.issued["kid"]}, claims(scope="admin"))
                sig = hmac.new(secret, signing_input, digest).digest()
                token = token + b64url(sig)
                self.assertEqual(self.kiln_verify(token), "refused bad_alg")

    def test_der_signature_is_refused(self):
        priv = ec.generate_private_key(ec.SECP256R1())
        jwk = jwk_of(priv)
        token, signing_input = raw_token({"alg": "ES256", "typ": "JWT", "kid": jwk["kid"]},
                                         claims())
        der = priv.sign(signing_input, ec.ECDSA(hashes.SHA256()))
        self.assertEqual(self.kiln_verify(token + b64url(der), json.dumps({"keys": [jwk]})),
                         "refused bad_signature")

    def test_tampered_payload_is_refused(self):
        head, _, sig = self.issued["token"].split(".")
        body = b64url(json.dumps(claims(sub="key_interop", tid="tn_other")).encode())
        self.assertEqual(self.kiln_verify("%s.%s.%s" % (head, body, sig)),
                         "refused bad_signature")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    TOOL = sys.argv.pop(1)
    unittest.main(verbosity=2)
