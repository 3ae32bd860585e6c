#!/usr/bin/env bash
# The test command: installs and starts the private Redis and PostgreSQL (scripts/services.sh),
# builds, then runs every test against them. Each test starts its own redis-server on a free
# port and clones its own PostgreSQL database from a migrated template, so tests run in
# parallel. Message decoding is covered by property tests in the normal suite; long fuzzing
# (scripts/fuzz.sh) and the long chaos soak (scripts/chaos.sh) are separate.
#
# The glibc 2.17 release build (scripts/release.sh with the quick glibc-check profile,
# minutes of CPU) runs in the background from the start at a low CPU priority (nice 10, set
# on its session's scheduler autogroup too: setsid gives it a group of its own, and with
# autogroups a process's nice counts only inside its group, so the group would otherwise
# take half of the cores beside the build), so it mostly takes what the build and the tests
# leave idle; tests/it/release.rs waits for it
# (DW_RELEASE_CHECK names its directory: log, then rc). promtool is fetched first, for
# tests/it/monitoring.rs.
#
# Debian packages some tests need are installed (as root, with apt-get) in the background
# while cargo builds, when missing: `chromium` (the status page tests look at the page in
# headless Chromium), `rpm` (tests/it/release.rs installs the RPM into a throwaway root
# with it; release.sh packs the RPM with its rpmbuild) and `php-cli` with `php-redis`
# (tests/it/php.rs runs the PHP library of clients/php/ against the worker), `faketime`
# (libfaketime: tests/it/clock.rs runs the worker with its clock 120 s ahead of and behind
# Redis's).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
phase() { echo "== $* ($(( $(date +%s) - start ))s)"; }
phase "background: promtool, then the glibc 2.17 release build (log: target/release-check/log)"
export DW_RELEASE_CHECK=$PWD/target/release-check
mkdir -p "$DW_RELEASE_CHECK"
rm -f "$DW_RELEASE_CHECK/rc"
setsid nice -n 10 bash -c '
  echo 10 >/proc/self/autogroup 2>/dev/null || true
  scripts/monitoring/promtool.sh >/dev/null 2>&1 || true
  rc=0
  CARGO_TARGET_DIR=$DW_RELEASE_CHECK/build scripts/release.sh --profile glibc-check \
    --out "$DW_RELEASE_CHECK/dist" || rc=$?
  echo "$rc" >"$DW_RELEASE_CHECK/rc.new" && mv "$DW_RELEASE_CHECK/rc.new" "$DW_RELEASE_CHECK/rc"
' >"$DW_RELEASE_CHECK/log" 2>&1 </dev/null &
release_pid=$!
# A run filtered to some tests does not wait for it.
trap 'kill -- -"$release_pid" 2>/dev/null || true' EXIT
# The services (installed with apt-get when missing) and the packages some tests need
# are set up in the background while cargo builds: on a fresh machine that is half a
# minute of apt-get the build does not wait for.
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
packages=()
command -v chromium >/dev/null || packages+=(chromium)
{ command -v rpm && command -v rpmbuild; } >/dev/null || packages+=(rpm)
command -v php >/dev/null || packages+=(php-cli)
{ command -v php && php -r 'exit(extension_loaded("redis") ? 0 : 1);'; } >/dev/null 2>&1 ||
  packages+=(php-redis)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 ] || packages+=(faketime)
mkdir -p target
services_log=target/services.log
apt_log=target/apt-install.log
rm -f target/services.rc
if [ ${#packages[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  echo "${packages[*]} missing and this is not root: the tests that use them will fail (apt-get install ${packages[*]})"
  packages=()
fi
phase "background: redis-server and postgresql (scripts/services.sh; log: $services_log), then ${packages[*]:-no packages} (apt-get; log: $apt_log)"
(
  rc=0
  scripts/services.sh start --fast >"$services_log" 2>&1 </dev/null || rc=$?
  echo "$rc" >target/services.rc
  if [ ${#packages[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    # release.sh may be installing a tool of its own: wait for its lock, do not fail.
    apt=(apt-get -o DPkg::Lock::Timeout=600)
    "${apt[@]}" install -y -qq "${packages[@]}" ||
      { "${apt[@]}" update -qq && "${apt[@]}" install -y -qq "${packages[@]}"; }
  fi
) >"$apt_log" 2>&1 </dev/null &
setup_pid=$!
phase "building the tests (a first build takes about 2-3 minutes on 2 cores)"
cargo build --all-targets --quiet
phase "built"
# The background release build, kept behind the test build so far, now ends the run (its
# tests wait for it): from here it shares the cores equally with the tests (root only;
# a clean clone on 2 cores: 309 s against 340 s, the tests no slower).
renice -n 0 -g "$release_pid" >/dev/null 2>&1 || true
echo 0 >"/proc/$release_pid/autogroup" 2>/dev/null || true
setup_rc=0
wait "$setup_pid" || setup_rc=$?
cat "$services_log"
if [ "$(cat target/services.rc 2>/dev/null)" != 0 ]; then
  echo "scripts/services.sh start --fast failed (its log above)"
  exit 1
fi
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$setup_rc" = 0 ]; then
    phase "${packages[*]} installed"
  else
    echo "installing ${packages[*]} failed (the tests that use them will fail); the last lines of $apt_log:"
    tail -n 5 "$apt_log"
  fi
fi
# Most integration tests wait on their servers (a failover, a lock held, a worker stopping)
# rather than compute: five at a time per core keeps both cores busy (measured on 2 cores:
# 254 s with 2 at a time, 151 s with 4, 139 s with 6, with fewer and shorter tests; with
# 294 tests, whose longest wait 30-60 s for a standstill or a minute's window, 281 s with 6
# in a clean clone and 234 s with 8 warm; with 310 tests, a clean clone's whole run took
# 369 s with 8, the two cores 63 % busy, and the tests alone 190 s with 10 warm).
# RUST_TEST_THREADS overrides it.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-$(( $(nproc) * 5 ))}
if [ $# -gt 0 ]; then
  phase "testing ($RUST_TEST_THREADS tests at a time)"
  cargo test --all-targets -- "$@"
  phase "done"
  exit 0
fi
# tests/it/release.rs waits for the background release build, in a test process of its own
# beside the rest, its output shown when both are done: in the rest's process its nine
# tests held nine of the ten threads until that build ended (4 min beside the tests),
# leaving one for everything after `release` in the alphabet. (The shop database's suite
# run beside the rest as well, eight at a time, made its lateness bounds fail under the
# load: not kept.)
phase "testing ($RUST_TEST_THREADS tests at a time; beside them tests/it/release.rs, log: target/release-tests.log)"
cargo test --test it -- release:: --test-threads 3 >target/release-tests.log 2>&1 &
release_tests_pid=$!
rc=0
cargo test --all-targets -- --skip release:: || rc=$?
phase "the rest done; waiting for tests/it/release.rs"
release_rc=0
wait "$release_tests_pid" || release_rc=$?
cat target/release-tests.log
phase "done"
if [ "$rc" != 0 ] || [ "$release_rc" != 0 ]; then
  echo "failed: exit codes $rc (the rest), $release_rc (tests/it/release.rs)"
  exit 1
fi

