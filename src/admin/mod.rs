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
//! - `check.rs` — thresholds and the one-line verdict of `--check`.
//! - `dead.rs` — the dead-letter stream: filters, list, show, requeue, purge; `dead/list.rs`
//!   the same on list mode's dead lists.

pub mod check;
pub mod dead;
pub mod stats;

pub use check::{Status, Thresholds, Verdict};
pub use dead::{DeadArgs, DeadLetter, Filter};
pub use stats::{gather, StatsArgs, StatsReport};

use crate::config::parse_duration;
use crate::config::Config;
use crate::store::value_to_string;
pub use crate::text::{fmt_age, fmt_time, one_line};
use redis::Value;
use std::io::{self, Write};
use std::process::ExitCode;

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
    Ok(crate::connect::redis_connection(config)?)
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

#[cfg(test)]
mod tests {
    use super::*;

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
