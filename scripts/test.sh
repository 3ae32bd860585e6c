#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# then runs every test against them. Each test starts its own redis-server on a free port
# and clones its own PostgreSQL database from a migrated template, so tests run in parallel.
# A short cargo fuzz pass over message decoding runs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh start --fast
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
# A short fuzzing pass over message decoding first (scripts/fuzz.sh runs longer ones), so
# the test summary is the last thing printed.
scripts/fuzz.sh "${DW_FUZZ_SECONDS:-15}"
cargo build --all-targets
cargo test --all-targets -- "$@"
