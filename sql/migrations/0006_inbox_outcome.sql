-- What an inbox row tells of its job besides its identity, for an operator asking what
-- happened to it: `outcome` ('done': the handler changed something; 'noop': it had
-- nothing to change), `late_ms` (from the job's first due time to its transaction, on
-- Redis's clock; NULL when the message carried no due time) and `consumer` (the worker
-- process that ran it). The job's own insert writes them (a no-op's outcome is set in
-- the round trip of its commit). Rows written by older workers keep NULL: not recorded.
-- Nullable and without a default, so adding them rewrites nothing, and older workers,
-- which insert without them, keep working beside newer ones.
ALTER TABLE worker_inbox ADD COLUMN IF NOT EXISTS outcome text;
ALTER TABLE worker_inbox ADD COLUMN IF NOT EXISTS late_ms bigint;
ALTER TABLE worker_inbox ADD COLUMN IF NOT EXISTS consumer text;
