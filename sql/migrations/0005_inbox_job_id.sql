-- Job identity: a job is its key plus the `job_id` the mover stamps on a message the first
-- time it leaves the delay pool (kept through retries and requeues), so the same key
-- pushed again, even within the same second, is a new job, while a redelivery or a retry
-- of one message is not. Rows written before the stamp existed keep job_id '' and their
-- `ts` as before.
ALTER TABLE worker_inbox ADD COLUMN IF NOT EXISTS job_id text NOT NULL DEFAULT '';
ALTER TABLE worker_inbox DROP CONSTRAINT IF EXISTS worker_inbox_pkey;
ALTER TABLE worker_inbox ADD PRIMARY KEY (job_key, job_id, enqueued_at);
