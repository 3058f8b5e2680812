"""Snapshots in the tenant's own bucket: a sandbox paused on one node resumes on another.

The bucket is a real S3-compatible server (s3rver, behind a proxy that checks every SigV4
signature and Content-MD5), as in tests/integration/s3."""
import os
import sys
import time
import unittest

import kiln

sys.path.insert(0, os.path.join(kiln.ROOT, "tests", "integration", "s3"))
import s3env  # noqa: E402

COUNTER_PY = b"""import time
i = 0
while True:
    i += 1
    with open('/root/log', 'a') as f:
        f.write(str(i) + chr(10))
    time.sleep(0.2)
"""


class BucketTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s3 = s3env.S3Server()
        cls.addClassCleanup(cls.s3.stop)
        cls.stack = kiln.Stack(node_env=s3env.ALLOW_ENV, gateway_env=s3env.ALLOW_ENV)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()
        r = cls.gw.request("PUT", "/v1/storage", dict(cls.s3.target(prefix="kiln/"), kind="s3"), cls.key)
        assert r.status == 200, r

    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def snapshot_status(self, sb):
        return self.stack.db.sql("SELECT p.status FROM sandboxes s JOIN snapshots p ON p.id = s.pause_snapshot"
                                 f" WHERE s.id = '{sb['id']}'")

    def test_pause_on_one_node_resume_on_another_through_the_bucket(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/files?path=/root/counter.py", COUNTER_PY, self.key)
        self.sh(sb, "echo precious > /root/data; nohup python3 /root/counter.py >/dev/null 2>&1 &")
        deadline = time.time() + 90
        while time.time() < deadline and len(self.sh(sb, "cat /root/log 2>/dev/null").split()) < 3:
            time.sleep(0.5)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/pause", headers=self.key, timeout=120)
        self.assertEqual(r.status, 200, r)
        deadline = time.time() + 180
        while time.time() < deadline and self.snapshot_status(sb) != "stored":
            time.sleep(1)
        self.assertEqual(self.snapshot_status(sb), "stored")
        objects = [p for m, p, st in self.s3.requests() if m == "PUT" and ".kiln" in p]
        self.assertTrue(objects, "nothing was uploaded")

        # The first node goes away; a second one, sharing only Postgres and the bucket, takes over.
        first = self.stack.node
        first.cleanup()
        self.stack.node = self.stack.add_node(s3env.ALLOW_ENV)
        self.stack.db.sql(f"UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = '{first.node_id}'")

        # With the bucket unreachable the resume fails clearly and the sandbox stays paused.
        self.s3.kill_s3rver()
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/resume", headers=self.key, timeout=120)
        self.assertEqual(r.status, 503, r)
        self.assertIn("paused", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "paused")

        self.s3.start_s3rver()
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/resume", headers=self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["node"], self.stack.node.node_id)
        self.assertEqual(self.sh(sb, "cat /root/data"), "precious\n")
        time.sleep(1.5)
        nums = [int(x) for x in self.sh(sb, "cat /root/log").split()]
        self.assertEqual(nums, list(range(1, len(nums) + 1)), "the counter restarted or skipped")


if __name__ == "__main__":
    unittest.main()
