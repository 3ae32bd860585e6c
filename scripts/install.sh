#!/usr/bin/env bash
# Installs the worker as a systemd service on a host without containers. Run as root.
#
#   scripts/install.sh [--dry-run] [FILE]
#
#   FILE       a delay-worker .deb or .rpm (scripts/release.sh makes both) or a worker
#              binary [default: in an unpacked release tarball, its ./worker; in the
#              repository, where dpkg exists, the .deb in target/dist; where rpm exists and
#              dpkg does not, the .rpm there; elsewhere target/release/worker]
#   --dry-run  print the steps, change nothing (needs neither root nor systemd; fails,
#              as a real run would, when FILE is missing or the real run would refuse)
#
# A .deb (Debian, Ubuntu: where dpkg exists) is installed with `dpkg -i --force-confold`,
# an .rpm (RHEL/CentOS 7 and later: where rpm exists and dpkg does not) with `rpm -U
# --replacepkgs`: the package holds the binary (/usr/bin/worker), the unit, the environment
# file template and creates the system user (docs/operating.md "Packages"); an existing environment
# file is kept (rpm writes the template beside it as worker.env.rpmnew). A host installed
# from a binary before moves to the package: its /usr/local/bin/worker and the copied unit
# in /etc/systemd/system (which would hide the package's) are removed.
#
# A binary is copied instead: to /usr/local/bin/worker; a system user and group
# `delay-worker`; the environment file /etc/delay-worker/worker.env (mode 0600, root;
# created from scripts/worker.env only when absent, never overwritten); the unit
# scripts/worker.service as /etc/systemd/system/delay-worker.service.
#
# Then, when systemd is running (PID 1), `systemctl daemon-reload` and `systemctl enable
# --now` (or a restart when the service already runs, so a new binary takes over). A
# environment file that names no server yet (the template, just created or left unedited)
# leaves the service neither enabled nor started (a reboot would start it without its
# URLs; one enabled by an earlier run is disabled): fill it in, run `bash -c 'set -a; .
# /etc/delay-worker/worker.env; worker migrate'`, then `systemctl enable --now
# delay-worker`.
# Without systemd the script says what it would have done and exits 0. Running it again is
# safe (an upgrade).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

PACKAGE=delay-worker
UNIT_NAME=delay-worker.service
UNIT_SRC=$here/worker.service
ENV_SRC=$here/worker.env
BIN_DST=/usr/local/bin/worker
USER_NAME=delay-worker
ETC_DIR=/etc/delay-worker
ENV_FILE=$ETC_DIR/worker.env
UNIT_DST=/etc/systemd/system/$UNIT_NAME

dry_run=0
file=
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    -*) echo "install: unknown option $arg (try --help)" >&2; exit 2 ;;
    *)
      [ -z "$file" ] || { echo "install: more than one file given" >&2; exit 2; }
      file=$arg
      ;;
  esac
done
have_dpkg=0
command -v dpkg >/dev/null && have_dpkg=1
# The RPM is for hosts that have rpm as their package manager, not for a Debian host that
# has the rpm tool as well.
have_rpm=0
[ "$have_dpkg" = 0 ] && command -v rpm >/dev/null && have_rpm=1
if [ -z "$file" ] && [ -x "$here/worker" ] && [ ! -d "$root/target" ]; then
  # An unpacked release tarball: the binary beside this script.
  file=$here/worker
elif [ -z "$file" ]; then
  if [ "$have_dpkg" = 1 ]; then
    file=$(ls -1 "$root"/target/dist/${PACKAGE}_*.deb 2>/dev/null | sort -V | tail -n 1 || true)
    file=${file:-$root/target/dist/${PACKAGE}_VERSION_amd64.deb}
  elif [ "$have_rpm" = 1 ]; then
    file=$(ls -1 "$root"/target/dist/${PACKAGE}-*.x86_64.rpm 2>/dev/null | sort -V | tail -n 1 || true)
    file=${file:-$root/target/dist/${PACKAGE}-VERSION-1.x86_64.rpm}
  else
    file=$root/target/release/worker
  fi
fi
case "$file" in
  *.deb) kind=deb ;;
  *.rpm) kind=rpm ;;
  *) kind=binary ;;
esac

die() { echo "install: $*" >&2; exit 1; }
step() { echo "+ $*"; }
note() { echo "install: $*"; }
# Runs a command, or only shows it under --dry-run.
run() {
  step "$(printf '%q ' "$@")"
  [ "$dry_run" = 1 ] || "$@"
}
# Stops unless this is a dry run, which notes the problem, shows the rest, and fails at
# the end as the real run would have at once.
refused=
refuse() {
  [ "$dry_run" = 1 ] || die "$*"
  note "note: $*"
  refused=$*
}
package_installed() {
  if [ "$have_dpkg" = 1 ]; then
    dpkg-query -W -f='${Status}' "$PACKAGE" 2>/dev/null | grep -q ' installed$'
  else
    [ "$have_rpm" = 1 ] && rpm -q "$PACKAGE" >/dev/null 2>&1
  fi
}

[ -f "$UNIT_SRC" ] || die "unit file $UNIT_SRC is missing"
[ -f "$ENV_SRC" ] || die "environment file template $ENV_SRC is missing"
if [ "$kind" = deb ]; then
  [ "$have_dpkg" = 1 ] ||
    die "a .deb needs dpkg; on this host install the .rpm (where rpm exists) or the binary: scripts/install.sh DIR/worker"
elif [ "$kind" = rpm ]; then
  [ "$have_rpm" = 1 ] || {
    [ "$have_dpkg" = 1 ] &&
      die "this host has dpkg: install the .deb, not the .rpm (which is for EL7-compatible hosts)"
    die "an .rpm needs rpm; on this host install the binary instead: scripts/install.sh DIR/worker"
  }
fi
# What is to be installed must exist, dry run or not: a dry run that shows the install of
# a file that is not there would only say that a real run works when it does not.
if [ "$kind" = binary ]; then
  [ -x "$file" ] ||
    die "no executable worker at $file (build it: cargo build --release, or name one)"
  remove="dpkg -r $PACKAGE"
  # The package manager package_installed asked (dpkg where it exists).
  [ "$have_dpkg" = 0 ] && [ "$have_rpm" = 1 ] && remove="rpm -e $PACKAGE"
  ! package_installed ||
    refuse "$PACKAGE is installed as a package (/usr/bin/worker): install a newer package, or remove it first ($remove)"
else
  [ -f "$file" ] ||
    die "no package at $file (make one: scripts/release.sh; or name a package or a binary)"
fi
if [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
  die "run as root (or with --dry-run to see the steps)"
fi
[ "$dry_run" = 1 ] && note "dry run, nothing is changed"

env_created=0
[ -e "$ENV_FILE" ] || env_created=1
# Whether the environment file names a server yet (a REDIS_URL or DATABASE_URL line that is
# not commented out): until then it is the template, and the service is neither enabled
# nor started (it would restart in a loop without its URLs, and again at every boot). Read
# after the install below, which may have written the template; a file this user may not
# read (a dry run as another user) is taken as filled in.
env_filled() {
  [ -e "$ENV_FILE" ] || return 1
  [ -r "$ENV_FILE" ] || return 0
  grep -Eq '^[[:space:]]*(export[[:space:]]+)?(REDIS_URL|DATABASE_URL)=' "$ENV_FILE"
}
# A restart is left to this script unless the package's postinst makes it (an upgrade of
# the package restarts a running worker itself).
restart=1

if [ "$kind" != binary ]; then
  # 1. Leftovers of a copy install: the unit in /etc would hide the package's, and
  #    /usr/local/bin comes before /usr/bin in PATH.
  if [ -f "$UNIT_DST" ] && grep -q '^ExecStart=/usr/local/bin/worker' "$UNIT_DST"; then
    run rm -f "$UNIT_DST"
  fi
  if [ -x "$BIN_DST" ] && "$BIN_DST" --version 2>/dev/null | grep -q '^worker '; then
    run rm -f "$BIN_DST"
  fi
  # 2. The package. An environment file already there (edited, or written by a copy
  #    install) is kept without a question: dpkg's --force-confold; rpm keeps it by itself
  #    (%config(noreplace)). rpm -U installs or upgrades; --replacepkgs lets this script run
  #    again with the same package. The package's scripts restart a running worker on an
  #    upgrade.
  package_installed && restart=0
  if [ "$kind" = deb ]; then
    run dpkg -i --force-confold "$file"
  else
    run rpm -U --replacepkgs "$file"
  fi
else
  # 1. The binary. `install` writes a new file and renames it over the old one, so a
  #    running worker keeps its inode and is not disturbed until the restart below.
  run install -D -m 0755 -o root -g root "$file" "$BIN_DST"

  # 2. A dedicated system user without a login or a home directory.
  if getent passwd "$USER_NAME" >/dev/null; then
    step "system user $USER_NAME exists"
  else
    run useradd --system --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin --comment "delay-worker service" "$USER_NAME"
  fi

  # 3. The environment file: secrets, so root-only; systemd reads it before dropping to
  #    the service user. An existing file is the operator's and is left alone.
  run install -d -m 0755 -o root -g root "$ETC_DIR"
  if [ "$env_created" = 0 ]; then
    step "keeping the existing $ENV_FILE"
  else
    run install -m 0600 -o root -g root "$ENV_SRC" "$ENV_FILE"
  fi

  # 4. The unit.
  run install -D -m 0644 -o root -g root "$UNIT_SRC" "$UNIT_DST"
fi

# 5. systemd, when it is what runs this host (the check sd_booted(3) makes).
if [ -d /run/systemd/system ]; then
  run systemctl daemon-reload
  if [ "$env_created" = 1 ] || ! env_filled; then
    if [ "$dry_run" = 0 ] && systemctl is-enabled --quiet "$UNIT_NAME" 2>/dev/null; then
      # Enabled by an earlier install while the file was still the template.
      run systemctl disable --now "$UNIT_NAME"
    fi
    note "fill in $ENV_FILE, run \`bash -c 'set -a; . $ENV_FILE; worker migrate'\` (its URLs), then: systemctl enable --now $UNIT_NAME"
  elif [ "$dry_run" = 0 ] && systemctl is-active --quiet "$UNIT_NAME"; then
    run systemctl enable "$UNIT_NAME"
    [ "$restart" = 0 ] || run systemctl restart "$UNIT_NAME"
  else
    run systemctl enable --now "$UNIT_NAME"
  fi
else
  note "systemd is not running here (PID 1 is $(cat /proc/1/comm 2>/dev/null || echo unknown)); on a systemd host this would now run:"
  echo "    systemctl daemon-reload"
  if [ "$env_created" = 1 ] || ! env_filled; then
    note "fill in $ENV_FILE, run \`bash -c 'set -a; . $ENV_FILE; worker migrate'\` (its URLs), then: systemctl enable --now $UNIT_NAME"
  else
    echo "    systemctl enable --now $UNIT_NAME"
  fi
fi
[ -z "$refused" ] || die "a real run would stop here: $refused"
note "done"
