"""Limits that hold per tenant, whatever its keys: the tenant's shared rate and creation buckets
(429 naming the limit, across keys and tokens, no effect on another tenant), and Idempotency-Key
records that expire (the periodic sweep deletes them in bounded batches; a key reused after expiry
is a new request)."""
import os
import subprocess
import time
import unittest

import kiln
from authtest import GatewayCase, bearer, poll

TENANT_SMALL = {"KILN_TENANT_RATE_LIMIT_RPS": "2", "KILN_TENANT_RATE_LIMIT_BURST": "4",
                "KILN_TENANT_CREATE_LIMIT_RPM": "2"}


class TenantRateLimitTests(GatewayCase):
    EXTRA_ENV = TENANT_SMALL
    PER_TEST = True

    def patient(self, method, path, body=None, headers=None):
        """A call retried after each 429's Retry-After (setting up under a small limit)."""
        for _ in range(30):
            r = self.call(method, path, body, headers)
            if r.status != 429:
                return r
            time.sleep(int(r.headers["Retry-After"]))
        self.fail("still 429 after 30 tries")

    def tenant_with_keys(self, n):
        """A tenant and n + 1 credentials of it (its first key, n more keys, a token), with its
        bucket full again afterwards."""
        r = self.expect(self.patient("POST", "/v1/tenants", {"name": "many"}, self.admin), 201)
        tid, first = r.json()["tenant"]["id"], bearer(r.json()["api_key"]["key"])
        creds = [first]
        for i in range(n):
            k = self.expect(self.patient("POST", "/v1/api-keys",
                                         {"name": f"k{i}", "scopes": ["sandbox:read",
                                                                      "sandbox:write"]},
                                         first), 201).json()
            creds.append(bearer(k["key"]))
        tok = self.expect(self.patient("POST", "/v1/tokens", {}, first), 201).json()["token"]
        creds.append(bearer(tok))
        time.sleep(2.5)     # the burst of 4 refills at 2 a second
        return tid, creds

    def test_many_keys_share_the_tenants_rate(self):
        _, creds = self.tenant_with_keys(6)
        statuses, limited = [], []
        for i in range(16):
            r = self.call("GET", "/v1/sandboxes", headers=creds[i % len(creds)])
            statuses.append(r.status)
            if r.status == 429:
                limited.append(r)
        # Each key alone is far under its own (generous) limit; together they pass the tenant's
        # burst of 4 (a refill during the run may add one or two) and are refused.
        self.assertIn(429, statuses, statuses)
        self.assertIn(statuses.index(429), (4, 5, 6), statuses)
        self.assertTrue(all(s == 200 for s in statuses[:statuses.index(429)]), statuses)
        self.assertGreaterEqual(len(limited), 8, statuses)
        for r in limited:
            self.expect(r, 429, "rate_limited")
            self.assertIn("tenant_rate_limit_rps", r.json()["error"]["message"])
            self.assertRegex(r.headers["Retry-After"], r"^[1-9][0-9]*$")
        # Refused keys of the tenant include several distinct ones and the token.
        refused = {i % len(creds) for i, s in enumerate(statuses) if s == 429}
        self.assertGreaterEqual(len(refused), 5, statuses)

    def test_another_tenant_is_not_affected(self):
        _, creds = self.tenant_with_keys(2)
        r = self.expect(self.patient("POST", "/v1/tenants", {"name": "other"}, self.admin), 201)
        other = bearer(r.json()["api_key"]["key"])
        time.sleep(2.5)
        for i in range(12):
            self.call("GET", "/v1/sandboxes", headers=creds[i % len(creds)])
        self.expect(self.call("GET", "/v1/sandboxes", headers=creds[0]), 429, "rate_limited")
        for _ in range(4):
            self.expect(self.call("GET", "/v1/sandboxes", headers=other), 200)

    def test_sandbox_creations_share_the_tenants_creation_bucket(self):
        _, creds = self.tenant_with_keys(3)
        statuses = []
        for i in range(3):
            time.sleep(0.6)     # stay under the request rate: only the creation limit counts
            r = self.call("POST", "/v1/sandboxes", {"memory_mib": 256}, creds[i])
            statuses.append(r.status)
        # Two creations a minute for the whole tenant: the third key's first creation is refused
        # (the first two fail for want of a node, after the limit let them through).
        self.assertNotIn(429, statuses[:2], statuses)
        self.assertEqual(statuses[2], 429, statuses)
        self.assertIn("tenant_create_limit_rpm", r.json()["error"]["message"])


class IdempotencyExpiryTests(GatewayCase):
    EXTRA_ENV = {"KILN_IDEMPOTENCY_TTL_S": "120", "KILN_IDEMPOTENCY_SWEEP_S": "1"}

    def records(self, where):
        return int(self.db.sql(f"SELECT count(*) FROM idempotency WHERE {where}"))

    def age(self, key, seconds):
        self.db.sql(f"UPDATE idempotency SET created_at = now() - interval '{seconds} seconds' "
                    f"WHERE key = '{key}'")

    def create_key(self, h, idem):
        return self.call("POST", "/v1/api-keys", {"name": "idem", "scopes": ["sandbox:read"]},
                         dict(h, **{"Idempotency-Key": idem}))

    def test_the_sweep_removes_expired_records_and_keeps_the_others(self):
        tid, _, h = self.new_tenant()
        self.expect(self.create_key(h, "sweep-old"), 201)
        self.expect(self.create_key(h, "sweep-young"), 201)
        self.age("sweep-old", 200)      # past the 120 s period
        self.age("sweep-young", 60)     # within it
        self.assertTrue(poll(lambda: self.records("key = 'sweep-old'") == 0, 15),
                        "the sweep did not delete the expired record")
        time.sleep(2)                   # two more sweeps
        self.assertEqual(self.records("key = 'sweep-young'"), 1)

    def test_the_sweep_deletes_in_bounded_batches_until_none_is_left(self):
        tid, _, _ = self.new_tenant()
        self.db.sql("INSERT INTO idempotency (tenant_id, key, method, path, body_sha256, status, "
                    "response, created_at) SELECT '%s', 'bulk-' || g, 'POST', '/v1/api-keys', "
                    "'x', 201, '', now() - interval '2 days' FROM generate_series(1, 2500) g" % tid)
        self.assertTrue(poll(lambda: self.records("key LIKE 'bulk-%'") == 0, 30),
                        "expired records left after the sweeps")
        out = self.gw.output()
        self.assertRegex(out, r"idempotency sweep: deleted \d+ expired records")

    def test_a_key_reused_after_expiry_is_a_new_request(self):
        tid, _, h = self.new_tenant()
        first = self.expect(self.create_key(h, "reused"), 201)
        again = self.expect(self.create_key(h, "reused"), 201)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.assertEqual(again.json()["id"], first.json()["id"])
        self.age("reused", 200)
        self.assertTrue(poll(lambda: self.records("key = 'reused'") == 0, 15))
        fresh = self.expect(self.create_key(h, "reused"), 201)
        self.assertIsNone(fresh.headers.get("Idempotent-Replayed"))
        self.assertNotEqual(fresh.json()["id"], first.json()["id"])
        n = self.db.sql(f"SELECT count(*) FROM api_keys WHERE tenant_id = '{tid}' "
                        "AND name = 'idem'")
        self.assertEqual(n, "2")

    def test_a_grants_key_reused_after_expiry_still_grants_once(self):
        # The grant keeps its key for good: the request answers the original grant, said to be a
        # replay, and grants nothing new.
        tid, _, _ = self.new_tenant()
        body = {"tenant_id": tid, "amount_ucr": 1000, "reason": "goodwill"}
        h = dict(self.admin, **{"Idempotency-Key": "grant-once"})
        first = self.expect(self.call("POST", "/v1/billing/grants", body, h), 201)
        self.age("grant-once", 200)
        self.assertTrue(poll(lambda: self.records("key = 'grant-once'") == 0, 15))
        again = self.expect(self.call("POST", "/v1/billing/grants", body, h), 201)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.assertEqual(again.data, first.data)
        n = self.db.sql(f"SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{tid}' "
                        "AND reason = 'goodwill'")
        self.assertEqual(n, "1")

    def test_an_expired_record_not_yet_swept_does_not_count(self):
        # Between two sweeps an expired record still exists: the claim itself ignores it.
        tid, _, h = self.new_tenant()
        first = self.expect(self.create_key(h, "unswept"), 201)
        self.db.sql("BEGIN; UPDATE idempotency SET created_at = now() - interval '200 seconds' "
                    "WHERE key = 'unswept'; COMMIT")
        fresh = self.expect(self.create_key(h, "unswept"), 201)
        self.assertIsNone(fresh.headers.get("Idempotent-Replayed"))
        self.assertNotEqual(fresh.json()["id"], first.json()["id"])


class HelpTests(unittest.TestCase):
    def test_help_lists_the_tenant_limits_and_the_idempotency_period(self):
        out = subprocess.run([os.path.join(kiln.BUILD, "api", "kiln-gateway"), "--help"],
                             check=True, capture_output=True, text=True).stdout
        for name in ("tenant_rate_limit_rps", "tenant_rate_limit_burst", "tenant_create_limit_rpm",
                     "idempotency_ttl_s", "idempotency_sweep_s"):
            self.assertIn(name, out)
        self.assertRegex(out, r"idempotency_ttl_s .*, default 86400\n")


if __name__ == "__main__":
    unittest.main()
