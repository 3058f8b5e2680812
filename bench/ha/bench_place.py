"""bench/ha/place.sh's driver: creates against one and against three live kiln-node processes,
alternating round by round, and prints each configuration's median and 90th percentile per
create and the ratio of the medians (three nodes against one).

The nodes are real kiln-node processes with the `hostagent` hook (docs/vmm.md: each sandbox's
guest is the build's kiln-agent run on the host), so a create is the whole control plane: the
gateway's checks and admission, the placement statement, the node's admission and records in
Postgres, its network namespace, disk layer, cgroup and jail, and the agent's HELLO, with no VM
to boot. A configuration's left-out nodes are marked draining (out of placement). Each sandbox
is deleted after its create (not timed). Another tenant's 300 sandboxes, recorded paused on the
nodes, are what the placement statement aggregates besides. Every create must succeed (201)."""
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "harness")]

import kiln  # noqa: E402

# Room for every sandbox the bench and its load record, on every node.
NODE_ENV = {"KILN_NODE_MAX_SANDBOXES": "1000", "KILN_NODE_VCPU_MILLI": "512000",
            "KILN_NODE_MEMORY_MIB": "1048576", "KILN_NODE_DISK_GIB": "100000", "KILN_LOG_LEVEL": "info"}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    per = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    env = kiln.services_env()
    db = kiln.fresh_database()
    # Rate limits out of the way: the bench measures the work, not the limiter's refusals.
    gw = kiln.Gateway(db.url, env["KILN_REDIS_URL"], {
        "KILN_RATE_LIMIT_RPS": "1000000", "KILN_RATE_LIMIT_BURST": "1000000",
        "KILN_TENANT_RATE_LIMIT_RPS": "1000000", "KILN_TENANT_RATE_LIMIT_BURST": "1000000",
        "KILN_CREATE_LIMIT_RPM": "1000000", "KILN_TENANT_CREATE_LIMIT_RPM": "1000000",
        "KILN_LOG_LEVEL": "info"})
    nodes = []
    try:
        nodes = [kiln.Node(db.url, gw.url, dict(NODE_ENV, KILN_MASTER_KEY=gw.master_key), hostagent=True)
                 for _ in range(3)]
        ids = [n.node_id for n in nodes]
        admin = {"Authorization": "Bearer " + gw.admin_key}
        r = gw.request("POST", "/v1/tenants", {"name": "bench"}, admin)
        assert r.status == 201, r
        key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        # The nodes' other load: another tenant's paused sandboxes (the bench's tenant stays
        # within its plan).
        r = gw.request("POST", "/v1/tenants", {"name": "load"}, admin)
        assert r.status == 201, r
        tenant = db.sql("SELECT id FROM tenants WHERE name = 'load'")
        db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
               "disk_gib, timeout_s, expires_at) SELECT 'sb_bench' || i, "
               f"'{tenant}', (ARRAY{ids!r})[1 + i % 3], 'paused', 'python', 1000, 256, 1, 3600, "
               "now() + interval '1 hour' FROM generate_series(1, 300) i")
        times = {1: [], 3: []}
        for rnd in range(rounds):
            for count in ((1, 3) if rnd % 2 == 0 else (3, 1)):
                db.sql(f"UPDATE nodes SET drain_at = CASE WHEN id = ANY (ARRAY{ids[:count]!r}) THEN NULL "
                       "ELSE now() END")
                for _ in range(per):
                    t0 = time.perf_counter()
                    r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, key, timeout=60)
                    times[count].append(time.perf_counter() - t0)
                    if r.status != 201:
                        print(f"a create answered {r.status}: {r.data[:300]!r}", file=sys.stderr)
                        sys.exit(1)
                    sb = r.json()["id"]
                    r = gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=key, timeout=60)
                    if r.status != 204:
                        print(f"a delete answered {r.status}: {r.data[:300]!r}", file=sys.stderr)
                        sys.exit(1)
        med = {}
        for count in (1, 3):
            t = sorted(times[count])
            med[count] = statistics.median(t)
            print(f"{count} node(s): {len(t)} creates, median {med[count] * 1000:.2f} ms, "
                  f"p90 {t[int(len(t) * 0.9)] * 1000:.2f} ms")
        print(f"three nodes against one: {med[3] / med[1]:.3f}x (aim <= 1.1x)")
    finally:
        for n in nodes:
            n.cleanup()
        gw.cleanup()
        db.drop()


if __name__ == "__main__":
    main()
