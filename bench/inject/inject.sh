#!/usr/bin/env bash
# The injecting proxy's cost on the host: an HTTPS download through inject_serve (the injector on
# loopback, node/inject.c) against the same download straight from the TLS server, same run.
# Usage: bench/inject/inject.sh BUILD_DIR [MIB] [ROUNDS] [BASE_BUILD_DIR]
# With BASE_BUILD_DIR, that build's inject_serve (say, from before a change) runs in the same rounds.
set -euo pipefail
build=${1:?build dir}
base=()
if [ -n "${4:-}" ]; then base=(--serve-base "$4/tests/integration/inject/inject_serve"); fi
exec /usr/bin/python3 "$(dirname "$0")/bench_inject.py" \
  --serve "$build/tests/integration/inject/inject_serve" --mib "${2:-64}" --rounds "${3:-5}" "${base[@]}"
