"""bench_concurrent.py - N creates at once: wall time, latency per create, CPU per create.

Run by bench/create/concurrent.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). A real kiln-gateway and kiln-node (tests/harness/kiln.py
Stack) with templates on: the node builds the template of the default shape (1 vCPU, 512 MiB,
10 GiB) at start, and every create here is a restore of it (its lineage is checked).

After the template is ready, two creates one after another warm it (its image in the page cache,
the pools' connections open). Then ROUNDS × (for each N in SIZES: N threads each send
POST /v1/sandboxes at the same moment; the batch's wall time runs from then until the last 201
running; then all N are deleted and their cgroups waited for before the next batch). The sizes
are interleaved within a round so that they see the same load from the rest of the machine.

CPU of a batch, from its start until its last 201, divided by N:
- kiln-node: utime + stime of its threads, and cutime + cstime of the children it reaped (the
  helpers it runs), from /proc/PID/stat;
- the VMs: the node's cpuacct cgroup (kiln/<node id>), which keeps the usage of the sandboxes'
  cgroups (their jailed QEMU) after they are removed;
- kiln-gateway: as kiln-node;
- Postgres: the postmaster's own and reaped children's time and the live backends' utime + stime.
The Python client sending the requests is not counted. All N come from one tenant, whose bound on
requests in progress at once on the gateway (tenant_max_in_flight) is raised to 64.

Ratio per batch: wall ÷ (N × CPU per create ÷ cores); 1.0 when the creates are limited by the CPU
alone. The node's log gives each restore's phases (network, vmm, agent, disk, identity), whose
medians per N are printed too.

usage: bench_concurrent.py [ROUNDS] [SIZES]   (SIZES comma-separated, e.g. 1,8,20)
"""
import glob
import os
import re
import signal
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
import kiln  # noqa: E402
from bench_vm import on_term, teardown, wait_template  # noqa: E402

SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}  # the default shape, spelled out
NODE_ENV = {"KILN_LOG_LEVEL": "info", "KILN_NODE_VCPU_MILLI": "64000",
            "KILN_NODE_MEMORY_MIB": "32768", "KILN_NODE_MAX_SANDBOXES": "64",
            "KILN_NODE_DISK_GIB": "1000", "KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
            # the template's cold boot on a host loaded by other work takes minutes
            "KILN_BOOT_TIMEOUT_S": "600",
            # no code interpreter image: one template to build at start, not two
            "KILN_GUEST_CODEINT_ROOTFS": ""}
CLK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count()
PHASES = ("network", "vmm", "agent", "disk", "identity")
RESTORED = re.compile(r'sandbox "([^"]+)" restored from \S+ in (\d+) ms: network (\d+), vmm (\d+), '
                      r'agent (\d+), disk (\d+), identity (\d+)')


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def proc_stat(pid):
    """(utime + stime, cutime + cstime, ppid) of `pid` in seconds; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    # fields[0] is the state (field 3): utime is field 14, so fields[11]
    return ((int(fields[11]) + int(fields[12])) / CLK, (int(fields[13]) + int(fields[14])) / CLK,
            int(fields[1]))


def own_and_reaped(pid):
    st = proc_stat(pid)
    if st is None:
        raise RuntimeError(f"process {pid} is gone")
    return st[0] + st[1]


def postgres_cpu(pgdata):
    with open(os.path.join(pgdata, "postmaster.pid")) as f:
        pm = int(f.readline())
    total = own_and_reaped(pm)
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st and st[2] == pm:
                total += st[0]
    return total


def cgroup_cpu(node_id):
    for f in (f"/sys/fs/cgroup/cpuacct/kiln/{node_id}/cpuacct.usage",
              f"/sys/fs/cgroup/cpu,cpuacct/kiln/{node_id}/cpuacct.usage"):
        if os.path.exists(f):
            with open(f) as fh:
                return int(fh.read()) / 1e9
    for f in glob.glob(f"/sys/fs/cgroup/kiln/{node_id}/cpu.stat"):
        with open(f) as fh:
            for line in fh:
                if line.startswith("usage_usec"):
                    return int(line.split()[1]) / 1e6
    return 0.0


def pct(xs, p):
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, -(-len(xs) * p // 100) - 1))]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,8,20").split(",")]
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    kiln.guest_image()
    pgdata = kiln.services_env()["KILN_TEST_PGDATA"]
    # One tenant sends all N: its in-flight bound on the gateway (16 by default) raised above N.
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info",
                                                       "KILN_TENANT_MAX_IN_FLIGHT": "64"})
    live = set()
    live_lock = threading.Lock()
    key = None
    ok = False
    try:
        gw = stack.gw
        key = stack.tenant("bench")
        stack.db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
                     "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
                     "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        node_id = stack.node.node_id
        template, _, t_usable = wait_template(stack, 900)
        print(f"template {template} usable after {t_usable:.1f} s; {CORES} CPUs", flush=True)

        def create(out, i, go):
            go.wait()
            t0 = time.monotonic()
            r = gw.request("POST", "/v1/sandboxes", dict(SHAPE, timeout_s=3600), key, timeout=600)
            out[i] = (time.monotonic(), time.monotonic() - t0, r)
            if r.status == 201:
                with live_lock:
                    live.add(r.json()["id"])

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=300)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            with live_lock:
                live.discard(sid)

        def in_parallel(fn, args):
            ts = [threading.Thread(target=fn, args=a) for a in args]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        def cpu():
            return {"node": own_and_reaped(stack.node.proc.pid), "vms": cgroup_cpu(node_id),
                    "gateway": own_and_reaped(stack.gw.proc.pid), "postgres": postgres_cpu(pgdata)}

        def batch(n):
            out = [None] * n
            go = threading.Event()
            ts = [threading.Thread(target=create, args=(out, i, go)) for i in range(n)]
            for t in ts:
                t.start()
            c0 = cpu()
            t0 = time.monotonic()
            go.set()
            for t in ts:
                t.join()
            c1 = cpu()
            wall = max(o[0] for o in out) - t0
            bad = [o[2] for o in out if o[2].status != 201 or o[2].json().get("state") != "running"]
            ids = [o[2].json()["id"] for o in out if o[2].status == 201]
            try:
                if bad:
                    raise RuntimeError(f"{len(bad)} of {n} creates failed, the first: {bad[0]}")
                for sid in ids:
                    lineage = stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes "
                                           f"WHERE id = '{sid}'")
                    if lineage != template:
                        raise RuntimeError(f"{sid} was not restored from the template ({lineage!r})")
            finally:
                in_parallel(delete, [(s,) for s in ids])
            deadline = time.monotonic() + 120
            while any(glob.glob(f"/sys/fs/cgroup/*/kiln/{node_id}/{s}") for s in ids) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)
            used = {k: c1[k] - c0[k] for k in c0}
            return {"n": n, "wall": wall, "lat": [o[1] for o in out], "ids": ids, "cpu": used,
                    "load": os.getloadavg()[0]}

        def restore_phases(ids):
            """The node's logged phases of the restores of `ids`: [total, network, vmm, ...]."""
            got = {m.group(1): [int(x) for x in m.groups()[1:]]
                   for m in RESTORED.finditer(stack.node.output())}
            return [got[s] for s in ids if s in got]

        print("warming the template: 2 creates one after another", flush=True)
        for _ in range(2):
            batch(1)

        results = {n: [] for n in sizes}
        for rd in range(rounds):
            for n in sizes:
                b = batch(n)
                results[n].append(b)
                cpn = sum(b["cpu"].values()) / n
                print(f"round {rd + 1} N={n:2d}: wall {b['wall']:6.2f} s, create p50 "
                      f"{pct(b['lat'], 50):5.2f} max {max(b['lat']):5.2f} s, CPU per create "
                      f"{cpn:5.3f} s (" + ", ".join(f"{k} {v / n:.3f}" for k, v in b["cpu"].items())
                      + f"), ratio {b['wall'] / (n * cpn / CORES):4.2f}, load {b['load']:.2f}",
                      flush=True)
                rows = restore_phases(b["ids"])
                if rows:
                    print("  restores' phases, median ms: " + ", ".join(
                        f"{k} {statistics.median(r[i] for r in rows):.0f}"
                        for i, k in enumerate(("total",) + PHASES)), flush=True)

        print()
        print(f"{CORES} CPUs; load average (1/5/15 min) at the end: {loadavg()}; "
              f"1-minute load at each batch's end: "
              f"{min(b['load'] for bs in results.values() for b in bs):.1f}–"
              f"{max(b['load'] for bs in results.values() for b in bs):.1f}")
        print()
        print("| N at once | batches | wall s, median (min–max) | create p50 s | create p99 s | "
              "CPU per create s (node + VMs + gateway + Postgres) | N × CPU ÷ cores s | "
              "**wall ÷ (N × CPU ÷ cores)**, median (min–max) |")
        print("|---|---|---|---|---|---|---|---|")
        for n in sizes:
            bs = results[n]
            walls = [b["wall"] for b in bs]
            lat = [x for b in bs for x in b["lat"]]
            cpns = [sum(b["cpu"].values()) / n for b in bs]
            parts = {k: statistics.median(b["cpu"][k] / n for b in bs) for k in bs[0]["cpu"]}
            ratios = [b["wall"] / (n * c / CORES) for b, c in zip(bs, cpns)]
            print(f"| {n} | {len(bs)} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
                  f"{pct(lat, 50):.2f} | {pct(lat, 99):.2f} | {statistics.median(cpns):.3f} ("
                  + " + ".join(f"{parts[k]:.3f}" for k in ("node", "vms", "gateway", "postgres"))
                  + f") | {n * statistics.median(cpns) / CORES:.2f} | "
                  f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}–{max(ratios):.2f}) |")
        print()
        print("| N at once | restores | node's phases, median ms: " + " / ".join(PHASES) +
              " | restore total, median (max) ms | create p50 − restore median ms |")
        print("|---|---|---|---|---|")
        for n in sizes:
            rows = restore_phases([s for b in results[n] for s in b["ids"]])
            if not rows:
                continue
            lat = [x for b in results[n] for x in b["lat"]]
            med = [statistics.median(r[i] for r in rows) for i in range(6)]
            print(f"| {n} | {len(rows)} | " + " / ".join(f"{m:.0f}" for m in med[1:]) +
                  f" | {med[0]:.0f} ({max(r[0] for r in rows)}) | "
                  f"{pct(lat, 50) * 1000 - med[0]:.0f} |")
        print(f"\ntotal bench time: {time.monotonic() - t_start:.0f} s")
        ok = True
    finally:
        teardown(stack, key, live, ok)


if __name__ == "__main__":
    main()
