//! A worker's PostgreSQL session: one pooled connection with every statement prepared on
//! it once, and the three ways jobs run on it: alone, as a set through the handler's set
//! form, or several in one transaction (`--tx-batch`).
//!
//! Every failure becomes a [`Failure`] carrying its [`Fault`] (`db::classify`): whose fault
//! it is decides what becomes of the job (`workers.rs`). A handler whose statements do not
//! prepare (a table not there yet, SQL that does not parse) fails only its own jobs, with
//! a schema fault, and is prepared again every [`REPREPARE_EVERY`]; the others run.
//!
//! A set waits for row locks at most a fifth of `--lock-timeout` (`SET LOCAL` in the same
//! round trip as its `BEGIN`; a twenty-fifth while the shop is busy). A set that meets
//! contention is tried again whole a few times, then split in halves and run
//! again, down to single jobs, and its event's set size halves (`manners.rs`): the worker
//! never waits on the shop's locks while holding many rows of its own. A set that fails for
//! another reason runs job by job, so one bad job never fails its neighbours.

use crate::db::{self, Fault};
use crate::delivery::Delivery;
use crate::handlers::{Effect, Handler, Registry};
use crate::manners::Manners;
use crate::message::Envelope;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use postgres::types::Type;
use postgres::Statement;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// How long ago (ms) a job of `event` last changed something, in any process, if within
/// `within_ms`, by the inbox rows' start time on the server's own clock.
pub fn last_change(
    conn: &mut postgres::Client,
    event: &str,
    within_ms: i64,
) -> Result<Option<i64>, postgres::Error> {
    let row = conn.query_opt(
        "SELECT (extract(epoch FROM now() - processed_at) * 1000)::bigint \
         FROM worker_inbox \
         WHERE processed_at > now() - $2::bigint * interval '1 millisecond' \
         AND event = $1 AND outcome = 'done' \
         ORDER BY processed_at DESC LIMIT 1",
        &[&event, &within_ms],
    )?;
    Ok(row.map(|r| r.get::<_, i64>(0).max(0)))
}

/// How often a handler that did not prepare is tried again (when a job of it comes).
pub const REPREPARE_EVERY: Duration = Duration::from_secs(2);

/// Tries of a set, in all, before a set that meets contention is split
/// ([`Session::run_set_tries`]). Split at the first, a drain on a few hot skus beside the
/// shop's own traffic on them went down to single jobs, each taking the skus a set takes
/// once, their brief waits missed and retried: measured with `scripts/bench.sh shop
/// --no-ceilings --skus 3 --shop-rate 400 --shop-backlog 3000 --shop-alone 10s`, the drain
/// at 339–596 jobs/s (0.02–0.04× alone) and the shop's p99 17–52 ms in 3 runs of 3; tried
/// four times (as now, with the pause), 5,499 and 4,938 jobs/s (0.47× and 0.39×, the
/// second 2 minutes overdue) and 13–17 ms in 2 runs of 3, the third tipped as before
/// (534 jobs/s, 73 ms). Eight tries (without the pause) kept 3 of 3 such runs whole, but a
/// backlog 2 minutes overdue then tipped in 3 of 3 (p99 332–474 ms): the retries hold the
/// rows the set locked before.
pub const SET_TRIES: u32 = 4;

/// The pause before a set's next try, spread by half either way: about a shop
/// transaction's own time, so that a row it held is free.
pub const SET_RETRY_PAUSE: Duration = Duration::from_millis(2);

/// Why a statement, a transaction or a preparation failed, and whose fault it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub fault: Fault,
    /// The server's message and SQLSTATE, or the client's error.
    pub reason: String,
    /// What a lock or statement timeout waited on, for the look-up of who held it.
    pub wait: Option<crate::blocker::LockWait>,
    /// A data exception (class `22`: a cast, an overflow) raised by the handler's own
    /// statement, not inside a function or a trigger: the job's data, whatever the shop
    /// does (see [`db::own_data`]).
    pub own_data: bool,
    /// Such a data exception whose message quotes no value, not raised while reading the
    /// payload (see [`db::stored_data`]): the shop's stored rows as likely as the job's data.
    pub stored_data: bool,
    /// The statement was cancelled (57014): it ran out `--statement-timeout`, or an
    /// operator cancelled it. A set that was is not split: each half would spend the
    /// whole timeout again.
    pub cancelled: bool,
    /// The failure was a whole set's, and which of its jobs caused it is not known (a set
    /// that ran out of time): none of them is charged a retry for it.
    pub shared: bool,
}

impl Failure {
    /// Whether it waited for another transaction's lock, a row's or a whole table's: a
    /// lock timeout, or a statement timeout that names the row or whose holder was found
    /// holding the table (found from outside: with `--lock-timeout 10s
    /// --statement-timeout 1s`, 17 of 50 jobs behind a `LOCK TABLE` were dead letters).
    /// Such a wait is the surroundings' fault however long it lasts.
    pub fn waited_for_lock(&self) -> bool {
        self.wait
            .as_ref()
            .is_some_and(|w| !self.cancelled || w.row.is_some() || w.table)
    }
}

impl From<postgres::Error> for Failure {
    fn from(e: postgres::Error) -> Failure {
        Failure {
            fault: db::classify(&e),
            reason: db::error_text(&e),
            wait: crate::blocker::lock_wait(&e),
            own_data: db::own_data(&e),
            stored_data: db::stored_data(&e),
            cancelled: e.code() == Some(&postgres::error::SqlState::QUERY_CANCELED),
            shared: false,
        }
    }
}

/// How one job ended in PostgreSQL.
#[derive(Debug)]
pub enum JobResult {
    Committed(Effect),
    Duplicate,
    Failed(Failure),
    Panicked(String),
    /// The job's inbox insert waited on the inbox row of the same job, inserted by another
    /// transaction that has not ended: a second delivery of a job that is running now.
    /// When that transaction is a live worker's (an entry reclaimed from a worker still
    /// at it), it decides the job, and this delivery must not (see `Worker::finish`). One
    /// whose worker is gone ([`Delivery::holder_gone`]), and any list copy, is waited
    /// out first and the job run again ([`Session::run_job`]).
    ///
    /// [`Delivery::holder_gone`]: crate::delivery::Delivery::holder_gone
    RunningElsewhere,
    /// Not run: while this worker waited for PostgreSQL its stream entry was taken over by
    /// a peer (this process had none usable, and said so), or settled by one. The peer
    /// decides the job; this delivery settles nothing.
    TakenOver,
}

/// A delivery that decoded and has a handler: ready for the database.
#[derive(Clone)]
pub struct Job<'h> {
    pub d: Delivery,
    pub env: Envelope,
    /// The handler's position in the registry (and of its statements in a session).
    pub index: usize,
    pub handler: &'h dyn Handler,
    /// The inbox's text form of the job key.
    pub key: String,
    /// When the job first fell due (unix ms, Redis's clock): the message's `first_due`,
    /// else the due time its stream entry carries; `None` when neither says.
    pub first_due: Option<i64>,
    /// The consumer that runs it, and the clock its lateness is read on: both go into its
    /// inbox row.
    pub consumer: &'h str,
    pub clock: &'h crate::clock::Clock,
    /// Its try waits a fifth of `--lock-timeout` for a lock: its last try waited in vain
    /// for one ([`Envelope::waited_lock`]), less than [`BRIEF_LOCKS_FOR`] (and half of
    /// `--retry-for`) after its due time.
    ///
    /// [`BRIEF_LOCKS_FOR`]: crate::workers::BRIEF_LOCKS_FOR
    pub brief_lock: bool,
    /// Less than [`BRIEF_LOCKS_FOR`] (and half of `--retry-for`) after its due time: while
    /// its event's sets are being split it waits as briefly ([`Manners::splitting`]); an
    /// older job waits the whole `--lock-timeout`, so that a row the shop keeps busy is
    /// got in the end.
    ///
    /// [`BRIEF_LOCKS_FOR`]: crate::workers::BRIEF_LOCKS_FOR
    pub young: bool,
}

impl Job<'_> {
    /// How late the job runs now, for its inbox row: from its first due time on Redis's
    /// clock (this host's, corrected).
    fn late_ms(&self) -> Option<i64> {
        self.first_due.map(|due| self.clock.now_ms() - due)
    }
}

/// Told of the jobs of each transaction as it begins (its `BEGIN` answered) and as it
/// ends, and asked which jobs run in a transaction of their own: the worker counts the
/// starts of jobs delivered before in Redis, so that a message that kills its consumer
/// (its job started `--max-deliveries` times and its process never saw the end) is told
/// from one held unrun, or cut short by the surroundings (see `Worker::run_paced`).
pub trait Starts {
    /// Whether `job` runs alone, in no set or batch: it started before, and its process
    /// did not see the end, so it may be one that kills its consumer, and must not take
    /// a set's other jobs with it.
    fn alone(&self, job: &Job<'_>) -> bool;
    /// The transaction of `jobs` has begun.
    fn begin(&mut self, jobs: &[&Job<'_>]);
    /// The transaction of `jobs` has ended, however: committed (with group commit, maybe
    /// not durably), failed, or cut short by the server.
    fn end(&mut self, jobs: &[&Job<'_>]);
}

/// A handler's statements on this connection, or why they could not be prepared.
enum Prepared {
    Ready {
        one: Vec<Statement>,
        /// The set form, if it has one that keeps its contract.
        set: Option<Statement>,
    },
    Failed {
        failure: Failure,
        at: Instant,
    },
}

/// Why a session could not be opened: its jobs wait for a new one.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no database connection: {0}")]
    Checkout(#[from] r2d2::Error),
    #[error("cannot prepare the inbox statement: {}", .0.reason)]
    Inbox(Failure),
    #[error("the connection failed while preparing the handlers: {}", .0.reason)]
    Lost(Failure),
}

/// A worker's PostgreSQL connection with its statements prepared once.
pub struct Session {
    conn: db::Conn,
    inbox: Statement,
    /// The inbox insert of a whole set.
    inbox_set: Statement,
    /// `handlers[i]`: the registry's handler `i`.
    handlers: Vec<Prepared>,
    /// `BEGIN` of a set, with its short lock timeout: `[quiet, busy]`, the second while the
    /// shop is busy ([`crate::config::busy_set_lock_ms`]).
    begin_set: [String; 2],
    /// `SET LOCAL` of the connection's own lock timeout, which a job's transaction that
    /// waited without one for its inbox row goes back to before its handler runs.
    lock_timeout_back: String,
    /// `SET LOCAL` of a set's short lock timeout, `[quiet, busy]` as [`Session::begin_set`],
    /// which a job that waited in vain for a lock at its last try runs under
    /// ([`Job::brief_lock`]), and a job of an event whose sets are being split
    /// ([`Manners::splitting`]).
    short_lock: [String; 2],
    /// Who held the lock a job waited for, looked up after its timeout (rate-limited).
    looker: crate::blocker::Looker,
}

/// The inbox insert. Its row says whether this job is new (a row) or a redelivery (none).
/// A job is its key, the mover's `job_id` stamp and `ts` (see `message.rs`). The row also
/// records how late the job ran, the consumer, and the outcome `done`; a job that turns out
/// a no-op has that changed in the round trip of its commit ([`commit_sql`]), by the row's
/// `ctid`, which the insert returns.
const INBOX_SQL: &str = "INSERT INTO worker_inbox \
                         (job_key, enqueued_at, event, job_id, outcome, late_ms, consumer) \
                         VALUES ($1, $2, $3, $4, 'done', $5, $6) ON CONFLICT DO NOTHING \
                         RETURNING ctid::text";

/// The inbox insert of a set: one statement for all its rows. It returns the rows it
/// inserted; a job whose row is not among them is a redelivery.
const INBOX_SET_SQL: &str = "INSERT INTO worker_inbox \
                             (job_key, enqueued_at, event, job_id, outcome, late_ms, consumer) \
                             SELECT k, t, e, i, 'done', l, $6 \
                             FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::bigint[]) \
                             AS u(k, t, e, i, l) \
                             ON CONFLICT DO NOTHING RETURNING job_key, enqueued_at, job_id, ctid::text";

/// The statement that ends a job's (or a set's, or a batch's) transaction: `COMMIT`, after
/// the outcome `noop` is written into the inbox rows (by their `ctid`, as the inserts
/// returned them) of the jobs that changed nothing. Both go in one simple query, the one
/// round trip `COMMIT` takes alone. A ctid not of the form `(block,offset)` is left out
/// (its row keeps `done`): nothing but digits goes into the statement.
fn commit_sql(noops: &[String]) -> String {
    let tids: Vec<String> = noops
        .iter()
        .filter(|t| is_tid(t))
        .map(|t| format!("\"{t}\""))
        .collect();
    if tids.is_empty() {
        return "COMMIT".to_string();
    }
    format!(
        "UPDATE worker_inbox SET outcome = 'noop' WHERE ctid = ANY ('{{{}}}'::tid[]); COMMIT",
        tids.join(",")
    )
}

/// `(block,offset)`, digits only: a ctid as PostgreSQL writes it.
fn is_tid(t: &str) -> bool {
    t.strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .and_then(|t| t.split_once(','))
        .is_some_and(|(b, o)| {
            [b, o]
                .iter()
                .all(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
        })
}

/// Commits `tx` with [`commit_sql`]: one round trip, as [`postgres::Transaction::commit`].
/// With no-ops to write, the simple query does the `COMMIT` itself, and the transaction's
/// handle is then forgotten: dropping it would send a `ROLLBACK` (one more round trip, and
/// a warning) after the commit. If the query fails, the handle is dropped as usual and
/// rolls back whatever is left of the transaction.
fn commit(mut tx: postgres::Transaction<'_>, noops: &[String]) -> Result<(), postgres::Error> {
    let sql = commit_sql(noops);
    if sql == "COMMIT" {
        return tx.commit();
    }
    tx.batch_execute(&sql)?;
    std::mem::forget(tx);
    Ok(())
}

impl Session {
    /// Checks a connection out and prepares the inbox and every handler on it. A handler
    /// that does not prepare is kept as such (its jobs fail with the reason); only the
    /// inbox, or a connection lost meanwhile, fails the session.
    pub fn open(
        pool: &db::Pool,
        registry: &Registry,
        lock_timeout: Duration,
    ) -> Result<Session, SessionError> {
        let mut conn = pool.get()?;
        // A connection that cannot prepare the worker's own statement is not handed out
        // again: what it lacks may be its session's (a `search_path` the role had when
        // it connected; found from outside, `ALTER ROLE ... SET search_path` undone left
        // the pool's sessions failing, and health red, for minutes), and the next one
        // takes the role's settings as they are then.
        let (inbox, inbox_set) = match conn
            .prepare(INBOX_SQL)
            .and_then(|one| Ok((one, conn.prepare(INBOX_SET_SQL)?)))
        {
            Ok(both) => both,
            Err(e) => {
                let failure: Failure = e.into();
                // Another transaction's lock on the inbox says nothing of this session.
                if failure.fault != Fault::Contention {
                    conn.discard();
                }
                return Err(SessionError::Inbox(failure));
            }
        };
        let mut handlers = Vec::new();
        for h in registry.iter() {
            let prepared = prepare(&mut conn, h);
            if let Prepared::Failed { failure, .. } = &prepared {
                if failure.fault == Fault::Server {
                    conn.discard();
                    return Err(SessionError::Lost(failure.clone()));
                }
            }
            handlers.push(prepared);
        }
        let set_lock_ms = crate::config::set_lock_ms(lock_timeout);
        let busy_set_lock_ms = crate::config::busy_set_lock_ms(lock_timeout);
        Ok(Session {
            conn,
            inbox,
            inbox_set,
            handlers,
            begin_set: [
                format!("BEGIN; SET LOCAL lock_timeout = {set_lock_ms}"),
                format!("BEGIN; SET LOCAL lock_timeout = {busy_set_lock_ms}"),
            ],
            lock_timeout_back: format!(
                "SET LOCAL lock_timeout = {}",
                lock_timeout.as_millis().max(1)
            ),
            short_lock: [
                format!("SET LOCAL lock_timeout = {set_lock_ms}"),
                format!("SET LOCAL lock_timeout = {busy_set_lock_ms}"),
            ],
            looker: crate::blocker::Looker::default(),
        })
    }

    /// Prepares the handlers of a new registry (a reload) on this connection, in place of
    /// the old ones. Fails only when the connection does.
    pub fn reprepare(&mut self, registry: &Registry) -> Result<(), SessionError> {
        let mut handlers = Vec::new();
        for h in registry.iter() {
            let prepared = prepare(&mut self.conn, h);
            if let Prepared::Failed { failure, .. } = &prepared {
                if failure.fault == Fault::Server {
                    return Err(SessionError::Lost(failure.clone()));
                }
            }
            handlers.push(prepared);
        }
        self.handlers = handlers;
        Ok(())
    }

    /// The handlers whose statements did not prepare, by event, with the reason.
    pub fn unprepared<'r>(&self, registry: &'r Registry) -> Vec<(&'r str, &Failure)> {
        registry
            .iter()
            .zip(&self.handlers)
            .filter_map(|(h, p)| match p {
                Prepared::Failed { failure, .. } => Some((h.event(), failure)),
                Prepared::Ready { .. } => None,
            })
            .collect()
    }

    /// How long ago (ms) the newest job of `event` that changed something committed, in
    /// any process, if one did within the last `within_ms`: the inbox rows' outcome
    /// `done`, by their start time on the server's own clock (`processed_at`, indexed).
    pub fn applied_within(
        &mut self,
        event: &str,
        within_ms: i64,
    ) -> Result<Option<i64>, postgres::Error> {
        last_change(&mut self.conn, event, within_ms)
    }

    /// Whether jobs of `event` changed something in each third of the span from `from_ms`
    /// to `to_ms` ago (`from_ms` > `to_ms`), in any process, by the inbox rows' start time
    /// on the server's own clock: jobs of it went through all along, not in one gap.
    pub fn applied_throughout(
        &mut self,
        event: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<bool, postgres::Error> {
        let third = (from_ms - to_ms) / 3;
        let row = self.conn.query_one(
            "SELECT bool_and(EXISTS (SELECT 1 FROM worker_inbox \
                 WHERE processed_at > now() - (e + $3::bigint) * interval '1 millisecond' \
                 AND processed_at <= now() - e * interval '1 millisecond' \
                 AND event = $1 AND outcome = 'done')) \
             FROM unnest(ARRAY[$2::bigint, $2::bigint + $3::bigint, $2::bigint + 2 * $3::bigint]) e",
            &[&event, &to_ms, &third],
        )?;
        Ok(row.get::<_, Option<bool>>(0).unwrap_or(false))
    }

    /// The connection, for the WAL flush.
    pub fn client(&mut self) -> &mut postgres::Client {
        &mut self.conn
    }

    /// Who holds what a failed statement of this session waited for (a lock or statement
    /// timeout), in words ([`crate::blocker`]); its transaction must have ended.
    pub fn holder_of(&mut self, e: &postgres::Error) -> Option<String> {
        let wait = crate::blocker::lock_wait(e)?;
        self.looker.holder(&mut self.conn, &wait)
    }

    /// Closes the connection instead of handing it back to the pool (it failed, or may
    /// be mid-transaction).
    pub fn discard(mut self) {
        self.conn.discard();
    }

    /// Handler `index` ready to run: prepared now if it failed before and
    /// [`REPREPARE_EVERY`] has passed, or if it failed on contention (a lock on a table
    /// it names, past the lock timeout: the prepare waits for it as the job would);
    /// otherwise its failure. A lock met at a prepare was kept as the job's failure for
    /// 2 s: jobs brought back as that lock ended failed at once with it, and went back
    /// for their whole backoff, up to 30 s.
    fn ready(&mut self, index: usize, handler: &dyn Handler) -> Result<(), Failure> {
        match &self.handlers[index] {
            Prepared::Ready { .. } => Ok(()),
            Prepared::Failed { at, failure }
                if at.elapsed() < REPREPARE_EVERY && failure.fault != Fault::Contention =>
            {
                Err(failure.clone())
            }
            Prepared::Failed { .. } => {
                self.handlers[index] = prepare(&mut self.conn, handler);
                match &self.handlers[index] {
                    Prepared::Failed { failure, .. } => Err(failure.clone()),
                    Prepared::Ready { .. } => {
                        log::info!("the handler of {:?} prepared", handler.event());
                        Ok(())
                    }
                }
            }
        }
    }

    /// A job of handler `index` met a schema fault: prepare it again before its next
    /// job (a plan that must change its result type needs a new statement).
    fn stale(&mut self, index: usize, failure: &Failure) {
        self.handlers[index] = Prepared::Failed {
            failure: failure.clone(),
            at: Instant::now() - REPREPARE_EVERY,
        };
    }

    /// Runs the jobs a worker took together: those of an event with a set form, two or
    /// more, as sets of the event's current size ([`Manners::set_size`]); the rest alone,
    /// or `tx_batch` at a time in one transaction. One result per job, in order.
    pub fn run(
        &mut self,
        jobs: &[Job<'_>],
        cfg: &crate::config::JobConfig,
        (manners, shutdown): (&Manners, &Shutdown),
        in_sets: &AtomicU64,
        starts: &mut dyn Starts,
    ) -> Vec<JobResult> {
        let mut results: Vec<Option<JobResult>> = jobs.iter().map(|_| None).collect();
        let mut sets: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut alone = Vec::new();
        for (k, job) in jobs.iter().enumerate() {
            if let Err(f) = self.ready(job.index, job.handler) {
                results[k] = Some(JobResult::Failed(f));
                continue;
            }
            match &self.handlers[job.index] {
                Prepared::Ready { set: Some(_), .. }
                    if cfg.set_size > 1 && jobs.len() > 1 && !starts.alone(job) =>
                {
                    sets.entry(job.index).or_default().push(k)
                }
                _ => alone.push(k),
            }
        }
        for ks in sets.into_values() {
            let size = manners
                .set_size(&jobs[ks[0]].env.event)
                .min(cfg.set_size)
                .max(1);
            for chunk in ks.chunks(size) {
                if chunk.len() < 2 {
                    alone.extend_from_slice(chunk);
                    continue;
                }
                let set: Vec<(usize, &Job<'_>)> = chunk.iter().map(|&k| (k, &jobs[k])).collect();
                for (k, r) in self.run_set_or_split(
                    &set,
                    SET_TRIES,
                    (manners, shutdown),
                    in_sets,
                    &mut alone,
                    starts,
                ) {
                    results[k] = Some(r);
                }
            }
        }
        alone.sort_unstable();
        for chunk in alone.chunks(cfg.tx_batch.max(1)) {
            let batch: Vec<&Job<'_>> = chunk.iter().map(|&k| &jobs[k]).collect();
            let rs = match batch.as_slice() {
                [job] => vec![self.run_job(job, manners, shutdown, starts)],
                _ if batch.iter().any(|job| starts.alone(job)) => batch
                    .iter()
                    .map(|job| self.run_job(job, manners, shutdown, starts))
                    .collect(),
                _ => {
                    let inside = manners.enter(shutdown);
                    let ran = self.run_batch(&batch, starts);
                    // The jobs of a batch that failed go through the gate each on its own.
                    drop(inside);
                    ran.unwrap_or_else(|| {
                        batch
                            .iter()
                            .map(|job| self.run_job(job, manners, shutdown, starts))
                            .collect()
                    })
                }
            };
            for (&k, r) in chunk.iter().zip(rs) {
                results[k] = Some(r);
            }
        }
        // Every transaction has ended: who held the lock a job timed out on is asked on
        // this connection now, on this failure path alone (rate-limited, `blocker.rs`).
        for r in results.iter_mut() {
            if let Some(JobResult::Failed(f)) = r {
                // Kept: a wait that names no row is looked up as a whole table's.
                if let Some(wait) = f.wait.clone() {
                    if let Some(holder) = self.looker.holder(&mut self.conn, &wait) {
                        // Without a row, a holder is found only holding the table.
                        if let (None, Some(w)) = (&wait.row, f.wait.as_mut()) {
                            w.table = true;
                        }
                        f.reason = format!("{}: {holder}", f.reason);
                    }
                }
            }
        }
        for (job, r) in jobs.iter().zip(&results) {
            if let Some(JobResult::Failed(f)) = r {
                if f.fault == Fault::Schema {
                    self.stale(job.index, f);
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every job ran"))
            .collect()
    }

    /// One set, or, when it meets contention, its two halves (each a set again, or a
    /// single job); a set that fails otherwise runs job by job. The single jobs of halves
    /// go to `alone`, to run after every set of the batch: each may wait out a lock
    /// timeout, and the other sets' jobs, which met no lock, go first.
    fn run_set_or_split(
        &mut self,
        set: &[(usize, &Job<'_>)],
        tries: u32,
        (manners, shutdown): (&Manners, &Shutdown),
        in_sets: &AtomicU64,
        alone: &mut Vec<usize>,
        starts: &mut dyn Starts,
    ) -> Vec<(usize, JobResult)> {
        let event = set[0].1.env.event.as_str();
        let jobs: Vec<&Job<'_>> = set.iter().map(|(_, j)| *j).collect();
        manners.pause(shutdown);
        let failure = match self.run_set_tries(&jobs, tries, (manners, shutdown), starts) {
            Ok(rs) => {
                let changed = rs
                    .iter()
                    .any(|r| matches!(r, JobResult::Committed(e) if *e != Effect::NoOp));
                manners.committed(event, changed);
                manners.went_through(rs.len());
                Stats::add(in_sets, rs.len() as u64);
                return set.iter().map(|(k, _)| *k).zip(rs).collect();
            }
            Err(SetError::Index(i)) => {
                log::warn!(
                    "a set of {} {} jobs failed, so they run one by one: the set form returned index {i}, not one of a new job of the set, or twice",
                    set.len(),
                    jobs[0].env.event
                );
                None
            }
            Err(SetError::Db(f)) => Some(f),
        };
        let each_failed = |f: Failure| {
            set.iter()
                .map(|(k, _)| (*k, JobResult::Failed(f.clone())))
                .collect()
        };
        match failure {
            // The connection is gone: every job waits for the next one.
            Some(f) if f.fault == Fault::Server => each_failed(f),
            // A set that ran out the statement timeout (a slow trigger, a shop function
            // waiting on something that is not a row lock): its halves would each spend
            // it again, 2n - 1 timeouts before any job is settled. Every job of it goes
            // back, charged nothing (which one was slow is not known), and the event's
            // next sets are smaller, down to single jobs, where a slow one is charged.
            Some(f) if f.fault == Fault::Contention && f.cancelled => {
                manners.contended(event);
                log::debug!(
                    "a set of {} {} jobs ran out of time, so they go back: {}",
                    set.len(),
                    jobs[0].env.event,
                    f.reason
                );
                each_failed(Failure { shared: true, ..f })
            }
            Some(f) if f.fault == Fault::Contention => {
                manners.contended(event);
                log::debug!(
                    "a set of {} {} jobs met contention, so it runs in halves: {}",
                    set.len(),
                    jobs[0].env.event,
                    f.reason
                );
                let (a, b) = set.split_at(set.len() / 2);
                let mut out = Vec::with_capacity(set.len());
                for half in [a, b] {
                    match half {
                        [] => {}
                        [(k, _)] => alone.push(*k),
                        _ => out.extend(self.run_set_or_split(
                            half,
                            1,
                            (manners, shutdown),
                            in_sets,
                            alone,
                            starts,
                        )),
                    }
                }
                out
            }
            other => {
                if let Some(f) = other.filter(|f| f.fault == Fault::Schema) {
                    log::warn!(
                        "a set of {} {} jobs failed, so they run one by one: {}",
                        set.len(),
                        jobs[0].env.event,
                        f.reason
                    );
                }
                set.iter()
                    .map(|(k, job)| (*k, self.run_job(job, manners, shutdown, starts)))
                    .collect()
            }
        }
    }

    /// [`Session::run_set`], tried again whole, up to `most` tries in all ([`SET_TRIES`]
    /// for a set as taken, one for the halves of a split one), when it missed its brief
    /// wait for a row (or met a deadlock): a row the shop keeps busy is free again within
    /// milliseconds, and a set takes each shared row (a sku, a coupon) once for all its
    /// jobs, where its halves take it once each. A set that misses every try is split as
    /// before: a row held for long is found by its halves.
    ///
    /// A set's first miss counts as contention met while the shop is busy
    /// ([`Manners::met_contention`]), and its next tries wait out the workers' pause: tried
    /// again only 2 ms apart, beside a shop that locked its 3 skus in every transaction at
    /// 400 a second (found from outside), the shop's transactions took 1.4–2.4 s on
    /// average in the worst seconds of a drain, where sets split at the first miss held
    /// them to 121–164 ms; with the pause 9.5–54 ms, in two runs each. Counting every miss, not only the first,
    /// paused every worker while a long lock on one order in eleven failed nearly every
    /// set (`shopdb::a_long_shop_lock_while_the_shop_is_busy_holds_up_only_the_orders_that_need_its_rows`).
    fn run_set_tries(
        &mut self,
        jobs: &[&Job<'_>],
        most: u32,
        (manners, shutdown): (&Manners, &Shutdown),
        starts: &mut dyn Starts,
    ) -> Result<Vec<JobResult>, SetError> {
        let mut tries = 1;
        // One place in the gate for all the set's tries: let in between them, the other
        // workers' tries met the same hot rows, and a shop that locks every one of them in
        // each transaction waited seconds (docs/performance.md, "The shop's hot rows").
        let _inside = manners.enter(shutdown);
        loop {
            // Tried again, it waits as briefly as while the shop is busy: it missed a
            // row once, and holds the rows it locked before the one it waits for.
            let busy = tries > 1 || manners.yielding();
            match self.run_set(jobs, busy, starts) {
                Err(SetError::Db(f))
                    if tries < most && f.fault == Fault::Contention && !f.cancelled =>
                {
                    if tries == 1 {
                        manners.met_contention();
                    }
                    tries += 1;
                    std::thread::sleep(SET_RETRY_PAUSE.mul_f64(0.5 + fastrand::f64()));
                    manners.pause(shutdown);
                }
                r => return r,
            }
        }
    }

    /// One job in one transaction: the inbox row first, then the handler, then commit.
    /// Dropping the transaction on an error rolls it back. A commit whose outcome the
    /// connection could not report fails with a server fault: the job runs again on a
    /// new connection, where its inbox row says whether it had committed.
    ///
    /// A job running in another transaction whose worker is gone (or a list copy, whose
    /// other copy may have gone back to its queue) is waited out: the other transaction
    /// ends by itself (committed, or rolled back once its statement ends and it finds its
    /// client gone), and the job runs again, a duplicate or the job's only run.
    ///
    /// A job of an event whose sets are being split ([`Manners::splitting`]: they met
    /// contention within the last 10 s), less than a minute after its due time, waits as
    /// briefly as a set: the shop holds rows many of its jobs need, and a single job's
    /// whole `--lock-timeout` held its own locks against the shop as long. While the shop
    /// is busy, a job that would wait the whole of it does so only with the process's one
    /// leave for it ([`Manners::long_wait`]), and otherwise waits as briefly.
    fn run_job(
        &mut self,
        job: &Job<'_>,
        manners: &Manners,
        shutdown: &Shutdown,
        starts: &mut dyn Starts,
    ) -> JobResult {
        manners.pause(shutdown);
        let brief = job.brief_lock || (job.young && manners.splitting(&job.env.event));
        // While the shop is busy, one whole wait at a time.
        let long = (!brief).then(|| manners.long_wait()).flatten();
        let brief = (brief || long.is_none()).then(|| manners.yielding());
        let mut once = |wait_out| {
            let _inside = manners.enter(shutdown);
            self.run_job_once(job, wait_out, brief, starts)
        };
        let r = match once(false) {
            JobResult::RunningElsewhere
                if job.d.holder_gone
                    || matches!(job.d.origin, crate::delivery::Origin::List { .. }) =>
            {
                once(true)
            }
            r => r,
        };
        match &r {
            // A set size of 1 runs no set, so its single jobs grow it back.
            JobResult::Committed(effect) => {
                manners.committed(&job.env.event, *effect != Effect::NoOp);
                manners.went_through(1)
            }
            // A retry of a job that waited in vain for a lock before meets a row held for
            // long: its failing again says nothing new of the shop's load (a long lock on
            // the orders of a tenth of the due jobs, retried in batches, paused every
            // worker for seconds).
            JobResult::Failed(f) if f.fault == Fault::Contention => {
                manners.job_contended(&job.env.event);
                if let Some(long) = &long {
                    long.in_vain();
                }
                if !job.env.waited_lock() {
                    manners.met_contention()
                }
            }
            _ => {}
        }
        r
    }

    /// [`Session::run_job`]'s one try. `wait_out`: the inbox insert waits for another
    /// transaction holding the job's row without a lock timeout (the statement timeout
    /// bounds it), and the handler then runs under the connection's own.
    fn run_job_once(
        &mut self,
        job: &Job<'_>,
        wait_out: bool,
        brief: Option<bool>,
        starts: &mut dyn Starts,
    ) -> JobResult {
        let one = match &self.handlers[job.index] {
            Prepared::Ready { one, .. } => one,
            Prepared::Failed { failure, .. } => return JobResult::Failed(failure.clone()),
        };
        let mut tx = match self.conn.transaction() {
            Ok(tx) => tx,
            Err(e) => return JobResult::Failed(e.into()),
        };
        starts.begin(&[job]);
        let result = (|| {
            let mut noops = Vec::new();
            // A job that waited in vain for a lock at its last try waits as briefly as a
            // set now: while the shop holds a row that many due jobs need, each try holds
            // a worker (and the job's own locks, taken before, against the shop) for its
            // whole wait.
            let lock = match brief {
                Some(busy) => self.short_lock[busy as usize].as_str(),
                None => self.lock_timeout_back.as_str(),
            };
            let first = match wait_out {
                true => Some("SET LOCAL lock_timeout = 0"),
                false => brief.map(|_| lock),
            };
            if let Some(sql) = first {
                if let Err(e) = tx.batch_execute(sql) {
                    return JobResult::Failed(e.into());
                }
            }
            let waits = wait_out.then_some(lock);
            let result = match apply(&mut tx, &self.inbox, one, job, waits) {
                Ok(Some((effect, tid))) => {
                    if effect == Effect::NoOp {
                        noops.push(tid);
                    }
                    JobResult::Committed(effect)
                }
                Ok(None) => JobResult::Duplicate,
                Err(failed) => return failed,
            };
            match commit(tx, &noops) {
                Ok(()) => result,
                Err(e) => JobResult::Failed(e.into()),
            }
        })();
        starts.end(&[job]);
        result
    }

    /// Jobs of one event in one transaction through the handler's set form: the inbox
    /// rows of all of them in one statement, then one statement for the jobs whose rows
    /// were new (the others are redeliveries), then one commit. An error if anything
    /// failed (nothing committed).
    fn run_set(
        &mut self,
        jobs: &[&Job<'_>],
        busy: bool,
        starts: &mut dyn Starts,
    ) -> Result<Vec<JobResult>, SetError> {
        let statement = match &self.handlers[jobs[0].index] {
            Prepared::Ready { set: Some(st), .. } => st.clone(),
            Prepared::Ready { set: None, .. } => return Err(SetError::Index(-1)),
            Prepared::Failed { failure, .. } => return Err(SetError::Db(failure.clone())),
        };
        self.conn
            .batch_execute(&self.begin_set[busy as usize])
            .map_err(db_err)?;
        starts.begin(jobs);
        let result =
            set_body(&mut self.conn, &self.inbox_set, &statement, jobs).and_then(|(rs, noops)| {
                self.conn
                    .batch_execute(&commit_sql(&noops))
                    .map_err(db_err)?;
                Ok(rs)
            });
        if result.is_err() {
            // Nothing committed. A connection that cannot even roll back is thrown away
            // (its jobs then wait for the next one).
            if let Err(e) = self.conn.batch_execute("ROLLBACK") {
                starts.end(jobs);
                return Err(SetError::Db(Failure {
                    fault: Fault::Server,
                    reason: db::error_text(&e),
                    wait: None,
                    own_data: false,
                    stored_data: false,
                    cancelled: false,
                    shared: false,
                }));
            }
        }
        // Told after the rollback: a set that failed holds its rows until then.
        starts.end(jobs);
        result
    }

    /// Several jobs in one transaction (`--tx-batch`): one commit for all of them, which
    /// is what a job costs most. Each job keeps its own inbox row, so each stays
    /// idempotent; if any statement fails nothing commits and `None` tells the caller to
    /// run each job alone.
    fn run_batch(&mut self, jobs: &[&Job<'_>], starts: &mut dyn Starts) -> Option<Vec<JobResult>> {
        let mut tx = self.conn.transaction().ok()?;
        starts.begin(jobs);
        let results = (|| {
            let mut results = Vec::with_capacity(jobs.len());
            let mut noops = Vec::new();
            for job in jobs {
                let Prepared::Ready { one, .. } = &self.handlers[job.index] else {
                    return None;
                };
                results.push(match apply(&mut tx, &self.inbox, one, job, None).ok()? {
                    Some((effect, tid)) => {
                        if effect == Effect::NoOp {
                            noops.push(tid);
                        }
                        JobResult::Committed(effect)
                    }
                    None => JobResult::Duplicate,
                });
            }
            commit(tx, &noops).ok()?;
            Some(results)
        })();
        starts.end(jobs);
        results
    }
}

/// Prepares one handler's statements: its one-job form, and its set form when it keeps
/// the contract (`$1` only, the job's index first); a set form that does not is left
/// out, with a warning, and its jobs run one by one.
fn prepare(conn: &mut postgres::Client, h: &dyn Handler) -> Prepared {
    let failed = |e: postgres::Error| Prepared::Failed {
        failure: e.into(),
        at: Instant::now(),
    };
    let mut one = Vec::new();
    for (sql, types) in h.statements() {
        match conn.prepare_typed(&sql, &types) {
            Ok(st) => one.push(st),
            Err(e) => return failed(e),
        }
    }
    let set = match h.set_statement() {
        Some(sql) => match conn.prepare_typed(&sql, &[Type::JSONB]) {
            Ok(st) => match set_shape(&st) {
                None => Some(st),
                Some(problem) => {
                    log::warn!(
                        "the set form of {:?} is not used, its jobs run one by one: {problem}",
                        h.event()
                    );
                    None
                }
            },
            Err(e) => return failed(e),
        },
        None => None,
    };
    Prepared::Ready { one, set }
}

/// Whether a handler's statements prepare on `conn` (they are dropped at once): the
/// check of a reload and of the PostgreSQL watch.
pub fn try_prepare(conn: &mut postgres::Client, h: &dyn Handler) -> Result<(), Failure> {
    match prepare(conn, h) {
        Prepared::Ready { .. } => Ok(()),
        Prepared::Failed { failure, .. } => Err(failure),
    }
}

/// What is wrong with a set form's shape, if anything: it takes `$1` only and returns
/// the job's index first, as an integer.
pub fn set_shape(st: &Statement) -> Option<String> {
    if st.params().len() != 1 {
        Some(format!(
            "its set form takes {} parameters; it gets one, $1 (the jobs)",
            st.params().len()
        ))
    } else if st.columns().first().map(|c| c.type_()) != Some(&Type::INT4) {
        Some("its set form must return the job's index first, as an integer (RETURNING or SELECT ... i)".to_string())
    } else {
        None
    }
}

/// Inserts the job's inbox row and runs its handler inside `tx`: its effect and its
/// row's ctid. `Ok(None)`: the inbox already held the job (a redelivery), nothing else
/// was done. `after_insert` runs between the two (a lock timeout set back).
fn apply(
    tx: &mut postgres::Transaction<'_>,
    inbox: &Statement,
    statements: &[Statement],
    job: &Job<'_>,
    after_insert: Option<&str>,
) -> Result<Option<(Effect, String)>, JobResult> {
    let job_id = job.env.job_id.as_deref().unwrap_or("");
    let late = job.late_ms();
    let params: [&(dyn postgres::types::ToSql + Sync); 6] = [
        &job.key,
        &job.env.ts,
        &job.env.event,
        &job_id,
        &late,
        &job.consumer,
    ];
    let tid: String = match tx.query(inbox, &params) {
        Ok(rows) => match rows.first() {
            None => return Ok(None),
            Some(row) => row.try_get(0).unwrap_or_default(),
        },
        Err(e) if waited_on_inbox_row(&e) => return Err(JobResult::RunningElsewhere),
        Err(e) => return Err(JobResult::Failed(e.into())),
    };
    if let Some(sql) = after_insert {
        if let Err(e) = tx.batch_execute(sql) {
            return Err(JobResult::Failed(e.into()));
        }
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        job.handler.handle(tx, statements, &job.env.payload)
    }));
    match outcome {
        Ok(Ok(effect)) => Ok(Some((effect, tid))),
        Ok(Err(e)) => Err(JobResult::Failed(e.into())),
        Err(panic) => Err(JobResult::Panicked(crate::text::panic_text(&*panic))),
    }
}

/// A job's inbox key: its job key (as text), `ts` and the mover's `job_id` (empty when
/// unstamped).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InboxId {
    pub key: String,
    pub ts: i64,
    pub job_id: String,
}

impl InboxId {
    /// The inbox key of `env`'s job under job key `key`, as its inbox insert writes it.
    pub fn of_envelope(key: &[u8], env: &Envelope) -> InboxId {
        InboxId {
            key: crate::workers::key_text(key),
            ts: env.ts,
            job_id: env.job_id.clone().unwrap_or_default(),
        }
    }
}

/// Which of `ids` have their inbox row, in one statement.
pub fn inbox_rows<'a>(
    client: &mut postgres::Client,
    ids: impl Iterator<Item = &'a InboxId>,
) -> Result<HashSet<InboxId>, postgres::Error> {
    let (mut keys, mut ts, mut job_ids) = (Vec::new(), Vec::new(), Vec::new());
    for id in ids {
        keys.push(id.key.as_str());
        ts.push(id.ts);
        job_ids.push(id.job_id.as_str());
    }
    if keys.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = client.query(
        "SELECT i.job_key, i.enqueued_at, i.job_id FROM worker_inbox i \
         JOIN unnest($1::text[], $2::bigint[], $3::text[]) AS u(k, t, j) \
         ON i.job_key = u.k AND i.enqueued_at = u.t AND i.job_id = u.j",
        &[&keys, &ts, &job_ids],
    )?;
    rows.iter()
        .map(|r| {
            Ok(InboxId {
                key: r.try_get(0)?,
                ts: r.try_get(1)?,
                job_id: r.try_get(2)?,
            })
        })
        .collect()
}

/// Whether an inbox insert timed out waiting on a row of the inbox itself: the only row
/// it can wait on is the same job's, inserted by a transaction still running (ON CONFLICT
/// waits for it to end). A wait on the whole table (a migration's lock) is contention.
fn waited_on_inbox_row(e: &postgres::Error) -> bool {
    crate::blocker::lock_wait(e)
        .and_then(|w| w.row)
        .is_some_and(|(relation, _)| relation == "worker_inbox")
}

/// Why a set did not commit.
#[derive(Debug)]
enum SetError {
    Db(Failure),
    /// The set form returned an index it was not given, or one twice: it does not keep
    /// its contract, so nothing commits and every job runs alone.
    Index(i32),
}

fn db_err(e: postgres::Error) -> SetError {
    SetError::Db(e.into())
}

/// One job of a set as its statement reads it: `{"i": <index in the set>, "payload": ...}`,
/// the payload borrowed, not copied.
#[derive(Debug, serde::Serialize)]
struct Work<'a> {
    i: usize,
    payload: &'a serde_json::Value,
}

/// The statements of a set inside its open transaction: the inbox rows, then the set
/// form for the jobs whose rows were new. Returns each job's result and the ctids of the
/// rows of the jobs that changed nothing (for [`commit_sql`]).
fn set_body(
    conn: &mut postgres::Client,
    inbox_set: &Statement,
    statement: &Statement,
    jobs: &[&Job<'_>],
) -> Result<(Vec<JobResult>, Vec<String>), SetError> {
    let keys: Vec<&str> = jobs.iter().map(|j| j.key.as_str()).collect();
    let ts: Vec<i64> = jobs.iter().map(|j| j.env.ts).collect();
    let events: Vec<&str> = jobs.iter().map(|j| j.env.event.as_str()).collect();
    let ids: Vec<&str> = jobs
        .iter()
        .map(|j| j.env.job_id.as_deref().unwrap_or(""))
        .collect();
    let late: Vec<Option<i64>> = jobs.iter().map(|j| j.late_ms()).collect();
    let consumer = jobs[0].consumer;
    let rows = conn
        .query(inbox_set, &[&keys, &ts, &events, &ids, &late, &consumer])
        .map_err(db_err)?;
    // A job is new if its row was inserted now; of two copies of one job in the set, the
    // first is new and the second a redelivery. Matched by borrowed keys: nothing is
    // copied per job.
    let mut first: HashMap<(&str, i64, &str), usize> = HashMap::with_capacity(jobs.len());
    for i in 0..jobs.len() {
        first.entry((keys[i], ts[i], ids[i])).or_insert(i);
    }
    // The ctid of each new job's row (by index), while it counts as a no-op.
    let mut tids: Vec<Option<&str>> = vec![None; jobs.len()];
    for row in &rows {
        let id: (&str, i64, &str) = (
            row.try_get(0).map_err(db_err)?,
            row.try_get(1).map_err(db_err)?,
            row.try_get(2).map_err(db_err)?,
        );
        if let Some(&i) = first.get(&id) {
            tids[i] = Some(row.try_get(3).map_err(db_err)?);
        }
    }
    let mut results: Vec<JobResult> = Vec::with_capacity(jobs.len());
    let mut work: Vec<Work<'_>> = Vec::new();
    for (i, (job, tid)) in jobs.iter().zip(&tids).enumerate() {
        if tid.is_some() {
            results.push(JobResult::Committed(Effect::NoOp));
            work.push(Work {
                i,
                payload: &job.env.payload,
            });
        } else {
            results.push(JobResult::Duplicate);
        }
    }
    if !work.is_empty() {
        let work = postgres::types::Json(&work);
        for row in conn.query(statement, &[&work]).map_err(db_err)? {
            let i: i32 = row.try_get(0).map_err(db_err)?;
            match usize::try_from(i).ok().and_then(|i| results.get_mut(i)) {
                Some(r @ JobResult::Committed(Effect::NoOp)) => {
                    *r = JobResult::Committed(Effect::Applied);
                    tids[i as usize] = None;
                }
                _ => return Err(SetError::Index(i)),
            }
        }
    }
    let noops = tids.into_iter().flatten().map(str::to_string).collect();
    Ok((results, noops))
}
