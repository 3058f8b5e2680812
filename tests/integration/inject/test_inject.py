"""test_inject.py - the injecting proxy (node/inject.c) on the host.

A client that trusts only the tenant's CA (as a guest does) talks through inject_serve (the injector
on loopback, standing in for the name-checking proxy's hand-off) to a TLS test server whose
certificate a test CA signed, and which records every request it gets. The secret header must
reach the server on every request of a keep-alive connection, replace one the client sent, stay
off requests for another Host; TRACE, CONNECT and upgrades are refused; bodies stream both ways;
redirects pass through; an upstream whose certificate the node does not trust gets nothing.
"""
import datetime
import hashlib
import http.client
import http.server
import os
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import unittest

from cryptography import x509

from testca import make_ca, make_leaf, pem_cert, pem_key

SERVE = os.environ.get("KILN_INJECT_SERVE", "")
HOST = "api.test"
SECRET = "Bearer s3cr3t-value-9f27c1"


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def _handle(self):
        body = self._body()
        self.server.seen.append((self.command, self.path, self.headers, body))
        self.server.resumed[self.path] = self.connection.session_reused
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "https://elsewhere.test/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"x" * 70000, b"y" * 5, b"z" * 3):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        out = ("%s %s %d %s" % (self.command, self.path, len(body),
                                hashlib.sha256(body).hexdigest())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _handle


class Upstream:
    def __init__(self, cert_file, key_file):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        self.httpd.daemon_threads = True
        self.httpd.seen = []
        self.httpd.resumed = {}  # path: whether its connection's TLS session was resumed
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert_file, key_file)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self):
        return self.httpd.seen

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class InjectTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not SERVE or not os.access(SERVE, os.X_OK):
            raise RuntimeError("KILN_INJECT_SERVE must name the built inject_serve")
        cls.tmp = tempfile.TemporaryDirectory(prefix="kiln-inject-")
        d = cls.tmp.name
        trusted_key, trusted = make_ca("test upstream CA")
        rogue_key, rogue = make_ca("rogue CA")
        cls.upstream_ca = os.path.join(d, "upstream-ca.pem")
        with open(cls.upstream_ca, "wb") as f:
            f.write(pem_cert(trusted))
        cls.servers = {}
        for name, (ck, cc) in (("good", (trusted_key, trusted)), ("rogue", (rogue_key, rogue))):
            key, cert = make_leaf(ck, cc, HOST)
            cf, kf = os.path.join(d, name + ".crt"), os.path.join(d, name + ".key")
            with open(cf, "wb") as f:
                f.write(pem_cert(cert))
            with open(kf, "wb") as f:
                f.write(pem_key(key))
            cls.servers[name] = Upstream(cf, kf)
        cls.procs = []

    @classmethod
    def tearDownClass(cls):
        for p in cls.procs:
            p.kill()
            p.wait()
        for s in cls.servers.values():
            s.stop()
        cls.tmp.cleanup()

    def serve(self, server, secrets, pre=0, host=HOST, extra=()):
        """Starts inject_serve towards `server`; returns (port, path of the tenant CA)."""
        ca_out = os.path.join(self.tmp.name, "tenant-ca-%d.pem" % len(self.procs))
        args = [SERVE, "--host", host, "--upstream", str(self.servers[server].port),
                "--ca-file", self.upstream_ca, "--ca-out", ca_out, "--pre", str(pre)] + list(extra)
        for s in secrets:
            args += ["--secret"] + list(s)
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        port = int(p.stdout.readline())
        return port, ca_out

    def request(self, conn, method, path, host=HOST, headers=None, body=None, chunked=False):
        h = {"Host": host}
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h, encode_chunked=chunked)
        r = conn.getresponse()
        return r.status, r.read(), r

    def test_secret_on_every_request_replaced_and_not_for_another_host(self):
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET), (HOST, "X-Api-Key", "k-42")],
                              pre=7)
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        start = len(up.seen)
        for i in range(3):  # one keep-alive connection
            st, body, _ = self.request(conn, "GET", "/a%d" % i)
            self.assertEqual(st, 200, body)
        st, _, _ = self.request(conn, "GET", "/forged", headers={"Authorization": "Bearer guest",
                                                                  "x-api-key": "guest"})
        self.assertEqual(st, 200)
        st, _, _ = self.request(conn, "GET", "/other", host="other.test")
        self.assertEqual(st, 200)
        st, _, _ = self.request(conn, "GET", "/port", host=HOST + ":443")
        self.assertEqual(st, 200)
        seen = up.seen[start:]
        self.assertEqual([s[1] for s in seen], ["/a0", "/a1", "/a2", "/forged", "/other", "/port"])
        for s in seen[:4] + seen[5:]:
            self.assertEqual(s[2].get_all("Authorization"), [SECRET], s[1])
            self.assertEqual(s[2].get_all("X-Api-Key"), ["k-42"], s[1])
        self.assertIsNone(seen[4][2].get("Authorization"))
        self.assertIsNone(seen[4][2].get("X-Api-Key"))
        conn.close()

    def test_upstream_session_resumed_by_the_next_connection(self):
        # the injector keeps the upstream's TLS session: the next guest connection's upstream
        # handshake is a resumption, not a full one (the first byte waits less)
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)])
        ctx = ssl.create_default_context(cafile=ca)
        for path in ("/first", "/second", "/third"):
            conn = _Conn(port, ctx)
            st, body, _ = self.request(conn, "GET", path)
            self.assertEqual(st, 200, body)
            conn.close()
        self.assertEqual([up.httpd.resumed[p] for p in ("/first", "/second", "/third")],
                         [False, True, True])
        self.assertEqual([s[2].get("Authorization") for s in up.seen[-3:]], [SECRET] * 3)

    def test_bodies_stream_both_ways_and_redirects_pass_through(self):
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)])
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        data = os.urandom(300000)
        st, body, _ = self.request(conn, "POST", "/upload", body=data)
        self.assertEqual(st, 200)
        self.assertEqual(body.decode(), "POST /upload %d %s" % (len(data),
                                                                hashlib.sha256(data).hexdigest()))
        # a chunked request body
        st, body, _ = self.request(conn, "PUT", "/chunks", body=iter([b"ab" * 5000, b"c"]),
                                   headers={"Transfer-Encoding": "chunked"}, chunked=True)
        self.assertEqual(st, 200)
        self.assertEqual(body.decode().split()[2], "10001")
        st, body, _ = self.request(conn, "GET", "/chunked")
        self.assertEqual((st, len(body)), (200, 70008))
        st, body, r = self.request(conn, "GET", "/redirect")
        self.assertEqual((st, r.getheader("Location")), (302, "https://elsewhere.test/"))
        st, body, _ = self.request(conn, "HEAD", "/head")
        self.assertEqual((st, body), (200, b""))
        st, body, _ = self.request(conn, "GET", "/after")
        self.assertEqual(st, 200)
        self.assertEqual(up.seen[-1][2].get("Authorization"), SECRET)
        conn.close()
        # curl, as a guest runs it: HTTP/1.1 even when it would rather speak h2
        out = subprocess.run(["curl", "-sS", "--http2", "--cacert", ca, "--connect-to",
                              "%s:443:127.0.0.1:%d" % (HOST, port), "-w", " %{http_version}",
                              "https://%s/curl" % HOST], capture_output=True, text=True,
                             timeout=30)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertTrue(out.stdout.startswith("GET /curl 0 "), out.stdout)
        self.assertTrue(out.stdout.endswith(" 1.1"), out.stdout)
        self.assertEqual(up.seen[-1][2].get("Authorization"), SECRET)

    def test_bare_lf_heads(self):
        # lines ended by LF alone (RFC 9112 lets a recipient accept them) gain their CR upstream
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)])
        ctx = ssl.create_default_context(cafile=ca)
        head = "GET /lf HTTP/1.1\nHost: %s\n%sConnection: close\n\n" % (
            HOST, "".join("X-H%d: v\n" % i for i in range(90)))
        with socket.create_connection(("127.0.0.1", port), 30) as raw:
            with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
                tls.sendall(head.encode())
                data = b""
                while True:
                    chunk = tls.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        self.assertTrue(data.startswith(b"HTTP/1.1 200"), data[:200])
        self.assertEqual(up.seen[-1][1], "/lf")
        self.assertEqual(up.seen[-1][2].get("Authorization"), SECRET)
        self.assertEqual(up.seen[-1][2].get("X-H89"), "v")

    def test_trace_connect_upgrade_refused(self):
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)])
        for method, path, headers in (("TRACE", "/t", {}), ("CONNECT", "/c", {}),
                                      ("GET", "/u", {"Connection": "Upgrade", "Upgrade": "h2c"}),
                                      ("GET", "/ws", {"Upgrade": "websocket"})):
            start = len(up.seen)
            conn = _Conn(port, ssl.create_default_context(cafile=ca))
            st, body, _ = self.request(conn, method, path, headers=headers)
            self.assertEqual(st, 403, (method, path, body))
            self.assertEqual(up.seen[start:], [], (method, path))
            conn.close()

    def test_connection_log_notes_requests_never_values(self):
        notes = os.path.join(self.tmp.name, "notes-%d.log" % len(self.procs))
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)],
                              extra=("--notes", notes, "--requests-per-conn", "4"))
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        self.assertEqual(self.request(conn, "GET", "/a/b?token=q-secret#frag")[0], 200)
        self.assertEqual(self.request(conn, "POST", "/up", body=b"x" * 10)[0], 200)
        self.assertEqual(self.request(conn, "GET", "/other", host="other.test")[0], 200)
        self.assertEqual(self.request(conn, "GET", "/redirect")[0], 302)
        self.assertEqual(self.request(conn, "GET", "/fifth")[0], 200)  # over the cap: not noted
        conn.close()
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        self.assertEqual(self.request(conn, "TRACE", "/t")[0], 403)
        conn.close()
        deadline = time.time() + 10
        while time.time() < deadline:
            with open(notes) as f:
                lines = [l.split() for l in f.read().splitlines()]
            if len(lines) >= 5:
                break
            time.sleep(0.1)
        got = [l[:6] for l in lines]
        self.assertEqual(got, [
            ["sb_test", "GET", HOST, "/a/b", "200", "1"],
            ["sb_test", "POST", HOST, "/up", "200", "1"],
            ["sb_test", "GET", "other.test", "/other", "200", "0"],
            ["sb_test", "GET", HOST, "/redirect", "302", "1"],
            ["sb_test", "TRACE", HOST, "/t", "403", "0"]])
        # the flow: the port the client dialled and its own port
        self.assertTrue(all(l[6] == str(port) and 0 < int(l[7]) < 65536 for l in lines), lines)
        with open(notes) as f:
            text = f.read()
        self.assertNotIn(SECRET, text)
        self.assertNotIn("q-secret", text)

    def test_untrusted_upstream_gets_nothing(self):
        up = self.servers["rogue"]
        port, ca = self.serve("rogue", [(HOST, "Authorization", SECRET)])
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        st, body, _ = self.request(conn, "GET", "/steal")
        self.assertEqual(st, 502, body)
        self.assertEqual(up.seen, [])
        conn.close()

    def test_guest_must_trust_the_tenant_ca(self):
        port, _ = self.serve("good", [(HOST, "Authorization", SECRET)])
        conn = _Conn(port, ssl.create_default_context(cafile=self.upstream_ca))
        with self.assertRaises(ssl.SSLCertVerificationError):
            self.request(conn, "GET", "/x")
        conn.close()

    def test_tenant_ca_and_leaf(self):
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)])
        with open(ca, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        self.assertTrue(bc.critical)
        self.assertEqual((bc.value.ca, bc.value.path_length), (True, 0))
        ctx = ssl.create_default_context(cafile=ca)
        with socket.create_connection(("127.0.0.1", port), 30) as raw:
            with ctx.wrap_socket(raw, server_hostname=HOST) as tls:
                leaf = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
                self.assertEqual(tls.selected_alpn_protocol(), None)
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        self.assertEqual(san.value.get_values_for_type(x509.DNSName), [HOST])
        if hasattr(leaf, "not_valid_after_utc"):
            life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
        else:  # older cryptography
            life = leaf.not_valid_after - leaf.not_valid_before
        self.assertLessEqual(life, datetime.timedelta(hours=25))
        self.assertFalse(leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)

    def test_dials_from_its_own_network_namespace(self):
        # the hand-off comes from a thread in another netns (loopback down there)
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)],
                              extra=["--handoff-from-netns"])
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        st, body, _ = self.request(conn, "GET", "/netns")
        self.assertEqual(st, 200, body)
        self.assertEqual(up.seen[-1][1], "/netns")
        conn.close()

    def test_denied_upstream_address_never_dialled(self):
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)], extra=["--deny-loopback"])
        start = len(up.seen)
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        with self.assertRaises((ConnectionError, ssl.SSLError, OSError)):
            self.request(conn, "GET", "/denied")
        conn.close()
        self.assertEqual(up.seen[start:], [])

    def test_connections_max(self):
        # inject_connections_max: the connection over it is closed, those under it go on
        self.connections_cap(["--max", "2"])

    def test_connections_per_sandbox(self):
        self.connections_cap(["--per-sandbox", "2"])

    def connections_cap(self, extra):
        up = self.servers["good"]
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)], extra=extra)
        held = [_Conn(port, ssl.create_default_context(cafile=ca)) for _ in range(2)]
        for c in held:
            st, _, _ = self.request(c, "GET", "/held")
            self.assertEqual(st, 200)
        extra = _Conn(port, ssl.create_default_context(cafile=ca))
        with self.assertRaises((ConnectionError, ssl.SSLError, OSError)):
            self.request(extra, "GET", "/over")
        extra.close()
        self.assertNotIn("/over", [s[1] for s in up.seen])
        for c in held:
            st, _, _ = self.request(c, "GET", "/still")
            self.assertEqual(st, 200)
            c.close()
        time.sleep(0.5)  # the injector's threads end as their connections close
        again = _Conn(port, ssl.create_default_context(cafile=ca))
        st, _, _ = self.request(again, "GET", "/again")
        self.assertEqual(st, 200)
        again.close()

    def test_other_host_not_taken(self):
        # inject_serve hands over connections to a host without secrets: the injector declines
        port, ca = self.serve("good", [(HOST, "Authorization", SECRET)], host="other.test")
        conn = _Conn(port, ssl.create_default_context(cafile=ca))
        with self.assertRaises((ConnectionError, ssl.SSLError, OSError)):
            self.request(conn, "GET", "/x")
        conn.close()


class _Conn(http.client.HTTPSConnection):
    """An HTTPS connection to 127.0.0.1:port that checks the certificate for HOST."""

    def __init__(self, port, ctx):
        super().__init__("127.0.0.1", port, context=ctx, timeout=30)
        self._ctx = ctx

    def connect(self):
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._ctx.wrap_socket(sock, server_hostname=HOST)


if __name__ == "__main__":
    unittest.main()
