//! The mover thread: due jobs from the delay pool into the stream.
//!
//! Owns one Redis connection. Loops on [`Mover::tick`], one atomic `move_due` script per
//! batch and pool (ours, plus any legacy pools), into the stream or, in list mode, a
//! queue, so any number of movers (one per worker process) run at once without duplicates
//! or loss. A member that cannot be moved (over the size limit, a legacy key of another
//! type, no data past the grace) is dead-lettered by the same script and the rest move
//! on. After moving anything it rings the reader's doorbell. A full batch loops at once;
//! otherwise it sleeps until the next due score or the poll interval, whichever comes
//! first. Stops within one poll interval of shutdown (the sleep is woken at once); a
//! Redis error backs off (and reconnects when the connection is lost); a key of the wrong
//! type is reported to the health checks until an operator fixes it.

use crate::backoff::Backoff;
use crate::config::MoverConfig;
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::source::Doorbell;
use crate::stats::Stats;
use crate::store::{self, MoveReport, Pool, StoreResult, Target};
use redis::ConnectionLike;
use std::time::Duration;

pub struct Mover<'a> {
    keys: &'a Keys,
    cfg: &'a MoverConfig,
    stats: &'a Stats,
    doorbell: Doorbell,
}

impl<'a> Mover<'a> {
    pub fn new(keys: &'a Keys, cfg: &'a MoverConfig, stats: &'a Stats) -> Self {
        Mover {
            keys,
            cfg,
            stats,
            doorbell: Doorbell::default(),
        }
    }

    /// Rings this doorbell after moving messages (the daemon shares it with the reader).
    pub fn with_doorbell(mut self, doorbell: Doorbell) -> Self {
        self.doorbell = doorbell;
        self
    }

    /// One batch from each pool at time `now_ms`. Returns what moved and how long to
    /// sleep before the next tick (zero: loop at once).
    pub fn tick(
        &self,
        con: &mut dyn ConnectionLike,
        now_ms: i64,
    ) -> StoreResult<(MoveReport, Duration)> {
        let target = match self.keys.queues.get(self.cfg.queue) {
            Some(q) => Target::List {
                queue: &q.name,
                dead: &q.dead,
            },
            None => Target::Stream {
                stream: &self.keys.stream,
                dead: &self.keys.dead,
            },
        };
        let grace = self.cfg.orphan_grace.as_millis() as i64;
        let ours = Pool::Enveloped {
            pool: &self.keys.pool,
            data: &self.keys.data,
        };
        let legacy = self.cfg.legacy.iter().map(|l| Pool::Legacy {
            pool: &l.key,
            event: &l.event,
        });
        let mut sleep = self.cfg.poll;
        let mut total = MoveReport::default();
        for pool in std::iter::once(ours).chain(legacy) {
            let report = store::move_due(
                con,
                pool,
                &self.keys.jobs,
                target,
                now_ms,
                self.cfg.batch,
                grace,
                self.cfg.max_message_bytes,
            )?;
            sleep = sleep.min(self.next_sleep(&report, now_ms));
            total.moved += report.moved;
            total.skipped += report.skipped;
            total.next_due_ms = match (total.next_due_ms, report.next_due_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            total.buried.extend(report.buried);
            if let Some(w) = report.blocked {
                let problem = format!(
                    "members that cannot be moved stay in the pool: {w}; rename or remove the key"
                );
                if self.stats.report_problem("mover", problem.clone()) {
                    log::error!("mover: {problem}");
                }
            }
        }
        Stats::add(&self.stats.moved, (total.moved + total.buried.len()) as u64);
        self.stats.dead_lettered("mover", &total.buried);
        if total.moved > 0 {
            self.doorbell.ring();
        }
        Ok((total, sleep))
    }

    fn next_sleep(&self, r: &MoveReport, now_ms: i64) -> Duration {
        if r.moved + r.buried.len() >= self.cfg.batch {
            return Duration::ZERO;
        }
        // Members waiting for their data are due already; re-looking at once would spin
        // until the grace period ends, so they are retried at the poll interval.
        if r.skipped > 0 {
            return self.cfg.poll;
        }
        match r.next_due_ms {
            Some(due) => Duration::from_millis((due - now_ms).max(0) as u64).min(self.cfg.poll),
            None => self.cfg.poll,
        }
    }

    /// The thread body: ticks until shutdown.
    pub fn run(&self, client: &redis::Client, shutdown: &Shutdown) {
        let mut backoff = Backoff::new("mover");
        let mut con = None;
        while !shutdown.is_set() {
            let c = match con.as_mut() {
                Some(c) => c,
                None => match store::connect(client) {
                    Ok(c) => con.insert(c),
                    Err(e) => {
                        self.stats.redis_failure(&backoff);
                        backoff.fail("cannot connect to redis", &e, shutdown);
                        continue;
                    }
                },
            };
            let step_started = crate::now_ms();
            match self.tick(c, step_started) {
                Ok((_, sleep)) => {
                    backoff.reset();
                    if self.stats.clear_problem("mover", step_started) {
                        log::info!("mover: the key that held members back is fixed");
                    }
                    Stats::beat(&self.stats.mover_beat_ms);
                    if !sleep.is_zero() {
                        shutdown.wait(sleep);
                    }
                }
                Err(e) => {
                    if let Some(p) = e.operator_problem() {
                        self.stats.report_problem("mover", p);
                    }
                    if e.is_connection() {
                        con = None;
                        self.stats.redis_failure(&backoff);
                    }
                    backoff.fail("move_due failed", &e, shutdown);
                }
            }
        }
        log::info!("mover: stopped");
    }
}
