#!/usr/bin/env bash
# Templates (issue 15): a rebuild with one changed last line (the layer cache) against a full build
# of the same Dockerfile, in one run. A real kiln-gateway and kiln-node (jailed QEMU microVMs, warm
# templates on) on a database of their own; needs root, QEMU and the guest image.
# Usage: bench/templates/rebuild.sh BUILD_DIR [RUNS]   (default 2)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python rebuild "$here/bench_rebuild.py" "${1:?build dir}" "${2:-2}"
