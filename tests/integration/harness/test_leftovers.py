"""What the nodes of a test run leave on the host, checked at the run's end: the "services" fixture's
cleanup (services.sh stop) reaps the daemons a test left (reap.py) and then fails when any node the
run started left something behind (reap.py --check on KILN_TEST_DIR/nodes, the run's list of node
ids that kiln.py keeps). Each case runs a services pair of its own, as a test run of its own.

- A node killed with a sandbox (the hook's agent on the host as its guest, no VM) leaves its VM
  run directory /run/kiln/<node>/<sandbox>/ and the sandbox's uid lease in /run/kiln/uids. When
  its test never cleans it up (killed at its timeout), the reaper at the end of the run removes
  both, and the stop passes; when its test cleans it up without starting it again, kiln.py reaps
  it there and then, its guest included.
- A cleanly stopped node leaves nothing, and the stop passes.
- What a node of the run left (planted: a VM run directory and a lease naming it) fails the stop,
  is named and removed; the same things of a node id the run did not start are not touched.
- What a test left in the run's temporary directory (KILN_TEST_DIR/tmp, the tests' TMPDIR) fails
  the stop, is named and removed.
- A gateway or a node that exits at its start leaves none of the harness's temporary files (its
  log, the admin key's file) nor its record; a gateway its test never stops leaves neither after
  the reaper.
"""
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import unittest

import kiln
import reap

SERVICES = os.path.join(kiln.ROOT, "tests", "harness", "services.sh")
VM_RUN_ROOT = "/run/kiln"  # vmm/orphan.h: a node's VMs' run directories, <root>/<node>/<id>/
LEASE_DIR = "/run/kiln/uids"  # vmm/jail.h: <uid>, holding "<node>/<id>"


def leases(node):
    """The owners of the uid leases that name `node`."""
    out = []
    for name in os.listdir(LEASE_DIR) if os.path.isdir(LEASE_DIR) else []:
        with open(os.path.join(LEASE_DIR, name)) as f:
            owner = f.read()
        if owner.startswith(node + "/"):
            out.append(owner)
    return sorted(out)


def plant(node, sb):
    """A VM run directory and a uid lease of sandbox `sb` of `node`, as a node leaves them;
    returns the lease's path."""
    os.makedirs(f"{VM_RUN_ROOT}/{node}/{sb}/jail", mode=0o711)
    with open(f"{VM_RUN_ROOT}/{node}/{sb}/vm.log", "w") as f:
        f.write("left\n")
    os.makedirs(LEASE_DIR, mode=0o700, exist_ok=True)
    for uid in range(64000, 65000):  # vmm/jail.h's range, taken as jail_uid_alloc() takes it
        path = f"{LEASE_DIR}/{uid}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        os.write(fd, f"{node}/{sb}".encode())
        os.close(fd)
        return path
    raise RuntimeError("no free uid to plant a lease")


def unplant(node, lease):
    shutil.rmtree(f"{VM_RUN_ROOT}/{node}", ignore_errors=True)
    # Once released, the uid is free: a node of a test running alongside may hold it now.
    try:
        with open(lease) as f:
            if f.read().startswith(node + "/"):
                os.unlink(lease)
    except FileNotFoundError:
        pass


class LeftoverTests(unittest.TestCase):
    def setUp(self):
        # A test run of its own: its own Postgres, Redis, registry and list of nodes.
        self.envfile = os.path.join(tempfile.gettempdir(), f"kiln-leftovers-{secrets.token_hex(4)}.env")
        subprocess.run([SERVICES, "start", self.envfile], check=True, capture_output=True)
        self.addCleanup(subprocess.run, [SERVICES, "stop", self.envfile], capture_output=True)
        saved = os.environ["KILN_SERVICES_ENV"]
        os.environ["KILN_SERVICES_ENV"] = self.envfile
        self.addCleanup(os.environ.__setitem__, "KILN_SERVICES_ENV", saved)
        self.dir = kiln.services_env()["KILN_TEST_DIR"]

    def stop(self):
        return subprocess.run([SERVICES, "stop", self.envfile], capture_output=True, text=True,
                              timeout=120)

    def stack(self):
        """A gateway and a node on the hook (no VM); torn down by down() before the run stops."""
        stack = kiln.Stack(hostagent=True, node_env={"KILN_LOG_LEVEL": "info"})
        self.addCleanup(self.down, stack)
        return stack

    def down(self, stack, node=True):
        if getattr(stack, "down", False):
            return
        stack.down = True
        if node:
            stack.node.cleanup()
        stack.gw.cleanup()
        stack.db.drop()

    def sandbox(self, stack):
        key = stack.tenant("leftovers")
        r = stack.gw.request("POST", "/v1/sandboxes", {}, key, timeout=120)
        self.assertEqual(r.status, 201, r)
        return r.json()["id"]

    def test_a_killed_node_never_stopped_by_its_test_is_reaped_at_the_end_of_the_run(self):
        stack = self.stack()
        node = stack.node.node_id
        sb = self.sandbox(stack)
        self.assertEqual(leases(node), [f"{node}/{sb}"])
        self.assertTrue(os.path.isdir(f"{VM_RUN_ROOT}/{node}/{sb}"))
        # Killed, and its test killed too (ctest's timeout): nothing stops or cleans it up.
        stack.node.stop(signal.SIGKILL)
        self.down(stack, node=False)
        self.assertEqual(leases(node), [f"{node}/{sb}"])
        self.assertTrue(os.path.isdir(f"{VM_RUN_ROOT}/{node}/{sb}"))
        r = self.stop()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(leases(node), [], r.stdout)
        self.assertFalse(os.path.exists(f"{VM_RUN_ROOT}/{node}"), r.stdout)
        self.assertFalse(os.path.exists(stack.node.log.name), r.stdout)
        self.assertNotIn("check: FAILED", r.stdout)

    def test_a_killed_node_is_reaped_when_its_test_cleans_it_up(self):
        stack = self.stack()
        node = stack.node.node_id
        sb = self.sandbox(stack)
        agents = kiln.vm_pids(node, sb)
        self.assertNotEqual(agents, set(), "the sandbox's guest (the hook's agent) is not in its cgroup")
        # Killed as a crash test kills it, and not started again: its cleanup reaps it at once.
        stack.node.stop(signal.SIGKILL)
        self.down(stack)
        self.assertEqual(leases(node), [])
        self.assertFalse(os.path.exists(f"{VM_RUN_ROOT}/{node}"))
        # Ended (a zombie until init, its parent now, collects it, which a loaded host delays).
        self.assertEqual(reap.wait_gone(sorted(agents), 10), [],
                         "the sandbox's guest outlived its node's cleanup")
        self.assertEqual(os.listdir(os.path.join(self.dir, "daemons")), [])
        r = self.stop()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_cleanly_stopped_node_leaves_nothing(self):
        stack = self.stack()
        node = stack.node.node_id
        sb = self.sandbox(stack)
        self.assertEqual(leases(node), [f"{node}/{sb}"])
        self.assertEqual(stack.node.stop(), 0, stack.node.output())
        self.down(stack)
        self.assertEqual(sorted(os.listdir(os.path.join(self.dir, "nodes"))), [node + ".json"])
        r = self.stop()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(leases(node), [])
        self.assertFalse(os.path.exists(f"{VM_RUN_ROOT}/{node}"))

    def test_what_a_node_of_the_run_left_fails_the_stop_and_only_that_run_is_looked_at(self):
        # A node of the run, stopped cleanly; then what a node leaves, as if it had left it.
        stack = self.stack()
        self.assertEqual(stack.node.stop(), 0, stack.node.output())
        self.down(stack)
        ours, theirs = stack.node.node_id, "t" + secrets.token_hex(4)
        ours_lease = plant(ours, "sb_left")
        self.addCleanup(unplant, ours, ours_lease)
        theirs_lease = plant(theirs, "sb_theirs")
        self.addCleanup(unplant, theirs, theirs_lease)

        r = self.stop()
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"check: FAILED node {ours} left {VM_RUN_ROOT}/{ours}: sb_left", r.stdout)
        self.assertIn(f"check: FAILED node {ours} left uid lease {ours_lease}: {ours}/sb_left",
                      r.stdout)
        # removed, so that the next run starts on a clean host
        self.assertFalse(os.path.exists(f"{VM_RUN_ROOT}/{ours}"))
        self.assertEqual(leases(ours), [])  # its uid may be another node's lease by now
        # another run's node: not named, not touched
        self.assertNotIn(theirs, r.stdout)
        self.assertTrue(os.path.exists(f"{VM_RUN_ROOT}/{theirs}/sb_theirs/vm.log"))
        with open(theirs_lease) as f:
            self.assertEqual(f.read(), f"{theirs}/sb_theirs")

    def test_what_a_test_left_in_the_runs_temporary_directory_fails_the_stop(self):
        # The run's TMPDIR (kiln.py points tempfile and the daemons at it): a file and a folder
        # a test made and never removed.
        tmp = os.path.join(self.dir, "tmp")
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "kiln-admin-key-left"), "w") as f:
            f.write("key\n")
        os.makedirs(os.path.join(tmp, "kiln-place-left", "inside"))
        r = self.stop()
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"check: FAILED a test left {tmp}/kiln-admin-key-left", r.stdout)
        self.assertIn(f"check: FAILED a test left {tmp}/kiln-place-left", r.stdout)
        self.assertNotIn("inside", r.stdout)  # what is in a folder goes with it, unnamed
        self.assertFalse(os.path.exists(self.dir), r.stdout)

    def test_a_gateway_never_stopped_by_its_test_leaves_no_file(self):
        # Its test killed at its timeout: the reaper ends the gateway and removes its log and the
        # admin key file it wrote.
        db = kiln.fresh_database()
        gw = kiln.Gateway(db.url, kiln.services_env()["KILN_REDIS_URL"])
        self.assertTrue(gw.admin_key)
        r = self.stop()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertFalse(gw.alive())
        self.assertFalse(os.path.exists(gw.admin_key_file), r.stdout)
        self.assertFalse(os.path.exists(gw.log.name), r.stdout)

    def test_a_daemon_that_never_starts_leaves_nothing(self):
        # The harness's temporary files (a daemon's log, a gateway's admin key file) of a gateway
        # and a node that exit at start over a setting they refuse: their test never gets them
        # to clean up.
        private = tempfile.mkdtemp(prefix="kiln-start-")
        self.addCleanup(shutil.rmtree, private, True)
        saved = tempfile.tempdir
        tempfile.tempdir = private
        self.addCleanup(setattr, tempfile, "tempdir", saved)
        db = kiln.fresh_database()
        redis = kiln.services_env()["KILN_REDIS_URL"]
        with self.assertRaisesRegex(RuntimeError, "exited"):
            kiln.Gateway(db.url, redis, {"KILN_HTTP_BODY_MAX": "many"})
        gw = kiln.Gateway(db.url, redis)
        try:
            with self.assertRaisesRegex(RuntimeError, "exited"):
                kiln.Node(db.url, gw.url, {"KILN_MASTER_KEY": gw.master_key,
                                           "KILN_NODE_MAX_SANDBOXES": "many"}, hostagent=True)
        finally:
            gw.cleanup()
            db.drop()
        self.assertEqual(os.listdir(private), [])
        self.assertEqual(os.listdir(os.path.join(self.dir, "daemons")), [])
        r = self.stop()
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
