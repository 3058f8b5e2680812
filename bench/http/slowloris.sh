#!/usr/bin/env bash
# slowloris.sh - the long form of tests/integration/foundation/test_connections.py: CONNS slow
# connections (default 1000) from 127.0.0.1 hold authenticated requests open, dripping one header
# byte a second and reconnecting whenever the gateway closes them, for SECONDS (default 60), while a
# well-behaved client on 127.0.0.2 calls GET /v1/api-keys. Prints its latencies, what the attack
# got, and the gateway's RSS before and after; fails when a good request failed or took over 2 s,
# or the RSS grew by more than 64 MiB. Needs root (it starts Postgres and Redis).
#
#   bash bench/http/slowloris.sh build [SECONDS] [CONNS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib.sh
source "$here/../lib.sh"
bench_python http-slowloris "$here/slowloris.py" "${1:?build dir}" "${2:-60}" "${3:-1000}"
