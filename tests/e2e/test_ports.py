"""Port streams: kiln-node carries a byte stream to 127.0.0.1:PORT inside a sandbox over its
agent's channel (GET /v1/sandboxes/{id}/ports/{port}/stream, Upgrade: kiln-port; docs/ports.md),
and kiln-gateway passes it on to the sandbox's owner (GET /v1/sandboxes/{id}/connect?port=N).

One sandbox (a real microVM) serves the cases: a Python HTTP server answers through the stream, a
chunked response arrives piece by piece as the guest writes it, an echo server returns 1 MiB both
ways at once (the windows of docs/agent-protocol.md end to end), and the errors: 502 port_closed
for a port nobody listens on, 401 without a node token, 404 with another tenant's.

The same sandbox serves the port URLs of the gateway's own listener (ports_listen; requests
carry Host {port}-{id}.localhost and go to 127.0.0.1 as `curl --resolve` would): its HTTP
server, a streamed reply, a chunked request body that reaches the guest without Kiln's
credentials or cookies, a WebSocket echo both ways, 401 without a credential, 404 with another
tenant's, the signed URL's redirect and cookie (403 expired or forged, or on another origin),
public ports answering without a credential until made private, neither origin serving the
other's routes, and no direct connection to the guest's address.
"""
import base64
import json
import os
import re
import sys
import urllib.parse
import socket
import subprocess
import threading
import time
import unittest

import kiln
import metertest as mt
from portserver import WsReader, read_head, recv_all, ws_accept, ws_frame
from portserver import arrivals as arrivals_of

SERVER = r'''
import http.server, socket, threading, time

def listener(port):
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port))
    l.listen(16)
    return l

def echo(c):
    while True:
        d = c.recv(65536)
        if not d:
            break
        c.sendall(d)
    c.close()

def echo_server():
    l = listener(8002)
    while True:
        c, _ = l.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()

def drip(c):
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(3):
        c.sendall(b"2\r\n%d\n\r\n" % i)
        time.sleep(1)
    c.sendall(b"0\r\n\r\n")
    c.close()

def drip_server():
    l = listener(8001)
    while True:
        c, _ = l.accept()
        threading.Thread(target=drip, args=(c,), daemon=True).start()


def ws_server():
    # a WebSocket echo with the handshake by hand: says "hello" first, then echoes each text frame
    import base64, hashlib, struct
    l = listener(8003)
    def serve(c):
        head = b""
        while b"\r\n\r\n" not in head:
            d = c.recv(4096)
            if not d:
                return c.close()
            head += d
        key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
               if l.lower().startswith(b"sec-websocket-key:")][0]
        acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                  b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
        c.sendall(b"\x81\x05hello")
        f = c.makefile("rb")
        while True:
            h = f.read(2)
            if len(h) < 2 or h[0] & 0x0f == 8:
                break
            n = h[1] & 0x7f
            if n == 126:
                n = struct.unpack(">H", f.read(2))[0]
            mask = f.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
            c.sendall(bytes([0x81, 126]) + struct.pack(">H", len(data)) + data if len(data) > 125
                      else bytes([0x81, len(data)]) + data)
        c.close()
    while True:
        c, _ = l.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()

def mirror_server(port, host="127.0.0.1"):
    # answers each request with what reached it: its head, and its body (chunked decoded)
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((host, port))
    l.listen(16)
    def serve(c):
        f = c.makefile("rb")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = f.readline()
            if not line:
                return c.close()
            head += line
        body = b""
        lines = head.lower().split(b"\r\n")
        if b"transfer-encoding: chunked" in lines:
            while True:
                n = int(f.readline().split(b";")[0], 16)
                if n == 0:
                    while f.readline() not in (b"\r\n", b""):
                        pass
                    break
                body += f.read(n)
                f.readline()
        for x in lines:
            if x.startswith(b"content-length:"):
                body = f.read(int(x.split(b":")[1]))
        out = json.dumps({"head": head.decode("latin-1"), "body": body.decode("latin-1")}).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n" % len(out) + out)
        c.close()
    while True:
        c, _ = l.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()

import json
threading.Thread(target=ws_server, daemon=True).start()
threading.Thread(target=mirror_server, args=(8004,), daemon=True).start()
threading.Thread(target=mirror_server, args=(8005, "0.0.0.0"), daemon=True).start()
threading.Thread(target=echo_server, daemon=True).start()
threading.Thread(target=drip_server, daemon=True).start()
open("/root/index.html", "w").write("hello from the sandbox\n")
http.server.ThreadingHTTPServer(("127.0.0.1", 8000),
    lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory="/root")).serve_forever()
'''


def node_token(stack, tenant_id, sandbox_id):
    env = dict(os.environ, KILN_DATABASE_URL=stack.db.url, KILN_MASTER_KEY=stack.gw.master_key)
    out = subprocess.run([os.path.join(kiln.BUILD, "tests", "e2e", "kiln-test-nodetoken"),
                          tenant_id, sandbox_id], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


class PortStreamTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # A short header timeout: an upgraded connection must not be held to it (see below).
        cls.stack = kiln.Stack(gateway_env={"KILN_HTTP_HEADER_TIMEOUT_S": "2",
                                            "KILN_PORT_STREAMS_MAX_PER_TENANT": "4",
                                            "KILN_PORT_PUBLIC_MAX_PER_SANDBOX": "2",
                                            "KILN_PORT_PUBLIC_WAKES_PER_HOUR": "1"},
                               node_env={"KILN_PORT_STREAMS_MAX_PER_SANDBOX": "5"})
        cls.addClassCleanup(cls.stack.cleanup)
        gw = cls.stack.gw
        r = gw.request("POST", "/v1/tenants", {"name": "ports"}, cls.stack.admin)
        assert r.status == 201, r
        cls.tenant_id = r.json()["tenant"]["id"]
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 512, "auto_resume": True}, cls.key,
                       timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()["id"]
        # the create's own answer shows auto_resume, as GET does (the last case sets it again)
        assert r.json().get("auto_resume") is True, r.json()
        r = gw.request("PATCH", f"/v1/sandboxes/{cls.sb}", {"auto_resume": False}, cls.key)
        assert (r.status, r.json()) == (200, {"id": cls.sb, "auto_resume": False}), r
        cls.exec(["python3", "-c", f"open('/root/srv.py', 'w').write({SERVER!r})"])
        cls.exec(["sh", "-c", "nohup python3 /root/srv.py >/root/srv.log 2>&1 &"])
        wait = ("import socket, time\n"
                "for i in range(3000):\n"
                "    try:\n"
                "        [socket.create_connection(('127.0.0.1', p)).close() for p in (8000, 8001, 8002, 8003, 8004, 8005)]\n"
                "        break\n"
                "    except OSError:\n"
                "        time.sleep(0.1)\n"
                "else:\n"
                "    raise SystemExit('the servers did not start')\n")
        cls.exec(["python3", "-c", wait], timeout_s=330)  # a loaded host's TCG guest is slow
        cls.token = node_token(cls.stack, cls.tenant_id, cls.sb)
        r = gw.request("GET", f"/v1/sandboxes/{cls.sb}/ports/8000", headers=cls.key)
        assert r.status == 200, r
        cls.url8000 = r.json()["url"]
        cls.ports_port = urllib.parse.urlparse(cls.url8000).port
        r = gw.request("POST", "/v1/tenants", {"name": "stranger"}, cls.stack.admin)
        cls.other = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    @classmethod
    def exec(cls, cmd, timeout_s=60):
        r = cls.stack.gw.request("POST", f"/v1/sandboxes/{cls.sb}/exec",
                                 {"cmd": cmd, "timeout_s": timeout_s}, cls.key,
                                 timeout=timeout_s + 60)
        assert r.status == 200 and r.json()["exit_code"] == 0, r

    def stream(self, port, token=None, sandbox=None, upgrade="kiln-port"):
        """Opens a port stream on the node's socket; returns (status, socket, head, rest)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(self.stack.node.sock)
        self.addCleanup(s.close)
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        s.sendall((f"GET /v1/sandboxes/{sandbox or self.sb}/ports/{port}/stream HTTP/1.1\r\n"
                   f"Host: node\r\nConnection: Upgrade\r\nUpgrade: {upgrade}\r\n{auth}\r\n").encode())
        status, head, rest = read_head(s)
        return status, s, head, rest

    def gw_stream(self, port, key=None, upgrade="kiln-port"):
        """Opens a port stream through the gateway's API; returns (status, socket, head, rest)."""
        u = urllib.parse.urlparse(self.stack.gw.url)
        s = socket.create_connection((u.hostname, u.port), timeout=60)
        self.addCleanup(s.close)
        auth = f"Authorization: {key['Authorization']}\r\n" if key else ""
        s.sendall((f"GET /v1/sandboxes/{self.sb}/connect?port={port} HTTP/1.1\r\n"
                   f"Host: x\r\nConnection: Upgrade\r\nUpgrade: {upgrade}\r\n{auth}\r\n").encode())
        status, head, rest = read_head(s)
        return status, s, head, rest

    def test_gateway_carries_the_stream_to_its_owner_only(self):
        status, s, head, rest = self.gw_stream(8000, self.key)
        self.assertEqual(status, 101, head)
        s.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = recv_all(s, rest)
        self.assertIn(b" 200 ", reply.split(b"\r\n", 1)[0])
        self.assertIn(b"hello from the sandbox", reply)
        # a mebibyte both ways at once through gateway, node and agent
        status, s, head, rest = self.gw_stream(8002, self.key)
        self.assertEqual(status, 101, head)
        payload = os.urandom(1 << 20)
        got = [rest]
        t = threading.Thread(target=lambda: got.append(recv_all(s)))
        t.start()
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        t.join(120)
        self.assertEqual(b"".join(got), payload)
        # the errors, as the node gave them or the gateway's own
        status, s, head, rest = self.gw_stream(8999, self.key)
        self.assertEqual(status, 502, head)
        self.assertIn(b"port_closed", rest)
        self.assertEqual(self.gw_stream(8000)[0], 401)
        r = self.stack.gw.request("POST", "/v1/tenants", {"name": "stranger"}, self.stack.admin)
        other = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        self.assertEqual(self.gw_stream(8000, other)[0], 404)
        self.assertEqual(self.gw_stream(0, self.key)[0], 422)
        self.assertEqual(self.gw_stream(8000, self.key, upgrade="websocket")[0], 400)
        # without the upgrade, a probe: does anything listen?
        sbp = f"/v1/sandboxes/{self.sb}/connect?port="
        r = self.stack.gw.request("GET", sbp + "8000", headers=self.key)
        self.assertEqual((r.status, r.json()), (200, {"port": 8000, "listening": True}), r)
        r = self.stack.gw.request("GET", sbp + "8999", headers=self.key)
        self.assertEqual((r.status, r.json()), (200, {"port": 8999, "listening": False}), r)
        r = self.stack.gw.request("GET", sbp + "8000", headers=other)
        self.assertEqual(r.status, 404, r)

    def test_an_idle_stream_outlives_the_header_timeout(self):
        # the gateway closes connections that send no request within http_header_timeout_s (2 s
        # here); an upgraded one carries no more requests and is not subject to it
        status, s, head, rest = self.gw_stream(8002, self.key)
        self.assertEqual(status, 101, head)
        time.sleep(5)
        s.sendall(b"still there")
        s.shutdown(socket.SHUT_WR)
        self.assertEqual(recv_all(s, rest), b"still there")

    def test_streams_at_once_are_capped_per_sandbox(self):
        # port_streams_max_per_sandbox is 5 on this node: the sixth at the latest is 429 naming it
        self.assert_streams_capped(lambda: self.stream(8002, self.token), 5,
                                   b"port_streams_max_per_sandbox")

    def test_streams_at_once_are_capped_at_the_gateway_per_tenant(self):
        # runs before the per-sandbox case: streams that case closes may still be ending on the
        # node (the guest sees each end over the agent), which would meet the node's cap first
        # port_streams_max_per_tenant is 4 on this gateway: the fifth at the latest is 429
        self.assert_streams_capped(lambda: self.gw_stream(8002, self.key), 4,
                                   b"port_streams_max_per_tenant")

    def assert_streams_capped(self, open_stream, cap, limit):
        """At most `cap` streams of open_stream() are open at once, the next is 429 naming
        `limit`, and once they end streams open again."""
        opened, refused = [], None
        for _ in range(cap + 2):
            status, s, head, rest = open_stream()
            if status == 101:
                opened.append(s)
                continue
            refused = (status, head, rest)
            break
        self.assertIsNotNone(refused, "%d streams open at once" % (cap + 2))
        self.assertEqual(refused[0], 429, refused)
        self.assertIn(limit, refused[2])
        self.assertLessEqual(len(opened), cap)
        for s in opened:
            s.close()
        for _ in range(100):
            status, s, head, rest = open_stream()
            if status == 101:
                break
            time.sleep(0.1)
        self.assertEqual(status, 101, head)

    def test_http_server_answers_through_the_stream(self):
        status, s, head, rest = self.stream(8000, self.token)
        self.assertEqual(status, 101, head)
        self.assertIn("upgrade: kiln-port", head.lower())
        s.sendall(b"GET /index.html HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = recv_all(s, rest)
        self.assertTrue(reply.startswith(b"HTTP/1.0 200") or reply.startswith(b"HTTP/1.1 200"), reply[:200])
        self.assertIn(b"hello from the sandbox", reply)

    def test_streamed_response_arrives_as_written(self):
        status, s, head, rest = self.stream(8001, self.token)
        self.assertEqual(status, 101, head)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data, arrivals = arrivals_of(s, rest=rest)
        self.assertEqual(len(arrivals), 3, data)
        # the guest sleeps 1 s between chunks: each arrived before the next was written
        self.assertGreater(arrivals[2] - arrivals[0], 1.0, arrivals)
        self.assertTrue(data.endswith(b"0\r\n\r\n"), data[-50:])

    def test_echo_carries_a_mebibyte_both_ways_at_once(self):
        status, s, head, rest = self.stream(8002, self.token)
        self.assertEqual(status, 101, head)
        payload = os.urandom(1 << 20)
        got = [rest]

        def reader():
            got.append(recv_all(s))

        t = threading.Thread(target=reader)
        t.start()
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)  # the server reads EOF, closes, and we read EOF
        t.join(120)
        self.assertFalse(t.is_alive())
        self.assertEqual(b"".join(got), payload)

    def test_nothing_listening_is_502_port_closed(self):
        status, s, head, rest = self.stream(8999, self.token)
        self.assertEqual(status, 502, head)
        self.assertIn(b"port_closed", rest + s.recv(4096) if b"port_closed" not in rest else rest)

    def test_bad_requests_are_refused(self):
        status, *_ = self.stream(8000)
        self.assertEqual(status, 401)
        status, *_ = self.stream(0, self.token)
        self.assertEqual(status, 422)
        status, *_ = self.stream(8000, self.token, upgrade="websocket")
        self.assertEqual(status, 400)
        # another tenant's token for this sandbox: as if it did not exist
        r = self.stack.gw.request("POST", "/v1/tenants", {"name": "other"}, self.stack.admin)
        other = node_token(self.stack, r.json()["tenant"]["id"], self.sb)
        status, *_ = self.stream(8000, other)
        self.assertEqual(status, 404)

    # --- port URLs: the gateway's ports listener ---

    def host(self, port):
        return f"{port}-{self.sb[3:]}.localhost:{self.ports_port}"

    def port_request(self, port, path="/", headers=None, body=None, method="GET", listener=None,
                     host=None, chunks=None):
        """One request to the ports listener (or `listener`, a (host, port)) with Host
        {port}-{id}.localhost; returns (status, head text, body bytes) once the server closed."""
        s = socket.create_connection(listener or ("127.0.0.1", self.ports_port), timeout=60)
        self.addCleanup(s.close)
        h = {"Host": host or self.host(port)}
        h.update(headers or {})
        if body is not None:
            h["Content-Length"] = str(len(body))
        if chunks is not None:
            h["Transfer-Encoding"] = "chunked"
        s.sendall((f"{method} {path} HTTP/1.1\r\n" +
                   "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() +
                  (body or b""))
        for c in chunks or []:
            s.sendall(b"%x\r\n%s\r\n" % (len(c), c) if c else b"0\r\n\r\n")
            time.sleep(0.2)
        data = recv_all(s)
        s.close()
        head, _, rest = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head else 0
        return status, head.decode("latin-1"), rest

    def test_port_url_serves_the_guests_http_server_to_its_owner_only(self):
        self.assertEqual(urllib.parse.urlparse(self.url8000).hostname, f"8000-{self.sb[3:]}.localhost")
        status, head, body = self.port_request(8000, "/index.html", self.key)
        self.assertEqual(status, 200, head)
        self.assertEqual(body, b"hello from the sandbox\n")
        # the key in X-API-Key works the same
        key = self.key["Authorization"].split(" ", 1)[1]
        status, head, body = self.port_request(8000, "/index.html", {"X-API-Key": key})
        self.assertEqual((status, body), (200, b"hello from the sandbox\n"), head)
        # a real client: curl resolving the port URL's name to the listener
        out = subprocess.run(["curl", "-sS", "--resolve",
                              f"8000-{self.sb[3:]}.localhost:{self.ports_port}:127.0.0.1",
                              "-H", "Authorization: " + self.key["Authorization"],
                              self.url8000 + "/index.html"], capture_output=True, timeout=60)
        self.assertEqual(out.stdout, b"hello from the sandbox\n", out.stderr)
        # without a credential 401; a wrong one 401; another tenant's 404; another's sandbox id 404
        status, head, body = self.port_request(8000, "/index.html")
        self.assertEqual(status, 401, head)
        self.assertNotIn(b"hello", body)
        self.assertEqual(self.port_request(8000, "/", {"Authorization": "Bearer kiln_nope"})[0], 401)
        status, head, body = self.port_request(8000, "/index.html", self.other)
        self.assertEqual(status, 404, head)
        self.assertNotIn(b"hello", body)
        status, _, _ = self.port_request(8000, "/", self.key,
                                         host=f"8000-zz{self.sb[5:]}.localhost:{self.ports_port}")
        self.assertEqual(status, 404)
        # nothing listening: the node's 502 port_closed passed on
        status, head, body = self.port_request(8999, "/", self.key)
        self.assertEqual(status, 502, head)
        self.assertIn(b"port_closed", body)

    def test_the_guest_gets_the_request_without_kilns_credentials(self):
        # a chunked body arrives whole; Authorization, X-API-Key and kiln_* cookies never reach it
        key = self.key["Authorization"].split(" ", 1)[1]
        status, head, body = self.port_request(
            8004, "/upload?x=1", dict(self.key, **{"X-API-Key": key,
                                                  "Cookie": "theme=dark; kiln_port=1.abc;a=b;c=d;e=f"}),
            method="POST", chunks=[b"first part,", b"second part", b""])
        self.assertEqual(status, 200, head)
        got = json.loads(body)
        self.assertEqual(got["body"], "first part,second part")
        self.assertTrue(got["head"].startswith("POST /upload?x=1 HTTP/1.1\r\n"), got["head"])
        self.assertNotIn(key, got["head"])
        self.assertNotIn("authorization", got["head"].lower())
        self.assertNotIn("x-api-key", got["head"].lower())
        self.assertNotIn("kiln_port", got["head"])
        self.assertIn("Cookie: theme=dark; a=b; c=d; e=f\r\n", got["head"])
        self.assertIn(f"Host: {self.host(8004)}\r\n", got["head"])
        # a request pipelined after the first one's body is not forwarded: the mirror's answer is
        # the first request's alone, and the connection ends after it
        s = socket.create_connection(("127.0.0.1", self.ports_port), timeout=60)
        self.addCleanup(s.close)
        s.sendall((f"POST /one HTTP/1.1\r\nHost: {self.host(8004)}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\nContent-Length: 3\r\n\r\nabc"
                   f"GET /two HTTP/1.1\r\nHost: {self.host(8004)}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\n\r\n").encode())
        data = recv_all(s)
        self.assertEqual(data.count(b"HTTP/1.1 200"), 1, data)
        got = json.loads(data.partition(b"\r\n\r\n")[2])
        self.assertEqual(got["body"], "abc")
        self.assertNotIn("/two", got["head"])

    def test_port_url_streams_a_reply_as_it_is_written(self):
        s = socket.create_connection(("127.0.0.1", self.ports_port), timeout=60)
        self.addCleanup(s.close)
        s.sendall((f"GET / HTTP/1.1\r\nHost: {self.host(8001)}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\n\r\n").encode())
        data, arrivals = arrivals_of(s)
        self.assertTrue(data.startswith(b"HTTP/1.1 200"), data[:100])
        self.assertIn(b"Transfer-Encoding: chunked", data)
        self.assertEqual(len(arrivals), 3, data)
        self.assertGreater(arrivals[2] - arrivals[0], 1.0, arrivals)
        self.assertTrue(data.endswith(b"0\r\n\r\n"), data[-50:])

    def test_port_url_carries_a_websocket_both_ways(self):
        s = socket.create_connection(("127.0.0.1", self.ports_port), timeout=60)
        self.addCleanup(s.close)
        key = base64.b64encode(os.urandom(16))
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: {self.host(8003)}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                   f"Sec-WebSocket-Key: {key.decode()}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\n\r\n").encode())
        status, head, rest = read_head(s)
        self.assertEqual(status, 101, head)
        self.assertIn("Sec-WebSocket-Accept: " + ws_accept(key).decode(), head)
        ws = WsReader(s, rest)
        self.assertEqual(ws.frame(), b"hello")  # the server spoke first
        for msg in (b"ping 1", b"x" * 1000, b"ping 3"):
            s.sendall(ws_frame(msg, masked=True))
            self.assertEqual(ws.frame(), msg)
        s.sendall(bytes([0x88, 0x80]) + os.urandom(4))  # close
        s.shutdown(socket.SHUT_WR)
        self.assertEqual(recv_all(s), b"")

    def test_signed_url_sets_a_cookie_for_its_origin_and_expires(self):
        sbp = f"/v1/sandboxes/{self.sb}/ports"
        r = self.stack.gw.request("POST", sbp + "/8000/url", {"expires_in_s": 120}, self.key)
        self.assertEqual(r.status, 200, r)
        u = urllib.parse.urlparse(r.json()["url"])
        self.assertEqual((u.hostname, u.port), (f"8000-{self.sb[3:]}.localhost", self.ports_port))
        path = u.path + "?" + u.query
        status, head, _ = self.port_request(8000, path)
        self.assertEqual(status, 302, head)
        self.assertIn("\r\nLocation: /\r\n", head)
        cookie = re.search(r"Set-Cookie: (kiln_port=[^;]+);([^\r]*)", head)
        self.assertIsNotNone(cookie, head)
        attrs = cookie.group(2).lower()
        for a in ("httponly", "samesite=lax", "path=/", "max-age="):
            self.assertIn(a, attrs)
        self.assertNotIn("domain", attrs)  # host-only: this origin and no other
        status, head, body = self.port_request(8000, "/index.html", {"Cookie": cookie.group(1)})
        self.assertEqual((status, body), (200, b"hello from the sandbox\n"), head)
        # the cookie is port 8000's: on port 8004's origin it is worth nothing
        status, head, body = self.port_request(8004, "/", {"Cookie": cookie.group(1)})
        self.assertEqual(status, 403, head)
        # forged: 403
        forged = cookie.group(1)[:-1] + ("0" if cookie.group(1)[-1] != "0" else "1")
        self.assertEqual(self.port_request(8000, "/", {"Cookie": forged})[0], 403)
        self.assertEqual(self.port_request(8000, "/?kiln_sig=" + forged.split("=", 1)[1])[0], 403)
        # bounds of expires_in_s
        r = self.stack.gw.request("POST", sbp + "/8000/url", {"expires_in_s": 10 ** 9}, self.key)
        self.assertEqual(r.status, 422, r)
        self.assertIn("port_url_ttl_max_s", r.data.decode())
        r = self.stack.gw.request("POST", sbp + "/8000/url", {"expires_in_s": 60}, self.other)
        self.assertEqual(r.status, 404, r)
        # expired: the URL and its cookie are 403
        # (3 s: under load a 1 s URL could expire before its first visit)
        r = self.stack.gw.request("POST", sbp + "/8000/url", {"expires_in_s": 3}, self.key)
        u = urllib.parse.urlparse(r.json()["url"])
        status, head, _ = self.port_request(8000, u.path + "?" + u.query)
        self.assertEqual(status, 302, head)
        short = re.search(r"Set-Cookie: (kiln_port=[^;]+);", head).group(1)
        time.sleep(4.5)
        status, head, body = self.port_request(8000, u.path + "?" + u.query)
        self.assertEqual(status, 403, head)
        self.assertIn(b"expired", body)
        status, head, body = self.port_request(8000, "/index.html", {"Cookie": short})
        self.assertEqual(status, 403, head)
        self.assertNotIn(b"hello", body)

    def cli(self, *args):
        """Runs the kiln CLI as the tenant; returns its stdout (it must succeed)."""
        env = dict(os.environ, KILN_URL=self.stack.gw.url,
                   KILN_API_KEY=self.key["Authorization"].split(" ", 1)[1])
        p = subprocess.run([os.path.join(kiln.BUILD, "cli", "kiln"), *args], env=env,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_public_port_answers_without_a_credential_until_made_private(self):
        sbp = f"/v1/sandboxes/{self.sb}/ports"
        self.assertEqual(self.port_request(8000, "/index.html")[0], 401)
        r = self.stack.gw.request("GET", sbp, headers=self.key)
        self.assertEqual((r.status, r.json()), (200, {"ports": [], "auto_resume": False}), r)
        r = self.stack.gw.request("PUT", sbp + "/8000/public", None, self.other)
        self.assertEqual(r.status, 404, r)
        r = self.stack.gw.request("PUT", sbp + "/8000/public", None, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"port": 8000, "public": True, "url": self.url8000})
        r = self.stack.gw.request("GET", sbp, headers=self.key)
        self.assertEqual(r.json()["ports"], [{"port": 8000, "public": True, "url": self.url8000}])
        r = self.stack.gw.request("GET", sbp + "/8000", headers=self.key)
        self.assertTrue(r.json()["public"], r)
        status, head, body = self.port_request(8000, "/index.html")
        self.assertEqual((status, body), (200, b"hello from the sandbox\n"), head)
        # other ports stay private; port_public_max_per_sandbox (2 here) holds
        self.assertEqual(self.port_request(8004, "/")[0], 401)
        self.assertEqual(self.stack.gw.request("PUT", sbp + "/8004/public", None, self.key).status, 200)
        r = self.stack.gw.request("PUT", sbp + "/8005/public", None, self.key)
        self.assertEqual(r.status, 403, r)
        self.assertEqual(r.json()["error"]["code"], "quota_exceeded")
        self.assertIn("port_public_max_per_sandbox", r.json()["error"]["message"])
        self.assertEqual(self.stack.gw.request("PUT", sbp + "/8000/public", None, self.key).status, 200)
        # private again: at once (port 8000 by the CLI)
        r = self.stack.gw.request("DELETE", sbp + "/8004/public", None, self.key)
        self.assertEqual((r.status, r.json()["public"]), (200, False), r)
        self.assertEqual(self.cli("port", self.sb, "8000", "--private"), self.url8000 + "\n")
        self.assertEqual(self.port_request(8000, "/index.html")[0], 401)
        self.assertEqual(self.cli("port", self.sb, "8000"), self.url8000 + "\n")
        self.assertEqual(self.cli("port", self.sb, "8000", "--public"), self.url8000 + "\n")
        self.assertEqual(self.port_request(8000, "/index.html")[0], 200)
        self.assertEqual(self.cli("port", self.sb, "8000", "--private"), self.url8000 + "\n")
        self.assertEqual(self.port_request(8000, "/index.html")[0], 401)
        signed = urllib.parse.urlparse(self.cli("port", self.sb, "8000", "--signed", "60").strip())
        self.assertEqual(self.port_request(8000, signed.path + "?" + signed.query)[0], 302)
        r = self.stack.gw.request("GET", sbp, headers=self.key)
        self.assertEqual(r.json(), {"ports": [], "auto_resume": False})
        self.assertEqual(self.stack.gw.request("GET", sbp + "/0", headers=self.key).status, 422)
        self.assertEqual(self.stack.gw.request("GET", sbp + "/8000", headers=self.other).status, 404)

    def test_origins_stay_apart_and_the_guest_takes_no_direct_connection(self):
        # the ports listener serves no API (nor dashboard), whatever the Host
        for host in (f"127.0.0.1:{self.ports_port}", f"localhost:{self.ports_port}",
                     urllib.parse.urlparse(self.stack.gw.url).netloc):
            status, head, body = self.port_request(0, "/v1/sandboxes", self.key, host=host)
            self.assertEqual(status, 404, head)
            self.assertNotIn(self.sb.encode(), body)
            self.assertEqual(self.port_request(0, "/", host=host)[0], 404)
        # a port URL's Host on the API's listener serves no port
        u = urllib.parse.urlparse(self.stack.gw.url)
        status, head, body = self.port_request(8000, "/index.html", self.key,
                                               listener=(u.hostname, u.port))
        self.assertEqual(status, 404, head)
        self.assertNotIn(b"hello from the sandbox", body)
        # port 8005 listens on the guest's every address: reachable by its port URL, but a direct
        # connection to the guest's address from its own namespace on the host is not taken
        status, head, body = self.port_request(8005, "/", self.key)
        self.assertEqual(status, 200, head)
        ns = [n.split()[0] for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                   text=True).stdout.splitlines()
              if n.startswith("kiln-") and self.sb[3:].startswith(n.split()[0][5:])]
        self.assertEqual(len(ns), 1, ns)
        probe = ("import socket\ns = socket.socket()\ns.settimeout(3)\n"
                 "try:\n  s.connect(('172.16.0.2', 8005)); print('open')\n"
                 "except OSError:\n  print('closed')\n")
        out = subprocess.run(["ip", "netns", "exec", ns[0], "python3", "-c", probe],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.stdout.strip(), "closed", out.stderr)
        # and the eBPF policy recorded no flow to a port the guest serves: every flow in its
        # `flows` map is one the guest opened (key: family, proto, guest port big-endian, ...)
        pin = f"/sys/fs/bpf/kiln/{self.stack.node.node_id}/{self.sb}/flows"
        dump = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", pin],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(dump.returncode, 0, dump.stderr)
        gports = [int(e["key"][2], 16) << 8 | int(e["key"][3], 16) for e in json.loads(dump.stdout)]
        self.assertFalse(set(gports) & set(range(8000, 8006)), gports)

    def test_streams_end_before_a_pause_and_the_sandbox_serves_after(self):
        for _ in range(100):  # the streams of the cases before may still be ending on the node
            status, s, head, rest = self.stream(8002, self.token)
            if status != 429:
                break
            time.sleep(0.1)
        self.assertEqual(status, 101, head)
        s.sendall(b"ping")
        self.assertEqual(rest + s.recv(4) if not rest else rest, b"ping")
        r = self.stack.gw.request("POST", f"/v1/sandboxes/{self.sb}/pause", None, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(recv_all(s), b"")  # the pause ended the stream
        r = self.stack.gw.request("POST", f"/v1/sandboxes/{self.sb}/resume", None, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        # the servers came back with the memory snapshot
        status, s2, head, rest = self.stream(8002, node_token(self.stack, self.tenant_id, self.sb))
        self.assertEqual(status, 101, head)
        s2.sendall(b"pong")
        s2.shutdown(socket.SHUT_WR)
        self.assertEqual(recv_all(s2, rest), b"pong")


    def test_zy_port_bytes_count_in_usage_and_against_the_bandwidth_quota(self):
        # the bytes of a port travel on the agent's channel, not the guest's NIC: kiln-node
        # charges them to the sandbox's eBPF bucket and counters, which the meter reads
        gw, sbp, size = self.stack.gw, f"/v1/sandboxes/{self.sb}", 2 << 20
        self.exec(["sh", "-c", f"head -c {size} /dev/urandom >/root/big.bin"])
        meter = mt.Meter(self.stack.db.url, kiln.services_env()["KILN_REDIS_URL"],
                         self.stack.node.node_id, master_key=gw.master_key,
                         extra_env={"KILN_METER_PIN_ROOT": "/sys/fs/bpf/kiln"})
        self.addCleanup(meter.cleanup)
        status, _, body = self.port_request(8000, "/big.bin", self.key)
        self.assertEqual((status, len(body)), (200, size))
        for _ in range(60):
            points = gw.request("GET", sbp + "/usage", headers=self.key).json()["points"]
            if sum(p["tx_bytes"] for p in points) >= size:
                break
            time.sleep(0.5)
        self.assertGreaterEqual(sum(p["tx_bytes"] for p in points), size, points)
        self.assertGreater(sum(p["rx_bytes"] for p in points), 0, points)

        # a quota of 256 KiB with no refill to speak of: a download stops at it
        quota = 256 << 10
        self.addCleanup(gw.request, "PUT", sbp + "/bandwidth", {"unmetered": True}, self.key)
        r = gw.request("PUT", sbp + "/bandwidth", {"quota_bytes": quota, "refill_bytes": 1,
                                                   "refill_interval_s": 86400}, self.key)
        self.assertEqual((r.status, r.json()["remaining_bytes"]), (200, quota), r)
        s = socket.create_connection(("127.0.0.1", self.ports_port), timeout=60)
        self.addCleanup(s.close)
        s.sendall((f"GET /big.bin HTTP/1.1\r\nHost: {self.host(8000)}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\n\r\n").encode())
        got = b""
        s.settimeout(3)
        try:
            while d := s.recv(65536):
                got += d
        except socket.timeout:
            pass
        self.assertTrue(got.startswith(b"HTTP/1.0 200"), got[:200])
        self.assertGreater(len(got), quota - 4096)
        self.assertLessEqual(len(got), quota)
        r = gw.request("GET", sbp + "/bandwidth", headers=self.key)
        self.assertEqual(r.json()["remaining_bytes"], 0, r)
        # a new stream meets the spent quota; the open one goes on once the bucket has room
        status, head, body = self.port_request(8000, "/index.html", self.key)
        self.assertEqual(status, 429, head)
        self.assertIn(b"bandwidth quota", body)
        r = gw.request("PUT", sbp + "/bandwidth", {"unmetered": True}, self.key)
        self.assertEqual(r.status, 200, r)
        s.settimeout(60)
        got = recv_all(s, got)
        self.assertEqual(len(got.partition(b"\r\n\r\n")[2]), size)

    def state(self):
        return self.stack.gw.request("GET", f"/v1/sandboxes/{self.sb}", headers=self.key).json()["state"]

    def wait_state(self, want, seconds=180):
        for _ in range(seconds * 2):
            if self.state() == want:
                return
            time.sleep(0.5)
        self.fail(f"the sandbox is {self.state()}, not {want}, after {seconds} s")

    def test_zz_a_paused_sandbox_with_auto_resume_answers_and_pauses_again(self):
        # runs last: it leaves the sandbox paused and its tenant without credits
        gw, sbp = self.stack.gw, f"/v1/sandboxes/{self.sb}"
        self.assertEqual(gw.request("PATCH", sbp, {"auto_resume": True}, self.other).status, 404)
        self.assertEqual(gw.request("PATCH", sbp, {"auto_resume": "yes"}, self.key).status, 400)
        self.assertEqual(gw.request("PATCH", sbp, {}, self.key).status, 400)
        r = gw.request("GET", sbp + "/ports", headers=self.key)
        self.assertFalse(r.json()["auto_resume"], r)
        # the sandbox's own JSON shows it, in GET and in the listing
        self.assertIs(gw.request("GET", sbp, headers=self.key).json()["auto_resume"], False)
        # without auto_resume a paused sandbox's port URL is 409, and it stays paused
        r = gw.request("PUT", sbp + "/timeout", {"timeout_s": 10}, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(gw.request("POST", sbp + "/pause", None, self.key, timeout=300).status, 200)
        self.assertEqual(self.port_request(8000, "/index.html", self.key)[0], 409)
        self.assertEqual(self.state(), "paused")
        r = gw.request("PATCH", sbp, {"auto_resume": True}, self.key)
        self.assertEqual((r.status, r.json()), (200, {"id": self.sb, "auto_resume": True}), r)
        self.assertTrue(gw.request("GET", sbp + "/ports", headers=self.key).json()["auto_resume"])
        self.assertIs(gw.request("GET", sbp, headers=self.key).json()["auto_resume"], True)
        r = gw.request("GET", "/v1/sandboxes", headers=self.key)
        self.assertEqual([x["auto_resume"] for x in r.json()["sandboxes"] if x["id"] == self.sb],
                         [True], r)
        # a request resumes it and is held until the guest's server answers
        s = socket.create_connection(("127.0.0.1", self.ports_port), timeout=300)
        self.addCleanup(s.close)
        t0 = time.monotonic()
        s.sendall((f"GET /index.html HTTP/1.1\r\nHost: {self.host(8000)}\r\n"
                   f"Authorization: {self.key['Authorization']}\r\n\r\n").encode())
        first = s.recv(65536)
        ttfb = time.monotonic() - t0
        reply = recv_all(s, first)
        s.close()
        self.assertTrue(reply.startswith(b"HTTP/1.0 200"), reply[:300])
        self.assertIn(b"hello from the sandbox", reply)
        print(f"auto-resume: time to first byte {ttfb:.2f} s", file=sys.stderr)
        self.assertEqual(self.state(), "running")
        # timeout_s started again with the resume: it pauses by itself as usual
        self.wait_state("paused", 120)
        # a public port wakes it too, port_public_wakes_per_hour (1 here) times an hour
        self.assertEqual(gw.request("PUT", sbp + "/ports/8000/public", None, self.key).status, 200)
        status, head, body = self.port_request(8000, "/index.html")
        self.assertEqual((status, body), (200, b"hello from the sandbox\n"), head)
        self.assertIn(gw.request("POST", sbp + "/pause", None, self.key, timeout=300).status, (200, 409))
        self.wait_state("paused", 120)
        status, head, body = self.port_request(8000, "/index.html")
        self.assertEqual(status, 429, head)
        self.assertIn(b"port_public_wakes_per_hour", body)
        self.assertEqual(self.state(), "paused")
        # a tenant at zero credits gets 402 and the sandbox stays paused
        self.stack.db.sql(
            "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
            "amount_ucr, tenant_id) SELECT 'tx_ports_spent', 'test:ports-spent', 'usage', a.id, "
            f"'system:revenue', 500000000, '{self.tenant_id}' FROM ledger_accounts a "
            f"WHERE a.tenant_id = '{self.tenant_id}' AND a.kind = 'grant'")
        # the gateways' cached balance (metering/billing.c) is read again
        sock = kiln.services_env()["KILN_REDIS_URL"][len("unix:"):]
        subprocess.run(["redis-cli", "-s", sock, "DEL", "kiln:bal:" + self.tenant_id], check=True,
                       capture_output=True)
        status, head, body = self.port_request(8000, "/index.html", self.key)
        self.assertEqual(status, 402, head)
        self.assertIn(b"insufficient_credits", body)
        self.assertEqual(self.state(), "paused")


if __name__ == "__main__":
    unittest.main()
