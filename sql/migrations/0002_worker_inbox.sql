-- The worker's own inbox: one row per job whose handler committed. The handler's
-- transaction inserts the row first; a redelivered job finds it and changes nothing.
-- A job is its key plus the producer's `ts`, so a key re-used by a later push is a new
-- job, while a redelivery or a retry of the same message is not.
CREATE TABLE IF NOT EXISTS worker_inbox (
    job_key       text NOT NULL,
    enqueued_at   bigint NOT NULL,         -- the message's `ts` (unix seconds), 0 if absent
    event         text NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_key, enqueued_at)
);

CREATE INDEX IF NOT EXISTS worker_inbox_processed_at_idx ON worker_inbox (processed_at);
