#!/usr/bin/env bash
# The base image (issue 20): the guest image of a previous recipe against this checkout's, in one
# run: their sizes, the default template's build time, create latency from it (POST until 201
# running, then the first exec) and the memory (PSS) of sandboxes made from it. The previous
# image is built (or found in the shared cache, KILN_IMAGE_CACHE) from `git archive BASE
# vmm/guest` in a temporary directory. A real kiln-gateway and kiln-node (jailed QEMU microVMs) on
# a database of their own; needs root and QEMU.
# Usage: bench/image/image.sh BUILD_DIR [BASE] [RUNS] [MEM_VMS]
#        BASE: a commit (default: the parent of the commit that added vmm/guest/add-user.sh);
#        RUNS creates and MEM_VMS kept sandboxes per image (defaults 10 8; about 10 minutes here)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
root=$(cd "$here/../.." && pwd)
base=${2:-}
if [ -z "$base" ]; then
  added=$(git -C "$root" log --diff-filter=A --format=%H -1 -- vmm/guest/add-user.sh)
  [ -n "$added" ] || { echo "bench/image: no commit adds vmm/guest/add-user.sh; name BASE" >&2; exit 2; }
  base=$added^
fi
base=$(git -C "$root" rev-parse --verify "$base^{commit}")
old=$(mktemp -d /tmp/kiln-bench-image-XXXXXX)
trap 'rm -rf "$old"' EXIT
git -C "$root" archive "$base" vmm/guest | tar -x -C "$old"
old_env=$old/old-image.env
bash "$old/vmm/guest/build-image.sh" --print-env >"$old_env"
(bench_python image "$here/bench_image.py" "${1:?build dir}" "$old_env" "$base" "${3:-10}" "${4:-8}")
