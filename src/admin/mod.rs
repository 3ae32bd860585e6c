//! The operator's tools: `worker stats` (the queue's figures, `--watch`, `--check` for
//! monitoring) and `worker dead list|show|requeue|purge` (the dead letters).
//!
//! Owns no role of the daemon and starts no thread: each command opens one Redis
//! connection, reads (or makes one atomic change per batch), prints and returns its exit
//! code. The only loop is `stats --watch`, which redraws once a second until Ctrl-C.
//! The figures and the dead letters are gathered by plain functions ([`stats::gather`],
//! [`dead::scan`]) with the time passed in, so the tests check numbers, not text.
//!
//! - `stats.rs` — what the queue looks like right now, the table, `--watch`.
//! - `by_event.rs` — the pool's soonest members split by event, with each one's next due.
//! - `check.rs` — thresholds and the one-line verdict of `--check`.
//! - `dead.rs` — the dead-letter stream: filters, list, show, requeue, purge; `dead/list.rs`
//!   the same on list mode's dead lists.
//! - `trace.rs` — `worker trace`: a job key's story (gathered in `crate::trace`) in words.
//! - `handlers_check.rs` — `worker handlers check`: handler files prepared without a daemon.

pub mod by_event;
pub mod check;
pub mod dead;
pub mod handlers_check;
pub mod stats;
pub mod trace;

pub use check::{Status, Thresholds, Verdict};
pub use dead::{DeadArgs, DeadLetter, Filter};
pub use stats::{gather, StatsArgs, StatsReport};

use crate::config::parse_duration;
use crate::config::Config;
use crate::store::value_to_string;
use redis::Value;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

/// `worker stats`: the table, `--json`, `--watch` or `--check`.
pub fn stats(config: &Config, args: &StatsArgs) -> anyhow::Result<ExitCode> {
    let out = &mut io::stdout().lock();
    quiet_on_broken_pipe(if args.check {
        check::run(config, args, out)
    } else if args.watch {
        stats::watch(config, args, out)
    } else {
        stats::run(config, args, out)
    })
}

/// `worker trace KEY` / `--order ORDER`.
pub fn trace(config: &Config, args: &trace::TraceArgs) -> anyhow::Result<ExitCode> {
    let out = &mut io::stdout().lock();
    quiet_on_broken_pipe(trace::run(config, args, out))
}

/// `worker dead ...`.
pub fn dead(config: &Config, args: &DeadArgs) -> anyhow::Result<ExitCode> {
    let out = &mut io::stdout().lock();
    quiet_on_broken_pipe(dead::run(config, args, out))
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

/// One connection, checked with a PING, its errors showing the URL without password.
fn connect(config: &Config) -> anyhow::Result<crate::store::Con> {
    Ok(crate::daemon::redis_connection(config)?)
}

/// The millisecond part of a stream id: when the entry was added.
pub fn id_ms(id: &str) -> Option<i64> {
    id.split('-').next()?.parse().ok()
}

/// A stream id as XRANGE takes it: `<ms>` or `<ms>-<seq>`, each part digits that fit in
/// 64 bits (Redis refuses a larger one).
pub fn is_stream_id(s: &str) -> bool {
    let mut parts = s.split('-');
    let digits = |p: Option<&str>| {
        p.is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u64>().is_ok())
    };
    digits(parts.next()) && parts.next().is_none_or(|p| digits(Some(p))) && parts.next().is_none()
}

/// An age for people: `42s`, `3m05s`, `2h10m`, `3d04h`.
pub fn fmt_age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600)
    }
}

/// Unix milliseconds as an RFC 3339 time (UTC, whole seconds).
pub fn fmt_time(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The field/value pairs of an XINFO reply: a flat array in RESP2, a map in RESP3.
fn pairs(v: &Value) -> Vec<(String, &Value)> {
    match v {
        Value::Array(kv) => kv
            .chunks_exact(2)
            .map(|c| (value_to_string(&c[0]), &c[1]))
            .collect(),
        Value::Map(kv) => kv.iter().map(|(k, v)| (value_to_string(k), v)).collect(),
        _ => Vec::new(),
    }
}

fn field<'a>(pairs: &'a [(String, &'a Value)], name: &str) -> Option<&'a Value> {
    pairs.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
}

/// A non-negative integer reply; `None` for nil (XINFO's "cannot tell") or anything else.
fn uint(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn write_json(out: &mut dyn Write, v: &impl serde::Serialize) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v)?;
    writeln!(out)?;
    Ok(())
}

/// An error and its causes on one line, each said once, never a backtrace: how every
/// command of the binary reports a failure.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !line.contains(&c) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&c);
        }
    }
    line.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_a_person_would_write_them() {
        assert_eq!(fmt_age(-5), "0s");
        assert_eq!(fmt_age(999), "0s");
        assert_eq!(fmt_age(59_999), "59s");
        assert_eq!(fmt_age(185_000), "3m05s");
        assert_eq!(fmt_age(2 * 3_600_000 + 600_000), "2h10m");
        assert_eq!(fmt_age(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
    }

    #[test]
    fn stream_ids() {
        assert_eq!(id_ms("1768764300123-4"), Some(1_768_764_300_123));
        assert!(is_stream_id("1768764300123-4"));
        assert!(is_stream_id("1768764300123"));
        assert!(is_stream_id("18446744073709551615-18446744073709551615"));
        for bad in [
            "",
            "-",
            "1-",
            "-1",
            "a-1",
            "1-2-3",
            "1 2",
            "+1",
            "18446744073709551616",
            "99999999999999999999999-0",
            "1-18446744073709551616",
        ] {
            assert!(!is_stream_id(bad), "{bad:?}");
        }
    }
}
