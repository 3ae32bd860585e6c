//! Whether this process stood still lately: stopped (SIGSTOP, a frozen VM, a debugger) or
//! starved of CPU. A thread of its own ticks every [`TICK`]; a tick that comes more than
//! [`STALL`] late is a stall, remembered with its length.
//!
//! What it is for: PostgreSQL ends a session left idle inside a transaction past 2 s
//! (`db::IDLE_IN_TRANSACTION`), and a worker that stood still mid-transaction finds its
//! connection gone when it runs again, often as a plain "connection closed" rather than
//! the server's 25P03. That is this process's pause, not an outage of PostgreSQL, and is
//! told as such (found from outside: after a 5 s SIGSTOP `stats --check` was CRITICAL "no
//! writable PostgreSQL: connection closed").

use crate::shutdown::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How often the thread ticks.
pub const TICK: Duration = Duration::from_millis(100);

/// How late a tick must be to count as a stall.
pub const STALL: Duration = Duration::from_millis(900);

/// How long a stall is remembered for [`Stalls::stood_still`]'s callers: a worker back
/// from one meets its closed session within its next statement.
pub const REMEMBERED: Duration = Duration::from_secs(10);

/// The ticks and the last stall (µs since `epoch`; 0: none yet).
pub struct Stalls {
    epoch: Instant,
    last_tick_us: AtomicU64,
    last_end_us: AtomicU64,
    last_len_us: AtomicU64,
}

impl Default for Stalls {
    fn default() -> Self {
        Stalls {
            epoch: Instant::now(),
            last_tick_us: AtomicU64::new(0),
            last_end_us: AtomicU64::new(0),
            last_len_us: AtomicU64::new(0),
        }
    }
}

impl Stalls {
    /// The thread body: a tick every [`TICK`] until shutdown.
    pub fn run(&self, shutdown: &Shutdown) {
        loop {
            self.tick();
            if shutdown.wait(TICK) {
                // Not ticking from here on is no stall.
                self.last_tick_us.store(0, Relaxed);
                return;
            }
        }
    }

    /// From 1 on: 0 stands for "never".
    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64 + 1
    }

    fn tick(&self) {
        let now = self.now_us();
        let last = self.last_tick_us.swap(now, Relaxed);
        let gap = now.saturating_sub(last);
        if last > 0 && gap > (TICK + STALL).as_micros() as u64 {
            self.last_len_us.store(gap, Relaxed);
            self.last_end_us.store(now, Relaxed);
        }
    }

    /// How long the process stood still, if it did for at least `at_least` within the last
    /// `within`: the last stall the thread saw, or the one it has not yet woken from (it
    /// was stopped with the rest and has not run since).
    pub fn stood_still(&self, at_least: Duration, within: Duration) -> Option<Duration> {
        let now = self.now_us();
        let last = self.last_tick_us.load(Relaxed);
        let ongoing = (last > 0).then(|| now.saturating_sub(last));
        let ended = self.last_end_us.load(Relaxed);
        let seen = (ended > 0 && now.saturating_sub(ended) <= within.as_micros() as u64)
            .then(|| self.last_len_us.load(Relaxed));
        [ongoing, seen]
            .into_iter()
            .flatten()
            .map(Duration::from_micros)
            .filter(|d| *d >= at_least)
            .max()
    }
}

#[cfg(test)]
impl Stalls {
    /// As if the process had just stood still for `d`.
    pub fn stood_still_for(&self, d: Duration) {
        self.tick();
        self.last_len_us.store(d.as_micros() as u64, Relaxed);
        self.last_end_us.store(self.now_us(), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_tick_is_a_stall_remembered_for_a_while() {
        let s = Stalls::default();
        s.tick();
        assert_eq!(
            s.stood_still(Duration::from_millis(50), Duration::from_secs(10)),
            None
        );
        std::thread::sleep(Duration::from_millis(1100));
        // Not ticked since: standing still now, as far as it knows.
        let now = s.stood_still(Duration::from_secs(1), Duration::from_secs(10));
        assert!(
            now.is_some_and(|d| d >= Duration::from_millis(1100)),
            "{now:?}"
        );
        s.tick();
        s.tick();
        let seen = s.stood_still(Duration::from_secs(1), Duration::from_secs(10));
        assert!(
            seen.is_some_and(|d| d >= Duration::from_millis(1100)),
            "{seen:?}"
        );
        assert_eq!(
            s.stood_still(Duration::from_secs(2), Duration::from_secs(10)),
            None
        );
        assert_eq!(s.stood_still(Duration::from_secs(1), Duration::ZERO), None);
    }
}
