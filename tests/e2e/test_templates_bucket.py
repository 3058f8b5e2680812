"""A template's warm image in the tenant's bucket: built on one node, used on another.

Two nodes share Postgres and a tenant's bucket (s3rver behind the proxy that checks every SigV4
signature and Content-MD5, as in tests/integration/s3). The template is built once, on the first
node (the second starts after the build was placed); its image is uploaded (`image_status` stored,
one object). With the first node drained, a build FROM the template lands on the second, which
fetches the image from the bucket for its builder; its own upload fails (the bucket made to vanish
meanwhile), which its version says, and it stays usable on that node. A create from the first
template lands there too and fetches nothing more (the copy is kept), and its sandbox sees the file
the first build wrote. Another tenant sees no template. The first node is then removed (stopped
for good): deleting the templates removes their objects from the bucket (the first template's by
the second node, its own node being gone) and the second node's copy."""
import os
import sys
import time
import unittest

import kiln

sys.path.insert(0, os.path.join(kiln.ROOT, "tests", "integration", "s3"))
import s3env  # noqa: E402

DOCKERFILE = "FROM base\nRUN echo built-on-the-first-node > /root/proof\n"
EMPTY_TAR = b"\0" * 1024
PREFIX = "kiln/"


class TemplateBucketTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        t0 = time.monotonic()
        cls.s3 = s3env.S3Server()
        cls.addClassCleanup(cls.s3.stop)
        # The builder starts from the base's pre-booted template of the version's shape.
        cls.stack = kiln.Stack(node_env=dict(s3env.ALLOW_ENV, KILN_TEMPLATES="true",
                                             KILN_TEMPLATE_DEFAULT="true",
                                             KILN_GUEST_CODEINT_ROOTFS=""),
                               gateway_env=s3env.ALLOW_ENV)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw, cls.db = cls.stack.gw, cls.stack.db
        cls.key = cls.stack.tenant("tbucket-a")
        cls.other = cls.stack.tenant("tbucket-b")
        r = cls.gw.request("PUT", "/v1/storage", dict(cls.s3.target(prefix=PREFIX), kind="s3"), cls.key)
        assert r.status == 200, r
        cls.first = cls.stack.node

        cls.tmpl = cls.build("proof", DOCKERFILE)
        # Placed on the only node; the second one starts while the first builds.
        cls.second = cls.stack.add_node(s3env.ALLOW_ENV)
        cls.addClassCleanup(cls.second.cleanup)
        cls.version = cls.wait_version(cls.tmpl, lambda v: v["status"] != "building" and
                                       (v["status"] != "ready" or v["image_status"] not in (None, "uploading")))
        assert cls.version["status"] == "ready", cls.version
        cls.snap = cls.db.sql(f"SELECT snapshot_id FROM template_versions WHERE template_id = '{cls.tmpl}'")
        print(f"\nbuild and upload: {time.monotonic() - t0:.1f} s", file=sys.stderr)

    @classmethod
    def build(cls, name, dockerfile):
        """A new template `name` built from `dockerfile` (no COPY: an empty context); its id."""
        r = cls.gw.request("POST", "/v1/templates",
                           {"name": name, "vcpus": 1, "memory_mib": 512, "disk_gib": 10}, cls.key)
        assert r.status == 201, r
        tmpl = r.json()["id"]
        r = cls.gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile", dockerfile,
                           dict(cls.key, **{"Content-Type": "text/plain"}))
        assert r.status == 204, r
        r = cls.gw.request("PUT", f"/v1/templates/{tmpl}/source", EMPTY_TAR,
                           dict(cls.key, **{"Content-Type": "application/x-tar"}), timeout=120)
        assert r.status == 202, r
        return tmpl

    @classmethod
    def wait_version(cls, tmpl, done, seconds=600):
        deadline = time.time() + seconds
        while True:
            r = cls.gw.request("GET", f"/v1/templates/{tmpl}", headers=cls.key)
            assert r.status == 200, r
            v = r.json()["versions"][0]
            if done(v) or time.time() > deadline:
                return v
            time.sleep(0.5)

    def objects(self):
        got, err = s3env.tool(self.s3.target(prefix=PREFIX), "list", "")
        self.assertEqual(got["rc"], "ok", (got, err))
        return [k["key"] for k in got["keys"]]

    def fetches(self):
        return [p for m, p, st in self.s3.requests() if m == "GET" and self.snap in p and st.startswith("2")]

    def create(self, template="proof"):
        r = self.gw.request("POST", "/v1/sandboxes", {"template": template, "timeout_s": 600}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        return r.json()

    def node_of(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()["node"]

    def delete_sandbox(self, sb):
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key, timeout=120)
        self.assertEqual(r.status, 204, r)

    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def test_created_on_another_node_from_the_bucket_then_deleted_everywhere(self):
        # Built on the first node, its image stored in the bucket: one object, the snapshot's.
        self.assertEqual(self.version["image_status"], "stored", self.version)
        self.assertIsNone(self.version["image_reason"])
        self.assertEqual(self.db.sql(f"SELECT node_id FROM snapshots WHERE id = '{self.snap}'"),
                         self.first.node_id)
        key = f"snapshots/{self.snap}.kiln"  # under the prefix
        self.assertIn(key, self.objects())
        self.assertFalse(os.path.exists(os.path.join(self.second.data_dir, "snaps", self.second.node_id,
                                                     self.snap)))

        # The first node takes no work: a build FROM the template lands on the second, which
        # fetches the image from the bucket for its builder (the RUN reads the first build's file).
        self.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id = '{self.first.node_id}'")
        # A fetch that fails (the bucket gone for a moment) fails the create with its reason and
        # leaves no record of a copy the second node lacks.
        self.db.sql("UPDATE tenant_storage SET bucket = 'kiln-gone'")
        r = self.gw.request("POST", "/v1/sandboxes", {"template": "proof", "timeout_s": 600}, self.key,
                            timeout=300)
        self.db.sql(f"UPDATE tenant_storage SET bucket = '{s3env.BUCKET}'")
        self.assertGreaterEqual(r.status, 400, r)
        self.assertIn("could not be fetched from the tenant's bucket", r.data.decode(errors="replace"))
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM snapshot_copies WHERE snapshot_id = '{self.snap}'"),
                         "0")
        t0 = time.monotonic()
        child = self.build("child", "FROM proof\nRUN cat /root/proof > /root/child\n")
        fetched = f'snapshot "{self.snap}" fetched from the tenant\'s bucket'
        deadline = time.time() + 300
        while time.time() < deadline and fetched not in self.second.output():
            time.sleep(0.05)
        # Once the builder has its image, the bucket goes away (a bucket name that does not exist):
        # the child's upload fails, saying so, and it stays usable on its node.
        self.db.sql("UPDATE tenant_storage SET bucket = 'kiln-gone'")
        got = self.wait_version(child, lambda v: v["status"] != "building" and
                                v["image_status"] not in (None, "uploading"))
        print(f"build FROM it on the second node: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        self.db.sql(f"UPDATE tenant_storage SET bucket = '{s3env.BUCKET}'")
        self.assertEqual(got["status"], "ready", got)
        self.assertEqual(self.db.sql(f"SELECT node_id FROM template_versions WHERE template_id = '{child}'"),
                         self.second.node_id)
        self.assertEqual(len(self.fetches()), 1, self.fetches())
        self.assertIn(fetched, self.second.output())
        self.assertEqual(self.db.sql(f"SELECT node_id FROM snapshot_copies WHERE snapshot_id = '{self.snap}'"),
                         self.second.node_id)
        self.assertEqual(got["image_status"], "failed", got)
        self.assertIn("the bucket does not exist", got["image_reason"])
        sb = self.create("child")
        self.assertEqual(self.node_of(sb), self.second.node_id, sb)
        self.assertEqual(self.sh(sb, "cat /root/child"), "built-on-the-first-node\n")
        self.delete_sandbox(sb)

        # A create from the template lands on the second node too, from its copy: no new fetch.
        t0 = time.monotonic()
        sb = self.create()
        print(f"create from the copy: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        self.assertEqual(self.node_of(sb), self.second.node_id, sb)
        self.assertEqual(self.sh(sb, "cat /root/proof"), "built-on-the-first-node\n")
        self.assertEqual(len(self.fetches()), 1, self.fetches())

        # Another tenant has no such template, whatever the node.
        r = self.gw.request("GET", f"/v1/templates/{self.tmpl}", headers=self.other)
        self.assertEqual(r.status, 404, r)
        r = self.gw.request("POST", "/v1/sandboxes", {"template": "proof"}, self.other)
        self.assertEqual(r.status, 404, r)

        # The first node is removed (drained above, now stopped for good): the object of the
        # image it built is left to the nodes still up.
        self.delete_sandbox(sb)
        self.assertEqual(self.first.stop(), 0, self.first.output()[-3000:])
        self.assertEqual(self.db.sql(f"SELECT stopped_at IS NOT NULL FROM nodes WHERE id = '{self.first.node_id}'"),
                         "t")
        self.assertIn(key, self.objects())

        # Deleting the templates: once nothing stands on their images, their objects leave the
        # bucket (the child's deleted by its node, the second; the first template's, whose node
        # is gone, by the second too) and the copy leaves the second node.
        child_snap = self.db.sql(f"SELECT snapshot_id FROM template_versions WHERE template_id = '{child}'")
        child_key = f"snapshots/{child_snap}.kiln"
        for t in (child, self.tmpl):
            r = self.gw.request("DELETE", f"/v1/templates/{t}", headers=self.key)
            self.assertEqual(r.status, 204, r)
        copy = os.path.join(self.second.data_dir, "snaps", self.second.node_id, self.snap)

        def deletes(snap):
            return [p for m, p, st in self.s3.requests() if m == "DELETE" and snap in p and st.startswith("2")]
        deadline = time.time() + 120
        while time.time() < deadline and (set(self.objects()) & {key, child_key} or os.path.exists(copy)
                                          or not deletes(child_snap)):
            time.sleep(1)
        self.assertFalse(set(self.objects()) & {key, child_key}, self.objects())
        # (the child's upload failed: its node still asks the bucket to delete its object)
        self.assertTrue(deletes(child_snap), self.s3.requests()[-20:])
        self.assertIn(f'deleted the object of snapshot "{self.snap}" from its bucket (its node '
                      f'"{self.first.node_id}" is gone)', self.second.output())
        # its row says the image is on its node only, whose files go should it ever come back
        self.assertEqual(self.db.sql(f"SELECT storage, status FROM snapshots WHERE id = '{self.snap}'"),
                         "local|local")
        self.assertFalse(os.path.exists(copy), "the fetched copy stayed")
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM snapshot_copies WHERE snapshot_id = '{self.snap}'"),
                         "0")


if __name__ == "__main__":
    unittest.main()
