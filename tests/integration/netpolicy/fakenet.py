#!/usr/bin/python3
"""The fake internet's servers, run inside a test network namespace.

  fakenet.py ADDR...        TCP on every address: 80, 443, 8080, 25, 5432 answer one line and
                            close (80 and 443 then answer each request head with a line
                            "host=<its Host>" until the client closes, GET /bulk/N with N
                            bytes after it); 7000 streams a line every 50 ms; 8081 streams bytes as fast as
                            it can. UDP echo on 9999 of each address. DNS on 53 (UDP and TCP) of
                            each address whose last IPv4 byte is 53, from the table below; a UDP
                            answer over 512 bytes comes truncated (TC, no records), as from a
                            real server, and whole over TCP. Names under "hole.test" are
                            never answered (a slow resolver: the proxy's queries stay pending).
Prints "ready" when every socket listens.
"""
import socket
import socketserver
import struct
import sys
import threading
import time

TTL = 60
DNS = {
    "sub.example.com": [("A", "203.0.113.10")],
    "twin.example.com": [("A", "203.0.113.10")],    # two names on one address
    "example.com": [("A", "203.0.113.11")],
    "wild.test": [("A", "203.0.113.16")],
    "a.wild.test": [("A", "203.0.113.12")],
    "x.y.wild.test": [("A", "203.0.113.13")],
    "late.wild.test": [("A", "203.0.113.14")],
    "alias.wild.test": [("CNAME", "real.other.test")],
    "real.other.test": [("A", "203.0.113.17")],
    "api.test": [("A", "198.51.100.21")],
    "rebind.test": [("A", "10.0.0.5"), ("A", "169.254.169.254"), ("A", "203.0.113.15")],
    "v6.test": [("AAAA", "2001:db8:1::10")],
    "other.test": [("A", "198.51.100.22")],
    # two names on an address fakenet does not serve: test_egress.py's real HTTPS server
    "tls.example.test": [("A", "203.0.113.20")],
    "tlstwin.example.test": [("A", "203.0.113.20")],
    # test_egress.py's recording servers of the secrets tests (tlsrecord.py)
    "api.example.test": [("A", "198.51.100.30")],
    "rogue.example.test": [("A", "198.51.100.31")],
    # 300 addresses: over 512 bytes, so only TCP carries them; the first one is served here
    "many.test": [("A", "203.0.113.10")] + [("A", "198.18.%d.%d" % (i // 200, 1 + i % 200)) for i in range(299)],
}
ONE_LINE_PORTS = [80, 443, 8080, 25, 5432]


def encode_name(name):
    out = b""
    for label in name.split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\0"


def dns_answer(q):
    if len(q) < 12:
        return None
    qid, flags, qd = struct.unpack("!HHH", q[:6])
    if qd != 1:
        return None
    off, labels = 12, []
    while off < len(q) and q[off] != 0:
        n = q[off]
        labels.append(q[off + 1:off + 1 + n].decode(errors="replace"))
        off += 1 + n
    off += 1
    qtype, qclass = struct.unpack("!HH", q[off:off + 4])
    question = q[12:off + 4]
    name = ".".join(labels).lower()
    if name.endswith(".hole.test"):
        return None
    records = []
    cur = name
    for _ in range(4):
        for kind, value in DNS.get(cur, []):
            if kind == "CNAME":
                records.append((cur, 5, encode_name(value)))
                cur = value
                break
            if kind == "A" and qtype == 1:
                records.append((cur, 1, socket.inet_pton(socket.AF_INET, value)))
            if kind == "AAAA" and qtype == 28:
                records.append((cur, 28, socket.inet_pton(socket.AF_INET6, value)))
        else:
            break
    rcode = 0 if name in DNS else 3
    hdr = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, len(records), 0, 0)
    body = b""
    for owner, rtype, rdata in records:
        body += encode_name(owner) + struct.pack("!HHIH", rtype, 1, TTL, len(rdata)) + rdata
    return hdr + question + body


class Handler(socketserver.BaseRequestHandler):
    def handle(self):
        port = self.server.server_address[1]
        local = self.request.getsockname()[0]
        try:
            if port == 7000:
                while True:
                    self.request.sendall(b"tick %f\n" % time.time())
                    time.sleep(0.05)
            elif port == 9000:
                got = 0
                while True:
                    b = self.request.recv(65536)
                    if not b:
                        break
                    got += len(b)
                self.request.sendall(b"%d\n" % got)
            elif port == 8081:
                chunk = b"x" * 16384
                while True:
                    self.request.sendall(chunk)
            else:
                self.request.sendall(b"hello from %s:%d\n" % (local.encode(), port))
                if port in (80, 443):
                    self.web()
        except OSError:
            pass


    def web(self):
        """After the greeting, 80 and 443 answer each request head with the Host it named."""
        self.request.settimeout(30)
        buf = b""
        while True:
            b = self.request.recv(4096)
            if not b:
                return
            buf += b
            while b"\r\n\r\n" in buf:
                head, buf = buf.split(b"\r\n\r\n", 1)
                host = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
                        if l.lower().startswith(b"host:")]
                if head.startswith(b"GET /bulk/"):
                    # GET /bulk/N: N bytes after the "host=" line (benchmarks)
                    n = int(head.split()[1].split(b"/")[2])
                    self.request.sendall(b"host=%s\n" % (host[0] if host else b"-"))
                    chunk = b"x" * 65536
                    while n > 0:
                        self.request.sendall(chunk[:n])
                        n -= min(n, len(chunk))
                    continue
                self.request.sendall(b"host=%s\n" % (host[0] if host else b"-"))


class TCP(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, addr, v6):
        self.address_family = socket.AF_INET6 if v6 else socket.AF_INET
        super().__init__(addr, Handler)


def truncated(reply):
    """The reply as a UDP server sends one too large for 512 bytes: TC set, the question only."""
    qid, flags, qd = struct.unpack("!HHH", reply[:6])
    off = 12
    while reply[off] != 0:
        off += 1 + reply[off]
    return struct.pack("!HHHHHH", qid, flags | 0x0200, qd, 0, 0, 0) + reply[12:off + 5]


def udp_loop(sock, dns):
    while True:
        data, peer = sock.recvfrom(4096)
        reply = dns_answer(data) if dns else data
        if reply and dns and len(reply) > 512:
            reply = truncated(reply)
        if reply:
            sock.sendto(reply, peer)


class DNSHandler(socketserver.BaseRequestHandler):
    """DNS over TCP: length-prefixed queries, one after another on a connection."""

    def handle(self):
        try:
            while True:
                head = self.request.recv(2, socket.MSG_WAITALL)
                if len(head) < 2:
                    return
                q = self.request.recv(struct.unpack("!H", head)[0], socket.MSG_WAITALL)
                reply = dns_answer(q)
                if not reply:
                    return
                self.request.sendall(struct.pack("!H", len(reply)) + reply)
        except OSError:
            pass


class DNSTCP(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, addr):
        super().__init__(addr, DNSHandler)


def main():
    addrs = sys.argv[1:]
    servers = []
    for a in addrs:
        v6 = ":" in a
        for port in ONE_LINE_PORTS + [7000, 8081, 9000]:
            servers.append(TCP((a, port), v6))
        fam = socket.AF_INET6 if v6 else socket.AF_INET
        u = socket.socket(fam, socket.SOCK_DGRAM)
        u.bind((a, 9999))
        threading.Thread(target=udp_loop, args=(u, False), daemon=True).start()
        if not v6 and a.endswith(".53"):
            d = socket.socket(fam, socket.SOCK_DGRAM)
            d.bind((a, 53))
            threading.Thread(target=udp_loop, args=(d, True), daemon=True).start()
            servers.append(DNSTCP((a, 53)))
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
