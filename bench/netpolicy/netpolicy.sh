#!/usr/bin/env bash
# The egress policy's cost: iperf3 through 1,000 rules vs no policy program (same run), the
# program's per-packet cost (BPF_PROG_TEST_RUN) and the time to replace 100 rules live.
# Usage: bench/netpolicy/netpolicy.sh BUILD_DIR [SECONDS] [ROUNDS]
set -euo pipefail
build=${1:?build dir}
exec /usr/bin/python3 "$(dirname "$0")/bench_netpolicy.py" \
  --tool "$build/tests/integration/netpolicy/np_tool" --seconds "${2:-5}" --rounds "${3:-2}"
