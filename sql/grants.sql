-- Least privilege for the worker's runtime role: exactly what `worker` (the daemon) needs
-- at run time, and nothing else. No DDL, no DELETE, no column it does not use.
--
-- Run it as the owner of the tables (the role that ran `worker migrate`), after every
-- `worker migrate`, with the runtime role's name (and the schema, default public):
--
--   psql "postgres://shop_owner@127.0.0.1:5432/shop" -v role=delay_worker -f sql/grants.sql
--   psql ... -v role=delay_worker -v schema=shop -f sql/grants.sql
--
-- It only grants, so running it again changes nothing. `worker migrate` needs the owner:
-- the runtime role can create, alter and drop nothing. The operator commands (`worker
-- stats`, `worker dead ...`, `push`, `cancel`) use no PostgreSQL at all. A handler added
-- with --handlers-dir needs its own grants, in the same style.

\set ON_ERROR_STOP on
\if :{?role}
\else
  DO $$ BEGIN RAISE 'sql/grants.sql: name the runtime role: psql -v role=NAME -f sql/grants.sql'; END $$;
\endif
\if :{?schema}
\else
  \set schema public
\endif

BEGIN;

GRANT CONNECT ON DATABASE :"DBNAME" TO :"role";
GRANT USAGE ON SCHEMA :"schema" TO :"role";
SET LOCAL search_path TO :"schema";

-- `worker run` refuses a schema that `worker migrate` has not brought up to date.
GRANT SELECT (version) ON worker_migrations TO :"role";

-- The inbox: each job inserts its row (ON CONFLICT DO NOTHING: a redelivery inserts
-- nothing) and reads back its ctid; a set inserts its rows in one statement and reads back
-- which were new (RETURNING); a job that changed nothing has its row's outcome set to
-- 'noop' by that ctid before its commit (the only column the worker updates); the pruner
-- deletes rows older than --inbox-retention, found by ctid, which needs SELECT on the
-- whole table.
GRANT INSERT (job_key, enqueued_at, event, job_id, outcome, late_ms, consumer),
      UPDATE (outcome), SELECT, DELETE ON worker_inbox TO :"role";

-- Group commit: each worker thread upserts its own row (db::flush_wal); ctid and xmax
-- name the session holding a row lock on it.
GRANT SELECT (ctid, xmax, slot, flushes), INSERT (slot), UPDATE (flushes, flushed_at)
   ON worker_flush TO :"role";

-- order.timeout: a pending order -> cancelled; payment.paid: a pending order -> paid.
-- Both find the order by id or order_no and lock its row (FOR UPDATE needs UPDATE).
-- On every table whose rows a handler locks, the system columns ctid and xmax: after a
-- lock timeout the worker reads the row's xmax (by the ctid PostgreSQL named) to say
-- whose transaction held it. Transaction ids, no data.
GRANT SELECT (ctid, xmax, id, order_no, status, cancel_reason, coupon_id),
      UPDATE (status, cancel_reason, cancelled_at, paid_at, updated_at)
   ON orders TO :"role";

-- order.timeout: the lines whose stock goes back.
GRANT SELECT (order_id, sku_id, qty) ON order_items TO :"role";

-- order.timeout: stock back, sku rows locked in id order.
GRANT SELECT (ctid, xmax, id, stock), UPDATE (stock, updated_at) ON sku TO :"role";

-- order.timeout: the order's coupon back to unused; coupon.expire: unused -> expired.
GRANT SELECT (ctid, xmax, id, status, expire_at), UPDATE (status, used_at, updated_at)
   ON coupon_user TO :"role";

-- aftersale.timeout: a pending request past its deadline -> approved.
GRANT SELECT (ctid, xmax, id, status, deadline_at),
      UPDATE (status, resolved_at, resolve_reason)
   ON aftersale TO :"role";

-- payment.paid for a cancelled or missing order: one review row. The id comes from the
-- table's sequence (USAGE: nextval) and is returned (SELECT on id alone: the worker
-- cannot read the payloads of earlier reviews).
GRANT INSERT (order_id, order_no, payload, reason), SELECT (id) ON payment_review TO :"role";
GRANT USAGE ON SEQUENCE payment_review_id_seq TO :"role";

COMMIT;
