-- event: order.timeout
-- requires: order_id|order_no
--
-- An order still unpaid when its timeout fires is cancelled: status, reason and time;
-- the stock of every item goes back (two lines of one sku return both); its coupon goes
-- back to unused. A paid, already cancelled or missing order is a no-op.
--
-- $1 is the payload (jsonb). One statement, so one round trip. Concurrency: a second
-- cancel or a payment of the same order waits on the order's row lock and then finds it
-- no longer pending. Sku rows are locked in id order, so two cancellations that share
-- skus never deadlock.
WITH target AS (
    SELECT id FROM orders
    WHERE id = ($1 ->> 'order_id')::bigint
       OR order_no = ($1 ->> 'order_no')
    LIMIT 1
), cancelled AS (
    UPDATE orders o
       SET status = 'cancelled', cancel_reason = 'timeout',
           cancelled_at = now(), updated_at = now()
      FROM target
     WHERE o.id = target.id AND o.status = 'pending'
    RETURNING o.id, o.coupon_id
), items AS (
    SELECT i.sku_id, sum(i.qty)::integer AS qty
      FROM order_items i JOIN cancelled c ON c.id = i.order_id
     GROUP BY i.sku_id
), locked AS (
    SELECT s.id FROM sku s JOIN items ON items.sku_id = s.id
     ORDER BY s.id
       FOR UPDATE OF s
), stock AS (
    UPDATE sku s
       SET stock = s.stock + items.qty, updated_at = now()
      FROM items JOIN locked ON locked.id = items.sku_id
     WHERE s.id = items.sku_id
    RETURNING s.id
), coupon AS (
    UPDATE coupon_user u
       SET status = 'unused', used_at = NULL, updated_at = now()
      FROM cancelled c
     WHERE u.id = c.coupon_id AND u.status = 'used'
    RETURNING u.id
)
SELECT c.id, (SELECT count(*) FROM stock) AS skus, (SELECT count(*) FROM coupon) AS coupons
  FROM cancelled c
