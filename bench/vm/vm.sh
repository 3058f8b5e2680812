#!/usr/bin/env bash
# Sandboxes (issue 4): create-to-first-exec latency through the public API against a bare QEMU boot
# of the same image, the VMM's memory per idle VM beyond the guest memory it touched, and how many
# 256 MiB sandboxes one 24 GiB host holds by that measured cost. A real kiln-gateway and kiln-node
# (jailed QEMU microVMs) on a database of their own; needs root, QEMU and the guest image
# (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/vm/vm.sh BUILD_DIR [RUNS] [IDLE_VMS] [BARE_RUNS]   (defaults 10 4 5)
set -euo pipefail
build=$(cd "${1:?build dir}" && pwd)
runs=${2:-10}
idle=${3:-4}
bare=${4:-5}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "bench/vm: needs root (jails, cgroups, network namespaces)" >&2; exit 1; fi
envfile=$(mktemp /tmp/kiln-bench-XXXXXX.env)
py=
cleanup() {
  if [ -n "$py" ]; then
    kill -TERM "$py" 2>/dev/null || true
    wait "$py" 2>/dev/null || true
  fi
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null || true
  rm -f "$envfile"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
KILN_BUILD_DIR=$build KILN_SERVICES_ENV=$envfile python3 "$here/bench_vm.py" "$runs" "$idle" "$bare" &
py=$!
rc=0
wait "$py" || rc=$?
py=
exit "$rc"
