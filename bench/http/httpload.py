"""httpload.py - authenticated load on kiln-gateway, shared by bench/http/load.sh (the long form)
and tests/integration/foundation/test_load.py (the short form).

run() starts a gateway on a database of its own (Postgres and Redis from KILN_SERVICES_ENV), makes
ATTACK_TENANTS tenants with two API keys and one ES256 token each and a paused sandbox row each,
and a well-behaved tenant with one key; then bench-load (bench/http/load.c) holds CONNS keep-alive
connections from 127.0.1.x (PER_ADDR each, under http_max_connections_per_addr) sending those
credentials' requests back to back over a mix of routes, while the well-behaved tenant calls from
127.0.0.2 at GOOD_RPS, within its rate limit. The gateway's RSS, threads and fds are sampled every
second by bench-load; its Postgres and Redis connections (Unix sockets matched to its fds through
`ss -x`) every second here. check() turns the figures into failures.
"""
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "harness"))
import kiln  # noqa: E402

ATTACK_TENANTS = 8
PER_ADDR = 25          # under the gateway's http_max_connections_per_addr (32)
BASE_ADDR = "127.0.1.1"
GOOD_ADDR = "127.0.0.2"
GOOD_RPS = 5           # under rate_limit_rps (50)
GOOD_P99_MS = 2000
RSS_GROWTH_MAX = 0.10  # after warm-up, of the RSS at the end of warm-up
RSS_GROWTH_MIN_KIB = 8 * 1024  # ... but never a bound below 8 MiB

# The attackers' requests: "METHOD PATH [BODY]"; {sb} is the credential's tenant's sandbox.
REQUESTS = [
    "GET /v1/sandboxes",
    "GET /v1/sandboxes/sb_00000000deadbeef",
    "GET /v1/sandboxes/{sb}",
    "GET /v1/usage",
    "GET /v1/billing/balance",
    'POST /v1/sandboxes {"vcpus":1000,"memory_mib":512}',
    'POST /v1/api-keys {"name":7}',
    "GET /v1/api-keys",
]
GOOD_REQUESTS = ["GET /v1/api-keys", "GET /v1/sandboxes", "GET /v1/usage"]


def bench_binary():
    return os.path.join(kiln.BUILD, "bench", "bench-load")


def _socket_inodes(pid):
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def service_connections(pid, pg_sock, redis_sock):
    """(Postgres, Redis) connections process `pid` holds: the peers of the servers' Unix sockets
    that are among its fds."""
    mine = _socket_inodes(pid)
    pg = redis = 0
    out = subprocess.run(["ss", "-xH"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        local, peer_inode = f[4], f[7]
        if peer_inode in mine:
            if local == pg_sock:
                pg += 1
            elif local == redis_sock:
                redis += 1
    return pg, redis


def _tenant(gw, admin, name, with_jwt):
    """A tenant's credentials: [(token, sandbox id)], and its id."""
    r = gw.request("POST", "/v1/tenants", {"name": name}, admin)
    assert r.status == 201, r
    tid, key = r.json()["tenant"]["id"], r.json()["api_key"]["key"]
    h = {"Authorization": f"Bearer {key}"}
    creds = [key]
    if with_jwt:
        r = gw.request("POST", "/v1/api-keys", {"name": "second", "scopes": [
            "sandbox:read", "sandbox:write", "billing:read", "keys:write"]}, h)
        assert r.status == 201, r
        creds.append(r.json()["key"])
        r = gw.request("POST", "/v1/tokens", {"ttl_s": 900}, h)
        assert r.status == 201, r
        creds.append(r.json()["token"])
    return tid, creds


def run(seconds, conns, gateway_env=None, log=print):
    """Runs the load; returns the figures (bench-load's JSON plus "services": [(t, pg, redis)],
    "baseline": the gateway's fds/threads/pg/redis before, "pg_pool" and "after")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < conns + 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, conns + 2048), hard))
    env = kiln.services_env()
    db = kiln.fresh_database()
    genv = {"KILN_LOG_LEVEL": "warn"}
    # Under AddressSanitizer (make test) every thread keeps 1 MiB of freed memory in its own
    # quarantine and the process 256 MiB more: with a thousand connection threads that alone
    # grows the RSS by a gigabyte. Small quarantines keep the RSS a measure of the gateway's own
    # memory (use-after-free is still caught within them). Without ASan this changes nothing.
    asan = os.environ.get("ASAN_OPTIONS", "")
    genv["ASAN_OPTIONS"] = (asan + ":" if asan else "") + \
        "quarantine_size_mb=16:thread_local_quarantine_size_kb=16"
    # The limits under test may be set from outside (KILN_TENANT_MAX_IN_FLIGHT=8 bash load.sh ...).
    genv.update({k: v for k, v in os.environ.items()
                 if k.startswith("KILN_TENANT_") or k.startswith("KILN_RATE_")})
    genv.update(gateway_env or {})
    gw = kiln.Gateway(db.url, env["KILN_REDIS_URL"], genv)
    tmp = tempfile.mkdtemp(prefix="kiln-load-")
    pg_sock = os.path.join(env["KILN_TEST_SOCKDIR"], ".s.PGSQL.5432")
    redis_sock = env["KILN_REDIS_URL"][len("unix:"):]
    try:
        admin = {"Authorization": f"Bearer {gw.admin_key}"}
        db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor,"
               " accelerator, image_hash, heartbeat_at) VALUES ('load', 'unix:/nonexistent', 1000,"
               " 1024, 1, 'qemu', 'tcg', '', now())")
        lines = []
        for i in range(ATTACK_TENANTS):
            tid, creds = _tenant(gw, admin, f"load-{i}", True)
            sb = "sb_" + secrets.token_hex(8)
            db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli,"
                   " memory_mib, disk_gib, timeout_s, expires_at, state_changed_at) VALUES"
                   f" ('{sb}', '{tid}', 'load', 'paused', 'python', 1000, 256, 1, 300,"
                   " now() + interval '1 hour', now())")
            lines += [f"{c} {sb}" for c in creds]
        _, good_creds = _tenant(gw, admin, "well-behaved", False)
        good = good_creds[0]
        # A real object of the attackers' answers 200 (checked before the load).
        tok, sb = lines[0].split()
        r = gw.request("GET", f"/v1/sandboxes/{sb}", None, {"Authorization": f"Bearer {tok}"})
        assert r.status == 200 and r.json()["state"] == "paused", r
        paths = {}
        for name, content in (("creds", lines), ("reqs", REQUESTS), ("good", GOOD_REQUESTS)):
            paths[name] = os.path.join(tmp, name)
            with open(paths[name], "w") as f:
                f.write("\n".join(content) + "\n")
        for _ in range(10):  # the gateway's first requests (caches, pool) before the baseline
            gw.request("GET", "/v1/api-keys", None, {"Authorization": f"Bearer {good}"})
        time.sleep(1)
        pid = gw.proc.pid
        base_pg, base_redis = service_connections(pid, pg_sock, redis_sock)
        baseline = {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": _threads(pid),
                    "pg": base_pg, "redis": base_redis}
        services, stop = [], threading.Event()

        def watch():
            t0 = time.time()
            while not stop.wait(1):
                services.append((round(time.time() - t0, 1),) +
                                service_connections(pid, pg_sock, redis_sock))

        watcher = threading.Thread(target=watch)
        watcher.start()
        log(f"load: {conns} connections for {seconds} s from {BASE_ADDR} on, "
            f"{ATTACK_TENANTS} tenants, {len(lines)} credentials; well-behaved client on "
            f"{GOOD_ADDR} at {GOOD_RPS}/s")
        try:
            out = subprocess.run(
                [bench_binary(), "-p", str(gw.port), "-c", str(conns), "-d", str(seconds),
                 "-b", BASE_ADDR, "-P", str(PER_ADDR), "-k", paths["creds"], "-r", paths["reqs"],
                 "-g", GOOD_ADDR, "-K", good, "-R", paths["good"], "-q", str(GOOD_RPS),
                 "-w", str(pid)],
                capture_output=True, text=True, timeout=seconds + 120)
        finally:
            stop.set()
            watcher.join()
        if out.returncode != 0:
            raise AssertionError(f"bench-load failed ({out.returncode}): {out.stderr}")
        res = json.loads(out.stdout)
        res["services"] = services
        res["baseline"] = baseline
        # The main pool (db_pool_size) and the audit trail's (GW_AUDIT_POOL, 4).
        res["pg_pool"] = int(genv.get("KILN_DB_POOL_SIZE", 8)) + 4
        res["gateway_alive"] = gw.alive()
        # After: the same well-behaved request still answers, and what the load held is let go.
        r = gw.request("GET", "/v1/api-keys", None, {"Authorization": f"Bearer {good}"})
        res["after_status"] = r.status
        deadline = time.time() + 15
        while True:
            after_pg, after_redis = service_connections(pid, pg_sock, redis_sock)
            res["after"] = {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": _threads(pid),
                            "pg": after_pg, "redis": after_redis}
            if (_own_fds(res["after"]) <= _own_fds(baseline) + 2 and
                    res["after"]["threads"] <= baseline["threads"] + 2) or time.time() > deadline:
                break
            time.sleep(0.5)
        res["gateway_alive"] = res["gateway_alive"] and gw.alive()
        # A clean stop, and under AddressSanitizer no leak (LeakSanitizer fails the exit).
        res["exit_code"] = gw.stop()
        res["gateway_log_tail"] = gw.output()[-3000:]
        return res
    finally:
        gw.cleanup()
        db.drop()
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def _pct(sorted_values, p):
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def ramp_s(res):
    """Seconds from the start until the gateway held (a thread for) every connection."""
    for s in res["samples"]:
        if s["threads"] >= res["conns"]:
            return s["t"]
    return res["seconds"]


def _own_fds(figures):
    """The gateway's fds that are not its Postgres and Redis connections (pools open lazily)."""
    return figures["fds"] - figures["pg"] - figures["redis"]


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def warmup_end(res, warmup_s):
    """When the RSS is first taken as the base: `warmup_s` after the start, and at least 3 s after
    every connection was held."""
    return max(warmup_s, ramp_s(res) + 3)


def check(res, warmup_s, rss_growth_max=RSS_GROWTH_MAX, p99_from_ramp=False):
    """The failures in `res` (a list of sentences; empty when the run passed): the RSS may grow by
    `rss_growth_max` of itself after warmup_end(); with `p99_from_ramp` the well-behaved client's
    p99 counts only the requests sent once every connection was held (all must still be 2xx)."""
    bad = []
    g = res["good"]
    if not res["gateway_alive"]:
        bad.append("the gateway died")
    if res["exit_code"] != 0:
        bad.append(f"the gateway exited {res['exit_code']} when stopped:\n{res['gateway_log_tail']}")
    if g["requests"] < 5:
        bad.append(f"the well-behaved client made only {g['requests']} requests")
    if g["failures"]:
        bad.append(f"{g['failures']} of the well-behaved client's {g['requests']} requests "
                   f"failed: {g['statuses']}")
    p99 = g["p99_ms"]
    if p99_from_ramp:
        p99 = _pct(sorted(ms for t, ms in res["good_each"] if t >= ramp_s(res)), 0.99)
    if p99 >= GOOD_P99_MS:
        bad.append(f"the well-behaved client's p99 is {p99:.0f} ms (bound {GOOD_P99_MS} ms"
                   f"{', from the ramp on' if p99_from_ramp else ''})")
    if res["after_status"] != 200:
        bad.append(f"after the load the well-behaved request answered {res['after_status']}")
    st = {int(k): v for k, v in res["statuses"].items()}
    if sum(v for k, v in st.items() if 200 <= k < 300) == 0:
        bad.append(f"no attacking request was served: {st}")
    if not st.get(429):
        bad.append(f"no attacking request was rate limited: {st}")
    odd = {k: v for k, v in st.items() if k not in (200, 400, 404, 422, 429)}
    if odd:
        bad.append(f"unexpected statuses under load: {odd}")
    during = [s for s in res["samples"] if s["t"] <= res["seconds"] + 0.5]
    held = [s for s in during if s["t"] >= warmup_end(res, warmup_s)]
    if len(held) < 3:
        bad.append(f"too few samples after warm-up: {len(held)}")
    else:
        base = held[0]["rss_kib"]
        peak = max(s["rss_kib"] for s in held)
        allowed = max(base * rss_growth_max, RSS_GROWTH_MIN_KIB)
        if peak - base > allowed:
            bad.append(f"the gateway's RSS grew after warm-up: {base} KiB at {held[0]['t']} s, "
                       f"peak {peak} KiB (bound +{allowed:.0f} KiB)")
    pool = res["pg_pool"]
    for t, pg, redis in res["services"]:
        if pg > pool:
            bad.append(f"the gateway held {pg} Postgres connections at {t} s (pool {pool})")
            break
        if redis > res["baseline"]["redis"] + 1:
            bad.append(f"the gateway held {redis} Redis connections at {t} s "
                       f"(baseline {res['baseline']['redis']})")
            break
    a, b = res["after"], res["baseline"]
    if _own_fds(a) > _own_fds(b) + 2 or a["threads"] > b["threads"] + 2:
        bad.append(f"after the load the gateway holds {a['fds']} fds and {a['threads']} threads "
                   f"(before: {b['fds']} and {b['threads']})")
    return bad


def report(res, warmup_s):
    """The figures as lines of text."""
    g = res["good"]
    st = ", ".join(f"{k}: {v}" for k, v in sorted(res["statuses"].items(), key=lambda kv: int(kv[0])))
    during = [s for s in res["samples"] if s["t"] <= res["seconds"] + 0.5]
    held = [s for s in during if s["t"] >= warmup_end(res, warmup_s)] or during
    pgs = [p for _, p, _ in res["services"]] or [0]
    rds = [r for _, _, r in res["services"]] or [0]
    ramp = ramp_s(res)
    late = sorted(ms for t, ms in res["good_each"] if t >= ramp)
    return [
        f"all {res['conns']} connections held {ramp:.1f} s after the start; the well-behaved "
        f"client from then on: {len(late)} requests, p50 {_pct(late, 0.5):.1f} ms, "
        f"p99 {_pct(late, 0.99):.1f} ms, max {_pct(late, 1):.1f} ms",
        f"load: {res['conns']} connections, {res['seconds']:.0f} s: {res['replies']} replies, "
        f"{res['rps']:.0f} req/s, p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms",
        f"  statuses: {st}",
        f"  connections opened {res['opened']}, connect errors {res['connect_errors']}, "
        f"closed by the gateway {res['closed_by_server']}, resets {res['resets']}, "
        f"timeouts {res['timeouts']}, bad replies {res['bad_replies']}",
        f"well-behaved client: {g['requests']} requests, {g['failures']} failed {g['statuses']}, "
        f"p50 {g['p50_ms']:.1f} ms, p95 {g['p95_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms, "
        f"max {g['max_ms']:.1f} ms",
        f"gateway RSS: {during[0]['rss_kib']} KiB at start, {held[0]['rss_kib']} KiB after "
        f"warm-up ({held[0]['t']:.0f} s), peak {max(s['rss_kib'] for s in during)} KiB, "
        f"{res['samples'][-1]['rss_kib']} KiB 3 s after the end",
        f"gateway threads: {res['baseline']['threads']} before, peak "
        f"{max(s['threads'] for s in during)}, {res['after']['threads']} after; fds: "
        f"{res['baseline']['fds']} before, peak {max(s['fds'] for s in during)}, "
        f"{res['after']['fds']} after",
        "gateway each second (s: RSS MiB/threads/replies so far): " + " ".join(
            f"{s['t']:.0f}:{s['rss_kib'] // 1024}/{s['threads']}/{s['replies']}" for s in res["samples"]),
        f"gateway Postgres connections: {res['baseline']['pg']} before, peak {max(pgs)} "
        f"(pool {res['pg_pool']}), {res['after']['pg']} after; Redis: "
        f"{res['baseline']['redis']} before, peak {max(rds)}, {res['after']['redis']} after",
    ]


def main():
    seconds, conns = int(sys.argv[1]), int(sys.argv[2])
    warmup = min(20, seconds // 3)
    res = run(seconds, conns)
    for line in report(res, warmup):
        print(line)
    bad = check(res, warmup)
    for b in bad:
        print("FAIL: " + b)
    print("PASS" if not bad else "FAIL")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
