"""Idempotency-Key on mutating POSTs: a replay returns the first response; another body is 422."""
import unittest

from authtest import GatewayCase, bearer, poll


class IdempotencyTests(GatewayCase):
    def keys_of(self, tid):
        return int(self.db.sql(f"SELECT count(*) FROM api_keys WHERE tenant_id = '{tid}'"))

    def test_replay_of_post_api_keys_returns_the_same_response_and_makes_one_key(self):
        tid, _, h = self.new_tenant()
        hi = dict(h, **{"Idempotency-Key": "create-ci-key-1"})
        body = {"name": "ci", "scopes": ["sandbox:read"]}
        first = self.expect(self.call("POST", "/v1/api-keys", body, hi), 201)
        self.assertNotIn("Idempotent-Replayed", first.headers)
        for _ in range(2):
            again = self.expect(self.call("POST", "/v1/api-keys", body, hi), 201)
            self.assertEqual(again.data, first.data)
            self.assertEqual(again.headers["Idempotent-Replayed"], "true")
            self.assertTrue(again.headers["Content-Type"].startswith("application/json"))
        self.assertEqual(self.keys_of(tid), 2)      # the first key and this one
        # The replayed key is the one that was made, and it works.
        self.expect(self.call("GET", "/v1/api-keys", headers=bearer(first.json()["key"])), 403,
                    "forbidden")

    def test_same_key_with_a_different_body_is_422_and_changes_nothing(self):
        tid, _, h = self.new_tenant()
        hi = dict(h, **{"Idempotency-Key": "k-422"})
        self.expect(self.call("POST", "/v1/api-keys", {"name": "a", "scopes": ["sandbox:read"]}, hi), 201)
        before = self.counts()
        for body in ({"name": "b", "scopes": ["sandbox:read"]},
                     {"name": "a", "scopes": ["sandbox:read", "billing:read"]}):
            with self.subTest(body=body):
                r = self.expect(self.call("POST", "/v1/api-keys", body, hi), 422, "invalid")
                self.assertIn("Idempotency-Key", r.json()["error"]["message"])
        # The same key on another route is a different request too.
        self.expect(self.call("POST", "/v1/tokens", {}, hi), 422, "invalid")
        self.assertEqual(self.counts(), before)
        self.assertEqual(self.keys_of(tid), 2)

    def test_keys_are_per_tenant(self):
        tid_a, _, ha = self.new_tenant("a")
        tid_b, _, hb = self.new_tenant("b")
        body = {"name": "shared-name", "scopes": ["sandbox:read"]}
        ra = self.expect(self.call("POST", "/v1/api-keys", body, dict(ha, **{"Idempotency-Key": "same"})), 201)
        rb = self.expect(self.call("POST", "/v1/api-keys", body, dict(hb, **{"Idempotency-Key": "same"})), 201)
        self.assertNotIn("Idempotent-Replayed", rb.headers)
        self.assertNotEqual(ra.json()["id"], rb.json()["id"])
        self.assertEqual((self.keys_of(tid_a), self.keys_of(tid_b)), (2, 2))

    def test_replay_of_post_tenants_creates_one_tenant_and_one_grant(self):
        before = int(self.db.sql("SELECT count(*) FROM tenants"))
        hi = dict(self.admin, **{"Idempotency-Key": "signup-42"})
        first = self.expect(self.call("POST", "/v1/tenants", {"name": "once"}, hi), 201)
        again = self.expect(self.call("POST", "/v1/tenants", {"name": "once"}, hi), 201)
        self.assertEqual(again.data, first.data)
        self.assertEqual(again.headers["Idempotent-Replayed"], "true")
        self.assertEqual(int(self.db.sql("SELECT count(*) FROM tenants")), before + 1)
        tid = first.json()["tenant"]["id"]
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{tid}'"), "1")

    def test_replay_of_an_error_returns_the_same_error(self):
        _, _, h = self.new_tenant()
        hi = dict(h, **{"Idempotency-Key": "bad-one"})
        body = {"name": "x", "scopes": ["sandbox:nope"]}
        first = self.expect(self.call("POST", "/v1/api-keys", body, hi), 422, "invalid")
        again = self.expect(self.call("POST", "/v1/api-keys", body, hi), 422)
        self.assertEqual(again.data, first.data)
        self.assertEqual(again.headers["Idempotent-Replayed"], "true")

    def test_replay_through_a_jwt_of_the_same_tenant(self):
        tid, _, h = self.new_tenant()
        tok = bearer(self.new_token(h))
        body = {"name": "via-jwt", "scopes": ["sandbox:read"]}
        first = self.expect(self.call("POST", "/v1/api-keys", body, dict(h, **{"Idempotency-Key": "j"})), 201)
        again = self.expect(self.call("POST", "/v1/api-keys", body, dict(tok, **{"Idempotency-Key": "j"})), 201)
        self.assertEqual(again.data, first.data)
        self.assertEqual(self.keys_of(tid), 2)

    def test_an_immediate_retry_gets_the_first_response_not_a_conflict(self):
        _, _, h = self.new_tenant()
        for i in range(40):
            hi = dict(h, **{"Idempotency-Key": f"quick-{i}"})
            first = self.expect(self.call("POST", "/v1/tokens", {"ttl_s": 60}, hi), 201)
            again = self.expect(self.call("POST", "/v1/tokens", {"ttl_s": 60}, hi), 201)
            self.assertEqual(again.data, first.data)

    def test_idempotency_key_longer_than_255_is_400(self):
        _, _, h = self.new_tenant()
        before = self.counts()
        self.expect(self.call("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]},
                              dict(h, **{"Idempotency-Key": "k" * 256})), 400, "bad_request")
        self.assertEqual(self.counts(), before)

    def test_the_stored_response_does_not_hold_a_new_key_in_clear(self):
        _, _, h = self.new_tenant()
        r = self.expect(self.call("POST", "/v1/api-keys", {"name": "s", "scopes": ["sandbox:read"]},
                                  dict(h, **{"Idempotency-Key": "secret-check"})), 201)
        secret = r.json()["key"].rsplit("_", 1)[1]
        stored = self.db.sql("SELECT string_agg(coalesce(response, ''), ' ') FROM idempotency")
        self.assertTrue(stored)
        self.assertNotIn(secret, stored)
        t = self.expect(self.call("POST", "/v1/tenants", {"name": "s"},
                                  dict(self.admin, **{"Idempotency-Key": "secret-check"})), 201)
        secret = t.json()["api_key"]["key"].rsplit("_", 1)[1]
        stored = self.db.sql("SELECT string_agg(coalesce(response, ''), ' ') FROM idempotency")
        self.assertNotIn(secret, stored)

    def expire_idempotency_record(self, key):
        """Moves the gateway's record of `key` past idempotency_ttl_s (24 h), as if a day went by."""
        n = self.db.sql("WITH x AS (UPDATE idempotency SET created_at = now() - interval '25 hours' "
                        f"WHERE key = '{key}' RETURNING 1) SELECT count(*) FROM x")
        self.assertEqual(n, "1")

    def grants_of(self, tid):
        return self.db.sql("SELECT count(*) || ':' || coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
                           f"WHERE tenant_id = '{tid}' AND kind = 'grant'")

    def test_grant_replayed_after_the_idempotency_record_expired_answers_the_original_grant(self):
        tid, _, _ = self.new_tenant()
        key = "grant-" + tid
        hi = dict(self.admin, **{"Idempotency-Key": key})
        body = {"tenant_id": tid, "amount_ucr": 1_000_000, "reason": "support"}
        before = self.grants_of(tid)
        first = self.expect(self.call("POST", "/v1/billing/grants", body, hi), 201)
        self.assertNotIn("Idempotent-Replayed", first.headers)
        self.expire_idempotency_record(key)
        # A day later the same request: the grant that was made, said to be a replay; no credit.
        again = self.expect(self.call("POST", "/v1/billing/grants", body, hi), 201)
        self.assertEqual(again.data, first.data)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.expire_idempotency_record(key)
        # Another request under that key is refused as it is within the day, and credits nothing.
        for other in (dict(body, amount_ucr=2_000_000), dict(body, reason="other")):
            with self.subTest(body=other):
                r = self.expect(self.call("POST", "/v1/billing/grants", other, hi), 422, "invalid")
                self.assertIn("Idempotency-Key", r.json()["error"]["message"])
                self.db.sql(f"DELETE FROM idempotency WHERE key = '{key}'")
        n, total = (int(x) for x in before.split(":"))
        self.assertEqual(self.grants_of(tid), f"{n + 1}:{total + 1_000_000}")

    def test_grant_replayed_after_it_expired_still_answers_the_grant(self):
        tid, _, _ = self.new_tenant()
        key = "grant-exp-" + tid
        hi = dict(self.admin, **{"Idempotency-Key": key})
        soon = self.db.sql("SELECT to_char((now() + interval '2 seconds') AT TIME ZONE 'UTC', "
                           "'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')")
        body = {"tenant_id": tid, "amount_ucr": 3_000_000, "expires_at": soon, "reason": "trial"}
        first = self.expect(self.call("POST", "/v1/billing/grants", body, hi), 201)
        poll(lambda: self.db.sql(f"SELECT now() > '{soon}'::timestamptz") == "t", 10)
        self.expire_idempotency_record(key)
        # Its expires_at is past now, but it is the grant that was made: not a 422.
        again = self.expect(self.call("POST", "/v1/billing/grants", body, hi), 201)
        self.assertEqual(again.data, first.data)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{tid}' "
                                     "AND kind = 'grant' AND amount_ucr = 3000000"), "1")


if __name__ == "__main__":
    unittest.main()
