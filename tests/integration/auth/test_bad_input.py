"""Bad credentials and bad bodies: the error code of docs/errors.md, and nothing in the database changes."""
import datetime
import glob
import os
import re
import unittest

import kiln
from authtest import TENANT_SCOPES, GatewayCase, bearer


class BadInputTests(GatewayCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        r = cls.gw.request("POST", "/v1/tenants", {"name": "victim"}, cls.admin)
        assert r.status == 201, r
        cls.key = r.json()["api_key"]
        cls.h = bearer(cls.key["key"])

    def refused(self, method, path, body, headers, status, code):
        """Sends one bad request; asserts its status and code and that no table changed."""
        before = self.counts()
        r = self.expect(self.call(method, path, body, headers), status, code)
        self.assertEqual(self.counts(), before, f"{method} {path} {body!r} changed the database")
        return r

    # --- Path parameters -----------------------------------------------------------------

    def test_path_parameters_that_are_not_utf8_are_404_and_change_nothing(self):
        """Every route of the API with a path parameter ({id}, {wid}, {pid}, {port}), read from
        the gateway's route tables, with %FF (or another byte sequence that is not UTF-8) in
        each parameter in turn: 404 not_found with the error model, nothing stored."""
        api = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "api")
        routes = set()
        for src in glob.glob(os.path.join(api, "*.c")):
            with open(src) as f:
                routes.update(re.findall(r'\{ "(GET|POST|PUT|PATCH|DELETE)", "(/v1/[^"]*\{[^"]*)"',
                                         f.read()))
        self.assertGreaterEqual(len(routes), 45, routes)
        valid = {"port": "8080", "pid": "1", "wid": "w_x"}
        full = self.new_key(self.h, TENANT_SCOPES, name="all")
        tenant = bearer(full["key"])
        before = self.counts()  # once around the whole loop: a psql per request is slow
        for method, pattern in sorted(routes):
            params = re.findall(r"\{(\w+)\}", pattern)
            for bad in params:
                for raw in ("%FF", "sb_%C3%28x", "%ED%A0%80"):
                    path = pattern
                    for p in params:
                        path = path.replace("{" + p + "}", raw if p == bad else valid.get(p, "x1"))
                    hdr = dict(self.admin if "/admin/" in pattern or "/tenants/" in pattern
                               else tenant)
                    if method == "POST":
                        hdr["Idempotency-Key"] = f"utf8-{method}-{path}"
                    with self.subTest(method=method, path=path):
                        self.expect(self.call(method, path, {} if method not in ("GET", "DELETE")
                                              else None, hdr), 404, "not_found")
        self.assertEqual(self.counts(), before, "a request with a parameter that is not UTF-8 "
                         "changed the database")

    def test_parameters_that_are_not_utf8_take_the_rate_limits_tokens(self):
        """Such a request is audited (a row per mutating request): it passes the rate limits
        first, so a tenant cannot write audit rows past them."""
        gw = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"],
                          {"KILN_RATE_LIMIT_RPS": "1", "KILN_RATE_LIMIT_BURST": "2"},
                          master_key=self.gw.master_key)
        self.addCleanup(gw.cleanup)
        statuses = [gw.request("DELETE", "/v1/api-keys/%FF", None, self.h).status
                    for _ in range(8)]
        self.assertEqual(statuses[0], 404, statuses)
        self.assertIn(429, statuses)

    # --- Authorization -------------------------------------------------------------------

    def test_missing_authorization_is_401_with_www_authenticate(self):
        for method, path, body in (("GET", "/v1/api-keys", None),
                                   ("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]}),
                                   ("DELETE", f"/v1/api-keys/{self.key['id']}", None),
                                   ("POST", "/v1/tokens", {}),
                                   ("POST", "/v1/tenants", {"name": "x"}),
                                   ("GET", "/v1/audit", None)):
            with self.subTest(method=method, path=path):
                r = self.refused(method, path, body, {}, 401, "unauthenticated")
                self.assertEqual(r.headers["WWW-Authenticate"], "Bearer")

    def test_malformed_authorization_headers_are_401(self):
        k = self.key["key"]
        key_id = self.key["id"]
        other_secret = "a" * 52
        bad = {
            "empty": "",
            "scheme only": "Bearer",
            "scheme and space": "Bearer ",
            "basic scheme": "Basic " + k,
            "no scheme": k,
            "two spaces": "Bearer  " + k,
            "trailing space": "Bearer " + k + " ",
            "tab": "Bearer\t" + k,
            "key one char short": "Bearer " + k[:-1],
            "key one char long": "Bearer " + k + "a",
            "key in upper case": "Bearer " + k.upper(),
            "wrong secret": f"Bearer kiln_sk_{key_id}_{other_secret}",
            "unknown key id": "Bearer kiln_sk_key_" + "b" * 26 + "_" + "c" * 52,
            "two parts": "Bearer abc.def",
            "garbage jwt": "Bearer abc.def.ghi",
            "four parts": "Bearer a.b.c.d",
            "non-ascii": "Bearer kiln_sk_\u00e9t\u00e9",
        }
        for name, value in bad.items():
            with self.subTest(name=name):
                hdr = {"Authorization": value.encode("utf-8").decode("latin-1")}
                self.refused("GET", "/v1/api-keys", None, hdr, 401, "unauthenticated")
        # And for a mutating route, where nothing may change.
        self.refused("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]},
                     {"Authorization": "Bearer " + k[:-1] + ("a" if k[-1] != "a" else "b")},
                     401, "unauthenticated")

    def test_oversized_authorization_headers_are_401(self):
        for n in (4097, 8000):
            with self.subTest(n=n):
                self.refused("GET", "/v1/api-keys", None, bearer("a" * n), 401, "unauthenticated")
                self.refused("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]},
                             bearer("x." * (n // 2) + "y"), 401, "unauthenticated")
        # A long token-shaped credential is refused before anything parses it.
        self.refused("GET", "/v1/api-keys", None, bearer("e" * 3000 + "." + "e" * 3000 + ".e"), 401,
                     "unauthenticated")

    def test_error_messages_never_echo_the_credential(self):
        wrong = f"kiln_sk_{self.key['id']}_" + "q" * 52
        r = self.refused("GET", "/v1/api-keys", None, bearer(wrong), 401, "unauthenticated")
        self.assertNotIn("q" * 52, r.data.decode())

    # --- bodies --------------------------------------------------------------------------

    def test_api_key_bodies_with_unknown_fields_or_wrong_types_are_400(self):
        bodies = {
            "unknown field": {"name": "x", "scopes": ["sandbox:read"], "admin": True},
            "name a number": {"name": 7, "scopes": ["sandbox:read"]},
            "name null": {"name": None, "scopes": ["sandbox:read"]},
            "scopes a string": {"name": "x", "scopes": "sandbox:read"},
            "scopes of numbers": {"name": "x", "scopes": [1]},
            "scopes of objects": {"name": "x", "scopes": [{"scope": "sandbox:read"}]},
            "expires_at a number": {"name": "x", "scopes": ["sandbox:read"], "expires_at": 1},
            "missing name": {"scopes": ["sandbox:read"]},
            "missing scopes": {"name": "x"},
            "an array": [{"name": "x", "scopes": ["sandbox:read"]}],
            "not json": b"{name: x}",
            "truncated json": b'{"name": "x", "scopes": ["sandbox:read"]',
        }
        for name, body in bodies.items():
            with self.subTest(name=name):
                self.refused("POST", "/v1/api-keys", body, self.h, 400, "bad_request")

    def test_api_key_values_out_of_range_are_422(self):
        past = (datetime.datetime.now(datetime.timezone.utc)
                - datetime.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
        bodies = {
            "over-long name": {"name": "n" * 101, "scopes": ["sandbox:read"]},
            "empty name": {"name": "", "scopes": ["sandbox:read"]},
            "control character in name": {"name": "a\nb", "scopes": ["sandbox:read"]},
            "duplicate scopes": {"name": "x", "scopes": ["sandbox:read", "sandbox:read"]},
            "unknown scope": {"name": "x", "scopes": ["sandbox:delete"]},
            "scope in upper case": {"name": "x", "scopes": ["SANDBOX:READ"]},
            "empty scopes": {"name": "x", "scopes": []},
            "expires_at in the past": {"name": "x", "scopes": ["sandbox:read"], "expires_at": past},
            "expires_at not a time": {"name": "x", "scopes": ["sandbox:read"], "expires_at": "tomorrow"},
            "expires_at without a zone": {"name": "x", "scopes": ["sandbox:read"],
                                          "expires_at": "2099-01-01T00:00:00"},
            "expires_at impossible date": {"name": "x", "scopes": ["sandbox:read"],
                                           "expires_at": "2099-02-31T00:00:00Z"},
        }
        for name, body in bodies.items():
            with self.subTest(name=name):
                r = self.refused("POST", "/v1/api-keys", body, self.h, 422, "invalid")
                field = "name" if "name" in name else ("expires_at" if "expires" in name else "scope")
                self.assertIn(field, r.json()["error"]["message"])
        # The limit itself is fine.
        self.new_key(self.h, ["sandbox:read"], name="n" * 100)

    def test_unknown_scope_message_names_the_scope(self):
        r = self.refused("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read", "root"]},
                         self.h, 422, "invalid")
        self.assertIn("root", r.json()["error"]["message"])

    def test_token_bodies_with_bad_ttl_or_scopes_are_refused(self):
        cases = [
            ({"ttl_s": 0}, 422, "invalid"),
            ({"ttl_s": 901}, 422, "invalid"),
            ({"ttl_s": -5}, 422, "invalid"),
            ({"ttl_s": "60"}, 400, "bad_request"),
            ({"ttl_s": 60.5}, 400, "bad_request"),
            ({"ttl_s": True}, 400, "bad_request"),
            ({"scopes": "sandbox:read"}, 400, "bad_request"),
            ({"scopes": ["sandbox:nope"]}, 422, "invalid"),
            ({"scopes": ["sandbox:read", "sandbox:read"]}, 422, "invalid"),
            ({"audience": "kiln-node"}, 400, "bad_request"),
            (b"[]", 400, "bad_request"),
        ]
        for body, status, code in cases:
            with self.subTest(body=body):
                r = self.refused("POST", "/v1/tokens", body, self.h, status, code)
                self.assertNotIn("token", r.json())
        for ttl in (1, 900):
            self.new_token(self.h, ttl_s=ttl)

    def test_tenant_bodies_are_validated(self):
        cases = [
            ({"name": "n" * 101}, 422, "invalid"),
            ({"name": ""}, 422, "invalid"),
            ({"name": 5}, 400, "bad_request"),
            ({}, 400, "bad_request"),
            ({"name": "x", "plan": "enterprise"}, 400, "bad_request"),
            (b"{", 400, "bad_request"),
        ]
        for body, status, code in cases:
            with self.subTest(body=body):
                self.refused("POST", "/v1/tenants", body, self.admin, status, code)

    def test_audit_query_out_of_range_is_422(self):
        for q in ("limit=0", "limit=501", "limit=x", "cursor=abc", "cursor=-1", "cursor="):
            with self.subTest(q=q):
                self.refused("GET", "/v1/audit?" + q, None, self.h, 422, "invalid")


if __name__ == "__main__":
    unittest.main()
