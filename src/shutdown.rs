//! The shutdown signal shared by every thread.
//!
//! `Shutdown` is set once (by a signal handler, a test, or a role that failed) and never
//! cleared. Threads check [`Shutdown::is_set`] between steps and sleep with
//! [`Shutdown::wait`], which returns at once when shutdown is triggered: the wake-up is a
//! crossbeam channel whose only sender is dropped on trigger, so every sleeper sees
//! `Disconnected` at the same moment.

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Cheap to clone; all clones share one flag.
#[derive(Clone)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

struct Inner {
    /// Written once by `trigger`; read by every loop.
    flag: AtomicBool,
    /// Dropped by `trigger` to wake every `wait` at once.
    wake_tx: Mutex<Option<Sender<()>>>,
    wake_rx: Receiver<()>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        let (tx, rx) = crossbeam_channel::bounded(0);
        Shutdown {
            inner: Arc::new(Inner {
                flag: AtomicBool::new(false),
                wake_tx: Mutex::new(Some(tx)),
                wake_rx: rx,
            }),
        }
    }

    /// Asks every thread to stop. Returns `true` if shutdown was already triggered
    /// (the caller may treat that as a second signal).
    pub fn trigger(&self) -> bool {
        let was = self.inner.flag.swap(true, Ordering::SeqCst);
        // A poisoned lock only means another thread panicked while triggering; the
        // sender is dropped either way.
        let mut tx = match self.inner.wake_tx.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        tx.take();
        was
    }

    pub fn is_set(&self) -> bool {
        self.inner.flag.load(Ordering::SeqCst)
    }

    /// Sleeps for `d` or until shutdown, whichever comes first. Returns `true` if shutdown
    /// is set.
    pub fn wait(&self, d: Duration) -> bool {
        if self.is_set() {
            return true;
        }
        match self.inner.wake_rx.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => self.is_set(),
            _ => true,
        }
    }

    /// A receiver that becomes disconnected on shutdown, for `select!` next to other
    /// channels.
    pub fn receiver(&self) -> &Receiver<()> {
        &self.inner.wake_rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn trigger_wakes_sleepers_at_once() {
        let s = Shutdown::new();
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            assert!(s2.wait(Duration::from_secs(30)));
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(!s.trigger());
        assert!(t.join().unwrap() < Duration::from_secs(5));
        assert!(s.trigger(), "second trigger reports the first");
    }
}
