//! The one clock: the Redis server's.
//!
//! Whether a job is due is decided inside Redis, on its own clock (`TIME` in the move
//! script), so no worker host's clock ever decides it. Everywhere else a worker compares
//! a time with a due time (a retry's due time, how late a job took effect, the time a dead
//! letter died) it uses its own clock corrected by its measured offset to Redis:
//! [`Clock::now_ms`]. The offset is measured once by the daemon before its roles start,
//! then by the watch role (`watch.rs`) every [`MEASURE_EVERY`], with a few `TIME` round
//! trips; the one with the shortest round trip wins, and half its round trip bounds the
//! error.
//!
//! The clock also sees producers' clocks through the `ts` they write: a message whose `ts`
//! is later than its arrival (on the shared clock) by more than [`SKEW_WARN`] comes from a
//! producer whose clock runs ahead. Such messages are counted ([`Clock::producer_ahead`])
//! and logged at most once per [`MEASURE_EVERY`] by the watch role.
//!
//! Every field is an atomic: written by the watch role (the offset) and by the workers
//! (producer skew), read by every role, `/metrics`, the heartbeat record and the state
//! report. Nothing to do at shutdown.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// How often the offset to Redis is measured.
pub const MEASURE_EVERY: Duration = Duration::from_secs(10);

/// An offset (this host's, or a producer's lead) beyond this is logged as a warning: a
/// host whose clock is not synchronised (NTP, chrony).
pub const SKEW_WARN: Duration = Duration::from_secs(1);

/// One `TIME` round trip: this host's clock before and after, and the server's time in
/// between, all in unix microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub before_us: i64,
    pub server_us: i64,
    pub after_us: i64,
}

/// The offset of this host's clock to Redis's: `redis = host + offset_ms`, within
/// `error_ms` either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offset {
    pub offset_ms: i64,
    pub error_ms: i64,
}

impl Sample {
    /// The offset this round trip shows: the server answered somewhere between `before`
    /// and `after`, so at their midpoint, give or take half the round trip.
    pub fn offset(&self) -> Offset {
        let rtt = (self.after_us - self.before_us).max(0);
        let mid = self.before_us + rtt / 2;
        Offset {
            offset_ms: (self.server_us - mid).div_euclid(1000),
            // Rounded up: the error is never understated.
            error_ms: (rtt / 2 + 999) / 1000,
        }
    }
}

/// The offset of the sample with the shortest round trip: the least disturbed by a busy
/// network or server. `None` for no samples.
pub fn best(samples: &[Sample]) -> Option<Offset> {
    samples
        .iter()
        .min_by_key(|s| s.after_us - s.before_us)
        .map(Sample::offset)
}

/// This host's clock corrected to Redis's, and what the roles saw of producers' clocks.
#[derive(Debug)]
pub struct Clock {
    /// Redis minus this host, ms (0 until measured).
    offset_ms: AtomicI64,
    /// The measurement's error bound, ms; -1 until measured.
    error_ms: AtomicI64,
    /// Messages whose `ts` was later than their arrival by more than [`SKEW_WARN`].
    producer_ahead: AtomicU64,
    /// The largest such lead (ms) since the watch role last logged it; taken by
    /// [`Clock::take_producer_lead`].
    lead_ms: AtomicI64,
    /// The largest lead seen since start (ms), for `/metrics`.
    lead_max_ms: AtomicI64,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            offset_ms: AtomicI64::new(0),
            error_ms: AtomicI64::new(-1),
            producer_ahead: AtomicU64::new(0),
            lead_ms: AtomicI64::new(0),
            lead_max_ms: AtomicI64::new(0),
        }
    }

    /// Now on the shared clock (unix ms): this host's clock plus its measured offset.
    pub fn now_ms(&self) -> i64 {
        self.at(crate::now_ms())
    }

    /// A time of this host's clock (unix ms) on the shared clock.
    pub fn at(&self, host_ms: i64) -> i64 {
        host_ms.saturating_add(self.offset_ms.load(Relaxed))
    }

    /// Records a measurement.
    pub fn set(&self, o: Offset) {
        self.offset_ms.store(o.offset_ms, Relaxed);
        self.error_ms.store(o.error_ms.max(0), Relaxed);
    }

    /// The last measurement; `None` before the first.
    pub fn offset(&self) -> Option<Offset> {
        let error_ms = self.error_ms.load(Relaxed);
        (error_ms >= 0).then(|| Offset {
            offset_ms: self.offset_ms.load(Relaxed),
            error_ms,
        })
    }

    /// Looks at a message's `ts` (unix seconds, 0 when it has none) against when it
    /// arrived on the shared clock (unix ms): a `ts` later than that by more than
    /// [`SKEW_WARN`] means its producer's clock runs ahead. Returns the lead (ms) then.
    pub fn producer_ts(&self, ts_s: i64, arrived_ms: i64) -> Option<i64> {
        if ts_s <= 0 {
            return None;
        }
        let lead = ts_s.saturating_mul(1000).saturating_sub(arrived_ms);
        if lead <= SKEW_WARN.as_millis() as i64 {
            return None;
        }
        self.producer_ahead.fetch_add(1, Relaxed);
        self.lead_ms.fetch_max(lead, Relaxed);
        self.lead_max_ms.fetch_max(lead, Relaxed);
        Some(lead)
    }

    /// Messages seen from producers whose clock runs ahead, since start.
    pub fn producer_ahead(&self) -> u64 {
        self.producer_ahead.load(Relaxed)
    }

    /// The largest producer lead seen since start (ms; 0 for none).
    pub fn producer_lead_max_ms(&self) -> i64 {
        self.lead_max_ms.load(Relaxed)
    }

    /// The largest producer lead seen since the last call (ms), if any: the watch role
    /// logs it once per interval.
    pub fn take_producer_lead(&self) -> Option<i64> {
        let lead = self.lead_ms.swap(0, Relaxed);
        (lead > 0).then_some(lead)
    }
}

/// An offset as people read it: `+120.003s (±1ms)`.
pub fn describe(o: &Offset) -> String {
    format!("{:+.3}s (±{}ms)", o.offset_ms as f64 / 1000.0, o.error_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(before: i64, server: i64, after: i64) -> Sample {
        Sample {
            before_us: before,
            server_us: server,
            after_us: after,
        }
    }

    #[test]
    fn the_offset_is_taken_at_the_midpoint_of_the_round_trip() {
        // A host 120 s ahead of Redis: Redis says 120 s less than the host's midpoint.
        let host = 1_800_000_000_000_000i64;
        let o = s(host, host + 1_000 - 120_000_000, host + 2_000).offset();
        assert_eq!(o.offset_ms, -120_000);
        assert_eq!(o.error_ms, 1);
        // Behind: Redis is ahead of the host.
        let o = s(host, host + 120_000_500, host + 1_000).offset();
        assert_eq!(o.offset_ms, 120_000);
        // A slow round trip's error bound covers its whole half.
        let o = s(host, host + 300_000, host + 600_000).offset();
        assert_eq!((o.offset_ms, o.error_ms), (0, 300));
    }

    #[test]
    fn the_quickest_round_trip_wins() {
        let host = 1_800_000_000_000_000i64;
        let samples = [
            s(host, host + 40_000, host + 50_000), // slow, skewed by the delay
            s(host, host + 500 + 2_000_000, host + 1_000), // quick: +2 s
            s(host, host + 9_000, host + 20_000),
        ];
        assert_eq!(
            best(&samples),
            Some(Offset {
                offset_ms: 2_000,
                error_ms: 1
            })
        );
        assert_eq!(best(&[]), None);
    }

    #[test]
    fn the_corrected_clock_follows_the_offset() {
        let c = Clock::new();
        assert_eq!(c.offset(), None, "not measured yet");
        assert_eq!(c.at(1_000_000), 1_000_000);
        c.set(Offset {
            offset_ms: -120_000,
            error_ms: 2,
        });
        assert_eq!(c.at(1_000_000), 880_000);
        assert_eq!(c.offset().unwrap().error_ms, 2);
        assert_eq!(describe(&c.offset().unwrap()), "-120.000s (±2ms)");
    }

    #[test]
    fn a_producer_ahead_of_the_shared_clock_is_counted() {
        let c = Clock::new();
        let arrived = 1_800_000_000_500;
        assert_eq!(c.producer_ts(0, arrived), None, "no ts: nothing to say");
        assert_eq!(
            c.producer_ts(1_800_000_000, arrived),
            None,
            "written before"
        );
        assert_eq!(
            c.producer_ts(1_800_000_001, arrived),
            None,
            "within a second"
        );
        assert_eq!(c.producer_ts(1_800_000_120, arrived), Some(119_500));
        assert_eq!(c.producer_ts(1_800_000_030, arrived), Some(29_500));
        assert_eq!(c.producer_ahead(), 2);
        assert_eq!(c.take_producer_lead(), Some(119_500));
        assert_eq!(c.take_producer_lead(), None, "logged once per interval");
        assert_eq!(c.producer_lead_max_ms(), 119_500);
    }
}
