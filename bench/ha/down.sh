#!/usr/bin/env bash
# A node's death (issue 19): the time from a node killed with -9 (its kiln-meter with it) to its
# running sandboxes reported lost and the node marked down (from then its paused sandboxes are
# resumable elsewhere), and to its paused sandbox running on the other node from the tenant's
# bucket (restore included). Runs tests/e2e/test_nodes.py's first test RUNS times (two
# kiln-node + kiln-meter pairs in namespaces of their own, two gateways behind HAProxy, a real
# S3 server, node_down_after_s 3); needs root, QEMU and the guest image.
# Usage: bench/ha/down.sh BUILD_DIR [RUNS]   (default 3; a few minutes a run)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ha-down "$here/bench_down.py" "${1:?build dir}" "${2:-3}"
