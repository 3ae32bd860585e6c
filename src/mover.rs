//! The mover thread: due jobs from the delay pool into the stream.
//!
//! Owns one Redis connection. Loops on [`Mover::tick`], one atomic `move_due` script per
//! batch and pool (ours, plus any legacy pools), into the stream or, in list mode, a
//! queue, so any number of movers (one per worker process) run at once without duplicates
//! or loss. A member that cannot be moved (over the size limit, a legacy key of another
//! type or that Redis refuses to read, no data past the grace) is dead-lettered by the
//! same script and the rest move on. After moving anything it rings the reader's
//! doorbell. A full batch loops at once; otherwise it sleeps until the next due score or
//! the poll interval, whichever comes first. It moves no further ahead of the readers
//! than `--move-ahead` unread stream entries (`MoverConfig::ahead`; list mode is not
//! bounded): a backlog leaves the pool as the readers of every host take it, instead of
//! all at once, which took Redis's core from the shop's own work for the backlog's first
//! second (docs/performance.md). Stops within one poll interval of shutdown (the sleep
//! is woken at once).
//!
//! Each pool is moved on its own: a call that fails for one pool (a key of the wrong type,
//! a command Redis refuses) is reported to the health checks under that pool's name, and
//! that pool alone backs off (capped at 30 s) while the others keep their schedule; its
//! problem is cleared by its next clean call. Only a lost connection fails the whole tick:
//! the thread reconnects and backs off.
//!
//! **One clock.** The thread ticks [`At::Server`]: each script decides what is due by
//! Redis's own `TIME` and returns that time, which the sleep until the next due member
//! is counted from, so a worker host whose clock runs ahead never moves a job early (nor
//! one behind late). A member whose data vanished (its pool's data hash gone) is buried
//! as lost data and reported (see [`LOST_DATA`]).

use crate::backoff::{Backoff, MAX_BACKOFF};
use crate::config::MoverConfig;
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::source::Doorbell;
use crate::stats::Stats;
use crate::store::{self, At, MoveReport, Pool, StoreError, StoreResult, Target, LOST_DATA};
use redis::ConnectionLike;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The longest a pool waits before trying again while its hash slot is moving.
pub const MOVING_BACKOFF: Duration = Duration::from_secs(1);

/// How soon the mover looks again after a call that `--move-ahead` cut short: short
/// against the time the readers take to empty the bound (the default's 5,000 entries: a
/// third of a second at the fastest drain measured on one host).
pub const AHEAD_WAIT: Duration = Duration::from_millis(10);

pub struct Mover<'a> {
    keys: &'a Keys,
    cfg: &'a MoverConfig,
    stats: &'a Stats,
    doorbell: Doorbell,
    /// Ours first, then each legacy pool in the order of `cfg.legacy`.
    pools: Mutex<Vec<PoolState>>,
}

/// One pool's own schedule: after a failed call it waits out its own backoff.
struct PoolState {
    /// The name its problems are reported and logged under: `mover` for our pool,
    /// `mover (legacy pool KEY)` for a legacy one.
    role: String,
    backoff: Backoff,
    /// Not tried again before this time (unix ms), after a failed call.
    retry_at_ms: Option<i64>,
}

impl PoolState {
    fn new(role: String) -> PoolState {
        PoolState {
            backoff: Backoff::new(&role),
            role,
            retry_at_ms: None,
        }
    }

    /// How long this pool still waits out its backoff at `now_ms`; `None` when it is due.
    fn waiting(&self, now_ms: i64) -> Option<Duration> {
        let left = self.retry_at_ms? - now_ms;
        // A wall clock stepped back is no reason to wait longer than the longest backoff.
        (left > 0 && left <= MAX_BACKOFF.as_millis() as i64)
            .then(|| Duration::from_millis(left as u64))
    }
}

impl<'a> Mover<'a> {
    pub fn new(keys: &'a Keys, cfg: &'a MoverConfig, stats: &'a Stats) -> Self {
        let pools = std::iter::once("mover".to_string())
            .chain(
                cfg.legacy
                    .iter()
                    .map(|l| format!("mover (legacy pool {})", l.key)),
            )
            .map(PoolState::new)
            .collect();
        Mover {
            keys,
            cfg,
            stats,
            doorbell: Doorbell::default(),
            pools: Mutex::new(pools),
        }
    }

    /// This mover serves shard `i` among several: its own pool's problems are reported
    /// and logged as `mover (shard i)`, so one shard's clean call never clears another's.
    pub fn in_shard(mut self, i: usize) -> Self {
        if let Some(ours) = self.pools.get_mut().ok().and_then(|p| p.first_mut()) {
            *ours = PoolState::new(format!("mover (shard {i})"));
        }
        self
    }

    /// Rings this doorbell after moving messages (the daemon shares it with the reader).
    pub fn with_doorbell(mut self, doorbell: Doorbell) -> Self {
        self.doorbell = doorbell;
        self
    }

    /// One batch from each pool that is not backing off, due by `at` (the thread passes
    /// [`At::Server`], Redis's clock; the tests a time). Returns what moved and how long
    /// to sleep before the next tick (zero: loop at once). A pool whose call fails is
    /// reported and backs off on its own (see the module header); only a lost connection
    /// is returned as an error, after what moved before it was counted.
    pub fn tick(
        &self,
        con: &mut dyn ConnectionLike,
        at: impl Into<At>,
    ) -> StoreResult<(MoveReport, Duration)> {
        let at = at.into();
        // The pools' own backoff schedule, on this host's clock corrected to Redis's.
        let now_ms = match at {
            At::Ms(ms) => ms,
            At::Server => self.stats.clock.now_ms(),
        };
        let target = match self.keys.queues.get(self.cfg.queue) {
            Some(q) => Target::List {
                queue: &q.name,
                dead: &q.dead,
            },
            None => Target::Stream {
                stream: &self.keys.stream,
                dead: &self.keys.dead,
            },
        };
        let grace = self.cfg.orphan_grace.as_millis() as i64;
        let ours = Pool::Enveloped {
            pool: &self.keys.pool,
            data: &self.keys.data,
        };
        let legacy = self.cfg.legacy.iter().map(|l| Pool::Legacy {
            pool: &l.key,
            event: &l.event,
            cluster: self.cfg.cluster,
        });
        let mut states = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        let mut sleep = self.cfg.poll;
        let mut total = MoveReport::default();
        let mut lost = None;
        for (pool, state) in std::iter::once(ours).chain(legacy).zip(states.iter_mut()) {
            if let Some(wait) = state.waiting(now_ms) {
                sleep = sleep.min(wait);
                continue;
            }
            match store::move_due(
                con,
                pool,
                self.keys,
                target,
                at,
                self.cfg.batch,
                grace,
                self.cfg.max_message_bytes,
                self.cfg.ahead,
            ) {
                Ok(report) => {
                    sleep = sleep.min(self.next_sleep(&report, report.now_ms));
                    self.moved(state, &report);
                    absorb(&mut total, report);
                }
                Err(e) if e.is_connection() => {
                    lost = Some(e);
                    break;
                }
                Err(e) => sleep = sleep.min(self.failed(state, &e, now_ms)),
            }
        }
        drop(states);
        Stats::add(&self.stats.moved, (total.moved + total.buried.len()) as u64);
        self.stats.dead_lettered("mover", &total.buried);
        self.lost(&total.buried);
        if total.moved > 0 {
            self.doorbell.ring();
        }
        match lost {
            Some(e) => Err(e),
            None => Ok((total, sleep)),
        }
    }

    /// A pool's clean call: its backoff ends, and its problem with it unless the call met
    /// a dead-letter key of the wrong type again.
    fn moved(&self, state: &mut PoolState, report: &MoveReport) {
        state.retry_at_ms = None;
        state.backoff.reset();
        let role = &state.role;
        if let Some(w) = &report.blocked {
            let problem = format!(
                "members that cannot be moved stay in the pool: {w}; rename or remove the key"
            );
            if self.stats.report_problem(role, problem.clone()) {
                log::error!("{role}: {problem}");
            }
        } else if self.stats.clear_problem(role, i64::MAX) {
            log::info!("{role}: fixed, the pool moves again");
        }
        if let Some((key, err)) = report.undeleted.first() {
            log::warn!(
                "{role}: {} moved or buried member(s) whose STRING key Redis refused to \
                 delete, left in place (first: {key:?}: {err}); give the ACL user write \
                 access to those keys",
                report.undeleted.len()
            );
        }
    }

    /// Members whose data vanished: counted, and reported as a problem of their own role
    /// (`mover (lost data)`), which no clean call clears: it stays on the health checks for
    /// [`crate::stats::PROBLEM_WINDOW`] after the last one, and in the dead letters.
    fn lost(&self, buried: &[(String, String)]) {
        let lost: Vec<&(String, String)> = buried
            .iter()
            .filter(|(_, why)| why.starts_with(LOST_DATA))
            .collect();
        let Some((key, why)) = lost.first() else {
            return;
        };
        Stats::add(&self.stats.lost_data, lost.len() as u64);
        let problem = format!(
            "{} pool member(s) lost their data, each now a dead letter (first: {key:?}: {why});              set maxmemory-policy noeviction",
            lost.len()
        );
        if self
            .stats
            .report_critical("mover (lost data)", problem.clone())
        {
            log::error!("mover: {problem}");
        }
    }

    /// A pool's failed call: reported under its name, and it alone waits before its next
    /// try. Returns that wait.
    fn failed(&self, state: &mut PoolState, e: &StoreError, now_ms: i64) -> Duration {
        let mut wait = state.backoff.next_delay();
        if e.is_moving() {
            // A reshard or a failover ends by itself: try again soon, and do not withhold
            // the watchdog (a restart would not help; the other pools go on).
            wait = wait.min(MOVING_BACKOFF);
        } else if e.operator_problem().is_some() {
            // A key of the wrong type: take up the operator's fix soon.
            wait = wait.min(crate::backoff::FIX_BACKOFF);
        }
        state.retry_at_ms = Some(now_ms.saturating_add(wait.as_millis() as i64));
        let role = &state.role;
        let log = if e.is_moving() {
            self.stats.report_critical(role, e.to_string())
        } else {
            self.stats.report_problem(role, e.to_string())
        };
        if log {
            log::error!("{role}: {e}; this pool retries with backoff, the others go on");
        } else {
            log::debug!("{role}: still failing: {e}");
        }
        wait
    }

    fn next_sleep(&self, r: &MoveReport, now_ms: i64) -> Duration {
        if r.moved + r.buried.len() >= self.cfg.batch {
            return Duration::ZERO;
        }
        // The stream holds as many unread entries as it may: look again when the readers
        // have taken some.
        if r.cut {
            return AHEAD_WAIT.min(self.cfg.poll);
        }
        // Members waiting for their data are due already; re-looking at once would spin
        // until the grace period ends, so they are retried at the poll interval.
        if r.skipped > 0 {
            return self.cfg.poll;
        }
        match r.next_due_ms {
            Some(due) => Duration::from_millis((due - now_ms).max(0) as u64)
                .max(self.cfg.window)
                .min(self.cfg.poll),
            None => self.cfg.poll,
        }
    }

    /// The thread body: ticks until shutdown.
    pub fn run(&self, client: &crate::store::Redis, shutdown: &Shutdown) {
        run_shards(std::slice::from_ref(self), client, shutdown)
    }
}

/// The mover thread over every shard (one mover per key set, `--shards`): a tick of each
/// in turn on one connection, then the shortest of their sleeps.
pub fn run_shards(movers: &[Mover<'_>], client: &crate::store::Redis, shutdown: &Shutdown) {
    let Some(first) = movers.first() else { return };
    let stats = first.stats;
    let mut backoff = Backoff::new("mover");
    let mut con = None;
    let mut looked = Instant::now();
    while !shutdown.is_set() {
        let c = match con.as_mut() {
            Some(c) => c,
            None => match store::connect(client) {
                Ok(c) => con.insert(c),
                Err(e) => {
                    stats.redis_failure(&backoff);
                    backoff.fail("cannot connect to redis", &e, shutdown);
                    continue;
                }
            },
        };
        let mut sleep = Duration::MAX;
        let mut failed = None;
        let freed = stats.contention.to_hasten();
        if !freed.is_empty() {
            hasten(c, movers, &freed, stats);
        }
        let look = looked.elapsed() >= RETRIES_LOOK_EVERY;
        if look {
            looked = Instant::now();
            look_for_retries(c, movers, stats);
        }
        share_lock_ends(c, first.keys, stats, look);
        for m in movers {
            match m.tick(c, At::Server) {
                Ok((_, s)) => sleep = sleep.min(s),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match failed {
            None => {
                backoff.reset();
                Stats::beat(&stats.mover_beat_ms);
                if !sleep.is_zero() && sleep != Duration::MAX {
                    shutdown.wait(sleep);
                }
            }
            Some(e) => {
                // Only a lost connection ends a tick (each pool's own failures are
                // handled in it).
                con = None;
                stats.redis_failure(&backoff);
                backoff.fail("move_due failed", &e, shutdown);
            }
        }
    }
    log::info!("mover: stopped");
}

/// Brings forward, each in its shard's pool, the retries of jobs that waited for a lock
/// whose holder's transaction has ended (`Contention::to_hasten`): this tick moves them.
/// A retry that is no longer the one written (pushed again, moved, run by a peer) is left
/// as it is; one not in the pool yet (written with its worker's next acks) is asked for
/// again at the next ticks (`Contention::to_hasten`).
fn hasten(
    con: &mut dyn ConnectionLike,
    movers: &[Mover<'_>],
    freed: &[(String, i64, String)],
    stats: &Stats,
) {
    for (i, m) in movers.iter().enumerate() {
        let mine: Vec<(&str, i64, &str)> = freed
            .iter()
            .filter(|(key, ..)| crate::keys::shard_of(key.as_bytes(), movers.len()) == i)
            .map(|(key, score, sha)| (key.as_str(), *score, sha.as_str()))
            .collect();
        if mine.is_empty() {
            continue;
        }
        match store::pool::hasten(con, m.keys, &mine) {
            Ok(brought) if brought.is_empty() => {}
            Ok(brought) => {
                stats
                    .contention
                    .brought_forward(&brought, stats.clock.now_ms());
                log::info!(
                    "mover: {} job(s) that waited for a lock now let go run now, not at the end of their backoff",
                    brought.len()
                )
            }
            Err(e) => log::debug!("mover: bringing forward the retries of a lock let go: {e}"),
        }
    }
}

/// How often the mover looks whether the retries of the jobs waiting on contention have
/// left the pool.
const RETRIES_LOOK_EVERY: Duration = Duration::from_secs(1);

/// Looks whether the retries of the jobs waiting on contention have left their shard's pool
/// (moved, or replaced by a retry or a push: `Contention::looked`); one pipeline of
/// `ZSCORE`s per shard. Not answered, they are looked at again next time.
fn look_for_retries(con: &mut dyn ConnectionLike, movers: &[Mover<'_>], stats: &Stats) {
    let keys = stats.contention.to_look();
    if keys.is_empty() {
        return;
    }
    let now = stats.clock.now_ms();
    let mut found = Vec::new();
    for (i, m) in movers.iter().enumerate() {
        let mine: Vec<&String> = keys
            .iter()
            .filter(|key| crate::keys::shard_of(key.as_bytes(), movers.len()) == i)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for key in &mine {
            pipe.cmd("ZSCORE").arg(&m.keys.pool).arg(key.as_str());
        }
        match pipe.query::<Vec<Option<f64>>>(con) {
            Ok(scores) => found.extend(
                mine.into_iter()
                    .zip(scores)
                    .map(|(k, s)| (k.clone(), s.map(|s| s as i64))),
            ),
            Err(e) => {
                log::debug!("mover: looking for the retries of jobs waiting on contention: {e}")
            }
        }
    }
    stats.contention.looked(&found, now);
}

/// The field of [`Keys::refused`] that holds when a process last saw the lock of `event`'s
/// waiters end (`<unix ms>`, Redis's clock). Job keys are never fields there (the fields of
/// letters are event names), and an event name holds no newline.
fn lock_end_field(event: &str) -> String {
    format!("lock-ended\n{event}")
}

/// The ends of locks this process saw, put on record for every process of the prefix (one
/// `HSET` into `keys.refused`, shard 0's); with `look`, the ends on record of the events
/// whose jobs wait here for a lock whose holder this process does not follow, one `HMGET`
/// (`Contention::ended_elsewhere`): only a process that named a holder, and may see its
/// session's state, follows it to its end. Best effort: not written or not read, each
/// process brings forward what it saw itself.
fn share_lock_ends(con: &mut dyn ConnectionLike, keys: &Keys, stats: &Stats, look: bool) {
    let now = stats.clock.now_ms();
    let tell = stats.contention.ends_to_tell(now);
    if !tell.is_empty() {
        let mut hset = redis::cmd("HSET");
        hset.arg(&keys.refused);
        for event in &tell {
            hset.arg(lock_end_field(event)).arg(now);
        }
        if let Err(e) = hset.query::<()>(con) {
            log::debug!(
                "mover: cannot record the end of a lock in {}: {e}",
                keys.refused
            );
        }
    }
    if !look {
        return;
    }
    let events = stats.contention.unfollowed_lock_events();
    if events.is_empty() {
        return;
    }
    let mut hmget = redis::cmd("HMGET");
    hmget.arg(&keys.refused);
    for event in &events {
        hmget.arg(lock_end_field(event));
    }
    match hmget.query::<Vec<Option<String>>>(con) {
        Ok(ends) => {
            let ends: Vec<(String, i64)> = events
                .into_iter()
                .zip(ends)
                .filter_map(|(event, at)| Some((event, at?.parse().ok()?)))
                .collect();
            stats
                .contention
                .ended_elsewhere(&ends, stats.clock.now_ms());
        }
        Err(e) => log::debug!(
            "mover: cannot read the ends of locks in {}: {e}",
            keys.refused
        ),
    }
}

/// Adds one pool's report to the tick's.
fn absorb(total: &mut MoveReport, r: MoveReport) {
    total.now_ms = total.now_ms.max(r.now_ms);
    total.moved += r.moved;
    total.skipped += r.skipped;
    total.next_due_ms = match (total.next_due_ms, r.next_due_ms) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    total.buried.extend(r.buried);
    total.blocked = total.blocked.take().or(r.blocked);
    total.undeleted.extend(r.undeleted);
    total.cut |= r.cut;
}
