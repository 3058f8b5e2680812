#!/usr/bin/env bash
# bench/metering/flush_profile.sh BUILD_DIR [N]: where the time of a ledger flush goes, on a
# Postgres of its own (tests/harness/services.sh) migrated by BUILD_DIR's kiln-migrate: the
# steps of bench/metering/flush_profile.sql (transfer ids, the balance trigger, the
# other triggers, one grant against one per ten windows, the items' text as jsonb and as json)
# for 1,000 and N (default 10,000)
# transfers, each time as psql's \timing prints it. docs/benchmarks.md has the figures.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
n=${2:-10000}
envfile=$(mktemp /tmp/kiln-bench-flushprof-XXXXXX)
trap '"$root/tests/harness/services.sh" stop "$envfile" >/dev/null; rm -f "$envfile"' EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
. "$envfile"
KILN_DATABASE_URL=$KILN_DATABASE_URL "$build/migrations/kiln-migrate" >/dev/null 2>&1
card=cpu1000-mem1024-disk16-snap128
psql -X -q "$KILN_DATABASE_URL" -c "INSERT INTO rate_cards (version, cpu_ucr_per_cpu_s, \
mem_ucr_per_gib_s, disk_ucr_per_gib_s, snapshot_ucr_per_gib_s) VALUES ('$card', 1000, 1024, 16, 128) \
ON CONFLICT DO NOTHING"
for k in 1000 "$n"; do
  echo "== $k transfers"
  psql -X -q "$KILN_DATABASE_URL" -v n="$k" -v card="$card" -f "$root/bench/metering/flush_profile.sql" |
    grep -E '^[0-9]|^Time|Execution Time'
done
