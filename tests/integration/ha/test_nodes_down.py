"""Nodes marked down without VMs: a real gateway and Postgres, the nodes' rows written as their
heartbeats would (migrations/0019, api/routes_nodes.c).

- a node whose heartbeat lapsed is marked down once, by the first read that sees it; its running
  sandbox becomes lost (node_down) at its last heartbeat, its paused one stays paused;
- two markers at once (one holding its transaction open) mark it once and log one change;
- a paused sandbox whose snapshot is only on the down node's disk: resume is 503 naming the node;
- GET /v1/admin/nodes shows each node's state, capacity and use; only an admin sees it;
- a real kiln-node (no VM) stopped cleanly is out of placement at once, its heartbeat still
  fresh, and back when it starts again (migrations/0029)."""
import secrets
import subprocess
import threading
import time
import unittest

import kiln


class NodesDownTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        env = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.addClassCleanup(cls.db.drop)
        cls.gw = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"], {"KILN_NODE_DOWN_AFTER_S": "30"})
        cls.addClassCleanup(cls.gw.cleanup)
        cls.admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        name = "nd" + secrets.token_hex(3)
        r = cls.gw.request("POST", "/v1/tenants", {"name": name}, cls.admin)
        assert r.status == 201, r
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        cls.tenant = cls.db.sql(f"SELECT id FROM tenants WHERE name = '{name}'")

    def node(self, heartbeat_ago_s):
        nid = "n" + secrets.token_hex(4)
        self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
                    "accelerator, image_hash, disk_gib, heartbeat_at) VALUES "
                    f"('{nid}', 'unix:/nonexistent/{nid}', 4000, 4096, 8, 'qemu', 'tcg', 'x', 40, "
                    f"now() - interval '{heartbeat_ago_s} seconds')")
        return nid

    def sandbox(self, node, state, snapshot_status=None):
        sb = "sb_" + secrets.token_hex(8)
        self.db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
                    "disk_gib, timeout_s, expires_at, state_changed_at) VALUES "
                    f"('{sb}', '{self.tenant}', '{node}', '{state}', 'python', 1000, 256, 1, 300, "
                    "now() + interval '1 hour', now() - interval '1 hour')")
        if snapshot_status:
            snap = "snap_" + secrets.token_hex(8)
            self.db.sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, vcpu_milli, "
                        f"memory_mib, disk_gib, status) VALUES ('{snap}', '{self.tenant}', '{sb}', '{node}', "
                        f"'pause', 1000, 256, 1, '{snapshot_status}')")
            self.db.sql(f"UPDATE sandboxes SET pause_snapshot = '{snap}' WHERE id = '{sb}'")
        return sb

    def get(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def nodes(self):
        r = self.gw.request("GET", "/v1/admin/nodes", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        return {n["id"]: n for n in r.json()["nodes"]}

    def test_a_lapsed_node_is_marked_down_its_running_sandbox_lost_its_paused_one_kept(self):
        live, dead = self.node(0), self.node(300)
        on_live, running = self.sandbox(live, "running"), self.sandbox(dead, "running")
        paused = self.sandbox(dead, "paused", "local")
        heartbeat = self.db.sql(f"SELECT heartbeat_at FROM nodes WHERE id = '{dead}'")

        got = self.get(running)
        self.assertEqual((got["state"], got.get("lost_reason")), ("lost", "node_down"), got)
        self.assertEqual(self.get(on_live)["state"], "running")
        self.assertNotIn("lost_reason", self.get(on_live))
        self.assertEqual(self.get(paused)["state"], "paused")
        # Billing's end: the log's change at the node's last heartbeat, once.
        self.assertEqual(self.db.sql(f"SELECT count(*), min(at) = '{heartbeat}'::timestamptz FROM "
                                     f"sandbox_state_log WHERE sandbox_id = '{running}' AND state = 'lost'"),
                         "1|t")
        n = self.nodes()
        self.assertEqual(n[dead]["state"], "down")
        self.assertEqual(n[live]["state"], "up")
        self.assertEqual(n[live]["used"]["running"], 1)
        self.assertEqual(n[live]["used"]["memory_mib"], 256)
        self.assertEqual(n[dead]["used"]["lost"], 1)
        self.assertEqual(n[dead]["capacity"]["memory_mib"], 4096)
        r = self.gw.request("GET", f"/v1/sandboxes?state=lost", headers=self.key)
        self.assertEqual(r.status, 200, r)
        self.assertIn(running, [s["id"] for s in r.json()["sandboxes"]])

        # Lost: no resume; a delete needs no node.
        r = self.gw.request("POST", f"/v1/sandboxes/{running}/resume", headers=self.key)
        self.assertEqual(r.status, 409, r)
        self.assertIn("lost", r.json()["error"]["message"])
        # The paused one's snapshot is only on the dead node: 503 naming it, nothing changed.
        r = self.gw.request("POST", f"/v1/sandboxes/{paused}/resume", headers=self.key)
        self.assertEqual(r.status, 503, r)
        self.assertIn(dead, r.json()["error"]["message"])
        self.assertEqual(self.get(paused)["state"], "paused")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{running}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{running}", headers=self.key).status, 404)

        # Its next heartbeat (as kiln-node writes it) brings it back up.
        self.db.sql(f"UPDATE nodes SET heartbeat_at = now(), down_at = NULL WHERE id = '{dead}'")
        self.assertEqual(self.nodes()[dead]["state"], "up")

    def test_two_that_see_the_lapse_at_once_mark_it_once(self):
        dead = self.node(300)
        running = self.sandbox(dead, "running")
        first = {}

        def hold():
            # The first marker holds its row locks for a second before it commits.
            out = subprocess.run(["psql", "-h", self.db.sockdir, "-U", "kiln", "-d", self.db.name, "-tAq",
                                  "-c", "BEGIN", "-c", "SELECT count(*) FROM nodes_mark_down(30)",
                                  "-c", "SELECT pg_sleep(1)", "-c", "COMMIT"],
                                 check=True, capture_output=True, text=True)
            first["out"] = out.stdout.split()

        t = threading.Thread(target=hold)
        t.start()
        time.sleep(0.3)
        second = self.db.sql("SELECT count(*) FROM nodes_mark_down(30)")
        t.join()
        marked = [first["out"][0], second]
        self.assertEqual(sorted(marked), ["0", "1"], marked)
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '{running}' "
                                     "AND state = 'lost'"), "1")
        self.assertEqual(self.db.sql("SELECT count(*) FROM nodes_mark_down(30)"), "0")

    def test_only_an_admin_lists_or_drains_nodes(self):
        live = self.node(0)
        self.assertEqual(self.gw.request("GET", "/v1/admin/nodes", headers=self.key).status, 403)
        r = self.gw.request("POST", f"/v1/admin/nodes/{live}/drain", headers=self.key)
        self.assertEqual(r.status, 403, r)
        r = self.gw.request("POST", "/v1/admin/nodes/nope/drain", headers=self.admin)
        self.assertEqual(r.status, 404, r)
        # A drain of a node with nothing on it: draining, placed on no more; undrain opens it.
        r = self.gw.request("POST", f"/v1/admin/nodes/{live}/drain", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"node": live, "moved": [], "kept": []})
        self.assertEqual(self.nodes()[live]["state"], "draining")
        r = self.gw.request("POST", f"/v1/admin/nodes/{live}/undrain", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.nodes()[live]["state"], "up")
        # A node that is down: only marked; its paused sandboxes listed with where they resume.
        dead = self.node(300)
        kept_local, kept_stored = self.sandbox(dead, "paused", "local"), self.sandbox(dead, "paused", "stored")
        r = self.gw.request("POST", f"/v1/admin/nodes/{dead}/drain", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        kept = {k["id"]: k["reason"] for k in r.json()["kept"]}
        self.assertEqual(set(kept), {kept_local, kept_stored}, r.json())
        self.assertIn("only there", kept[kept_local])
        self.assertIn("bucket", kept[kept_stored])
        self.assertEqual(self.nodes()[dead]["state"], "down")

    def wait_state(self, node_id, state):
        """The node as the admin route shows it, once in `state` (its socket is up a moment
        before its first heartbeat) or after 15 s."""
        deadline = time.time() + 15
        while True:
            got = self.nodes().get(node_id, {})
            if got.get("state") == state or time.time() > deadline:
                return got
            time.sleep(0.2)

    def test_z_a_cleanly_stopped_node_leaves_placement_at_once_and_a_restart_puts_it_back(self):
        # A real kiln-node (no sandbox, so no VM), the only node placement may use.
        node = kiln.Node(self.db.url, self.gw.url, {"KILN_NODE_DOWN_AFTER_S": "30"})
        self.addCleanup(node.cleanup)
        self.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id <> '{node.node_id}'")
        self.assertEqual(self.wait_state(node.node_id, "up")["state"], "up")
        # Its image is recorded (migrations/0030) for the restores of its snapshots.
        img = kiln.guest_image()
        self.assertEqual(self.db.sql(f"SELECT rootfs FROM node_images WHERE node_id = '{node.node_id}' "
                                     f"AND image_hash = '{img['KILN_GUEST_IMAGE_HASH']}'"),
                         img["KILN_GUEST_ROOTFS"])

        self.assertEqual(node.stop(), 0, node.output())
        # At once, its heartbeat still fresh: stopped, and a create fits nowhere (no VM is booted).
        self.assertEqual(self.db.sql(f"SELECT heartbeat_at > now() - interval '30 seconds' AND "
                                     f"stopped_at IS NOT NULL FROM nodes WHERE id = '{node.node_id}'"), "t")
        got = self.nodes()[node.node_id]
        self.assertEqual(got["state"], "stopped", got)
        self.assertTrue(got["stopped_at"], got)
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json()["error"]["code"], "no_capacity", r)

        # Started again on its state: placed on again (up, the mark cleared by its heartbeat).
        again = kiln.Node(self.db.url, self.gw.url, {"KILN_NODE_DOWN_AFTER_S": "30"},
                          node_id=node.node_id, data_dir=node.data_dir)
        self.addCleanup(again.cleanup)
        got = self.wait_state(node.node_id, "up")
        self.assertEqual(got["state"], "up", got)
        self.assertIsNone(got["stopped_at"], got)


if __name__ == "__main__":
    unittest.main()
