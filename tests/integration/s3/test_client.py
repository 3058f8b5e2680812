"""The S3 client (common/s3.c, through s3_tool) against s3rver behind a SigV4-checking proxy, its
objects read back by the AWS SDK for JavaScript."""
import filecmp
import json
import os
import re
import tempfile
import unittest

import kiln
import s3env

MIB = 1 << 20


def random_file(size):
    f = tempfile.NamedTemporaryFile(prefix="kiln-s3-obj-", delete=False)
    f.write(os.urandom(size))
    f.close()
    return f.name


class ClientTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = s3env.S3Server()

    @classmethod
    def tearDownClass(cls):
        cls.srv.stop()

    def setUp(self):
        self.files = []

    def tearDown(self):
        for p in self.files:
            for suffix in ("", ".s3upload", ".s3upload.tmp", ".part"):
                if os.path.exists(p + suffix):
                    os.unlink(p + suffix)

    def file(self, size):
        p = random_file(size)
        self.files.append(p)
        return p

    def sdk_equals(self, key, path):
        out = tempfile.mktemp(prefix="kiln-s3-sdk-")
        self.files.append(out)
        r = s3env.sdk(self.srv.endpoint, "get", key, out)
        self.assertNotIn("error", r, r)
        self.assertTrue(filecmp.cmp(path, out, shallow=False), "the SDK read other bytes")
        return r

    def test_small_object_is_one_put_and_reads_back_byte_for_byte(self):
        t = self.srv.target("small/")
        path = self.file(MIB + 123)
        self.srv.clear_log()
        r, _ = s3env.tool(t, "put", "snap_a.obj", path)
        self.assertEqual(r["rc"], "ok", r)
        self.assertEqual((r["parts"], r["parts_sent"], r["multipart"]), (1, 1, False))
        reqs = self.srv.requests()
        self.assertEqual([(m, s) for m, _, s in reqs], [("PUT", "200")], reqs)
        self.sdk_equals("small/snap_a.obj", path)
        # Kiln's own reads: HEAD, GET to a file, list.
        r, _ = s3env.tool(t, "head", "snap_a.obj")
        self.assertEqual((r["rc"], r["size"]), ("ok", MIB + 123))
        got = tempfile.mktemp(prefix="kiln-s3-get-")
        self.files.append(got)
        r, _ = s3env.tool(t, "get", "snap_a.obj", got)
        self.assertEqual(r["rc"], "ok", r)
        self.assertTrue(filecmp.cmp(path, got, shallow=False))
        self.assertFalse(os.path.exists(got + ".part"))
        r, _ = s3env.tool(t, "list", "")
        self.assertEqual(r["keys"], [{"key": "snap_a.obj", "size": MIB + 123}])

    def test_odd_keys_are_signed_and_encoded_right(self):
        # The proxy recomputes every signature with the SDK's signer: spaces, '+', '&', '=' and
        # UTF-8 in the prefix and key must be encoded the same way on both sides.
        t = self.srv.target("odd prefix/é/")
        r, _ = s3env.tool(t, "putdata", "a+b&c=d e.txt", "hello")
        self.assertEqual(r["rc"], "ok", r)
        out = tempfile.mktemp()
        self.files.append(out)
        r = s3env.sdk(self.srv.endpoint, "get", "odd prefix/é/a+b&c=d e.txt", out)
        self.assertEqual(r.get("size"), 5, r)
        with open(out) as f:
            self.assertEqual(f.read(), "hello")
        r, _ = s3env.tool(t, "delete", "a+b&c=d e.txt")
        self.assertEqual(r["rc"], "ok", r)
        r, _ = s3env.tool(t, "head", "a+b&c=d e.txt")
        self.assertEqual(r["rc"], "not_found", r)

    def test_multipart_upload_of_20_mib_in_5_mib_parts(self):
        t = self.srv.target("mp/")
        path = self.file(20 * MIB + 7)
        self.srv.clear_log()
        r, _ = s3env.tool(t, "put", "snap_big.obj", path, part_size=5 * MIB)
        self.assertEqual(r["rc"], "ok", r)
        self.assertEqual((r["parts"], r["parts_sent"], r["multipart"]), (5, 5, True))
        parts = [q for m, q, s in self.srv.requests() if m == "PUT" and "partNumber=" in q]
        # Every part passed the proxy's Content-MD5 and SHA-256 checks (200, not 400).
        self.assertEqual(len(parts), 5, self.srv.requests())
        self.assertTrue(all(s == "200" for m, q, s in self.srv.requests()), self.srv.requests())
        self.assertFalse(os.path.exists(path + ".s3upload"), "the state file outlived the upload")
        self.sdk_equals("mp/snap_big.obj", path)

    def test_upload_resumes_after_the_server_is_killed_mid_upload(self):
        t = self.srv.target("resume/")
        path = self.file(20 * MIB)
        self.srv.clear_log()
        p = s3env.tool_popen(t, "put", "snap_r.obj", path, "2", part_size=5 * MIB)
        self.assertEqual(p.stdout.readline().strip(), "paused")
        self.srv.kill_s3rver()            # a crash after part 2 of 4
        out, err = p.communicate("go\n", timeout=60)
        r = json.loads(out.strip().splitlines()[-1])
        self.assertEqual(r["rc"], "unavailable", r)
        self.assertEqual(r["parts_sent"], 2, r)
        with open(path + ".s3upload") as f:
            state = f.read()
        self.assertEqual(len(re.findall(r"^part \d+ ", state, re.M)), 2, state)
        self.assertNotIn(s3env.SECRET, state)

        self.srv.start_s3rver()           # same directory, same port
        self.srv.clear_log()
        r, _ = s3env.tool(t, "put", "snap_r.obj", path, part_size=5 * MIB)
        self.assertEqual(r["rc"], "ok", r)
        self.assertEqual((r["resumed"], r["parts_skipped"], r["parts_sent"]), (True, 2, 2), r)
        sent = sorted(int(re.search(r"partNumber=(\d+)", q).group(1))
                      for m, q, s in self.srv.requests() if m == "PUT" and "partNumber=" in q)
        self.assertEqual(sent, [3, 4], self.srv.requests())
        self.assertFalse([q for m, q, s in self.srv.requests() if q.endswith("uploads=")],
                         "a new upload was started instead of resuming")
        self.assertFalse(os.path.exists(path + ".s3upload"))
        self.sdk_equals("resume/snap_r.obj", path)

    def test_a_changed_file_starts_a_new_upload(self):
        t = self.srv.target("changed/")
        path = self.file(12 * MIB)
        p = s3env.tool_popen(t, "put", "snap_c.obj", path, "1", part_size=5 * MIB)
        self.assertEqual(p.stdout.readline().strip(), "paused")
        p.communicate("", timeout=60)     # EOF: the callback stops the upload, state kept
        self.assertTrue(os.path.exists(path + ".s3upload"))
        with open(path, "r+b") as f:      # new content, new mtime
            f.write(os.urandom(MIB))
        os.utime(path, (1, 1))
        r, _ = s3env.tool(t, "put", "snap_c.obj", path, part_size=5 * MIB)
        self.assertEqual((r["rc"], r["resumed"], r["parts_sent"]), ("ok", False, 3), r)
        self.sdk_equals("changed/snap_c.obj", path)

    def test_a_malformed_state_file_is_ignored(self):
        t = self.srv.target("torn/")
        path = self.file(11 * MIB)
        with open(path + ".s3upload", "w") as f:
            f.write("kiln-s3-upload 1\nendpoint x\n")   # torn
        r, _ = s3env.tool(t, "put", "snap_t.obj", path, part_size=5 * MIB)
        self.assertEqual((r["rc"], r["resumed"], r["parts_sent"]), ("ok", False, 3), r)
        self.sdk_equals("torn/snap_t.obj", path)

    def test_wrong_secret_is_forbidden_with_the_s3_code(self):
        r, _ = s3env.tool(self.srv.target(secret_access_key="not-the-secret"), "putdata", "x", "y")
        self.assertEqual(r["rc"], "forbidden", r)
        self.assertIn("SignatureDoesNotMatch", r["message"])
        self.assertNotIn("not-the-secret", r["message"])

    def test_unknown_access_key_is_forbidden_with_the_s3_code(self):
        r, _ = s3env.tool(self.srv.target(access_key_id="NOBODY"), "putdata", "x", "y")
        self.assertEqual(r["rc"], "forbidden", r)
        self.assertIn("InvalidAccessKeyId", r["message"])

    def test_multipart_with_bad_credentials_fails_and_keeps_no_state(self):
        path = self.file(11 * MIB)
        r, _ = s3env.tool(self.srv.target(access_key_id="NOBODY"), "put", "k", path,
                          part_size=5 * MIB)
        self.assertEqual(r["rc"], "forbidden", r)
        self.assertFalse(os.path.exists(path + ".s3upload"))

    def test_missing_bucket_is_invalid_with_the_s3_code(self):
        r, _ = s3env.tool(self.srv.target(bucket="no-such-bucket"), "putdata", "x", "y")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("NoSuchBucket", r["message"])

    def test_missing_key_is_not_found_and_leaves_no_file(self):
        got = tempfile.mktemp(prefix="kiln-s3-get-")
        r, _ = s3env.tool(self.srv.target(), "get", "nothing-here", got)
        self.assertEqual(r["rc"], "not_found", r)
        self.assertFalse(os.path.exists(got) or os.path.exists(got + ".part"))
        r, _ = s3env.tool(self.srv.target(), "head", "nothing-here")
        self.assertEqual(r["rc"], "not_found", r)

    def test_unreachable_endpoint_is_unavailable(self):
        port = kiln.free_port()        # nothing listens there
        r, _ = s3env.tool(self.srv.target(endpoint=f"http://127.0.0.1:{port}"), "putdata", "x", "y",
                          retries=1)
        self.assertEqual(r["rc"], "unavailable", r)
        self.assertIn("cannot reach", r["message"])

    def test_link_local_endpoint_is_refused(self):
        r, _ = s3env.tool(self.srv.target(endpoint="http://169.254.169.254"), "putdata", "x", "y")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("link-local", r["message"])


if __name__ == "__main__":
    unittest.main()
