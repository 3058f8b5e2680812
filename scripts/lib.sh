# lib.sh - shell functions shared by scripts/run.sh, scripts/stop.sh and tests/harness/.
# Sourced, not run. Every function starts or stops only processes whose pid file it wrote.

KILN_PG_BIN=/usr/lib/postgresql/15/bin
KILN_USER=kiln

# kiln_checkout_id DIR: a short id of a checkout (8 hex digits of its real path's hash).
kiln_checkout_id() {
  realpath "$1" | sha256sum | cut -c1-8
}

# kiln_ensure_user: the unprivileged system user that owns Postgres and Redis data
# (initdb refuses root).
kiln_ensure_user() {
  id -u "$KILN_USER" >/dev/null 2>&1 && return 0
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$KILN_USER"
}

# kiln_user_can_reach DIR: whether the unprivileged user can traverse to DIR.
kiln_user_can_reach() {
  runuser -u "$KILN_USER" -- test -x "$1" 2>/dev/null
}

# kiln_pid_alive PIDFILE: whether the pid in PIDFILE names a live process.
kiln_pid_alive() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(head -n1 "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

# kiln_stop_pid PIDFILE [SECONDS]: SIGTERM the process, wait, SIGKILL if it lingers.
kiln_stop_pid() {
  local pid i limit=${2:-30}
  kiln_pid_alive "$1" || { rm -f "$1"; return 0; }
  pid=$(head -n1 "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < limit * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  rm -f "$1"
}

# kiln_pg_start DATADIR SOCKDIR LOG: initialises (once) and starts a Postgres cluster that listens
# only on a Unix socket in SOCKDIR, trusted there (SOCKDIR is 0700: only its owner and root get
# in). Creates database "kiln". Returns when it accepts connections.
kiln_pg_start() {
  local data=$1 sock=$2 log=$3
  kiln_ensure_user
  mkdir -p "$sock"
  chown "$KILN_USER:" "$sock"
  chmod 0700 "$sock"
  if [ ! -s "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    chown "$KILN_USER:" "$data"
    chmod 0700 "$data"
    runuser -u "$KILN_USER" -- "$KILN_PG_BIN/initdb" -D "$data" -U kiln --auth=trust \
      --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  fi
  touch "$log"
  chown "$KILN_USER:" "$log"
  if ! runuser -u "$KILN_USER" -- "$KILN_PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    runuser -u "$KILN_USER" -- "$KILN_PG_BIN/pg_ctl" -D "$data" -l "$log" -w -t 60 \
      -o "-c listen_addresses='' -c unix_socket_directories='$sock' -c fsync=on" start >/dev/null
  fi
  if ! psql -h "$sock" -U kiln -d postgres -tAc "select 1 from pg_database where datname='kiln'" | grep -q 1; then
    psql -h "$sock" -U kiln -d postgres -qc "create database kiln" >/dev/null
  fi
}

# kiln_pg_stop DATADIR: stops the cluster (fast shutdown), if it runs.
kiln_pg_stop() {
  [ -s "$1/postmaster.pid" ] || return 0
  runuser -u "$KILN_USER" -- "$KILN_PG_BIN/pg_ctl" -D "$1" -m fast -w -t 60 stop >/dev/null 2>&1 || true
}

# kiln_redis_start DATADIR SOCK PIDFILE LOG: starts Redis on a Unix socket only (mode 0700).
kiln_redis_start() {
  local data=$1 sock=$2 pidfile=$3 log=$4 i
  kiln_ensure_user
  kiln_pid_alive "$pidfile" && return 0
  mkdir -p "$data" "$(dirname "$sock")"
  chown "$KILN_USER:" "$data"
  touch "$log" "$pidfile"
  chown "$KILN_USER:" "$log" "$pidfile"
  runuser -u "$KILN_USER" -- redis-server --port 0 --unixsocket "$sock" --unixsocketperm 700 \
    --dir "$data" --daemonize yes --pidfile "$pidfile" --logfile "$log" \
    --appendonly yes --save "" >/dev/null
  for ((i = 0; i < 100; i++)); do
    redis-cli -s "$sock" ping 2>/dev/null | grep -q PONG && return 0
    sleep 0.1
  done
  echo "redis did not start; see $log" >&2
  return 1
}

# kiln_node_table NODE_ID: the name of kiln-node's nftables table, inet kiln_<node id with - as _>
# (node/netsetup.c).
kiln_node_table() {
  echo "kiln_${1//-/_}"
}

# kiln_node_table_remove NODE_ID: removes the node's nftables table when it is there (a node that
# stops cleanly removes it itself; one killed leaves it). Forwarding is left on. Prints what it did.
kiln_node_table_remove() {
  local t
  command -v nft >/dev/null 2>&1 || return 0
  t=$(kiln_node_table "$1")
  nft list table inet "$t" >/dev/null 2>&1 || return 0
  nft "table inet $t; delete table inet $t"
  echo "removed nftables table inet $t"
}
