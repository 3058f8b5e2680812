"""Scope rules of docs/openapi.yaml on every route here, and tenant isolation."""
import unittest

from authtest import TENANT_SCOPES, GatewayCase, bearer, jwt_parts

KEY_ROUTES = [("GET", "/v1/api-keys", None),
              ("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]}),
              ("DELETE", "/v1/api-keys/key_whatever", None)]


class ScopeTests(GatewayCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tid, cls.first, cls.full = cls.new_tenant_cls("scoped")

    @classmethod
    def new_tenant_cls(cls, name):
        r = cls.gw.request("POST", "/v1/tenants", {"name": name}, cls.admin)
        assert r.status == 201, r
        b = r.json()
        return b["tenant"]["id"], b["api_key"], bearer(b["api_key"]["key"])

    def key_with(self, scopes):
        return bearer(self.new_key(self.full, scopes)["key"])

    def test_sandbox_read_key_gets_403_on_every_api_keys_route(self):
        h = self.key_with(["sandbox:read"])
        before = self.counts()
        for method, path, body in KEY_ROUTES:
            with self.subTest(method=method, path=path):
                r = self.expect(self.call(method, path, body, h), 403, "forbidden")
                self.assertIn("keys:write", r.json()["error"]["message"])
        self.assertEqual(self.counts(), before)

    def test_keys_write_alone_is_enough_for_api_keys_routes(self):
        h = self.key_with(["keys:write"])
        self.expect(self.call("GET", "/v1/api-keys", headers=h), 200)
        made = self.new_key(h, ["keys:write"])
        self.expect(self.call("DELETE", f"/v1/api-keys/{made['id']}", headers=h), 204)

    def test_admin_only_tenants_route_is_403_for_a_tenant_key_with_every_tenant_scope(self):
        self.assertEqual(self.first["scopes"], TENANT_SCOPES)
        before = self.counts()
        r = self.expect(self.call("POST", "/v1/tenants", {"name": "sneaky"}, self.full), 403,
                        "forbidden")
        self.assertIn("admin", r.json()["error"]["message"])
        # A JWT of the tenant key cannot do it either.
        tok = self.new_token(self.full)
        self.expect(self.call("POST", "/v1/tenants", {"name": "sneaky"}, bearer(tok)), 403,
                    "forbidden")
        self.assertEqual(self.counts(), before)

    def test_admin_jwt_may_create_tenants(self):
        tok = self.new_token(self.admin, scopes=["admin"])
        self.expect(self.call("POST", "/v1/tenants", {"name": "via-token"}, bearer(tok)), 201)

    def test_audit_needs_billing_read(self):
        for scopes in (["sandbox:read", "sandbox:write", "keys:write"], ["sandbox:read"]):
            with self.subTest(scopes=scopes):
                r = self.expect(self.call("GET", "/v1/audit", headers=self.key_with(scopes)), 403,
                                "forbidden")
                self.assertIn("billing:read", r.json()["error"]["message"])
        self.expect(self.call("GET", "/v1/audit", headers=self.key_with(["billing:read"])), 200)
        tok = self.new_token(self.full, scopes=["billing:read"])
        self.expect(self.call("GET", "/v1/audit", headers=bearer(tok)), 200)

    def test_billing_read_key_cannot_manage_keys(self):
        h = self.key_with(["billing:read"])
        self.expect(self.call("GET", "/v1/api-keys", headers=h), 403, "forbidden")

    def test_jwt_asking_for_more_scopes_than_its_key_is_403(self):
        h = self.key_with(["sandbox:read"])
        for scopes in (["keys:write"], ["sandbox:read", "sandbox:write"], ["admin"]):
            with self.subTest(scopes=scopes):
                self.expect(self.call("POST", "/v1/tokens", {"scopes": scopes}, h), 403,
                            "forbidden")
        self.expect(self.call("POST", "/v1/tokens", {"scopes": ["admin"]}, self.full), 403,
                    "forbidden")

    def test_jwt_without_scopes_asked_carries_exactly_its_keys_scopes(self):
        h = self.key_with(["sandbox:read", "billing:read"])
        _, claims = jwt_parts(self.new_token(h))
        self.assertEqual(claims["scope"], "sandbox:read billing:read")

    def test_jwt_is_held_to_its_own_narrower_scopes(self):
        narrow = bearer(self.new_token(self.full, scopes=["sandbox:read"]))
        self.expect(self.call("GET", "/v1/api-keys", headers=narrow), 403, "forbidden")
        self.expect(self.call("GET", "/v1/audit", headers=narrow), 403, "forbidden")
        wide = bearer(self.new_token(self.full, scopes=["keys:write"]))
        self.expect(self.call("GET", "/v1/api-keys", headers=wide), 200)
        empty = bearer(self.new_token(self.full, scopes=[]))
        self.expect(self.call("GET", "/v1/api-keys", headers=empty), 403, "forbidden")

    def test_post_tokens_with_a_jwt_is_403(self):
        tok = bearer(self.new_token(self.full))
        for body in ({}, {"scopes": ["sandbox:read"]}):
            with self.subTest(body=body):
                r = self.expect(self.call("POST", "/v1/tokens", body, tok), 403, "forbidden")
                self.assertIn("API key", r.json()["error"]["message"])

    def test_any_api_key_may_exchange_itself_for_a_token(self):
        h = self.key_with(["sandbox:read"])
        _, claims = jwt_parts(self.new_token(h))
        self.assertEqual(claims["scope"], "sandbox:read")

    def test_a_key_cannot_create_a_key_with_scopes_it_lacks(self):
        h = self.key_with(["keys:write"])
        before = self.counts()
        self.expect(self.call("POST", "/v1/api-keys", {"name": "up", "scopes": ["sandbox:write"]}, h),
                    403, "forbidden")
        self.expect(self.call("POST", "/v1/api-keys", {"name": "up", "scopes": ["admin"]}, self.full),
                    403, "forbidden")
        # Nor through a token of a wider key that was narrowed.
        tok = bearer(self.new_token(self.full, scopes=["keys:write"]))
        self.expect(self.call("POST", "/v1/api-keys", {"name": "up", "scopes": ["billing:read"]}, tok),
                    403, "forbidden")
        self.assertEqual(self.counts(), before)


class IsolationTests(GatewayCase):
    def test_deleting_another_tenants_key_is_404_and_leaves_it_working(self):
        _, _, ha = self.new_tenant("a")
        _, kb, hb = self.new_tenant("b")
        before = self.counts()
        for h in (ha, bearer(self.new_token(ha))):
            r = self.expect(self.call("DELETE", f"/v1/api-keys/{kb['id']}", headers=h), 404,
                            "not_found")
            self.assertNotIn("forbidden", r.data.decode())
        self.assertEqual(self.counts(), before)
        self.assertEqual(self.db.sql(f"SELECT revoked_at IS NULL FROM api_keys WHERE id = '{kb['id']}'"),
                         "t")
        self.expect(self.call("GET", "/v1/api-keys", headers=hb), 200)

    def test_each_tenant_lists_only_its_own_keys(self):
        _, ka, ha = self.new_tenant("a")
        _, kb, hb = self.new_tenant("b")
        a2 = self.new_key(ha, ["sandbox:read"], name="a-second")
        b2 = self.new_key(hb, ["sandbox:read"], name="b-second")
        la = self.expect(self.call("GET", "/v1/api-keys", headers=ha), 200).json()["api_keys"]
        lb = self.expect(self.call("GET", "/v1/api-keys", headers=hb), 200).json()["api_keys"]
        self.assertEqual({k["id"] for k in la}, {ka["id"], a2["id"]})
        self.assertEqual({k["id"] for k in lb}, {kb["id"], b2["id"]})
        # Through a JWT too.
        lbt = self.expect(self.call("GET", "/v1/api-keys", headers=bearer(self.new_token(hb))),
                          200).json()["api_keys"]
        self.assertEqual({k["id"] for k in lbt}, {kb["id"], b2["id"]})

    def test_a_tenants_key_cannot_see_the_operators_keys(self):
        _, ka, ha = self.new_tenant("a")
        la = self.expect(self.call("GET", "/v1/api-keys", headers=ha), 200).json()["api_keys"]
        ops = self.db.sql("SELECT id FROM api_keys WHERE tenant_id = 'tn_operator'")
        self.assertNotIn(ops, [k["id"] for k in la])
        self.expect(self.call("DELETE", f"/v1/api-keys/{ops}", headers=ha), 404, "not_found")


if __name__ == "__main__":
    unittest.main()
