"""Many hosts: a node whose heartbeat lapses is marked down, its running sandboxes reported lost,
its paused ones (snapshots in their tenant's bucket) resumed on another node; the node, back,
discards the VMs that are no longer its own (fenced by generation); a drain moves a node's
sandboxes to another with their files and egress rules; a snapshot restores on the guest image it
was taken from after the node's image changed (docs/operations.md, Many hosts).

Two kiln-node processes on one gateway and Postgres, the bucket a real S3-compatible server
(tests/integration/s3). The first node is stopped with SIGSTOP: its QEMUs go on running, as a
host cut off from the network would, until it comes back."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import unittest

import kiln

sys.path.insert(0, os.path.join(kiln.ROOT, "tests", "integration", "s3"))
import s3env  # noqa: E402

DOWN_AFTER = 5  # node_down_after_s here (default 10): the test waits less
ENV = dict(s3env.ALLOW_ENV, KILN_NODE_DOWN_AFTER_S=str(DOWN_AFTER))


class NodeLossTests(unittest.TestCase):
    figures = {}  # what bench/ha/down.sh reports: seconds from a node's stop to each step

    @classmethod
    def setUpClass(cls):
        cls.s3 = s3env.S3Server()
        cls.addClassCleanup(cls.s3.stop)
        cls.stack = kiln.Stack(node_env=ENV, gateway_env=ENV)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()
        r = cls.gw.request("PUT", "/v1/storage", dict(cls.s3.target(prefix="kiln/"), kind="s3"), cls.key)
        assert r.status == 200, r

    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=180)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def get(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def nodes(self):
        r = self.gw.request("GET", "/v1/admin/nodes", headers=self.stack.admin)
        self.assertEqual(r.status, 200, r)
        return {n["id"]: n for n in r.json()["nodes"]}

    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        return r.json()["id"]

    def wait_stored(self, sb):
        deadline = time.time() + 180
        q = f"SELECT p.status FROM sandboxes s JOIN snapshots p ON p.id = s.pause_snapshot WHERE s.id = '{sb}'"
        while time.time() < deadline and self.stack.db.sql(q) != "stored":
            time.sleep(1)
        self.assertEqual(self.stack.db.sql(q), "stored")

    def test_a_lost_node_its_paused_sandbox_elsewhere_its_vms_fenced_then_a_drain(self):
        a = self.stack.node
        # Both on the first node (the only one yet): one runs, one is paused into the bucket.
        runner, sleeper = self.create(), self.create()
        self.sh(sleeper, "echo precious > /root/data")
        r = self.gw.request("POST", f"/v1/sandboxes/{sleeper}/pause", headers=self.key, timeout=180)
        self.assertEqual(r.status, 200, r)
        self.wait_stored(sleeper)
        b = self.stack.add_node(ENV)
        self.addCleanup(b.cleanup)
        self.assertTrue(kiln.vm_pids(a.node_id, runner), "the running sandbox has no QEMU")

        # The first node stops answering: marked down within its bound (plus a heartbeat and a
        # load allowance), once; its running sandbox lost (node_down), its paused one not.
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = time.time()
        try:
            deadline = stopped + DOWN_AFTER + 30
            while time.time() < deadline and self.get(runner)["state"] != "lost":
                time.sleep(0.5)
            took = time.time() - stopped
            got = self.get(runner)
            self.assertEqual(got["state"], "lost", got)
            self.assertEqual(got["lost_reason"], "node_down", got)
            self.assertGreaterEqual(took, DOWN_AFTER - 1.5)
            print(f"marked down {took:.1f} s after its node stopped (bound {DOWN_AFTER} s)", file=sys.stderr)
            self.figures["marked_down_s"] = took
            self.assertEqual(self.nodes()[a.node_id]["state"], "down")
            self.assertEqual(self.stack.db.sql(f"SELECT count(*) FROM nodes WHERE id = '{a.node_id}' "
                                               "AND down_at IS NOT NULL"), "1")
            self.assertEqual(self.get(sleeper)["state"], "paused")
            # The lost one: no resume (409), and billing stopped at the node's last heartbeat.
            r = self.gw.request("POST", f"/v1/sandboxes/{runner}/resume", headers=self.key)
            self.assertEqual(r.status, 409, r)
            self.assertIn("lost", r.json()["error"]["message"])
            self.assertEqual(self.stack.db.sql(
                f"SELECT l.at <= n.heartbeat_at + interval '1 second' FROM sandbox_state_log l, nodes n "
                f"WHERE l.sandbox_id = '{runner}' AND l.state = 'lost' AND n.id = '{a.node_id}'"), "t")

            # A snapshot only on the dead node's disk: 503 naming the node, and nothing changes.
            snap = self.stack.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{sleeper}'")
            self.stack.db.sql(f"UPDATE snapshots SET status = 'local' WHERE id = '{snap}'")
            r = self.gw.request("POST", f"/v1/sandboxes/{sleeper}/resume", headers=self.key)
            self.stack.db.sql(f"UPDATE snapshots SET status = 'stored' WHERE id = '{snap}'")
            self.assertEqual(r.status, 503, r)
            self.assertIn(a.node_id, r.json()["error"]["message"])
            self.assertEqual(self.get(sleeper)["state"], "paused")

            # From the bucket, on the other node, with its file.
            t0 = time.time()
            r = self.gw.request("POST", f"/v1/sandboxes/{sleeper}/resume", headers=self.key, timeout=300)
            self.assertEqual(r.status, 200, r)
            self.assertEqual(r.json()["node"], b.node_id)
            print(f"resumed on the other node in {time.time() - t0:.1f} s", file=sys.stderr)
            self.figures["resume_s"] = time.time() - t0
            self.figures["stop_to_running_elsewhere_s"] = time.time() - stopped
            self.assertEqual(self.sh(sleeper, "cat /root/data"), "precious\n")
            self.assertTrue(kiln.vm_pids(a.node_id, runner), "the stopped node's QEMU should still be there")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)

        # Back: its QEMU of the lost sandbox is stopped and discarded, never run on; it is up.
        deadline = time.time() + 60
        while time.time() < deadline and kiln.vm_pids(a.node_id, runner):
            time.sleep(0.5)
        self.assertFalse(kiln.vm_pids(a.node_id, runner), "the fenced VM still runs")
        self.assertIn("is no longer this node's", a.output())
        deadline = time.time() + 30
        while time.time() < deadline and self.nodes()[a.node_id]["state"] != "up":
            time.sleep(0.5)
        self.assertEqual(self.nodes()[a.node_id]["state"], "up")
        got = self.get(sleeper)
        self.assertEqual((got["state"], got["node"]), ("running", b.node_id))
        self.assertEqual(self.get(runner)["state"], "lost")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{runner}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{runner}", headers=self.key).status, 404)

        # Drain the second node with `kiln-node drain`: the running sandbox moves back to the
        # first with its files and its egress rules; nothing new is placed on the drained one.
        self.sh(sleeper, "echo more >> /root/data")
        r = self.gw.request("PUT", f"/v1/sandboxes/{sleeper}/egress", {"rules": ["example.com"]}, self.key)
        self.assertEqual(r.status, 200, r)
        env = dict(os.environ, KILN_NODE_ID=b.node_id, KILN_GATEWAY_URL=self.gw.url,
                   KILN_ADMIN_KEY=self.gw.admin_key)
        out = subprocess.run([os.path.join(kiln.BUILD, "node", "kiln-node"), "drain"], env=env,
                             capture_output=True, text=True, timeout=600)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(sleeper, out.stdout)
        self.assertIn(a.node_id, out.stdout)
        self.assertEqual(self.nodes()[b.node_id]["state"], "draining")
        got = self.get(sleeper)
        self.assertEqual((got["state"], got["node"]), ("running", a.node_id))
        self.assertEqual(self.sh(sleeper, "cat /root/data"), "precious\nmore\n")
        r = self.gw.request("GET", f"/v1/sandboxes/{sleeper}/egress", headers=self.key)
        self.assertEqual(r.status, 200, r)
        self.assertIn("example.com", str(r.json()))
        self.assertFalse(kiln.vm_pids(b.node_id, sleeper), "the drained node still runs it")
        # Only an admin drains.
        r = self.gw.request("POST", f"/v1/admin/nodes/{b.node_id}/drain", headers=self.key)
        self.assertEqual(r.status, 403, r)
        r = self.gw.request("POST", "/v1/admin/nodes/nope/drain", headers=self.stack.admin)
        self.assertEqual(r.status, 404, r)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sleeper}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)

    def test_b_two_creates_at_once_on_a_node_with_room_for_one_place_one(self):
        # A node with room for one sandbox, the only one placement may use (the first drained).
        one = self.stack.add_node(dict(ENV, KILN_NODE_MAX_SANDBOXES="1"))
        self.addCleanup(one.cleanup)
        a = self.stack.node.node_id
        r = self.gw.request("POST", f"/v1/admin/nodes/{a}/drain", headers=self.stack.admin, timeout=600)
        self.assertEqual(r.status, 200, r)
        self.addCleanup(self.gw.request, "POST", f"/v1/admin/nodes/{a}/undrain", None, self.stack.admin)
        got = []

        def create():
            got.append(self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 600}, self.key,
                                       timeout=300))
        threads = [threading.Thread(target=create) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status for r in got)
        self.assertEqual(codes, [201, 503], got)
        made = next(r for r in got if r.status == 201).json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{made['id']}", None, self.key, False, 120)
        self.assertEqual(made["node"], one.node_id)
        refused = next(r for r in got if r.status == 503).json()["error"]
        self.assertEqual(refused["code"], "no_capacity", refused)
        # Nothing of the refused one is left: one live sandbox on the node.
        self.assertEqual(self.nodes()[one.node_id]["used"]["running"], 1)

    def test_c_a_node_killed_and_marked_down_brings_its_lost_sandbox_back_paused_with_its_files(self):
        # The nodes the earlier tests stopped may still look alive for a few seconds: out of
        # placement, so the sandbox goes to the first node.
        for nid in self.nodes():
            if nid != self.stack.node.node_id:
                r = self.gw.request("POST", f"/v1/admin/nodes/{nid}/drain", headers=self.stack.admin)
                self.assertEqual(r.status, 200, r)
        sb = self.create()
        self.assertEqual(self.get(sb)["node"], self.stack.node.node_id)
        self.sh(sb, "echo kept > /root/data")
        self.stack.node.stop(signal.SIGKILL)
        deadline = time.time() + DOWN_AFTER + 30
        while time.time() < deadline and self.get(sb)["state"] != "lost":
            time.sleep(0.5)
        self.assertEqual(self.get(sb)["state"], "lost")
        # Back on its state directory: the VM outlived its node and the sandbox ran nowhere else,
        # so it is paused whole instead of discarded.
        self.stack.restart_node(ENV)
        got = self.get(sb)
        self.assertEqual(got["state"], "paused", got)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/resume", headers=self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.sh(sb, "cat /root/data"), "kept\n")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)

    def test_d_a_snapshot_restores_on_the_image_it_was_taken_from(self):
        # Image A: the test image's files under another directory and hash (kiln.image_copy);
        # image B: the test image itself. The sandbox is paused on A, the node restarted on B.
        img = kiln.guest_image()
        a_dir, a = kiln.image_copy("a")
        self.addCleanup(shutil.rmtree, a_dir, True)
        hash_a = a["KILN_GUEST_IMAGE_HASH"]
        for nid in self.nodes():
            if nid != self.stack.node.node_id:
                self.stack.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id = '{nid}'")
        node = self.stack.restart_node(dict(ENV, **a))
        sb = self.create()
        self.assertEqual(kiln.vm_files(node, sb), (a["KILN_GUEST_KERNEL"], a["KILN_GUEST_ROOTFS"]))
        self.sh(sb, "echo on-a > /root/data; setsid sleep 100000 </dev/null >/dev/null 2>&1 & "
                    "echo $! > /root/pid")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/pause", headers=self.key, timeout=180)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.stack.db.sql(f"SELECT p.image_hash FROM sandboxes s JOIN snapshots p "
                                           f"ON p.id = s.pause_snapshot WHERE s.id = '{sb}'"), hash_a)

        # The node upgraded to B: A stays pinned against pruning while the snapshot needs it;
        # the resume restores on A with its memory (the process lives on) and files.
        node = self.stack.restart_node(ENV)
        self.assertTrue(os.path.exists(os.path.join(a_dir, ".kiln-pin-" + node.node_id)),
                        "image A is not pinned")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/resume", headers=self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(kiln.vm_files(node, sb), (a["KILN_GUEST_KERNEL"], a["KILN_GUEST_ROOTFS"]))
        self.assertEqual(self.sh(sb, "cat /root/data; kill -0 $(cat /root/pid) && echo alive"),
                         "on-a\nalive\n")
        # A new sandbox: on B.
        new = self.create()
        self.assertEqual(kiln.vm_files(node, new), (img["KILN_GUEST_KERNEL"], img["KILN_GUEST_ROOTFS"]))
        r = self.gw.request("DELETE", f"/v1/sandboxes/{new}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)

        # A node that lacks A (its kernel gone) refuses the restore, naming the image; nothing
        # changes: the sandbox stays paused on A's snapshot.
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/pause", headers=self.key, timeout=180)
        self.assertEqual(r.status, 200, r)
        os.unlink(a["KILN_GUEST_KERNEL"])
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/resume", headers=self.key, timeout=300)
        self.assertEqual(r.status, 409, r)
        self.assertIn(hash_a, r.json()["error"]["message"])
        self.assertIn("lacks guest image", r.json()["error"]["message"])
        self.assertEqual(self.get(sb)["state"], "paused")
        self.assertFalse(kiln.vm_pids(node.node_id, sb), "a VM of the refused restore runs")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)


if __name__ == "__main__":
    unittest.main()
