-- event: payment.paid
-- requires: order_id|order_no
--
-- A payment arrived. A pending order becomes paid with the time. An order already
-- cancelled (its timeout fired just before the user paid) or missing is recorded in
-- payment_review for a refund or a person's look: never silently ignored. An order already
-- paid is a no-op.
--
-- The order row is locked first, so a payment and the order's timeout never both win:
-- whichever commits second sees the other's status.
WITH target AS (
    SELECT id, order_no, status, cancel_reason FROM orders
    WHERE id = ($1 ->> 'order_id')::bigint
       OR order_no = ($1 ->> 'order_no')
    LIMIT 1
    FOR UPDATE
), paid AS (
    UPDATE orders o
       SET status = 'paid', paid_at = now(), updated_at = now()
      FROM target t
     WHERE o.id = t.id AND t.status = 'pending'
    RETURNING o.id
), review AS (
    INSERT INTO payment_review (order_id, order_no, payload, reason)
    SELECT t.id, t.order_no, $1,
           'paid after the order was cancelled (' || coalesce(t.cancel_reason, 'no reason') || ')'
      FROM target t WHERE t.status = 'cancelled'
    UNION ALL
    SELECT NULL, $1 ->> 'order_no', $1, 'paid for an order that does not exist'
     WHERE NOT EXISTS (SELECT 1 FROM target)
    RETURNING id
)
SELECT id FROM paid
UNION ALL
SELECT id FROM review
