#!/usr/bin/env bash
# make run: installs what is missing, builds, starts Postgres, Redis and Kiln's daemons for this
# checkout (data under ./var), and prints the URL and the admin API key. Running it again while
# everything is up only reports what runs.
set -euo pipefail
. "$(dirname "$0")/env.sh"

if [ "$(id -u)" -ne 0 ]; then
  exec sudo -E bash "$0" "$@"
fi

bash "$KILN_ROOT/scripts/deps"
cmake -S "$KILN_ROOT" -B "$KILN_ROOT/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$KILN_ROOT/build" -j2 >/dev/null

# The guest image (kernel, initramfs, root file system), and the code interpreter's image
# (template code-interpreter-v1, docs/e2b.md), each cached outside the checkout by the hash
# of its recipe: minutes the first time, instant afterwards. KILN_GUEST_APT_MIRROR names the
# operator's Debian mirror (default http://deb.debian.org/debian).
eval "$(bash "$KILN_ROOT/vmm/guest/build-image.sh" --print-env)"

kiln_ensure_user
mkdir -p "$KILN_VAR/log" "$KILN_RUN"
chmod 0755 "$KILN_VAR"
chmod 0711 "$KILN_RUN"
if [ ! -f "$KILN_VAR/data_dir" ]; then
  if kiln_user_can_reach "$KILN_VAR"; then
    echo "$KILN_VAR" >"$KILN_VAR/data_dir"
  else
    echo "/var/lib/kiln-$KILN_ID" >"$KILN_VAR/data_dir"
  fi
fi
KILN_DATA=$(cat "$KILN_VAR/data_dir")
mkdir -p "$KILN_DATA"
chmod 0755 "$KILN_DATA"

# The master key, once, readable by root only.
if [ ! -s "$KILN_VAR/master.key" ]; then
  (umask 077 && openssl rand -hex 32 >"$KILN_VAR/master.key")
fi
chmod 0600 "$KILN_VAR/master.key"

listen=${KILN_LISTEN:-127.0.0.1:8080}
e2b_listen=${KILN_E2B_LISTEN-127.0.0.1:8081}
ports_listen=${KILN_PORTS_LISTEN:-127.0.0.1:8082}
e2b_sandbox_listen=${KILN_E2B_SANDBOX_LISTEN-127.0.0.1:8083}
cat >"$KILN_VAR/kiln.conf" <<EOT
# Written by make run; environment variables KILN_<NAME> override these.
database_url = host=$KILN_RUN user=kiln dbname=kiln
redis_url = unix:$KILN_RUN/redis.sock
data_dir = $KILN_DATA
run_dir = $KILN_RUN
master_key_file = $KILN_VAR/master.key
admin_key_file = $KILN_VAR/admin.key
listen = $listen
e2b_listen = $e2b_listen
ports_listen = $ports_listen
e2b_sandbox_listen = $e2b_sandbox_listen
node_id = node-$KILN_ID
gateway_url = http://$listen
guest_kernel = $KILN_GUEST_KERNEL
guest_initrd = $KILN_GUEST_INITRD
guest_rootfs = $KILN_GUEST_ROOTFS
guest_codeint_rootfs = $KILN_GUEST_CODEINT_ROOTFS
guest_image_hash = $KILN_GUEST_IMAGE_HASH
guest_apt_mirror = ${KILN_GUEST_APT_MIRROR:-http://deb.debian.org/debian}
guest_cmdline = root=/dev/vda rootfstype=ext4 rw
EOT

running=()
started=()
if [ -s "$KILN_DATA/pg/postmaster.pid" ] && kill -0 "$(head -n1 "$KILN_DATA/pg/postmaster.pid")" 2>/dev/null; then
  running+=(postgres)
else
  kiln_pg_start "$KILN_DATA/pg" "$KILN_RUN" "$KILN_VAR/log/postgres.log"
  started+=(postgres)
fi
if kiln_pid_alive "$KILN_RUN/redis.pid"; then
  running+=(redis)
else
  kiln_redis_start "$KILN_DATA/redis" "$KILN_RUN/redis.sock" "$KILN_RUN/redis.pid" "$KILN_VAR/log/redis.log"
  started+=(redis)
fi

"$KILN_ROOT/build/migrations/kiln-migrate" --config "$KILN_VAR/kiln.conf" >>"$KILN_VAR/log/migrate.log" 2>&1 ||
  { echo "migrations failed; see $KILN_VAR/log/migrate.log" >&2; exit 1; }

# kiln_daemon NAME BINARY: starts a daemon in the background unless its pid file names a live one.
kiln_daemon() {
  local name=$1 bin=$2
  if kiln_pid_alive "$KILN_RUN/$name.pid"; then
    running+=("$name")
    return 0
  fi
  setsid "$bin" --config "$KILN_VAR/kiln.conf" >>"$KILN_VAR/log/$name.log" 2>&1 </dev/null &
  echo $! >"$KILN_RUN/$name.pid"
  started+=("$name")
}
kiln_daemon kiln-gateway "$KILN_ROOT/build/api/kiln-gateway"
kiln_daemon kiln-node "$KILN_ROOT/build/node/kiln-node"
kiln_daemon kiln-meter "$KILN_ROOT/build/metering/kiln-meter"

url="http://$listen"
# Port URLs: http://{port}-{sandbox id without sb_}.localhost:PORT (docs/ports.md).
ports_url="http://localhost:${ports_listen##*:}"
for ((i = 0; i < 300; i++)); do
  curl -fsS "$url/healthz" >/dev/null 2>&1 && break
  for d in kiln-gateway kiln-node; do
    kiln_pid_alive "$KILN_RUN/$d.pid" || { echo "$d exited; see $KILN_VAR/log/$d.log" >&2; exit 1; }
  done
  sleep 0.1
done
curl -fsS "$url/healthz" >/dev/null || { echo "Kiln is not healthy ($(curl -s "$url/healthz")); see $KILN_VAR/log/" >&2; exit 1; }
# A kiln-node started now serves once it has recovered what an earlier run left (it pauses the
# sandboxes a killed node left running); until then the last run's heartbeat may still look fresh.
if [[ " ${started[*]} " == *" kiln-node "* ]]; then
  for ((i = 0; i < 6000; i++)); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --unix-socket "$KILN_RUN/node.sock" http://node/ 2>/dev/null)" != 000 ] && break
    kiln_pid_alive "$KILN_RUN/kiln-node.pid" || { echo "kiln-node exited; see $KILN_VAR/log/kiln-node.log" >&2; exit 1; }
    sleep 0.1
  done
fi

admin_key=""
[ -s "$KILN_VAR/admin.key" ] && admin_key=$(cat "$KILN_VAR/admin.key")
(umask 077 && cat >"$KILN_VAR/kiln.env" <<EOT
KILN_URL=$url
KILN_PORTS_URL=$ports_url
KILN_ADMIN_KEY=$admin_key
KILN_DATA_DIR=$KILN_DATA
KILN_RUN_DIR=$KILN_RUN
E2B_API_URL=${e2b_listen:+http://$e2b_listen}
E2B_SANDBOX_URL=${e2b_sandbox_listen:+http://$e2b_sandbox_listen}
EOT
)

[ ${#started[@]} -gt 0 ] && echo "started: ${started[*]}"
[ ${#running[@]} -gt 0 ] && echo "already running: ${running[*]}"
echo "Kiln is up."
echo "  KILN_URL=$url"
echo "  KILN_PORTS_URL=$ports_url   (servers in sandboxes: {port}-{id}.localhost; docs/ports.md)"
echo "  KILN_ADMIN_KEY=$admin_key"
[ -n "$e2b_listen" ] && echo "  E2B_API_URL=http://$e2b_listen (E2B's SDKs, with E2B_API_KEY a tenant's key; docs/e2b.md)"
[ -n "$e2b_sandbox_listen" ] && echo "  E2B_SANDBOX_URL=http://$e2b_sandbox_listen (E2B's sandbox data plane: files and commands; docs/e2b.md)"
echo "(also in $KILN_VAR/kiln.env; logs in $KILN_VAR/log/; stop with: make stop)"
echo "Usage dashboard: $url/ (sign in with a tenant's API key)"
echo "Command-line client: $KILN_ROOT/build/cli/kiln (KILN_URL and KILN_API_KEY; docs/cli.md)"
