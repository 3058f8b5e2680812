"""An operator suspends a tenant with a running sandbox: the sandbox is paused through its node
(its VM released, its files kept), the tenant's key is refused with 403 `suspended`, nothing is
deleted; after unsuspend the key works again and the sandbox stays paused until the tenant resumes
it. Through the CLI, as the operator would (`kiln admin suspend|unsuspend`). A suspension's pauses
are forced like kiln-meter's: a tenant whose plan allows no snapshot bytes is paused all the same."""
import os
import subprocess
import unittest

import kiln


vm_pids = kiln.vm_pids


class SuspendTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        r = cls.gw.request("POST", "/v1/tenants", {"name": "suspect"}, cls.stack.admin)
        assert r.status == 201, r
        cls.tid = r.json()["tenant"]["id"]
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        cls.bystander = cls.stack.tenant("bystander")

    def admin_cli(self, *args):
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=self.gw.admin_key)
        return subprocess.run([os.path.join(kiln.BUILD, "cli", "kiln"), "admin", *args],
                              env=env, capture_output=True, text=True, timeout=300)

    def state(self, sb_id):
        return self.stack.db.sql(f"SELECT state FROM sandboxes WHERE id = '{sb_id}'")

    def test_suspend_pauses_the_running_sandbox_and_unsuspend_lets_the_tenant_resume_it(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600},
                            self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()["id"]
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb}/files?path=/root/keep.txt", b"kept",
                            self.key)
        self.assertEqual(r.status, 204, r)
        self.assertNotEqual(vm_pids(self.stack.node.node_id, sb), set())

        # A tenant's own key cannot suspend.
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=self.key["Authorization"][7:])
        p = subprocess.run([os.path.join(kiln.BUILD, "cli", "kiln"), "admin", "suspend", self.tid],
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1, p)
        self.assertIn("forbidden", p.stderr)
        self.assertEqual(self.state(sb), "running")

        p = self.admin_cli("suspend", self.tid)
        self.assertEqual(p.returncode, 0, p)
        self.assertEqual(p.stdout.splitlines(), [f"{self.tid}\tsuspended", f"{sb}\tpaused"])
        self.assertEqual(self.state(sb), "paused")
        self.assertEqual(vm_pids(self.stack.node.node_id, sb), set(), "its VM was released")

        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual((r.status, r.json()["error"]["code"]), (403, "suspended"), r)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/resume", headers=self.key, timeout=120)
        self.assertEqual((r.status, r.json()["error"]["code"]), (403, "suspended"), r)
        self.assertEqual(self.gw.request("GET", "/v1/sandboxes", headers=self.bystander).status,
                         200)
        # Nothing deleted: the sandbox, its pause snapshot and the keys are all there.
        self.assertEqual(self.stack.db.sql(
            f"SELECT count(*) FROM sandboxes WHERE id = '{sb}' AND deleted_at IS NULL"), "1")
        self.assertEqual(self.stack.db.sql(
            f"SELECT count(*) FROM api_keys WHERE tenant_id = '{self.tid}' "
            "AND revoked_at IS NULL"), "1")

        p = self.admin_cli("unsuspend", self.tid)
        self.assertEqual(p.returncode, 0, p)
        self.assertEqual(p.stdout.splitlines(), [f"{self.tid}\tactive"])
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "paused", "unsuspending resumes nothing")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/resume", headers=self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}/files?path=/root/keep.txt",
                            headers=self.key)
        self.assertEqual(r.data, b"kept")
        self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key, timeout=120)

    def test_suspend_pauses_a_sandbox_over_the_snapshot_bytes_limit(self):
        r = self.gw.request("POST", "/v1/tenants", {"name": "hoarder"}, self.stack.admin)
        self.assertEqual(r.status, 201, r)
        tid = r.json()["tenant"]["id"]
        key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()["id"]
        # A plan whose snapshots may hold 1 byte: the tenant's own pause is refused ...
        self.stack.db.sql("INSERT INTO plan_limits VALUES ('tiny_snaps', 10, 16000, 32768, 0) "
                          "ON CONFLICT (plan) DO NOTHING")
        self.stack.db.sql("UPDATE plan_limits SET max_snapshot_bytes = 1 WHERE plan = 'tiny_snaps'")
        self.stack.db.sql(f"UPDATE tenants SET plan = 'tiny_snaps' WHERE id = '{tid}'")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/pause", None, key, timeout=600)
        self.assertEqual((r.status, r.json()["error"]["code"]), (403, "quota_exceeded"), r)
        self.assertIn("max_snapshot_bytes", r.json()["error"]["message"])
        self.assertEqual(self.state(sb), "running")

        # ... the operator's suspension pauses it all the same.
        r = self.gw.request("POST", f"/v1/tenants/{tid}/suspend", None, self.stack.admin,
                            timeout=600)
        self.assertEqual(r.status, 200, r)
        self.assertEqual((r.json()["paused"], r.json()["not_paused"]), ([sb], []), r.json())
        self.assertEqual(self.state(sb), "paused")
        self.assertEqual(vm_pids(self.stack.node.node_id, sb), set(), "its VM was released")
        self.assertGreater(int(self.stack.db.sql(
            f"SELECT coalesce(sum(size_bytes), 0) FROM snapshots WHERE tenant_id = '{tid}' "
            "AND kind = 'pause' AND purged_at IS NULL")), 1, "the forced pause counts")
        self.assertEqual(self.stack.db.sql("SELECT count(*) FROM snapshot_reservations"), "0")


if __name__ == "__main__":
    unittest.main()
