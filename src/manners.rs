//! How the worker shares the shop's database with the shop: caps on its rate
//! (`--max-rate`), and sets that shrink where they meet the shop's locks.
//!
//! - **Rates.** `--max-rate N/s` caps every job, `--max-rate EVENT=N/s` one event's, for
//!   the whole fleet: each cap is a schedule of free slots (GCRA) that every process of
//!   the prefix takes from in Redis (`take_slots.lua`, on Redis's clock; the schedules
//!   here are a process's own, kept while Redis's cannot be taken). A job takes the next
//!   slot, and a worker whose slot is in the future sleeps until then, holding its jobs
//!   (the channel fills, the reader waits: back-pressure, nothing lost). A set of k jobs takes k slots, and a
//!   worker paces a tenth of a second's share of the tightest cap at a time
//!   ([`Manners::share`]), so no second holds much more than the cap. The sleep is woken
//!   by shutdown, and the cap holds through it: jobs whose slots are not yet due when the
//!   stop comes are left pending, for this consumer's next start or a peer (a restart on
//!   sale day once ran 392 held jobs within 0.18 s against a cap of 20 a second).
//! - **Set sizes.** Each event's sets start at `--set-size`. A set that meets contention
//!   (a row lock held past the lock timeout, a deadlock) halves its event's size, down to
//!   single jobs; each set that commits cleanly grows it by one again. So under the shop's
//!   load the worker holds few rows at a time and waits briefly, while a quiet database
//!   gets whole sets. Shared by every worker of the process (atomics only).
//! - **Yielding.** While the shop's own sessions are busy in the database (the PostgreSQL
//!   watch samples `pg_stat_activity` four times a second, `dbwatch.rs`), at most
//!   [`YIELD_CONCURRENCY`] of this process's workers are inside a transaction at once;
//!   the others wait at the gate holding their jobs. A drain then leaves the database's
//!   cores and the WAL to the shop's transactions instead of queueing eight of its own in
//!   front of them (measured with `scripts/bench.sh shop`: docs/performance.md, "The shop beside a drain"). A
//!   worker counts for its first [`GATE_LEASE`] inside only: one inside longer waits (for
//!   a row lock) rather than computes, and must not keep the others out. A set goes
//!   through the gate once for all its tries (and the short pauses between them); each
//!   half of a split set and each single job goes through on its own. Taken once for a
//!   worker's whole batch, the gate let the next worker in beside a split set's halves
//!   and single jobs once the lease ran out, and on 3 hot skus about one drain in three
//!   collapsed into single jobs; taken for each try of a set, it let the other workers'
//!   tries in between, and beside a shop that locks every hot sku in each transaction the
//!   shop's p99 went from 0.2–0.3 s to 2.2–2.9 s (docs/performance.md, "The shop's hot
//!   rows"). When the shop is quiet, every worker may run.

use crate::shutdown::Shutdown;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// One `--max-rate`: jobs per second, for one event or (`event: None`) for all.
#[derive(Debug, Clone, PartialEq)]
pub struct MaxRate {
    pub event: Option<String>,
    pub per_second: f64,
}

impl MaxRate {
    /// `N/s`, `N/m` or `N/h` (a bare number is per second), optionally after `EVENT=`.
    pub fn parse(spec: &str) -> Result<MaxRate, String> {
        let (event, rate) = match spec.rsplit_once('=') {
            Some((e, _)) if e.trim() == GLOBAL_CAP => {
                return Err("no event is called *: a cap on every job is N/s alone".into())
            }
            Some((e, r)) if !e.trim().is_empty() => (Some(e.trim().to_string()), r.trim()),
            Some(_) => return Err("the event before = is empty".into()),
            None => (None, spec.trim()),
        };
        let (n, per) = match rate.split_once('/') {
            Some((n, unit)) => (n, unit.trim()),
            None => (rate, "s"),
        };
        let seconds = match per {
            "s" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            other => return Err(format!("unknown unit /{other}: use /s, /m or /h")),
        };
        let n: f64 = n
            .trim()
            .parse()
            .map_err(|_| format!("{rate:?} is not a rate such as 200/s"))?;
        if !(n.is_finite() && n > 0.0) {
            return Err(format!("{rate:?}: the rate must be above 0"));
        }
        Ok(MaxRate {
            event,
            per_second: n / seconds,
        })
    }
}

/// The name of the cap on every job in the fleet's schedules ([`SlotTake::cap`]).
pub const GLOBAL_CAP: &str = "*";

/// The slots of one cap a share of jobs takes.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotTake<'m> {
    /// [`GLOBAL_CAP`], or the event of an event's cap.
    pub cap: &'m str,
    /// The time between two of its slots.
    pub interval: Duration,
    /// How many slots: the share's jobs it applies to.
    pub n: usize,
}

/// A schedule of slots `interval` apart: the time the next one is free.
struct Slots {
    interval: Duration,
    next: Mutex<Option<Instant>>,
}

/// The burst a cap lets through at once after a quiet spell, and the share of a worker's
/// jobs paced at a time ([`Manners::share`]): a tenth of a second's slots.
pub const BURST: Duration = Duration::from_millis(100);

impl Slots {
    /// Takes `n` slots; returns when the last of them is due (now or later). A burst of
    /// at most a tenth of a second's slots is let through at once after a quiet spell,
    /// and at least one: the first job under `1/m` runs at once, not a minute on.
    fn take(&self, n: usize, now: Instant) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let burst = BURST.max(self.interval);
        let start = match *next {
            Some(t) if t + burst > now => t,
            _ => now.checked_sub(burst).unwrap_or(now),
        };
        let end = start + self.interval.saturating_mul(n as u32);
        *next = Some(end);
        end.max(now)
    }

    /// How many slots fall in `horizon`, at least one.
    fn within(&self, horizon: Duration) -> usize {
        ((horizon.as_secs_f64() / self.interval.as_secs_f64()).floor() as usize).max(1)
    }

    /// The jobs that took slots here run at `at` (another cap made them wait past their
    /// slots): this schedule goes on from there, not from the slots they did not use.
    fn ran_at(&self, at: Instant) {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        if next.is_none_or(|t| t < at) {
            *next = Some(at);
        }
    }
}

/// Workers of one process inside a transaction at once while the shop is busy.
pub const YIELD_CONCURRENCY: usize = 1;

/// How long a worker inside the gate counts against [`YIELD_CONCURRENCY`]. A set
/// transaction beside a busy shop takes a few milliseconds; one still open after this
/// waits (for a row lock, its lock wait being 20 ms for a set and 100 ms for a single
/// job by default, or a handler's sleep) rather than computes, and the next worker goes
/// in. Without it a lock held for long on rows many due jobs need kept the others out
/// behind those jobs' lock waits: found from outside, with 5 of 50 skus locked for 60 s
/// while the shop was busy, the orders that needed no locked row were cancelled 14 s late
/// at the median and 50 s at p99.
pub const GATE_LEASE: Duration = Duration::from_millis(20);

/// The rate caps, the per-event set sizes and the yielding gate of one process.
pub struct Manners {
    all: Option<Slots>,
    by_event: HashMap<String, Slots>,
    /// Held while a worker takes its slots of every cap ([`Manners::pace`]).
    taking: Mutex<()>,
    /// The set size each event now runs with (absent: `--set-size`), and when its sets
    /// last met contention. Events are few and a set looks its own up once.
    set_sizes: RwLock<HashMap<String, EventSets>>,
    /// What [`EventSets::contended_ms`] and `paused_until_us` count from.
    epoch: Instant,
    /// While the shop is busy: how long this process's workers pause before their next
    /// transaction after one met contention (µs; 0: none), and until when ([`Manners::pause`]).
    pause_us: AtomicU64,
    paused_until_us: AtomicU64,
    /// While the shop is busy: a single job of this process waits the whole
    /// `--lock-timeout` now, and none does before this (µs since `epoch`)
    /// ([`Manners::long_wait`]).
    long_waiting: AtomicBool,
    long_rest_until_us: AtomicU64,
    set_size: usize,
    /// Written by the PostgreSQL watch: the shop's sessions are busy now.
    yielding: AtomicBool,
    /// The caps are kept here, the fleet's schedules in Redis not answering.
    alone: AtomicBool,
    /// When [`Manners::alone`] last saw the fleet's schedules fail.
    alone_since: Mutex<Option<Instant>>,
    /// When each worker inside a transaction went in (by its permit's number), and the
    /// condition they wait on at the gate.
    inside: Mutex<Inside>,
    gate: Condvar,
}

/// How long after an event's sets last met contention its single jobs wait briefly
/// ([`Manners::splitting`]).
pub const SPLIT_WAITS_BRIEFLY: Duration = Duration::from_secs(10);

/// The shortest and the longest pause after a transaction met contention while the shop
/// is busy ([`Manners::met_contention`]).
pub const PAUSE_MIN: Duration = Duration::from_millis(2);
pub const PAUSE_MAX: Duration = Duration::from_millis(500);

/// One event's sets: their size now and when they last met contention; when its jobs
/// (sets or single jobs) last met contention, and first did since one of them last
/// changed something (ms since [`Manners::epoch`], plus one; 0: never, or not since).
struct EventSets {
    size: AtomicUsize,
    contended_ms: AtomicU64,
    met_ms: AtomicU64,
    met_since_ms: AtomicU64,
}

/// The workers inside the gate: their entry times by permit number.
#[derive(Default)]
struct Inside {
    next: u64,
    since: Vec<(u64, Instant)>,
}

impl Inside {
    /// Those inside for less than [`GATE_LEASE`] at `now`, and when the earliest of their
    /// leases ends.
    fn counted(&self, now: Instant) -> (usize, Option<Instant>) {
        let ends = self
            .since
            .iter()
            .map(|(_, at)| *at + GATE_LEASE)
            .filter(|end| *end > now);
        ends.fold((0, None), |(n, first), end| {
            (n + 1, Some(first.map_or(end, |f: Instant| f.min(end))))
        })
    }
}

/// How long, while the shop is busy, no single job waits the whole `--lock-timeout` after
/// one did in vain ([`Manners::long_wait`]).
pub const LONG_WAIT_REST: Duration = Duration::from_secs(1);

/// A single job's leave to wait the whole `--lock-timeout` ([`Manners::long_wait`]);
/// given back on drop.
pub struct LongWait<'a>(&'a Manners, bool);

impl LongWait<'_> {
    /// Its wait ended in vain: no long wait for [`LONG_WAIT_REST`] while the shop is busy.
    pub fn in_vain(&self) {
        if self.1 {
            let until = self.0.since_epoch_us() + LONG_WAIT_REST.as_micros() as u64;
            self.0
                .long_rest_until_us
                .fetch_max(until, Ordering::Relaxed);
        }
    }
}

impl Drop for LongWait<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.long_waiting.store(false, Ordering::Release);
        }
    }
}

/// A worker's place inside the gate; given back on drop.
pub struct Permit<'a>(&'a Manners, u64);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut inside = self.0.inside.lock().unwrap_or_else(|p| p.into_inner());
        inside.since.retain(|(n, _)| *n != self.1);
        self.0.gate.notify_one();
    }
}

impl Manners {
    /// `set_size` is `--set-size`.
    pub fn new(rates: &[MaxRate], set_size: usize) -> Manners {
        let slots = |r: &MaxRate| Slots {
            interval: Duration::from_secs_f64(1.0 / r.per_second),
            next: Mutex::new(None),
        };
        Manners {
            all: rates.iter().rev().find(|r| r.event.is_none()).map(slots),
            by_event: rates
                .iter()
                .filter_map(|r| r.event.clone().map(|e| (e, slots(r))))
                .collect(),
            taking: Mutex::new(()),
            set_sizes: RwLock::new(HashMap::new()),
            epoch: Instant::now(),
            pause_us: AtomicU64::new(0),
            paused_until_us: AtomicU64::new(0),
            long_waiting: AtomicBool::new(false),
            long_rest_until_us: AtomicU64::new(0),
            set_size: set_size.max(1),
            yielding: AtomicBool::new(false),
            alone: AtomicBool::new(false),
            alone_since: Mutex::new(None),
            inside: Mutex::new(Inside::default()),
            gate: Condvar::new(),
        }
    }

    /// The shop's sessions are busy (`true`) or quiet: the gate narrows or opens.
    pub fn set_yielding(&self, on: bool) {
        if self.yielding.swap(on, Ordering::Relaxed) != on && !on {
            self.gate.notify_all();
        }
    }

    /// Whether the gate is narrowed now.
    pub fn yielding(&self) -> bool {
        self.yielding.load(Ordering::Relaxed)
    }

    /// Waits for a place inside the gate: at once unless the shop is busy and
    /// [`YIELD_CONCURRENCY`] workers went in less than [`GATE_LEASE`] ago and are inside
    /// still. Shutdown opens the gate (the drain is not held back).
    pub fn enter(&self, shutdown: &Shutdown) -> Permit<'_> {
        let mut inside = self.inside.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let now = Instant::now();
            let (counted, first_end) = inside.counted(now);
            if !self.yielding() || counted < YIELD_CONCURRENCY || shutdown.is_set() {
                break;
            }
            // Woken by a permit given back, or when a lease ends; the timeout also sees
            // shutdown and a gate opened.
            let wait = first_end.map_or(Duration::ZERO, |e| e - now);
            inside = self
                .gate
                .wait_timeout(inside, wait.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let n = inside.next;
        inside.next += 1;
        inside.since.push((n, Instant::now()));
        Permit(self, n)
    }

    /// No caps, whole sets: for tests and tools.
    pub fn unlimited(set_size: usize) -> Manners {
        Manners::new(&[], set_size)
    }

    /// Waits until the caps let jobs of these events run (one slot each): `true` when they
    /// may run now, at once without caps. `false` when shutdown came before their slots
    /// (set before or during the wait): they must not run, and stay pending for the next
    /// start, so that a stop does not run the jobs a cap held back in one burst.
    ///
    /// While it waits, `keep` is called every `every`: the worker keeps the jobs it holds
    /// claimed, since under a cap below a job per worker per quarter of `--claim-idle`
    /// (8 workers under 60/h hold their jobs for up to 8 minutes) they would otherwise
    /// look stuck and be delivered again, each delivery counted against the job.
    #[cfg(test)]
    #[must_use]
    pub fn pace<'e>(
        &self,
        events: impl Iterator<Item = &'e str>,
        shutdown: &Shutdown,
        every: Duration,
        keep: impl FnMut(),
    ) -> bool {
        let takes = self.takes(events);
        if takes.is_empty() {
            return true;
        }
        let until = self.take_here(&takes, Instant::now());
        self.wait_for(until, shutdown, every, keep)
    }

    /// The slots jobs of these events take, one per job of each cap that applies to them;
    /// empty without caps.
    pub fn takes<'m, 'e>(&'m self, events: impl Iterator<Item = &'e str>) -> Vec<SlotTake<'m>> {
        if !self.capped() {
            return Vec::new();
        }
        let mut counts: HashMap<&'m str, usize> = HashMap::new();
        let mut total = 0;
        for e in events {
            if let Some((name, _)) = self.by_event.get_key_value(e) {
                *counts.entry(name.as_str()).or_default() += 1;
            }
            total += 1;
        }
        let take = |cap: &'m str, s: &Slots, n: usize| SlotTake {
            cap,
            interval: s.interval,
            n,
        };
        self.all
            .iter()
            .map(|all| take(GLOBAL_CAP, all, total))
            .chain(
                counts
                    .into_iter()
                    .map(|(e, n)| take(e, &self.by_event[e], n)),
            )
            .collect()
    }

    /// Takes these slots of this process's own schedules: when the jobs may run, not before
    /// `not_before`. The worker keeps them beside the fleet's schedules in Redis
    /// ([`crate::store::take_slots`]), whose booking is `not_before`: the later decides,
    /// and these go on from it, so a switch to them alone (Redis not answering) or back
    /// runs no burst beside what the other let this process run (one process under 20/s
    /// ran 36 jobs in a second across the switches). Alone, `not_before` is now.
    pub fn take_here(&self, takes: &[SlotTake<'_>], not_before: Instant) -> Instant {
        // One worker takes its slots of every cap at a time, and every cap it took goes
        // on from when the jobs may run, the latest of their slots: a cap that let them
        // run earlier would otherwise count them at slots they did not use and let the
        // next jobs in early (`order.timeout=30/s` held 38 in a second under a global
        // `60/s`, `shopdb::event_caps_hold_under_a_global_cap`).
        let now = Instant::now();
        let _one_at_a_time = self.taking.lock().unwrap_or_else(|p| p.into_inner());
        let until = takes
            .iter()
            .filter_map(|t| self.slots_of(t.cap).map(|s| s.take(t.n, now)))
            .fold(not_before.max(now), Instant::max);
        for s in takes.iter().filter_map(|t| self.slots_of(t.cap)) {
            s.ran_at(until);
        }
        until
    }

    /// This process's own schedule of a cap: [`GLOBAL_CAP`] or an event's.
    fn slots_of(&self, cap: &str) -> Option<&Slots> {
        match cap {
            GLOBAL_CAP => self.all.as_ref(),
            e => self.by_event.get(e),
        }
    }

    /// Waits until `until`: `true` then, `false` when shutdown comes first (set before or
    /// during the wait; not when `until` has passed already). `keep` is called every
    /// `every` on the way.
    #[must_use]
    pub fn wait_for(
        &self,
        until: Instant,
        shutdown: &Shutdown,
        every: Duration,
        mut keep: impl FnMut(),
    ) -> bool {
        let every = every.max(Duration::from_millis(10));
        loop {
            let now = Instant::now();
            if until <= now {
                return true;
            }
            if shutdown.wait((until - now).min(every)) {
                return false;
            }
            if Instant::now() < until {
                keep();
            }
        }
    }

    /// How many of a worker's jobs of these events run between two paces: a tenth of a
    /// second's slots of the tightest cap that applies to them, at least one; `None`
    /// when none applies. Paced all at once, a worker's 32 jobs under a cap of 20 a
    /// second waited 1.6 s and then ran in one burst, 43 jobs within 3 ms with another
    /// worker's; a tenth of a second's share at a time, no second holds much more than
    /// the cap.
    pub fn share<'e>(&self, events: impl Iterator<Item = &'e str>) -> Option<usize> {
        if !self.capped() {
            return None;
        }
        let per_burst = |s: &Slots| s.within(BURST);
        let mut share = self.all.as_ref().map(per_burst);
        for e in events {
            if let Some(s) = self.by_event.get(e) {
                share = Some(share.map_or(per_burst(s), |n| n.min(per_burst(s))));
            }
        }
        share
    }

    /// The time between the slots of the slowest cap on jobs of `event` (the global cap or
    /// its own); `None` when none applies.
    pub fn slowest_slots(&self, event: &str) -> Option<Duration> {
        self.all
            .iter()
            .chain(self.by_event.get(event))
            .map(|s| s.interval)
            .max()
    }

    /// The fleet's schedules in Redis could not be taken: `true` the first time since they
    /// last could (so that it is said once per process, not per worker).
    pub fn alone(&self) -> bool {
        let mut since = self.alone_since.lock().unwrap_or_else(|p| p.into_inner());
        *since = Some(Instant::now());
        !self.alone.swap(true, Ordering::Relaxed)
    }

    /// The fleet's schedules could be taken, by a call made at `asked`: `true` the first
    /// time after [`Manners::alone`]. A call made before the last failure was seen says
    /// nothing of it (another worker's, answered before the key went wrong and read after:
    /// found on a loaded machine, the fall-back said twice, "the fleet's again" between).
    pub fn fleet_s_again(&self, asked: Instant) -> bool {
        if !self.alone.load(Ordering::Relaxed) {
            return false;
        }
        let mut since = self.alone_since.lock().unwrap_or_else(|p| p.into_inner());
        if since.is_some_and(|t| asked < t) {
            return false;
        }
        *since = None;
        self.alone.swap(false, Ordering::Relaxed)
    }

    /// Whether any cap is set.
    pub fn capped(&self) -> bool {
        self.all.is_some() || !self.by_event.is_empty()
    }

    /// The global cap's share ([`Manners::share`]): what a worker takes at a time under
    /// it, so that it holds no jobs for seconds while the reader reads more in their
    /// place. `None` without a global cap.
    pub fn global_share(&self) -> Option<usize> {
        self.global_runs_within(BURST)
    }

    /// How many jobs the global cap lets run in `horizon` (at least one); `None` without
    /// one. What a process may hold at once under it
    /// ([`crate::config::Config::channel_capacity_under`]): more would wait for their
    /// slots past `--claim-idle`, and be taken back as a stuck consumer's, by a peer or by
    /// its own reader, and run twice (150 jobs under 3/s were 429 deliveries, 77 of them
    /// run again as duplicates, each taking a slot). Not an event's cap: the reader cannot
    /// tell the events apart before it reads, and bounding every event by one event's cap
    /// made the others' drain five times slower (`coupon.expire=2/s` with no such job:
    /// 3,500 order timeouts a second against 20,000, and no sets).
    pub fn global_runs_within(&self, horizon: Duration) -> Option<usize> {
        self.all.as_ref().map(|s| s.within(horizon))
    }

    /// The set size jobs of `event` run with now.
    pub fn set_size(&self, event: &str) -> usize {
        let sizes = self.set_sizes.read().unwrap_or_else(|p| p.into_inner());
        sizes
            .get(event)
            .map_or(self.set_size, |s| s.size.load(Ordering::Relaxed).max(1))
    }

    /// Calls `f` with `event`'s sets (its first call adds them).
    fn with_sets(&self, event: &str, f: impl Fn(&EventSets)) {
        {
            let sizes = self.set_sizes.read().unwrap_or_else(|p| p.into_inner());
            if let Some(s) = sizes.get(event) {
                return f(s);
            }
        }
        let mut sizes = self.set_sizes.write().unwrap_or_else(|p| p.into_inner());
        let s = sizes.entry(event.to_string()).or_insert_with(|| EventSets {
            size: AtomicUsize::new(self.set_size),
            contended_ms: AtomicU64::new(0),
            met_ms: AtomicU64::new(0),
            met_since_ms: AtomicU64::new(0),
        });
        f(s)
    }

    /// Whether `event`'s sets are being split: smaller than `--set-size` now, and they
    /// met contention within [`SPLIT_WAITS_BRIEFLY`]. Its single jobs then wait for a
    /// lock as briefly as a set (`session.rs`): the shop holds rows many of its jobs need.
    pub fn splitting(&self, event: &str) -> bool {
        let sizes = self.set_sizes.read().unwrap_or_else(|p| p.into_inner());
        sizes.get(event).is_some_and(|s| {
            let at = s.contended_ms.load(Ordering::Relaxed);
            s.size.load(Ordering::Relaxed) < self.set_size
                && at > 0
                && self.since_epoch_ms() < at + SPLIT_WAITS_BRIEFLY.as_millis() as u64
        })
    }

    fn since_epoch_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A set of `event` met contention: halve its size.
    pub fn contended(&self, event: &str) {
        let now = self.since_epoch_ms() + 1;
        self.with_sets(event, |s| {
            let _ = s
                .size
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some((n / 2).max(1))
                });
            s.contended_ms.store(now, Ordering::Relaxed);
            Self::met_at(s, now);
        });
    }

    /// A single job of `event` met contention.
    pub fn job_contended(&self, event: &str) {
        let now = self.since_epoch_ms() + 1;
        self.with_sets(event, |s| Self::met_at(s, now));
    }

    /// `s`'s jobs met contention at `now`: it began then unless they met it within
    /// [`SPLIT_WAITS_BRIEFLY`] before, none changing anything since. Another worker may
    /// have stored a later time since `now` was read (found in a test run: a worker
    /// panicked on the subtraction).
    fn met_at(s: &EventSets, now: u64) {
        let last = s.met_ms.fetch_max(now, Ordering::Relaxed);
        if last == 0 || now.saturating_sub(last) > SPLIT_WAITS_BRIEFLY.as_millis() as u64 {
            s.met_since_ms.store(now, Ordering::Relaxed);
        } else {
            let _ = s
                .met_since_ms
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// How long ago `event`'s jobs began to meet contention: none of them changed anything
    /// since, and they met it again within [`SPLIT_WAITS_BRIEFLY`] of each other. A set
    /// that meets contention is tried again and split down to single jobs before any of
    /// its jobs goes back to the pool and is counted as waiting: with 2,000 jobs behind
    /// rows the shop held, their sets and single jobs kept the workers for about 17 s
    /// before the first went back, and the standstill, counted from then, was told 47–74 s
    /// after the jobs met the lock (found from outside).
    pub fn contended_for(&self, event: &str) -> Option<Duration> {
        let sizes = self.set_sizes.read().unwrap_or_else(|p| p.into_inner());
        let s = sizes.get(event)?;
        let now = self.since_epoch_ms() + 1;
        let since = s.met_since_ms.load(Ordering::Relaxed);
        let last = s.met_ms.load(Ordering::Relaxed);
        (since > 0 && now.saturating_sub(last) <= SPLIT_WAITS_BRIEFLY.as_millis() as u64)
            .then(|| Duration::from_millis(now.saturating_sub(since)))
    }

    /// Whether a single job may wait the whole `--lock-timeout` for a lock now (an older
    /// job's try, or one whose event's sets are not being split): always while the shop
    /// is quiet; while it is busy, one job of the process at a time, and none for
    /// [`LONG_WAIT_REST`] after one waited in vain ([`LongWait::in_vain`]). The others
    /// wait as briefly as a set. A job waiting for a row holds the rows it locked before
    /// against the shop, and the shop's transactions queue behind both: with a backlog
    /// over a minute overdue on a few hot skus (its jobs past the brief waits), every
    /// worker's try waited 100 ms and the shop fell to a few percent of its rate for
    /// tens of seconds (found from outside; `scripts/bench.sh shop --skus 3 --shop-rate
    /// 400 --shop-backlog 3000 --shop-overdue 2m`: the drain at 23 jobs/s, the shop's p99
    /// 20 s). A row the shop keeps busy is still got in the end, by the one long wait.
    pub fn long_wait(&self) -> Option<LongWait<'_>> {
        if !self.yielding() {
            return Some(LongWait(self, false));
        }
        if self.since_epoch_us() < self.long_rest_until_us.load(Ordering::Relaxed)
            || self.long_waiting.swap(true, Ordering::AcqRel)
        {
            return None;
        }
        Some(LongWait(self, true))
    }

    /// A single job of this process met contention on its first try, or a set as taken
    /// missed its first try (a lock wait in vain, a deadlock; a retry of a lock wait meets
    /// a row held for long and is not counted):
    /// while the shop is busy, the workers pause before their next transaction, twice as
    /// long as after the last one (from [`PAUSE_MIN`] up to [`PAUSE_MAX`]). Each try that
    /// waits for a row the shop needs holds the shop up for that wait; with a few hot rows
    /// near their capacity under the shop's own load, the drain's tries kept the shop's
    /// queue from ever clearing, and their failures only brought more tries (measured:
    /// `scripts/bench.sh shop --skus 3 --shop-rate 400 --shop-backlog 3000`, the shop's p99
    /// at 0.7–3.3 s and the drain at 150 jobs/s, every job a transaction of its own). A
    /// set's later tries and the halves of a split one are not counted, so a long lock on
    /// a few rows, met by few of the due jobs, pauses little.
    pub fn met_contention(&self) {
        if !self.yielding() {
            return;
        }
        let min = PAUSE_MIN.as_micros() as u64;
        let max = PAUSE_MAX.as_micros() as u64;
        let p = self.pause_us.load(Ordering::Relaxed);
        let p = (p * 2).clamp(min, max);
        self.pause_us.store(p, Ordering::Relaxed);
        let until = self.since_epoch_us() + p;
        self.paused_until_us.fetch_max(until, Ordering::Relaxed);
    }

    /// `n` jobs of this process committed: the pause halves for each, and ends below
    /// [`PAUSE_MIN`]. So it lasts only while single jobs meet contention more often than
    /// jobs go through: a long shop lock on the rows of a tenth of the due orders, whose
    /// retries meet it again and again, pauses nothing (with an eighth for each job, the
    /// orders needing no locked row waited up to 7 s).
    pub fn went_through(&self, n: usize) {
        let mut p = self.pause_us.load(Ordering::Relaxed);
        if p == 0 {
            return;
        }
        p >>= n.min(63);
        let p = if p < PAUSE_MIN.as_micros() as u64 {
            0
        } else {
            p
        };
        self.pause_us.store(p, Ordering::Relaxed);
    }

    /// Waits out the pause [`Manners::met_contention`] set, while the shop is busy (a
    /// shop gone quiet ends it); shutdown ends it too.
    pub fn pause(&self, shutdown: &Shutdown) {
        loop {
            let until = self.paused_until_us.load(Ordering::Relaxed);
            let now = self.since_epoch_us();
            // Looked at again every 50 ms: a shop gone quiet, or a pause made longer.
            if until <= now
                || !self.yielding()
                || shutdown.wait(Duration::from_micros((until - now).min(50_000)))
            {
                return;
            }
        }
    }

    fn since_epoch_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// A set of `event` committed: grow its size by one, up to `--set-size`. `changed`:
    /// one of its jobs changed something, so the event's contention ends
    /// ([`Manners::contended_for`]).
    pub fn committed(&self, event: &str, changed: bool) {
        let cap = self.set_size;
        let sizes = self.set_sizes.read().unwrap_or_else(|p| p.into_inner());
        // An event that never met contention has no entry: nothing to do.
        if let Some(s) = sizes.get(event) {
            let _ = s
                .size
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n < cap).then_some(n + 1)
                });
            if changed && s.met_since_ms.load(Ordering::Relaxed) != 0 {
                s.met_since_ms.store(0, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A take asked before the fall-back's failure was seen does not end it; one asked
    /// after does, once.
    #[test]
    fn a_take_asked_before_the_failure_does_not_end_the_fall_back() {
        let m = Manners::unlimited(32);
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(m.alone());
        assert!(!m.alone());
        assert!(!m.fleet_s_again(before));
        let after = Instant::now();
        assert!(m.fleet_s_again(after));
        assert!(!m.fleet_s_again(Instant::now()));
    }

    #[test]
    fn rates_parse_with_units_and_events() {
        let r = MaxRate::parse("order.timeout=120/m").unwrap();
        assert_eq!(r.event.as_deref(), Some("order.timeout"));
        assert!((r.per_second - 2.0).abs() < 1e-9);
        assert_eq!(MaxRate::parse("50").unwrap().per_second, 50.0);
        assert_eq!(MaxRate::parse("3600/h").unwrap().per_second, 1.0);
        assert!(MaxRate::parse("0/s").is_err());
        assert!(MaxRate::parse("=5/s").is_err());
        assert!(MaxRate::parse("5/w").is_err());
        assert!(MaxRate::parse("x/s").is_err());
        assert!(
            MaxRate::parse("*=5/s").is_err(),
            "* names the cap on every job"
        );
    }

    #[test]
    fn a_capped_worker_paces_a_tenth_of_a_second_s_share_at_a_time() {
        let rates: Vec<MaxRate> = ["order.timeout=20/s", "coupon.expire=3/s"]
            .iter()
            .map(|r| MaxRate::parse(r).unwrap())
            .collect();
        let m = Manners::new(&rates, 32);
        assert_eq!(m.share(["order.timeout"].into_iter()), Some(2));
        assert_eq!(
            m.share(["order.timeout", "coupon.expire"].into_iter()),
            Some(1)
        );
        assert_eq!(m.share(["aftersale.timeout"].into_iter()), None);
        let all = Manners::new(&[MaxRate::parse("9000/s").unwrap()], 32);
        assert_eq!(all.share(["aftersale.timeout"].into_iter()), Some(900));
        // What a process takes at a time and holds at once: by the global cap only.
        assert_eq!(m.global_share(), None);
        assert_eq!(m.global_runs_within(Duration::from_secs(15)), None);
        assert_eq!(all.global_share(), Some(900));
        assert_eq!(
            all.global_runs_within(Duration::from_secs(15)),
            Some(135_000)
        );
        let slow = Manners::new(&[MaxRate::parse("1/m").unwrap()], 32);
        assert_eq!(slow.global_runs_within(Duration::from_secs(15)), Some(1));
    }

    #[test]
    fn a_stop_leaves_the_jobs_whose_slots_are_not_due_and_runs_those_that_are() {
        let m = Manners::new(&[MaxRate::parse("10/s").unwrap()], 32);
        let stop = Shutdown::new();
        let one = || ["order.timeout"].into_iter();
        // The burst's one slot is free now, the next is 100 ms on.
        assert!(m.pace(one(), &stop, Duration::MAX, || {}));
        let waited = Instant::now();
        assert!(
            m.pace(one(), &stop, Duration::MAX, || {}),
            "run once its slot is due"
        );
        assert!(waited.elapsed() >= Duration::from_millis(50));
        stop.trigger();
        let asked = Instant::now();
        assert!(
            !m.pace(one(), &stop, Duration::MAX, || {}),
            "its slot is not due: left"
        );
        assert!(
            asked.elapsed() < Duration::from_millis(50),
            "not waited for"
        );
        std::thread::sleep(Duration::from_millis(250));
        assert!(
            m.pace(one(), &stop, Duration::MAX, || {}),
            "a slot due now runs in the drain too"
        );
        assert!(
            Manners::unlimited(32).pace(one(), &stop, Duration::MAX, || {}),
            "no cap: runs"
        );
    }

    #[test]
    fn a_share_takes_a_slot_per_job_of_every_cap_that_applies() {
        let rates: Vec<MaxRate> = ["60/s", "order.timeout=30/s", "coupon.expire=5/s"]
            .iter()
            .map(|r| MaxRate::parse(r).unwrap())
            .collect();
        let m = Manners::new(&rates, 32);
        let events = ["order.timeout", "refund.approve", "order.timeout"];
        let takes = m.takes(events.into_iter());
        let every = |n: f64| Duration::from_secs_f64(1.0 / n);
        assert_eq!(
            takes,
            [
                SlotTake {
                    cap: GLOBAL_CAP,
                    interval: every(60.0),
                    n: 3
                },
                SlotTake {
                    cap: "order.timeout",
                    interval: every(30.0),
                    n: 2
                },
            ]
        );
        assert!(Manners::unlimited(32).takes(events.into_iter()).is_empty());
    }

    #[test]
    fn a_long_wait_for_a_slot_keeps_the_held_jobs_claimed_on_the_way() {
        let m = Manners::new(&[MaxRate::parse("10/s").unwrap()], 32);
        let stop = Shutdown::new();
        let one = || ["order.timeout"].into_iter();
        let every = Duration::from_millis(20);
        let mut kept = 0;
        assert!(m.pace(one(), &stop, every, || kept += 1));
        assert_eq!(kept, 0, "the burst's slot: no wait");
        assert!(m.pace(one(), &stop, every, || kept += 1));
        // 100 ms for the slot: a keep every 20 ms on the way, none at its end.
        assert!((2..=5).contains(&kept), "kept {kept} times");
        stop.trigger();
        let mut after_stop = 0;
        assert!(!m.pace(one(), &stop, every, || after_stop += 1));
        assert_eq!(after_stop, 0, "a stop leaves the jobs at once");
    }

    #[test]
    fn slots_keep_the_rate_after_a_small_burst() {
        let s = Slots {
            interval: Duration::from_millis(10),
            next: Mutex::new(None),
        };
        let t0 = Instant::now();
        // The burst: 100 ms worth of slots (10) are free at once.
        for _ in 0..10 {
            assert!(s.take(1, t0) <= t0);
        }
        // Then each slot is 10 ms after the last.
        let a = s.take(1, t0);
        let b = s.take(5, t0);
        assert_eq!(a, t0 + Duration::from_millis(10));
        assert_eq!(b, t0 + Duration::from_millis(60));
        // A cap slower than the burst: one slot free at once, the next an interval on.
        let slow = Slots {
            interval: Duration::from_secs(60),
            next: Mutex::new(None),
        };
        assert!(
            slow.take(1, t0) <= t0,
            "the first job under 1/m runs at once"
        );
        assert_eq!(slow.take(1, t0), t0 + Duration::from_secs(60));
    }

    #[test]
    fn while_the_shop_is_busy_one_job_at_a_time_may_wait_long_and_none_after_one_in_vain() {
        let m = Manners::unlimited(32);
        let (a, b) = (m.long_wait(), m.long_wait());
        assert!(
            a.is_some() && b.is_some(),
            "any number while the shop is quiet"
        );
        drop((a, b));
        m.set_yielding(true);
        let first = m.long_wait();
        assert!(first.is_some());
        assert!(m.long_wait().is_none(), "one at a time");
        drop(first);
        let again = m.long_wait().expect("free again once given back");
        again.in_vain();
        drop(again);
        assert!(
            m.long_wait().is_none(),
            "none for a while after one in vain"
        );
        m.set_yielding(false);
        assert!(m.long_wait().is_some(), "the shop quiet: at once");
        m.set_yielding(true);
        std::thread::sleep(LONG_WAIT_REST);
        assert!(m.long_wait().is_some(), "after the rest");
    }

    #[test]
    fn the_gate_lets_one_worker_in_while_yielding_and_all_otherwise() {
        let m = Manners::unlimited(32);
        let stop = Shutdown::new();
        let a = m.enter(&stop);
        let b = m.enter(&stop);
        drop((a, b));
        m.set_yielding(true);
        let before = Instant::now();
        let first = m.enter(&stop);
        std::thread::scope(|s| {
            let second = s.spawn(|| {
                let _p = m.enter(&stop);
                before.elapsed()
            });
            // The second waits at the gate while the first is inside, and goes in once it
            // leaves (or once its lease has ended).
            std::thread::sleep(GATE_LEASE / 4);
            let left = before.elapsed();
            drop(first);
            let entered = second.join().unwrap();
            assert!(entered >= left.min(GATE_LEASE), "{entered:?} {left:?}");
        });
        // Shutdown opens the gate.
        let _inside = m.enter(&stop);
        stop.trigger();
        let _also = m.enter(&stop);
    }

    #[test]
    fn a_worker_inside_longer_than_its_lease_no_longer_keeps_the_next_one_out() {
        let m = Manners::unlimited(32);
        let stop = Shutdown::new();
        m.set_yielding(true);
        let before = Instant::now();
        let _waiting_on_a_lock = m.enter(&stop);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let _second = m.enter(&stop);
                tx.send(before.elapsed()).unwrap();
                // The second is counted for its own lease: a third waits it out too.
                let _third = m.enter(&stop);
                tx.send(before.elapsed()).unwrap();
            });
            // Both go in while the first is still inside, each once the lease before it
            // has ended.
            let second = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            let third = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert!(
                second >= GATE_LEASE && third >= 2 * GATE_LEASE,
                "{second:?} {third:?}"
            );
        });
    }

    /// An event's contention is counted from its first set (or single job) that met it,
    /// until one of its jobs changes something: a no-op ends nothing.
    #[test]
    fn contention_counts_from_the_first_set_that_met_it_until_a_job_changes_something() {
        let m = Manners::unlimited(4);
        assert!(m.contended_for("a").is_none());
        m.contended("a");
        std::thread::sleep(Duration::from_millis(30));
        m.job_contended("a");
        let began = |m: &Manners| m.contended_for("a").map(|d| d.as_millis());
        assert!(began(&m).unwrap() >= 30, "{:?}", began(&m));
        assert!(m.contended_for("b").is_none());
        m.committed("a", false);
        assert!(began(&m).unwrap() >= 30, "a no-op ends nothing");
        m.committed("a", true);
        assert!(m.contended_for("a").is_none());
        m.job_contended("a");
        assert!(began(&m).unwrap() < 30, "{:?}", began(&m));
        // A worker that read the time before another stored a later one.
        m.with_sets("a", |s| {
            let later = s.met_ms.load(Ordering::Relaxed) + 5;
            Manners::met_at(s, later);
            Manners::met_at(s, later - 3);
            assert_eq!(s.met_ms.load(Ordering::Relaxed), later);
        });
    }

    /// An event's single jobs wait briefly while its sets are smaller than `--set-size`
    /// and met contention within [`SPLIT_WAITS_BRIEFLY`]: not once they have grown back,
    /// nor once that long has passed (an event whose jobs come one at a time never grows
    /// its sets back, and its jobs would otherwise wait briefly for good).
    #[test]
    fn an_event_is_splitting_only_while_its_sets_are_small_and_met_contention_lately() {
        let m = Manners::unlimited(4);
        assert!(!m.splitting("a"));
        m.contended("a");
        assert!(m.splitting("a") && !m.splitting("b"));
        m.committed("a", true);
        m.committed("a", true);
        assert!(!m.splitting("a"), "grown back to --set-size");
        m.contended("a");
        assert!(m.splitting("a"));
        let sizes = m.set_sizes.read().unwrap();
        let long_ago = m
            .since_epoch_ms()
            .saturating_sub(SPLIT_WAITS_BRIEFLY.as_millis() as u64);
        sizes["a"].contended_ms.store(long_ago, Ordering::Relaxed);
        drop(sizes);
        assert!(!m.splitting("a"), "its last contention too long ago");
        assert_eq!(m.set_size("a"), 2, "its sets still small");
    }

    /// While the shop is busy, a single job that met contention makes the workers pause
    /// before their next transaction, twice as long at each further one up to
    /// [`PAUSE_MAX`], half as long at each job that commits; while the shop is quiet,
    /// never; shutdown ends a pause.
    #[test]
    fn contention_beside_a_busy_shop_pauses_the_workers_and_commits_end_the_pause() {
        let m = Manners::unlimited(32);
        let off = Shutdown::new();
        m.met_contention();
        assert_eq!(
            m.pause_us.load(Ordering::Relaxed),
            0,
            "the shop quiet: no pause"
        );
        m.set_yielding(true);
        m.met_contention();
        m.met_contention();
        let p = m.pause_us.load(Ordering::Relaxed);
        assert_eq!(p, 2 * PAUSE_MIN.as_micros() as u64);
        let t = Instant::now();
        m.pause(&off);
        assert!(
            t.elapsed() >= Duration::from_micros(p) / 2,
            "{:?}",
            t.elapsed()
        );
        for _ in 0..20 {
            m.met_contention();
        }
        assert_eq!(
            m.pause_us.load(Ordering::Relaxed),
            PAUSE_MAX.as_micros() as u64
        );
        let stop = Shutdown::new();
        stop.trigger();
        let t = Instant::now();
        m.pause(&stop);
        assert!(t.elapsed() < PAUSE_MAX / 2, "shutdown ends the pause");
        m.set_yielding(false);
        let t = Instant::now();
        m.pause(&off);
        assert!(t.elapsed() < PAUSE_MAX / 2, "a quiet shop ends the pause");
        m.went_through(60);
        assert_eq!(m.pause_us.load(Ordering::Relaxed), 0, "commits end it");
    }

    #[test]
    fn set_sizes_halve_under_contention_and_grow_back_one_by_one() {
        let m = Manners::unlimited(32);
        m.contended("a");
        m.contended("a");
        assert_eq!((m.set_size("a"), m.set_size("b")), (8, 32));
        for _ in 0..5 {
            m.contended("a");
        }
        assert_eq!(m.set_size("a"), 1);
        m.committed("a", true);
        m.committed("a", true);
        assert_eq!(m.set_size("a"), 3);
        for _ in 0..100 {
            m.committed("b", true);
        }
        assert_eq!(m.set_size("b"), 32);
    }
}
