//! Prometheus metrics and a health check, served over plain HTTP/1.1 (`--metrics-addr`).
//!
//! The exporter over the one set of counters ([`Stats`], `stats.rs`): [`Server`], one
//! named thread in the daemon's scope with a blocking `TcpListener`. `GET /metrics`
//! renders the counters, channel depth, database pool state and resident memory in the
//! text exposition format; `GET /healthz` answers `200 ok` when the roles make progress
//! (the watchdog's verdict, which includes a key of the wrong type reported by a role),
//! Redis answers PING and PostgreSQL a `SELECT 1`, else `503` with the reason. One
//! request at a time, `Connection: close`: a scraper every few seconds is the whole load.
//!
//! **How it stops.** The listener is non-blocking; when no connection is waiting the
//! thread sleeps in `Shutdown::wait` for [`ACCEPT_POLL`], which returns at once on
//! shutdown. So the thread notices shutdown immediately and costs ~20 wake-ups a second
//! when idle; a request waits at most that long to be accepted.

use crate::config::Config;
use crate::db;
use crate::shutdown::Shutdown;
use crate::stats::{sample, Stats};
use crate::store;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// Sleep between two looks at an idle listener (woken at once by shutdown).
pub const ACCEPT_POLL: Duration = Duration::from_millis(50);
/// A client gets this long to send its request and read the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest request head read; anything longer is not a scraper.
const MAX_REQUEST: usize = 8 * 1024;
/// `/healthz` answers 503 when the servers have not answered within this.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);
/// Connect and I/O timeout of each server the health check asks.
const PROBE_IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Resident set size in bytes, from `/proc/self/status` (`VmRSS`, in kB).
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[derive(Debug, thiserror::Error)]
#[error("--metrics-addr {addr}: cannot listen: {source}")]
pub struct MetricsError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// What the metrics thread reads. Everything but `depth` and the probe is borrowed from
/// the daemon.
pub struct Sources<'a> {
    pub stats: &'a Stats,
    pub config: &'a Config,
    /// The workers' pool, for its state only: it never checks a connection out (each
    /// worker holds one for its whole life, so a checkout would wait for the timeout).
    pub pool: &'a db::Pool,
    pub redis: &'a redis::Client,
    /// Messages waiting in the reader -> pool channel.
    pub depth: Box<dyn Fn() -> usize + Send + Sync + 'a>,
    pub capacity: usize,
}

/// The HTTP endpoint; [`Server::run`] is the thread body.
pub struct Server<'a> {
    listener: TcpListener,
    src: Sources<'a>,
    probe: Probe,
}

impl<'a> Server<'a> {
    /// Binds now, so a port in use stops the start with one readable line.
    pub fn bind(addr: SocketAddr, src: Sources<'a>) -> Result<Server<'a>, MetricsError> {
        let err = |source| MetricsError { addr, source };
        let listener = TcpListener::bind(addr).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        // The daemon checked this URL at start; a parse error here is not expected.
        let mut pg: postgres::Config = src
            .config
            .database_url
            .parse()
            .map_err(|e: postgres::Error| err(std::io::Error::other(db::error_text(&e))))?;
        pg.connect_timeout(PROBE_IO_TIMEOUT);
        pg.application_name("delay-worker healthz");
        pg.options(&format!(
            "-c statement_timeout={}",
            PROBE_IO_TIMEOUT.as_millis()
        ));
        Ok(Server {
            listener,
            probe: Probe {
                redis: src.redis.clone(),
                pg,
                busy: Arc::new(AtomicBool::new(false)),
            },
            src,
        })
    }

    /// The address actually bound (port 0 picks one).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until shutdown (see the module header for how it stops).
    pub fn run(&self, shutdown: &Shutdown) {
        if let Ok(a) = self.local_addr() {
            log::info!("metrics: serving http://{a}/metrics and /healthz");
        }
        while !shutdown.is_set() {
            match self.listener.accept() {
                Ok((stream, _)) => self.serve(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    shutdown.wait(ACCEPT_POLL);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of file descriptors and the like: say so, and do not spin.
                    log::warn!("metrics: accept failed: {e}");
                    shutdown.wait(Duration::from_secs(1));
                }
            }
        }
        log::debug!("metrics: stopped");
    }

    /// One request, one answer, close. Errors writing mean the client went away: there
    /// is nobody left to tell, so they are dropped.
    fn serve(&self, mut stream: TcpStream) {
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
        let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
        let (status, content_type, body, head_only) = match read_request(&mut stream) {
            Ok((method, path)) => {
                let head_only = method == "HEAD";
                let (s, t, b) = if method != "GET" && !head_only {
                    (405, "text/plain", "only GET and HEAD\n".to_string())
                } else {
                    self.route(&path)
                };
                (s, t, b, head_only)
            }
            Err(why) => (400, "text/plain", format!("{why}\n"), false),
        };
        let reason = match status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Service Unavailable",
        };
        let mut response = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        if !head_only {
            response.push_str(&body);
        }
        let _ = stream.write_all(response.as_bytes());
        let _ = stream.flush();
    }

    fn route(&self, path: &str) -> (u16, &'static str, String) {
        match path {
            "/metrics" => (
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                self.render(),
            ),
            "/healthz" => {
                match crate::notify::live(self.src.stats, self.src.config, crate::now_ms())
                    .and_then(|()| self.probe.check())
                {
                    Ok(()) => (200, "text/plain", "ok\n".to_string()),
                    Err(why) => {
                        log::debug!("healthz: {why}");
                        (503, "text/plain", format!("{why}\n"))
                    }
                }
            }
            _ => (
                404,
                "text/plain",
                "not found: try /metrics or /healthz\n".to_string(),
            ),
        }
    }

    /// The whole exposition.
    pub fn render(&self) -> String {
        let src = &self.src;
        let mut out = String::with_capacity(16 * 1024);
        src.stats.jobs.render(&mut out);
        let s = src.stats.snapshot();
        for (name, help, v) in [
            ("delay_worker_moved_total", "Members that left the delay pool through this process's mover (moved, or dead-lettered when they could not be).", s.moved),
            ("delay_worker_delivered_total", "Messages handed to the worker pool (new, own pending, reclaimed).", s.delivered),
            ("delay_worker_reclaimed_total", "Messages taken over from dead or idle consumers.", s.reclaimed),
            ("delay_worker_acked_total", "Messages acknowledged in Redis.", s.acked),
            ("delay_worker_dead_letters_total", "Messages sent to the dead letters by this process (workers, reader and mover), counted once the letter exists.", s.dead),
            ("delay_worker_redis_reconnects_total", "Redis outages (a connection lost or refused, then reconnecting with backoff), one per thread and outage.", src.stats.redis_reconnects.load(Relaxed)),
            ("delay_worker_inbox_pruned_total", "worker_inbox rows older than --inbox-retention deleted by this process.", src.stats.inbox_pruned.load(Relaxed)),
        ] {
            sample(&mut out, name, "counter", help, v);
        }
        let state = src.pool.state();
        let live = crate::notify::live(src.stats, src.config, crate::now_ms()).is_ok();
        for (name, help, v) in [
            ("delay_worker_channel_depth", "Messages read and waiting for a worker.", (src.depth)() as u64),
            ("delay_worker_channel_capacity", "Capacity of the reader -> pool channel.", src.capacity as u64),
            ("delay_worker_db_pool_connections", "Open connections of the workers' PostgreSQL pool.", state.connections as u64),
            ("delay_worker_db_pool_idle_connections", "Idle connections of the workers' PostgreSQL pool.", state.idle_connections as u64),
            ("delay_worker_db_pool_max_connections", "Size of the workers' PostgreSQL pool (one per worker thread).", src.pool.max_size() as u64),
            ("delay_worker_workers_waiting_for_db", "Workers holding a job while they cannot get a PostgreSQL connection.", src.stats.db_waiting.load(Relaxed)),
            ("delay_worker_live", "1 while the reader, mover and workers make progress (the systemd watchdog's verdict), else 0.", live as u64),
        ] {
            sample(&mut out, name, "gauge", help, v);
        }
        if let Some(rss) = resident_memory_bytes() {
            sample(
                &mut out,
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
                rss,
            );
        }
        out
    }
}

/// Reads the request head; returns the method and the path without its query string.
fn read_request(stream: &mut TcpStream) -> Result<(String, String), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        if buf.len() >= MAX_REQUEST {
            return Err("request head too large".into());
        }
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("cannot read the request: {e}")),
        }
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    match (parts.next(), parts.next()) {
        (Some(method), Some(target)) => {
            let path = target.split('?').next().unwrap_or(target);
            Ok((method.to_string(), path.to_string()))
        }
        _ => Err("not an HTTP request".into()),
    }
}

/// The `/healthz` check: Redis answers PING, and PostgreSQL accepts a new connection
/// (what a restarted worker needs; the workers' pool has none to spare, see
/// `Sources::pool`) that answers `SELECT 1`. A fresh connection also gives the server's
/// own reason when it refuses, where a pool would only time out.
///
/// It runs on a short-lived thread of its own: a server that
/// accepts connections but never answers (stopped, or a network black hole) must cost a
/// 503 after [`HEALTH_TIMEOUT`], not a metrics thread stuck in a read, which would also
/// hold up the daemon's exit. That thread is not joined for the same reason; it ends by
/// itself when its socket times out or errors, and only one runs at a time.
struct Probe {
    redis: redis::Client,
    pg: postgres::Config,
    /// Set while a check runs; cleared by the check's thread when it ends.
    busy: Arc<AtomicBool>,
}

impl Probe {
    fn check(&self) -> Result<(), String> {
        if self.busy.swap(true, Relaxed) {
            return Err("the previous health check is still waiting for a server".into());
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (redis, pg, busy) = (self.redis.clone(), self.pg.clone(), self.busy.clone());
        let spawned = std::thread::Builder::new()
            .name("healthz".into())
            .spawn(move || {
                // The receiver is gone when the answer came too late: nothing to do.
                let _ = tx.send(probe(&redis, &pg));
                busy.store(false, Relaxed);
            });
        if let Err(e) = spawned {
            self.busy.store(false, Relaxed);
            return Err(format!("cannot start the health check: {e}"));
        }
        match rx.recv_timeout(HEALTH_TIMEOUT) {
            Ok(r) => r,
            Err(_) => Err(format!(
                "no answer from Redis or PostgreSQL within {}s",
                HEALTH_TIMEOUT.as_secs()
            )),
        }
    }
}

fn probe(redis: &redis::Client, pg: &postgres::Config) -> Result<(), String> {
    let mut con = store::connect_with(redis, PROBE_IO_TIMEOUT)
        .map_err(|e| format!("Redis unreachable: {e}"))?;
    redis::cmd("PING")
        .query::<String>(&mut con)
        .map_err(|e| format!("Redis does not answer PING: {e}"))?;
    let mut c = pg
        .connect(postgres::NoTls)
        .map_err(|e| format!("no PostgreSQL connection: {}", db::error_text(&e)))?;
    c.simple_query("SELECT 1")
        .map_err(|e| format!("PostgreSQL SELECT 1 failed: {}", db::error_text(&e)))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_is_read() {
        assert!(resident_memory_bytes().unwrap_or(0) > 0);
    }
}
