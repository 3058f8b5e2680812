#!/usr/bin/env bash
# make bench: builds an optimised tree and runs every benchmark under bench/, printing figures.
# Results are copied by hand into docs/benchmarks.md with the command that produced them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then exec sudo -E bash "$0" "$@"; fi
bash "$root/scripts/deps"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$root/build" -j2 >/dev/null
for b in "$root"/bench/*/*.sh; do
  echo "== ${b#$root/}"
  bash "$b" "$root/build"
done
