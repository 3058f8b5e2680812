"""Billing through the public API with a real kiln-meter billing cgroups (the host's, or a fixture
tree's: KILN_TEST_CGROUPS, metertest.py).

A sandbox that runs T seconds is charged exactly its price for the time it ran (which is T within
a second); the ledger, Redis and GET /v1/billing/balance agree after a flush; grants need an admin
and an Idempotency-Key and replay to the same grant; the ledger pages with a cursor; a grant's
expiry is a transfer; usage series and daily totals add up to the ledger; a tenant past zero is
billed into debt, shown as a negative balance, refused new sandboxes (402) until a grant pays it."""
import math
import os
import time
import unittest

import kiln
import metertest as mt


class BillingTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        mt.check_cgroups()
        cls.env = kiln.services_env()
        cls.redis = cls.env["KILN_REDIS_URL"]
        cls.db = kiln.fresh_database()
        cls.gw = kiln.Gateway(cls.db.url, cls.redis)
        cls.admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        cls.node = "tm" + os.urandom(4).hex()
        mt.add_node(cls.db, cls.node)
        cls.meter = mt.Meter(cls.db.url, cls.redis, cls.node)
        cls.vms = []

    @classmethod
    def tearDownClass(cls):
        cls.meter.cleanup()
        for vm in cls.vms:
            vm.destroy()
        cls.gw.cleanup()
        cls.db.drop()

    def tenant(self):
        r = self.gw.request("POST", "/v1/tenants", {"name": "acme"}, self.admin)
        self.assertEqual(r.status, 201, r)
        return r.json()["tenant"]["id"], {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    def run_sandbox(self, tenant, seconds, busy_loops=0):
        """A sandbox row and its cgroup for `seconds` of wall time; returns (id, wall ns)."""
        sb = mt.add_sandbox(self.db, tenant, self.node)
        vm = mt.FakeVM(self.node, sb, busy_loops)
        self.vms.append(vm)
        t0 = time.time()
        time.sleep(seconds)
        self.db.sql(f"UPDATE sandboxes SET state = 'stopped', state_changed_at = now()"
                    f" WHERE id = '{sb}'")
        wall = time.time() - t0
        done = mt.wait_for(lambda: (mt.billed(self.db, sb) or (0, 0, 0, ""))[3] == "none", 20)
        self.assertTrue(done, self.meter.output()[-2000:])
        return sb, vm, wall

    def test_sandbox_running_t_seconds_is_charged_exactly_its_price(self):
        tenant, _ = self.tenant()
        sb, vm, wall = self.run_sandbox(tenant, 6, busy_loops=300000)
        start = mt.epoch_ns(self.db, f"(SELECT created_at FROM sandboxes WHERE id = '{sb}')")
        last_t, cpu_ns, rem, _ = mt.billed(self.db, sb)
        run_ns = last_t - start
        self.assertLess(abs(run_ns / 1e9 - wall), 1.0)
        # All the CPU the group used was billed, at the measured amount.
        self.assertGreater(cpu_ns, 10_000_000)
        self.assertEqual(cpu_ns, vm.cpu_ns())
        fine = mt.expected_fine(256, 1, run_ns, cpu_ns)
        self.assertEqual(mt.ledger_used(self.db, tenant), fine // mt.UNIT)
        self.assertEqual(rem, fine % mt.UNIT)

    def test_ledger_redis_and_balance_route_agree_after_a_flush(self):
        tenant, key = self.tenant()
        self.run_sandbox(tenant, 3)
        used = mt.ledger_used(self.db, tenant)
        self.assertGreater(used, 0)
        ledger = mt.ledger_balance(self.db, tenant)
        self.assertEqual(ledger, 500_000_000 - used)
        self.assertEqual(mt.redis_balance(self.redis, tenant), ledger)
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual(b, {"balance_ucr": ledger, "granted_ucr": 500_000_000, "used_ucr": used,
                             "burn_rate_ucr_s": 0, "debt_ucr": 0, "debt_since": None,
                             "snapshots_delete_at": None})

    def test_balance_shows_the_live_charges_and_burn_rate_while_running(self):
        tenant, key = self.tenant()
        sb = mt.add_sandbox(self.db, tenant, self.node)
        self.vms.append(mt.FakeVM(self.node, sb))
        b = mt.wait_for(lambda: (lambda r: r if r["burn_rate_ucr_s"] else None)(
            self.gw.request("GET", "/v1/billing/balance", headers=key).json()), 10)
        self.assertIsNotNone(b)
        # 257 µcr/s of allocation, plus the little CPU the idle process uses at 1000 µcr/CPU-s.
        self.assertTrue(257 <= b["burn_rate_ucr_s"] <= 300, b)
        self.assertEqual(b["balance_ucr"] + b["used_ucr"], b["granted_ucr"])
        self.db.sql(f"UPDATE sandboxes SET state = 'stopped', state_changed_at = now() WHERE id = '{sb}'")

    def test_usage_series_and_daily_totals_add_up_to_the_ledger(self):
        tenant, key = self.tenant()
        sb, _, _ = self.run_sandbox(tenant, 4)
        used = mt.ledger_used(self.db, tenant)
        # The series ends before the current second (to defaults to now, exclusive): the last
        # point, of the second the sandbox stopped in, shows once that second is over.
        time.sleep(math.ceil(time.time()) - time.time() + 0.05)
        pts = self.gw.request("GET", f"/v1/sandboxes/{sb}/usage", headers=key).json()["points"]
        self.assertEqual(sum(p["ucr"] for p in pts), used)
        self.assertTrue(all(p["t"].endswith("Z") for p in pts))
        wide = self.gw.request("GET", f"/v1/sandboxes/{sb}/usage?step=1h", headers=key).json()
        self.assertEqual(len(wide["points"]), 1 if pts[0]["t"][:13] == pts[-1]["t"][:13] else 2)
        self.assertEqual(sum(p["ucr"] for p in wide["points"]), used)
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}/usage?from=2020-01-01T00:00:00Z"
                                   "&to=2020-01-02T00:00:00Z&step=1s", headers=key)
        self.assertEqual(r.status, 422, r)
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{sb}/usage?step=1d",
                                         headers=key).status, 422)
        totals = self.gw.request("GET", "/v1/usage", headers=key).json()
        self.assertEqual(totals["next_cursor"], None)
        self.assertEqual([t["sandbox_id"] for t in totals["totals"]], [sb])
        self.assertEqual(sum(t["ucr"] for t in totals["totals"]), used)
        self.assertGreater(totals["totals"][0]["mem_byte_s"], 256 * mt.MiB * 3)
        # Another tenant's sandbox is not found.
        _, other = self.tenant()
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{sb}/usage", headers=other).status, 404)

    def test_grants_need_admin_and_an_idempotency_key_and_replay_to_the_same_grant(self):
        tenant, key = self.tenant()
        body = {"tenant_id": tenant, "amount_ucr": 2_000_000, "reason": "top-up"}
        self.assertEqual(self.gw.request("POST", "/v1/billing/grants", body, key).status, 403)
        r = self.gw.request("POST", "/v1/billing/grants", body, self.admin)
        self.assertEqual((r.status, r.json()["error"]["code"]), (400, "bad_request"))
        idem = dict(self.admin, **{"Idempotency-Key": "grant-" + os.urandom(4).hex()})
        r1 = self.gw.request("POST", "/v1/billing/grants", body, idem)
        self.assertEqual(r1.status, 201, r1)
        g = r1.json()
        self.assertTrue(g["id"].startswith("tx_"))
        self.assertEqual((g["tenant_id"], g["amount_ucr"], g["expires_at"], g["reason"]),
                         (tenant, 2_000_000, None, "top-up"))
        r2 = self.gw.request("POST", "/v1/billing/grants", body, idem)
        self.assertEqual((r2.status, r2.json()), (201, g))
        self.assertEqual(r2.headers.get("Idempotent-Replayed"), "true")
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual(b["granted_ucr"], 502_000_000)
        self.assertEqual(mt.redis_balance(self.redis, tenant), 502_000_000)
        bad = [({"tenant_id": "tn_nobody", "amount_ucr": 1, "reason": "x"}, 404),
               ({"tenant_id": tenant, "amount_ucr": 0, "reason": "x"}, 422),
               ({"tenant_id": tenant, "amount_ucr": 1, "reason": ""}, 422),
               ({"tenant_id": tenant, "amount_ucr": 1, "reason": "x",
                 "expires_at": "2001-01-01T00:00:00Z"}, 422),
               ({"tenant_id": tenant, "amount_ucr": "1", "reason": "x"}, 400),
               ({"tenant_id": tenant, "amount_ucr": 1, "reason": "x", "extra": 1}, 400)]
        for i, (body, want) in enumerate(bad):
            h = dict(self.admin, **{"Idempotency-Key": f"bad-{i}-" + os.urandom(4).hex()})
            self.assertEqual(self.gw.request("POST", "/v1/billing/grants", body, h).status, want, body)

    def test_ledger_lists_newest_first_with_a_cursor(self):
        tenant, key = self.tenant()
        ids = []
        for i in range(5):
            h = dict(self.admin, **{"Idempotency-Key": f"page-{i}-" + os.urandom(4).hex()})
            r = self.gw.request("POST", "/v1/billing/grants",
                                {"tenant_id": tenant, "amount_ucr": i + 1, "reason": "page"}, h)
            ids.append(r.json()["id"])
        seen, cursor = [], None
        while True:
            q = "/v1/billing/ledger?limit=2" + (f"&cursor={cursor}" if cursor else "")
            page = self.gw.request("GET", q, headers=key).json()
            self.assertLessEqual(len(page["entries"]), 2)
            seen += page["entries"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        self.assertEqual([e["id"] for e in seen[:5]], ids[::-1])
        self.assertEqual([e["amount_ucr"] for e in seen], [5, 4, 3, 2, 1, 500_000_000])
        self.assertTrue(all(e["kind"] == "grant" for e in seen))
        self.assertEqual(self.gw.request("GET", "/v1/billing/ledger?cursor=abc", headers=key).status, 422)

    def test_usage_entries_name_the_sandbox_and_period(self):
        tenant, key = self.tenant()
        sb, _, _ = self.run_sandbox(tenant, 3)
        entries = self.gw.request("GET", "/v1/billing/ledger?limit=100", headers=key).json()["entries"]
        usage = [e for e in entries if e["kind"] == "usage"]
        self.assertTrue(usage)
        self.assertTrue(all(e["sandbox_id"] == sb and e["amount_ucr"] < 0 for e in usage))
        self.assertTrue(all(e["period"]["start"] <= e["period"]["end"] for e in usage))
        self.assertEqual(-sum(e["amount_ucr"] for e in usage), mt.ledger_used(self.db, tenant))

    def test_expiry_of_a_grant_is_a_transfer(self):
        tenant, key = self.tenant()
        exp = self.db.sql("SELECT rfc3339(now() + interval '3 seconds')")
        h = dict(self.admin, **{"Idempotency-Key": "exp-" + os.urandom(4).hex()})
        r = self.gw.request("POST", "/v1/billing/grants",
                            {"tenant_id": tenant, "amount_ucr": 777, "reason": "trial",
                             "expires_at": exp}, h)
        self.assertEqual((r.status, r.json()["expires_at"]), (201, exp))

        def expiry():
            e = self.gw.request("GET", "/v1/billing/ledger", headers=key).json()["entries"]
            return [x for x in e if x["kind"] == "expiry"]
        got = mt.wait_for(expiry, 20)
        self.assertEqual([x["amount_ucr"] for x in got], [-777])
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["granted_ucr"], b["balance_ucr"]), (500_000_000, 500_000_000))
        # An expiry taken back (a window from before it flushed after it ran, which the grant then
        # pays: migrations/0047) adds to the balance and shows as a credit.
        acct = self.db.sql(f"SELECT id FROM ledger_accounts WHERE tenant_id = '{tenant}'"
                           " AND expires_at IS NOT NULL")
        self.db.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,"
                    f" amount_ucr, tenant_id, reason) VALUES ('tx_rev_{tenant}',"
                    f" 'test-reversal:{tenant}', 'expiry_reversal', 'system:expired', '{acct}', 300,"
                    f" '{tenant}', 'test')")
        e = self.gw.request("GET", "/v1/billing/ledger", headers=key).json()["entries"]
        self.assertEqual([(x["kind"], x["amount_ucr"]) for x in e if x["kind"].startswith("expiry")],
                         [("expiry_reversal", 300), ("expiry", -777)])
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["granted_ucr"], b["balance_ucr"]), (500_000_300, 500_000_300))

    def test_a_tenant_in_debt_is_billed_shows_a_negative_balance_and_gets_402_on_create(self):
        tenant, key = self.tenant()
        # Leave the tenant 1000 µcr: the rest of its free tier expires.
        grant = self.db.sql(f"SELECT id FROM ledger_accounts WHERE tenant_id = '{tenant}'"
                            " AND kind = 'grant'")
        self.db.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,"
                    f" amount_ucr, tenant_id, reason) VALUES ('tx_test_{tenant}',"
                    f" 'test-expiry:{tenant}', 'expiry', '{grant}', 'system:expired', 499999000,"
                    f" '{tenant}', 'test')")
        mt.redis_cli(self.redis, "DEL", "kiln:bal:" + tenant)
        # 257 µcr/s: zero within 4 s; this meter has no master key, so nothing is paused and every
        # second it runs is charged, into debt.
        sb, vm, wall = self.run_sandbox(tenant, 8)
        used = mt.ledger_used(self.db, tenant)
        self.assertGreaterEqual(used, 257 * 7, "the time after zero was not billed")
        ledger = mt.ledger_balance(self.db, tenant)
        self.assertEqual(ledger, 1000 - used)
        self.assertLess(ledger, -257 * 3)
        self.assertIn("no master key, so the meter cannot pause it", self.meter.output())
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["balance_ucr"], b["debt_ucr"]), (ledger, -ledger))
        self.assertTrue(b["debt_since"].endswith("Z"), b)
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, key)
        self.assertEqual((r.status, r.json()["error"]["code"]), (402, "insufficient_credits"), r)
        # A grant pays the debt first: the balance is credits - charges, and the debt is cleared.
        h = dict(self.admin, **{"Idempotency-Key": "debt-" + os.urandom(4).hex()})
        r = self.gw.request("POST", "/v1/billing/grants",
                            {"tenant_id": tenant, "amount_ucr": 100_000, "reason": "top-up"}, h)
        self.assertEqual(r.status, 201, r)
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["balance_ucr"], b["debt_ucr"], b["debt_since"]),
                         (100_000 + ledger, 0, None))

    def test_metrics_show_the_meter_lag_and_missed_ticks(self):
        text = mt.wait_for(lambda: (lambda t: t if f'kiln_meter_lag_seconds{{node="{self.node}"}}' in t
                                    else None)(self.gw.request("GET", "/metrics").data.decode()), 15)
        self.assertIsNotNone(text)
        self.assertIn(f'kiln_meter_ticks_missed_total{{node="{self.node}"}}', text)


if __name__ == "__main__":
    unittest.main()
