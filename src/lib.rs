//! delay-worker: delayed business events from Redis, applied once in PostgreSQL.
//!
//! ```text
//!  producers ──ZADD/HSET──▶ delay pool (ZSET + HASH)          store::push / cancel
//!                                │ mover thread: one Lua call per batch    mover.rs
//!                                ▼
//!                       events STREAM (fields msg, key)
//!                                │ reader thread: XREADGROUP, reclaim      reader.rs
//!                                ▼
//!                  bounded crossbeam channel (back-pressure)
//!                                │
//!             N worker threads: one PostgreSQL transaction per job         workers.rs
//!               (inbox row + handler)                                      handlers/
//!                                │
//!          settle ──▶ ack | retry into the pool | dead letter (one Lua call per batch)
//! ```
//!
//! Layout:
//! - `config.rs` — the validated [`Config`]; `cli.rs` — flags and subcommands.
//! - `keys.rs` — every Redis key name; `store.rs` + `lua/` — every Redis state change.
//! - `producer.rs` — push and cancel; `message.rs` — the envelope and its validation.
//! - `mover.rs`, `reader.rs`, `workers.rs` — the three roles; `daemon.rs` runs them.
//! - `handlers/` — what a job does in PostgreSQL; `db.rs` — pool, migrations, errors.
//! - `shutdown.rs`, `backoff.rs`, `stats.rs` — the small shared pieces.
//! - `admin/` — the operator's tools: `worker stats` (`--watch`, `--check`), `worker dead`.
//! - `notify.rs` — systemd readiness and watchdog; `metrics.rs` — `/metrics` and `/healthz`.
//! - `bench/` — `worker bench`: lateness and throughput next to the machine's ceilings.

pub mod admin;
pub mod backoff;
pub mod bench;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod db;
pub mod delivery;
pub mod handlers;
pub mod keys;
pub mod list;
pub mod message;
pub mod metrics;
pub mod mover;
pub mod notify;
pub mod producer;
pub mod reader;
pub mod shutdown;
pub mod stats;
pub mod store;
pub mod workers;

pub use config::Config;
pub use shutdown::Shutdown;

/// Wall-clock time in unix milliseconds: due times are wall-clock by contract.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
