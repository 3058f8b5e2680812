#!/usr/bin/env bash
# scripts/sim.sh - the long run of the billing simulation (kiln-sim, tests/integration/sim/sim.c):
# many seeds over simulated hours, on a Postgres and Redis pair of its own, in parallel jobs.
#
#   bash scripts/sim.sh [--jobs J] [--from N] [--count K] [--minutes M] [kiln-sim options...]
#
# Builds kiln-sim (build-sim/, RelWithDebInfo), starts the pair (tests/harness/services.sh), and
# runs seeds N..N+K-1 (default 1..2000) split over J jobs (default 2), each seed 3600 simulated
# seconds with the fault kinds that hold today (KILN_SIM_FAULTS of tests/integration/sim/
# CMakeLists.txt) unless --steps or --faults are given. --minutes stops starting seeds after M
# minutes. Prints each failing seed with its replay command, and the total: seeds, simulated
# hours, failures. Exit 0 when every seed kept every invariant. docs/testing.md says more.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi

jobs=2 from=1 count=2000 minutes=0
args=()
have_steps=0 have_faults=0
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) jobs=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    --count) count=$2; shift 2 ;;
    --minutes) minutes=$2; shift 2 ;;
    --steps) have_steps=1; args+=("$1" "$2"); shift 2 ;;
    --faults=*) have_faults=1; args+=("$1"); shift ;;
    --faults) have_faults=1; args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
faults=$(sed -n 's/^set(KILN_SIM_FAULTS "\([^"]*\)".*/\1/p' "$root/tests/integration/sim/CMakeLists.txt")
[ "$have_steps" = 1 ] || args+=(--steps 3600)
[ "$have_faults" = 1 ] || args+=("--faults=$faults")

bash "$root/scripts/deps" >/dev/null
cmake -S "$root" -B "$root/build-sim" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$root/build-sim" -j2 --target kiln-sim >/dev/null
sim=$root/build-sim/tests/integration/sim/kiln-sim

work=$(mktemp -d /tmp/kiln-sim-run-XXXXXX)
envf=$work/services.env
cleanup() {
  bash "$root/tests/harness/services.sh" stop "$envf" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
bash "$root/tests/harness/services.sh" start "$envf" >/dev/null
export KILN_SERVICES_ENV=$envf

budget=()
[ "$minutes" = 0 ] || budget=(--budget $((minutes * 60)))
per=$(((count + jobs - 1) / jobs))
echo "kiln-sim: seeds $from..$((from + count - 1)) in $jobs jobs, ${args[*]} ${budget[*]}"
start=$(date +%s)
pids=()
for ((j = 0; j < jobs; j++)); do
  first=$((from + j * per))
  n=$per
  [ $((first + n)) -le $((from + count)) ] || n=$((from + count - first))
  [ "$n" -gt 0 ] || continue
  "$sim" --seed "$first" --count "$n" "${args[@]}" "${budget[@]}" >"$work/job$j.out" 2>"$work/job$j.err" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
grep -h -A14 ': FAIL' "$work"/job*.out || true
seeds=0 failed=0 hours=0
for f in "$work"/job*.out; do
  line=$(grep '^kiln-sim: ' "$f" | tail -1 || true)
  [ -n "$line" ] || { echo "a job ended without its summary:"; cat "${f%.out}.err"; rc=1; continue; }
  read -r fl of rn h <<<"$(sed -E 's/^kiln-sim: ([0-9]+) of ([0-9]+) seeds failed, ([0-9.]+) simulated hours.*/\1 \2 x \3/' <<<"$line")"
  failed=$((failed + fl)) seeds=$((seeds + of))
  hours=$(awk -v a="$hours" -v b="$h" 'BEGIN { printf "%.2f", a + b }')
done
echo "kiln-sim long run: $seeds seeds, $hours simulated hours, $failed failed, $(($(date +%s) - start)) s"
exit "$rc"
