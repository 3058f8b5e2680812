"""bench_codeint.py - code-interpreter-v1 against the base template, in the same run.

Run by bench/e2b/codeint.sh (throwaway Postgres and Redis, KILN_BUILD_DIR, KILN_SERVICES_ENV). A
real kiln-gateway and kiln-node (tests/harness/kiln.py) with templates on builds the warm
templates of both images at start (the code interpreter's waits for its worker, with numpy,
pandas and matplotlib imported). Then ROUNDS times, base then code interpreter: POST
/v1/sandboxes until 201 (a restore: its lineage is checked), the first exec of
`python3 -c 'print(1)'`, and the sandbox is kept. After IDLE_SETTLE_S, the PSS of each sandbox's
QEMU process. Prints medians per template and the ratios code interpreter / base.

usage: bench_codeint.py [ROUNDS]
"""
import os
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
import kiln  # noqa: E402
from bench_vm import on_term, smaps_rollup, vm_pids  # noqa: E402

MIB = 1 << 20
IDLE_SETTLE_S = 10
NODE_ENV = {"KILN_LOG_LEVEL": "info", "KILN_NODE_VCPU_MILLI": "64000", "KILN_NODE_MEMORY_MIB": "32768",
            "KILN_NODE_MAX_SANDBOXES": "64", "KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true"}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    kiln.guest_image()
    t0 = time.monotonic()
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info"})
    live = []
    try:
        gw = stack.gw
        key = stack.tenant("bench")
        stack.db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
                     "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
                     "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        while (stack.node.output().count(" ready in ") < 2 or
               "(code interpreter) of" not in stack.node.output()):
            if time.monotonic() - t0 > 1200:
                raise RuntimeError("the templates were not built:\n" + stack.node.output()[-3000:])
            time.sleep(0.5)
        print(f"both templates ready {time.monotonic() - t0:.1f} s after the node started", flush=True)
        rows = {"python": [], "code-interpreter-v1": []}
        for i in range(rounds):
            for tmpl in rows:
                c0 = time.monotonic()
                r = gw.request("POST", "/v1/sandboxes", {"template": tmpl, "timeout_s": 3600}, key,
                               timeout=300)
                dc = time.monotonic() - c0
                if r.status != 201:
                    raise RuntimeError(f"create {tmpl}: {r}")
                sid = r.json()["id"]
                live.append(sid)
                lineage = stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sid}'")
                if not lineage:
                    raise RuntimeError(f"{sid} ({tmpl}) was cold-booted, not restored")
                e0 = time.monotonic()
                r = gw.request("POST", f"/v1/sandboxes/{sid}/exec",
                               {"cmd": ["python3", "-c", "print(1)"]}, key, timeout=300)
                de = time.monotonic() - e0
                if r.status != 200 or r.json().get("stdout") != "1\n":
                    raise RuntimeError(f"first exec in {sid}: {r}")
                rows[tmpl].append([sid, dc, de])
                print(f"  {tmpl:20s} {i + 1}: create {dc:5.2f} s  first exec {de:5.2f} s", flush=True)
        time.sleep(IDLE_SETTLE_S)
        for tmpl, rs in rows.items():
            for row in rs:
                row.append(sum(smaps_rollup(p).get("Pss", 0) for p in vm_pids(stack.node.node_id, row[0])))
        med = {t: [statistics.median(r[k] for r in rs) for k in (1, 2, 3)] for t, rs in rows.items()}
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        print("| template | sandboxes | create → 201 median s | first exec median s | PSS median MiB |")
        print("|---|---|---|---|---|")
        for t, (c, e, m) in med.items():
            print(f"| {t} | {rounds} | {c:.2f} | {e:.2f} | {m / MIB:.1f} |")
        b, ci = med["python"], med["code-interpreter-v1"]
        print(f"ratios code-interpreter-v1 / base: create {ci[0] / b[0]:.2f}, first exec "
              f"{ci[1] / b[1]:.2f}, PSS {ci[2] / b[2]:.2f}")
    finally:
        for sid in live:
            stack.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
        stack.cleanup()


if __name__ == "__main__":
    main()
