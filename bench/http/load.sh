#!/usr/bin/env bash
# load.sh - the long form of tests/integration/foundation/test_load.py: CONNS (default 1000)
# concurrent keep-alive connections from 127.0.1.x send authenticated requests (API keys and ES256
# tokens of eight tenants; lists, a real sandbox and unknown ones, usage, balance, invalid bodies,
# key lists) for SECONDS (default 60), while a well-behaved tenant calls from 127.0.0.2 at 5/s.
# Prints requests/s, the statuses, the well-behaved client's p50/p95/p99, the gateway's RSS at
# start, after warm-up, peak and end, its threads, fds, Postgres and Redis connections; fails when
# a well-behaved request failed or its p99 passed 2 s, the RSS grew over 10 % after warm-up (the
# first 20 s, or a third of the run if shorter, and at least 3 s after every connection was held),
# or fds, threads or service connections were not let go (bench/http/httpload.py). Needs root (it
# starts Postgres and Redis).
#
#   bash bench/http/load.sh build [SECONDS] [CONNS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib.sh
source "$here/../lib.sh"
bench_python http-load "$here/httpload.py" "${1:?build dir}" "${2:-60}" "${3:-1000}"
