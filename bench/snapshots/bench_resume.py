"""bench_resume.py - create and resume against a cold boot of the same image, interleaved.

Run by bench/snapshots/resume.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). One stack (tests/harness/kiln.py): a kiln-gateway, node A
with warm templates on (it builds the default shape's template at start) and node B with them off
(every create there boots the base image cold), the tenant's bucket on s3rver behind the checking
proxy (tests/integration/s3/s3env.py), sandboxes of the default shape (1 vCPU, 512 MiB, 10 GiB).
Where each step runs is chosen with the admin drain and undrain of the other node.

Per round, in this order:
  (a) cold: B open, A drained: POST /v1/sandboxes → 201 (B boots the base image; its lineage is
      checked empty). This sandbox S serves (c), (d) and (e).
  (c) warm: S paused (its snapshot stored in the bucket before going on, so the upload does not
      run beside the resume), then resumed on B with the snapshot's files in the page cache, on
      the QEMU node B started ahead on the pause snapshot when one waits (node/warm.c,
      paused_warm_vms; counted in the output, as for (d)).
  (d) dropped: S paused and stored, `sync; echo 3 > /proc/sys/vm/drop_caches` (the whole host's
      page cache, dentries and inodes), then resumed on B.
  (e) bucket: S paused and stored, A open, B drained: the resume is placed on A, which fetches the
      snapshot from the bucket (download, decrypt, unpack, verify), then restores it. S deleted.
  (b) template: POST /v1/sandboxes on A → 201, restored from the template (lineage checked), on
      the QEMU node A started ahead for it when one waits (node/warm.c; counted in the output).
Each timed from the POST to its 201 (create) or 200 (resume), and to the first exec (`true`)
answering. The node's phases for each restore (`snapshot "…" verified in N ms`, `restored from …
in N ms: network, vmm, agent, disk, identity, policy (after the agent; images checked in N of the
network's)`, and the network's parts: `network up in N ms: uid, netns, gate, policy, rules, dns,
sni, attach (programs loaded ahead in N)`, docs/network-policy.md "Setup time") are parsed from
its log; for (e) the fetch is the time from the POST to the node's `snapshot "…" fetched from the
tenant's bucket` line (both on this host's clock), and after it the bench downloads the same
object once more with the node's own S3 client (tests/integration/s3/s3_tool get) to split the
download from the rest of the fetch. At the end, the memory of node A's QEMU begun ahead for the
template while it waits (its processes' Rss and Pss).

usage: bench_resume.py [ROUNDS]
"""
import datetime
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration", "s3"))
sys.path.insert(0, os.path.join(HERE, "..", "vm"))
import kiln  # noqa: E402
import s3env  # noqa: E402
from bench_vm import on_term, smaps_rollup, teardown, wait_template, warm_vm_pids  # noqa: E402

SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}  # the default shape: A's template's
COMMON = dict(s3env.ALLOW_ENV, KILN_LOG_LEVEL="info", KILN_NODE_VCPU_MILLI="64000",
              KILN_NODE_MEMORY_MIB="32768", KILN_BOOT_TIMEOUT_S="900")  # cold boots under load
# no code interpreter's image: its own templates would be VMs beside the bench's
NODE_A = dict(COMMON, KILN_TEMPLATES="true", KILN_TEMPLATE_DEFAULT="true", KILN_GUEST_CODEINT_ROOTFS="")
NODE_B = dict(COMMON, KILN_TEMPLATES="false", KILN_TEMPLATE_DEFAULT="false")
PREFIX = "kiln/"
FIRST_EXEC = {"cmd": ["true"], "user": "root", "cwd": "/"}
KINDS = (("a", "cold boot of the base image (node B, templates off): create"),
         ("b", "create from the base's warm template (node A)"),
         ("c", "resume, warm page cache (right after the pause)"),
         ("d", "resume after dropping the host's caches"),
         ("e", "resume on the other node from the tenant's bucket"))
TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z ")
RESTORED = re.compile(r"restored from \S+/(snap_[^/\s]+) in (\d+) ms: network (\d+), vmm (\d+), "
                      r"agent (\d+), disk (\d+), identity (\d+)(?:, policy (\d+))?")
VERIFIED = re.compile(r"snapshot \"(snap_[^\"]+)\" verified in (\d+) ms")
FETCHED = re.compile(r"snapshot \"(snap_[^\"]+)\" fetched from the tenant's bucket")
IMAGES = re.compile(r"images checked in (\d+) of the network's\)")
# the network's parts (node/sandbox.c, sb_net_base and sb_net_policy); since the gate, a restore
# sets up uid, netns and gate before the VMM and the rest ("policy" in the restore line) after
# the agent's hello; "loaded ahead": the eBPF programs' load on a thread of its own from the
# sandbox's slot on (sb_net_prepare), not part of either
NETUP = re.compile(r"sandbox \"([^\"]+)\": network up in (\d+) ms: uid (\d+), netns (\d+), "
                   r"(?:gate (\d+), )?policy (\d+), rules (\d+), dns (\d+), sni (\d+)"
                   r"(?:, attach (\d+))?(?: \(programs loaded ahead in (-?\d+)\))?")
NET_PARTS = ("net: uid", "net: netns", "net: gate", "net: policy", "net: rules", "net: dns",
             "net: sni", "net: attach", "net: loaded ahead")
PHASES = ("fetch", "download", "rest of fetch", "verify", "restore", "network", "images") + NET_PARTS + (
          "vmm", "agent", "policy", "disk", "identity")


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def log_phases(node, snap, since, sid=None):
    """The phases `node` logged for `snap` after wall time `since`: {phase: ms}, the fetch as the
    time from `since` to the line saying the fetch ended; with `sid`, the parts of the network
    phase of that sandbox (the node logs them where it logs them)."""
    out = {}
    for line in node.output().splitlines():
        m = TS.match(line)
        if not m:
            continue
        at = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(
            tzinfo=datetime.timezone.utc).timestamp()
        if at < since - 0.002:
            continue
        if (v := VERIFIED.search(line)) and v.group(1) == snap:
            out["verify"] = int(v.group(2))
        elif (f := FETCHED.search(line)) and f.group(1) == snap:
            out["fetch"] = round((at - since) * 1000)
        elif (r := RESTORED.search(line)) and r.group(1) == snap:
            for k, g in zip(("restore", "network", "vmm", "agent", "disk", "identity", "policy"),
                            range(2, 9)):
                if r.group(g) is not None:
                    out[k] = int(r.group(g))
            if im := IMAGES.search(line):
                out["images"] = int(im.group(1))
            if "its VMM started ahead" in line:
                out["started ahead"] = 1  # node/warm.c: a create or resume that took a waiting QEMU
        elif sid and (u := NETUP.search(line)) and u.group(1) == sid:
            for k, g in zip(NET_PARTS, range(3, 12)):
                if u.group(g) is not None and int(u.group(g)) >= 0:
                    out[k] = int(u.group(g))
    return out


def warm_memory(node, timeout=30):
    """Prints what a QEMU begun ahead (node/warm.c) holds while it waits: its processes' Rss and
    Pss (smaps_rollup), found in its cgroup kiln/<node>/0… (a taken one's is renamed)."""
    deadline = time.time() + timeout
    while not (waiting := warm_vm_pids(node.node_id)) and time.time() < deadline:
        time.sleep(0.5)
    if not waiting:
        print("no QEMU waits started ahead on node A")
        return
    pids = next(iter(waiting.values()))
    rolls = [smaps_rollup(p) for p in pids]
    print(f"a QEMU started ahead, waiting (node A, {len(pids)} process): "
          f"Rss {sum(r['Rss'] for r in rolls) / (1 << 20):.1f} MiB, "
          f"Pss {sum(r['Pss'] for r in rolls) / (1 << 20):.1f} MiB")


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    kiln.guest_image()
    s3 = s3env.S3Server()
    stack = kiln.Stack(node_env=NODE_A, gateway_env=dict(s3env.ALLOW_ENV, KILN_LOG_LEVEL="info"))
    b_node = None
    live, key, ok = [], None, False
    loads = {"start": loadavg()}
    try:
        gw, db, a_node = stack.gw, stack.db, stack.node
        key = stack.tenant("bench")
        db.sql("INSERT INTO plan_limits (plan, max_sandboxes, max_vcpu_milli, max_memory_mib, "
               "max_snapshot_bytes) VALUES ('bench', 64, 64000, 65536, 53687091200); "
               "UPDATE tenants SET plan = 'bench' WHERE name = 'bench'")
        r = gw.request("PUT", "/v1/storage", dict(s3.target(prefix=PREFIX), kind="s3"), key)
        if r.status != 200:
            raise RuntimeError(f"PUT /v1/storage: {r}")
        b_node = stack.add_node(NODE_B)
        accel = db.sql(f"SELECT accelerator FROM nodes WHERE id = '{a_node.node_id}'") or "?"
        template, _, t_usable = wait_template(stack, 900)
        print(f"node A {a_node.node_id} (warm templates on): template {template} usable after {t_usable:.1f} s; "
              f"node B {b_node.node_id} (templates off); accelerator {accel}; load {loadavg()}", flush=True)
        loads["template ready"] = loadavg()

        def admin(node, what):
            r = gw.request("POST", f"/v1/admin/nodes/{node.node_id}/{what}", None, stack.admin, timeout=600)
            if r.status != 200:
                raise RuntimeError(f"{what} of {node.node_id}: {r}")
            return r.json()

        def open_only(node):
            """Placement on `node` alone: it undrained, the other drained (its paused sandboxes
            stay, stored in the bucket)."""
            other = b_node if node is a_node else a_node
            admin(node, "undrain")
            got = admin(other, "drain")
            if got.get("moved"):
                raise RuntimeError(f"the drain of {other.node_id} moved {got['moved']}")

        def first_exec(sid, t0):
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", FIRST_EXEC, key, timeout=300)
            if r.status != 200 or r.json().get("exit_code") != 0:
                raise RuntimeError(f"first exec in {sid}: {r}")
            return time.monotonic() - t0

        def where(sid):
            return db.sql(f"SELECT node_id || '|' || coalesce(array_to_string(lineage, ','), '') "
                          f"FROM sandboxes WHERE id = '{sid}'").split("|")

        def create(node, lineage):
            t0 = time.monotonic()
            r = gw.request("POST", "/v1/sandboxes", dict(SHAPE, timeout_s=3600), key, timeout=900)
            t201 = time.monotonic() - t0
            if r.status != 201 or r.json().get("state") != "running":
                raise RuntimeError(f"create: {r}")
            sid = r.json()["id"]
            live.append(sid)
            texec = first_exec(sid, t0)
            got = where(sid)
            if got != [node.node_id, lineage]:
                raise RuntimeError(f"{sid}: node and lineage {got}, want {[node.node_id, lineage]}")
            return sid, (t201, texec)

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=300)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            live.remove(sid)

        def pause_stored(sid):
            r = gw.request("POST", f"/v1/sandboxes/{sid}/pause", None, key, timeout=300)
            if r.status != 200 or r.json().get("state") != "paused":
                raise RuntimeError(f"pause of {sid}: {r}")
            snap = db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{sid}'")
            deadline = time.monotonic() + 600
            while (st := db.sql(f"SELECT status FROM snapshots WHERE id = '{snap}'")) != "stored":
                if st == "failed" or time.monotonic() > deadline:
                    raise RuntimeError(f"snapshot {snap} of {sid} not stored in the bucket: {st}")
                time.sleep(0.2)
            return snap

        def resume(sid, node, snap):
            since = time.time()
            t0 = time.monotonic()
            r = gw.request("POST", f"/v1/sandboxes/{sid}/resume", None, key, timeout=900)
            t200 = time.monotonic() - t0
            if r.status != 200 or r.json().get("state") != "running":
                raise RuntimeError(f"resume of {sid}: {r}")
            texec = first_exec(sid, t0)
            if where(sid)[0] != node.node_id:
                raise RuntimeError(f"{sid} resumed on {where(sid)[0]}, not {node.node_id}")
            return (t200, texec), log_phases(node, snap, since, sid)

        def download(snap):
            """Seconds for the node's S3 client to download the snapshot's object again."""
            with tempfile.TemporaryDirectory(prefix="kiln-bench-get-") as d:
                t0 = time.monotonic()
                got, err = s3env.tool(s3.target(prefix=PREFIX), "get", f"snapshots/{snap}.kiln",
                                      os.path.join(d, "obj"))
                dt = time.monotonic() - t0
                if got.get("rc") != "ok":
                    raise RuntimeError(f"get of {snap}: {got} {err}")
                return dt, os.path.getsize(os.path.join(d, "obj"))

        times = {k: [] for k, _ in KINDS}
        phases = {k: [] for k, _ in KINDS}
        drops, objects = [], []
        print(f"{rounds} rounds of (a) cold, (c) warm resume, (d) resume after drop_caches, (e) resume "
              f"from the bucket on the other node, (b) create from the template; s to 201|200 / to the "
              f"first exec", flush=True)
        for i in range(rounds):
            open_only(b_node)
            sid, t = create(b_node, "")
            times["a"].append(t)
            snap = pause_stored(sid)
            t, ph = resume(sid, b_node, snap)
            times["c"].append(t)
            phases["c"].append(ph)
            snap = pause_stored(sid)
            t0 = time.monotonic()
            subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
            drops.append(time.monotonic() - t0)
            t, ph = resume(sid, b_node, snap)
            times["d"].append(t)
            phases["d"].append(ph)
            snap = pause_stored(sid)
            open_only(a_node)
            t, ph = resume(sid, a_node, snap)
            dl, size = download(snap)
            ph["download"] = round(dl * 1000)
            if "fetch" in ph:
                ph["rest of fetch"] = ph["fetch"] - ph["download"]
            objects.append(size)
            times["e"].append(t)
            phases["e"].append(ph)
            delete(sid)
            since = time.time()
            sid, t = create(a_node, template)
            times["b"].append(t)
            phases["b"].append(log_phases(a_node, template, since, sid))
            delete(sid)
            print(f"  round {i + 1}: " + "  ".join(f"{k} {times[k][-1][0]:.2f}/{times[k][-1][1]:.2f}"
                                                   for k, _ in KINDS)
                  + f"  (drop_caches {drops[-1]:.1f} s; load {loadavg()})", flush=True)
            for k in "bcde":
                print(f"    {k} phases ms: " + ", ".join(f"{p} {phases[k][-1][p]}" for p in PHASES
                                                      if p in phases[k][-1]), flush=True)
        loads["end"] = loadavg()
        warm_memory(a_node)

        print()
        print(f"accelerator {accel}; {os.cpu_count()} CPUs; load average (1/5/15 min) "
              + "; ".join(f"{k}: {v}" for k, v in loads.items()))
        print()
        print(f"| default shape (1 vCPU, 512 MiB, 10 GiB), {rounds} rounds | to 201/200: median s | min | max "
              "| to the first exec: median s | min | max |")
        print("|---|---|---|---|---|---|---|")
        for k, label in KINDS:
            a = stats([t[0] for t in times[k]])
            x = stats([t[1] for t in times[k]])
            print(f"| ({k}) {label} | " + " | ".join(f"{v:.2f}" for v in a + x) + " |")
        med = {k: (statistics.median(t[0] for t in times[k]), statistics.median(t[1] for t in times[k]))
               for k, _ in KINDS}
        for k in "bcde":
            print(f"ratio cold / ({k}) (medians): {med['a'][0] / med[k][0]:.1f}× to 201/200, "
                  f"{med['a'][1] / med[k][1]:.1f}× to the first exec" + (" (aim ≥ 20×)" if k in "bc" else ""))
        print()
        print("| node's phases, ms (median, min–max) | " + " | ".join(f"({k})" for k in "bcde") + " |")
        print("|---|" + "---|" * 4)
        for p in PHASES:
            cells = []
            for k in "bcde":
                xs = [ph[p] for ph in phases[k] if p in ph]
                cells.append(f"{statistics.median(xs):.0f} ({min(xs)}–{max(xs)})" if xs else "–")
            print(f"| {p} | " + " | ".join(cells) + " |")
        for k, what in (("b", "template_warm_vms"), ("c", "paused_warm_vms"), ("d", "paused_warm_vms"),
                        ("e", "none: the snapshot comes from the bucket")):
            ahead = sum(1 for ph in phases[k] if ph.get("started ahead"))
            print(f"({k}) on a VMM started ahead (node/warm.c, {what}): {ahead} of {len(phases[k])}")
        print(f"(b: the restore of the template, which is not verified per create; fetch: from the POST to "
              f"the node's line saying the fetch ended; download: the same object fetched again by the "
              f"node's S3 client right after; rest of fetch = fetch − download: decrypt, unpack, verify, "
              f"move into place (the two measured apart: under a changing load it can even come out "
              f"negative); object {statistics.median(objects) / (1 << 20):.1f} MiB median; "
              f"drop_caches took {statistics.median(drops):.1f} s median, not in any time)")
        print(f"\ntotal bench time: {time.monotonic() - t_start:.0f} s")
        ok = True
    finally:
        if b_node:
            for sid in list(live):
                try:
                    gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
                    live.remove(sid)
                except Exception:
                    pass
            b_node.cleanup()
        teardown(stack, key, live, ok, extra=(f"/dev/shm/kiln-{b_node.node_id}-*",) if b_node else ())
        s3.stop()


if __name__ == "__main__":
    main()
