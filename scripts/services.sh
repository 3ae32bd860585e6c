#!/usr/bin/env bash
# Private Redis and PostgreSQL on loopback, for development, the tests and the demo.
#
#   scripts/services.sh install        apt-get install redis-server postgresql systemd if missing
#   scripts/services.sh start [--fast] start both (idempotent); --fast turns off fsync (tests),
#                                      and a cluster it creates lives in /dev/shm when that
#                                      is a tmpfs with room ($DW_RUN_DIR/pg links to it);
#                                      it also makes the de_DE and fr_FR locales the tests use
#   scripts/services.sh stop           stop both
#   scripts/services.sh status         say what runs
#   scripts/services.sh env            print REDIS_URL / DATABASE_URL exports
#
# Data lives in $DW_RUN_DIR (default /tmp/delay-worker-services), ports are
# $DW_REDIS_PORT (6390) and $DW_PG_PORT (5439), so nothing clashes with a system Redis or
# PostgreSQL. PostgreSQL refuses to run as root: when run as root the cluster belongs to
# the `postgres` user the Debian package creates.
set -euo pipefail

RUN_DIR=${DW_RUN_DIR:-/tmp/delay-worker-services}
REDIS_PORT=${DW_REDIS_PORT:-6390}
PG_PORT=${DW_PG_PORT:-5439}
PG_DB=${DW_PG_DB:-delay_worker}

die() { echo "services: $*" >&2; exit 1; }

pg_bin() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$d" ] && echo "$d"
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

install() {
  # systemd only for `systemd-analyze verify` of scripts/worker.service in the tests.
  if command -v redis-server >/dev/null && [ -n "$(pg_bin)" ] && command -v systemd-analyze >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "redis-server, postgresql or systemd-analyze is missing; run as root to install them"
  echo "services: installing redis-server, postgresql and systemd (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server postgresql systemd >/dev/null
  # The packages start their own servers where systemd runs; ours are separate.
}

# The tests (--fast) read a server whose messages are German or French (lc_messages), so
# those locales must exist when it starts: made once where missing, from the `locales`
# package's sources.
test_locales() {
  local l
  for l in de_DE fr_FR; do
    locale -a 2>/dev/null | grep -qix "$l.utf8" && continue
    if [ "$(id -u)" != 0 ]; then
      echo "services: the locale $l.UTF-8 is missing (the tests need it); run as root to make it" >&2
      continue
    fi
    if [ ! -f "/usr/share/i18n/locales/$l" ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq locales >/dev/null
    fi
    localedef -i "$l" -f UTF-8 "$l.UTF-8" || die "localedef $l.UTF-8 failed"
  done
}

# PONG, not an error reply: a Redis still loading its AOF answers LOADING (and redis-cli
# exits 0), and a worker started then stops with "Redis is loading the dataset".
redis_up() { [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ]; }

# The demo's Redis keeps what it is given as the guarantees assume (an append-only file,
# each write synced); the tests' (--fast) keeps nothing, each test starting its own.
start_redis() {
  local fast=$1 keep=(--appendonly yes --appendfsync always)
  if redis_up; then return 0; fi
  [ "$fast" = 1 ] && keep=(--save "" --appendonly no)
  mkdir -p "$RUN_DIR/redis"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --daemonize yes \
    --dir "$RUN_DIR/redis" --pidfile "$RUN_DIR/redis/redis.pid" \
    --logfile "$RUN_DIR/redis/redis.log" "${keep[@]}" 9>&-
  for _ in $(seq 100); do redis_up && return 0; sleep 0.1; done
  die "redis-server did not answer on port $REDIS_PORT (see $RUN_DIR/redis/redis.log)"
}

pg_up() { as_pg "$(pg_bin)/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" 2>/dev/null; }

start_pg() {
  local bin fast=$1
  bin=$(pg_bin) || die "postgresql is not installed (scripts/services.sh install)"
  if ! pg_up; then
    init_and_start_pg "$bin" "$fast"
  fi
  as_pg "$bin/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -qtAc \
    "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" | grep -q 1 \
    || as_pg "$bin/createdb" -h 127.0.0.1 -p "$PG_PORT" -U postgres "$PG_DB"
}

# Where --fast keeps a new cluster when /dev/shm is a memory file system with room.
shm_pg_dir() { echo "/dev/shm/delay-worker-pg-$PG_PORT"; }

# /dev/shm is a tmpfs with at least 2 GiB free (the clones of the tests' databases take
# a few hundred MB at most).
shm_roomy() {
  [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ] &&
    [ "$(df --output=avail -k /dev/shm | tail -n 1)" -ge $((2 * 1024 * 1024)) ]
}

# A new cluster at $RUN_DIR/pg. It is made aside and put in place only once initdb has
# finished, so a $RUN_DIR/pg without PG_VERSION is what an init cut off (or a reboot that
# emptied /dev/shm under the link) left: it holds nothing and goes. So does a memory
# directory for this port that an earlier run directory left (no server answers on the
# port, or this would not run).
init_pg() {
  local bin=$1 fast=$2 dir
  if [ -L "$RUN_DIR/pg" ] || [ -e "$RUN_DIR/pg" ]; then
    echo "services: $RUN_DIR/pg holds no finished cluster (an init cut off?): making a new one"
    [ -L "$RUN_DIR/pg" ] && rm -rf "$(shm_pg_dir)"
    rm -rf "$RUN_DIR/pg"
  fi
  if [ "$fast" = 1 ] && shm_roomy; then
    # The tests' cluster in memory: each test clones a database of its own and drops
    # it, and on ext4 creating and deleting those thousands of files cost the server
    # more CPU than anything the tests ran in it.
    dir=$(shm_pg_dir)
  else
    dir="$RUN_DIR/pg.new"
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$dir"
  as_pg "$bin/initdb" -D "$dir" -U postgres -A trust --no-sync -E UTF8 >/dev/null
  if [ "$dir" = "$RUN_DIR/pg.new" ]; then mv "$dir" "$RUN_DIR/pg"; else ln -s "$dir" "$RUN_DIR/pg"; fi
}

init_and_start_pg() {
  local bin=$1 fast=$2
  mkdir -p "$RUN_DIR"
  chmod 755 "$RUN_DIR"
  [ -f "$RUN_DIR/pg/PG_VERSION" ] || init_pg "$bin" "$fast"
  local opts="-c listen_addresses=127.0.0.1 -p $PG_PORT -k $RUN_DIR/pg -c max_connections=400"
  opts="$opts -c shared_buffers=256MB"
  if [ "$fast" = 1 ]; then
    opts="$opts -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  fi
  as_pg "$bin/pg_ctl" -D "$RUN_DIR/pg" -l "$RUN_DIR/pg/server.log" -o "$opts" -w -t 60 start >/dev/null 9>&- \
    || die "postgresql did not start (see $RUN_DIR/pg/server.log)"
}

stop() {
  if [ -f "$RUN_DIR/redis/redis.pid" ]; then
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  fi
  if [ -f "$RUN_DIR/pg/postmaster.pid" ]; then
    as_pg "$(pg_bin)/pg_ctl" -D "$RUN_DIR/pg" -m fast -w stop >/dev/null || true
  fi
}

env_lines() {
  echo "export REDIS_URL=redis://127.0.0.1:$REDIS_PORT/"
  echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/$PG_DB"
}

case "${1:-}" in
  install) install ;;
  start)
    # One start at a time per $DW_RUN_DIR: a second one (another checkout's tests, the demo)
    # waits for the first and then finds the packages installed and the servers up, instead
    # of meeting apt-get's lock or a half-made cluster. The servers are started without the
    # lock's descriptor (9>&-), so the lock ends with this script.
    mkdir -p "$RUN_DIR"
    exec 9>"$RUN_DIR/.start.lock"
    flock 9
    install
    fast=0; [ "${2:-}" = "--fast" ] && fast=1
    start_redis "$fast"
    # Before PostgreSQL starts: its processes see only the locales there at its start.
    [ "$fast" = 0 ] || test_locales
    start_pg "$fast"
    echo "services: redis on 127.0.0.1:$REDIS_PORT, postgresql on 127.0.0.1:$PG_PORT (data in $RUN_DIR)"
    ;;
  stop) stop ;;
  status)
    redis_up && echo "redis: up on $REDIS_PORT" || echo "redis: down"
    pg_up && echo "postgresql: up on $PG_PORT" || echo "postgresql: down"
    ;;
  env) env_lines ;;
  *) echo "usage: $0 install|start [--fast]|stop|status|env" >&2; exit 2 ;;
esac
