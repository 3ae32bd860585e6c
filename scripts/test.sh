#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# builds, then runs every test against them. Each test starts its own redis-server on a free
# port and clones its own PostgreSQL database from a migrated template, so tests run in
# parallel. Message decoding is covered by property tests in the normal suite; long fuzzing
# (scripts/fuzz.sh) and the long chaos soak (scripts/chaos.sh) are separate.
#
# The glibc 2.17 release build (scripts/release.sh with the quick glibc-check profile,
# minutes of CPU) runs in the background from the start at a low CPU priority (nice 10), so
# it mostly takes what the build and the tests leave idle; tests/it/release.rs waits for it
# (DW_RELEASE_CHECK names its directory: log, then rc). promtool is fetched first, for
# tests/it/monitoring.rs.
#
# The status page tests look at the page in headless Chromium: Debian's `chromium` is
# installed (as root, with apt-get) in the background while cargo builds, when missing;
# so is `faketime` (libfaketime), which tests/it/clock.rs runs the worker under with its
# clock 120 s ahead of and behind Redis's.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
phase() { echo "== $* ($(( $(date +%s) - start ))s)"; }
phase "background: promtool, then the glibc 2.17 release build (log: target/release-check/log)"
export DW_RELEASE_CHECK=$PWD/target/release-check
mkdir -p "$DW_RELEASE_CHECK"
rm -f "$DW_RELEASE_CHECK/rc"
setsid nice -n 10 bash -c '
  scripts/monitoring/promtool.sh >/dev/null 2>&1 || true
  rc=0
  CARGO_TARGET_DIR=$DW_RELEASE_CHECK/build scripts/release.sh --profile glibc-check \
    --out "$DW_RELEASE_CHECK/dist" || rc=$?
  echo "$rc" >"$DW_RELEASE_CHECK/rc.new" && mv "$DW_RELEASE_CHECK/rc.new" "$DW_RELEASE_CHECK/rc"
' >"$DW_RELEASE_CHECK/log" 2>&1 </dev/null &
release_pid=$!
# A run filtered to some tests does not wait for it.
trap 'kill -- -"$release_pid" 2>/dev/null || true' EXIT
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
faketime_pid=
faketime_log=target/faketime-install.log
if [ ! -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ]; then
  if [ "$(id -u)" = 0 ]; then
    phase "installing faketime in the background (apt-get; log: $faketime_log)"
    mkdir -p target
    (
      # After chromium's install, if one runs: dpkg takes one install at a time.
      [ -z "$chromium_pid" ] || while kill -0 "$chromium_pid" 2>/dev/null; do sleep 1; done
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -qq faketime || { apt-get update -qq && apt-get install -y -qq faketime; }
    ) >"$faketime_log" 2>&1 &
    faketime_pid=$!
  else
    echo "faketime is missing and this is not root: the clock tests will fail (apt-get install faketime)"
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
if [ -n "$faketime_pid" ]; then
  if wait "$faketime_pid"; then
    phase "faketime installed"
  else
    echo "installing faketime failed (the clock tests will fail); the last lines of $faketime_log:"
    tail -n 5 "$faketime_log"
  fi
fi
phase "testing"
cargo test --all-targets -- "$@"
phase "done"
