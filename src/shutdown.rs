//! The shutdown signal shared by every thread.
//!
//! `Shutdown` is set once (by a signal handler, a test, or a role that failed) and never
//! cleared. Threads check [`Shutdown::is_set`] between steps and sleep with
//! [`Shutdown::wait`], which returns at once when shutdown is triggered: the wake-up is a
//! crossbeam channel whose only sender is dropped on trigger, so every sleeper sees
//! `Disconnected` at the same moment.
//!
//! It also carries the two requests an operator sends without stopping the daemon
//! (`signals.rs`): SIGHUP asks for a reload ([`Shutdown::request_reload`]), SIGUSR1 for a
//! state report ([`Shutdown::request_report`]). Each raises a generation counter and wakes
//! the daemon's main loop ([`Shutdown::wait_or_request`]), which acts on a generation it
//! has not seen yet (`daemon::reload`, `daemon::report`).

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Raised by the signal thread (SIGHUP, SIGUSR1); read by the daemon's main loop.
    reloads: AtomicU64,
    reports: AtomicU64,
    /// One token wakes the main loop after a request (a full channel: it is awake).
    request_tx: Sender<()>,
    request_rx: Receiver<()>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

impl Shutdown {
    pub fn new() -> Self {
        let (tx, rx) = crossbeam_channel::bounded(0);
        let (request_tx, request_rx) = crossbeam_channel::bounded(1);
        Shutdown {
            inner: Arc::new(Inner {
                flag: AtomicBool::new(false),
                wake_tx: Mutex::new(Some(tx)),
                wake_rx: rx,
                reloads: AtomicU64::new(0),
                reports: AtomicU64::new(0),
                request_tx,
                request_rx,
            }),
        }
    }

    /// Asks the daemon to reload what it can without a restart (SIGHUP).
    pub fn request_reload(&self) {
        self.inner.reloads.fetch_add(1, Ordering::SeqCst);
        let _ = self.inner.request_tx.try_send(());
    }

    /// Asks the daemon to log its state report (SIGUSR1).
    pub fn request_report(&self) {
        self.inner.reports.fetch_add(1, Ordering::SeqCst);
        let _ = self.inner.request_tx.try_send(());
    }

    /// How many reloads were requested so far.
    pub fn reloads(&self) -> u64 {
        self.inner.reloads.load(Ordering::SeqCst)
    }

    /// How many state reports were requested so far.
    pub fn reports(&self) -> u64 {
        self.inner.reports.load(Ordering::SeqCst)
    }

    /// Sleeps for `d`, until a reload or report is requested, or until shutdown. Returns
    /// `true` if shutdown is set.
    pub fn wait_or_request(&self, d: Duration) -> bool {
        if self.is_set() {
            return true;
        }
        crossbeam_channel::select! {
            recv(self.inner.wake_rx) -> _ => {}
            recv(self.inner.request_rx) -> _ => {}
            default(d) => {}
        }
        self.is_set()
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
