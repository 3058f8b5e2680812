#!/usr/bin/env bash
# Port URLs (issue 17): what the gateway and the node add to a request through a port URL, against
# the same HTTP server on the host's loopback reached directly, interleaved in one run. A real
# kiln-gateway and kiln-node whose sandbox's guest is the node's hostagent hook (the build's
# kiln-agent run on the host, docs/vmm.md): no VM, no guest image. Needs root (the node's network
# namespaces, cgroups). Use a Release build for figures.
# Usage: bench/ports/stub.sh BUILD_DIR [REQUESTS] [CONCURRENCY]   (defaults 2000 8; about a minute)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python ports-stub "$here/bench_ports_stub.py" "${1:?build dir}" "${2:-2000}" "${3:-8}"
