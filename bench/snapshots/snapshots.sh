#!/usr/bin/env bash
# Snapshots (issue 5): resume latency against cold boot latency, both until the agent answers, in
# one run; the memory (PSS) of 8 fork children against 8 cold-booted sandboxes running the same
# workload; the size of a pause snapshot against the guest's memory. A real kiln-gateway and
# kiln-node (jailed QEMU microVMs, templates off) on a database of their own; needs root, QEMU and
# the guest image (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/snapshots/snapshots.sh BUILD_DIR [RUNS] [FORK]   (defaults 6 8; about 3.5 minutes)
set -euo pipefail
build=$(cd "${1:?build dir}" && pwd)
runs=${2:-6}
fork=${3:-8}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "bench/snapshots: needs root (jails, cgroups, network namespaces)" >&2; exit 1; fi
envfile=$(mktemp /tmp/kiln-bench-XXXXXX.env)
py=
cleanup() {
  if [ -n "$py" ]; then
    kill -TERM "$py" 2>/dev/null || true
    wait "$py" 2>/dev/null || true
  fi
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null || true
  rm -f "$envfile"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
PYTHONDONTWRITEBYTECODE=1 KILN_BUILD_DIR=$build KILN_SERVICES_ENV=$envfile \
  python3 "$here/bench_snapshots.py" "$runs" "$fork" &
py=$!
rc=0
wait "$py" || rc=$?
py=
exit "$rc"
