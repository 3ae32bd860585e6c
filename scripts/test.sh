#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# then runs every test against them. Each test starts its own redis-server on a free port
# and clones its own PostgreSQL database from a migrated template, so tests run in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh start --fast
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
cargo build --all-targets
cargo test --all-targets -- "$@"
