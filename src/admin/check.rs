//! `worker stats --check`: the figures held against thresholds, as a monitoring plugin
//! (Nagios, Icinga, Zabbix, Sensu ...) expects it: one line `STATUS - summary | perfdata`
//! and the exit code 0 ok, 1 warning, 2 critical, 3 unknown.
//!
//! A figure is at a level when it is *above* that level's threshold (Nagios range
//! semantics: perfdata `pending=3;100;1000` alerts above 100 and above 1000). The worst
//! figure decides the status. Unknown is only for "could not look": Redis unreachable or
//! answering with an error.

use super::stats::StatsArgs;
use crate::config::Config;
use crate::figures::{gather_all, redis_now_ms, wrong_types, StatsReport};
use crate::store::Memory;
use clap::Args;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// Thresholds of `--check`: a figure above a level's value is at that level.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Check thresholds (--check)")]
pub struct Thresholds {
    /// Pending (delivered, unacknowledged) entries above this: warning.
    #[arg(long, default_value_t = 100)]
    pub pending_warn: u64,
    /// Pending entries above this: critical.
    #[arg(long, default_value_t = 1000)]
    pub pending_crit: u64,
    /// Oldest pending entry older than this: warning.
    #[arg(long, default_value = "10m", value_parser = super::parse_duration)]
    pub oldest_warn: Duration,
    /// Oldest pending entry older than this: critical.
    #[arg(long, default_value = "1h", value_parser = super::parse_duration)]
    pub oldest_crit: Duration,
    /// Mover lag (how overdue the oldest due member of the pool is) above this: warning.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration)]
    pub mover_lag_warn: Duration,
    /// Mover lag above this: critical (no mover running, or it cannot keep up).
    #[arg(long, default_value = "5s", value_parser = super::parse_duration)]
    pub mover_lag_crit: Duration,
    /// New dead letters (within --dead-window) above this: warning; 0 means any.
    #[arg(long, default_value_t = 0)]
    pub dead_warn: u64,
    /// New dead letters above this: critical [default: never].
    #[arg(long)]
    pub dead_crit: Option<u64>,
    /// List mode: messages waiting in a queue above this: warning.
    #[arg(
        help_heading = "Check thresholds, list mode only (--check --source list)",
        long,
        default_value_t = 10_000
    )]
    pub queue_length_warn: u64,
    /// List mode: messages waiting in a queue above this: critical.
    #[arg(
        help_heading = "Check thresholds, list mode only (--check --source list)",
        long,
        default_value_t = 100_000
    )]
    pub queue_length_crit: u64,
    /// List mode: a queue's oldest waiting message older than this: warning.
    #[arg(help_heading = "Check thresholds, list mode only (--check --source list)", long, default_value = "1m", value_parser = super::parse_duration)]
    pub queue_oldest_warn: Duration,
    /// List mode: a queue's oldest waiting message older than this: critical.
    #[arg(help_heading = "Check thresholds, list mode only (--check --source list)", long, default_value = "10m", value_parser = super::parse_duration)]
    pub queue_oldest_crit: Duration,
    /// A live worker's clock offset to Redis (either way) beyond this: warning.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration)]
    pub clock_offset_warn: Duration,
    /// A live worker's clock offset to Redis beyond this: critical.
    #[arg(long, default_value = "10s", value_parser = super::parse_duration)]
    pub clock_offset_crit: Duration,
    /// Workers expected alive (a live heartbeat): none is critical, fewer than this a
    /// warning; 0 leaves the workers out of the check (a host that checks the queue only).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub expect_workers: u64,
}

impl Default for Thresholds {
    /// The flags' defaults, from the one place they are written: the `#[arg]`s above.
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            t: Thresholds,
        }
        <Defaults as clap::Parser>::parse_from(["check"]).t
    }
}

/// Ordered by severity, so the worst of several is their `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    Ok,
    Warning,
    Critical,
    Unknown,
}

impl Status {
    /// The monitoring-plugin exit code.
    pub fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::Warning => 1,
            Status::Critical => 2,
            Status::Unknown => 3,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::Warning => "WARNING",
            Status::Critical => "CRITICAL",
            Status::Unknown => "UNKNOWN",
        }
    }
}

/// The outcome of a check: its status and the line to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub status: Status,
    pub line: String,
}

/// One figure against its two levels.
struct Figure {
    status: Status,
    /// `pending 3`, or `pending 150 (warn > 100)` when over a level.
    text: String,
    perf: String,
}

fn figure(
    name: &str,
    shown: String,
    value: f64,
    warn: f64,
    crit: Option<f64>,
    perf: String,
) -> Figure {
    let (status, note) = match crit {
        Some(c) if value > c => (Status::Critical, format!(" (crit > {})", num(c))),
        _ if value > warn => (Status::Warning, format!(" (warn > {})", num(warn))),
        _ => (Status::Ok, String::new()),
    };
    Figure {
        status,
        text: format!("{name} {shown}{note}"),
        perf,
    }
}

/// A threshold as people write it: no `.0` on whole numbers.
fn num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// A perfdata label from a queue name: `=` and `'` cannot be in one, and one with
/// spaces is quoted.
fn label(name: &str, figure: &str) -> String {
    let l = format!("{name}_{figure}").replace(['=', '\''], "_");
    if l.contains(char::is_whitespace) {
        format!("'{l}'")
    } else {
        l
    }
}

/// Holds the report against the thresholds (see [`figures`]), with what `memory` says of
/// the Redis servers of the worker's keys (`INFO memory`, by key): a policy that may evict
/// them is CRITICAL, keys evicted that may have been theirs too (until `CONFIG RESETSTAT`,
/// see [`Memory::evicted_data`]), memory near `maxmemory` a WARNING.
pub fn evaluate_all(r: &StatsReport, t: &Thresholds, memory: &[(String, Memory)]) -> Verdict {
    let (mut figs, extra) = figures(r, t);
    for (key, m) in memory {
        if m.evicts_data() {
            figs.push(Figure {
                status: Status::Critical,
                text: format!(
                    "redis maxmemory-policy {} on the server of {key}: it may evict scheduled jobs (set noeviction)",
                    m.policy
                ),
                perf: String::new(),
            });
        }
        if let Some(n) = m.evicted_data() {
            figs.push(Figure {
                status: Status::Critical,
                text: crate::watch::evicted_text(n, key),
                perf: String::new(),
            });
        }
        if let Some(f) = m.fill().filter(|f| *f > crate::watch::NEAR_FULL) {
            figs.push(Figure {
                status: Status::Warning,
                text: format!(
                    "redis memory {:.0}% of maxmemory on the server of {key} (warn > {:.0}%)",
                    f * 100.0,
                    crate::watch::NEAR_FULL * 100.0
                ),
                perf: String::new(),
            });
        }
    }
    verdict(&figs, &extra)
}

/// [`evaluate_all`] without looking at Redis's memory.
pub fn evaluate(r: &StatsReport, t: &Thresholds) -> Verdict {
    let (figs, extra) = figures(r, t);
    verdict(&figs, &extra)
}

/// The live workers' own view, from the health records in their heartbeat keys: the
/// largest clock offset to Redis (with the worker's name) against its levels, and each
/// worker's problems (CRITICAL for one that holds jobs back or breaks a guarantee,
/// WARNING for the others), named with the worker. Nothing without records.
fn worker_figures(r: &StatsReport, t: &Thresholds) -> Vec<Figure> {
    let mut out = Vec::new();
    match live_workers(r, t.expect_workers) {
        // No worker at all leads the line: it is what the operator must act on.
        Some(f) if f.status == Status::Critical => out.insert(0, f),
        Some(f) => out.push(f),
        None => {}
    }
    let secs = |d: Duration| d.as_secs_f64();
    let worst = r
        .workers
        .iter()
        .filter_map(|w| Some((w, w.record.as_ref()?.clock_offset_ms?)))
        .max_by_key(|(_, o)| o.abs());
    if let Some((w, o)) = worst {
        let s = o as f64 / 1000.0;
        out.push(figure(
            "clock offset",
            format!("{s:+.1}s ({})", w.name),
            s.abs(),
            secs(t.clock_offset_warn),
            Some(secs(t.clock_offset_crit)),
            format!(
                "clock_offset={:.3}s;{};{}",
                s.abs(),
                num(secs(t.clock_offset_warn)),
                num(secs(t.clock_offset_crit))
            ),
        ));
    }
    for w in &r.workers {
        let Some(rec) = &w.record else { continue };
        let (critical, warnings) = rec.split();
        for (status, ps) in [(Status::Critical, critical), (Status::Warning, warnings)] {
            for p in ps {
                out.push(Figure {
                    status,
                    text: format!("worker {}: {}: {}", w.name, p.role, p.what),
                    perf: String::new(),
                });
            }
        }
    }
    let lost = r.dead.lost + r.queues.iter().map(|q| q.dead_lost).sum::<u64>();
    if lost > 0 {
        out.push(Figure {
            status: Status::Critical,
            text: format!(
                "lost data {lost} (pool members whose data vanished: their dead letters say lost data)"
            ),
            perf: format!("lost_data={lost};0;0"),
        });
    }
    out
}

/// The workers' figures after the queue's, but "no worker is running" first.
fn add_worker_figures(figures: &mut Vec<Figure>, r: &StatsReport, t: &Thresholds) {
    let mut workers = worker_figures(r, t);
    if workers
        .first()
        .is_some_and(|f| f.text.starts_with("no worker"))
    {
        figures.insert(0, workers.remove(0));
    }
    figures.extend(workers);
}

/// The live workers against `expect` (0: not checked): none is CRITICAL and says so,
/// fewer than `expect` a WARNING. Perfdata in Nagios's "below" ranges: `workers=1;2:;1:`.
fn live_workers(r: &StatsReport, expect: u64) -> Option<Figure> {
    if expect == 0 {
        return None;
    }
    let live = r.workers.len() as u64;
    let perf = format!("workers={live};{expect}:;1:");
    let whose = if r.queues.is_empty() {
        format!("no consumer of group {} has a live heartbeat", r.group.name)
    } else {
        "no list-mode worker has a live heartbeat".to_string()
    };
    Some(if live == 0 {
        Figure {
            status: Status::Critical,
            text: format!("no worker is running ({whose}; due jobs wait until one starts)"),
            perf,
        }
    } else if live < expect {
        Figure {
            status: Status::Warning,
            text: format!("workers {live} live (warn < {expect})"),
            perf,
        }
    } else {
        Figure {
            status: Status::Ok,
            text: format!("workers {live} live"),
            perf,
        }
    })
}

/// Every figure of the report against the thresholds, and the perfdata of the figures
/// without a threshold. In list mode (the report has queues) the queues take the place of
/// the stream: each queue's length and oldest waiting message, and the new letters of
/// their dead lists; the mover lag counts in both modes; then the workers' own figures.
fn figures(r: &StatsReport, t: &Thresholds) -> (Vec<Figure>, String) {
    let secs = |d: Duration| d.as_secs_f64();
    let lag = r.pool.mover_lag_ms as f64 / 1000.0;
    let orphan = if r.pool.oldest_due_has_data == Some(false) && r.pool.mover_lag_ms > 0 {
        " [oldest due member has no data]"
    } else {
        ""
    };
    let mover_lag = figure(
        "mover lag",
        format!("{lag:.1}s{orphan}"),
        lag,
        secs(t.mover_lag_warn),
        Some(secs(t.mover_lag_crit)),
        format!(
            "mover_lag={lag:.3}s;{};{}",
            num(secs(t.mover_lag_warn)),
            num(secs(t.mover_lag_crit))
        ),
    );
    let dead = |new: u64| {
        figure(
            "dead",
            format!("{new} new"),
            new as f64,
            t.dead_warn as f64,
            t.dead_crit.map(|c| c as f64),
            format!(
                "dead_new={new};{};{}",
                t.dead_warn,
                t.dead_crit.map_or(String::new(), |c| c.to_string())
            ),
        )
    };
    if !r.queues.is_empty() {
        let mut figures = Vec::new();
        for q in &r.queues {
            figures.push(figure(
                &format!("queue {}", q.name),
                format!("{} waiting", q.length),
                q.length as f64,
                t.queue_length_warn as f64,
                Some(t.queue_length_crit as f64),
                format!(
                    "{}={};{};{}",
                    label(&q.name, "length"),
                    q.length,
                    t.queue_length_warn,
                    t.queue_length_crit
                ),
            ));
            let levels = format!(
                "{};{}",
                num(secs(t.queue_oldest_warn)),
                num(secs(t.queue_oldest_crit))
            );
            figures.push(match (q.oldest_age_ms, q.oldest_unknown) {
                // Not guessed: said, and no level.
                (None, Some(why)) => Figure {
                    status: Status::Ok,
                    text: format!("oldest unknown ({why})"),
                    perf: format!("{}=U;{levels}", label(&q.name, "oldest")),
                },
                (age, _) => {
                    let ms = age.unwrap_or(0);
                    figure(
                        "oldest",
                        super::fmt_age(ms),
                        ms as f64 / 1000.0,
                        secs(t.queue_oldest_warn),
                        Some(secs(t.queue_oldest_crit)),
                        format!("{}={}s;{levels}", label(&q.name, "oldest"), ms / 1000),
                    )
                }
            });
        }
        figures.push(mover_lag);
        figures.push(dead(r.queues.iter().map(|q| q.dead_new).sum()));
        add_worker_figures(&mut figures, r, t);
        let extra = format!(
            "pool={} due={} dead={}",
            r.pool.size,
            r.pool.due,
            r.queues.iter().map(|q| q.dead).sum::<u64>()
        );
        return (figures, extra);
    }
    // The oldest job waiting for the readers: delivered and not acknowledged, or due and
    // held in the pool while the stream holds entries no reader has taken yet.
    let oldest_ms = r
        .group
        .oldest_pending_age_ms
        .unwrap_or(0)
        .max(r.pool.readers_backlog_ms);
    let mut figures = vec![
        figure(
            "pending",
            r.group.pending.to_string(),
            r.group.pending as f64,
            t.pending_warn as f64,
            Some(t.pending_crit as f64),
            format!(
                "pending={};{};{}",
                r.group.pending, t.pending_warn, t.pending_crit
            ),
        ),
        figure(
            "oldest",
            super::fmt_age(oldest_ms),
            oldest_ms as f64 / 1000.0,
            secs(t.oldest_warn),
            Some(secs(t.oldest_crit)),
            format!(
                "oldest={}s;{};{}",
                oldest_ms / 1000,
                num(secs(t.oldest_warn)),
                num(secs(t.oldest_crit))
            ),
        ),
        mover_lag,
        dead(r.dead.new),
    ];
    add_worker_figures(&mut figures, r, t);
    // Figures without a threshold, for the graphs.
    let extra = format!(
        "pool={} due={} stream_lag={} dead={}",
        r.pool.size,
        r.pool.due,
        r.group.lag.unwrap_or(0),
        r.dead.length
    );
    (figures, extra)
}

/// The worst figure's status, and the line: every figure's text, then the perfdata with
/// `extra` (figures without a threshold) at the end.
fn verdict(figures: &[Figure], extra: &str) -> Verdict {
    let status = figures.iter().map(|f| f.status).max().unwrap_or(Status::Ok);
    let text: Vec<&str> = figures.iter().map(|f| f.text.as_str()).collect();
    let mut perf: Vec<&str> = figures
        .iter()
        .map(|f| f.perf.as_str())
        .filter(|p| !p.is_empty())
        .collect();
    perf.push(extra);
    Verdict {
        status,
        line: format!(
            "{} - {} | {}",
            status.label(),
            text.join(", "),
            perf.join(" ")
        ),
    }
}

/// `INFO memory` of the server of each shard's keys (by the pool key); what cannot be
/// read (an ACL user without `+info|memory`) is left out.
fn memory(con: &mut dyn redis::ConnectionLike, config: &Config) -> Vec<(String, Memory)> {
    config
        .derived
        .shards
        .iter()
        .filter_map(|k| Some((k.pool.clone(), crate::store::memory(con, &k.pool).ok()?)))
        .collect()
}

/// How long `stats --check` waits for Redis in all, connection included: a server that
/// accepts connections but never answers (stopped, swapping, a network that drops
/// replies) is UNKNOWN this soon, well inside a monitoring system's own timeout (10 s by
/// default in Nagios and Icinga), not after every reply of the connection's setup has
/// timed out one after the other (about 6 s).
pub const CHECK_DEADLINE: Duration = Duration::from_secs(3);

/// [`CHECK_DEADLINE`] through Sentinels: a Sentinel that never answers costs its look-up
/// up to 6 s before the next one is asked (`store::link`), and the check must still see
/// the master the others name.
pub const CHECK_DEADLINE_SENTINEL: Duration = Duration::from_secs(9);

/// `worker stats --check`. Never an `Err` for Redis: that is the UNKNOWN line and exit 3,
/// which a monitoring system tells apart from "the queue is in trouble". The verdict is
/// made on a thread of its own, and one not made within [`CHECK_DEADLINE`] (through
/// Sentinels [`CHECK_DEADLINE_SENTINEL`]) is UNKNOWN (the process exits; the thread is
/// left to its socket's timeout).
pub(super) fn run(
    config: &Config,
    args: &StatsArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (c, a) = (config.clone(), args.clone());
    std::thread::spawn(move || {
        let _ = tx.send(check(&c, &a));
    });
    let deadline = match crate::store::Topology::of(&config.redis_url) {
        crate::store::Topology::Sentinel => CHECK_DEADLINE_SENTINEL,
        _ => CHECK_DEADLINE,
    };
    let verdict = rx.recv_timeout(deadline).unwrap_or_else(|_| Verdict {
        status: Status::Unknown,
        line: format!(
            "UNKNOWN - no answer from Redis at {} within {} s",
            config.derived.redis_shown,
            deadline.as_secs()
        ),
    });
    writeln!(out, "{}", verdict.line)?;
    Ok(ExitCode::from(verdict.status.code()))
}

/// What `stats --check` says, as long as Redis takes to answer.
fn check(config: &Config, args: &StatsArgs) -> Verdict {
    let unknown = |why: String| Verdict {
        status: Status::Unknown,
        line: format!("UNKNOWN - {why}"),
    };
    match super::connect(config) {
        // The error already names the (redacted) URL.
        Err(e) => unknown(super::one_line(&e)),
        Ok(mut con) => match wrong_types(&mut con, config) {
            Ok(bad) if !bad.is_empty() => Verdict {
                status: Status::Critical,
                line: format!(
                    "CRITICAL - {}: the worker cannot write there; rename or remove the key",
                    bad.join(", ")
                ),
            },
            Err(e) => unknown(format!(
                "cannot read the key types from {}: {e}",
                config.derived.redis_shown
            )),
            Ok(_) => {
                match redis_now_ms(&mut con, config)
                    .and_then(|now| gather_all(&mut con, config, now, args.dead_window))
                {
                    Ok(r) => evaluate_all(&r, &args.thresholds, &memory(&mut con, config)),
                    Err(e) => unknown(format!(
                        "cannot read the queue figures from {}: {e}",
                        config.derived.redis_shown
                    )),
                }
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::{DeadFigures, GroupFigures, PoolFigures, QueueFigures, StreamFigures};

    fn report(pending: u64, oldest_ms: i64, lag_ms: i64, dead_new: u64) -> StatsReport {
        StatsReport {
            now_ms: 0,
            stream: StreamFigures {
                key: "s".into(),
                length: 0,
                entries_added: None,
            },
            group: GroupFigures {
                name: "g".into(),
                exists: true,
                lag: Some(0),
                entries_read: Some(0),
                pending,
                oldest_pending_id: None,
                oldest_pending_age_ms: Some(oldest_ms),
            },
            consumers: vec![],
            queues: vec![],
            legacy: Vec::new(),
            shards: Vec::new(),
            workers: Vec::new(),
            by_event: None,
            pool: PoolFigures {
                key: "p".into(),
                size: 0,
                due: 0,
                due_seconds: 0,
                due_ms: 0,
                oldest_due_key: None,
                oldest_due_at_ms: None,
                mover_lag_ms: lag_ms,
                readers_backlog_ms: 0,
                oldest_due_has_data: None,
            },
            dead: DeadFigures {
                key: "d".into(),
                length: dead_new,
                entries_added: None,
                new: dead_new,
                lost: 0,
                window_ms: 300_000,
                newest_age_ms: None,
            },
        }
    }

    /// The defaults with the workers left out: these reports have none.
    fn queue_only() -> Thresholds {
        Thresholds {
            expect_workers: 0,
            ..Thresholds::default()
        }
    }

    #[test]
    fn no_live_worker_is_critical_and_fewer_than_expected_a_warning() {
        use crate::figures::WorkerHealth;
        let mut r = report(0, 0, 0, 0);
        let v = evaluate(&r, &Thresholds::default());
        assert_eq!(v.status, Status::Critical, "{}", v.line);
        assert!(
            v.line.starts_with(
                "CRITICAL - no worker is running (no consumer of group g has a live heartbeat"
            ),
            "{}",
            v.line
        );
        assert!(v.line.contains(" workers=0;1:;1: "), "{}", v.line);
        r.queues = vec![queue("q1", 0, Some(0), 0)];
        let v = evaluate(&r, &Thresholds::default());
        assert!(
            v.line
                .contains("no worker is running (no list-mode worker has a live heartbeat"),
            "{}",
            v.line
        );
        r.queues.clear();
        r.workers = vec![WorkerHealth {
            name: "c1".into(),
            record: None,
        }];
        let v = evaluate(&r, &Thresholds::default());
        assert_eq!(v.status, Status::Ok, "{}", v.line);
        assert!(
            v.line.contains("dead 0 new, workers 1 live |"),
            "{}",
            v.line
        );
        let t = Thresholds {
            expect_workers: 2,
            ..Thresholds::default()
        };
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Warning, "{}", v.line);
        assert!(v.line.contains("workers 1 live (warn < 2)"), "{}", v.line);
        assert!(v.line.contains(" workers=1;2:;1: "), "{}", v.line);
        r.workers.clear();
        assert_eq!(evaluate(&r, &queue_only()).status, Status::Ok);
    }

    /// Keys evicted count against the worker's keys under any policy but a `volatile-*`
    /// one (which evicts only keys with a TTL); a count Redis cannot give says nothing.
    #[test]
    fn evicted_keys_are_critical_unless_only_keys_with_a_ttl_could_go() {
        use crate::figures::WorkerHealth;
        let mut r = report(0, 0, 0, 0);
        r.workers = vec![WorkerHealth {
            name: "c1".into(),
            record: None,
        }];
        let m = |policy: &str, evicted: Option<u64>| {
            vec![(
                "mq:delay:pool".to_string(),
                Memory {
                    policy: policy.into(),
                    max: 0,
                    used: 1,
                    evicted,
                    aof: Some(true),
                    run_id: None,
                },
            )]
        };
        let t = Thresholds::default();
        for (policy, evicted, critical) in [
            ("noeviction", Some(0), false),
            ("noeviction", None, false),
            ("noeviction", Some(12), true),
            ("volatile-lru", Some(12), false),
            ("allkeys-lru", Some(0), true),
        ] {
            let v = evaluate_all(&r, &t, &m(policy, evicted));
            assert_eq!(
                v.status == Status::Critical,
                critical,
                "{policy} {evicted:?}: {}",
                v.line
            );
            assert_eq!(
                v.line.contains("Redis evicted 12 keys"),
                critical && evicted == Some(12),
                "{}",
                v.line
            );
        }
    }

    #[test]
    fn due_members_held_for_busy_readers_count_as_the_oldest_job_not_the_mover_lag() {
        use crate::figures::WorkerHealth;
        let mut r = report(0, 2_000, 0, 0);
        r.workers = vec![WorkerHealth {
            name: "c1".into(),
            record: None,
        }];
        r.pool.readers_backlog_ms = 700_000;
        let v = evaluate(&r, &Thresholds::default());
        assert_eq!(v.status, Status::Warning, "{}", v.line);
        assert!(v.line.contains("oldest=700s;600;3600"), "{}", v.line);
        assert!(v.line.contains("mover_lag=0.000s"), "{}", v.line);
        r.pool.readers_backlog_ms = 3_000;
        assert_eq!(evaluate(&r, &Thresholds::default()).status, Status::Ok);
    }

    #[test]
    fn the_worst_figure_decides() {
        let t = queue_only();
        let v = evaluate(&report(3, 0, 0, 0), &t);
        assert_eq!(v.status, Status::Ok);
        assert_eq!(
            v.line,
            "OK - pending 3, oldest 0s, mover lag 0.0s, dead 0 new | pending=3;100;1000 \
             oldest=0s;600;3600 mover_lag=0.000s;1;5 dead_new=0;0; pool=0 due=0 stream_lag=0 dead=0"
        );
        assert_eq!(evaluate(&report(100, 0, 0, 0), &t).status, Status::Ok);
        assert_eq!(evaluate(&report(101, 0, 0, 0), &t).status, Status::Warning);
        assert_eq!(
            evaluate(&report(1001, 0, 0, 0), &t).status,
            Status::Critical
        );
        assert_eq!(
            evaluate(&report(0, 601_000, 0, 0), &t).status,
            Status::Warning
        );
        assert_eq!(
            evaluate(&report(0, 0, 5_001, 0), &t).status,
            Status::Critical
        );
        let v = evaluate(&report(150, 0, 0, 1), &t);
        assert_eq!(v.status, Status::Warning);
        assert!(v.line.starts_with("WARNING - pending 150 (warn > 100), oldest 0s, mover lag 0.0s, dead 1 new (warn > 0) |"), "{}", v.line);
        let t = Thresholds {
            dead_crit: Some(5),
            ..queue_only()
        };
        assert_eq!(evaluate(&report(0, 0, 0, 6), &t).status, Status::Critical);
    }

    #[test]
    fn the_workers_offsets_and_problems_count() {
        use crate::figures::WorkerHealth;
        use crate::health::Record;
        use crate::stats::Reported;
        let t = Thresholds::default();
        let record = |offset: i64, problems: Vec<Reported>| Record {
            events: Vec::new(),
            at_ms: 0,
            host: "h".into(),
            pid: 1,
            version: "0".into(),
            clock_offset_ms: Some(offset),
            clock_error_ms: Some(1),
            producer_ahead: 0,
            producer_lead_max_ms: 0,
            problems,
            move_ahead: None,
        };
        let mut r = report(0, 0, 0, 0);
        r.workers = vec![
            WorkerHealth {
                name: "c1".into(),
                record: Some(record(-400, vec![])),
            },
            WorkerHealth {
                name: "old".into(),
                record: None,
            },
        ];
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Ok, "{}", v.line);
        assert!(v.line.contains("clock offset -0.4s (c1)"), "{}", v.line);
        assert!(v.line.contains("clock_offset=0.400s;1;10"), "{}", v.line);
        r.workers[0].record = Some(record(-120_000, vec![]));
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Critical, "{}", v.line);
        assert!(
            v.line.contains("clock offset -120.0s (c1) (crit > 10)"),
            "{}",
            v.line
        );
        r.workers[0].record = Some(record(2_000, vec![]));
        assert_eq!(evaluate(&r, &t).status, Status::Warning);
        let p = |severity: &str| Reported {
            role: "redis".into(),
            what: "maxmemory-policy is allkeys-lru".into(),
            severity: severity.into(),
        };
        r.workers[0].record = Some(record(0, vec![p("warning")]));
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Warning, "{}", v.line);
        assert!(
            v.line
                .contains("worker c1: redis: maxmemory-policy is allkeys-lru"),
            "{}",
            v.line
        );
        r.workers[0].record = Some(record(0, vec![p("critical")]));
        assert_eq!(evaluate(&r, &t).status, Status::Critical);
        r.workers[0].record = Some(record(0, vec![]));
        r.dead.lost = 3;
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Critical);
        assert!(v.line.contains("lost data 3"), "{}", v.line);
    }

    fn queue(name: &str, length: u64, oldest_ms: Option<i64>, dead_new: u64) -> QueueFigures {
        QueueFigures {
            name: name.into(),
            length,
            processing: vec![],
            dead: dead_new,
            dead_new,
            dead_lost: 0,
            oldest_age_ms: oldest_ms,
            oldest_unknown: oldest_ms.is_none().then_some("raw message"),
        }
    }

    #[test]
    fn in_list_mode_the_queues_are_held_against_their_levels() {
        let t = queue_only();
        let mut r = report(5000, 7_200_000, 0, 9);
        r.queues = vec![queue("high", 3, Some(2_000), 0), queue("pay q", 1, None, 0)];
        let v = evaluate(&r, &t);
        assert_eq!(
            v.status,
            Status::Ok,
            "stream figures do not count in list mode"
        );
        assert_eq!(
            v.line,
            "OK - queue high 3 waiting, oldest 2s, queue pay q 1 waiting, oldest unknown (raw message), \
             mover lag 0.0s, dead 0 new | high_length=3;10000;100000 high_oldest=2s;60;600 \
             'pay q_length'=1;10000;100000 'pay q_oldest'=U;60;600 mover_lag=0.000s;1;5 \
             dead_new=0;0; pool=0 due=0 dead=0"
        );
        r.queues = vec![queue("high", 10_001, Some(2_000), 0)];
        assert_eq!(evaluate(&r, &t).status, Status::Warning);
        r.queues = vec![queue("high", 100_001, Some(2_000), 0)];
        assert_eq!(evaluate(&r, &t).status, Status::Critical);
        r.queues = vec![queue("high", 1, Some(61_000), 0)];
        assert_eq!(evaluate(&r, &t).status, Status::Warning);
        r.queues = vec![queue("high", 1, Some(601_000), 0)];
        let v = evaluate(&r, &t);
        assert_eq!(v.status, Status::Critical);
        assert!(v.line.contains("oldest 10m01s (crit > 600)"), "{}", v.line);
        r.queues = vec![queue("a", 0, None, 1), queue("b", 0, None, 1)];
        let v = evaluate(
            &r,
            &Thresholds {
                dead_crit: Some(1),
                ..t
            },
        );
        assert_eq!(
            v.status,
            Status::Critical,
            "the dead lists add up: {}",
            v.line
        );
    }
}
