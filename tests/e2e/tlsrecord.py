#!/usr/bin/python3
"""HTTPS servers that record every request's headers, and the DNS that names them, for the
secrets tests of test_egress.py; run inside the fake internet's namespace (test_egress.py builds
it).

  tlsrecord.py LOG DNS_ADDR NAME=ADDR,CERT,KEY...

DNS on DNS_ADDR:53 (UDP and TCP) answers each NAME with its ADDR (A, TTL 60) and anything else
with NXDOMAIN. On ADDR:443, an HTTP/1.1 server over TLS with CERT and KEY (a keep-alive
connection serves many requests) appends one JSON line to LOG for each request: the name it
serves, the client's address and port, method, path and every header as [name, value] pairs in
order. Each answer is 200 with the body "ok <path> <MARK>\n", MARK the environment's
TLSRECORD_MARK: it never echoes a header; GET /bulk/N answers N bytes (bench/egress). Prints
"ready" once every socket listens.
"""
import http.server
import json
import os
import socket
import ssl
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration",
                                "netpolicy"))
import fakenet  # noqa: E402  (its DNS encoding and UDP/TCP DNS loops)

LOCK = threading.Lock()


class Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _handle(self):
        n = int(self.headers.get("Content-Length", "0") or 0)
        if n:
            self.rfile.read(n)
        rec = {"name": self.server.name, "peer": "%s:%d" % self.client_address[:2],
               "method": self.command, "path": self.path, "headers": list(self.headers.items())}
        with LOCK, open(self.server.log, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.path.startswith("/bulk/") and self.path[6:].isdigit():
            self._bulk(int(self.path[6:]))
            return
        out = ("ok %s %s\n" % (self.path, os.environ.get("TLSRECORD_MARK", ""))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    def _bulk(self, n):
        # GET /bulk/N: N bytes (bench/egress)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        chunk = b"x" * 65536
        while n > 0 and self.command != "HEAD":
            self.wfile.write(chunk[:n])
            n -= min(n, len(chunk))

    do_GET = do_POST = do_HEAD = _handle


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def finish_request(self, request, client_address):
        # the handshake in the connection's own thread: a client that stalls holds only itself
        try:
            request = self.ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        super().finish_request(request, client_address)


def main():
    log, dns_addr, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    fakenet.DNS.clear()
    servers = []
    for spec in specs:
        name, rest = spec.split("=", 1)
        addr, cert, key = rest.split(",")
        fakenet.DNS[name] = [("A", addr)]
        s = Server((addr, 443), Recorder)
        s.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        s.ctx.load_cert_chain(cert, key)
        s.name, s.log = name, log
        servers.append(s)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((dns_addr, 53))
    threading.Thread(target=fakenet.udp_loop, args=(u, True), daemon=True).start()
    servers.append(fakenet.DNSTCP((dns_addr, 53)))
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
