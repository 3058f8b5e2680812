"""The slowloris benchmark (see slowloris.sh): SECONDS of CONNS slow connections from 127.0.0.1
against authenticated routes; a client on 127.0.0.2 must keep being served."""
import os
import resource
import selectors
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "harness"))
import kiln  # noqa: E402

BOUND_S = 2.0
RSS_GROWTH_MAX_KIB = 64 * 1024


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def good_request(port, key):
    s = socket.socket()
    s.settimeout(10)
    s.bind(("127.0.0.2", 0))
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET /v1/api-keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    except OSError:
        return 0
    finally:
        s.close()


def main():
    seconds, conns = int(sys.argv[1]), int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, conns * 2 + 256)), hard))
    env = kiln.services_env()
    db = kiln.fresh_database()
    gw = kiln.Gateway(db.url, env["KILN_REDIS_URL"],
                      {"KILN_LOG_LEVEL": "warn", "KILN_RATE_LIMIT_RPS": "100000",
                       "KILN_RATE_LIMIT_BURST": "100000"})
    try:
        key = gw.admin_key
        line = (f"GET /v1/api-keys HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                "X-Pad: " + "a" * 64 + "\r\n\r\n").encode()
        for _ in range(20):
            good_request(gw.port, key)
        before = rss_kib(gw.proc.pid)
        sel = selectors.DefaultSelector()
        attack = {}  # socket -> bytes of `line` sent
        stats = {"opened": 0, "refused_429": 0, "closed": 0}

        def open_one():
            s = socket.socket()
            s.setblocking(False)
            s.bind(("127.0.0.1", 0))
            s.connect_ex(("127.0.0.1", gw.port))
            attack[s] = 0
            sel.register(s, selectors.EVENT_READ)
            stats["opened"] += 1

        def drop(s):
            sel.unregister(s)
            del attack[s]
            s.close()

        for _ in range(conns):
            open_one()
        latencies, failures = [], 0
        t_end = time.time() + seconds
        next_drip = 0.0
        while time.time() < t_end:
            now = time.time()
            for k, _ in sel.select(timeout=0):
                s = k.fileobj
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if data.startswith(b"HTTP/1.1 429"):
                    stats["refused_429"] += 1
                else:
                    stats["closed"] += 1
                drop(s)
            while len(attack) < conns:  # the attack never lets up
                open_one()
            if now >= next_drip:
                next_drip = now + 1
                for s, sent in list(attack.items()):
                    if sent < len(line) - 1:  # never the last byte
                        try:
                            s.send(line[sent:sent + 1])
                            attack[s] = sent + 1
                        except OSError:
                            pass
            t0 = time.time()
            status = good_request(gw.port, key)
            latencies.append(time.time() - t0)
            if status != 200:
                failures += 1
            time.sleep(0.1)
        for s in list(attack):
            drop(s)
        time.sleep(1)
        after = rss_kib(gw.proc.pid)
        latencies.sort()
        pct = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000
        print(f"{conns} slow connections from 127.0.0.1 for {seconds} s: {stats['opened']} opened, "
              f"{stats['refused_429']} answered 429, {stats['closed']} closed by a deadline")
        print(f"127.0.0.2, GET /v1/api-keys: {len(latencies)} requests, {failures} failed, "
              f"p50 {pct(0.5):.1f} ms, p99 {pct(0.99):.1f} ms, max {latencies[-1] * 1000:.1f} ms")
        print(f"gateway RSS: {before} KiB before, {after} KiB after")
        ok = failures == 0 and latencies[-1] < BOUND_S and after - before < RSS_GROWTH_MAX_KIB
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        gw.cleanup()
        db.drop()


if __name__ == "__main__":
    sys.exit(main())
