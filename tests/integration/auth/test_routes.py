"""Every route of "Tenants, keys, tokens" and GET /v1/audit through real HTTP: shapes and effects."""
import re
import time
import unittest

import kiln
from authtest import TENANT_SCOPES, GatewayCase, bearer, jwt_parts

KEY_RE = r"^kiln_sk_key_[a-z2-7]{26}_[a-z2-7]{52}$"
TIME_RE = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"


class RouteTests(GatewayCase):
    def test_operator_bootstrap_made_one_admin_key_with_every_scope(self):
        self.assertRegex(self.gw.admin_key, KEY_RE)
        self.assertEqual(self.db.sql("SELECT id, operator FROM tenants WHERE operator"),
                         "tn_operator|t")
        self.assertEqual(self.db.sql("SELECT scopes FROM api_keys WHERE tenant_id = 'tn_operator'"),
                         "sandbox:read sandbox:write billing:read keys:write admin")
        # A second gateway on the same database finds the operator and makes no other key.
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"],
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        self.assertIsNone(gw2.admin_key)
        self.assertEqual(self.db.sql("SELECT count(*) FROM api_keys WHERE tenant_id = 'tn_operator'"),
                         "1")
        self.expect(self.call("GET", "/v1/api-keys", headers=self.admin, gw=gw2), 200)

    def test_post_tenants_returns_the_tenant_and_a_first_key_with_every_tenant_scope(self):
        r = self.expect(self.call("POST", "/v1/tenants", {"name": "Acme Ltd"}, self.admin), 201)
        body = r.json()
        self.assertEqual(set(body), {"tenant", "api_key"})
        t, k = body["tenant"], body["api_key"]
        self.assertEqual(set(t), {"id", "name", "created_at"})
        self.assertRegex(t["id"], r"^tn_[a-z2-7]{26}$")
        self.assertEqual(t["name"], "Acme Ltd")
        self.assertRegex(t["created_at"], TIME_RE)
        self.assertEqual(set(k), {"id", "key", "scopes"})
        self.assertRegex(k["id"], r"^key_[a-z2-7]{26}$")
        self.assertRegex(k["key"], KEY_RE)
        self.assertIn(k["id"], k["key"])
        self.assertEqual(k["scopes"], TENANT_SCOPES)
        # The key works, for its own tenant.
        r = self.expect(self.call("GET", "/v1/api-keys", headers=bearer(k["key"])), 200)
        self.assertEqual([x["id"] for x in r.json()["api_keys"]], [k["id"]])
        # Only a hash of the secret is stored.
        secret = k["key"].rsplit("_", 1)[1]
        stored = self.db.sql(f"SELECT prefix || ' ' || secret_hash FROM api_keys WHERE id = '{k['id']}'")
        self.assertNotIn(secret, stored)
        self.assertTrue(stored.startswith(k["key"][:20] + " "))

    def test_tenant_creation_grants_500_credits_as_a_ledger_transfer(self):
        tid, _, _ = self.new_tenant("granted")
        rows = self.db.sql(
            "SELECT kind, amount_ucr, debit_account, credit_account FROM ledger_transfers "
            f"WHERE tenant_id = '{tid}'").splitlines()
        self.assertEqual(len(rows), 1, rows)
        kind, amount, debit, credit = rows[0].split("|")
        self.assertEqual((kind, amount), ("grant", "500000000"))
        self.assertEqual(debit, "system:issuance")
        self.assertEqual(self.db.sql(f"SELECT kind, tenant_id FROM ledger_accounts WHERE id = '{credit}'"),
                         f"grant|{tid}")
        self.assertTrue(credit.startswith("grant:"))
        # Not a number in a column: the tenants row holds no balance.
        self.assertNotIn("balance", self.db.sql(
            "SELECT string_agg(column_name, ' ') FROM information_schema.columns "
            "WHERE table_name = 'tenants'"))

    def test_post_api_keys_returns_the_key_once_and_get_lists_it_without_the_secret(self):
        _, first, h = self.new_tenant()
        r = self.expect(self.call("POST", "/v1/api-keys",
                                  {"name": "ci", "scopes": ["sandbox:write", "sandbox:read"]}, h), 201)
        k = r.json()
        self.assertTrue({"id", "key", "prefix", "scopes", "created_at"} <= set(k), k)
        self.assertRegex(k["key"], KEY_RE)
        self.assertEqual(k["prefix"], k["key"][:20])
        self.assertEqual(k["scopes"], ["sandbox:read", "sandbox:write"])
        self.assertRegex(k["created_at"], TIME_RE)
        r = self.expect(self.call("GET", "/v1/api-keys", headers=h), 200)
        self.assertNotIn(k["key"].rsplit("_", 1)[1], r.data.decode())
        listing = r.json()["api_keys"]
        self.assertEqual({x["id"] for x in listing}, {first["id"], k["id"]})
        mine = next(x for x in listing if x["id"] == k["id"])
        for field in ("id", "name", "prefix", "scopes", "created_at", "last_used_at", "revoked_at"):
            self.assertIn(field, mine)
        self.assertNotIn("key", mine)
        self.assertEqual((mine["name"], mine["prefix"], mine["scopes"]),
                         ("ci", k["prefix"], ["sandbox:read", "sandbox:write"]))
        self.assertIsNone(mine["last_used_at"])
        self.assertIsNone(mine["revoked_at"])
        # Using the new key sets its last_used_at.
        self.expect(self.call("POST", "/v1/tokens", {}, bearer(k["key"])), 201)
        listing = self.expect(self.call("GET", "/v1/api-keys", headers=h), 200).json()["api_keys"]
        self.assertRegex(next(x for x in listing if x["id"] == k["id"])["last_used_at"], TIME_RE)

    def test_delete_api_key_is_204_marks_it_revoked_and_is_idempotent_in_effect(self):
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["sandbox:read"])
        r = self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=h), 204)
        self.assertEqual(r.data, b"")
        listing = self.expect(self.call("GET", "/v1/api-keys", headers=h), 200).json()["api_keys"]
        self.assertRegex(next(x for x in listing if x["id"] == k["id"])["revoked_at"], TIME_RE)
        revoked = self.db.sql(f"SELECT revoked_at FROM api_keys WHERE id = '{k['id']}'")
        # Deleting again keeps the first revocation time.
        self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=h), 204)
        self.assertEqual(self.db.sql(f"SELECT revoked_at FROM api_keys WHERE id = '{k['id']}'"), revoked)
        self.expect(self.call("DELETE", "/v1/api-keys/key_doesnotexist", headers=h), 404, "not_found")

    def test_post_tokens_issues_an_es256_jwt_with_the_documented_claims(self):
        tid, k, h = self.new_tenant()
        before = int(time.time())
        r = self.expect(self.call("POST", "/v1/tokens", {"ttl_s": 120}, h), 201)
        body = r.json()
        self.assertEqual(set(body), {"token", "expires_at"})
        header, claims = jwt_parts(body["token"])
        self.assertEqual(header["alg"], "ES256")
        self.assertEqual(header["typ"], "JWT")
        jwks = self.call("GET", "/v1/.well-known/jwks.json").json()
        self.assertIn(header["kid"], [key["kid"] for key in jwks["keys"]])
        self.assertEqual(set(claims), {"iss", "aud", "sub", "tid", "scope", "iat", "exp", "jti"})
        self.assertEqual(claims["aud"], "kiln-api")
        self.assertEqual(claims["sub"], k["id"])
        self.assertEqual(claims["tid"], tid)
        self.assertEqual(claims["scope"].split(" "), TENANT_SCOPES)
        self.assertTrue(claims["iss"])
        self.assertRegex(claims["jti"], r"^jti_")
        self.assertGreaterEqual(claims["iat"], before)
        self.assertEqual(claims["exp"] - claims["iat"], 120)
        self.assertEqual(body["expires_at"],
                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims["exp"])))
        # Default lifetime is at most 15 minutes; narrower scopes are honoured.
        _, c2 = jwt_parts(self.new_token(h, scopes=["billing:read"]))
        self.assertLessEqual(c2["exp"] - c2["iat"], 900)
        self.assertEqual(c2["scope"], "billing:read")
        self.assertNotEqual(c2["jti"], claims["jti"])
        # The token authenticates.
        self.expect(self.call("GET", "/v1/api-keys", headers=bearer(body["token"])), 200)

    def test_jwks_needs_no_credential_and_lists_p256_public_keys_only(self):
        r = self.expect(self.call("GET", "/v1/.well-known/jwks.json"), 200)
        self.assertTrue(r.headers["Content-Type"].startswith("application/json"))
        keys = r.json()["keys"]
        self.assertGreaterEqual(len(keys), 1)
        for key in keys:
            self.assertEqual(set(key), {"kty", "crv", "x", "y", "kid", "use", "alg"})
            self.assertEqual((key["kty"], key["crv"], key["alg"], key["use"]),
                             ("EC", "P-256", "ES256", "sig"))
            self.assertEqual(len(key["kid"]), 43)
        # A credential, even a bad one, changes nothing.
        r2 = self.call("GET", "/v1/.well-known/jwks.json", headers=bearer("garbage"))
        self.assertEqual(r2.status, 200)

    def test_get_audit_lists_the_tenants_mutations(self):
        _, k, h = self.new_tenant()
        made = self.new_key(h, ["sandbox:read"])
        e = self.audit(h, 1)[0]
        r = self.expect(self.call("GET", "/v1/audit", headers=h), 200).json()
        self.assertEqual(set(r), {"entries", "next_cursor"})
        self.assertIsNone(r["next_cursor"])
        self.assertEqual(r["entries"], [e])
        self.assertEqual((e["key_id"], e["method"], e["route"], e["object_id"], e["status"]),
                         (k["id"], "POST", "/v1/api-keys", made["id"], 201))
        self.assertRegex(e["created_at"], TIME_RE)
        self.assertRegex(e["request_id"], r"^req_")


if __name__ == "__main__":
    unittest.main()
