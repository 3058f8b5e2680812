#!/usr/bin/env bash
# Sandboxes (issue 4): create-to-first-exec latency through the public API against a bare QEMU boot
# of the same image, the VMM's memory per idle VM beyond the guest memory it touched, and how many
# 256 MiB sandboxes one 24 GiB host holds by that measured cost. A real kiln-gateway and kiln-node
# (jailed QEMU microVMs) on a database of their own; needs root, QEMU and the guest image
# (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/vm/vm.sh BUILD_DIR [RUNS] [IDLE_VMS] [BARE_RUNS]   (defaults 10 4 5)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python vm "$here/bench_vm.py" "${1:?build dir}" "${2:-10}" "${3:-4}" "${4:-5}"
