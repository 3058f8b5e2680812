#!/usr/bin/env bash
# Placement (issue 19): the control plane's own time per create with one and with three live
# nodes, in interleaved rounds: a real kiln-gateway, Postgres and Redis, and three real kiln-node
# processes with the hostagent hook (docs/vmm.md: the guest agent runs on the host, no VM), so a
# create is the gateway's checks, admission and placement statement plus the node's admission,
# records, namespace, disk layer, cgroup and jail, with no boot. Another tenant's 300 paused
# sandboxes are recorded on the nodes. Usage: bench/ha/place.sh BUILD_DIR [ROUNDS] [PER_ROUND]
# (default 10 rounds of 20 creates per configuration, each deleted after; a few minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ha-place "$here/bench_place.py" "${1:?build dir}" "${2:-10}" "${3:-20}"
