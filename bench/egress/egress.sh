#!/usr/bin/env bash
# Names on the wire and secrets (issue 21) through a real guest: an HTTPS download from a real
# microVM through the name-checking proxy and through the injecting proxy, against the same
# download with an address rule only, in one run (bench_egress_vm.py says how). A real
# kiln-gateway and kiln-node (jailed QEMU microVM) on a database of their own, in network
# namespaces of the bench's own; needs root, QEMU and the guest image.
# Usage: bench/egress/egress.sh BUILD_DIR [MIB] [ROUNDS]   (defaults 16 3)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python egress "$here/bench_egress_vm.py" "${1:?build dir}" "${2:-16}" "${3:-3}"
