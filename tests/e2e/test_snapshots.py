"""Pause, resume and fork: memory, processes and files survive; children diverge independently."""
import glob
import os
import signal
import subprocess
import time
import unittest

import kiln
from test_sandboxes import vm_pids

COUNTER_PY = b"""import time
i = 0
while True:
    i += 1
    with open('/root/log', 'a') as f:
        f.write(str(i) + chr(10))
    time.sleep(0.2)
"""
COUNTER = "nohup python3 /root/counter.py >/dev/null 2>&1 &"


class SnapshotTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def create(self, **body):
        body.setdefault("memory_mib", 256)
        body.setdefault("timeout_s", 3600)
        r = self.gw.request("POST", "/v1/sandboxes", body, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        return sb

    def start_counter(self, sb, then):
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/files?path=/root/counter.py", COUNTER_PY, self.key)
        self.assertEqual(r.status, 204, r)
        self.sh(sb, COUNTER + " " + then)
        deadline = time.time() + 90
        while time.time() < deadline and len(self.log_numbers(sb)) < 3:
            time.sleep(0.5)
        self.assertGreaterEqual(len(self.log_numbers(sb)), 3, "the counter did not start")

    def sh(self, sb, cmd, status=200):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=120)
        self.assertEqual(r.status, status, r)
        return r.json()["stdout"] if status == 200 else r.json()

    def post(self, sb, what, body=None):
        return self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/{what}", body, self.key, timeout=300)

    def log_numbers(self, sb):
        return [int(x) for x in self.sh(sb, "cat /root/log 2>/dev/null").split()]

    def test_a_counting_process_goes_on_from_exactly_where_it_was_after_pause_and_resume(self):
        sb = self.create()
        self.start_counter(sb, "echo started > /root/marker")
        r = self.post(sb, "pause")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "paused")
        self.assertEqual(vm_pids(self.stack.node.node_id, sb["id"]), set(), "a paused sandbox keeps no VMM")
        self.assertEqual(self.post(sb, "pause").status, 409)
        self.assertEqual(self.post(sb, "exec", {"cmd": ["true"]}).status, 409)
        time.sleep(2)
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "running")
        self.assertEqual(self.post(sb, "resume").status, 409)
        time.sleep(1.5)
        nums = self.log_numbers(sb)
        self.assertGreater(len(nums), 10)
        self.assertEqual(nums, list(range(1, len(nums) + 1)), "the counter restarted or skipped")
        self.assertEqual(self.sh(sb, "cat /root/marker"), "started\n")
        # The guest clock caught up: within a few seconds of the host's.
        guest_now = int(self.sh(sb, "date +%s"))
        self.assertLess(abs(guest_now - time.time()), 3)

    def test_fork_of_4_children_see_the_parent_state_then_diverge(self):
        parent = self.create()
        self.start_counter(parent, "echo parent > /root/who")
        r = self.post(parent, "fork", {"count": 4})
        self.assertEqual(r.status, 201, r)
        kids = r.json()["sandboxes"]
        for k in kids:
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{k['id']}", None, self.key)
        self.assertEqual(len(kids), 4)
        ids = {k["id"] for k in kids}
        self.assertEqual(len(ids), 4)
        self.assertNotIn(parent["id"], ids)
        for k in kids:
            self.assertEqual(k["parent_id"], parent["id"])
            self.assertEqual(k["state"], "running")
        at_fork = len(self.log_numbers(parent))
        outs = []
        for i, k in enumerate(kids):
            self.assertEqual(self.sh(k, "cat /root/who"), "parent\n")
            self.sh(k, f"echo child{i} > /root/who")
            out = self.sh(k, "hostname; echo $KILN_SANDBOX_ID; python3 -c 'import os,random; "
                             "print(os.urandom(16).hex()); print(random.random())'").split()
            outs.append(out)
            nums = self.log_numbers(k)
            self.assertGreater(len(nums), 3)
            self.assertEqual(nums, list(range(1, len(nums) + 1)), "the child's counter did not go on")
        self.assertEqual(len({o[0] for o in outs}), 4, "host names must differ")
        self.assertEqual({o[1] for o in outs}, ids)
        self.assertEqual(len({o[2] for o in outs}), 4, "os.urandom streams must differ")
        self.assertEqual(len({o[3] for o in outs}), 4, "random.random() must differ")
        for i, k in enumerate(kids):
            self.assertEqual(self.sh(k, "cat /root/who"), f"child{i}\n")
        self.assertEqual(self.sh(parent, "cat /root/who"), "parent\n")
        self.assertGreaterEqual(len(self.log_numbers(parent)), at_fork)
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for k in kids + [parent]:
            self.assertIn("kiln-" + k["id"].split("_", 1)[1][:13], netns)
            self.assertTrue(vm_pids(self.stack.node.node_id, k["id"]))

    def test_fork_bad_counts_are_422_and_change_nothing(self):
        sb = self.create()
        for count in (0, 17, -1):
            self.assertEqual(self.post(sb, "fork", {"count": count}).status, 422)
        self.assertEqual(self.post(sb, "fork", {"count": "2"}).status, 400)
        listed = self.gw.request("GET", "/v1/sandboxes", headers=self.key).json()["sandboxes"]
        self.assertEqual([s["id"] for s in listed if s["parent_id"] == sb["id"]], [])

    def test_a_named_snapshot_starts_new_sandboxes_in_the_state_it_caught(self):
        sb = self.create()
        self.start_counter(sb, "echo original > /root/who")
        r = self.post(sb, "snapshots", {"name": "warm"})
        self.assertEqual(r.status, 201, r)
        snap = r.json()
        self.assertTrue(snap["id"].startswith("snap_"))
        self.assertEqual((snap["sandbox_id"], snap["name"], snap["status"], snap["storage"]),
                         (sb["id"], "warm", "local", "local"))
        self.assertGreater(snap["size_bytes"], 0)
        listed = self.gw.request("GET", f"/v1/snapshots?sandbox_id={sb['id']}", headers=self.key).json()
        self.assertEqual([x["id"] for x in listed["snapshots"]], [snap["id"]])
        # The original goes on running after the snapshot.
        before = len(self.log_numbers(sb))
        time.sleep(1)
        self.assertGreater(len(self.log_numbers(sb)), before)
        r = self.gw.request("POST", "/v1/sandboxes", {"snapshot_id": snap["id"]}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        child = r.json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{child['id']}", None, self.key)
        self.assertEqual(self.sh(child, "cat /root/who"), "original\n")
        self.assertEqual(self.sh(child, "hostname").strip(), child["id"].replace("_", "-"))
        nums = self.log_numbers(child)
        self.assertEqual(nums, list(range(1, len(nums) + 1)))
        # A paused sandbox can be snapshotted too.
        self.assertEqual(self.post(sb, "pause").status, 200)
        r = self.post(sb, "snapshots", {})
        self.assertEqual(r.status, 201, r)
        self.assertEqual(self.gw.request("DELETE", f"/v1/snapshots/{snap['id']}", headers=self.key).status, 204)
        self.assertEqual(self.gw.request("DELETE", f"/v1/snapshots/{snap['id']}", headers=self.key).status, 404)
        r = self.gw.request("POST", "/v1/sandboxes", {"snapshot_id": snap["id"]}, self.key)
        self.assertEqual(r.status, 404)
        other = self.stack.tenant("other")
        self.assertEqual(self.gw.request("GET", "/v1/snapshots", headers=other).json()["snapshots"], [])
        self.assertEqual(self.gw.request("POST", "/v1/sandboxes/sb_nope/snapshots", {}, self.key).status, 404)

    def test_deleting_a_paused_sandbox_removes_its_snapshot(self):
        sb = self.create()
        pattern = f"{self.stack.node.data_dir}/snaps/{self.stack.node.node_id}/snap_*"
        before = set(glob.glob(pattern))
        self.assertEqual(self.post(sb, "pause").status, 200)
        snaps = set(glob.glob(pattern)) - before
        self.assertEqual(len(snaps), 1)
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key).status, 204)
        deadline = time.time() + 30
        while time.time() < deadline and any(os.path.exists(s) for s in snaps):
            time.sleep(1)
        self.assertFalse(any(os.path.exists(s) for s in snaps), "the pause snapshot's files stayed")


if __name__ == "__main__":
    unittest.main()


class SnapshotFaultTests(unittest.TestCase):
    """A node killed in the middle of a pause, and a disk too full for a snapshot."""

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        return sb

    def sh(self, sb, cmd, status=200):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=120)
        self.assertEqual(r.status, status, r)
        return r.json()["stdout"]

    def test_a_node_killed_after_the_snapshot_but_before_its_record_comes_back_paused(self):
        self.stack.restart_node({"KILN_FAULT": "pause-after-snapshot"})
        sb = self.create()
        self.sh(sb, "echo kept > /root/kept")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/pause", headers=self.key, timeout=120)
        self.assertIn(r.status, (502, 503), r)
        self.stack.node.proc.wait(30)
        self.stack.restart_node()
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "paused", "the complete snapshot was not found again")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/resume", headers=self.key, timeout=120)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")

    def test_a_full_disk_refuses_the_pause_and_the_sandbox_runs_on(self):
        sb = self.create()
        self.sh(sb, "echo still-here > /root/f")
        snaps = f"{self.stack.node.data_dir}/snaps/{self.stack.node.node_id}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", snaps], check=True)
        self.addCleanup(subprocess.run, ["umount", "-l", snaps])
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/pause", headers=self.key, timeout=120)
        self.assertEqual(r.status, 503, r)
        self.assertIn("no room", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "running")
        self.assertEqual(self.sh(sb, "cat /root/f"), "still-here\n")
