//! Capped exponential backoff with jitter for infrastructure errors (Redis or PostgreSQL
//! unreachable), shared by every loop.
//!
//! An outage is logged once when it starts (warn) and once when it ends (info), not per
//! attempt. Sleeps are woken by shutdown. `reset` on the first success.

use crate::shutdown::Shutdown;
use std::time::{Duration, Instant};

pub struct Backoff {
    /// Who is backing off, for the log lines ("mover", "reader", "worker-3").
    role: String,
    base: Duration,
    cap: Duration,
    attempt: u32,
    outage_since: Option<Instant>,
}

/// Ceiling of every infrastructure backoff (the consumer issue asks for at most 60 s).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Ceiling of the backoff while a key of the wrong type holds a loop back: the operator's
/// fix (a `DEL` or a `RENAME`) is taken up within this, where [`MAX_BACKOFF`] left every
/// job waiting up to half a minute more after it. A failed read of a wrong-typed key costs
/// Redis next to nothing.
pub const FIX_BACKOFF: Duration = Duration::from_secs(2);

impl Backoff {
    pub fn new(role: &str) -> Backoff {
        Backoff::with_cap(role, MAX_BACKOFF)
    }

    /// A backoff that never waits longer than `cap`.
    pub fn with_cap(role: &str, cap: Duration) -> Backoff {
        Backoff {
            role: role.to_string(),
            base: Duration::from_millis(100),
            cap,
            attempt: 0,
            outage_since: None,
        }
    }

    /// The delay before the next attempt: base * 2^attempt, capped, then "full jitter"
    /// between half and all of it so that many workers do not reconnect in lockstep.
    pub fn next_delay(&mut self) -> Duration {
        let exp = self.base.saturating_mul(1u32 << self.attempt.min(16));
        let d = exp.min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let half = d / 2;
        half + Duration::from_nanos(fastrand::u64(..=half.as_nanos() as u64))
    }

    /// Records a failure and sleeps (woken by shutdown). Returns `true` if shutdown is set.
    pub fn fail(&mut self, what: &str, err: &dyn std::fmt::Display, shutdown: &Shutdown) -> bool {
        self.fail_within(what, err, shutdown, self.cap)
    }

    /// [`Backoff::fail`], sleeping at most `cap` this time.
    pub fn fail_within(
        &mut self,
        what: &str,
        err: &dyn std::fmt::Display,
        shutdown: &Shutdown,
        cap: Duration,
    ) -> bool {
        if self.outage_since.is_none() {
            self.outage_since = Some(Instant::now());
            log::warn!("{}: {what}: {err}; retrying with backoff", self.role);
        } else {
            log::debug!("{}: {what} still failing: {err}", self.role);
        }
        let d = self.next_delay().min(cap);
        shutdown.wait(d)
    }

    /// Records a success; logs the end of an outage.
    pub fn reset(&mut self) {
        if let Some(since) = self.outage_since.take() {
            log::info!(
                "{}: recovered after {} and {} attempts",
                self.role,
                crate::human_ms(since.elapsed().as_millis() as i64),
                self.attempt
            );
        }
        self.attempt = 0;
    }

    pub fn in_outage(&self) -> bool {
        self.outage_since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_stays_under_the_cap() {
        let mut b = Backoff::new("t");
        let first = b.next_delay();
        assert!(first <= Duration::from_millis(100));
        for _ in 0..40 {
            assert!(b.next_delay() <= MAX_BACKOFF);
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
