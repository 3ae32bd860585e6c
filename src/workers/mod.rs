//! The worker pool: `--threads N` threads that turn deliveries into PostgreSQL
//! transactions and settle them in Redis.
//!
//! Each worker owns one pooled PostgreSQL connection for its whole life, with every
//! handler statement prepared on it once ([`session::Session`]), and one Redis connection
//! for settling. It loops on the channel: decode and validate, run the handler in one
//! transaction that first records the job in the inbox, then decide the outcome.
//!
//! **Delivery guarantee.** An entry is acknowledged only after its transaction committed
//! durably (or after its retry or dead letter was written, in the same script as the ack).
//! A crash before the ack leaves the entry pending; it is delivered again and the inbox row
//! makes the second run a no-op. So delivery is at least once and the effect exactly once.
//!
//! **Whose fault.** A failure's [`Fault`] decides the outcome, never where it showed:
//! - the server's (connection lost, restarting, read-only, out of connections): the worker
//!   throws the connection away, holds its jobs and runs them again on a new one, with
//!   backoff and no retry spent; a job that did commit finds its inbox row then, so a
//!   commit whose outcome was not reported is never also retried or dead-lettered;
//! - contention (the shop's locks, deadlocks): back to the pool with backoff; a lock
//!   wait is never a dead letter (critical past `--retry-for`), anything else (a
//!   deadlock, a slow statement) is one only once `--max-retries` are spent *and*
//!   `--retry-for` has passed since the job first fell due;
//! - the schema's (a missing column, a refused privilege, a handler that does not
//!   prepare): held, back in the pool for [`SCHEMA_HOLD`] without spending a retry, and
//!   health is red naming the error until a job of that event commits;
//! - the job's own (its data, the handler's `RAISE`): a dead letter with the reason once
//!   another job of its event has changed something since it failed (in any process: the
//!   inbox is asked), or at its second look when the handler's own statement met its data
//!   (a class `22` error outside any function or trigger, quoting no value or one its
//!   payload holds), the job was never held (`held_at`) and no other job of its event is
//!   refused (here, or in any process as Redis's record says when none is on record
//!   here: `refusal_on_record`); held and red until then, the
//!   held jobs of an event tried one at a time (`own_fault`, `may_run`);
//! - messages that cannot be decoded: a dead letter at once, with the reason.
//!
//! A retried or held message carries `first_due`, when the job first fell due: lateness
//! and the contention horizon count from there.
//!
//! Acks are batched: outcomes collect for at most [`ACK_HOLD`] after the first of them,
//! and are sent in one `settle` script call, up to [`ACK_BATCH`] at a time. With
//! group commit the jobs commit without waiting for the WAL flush, and one
//! `db::flush_wal` before the settle makes all of them durable (`make_durable`).
//!
//! Stops when the channel is disconnected (the reader has stopped) and empty: everything
//! the pool held is finished and acknowledged first.

pub mod session;

use crate::backoff::Backoff;
use crate::config::JobConfig;
use crate::db::{self, Fault};
use crate::delivery::{Delivery, Origin, Outcome, Settlement, Take};
use crate::handlers::{Effect, Handlers, Registry};
use crate::keys::Keys;
use crate::manners::Manners;
use crate::message::{event_of, Envelope, Rejection};
use crate::shutdown::Shutdown;
use crate::stats::{
    JobOutcome, Stats, CONTENTION_ROLE as CONTENTION, CONTENTION_STALL, HELD_ROLE_PREFIX,
};
use crate::store::{self, Settled, StoreError};
use crossbeam_channel::{RecvTimeoutError, Sender, TryRecvError};
use session::{Failure, InboxId, Job, JobResult, Session};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after its due time a job that waited in vain for a lock waits only a fifth of
/// `--lock-timeout` at its tries (at most half of `--retry-for`): [`Job::brief_lock`].
/// Each try holds a worker for its whole wait, so while the shop holds for long rows that
/// many due jobs need, their retries kept the workers from the others; a row the shop
/// keeps busy without a pause, a waiter always finding others queued before it, is got
/// only by a whole wait, which a job's tries go back to after this.
pub const BRIEF_LOCKS_FOR: Duration = Duration::from_secs(60);

/// How long a delivery waits in this process before a worker asks whether this consumer
/// still owns its entry before running it ([`Worker::drop_taken_over`]): a peer takes a
/// process's entries only after it has had no usable PostgreSQL for `--heartbeat-ttl`, so
/// a delivery younger than this was not taken; one that waited in the channel through
/// such an outage may have been.
pub const HELD_LONG: Duration = Duration::from_secs(1);

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

/// The longest a worker rests between two checkouts for a PostgreSQL session. Each
/// checkout already waits up to [`db::CHECKOUT`] while the pool tries to connect in the
/// background, so a longer rest would only leave a connection made meanwhile (a standby
/// just promoted) idle in the pool.
pub const DB_BACKOFF_CAP: Duration = Duration::from_millis(250);

/// How long a job held by a schema fault waits in the pool before it is tried again.
pub const SCHEMA_HOLD: Duration = Duration::from_secs(5);

/// How long a job whose own fault it seems to be (its data, a `RAISE`) waits in the pool
/// before its second look: time for the same fault in its event's other jobs to show.
pub const SECOND_LOOK: Duration = Duration::from_secs(2);

/// How long after a job's first refusal another job's change must come to prove the
/// refusal the job's own (see [`Worker::own_fault`]).
const PROOF_AFTER_REFUSAL: Duration = Duration::from_secs(1);

/// The longest a job refused within `--refusal-grace` waits for its next look.
pub const GRACE_LOOK: Duration = Duration::from_secs(30);

/// How long before a job's failure on contention a change by another job of its event
/// must have been, to prove that the lock is the job's alone ([`Worker::stands_still`]):
/// longer than a worker's batch of lock waits, so that the changes made once a lock
/// every job met is let go do not count.
pub const PROOF_BEFORE_FAILURE: Duration = Duration::from_secs(2);

/// How often a worker replaces a session on which jobs meet a schema fault
/// ([`Worker::renew_session`]): the role's settings (`role`, `search_path`) are read
/// only when a session starts. Found from outside: `ALTER ROLE ... SET role = 'nopriv'`
/// undone with `RESET role` left every job held, red, for as long as the worker ran.
const SESSION_RENEW_EVERY: Duration = Duration::from_secs(5);

/// The longest delay between two tries of a job that meets contention (or `--retry-cap`,
/// if shorter): once the shop's lock is gone the job runs within this.
pub const CONTENTION_CAP: Duration = Duration::from_secs(30);

/// The role a group commit that cannot be confirmed for the operator's reason (a refused
/// privilege on `worker_flush`) is reported under: critical.
const GROUP_COMMIT: &str = "group commit";

/// The first and the longest pause between two tries of a group commit's WAL flush that
/// met contention ([`Worker::flush`]).
const FLUSH_RETRY_FIRST: Duration = Duration::from_millis(100);
const FLUSH_RETRY_CAP: Duration = Duration::from_secs(1);

/// How a WAL flush of group commit went through ([`Worker::flush`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flushed {
    /// On `worker_flush`, as it should.
    OnItsTable,
    /// Around it, `worker_flush` not writable: by the inbox ([`db::flush_wal_by_inbox`]).
    ByTheInbox,
}

/// The WAL flush of group commit went around `worker_flush`, refused `e`: critical.
fn flushed_around(stats: &Stats, e: &postgres::Error) {
    let what = format!(
        "worker_flush cannot be written: {}: each WAL flush of group commit updates a row of worker_inbox instead, so jobs go on (grant it as sql/grants.sql does, or put the table back)",
        db::error_text(e)
    );
    if stats.report_critical(GROUP_COMMIT, what.clone()) {
        log::error!("{GROUP_COMMIT}: {what}");
    }
}

/// How often a worker whose flushes went around `worker_flush` tries the table again,
/// with jobs or without: well within the minute a problem is told for after its last
/// report, so that red lasts as long as the refusal, not a minute after the last job.
const FLUSH_RECHECK: Duration = Duration::from_secs(15);

/// A flush of the WAL went through: a refused group commit's alarm goes.
fn durable_again(stats: &Stats) {
    if stats.clear_problem(GROUP_COMMIT, i64::MAX) {
        log::info!("{GROUP_COMMIT}: commits are confirmed durable again");
    }
}

/// The role acknowledgements waiting for their commits' confirmation are reported under
/// ([`unconfirmed`]).
const ACKS_WAIT: &str = "acknowledgements";

/// Acknowledgements waiting for their commits to be confirmed durable
/// ([`Worker::survived`]): critical, under [`ACKS_WAIT`] (beside the group commit's own
/// problems, a `worker_flush` refused), until the look-up ends. Found from outside: with
/// a synchronous standby gone, the workers' sessions waiting for it ended every second or
/// two (each wait under [`crate::dbwatch::SYNC_WAIT_CRIT`], each lost session red only
/// until the next one opened): no job was acknowledged for 20 s, and `/healthz` was 200
/// for over 90 % of it.
fn unconfirmed(stats: &Stats, jobs: usize, why: &dyn std::fmt::Display) {
    let what = format!(
        "acknowledgements wait: the commits of {jobs} jobs are not confirmed durable ({why}); each is acknowledged once a WAL flush goes through, or runs again, a no-op where it committed"
    );
    let gist = "acknowledgements wait for a confirmed WAL flush".to_string();
    if stats.report_critical_about(ACKS_WAIT, what.clone(), gist) {
        log::error!("{what}");
    }
}

/// What every worker shares. Read-only except the counters.
pub struct PoolContext<'a> {
    pub keys: &'a Keys,
    /// `--claim-idle`: entries held longer are claimed again before they look stuck
    /// ([`Worker::keep_claimed`]).
    pub claim_idle: Duration,
    /// Every shard's key set (`keys` alone when unsharded): settlements go to their own.
    pub shards: &'a [Keys],
    pub jobs: &'a JobConfig,
    pub consumer: &'a str,
    /// The handlers, replaced by a reload (SIGHUP): each worker takes the new ones at its
    /// next batch.
    pub handlers: &'a Handlers,
    /// Rate caps and per-event set sizes (`manners.rs`).
    pub manners: &'a Manners,
    pub stats: &'a Stats,
    pub db: &'a db::Pool,
    pub redis: &'a crate::store::Redis,
    pub shutdown: &'a Shutdown,
    /// What the stop did with the jobs the workers held, for the exit log.
    pub drain: &'a Drain,
}

/// What a stop did with the jobs the workers held when it came: ran them (`ran`, after
/// the stop was asked for), or left them pending for the next start (`left`: a
/// `--max-rate` had not let them run yet, or the database was unreachable).
#[derive(Debug, Default)]
pub struct Drain {
    pub ran: AtomicU64,
    pub left: AtomicU64,
}

/// The role a schema fault of `event` is reported under.
fn held_role(event: &str) -> String {
    format!("{HELD_ROLE_PREFIX}{event}")
}

/// The role under which a refusal of every job of `event` is reported.
fn refused_role(event: &str) -> String {
    format!("{HELD_ROLE_PREFIX}{event} refused")
}

/// The words a refusal is known by from one try to the next and from one job to another:
/// its first 80 characters (the message kept in a job's `last_error` is cut longer), each
/// word that holds a digit as `#` and each quoted text as `'…'`, so that a rule whose
/// message names the order (`RAISE 'order % is frozen', NEW.order_no`) is one refusal for
/// every order it refuses. Found from outside: such a rule switched on and off
/// dead-lettered 42 of 80 unpaid orders past `--refusal-grace`, where the same rule with
/// one message for all cost none (a job refused so that went through was never taken for
/// the same rule). A capitalised word after the first (`Alice`, not `ALL`) is `#` too: a
/// name the message gives (`RAISE 'order of customer % is frozen', NEW.customer`; found
/// from outside: 135 of 800 unpaid orders dead-lettered by such a rule switched on and
/// off).
fn refusal_gist(reason: &str) -> String {
    let mut gist = String::with_capacity(reason.len().min(GIST_CHARS * 4));
    let mut chars = reason.chars().peekable();
    // Counted as it grows: at most one word past the cut, taken off at the end.
    let mut kept = 0;
    let mut first_word = true;
    while let Some(c) = chars.next() {
        if kept >= GIST_CHARS {
            break;
        }
        let before = gist.len();
        match c {
            // Quoted text (a value, a name) is the job's, not the rule's.
            '\'' | '"' => {
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                }
                gist.push(c);
                gist.push('…');
                gist.push(c);
            }
            c if c.is_alphanumeric() || c == '_' || c == '-' => {
                let mut word = String::from(c);
                while let Some(&n) = chars.peek() {
                    if !(n.is_alphanumeric() || n == '_' || n == '-') {
                        break;
                    }
                    word.push(n);
                    chars.next();
                }
                // A word with a digit in it (an order's number, an id) is the job's too,
                // and so is a name.
                let named = !first_word
                    && word.chars().next().is_some_and(char::is_uppercase)
                    && word.chars().any(char::is_lowercase);
                first_word = false;
                match named || word.chars().any(|c| c.is_ascii_digit()) {
                    true => gist.push('#'),
                    false => gist.push_str(&word),
                }
            }
            c => gist.push(c),
        }
        kept += gist[before..].chars().count();
    }
    gist.chars().take(GIST_CHARS).collect()
}

/// How much of a refusal's words [`refusal_gist`] keeps.
const GIST_CHARS: usize = 80;

/// The role of jobs of `event` refused within `--refusal-grace` while others go through.
fn grace_role(event: &str) -> String {
    format!("{HELD_ROLE_PREFIX}{event} refused within the grace")
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

/// The inbox key of the job of message `msg` (job key `key`) from `origin`, as its inbox
/// insert writes it; `None` when the message does not decode (no job of it ever ran).
pub fn inbox_id(keys: &Keys, origin: &Origin, key: &[u8], msg: &[u8]) -> Option<InboxId> {
    let env = match raw_event(keys, origin) {
        Some(event) => Envelope::decode_raw(msg, usize::MAX, event),
        None => Envelope::decode(msg, usize::MAX),
    }
    .ok()?;
    Some(InboxId::of_envelope(key, &env))
}

/// The event a raw list queue stands for, when the message came from one (`--queue
/// NAME=EVENT`): its messages are the payload alone, without the envelope.
fn raw_event<'k>(keys: &'k Keys, origin: &Origin) -> Option<&'k str> {
    match origin {
        Origin::List { queue } => keys.queues.get(*queue).and_then(|q| q.raw_event.as_deref()),
        Origin::Stream { .. } => None,
    }
}

/// How long a worker runs jobs without counting their starts after Redis failed to count
/// them ([`StartCount`]).
const COUNT_STARTS_PAUSE: Duration = Duration::from_secs(5);

/// Counts in Redis the starts of the jobs delivered before ([`crate::keys::Keys::starts`];
/// a first delivery's start is not counted, so a drain's jobs cost no round trip more), as
/// a session's transactions begin and end ([`session::Starts`]): one more as the
/// transaction of such a job begins, one less once it has ended, however (it failed, the
/// server went, or it committed: the process saw the end, so it was no message that kills
/// its consumer; a commit that group commit had not yet made durable is lost in a crash
/// of the server, found from outside: counted still, it made good jobs dead letters after
/// one kill). What stays counted is the transactions in which a process died,
/// and a job over `--max-deliveries` is a poison message only when that is as many as the
/// limit (found from outside: counted once per try before its transaction, jobs held
/// through a PostgreSQL outage, or waiting in their worker behind a set that a poison
/// message killed, became dead letters after one or two real starts). A job that started
/// before and was not seen to end runs alone, so that a poison message takes no other
/// job of a set with it. Without Redis the jobs run all the same, uncounted: Redis being
/// away must not stop jobs it already handed over (their acknowledgements wait); after a
/// failure it counts again only [`COUNT_STARTS_PAUSE`] later, so that a Redis that stalls
/// holds up one transaction, not each.
struct StartCount<'w> {
    redis: &'w mut Option<crate::store::Con>,
    target: &'w crate::store::Redis,
    shards: &'w [Keys],
    after: &'w mut Option<Instant>,
    /// The [`store::starts_field`]s of the jobs that run alone.
    alone: HashSet<String>,
    /// Whether the transaction now running had its jobs counted.
    counted: bool,
}

impl<'w> StartCount<'w> {
    /// Reads the starts of those of `jobs` delivered before: the ones counted run alone.
    fn new(
        redis: &'w mut Option<crate::store::Con>,
        target: &'w crate::store::Redis,
        shards: &'w [Keys],
        after: &'w mut Option<Instant>,
        jobs: &[Job<'_>],
    ) -> StartCount<'w> {
        let mut count = StartCount {
            redis,
            target,
            shards,
            after,
            alone: HashSet::new(),
            counted: false,
        };
        let before = Self::before(jobs);
        if let Some(counts) = count.change(&before, 0) {
            count.alone = before
                .iter()
                .zip(counts)
                .filter(|(_, n)| n.is_some_and(|n| n > 0))
                .map(|(d, _)| store::starts_field(d))
                .collect();
        }
        count
    }

    /// [`store::started`] on the worker's connection; `None` when Redis could not answer.
    fn change(&mut self, ds: &[&Delivery], delta: i64) -> Option<Vec<Option<u64>>> {
        if ds.is_empty() || self.after.is_some_and(|t| Instant::now() < t) {
            return None;
        }
        let counted = match connected(self.redis, self.target) {
            Some(con) => store::started(con, self.shards, ds, delta).map_err(|e| e.to_string()),
            None => Err("Redis cannot be reached".to_string()),
        };
        match counted {
            Ok(counts) => Some(counts),
            Err(e) => {
                log::debug!("cannot count the starts of {} jobs: {e}", ds.len());
                *self.redis = None;
                *self.after = Some(Instant::now() + COUNT_STARTS_PAUSE);
                None
            }
        }
    }

    /// The deliveries of those of `jobs` delivered before: the ones whose starts count.
    fn before<'j, 'h: 'j>(jobs: impl IntoIterator<Item = &'j Job<'h>>) -> Vec<&'j Delivery> {
        jobs.into_iter()
            .filter(|j| j.d.redelivered)
            .map(|j| &j.d)
            .collect()
    }
}

impl session::Starts for StartCount<'_> {
    fn alone(&self, job: &Job<'_>) -> bool {
        job.d.redelivered
            && !self.alone.is_empty()
            && self.alone.contains(&store::starts_field(&job.d))
    }

    fn begin(&mut self, jobs: &[&Job<'_>]) {
        let ds = Self::before(jobs.iter().copied());
        self.counted = self.change(&ds, 1).is_some();
    }

    fn end(&mut self, jobs: &[&Job<'_>]) {
        if std::mem::take(&mut self.counted) {
            let ds = Self::before(jobs.iter().copied());
            self.change(&ds, -1);
        }
    }
}

/// A worker's Redis connection, connected now if it has none; `None` when Redis cannot be
/// reached.
fn connected<'c>(
    redis: &'c mut Option<crate::store::Con>,
    target: &crate::store::Redis,
) -> Option<&'c mut crate::store::Con> {
    if redis.is_none() {
        *redis = Some(store::connect(target).ok()?);
    }
    redis.as_mut()
}

/// Delay before retry number `retry + 1`: base * 2^retry, capped.
pub fn retry_delay(jobs: &JobConfig, retry: u32) -> Duration {
    jobs.retry_base
        .saturating_mul(1u32 << retry.min(20))
        .min(jobs.retry_cap)
}

/// Delay before the next try of a job that met contention: [`retry_delay`] capped at
/// [`CONTENTION_CAP`], spread by a quarter either way so that jobs held up by one lock do
/// not all come back at once.
pub fn contention_delay(jobs: &JobConfig, retry: u32) -> Duration {
    let d = retry_delay(jobs, retry).min(CONTENTION_CAP);
    d.mul_f64(0.75 + fastrand::f64() * 0.5)
}

/// Tells the operator of the jobs waiting on contention as of `now` (a warning naming the
/// one that waited longest), critical while a queue of `events` stands still (no job of it
/// has changed anything for [`crate::stats::CONTENTION_STALL`]). Called at each retry
/// on contention with its job's event, and every second by [`watch_contention`]. `now` is
/// on the Redis clock (as the waiters' times), `local` the same moment on this host's.
fn report_contention<'e>(
    stats: &Stats,
    events: impl IntoIterator<Item = &'e str>,
    (now, local): (i64, i64),
    jobs: &JobConfig,
) {
    let retry_for = jobs.retry_for;
    let (waiting, longest, lock_wait) = stats
        .contention
        .summary_with_lock_wait(now, jobs.max_retries);
    let Some(w) = longest else {
        return;
    };
    let what = format!(
        "{waiting} job(s) wait on contention (other transactions' locks, statement timeouts); the longest, {} {}, for {}: {}",
        w.event,
        w.key,
        crate::human_ms(now - w.since_ms),
        w.reason
    );
    // Logged when the longest waiter or its reason changes, else every 30 s: the count and
    // the time change at every retry.
    let gist = format!("{} {}: {}", w.event, w.key, w.reason);
    // Measured from the last job of the event that changed something: a rule that stops
    // every cancellation while paid orders' no-ops pass is a standstill too.
    let still = events.into_iter().find_map(|event| {
        let applied = stats.jobs.applied_ms(event);
        Some((event, stats.contention.standing_still(applied, local)?))
    });
    match still {
        Some((event, idle)) => {
            let what = format!(
                "no job of {event} has changed anything for {}: {what}",
                crate::human_ms(idle.as_millis() as i64)
            );
            stats.contention.standstill.store(true, Ordering::Relaxed);
            if stats.report_critical_about(CONTENTION, what.clone(), gist + " (still)") {
                log::error!("{what}");
            }
        }
        None => match lock_wait {
            // A job waiting for a lock past `--retry-for` (and `--max-retries`, so that a
            // job of a backlog long overdue is not told at its first lock) is told as
            // critical, since it is never a dead letter: the operator ends the lock (or
            // lets it end).
            Some(l) if now - l.since_ms >= retry_for.as_millis() as i64 => {
                let what = format!(
                    "{} {} has waited {} for another transaction's lock, past --retry-for {} (it waits on, never a dead letter; {waiting} job(s) wait on contention): {}",
                    l.event,
                    l.key,
                    crate::human_ms(now - l.since_ms),
                    crate::human_ms(retry_for.as_millis() as i64),
                    l.reason
                );
                // Logged again early only for another job: its reason names the holder
                // at one retry and not at the next.
                let gist = format!("{} {} (past --retry-for)", l.event, l.key);
                if stats.report_critical_about(CONTENTION, what.clone(), gist) {
                    log::error!("{what}");
                }
            }
            _ => {
                if stats.report_trouble_about(CONTENTION, what.clone(), gist) {
                    log::warn!("{what}");
                }
            }
        },
    }
}

/// The contention report between retries, every second (the supervisor's): a standstill is
/// told when it comes, not at the next retry, which the backoff (and a `--max-rate` that
/// brings retries back late) may put a minute away (found from outside: `/healthz` stayed
/// 200 for 52 s under a table lock that stopped every job of a capped drain). `local` is
/// this host's time.
pub fn watch_contention(stats: &Stats, local: i64, jobs: &JobConfig) {
    let now = stats.clock.at(local);
    let events = stats.contention.events(now);
    if !events.is_empty() {
        report_contention(stats, events.iter().map(String::as_str), (now, local), jobs);
    }
}

pub struct Worker<'a> {
    name: String,
    index: usize,
    ctx: &'a PoolContext<'a>,
    /// The handlers this worker runs, of `generation` of [`PoolContext::handlers`].
    registry: Arc<Registry>,
    generation: u64,
    session: Option<Session>,
    /// Group commit: jobs committed on `session` since its last WAL flush.
    unflushed: bool,
    /// A job met a schema fault on this session: it is replaced at the next batch with
    /// nothing left to flush, at most every [`SESSION_RENEW_EVERY`] (when it was last:
    /// `renewed_at`), so that a fix to the role's settings (`ALTER ROLE ... RESET role`)
    /// reaches the workers, which see them only on a new session.
    renew_session: bool,
    renewed_at: Option<Instant>,
    /// Group commit: this worker's row in `worker_flush` (`<consumer>/<index>`).
    flush_slot: String,
    /// Group commit: a session with unflushed commits was lost, so those commits may be
    /// too (a crashed server forgets them); their acks must not go out as acks.
    durability_lost: bool,
    /// Group commit: when this worker last found `worker_flush` refused to it, its
    /// flushes going around the table since ([`Worker::flush`],
    /// [`Worker::recheck_flush_table`]).
    flushed_around: Option<Instant>,
    redis: Option<crate::store::Con>,
    /// Starts are not counted before then: Redis failed to count the last ones.
    count_starts_after: Option<Instant>,
    /// Outcomes a settle left where they were because a key they go to holds another
    /// type: tried again every [`HELD_RETRY`] until it is fixed. At shutdown they stay
    /// pending (or in the processing list) for the next start.
    held: Vec<Settlement>,
    held_tried: Option<std::time::Instant>,
    /// When this worker last kept up while pacing under a `--max-rate`
    /// ([`Worker::keep_up`]).
    kept_at: Instant,
    db_backoff: Backoff,
    redis_backoff: Backoff,
}

/// What became of jobs [`Worker::run_paced`] was given.
enum Paced {
    Ran(Vec<JobResult>),
    /// Their slots went by before a session could be had: they take new ones.
    Late,
    /// Shutdown came while the database was unreachable: left pending.
    Stopped,
}

/// How far ahead of now a worker books `--max-rate` slots in the fleet's schedules
/// ([`store::take_slots`]): no further, so that a process stopped while its workers wait
/// leaves no more of the cap unused (under 6/m, 8 workers that booked a slot each left the
/// next start waiting 100 s), and a schedule lost meanwhile (its key deleted by hand, a
/// Redis without it) lets no more run beside the slots booked before: with 1 s, three
/// processes under 40/s ran 80–120 jobs a second for a second after each `DEL`.
const BOOK_AHEAD: Duration = Duration::from_millis(250);

/// How long after its slots a paced share may still run ([`Paced::Late`]): the burst a
/// cap lets through at once.
const LATE_FOR_SLOTS: Duration = crate::manners::BURST;

impl<'a> Worker<'a> {
    pub fn new(index: usize, ctx: &'a PoolContext<'a>) -> Worker<'a> {
        let name = format!("worker-{index}");
        let (registry, generation) = ctx.handlers.current();
        Worker {
            registry,
            generation,
            db_backoff: Backoff::with_cap(&name, DB_BACKOFF_CAP),
            redis_backoff: Backoff::new(&name),
            name,
            index,
            ctx,
            session: None,
            unflushed: false,
            renew_session: false,
            renewed_at: None,
            flush_slot: format!("{}/{index}", ctx.consumer),
            durability_lost: false,
            flushed_around: None,
            redis: None,
            count_starts_after: None,
            held: Vec::new(),
            held_tried: None,
            kept_at: Instant::now(),
        }
    }

    /// At start, when a job of each event last changed something in any process, within
    /// [`CONTENTION_STALL`], as the inbox says: a process started while the others stand
    /// still behind a lock counts the standstill from that change, not from its own start
    /// (with [`crate::stats::Contention::began_by`] of the lock waiters it finds in the
    /// pool), and one started while they go through does not take their queue for one
    /// standing still.
    fn last_changes(&mut self) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let within = CONTENTION_STALL.as_millis() as i64;
        for event in self.registry.events() {
            match session.applied_within(event, within) {
                Ok(Some(age)) => self.ctx.stats.jobs.applied_at(event, crate::now_ms() - age),
                Ok(None) => {}
                Err(e) => log::debug!(
                    "cannot ask the inbox when a job of {event} last changed something: {}",
                    db::error_text(&e)
                ),
            }
        }
    }

    /// Closes the database session (broken, or mid-transaction after a panic): its
    /// connection is thrown away, never handed back to the pool.
    fn drop_session(&mut self) {
        if self.unflushed {
            self.durability_lost = true;
            self.unflushed = false;
        }
        if let Some(s) = self.session.take() {
            s.discard();
        }
    }

    /// Group commit: before acks go out, the commits behind them must be durable. One WAL
    /// flush covers them all. If that cannot be confirmed (the session, or the server, was
    /// lost since), each ack becomes a re-queue of its message, due now: if the commit
    /// survived, the inbox makes the second run a no-op; if not, the job runs again.
    fn make_durable(&mut self, outcomes: &mut [Settlement]) {
        // The operator's refusal (no grant on either way to flush): the jobs come back
        // after a hold, not at once (found from outside: about 7,000 deliveries a second).
        let mut refused = false;
        if self.unflushed {
            let flushed = self.flush(outcomes);
            self.unflushed = false;
            let stats = self.ctx.stats;
            match flushed {
                Ok(Flushed::OnItsTable) => durable_again(stats),
                Ok(Flushed::ByTheInbox) => {}
                Err((e, fault)) => {
                    // A refused privilege or a missing table: every job's ack waits for the
                    // operator, so health is red naming it (the jobs run again meanwhile,
                    // and their inbox rows make the second runs no-ops).
                    if fault == db::Fault::Schema {
                        refused = true;
                        let what = format!(
                            "cannot confirm that commits are durable: {e}: neither \
                             worker_flush nor the inbox's outcome can be written, so every \
                             job runs again until one can (run sql/grants.sql)"
                        );
                        if stats.report_critical(GROUP_COMMIT, what.clone()) {
                            log::error!("{GROUP_COMMIT}: {what}");
                        }
                    }
                    log::warn!(
                        "{}: cannot confirm that commits are durable: {e}",
                        self.name
                    );
                    if let Some(s) = self.session.take() {
                        s.discard();
                    }
                    self.durability_lost = true;
                }
            }
        }
        if !self.durability_lost {
            return;
        }
        self.durability_lost = false;
        let doubtful: Vec<usize> = (0..outcomes.len())
            .filter(|&i| outcomes[i].is_ack())
            .collect();
        if doubtful.is_empty() {
            return;
        }
        let survived = self.survived(outcomes, &doubtful);
        let now = self.ctx.stats.clock.now_ms();
        let mut n = 0;
        for i in doubtful.into_iter().filter(|i| !survived.contains(i)) {
            let s = &mut outcomes[i];
            s.outcome = Outcome::Retry {
                msg: self.requeue_message(s),
                due_ms: match refused {
                    true => now + SCHEMA_HOLD.as_millis() as i64,
                    false => now,
                },
            };
            s.counts_as = Some(JobOutcome::Retry);
            n += 1;
        }
        if n > 0 {
            log::warn!(
                "{}: {n} jobs go back to the delay pool instead of being acknowledged: their commits may not have survived",
                self.name
            );
        }
    }

    /// The WAL flush of group commit, waited for while it meets contention. A lock on
    /// `worker_flush` (a migration, an operator's `LOCK TABLE`) or a statement timeout
    /// holds this worker's acknowledgements, and they wait with it, critical and naming
    /// the holder, instead of going round the pool as re-queues of jobs that committed
    /// (found from outside: about 900 deliveries a second while a lock lasted 40 s, health
    /// green). While it waits, the stream entries of `held` (the outcomes waiting for it)
    /// are claimed again every [`Worker::keep_up_every`], so that no peer takes them for
    /// stuck after `--claim-idle` and runs them again. Shutdown ends the wait: the acks
    /// then go back as re-queues, as after any flush that was not confirmed.
    ///
    /// A `worker_flush` the worker may not write (its grant lost, the table gone) is
    /// flushed around: the same wait made by updating a row of the inbox to itself
    /// ([`db::flush_wal_by_inbox`]), critical naming the table meanwhile. Found from
    /// outside: each ack became a re-queue due at once, 83,469 deliveries for 2,000 jobs
    /// in 20 s of a revoked grant, about 1,450 transactions a second beside the shop.
    fn flush(&mut self, held: &[Settlement]) -> Result<Flushed, (String, db::Fault)> {
        let Some(mut session) = self.session.take() else {
            return Err(("no session".to_string(), db::Fault::Server));
        };
        let (stats, shutdown) = (self.ctx.stats, self.ctx.shutdown);
        // The table found refused lately: straight around it, not a refused statement and
        // its rollback first at every flush; it is tried again every FLUSH_RECHECK.
        if self
            .flushed_around
            .is_some_and(|at| at.elapsed() < FLUSH_RECHECK)
            && db::flush_wal_by_inbox(session.client()).is_ok()
        {
            self.session = Some(session);
            return Ok(Flushed::ByTheInbox);
        }
        let mut pause = FLUSH_RETRY_FIRST;
        let mut claimed = Instant::now();
        let result = loop {
            let e = match db::flush_wal(session.client(), &self.flush_slot) {
                Ok(()) => {
                    self.flushed_around = None;
                    break Ok(Flushed::OnItsTable);
                }
                Err(e) => e,
            };
            let fault = db::classify(&e);
            if fault == db::Fault::Schema {
                let around = session
                    .client()
                    .batch_execute("ROLLBACK")
                    .and_then(|()| db::flush_wal_by_inbox(session.client()));
                if around.is_ok() {
                    flushed_around(stats, &e);
                    self.flushed_around = Some(Instant::now());
                    break Ok(Flushed::ByTheInbox);
                }
            }
            if fault != db::Fault::Contention || shutdown.is_set() {
                break Err((db::error_text(&e), fault));
            }
            if let Err(r) = session.client().batch_execute("ROLLBACK") {
                break Err((db::error_text(&r), db::classify(&r)));
            }
            let mut what = format!(
                "acknowledgements wait: the WAL flush of group commit on worker_flush meets {}",
                db::error_text(&e)
            );
            if let Some(holder) = session.holder_of(&e) {
                what = format!("{what}: {holder}");
            }
            let gist = "acknowledgements wait for the WAL flush on worker_flush".to_string();
            if stats.report_critical_about(GROUP_COMMIT, what.clone(), gist) {
                log::error!("{GROUP_COMMIT}: {what}");
            }
            if shutdown.wait(pause) {
                break Err((db::error_text(&e), fault));
            }
            pause = (pause * 2).min(FLUSH_RETRY_CAP);
            self.keep_settlements_claimed(held, &mut claimed);
        };
        self.session = Some(session);
        result
    }

    /// Which of the acks at `doubtful` (their commits' durability unconfirmed) stand for
    /// a job whose inbox row is there and durable: on a new session, one WAL flush (which
    /// makes every commit visible to it durable), then one look-up of their inbox rows.
    /// Those stay acks, so a job that committed is never also sent round again (where a
    /// newer push of its key would turn it into a dead letter). While PostgreSQL cannot be
    /// reached or asked, it waits, as a job does. Empty when a stop ends that wait, or the
    /// look-up fails for another reason (a refused privilege): then every doubtful ack
    /// goes back to the pool, and the inbox makes the second run of a job that had
    /// committed a no-op.
    fn survived(&mut self, outcomes: &[Settlement], doubtful: &[usize]) -> HashSet<usize> {
        let survived = self.look_up_survivors(outcomes, doubtful);
        if self.ctx.stats.clear_problem(ACKS_WAIT, i64::MAX) {
            log::info!("{ACKS_WAIT}: the commits behind them are looked up");
        }
        survived
    }

    /// [`Worker::survived`]'s look-up, critical under [`ACKS_WAIT`] while it waits.
    fn look_up_survivors(&mut self, outcomes: &[Settlement], doubtful: &[usize]) -> HashSet<usize> {
        let ids: Vec<(usize, InboxId)> = doubtful
            .iter()
            .filter_map(|&i| Some((i, self.inbox_id(&outcomes[i])?)))
            .collect();
        let what = "cannot look up whether commits survived";
        let stats = self.ctx.stats;
        let lost = "their session was lost before a WAL flush";
        unconfirmed(stats, doubtful.len(), &lost);
        let mut claimed = Instant::now();
        loop {
            // A server that cannot be asked now (restarting, its sessions ended) is waited
            // for, as a job waits for it, the entries kept claimed meanwhile: asked once,
            // a restart or a second lost session sent every ack round (found from outside
            // with worker_flush locked across them: 300 of 300 re-queued). A stop ends
            // the wait.
            self.keep_settlements_claimed(outcomes, &mut claimed);
            if let Err(e) = self.ensure_session() {
                unconfirmed(stats, doubtful.len(), &e);
                if self.wait_for_database(what, &e) {
                    return HashSet::new();
                }
                continue;
            }
            // The flush waits out contention as `make_durable`'s does: a lock on
            // worker_flush met here sent every job round again.
            let found = self.flush(outcomes).and_then(|flushed| {
                // A flush went through, though no job may be left to commit and flush on
                // the way of `make_durable`.
                if flushed == Flushed::OnItsTable {
                    durable_again(self.ctx.stats);
                }
                let session = self.session.as_mut().expect("the flush keeps its session");
                session::inbox_rows(session.client(), ids.iter().map(|(_, id)| id))
                    .map_err(|e| (db::error_text(&e), db::classify(&e)))
            });
            match found {
                Ok(found) => {
                    return ids
                        .into_iter()
                        .filter(|(_, id)| found.contains(id))
                        .map(|(i, _)| i)
                        .collect()
                }
                Err((e, fault)) => {
                    self.drop_session();
                    if fault == db::Fault::Server && !self.ctx.shutdown.is_set() {
                        unconfirmed(stats, doubtful.len(), &e);
                        if self.wait_for_database(what, &e) {
                            return HashSet::new();
                        }
                        continue;
                    }
                    log::warn!("{}: {what}: {e}", self.name);
                    return HashSet::new();
                }
            }
        }
    }

    /// The inbox key of a settlement's job, as its inbox insert wrote it.
    fn inbox_id(&self, s: &Settlement) -> Option<InboxId> {
        inbox_id(self.ctx.keys, &s.origin, &s.key, &s.msg)
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
        // The session (a connection, every statement prepared) is opened now, not for the
        // first job: a worker just started that meets a backlog would otherwise fork and
        // prepare all its backends at once, in the backlog's first half second, beside the
        // shop's own transactions (docs/performance.md, "The shop beside a drain"). One
        // that cannot be opened now is opened for the first job, as after an outage.
        if let Ok(s) = Session::open(self.ctx.db, &self.registry, self.ctx.jobs.lock_timeout) {
            self.session = Some(s);
            if self.index == 0 {
                self.last_changes();
            }
        }
        let mut outcomes: Vec<Settlement> = Vec::with_capacity(ACK_BATCH);
        let gather = self.ctx.jobs.take_size_under(self.ctx.manners);
        let capped = self.ctx.manners.capped();
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
                            self.settle(&mut outcomes);
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
                let more = if capped {
                    rx.try_recv_read().or_else(|_| rx.try_recv())
                } else {
                    rx.try_recv()
                };
                match more {
                    Ok(more) => batch.extend(more),
                    Err(_) => break,
                }
            }
            // A full channel's reader waits for this; a token already there is enough.
            let _ = space.try_send(());
            // What the drain ran and left is counted where the jobs run
            // (`run_in_database`), so a batch whose first shares ran before the stop
            // counts only the rest.
            self.handle_batch_sharing(batch, &mut outcomes, Some(rx));
            let draining = self.ctx.shutdown.is_set();
            // A lost session's doubtful acks are settled at once, before jobs committed
            // on the next session join them; so is everything while draining. (A batch
            // that waits long for its `--max-rate` slots settles those in hand on the way:
            // `run_in_database`.)
            let now = Instant::now();
            if outcomes.len() >= ACK_BATCH
                || self.durability_lost
                || draining
                || settle_by.is_some_and(|at| now >= at)
            {
                self.settle(&mut outcomes);
                settle_by = None;
            } else if !outcomes.is_empty() && settle_by.is_none() {
                settle_by = Some(now + ACK_HOLD);
            }
        }
        self.settle(&mut outcomes);
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
            if self.held.is_empty() && self.flushed_around.is_none() {
                return rx.recv().ok();
            }
            let wait = match self.held.is_empty() {
                true => FLUSH_RECHECK,
                false => HELD_RETRY,
            };
            match rx.recv_timeout(wait) {
                Ok(d) => return Some(d),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {
                    self.settle(outcomes);
                    self.recheck_flush_table();
                }
            }
        }
    }

    /// A worker whose flushes went around `worker_flush` and that has no job tries the
    /// table again: green once it can be written, red told again while it cannot (found
    /// from outside: red for a minute after the last job, then green with the grant still
    /// missing).
    fn recheck_flush_table(&mut self) {
        if self.flushed_around.is_none() {
            return;
        }
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let stats = self.ctx.stats;
        match db::flush_wal(session.client(), &self.flush_slot) {
            Ok(()) => {
                self.flushed_around = None;
                durable_again(stats);
            }
            Err(e) => {
                let _ = session.client().batch_execute("ROLLBACK");
                if db::classify(&e) == db::Fault::Schema {
                    flushed_around(stats, &e);
                    self.flushed_around = Some(Instant::now());
                }
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
    /// `out`. Jobs that need the database run together when there are several (sets,
    /// `--tx-batch`: see [`Session::run`]); a delivery is missing from `out` only when the
    /// database stayed unreachable until shutdown.
    pub fn handle_batch(&mut self, ds: Vec<Delivery>, out: &mut Vec<Settlement>) {
        self.handle_batch_sharing(ds, out, None)
    }

    /// [`Worker::handle_batch`], giving back to `pool` the jobs this worker would run one
    /// transaction after another (see [`Worker::share`]).
    fn handle_batch_sharing(
        &mut self,
        ds: Vec<Delivery>,
        out: &mut Vec<Settlement>,
        pool: Option<&crate::delivery::Take>,
    ) {
        if self.ctx.handlers.generation() != self.generation {
            // A reload: the new handlers, prepared on the same connection (its commits
            // not yet flushed stay this session's).
            (self.registry, self.generation) = self.ctx.handlers.current();
            if let Some(s) = self.session.as_mut() {
                if let Err(e) = s.reprepare(&self.registry) {
                    log::warn!("{}: preparing the reloaded handlers: {e}", self.name);
                    self.drop_session();
                }
            }
        }
        let registry = self.registry.clone();
        let ds = self.drop_taken_over(ds);
        let mut jobs = Vec::with_capacity(ds.len());
        for d in ds {
            match self.prepare(&registry, d) {
                Ok(job) if job.handler.needs_database() && !self.may_run(&job) => {
                    out.push(self.held_back(job))
                }
                Ok(job) if job.handler.needs_database() => jobs.push(job),
                Ok(job) => {
                    let result = JobResult::Committed(Effect::NoOp);
                    out.extend(self.finish(job, result, crate::now_ms()))
                }
                Err(dead) => out.push(*dead),
            }
        }
        self.ctx
            .stats
            .contention
            .taken(jobs.iter().map(|j| j.key.as_str()));
        if let Some(pool) = pool {
            jobs = self.share(jobs, pool);
        }
        if jobs.is_empty() {
            return;
        }
        let results = self.run_in_database(&jobs, out, pool);
        let left = jobs.len() - results.len();
        if left > 0 {
            self.ctx
                .drain
                .left
                .fetch_add(left as u64, Ordering::Relaxed);
        }
        // Those without a result stay pending: the next start delivers them again.
        for (job, (result, at)) in jobs.into_iter().zip(results) {
            out.extend(self.finish(job, result, at));
        }
    }

    /// Whether a job may go to the database now: a job that was sent back before (it
    /// carries its last error) waits untried while its event is held, save one probe at a
    /// time ([`crate::stats::Metrics::may_run_held`]) and one whose `--retry-for` has
    /// passed (it is decided).
    fn may_run(&self, job: &Job<'_>) -> bool {
        let stats = self.ctx.stats;
        if job.env.last_error().is_none() {
            return true;
        }
        let local = crate::now_ms();
        let event = &job.env.event;
        // Held elsewhere or before a restart, and nothing here has changed anything since it
        // failed: this process holds the event too, rather than learn it job by job.
        // It says so at once, as the process that held it did (a restarted one too).
        if let Some(held_at) = job.env.held_at() {
            let failed_at = job.env.failed_at().unwrap_or(held_at);
            if stats.clock.at(stats.jobs.applied_ms(event)) < failed_at {
                self.held_for_refusal(event, job.env.last_error().unwrap_or_default());
            }
        }
        if stats.jobs.may_run_held(event, local) {
            return true;
        }
        let now = stats.clock.now_ms();
        let waited = now - job.first_due.unwrap_or(now);
        waited >= self.ctx.jobs.retry_for.as_millis() as i64
    }

    /// A job [`Worker::may_run`] keeps from the database: back for [`SCHEMA_HOLD`] as it
    /// came (its last error, when it failed), no retry spent, counted as held.
    fn held_back(&self, job: Job<'_>) -> Settlement {
        let now = self.ctx.stats.clock.now_ms();
        let Job {
            d,
            mut env,
            first_due,
            ..
        } = job;
        // Held with its event for a refusal of every job: the surroundings' fault until
        // proof says otherwise, in this process or the next that meets it. (Held for a
        // schema fault, it is not marked: any job that goes through ends that.)
        if self.ctx.stats.jobs.held_by_refusal(&env.event) {
            env.mark_held(now);
        }
        let failed = (
            env.last_error().unwrap_or_default(),
            env.failed_at().unwrap_or(now),
        );
        self.back_unspent(d, &env, first_due.unwrap_or(now), failed, SCHEMA_HOLD)
    }

    /// Keeps the jobs this worker runs together (sets, and one `--tx-batch` of the rest)
    /// and gives the others back to the pool, so that jobs of a handler without a set form
    /// that came in one read run on the idle workers side by side rather than one after
    /// another here (16 slow jobs due together once took 16 times one job on one worker
    /// while the others idled, and their acks waited for the last). Under a `--max-rate`,
    /// one share of the cap ([`crate::manners::Manners::share`]): a worker that held a
    /// whole batch paced it over many seconds, and its jobs' outcomes (the contention they
    /// met, what they changed) were known only at its end (health red 42 s into a
    /// standstill under 3/s, not 30). Not while draining: a worker that stops runs what
    /// it took.
    fn share<'h>(&mut self, jobs: Vec<Job<'h>>, pool: &crate::delivery::Take) -> Vec<Job<'h>> {
        let capped = self
            .ctx
            .manners
            .share(jobs.iter().map(|j| j.env.event.as_str()));
        let alone_max = self.ctx.jobs.tx_batch.max(1);
        let fits = jobs.len() <= alone_max && capped.is_none_or(|n| jobs.len() <= n);
        if fits || self.ctx.shutdown.is_set() {
            return jobs;
        }
        let sets = self.ctx.jobs.set_size > 1;
        let mut kept = Vec::with_capacity(jobs.len());
        let mut back = Vec::new();
        let mut alone = 0;
        for job in jobs {
            if sets && job.handler.has_set_form() {
                kept.push(job);
            } else if alone < alone_max {
                alone += 1;
                kept.push(job);
            } else {
                back.push(job.d);
            }
        }
        if let Some(n) = capped {
            // Jobs no cap applies to run now, ahead of one share of the capped ones: an
            // event's cap held the others behind it (coupons due with a backlog of
            // timeouts under `order.timeout=1/s` ran up to 29 s late, one after each
            // timeout).
            let manners = self.ctx.manners;
            let (free, mut paced): (Vec<Job<'h>>, Vec<Job<'h>>) = kept
                .into_iter()
                .partition(|j| manners.slowest_slots(&j.env.event).is_none());
            if paced.len() > n {
                back.extend(paced.drain(n..).map(|j| j.d));
                self.keep_claimed(&mut back);
            }
            kept = free;
            kept.append(&mut paced);
        }
        if !back.is_empty() {
            pool.give_back(back, capped.unwrap_or(alone_max));
        }
        kept
    }

    /// Stream entries this worker gives back to wait for their `--max-rate` slots, held
    /// for a quarter of `--claim-idle` or more: their idle time starts again
    /// ([`store::stream::keep_claimed`]), so that neither this process's reader nor a
    /// peer takes them back as a stuck consumer's and runs them twice (jobs of an event
    /// capped at 2/s fill the channel for a minute and more). Best effort: if Redis
    /// does not answer, they may be delivered again, and the inbox stops the second run.
    fn keep_claimed(&mut self, back: &mut [Delivery]) {
        // A quarter: the next look may come a rotation of the given-back jobs later.
        let due = self.ctx.claim_idle / 4;
        let stale: Vec<usize> = (0..back.len())
            .filter(|&i| {
                matches!(back[i].origin, Origin::Stream { .. }) && back[i].received.elapsed() >= due
            })
            .collect();
        if stale.is_empty() || !self.claim_again(stale.iter().map(|&i| &back[i])) {
            return;
        }
        let now = Instant::now();
        for i in stale {
            back[i].received = now;
        }
    }

    /// When jobs taking these slots may run: the slots are the fleet's, taken from the
    /// schedules every process of the prefix shares in Redis ([`store::take_slots`], on
    /// Redis's clock), so that a cap holds however many processes run; this process's own
    /// schedules while Redis does not answer (each process then keeps the cap by itself,
    /// and none runs anything it cannot acknowledge for long).
    /// `Err(when)` when the slots are further off than [`BOOK_AHEAD`]: nothing was booked,
    /// ask again then.
    fn take_slots(&mut self, takes: &[crate::manners::SlotTake<'_>]) -> Result<Instant, Instant> {
        let ctx = self.ctx;
        let asked = Instant::now();
        if let Some(con) = self.redis_now() {
            let rates = &ctx.shards[0].rates;
            match store::take_slots(con, rates, crate::manners::BURST, BOOK_AHEAD, takes) {
                Ok(slots) => {
                    if ctx.manners.fleet_s_again(asked) {
                        log::info!("--max-rate is the fleet's again");
                    }
                    return match slots {
                        // This process's own schedules are kept beside ([`Manners::take_here`]).
                        store::Slots::Booked(wait) => {
                            Ok(ctx.manners.take_here(takes, asked + wait))
                        }
                        store::Slots::NotYet(wait) => Err(asked + wait),
                    };
                }
                Err(e) => {
                    if ctx.manners.alone() {
                        log::warn!(
                            "--max-rate kept by this process alone until the fleet's schedules in Redis can be taken: {e}"
                        );
                    }
                    self.redis = None;
                }
            }
        }
        Ok(ctx.manners.take_here(takes, Instant::now()))
    }

    /// How often a pacing worker keeps up: a quarter of `--claim-idle` (so that no job it
    /// or its process holds is taken back as stuck), and a third of
    /// [`crate::stats::CONTENTION_FORGET`] (so that no job it holds that waits on
    /// contention is forgotten as another process's).
    fn keep_up_every(&self) -> Duration {
        (self.ctx.claim_idle / 4).min(crate::stats::CONTENTION_FORGET / 3)
    }

    /// What a worker pacing under a `--max-rate` does every [`Worker::keep_up_every`], so
    /// that no wait for slots makes a job look stuck, however low the cap (and no job
    /// waiting on contention is forgotten while this process holds it,
    /// [`crate::stats::Contention::held`]): it settles the
    /// outcomes in hand (held back for the next acknowledgement, an outcome of a job run
    /// before a wait of seconds was taken back after `--claim-idle` and its job delivered
    /// again), claims the jobs it holds again, and so the deliveries waiting in `pool` for
    /// a worker once they have waited a quarter of `--claim-idle` ([`Worker::keep_claimed`]),
    /// the reader's and those given back (when every worker paces, nothing else takes them:
    /// under a cap whose slots were seconds apart, the read-ahead waited past
    /// `--claim-idle` and was delivered again). Those go back in chunks of `chunk`, ahead
    /// of the reader's, still counted against its room.
    fn keep_up(
        &mut self,
        outcomes: &mut Vec<Settlement>,
        held: &[Job<'_>],
        pool: Option<&crate::delivery::Take>,
        chunk: usize,
    ) {
        self.kept_at = Instant::now();
        self.settle(outcomes);
        let contention = &self.ctx.stats.contention;
        let until = crate::now_ms() + self.keep_up_every().as_millis() as i64;
        contention.held(held.iter().map(|j| j.key.as_str()), until);
        self.claim_again(held.iter().map(|j| &j.d));
        if let Some(pool) = pool {
            pool.rotate(chunk, |waiting| {
                contention.held(waiting.iter().map(|d| key_text(&d.key)), until);
                self.keep_claimed(waiting)
            });
        }
    }

    /// Claims these stream entries to this consumer again, their idle time started anew
    /// ([`store::stream::keep_claimed`]); list copies need nothing (a live consumer's
    /// processing list is never taken back). `false` when Redis did not answer.
    fn claim_again<'d>(&mut self, held: impl Iterator<Item = &'d Delivery> + Clone) -> bool {
        self.claim_entries(held.map(|d| (d.shard, &d.origin)))
    }

    /// The stream entries of outcomes waiting for PostgreSQL (their acks, retries and
    /// letters not yet settled) claimed again once [`Worker::keep_up_every`] has passed
    /// since `claimed`, so that no peer takes them for stuck.
    fn keep_settlements_claimed(&mut self, held: &[Settlement], claimed: &mut Instant) {
        if claimed.elapsed() >= self.keep_up_every() {
            *claimed = Instant::now();
            self.claim_entries(held.iter().map(|s| (s.shard, &s.origin)));
        }
    }

    /// Which of `ds` this consumer still owns, asked of Redis: a stream entry by claiming
    /// it again ([`store::stream::keep_claimed`]: its idle time starts again), a list
    /// message by finding it in this consumer's processing list
    /// ([`store::list::still_held`]). One a peer took over while this process had no
    /// usable PostgreSQL (its reader said so), or settled since, is not: run here too, a
    /// job dead-lettered meanwhile would also be done (found from outside: a letter for
    /// too many deliveries, then the held copy cancelled the order; in list mode, every
    /// message a peer pushed back ran again here). `None` when Redis does not answer: then
    /// all run, and the inbox stops a second run.
    fn still_owned(&mut self, ds: &[&Delivery]) -> Option<Vec<bool>> {
        let (shards, consumer) = (self.ctx.shards, self.ctx.consumer);
        let con = self.redis_now()?;
        let mut owned: HashSet<(usize, String)> = HashSet::new();
        let mut held: Vec<Option<bool>> = vec![None; ds.len()];
        for (shard, keys) in shards.iter().enumerate() {
            let ids: Vec<&str> = ds
                .iter()
                .filter(|d| d.shard == shard)
                .filter_map(|d| d.stream_id())
                .collect();
            let listed: Vec<(usize, (usize, &[u8]))> = ds
                .iter()
                .enumerate()
                .filter(|(_, d)| d.shard == shard)
                .filter_map(|(i, d)| match d.origin {
                    Origin::List { queue } => Some((i, (queue, d.msg.as_slice()))),
                    Origin::Stream { .. } => None,
                })
                .collect();
            let asked = (|| -> Result<(), StoreError> {
                if !ids.is_empty() {
                    let kept = store::stream::keep_claimed(con, keys, consumer, &ids)?;
                    owned.extend(kept.into_iter().map(|id| (shard, id)));
                }
                if !listed.is_empty() {
                    let msgs: Vec<(usize, &[u8])> = listed.iter().map(|(_, m)| *m).collect();
                    let still = store::list::still_held(con, keys, consumer, &msgs)?;
                    for ((i, _), s) in listed.iter().zip(still) {
                        held[*i] = Some(s);
                    }
                }
                Ok(())
            })();
            if let Err(e) = asked {
                log::debug!("{}: asking which held jobs are still ours: {e}", self.name);
                self.redis = None;
                return None;
            }
        }
        Some(
            ds.iter()
                .zip(held)
                .map(|(d, held)| match d.stream_id() {
                    Some(id) => owned.contains(&(d.shard, id.to_string())),
                    None => held.unwrap_or(true),
                })
                .collect(),
        )
    }

    /// Deliveries that waited in this process for [`HELD_LONG`] or more (in the channel
    /// while the workers waited for PostgreSQL) go to the database only if this consumer
    /// still owns them ([`Worker::still_owned`]); the others are left to whoever has them.
    fn drop_taken_over(&mut self, mut ds: Vec<Delivery>) -> Vec<Delivery> {
        let now = Instant::now();
        let is_old = |d: &Delivery| now.saturating_duration_since(d.received) >= HELD_LONG;
        let old: Vec<&Delivery> = ds.iter().filter(|d| is_old(d)).collect();
        if old.is_empty() {
            return ds;
        }
        let Some(owned) = self.still_owned(&old) else {
            return ds;
        };
        let gone = owned.iter().filter(|o| !**o).count();
        // Those still ours were claimed again just now: their idle time starts here.
        let mut verdicts = owned.into_iter();
        let mut keep = Vec::with_capacity(ds.len());
        for d in ds.iter_mut() {
            if is_old(d) {
                let ours = verdicts.next().unwrap_or(true);
                if ours {
                    d.received = now;
                }
                keep.push(ours);
            } else {
                keep.push(true);
            }
        }
        if gone > 0 {
            log::info!(
                "{}: {gone} jobs held here were taken over by a peer meanwhile (or settled); left to it",
                self.name
            );
            let mut keep = keep.into_iter();
            ds.retain(|_| keep.next().unwrap_or(true));
        }
        ds
    }

    /// [`Worker::claim_again`] of the entries at these origins, by shard.
    fn claim_entries<'o>(
        &mut self,
        held: impl Iterator<Item = (usize, &'o Origin)> + Clone,
    ) -> bool {
        let (shards, consumer) = (self.ctx.shards, self.ctx.consumer);
        let Some(con) = self.redis_now() else {
            return false;
        };
        for (shard, keys) in shards.iter().enumerate() {
            let ids: Vec<&str> = held
                .clone()
                .filter(|(s, _)| *s == shard)
                .filter_map(|(_, origin)| match origin {
                    Origin::Stream { id } => Some(id.as_str()),
                    Origin::List { .. } => None,
                })
                .collect();
            if ids.is_empty() {
                continue;
            }
            if let Err(e) = store::stream::keep_claimed(con, keys, consumer, &ids) {
                log::debug!("{}: keeping held entries claimed: {e}", self.name);
                self.redis = None;
                return false;
            }
        }
        true
    }

    /// A second delivery of a job whose transaction is running in a live worker's session
    /// (its inbox insert waited on that one's row): that transaction decides the job, and
    /// this delivery must not, or it could retry a job that then commits, and a retry that
    /// meets a newer push of the key becomes a dead letter of a job that was done. The
    /// stream entry is left pending: the running one settles it (both deliveries are the
    /// same entry), and if that one's worker dies first, the entry is reclaimed after
    /// `--claim-idle` and its inbox row decides. (Deliveries whose holder is gone, and list
    /// copies, were waited out and run again by the session; a list copy still waiting
    /// after the statement timeout is contention.)
    fn running_elsewhere(
        &mut self,
        d: Delivery,
        key: &str,
        env: &Envelope,
        first_due: Option<i64>,
    ) -> Option<Settlement> {
        match d.origin {
            Origin::Stream { .. } => {
                log::debug!(
                    "job {key} {}: running in another session (a second delivery), left to it",
                    env.event
                );
                None
            }
            Origin::List { .. } => {
                let f = Failure {
                    fault: Fault::Contention,
                    reason: "its job is running in another session".into(),
                    wait: None,
                    own_data: false,
                    stored_data: false,
                    cancelled: false,
                    shared: false,
                };
                Some(self.contended(d, env, key, first_due, &f, crate::now_ms()))
            }
        }
    }

    /// Decodes and validates a delivery: a job ready for its handler, or its dead letter.
    fn prepare<'r>(&self, registry: &'r Registry, d: Delivery) -> Result<Job<'r>, Box<Settlement>>
    where
        'a: 'r,
    {
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
        let Some((index, handler)) = registry.get(&env.event) else {
            let reason = Rejection::UnknownEvent(env.event.clone()).to_string();
            let attempts = env.retry as u64 + 1;
            return Err(Box::new(self.dead(d, reason, env.event, attempts)));
        };
        if let Err(r) = env.require(handler.required()) {
            let attempts = env.retry as u64 + 1;
            return Err(Box::new(self.dead(d, r.to_string(), env.event, attempts)));
        }
        let first_due = env.first_due.or(d.due_ms);
        let waited = first_due.map_or(0, |due| clock.now_ms() - due);
        let brief_for = (self.ctx.jobs.retry_for / 2).min(BRIEF_LOCKS_FOR);
        let young = waited < brief_for.as_millis() as i64;
        Ok(Job {
            key: key_text(&d.key),
            first_due,
            brief_lock: env.waited_lock() && young,
            young,
            consumer: self.ctx.consumer,
            clock: &self.ctx.stats.clock,
            d,
            env,
            index,
            handler,
        })
    }

    /// Turns a job's result, had at `at` (local ms), into its settlement: ack, retry with
    /// backoff, hold, or dead letter, by whose fault a failure is (see the module header);
    /// none for a stream entry whose job is running in another session.
    fn finish(&mut self, job: Job<'_>, result: JobResult, at: i64) -> Option<Settlement> {
        let stats = self.ctx.stats;
        let Job {
            d,
            env,
            key,
            first_due,
            handler,
            ..
        } = job;
        Some(match result {
            JobResult::Committed(effect) => {
                let outcome = match effect {
                    Effect::Applied => JobOutcome::Done,
                    Effect::NoOp => JobOutcome::NoOp,
                };
                // When it committed: a batch under a `--max-rate` is finished seconds
                // after its first shares ran.
                let now = stats.clock.at(at);
                stats.jobs.lateness(first_due, now);
                // Refused before and through now: that refusal comes and goes.
                if let (Some(_), Some(error)) = (env.refused_at(), env.last_error()) {
                    let gist = refusal_gist(error);
                    if stats.jobs.refusal_lapsed(&env.event, &gist, at) {
                        self.record_lapse(&env.event, &gist);
                    }
                }
                self.went_through(
                    &key,
                    &env.event,
                    effect == Effect::Applied,
                    env.last_error().is_some(),
                    at,
                );
                if log::log_enabled!(log::Level::Debug) {
                    let what = match effect {
                        Effect::Applied => "done",
                        Effect::NoOp => "no-op (nothing to change)",
                    };
                    let late = first_due
                        .map(|due| format!(", {} after its due time", crate::human_ms(now - due)))
                        .unwrap_or_default();
                    log::debug!("job {key} {}: {what}{late}", env.event);
                }
                Settlement::ack(d, &env.event, outcome)
            }
            JobResult::Duplicate => {
                self.went_through(&key, &env.event, false, env.last_error().is_some(), at);
                log::debug!("job {key} {}: duplicate (already in the inbox)", env.event);
                Settlement::ack(d, &env.event, JobOutcome::Duplicate)
            }
            JobResult::Failed(f) => match f.fault {
                // A data exception that names no value: the shop's stored data as
                // likely as the job's.
                Fault::Job if f.stored_data => {
                    self.held_for_stored_data(d, &env, &key, first_due, &f)
                }
                Fault::Job => self.own_fault(d, &env, &key, first_due, &f),
                Fault::Contention => self.contended(d, &env, &key, first_due, &f, at),
                // Server faults come here only if shutdown cut the wait for a new
                // connection short; they are held like the schema's.
                Fault::Schema | Fault::Server => {
                    if f.fault == Fault::Schema
                        && self
                            .renewed_at
                            .is_none_or(|t| t.elapsed() >= SESSION_RENEW_EVERY)
                    {
                        self.renew_session = true;
                    }
                    self.hold(d, &env, &key, first_due, &f, handler.source())
                }
            },
            JobResult::Panicked(msg) => {
                // The connection may be mid-transaction: start afresh.
                self.drop_session();
                let reason = format!("handler panicked: {msg}");
                self.dead(d, reason, env.event.clone(), env.retry as u64 + 1)
            }
            JobResult::RunningElsewhere => return self.running_elsewhere(d, &key, &env, first_due),
            JobResult::TakenOver => {
                log::debug!(
                    "job {key} {}: taken over by a peer while this worker waited for PostgreSQL, left to it",
                    env.event
                );
                return None;
            }
        })
    }

    /// A job of `event` committed at `at` (local ms; or was already in the inbox;
    /// `applied`: it changed something): it waits on contention no more; if it had been
    /// sent back before (`was_back`), its event is no longer held by a schema fault; if it
    /// changed something, nor by a refusal of every job. A job that was never sent back
    /// proves nothing of the held ones: a refused privilege that only some jobs need (the
    /// inbox's `outcome`, which only paid orders' no-ops write) held those while the
    /// others committed, and each commit turned health green between two holds (found
    /// from outside: `stats --check` OK in 14 of 16 samples while the no-ops were held).
    fn went_through(&self, key: &str, event: &str, applied: bool, was_back: bool, at: i64) {
        let stats = self.ctx.stats;
        stats.jobs.went_through(event, applied, at);
        stats.jobs.refusal_decided(event, key);
        if applied
            && stats.contention.standstill.load(Ordering::Relaxed)
            && stats.contention.standstill.swap(false, Ordering::Relaxed)
        {
            stats.ease(CONTENTION);
            log::info!("{CONTENTION}: jobs go through again");
        }
        self.no_longer_waits(key);
        // The roles' names are made only when some problem is on record: not per job.
        if !stats.has_problems() {
            return;
        }
        if was_back && stats.clear_problem(&held_role(event), i64::MAX) {
            log::info!("jobs of {event} run again: the schema fault is gone");
        }
        if applied && stats.clear_problem(&refused_role(event), i64::MAX) {
            log::info!("jobs of {event} go through again: what refused them is gone");
        }
    }

    /// A job that waited on contention finished: the warning goes with the last one, not
    /// a [`crate::stats::PROBLEM_WINDOW`] after the last retry.
    fn no_longer_waits(&self, key: &str) {
        let stats = self.ctx.stats;
        // A job another worker sends back meanwhile reports it again: that report stays.
        let since = crate::now_ms();
        if stats.contention.finished(key) && stats.clear_problem(CONTENTION, since) {
            log::info!("{CONTENTION}: no job waits on contention any more");
        }
    }

    /// A schema fault (a missing table or column, a refused privilege, a handler that
    /// does not prepare): the job goes back to the pool for [`SCHEMA_HOLD`] without
    /// spending a retry, and health is red naming the error until a job of its event
    /// commits.
    fn hold(
        &self,
        d: Delivery,
        env: &Envelope,
        key: &str,
        first_due: Option<i64>,
        f: &Failure,
        file: Option<&str>,
    ) -> Settlement {
        let now = self.ctx.stats.clock.now_ms();
        let what = format!(
            "jobs of {}{} are held, none dead-lettered: {} (tried again every {}s, no retry spent)",
            env.event,
            file.map(|f| format!(" ({f})")).unwrap_or_default(),
            f.reason,
            SCHEMA_HOLD.as_secs()
        );
        self.held_red(d, env, key, first_due.unwrap_or(now), f, what)
    }

    /// A job held by a fault of its surroundings that only an operator mends: `what` on
    /// record under its event's held role (health red, logged when new), the job back to
    /// the pool for [`SCHEMA_HOLD`], its retries unspent; first fell due at `since`.
    fn held_red(
        &self,
        d: Delivery,
        env: &Envelope,
        key: &str,
        since: i64,
        f: &Failure,
        what: String,
    ) -> Settlement {
        if self
            .ctx
            .stats
            .report_critical(&held_role(&env.event), what.clone())
        {
            log::error!("{what}");
        }
        log::debug!("job {key} {} held: {}", env.event, f.reason);
        self.ctx.stats.jobs.held(&env.event, false, crate::now_ms());
        self.sent_back_unspent(d, env, since, &f.reason, SCHEMA_HOLD)
    }

    /// A data exception the handler's own statement raised that names no value (`integer
    /// out of range`: giving stock back to a sku the shop keeps at the type's top as
    /// "unlimited"), so that nothing shows it met the job's data rather than the shop's
    /// stored rows: the surroundings' fault until the job goes through. Held like a schema
    /// fault (back every [`SCHEMA_HOLD`], no retry spent, health red naming the error),
    /// and a dead letter only once `--retry-for` has passed since it fell due. Found from
    /// outside: every unpaid order returning stock to such a sku was a dead letter a second
    /// after its first failure, its order left uncancelled.
    fn held_for_stored_data(
        &self,
        d: Delivery,
        env: &Envelope,
        key: &str,
        first_due: Option<i64>,
        f: &Failure,
    ) -> Settlement {
        let jobs = self.ctx.jobs;
        let now = self.ctx.stats.clock.now_ms();
        let since = first_due.unwrap_or(now);
        let horizon = crate::human_ms(jobs.retry_for.as_millis() as i64);
        if now - since >= jobs.retry_for.as_millis() as i64 {
            let reason = format!(
                "handler failed: {} (held for --retry-for {horizon}: the error names no value of the job's own, so it was taken for the shop's stored data)",
                f.reason
            );
            return self.dead(d, reason, env.event.clone(), env.retry as u64 + 1);
        }
        let what = format!(
            "jobs of {} are held, none dead-lettered yet: the handler's statement fails on a value none of them names, taken for the shop's stored data (a row at its type's limit?): {} (tried again every {}s, no retry spent; a dead letter after --retry-for {horizon})",
            env.event,
            f.reason,
            SCHEMA_HOLD.as_secs()
        );
        self.held_red(d, env, key, since, f, what)
    }

    /// The job back to the pool for `after`, its retries unspent, with the failure and
    /// when it first fell due written into it; counted as held.
    fn sent_back_unspent(
        &self,
        d: Delivery,
        env: &Envelope,
        first_due: i64,
        reason: &str,
        after: Duration,
    ) -> Settlement {
        let now = self.ctx.stats.clock.now_ms();
        self.back_unspent(d, env, first_due, (reason, now), after)
    }

    /// [`Worker::sent_back_unspent`] with the failure and when it happened (Redis's clock)
    /// given: `failed`.
    fn back_unspent(
        &self,
        d: Delivery,
        env: &Envelope,
        first_due: i64,
        failed: (&str, i64),
        after: Duration,
    ) -> Settlement {
        let now = self.ctx.stats.clock.now_ms();
        let msg = env.requeued_after(
            env.retry,
            first_due,
            failed.0,
            failed.1,
            self.ctx.jobs.max_message_bytes,
        );
        let mut s = Settlement::new(
            d,
            Outcome::Retry {
                msg: msg.into_bytes(),
                due_ms: now + after.as_millis() as i64,
            },
        )
        .with_event(&env.event);
        s.counts_as = Some(JobOutcome::Held);
        s
    }

    /// A fault PostgreSQL gives to the job (its data, a `RAISE`): a dead letter once
    /// another job of its event has changed something since this one failed, in this
    /// process or in any other (the inbox says so: [`Worker::applied_since`]), which shows
    /// the fault is this job's; or when the handler's own statement met the job's data
    /// ([`Failure::own_data`]) with a value the job's payload holds, if the error quotes
    /// one ([`crate::db::quotes_payload`]), the job was never held ([`Envelope::held_at`]) and no
    /// other job of the event was refused since one last changed something, here or, when
    /// none is on record here, as Redis's record says ([`Worker::refusal_on_record`]) (a shop
    /// constraint that casts refuses every job with the same error, so a second refused
    /// job withdraws this shortcut until a job of the event changes something). A job
    /// refused first while others are refused or held is marked held at once. The first
    /// failure sends it back for [`SECOND_LOOK`] (no
    /// retry spent). Without that proof (a trigger, a constraint or a function the shop is
    /// changing may be refusing every job of the event, and one refusal alone cannot tell
    /// which) it is held: back every [`SCHEMA_HOLD`], health red naming the error, until a
    /// job of the event changes something, and a dead letter only once `--retry-for` has
    /// passed since it fell due.
    fn own_fault(
        &mut self,
        d: Delivery,
        env: &Envelope,
        key: &str,
        first_due: Option<i64>,
        f: &Failure,
    ) -> Settlement {
        let stats = self.ctx.stats;
        let jobs = self.ctx.jobs;
        let now = stats.clock.now_ms();
        let since = first_due.unwrap_or(now);
        let gist = refusal_gist(&f.reason);
        let seen = env.last_error().is_some_and(|e| refusal_gist(e) == gist);
        let local = crate::now_ms();
        // Asked before this refusal is on record, so that it is not its own witness.
        let other_refused = stats.jobs.other_refused_ms(&env.event, key);
        stats.jobs.refused(&env.event, key, local);
        if !seen {
            log::debug!(
                "job {key} {} failed, a second look in {}s: {}",
                env.event,
                SECOND_LOOK.as_secs(),
                f.reason
            );
            // The grace of this refusal counts from now.
            let mut refused = env.clone();
            refused.mark_refused(now);
            // Refused while other jobs of its event are refused too, or held: the
            // surroundings' fault is suspected, and only proof makes it the job's own, in
            // whichever process looks next.
            if other_refused.is_some() || stats.jobs.held_by_refusal(&env.event) {
                return self.sent_back_held(d, &refused, since, &f.reason, SECOND_LOOK);
            }
            return self.sent_back_unspent(d, &refused, since, &f.reason, SECOND_LOOK);
        }
        // As the message says; else (sent back by an older version) at least SECOND_LOOK
        // before this look fell due.
        let failed_at = env
            .failed_at()
            .unwrap_or_else(|| d.due_ms.unwrap_or(now) - SECOND_LOOK.as_millis() as i64);
        let failed_ago = now - failed_at;
        // The handler's own statement meeting the job's data needs no proof from after
        // the failure, only none against it: no other job of the event refused here since
        // one last changed something, or one changed something since that refusal. A shop
        // rule refusing every job (a constraint that casts) refuses the others too.
        // A job held before (here or in another process, before a restart) was taken for
        // the surroundings' fault: only proof undoes that.
        // The value the error quotes, if any, must be the job's too: a shop rule that
        // casts the handler's own constant refuses every job with a value none of them
        // holds, and is taken for the surroundings' fault from its first job on.
        let own_data = f.own_data
            && env.held_at().is_none()
            && crate::db::quotes_payload(&f.reason, &env.payload);
        // No refusal on record here (a process just started, or another took the last
        // one): the record in Redis says whether one cost a letter already, in any
        // process.
        let other_refused = match other_refused {
            None if own_data => match self.refusal_on_record(&env.event, key) {
                Ok(ago) => ago.map(|ago| local - ago),
                // Redis cannot say: as if it had, so the job waits for proof.
                Err(()) => Some(local),
            },
            known => known,
        };
        // How long this refusal has lasted: from the job's first refusal with it (a
        // message of an older version says only when it failed last).
        let refused_for = now - env.refused_at().unwrap_or(failed_at);
        // A refusal by a rule of the database (not the handler's own statement meeting
        // the job's data) is proven the job's own by a change of another job of its event
        // after its first refusal, not only after its last try: the grace's last look
        // comes when the other jobs may have run dry (found from outside: 29 of 51 orders
        // a trigger refused for good were held, red, for `--retry-for` since the jobs due
        // with them had all gone through before their grace ended).
        // A second after that refusal at the earliest: a job whose transaction passed the
        // rule's place before the rule came (`CREATE TRIGGER` waits for it) is counted by
        // its worker a moment later, and proves nothing of the rule.
        let proof_since = match f.own_data {
            true => failed_ago,
            false => failed_ago.max(refused_for - PROOF_AFTER_REFUSAL.as_millis() as i64),
        };
        let window = match (own_data, other_refused) {
            (true, Some(at)) => proof_since.max(local - at),
            _ => proof_since,
        };
        let applied = self.applied_since(&env.event, window);
        // The newest change, which the question above kept: after this job's refusal, it
        // is proof, and the refusal says nothing more of the others.
        let proven = applied && stats.jobs.applied_ms(&env.event) > local - proof_since;
        // A rule the shop switches on for a while (a table frozen during a deploy, a
        // trigger toggled) refuses the jobs that meet it while the others go through: the
        // proof holds only for a refusal that lasts `--refusal-grace`. Found from outside:
        // a trigger refusing every row of `coupon_user` for 20 s dead-lettered 482 of 1,600
        // unpaid orders, those with a coupon, left uncancelled; one switched on and off
        // every 3 s, 168. The handler's own statement refusing the job's data (class 22,
        // no function or trigger in the error), proven, needs no grace: the rule is the
        // handler's, the data the job's.
        let grace = jobs.refusal_grace.as_millis() as i64;
        // A job refused the same way went through within `--retry-for`: the rule is
        // switched on and off (a maintenance switch), and this job's tries only met it
        // on. Waited out like a hold, up to `--retry-for` since it fell due. Found from
        // outside: a trigger toggled every 3 s for 160 s dead-lettered 38 of 900 unpaid
        // orders past the grace, 20 s on and 2 s off 145. Not only since this job's
        // first refusal: the proof may come from jobs never refused that went through
        // in an off spell in which no refused job happened to look (found from outside:
        // on 12 s and off 2 s, 10 dead letters in one of two runs).
        // Seen here, or (asked only when the grace is over) in any process, a process
        // restarted meanwhile too: the record in Redis.
        let horizon_ms = jobs.retry_for.as_millis() as i64;
        let switching = proven
            && !f.own_data
            && now - since < horizon_ms
            && (stats
                .jobs
                .lapsed_since(&env.event, &gist, local - horizon_ms)
                || (refused_for >= grace && self.lapse_on_record(&env.event, &gist, horizon_ms)));
        if proven && !f.own_data && (refused_for < grace || switching) {
            return self.refused_within_grace(d, env, since, f, (refused_for, grace), switching);
        }
        if proven {
            stats.jobs.refusal_decided(&env.event, key);
        }
        // Taken for its data without proof, its refusal stays on record against the next
        // such job, so that a rule refusing every job costs one letter, not a letter a job.
        if proven || (own_data && (other_refused.is_none() || applied)) {
            if !proven {
                self.record_refusal_letter(&env.event, key);
            }
            let lasted = match proven && !f.own_data && grace > 0 {
                true => format!(
                    " (refused for {} while other jobs of {} went through after its first refusal)",
                    crate::human_ms(refused_for),
                    env.event
                ),
                false => String::new(),
            };
            return self.dead(
                d,
                format!("handler failed: {}{lasted}", f.reason),
                env.event.clone(),
                env.retry as u64 + 1,
            );
        }
        let waited = Duration::from_millis((now - since).max(0) as u64);
        let horizon = crate::human_ms(jobs.retry_for.as_millis() as i64);
        if waited >= jobs.retry_for {
            let reason = format!(
                "handler failed: {} (no job of {} changed anything for --retry-for {horizon})",
                f.reason, env.event
            );
            stats.jobs.refusal_decided(&env.event, key);
            return self.dead(d, reason, env.event.clone(), env.retry as u64 + 1);
        }
        self.held_for_refusal(&env.event, &f.reason);
        self.sent_back_held(d, env, since, &f.reason, SCHEMA_HOLD)
    }

    /// A job refused while others of its event go through, `refused_for` ms after its
    /// first refusal, less than `grace` (`--refusal-grace`): back for another look, no
    /// retry spent, after as long again as it has been refused (at least [`SECOND_LOOK`],
    /// at most [`GRACE_LOOK`]), and once more when the grace ends; a warning names it.
    fn refused_within_grace(
        &self,
        d: Delivery,
        env: &Envelope,
        first_due: i64,
        f: &Failure,
        (refused_for, grace): (i64, i64),
        switching: bool,
    ) -> Settlement {
        let stats = self.ctx.stats;
        // Sent back by an older version, it says only when it failed last: its grace
        // counts from then.
        let mut env = env.clone();
        if env.refused_at().is_none() {
            env.mark_refused(stats.clock.now_ms() - refused_for);
        }
        let left = match switching {
            true => u64::MAX,
            false => (grace - refused_for).max(0) as u64,
        };
        let next = (refused_for.max(0) as u64)
            .clamp(
                SECOND_LOOK.as_millis() as u64,
                GRACE_LOOK.as_millis() as u64,
            )
            .min(left.max(SECOND_LOOK.as_millis() as u64 / 4));
        let what = match switching {
            false => format!(
                "jobs of {} are refused ({}) while other jobs of it go through: each is tried again, no retry spent, and is a dead letter only if still refused --refusal-grace {} after its first refusal",
                env.event,
                f.reason,
                crate::human_ms(grace)
            ),
            true => format!(
                "jobs of {} are refused ({}) by a rule that comes and goes (jobs refused so went through later): each is tried again, no retry spent, until it goes through or --retry-for {} has passed since it fell due",
                env.event,
                f.reason,
                crate::human_ms(self.ctx.jobs.retry_for.as_millis() as i64)
            ),
        };
        let gist = format!(
            "{}: {}",
            env.event,
            f.reason.chars().take(80).collect::<String>()
        );
        if stats.report_trouble_about(&grace_role(&env.event), what.clone(), gist) {
            log::warn!("{what}");
        }
        self.sent_back_unspent(d, &env, first_due, &f.reason, Duration::from_millis(next))
    }

    /// [`Worker::sent_back_unspent`], the message marked held ([`Envelope::mark_held`])
    /// unless it already is: a dead letter from now on only on proof.
    fn sent_back_held(
        &self,
        d: Delivery,
        env: &Envelope,
        first_due: i64,
        reason: &str,
        after: Duration,
    ) -> Settlement {
        let mut held = env.clone();
        held.mark_held(self.ctx.stats.clock.now_ms());
        self.sent_back_unspent(d, &held, first_due, reason, after)
    }

    /// Jobs of `event` are held for a refusal no job has shown to be its own (`reason`):
    /// health red naming it, and held jobs of it wait for the probe here.
    fn held_for_refusal(&self, event: &str, reason: &str) {
        let stats = self.ctx.stats;
        let horizon = crate::human_ms(self.ctx.jobs.retry_for.as_millis() as i64);
        let what = format!(
            "jobs of {event} are held: they fail ({reason}) and no job of {event} has changed anything since, so it is taken for the surroundings' fault (a trigger, a constraint or a function being changed) until one does, or --retry-for {horizon} passes (tried again every {}s, no retry spent)",
            SCHEMA_HOLD.as_secs()
        );
        if stats.report_critical(&refused_role(event), what.clone()) {
            log::error!("{what}");
        }
        stats.jobs.held(event, true, crate::now_ms());
    }

    /// The worker's Redis connection, connected now if it has none; `None` when Redis
    /// cannot be reached (the caller goes on without it; the settle retries on its own).
    fn redis_now(&mut self) -> Option<&mut crate::store::Con> {
        connected(&mut self.redis, self.ctx.redis)
    }

    /// The field of [`crate::keys::Keys::refused`] that holds the newest lapse of a
    /// refusal of `event` ([`Worker::record_lapse`]). Job keys are never fields there
    /// (the fields of letters are event names), and an event name holds no newline.
    fn lapse_field(event: &str) -> String {
        format!("lapse\n{event}")
    }

    /// Writes `<unix ms> <what>` (the ms on Redis's clock) into `field` of
    /// [`crate::keys::Keys::refused`], one `HSET`. Best effort: a record that cannot be
    /// written is said at debug level only (see its callers for what it costs).
    fn record_refusal(&mut self, field: &str, what: &str) {
        let ctx = self.ctx;
        let Some(con) = self.redis_now() else {
            return;
        };
        let now = ctx.stats.clock.now_ms();
        let done: redis::RedisResult<()> = redis::cmd("HSET")
            .arg(&ctx.keys.refused)
            .arg(field)
            .arg(format!("{now} {what}"))
            .query(con);
        if let Err(e) = done {
            log::debug!("cannot record {field:?} in {}: {e}", ctx.keys.refused);
        }
    }

    /// What [`Worker::record_refusal`] wrote into `field`: how long ago (ms, Redis's
    /// clock) and what. `Err` when Redis cannot say.
    fn refusal_record(&mut self, field: &str) -> Result<Option<(i64, String)>, ()> {
        let ctx = self.ctx;
        let con = self.redis_now().ok_or(())?;
        let recorded: Option<String> = redis::cmd("HGET")
            .arg(&ctx.keys.refused)
            .arg(field)
            .query(con)
            .map_err(|_| ())?;
        let Some(r) = recorded else {
            return Ok(None);
        };
        let (at, what) = r.split_once(' ').unwrap_or((&r, ""));
        let at = at.parse::<i64>().map_err(|_| ())?;
        Ok(Some((
            (ctx.stats.clock.now_ms() - at).max(0),
            what.to_string(),
        )))
    }

    /// A job of `event` refused with `gist` went through: on record for every process (a
    /// restarted one too; the newest lapse of the event, one field for each event). A
    /// record that cannot be written leaves each process to what it saw itself.
    fn record_lapse(&mut self, event: &str, gist: &str) {
        self.record_refusal(&Self::lapse_field(event), gist);
    }

    /// Whether the refusal `gist` of `event` lapsed, in any process, within the last
    /// `within_ms` ([`Worker::record_lapse`]). Asked only as a job's grace ends without
    /// a lapse seen here. Redis unable to say: no.
    fn lapse_on_record(&mut self, event: &str, gist: &str, within_ms: i64) -> bool {
        matches!(
            self.refusal_record(&Self::lapse_field(event)),
            Ok(Some((ago, of))) if of == gist && ago < within_ms
        )
    }

    /// Job `key` of `event` is about to be a dead letter, its refusal taken for its data
    /// without proof: on record against the next such job in every process, as it is in
    /// this one ([`crate::stats::Metrics::refused`]), in [`crate::keys::Keys::refused`]
    /// (`<unix ms> <key>` in the event's field), which [`Worker::refusal_on_record`]
    /// reads. A letter proven by another job's change is decided and records nothing, as
    /// here. A record that cannot be written costs one more letter at most.
    fn record_refusal_letter(&mut self, event: &str, key: &str) {
        self.record_refusal(event, key);
    }

    /// How long ago (ms) a job of `event` other than `key` was last taken for its data
    /// without proof, in any process, within `--retry-for` ([`Worker::record_refusal_letter`]).
    /// Asked only before a job's class-22 error is taken for its data while no refusal of
    /// the event is on record here, so that a restart or another process knows the letter
    /// a shop rule refusing every job has cost already (otherwise each process, and each
    /// restart, would take one more job for its data; the record is not among the dead
    /// letters, so a purge or a flood of them does not hide it). `Err` when Redis cannot
    /// say.
    fn refusal_on_record(&mut self, event: &str, key: &str) -> Result<Option<i64>, ()> {
        let retry_for = crate::dead::millis(self.ctx.jobs.retry_for);
        // A job's own letter, requeued, is no record against it.
        Ok(self
            .refusal_record(event)?
            .and_then(|(ago, of)| (of != key && ago <= retry_for).then_some(ago)))
    }

    /// Whether a job of `event` changed something in the last `ago_ms`: in this process,
    /// or in any (the inbox, asked at most every [`crate::stats::ASK_INBOX_EVERY`] per
    /// event; what it says is kept for the jobs that look meanwhile). A failed question
    /// is no proof.
    fn applied_since(&mut self, event: &str, ago_ms: i64) -> bool {
        let jobs = &self.ctx.stats.jobs;
        let local = crate::now_ms();
        if jobs.applied_ms(event) > local - ago_ms {
            return true;
        }
        if ago_ms <= 0 {
            return false;
        }
        match self.ask_inbox(event, local, |s| s.applied_within(event, ago_ms)) {
            Some(Some(age)) => {
                jobs.applied_at(event, local - age);
                true
            }
            _ => false,
        }
    }

    /// Asks the inbox on this worker's session whether jobs of `event` changed something,
    /// at most once every [`crate::stats::ASK_INBOX_EVERY`] per event: `None` when it may
    /// not now, has no session, or the question failed.
    fn ask_inbox<T>(
        &mut self,
        event: &str,
        local: i64,
        ask: impl FnOnce(&mut Session) -> Result<T, postgres::Error>,
    ) -> Option<T> {
        if !self.ctx.stats.jobs.ask_inbox(event, local) {
            return None;
        }
        ask(self.session.as_mut()?)
            .map_err(|e| {
                log::debug!(
                    "cannot ask the inbox whether a job of {event} changed something: {}",
                    db::error_text(&e)
                )
            })
            .ok()
    }

    /// Contention (another transaction's lock past the lock timeout, a deadlock): back
    /// to the pool with backoff ([`contention_delay`]); a dead letter only once
    /// `--max-retries` are spent and `--retry-for` has passed since the job first fell
    /// due. `failed_at`: when it met the contention (local ms).
    fn contended(
        &mut self,
        d: Delivery,
        env: &Envelope,
        key: &str,
        first_due: Option<i64>,
        f: &Failure,
        failed_at: i64,
    ) -> Settlement {
        let jobs = self.ctx.jobs;
        let stats = self.ctx.stats;
        let now = stats.clock.now_ms();
        let since = first_due.unwrap_or(now);
        let waited = Duration::from_millis((now - since).max(0) as u64);
        // A whole set's failure (it ran out of time) says nothing of which of its jobs was
        // slow: none is charged a retry for it. Each comes back after the backoff of the
        // retries it has, into the event's smaller sets, where a slow job ends up alone
        // and is charged.
        let delay = contention_delay(jobs, env.retry);
        let retry = if f.shared {
            env.retry
        } else {
            env.retry.saturating_add(1)
        };
        // A wait for another transaction's lock ([`Failure::waited_for_lock`]) is waited
        // out and never a dead letter; past `--retry-for` health turns red naming the job
        // ([`report_contention`]). Found from outside: two skus the shop kept busy past
        // `--retry-for 20s` turned 15 unpaid orders into dead letters, left uncancelled,
        // while the orders queued behind the first waiter of each row (whose errors name
        // no row) were waited out. A deadlock or a statement timeout (a handler slow on
        // its own data, or a slow trigger): retried for `--retry-for`, then
        // dead-lettered as configured, unless the queue stands still
        // ([`Worker::stands_still`]): a trigger slower than the statement timeout on
        // every update is the surroundings', waited out, red meanwhile.
        let lock_wait = f.waited_for_lock();
        let spent = env.retry >= jobs.max_retries && waited >= jobs.retry_for;
        if !f.shared
            && !lock_wait
            && spent
            && !self.stands_still(&env.event, key, now - since, failed_at)
        {
            self.no_longer_waits(key);
            let reason = format!(
                "transient failure after {} retries, {} after its due time (contention: --retry-for {}): {}",
                env.retry,
                crate::human_ms(waited.as_millis() as i64),
                crate::human_ms(jobs.retry_for.as_millis() as i64),
                f.reason
            );
            return self.dead(d, reason, env.event.clone(), env.retry as u64 + 1);
        }
        log::debug!(
            "job {key} {} will retry ({}) in {}: {}",
            env.event,
            retry,
            crate::human_ms(delay.as_millis() as i64),
            f.reason
        );
        let due_ms = now + delay.as_millis() as i64;
        // Remembered past its retry for two of the slowest cap's slots: under a cap whose
        // slots are seconds apart the job (or the next one, which meets the lock in its
        // place) comes back only at a slot, later than a job another process ran is
        // forgotten, and a standstill under 2/m was never told (nothing stayed waiting).
        let patience = self
            .ctx
            .manners
            .slowest_slots(&env.event)
            .map_or(0, |s| 2 * s.as_millis() as i64);
        let msg = env
            .requeued_waiting(
                retry,
                since,
                (&f.reason, now),
                f.wait.is_some(),
                jobs.max_message_bytes,
            )
            .into_bytes();
        stats.contention.waiting(
            key,
            &env.event,
            since,
            (&f.reason, lock_wait, retry),
            due_ms + patience,
            failed_at,
            Some((due_ms, msg.as_slice())),
        );
        if let Some(ago) = self.ctx.manners.contended_for(&env.event) {
            stats
                .contention
                .began_by(crate::now_ms() - ago.as_millis() as i64);
        }
        let local = crate::now_ms();
        report_contention(stats, [env.event.as_str()], (now, local), jobs);
        Settlement::new(d, Outcome::Retry { msg, due_ms }).with_event(&env.event)
    }

    /// Whether the queue of `event` stands still for the job `key`, which fell due
    /// `waited_ms` ago and failed at `failed_at` (local ms): other jobs of it wait on
    /// contention here, and the jobs of it did not go through all along in the span before
    /// the failure (`--retry-for`, at least 6 s and at most [`CONTENTION_STALL`]): none
    /// changed anything (in any process: the inbox is asked, at most once every
    /// [`crate::stats::ASK_INBOX_EVERY`]) in some third of it, up to
    /// [`PROOF_BEFORE_FAILURE`] before the failure, or the job has not waited that long.
    /// Changes in one stretch prove nothing of the lock: the jobs that go through the
    /// moment a lock every job met is let go (found in the test: two dead letters at the
    /// release), or in a gap of a second between two such locks (found from outside: 260
    /// of 900 unpaid orders were dead letters after a gap), must not make the waiters'
    /// failures their own. The inbox is asked once a second per event: a job that cannot
    /// ask now waits for its next try.
    fn stands_still(&mut self, event: &str, key: &str, waited_ms: i64, failed_at: i64) -> bool {
        let stats = self.ctx.stats;
        if !stats
            .contention
            .others_wait(event, key, stats.clock.now_ms())
        {
            return false;
        }
        let local = crate::now_ms();
        let to = failed_at - PROOF_BEFORE_FAILURE.as_millis() as i64;
        let span = self
            .ctx
            .jobs
            .retry_for
            .clamp(PROOF_BEFORE_FAILURE * 3, CONTENTION_STALL);
        let from = failed_at - span.as_millis() as i64;
        if local - waited_ms > from {
            return true;
        }
        let applied = self.ask_inbox(event, local, |s| {
            s.applied_throughout(event, local - from, local - to)
        });
        !applied.unwrap_or(false)
    }

    /// Runs the jobs, waiting (with backoff) for a database session, and returns their
    /// results in order, each with when it was had (local ms). Under a `--max-rate`, a share of them at a time
    /// ([`Manners::share`]), each paced. Fewer results than jobs when shutdown came first:
    /// while the database was unreachable, or before the cap let the rest run (the cap
    /// holds through a stop). The jobs without one stay pending for the next start.
    ///
    /// [`Manners::share`]: crate::manners::Manners::share
    fn run_in_database(
        &mut self,
        jobs: &[Job<'_>],
        outcomes: &mut Vec<Settlement>,
        pool: Option<&crate::delivery::Take>,
    ) -> Vec<(JobResult, i64)> {
        let (manners, shutdown) = (self.ctx.manners, self.ctx.shutdown);
        // The jobs no cap applies to, first ([`Worker::share`]), run together unpaced;
        // the rest a share at a time.
        let free = jobs
            .iter()
            .take_while(|j| manners.slowest_slots(&j.env.event).is_none())
            .count();
        let share = manners
            .share(jobs[free..].iter().map(|j| j.env.event.as_str()))
            .unwrap_or(jobs.len())
            .max(1);
        let parts = (free > 0).then_some((0, &jobs[..free])).into_iter().chain(
            jobs[free..]
                .chunks(share)
                .enumerate()
                .map(|(k, part)| (free + k * share, part)),
        );
        // While this worker paces it keeps up ([`Worker::keep_up`], every
        // [`Worker::keep_up_every`]): between the waits (each may be shorter) and during
        // a long one ([`Manners::wait_for`]).
        let every = self.keep_up_every();
        let capped = manners.capped();
        let mut results = Vec::with_capacity(jobs.len());
        'parts: for (start, part) in parts {
            let takes = manners.takes(part.iter().map(|j| j.env.event.as_str()));
            let held = &jobs[start..];
            loop {
                if capped && self.kept_at.elapsed() >= every {
                    self.keep_up(outcomes, held, pool, share);
                }
                if !takes.is_empty() {
                    // Still waiting here, not another process's to forget.
                    let until = crate::now_ms() + every.as_millis() as i64;
                    let keys = held.iter().map(|j| j.key.as_str());
                    self.ctx.stats.contention.held(keys, until);
                }
                let until = if takes.is_empty() {
                    None
                } else {
                    match self.take_slots(&takes) {
                        Ok(until) => Some(until),
                        Err(again) => {
                            // Not booked yet: ask again when the slots are near.
                            if !manners.wait_for(again, shutdown, every, || {
                                self.keep_up(outcomes, held, pool, share)
                            }) {
                                break 'parts;
                            }
                            continue;
                        }
                    }
                };
                if let Some(until) = until {
                    // What it ran is settled before a wait longer than an ack is held:
                    // a retry held back behind a wait of 30 s for a slot went back to
                    // the pool that much later.
                    if until.saturating_duration_since(Instant::now()) > ACK_HOLD {
                        self.settle(outcomes);
                    }
                    if !manners.wait_for(until, shutdown, every, || {
                        self.keep_up(outcomes, held, pool, share)
                    }) {
                        break 'parts;
                    }
                }
                match self.run_paced(part, until) {
                    Paced::Ran(r) => {
                        let at = crate::now_ms();
                        results.extend(r.into_iter().map(|r| (r, at)));
                        break;
                    }
                    // Its slots went by while it waited for the database (or the process
                    // was stopped): new ones, or the jobs held meanwhile ran at once.
                    Paced::Late => continue,
                    Paced::Stopped => break 'parts,
                }
            }
        }
        results
    }

    /// [`Worker::run_in_database`] for jobs paced at once, their slots due at `until`
    /// (`None`: no cap applies). [`Paced::Late`] when a session could be had only more than
    /// [`LATE_FOR_SLOTS`] after them: after a PostgreSQL outage every worker's slots had
    /// gone by and their jobs ran at once, 8 within 0.1 s under 2/s.
    fn run_paced(&mut self, jobs: &[Job<'_>], until: Option<Instant>) -> Paced {
        let mut counted = false;
        // What a run cut short by a lost session had committed, by job: those jobs run
        // again with the rest and find their inbox rows, and are counted as what they did
        // here, not as duplicates (from outside: `done` rose by 845 for 1,125 cancels
        // under a SIGSTOP loop).
        let mut committed: Vec<Option<JobResult>> = Vec::new();
        // After a wait for PostgreSQL: which of the jobs this consumer still owns (a peer
        // may have taken them meanwhile); `None`: all, as far as is known.
        let mut owned: Option<Vec<bool>> = None;
        // Jobs held here a while (a wait for their slots under `--max-rate`) are looked at
        // first too: a peer may have taken them while this process had no usable
        // PostgreSQL, and the session may be had at once now (found from outside: jobs a
        // peer had dead-lettered ran here after a wait for slots).
        let mut waited = jobs.iter().any(|j| j.d.received.elapsed() >= HELD_LONG);
        loop {
            if let Err(e) = self.ensure_session() {
                if self.wait_for_database("no database session", &e) {
                    return Paced::Stopped;
                }
                waited = true;
                continue;
            }
            if std::mem::take(&mut waited) {
                let ds: Vec<&Delivery> = jobs.iter().map(|j| &j.d).collect();
                owned = self.still_owned(&ds).filter(|o| o.contains(&false));
            }
            if until.is_some_and(|u| u.elapsed() > LATE_FOR_SLOTS) {
                return Paced::Late;
            }
            // Run after the stop was asked for: the drain's.
            if self.ctx.shutdown.is_set() && !std::mem::replace(&mut counted, true) {
                self.ctx
                    .drain
                    .ran
                    .fetch_add(jobs.len() as u64, Ordering::Relaxed);
            }
            // The starts of jobs delivered before are counted as their transactions begin
            // and end ([`StartCount`]).
            let mut starts = StartCount::new(
                &mut self.redis,
                self.ctx.redis,
                self.ctx.shards,
                &mut self.count_starts_after,
                jobs,
            );
            let session = self.session.as_mut().expect("a session was just ensured");
            let started = std::time::Instant::now();
            let results = match &owned {
                None => session.run(
                    jobs,
                    self.ctx.jobs,
                    (self.ctx.manners, self.ctx.shutdown),
                    &self.ctx.stats.in_sets,
                    &mut starts,
                ),
                Some(owned) => {
                    let ours: Vec<Job<'_>> = jobs
                        .iter()
                        .zip(owned)
                        .filter(|(_, o)| **o)
                        .map(|(j, _)| j.clone())
                        .collect();
                    let mut ran = session
                        .run(
                            &ours,
                            self.ctx.jobs,
                            (self.ctx.manners, self.ctx.shutdown),
                            &self.ctx.stats.in_sets,
                            &mut starts,
                        )
                        .into_iter();
                    owned
                        .iter()
                        .map(|o| match o {
                            true => ran.next().expect("one result per job run"),
                            false => JobResult::TakenOver,
                        })
                        .collect()
                }
            };
            if let Some(reason) = results.iter().find_map(|r| match r {
                JobResult::Failed(f) if f.fault == Fault::Server => Some(f.reason.clone()),
                _ => None,
            }) {
                // The server's failure, not the jobs': run them again on a new
                // connection. A job that did commit before it went finds its inbox row.
                committed.resize_with(jobs.len(), || None);
                for (c, r) in committed.iter_mut().zip(results) {
                    if c.is_none() && matches!(r, JobResult::Committed(_)) {
                        *c = Some(r);
                    }
                }
                self.drop_session();
                // A session lost while this process stood still (the server's 25P03 for
                // its idle transaction, or only the connection found closed): the pause,
                // not the server. Half the idle timeout: the session may have been idle a
                // moment before the stop. A 25P03 without a stall (a round trip to Redis
                // inside the transaction that hung) is the server path's, named by its
                // reason.
                let stood = self
                    .ctx
                    .stats
                    .stalls
                    .stood_still(crate::db::IDLE_IN_TRANSACTION / 2, crate::stall::REMEMBERED);
                if let Some(stood) = stood {
                    self.was_paused(&reason, stood);
                } else if self.wait_for_database("database connection lost", &reason) {
                    return Paced::Stopped;
                }
                waited = true;
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
            let mut results = results;
            for (r, c) in results.iter_mut().zip(committed) {
                if let (JobResult::Duplicate, Some(c)) = (&r, c) {
                    *r = c;
                }
            }
            return Paced::Ran(results);
        }
    }

    /// Opens this worker's database session if it has none; a worker back from an outage
    /// says so.
    fn ensure_session(&mut self) -> Result<(), crate::workers::session::SessionError> {
        if self.renew_session && !self.unflushed && self.session.is_some() {
            self.renew_session = false;
            self.renewed_at = Some(Instant::now());
            self.drop_session();
        }
        if self.session.is_some() {
            return Ok(());
        }
        let s = Session::open(self.ctx.db, &self.registry, self.ctx.jobs.lock_timeout)?;
        if self.db_backoff.in_outage() {
            self.ctx.stats.db_waiting.fetch_sub(1, Ordering::Relaxed);
            if self.ctx.stats.clear_problem(&self.db_role(), i64::MAX) {
                log::info!("{}: a writable PostgreSQL is back", self.name);
            }
        }
        self.db_backoff.reset();
        self.session = Some(s);
        Ok(())
    }

    /// The role this worker reports PostgreSQL outages under.
    fn db_role(&self) -> String {
        format!("{} (postgresql)", self.name)
    }

    /// This worker's session was lost while the process stood still for `stood` (the
    /// stall watch's measure): PostgreSQL ends a session idle inside a transaction past
    /// [`crate::db::IDLE_IN_TRANSACTION`] (25P03). Told as that, a warning for [`crate::stats::PROBLEM_WINDOW`], not as
    /// an outage of PostgreSQL (found from outside: after a 5 s SIGSTOP `stats --check`
    /// was CRITICAL "no writable PostgreSQL").
    fn was_paused(&self, reason: &str, stood: Duration) {
        let what = format!(
            "this process was paused inside a transaction for {:.1} s (SIGSTOP, a frozen \
             VM, a host out of CPU), so PostgreSQL ended the transaction to free the rows it \
             held ({reason}); its jobs run again on a new session",
            stood.as_secs_f64()
        );
        if self
            .ctx
            .stats
            .report_trouble(&format!("{} (paused)", self.name), what.clone())
        {
            log::warn!("{}: {what}", self.name);
        }
    }

    /// The database failed, not the job: hold the job (back-pressure on the reader)
    /// instead of spending its retries, and back off. Counts this worker as waiting once
    /// per outage. `true` when shutdown came meanwhile.
    fn wait_for_database(&mut self, what: &str, err: &dyn std::fmt::Display) -> bool {
        if !self.db_backoff.in_outage() {
            Stats::add(&self.ctx.stats.db_waiting, 1);
        }
        self.ctx.stats.report_problem(
            &self.db_role(),
            format!("holds its jobs, no writable PostgreSQL: {err}"),
        );
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

    /// Settles the collected outcomes in one script call, after making the commits behind
    /// the acks durable (group commit). Retries with backoff while Redis is unreachable;
    /// gives up only at shutdown, leaving the entries pending (they are redelivered and
    /// the inbox turns the redelivery into a no-op). The loop's step after
    /// [`Worker::handle_batch`].
    pub fn settle(&mut self, outcomes: &mut Vec<Settlement>) {
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
                    stats
                        .jobs
                        .job(&s.event, s.counts_as.unwrap_or(JobOutcome::Retry));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A rule's refusal is one gist for every job it refuses, whatever of the job its
    /// message names; different rules keep different gists.
    #[test]
    fn a_refusal_s_gist_leaves_out_what_names_the_job() {
        let a = refusal_gist("order SO12 is frozen by the shop for an audit (P0001)");
        let b = refusal_gist("order SO12345 is frozen by the shop for an audit (P0001)");
        assert_eq!(a, "order # is frozen by the shop for an audit (#)");
        assert_eq!(a, b);
        assert_eq!(
            refusal_gist("coupon 'SPRING-A' is locked (P0001)"),
            refusal_gist("coupon 'WINTER' is locked (P0001)")
        );
        assert_ne!(
            refusal_gist("orders are read-only during maintenance (P0001)"),
            refusal_gist("coupons are read-only during maintenance (P0001)")
        );
        // Cut after it is made, so a longer number does not move the cut.
        let long = "x".repeat(70);
        assert_eq!(
            refusal_gist(&format!("{long} order 1 of 2 refused")),
            refusal_gist(&format!("{long} order 123456789 of 2 refused"))
        );
        assert_eq!(refusal_gist(&"é".repeat(200)).chars().count(), GIST_CHARS);
        // An unterminated quote (a message cut short) is quoted text to its end.
        assert_eq!(refusal_gist("value 'abc"), "value '…'");
        // A name the message gives is the job's; the first word, and a word in capitals,
        // are the rule's.
        assert_eq!(
            refusal_gist("Order of customer Sbixaaaagc is frozen for a deploy (P0001)"),
            refusal_gist("Order of customer Alice is frozen for a deploy (P0001)")
        );
        assert_eq!(
            refusal_gist("Order of customer Alice is frozen by ALL rules"),
            "Order of customer # is frozen by ALL rules"
        );
    }

    /// The jobs waiting on contention are told between retries: a warning at once, and
    /// critical once the queue has stood still for `CONTENTION_STALL`, with no retry in
    /// between (a retry a minute away once left `/healthz` at 200 for 52 s).
    #[test]
    fn a_standstill_is_told_between_retries() {
        let stats = Stats::default();
        let local = crate::now_ms();
        let now = stats.clock.at(local);
        let retry_due = now + 60_000;
        let reason = "lock timeout (55P03)";
        stats.contention.waiting(
            "order.timeout:SO1",
            "order.timeout",
            now,
            (reason, true, 1),
            retry_due,
            local,
            None,
        );
        let jobs = JobConfig::default();
        let watch_contention = |stats: &Stats, local| watch_contention(stats, local, &jobs);
        watch_contention(&stats, local + 1_000);
        let told = stats.problems(local + 1_000);
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!(told[0].severity, "warning");
        assert!(
            told[0].what.contains("1 job(s) wait on contention"),
            "{told:?}"
        );
        assert_eq!(stats.alarm(local + 1_000), None);
        let stalled = crate::stats::CONTENTION_STALL.as_millis() as i64 + 1_000;
        watch_contention(&stats, local + stalled);
        let alarm = stats.alarm(local + stalled).expect("critical");
        assert!(
            alarm.contains("no job of order.timeout has changed anything for")
                && alarm.contains(reason),
            "{alarm}"
        );
        // A job of the event that changes something ends the standstill.
        stats
            .jobs
            .went_through("order.timeout", true, local + stalled);
        stats.ease(CONTENTION);
        watch_contention(&stats, local + stalled + 1_000);
        assert_eq!(stats.alarm(local + stalled + 1_000), None);
    }

    /// A job waiting for another transaction's lock is never a dead letter: past
    /// `--retry-for` and `--max-retries` health is critical, naming it, while other jobs
    /// of its event go through; a slow statement's waiter is not (it is decided at the
    /// horizon), nor a job long overdue at its first lock wait.
    #[test]
    fn a_lock_waited_for_past_the_retry_horizon_is_critical() {
        let stats = Stats::default();
        let local = crate::now_ms();
        let now = stats.clock.at(local);
        let jobs = JobConfig {
            retry_for: Duration::from_secs(20),
            max_retries: 3,
            ..JobConfig::default()
        };
        let waiting = |key, why| {
            stats
                .contention
                .waiting(key, "order.timeout", now, why, now + 60_000, local, None)
        };
        waiting("order.timeout:SO1", ("statement timeout (57014)", false, 3));
        // Other jobs of the event change things all along: no standstill.
        let went_through = |at| stats.jobs.went_through("order.timeout", true, at);
        went_through(local + 19_000);
        watch_contention(&stats, local + 19_500, &jobs);
        assert_eq!(stats.alarm(local + 19_500), None);
        went_through(local + 21_000);
        watch_contention(&stats, local + 21_000, &jobs);
        assert_eq!(
            stats.alarm(local + 21_000),
            None,
            "a slow statement is decided"
        );
        // A job long overdue (a backlog after an outage) at its first lock: not yet.
        waiting("order.timeout:SO2", ("lock timeout (55P03)", true, 1));
        watch_contention(&stats, local + 21_000, &jobs);
        assert_eq!(stats.alarm(local + 21_000), None, "a first lock wait");
        waiting("order.timeout:SO2", ("lock timeout (55P03)", true, 3));
        watch_contention(&stats, local + 21_000, &jobs);
        let alarm = stats.alarm(local + 21_000).expect("critical");
        assert!(
            alarm.contains("order.timeout order.timeout:SO2 has waited 21")
                && alarm.contains("past --retry-for 20 s")
                && alarm.contains("lock timeout (55P03)"),
            "{alarm}"
        );
    }
}
