"""Pause, resume and fork: memory, processes and files survive; children diverge independently."""
import glob
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import kiln
from test_sandboxes import netns_list, running, uid_leases, vm_pids

COUNTER_PY = b"""import time
i = 0
while True:
    i += 1
    with open('/root/log', 'a') as f:
        f.write(str(i) + chr(10))
    time.sleep(0.2)
"""
COUNTER = "nohup python3 /root/counter.py >/dev/null 2>&1 &"
# A node's log line at a fault point it holds at (common/fault.c)
HELD = re.compile(r'fault point "([^"]+)": held')
# A loaded host (ctest -j2 beside other work) can take minutes to boot a guest under TCG: a boot
# that runs out of time fails a create, which these tests are not about.
BOOT = {"KILN_BOOT_TIMEOUT_S": "600"}


class Helpers:
    """A stack of the class's own (its node with the class's ENV), and its sandboxes through the
    API."""

    ENV = BOOT

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env=cls.ENV)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def restart_node(self, env=None):
        """The class's node started again (as after a crash), with `env` beside BOOT."""
        self.stack.restart_node({**BOOT, **(env or {})})

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

    def pause(self, sb):
        """Pauses `sb`; its pause snapshot's id."""
        r = self.post(sb, "pause")
        self.assertEqual((r.status, r.json().get("state")), (200, "paused"), r)
        return self.stack.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{sb['id']}'")

    def warm_of(self, snap, timeout=120):
        """The id of the VMM started ahead on pause snapshot `snap` (node/warm.c), once it waits."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(rf'paused snapshot "{snap}": VMM "(0[a-z2-7]{{12}})" started ahead',
                          self.stack.node.output())
            if m and vm_pids(self.stack.node.node_id, m.group(1)):
                return m.group(1)
            time.sleep(0.2)
        self.fail(f"no VMM started ahead on {snap}:\n" + self.stack.node.output()[-3000:])


class SnapshotTests(Helpers, unittest.TestCase):
    """Each test's sandboxes serve every check that can share them: a boot is the slow part."""

    def test_a_counting_process_goes_on_from_exactly_where_it_was_after_pause_and_resume(self):
        """A counting process goes on after a pause and a resume; deleted paused, the sandbox's
        snapshot goes with it."""
        sb = self.create()
        self.start_counter(sb, "echo started > /root/marker")
        snap = self.pause(sb)
        self.assertEqual(vm_pids(self.stack.node.node_id, sb["id"]), set(), "a paused sandbox keeps no VMM")
        self.assertEqual(self.post(sb, "pause").status, 409)
        self.assertEqual(self.post(sb, "exec", {"cmd": ["true"]}).status, 409)
        time.sleep(2)
        self.warm_of(snap)  # the default paused_warm_vms: one waits for its resume
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "running")
        self.assertRegex(self.stack.node.output(),
                         rf'sandbox "{sb["id"]}" restored from \S+/{snap} in \d+ ms: .*its VMM started ahead')
        self.assertEqual(self.post(sb, "resume").status, 409)
        time.sleep(1.5)
        nums = self.log_numbers(sb)
        self.assertGreater(len(nums), 10)
        self.assertEqual(nums, list(range(1, len(nums) + 1)), "the counter restarted or skipped")
        self.assertEqual(self.sh(sb, "cat /root/marker"), "started\n")
        # The guest clock caught up: within a few seconds of the host's.
        guest_now = int(self.sh(sb, "date +%s"))
        self.assertLess(abs(guest_now - time.time()), 3)
        self.deleting_it_paused_removes_its_snapshot(sb)

    def test_fork_of_4_children_see_the_parent_state_then_diverge(self):
        """Forks of bad counts are refused and make nothing; four children see the parent's state,
        then diverge."""
        parent = self.create()
        self.fork_bad_counts_are_422_and_change_nothing(parent)
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
        # each child's eBPF programs were loaded ahead, beside the parent's snapshot (sandbox.c)
        log = self.stack.node.output()
        for k in kids:
            m = re.search(r'sandbox "%s": network up in \d+ ms: .*\(programs loaded ahead in '
                          r'(-?\d+)\)' % re.escape(k["id"]), log)
            self.assertTrue(m, "no network line for " + k["id"])
            self.assertGreaterEqual(int(m.group(1)), 0,
                                    "the child's programs were not loaded ahead")

    def fork_bad_counts_are_422_and_change_nothing(self, sb):
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

    def deleting_it_paused_removes_its_snapshot(self, sb):
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


class ResumeWarmVmTests(Helpers, unittest.TestCase):
    """Resumes on a VMM started ahead on the pause snapshot (node/warm.c, paused_warm_vms): the
    resume takes its QEMU, namespace and uid and copies the memory in; while it waits it holds
    none of the guest's memory; only the latest paused sandbox keeps one here (paused_warm_vms
    1); one whose sandbox is deleted goes; one that died leaves the resume to restore anew."""

    ENV = {**BOOT, "KILN_TEMPLATES": "false", "KILN_PAUSED_WARM_VMS": "1"}

    def mem_file(self, name):
        return f"/dev/shm/kiln-{self.stack.node.node_id}-{name}.mem"

    def assert_gone(self, w, pids, timeout=0):
        """Nothing of warm VM `w` (whose processes were `pids`) left, within `timeout` s."""
        node = self.stack.node.node_id
        deadline = time.time() + timeout
        while True:
            left = [p for p in pids if running(p)] + \
                (["lease"] if f"{node}/{w}" in uid_leases() else []) + \
                (["netns"] if "kiln-" + w in netns_list() else []) + \
                glob.glob(f"/sys/fs/cgroup/*/kiln/{node}/{w}") + glob.glob(f"/run/kiln/{node}/{w}") + \
                glob.glob(f"{self.stack.node.data_dir}/vms/{node}/{w}") + glob.glob(self.mem_file(w))
            if not left or time.time() >= deadline:
                break
            time.sleep(0.5)
        self.assertEqual(left, [], f"left of the VMM started ahead {w}")

    def restored_lines(self, sid):
        return [line for line in self.stack.node.output().splitlines()
                if f'sandbox "{sid}" restored from' in line]

    def test_a_resume_takes_the_vmm_started_ahead_on_its_snapshot_and_a_delete_removes_one(self):
        node = self.stack.node.node_id
        sb = self.create()
        sid = sb["id"]
        self.sh(sb, "echo m-$$ > /dev/shm/m; nohup sleep 3600 >/dev/null 2>&1 & echo $! > /dev/shm/pid")
        marker = self.sh(sb, "cat /dev/shm/m")
        snap = self.pause(sb)
        w = self.warm_of(snap)
        pids = vm_pids(node, w)
        uid = uid_leases()[f"{node}/{w}"]
        self.assertIn("kiln-" + w, netns_list())
        st = os.stat(self.mem_file(w))
        # the guest's length, none of its memory while it waits: the pause gave that back
        self.assertEqual(st.st_size, 256 << 20)
        self.assertLess(st.st_blocks * 512, 1 << 20, "the waiting VMM holds the guest's memory")
        r = self.post(sb, "resume")
        self.assertEqual((r.status, r.json().get("state")), (200, "running"), r)
        lines = self.restored_lines(sid)
        self.assertEqual(len(lines), 1, lines)  # the resume's (a boot logs none)
        self.assertRegex(lines[-1], rf"restored from \S+/{snap} in \d+ ms: .*its VMM started ahead")
        # the same QEMU, now the sandbox's, under its uid; nothing left under the warm VM's name
        self.assertEqual(vm_pids(node, sid), pids)
        self.assertEqual({os.stat(f"/proc/{p}").st_uid for p in pids}, {uid})
        self.assertEqual(uid_leases().get(f"{node}/{sid}"), uid)
        self.assert_gone(w, [])
        # the memory copied in: the guest's files in its tmpfs and its processes are back
        self.assertGreater(os.stat(self.mem_file(sid)).st_blocks * 512, 8 << 20)
        self.assertEqual(self.sh(sb, "cat /dev/shm/m; kill -0 $(cat /dev/shm/pid) && echo alive"),
                         marker + "alive\n")
        snap_mem = f"{self.stack.node.data_dir}/snaps/{node}/{snap}/mem"
        deadline = time.time() + 20
        while time.time() < deadline and os.path.exists(snap_mem):
            time.sleep(0.2)
        self.assertFalse(os.path.exists(snap_mem), "the resumed snapshot kept its memory image")
        # paused again and deleted paused: its VMM started ahead goes with the snapshot's files
        snap2 = self.pause(sb)
        w2 = self.warm_of(snap2)
        pids2 = vm_pids(node, w2)
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=self.key).status, 204)
        self.assert_gone(w2, pids2, timeout=30)

    def test_only_the_latest_paused_keeps_one_and_a_dead_one_leaves_the_resume_to_restore_anew(self):
        node = self.stack.node.node_id
        a, b = self.create(), self.create()
        snap_a = self.pause(a)
        wa = self.warm_of(snap_a)
        pa = vm_pids(node, wa)
        snap_b = self.pause(b)
        wb = self.warm_of(snap_b)
        self.assert_gone(wa, pa, timeout=30)  # paused_warm_vms 1: the older one made room
        r = self.post(a, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertNotIn("its VMM started ahead", self.restored_lines(a["id"])[-1])
        self.assertEqual(self.sh(a, "echo ok"), "ok\n")
        pb = vm_pids(node, wb)
        for pid in pb:
            os.kill(pid, signal.SIGKILL)
        r = self.post(b, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertIn(f'resuming "{b["id"]}" on a VMM started ahead failed', self.stack.node.output())
        self.assertNotIn("its VMM started ahead", self.restored_lines(b["id"])[-1])
        self.assertEqual(self.sh(b, "echo ok"), "ok\n")
        self.assert_gone(wb, pb)

    def test_a_node_killed_with_one_waiting_leaves_none_at_its_restart_and_the_sandbox_resumes(self):
        node = self.stack.node
        sb = self.create()
        snap = self.pause(sb)
        w = self.warm_of(snap)
        pids = vm_pids(node.node_id, w)
        self.assertTrue(os.path.exists(self.mem_file(w)))
        node.stop(signal.SIGKILL)
        for pid in pids:
            self.assertTrue(running(pid), "the VMM should outlive a killed node")
        self.restart_node(self.ENV)
        self.assert_gone(w, pids)
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertNotIn("its VMM started ahead", self.restored_lines(sb["id"])[-1])
        self.assertEqual(self.sh(sb, "echo ok"), "ok\n")


class BandwidthSnapshotTests(Helpers, unittest.TestCase):
    """The bandwidth bucket across pause, resume and fork: what was spent stays spent."""

    # no refill: any byte more after a resume or in a child would have been minted
    BW = {"quota_bytes": 20000, "refill_bytes": 0, "refill_interval_s": 3600, "one_time_burst_bytes": 5000}
    FULL = 25000

    def remaining(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/bandwidth", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()["remaining_bytes"]

    def send(self, sb, count):
        """UDP datagrams of 1,000 bytes to a public address: 1,042 bytes charged each, if any left."""
        self.sh(sb, "python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                    f"[s.sendto(bytes(1000), (\"198.51.100.1\", 9)) for _ in range({count})]'")

    def test_a_spent_quota_stays_spent_across_pause_and_resume(self):
        sb = self.create(bandwidth=self.BW)
        self.assertEqual(self.remaining(sb), self.FULL)
        self.send(sb, 30)
        before = self.remaining(sb)
        self.assertLess(before, 1042, "the quota was not used up")
        self.assertEqual(self.post(sb, "pause").status, 200)
        time.sleep(1)
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.remaining(sb), before, "the resume refilled the bucket (or its burst)")
        self.send(sb, 5)
        self.assertEqual(self.remaining(sb), before, "traffic went out past a spent quota")

    def test_a_fork_child_starts_with_the_parent_s_bucket_not_a_full_one(self):
        parent = self.create(bandwidth=self.BW)
        self.send(parent, 10)
        level = self.remaining(parent)
        self.assertLessEqual(level, self.FULL - 10 * 1042)
        r = self.post(parent, "fork", {"count": 1})
        self.assertEqual(r.status, 201, r)
        kid = r.json()["sandboxes"][0]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{kid['id']}", None, self.key)
        self.assertEqual(self.remaining(kid), level, "the child's bucket was not the parent's")
        self.assertEqual(self.remaining(parent), level)
        self.send(kid, 5)
        self.assertEqual(self.remaining(kid), level - 5 * 1042)
        self.assertEqual(self.remaining(parent), level, "the child's traffic was charged to the parent")


class SnapshotFaultTests(Helpers, unittest.TestCase):
    """A node killed in the middle of a pause, and a disk too full for a snapshot."""

    # Every step of a pause a node can die at (common/fault.h), in order.
    CUT_POINTS = ["pause-space-reserved", "snapshot-vcpus-stopped", "snapshot-migrating",
                  "snapshot-state-saved", "snapshot-vmm-ended", "snapshot-memory-moved",
                  "snapshot-before-manifest", "pause-before-manifest", "pause-after-snapshot"]

    def state(self, sb):
        return self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()["state"]

    def snapshot_dirs(self):
        node = self.stack.node
        return {os.path.basename(d) for d in glob.glob(f"{node.data_dir}/snaps/{node.node_id}/snap_*")}

    def recorded_snapshots(self):
        return set(self.stack.db.sql("SELECT id FROM snapshots").split())

    def assert_counter_went_on(self, sb, before):
        """The counter kept its numbers: no restart, no gap, and it counts again."""
        time.sleep(1)
        nums = self.log_numbers(sb)
        self.assertEqual(nums, list(range(1, len(nums) + 1)), "the counter restarted or skipped")
        self.assertGreater(len(nums), before)
        return len(nums)

    def hold_at(self, hold, point, seen):
        """Lets a pause on through each point it holds at (removing `hold`) until it holds at
        `point`. `seen`: the lines "held" the node had logged before the pause."""
        deadline = time.time() + 120
        while time.time() < deadline:
            # the node makes the file, then logs the line, then waits
            names = HELD.findall(self.stack.node.output())
            if len(names) > seen and names[seen] == point:
                return
            if len(names) > seen:
                os.unlink(hold)
                seen += 1
            time.sleep(0.02)
        self.fail(f"the pause did not reach {point}")

    def test_a_node_killed_anywhere_inside_a_pause_comes_back_with_the_sandbox_paused_whole(self):
        # Every node of this test holds at every point of a pause while its hold file can be made:
        # a pause is let on through the points before the one under test, and the node is killed
        # (SIGKILL) holding at that one. Without the hold file's folder the points pass (a node
        # finishing an interrupted pause as it starts, a resume), so no restart is needed to arm
        # a point, nor a pause and a resume around that restart.
        folder = os.path.join(tempfile.gettempdir(), f"kiln-hold-{os.getpid()}-{time.time_ns()}")
        hold = os.path.join(folder, "held")
        held = {"KILN_FAULT_HOLD": ",".join(self.CUT_POINTS), "KILN_FAULT_HOLD_FILE": hold}
        self.restart_node(held)
        self.addCleanup(self.restart_node)  # the next tests' node holds nowhere
        self.addCleanup(subprocess.run, ["rm", "-rf", folder])
        sb = self.create()
        self.start_counter(sb, "echo kept > /root/kept")
        count = len(self.log_numbers(sb))
        for point in self.CUT_POINTS:
            with self.subTest(point=point):
                os.mkdir(folder)
                seen = len(HELD.findall(self.stack.node.output()))
                result = {}
                pause = threading.Thread(target=lambda: result.update(r=self.post(sb, "pause")))
                pause.start()
                try:
                    self.hold_at(hold, point, seen)
                    self.stack.node.stop(signal.SIGKILL)
                finally:
                    subprocess.run(["rm", "-rf", folder])
                    pause.join(300)
                r = result["r"]
                self.assertIn(r.status, (502, 503), r)
                self.restart_node(held)
                self.assertEqual(self.state(sb), "paused")
                self.assertEqual(vm_pids(self.stack.node.node_id, sb["id"]), set())
                self.assertLessEqual(self.snapshot_dirs(), self.recorded_snapshots(),
                                     "a snapshot directory nothing records was left")
                r = self.post(sb, "resume")
                self.assertEqual(r.status, 200, r)
                self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")
                count = self.assert_counter_went_on(sb, count)

    def test_a_resume_refused_at_its_verification_leaves_no_policy_pins_and_resumes_later(self):
        # A resume loads the sandbox's eBPF programs and pins their maps ahead, beside the
        # verification of its snapshot (node/sandbox.c, sb_net_prepare): a resume refused there,
        # before any network of it exists, must take those pins away again.
        sb = self.create()
        rules = ["203.0.113.7:443"]
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/egress", {"rules": rules}, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.post(sb, "pause").status, 200)
        node = self.stack.node
        snap = self.stack.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{sb['id']}'").strip()
        mem = f"{node.data_dir}/snaps/{node.node_id}/{snap}/mem"
        pins = f"/sys/fs/bpf/kiln/{node.node_id}/{sb['id']}"
        size = os.path.getsize(mem)
        with open(mem, "ab") as f:
            f.write(b"x")  # one byte more than its manifest says: the verification refuses it
        try:
            r = self.post(sb, "resume")
        finally:
            os.truncate(mem, size)
        self.assertGreaterEqual(r.status, 400, r)
        self.assertEqual(self.state(sb), "paused")
        self.assertFalse(os.path.exists(pins), f"the refused resume left its policy pins: {pins}")
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertTrue(os.path.exists(pins))
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": rules, "mode": "allowlist"})

    def test_a_node_killed_with_a_running_sandbox_comes_back_with_it_paused(self):
        sb = self.create()
        self.start_counter(sb, "echo kept > /root/kept")
        rules = ["example.com", "203.0.113.7:443"]
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/egress", {"rules": rules}, self.key)
        self.assertEqual(r.status, 200, r)
        count = len(self.log_numbers(sb))
        node = self.stack.node
        pids = vm_pids(node.node_id, sb["id"])
        node.stop(signal.SIGKILL)
        self.restart_node()
        for pid in pids:
            self.assertFalse(running(pid), f"VMM {pid} of the earlier run left running")
        self.assertEqual(self.state(sb), "paused")
        self.assertEqual(glob.glob(f"/dev/shm/*{sb['id']}*"), [])
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")
        self.assert_counter_went_on(sb, count)
        # its rules came through the restart: from the pinned maps into the snapshot, and back
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": rules, "mode": "allowlist"})

    def held_pause(self, sb, hold, during):
        """Pauses `sb` on a node holding at its space check; `during()` runs while it holds."""
        result = {}
        pause = threading.Thread(target=lambda: result.update(r=self.post(sb, "pause")))
        pause.start()
        deadline = time.time() + 60
        while not os.path.exists(hold) and time.time() < deadline:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(hold), "the pause did not reach its space check")
        during()
        os.unlink(hold)
        pause.join(120)
        return result["r"]

    def test_a_disk_full_or_filling_up_during_the_save_fails_the_pause_and_the_sandbox_runs_on(self):
        hold = os.path.join(tempfile.gettempdir(), f"kiln-hold-{os.getpid()}-{time.time_ns()}")
        # after the node below is replaced: until then it may hold (make the file) again
        self.addCleanup(lambda: os.path.exists(hold) and os.unlink(hold))
        self.restart_node({"KILN_FAULT_HOLD": "pause-space-reserved", "KILN_FAULT_HOLD_FILE": hold})
        sb = self.create()
        self.addCleanup(self.restart_node)  # the next tests' node holds nowhere
        # A disk already too full is refused before the node reserves anything (so before the
        # point it holds at).
        self.a_full_disk_refuses_the_pause_and_the_sandbox_runs_on(sb)
        self.start_counter(sb, "echo kept > /root/kept")
        snaps = f"{self.stack.node.data_dir}/snaps/{self.stack.node.node_id}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", snaps], check=True)
        self.addCleanup(subprocess.run, ["umount", "-l", snaps])
        filler = f"{snaps}/filler"

        def fill():
            # The check passed; now something else takes the space, leaving 4 MiB.
            vfs = os.statvfs(snaps)
            subprocess.run(["fallocate", "-l", str(vfs.f_bavail * vfs.f_frsize - (4 << 20)), filler],
                           check=True)

        r = self.held_pause(sb, hold, fill)
        self.assertEqual(r.status, 503, r)
        self.assertIn("runs on", r.json()["error"]["message"])
        self.assertEqual(self.state(sb), "running")
        self.assertEqual(os.listdir(snaps), ["filler"], "a partial snapshot was left")
        self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")
        count = self.assert_counter_went_on(sb, 0)
        # With the space back, the same sandbox pauses and resumes whole.
        os.unlink(filler)
        r = self.held_pause(sb, hold, lambda: None)
        self.assertEqual(r.status, 200, r)
        r = self.post(sb, "resume")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")
        self.assert_counter_went_on(sb, count)

    def a_full_disk_refuses_the_pause_and_the_sandbox_runs_on(self, sb):
        self.sh(sb, "echo still-here > /root/f")
        snaps = f"{self.stack.node.data_dir}/snaps/{self.stack.node.node_id}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", snaps], check=True)
        try:
            r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/pause", headers=self.key, timeout=120)
        finally:
            subprocess.run(["umount", "-l", snaps], check=True)
        self.assertEqual(r.status, 503, r)
        self.assertIn("no room", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "running")
        self.assertEqual(self.sh(sb, "cat /root/f"), "still-here\n")


if __name__ == "__main__":
    unittest.main()
