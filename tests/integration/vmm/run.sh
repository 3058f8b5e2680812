#!/bin/sh
# run.sh BINARY - runs a vmm integration test with a guest image in KILN_GUEST_* variables: the
# minimal busybox image of mkimage.sh, whose /init prints the marker and counter the test reads.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
[ "$(id -u)" = 0 ] || { echo "FAIL: needs root (a missing privilege fails, never skips)" >&2; exit 1; }
eval "$("$here/mkimage.sh")"
export KILN_GUEST_KERNEL KILN_GUEST_INITRD
exec "$@"
