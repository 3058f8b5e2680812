#!/usr/bin/env bash
# Templates (issue 15): create from a user template whose image is about 4x the base against create
# from the base, interleaved in one run so both see the same load. A real kiln-gateway and
# kiln-node (jailed QEMU microVMs, warm templates on) on a database of their own; needs root, QEMU
# and the guest image (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/templates/user_templates.sh BUILD_DIR [RUNS] [EXTRA_MIB]   (defaults 5 1500)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python user_templates "$here/bench_user_templates.py" "${1:?build dir}" "${2:-5}" "${3:-1500}"
