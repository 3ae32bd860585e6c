//! Prometheus metrics and a health check, served over plain HTTP/1.1 (`--metrics-addr`).
//!
//! The exporter over the one set of counters ([`Stats`], `stats.rs`): [`Server`], one
//! named thread in the daemon's scope. `GET /metrics` renders the counters, channel depth,
//! database pool state and resident memory in the text exposition format; `GET /healthz`
//! answers `200 ok` when the roles make progress (the watchdog's verdict, which includes a
//! key of the wrong type reported by a role), Redis answers PING and PostgreSQL a
//! `SELECT 1`, else `503` with the reason. `/` and `/dead...` are the status page
//! (`status/`): a connection thread hands those requests to the page's own thread
//! (`status::Page::run`, in this server's scope). Routing is by method and path
//! ([`Server::route`]) on a parsed [`Request`]: the head parsed by `httparse`, a body of at
//! most [`MAX_BODY`] bytes read by its `Content-Length`. `Connection: close` always.
//!
//! **Slow clients cannot starve it.** The thread blocks in `accept` and hands each
//! connection to a thread of its own, at most [`MAX_CONNECTIONS`] at once. A connection
//! must deliver its whole request within [`REQUEST_DEADLINE`] (a head of at most
//! [`MAX_HEAD`] bytes) and take its answer within [`WRITE_TIMEOUT`], else it is closed
//! (with `408` if it sent part of a request). When every slot is taken, the connection that
//! has been sending its request longest (at least [`STALLED`]) is closed to make room, so a
//! new request never waits behind clients that connect and stall, however many there are.
//! Clients that stall and reconnect at once keep every slot younger than that: then a new
//! connection that has sent its whole request head (within [`WHOLE_HEAD_WAIT`]) takes the
//! slot of the oldest one whose thread waits for more of its request, whatever its age, so
//! a probe is answered through such a flood. Only when every slot is busy answering
//! (answers take milliseconds, a health check at most [`HEALTH_TIMEOUT`]) or holds a
//! request not read yet does a new connection get `503` (at once, or after looking for
//! room for [`EVICT_WAIT`] when it sent a whole request), and a request that was sent
//! whole is never closed unanswered. Nothing is queued.
//!
//! **How it stops.** On shutdown a helper thread of the server closes the connections
//! still open and wakes the blocked `accept` by connecting to the listener itself; the
//! connection threads end with the server's thread scope.

use crate::config::Config;
use crate::db;
use crate::shutdown::Shutdown;
use crate::stats::{sample, Stats};
use crate::store;
use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown as Close;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Connections served at once, one thread each.
pub const MAX_CONNECTIONS: usize = 16;
/// A client must have sent its whole request (head and body) within this of connecting.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(1);
/// A client that does not take its answer within this is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest request head (request line and headers): `431` beyond.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest request body: `413` beyond.
pub const MAX_BODY: usize = 64 * 1024;
/// Most request headers: `431` beyond.
const MAX_HEADERS: usize = 32;
/// Stack of a connection thread: rendering the exposition needs little.
const CONNECTION_STACK: usize = 256 * 1024;
/// How long the accepting thread waits for a connection it closed to free its slot.
const EVICT_WAIT: Duration = Duration::from_millis(200);
/// A connection still sending its request after this long may be closed to make room for
/// a new one; a client that sends its request at once is read well within it.
const STALLED: Duration = Duration::from_millis(250);
/// How long a new connection that finds every slot young may take to send its whole
/// request head, to take the slot of a client still sending its own.
const WHOLE_HEAD_WAIT: Duration = Duration::from_millis(20);
/// A connection that has sent nothing for this long since it connected may be closed to
/// make room for a whole request; a client sends its request at once.
const SILENT: Duration = Duration::from_millis(100);

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
    pub redis: &'a crate::store::Redis,
    /// Whether the workers yield to the shop (`manners.rs`).
    pub manners: &'a crate::manners::Manners,
    /// Messages waiting in the reader -> pool channel.
    pub depth: Box<dyn Fn() -> usize + Send + Sync + 'a>,
    pub capacity: usize,
}

/// One request as read from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path, without its query string.
    pub path: String,
    /// What followed `?`, as sent.
    pub query: String,
    /// The `Content-Type` header, if any.
    pub content_type: Option<String>,
    /// Every header as sent, names lower-cased (at most [`MAX_HEADERS`]).
    pub headers: Vec<(String, String)>,
    /// The body (`Content-Length` bytes, at most [`MAX_BODY`]).
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of this (lower-case) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One answer; always sent with `Connection: close`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    /// The `Allow` header of a `405`.
    pub allow: Option<&'static str>,
    /// More headers (the status page's security headers).
    pub headers: Vec<(&'static str, &'static str)>,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            allow: None,
            headers: Vec::new(),
        }
    }

    fn write_to(&self, w: &mut impl Write, head_only: bool) -> std::io::Result<()> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            413 => "Content Too Large",
            415 => "Unsupported Media Type",
            431 => "Request Header Fields Too Large",
            501 => "Not Implemented",
            503 => "Service Unavailable",
            _ => "",
        };
        let mut out = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if let Some(allow) = self.allow {
            out.push_str(&format!("Allow: {allow}\r\n"));
        }
        for (name, value) in &self.headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str("\r\n");
        // The body on its own: a page is not copied once more behind its head.
        w.write_all(out.as_bytes())?;
        if !head_only {
            w.write_all(self.body.as_bytes())?;
        }
        w.flush()
    }
}

/// The HTTP endpoint; [`Server::run`] is the thread body.
pub struct Server<'a> {
    listener: TcpListener,
    src: Sources<'a>,
    probe: Probe,
    slots: Slots,
    status: crate::status::Page<'a>,
}

impl<'a> Server<'a> {
    /// Binds now, so a port in use stops the start with one readable line. Warns when the
    /// address is not a loopback one: the endpoint has no authentication.
    pub fn bind(addr: SocketAddr, src: Sources<'a>) -> Result<Server<'a>, MetricsError> {
        let err = |source| MetricsError { addr, source };
        let listener = TcpListener::bind(addr).map_err(err)?;
        // The daemon checked this URL at start; a parse error here is not expected.
        let mut pg = db::Target::parse(&src.config.database_url)
            .map_err(|e| err(std::io::Error::other(e.to_string())))?;
        pg.config.connect_timeout(PROBE_IO_TIMEOUT);
        pg.config.application_name("delay-worker healthz");
        pg.config.options(&format!(
            "-c statement_timeout={}",
            PROBE_IO_TIMEOUT.as_millis()
        ));
        if !addr.ip().to_canonical().is_loopback() {
            log::warn!(
                "metrics: --metrics-addr {addr} is not a loopback address, and /metrics and \
                 /healthz have no authentication: anyone who can reach this port can read the \
                 metrics and run the health check; bind 127.0.0.1, or a private interface \
                 behind a firewall"
            );
        }
        Ok(Server {
            listener,
            probe: Probe {
                redis: src.redis.clone(),
                pg,
                shared: Arc::default(),
            },
            slots: Slots::default(),
            status: crate::status::Page::new(src.config, src.stats, src.redis.clone()),
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
            log::info!(
                "metrics: serving http://{a}/metrics, /healthz and the status page http://{a}/ ({})",
                self.status.mode()
            );
        }
        let stopped = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waker = std::thread::Builder::new()
                .name("metrics-stop".into())
                .spawn_scoped(s, || {
                    // Disconnected (an error) exactly when shutdown is triggered.
                    let _ = shutdown.receiver().recv();
                    self.slots.close_all();
                    self.wake_accept(&stopped);
                });
            if let Err(e) = waker {
                // Without it a blocked accept could not be woken at shutdown.
                log::error!("metrics: cannot start its stop thread, not serving: {e}");
                return;
            }
            let pages = std::thread::Builder::new()
                .name("status-page".into())
                .stack_size(crate::status::PAGE_STACK)
                .spawn_scoped(s, || self.status.run(shutdown));
            if let Err(e) = pages {
                // /metrics and /healthz still work; the page answers 503.
                log::error!("metrics: cannot start the status page's thread: {e}");
            }
            self.accept_loop(s, shutdown);
            stopped.store(true, Relaxed);
        });
        log::debug!("metrics: stopped");
    }

    fn accept_loop<'s>(&'s self, s: &'s std::thread::Scope<'s, '_>, shutdown: &Shutdown) {
        while !shutdown.is_set() {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted
                            | ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                    ) =>
                {
                    continue
                }
                Err(e) => {
                    // Out of file descriptors and the like: say so, and do not spin.
                    log::warn!("metrics: accept failed: {e}");
                    shutdown.wait(Duration::from_secs(1));
                    continue;
                }
            };
            if shutdown.is_set() {
                break;
            }
            let Some(id) = self.slots.admit(&stream) else {
                log::debug!("metrics: every connection slot is answering; 503");
                refuse(stream);
                continue;
            };
            let spawned = std::thread::Builder::new()
                .name("metrics-conn".into())
                .stack_size(CONNECTION_STACK)
                .spawn_scoped(s, move || {
                    let _leave = Leave(&self.slots, id);
                    self.serve(stream, id);
                });
            if let Err(e) = spawned {
                // The closure, and the connection with it, is dropped: closed.
                self.slots.leave(id);
                log::warn!("metrics: cannot start a connection thread: {e}");
            }
        }
    }

    /// Connects to the listener until the accepting thread has noticed the shutdown.
    fn wake_accept(&self, stopped: &AtomicBool) {
        let Ok(mut addr) = self.local_addr() else {
            return;
        };
        match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => addr.set_ip(Ipv4Addr::LOCALHOST.into()),
            IpAddr::V6(ip) if ip.is_unspecified() => addr.set_ip(Ipv6Addr::LOCALHOST.into()),
            _ => {}
        }
        let mut warned = false;
        while !stopped.load(Relaxed) {
            if let Err(e) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                if !warned {
                    log::warn!("metrics: cannot reach {addr} to stop the listener: {e}; retrying");
                    warned = true;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One request, one answer, close. Errors writing mean the client went away: there
    /// is nobody left to tell, so they are dropped.
    fn serve(&self, mut stream: TcpStream, id: u64) {
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
        let deadline = Instant::now() + REQUEST_DEADLINE;
        let waiting = |w: bool, started: bool| self.slots.waiting(id, w, started);
        let (response, head_only) = match read_request(&mut stream, deadline, &waiting) {
            Ok(req) => {
                if !self.slots.answering(id) {
                    return; // closed to make room for a newer connection
                }
                (self.route(&req), req.method == "HEAD")
            }
            Err(Some(r)) => (r, false),
            Err(None) => return,
        };
        let _ = response.write_to(&mut stream, head_only);
        let _ = stream.shutdown(Close::Write);
    }

    /// The answer to one request, by method and path.
    pub fn route(&self, req: &Request) -> Response {
        let read_only = matches!(req.method.as_str(), "GET" | "HEAD");
        match req.path.as_str() {
            "/metrics" | "/healthz" if !read_only => Response {
                allow: Some("GET, HEAD"),
                ..Response::text(405, format!("{} takes GET or HEAD\n", req.path))
            },
            "/metrics" => Response {
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                ..Response::text(200, self.render())
            },
            "/healthz" => {
                match crate::notify::healthy(self.src.stats, self.src.config, crate::now_ms())
                    .and_then(|()| self.probe.check())
                {
                    Ok(()) => Response::text(200, "ok\n"),
                    Err(why) => {
                        log::debug!("healthz: {why}");
                        Response::text(503, format!("{why}\n"))
                    }
                }
            }
            path if crate::status::serves(path) => self.status.route(req),
            _ => Response::text(404, "not found: try /, /metrics or /healthz\n"),
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
            ("delay_worker_set_jobs_total", "Jobs committed as part of a set (a handler's set form).", s.in_sets),
            ("delay_worker_dead_letters_total", "Messages sent to the dead letters by this process (workers, reader and mover), counted once the letter exists.", s.dead),
            ("delay_worker_redis_reconnects_total", "Redis outages (a connection lost or refused, then reconnecting with backoff), one per thread and outage.", src.stats.redis_reconnects.load(Relaxed)),
            ("delay_worker_inbox_pruned_total", "worker_inbox rows older than --inbox-retention deleted by this process.", src.stats.inbox_pruned.load(Relaxed)),
            ("delay_worker_lost_data_total", "Pool members whose data vanished (the data hash gone: an evicting Redis or a deletion), each dead-lettered as lost data by this process's mover.", src.stats.lost_data.load(Relaxed)),
            ("delay_worker_producer_clock_ahead_total", "Messages whose ts was more than 1s later than their arrival on Redis's clock: a producer's clock runs ahead.", src.stats.clock.producer_ahead()),
        ] {
            sample(&mut out, name, "counter", help, v);
        }
        let clock = src.stats.clock.offset();
        for (name, help, v) in [
            ("delay_worker_clock_offset_seconds", "This host's clock to Redis's (redis = host + offset; negative: this host is ahead), as last measured with TIME round trips; 0 before the first.", clock.map_or(0.0, |o| o.offset_ms as f64 / 1000.0)),
            ("delay_worker_clock_offset_error_seconds", "Error bound of that offset (half the quickest round trip); -1 before the first measurement.", clock.map_or(-1.0, |o| o.error_ms as f64 / 1000.0)),
            ("delay_worker_producer_clock_lead_max_seconds", "The largest lead of a message's ts over its arrival on Redis's clock seen since start.", src.stats.clock.producer_lead_max_ms() as f64 / 1000.0),
        ] {
            sample(&mut out, name, "gauge", help, v);
        }
        let state = src.pool.state();
        let now = crate::now_ms();
        let live = crate::notify::live(src.stats, src.config, now).is_ok();
        let healthy = crate::notify::healthy(src.stats, src.config, now).is_ok();
        // Due times are on the shared clock (Redis's).
        let shared_now = src.stats.clock.now_ms();
        let (waiting, longest) = src.stats.contention.summary(shared_now);
        let longest_s = longest.map_or(0, |w| ((shared_now - w.since_ms).max(0) / 1000) as u64);
        for (name, help, v) in [
            ("delay_worker_channel_depth", "Messages read and waiting for a worker.", (src.depth)() as u64),
            ("delay_worker_channel_capacity", "Capacity of the reader -> pool channel.", src.capacity as u64),
            ("delay_worker_db_pool_connections", "Open connections of the workers' PostgreSQL pool.", state.connections as u64),
            ("delay_worker_db_pool_idle_connections", "Idle connections of the workers' PostgreSQL pool.", state.idle_connections as u64),
            ("delay_worker_db_pool_max_connections", "Size of the workers' PostgreSQL pool (one per worker thread).", src.pool.max_size() as u64),
            ("delay_worker_workers_waiting_for_db", "Workers holding a job while they cannot get a PostgreSQL connection.", src.stats.db_waiting.load(Relaxed)),
            ("delay_worker_live", "1 while the reader, mover and workers make progress (the systemd watchdog's verdict), else 0.", live as u64),
            ("delay_worker_healthy", "1 while /healthz would say ok before its probe of both servers (live, no job held by a schema fault, PostgreSQL writable, dead letters under --dead-rate-crit), else 0.", healthy as u64),
            ("delay_worker_jobs_waiting_on_contention", "Jobs this process sent back to the pool after contention (another transaction's lock, a deadlock) that have not run since.", waiting as u64),
            ("delay_worker_contention_longest_wait_seconds", "How long the job waiting longest on contention has waited since its due time.", longest_s),
            ("delay_worker_yielding", "1 while the shop's own sessions are busy in the database and the workers yield (one transaction at a time), else 0.", src.manners.yielding() as u64),
            ("delay_worker_dead_letters_last_minute", "Dead letters this process wrote in about the last minute (/healthz is 503 above --dead-rate-crit).", src.stats.jobs.dead_last_minute(now)),
        ] {
            sample(&mut out, name, "gauge", help, v);
        }
        self.render_queue(&mut out);
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

impl Server<'_> {
    /// The queue's own figures, as `worker stats` reads them (one connection of the
    /// scrape's own, two pipelined round trips, bounded by [`PROBE_IO_TIMEOUT`]): the same
    /// for every worker process of one queue, so alert rules take `max` over them.
    /// `delay_worker_queue_up` is 0 when they could not be read.
    fn render_queue(&self, out: &mut String) {
        let src = &self.src;
        let report = store::connect_with(src.redis, PROBE_IO_TIMEOUT)
            .map_err(|e| e.to_string())
            .and_then(|mut con| {
                crate::admin::stats::redis_now_ms(&mut con, src.config)
                    .and_then(|now| {
                        crate::admin::stats::gather_all(
                            &mut con,
                            src.config,
                            now,
                            QUEUE_DEAD_WINDOW,
                        )
                    })
                    .map_err(|e| e.to_string())
            });
        let r = match report {
            Ok(r) => r,
            Err(e) => {
                log::debug!("metrics: queue figures unavailable: {e}");
                sample(out, "delay_worker_queue_up", "gauge", QUEUE_UP_HELP, 0);
                return;
            }
        };
        sample(out, "delay_worker_queue_up", "gauge", QUEUE_UP_HELP, 1);
        let secs = |ms: Option<i64>| ms.unwrap_or(0).max(0) as f64 / 1000.0;
        let g = &r.group;
        for (name, help, v) in [
            (
                "delay_worker_stream_pending",
                "Stream entries delivered to the group and not yet acknowledged (XPENDING).",
                g.pending as f64,
            ),
            (
                "delay_worker_stream_oldest_pending_seconds",
                "Age of the oldest pending stream entry (0 when none is pending).",
                secs(g.oldest_pending_age_ms),
            ),
            (
                "delay_worker_stream_lag",
                "Stream entries not yet delivered to the group (0 when Redis cannot tell).",
                g.lag.unwrap_or(0) as f64,
            ),
            (
                "delay_worker_pool_size",
                "Members scheduled in the delay pool.",
                r.pool.size as f64,
            ),
            (
                "delay_worker_pool_due",
                "Members due now but not moved yet.",
                r.pool.due as f64,
            ),
            (
                "delay_worker_mover_lag_seconds",
                "How overdue the oldest due member of the delay pool is (0 when nothing is due).",
                r.pool.mover_lag_ms.max(0) as f64 / 1000.0,
            ),
            (
                "delay_worker_dead_letters",
                "Dead letters kept in the dead-letter stream (XLEN).",
                r.dead.length as f64,
            ),
            (
                "delay_worker_dead_letters_recent",
                "Dead letters of the dead-letter stream written within the last 5 minutes.",
                r.dead.new as f64,
            ),
            (
                "delay_worker_live_workers",
                "Workers of this queue with a live heartbeat (every host's; 0 means none runs).",
                r.workers.len() as f64,
            ),
        ] {
            sample(out, name, "gauge", help, v);
        }
        if r.queues.is_empty() {
            return;
        }
        let labelled =
            |out: &mut String,
             name: &str,
             help: &str,
             value: &dyn Fn(&crate::admin::stats::QueueFigures) -> f64| {
                crate::stats::header(out, name, "gauge", help);
                for q in &r.queues {
                    let _ = writeln!(
                        out,
                        "{name}{{queue=\"{}\"}} {}",
                        crate::stats::escape(&q.name),
                        value(q)
                    );
                }
            };
        labelled(
            out,
            "delay_worker_list_queue_length",
            "List mode: messages waiting in the queue.",
            &|q| q.length as f64,
        );
        labelled(
            out,
            "delay_worker_list_queue_oldest_seconds",
            "List mode: how long the queue's oldest message has waited (0 when empty or unknown).",
            &|q| secs(q.oldest_age_ms),
        );
        labelled(
            out,
            "delay_worker_list_dead",
            "List mode: letters in the queue's dead list.",
            &|q| q.dead as f64,
        );
        labelled(
            out,
            "delay_worker_list_dead_recent",
            "List mode: letters of the queue's dead list written within the last 5 minutes.",
            &|q| q.dead_new as f64,
        );
    }
}

const QUEUE_UP_HELP: &str =
    "1 when the queue figures below could be read from Redis for this scrape, else 0.";

/// Dead letters this recent count as recent in the queue figures.
const QUEUE_DEAD_WINDOW: Duration = Duration::from_secs(300);

/// The open connections: at most [`MAX_CONNECTIONS`], each with a handle to close it.
#[derive(Default)]
struct Slots {
    open: Mutex<Vec<Open>>,
    /// Signalled whenever a connection leaves.
    freed: Condvar,
    next_id: AtomicU64,
}

type OpenGuard<'a> = MutexGuard<'a, Vec<Open>>;

struct Open {
    id: u64,
    /// A second handle on the connection's socket, to close it from another thread.
    handle: TcpStream,
    since: Instant,
    state: ConnState,
    /// Its thread waits in a read for more of its request (the request is not whole).
    waiting: bool,
    /// Part of its request has come.
    started: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Still receiving its request: may be closed to make room.
    Reading,
    Answering,
    /// Closed from outside; its thread is on its way out.
    Closed,
}

/// Leaves the slot when the connection thread ends, however it ends.
struct Leave<'a>(&'a Slots, u64);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

impl Slots {
    fn lock(&self) -> OpenGuard<'_> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for `stream`, closing the connection that has been reading its request the
    /// longest (at least [`STALLED`]) when none is free, or, for a connection that has
    /// sent its whole request head, the oldest one whose thread waits for more of its
    /// request; `None` when every slot is answering or has just connected.
    fn admit(&self, stream: &TcpStream) -> Option<u64> {
        let handle = stream.try_clone().ok()?;
        let mut open = self.lock();
        if open.len() >= MAX_CONNECTIONS {
            // Only a client that is slow to send: one whose request is merely not parsed
            // yet (its thread not scheduled) is left to be answered.
            let stalled = open
                .iter()
                .enumerate()
                .filter(|(_, o)| o.state == ConnState::Reading && o.since.elapsed() >= STALLED)
                .min_by_key(|(_, o)| o.since)
                .map(|(i, _)| i);
            let victim = match stalled {
                Some(i) => Some(i),
                None => {
                    drop(open);
                    let (guard, i) = self.waiting_for_more(stream)?;
                    open = guard;
                    i
                }
            };
            if let Some(i) = victim {
                let victim = &mut open[i];
                victim.state = ConnState::Closed;
                // Its blocked read returns at once, and its thread leaves.
                let _ = victim.handle.shutdown(Close::Both);
                log::debug!(
                    "metrics: closed a connection that sent no whole request, to make room"
                );
                open = match self
                    .freed
                    .wait_timeout_while(open, EVICT_WAIT, |o| o.len() >= MAX_CONNECTIONS)
                {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
            if open.len() >= MAX_CONNECTIONS {
                return None;
            }
        }
        let id = self.next_id.fetch_add(1, Relaxed);
        open.push(Open {
            id,
            handle,
            since: Instant::now(),
            state: ConnState::Reading,
            waiting: false,
            started: false,
        });
        Some(id)
    }

    /// When every slot is young and `stream` has sent its whole request head within
    /// [`WHOLE_HEAD_WAIT`]: the connection to close for it, the oldest whose thread waits
    /// in a read with nothing unread on its socket (its request is not whole and no more of
    /// it has come) and that has sent part of a request or nothing for [`SILENT`] (one
    /// that has just connected may be a whole request on its way), returned with the lock
    /// held; no connection when a slot came free meanwhile. Looks again for
    /// [`EVICT_WAIT`], since a flood's threads may not have reached their read yet (so in
    /// a flood of whole requests a new one waits that long before its `503`). `None` when `stream` has not sent a whole head, or no
    /// connection waits so.
    fn waiting_for_more(&self, stream: &TcpStream) -> Option<(OpenGuard<'_>, Option<usize>)> {
        if !whole_head(stream, WHOLE_HEAD_WAIT) {
            return None;
        }
        let until = Instant::now() + EVICT_WAIT;
        loop {
            let open = self.lock();
            if open.len() < MAX_CONNECTIONS {
                return Some((open, None));
            }
            let victim = open
                .iter()
                .enumerate()
                .filter(|(_, o)| {
                    o.state == ConnState::Reading
                        && o.waiting
                        && (o.started || o.since.elapsed() >= SILENT)
                        && !unread(&o.handle)
                })
                .min_by_key(|(_, o)| o.since)
                .map(|(i, _)| i);
            if victim.is_some() {
                return Some((open, victim));
            }
            if Instant::now() >= until {
                return None;
            }
            drop(open);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its thread is about to wait in a read for (more of) its request, or is back;
    /// `started`: part of the request has come.
    fn waiting(&self, id: u64, waiting: bool, started: bool) {
        if let Some(o) = self.lock().iter_mut().find(|o| o.id == id) {
            o.waiting = waiting;
            o.started = started;
        }
    }

    /// The connection has its request: from now on it is not closed to make room.
    /// `false` if it was closed already.
    fn answering(&self, id: u64) -> bool {
        let mut open = self.lock();
        match open.iter_mut().find(|o| o.id == id) {
            Some(o) if o.state == ConnState::Reading => {
                o.state = ConnState::Answering;
                true
            }
            _ => false,
        }
    }

    fn leave(&self, id: u64) {
        self.lock().retain(|o| o.id != id);
        self.freed.notify_all();
    }

    /// At shutdown: every open connection's blocked read or write returns at once.
    fn close_all(&self) {
        for o in self.lock().iter_mut() {
            o.state = ConnState::Closed;
            let _ = o.handle.shutdown(Close::Both);
        }
    }
}

/// What is in `stream`'s receive buffer, up to `buf`'s length, without taking it and
/// without waiting; 0 when nothing is (or the peer closed).
fn peek_now(stream: &TcpStream, buf: &mut [u8]) -> usize {
    use std::os::fd::AsRawFd;
    // SAFETY: `buf` is valid for writes of its length; MSG_PEEK leaves the data queued and
    // MSG_DONTWAIT makes this one call non-blocking without changing the socket's mode,
    // which its connection thread shares.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).unwrap_or(0)
}

/// Data has come on `stream` that nobody has read yet.
fn unread(stream: &TcpStream) -> bool {
    peek_now(stream, &mut [0u8; 1]) > 0
}

/// `stream` has sent a whole request head (up to its blank line) within `wait`.
fn whole_head(stream: &TcpStream, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    let mut buf = vec![0u8; MAX_HEAD];
    loop {
        let n = peek_now(stream, &mut buf);
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            return true;
        }
        if n == buf.len() || Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `503` at once for a connection no slot can take. Never blocks: whatever the client
/// sent already is read first (closing a socket with unread data resets it, and the
/// answer with it), the answer goes into the socket's buffer, and the connection closes.
fn refuse(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = stream.read(&mut [0u8; 4096]);
    let _ = Response::text(503, "busy: every connection is being answered; try again\n")
        .write_to(&mut stream, false);
    let _ = stream.shutdown(Close::Write);
}

/// Reads one request by `deadline`. `Err(Some(answer))` for a request that is malformed,
/// too large or incomplete at the deadline; `Err(None)` when there is nobody to answer (the
/// client sent nothing, or closed, or the connection was closed from outside).
/// `waiting` is told when a read waits for (more of) the request, and when it is back,
/// and whether part of the request has come.
fn read_request(
    stream: &mut TcpStream,
    deadline: Instant,
    waiting: &dyn Fn(bool, bool),
) -> Result<Request, Option<Response>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut head = httparse::Request::new(&mut headers);
        match head.parse(&buf) {
            Ok(httparse::Status::Complete(len)) if len <= MAX_HEAD => {
                let request = parse_head(&head)?;
                let body_len = content_length(&head)?;
                let mut body = buf.split_off(len);
                while body.len() < body_len {
                    let n = read_some(stream, &mut chunk, deadline, true, waiting)?;
                    body.extend_from_slice(&chunk[..n]);
                }
                body.truncate(body_len);
                return Ok(Request { body, ..request });
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(_) | Err(httparse::Error::TooManyHeaders) => {
                return Err(Some(Response::text(
                    431,
                    format!("request head over {MAX_HEAD} bytes or {MAX_HEADERS} headers\n"),
                )))
            }
            Err(e) => {
                return Err(Some(Response::text(
                    400,
                    format!("not an HTTP request: {e}\n"),
                )))
            }
        }
        let n = read_some(stream, &mut chunk, deadline, !buf.is_empty(), waiting)?;
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Method, path, query and content type of a complete head.
fn parse_head(head: &httparse::Request) -> Result<Request, Option<Response>> {
    let (Some(method), Some(target)) = (head.method, head.path) else {
        return Err(Some(Response::text(400, "not an HTTP request\n")));
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers: Vec<(String, String)> = head
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_ascii_lowercase(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    let content_type = headers
        .iter()
        .find(|(n, _)| n == "content-type")
        .map(|(_, v)| v.clone());
    Ok(Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        content_type,
        headers,
        body: Vec::new(),
    })
}

/// The body's length from `Content-Length` (0 without one); chunked bodies are refused.
fn content_length(head: &httparse::Request) -> Result<usize, Option<Response>> {
    let header = |name: &str| {
        head.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
    };
    if header("transfer-encoding").is_some() {
        return Err(Some(Response::text(
            501,
            "request bodies must come with Content-Length\n",
        )));
    }
    match header("content-length").map(|v| v.parse::<usize>()) {
        None => Ok(0),
        Some(Ok(n)) if n <= MAX_BODY => Ok(n),
        Some(Ok(n)) => Err(Some(Response::text(
            413,
            format!("request body of {n} bytes, limit {MAX_BODY}\n"),
        ))),
        Some(Err(_)) => Err(Some(Response::text(400, "bad Content-Length\n"))),
    }
}

/// One read, given the time left until `deadline`. `started`: the client has sent part of
/// a request, so running out of time is a `408`; otherwise the connection just closes.
fn read_some(
    stream: &mut TcpStream,
    chunk: &mut [u8],
    deadline: Instant,
    started: bool,
    waiting: &dyn Fn(bool, bool),
) -> Result<usize, Option<Response>> {
    let late = || {
        started.then(|| {
            Response::text(
                408,
                format!(
                    "the request did not arrive within {}s\n",
                    REQUEST_DEADLINE.as_secs_f64()
                ),
            )
        })
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        let _ = stream.set_read_timeout(Some(left));
        waiting(true, started);
        let read = stream.read(chunk);
        waiting(false, true);
        match read {
            Ok(0) => return Err(None),
            Ok(n) => return Ok(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(late())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(None),
        }
    }
}

/// The `/healthz` check: Redis answers PING, and PostgreSQL accepts a new connection
/// (what a restarted worker needs; the workers' pool has none to spare, see
/// `Sources::pool`) that answers `SELECT 1`. A fresh connection also gives the server's
/// own reason when it refuses, where a pool would only time out.
///
/// It runs on a short-lived thread of its own: a server that accepts connections but
/// never answers (stopped, or a network black hole) must cost a 503 after
/// [`HEALTH_TIMEOUT`], not a connection thread stuck in a read. That thread is not joined
/// for the same reason; it ends by itself when its socket times out or errors. One check
/// runs at a time: a request that comes while one runs waits for that one's result
/// (so two probes at the same moment both get the answer, and a hung server costs one
/// thread, not one per request).
struct Probe {
    redis: crate::store::Redis,
    pg: db::Target,
    shared: Arc<ProbeShared>,
}

#[derive(Default)]
struct ProbeShared {
    state: Mutex<ProbeState>,
    /// Signalled when a check ends.
    done: Condvar,
}

#[derive(Default)]
struct ProbeState {
    /// The number of the check that is running, if one is.
    running: Option<u64>,
    /// The number of the last check started.
    started: u64,
    /// The last check that ended: its number and result.
    last: Option<(u64, Result<(), String>)>,
}

impl Probe {
    fn check(&self) -> Result<(), String> {
        let shared = &self.shared;
        let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let number = match st.running {
            Some(n) => n,
            None => {
                st.started += 1;
                let n = st.started;
                let (redis, pg, sh) = (self.redis.clone(), self.pg.clone(), shared.clone());
                std::thread::Builder::new()
                    .name("healthz".into())
                    .spawn(move || {
                        let r = probe(&redis, &pg);
                        let mut st = sh.state.lock().unwrap_or_else(|p| p.into_inner());
                        st.running = None;
                        st.last = Some((n, r));
                        sh.done.notify_all();
                    })
                    .map_err(|e| format!("cannot start the health check: {e}"))?;
                st.running = Some(n);
                n
            }
        };
        let ended = |st: &ProbeState| matches!(&st.last, Some((n, _)) if *n == number);
        let st = match shared
            .done
            .wait_timeout_while(st, HEALTH_TIMEOUT, |st| !ended(st))
        {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
        match &st.last {
            Some((n, r)) if *n == number => r.clone(),
            _ => Err(format!(
                "no answer from Redis or PostgreSQL within {}s",
                HEALTH_TIMEOUT.as_secs()
            )),
        }
    }
}

fn probe(redis: &crate::store::Redis, pg: &db::Target) -> Result<(), String> {
    let mut con = store::connect_with(redis, PROBE_IO_TIMEOUT)
        .map_err(|e| format!("Redis unreachable: {e}"))?;
    redis::cmd("PING")
        .query::<String>(&mut con)
        .map_err(|e| format!("Redis does not answer PING: {e}"))?;
    let mut c = pg
        .connect()
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
