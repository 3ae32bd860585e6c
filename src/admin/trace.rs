//! `worker trace KEY` (or `--order SO123`): the jobs of one job key, where each is now and
//! what became of it, as lines for a person or `--json` for scripts. The story is
//! gathered by [`crate::trace::gather`]; here it is only worded. Exit 0 when a job was
//! found, [`NOT_FOUND`] when there is no trace of one (never pushed, cancelled, or done so
//! long ago that its inbox row was pruned).

use super::{fmt_age, fmt_time, write_json};
use crate::config::Config;
use crate::trace::{self, Job, Query, State, Trace};
use clap::Args;
use serde::Serialize;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// How long the inbox lookup may run (or wait for a lock).
const INBOX_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The exit code when no job of the key (or order) is found anywhere.
pub const NOT_FOUND: u8 = 4;

/// Where the jobs of a job key are and what became of them.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// The job key (e.g. order.timeout:SO123).
    #[arg(required_unless_present = "order", conflicts_with = "order")]
    pub key: Option<String>,
    /// Trace an order: the keys <event>:<ORDER> of the built-in events that act on an
    /// order (order.timeout, payment.paid; payload order_no or order_id).
    #[arg(long, value_name = "ORDER")]
    pub order: Option<String>,
    /// Only jobs of this event (with --order: only its key).
    #[arg(long)]
    pub event: Option<String>,
    /// Print the trace as one JSON object (for scripts).
    #[arg(long)]
    pub json: bool,
}

impl TraceArgs {
    pub fn query(&self) -> Query {
        match &self.key {
            Some(k) => Query::key(k, self.event.as_deref()),
            None => Query::order(
                self.order.as_deref().unwrap_or_default(),
                self.event.as_deref(),
            ),
        }
    }
}

/// Input that can never be answered (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadQuery(pub String);

/// `worker trace`.
pub fn run(config: &Config, args: &TraceArgs, out: &mut dyn Write) -> anyhow::Result<ExitCode> {
    let q = args.query();
    if let Some(p) = q.problem() {
        return Err(BadQuery(p.to_string()).into());
    }
    let mut con = super::connect(config)?;
    let now = crate::figures::redis_now_ms(&mut con, config)?;
    // Its own statement timeout, not the role's (which may be far shorter or none).
    let mut db = crate::db::connect_bounded(&config.database_url, INBOX_READ_TIMEOUT)
        .map_err(|e| anyhow::anyhow!("PostgreSQL (the inbox, worker_inbox): {e}"))?;
    let t = trace::gather(&mut con, Some(&mut db), config, &q, now)?;
    if args.json {
        write_json(out, &Json::of(&t))?;
    } else {
        write!(out, "{}", text(&t))?;
    }
    if let Some(e) = &t.inbox_error {
        anyhow::bail!(
            "the inbox (worker_inbox) could not be read, so done jobs are missing above: {e}"
        );
    }
    Ok(if t.gone() {
        ExitCode::from(NOT_FOUND)
    } else {
        ExitCode::SUCCESS
    })
}

/// The `--json` object: the trace, and whether anything was found.
#[derive(Serialize)]
struct Json<'a> {
    #[serde(flatten)]
    trace: &'a Trace,
    found: bool,
    /// When nothing was found: why, in words.
    gone: Option<String>,
}

impl Json<'_> {
    fn of(t: &Trace) -> Json<'_> {
        Json {
            trace: t,
            found: !t.gone(),
            gone: t.gone().then(|| t.gone_why()),
        }
    }
}

/// What was asked, in words: the key, or the order and its keys.
pub fn asked(q: &Query) -> String {
    match (&q.key, &q.order) {
        (Some(k), _) => k.clone(),
        (None, Some(o)) => format!("order {o} ({})", q.keys().join(", ")),
        _ => String::new(),
    }
}

/// The whole trace as text: a heading, then each job's heading and where it is.
pub fn text(t: &Trace) -> String {
    let mut s = String::new();
    let n = t.jobs.len();
    s.push_str(&format!(
        "{}: {} (Redis's clock {})\n",
        asked(&t.query),
        match n {
            0 => "no job".to_string(),
            1 => "1 job".to_string(),
            n => format!("{n} jobs, oldest first"),
        },
        fmt_time(t.now_ms)
    ));
    if t.gone() {
        s.push_str(&format!("  {}\n", t.gone_why()));
    }
    for j in &t.jobs {
        s.push_str(&format!("\n{}\n", heading(j, t.query.key.is_none())));
        s.push_str(&format!("  {}\n", describe(j, t.now_ms)));
        if let Some(due) = due_line(j, t.now_ms) {
            s.push_str(&format!("  {due}\n"));
        }
        for note in &j.notes {
            s.push_str(&format!("  note: {note}\n"));
        }
    }
    for note in &t.notes {
        s.push_str(&format!("\nnote: {note}\n"));
    }
    if let Some(e) = &t.inbox_error {
        s.push_str(&format!(
            "\nthe inbox (worker_inbox) could not be read: {e}\n"
        ));
    }
    s
}

/// A job's heading: `job <id> · <event>` (the key too for an order, the shard).
pub fn heading(j: &Job, with_key: bool) -> String {
    let mut h = format!("job {}", j.job_id.as_deref().unwrap_or("(no id yet)"));
    if let Some(e) = &j.event {
        h.push_str(&format!(" · {e}"));
    }
    if with_key {
        h.push_str(&format!(" · {}", j.key));
    }
    if let Some(s) = j.shard {
        h.push_str(&format!(" · shard {s}"));
    }
    h
}

/// `<time> (3m05s ago)` or `<time> (in 14m32s)`.
pub fn when(ms: i64, now_ms: i64) -> String {
    if ms > now_ms {
        format!("{} (in {})", fmt_time(ms), fmt_age(ms - now_ms))
    } else {
        format!("{} ({} ago)", fmt_time(ms), fmt_age(now_ms - ms))
    }
}

/// When the job was due, unless its state says it already.
pub fn due_line(j: &Job, now_ms: i64) -> Option<String> {
    match (&j.state, j.due_ms) {
        (State::Scheduled { .. }, _) | (_, None) => None,
        (_, Some(d)) => Some(format!("first due {}", when(d, now_ms))),
    }
}

/// Where the job is, or how it ended, in one line.
pub fn describe(j: &Job, now_ms: i64) -> String {
    let alive = |a: bool| {
        if a {
            "alive"
        } else {
            "no heartbeat: a peer takes it over"
        }
    };
    match &j.state {
        State::Scheduled { pool } => match j.due_ms {
            Some(d) if d <= now_ms => format!(
                "scheduled in {pool}, due {} (overdue {}: the mover moves it next)",
                fmt_time(d),
                fmt_age(now_ms - d)
            ),
            Some(d) => format!("scheduled in {pool}, due {}", when(d, now_ms)),
            None => format!("scheduled in {pool}"),
        },
        State::Retrying {
            pool,
            attempt,
            last_error,
            next_ms,
        } => format!(
            "waiting for a retry in {pool}: {} retries so far, next {}{}",
            attempt,
            when(*next_ms, now_ms),
            last_error
                .as_deref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        ),
        State::Moved {
            stream,
            entry,
            moved_ms,
        } => format!(
            "moved to {stream} as entry {entry} at {}, not read by a consumer yet",
            when(*moved_ms, now_ms)
        ),
        State::InFlight {
            stream,
            entry,
            moved_ms,
            consumer,
            alive: a,
            idle_ms,
            deliveries,
        } => format!(
            "in flight on {consumer} ({}): entry {entry} of {stream}, moved at {}, idle {}, delivered {deliveries} time{}",
            alive(*a),
            when(*moved_ms, now_ms),
            fmt_age(*idle_ms),
            if *deliveries == 1 { "" } else { "s" }
        ),
        State::Queued { queue, position } => format!(
            "on queue {queue}, waiting to be fetched ({position} ahead of it)"
        ),
        State::Processing {
            queue,
            consumer,
            alive: a,
        } => format!("fetched from {queue} by {consumer} ({}), not settled yet", alive(*a)),
        State::Done {
            processed_ms,
            late_ms,
            outcome,
            consumer,
        } => {
            let mut s = format!("done at {}", when(*processed_ms, now_ms));
            if let Some(l) = late_ms {
                s.push_str(&format!(", {} late", crate::human_ms(*l)));
            }
            if let Some(c) = consumer {
                s.push_str(&format!(", by {c}"));
            }
            s.push_str(match outcome.as_deref() {
                Some("noop") => ": a no-op (the handler had nothing to change)",
                Some(_) => "",
                None => " (a worker that did not record its outcome)",
            });
            s
        }
        State::Dead {
            dead,
            id,
            reason,
            attempts,
            died_ms,
            consumer,
        } => {
            let mut s = format!("dead letter {id} in {dead} since {}", when(*died_ms, now_ms));
            if let Some(a) = attempts {
                s.push_str(&format!(", after {a} attempt{}", if *a == 1 { "" } else { "s" }));
            }
            if let Some(c) = consumer {
                s.push_str(&format!(", by {c}"));
            }
            s.push_str(&format!(": {reason}"));
            s
        }
    }
}
