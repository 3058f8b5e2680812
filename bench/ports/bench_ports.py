"""bench_ports.py - a sandbox's HTTP server through its port URL against from inside the guest.

Run by bench/ports/ports.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). One sandbox (a jailed QEMU microVM, 512 MiB, 1 vCPU) runs
a Python ThreadingHTTPServer on 127.0.0.1:8000 answering GET / with 13 bytes.

1. Inside the guest (the baseline): REQUESTS sequential GETs, each on a new connection, timed
   one by one (an exec of a Python client in the guest).
2. Through the port URL from the host: the same REQUESTS sequential GETs with the tenant's API
   key, each on a new connection (the listener carries one request per connection), timed from
   connect to the reply's end.
3. Throughput: REQUESTS GETs through the port URL from CONCURRENCY client threads at once.
4. Auto-resume, WAKES times each, interleaved: pause, then POST .../resume timed until its 200
   and a first request through the port URL; pause again, then a request through the port URL
   with auto_resume on, timed from sending to its first byte (the resume included).
Every figure is of this run, so both paths see the same machine and load; the added p50 is the
difference of the two p50s.

usage: bench_ports.py [REQUESTS] [CONCURRENCY]
"""
import json
import os
import socket
import statistics
import sys
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
import kiln  # noqa: E402
from portbench import burst, pct  # noqa: E402

WAKES = 3

SERVER = r'''
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "13")
        self.end_headers()
        self.wfile.write(b"hello, ports\n")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), H).serve_forever()
'''

GUEST_CLIENT = r'''
import json, socket, sys, time
n = int(sys.argv[1])
lat = []
t0 = time.perf_counter()
for _ in range(n):
    t = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", 8000))
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    d = b""
    while True:
        k = s.recv(65536)
        if not k:
            break
        d += k
    s.close()
    assert d.endswith(b"hello, ports\n"), d
    lat.append(time.perf_counter() - t)
print(json.dumps({"lat": lat, "wall": time.perf_counter() - t0}))
'''


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    conc = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    stack = kiln.Stack(node_env={"KILN_LOG_LEVEL": "warn"},
                       gateway_env={"KILN_LOG_LEVEL": "warn",
                                    "KILN_PORT_STREAMS_MAX_PER_TENANT": "256"})
    try:
        gw = stack.gw
        r = gw.request("POST", "/v1/tenants", {"name": "bench-ports"}, stack.admin)
        key = r.json()["api_key"]["key"]
        auth = {"Authorization": "Bearer " + key}
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 512}, auth, timeout=300)
        assert r.status == 201, r
        sb = r.json()["id"]

        def ex(cmd):
            r = gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": cmd}, auth, timeout=600)
            assert r.status == 200 and r.json()["exit_code"] == 0, r
            return r.json()["stdout"]

        ex(["python3", "-c", f"open('/root/srv.py', 'w').write({SERVER!r})"])
        ex(["sh", "-c", "nohup python3 /root/srv.py >/dev/null 2>&1 &"])
        ex(["python3", "-c", "import socket, time\nfor i in range(600):\n  try:\n"
            "    socket.create_connection(('127.0.0.1', 8000)).close(); break\n"
            "  except OSError: time.sleep(0.1)\n"])
        url = urllib.parse.urlparse(gw.request("GET", f"/v1/sandboxes/{sb}/ports/8000",
                                               headers=auth).json()["url"])
        req = (f"GET / HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n\r\n"
               ).encode()

        def one():
            t = time.perf_counter()
            s = socket.create_connection(("127.0.0.1", url.port))
            s.sendall(req)
            d = b""
            while True:
                k = s.recv(65536)
                if not k:
                    break
                d += k
            s.close()
            assert d.endswith(b"hello, ports\n"), d[:200]
            return time.perf_counter() - t

        for _ in range(20):  # warm-up of both paths
            one()
        ex(["python3", "-c", GUEST_CLIENT, "20"])
        guest = json.loads(ex(["python3", "-c", GUEST_CLIENT, str(n)]))
        t0 = time.perf_counter()
        host = [one() for _ in range(n)]
        host_wall = time.perf_counter() - t0
        lat_c, conc_wall = burst(one, n, conc)
        wakes, resumes = [], []
        gw.request("PATCH", f"/v1/sandboxes/{sb}", {"auto_resume": True}, auth)
        for _ in range(WAKES):
            assert gw.request("POST", f"/v1/sandboxes/{sb}/pause", None, auth, timeout=600).status == 200
            t = time.perf_counter()
            r = gw.request("POST", f"/v1/sandboxes/{sb}/resume", None, auth, timeout=600)
            assert r.status == 200, r
            resumes.append(time.perf_counter() - t)
            one()
            assert gw.request("POST", f"/v1/sandboxes/{sb}/pause", None, auth, timeout=600).status == 200
            s = socket.create_connection(("127.0.0.1", url.port), timeout=600)
            t = time.perf_counter()
            s.sendall(req)
            assert s.recv(65536).startswith(b"HTTP/1.0 200")
            wakes.append(time.perf_counter() - t)
            s.close()
        ms = 1000
        print(f"{'path':<46} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
        print(f"{'inside the guest, sequential':<46} {n / guest['wall']:8.0f} "
              f"{pct(guest['lat'], .5) * ms:8.2f} {pct(guest['lat'], .99) * ms:8.2f}")
        print(f"{'port URL from the host, sequential':<46} {n / host_wall:8.0f} "
              f"{pct(host, .5) * ms:8.2f} {pct(host, .99) * ms:8.2f}")
        print(f"{f'port URL from the host, {conc} at once':<46} {n / conc_wall:8.0f} "
              f"{pct(lat_c, .5) * ms:8.2f} {pct(lat_c, .99) * ms:8.2f}")
        print(f"added p50 (port URL - inside the guest): "
              f"{(pct(host, .5) - pct(guest['lat'], .5)) * ms:.2f} ms; "
              f"ratio of sequential req/s: {(n / host_wall) / (n / guest['wall']):.2f}")
        print(f"resume (POST .../resume until 200), median of {WAKES}: "
              f"{statistics.median(resumes):.2f} s; auto-resume, request to first byte: "
              f"{statistics.median(wakes):.2f} s; ratio "
              f"{statistics.median(wakes) / statistics.median(resumes):.2f}")
    finally:
        stack.cleanup()


if __name__ == "__main__":
    main()
