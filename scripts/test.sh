#!/usr/bin/env bash
# make test: installs what is missing, builds with AddressSanitizer and UBSan and the guest image,
# checks that every test is labelled, runs every test, longest first (tests/ctest-costs.txt), and
# fails when a test skipped that tests/skip-allowed.txt does not allow to (docs/testing.md).
# Arguments go to ctest (e.g. -R metering, -L unit).
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
# The guest image (vmm/guest/build-image.sh, cached outside the checkout by its recipe's hash):
# made here, once, before any test asks for it, so that a machine without it builds it in view
# and a failed build fails here with its messages, not inside the first test that needs it. It
# fetches from the Debian mirror: a failed build is tried once more.
imglog=$root/build-test/guest-image.log
if ! bash "$root/vmm/guest/build-image.sh" --print-env >/dev/null 2>"$imglog" &&
  ! { echo "test: the guest image's build failed; trying once more" >&2;
      bash "$root/vmm/guest/build-image.sh" --print-env >/dev/null 2>>"$imglog"; }; then
  tail -n 60 "$imglog" >&2
  echo "test: the guest image could not be built (all of its messages: $imglog)" >&2
  exit 1
fi
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
