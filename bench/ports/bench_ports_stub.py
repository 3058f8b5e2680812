"""bench_ports_stub.py - what the gateway and the node add to a request through a port URL, against
the same HTTP server reached directly, with no VM in the path.

Run by bench/ports/stub.sh (which starts the throwaway Postgres and Redis and sets KILN_BUILD_DIR
and KILN_SERVICES_ENV). A real kiln-gateway (its ports listener) and kiln-node whose sandbox's
guest is the node's hostagent hook (docs/vmm.md): the build's own kiln-agent run on the host,
on the agent channel's socket, so a request goes client -> gateway -> node -> agent channel ->
kiln-agent -> the HTTP server, and nothing in it waits for a guest's CPU. The server
(tests/harness/portserver.py, a Python ThreadingHTTPServer on the host's 127.0.0.1) answers
GET / with 13 bytes.

1. Latency: REQUESTS triples of GETs, each on a new connection, timed from connect to the
   reply's end: one straight to the server, one through the port URL with the tenant's API key,
   one through the port URL of the port made public (no credential to check), interleaved (which
   goes first rotates too), so all see the same moments of the machine; and a fourth, kiln-node's
   own stream route with a node token as the gateway opens it (bypassing the gateway: the
   node's and the agent's share of the added time).
2. Throughput: ROUNDS rounds of REQUESTS/ROUNDS GETs from CONCURRENCY client threads at once on
   each of the three paths, rotating by round.
The added p50 is the difference of the two p50s; the figures are all of this run.

usage: bench_ports_stub.py [REQUESTS] [CONCURRENCY]
"""
import os
import socket
import subprocess
import sys
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
import kiln  # noqa: E402
import portserver as ps  # noqa: E402
from portbench import burst, pct  # noqa: E402

ROUNDS = 10


def timed(addr, head):
    t = time.perf_counter()
    s = socket.create_connection(addr)
    s.sendall(head)
    d = ps.recv_all(s)
    s.close()
    assert d.startswith(b"HTTP/1.1 200") and d.endswith(ps.HELLO), d[:200]
    return time.perf_counter() - t


def node_timed(sock, sb, port, token):
    """One GET through kiln-node's own stream route (Upgrade: kiln-port, a node token), as the
    gateway opens it: the node's and the agent's part without the gateway's."""
    t = time.perf_counter()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock)
    s.sendall((f"GET /v1/sandboxes/{sb}/ports/{port}/stream HTTP/1.1\r\nHost: node\r\n"
               f"Connection: Upgrade\r\nUpgrade: kiln-port\r\nAuthorization: Bearer {token}\r\n\r\n"
               ).encode())
    status, head, rest = ps.read_head(s)
    assert status == 101, head
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    d = ps.recv_all(s, rest)
    s.close()
    assert d.endswith(ps.HELLO), d[:200]
    return time.perf_counter() - t


def node_token(stack, tenant_id, sb):
    env = dict(os.environ, KILN_DATABASE_URL=stack.db.url, KILN_MASTER_KEY=stack.gw.master_key)
    return subprocess.run([os.path.join(kiln.BUILD, "tests", "e2e", "kiln-test-nodetoken"),
                           tenant_id, sb], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    conc = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    stack = kiln.Stack(hostagent=True, node_env={"KILN_LOG_LEVEL": "warn"},
                       gateway_env={"KILN_LOG_LEVEL": "warn",
                                    "KILN_PORT_STREAMS_MAX_PER_TENANT": "256"})
    srv = ps.serve()
    try:
        gw = stack.gw
        r = gw.request("POST", "/v1/tenants", {"name": "bench-ports-stub"}, stack.admin)
        tenant_id = r.json()["tenant"]["id"]
        auth = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = gw.request("POST", "/v1/sandboxes", {}, auth, timeout=60)
        assert r.status == 201, r
        sb = r.json()["id"]
        port = srv.server_address[1]
        url = urllib.parse.urlparse(gw.request("GET", f"/v1/sandboxes/{sb}/ports/{port}",
                                               headers=auth).json()["url"])
        paths = {
            "direct": (("127.0.0.1", port),
                       f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()),
            "port URL": (("127.0.0.1", url.port),
                         (f"GET / HTTP/1.1\r\nHost: {url.netloc}\r\n"
                          f"Authorization: {auth['Authorization']}\r\n\r\n").encode()),
            "port URL, public": (("127.0.0.1", url.port),
                                 f"GET / HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode()),
        }
        r = gw.request("PUT", f"/v1/sandboxes/{sb}/ports/{port}/public", None, auth)
        assert r.status == 200, r
        names = list(paths)
        token = [node_token(stack, tenant_id, sb)]
        one = {k: (lambda k=k: timed(*paths[k])) for k in names}
        one["node stream"] = lambda: node_timed(stack.node.sock, sb, port, token[0])
        for _ in range(50):  # warm-up of every path
            for k in one:
                one[k]()
        lat = {k: [] for k in one}
        wall = dict.fromkeys(one, 0.0)
        seq = list(one)
        for i in range(n):
            if i % 200 == 199:  # node tokens live 60 s
                token[0] = node_token(stack, tenant_id, sb)
            for k in seq[i % len(seq):] + seq[:i % len(seq)]:
                x = one[k]()
                lat[k].append(x)
                wall[k] += x
        clat = {k: [] for k in names}
        cwall = dict.fromkeys(names, 0.0)
        for i in range(ROUNDS):
            for k in names[i % 3:] + names[:i % 3]:
                ls, w = burst(lambda: timed(*paths[k]), n // ROUNDS, conc)
                clat[k] += ls
                cwall[k] += w
        ms = 1000
        print(f"{'path':<40} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
        for k in seq:
            print(f"{k + ', sequential':<40} {n / wall[k]:8.0f} "
                  f"{pct(lat[k], .5) * ms:8.3f} {pct(lat[k], .99) * ms:8.3f}")
        for k in names:
            print(f"{f'{k}, {conc} at once':<40} {len(clat[k]) / cwall[k]:8.0f} "
                  f"{pct(clat[k], .5) * ms:8.3f} {pct(clat[k], .99) * ms:8.3f}")
        print(f"added p50 by the node and the agent alone (node stream, sequential): "
              f"{(pct(lat['node stream'], .5) - pct(lat['direct'], .5)) * ms:.3f} ms")
        for k in names[1:]:
            print(f"added p50 by the gateway and the node, {k} (sequential): "
                  f"{(pct(lat[k], .5) - pct(lat['direct'], .5)) * ms:.3f} ms (aim <= 2 ms); "
                  f"added p99: {(pct(lat[k], .99) - pct(lat['direct'], .99)) * ms:.3f} ms")
        print(f"ratio of req/s through the port URL to direct: sequential "
              f"{wall['direct'] / wall['port URL']:.2f}, {conc} at once "
              f"{(len(clat['port URL']) / cwall['port URL']) / (len(clat['direct']) / cwall['direct']):.2f}")
    finally:
        srv.shutdown()
        srv.server_close()
        stack.cleanup()


if __name__ == "__main__":
    main()
