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
        self.assertEqual(r["message"], 's3 PUT "x": the bucket could not be reached')

    def test_link_local_endpoint_is_refused(self):
        r, _ = s3env.tool(self.srv.target(endpoint="http://169.254.169.254"), "putdata", "x", "y")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("link-local", r["message"])
        # even when the operator allows loopback
        r, _ = s3env.tool(self.srv.target(endpoint="http://169.254.169.254"), "putdata", "x", "y",
                          allow="127.0.0.0/8")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("link-local", r["message"])

    def test_loopback_is_refused_unless_allowed(self):
        port = self.srv.port
        self.srv.clear_log()
        for endpoint, what in [(f"http://127.0.0.1:{port}", "loopback"),
                               (f"http://localhost:{port}", "loopback"),
                               (f"http://2130706433:{port}", "loopback"),
                               (f"http://0x7f.1:{port}", "loopback"),
                               (f"http://[::ffff:127.0.0.1]:{port}", "loopback"),
                               (f"http://[64:ff9b::7f00:1]:{port}", "loopback"),
                               (f"http://0.0.0.0:{port}", "unspecified")]:
            r, _ = s3env.tool(self.srv.target(endpoint=endpoint), "putdata", "x", "y", allow="")
            self.assertEqual(r["rc"], "invalid", (endpoint, r))
            self.assertIn(what, r["message"], (endpoint, r))
            self.assertNotIn("127.0.0.1", r["message"])
        self.assertEqual(self.srv.requests(), [], "a refused endpoint was reached")
        # allowed by address, by network and by host name: reached
        for endpoint, allow in [(f"http://127.0.0.1:{port}", "127.0.0.1"),
                                (f"http://2130706433:{port}", "127.0.0.0/8"),
                                (f"http://localhost:{port}", "localhost")]:
            r, _ = s3env.tool(self.srv.target(endpoint=endpoint), "putdata", "x", "y", allow=allow)
            self.assertEqual(r["rc"], "ok", (endpoint, allow, r))
        self.assertEqual(len(self.srv.requests()), 3)
        # a malformed allow list is refused, not read as empty or as everything
        r, _ = s3env.tool(self.srv.target(), "putdata", "x", "y", allow="127.0.0.0/99")
        self.assertEqual(r["rc"], "invalid", r)
        self.assertIn("storage_allow", r["message"])

    def test_an_endpoints_answer_is_never_repeated(self):
        canary = "kiln-canary-7f3a9c"
        body = (f"<?xml version='1.0'?><Error><Code>{canary}Code</Code>"
                f"<Message>{canary} ssh-2.0 redis_version:7</Message></Error>").encode()
        for status, want_rc, want in [(400, "invalid", "the bucket refused the request"),
                                      (403, "forbidden", "the bucket refused the credentials"),
                                      (500, "unavailable", "the bucket could not be reached"),
                                      (200, "ok", None)]:
            srv = s3env.CannedServer(status, body, {"ETag": '"abc"'})
            try:
                r, _ = s3env.tool(self.srv.target(endpoint=srv.endpoint), "putdata", "k", "v")
                self.assertEqual(r["rc"], want_rc, (status, r))
                if want:
                    self.assertEqual(r["message"], f's3 PUT "k": {want}', (status, r))
                self.assertNotIn(canary, json.dumps(r))
                # a multipart upload: the create's answer is parsed, and its <Error> too
                path = self.file(6 * MIB)
                r, _ = s3env.tool(self.srv.target(endpoint=srv.endpoint), "put", "m", path,
                                  part_size=5 * MIB)
                self.assertNotIn(canary, json.dumps(r))
                self.assertNotEqual(r["rc"], "ok", (status, r))
            finally:
                srv.stop()

    def test_redirects_are_not_followed(self):
        srv = s3env.CannedServer(307, b"", {"Location": self.srv.endpoint + "/" + s3env.BUCKET + "/x"})
        try:
            self.srv.clear_log()
            r, _ = s3env.tool(self.srv.target(endpoint=srv.endpoint), "putdata", "x", "y")
            self.assertEqual(r["rc"], "invalid", r)
            self.assertEqual(srv.hits, 1)
            self.assertEqual(self.srv.requests(), [], "the redirect was followed")
        finally:
            srv.stop()

    def test_a_closed_port_and_a_silent_one_read_alike(self):
        port, held = s3env.silent_port()
        try:
            closed, _ = s3env.tool(self.srv.target(endpoint=f"http://127.0.0.1:{kiln.free_port()}"),
                                   "putdata", "x", "y")
            silent, _ = s3env.tool(self.srv.target(endpoint=f"http://127.0.0.1:{port}"),
                                   "putdata", "x", "y")
        finally:
            for s in held:
                s.close()
        self.assertEqual(closed, silent)
        self.assertEqual(closed["rc"], "unavailable", closed)


if __name__ == "__main__":
    unittest.main()
