"""Gateway connections against hostile clients: the per-address cap, the header deadline, the
minimum body rate, and the client address trusted proxies carry (PROXY v1/v2, X-Forwarded-For).

Clients use distinct loopback addresses as their source (127.0.0.2, .3, ...: all of 127/8 is
the loopback), so one address's attack and another's service can be told apart.
"""
import json
import resource
import select
import socket
import struct
import time
import unittest

import kiln

CAP = 16            # http_max_connections_per_addr
HEADER_S = 3        # http_header_timeout_s
MIN_RATE = 1024     # http_body_min_rate
PROXY = "127.0.0.3"  # the trusted proxy


def connect(port, source, timeout=5):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def read_reply(s, timeout=5):
    """Reads one HTTP reply (status, headers, body) or None when the server closed first."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            chunk = b""
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_server(s, timeout):
    """Whether the server closes `s` (EOF or reset) within `timeout` seconds, discarding data."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s.settimeout(max(0.01, deadline - time.time()))
        try:
            if not s.recv(65536):
                return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
    return False


def get(port, source, path, headers=None, prefix=b""):
    s = connect(port, source)
    try:
        hdrs = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        s.sendall(prefix + f"GET {path} HTTP/1.1\r\nHost: x\r\n{hdrs}Connection: close\r\n\r\n".encode())
        return read_reply(s)
    finally:
        s.close()


def proxy_v1(client, port=40000):
    return f"PROXY TCP4 {client} 127.0.0.1 {port} 8080\r\n".encode()


def proxy_v2(client, port=40000):
    addrs = socket.inet_aton(client) + socket.inet_aton("127.0.0.1") + struct.pack("!HH", port, 8080)
    return b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x11]) + struct.pack("!H", len(addrs)) + addrs


def proxy_v2_ipv6(client, port=40000):
    addrs = (socket.inet_pton(socket.AF_INET6, client) + socket.inet_pton(socket.AF_INET6, "::1")
             + struct.pack("!HH", port, 8080))
    return b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x21]) + struct.pack("!H", len(addrs)) + addrs


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


class ConnectionTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 4096:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
        env = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.gw = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"], {
            "KILN_HTTP_MAX_CONNECTIONS_PER_ADDR": str(CAP),
            "KILN_HTTP_HEADER_TIMEOUT_S": str(HEADER_S),
            "KILN_HTTP_BODY_MIN_RATE": str(MIN_RATE),
            "KILN_HTTP_TRUSTED_PROXIES": f"{PROXY}, 10.9.0.0/16",
            "KILN_RATE_LIMIT_RPS": "1000", "KILN_RATE_LIMIT_BURST": "1000"})
        cls.port = cls.gw.port
        cls.auth = {"Authorization": f"Bearer {cls.gw.admin_key}"}

    @classmethod
    def tearDownClass(cls):
        cls.gw.cleanup()
        cls.db.drop()

    def hold(self, source, n, prefix=b"", request=b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        """Opens `n` connections from `source` that send `prefix` and an unfinished request."""
        held = []
        for _ in range(n):
            s = connect(self.port, source)
            s.sendall(prefix + request)
            held.append(s)
        time.sleep(0.3)
        for s in held:  # none was refused
            s.setblocking(False)
            try:
                self.assertNotEqual(s.recv(1), b"", "a connection under the cap was closed")
            except BlockingIOError:
                pass
            s.setblocking(True)
        return held

    def assert_cap_reply(self, reply, client):
        self.assertIsNotNone(reply, "the connection over the cap was closed without a reply")
        status, headers, body = reply
        self.assertEqual(status, 429, body)
        err = json.loads(body)["error"]
        self.assertEqual(err["code"], "rate_limited")
        self.assertIn("http_max_connections_per_addr", err["message"])
        self.assertIn(client, err["message"])
        self.assertEqual(headers.get("retry-after"), "1")

    def test_slow_connections_from_one_address_do_not_lock_out_another(self):
        """1,000 slowloris connections from 127.0.0.1; 127.0.0.2's authenticated requests go on."""
        before = rss_kib(self.gw.proc.pid)
        attackers, refused = [], 0
        for _ in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.bind(("127.0.0.1", 0))
            s.connect_ex(("127.0.0.1", self.port))
            attackers.append(s)
        latencies = []
        t_end = time.time() + 2 * HEADER_S + 2
        drip = 0
        while time.time() < t_end:
            # One header byte on every attacking socket still open, then a well-behaved request.
            for s in attackers:
                if s.fileno() >= 0:
                    try:
                        s.send(b"GET / HTTP/1.1\r\n"[drip % 16:drip % 16 + 1])
                    except OSError:
                        pass
            drip += 1
            t0 = time.time()
            r = get(self.port, "127.0.0.2", "/v1/api-keys", self.auth)
            latencies.append(time.time() - t0)
            self.assertIsNotNone(r)
            self.assertEqual(r[0], 200, r)
            time.sleep(0.5)
        self.assertGreater(len(latencies), 5)
        self.assertLess(max(latencies), 2.0, latencies)
        # The attackers over the cap were answered 429 at once; the rest were closed by the
        # header deadline: by now none is held.
        held = 0
        for s in attackers:
            r, _, _ = select.select([s], [], [], 0)
            if not r:
                held += 1
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 429"):
                refused += 1
        self.assertGreaterEqual(refused, 1000 - CAP - 50)
        self.assertEqual(held, 0, "connections outlived the header deadline")
        for s in attackers:
            s.close()
        metrics = get(self.port, "127.0.0.2", "/metrics")[2].decode()
        self.assertIn('kiln_http_connections_refused_total{limit="per_addr"}', metrics)
        self.assertRegex(metrics, r'kiln_http_timeouts_total\{phase="headers"\} [1-9]')
        # The gateway's memory stays flat: nothing is kept per refused connection.
        time.sleep(0.5)
        after = rss_kib(self.gw.proc.pid)
        self.assertLess(after - before, 48 * 1024, f"RSS {before} KiB -> {after} KiB")
        # And the attacking address is served again once its connections are gone.
        self.assertEqual(get(self.port, "127.0.0.1", "/v1/api-keys", self.auth)[0], 200)

    def test_the_cap_counts_one_address_and_is_freed_as_connections_close(self):
        held = self.hold("127.0.0.4", CAP)
        try:
            self.assert_cap_reply(get(self.port, "127.0.0.4", "/healthz"), "127.0.0.4")
            self.assertIn(get(self.port, "127.0.0.5", "/healthz")[0], (200, 503))
            held.pop().close()
            time.sleep(0.3)
            self.assertIn(get(self.port, "127.0.0.4", "/healthz")[0], (200, 503))
        finally:
            for s in held:
                s.close()

    def test_slow_headers_are_cut_at_the_deadline(self):
        s = connect(self.port, "127.0.0.6")
        t0 = time.time()
        try:
            for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\n":
                try:
                    s.send(bytes([b]))
                except OSError:
                    break
                if closed_by_server(s, 0.5):
                    break
            elapsed = time.time() - t0
            self.assertGreater(elapsed, HEADER_S - 0.5)
            self.assertLess(elapsed, HEADER_S + 1.5)
        finally:
            s.close()

    def slow_body(self, source, head):
        """Sends `head` then a body at 100 bytes/s; returns (reply, seconds until it came)."""
        s = connect(self.port, source)
        try:
            s.sendall(head)
            t0 = time.time()
            reply = None
            while time.time() - t0 < HEADER_S + 5:
                try:
                    s.send(b"x" * 10)
                except OSError:
                    pass
                r, _, _ = select.select([s], [], [], 0.1)
                if r:
                    reply = read_reply(s)
                    break
            elapsed = time.time() - t0
            closed = reply is not None and closed_by_server(s, 2)
            return reply, elapsed, closed
        finally:
            s.close()

    def test_slow_upload_body_gets_408_and_the_connection_closes(self):
        for head in (
                # A streamed upload (the files route) and a buffered JSON body.
                (f"PUT /v1/sandboxes/sb_none/files?path=/tmp/x HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Bearer {self.gw.admin_key}\r\nContent-Length: 100000\r\n\r\n").encode(),
                (f"POST /v1/api-keys HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {self.gw.admin_key}\r\nContent-Length: 900000\r\n\r\n").encode()):
            reply, elapsed, closed = self.slow_body("127.0.0.7", head)
            self.assertIsNotNone(reply, head)
            status, _, body = reply
            self.assertEqual(status, 408, body)
            self.assertEqual(json.loads(body)["error"]["code"], "request_timeout")
            self.assertIn("http_body_min_rate", json.loads(body)["error"]["message"])
            self.assertLess(elapsed, HEADER_S + 1.5)
            self.assertTrue(closed, "the connection stayed open after the 408")
        # A body at full speed is not cut: its route answers it.
        s = connect(self.port, "127.0.0.7")
        try:
            s.sendall((f"PUT /v1/sandboxes/sb_none/files?path=/tmp/x HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {self.gw.admin_key}\r\nContent-Length: 100000\r\n"
                       f"Connection: close\r\n\r\n").encode() + b"x" * 100000)
            status = read_reply(s)[0]
            self.assertNotEqual(status, 408)
        finally:
            s.close()

    def test_proxy_protocol_from_the_trusted_proxy_names_the_client(self):
        for version, header in (("v1", proxy_v1), ("v2", proxy_v2)):
            with self.subTest(version=version):
                client = "203.0.113.7" if version == "v1" else "198.51.100.7"
                # The cap counts the carried address, not the proxy's.
                held = self.hold(PROXY, CAP, prefix=header(client))
                try:
                    self.assert_cap_reply(get(self.port, PROXY, "/healthz", prefix=header(client)),
                                          client)
                    other = get(self.port, PROXY, "/healthz", prefix=header(client[:-1] + "8"))
                    self.assertIn(other[0], (200, 503), other)
                    # The proxy's own connections (no PROXY header) are not capped by address.
                    self.assertIn(get(self.port, PROXY, "/healthz")[0], (200, 503))
                finally:
                    for s in held:
                        s.close()
        # IPv6 clients count by their /64: its other addresses are the same client.
        held = self.hold(PROXY, CAP, prefix=proxy_v2_ipv6("2001:db8:1:2::a"))
        try:
            self.assert_cap_reply(get(self.port, PROXY, "/healthz",
                                      prefix=proxy_v2_ipv6("2001:db8:1:2:ffff::1")),
                                  "2001:db8:1:2:ffff::1")
            other = get(self.port, PROXY, "/healthz", prefix=proxy_v2_ipv6("2001:db8:1:3::a"))
            self.assertIn(other[0], (200, 503), other)
        finally:
            for s in held:
                s.close()
        # A malformed header from the trusted proxy is refused.
        r = get(self.port, PROXY, "/healthz", prefix=b"PROXY TCP4 nonsense\r\n")
        self.assertTrue(r is None or r[0] == 400, r)
        self.assertIn("refused a connection from 203.0.113.7", self.gw.output())

    def test_proxy_protocol_from_anyone_else_is_refused_and_not_believed(self):
        for header in (proxy_v1("203.0.113.9"), proxy_v2("203.0.113.9")):
            r = get(self.port, "127.0.0.8", "/healthz", prefix=header)
            self.assertTrue(r is None or r[0] == 400, r)
        # The cap counts the socket's address, whatever the header says.
        held = self.hold("127.0.0.9", CAP)
        try:
            self.assert_cap_reply(get(self.port, "127.0.0.9", "/healthz",
                                      prefix=proxy_v1("203.0.113.99")), "127.0.0.9")
        finally:
            for s in held:
                s.close()

    def test_x_forwarded_for_from_the_trusted_proxy_names_the_client(self):
        client = "192.0.2.44"
        # Requests whose headers are in and whose bodies are still coming hold their connections.
        body_pending = (f"POST /v1/api-keys HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.1.1.1, {client}\r\n"
                        f"Content-Length: 100\r\n\r\n").encode()
        held = self.hold(PROXY, CAP, request=body_pending)
        try:
            # The rightmost address that is not a trusted proxy is the client.
            r = get(self.port, PROXY, "/healthz", {"X-Forwarded-For": f"{client}, 10.9.3.4"})
            self.assert_cap_reply(r, client)
            r = get(self.port, PROXY, "/healthz", {"X-Forwarded-For": "192.0.2.45"})
            self.assertIn(r[0], (200, 503), r)
            # From an untrusted peer the header is ignored: its socket address is the client.
            r = get(self.port, "127.0.0.10", "/healthz", {"X-Forwarded-For": client})
            self.assertIn(r[0], (200, 503), r)
        finally:
            for s in held:
                s.close()


if __name__ == "__main__":
    unittest.main()
