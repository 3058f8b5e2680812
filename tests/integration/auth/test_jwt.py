"""The gateway's tokens against an independent JWT implementation (Debian's python3-jwt): a Kiln
token verifies with PyJWT against the served JWKS, and tokens PyJWT (or hand) forges are refused."""
import base64
import hashlib
import hmac
import json
import time
import unittest
import urllib.request

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from authtest import GatewayCase, bearer, jwt_parts


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def compact(header, claims, sig):
    h = b64url(json.dumps(header, separators=(",", ":")).encode())
    p = b64url(json.dumps(claims, separators=(",", ":")).encode())
    return f"{h}.{p}.{b64url(sig)}"


class JwtInteropTests(GatewayCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        r = cls.gw.request("POST", "/v1/tenants", {"name": "interop"}, cls.admin)
        assert r.status == 201, r
        cls.key = r.json()["api_key"]
        cls.h = bearer(cls.key["key"])

    def jwks(self):
        with urllib.request.urlopen(self.gw.url + "/v1/.well-known/jwks.json", timeout=10) as r:
            return json.loads(r.read())

    def issued(self, **body):
        tok = self.new_token(self.h, **body)
        return tok, jwt_parts(tok)

    def assert_refused(self, token):
        before = self.counts()
        for method, path, body in (("GET", "/v1/api-keys", None),
                                   ("POST", "/v1/api-keys", {"name": "forged", "scopes": ["keys:write"]})):
            r = self.expect(self.call(method, path, body, bearer(token)), 401, "unauthenticated")
            self.assertEqual(r.headers["WWW-Authenticate"], "Bearer")
        self.assertEqual(self.counts(), before)
        return r

    def test_a_kiln_token_verifies_with_pyjwt_against_the_served_jwks(self):
        tok, (header, _) = self.issued(ttl_s=300)
        jwks = self.jwks()
        jwk = next(k for k in jwks["keys"] if k["kid"] == header["kid"])
        key = jwt.PyJWK(jwk)
        self.assertEqual(key.key_id, header["kid"])
        claims = jwt.decode(tok, key.key, algorithms=["ES256"], audience="kiln-api",
                            options={"require": ["iss", "aud", "sub", "exp", "iat", "jti"]})
        self.assertEqual(claims["sub"], self.key["id"])
        self.assertEqual(claims["aud"], "kiln-api")
        self.assertEqual(claims["exp"] - claims["iat"], 300)
        # The whole key set loads as well, and a wrong audience is PyJWT's refusal too.
        keyset = jwt.PyJWKSet.from_dict(jwks)
        self.assertIn(header["kid"], [k.key_id for k in keyset.keys])
        with self.assertRaises(jwt.InvalidAudienceError):
            jwt.decode(tok, key.key, algorithms=["ES256"], audience="kiln-node")

    def test_a_token_forged_with_a_wrong_p256_key_and_the_real_kid_is_401(self):
        _, (header, claims) = self.issued()
        wrong = ec.generate_private_key(ec.SECP256R1())
        forged = jwt.encode(claims, wrong, algorithm="ES256", headers={"kid": header["kid"]})
        self.assertEqual(jwt.get_unverified_header(forged)["kid"], header["kid"])
        r = self.assert_refused(forged)
        self.assertIn("bad_signature", r.json()["error"]["message"])

    def test_a_token_forged_with_more_scopes_is_401(self):
        _, (header, claims) = self.issued(scopes=["sandbox:read"])
        claims["scope"] = "sandbox:read sandbox:write billing:read keys:write admin"
        wrong = ec.generate_private_key(ec.SECP256R1())
        self.assert_refused(jwt.encode(claims, wrong, algorithm="ES256", headers={"kid": header["kid"]}))

    def test_a_kiln_token_with_its_payload_changed_is_401(self):
        tok, (_, claims) = self.issued(scopes=["sandbox:read"])
        h, _, s = tok.split(".")
        claims["scope"] = "keys:write"
        p = b64url(json.dumps(claims, separators=(",", ":")).encode())
        self.assert_refused(f"{h}.{p}.{s}")

    def test_alg_none_token_is_401(self):
        _, (header, claims) = self.issued()
        unsigned = jwt.encode(claims, None, algorithm=None)
        self.assertEqual(jwt.get_unverified_header(unsigned)["alg"], "none")
        self.assert_refused(unsigned)
        # With the kid and a non-empty (junk) signature part, too.
        for alg in ("none", "None", "NONE"):
            with self.subTest(alg=alg):
                self.assert_refused(compact({"alg": alg, "typ": "JWT", "kid": header["kid"]}, claims,
                                            b"\x00" * 64))

    def test_hs256_token_keyed_with_the_public_pem_is_401(self):
        _, (header, claims) = self.issued()
        jwk = next(k for k in self.jwks()["keys"] if k["kid"] == header["kid"])
        pub = jwt.PyJWK(jwk).key
        variants = {
            "pem": pub.public_bytes(serialization.Encoding.PEM,
                                    serialization.PublicFormat.SubjectPublicKeyInfo),
            "der": pub.public_bytes(serialization.Encoding.DER,
                                    serialization.PublicFormat.SubjectPublicKeyInfo),
            "jwk json": json.dumps(jwk).encode(),
        }
        for name, secret in variants.items():
            for alg, digest in (("HS256", hashlib.sha256), ("HS512", hashlib.sha512)):
                with self.subTest(key=name, alg=alg):
                    head = {"alg": alg, "typ": "JWT", "kid": header["kid"]}
                    h = b64url(json.dumps(head, separators=(",", ":")).encode())
                    p = b64url(json.dumps(claims, separators=(",", ":")).encode())
                    sig = hmac.new(secret, f"{h}.{p}".encode(), digest).digest()
                    self.assert_refused(f"{h}.{p}.{b64url(sig)}")

    def test_tokens_with_a_bad_kid_audience_or_time_are_401(self):
        wrong = ec.generate_private_key(ec.SECP256R1())
        _, (header, claims) = self.issued()
        now = int(time.time())
        cases = {
            "unknown kid": ({"kid": "x" * 43}, {}),
            "no kid": ({"kid": None}, {}),
            "node audience": ({}, {"aud": "kiln-node"}),
            "expired": ({}, {"iat": now - 1000, "exp": now - 100}),
            "too long a ttl": ({}, {"exp": now + 3600}),
        }
        for name, (h_over, c_over) in cases.items():
            with self.subTest(name=name):
                c = dict(claims, **c_over)
                headers = dict({"kid": header["kid"]}, **h_over)
                if headers["kid"] is None:
                    del headers["kid"]
                self.assert_refused(jwt.encode(c, wrong, algorithm="ES256", headers=headers))

    def test_a_der_encoded_signature_is_401(self):
        # A valid-looking token whose signature is in DER rather than raw r||s.
        tok, _ = self.issued()
        h, p, s = tok.split(".")
        raw = base64.urlsafe_b64decode(s + "==")
        der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
        self.assert_refused(f"{h}.{p}.{b64url(der)}")


if __name__ == "__main__":
    unittest.main()
