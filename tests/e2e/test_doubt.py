"""Nothing destroys on doubt: a node that cannot reach Postgres keeps the VMs of its earlier run,
a delete the sandbox's live node cannot carry out changes nothing, and a sandbox lost with its
down node is deleted at once, its VM discarded (fenced) when the node returns.

The first test stops Postgres, so it runs its own Postgres/Redis pair rather than the shared
fixture's (as tests/integration/foundation/test_healthz.py does)."""
import os
import signal
import subprocess
import tempfile
import time
import unittest

import kiln
from test_sandboxes import running, vm_pids

SERVICES = os.path.join(kiln.ROOT, "tests", "harness", "services.sh")


def shell(script):
    lib = os.path.join(kiln.ROOT, "scripts", "lib.sh")
    subprocess.run(["bash", "-c", f". {lib}; {script}"], check=True, capture_output=True)


class UnwaitedNode(kiln.Node):
    """kiln.Node started again with the same id and data, without waiting for it to listen (it
    waits for Postgres first); wait_listening() waits for that."""

    def __init__(self, old, database_url, gateway_url, extra_env):
        img = kiln.guest_image()
        self.node_id = old.node_id
        self.run_dir = old.run_dir
        self.data_dir = old.data_dir
        env = {"KILN_NODE_ID": self.node_id, "KILN_RUN_DIR": self.run_dir,
               "KILN_DATA_DIR": self.data_dir, "KILN_DATABASE_URL": database_url,
               "KILN_GATEWAY_URL": gateway_url, "KILN_LOG_LEVEL": "debug",
               "KILN_GUEST_KERNEL": img["KILN_GUEST_KERNEL"],
               "KILN_GUEST_INITRD": img["KILN_GUEST_INITRD"],
               "KILN_GUEST_ROOTFS": img["KILN_GUEST_ROOTFS"],
               "KILN_GUEST_IMAGE_HASH": img["KILN_GUEST_IMAGE_HASH"],
               "KILN_GUEST_CMDLINE": "root=/dev/vda rootfstype=ext4 rw",
               "KILN_TEMPLATES": "false", "KILN_TEMPLATE_DEFAULT": "false"}
        env.update(extra_env)
        kiln.Daemon.__init__(self, os.path.join(kiln.BUILD, "node", "kiln-node"), env)
        self.sock = os.path.join(self.run_dir, "node.sock")

    def wait_listening(self, timeout):
        """Until the node listens and its first heartbeat is in ("serving at", node/main.c): it
        listens before that beat, and until the beat the gateway still takes it for down (a
        resume of a sandbox whose snapshot is on it alone answers 503)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError("kiln-node exited:\n" + self.output())
            if os.path.exists(self.sock) and "serving at" in self.output():
                return
            time.sleep(0.2)
        raise RuntimeError("kiln-node did not start serving:\n" + self.output())


class Api:
    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600},
                            self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        return r.json()

    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]},
                            self.key, timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def get(self, sb):
        return self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key)

    def wait_state(self, sb, want, timeout=60):
        deadline = time.time() + timeout
        r = None
        while time.time() < deadline:
            r = self.get(sb)
            if r.status == 200 and r.json()["state"] == want:
                return r
            time.sleep(0.5)
        self.fail(f"the sandbox did not become {want}: {r}")


class PostgresAwayAtStartTests(Api, unittest.TestCase):
    def setUp(self):
        fd, self.envfile = tempfile.mkstemp(prefix="kiln-own-services-")
        os.close(fd)
        subprocess.run([SERVICES, "start", self.envfile], check=True, capture_output=True)
        self.addCleanup(self.services_stop)
        saved = os.environ["KILN_SERVICES_ENV"]
        os.environ["KILN_SERVICES_ENV"] = self.envfile
        self.addCleanup(os.environ.__setitem__, "KILN_SERVICES_ENV", saved)
        self.env = kiln.services_env()
        self.stack = kiln.Stack()
        self.addCleanup(self.stack.cleanup)
        self.gw = self.stack.gw
        self.key = self.stack.tenant()

    def services_stop(self):
        """The pair's stop, which fails when a node of this pair's run left anything on the
        host (tests/harness/reap.py --check), as the run's own fixture does."""
        r = subprocess.run([SERVICES, "stop", self.envfile], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_node_without_postgres_at_start_keeps_its_vms_and_recovers_them_when_it_returns(self):
        sb = self.create()
        self.sh(sb, "echo kept > /root/kept")
        old = self.stack.node
        pids = vm_pids(old.node_id, sb["id"])
        self.assertTrue(pids, "no VMM found for the sandbox")
        old.stop(signal.SIGKILL)
        old.cleanup(keep_data=True)
        d = self.env["KILN_TEST_DIR"]
        shell(f"kiln_pg_stop {d}/pg")
        node = UnwaitedNode(old, self.stack.db.url, self.gw.url,
                            {"KILN_MASTER_KEY": self.gw.master_key})
        self.stack.node = node
        time.sleep(8)
        self.assertTrue(node.alive(), "the node gave up without Postgres:\n" + node.output())
        for pid in pids:
            self.assertTrue(running(pid), f"VMM {pid} of the earlier run was killed without Postgres")
        self.assertFalse(os.path.exists(node.sock), "the node served without Postgres")
        self.assertIn("postgres is unavailable", node.output())
        shell(f"kiln_pg_start {d}/pg {d}/s {d}/pg.log")
        node.wait_listening(180)
        self.wait_state(sb, "paused")
        for pid in pids:
            self.assertFalse(running(pid), f"VMM {pid} of the earlier run left running")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/resume", None, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.sh(sb, "cat /root/kept"), "kept\n")


class DeleteOnDoubtTests(Api, unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def unreachable_node(self, down):
        """The sandbox's node made unreachable: stopped (SIGSTOP: no heartbeat, no answer) and its
        address pointed at a socket nobody listens on, its heartbeat still fresh or (`down`)
        marked stale. back() undoes it (also at the end of the test)."""
        node = self.stack.node
        node.proc.send_signal(signal.SIGSTOP)
        address = self.stack.db.sql(f"SELECT address FROM nodes WHERE id = '{node.node_id}'")
        stale = ", heartbeat_at = now() - interval '1 minute'" if down else ""
        self.stack.db.sql(f"UPDATE nodes SET address = 'unix:/nonexistent/node.sock'{stale} "
                          f"WHERE id = '{node.node_id}'")

        def back():
            self.stack.db.sql(f"UPDATE nodes SET address = '{address}' WHERE id = '{node.node_id}'")
            node.proc.send_signal(signal.SIGCONT)
        self.addCleanup(back)
        return back

    def test_a_delete_the_live_node_does_not_answer_is_503_and_changes_nothing(self):
        sb = self.create()
        pids = vm_pids(self.stack.node.node_id, sb["id"])
        back = self.unreachable_node(down=False)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key, timeout=60)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json()["error"]["code"], "unavailable")
        r = self.get(sb)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "running")
        self.assertFalse(r.json()["deleting"])
        for pid in pids:
            self.assertTrue(running(pid))
        back()
        self.assertEqual(self.sh(sb, "echo alive"), "alive\n")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.get(sb).status, 404)
        for pid in pids:
            self.assertFalse(running(pid), f"VMM {pid} left running after the delete")

    def test_a_delete_while_the_node_is_down_is_done_and_its_vm_fenced_when_the_node_returns(self):
        # A node marked down has its running sandboxes lost (docs/operations.md, "Many hosts"): a
        # delete then ends the record at once, and the node, when it returns, discards the VM
        # whose sandbox is gone (fencing) instead of running it again.
        sb = self.create()
        node = self.stack.node
        pids = vm_pids(node.node_id, sb["id"])
        back = self.unreachable_node(down=True)
        r = self.get(sb)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["state"], "lost", r)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key, timeout=60)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.get(sb).status, 404)
        for pid in pids:
            self.assertTrue(running(pid))
        back()
        deadline = time.time() + 60
        while time.time() < deadline and any(running(p) for p in pids):
            time.sleep(0.5)
        for pid in pids:
            self.assertFalse(running(pid), f"VMM {pid} left running after its node returned")
        self.assertEqual(self.get(sb).status, 404)

if __name__ == "__main__":
    unittest.main()
