#!/usr/bin/env bash
# Enforcement (issue 14): a tenant at zero with 6 running sandboxes (256 MiB real VMs); the time
# from the meter's log line of the tick that saw zero to the vCPU stop the node logged for each
# (sandbox_state_log), the last of the 6 being the figure docs/metering.md promises under 2 s.
# Runs tests/integration/metering/test_enforcement_six.py RUNS times (a real kiln-gateway,
# kiln-node and kiln-meter on a database of their own each run); needs root, QEMU and the guest
# image. Usage: bench/metering/pause6.sh BUILD_DIR [RUNS]   (default 3; about 2 minutes a run)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../lib.sh"
bench_python pause6 "$here/bench_pause6.py" "${1:?build dir}" "${2:-3}"
