-- The bench shop, seeded set-based (generate_series) into freshly truncated tables: the
-- shape of tests/it/support.rs `seed_orders`, row for row, but fast enough for 100,000
-- orders. `worker bench` replaces {orders}, {skus} and {stock} with integers.
--
-- - {skus} skus holding {stock} each before the orders take theirs out;
-- - orders 1..{orders}, all pending, order_no BO000000001...; every odd order holds a
--   used coupon (coupon id = order id);
-- - 1 to 3 lines per order: always one; a second line of another sku when id % 3 = 1; a
--   line of the FIRST line's sku again when id % 5 = 2 (two lines of one sku: both must
--   come back). Skus are spread by a hash of the order id, so neighbouring orders (which
--   a backlog cancels at the same moment) do not all lock the same rows;
-- - the stock of every line taken out, as the shop did when the order was placed.

INSERT INTO sku (id, stock)
SELECT g, {stock} FROM generate_series(1, {skus}) g;

INSERT INTO coupon_user (id, user_id, status, used_at)
SELECT g, g, 'used', now() FROM generate_series(1, {orders}) g WHERE g % 2 = 1;

INSERT INTO orders (id, order_no, user_id, status, coupon_id)
SELECT g, 'BO' || lpad(g::text, 9, '0'), g, 'pending', CASE WHEN g % 2 = 1 THEN g END
  FROM generate_series(1, {orders}) g;

INSERT INTO order_items (order_id, sku_id, qty)
SELECT g, 1 + (hashint8(g) & 2147483647) % {skus}, 1 + g % 3
  FROM generate_series(1, {orders}) g
UNION ALL
SELECT g, 1 + ((hashint8(g) & 2147483647) + 1) % {skus}, 2
  FROM generate_series(1, {orders}) g WHERE g % 3 = 1
UNION ALL
SELECT g, 1 + (hashint8(g) & 2147483647) % {skus}, 1
  FROM generate_series(1, {orders}) g WHERE g % 5 = 2;

UPDATE sku s
   SET stock = s.stock - l.qty
  FROM (SELECT sku_id, sum(qty)::integer AS qty FROM order_items GROUP BY sku_id) l
 WHERE l.sku_id = s.id;

-- Explicit ids above: move the sequences past them for anything inserted later.
SELECT setval(pg_get_serial_sequence('sku', 'id'), {skus});
SELECT setval(pg_get_serial_sequence('orders', 'id'), {orders});
SELECT setval(pg_get_serial_sequence('coupon_user', 'id'), {orders});
