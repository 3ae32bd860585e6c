//! The status page: `/` on the metrics address (`--metrics-addr`), for shops that run no
//! Prometheus. Plain HTML (escaped by construction: `maud`), a small inline SVG chart, no
//! script at all (the Content-Security-Policy forbids any); the overview reloads itself
//! every 10 s with a meta refresh. Served by the metrics server's threads
//! (`metrics.rs` routes the paths of [`serves`] here).
//!
//! - `GET /`: what `worker stats` shows, read by the same code (`figures.rs`) so the
//!   figures are the same, plus this process's own last hour from its counters
//!   (`stats::History`: jobs and lateness percentiles per minute, a fixed ring).
//! - `GET /dead`: the dead letters, newest first, a page at a time, filtered by event;
//!   list mode: the dead list of one queue at a time. `GET /dead/letter`: one letter, its
//!   reason and its message pretty-printed. Both through the dead-letter model (`dead/`).
//!   With `--shards N`, every shard's letters merged newest first
//!   (`dead::newest_sharded`), ids written `<shard>/<id>` as `worker dead` writes them.
//! - `GET /trace?q=...`: the search box (in every page's header): the trace of a job key
//!   or an order number, as `worker trace` shows it (`trace.rs`).
//! - `POST /dead/requeue`, `POST /dead/purge`: only with `--admin-token-file`
//!   (`actions.rs`); without it the page is read-only, says so, and renders no form.
//!
//! **Bounded.** Pages are made one at a time by one thread of their own ([`Page::run`],
//! in the metrics server's scope): a connection thread hands its request over and waits
//! for the answer, at most [`QUEUED`] wait, and more get `503` at once, so page loads never
//! take the connection threads `/healthz` needs. One thread also keeps a page's
//! allocations in one malloc arena: made on the short-lived connection threads, they would
//! be spread over every arena of the process (two, see `main.rs`, or as many as an
//! operator's `MALLOC_ARENA_MAX` allows) and each would keep its high-water mark.
//! A page takes a Redis connection of its own (kept for the next one, at most
//! [`IDLE_CONNECTIONS`]) with a [`REDIS_TIMEOUT`] and reads a bounded amount (the figures
//! are counted up to caps; a dead-letter page looks at no more than [`DEAD_BUDGET`]
//! letters).
//!
//! Layout: `view.rs` the HTML, `chart.rs` the SVG, `actions.rs` requeue and purge with
//! their checks, `pretty.rs` a message's JSON laid out for reading.

mod actions;
mod chart;
mod pretty;
mod trace;
mod view;

use crate::config::{Config, Source};
use crate::dead;
use crate::figures::StatsReport;
use crate::http::{Request, Response};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Requests waiting for the page thread, besides the one it is making; more get `503` at
/// once (the metrics server has 16 connection threads, and `/healthz` must always find one).
pub const QUEUED: usize = 3;
/// A request waits this long for the page thread to start on it, then gets `503` and is
/// dropped (Redis stalled, and the pages ahead of it take their timeouts).
pub const PAGE_WAIT: Duration = Duration::from_secs(6);
/// Time a page load's Redis commands have in all ([`Deadline`]).
pub const REDIS_TIMEOUT: Duration = Duration::from_secs(2);
/// A new Redis connection of the page's is made within this (and each of the three
/// replies of its setup comes within it).
pub const REDIS_CONNECT: Duration = Duration::from_millis(500);
/// The shortest wait for one reply under a [`Deadline`].
const REPLY_FLOOR: Duration = Duration::from_millis(50);
/// Redis connections kept between page loads.
const IDLE_CONNECTIONS: usize = 2;
/// Dead letters shown per page.
pub const DEAD_PER_PAGE: usize = 50;
/// Dead letters a page load looks at, at most (a filter that matches few letters shows a
/// short page with a link to look further).
pub const DEAD_BUDGET: usize = 500;
/// Letters looked at, at most, to find one list letter by its id.
const FIND_BUDGET: usize = 2_000;
/// The `--dead-window` of `worker stats`: what counts as a new dead letter.
pub const DEAD_WINDOW: Duration = Duration::from_secs(300);
/// Stack of the page thread: as a worker's (Rust's default), for `serde_json` on a
/// letter's message (`message::event_of`, `pretty::json`); only what is used is resident.
pub const PAGE_STACK: usize = 2 * 1024 * 1024;
/// The overview's meta refresh.
pub const REFRESH_S: u32 = 10;

/// Whether `path` is the status page's.
pub fn serves(path: &str) -> bool {
    matches!(
        path,
        "/" | "/dead" | "/dead/letter" | "/dead/requeue" | "/dead/purge" | "/trace"
    )
}

/// The status page of one daemon.
pub struct Page<'a> {
    config: &'a Config,
    stats: &'a Stats,
    /// The daemon's handlers (SIGHUP replaces them): a requeue is held against them.
    handlers: &'a crate::handlers::Handlers,
    redis: crate::store::Redis,
    idle: Mutex<Vec<crate::store::Con>>,
    /// Requests for the page thread, and where each answer goes.
    jobs: (Sender<Job>, Receiver<Job>),
    /// Set when the page thread has stopped.
    stopped: AtomicBool,
    started: Instant,
    /// `Some` with `--admin-token-file`.
    actions: Option<actions::Actions>,
}

/// One request for the page thread.
struct Job {
    req: Request,
    reply: Sender<Response>,
    /// [`WAITING`], then [`STARTED`] by the page thread or [`ABANDONED`] by the asker,
    /// whichever comes first.
    state: Arc<AtomicU8>,
}

const WAITING: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

impl<'a> Page<'a> {
    pub fn new(
        config: &'a Config,
        stats: &'a Stats,
        handlers: &'a crate::handlers::Handlers,
        redis: crate::store::Redis,
    ) -> Page<'a> {
        Page {
            config,
            stats,
            handlers,
            redis,
            idle: Mutex::new(Vec::new()),
            jobs: crossbeam_channel::bounded(QUEUED),
            stopped: AtomicBool::new(false),
            started: Instant::now(),
            actions: config.admin_token.clone().map(actions::Actions::new),
        }
    }

    /// The handlers now (a requeue is held against them).
    fn registry(&self) -> std::sync::Arc<crate::handlers::Registry> {
        self.handlers.current().0
    }

    /// What a requeue from the page is held against: the same refusal as `worker dead
    /// requeue`, never forced.
    fn screen<'r>(&self, registry: &'r crate::handlers::Registry) -> crate::dead::Screen<'r> {
        crate::dead::Screen {
            registry,
            new_event: None,
            limit: self.config.jobs.max_message_bytes,
            force: false,
            served: &[],
        }
    }

    /// For the start's log line.
    pub fn mode(&self) -> &'static str {
        if self.actions.is_some() {
            "requeue and purge with the admin token"
        } else {
            "read-only"
        }
    }

    /// The answer to one request of a path [`serves`] names: a wrong method at once,
    /// anything else from the page thread.
    pub fn route(&self, req: &Request) -> Response {
        let read = matches!(req.method.as_str(), "GET" | "HEAD");
        let path = req.path.as_str();
        let action = matches!(path, "/dead/requeue" | "/dead/purge");
        if (action && req.method != "POST") || (!action && !read) {
            let allow = if action { "POST" } else { "GET, HEAD" };
            return Response {
                allow: Some(allow),
                ..Response::text(405, format!("{path} takes {allow}\n"))
            };
        }
        if let Err(why) = host_allowed(req.header("host"), &self.config.status_hosts) {
            return Response::text(421, why);
        }
        if self.stopped.load(SeqCst) {
            return Response::text(503, "stopping\n");
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        let state = Arc::new(AtomicU8::new(WAITING));
        let job = Job {
            req: req.clone(),
            reply,
            state: state.clone(),
        };
        if self.jobs.0.try_send(job).is_err() {
            if action {
                log::warn!("status page: refused POST {path}: the page is busy; nothing was done");
            }
            return Response::text(
                503,
                "the status page is busy (other pages are being made); try again\n",
            );
        }
        let deadline = Instant::now() + PAGE_WAIT;
        loop {
            match answer.recv_timeout(Duration::from_millis(100)) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Disconnected) => {
                    return Response::text(503, "stopping\n");
                }
                // Once the page thread has started on it, its answer is awaited whatever
                // the time (an action it runs is not to be reported as not done); its
                // Redis timeouts bound it.
                Err(RecvTimeoutError::Timeout) => {
                    let late = Instant::now() >= deadline || self.stopped.load(SeqCst);
                    if late
                        && state
                            .compare_exchange(WAITING, ABANDONED, SeqCst, SeqCst)
                            .is_ok()
                    {
                        if action {
                            log::warn!(
                                "status page: dropped POST {path}: not started within {}s; nothing was done",
                                PAGE_WAIT.as_secs()
                            );
                        }
                        return Response::text(
                            503,
                            format!(
                                "the status page did not start on this within {}s (Redis slow?); nothing was done; try again\n",
                                PAGE_WAIT.as_secs()
                            ),
                        );
                    }
                }
            }
        }
    }

    /// The page thread: makes the pages asked for, one at a time, until shutdown; a
    /// request whose asker gave up waiting is skipped (an action in it is not run).
    pub fn run(&self, shutdown: &Shutdown) {
        loop {
            crossbeam_channel::select! {
                recv(self.jobs.1) -> job => match job {
                    Ok(job) => {
                        if job.state.compare_exchange(WAITING, STARTED, SeqCst, SeqCst).is_ok() {
                            let _ = job.reply.send(self.make_or_500(&job.req));
                        }
                    }
                    Err(_) => break,
                },
                recv(shutdown.receiver()) -> _ => break,
            }
        }
        // Whoever still waits is told at once (their reply channels close).
        self.stopped.store(true, SeqCst);
        while self.jobs.1.try_recv().is_ok() {}
    }

    /// One page; a page that panicked is a 500 and a log line, and the page thread goes
    /// on serving the next (a connection in use is dropped with the unwinding, never
    /// reused).
    fn make_or_500(&self, req: &Request) -> Response {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.make(req))).unwrap_or_else(
            |panic| {
                log::error!(
                    "status page: {} {} failed: {}",
                    req.method,
                    req.path,
                    crate::text::panic_text(&*panic)
                );
                Response::text(500, "this page failed; the worker's log says why\n")
            },
        )
    }

    /// One page.
    fn make(&self, req: &Request) -> Response {
        let query: Vec<(String, String)> = form_urlencoded::parse(req.query.as_bytes())
            .into_owned()
            .collect();
        let arg = |name: &str| {
            query
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
                .filter(|v| !v.is_empty())
        };
        let path = req.path.as_str();
        match path {
            "/" => self.overview(),
            "/dead" => self.dead_list(
                arg("event"),
                arg("queue"),
                arg("before"),
                (arg("at"), arg("after"), arg("older")),
            ),
            "/dead/letter" => self.letter(arg("id"), arg("queue"), arg("at")),
            "/trace" => self.trace(arg("q")),
            _ => match &self.actions {
                Some(a) => a.handle(self, req),
                None => {
                    log::warn!(
                        "status page: refused {} {path}: the page is read-only (no --admin-token-file)",
                        req.method
                    );
                    Response::text(
                        403,
                        "the status page is read-only: start the worker with --admin-token-file to requeue or purge here\n",
                    )
                }
            },
        }
    }

    /// Runs `f` on a Redis connection of the page's own: an idle one, or a new one made
    /// within [`REDIS_CONNECT`]. All of `f`'s commands get [`REDIS_TIMEOUT`] together
    /// ([`Deadline`]). A connection that failed is dropped, not kept.
    fn with_redis<T>(
        &self,
        f: impl FnOnce(&mut Deadline) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut con = match idle {
            Some(c) => c,
            None => self
                .redis
                .connect_within(REDIS_CONNECT, REDIS_TIMEOUT)
                .map_err(|e| anyhow::anyhow!("cannot reach Redis: {e}"))?,
        };
        let r = f(&mut Deadline {
            con: &mut con,
            until: Instant::now() + REDIS_TIMEOUT,
        });
        if r.is_ok() {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < IDLE_CONNECTIONS {
                idle.push(con);
            }
        }
        r
    }

    fn overview(&self) -> Response {
        let now = crate::now_ms();
        let report: Result<StatsReport, String> = self
            .with_redis(|con| {
                // Ages and lags on Redis's clock, as `worker stats` reads them.
                let redis_now = crate::figures::redis_now_ms(con, self.config)?;
                Ok(crate::figures::gather_all(
                    con,
                    self.config,
                    redis_now,
                    DEAD_WINDOW,
                )?)
            })
            .map_err(|e| self.explain(&e));
        if let Err(e) = &report {
            log::debug!("status page: {e}");
        }
        let verdict = crate::health::Verdict::of(self.stats, self.config, now);
        let v = view::Overview {
            config: self.config,
            report: &report,
            hour: &self.stats.jobs.last_hour(now),
            totals: &self.stats.snapshot(),
            alerts: verdict.alerts(),
            live: verdict.live,
            contention: self.stats.contention.summary(self.stats.clock.now_ms()),
            uptime: self.started.elapsed(),
            rss: crate::stats::resident_memory_bytes(),
            now_ms: now,
            actions: self.actions.is_some(),
        };
        html(200, view::overview(&v))
    }

    /// The queue a `queue` argument names (list mode); the first one without.
    fn queue(&self, name: Option<&str>) -> Option<&crate::keys::Queue> {
        let queues = &self.config.keys.queues;
        match name {
            Some(n) => queues.iter().find(|q| q.name == n),
            None => queues.first(),
        }
    }

    fn dead_list(
        &self,
        event: Option<&str>,
        queue: Option<&str>,
        before: Option<&str>,
        (at, after, older): (Option<&str>, Option<&str>, Option<&str>),
    ) -> Response {
        let now = crate::now_ms();
        let filter = dead::Filter {
            event: event.map(str::to_string),
            ..Default::default()
        };
        let actions = self.actions.as_ref().map(|a| a.nonce());
        let page = if self.config.source == Source::List {
            let Some(q) = self.queue(queue) else {
                return not_found("no such queue");
            };
            // `after` and `older`: where the previous page ended (`Older →`); `at`: a
            // position from the head.
            let from = match (after, older, at) {
                // A list holds at most 2^32 - 1 letters.
                (Some(id), Some(n), _) => match (dead::list::parse_id(id), n.parse::<u32>()) {
                    (Ok(id), Ok(n)) => dead::list::Start::After(dead::list::After {
                        id,
                        older: n as usize,
                    }),
                    _ => return bad_request("after, older: not a list dead-letter id and a count"),
                },
                (Some(_), None, _) | (None, Some(_), _) => {
                    return bad_request("after and older go together")
                }
                (None, None, None) => dead::list::Start::Head(0),
                (None, None, Some(n)) => match n.parse::<u32>() {
                    Ok(n) => dead::list::Start::Head(n as usize),
                    Err(_) => return bad_request("at: not a position"),
                },
            };
            let read = self.with_redis(|con| {
                // Another queue's dead list of the wrong type counts 0 here and does not
                // keep this queue's letters from being shown.
                let mut p = redis::pipe();
                p.ignore_errors();
                for q in &self.config.keys.queues {
                    p.cmd("LLEN").arg(&q.dead);
                }
                let lengths: Vec<redis::RedisResult<u64>> = p.query(con)?;
                let lengths: Vec<u64> = lengths.into_iter().map(|n| n.unwrap_or(0)).collect();
                let page =
                    dead::list::newest(con, q, &filter, now, &from, DEAD_PER_PAGE, DEAD_BUDGET)?;
                Ok((lengths, page))
            });
            match read {
                Ok((lengths, page)) => view::dead_list_mode(&view::DeadListMode {
                    queues: self
                        .config
                        .keys
                        .queues
                        .iter()
                        .map(|q| q.name.as_str())
                        .zip(lengths)
                        .collect(),
                    queue: &q.name,
                    event,
                    older_page: from != dead::list::Start::Head(0),
                    page: &page,
                    nonce: actions,
                }),
                Err(e) => return self.unavailable(&e),
            }
        } else if self.config.shards > 1 {
            return self.dead_shards(&filter, event, before, now, actions);
        } else {
            if before.is_some_and(|b| !crate::store::stream::is_stream_id(b)) {
                return bad_request("before: not a dead-letter id");
            }
            let read = self.with_redis(|con| {
                let length: u64 = redis::cmd("XLEN").arg(&self.config.keys.dead).query(con)?;
                let (letters, next) = dead::newest(
                    con,
                    &self.config.keys,
                    &filter,
                    now,
                    before,
                    DEAD_PER_PAGE,
                    DEAD_BUDGET,
                )?;
                Ok((length, letters, next))
            });
            match read {
                Ok((length, letters, next)) => view::dead_stream(&view::DeadStream {
                    streams: &[(self.config.keys.dead.clone(), length)],
                    event,
                    before,
                    letters: &letters.into_iter().map(|d| (None, d)).collect::<Vec<_>>(),
                    next,
                    nonce: actions,
                    broken: &[],
                }),
                Err(e) => return self.unavailable(&e),
            }
        };
        html(200, page)
    }

    /// `/dead` with `--shards N`: every shard's letters merged newest first, ids written
    /// `<shard>/<id>`; `before` is such an id too, the place the previous page ended.
    fn dead_shards(
        &self,
        filter: &dead::Filter,
        event: Option<&str>,
        before: Option<&str>,
        now: i64,
        nonce: Option<&str>,
    ) -> Response {
        let shards = &self.config.derived.shards;
        let place = match before.map(|b| b.split_once('/')) {
            None => None,
            Some(Some((s, id))) => match s.parse::<usize>() {
                Ok(s) if s < shards.len() && crate::store::stream::is_stream_id(id) => {
                    Some((s, id))
                }
                _ => return bad_request("before: not a dead-letter id (<shard>/<id>)"),
            },
            Some(None) => return bad_request("before: not a dead-letter id (<shard>/<id>)"),
        };
        let read = self.with_redis(|con| {
            // A shard whose dead-letter key holds another type is left out, and named:
            // the other shards' letters are still shown. Its type and length in one
            // round trip (XLEN fails on the other types, so errors are taken per command).
            let mut p = redis::pipe();
            p.ignore_errors();
            for k in shards {
                p.cmd("TYPE").arg(&k.dead).cmd("XLEN").arg(&k.dead);
            }
            let answers: Vec<redis::RedisResult<redis::Value>> = p.query(con)?;
            let mut answers = answers.into_iter();
            let mut readable = Vec::new();
            let mut broken = Vec::new();
            let mut lengths = vec![0; shards.len()];
            for (i, k) in shards.iter().enumerate() {
                let (Some(t), Some(n)) = (answers.next(), answers.next()) else {
                    break;
                };
                let t: String = redis::from_redis_value(t?)?;
                if t == "stream" || t == "none" {
                    lengths[i] = redis::from_redis_value(n?)?;
                    readable.push((i, k));
                } else {
                    broken.push(format!(
                        "key {:?} (shard {i}) holds a {t}, not a stream: its letters are \
                         neither counted nor shown; rename or remove the key",
                        k.dead
                    ));
                }
            }
            let (letters, next) = dead::newest_sharded(
                con,
                &readable,
                filter,
                now,
                place,
                DEAD_PER_PAGE,
                DEAD_BUDGET,
            )?;
            Ok((lengths, broken, letters, next))
        });
        match read {
            Ok((lengths, broken, letters, next)) => {
                let streams: Vec<(String, u64)> =
                    shards.iter().map(|k| k.dead.clone()).zip(lengths).collect();
                let letters: Vec<(Option<usize>, dead::DeadLetter)> =
                    letters.into_iter().map(|(s, d)| (Some(s), d)).collect();
                html(
                    200,
                    view::dead_stream(&view::DeadStream {
                        streams: &streams,
                        event,
                        before,
                        letters: &letters,
                        next: next.map(|(s, id)| dead::shard_id(s, &id)),
                        nonce,
                        broken: &broken,
                    }),
                )
            }
            Err(e) => self.unavailable(&e),
        }
    }

    fn letter(&self, id: Option<&str>, queue: Option<&str>, at: Option<&str>) -> Response {
        let now = crate::now_ms();
        let Some(id) = id else {
            return bad_request("id: which dead letter?");
        };
        let nonce = self.actions.as_ref().map(|a| a.nonce());
        if self.config.source == Source::List {
            let Some(q) = self.queue(queue) else {
                return not_found("no such queue");
            };
            let Ok(id) = dead::list::parse_id(id) else {
                return bad_request("id: not a list dead-letter id");
            };
            let near = at.and_then(|a| a.parse().ok()).unwrap_or(0);
            let ids = [id.clone()];
            let found = self.with_redis(|con| {
                Ok(dead::list::find_near(
                    con,
                    q,
                    &ids,
                    now,
                    (near, 1),
                    FIND_BUDGET,
                )?)
            });
            match found.map(|f| f.into_iter().next().flatten()) {
                Ok(Some(l)) => html(200, view::list_letter(&l, near, nonce)),
                Ok(None) => not_found(&format!(
                    "no dead letter {id} in the first {FIND_BUDGET} letters of {}",
                    q.dead
                )),
                Err(e) => self.unavailable(&e),
            }
        } else if self.config.shards > 1 {
            let shards = &self.config.derived.shards;
            let found = self.with_redis(|con| {
                Ok(match dead::locate(con, shards, id, now)? {
                    Ok((s, bare)) if crate::store::stream::is_stream_id(&bare) => {
                        let ids = [bare];
                        let d = dead::fetch(con, &shards[s], &ids, now)?;
                        Ok((s, d.into_iter().next().flatten()))
                    }
                    Ok(_) => Err(format!(
                        "id: {id:?} is not a dead-letter id (like 2/1768764300123-0)"
                    )),
                    Err(why) => Err(format!("id: {why}")),
                })
            });
            match found {
                Ok(Ok((s, Some(d)))) => html(
                    200,
                    view::stream_letter(&d, Some((s, &shards[s].dead)), nonce),
                ),
                Ok(Ok((_, None))) => not_found(&format!("no dead letter {id}")),
                Ok(Err(why)) => bad_request(&why),
                Err(e) => self.unavailable(&e),
            }
        } else {
            if !crate::store::stream::is_stream_id(id) {
                return bad_request("id: not a dead-letter id (like 1768764300123-0)");
            }
            let ids = [id.to_string()];
            match self.with_redis(|con| Ok(dead::fetch(con, &self.config.keys, &ids, now)?)) {
                Ok(found) => match found.into_iter().next().flatten() {
                    Some(d) => html(200, view::stream_letter(&d, None, nonce)),
                    None => not_found(&format!("no dead letter {id}")),
                },
                Err(e) => self.unavailable(&e),
            }
        }
    }
}

/// The status page answers only to a `Host` that is an IP address, `localhost`, or a name
/// given with `--status-host`: a web page of another site whose name an attacker points at
/// this address (DNS rebinding) is refused, so it cannot read the dead letters.
fn host_allowed(host: Option<&str>, names: &[String]) -> Result<(), String> {
    let Some(host) = host else {
        return Err("a request to the status page must name its Host\n".into());
    };
    // `name`, `name:port`, `[v6]` or `[v6]:port`, and nothing else.
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, "")) => (ip, None),
            Some((ip, tail)) => (ip, Some(tail.strip_prefix(':').unwrap_or("x"))),
            None => (rest, Some("x")),
        },
        None => match host.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        },
    };
    let port_ok = port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    if !port_ok {
        return Err(format!("not a host name with a port: {host:?}\n"));
    }
    let name = name.to_ascii_lowercase();
    if name.parse::<std::net::IpAddr>().is_ok() || name == "localhost" || names.contains(&name) {
        return Ok(());
    }
    Err(format!(
        "the status page answers to IP addresses, localhost and the names given with --status-host; start the worker with --status-host {name} to open it as {host}\n"
    ))
}

/// Headers of every HTML answer: no script may run, no other site may frame the page or
/// see where a link from it came from, and nothing is cached.
const HTML_HEADERS: [(&str, &str); 5] = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
];

fn html(status: u16, markup: maud::Markup) -> Response {
    Response {
        status,
        content_type: "text/html; charset=utf-8",
        body: markup.into_string(),
        allow: None,
        headers: HTML_HEADERS.to_vec(),
    }
}

fn bad_request(why: &str) -> Response {
    html(400, view::message("Bad request", why))
}

fn not_found(why: &str) -> Response {
    html(404, view::message("Not found", why))
}

/// Whether Redis answered `e` with an error of its own (WRONGTYPE, NOPERM, ...) rather
/// than not answering at all.
fn refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        // A pipeline's failures carry no code of their own, only their commands' texts.
        c.downcast_ref::<redis::RedisError>()
            .is_some_and(|r| r.code().is_some() || r.to_string().contains("WRONGTYPE"))
    })
}

impl Page<'_> {
    /// A read that failed, in one line: what Redis said, and when it refused because a
    /// key holds another type, which key (and shard).
    fn explain(&self, e: &anyhow::Error) -> String {
        let line = crate::text::one_line(e);
        if !refused(e) {
            return line;
        }
        let bad = self
            .with_redis(|con| Ok(crate::figures::wrong_types(con, self.config)?))
            .unwrap_or_default();
        if bad.is_empty() {
            format!("Redis refused: {line}")
        } else {
            // The key says it all; a pipeline's raw failures would only bury it.
            format!(
                "Redis refused (WRONGTYPE): {}; rename or remove the key",
                bad.join(", ")
            )
        }
    }

    /// The page of a read that failed: Redis did not answer, or refused (naming the key).
    fn unavailable(&self, e: &anyhow::Error) -> Response {
        let line = self.explain(e);
        log::debug!("status page: {line}");
        let title = if refused(e) {
            "Redis refused"
        } else {
            "Redis did not answer"
        };
        html(503, view::message(title, &line))
    }
}

/// A page's Redis connection under one deadline for all the commands of a page load.
/// Each call's socket timeout is the time left, shared among the replies it waits for:
/// redis-rs waits for every reply of a pipeline even after one timed out, so a pipeline
/// of 20 commands to a stalled Redis would otherwise take 20 timeouts. Once the time is
/// up, calls fail at once.
pub struct Deadline<'a> {
    con: &'a mut crate::store::Con,
    until: Instant,
}

impl Deadline<'_> {
    fn arm(&mut self, replies: usize) -> redis::RedisResult<()> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        let each = left / u32::try_from(replies.max(1)).unwrap_or(u32::MAX);
        self.con.set_io_timeout(each.max(REPLY_FLOOR))
    }
}

/// The error of a page load whose Redis commands ran out of time.
fn late() -> redis::RedisError {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "Redis did not answer within {} s",
            REDIS_TIMEOUT.as_secs_f64()
        ),
    )
    .into()
}

/// A timed-out read says so in words ("os error 11" says nothing to an operator).
fn worded<T>(r: redis::RedisResult<T>) -> redis::RedisResult<T> {
    r.map_err(|e| if e.is_timeout() { late() } else { e })
}

impl redis::ConnectionLike for Deadline<'_> {
    fn req_packed_command(&mut self, cmd: &[u8]) -> redis::RedisResult<redis::Value> {
        self.arm(1)?;
        worded(self.con.req_packed_command(cmd))
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> redis::RedisResult<Vec<redis::Value>> {
        self.arm(offset + count)?;
        worded(self.con.req_packed_commands(cmd, offset, count))
    }

    fn req_command(&mut self, cmd: &redis::Cmd) -> redis::RedisResult<redis::Value> {
        self.arm(1)?;
        worded(self.con.req_command(cmd))
    }

    fn get_db(&self) -> i64 {
        self.con.get_db()
    }

    fn supports_pipelining(&self) -> bool {
        self.con.supports_pipelining()
    }

    fn check_connection(&mut self) -> bool {
        self.con.check_connection()
    }

    fn is_open(&self) -> bool {
        self.con.is_open()
    }
}

#[cfg(test)]
mod tests {
    use super::host_allowed;

    #[test]
    fn the_page_answers_to_addresses_localhost_and_named_hosts() {
        let named = ["shop-1.example.com".to_string()];
        for ok in [
            "127.0.0.1:9187",
            "127.0.0.1",
            "[::1]:9187",
            "10.0.0.7:80",
            "localhost:9187",
            "LOCALHOST",
            "Shop-1.Example.com:9187",
        ] {
            assert_eq!(host_allowed(Some(ok), &named), Ok(()), "{ok}");
        }
        for bad in [
            "evil.example:9187",
            "evil.example",
            "127.0.0.1.evil.example",
            "shop-1",
            "127.0.0.1:9187@evil.example",
            "localhost:x.evil.example",
            "[::1]evil",
            "127.0.0.1:9187,evil.example",
            "[::1]:",
        ] {
            assert!(host_allowed(Some(bad), &named).is_err(), "{bad}");
        }
        assert!(host_allowed(None, &named).is_err());
    }
}
