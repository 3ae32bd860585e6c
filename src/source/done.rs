//! Whether jobs over the delivery limit were done: the inbox looked at before an entry
//! delivered more than `--max-deliveries` times becomes a dead letter.
//!
//! A process killed between a job's commit and its acknowledgement, as often as the limit
//! allows, leaves an entry that looks just like a message that kills its consumer. Its
//! job is done (its inbox row is there), so it is acknowledged, never also a dead letter
//! (found from outside: five kill -9s under `--max-deliveries 3` made jobs both done and
//! dead letters). The reader asks on a connection of its own, made at the first question
//! and kept while it answers (never one a job committed on): the workers' pool keeps all
//! its connections.

use crate::db;
use crate::workers::session::{inbox_rows, InboxId};
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

/// The longest each of the look's three steps (connect, flush, look-up) may take, at most:
/// the reader waits for them between two refreshes of its heartbeat.
const LOOK_TIMEOUT: Duration = Duration::from_secs(2);

/// Asks the inbox which jobs are done.
pub struct InboxLook {
    target: db::Target,
    timeout: Duration,
    /// The connection of the last look that answered.
    kept: Mutex<Option<postgres::Client>>,
}

impl InboxLook {
    /// Looks through `target` (the workers' database, their `search_path` kept), each step
    /// within a quarter of `heartbeat_ttl` (at most 2 s), so that a server that accepts and
    /// never answers cannot hold the reader until its heartbeat lapses.
    pub fn new(mut target: db::Target, heartbeat_ttl: Duration) -> InboxLook {
        let timeout = (heartbeat_ttl / 4).clamp(Duration::from_millis(100), LOOK_TIMEOUT);
        let ms = timeout.as_millis();
        target.add_options(&format!(
            "-c statement_timeout={ms} -c lock_timeout={ms} -c synchronous_commit=on"
        ));
        InboxLook {
            target,
            timeout,
            kept: Mutex::new(None),
        }
    }

    /// Which of `ids` have their inbox row, durable: one WAL flush (every commit the
    /// look can see is then durable: an acknowledged job's row must survive a crash of the
    /// server), then one look-up; on the kept connection, or a new one when there is none
    /// or the kept one fails (its server restarted, or turned read-only). An error when
    /// PostgreSQL cannot be asked: the caller then decides nothing.
    pub fn done(&self, ids: &[InboxId]) -> Result<HashSet<InboxId>, String> {
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut client) = kept.take().filter(|c| !c.is_closed()) {
            if let Ok(found) = ask(&mut client, ids) {
                *kept = Some(client);
                return Ok(found);
            }
        }
        let mut client = self
            .target
            .connect_within(self.timeout)
            .map_err(|e| e.to_string())?;
        // A role's `idle_session_timeout` would end it between two looks.
        db::keep_session(&mut client).map_err(|e| db::error_text(&e))?;
        let found = ask(&mut client, ids)?;
        *kept = Some(client);
        Ok(found)
    }
}

fn ask(client: &mut postgres::Client, ids: &[InboxId]) -> Result<HashSet<InboxId>, String> {
    db::flush_wal_by_inbox(client).map_err(|e| db::error_text(&e))?;
    inbox_rows(client, ids.iter()).map_err(|e| db::error_text(&e))
}
