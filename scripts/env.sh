# env.sh - where a checkout's running state lives; sourced by run.sh, stop.sh, clean-state.sh.
#
# KILN_ROOT   the checkout
# KILN_VAR    ./var: config, master key, logs, kiln.env
# KILN_DATA   Postgres and Redis data: ./var when the unprivileged user can reach it, else
#             /var/lib/kiln-<id> (a checkout under a 0700 home directory)
# KILN_RUN    /run/kiln-<id>: sockets and pid files (short: socket paths are at most 107 bytes)
KILN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$KILN_ROOT/scripts/lib.sh"
KILN_ID=$(kiln_checkout_id "$KILN_ROOT")
KILN_VAR=$KILN_ROOT/var
KILN_RUN=/run/kiln-$KILN_ID
if [ -f "$KILN_VAR/data_dir" ]; then
  KILN_DATA=$(cat "$KILN_VAR/data_dir")
else
  KILN_DATA=$KILN_VAR
fi
