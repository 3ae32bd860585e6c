#!/usr/bin/env bash
# Fuzzes message decoding and validation (fuzz/fuzz_targets/decode.rs) with cargo fuzz.
#   scripts/fuzz.sh [SECONDS]     default 30; the test script runs a short pass
# cargo fuzz needs nightly features: RUSTC_BOOTSTRAP=1 enables them on the stable toolchain
# this machine has. Installs cargo-fuzz from crates.io when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
fi
export RUSTC_BOOTSTRAP=1
mkdir -p fuzz/corpus/decode
# A few seeds in the wire format, so the fuzzer starts from the interesting shapes.
printf '%s' '{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":0,"ts":1768764300}' > fuzz/corpus/decode/seed1
printf '%s' '{"event":"payment.paid","payload":{"order_id":7},"retry":2,"x":[1,{"y":null}]}' > fuzz/corpus/decode/seed2
printf '%s' '{"order_no":"SO1","amount":990}' > fuzz/corpus/decode/seed3
cargo fuzz run decode fuzz/corpus/decode -- -max_total_time="$secs" -max_len=4096 -print_final_stats=1 2>&1 | tail -n 15
