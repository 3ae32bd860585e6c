//! The PostgreSQL watch: whether the database takes writes, asked every [`EVERY`] whether
//! jobs come or not.
//!
//! The workers find out that PostgreSQL is gone or read-only only when a job fails, so a
//! quiet worker would look healthy through an outage and surprise everyone at the next
//! due order. This thread keeps one connection of its own (one more per process) and asks
//! `SHOW transaction_read_only` on it; a server that does not answer, refuses the
//! connection or takes no writes (a standby, a primary demoted or with
//! `default_transaction_read_only`) is reported as an alert ([`Stats::report_critical`]:
//! `/healthz` 503 and the published health red, the watchdog left alone: a restart
//! would not make the server writable), and the report is cleared once it takes writes
//! again. It stops at shutdown, within one [`EVERY`].
//!
//! Each pass also holds this process's dead letters of the last minute against
//! `--dead-rate-crit`: more is reported the same way (under [`DEAD_RATE`]), so the
//! published health record, and with it `worker stats --check`, says so too.

use crate::db::{self, DbError};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the watch asks.
pub const EVERY: Duration = Duration::from_secs(5);

/// The role its reports carry.
pub const ROLE: &str = "postgresql";

/// The role the dead-letter rate is reported under.
pub const DEAD_RATE: &str = "dead letters";

/// Longest a check may take; a server that accepts and never answers costs this.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Checks given up on that still wait for their server; while this many do, no new one
/// starts (each is a thread blocked in a read until the server answers or the socket
/// fails).
const MAX_WAITING: usize = 2;

const RUNNING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

/// The watch of one daemon.
pub struct DbWatch<'a> {
    target: db::Target,
    stats: &'a Stats,
    /// `--dead-rate-crit` (0: off).
    dead_rate_crit: u64,
}

impl<'a> DbWatch<'a> {
    pub fn new(target: db::Target, stats: &'a Stats, dead_rate_crit: u64) -> DbWatch<'a> {
        DbWatch {
            target,
            stats,
            dead_rate_crit,
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
        }
    }

    /// The thread body: one check every [`EVERY`] until shutdown. Each check runs on a
    /// short-lived thread with the kept connection, so that a server that stops
    /// answering costs [`ANSWER_WITHIN`], not a watch stuck in a read (and a shutdown
    /// that cannot join it).
    pub fn run(&self, shutdown: &Shutdown) {
        let waiting = Arc::new(AtomicUsize::new(0));
        let mut kept: Option<postgres::Client> = None;
        loop {
            let result = if waiting.load(Ordering::SeqCst) >= MAX_WAITING {
                Err(format!(
                    "no answer: {MAX_WAITING} earlier checks still wait for the server"
                ))
            } else {
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                let state = Arc::new(AtomicU8::new(RUNNING));
                let (target, mut client) = (self.target.clone(), kept.take());
                let (w, st) = (waiting.clone(), state.clone());
                let spawned =
                    std::thread::Builder::new()
                        .name("pg-watch".into())
                        .spawn(move || {
                            let r = check(&target, &mut client);
                            let _ = tx.send((client, r));
                            if st.swap(DONE, Ordering::SeqCst) == ABANDONED {
                                w.fetch_sub(1, Ordering::SeqCst);
                            }
                        });
                match spawned {
                    Err(e) => Err(format!("cannot start a check: {e}")),
                    Ok(_) => {
                        let answer = match rx.recv_timeout(ANSWER_WITHIN) {
                            Ok(a) => Some(a),
                            Err(_) => {
                                waiting.fetch_add(1, Ordering::SeqCst);
                                match state.compare_exchange(
                                    RUNNING,
                                    ABANDONED,
                                    Ordering::SeqCst,
                                    Ordering::SeqCst,
                                ) {
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
                                    kept = client;
                                }
                                r
                            }
                            None => Err(format!("no answer within {}s", ANSWER_WITHIN.as_secs())),
                        }
                    }
                }
            };
            match result {
                Ok(()) => {
                    if self.stats.clear_problem(ROLE, i64::MAX) {
                        log::info!("PostgreSQL takes writes again");
                    }
                }
                Err(why) => {
                    let what = format!("no writable PostgreSQL: {why}");
                    if self.stats.report_critical(ROLE, what.clone()) {
                        log::error!("{what}");
                    }
                }
            }
            self.dead_rate();
            if shutdown.wait(EVERY) {
                return;
            }
        }
    }
}

/// One check on the kept connection (a new one when there is none). A new connection is
/// already refused by a read-only server (the target asks for read-write); a kept one is
/// asked again. A failed connection is not kept.
fn check(target: &db::Target, client: &mut Option<postgres::Client>) -> Result<(), String> {
    let c = match client {
        Some(c) => c,
        None => client.insert(target.connect_within(db::HANDSHAKE_DEADLINE).map_err(
            |e| match e {
                DbError::Unreachable { reason, .. } => reason,
                other => other.to_string(),
            },
        )?),
    };
    let read_only = c
        .simple_query("SHOW transaction_read_only")
        .map_err(|e| db::error_text(&e))
        .map(|rows| {
            rows.iter().any(|m| match m {
                postgres::SimpleQueryMessage::Row(r) => r.get(0) == Some("on"),
                _ => false,
            })
        });
    match read_only {
        Ok(false) => Ok(()),
        Ok(true) => {
            *client = None;
            Err(db::READ_ONLY.to_string())
        }
        Err(e) => {
            *client = None;
            Err(e)
        }
    }
}
