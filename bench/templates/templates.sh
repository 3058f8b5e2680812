#!/usr/bin/env bash
# Templates (issue 8): create latency until the sandbox answers running with its agent ready, and
# create-to-first-Python-exec, through the public API with templates on (a copy-on-write restore of
# the pre-booted template of the default shape) against cold boots (templates off) in the same
# run; the memory (PSS) of sandboxes made from one template against as many cold-booted ones. A
# real kiln-gateway and kiln-node (jailed QEMU microVMs) on a database of their own; needs root,
# QEMU and the guest image (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/templates/templates.sh BUILD_DIR [TEMPLATE_RUNS] [COLD_RUNS] [MEM_VMS] [REPORTING]
#        (defaults 20 20 20 off; about 10 minutes on a 2-core machine; REPORTING on: both sides
#        with free page reporting, KILN_FREE_PAGE_REPORTING=1)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python templates "$here/bench_templates.py" "${1:?build dir}" "${2:-20}" "${3:-20}" "${4:-20}" "${5:-off}"
