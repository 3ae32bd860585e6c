//! Counters shared by all threads, for the periodic log line and the exit report.
//!
//! Every role only adds (Relaxed: the numbers are for people, not for synchronisation);
//! the daemon reads them once a `stats_interval` and at exit.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default, Debug)]
pub struct Stats {
    /// Written by movers: members moved from the pool to the stream.
    pub moved: AtomicU64,
    /// Written by movers: members removed because their data never arrived.
    pub orphans: AtomicU64,
    /// Written by the reader: entries handed to the pool (new, own pending, reclaimed).
    pub delivered: AtomicU64,
    /// Written by the reader: entries taken over from other consumers.
    pub reclaimed: AtomicU64,
    /// Written by workers: handler committed with an effect.
    pub done: AtomicU64,
    /// Written by workers: handler committed, nothing to change (paid order, ...).
    pub noop: AtomicU64,
    /// Written by workers: the inbox already held the job (a redelivery).
    pub duplicate: AtomicU64,
    /// Written by workers: sent back to the delay pool after a transient failure.
    pub retried: AtomicU64,
    /// Written by workers and the reader: sent to the dead letters.
    pub dead: AtomicU64,
    /// Written by workers: entries acknowledged in Redis.
    pub acked: AtomicU64,
    /// Written by every Redis loop (mover, reader, workers' settle) when an outage starts
    /// (the first failure after a success, see [`Stats::redis_failure`]); read by metrics.
    pub redis_reconnects: AtomicU64,
    /// Written by the reader (unix ms) whenever it hands messages to the pool or waits for
    /// room, which every successful step ends in; read by the watchdog (`notify::live`):
    /// a stale stamp means a stuck reader or a Redis outage.
    pub reader_beat_ms: AtomicU64,
    /// Written by the mover after every successful tick (unix ms); read like the above.
    pub mover_beat_ms: AtomicU64,
    /// Workers now holding a job while they cannot get a PostgreSQL session: each raises
    /// it when its outage starts and lowers it when it ends. Read by the watchdog and
    /// metrics; left as is at shutdown.
    pub db_waiting: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub moved: u64,
    pub orphans: u64,
    pub delivered: u64,
    pub reclaimed: u64,
    pub done: u64,
    pub noop: u64,
    pub duplicate: u64,
    pub retried: u64,
    pub dead: u64,
    pub acked: u64,
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Stamps a role's heartbeat with the current time.
    pub fn beat(stamp: &AtomicU64) {
        stamp.store(crate::now_ms().max(0) as u64, Relaxed);
    }

    /// Counts a Redis outage if `backoff` is not in one yet; call right before
    /// `Backoff::fail` on a Redis error.
    pub fn redis_failure(&self, backoff: &crate::backoff::Backoff) {
        if !backoff.in_outage() {
            Self::add(&self.redis_reconnects, 1);
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            moved: self.moved.load(Relaxed),
            orphans: self.orphans.load(Relaxed),
            delivered: self.delivered.load(Relaxed),
            reclaimed: self.reclaimed.load(Relaxed),
            done: self.done.load(Relaxed),
            noop: self.noop.load(Relaxed),
            duplicate: self.duplicate.load(Relaxed),
            retried: self.retried.load(Relaxed),
            dead: self.dead.load(Relaxed),
            acked: self.acked.load(Relaxed),
        }
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "moved={} delivered={} reclaimed={} done={} noop={} duplicate={} retried={} dead={} acked={} orphans={}",
            self.moved,
            self.delivered,
            self.reclaimed,
            self.done,
            self.noop,
            self.duplicate,
            self.retried,
            self.dead,
            self.acked,
            self.orphans
        )
    }
}
