#!/usr/bin/env bash
# Where a POST /v1/tokens (API key, fresh Idempotency-Key, audit row) spends its time, against
# GET /healthz of the same gateway: req/s, p50, and the CPU time per request of the gateway, of
# Postgres (the postmaster and all its backends) and of Redis, from /proc/PID/stat before and after
# each wrk run. Each pair (H P) runs twice per round: with the cluster's synchronous_commit as
# configured (on), then with it off for the whole cluster (ALTER SYSTEM, reloaded), which shows
# what waiting for the WAL flush costs. Measurement only: no gateway ever runs with it off.
# With BASE_BUILD, a gateway of another build on the same database is measured the same way
# right after (its CPU counts the Postgres backends of both gateways; the idle one's are
# near zero). Runs are interleaved; a ratio is to the /healthz run just before it.
# With GETS=1 in the environment each gateway also runs GET /v1/api-keys with the API keys in turn
# (as keys.sh's API-key run; with synchronous_commit on only), so that what authentication costs a
# read can be told apart per process against /healthz.
# PG_SETTINGS="name=value ..." in the environment is set on the cluster (ALTER SYSTEM) before the
# runs, e.g. "commit_delay=1000 commit_siblings=2" to see what Postgres's own grouping of WAL
# flushes does.
# Usage: bench/auth/post_cost.sh BUILD_DIR [BASE_BUILD] [SECONDS] [CONNECTIONS] [ROUNDS] [CREDS]
set -euo pipefail
build=${1:?build dir}
base=${2:-}
secs=${3:-8}
conns=${4:-8}
rounds=${5:-2}
ncreds=${6:-200}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d /tmp/kiln-bench-post-XXXXXX)
envfile=$tmp/env keyfile=$tmp/admin keys=$tmp/keys
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  "$root/tests/harness/services.sh" stop "$envfile" >/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
"$root/tests/harness/services.sh" start "$envfile" >/dev/null
set -a; . "$envfile"; set +a
sql() { psql -h "$KILN_TEST_SOCKDIR" -U kiln -d kiln -tAqc "$1"; }

for setting in ${PG_SETTINGS:-}; do
  sql "ALTER SYSTEM SET ${setting%%=*} = '${setting#*=}'" >/dev/null
done
sql "SELECT pg_reload_conf()" >/dev/null
master=$(openssl rand -hex 32)
# start_gw BUILD PORT: a gateway of BUILD on PORT; its pid in $gw_pid
start_gw() {
  KILN_LISTEN=127.0.0.1:$2 KILN_E2B_LISTEN= KILN_E2B_SANDBOX_LISTEN= KILN_PORTS_LISTEN=127.0.0.1:0 \
    KILN_LOG_LEVEL=warn KILN_ADMIN_KEY_FILE=$keyfile KILN_MASTER_KEY=$master \
    KILN_RATE_LIMIT_RPS=1000000 KILN_RATE_LIMIT_BURST=1000000 \
    KILN_TENANT_RATE_LIMIT_RPS=1000000 KILN_TENANT_RATE_LIMIT_BURST=1000000 \
    "$1/api/kiln-gateway" >/dev/null 2>&1 &
  gw_pid=$!
  pids+=("$gw_pid")
  for ((i = 0; i < 100; i++)); do
    [ -s "$keyfile" ] && curl -s -o /dev/null "http://127.0.0.1:$2/healthz" && break
    sleep 0.1
  done
}
port=$((20000 + RANDOM % 10000))
start_gw "$build" "$port"
gws=("$build $port $gw_pid")
if [ -n "$base" ]; then
  start_gw "$base" $((port + 1))
  gws+=("$base $((port + 1)) $gw_pid")
fi
# a live node, so /healthz does its full work and answers 200 (as bench/auth/keys.sh)
sql "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, accelerator,
     image_hash, heartbeat_at) VALUES ('bench', 'unix:/nonexistent', 1000, 1024, 1, 'qemu', 'tcg', '',
     now() + interval '1 day')" >/dev/null
python3 - "http://127.0.0.1:$port" "$(cat "$keyfile")" "$ncreds" "$keys" <<'PY'
import http.client, json, sys, urllib.parse
url, admin, n, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
u = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
with open(path, "w") as f:
    for i in range(n):
        conn.request("POST", "/v1/tenants", json.dumps({"name": f"b{i}"}),
                     {"Authorization": "Bearer " + admin, "Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 201:
            sys.exit(f"POST /v1/tenants answered {r.status}: {data[:200]!r}")
        print(json.loads(data)["api_key"]["key"], file=f)
PY

# ticks (1/100 s) of CPU used so far by: Postgres, Redis, the gateway GW_PID
ticks() {
  local pm p t out=
  pm=$(head -1 "$KILN_TEST_PGDATA/postmaster.pid")
  for group in "$pm $(pgrep -P "$pm" | tr '\n' ' ')" "$(cat "$KILN_TEST_REDIS_PIDFILE")" "$1"; do
    t=0
    for p in $group; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done
    out="$out $t"
  done
  echo $out
}
# run URL GW_PID [post|get NONCE]: prints "req/s p50_ms non2xx cpu_ms_pg cpu_ms_redis cpu_ms_gw" per request
run() {
  local before after out
  before=$(ticks "$2")
  out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency ${3:+-s "$here/creds.lua"} "$1" \
        ${3:+-- "$keys" "$3" "$4"} | awk '
    /Requests\/sec/ {rps=$2} /^ +50%/ {p50=$2} /Non-2xx or 3xx responses/ {bad=$NF}
    function ms(v) { if (v ~ /us$/) return v/1000; if (v ~ /ms$/) return v+0; if (v ~ /s$/) return v*1000; return v }
    END {printf "%.0f %.3f %d\n", rps, ms(p50), bad}')
  after=$(ticks "$2")
  echo "$out" "$before" "$after" | awk -v s="$secs" '{n = $1 * s; if (n < 1) n = 1;
    printf "%s %s %s %.3f %.3f %.3f\n", $1, $2, $3, ($7-$4)*10/n, ($8-$5)*10/n, ($9-$6)*10/n}'
}
printf "%-5s %-9s %-38s %8s %8s %7s %7s %7s %7s %7s %6s %s\n" round sync gateway req/s "p50 ms" non2xx \
  "pg ms" "rds ms" "gw ms" "cpu ms" ratio load
bad=0
for ((r = 1; r <= rounds; r++)); do
  for sync in on off; do
    if [ "$sync" = off ]; then sql "ALTER SYSTEM SET synchronous_commit = off" >/dev/null
    else sql "ALTER SYSTEM RESET synchronous_commit" >/dev/null; fi
    sql "SELECT pg_reload_conf()" >/dev/null
    for g in "${gws[@]}"; do
      read -r b p pid <<<"$g"
      name=$([ "$b" = "$build" ] && echo BUILD || echo BASE_BUILD)
      read -r h_rps h_p50 h_bad h_pg h_rd h_gw < <(run "http://127.0.0.1:$p/healthz" "$pid")
      read -r x_rps x_p50 x_bad x_pg x_rd x_gw < <(run "http://127.0.0.1:$p/v1/tokens" "$pid" post "$r$sync$p$(date +%s%N)")
      rows=("GET /healthz|$h_rps|$h_p50|$h_bad|$h_pg|$h_rd|$h_gw|-"
            "POST /v1/tokens|$x_rps|$x_p50|$x_bad|$x_pg|$x_rd|$x_gw|$(awk -v x="$x_rps" -v h="$h_rps" 'BEGIN {printf "%.2f", x / h}')")
      if [ -n "${GETS:-}" ] && [ "$sync" = on ]; then
        read -r k_rps k_p50 k_bad k_pg k_rd k_gw < <(run "http://127.0.0.1:$p/v1/api-keys" "$pid" get 0)
        rows+=("GET /v1/api-keys, API key|$k_rps|$k_p50|$k_bad|$k_pg|$k_rd|$k_gw|$(awk -v x="$k_rps" -v h="$h_rps" 'BEGIN {printf "%.2f", x / h}')")
        bad=$((bad + k_bad))
      fi
      load=$(cut -d' ' -f1 /proc/loadavg)
      for row in "${rows[@]}"; do
        IFS='|' read -r what rps p50 nb pg rd gwc ratio <<<"$row"
        printf "%-5s %-9s %-38s %8s %8s %7s %7s %7s %7s %7s %6s %s\n" "$r" "$sync" "$name, $what" "$rps" "$p50" "$nb" \
          "$pg" "$rd" "$gwc" "$(awk -v a="$pg" -v b="$rd" -v c="$gwc" 'BEGIN {printf "%.3f", a + b + c}')" "$ratio" "$load"
      done
      bad=$((bad + h_bad + x_bad))
    done
  done
done
sql "ALTER SYSTEM RESET synchronous_commit" >/dev/null
if [ "$bad" -ne 0 ]; then
  echo "some answers were not 2xx: the figures above do not measure what they say" >&2
  exit 1
fi
