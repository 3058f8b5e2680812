"""bench/ha/place.sh's driver: creates against one and against three live nodes, alternating
round by round, and prints each configuration's median and 90th percentile per create and the
ratio of the medians (three nodes against one). Each create must be refused by its node's
absence (503), never by placement (no_capacity): a bench that placed nothing measures nothing."""
import os
import secrets
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "harness")]

import kiln  # noqa: E402

NODES = ["bench-a", "bench-b", "bench-c"]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    per = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    env = kiln.services_env()
    db = kiln.fresh_database()
    # Rate limits out of the way: the bench measures the work, not the limiter's refusals.
    gw = kiln.Gateway(db.url, env["KILN_REDIS_URL"], {
        "KILN_RATE_LIMIT_RPS": "1000000", "KILN_RATE_LIMIT_BURST": "1000000",
        "KILN_TENANT_RATE_LIMIT_RPS": "1000000", "KILN_TENANT_RATE_LIMIT_BURST": "1000000",
        "KILN_CREATE_LIMIT_RPM": "1000000", "KILN_TENANT_CREATE_LIMIT_RPM": "1000000"})
    try:
        admin = {"Authorization": "Bearer " + gw.admin_key}
        r = gw.request("POST", "/v1/tenants", {"name": "bench"}, admin)
        assert r.status == 201, r
        key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        # The nodes' other load: another tenant's (the bench's tenant stays within its plan).
        r = gw.request("POST", "/v1/tenants", {"name": "load"}, admin)
        assert r.status == 201, r
        tenant = db.sql("SELECT id FROM tenants WHERE name = 'load'")
        for n in NODES:
            db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
                   f"accelerator, image_hash, disk_gib) VALUES ('{n}', 'unix:/nonexistent/{n}.sock', "
                   "512000, 1048576, 1000, 'qemu', 'tcg', 'x', 100000)")
        db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
               "disk_gib, timeout_s, expires_at) SELECT 'sb_bench' || i, "
               f"'{tenant}', (ARRAY['bench-a','bench-b','bench-c'])[1 + i % 3], "
               "CASE WHEN i % 4 = 0 THEN 'paused' ELSE 'running' END, 'python', 1000, 256, 1, 3600, "
               "now() + interval '1 hour' FROM generate_series(1, 300) i")
        times = {1: [], 3: []}
        for rnd in range(rounds):
            for count in ((1, 3) if rnd % 2 == 0 else (3, 1)):
                # The nodes' heartbeats; the ones left out of this configuration draining.
                db.sql("UPDATE nodes SET heartbeat_at = now(), down_at = NULL, drain_at = CASE WHEN id = "
                       f"ANY (ARRAY{NODES[:count]!r}) THEN NULL ELSE now() END")
                for _ in range(per):
                    t0 = time.perf_counter()
                    r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, key)
                    times[count].append(time.perf_counter() - t0)
                    if r.status != 503 or r.json()["error"]["code"] != "unavailable":
                        print(f"a create answered {r.status}: {r.data[:300]!r}", file=sys.stderr)
                        sys.exit(1)
        med = {}
        for count in (1, 3):
            t = sorted(times[count])
            med[count] = statistics.median(t)
            print(f"{count} node(s): {len(t)} creates, median {med[count] * 1000:.2f} ms, "
                  f"p90 {t[int(len(t) * 0.9)] * 1000:.2f} ms")
        print(f"three nodes against one: {med[3] / med[1]:.3f}x (aim <= 1.1x)")
    finally:
        gw.cleanup()
        db.drop()


if __name__ == "__main__":
    main()
