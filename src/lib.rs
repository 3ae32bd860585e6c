//! delay-worker: delayed business events from Redis, applied once in PostgreSQL.
//!
//! ```text
//!  producers ──ZADD/HSET──▶ delay pool (ZSET + HASH)          store::push / cancel
//!                                │ mover thread: one Lua call per batch    mover.rs
//!                                ▼
//!                       events STREAM (fields msg, key) or list queues
//!                                │ reader thread: screened reads, takeover source/
//!                                ▼
//!       bounded crossbeam channel (back-pressure) of chunks: a read's    delivery.rs
//!       entries, up to a set each
//!                                │
//!             N worker threads: one PostgreSQL transaction per job or set  workers.rs
//!               (inbox rows + handler)                                     handlers/
//!                                │
//!          settle ──▶ retry into the pool | dead letter, then ack (one Lua call per batch)
//! ```
//!
//! Every arrow that changes Redis is a function of `store` (one script or one command);
//! nothing else writes to Redis, and every script writes a message's next place before
//! it removes it from the last (ack last).
//!
//! Layout:
//! - `config.rs` — the validated [`Config`]; the binary (`bin/worker/`) parses the flags
//!   into it (`cli.rs`) and carries `worker bench` (`bench/`), which is not library API.
//! - `keys.rs` — every Redis key name; `store/` + `lua/` — every Redis state change, and
//!   `StoreError`, the typed Redis failure (connection, wrong key type, refused).
//! - `producer.rs` — push and cancel; `message.rs` — the envelope and its validation.
//! - `mover.rs`, `source/` (`stream.rs`, `list.rs`: the reader thread's two sources and
//!   what they share), `workers/` — the three roles; `daemon.rs` runs them.
//! - `handlers/` — what a job does in PostgreSQL (`Handlers`: the registry SIGHUP replaces);
//!   `db.rs` — pool, migrations, and whose
//!   fault a failure is (`Fault`); `workers/session.rs` — a worker's prepared session, jobs
//!   alone, in sets (split under contention) or in batches; `manners.rs` — `--max-rate`
//!   and the set sizes that shrink under the shop's locks; `dbwatch.rs` — whether
//!   PostgreSQL takes writes and the shop is busy (4 times a second), every handler still
//!   prepares (every 10 s); `blocker.rs` — who held the lock a job timed out on (looked
//!   up after the timeout, rate-limited).
//! - `tls.rs` — TLS to both servers (rustls); `conninfo.rs` — connection strings read as
//!   their clients read them (for the TLS settings and for redaction).
//! - `stats.rs` — the one set of counters (log line, exit report, `/metrics`) and the
//!   problems the roles report; `health.rs` — the verdicts on them (live: the watchdog's;
//!   healthy: `/healthz`'s, with its probe of both servers) and the record each worker
//!   publishes in its heartbeat key, for `worker stats`.
//! - `clock.rs` — the one clock: due times are Redis's (`TIME` in the move script); the
//!   host's measured offset corrects its own clock everywhere else. `watch.rs` — the role
//!   that measures it and looks at Redis's memory settings (an evicting Redis is refused).
//! - `signals.rs` — the signals: stop, reload (SIGHUP), state report (SIGUSR1).
//! - `prune.rs` — the inbox pruner: old `worker_inbox` rows deleted, one process at a time.
//! - `stall.rs` — whether this process stood still lately (SIGSTOP, a frozen VM).
//! - `shutdown.rs`, `backoff.rs` — the small shared pieces.
//!
//! The operator's side, each file one job and every arrow pointing down this list:
//! - `admin/` (`worker stats`, `--watch`, `--check`; `worker dead`; `worker trace`;
//!   `worker handlers check`), `status/` (the status page: `/`, the dead letters, requeue
//!   and purge with `--admin-token-file`, the trace search; `view.rs` the HTML) and
//!   `metrics.rs` (`/metrics`, `/healthz`, the routing of the address) — the three
//!   surfaces, each formatting on top of the same models;
//! - `figures.rs` — the queue's figures (what `worker stats` shows), the one source of them
//!   for all three; `trace.rs` — a job key's story (where each of its jobs is and what
//!   became of it), for `worker trace` and the page's search;
//! - `dead/` — the dead letters, one model for both kinds (`stream.rs`: the dead-letter
//!   stream, each shard's; `list.rs`: the dead lists): read, page, find, requeue, purge;
//!   `screen.rs` holds a requeue against the handlers (what would only die again);
//! - `http.rs` — HTTP/1.1 for the address: accept, request deadlines, answers, the
//!   connection slots shared among stalled clients; nothing about queues;
//! - `connect.rs` — opening Redis, checked, its shard layout agreed (the daemon, every
//!   command, the benchmark); `text.rs` — ages, times and clipped lines, the same in the
//!   terminal and on the page; `notify.rs` — systemd readiness and watchdog.
//!
//! The configuration carries what its users need computed (`Config::derived`: the
//! redacted URLs, each shard's key set), so none of them computes it again.

pub mod admin;
pub mod backoff;
pub mod blocker;
pub mod clock;
pub mod config;
pub mod connect;
pub mod conninfo;
pub mod daemon;
pub mod db;
pub mod dbwatch;
pub mod dead;
pub mod delivery;
pub mod figures;
pub mod handlers;
pub mod health;
pub mod http;
pub mod keys;
pub mod manners;
pub mod message;
pub mod metrics;
pub mod mover;
pub mod notify;
pub mod producer;
pub mod prune;
pub mod shutdown;
pub mod signals;
pub mod source;
pub mod stall;
pub mod stats;
pub mod status;
pub mod store;
pub mod text;
pub mod tls;
pub mod trace;
pub mod watch;
pub mod workers;

pub use config::Config;
pub use shutdown::Shutdown;

/// A duration in milliseconds in the unit a person reads it in: `850 ms`, `1.9 s`, `24 s`,
/// `3 min 5 s`, `2 h 10 min`, `7 d`.
pub fn human_ms(ms: i64) -> String {
    let sign = if ms < 0 { "-" } else { "" };
    let ms = ms.unsigned_abs();
    let s = ms / 1000;
    let text = match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=9_999 => format!("{:.1} s", ms as f64 / 1000.0),
        10_000..=59_999 => format!("{s} s"),
        60_000..=3_599_999 => match s % 60 {
            0 => format!("{} min", s / 60),
            r => format!("{} min {r} s", s / 60),
        },
        3_600_000..=86_399_999 => match (s / 60) % 60 {
            0 => format!("{} h", s / 3600),
            m => format!("{} h {m} min", s / 3600),
        },
        _ => match (s / 3600) % 24 {
            0 => format!("{} d", s / 86_400),
            h => format!("{} d {h} h", s / 86_400),
        },
    };
    format!("{sign}{text}")
}

/// This host's wall-clock time in unix milliseconds. Due times are wall-clock by contract,
/// on Redis's clock: compare with them through `Stats::clock` (`clock.rs`), which corrects
/// this by the host's measured offset; this raw clock is for the host's own intervals
/// (heartbeats of the roles, problem windows).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_read_in_human_units() {
        let cases = [
            (850, "850 ms"),
            (1_855, "1.9 s"),
            (24_000, "24 s"),
            (185_000, "3 min 5 s"),
            (600_000, "10 min"),
            (7_800_000, "2 h 10 min"),
            (604_800_000, "7 d"),
            (-1_500, "-1.5 s"),
        ];
        for (ms, text) in cases {
            assert_eq!(super::human_ms(ms), text);
        }
    }
}
