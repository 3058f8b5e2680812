#!/usr/bin/env bash
# GET /healthz throughput and latency of kiln-gateway (real Postgres and Redis behind it) against a
# bare libmicrohttpd handler with the same threading model, both measured now with wrk.
# Usage: bench/http/healthz.sh BUILD_DIR [SECONDS] [CONNECTIONS]
set -euo pipefail
build=${1:?build dir}
secs=${2:-10}
conns=${3:-8}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
envfile=$(mktemp /tmp/kiln-bench-XXXXXX.env)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null
  rm -f "$envfile"
}
trap cleanup EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
set -a; . "$envfile"; set +a

port_gw=$((20000 + RANDOM % 10000))
port_bare=$((port_gw + 1))
KILN_MASTER_KEY=$(openssl rand -hex 32) KILN_LISTEN=127.0.0.1:$port_gw KILN_E2B_LISTEN= KILN_E2B_SANDBOX_LISTEN= KILN_PORTS_LISTEN=127.0.0.1:0 KILN_LOG_LEVEL=warn \
  "$build/api/kiln-gateway" >/dev/null 2>&1 &
pids+=($!)
"$build/bench/bench-bare-mhd" "$port_bare" &
pids+=($!)
# /healthz is 200 only with a live node: register one whose heartbeat stays fresh for the run
# (the bench measures the gateway's checks, not a node).
for ((i = 0; i < 100; i++)); do
  curl -s "http://127.0.0.1:$port_gw/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -qc "INSERT INTO nodes (id, address, vcpu_milli, memory_mib,
  max_sandboxes, hypervisor, accelerator, image_hash, heartbeat_at) VALUES ('bench', 'unix:/nonexistent',
  1000, 1024, 1, 'qemu', 'tcg', '', now() + interval '1 hour')"
for ((i = 0; i < 100; i++)); do
  curl -fs "http://127.0.0.1:$port_gw/healthz" >/dev/null 2>&1 && curl -fs "http://127.0.0.1:$port_bare/" >/dev/null 2>&1 && break
  sleep 0.1
done

# run_wrk URL: prints "requests/s p50_ms p99_ms"
run_wrk() {
  wrk -t2 -c"$conns" -d"${secs}s" --latency "$1" | awk '
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=$2} /^ +99%/ {p99=$2}
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    END {printf "%.0f %.3f %.3f\n", rps, ms(p50), ms(p99)}'
}
read -r bare_rps bare_p50 bare_p99 < <(run_wrk "http://127.0.0.1:$port_bare/healthz")
read -r gw_rps gw_p50 gw_p99 < <(run_wrk "http://127.0.0.1:$port_gw/healthz")
printf "%-34s %10s %9s %9s\n" "GET /healthz, $conns connections" "req/s" "p50 ms" "p99 ms"
printf "%-34s %10s %9s %9s\n" "bare libmicrohttpd (baseline)" "$bare_rps" "$bare_p50" "$bare_p99"
printf "%-34s %10s %9s %9s\n" "kiln-gateway (Postgres + Redis)" "$gw_rps" "$gw_p50" "$gw_p99"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port_gw/healthz")" = 200 ] ||
  echo "warning: /healthz did not answer 200 during the run"
awk -v a="$gw_rps" -v b="$bare_rps" 'BEGIN {printf "ratio kiln-gateway / baseline: %.2f\n", a / b}'
