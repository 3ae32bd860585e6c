//! The shop database side of the bench: the safety check, reset and seed, what the bench
//! recorded (`bench_due`, `bench_orders`), lateness percentiles and the accounting.
//!
//! Everything is set-based SQL on the bench's own connection, so the books of 60,000
//! orders take a few queries, not 60,000 round trips.

use anyhow::{bail, Context, Result};
use postgres::Client;
use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

/// Stock of every sku before the seeded orders take theirs out.
pub const START_STOCK: i64 = 1_000_000;

const SEED_SQL: &str = include_str!("../../../../sql/bench/seed.sql");

/// The bench truncates the shop tables, so it only runs on a database meant for it.
pub fn check_database(db: &mut Client) -> Result<()> {
    let name: String = db.query_one("SELECT current_database()", &[])?.get(0);
    if !name.contains("bench") {
        bail!(
            "the bench truncates the shop tables; it only runs on a database whose name contains \"bench\" (DATABASE_URL names {name:?}; scripts/bench.sh makes dw_bench)"
        );
    }
    Ok(())
}

/// What the bench records next to the shop: each job key's due time, each pushed order
/// and whether the bench paid it. Unlogged: scratch data, kept after the run to inspect.
pub fn prepare_tables(db: &mut Client) -> Result<()> {
    db.batch_execute(
        "CREATE UNLOGGED TABLE IF NOT EXISTS bench_due (job_key text PRIMARY KEY, due_ms bigint NOT NULL);
         ALTER TABLE bench_due ADD COLUMN IF NOT EXISTS moved_ms bigint;
         CREATE UNLOGGED TABLE IF NOT EXISTS bench_orders (order_id bigint PRIMARY KEY, paid boolean NOT NULL);",
    )
    .context("cannot create the bench tables")
}

/// Empties the shop, the inbox and the bench's records.
pub fn reset(db: &mut Client) -> Result<()> {
    db.batch_execute(
        "TRUNCATE orders, order_items, sku, coupon_user, worker_inbox, bench_due, bench_orders
         RESTART IDENTITY CASCADE",
    )
    .context("cannot reset the shop tables")
}

/// The key prefix of the inbox rows [`fill_inbox`] writes: old jobs, not the scenario's.
pub const FILLER_PREFIX: &str = "fill:";

/// Writes `n` old inbox rows in one statement: keys `fill:<i>` in order, processed 2,000
/// a second (as the steady load writes them), the newest `age` ago. Returns how long it
/// took.
pub fn fill_inbox(db: &mut Client, n: u64, age: Duration) -> Result<Duration> {
    let started = Instant::now();
    db.execute(
        "INSERT INTO worker_inbox (job_key, job_id, enqueued_at, event, processed_at)
         SELECT $1 || lpad(i::text, 10, '0'), '', i, 'order.timeout',
                now() - make_interval(secs => $2) - ($3::bigint - i) * interval '500 microseconds'
           FROM generate_series(1, $3::bigint) i",
        &[&FILLER_PREFIX, &age.as_secs_f64(), &(n as i64)],
    )
    .context("cannot fill the inbox")?;
    Ok(started.elapsed())
}

/// Inbox rows processed longer than `age` ago.
pub fn inbox_older_than(db: &mut Client, age: Duration) -> Result<i64> {
    Ok(db
        .query_one(
            "SELECT count(*) FROM worker_inbox WHERE processed_at < now() - make_interval(secs => $1)",
            &[&age.as_secs_f64()],
        )?
        .get(0))
}

/// Empties the shop and the bench's records like [`reset`], but of the inbox removes only
/// the scenario's own rows, keeping [`fill_inbox`]'s.
pub fn reset_keep_filler(db: &mut Client) -> Result<()> {
    db.batch_execute(
        "TRUNCATE orders, order_items, sku, coupon_user, bench_due, bench_orders
         RESTART IDENTITY CASCADE;
         DELETE FROM worker_inbox WHERE NOT starts_with(job_key, 'fill:');",
    )
    .context("cannot reset the shop tables")
}

/// Seeds `orders` pending orders over `skus` skus (sql/bench/seed.sql), then vacuums,
/// analyzes and checkpoints, so neither hint bits, stale statistics nor the seed's
/// checkpoint land inside the measurement. Returns how long it took.
pub fn seed(db: &mut Client, orders: u64, skus: u32) -> Result<Duration> {
    let started = Instant::now();
    let sql = SEED_SQL
        .replace("{orders}", &orders.to_string())
        .replace("{skus}", &skus.to_string())
        .replace("{stock}", &START_STOCK.to_string());
    db.batch_execute(&sql).context("cannot seed the shop")?;
    // VACUUM cannot run inside the implicit transaction of a multi-statement string.
    for t in [
        "orders",
        "order_items",
        "sku",
        "coupon_user",
        "worker_inbox",
    ] {
        db.batch_execute(&format!("VACUUM (ANALYZE) {t}"))
            .with_context(|| format!("cannot vacuum {t}"))?;
    }
    // Needs superuser or pg_checkpoint; without it the figures are only a little noisier.
    if let Err(e) = db.batch_execute("CHECKPOINT") {
        log::warn!(
            "CHECKPOINT after seeding failed: {}",
            delay_worker::db::error_text(&e)
        );
    }
    Ok(started.elapsed())
}

/// Stores the due time (and the time it reached the stream, when known) of every job key
/// and every pushed order (COPY: 60,000 rows in well under a second).
pub fn record(
    db: &mut Client,
    dues: &[(String, i64)],
    moved: &HashMap<String, i64>,
    orders: &[(i64, bool)],
) -> Result<()> {
    let mut w = db.copy_in("COPY bench_due (job_key, due_ms, moved_ms) FROM STDIN")?;
    let mut buf = Vec::with_capacity(64 * 1024);
    for (key, due) in dues {
        // Job keys are ours (order.timeout:BO...): no tab, newline or backslash to escape.
        match moved.get(key) {
            Some(m) => writeln!(buf, "{key}\t{due}\t{m}")?,
            None => writeln!(buf, "{key}\t{due}\t\\N")?,
        }
        if buf.len() > 60 * 1024 {
            w.write_all(&buf)?;
            buf.clear();
        }
    }
    w.write_all(&buf)?;
    w.finish().context("cannot record the due times")?;
    let mut w = db.copy_in("COPY bench_orders (order_id, paid) FROM STDIN")?;
    buf.clear();
    for (id, paid) in orders {
        writeln!(buf, "{id}\t{}", if *paid { "t" } else { "f" })?;
        if buf.len() > 60 * 1024 {
            w.write_all(&buf)?;
            buf.clear();
        }
    }
    w.write_all(&buf)?;
    w.finish().context("cannot record the orders")?;
    Ok(())
}

/// Lateness of the recorded jobs, in milliseconds, from their due time to
/// `worker_inbox.processed_at`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Lateness {
    /// Jobs with an inbox row (the others never committed).
    pub count: i64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub min_ms: f64,
    /// First and last `processed_at`, unix ms: the span throughput is measured over.
    pub first_processed_ms: f64,
    pub last_processed_ms: f64,
    /// The mover's part: due time to the stream entry (p50, p99, max).
    pub to_stream_ms: Option<[f64; 3]>,
    /// The rest: stream entry to the transaction (reader, channel, workers, PostgreSQL).
    pub stream_to_commit_ms: Option<[f64; 3]>,
}

/// `processed_at` is the inbox column's `now()`: the start of the job's transaction. Its
/// commit follows within the transaction's few statements and one WAL flush, so the
/// figures are a hair early; the Redis ack comes after the commit, and is not counted.
pub fn lateness(db: &mut Client) -> Result<Option<Lateness>> {
    let row = db.query_one(
        "SELECT count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY l),
                percentile_cont(0.95) WITHIN GROUP (ORDER BY l),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY l),
                max(l), min(l), min(p), max(p),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY m),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY m), max(m),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY w),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY w), max(w)
           FROM (SELECT p - d.due_ms AS l, p, (d.moved_ms - d.due_ms)::float8 AS m,
                        p - d.moved_ms AS w
                   FROM bench_due d
                   JOIN (SELECT job_key, (extract(epoch FROM processed_at) * 1000)::float8 AS p
                           FROM worker_inbox) i ON i.job_key = d.job_key) x",
        &[],
    )?;
    let count: i64 = row.get(0);
    if count == 0 {
        return Ok(None);
    }
    Ok(Some(Lateness {
        count,
        p50_ms: row.get(1),
        p95_ms: row.get(2),
        p99_ms: row.get(3),
        max_ms: row.get(4),
        min_ms: row.get(5),
        first_processed_ms: row.get(6),
        last_processed_ms: row.get(7),
        to_stream_ms: triple(row.get(8), row.get(9), row.get(10)),
        stream_to_commit_ms: triple(row.get(11), row.get(12), row.get(13)),
    }))
}

fn triple(a: Option<f64>, b: Option<f64>, c: Option<f64>) -> Option<[f64; 3]> {
    Some([a?, b?, c?])
}

/// The books after an order scenario; each field is a count that must be zero except
/// the first three.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Books {
    /// Pushed orders the bench did not pay: each must be cancelled, once.
    pub expected_cancelled: i64,
    pub cancelled: i64,
    /// The scenario's own inbox rows (not [`fill_inbox`]'s).
    pub inbox_rows: i64,
    /// Orders the bench paid (before their due time) that are not `paid` now: a payment
    /// that came too late, or a cancellation of a paid order.
    pub paid_wrong: i64,
    /// Unpaid pushed orders not cancelled with reason `timeout`.
    pub unpaid_wrong: i64,
    /// Orders never pushed that are no longer pending.
    pub untouched_wrong: i64,
    /// Skus whose stock is not the start minus the lines of the orders not cancelled.
    pub stock_wrong: i64,
    /// Coupons not `unused` for a cancelled order, or not `used` for any other.
    pub coupon_wrong: i64,
    /// Job keys with more than one inbox row.
    pub inbox_duplicates: i64,
    /// Recorded job keys without an inbox row (never committed).
    pub inbox_missing: i64,
}

pub fn books(db: &mut Client) -> Result<Books> {
    let sql = format!(
        "SELECT
           (SELECT count(*) FROM bench_orders WHERE NOT paid),
           (SELECT count(*) FROM orders WHERE status = 'cancelled'),
           (SELECT count(*) FROM worker_inbox WHERE NOT starts_with(job_key, 'fill:')),
           (SELECT count(*) FROM orders o JOIN bench_orders b ON b.order_id = o.id
             WHERE b.paid AND o.status <> 'paid'),
           (SELECT count(*) FROM orders o JOIN bench_orders b ON b.order_id = o.id
             WHERE NOT b.paid AND (o.status <> 'cancelled'
                   OR o.cancel_reason IS DISTINCT FROM 'timeout' OR o.cancelled_at IS NULL)),
           (SELECT count(*) FROM orders o
             WHERE o.status <> 'pending'
               AND NOT EXISTS (SELECT 1 FROM bench_orders b WHERE b.order_id = o.id)),
           (SELECT count(*) FROM sku s
              LEFT JOIN (SELECT i.sku_id, sum(i.qty) AS q
                           FROM order_items i JOIN orders o ON o.id = i.order_id
                          WHERE o.status <> 'cancelled' GROUP BY i.sku_id) x
                ON x.sku_id = s.id
             WHERE s.stock <> {START_STOCK} - coalesce(x.q, 0)),
           (SELECT count(*) FROM orders o JOIN coupon_user c ON c.id = o.coupon_id
             WHERE (o.status = 'cancelled') <> (c.status = 'unused')
                OR c.status NOT IN ('used', 'unused')),
           (SELECT count(*) - count(DISTINCT job_key) FROM worker_inbox
             WHERE NOT starts_with(job_key, 'fill:')),
           (SELECT count(*) FROM bench_due d
             WHERE NOT EXISTS (SELECT 1 FROM worker_inbox i WHERE i.job_key = d.job_key))"
    );
    let r = db.query_one(sql.as_str(), &[])?;
    Ok(Books {
        expected_cancelled: r.get(0),
        cancelled: r.get(1),
        inbox_rows: r.get(2),
        paid_wrong: r.get(3),
        unpaid_wrong: r.get(4),
        untouched_wrong: r.get(5),
        stock_wrong: r.get(6),
        coupon_wrong: r.get(7),
        inbox_duplicates: r.get(8),
        inbox_missing: r.get(9),
    })
}

impl Books {
    /// What is wrong, one phrase each; empty when the books add up. `jobs` is the number
    /// of job keys pushed (each must have exactly one inbox row).
    pub fn problems(&self, jobs: u64) -> Vec<String> {
        let mut p = Vec::new();
        if self.cancelled != self.expected_cancelled {
            p.push(format!(
                "{} orders cancelled, {} expected",
                self.cancelled, self.expected_cancelled
            ));
        }
        if self.inbox_rows != jobs as i64 {
            p.push(format!(
                "{} inbox rows for {jobs} job keys",
                self.inbox_rows
            ));
        }
        let counts = [
            (self.paid_wrong, "paid orders not paid (paid too late?)"),
            (self.unpaid_wrong, "unpaid orders not cancelled by timeout"),
            (self.untouched_wrong, "orders never pushed but touched"),
            (self.stock_wrong, "skus with wrong stock"),
            (self.coupon_wrong, "coupons in the wrong state"),
            (self.inbox_duplicates, "job keys with two inbox rows"),
            (self.inbox_missing, "job keys never committed"),
        ];
        for (n, what) in counts {
            if n != 0 {
                p.push(format!("{n} {what}"));
            }
        }
        p
    }
}

/// Orders cancelled (the pgbench ceiling's check that each transaction cancelled one).
pub fn cancelled_count(db: &mut Client) -> Result<i64> {
    Ok(db
        .query_one(
            "SELECT count(*) FROM orders WHERE status = 'cancelled'",
            &[],
        )?
        .get(0))
}

/// Rows in the inbox (the engine scenario must leave none).
pub fn inbox_count(db: &mut Client) -> Result<i64> {
    Ok(db
        .query_one("SELECT count(*) FROM worker_inbox", &[])?
        .get(0))
}

/// The transactions the inbox rows came in (each transaction stamps its rows with its
/// own start, `processed_at`), and the rows.
pub fn inbox_transactions(db: &mut Client) -> Result<(i64, i64)> {
    let row = db.query_one(
        "SELECT count(DISTINCT processed_at), count(*) FROM worker_inbox",
        &[],
    )?;
    Ok((row.get(0), row.get(1)))
}
