#!/usr/bin/env bash
# make clean-state: stops everything and removes ./var (and the data directory outside the
# checkout, when one was used) after a confirmation.
set -euo pipefail
. "$(dirname "$0")/env.sh"
if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi
echo "This deletes $KILN_VAR${KILN_DATA:+ and $KILN_DATA}: every tenant, key, sandbox and ledger entry."
read -r -p "Type 'yes' to go on: " answer
[ "$answer" = yes ] || { echo "nothing removed"; exit 1; }
bash "$KILN_ROOT/scripts/stop.sh"
case "$KILN_DATA" in
  "$KILN_VAR"|/var/lib/kiln-*) rm -rf "$KILN_DATA" ;;
esac
rm -rf "$KILN_VAR" "$KILN_RUN"
echo "removed"
