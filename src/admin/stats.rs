//! `worker stats`: what the queue looks like right now (`figures.rs` reads it), as a table,
//! as JSON, or redrawn every second (`--watch`) with rates.
//!
//! `--watch` is the one loop of the admin tools; it ends on Ctrl-C (or SIGTERM), which
//! only wakes it, so it leaves through the normal return path.

use super::Thresholds;
use crate::config::Config;
use crate::figures::{gather_all, rates, redis_now_ms, Rates, StatsReport};
use crate::text::fmt_age;
use anyhow::Context;
use clap::Args;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// Queue figures: stream, group, consumers, delay pool, dead letters.
#[derive(Args, Debug, Clone)]
pub struct StatsArgs {
    /// Print the figures as one JSON object (for scripts).
    #[arg(long, conflicts_with_all = ["watch", "check"])]
    pub json: bool,
    /// Redraw every second, like top, with moved/acked/dead rates; Ctrl-C ends it.
    #[arg(long, conflicts_with = "check")]
    pub watch: bool,
    /// Monitoring check: print one summary line with perfdata and exit 0 (ok),
    /// 1 (warning), 2 (critical) or 3 (unknown: Redis unreachable).
    #[arg(long)]
    pub check: bool,
    /// Dead letters added within this window count as new.
    #[arg(long, default_value = "5m", value_parser = super::parse_duration)]
    pub dead_window: Duration,
    #[command(flatten)]
    pub thresholds: Thresholds,
}

/// The human table.
pub fn render(r: &StatsReport, rates: Option<&Rates>, out: &mut dyn Write) -> std::io::Result<()> {
    let opt = |v: Option<u64>| v.map_or("?".to_string(), |n| n.to_string());
    let w = r
        .stream
        .key
        .len()
        .max(r.group.name.len())
        .max(r.pool.key.len())
        .max(r.dead.key.len());
    writeln!(
        out,
        "stream  {:w$}  length {}",
        r.stream.key, r.stream.length
    )?;
    if r.group.exists {
        writeln!(
            out,
            "group   {:w$}  lag {}  read {}  pending {}  oldest pending {}",
            r.group.name,
            opt(r.group.lag),
            opt(r.group.entries_read),
            r.group.pending,
            r.group
                .oldest_pending_age_ms
                .map_or("-".to_string(), fmt_age),
        )?;
    } else {
        writeln!(
            out,
            "group   {:w$}  not created yet (no worker has started on this stream)",
            r.group.name
        )?;
    }
    let orphan = if r.pool.oldest_due_has_data == Some(false) {
        "  (its oldest due member has no data yet)"
    } else {
        ""
    };
    writeln!(
        out,
        "pool    {:w$}  size {}  due {} ({} seconds, {} ms scores)  mover lag {:.1}s{orphan}",
        r.pool.key,
        r.pool.size,
        r.pool.due,
        r.pool.due_seconds,
        r.pool.due_ms,
        r.pool.mover_lag_ms as f64 / 1000.0,
    )?;
    if r.pool.readers_backlog_ms > 0 {
        writeln!(
            out,
            "        {:w$}  due members held while the readers are behind (--move-ahead): oldest due {:.1}s ago",
            "",
            r.pool.readers_backlog_ms as f64 / 1000.0,
        )?;
    }
    for l in &r.legacy {
        writeln!(
            out,
            "legacy  {:w$}  size {}  due {}  mover lag {:.1}s",
            l.key,
            l.size,
            l.due,
            l.mover_lag_ms as f64 / 1000.0,
        )?;
    }
    writeln!(
        out,
        "dead    {:w$}  length {}  new {} (last {})  newest {}",
        r.dead.key,
        r.dead.length,
        r.dead.new,
        humantime::format_duration(Duration::from_millis(r.dead.window_ms.max(0) as u64)),
        r.dead
            .newest_age_ms
            .map_or("-".to_string(), |a| format!("{} ago", fmt_age(a))),
    )?;
    for q in &r.queues {
        let held: Vec<String> = q
            .processing
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        let oldest = match (q.oldest_age_ms, q.oldest_unknown) {
            (Some(age), _) => fmt_age(age),
            (None, Some(why)) => format!("? ({why})"),
            (None, None) => "-".to_string(),
        };
        writeln!(
            out,
            "queue   {:w$}  length {}  oldest {oldest}  processing {}  dead {} (new {})",
            q.name,
            q.length,
            if held.is_empty() {
                "0".to_string()
            } else {
                held.join(", ")
            },
            q.dead,
            q.dead_new,
        )?;
    }
    if !r.shards.is_empty() {
        writeln!(out)?;
        writeln!(
            out,
            "{:>5}  {:>9}  {:>7}  {:>9}  {:>8}  {:>14}  {:>9}  {:>6}",
            "shard", "pool", "due", "lag", "pending", "oldest pending", "mover lag", "dead"
        )?;
        for (i, s) in r.shards.iter().enumerate() {
            writeln!(
                out,
                "{:>5}  {:>9}  {:>7}  {:>9}  {:>8}  {:>14}  {:>8.1}s  {:>6}",
                i,
                s.pool.size,
                s.pool.due,
                opt(s.group.lag),
                s.group.pending,
                s.group
                    .oldest_pending_age_ms
                    .map_or("-".to_string(), fmt_age),
                s.pool.mover_lag_ms as f64 / 1000.0,
                s.dead.length,
            )?;
        }
    }
    if let Some(x) = rates {
        writeln!(
            out,
            "rates   {:w$}  moved {:.1}/s  acked {}/s  dead {:.1}/s",
            "",
            x.moved,
            x.acked.map_or("?".to_string(), |a| format!("{a:.1}")),
            x.dead,
        )?;
    }
    if !r.consumers.is_empty() {
        let cw = r
            .consumers
            .iter()
            .map(|c| c.name.len())
            .max()
            .unwrap_or(0)
            .max("consumer".len());
        writeln!(out)?;
        writeln!(
            out,
            "{:cw$}  {:>8}  {:>7}  heartbeat",
            "consumer", "pending", "idle"
        )?;
        for c in &r.consumers {
            let hb = match (c.heartbeat, c.pending) {
                (true, _) if c.without_database => {
                    "alive, no usable PostgreSQL (a peer that has one takes its entries)"
                }
                (true, _) => "alive",
                (false, 0) => "none",
                // Pending entries on a consumer without heartbeat: a dead host. A live
                // reader takes them over within one block timeout; if this stays, none runs.
                (false, _) => "none (dead host: its entries wait for a takeover)",
            };
            writeln!(
                out,
                "{:cw$}  {:>8}  {:>7}  {hb}",
                c.name,
                c.pending,
                fmt_age(c.idle_ms as i64)
            )?;
        }
    }
    if !r.workers.is_empty() {
        let ww = r
            .workers
            .iter()
            .map(|w| w.name.len())
            .max()
            .unwrap_or(0)
            .max("worker".len());
        writeln!(out)?;
        writeln!(
            out,
            "{:ww$}  {:>18}  {:>15}  problems",
            "worker", "clock offset", "producers ahead"
        )?;
        for w in &r.workers {
            let Some(rec) = &w.record else {
                writeln!(
                    out,
                    "{:ww$}  {:>18}  {:>15}  (an older worker: no health record)",
                    w.name, "?", "?"
                )?;
                continue;
            };
            let offset = match (rec.clock_offset_ms, rec.clock_error_ms) {
                (Some(o), Some(e)) => crate::clock::describe(&crate::clock::Offset {
                    offset_ms: o,
                    error_ms: e,
                }),
                _ => "not measured".to_string(),
            };
            let problems: Vec<String> = rec
                .problems
                .iter()
                .map(|p| format!("[{}] {}: {}", p.severity, p.role, p.what))
                .collect();
            let ahead = match rec.producer_ahead {
                0 => "0".to_string(),
                n => format!("{n} (≤{:.0}s)", rec.producer_lead_max_ms as f64 / 1000.0),
            };
            writeln!(
                out,
                "{:ww$}  {offset:>18}  {ahead:>15}  {}",
                w.name,
                if problems.is_empty() {
                    "none".to_string()
                } else {
                    problems.join("; ")
                }
            )?;
        }
    }
    Ok(())
}

fn read(config: &Config, args: &StatsArgs) -> anyhow::Result<(crate::store::Con, StatsReport)> {
    let mut con = super::connect(config)?;
    let now = redis_now_ms(&mut con, config).context("cannot read Redis's clock")?;
    let report = gather_all(&mut con, config, now, args.dead_window)
        .context("cannot read the queue figures")?;
    Ok((con, report))
}

/// `worker stats` and `worker stats --json`.
pub(super) fn run(
    config: &Config,
    args: &StatsArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let (mut con, mut report) = read(config, args)?;
    let by_event = crate::figures::by_event::gather(
        &mut con,
        &config.shard_keys(),
        report.now_ms,
        report.pool.size,
    )
    .context("cannot read the pool's events")?;
    if args.json {
        report.by_event = Some(by_event);
        super::write_json(out, &report)?;
    } else {
        render(&report, None, out)?;
        render_by_event(&by_event, report.now_ms, out)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `worker stats --watch`: clear the screen, redraw, once a second until Ctrl-C. A Redis
/// error is shown in place of the figures and the next second tries again, as `top`
/// would, instead of ending the watch.
pub(super) fn watch(
    config: &Config,
    args: &StatsArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let (stop_tx, stop) = crossbeam_channel::bounded::<()>(1);
    // Ctrl-C (or SIGTERM) only wakes the loop; a full channel means it already knows.
    crate::signals::on_stop(move || {
        let _ = stop_tx.try_send(());
    })
    .context("cannot install the Ctrl-C handler")?;
    let (con, first) = read(config, args)?;
    let mut con = Some(con);
    let mut last: Option<StatsReport> = None;
    let mut frame = Vec::new();
    let mut now_report = Ok(first);
    loop {
        frame.clear();
        writeln!(
            frame,
            "worker stats  {}  {}  (every 1s, Ctrl-C to quit)\n",
            config.derived.redis_shown,
            super::fmt_time(crate::now_ms())
        )?;
        match &now_report {
            Ok(r) => {
                let rates = last.as_ref().and_then(|p| rates(p, r));
                render(r, rates.as_ref(), &mut frame)?;
                last = Some(r.clone());
            }
            Err(e) => writeln!(frame, "redis: {e} (retrying every second)")?,
        }
        // Home, clear, then the whole frame in one write, so it does not flicker.
        out.write_all(b"\x1b[H\x1b[2J")?;
        out.write_all(&frame)?;
        out.flush()?;
        match stop.recv_timeout(Duration::from_secs(1)) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            _ => break,
        }
        now_report = match con.as_mut() {
            Some(c) => redis_now_ms(c, config)
                .and_then(|now| gather_all(c, config, now, args.dead_window))
                .map_err(anyhow::Error::from),
            None => super::connect(config).and_then(|mut c| {
                let now = redis_now_ms(&mut c, config)?;
                let r = gather_all(&mut c, config, now, args.dead_window)?;
                con = Some(c);
                Ok(r)
            }),
        };
        if now_report.is_err() {
            // Reconnect next time: the connection may be what broke.
            con = None;
        }
    }
    writeln!(out)?;
    Ok(ExitCode::SUCCESS)
}

/// The pool by event: a blank line, a head and one line per event.
fn render_by_event(
    b: &crate::figures::by_event::ByEvent,
    now_ms: i64,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    if b.events.is_empty() {
        return Ok(());
    }
    let w = b
        .events
        .iter()
        .map(|e| e.event.chars().count())
        .max()
        .unwrap_or(0)
        .max("event".len());
    writeln!(out)?;
    if b.complete {
        writeln!(
            out,
            "{:w$}  {:>9}  {:>7}  next due",
            "event", "scheduled", "due"
        )?;
    } else {
        writeln!(
            out,
            "{:w$}  {:>9}  {:>7}  next due   (of the {} due soonest; the pool holds more)",
            "event", "scheduled", "due", b.sampled
        )?;
    }
    for e in &b.events {
        let when = e.next_due_ms - now_ms;
        let next = if when <= 0 {
            format!("{} ago", crate::human_ms(-when))
        } else {
            format!("in {}", crate::human_ms(when))
        };
        writeln!(
            out,
            "{:w$}  {:>9}  {:>7}  {} ({next})",
            e.event,
            e.scheduled,
            e.due,
            crate::text::fmt_time(e.next_due_ms)
        )?;
    }
    Ok(())
}
