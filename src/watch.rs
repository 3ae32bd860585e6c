//! The watch role: what the worker's guarantees need of its surroundings, looked at.
//!
//! One thread of the daemon. At start and every [`clock::MEASURE_EVERY`] (or
//! `--stats-interval` when shorter; every second until the clock has been measured once,
//! and every second while a critical problem of its own stands, so a fix shows at once)
//! it
//! - measures this host's clock against Redis's ([`offset`]: a few `TIME` round trips on
//!   the server of shard 0, the quickest wins; the daemon measures it the same way once
//!   before the roles start) and stores the offset in [`Stats::clock`], which every role
//!   corrects its clock with; an offset beyond [`clock::SKEW_WARN`] is logged (again
//!   every [`LOG_EVERY`] while it lasts, or when it changes by a second);
//! - reads `INFO memory` of the server of each shard: a `maxmemory-policy` that may evict
//!   the worker's keys (`allkeys-*`) is a critical problem (`/healthz` 503, `stats
//!   --check` CRITICAL; a warning only with `--allow-eviction`), memory above
//!   [`NEAR_FULL`] of `maxmemory` a warning: Redis refuses writes (OOM) when it is full;
//!   and its `evicted_keys` (`INFO stats`): keys evicted that may have been the worker's
//!   are a critical problem, with `--allow-eviction` too, until the count is reset
//!   (`CONFIG RESETSTAT`; a Redis restart resets it too, but a process that saw them
//!   keeps them, as its `run_id` tells): at the first pass any under a policy other than
//!   `volatile-*`, after that any that went between two passes unless the policy was
//!   `volatile-*` at both (so a `volatile-*` policy seen at both that was `allkeys-*` in
//!   between is not told). An evicted pool or data hash leaves nothing else that could tell (found from
//!   outside: the whole pool evicted under `allkeys-random`, the policy set back to
//!   `noeviction`, or to `volatile-lru`, and every check green while a thousand orders
//!   were never cancelled);
//! - logs the largest lead of a producer's clock the workers saw since the last pass;
//! - from its second pass on, reads the queue's figures as `worker stats` does
//!   ([`figures::gather_all`]): a due job that waits in the pool unmoved longer than
//!   `--mover-lag-crit` (the readers' backlog apart) is a critical problem, whether or not
//!   this process runs a mover: no process runs one (each started with `--no-mover`), or
//!   the movers cannot keep up. Cleared at the first pass that finds the lag under it.
//!
//! [`refuse_eviction`] is the same policy check at start, where an evicting policy stops
//! the daemon with one line. A Redis that cannot be reached is the other roles' outage to
//! report; this one logs it at debug and tries again at its next pass. Stops within one
//! pass of shutdown (its sleep is woken at once).

use crate::clock::{self, Offset, SKEW_WARN};
use crate::config::Config;
use crate::figures;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store::{self, Memory, StoreError};
use std::time::{Duration, Instant};

/// `TIME` round trips per measurement; the quickest one counts.
const SAMPLES: usize = 5;
/// A persisting clock offset is logged again this often.
const LOG_EVERY: Duration = Duration::from_secs(300);
/// Used memory beyond this share of `maxmemory` is a warning.
pub const NEAR_FULL: f64 = 0.9;
/// The role its problems are reported under.
const REDIS: &str = "redis";
const EVICTED: &str = "redis evictions";
const MEMORY: &str = "redis memory";
const POOL: &str = "pool";

pub struct Watch<'a> {
    config: &'a Config,
    stats: &'a Stats,
    /// The pool key of each shard: `INFO` and `TIME` go to the server holding it.
    keys: Vec<String>,
    /// When the offset was last logged, and what it was.
    logged: Option<(Instant, i64)>,
    /// `INFO memory` was refused (an ACL user without `+info|memory`): said once.
    info_refused: bool,
    /// A pass has run: the first, at start, does not judge the mover lag (this process's
    /// own mover has not moved yet).
    passed: bool,
    /// A critical problem of this role stands, an evicting policy or due jobs unmoved:
    /// the passes come every [`RAISED_RETRY`] until it clears, so the operator's fix turns
    /// `/healthz` green within a second or so, not at the next ordinary pass.
    evicting: bool,
    unmoved: bool,
    /// Per shard: the keys evicted that may have been the worker's.
    evictions: Vec<Evictions>,
    /// The lock waiters an earlier run left in the pool have been read ([`Watch::lock_waiters_left`]).
    inventoried: bool,
}

/// The keys a server evicted that may have been the worker's, counted from one pass to
/// the next (see the module's text).
#[derive(Clone, Default)]
struct Evictions {
    /// `evicted_keys` at the last pass, whether the policy then was a `volatile-*` one,
    /// and the server's `run_id`.
    last: Option<(u64, bool, Option<String>)>,
    /// Counted so far, until the count is reset.
    counted: Option<u64>,
}

impl Evictions {
    /// Takes this pass's reading; the keys counted so far (`None`: none, or no count
    /// could be read this pass).
    fn look(&mut self, m: &Memory) -> Option<u64> {
        let n = m.evicted?;
        let volatile = m.policy.starts_with("volatile-");
        // Keys gone since the last pass, and whether the policy was volatile then.
        let (gone, was_volatile) = match &self.last {
            // The first pass: what went before it, under a policy not seen.
            None => (n, false),
            // Redis restarted: its count starts again; what was counted stays.
            Some((_, v, run)) if run.is_some() && *run != m.run_id => (n, *v),
            // `CONFIG RESETSTAT`: the operator's word that it is dealt with.
            Some((was, v, _)) if n < *was => {
                self.counted = None;
                (n, *v)
            }
            Some((was, v, _)) => (n - was, *v),
        };
        if gone > 0 && !(volatile && was_volatile) {
            self.counted = Some(self.counted.unwrap_or(0) + gone);
        }
        self.last = Some((n, volatile, m.run_id.clone()));
        self.counted
    }
}

impl<'a> Watch<'a> {
    pub fn new(config: &'a Config, stats: &'a Stats) -> Watch<'a> {
        Watch {
            config,
            stats,
            keys: config
                .derived
                .shards
                .iter()
                .map(|k| k.pool.clone())
                .collect(),
            logged: None,
            info_refused: false,
            passed: false,
            evicting: false,
            unmoved: false,
            evictions: vec![Evictions::default(); config.derived.shards.len()],
            inventoried: false,
        }
    }

    /// How often a pass runs.
    pub fn every(&self) -> Duration {
        clock::MEASURE_EVERY.min(self.config.stats_interval)
    }

    /// One pass: the clock, Redis's memory settings, the producers' clocks.
    pub fn step(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<(), StoreError> {
        self.measure(con)?;
        self.memory(con)?;
        if !self.inventoried {
            match self.lock_waiters_left(con) {
                Err(e) if e.is_connection() => return Err(e),
                // A key of another type is the other roles' problem to report.
                Err(e) => log::debug!("watch: the lock waiters left in the pool: {e}"),
                Ok(()) => {}
            }
            self.inventoried = true;
        }
        if self.passed {
            self.mover_lag(con);
        }
        self.passed = true;
        if let Some(lead) = self.stats.clock.take_producer_lead() {
            log::warn!(
                "clock: messages arrived with a ts up to {:.1}s later than their arrival on \
                 Redis's clock ({} such messages since start): a producer's clock runs ahead; \
                 synchronise every producer host (NTP, chrony)",
                lead as f64 / 1000.0,
                self.stats.clock.producer_ahead()
            );
        }
        Ok(())
    }

    /// Measures this host's offset to Redis and logs it when beyond [`SKEW_WARN`].
    pub fn measure(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<Offset, StoreError> {
        let o = offset(con, &self.keys[0])?;
        self.stats.clock.set(o);
        let beyond = o.offset_ms.abs() > SKEW_WARN.as_millis() as i64 + o.error_ms;
        if beyond {
            let again = self.logged.is_none_or(|(at, was)| {
                at.elapsed() >= LOG_EVERY || (was - o.offset_ms).abs() >= 1000
            });
            if again {
                let (side, by) = if o.offset_ms < 0 {
                    ("ahead of", -o.offset_ms)
                } else {
                    ("behind", o.offset_ms)
                };
                log::warn!(
                    "clock: this host's clock is {:.3}s {side} Redis's (offset {}); due times \
                     are decided on Redis's clock and this worker corrects its own, but \
                     synchronise every host's clock (NTP, chrony): PostgreSQL's now() in the \
                     handlers and the producers' due times are not corrected",
                    by as f64 / 1000.0,
                    clock::describe(&o)
                );
                self.logged = Some((Instant::now(), o.offset_ms));
            }
        } else if self.logged.take().is_some() {
            log::info!(
                "clock: this host's clock is within {}s of Redis's again (offset {})",
                SKEW_WARN.as_secs(),
                clock::describe(&o)
            );
        }
        Ok(o)
    }

    /// Reads each shard's server's memory settings and reports what endangers the jobs.
    fn memory(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<(), StoreError> {
        let mut evicting = None;
        let mut full = None;
        let mut evicted = None;
        for (i, key) in self.keys.iter().enumerate() {
            let m = match store::memory(con, key) {
                Ok(m) => m,
                Err(StoreError::Refused { source, .. }) if source.code() == Some("NOPERM") => {
                    if !std::mem::replace(&mut self.info_refused, true) {
                        log::warn!(
                            "redis: INFO memory refused ({source}): the eviction policy and \
                             memory are not watched; give the ACL user +info|memory"
                        );
                    }
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            if m.evicts_data() && evicting.is_none() {
                evicting = Some((key.clone(), m.clone()));
            }
            if let (Some(n), None) = (self.evictions[i].look(&m), &evicted) {
                evicted = Some((key.clone(), n));
            }
            if m.fill().is_some_and(|f| f > NEAR_FULL) && full.is_none() {
                full = Some((key.clone(), m));
            }
        }
        self.evicting = evicting.is_some() && !self.config.allow_eviction;
        match evicting {
            Some((key, m)) => {
                let what = evicting_text(&m, &key, self.keys.len() > 1);
                let log = if self.config.allow_eviction {
                    self.stats.report_trouble(REDIS, what.clone())
                } else {
                    self.stats.report_critical(REDIS, what.clone())
                };
                if log {
                    log::error!("{REDIS}: {what}");
                }
            }
            None => {
                if self.stats.clear_problem(REDIS, i64::MAX) {
                    log::info!("{REDIS}: maxmemory-policy no longer evicts the worker's keys");
                }
            }
        }
        // Keys gone are critical with `--allow-eviction` too: the flag lets the worker run
        // on such a Redis, it does not make a loss quiet (found from outside: a fleet run
        // with it answered 200 while 300 jobs were evicted).
        self.evicting |= evicted.is_some();
        match evicted {
            Some((key, n)) => {
                let what = evicted_text(n, &key);
                if self.stats.report_critical_about(EVICTED, what.clone(), key) {
                    log::error!("{EVICTED}: {what}");
                }
            }
            None => {
                if self.stats.clear_problem(EVICTED, i64::MAX) {
                    log::info!("{EVICTED}: the count of evicted keys was reset (CONFIG RESETSTAT)");
                }
            }
        }
        match full {
            Some((key, m)) => {
                let what = format!(
                    "used memory is {:.0}% of maxmemory ({} of {} bytes) on the server of {key}: \
                     at 100% Redis refuses every write (OOM) and jobs wait; raise maxmemory or \
                     free memory",
                    m.fill().unwrap_or(0.0) * 100.0,
                    m.used,
                    m.max
                );
                if self.stats.report_trouble(MEMORY, what.clone()) {
                    log::warn!("{MEMORY}: {what}");
                }
            }
            None => {
                if self.stats.clear_problem(MEMORY, i64::MAX) {
                    log::info!(
                        "{MEMORY}: used memory is below {:.0}% of maxmemory again",
                        NEAR_FULL * 100.0
                    );
                }
            }
        }
        Ok(())
    }

    /// Reports the pool's mover lag beyond `--mover-lag-crit` as critical, and clears it
    /// once under. Figures that cannot be read leave the verdict as it was (an
    /// unreachable Redis is the other roles' to report).
    /// At start, the jobs an earlier run (of this process or another) sent back to the
    /// pool after waiting in vain for another transaction's lock: this process counts them
    /// as waiting ([`crate::stats::Contention::waiting`]), each until its retry is due and
    /// [`crate::stats::CONTENTION_FORGET`] after, so that a restart during a long lock is
    /// critical at once when one has waited past `--retry-for` and `--max-retries`, not
    /// only at its next try (up to [`crate::workers::CONTENTION_CAP`] later; found from
    /// outside: a restarted process green for 20 s while an order waited past the horizon).
    /// Reads at most [`LEFT_SCAN`] retries of each shard, a page at a time.
    fn lock_waiters_left(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<(), StoreError> {
        let limit = self.config.jobs.max_message_bytes;
        let (mut found, mut scanned) = (0usize, 0usize);
        // Redis's clock less this host's: a failure's time (Redis's) on this host's clock.
        let ahead = self.stats.clock.now_ms() - crate::now_ms();
        let mut first_met: Option<i64> = None;
        for keys in &self.config.derived.shards {
            let mut cursor = 0;
            let mut read = 0;
            loop {
                let (next, page) = store::pool::retries_page(con, keys, cursor, LEFT_PAGE)?;
                read += page.len();
                for r in page {
                    let (Some(msg), Some(due_ms)) = (r.msg, r.due_ms) else {
                        continue;
                    };
                    let Ok(env) = crate::message::Envelope::decode(&msg, limit) else {
                        continue;
                    };
                    if !env.waited_lock() {
                        continue;
                    }
                    found += 1;
                    let met = env
                        .failed_at()
                        .map_or(crate::now_ms(), |at| (at - ahead).min(crate::now_ms()));
                    // Its tries have waited for a lock since then (an earlier build's
                    // retry does not say: since its last failure).
                    let began = env.waited_since().map_or(met, |at| (at - ahead).min(met));
                    first_met = Some(first_met.map_or(began, |f| f.min(began)));
                    self.stats.contention.waiting(
                        &r.key,
                        &env.event,
                        env.first_due.unwrap_or(due_ms),
                        (
                            env.last_error().unwrap_or("another transaction's lock"),
                            true,
                            env.retry,
                        ),
                        due_ms,
                        met,
                        Some((due_ms, msg.as_slice())),
                    );
                }
                cursor = next;
                if cursor == 0 || read >= LEFT_SCAN {
                    break;
                }
            }
            scanned += read;
        }
        // A process restarted during a lock every job meets counts the standstill from
        // when their contention began, not from its own start (found from outside: red
        // 41–59 s after the lock, where the others were red at 32 s).
        if let Some(met) = first_met {
            self.stats.contention.began_by(met);
        }
        if found > 0 {
            log::info!(
                "{found} job(s) in the pool wait for another transaction's lock since an earlier run (of {scanned} retries read); counted as waiting until they are tried again"
            );
        }
        Ok(())
    }

    fn mover_lag(&mut self, con: &mut dyn redis::ConnectionLike) {
        let limit = self.config.mover_lag_crit;
        if limit.is_zero() {
            return;
        }
        // Redis's clock through the offset this pass has just measured: no TIME of its own.
        let now = self.stats.clock.now_ms();
        let report = figures::gather_all(con, self.config, now, Duration::ZERO);
        let (pool, workers, legacy) = match report {
            Ok(r) => (r.pool, r.workers, r.legacy),
            Err(e) => {
                log::debug!("watch: the queue's figures: {e}");
                return;
            }
        };
        let lag = Duration::from_millis(pool.mover_lag_ms.max(0) as u64);
        self.unmoved = lag > limit;
        // This process's own stand-still within the lag, when it runs a mover: due jobs
        // waited for it while it was stopped.
        let stood = self
            .config
            .run_mover
            .then(|| self.stats.stalls.stood_still(crate::stall::STALL, lag))
            .flatten();
        if let Some(stood) = explained_by_a_pause(lag, limit, stood) {
            let what = format!(
                "due jobs waited unmoved up to {:.1}s: this process, which runs a mover, stood \
                 still for {:.1}s (SIGSTOP, a frozen VM, a host out of CPU); its mover is \
                 catching up",
                lag.as_secs_f64(),
                stood.as_secs_f64()
            );
            if self
                .stats
                .report_trouble_about(POOL, what.clone(), "paused".into())
            {
                log::warn!("{POOL}: {what}");
            }
        } else if lag > limit {
            // The lag is a legacy pool's when one of them holds the oldest due member.
            let legacy = legacy
                .into_iter()
                .find(|l| l.mover_lag_ms == pool.mover_lag_ms);
            let member = match (&legacy, pool.oldest_due_key.as_deref()) {
                (Some(l), _) => format!(" of the legacy pool {:?}", l.key),
                (None, Some(k)) => format!(" ({k:?})"),
                (None, None) => String::new(),
            };
            // The live processes that run a mover publish their `--move-ahead`.
            let movers = self.config.run_mover
                || workers
                    .iter()
                    .any(|w| w.record.as_ref().is_some_and(|r| r.move_ahead.is_some()));
            let why = if !movers {
                "no live process runs a mover (each started with --no-mover?): start one"
            } else if legacy.is_some() {
                "no live mover moves that pool (a mover moves a legacy pool only when started \
                 with --legacy-pool for it), or the movers are stuck (see their /healthz)"
            } else if pool.oldest_due_has_data == Some(false) {
                // A member whose data is missing waits out the orphan grace, then a mover
                // buries it as lost data: the movers may be fine.
                "it has no data: a mover buries it as lost once its --orphan-grace has passed"
            } else {
                "the movers cannot keep up, or are stuck (see their /healthz)"
            };
            let what = format!(
                "due jobs wait unmoved: the oldest due member{member} was {:.1}s overdue at \
                 the last look (over --mover-lag-crit {}s): {why}; `worker stats` shows the pool",
                lag.as_secs_f64(),
                limit.as_secs_f64()
            );
            // Logged again early when the cause changes, not at each new oldest member.
            if self
                .stats
                .report_critical_about(POOL, what.clone(), why.to_string())
            {
                log::error!("{POOL}: {what}");
            }
        } else if self.stats.clear_problem(POOL, i64::MAX) {
            log::info!(
                "{POOL}: due jobs are moved again (mover lag {:.1}s)",
                lag.as_secs_f64()
            );
        }
    }

    /// The thread body: a pass at once, then one every [`Watch::every`] until shutdown.
    pub fn run(mut self, client: &store::Redis, shutdown: &Shutdown) {
        let mut con = None;
        while !shutdown.is_set() {
            let c = match con.as_mut() {
                Some(c) => c,
                None => match store::connect_with(client, Duration::from_secs(5)) {
                    Ok(c) => con.insert(c),
                    Err(e) => {
                        log::debug!("watch: cannot connect to redis: {e}");
                        shutdown.wait(self.next_pass());
                        continue;
                    }
                },
            };
            if let Err(e) = self.step(c) {
                log::debug!("watch: {e}");
                if e.is_connection() {
                    con = None;
                }
            }
            shutdown.wait(self.next_pass());
        }
        log::debug!("watch: stopped");
    }

    /// How long until the next pass: [`Watch::every`], or [`RAISED_RETRY`] while the clock
    /// has never been measured (every role reads it through the offset) or while a critical
    /// problem of this role stands.
    fn next_pass(&self) -> Duration {
        let unmeasured = self.stats.clock.offset().is_none();
        if unmeasured || self.evicting || self.unmoved {
            self.every().min(RAISED_RETRY)
        } else {
            self.every()
        }
    }
}

/// The part of a mover lag past `limit` that this process's own stand-still explains, if
/// it explains all of it (`stood`: how long the process, which runs a mover, stood still
/// within the lag): told as the pause, a warning, not as movers stuck. Found from outside:
/// right after a 10 s SIGSTOP of the only worker, `/healthz` answered 503 "due jobs wait
/// unmoved ... 5.7s overdue ...: the movers cannot keep up, or are stuck" for a second,
/// before its mover had run again. A lag that goes on growing past the stand-still plus
/// `limit` is critical again.
fn explained_by_a_pause(
    lag: Duration,
    limit: Duration,
    stood: Option<Duration>,
) -> Option<Duration> {
    let stood = stood?;
    (lag > limit && lag.saturating_sub(stood) <= limit).then_some(stood)
}

/// Retries read per round trip at start ([`Watch::lock_waiters_left`]), and at most per shard.
const LEFT_PAGE: usize = 500;
const LEFT_SCAN: usize = 50_000;

/// How soon a pass comes again while the clock has never been measured, or while a
/// critical problem of this role stands.
const RAISED_RETRY: Duration = Duration::from_secs(1);

/// This host's offset to Redis, read on the server that holds `key`: [`SAMPLES`] `TIME`
/// round trips, the quickest wins. The daemon measures it once before its roles start
/// (so none of them reads its clock uncorrected: a host whose clock is off would write
/// the due times of its first retries and held jobs, and its first jobs' lateness, by its
/// own clock), then the watch role at each pass.
pub fn offset(con: &mut dyn redis::ConnectionLike, key: &str) -> Result<Offset, StoreError> {
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        samples.push(store::clock_sample(con, key)?);
    }
    Ok(clock::best(&samples).unwrap_or(Offset {
        offset_ms: 0,
        error_ms: 0,
    }))
}

/// What an evicting policy endangers, in one line.
fn evicting_text(m: &Memory, key: &str, sharded: bool) -> String {
    let whose = if sharded {
        format!(" (the server of {key})")
    } else {
        String::new()
    };
    format!(
        "maxmemory-policy is {}{whose}: Redis may evict the delay pool, its data and the dead \
         letters and lose scheduled jobs; set maxmemory-policy noeviction",
        m.policy
    )
}

/// What keys evicted on the server of `key` may have cost, and how to clear it, in one line.
pub fn evicted_text(n: u64, key: &str) -> String {
    format!(
        "Redis evicted {n} keys (INFO stats evicted_keys) on the server of {key}, and not \
         under a volatile-* maxmemory-policy throughout, as far as seen: scheduled jobs, \
         their data or dead letters may be gone without a trace; compare `worker stats` and the dead letters (\"lost data\") \
         with the shop's own records, keep maxmemory-policy noeviction, then CONFIG RESETSTAT \
         clears this (after a restart of Redis, a restart of the worker)"
    )
}

/// The start's check: `Some(why)` when a server of the worker's keys may evict them and
/// `--allow-eviction` was not given (with it, one loud warning). A policy that cannot be
/// read (an ACL user without `+info|memory`) is a warning: the start goes on. Second, the
/// warning to log once the start has gone through when a server writes no append-only
/// file (found from outside: a Redis without persistence restarted lost every scheduled
/// job, and nothing had said it would).
pub fn refuse_eviction(
    con: &mut dyn redis::ConnectionLike,
    config: &Config,
) -> Result<(Option<String>, Option<String>), StoreError> {
    let keys: Vec<String> = config
        .derived
        .shards
        .iter()
        .map(|k| k.pool.clone())
        .collect();
    // Said once the start has gone through (a refusal is one line).
    let mut no_aof: Option<String> = None;
    let warn_no_aof = |no_aof: Option<String>| {
        no_aof.map(|whose| {
            format!(
                "Redis at {}{whose}: appendonly is off: a restart or crash of Redis loses \
                 the jobs scheduled since its last snapshot, every one without a snapshot; \
                 the guarantees assume appendonly yes with appendfsync always",
                config.derived.redis_shown
            )
        })
    };
    for key in &keys {
        let m = match store::memory(con, key) {
            Ok(m) => m,
            Err(StoreError::Refused { source, .. }) if source.code() == Some("NOPERM") => {
                log::warn!(
                    "redis: INFO memory refused ({source}): cannot check maxmemory-policy; \
                     give the ACL user +info|memory"
                );
                return Ok((None, warn_no_aof(no_aof)));
            }
            Err(e) => return Err(e),
        };
        if m.aof == Some(false) && no_aof.is_none() {
            no_aof = Some(match keys.len() > 1 {
                true => format!(" (the server of {key})"),
                false => String::new(),
            });
        }
        if !m.evicts_data() {
            continue;
        }
        let what = evicting_text(&m, key, keys.len() > 1);
        if config.allow_eviction {
            log::warn!(
                "--allow-eviction: running although {what} (Redis at {})",
                config.derived.redis_shown
            );
            return Ok((None, warn_no_aof(no_aof)));
        }
        return Ok((Some(what), None));
    }
    Ok((None, warn_no_aof(no_aof)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_jobs_unmoved_while_the_process_stood_still_are_its_pause_not_stuck_movers() {
        let (s, limit) = (Duration::from_secs, Duration::from_secs(5));
        // A 10 s stop: the jobs due meanwhile, 5.7 s overdue at the first look after it.
        assert_eq!(
            explained_by_a_pause(s(5) + s(7) / 10, limit, Some(s(10))),
            Some(s(10))
        );
        // Under the limit there is nothing to tell.
        assert_eq!(explained_by_a_pause(s(3), limit, Some(s(10))), None);
        // No stand-still, or one that explains only part of it: the movers' lag.
        assert_eq!(explained_by_a_pause(s(7), limit, None), None);
        assert_eq!(explained_by_a_pause(s(17), limit, Some(s(10))), None);
        assert_eq!(explained_by_a_pause(s(15), limit, Some(s(10))), Some(s(10)));
    }
}
