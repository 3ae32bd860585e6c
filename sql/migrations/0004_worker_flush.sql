-- Group commit (see `db::flush_wal`): jobs commit without waiting for the WAL flush, and
-- before acknowledging them a worker commits one small write here with
-- synchronous_commit on, which flushes the WAL up to that point, every earlier commit
-- included. A commit that wrote nothing would not wait for the flush, hence a real write;
-- one row per worker, so workers never wait on each other's row.
CREATE TABLE IF NOT EXISTS worker_flush (
    slot        text PRIMARY KEY,         -- <consumer>/<worker index>
    flushes     bigint NOT NULL DEFAULT 1,
    flushed_at  timestamptz NOT NULL DEFAULT now()
);
