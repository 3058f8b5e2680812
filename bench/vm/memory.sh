#!/usr/bin/env bash
# Memory after a burst (issue 18): one sandbox writes 300 MiB in Python and frees it; after an idle
# wait, the guest's own used memory (MemTotal − MemFree) against the host memory backing its RAM
# (Rss of QEMU's guest memory mapping), with free page reporting on and off
# (KILN_FREE_PAGE_REPORTING), QEMU's and TCG's own memory apart. A real kiln-gateway and kiln-node
# on a database of their own; needs root, QEMU and the guest image.
# Usage: bench/vm/memory.sh BUILD_DIR [IDLE_S [VARIANTS [MEM_MIB [BURST_MIB]]]]
#        (defaults 10, on,off, 512, 300; a variant on:N also puts
#        page_reporting.page_reporting_order=N on the guest's kernel command line, on=N writes N to
#        /sys/module/page_reporting/parameters/page_reporting_order in the guest before the burst;
#        tpl and tpl-off: the sandbox made from the node's template, reporting on and off)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python memory "$here/memory.py" "${1:?build dir}" "${2:-10}" "${3:-on,off}" "${4:-512}" "${5:-300}"
