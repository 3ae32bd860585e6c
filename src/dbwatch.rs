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
//!   worker using the shop's own role); without it the shop's sessions inside a
//!   transaction are counted from `pg_locks` instead (found from outside: a worker that
//!   saw no shop never yielded, and on 3 hot skus held the shop at a fifth of its rate for
//!   27 s), and the shop held up behind the worker ([`HELD_UP`], and [`OFTEN_HELD_UP`]
//!   for many brief waits) is not told, which is said once in the log.
//! - Every [`PREPARE_EVERY`] it prepares every handler's statements on its connection
//!   (and drops them): a handler that does not prepare (its table not there yet, a column
//!   renamed, SQL that does not parse) is reported as critical, naming its file and the
//!   error, until it does; its jobs are held meanwhile (`workers.rs`), the other events run.
//!   A prepare waits at most [`PREPARE_LOCK_WAIT`] for another session's lock on a table,
//!   and one that gives up there changes nothing: the check answers on time.
//! - With the prepare, it reads the `--handlers-dir` files again: one that cannot be read
//!   or parsed (a file the service's user may not read) is a warning until it can: the
//!   running handlers stay, but a reload would keep them and the next start would stop.
//! - A commit of the worker's waiting for a synchronous standby past [`SYNC_WAIT_CRIT`]
//!   (the standby down or far behind: the server takes writes, yet no commit that waits
//!   for it ends) is reported as critical, until none waits that long.
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

/// Whether the server takes writes, the shop's sessions running a statement, whether
/// this role may see other roles' session state (`pg_read_all_stats`: without it their
/// state is NULL, and the shop's sessions inside a transaction or a statement are counted
/// instead, from `pg_locks`, which every role may read: each holds its virtual
/// transaction id's lock; so a session idle in its transaction counts too), and whether a new session of this role in this database would start
/// read-only: `default_transaction_read_only` set for the role or the database (`ALTER
/// ROLE ... SET`) applies only to sessions opened after it, so the kept connection, and
/// the workers' open ones, go on writing while every new one (the workers' next, the
/// `/healthz` probe's) is refused (found from outside: `/healthz` red, `stats --check`
/// only a warning). The most specific setting wins, as PostgreSQL applies them. Last, how
/// many shop sessions wait for a lock right now directly behind a session of the worker,
/// however briefly ([`OFTEN_HELD_UP`]; 0 without `pg_read_all_stats`, whose want leaves
/// other roles' wait events NULL). Then how many of the worker's sessions wait for their
/// commit to reach a synchronous standby (`SyncRep`), and the longest of them (s, from its
/// statement's start: the commit is its statement's end): [`SYNC_WAIT_CRIT`].
const ASK: &str = "SELECT current_setting('transaction_read_only') = 'on', \
     CASE WHEN pg_has_role('pg_read_all_stats', 'USAGE') THEN \
     (SELECT count(*) FROM pg_stat_activity \
       WHERE state = 'active' AND backend_type = 'client backend' AND datname = current_database() \
         AND pid <> pg_backend_pid() AND application_name NOT LIKE 'delay-worker%') \
     ELSE (SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
       WHERE l.locktype = 'virtualxid' AND l.granted AND a.datname = current_database() \
         AND a.pid <> pg_backend_pid() AND a.application_name NOT LIKE 'delay-worker%') END, \
     pg_has_role('pg_read_all_stats', 'USAGE'), \
     coalesce((SELECT lower(split_part(c, '=', 2)) ~ '^(on|t|tr|tru|true|y|ye|yes|1)$' \
       FROM pg_db_role_setting s, unnest(s.setconfig) c \
       WHERE c LIKE 'default\\_transaction\\_read\\_only=%' \
         AND s.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = current_user)) \
         AND s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database())) \
       ORDER BY s.setrole <> 0 DESC, s.setdatabase <> 0 DESC LIMIT 1), false), \
     (SELECT count(*) FROM pg_stat_activity s \
       WHERE s.wait_event_type = 'Lock' AND s.backend_type = 'client backend' \
         AND s.datname = current_database() AND s.application_name NOT LIKE 'delay-worker%' \
         AND EXISTS (SELECT 1 FROM unnest(pg_blocking_pids(s.pid)) b \
           JOIN pg_stat_activity w ON w.pid = b WHERE w.application_name LIKE 'delay-worker%')), \
     sync.waiting, sync.longest \
     FROM (SELECT count(*) AS waiting, \
       coalesce(extract(epoch FROM max(clock_timestamp() - query_start)), 0)::float8 AS longest \
       FROM pg_stat_activity \
       WHERE wait_event = 'SyncRep' AND application_name LIKE 'delay-worker%' \
         AND datname = current_database()) sync";

/// The shop's longest lock wait behind the worker's sessions ([`HELD_UP`]): its shop
/// session, how long it has waited (s), the worker's session it waits behind, and how many
/// shop sessions wait so for over `$1` seconds. A shop session counts when a session of
/// `delay-worker` is among those it waits for, directly or through other waiting sessions
/// (`pg_blocking_pids`, four deep; called only for sessions already waiting over `$1`),
/// unless the shop's own transaction, open for over `$1` and not itself waiting for a
/// lock, is among them too: then a long lock of the shop's holds it, the worker's session
/// only queued beside it.
const HELD_UP_ASK: &str = "WITH RECURSIVE shop AS ( \
       SELECT pid, clock_timestamp() - query_start AS waited FROM pg_stat_activity \
       WHERE wait_event_type = 'Lock' AND backend_type = 'client backend' \
         AND datname = current_database() AND application_name NOT LIKE 'delay-worker%' \
         AND query_start < clock_timestamp() - $1::float8 * interval '1 second'), \
     chain(root, pid, depth) AS ( \
       SELECT s.pid, b, 1 FROM shop s, unnest(pg_blocking_pids(s.pid)) b \
       UNION \
       SELECT c.root, b, c.depth + 1 FROM chain c, unnest(pg_blocking_pids(c.pid)) b \
       WHERE c.depth < 4), \
     own AS (SELECT DISTINCT c.root FROM chain c JOIN pg_stat_activity h ON h.pid = c.pid \
       WHERE h.application_name NOT LIKE 'delay-worker%' \
         AND h.wait_event_type IS DISTINCT FROM 'Lock' \
         AND h.xact_start < clock_timestamp() - $1::float8 * interval '1 second'), \
     blame AS (SELECT c.root, min(c.pid) AS worker FROM chain c \
       JOIN pg_stat_activity w ON w.pid = c.pid \
       WHERE w.application_name LIKE 'delay-worker%' \
         AND c.root NOT IN (SELECT root FROM own) GROUP BY c.root) \
     SELECT s.pid, extract(epoch FROM s.waited)::float8, b.worker, \
       (SELECT count(*) FROM blame) \
     FROM shop s JOIN blame b ON b.root = s.pid ORDER BY s.waited DESC LIMIT 1";

/// Of the sessions named as holding the locks jobs wait for, those still inside a
/// transaction (or whose state this role may not see), with when that transaction began
/// and how long ago (seconds; NULL where this role may not see it, and such a session is
/// not followed): the others' transactions, and their locks, have ended ([`LongHolders`]).
/// A transaction that failed ("idle in transaction (aborted)", the shop's PHP code
/// caught an exception and has not rolled back yet) released its locks at the error: it
/// holds none (found from outside: its waiters ran at the end of their backoff, 15–21 s
/// after the error).
const HOLDERS_BUSY: &str = "SELECT pid, extract(epoch FROM xact_start)::float8, \
     extract(epoch FROM now() - xact_start)::float8 FROM pg_stat_activity \
     WHERE pid = ANY($1) \
       AND (state IS NULL OR state NOT IN ('idle', 'idle in transaction (aborted)'))";

/// The prepared transactions as one holder ([`crate::blocker::PREPARED_HOLDER`]), which
/// have no session to follow: the oldest's start and age; no row when there is none. So
/// the end of the oldest, or of the last, ends it (one of several others ending does not:
/// their waiters keep their backoff).
const PREPARED_BUSY: &str = "SELECT 0::int4, extract(epoch FROM min(prepared))::float8, \
     extract(epoch FROM now() - min(prepared))::float8 FROM pg_prepared_xacts \
     HAVING count(*) > 0";

/// A holder's transaction open this long at a look is a long lock, whose end brings its
/// waiters' retries forward. A shop session that locks the same rows again and again in
/// short transactions is never one: its waiters keep their backoff rather than being
/// brought back at every gap between its transactions.
pub const LONG_LOCK: Duration = Duration::from_secs(1);

/// The holders named by waiting jobs that the watch has seen inside one transaction for
/// [`LONG_LOCK`] or more: pid → when that transaction began (epoch seconds).
#[derive(Default)]
pub struct LongHolders(std::collections::HashMap<i32, f64>);

/// One holder's row of [`HOLDERS_BUSY`]: pid, its transaction's start and age.
pub type HolderRow = (i32, Option<f64>, Option<f64>);

impl LongHolders {
    /// One look: `asked`, the holders named now; `busy`, those of them still inside a
    /// transaction (`None`: not known this time). The long holders whose transaction has
    /// ended since the last look (gone, idle, or in a transaction begun since).
    pub fn look(&mut self, asked: &[i32], busy: Option<&[HolderRow]>) -> Vec<i32> {
        let Some(busy) = busy else {
            return Vec::new();
        };
        let mut ended = Vec::new();
        for &(pid, start, age) in busy {
            let (Some(start), Some(age)) = (start, age) else {
                continue;
            };
            if self.0.get(&pid).is_some_and(|was| *was != start) {
                self.0.remove(&pid);
                ended.push(pid);
            }
            if age >= LONG_LOCK.as_secs_f64() {
                self.0.insert(pid, start);
            }
        }
        for pid in asked {
            if !busy.iter().any(|(p, ..)| p == pid) && self.0.remove(pid).is_some() {
                ended.push(*pid);
            }
        }
        self.0.retain(|pid, _| asked.contains(pid));
        ended
    }

    /// The long holders still inside the transaction they were seen in.
    pub fn still_held(&self) -> Vec<i32> {
        self.0.keys().copied().collect()
    }
}

/// How long a shop session may wait for a lock behind the worker's sessions before the
/// watch warns ([`HELD_UP_CRIT`]: critical). A set waits 4 ms for the shop's rows while
/// the shop is busy and a job at most `--lock-timeout`: a shop transaction waiting a
/// second behind them is held up by the drain (rows near their capacity), by a worker
/// paused mid-transaction, or by a slow handler.
pub const HELD_UP: Duration = Duration::from_secs(1);
pub const HELD_UP_CRIT: Duration = Duration::from_secs(5);

/// The role the shop held up is reported under.
pub const SHOP_HELD_UP: &str = "the shop's transactions";

/// A commit of the worker's that has waited this long for a synchronous standby
/// (`synchronous_standby_names`, a `SyncRep` wait) is critical: a standby gone or far
/// behind stops every commit that waits for it, the workers' acknowledgements among them
/// (their jobs' own transactions do not wait: `synchronous_commit=off`), so every job
/// waits, and nothing else tells (the server takes writes, no statement times out: a
/// statement timeout does not end such a wait). Found from outside: a synchronous standby
/// stopped for 40 s stopped every job with `/healthz` 200 and `stats --check` OK
/// throughout. Cleared at the first look that finds no such wait this long.
pub const SYNC_WAIT_CRIT: Duration = Duration::from_secs(2);

/// The role a commit waiting for a synchronous standby is reported under.
pub const SYNC_STANDBY: &str = "synchronous standby";

/// The shop waiting behind the worker's sessions in this many of the last
/// [`OFTEN_LOOKS`] looks (about 5 s), each wait however brief, is a warning: each shop
/// transaction may wait less than [`HELD_UP`], and together they queue for seconds. It
/// does not catch everything: beside a shop that locks 3 hot skus in every transaction
/// (found from outside, its p99 0.35 s from its scheduled start while a drain ran, each
/// transaction under a second in the database), a shop session waited behind a worker's
/// in 11 of 34 looks (the shop's sessions mostly queue behind one another there), and
/// nothing is told (docs/performance.md, "The shop's hot rows").
pub const OFTEN_HELD_UP: usize = 12;
pub const OFTEN_LOOKS: usize = 20;

/// The role the shop often held up is reported under.
pub const SHOP_OFTEN_HELD_UP: &str = "the shop's transactions, often";

/// A shop session waiting behind the worker's ([`HELD_UP_ASK`]).
#[derive(Debug, Clone, PartialEq)]
struct HeldUp {
    shop_pid: i32,
    waited_s: f64,
    worker_pid: i32,
    sessions: i64,
}

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
    /// The shop's longest wait behind the worker's sessions, past [`HELD_UP`].
    held_up: Option<HeldUp>,
    /// The shop's sessions waiting directly behind the worker's now ([`ASK`]).
    held_up_now: i64,
    /// The worker's sessions whose commit waits for a synchronous standby, and the
    /// longest wait (s).
    sync_waits: (i64, f64),
    /// Of the sessions named as holding the locks that jobs wait for, those still inside
    /// a transaction ([`HOLDERS_BUSY`]); `None` when none was named or the question failed.
    holders_busy: Option<Vec<HolderRow>>,
    /// Of the events asked about, how long ago (ms) a job of each last changed something
    /// in any process, within [`crate::stats::CONTENTION_STALL`].
    changed: Vec<(String, i64)>,
}

/// How often, while jobs wait on contention, the watch asks the inbox when a job of
/// their events last changed something in any process ([`crate::stats::Metrics::applied_at`]):
/// an event's queue stands still only when none changed anything anywhere. Found from
/// outside: a process holding one job behind a lock on a few rows, whose peer cancelled
/// an order every 8 s, was red for 54 s, counting only its own changes; and, after a lock
/// every job met, a process was red again for 8 s naming a last job that another ran
/// late, while 1,700 of the event had gone through 30 s before.
const CHANGES_EVERY: Duration = Duration::from_secs(1);

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
        // The last looks: whether the shop waited behind the worker's sessions in each.
        let mut looks: std::collections::VecDeque<bool> =
            std::collections::VecDeque::with_capacity(OFTEN_LOOKS);
        let mut long_holders = LongHolders::default();
        let mut changes_asked: Option<Instant> = None;
        loop {
            let prepare = prepared_at
                .is_none_or(|t| t.elapsed() >= PREPARE_EVERY)
                .then(|| self.handlers.current().0);
            if prepare.is_some() {
                prepared_at = Some(Instant::now());
                self.handlers_folder();
            }
            let holders = self.stats.contention.holders();
            let changes_of = match changes_asked.is_none_or(|t| t.elapsed() >= CHANGES_EVERY) {
                true => self.stats.contention.events(self.stats.clock.now_ms()),
                false => Vec::new(),
            };
            if !changes_of.is_empty() {
                changes_asked = Some(Instant::now());
            }
            match self.ask(&waiting, &mut kept, prepare, (holders.clone(), changes_of)) {
                Ok(seen) => {
                    for (event, age) in &seen.changed {
                        self.stats.jobs.applied_at(event, crate::now_ms() - age);
                    }
                    let ended = long_holders.look(&holders, seen.holders_busy.as_deref());
                    self.stats
                        .contention
                        .holders_ended(&ended, &long_holders.still_held());
                    self.stats.db_unusable.store(false, Ordering::Relaxed);
                    self.handlers_prepared(&seen.prepared);
                    if self.stats.clear_problem(ROLE, i64::MAX) {
                        log::info!("PostgreSQL takes writes again");
                    }
                    if !seen.sees_all && !said_blind {
                        said_blind = true;
                        log::warn!(
                            "the worker's PostgreSQL role may not see other roles' session state: it sees the shop busy from pg_locks (a session idle in its transaction counts as busy), and cannot tell when the shop waits behind the worker's sessions (GRANT pg_read_all_stats to it)"
                        );
                    }
                    self.sync_waits(seen.sync_waits);
                    self.held_up(seen.held_up.as_ref());
                    self.often_held_up(&mut looks, seen.held_up_now);
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
        (holders, changes_of): (Vec<i32>, Vec<String>),
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
                let r = check(
                    &target,
                    &mut client,
                    prepare.as_deref(),
                    (&holders, &changes_of),
                );
                let _ = tx.send((client, r));
                if st.swap(DONE, Ordering::SeqCst) == ABANDONED {
                    w.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| format!("cannot start a check: {e}"))?;
        // A wait this process spent standing still (SIGSTOP, a frozen VM) says nothing of
        // the server: it waits again (found in the tests: a 5 s stop read as "no answer
        // within 5s", CRITICAL "no writable PostgreSQL", as the process came back).
        let asked = Instant::now();
        let answer = rx.recv_timeout(ANSWER_WITHIN).or_else(|e| {
            match self
                .stats
                .stalls
                .stood_still(crate::stall::STALL, asked.elapsed())
            {
                Some(_) => rx.recv_timeout(ANSWER_WITHIN),
                None => Err(e),
            }
        });
        let answer = match answer {
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

    /// Reports the worker's commits waiting for a synchronous standby past
    /// [`SYNC_WAIT_CRIT`] as critical; clears the report once none waits that long.
    fn sync_waits(&self, (sessions, longest_s): (i64, f64)) {
        if sessions == 0 || longest_s < SYNC_WAIT_CRIT.as_secs_f64() {
            if self.stats.clear_problem(SYNC_STANDBY, i64::MAX) {
                log::info!("the worker's commits no longer wait for a synchronous standby");
            }
            return;
        }
        let what = format!(
            "{sessions} of the worker's sessions wait for their commit to reach a synchronous standby, the longest for {longest_s:.0} s: a standby named in synchronous_standby_names is down or far behind (pg_stat_replication on the primary), and every job waits until it is back or the setting is changed; nothing is lost"
        );
        if self
            .stats
            .report_critical_about(SYNC_STANDBY, what.clone(), "waiting".into())
        {
            log::error!("{what}");
        }
    }

    /// Reports a shop session waiting behind the worker's past [`HELD_UP`], critical past
    /// [`HELD_UP_CRIT`]; a look that finds none lowers a critical report to a warning,
    /// which lasts its window (found from outside: a drain on a few hot rows held the
    /// shop's transactions up for tens of seconds while health stayed green).
    fn held_up(&self, seen: Option<&HeldUp>) {
        let ms = seen.map_or(0, |h| (h.waited_s * 1000.0) as u64);
        self.stats.shop_held_up_ms.store(ms, Ordering::Relaxed);
        let Some(h) = seen else {
            self.stats.ease(SHOP_HELD_UP);
            return;
        };
        let what = format!(
            "the shop's session {} has waited {:.1} s for a lock behind the worker's session {} ({} shop session{} waiting over {} s behind the worker's): the worker holds the shop up (rows the drain and the shop both need, a worker paused mid-transaction, a slow handler)",
            h.shop_pid,
            h.waited_s,
            h.worker_pid,
            h.sessions,
            if h.sessions == 1 { "" } else { "s" },
            HELD_UP.as_secs()
        );
        let critical = h.waited_s >= HELD_UP_CRIT.as_secs_f64();
        let gist = if critical { "critical" } else { "warning" }.to_string();
        let log = if critical {
            self.stats
                .report_critical_about(SHOP_HELD_UP, what.clone(), gist)
        } else {
            self.stats
                .report_trouble_about(SHOP_HELD_UP, what.clone(), gist)
        };
        if log {
            log::warn!("{what}");
        }
    }

    /// Counts this look in the last [`OFTEN_LOOKS`]; reports a warning while the shop
    /// waited behind the worker's sessions in [`OFTEN_HELD_UP`] of them or more (the
    /// report lasts its window once the waits end).
    fn often_held_up(&self, looks: &mut std::collections::VecDeque<bool>, now: i64) {
        if looks.len() == OFTEN_LOOKS {
            looks.pop_front();
        }
        looks.push_back(now > 0);
        let held = looks.iter().filter(|h| **h).count();
        if looks.len() < OFTEN_LOOKS || held < OFTEN_HELD_UP {
            return;
        }
        let what = format!(
            "the shop's sessions waited for locks behind the worker's in {held} of the last {} looks ({:.0} s), each briefly: the drain holds the shop up on rows both need (a few hot rows); a --max-rate for the drain eases it",
            looks.len(),
            (EVERY * looks.len() as u32).as_secs_f64()
        );
        if self
            .stats
            .report_trouble_about(SHOP_OFTEN_HELD_UP, what.clone(), "warning".into())
        {
            log::warn!("{what}");
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
    (holders, changes_of): (&[i32], &[String]),
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
            let held_up_now: i64 = row.try_get(4).map_err(|e| db::error_text(&e))?;
            let sync_waiting: i64 = row.try_get(5).map_err(|e| db::error_text(&e))?;
            let sync_waited: f64 = row.try_get(6).map_err(|e| db::error_text(&e))?;
            if new_read_only && !read_only {
                return Err(NEW_SESSIONS_READ_ONLY.to_string());
            }
            Ok((
                read_only,
                Seen {
                    busy,
                    sees_all,
                    prepared: Vec::new(),
                    held_up: None,
                    held_up_now,
                    sync_waits: (sync_waiting, sync_waited),
                    holders_busy: None,
                    changed: Vec::new(),
                },
            ))
        });
    match answer {
        Ok((false, mut seen)) => {
            // Other roles' waits are seen only with `pg_read_all_stats`; a server that
            // cannot answer it (no `pg_blocking_pids`) tells nothing of it.
            if seen.sees_all {
                seen.held_up = c
                    .query_opt(HELD_UP_ASK, &[&HELD_UP.as_secs_f64()])
                    .ok()
                    .flatten()
                    .and_then(|r| {
                        Some(HeldUp {
                            shop_pid: r.try_get(0).ok()?,
                            waited_s: r.try_get(1).ok()?,
                            worker_pid: r.try_get(2).ok()?,
                            sessions: r.try_get(3).ok()?,
                        })
                    });
            }
            // Only while jobs wait for a lock whose holder was named: nothing otherwise.
            if !holders.is_empty() {
                let prepared = holders.contains(&crate::blocker::PREPARED_HOLDER);
                let rows = c.query(HOLDERS_BUSY, &[&holders]).and_then(|mut rows| {
                    if prepared {
                        rows.extend(c.query(PREPARED_BUSY, &[])?);
                    }
                    Ok(rows)
                });
                seen.holders_busy = rows.ok().map(|rows| {
                    rows.iter()
                        .filter_map(|r| {
                            let secs = |i| r.try_get::<_, Option<f64>>(i).ok().flatten();
                            Some((r.try_get(0).ok()?, secs(1), secs(2)))
                        })
                        .collect()
                });
            }
            let within = crate::stats::CONTENTION_STALL.as_millis() as i64;
            for event in changes_of {
                match crate::workers::session::last_change(c, event, within) {
                    Ok(Some(age)) => seen.changed.push((event.clone(), age)),
                    Ok(None) => {}
                    Err(e) => log::debug!(
                        "cannot ask the inbox when a job of {event} last changed something: {}",
                        db::error_text(&e)
                    ),
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_holder_seen_in_one_long_transaction_is_ended() {
        let mut h = LongHolders::default();
        // A shop session locking the rows again and again, each transaction short: never
        // long, so its gaps end nothing.
        assert!(h
            .look(&[7], Some(&[(7, Some(100.0), Some(0.01))]))
            .is_empty());
        assert!(h.look(&[7], Some(&[])).is_empty(), "idle between two");
        assert!(h
            .look(&[7], Some(&[(7, Some(100.3), Some(0.02))]))
            .is_empty());
        // A session holding one transaction open past LONG_LOCK, then gone or idle.
        assert!(h.look(&[8], Some(&[(8, Some(50.0), Some(0.5))])).is_empty());
        assert!(h.look(&[8], Some(&[(8, Some(50.0), Some(1.5))])).is_empty());
        assert!(h.look(&[8], None).is_empty(), "not known this time");
        assert!(h.look(&[8], Some(&[(8, Some(50.0), Some(9.0))])).is_empty());
        assert_eq!(h.look(&[8], Some(&[])), vec![8]);
        assert!(h.look(&[8], Some(&[])).is_empty(), "once");
        // Its transaction ended and another began between two looks.
        h.look(&[9], Some(&[(9, Some(10.0), Some(2.0))]));
        assert_eq!(h.look(&[9], Some(&[(9, Some(12.5), Some(0.1))])), vec![9]);
        // A state this role may not see: nothing known, nothing ended.
        assert!(h.look(&[5], Some(&[(5, None, None)])).is_empty());
        assert!(h.look(&[5], Some(&[])).is_empty());
        // A holder no waiter names any more is forgotten.
        h.look(&[6], Some(&[(6, Some(1.0), Some(3.0))]));
        h.look(&[], Some(&[]));
        assert!(h.look(&[6], Some(&[])).is_empty());
    }
}
