#!/usr/bin/env bash
# make fuzz: builds every libFuzzer target of tests/fuzz/ and runs each at length, one after the
# other, with the arguments ctest uses for its short runs (build-fuzz/tests/fuzz/targets.tsv).
#   KILN_FUZZ_SECONDS  how long each target runs (default 600)
#   arguments          only the targets named (default: all of them)
# The corpus each run grows stays in build-fuzz/tests/fuzz/corpus/<target>/ for the next run; a
# crash leaves its input in build-fuzz/tests/fuzz/crash-<target>-*. Exits 1 when any target failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${KILN_FUZZ_SECONDS:-600}
case $secs in ''|*[!0-9]*) echo "fuzz: KILN_FUZZ_SECONDS must be a number of seconds" >&2; exit 2;; esac
build=$root/build-fuzz
bash "$root/scripts/deps"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Debug -DKILN_FUZZ=ON >/dev/null
cmake --build "$build" -j2 --target kiln_fuzz_targets
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

manifest=$build/tests/fuzz/targets.tsv
declare -A wanted=()
for t in "$@"; do
  grep -q "^$t	" "$manifest" || { echo "fuzz: no target $t (see $manifest)" >&2; exit 2; }
  wanted[$t]=1
done
failed=()
ran=0
while IFS=$'\t' read -r -a line <&3; do
  name=${line[0]} bin=${line[1]}
  if [ $# -gt 0 ] && [ -z "${wanted[$name]:-}" ]; then
    continue
  fi
  echo "fuzz: $name for ${secs}s" >&2
  ran=$((ran + 1))
  "$bin" -max_total_time="$secs" "${line[@]:2}" || failed+=("$name")
done 3<"$manifest"
[ "$ran" -gt 0 ] || { echo "fuzz: no target ran" >&2; exit 1; }
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in $build/tests/fuzz/crash-*)" >&2
  exit 1
fi
echo "fuzz: $ran targets ran ${secs}s each without a failure" >&2
