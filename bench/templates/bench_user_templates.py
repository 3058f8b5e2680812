"""bench_user_templates.py - create from a large user template against create from the base.

Run by bench/templates/user_templates.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). Everything goes through a real kiln-gateway and kiln-node
(tests/harness/kiln.py Stack, warm templates on) with jailed QEMU microVMs of 512 MiB and 1 vCPU.

1. Builds template `big`: FROM base, one RUN writing EXTRA_MIB of random bytes into the image, so
   its file system holds the base's content (about 500 MiB) plus EXTRA_MIB (1500: about 4x). The
   build's time is printed.
2. RUNS times, interleaved: create from the base (POST /v1/sandboxes until 201, then the first
   exec), delete; create from `big` the same way, delete. Medians and their ratio.

usage: bench_user_templates.py [RUNS] [EXTRA_MIB]
"""
import json
import os
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "harness"))
import kiln  # noqa: E402

SHAPE = {"vcpus": 1, "memory_mib": 512}
NODE_ENV = {"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
            "KILN_NODE_VCPU_MILLI": "64000", "KILN_NODE_MEMORY_MIB": "32768"}


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


def timed_create(gw, key, body):
    t0 = time.monotonic()
    r = gw.request("POST", "/v1/sandboxes", dict(body, timeout_s=600), key, timeout=600)
    assert r.status == 201, r
    t1 = time.monotonic()
    sb = r.json()["id"]
    x = gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": ["true"], "user": "root", "cwd": "/"}, key,
                   timeout=300)
    assert x.status == 200, x
    t2 = time.monotonic()
    gw.request("DELETE", f"/v1/sandboxes/{sb}", None, key)
    return t1 - t0, t2 - t0


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    extra = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info"})
    try:
        gw, key = stack.gw, stack.tenant("bench-templates")
        r = gw.request("POST", "/v1/templates", dict(SHAPE, name="big", disk_gib=10), key)
        assert r.status == 201, r
        tmpl, v = r.json()["id"], r.json()["version"]
        df = f"FROM base\nRUN head -c {extra}M /dev/urandom > /var/big.bin && sync\n"
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
        base, big = [], []
        timed_create(gw, key, SHAPE)  # warm-up: the base's pre-booted template of the shape
        for _ in range(runs):
            base.append(timed_create(gw, key, SHAPE))
            big.append(timed_create(gw, key, {"template": "big"}))
        for name, xs in (("base", base), ("big", big)):
            print(f"create from {name}: median {statistics.median(x[0] for x in xs):.3f} s to 201, "
                  f"{statistics.median(x[1] for x in xs):.3f} s to the first exec "
                  f"({', '.join(f'{x[1]:.2f}' for x in xs)})", flush=True)
        ratio = statistics.median(x[1] for x in big) / statistics.median(x[1] for x in base)
        print(f"big / base (to the first exec): {ratio:.2f}x (aim <= 1.2x); load {os.getloadavg()[0]:.1f}",
              flush=True)
    finally:
        stack.cleanup()


if __name__ == "__main__":
    main()
