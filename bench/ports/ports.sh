#!/usr/bin/env bash
# Port URLs (issue 17): requests per second and latency of a small HTTP server in a sandbox
# reached through its port URL (the gateway's ports listener, kiln-node, the agent's channel)
# against the same server reached from inside the guest, in one run. A real kiln-gateway and
# kiln-node (jailed QEMU microVM) on a database of their own; needs root, QEMU and the guest image.
# Usage: bench/ports/ports.sh BUILD_DIR [REQUESTS] [CONCURRENCY]   (defaults 300 8; about 2 minutes)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ports "$here/bench_ports.py" "${1:?build dir}" "${2:-300}" "${3:-8}"
