#!/usr/bin/env bash
# make stop: stops everything make run started for this checkout, by pid; keeps the data.
set -euo pipefail
. "$(dirname "$0")/env.sh"
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi
# kiln-node pauses its running sandboxes before it exits: it gets longer. Killed past that, it
# leaves them running and pauses them when it starts again.
for d in kiln-gateway kiln-meter kiln-node; do
  if kiln_pid_alive "$KILN_RUN/$d.pid"; then
    kiln_stop_pid "$KILN_RUN/$d.pid" "$([ $d = kiln-node ] && echo 300 || echo 40)"
    echo "stopped $d"
  fi
done
# The node's nftables table (node_network_setup): gone with a clean stop, left by a killed node.
node_id=${KILN_NODE_ID:-$(sed -n 's/^node_id = //p' "$KILN_VAR/kiln.conf" 2>/dev/null || true)}
kiln_node_table_remove "${node_id:-node-$KILN_ID}"
if kiln_pid_alive "$KILN_RUN/redis.pid"; then
  kiln_stop_pid "$KILN_RUN/redis.pid" 20
  echo "stopped redis"
fi
if [ -s "$KILN_DATA/pg/postmaster.pid" ]; then
  kiln_pg_stop "$KILN_DATA/pg"
  echo "stopped postgres"
fi
