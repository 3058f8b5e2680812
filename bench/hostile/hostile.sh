#!/usr/bin/env bash
# The hostile-guest suite's long form (issue 13): every attack of bench/hostile/attacks.py from
# tenant A's sandbox for SECONDS each (host services, metadata, the neighbour, spoofing, DNS
# flood, console, disk fill, disk I/O, memory, fork bomb, agent-channel flood), printing tenant
# B's neighbour's exec latency p50/p95/max during each against BASELINE seconds just before it,
# and /healthz. Real kiln-gateway and kiln-node, jailed QEMU microVMs, eBPF, in network namespaces
# of its own; needs root, QEMU and the guest image. The short form is the ctest e2e_hostile.
# Usage: bench/hostile/hostile.sh BUILD_DIR [SECONDS] [BASELINE]
#        (defaults 45 20: about 12 minutes on a 2-core machine)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python hostile "$here/bench_hostile.py" "${1:?build dir}" "${2:-45}" "${3:-20}"
