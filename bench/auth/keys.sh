#!/usr/bin/env bash
# Authenticated GET /v1/api-keys throughput of kiln-gateway, with an API key and with a JWT, each
# as a ratio to GET /healthz of the same gateway in the same run (wrk; real Postgres and Redis).
# Usage: bench/auth/keys.sh BUILD_DIR [SECONDS] [CONNECTIONS]
#
# What each request costs: /healthz pings Postgres and Redis and looks for a live node (three
# round trips); /v1/api-keys authenticates (an API key from the gateway's ≤ 5 s key cache and an
# HMAC check, or an ES256 signature check of the JWT), takes a token from the key's Redis bucket
# (one EVALSHA) and lists the tenant's keys (one Postgres query). Rate limits are set far above
# what the run can reach, so no request is throttled; the script fails if any answer is not 2xx.
set -euo pipefail
build=${1:?build dir}
secs=${2:-10}
conns=${3:-8}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
envfile=$(mktemp /tmp/kiln-bench-XXXXXX.env)
keyfile=$(mktemp -u /tmp/kiln-bench-admin-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null
  rm -f "$envfile" "$keyfile"
}
trap cleanup EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
set -a; . "$envfile"; set +a

port=$((20000 + RANDOM % 10000))
url=http://127.0.0.1:$port
KILN_LISTEN=127.0.0.1:$port KILN_E2B_LISTEN= KILN_E2B_SANDBOX_LISTEN= KILN_PORTS_LISTEN=127.0.0.1:0 KILN_LOG_LEVEL=warn KILN_ADMIN_KEY_FILE=$keyfile \
  KILN_MASTER_KEY=$(openssl rand -hex 32) \
  KILN_RATE_LIMIT_RPS=1000000 KILN_RATE_LIMIT_BURST=1000000 \
  KILN_TENANT_RATE_LIMIT_RPS=1000000 KILN_TENANT_RATE_LIMIT_BURST=1000000 \
  "$build/api/kiln-gateway" >/dev/null 2>&1 &
pids+=($!)
for ((i = 0; i < 100; i++)); do
  [ -s "$keyfile" ] && curl -s -o /dev/null "$url/healthz" && break
  sleep 0.1
done
# /healthz answers 200 only with a live node; a registered node whose heartbeat stays fresh for
# the run makes it do its full work and answer 200, as in production.
psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -qc \
  "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, accelerator,
   image_hash, heartbeat_at) VALUES ('bench', 'unix:/nonexistent', 1000, 1024, 1, 'qemu', 'tcg', '',
   now() + interval '1 day')" >/dev/null
health=$(curl -s -o /dev/null -w '%{http_code}' "$url/healthz")
[ "$health" = 200 ] || { echo "GET /healthz answers $health, not 200" >&2; exit 1; }

# A tenant, its first API key (every tenant scope) and a 15-minute token of that key.
admin=$(cat "$keyfile")
key=$(curl -sf -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' \
  -d '{"name":"bench"}' "$url/v1/tenants" | python3 -c 'import json,sys; print(json.load(sys.stdin)["api_key"]["key"])')
jwt=$(curl -sf -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d '{"ttl_s":900}' "$url/v1/tokens" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
for cred in "$key" "$jwt"; do
  curl -sf -o /dev/null -H "Authorization: Bearer $cred" "$url/v1/api-keys"
done

# run_wrk URL [CREDENTIAL]: prints "requests/s p50_ms p99_ms non2xx"
run_wrk() {
  local hdr=()
  [ -n "${2:-}" ] && hdr=(-H "Authorization: Bearer $2")
  wrk -t2 -c"$conns" -d"${secs}s" --latency "${hdr[@]}" "$1" | awk '
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=$2} /^ +99%/ {p99=$2}
    /Non-2xx or 3xx responses/ {bad=$NF}
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    END {printf "%.0f %.3f %.3f %d\n", rps, ms(p50), ms(p99), bad}'
}
read -r h_rps h_p50 h_p99 h_bad < <(run_wrk "$url/healthz")
read -r k_rps k_p50 k_p99 k_bad < <(run_wrk "$url/v1/api-keys" "$key")
read -r j_rps j_p50 j_p99 j_bad < <(run_wrk "$url/v1/api-keys" "$jwt")
printf "%-36s %10s %9s %9s %8s\n" "kiln-gateway, $conns connections" "req/s" "p50 ms" "p99 ms" "non-2xx"
printf "%-36s %10s %9s %9s %8s\n" "GET /healthz (baseline)" "$h_rps" "$h_p50" "$h_p99" "$h_bad"
printf "%-36s %10s %9s %9s %8s\n" "GET /v1/api-keys, API key" "$k_rps" "$k_p50" "$k_p99" "$k_bad"
printf "%-36s %10s %9s %9s %8s\n" "GET /v1/api-keys, JWT (ES256)" "$j_rps" "$j_p50" "$j_p99" "$j_bad"
awk -v k="$k_rps" -v j="$j_rps" -v h="$h_rps" 'BEGIN {
  printf "ratio API key / healthz: %.2f (aim >= 0.5)\n", k / h
  printf "ratio JWT / healthz:     %.2f (aim >= 0.7)\n", j / h }'
if [ "$((h_bad + k_bad + j_bad))" -ne 0 ]; then
  echo "some answers were not 2xx: the figures above do not measure what they say" >&2
  exit 1
fi
