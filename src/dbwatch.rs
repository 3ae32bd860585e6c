//! The PostgreSQL watch: whether the database takes writes, and whether the shop is busy
//! in it, asked every [`EVERY`] whether jobs come or not.
//!
//! The workers find out that PostgreSQL is gone or read-only only when a job fails, so a
//! quiet worker would look healthy through an outage and surprise everyone at the next
//! due order. This thread keeps one connection of its own (one more per process) and asks,
//! in one statement, whether the server takes writes (`transaction_read_only`) and how
//! many of the shop's sessions are running a statement now (`pg_stat_activity`: client
//! backends of this database that are not the worker's, by `application_name`).
//!
//! - A server that does not answer, refuses the connection or takes no writes (a standby,
//!   a primary demoted or with `default_transaction_read_only`) is reported as critical
//!   ([`Stats::report_critical`]: `/healthz` 503 and the published health red, the
//!   watchdog left alone: a restart would not make the server writable); the report is
//!   cleared once it takes writes again.
//! - The shop's busy sessions, averaged over about a second, decide whether the workers
//!   yield ([`Manners::set_yielding`]): from [`BUSY`] on, and until it has been quiet for
//!   [`QUIET_FOR`]. Seeing other roles' sessions' state needs `pg_read_all_stats` (or the
//!   worker using the shop's own role); without it the worker sees no shop and never
//!   yields, which is said once in the log.
//! - Every [`PREPARE_EVERY`] it prepares every handler's statements on its connection
//!   (and drops them): a handler that does not prepare (its table not there yet, a column
//!   renamed, SQL that does not parse) is reported as critical, naming its file and the
//!   error, until it does; its jobs are held meanwhile (`workers.rs`), the other events run.
//!   A prepare waits at most [`PREPARE_LOCK_WAIT`] for another session's lock on a table,
//!   and one that gives up there changes nothing: the check answers on time.
//! - With the prepare, it reads the `--handlers-dir` files again: one that cannot be read
//!   or parsed (a file the service's user may not read) is a warning until it can: the
//!   running handlers stay, but a reload would keep them and the next start would stop.
//! - This process's dead letters of the last minute are held against `--dead-rate-crit`:
//!   more is reported as critical too (under [`DEAD_RATE`]), so the published health
//!   record, and with it `worker stats --check`, says so; it is cleared at the first look
//!   that counts no more.
//!
//! Each check runs on a short-lived thread with the kept connection, so that a server that
//! stops answering costs [`ANSWER_WITHIN`], not a watch stuck in a read (and a shutdown
//! that cannot join it). It stops at shutdown, within one [`EVERY`].

use crate::db::{self, DbError};
use crate::handlers::sql::SqlHandler;
use crate::handlers::{Handlers, Registry};
use crate::manners::Manners;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a handler's prepare waits for a lock another session holds on its table.
const PREPARE_LOCK_WAIT: Duration = Duration::from_millis(500);

/// How long one statement of a check may run (the watch's sessions set it themselves,
/// whatever the role or the database says).
const CHECK_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the watch asks.
pub const EVERY: Duration = Duration::from_millis(250);

/// The role its reports carry.
pub const ROLE: &str = "postgresql";

/// The role a `--handlers-dir` that cannot be loaded is reported under.
pub const HANDLERS_FOLDER: &str = "handlers folder";

/// The role the dead-letter rate is reported under.
pub const DEAD_RATE: &str = "dead letters";

/// The shop's sessions running a statement, on average, from which the workers yield:
/// a shop doing a few dozen short transactions a second.
pub const BUSY: f64 = 0.05;

/// How often every handler is prepared to see that it still can.
pub const PREPARE_EVERY: Duration = Duration::from_secs(10);

/// How long the shop must have been quiet before the workers stop yielding.
pub const QUIET_FOR: Duration = Duration::from_secs(3);

/// Longest a check may take; a server that accepts and never answers costs this.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Checks given up on that still wait for their server; while this many do, no new one
/// starts (each is a thread blocked in a read until the server answers or the socket
/// fails).
const MAX_WAITING: usize = 2;

/// Whether the server takes writes, the shop's sessions running a statement (of other
/// roles only if this one may see their state: otherwise it is NULL, and not counted),
/// whether it may, and whether a new session of this role in this database would start
/// read-only: `default_transaction_read_only` set for the role or the database (`ALTER
/// ROLE ... SET`) applies only to sessions opened after it, so the kept connection, and
/// the workers' open ones, go on writing while every new one (the workers' next, the
/// `/healthz` probe's) is refused (found from outside: `/healthz` red, `stats --check`
/// only a warning). The most specific setting wins, as PostgreSQL applies them.
const ASK: &str = "SELECT current_setting('transaction_read_only') = 'on', \
     (SELECT count(*) FROM pg_stat_activity \
       WHERE state = 'active' AND backend_type = 'client backend' AND datname = current_database() \
         AND pid <> pg_backend_pid() AND application_name NOT LIKE 'delay-worker%'), \
     pg_has_role('pg_read_all_stats', 'USAGE'), \
     coalesce((SELECT lower(split_part(c, '=', 2)) ~ '^(on|t|tr|tru|true|y|ye|yes|1)$' \
       FROM pg_db_role_setting s, unnest(s.setconfig) c \
       WHERE c LIKE 'default\\_transaction\\_read\\_only=%' \
         AND s.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = current_user)) \
         AND s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database())) \
       ORDER BY s.setrole <> 0 DESC, s.setdatabase <> 0 DESC LIMIT 1), false)";

/// What the watch says when new sessions of the worker's role would start read-only.
const NEW_SESSIONS_READ_ONLY: &str = "new sessions of the worker's role are read-only: \
     default_transaction_read_only is on for the role or the database (ALTER ROLE or ALTER \
     DATABASE ... SET); the sessions open now still write, a new one would not";

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

/// What one check found.
struct Seen {
    /// The shop's sessions running a statement now.
    busy: i64,
    /// Whether other roles' sessions can be seen at all.
    sees_all: bool,
    /// When the handlers were prepared: each one's event, file and failure.
    prepared: Vec<(String, Option<String>, Option<String>)>,
}

/// The watch of one daemon.
pub struct DbWatch<'a> {
    target: db::Target,
    stats: &'a Stats,
    manners: &'a Manners,
    handlers: &'a Handlers,
    /// `--handlers-dir`, read again with every prepare: what a reload or the next start
    /// would load.
    handlers_dir: Option<std::path::PathBuf>,
    /// `--dead-rate-crit` (0: off).
    dead_rate_crit: u64,
}

impl<'a> DbWatch<'a> {
    pub fn new(
        mut target: db::Target,
        stats: &'a Stats,
        manners: &'a Manners,
        handlers: &'a Handlers,
        handlers_dir: Option<std::path::PathBuf>,
        dead_rate_crit: u64,
    ) -> DbWatch<'a> {
        // A prepare takes a lock on each table it names: behind a shop's lock (an ALTER
        // TABLE, a LOCK TABLE) it gives up soon rather than keeping the check from
        // answering, which would read as a server that takes no writes. A session option,
        // as the workers' pool sets its timeouts. Its own statement timeout too: a
        // role's or database's (`ALTER ROLE ... SET statement_timeout = '1ms'`) made
        // every check fail, read as "no writable PostgreSQL" while jobs ran.
        target.add_options(&format!(
            "-c lock_timeout={} -c statement_timeout={}",
            PREPARE_LOCK_WAIT.as_millis(),
            CHECK_STATEMENT_TIMEOUT.as_millis()
        ));
        DbWatch {
            target,
            stats,
            manners,
            handlers,
            handlers_dir,
            dead_rate_crit,
        }
    }

    /// The thread body: one check every [`EVERY`] until shutdown.
    pub fn run(&self, shutdown: &Shutdown) {
        let waiting = Arc::new(AtomicUsize::new(0));
        let mut kept: Option<postgres::Client> = None;
        // The shop's busy sessions, averaged; when it was last busy.
        let mut busy = 0.0;
        let mut last_busy: Option<Instant> = None;
        let mut said_blind = false;
        let mut prepared_at: Option<Instant> = None;
        loop {
            let prepare = prepared_at
                .is_none_or(|t| t.elapsed() >= PREPARE_EVERY)
                .then(|| self.handlers.current().0);
            if prepare.is_some() {
                prepared_at = Some(Instant::now());
                self.handlers_folder();
            }
            match self.ask(&waiting, &mut kept, prepare) {
                Ok(seen) => {
                    self.stats.db_unusable.store(false, Ordering::Relaxed);
                    self.handlers_prepared(&seen.prepared);
                    if self.stats.clear_problem(ROLE, i64::MAX) {
                        log::info!("PostgreSQL takes writes again");
                    }
                    if !seen.sees_all && !said_blind {
                        said_blind = true;
                        log::info!(
                            "the worker's PostgreSQL role sees only its own sessions: it yields to the shop's traffic only if the shop uses the same role (GRANT pg_read_all_stats to it to see the shop's)"
                        );
                    }
                    busy = 0.8 * busy + 0.2 * seen.busy as f64;
                    if busy >= BUSY {
                        last_busy = Some(Instant::now());
                    }
                }
                Err(why) => {
                    self.stats.db_unusable.store(true, Ordering::Relaxed);
                    let what = format!("no writable PostgreSQL: {why}");
                    if self.stats.report_critical(ROLE, what.clone()) {
                        log::error!("{what}");
                    }
                }
            }
            let yielding = last_busy.is_some_and(|t| t.elapsed() < QUIET_FOR);
            if yielding != self.manners.yielding() {
                log::debug!(
                    "the shop's sessions are {}: the workers {}",
                    if yielding { "busy" } else { "quiet" },
                    if yielding { "yield" } else { "run freely" }
                );
                self.manners.set_yielding(yielding);
            }
            self.dead_rate();
            if shutdown.wait(EVERY) {
                return;
            }
        }
    }

    /// One check on a thread of its own (see the module header), within
    /// [`ANSWER_WITHIN`].
    fn ask(
        &self,
        waiting: &Arc<AtomicUsize>,
        kept: &mut Option<postgres::Client>,
        prepare: Option<Arc<Registry>>,
    ) -> Result<Seen, String> {
        if waiting.load(Ordering::SeqCst) >= MAX_WAITING {
            return Err(format!(
                "no answer: {MAX_WAITING} earlier checks still wait for the server"
            ));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (target, mut client) = (self.target.clone(), kept.take());
        let (w, st) = (waiting.clone(), state.clone());
        std::thread::Builder::new()
            .name("pg-watch".into())
            .spawn(move || {
                let r = check(&target, &mut client, prepare.as_deref());
                let _ = tx.send((client, r));
                if st.swap(DONE, Ordering::SeqCst) == ABANDONED {
                    w.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| format!("cannot start a check: {e}"))?;
        let answer = match rx.recv_timeout(ANSWER_WITHIN) {
            Ok(a) => Some(a),
            Err(_) => {
                waiting.fetch_add(1, Ordering::SeqCst);
                match state.compare_exchange(RUNNING, ABANDONED, Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => None,
                    // It finished just now.
                    Err(_) => {
                        waiting.fetch_sub(1, Ordering::SeqCst);
                        rx.recv().ok()
                    }
                }
            }
        };
        match answer {
            Some((client, r)) => {
                if r.is_ok() {
                    *kept = client;
                }
                r
            }
            None => Err(format!("no answer within {}s", ANSWER_WITHIN.as_secs())),
        }
    }

    /// Reports each handler that did not prepare, and clears each that did.
    fn handlers_prepared(&self, prepared: &[(String, Option<String>, Option<String>)]) {
        for (event, file, failure) in prepared {
            let role = format!("handler {event} (prepare)");
            match failure {
                Some(reason) => {
                    let what = format!(
                        "{} does not prepare, its jobs are held until it does: {reason}",
                        file.as_deref().unwrap_or("the built-in handler")
                    );
                    if self.stats.report_critical(&role, what.clone()) {
                        log::error!("{what}");
                    }
                }
                None => {
                    if self.stats.clear_problem(&role, i64::MAX) {
                        log::info!("the handler of {event:?} prepares again");
                    }
                }
            }
        }
    }

    /// Reads the `--handlers-dir` files again, as a reload or the next start would: one
    /// that cannot be read (a mode the service's user may not read) or parsed is a
    /// warning until it can, since the handlers running now stay but a restart would stop
    /// at it.
    fn handlers_folder(&self) {
        let Some(dir) = &self.handlers_dir else {
            return;
        };
        match SqlHandler::load_dir(dir) {
            Err(e) => {
                let what = format!(
                    "the handlers folder cannot be loaded now: {e}; the handlers loaded before run on, but a reload keeps them and a restart would stop here"
                );
                if self.stats.report_trouble(HANDLERS_FOLDER, what.clone()) {
                    log::warn!("{what}");
                }
            }
            Ok(_) => {
                if self.stats.clear_problem(HANDLERS_FOLDER, i64::MAX) {
                    log::info!("the handlers folder {} loads again", dir.display());
                }
            }
        }
    }

    /// Reports the dead-letter rate when it is over `--dead-rate-crit`.
    fn dead_rate(&self) {
        if self.dead_rate_crit == 0 {
            return;
        }
        let n = self.stats.jobs.dead_last_minute(crate::now_ms());
        if n > self.dead_rate_crit {
            let what = format!(
                "{n} dead letters in the last minute (over --dead-rate-crit {}): `worker dead list --newer-than 5m`",
                self.dead_rate_crit
            );
            if self.stats.report_critical(DEAD_RATE, what.clone()) {
                log::error!("{what}");
            }
        } else if self.stats.clear_problem(DEAD_RATE, i64::MAX) {
            log::info!(
                "dead letters back to {n} in the last minute (--dead-rate-crit {})",
                self.dead_rate_crit
            );
        }
    }
}

/// One check on the kept connection (a new one when there is none). A new connection is
/// already refused by a read-only server (the target asks for read-write); a kept one is
/// asked again. A failed connection is not kept.
fn check(
    target: &db::Target,
    client: &mut Option<postgres::Client>,
    prepare: Option<&Registry>,
) -> Result<Seen, String> {
    let c = match client {
        Some(c) => c,
        None => {
            let mut new = target
                .connect_within(db::HANDSHAKE_DEADLINE)
                .map_err(|e| match e {
                    DbError::Unreachable { reason, .. } => reason,
                    other => other.to_string(),
                })?;
            if let Some(why) = db::keep_session(&mut new).map_err(|e| db::error_text(&e))? {
                return Err(why.to_string());
            }
            client.insert(new)
        }
    };
    let answer = c
        .query_one(ASK, &[])
        .map_err(|e| db::error_text(&e))
        .and_then(|row| {
            let read_only: bool = row.try_get(0).map_err(|e| db::error_text(&e))?;
            let busy: i64 = row.try_get(1).map_err(|e| db::error_text(&e))?;
            let sees_all: bool = row.try_get(2).map_err(|e| db::error_text(&e))?;
            let new_read_only: bool = row.try_get(3).map_err(|e| db::error_text(&e))?;
            if new_read_only && !read_only {
                return Err(NEW_SESSIONS_READ_ONLY.to_string());
            }
            Ok((
                read_only,
                Seen {
                    busy,
                    sees_all,
                    prepared: Vec::new(),
                },
            ))
        });
    match answer {
        Ok((false, mut seen)) => {
            for h in prepare.into_iter().flat_map(Registry::iter) {
                let failure = match crate::workers::session::try_prepare(c, h) {
                    Ok(()) => None,
                    // The connection failed meanwhile: the next check says so.
                    Err(f) if f.fault == db::Fault::Server => return Err(f.reason),
                    // Another session's lock on its table: it says nothing of the handler,
                    // whose state stays as it was until a prepare gets through.
                    Err(f) if f.fault == db::Fault::Contention => continue,
                    Err(f) => Some(f.reason),
                };
                seen.prepared.push((
                    h.event().to_string(),
                    h.source().map(str::to_string),
                    failure,
                ));
            }
            // A handler that does not prepare is looked at next on a new session, with
            // the role's settings as they are then (a `search_path` undone since this
            // one connected).
            if seen
                .prepared
                .iter()
                .any(|(_, _, failure)| failure.is_some())
            {
                *client = None;
            }
            Ok(seen)
        }
        Ok((true, _)) => {
            *client = None;
            Err(db::READ_ONLY.to_string())
        }
        Err(e) => {
            *client = None;
            Err(e)
        }
    }
}
