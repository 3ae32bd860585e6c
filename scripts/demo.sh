#!/usr/bin/env bash
# Runs the worker for real and shows the work: private Redis and PostgreSQL on loopback
# (installed with apt-get when missing), the release build, a fresh demo database and key
# prefix, 10 pending orders whose 15-minute timeout is shortened to a few seconds (2 of
# them get paid first), then `worker --threads 8`, logging each job as it happens. It ends
# by itself once every timeout has fired, with a summary. Running it again starts clean.
#
# Against your own servers instead: REDIS_URL=... DATABASE_URL=... target/release/worker
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "demo: $*"; }

say "starting private Redis and PostgreSQL (the first run installs them with apt-get)"
scripts/services.sh start >/dev/null
eval "$(scripts/services.sh env)"
REDIS_PORT=${DW_REDIS_PORT:-6390}
PG_ADMIN="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/postgres"
DB=delay_worker_demo
export DATABASE_URL="postgres://postgres@127.0.0.1:${DW_PG_PORT:-5439}/$DB"
PREFIX=demo
export PGOPTIONS="-c client_min_messages=warning"
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
sql() { as_pg psql "$DATABASE_URL" -qtAX -v ON_ERROR_STOP=1 "$@"; }

say "building the release binary (the first build takes about 3 minutes on 2 cores)"
cargo build --release --quiet
W=target/release/worker

say "fresh demo state: database $DB, Redis keys $PREFIX:*"
as_pg psql "$PG_ADMIN" -qtAX -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" -c "CREATE DATABASE $DB"
redis-cli -p "$REDIS_PORT" --scan --pattern "$PREFIX:*" | xargs -r redis-cli -p "$REDIS_PORT" DEL >/dev/null
$W migrate >/dev/null
sql <<'SQL'
INSERT INTO sku (stock) VALUES (100), (100), (100);
INSERT INTO coupon_user (user_id, status, used_at)
  SELECT g, 'used', now() FROM generate_series(1, 5) g;
INSERT INTO orders (order_no, user_id, coupon_id)
  SELECT 'DEMO' || lpad(g::text, 4, '0'), g, CASE WHEN g <= 5 THEN g END FROM generate_series(1, 10) g;
INSERT INTO order_items (order_id, sku_id, qty)
  SELECT o.id, 1 + (o.id % 3), 1 + (o.id % 2) FROM orders o;
UPDATE sku s SET stock = stock - t.q
  FROM (SELECT sku_id, sum(qty) q FROM order_items GROUP BY sku_id) t WHERE s.id = t.sku_id;
CREATE TABLE demo_due (order_no text PRIMARY KEY, due_at timestamptz NOT NULL);
SQL
say "10 pending orders DEMO0001..DEMO0010, 5 with a used coupon; stock taken out of 3 skus"
for i in $(seq 1 10); do
  no=$(printf 'DEMO%04d' "$i")
  $W --key-prefix "$PREFIX" push --event order.timeout --payload "{\"order_no\":\"$no\"}" \
    --delay "$((i + 2))s" --key "order.timeout:$no" >/dev/null
  due_ms=$(redis-cli -p "$REDIS_PORT" ZSCORE "$PREFIX:delay:pool" "order.timeout:$no")
  sql -c "INSERT INTO demo_due VALUES ('$no', to_timestamp($due_ms / 1000.0))"
done
say "pushed their timeouts, due in 3 to 12 seconds (standing in for 15 minutes)"
sql -c "UPDATE orders SET status = 'paid', paid_at = now() WHERE order_no IN ('DEMO0003', 'DEMO0008')"
say "DEMO0003 and DEMO0008 are paid before their timeout: they must stay paid"

say "starting: worker --threads 8 (each job is logged as it happens)"
RUST_LOG=${RUST_LOG:-warn,delay_worker::workers=debug} $W --key-prefix "$PREFIX" --threads 8 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  left=$(redis-cli -p "$REDIS_PORT" ZCARD "$PREFIX:delay:pool")
  done_jobs=$(sql -c "SELECT count(*) FROM worker_inbox")
  [ "$left" = 0 ] && [ "$done_jobs" = 10 ] && break
  sleep 1
done
kill -TERM "$pid"
wait "$pid" || true
trap - EXIT

say "summary"
sql <<'SQL'
SELECT format('  cancelled by their timeout: %s of 8 unpaid orders', count(*) FILTER (WHERE status = 'cancelled' AND cancel_reason = 'timeout')) FROM orders;
SELECT format('  paid and untouched:         %s of 2 (%s)', count(*), string_agg(order_no, ', ' ORDER BY order_no)) FROM orders WHERE status = 'paid';
SELECT format('  stock back on the shelf:    %s units of %s taken by cancelled orders',
              (SELECT sum(stock) FROM sku) - (300 - (SELECT sum(i.qty) FROM order_items i JOIN orders o ON o.id = i.order_id)),
              (SELECT sum(i.qty) FROM order_items i JOIN orders o ON o.id = i.order_id WHERE o.status = 'cancelled'));
SELECT format('  coupons given back:         %s of %s on cancelled orders',
              count(*) FILTER (WHERE c.status = 'unused'), count(*))
  FROM orders o JOIN coupon_user c ON c.id = o.coupon_id WHERE o.status = 'cancelled';
SELECT format('  lateness (start - due):     p50 %s ms, max %s ms',
              round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::int, round(max(ms))::int)
  FROM (SELECT extract(epoch FROM i.processed_at - d.due_at) * 1000 AS ms
          FROM worker_inbox i JOIN demo_due d ON i.job_key = 'order.timeout:' || d.order_no) t;
SQL
say "look yourself: psql '$DATABASE_URL' -c 'SELECT order_no, status, cancel_reason FROM orders ORDER BY id'"
