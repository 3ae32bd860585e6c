-- event: coupon.expire
-- requires: coupon_id
--
-- A user coupon still unused past its expiry becomes expired. A used coupon, one whose
-- expiry was extended, or a missing one is a no-op.
UPDATE coupon_user
   SET status = 'expired', updated_at = now()
 WHERE id = ($1 ->> 'coupon_id')::bigint
   AND status = 'unused'
   AND (expire_at IS NULL OR expire_at <= now())
