# lib.sh - what the VM benchmarks share; sourced, not run.
#
# bench_python NAME SCRIPT BUILD_DIR ARGS...: as root, starts a throwaway Postgres and Redis
# (tests/harness/services.sh), runs the Python bench SCRIPT with KILN_BUILD_DIR and
# KILN_SERVICES_ENV set (it starts its own gateway and node through tests/harness/kiln.py), and
# stops everything when it ends, fails or is interrupted. Exits with the script's status.
bench_python() {
  local name=$1 script=$2 build
  build=$(cd "${3:?build dir}" && pwd)
  shift 3
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [ "$(id -u)" -ne 0 ]; then
    echo "bench/$name: needs root (jails, cgroups, network namespaces)" >&2
    exit 1
  fi
  BENCH_ENVFILE=$(mktemp /tmp/kiln-bench-XXXXXX.env)
  BENCH_ROOT=$root
  BENCH_PY=
  trap _bench_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM HUP
  "$root/tests/harness/services.sh" start "$BENCH_ENVFILE" >/dev/null
  PYTHONDONTWRITEBYTECODE=1 KILN_BUILD_DIR=$build KILN_SERVICES_ENV=$BENCH_ENVFILE \
    python3 "$script" "$@" &
  BENCH_PY=$!
  local rc=0
  wait "$BENCH_PY" || rc=$?
  BENCH_PY=
  exit "$rc"
}

_bench_cleanup() {
  if [ -n "$BENCH_PY" ]; then
    kill -TERM "$BENCH_PY" 2>/dev/null || true
    wait "$BENCH_PY" 2>/dev/null || true
  fi
  "$BENCH_ROOT/tests/harness/services.sh" stop "$BENCH_ENVFILE" >/dev/null || true
  rm -f "$BENCH_ENVFILE"
}
