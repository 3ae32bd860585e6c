#!/usr/bin/env bash
# scripts/bench.sh [scenario ...] [worker bench flags ...]
#
# Measures the release worker against this machine's own ceilings (issue 7): lateness,
# throughput, CPU and memory per scenario, next to redis-benchmark XADD and pgbench running
# the order.timeout transaction; checks the books of every scenario. Prints a table and
# writes JSON (target/bench/<UTC date-time>.json unless --out is given).
#
#   scripts/bench.sh                                  every scenario but prune, default sizes
#   scripts/bench.sh backlog engine                   some of them
#   scripts/bench.sh steady-ms --duration 5s --rate 500 --threads 4
#   scripts/bench.sh prune --no-ceilings              inbox pruning under the steady load
#   scripts/bench.sh shop --no-ceilings               the shop's own traffic beside a drain
#   scripts/bench.sh cluster                          the engine on 1 and on 3 Redis Cluster
#                                                     masters, spread over shards, the model
#
# Scenarios: steady-ms steady-s backlog engine (the default set), prune and shop. Anything else
# is passed on to `worker bench` (see `worker bench --help`: --duration, --rate,
# --max-delay, --backlog-jobs, --engine-jobs, --prune-rows, --timeout, --ceiling-time,
# --threads, --inbox-prune-batch, ...).
#
# Works on a fresh Debian machine (as root it installs what is missing). It runs its OWN
# Redis (6391) and PostgreSQL (5440) with durable settings (fsync and synchronous commit
# on, unlike the tests' --fast), data in /tmp/delay-worker-bench, and a fresh database
# dw_bench each run. They keep running afterwards; stop them with
#   DW_RUN_DIR=/tmp/delay-worker-bench DW_REDIS_PORT=6391 DW_PG_PORT=5440 scripts/services.sh stop
#
# `cluster` (alone, with worker bench flags) starts two Redis Clusters of its own on
# loopback, no replicas, data in /tmp/delay-worker-bench/cluster: one master (7401) and
# three (7411-7413, made by `redis-cli --cluster create`: even slot ranges); it stops them
# when it ends. Five runs, the same PostgreSQL:
#   1 master,  --key-prefix '{mq}' (one slot, no shards)   engine, backlog; redis ceiling
#   1 master,  --shards 3                                  engine (what sharding costs)
#   3 masters, --shards 3, slots as created                engine; redis ceiling
#   3 masters, --shards 12, slots as created               engine
#   3 masters, --shards 12, 4 shards' slots per master     engine, backlog; every ceiling
# then a summary: jobs/s, the spread over shards and masters (max/min), Redis CPU per job
# per master, and the model of the last run (what N hosts and M masters would carry).
set -euo pipefail

cd "$(dirname "$0")/.."

export DW_RUN_DIR=/tmp/delay-worker-bench DW_REDIS_PORT=6391 DW_PG_PORT=5440
DB=dw_bench

die() { echo "bench: $*" >&2; exit 1; }

scenarios=()
flags=()
cluster=0
for a in "$@"; do
  case "$a" in
    steady-ms|steady-s|backlog|engine|prune|shop) scenarios+=(--scenario "$a") ;;
    cluster) cluster=1 ;;
    *) flags+=("$a") ;;
  esac
done
[ "$cluster" = 0 ] || [ "${#scenarios[@]}" = 0 ] \
  || die "cluster runs its own scenarios (engine, backlog); name no other"

apt_install() {
  [ "$(id -u)" = 0 ] || die "$1 is missing; run as root to install $2, or install it yourself"
  echo "bench: installing $2 (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$2" >/dev/null
}

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

# The servers (and their packages) first: redis-server pulls in redis-tools, and the
# postgresql server package ships pgbench on Debian 12.
scripts/services.sh start

command -v redis-benchmark >/dev/null || apt_install redis-benchmark redis-tools
if ! command -v pgbench >/dev/null && [ ! -x "$(pg_bin)/pgbench" ]; then
  apt_install pgbench postgresql-contrib
fi
# pgbench of the server's own version first.
PATH="$(pg_bin):$PATH"
export PATH

command -v cargo >/dev/null || die "cargo is missing: install Rust (https://rustup.rs)"
echo "bench: cargo build --release"
cargo build --release --quiet
WORKER="${CARGO_TARGET_DIR:-target}/release/worker"
[ -x "$WORKER" ] || die "no $WORKER after the build"

psql_admin() { psql -h 127.0.0.1 -p "$DW_PG_PORT" -U postgres -d postgres -qtA -v ON_ERROR_STOP=1 "$@"; }
psql_admin -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null
psql_admin -c "CREATE DATABASE $DB" >/dev/null
redis-cli -p "$DW_REDIS_PORT" FLUSHALL >/dev/null

export REDIS_URL="redis://127.0.0.1:$DW_REDIS_PORT/"
export DATABASE_URL="postgres://postgres@127.0.0.1:$DW_PG_PORT/$DB"
RUST_LOG=warn "$WORKER" migrate >/dev/null

if [ "$cluster" = 0 ]; then
  exec env RUST_LOG="${RUST_LOG:-warn}" "$WORKER" bench "${scenarios[@]}" "${flags[@]}"
fi

# ---- cluster ----------------------------------------------------------------------------
CLUSTER_DIR="$DW_RUN_DIR/cluster"
ONE=(7401)
THREE=(7411 7412 7413)

node_stop() {
  redis-cli -p "$1" shutdown nosave >/dev/null 2>&1 || true
}

stop_clusters() {
  for p in "${ONE[@]}" "${THREE[@]}"; do node_stop "$p"; done
}

# A fresh node: any old one on the port stopped, its directory emptied.
node_start() {
  local port=$1 dir="$CLUSTER_DIR/$1"
  node_stop "$port"
  rm -rf "$dir"
  mkdir -p "$dir"
  redis-server --port "$port" --bind 127.0.0.1 --daemonize yes --dir "$dir" \
    --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --save "" --appendonly no \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000
  for _ in $(seq 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "redis-server did not answer on port $port (see $dir/redis.log)"
}

# Waits until every node says cluster_state:ok with all 16384 slots assigned.
cluster_wait() {
  local p
  for _ in $(seq 200); do
    local ok=1
    for p in "$@"; do
      redis-cli -p "$p" cluster info 2>/dev/null | tr -d '\r' \
        | grep -q '^cluster_state:ok$' || ok=0
      redis-cli -p "$p" cluster info 2>/dev/null | tr -d '\r' \
        | grep -q '^cluster_slots_assigned:16384$' || ok=0
    done
    [ "$ok" = 1 ] && return 0
    sleep 0.1
  done
  die "the cluster on ports $* did not reach cluster_state:ok"
}

flush() {
  for p in "$@"; do redis-cli -p "$p" flushall >/dev/null; done
}

# The port of the master serving a slot, as the first node of "$@" sees it.
slot_owner() {
  local slot=$1
  shift
  redis-cli -p "$1" cluster nodes | awk -v s="$slot" '$3 ~ /master/ {
    for (i = 9; i <= NF; i++) {
      n = split($i, r, "-"); if (n == 1) r[2] = r[1]
      if (s + 0 >= r[1] + 0 && s + 0 <= r[2] + 0) { split($2, a, "[:@]"); print a[2] }
    } }'
}

# Moves an empty slot to the master on port $2 (the steps of CLUSTER SETSLOT's
# documentation, with no keys to MIGRATE), then waits until every node agrees.
move_slot() {
  local slot=$1 to=$2 from p
  shift 2
  from=$(slot_owner "$slot" "$@")
  [ "$from" = "$to" ] && return 0
  local to_id from_id
  to_id=$(redis-cli -p "$to" cluster myid)
  from_id=$(redis-cli -p "$from" cluster myid)
  redis-cli -p "$to" cluster setslot "$slot" importing "$from_id" >/dev/null
  redis-cli -p "$from" cluster setslot "$slot" migrating "$to_id" >/dev/null
  redis-cli -p "$to" cluster setslot "$slot" node "$to_id" >/dev/null
  redis-cli -p "$from" cluster setslot "$slot" node "$to_id" >/dev/null
  for p in "$@"; do
    [ "$p" = "$to" ] || [ "$p" = "$from" ] \
      || redis-cli -p "$p" cluster setslot "$slot" node "$to_id" >/dev/null
  done
  for _ in $(seq 200); do
    local agreed=1
    for p in "$@"; do [ "$(slot_owner "$slot" "$p")" = "$to" ] || agreed=0; done
    [ "$agreed" = 1 ] && return 0
    sleep 0.1
  done
  die "slot $slot did not move to the master on port $to"
}

# Shard i's slot (its hash tag {mq:i}) onto master i mod M: N/M shards on each.
place_shards() {
  local n=$1 i slot
  shift
  for ((i = 0; i < n; i++)); do
    slot=$(redis-cli -p "$1" cluster keyslot "{mq:$i}")
    local ports=("$@")
    move_slot "$slot" "${ports[$((i % ${#ports[@]}))]}" "$@"
  done
  cluster_wait "$@"
}

trap stop_clusters EXIT
echo "bench: starting a Redis Cluster of 1 master (${ONE[*]}) and one of 3 (${THREE[*]})"
for p in "${ONE[@]}" "${THREE[@]}"; do node_start "$p"; done
# redis-cli --cluster create wants three masters at least: one master takes every slot itself.
redis-cli -p "${ONE[0]}" cluster addslotsrange 0 16383 >/dev/null
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${THREE[@]}") --cluster-replicas 0 \
  --cluster-yes >"$CLUSTER_DIR/create.log" 2>&1 \
  || die "redis-cli --cluster create failed (see $CLUSTER_DIR/create.log)"
cluster_wait "${ONE[@]}"
cluster_wait "${THREE[@]}"

stamp=$(date -u +%Y-%m-%dT%H%M%SZ)
OUT=target/bench/cluster-$stamp
mkdir -p "$OUT"
echo "bench: load average before the runs: $(cut -d' ' -f1-3 /proc/loadavg)"

# run NAME PORTS... -- worker bench flags...
run() {
  local name=$1 ports=() urls=()
  shift
  while [ "$1" != "--" ]; do ports+=("$1"); shift; done
  shift
  for p in "${ports[@]}"; do urls+=("127.0.0.1:$p"); done
  flush "${ports[@]}"
  echo
  echo "=== $name ==="
  local url
  url="redis+cluster://$(IFS=,; echo "${urls[*]}")"
  # A FAIL (exit 1) is kept for the end; the other runs still go.
  REDIS_URL="$url" RUST_LOG="${RUST_LOG:-warn}" "$WORKER" bench "$@" "${flags[@]}" \
    --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt" || status=1
}

status=0
runs=(1-master-1-slot 1-master-3-shards 3-masters-3-shards 3-masters-12-shards
  3-masters-12-shards-placed)
run 1-master-1-slot "${ONE[@]}" -- --key-prefix '{mq}' --scenario engine,backlog --ceilings redis
run 1-master-3-shards "${ONE[@]}" -- --shards 3 --scenario engine --no-ceilings
run 3-masters-3-shards "${THREE[@]}" -- --shards 3 --scenario engine --ceilings redis
run 3-masters-12-shards "${THREE[@]}" -- --shards 12 --scenario engine --no-ceilings
flush "${THREE[@]}"
place_shards 12 "${THREE[@]}"
run 3-masters-12-shards-placed "${THREE[@]}" -- --shards 12 --scenario engine,backlog

echo
echo "=== summary (reports in $OUT) ==="
for name in "${runs[@]}"; do
  echo "$name:"
  grep -E '^machine: |^ceiling: redis XADD|^ceiling: pgbench order.timeout ([0-9]|in sets)|^  (engine|backlog): |^(engine|backlog):$|^  (spread:|master |CPU s:)' \
    "$OUT/$name.txt" | sed 's/^/  /'
done
echo
sed -n '/^model/,/^JSON/p' "$OUT/${runs[-1]}.txt" | grep -v '^JSON'
exit "$status"
