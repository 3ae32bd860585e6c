#!/usr/bin/env bash
# The chaos soak (tests/it/chaos.rs): seeded runs of faults over a load of order timeouts,
# each ending with an exact oracle, one seed after another until the time is up. A third of
# the seeds run on a Redis Cluster of three masters with --shards 3 and reshard a slot.
#
#   scripts/chaos.sh --minutes 30                  random seeds for 30 minutes
#   scripts/chaos.sh --seed 123 --minutes 0        exactly one run, seed 123 (a replay)
#   scripts/chaos.sh --seed 123 --minutes 10       seed 123 first, then random seeds
#
# Options: --seconds N   schedule length of each run (default 60; the plan scales with it)
#          --skip LIST   fault kinds (and float-ts, flaky, repush) taken out of every plan
#                        (DW_CHAOS_SKIP), e.g. wrong-dead,float-ts. The rest of each plan
#                        stays as drawn, so a failing seed replayed with one kind skipped
#                        shows whether it is the cause (names: SKIPPABLE in tests/it/chaos.rs)
#          --logs DIR    where the logs go (default target/chaos/<date>-<time>)
#
# Builds once, then runs the test binary's ignored `chaos::chaos_seeded` for each seed with
# DW_CHAOS_SEED and DW_CHAOS_SECONDS. Each run's output goes to <logs>/seed-<S>.log, the
# worker processes' logs of a failed run to <logs>/chaos-<S>-<pid>/. One line per seed:
# PASS or FAIL, and for a failure the replay command. Exits 1 if any seed failed.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=""
seed=""
seconds=60
skip=""
logs=""
usage() {
  sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=${2:?--minutes needs a number}; shift 2 ;;
    --seed) seed=${2:?--seed needs a number}; shift 2 ;;
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --skip) skip=${2:?--skip needs a list}; shift 2 ;;
    --logs) logs=${2:?--logs needs a directory}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "chaos: unknown argument $1" >&2; usage ;;
  esac
done
[ -n "$minutes" ] || { echo "chaos: --minutes is required (0 runs exactly one seed)" >&2; exit 2; }
[[ "$minutes" =~ ^[0-9]+$ ]] || { echo "chaos: --minutes must be a whole number" >&2; exit 2; }
[[ "$seconds" =~ ^[0-9]+$ ]] || { echo "chaos: --seconds must be a whole number" >&2; exit 2; }
[ -z "$seed" ] || [[ "$seed" =~ ^[0-9]+$ ]] || { echo "chaos: --seed must be a u64" >&2; exit 2; }

scripts/services.sh start --fast
export DW_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"

logs=${logs:-target/chaos/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)

# Build once; the test binary is run directly from then on.
echo "chaos: building the tests"
bin=$(cargo test --test it --no-run --message-format=json 2>"$logs/build.log" \
  | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' | grep '/it-' | tail -n 1) || true
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  cat "$logs/build.log" >&2
  echo "chaos: the build failed (see $logs/build.log)" >&2
  exit 1
fi

random_seed() { od -An -N8 -tu8 /dev/urandom 2>/dev/null | tr -d ' ' || echo $(( (RANDOM << 30) | (RANDOM << 15) | RANDOM )); }

start=$(date +%s)
deadline=$(( start + minutes * 60 ))
runs=0
failed=0
failures=()
skip_flag=""
[ -z "$skip" ] || skip_flag=" --skip $skip"
echo "chaos: ${seconds}s runs for ${minutes} minute(s); logs in $logs"
while :; do
  if [ $runs -gt 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then
    break
  fi
  if [ $runs -eq 0 ] && [ -n "$seed" ]; then s=$seed; else s=$(random_seed); fi
  log="$logs/seed-$s.log"
  t0=$(date +%s)
  set +e
  DW_CHAOS_SEED=$s DW_CHAOS_SECONDS=$seconds DW_CHAOS_SKIP=$skip DW_CHAOS_LOG_DIR=$logs \
    RUST_BACKTRACE=0 "$bin" chaos::chaos_seeded --ignored --exact --nocapture --test-threads 1 \
    >"$log" 2>&1
  rc=$?
  set -e
  took=$(( $(date +%s) - t0 ))
  runs=$((runs + 1))
  replay="scripts/chaos.sh --seed $s --seconds $seconds --minutes 0$skip_flag"
  if [ $rc -eq 0 ] && grep -q "^test result: ok. 1 passed" "$log"; then
    echo "seed $s: PASS (${took}s)"
  else
    failed=$((failed + 1))
    kinds=$(grep -o '^  FAIL [0-9]* × .*' "$log" | sed 's/^  FAIL //' | paste -sd ';' - || true)
    echo "seed $s: FAIL (${took}s) ${kinds:-(see the log)}"
    echo "    log: $log"
    echo "    replay: $replay"
    failures+=("$s")
  fi
  [ "$minutes" -eq 0 ] && break
done
echo "chaos: $runs run(s), $failed failed, in $(( ($(date +%s) - start) / 60 )) minute(s)${failures:+; failed seeds: ${failures[*]}}"
[ $failed -eq 0 ]
