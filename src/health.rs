//! Each worker's health: the verdicts of this process and the record it publishes in Redis
//! for the operator's tools.
//!
//! **The verdicts.** [`live`] is the watchdog's (`notify.rs` pings systemd while it holds;
//! also the `delay_worker_live` metric and the status page's headline); [`healthy`] is
//! `/healthz`'s before its [`Probe`] of both servers (also `delay_worker_healthy`, and the
//! status page's alerts). Every surface that speaks of health asks these.
//!
//! **What "live" means**:
//! the reader finished a step (a read, or a wait for room in the channel) within one
//! block timeout plus [`STALL_MARGIN`], the mover (when this process runs one) a tick
//! within one poll interval plus the margin, and no worker is waiting for a database
//! session. The roles stamp heartbeats in [`Stats`] after each successful step, so a
//! stuck thread, a Redis outage and a PostgreSQL outage all look the same here: no
//! progress. systemd then restarts the unit once `WatchdogSec` passes without a ping; a
//! blip shorter than that costs nothing.
//!
//! **The record.** The reader refreshes the consumer's heartbeat key every `--block`
//! (`SET <prefix>:consumer:<name>:alive <record> PX <ttl>`, `store::heartbeat`); its value
//! is this process's [`Record`], a small JSON object: when it was written, the host,
//! the version, the measured offset of the host's clock to Redis, the producers seen
//! ahead of it, its current problems from [`Stats::problems`] (whatever any role
//! reports, PostgreSQL's included), its events, and its mover's `--move-ahead` when it runs
//! one. Peers only ask whether the key exists (their takeover
//! of a dead consumer's work, `lua/take_over.lua`, `lua/requeue_processing.lua`); `worker
//! stats` and `stats --check`, often on another host, read the record, so every worker's
//! view shows in one place.
//!
//! Bounded: at most [`MAX_PROBLEMS`] problems of at most [`MAX_TEXT`] characters each,
//! and at most [`MAX_EVENTS`] event names, so the key stays under 12 KiB however a role
//! words its problem.

use crate::config::Config;
use crate::db;
use crate::stats::{Reported, Stats};
use crate::store;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Most problems a record carries (the worst first).
pub const MAX_PROBLEMS: usize = 8;
/// Most event names a record carries.
pub const MAX_EVENTS: usize = 32;
/// Longest text of a problem in a record, in characters; longer ones end in `…`.
pub const MAX_TEXT: usize = 300;

/// `/healthz` answers within this: 503 when a server has not answered by then (under the
/// 3 s that probes often allow).
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Connect and I/O timeout of each server the health check asks.
pub const PROBE_IO_TIMEOUT: Duration = Duration::from_millis(1500);

/// Slack over a role's longest healthy step before it counts as stalled: absorbs a slow
/// maintenance pass or a busy Redis without calling the daemon dead.
pub const STALL_MARGIN: Duration = Duration::from_secs(5);

/// What a worker says of itself in its heartbeat key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// When it was written: this host's clock corrected to Redis's (unix ms).
    pub at_ms: i64,
    pub host: String,
    pub pid: u32,
    pub version: String,
    /// This host's clock to Redis's (`redis = host + offset`), and the measurement's
    /// error bound; `None` before the first measurement.
    pub clock_offset_ms: Option<i64>,
    pub clock_error_ms: Option<i64>,
    /// Messages seen whose `ts` was ahead of their arrival (a producer's clock ahead), and
    /// the largest lead (ms), since start.
    pub producer_ahead: u64,
    pub producer_lead_max_ms: i64,
    /// Its problems now, the worst first.
    pub problems: Vec<Reported>,
    /// The events it has handlers for (as it started; at most [`MAX_EVENTS`]), so that
    /// `worker dead requeue` on another host knows them without the handler files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<String>,
    /// Its mover's `--move-ahead` (absent: it runs no mover, or is older), which `worker
    /// stats` reads the pool against (`figures::gather_all`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub move_ahead: Option<usize>,
}

impl Record {
    /// This process's record now.
    pub fn of(stats: &Stats) -> Record {
        let offset = stats.clock.offset();
        let problems = stats
            .problems(crate::now_ms())
            .into_iter()
            .take(MAX_PROBLEMS)
            .map(|mut p| {
                p.role = truncate(&p.role);
                p.what = truncate(&p.what);
                p
            })
            .collect();
        Record {
            at_ms: stats.clock.now_ms(),
            host: host_name(),
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            clock_offset_ms: offset.map(|o| o.offset_ms),
            clock_error_ms: offset.map(|o| o.error_ms),
            producer_ahead: stats.clock.producer_ahead(),
            producer_lead_max_ms: stats.clock.producer_lead_max_ms(),
            problems,
            events: stats
                .jobs
                .event_names()
                .take(MAX_EVENTS)
                .map(truncate)
                .collect(),
            move_ahead: stats.mover_ahead.get().copied(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_string())
    }

    /// A heartbeat key's value as a record; `None` for what an older worker wrote (its
    /// clock in unix ms) or anything else.
    pub fn parse(value: &[u8]) -> Option<Record> {
        serde_json::from_slice(value).ok()
    }

    /// The problems that make a check CRITICAL (blocking or critical), and the warnings.
    pub fn split(&self) -> (Vec<&Reported>, Vec<&Reported>) {
        self.problems.iter().partition(|p| p.severity != "warning")
    }
}

fn truncate(s: &str) -> String {
    if s.chars().count() <= MAX_TEXT {
        return s.to_string();
    }
    let mut t: String = s.chars().take(MAX_TEXT - 1).collect();
    t.push('…');
    t
}

/// The host's name, as the kernel has it.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The health verdict of `/healthz` (before its probe of both servers): [`live`], and no
/// critical problem ([`Stats::report_critical`]: jobs held by a schema fault, PostgreSQL
/// not writable, an evicting Redis, lost data),
/// and no more than `--dead-rate-crit` dead letters written in the last minute. Unlike
/// [`live`], none of these stops the watchdog: a restart would not fix them.
pub fn healthy(stats: &Stats, config: &Config, now_ms: i64) -> Result<(), String> {
    live(stats, config, now_ms)?;
    if let Some(p) = stats.alarm(now_ms) {
        return Err(p);
    }
    let limit = config.dead_rate_crit;
    if limit > 0 {
        let n = stats.jobs.dead_last_minute(now_ms);
        if n > limit {
            return Err(format!(
                "{n} dead letters in the last minute (over --dead-rate-crit {limit}): `worker dead list --newer-than 5m`"
            ));
        }
    }
    Ok(())
}

/// Both verdicts at one moment, as the exporter's gauges and the status page show them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub live: Result<(), String>,
    pub healthy: Result<(), String>,
}

impl Verdict {
    pub fn of(stats: &Stats, config: &Config, now_ms: i64) -> Verdict {
        Verdict {
            live: live(stats, config, now_ms),
            healthy: healthy(stats, config, now_ms),
        }
    }

    /// What holds jobs back besides liveness: why the daemon is not healthy while it is
    /// live (a not-live daemon says so on its own).
    pub fn alerts(&self) -> Vec<String> {
        match (&self.live, &self.healthy) {
            (Ok(()), Err(why)) => vec![why.clone()],
            _ => Vec::new(),
        }
    }
}

/// The liveness verdict described in the module header; `Err` says what is wrong.
pub fn live(stats: &Stats, config: &Config, now_ms: i64) -> Result<(), String> {
    // What an operator must fix comes first: it is also why a role stopped moving.
    if let Some(p) = stats.problem(now_ms) {
        return Err(p);
    }
    // A beat this process missed while it stood still (SIGSTOP, a frozen VM) is not its
    // reader's or mover's fault (found from outside: the first answer after a 10 s stop
    // was 503 "the reader made no progress for 10s").
    let stalled = |beat: u64, step: Duration| {
        let age = now_ms.saturating_sub(beat as i64).max(0) as u64;
        let stood = stats
            .stalls
            .stood_still(crate::stall::STALL, Duration::from_millis(age))
            .map_or(0, |d| d.as_millis() as u64);
        let limit = (step + STALL_MARGIN).as_millis() as u64;
        (age.saturating_sub(stood) > limit).then(|| Duration::from_millis(age).as_secs())
    };
    if let Some(s) = stalled(stats.reader_beat_ms.load(Relaxed), config.reader.block) {
        return Err(format!(
            "the reader made no progress for {s}s (Redis unreachable or the thread stuck)"
        ));
    }
    if config.run_mover {
        if let Some(s) = stalled(stats.mover_beat_ms.load(Relaxed), config.mover.poll) {
            return Err(format!(
                "the mover made no progress for {s}s (Redis unreachable or the thread stuck)"
            ));
        }
    }
    match stats.db_waiting.load(Relaxed) {
        0 => Ok(()),
        n => Err(format!("{n} worker(s) cannot get a PostgreSQL connection")),
    }
}

/// The `/healthz` check: Redis answers PING, and PostgreSQL accepts a new connection
/// (what a restarted worker needs; the workers' pool has none to spare, see
/// `metrics::Sources::pool`) that answers `SELECT 1`. A fresh connection also gives the server's
/// own reason when it refuses, where a pool would only time out.
///
/// The two servers are asked at once, each on a short-lived thread of its own, and the
/// answer comes within [`HEALTH_TIMEOUT`] whatever they do: a server that accepts
/// connections but never answers (stopped, or a network black hole) costs a 503 naming
/// it, not a connection thread stuck in a read. (Asked one after the other, with each
/// reply of a connection's setup allowed [`PROBE_IO_TIMEOUT`], a stopped Redis was a 503
/// at 3 s, just past a client's 3 s timeout: found from outside.) A server's thread is
/// not joined, for the same reason; it ends by itself when its socket times out or
/// errors. One thread per server runs at a time: a request that comes while one runs
/// waits for that one's answer (so two probes at the same moment both get it, and a hung
/// server costs one thread, not one per request).
pub struct Probe {
    redis: store::Redis,
    pg: db::Target,
    shared: Arc<ProbeShared>,
}

#[derive(Default)]
struct ProbeShared {
    /// Redis's part, then PostgreSQL's.
    parts: Mutex<[Part; 2]>,
    /// Signalled when a part's check ends.
    done: Condvar,
}

/// The check of one server.
#[derive(Default)]
struct Part {
    /// The number of the last check started, and since when it runs (`None`: it ended).
    started: u64,
    running: Option<std::time::Instant>,
    /// The last check that ended: its number and result.
    last: Option<(u64, Result<Probed, String>)>,
}

const REDIS: usize = 0;
const POSTGRES: usize = 1;

impl Probe {
    /// The probe of `redis` and of the database at `database_url`, each asked within
    /// [`PROBE_IO_TIMEOUT`]; `Err` for a URL that does not parse.
    pub fn new(redis: &store::Redis, database_url: &str) -> Result<Probe, String> {
        let mut pg = db::Target::parse(database_url).map_err(|e| e.to_string())?;
        pg.config.connect_timeout(PROBE_IO_TIMEOUT);
        pg.config.application_name("delay-worker healthz");
        pg.add_options(&format!(
            "-c statement_timeout={}",
            PROBE_IO_TIMEOUT.as_millis()
        ));
        Ok(Probe {
            redis: redis.clone(),
            pg,
            shared: Arc::default(),
        })
    }

    /// Asks both servers, or waits for the checks running (see above).
    pub fn check(&self) -> Result<Probed, String> {
        let deadline = std::time::Instant::now() + HEALTH_TIMEOUT;
        let shared = &self.shared;
        let mut parts = shared.parts.lock().unwrap_or_else(|p| p.into_inner());
        let mut wanted = [0; 2];
        for i in [REDIS, POSTGRES] {
            if parts[i].running.is_none() {
                let n = parts[i].started + 1;
                let (redis, pg, sh) = (self.redis.clone(), self.pg.clone(), shared.clone());
                std::thread::Builder::new()
                    .name("healthz".into())
                    .spawn(move || {
                        let r = match i {
                            REDIS => probe_redis(&redis),
                            _ => probe_postgres(&pg),
                        };
                        let mut parts = sh.parts.lock().unwrap_or_else(|p| p.into_inner());
                        parts[i].running = None;
                        parts[i].last = Some((n, r));
                        sh.done.notify_all();
                    })
                    .map_err(|e| format!("cannot start the health check: {e}"))?;
                parts[i].started = n;
                parts[i].running = Some(std::time::Instant::now());
            }
            wanted[i] = parts[i].started;
        }
        let silent = |p: &Part| {
            p.running
                .is_some_and(|t| t.elapsed() >= std::time::Duration::from_secs(1))
        };
        let answer = |parts: &[Part; 2], i: usize| match &parts[i].last {
            Some((n, r)) if *n >= wanted[i] => Some(r.clone()),
            _ => None,
        };
        loop {
            match (answer(&parts, REDIS), answer(&parts, POSTGRES)) {
                // Redis failed, and PostgreSQL has not answered for a second or more
                // either: both named (found from outside: both stopped, only Redis was).
                (Some(Err(e)), None) if silent(&parts[POSTGRES]) => {
                    return Err(format!(
                    "{e}; PostgreSQL has not answered a new session's SELECT 1 for {:.1}s either",
                    parts[POSTGRES]
                        .running
                        .map_or(0.0, |t| t.elapsed().as_secs_f64())
                ))
                }
                (Some(Err(e)), _) | (_, Some(Err(e))) => return Err(e),
                (Some(Ok(_)), Some(pg)) => return pg,
                _ => {}
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            parts = match shared.done.wait_timeout(parts, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        let within = HEALTH_TIMEOUT.as_secs_f64();
        Err(match (answer(&parts, REDIS), answer(&parts, POSTGRES)) {
            (None, None) => format!(
                "neither Redis (PING) nor PostgreSQL (a new session's SELECT 1) answered within {within}s"
            ),
            (None, _) => format!("Redis did not answer PING within {within}s"),
            _ => format!("PostgreSQL did not answer a new session's SELECT 1 within {within}s"),
        })
    }
}

fn probe_redis(redis: &store::Redis) -> Result<Probed, String> {
    let silent = || {
        format!(
            "Redis did not answer within {}s",
            PROBE_IO_TIMEOUT.as_secs_f64()
        )
    };
    let mut con = redis
        .connect_within(PROBE_IO_TIMEOUT, PROBE_IO_TIMEOUT)
        .map_err(|e| match e.is_timeout() {
            true => silent(),
            false => format!("Redis unreachable: {e}"),
        })?;
    redis::cmd("PING")
        .query::<String>(&mut con)
        .map_err(|e| match e.is_timeout() {
            true => silent(),
            false => format!("Redis does not answer PING: {e}"),
        })?;
    Ok(Probed::Fine)
}

fn probe_postgres(pg: &db::Target) -> Result<Probed, String> {
    let mut c = match pg.connect() {
        Ok(c) => c,
        // The server answers, and has no connection slot left for a new session (another
        // client took them all): the workers' own sessions go on, and whether they can is
        // `live`'s to say (a worker that cannot get a connection counts there). Not an
        // outage of this worker, so not a 503 that a probe would restart it for, into a
        // start that finds no connection; a warning. Found from outside: 503 for 57 s while
        // the jobs went through, and `stats --check` OK.
        Err(e) if e.code() == Some(&postgres::error::SqlState::TOO_MANY_CONNECTIONS) => {
            return Ok(Probed::NoSlotLeft(format!(
                "PostgreSQL has no connection left for a new session: {}; the workers' own \
                 sessions go on, but a restart now (of this process or of the shop's) would \
                 find none: see what holds them (pg_stat_activity)",
                db::error_text(&e)
            )))
        }
        Err(e) => return Err(format!("no PostgreSQL connection: {}", db::error_text(&e))),
    };
    c.simple_query("SELECT 1")
        .map_err(|e| format!("PostgreSQL SELECT 1 failed: {}", db::error_text(&e)))?;
    Ok(Probed::Fine)
}

/// What a probe that found both servers answering says ([`Probe::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probed {
    Fine,
    /// PostgreSQL refused a new session for want of connection slots (53300): a warning.
    NoSlotLeft(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_missed_while_the_process_stood_still_is_not_the_reader_s() {
        let stats = Stats::default();
        let config = Config::new("redis://127.0.0.1/", "postgres://localhost/x");
        let now = crate::now_ms();
        stats.reader_beat_ms.store((now - 12_000) as u64, Relaxed);
        stats.mover_beat_ms.store(now as u64, Relaxed);
        assert!(
            live(&stats, &config, now).is_err(),
            "a reader stuck for 12 s"
        );
        stats.stalls.stood_still_for(Duration::from_secs(11));
        assert_eq!(
            live(&stats, &config, now),
            Ok(()),
            "the process stood still 11 s"
        );
    }

    #[test]
    fn a_record_is_bounded_and_reads_back() {
        let stats = Stats::default();
        for i in 0..20 {
            stats.report_problem(&format!("worker-{i}"), "x".repeat(5_000));
        }
        stats.report_trouble("inbox pruner", "no DELETE privilege".into());
        stats.clock.set(crate::clock::Offset {
            offset_ms: -120_000,
            error_ms: 1,
        });
        let r = Record::of(&stats);
        assert_eq!(r.problems.len(), MAX_PROBLEMS);
        assert!(r
            .problems
            .iter()
            .all(|p| p.what.chars().count() == MAX_TEXT));
        assert!(r.problems[0].what.ends_with('…'));
        let json = r.to_json();
        assert!(json.len() < 4096, "{} bytes", json.len());
        let back = Record::parse(json.as_bytes()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.clock_offset_ms, Some(-120_000));
        let (critical, warnings) = back.split();
        assert_eq!((critical.len(), warnings.len()), (MAX_PROBLEMS, 0));
        assert_eq!(
            Record::parse(b"1796152213000"),
            None,
            "an older worker's value"
        );
    }

    #[test]
    fn stale_heartbeats_and_database_waits_are_not_live() {
        let config = Config::new("redis://127.0.0.1/", "postgres://h/d");
        let stats = Stats::default();
        let now = 1_000_000_000;
        stats.reader_beat_ms.store(now as u64, Relaxed);
        stats.mover_beat_ms.store(now as u64, Relaxed);
        assert_eq!(live(&stats, &config, now + 1000), Ok(()));
        let late = now + (config.reader.block + STALL_MARGIN).as_millis() as i64 + 1000;
        let e = live(&stats, &config, late).unwrap_err();
        assert!(e.contains("reader made no progress"), "{e}");
        stats.reader_beat_ms.store(late as u64, Relaxed);
        assert!(live(&stats, &config, late).unwrap_err().contains("mover"));
        stats.mover_beat_ms.store(late as u64, Relaxed);
        stats.db_waiting.store(2, Relaxed);
        assert!(live(&stats, &config, late)
            .unwrap_err()
            .contains("PostgreSQL"));
    }
}
