#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# builds, then runs every test against them. Each test starts its own redis-server on a free
# port and clones its own PostgreSQL database from a migrated template, so tests run in
# parallel. Message decoding is covered by property tests in the normal suite; long fuzzing
# (scripts/fuzz.sh) and the long chaos soak (scripts/chaos.sh) are separate.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
phase() { echo "== $* ($(( $(date +%s) - start ))s)"; }
phase "services: redis-server and postgresql (installed with apt-get when missing)"
scripts/services.sh start --fast
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
phase "building the tests (a first build takes about 2-3 minutes on 2 cores)"
cargo build --all-targets --quiet
phase "testing"
cargo test --all-targets -- "$@"
phase "done"
