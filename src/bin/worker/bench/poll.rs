//! `--poll-status`: the worker under test serves its status page, and this loads `/`
//! once a second for the whole steady run, as a browser left open on it would (the page
//! refreshes itself every 10 s; once a second is ten such tabs). What it costs shows in
//! the scenario's RSS figures; the loads themselves are summarised in a note.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A loopback port nobody listens on now, for the worker's `--metrics-addr`.
pub fn free_addr() -> std::io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// What the loads saw.
#[derive(Debug, Default)]
struct Tally {
    ok: u64,
    failed: u64,
    last_failure: Option<String>,
    bytes: u64,
    slowest: Duration,
    total: Duration,
}

pub struct Poller {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Tally>,
}

impl Poller {
    /// Starts loading `http://addr/` once a second.
    pub fn start(addr: SocketAddr) -> Poller {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut t = Tally::default();
            let mut next = Instant::now();
            while !s.load(Ordering::Relaxed) {
                let started = Instant::now();
                match load(addr) {
                    Ok(n) => {
                        let took = started.elapsed();
                        t.ok += 1;
                        t.bytes += n as u64;
                        t.total += took;
                        t.slowest = t.slowest.max(took);
                    }
                    Err(e) => {
                        t.failed += 1;
                        t.last_failure = Some(e.to_string());
                    }
                }
                next += Duration::from_secs(1);
                while !s.load(Ordering::Relaxed) && Instant::now() < next {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            t
        });
        Poller { stop, handle }
    }

    /// Stops the loads; one line for the report's notes.
    pub fn finish(self) -> String {
        self.stop.store(true, Ordering::Relaxed);
        let t = self.handle.join().unwrap_or_default();
        let mut line = format!(
            "status page loaded once a second: {} loads, {} failed",
            t.ok + t.failed,
            t.failed
        );
        if t.ok > 0 {
            line.push_str(&format!(
                ", {:.1} KB each, {:.1} ms on average, {:.1} ms the slowest",
                t.bytes as f64 / t.ok as f64 / 1024.0,
                t.total.as_secs_f64() * 1000.0 / t.ok as f64,
                t.slowest.as_secs_f64() * 1000.0
            ));
        }
        if let Some(e) = t.last_failure {
            line.push_str(&format!(" (last failure: {e})"));
        }
        line
    }
}

/// One `GET /`; the body's length, or why not (a status other than 200 included).
fn load(addr: SocketAddr) -> std::io::Result<usize> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP answer"))?;
    let head = String::from_utf8_lossy(&raw[..head_end]);
    if !head.starts_with("HTTP/1.1 200") {
        let line = head.lines().next().unwrap_or("").to_string();
        return Err(std::io::Error::other(line));
    }
    Ok(raw.len() - head_end - 4)
}
