"""Many hosts, the short form of issue 19 (docs/operations.md, "Many hosts"): two kiln-node +
kiln-meter pairs, each pair in a network namespace of its own as on a host of its own
(kiln.Netns: a veth to this host, the node's API on TCP at the namespace's address, its
sandboxes' networks and nftables table inside), two kiln-gateways behind HAProxy (PROXY v2), the
one Postgres and Redis of the services fixture, the tenant's bucket on a real S3-compatible server
(tests/integration/s3), real QEMU guests. Every request goes through HAProxy; the nodes reach the
gateways and the bucket through it and through this host's address.

One test tells the whole story, so that every guest it boots serves several checks:
- creates spread by capacity: the first goes to the node with more memory free, the second to the
  other (the first's load counted); two creates at once on a node with room for one place one;
- `kiln-node drain` moves every sandbox of its node to the other, running, with its memory (a
  process lives on), files and egress rules; nothing new is placed on the drained node;
- a node killed with -9 (its meter with it, as when its host dies) is marked down within its
  heartbeat bound: its running sandboxes `lost` (billed up to its last heartbeat), its paused
  one resumed on the other node from the bucket with its memory and files;
- the node started again takes back, paused and whole, its lost sandboxes whose VMs outlived it;
- a node only cut off (SIGSTOP: its QEMUs run on) and back discards the VM of its sandbox marked
  lost meanwhile (fenced by generation), and is up again;
- each node's meter billed what ran on it;
- no live node is ever marked down: after the spread, the drain, the restarts and the upgrade no
  sandbox was lost but the dead or cut-off node's, and neither node's log says "this node had been
  marked down" but after its death or its cut-off (its heartbeat has a thread and a Postgres
  connection of its own, node/main.c);
- a node upgraded to a new guest image: a snapshot taken on the old one restores on it (kept and
  pinned), a new sandbox boots on the new one, and a node that lacks the old image refuses the
  restore (409 naming it) and changes nothing.
"""
import os
import re
import secrets
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

DOWN_AFTER = 3   # node_down_after_s here (default 10; 3 is its least): the test waits less
HEARTBEAT_S = min(DOWN_AFTER / 5, 2)  # a node's heartbeat period (node/main.c)
# What a node logs when its heartbeat finds it had been marked down (its heartbeat had lapsed).
MARKED_DOWN = "this node had been marked down at"


class NodesTests(unittest.TestCase):
    figures = {}  # what bench/ha/down.sh reports: seconds from a node's death to each step

    @classmethod
    def setUpClass(cls):
        services = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.addClassCleanup(cls.db.drop)
        cls.nets = []
        for _ in range(2):
            cls.nets.append(kiln.Netns())
            cls.addClassCleanup(cls.nets[-1].remove)
        # The bucket and HAProxy listen on this host's address facing the first namespace; both
        # namespaces reach it through their default routes.
        host = cls.nets[0].host_addr
        cls.s3 = s3env.S3Server(host)
        cls.addClassCleanup(cls.s3.stop)
        cls.env = {"KILN_STORAGE_ALLOW": host, "KILN_NODE_DOWN_AFTER_S": str(DOWN_AFTER)}
        cls.master_key = secrets.token_hex(32)
        cls.redis_url = services["KILN_REDIS_URL"]
        gws = []
        for _ in range(2):
            gws.append(kiln.Gateway(cls.db.url, cls.redis_url, dict(cls.env, KILN_HTTP_TRUSTED_PROXIES="127.0.0.1"),
                                    master_key=cls.master_key))
            cls.addClassCleanup(gws[-1].cleanup)
        cls.admin = {"Authorization": "Bearer " + gws[0].admin_key}
        cls.gw = kiln.Haproxy([g.port for g in gws], host)
        cls.addClassCleanup(cls.gw.stop)
        cls.gw.wait_serving(lambda: cls.gw.request("GET", "/v1/.well-known/jwks.json").status == 200)
        r = cls.gw.request("POST", "/v1/tenants", {"name": "acme"}, cls.admin)
        assert r.status == 201, r
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = cls.gw.request("PUT", "/v1/storage", dict(cls.s3.target(prefix="kiln/"), kind="s3"), cls.key)
        assert r.status == 200, r
        # Both nodes start on image A: the test image's files under another directory and hash
        # (kiln.image_copy), so that the upgrade at the end goes to the test image itself (B).
        a_dir, cls.image_a = kiln.image_copy("a")
        cls.addClassCleanup(shutil.rmtree, a_dir, True)
        cls.image_a_dir = a_dir
        # The first node has twice the memory of the second, which has room for two sandboxes.
        cls.node_env = [dict(cls.env, KILN_NODE_MEMORY_MIB="8192", **cls.image_a),
                        dict(cls.env, KILN_NODE_MEMORY_MIB="4096", KILN_NODE_MAX_SANDBOXES="2", **cls.image_a)]
        cls.nodes, cls.meters = [None, None], [None, None]
        cls.addClassCleanup(cls.stop_nodes)
        for i in range(2):
            cls.start(i)

    @classmethod
    def start(cls, i, extra_env=None):
        """Node `i` and its meter in its namespace; started again on its id and data after a
        stop (an upgrade, a crash)."""
        old = cls.nodes[i]
        env = dict(cls.node_env[i], KILN_MASTER_KEY=cls.master_key, **(extra_env or {}))
        cls.nodes[i] = kiln.Node(cls.db.url, cls.gw.url, env, node_id=old.node_id if old else None,
                                 data_dir=old.data_dir if old else None, netns=cls.nets[i])
        cls.meters[i] = kiln.Meter(cls.db.url, cls.redis_url, cls.nodes[i].node_id,
                                   {"KILN_METER_WINDOW_S": "2", "KILN_MASTER_KEY": cls.master_key},
                                   netns=cls.nets[i])
        return cls.nodes[i]

    @classmethod
    def restart(cls, i, extra_env=None):
        cls.meters[i].cleanup()
        cls.nodes[i].cleanup(keep_data=True)
        return cls.start(i, extra_env)

    @classmethod
    def stop_nodes(cls):
        for d in cls.meters + cls.nodes:
            if d:
                d.cleanup()

    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=180)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def get(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def node_states(self):
        r = self.gw.request("GET", "/v1/admin/nodes", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        return {n["id"]: n for n in r.json()["nodes"]}

    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        return r.json()["id"]

    def call(self, method, sb, what, status=200, timeout=300):
        r = self.gw.request(method, f"/v1/sandboxes/{sb}{what}", headers=self.key, timeout=timeout)
        self.assertEqual(r.status, status, r)
        return r

    def wait(self, what, pred, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline and not pred():
            time.sleep(0.25)
        self.assertTrue(pred(), "timed out waiting for " + what)

    def wait_stored(self, sb):
        q = f"SELECT p.status FROM sandboxes s JOIN snapshots p ON p.id = s.pause_snapshot WHERE s.id = '{sb}'"
        self.wait(f"{sb}'s snapshot in the bucket", lambda: self.db.sql(q) == "stored", 180)

    def assert_no_live_node_lost(self, lost, marked):
        """Nothing lost but what the steps so far lost on purpose: `lost` changes to lost in the
        sandboxes' log in all, and each node's log (of its current run) saying it had been marked
        down as many times as `marked` gives, one figure per node."""
        self.assertEqual(self.db.sql("SELECT count(*) FROM sandbox_state_log WHERE state = 'lost'"),
                         str(lost), self.db.sql("SELECT sandbox_id, at, node_id FROM sandbox_state_log "
                                                "WHERE state = 'lost'"))
        for n, want in zip(self.nodes, marked):
            out = n.output()
            self.assertEqual(out.count(MARKED_DOWN), want, f"node {n.node_id}: " + "\n".join(
                line for line in out.splitlines() if MARKED_DOWN in line))

    def wait_lost(self, sb, since):
        """Seconds from `since` (the node's death) until `sb` reads as lost."""
        deadline = since + DOWN_AFTER + 30
        while time.time() < deadline and self.get(sb)["state"] != "lost":
            time.sleep(0.25)
        took = time.time() - since
        got = self.get(sb)
        self.assertEqual((got["state"], got.get("lost_reason")), ("lost", "node_down"), got)
        # Its last heartbeat was at most one period before its death; it is marked on the first
        # look after the lapse (each read here, at most once a second per gateway, and the other
        # node's heartbeats), plus an allowance for a loaded machine.
        self.assertGreaterEqual(took, DOWN_AFTER - HEARTBEAT_S - 0.5)
        self.assertLessEqual(took, DOWN_AFTER + HEARTBEAT_S + 4, "not marked down within its bound")
        return took

    def test_spread_drain_death_return_and_upgrade(self):
        n0, n1 = self.nodes
        # Spread by capacity: the first create to the node with more memory free, the second to
        # the other, the first node's load counted.
        x = self.create()
        self.assertEqual(self.get(x)["node"], n0.node_id)
        w = self.create()
        self.assertEqual(self.get(w)["node"], n1.node_id)

        # Two creates at once while only the second node (room for one more) is placed on: one
        # is made there, the other refused (no_capacity), nothing of it left.
        self.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id = '{n0.node_id}'")
        got = []
        threads = [threading.Thread(target=lambda: got.append(self.gw.request(
            "POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, self.key, timeout=300)))
            for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.db.sql(f"UPDATE nodes SET drain_at = NULL WHERE id = '{n0.node_id}'")
        self.assertEqual(sorted(r.status for r in got), [201, 503], got)
        y = next(r for r in got if r.status == 201).json()["id"]
        self.assertEqual(self.get(y)["node"], n1.node_id)
        refused = next(r for r in got if r.status == 503).json()["error"]
        self.assertEqual(refused["code"], "no_capacity", refused)
        self.assertEqual(self.node_states()[n1.node_id]["used"]["running"], 2)

        # State in each: a file, a process (its memory), and for one an egress rule.
        for sb, tag in ((x, "x"), (w, "w"), (y, "y")):
            self.sh(sb, f"echo {tag} > /root/data; setsid sleep 100000 </dev/null >/dev/null 2>&1 & "
                        "echo $! > /root/pid")
        r = self.gw.request("PUT", f"/v1/sandboxes/{w}/egress", {"rules": ["example.com"]}, self.key)
        self.assertEqual(r.status, 200, r)
        check = "cat /root/data; kill -0 $(cat /root/pid) && echo alive"

        # Drain the second node with `kiln-node drain`: both its sandboxes move to the first,
        # running, with their memory, files and egress rules.
        env = dict(os.environ, KILN_NODE_ID=n1.node_id, KILN_GATEWAY_URL=self.gw.url,
                   KILN_ADMIN_KEY=self.admin["Authorization"].split()[1])
        t0 = time.time()
        out = subprocess.run([os.path.join(kiln.BUILD, "node", "kiln-node"), "drain"], env=env,
                             capture_output=True, text=True, timeout=900)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        print(f"drain of two sandboxes {time.time() - t0:.1f} s", file=sys.stderr)
        for sb, tag in ((w, "w"), (y, "y")):
            self.assertIn(sb, out.stdout)
            got = self.get(sb)
            self.assertEqual((got["state"], got["node"]), ("running", n0.node_id), got)
            self.assertEqual(self.sh(sb, check), f"{tag}\nalive\n")
            self.assertFalse(kiln.vm_pids(n1.node_id, sb), "the drained node still runs it")
        self.assertIn(n0.node_id, out.stdout)
        r = self.gw.request("GET", f"/v1/sandboxes/{w}/egress", headers=self.key)
        self.assertEqual(r.status, 200, r)
        self.assertIn("example.com", str(r.json()))
        self.assertEqual(self.node_states()[n1.node_id]["state"], "draining")
        # Their pauses there each had a VMM started ahead on the pause snapshot (node/warm.c); now
        # that the records hold them running here, the drained node removes those by its check.
        ahead = re.findall(r'paused snapshot "[^"]+": VMM "(0[a-z2-7]{12})" started ahead', n1.output())
        self.assertTrue(ahead, "no VMM was started ahead on the drained node's pause snapshots")
        deadline = time.time() + 30
        while time.time() < deadline and any(kiln.vm_pids(n1.node_id, a) for a in ahead):
            time.sleep(0.5)
        self.assertEqual([a for a in ahead if kiln.vm_pids(n1.node_id, a)], [],
                         "VMMs started ahead on the drained node outlived their sandboxes' moves")
        self.assertIn("is no longer its sandbox's", n1.output())
        # Only an admin drains; an unknown node is 404.
        r = self.gw.request("POST", f"/v1/admin/nodes/{n1.node_id}/drain", headers=self.key)
        self.assertEqual(r.status, 403, r)
        r = self.gw.request("POST", "/v1/admin/nodes/nope/drain", headers=self.admin)
        self.assertEqual(r.status, 404, r)
        r = self.gw.request("POST", f"/v1/admin/nodes/{n1.node_id}/undrain", headers=self.admin)
        self.assertEqual(r.status, 200, r)
        # Both nodes lived through the spread and the drain: neither was marked down meanwhile
        # (a heartbeat held up by the node's other work), nothing was lost.
        self.assert_no_live_node_lost(0, [0, 0])

        # The first node dies (-9, its meter with it) with x and w running and y paused into the
        # bucket: marked down within its bound, once; x and w lost, y paused.
        self.call("POST", y, "/pause", timeout=180)
        self.wait_stored(y)
        self.assert_no_live_node_lost(0, [0, 0])
        self.assertTrue(kiln.vm_pids(n0.node_id, x), f"x has no QEMU: {self.get(x)}")
        self.meters[0].stop(signal.SIGKILL)
        n0.stop(signal.SIGKILL)
        died = time.time()
        took = self.wait_lost(x, died)
        print(f"marked down {took:.1f} s after its node was killed (bound {DOWN_AFTER} s)", file=sys.stderr)
        self.figures["marked_down_s"] = took
        self.assertEqual(self.get(w)["state"], "lost")
        self.assertEqual(self.node_states()[n0.node_id]["state"], "down")
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM nodes WHERE id = '{n0.node_id}' "
                                     "AND down_at IS NOT NULL"), "1")
        self.assertEqual(self.get(y)["state"], "paused")
        self.assert_no_live_node_lost(2, [0, 0])  # x and w, on the dead node only
        # A lost one: no resume (409), and billing stopped at the node's last heartbeat, or at
        # what its meter had billed when that was later, never after the death.
        r = self.call("POST", x, "/resume", 409)
        self.assertIn("lost", r.json()["error"]["message"])
        self.assertEqual(self.db.sql(
            f"SELECT count(*) FILTER (WHERE l.at >= n.heartbeat_at AND l.at <= to_timestamp({died})) "
            f"FROM sandbox_state_log l, nodes n WHERE l.sandbox_id IN ('{x}', '{w}') AND l.state = 'lost' "
            f"AND n.id = '{n0.node_id}'"), "2")
        # A snapshot only on the dead node's disk: 503 naming the node, and nothing changes.
        snap = self.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{y}'")
        self.db.sql(f"UPDATE snapshots SET status = 'local' WHERE id = '{snap}'")
        r = self.call("POST", y, "/resume", 503)
        self.db.sql(f"UPDATE snapshots SET status = 'stored' WHERE id = '{snap}'")
        self.assertIn(n0.node_id, r.json()["error"]["message"])
        self.assertEqual(self.get(y)["state"], "paused")
        # From the bucket, on the other node, with its memory and files.
        t0 = time.time()
        self.assertEqual(self.call("POST", y, "/resume").json()["node"], n1.node_id)
        self.figures["resume_s"] = time.time() - t0
        self.figures["death_to_running_elsewhere_s"] = time.time() - died
        print(f"its paused sandbox resumed on the other node in {self.figures['resume_s']:.1f} s, "
              f"{self.figures['death_to_running_elsewhere_s']:.1f} s after the death", file=sys.stderr)
        self.assertEqual(self.sh(y, check), "y\nalive\n")

        # The node back on its state: the VMs of x and w outlived it and ran nowhere else, so
        # both are paused whole instead of discarded; x resumes with its memory and files.
        n0 = self.restart(0)
        for sb in (x, w):
            got = self.get(sb)
            self.assertEqual(got["state"], "paused", got)
        self.assertEqual(self.call("POST", x, "/resume").json()["node"], n0.node_id)
        self.assertEqual(self.sh(x, check), "x\nalive\n")

        # Each node's meter bills what runs on it: x's generation now on the first node by the
        # first node's (new) meter, y's on the second by the second's. (A generation on the dead
        # node may have its tail billed by the other's meter: docs/metering.md.)
        billed = lambda sb: self.db.sql(f"SELECT m.node_id FROM meter_sandboxes m JOIN sandboxes s ON "
                                        f"s.id = m.sandbox_id AND m.generation = s.generation WHERE s.id = '{sb}'")
        self.wait("each meter's bill", lambda: (billed(x), billed(y)) == (n0.node_id, n1.node_id), 30)
        self.call("DELETE", w, "", 204, 120)
        # The first node's new run says, at its first heartbeat, that it had been marked down.
        self.assert_no_live_node_lost(2, [1, 0])

        # The first node only cut off (SIGSTOP: its QEMUs run on): x lost; back, its VM of x is
        # stopped and discarded, never run on, and the node is up again.
        os.kill(n0.proc.pid, signal.SIGSTOP)
        try:
            self.wait_lost(x, time.time())
            self.assertTrue(kiln.vm_pids(n0.node_id, x), "the stopped node's QEMU should still be there")
        finally:
            os.kill(n0.proc.pid, signal.SIGCONT)
        self.wait("the fenced VM gone", lambda: not kiln.vm_pids(n0.node_id, x), 60)
        self.assertIn("is no longer this node's", n0.output())
        self.wait("the node up", lambda: self.node_states()[n0.node_id]["state"] == "up", 30)
        # Back, its heartbeat says so; the other node was never marked down.
        self.assert_no_live_node_lost(3, [2, 0])
        got = self.get(y)
        self.assertEqual((got["state"], got["node"]), ("running", n1.node_id))
        self.assertEqual(self.get(x)["state"], "lost")
        self.call("DELETE", x, "", 204, 120)
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{x}", headers=self.key).status, 404)

        # The second node upgraded to image B (the test image) with y paused on A: A stays
        # pinned against pruning while the snapshot needs it; the resume restores on A with y's
        # memory and files, and a new sandbox boots on B.
        a, hash_a, img = self.image_a, self.image_a["KILN_GUEST_IMAGE_HASH"], kiln.guest_image()
        self.call("POST", y, "/pause", timeout=180)
        self.assertEqual(self.db.sql(f"SELECT p.image_hash FROM sandboxes s JOIN snapshots p "
                                     f"ON p.id = s.pause_snapshot WHERE s.id = '{y}'"), hash_a)
        n1 = self.restart(1, {k: img[k] for k in a})
        self.assertTrue(os.path.exists(os.path.join(self.image_a_dir, ".kiln-pin-" + n1.node_id)),
                        "image A is not pinned")
        self.assertEqual(self.call("POST", y, "/resume").json()["node"], n1.node_id)
        self.assertEqual(kiln.vm_files(n1, y), (a["KILN_GUEST_KERNEL"], a["KILN_GUEST_ROOTFS"]))
        self.assertEqual(self.sh(y, check), "y\nalive\n")
        self.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id = '{n0.node_id}'")
        new = self.create()
        self.db.sql(f"UPDATE nodes SET drain_at = NULL WHERE id = '{n0.node_id}'")
        self.assertEqual(kiln.vm_files(n1, new), (img["KILN_GUEST_KERNEL"], img["KILN_GUEST_ROOTFS"]))
        self.call("DELETE", new, "", 204, 120)

        # A node that lacks A (its kernel gone) refuses the restore, naming the image; nothing
        # changes: the sandbox stays paused on A's snapshot.
        self.call("POST", y, "/pause", timeout=180)
        os.unlink(a["KILN_GUEST_KERNEL"])
        r = self.call("POST", y, "/resume", 409)
        self.assertIn(hash_a, r.json()["error"]["message"])
        self.assertIn("lacks guest image", r.json()["error"]["message"])
        self.assertEqual(self.get(y)["state"], "paused")
        self.assertFalse(kiln.vm_pids(n1.node_id, y), "a VM of the refused restore runs")
        self.call("DELETE", y, "", 204, 120)
        # Through the upgrade (the second node's new run) no live node was marked down.
        self.assert_no_live_node_lost(3, [2, 0])


if __name__ == "__main__":
    unittest.main()
