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
    -- A payload naming both: the order of its order_id (as the set form below).
    ORDER BY id = ($1 ->> 'order_id')::bigint DESC NULLS LAST
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

-- set:
-- The set form: many jobs in one statement, for a backlog. $1 is a jsonb array of
-- {"i": <index>, "payload": <payload>}; a row per job that cancelled its order, holding
-- its index. Every lock is taken in one global order — orders by id, then skus by id,
-- then coupons by id — the same order as the one-job form above, so concurrent sets (and
-- single jobs) wait for each other but never deadlock. Two jobs of one order: the first
-- in the set acts, the other finds nothing to do, as it would one after the other.
WITH jobs AS (
    SELECT (j ->> 'i')::integer AS i, j -> 'payload' AS p
      FROM jsonb_array_elements($1) j
), targets AS (
    -- One order per job, as the one-job form finds it: by order_id, else by order_no.
    SELECT jobs.i, t.id
      FROM jobs CROSS JOIN LATERAL (
               SELECT o.id FROM orders o WHERE o.id = (jobs.p ->> 'order_id')::bigint
               UNION ALL
               SELECT o.id FROM orders o WHERE o.order_no = (jobs.p ->> 'order_no')
               LIMIT 1) t
), wanted AS (
    SELECT DISTINCT ON (id) id, i FROM targets ORDER BY id, i
), locked AS (
    SELECT o.id, o.coupon_id, wanted.i FROM orders o JOIN wanted ON wanted.id = o.id
     WHERE o.status = 'pending'
     ORDER BY o.id
       FOR UPDATE OF o
), cancelled AS (
    UPDATE orders o
       SET status = 'cancelled', cancel_reason = 'timeout',
           cancelled_at = now(), updated_at = now()
      FROM locked l
     WHERE o.id = l.id AND o.status = 'pending'
    RETURNING o.id, o.coupon_id
), items AS (
    SELECT i.sku_id, sum(i.qty)::integer AS qty
      FROM order_items i JOIN cancelled c ON c.id = i.order_id
     GROUP BY i.sku_id
), skus AS (
    SELECT s.id FROM sku s JOIN items ON items.sku_id = s.id
     ORDER BY s.id
       FOR UPDATE OF s
), stock AS (
    UPDATE sku s
       SET stock = s.stock + items.qty, updated_at = now()
      FROM items JOIN skus ON skus.id = items.sku_id
     WHERE s.id = items.sku_id
    RETURNING s.id
), coupons AS (
    SELECT u.id FROM coupon_user u JOIN cancelled c ON c.coupon_id = u.id
     WHERE u.status = 'used'
     ORDER BY u.id
       FOR UPDATE OF u
), coupon AS (
    UPDATE coupon_user u
       SET status = 'unused', used_at = NULL, updated_at = now()
      FROM coupons c
     WHERE u.id = c.id AND u.status = 'used'
    RETURNING u.id
)
SELECT l.i, (SELECT count(*) FROM stock) AS skus, (SELECT count(*) FROM coupon) AS coupons
  FROM cancelled c JOIN locked l ON l.id = c.id
