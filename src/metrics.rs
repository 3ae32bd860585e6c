//! Prometheus metrics and a health check, served over plain HTTP/1.1 (`--metrics-addr`).
//!
//! The exporter over the one set of counters ([`Stats`], `stats.rs`): [`Server`], one
//! named thread in the daemon's scope. `GET /metrics` renders the counters, channel depth,
//! database pool state and resident memory in the text exposition format, and the queue's
//! own figures (`figures.rs`, as `worker stats` reads them); `GET /healthz` answers `200 ok`
//! when the health verdict holds (`health.rs`: the roles make progress, no critical
//! problem, Redis answers PING and PostgreSQL a `SELECT 1`), else `503` with the reason.
//! `/` and `/dead...` are the status page (`status/`): a connection thread hands those
//! requests to the page's own thread (`status::Page::run`, in this server's scope).
//! Routing is by method and path ([`Server::route`]); accepting, reading a request by its
//! deadlines, answering and sharing the connection slots among stalled clients is
//! `http.rs`'s.

use crate::config::Config;
use crate::db;
use crate::health::{Probe, PROBE_IO_TIMEOUT};
use crate::http::{Listener, Request, Response};
use crate::shutdown::Shutdown;
use crate::stats::{sample, Stats};
use crate::store;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
#[error("--metrics-addr {addr}: cannot listen: {source}")]
pub struct MetricsError {
    addr: SocketAddr,
    source: std::io::Error,
}

/// The role a `/healthz` probe reports PostgreSQL's want of connection slots under.
const NO_SLOT_LEFT: &str = "postgresql connections";

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
    /// The daemon's handlers, for the status page's requeue.
    pub handlers: &'a crate::handlers::Handlers,
    /// Messages waiting in the reader -> pool channel.
    pub depth: Box<dyn Fn() -> usize + Send + Sync + 'a>,
    pub capacity: usize,
}

/// The HTTP endpoint; [`Server::run`] is the thread body.
pub struct Server<'a> {
    http: Listener,
    src: Sources<'a>,
    probe: Probe,
    status: crate::status::Page<'a>,
}

impl<'a> Server<'a> {
    /// Binds now, so a port in use stops the start with one readable line. Warns when the
    /// address is not a loopback one: the endpoint has no authentication.
    pub fn bind(addr: SocketAddr, src: Sources<'a>) -> Result<Server<'a>, MetricsError> {
        let err = |source| MetricsError { addr, source };
        let http = Listener::bind(addr, "metrics").map_err(err)?;
        // The daemon checked this URL at start; a parse error here is not expected.
        let probe = Probe::new(src.redis, &src.config.database_url)
            .map_err(|e| err(std::io::Error::other(e)))?;
        if !addr.ip().to_canonical().is_loopback() {
            log::warn!(
                "metrics: --metrics-addr {addr} is not a loopback address, and /metrics and \
                 /healthz have no authentication: anyone who can reach this port can read the \
                 metrics and run the health check; bind 127.0.0.1, or a private interface \
                 behind a firewall"
            );
        }
        Ok(Server {
            http,
            probe,
            status: crate::status::Page::new(
                src.config,
                src.stats,
                src.handlers,
                src.redis.clone(),
            ),
            src,
        })
    }

    /// The address actually bound (port 0 picks one).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.http.local_addr()
    }

    /// Serves until shutdown (see `http.rs` for how it stops).
    pub fn run(&self, shutdown: &Shutdown) {
        if let Ok(a) = self.local_addr() {
            log::info!(
                "metrics: serving http://{a}/metrics, /healthz and the status page http://{a}/ ({})",
                self.status.mode()
            );
        }
        let route = |req: &Request| self.route(req);
        std::thread::scope(|s| {
            if !self.http.start_stopper(s, shutdown) {
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
            self.http.serve(s, shutdown, &route);
        });
        log::debug!("metrics: stopped");
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
                match crate::health::healthy(self.src.stats, self.src.config, crate::now_ms())
                    .and_then(|()| self.probe.check())
                {
                    Ok(crate::health::Probed::Fine) => {
                        // Slots free again: `stats --check` and the status page follow at
                        // the next heartbeat, not when the warning would have lapsed.
                        if self.src.stats.clear_problem(NO_SLOT_LEFT, i64::MAX) {
                            log::info!("{NO_SLOT_LEFT}: a new session can be had again");
                        }
                        Response::text(200, "ok\n")
                    }
                    Ok(crate::health::Probed::NoSlotLeft(what)) => {
                        // `stats --check` and the status page read it from the record.
                        if self.src.stats.report_trouble(NO_SLOT_LEFT, what.clone()) {
                            log::warn!("{NO_SLOT_LEFT}: {what}");
                        }
                        Response::text(200, format!("ok, but {what}\n"))
                    }
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
        let verdict = crate::health::Verdict::of(src.stats, src.config, now);
        let (live, healthy) = (verdict.live.is_ok(), verdict.healthy.is_ok());
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
            ("delay_worker_shop_held_up_seconds", "How long the shop's session waiting longest for a lock behind one of the worker's sessions had waited at the PostgreSQL watch's last look (0: none for over a second; needs pg_read_all_stats).", src.stats.shop_held_up_ms.load(Relaxed) / 1000),
            ("delay_worker_dead_letters_last_minute", "Dead letters this process wrote in the last minute (/healthz is 503 above --dead-rate-crit).", src.stats.jobs.dead_last_minute(now)),
        ] {
            sample(&mut out, name, "gauge", help, v);
        }
        self.render_queue(&mut out);
        if let Some(rss) = crate::stats::resident_memory_bytes() {
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
                crate::figures::redis_now_ms(&mut con, src.config)
                    .and_then(|now| {
                        crate::figures::gather_all(&mut con, src.config, now, QUEUE_DEAD_WINDOW)
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
             value: &dyn Fn(&crate::figures::QueueFigures) -> f64| {
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
