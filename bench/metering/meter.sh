#!/usr/bin/env bash
# bench/metering/meter.sh BUILD_DIR [TICKS]: kiln-meter's tick cost for 1, 100 and 1,000 VMs
# (real cgroups with idle processes) and ledger flush throughput vs a plain INSERT loop, on a
# Postgres and Redis pair of its own. Needs root (cgroups).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
ticks=${2:-30}
envfile=$(mktemp /tmp/kiln-bench-meter-XXXXXX)
trap '"$root/tests/harness/services.sh" stop "$envfile" >/dev/null' EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
. "$envfile"
"$build/metering/bench-meter" "$KILN_DATABASE_URL" "$KILN_REDIS_URL" "$ticks"
