"""bench_user_templates.py - create from a large user template against create from the base and a cold boot.

Run by bench/templates/user_templates.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). Everything goes through a real kiln-gateway and kiln-node
(tests/harness/kiln.py) with jailed QEMU microVMs of 512 MiB and 1 vCPU.

1. Builds template `big`: FROM base, one RUN writing EXTRA_MIB of data into the image (1 MiB of
   random bytes repeated), so
   its file system holds the base's content (about 500 MiB) plus EXTRA_MIB (1500: about 4x). The
   build's time is printed.
2. Warm templates on: the first create from `big` (alone), then RUNS times, interleaved: create
   from the base (its pre-booted template), create from `big`; each until 201, then the first
   exec, then deleted.
3. The node restarted with warm templates off: the first create from `big` after the restart
   (alone: the node hashes its image again), then RUNS times, interleaved: a cold boot of the base
   image, create from `big`.
Medians and ratios, and the median of each phase the node logged for the creates from `big`.

usage: bench_user_templates.py [RUNS] [EXTRA_MIB]
"""
import json
import os
import re
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
import kiln  # noqa: E402

SHAPE = {"vcpus": 1, "memory_mib": 512}
NODE_ENV = {"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
            "KILN_NODE_VCPU_MILLI": "64000", "KILN_NODE_MEMORY_MIB": "32768",
            "KILN_BOOT_TIMEOUT_S": "900",  # cold boots beside other work under TCG
            "KILN_TEMPLATE_BUILD_MAX_S": "7200"}  # the +1500 MiB write on a loaded host


def follow(gw, key, tmpl, version):
    req = urllib.request.Request(f"{gw.url}/v1/templates/{tmpl}/log?version={version}",
                                 headers=dict(key, Accept="text/event-stream"))
    event, end = None, None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "end":
                end = json.loads(line[6:])
                break
    return end


def timed_create(stack, key, body, lineage):
    """POST /v1/sandboxes until 201, the first exec, delete; (to 201, to the first exec) in s."""
    gw = stack.gw
    t0 = time.monotonic()
    r = gw.request("POST", "/v1/sandboxes", dict(body, timeout_s=600), key, timeout=600)
    assert r.status == 201, r
    t1 = time.monotonic()
    sb = r.json()["id"]
    x = stack.db.sql(f"SELECT coalesce(cardinality(lineage), 0) > 0 FROM sandboxes WHERE id = '{sb}'")
    assert lineage is None or x == ("t" if lineage else "f"), (sb, x)  # a restore, or a cold boot
    x = gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": ["true"], "user": "root", "cwd": "/"}, key,
                   timeout=300)
    assert x.status == 200, x
    t2 = time.monotonic()
    gw.request("DELETE", f"/v1/sandboxes/{sb}", None, key)
    return t1 - t0, t2 - t0


PHASES = re.compile(r"snapshot \"(snap_[^\"]+)\" verified in (\d+) ms|restored from \S+/(snap_[^/\s]+) in "
                    r"(\d+) ms: network (\d+), vmm (\d+), agent (\d+), disk (\d+), identity (\d+)")


def node_phases(node, snap):
    """The node's logged phases of every restore of `snap`: {phase: [ms, ...]}."""
    with open(node.log.name, errors="replace") as f:
        text = f.read()
    out = {k: [] for k in ("verify", "total", "network", "vmm", "agent", "disk", "identity")}
    for m in PHASES.finditer(text):
        if m.group(1) == snap:
            out["verify"].append(int(m.group(2)))
        elif m.group(3) == snap:
            for k, g in zip(("total", "network", "vmm", "agent", "disk", "identity"), range(4, 10)):
                out[k].append(int(m.group(g)))
    return out


def report(name, xs):
    print(f"{name}: median {statistics.median(x[0] for x in xs):.3f} s to 201, "
          f"{statistics.median(x[1] for x in xs):.3f} s to the first exec "
          f"({', '.join(f'{x[0]:.2f}/{x[1]:.2f}' for x in xs)})", flush=True)


def ratio(a, b):
    return statistics.median(x[1] for x in a) / statistics.median(x[1] for x in b)


def interleaved(stack, key, runs, warm):
    """RUNS times: a create of the base's shape (from its template when `warm`, else a cold boot),
    then one from `big`; the two lists of timings."""
    base, big = [], []
    for _ in range(runs):
        base.append(timed_create(stack, key, SHAPE, warm))
        big.append(timed_create(stack, key, {"template": "big"}, True))
    return base, big


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    extra = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info"})
    try:
        gw, key = stack.gw, stack.tenant("bench-templates")
        r = gw.request("POST", "/v1/templates", dict(SHAPE, name="big", disk_gib=10), key)
        assert r.status == 201, r
        tmpl, v = r.json()["id"], r.json()["version"]
        # 1 MiB of random bytes repeated: real data on the disk (qcow2 neither dedups nor
        # compresses it) without drawing 1.5 GiB from the guest's RNG under TCG (15 min), written
        # by one process (a `cat` per MiB spent its time in fork and exec under TCG: 16 s per
        # 100 MiB against 3.3 s)
        df = ("FROM base\nRUN python3 -c \"import os; b = os.urandom(1 << 20); f = open('/var/big.bin', "
              f"'wb'); [f.write(b) for _ in range({extra})]; f.close()\" && sync\n")
        r = gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version={v}", df,
                       dict(key, **{"Content-Type": "text/plain"}))
        assert r.status == 204, r
        t0 = time.monotonic()
        r = gw.request("PUT", f"/v1/templates/{tmpl}/source?version={v}", b"\0" * 10240,
                       dict(key, **{"Content-Type": "application/x-tar"}), timeout=120)
        assert r.status == 202, r
        end = follow(gw, key, tmpl, v)
        assert end["status"] == "ready", end
        print(f"build of big (+{extra} MiB): {time.monotonic() - t0:.1f} s", flush=True)
        snap = stack.db.sql(f"SELECT snapshot_id FROM template_versions WHERE template_id = '{tmpl}'")
        size = int(stack.db.sql(f"SELECT size_bytes FROM snapshots WHERE id = '{snap}'"))
        print(f"snapshot of big: {size / 2**20:.0f} MiB (its memory, and its disk layer over the "
              f"base's image)", flush=True)
        big_body = {"template": "big"}
        timed_create(stack, key, SHAPE, None)  # warm-up: the base's pre-booted template of the shape
        first = timed_create(stack, key, big_body, True)
        print(f"first create from big: {first[0]:.2f} s to 201, {first[1]:.2f} s to the first exec",
              flush=True)
        base, big = interleaved(stack, key, runs, True)
        load1 = os.getloadavg()
        report("create from base", base)
        report("create from big", big)

        print("restarting the node with warm templates off", flush=True)
        node_id = stack.node.node_id
        phases1 = node_phases(stack.node, snap)
        stack.restart_node(dict(NODE_ENV, KILN_TEMPLATES="false", KILN_TEMPLATE_DEFAULT="false"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and stack.db.sql(
                f"SELECT heartbeat_at > now() - interval '5 seconds' FROM nodes WHERE id = '{node_id}'") != "t":
            time.sleep(0.5)
        after = timed_create(stack, key, big_body, True)
        print(f"first create from big after the restart: {after[0]:.2f} s to 201, {after[1]:.2f} s "
              f"to the first exec", flush=True)
        cold, big2 = interleaved(stack, key, runs, False)
        load2 = os.getloadavg()
        report("cold boot of the base image", cold)
        report("create from big (templates off)", big2)
        phases2 = node_phases(stack.node, snap)
        for label, ph in (("warm templates on", phases1), ("after the restart", phases2)):
            print(f"node phases of the creates from big, {label} (ms, in order): "
                  + "; ".join(f"{k} {ph[k]}" for k in ph), flush=True)
        print(f"big / base (to the first exec): {ratio(big, base):.2f}x (aim <= 1.2x); "
              f"cold / big: {ratio(cold, big2):.2f}x; load average {load1[0]:.1f} after the first part, "
              f"{load2[0]:.1f} at the end", flush=True)
    finally:
        stack.cleanup()


if __name__ == "__main__":
    main()
