#!/usr/bin/env bash
# Prints the path of a `promtool` (Prometheus' rule checker), for tests/it/monitoring.rs and
# for checking edited rules by hand:
#
#   "$(scripts/monitoring/promtool.sh)" test rules scripts/monitoring/alerts.test.yml
#
# One on PATH is used as it is. Otherwise it is taken out of Debian's `prometheus` package
# into target/tools/bin: `apt-get download` and `dpkg-deb -x`, nothing installed or started
# (the package would also start a Prometheus server).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tools=$root/target/tools/bin

if command -v promtool >/dev/null; then
  command -v promtool
  exit 0
fi
if [ ! -x "$tools/promtool" ]; then
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null ||
    { echo "promtool: not found; install Prometheus' promtool (Debian: apt-get install prometheus)" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # _apt cannot write into a root-only temporary directory: allow it to enter and write.
  chmod 0777 "$tmp"
  (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) ||
    { apt-get update -qq >/dev/null 2>&1 && (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); } ||
    { echo "promtool: apt-get download prometheus failed" >&2; exit 1; }
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  mkdir -p "$tools"
  install -m 0755 "$tmp/x/usr/bin/promtool" "$tools/promtool.new"
  mv "$tools/promtool.new" "$tools/promtool"
fi
echo "$tools/promtool"
