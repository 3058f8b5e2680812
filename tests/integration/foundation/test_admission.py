"""Admission of create, resume and fork: credits (402), plan limits (403), Redis down (503).

Each refusal must come before anything is made: no sandbox row, no node call."""
import os
import subprocess
import tempfile
import unittest

import kiln

SERVICES = os.path.join(kiln.ROOT, "tests", "harness", "services.sh")


class AdmissionTests(unittest.TestCase):
    def setUp(self):
        fd, self.envfile = tempfile.mkstemp(prefix="kiln-admission-")
        os.close(fd)
        subprocess.run([SERVICES, "start", self.envfile], check=True, capture_output=True)
        self.addCleanup(subprocess.run, [SERVICES, "stop", self.envfile], capture_output=True)
        saved = os.environ["KILN_SERVICES_ENV"]
        os.environ["KILN_SERVICES_ENV"] = self.envfile
        self.env = kiln.services_env()
        os.environ["KILN_SERVICES_ENV"] = saved
        self.gw = kiln.Gateway(self.env["KILN_DATABASE_URL"], self.env["KILN_REDIS_URL"])
        self.addCleanup(self.gw.cleanup)
        r = self.gw.request("POST", "/v1/tenants", {"name": "t"}, {"Authorization": "Bearer " + self.gw.admin_key})
        self.assertEqual(r.status, 201, r)
        self.tenant = r.json()["tenant"]["id"]
        self.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    def sql(self, q):
        return kiln.psql(self.env["KILN_TEST_SOCKDIR"], "kiln", q)

    def sandboxes(self):
        return int(self.sql(f"SELECT count(*) FROM sandboxes WHERE tenant_id = '{self.tenant}'"))

    def test_a_tenant_without_credits_gets_402_and_nothing_is_made(self):
        # Spend the whole free tier, as kiln-meter would have.
        self.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr, "
                 f"tenant_id) SELECT 'tx_spent', 'test:spent', 'usage', a.id, 'system:revenue', 500000000, "
                 f"'{self.tenant}' FROM ledger_accounts a WHERE a.tenant_id = '{self.tenant}' AND a.kind = 'grant'")
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertEqual(r.status, 402, r)
        self.assertEqual(r.json()["error"]["code"], "insufficient_credits")
        self.assertEqual(self.sandboxes(), 0)

    def test_a_plan_limit_is_403_quota_exceeded_naming_it(self):
        self.sql("UPDATE plan_limits SET max_memory_mib = 1024")
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 2048}, self.key)
        self.assertEqual(r.status, 403, r)
        self.assertEqual(r.json()["error"]["code"], "quota_exceeded")
        self.assertIn("memory", r.json()["error"]["message"])
        self.assertEqual(self.sandboxes(), 0)

    def test_the_snapshot_bytes_of_the_plan_are_a_limit_too(self):
        self.sql("UPDATE plan_limits SET max_snapshot_bytes = 1000000")
        self.sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, size_bytes, vcpu_milli, memory_mib,"
                 f" disk_gib) VALUES ('snap_x', '{self.tenant}', 'sb_x', 'named', 2000000, 1000, 256, 10)")
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertEqual(r.status, 403, r)
        self.assertIn("snapshots", r.json()["error"]["message"])
        self.assertNotIn("layers", r.json()["error"]["message"])
        self.assertEqual(self.sandboxes(), 0)
        # cached layers of template builds taking part: the message names them and how they go
        self.sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, size_bytes, vcpu_milli, memory_mib,"
                 f" disk_gib) VALUES ('snap_l', '{self.tenant}', 'sb_l', 'build', 3145728, 1000, 256, 10)")
        self.sql("INSERT INTO template_layers (tenant_id, node_id, key, snapshot_id, template_id) VALUES "
                 f"('{self.tenant}', 'node-x', '{'0' * 64}', 'snap_l', 'tpl_x')")
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertEqual(r.status, 403, r)
        self.assertIn("4 MiB are kept (3 MiB of them cached layers of template builds, which go with "
                      "their templates or are evicted by builds): delete snapshots, sandboxes or "
                      "templates to go on", r.json()["error"]["message"])
        self.sql("DELETE FROM template_layers WHERE snapshot_id = 'snap_l'")
        self.sql("UPDATE snapshots SET deleted_at = now(), purged_at = now() WHERE id = 'snap_l'")
        self.sql("UPDATE snapshots SET deleted_at = now(), purged_at = now() WHERE id = 'snap_x'")
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertNotEqual(r.status, 403, r)

    def test_with_redis_down_create_answers_503_and_changes_nothing(self):
        lib = os.path.join(kiln.ROOT, "scripts", "lib.sh")
        subprocess.run(["bash", "-c", f". {lib}; kiln_stop_pid {self.env['KILN_TEST_REDIS_PIDFILE']} 10"],
                       check=True)
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json()["error"]["code"], "unavailable")
        self.assertEqual(self.sandboxes(), 0)
        # Reads go on.
        self.assertEqual(self.gw.request("GET", "/v1/sandboxes", headers=self.key).status, 200)


if __name__ == "__main__":
    unittest.main()
