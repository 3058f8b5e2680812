#!/usr/bin/python3
"""Client probes run inside the stand-in guest's namespace. Exit 0 on success, 1 on failure.

  probe.py tcp ADDR PORT [TIMEOUT]         connect and read a line
  probe.py udp ADDR PORT [TIMEOUT]         one datagram echoed
  probe.py udpfrom SRC ADDR PORT           the same, from a given source address
  probe.py dns NAME [SERVER] [TYPE]        prints rcode, the TC flag and the addresses
  probe.py dnstcp NAME [SERVER] [TYPE]     the same over TCP (twice on one connection)
  probe.py dnsflood SECONDS                 queries for unanswered names (n.hole.test) to the
                                            proxy as fast as one socket sends; prints how many
                                            were sent and how many came back REFUSED
  probe.py dnsburst NAME COUNT              COUNT queries at once, each from its own socket
                                            (a new flow each); prints how many were answered
  probe.py dnsrepeat NAME COUNT             COUNT queries one after another (retrying none);
                                            prints how many were answered with rcode 0
  probe.py stream ADDR PORT SECONDS        prints the times at which data arrived
  probe.py bytes ADDR PORT SECONDS         prints how many bytes arrived
  probe.py send ADDR PORT N                sends N bytes on one TCP connection, closes its side,
                                           prints the server's count of what it got
  probe.py udpburst ADDR PORT COUNT        COUNT new UDP flows at once; prints how many answered
  probe.py udpspray ADDR PORT COUNT        COUNT datagrams to one address, waiting for none
  probe.py listen PORT                     accepts TCP on every address until killed
  probe.py http ADDR PORT HOST...          one keep-alive connection, one GET per HOST (each
                                           after the last answer); prints each line the server
                                           sent, then RESET or EOF as the connection ended
  probe.py tls ADDR PORT SNI               sends a real ClientHello (Python's ssl) naming SNI;
                                           prints the first line the server sent, or RESET/EOF
  probe.py httphold ADDR PORT HOST SECS    one GET, its answer, then prints "open" and waits up
                                           to SECS for the connection to end: prints RESET, EOF
                                           or TIMEOUT
  probe.py bulk ADDR PORT HOST BYTES       connects, waits for the greeting, then GET /bulk/BYTES:
                                           prints the ms from the request to the first byte of
                                           the answer and the MB/s of the whole download
  probe.py webflood ADDR PORT HOST COUNT   COUNT connections at once, each sending a GET for
                                           HOST and held open; prints "ok=N reset=M"
"""
import os
import random
import select
import socket
import struct
import sys
import time


def family(addr):
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def tcp(addr, port, timeout=1.5):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        data = s.recv(200)
        print(data.decode(errors="replace").strip())
        return 0 if data else 1
    except OSError as e:
        print("FAIL", e)
        return 1


def udp(addr, port, timeout=1.5, src=None):
    s = socket.socket(family(addr), socket.SOCK_DGRAM)
    if src:
        s.bind((src, 0))
    s.settimeout(timeout)
    try:
        s.sendto(b"ping", (addr, port))
        data, _ = s.recvfrom(100)
        return 0 if data == b"ping" else 1
    except OSError as e:
        print("FAIL", e)
        return 1


def send(addr, port, n):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect((addr, port))
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            b = s.recv(100)
            if not b:
                break
            data += b
        print(data.decode().strip())
        # the bytes TCP sent again (tcp_info's tcpi_bytes_retrans, at 208 since Linux 4.19): on
        # the wire, and so in the counters, beside the first copy
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        print("retrans", struct.unpack_from("=Q", info, 208)[0] if len(info) >= 216 else 0)
        return 0 if data.strip() == str(n).encode() else 1
    except OSError as e:
        print("FAIL", e)
        return 1


def query(name, qtype):
    t = {"A": 1, "AAAA": 28}[qtype]
    qid = random.randint(0, 65535)
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return qid, q + b"\0" + struct.pack("!HH", t, 1)


def dns(name, server="172.16.0.1", qtype="A"):
    qid, q = query(name, qtype)
    s = socket.socket(family(server), socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(q, (server, 53))
        r, _ = s.recvfrom(4096)
    except OSError as e:
        print("FAIL", e)
        return 1
    return show(r, qid)


def recv_all(s, n):
    out = b""
    while len(out) < n:
        d = s.recv(n - len(out))
        if not d:
            raise OSError("connection closed")
        out += d
    return out


def dnstcp(name, server="172.16.0.1", qtype="A"):
    s = socket.socket(family(server), socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((server, 53))
        for _ in range(2):
            qid, q = query(name, qtype)
            s.sendall(struct.pack("!H", len(q)) + q)
            r = recv_all(s, struct.unpack("!H", recv_all(s, 2))[0])
            if show(r, qid):
                return 1
    except OSError as e:
        print("FAIL", e)
        return 1
    return 0


def show(r, qid):
    rid, flags, qd, an = struct.unpack("!HHHH", r[:8])
    if rid != qid:
        print("FAIL bad id")
        return 1
    off = 12

    def skip_name(o):
        while True:
            n = r[o]
            if n & 0xC0 == 0xC0:
                return o + 2
            if n == 0:
                return o + 1
            o += 1 + n

    for _ in range(qd):
        off = skip_name(off) + 4
    addrs = []
    for _ in range(an):
        off = skip_name(off)
        rtype, _, _, rdlen = struct.unpack("!HHIH", r[off:off + 10])
        off += 10
        if rtype == 1:
            addrs.append(socket.inet_ntop(socket.AF_INET, r[off:off + 4]))
        elif rtype == 28:
            addrs.append(socket.inet_ntop(socket.AF_INET6, r[off:off + 16]))
        off += rdlen
    print("rcode=%d tc=%d %s" % (flags & 0xF, (flags >> 9) & 1, " ".join(addrs)))
    return 0


def stream(addr, port, seconds):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect((addr, port))
    end = time.time() + seconds
    s.setblocking(False)
    while time.time() < end:
        r, _, _ = select.select([s], [], [], 0.1)
        if r:
            try:
                d = s.recv(4096)
            except OSError:
                break
            if not d:
                break
            print("%.3f %d" % (time.time(), len(d)), flush=True)
    return 0


def nbytes(addr, port, seconds):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(2)
    total = 0
    try:
        s.connect((addr, port))
        end = time.time() + seconds
        s.settimeout(0.2)
        while time.time() < end:
            try:
                d = s.recv(65536)
            except socket.timeout:
                continue
            if not d:
                break
            total += len(d)
    except OSError as e:
        print("FAIL", e)
    print(total)
    return 0


def udpburst(addr, port, count):
    socks = []
    for _ in range(count):
        s = socket.socket(family(addr), socket.SOCK_DGRAM)
        s.setblocking(False)
        s.sendto(b"ping", (addr, port))
        socks.append(s)
    ok = set()
    end = time.time() + 1.5
    while time.time() < end and len(ok) < count:
        r, _, _ = select.select(socks, [], [], 0.1)
        for s in r:
            try:
                s.recvfrom(100)
                ok.add(s)
            except OSError:
                pass
    print(len(ok))
    return 0


def dnsflood(seconds):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    sent = refused = i = 0
    end = time.time() + seconds
    while time.time() < end:
        i += 1
        _, q = query("n%d.hole.test" % i, "A")
        try:
            s.sendto(q, ("172.16.0.1", 53))
            sent += 1
        except OSError:
            time.sleep(0.0005)
        while True:
            try:
                r = s.recv(4096)
            except OSError:
                break
            if len(r) >= 4 and r[3] & 0x0f == 5:
                refused += 1
        if i % 64 == 0:
            time.sleep(0.001)    # thousands per second, not a busy CPU
    print(sent, refused)
    return 0


def dnsburst(name, count):
    socks, ids = [], {}
    for _ in range(count):
        qid, q = query(name, "A")
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.sendto(q, ("172.16.0.1", 53))
        socks.append(s)
    ok = set()
    end = time.time() + 2
    while time.time() < end and len(ok) < count:
        r, _, _ = select.select(socks, [], [], 0.1)
        for s in r:
            try:
                s.recvfrom(4096)
                ok.add(s)
            except OSError:
                pass
    print(len(ok))
    return 0


def dnsrepeat(name, count):
    good = 0
    for _ in range(count):
        qid, q = query(name, "A")
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1)
        try:
            s.sendto(q, ("172.16.0.1", 53))
            r, _ = s.recvfrom(4096)
            if struct.unpack("!H", r[:2])[0] == qid and r[3] & 0x0f == 0:
                good += 1
        except OSError:
            pass
        s.close()
        time.sleep(0.05)
    print(good)
    return 0


def udpspray(addr, port, count):
    s = socket.socket(family(addr), socket.SOCK_DGRAM)
    sent = 0
    for _ in range(count):
        try:
            s.sendto(b"x", (addr, port))
            sent += 1
        except OSError:
            time.sleep(0.001)
    print(sent)
    return 0


def lines_until_end(s, want, deadline):
    """Reads until `want` lines arrived or the connection ended; returns (lines, end)."""
    buf = b""
    while buf.count(b"\n") < want:
        s.settimeout(max(0.1, deadline - time.time()))
        try:
            b = s.recv(4096)
        except ConnectionResetError:
            return buf.decode(errors="replace").splitlines(), "RESET"
        except socket.timeout:
            return buf.decode(errors="replace").splitlines(), "TIMEOUT"
        if not b:
            return buf.decode(errors="replace").splitlines(), "EOF"
        buf += b
    return buf.decode(errors="replace").splitlines(), None


def http(addr, port, hosts, timeout=10):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(timeout)
    deadline = time.time() + timeout
    try:
        s.connect((addr, port))
        for i, h in enumerate(hosts):
            s.sendall(b"GET /%d HTTP/1.1\r\nHost: %s\r\n\r\n" % (i, h.encode()))
            # the server greets first (one line), then answers each request with a line
            lines, end = lines_until_end(s, 2 if i == 0 else 1, deadline)
            for l in lines:
                print(l)
            if end:
                print(end)
                return 1
    except OSError as e:
        print("RESET" if isinstance(e, ConnectionResetError) else "FAIL %s" % e)
        return 1
    return 0


def tls(addr, port, sni, timeout=10):
    import ssl
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = out.read()
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((addr, port))
        # in three segments: the proxy must put the ClientHello together
        for i in range(3):
            s.sendall(hello[i * len(hello) // 3:(i + 1) * len(hello) // 3])
            time.sleep(0.05)
        lines, end = lines_until_end(s, 1, time.time() + timeout)
        for l in lines:
            print(l)
        if end:
            print(end)
        return 0 if lines else 1
    except OSError as e:
        print("RESET" if isinstance(e, ConnectionResetError) else "FAIL %s" % e)
        return 1


def httphold(addr, port, host, secs):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect((addr, port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % host.encode())
        lines, end = lines_until_end(s, 2, time.time() + 10)
        if end:
            print(end)
            return 1
        print("open", flush=True)
        lines, end = lines_until_end(s, 1, time.time() + secs)
        print(end or "DATA")
    except OSError as e:
        print("RESET" if isinstance(e, ConnectionResetError) else "FAIL %s" % e)
        return 1
    return 0


def bulk(addr, port, host, nbytes):
    s = socket.socket(family(addr), socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect((addr, port))
    s.sendall(b"GET /x HTTP/1.1\r\nHost: %s\r\n\r\n" % host.encode())
    lines_until_end(s, 2, time.time() + 30)    # greeting, host= (the path is checked now)
    t0 = time.time()
    s.sendall(b"GET /bulk/%d HTTP/1.1\r\nHost: %s\r\n\r\n" % (nbytes, host.encode()))
    got = len(s.recv(65536))
    t1 = time.time()
    want = nbytes + len("host=%s\n" % host)
    while got < want:
        b = s.recv(1 << 20)
        if not b:
            break
        got += len(b)
    t2 = time.time()
    print("%.3f %.1f %d" % ((t1 - t0) * 1000, got / (t2 - t0) / 1e6, got))
    return 0 if got == want else 1


def webflood(addr, port, host, count):
    socks = []
    for _ in range(count):
        s = socket.socket(family(addr), socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect((addr, port))
        except BlockingIOError:
            pass
        socks.append(s)
    ok = reset = 0
    deadline = time.time() + 20
    pending = list(socks)
    sent = set()
    while pending and time.time() < deadline:
        _, w, _ = select.select([], [s for s in pending if s not in sent], [], 0.2)
        for s in w:
            try:
                s.send(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % host.encode())
            except OSError:
                pass
            sent.add(s)
        r, _, _ = select.select(pending, [], [], 0.2)
        for s in r:
            try:
                b = s.recv(4096)
            except OSError:
                b = b""
            if b:
                ok += 1
            else:
                reset += 1
            pending.remove(s)
    print("ok=%d reset=%d" % (ok, reset))
    time.sleep(float(os.environ.get("PROBE_HOLD", "0")))
    return 0


def listen(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(b"guest\n")
        c.close()


def main():
    cmd, a = sys.argv[1], sys.argv[2:]
    if cmd == "http":
        return http(a[0], int(a[1]), a[2:])
    if cmd == "tls":
        return tls(a[0], int(a[1]), a[2])
    if cmd == "httphold":
        return httphold(a[0], int(a[1]), a[2], float(a[3]))
    if cmd == "bulk":
        return bulk(a[0], int(a[1]), a[2], int(a[3]))
    if cmd == "webflood":
        return webflood(a[0], int(a[1]), a[2], int(a[3]))
    if cmd == "tcp":
        return tcp(a[0], int(a[1]), float(a[2]) if len(a) > 2 else 1.5)
    if cmd == "udp":
        return udp(a[0], int(a[1]), float(a[2]) if len(a) > 2 else 1.5)
    if cmd == "udpfrom":
        return udp(a[1], int(a[2]), src=a[0])
    if cmd == "dns":
        return dns(a[0], *(a[1:3]))
    if cmd == "dnstcp":
        return dnstcp(a[0], *(a[1:3]))
    if cmd == "stream":
        return stream(a[0], int(a[1]), float(a[2]))
    if cmd == "send":
        return send(a[0], int(a[1]), int(a[2]))
    if cmd == "bytes":
        return nbytes(a[0], int(a[1]), float(a[2]))
    if cmd == "udpburst":
        return udpburst(a[0], int(a[1]), int(a[2]))
    if cmd == "dnsflood":
        return dnsflood(float(a[0]))
    if cmd == "dnsburst":
        return dnsburst(a[0], int(a[1]))
    if cmd == "dnsrepeat":
        return dnsrepeat(a[0], int(a[1]))
    if cmd == "udpspray":
        return udpspray(a[0], int(a[1]), int(a[2]))
    if cmd == "listen":
        return listen(int(a[0]))
    print("unknown command", cmd)
    return 2


if __name__ == "__main__":
    sys.exit(main())
