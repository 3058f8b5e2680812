#!/usr/bin/env bash
# make test: installs what is missing, builds with AddressSanitizer and UBSan, runs every test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi
bash "$root/scripts/deps"
cmake -S "$root" -B "$root/build-test" -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON >/dev/null
cmake --build "$root/build-test" -j2
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$root/build-test"
ctest --output-on-failure --timeout 1500 -j2 "$@"
