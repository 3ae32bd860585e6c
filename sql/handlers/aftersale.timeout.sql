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

-- set:
-- The set form (see order.timeout.sql): $1 is a jsonb array of {"i", "payload"}; a row
-- per job that approved its request, holding its index. Rows are locked in id order.
WITH jobs AS (
    SELECT (j ->> 'i')::integer AS i, j -> 'payload' AS p
      FROM jsonb_array_elements($1) j
), wanted AS (
    SELECT DISTINCT ON (a.id) a.id, jobs.i
      FROM jobs JOIN aftersale a ON a.id = (jobs.p ->> 'aftersale_id')::bigint
     ORDER BY a.id, jobs.i
), locked AS (
    SELECT a.id, wanted.i FROM aftersale a JOIN wanted ON wanted.id = a.id
     WHERE a.status = 'pending' AND (a.deadline_at IS NULL OR a.deadline_at <= now())
     ORDER BY a.id
       FOR UPDATE OF a
), approved AS (
    UPDATE aftersale a
       SET status = 'approved', resolved_at = now(),
           resolve_reason = 'auto-approved: no merchant response before the deadline'
      FROM locked l
     WHERE a.id = l.id
       AND a.status = 'pending'
       AND (a.deadline_at IS NULL OR a.deadline_at <= now())
    RETURNING a.id
)
SELECT l.i FROM approved x JOIN locked l ON l.id = x.id
