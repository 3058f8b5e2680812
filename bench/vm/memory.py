"""Memory of one sandbox after a burst (issue 18): boots a sandbox, runs one Python that writes
300 MiB and frees it, idles, then sets the guest's own used memory against the host memory that
backs its RAM, for each variant asked for: free page reporting on (the node's default guest
command line, or with the guest's page_reporting_order given on it) and off. Inside the guest it
also reads where its free memory sits (/proc/buddyinfo by order, page cache, slab) and the order
the guest's page reporting actually uses. Run through memory.sh (root, services)."""
import ctypes
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vm import MIB, _libc, fmt_mib, kiln, measure_vmm, vm_pids, wait_template  # noqa: E402

MEM_MIB = int(sys.argv[3]) if len(sys.argv) > 3 else 512
BURST_MIB = int(sys.argv[4]) if len(sys.argv) > 4 else 300
BURST = {"cmd": ["python3", "-c", f"b = b'x' * ({BURST_MIB} << 20); print(len(b) >> 20)"],
         "timeout_s": 300}
# MemTotal and friends, the page reporting order in effect, free blocks per order
GUEST = {"cmd": ["sh", "-c", "cat /proc/meminfo; echo order $(cat "
                 "/sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null || echo -); "
                 "cat /proc/buddyinfo"]}
PAGE = 4096


def parse_guest(out):
    """meminfo (bytes), free blocks per order per zone ({"DMA": [n0..n10], ...}), the order."""
    mi, buddy, order = {}, {}, None
    for ln in out.splitlines():
        f = ln.split()
        if ln.startswith("Node "):  # Node 0, zone   DMA32  n0 n1 ... n10
            buddy[f[3]] = [int(n) for n in f[4:]]
        elif f and f[0] == "order":
            order = f[1]
        elif len(f) >= 2 and f[0].endswith(":"):
            mi[f[0].rstrip(":")] = int(f[1]) * (1024 if len(f) == 3 else 1)
    return mi, buddy, order


DMA_ZONE = 16 * MIB  # the guest's ZONE_DMA: its first 16 MiB, the memory file's first 16 MiB


def resident_head(path, size):
    """Bytes of the file's first `size` bytes resident in memory (mincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap " + path)
        try:
            vec = ctypes.create_string_buffer(size // PAGE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore " + path)
            return sum(b & 1 for b in vec.raw) * PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def huge_bytes(pids, mem_path):
    """Bytes of the guest memory file's mappings that the host maps with huge pages."""
    st = os.stat(mem_path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    n = 0
    for pid in pids:
        cur = False
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                p = line.split()
                if p and "-" in p[0] and len(p) >= 5 and ":" in p[3]:
                    cur = p[3] == dev and p[4] == str(st.st_ino)
                elif cur and p[0] in ("ShmemPmdMapped:", "FilePmdMapped:", "AnonHugePages:"):
                    n += int(p[1]) * 1024
    return n


def run(variant, idle_s):
    """variant: "off", "on", "on:N" (page_reporting.page_reporting_order=N on the guest's command
    line) or "on=N" (N written to /sys/module/page_reporting/parameters/page_reporting_order in
    the guest after its first exec, before the burst); "tpl" and "tpl-off": the sandbox made from
    the node's template (of the default shape: MEM_MIB 512), with reporting on and off, its
    memory the template's image mapped privately."""
    template = variant.startswith("tpl")
    reporting = variant not in ("off", "tpl-off")
    env = {"KILN_LOG_LEVEL": "info", "KILN_TEMPLATES": "true" if template else "false",
           "KILN_TEMPLATE_DEFAULT": "true" if template else "false",
           "KILN_FREE_PAGE_REPORTING": "1" if reporting else "0",
           "KILN_BOOT_TIMEOUT_S": "600"}  # a boot under TCG on a loaded host
    if ":" in variant:
        env["KILN_GUEST_CMDLINE"] = ("root=/dev/vda rootfstype=ext4 rw "
                                     f"page_reporting.page_reporting_order={variant.split(':')[1]}")
    stack = kiln.Stack(node_env=env, gateway_env={"KILN_LOG_LEVEL": "info"})
    sid = key = None
    try:
        gw, node = stack.gw, stack.node
        key = stack.tenant("bench")
        if template:
            wait_template(stack)
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": MEM_MIB, "vcpus": 1}, key, timeout=600)
        if r.status != 201:
            raise RuntimeError(f"create: {r}")
        sid = r.json()["id"]
        if template != bool(stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes "
                                         f"WHERE id = '{sid}'")):
            raise RuntimeError(f"{variant}: the sandbox was {'not ' if template else ''}made from the template")

        def ex(body):
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", body, key, timeout=600)
            if r.status != 200 or r.json().get("exit_code") != 0:
                raise RuntimeError(f"exec {body['cmd']}: {r}")
            return r.json()["stdout"]

        ex({"cmd": ["true"]})
        if "=" in variant:
            ex({"cmd": ["sh", "-c", f"echo {variant.split('=')[1]} > "
                        "/sys/module/page_reporting/parameters/page_reporting_order"]})
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
        mi, buddy, order = parse_guest(ex(GUEST))
        idle = measure_vmm(pids, mem_path)
        idle["guest_huge"] = huge_bytes(pids, mem_path)
        # of the VM's own file only: a template's image is resident for every VM mapping it
        idle["dma_resident"] = None if template else resident_head(mem_path, DMA_ZONE)
        time.sleep(2 * idle_s)
        mi3, buddy3, _ = parse_guest(ex(GUEST))
        idle3 = measure_vmm(pids, mem_path)
        return {"before": before, "burst": after_burst, "idle": idle, "meminfo": mi, "buddy": buddy,
                "order": order, "idle3": idle3, "meminfo3": mi3, "buddy3": buddy3,
                "burst_s": burst_s}
    finally:
        if sid:
            try:
                stack.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            except Exception:
                pass
        stack.cleanup()


def free_below(buddy, order, zones=None):
    """Bytes of the guest's free memory in blocks smaller than 2^order pages (in `zones`, or all)."""
    return sum(n * (PAGE << k) for z, ns in buddy.items() if zones is None or z in zones
               for k, n in enumerate(ns) if k < order)


def main():
    idle_s = float(sys.argv[1]) if len(sys.argv) > 1 else 10
    variants = (sys.argv[2] if len(sys.argv) > 2 else "on,off").split(",")
    load0 = os.getloadavg()
    res = {}
    for v in variants:
        res[v] = r = run(v, idle_s)
        print(f"{v}: order {r['order']}, guest RAM Rss before {fmt_mib(r['before']['guest_rss'])}, after the "
              f"burst {fmt_mib(r['burst']['guest_rss'])}, after idle {fmt_mib(r['idle']['guest_rss'])}, "
              f"MemFree {fmt_mib(r['meminfo']['MemFree'])}, first 16 MiB resident "
              f"{fmt_mib(r['idle']['dma_resident'])}, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    print(f"one sandbox of {MEM_MIB} MiB, 1 vCPU, cold boot (tpl, tpl-off: made from the template); `python3 -c \"b = b'x' * ({BURST_MIB} << 20)\"` "
          f"(writes {BURST_MIB} MiB, frees it on exit), then {idle_s:.0f} s idle (and {3 * idle_s:.0f} s)")
    print(f"host: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in load0)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print()
    print(f"| free page reporting | order in the guest | guest MemTotal − MemFree | guest {MEM_MIB} MiB − MemFree | "
          "guest RAM Rss before | right after the burst | **after idle** | after 3× idle | "
          f"**ratio Rss / (MemTotal − MemFree)** | ratio Rss / ({MEM_MIB} MiB − MemFree) | "
          "QEMU Rss − guest RAM (overhead) | of which TCG code cache | burst s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        r = res[v]
        mi, m = r["meminfo"], r["idle"]
        used = mi["MemTotal"] - mi["MemFree"]
        used_all = MEM_MIB * MIB - mi["MemFree"]
        print(f"| {v} | {r['order']} | {fmt_mib(used)} | {fmt_mib(used_all)} | "
              f"{fmt_mib(r['before']['guest_rss'])} | {fmt_mib(r['burst']['guest_rss'])} | "
              f"**{fmt_mib(m['guest_rss'])}** | {fmt_mib(r['idle3']['guest_rss'])} | "
              f"**{m['guest_rss'] / used:.2f}** | {m['guest_rss'] / used_all:.2f} | "
              f"{fmt_mib(m['overhead'])} | {fmt_mib(m['tcg'])} | {r['burst_s']:.1f} |")
    print()
    print("where the guest's memory sits after idle (MiB): MemFree, of it in free blocks below "
          "2 MiB (order < 9) and below 64 KiB (order < 4); page cache (Cached), slab, page tables; "
          "then the same after 3× idle")
    for v in variants:
        r = res[v]
        for tag, mi, buddy in (("idle", r["meminfo"], r["buddy"]), ("3x", r["meminfo3"], r["buddy3"])):
            print(f"  {v:6} {tag:4}: MemFree {fmt_mib(mi['MemFree'])}, <2M {fmt_mib(free_below(buddy, 9))}, "
                  f"<64K {fmt_mib(free_below(buddy, 4))}, free in the DMA zone "
                  f"{fmt_mib(free_below(buddy, 11, ('DMA',)))}, Cached {fmt_mib(mi['Cached'])}, "
                  f"Slab {fmt_mib(mi['Slab'])}, PageTables {fmt_mib(mi['PageTables'])}, "
                  f"AnonPages {fmt_mib(mi['AnonPages'])}, buddyinfo {buddy}")
        print(f"  {v:6} guest RAM mapped by huge pages on the host (smaps ShmemPmdMapped + FilePmdMapped "
              f"+ AnonHugePages): {fmt_mib(r['idle']['guest_huge'])}; of the guest's first 16 MiB "
              f"(its DMA zone) resident on the host: {fmt_mib(r['idle']['dma_resident'])}")
    print(f"(MiB; guest RAM = QEMU's mapping of the guest's memory file, or of the template's image, "
          f"from /proc/<qemu>/smaps; "
          f"MemTotal {fmt_mib(res[variants[0]]['meminfo']['MemTotal'])} MiB of the {MEM_MIB} MiB)")


if __name__ == "__main__":
    main()
