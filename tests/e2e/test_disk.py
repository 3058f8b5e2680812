"""Host disk and snapshot bytes against hostile tenants: a node never promises more guest disk than
it has (node_disk_gib x node_disk_overcommit_pct), a guest cannot grow its layer past its disk_gib,
and concurrent pauses cannot pass the plan's max_snapshot_bytes together. And the disk a tenant
asks for is the guest's: its root file system fills disk_gib however the sandbox was made."""
import os
import shutil
import tempfile
import threading
import time
import unittest

import kiln

GIB = 1 << 30
MIB = 1 << 20
# A loaded host (ctest -j2 beside other work) can take minutes to boot a guest under TCG: a boot
# that runs out of time fails a create and a template build, which this test is not about.
BOOT = {"KILN_BOOT_TIMEOUT_S": "600"}


def qcow2_bound(virtual_size):
    """The most a qcow2 layer of `virtual_size` can take on the host (vmm/disk.h): the data
    itself, an 8-byte L2 entry and a 2-byte refcount per 64 KiB cluster, and 4 MiB of header,
    L1 table and refcount table."""
    clusters = virtual_size // (64 * 1024)
    return virtual_size + clusters * 8 + clusters * 2 + 4 * MIB


class Helpers:
    def create(self, key=None, status=201, **body):
        body.setdefault("memory_mib", 256)
        body.setdefault("timeout_s", 3600)
        r = self.gw.request("POST", "/v1/sandboxes", body, key or self.key, timeout=600)
        self.assertEqual(r.status, status, r)
        if status == 201:
            sb = r.json()
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, key or self.key)
            return sb
        return r

    def at_once(self, calls):
        """Runs the callables together; their results in order."""
        results = [None] * len(calls)

        def run(i):
            results[i] = calls[i]()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        return results

    def delete(self, sb, key=None):
        """Deletes `sb` as soon as the test is done with it: a VM less on the host's two cores."""
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", None, key or self.key)
        self.assertEqual(r.status, 204, r)

    def sh(self, sb, cmd, key=None):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]},
                            key or self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def state(self, sb, key=None):
        return self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=key or self.key).json()["state"]


class NodeDiskTests(Helpers, unittest.TestCase):
    """A node that may promise 25 GiB of guest disk: two sandboxes of 10 GiB, never three; and a
    guest cannot grow its disk layer past its size."""

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_NODE_DISK_GIB": "25", **BOOT})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def test_a_create_that_would_overcommit_the_disk_is_refused_and_a_guest_stays_within_its_disk(self):
        node = self.stack.node.node_id
        self.assertEqual(self.stack.db.sql(f"SELECT disk_gib FROM nodes WHERE id = '{node}'"), "25")
        first = self.create(disk_gib=10)
        # Two more at once: the gateway's placement may let both through, the node admits one.
        body = {"memory_mib": 256, "timeout_s": 3600, "disk_gib": 10}
        results = self.at_once([lambda: self.gw.request("POST", "/v1/sandboxes", body, self.key, timeout=600)
                                for _ in range(2)])
        made = [r.json() for r in results if r.status == 201]
        for sb in made:
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        refused = [r for r in results if r.status != 201]
        made.insert(0, first)
        self.assertEqual(len(made), 2, results)
        self.assertEqual(len(refused), 1, results)
        self.assertEqual(refused[0].status, 503, refused[0])
        self.assertEqual(refused[0].json()["error"]["code"], "no_capacity")
        self.assertIn("disk", refused[0].json()["error"]["message"])
        # The gateway's own placement refuses the next one before any node is asked.
        r = self.create(status=503, disk_gib=10)
        self.assertEqual(r.json()["error"]["code"], "no_capacity")
        self.assertIn("GiB of disk", r.json()["error"]["message"])
        self.assertEqual(self.stack.db.sql("SELECT sum(disk_gib) FROM sandboxes WHERE deleted_at IS NULL "
                                           "AND state IN ('creating', 'running', 'paused')"), "20")
        # The refusal touched nobody: both run on.
        for sb in made:
            self.assertEqual(self.sh(sb, "echo ok")["stdout"], "ok\n")
        # A paused sandbox keeps its disk: it resumes here into a layer of its full size.
        r = self.gw.request("POST", f"/v1/sandboxes/{made[0]['id']}/pause", None, self.key, timeout=600)
        self.assertEqual(r.status, 200, r)
        self.create(status=503, disk_gib=10)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{made[0]['id']}", None, self.key)
        self.assertEqual(r.status, 204, r)
        sb = self.create(disk_gib=10)
        self.assertEqual(self.state(sb), "running")
        # A fork's children each get a layer of the parent's size: the node admits them too.
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/fork", {"count": 1}, self.key, timeout=600)
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json()["error"]["code"], "no_capacity")
        self.assertIn("GiB of disk", r.json()["error"]["message"])
        self.assertEqual(self.state(sb), "running")
        self.assertEqual(self.sh(sb, "echo ok")["stdout"], "ok\n")
        self.assertEqual(self.stack.db.sql("SELECT sum(disk_gib) FROM sandboxes WHERE deleted_at IS NULL "
                                           "AND state IN ('creating', 'running', 'paused')"), "20")
        # And the disk it was given is all a guest can take on the host (the sandbox's last act:
        # it overwrites its own file system).
        self.guest_cannot_grow_its_layer(sb)

    def guest_cannot_grow_its_layer(self, sb):
        """Root in the running 10 GiB sandbox `sb` writes its raw device up to its end and past
        it: the host's layer of it stays within a qcow2 of 10 GiB."""
        self.assertEqual(self.sh(sb, "blockdev --getsize64 /dev/vda")["stdout"].strip(), str(10 * GIB))
        # Root in the guest writes the raw device: 64 MiB just below its end, then past it.
        r = self.sh(sb, f"dd if=/dev/urandom of=/dev/vda bs=1M seek={10 * 1024 - 64} count=64 "
                        "conv=fsync 2>&1; echo status=$?; "
                        f"dd if=/dev/zero of=/dev/vda bs=1M seek={10 * 1024 - 1} count=16 "
                        "conv=fsync 2>&1; echo status=$?")
        out = r["stdout"]
        self.assertIn("status=0", out, out)
        self.assertIn("No space left on device", out)
        self.assertTrue(out.rstrip().endswith("status=1"), out)
        layer = os.path.join(self.stack.node.data_dir, "vms", self.stack.node.node_id, sb["id"],
                             "disk.qcow2")
        st = os.stat(layer)
        self.assertGreaterEqual(st.st_blocks * 512, 64 * MIB, "the writes did not reach the layer")
        self.assertLessEqual(st.st_size, qcow2_bound(10 * GIB))
        self.assertLessEqual(st.st_blocks * 512, qcow2_bound(10 * GIB))


class SnapshotBytesTests(Helpers, unittest.TestCase):
    """Pauses held just after their reservation (a fault point), so they are truly concurrent."""

    @classmethod
    def setUpClass(cls):
        cls.hold = os.path.join(tempfile.mkdtemp(prefix="kiln-disk-hold-"), "held")
        cls.addClassCleanup(shutil.rmtree, os.path.dirname(cls.hold), True)  # after the stack's
        cls.stack = kiln.Stack(node_env={"KILN_FAULT_HOLD": "pause-space-reserved",
                                         "KILN_FAULT_HOLD_FILE": cls.hold, **BOOT})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        r = cls.gw.request("POST", "/v1/tenants", {"name": "snapper"}, cls.stack.admin)
        assert r.status == 201, r
        cls.tenant = r.json()["tenant"]["id"]
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    def limit(self, nbytes):
        self.stack.db.sql("INSERT INTO plan_limits VALUES ('snaps', 10, 16000, 32768, 0) "
                          "ON CONFLICT (plan) DO NOTHING")
        self.stack.db.sql(f"UPDATE plan_limits SET max_snapshot_bytes = {nbytes} WHERE plan = 'snaps'")
        self.stack.db.sql(f"UPDATE tenants SET plan = 'snaps' WHERE id = '{self.tenant}'")

    def kept(self):
        return int(self.stack.db.sql(
            f"SELECT coalesce(sum(size_bytes), 0) FROM snapshots WHERE tenant_id = '{self.tenant}' "
            "AND purged_at IS NULL AND (deleted_at IS NULL OR kind IN ('pause', 'fork'))"))

    def test_concurrent_pauses_cannot_pass_the_snapshot_bytes_limit_together(self):
        self.limit(50 * GIB)
        made = self.at_once([lambda: self.create() for _ in range(3)])
        # Each pause reserves 256 MiB of memory + its disk layer + 64 MiB: one fits, two do not.
        self.limit(500 * MIB)
        results = [None] * 3

        def pause(i):
            results[i] = self.gw.request("POST", f"/v1/sandboxes/{made[i]['id']}/pause", None, self.key,
                                         timeout=600)

        threads = [threading.Thread(target=pause, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while time.time() < deadline and not os.path.exists(self.hold):
            time.sleep(0.1)
        self.assertTrue(os.path.exists(self.hold), "no pause reached its reservation")
        # The held pause has reserved; the others are refused meanwhile, not held.
        deadline = time.time() + 60
        while time.time() < deadline and sum(r is not None for r in results) < 2:
            time.sleep(0.1)
        os.unlink(self.hold)
        for t in threads:
            t.join(600)
        ok = [i for i, r in enumerate(results) if r.status == 200]
        refused = [i for i, r in enumerate(results) if r.status != 200]
        self.assertEqual(len(ok), 1, results)
        for i in refused:
            self.assertEqual(results[i].status, 403, results[i])
            self.assertEqual(results[i].json()["error"]["code"], "quota_exceeded")
            self.assertIn("max_snapshot_bytes", results[i].json()["error"]["message"])
            # The sandbox runs on, untouched.
            self.assertEqual(self.state(made[i]), "running")
            self.assertEqual(self.sh(made[i], "echo alive")["stdout"], "alive\n")
        self.assertEqual(self.state(made[ok[0]]), "paused")
        self.assertLessEqual(self.kept(), 500 * MIB)
        self.assertEqual(self.stack.db.sql("SELECT count(*) FROM snapshot_reservations"), "0")

        # At the limit, a user's pause is refused; the node's pause at a timeout never is.
        self.limit(1)
        r = self.gw.request("POST", f"/v1/sandboxes/{made[refused[0]]['id']}/pause", None, self.key,
                            timeout=600)
        self.assertEqual(r.status, 403, r)
        self.assertEqual(self.state(made[refused[0]]), "running")
        # (the other refused sandbox, running all along, is given a timeout of a second)
        sb = made[refused[1]]
        before = self.kept()
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/timeout", {"timeout_s": 1}, self.key)
        self.assertEqual(r.status, 200, r)
        deadline = time.time() + 180
        while time.time() < deadline and self.state(sb) != "paused":
            time.sleep(1)
        self.assertEqual(self.state(sb), "paused", "the timeout's pause was refused")
        self.assertGreater(self.kept(), before, "a forced pause counts")


# Data the guest writes and reads back: 4001-byte lines of random base64 (so neighbouring 4 KiB
# blocks differ), written with `yes` and compared by regenerating the stream into cmp: far less
# guest CPU under TCG than hashing it twice.
FILL = ('head -c 3000 /dev/urandom | base64 -w0 > /root/line; yes "$(cat /root/line)" | head -c {n} '
        '> /root/fill && sync && stat -c %s /root/fill')
CHECK = ('echo 3 > /proc/sys/vm/drop_caches; yes "$(cat /root/line)" | head -c {n} | cmp - /root/fill '
         '&& echo same; rm -f /root/fill /root/line')
# The room: `n` bytes of blocks allocated to one file (its size, once they are), then freed.
ROOM = 'fallocate -l {n} /root/room && sync && stat -c %s /root/room; rm -f /root/room'


class RootFsTests(Helpers, unittest.TestCase):
    """The guest's root file system fills disk_gib for every way a sandbox comes to exist: cold,
    from the default template and from another shape's, resumed, forked, and from a named
    snapshot with a larger disk (a smaller one is a 422 that changes nothing)."""

    @classmethod
    def setUpClass(cls):
        # Disk throttling off: this is about room, not rate. No code interpreter image: its
        # template (a boot and a warm-up of its own) is of no use here.
        cls.stack = kiln.Stack(node_env={"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
                                         "KILN_DISK_MIBPS_PER_VCPU": "0",
                                         "KILN_DISK_IOPS_PER_VCPU": "0",
                                         "KILN_GUEST_CODEINT_ROOTFS": "", **BOOT})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def template(self, memory_mib, timeout=600):
        """The ready template of the shape (1 vCPU, memory_mib, 10 GiB), waited for. A build that
        failed (its Python warm-up has a deadline a loaded host can miss) starts again at the
        next create of the shape, as the node does for any create."""
        deadline = time.time() + timeout
        failed = f"template of 1000 mvCPU, {memory_mib} MiB not built"
        seen = self.stack.node.output().count(failed)
        while time.time() < deadline:
            got = self.stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL "
                                    f"AND memory_mib = {memory_mib}")
            if got:
                return got.split()[0]
            if self.stack.node.output().count(failed) > seen:
                seen = self.stack.node.output().count(failed)
                kick = self.create(memory_mib=memory_mib, disk_gib=10)
                self.gw.request("DELETE", f"/v1/sandboxes/{kick['id']}", None, self.key)
            time.sleep(0.5)
        self.fail(f"no template of {memory_mib} MiB was built:\n" + self.stack.node.output()[-3000:])

    def lineage(self, sb):
        return self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sb['id']}'")

    def df(self, sb):
        """(size, available) of the guest's / in bytes, as df shows them."""
        out = self.sh(sb, "df -B1 --output=size,avail / | tail -1")["stdout"].split()
        return int(out[0]), int(out[1])

    def fills(self, sb, gib, write):
        """The guest sees a file system of about `gib` GiB on / and has the room: a file of
        `gib` - 1 GiB is allocated on it (fallocate: blocks taken, no data written); and it writes
        and reads back `write` bytes through it."""
        size, avail = self.df(sb)
        self.assertGreaterEqual(size, (gib - 1) * GIB, f"df shows {size} bytes on {gib} GiB")
        self.assertGreaterEqual(avail, (gib - 1) * GIB, f"df shows {avail} bytes free on {gib} GiB")
        room = (gib - 1) * GIB
        for cmd, out in ((ROOM.format(n=room), str(room)), (FILL.format(n=write), str(write)),
                         (CHECK.format(n=write), "same")):
            r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec",
                                {"cmd": ["sh", "-c", cmd], "timeout_s": 1800}, self.key,
                                timeout=1900)
            self.assertEqual(r.status, 200, r)
            self.assertEqual((r.json()["exit_code"], r.json()["stdout"].strip()), (0, out), r.json())

    def meanwhile(self, fn, *args):
        """Runs fn(*args) in a thread; returns a function that waits for it and raises what it
        raised (a failed assertion too)."""
        box = {}

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: B902 - handed to the waiter
                box["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()

        def wait():
            t.join(3600)
            self.assertFalse(t.is_alive(), "still running after an hour")
            if "error" in box:
                raise box["error"]
        return wait

    def test_the_root_file_system_fills_disk_gib_every_way_a_sandbox_is_made(self):
        t0 = time.monotonic()
        tpl = self.template(512)
        # From the default template (1 vCPU, 512 MiB, 10 GiB).
        made = self.create(memory_mib=512, disk_gib=10)
        self.assertEqual(self.lineage(made), tpl, "the create did not restore the template")
        self.fills(made, 10, 256 * MIB)
        # Cold: a shape without a template (its template is built meanwhile, for later). Its
        # check goes on in its own VM, on the other core, while the other ways are checked.
        cold = self.create(memory_mib=256, disk_gib=10)
        self.assertEqual(self.lineage(cold), "", "the create did not boot cold")
        cold_fill = self.meanwhile(self.fills, cold, 10, 256 * MIB)
        # Resumed.
        self.assertEqual(self.gw.request("POST", f"/v1/sandboxes/{made['id']}/pause", None, self.key,
                                         timeout=300).status, 200)
        r = self.gw.request("POST", f"/v1/sandboxes/{made['id']}/resume", None, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.fills(made, 10, 256 * MIB)
        # Forked.
        r = self.gw.request("POST", f"/v1/sandboxes/{made['id']}/fork", {"count": 1}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        kid = r.json()["sandboxes"][0]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{kid['id']}", None, self.key)
        self.fills(kid, 10, 256 * MIB)
        self.delete(kid)
        # From a named snapshot of 10 GiB, onto a larger disk of 11 GiB: the file system grows.
        self.sh(made, "echo kept > /root/kept")
        r = self.gw.request("POST", f"/v1/sandboxes/{made['id']}/snapshots", {"name": "ten"}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        ten = r.json()
        grown = self.create(snapshot_id=ten["id"], disk_gib=11)
        self.assertEqual(self.stack.db.sql(f"SELECT disk_gib FROM sandboxes WHERE id = '{grown['id']}'"), "11")
        self.assertEqual(self.sh(grown, "cat /root/kept")["stdout"], "kept\n")
        self.assertEqual(self.sh(grown, "blockdev --getsize64 /dev/vda")["stdout"].strip(), str(11 * GIB))
        self.fills(grown, 11, 256 * MIB)
        # Without disk_gib, the snapshot's own size.
        same = self.create(snapshot_id=ten["id"])
        self.assertEqual(self.stack.db.sql(f"SELECT disk_gib FROM sandboxes WHERE id = '{same['id']}'"), "10")
        self.delete(same)
        # A snapshot of 11 GiB onto 10: a 422 naming the minimum, and nothing made.
        r = self.gw.request("POST", f"/v1/sandboxes/{grown['id']}/snapshots", {"name": "eleven"}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        before = self.stack.db.sql("SELECT count(*) FROM sandboxes")
        r = self.create(status=422, snapshot_id=r.json()["id"], disk_gib=10)
        self.assertEqual(r.json()["error"]["code"], "invalid")
        self.assertIn("at least 11", r.json()["error"]["message"])
        self.assertEqual(self.stack.db.sql("SELECT count(*) FROM sandboxes"), before)
        self.delete(grown)
        self.delete(made)
        # From another shape's template: the cold create's shape has one by now.
        cold_fill()
        self.delete(cold)
        other = self.template(256)
        made2 = self.create(memory_mib=256, disk_gib=10)
        self.assertEqual(self.lineage(made2), other, "the create did not restore the other template")
        self.fills(made2, 10, 256 * MIB)
        print(f"\nroot fs fills disk_gib, five ways: {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    unittest.main()
