"""test_haproxy.py - two kiln-gateways behind HAProxy (Debian's package) with the PROXY protocol.

HAProxy balances TCP connections over two gateways of one database, sending each a PROXY v2
header; the gateways trust it from 127.0.0.1 only (http_trusted_proxies). The client's own
address, not HAProxy's, is what the per-address connection cap counts: with a cap of one
connection per address, clients on 127.0.0.5 and 127.0.0.6 (both loopback) each get their one
connection on each gateway, and a second connection of 127.0.0.5 on the same gateway is refused
with 429 naming 127.0.0.5 (were HAProxy's address counted, the refusal would name 127.0.0.1 and
hit 127.0.0.6 too). Then one gateway is killed with -9: HAProxy's checks take it out, and requests
go on through the other. Every process started is stopped by its pid.
"""
import secrets
import signal
import socket
import time
import unittest

import kiln


def get(port, source, path="/v1/.well-known/jwks.json", keep=False):
    """A GET through 127.0.0.1:`port` from `source`; (status, body, socket when `keep`)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: kiln\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(body) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    if not keep:
        s.close()
        s = None
    return status, body, s


class HaproxyTest(unittest.TestCase):
    def setUp(self):
        env = kiln.services_env()
        self.db = kiln.fresh_database()
        self.addCleanup(self.db.drop)
        key = secrets.token_hex(32)
        extra = {"KILN_HTTP_TRUSTED_PROXIES": "127.0.0.1",
                 "KILN_HTTP_MAX_CONNECTIONS_PER_ADDR": "1", "KILN_LOG_LEVEL": "info"}
        self.gws = []
        for _ in range(2):
            gw = kiln.Gateway(self.db.url, env["KILN_REDIS_URL"], extra_env=extra, master_key=key)
            self.addCleanup(gw.cleanup)
            self.gws.append(gw)
        self.haproxy = kiln.Haproxy([gw.port for gw in self.gws])
        self.addCleanup(self.haproxy.stop)
        self.port = self.haproxy.port
        self.haproxy.wait_serving(lambda: get(self.port, "127.0.0.1")[0] == 200)

    def test_client_address_and_a_dead_gateway(self):
        # Round robin: the first two connections of 127.0.0.5 land on different gateways and are
        # held open; the third lands on a gateway that holds one of 127.0.0.5's already.
        held = []
        for _ in range(2):
            status, body, s = get(self.port, "127.0.0.5", keep=True)
            self.assertEqual(status, 200, body)
            held.append(s)
        status, body, _ = get(self.port, "127.0.0.5")
        self.assertEqual(status, 429, body)
        self.assertIn(b"127.0.0.5", body)
        # Another client address is not counted with it.
        for _ in range(2):
            status, body, s = get(self.port, "127.0.0.6", keep=True)
            self.assertEqual(status, 200, body)
            held.append(s)
        for s in held:
            s.close()
        time.sleep(0.5)

        # One gateway dies: HAProxy takes it out, the other answers everything.
        self.gws[0].stop(signal.SIGKILL)
        deadline = time.time() + 20
        streak = 0
        while time.time() < deadline and streak < 20:
            try:
                status = get(self.port, "127.0.0.7")[0]
            except OSError:
                status = 0
            streak = streak + 1 if status == 200 else 0
            time.sleep(0.05)
        self.assertEqual(streak, 20, "requests through HAProxy kept failing after a gateway died")


if __name__ == "__main__":
    unittest.main()
