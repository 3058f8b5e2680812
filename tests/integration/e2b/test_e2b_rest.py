"""E2B's REST API on kiln-gateway's E2B listener (api/e2b.c, docs/e2b.md): the shapes the `e2b`
SDKs depend on, without VMs. Sandboxes are rows written straight into the test's database (no
node holds them), which is all get, list, pause's refusal and kill need.

The error shape is the SDKs' contract: `{"code": <the HTTP status as an integer>, "message"}`;
`kill()` returning false and SandboxNotFoundError hang on `code == 404` in the body.
"""
import http.client
import json
import select
import socket
import subprocess
import time
import unittest
import urllib.parse

import kiln

GENEROUS = {"KILN_RATE_LIMIT_RPS": "100000", "KILN_RATE_LIMIT_BURST": "100000",
            "KILN_TENANT_RATE_LIMIT_RPS": "100000", "KILN_TENANT_RATE_LIMIT_BURST": "100000"}


def http_from(source, url, headers):
    """A GET from the loopback address `source` (all of 127/8 is loopback). A connection over
    the per-address cap is answered at once and closed, maybe before the request is in: sending
    it may then fail (EPIPE, reset), and the answer is still there to read."""
    u = urllib.parse.urlsplit(url)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(60)
        s.bind((source, 0))
        s.connect((u.hostname, u.port))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        try:
            s.sendall(f"GET {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\n{head}"
                      "Connection: close\r\n\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = http.client.HTTPResponse(s)
        r.begin()
        return kiln.Response(r.status, r.headers, r.read())
    finally:
        s.close()


def hex_addr(addr, port):
    """An IPv4 socket address as /proc/net/tcp writes it."""
    return "%08X:%04X" % (int.from_bytes(socket.inet_aton(addr), "little"), port)


def accepted(port, clients):
    """Whether the process listening on 127.0.0.1:`port` has accepted every connection whose
    client end is in `clients`: the kernel's accept queue of the port is empty and each one's
    server end is past SYN_RECV (established, or closed since by that process)."""
    queued, states = None, {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state, queues = line.split()[1:5]
            if local != hex_addr("127.0.0.1", port):
                continue
            if state == "0A":  # LISTEN: its rx_queue is the accept queue
                queued = int(queues.split(":")[1], 16)
            else:
                states[remote] = state
    return queued == 0 and all(states.get(hex_addr(*c), "03") != "03" for c in clients)


class E2bRest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.services = kiln.services_env()
        cls.db = kiln.fresh_database()
        try:
            cls.gw = kiln.Gateway(cls.db.url, cls.services["KILN_REDIS_URL"], GENEROUS, e2b=True)
        except Exception:
            cls.db.drop()
            raise
        admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        cls.tenants = {}
        for name in ("acme", "other"):
            r = cls.gw.request("POST", "/v1/tenants", {"name": name}, admin)
            assert r.status == 201, r
            cls.tenants[name] = (r.json()["tenant"]["id"], r.json()["api_key"]["key"])
        acme = cls.tenants["acme"][0]
        # 7 of acme's sandboxes, newest last: 4 running (team a: 3), 1 creating, 1 paused, 1 stopped.
        rows = [("sb_e2btest0", "running", {"team": "a", "n": "0"}),
                ("sb_e2btest1", "running", {"team": "a", "n": "1"}),
                ("sb_e2btest2", "paused", {"team": "a", "a b": "c&d"}),
                ("sb_e2btest3", "running", {"team": "b"}),
                ("sb_e2btest4", "stopped", {"team": "a"}),
                ("sb_e2btest5", "creating", {"team": "a"}),
                ("sb_e2btest6", "running", {})]
        values = ",".join(
            f"('{i}', '{acme}', '{st}', '{'code-interpreter-v1' if i == 'sb_e2btest3' else 'python'}', "
            f"1000, 512, 10, 300, "
            f"'{json.dumps(md)}'::jsonb, now() - interval '{100 - k} seconds', "
            f"now() + interval '300 seconds')"
            for k, (i, st, md) in enumerate(rows))
        cls.db.sql("INSERT INTO sandboxes (id, tenant_id, state, template, vcpu_milli, memory_mib, "
                   "disk_gib, timeout_s, metadata, created_at, expires_at) VALUES " + values)

    @classmethod
    def tearDownClass(cls):
        cls.gw.cleanup()
        cls.db.drop()

    def e2b(self, method, path, body=None, tenant="acme", headers=None):
        h = {"X-API-Key": self.tenants[tenant][1]} if tenant else {}
        h.update(headers or {})
        return kiln.http(method, self.gw.e2b_url + path, body, h)

    def assertE2bError(self, r, status):
        self.assertEqual(r.status, status, r)
        body = r.json()
        self.assertEqual(body["code"], status, body)
        self.assertIsInstance(body["message"], str)
        self.assertTrue(body["message"])
        return body["message"]

    def test_key_is_required_and_checked(self):
        self.assertIn("X-API-Key", self.assertE2bError(self.e2b("GET", "/v2/sandboxes", tenant=None), 401))
        r = self.e2b("GET", "/v2/sandboxes", tenant=None, headers={"X-API-Key": "kiln_nope"})
        self.assertE2bError(r, 401)

    def test_get_maps_the_sandbox(self):
        r = self.e2b("GET", "/sandboxes/sb_e2btest2")
        self.assertEqual(r.status, 200, r)
        d = r.json()
        self.assertEqual(d["sandboxID"], "sb_e2btest2")
        self.assertEqual(d["state"], "paused")
        self.assertEqual(d["metadata"], {"team": "a", "a b": "c&d"})
        self.assertEqual((d["cpuCount"], d["memoryMB"], d["diskSizeMB"]), (1, 512, 10240))
        self.assertEqual(d["envdVersion"], "0.4.0")
        for k in ("templateID", "clientID", "startedAt", "endAt", "lifecycle", "volumeMounts"):
            self.assertIn(k, d)
        self.assertEqual(self.e2b("GET", "/sandboxes/sb_e2btest5").json()["state"], "running")

    def test_not_found_everywhere(self):
        # Unknown, stopped, another tenant's, and not an id at all: 404 with code 404.
        for path in ("/sandboxes/sb_nope", "/sandboxes/sb_e2btest4", "/sandboxes/sb_x.y"):
            self.assertE2bError(self.e2b("GET", path), 404)
        self.assertE2bError(self.e2b("GET", "/sandboxes/sb_e2btest0", tenant="other"), 404)
        self.assertE2bError(self.e2b("DELETE", "/sandboxes/sb_e2btest0", tenant="other"), 404)
        self.assertE2bError(self.e2b("POST", "/sandboxes/sb_e2btest0/timeout", {"timeout": 30},
                                     tenant="other"), 404)
        self.assertE2bError(self.e2b("POST", "/sandboxes/sb_e2btest0/pause", {}, tenant="other"), 404)
        self.assertE2bError(self.e2b("POST", "/v2/sandboxes/sb_e2btest0/connect", {},
                                     tenant="other"), 404)
        self.assertE2bError(self.e2b("GET", "/sandboxes/sb_e2btest0/metrics", tenant="other"), 404)
        self.assertE2bError(self.e2b("PUT", "/sandboxes/sb_e2btest0/network", {},
                                     tenant="other"), 404)
        # ... and the other tenant's list does not show acme's.
        self.assertEqual(self.e2b("GET", "/v2/sandboxes", tenant="other").json(), [])

    def test_pause_of_a_paused_sandbox_is_409(self):
        self.assertE2bError(self.e2b("POST", "/sandboxes/sb_e2btest2/pause", {}), 409)

    def test_metrics_are_the_usage_series(self):
        # The meter's per-second series (Redis, "t:cpu_us:mem:rx:tx:ucr"): 10 s at 50 % of 1
        # vCPU, then 10 s idle, within one E2B sample of 5 s each.
        now = int(time.time()) // 5 * 5 - 60
        sock = self.services["KILN_REDIS_URL"][len("unix:"):]
        args = []
        for k in range(20):
            t = now + k
            args += [str(t), f"{t}:{500000 if k < 10 else 0}:{100 << 20}:0:0:1"]
        subprocess.run(["redis-cli", "-s", sock, "ZADD", "kiln:usage:sb_e2btest1", *args],
                       check=True, capture_output=True)
        r = self.e2b("GET", f"/sandboxes/sb_e2btest1/metrics?start={now}&end={now + 20}")
        self.assertEqual(r.status, 200, r)
        m = r.json()
        self.assertEqual([x["timestampUnix"] for x in m], [now, now + 5, now + 10, now + 15])
        self.assertEqual([x["cpuUsedPct"] for x in m], [50.0, 50.0, 0.0, 0.0])
        self.assertEqual({x["memUsed"] for x in m}, {100 << 20})
        self.assertEqual({(x["cpuCount"], x["memTotal"], x["diskTotal"]) for x in m},
                         {(1, 512 << 20, 10 << 30)})
        # Without a range: the last 15 minutes; nothing recorded for this one.
        self.assertEqual(self.e2b("GET", "/sandboxes/sb_e2btest0/metrics").json(), [])
        for q in ("start=x", "start=10&end=5", "end=-1"):
            self.assertE2bError(self.e2b("GET", "/sandboxes/sb_e2btest0/metrics?" + q), 400)

    def list_all(self, query, limit):
        ids, token, pages = [], None, 0
        while True:
            q = dict(query, limit=str(limit))
            if token:
                q["nextToken"] = token
            r = self.e2b("GET", "/v2/sandboxes?" + urllib.parse.urlencode(q))
            self.assertEqual(r.status, 200, r)
            page = r.json()
            self.assertLessEqual(len(page), limit)
            ids += [s["sandboxID"] for s in page]
            pages += 1
            token = r.headers.get("X-Next-Token")
            if not token:
                return ids, pages
            self.assertLess(pages, 20)

    def test_list_pages_and_filters(self):
        ids, pages = self.list_all({}, 2)
        # Newest first; the stopped one is not E2B's to show.
        self.assertEqual(ids, ["sb_e2btest6", "sb_e2btest5", "sb_e2btest3", "sb_e2btest2",
                               "sb_e2btest1", "sb_e2btest0"])
        self.assertGreaterEqual(pages, 3)
        ids, _ = self.list_all({"state": "paused"}, 2)
        self.assertEqual(ids, ["sb_e2btest2"])
        ids, _ = self.list_all({"state": "running"}, 100)
        self.assertEqual(ids, ["sb_e2btest6", "sb_e2btest5", "sb_e2btest3", "sb_e2btest1",
                               "sb_e2btest0"])
        # The SDK's metadata filter: key=value pairs form-encoded, each part encoded once more.
        enc = lambda md: urllib.parse.urlencode({urllib.parse.quote(k, safe=""): urllib.parse.quote(v, safe="")
                                                 for k, v in md.items()})
        ids, _ = self.list_all({"metadata": enc({"team": "a"}), "state": "running,paused"}, 1)
        self.assertEqual(ids, ["sb_e2btest5", "sb_e2btest2", "sb_e2btest1", "sb_e2btest0"])
        ids, _ = self.list_all({"metadata": enc({"a b": "c&d"})}, 100)
        self.assertEqual(ids, ["sb_e2btest2"])
        ids, _ = self.list_all({"metadata": enc({"team": "a", "n": "1"})}, 100)
        self.assertEqual(ids, ["sb_e2btest1"])
        # The SDK's template filter: E2B's base is Kiln's python; another name is its own.
        ids, _ = self.list_all({"template": "code-interpreter-v1"}, 100)
        self.assertEqual(ids, ["sb_e2btest3"])
        ids, _ = self.list_all({"template": "base", "state": "running"}, 2)
        self.assertEqual(ids, ["sb_e2btest6", "sb_e2btest5", "sb_e2btest1", "sb_e2btest0"])
        ids, _ = self.list_all({"template": "python", "metadata": enc({"team": "b"})}, 100)
        self.assertEqual(ids, [])
        ids, _ = self.list_all({"template": "no-such-template"}, 100)
        self.assertEqual(ids, [])
        listed = self.e2b("GET", "/v2/sandboxes?limit=1").json()[0]
        for k in ("sandboxID", "templateID", "clientID", "startedAt", "endAt", "state", "cpuCount",
                  "memoryMB", "diskSizeMB", "envdVersion", "metadata"):
            self.assertIn(k, listed)

    def test_list_bad_input(self):
        for q in ("limit=0", "limit=101", "limit=x", "state=stopped", "state=running,",
                  "startedAfter=2026-01-01T00:00:00Z", "order=asc", "nextToken=garbage",
                  "metadata=novalue"):
            with self.subTest(q=q):
                self.assertE2bError(self.e2b("GET", "/v2/sandboxes?" + q), 400)

    def test_kiln_list_filters_the_mapping_uses(self):
        # GET /v1/sandboxes: several states, comma-separated, and a metadata object (containment).
        auth = {"Authorization": "Bearer " + self.tenants["acme"][1]}
        q = urllib.parse.urlencode({"state": "paused,stopped", "metadata": '{"team":"a"}'})
        r = self.gw.request("GET", "/v1/sandboxes?" + q, None, auth)
        self.assertEqual(r.status, 200, r)
        self.assertEqual([s["id"] for s in r.json()["sandboxes"]], ["sb_e2btest4", "sb_e2btest2"])
        for bad in ({"state": "running,bogus"}, {"state": "running,"}, {"state": ""},
                    {"metadata": "[1]"}, {"metadata": "{"}, {"metadata": "x" * 20000}):
            with self.subTest(q=bad):
                r = self.gw.request("GET", "/v1/sandboxes?" + urllib.parse.urlencode(bad), None, auth)
                self.assertEqual(r.status, 422, r)
                self.assertEqual(r.json()["error"]["code"], "invalid")

    def test_legacy_list_is_running_only(self):
        r = self.e2b("GET", "/sandboxes?metadata=" + urllib.parse.quote("team=a"))
        self.assertEqual(r.status, 200, r)
        self.assertEqual(sorted(s["sandboxID"] for s in r.json()),
                         ["sb_e2btest0", "sb_e2btest1", "sb_e2btest5"])

    def test_create_refuses_what_it_cannot_map(self):
        cases = [({"templateID": "base", "autoPause": True}, 400, "autoPause"),
                 ({"templateID": "base", "autoResume": {"enabled": True}}, 400, "autoResume"),
                 ({"templateID": "base", "mcp": {"x": {}}}, 400, "mcp"),
                 ({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}, 400,
                  "volumeMounts"),
                 ({"templateID": "base", "network": {"denyOut": ["10.0.0.0/8"]}}, 400, "denyOut"),
                 ({"templateID": "base", "network": {"egressProxy": {"address": "x:1"}}}, 400,
                  "egressProxy"),
                 # network.rules' headers map onto Kiln's secrets only for an exact allowOut host
                 # of a closed network; the rest is refused before anything is made
                 ({"templateID": "base", "network": {"rules": {"api.test": [
                     {"transform": {"headers": {"X-Key": "v"}}}]}}}, 400, "allowOut"),
                 ({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["x.test"],
                                                     "rules": {"api.test": [{"transform": {
                                                         "headers": {"X-Key": "v"}}}]}}}, 400, "allowOut"),
                 ({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["*.api.test"],
                                                     "rules": {"*.api.test": [{"transform": {
                                                         "headers": {"X-Key": "v"}}}]}}}, 400, "wildcard"),
                 ({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["api.test"],
                                                     "rules": {"api.test": [{"transform": {"headers": {
                                                         "X-Key": "Bearer ${e2b.identity.tokens.aws}"}}}]}}},
                  400, "IAM"),
                 ({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["api.test"],
                                                     "rules": {"api.test": [{"transform": {
                                                         "body": "x"}}]}}}, 400, "transform.headers"),
                 ({"templateID": "base", "network": {"rules": ["api.test"]}}, 400, "rules"),
                 ({"templateID": "base", "timeout": 0}, 400, "timeout"),
                 ({"templateID": 7}, 400, "templateID"),
                 ({"templateID": "my-template"}, 404, "my-template")]
        for body, status, word in cases:
            with self.subTest(body=body):
                self.assertIn(word, self.assertE2bError(self.e2b("POST", "/v2/sandboxes", body), status))
        self.assertE2bError(self.e2b("POST", "/v2/sandboxes", b"{nope",
                                     headers={"Content-Type": "application/json"}), 400)
        # A Kiln refusal comes back in E2B's shape too (a bad env name is Kiln's 422: E2B's 400).
        r = self.e2b("POST", "/v2/sandboxes", {"templateID": "base", "envVars": {"1BAD": "x"}})
        self.assertIn(r.status, (400, 402, 503), r)
        self.assertE2bError(r, r.status)

    def test_chunked_body_and_underscore_headers(self):
        # As the SDK sends them: a chunked JSON body and header names with underscores.
        url = urllib.parse.urlparse(self.gw.e2b_url)
        c = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        body = json.dumps({"templateID": "base", "autoPause": True}).encode()
        c.putrequest("POST", "/v2/sandboxes")
        for k, v in (("X-API-Key", self.tenants["acme"][1]), ("Content-Type", "application/json"),
                     ("Transfer-Encoding", "chunked"), ("lang_version", "20.20.2"),
                     ("sdk_runtime", "node")):
            c.putheader(k, v)
        c.endheaders()
        c.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        r = c.getresponse()
        data = json.loads(r.read())
        c.close()
        self.assertEqual((r.status, data["code"]), (400, 400))
        self.assertIn("autoPause", data["message"])

    def test_unmapped_routes_are_refused_in_e2b_shape(self):
        self.assertE2bError(self.e2b("POST", "/sandboxes/sb_e2btest0/fork", {}), 501)
        # The engine's own refusals too: no route, a body over http_body_max.
        self.assertE2bError(self.e2b("GET", "/v3/templates"), 404)
        self.assertE2bError(self.e2b("POST", "/v2/sandboxes", b"{" + b" " * (2 << 20) + b"}",
                                     headers={"Content-Type": "application/json"}), 413)

    def test_data_plane_refuses_without_the_sandbox_token(self):
        def dp(method, path, headers, body=None):
            return kiln.http(method, self.gw.e2b_sandbox_url + path, body, headers)
        target = {"E2b-Sandbox-Id": "sb_e2btest0", "E2b-Sandbox-Port": "49983"}
        for method, path, body in (("GET", "/files?path=/etc/passwd", None),
                                   ("POST", "/files?path=/tmp/x", b"x"),
                                   ("GET", "/health", None),
                                   ("POST", "/filesystem.Filesystem/Stat", {"path": "/"}),
                                   ("POST", "/filesystem.Filesystem/Remove", {"path": "/"}),
                                   ("POST", "/process.Process/Start", {})):
            for token in (None, "0" * 32, "x", "0" * 33):
                h = dict(target, **({"X-Access-Token": token} if token else {}))
                msg = self.assertE2bError(dp(method, path, h, body), 401)
                self.assertIn("access token", msg)
            # An API key is no credential here.
            h = dict(target, **{"X-API-Key": self.tenants["acme"][1],
                                "Authorization": "Bearer " + self.tenants["acme"][1]})
            self.assertE2bError(dp(method, path, h, body), 401)
        # No or a malformed sandbox id or port: 400.
        self.assertE2bError(dp("GET", "/health", {"E2b-Sandbox-Port": "49983"}), 400)
        self.assertE2bError(dp("GET", "/health", {"E2b-Sandbox-Id": "../x",
                                                  "E2b-Sandbox-Port": "49983"}), 400)
        for port in ("", "nope", "0"):
            self.assertE2bError(dp("GET", "/health", dict(target, **{"E2b-Sandbox-Port": port})), 400)
        # Another guest port (api/e2b_code.c): code never runs without the token; a port of the
        # user's needs it for anything; the code interpreter's contexts do not.
        for token in (None, "0" * 32):
            h = dict(target, **{"E2b-Sandbox-Port": "49999"}, **({"X-Access-Token": token} if token else {}))
            self.assertIn("access token", self.assertE2bError(dp("POST", "/execute", h, {"code": "1"}), 401))
            h = dict(target, **{"E2b-Sandbox-Port": "8080"}, **({"X-Access-Token": token} if token else {}))
            self.assertE2bError(dp("GET", "/", h), 401)
            self.assertE2bError(kiln.http("GET", self.gw.e2b_sandbox_url + "/", None,
                                          {"Host": "8080-e2btest0.localhost", **({"X-Access-Token": token} if token else {})}), 401)
        # Past the guards, a sandbox with no node to reach: 502, as E2B's proxy answers.
        self.assertE2bError(dp("GET", "/contexts", dict(target, **{"E2b-Sandbox-Port": "49999"})), 502)
        # No audit record, no file: nothing reached the API.
        rows = self.db.sql("SELECT count(*) FROM audit_log WHERE object_id = 'sb_e2btest0' "
                           "AND route LIKE '%files%'")
        self.assertEqual(rows, "0")

    def test_kill(self):
        self.db.sql(f"INSERT INTO sandboxes (id, tenant_id, state, template, vcpu_milli, memory_mib, "
                    f"disk_gib, timeout_s, expires_at) VALUES ('sb_e2bkill', "
                    f"'{self.tenants['acme'][0]}', 'running', 'python', 1000, 512, 10, 300, "
                    f"now() + interval '300 seconds')")
        r = self.e2b("DELETE", "/sandboxes/sb_e2bkill")
        self.assertEqual((r.status, r.data), (204, b""), r)
        self.assertE2bError(self.e2b("DELETE", "/sandboxes/sb_e2bkill"), 404)
        self.assertE2bError(self.e2b("GET", "/sandboxes/sb_e2bkill"), 404)

    def test_an_id_that_is_not_utf8_is_404_with_its_body(self):
        # The id is not echoed into the message (a JSON string must be UTF-8): the error body
        # comes whole, on every route with a sandbox id.
        for method, path in (("GET", "/sandboxes/%FF"), ("DELETE", "/sandboxes/sb_%C3%28x"),
                             ("POST", "/sandboxes/%ED%A0%80/pause"),
                             ("POST", "/sandboxes/%FF/timeout")):
            with self.subTest(method=method, path=path):
                body = {"timeout": 60} if path.endswith("/timeout") else None
                msg = self.assertE2bError(self.e2b(method, path, body), 404)
                self.assertIn("doesn't exist", msg)

    def test_rate_limit_is_the_api_s(self):
        # The API's own limits apply: a tenant with a tiny rate gets 429 in E2B's shape.
        gw = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"],
                          {"KILN_RATE_LIMIT_RPS": "1", "KILN_RATE_LIMIT_BURST": "2"},
                          master_key=self.gw.master_key, e2b=True)
        try:
            statuses = []
            for _ in range(6):
                r = kiln.http("GET", gw.e2b_url + "/v2/sandboxes",
                              headers={"X-API-Key": self.tenants["other"][1]})
                statuses.append(r.status)
                if r.status == 429:
                    self.assertEqual(r.json()["code"], 429)
                    self.assertIn("rate_limit_rps", r.json()["message"])
                    self.assertTrue(r.headers.get("Retry-After"))
            self.assertIn(429, statuses)
        finally:
            gw.cleanup()


class E2bAddressLimits(unittest.TestCase):
    """The API's per-address connection cap counts E2B clients by their own address: the E2B
    listener's calls of the API do not share one (the gateway's) address among all clients."""

    def test_api_connections_of_one_address_do_not_block_e2b_clients(self):
        services = kiln.services_env()
        db = kiln.fresh_database()
        self.addCleanup(db.drop)
        gw = kiln.Gateway(db.url, services["KILN_REDIS_URL"],
                          dict(GENEROUS, KILN_HTTP_MAX_CONNECTIONS_PER_ADDR="2",
                               # the held idle connections stay for the idle timeout (60 s),
                               # not the header timeout's 10 s, however loaded the machine is
                               KILN_HTTP_HEADER_TIMEOUT_S="0"), e2b=True)
        self.addCleanup(gw.cleanup)
        r = gw.request("POST", "/v1/tenants", {"name": "acme"},
                       {"Authorization": "Bearer " + gw.admin_key})
        self.assertEqual(r.status, 201, r)
        key = r.json()["api_key"]["key"]
        # Two idle connections use up their address's cap on the API listener. The address is one
        # no other connection of this test used: the gateway counts a connection until it has
        # closed its end, a little after its client read the reply (the POST above, from
        # 127.0.0.1, can still count when a loaded host makes the next connections). With one
        # still counted the second held connection is refused, and every GET then admitted.
        client = "127.0.0.9"
        held = []
        self.addCleanup(lambda: [s.close() for s in held])
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((client, 0))
            s.connect(("127.0.0.1", gw.port))
        # Waits until the gateway has accepted both (the kernel's view, not a time): its one
        # accept thread counts a connection before it takes the next, so the GET comes after both.
        deadline = time.monotonic() + 60
        while not accepted(gw.port, [s.getsockname() for s in held]):
            self.assertLess(time.monotonic(), deadline, "the gateway did not accept them")
            time.sleep(0.05)
        r = http_from(client, gw.url + "/v1/sandboxes", {"Authorization": "Bearer " + key})
        self.assertEqual(r.status, 429, r)
        self.assertIn("http_max_connections_per_addr", r.json()["error"]["message"])
        # Both held connections are still open: the cap held them, it did not refuse them.
        self.assertEqual(select.select(held, [], [], 0)[0], [], "a held connection was closed")
        r = http_from(client, gw.e2b_url + "/v2/sandboxes", {"X-API-Key": key})
        self.assertEqual((r.status, r.json()), (200, []), r)


if __name__ == "__main__":
    unittest.main()
