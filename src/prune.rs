//! The inbox pruner: keeps `worker_inbox` bounded by deleting rows older than
//! `--inbox-retention`.
//!
//! The inbox gains one row per job (`workers.rs`), used only to make a job delivered again
//! a no-op; a row is needed only as long as its job can still arrive again (docs/design.md,
//! Semantics, "Inbox retention"). One thread per daemon runs a pass every `interval`:
//!
//! ```text
//!  cutoff = PostgreSQL now() - retention, held back to the oldest pending stream entry
//!  new connection; pg_try_advisory_lock(PRUNE_LOCK)  ── taken by another process: skip
//!  repeat until no old row is left, the budget (interval / 2) is spent, or shutdown:
//!      DELETE one batch of the oldest rows before the cutoff (one short transaction)
//!      pause
//!  unlock, disconnect; one info line if rows went
//! ```
//!
//! **One process at a time.** Every worker process on every host runs the thread; the
//! session advisory lock lets one of them work and the others skip the pass (never wait).
//! If the pruning process dies, PostgreSQL drops its lock with its connection.
//!
//! **Batches.** Each batch deletes the `batch` oldest rows by `ctid`, found through the
//! `processed_at` index, starting at the newest `processed_at` the previous batch
//! deleted, so no batch walks the index entries of rows deleted before it. Commits do not
//! wait for the WAL flush (`synchronous_commit=off`): a batch lost in a crash is deleted
//! again by the next pass. A batch locks only rows no job touches (a job writes its own new
//! row), so the jobs' transactions never wait for one; the pause between batches leaves
//! the CPU and the disk to them.
//!
//! **Never the row of a pending entry.** In stream mode the cutoff never passes the oldest
//! entry still pending in the group (less [`PENDING_MARGIN`], 5 minutes, for clock skew): a job whose
//! acknowledgement was lost stays deduplicated however long its redelivery waits (a fleet
//! stopped for longer than the retention, an outcome held back by a key of the wrong
//! type). If Redis cannot be asked, the pass is skipped.
//!
//! Failures (no connection, a statement timeout, no DELETE privilege) end the pass and are
//! reported with [`Stats::report_trouble`]: logged when new and every 30 s while they
//! last, never turning the health checks red (the jobs are not held back by them). The
//! next pass tries again.

use crate::config::{Config, PruneConfig, Source};
use crate::db;
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store;
use std::time::{Duration, Instant, SystemTime};

/// The advisory lock key of the pruner (migrations use 7300001).
pub const PRUNE_LOCK: i64 = 7_300_003;

/// How far before the oldest pending stream entry the cutoff stays: the entry's id is the
/// Redis host's clock, `processed_at` the PostgreSQL host's.
pub const PENDING_MARGIN: Duration = Duration::from_secs(300);

/// Longest one statement of the pruner may run (it is a batch of a few thousand rows).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest a batch waits for a row lock (only an operator's own statement can hold one).
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The name problems are reported under.
const ROLE: &str = "inbox pruner";

/// One batch: the oldest `$3` rows at or after `$1` and before `$2`, found through the
/// `processed_at` index, deleted by `ctid`; returns how many and the newest deleted.
const DELETE_BATCH: &str = "WITH gone AS (
       DELETE FROM worker_inbox
        WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM worker_inbox
                 WHERE processed_at >= $1 AND processed_at < $2
                 ORDER BY processed_at
                 LIMIT $3))
          AND processed_at < $2
       RETURNING processed_at)
     SELECT count(*), max(processed_at) FROM gone";

/// How soon a pass that could not connect is tried again (sooner than `interval`).
const CONNECT_RETRY: Duration = Duration::from_secs(2);

/// Why a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    #[error("{0}")]
    Connect(db::DbError),
    #[error("{}", db::error_text(.0))]
    Postgres(#[from] postgres::Error),
    #[error("cannot read the oldest pending stream entry: {0}")]
    Redis(String),
}

/// What one pass did.
#[derive(Debug, Clone)]
pub enum Pass {
    /// Another process holds the lock: this one did nothing.
    Skipped,
    Done(PassReport),
}

#[derive(Debug, Clone)]
pub struct PassReport {
    /// Rows deleted and the batches that deleted them.
    pub rows: u64,
    pub batches: u64,
    /// No row older than the cutoff was left when the pass ended (else the budget ran out
    /// or shutdown came).
    pub complete: bool,
    /// How old the oldest pending stream entry was, when it held the cutoff back.
    pub held_by_pending: Option<Duration>,
    /// While this process held the lock: taken, and about to be released.
    pub locked_at: Instant,
    pub unlocked_at: Instant,
}

/// The pruner of one process.
pub struct Pruner<'a> {
    database_url: &'a str,
    cfg: &'a PruneConfig,
    stats: &'a Stats,
    /// Stream mode: where to find the oldest pending entry (each shard's group).
    stream: Option<(&'a crate::store::Redis, Vec<Keys>)>,
}

impl<'a> Pruner<'a> {
    /// The daemon's pruner: the config's database and prune settings, and in stream mode
    /// the group whose pending entries hold the cutoff back.
    pub fn new(config: &'a Config, stats: &'a Stats, redis: &'a crate::store::Redis) -> Pruner<'a> {
        Pruner {
            database_url: &config.database_url,
            cfg: &config.prune,
            stats,
            stream: (config.source == Source::Stream)
                .then(|| (redis, config.derived.shards.clone())),
        }
    }

    /// The thread body: a pass every `interval` (counted from the start of the last),
    /// the first one `interval` after the start, until shutdown.
    pub fn run(&self, shutdown: &Shutdown) {
        log::info!(
            "inbox: rows older than {} are pruned (a pass every {})",
            crate::human_ms(self.cfg.retention.as_millis() as i64),
            crate::human_ms(self.cfg.interval.as_millis() as i64)
        );
        let mut next = Instant::now() + self.cfg.interval;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            if shutdown.wait(wait) {
                break;
            }
            let started = Instant::now();
            next = started + self.cfg.interval;
            let started_ms = crate::now_ms();
            match self.pass(shutdown) {
                Ok(pass) => {
                    if let Pass::Done(r) = &pass {
                        self.log_pass(r, started.elapsed());
                    }
                    if self.stats.clear_problem(ROLE, started_ms) {
                        log::info!("inbox: pruning works again");
                    }
                }
                Err(e) => {
                    // A server out of reach is tried again soon, so that the warning goes
                    // within seconds of its return, not a whole interval later (found from
                    // outside: `stats --check` warned 12 s after PostgreSQL came back).
                    if let PruneError::Connect(_) = e {
                        next = next.min(started + CONNECT_RETRY);
                    }
                    let what = format!("cannot prune old inbox rows: {e}");
                    if self.stats.report_trouble(ROLE, what.clone()) {
                        let every = crate::human_ms(self.cfg.interval.as_millis() as i64);
                        log::warn!("inbox: {what} (tried again every {every})");
                    }
                }
            }
        }
        log::debug!("inbox pruner: stopped");
    }

    fn log_pass(&self, r: &PassReport, took: Duration) {
        if r.rows == 0 {
            return;
        }
        let mut line = format!(
            "inbox: pruned {} rows older than {} in {} batches ({:.1}s)",
            r.rows,
            crate::human_ms(self.cfg.retention.as_millis() as i64),
            r.batches,
            took.as_secs_f64()
        );
        if let Some(age) = r.held_by_pending {
            line.push_str(&format!(
                "; held back to the oldest pending stream entry ({} old)",
                crate::human_ms(Duration::from_secs(age.as_secs()).as_millis() as i64)
            ));
        }
        if !r.complete {
            line.push_str("; older rows remain for the next pass");
        }
        log::info!("{line}");
    }

    /// One pass (see the module header). `shutdown` ends it between two batches.
    pub fn pass(&self, shutdown: &Shutdown) -> Result<Pass, PruneError> {
        // Read before the cutoff: entries that become pending later are newer, or belong
        // to jobs that have no inbox row yet.
        let oldest_pending_ms = self.oldest_pending_ms()?;
        let mut client = db::connect(self.database_url).map_err(PruneError::Connect)?;
        client.batch_execute(&format!(
            "SET application_name = 'delay-worker prune'; \
             SET synchronous_commit = off; \
             SET statement_timeout = {}; SET lock_timeout = {}",
            STATEMENT_TIMEOUT.as_millis(),
            LOCK_TIMEOUT.as_millis()
        ))?;
        let locked: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&PRUNE_LOCK])?
            .get(0);
        if !locked {
            return Ok(Pass::Skipped);
        }
        let locked_at = Instant::now();
        let result = self.batches(&mut client, oldest_pending_ms, shutdown, locked_at);
        let unlocked_at = Instant::now();
        // Dropping the connection releases the lock too; unlocking first makes it exact.
        let _ = client.query_one("SELECT pg_advisory_unlock($1)", &[&PRUNE_LOCK]);
        let (rows, batches, complete, held_by_pending) = result?;
        Ok(Pass::Done(PassReport {
            rows,
            batches,
            complete,
            held_by_pending,
            locked_at,
            unlocked_at,
        }))
    }

    /// The batches of one pass, under the lock.
    fn batches(
        &self,
        client: &mut postgres::Client,
        oldest_pending_ms: Option<i64>,
        shutdown: &Shutdown,
        locked_at: Instant,
    ) -> Result<(u64, u64, bool, Option<Duration>), PruneError> {
        // The cutoff on the clock that wrote processed_at.
        let db_now: SystemTime = client.query_one("SELECT now()", &[])?.get(0);
        let retention_cutoff = db_now
            .checked_sub(self.cfg.retention)
            .unwrap_or(SystemTime::UNIX_EPOCH)
            .max(SystemTime::UNIX_EPOCH);
        let mut cutoff = retention_cutoff;
        let mut held_by_pending = None;
        if let Some(ms) = oldest_pending_ms {
            let entry = SystemTime::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
            let bound = entry.checked_sub(PENDING_MARGIN).unwrap_or(entry);
            cutoff = cutoff.min(bound);
            // Worth saying only when the entry itself is older than the retention (the
            // margin alone moves the cutoff by minutes).
            if entry < retention_cutoff {
                held_by_pending = Some(db_now.duration_since(entry).unwrap_or_default());
            }
        }
        let delete = client.prepare_typed(
            DELETE_BATCH,
            &[
                postgres::types::Type::TIMESTAMPTZ,
                postgres::types::Type::TIMESTAMPTZ,
                postgres::types::Type::INT8,
            ],
        )?;
        let limit = self.cfg.batch.max(1) as i64;
        let budget = self.cfg.budget();
        let mut from = SystemTime::UNIX_EPOCH;
        let (mut rows, mut batches) = (0u64, 0u64);
        loop {
            let row = client.query_one(&delete, &[&from, &cutoff, &limit])?;
            let n: i64 = row.get(0);
            batches += 1;
            if n > 0 {
                rows += n as u64;
                Stats::add(&self.stats.inbox_pruned, n as u64);
            }
            if let Some(newest) = row.get::<_, Option<SystemTime>>(1) {
                from = newest;
            }
            if n < limit {
                return Ok((rows, batches, true, held_by_pending));
            }
            if locked_at.elapsed() >= budget || shutdown.wait(self.cfg.pause) {
                return Ok((rows, batches, false, held_by_pending));
            }
        }
    }

    /// The time (Redis clock, unix ms) of the oldest entry pending in the group, in
    /// stream mode; `None` when nothing is pending (or in list mode).
    fn oldest_pending_ms(&self) -> Result<Option<i64>, PruneError> {
        let Some((client, shards)) = &self.stream else {
            return Ok(None);
        };
        let mut con = store::connect(client).map_err(|e| PruneError::Redis(e.to_string()))?;
        let mut oldest: Option<i64> = None;
        for keys in shards {
            let first = match store::stream::pending(&mut con, keys, 0, 1, None) {
                Ok(entries) => entries
                    .first()
                    .and_then(|e| e.id.split('-').next().and_then(|ms| ms.parse::<i64>().ok())),
                // No stream or group yet (the reader creates them): nothing pending.
                Err(
                    store::StoreError::Refused { source, .. }
                    | store::StoreError::Connection { source, .. },
                ) if source.code() == Some("NOGROUP") => None,
                Err(e) => return Err(PruneError::Redis(e.to_string())),
            };
            oldest = match (oldest, first) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(oldest)
    }
}
