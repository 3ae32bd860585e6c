//! The operator's tools: `worker stats` (the queue's figures, `--watch`, `--check` for
//! monitoring) and `worker dead list|show|requeue|purge` (the dead letters).
//!
//! Owns no role of the daemon and starts no thread: each command opens one Redis
//! connection, reads (or makes one atomic change per batch), prints and returns its exit
//! code. The only loop is `stats --watch`, which redraws once a second until Ctrl-C.
//! The figures and the dead letters are read by the library (`figures.rs`, `dead/`: plain
//! functions with the time passed in, so the tests check numbers, not text); these files
//! hold the flags and print.
//!
//! - `stats.rs` — what the queue looks like right now, the table, `--watch`.
//! - `check.rs` — thresholds and the one-line verdict of `--check`.
//! - `dead.rs` — `worker dead`: list, show, requeue, purge, on the dead-letter stream (each
//!   shard's) or on list mode's dead lists.
//! - `trace.rs` — `worker trace`: a job key's story (gathered in `crate::trace`) in words.
//! - `handlers_check.rs` — `worker handlers check`: handler files prepared without a daemon.

pub mod check;
pub mod dead;
pub mod handlers_check;
pub mod stats;
pub mod trace;

pub use crate::dead::{DeadLetter, Filter};
pub use crate::figures::{gather, StatsReport};
pub use check::{Status, Thresholds, Verdict};
pub use dead::DeadArgs;
pub use stats::StatsArgs;

use crate::config::parse_duration;
use crate::config::Config;
pub use crate::text::{fmt_age, fmt_time, one_line};
use std::io::{self, Write};
use std::process::ExitCode;

/// `worker stats`: the table, `--json`, `--watch` or `--check`.
pub fn stats(config: &Config, args: &StatsArgs) -> anyhow::Result<ExitCode> {
    let config = &config.settled();
    let out = &mut io::stdout().lock();
    let r = if args.check {
        check::run(config, args, out)
    } else if args.watch {
        stats::watch(config, args, out)
    } else {
        stats::run(config, args, out)
    };
    quiet_on_broken_pipe(name_wrong_keys(config, r))
}

/// `worker trace KEY` / `--order ORDER`.
pub fn trace(config: &Config, args: &trace::TraceArgs) -> anyhow::Result<ExitCode> {
    let out = &mut io::stdout().lock();
    quiet_on_broken_pipe(name_wrong_keys(config, trace::run(config, args, out)))
}

/// `worker dead ...`.
pub fn dead(config: &Config, args: &DeadArgs) -> anyhow::Result<ExitCode> {
    let config = &config.settled();
    let out = &mut io::stdout().lock();
    quiet_on_broken_pipe(name_wrong_keys(config, dead::run(config, args, out)))
}

/// `worker dead list | head` closes our stdout early: that is the reader being done,
/// not an error worth a line.
fn quiet_on_broken_pipe(r: anyhow::Result<ExitCode>) -> anyhow::Result<ExitCode> {
    match r {
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe) =>
        {
            Ok(ExitCode::SUCCESS)
        }
        r => r,
    }
}

/// Redis's `WRONGTYPE` does not say which key: a command that met it says, from a look
/// at the worker's keys' types (`figures::wrong_types`), which of them holds the wrong
/// type, e.g. `cannot read the queue figures: key "mq:events" holds a string, not a
/// stream; rename or remove it`. Any other error, or none found, as it was.
fn name_wrong_keys(config: &Config, r: anyhow::Result<ExitCode>) -> anyhow::Result<ExitCode> {
    let Err(e) = r else { return r };
    let wrongtype = e.chain().any(|c| {
        c.downcast_ref::<redis::RedisError>()
            .is_some_and(|r| r.code() == Some("WRONGTYPE"))
    });
    if !wrongtype {
        return Err(e);
    }
    let bad = connect(config)
        .ok()
        .and_then(|mut con| crate::figures::wrong_types(&mut con, config).ok())
        .unwrap_or_default();
    if bad.is_empty() {
        return Err(e);
    }
    // Without a context of its own the error is Redis's refusal, which says nothing more.
    let what = match e.to_string() {
        s if s.contains("WRONGTYPE") => "Redis refused a read".to_string(),
        s => s,
    };
    Err(anyhow::anyhow!(
        "{what}: {}; rename or remove it",
        bad.join(", ")
    ))
}

/// One connection, checked with a PING, its errors showing the URL without password.
fn connect(config: &Config) -> anyhow::Result<crate::store::Con> {
    Ok(crate::connect::redis_connection(config)?)
}

fn write_json(out: &mut dyn Write, v: &impl serde::Serialize) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v)?;
    writeln!(out)?;
    Ok(())
}
