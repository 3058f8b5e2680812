"""bench_inject.py - throughput and time to first byte of an HTTPS download through the injecting
proxy (inject_serve on loopback) against the same download straight from the TLS server, rounds
interleaved in one run. curl does the downloads; the server is Python's, serving MIB MiB from
memory (the same server both ways, so its own cost cancels out of the ratio). With --serve-base,
a second injector (say, a build from before a change) is measured in the same rounds too.
"""
import argparse
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import http.server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "integration",
                                "inject"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "harness"))
from test_inject import make_ca, make_leaf, pem_cert, pem_key  # noqa: E402

HOST = "api.test"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", required=True)
    ap.add_argument("--serve-base", help="another inject_serve, measured alongside")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    body = os.urandom(1 << 20) * a.mib

    class Big(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            view = memoryview(body)
            for i in range(0, len(body), 1 << 18):
                self.wfile.write(view[i:i + (1 << 18)])

    with tempfile.TemporaryDirectory(prefix="kiln-bench-inject-") as d:
        ca_key, ca = make_ca("bench CA")
        key, cert = make_leaf(ca_key, ca, HOST)
        paths = {n: os.path.join(d, n) for n in ("ca.pem", "srv.crt", "srv.key", "tenant.pem")}
        for n, data in (("ca.pem", pem_cert(ca)), ("srv.crt", pem_cert(cert)),
                        ("srv.key", pem_key(key))):
            with open(paths[n], "wb") as f:
                f.write(data)
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Big)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(paths["srv.crt"], paths["srv.key"])
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        up = httpd.server_address[1]
        procs, ways = [], {"direct": (up, paths["ca.pem"])}
        for name, serve in (("inject", a.serve), ("base", a.serve_base)):
            if not serve:
                continue
            out = os.path.join(d, name + ".pem")
            procs.append(subprocess.Popen([serve, "--host", HOST, "--upstream", str(up),
                                           "--ca-file", paths["ca.pem"], "--ca-out", out,
                                           "--secret", HOST, "Authorization", "Bearer bench"],
                                          stdout=subprocess.PIPE, text=True))
            ways[name] = (int(procs[-1].stdout.readline()), out)
        res = {w: {"mbps": [], "ttfb_ms": []} for w in ways}
        try:
            for _ in range(a.rounds):
                for w, (p, cafile) in ways.items():
                    out = subprocess.run(
                        ["curl", "-sS", "-o", "/dev/null", "--http1.1", "--cacert", cafile,
                         "--connect-to", f"{HOST}:443:127.0.0.1:{p}",
                         "-w", "%{time_starttransfer} %{speed_download}", f"https://{HOST}/"],
                        capture_output=True, text=True, check=True, timeout=600).stdout.split()
                    res[w]["ttfb_ms"].append(float(out[0]) * 1000)
                    res[w]["mbps"].append(float(out[1]) * 8 / 1e6)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            httpd.shutdown()
    med = {w: {k: statistics.median(v) for k, v in r.items()} for w, r in res.items()}
    for w in ways:
        print(f"{w:7s} throughput median {med[w]['mbps']:8.0f} Mbit/s "
              f"(runs {', '.join('%.0f' % x for x in res[w]['mbps'])}); "
              f"first byte median {med[w]['ttfb_ms']:6.2f} ms "
              f"(runs {', '.join('%.2f' % x for x in res[w]['ttfb_ms'])})")
    for w in ways:
        if w != "direct":
            print(f"{w}/direct throughput {med[w]['mbps'] / med['direct']['mbps']:.2f}x; "
                  f"first byte +{med[w]['ttfb_ms'] - med['direct']['ttfb_ms']:.2f} ms")


if __name__ == "__main__":
    main()
