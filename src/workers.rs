//! The worker pool: `--threads N` threads that turn deliveries into PostgreSQL
//! transactions and settle them in Redis.
//!
//! Each worker owns one pooled PostgreSQL connection for its whole life, with every
//! handler statement prepared on it once ([`Session`]), and one Redis connection for
//! settling. It loops on the channel: decode and validate, run the handler in one
//! transaction that first records the job in the inbox, then decide the outcome.
//!
//! **Delivery guarantee.** An entry is acknowledged only after its transaction committed
//! durably (or after its retry or dead letter was written, in the same script as the ack).
//! A crash before the ack leaves the entry pending; it is delivered again and the inbox row
//! makes the second run a no-op. So delivery is at least once and the effect exactly once.
//!
//! Acks are batched: outcomes collect for at most [`ACK_HOLD`] after the first of them,
//! and are sent in one `settle` script call, up to [`ACK_BATCH`] at a time. With
//! group commit the jobs commit without waiting for the WAL flush, and one
//! `db::flush_wal` before the settle makes all of them durable (`make_durable`).
//! Database failures (connection lost, server restarting, out of connections) hold the job
//! and run it again on a new session; only the job's own transient failures (deadlock,
//! serialization, timeouts) spend its retries.
//!
//! Stops when the channel is disconnected (the reader has stopped) and empty: everything
//! the pool held is finished and acknowledged first.

use crate::backoff::Backoff;
use crate::config::JobConfig;
use crate::db;
use crate::delivery::{Delivery, Origin, Outcome, Settlement, Take};
use crate::handlers::{Effect, Registry};
use crate::keys::Keys;
use crate::message::{event_of, Envelope, Rejection};
use crate::shutdown::Shutdown;
use crate::stats::{JobOutcome, Stats};
use crate::store::{self, Settled, StoreError};
use crossbeam_channel::{RecvTimeoutError, Sender, TryRecvError};
use postgres::types::Type;
use postgres::Statement;
use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Most outcomes settled in one script call.
pub const ACK_BATCH: usize = 64;

/// How long a worker holds an outcome before settling it, so that one WAL flush and one
/// script call cover the jobs it finishes meanwhile. At a steady load spread over the pool
/// a worker finishes a set every few tens of milliseconds: settling each alone cost a
/// PostgreSQL round trip and a Redis call per set (at 2,000 jobs/s, 25 ms gave 0.093 s of
/// worker CPU per 1,000 jobs, 100 ms 0.073). Only the ack waits, never a job; a crash
/// meanwhile means redeliveries that the inbox makes no-ops.
pub const ACK_HOLD: Duration = Duration::from_millis(100);

/// How often outcomes held back by a key of the wrong type are tried again.
pub const HELD_RETRY: Duration = Duration::from_secs(1);

/// What every worker shares. Read-only except the counters.
pub struct PoolContext<'a> {
    pub keys: &'a Keys,
    /// Every shard's key set (`keys` alone when unsharded): settlements go to their own.
    pub shards: &'a [Keys],
    pub jobs: &'a JobConfig,
    pub consumer: &'a str,
    pub registry: &'a Registry,
    pub stats: &'a Stats,
    pub db: &'a db::Pool,
    pub redis: &'a crate::store::Redis,
    pub shutdown: &'a Shutdown,
    /// Jobs finished after shutdown was requested (the drain), for the exit log.
    pub drained: &'a AtomicU64,
}

/// A worker's PostgreSQL connection with its statements prepared once.
pub struct Session {
    conn: db::Conn,
    inbox: Statement,
    /// The inbox insert of a whole set.
    inbox_set: Statement,
    /// `handlers[i]` holds the statements of the registry's handler `i`.
    handlers: Vec<Vec<Statement>>,
    /// `sets[i]`: the set form of the registry's handler `i`, if it has one.
    sets: Vec<Option<Statement>>,
}

/// The inbox insert. Its row count says whether this job is new (1) or a redelivery (0).
/// A job is its key, the mover's `job_id` stamp and `ts` (see `message.rs`).
const INBOX_SQL: &str = "INSERT INTO worker_inbox (job_key, enqueued_at, event, job_id) \
                         VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING";

/// The inbox insert of a set: one statement for all its rows. It returns the rows it
/// inserted; a job whose row is not among them is a redelivery.
const INBOX_SET_SQL: &str = "INSERT INTO worker_inbox (job_key, enqueued_at, event, job_id) \
                             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[]) \
                             ON CONFLICT DO NOTHING RETURNING job_key, enqueued_at, job_id";

/// Why a session could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no database connection: {0}")]
    Checkout(#[from] r2d2::Error),
    #[error("cannot prepare the handler of {event:?}: {reason}")]
    Prepare { event: String, reason: String },
    #[error("cannot prepare the inbox statement: {0}")]
    Inbox(String),
}

impl Session {
    pub fn open(pool: &db::Pool, registry: &Registry) -> Result<Session, SessionError> {
        let mut conn = pool.get()?;
        let inbox_err = |e: postgres::Error| SessionError::Inbox(db::error_text(&e));
        let inbox = conn.prepare(INBOX_SQL).map_err(inbox_err)?;
        let inbox_set = conn.prepare(INBOX_SET_SQL).map_err(inbox_err)?;
        let mut handlers = Vec::new();
        let mut sets = Vec::new();
        for h in registry.iter() {
            let prepare_err = |e: postgres::Error| SessionError::Prepare {
                event: h.event().to_string(),
                reason: db::error_text(&e),
            };
            let mut stmts = Vec::new();
            for (sql, types) in h.statements() {
                stmts.push(conn.prepare_typed(&sql, &types).map_err(prepare_err)?);
            }
            handlers.push(stmts);
            sets.push(match h.set_statement() {
                Some(sql) => {
                    let st = conn
                        .prepare_typed(&sql, &[Type::JSONB])
                        .map_err(prepare_err)?;
                    // The contract, checked once: `$1` only, the job's index first.
                    let shape = if st.params().len() != 1 {
                        Some(format!("its set form takes {} parameters; it gets one, $1 (the jobs)", st.params().len()))
                    } else if st.columns().first().map(|c| c.type_()) != Some(&Type::INT4) {
                        Some("its set form must return the job's index first, as an integer (RETURNING or SELECT ... i)".to_string())
                    } else {
                        None
                    };
                    if let Some(reason) = shape {
                        return Err(SessionError::Prepare {
                            event: h.event().to_string(),
                            reason,
                        });
                    }
                    Some(st)
                }
                None => None,
            });
        }
        Ok(Session {
            conn,
            inbox,
            inbox_set,
            handlers,
            sets,
        })
    }
}

/// How one job ended in PostgreSQL.
enum JobResult {
    Committed(Effect),
    Duplicate,
    Failed(postgres::Error),
    Panicked(String),
}

/// The inbox's text form of a job key: as is when it is text PostgreSQL can hold,
/// otherwise `\x` and hex (keys with NUL or invalid UTF-8 bytes).
pub fn key_text(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(s) if !s.contains('\0') => s.to_string(),
        _ => {
            let mut out = String::from("\\x");
            for b in key {
                out.push_str(&format!("{b:02x}"));
            }
            out
        }
    }
}

/// The event a raw list queue stands for, when the message came from one (`--queue
/// NAME=EVENT`): its messages are the payload alone, without the envelope.
fn raw_event<'k>(keys: &'k Keys, origin: &Origin) -> Option<&'k str> {
    match origin {
        Origin::List { queue } => keys.queues.get(*queue).and_then(|q| q.raw_event.as_deref()),
        Origin::Stream { .. } => None,
    }
}

/// Delay before retry number `retry + 1`: base * 2^retry, capped.
pub fn retry_delay(jobs: &JobConfig, retry: u32) -> Duration {
    jobs.retry_base
        .saturating_mul(1u32 << retry.min(20))
        .min(jobs.retry_cap)
}

pub struct Worker<'a> {
    name: String,
    ctx: &'a PoolContext<'a>,
    session: Option<Session>,
    /// Group commit: jobs committed on `session` since its last WAL flush.
    unflushed: bool,
    /// Group commit: this worker's row in `worker_flush` (`<consumer>/<index>`).
    flush_slot: String,
    /// Group commit: a session with unflushed commits was lost, so those commits may be
    /// too (a crashed server forgets them); their acks must not go out as acks.
    durability_lost: bool,
    redis: Option<crate::store::Con>,
    /// Outcomes a settle left where they were because a key they go to holds another
    /// type: tried again every [`HELD_RETRY`] until it is fixed. At shutdown they stay
    /// pending (or in the processing list) for the next start.
    held: Vec<Settlement>,
    held_tried: Option<std::time::Instant>,
    db_backoff: Backoff,
    redis_backoff: Backoff,
}

impl<'a> Worker<'a> {
    pub fn new(index: usize, ctx: &'a PoolContext<'a>) -> Worker<'a> {
        let name = format!("worker-{index}");
        Worker {
            db_backoff: Backoff::new(&name),
            redis_backoff: Backoff::new(&name),
            name,
            ctx,
            session: None,
            unflushed: false,
            flush_slot: format!("{}/{index}", ctx.consumer),
            durability_lost: false,
            redis: None,
            held: Vec::new(),
            held_tried: None,
        }
    }

    /// Drops the database session (broken, or mid-transaction after a panic).
    fn drop_session(&mut self) {
        if self.unflushed {
            self.durability_lost = true;
            self.unflushed = false;
        }
        self.session = None;
    }

    /// Group commit: before acks go out, the commits behind them must be durable. One WAL
    /// flush covers them all. If that cannot be confirmed (the session, or the server, was
    /// lost since), each ack becomes a re-queue of its message, due now: if the commit
    /// survived, the inbox makes the second run a no-op; if not, the job runs again.
    fn make_durable(&mut self, outcomes: &mut [Settlement]) {
        if self.unflushed {
            let flushed = match self.session.as_mut() {
                Some(session) => db::flush_wal(&mut session.conn, &self.flush_slot)
                    .map_err(|e| db::error_text(&e)),
                None => Err("no session".to_string()),
            };
            self.unflushed = false;
            if let Err(e) = flushed {
                log::warn!(
                    "{}: cannot confirm that commits are durable: {e}",
                    self.name
                );
                self.session = None;
                self.durability_lost = true;
            }
        }
        if !self.durability_lost {
            return;
        }
        self.durability_lost = false;
        let now = self.ctx.stats.clock.now_ms();
        let mut n = 0;
        for s in outcomes.iter_mut().filter(|s| s.is_ack()) {
            s.outcome = Outcome::Retry {
                msg: self.requeue_message(s),
                due_ms: now,
            };
            n += 1;
        }
        if n > 0 {
            log::warn!(
                "{}: {n} jobs go back to the delay pool instead of being acknowledged: their commits may not have survived",
                self.name
            );
        }
    }

    /// The message to put back in the delay pool for a settlement: as delivered, except a
    /// raw list message, which goes back wrapped in the envelope (the mover's queue carries
    /// envelopes).
    fn requeue_message(&self, s: &Settlement) -> Vec<u8> {
        match raw_event(self.ctx.keys, &s.origin)
            .map(|e| Envelope::decode_raw(&s.msg, usize::MAX, e))
        {
            Some(Ok(env)) => env.to_json().into_bytes(),
            _ => s.msg.clone(),
        }
    }

    /// The thread body. `space` wakes the reader when a slot frees up.
    pub fn run(mut self, rx: &Take, space: &Sender<()>) {
        let mut outcomes: Vec<Settlement> = Vec::with_capacity(ACK_BATCH);
        let gather = self.ctx.jobs.take_size();
        // When the oldest unsettled outcome must be settled.
        let mut settle_by: Option<Instant> = None;
        loop {
            let first = match rx.try_recv() {
                Ok(d) => d,
                Err(TryRecvError::Empty) => {
                    // Wait for work, but settle the outcomes in hand when their time comes.
                    let waited = match settle_by {
                        Some(at) => rx.recv_deadline(at),
                        None => Err(RecvTimeoutError::Timeout),
                    };
                    match waited {
                        Ok(d) => d,
                        Err(RecvTimeoutError::Disconnected) => break,
                        Err(RecvTimeoutError::Timeout) => {
                            self.flush(&mut outcomes);
                            settle_by = None;
                            match self.wait_for_work(rx, &mut outcomes) {
                                Some(d) => d,
                                None => break,
                            }
                        }
                    }
                }
                Err(TryRecvError::Disconnected) => break,
            };
            // Only what is already waiting joins the batch: batching never delays a job.
            let mut batch = first;
            while batch.len() < gather {
                match rx.try_recv() {
                    Ok(more) => batch.extend(more),
                    Err(_) => break,
                }
            }
            // A full channel's reader waits for this; a token already there is enough.
            let _ = space.try_send(());
            let draining = self.ctx.shutdown.is_set();
            let taken = batch.len() as u64;
            let before = outcomes.len();
            self.handle_batch(batch, &mut outcomes);
            if outcomes.len() - before < taken as usize {
                log::info!("{}: jobs left pending for the next start", self.name);
            }
            if draining {
                self.ctx.drained.fetch_add(taken, Ordering::Relaxed);
            }
            // A lost session's doubtful acks are settled at once, before jobs committed
            // on the next session join them; so is everything while draining.
            let now = Instant::now();
            if outcomes.len() >= ACK_BATCH
                || self.durability_lost
                || draining
                || settle_by.is_some_and(|at| now >= at)
            {
                self.flush(&mut outcomes);
                settle_by = None;
            } else if !outcomes.is_empty() && settle_by.is_none() {
                settle_by = Some(now + ACK_HOLD);
            }
        }
        self.flush(&mut outcomes);
        if !self.held.is_empty() {
            log::warn!(
                "{}: {} outcomes held back by a key of the wrong type stay where they are for the next start",
                self.name,
                self.held.len()
            );
        }
        log::trace!("{}: stopped", self.name);
    }

    /// Waits for the next delivery; while outcomes are held back, tries them again every
    /// [`HELD_RETRY`] meanwhile. `None` when the channel is disconnected.
    fn wait_for_work(
        &mut self,
        rx: &Take,
        outcomes: &mut Vec<Settlement>,
    ) -> Option<Vec<Delivery>> {
        loop {
            if self.held.is_empty() {
                return rx.recv().ok();
            }
            match rx.recv_timeout(HELD_RETRY) {
                Ok(d) => return Some(d),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => self.flush(outcomes),
            }
        }
    }

    /// Decides what becomes of one delivery. `None` leaves it pending (only when the
    /// database stays unreachable until shutdown): the next start delivers it again.
    pub fn handle(&mut self, d: Delivery) -> Option<Settlement> {
        let mut out = Vec::with_capacity(1);
        self.handle_batch(vec![d], &mut out);
        out.pop()
    }

    /// Decides what becomes of each delivery of a batch, appending the settlements to
    /// `out`. Jobs that need the database run in one transaction when there are several
    /// (see [`run_batch`]); a delivery is missing from `out` only when the database stayed
    /// unreachable until shutdown.
    pub fn handle_batch(&mut self, ds: Vec<Delivery>, out: &mut Vec<Settlement>) {
        let mut jobs = Vec::with_capacity(ds.len());
        for d in ds {
            match self.prepare(d) {
                Ok(job) if job.handler.needs_database() => jobs.push(job),
                Ok(job) => out.push(self.finish(job, JobResult::Committed(Effect::NoOp))),
                Err(dead) => out.push(*dead),
            }
        }
        if jobs.is_empty() {
            return;
        }
        let Some(results) = self.run_in_database(&jobs) else {
            return;
        };
        for (job, result) in jobs.into_iter().zip(results) {
            out.push(self.finish(job, result));
        }
    }

    /// Decodes and validates a delivery: a job ready for its handler, or its dead letter.
    fn prepare(&self, d: Delivery) -> Result<Job<'a>, Box<Settlement>> {
        let limit = self.ctx.jobs.max_message_bytes;
        let decoded = match raw_event(self.ctx.keys, &d.origin) {
            Some(event) => Envelope::decode_raw(&d.msg, limit, event),
            None => Envelope::decode(&d.msg, limit),
        };
        let env = match decoded {
            Ok(env) => env,
            Err(r) => {
                let event = match r {
                    Rejection::TooLarge { .. } => String::new(),
                    _ => event_of(&d.msg),
                };
                return Err(Box::new(self.dead(d, r.to_string(), event, 1)));
            }
        };
        let clock = &self.ctx.stats.clock;
        clock.producer_ts(env.ts, d.arrived_ms().unwrap_or_else(|| clock.now_ms()));
        let Some((index, handler)) = self.ctx.registry.get(&env.event) else {
            let reason = Rejection::UnknownEvent(env.event.clone()).to_string();
            let attempts = env.retry as u64 + 1;
            return Err(Box::new(self.dead(d, reason, env.event, attempts)));
        };
        if let Err(r) = env.require(handler.required()) {
            let attempts = env.retry as u64 + 1;
            return Err(Box::new(self.dead(d, r.to_string(), env.event, attempts)));
        }
        Ok(Job {
            key: key_text(&d.key),
            d,
            env,
            index,
            handler,
        })
    }

    /// Turns a job's result into its settlement: ack, retry with backoff, or dead letter.
    fn finish(&mut self, job: Job<'a>, result: JobResult) -> Settlement {
        let stats = self.ctx.stats;
        let Job { d, env, key, .. } = job;
        match result {
            JobResult::Committed(effect) => {
                let outcome = match effect {
                    Effect::Applied => JobOutcome::Done,
                    Effect::NoOp => JobOutcome::NoOp,
                };
                let now = stats.clock.now_ms();
                stats.jobs.lateness(d.due_ms, now);
                if log::log_enabled!(log::Level::Debug) {
                    let what = match effect {
                        Effect::Applied => "done",
                        Effect::NoOp => "no-op (nothing to change)",
                    };
                    let late = d
                        .due_ms
                        .map(|due| format!(", {} ms after its due time", now - due))
                        .unwrap_or_default();
                    log::debug!("job {key} {}: {what}{late}", env.event);
                }
                Settlement::ack(d, &env.event, outcome)
            }
            JobResult::Duplicate => {
                log::debug!("job {key} {}: duplicate (already in the inbox)", env.event);
                Settlement::ack(d, &env.event, JobOutcome::Duplicate)
            }
            // Connection-level failures never get here: `run_in_database` reruns those.
            JobResult::Failed(e) if db::is_transient(&e) => {
                let reason = db::error_text(&e);
                if env.retry >= self.ctx.jobs.max_retries {
                    let reason = format!("transient failure after {} retries: {reason}", env.retry);
                    return self.dead(d, reason, env.event.clone(), env.retry as u64 + 1);
                }
                let delay = retry_delay(self.ctx.jobs, env.retry);
                log::warn!(
                    "job {key} {} will retry ({}) in {:.1}s: {reason}",
                    env.event,
                    env.retry + 1,
                    delay.as_secs_f64()
                );
                let retry = Outcome::Retry {
                    msg: env.next_retry().into_bytes(),
                    due_ms: stats.clock.now_ms() + delay.as_millis() as i64,
                };
                Settlement::new(d, retry).with_event(&env.event)
            }
            JobResult::Failed(e) => {
                let reason = format!("handler failed: {}", db::error_text(&e));
                self.dead(d, reason, env.event.clone(), env.retry as u64 + 1)
            }
            JobResult::Panicked(msg) => {
                // The connection may be mid-transaction: start afresh.
                self.drop_session();
                let reason = format!("handler panicked: {msg}");
                self.dead(d, reason, env.event.clone(), env.retry as u64 + 1)
            }
        }
    }

    /// Runs the jobs, waiting (with backoff) for a database session. `None` when shutdown
    /// came while the database was unreachable.
    fn run_in_database(&mut self, jobs: &[Job<'a>]) -> Option<Vec<JobResult>> {
        loop {
            let session = match self.session.as_mut() {
                Some(s) => s,
                None => match Session::open(self.ctx.db, self.ctx.registry) {
                    Ok(s) => {
                        if self.db_backoff.in_outage() {
                            self.ctx.stats.db_waiting.fetch_sub(1, Ordering::Relaxed);
                        }
                        self.db_backoff.reset();
                        self.session.insert(s)
                    }
                    Err(e) => {
                        // The database is unreachable or out of connections (handler SQL
                        // was checked at start).
                        if self.wait_for_database("no database session", &e) {
                            return None;
                        }
                        continue;
                    }
                },
            };
            let started = std::time::Instant::now();
            let results = match jobs {
                [job] => vec![run_job(session, job)],
                _ => run_jobs(session, jobs, self.ctx.jobs, &self.ctx.stats.in_sets),
            };
            if let Some(e) = results.iter().find_map(|r| match r {
                JobResult::Failed(e) if db::is_connection_error(e) => Some(db::error_text(e)),
                _ => None,
            }) {
                // The database's failure, not the jobs': run them again on a new session.
                // A job that did commit before the connection went finds its inbox row.
                self.drop_session();
                if self.wait_for_database("database connection lost", &e) {
                    return None;
                }
                continue;
            }
            // A duplicate counts too: the inbox row it found may be another session's
            // commit that is visible but not yet durable.
            if self.ctx.jobs.group_commit
                && results
                    .iter()
                    .any(|r| matches!(r, JobResult::Committed(_) | JobResult::Duplicate))
            {
                self.unflushed = true;
            }
            let each = started.elapsed() / jobs.len() as u32;
            for job in jobs {
                self.ctx.stats.jobs.handler_time(&job.env.event, each);
            }
            return Some(results);
        }
    }

    /// The database failed, not the job: hold the job (back-pressure on the reader)
    /// instead of spending its retries, and back off. Counts this worker as waiting once
    /// per outage. `true` when shutdown came meanwhile.
    fn wait_for_database(&mut self, what: &str, err: &dyn std::fmt::Display) -> bool {
        if !self.db_backoff.in_outage() {
            Stats::add(&self.ctx.stats.db_waiting, 1);
        }
        self.db_backoff.fail(what, err, self.ctx.shutdown)
    }

    /// A dead-letter outcome; logged and counted once the settle wrote the letter.
    fn dead(&self, d: Delivery, reason: String, event: String, attempts: u64) -> Settlement {
        Settlement::new(
            d,
            Outcome::Dead {
                reason,
                event,
                attempts,
            },
        )
    }

    /// Settles the collected outcomes in one script call. Retries with backoff while Redis
    /// is unreachable; gives up only at shutdown, leaving the entries pending (they are
    /// redelivered and the inbox turns the redelivery into a no-op).
    fn flush(&mut self, outcomes: &mut Vec<Settlement>) {
        if !self.held.is_empty() && self.held_tried.is_none_or(|t| t.elapsed() >= HELD_RETRY) {
            self.held_tried = Some(std::time::Instant::now());
            outcomes.append(&mut self.held);
        }
        if outcomes.is_empty() {
            return;
        }
        self.make_durable(outcomes);
        loop {
            let con = match self.redis.as_mut() {
                Some(c) => c,
                None => match store::connect(self.ctx.redis) {
                    Ok(c) => self.redis.insert(c),
                    Err(e) => {
                        self.ctx.stats.redis_failure(&self.redis_backoff);
                        if self
                            .redis_backoff
                            .fail("cannot connect to redis", &e, self.ctx.shutdown)
                            && self.give_up(outcomes)
                        {
                            return;
                        }
                        continue;
                    }
                },
            };
            match store::settle(con, self.ctx.shards, self.ctx.consumer, outcomes) {
                Ok(report) => {
                    self.redis_backoff.reset();
                    self.settled(outcomes, &report);
                    return;
                }
                Err(e) => {
                    self.store_failure(&e);
                    if self
                        .redis_backoff
                        .fail("settle failed", &e, self.ctx.shutdown)
                        && self.give_up(outcomes)
                    {
                        return;
                    }
                }
            }
        }
    }

    /// A settle failed: a lost connection is dropped (reconnect), a key of the wrong type
    /// is the operator's problem (the health checks say so).
    fn store_failure(&mut self, e: &StoreError) {
        if let Some(p) = e.operator_problem() {
            self.ctx.stats.report_problem(&self.name, p);
        }
        self.redis = None;
        self.ctx.stats.redis_failure(&self.redis_backoff);
    }

    /// Counts and logs what a settle did, now that Redis has it: the retries written, the
    /// dead letters written, and the outcomes left where they were behind a key of the
    /// wrong type (held, and tried again). Empties `outcomes`.
    fn settled(&mut self, outcomes: &mut Vec<Settlement>, report: &store::SettleReport) {
        let stats = self.ctx.stats;
        Stats::add(&stats.acked, report.applied() as u64);
        let mut blocked = 0;
        for (s, what) in outcomes.drain(..).zip(&report.each) {
            match (what, &s.outcome) {
                // The commit happened whoever acknowledged it (a peer after a reclaim).
                (Settled::Applied | Settled::AlreadySettled, Outcome::Ack) => {
                    if let Some(o) = s.counts_as {
                        stats.jobs.job(&s.event, o);
                    }
                }
                (Settled::Applied, Outcome::Retry { .. }) => {
                    stats.jobs.job(&s.event, JobOutcome::Retry);
                }
                (Settled::Applied, Outcome::Dead { reason, .. }) => {
                    log::warn!(
                        "job {} {} dead-lettered: {reason}",
                        key_text(&s.key),
                        s.event
                    );
                    stats.jobs.job(&s.event, JobOutcome::Dead);
                }
                (Settled::Superseded, _) => {
                    log::warn!(
                        "job {} {} dead-lettered: its key was pushed again before the retry ran (the newer push runs)",
                        key_text(&s.key),
                        s.event
                    );
                    stats.jobs.job(&s.event, JobOutcome::Dead);
                }
                (Settled::Blocked, _) => {
                    blocked += 1;
                    self.held.push(s);
                }
                _ => {}
            }
        }
        if let Some(m) = &report.moving {
            let problem = format!("outcomes are held back: {m}; they are settled once it answers");
            if stats.report_critical(&self.name, problem.clone()) {
                log::warn!("{}: {blocked} {problem}", self.name);
            }
        } else if let Some(w) = &report.blocked {
            let problem = format!(
                "outcomes are held back: {w}; they are settled once it is renamed or removed"
            );
            if stats.report_problem(&self.name, problem.clone()) {
                log::error!("{}: {blocked} {problem}", self.name);
            }
        } else if self.held.is_empty() && stats.clear_problem(&self.name, i64::MAX) {
            log::info!("{}: the held-back outcomes are settled", self.name);
        }
    }

    /// At shutdown, a few more quick attempts, then leave the outcomes pending.
    fn give_up(&mut self, outcomes: &mut Vec<Settlement>) -> bool {
        for _ in 0..3 {
            if let Ok(mut c) = store::connect(self.ctx.redis) {
                if let Ok(report) =
                    store::settle(&mut c, self.ctx.shards, self.ctx.consumer, outcomes)
                {
                    self.settled(outcomes, &report);
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        log::warn!(
            "{}: redis unreachable at shutdown; {} entries stay pending and will be redelivered",
            self.name,
            outcomes.len()
        );
        outcomes.clear();
        true
    }
}

/// A delivery that decoded and has a handler: ready for the database.
struct Job<'h> {
    d: Delivery,
    env: Envelope,
    /// The handler's position in the registry (and of its statements in a session).
    index: usize,
    handler: &'h dyn crate::handlers::Handler,
    /// The inbox's text form of the job key.
    key: String,
}

/// Inserts the job's inbox row and runs its handler inside `tx`. `Ok(None)`: the inbox
/// already held the job (a redelivery), nothing else was done.
fn apply(
    tx: &mut postgres::Transaction<'_>,
    inbox: &Statement,
    statements: &[Vec<Statement>],
    job: &Job<'_>,
) -> Result<Option<Effect>, JobResult> {
    let job_id = job.env.job_id.as_deref().unwrap_or("");
    match tx.execute(inbox, &[&job.key, &job.env.ts, &job.env.event, &job_id]) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(JobResult::Failed(e)),
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        job.handler
            .handle(tx, &statements[job.index], &job.env.payload)
    }));
    match outcome {
        Ok(Ok(effect)) => Ok(Some(effect)),
        Ok(Err(e)) => Err(JobResult::Failed(e)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(JobResult::Panicked(msg))
        }
    }
}

/// One job in one transaction: the inbox row first, then the handler, then commit.
/// Dropping the transaction on an error rolls it back.
fn run_job(session: &mut Session, job: &Job<'_>) -> JobResult {
    let Session {
        conn,
        inbox,
        handlers,
        ..
    } = session;
    let mut tx = match conn.transaction() {
        Ok(tx) => tx,
        Err(e) => return JobResult::Failed(e),
    };
    let result = match apply(&mut tx, inbox, handlers, job) {
        Ok(Some(effect)) => JobResult::Committed(effect),
        Ok(None) => JobResult::Duplicate,
        Err(failed) => return failed,
    };
    match tx.commit() {
        Ok(()) => result,
        Err(e) => JobResult::Failed(e),
    }
}

/// Why a set did not commit.
#[derive(Debug, thiserror::Error)]
enum SetError {
    #[error("{}", db::error_text(.0))]
    Db(#[from] postgres::Error),
    #[error("the set form returned index {0}, not one of a new job of the set, or twice")]
    Index(i32),
}

/// The jobs a worker took together: those of an event with a set form, two or more, as
/// one set ([`run_set`]); the rest alone, or `tx_batch` at a time in one transaction
/// ([`run_batch`]). A set or batch that fails committed nothing, and its jobs run again
/// one by one, so each gets its own outcome and one bad job never fails its neighbours.
fn run_jobs(
    session: &mut Session,
    jobs: &[Job<'_>],
    cfg: &JobConfig,
    in_sets: &AtomicU64,
) -> Vec<JobResult> {
    let tx_batch = cfg.tx_batch;
    let mut results: Vec<Option<JobResult>> = jobs.iter().map(|_| None).collect();
    let mut sets: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut alone = Vec::new();
    for (k, job) in jobs.iter().enumerate() {
        match session.sets[job.index] {
            Some(_) if cfg.set_size > 1 => sets.entry(job.index).or_default().push(k),
            _ => alone.push(k),
        }
    }
    for ks in sets.into_values().flat_map(|ks| {
        ks.chunks(cfg.set_size)
            .map(<[usize]>::to_vec)
            .collect::<Vec<_>>()
    }) {
        let set: Vec<&Job<'_>> = ks.iter().map(|&k| &jobs[k]).collect();
        if set.len() < 2 {
            alone.extend(ks);
            continue;
        }
        match run_set(session, &set) {
            Ok(rs) => {
                Stats::add(in_sets, rs.len() as u64);
                for (k, r) in ks.into_iter().zip(rs) {
                    results[k] = Some(r);
                }
            }
            Err(e) => {
                // A bad payload or a deadlock with the shop's own transactions is the
                // jobs' business: each runs alone and gets its own outcome. A refused
                // privilege, or a set form that breaks its contract, is the operator's:
                // the set form would never work.
                let text = e.to_string();
                let privilege = matches!(&e, SetError::Db(e)
                    if e.code() == Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE));
                if privilege || matches!(e, SetError::Index(_)) {
                    log::warn!(
                        "a set of {} {} jobs failed, so they run one by one: {text}",
                        set.len(),
                        set[0].env.event
                    );
                } else {
                    log::debug!(
                        "a set of {} jobs failed, so they run one by one: {text}",
                        set.len()
                    );
                }
                alone.extend(ks);
            }
        }
    }
    alone.sort_unstable();
    for chunk in alone.chunks(tx_batch.max(1)) {
        let batch: Vec<&Job<'_>> = chunk.iter().map(|&k| &jobs[k]).collect();
        let rs = match batch.as_slice() {
            [job] => vec![run_job(session, job)],
            _ => run_batch(session, &batch)
                .unwrap_or_else(|| batch.iter().map(|job| run_job(session, job)).collect()),
        };
        for (&k, r) in chunk.iter().zip(rs) {
            results[k] = Some(r);
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// Jobs of one event in one transaction through the handler's set form: the inbox rows of
/// all of them in one statement, then one statement for the jobs whose rows were new (the
/// others are redeliveries), then one commit. An error if anything failed (nothing
/// committed): the caller runs each job alone.
fn run_set(session: &mut Session, jobs: &[&Job<'_>]) -> Result<Vec<JobResult>, SetError> {
    let Session {
        conn,
        inbox_set,
        sets,
        ..
    } = session;
    let statement = sets[jobs[0].index]
        .as_ref()
        .expect("only jobs of a handler with a set form form a set");
    let keys: Vec<&str> = jobs.iter().map(|j| j.key.as_str()).collect();
    let ts: Vec<i64> = jobs.iter().map(|j| j.env.ts).collect();
    let events: Vec<&str> = jobs.iter().map(|j| j.env.event.as_str()).collect();
    let ids: Vec<&str> = jobs
        .iter()
        .map(|j| j.env.job_id.as_deref().unwrap_or(""))
        .collect();
    let mut tx = conn.transaction()?;
    let inserted: HashSet<(String, i64, String)> = tx
        .query(inbox_set, &[&keys, &ts, &events, &ids])?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
        .collect::<Result<_, postgres::Error>>()?;
    // A job is new if its row was inserted now; of two copies of one job in the set, the
    // first is new and the second a redelivery.
    let mut results: Vec<JobResult> = Vec::with_capacity(jobs.len());
    let mut work = Vec::new();
    let mut seen = HashSet::new();
    for (i, job) in jobs.iter().enumerate() {
        let id = (keys[i].to_string(), ts[i], ids[i].to_string());
        if inserted.contains(&id) && seen.insert(id) {
            results.push(JobResult::Committed(Effect::NoOp));
            work.push(serde_json::json!({"i": i, "payload": job.env.payload}));
        } else {
            results.push(JobResult::Duplicate);
        }
    }
    if !work.is_empty() {
        let work = serde_json::Value::Array(work);
        for row in tx.query(statement, &[&work])? {
            let i: i32 = row.try_get(0)?;
            // An index the set was not given, or one given twice, is a set form that does
            // not keep its contract: nothing commits and every job runs alone.
            match usize::try_from(i).ok().and_then(|i| results.get_mut(i)) {
                Some(r @ JobResult::Committed(Effect::NoOp)) => {
                    *r = JobResult::Committed(Effect::Applied)
                }
                _ => return Err(SetError::Index(i)),
            }
        }
    }
    tx.commit()?;
    Ok(results)
}

/// Several jobs in one transaction (`--tx-batch`): one commit for all of them, which is
/// what a job costs most. Each job keeps its own inbox row, so each stays idempotent; if
/// any statement fails nothing commits and `None` tells the caller to run each job alone.
fn run_batch(session: &mut Session, jobs: &[&Job<'_>]) -> Option<Vec<JobResult>> {
    let Session {
        conn,
        inbox,
        handlers,
        ..
    } = session;
    let mut tx = conn.transaction().ok()?;
    let mut results = Vec::with_capacity(jobs.len());
    for job in jobs {
        results.push(match apply(&mut tx, inbox, handlers, job).ok()? {
            Some(effect) => JobResult::Committed(effect),
            None => JobResult::Duplicate,
        });
    }
    tx.commit().ok()?;
    Some(results)
}
