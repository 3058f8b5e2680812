"""bench_image.py - the previous guest image against this checkout's: size, the default template's
build, create latency from it and the memory of sandboxes made from it.

Run by bench/image/image.sh (which builds or finds the previous image, starts the throwaway
Postgres and Redis and sets KILN_BUILD_DIR and KILN_SERVICES_ENV). For each image, one after
another on the same machine: a real kiln-gateway and kiln-node (tests/harness/kiln.py Stack) with
templates on and that image (KILN_GUEST_*); the time from the node's start until its default
template (1 vCPU, 512 MiB, 10 GiB) is ready; RUNS × (POST /v1/sandboxes until 201 running, each
checked to be a restore of the template, the first `python3 -c 'print(1)'`, delete); then MEM_VMS
sandboxes from the template kept, each after its first exec, and after IDLE_SETTLE_S the PSS of
their QEMU processes (/proc/PID/smaps_rollup). Prints both and the ratios new / old.

usage: bench_image.py OLD_IMAGE_ENV BASE_COMMIT [RUNS] [MEM_VMS]
"""
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
import kiln  # noqa: E402
from bench_vm import on_term, smaps_rollup, vm_pids, wait_template  # noqa: E402

MIB = 1 << 20
SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}  # the default template's shape
IDLE_SETTLE_S = 10
NODE_ENV = {"KILN_LOG_LEVEL": "info", "KILN_NODE_VCPU_MILLI": "64000", "KILN_NODE_MEMORY_MIB": "32768",
            "KILN_NODE_MAX_SANDBOXES": "64", "KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true"}
FIRST_EXEC = {"cmd": ["python3", "-c", "print(1)"]}


def read_env(path):
    out = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                out[k] = shlex.split(v)[0] if v else ""
    return out


def image_size(env):
    """(apparent bytes, allocated bytes, used KiB from the manifest) of the image's rootfs.ext4."""
    rootfs = env["KILN_GUEST_ROOTFS"]
    st = os.stat(rootfs)
    with open(os.path.join(os.path.dirname(rootfs), "manifest.json")) as f:
        used = json.load(f)["files"]["rootfs.ext4"]["used_kib"]
    return st.st_size, st.st_blocks * 512, used


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def measure(label, env, runs, nmem):
    """One stack on the image `env`: template ready time, create/first-exec latencies, PSS rows."""
    node_env = dict(NODE_ENV, **{k: env[k] for k in ("KILN_GUEST_KERNEL", "KILN_GUEST_INITRD",
                                                     "KILN_GUEST_ROOTFS", "KILN_GUEST_IMAGE_HASH")})
    t_node = time.monotonic()
    stack = kiln.Stack(node_env=node_env, gateway_env={"KILN_LOG_LEVEL": "info"})
    live = []
    ok = False
    try:
        gw = stack.gw
        key = stack.tenant("bench")
        stack.db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
                     "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
                     "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        node_id = stack.node.node_id
        template, _, _ = wait_template(stack, 900)
        t_ready = time.monotonic() - t_node
        print(f"{label}: template {template} ready {t_ready:.1f} s after the node was started", flush=True)

        def create():
            t0 = time.monotonic()
            r = gw.request("POST", "/v1/sandboxes", dict(SHAPE, timeout_s=3600), key, timeout=300)
            dt = time.monotonic() - t0
            if r.status != 201 or r.json().get("state") != "running":
                raise RuntimeError(f"create: {r}")
            sid = r.json()["id"]
            live.append(sid)
            lineage = stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sid}'")
            if lineage != template:
                raise RuntimeError(f"{sid} was not restored from the template (lineage {lineage!r})")
            return sid, dt

        def first_exec(sid):
            t0 = time.monotonic()
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", FIRST_EXEC, key, timeout=300)
            if r.status != 200 or r.json().get("stdout") != "1\n":
                raise RuntimeError(f"first exec in {sid}: {r}")
            return time.monotonic() - t0

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            live.remove(sid)

        lat = []
        for i in range(runs):
            sid, dc = create()
            fe = first_exec(sid)
            delete(sid)
            lat.append((dc, fe))
            print(f"  {label} {i + 1:2d}: create {dc:6.2f} s  first exec {fe:5.2f} s", flush=True)
        ids = []
        for i in range(nmem):
            sid, dc = create()
            first_exec(sid)
            ids.append(sid)
        time.sleep(IDLE_SETTLE_S)
        pss = []
        for sid in ids:
            pids = vm_pids(node_id, sid)
            if not pids:
                raise RuntimeError(f"no VMM process in the cgroup of {sid}")
            pss.append(sum(smaps_rollup(p)["Pss"] for p in pids))
        print(f"  {label}: PSS per sandbox MiB: " + ", ".join(f"{p / MIB:.1f}" for p in pss), flush=True)
        for sid in ids:
            delete(sid)
        ok = True
        return {"ready": t_ready, "lat": lat, "pss": pss}
    finally:
        for sid in list(live):
            try:
                stack.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=60)
            except Exception:
                pass
        if not ok:
            sys.stderr.write("--- kiln-node log (tail) ---\n" + "\n".join(
                stack.node.output().splitlines()[-30:]) + "\n")
        stack.cleanup()


def main():
    old_env = read_env(sys.argv[1])
    base = sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    nmem = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    new_env = kiln.guest_image()
    images = (("previous", old_env), ("this", new_env))
    if old_env["KILN_GUEST_IMAGE_HASH"] == new_env["KILN_GUEST_IMAGE_HASH"]:
        raise SystemExit(f"the image of {base} is this checkout's: nothing to compare")
    res = {}
    for label, env in images:
        res[label] = measure(label, env, runs, nmem)
    o, n = res["previous"], res["this"]

    print()
    print(f"previous image: {base[:12]} ({old_env['KILN_GUEST_IMAGE_HASH'][:12]}); this checkout's: "
          f"{new_env['KILN_GUEST_IMAGE_HASH'][:12]}; {os.cpu_count()} CPUs; load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print()
    print("| rootfs.ext4 | file MiB | allocated MiB | content MiB (manifest used_kib) |")
    print("|---|---|---|---|")
    sizes = {}
    for label, env in images:
        sizes[label] = image_size(env)
        a, b, u = sizes[label]
        print(f"| {label} | {a / MIB:.0f} | {b / MIB:.0f} | {u / 1024:.0f} |")
    print()
    print(f"| default shape, from the template | runs | previous median (min–max) s | this median "
          f"(min–max) s | ratio this / previous (medians) |")
    print("|---|---|---|---|---|")
    for what, f in (("create → 201 running", lambda r: r[0]), ("first exec", lambda r: r[1]),
                    ("create + first exec", lambda r: r[0] + r[1])):
        so, sn = stats([f(r) for r in o["lat"]]), stats([f(r) for r in n["lat"]])
        print(f"| {what} | {runs} | {so[0]:.2f} ({so[1]:.2f}–{so[2]:.2f}) | {sn[0]:.2f} "
              f"({sn[1]:.2f}–{sn[2]:.2f}) | {sn[0] / so[0]:.2f} |")
    print(f"| template ready after node start | 1 | {o['ready']:.1f} | {n['ready']:.1f} | "
          f"{n['ready'] / o['ready']:.2f} |")
    po, pn = statistics.median(o["pss"]), statistics.median(n["pss"])
    print(f"| PSS per sandbox, MiB ({nmem} kept, idle {IDLE_SETTLE_S} s) | {nmem} | {po / MIB:.1f} | "
          f"{pn / MIB:.1f} | {pn / po:.2f} |")
    print()
    print(f"ratios this / previous: image content {sizes['this'][2] / sizes['previous'][2]:.2f}, "
          f"create (median) {statistics.median(r[0] for r in n['lat']) / statistics.median(r[0] for r in o['lat']):.2f} "
          f"(aim ≤ 1.10), PSS per sandbox {pn / po:.2f}")
    print(f"total bench time: {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
