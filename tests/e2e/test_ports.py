"""Port streams: kiln-node carries a byte stream to 127.0.0.1:PORT inside a sandbox over its
agent's channel (GET /v1/sandboxes/{id}/ports/{port}/stream, Upgrade: kiln-port; docs/ports.md),
and kiln-gateway passes it on to the sandbox's owner (GET /v1/sandboxes/{id}/connect?port=N).

One sandbox (a real microVM) serves the cases: a Python HTTP server answers through the stream, a
chunked response arrives piece by piece as the guest writes it, an echo server returns 1 MiB both
ways at once (the windows of docs/agent-protocol.md end to end), and the errors: 502 port_closed
for a port nobody listens on, 401 without a node token, 404 with another tenant's.
"""
import json
import os
import urllib.parse
import socket
import subprocess
import threading
import time
import unittest

import kiln

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


def read_head(s):
    """Reads an HTTP head from socket `s`; returns (status, head text, bytes after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        d = s.recv(4096)
        if not d:
            break
        data += d
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    text = head.decode("latin-1")
    if status != 101:  # an error's whole body
        length = [int(l.split(":", 1)[1]) for l in text.split("\r\n")
                  if l.lower().startswith("content-length:")]
        while length and len(rest) < length[0]:
            d = s.recv(4096)
            if not d:
                break
            rest += d
    return status, text, rest


def recv_all(s, rest=b""):
    data = rest
    while True:
        d = s.recv(65536)
        if not d:
            return data
        data += d


class PortStreamTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # A short header timeout: an upgraded connection must not be held to it (see below).
        cls.stack = kiln.Stack(gateway_env={"KILN_HTTP_HEADER_TIMEOUT_S": "2",
                                            "KILN_PORT_STREAMS_MAX_PER_TENANT": "4"},
                               node_env={"KILN_PORT_STREAMS_MAX_PER_SANDBOX": "5"})
        cls.addClassCleanup(cls.stack.cleanup)
        gw = cls.stack.gw
        r = gw.request("POST", "/v1/tenants", {"name": "ports"}, cls.stack.admin)
        assert r.status == 201, r
        cls.tenant_id = r.json()["tenant"]["id"]
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 512}, cls.key, timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()["id"]
        cls.exec(["python3", "-c", f"open('/root/srv.py', 'w').write({SERVER!r})"])
        cls.exec(["sh", "-c", "nohup python3 /root/srv.py >/root/srv.log 2>&1 &"])
        wait = ("import socket, time\n"
                "for i in range(600):\n"
                "    try:\n"
                "        [socket.create_connection(('127.0.0.1', p)).close() for p in (8000, 8001, 8002)]\n"
                "        break\n"
                "    except OSError:\n"
                "        time.sleep(0.1)\n"
                "else:\n"
                "    raise SystemExit('the servers did not start')\n")
        cls.exec(["python3", "-c", wait])
        cls.token = node_token(cls.stack, cls.tenant_id, cls.sb)

    @classmethod
    def exec(cls, cmd):
        r = cls.stack.gw.request("POST", f"/v1/sandboxes/{cls.sb}/exec", {"cmd": cmd}, cls.key,
                                 timeout=120)
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
        opened, refused = [], None
        for _ in range(7):
            status, s, head, rest = self.stream(8002, self.token)
            if status == 101:
                opened.append(s)
                continue
            refused = (status, head, rest)
            break
        self.assertIsNotNone(refused, "7 streams open at once")
        self.assertEqual(refused[0], 429, refused)
        self.assertIn(b"port_streams_max_per_sandbox", refused[2])
        self.assertLessEqual(len(opened), 5)
        for s in opened:
            s.close()
        # once they ended, streams open again
        for _ in range(100):
            status, s, head, rest = self.stream(8002, self.token)
            if status == 101:
                break
            time.sleep(0.1)
        self.assertEqual(status, 101, head)

    def test_streams_at_once_are_capped_per_tenant_at_the_gateway(self):
        # port_streams_max_per_tenant is 4 on this gateway: the fifth at the latest is 429
        opened, refused = [], None
        for _ in range(6):
            status, s, head, rest = self.gw_stream(8002, self.key)
            if status == 101:
                opened.append(s)
                continue
            refused = (status, head, rest)
            break
        self.assertIsNotNone(refused, "6 streams open at once")
        self.assertEqual(refused[0], 429, refused)
        self.assertIn(b"port_streams_max_per_tenant", refused[2])
        self.assertLessEqual(len(opened), 4)
        for s in opened:
            s.close()
        for _ in range(100):
            status, s, head, rest = self.gw_stream(8002, self.key)
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
        arrivals, data = [], rest
        while True:
            d = s.recv(65536)
            if not d:
                break
            data += d
            for i in range(3):
                if f"{i}\n".encode() in data and len(arrivals) == i:
                    arrivals.append(time.monotonic())
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

    def test_streams_end_before_a_pause_and_the_sandbox_serves_after(self):
        status, s, head, rest = self.stream(8002, self.token)
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


if __name__ == "__main__":
    unittest.main()
