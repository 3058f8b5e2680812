#!/usr/bin/python3
"""Names on the wire and secrets through a real guest: an HTTPS download from a real microVM
through kiln-node's name-checking proxy, and through its injecting proxy, against the same download
with an address rule only, in one run.

Run by bench/egress/egress.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV):

  bench_egress_vm.py [MIB] [ROUNDS]

It builds the namespaces of tests/e2e/test_egress.py (a "host" holding the gateway, kiln-node and
its sandboxes, wired to an "internet"), and runs itself again inside the host one. There an HTTPS
server (tests/e2e/tlsrecord.py, Python's ssl, a certificate from a throwaway test CA that the node
trusts as its upstream store) serves GET /bulk/N on 203.0.113.20:443 under the name
tls.example.test. One sandbox (a jailed QEMU microVM, 512 MiB, 1 vCPU) downloads MIB MiB from it
with Python's ssl over a new connection each time, ROUNDS rounds, each round in three modes one
after the other:
  - "address": the rule 203.0.113.20:443 (the kernel only, no proxy);
  - "names":   the rule tls.example.test, resolved first (the connection goes through the
               name-checking proxy, which reads the SNI and then splices);
  - "inject":  the same rule and a secret bound to the host (the injecting proxy terminates the
               guest's TLS with the tenant CA's leaf, adds the header, and opens its own TLS
               connection upstream).
Per mode it prints the median time from the connect to the first byte of the answer (the TLS
handshake or handshakes included) and the median throughput of the body, then each proxy's
ratio against "address". Every figure comes from this one run, so all three modes see the same
machine and load. Everything it makes is removed at the end.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "..", "..", "tests", "e2e")
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, E2E)
import kiln  # noqa: E402
import testca  # noqa: E402
import test_egress  # noqa: E402  (the namespaces, and the TLS server's address and names)

ADDR, NAME, DNS = test_egress.TLS_ADDR, test_egress.TLS_NAME, test_egress.TLS_DNS
MODES = ("address", "names", "inject")

CLIENT = r'''
import socket, ssl, sys, time
name, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if sys.argv[4] == "resolve":
    assert addr in {a[4][0] for a in socket.getaddrinfo(name, 443)}
ctx = ssl.create_default_context()
ctx.load_verify_locations("/tmp/bench-ca.pem")
t0 = time.perf_counter()
s = ctx.wrap_socket(socket.create_connection((addr, 443), timeout=120), server_hostname=name)
s.sendall(b"GET /bulk/%d HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (n, name.encode()))
d = s.recv(1 << 20)
t1 = time.perf_counter()
head, _, body = d.partition(b"\r\n\r\n")
assert head.startswith(b"HTTP/1.1 200"), head
got = len(body)
while True:
    k = s.recv(1 << 20)
    if not k:
        break
    got += len(k)
t2 = time.perf_counter()
assert got == n, (got, n)
print("%.3f %.3f" % ((t1 - t0) * 1000, got / (t2 - t1) / 1e6))
'''


def inside(mib, rounds):
    ns = os.environ["KILN_E2E_INET_NS"]
    d = tempfile.mkdtemp(prefix="kiln-bench-egress-")
    os.chmod(d, 0o755)
    ca_key, ca = testca.make_ca("kiln bench egress CA")
    key, cert = testca.make_leaf(ca_key, ca, NAME)
    for fn, data in (("ca.pem", testca.pem_cert(ca)), ("leaf.crt", testca.pem_cert(cert)),
                     ("leaf.key", testca.pem_key(key))):
        with open(os.path.join(d, fn), "wb") as f:
            f.write(data)
    for a in (ADDR, DNS):
        subprocess.run(["ip", "-n", ns, "addr", "replace", a + "/32", "dev", "lo"], check=True)
    srv = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(E2E, "tlsrecord.py"),
                            os.devnull, DNS, "%s=%s,%s,%s" % (NAME, ADDR, os.path.join(d, "leaf.crt"),
                                                             os.path.join(d, "leaf.key"))],
                           stdout=subprocess.PIPE, text=True)
    stack = None
    try:
        assert srv.stdout.readline().strip() == "ready"
        stack = kiln.Stack(node_env={"KILN_DNS_UPSTREAM": DNS, "KILN_LOG_LEVEL": "warn",
                                     "KILN_INJECT_CA_FILE": os.path.join(d, "ca.pem")},
                           gateway_env={"KILN_LOG_LEVEL": "warn"})
        gw, auth = stack.gw, stack.tenant()
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 512, "timeout_s": 3600}, auth,
                       timeout=300)
        assert r.status == 201, r
        sb = r.json()["id"]

        def api(method, what, body):
            r = gw.request(method, f"/v1/sandboxes/{sb}/{what}", body, auth, timeout=120)
            assert r.status == 200, r

        def ex(cmd):
            r = gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": cmd, "timeout_s": 600}, auth,
                           timeout=630)
            assert r.status == 200 and r.json()["exit_code"] == 0, r
            return r.json()["stdout"]

        ex(["sh", "-c", "cat > /tmp/bench-ca.pem <<'EOF'\n%sEOF\ncat > /tmp/bench.py <<'EOF'\n%sEOF\n"
            % (testca.pem_cert(ca).decode(), CLIENT)])
        res = {m: [] for m in MODES}
        n = mib << 20
        for _ in range(rounds):
            for mode in MODES:
                api("PUT", "egress", {"rules": [ADDR + ":443"] if mode == "address" else [NAME]})
                api("PUT", "secrets", {"secrets": [{"host": NAME, "header": "X-Bench-Key",
                                                    "value": "bench-secret"}]
                                       if mode == "inject" else []})
                out = ex(["python3", "/tmp/bench.py", NAME, ADDR, str(n),
                          "direct" if mode == "address" else "resolve"])
                ttfb, mbps = (float(x) for x in out.split())
                res[mode].append((ttfb, mbps))
                print("  %-7s first byte %8.2f ms  %7.2f MB/s" % (mode, ttfb, mbps), flush=True)
        med = {m: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
               for m, v in res.items()}
        for m in MODES:
            print("%-7s first byte %8.2f ms  throughput %7.2f MB/s  (rounds: %s)" % (
                m, med[m][0], med[m][1], ", ".join("%.1f ms %.1f MB/s" % x for x in res[m])))
        for m in MODES[1:]:
            print("%s/address: throughput %.2fx, first byte %+.2f ms" % (
                m, med[m][1] / med["address"][1], med[m][0] - med["address"][0]))
        print(json.dumps({"load_average": os.getloadavg()}))
        return 0
    finally:
        if stack:
            stack.cleanup()
        srv.kill()
        srv.wait()
        subprocess.run(["rm", "-rf", d])


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if "KILN_E2E_INET_NS" in os.environ:
        return inside(mib, rounds)
    return test_egress.with_fake_internet([sys.executable, os.path.abspath(__file__), str(mib),
                                           str(rounds)])


if __name__ == "__main__":
    sys.exit(main())
