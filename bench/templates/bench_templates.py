"""bench_templates.py - create from a template vs cold boot: latency to running, to first Python
exec, and the memory of many sandboxes made from one template vs as many cold-booted ones.

Run by bench/templates/templates.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). Everything goes through a real kiln-gateway and kiln-node
(tests/harness/kiln.py Stack) with jailed QEMU microVMs of the default shape (1 vCPU, 512 MiB,
10 GiB): the shape the node builds a template of at start (KILN_TEMPLATE_DEFAULT).

1. Templates on: the node starts, builds the template (timed until its snapshots row exists);
   then TEMPLATE_RUNS × (POST /v1/sandboxes until 201 with state running — the node answers after
   the restored agent took the sandbox's fresh identity —, the first exec of
   `python3 -c 'print(1)'` until 200, delete), one after another; every sandbox's lineage is
   checked to be the template (a restore, not a boot).
2. MEM_VMS sandboxes from the template, created one after another and kept, each after its first
   exec; after IDLE_SETTLE_S, the PSS (/proc/PID/smaps_rollup) of their QEMU processes, summed.
3. The same node restarted with templates off (every create cold-boots): COLD_RUNS × the same
   create + first exec + delete, then MEM_VMS cold sandboxes measured as in 2.

With REPORTING "on" both phases' nodes boot their VMs with free page reporting
(KILN_FREE_PAGE_REPORTING=1): a create from the template then restores into a copy of the
template's image of its own (docs/vmm.md, "Free page reporting"), whose Pss is its guest memory.
The page cache of the guest image's files (kernel, initramfs, root file system: every VM of either
side reads them) is measured after each memory phase and counted on both sides; the template's
image's on the template side, and so are the QEMUs the node keeps started ahead on the template
while they wait (node/warm.c, template_warm_vms; their Pss, found by their cgroups kiln/<node>/0…).

usage: bench_templates.py [TEMPLATE_RUNS] [COLD_RUNS] [MEM_VMS] [REPORTING]
"""
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
from bench_vm import (on_term, resident_bytes, scan_smaps, smaps_rollup, teardown, vm_pids,  # noqa: E402
                      wait_template, warm_vm_pids)

MIB = 1 << 20
SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}  # the default shape, spelled out
IDLE_SETTLE_S = 10
NODE_ENV = {"KILN_LOG_LEVEL": "info", "KILN_NODE_VCPU_MILLI": "64000",
            "KILN_BOOT_TIMEOUT_S": "600",  # cold boots under TCG on a loaded host
            "KILN_NODE_MEMORY_MIB": "32768", "KILN_NODE_MAX_SANDBOXES": "64"}
TEMPLATES_ON = dict(NODE_ENV, KILN_TEMPLATES="true", KILN_TEMPLATE_DEFAULT="true")
TEMPLATES_OFF = dict(NODE_ENV, KILN_TEMPLATES="false", KILN_TEMPLATE_DEFAULT="false")
FIRST_EXEC = {"cmd": ["python3", "-c", "print(1)"]}


def du_bytes(path):
    out = subprocess.run(["du", "-s", "--block-size=1", path], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[0])


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def main():
    truns = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    cruns = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    nmem = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    reporting = (sys.argv[4] if len(sys.argv) > 4 else "off") == "on"
    fpr = {"KILN_FREE_PAGE_REPORTING": "1" if reporting else "0"}
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    image = kiln.guest_image()
    image_files = [image[k] for k in ("KILN_GUEST_KERNEL", "KILN_GUEST_INITRD", "KILN_GUEST_ROOTFS")]
    t_node = time.monotonic()
    stack = kiln.Stack(node_env=dict(TEMPLATES_ON, **fpr), gateway_env={"KILN_LOG_LEVEL": "info"})
    live = []
    key = None
    ok = False
    loads = {"start": loadavg()}
    try:
        gw = stack.gw
        key = stack.tenant("bench")
        # The default plan allows 10 running sandboxes and 16 vCPUs.
        stack.db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
                     "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
                     "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        node_id = stack.node.node_id
        accel = stack.db.sql(f"SELECT accelerator FROM nodes WHERE id = '{node_id}'") or "?"

        # On a loaded host the template's QEMU may not answer QMP in time and the node gives the
        # template up ("not built"): start the node again, which tries again, up to 3 times.
        give_up = time.monotonic() + 1800

        def template_row():
            return stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL "
                                f"AND node_id = '{stack.node.node_id}'")

        for attempt in range(3):
            while time.monotonic() < give_up and not template_row() and "not built" not in stack.node.output():
                time.sleep(1)
            if template_row() or "not built" not in stack.node.output() or attempt == 2:
                break
            print("the node gave its template up; starting it again", flush=True)
            stack.restart_node(dict(TEMPLATES_ON, **fpr))
        waited_from = time.monotonic() - t_node
        template, t_template, t_usable = wait_template(stack, 600)
        t_template += waited_from
        t_usable += waited_from
        tdir = f"{stack.node.data_dir}/snaps/{node_id}/{template}"
        t_alloc = du_bytes(tdir)
        print(f"template {template}: row {t_template:.1f} s, usable {t_usable:.1f} s after the node was "
              f"started ({t_alloc / MIB:.1f} MiB allocated on disk); accelerator {accel}", flush=True)
        loads["template ready"] = loadavg()

        def create(expect_template):
            for attempt in range(3):
                # a create the loaded host could not start in time (502, 503) is tried again
                t0 = time.monotonic()
                r = gw.request("POST", "/v1/sandboxes", dict(SHAPE, timeout_s=3600), key, timeout=300)
                dt = time.monotonic() - t0
                if r.status not in (502, 503):
                    break
                print(f"  create failed ({r.status}), trying again", flush=True)
            if r.status != 201 or r.json().get("state") != "running":
                raise RuntimeError(f"create: {r}")
            sb = r.json()
            live.append(sb["id"])
            lineage = stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sb['id']}'")
            if expect_template and lineage != template:
                raise RuntimeError(f"{sb['id']} was not restored from the template (lineage {lineage!r})")
            if not expect_template and lineage:
                raise RuntimeError(f"{sb['id']} was not cold-booted (lineage {lineage!r})")
            return sb["id"], dt

        def first_exec(sid):
            t0 = time.monotonic()
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", FIRST_EXEC, key, timeout=300)
            if r.status != 200 or r.json().get("stdout") != "1\n" or r.json().get("exit_code") != 0:
                raise RuntimeError(f"first exec in {sid}: {r}")
            return time.monotonic() - t0

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            live.remove(sid)

        def warm_pss(node_id):
            """(count, Pss) of the QEMUs started ahead that wait now."""
            waiting = warm_vm_pids(node_id)
            return len(waiting), sum(smaps_rollup(p)["Pss"] for pids in waiting.values() for p in pids)

        def latency(n, expect_template, label):
            rows = []
            for i in range(n):
                took = stack.node.output().count("its VMM started ahead")
                sid, dc = create(expect_template)
                # the create's restore line says whether it took a QEMU started ahead (node/warm.c)
                took = stack.node.output().count("its VMM started ahead") > took
                fe = first_exec(sid)
                delete(sid)
                rows.append((dc, fe, took))
                print(f"  {label} {i + 1:2d}: create {dc:6.2f} s  first exec {fe:5.2f} s"
                      + ("  (its VMM started ahead)" if took else ""), flush=True)
            return rows

        def memory(n, expect_template, label):
            """Sums over the sandboxes' QEMU processes (bytes), and each create's latency. The
            guest's part is the Pss of the mapping of the file behind its RAM: the template's image
            (mapped privately, with the pages copied on write) or a cold VM's own file in /dev/shm."""
            ids, creates = [], []
            for i in range(n):
                sid, dc = create(expect_template)
                first_exec(sid)
                ids.append(sid)
                creates.append(dc)
                print(f"  {label} {i + 1:2d}: create {dc:6.2f} s", flush=True)
            time.sleep(IDLE_SETTLE_S)
            rows = []
            for sid in ids:
                pids = vm_pids(stack.node.node_id, sid)
                if not pids:
                    raise RuntimeError(f"no VMM process in the cgroup of {sid}")
                # a VM's own file in /dev/shm: a cold VM's, or a copy of the template's image
                own = f"/dev/shm/kiln-{stack.node.node_id}-{sid}.mem"
                st = os.stat(os.path.join(tdir, "mem") if expect_template and not os.path.exists(own)
                             else own)
                r = dict.fromkeys(("Pss", "Rss", "Private", "Anonymous", "guest_pss", "tcg"), 0)
                # a file of its own is resident in full, mapped or not: a copy of the template's
                # image holds the pages the guest has not touched since the restore too
                r["own_resident"] = resident_bytes(own) if os.path.exists(own) else 0
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
            extra = {"creates": creates, "image_files": sum(resident_bytes(f) for f in image_files),
                     "warm": warm_pss(stack.node.node_id)}
            if expect_template:
                extra["image_resident"] = resident_bytes(os.path.join(tdir, "mem"))
            for sid in ids:
                delete(sid)
            return {k: sum(r[k] for r in rows) for k in rows[0]}, rows, extra

        print(f"\ntemplates on: {truns} × (create, first exec, delete)", flush=True)
        t_lat = latency(truns, True, "template")
        loads["template latency"] = loadavg()
        print(f"\ntemplates on: {nmem} sandboxes kept, each after its first exec; measured after "
              f"{IDLE_SETTLE_S} s idle", flush=True)
        t_mem, t_rows, t_extra = memory(nmem, True, "template")
        print(f"  Pss {t_mem['Pss'] / MIB:.1f} MiB (guest memory {t_mem['guest_pss'] / MIB:.1f}, TCG code "
              f"cache {t_mem['tcg'] / MIB:.1f}); the sandboxes' own memory files resident "
              f"{t_mem['own_resident'] / MIB:.1f}; the template's image in the page cache "
              f"{t_extra['image_resident'] / MIB:.1f}, the guest image's files {t_extra['image_files'] / MIB:.1f}",
              flush=True)
        loads["template memory"] = loadavg()

        print("\nrestarting the node with templates off", flush=True)
        stack.restart_node(dict(TEMPLATES_OFF, **fpr))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # Placement needs the restarted node's fresh heartbeat.
            if stack.db.sql(f"SELECT heartbeat_at > now() - interval '5 seconds' FROM nodes WHERE id = '{node_id}'") == "t":
                break
            time.sleep(0.5)
        print(f"\ntemplates off: {cruns} × (create, first exec, delete)", flush=True)
        c_lat = latency(cruns, False, "cold")
        loads["cold latency"] = loadavg()
        print(f"\ntemplates off: {nmem} sandboxes kept, each after its first exec; measured after "
              f"{IDLE_SETTLE_S} s idle", flush=True)
        c_mem, c_rows, c_extra = memory(nmem, False, "cold")
        loads["cold memory"] = loadavg()

        # ---- figures ----
        print()
        print(f"free page reporting: {'on' if reporting else 'off'}")
        print(f"accelerator (nodes.accelerator): {accel}; {os.cpu_count()} CPUs; load average (1/5/15 min) "
              + "; ".join(f"{k}: {v}" for k, v in loads.items()))
        print()
        print(f"| default shape (1 vCPU, 512 MiB, 10 GiB) | runs | median s | min s | max s |")
        print("|---|---|---|---|---|")
        for label, rows, f in (("create → 201 running, templates on", t_lat, lambda r: r[0]),
                               ("create → 201 running, cold boot (templates off)", c_lat, lambda r: r[0]),
                               ("first exec after a create from the template", t_lat, lambda r: r[1]),
                               ("first exec after a cold boot", c_lat, lambda r: r[1]),
                               ("**create + first exec, templates on**", t_lat, lambda r: r[0] + r[1]),
                               ("**create + first exec, cold boot**", c_lat, lambda r: r[0] + r[1])):
            print(f"| {label} | {len(rows)} | " + " | ".join(f"{x:.2f}" for x in stats([f(r) for r in rows])) + " |")
        for label, xs in ((f"create → 201, templates on, beside the 0..{nmem - 1} kept ones (memory phase)",
                           t_extra["creates"]),
                          (f"create → 201, cold boot, beside the 0..{nmem - 1} kept ones (memory phase)",
                           c_extra["creates"])):
            print(f"| {label} | {len(xs)} | " + " | ".join(f"{x:.2f}" for x in stats(xs)) + " |")
        print(f"creates from the template on a VMM started ahead: {sum(r[2] for r in t_lat)} of {len(t_lat)}")
        mt = statistics.median(r[0] for r in t_lat)
        mc = statistics.median(r[0] for r in c_lat)
        print(f"\nratio cold / template, create (medians): {mc / mt:.1f}× (aim ≥ 15×)")
        print(f"ratio cold / template, create + first exec (medians): "
              f"{statistics.median(r[0] + r[1] for r in c_lat) / statistics.median(r[0] + r[1] for r in t_lat):.1f}×")
        print(f"template build (node start → template row): {t_template:.1f} s, → ready in the node "
              f"{t_usable:.1f} s; its snapshot directory {t_alloc / MIB:.1f} MiB allocated")

        print()
        print(f"| {nmem} sandboxes, each after one `python3 -c 'print(1)'`, idle {IDLE_SETTLE_S} s | Pss | "
              "of which guest memory | of which TCG code cache | of which the rest of QEMU | Rss | Private | "
              "Anonymous | Pss per sandbox |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, m in (("from one template", t_mem), ("cold-booted", c_mem)):
            rest = m["Pss"] - m["guest_pss"] - m["tcg"]
            print(f"| {label} | {m['Pss'] / MIB:.1f} | {m['guest_pss'] / MIB:.1f} | {m['tcg'] / MIB:.1f} | "
                  f"{rest / MIB:.1f} | {m['Rss'] / MIB:.1f} | {m['Private'] / MIB:.1f} | "
                  f"{m['Anonymous'] / MIB:.1f} | {m['Pss'] / nmem / MIB:.1f} |")
        print("(MiB, summed over the sandboxes' QEMU processes)")
        print("per template sandbox Pss MiB: " + ", ".join(f"{r['Pss'] / MIB:.1f}" for r in t_rows))
        print("per cold sandbox Pss MiB: " + ", ".join(f"{r['Pss'] / MIB:.1f}" for r in c_rows))
        print(f"ratio template / cold (Pss sums): {t_mem['Pss'] / c_mem['Pss']:.2f} (aim ≤ 0.4); "
              f"by Rss: {t_mem['Rss'] / c_mem['Rss']:.2f}; guest memory alone (Pss): "
              f"{t_mem['guest_pss'] / c_mem['guest_pss']:.2f}; without the TCG code cache, which KVM "
              f"does not have: {(t_mem['Pss'] - t_mem['tcg']) / (c_mem['Pss'] - c_mem['tcg']):.2f}")
        print(f"the template's memory image in the page cache when measured: "
              f"{t_extra['image_resident'] / MIB:.1f} MiB (mapped pages of it are in the sandboxes' Pss)")
        print(f"counting that whole page cache as the template sandboxes' too: "
              f"({t_mem['Pss'] / MIB:.1f} + {t_extra['image_resident'] / MIB:.1f}) / {c_mem['Pss'] / MIB:.1f} = "
              f"{(t_mem['Pss'] + t_extra['image_resident']) / c_mem['Pss']:.2f}")

        def host(m):
            """Pss, with a VM's own memory file counted whole (resident) instead of its mapped part."""
            return m["Pss"] - (m["guest_pss"] if m["own_resident"] else 0) + m["own_resident"]

        t_all = host(t_mem) + t_extra["image_resident"] + t_extra["image_files"] + t_extra["warm"][1]
        c_all = host(c_mem) + c_extra["image_files"]
        print(f"the guest image's files (kernel, initramfs, root file system) in the page cache: "
              f"{t_extra['image_files'] / MIB:.1f} MiB after the template phase, "
              f"{c_extra['image_files'] / MIB:.1f} MiB after the cold one")
        print(f"QEMUs started ahead on the template, waiting beside the template's sandboxes: "
              f"{t_extra['warm'][0]}, Pss {t_extra['warm'][1] / MIB:.1f} MiB (beside the cold ones: "
              f"{c_extra['warm'][0]})")
        print(f"counting every page cache on both sides, the VMs' own memory files whole and the QEMUs "
              f"started ahead: ({host(t_mem) / MIB:.1f} + "
              f"{t_extra['image_resident'] / MIB:.1f} + {t_extra['image_files'] / MIB:.1f} + "
              f"{t_extra['warm'][1] / MIB:.1f}) / "
              f"({host(c_mem) / MIB:.1f} + {c_extra['image_files'] / MIB:.1f}) = {t_all / c_all:.2f}; "
              f"without the TCG code cache: {(t_all - t_mem['tcg']) / (c_all - c_mem['tcg']):.2f}")
        print(f"\ntotal bench time: {time.monotonic() - t_start:.0f} s")
        ok = True
    finally:
        teardown(stack, key, live, ok)


if __name__ == "__main__":
    main()
