#!/usr/bin/env bash
# The code interpreter's image (code-interpreter-v1) against the base, in one run: create → 201
# from each warm template, the first exec, and each sandbox's memory (PSS of its QEMU process)
# after that exec, for ROUNDS sandboxes of each, interleaved (base, code interpreter, base, ...)
# so both see the same load. A real kiln-gateway and kiln-node with templates on; needs root,
# QEMU and both guest images (vmm/guest/build-image.sh --print-env builds them on first use).
# Usage: bench/e2b/codeint.sh BUILD_DIR [ROUNDS]   (default 6; docs/benchmarks.md)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python codeint "$here/bench_codeint.py" "${1:?build dir}" "${2:-6}"
