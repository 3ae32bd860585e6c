//! systemd's notification protocol (`sd_notify`), without a crate: readiness, watchdog,
//! status line and stopping, as datagrams to `$NOTIFY_SOCKET`.
//!
//! The daemon's main thread owns the one [`Notifier`]. It sends `READY=1` once Redis and
//! PostgreSQL were checked and the roles spawned; then, at each tick of its loop (half of
//! `$WATCHDOG_USEC` when systemd asked for a watchdog, else the stats interval), a
//! `STATUS=` line with the counters and, while the daemon is live (`health::live`), `WATCHDOG=1`;
//! `STOPPING=1` when shutdown starts. Without `NOTIFY_SOCKET` (not under systemd, or a
//! unit that is not `Type=notify`) every call is a no-op.

use crate::config::Config;
use crate::health::live;
use crate::stats::{Snapshot, Stats};
use std::ffi::OsStr;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where notifications go; `None` parts make every call a no-op.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    /// Half of `WATCHDOG_USEC` (systemd's advice): a ping may be late once without harm.
    watchdog: Option<Duration>,
    /// Whether the last tick found the daemon live; only its changes are logged.
    live: bool,
    /// A send failure is logged once: it repeats every tick otherwise.
    warned: bool,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` as systemd sets them.
    pub fn from_env() -> Notifier {
        Notifier::from_vars(
            std::env::var_os("NOTIFY_SOCKET").as_deref(),
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
        )
    }

    /// The same from given values (tests). A socket that cannot be used is logged once
    /// and ignored: the daemon runs without notifications rather than not at all (systemd
    /// then reports the start as timed out, which names the problem).
    pub fn from_vars(socket: Option<&OsStr>, usec: Option<&str>, pid: Option<&str>) -> Notifier {
        let target = socket.filter(|s| !s.is_empty()).and_then(|s| {
            match address(s).and_then(|a| UnixDatagram::unbound().map(|u| (u, a))) {
                Ok(t) => Some(t),
                Err(e) => {
                    log::warn!("NOTIFY_SOCKET {s:?} unusable, not notifying systemd: {e}");
                    None
                }
            }
        });
        // WATCHDOG_PID names the process the watchdog is meant for; a child that inherited
        // the variables must not ping in its parent's name.
        let ours = pid.is_none_or(|p| p.trim().parse::<u32>().ok() == Some(std::process::id()));
        let watchdog = usec
            .and_then(|u| u.trim().parse::<u64>().ok())
            .filter(|&u| u > 0 && ours && target.is_some())
            .map(|u| Duration::from_micros(u / 2).max(Duration::from_millis(1)));
        Notifier {
            target,
            watchdog,
            live: true,
            warned: false,
        }
    }

    pub fn is_active(&self) -> bool {
        self.target.is_some()
    }

    /// How often systemd wants `WATCHDOG=1`, if it does.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog
    }

    /// The period of the daemon's main loop: the stats interval, or the watchdog
    /// interval when that is shorter.
    pub fn tick_interval(&self, stats_interval: Duration) -> Duration {
        self.watchdog
            .map_or(stats_interval, |w| w.min(stats_interval))
    }

    /// Sends one notification (newline-separated `KEY=value` assignments).
    pub fn send(&mut self, state: &str) {
        let Some((socket, addr)) = &self.target else {
            return;
        };
        if let Err(e) = socket.send_to_addr(state.as_bytes(), addr) {
            if !self.warned {
                self.warned = true;
                log::warn!("cannot notify systemd: {e}; the watchdog may restart the unit");
            }
        }
    }

    /// Startup is over: systemd marks the unit active (and starts ordering units after it).
    pub fn ready(&mut self, stats: &Stats, in_channel: usize) {
        if !self.is_active() {
            return;
        }
        let status = status_line(&stats.snapshot(), in_channel, None);
        let ping = if self.watchdog.is_some() {
            "\nWATCHDOG=1"
        } else {
            ""
        };
        self.send(&format!("READY=1\nSTATUS={status}{ping}"));
    }

    /// One tick of the main loop: `WATCHDOG=1` while live, and the status line. A change
    /// of verdict is logged, so the journal says why systemd restarted the unit.
    pub fn tick(&mut self, stats: &Stats, config: &Config, in_channel: usize) {
        if !self.is_active() {
            return;
        }
        let verdict = live(stats, config, crate::now_ms());
        if let Some(w) = self.watchdog {
            match (&verdict, self.live) {
                (Err(why), true) => log::warn!(
                    "withholding the systemd watchdog ping: {why}; systemd restarts the unit once {:.1}s pass without one",
                    (w * 2).as_secs_f64()
                ),
                (Ok(()), false) => log::info!("live again; watchdog pings resumed"),
                _ => {}
            }
        }
        self.live = verdict.is_ok();
        let status = status_line(&stats.snapshot(), in_channel, verdict.as_ref().err());
        let ping = if self.watchdog.is_some() && self.live {
            "WATCHDOG=1\n"
        } else {
            ""
        };
        self.send(&format!("{ping}STATUS={status}"));
    }

    /// Shutdown started: systemd shows the unit as deactivating while the pool drains.
    pub fn stopping(&mut self) {
        self.send("STOPPING=1\nSTATUS=draining the jobs already read");
    }
}

/// `@name` is an abstract socket (Linux), anything else a path.
fn address(s: &OsStr) -> std::io::Result<SocketAddr> {
    use std::os::unix::ffi::OsStrExt;
    match s.as_bytes() {
        [b'@', name @ ..] => abstract_address(name),
        _ => SocketAddr::from_pathname(s),
    }
}

#[cfg(target_os = "linux")]
fn abstract_address(name: &[u8]) -> std::io::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(target_os = "linux"))]
fn abstract_address(_: &[u8]) -> std::io::Result<SocketAddr> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "abstract sockets exist only on Linux",
    ))
}

/// The `STATUS=` line `systemctl status` shows.
pub fn status_line(s: &Snapshot, in_channel: usize, problem: Option<&String>) -> String {
    let mut line = format!(
        "done {}, noop {}, duplicate {}, retried {}, dead {}, in channel {in_channel}",
        s.done, s.noop, s.duplicate, s.retried, s.dead
    );
    if let Some(p) = problem {
        line.push_str("; not live: ");
        line.push_str(p);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn recv(s: &UnixDatagram) -> String {
        let mut buf = [0u8; 4096];
        let n = s.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn without_a_socket_everything_is_a_no_op() {
        let mut n = Notifier::from_vars(None, Some("1000000"), None);
        assert!(!n.is_active());
        assert_eq!(n.watchdog_interval(), None, "no socket, no watchdog");
        n.send("READY=1");
        n.stopping();
        let n = Notifier::from_vars(Some(OsStr::new("")), None, None);
        assert!(!n.is_active());
    }

    #[test]
    fn sends_to_an_abstract_socket_and_halves_the_watchdog() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("dw-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let var = OsString::from(format!("@{name}"));
        let pid = std::process::id().to_string();
        let mut n = Notifier::from_vars(Some(&var), Some("400000"), Some(&pid));
        assert_eq!(n.watchdog_interval(), Some(Duration::from_millis(200)));
        assert_eq!(
            n.tick_interval(Duration::from_secs(60)),
            Duration::from_millis(200)
        );
        n.ready(&Stats::default(), 3);
        let got = recv(&server);
        assert!(got.starts_with("READY=1\nSTATUS=done 0,"), "{got}");
        assert!(
            got.contains("in channel 3") && got.ends_with("WATCHDOG=1"),
            "{got}"
        );
        n.stopping();
        assert!(recv(&server).starts_with("STOPPING=1"));
    }

    #[test]
    fn a_watchdog_meant_for_another_process_is_ignored() {
        let dir = std::env::temp_dir().join(format!("dw-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sock");
        let _ = std::fs::remove_file(&path);
        let _server = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::from_vars(Some(path.as_os_str()), Some("400000"), Some("1"));
        assert!(n.is_active());
        assert_eq!(n.watchdog_interval(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
