#!/usr/bin/env bash
# Placement (issue 19): the control plane's own time per create with one and with three
# registered nodes, in interleaved rounds: a real kiln-gateway and Postgres and Redis, the nodes'
# rows as their heartbeats write them, 300 live sandboxes spread over them, and nodes that do not
# answer (their addresses lead nowhere), so each create is the gateway's work alone: its checks,
# admission, the placement statement, and the call to the node refused at once (503). The VM's
# boot and the node's records are left out. Usage: bench/ha/place.sh BUILD_DIR [ROUNDS] [PER_ROUND]
# (default 10 rounds of 40 creates per configuration; about a minute).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ha-place "$here/bench_place.py" "${1:?build dir}" "${2:-10}" "${3:-40}"
