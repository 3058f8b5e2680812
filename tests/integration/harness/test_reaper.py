"""The reaper of a killed test (tests/harness/reap.py): a child test starts a gateway, a node and a
sandbox and is SIGKILLed with its node, as ctest kills a test at its timeout; its QEMU, netns,
host veth, nftables table, BPF pins, cgroups, VM run directory and uid lease outlive it. The
reaper, run on the child's registry as the "services" fixture's cleanup runs it on the run's,
leaves none of them, and kills no process whose record does not match it (another process now
has that pid)."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import kiln

REAP = os.path.join(kiln.HERE, "reap.py")

# The child: what a test does up to the moment ctest kills it.
CHILD = r"""
import json, os, sys, time
import kiln
st = kiln.Stack()
key = st.tenant("reaped")
r = st.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, key, timeout=300)
assert r.status == 201, r
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"node_id": st.node.node_id, "node_pid": st.node.proc.pid,
               "gateway_pid": st.gw.proc.pid, "sandbox": r.json()["id"], "db": st.db.name}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        return False


def cgroup_dirs(node):
    return [d for p in (f"/sys/fs/cgroup/kiln/{node}", f"/sys/fs/cgroup/*/kiln/{node}",
                        f"/sys/fs/cgroup/*/*/kiln/{node}") for d in glob.glob(p)]


def cgroup_pids(node):
    pids = set()
    for d in cgroup_dirs(node):
        for f in glob.glob(os.path.join(d, "*", "cgroup.procs")):
            with open(f) as fh:
                pids.update(int(p) for p in fh.read().split())
    return pids


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          check=True).stdout


def links():
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def nft_table(node):
    """Whether node/netsetup.c's table of `node` is there."""
    return subprocess.run(["nft", "list", "table", "inet", "kiln_" + node.replace("-", "_")],
                          capture_output=True).returncode == 0


def leases(node):
    """The owners of the uid leases (vmm/jail.h, /run/kiln/uids) naming `node`."""
    out = []
    for p in glob.glob("/run/kiln/uids/*"):
        with open(p) as f:
            owner = f.read()
        if owner.startswith(node + "/"):
            out.append(owner)
    return sorted(out)


class ReaperTests(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kiln-reaper-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.registry = os.path.join(self.tmp, "daemons")
        self.ready = os.path.join(self.tmp, "ready.json")
        # whatever happens below, nothing of the child's is left (the same reaper, once more)
        self.addCleanup(subprocess.run, [sys.executable, REAP, self.registry], timeout=60)

    def test_a_killed_test_leaves_nothing_after_the_reaper(self):
        env = dict(os.environ, KILN_TEST_REGISTRY=self.registry)
        child = subprocess.Popen([sys.executable, "-c", CHILD, self.ready], env=env)
        self.addCleanup(lambda: child.poll() is None and child.kill())
        deadline = time.time() + 240
        while time.time() < deadline and not os.path.exists(self.ready) and child.poll() is None:
            time.sleep(0.1)
        self.assertTrue(os.path.exists(self.ready), "the child made no sandbox")
        with open(self.ready) as f:
            made = json.load(f)
        sockdir = kiln.services_env()["KILN_TEST_SOCKDIR"]
        self.addCleanup(kiln.psql, sockdir, "postgres",
                        f"DROP DATABASE IF EXISTS {made['db']} WITH (FORCE)")
        node, sb = made["node_id"], made["sandbox"]
        net = sb.split("_", 1)[1][:13]  # node/sandbox.c's network id
        records = sorted(os.listdir(self.registry))
        self.assertEqual(len(records), 2, records)
        logs = []
        for rec in records:
            with open(os.path.join(self.registry, rec)) as f:
                logs.append(json.load(f)["log"])
        self.assertTrue(all(os.path.exists(p) for p in logs), logs)

        # ctest's timeout: the test process dies; its node is killed too (a node killed keeps
        # its VMs running, as one that crashed does), and the gateway lives on.
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        os.kill(made["node_pid"], signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and alive(made["node_pid"]):
            time.sleep(0.05)
        vms = cgroup_pids(node)
        # What is left, so the checks below can fail.
        self.assertNotEqual(vms, set(), "no VM process in the node's cgroups")
        self.assertTrue(all(alive(p) for p in vms))
        self.assertTrue(alive(made["gateway_pid"]))
        self.assertIn(f"kiln-{net}", netns_names())
        self.assertIn(f"kv{net}", links())
        self.assertTrue(os.path.isdir(f"/sys/fs/bpf/kiln/{node}"))
        self.assertNotEqual(cgroup_dirs(node), [])
        self.assertTrue(nft_table(node), "the node's nftables table is not there")
        self.assertTrue(os.path.isdir(f"/run/kiln/{node}/{sb}"))
        self.assertEqual(leases(node), [f"{node}/{sb}"])

        # A record whose pid is now another process (its start time differs): not killed.
        bystander = subprocess.Popen(["sleep", "120"])
        self.addCleanup(bystander.kill)
        with open(os.path.join(self.registry, "kiln-gateway-stale.json"), "w") as f:
            json.dump({"kind": "kiln-gateway", "pid": bystander.pid, "start_time": 1,
                       "exe": os.path.realpath("/bin/sleep")}, f)

        r = subprocess.run([sys.executable, REAP, self.registry], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertTrue(alive(bystander.pid), "the reaper killed a process it did not start")
        self.assertEqual(os.listdir(self.registry), [])
        self.assertFalse(alive(made["gateway_pid"]))
        self.assertEqual([p for p in vms if alive(p)], [], "a VM process outlived the reaper")
        self.assertNotIn(f"kiln-{net}", netns_names())
        self.assertNotIn(f"kv{net}", links())
        self.assertFalse(os.path.exists(f"/sys/fs/bpf/kiln/{node}"))
        self.assertEqual(cgroup_dirs(node), [])
        self.assertFalse(nft_table(node), "the node's nftables table outlived the reaper")
        self.assertEqual(glob.glob(f"/dev/shm/kiln-{node}-*"), [])
        self.assertFalse(os.path.exists(f"/run/kt-{node}"))
        # the VM's run directory and uid lease, which only the node's next start would remove
        self.assertFalse(os.path.exists(f"/run/kiln/{node}"))
        self.assertEqual(leases(node), [])
        self.assertEqual([p for p in logs if os.path.exists(p)], [], "the daemons' logs are left")
        self.assertEqual([p for p in os.listdir("/proc") if p.isdigit() and node in cmdline(p)], [],
                         "a process naming the node is left")

        # Reaping again finds nothing to do and fails on nothing.
        r = subprocess.run([sys.executable, REAP, self.registry], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual((r.returncode, r.stdout), (0, ""))


if __name__ == "__main__":
    unittest.main()
