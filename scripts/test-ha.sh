#!/usr/bin/env bash
# make test-ha: the long high-availability test (docs/testing.md, docs/operations.md), not part of
# `make test`: builds build/ and runs tests/ha/rolling.py (three kiln-node processes upgraded one
# after the other to a new guest image under a stream of exec, Postgres standby and Redis Sentinel
# in place) with the `services` fixture's registry, so that the reaper removes what a failed run
# leaves (tests/harness/reap.py). Heavy: about 15-30 minutes under TCG; run it alone.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi
bash "$root/scripts/deps"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
nice -n 19 cmake --build "$root/build" -j2
. "$root/bench/lib.sh"
bench_python test-ha "$root/tests/ha/rolling.py" "$root/build" "$@"
