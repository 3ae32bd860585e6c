//! The load: the paced producer of the steady scenarios, with its payer thread, and the
//! pipelined bulk push of the backlog and engine scenarios.
//!
//! The steady producer is one thread calling the library producer (`producer::push`, one
//! atomic script per message) on a schedule: message `i` is due to be sent at
//! `t0 + i / rate`; when the thread falls behind it sends at once and records by how much,
//! so the report shows whether the producer kept up. Payments go to a second thread that
//! batches them into one UPDATE every [`PAY_EVERY`], so the producer never waits on a
//! commit. The bulk push groups the jobs by shard and loads each shard's with
//! `store::pool::push_many`, 1,000 jobs per script call (one round trip, on a Redis
//! Cluster too). With `--shards`, every message goes to the key set of its shard
//! (`keys::shard_of`), as a producer's would.

use anyhow::{bail, Context, Result};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use delay_worker::keys::{shard_of, Keys};
use delay_worker::message::Envelope;
use delay_worker::producer::{self, NewJob};
use delay_worker::{store, Shutdown};
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

pub const ORDER_EVENT: &str = "order.timeout";
pub const NOOP_EVENT: &str = "bench.noop";
/// Share of steady orders the bench pays before they fall due.
pub const PAID_PERCENT: u32 = 20;
/// Share of steady messages that are a second push of an order under another key.
pub const DUPLICATE_PERCENT: u32 = 5;
/// Longest a payment waits in the payer's batch. Delays start at 1 s, so every payment
/// commits long before its order falls due.
const PAY_EVERY: Duration = Duration::from_millis(20);
/// Jobs per script call in the bulk push.
const PER_CALL: usize = 1000;

/// The job key of an order's timeout; the order number is the seed's `BO` + 9 digits.
pub fn order_key(id: i64) -> String {
    format!("{ORDER_EVENT}:BO{id:09}")
}

fn order_payload(id: i64) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("order_id".into(), json!(id));
    m
}

/// How the steady producer writes due times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scores {
    /// Unix milliseconds, through `producer::push` (what the Rust producer writes).
    Millis,
    /// Unix seconds, due times rounded up to the whole second, as the PHP producer writes
    /// them: every second a burst falls due at once.
    Seconds,
}

#[derive(Debug, Clone)]
pub struct SteadyPlan {
    pub rate: u32,
    pub duration: Duration,
    pub max_delay: Duration,
    pub scores: Scores,
    /// Seed of the choices (delays, paid, duplicates), so runs are comparable.
    pub seed: u64,
}

impl SteadyPlan {
    /// Messages the plan sends; also the most orders it can use.
    pub fn messages(&self) -> u64 {
        (self.rate as f64 * self.duration.as_secs_f64()).round() as u64
    }
}

/// What the steady producer did.
#[derive(Debug, Default)]
pub struct Produced {
    /// Job key -> due time (unix ms) of every message sent.
    pub dues: Vec<(String, i64)>,
    /// Every order pushed and whether the bench paid it.
    pub orders: Vec<(i64, bool)>,
    pub duplicates: u64,
    /// Messages per second the producer actually sent (first to last send).
    pub achieved_rate: f64,
    /// Furthest the producer fell behind its schedule.
    pub max_behind_ms: f64,
    pub last_due_ms: i64,
    pub paid: u64,
    /// Payments whose order was no longer pending (it had been cancelled first).
    pub paid_late: u64,
    /// Longest time from a push to its payment's commit.
    pub pay_max_lag_ms: f64,
}

/// Runs the steady producer for the plan, with the payer on its own thread.
pub fn steady(
    redis: &delay_worker::store::Redis,
    database_url: &str,
    shards: &[Keys],
    plan: &SteadyPlan,
    stop: &Shutdown,
) -> Result<Produced> {
    let mut con = store::connect(redis).context("producer: cannot connect to redis")?;
    let mut payer_db = delay_worker::db::connect(database_url).context("payer")?;
    let (pay_tx, pay_rx) = crossbeam_channel::unbounded::<(i64, Instant)>();
    std::thread::scope(|s| {
        let payer = std::thread::Builder::new()
            .name("bench-payer".into())
            .spawn_scoped(s, move || pay(&mut payer_db, &pay_rx))
            .context("cannot start the payer thread")?;
        // The payer stops when `pay_tx` is dropped, which `produce` does on every path.
        let produced = produce(&mut con, shards, plan, pay_tx, stop);
        let paid = payer
            .join()
            .map_err(|_| anyhow::anyhow!("the payer thread panicked"))?;
        let mut produced = produced?;
        let (n, late, lag) = paid?;
        produced.paid = n;
        produced.paid_late = late;
        produced.pay_max_lag_ms = lag;
        Ok(produced)
    })
}

fn produce(
    con: &mut delay_worker::store::Con,
    shards: &[Keys],
    plan: &SteadyPlan,
    pay: crossbeam_channel::Sender<(i64, Instant)>,
    stop: &Shutdown,
) -> Result<Produced> {
    let total = plan.messages();
    let mut rng = fastrand::Rng::with_seed(plan.seed);
    let (min_ms, max_ms) = (1000i64, plan.max_delay.as_millis() as i64);
    let mut out = Produced {
        dues: Vec::with_capacity(total as usize),
        ..Default::default()
    };
    let mut next_order = 1i64;
    // The last new order: (id, due, already duplicated). A duplicate repeats it at once
    // with the same due time: the double submit whose two jobs race for the order's row.
    let mut last: Option<(i64, i64, bool)> = None;
    let t0 = Instant::now();
    let mut first_sent: Option<Instant> = None;
    let mut last_sent = t0;
    for i in 0..total {
        if i % 256 == 0 && stop.is_set() {
            bail!("interrupted");
        }
        let at = t0 + Duration::from_secs_f64(i as f64 / plan.rate as f64);
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        } else {
            out.max_behind_ms = out.max_behind_ms.max((now - at).as_secs_f64() * 1000.0);
        }
        let now_ms = delay_worker::now_ms();
        let duplicate = rng.u32(0..100) < DUPLICATE_PERCENT && last.is_some_and(|l| !l.2);
        let (id, key, due_ms) = match (duplicate, last.as_mut()) {
            (true, Some(l)) => {
                l.2 = true;
                out.duplicates += 1;
                (l.0, format!("{}:dup", order_key(l.0)), l.1)
            }
            _ => {
                let id = next_order;
                next_order += 1;
                let due = now_ms + rng.i64(min_ms..=max_ms.max(min_ms));
                let due = match plan.scores {
                    Scores::Millis => due,
                    Scores::Seconds => (due + 999) / 1000 * 1000,
                };
                last = Some((id, due, false));
                (id, order_key(id), due)
            }
        };
        let keys = &shards[shard_of(key.as_bytes(), shards.len())];
        match plan.scores {
            Scores::Millis => {
                let job = NewJob {
                    event: ORDER_EVENT.into(),
                    payload: Value::Object(order_payload(id)),
                    due_ms,
                    key: Some(key.clone()),
                };
                producer::push(con, keys, &job, now_ms).context("producer")?;
            }
            Scores::Seconds => {
                // push.lua with a score in seconds: the PHP producer's HSET + ZADD, atomic.
                let msg = Envelope::new(ORDER_EVENT, order_payload(id), now_ms / 1000).to_json();
                store::push(con, keys, &key, &msg, due_ms / 1000).context("producer")?;
            }
        }
        let sent = Instant::now();
        first_sent.get_or_insert(sent);
        last_sent = sent;
        if !duplicate {
            let paid = rng.u32(0..100) < PAID_PERCENT;
            out.orders.push((id, paid));
            if paid {
                // The payer only goes away if it failed; its error is reported by `steady`.
                let _ = pay.send((id, sent));
            }
        }
        out.last_due_ms = out.last_due_ms.max(due_ms);
        out.dues.push((key, due_ms));
    }
    let span = last_sent.duration_since(first_sent.unwrap_or(last_sent));
    if total > 1 && !span.is_zero() {
        out.achieved_rate = (total - 1) as f64 / span.as_secs_f64();
    }
    Ok(out)
}

/// The payer: pays the orders it receives in batches. Returns (paid, paid too late,
/// longest push-to-commit lag in ms).
fn pay(db: &mut postgres::Client, rx: &Receiver<(i64, Instant)>) -> Result<(u64, u64, f64)> {
    let stmt = db.prepare(
        "UPDATE orders SET status = 'paid', paid_at = now(), updated_at = now()
          WHERE id = ANY($1) AND status = 'pending'",
    )?;
    let (mut paid, mut late, mut lag) = (0u64, 0u64, 0f64);
    let mut batch: Vec<(i64, Instant)> = Vec::new();
    loop {
        let done = match rx.recv_timeout(PAY_EVERY) {
            Ok(p) => {
                batch.push(p);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let due = batch.first().is_some_and(|(_, t)| t.elapsed() >= PAY_EVERY);
        if !batch.is_empty() && (due || done) {
            let ids: Vec<i64> = batch.iter().map(|(id, _)| *id).collect();
            let n = db.execute(&stmt, &[&ids]).context("payer")?;
            paid += ids.len() as u64;
            late += ids.len() as u64 - n;
            lag = lag.max(batch[0].1.elapsed().as_secs_f64() * 1000.0);
            batch.clear();
        }
        if done {
            return Ok((paid, late, lag));
        }
    }
}

/// One message for the bulk push: job key, message JSON, score.
pub type Bulk = (String, String, i64);

/// `order.timeout` for orders `1..=n`, all due a second before now.
pub fn backlog_jobs(n: u64) -> impl Iterator<Item = Bulk> {
    backlog_jobs_due(n, delay_worker::now_ms() - 1000)
}

/// `order.timeout` for orders `1..=n`, all due at `due_ms` (written now).
pub fn backlog_jobs_due(n: u64, due_ms: i64) -> impl Iterator<Item = Bulk> {
    let now_ms = delay_worker::now_ms();
    (1..=n as i64).map(move |id| {
        let msg = Envelope::new(ORDER_EVENT, order_payload(id), now_ms / 1000).to_json();
        (order_key(id), msg, due_ms)
    })
}

/// `n` no-op messages, all due a second before now.
pub fn engine_jobs(n: u64) -> impl Iterator<Item = Bulk> {
    let now_ms = delay_worker::now_ms();
    (1..=n).map(move |i| {
        let mut payload = Map::new();
        payload.insert("n".into(), json!(i));
        let msg = Envelope::new(NOOP_EVENT, payload, now_ms / 1000).to_json();
        (format!("{NOOP_EVENT}:{i}"), msg, now_ms - 1000)
    })
}

/// Pushes every job into its shard's key set with the store's `push_many`, [`PER_CALL`]
/// jobs per script call. Returns how many jobs each shard got, in shard order.
pub fn bulk_push(
    con: &mut delay_worker::store::Con,
    shards: &[Keys],
    jobs: impl Iterator<Item = Bulk>,
) -> Result<Vec<u64>> {
    let mut by_shard: Vec<Vec<Bulk>> = vec![Vec::new(); shards.len()];
    for job in jobs {
        by_shard[shard_of(job.0.as_bytes(), shards.len())].push(job);
    }
    by_shard
        .into_iter()
        .zip(shards)
        .map(|(jobs, keys)| {
            let (pushed, _) = store::pool::push_many(con, keys, jobs.into_iter(), PER_CALL)
                .context("bulk push")?;
            Ok(pushed)
        })
        .collect()
}
