#!/usr/bin/env bash
# Runs the worker for real: private Redis and PostgreSQL on loopback (installed if missing),
# the release build, the schema, a few demo orders whose 15-minute timeout is shortened to
# seconds, and then `worker --threads 8` in the foreground. Ctrl-C stops it gracefully.
#
# Against your own servers instead: REDIS_URL=... DATABASE_URL=... target/release/worker
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh start
eval "$(scripts/services.sh env)"
cargo build --release --quiet
W=target/release/worker
$W migrate

if [ "$(psql "$DATABASE_URL" -qtAc 'SELECT count(*) FROM orders')" = 0 ]; then
  echo "demo: creating 10 pending orders (2 of them get paid before their timeout)"
  psql "$DATABASE_URL" -q <<'SQL'
INSERT INTO sku (stock) VALUES (100), (100), (100);
INSERT INTO coupon_user (user_id, status, used_at)
  SELECT g, 'used', now() FROM generate_series(1, 5) g;
INSERT INTO orders (order_no, user_id, coupon_id)
  SELECT 'DEMO' || lpad(g::text, 4, '0'), g, CASE WHEN g <= 5 THEN g END FROM generate_series(1, 10) g;
INSERT INTO order_items (order_id, sku_id, qty)
  SELECT o.id, 1 + (o.id % 3), 1 + (o.id % 2) FROM orders o;
UPDATE sku s SET stock = stock - t.q
  FROM (SELECT sku_id, sum(qty) q FROM order_items GROUP BY sku_id) t WHERE s.id = t.sku_id;
SQL
  for i in $(seq 1 10); do
    no=$(printf 'DEMO%04d' "$i")
    $W push --event order.timeout --payload "{\"order_no\":\"$no\"}" --delay "$((i * 2))" --key "order.timeout:$no"
  done
  psql "$DATABASE_URL" -qc "UPDATE orders SET status = 'paid', paid_at = now() WHERE order_no IN ('DEMO0003', 'DEMO0008')"
  echo "demo: watch them:  psql '$DATABASE_URL' -c 'SELECT order_no, status, cancel_reason FROM orders ORDER BY id'"
fi

echo "demo: starting the worker (Ctrl-C to stop)"
exec $W --threads 8
