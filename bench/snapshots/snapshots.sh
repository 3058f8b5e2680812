#!/usr/bin/env bash
# Snapshots (issue 5): resume latency against cold boot latency, both until the agent answers, in
# one run; the memory (PSS) of 8 fork children against 8 cold-booted sandboxes running the same
# workload; the size of a pause snapshot against the guest's memory. A real kiln-gateway and
# kiln-node (jailed QEMU microVMs, templates off) on a database of their own; needs root, QEMU and
# the guest image (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/snapshots/snapshots.sh BUILD_DIR [RUNS] [FORK]   (defaults 6 8; about 3.5 minutes)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python snapshots "$here/bench_snapshots.py" "${1:?build dir}" "${2:-6}" "${3:-8}"
