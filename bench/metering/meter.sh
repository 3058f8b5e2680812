#!/usr/bin/env bash
# bench/metering/meter.sh BUILD_DIR [TICKS [HISTORY]]: ledger flush throughput (the set-based flush, the
# loop it replaced, bare multi-row INSERTs into the same table) and kiln-meter's tick cost for 1,
# 100 and 1,000 VMs (real cgroups with idle processes, real pinned eBPF counter maps; the meter's,
# Redis's and Postgres's CPU), on a Postgres and Redis pair of its own; with HISTORY, each size
# beside that many sandboxes deleted long ago (a deployment's past, which the tick must not read).
# Needs root (cgroups, bpffs).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
ticks=${2:-30}
history=${3:-0}
# bpffs on /sys/fs/bpf, mounted (and left mounted) as kiln-node's netpolicy does when a host lacks it
if [ "$(stat -f -c %T /sys/fs/bpf 2>/dev/null)" != bpf_fs ]; then
	mount -t bpf -o mode=0700 bpf /sys/fs/bpf
fi
envfile=$(mktemp /tmp/kiln-bench-meter-XXXXXX)
trap '"$root/tests/harness/services.sh" stop "$envfile" >/dev/null' EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
. "$envfile"
KILN_TEST_PGDATA=$KILN_TEST_PGDATA "$build/metering/bench-meter" "$KILN_DATABASE_URL" "$KILN_REDIS_URL" "$ticks" "$history"
