#!/usr/bin/env bash
# Concurrent creates (issue 18): N sandboxes created at once through the public API (N = 1, 8 and
# 20 by default, several rounds each), from the node's pre-booted template of the default shape:
# the wall time of each batch, p50/p99 of its creates, the CPU time a create costs (kiln-node and
# the helpers it ran, the VMs' QEMU, kiln-gateway, Postgres), and wall ÷ (N × CPU per create ÷
# cores): 1.0 when nothing but the CPU serialises the creates. A real kiln-gateway and kiln-node
# (jailed QEMU microVMs) on a database of their own; needs root, QEMU and the guest image
# (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/create/concurrent.sh BUILD_DIR [ROUNDS] [SIZES]   (defaults 3 1,8,20)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python create "$here/bench_concurrent.py" "${1:?build dir}" "${2:-3}" "${3:-1,8,20}"
