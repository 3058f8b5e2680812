#!/usr/bin/env bash
# Create and resume against a cold boot (issue 18): per round, interleaved in one run, a cold boot of
# the base image, a create from the base's warm template, a resume with a warm page cache, a resume
# after dropping the host's caches and a resume on another node from the tenant's bucket; the
# node's logged phases of the last two beside them. Two real kiln-nodes (jailed QEMU microVMs) and
# a kiln-gateway on a database of their own, the tenant's bucket on s3rver (npm); needs root, QEMU,
# node and the guest image (vmm/guest/build-image.sh builds it on first use). It drops the whole
# host's page cache once per round (sync; echo 3 > /proc/sys/vm/drop_caches).
# Usage: bench/snapshots/resume.sh BUILD_DIR [ROUNDS]   (default 5)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python resume "$here/bench_resume.py" "${1:?build dir}" "${ROUNDS:-${2:-5}}"
