"""bench_snapshots.py - resume vs cold boot, fork children's memory vs cold VMs, snapshot size.

Run by bench/snapshots/snapshots.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). Everything goes through a real kiln-gateway and kiln-node
(tests/harness/kiln.py Stack, templates off: every create cold-boots) with jailed QEMU microVMs of
256 MiB and 1 vCPU.

1. Latency, interleaved so both see the same load: RUNS times, pause a sandbox and resume it
   (POST resume until 200; the node answers after the restored agent's HELLO), then cold-boot a new
   sandbox (POST /v1/sandboxes until 201; the node answers after the booted agent's HELLO) and
   delete it. Both are followed by the same first exec, timed apart.
2. Snapshot size: at every pause, the allocated bytes of the pause snapshot's directory
   (<data_dir>/snaps/<node>/<sandboxes.pause_snapshot>) and of each file in it, against the
   guest's memory size; once more for the workload's parent (below).
3. Memory: a parent runs WORKLOAD (a Python process that allocates and writes 50 MiB and keeps
   it); fork of FORK; after IDLE_SETTLE_S the PSS (/proc/PID/smaps_rollup) of the children's QEMU
   processes, summed; then FORK cold-booted sandboxes, created one after another, each running
   the same WORKLOAD, measured the same way.

usage: bench_snapshots.py [RUNS] [FORK]
"""
import glob
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
import kiln  # noqa: E402
from bench_vm import on_term, resident_bytes, scan_smaps, smaps_rollup, teardown, vm_pids  # noqa: E402

MEM_MIB = 256
MIB = 1 << 20
IDLE_SETTLE_S = 10
NODE_ENV = {"KILN_LOG_LEVEL": "info", "KILN_NODE_VCPU_MILLI": "64000",
            "KILN_NODE_MEMORY_MIB": "32768", "KILN_NODE_MAX_SANDBOXES": "64"}
FIRST_EXEC = {"cmd": ["python3", "-c", "print(1)"]}
WORKLOAD_PY = ("import os, time\n"
               "b = bytearray(b'\\x01') * (50 << 20)\n"
               "open('/root/ready', 'w').write(str(os.getpid()))\n"
               "while True:\n"
               "    time.sleep(3600)\n")
WORKLOAD = "nohup python3 /root/workload.py >/dev/null 2>&1 &"
ALIVE = "kill -0 $(cat /root/ready) && echo alive"


def du_bytes(path):
    """Allocated bytes (du -s --block-size=1)."""
    out = subprocess.run(["du", "-s", "--block-size=1", path], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[0])


def apparent_bytes(path):
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*")) if os.path.isfile(f))


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    nfork = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    kiln.guest_image()
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info"})
    live = []
    key = None
    ok = False
    loads = {"start": loadavg()}
    try:
        gw, node = stack.gw, stack.node
        key = stack.tenant("bench")
        # The default plan allows 10 running sandboxes; the bench needs 2 × FORK + 1.
        stack.db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
                     "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
                     "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        snaps_root = f"{node.data_dir}/snaps/{node.node_id}"
        accel = stack.db.sql(f"SELECT accelerator FROM nodes WHERE id = '{node.node_id}'") or "?"

        def create():
            t0 = time.monotonic()
            r = gw.request("POST", "/v1/sandboxes", {"memory_mib": MEM_MIB, "vcpus": 1, "timeout_s": 3600},
                           key, timeout=300)
            dt = time.monotonic() - t0
            if r.status != 201 or r.json().get("state") != "running":
                raise RuntimeError(f"create: {r}")
            sb = r.json()
            live.append(sb["id"])
            return sb, dt

        def post(sid, what, body=None, want=200):
            t0 = time.monotonic()
            r = gw.request("POST", f"/v1/sandboxes/{sid}/{what}", body, key, timeout=300)
            dt = time.monotonic() - t0
            if r.status != want:
                raise RuntimeError(f"{what} of {sid}: {r}")
            return r.json(), dt

        def sh(sid, cmd):
            out, dt = post(sid, "exec", {"cmd": ["sh", "-c", cmd]})
            if out.get("exit_code") != 0:
                raise RuntimeError(f"exec {cmd!r} in {sid}: {out}")
            return out["stdout"], dt

        def first_exec(sid):
            out, dt = post(sid, "exec", FIRST_EXEC)
            if out.get("stdout") != "1\n":
                raise RuntimeError(f"first exec in {sid}: {out}")
            return dt

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            live.remove(sid)

        def snapshot_size(sid):
            snap = stack.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{sid}'")
            d = os.path.join(snaps_root, snap)
            files = {os.path.basename(f): (du_bytes(f), os.path.getsize(f))
                     for f in sorted(glob.glob(os.path.join(d, "*")))}
            return {"dir": du_bytes(d), "apparent": apparent_bytes(d), "files": files}

        def shm_mem(sid):
            return f"/dev/shm/kiln-{node.node_id}-{sid}.mem"

        def start_workload(sid):
            r = gw.request("PUT", f"/v1/sandboxes/{sid}/files?path=/root/workload.py", WORKLOAD_PY.encode(),
                           key, timeout=120)
            if r.status != 204:
                raise RuntimeError(f"upload of the workload to {sid}: {r}")
            sh(sid, WORKLOAD)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                out, _ = post(sid, "exec", {"cmd": ["sh", "-c", ALIVE + " 2>/dev/null || true"]})
                if out.get("stdout") == "alive\n":
                    return
                time.sleep(0.5)
            raise RuntimeError(f"the workload did not start in {sid}")

        def pss_of(sids, mem_of):
            """Sums over the sandboxes' QEMU processes (bytes); `mem_of(sid)` names the file that
            backs the guest's RAM, whose mapping (file pages and, when private, the copies made on
            write) is the guest's part."""
            rows = []
            for sid in sids:
                pids = vm_pids(node.node_id, sid)
                if not pids:
                    raise RuntimeError(f"no VMM process in the cgroup of {sid}")
                try:
                    st = os.stat(mem_of(sid))
                except (FileNotFoundError, TypeError):
                    st = os.stat("/proc")  # matches no mapping: the guest's part is not known
                r = dict.fromkeys(("Pss", "Rss", "Private", "Anonymous", "guest_pss", "tcg"), 0)
                for p in pids:
                    m = smaps_rollup(p)
                    _, g_pss, code = scan_smaps(p, st)
                    r["Pss"] += m["Pss"]
                    r["Rss"] += m["Rss"]
                    r["Private"] += m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
                    r["Anonymous"] += m["Anonymous"]
                    r["guest_pss"] += g_pss
                    r["tcg"] += code
                rows.append(r)
            return {k: sum(r[k] for r in rows) for k in rows[0]}, rows

        # ---- 1 + 2. resume vs cold boot, interleaved; the pause snapshot's size each time ----
        print(f"latency: {runs} × (pause + resume of one sandbox, then a cold boot of a new one); "
              f"{MEM_MIB} MiB, 1 vCPU; accelerator {accel}", flush=True)
        sb, dt = create()
        sid = sb["id"]
        fe = first_exec(sid)
        cold, resume, pause, sizes = [], [], [], []
        cold.append((dt, fe))
        print(f"  cold  0: create {dt:6.2f} s  first exec {fe:5.2f} s", flush=True)
        for i in range(runs):
            out, dp = post(sid, "pause")
            if out.get("state") != "paused":
                raise RuntimeError(f"pause: {out}")
            size = snapshot_size(sid)
            sizes.append(size)
            out, dr = post(sid, "resume")
            if out.get("state") != "running":
                raise RuntimeError(f"resume: {out}")
            fr = first_exec(sid)
            pause.append(dp)
            resume.append((dr, fr))
            c, dc = create()
            fc = first_exec(c["id"])
            delete(c["id"])
            cold.append((dc, fc))
            print(f"  run {i + 1:2d}: pause {dp:5.2f} s (snapshot {size['dir'] / MIB:6.1f} MiB)  "
                  f"resume {dr:5.2f} s  first exec {fr:5.2f} s  |  cold create {dc:6.2f} s  "
                  f"first exec {fc:5.2f} s", flush=True)
        guest_used = sh(sid, "grep -E '^(MemTotal|MemFree):' /proc/meminfo")[0].split()
        guest_total, guest_free = int(guest_used[1]) * 1024, int(guest_used[4]) * 1024
        delete(sid)
        loads["latency"] = loadavg()

        # ---- 3. fork of N children vs N cold VMs, both running WORKLOAD ----
        print(f"\nmemory: fork of {nfork} from a parent running the 50 MiB workload, then {nfork} cold "
              f"sandboxes each running it; measured after {IDLE_SETTLE_S} s idle", flush=True)
        parent, _ = create()
        pid_ = parent["id"]
        start_workload(pid_)
        before = set(glob.glob(os.path.join(snaps_root, "snap_*")))
        out, dfork = post(pid_, "fork", {"count": nfork}, want=201)
        kids = [k["id"] for k in out["sandboxes"]]
        live.extend(kids)
        fork_dirs = sorted(set(glob.glob(os.path.join(snaps_root, "snap_*"))) - before)
        print(f"  fork of {nfork}: {dfork:.2f} s", flush=True)
        for k in kids:
            if sh(k, ALIVE)[0] != "alive\n":
                raise RuntimeError(f"the workload does not run in child {k}")
        time.sleep(IDLE_SETTLE_S)
        image = [os.path.join(d, "mem") for d in fork_dirs if os.path.exists(os.path.join(d, "mem"))]
        if len(image) != 1:
            raise RuntimeError(f"expected one new memory image after the fork, found {image}")
        kid_sum, kid_rows = pss_of(kids, lambda sid: image[0])
        parent_sum, _ = pss_of([pid_], shm_mem)
        parent_file = resident_bytes(shm_mem(pid_)) if os.path.exists(shm_mem(pid_)) else 0
        image_resident = sum(resident_bytes(p) for p in image)
        image_alloc = sum(du_bytes(p) for p in image)
        loads["fork"] = loadavg()
        for k in kids:
            delete(k)
        out, _ = post(pid_, "pause")
        work_size = snapshot_size(pid_)
        delete(pid_)

        cold_ids = []
        for i in range(nfork):
            c, dc = create()
            start_workload(c["id"])
            cold_ids.append(c["id"])
            print(f"  cold {i + 1}: create {dc:6.2f} s", flush=True)
        time.sleep(IDLE_SETTLE_S)
        cold_sum, cold_rows = pss_of(cold_ids, shm_mem)
        loads["cold VMs"] = loadavg()
        for c in cold_ids:
            delete(c)

        # ---- figures ----
        print()
        print(f"accelerator (nodes.accelerator): {accel}; {os.cpu_count()} CPUs; load average (1/5/15 min) "
              + "; ".join(f"{k}: {v}" for k, v in loads.items()))
        print()
        print(f"| until the agent answers, {runs} runs each, interleaved | median s | min s | max s |")
        print("|---|---|---|---|")
        rows = (("cold boot: POST /v1/sandboxes → 201 (templates off)", [c[0] for c in cold]),
                ("resume: POST /v1/sandboxes/{id}/resume → 200", [r[0] for r in resume]),
                ("pause: POST /v1/sandboxes/{id}/pause → 200", pause),
                ("first exec (`python3 -c 'print(1)'`) after the cold boot", [c[1] for c in cold]),
                ("first exec (`python3 -c 'print(1)'`) after the resume", [r[1] for r in resume]),
                ("cold boot + first exec", [c[0] + c[1] for c in cold]),
                ("resume + first exec", [r[0] + r[1] for r in resume]))
        for label, xs in rows:
            print(f"| {label} | " + " | ".join(f"{x:.2f}" for x in stats(xs)) + " |")
        med_c = statistics.median(c[0] for c in cold)
        med_r = statistics.median(r[0] for r in resume)
        ratios = [c[0] / r[0] for c, r in zip(cold[1:], resume)]
        print(f"\n({len(cold)} cold boots: the first sandbox's own create and one per run)")
        print(f"ratio cold boot / resume (medians): {med_c / med_r:.1f}×; per run (the cold boot right "
              f"after each resume): {min(ratios):.1f}× to {max(ratios):.1f}× (aim ≥ 10×)")
        print(f"ratio cold + first exec / resume + first exec (medians): "
              f"{statistics.median(c[0] + c[1] for c in cold) / statistics.median(r[0] + r[1] for r in resume):.1f}×")

        print()
        print(f"| fork of {nfork} vs {nfork} cold, each running the 50 MiB workload | Pss | of which guest "
              "memory | of which TCG code cache | of which the rest of QEMU | Rss | Private | Anonymous |")
        print("|---|---|---|---|---|---|---|---|")
        for label, m in ((f"{nfork} fork children (sum)", kid_sum), (f"{nfork} cold-booted sandboxes (sum)", cold_sum),
                         ("the parent, after the fork (not in the sum)", parent_sum)):
            rest = m["Pss"] - m["guest_pss"] - m["tcg"]
            print(f"| {label} | {m['Pss'] / MIB:.1f} | {m['guest_pss'] / MIB:.1f} | {m['tcg'] / MIB:.1f} | "
                  f"{rest / MIB:.1f} | {m['Rss'] / MIB:.1f} | {m['Private'] / MIB:.1f} | {m['Anonymous'] / MIB:.1f} |")
        print("(MiB; guest memory = Pss of the mapping of the file behind the guest's RAM: the fork's image, "
              "mapped privately, with the pages copied on write; a cold VM's own file in /dev/shm)")
        print("per child Pss MiB: " + ", ".join(f"{r['Pss'] / MIB:.1f}" for r in kid_rows))
        print("per cold VM Pss MiB: " + ", ".join(f"{r['Pss'] / MIB:.1f}" for r in cold_rows))
        print(f"ratio children / cold (Pss sums): {kid_sum['Pss'] / cold_sum['Pss']:.2f} (aim ≤ 0.4); "
              f"by Rss: {kid_sum['Rss'] / cold_sum['Rss']:.2f}; guest memory alone (Pss): "
              f"{kid_sum['guest_pss'] / cold_sum['guest_pss']:.2f}; without the TCG code cache, which KVM "
              f"does not have: {(kid_sum['Pss'] - kid_sum['tcg']) / (cold_sum['Pss'] - cold_sum['tcg']):.2f}")
        print(f"the fork's memory image: {image_alloc / MIB:.1f} MiB allocated on disk, "
              f"{image_resident / MIB:.1f} MiB of it in the page cache when measured "
              f"(shared by the children; mapped pages are in their Pss)")
        print(f"counting that whole page cache as the children's too: "
              f"({kid_sum['Pss'] / MIB:.1f} + {image_resident / MIB:.1f}) / {cold_sum['Pss'] / MIB:.1f} = "
              f"{(kid_sum['Pss'] + image_resident) / cold_sum['Pss']:.2f}")
        print(f"the parent's own memory file (a copy of the image, /dev/shm): {parent_file / MIB:.1f} MiB "
              f"resident; only the pages it touched since the fork are mapped, hence in its Pss")

        print()
        print(f"| pause snapshot of a {MEM_MIB} MiB guest | allocated MiB (du) | apparent MiB | of guest memory |")
        print("|---|---|---|---|")
        for label, s in ((f"idle, after one python3 (median of {len(sizes)} pauses)", None),
                         ("the workload's parent (50 MiB written, after the fork)", work_size)):
            if s is None:
                d = statistics.median(x["dir"] for x in sizes)
                a = statistics.median(x["apparent"] for x in sizes)
            else:
                d, a = s["dir"], s["apparent"]
            print(f"| {label} | {d / MIB:.1f} | {a / MIB:.1f} | {d / (MEM_MIB * MIB):.2f} |")
        for label, s in (("idle, first pause", sizes[0]), ("the workload's parent", work_size)):
            print(f"  {label}: " + ", ".join(f"{n} {al / MIB:.1f} MiB allocated ({ap / MIB:.1f} apparent)"
                                              for n, (al, ap) in s["files"].items()))
        print("  per pause (allocated MiB): " + ", ".join(f"{x['dir'] / MIB:.1f}" for x in sizes))
        print(f"  inside the idle guest at the end: MemTotal {guest_total / MIB:.1f} MiB, MemFree "
              f"{guest_free / MIB:.1f} MiB (MemTotal − MemFree {(guest_total - guest_free) / MIB:.1f} MiB)")
        print(f"\ntotal bench time: {time.monotonic() - t_start:.0f} s")
        ok = True
    finally:
        teardown(stack, key, live, ok)


if __name__ == "__main__":
    main()
