//! The one set of counters: every role writes here once per event, and the periodic log
//! line, the exit report, `/metrics` and the watchdog all read the same numbers.
//!
//! Every role only adds (Relaxed: the numbers are for people, not for synchronisation).
//! A job's outcome is counted once, by event, in [`Metrics`] (`Stats::jobs`); the totals
//! of [`Snapshot`] are sums over it. A dead letter or retry is counted once Redis has
//! it (after the settle or the script that wrote it), never when it is only decided.
//!
//! The same per-job calls also feed [`History`], the last hour minute by minute (jobs by
//! outcome, a lateness histogram per minute) in a ring of fixed size, which the status
//! page draws: its memory does not grow with uptime.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

#[derive(Default)]
pub struct Stats {
    /// Written by movers: members that left the pool, to the stream or a queue.
    pub moved: AtomicU64,
    /// Written by the reader: entries handed to the pool (new, own pending, reclaimed).
    pub delivered: AtomicU64,
    /// Written by the reader: entries taken over from other consumers.
    pub reclaimed: AtomicU64,
    /// Written by workers: outcomes settled in Redis by this process (acks, retries and
    /// dead letters whose entry this process removed).
    pub acked: AtomicU64,
    /// Written by workers: jobs that committed as part of a set (a handler's set form).
    pub in_sets: AtomicU64,
    /// Jobs by event and outcome, handler times, lateness: written by workers once per
    /// job and by the mover and reader for the dead letters they write themselves.
    pub jobs: Metrics,
    /// Written by every Redis loop (mover, reader, workers' settle) when an outage starts
    /// (the first failure after a success, see [`Stats::redis_failure`]); read by metrics.
    pub redis_reconnects: AtomicU64,
    /// Written by the reader (unix ms) whenever it hands messages to the pool, waits for
    /// room or finds nothing to read, which every successful step ends in; read by the
    /// watchdog (`health::live`): a stale stamp means a stuck reader or a Redis outage.
    pub reader_beat_ms: AtomicU64,
    /// Written by the mover after every successful tick (unix ms); read like the above.
    pub mover_beat_ms: AtomicU64,
    /// Workers now holding a job while they cannot get a PostgreSQL session: each raises
    /// it when its outage starts and lowers it when it ends. Read by the watchdog and
    /// metrics; left as is at shutdown.
    pub db_waiting: AtomicU64,
    /// Written by the database watch at each look: it found no writable PostgreSQL
    /// usable by this process (down, read-only, a session the worker may not use). Read
    /// by the stream reader, which hands its pending entries to a peer that has one
    /// when this lasts.
    pub db_unusable: std::sync::atomic::AtomicBool,
    /// Written by the database watch at each look: how long the shop's session waiting
    /// longest behind a worker's session has waited (ms; 0: none past a second).
    pub shop_held_up_ms: AtomicU64,
    /// Written by the inbox pruner after each batch: `worker_inbox` rows it deleted.
    pub inbox_pruned: AtomicU64,
    /// This host's clock corrected to Redis's, and what the workers saw of producers'
    /// clocks (see `clock.rs`): the offset written by the watch role, read by every role
    /// that compares a time with a due time.
    pub clock: crate::clock::Clock,
    /// Ticked by the stall watch: whether this process stood still lately.
    pub stalls: crate::stall::Stalls,
    /// Written by the mover: pool members whose data vanished (the data hash gone: an
    /// evicting Redis, or a deletion), each sent to the dead letters as lost data.
    pub lost_data: AtomicU64,
    /// What only an operator can fix (a key of the wrong type), by the role that met it:
    /// written by that role when it meets it and cleared after its next clean step; read
    /// by `/healthz` and the watchdog, red while any role has one (at most
    /// [`PROBLEM_WINDOW`] after it was last met, should its role never step again).
    problems: Mutex<Vec<Problem>>,
    /// How many `problems` there are, so that the workers' clean commits look at the list
    /// only when there is something to clear.
    problem_count: AtomicU64,
    /// Jobs this process sent back to the pool because they met contention, by job key:
    /// written by workers, read by `/metrics` and the status page.
    pub contention: Contention,
    /// This process's `--move-ahead`, set once when it starts a mover (unset without
    /// one): published in its health record, so that `worker stats` on any host reads a
    /// held-back pool against the bound the movers really have, not its own flag's.
    pub mover_ahead: std::sync::OnceLock<usize>,
}

/// How far a problem reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Logged, nothing turns red: it holds no job back (the inbox pruner's failures).
    Trouble,
    /// `/healthz` red and `stats --check` CRITICAL: jobs are held (a schema fault), but a
    /// restart would not help, so the watchdog keeps the process running.
    Alert,
    /// Both, and the watchdog too: a role cannot do its work (a key of the wrong type, no
    /// writable PostgreSQL), and a restart may be what it takes.
    Stall,
}

struct Problem {
    role: String,
    /// Last met (unix ms).
    at: i64,
    what: String,
    /// Last logged (unix ms): a role meets it at every step, the log hears it twice a
    /// minute.
    logged: i64,
    /// What must change for it to be logged before its time ([`Stats::report_trouble_about`]);
    /// `None`: `what` itself.
    gist: Option<String>,
    severity: Severity,
}

/// How bad a reported problem is, and so where it shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Holds nothing back, but an operator should look ([`Stats::report_trouble`]): a
    /// WARNING in `worker stats --check`; `/healthz` and the watchdog stay green.
    Warning,
    /// The surroundings break a guarantee and a restart would not fix it (an evicting
    /// Redis, lost data: [`Stats::report_critical`]): `/healthz` 503 and CRITICAL in
    /// `worker stats --check`, but the watchdog keeps pinging.
    Critical,
    /// Holds jobs back ([`Stats::report_problem`], a key of the wrong type): `/healthz`
    /// and the watchdog red, CRITICAL in `worker stats --check`.
    Blocking,
}

/// One problem as the heartbeat record and the state report list it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Reported {
    pub role: String,
    pub what: String,
    /// `warning`, `critical` or `blocking`.
    pub severity: String,
}

/// How often a problem that persists is logged again.
const PROBLEM_LOG_EVERY_MS: i64 = 30_000;

/// How long a reported problem keeps the health check red after it was last seen. The
/// roles meet it again at every retry, and their backoff is capped well below this.
pub const PROBLEM_WINDOW: Duration = Duration::from_secs(60);

/// The role of an event's held jobs begins so (`handler order.timeout`).
pub const HELD_ROLE_PREFIX: &str = "handler ";

/// How long a report of held jobs keeps health red: each held job reports again at each
/// try (every 5 s), so this is a few tries; then the jobs have gone through here or in
/// another process.
pub const HELD_WINDOW: Duration = Duration::from_secs(15);

/// How long a role's problem lasts after it was last met.
fn window_ms(role: &str) -> i64 {
    if role.starts_with(HELD_ROLE_PREFIX) {
        HELD_WINDOW.as_millis() as i64
    } else {
        PROBLEM_WINDOW.as_millis() as i64
    }
}

/// A copy of the counters at one moment.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub moved: u64,
    pub delivered: u64,
    pub reclaimed: u64,
    pub done: u64,
    pub noop: u64,
    pub duplicate: u64,
    pub retried: u64,
    /// Jobs held by a schema fault: back in the pool for a while, no retry spent.
    pub held: u64,
    pub dead: u64,
    pub acked: u64,
    pub in_sets: u64,
}

impl Stats {
    /// Counters with one event slot per name (the registry's events), plus `_other`.
    pub fn new<S: Into<String>>(events: impl IntoIterator<Item = S>) -> Stats {
        Stats {
            jobs: Metrics::new(events),
            ..Default::default()
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Stamps a role's heartbeat with the current time.
    pub fn beat(stamp: &AtomicU64) {
        stamp.store(crate::now_ms().max(0) as u64, Relaxed);
    }

    /// Counts a Redis outage if `backoff` is not in one yet; call right before
    /// `Backoff::fail` on a Redis error.
    pub fn redis_failure(&self, backoff: &crate::backoff::Backoff) {
        if !backoff.in_outage() {
            Self::add(&self.redis_reconnects, 1);
        }
    }

    /// Counts and logs the messages a store script sent to the dead letters itself
    /// ((job key or queue, reason) each). Called after the script: the letters exist.
    pub fn dead_lettered(&self, role: &str, buried: &[(String, String)]) {
        for (key, reason) in buried {
            log::warn!("{role}: {key:?} dead-lettered: {reason}");
            self.jobs.job("", JobOutcome::Dead);
        }
    }

    /// Records a problem only an operator can fix, met by `role`. Returns whether to log
    /// it: when it is new or changed, and every 30 s while it persists.
    pub fn report_problem(&self, role: &str, what: String) -> bool {
        self.report(role, what, None, Severity::Blocking)
    }

    /// Like [`Stats::report_problem`] (logged as rarely, cleared the same way, or by
    /// time), for what breaks a guarantee without holding a job back and what a restart
    /// would not fix: an evicting Redis, data that vanished. `/healthz` is red and
    /// `worker stats --check` CRITICAL, but the watchdog keeps pinging, so systemd does
    /// not restart a daemon that is doing all it can.
    pub fn report_critical(&self, role: &str, what: String) -> bool {
        self.report(role, what, None, Severity::Critical)
    }

    /// Like [`Stats::report_problem`] (logged as rarely, cleared the same way), for a
    /// failure that holds no job back, such as the inbox pruner's: it never turns
    /// `/healthz` or the watchdog red, since a restart would not fix it and would only
    /// interrupt the jobs.
    pub fn report_trouble(&self, role: &str, what: String) -> bool {
        self.report(role, what, None, Severity::Warning)
    }

    /// Like [`Stats::report_trouble`], for a text that carries figures which change at
    /// every step (how many jobs wait, for how long): it is logged again early only when
    /// `gist` changes, not its figures; the health record shows the text as it is now.
    pub fn report_trouble_about(&self, role: &str, what: String, gist: String) -> bool {
        self.report(role, what, Some(gist), Severity::Warning)
    }

    /// [`Stats::report_critical`] for a text whose figures change at every step, logged
    /// again early only when `gist` changes (as [`Stats::report_trouble_about`]).
    pub fn report_critical_about(&self, role: &str, what: String, gist: String) -> bool {
        self.report(role, what, Some(gist), Severity::Critical)
    }

    fn report(&self, role: &str, what: String, gist: Option<String>, severity: Severity) -> bool {
        let now = crate::now_ms();
        let Ok(mut ps) = self.problems.lock() else {
            return true;
        };
        match ps.iter_mut().find(|p| p.role == role) {
            Some(p) => {
                p.at = now;
                p.severity = severity;
                let changed = match &gist {
                    Some(g) => p.gist.as_ref() != Some(g),
                    None => p.what != what,
                };
                let log = changed || now - p.logged >= PROBLEM_LOG_EVERY_MS;
                if log {
                    p.logged = now;
                }
                p.what = what;
                p.gist = gist;
                log
            }
            None => {
                ps.push(Problem {
                    role: role.to_string(),
                    at: now,
                    what,
                    logged: now,
                    gist,
                    severity,
                });
                self.problem_count.store(ps.len() as u64, Relaxed);
                true
            }
        }
    }

    /// Lowers `role`'s problem to a warning, if it has one: what held jobs back has let
    /// them through, but something of it may remain.
    pub fn ease(&self, role: &str) {
        if let Ok(mut ps) = self.problems.lock() {
            for p in ps.iter_mut().filter(|p| p.role == role) {
                p.severity = p.severity.min(Severity::Warning);
            }
        }
    }

    /// Forgets `role`'s problem unless it was met at or after `since_ms` (the start of the
    /// step that just went cleanly). Returns whether one was cleared.
    /// Whether any role has a problem on record (cheap: a commit asks before it names
    /// the roles it might clear).
    pub fn has_problems(&self) -> bool {
        self.problem_count.load(Relaxed) > 0
    }

    pub fn clear_problem(&self, role: &str, since_ms: i64) -> bool {
        if self.problem_count.load(Relaxed) == 0 {
            return false;
        }
        let Ok(mut ps) = self.problems.lock() else {
            return false;
        };
        let before = ps.len();
        ps.retain(|p| p.role != role || p.at >= since_ms);
        self.problem_count.store(ps.len() as u64, Relaxed);
        ps.len() < before
    }

    /// A problem that holds jobs back, met by some role within [`PROBLEM_WINDOW`] of
    /// `now_ms`, if any (the watchdog's; not the troubles of [`Stats::report_trouble`]
    /// nor the critical problems of [`Stats::report_critical`]).
    pub fn problem(&self, now_ms: i64) -> Option<String> {
        self.worst(now_ms, Severity::Blocking)
    }

    /// A problem at least critical (for `/healthz`), if any: blocking ones first.
    pub fn alarm(&self, now_ms: i64) -> Option<String> {
        self.problem(now_ms)
            .or_else(|| self.worst(now_ms, Severity::Critical))
    }

    /// Whether `p` is still told at `now_ms`: met within its role's window, and for
    /// contention only while this process counts a job waiting (`contended`), since one
    /// another process ran is forgotten.
    fn told(p: &Problem, now_ms: i64, contended: bool) -> bool {
        now_ms - p.at <= window_ms(&p.role) && (contended || p.role != CONTENTION_ROLE)
    }

    fn worst(&self, now_ms: i64, at_least: Severity) -> Option<String> {
        let contended = self.contention.summary(now_ms).0 > 0;
        let ps = self.problems.lock().ok()?;
        ps.iter()
            .filter(|p| p.severity >= at_least && Self::told(p, now_ms, contended))
            .max_by_key(|p| p.severity)
            .map(|p| format!("{}: {}", p.role, p.what))
    }

    /// Every problem met within [`PROBLEM_WINDOW`] of `now_ms`, the worst first: for the
    /// heartbeat record and the state report.
    pub fn problems(&self, now_ms: i64) -> Vec<Reported> {
        let contended = self.contention.summary(now_ms).0 > 0;
        let Ok(ps) = self.problems.lock() else {
            return Vec::new();
        };
        let mut out: Vec<(&Problem, Reported)> = ps
            .iter()
            .filter(|p| Self::told(p, now_ms, contended))
            .map(|p| {
                let severity = match p.severity {
                    Severity::Warning => "warning",
                    Severity::Critical => "critical",
                    Severity::Blocking => "blocking",
                };
                (
                    p,
                    Reported {
                        role: p.role.clone(),
                        what: p.what.clone(),
                        severity: severity.to_string(),
                    },
                )
            })
            .collect();
        out.sort_by_key(|(p, _)| std::cmp::Reverse(p.severity));
        out.into_iter().map(|(_, r)| r).collect()
    }

    pub fn snapshot(&self) -> Snapshot {
        let total = |o| self.jobs.total(o);
        Snapshot {
            moved: self.moved.load(Relaxed),
            delivered: self.delivered.load(Relaxed),
            reclaimed: self.reclaimed.load(Relaxed),
            done: total(JobOutcome::Done),
            noop: total(JobOutcome::NoOp),
            duplicate: total(JobOutcome::Duplicate),
            retried: total(JobOutcome::Retry),
            held: total(JobOutcome::Held),
            dead: total(JobOutcome::Dead),
            acked: self.acked.load(Relaxed),
            in_sets: self.in_sets.load(Relaxed),
        }
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "moved={} delivered={} reclaimed={} done={} noop={} duplicate={} retried={} held={} dead={} acked={} in_sets={}",
            self.moved,
            self.delivered,
            self.reclaimed,
            self.done,
            self.noop,
            self.duplicate,
            self.retried,
            self.held,
            self.dead,
            self.acked,
            self.in_sets,
        )
    }
}

// ---- jobs waiting on contention ----------------------------------------------------------

/// Most jobs [`Contention`] keeps track of; past it, new ones are counted but not named.
const CONTENTION_KEEP: usize = 10_000;

/// An entry not seen again this long after its retry fell due is forgotten: another
/// process ran the job (and counts it itself if it met the lock again).
pub const CONTENTION_FORGET: Duration = Duration::from_secs(15);

/// Jobs that wait on contention (other transactions' locks, statement timeouts) while no
/// job of their event has changed anything for this long have stopped the queue (a `LOCK
/// TABLE`, a long migration, an idle transaction holding the rows every job needs, a
/// trigger slower than the timeout): the warning becomes critical.
pub const CONTENTION_STALL: Duration = Duration::from_secs(30);

/// The role jobs waiting on contention are reported under (a warning; critical while the
/// queue stands still, [`CONTENTION_STALL`]): shown only while this process counts a job
/// waiting.
pub const CONTENTION_ROLE: &str = "contention";

/// Jobs this process sent back to the pool because they met contention (another
/// transaction's lock, a deadlock), by job key: how many wait, and which has waited
/// longest. Written by workers when they send one back and when one finishes; read by
/// `/metrics` and the status page. Bounded by [`CONTENTION_KEEP`].
#[derive(Default)]
pub struct Contention {
    waiting: Mutex<HashMap<String, Waiter>>,
    /// A waiter is [`Hasten::Due`], so the mover's tick looks ([`Contention::to_hasten`]).
    hasten_due: AtomicBool,
    /// `waiting.len()`, so a commit skips the lock when nothing waits.
    len: AtomicU64,
    /// When the jobs waiting now began to (unix ms): the first was sent back while none
    /// waited.
    began_ms: AtomicI64,
    /// Whether the contention problem stands as critical (a standstill) now.
    pub standstill: AtomicBool,
    /// When the map last went empty (local ms): a waiter counted within
    /// [`CONTENTION_FORGET`] of it goes on with the contention that began before.
    emptied_ms: AtomicI64,
    /// When the waiters were last looked at or one was added (this host's unix ms; the
    /// watch looks every second while any waits).
    seen_ms: AtomicI64,
    /// Events whose waiters' holder ended lately, as [`Contention::holders_ended`] saw
    /// it, for [`Contention::waiting`].
    ended_lately: Mutex<HashMap<String, EndedLock>>,
    /// Events whose waiters' lock this process saw end, for the mover to put on record
    /// for every process ([`Contention::ends_to_tell`]).
    to_tell: Mutex<Vec<String>>,
    /// Of each event, the newest end of its lock on record that this process told or
    /// acted on (Redis's unix ms; [`Contention::ended_elsewhere`]).
    ends_heard: Mutex<HashMap<String, i64>>,
    /// The long holders this process saw still inside their transactions at the watch's
    /// last look ([`Contention::holders_ended`]): the holders it follows to their end.
    followed: Mutex<Vec<i32>>,
}

/// A lock of an event's waiters that ended ([`Contention::holders_ended`]).
struct EndedLock {
    /// When the watch saw it end (local ms).
    at_ms: i64,
    /// The sessions whose transactions ended.
    ended: Vec<i32>,
}

/// A lock waiter counted this long or less after a lock of its event ended, whose reason
/// names one of the sessions that ended or none, is brought forward as it is counted: its
/// wait gave up as the lock ended and it was counted after the look that brought the
/// others forward (found in a test: such jobs ran at the end of their backoff, 7 s after
/// the lock), or it met the rush of the jobs freed with it, each waiting briefly for the
/// rows of another's transaction, and no holder was looked up for it (once a second per
/// worker; found in a test under load: 19–23 of 600 jobs behind a 6 s lock ran at the end
/// of their backoff, 8 s after it). One that names another holder is followed to that
/// holder's end. A lock met within it that lasts is tried against at most that long, each
/// try a brief wait.
const ENDED_LATELY_MS: i64 = 3_000;

/// Whether a lock waiter whose reason names `holder` is freed as the sessions `ended`
/// end, the long holders `still_held` staying inside their transactions; `event_freed`:
/// another waiter of its event named one of `ended`. Freed: behind one of `ended`; or, of
/// such an event, behind no named holder (of the jobs waiting for one row only the first
/// in line is told whose lock it is, and a holder is looked up at most once a second per
/// worker) or behind a session that is not a long holder still in its transaction (mostly
/// another worker's, itself waiting on the lock that ended; found from outside: such jobs
/// ran at the end of their backoff, 6–10 s after the lock).
fn behind_ended(holder: Option<i32>, ended: &[i32], still_held: &[i32], event_freed: bool) -> bool {
    match holder {
        Some(p) if ended.contains(&p) => true,
        Some(p) => event_freed && !still_held.contains(&p),
        None => event_freed,
    }
}

/// How long a waiter's retry is gone from the pool, no worker of this process having
/// taken it, before the waiter is forgotten ([`Contention::looked`]).
pub const LEFT_GRACE: Duration = Duration::from_secs(2);

/// A gap between two looks at the waiters longer than this is a time the process did not
/// run (SIGSTOP, a frozen VM): nothing is forgotten for it.
const PAUSED_AFTER: Duration = Duration::from_secs(3);

/// One job waiting on contention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter {
    pub key: String,
    pub event: String,
    /// When the job first fell due (unix ms): it has waited since.
    pub since_ms: i64,
    /// The last failure, as PostgreSQL said it.
    pub reason: String,
    /// It waited for another transaction's lock (a lock timeout): never a dead letter,
    /// however long, and critical past `--retry-for` and `--max-retries`.
    pub lock: bool,
    /// The retries it has been sent back with.
    pub retries: u32,
    /// When the retry it was last sent back with falls due (unix ms), later under a slow
    /// `--max-rate` (two of its slots), or later still while this process holds the job
    /// ([`Contention::held`]): it is forgotten [`CONTENTION_FORGET`] after.
    pub due_ms: i64,
    /// The session its reason names as holding the lock it waited for (a pid).
    pub holder: Option<i32>,
    /// The retry it went back to the pool with, its score and the SHA-1 of its message
    /// (hex; kept small however large the message): it is brought forward only while it
    /// is that very retry ([`Contention::to_hasten`]).
    pub retry: Option<(i64, String)>,
    pub hasten: Hasten,
    /// A worker of this process took the job since it was counted
    /// ([`Contention::taken`]): it is not forgotten for its retry's leaving the pool.
    pub in_hand: bool,
    /// When its retry was first seen gone from the pool (local ms, later by the time this
    /// process had jobs queued since): [`Contention::looked`].
    pub left_ms: Option<i64>,
}

impl Waiter {
    /// It waits for another transaction's lock, its retry in the pool (as written) and
    /// not brought forward yet: one that a lock's end brings forward.
    fn waits_for_lock(&self) -> bool {
        self.lock && self.hasten == Hasten::No && self.retry.is_some()
    }
}

/// Where bringing a lock waiter's retry forward stands, once the transaction that held
/// its lock has ended ([`Contention::holders_ended`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hasten {
    No,
    /// To be brought forward by the mover's next ticks, since this time (local ms): until
    /// its retry is in the pool (the worker writes it with its batch's acks, up to a tenth
    /// of a second after the failure) or for [`HASTEN_TRIED_FOR`].
    Due(i64),
    /// Brought forward (or found to be another retry by then): not again for this failure.
    Done,
}

impl Contention {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Waiter>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `len` (and when the map went empty) with the map `w`, locked.
    fn counted(&self, w: &HashMap<String, Waiter>) {
        if w.is_empty() && self.len.swap(0, Relaxed) > 0 {
            self.emptied_ms.store(crate::now_ms(), Relaxed);
        }
        self.len.store(w.len() as u64, Relaxed);
    }

    /// The contention of the jobs waiting now began no later than `local_ms`
    /// ([`crate::manners::Manners::contended_for`]: their sets met it before any of them
    /// went back to the pool).
    pub fn began_by(&self, local_ms: i64) {
        if self.len.load(Relaxed) > 0 {
            self.began_ms.fetch_min(local_ms, Relaxed);
        }
    }

    /// This process had jobs read and waiting for a worker through the last `ms`: its
    /// waiters' retries may be among them, so that time does not count towards their
    /// forgetting ([`CONTENTION_FORGET`]). Found in a test: with 2,000 jobs behind rows
    /// the shop held, the workers took longer than that to come back to each retry, every
    /// waiter was forgotten in turn, and the standstill was counted afresh each time.
    pub fn queued_for(&self, ms: i64) {
        if self.len.load(Relaxed) == 0 {
            return;
        }
        for v in self.lock().values_mut() {
            v.due_ms = v.due_ms.saturating_add(ms);
            v.left_ms = v.left_ms.map(|l| l.saturating_add(ms));
        }
    }

    /// A worker of this process took these jobs ([`Waiter::in_hand`]).
    pub fn taken<'k>(&self, keys: impl Iterator<Item = &'k str>) {
        if self.len.load(Relaxed) == 0 {
            return;
        }
        let mut w = self.lock();
        for k in keys {
            if let Some(v) = w.get_mut(k) {
                v.in_hand = true;
            }
        }
    }

    /// How long jobs have waited while none of their event changed anything (`applied_ms`,
    /// [`Metrics::applied_ms`]; a paid order's no-op does not count), when that is
    /// [`CONTENTION_STALL`] or more: the event's queue stands still.
    pub fn standing_still(&self, applied_ms: i64, now_ms: i64) -> Option<Duration> {
        let idle = now_ms - applied_ms.max(self.began_ms.load(Relaxed));
        (idle >= CONTENTION_STALL.as_millis() as i64).then(|| Duration::from_millis(idle as u64))
    }

    /// A job went back to the pool after contention it met at `met_ms` (local ms), its
    /// retry due at `due_ms`, with `retries`; `lock`: the contention was another
    /// transaction's lock ([`Waiter::lock`]); `retry`: the retry's score and message in
    /// the pool ([`Waiter::retry`]).
    #[allow(clippy::too_many_arguments)]
    pub fn waiting(
        &self,
        key: &str,
        event: &str,
        since_ms: i64,
        (reason, lock, retries): (&str, bool, u32),
        due_ms: i64,
        met_ms: i64,
        retry: Option<(i64, &[u8])>,
    ) {
        let mut w = self.lock();
        self.seen_ms.store(crate::now_ms(), Relaxed);
        if w.is_empty()
            && met_ms - self.emptied_ms.load(Relaxed) > CONTENTION_FORGET.as_millis() as i64
        {
            self.began_ms.store(met_ms, Relaxed);
        }
        if w.len() >= CONTENTION_KEEP && !w.contains_key(key) {
            w.retain(|_, v| forgotten_after(v) > due_ms);
            if w.len() >= CONTENTION_KEEP {
                return;
            }
        }
        let holder = lock.then(|| crate::blocker::holder_pid(reason)).flatten();
        let local = crate::now_ms();
        let late = lock && retry.is_some() && {
            let lately = self.ended_lately.lock().unwrap_or_else(|p| p.into_inner());
            lately.get(event).is_some_and(|e| {
                local - e.at_ms <= ENDED_LATELY_MS && holder.is_none_or(|p| e.ended.contains(&p))
            })
        };
        w.insert(
            key.to_string(),
            Waiter {
                key: key.to_string(),
                event: event.to_string(),
                since_ms,
                reason: reason.to_string(),
                lock,
                retries,
                due_ms,
                holder,
                retry: retry
                    .map(|(score, msg)| (score, sha1_smol::Sha1::from(msg).digest().to_string())),
                hasten: if late { Hasten::Due(local) } else { Hasten::No },
                in_hand: false,
                left_ms: None,
            },
        );
        if late {
            self.hasten_due.store(true, Relaxed);
        }
        self.counted(&w);
    }

    /// The sessions named as holding the locks that jobs waiting now waited for, each
    /// once: the PostgreSQL watch looks whether their transactions have ended
    /// ([`Contention::holders_ended`]).
    pub fn holders(&self) -> Vec<i32> {
        if self.len.load(Relaxed) == 0 {
            return Vec::new();
        }
        let mut pids: Vec<i32> = self
            .lock()
            .values()
            .filter(|v| v.hasten == Hasten::No && v.retry.is_some())
            .filter_map(|v| v.holder)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The transactions of the sessions `ended` (of [`Contention::holders`]) have ended,
    /// so the locks their waiters waited for are gone: the retries of the waiters those
    /// ends free ([`behind_ended`]; `still_held`: the long holders still inside their
    /// transactions, a waiter behind one of them waits on) are brought forward at the
    /// mover's next tick. Found from outside: a job behind a 25 s shop lock ran up to the
    /// 30 s backoff after the lock ended, health critical meanwhile naming the gone lock.
    pub fn holders_ended(&self, ended: &[i32], still_held: &[i32]) {
        {
            let mut followed = self.followed.lock().unwrap_or_else(|p| p.into_inner());
            if *followed != still_held {
                *followed = still_held.to_vec();
            }
        }
        if ended.is_empty() {
            return;
        }
        let mut w = self.lock();
        let events: std::collections::HashSet<String> = w
            .values()
            .filter(|v| v.waits_for_lock() && v.holder.is_some_and(|p| ended.contains(&p)))
            .map(|v| v.event.clone())
            .collect();
        let local = crate::now_ms();
        {
            let mut lately = self.ended_lately.lock().unwrap_or_else(|p| p.into_inner());
            lately.retain(|_, e| local - e.at_ms <= ENDED_LATELY_MS);
            lately.extend(events.iter().map(|e| {
                let end = EndedLock {
                    at_ms: local,
                    ended: ended.to_vec(),
                };
                (e.clone(), end)
            }));
        }
        let mut any = false;
        let (mut freed_n, mut left_named, mut left_unnamed) = (0, 0, 0);
        for v in w.values_mut() {
            let freed = behind_ended(v.holder, ended, still_held, events.contains(&v.event));
            if v.waits_for_lock() && freed {
                v.hasten = Hasten::Due(local);
                any = true;
                freed_n += 1;
            } else if v.waits_for_lock() {
                if v.holder.is_some() {
                    left_named += 1;
                } else {
                    left_unnamed += 1;
                }
            }
        }
        log::debug!(
            "the transactions of sessions {ended:?} ended: {freed_n} waiter(s) freed (events {events:?}); {left_named} behind another named holder and {left_unnamed} behind none named wait on"
        );
        if any {
            self.hasten_due.store(true, Relaxed);
        }
        let mut tell = self.to_tell.lock().unwrap_or_else(|p| p.into_inner());
        for e in events {
            if !tell.contains(&e) {
                tell.push(e);
            }
        }
    }

    /// The events whose waiters' lock this process saw end since the last call
    /// ([`Contention::holders_ended`]): the mover puts each on record for every process,
    /// `now_ms` (Redis's clock) as when ([`Contention::ended_elsewhere`]).
    pub fn ends_to_tell(&self, now_ms: i64) -> Vec<String> {
        let told = std::mem::take(&mut *self.to_tell.lock().unwrap_or_else(|p| p.into_inner()));
        if told.is_empty() {
            return told;
        }
        let mut heard = self.ends_heard.lock().unwrap_or_else(|p| p.into_inner());
        for e in &told {
            heard.insert(e.clone(), now_ms);
        }
        told
    }

    /// The events with a job waiting for a lock whose holder this process does not follow
    /// (none named, or one it does not see inside a long transaction: a session of
    /// another role whose state this role may not see, without `pg_read_all_stats`), its
    /// retry not brought forward: the mover asks whether another process saw their lock
    /// end ([`Contention::ended_elsewhere`]).
    pub fn unfollowed_lock_events(&self) -> Vec<String> {
        if self.len.load(Relaxed) == 0 {
            return Vec::new();
        }
        let followed = self.followed();
        let mut events: Vec<String> = self
            .lock()
            .values()
            .filter(|v| v.waits_for_lock() && behind_ended(v.holder, &[], &followed, true))
            .map(|v| v.event.clone())
            .collect();
        events.sort_unstable();
        events.dedup();
        events
    }

    /// Another process saw the lock of these events' waiters end, at these times (Redis's
    /// unix ms; `now_ms` Redis's time now): the retries of the jobs here waiting for a
    /// lock whose holder this process does not follow (none named, or one it does not see
    /// still inside a long transaction) are brought forward, as they would be had this
    /// process seen the end itself ([`Contention::holders_ended`]), once for each end no
    /// older than [`ENDED_LATELY_MS`]; and those naming none counted just after, as there.
    /// Found from outside: with processes restarted during a 60 s lock, 2–4 of 3,000
    /// jobs ran 23–37 s after its end, at the end of their backoff: only a process that
    /// named their holder follows it (a holder is looked up at most once a second per
    /// worker, and a role that may not read a row's `xmax` names none); and a process
    /// whose role may not see other roles' session state follows no holder it names (a
    /// table lock retaken at once as it ended: 160–820 jobs ran up to 37 s after the
    /// second end, in every process).
    pub fn ended_elsewhere(&self, ends: &[(String, i64)], now_ms: i64) {
        let fresh: Vec<&str> = {
            let mut heard = self.ends_heard.lock().unwrap_or_else(|p| p.into_inner());
            ends.iter()
                .filter(|(event, at)| {
                    // Not ahead of now by more than a moment either: a value written
                    // by hand far ahead would hide every end after it.
                    let new = (now_ms - at).abs() <= ENDED_LATELY_MS
                        && heard.get(event).is_none_or(|seen| at > seen);
                    if new {
                        heard.insert(event.clone(), *at);
                    }
                    new
                })
                .map(|(event, _)| event.as_str())
                .collect()
        };
        if fresh.is_empty() {
            return;
        }
        let local = crate::now_ms();
        let mut w = self.lock();
        {
            let mut lately = self.ended_lately.lock().unwrap_or_else(|p| p.into_inner());
            // One this process saw itself, lately, stands.
            for e in &fresh {
                if lately
                    .get(*e)
                    .is_none_or(|l| local - l.at_ms > ENDED_LATELY_MS)
                {
                    let end = EndedLock {
                        at_ms: local,
                        ended: Vec::new(),
                    };
                    lately.insert(e.to_string(), end);
                }
            }
        }
        let followed = self.followed();
        let mut freed = 0;
        for v in w.values_mut() {
            if v.waits_for_lock()
                && behind_ended(v.holder, &[], &followed, true)
                && fresh.contains(&v.event.as_str())
            {
                v.hasten = Hasten::Due(local);
                freed += 1;
            }
        }
        if freed > 0 {
            self.hasten_due.store(true, Relaxed);
            log::debug!(
                "another process saw the lock of {fresh:?} end: {freed} waiter(s) here freed"
            );
        }
    }

    /// The long holders the watch saw still inside their transactions at its last look.
    fn followed(&self) -> Vec<i32> {
        self.followed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The retries to bring forward now, as `(job key, score, SHA-1 of the message)`:
    /// those marked [`Hasten::Due`] less than [`HASTEN_TRIED_FOR`] ago (older ones are
    /// given up, [`Hasten::Done`]). The mover tells which it brought forward
    /// ([`Contention::brought_forward`]); the others are asked for again at its next tick.
    pub fn to_hasten(&self) -> Vec<(String, i64, String)> {
        if !self.hasten_due.swap(false, Relaxed) {
            return Vec::new();
        }
        let local = crate::now_ms();
        let mut w = self.lock();
        let mut out = Vec::new();
        for v in w.values_mut() {
            let Hasten::Due(since) = v.hasten else {
                continue;
            };
            if local - since >= HASTEN_TRIED_FOR.as_millis() as i64 {
                v.hasten = Hasten::Done;
            } else if let Some((score, msg)) = &v.retry {
                out.push((v.key.clone(), *score, msg.clone()));
            }
        }
        if !out.is_empty() {
            self.hasten_due.store(true, Relaxed);
        }
        out
    }

    /// The retries of these jobs were brought forward, due at `now_ms` (Redis's clock):
    /// each is brought forward once ([`Hasten::Done`]), and it is forgotten
    /// [`CONTENTION_FORGET`] from now unless this process meets it again, or sooner once
    /// its retry has left the pool ([`Contention::looked`]).
    pub fn brought_forward(&self, keys: &[String], now_ms: i64) {
        if keys.is_empty() {
            return;
        }
        let mut w = self.lock();
        for k in keys {
            if let Some(v) = w.get_mut(k).filter(|v| matches!(v.hasten, Hasten::Due(_))) {
                v.hasten = Hasten::Done;
                v.due_ms = v.due_ms.min(now_ms);
            }
        }
    }

    /// The job keys of the waiters whose retries the mover looks for in the pool
    /// ([`Contention::looked`]): those brought forward ([`Hasten::Done`]), and those with
    /// a retry that no worker of this process has taken since.
    pub fn to_look(&self) -> Vec<String> {
        if self.len.load(Relaxed) == 0 {
            return Vec::new();
        }
        self.lock()
            .values()
            .filter(|v| v.hasten == Hasten::Done || (v.retry.is_some() && !v.in_hand))
            .map(|v| v.key.clone())
            .collect()
    }

    /// What the mover found of [`Contention::to_look`]'s retries: each job key with its
    /// score in the pool now (`None`: not there), `now_ms` Redis's time. A waiter whose
    /// retry has left the pool (moved to be run, here or by a peer) or was replaced (a
    /// peer's retry of it, a push) waits here no more: a job this process runs and that
    /// meets the lock again is counted again, one a peer runs is the peer's.
    /// - Brought forward: once its retry is gone or due later. Found from outside: a
    ///   process whose waiters a peer ran stayed red 15 s after the lock's end (forgotten
    ///   only then), or turned red after the recovery, its queue standing still for it
    ///   alone.
    /// - Not taken by a worker here: once replaced, or gone for [`LEFT_GRACE`] (time for
    ///   this process to read and take it, had it come here; time with jobs queued here
    ///   not counted, [`Contention::queued_for`]). Found from outside: with three
    ///   processes, the waiters whose reasons named no holder (so none was followed to
    ///   its end) were counted, and warned of, 14–19 s after every job was done.
    pub fn looked(&self, found: &[(String, Option<i64>)], now_ms: i64) {
        if found.is_empty() {
            return;
        }
        let local = crate::now_ms();
        let mut w = self.lock();
        for (k, score) in found {
            let Some(v) = w.get_mut(k) else { continue };
            let forget = match (v.hasten, &v.retry) {
                (Hasten::Done, _) => score.is_none_or(|s| s > now_ms),
                (_, Some((retry, _))) if !v.in_hand => match score {
                    Some(s) if *s == *retry => {
                        v.left_ms = None;
                        false
                    }
                    Some(_) => true,
                    None => {
                        let left = *v.left_ms.get_or_insert(local);
                        local - left >= LEFT_GRACE.as_millis() as i64
                    }
                },
                _ => false,
            };
            if forget {
                w.remove(k);
            }
        }
        self.counted(&w);
    }

    /// A job finished (committed, a duplicate, or a dead letter): it waits no more. True
    /// when it was the last job waiting.
    pub fn finished(&self, key: &str) -> bool {
        if self.len.load(Relaxed) == 0 {
            return false;
        }
        let mut w = self.lock();
        let was = w.remove(key).is_some();
        self.counted(&w);
        was && w.is_empty()
    }

    /// Jobs this process holds, by job key (waiting for their `--max-rate` slots, or for a
    /// worker while every worker waits for slots): those waiting on contention are not
    /// forgotten before `until_ms` (+ [`CONTENTION_FORGET`]). Under a cap whose slots are
    /// seconds apart a job met the lock, went back, and waited for its next slot longer
    /// than it takes to be forgotten as another process's: nothing was left waiting, and
    /// health stayed green through a standstill under 2/m.
    pub fn held<K: AsRef<str>>(&self, keys: impl Iterator<Item = K>, until_ms: i64) {
        if self.len.load(Relaxed) == 0 {
            return;
        }
        let mut w = self.lock();
        for k in keys {
            if let Some(v) = w.get_mut(k.as_ref()) {
                v.due_ms = v.due_ms.max(until_ms);
            }
        }
    }

    /// The jobs waiting as of `now_ms`, those forgotten by then gone. A time the process
    /// did not run forgets none: each waiter's retry is taken as that much later (found
    /// from outside: a worker stopped for 35 s during a lock every job met forgot its
    /// waiters and was green for 30 s more, counting the standstill afresh).
    fn current(&self, now_ms: i64) -> MutexGuard<'_, HashMap<String, Waiter>> {
        let mut w = self.lock();
        let local = crate::now_ms();
        let seen = self.seen_ms.swap(local, Relaxed);
        let paused = local - seen;
        if seen > 0 && paused > PAUSED_AFTER.as_millis() as i64 {
            for v in w.values_mut() {
                v.due_ms = v.due_ms.saturating_add(paused);
            }
        }
        w.retain(|_, v| forgotten_after(v) > now_ms);
        self.counted(&w);
        w
    }

    /// The events of the jobs waiting on contention as of `now_ms`, each once.
    pub fn events(&self, now_ms: i64) -> Vec<String> {
        if self.len.load(Relaxed) == 0 {
            return Vec::new();
        }
        let w = self.current(now_ms);
        let mut events: Vec<String> = w.values().map(|v| v.event.clone()).collect();
        events.sort_unstable();
        events.dedup();
        events
    }

    /// Whether a job of `event` other than `key` waits on contention as of `now_ms`.
    pub fn others_wait(&self, event: &str, key: &str, now_ms: i64) -> bool {
        if self.len.load(Relaxed) == 0 {
            return false;
        }
        self.current(now_ms)
            .values()
            .any(|v| v.event == event && v.key != key)
    }

    /// [`Contention::summary`], and of the jobs waiting for another transaction's lock,
    /// sent back at least `retries` times, the one waiting longest: one look for both.
    pub fn summary_with_lock_wait(
        &self,
        now_ms: i64,
        retries: u32,
    ) -> (usize, Option<Waiter>, Option<Waiter>) {
        if self.len.load(Relaxed) == 0 {
            return (0, None, None);
        }
        let w = self.current(now_ms);
        let longest = |lock_only: bool| {
            w.values()
                .filter(|v| !lock_only || (v.lock && v.retries >= retries))
                .min_by_key(|v| v.since_ms)
                .cloned()
        };
        (w.len(), longest(false), longest(true))
    }

    /// How many jobs wait on contention as of `now_ms`, and the one waiting longest.
    pub fn summary(&self, now_ms: i64) -> (usize, Option<Waiter>) {
        if self.len.load(Relaxed) == 0 {
            return (0, None);
        }
        let w = self.current(now_ms);
        let longest = w.values().min_by_key(|v| v.since_ms).cloned();
        (w.len(), longest)
    }
}

/// How long a waiter's retry is looked for to be brought forward ([`Hasten::Due`]): one
/// not found by then was moved, run by a peer or pushed again. Found from outside: with
/// two processes and 2,000 jobs behind a lock, up to 74 ran at the end of their backoff,
/// their retries written just after the one look that brought the others forward.
pub const HASTEN_TRIED_FOR: Duration = Duration::from_secs(2);

/// When an entry is forgotten unless this process meets its job again.
fn forgotten_after(w: &Waiter) -> i64 {
    w.due_ms
        .saturating_add(CONTENTION_FORGET.as_millis() as i64)
}

// ---- per-job counters by event, and the histograms -------------------------------------

/// The label of every event no registered handler has.
pub const OTHER_EVENT: &str = "_other";

/// How a job ended, as the workers count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOutcome {
    /// Committed with an effect.
    Done,
    /// Committed, nothing to change (a paid order, ...).
    NoOp,
    /// The inbox already held the job (a redelivery).
    Duplicate,
    /// Back to the delay pool after a transient failure.
    Retry,
    /// Back to the delay pool for a while, no retry spent: the schema or a privilege the
    /// handler needs is missing (see `workers.rs`).
    Held,
    /// To the dead letters.
    Dead,
}

const OUTCOMES: [(JobOutcome, &str); 6] = [
    (JobOutcome::Done, "done"),
    (JobOutcome::NoOp, "noop"),
    (JobOutcome::Duplicate, "duplicate"),
    (JobOutcome::Retry, "retry"),
    (JobOutcome::Held, "held"),
    (JobOutcome::Dead, "dead"),
];

/// Upper bounds (seconds) of the handler duration buckets: a transaction of a few
/// statements up to the statement timeout.
const HANDLER_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Upper bounds (seconds) of the lateness buckets: on time, a backlog, an outage.
const LATENESS_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// A fixed-bucket histogram: one atomic per bucket (not cumulative; summed when
/// rendered), the sum in microseconds. Negative observations count as zero.
pub struct Histogram {
    bounds: &'static [f64],
    /// `counts[i]` for `bounds[i]`; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        let s = if seconds.is_finite() {
            seconds.max(0.0)
        } else {
            0.0
        };
        let i = self.bounds.partition_point(|&b| b < s);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add((s * 1e6) as u64, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// `name_bucket`, `name_sum`, `name_count` lines; `labels` is `k="v",` or empty.
    /// The count is the `+Inf` bucket, so the two always agree within one scrape.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = match self.bounds.get(i) {
                Some(b) => b.to_string(),
                None => "+Inf".to_string(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{le}\"}} {cumulative}");
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", labels.trim_end_matches(','))
        };
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// What one event slot counts.
struct EventMetrics {
    name: String,
    /// Indexed like [`OUTCOMES`].
    outcomes: [AtomicU64; 6],
    handler: Histogram,
    /// When a job of the event last went through (committed, or found done), and last
    /// changed something (applied, in this process or, as the inbox said, in another),
    /// unix ms.
    through_ms: AtomicI64,
    applied_ms: AtomicI64,
    /// When this process last asked the inbox whether a job of the event changed
    /// something (local ms; [`Metrics::ask_inbox`]).
    asked_ms: AtomicI64,
    /// Jobs of the event PostgreSQL refused here and not yet decided: their keys and when
    /// they were last refused (local ms; [`Metrics::refused`]). Touched only on a refusal.
    refused: Mutex<HashMap<String, i64>>,
    /// Refusals a refused job went through after (a rule switched off meanwhile): each
    /// one's first words and when it lapsed (local ms; [`Metrics::refusal_lapsed`]), the
    /// newest [`LAPSES_KEPT`].
    lapses: Mutex<Vec<(String, i64)>>,
    /// How many `refused` holds, read without the lock on every job that goes through.
    refused_len: AtomicU64,
    /// When a job of the event was last held by a schema fault and by a refusal of every
    /// job, and when a held job last ran as the event's probe (local ms;
    /// [`Metrics::may_run_held`]).
    held_ms: AtomicI64,
    held_refused_ms: AtomicI64,
    probed_ms: AtomicI64,
}

/// The refusals of one event remembered as lapsed ([`Metrics::refusal_lapsed`]).
const LAPSES_KEPT: usize = 8;

/// A lapse seen again within this long is not news ([`Metrics::refusal_lapsed`]).
const LAPSE_TOLD_EVERY_MS: i64 = 1_000;

/// While an event's jobs are held, one process runs at most one held job of it this often
/// (the probe); the others go back untried ([`Metrics::may_run_held`]).
pub const HELD_PROBE_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether `now_ms` is at least `every` after the time in `last`, which it then becomes:
/// for one caller only, however many threads ask at once.
fn once_every(last: &AtomicI64, every: std::time::Duration, now_ms: i64) -> bool {
    let was = last.load(Relaxed);
    now_ms - was >= every.as_millis() as i64
        && last.compare_exchange(was, now_ms, Relaxed, Relaxed).is_ok()
}

/// At most this many refused jobs remembered per event ([`Metrics::refused`]); past it the
/// oldest is forgotten.
const REFUSED_KEPT: usize = 1024;

/// How often one process asks the inbox, per event, whether a job of it changed
/// something ([`Metrics::ask_inbox`]).
pub const ASK_INBOX_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The per-job figures. Written by every worker (atomics only), read by the metrics
/// thread; nothing to do at shutdown.
pub struct Metrics {
    /// One slot per registered event, then `_other`; never grows after `new`.
    events: Vec<EventMetrics>,
    index: HashMap<String, usize>,
    /// Commit time minus the due time the mover recorded, of committed jobs (done, noop).
    lateness: Histogram,
    /// The same figures, minute by minute over the last hour.
    history: History,
}

impl Default for Metrics {
    /// No registered event: everything counts under `_other` (tests).
    fn default() -> Self {
        Metrics::new(std::iter::empty::<String>())
    }
}

impl Metrics {
    /// The registered events' names (without `_other`), sorted.
    pub fn event_names(&self) -> impl Iterator<Item = &str> {
        self.events
            .iter()
            .map(|e| e.name.as_str())
            .filter(|n| *n != OTHER_EVENT)
    }

    /// One slot per event name (the registry's), plus `_other`.
    pub fn new<S: Into<String>>(events: impl IntoIterator<Item = S>) -> Metrics {
        let mut names: Vec<String> = events.into_iter().map(Into::into).collect();
        names.retain(|n| n != OTHER_EVENT);
        names.sort();
        names.dedup();
        names.push(OTHER_EVENT.to_string());
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        let events = names
            .into_iter()
            .map(|name| EventMetrics {
                name,
                outcomes: Default::default(),
                handler: Histogram::new(HANDLER_BOUNDS),
                through_ms: AtomicI64::new(crate::now_ms()),
                applied_ms: AtomicI64::new(0),
                asked_ms: AtomicI64::new(0),
                refused: Mutex::new(HashMap::new()),
                lapses: Mutex::new(Vec::new()),
                refused_len: AtomicU64::new(0),
                held_ms: AtomicI64::new(0),
                held_refused_ms: AtomicI64::new(0),
                probed_ms: AtomicI64::new(0),
            })
            .collect();
        Metrics {
            events,
            index,
            lateness: Histogram::new(LATENESS_BOUNDS),
            history: History::default(),
        }
    }

    fn slot(&self, event: &str) -> &EventMetrics {
        let i = self
            .index
            .get(event)
            .copied()
            .unwrap_or(self.events.len() - 1);
        &self.events[i]
    }

    /// A job of `event` went through at `now_ms`; `applied`: it changed something.
    pub fn went_through(&self, event: &str, applied: bool, now_ms: i64) {
        let slot = self.slot(event);
        slot.through_ms.store(now_ms, Relaxed);
        if applied {
            self.applied_at(event, now_ms);
        }
    }

    /// A job of `event` changed something at `at_ms` (local ms) in some process, as the
    /// inbox says.
    pub fn applied_at(&self, event: &str, at_ms: i64) {
        self.slot(event).applied_ms.fetch_max(at_ms, Relaxed);
    }

    /// Whether this process may ask the inbox now whether a job of `event` changed
    /// something: at most once every [`ASK_INBOX_EVERY`] per event, however many jobs
    /// of it are held.
    pub fn ask_inbox(&self, event: &str, now_ms: i64) -> bool {
        once_every(&self.slot(event).asked_ms, ASK_INBOX_EVERY, now_ms)
    }

    /// PostgreSQL refused the job `key` of `event` at `at_ms` (local ms), not yet decided.
    pub fn refused(&self, event: &str, key: &str, at_ms: i64) {
        let slot = self.slot(event);
        let applied = slot.applied_ms.load(Relaxed);
        let mut refused = slot.refused.lock().unwrap_or_else(|p| p.into_inner());
        if refused.len() >= REFUSED_KEPT && !refused.contains_key(key) {
            refused.retain(|_, at| *at > applied);
            if refused.len() >= REFUSED_KEPT {
                let oldest = refused
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    refused.remove(&k);
                }
            }
        }
        refused.insert(key.to_string(), at_ms);
        slot.refused_len.store(refused.len() as u64, Relaxed);
    }

    /// A job of `event` that PostgreSQL had refused with `gist` (the refusal's first
    /// words) went through at `at_ms` (local ms): that refusal comes and goes, a rule
    /// switched on and off rather than one about the jobs it refuses.
    /// `true` unless the same lapse was remembered within the last second (so that the
    /// caller tells the fleet once, not once for each of a burst of jobs going through).
    pub fn refusal_lapsed(&self, event: &str, gist: &str, at_ms: i64) -> bool {
        let slot = self.slot(event);
        let mut lapses = slot.lapses.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = !lapses
            .iter()
            .any(|(g, at)| g == gist && *at > at_ms - LAPSE_TOLD_EVERY_MS);
        lapses.retain(|(g, _)| g != gist);
        if lapses.len() >= LAPSES_KEPT {
            lapses.remove(0);
        }
        lapses.push((gist.to_string(), at_ms));
        fresh
    }

    /// Whether a refusal of `event` with `gist` lapsed after `since_ms` (local ms):
    /// [`Metrics::refusal_lapsed`].
    pub fn lapsed_since(&self, event: &str, gist: &str, since_ms: i64) -> bool {
        let slot = self.slot(event);
        let lapses = slot.lapses.lock().unwrap_or_else(|p| p.into_inner());
        lapses.iter().any(|(g, at)| g == gist && *at > since_ms)
    }

    /// Job `key` of `event` is decided (it went through, or is a dead letter): a refusal
    /// of it no longer says anything about the other jobs. One atomic load when none is
    /// remembered.
    pub fn refusal_decided(&self, event: &str, key: &str) {
        let slot = self.slot(event);
        if slot.refused_len.load(Relaxed) == 0 {
            return;
        }
        let mut refused = slot.refused.lock().unwrap_or_else(|p| p.into_inner());
        refused.remove(key);
        slot.refused_len.store(refused.len() as u64, Relaxed);
    }

    /// When this process last saw PostgreSQL refuse a job of `event` other than `key`,
    /// undecided, since a job of the event last changed something (local ms).
    pub fn other_refused_ms(&self, event: &str, key: &str) -> Option<i64> {
        let slot = self.slot(event);
        let applied = slot.applied_ms.load(Relaxed);
        let refused = slot.refused.lock().unwrap_or_else(|p| p.into_inner());
        refused
            .iter()
            .filter(|(k, at)| k.as_str() != key && **at > applied)
            .map(|(_, at)| *at)
            .max()
    }

    /// A job of `event` was held at `now_ms` (local ms): by a schema fault (`refused`
    /// false), or by a refusal no job of the event has shown to be its own.
    pub fn held(&self, event: &str, refused: bool, now_ms: i64) {
        let slot = self.slot(event);
        let at = if refused {
            &slot.held_refused_ms
        } else {
            &slot.held_ms
        };
        at.fetch_max(now_ms, Relaxed);
    }

    /// Whether jobs of `event` are held by a refusal no job of the event has shown to be
    /// its own (none changed anything since).
    pub fn held_by_refusal(&self, event: &str) -> bool {
        let slot = self.slot(event);
        slot.held_refused_ms.load(Relaxed) > slot.applied_ms.load(Relaxed)
    }

    /// Whether a job of `event` that was held before may run now: yes when no job of the
    /// event has been held by a schema fault since one last went through, nor by a
    /// refusal since one last changed something (a no-op passes what refuses changes);
    /// else only as the event's probe, one every [`HELD_PROBE_EVERY`] in this process, so
    /// that a thousand held jobs cost the shop's database ten failing transactions a
    /// second, not two hundred. The first probe that goes through opens the way for the
    /// rest at their next look.
    pub fn may_run_held(&self, event: &str, now_ms: i64) -> bool {
        let slot = self.slot(event);
        if slot.held_ms.load(Relaxed) <= slot.through_ms.load(Relaxed)
            && !self.held_by_refusal(event)
        {
            return true;
        }
        once_every(&slot.probed_ms, HELD_PROBE_EVERY, now_ms)
    }

    /// When a job of `event` last changed something (0: none yet).
    pub fn applied_ms(&self, event: &str) -> i64 {
        self.slot(event).applied_ms.load(Relaxed)
    }

    /// Counts one finished job.
    pub fn job(&self, event: &str, outcome: JobOutcome) {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        self.slot(event).outcomes[i].fetch_add(1, Relaxed);
        self.history.job(crate::now_ms(), outcome);
    }

    /// Times one handler transaction (inbox row, handler, commit or failure).
    pub fn handler_time(&self, event: &str, d: Duration) {
        self.slot(event).handler.observe(d.as_secs_f64());
    }

    /// Records how late a committed job took effect; nothing when the due time is unknown
    /// (an entry a producer XADDed by hand).
    pub fn lateness(&self, due_ms: Option<i64>, committed_ms: i64) {
        if let Some(due) = due_ms {
            let late_ms = committed_ms.saturating_sub(due);
            self.lateness.observe(late_ms as f64 / 1000.0);
            // The minute slot on this host's clock, as the job's outcome's (`job`).
            self.history.lateness(crate::now_ms(), late_ms);
        }
    }

    /// The last hour, minute by minute, as of `now_ms`.
    pub fn last_hour(&self, now_ms: i64) -> Hour {
        self.history.last_hour(now_ms)
    }

    /// Dead letters this process wrote in the last minute (the 60 seconds up to `now_ms`,
    /// counted to the second).
    pub fn dead_last_minute(&self, now_ms: i64) -> u64 {
        self.history.dead_last_minute(now_ms)
    }

    /// Jobs of `event` (or `_other`) that ended with `outcome`.
    pub fn jobs(&self, event: &str, outcome: JobOutcome) -> u64 {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        self.slot(event).outcomes[i].load(Relaxed)
    }

    /// Jobs of every event that ended with `outcome`.
    pub fn total(&self, outcome: JobOutcome) -> u64 {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        self.events
            .iter()
            .map(|e| e.outcomes[i].load(Relaxed))
            .sum()
    }

    /// Committed jobs whose lateness was recorded.
    pub fn lateness_count(&self) -> u64 {
        self.lateness.count()
    }

    pub(crate) fn render(&self, out: &mut String) {
        header(
            out,
            "delay_worker_jobs_total",
            "counter",
            "Jobs finished by the worker pool, by event and outcome (done, noop, duplicate, retry, held, dead).",
        );
        for e in &self.events {
            for (i, (_, name)) in OUTCOMES.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "delay_worker_jobs_total{{event=\"{}\",outcome=\"{name}\"}} {}",
                    escape(&e.name),
                    e.outcomes[i].load(Relaxed)
                );
            }
        }
        header(
            out,
            "delay_worker_handler_duration_seconds",
            "histogram",
            "Time of one job's PostgreSQL transaction (inbox row, handler, commit), by event.",
        );
        for e in self.events.iter().filter(|e| e.name != OTHER_EVENT) {
            let labels = format!("event=\"{}\",", escape(&e.name));
            e.handler
                .render(out, "delay_worker_handler_duration_seconds", &labels);
        }
        header(
            out,
            "delay_worker_lateness_seconds",
            "histogram",
            "Commit time minus due time of committed jobs (done and noop) whose due time is known.",
        );
        self.lateness
            .render(out, "delay_worker_lateness_seconds", "");
        header(
            out,
            "delay_worker_jobs_refused_waiting",
            "gauge",
            "Jobs PostgreSQL refused in this process (a trigger, a constraint) within the last minute that have neither gone through nor become dead letters: held, or tried again within --refusal-grace, by event.",
        );
        let since = crate::now_ms() - REFUSED_WAITING_WINDOW_MS;
        for e in self.events.iter().filter(|e| e.name != OTHER_EVENT) {
            let waiting = match e.refused_len.load(Relaxed) {
                0 => 0,
                _ => e
                    .refused
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .filter(|at| **at > since)
                    .count(),
            };
            let _ = writeln!(
                out,
                "delay_worker_jobs_refused_waiting{{event=\"{}\"}} {waiting}",
                escape(&e.name)
            );
        }
    }
}

/// A refused job is counted as waiting ([`Metrics::render`]) while its last refusal here
/// is this recent: a waiting job is looked at again at least every 30 s, and one that
/// another process ran is forgotten.
const REFUSED_WAITING_WINDOW_MS: i64 = 60_000;

// ---- the last hour, minute by minute ------------------------------------------------------

/// Minutes the status page looks back: the ring holds this many, the current one included.
pub const HISTORY_MINUTES: usize = 60;

/// Lateness buckets of one minute: below 1 ms, then four per doubling (about 19 % wide)
/// up to 2^24.25 ms (6.5 h), then everything later.
const LATE_BUCKETS: usize = 100;

/// The bucket of a lateness in milliseconds.
fn late_bucket(ms: i64) -> usize {
    if ms < 1 {
        return 0;
    }
    let i = 1 + (4.0 * libm::log2(ms as f64)).floor() as usize;
    i.min(LATE_BUCKETS - 1)
}

/// The upper bound (ms) of a lateness bucket; `None` for the last one, which has none.
fn late_upper_ms(i: usize) -> Option<f64> {
    match i {
        0 => Some(1.0),
        i if i < LATE_BUCKETS - 1 => Some(libm::exp2(i as f64 / 4.0)),
        _ => None,
    }
}

/// One minute of the ring.
struct MinuteSlot {
    /// The unix minute it holds (`ms / 60_000`); another value means the slot is stale.
    minute: i64,
    outcomes: [u32; 6],
    late: [u32; LATE_BUCKETS],
}

impl MinuteSlot {
    const EMPTY: MinuteSlot = MinuteSlot {
        minute: i64::MIN,
        outcomes: [0; 6],
        late: [0; LATE_BUCKETS],
    };
}

/// The last [`HISTORY_MINUTES`] minutes of job outcomes and lateness, in a ring of fixed
/// size (about 25 KB): a slot is reused, zeroed, when its minute comes round again. One
/// short lock per finished job (workers rarely finish within the same microsecond).
/// Dead letters are also counted second by second over the last [`DEAD_WINDOW_S`]
/// seconds, for `--dead-rate-crit`: the minute slots alone would say "the last minute"
/// only to within a minute.
pub struct History {
    ring: Mutex<Box<[MinuteSlot; HISTORY_MINUTES]>>,
    /// `(unix second, dead letters in it)`, the slot of second `s` at `s % DEAD_WINDOW_S`.
    dead_seconds: Mutex<[(i64, u32); DEAD_WINDOW_S]>,
}

/// The seconds the dead-letter rate looks back: one minute.
const DEAD_WINDOW_S: usize = 60;

impl Default for History {
    fn default() -> Self {
        History {
            ring: Mutex::new(Box::new([MinuteSlot::EMPTY; HISTORY_MINUTES])),
            dead_seconds: Mutex::new([(i64::MIN, 0); DEAD_WINDOW_S]),
        }
    }
}

/// One minute as the status page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct MinuteFigures {
    /// Start of the minute, unix ms.
    pub start_ms: i64,
    /// Jobs that committed (done, no-op, duplicate).
    pub committed: u64,
    pub retried: u64,
    pub dead: u64,
    /// Committed jobs whose lateness was recorded, and its percentiles (ms, the upper
    /// bound of the bucket: "at most"); `None` without any.
    pub late_count: u64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// The last hour: [`HISTORY_MINUTES`] minutes, oldest first, the current (partial) one
/// last; and the hour's totals and lateness percentiles.
#[derive(Debug, Clone, PartialEq)]
pub struct Hour {
    pub minutes: Vec<MinuteFigures>,
    pub committed: u64,
    pub retried: u64,
    pub dead: u64,
    pub late_count: u64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// The `q` quantile of a bucket histogram, as the upper bound of its bucket (the last
/// bucket's lower bound, for lateness beyond the buckets); `None` when empty.
fn quantile(late: &[u32; LATE_BUCKETS], q: f64) -> Option<f64> {
    let total: u64 = late.iter().map(|&c| c as u64).sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).max(1);
    let mut seen = 0;
    for (i, &c) in late.iter().enumerate() {
        seen += c as u64;
        if seen >= rank {
            return Some(late_upper_ms(i).unwrap_or(libm::exp2((LATE_BUCKETS - 2) as f64 / 4.0)));
        }
    }
    None
}

impl History {
    fn lock(&self) -> MutexGuard<'_, Box<[MinuteSlot; HISTORY_MINUTES]>> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slot of the minute of `now_ms`, zeroed if it held an older minute.
    fn slot(ring: &mut [MinuteSlot; HISTORY_MINUTES], now_ms: i64) -> &mut MinuteSlot {
        let minute = now_ms.div_euclid(60_000);
        let s = &mut ring[minute.rem_euclid(HISTORY_MINUTES as i64) as usize];
        if s.minute != minute {
            *s = MinuteSlot::EMPTY;
            s.minute = minute;
        }
        s
    }

    pub fn job(&self, now_ms: i64, outcome: JobOutcome) {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        {
            let mut ring = self.lock();
            let s = Self::slot(&mut ring, now_ms);
            s.outcomes[i] = s.outcomes[i].saturating_add(1);
        }
        if outcome == JobOutcome::Dead {
            let second = now_ms.div_euclid(1000);
            let mut dead = self.dead_seconds.lock().unwrap_or_else(|p| p.into_inner());
            let slot = &mut dead[second.rem_euclid(DEAD_WINDOW_S as i64) as usize];
            if slot.0 != second {
                *slot = (second, 0);
            }
            slot.1 = slot.1.saturating_add(1);
        }
    }

    /// Dead letters written in the 60 seconds up to `now_ms` (to the second).
    fn dead_last_minute(&self, now_ms: i64) -> u64 {
        let now = now_ms.div_euclid(1000);
        let dead = self.dead_seconds.lock().unwrap_or_else(|p| p.into_inner());
        dead.iter()
            .filter(|(second, _)| {
                *second <= now && now.saturating_sub(*second) < DEAD_WINDOW_S as i64
            })
            .map(|&(_, n)| n as u64)
            .sum()
    }

    pub fn lateness(&self, now_ms: i64, late_ms: i64) {
        let mut ring = self.lock();
        let s = Self::slot(&mut ring, now_ms);
        let b = &mut s.late[late_bucket(late_ms)];
        *b = b.saturating_add(1);
    }

    /// The hour up to the minute of `now_ms`; minutes nothing happened in are zeros.
    /// Worked out under the lock (a few microseconds), so no copy of the ring is made.
    pub fn last_hour(&self, now_ms: i64) -> Hour {
        let now_minute = now_ms.div_euclid(60_000);
        let mut all = [0u32; LATE_BUCKETS];
        let mut hour = Hour {
            minutes: Vec::with_capacity(HISTORY_MINUTES),
            committed: 0,
            retried: 0,
            dead: 0,
            late_count: 0,
            p50_ms: None,
            p95_ms: None,
            p99_ms: None,
        };
        let ring = self.lock();
        for back in (0..HISTORY_MINUTES as i64).rev() {
            let minute = now_minute - back;
            let slot = &ring[minute.rem_euclid(HISTORY_MINUTES as i64) as usize];
            let s = if slot.minute == minute {
                slot
            } else {
                &MinuteSlot::EMPTY
            };
            let n = |o: JobOutcome| {
                let i = OUTCOMES.iter().position(|(x, _)| *x == o).unwrap_or(0);
                s.outcomes[i] as u64
            };
            let m = MinuteFigures {
                start_ms: minute * 60_000,
                committed: n(JobOutcome::Done) + n(JobOutcome::NoOp) + n(JobOutcome::Duplicate),
                retried: n(JobOutcome::Retry),
                dead: n(JobOutcome::Dead),
                late_count: s.late.iter().map(|&c| c as u64).sum(),
                p50_ms: quantile(&s.late, 0.50),
                p95_ms: quantile(&s.late, 0.95),
                p99_ms: quantile(&s.late, 0.99),
            };
            for (a, b) in all.iter_mut().zip(s.late.iter()) {
                *a = a.saturating_add(*b);
            }
            hour.committed += m.committed;
            hour.retried += m.retried;
            hour.dead += m.dead;
            hour.late_count += m.late_count;
            hour.minutes.push(m);
        }
        drop(ring);
        hour.p50_ms = quantile(&all, 0.50);
        hour.p95_ms = quantile(&all, 0.95);
        hour.p99_ms = quantile(&all, 0.99);
        hour
    }
}

pub(crate) fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

pub(crate) fn sample(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    value: impl std::fmt::Display,
) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// A label value as the exposition format wants it.
pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Resident set size in bytes, from `/proc/self/status` (`VmRSS`, in kB).
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_is_read() {
        assert!(super::resident_memory_bytes().unwrap_or(0) > 0);
    }

    #[test]
    fn histograms_are_cumulative_and_count_what_they_saw() {
        let h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 3.0, -2.0, f64::NAN] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "event=\"e\",");
        assert!(
            out.contains("x_bucket{event=\"e\",le=\"0.1\"} 4\n"),
            "{out}"
        );
        assert!(out.contains("x_bucket{event=\"e\",le=\"1\"} 5\n"), "{out}");
        assert!(
            out.contains("x_bucket{event=\"e\",le=\"+Inf\"} 6\n"),
            "{out}"
        );
        assert!(out.contains("x_count{event=\"e\"} 6\n"), "{out}");
        assert!(out.contains("x_sum{event=\"e\"} 3.65\n"), "{out}");
        assert_eq!(h.count(), 6);
    }

    #[test]
    fn unknown_events_share_one_slot() {
        let m = Metrics::new(["order.timeout"]);
        m.job("order.timeout", JobOutcome::Done);
        m.job("typo.event", JobOutcome::Dead);
        m.job("", JobOutcome::Dead);
        m.lateness(Some(1_000), 1_250);
        m.lateness(None, 1_250);
        assert_eq!(m.jobs("order.timeout", JobOutcome::Done), 1);
        assert_eq!(m.jobs(OTHER_EVENT, JobOutcome::Dead), 2);
        assert_eq!(m.lateness_count(), 1);
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains("delay_worker_jobs_total{event=\"_other\",outcome=\"dead\"} 2"));
        assert!(!out.contains("typo"), "no label per unknown name");
        assert!(
            out.contains("delay_worker_lateness_seconds_count 1\n"),
            "{out}"
        );
    }

    #[test]
    fn a_problem_is_reported_for_a_while() {
        let s = Stats::default();
        assert_eq!(s.problem(1_000), None);
        let what = || "key \"k\" holds a string, not a stream".to_string();
        // Before the report: the problem is met at `now` or after it.
        let now = crate::now_ms();
        assert!(s.report_problem("mover", what()), "logged the first time");
        assert!(!s.report_problem("mover", what()), "not at every step");
        assert!(s.problem(now).unwrap().contains("mover: key"));
        let after_window = crate::now_ms() + PROBLEM_WINDOW.as_millis() as i64 + 1;
        assert_eq!(s.problem(after_window), None);
        assert!(
            !s.clear_problem("mover", now - 1),
            "met during the step: kept"
        );
        assert!(
            s.clear_problem("mover", crate::now_ms() + 1),
            "a clean step clears it"
        );
        assert_eq!(s.problem(now), None);
        assert!(s.report_trouble("inbox pruner", "no DELETE privilege".into()));
        assert!(!s.report_trouble("inbox pruner", "no DELETE privilege".into()));
        assert_eq!(s.problem(now), None, "a trouble never turns health red");
        // Read again: on a busy machine the trouble may be met a millisecond after `now`.
        assert!(s.clear_problem("inbox pruner", crate::now_ms() + 1));
    }

    #[test]
    fn contention_is_told_while_a_job_of_this_process_waits() {
        let s = Stats::default();
        let now = crate::now_ms();
        s.contention.waiting(
            "k1",
            "order.timeout",
            now,
            ("lock timeout", true, 1),
            now + 500,
            now,
            None,
        );
        s.contention.waiting(
            "k2",
            "order.timeout",
            now,
            ("lock timeout", true, 1),
            now + 500,
            now,
            None,
        );
        assert!(s.report_trouble_about(CONTENTION_ROLE, "2 job(s) wait".into(), "k1".into()));
        assert_eq!(s.problems(now).len(), 1);
        assert!(!s.contention.finished("k1"), "k2 still waits");
        assert_eq!(s.problems(now).len(), 1);
        // k2 was run by another process: forgotten once its retry is well past due.
        let later = now + 500 + CONTENTION_FORGET.as_millis() as i64;
        assert_eq!(s.contention.summary(later - 1).0, 1);
        assert!(s.problems(later).is_empty(), "{:?}", s.problems(later));
        assert_eq!(s.contention.summary(later).0, 0);
    }

    /// A standstill is counted from when the jobs' contention began
    /// ([`Contention::began_by`]), a waiter is not forgotten for the time its retry may
    /// have waited in this process's channel ([`Contention::queued_for`]), and a waiter
    /// counted again soon after the last was forgotten goes on with the contention that
    /// began before.
    #[test]
    fn a_standstill_counts_from_when_contention_began_through_waiters_forgotten() {
        let s = Stats::default();
        let c = &s.contention;
        let now = crate::now_ms();
        let lock = (UNNAMED, true, 1);
        c.waiting("a", "order.timeout", now, lock, now + 1_000, now, None);
        assert_eq!(c.standing_still(0, now + 10_000), None);
        c.began_by(now - 20_000);
        let still = |at: i64| c.standing_still(0, at).map(|d| d.as_secs());
        assert_eq!(still(now + 10_000), Some(30));
        c.queued_for(10_000);
        let forget = 1_000 + CONTENTION_FORGET.as_millis() as i64;
        assert_eq!(c.summary(now + forget + 9_000).0, 1, "queued 10 s");
        assert_eq!(c.summary(now + forget + 10_000).0, 0);
        let met = crate::now_ms();
        c.waiting("b", "order.timeout", met, lock, met + 1_000, met, None);
        assert_eq!(still(now + 10_000), Some(30), "the same contention");
    }

    #[test]
    fn the_lock_waiters_of_a_holder_that_ended_are_brought_forward_once() {
        let s = Stats::default();
        let now = crate::now_ms();
        let held = "canceling statement due to lock timeout (55P03): waited for a lock held by pid 42 (idle in transaction, its last statement `LOCK TABLE orders`) on the table orders";
        let wait = |key: &str, event: &str, reason: &str, lock: bool| {
            let retry = Some((now + 20_000, key.as_bytes()));
            let why = (reason, lock, 1);
            s.contention
                .waiting(key, event, now, why, now + 20_000, now, retry);
        };
        wait("a", "order.timeout", held, true);
        // Behind the same lock, its holder not named (a look-up once a second).
        wait(
            "b",
            "order.timeout",
            "canceling statement due to lock timeout (55P03)",
            true,
        );
        // Another event's, and a statement timeout: neither is freed by pid 42.
        wait(
            "c",
            "coupon.expire",
            "canceling statement due to lock timeout (55P03)",
            true,
        );
        wait(
            "d",
            "order.timeout",
            "canceling statement due to statement timeout (57014)",
            false,
        );
        // Behind another worker's session (itself behind pid 42), and behind a long
        // holder still inside its transaction.
        wait(
            "e",
            "order.timeout",
            &held.replace("pid 42", "pid 99"),
            true,
        );
        wait(
            "f",
            "order.timeout",
            &held.replace("pid 42", "pid 55"),
            true,
        );
        assert_eq!(s.contention.holders(), vec![42, 55, 99]);
        assert!(s.contention.to_hasten().is_empty(), "nothing ended yet");
        s.contention.holders_ended(&[7], &[]);
        assert!(s.contention.to_hasten().is_empty(), "another session ended");
        s.contention.holders_ended(&[42], &[55]);
        let freed = || to_hasten_keys(&s.contention);
        assert_eq!(freed(), ["a", "b", "e"]);
        // Only a's and e's retries were in the pool yet (b's is written with its batch's
        // acks): b is asked for again at the next tick, a and e not.
        s.contention
            .brought_forward(&["a".to_string(), "e".to_string()], now);
        assert_eq!(freed(), ["b"]);
        s.contention.brought_forward(&["b".to_string()], now);
        assert!(freed().is_empty(), "once");
        assert_eq!(
            s.contention.holders(),
            vec![55],
            "f's holder left to look at"
        );
        // Due now, run by whichever process: forgotten from now, not from the old retry.
        let soon = now + CONTENTION_FORGET.as_millis() as i64 + 1;
        assert_eq!(s.contention.summary(soon).0, 3, "c, d and f wait on");
        // The job fails again behind a new holder: looked at again.
        wait(
            "a",
            "order.timeout",
            &held.replace("pid 42", "pid 43"),
            true,
        );
        assert_eq!(s.contention.holders(), vec![43, 55]);
        // A retry never found (moved, run by a peer) is given up after a while.
        s.contention.holders_ended(&[43], &[55]);
        if let Some(v) = s.contention.lock().get_mut("a") {
            v.hasten = Hasten::Due(crate::now_ms() - HASTEN_TRIED_FOR.as_millis() as i64);
        }
        assert!(freed().is_empty(), "given up");
        assert!(s.contention.to_look().contains(&"a".to_string()));
        s.contention.looked(&[("a".to_string(), None)], now);
        assert_eq!(
            s.contention.summary(now).0,
            3,
            "a forgotten; c, d and f wait on"
        );
    }

    /// A waiter whose retry has left the pool is forgotten [`LEFT_GRACE`] later unless a
    /// worker here took it; one whose retry a peer's replaced, at once.
    #[test]
    fn a_waiter_whose_retry_left_the_pool_untaken_here_is_forgotten() {
        let s = Stats::default();
        let c = &s.contention;
        let now = crate::now_ms();
        let lock = (UNNAMED, true, 1);
        // A statement cancelled (57014) is no lock wait: followed the same.
        let cancelled = ("canceling statement due to user request (57014)", false, 1);
        for key in ["gone", "taken", "replaced", "there"] {
            let retry = Some((now + 20_000, key.as_bytes()));
            let why = if key == "gone" { cancelled } else { lock };
            c.waiting(key, "order.timeout", now, why, now + 20_000, now, retry);
        }
        c.taken(["taken"].into_iter());
        let mut keys = c.to_look();
        keys.sort();
        assert_eq!(keys, ["gone", "replaced", "there"]);
        let found = |gone: Option<i64>| {
            [
                ("gone".to_string(), gone),
                ("replaced".to_string(), Some(now + 25_000)),
                ("there".to_string(), Some(now + 20_000)),
            ]
        };
        c.looked(&found(None), now);
        assert_eq!(c.summary(now).0, 3, "replaced: a peer's");
        // Back in the pool (a retry written just after the look): the grace starts again.
        c.looked(&found(Some(now + 20_000)), now);
        c.looked(&found(None), now);
        assert_eq!(c.summary(now).0, 3);
        if let Some(v) = c.lock().get_mut("gone") {
            v.left_ms = Some(crate::now_ms() - LEFT_GRACE.as_millis() as i64);
        }
        c.looked(&found(None), now);
        let mut left: Vec<String> = c.lock().keys().cloned().collect();
        left.sort();
        assert_eq!(left, ["taken", "there"]);
    }

    /// A lock wait's reason naming its holder, pid 42, and one naming none.
    const HELD_BY_42: &str = "canceling statement due to lock timeout (55P03): waited for a lock held by pid 42 (idle in transaction, its last statement `SELECT 1`) on the row (0,1) of sku";
    const UNNAMED: &str = "canceling statement due to lock timeout (55P03)";

    #[test]
    fn a_lock_waiter_counted_just_after_its_holder_ended_is_brought_forward() {
        let s = Stats::default();
        let now = crate::now_ms();
        let (held, unnamed) = (HELD_BY_42, UNNAMED);
        let wait = |key: &str, reason: &str, met: i64| {
            let retry = Some((now + 20_000, key.as_bytes()));
            s.contention.waiting(
                key,
                "order.timeout",
                now,
                (reason, true, 1),
                now + 20_000,
                met,
                retry,
            );
        };
        wait("a", held, now);
        s.contention.holders_ended(&[42], &[55]);
        // Their waits gave up as the lock ended, or they met the rush of the jobs freed
        // with them (however long after the end they met it); counted after the look
        // that saw the end: naming no holder, the holder that ended.
        wait("b", unnamed, now + 2_500);
        wait("d", held, now);
        // Another holder named is followed to its end; a long lock still held too.
        wait("f", &held.replace("pid 42", "pid 77"), now);
        wait("e", &held.replace("pid 42", "pid 55"), now);
        assert_eq!(to_hasten_keys(&s.contention), ["a", "b", "d"]);
        // A lock met well after the end is another lock: its backoff holds.
        for e in s.contention.ended_lately.lock().unwrap().values_mut() {
            e.at_ms -= ENDED_LATELY_MS + 1;
        }
        wait("c", unnamed, now);
        assert_eq!(to_hasten_keys(&s.contention), ["a", "b", "d"]);
    }

    #[test]
    fn a_lock_end_another_process_saw_frees_the_waiters_of_holders_not_followed_here_once() {
        let s = Stats::default();
        let now = crate::now_ms();
        let (held, unnamed) = (HELD_BY_42, UNNAMED);
        let wait = |key: &str, event: &str, reason: &str| {
            let retry = Some((now + 20_000, key.as_bytes()));
            s.contention
                .waiting(key, event, now, (reason, true, 1), now + 20_000, now, retry);
        };
        wait("a", "order.timeout", unnamed);
        wait("b", "order.timeout", held);
        wait("c", "coupon.expire", unnamed);
        // Named, its holder's state not seen here (another role's, without
        // pg_read_all_stats): not followed.
        wait("g", "aftersale.timeout", &held.replace("pid 42", "pid 77"));
        // The watch sees pid 42 inside its long transaction: followed here.
        s.contention.holders_ended(&[], &[42]);
        assert_eq!(
            s.contention.unfollowed_lock_events(),
            ["aftersale.timeout", "coupon.expire", "order.timeout"]
        );
        s.contention
            .ended_elsewhere(&[("aftersale.timeout".to_string(), now - 100)], now);
        assert_eq!(to_hasten_keys(&s.contention), ["g"]);
        s.contention.brought_forward(&["g".to_string()], now);
        // An end older than a moment is not news: nothing is brought forward for it.
        let ends = |at: i64| vec![("order.timeout".to_string(), at)];
        s.contention
            .ended_elsewhere(&ends(now - ENDED_LATELY_MS - 1), now);
        assert!(to_hasten_keys(&s.contention).is_empty());
        // A fresh one frees the waiter of its event that names no holder (b's holder is
        // followed here), once.
        s.contention.ended_elsewhere(&ends(now - 100), now);
        assert_eq!(to_hasten_keys(&s.contention), ["a"]);
        s.contention.brought_forward(&["a".to_string()], now);
        wait("d", "order.timeout", unnamed);
        s.contention.ended_elsewhere(&ends(now - 100), now);
        assert_eq!(to_hasten_keys(&s.contention), ["d"], "counted just after");
        s.contention.brought_forward(&["d".to_string()], now);
        s.contention.ended_elsewhere(&ends(now - 100), now);
        assert!(
            to_hasten_keys(&s.contention).is_empty(),
            "the same end again"
        );
        assert_eq!(s.contention.unfollowed_lock_events(), ["coupon.expire"]);
        // An end far ahead (written by hand) is none.
        for e in s.contention.ended_lately.lock().unwrap().values_mut() {
            e.at_ms -= ENDED_LATELY_MS + 1;
        }
        wait("e", "order.timeout", unnamed);
        s.contention
            .ended_elsewhere(&ends(now + ENDED_LATELY_MS + 1), now);
        assert!(to_hasten_keys(&s.contention).is_empty(), "ahead");
        // An end this process saw is told once, and not heard again as another's.
        s.contention.holders_ended(&[42], &[]);
        assert_eq!(s.contention.ends_to_tell(now + 5), ["order.timeout"]);
        assert!(s.contention.ends_to_tell(now + 6).is_empty());
    }

    /// The job keys [`Contention::to_hasten`] gives, sorted.
    fn to_hasten_keys(c: &Contention) -> Vec<String> {
        let mut keys: Vec<String> = c.to_hasten().into_iter().map(|(k, ..)| k).collect();
        keys.sort();
        keys
    }

    #[test]
    fn a_trouble_whose_figures_change_is_logged_when_its_gist_does() {
        let s = Stats::default();
        let due = crate::now_ms() + 1_000;
        s.contention.waiting(
            "k1",
            "order.timeout",
            due - 2_000,
            ("lock timeout", true, 1),
            due,
            due - 2_000,
            None,
        );
        let gist = || "order.timeout k1: lock timeout".to_string();
        let what = |n: u32, ms: u32| format!("{n} job(s) wait; the longest, k1, for {ms} ms");
        assert!(s.report_trouble_about("contention", what(1, 10), gist()));
        // The count and the time change at every retry: not logged for that ...
        assert!(!s.report_trouble_about("contention", what(2, 428), gist()));
        assert!(!s.report_trouble_about("contention", what(3, 923), gist()));
        // ... but the record shows the text as it is now.
        let now = crate::now_ms();
        let shown = s.problems(now);
        assert_eq!(shown.len(), 1);
        assert!(shown[0].what.contains("3 job(s) wait"), "{shown:?}");
        // Another longest waiter, or another reason, is logged at once.
        assert!(s.report_trouble_about(
            "contention",
            what(3, 5),
            "order.timeout k2: lock timeout".into()
        ));
        assert!(!s.report_trouble_about(
            "contention",
            what(4, 9),
            "order.timeout k2: lock timeout".into()
        ));
    }

    #[test]
    fn the_last_hour_is_a_ring_of_minutes() {
        let h = History::default();
        let t0 = 1_800_000_000_000i64; // a minute's start (a multiple of 60,000)
        for _ in 0..3 {
            h.job(t0 + 5_000, JobOutcome::Done);
        }
        h.job(t0 + 6_000, JobOutcome::Duplicate);
        h.job(t0 + 7_000, JobOutcome::Retry);
        h.job(t0 + 61_000, JobOutcome::Dead);
        for ms in [0, 3, 40, 40, 900] {
            h.lateness(t0 + 8_000, ms);
        }
        let hour = h.last_hour(t0 + 61_500);
        assert_eq!(hour.minutes.len(), HISTORY_MINUTES);
        let last = &hour.minutes[HISTORY_MINUTES - 1];
        let prev = &hour.minutes[HISTORY_MINUTES - 2];
        assert_eq!(
            (last.start_ms, last.dead, last.committed),
            (t0 + 60_000, 1, 0)
        );
        assert_eq!((prev.start_ms, prev.committed, prev.retried), (t0, 4, 1));
        assert_eq!(prev.late_count, 5);
        // 40 ms is in the bucket [2^21/4, 2^22/4) = [38.05, 45.25) ms: "at most 45.25".
        let p50 = prev.p50_ms.unwrap();
        assert!((40.0..46.0).contains(&p50), "{p50}");
        assert!(prev.p99_ms.unwrap() >= 900.0 && prev.p99_ms.unwrap() < 1100.0);
        assert_eq!(prev.p50_ms, hour.p50_ms);
        assert_eq!((hour.committed, hour.retried, hour.dead), (4, 1, 1));
        assert_eq!(hour.minutes[0].start_ms, t0 + 60_000 - 59 * 60_000);

        // An hour later the same slots hold new minutes; the old counts are gone.
        let later = t0 + 60 * 60_000;
        h.job(later + 1, JobOutcome::NoOp);
        let hour = h.last_hour(later + 2);
        assert_eq!((hour.committed, hour.dead, hour.late_count), (1, 1, 0));
        let hour = h.last_hour(later + 120 * 60_000);
        assert_eq!(
            (hour.committed, hour.dead),
            (0, 0),
            "nothing in the last hour"
        );
        assert!(hour.p50_ms.is_none());
    }

    #[test]
    fn a_refusal_counts_against_other_jobs_until_decided_or_an_apply() {
        let m = Metrics::new(["e"]);
        assert_eq!(m.other_refused_ms("e", "a"), None);
        m.refused("e", "a", 100);
        assert_eq!(m.other_refused_ms("e", "a"), None, "not its own witness");
        assert_eq!(m.other_refused_ms("e", "b"), Some(100));
        m.refused("e", "c", 150);
        assert_eq!(m.other_refused_ms("e", "b"), Some(150));
        assert_eq!(m.other_refused_ms("e", "c"), Some(100));
        m.refusal_decided("e", "c");
        assert_eq!(m.other_refused_ms("e", "b"), Some(100));
        // A job of the event changed something since: the refusals before say nothing.
        m.applied_at("e", 120);
        assert_eq!(m.other_refused_ms("e", "b"), None);
        m.refused("e", "d", 130);
        assert_eq!(m.other_refused_ms("e", "b"), Some(130));
        // Per event.
        assert_eq!(m.other_refused_ms("other", "b"), None);
        // Bounded: the oldest is forgotten.
        for i in 0..REFUSED_KEPT as i64 + 10 {
            m.refused("e", &format!("k{i}"), 1_000 + i);
        }
        assert!(m.slot("e").refused.lock().unwrap().len() <= REFUSED_KEPT);
        assert_eq!(
            m.other_refused_ms("e", "b"),
            Some(1_000 + REFUSED_KEPT as i64 + 9)
        );
    }

    #[test]
    fn a_held_event_runs_one_probe_at_a_time_until_a_job_goes_through() {
        let m = Metrics::new(["e"]);
        let start = crate::now_ms();
        let every = HELD_PROBE_EVERY.as_millis() as i64;
        assert!(m.may_run_held("e", start), "nothing held");
        m.held("e", true, start + 1);
        assert!(m.held_by_refusal("e"));
        assert!(m.may_run_held("e", start + 2), "the probe");
        assert!(!m.may_run_held("e", start + 3), "the others wait");
        assert!(m.may_run_held("e", start + 2 + every), "the next probe");
        // A no-op passes what refuses changes: no proof.
        m.went_through("e", false, start + 5);
        assert!(!m.may_run_held("e", start + 3 + every));
        m.went_through("e", true, start + 6);
        assert!(m.may_run_held("e", start + 7) && m.may_run_held("e", start + 7));
        // A schema fault: any job that goes through ends it, and it is no refusal.
        m.held("e", false, start + 10);
        assert!(!m.held_by_refusal("e"));
        let later = start + 10 + 2 * every;
        assert!(m.may_run_held("e", later), "the probe");
        assert!(!m.may_run_held("e", later), "the others wait");
        m.went_through("e", false, start + 12);
        assert!(m.may_run_held("e", start + 13) && m.may_run_held("e", start + 13));
        // Per event.
        assert!(m.may_run_held("other", start + 13));
    }

    #[test]
    fn the_dead_letter_rate_counts_the_last_sixty_seconds() {
        let h = History::default();
        let t0 = 1_800_000_050_000i64; // 50 s into a minute
        for _ in 0..12 {
            h.job(t0, JobOutcome::Dead);
        }
        h.job(t0, JobOutcome::Done);
        assert_eq!(h.dead_last_minute(t0), 12);
        // Across the minute's turn, and up to the 60th second, all twelve count.
        assert_eq!(h.dead_last_minute(t0 + 10_000), 12);
        assert_eq!(h.dead_last_minute(t0 + 59_999), 12);
        assert_eq!(h.dead_last_minute(t0 + 60_000), 0);
        // One a second: a steady 60 a minute is 60 at every moment, never more.
        let t1 = t0 + 3_600_000;
        for k in 0..180 {
            h.job(t1 + k * 1000 + 500, JobOutcome::Dead);
            if k >= 59 {
                assert_eq!(h.dead_last_minute(t1 + k * 1000 + 700), 60, "{k}");
            }
        }
        // A clock that went back sees nothing of its future.
        assert_eq!(h.dead_last_minute(t1 - 1_000), 0);
    }

    #[test]
    fn lateness_buckets_cover_every_value() {
        assert_eq!(late_bucket(-5), 0);
        assert_eq!(late_bucket(0), 0);
        assert_eq!(late_bucket(1), 1);
        assert_eq!(late_bucket(i64::MAX), LATE_BUCKETS - 1);
        for ms in [1, 2, 7, 100, 1_000, 65_000, 3_600_000] {
            let b = late_bucket(ms);
            assert!(late_upper_ms(b).unwrap() > ms as f64, "{ms} in {b}");
            assert!(b == 1 || late_upper_ms(b - 1).unwrap() <= ms as f64, "{ms}");
        }
    }
}
