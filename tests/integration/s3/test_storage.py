"""PUT /v1/storage through the gateway: validation, the test write against a real S3-compatible
server, the secret sealed in Postgres and never returned, and storage_load() as kiln-node uses it;
endpoints that lead into the operator's network (loopback, private, link-local, this host…) refused
unless storage_allow names them, and nothing of a target's answer in the errors."""
import json
import os
import re
import subprocess
import time
import unittest

import kiln
import s3env

STORAGE_TOOL = os.path.join(kiln.BUILD, "tests", "integration", "s3", "storage_tool")


class StorageTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # each cleanup registered as its part is made: a start that fails part way (a gateway
        # that cannot listen) leaves nothing behind either
        cls.srv = s3env.S3Server()
        cls.addClassCleanup(cls.srv.stop)
        env = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.addClassCleanup(cls.db.drop)
        # the tests' S3 server is on 127.0.0.1: this gateway's operator allows it
        cls.gw = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"], s3env.ALLOW_ENV)
        cls.addClassCleanup(cls.gw.cleanup)
        cls.admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        # and this one's (same database) allows nothing: the default
        cls.strict = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"], master_key=cls.gw.master_key)
        cls.addClassCleanup(cls.strict.cleanup)

    def tenant(self, name="acme"):
        r = self.gw.request("POST", "/v1/tenants", {"name": name}, self.admin)
        self.assertEqual(r.status, 201, r)
        body = r.json()
        return body["tenant"]["id"], {"Authorization": "Bearer " + body["api_key"]["key"]}

    def put(self, hdrs, gw=None, **over):
        body = {"kind": "s3"}
        body.update(self.srv.target("tenants/acme/"))
        body.update(over)
        body = {k: v for k, v in body.items() if v is not None}
        return (gw or self.gw).request("PUT", "/v1/storage", body, hdrs)

    def stored(self, tid):
        return self.db.sql(f"SELECT count(*) FROM tenant_storage WHERE tenant_id = '{tid}'")

    def load(self, tenant_id, master_key=None, expect_secret=s3env.SECRET):
        env = dict(os.environ, KILN_MASTER_KEY=master_key or self.gw.master_key,
                   EXPECT_SECRET=expect_secret)
        out = subprocess.run([STORAGE_TOOL, self.db.url, tenant_id], env=env, capture_output=True,
                             text=True, timeout=30)
        return json.loads(out.stdout)

    def test_put_storage_checks_the_bucket_and_seals_the_secret(self):
        tid, hdrs = self.tenant()
        self.srv.clear_log()
        r = self.put(hdrs)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"kind": "s3", "endpoint": self.srv.endpoint,
                                    "bucket": s3env.BUCKET, "region": "us-east-1",
                                    "prefix": "tenants/acme/", "access_key_id": s3env.ACCESS_KEY_ID})
        self.assertNotIn(s3env.SECRET.encode(), r.data, "the secret came back")
        # The test write: a PUT, a HEAD and a DELETE under the prefix, all signed right.
        reqs = self.srv.requests()
        self.assertEqual([(m, s) for m, _, s in reqs], [("PUT", "200"), ("HEAD", "200"),
                                                        ("DELETE", "204")], reqs)
        self.assertTrue(reqs[0][1].startswith(f"/{s3env.BUCKET}/tenants/acme/.kiln-write-check-"))
        self.assertEqual(s3env.sdk(self.srv.endpoint, "list", "tenants/acme/")["keys"], [])
        # In Postgres: sealed, nowhere in clear text in the row.
        row = self.db.sql(f"SELECT t::text FROM tenant_storage t WHERE tenant_id = '{tid}'")
        self.assertIn("k1.", row)
        self.assertNotIn(s3env.SECRET, row)
        sealed = self.db.sql(f"SELECT secret_sealed FROM tenant_storage WHERE tenant_id = '{tid}'")
        self.assertTrue(sealed.startswith("k1."), sealed)
        dump = subprocess.run(["pg_dump", "-h", self.db.sockdir, "-U", "kiln", "-a",
                               "-t", "tenant_storage", self.db.name], capture_output=True,
                              text=True, check=True).stdout
        self.assertIn(sealed, dump)
        self.assertNotIn(s3env.SECRET, dump)
        self.assertNotIn(s3env.SECRET, self.gw.output())

    def test_the_node_loads_the_setting_with_the_secret_opened(self):
        tid, hdrs = self.tenant("loader")
        self.assertEqual(self.put(hdrs, prefix="p/").status, 200)
        got = self.load(tid)
        self.assertEqual(got["rc"], "ok", got)
        self.assertEqual((got["endpoint"], got["bucket"], got["prefix"], got["secret_matches"]),
                         (self.srv.endpoint, s3env.BUCKET, "p/", True))
        # Another master key does not open it; a tenant without a bucket is not_found.
        self.assertEqual(self.load(tid, master_key="ab" * 32)["rc"], "internal")
        other, _ = self.tenant("nobucket")
        self.assertEqual(self.load(other)["rc"], "not_found")
        # A sealed secret moved to another tenant's row does not open there.
        self.db.sql(f"INSERT INTO tenant_storage (tenant_id, kind, endpoint, bucket, region, "
                    f"access_key_id, secret_sealed) SELECT '{other}', kind, endpoint, bucket, "
                    f"region, access_key_id, secret_sealed FROM tenant_storage "
                    f"WHERE tenant_id = '{tid}'")
        self.assertEqual(self.load(other)["rc"], "internal")

    def test_put_again_replaces_the_setting(self):
        tid, hdrs = self.tenant("twice")
        self.assertEqual(self.put(hdrs, prefix="one/").status, 200)
        self.assertEqual(self.put(hdrs, prefix="two/").status, 200)
        self.assertEqual(self.db.sql(f"SELECT prefix FROM tenant_storage WHERE tenant_id = '{tid}'"),
                         "two/")

    def test_bad_credentials_are_422_naming_the_s3_error_and_store_nothing(self):
        tid, hdrs = self.tenant("badcreds")
        r = self.put(hdrs, secret_access_key="wrong-secret-value")
        self.assertEqual(r.status, 422, r)
        self.assertEqual(r.json()["error"]["code"], "invalid")
        self.assertIn("SignatureDoesNotMatch", r.json()["error"]["message"])
        self.assertNotIn(b"wrong-secret-value", r.data)
        r = self.put(hdrs, access_key_id="NOBODY")
        self.assertEqual(r.status, 422, r)
        self.assertIn("InvalidAccessKeyId", r.json()["error"]["message"])
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM tenant_storage WHERE tenant_id = '{tid}'"),
                         "0")
        self.assertNotIn("wrong-secret-value", self.gw.output())

    def test_missing_bucket_and_unreachable_endpoint_are_422(self):
        _, hdrs = self.tenant("unreach")
        r = self.put(hdrs, bucket="no-such-bucket")
        self.assertEqual(r.status, 422, r)
        self.assertIn("NoSuchBucket", r.json()["error"]["message"])
        r = self.put(hdrs, endpoint=f"http://127.0.0.1:{kiln.free_port()}")
        self.assertEqual(r.status, 422, r)
        self.assertIn("the bucket could not be reached", r.json()["error"]["message"])

    def test_each_field_is_validated(self):
        _, hdrs = self.tenant("fields")
        cases = {
            "kind": ({"kind": "gcs"}, 422),
            "endpoint": ({"endpoint": "ftp://example.com"}, 422),
            "endpoint ": ({"endpoint": "http://user:pw@example.com"}, 422),
            "bucket": ({"bucket": "Bad_Bucket"}, 422),
            "bucket ": ({"bucket": "ab"}, 422),
            "region": ({"region": "us east"}, 422),
            "prefix": ({"prefix": "/abs"}, 422),
            "access_key_id": ({"access_key_id": "has space"}, 422),
            "secret_access_key": ({"secret_access_key": ""}, 422),
        }
        for field, (over, status) in cases.items():
            r = self.put(hdrs, **over)
            self.assertEqual(r.status, status, (field, r))
            self.assertIn(field.strip(), r.json()["error"]["message"], (field, r))
        r = self.put(hdrs, bucket=None)
        self.assertEqual(r.status, 400, r)
        self.assertIn("bucket", r.json()["error"]["message"])
        r = self.put(hdrs, color="blue")
        self.assertEqual(r.status, 400, r)
        r = self.put(hdrs, region="x" * 65)
        self.assertIn(r.status, (413, 422), r)

    def test_endpoints_into_the_operators_network_are_refused(self):
        tid, hdrs = self.tenant("scanner")
        port = self.srv.port    # the S3 server itself: reachable, were it allowed
        # this host's own addresses (its interfaces'), but the ones that need a zone
        ifs = json.loads(subprocess.run(["ip", "-j", "addr", "show"], capture_output=True,
                                        text=True, check=True).stdout)
        own = sorted({a["local"] for i in ifs for a in i.get("addr_info", [])
                      if not a["local"].startswith("fe80")} - {"127.0.0.1", "::1"})
        self.assertTrue(own, "this host has no address but loopback")
        cases = [("127.0.0.1", "loopback"), ("localhost", "loopback"), ("[::1]", "loopback"),
                 ("127.1", "loopback"), ("2130706433", "loopback"), ("0x7f.1", "loopback"),
                 ("0x7f000001", "loopback"), ("017700000001", "loopback"),
                 ("0177.0.0.1", "loopback"), ("[::ffff:127.0.0.1]", "loopback"),
                 ("[::ffff:7f00:1]", "loopback"), ("[64:ff9b::7f00:1]", "loopback"),
                 ("[2002:7f00:1::1]", "loopback"),
                 ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"),
                 ("[fc00::1]", "private"), ("[fd00:ec2::254]", "private"),
                 ("[64:ff9b::a00:1]", "private"), ("[::ffff:10.0.0.1]", "private"),
                 ("100.64.0.1", "shared"), ("169.254.169.254", "link-local"),
                 ("[fe80::1]", "link-local"), ("[::ffff:169.254.169.254]", "link-local"),
                 ("0.0.0.0", "unspecified"), ("[::]", "unspecified"), ("0", "unspecified"),
                 ("224.0.0.1", "multicast"), ("[ff02::1]", "multicast"),
                 ("255.255.255.255", "reserved")]
        cases += [(f"[{a}]" if ":" in a else a, "") for a in own]
        self.srv.clear_log()
        for host, what in cases:
            r = self.put(hdrs, gw=self.strict, endpoint=f"http://{host}:{port}")
            self.assertEqual(r.status, 422, (host, r))
            msg = r.json()["error"]["message"]
            self.assertTrue(msg.startswith("endpoint: the endpoint's host resolves to "), (host, msg))
            self.assertIn(what, msg, host)
            self.assertIn("storage_allow", msg)
        self.assertEqual(self.stored(tid), "0")
        self.assertEqual(self.srv.requests(), [], "a refused endpoint was reached")
        # The same setting through the gateway whose operator allows 127.0.0.1 is taken.
        self.assertEqual(self.put(hdrs, endpoint=f"http://127.0.0.1:{port}").status, 200)
        self.assertEqual(self.stored(tid), "1")

    def test_an_endpoints_answer_never_reaches_the_tenant(self):
        tid, hdrs = self.tenant("canary")
        canary = "kiln-canary-51d0e2"
        body = (f"<Error><Code>{canary}</Code><Message>{canary}: SSH-2.0-OpenSSH_9.6"
                f"</Message></Error>").encode()
        for status in (400, 403, 404, 500, 301):
            srv = s3env.CannedServer(status, body, {"Location": "http://169.254.169.254/"})
            try:
                r = self.put(hdrs, endpoint=srv.endpoint)
            finally:
                srv.stop()
            self.assertEqual(r.status, 422, (status, r))
            self.assertNotIn(canary.encode(), r.data, status)
            self.assertNotIn(b"SSH", r.data, status)
            msg = r.json()["error"]["message"]
            self.assertTrue(msg.startswith("the bucket cannot be written: s3 PUT "), msg)
            self.assertTrue(msg.endswith((": the bucket refused the request",
                                          ": the bucket refused the credentials",
                                          ": no such object",
                                          ": the bucket could not be reached")), msg)
        self.assertEqual(self.stored(tid), "0")

    def test_a_closed_port_and_a_silent_one_answer_alike(self):
        _, hdrs = self.tenant("ports")
        port, held = s3env.silent_port()
        try:
            t0 = time.monotonic()
            closed = self.put(hdrs, endpoint=f"http://127.0.0.1:{kiln.free_port()}")
            t1 = time.monotonic()
            silent = self.put(hdrs, endpoint=f"http://127.0.0.1:{port}")
            t2 = time.monotonic()
        finally:
            for s in held:
                s.close()
        def seen(r):    # what a tenant sees, but the test object's fresh id
            return r.status, r.json()["error"]["code"], re.sub(r"chk_[a-z0-9]+", "chk_",
                                                                r.json()["error"]["message"])
        self.assertEqual(seen(closed), seen(silent))
        self.assertIn(b"the bucket could not be reached", closed.data)
        # a closed port answers at once, but the gateway waits as long as for a silent one
        self.assertGreater(t1 - t0, 4.8)
        self.assertGreater(t2 - t1, 4.8)
        self.assertLess(abs((t2 - t1) - (t1 - t0)), 1.5)

    def test_needs_keys_write(self):
        _, hdrs = self.tenant("scoped")
        r = self.gw.request("POST", "/v1/api-keys", {"name": "ro", "scopes": ["sandbox:read"]}, hdrs)
        self.assertEqual(r.status, 201, r)
        ro = {"Authorization": "Bearer " + r.json()["key"]}
        self.assertEqual(self.put(ro).status, 403)
        self.assertEqual(self.gw.request("PUT", "/v1/storage", {}).status, 401)


if __name__ == "__main__":
    unittest.main()
