"""Memory of one sandbox after a burst (issue 18): boots a sandbox, runs one Python that writes
300 MiB and frees it, idles, then sets the guest's own used memory against the host memory that
backs its RAM, with free page reporting on and off. Run through memory.sh (root, services)."""
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vm import MIB, fmt_mib, kiln, measure_vmm, vm_pids  # noqa: E402

MEM_MIB = 512
BURST_MIB = 300
BURST = {"cmd": ["python3", "-c", f"b = b'x' * ({BURST_MIB} << 20); print(len(b) >> 20)"],
         "timeout_s": 300}
MEMINFO = {"cmd": ["grep", "-E", "^(MemTotal|MemFree|MemAvailable):", "/proc/meminfo"]}


def run(reporting, idle_s):
    quiet = {"KILN_LOG_LEVEL": "info", "KILN_TEMPLATES": "false", "KILN_TEMPLATE_DEFAULT": "false",
             "KILN_FREE_PAGE_REPORTING": "1" if reporting else "0",
             "KILN_BOOT_TIMEOUT_S": "600"}  # a boot under TCG on a loaded host
    stack = kiln.Stack(node_env=quiet, gateway_env=quiet)
    sid = key = None
    try:
        gw, node = stack.gw, stack.node
        key = stack.tenant("bench")
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": MEM_MIB, "vcpus": 1}, key, timeout=600)
        if r.status != 201:
            raise RuntimeError(f"create: {r}")
        sid = r.json()["id"]

        def ex(body):
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", body, key, timeout=600)
            if r.status != 200 or r.json().get("exit_code") != 0:
                raise RuntimeError(f"exec {body['cmd']}: {r}")
            return r.json()["stdout"]

        ex({"cmd": ["true"]})
        (rec,) = glob.glob(f"{node.data_dir}/vms/*/{sid}/vm.json")
        with open(rec) as f:
            mem_path = json.load(f)["mem_path"]
        pids = vm_pids(node.node_id, sid)
        before = measure_vmm(pids, mem_path)
        t0 = time.monotonic()
        if ex(BURST) != f"{BURST_MIB}\n":
            raise RuntimeError("the burst did not run")
        burst_s = time.monotonic() - t0
        after_burst = measure_vmm(pids, mem_path)
        time.sleep(idle_s)
        mi = {ln.split()[0].rstrip(":"): int(ln.split()[1]) * 1024 for ln in ex(MEMINFO).splitlines()}
        idle = measure_vmm(pids, mem_path)
        return {"before": before, "burst": after_burst, "idle": idle, "meminfo": mi, "burst_s": burst_s}
    finally:
        if sid:
            try:
                stack.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            except Exception:
                pass
        stack.cleanup()


def main():
    idle_s = float(sys.argv[1]) if len(sys.argv) > 1 else 10
    load0 = os.getloadavg()
    res = {}
    for reporting in (True, False):
        res[reporting] = run(reporting, idle_s)
    print(f"one sandbox of {MEM_MIB} MiB, 1 vCPU, cold boot; `python3 -c \"b = b'x' * ({BURST_MIB} << 20)\"` "
          f"(writes {BURST_MIB} MiB, frees it on exit), then {idle_s:.0f} s idle")
    print(f"host: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in load0)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print()
    print("| free page reporting | guest MemTotal − MemFree | guest MemTotal − MemAvailable | "
          "guest RAM Rss before | right after the burst | **after idle** | guest RAM Pss after idle | "
          "**ratio Rss / (MemTotal − MemFree)** | QEMU Rss − guest RAM (overhead) | of which TCG code cache |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratio = {}
    for reporting in (True, False):
        r = res[reporting]
        mi, m = r["meminfo"], r["idle"]
        used = mi["MemTotal"] - mi["MemFree"]
        ratio[reporting] = m["guest_rss"] / used
        print(f"| {'on' if reporting else 'off (KILN_FREE_PAGE_REPORTING=0)'} | {fmt_mib(used)} | "
              f"{fmt_mib(mi['MemTotal'] - mi['MemAvailable'])} | {fmt_mib(r['before']['guest_rss'])} | "
              f"{fmt_mib(r['burst']['guest_rss'])} | **{fmt_mib(m['guest_rss'])}** | {fmt_mib(m['guest_pss'])} | "
              f"**{ratio[reporting]:.2f}** | {fmt_mib(m['overhead'])} | {fmt_mib(m['tcg'])} |")
    print(f"\n(MiB; guest RAM = QEMU's mapping of the guest's memory file, from /proc/<qemu>/smaps; "
          f"MemTotal {fmt_mib(res[True]['meminfo']['MemTotal'])} MiB of the {MEM_MIB} MiB; "
          f"burst took {res[True]['burst_s']:.1f} s on, {res[False]['burst_s']:.1f} s off)")
    print(f"guest RAM after idle, on / off: {res[True]['idle']['guest_rss'] / res[False]['idle']['guest_rss']:.2f}")


if __name__ == "__main__":
    main()
