//! Where the worker pool's messages come from: the stream ([`stream::Reader`]) or list
//! queues ([`list::ListReader`]), run by one reader thread ([`run`]).
//!
//! What both share lives here: the pool's end of the channel ([`Feed`], back-pressure),
//! the [`Doorbell`] the mover rings when it moved work, the [`Source`] trait, the step
//! error and the thread loop. Neither source reads a message over `--max-message-bytes`:
//! their reads run as store scripts that dead-letter such messages inside Redis. Neither
//! blocks in Redis either (a blocking read would return a message unscreened): after an
//! empty read a source waits on the doorbell for at most [`IDLE_POLL`].
//!
//! Stops within one step of shutdown by returning, which drops the `Sender`: the workers
//! drain what the channel holds and then see it disconnected.

pub mod done;
pub mod list;
pub mod stream;

use crate::backoff::Backoff;
use crate::delivery::{Delivery, Hand};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store::Con;
use crate::store::{self, StoreError};
use crossbeam_channel::{Receiver, Sender};
use std::time::{Duration, Instant};

/// Longest wait between two reads while nothing is there: how late a message that the
/// local mover did not move (a peer's mover, a producer pushing onto a list queue
/// directly) can be picked up. One script call per wait while idle.
pub const IDLE_POLL: Duration = Duration::from_millis(20);

/// Rung by the mover after it moved messages, so an idle reader reads at once instead of
/// at its next poll. Written by the mover, read by the reader; dropped with the daemon.
#[derive(Debug, Clone)]
pub struct Doorbell {
    tx: Sender<()>,
    rx: Receiver<()>,
}

impl Default for Doorbell {
    fn default() -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        Doorbell { tx, rx }
    }
}

impl Doorbell {
    pub fn ring(&self) {
        // A ring already waiting is enough.
        let _ = self.tx.try_send(());
    }

    /// Waits for a ring, at most `d`.
    pub fn wait(&self, d: Duration) {
        let _ = self.rx.recv_timeout(d);
    }
}

/// The pool's end of the channel, as a reader sees it. Owns the `Sender`s (the reader
/// thread's only ones; a clone per shard): dropping them tells the workers there is no
/// more work.
#[derive(Clone)]
pub struct Feed<'a> {
    hand: Hand,
    /// A worker sends one token after taking a job, waking a reader that waits for room.
    space: Receiver<()>,
    stats: &'a Stats,
}

impl<'a> Feed<'a> {
    pub fn new(hand: Hand, space: Receiver<()>, stats: &'a Stats) -> Feed<'a> {
        Feed { hand, space, stats }
    }

    /// How many deliveries the channel can take now.
    pub fn room(&self) -> usize {
        self.hand.capacity().saturating_sub(self.hand.len())
    }

    /// Waits until a worker takes a job, at most `d`.
    pub fn wait_for_room(&self, d: Duration) {
        let _ = self.space.recv_timeout(d);
        // Every successful reader step ends here or in `send`: the watchdog's sign of life.
        Stats::beat(&self.stats.reader_beat_ms);
    }

    pub fn send(&self, entries: Vec<Delivery>) -> Result<usize, StepError> {
        Stats::beat(&self.stats.reader_beat_ms);
        let n = entries.len();
        self.hand.send(entries).map_err(|_| StepError::PoolGone)?;
        Stats::add(&self.stats.delivered, n as u64);
        Ok(n)
    }

    /// Reports a key of the wrong type that holds messages back (they stay where they
    /// are), under `name` (the reader, or one shard's): logged when new and every 30 s
    /// while it lasts, and shown by the health checks until that name's source clears it.
    pub fn blocked(&self, name: &str, w: &crate::store::WrongType) {
        let problem = format!("messages are held back: {w}; rename or remove the key");
        if self.stats.report_problem(name, problem.clone()) {
            log::error!("{name}: {problem}");
        }
    }

    /// Reports dead-letter keys of the wrong type that hold nothing back yet (found by a
    /// look before any message needs them), under `name`: critical, so `/healthz` is red
    /// and `stats --check` CRITICAL, but not the watchdog's (a restart would not mend
    /// the key, and no message waits on it); cleared with [`Stats::clear_problem`] once
    /// none is left. When a message does meet one, [`Feed::blocked`] says so.
    pub fn would_block(&self, name: &str, keys: &[crate::store::WrongType]) {
        let named: Vec<String> = keys.iter().map(|w| w.to_string()).collect();
        let problem = format!(
            "{}: a message that must be dead-lettered would stay where it is; rename or remove the key",
            named.join("; ")
        );
        if self.stats.report_critical(name, problem.clone()) {
            log::error!("{name}: {problem}");
        }
    }

    /// Counts and logs the messages a read sent to the dead letters instead of the pool.
    pub fn buried(&self, role: &str, buried: &[(String, String)]) {
        self.stats.dead_lettered(role, buried);
    }
}

/// Whether a periodic task is due (never run, or last run `every` ago); stamps it if so.
pub(crate) fn due(last: &mut Option<Instant>, every: Duration) -> bool {
    if last.is_some_and(|t| t.elapsed() < every) {
        return false;
    }
    *last = Some(Instant::now());
    true
}

/// Whether this process has a usable PostgreSQL, as its reader sees it at each
/// maintenance pass (the database watch's finding, [`Stats::db_unusable`]), and the mark
/// that tells peers when it has had none for a while.
///
/// A process whose database watch has found no usable PostgreSQL (down, read-only, a
/// session its role may not use) for `--heartbeat-ttl` marks its consumer so
/// ([`store::mark_without_database`]), for as long as it lasts: a peer that has one takes
/// over the jobs it holds at its next maintenance, as a dead host's, instead of after
/// `--claim-idle` (found from outside: a worker whose role was set
/// `session_replication_role = replica` held 194 entries, run by its peers up to 73 s
/// late). The mark goes at the first pass that finds the database usable. The jobs its
/// workers still hold are run there only if their entries are still its own
/// (`Worker::still_owned`; a list copy is waited out, or finds its inbox row).
#[derive(Debug, Default)]
pub struct Standing {
    /// Since when the watch has found no usable PostgreSQL.
    stuck_since: Option<Instant>,
    /// Since when it has found one: a peer's jobs are taken for want of a database only
    /// by a process that has had one for two maintenance passes, so that after an outage
    /// of every process's database the one that sees it back first does not take the jobs
    /// of another that is back too but has not yet taken its mark away.
    usable_since: Option<Instant>,
    /// The mark is set.
    marked: bool,
}

/// What a [`Standing`] says at one pass: which peers' jobs this process may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usable {
    /// It has a usable PostgreSQL now: it may take a dead peer's jobs. One without takes
    /// none: they would wait in its workers, and a dead peer's stay for a peer that has one
    /// (or for this one, once it has).
    pub now: bool,
    /// It has had one for two passes: it may take a marked live peer's jobs too.
    pub settled: bool,
}

impl Standing {
    /// How many deliveries to read now, of the channel's `room`: none while this consumer
    /// is marked as having no usable PostgreSQL (its workers could not run them; a peer
    /// that has one reads them instead, and would otherwise take them from this consumer
    /// later: found from outside, a marked list consumer fetched again after each
    /// push-back, each of those jobs a `--block` late). Not on the watch's every finding:
    /// one look that does not answer in time on a loaded machine must not stop the reads.
    pub fn wanted(&self, room: usize) -> usize {
        if self.marked {
            0
        } else {
            room
        }
    }

    /// One maintenance pass of the reader named `who.2` (consumer `who.1` of key set
    /// `who.0`): sets, refreshes or takes away the mark, and says which peers' jobs this
    /// process may take.
    pub fn look(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        who: (&crate::keys::Keys, &str, &str),
        stats: &Stats,
        cfg: &crate::config::ReaderConfig,
    ) -> Result<Usable, StepError> {
        let (keys, consumer, name) = who;
        let usable = !stats.db_unusable.load(std::sync::atomic::Ordering::Relaxed);
        let since = |now_so: bool, since: Option<Instant>| match (now_so, since) {
            (false, _) => None,
            (true, None) => Some(Instant::now()),
            (true, since) => since,
        };
        self.stuck_since = since(!usable, self.stuck_since);
        self.usable_since = since(usable, self.usable_since);
        let mark = self
            .stuck_since
            .is_some_and(|t| t.elapsed() >= cfg.heartbeat_ttl);
        if mark || self.marked {
            store::mark_without_database(con, keys, consumer, mark, cfg.heartbeat_ttl)?;
        }
        if mark && !self.marked {
            log::warn!(
                "{name}: no usable PostgreSQL for {}s: a peer that has one takes the jobs this process holds",
                cfg.heartbeat_ttl.as_secs_f64()
            );
        } else if !mark && self.marked {
            log::info!("{name}: PostgreSQL is usable again: this process keeps its jobs");
        }
        self.marked = mark;
        Ok(Usable {
            now: usable,
            settled: self
                .usable_since
                .is_some_and(|t| t.elapsed() >= 2 * cfg.block),
        })
    }
}

/// Why a reader step stopped.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Redis failed or refused: back off (and reconnect if the connection is gone).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The channel's receivers are gone: the pool has stopped, so must the reader.
    #[error("the worker pool has stopped")]
    PoolGone,
}

/// What the reader thread runs on: the stream or the list queues. Both hand deliveries to
/// the same pool.
pub trait Source {
    /// For log lines.
    fn role(&self) -> &'static str;
    /// Socket timeout: longer than the longest call (a wait for room is `block` long).
    fn io_timeout(&self) -> Duration {
        self.block() + Duration::from_secs(5)
    }
    /// The maintenance period (`--block`).
    fn block(&self) -> Duration;
    /// How long this consumer's heartbeat lives (`--heartbeat-ttl`): a wait between tries
    /// on a Redis that answers stays within a quarter of it (each try refreshes the
    /// heartbeat first), so that peers do not take over the pending work of a reader that
    /// only waits for an operator's fix, even on a host slow to schedule it.
    fn heartbeat_ttl(&self) -> Duration;
    /// Start-up (and after a lost connection): take back this consumer's own pending work.
    fn start(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        shutdown: &Shutdown,
    ) -> Result<usize, StepError>;
    /// One step: maintenance when due, then one bounded read (or a short wait).
    fn poll(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError>;
}

/// The reader thread body: start-up recovery, then `poll` until shutdown. Redis errors back
/// off (capped, with jitter); a lost connection reconnects. A key of the wrong type that
/// fails a step is reported as the operator's problem (health checks turn red) until a
/// step goes cleanly; one that only holds some messages back is the source's to report
/// and clear (see [`Feed::blocked`]).
/// Returning drops the source and with it the channel's `Sender`.
pub fn run(
    mut source: impl Source,
    client: &crate::store::Redis,
    stats: &Stats,
    shutdown: &Shutdown,
) {
    let role = source.role();
    let mut backoff = Backoff::new(role);
    let mut con: Option<Con> = None;
    let mut started = false;
    // A failed step reported a problem under `role`: the next clean step clears it.
    let mut failed_on_problem = false;
    while !shutdown.is_set() {
        let c = match con.as_mut() {
            Some(c) => c,
            None => match store::connect_with(client, source.io_timeout()) {
                Ok(c) => con.insert(c),
                Err(e) => {
                    stats.redis_failure(&backoff);
                    backoff.fail("cannot connect to redis", &e, shutdown);
                    continue;
                }
            },
        };
        let step_started = crate::now_ms();
        let step = if started {
            source.poll(c)
        } else {
            source.start(c, shutdown).inspect(|_| started = true)
        };
        match step {
            Ok(_) => {
                backoff.reset();
                if std::mem::take(&mut failed_on_problem) && stats.clear_problem(role, step_started)
                {
                    log::info!("{role}: the key that failed its reads is fixed");
                }
            }
            Err(StepError::PoolGone) => break,
            Err(StepError::Store(e)) => {
                let mut cap = crate::backoff::MAX_BACKOFF;
                if let Some(p) = e.operator_problem() {
                    stats.report_problem(role, p);
                    failed_on_problem = true;
                    cap = crate::backoff::FIX_BACKOFF.min(source.heartbeat_ttl() / 4);
                } else if e.is_group_missing() {
                    // The start that follows creates the group: no outage to wait out.
                    cap = std::time::Duration::from_millis(100);
                }
                if e.is_connection() {
                    con = None;
                    stats.redis_failure(&backoff);
                    // A read whose reply was lost left messages pending on us that no
                    // worker holds: take our pending work back first, as at start.
                    // Messages still in the pool come twice; the inbox and the guarded
                    // settle scripts make that harmless.
                    started = false;
                }
                backoff.fail_within("read failed", &e, shutdown, cap);
            }
        }
    }
    log::info!("{role}: stopped");
}
