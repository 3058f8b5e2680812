#!/usr/bin/env bash
# services.sh start|stop ENVFILE - the integration tests' throwaway Postgres and Redis.
#
# start: makes a temporary directory, starts a Postgres cluster and a Redis server in it (Unix
# sockets only, so no port can collide), applies nothing (each test migrates), and writes
# KILN_TEST_DIR, KILN_DATABASE_URL, KILN_REDIS_URL and the pieces tests need to ENVFILE.
# stop: first reaps what the run's daemons left (tests/harness/reap.py on KILN_TEST_DIR/daemons,
# where tests/harness/kiln.py records every kiln-node and kiln-gateway it starts until it stops
# them cleanly: a test ctest killed at its timeout leaves its node, VMs, netns, TAPs, BPF pins
# and cgroups behind), then stops both by their pid files and removes the directory. ctest runs
# stop as the fixture's cleanup, so it runs even when tests fail or time out. It fails when
# something could not be reaped. Then it checks that no node of the run (KILN_TEST_DIR/nodes, the
# list kiln.py keeps of every node id it started) left anything on the host: VM run directories
# (/run/kiln/<node>), uid leases naming it, its run directory, cgroups, BPF pins, memory files, its
# nftables table, its sandboxes' netns and veths, processes. What one left is named, removed, and
# fails the stop (reap.py --check). Only this run's node ids are looked at. Last, what tests left
# in the run's temporary directory (KILN_TEST_DIR/tmp, their TMPDIR: tests/harness/kiln.py) is
# named and fails the stop too; it goes with the directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../../scripts/lib.sh"

cmd=${1:?start or stop}
envfile=${2:?envfile}

case "$cmd" in
start)
  if [ -f "$envfile" ]; then "$0" stop "$envfile"; fi
  dir=$(mktemp -d /tmp/kt-XXXXXX)
  chmod 0755 "$dir"
  kiln_pg_start "$dir/pg" "$dir/s" "$dir/pg.log"
  kiln_redis_start "$dir/redis" "$dir/s/redis.sock" "$dir/redis.pid" "$dir/redis.log"
  cat >"$envfile" <<EOT
KILN_TEST_DIR=$dir
KILN_TEST_PGDATA=$dir/pg
KILN_TEST_SOCKDIR=$dir/s
KILN_TEST_REDIS_PIDFILE=$dir/redis.pid
KILN_DATABASE_URL='host=$dir/s user=kiln dbname=kiln'
KILN_REDIS_URL=unix:$dir/s/redis.sock
EOT
  echo "services: postgres and redis under $dir"
  ;;
stop)
  [ -f "$envfile" ] || exit 0
  dir=$(sed -n 's/^KILN_TEST_DIR=//p' "$envfile")
  reaped=0
  if [ -n "$dir" ] && [ -d "$dir/daemons" ]; then
    /usr/bin/python3 "$here/reap.py" "$dir/daemons" || reaped=$?
  fi
  if [ -n "$dir" ] && [ -d "$dir/nodes" ]; then
    /usr/bin/python3 "$here/reap.py" --check "$dir/nodes" || reaped=1
  fi
  if [ -n "$dir" ] && [ -d "$dir/tmp" ]; then
    while IFS= read -r -d '' left; do
      echo "check: FAILED a test left $left"
      reaped=1
    done < <(find "$dir/tmp" -mindepth 1 -maxdepth 1 -print0)
  fi
  if [ -n "$dir" ] && [ -d "$dir" ]; then
    kiln_pg_stop "$dir/pg"
    kiln_stop_pid "$dir/redis.pid" 10
    case "$dir" in /tmp/kt-*) rm -rf "$dir" ;; esac
  fi
  rm -f "$envfile"
  echo "services: stopped"
  exit "$reaped"
  ;;
*)
  echo "usage: $0 start|stop ENVFILE" >&2
  exit 2
  ;;
esac
