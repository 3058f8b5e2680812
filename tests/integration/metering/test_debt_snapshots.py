"""The operator's setting snapshot_delete_after_zero_days through a real gateway on Postgres:
a tenant whose ledger balance has been at or below zero that long has its paused sandboxes (and
their snapshots) deleted through the normal delete path, with notice: GET /v1/billing/balance
shows debt_since and snapshots_delete_at, an audit event is written when the period starts and
when a sandbox is deleted; a tenant at zero for less long, or whose grant took it above zero, is
left as it is; running sandboxes are never deleted by it."""
import os
import subprocess
import unittest

import kiln
import metertest as mt

DAYS = 3


class DebtSnapshotTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.env = kiln.services_env()
        cls.db = kiln.fresh_database()
        # The gateway's periodic work runs every second here.
        cls.gw = kiln.Gateway(cls.db.url, cls.env["KILN_REDIS_URL"],
                              extra_env={"KILN_SNAPSHOT_DELETE_AFTER_ZERO_DAYS": str(DAYS),
                                         "KILN_IDEMPOTENCY_SWEEP_S": "1"})
        cls.admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        cls.node = "td" + os.urandom(4).hex()
        mt.add_node(cls.db, cls.node)
        cls.db.sql(f"UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = '{cls.node}'")

    @classmethod
    def tearDownClass(cls):
        cls.gw.cleanup()
        cls.db.drop()

    def tenant_at_zero(self, days_ago):
        """A tenant whose free tier expired: its balance is 0 since `days_ago` days."""
        r = self.gw.request("POST", "/v1/tenants", {"name": "debt"}, self.admin)
        self.assertEqual(r.status, 201, r)
        t = r.json()["tenant"]["id"]
        key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        g = self.db.sql(f"SELECT id FROM ledger_accounts WHERE tenant_id = '{t}' AND kind = 'grant'")
        # One transaction: the period starts with the transfer (the trigger) and is moved back
        # before any gateway sees it.
        self.db.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,"
                    f" amount_ucr, tenant_id, reason) VALUES ('tx_exp_{t}', 'test-expiry:{t}',"
                    f" 'expiry', '{g}', 'system:expired', 500000000, '{t}', 'test');"
                    f"UPDATE billing_debts SET since = now() - interval '{days_ago} days'"
                    f" WHERE tenant_id = '{t}'")
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM billing_debts WHERE tenant_id = '{t}'"), "1")
        return t, key

    def sandbox(self, tenant, state, node=True):
        sb = mt.add_sandbox(self.db, tenant, self.node, state=state)
        if not node:
            self.db.sql(f"UPDATE sandboxes SET node_id = NULL, generation = generation + 1"
                        f" WHERE id = '{sb}'")
        return sb

    def row(self, sb):
        return self.db.sql("SELECT state, delete_requested_at IS NOT NULL, deleted_at IS NOT NULL"
                           f" FROM sandboxes WHERE id = '{sb}'")

    def audit(self, tenant):
        return self.db.sql(f"SELECT method || ' ' || route || ' ' || coalesce(object_id, '')"
                           f" FROM audit_log WHERE tenant_id = '{tenant}' AND method = 'SYSTEM'"
                           " ORDER BY seq").splitlines()

    def test_paused_sandboxes_of_a_tenant_at_zero_past_the_period_are_deleted_with_notice(self):
        t, key = self.tenant_at_zero(DAYS + 1)
        on_down_node = self.sandbox(t, "paused")
        unheld = self.sandbox(t, "paused", node=False)
        running = self.sandbox(t, "running")
        # A node that heartbeats but does not answer: the delete is decided and asked of it again
        # on every pass (the normal path's node call, outside any request).
        live = "tl" + os.urandom(4).hex()
        mt.add_node(self.db, live)
        self.db.sql(f"UPDATE nodes SET heartbeat_at = now() + interval '1 hour' WHERE id = '{live}'")
        on_silent_node = self.sandbox(t, "paused")
        self.db.sql(f"UPDATE sandboxes SET node_id = '{live}', generation = generation + 1"
                    f" WHERE id = '{on_silent_node}'")
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["balance_ucr"], b["debt_ucr"]), (0, 0))
        at = self.db.sql(f"SELECT rfc3339(since + interval '{DAYS} days') FROM billing_debts"
                         f" WHERE tenant_id = '{t}'")
        self.assertEqual(b["snapshots_delete_at"], at)
        # The node is down (its heartbeat an hour old): the delete is requested (the node carries
        # it out when it is back, and the sandbox shows as deleting); no node holds the other:
        # its record goes.
        self.assertTrue(mt.wait_for(lambda: self.row(on_down_node) == "paused|t|f"
                                    and self.row(unheld) == "stopped|t|t", 60),
                        (self.row(on_down_node), self.row(unheld), self.gw.output()[-3000:]))
        r = self.gw.request("GET", f"/v1/sandboxes/{on_down_node}", headers=key)
        self.assertEqual((r.status, r.json()["deleting"]), (200, True))
        # Never deleted by the debt pass (its node is down, so it shows lost: migrations/0019).
        self.assertIn(self.row(running), ("running|f|f", "lost|f|f"))
        self.assertTrue(mt.wait_for(lambda: self.row(on_silent_node) == "paused|t|f" and
                                    f'the node of sandbox "{on_silent_node}" did not answer its delete'
                                    in self.gw.output(), 60), self.gw.output()[-3000:])
        ev = self.audit(t)
        self.assertEqual(len(ev), 4, ev)
        self.assertTrue(ev[0].startswith("SYSTEM billing: balance at or below zero since"), ev)
        self.assertEqual(sorted(e.split()[-1] for e in ev[1:]),
                         sorted([on_down_node, unheld, on_silent_node]), ev)
        self.assertTrue(all("deleted after" in e for e in ev[1:]), ev)
        # Through the API too.
        r = self.gw.request("GET", "/v1/audit", headers=key).json()
        self.assertEqual(sum(1 for e in r["entries"] if e["method"] == "SYSTEM"), 4, r)

    def test_a_tenant_at_zero_for_less_than_the_period_is_told_when_and_kept(self):
        t, key = self.tenant_at_zero(DAYS - 1)
        sb = self.sandbox(t, "paused")
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        since = self.db.sql(f"SELECT rfc3339(since) FROM billing_debts WHERE tenant_id = '{t}'")
        at = self.db.sql(f"SELECT rfc3339(since + interval '{DAYS} days') FROM billing_debts"
                         f" WHERE tenant_id = '{t}'")
        self.assertEqual((b["debt_since"], b["snapshots_delete_at"]), (since, at))
        # The CLI says it plainly.
        p = subprocess.run([os.path.join(kiln.BUILD, "cli", "kiln"), "balance"], capture_output=True,
                           text=True, timeout=60,
                           env=dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=key["Authorization"][7:]))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"IN DEBT: 0.000000 credits owed, at or below zero since {since}", p.stdout)
        self.assertIn(f"will be DELETED at {at}", p.stdout)
        self.assertTrue(mt.wait_for(lambda: len(self.audit(t)) == 1, 60), self.audit(t))
        self.assertIn(at, self.audit(t)[0])
        self.assertEqual(self.row(sb), "paused|f|f")

    def test_a_grant_above_zero_cancels_the_deletion(self):
        t, key = self.tenant_at_zero(DAYS - 1)
        h = dict(self.admin, **{"Idempotency-Key": "debt-" + os.urandom(4).hex()})
        r = self.gw.request("POST", "/v1/billing/grants",
                            {"tenant_id": t, "amount_ucr": 1000, "reason": "top-up"}, h)
        self.assertEqual(r.status, 201, r)
        # Even once the old period would have passed: it ended with the grant.
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM billing_debts WHERE tenant_id = '{t}'"), "0")
        sb = self.sandbox(t, "paused")
        b = self.gw.request("GET", "/v1/billing/balance", headers=key).json()
        self.assertEqual((b["balance_ucr"], b["debt_since"], b["snapshots_delete_at"]), (1000, None, None))
        self.assertFalse(mt.wait_for(lambda: self.row(sb) != "paused|f|f", 4))


if __name__ == "__main__":
    unittest.main()
