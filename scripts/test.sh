#!/usr/bin/env bash
# make test: installs what is missing, builds with AddressSanitizer and UBSan, checks that every
# test is labelled, runs every test, longest first (tests/ctest-costs.txt), and fails when a test
# skipped that tests/skip-allowed.txt does not allow to (docs/testing.md). Arguments go to ctest
# (e.g. -R metering, -L unit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi
bash "$root/scripts/deps"
cmake -S "$root" -B "$root/build-test" -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON -DKILN_FUZZ=ON >/dev/null
cmake --build "$root/build-test" -j2
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
check="/usr/bin/python3 $root/tests/harness/ctest_check.py"
allowed=$root/tests/skip-allowed.txt
cd "$root/build-test"
$check policy "$root/build-test" "$allowed"
# The longest tests first (tests/ctest-costs.txt): an aid to the order only, never a reason to stop.
$check costs "$root/build-test" "$root/tests/ctest-costs.txt" ||
  echo "test: no typical test times given to ctest; it runs the tests in its own order" >&2
junit=$root/build-test/Testing/junit.xml
rm -f "$junit"
rc=0
ctest --output-on-failure --timeout 1500 -j2 --test-output-size-passed 65536 --test-output-size-failed 1048576 --output-junit "$junit" "$@" || rc=$?
if [ -f "$junit" ]; then
  $check skips "$junit" "$allowed" || rc=1
else
  echo "test: ctest wrote no results to $junit" >&2
  rc=1
fi
exit $rc
