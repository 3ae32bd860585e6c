//! Prometheus metrics and a health check, served over plain HTTP/1.1 (`--metrics-addr`).
//!
//! Two parts:
//! - [`Metrics`], the per-job figures the workers record in their hot path (see
//!   `Worker::handle`): jobs by event and outcome, handler duration and lateness
//!   histograms. Only atomics: the event slots are fixed when the daemon starts, one per
//!   registered handler plus `_other` for every name no handler has (unknown events, dead
//!   letters of undecodable messages), so a producer's typo cannot grow the label set.
//! - [`Server`], one named thread in the daemon's scope with a blocking `TcpListener`.
//!   `GET /metrics` renders [`Metrics`], the counters of [`Stats`], channel depth, database
//!   pool state and resident memory in the text exposition format; `GET /healthz` answers
//!   `200 ok` when Redis answers PING and PostgreSQL a `SELECT 1`, else `503` with the
//!   reason. One request at a time, `Connection: close`: a scraper every few seconds is
//!   the whole load.
//!
//! **How it stops.** The listener is non-blocking; when no connection is waiting the
//! thread sleeps in `Shutdown::wait` for [`ACCEPT_POLL`], which returns at once on
//! shutdown. So the thread notices shutdown immediately and costs ~20 wake-ups a second
//! when idle; a request waits at most that long to be accepted.

use crate::config::Config;
use crate::db;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
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

/// The label of every event no registered handler has.
pub const OTHER_EVENT: &str = "_other";

/// How a job ended, as the workers count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOutcome {
    /// Committed with an effect.
    Done,
    /// Committed, nothing to change (a paid order, ...).
    NoOp,
    /// The inbox already held the job (a redelivery).
    Duplicate,
    /// Back to the delay pool after a transient failure.
    Retry,
    /// To the dead letters.
    Dead,
}

const OUTCOMES: [(JobOutcome, &str); 5] = [
    (JobOutcome::Done, "done"),
    (JobOutcome::NoOp, "noop"),
    (JobOutcome::Duplicate, "duplicate"),
    (JobOutcome::Retry, "retry"),
    (JobOutcome::Dead, "dead"),
];

/// Upper bounds (seconds) of the handler duration buckets: a transaction of a few
/// statements up to the statement timeout.
const HANDLER_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Upper bounds (seconds) of the lateness buckets: on time, a backlog, an outage.
const LATENESS_BOUNDS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// A fixed-bucket histogram: one atomic per bucket (not cumulative; summed when
/// rendered), the sum in microseconds. Negative observations count as zero.
pub struct Histogram {
    bounds: &'static [f64],
    /// `counts[i]` for `bounds[i]`; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        let s = if seconds.is_finite() {
            seconds.max(0.0)
        } else {
            0.0
        };
        let i = self.bounds.partition_point(|&b| b < s);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add((s * 1e6) as u64, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// `name_bucket`, `name_sum`, `name_count` lines; `labels` is `k="v",` or empty.
    /// The count is the `+Inf` bucket, so the two always agree within one scrape.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Relaxed);
            let le = match self.bounds.get(i) {
                Some(b) => b.to_string(),
                None => "+Inf".to_string(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{le}\"}} {cumulative}");
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", labels.trim_end_matches(','))
        };
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

/// What one event slot counts.
struct EventMetrics {
    name: String,
    /// Indexed like [`OUTCOMES`].
    outcomes: [AtomicU64; 5],
    handler: Histogram,
}

/// The per-job figures. Written by every worker (atomics only), read by the metrics
/// thread; nothing to do at shutdown.
pub struct Metrics {
    /// One slot per registered event, then `_other`; never grows after `new`.
    events: Vec<EventMetrics>,
    index: HashMap<String, usize>,
    /// Commit time minus the due time the mover recorded, of committed jobs (done, noop).
    lateness: Histogram,
}

impl Default for Metrics {
    /// No registered event: everything counts under `_other` (tests).
    fn default() -> Self {
        Metrics::new(std::iter::empty::<String>())
    }
}

impl Metrics {
    /// One slot per event name (the registry's), plus `_other`.
    pub fn new<S: Into<String>>(events: impl IntoIterator<Item = S>) -> Metrics {
        let mut names: Vec<String> = events.into_iter().map(Into::into).collect();
        names.retain(|n| n != OTHER_EVENT);
        names.sort();
        names.dedup();
        names.push(OTHER_EVENT.to_string());
        let index = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        let events = names
            .into_iter()
            .map(|name| EventMetrics {
                name,
                outcomes: Default::default(),
                handler: Histogram::new(HANDLER_BOUNDS),
            })
            .collect();
        Metrics {
            events,
            index,
            lateness: Histogram::new(LATENESS_BOUNDS),
        }
    }

    fn slot(&self, event: &str) -> &EventMetrics {
        let i = self
            .index
            .get(event)
            .copied()
            .unwrap_or(self.events.len() - 1);
        &self.events[i]
    }

    /// Counts one finished job.
    pub fn job(&self, event: &str, outcome: JobOutcome) {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        self.slot(event).outcomes[i].fetch_add(1, Relaxed);
    }

    /// Times one handler transaction (inbox row, handler, commit or failure).
    pub fn handler_time(&self, event: &str, d: Duration) {
        self.slot(event).handler.observe(d.as_secs_f64());
    }

    /// Records how late a committed job took effect; nothing when the due time is unknown
    /// (an entry a producer XADDed by hand).
    pub fn lateness(&self, due_ms: Option<i64>, committed_ms: i64) {
        if let Some(due) = due_ms {
            self.lateness
                .observe(committed_ms.saturating_sub(due) as f64 / 1000.0);
        }
    }

    /// Jobs of `event` (or `_other`) that ended with `outcome`.
    pub fn jobs(&self, event: &str, outcome: JobOutcome) -> u64 {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .unwrap_or(0);
        self.slot(event).outcomes[i].load(Relaxed)
    }

    /// Committed jobs whose lateness was recorded.
    pub fn lateness_count(&self) -> u64 {
        self.lateness.count()
    }

    fn render(&self, out: &mut String) {
        header(
            out,
            "delay_worker_jobs_total",
            "counter",
            "Jobs finished by the worker pool, by event and outcome (done, noop, duplicate, retry, dead).",
        );
        for e in &self.events {
            for (i, (_, name)) in OUTCOMES.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "delay_worker_jobs_total{{event=\"{}\",outcome=\"{name}\"}} {}",
                    escape(&e.name),
                    e.outcomes[i].load(Relaxed)
                );
            }
        }
        header(
            out,
            "delay_worker_handler_duration_seconds",
            "histogram",
            "Time of one job's PostgreSQL transaction (inbox row, handler, commit), by event.",
        );
        for e in self.events.iter().filter(|e| e.name != OTHER_EVENT) {
            let labels = format!("event=\"{}\",", escape(&e.name));
            e.handler
                .render(out, "delay_worker_handler_duration_seconds", &labels);
        }
        header(
            out,
            "delay_worker_lateness_seconds",
            "histogram",
            "Commit time minus due time of committed jobs (done and noop) whose due time is known.",
        );
        self.lateness
            .render(out, "delay_worker_lateness_seconds", "");
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// A label value as the exposition format wants it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

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
    pub metrics: &'a Metrics,
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
            "/healthz" => match self.probe.check() {
                Ok(()) => (200, "text/plain", "ok\n".to_string()),
                Err(why) => {
                    log::debug!("healthz: {why}");
                    (503, "text/plain", format!("{why}\n"))
                }
            },
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
        src.metrics.render(&mut out);
        let s = src.stats.snapshot();
        for (name, help, v) in [
            ("delay_worker_moved_total", "Members moved from the delay pool by this process's mover.", s.moved),
            ("delay_worker_orphans_total", "Due members removed because their data never arrived.", s.orphans),
            ("delay_worker_delivered_total", "Messages handed to the worker pool (new, own pending, reclaimed).", s.delivered),
            ("delay_worker_reclaimed_total", "Messages taken over from dead or idle consumers.", s.reclaimed),
            ("delay_worker_acked_total", "Messages acknowledged in Redis.", s.acked),
            ("delay_worker_dead_letters_total", "Messages sent to the dead letters, by the workers and by the reader (over-delivered).", s.dead),
            ("delay_worker_redis_reconnects_total", "Redis outages (a connection lost or refused, then reconnecting with backoff), one per thread and outage.", src.stats.redis_reconnects.load(Relaxed)),
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
    fn histograms_are_cumulative_and_count_what_they_saw() {
        let h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 3.0, -2.0, f64::NAN] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "event=\"e\",");
        assert!(
            out.contains("x_bucket{event=\"e\",le=\"0.1\"} 4\n"),
            "{out}"
        );
        assert!(out.contains("x_bucket{event=\"e\",le=\"1\"} 5\n"), "{out}");
        assert!(
            out.contains("x_bucket{event=\"e\",le=\"+Inf\"} 6\n"),
            "{out}"
        );
        assert!(out.contains("x_count{event=\"e\"} 6\n"), "{out}");
        assert!(out.contains("x_sum{event=\"e\"} 3.65\n"), "{out}");
        assert_eq!(h.count(), 6);
    }

    #[test]
    fn unknown_events_share_one_slot() {
        let m = Metrics::new(["order.timeout"]);
        m.job("order.timeout", JobOutcome::Done);
        m.job("typo.event", JobOutcome::Dead);
        m.job("", JobOutcome::Dead);
        m.lateness(Some(1_000), 1_250);
        m.lateness(None, 1_250);
        assert_eq!(m.jobs("order.timeout", JobOutcome::Done), 1);
        assert_eq!(m.jobs(OTHER_EVENT, JobOutcome::Dead), 2);
        assert_eq!(m.lateness_count(), 1);
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains("delay_worker_jobs_total{event=\"_other\",outcome=\"dead\"} 2"));
        assert!(!out.contains("typo"), "no label per unknown name");
        assert!(
            out.contains("delay_worker_lateness_seconds_count 1\n"),
            "{out}"
        );
    }

    #[test]
    fn resident_memory_is_read() {
        assert!(resident_memory_bytes().unwrap_or(0) > 0);
    }
}
