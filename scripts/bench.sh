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
#
# Scenarios: steady-ms steady-s backlog engine (the default set) and prune. Anything else
# is passed on to `worker bench` (see `worker bench --help`: --duration, --rate,
# --max-delay, --backlog-jobs, --engine-jobs, --prune-rows, --timeout, --ceiling-time,
# --threads, --inbox-prune-batch, ...).
#
# Works on a fresh Debian machine (as root it installs what is missing). It runs its OWN
# Redis (6391) and PostgreSQL (5440) with durable settings (fsync and synchronous commit
# on, unlike the tests' --fast), data in /tmp/delay-worker-bench, and a fresh database
# dw_bench each run. They keep running afterwards; stop them with
#   DW_RUN_DIR=/tmp/delay-worker-bench DW_REDIS_PORT=6391 DW_PG_PORT=5440 scripts/services.sh stop
set -euo pipefail

cd "$(dirname "$0")/.."

export DW_RUN_DIR=/tmp/delay-worker-bench DW_REDIS_PORT=6391 DW_PG_PORT=5440
DB=dw_bench

die() { echo "bench: $*" >&2; exit 1; }

scenarios=()
flags=()
for a in "$@"; do
  case "$a" in
    steady-ms|steady-s|backlog|engine|prune) scenarios+=(--scenario "$a") ;;
    *) flags+=("$a") ;;
  esac
done

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

exec env RUST_LOG="${RUST_LOG:-warn}" "$WORKER" bench "${scenarios[@]}" "${flags[@]}"
