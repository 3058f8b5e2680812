#!/usr/bin/env bash
# Authenticated API throughput of kiln-gateway, each as a ratio to GET /healthz of the same gateway
# in the same run (wrk; real Postgres and Redis):
#   GET /v1/api-keys with API keys and with JWTs (ES256), each run cycling through CREDS distinct
#   credentials (creds.lua): key i and token i are the first key of tenant i and a token of it, so
#   every listing returns one key whichever credential asks;
#   POST /v1/tokens with an API key and a fresh Idempotency-Key per request: a mutating route with
#   its idempotency record and its audit row.
# With NOAUTH_BUILD, a build of the bench-only CMake option KILN_BENCH_NO_AUTH=ON (a gateway
# that skips authentication, api/authn.h), also GET /v1/api-keys on that gateway, started on the
# same database as tenant 1 with no credential at all: what authentication alone costs is
# 1 - (the API-key run's req/s / this run's) of the same round.
# With BASE_BUILD, the build of another commit (a baseline), also POST /v1/tokens on a gateway of
# that build, started on the same database, each ratio to that gateway's own /healthz.
# Runs are interleaved, /healthz before each (H K H J H P [H N] [H B]), ROUNDS times; each ratio
# is to the /healthz run just before it (of the same gateway), and the median over the rounds is
# reported. The `gw us` column is the CPU time (user + system, from /proc/PID/stat before and after
# the run) the gateway serving the run spent per request, in microseconds; with NOAUTH_BUILD,
# authentication's share is also given by it (1 - the off run's µs / the API-key run's µs, same
# round): what authentication costs the gateway, which the throughput share (1 - req/s ratio)
# mixes with wrk's, Postgres's and Redis's use of the same cores.
# Usage: bench/auth/keys.sh BUILD_DIR [SECONDS] [CONNECTIONS] [ROUNDS] [CREDS] [NOAUTH_BUILD]
#        [BASE_BUILD]
#
# What each request costs: /healthz pings Postgres and Redis and looks for a live node (three
# round trips); /v1/api-keys authenticates (an API key from the gateway's ≤ 5 s key cache and an
# HMAC check, or an ES256 signature check of the JWT, its claims cached per token once verified
# so that the token is not decoded again), takes a token from the key's and the tenant's
# rate-limit buckets (the gateway's view, reconciled with Redis every 25 ms) and lists the
# tenant's keys (one Postgres query); the POST authenticates the same way, claims its
# Idempotency-Key and reads its key's row (one upsert), signs a token and waits
# for the group commit of its audit row and stored outcome (api/commitq.h; one WAL flush per
# group). bench/auth/post_cost.sh breaks the POST's cost down. Rate limits are set far
# above what the run can reach, so no request is throttled; the script fails if any answer is not
# 2xx.
set -euo pipefail
build=${1:?build dir}
secs=${2:-10}
conns=${3:-8}
rounds=${4:-3}
ncreds=${5:-1000}
noauth=${6:-}
base=${7:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
envfile=$(mktemp /tmp/kiln-bench-XXXXXX.env)
keyfile=$(mktemp -u /tmp/kiln-bench-admin-XXXXXX)
keys=$(mktemp /tmp/kiln-bench-keys-XXXXXX)
jwts=$(mktemp /tmp/kiln-bench-jwts-XXXXXX)
tenantf=$(mktemp /tmp/kiln-bench-tenant-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null
  rm -f "$envfile" "$keyfile" "$keys" "$jwts" "$tenantf"
}
trap cleanup EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
set -a; . "$envfile"; set +a

master=$(openssl rand -hex 32)
# start_gw BUILD PORT: a gateway of BUILD on PORT (and the environment's extra settings)
start_gw() {
  KILN_LISTEN=127.0.0.1:$2 KILN_E2B_LISTEN= KILN_E2B_SANDBOX_LISTEN= KILN_PORTS_LISTEN=127.0.0.1:0 KILN_LOG_LEVEL=warn KILN_ADMIN_KEY_FILE=$keyfile \
    KILN_MASTER_KEY=$master \
    KILN_RATE_LIMIT_RPS=1000000 KILN_RATE_LIMIT_BURST=1000000 \
    KILN_TENANT_RATE_LIMIT_RPS=1000000 KILN_TENANT_RATE_LIMIT_BURST=1000000 \
    "$1/api/kiln-gateway" >/dev/null 2>&1 &
  gw_pid=$!
  pids+=($!)
  for ((i = 0; i < 100; i++)); do
    [ -s "$keyfile" ] && curl -s -o /dev/null "http://127.0.0.1:$2/healthz" && break
    sleep 0.1
  done
}
port=$((20000 + RANDOM % 10000))
url=http://127.0.0.1:$port
start_gw "$build" "$port"
pid_main=$gw_pid
# /healthz answers 200 only with a live node; a registered node whose heartbeat stays fresh for
# the run makes it do its full work and answer 200, as in production.
psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -qc \
  "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, accelerator,
   image_hash, heartbeat_at) VALUES ('bench', 'unix:/nonexistent', 1000, 1024, 1, 'qemu', 'tcg', '',
   now() + interval '1 day')" >/dev/null
health=$(curl -s -o /dev/null -w '%{http_code}' "$url/healthz")
[ "$health" = 200 ] || { echo "GET /healthz answers $health, not 200" >&2; exit 1; }

# CREDS tenants, the first API key of each (every tenant scope) and a 15-minute token of it.
python3 - "$url" "$(cat "$keyfile")" "$ncreds" "$keys" "$jwts" "$tenantf" <<'PY'
import http.client, json, sys, urllib.parse
url, admin, n, keys_path, jwts_path, tenant_path = sys.argv[1:3] + [int(sys.argv[3])] + sys.argv[4:7]
u = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
def call(path, cred, body):
    conn.request("POST", path, json.dumps(body),
                 {"Authorization": "Bearer " + cred, "Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    if r.status // 100 != 2:
        sys.exit(f"POST {path} answered {r.status}: {data[:200]!r}")
    return json.loads(data)
with open(keys_path, "w") as kf, open(jwts_path, "w") as jf:
    for i in range(n):
        made = call("/v1/tenants", admin, {"name": f"bench{i}"})
        key = made["api_key"]["key"]
        print(key, file=kf)
        if i == 0:
            with open(tenant_path, "w") as tf:
                print(made["tenant"]["id"], file=tf)
        print(call("/v1/tokens", key, {"ttl_s": 900})["token"], file=jf)
PY
for cred in "$(head -1 "$keys")" "$(head -1 "$jwts")"; do
  curl -sf -o /dev/null -H "Authorization: Bearer $cred" "$url/v1/api-keys"
done
whats="key jwt post"
if [ -n "$noauth" ]; then
  nport=$((port + 1))
  nurl=http://127.0.0.1:$nport
  KILN_BENCH_NO_AUTH=accept-anyone KILN_BENCH_TENANT=$(cat "$tenantf") start_gw "$noauth" "$nport"
  pid_noauth=$gw_pid
  # tenant 1's one key, as every authenticated listing returns one key
  [ "$(curl -sf "$nurl/v1/api-keys" | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["api_keys"]))')" = 1 ] ||
    { echo "the gateway of $noauth does not list tenant 1's key without a credential" >&2; exit 1; }
  whats="$whats noauth"
fi

if [ -n "$base" ]; then
  bport=$((port + 2))
  burl=http://127.0.0.1:$bport
  start_gw "$base" "$bport"
  pid_base=$gw_pid
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$burl/healthz")" = 200 ] ||
    { echo "the gateway of $base does not answer GET /healthz with 200" >&2; exit 1; }
  whats="$whats base"
fi

# ticks (1/100 s) of CPU the process PID has used so far
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# run_wrk PID URL [CRED_FILE [get|post]]: prints "requests/s p50_ms p99_ms non2xx gw_us", gw_us
# being the CPU time of the gateway PID per request. Runs in a subshell, so each run's
# Idempotency-Keys are told apart by the clock, not by a counter.
run_wrk() {
  local script=() nonce before out pid=$1
  shift
  nonce=$(date +%s%N)
  before=$(ticks "$pid")
  [ -n "${2:-}" ] && script=(-s "$here/creds.lua")
  out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency "${script[@]}" "$1" ${2:+-- "$2" "${3:-get}" "$nonce"} | awk '
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=$2} /^ +99%/ {p99=$2}
    /Non-2xx or 3xx responses/ {bad=$NF}
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    END {printf "%.0f %.3f %.3f %d\n", rps, ms(p50), ms(p99), bad}')
  echo "$out" | awk -v t="$(($(ticks "$pid") - before))" -v s="$secs" '{n = $1 * s; if (n < 1) n = 1;
    printf "%s %s %s %s %.0f\n", $1, $2, $3, $4, t * 10000 / n}'
}

# median of the arguments
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

printf "%-6s %-36s %10s %9s %9s %8s %7s %6s %s\n" round "kiln-gateway, $conns connections" "req/s" "p50 ms" "p99 ms" "non-2xx" ratio "gw us" load
bad=0
rk=() rj=() rp=() rn=() rc=() rb=() cj=() uk=() uj=() un=() sk=() sj=()
row() { printf "%-6s %-36s %10s %9s %9s %8s %7s %6s %s\n" "$@"; }
for ((r = 1; r <= rounds; r++)); do
  for what in $whats; do
    hurl=$url hname="GET /healthz" hpid=$pid_main
    [ "$what" = base ] && hurl=$burl hname="GET /healthz, BASE_BUILD" hpid=$pid_base
    read -r h_rps h_p50 h_p99 h_bad h_us < <(run_wrk "$hpid" "$hurl/healthz")
    row "$r" "$hname" "$h_rps" "$h_p50" "$h_p99" "$h_bad" - "$h_us" "$(cut -d' ' -f1 /proc/loadavg)"
    case $what in
    key) read -r x_rps x_p50 x_p99 x_bad x_us < <(run_wrk "$pid_main" "$url/v1/api-keys" "$keys"); name="GET /v1/api-keys, API key" ;;
    jwt) read -r x_rps x_p50 x_p99 x_bad x_us < <(run_wrk "$pid_main" "$url/v1/api-keys" "$jwts"); name="GET /v1/api-keys, JWT (ES256)" ;;
    post) read -r x_rps x_p50 x_p99 x_bad x_us < <(run_wrk "$pid_main" "$url/v1/tokens" "$keys" post); name="POST /v1/tokens, Idempotency-Key" ;;
    noauth) read -r x_rps x_p50 x_p99 x_bad x_us < <(run_wrk "$pid_noauth" "$nurl/v1/api-keys"); name="GET /v1/api-keys, authentication off" ;;
    base) read -r x_rps x_p50 x_p99 x_bad x_us < <(run_wrk "$pid_base" "$burl/v1/tokens" "$keys" post); name="POST /v1/tokens, BASE_BUILD" ;;
    esac
    ratio=$(awk -v x="$x_rps" -v h="$h_rps" 'BEGIN {printf "%.2f", x / h}')
    row "$r" "$name" "$x_rps" "$x_p50" "$x_p99" "$x_bad" "$ratio" "$x_us" "$(cut -d' ' -f1 /proc/loadavg)"
    case $what in
    key) rk+=("$ratio") key_rps=$x_rps key_us=$x_us uk+=("$x_us") ;;
    jwt) rj+=("$ratio") jwt_rps=$x_rps jwt_us=$x_us uj+=("$x_us") ;;
    post) rp+=("$ratio") ;;
    base) rb+=("$ratio") ;;
    noauth) rn+=("$ratio") un+=("$x_us")
      rc+=("$(awk -v k="$key_rps" -v n="$x_rps" 'BEGIN {printf "%.2f", 1 - k / n}')")
      cj+=("$(awk -v k="$jwt_rps" -v n="$x_rps" 'BEGIN {printf "%.2f", 1 - k / n}')")
      sk+=("$(awk -v k="$key_us" -v n="$x_us" 'BEGIN {printf "%.2f", 1 - n / k}')")
      sj+=("$(awk -v k="$jwt_us" -v n="$x_us" 'BEGIN {printf "%.2f", 1 - n / k}')") ;;
    esac
    bad=$((bad + h_bad + x_bad))
  done
done
echo "median ratio to /healthz over $rounds rounds ($ncreds distinct credentials each):"
echo "  API key: $(median "${rk[@]}") (aim >= 0.7)"
echo "  JWT:     $(median "${rj[@]}") (aim >= 0.7)"
echo "  POST:    $(median "${rp[@]}") (aim >= 0.3)"
[ -n "$base" ] && echo "  POST, BASE_BUILD ($base): $(median "${rb[@]}")"
if [ -n "$noauth" ]; then
  echo "  GET /v1/api-keys, authentication off: $(median "${rn[@]}")"
  echo "authentication's share of GET /v1/api-keys (1 - API key / off, same round): $(median "${rc[@]}") (aim <= 0.15)"
  echo "  the same with JWTs (1 - JWT / off, same round): $(median "${cj[@]}")"
  echo "gateway CPU per GET /v1/api-keys, us: API key $(median "${uk[@]}"), JWT $(median "${uj[@]}"), authentication off $(median "${un[@]}")"
  echo "authentication's share of the gateway's CPU per GET /v1/api-keys (1 - off / API key, same round): $(median "${sk[@]}") (aim <= 0.15)"
  echo "  the same with JWTs (1 - off / JWT, same round): $(median "${sj[@]}")"
fi
# Every POST was a first use of its key (a replay would be cheaper): one audit row each, and as
# many stored outcomes.
audit=$(psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -tAc \
  "SELECT count(*) FROM audit_log WHERE route = '/v1/tokens' AND status = 201")
stored=$(psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -tAc \
  "SELECT count(*) FROM idempotency WHERE key LIKE 'bench-%' AND status = 201")
echo "POST /v1/tokens: $((audit - ncreds)) audit rows, $stored stored outcomes"
if [ "$((audit - ncreds))" -ne "$stored" ]; then
  echo "some POSTs reused an Idempotency-Key: the POST figures do not measure what they say" >&2
  exit 1
fi
if [ "$bad" -ne 0 ]; then
  echo "some answers were not 2xx: the figures above do not measure what they say" >&2
  exit 1
fi
