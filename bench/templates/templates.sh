#!/usr/bin/env bash
# Templates (issue 8): create latency until the sandbox answers running with its agent ready, and
# create-to-first-Python-exec, through the public API with templates on (a copy-on-write restore of
# the pre-booted template of the default shape) against cold boots (templates off) in the same
# run; the memory (PSS) of sandboxes made from one template against as many cold-booted ones. A
# real kiln-gateway and kiln-node (jailed QEMU microVMs) on a database of their own; needs root,
# QEMU and the guest image (vmm/guest/build-image.sh builds it on first use).
# Usage: bench/templates/templates.sh BUILD_DIR [TEMPLATE_RUNS] [COLD_RUNS] [MEM_VMS]
#        (defaults 20 20 20; about 10 minutes on a 2-core machine)
set -euo pipefail
build=$(cd "${1:?build dir}" && pwd)
truns=${2:-20}
cruns=${3:-20}
mem=${4:-20}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ "$(id -u)" -ne 0 ]; then echo "bench/templates: needs root (jails, cgroups, network namespaces)" >&2; exit 1; fi
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
PYTHONDONTWRITEBYTECODE=1 KILN_BUILD_DIR=$build KILN_SERVICES_ENV=$envfile \
  python3 "$here/bench_templates.py" "$truns" "$cruns" "$mem" &
py=$!
rc=0
wait "$py" || rc=$?
py=
exit "$rc"
