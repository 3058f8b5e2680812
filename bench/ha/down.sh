#!/usr/bin/env bash
# A node's death (issue 19): the time from a node stopping (SIGSTOP: no heartbeat, its QEMUs left
# running) to its running sandbox reported lost and the node marked down, and then the resume of
# its paused sandbox on the other node from the tenant's bucket (restore included). Runs
# tests/e2e/test_nodes.py's first test RUNS times (two kiln-node processes, a real gateway and
# S3 server, node_down_after_s 5); needs root, QEMU and the guest image.
# Usage: bench/ha/down.sh BUILD_DIR [RUNS]   (default 3; about 3 minutes a run)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ha-down "$here/bench_down.py" "${1:?build dir}" "${2:-3}"
