"""The tenant matrix: every operation of docs/openapi.yaml, on every listener Kiln serves, called
across tenants.

Two tenants, A and B, each with a sandbox booted in QEMU, a named snapshot and a second API key
(A also has a file, egress rules and a bandwidth quota), on one stack: kiln-gateway, kiln-node
and a kiln-meter billing that node. The operations come from docs/openapi.yaml by its markers
(`x-kiln-access` on every operation, `x-kiln-object` on every id schema; unit_openapi requires
both), so a new route is in the matrix the day it is documented:

- tenant routes naming an object in their path: B's API key and B's token on A's object answer
  404 `not_found`; the same call by B on B's own object does not (so the 404 is about whose it
  is, not a bad path or body);
- tenant routes naming an object in a query parameter or the body (a snapshot to start from, a
  sandbox to filter by): B naming A's object gets exactly what B gets naming one that does not
  exist; no answer to B anywhere holds an id of A's;
- admin routes: A's and B's keys and tokens get 403 `forbidden`, no credential 401; the same call
  by the operator on a throwaway tenant succeeds;
- public routes: no id of a tenant's in their answers;
- kiln-node's own listener (its Unix socket): a tenant's API key or token, A's or B's, is 401
  `unauthenticated` on every route of its table (node/routes.c): the node takes only node tokens
  the gateway signs for one sandbox;
- the listeners: the sockets the stack's processes listen on (every network namespace) are
  exactly the kinds this test covers; a new one fails here until it is covered.

After each part A's view is compared with the one taken before: its sandbox, file, egress rules,
bandwidth settings, snapshots, keys, grants and its rows in Postgres. An Idempotency-Key A used
replays nothing of A's to B.
"""
import http.client
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import unittest
from urllib.parse import urlsplit

import kiln
import openapi_ops

sys.path.insert(0, os.path.join(kiln.ROOT, "tests", "integration", "metering"))
import metertest as mt  # noqa: E402  (kiln-meter as the metering tests run it)

GENEROUS = {"KILN_RATE_LIMIT_RPS": "100000", "KILN_RATE_LIMIT_BURST": "100000",
            "KILN_TENANT_RATE_LIMIT_RPS": "100000", "KILN_TENANT_RATE_LIMIT_BURST": "100000",
            "KILN_CREATE_LIMIT_RPM": "1000", "KILN_TENANT_CREATE_LIMIT_RPM": "1000"}
PREFIX = {"tenant": "tn_", "api_key": "key_", "sandbox": "sb_", "snapshot": "snap_",
          "template": "tmpl_"}
# Path parameters that name a part of an object, the same for every tenant: a sandbox's port is
# reached (and refused) through the sandbox that the path names first. A node is the operator's:
# a spare one with no room (setUpClass), so that its drain moves nothing of the tenants'.
PART = {"port": "8000", "node": "matrix-spare", "process": "1", "watch": "1"}  # "process": B's process, started in setUpClass
A_FILE = "/root/data.csv"


def absent_id(kind):
    """An id of `kind` that names nothing."""
    return PREFIX[kind] + "a" * 26


def bearer(credential):
    return {"Authorization": "Bearer " + credential}


class Tenant:
    """A tenant of the stack: its id, API key and token headers, and one object of each kind."""

    def __init__(self, gw, admin, name):
        r = gw.request("POST", "/v1/tenants", {"name": name}, admin)
        assert r.status == 201, r
        self.name = name
        self.tid = r.json()["tenant"]["id"]
        self.key = bearer(r.json()["api_key"]["key"])
        r = gw.request("POST", "/v1/tokens", {}, self.key)
        assert r.status == 201, r
        self.jwt = bearer(r.json()["token"])
        self.ids = {"tenant": self.tid}
        self.sandbox = None

    def creds(self):
        return (("%s's key" % self.name, self.key), ("%s's token" % self.name, self.jwt))


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over a Unix socket (kiln-node's listener)."""

    def __init__(self, path, timeout=60):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def node_request(sock, method, path, body=None, headers=None):
    c = UnixHTTP(sock)
    try:
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        h = dict(headers or {})
        if isinstance(body, (dict, list)):
            h["Content-Type"] = "application/json"
        try:
            c.request(method, path, body=data, headers=h)
        except (BrokenPipeError, ConnectionResetError):
            # A streamed upload's route may answer its headers (a 401) and close before reading
            # the body the client sends after them; the answer is still there to read.
            pass
        r = c.getresponse()
        return kiln.Response(r.status, r.headers, r.read())
    finally:
        c.close()


def node_routes():
    """(METHOD, path, needs a token) of every entry of node/routes.c's node_routes[]."""
    with open(os.path.join(kiln.ROOT, "node", "routes.c")) as f:
        text = f.read()
    m = re.search(r"struct http_route node_routes\[\]\s*=\s*\{(.*?)\n\};", text, re.S)
    assert m, "node/routes.c: node_routes[] not found"
    body = m.group(1)
    entries = re.findall(r'\{\s*"([A-Z]+)",\s*"([^"]+)",\s*\w+,\s*([^,]+),', body)
    assert entries and len(entries) == body.count("{ \""), "node/routes.c: unreadable entries"
    return [(meth, path, flags.strip() != "0") for meth, path, flags in entries]


def error_code(r):
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def control_rank(op):
    """The order of the calls on B's own objects: what B's later calls need goes last."""
    tail = op.path.rsplit("/", 1)[-1]
    if op.method == "DELETE":  # a part of a sandbox (its port's publicity) before the sandbox
        return (9, op.path.startswith("/v1/sandboxes"), -op.path.count("/"))
    return ({"PUT": 1, "GET": 2}.get(op.method, 3 + {"pause": 1, "resume": 2}.get(tail, 0)), False, 0)


class TenantMatrix(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.api = openapi_ops.Api()
        cls.ops = cls.api.operations()
        cls.stack = kiln.Stack(gateway_env=GENEROUS)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw, cls.db, cls.admin = cls.stack.gw, cls.stack.db, cls.stack.admin
        cls.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
                   "accelerator, image_hash) VALUES ('matrix-spare', 'unix:/nonexistent', 0, 0, 0, 'qemu', "
                   "'tcg', '')")
        cls.meter = mt.Meter(cls.db.url, kiln.services_env()["KILN_REDIS_URL"],
                             cls.stack.node.node_id, master_key=cls.gw.master_key)
        cls.addClassCleanup(cls.meter.cleanup)
        cls.A = Tenant(cls.gw, cls.admin, "a")
        cls.B = Tenant(cls.gw, cls.admin, "b")

        # One sandbox each, booted side by side.
        def boot(t):
            t.sandbox = cls.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600},
                                       t.key, timeout=300)
        threads = [threading.Thread(target=boot, args=(t,)) for t in (cls.A, cls.B)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for t in (cls.A, cls.B):
            assert t.sandbox.status == 201, t.sandbox
            t.ids["sandbox"] = t.sandbox.json()["id"]
        a = cls.A.ids["sandbox"]
        for method, path, body, want in (
                ("PUT", f"/v1/sandboxes/{a}/files?path={A_FILE}", b"a,1\nb,2\n", 204),
                ("PUT", f"/v1/sandboxes/{a}/egress", {"rules": ["example.org", "198.51.100.0/24"]}, 200),
                ("PUT", f"/v1/sandboxes/{a}/bandwidth",
                 {"quota_bytes": 1 << 30, "refill_bytes": 1 << 20, "refill_interval_s": 60}, 200)):
            r = cls.gw.request(method, path, body, cls.A.key, timeout=120)
            assert r.status == want, (method, path, r)
        for t in (cls.A, cls.B):
            r = cls.gw.request("POST", f"/v1/sandboxes/{t.ids['sandbox']}/snapshots", {"name": t.name},
                               t.key, timeout=300)
            assert r.status in (200, 201), r
            t.ids["snapshot"] = r.json()["id"]
            r = cls.gw.request("POST", "/v1/api-keys", {"name": "second", "scopes": ["sandbox:read"]}, t.key)
            assert r.status == 201, r
            t.ids["api_key"] = r.json()["id"]
            r = cls.gw.request("POST", "/v1/templates",
                               {"name": "tpl-" + t.name, "vcpus": 1, "memory_mib": 512, "disk_gib": 10},
                               t.key)
            assert r.status == 201, r
            t.ids["template"] = r.json()["id"]
        # A process of B's, ended at once (so its stream ends too): the process routes' {pid}, which
        # B's own calls find (409 for a signal or resize of an ended process, 422 for its stdin).
        r = cls.gw.request("POST", f"/v1/sandboxes/{cls.B.ids['sandbox']}/processes",
                           {"cmd": ["true"]}, cls.B.key, timeout=120)
        assert r.status == 201, r
        PART["process"] = str(r.json()["pid"])
        cls.A_ids = set(cls.A.ids.values())

    # -------------------------------------------------------------------------------- helpers

    def call(self, op, ids, headers, refs=None):
        """`op` with its path parameters from `ids` (by kind) and its references from `refs`."""
        params = {p: PART[kind] if kind in PART else ids[kind] for p, kind in op.path_objects.items()}
        query, body = {}, op.body
        if isinstance(body, dict):
            body = dict(body)
        for where, name, kind in op.refs:
            if refs and kind in refs:
                if where == "query":
                    query[name] = refs[kind]
                else:
                    body[name] = refs[kind]
        h = dict(headers or {})
        if op.content_type and op.content_type != openapi_ops.JSON:
            h["Content-Type"] = op.content_type
        for p in op.op.get("parameters", []):
            p = self.api.resolve(p)
            if p.get("in") == "header" and p.get("required"):
                h[p["name"]] = "matrix-" + secrets.token_hex(8)
        return self.gw.request(op.method, op.url(params, query), body, h, timeout=300)

    def a_view(self, lifecycle=True):
        """What tenant A has, through the API and in Postgres; without what a pause and resume of
        A's sandbox change (its expiry and generation) when not `lifecycle`."""
        A, a = self.A, self.A.ids["sandbox"]

        def get(path):
            r = self.gw.request("GET", path, headers=A.key, timeout=120)
            self.assertEqual(r.status, 200, (path, r))
            return r

        sb = get(f"/v1/sandboxes/{a}").json()
        bw = get(f"/v1/sandboxes/{a}/bandwidth").json()
        bw.pop("remaining_bytes", None)
        ls = self.gw.request("POST", f"/v1/sandboxes/{a}/exec",
                             {"cmd": ["sh", "-c", "ls -A /root /tmp"]}, A.key, timeout=120)
        self.assertEqual(ls.status, 200, ls)
        return {
            "sandbox": {k: sb.get(k) for k in ("state", "node", "expires_at", "metadata", "vcpus",
                                                "memory_mib", "disk_gib", "parent_id")
                        if lifecycle or k != "expires_at"},
            "sandboxes": sorted(s["id"] for s in get("/v1/sandboxes").json()["sandboxes"]),
            "file": get(f"/v1/sandboxes/{a}/files?path={A_FILE}").data,
            "ls": ls.json()["stdout"],
            "egress": get(f"/v1/sandboxes/{a}/egress").json(),
            "bandwidth": bw,
            "snapshots": sorted((s["id"], s["sandbox_id"], s.get("name"))
                                for s in get("/v1/snapshots").json()["snapshots"]),
            "templates": sorted(json.dumps(x, sort_keys=True)
                                for x in get("/v1/templates").json()["templates"]),
            "keys": sorted((k["id"], k["revoked_at"], k.get("expires_at"), tuple(k["scopes"]))
                           for k in get("/v1/api-keys").json()["api_keys"]),
            "granted": get("/v1/billing/balance").json()["granted_ucr"],
            "db": self.db.sql(
                f"SELECT (SELECT row_to_json(t)::text FROM tenants t WHERE id = '{A.tid}'), "
                f"(SELECT string_agg(id || state || coalesce(node_id, '') || "
                f"{'generation::text' if lifecycle else chr(39) * 2}, ',' "
                f"ORDER BY id) FROM sandboxes WHERE tenant_id = '{A.tid}'), "
                f"(SELECT string_agg(id || coalesce(revoked_at::text, ''), ',' ORDER BY id) "
                f"FROM api_keys WHERE tenant_id = '{A.tid}'), "
                f"(SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{A.tid}' AND kind = 'grant')"),
        }

    def assert_no_a_ids(self, r, what, sent=()):
        """No id of A's in the answer `r`, but for the ids the caller itself sent (`sent`)."""
        text = r.data.decode(errors="replace")
        leaked = sorted(i for i in self.A_ids - set(sent) if i in text)
        self.assertEqual(leaked, [], "%s shows B ids of A's: %r" % (what, text[:500]))

    @staticmethod
    def anonymous(r, ids):
        """The answer's error code and message with the ids of `ids` made one placeholder (the
        same for every tenant), or its body when it is no error."""
        try:
            e = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return r.data
        msg = e.get("message", "")
        for kind, i in ids.items():
            msg = msg.replace(i, "<%s>" % kind)
        return (e.get("code"), msg)

    def classify(self, op):
        """'admin', 'public', 'object' (a tenant route naming an object in its path) or
        'collection' (the other tenant routes); fails on what the document does not say."""
        self.assertIn(op.access, ("admin", "tenant", "public"),
                      "%r: no x-kiln-access in docs/openapi.yaml" % op)
        for p, kind in op.path_objects.items():
            self.assertIn(kind, set(PREFIX) | set(PART), "%r: path parameter {%s} names no object this test "
                          "makes (x-kiln-object %r)" % (op, p, kind))
        for where, name, kind in op.refs:
            self.assertIn(kind, PREFIX, "%r: %s %s names no object this test makes" % (op, where, name))
        if op.access != "tenant":
            return op.access
        return "object" if op.path_objects else "collection"

    # -------------------------------------------------------------------------------- tests

    def test_0_every_operation_is_classified_and_has_objects(self):
        kinds = {}
        for op in self.ops:
            kinds.setdefault(self.classify(op), []).append(op)
        self.assertEqual(len(self.ops), sum(len(v) for v in kinds.values()))
        self.assertGreaterEqual(len(kinds.get("object", [])), 15, kinds)
        self.assertGreaterEqual(len(kinds.get("admin", [])), 4, kinds)
        for kind in PREFIX:
            self.assertTrue(self.A.ids.get(kind, "").startswith(PREFIX[kind]), (kind, self.A.ids))
            self.assertTrue(self.B.ids.get(kind, "").startswith(PREFIX[kind]), (kind, self.B.ids))

    def test_1_admin_routes_refuse_tenants_with_403_and_strangers_with_401(self):
        before = self.a_view()
        C = Tenant(self.gw, self.admin, "c")
        admin_ops = [op for op in self.ops if self.classify(op) == "admin"]
        self.assertTrue(admin_ops)
        for op in admin_ops:
            for who, h in self.A.creds() + self.B.creds():
                for target in (self.A, self.B):
                    r = self.call(op, target.ids, h, refs=target.ids)
                    with self.subTest(op=repr(op), credential=who, on=target.name):
                        self.assertEqual((r.status, error_code(r)), (403, "forbidden"), r)
            r = self.call(op, self.A.ids, None, refs=self.A.ids)
            with self.subTest(op=repr(op), credential="none"):
                self.assertEqual((r.status, error_code(r)), (401, "unauthenticated"), r)
            # The operator's same call passes: the 403s were about who. A read runs on A's
            # objects (a throwaway tenant has no sandbox), a write on a throwaway tenant's.
            ids = self.A.ids if op.method == "GET" else C.ids
            r = self.call(op, ids, self.admin, refs=ids)
            with self.subTest(op=repr(op), credential="operator"):
                self.assertLess(r.status, 300, r)
        self.assertEqual(self.a_view(), before)

    def test_2_collections_show_b_nothing_of_a(self):
        before = self.a_view()
        absent = {k: absent_id(k) for k in PREFIX}
        for op in self.ops:
            kind = self.classify(op)
            if kind == "public":
                r = self.call(op, {}, None)
                with self.subTest(op=repr(op)):
                    self.assertEqual(r.status, 200, r)
                    self.assert_no_a_ids(r, repr(op))
                continue
            if kind != "collection":
                continue
            for who, h in self.B.creds():
                with self.subTest(op=repr(op), credential=who):
                    if op.refs:
                        # Naming A's object is the same as naming none (and creates nothing).
                        sent = [self.A.ids[k] for _, _, k in op.refs]
                        r = self.call(op, {}, h, refs=self.A.ids)
                        r0 = self.call(op, {}, h, refs=absent)
                        self.assertEqual((r.status, self.anonymous(r, self.A.ids)),
                                         (r0.status, self.anonymous(r0, absent)), (r, r0))
                        self.assertLess(r.status, 500, r)
                        self.assert_no_a_ids(r, repr(op), sent)
                    else:
                        r = self.call(op, {}, h)
                        self.assertNotEqual(r.status, 404, r)
                        self.assert_no_a_ids(r, repr(op))
        self.assertEqual(self.a_view(), before)

    def test_3_listeners_are_the_ones_covered(self):
        """Every listening socket of the stack's processes (and their children, in every network
        namespace) is one of the kinds this test covers, and each kind is there."""
        for d in (self.gw, self.stack.node, self.meter):
            self.assertTrue(d.alive(), d.output()[-2000:])
        pids = {self.gw.proc.pid: "gateway", self.stack.node.proc.pid: "node",
                self.meter.proc.pid: "meter"}
        children = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        owner = dict(pids)
        todo = list(pids)
        while todo:
            p = todo.pop()
            for c in children.get(p, []):
                if c not in owner:
                    owner[c] = owner[p] + "-child"
                    todo.append(c)

        def listening(ns):
            cmd = ["ss", "-H", "-l", "-n", "-p", "-t", "-u", "-x", "-w"]
            if ns:
                cmd = ["ip", "netns", "exec", ns] + cmd
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                return []   # a namespace that went away meanwhile
            found = []
            for line in out.stdout.splitlines():
                for pid in map(int, re.findall(r"pid=(\d+)", line)):
                    if pid in owner:
                        f = line.split()
                        found.append((owner[pid], f[0], f[4], ns))
            return found

        netns = [l.split()[0] for l in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True, check=True).stdout.splitlines()]
        seen = set(listening(None))
        for ns in netns:
            if ns.startswith("kiln-"):
                seen |= set(listening(ns))

        gw_addr = "127.0.0.1:%d" % self.gw.port
        # The port URL listener (docs/ports.md), bound where the API's port URLs say.
        r = self.gw.request("GET", f"/v1/sandboxes/{self.A.ids['sandbox']}/ports/{PART['port']}",
                            headers=self.A.key)
        self.assertEqual(r.status, 200, r)
        ports_addr = "127.0.0.1:%s" % urlsplit(r.json()["url"]).port
        kinds, unknown, dns_ns, proxy_ns, vm_sockets = set(), [], set(), set(), []
        for who, netid, local, ns in sorted(seen, key=str):
            if who == "gateway" and netid == "tcp" and local == gw_addr and ns is None:
                kinds.add("gateway-api")
            elif who == "gateway" and netid == "tcp" and local == ports_addr and ns is None:
                kinds.add("gateway-ports")
            elif who == "node" and netid == "u_str" and local == self.stack.node.sock and ns is None:
                kinds.add("node-api")
            elif who == "node" and netid in ("tcp", "udp") and local == "172.16.0.1:53" and ns:
                kinds.add("dns-proxy")
                dns_ns.add(ns)
            elif (who == "node" and netid == "tcp" and ns
                  and local in ("172.16.0.1:15001", "[fdff:6b69:6c6e::1]:15001")):
                # The name-checking proxy's transparent listener (bpf/policy.h NP_PROXY_PORT):
                # reached only through np_from_guest's hand-over of TCP 80/443, never dialled.
                kinds.add("name-proxy")
                proxy_ns.add(ns)
            elif (who == "node-child" and netid == "u_str" and ns
                  and re.fullmatch(r"/run/kiln/%s/sb_[a-z2-7]+/[a-z]+\.sock" % self.stack.node.node_id,
                                   local)):
                # A VM's own QEMU (its QMP and agent channels), in its sandbox's namespace.
                kinds.add("vm-control")
                vm_sockets.append((local, ns))
            else:
                unknown.append((who, netid, local, ns))
        self.assertEqual(unknown, [], "listeners this test does not cover")
        self.assertEqual(kinds, {"gateway-api", "gateway-ports", "node-api", "dns-proxy", "name-proxy",
                                 "vm-control"}, seen)
        # A VM's sockets: in its own sandbox's namespace, and only their owner may connect (each
        # VM's QEMU runs as a uid of its own; kiln-node is root): no other VM's QEMU can.
        owners = {}
        for path, ns in vm_sockets:
            sandbox = path.split("/")[-2]
            self.assertTrue(ns.startswith("kiln-") and len(ns) > 10 and sandbox[3:].startswith(ns[5:]),
                            (path, ns))
            st = os.stat(path)
            # connect() needs write permission on the socket file
            self.assertEqual(st.st_mode & 0o022, 0, "%s is mode %o" % (path, st.st_mode))
            owners.setdefault(st.st_uid, set()).add(sandbox)
        for uid, sandboxes in owners.items():
            self.assertTrue(uid == 0 or len(sandboxes) == 1, (uid, sandboxes))
        # The DNS proxy listens inside each running sandbox's own namespace only.
        running = self.db.sql(f"SELECT count(*) FROM sandboxes WHERE node_id = "
                              f"'{self.stack.node.node_id}' AND state = 'running'")
        self.assertEqual(len(dns_ns), int(running), dns_ns)
        self.assertEqual(proxy_ns, dns_ns)
        # From B's guest, A's sandbox namespace (its uplink address) takes no connection.
        a_ns = None
        for ns in dns_ns:
            out = subprocess.run(["ip", "netns", "exec", ns, "ip", "-4", "-o", "addr", "show", "kn0"],
                                 capture_output=True, text=True)
            addr = re.search(r"inet (\S+)/", out.stdout)
            probe = ("import socket\ns = socket.socket()\ns.settimeout(3)\n"
                     "try:\n  s.connect((%r, 53)); print('open')\nexcept OSError as e:\n  print('closed')\n")
            if addr:
                r = self.gw.request("POST", f"/v1/sandboxes/{self.B.ids['sandbox']}/exec",
                                    {"code": probe % addr.group(1)}, self.B.key, timeout=120)
                self.assertEqual(r.status, 200, r)
                self.assertEqual(r.json()["stdout"].strip(), "closed", (ns, addr.group(1)))
                a_ns = a_ns or ns
        self.assertIsNotNone(a_ns, "no sandbox namespace with an uplink address")
        # The same probe reaches B's own DNS proxy: "closed" above was the namespace, not the probe.
        r = self.gw.request("POST", f"/v1/sandboxes/{self.B.ids['sandbox']}/exec",
                            {"code": probe % "172.16.0.1"}, self.B.key, timeout=120)
        self.assertEqual((r.status, r.json().get("stdout", "").strip()), (200, "open"), r)
        # B's guest cannot dial its own namespace's name-checking proxy: only np_from_guest's
        # hand-over of a checked flow reaches that listener.
        r = self.gw.request("POST", f"/v1/sandboxes/{self.B.ids['sandbox']}/exec",
                            {"code": probe.replace("53))", "15001))") % "172.16.0.1"}, self.B.key,
                            timeout=120)
        self.assertEqual((r.status, r.json().get("stdout", "").strip()), (200, "closed"), r)

    def test_4_node_listener_takes_no_tenant_credential(self):
        before = self.a_view()
        sock = self.stack.node.sock
        a = self.A.ids["sandbox"]
        by_route = {(op.method, op.path): op for op in self.ops}
        routes = node_routes()
        self.assertGreaterEqual(sum(1 for _, _, t in routes if t), 10, routes)
        for method, path, needs_token in routes:
            url = path.replace("{id}", a)
            op = by_route.get((method, path))
            body = op.body if op else {}
            if op and op.query:
                url += "?" + "&".join("%s=%s" % kv for kv in op.query.items())
            if not needs_token:
                r = node_request(sock, method, url)
                with self.subTest(route=f"{method} {path}", credential="none"):
                    self.assertEqual(r.status, 200, r)
                    self.assert_no_a_ids(r, f"node {method} {path}")
                continue
            creds = self.A.creds() + self.B.creds() + (("none", {}),)
            for who, h in creds:
                with self.subTest(route=f"{method} {path}", credential=who):
                    try:
                        r = node_request(sock, method, url, body, h)
                    except OSError as e:
                        self.fail(f"node {method} {url} as {who}: {e!r}")
                    self.assertEqual((r.status, error_code(r)), (401, "unauthenticated"), r)
        self.assertEqual(self.a_view(), before)

    def test_5_tenant_objects_are_404_to_another_tenant(self):
        before = self.a_view()
        object_ops = sorted((op for op in self.ops if self.classify(op) == "object"), key=control_rank)
        self.assertTrue(object_ops)
        for op in object_ops:
            for who, h in self.B.creds():
                r = self.call(op, self.A.ids, h, refs=self.A.ids)
                r0 = self.call(op, {k: absent_id(k) for k in PREFIX}, h)
                with self.subTest(op=repr(op), credential=who):
                    self.assertEqual((r.status, error_code(r)), (404, "not_found"), r)
                    # Word for word what an id that names nothing gets.
                    self.assertEqual(self.anonymous(r, self.A.ids),
                                     self.anonymous(r0, {k: absent_id(k) for k in PREFIX}), (r, r0))
                    self.assert_no_a_ids(r, repr(op), self.A.ids.values())
            # The same call by B on B's own object is not a 404: the path and body are good. A
            # watch nobody reads ends after 60 s: B's is made for the call.
            if "watch" in op.path_objects.values():
                r = self.gw.request("POST", f"/v1/sandboxes/{self.B.ids['sandbox']}/watches",
                                    {"path": "/tmp"}, self.B.key, timeout=120)
                self.assertEqual(r.status, 201, r)
                PART["watch"] = str(r.json()["id"])
            r = self.call(op, self.B.ids, self.B.key, refs=self.B.ids)
            with self.subTest(op=repr(op), credential="B's key on B's own"):
                # 409: the state does not allow it; 429 rate_limited: a port stream of B's whose
                # bandwidth quota an earlier call set to nothing (docs/ports.md, "Metering").
                self.assertTrue(r.status < 300 or r.status == 409 or
                                (r.status == 429 and error_code(r) == "rate_limited"
                                 and "bandwidth quota" in r.json()["error"]["message"]), r)
        self.assertEqual(self.a_view(), before)

    def test_6_a_paused_sandbox_is_404_to_another_tenant(self):
        """The sandbox routes again on A's sandbox paused (its VM gone, its memory on disk)."""
        a = self.A.ids["sandbox"]
        before = self.a_view(lifecycle=False)
        r = self.gw.request("POST", f"/v1/sandboxes/{a}/pause", None, self.A.key, timeout=300)
        self.assertEqual(r.status, 200, r)

        def paused_view():
            r = self.gw.request("GET", f"/v1/sandboxes/{a}", headers=self.A.key)
            self.assertEqual(r.status, 200, r)
            return r.json(), self.db.sql(f"SELECT state || node_id || generation::text FROM "
                                         f"sandboxes WHERE id = '{a}'")

        paused = paused_view()
        self.assertEqual(paused[0]["state"], "paused", paused)
        sandbox_ops = [op for op in self.ops if self.classify(op) == "object"
                       and "sandbox" in op.path_objects.values()]
        self.assertTrue(sandbox_ops)
        for op in sorted(sandbox_ops, key=control_rank):
            for who, h in self.B.creds():
                r = self.call(op, self.A.ids, h, refs=self.A.ids)
                with self.subTest(op=repr(op), credential=who):
                    self.assertEqual((r.status, error_code(r)), (404, "not_found"), r)
        self.assertEqual(paused_view(), paused)
        r = self.gw.request("POST", f"/v1/sandboxes/{a}/resume", None, self.A.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(self.a_view(lifecycle=False), before)

    def test_7_an_idempotency_key_replays_only_to_its_own_tenant(self):
        """B sending the Idempotency-Key A used, with A's request, gets no replay of A's answer."""
        k1, k2 = "matrix-" + secrets.token_hex(8), "matrix-" + secrets.token_hex(8)
        body = {"name": "idem", "scopes": ["sandbox:read"]}
        ra = self.gw.request("POST", "/v1/api-keys", body, dict(self.A.key, **{"Idempotency-Key": k1}))
        self.assertEqual(ra.status, 201, ra)
        a = self.A.ids["sandbox"]
        ex = {"cmd": ["cat", A_FILE]}
        rx = self.gw.request("POST", f"/v1/sandboxes/{a}/exec", ex,
                             dict(self.A.key, **{"Idempotency-Key": k2}), timeout=120)
        self.assertEqual(rx.status, 200, rx)
        before = self.a_view()
        for who, h in self.B.creds():
            with self.subTest(credential=who):
                rb = self.gw.request("POST", "/v1/api-keys", body, dict(h, **{"Idempotency-Key": k1}))
                if who.endswith("key"):
                    self.assertEqual(rb.status, 201, rb)
                    self.assertNotEqual(rb.json()["id"], ra.json()["id"])
                    self.assertIsNone(rb.headers.get("Idempotent-Replayed"), rb.headers)
                self.assertNotIn(ra.json()["key"], rb.data.decode(errors="replace"))
                rb = self.gw.request("POST", f"/v1/sandboxes/{a}/exec", ex,
                                     dict(h, **{"Idempotency-Key": k2}), timeout=120)
                self.assertEqual((rb.status, error_code(rb)), (404, "not_found"), rb)
        self.assertEqual(self.a_view(), before)


if __name__ == "__main__":
    unittest.main()
