"""The snapshot store (node/storage_sync.c, through snapstore_tool) with real snapshot
directories, a real S3-compatible server (s3rver behind the SigV4-checking proxy of
tests/integration/s3/) and Postgres: upload from node A, fetch on node B, statuses, encryption,
failures (bucket down on fetch, corrupt, truncated and foreign objects, refused credentials) and an
upload interrupted mid-way that a restart finishes.

A snapshot here is what kiln-node leaves after a pause: `state`, a sparse `mem`, `netpolicy.json`
and `disk.qcow2`, a frozen qcow2 layer whose backing is an earlier snapshot's layer (backing files
named as in the VM's jail: `layer1`, `base`), over a raw base image; the manifest is written by
snapshot_manifest_write over the driver's fields.
"""
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import unittest

import kiln
import s3env

MIB = 1 << 20
TOOL = os.path.join(kiln.BUILD, "tests", "integration", "snapstore", "snapstore_tool")
MIGRATE = os.path.join(kiln.BUILD, "migrations", "kiln-migrate")
PART = 5 * MIB


def run(*argv):
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


def qemu_io(image, *cmds):
    args = ["qemu-io", "-f", "qcow2"]
    for c in cmds:
        args += ["-c", c]
    run(*args, image)


class SnapstoreTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = s3env.S3Server()
        cls.db = kiln.fresh_database()
        r = subprocess.run([MIGRATE], env=dict(os.environ, KILN_DATABASE_URL=cls.db.url),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        cls.mk = secrets.token_hex(32)
        cls.root = tempfile.mkdtemp(prefix="kiln-snapstore-")
        cls.images = os.path.join(cls.root, "images")
        os.makedirs(cls.images)
        cls.snaps = {n: os.path.join(cls.root, "snaps", n) for n in ("node-a", "node-b")}
        for d in cls.snaps.values():
            os.makedirs(d)
        # The guest image: 64 MiB raw, sparse, with data at a few places. Node B keeps its copy at
        # another path, so a fetched snapshot's chain must be rewritten for it.
        cls.base_a = os.path.join(cls.images, "rootfs-a.raw")
        cls.base_b = os.path.join(cls.images, "rootfs-b.raw")
        with open(cls.base_a, "wb") as f:
            f.truncate(64 * MIB)
            for off in (0, 1 * MIB, 40 * MIB):
                f.seek(off)
                f.write(os.urandom(256 * 1024))
        shutil.copy(cls.base_a, cls.base_b)
        for t in ("tn_a", "tn_b", "tn_c", "tn_d"):
            cls.db.sql(f"INSERT INTO tenants (id, name) VALUES ('{t}', '{t}')")
        for n in cls.snaps:
            cls.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
                       f"hypervisor, accelerator, image_hash) VALUES ('{n}', 'unix:/x', 1000, 1024, 4, "
                       "'qemu', 'tcg', 'sha256:snapstore-test')")
        # tn_a and tn_b have buckets (prefixes of their own); tn_c has none; tn_d a wrong secret.
        for t, over in (("tn_a", {}), ("tn_b", {}),
                        ("tn_d", {"secret_access_key": "not-the-secret"})):
            r = cls.tool("set-storage", t, storage=cls.srv.target(f"tenants/{t}/", **over))
            assert r["rc"] == "ok", r

    @classmethod
    def tearDownClass(cls):
        cls.db.drop()
        cls.srv.stop()
        shutil.rmtree(cls.root, ignore_errors=True)

    # ---- helpers ----

    @classmethod
    def env(cls, node="node-a", storage=None, **extra):
        e = dict(os.environ, KILN_DATABASE_URL=cls.db.url, KILN_MASTER_KEY=cls.mk, NODE_ID=node,
                 SNAP_ROOT=cls.snaps[node], BASE_IMAGE=cls.base_a if node == "node-a" else cls.base_b,
                 S3_PART_SIZE=str(PART), ASAN_OPTIONS="detect_leaks=1", **s3env.ALLOW_ENV)
        if storage:
            e.update({"S3_ENDPOINT": storage["endpoint"], "S3_BUCKET": storage["bucket"],
                      "S3_REGION": storage["region"], "S3_PREFIX": storage["prefix"],
                      "S3_ACCESS_KEY_ID": storage["access_key_id"],
                      "S3_SECRET_ACCESS_KEY": storage["secret_access_key"]})
        e.update({k: str(v) for k, v in extra.items()})
        return e

    @classmethod
    def tool(cls, *args, node="node-a", storage=None, **extra):
        out = subprocess.run([TOOL, *args], env=cls.env(node, storage, **extra), capture_output=True,
                             text=True, timeout=300)
        lines = out.stdout.strip().splitlines()
        assert lines, f"snapstore_tool {args}: no answer\n{out.stderr}"
        for bad in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            assert bad not in out.stderr, f"snapstore_tool {args}:\n{out.stderr}"
        r = json.loads(lines[-1])
        r["log"] = out.stderr
        return r

    def status(self, snap):
        return tuple(self.db.sql(f"SELECT status, storage, coalesce(reason, '') FROM snapshots "
                                 f"WHERE id = '{snap}'").split("|"))

    def make_snapshot(self, tenant="tn_a", mem_data=12 * MIB, below=1):
        """A paused sandbox's snapshot on node A: its own frozen layer over `below` layers of
        earlier snapshots over the base image. Returns (id, dir, jail)."""
        snap = "snap_" + secrets.token_hex(8)
        d = os.path.join(self.snaps["node-a"], snap)
        jail = tempfile.mkdtemp(prefix="jail-", dir=self.root)
        os.makedirs(d)
        # The chain as a VM's jail names it (base, layer1.., disk), each layer with data of its
        # own, some overwriting the layer below; then each layer moves where the node keeps it.
        os.symlink(self.base_a, os.path.join(jail, "base"))
        chain = [self.base_a]
        for k in range(1, below + 1):
            name = f"layer{k}"
            run("qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", "raw" if k == 1 else "qcow2",
                "-b", "base" if k == 1 else f"layer{k - 1}", os.path.join(jail, name), str(64 * MIB))
            qemu_io(os.path.join(jail, name), f"write -P 0x{k}1 {k}M 512k",
                    f"write -P 0x{k}2 {20 + k}M 64k", f"write -z {40 + k - 1}M 4k")
            pd = os.path.join(self.snaps["node-a"], "snap_" + secrets.token_hex(8))
            os.makedirs(pd)
            shutil.copy(os.path.join(jail, name), os.path.join(pd, "disk.qcow2"))
            os.chmod(os.path.join(pd, "disk.qcow2"), 0o444)
            chain.append(os.path.join(pd, "disk.qcow2"))
        run("qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", "qcow2" if below else "raw",
            "-b", f"layer{below}" if below else "base", os.path.join(jail, "disk"), str(128 * MIB))
        qemu_io(os.path.join(jail, "disk"), "write -P 0xa2 1280k 64k", "write -P 0xa3 100M 128k",
                "write -z 40M 64k")
        shutil.copy(os.path.join(jail, "disk"), os.path.join(d, "disk.qcow2"))
        os.chmod(os.path.join(d, "disk.qcow2"), 0o444)
        chain.append(os.path.join(d, "disk.qcow2"))
        # Memory: 64 MiB, sparse, `mem_data` bytes of data at 8 MiB, a plaintext marker in it.
        self.marker = b"KILN-PLAINTEXT-MARKER-" + secrets.token_hex(8).encode()
        with open(os.path.join(d, "mem"), "wb") as f:
            f.truncate(64 * MIB)
            f.seek(8 * MIB)
            f.write(os.urandom(mem_data))
            f.seek(50 * MIB)
            f.write(self.marker * 100)
        with open(os.path.join(d, "state"), "wb") as f:
            f.write(b"QEVM" + os.urandom(60000) + self.marker)
        with open(os.path.join(d, "netpolicy.json"), "w") as f:
            json.dump({"rules": ["allow tcp 10.0.0.0/8:443"], "bandwidth": {"unmetered": True}}, f)
        driver = {"format": 1, "hypervisor": "qemu", "hypervisor_version": "7.2.0",
                  "machine": "microvm", "accel": "tcg", "memory": "shared", "vcpus": 1,
                  "vcpu_milli": 1000, "mem_mib": 64, "disk": True, "net": True,
                  "disk_chain": chain,
                  "kernel": "/boot/vmlinuz", "created": 1700000000}
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(driver, f, indent=2, sort_keys=True)
        r = self.tool("manifest", d)
        self.assertEqual(r["rc"], "ok", r)
        self.db.sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, vcpu_milli, "
                    f"memory_mib, disk_gib) VALUES ('{snap}', '{tenant}', 'sb_x', 'node-a', 'pause', "
                    "1000, 64, 1)")
        return snap, d, jail

    def key(self, tenant, snap):
        return f"tenants/{tenant}/snapshots/{snap}.kiln"

    def sdk_get(self, key):
        out = os.path.join(self.root, "sdk-" + secrets.token_hex(4))
        r = s3env.sdk(self.srv.endpoint, "get", key, out)
        self.assertNotIn("error", r, r)
        with open(out, "rb") as f:
            data = f.read()
        os.unlink(out)
        return data

    def put_object(self, tenant, key_rel, data):
        path = os.path.join(self.root, "obj-" + secrets.token_hex(4))
        with open(path, "wb") as f:
            f.write(data)
        r, err = s3env.tool(self.srv.target(f"tenants/{tenant}/"), "put", key_rel, path)
        os.unlink(path)
        self.assertEqual(r["rc"], "ok", (r, err))

    def work_dirs(self, node):
        return sorted(n for n in os.listdir(self.snaps[node]) if n.startswith("."))

    def same_disk(self, jail, fetched_disk):
        """qemu-img compare of the original chain (resolved in the jail) and the fetched layer
        (its backing `base` resolved to node B's image)."""
        cmpdir = tempfile.mkdtemp(prefix="cmp-", dir=self.root)
        os.symlink(self.base_b, os.path.join(cmpdir, "base"))
        os.symlink(fetched_disk, os.path.join(cmpdir, "top"))
        r = subprocess.run(["qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
                            os.path.join(jail, "disk"), os.path.join(cmpdir, "top")],
                           capture_output=True, text=True, timeout=120)
        info = json.loads(subprocess.run(
            ["qemu-img", "info", "--output=json", "--backing-chain", os.path.join(cmpdir, "top")],
            capture_output=True, text=True, check=True).stdout)
        shutil.rmtree(cmpdir)
        return r, info

    def fetched_equals(self, snap, src_dir, jail):
        d = os.path.join(self.snaps["node-b"], snap)
        for name in ("state", "mem", "netpolicy.json"):
            with open(os.path.join(src_dir, name), "rb") as a, open(os.path.join(d, name), "rb") as b:
                self.assertTrue(a.read() == b.read(), f"{name} differs after the round trip")
        st = os.stat(os.path.join(d, "mem"))
        self.assertEqual(st.st_size, 64 * MIB)
        self.assertLess(st.st_blocks * 512, 20 * MIB, "the fetched memory image is not sparse")
        r, info = self.same_disk(jail, os.path.join(d, "disk.qcow2"))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # one qcow2 layer over the base, named as the jail names it
        self.assertEqual([i["format"] for i in info], ["qcow2", "raw"], info)
        self.assertEqual(info[0]["backing-filename"], "base")
        with open(os.path.join(d, "manifest.json")) as f:
            m = json.load(f)
        self.assertEqual(m["disk_chain"], [self.base_b, os.path.join(d, "disk.qcow2")])
        self.assertEqual(self.tool("verify", d)["rc"], "ok")

    # ---- tests ----

    def test_upload_then_fetch_on_another_node(self):
        snap, d, jail = self.make_snapshot()
        self.assertEqual(self.status(snap), ("local", "local", ""))
        self.srv.clear_log()
        p = subprocess.Popen([TOOL, "upload", snap, "tn_a", "1"], env=self.env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.assertEqual(p.stdout.readline().strip(), "paused")
        # while the object is on its way: uploading, the object not yet complete in the bucket
        self.assertEqual(self.status(snap), ("uploading", "s3", ""))
        self.assertTrue(os.path.exists(os.path.join(self.snaps["node-a"], ".up-" + snap, "object.kiln")))
        out, err = p.communicate("go\n", timeout=120)
        r = json.loads(out.strip().splitlines()[-1])
        self.assertEqual(r["rc"], "ok", (r, err))
        self.assertEqual(self.status(snap), ("stored", "s3", ""))
        self.assertEqual(self.work_dirs("node-a"), [], "temporaries left")
        self.assertTrue(all(sent for _, _, sent in r["parts"]), r)
        # the object: one multipart upload under the tenant's prefix, every request signed right
        reqs = self.srv.requests()
        self.assertTrue(all(s == "200" for _, _, s in reqs), reqs)
        self.assertTrue(any(q.endswith("uploads=") and snap in q for m, q, _ in reqs), reqs)
        obj = self.sdk_get(self.key("tn_a", snap))
        self.assertEqual(obj[:8], b"KILNSNAP")
        self.assertNotIn(self.marker, obj, "plaintext in the stored object")
        self.assertNotIn(b"QEVM", obj)
        # zero pages cost nothing: 64 MiB of memory with 12 MiB of data
        self.assertLess(len(obj), 14 * MIB, len(obj))
        self.assertGreater(len(obj), 12 * MIB, len(obj))
        # the snapshot on node A is untouched
        self.assertEqual(self.tool("verify", d)["rc"], "ok")

        # node B: nothing local, fetched from the bucket
        r = self.tool("fetch", snap, "tn_a", node="node-b")
        self.assertEqual(r["rc"], "ok", r)
        self.fetched_equals(snap, d, jail)
        self.assertEqual(self.work_dirs("node-b"), [])
        # a second fetch finds it there and reads nothing
        self.srv.clear_log()
        self.assertEqual(self.tool("fetch", snap, "tn_a", node="node-b")["rc"], "ok")
        self.assertEqual(self.srv.requests(), [])
        # another tenant cannot fetch it
        r = self.tool("fetch", snap, "tn_b", node="node-b")
        self.assertEqual(r["rc"], "not_found", r)
        # purged: the object leaves the bucket (twice is fine)
        self.assertEqual(self.tool("delete", snap, "tn_a")["rc"], "ok")
        r = s3env.sdk(self.srv.endpoint, "get", self.key("tn_a", snap), os.path.join(self.root, "x"))
        self.assertEqual(r.get("error"), "NoSuchKey", r)
        self.assertEqual(self.tool("delete", snap, "tn_a")["rc"], "ok")

    def test_fetch_with_the_bucket_down_is_unavailable_and_writes_nothing(self):
        snap, d, jail = self.make_snapshot()
        self.assertEqual(self.tool("upload", snap, "tn_a")["rc"], "ok")
        self.assertEqual(self.status(snap)[0], "stored")
        before = sorted(os.listdir(self.snaps["node-b"]))
        self.srv.kill_s3rver()
        try:
            r = self.tool("fetch", snap, "tn_a", node="node-b")
            self.assertEqual(r["rc"], "unavailable", r)
            self.assertIn("bucket cannot be reached", r["message"])
            self.assertEqual(sorted(os.listdir(self.snaps["node-b"])), before, "something was written")
        finally:
            self.srv.start_s3rver()
        # nothing lost: once the bucket is back, the same fetch works
        r = self.tool("fetch", snap, "tn_a", node="node-b")
        self.assertEqual(r["rc"], "ok", r)
        self.fetched_equals(snap, d, jail)

    def test_corrupt_truncated_and_foreign_objects_are_refused(self):
        snap, d, jail = self.make_snapshot(mem_data=1 * MIB, below=0)	# nothing to flatten
        self.assertEqual(self.tool("upload", snap, "tn_a")["rc"], "ok")
        good = self.sdk_get(self.key("tn_a", snap))
        before = sorted(os.listdir(self.snaps["node-b"]))

        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        self.put_object("tn_a", f"snapshots/{snap}.kiln", bytes(bad))
        r = self.tool("fetch", snap, "tn_a", node="node-b")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("corrupt", r["message"])
        self.assertEqual(sorted(os.listdir(self.snaps["node-b"])), before)

        self.put_object("tn_a", f"snapshots/{snap}.kiln", good[: len(good) // 2])
        r = self.tool("fetch", snap, "tn_a", node="node-b")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("truncated", r["message"])
        self.assertEqual(sorted(os.listdir(self.snaps["node-b"])), before)

        # tn_a's object under a snapshot of tn_b: its data key does not open for tn_b
        other = "snap_" + secrets.token_hex(8)
        self.db.sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, vcpu_milli, "
                    f"memory_mib, disk_gib, status, storage) VALUES ('{other}', 'tn_b', 'sb_y', "
                    "'node-a', 'pause', 1000, 64, 1, 'stored', 's3')")
        self.put_object("tn_b", f"snapshots/{other}.kiln", good)
        r = self.tool("fetch", other, "tn_b", node="node-b")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("not packed for tenant", r["message"])
        self.assertEqual(sorted(os.listdir(self.snaps["node-b"])), before)

        # the good object still restores
        self.put_object("tn_a", f"snapshots/{snap}.kiln", good)
        self.assertEqual(self.tool("fetch", snap, "tn_a", node="node-b")["rc"], "ok")
        self.fetched_equals(snap, d, jail)

    def test_tenant_without_a_bucket_stays_local(self):
        snap, d, _ = self.make_snapshot(tenant="tn_c", mem_data=MIB)
        self.srv.clear_log()
        r = self.tool("upload", snap, "tn_c")
        self.assertEqual(r["rc"], "ok", r)
        self.assertEqual(self.status(snap), ("local", "local", ""))
        self.assertEqual(self.srv.requests(), [])
        self.assertEqual(self.work_dirs("node-a"), [])
        r = self.tool("fetch", snap, "tn_c", node="node-b")
        self.assertEqual(r["rc"], "conflict", r)
        self.assertIn("only on the node that took it", r["message"])

    def test_an_image_shown_uploading_whose_bucket_went_fails_with_the_reason(self):
        """A template's image is marked `uploading` as it becomes ready; a tenant that removes its
        bucket before the upload starts leaves it failed with the reason, not uploading for ever."""
        snap, d, _ = self.make_snapshot(tenant="tn_c", mem_data=MIB)
        self.db.sql(f"UPDATE snapshots SET status = 'uploading', storage = 's3' WHERE id = '{snap}'")
        r = self.tool("upload", snap, "tn_c")
        self.assertEqual(r["rc"], "ok", r)
        status, storage, reason = self.status(snap)
        self.assertEqual((status, storage), ("failed", "s3"))
        self.assertIn("bucket was removed before the upload started", reason)
        self.assertEqual(self.srv.requests(), [])
        self.assertEqual(self.work_dirs("node-a"), [])

    def test_refused_credentials_fail_with_the_reason(self):
        snap, d, _ = self.make_snapshot(tenant="tn_d", mem_data=MIB)
        r = self.tool("upload", snap, "tn_d")
        self.assertEqual(r["rc"], "ok", r)	# the pause is not undone; the upload fails
        status, storage, reason = self.status(snap)
        self.assertEqual((status, storage), ("failed", "s3"))
        self.assertIn("SignatureDoesNotMatch", reason)
        self.assertNotIn("not-the-secret", reason)
        self.assertEqual(self.work_dirs("node-a"), [])
        self.assertEqual(self.tool("verify", d)["rc"], "ok")

    def test_a_node_refuses_a_bucket_in_its_network_unless_allowed(self):
        # storage_allow empty, as by default: the bucket on 127.0.0.1 is never contacted
        snap, d, _ = self.make_snapshot(mem_data=MIB)
        self.srv.clear_log()
        r = self.tool("upload", snap, "tn_a", KILN_STORAGE_ALLOW="")
        self.assertEqual(r["rc"], "ok", r)
        status, storage, reason = self.status(snap)
        self.assertEqual((status, storage), ("failed", "s3"))
        self.assertIn("resolves to a loopback address, which is refused", reason)
        self.assertEqual(self.srv.requests(), [])
        # a snapshot stored while it was allowed is not fetched once it is not
        snap, d, _ = self.make_snapshot(mem_data=MIB)
        self.assertEqual(self.tool("upload", snap, "tn_a")["rc"], "ok")
        self.assertEqual(self.status(snap)[0], "stored")
        self.srv.clear_log()
        r = self.tool("fetch", snap, "tn_a", node="node-b", KILN_STORAGE_ALLOW="")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("loopback", r["message"])
        self.assertEqual(self.srv.requests(), [])

    def test_upload_interrupted_mid_way_is_finished_by_the_next_start(self):
        snap, d, jail = self.make_snapshot(mem_data=18 * MIB)	# 4 parts of 5 MiB
        self.srv.clear_log()
        p = subprocess.Popen([TOOL, "upload", snap, "tn_a", "2"],
                             env=self.env(UPLOAD_TRIES=20, RETRY_DELAY_MS=300), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.assertEqual(p.stdout.readline().strip(), "paused")
        self.srv.kill_s3rver()		# the bucket goes down after part 2...
        out, err = p.communicate("stop\n", timeout=120)	# ...and the node stops
        r = json.loads(out.strip().splitlines()[-1])
        self.assertEqual(r["rc"], "ok", (r, err))
        self.assertEqual(self.status(snap), ("uploading", "s3", ""))
        up = os.path.join(self.snaps["node-a"], ".up-" + snap)
        self.assertTrue(os.path.exists(os.path.join(up, "object.kiln")))
        with open(os.path.join(up, "object.kiln.s3upload")) as f:
            self.assertEqual(len(re.findall(r"^part \d+ ", f.read(), re.M)), 2)

        # a leftover fetch and the work of an upload no longer pending are cleared at start
        os.makedirs(os.path.join(self.snaps["node-a"], ".fetch-snap_gone.0000"))
        os.makedirs(os.path.join(self.snaps["node-a"], ".up-snap_gone"))
        self.srv.start_s3rver()
        self.srv.clear_log()
        r = self.tool("resume")
        self.assertEqual(r["rc"], "ok", r)
        self.assertEqual(r["queued"], 1, r)
        self.assertEqual(self.status(snap), ("stored", "s3", ""))
        self.assertEqual(self.work_dirs("node-a"), [])
        # only the parts still missing were sent, into the same multipart upload
        reqs = self.srv.requests()
        sent = sorted(int(re.search(r"partNumber=(\d+)", q).group(1))
                      for m, q, s in reqs if m == "PUT" and "partNumber=" in q)
        self.assertEqual(sent, [3, 4], reqs)
        self.assertFalse([q for m, q, s in reqs if q.endswith("uploads=")], reqs)
        self.assertEqual([(pt, sn) for pt, _, sn in r["parts"]],
                         [(1, False), (2, False), (3, True), (4, True)], r)
        r = self.tool("fetch", snap, "tn_a", node="node-b")
        self.assertEqual(r["rc"], "ok", r)
        self.fetched_equals(snap, d, jail)

    def test_restart_before_the_files_were_staged_uploads_from_the_snapshot(self):
        # a crash between the status and the staging: the row says uploading, no work dir
        snap, d, jail = self.make_snapshot(mem_data=MIB, below=3)
        self.db.sql(f"UPDATE snapshots SET status = 'uploading', storage = 's3' WHERE id = '{snap}'")
        r = self.tool("resume")
        self.assertEqual((r["rc"], r["queued"]), ("ok", 1), r)
        self.assertEqual(self.status(snap), ("stored", "s3", ""))
        self.assertEqual(self.tool("fetch", snap, "tn_a", node="node-b")["rc"], "ok")
        self.fetched_equals(snap, d, jail)


if __name__ == "__main__":
    unittest.main()
