//! Each worker's health, published in Redis for the operator's tools.
//!
//! The reader refreshes the consumer's heartbeat key every `--block`
//! (`SET <prefix>:consumer:<name>:alive <record> PX <ttl>`, `store::heartbeat`); its value
//! is this process's [`Record`], a small JSON object: when it was written, the host,
//! the version, the measured offset of the host's clock to Redis, the producers seen
//! ahead of it, and its current problems from [`Stats::problems`] (whatever any role
//! reports, PostgreSQL's included). Peers only ask whether the key exists (their takeover
//! of a dead consumer's work, `lua/take_over.lua`, `lua/requeue_processing.lua`); `worker
//! stats` and `stats --check`, often on another host, read the record, so every worker's
//! view shows in one place.
//!
//! Bounded: at most [`MAX_PROBLEMS`] problems of at most [`MAX_TEXT`] characters each,
//! so the key stays well under 4 KiB however a role words its problem.

use crate::stats::{Reported, Stats};
use serde::{Deserialize, Serialize};

/// Most problems a record carries (the worst first).
pub const MAX_PROBLEMS: usize = 8;
/// Longest text of a problem in a record, in characters; longer ones end in `…`.
pub const MAX_TEXT: usize = 300;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
