#!/usr/bin/env bash
# Installs the worker as a systemd service on a host without containers. Run as root.
#
#   scripts/install.sh [--dry-run] [BINARY]
#
#   BINARY     the worker binary to install [default: target/release/worker]
#   --dry-run  print the steps, change nothing (needs neither root nor systemd)
#
# Steps: the binary to /usr/local/bin/worker; a system user and group `delay-worker`; the
# environment file /etc/delay-worker/worker.env (mode 0600, root; created from a template
# only when absent, never overwritten); the unit scripts/worker.service as
# /etc/systemd/system/delay-worker.service; then, when systemd is running (PID 1),
# `systemctl daemon-reload` and `systemctl enable --now` (or a restart when the service
# already runs, so a new binary takes over). A freshly created environment file is only a
# template, so the service is then enabled but not started: fill it in, run
# `worker migrate`, then `systemctl start delay-worker`. Without systemd the script says
# what it would have done and exits 0. Running it again is safe (an upgrade).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

UNIT_NAME=delay-worker.service
UNIT_SRC=$here/worker.service
BIN_DST=/usr/local/bin/worker
USER_NAME=delay-worker
ETC_DIR=/etc/delay-worker
ENV_FILE=$ETC_DIR/worker.env
UNIT_DST=/etc/systemd/system/$UNIT_NAME

dry_run=0
binary=
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "install: unknown option $arg (try --help)" >&2; exit 2 ;;
    *)
      [ -z "$binary" ] || { echo "install: more than one binary given" >&2; exit 2; }
      binary=$arg
      ;;
  esac
done
binary=${binary:-$root/target/release/worker}

die() { echo "install: $*" >&2; exit 1; }
step() { echo "+ $*"; }
# Runs a command, or only shows it under --dry-run.
run() {
  step "$(printf '%q ' "$@")"
  [ "$dry_run" = 1 ] || "$@"
}

[ -f "$UNIT_SRC" ] || die "unit file $UNIT_SRC is missing"
if [ ! -x "$binary" ]; then
  [ "$dry_run" = 1 ] || die "no executable worker at $binary (build it: cargo build --release, or name one)"
  echo "install: note: no executable worker at $binary yet (cargo build --release)"
fi
if [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
  die "run as root (or with --dry-run to see the steps)"
fi
[ "$dry_run" = 1 ] && echo "install: dry run, nothing is changed"

# 1. The binary. `install` writes a new file and renames it over the old one, so a
#    running worker keeps its inode and is not disturbed until the restart below.
run install -D -m 0755 -o root -g root "$binary" "$BIN_DST"

# 2. A dedicated system user without a login or a home directory.
if getent passwd "$USER_NAME" >/dev/null; then
  step "system user $USER_NAME exists"
else
  run useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin --comment "delay-worker service" "$USER_NAME"
fi

# 3. The environment file: secrets, so root-only; systemd reads it before dropping to
#    the service user. An existing file is the operator's and is left alone.
env_created=0
run install -d -m 0755 -o root -g root "$ETC_DIR"
if [ -e "$ENV_FILE" ]; then
  step "keeping the existing $ENV_FILE"
else
  env_created=1
  step "write $ENV_FILE (mode 0600, owner root) from the template"
  if [ "$dry_run" = 0 ]; then
    (
      umask 077
      cat >"$ENV_FILE" <<'EOF'
# delay-worker settings, read by systemd for delay-worker.service (keep mode 0600).
# Fill in both URLs, then: worker migrate; systemctl start delay-worker
#REDIS_URL=redis://:password@127.0.0.1:6379/0
#DATABASE_URL=postgres://shop:password@127.0.0.1:5432/shop
RUST_LOG=info
# Extra flags for `worker --threads 8`, e.g. metrics for Prometheus:
#WORKER_ARGS=--metrics-addr 127.0.0.1:9187
EOF
    )
    chown root:root "$ENV_FILE"
    chmod 0600 "$ENV_FILE"
  fi
fi

# 4. The unit.
run install -D -m 0644 -o root -g root "$UNIT_SRC" "$UNIT_DST"

# 5. systemd, when it is what runs this host (the check sd_booted(3) makes).
if [ -d /run/systemd/system ]; then
  run systemctl daemon-reload
  if [ "$env_created" = 1 ]; then
    run systemctl enable "$UNIT_NAME"
    echo "install: fill in $ENV_FILE, run \`worker migrate\` with those URLs, then: systemctl start $UNIT_NAME"
  elif [ "$dry_run" = 0 ] && systemctl is-active --quiet "$UNIT_NAME"; then
    run systemctl enable "$UNIT_NAME"
    run systemctl restart "$UNIT_NAME"
  else
    run systemctl enable --now "$UNIT_NAME"
  fi
else
  echo "install: systemd is not running here (PID 1 is $(cat /proc/1/comm 2>/dev/null || echo unknown)); on a systemd host this would now run:"
  echo "    systemctl daemon-reload"
  echo "    systemctl enable --now $UNIT_NAME"
fi
echo "install: done"
