-- event: aftersale.timeout
-- requires: aftersale_id
--
-- An after-sale request still waiting for the merchant past its deadline is approved
-- automatically, with the reason. Anything else (already resolved, deadline moved later,
-- missing) is a no-op.
UPDATE aftersale
   SET status = 'approved', resolved_at = now(),
       resolve_reason = 'auto-approved: no merchant response before the deadline'
 WHERE id = ($1 ->> 'aftersale_id')::bigint
   AND status = 'pending'
   AND (deadline_at IS NULL OR deadline_at <= now())
