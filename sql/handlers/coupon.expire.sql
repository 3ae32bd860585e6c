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

-- set:
-- The set form (see order.timeout.sql): $1 is a jsonb array of {"i", "payload"}; a row
-- per job that expired its coupon, holding its index. Rows are locked in id order.
WITH jobs AS (
    SELECT (j ->> 'i')::integer AS i, j -> 'payload' AS p
      FROM jsonb_array_elements($1) j
), wanted AS (
    SELECT DISTINCT ON (u.id) u.id, jobs.i
      FROM jobs JOIN coupon_user u ON u.id = (jobs.p ->> 'coupon_id')::bigint
     ORDER BY u.id, jobs.i
), locked AS (
    SELECT u.id, wanted.i FROM coupon_user u JOIN wanted ON wanted.id = u.id
     WHERE u.status = 'unused' AND (u.expire_at IS NULL OR u.expire_at <= now())
     ORDER BY u.id
       FOR UPDATE OF u
), expired AS (
    UPDATE coupon_user u
       SET status = 'expired', updated_at = now()
      FROM locked l
     WHERE u.id = l.id
       AND u.status = 'unused'
       AND (u.expire_at IS NULL OR u.expire_at <= now())
    RETURNING u.id
)
SELECT l.i FROM expired x JOIN locked l ON l.id = x.id
