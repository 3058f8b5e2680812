"""bench_rebuild.py - a rebuild with its last line changed against a full build.

Run by bench/templates/rebuild.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV). A real kiln-gateway and kiln-node (tests/harness/kiln.py
Stack, warm templates on), builders of 1 vCPU and 512 MiB.

RUNS times, each with a new tenant (so an empty layer cache): a full build of DOCKERFILE (a COPY of
a small context and RUN steps that write files and compute, as installing packages would), then
version 2 of the same template with only the last line changed. Each time is from the upload of
the context to the end of the build's log. Medians and their ratio (aim <= 0.2x).

usage: bench_rebuild.py [RUNS]
"""
import io
import os
import statistics
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_user_templates import NODE_ENV, SHAPE, follow, kiln  # noqa: E402

DOCKERFILE = """FROM base
ENV APP=/srv/app
WORKDIR /srv/app
COPY app/ ./
RUN head -c 100M /dev/urandom > /srv/app/data.bin && sha256sum data.bin > data.sum
RUN python3 -c "import hashlib; h = hashlib.sha256(); [h.update(b'x' * 4096) for _ in range(50000)]; print(h.hexdigest())" > digest.txt
RUN echo "version {v}" > /srv/app/version.txt
"""


def context():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in {"app/main.py": "print('hello')\n", "app/lib.py": "X = 1\n"}.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def build(gw, key, v):
    r = gw.request("POST", "/v1/templates", dict(SHAPE, name="app", disk_gib=10), key)
    assert r.status == 201, r
    tmpl, version = r.json()["id"], r.json()["version"]
    r = gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version={version}", DOCKERFILE.format(v=v),
                   dict(key, **{"Content-Type": "text/plain"}))
    assert r.status == 204, r
    t0 = time.monotonic()
    r = gw.request("PUT", f"/v1/templates/{tmpl}/source?version={version}", context(),
                   dict(key, **{"Content-Type": "application/x-tar"}), timeout=120)
    assert r.status == 202, r
    end = follow(gw, key, tmpl, version)
    assert end["status"] == "ready", end
    return time.monotonic() - t0


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_LOG_LEVEL": "info"})
    try:
        full, rebuild = [], []
        for i in range(runs):
            key = stack.tenant(f"bench-rebuild-{i}")
            full.append(build(stack.gw, key, 1))
            rebuild.append(build(stack.gw, key, 2))
            print(f"run {i + 1}: full build {full[-1]:.1f} s, rebuild with the last line changed "
                  f"{rebuild[-1]:.1f} s", flush=True)
        ratio = statistics.median(rebuild) / statistics.median(full)
        print(f"full build: median {statistics.median(full):.1f} s; rebuild: median "
              f"{statistics.median(rebuild):.1f} s; rebuild / full: {ratio:.2f}x (aim <= 0.2x); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        stack.cleanup()


if __name__ == "__main__":
    main()
