#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# builds, then runs every test against them. Each test starts its own redis-server on a free
# port and clones its own PostgreSQL database from a migrated template, so tests run in
# parallel. Message decoding is covered by property tests in the normal suite; long fuzzing
# (scripts/fuzz.sh) and the long chaos soak (scripts/chaos.sh) are separate. The status
# page tests look at the page in headless Chromium: Debian's `chromium` is installed (as
# root, with apt-get) in the background while cargo builds, when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
phase() { echo "== $* ($(( $(date +%s) - start ))s)"; }
phase "services: redis-server and postgresql (installed with apt-get when missing)"
scripts/services.sh start --fast
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
chromium_pid=
chromium_log=target/chromium-install.log
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    phase "installing chromium in the background (apt-get; log: $chromium_log)"
    mkdir -p target
    (
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }
    ) >"$chromium_log" 2>&1 &
    chromium_pid=$!
  else
    echo "chromium is missing and this is not root: the status page tests will fail (apt-get install chromium)"
  fi
fi
phase "building the tests (a first build takes about 2-3 minutes on 2 cores)"
cargo build --all-targets --quiet
if [ -n "$chromium_pid" ]; then
  if wait "$chromium_pid"; then
    phase "chromium installed"
  else
    echo "installing chromium failed (the status page tests will fail); the last lines of $chromium_log:"
    tail -n 5 "$chromium_log"
  fi
fi
phase "testing"
cargo test --all-targets -- "$@"
phase "done"
