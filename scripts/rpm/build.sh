#!/usr/bin/env bash
# Packs the RPM for EL7-compatible hosts from staged files (scripts/release.sh runs it).
#
#   scripts/rpm/build.sh --stage DIR --out DIR [--release N]
#
#   --stage DIR    holds worker (the glibc 2.17 binary, stripped), delay-worker.service (the
#                  unit with ExecStart=/usr/bin/worker) and worker.env (the template)
#   --out DIR      where delay-worker-<version>-<N>.x86_64.rpm goes
#   --release N    the package's release number [default: 1]; a higher one upgrades
#
# rpmbuild (Debian's `rpm` package has it) packs scripts/rpm/delay-worker.spec; the version
# is Cargo.toml's. Prints the package's path.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

stage=
out=
release=1
while [ $# -gt 0 ]; do
  case "$1" in
    --stage | --out | --release)
      [ $# -ge 2 ] || { echo "rpm: $1 needs a value" >&2; exit 2; }
      case "$1" in
        --stage) stage=$2 ;;
        --out) out=$2 ;;
        --release) release=$2 ;;
      esac
      shift
      ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "rpm: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
die() { echo "rpm: $*" >&2; exit 1; }
[ -n "$stage" ] && [ -n "$out" ] || die "--stage and --out are needed (try --help)"
for f in worker delay-worker.service worker.env; do
  [ -f "$stage/$f" ] || die "$stage/$f is missing"
done
case "$release" in
  '' | *[!0-9]*) die "--release must be a number, not $release" ;;
esac
command -v rpmbuild >/dev/null || die "rpmbuild is missing: install Debian's rpm package"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)
[ -n "$version" ] || die "no version in Cargo.toml"
stage=$(cd "$stage" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

top=$(mktemp -d)
trap 'rm -rf "$top"' EXIT
# _rpmdir/_build_name_fmt: the package straight into OUT (not OUT/x86_64/).
if ! rpmbuild -bb --quiet --target x86_64 \
  --define "_topdir $top" --define "_tmppath $top/tmp" --define "_rpmdir $out" \
  --define '_build_name_fmt %{NAME}-%{VERSION}-%{RELEASE}.%{ARCH}.rpm' \
  --define "dw_stage $stage" --define "dw_version $version" --define "dw_release $release" \
  "$here/delay-worker.spec" >"$top/log" 2>&1; then
  cat "$top/log" >&2
  die "rpmbuild failed"
fi
rpm=$out/delay-worker-$version-$release.x86_64.rpm
[ -f "$rpm" ] || { cat "$top/log" >&2; die "rpmbuild left no $rpm"; }
echo "$rpm"
