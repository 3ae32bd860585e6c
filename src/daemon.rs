//! The daemon: checks its surroundings, starts the roles, waits for shutdown.
//!
//! [`run`] is the seam the binary and the tests share. It fails fast, with one readable
//! error, when Redis or PostgreSQL cannot be reached, the schema is not migrated, or a
//! handler's SQL does not prepare. Then it spawns, in one `std::thread::scope`, the mover,
//! the reader and `threads` workers, all named, and logs the counters every
//! `stats_interval` until shutdown. A role that panics triggers shutdown, so the others
//! stop too instead of leaving a half-dead daemon; `run` then returns the error.
//!
//! Under systemd the main thread also tells readiness, pings the watchdog while the roles
//! make progress and reports a status line (`notify.rs`); with `--metrics-addr` one more
//! thread serves `/metrics` and `/healthz` (`metrics.rs`), and unless `--inbox-retention 0`
//! one prunes old inbox rows (`prune.rs`). The watch role (`watch.rs`) measures this
//! host's clock against Redis's and looks at Redis's memory settings; a Redis whose
//! `maxmemory-policy` may evict the worker's keys is refused at start.
//!
//! The main loop also answers the operator's requests (`signals.rs`): SIGUSR1 logs the
//! state report ([`report`]), SIGHUP calls [`reload`].

use crate::config::Config;
use crate::config::MoverConfig;
use crate::config::Source;
use crate::connect::{check_shards, redis_client, unreachable_reason, ConnectError};
use crate::db::{self, DbError};
use crate::dbwatch::DbWatch;
use crate::delivery::Take;
use crate::handlers::sql::{SqlHandler, SqlHandlerError};
use crate::handlers::{Handlers, Registry};
use crate::manners::Manners;
use crate::metrics;
use crate::mover::Mover;
use crate::notify::Notifier;
use crate::prune::Pruner;
use crate::shutdown::Shutdown;
use crate::source::done::InboxLook;
use crate::source::{self, list::ListReader, stream::Reader, stream::Shards, Doorbell, Feed};
use crate::stats::{Snapshot, Stats};
use crate::store;
use crate::workers::session::{Session, SessionError};
use crate::workers::{Drain, PoolContext, Worker};
use std::sync::atomic::Ordering;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Redis cannot be opened, or is laid out for another `--shards` (`connect.rs`).
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("cannot reach Redis at {url}: {reason}")]
    RedisUnreachable { url: String, reason: String },
    /// A key of the worker's holds another type (the stream): Redis answers, the key is
    /// the operator's to rename or remove.
    #[error("Redis at {url}: {reason}")]
    RedisKey { url: String, reason: String },
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("the database schema is not current (missing {missing}{seen}): run `worker migrate`")]
    NotMigrated { missing: String, seen: String },
    #[error(transparent)]
    Handler(#[from] SqlHandlerError),
    /// A `--max-rate` names an event no handler serves (a typo would run uncapped).
    #[error("--max-rate {event}=...: no handler serves {event:?} (handlers: {known})")]
    UnknownCapEvent { event: String, known: String },
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("the {0} thread panicked; the daemon stopped")]
    Panicked(String),
    #[error(transparent)]
    Metrics(#[from] metrics::MetricsError),
    /// Redis may evict the worker's keys (and `--allow-eviction` was not given).
    #[error("Redis at {url}: {what} (or start with --allow-eviction to run anyway)")]
    Evicting { url: String, what: String },
}

/// What a run did, for the exit log and the tests.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub stats: Snapshot,
    /// Jobs finished after shutdown was requested.
    pub drained: u64,
    /// Jobs the workers held when the stop came and left pending for the next start (a
    /// `--max-rate` had not let them run yet, or the database was unreachable).
    pub left: u64,
}

/// The built-in handlers plus those of `--handlers-dir`.
pub fn registry(config: &Config) -> Result<Registry, DaemonError> {
    let mut r = Registry::builtin();
    if let Some(dir) = &config.handlers_dir {
        // Debug: every command that takes --handlers-dir reads it (push, dead requeue), and
        // the daemon logs the events it serves once it starts.
        for h in SqlHandler::load_dir(dir)? {
            log::debug!(
                "handler for {:?} loaded from {}",
                crate::handlers::Handler::event(&h),
                dir.display()
            );
            r.register(Box::new(h));
        }
    }
    for event in &config.noop_events {
        r.register(Box::new(crate::handlers::Noop(event.clone())));
    }
    Ok(r)
}

/// How long the start's look at `worker_migrations` may wait for a lock on it (a
/// migration under way) or run.
const SCHEMA_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// Fails unless every embedded migration is recorded as applied. Returns the session's
/// `search_path` with `$user` settled as the start finds it ([`db::settled_search_path`]),
/// which the workers' sessions keep for the run ([`db::search_path_option`]).
pub fn check_schema(url: &str) -> Result<String, DaemonError> {
    let mut client = db::connect_bounded(url, SCHEMA_CHECK_TIMEOUT)?;
    let mut seen = String::new();
    // The session's `search_path` beside each version: one round trip.
    let mut search_path = String::new();
    let applied: Vec<i32> = match client.query(
        "SELECT version, current_setting('search_path'), quote_ident(current_user), \
           EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = current_user) \
         FROM worker_migrations",
        &[],
    ) {
        Ok(rows) => {
            if let Some(r) = rows.first() {
                search_path = db::settled_search_path(
                    &r.get::<_, String>(1),
                    &r.get::<_, String>(2),
                    r.get(3),
                );
            }
            rows.iter().map(|r| r.get(0)).collect()
        }
        // No table yet: nothing applied. Any other failure (no permission, the server
        // going away) is the database's own error, said as it is.
        Err(e) if e.code() == Some(&postgres::error::SqlState::UNDEFINED_TABLE) => {
            // Migrated already, but out of this session's sight: a role's `search_path`
            // that leaves out the schema it is in. Said, since `worker migrate` would
            // then create the tables a second time in another schema.
            let elsewhere = client
                .query_one(
                    "SELECT string_agg(n.nspname, ', '), current_setting('search_path') \
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                     WHERE c.relname = 'worker_migrations' AND c.relkind IN ('r', 'p')",
                    &[],
                )
                .ok()
                .and_then(|r| {
                    Some((
                        r.try_get::<_, String>(0).ok()?,
                        r.try_get::<_, String>(1).ok()?,
                    ))
                });
            if let Some((schemas, path)) = elsewhere {
                seen = format!(
                    "; yet worker_migrations is in schema {schemas}, which this session's search_path {path:?} leaves out: a role's or database's setting? If so, fix it rather than migrate again"
                );
            }
            Vec::new()
        }
        Err(e) => return Err(DaemonError::Db(DbError::Postgres(e))),
    };
    let missing: Vec<&str> = db::MIGRATIONS
        .iter()
        .filter(|(v, _, _)| !applied.contains(v))
        .map(|(_, name, _)| *name)
        .collect();
    // Nothing missing: at least one row was read, so its `search_path` with it.
    if missing.is_empty() {
        Ok(search_path)
    } else {
        Err(DaemonError::NotMigrated {
            missing: missing.join(", "),
            seen,
        })
    }
}

/// Triggers shutdown if the thread that owns it unwinds.
struct PanicGuard<'a> {
    shutdown: &'a Shutdown,
    role: String,
}

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            log::error!("{} panicked; stopping the daemon", self.role);
            self.shutdown.trigger();
        }
    }
}

/// A role's thread, named, or why it could not start.
type Spawned<'scope> = std::io::Result<(String, ScopedJoinHandle<'scope, ()>)>;

/// Spawns one named role in the scope, with a guard that stops the daemon if it panics.
fn spawn_role<'scope>(
    s: &'scope Scope<'scope, '_>,
    shutdown: &'scope Shutdown,
    name: String,
    f: impl FnOnce() + Send + 'scope,
) -> Spawned<'scope> {
    let role = name.clone();
    std::thread::Builder::new()
        .name(name.clone())
        .spawn_scoped(s, move || {
            let _guard = PanicGuard { shutdown, role };
            f()
        })
        .map(|h| (name, h))
}

/// At a graceful stop, before the heartbeat goes: what this process read and never ran
/// does not count as a delivery (taken off each pending entry's or held message's count;
/// they stay pending for the next start or a peer). Found from
/// outside: restarts under `--max-rate`, whose workers hold jobs for their slots, made good
/// jobs dead letters for too many deliveries, never run. Best effort: what is not
/// forgiven stays counted, as after a kill.
fn forgive_unrun(con: &mut dyn redis::ConnectionLike, config: &Config) {
    let consumer = &config.consumer;
    let done = match config.source {
        crate::config::Source::List => {
            crate::store::list::forgive_left(con, &config.keys, consumer)
        }
        crate::config::Source::Stream => config.derived.shards.iter().try_fold(0, |n, keys| {
            crate::store::stream::forgive_left(con, keys, consumer).map(|m| n + m)
        }),
    };
    match done {
        Ok(0) => {}
        Ok(n) => log::info!(
            "{n} jobs read and not run left pending, their delivery here not counted toward --max-deliveries"
        ),
        Err(e) => log::warn!("the jobs read and not run stay counted as delivered: {e}"),
    }
}

/// A second signal's exit (`signals::install`; `config` settled): what this process read
/// and never ran is not counted as delivered, as at a graceful stop ([`forgive_unrun`]),
/// if Redis answers within a second; past that it exits anyway, the deliveries counted as
/// after a kill. The jobs its workers were running are forgiven too: a second signal is
/// the operator's stop, not the death a message that kills its consumer causes. Found from
/// outside: five double-signal restarts under a cap made 12 (stream) and 15 (list) of 40
/// good jobs dead letters, never run.
pub fn forgive_at_exit(config: &Config) {
    let config = config.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if let Ok(mut con) = crate::connect::redis_connection(&config) {
            forgive_unrun(&mut con, &config);
        }
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(std::time::Duration::from_secs(1));
}

/// What the roles need, checked before any thread starts.
struct Ready {
    client: crate::store::Redis,
    handlers: Handlers,
    pool: db::Pool,
    /// This host's clock offset to Redis, measured before any role reads the clock;
    /// `None` when that failed (the watch role's first pass measures it).
    offset: Option<crate::clock::Offset>,
    /// The `search_path` the start saw, kept by every session of the run.
    search_path: String,
    /// A warning to log once the start has gone through: Redis keeps no append-only file.
    no_aof: Option<String>,
}

/// Runs the daemon until `shutdown` is triggered and the pool has drained: [`preflight`],
/// then the roles spawned and supervised in one scope ([`spawn_and_supervise`]).
pub fn run(config: &Config, shutdown: &Shutdown) -> Result<Report, DaemonError> {
    // What every role needs computed from the configuration, computed once here.
    let config = &config.settled();
    let ready = match preflight(config) {
        Ok(ready) => ready,
        // A signal during start-up interrupts a connect or a query: nothing was read yet,
        // so there is nothing to drain and the stop is as graceful as any other.
        // The signal handler runs on its own thread: a read the signal interrupted can fail
        // a moment before the flag is set.
        Err(e) if shutdown.is_set() || shutdown.wait(std::time::Duration::from_millis(200)) => {
            log::info!("stopped during start-up ({e}); nothing was read");
            return Ok(Report::default());
        }
        Err(e) => return Err(e),
    };
    log::info!("starting: {}", config.summary());
    if let Some(warning) = &ready.no_aof {
        log::warn!("{warning}");
    }
    log::info!(
        "handlers: {}",
        ready.handlers.current().0.events().join(", ")
    );
    let started = Instant::now();
    let (report, panicked) = spawn_and_supervise(config, shutdown, &ready)?;
    // Peers may take over at once whatever this consumer still has pending. Best effort:
    // if Redis is unreachable now, the key expires by itself.
    if let Ok(mut con) = store::connect(&ready.client) {
        if panicked.is_empty() {
            forgive_unrun(&mut con, config);
        }
        for keys in &config.derived.shards {
            let _ = store::forget_heartbeat(&mut con, keys, &config.consumer);
        }
    }
    let left = match report.left {
        0 => String::new(),
        n => format!(", left {n} pending for the next start"),
    };
    log::info!(
        "stopped after {}: drained {} jobs{left}; {}",
        crate::human_ms(started.elapsed().as_millis() as i64),
        report.drained,
        report.stats
    );
    match panicked.into_iter().next() {
        Some(name) => Err(DaemonError::Panicked(name)),
        None => Ok(report),
    }
}

/// Redis as the daemon needs it: the shard layout agrees (and is recorded), no key may be
/// evicted, and in stream mode every shard's consumer group exists. Returns this host's
/// clock offset to Redis, measured on the same connection (see [`crate::watch::offset`]),
/// and the warning to log once the start has gone through when Redis keeps no
/// append-only file.
fn check_redis(
    config: &Config,
    client: &crate::store::Redis,
) -> Result<(Option<crate::clock::Offset>, Option<String>), DaemonError> {
    let url = || config.derived.redis_shown.clone();
    let mut con = store::connect(client).map_err(|e| DaemonError::RedisUnreachable {
        url: url(),
        reason: unreachable_reason(&e, &config.redis_url),
    })?;
    check_shards(config, &mut con, true)?;
    let (evicting, no_aof) = crate::watch::refuse_eviction(&mut con, config).map_err(|e| {
        DaemonError::RedisUnreachable {
            url: url(),
            reason: e.to_string(),
        }
    })?;
    if let Some(what) = evicting {
        return Err(DaemonError::Evicting { url: url(), what });
    }
    if config.source == Source::Stream {
        for keys in &config.derived.shards {
            store::stream::ensure_group(&mut con, keys).map_err(|e| match e {
                store::StoreError::WrongType { .. } => DaemonError::RedisKey {
                    url: url(),
                    reason: e.to_string(),
                },
                _ => DaemonError::RedisUnreachable {
                    url: url(),
                    reason: e.to_string(),
                },
            })?;
        }
    }
    let key = &config.derived.shards[0].pool;
    let offset = match crate::watch::offset(&mut con, key) {
        Ok(o) => Some(o),
        Err(e) => {
            log::debug!("the clock's offset to Redis not measured at start: {e}");
            None
        }
    };
    Ok((offset, no_aof))
}

/// Fails fast, with one readable error, when Redis or PostgreSQL cannot be reached, the
/// schema is not current, or a handler's SQL does not prepare.
fn preflight(config: &Config) -> Result<Ready, DaemonError> {
    let client = redis_client(config)?;
    let (offset, no_aof) = check_redis(config, &client)?;
    let search_path = check_schema(&config.database_url)?;
    let registry = registry(config)?;
    if let Some(event) = config
        .jobs
        .max_rates
        .iter()
        .filter_map(|r| r.event.as_deref())
        .find(|e| !registry.events().contains(e))
    {
        return Err(DaemonError::UnknownCapEvent {
            event: event.to_string(),
            known: registry.events().join(", "),
        });
    }
    let pool = db::pool(
        &config.database_url,
        config.db_pool_size(),
        db::Timeouts {
            statement: config.jobs.statement_timeout,
            lock: config.jobs.lock_timeout,
        },
        db::CHECKOUT,
        config.jobs.group_commit,
        Some(&search_path),
    )?;
    // Prepares every handler once now, so that a handler that does not prepare (a table
    // not there yet, SQL that does not parse) is named at once. It does not stop the start:
    // its jobs are held, not dead-lettered, and the other events run. Nor does an inbox
    // another transaction has locked (a migration, a `LOCK TABLE`): the workers wait for
    // it as for a lock taken later, health red meanwhile (it stopped the start before).
    match Session::open(&pool, &registry, config.jobs.lock_timeout) {
        Ok(session) => {
            for (event, failure) in session.unprepared(&registry) {
                log::error!(
                    "the handler of {event:?} does not prepare, its jobs are held until it does: {}",
                    failure.reason
                );
            }
        }
        Err(SessionError::Inbox(f)) if f.fault == db::Fault::Contention => {
            log::warn!(
                "the inbox table is locked by another transaction, so the handlers are not checked now; every job waits until the lock ends: {}",
                f.reason
            );
        }
        Err(e) => return Err(e.into()),
    }
    Ok(Ready {
        client,
        handlers: Handlers::new(registry),
        pool,
        offset,
        search_path,
        no_aof,
    })
}

/// Spawns the roles in one scope, then supervises them from this thread until shutdown
/// and joins them: [`Crew::new`], the metrics server bound, [`Crew::spawn_all`],
/// [`Crew::supervise`], [`join`]. Returns the report and the names of roles that panicked.
fn spawn_and_supervise(
    config: &Config,
    shutdown: &Shutdown,
    ready: &Ready,
) -> Result<(Report, Vec<String>), DaemonError> {
    let started = Instant::now();
    let crew = Crew::new(config, shutdown, ready)?;
    let (hand, rx) = crate::delivery::channel(
        config.channel_capacity_under(&crew.manners),
        config.jobs.take_size_under(&crew.manners),
    );
    let (space_tx, space_rx) = crossbeam_channel::bounded::<()>(1);
    // Bound before any thread starts, so a port in use stops the start with one line.
    let server = crew.bind_metrics(&rx)?;
    let ctx = crew.pool_context();
    let panicked: Vec<String> = std::thread::scope(|s| {
        let feed = Feed::new(hand, space_rx, &crew.stats);
        let mut spawned = crew.spawn_all(s, feed, &ctx, (&rx, &space_tx));
        if let Some(server) = &server {
            spawned.push(spawn_role(s, shutdown, "metrics".into(), move || {
                server.run(shutdown)
            }));
        }
        // `rx` stays here for the channel depth of the status line. A receiver that never
        // receives holds nobody up: the reader sends only what fits, and the workers stop
        // when the sender is gone, however many receivers remain.
        let handles = started_or_stop(spawned, shutdown);
        crew.supervise(&|| rx.len(), started);
        join(handles)
    });
    let report = Report {
        stats: crew.stats.snapshot(),
        drained: crew.drain.ran.load(Ordering::Relaxed),
        left: crew.drain.left.load(Ordering::Relaxed),
    };
    Ok((report, panicked))
}

/// What the roles share, made before any of them starts and borrowed by each.
struct Crew<'a> {
    config: &'a Config,
    shutdown: &'a Shutdown,
    ready: &'a Ready,
    stats: Stats,
    doorbell: Doorbell,
    /// What the stop did with the jobs the workers held.
    drain: Drain,
    manners: Manners,
    /// The watch's own connections ask for read-write as the pool's do (`db::Target`).
    pool_target: db::Target,
    /// What the reader asks before an over-delivered entry becomes a dead letter.
    inbox: InboxLook,
    /// The mover's settings for every shard but the first: legacy pools are served once,
    /// with the first shard.
    shard_mover: MoverConfig,
}

impl<'a> Crew<'a> {
    fn new(
        config: &'a Config,
        shutdown: &'a Shutdown,
        ready: &'a Ready,
    ) -> Result<Crew<'a>, DaemonError> {
        let stats = Stats::new(ready.handlers.current().0.events());
        if let Some(o) = ready.offset {
            stats.clock.set(o);
        }
        // The roles' heartbeats start now: one that never completes a step counts as
        // stalled.
        Stats::beat(&stats.reader_beat_ms);
        Stats::beat(&stats.mover_beat_ms);
        let mut pool_target = db::Target::parse(&config.database_url)?;
        pool_target.keep_search_path(&ready.search_path);
        Ok(Crew {
            config,
            shutdown,
            ready,
            stats,
            doorbell: Doorbell::default(),
            drain: Drain::default(),
            manners: Manners::new(&config.jobs.max_rates, config.jobs.set_size),
            inbox: InboxLook::new(pool_target.clone(), config.reader.heartbeat_ttl),
            pool_target,
            shard_mover: MoverConfig {
                legacy: Vec::new(),
                ..config.mover.clone()
            },
        })
    }

    /// What every worker borrows.
    fn pool_context(&self) -> PoolContext<'_> {
        let config = self.config;
        PoolContext {
            keys: &config.keys,
            claim_idle: config.reader.claim_idle,
            shards: &config.derived.shards,
            jobs: &config.jobs,
            consumer: &config.consumer,
            handlers: &self.ready.handlers,
            manners: &self.manners,
            stats: &self.stats,
            db: &self.ready.pool,
            redis: &self.ready.client,
            shutdown: self.shutdown,
            drain: &self.drain,
        }
    }

    /// The metrics server of `--metrics-addr`, bound; `rx` for the channel's depth.
    fn bind_metrics(&self, rx: &Take) -> Result<Option<metrics::Server<'_>>, DaemonError> {
        let Some(addr) = self.config.metrics_addr else {
            return Ok(None);
        };
        let sources = metrics::Sources {
            stats: &self.stats,
            config: self.config,
            pool: &self.ready.pool,
            redis: &self.ready.client,
            manners: &self.manners,
            handlers: &self.ready.handlers,
            depth: Box::new({
                let rx = rx.clone();
                move || rx.len()
            }),
            capacity: self.config.channel_capacity_under(&self.manners),
        };
        Ok(Some(metrics::Server::bind(addr, sources)?))
    }

    /// Every role but the metrics server: the mover (unless `--no-mover`), the reader,
    /// the workers, the PostgreSQL watch, the pruner (unless `--inbox-retention 0`) and
    /// the watch.
    fn spawn_all<'s>(
        &'s self,
        s: &'s Scope<'s, '_>,
        feed: Feed<'s>,
        ctx: &'s PoolContext<'s>,
        (rx, space_tx): (&Take, &crossbeam_channel::Sender<()>),
    ) -> Vec<Spawned<'s>> {
        let (config, shutdown) = (self.config, self.shutdown);
        let mut spawned = Vec::new();
        if config.run_mover {
            spawned.push(self.spawn_mover(s));
        }
        spawned.push(self.spawn_reader(s, feed));
        for i in 0..config.threads {
            let (rx, space_tx) = (rx.clone(), space_tx.clone());
            spawned.push(spawn_role(s, shutdown, format!("worker-{i}"), move || {
                Worker::new(i, ctx).run(&rx, &space_tx)
            }));
        }
        let handlers = &self.ready.handlers;
        let pg = DbWatch::new(
            self.pool_target.clone(),
            &self.stats,
            &self.manners,
            handlers,
            config.handlers_dir.clone(),
            config.dead_rate_crit,
        );
        spawned.push(spawn_role(s, shutdown, "pg-watch".into(), move || {
            pg.run(shutdown)
        }));
        if config.prune.enabled() {
            let pruner = Pruner::new(config, &self.stats, &self.ready.client);
            spawned.push(spawn_role(s, shutdown, "pruner".into(), move || {
                pruner.run(shutdown)
            }));
        }
        let (watch, client) = (
            crate::watch::Watch::new(config, &self.stats),
            &self.ready.client,
        );
        spawned.push(spawn_role(s, shutdown, "watch".into(), move || {
            watch.run(client, shutdown)
        }));
        let stalls = &self.stats.stalls;
        spawned.push(spawn_role(s, shutdown, "stall-watch".into(), move || {
            stalls.run(shutdown)
        }));
        spawned
    }

    /// The mover: one a shard, each ringing the reader's doorbell after a move.
    fn spawn_mover<'s>(&'s self, s: &'s Scope<'s, '_>) -> Spawned<'s> {
        let _ = self.stats.mover_ahead.set(self.config.mover.ahead);
        let shard_keys = &self.config.derived.shards;
        let (client, bell) = (&self.ready.client, self.doorbell.clone());
        spawn_role(s, self.shutdown, "mover".into(), move || {
            let movers: Vec<Mover> = shard_keys
                .iter()
                .enumerate()
                .map(|(i, keys)| {
                    let cfg = if i == 0 {
                        &self.config.mover
                    } else {
                        &self.shard_mover
                    };
                    let m = Mover::new(keys, cfg, &self.stats).with_doorbell(bell.clone());
                    if shard_keys.len() > 1 {
                        m.in_shard(i)
                    } else {
                        m
                    }
                })
                .collect();
            crate::mover::run_shards(&movers, client, self.shutdown)
        })
    }

    /// The reader of the stream (of every shard's) or of the list queues.
    fn spawn_reader<'s>(&'s self, s: &'s Scope<'s, '_>, feed: Feed<'s>) -> Spawned<'s> {
        let config = self.config;
        let (client, stats, bell, shutdown) = (
            &self.ready.client,
            &self.stats,
            self.doorbell.clone(),
            self.shutdown,
        );
        let (keys, cfg, consumer) = (&config.keys, &config.reader, config.consumer.as_str());
        let capped = self.manners.capped();
        let shard_keys = &config.derived.shards;
        let inbox = &self.inbox;
        spawn_role(s, shutdown, "reader".into(), move || match config.source {
            Source::Stream if shard_keys.len() > 1 => {
                let readers = shard_keys
                    .iter()
                    .map(|k| {
                        Reader::new(k, cfg, consumer, stats, feed.clone(), inbox).capped(capped)
                    })
                    .collect();
                source::run(Shards::new(readers, bell), client, stats, shutdown)
            }
            Source::Stream => source::run(
                Reader::new(keys, cfg, consumer, stats, feed, inbox)
                    .with_doorbell(bell)
                    .capped(capped),
                client,
                stats,
                shutdown,
            ),
            Source::List => source::run(
                ListReader::new(keys, cfg, consumer, stats, feed, inbox).with_doorbell(bell),
                client,
                stats,
                shutdown,
            ),
        })
    }

    /// This thread until shutdown: systemd's readiness, watchdog and status line, SIGHUP's
    /// reload, SIGUSR1's report, the heap trimmed, the stats line every interval; `depth`:
    /// the channel's.
    fn supervise(&self, depth: &dyn Fn() -> usize, started: Instant) {
        let (config, shutdown, stats) = (self.config, self.shutdown, &self.stats);
        let mut notifier = Notifier::from_env();
        notifier.ready(stats, depth());
        let (mut logged, mut trimmed, mut ticked, mut watched) = (
            Instant::now(),
            Instant::now(),
            Instant::now(),
            Instant::now(),
        );
        let (mut reloads, mut reports) = (shutdown.reloads(), shutdown.reports());
        let tick = notifier.tick_interval(config.stats_interval);
        let next = |ticked: Instant, watched: Instant| {
            let tick = tick.saturating_sub(ticked.elapsed());
            tick.min(WATCH_CONTENTION_EVERY.saturating_sub(watched.elapsed()))
        };
        while !shutdown.wait_or_request(next(ticked, watched)) {
            if shutdown.reloads() != reloads {
                reloads = shutdown.reloads();
                reload(config, &self.ready.handlers, &self.pool_target, stats);
            }
            if shutdown.reports() != reports {
                reports = shutdown.reports();
                report(config, stats, depth(), started);
            }
            if watched.elapsed() >= WATCH_CONTENTION_EVERY {
                // Jobs read and not yet taken: the waiters' retries may be among them.
                if depth() > 0 {
                    stats
                        .contention
                        .queued_for(watched.elapsed().as_millis() as i64);
                }
                watched = Instant::now();
                crate::workers::watch_contention(stats, crate::now_ms(), &config.jobs);
            }
            if ticked.elapsed() < tick {
                continue;
            }
            ticked = Instant::now();
            notifier.tick(stats, config, depth());
            if trimmed.elapsed() >= TRIM_EVERY {
                trimmed = Instant::now();
                release_free_memory();
            }
            if logged.elapsed() < config.stats_interval {
                continue;
            }
            logged = Instant::now();
            // One line per interval even when idle: its absence in the journal means trouble.
            log::info!("stats: {} in_channel={}", stats.snapshot(), depth());
        }
        notifier.stopping();
        log::info!("shutdown requested; draining the jobs already read");
    }
}

/// How often the supervisor looks at the jobs waiting on contention
/// ([`crate::workers::watch_contention`]).
const WATCH_CONTENTION_EVERY: Duration = Duration::from_secs(1);

/// The roles that started; a role that could not start stops the daemon.
fn started_or_stop<'s>(
    spawned: Vec<Spawned<'s>>,
    shutdown: &Shutdown,
) -> Vec<(String, ScopedJoinHandle<'s, ()>)> {
    let mut handles = Vec::new();
    for r in spawned {
        match r {
            Ok(h) => handles.push(h),
            Err(e) => {
                log::error!("cannot spawn a thread: {e}");
                shutdown.trigger();
            }
        }
    }
    handles
}

/// Waits for every role; the names of those that panicked.
fn join(handles: Vec<(String, ScopedJoinHandle<'_, ()>)>) -> Vec<String> {
    handles
        .into_iter()
        .filter_map(|(name, h)| h.join().is_err().then_some(name))
        .collect()
}

/// SIGHUP: reads the `--handlers-dir` files again and hands the new handlers to the
/// workers (each takes them at its next batch). The daemon never stops for it:
/// - a file that cannot be read or parsed keeps the whole old set, and says why;
/// - a handler that does not prepare keeps its old version when it had one (an edit with
///   a typo does not take a working event down), and is added as it is when it is new (its
///   jobs are held, not dead-lettered, until it prepares: the PostgreSQL watch checks it
///   every 10 s and health names it meanwhile).
///
/// A folder that cannot be loaded is also a warning in the published health (`worker stats
/// --check`) until it loads again (the PostgreSQL watch reads it every 10 s), since the
/// next start would stop at it.
pub fn reload(config: &Config, handlers: &Handlers, target: &db::Target, stats: &Stats) {
    let Some(dir) = &config.handlers_dir else {
        log::info!("SIGHUP: no --handlers-dir, nothing to reload");
        return;
    };
    let new = match registry(config) {
        Ok(r) => {
            stats.clear_problem(crate::dbwatch::HANDLERS_FOLDER, i64::MAX);
            r
        }
        Err(e) => {
            log::error!("SIGHUP: the handlers stay as they were: {e}");
            stats.report_trouble(
                crate::dbwatch::HANDLERS_FOLDER,
                format!(
                    "SIGHUP: the handlers stay as they were, and a restart would stop here: {e}"
                ),
            );
            return;
        }
    };
    let (old, _) = handlers.current();
    let mut client = match target.connect_within(db::HANDSHAKE_DEADLINE) {
        Ok(c) => c,
        Err(e) => {
            log::error!("SIGHUP: the handlers stay as they were: cannot check them: {e}");
            return;
        }
    };
    let mut next = Registry::default();
    for h in new.shared() {
        let event = h.event().to_string();
        let Err(f) = crate::workers::session::try_prepare(&mut client, h.as_ref()) else {
            next.register_shared(h);
            continue;
        };
        let file = h.source().unwrap_or("the handler").to_string();
        match old.shared_of(&event) {
            Some(previous)
                if crate::workers::session::try_prepare(&mut client, previous.as_ref()).is_ok() =>
            {
                log::error!(
                    "SIGHUP: {file} does not prepare, the handler of {event:?} stays as it was: {}",
                    f.reason
                );
                next.register_shared(previous);
            }
            _ => {
                log::error!(
                    "SIGHUP: {file} does not prepare, the jobs of {event:?} are held until it does: {}",
                    f.reason
                );
                next.register_shared(h);
            }
        }
    }
    log::info!(
        "SIGHUP: handlers reloaded from {}: {}",
        dir.display(),
        next.events().join(", ")
    );
    handlers.replace(next);
}

/// SIGUSR1: the state report, one screen of log lines: the roles and their last step,
/// what is pending in this process, the problems, the clock, the counters.
pub fn report(config: &Config, stats: &Stats, in_channel: usize, started: Instant) {
    use std::sync::atomic::Ordering::Relaxed;
    let now = crate::now_ms();
    let ago = |beat: u64| {
        let ms = now.saturating_sub(beat as i64).max(0);
        format!("{:.1}s ago", ms as f64 / 1000.0)
    };
    let mut lines = vec![format!(
        "state: up {:.0}s, consumer {:?}, {} worker threads, source {:?}, {} shard(s)",
        started.elapsed().as_secs_f64(),
        config.consumer,
        config.threads,
        config.source,
        config.shards
    )];
    lines.push(format!(
        "state: reader last step {}; mover {}",
        ago(stats.reader_beat_ms.load(Relaxed)),
        if config.run_mover {
            format!("last tick {}", ago(stats.mover_beat_ms.load(Relaxed)))
        } else {
            "off (--no-mover)".to_string()
        }
    ));
    lines.push(format!(
        "state: pending here: {in_channel} read and waiting for a worker, {} worker(s) waiting for PostgreSQL",
        stats.db_waiting.load(Relaxed)
    ));
    lines.push(match crate::health::live(stats, config, now) {
        Ok(()) => "state: live (the watchdog's verdict)".to_string(),
        Err(why) => format!("state: not live: {why}"),
    });
    let problems = stats.problems(now);
    if problems.is_empty() {
        lines.push("state: problems: none".to_string());
    }
    for p in problems {
        lines.push(format!(
            "state: problem ({}): {}: {}",
            p.severity, p.role, p.what
        ));
    }
    lines.push(match stats.clock.offset() {
        Some(o) => format!(
            "state: clock offset to Redis {}; producers seen ahead: {} message(s), largest lead {:.1}s",
            crate::clock::describe(&o),
            stats.clock.producer_ahead(),
            stats.clock.producer_lead_max_ms() as f64 / 1000.0
        ),
        None => "state: clock offset to Redis not measured yet".to_string(),
    });
    lines.push(format!(
        "state: counters {} lost_data={}",
        stats.snapshot(),
        stats.lost_data.load(Relaxed)
    ));
    for l in lines {
        log::info!("{l}");
    }
}

/// How often the heap's free pages are given back to the system.
const TRIM_EVERY: Duration = Duration::from_secs(60);

/// Gives the free pages inside the malloc heaps back to the system (glibc's `malloc_trim`,
/// which since glibc 2.8 releases whole free pages anywhere in every arena, not only at
/// the top). The daemon's allocations churn per job on several threads; memory freed in
/// the middle of a heap otherwise stays resident: in 10-minute runs resident memory at
/// times grew by 0.7 MB in one step and stayed.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only takes malloc's own locks; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
}
