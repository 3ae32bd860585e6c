//! Who held the lock a job waited for: "waited for a lock held by pid N (`query`)", added
//! to the reason of a job that failed on a lock timeout (SQLSTATE 55P03) or a statement
//! timeout (57014), so that the operator reads whose transaction to look at.
//!
//! PostgreSQL names the row a statement waited on in the error's context ("while updating
//! tuple (0,5) in relation \"orders\""). Once the job's transaction is rolled back, one
//! statement on the same connection asks who holds it: the row's `xmax` is the locking
//! transaction, `pg_locks` gives the backend holding that transaction id, and
//! `pg_stat_activity` its query and state. A wait without a row (a table lock) is matched
//! against the other sessions holding a table lock that blocks writes. The lookup runs
//! only on that failure, at most once per [`LOOK_EVERY`] per worker connection, under the
//! connection's own lock timeout: the happy path has no extra round trip, and a storm of
//! lock timeouts no more than one a second per worker.

use std::time::{Duration, Instant};

/// Most often a worker connection looks up a holder.
pub const LOOK_EVERY: Duration = Duration::from_secs(1);

/// The longest query text quoted.
const QUERY_CHARS: usize = 120;

/// What a timed-out statement waited on, from its error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockWait {
    /// The row, when PostgreSQL said: its relation (as PostgreSQL printed it) and ctid.
    pub row: Option<(String, String)>,
}

/// The wait of a lock or statement timeout, `None` for any other error. A statement
/// timeout without a row in its context may have been a slow statement, not a wait: it is
/// looked up all the same, and says so only if another session holds a table lock.
pub fn lock_wait(e: &postgres::Error) -> Option<LockWait> {
    let db = e.as_db_error()?;
    let code = db.code().code();
    if code != "55P03" && code != "57014" {
        return None;
    }
    // A cancel by an operator (pg_cancel_backend) is 57014 too, and waited on nothing.
    if code == "57014" && !db.message().contains("timeout") {
        return None;
    }
    Some(LockWait {
        row: db.where_().and_then(row_of_context),
    })
}

/// `tuple (0,5) in relation "orders"` out of an error context line.
fn row_of_context(context: &str) -> Option<(String, String)> {
    let at = context.find(" tuple (")? + " tuple ".len();
    let tid_end = at + context[at..].find(')')? + 1;
    let tid = context[at..tid_end].to_string();
    let rel_at = tid_end + context[tid_end..].find("relation \"")? + "relation \"".len();
    let rel_end = rel_at + context[rel_at..].find('"')?;
    Some((context[rel_at..rel_end].to_string(), tid))
}

/// Rate-limits the lookups of one connection, and keeps the last answer: a wait on the
/// same thing within [`LOOK_EVERY`] is told the same holder without asking again.
#[derive(Debug, Default)]
pub struct Looker {
    last: Option<(Instant, LockWait, Option<String>)>,
}

impl Looker {
    /// Who holds what `wait` waited on, in words, or `None` (not found, not allowed now,
    /// or the lookup failed). `client` must be out of the failed transaction.
    pub fn holder(&mut self, client: &mut postgres::Client, wait: &LockWait) -> Option<String> {
        if let Some((at, seen, answer)) = &self.last {
            if at.elapsed() < LOOK_EVERY {
                return if seen == wait { answer.clone() } else { None };
            }
        }
        let answer = look(client, wait);
        self.last = Some((Instant::now(), wait.clone(), answer.clone()));
        answer
    }
}

/// One look-up: one statement.
fn look(client: &mut postgres::Client, wait: &LockWait) -> Option<String> {
    let row = match &wait.row {
        Some((relation, tid)) => {
            let sql = format!(
                "SELECT l.pid, a.query, a.state FROM pg_locks l \
                     LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                     WHERE l.locktype = 'transactionid' AND l.granted \
                     AND l.transactionid = (SELECT xmax FROM {} WHERE ctid = $1::text::tid) LIMIT 1",
                quote_ident(relation)
            );
            client.query_opt(&sql, &[tid]).ok().flatten()
        }
        None => None,
    };
    let (row, on) = match (row, &wait.row) {
        (Some(r), Some((relation, tid))) => (r, format!("on the row {tid} of {relation}")),
        (None, Some(_)) => return None,
        (_, None) => {
            let r = client
                    .query_opt(
                        "SELECT l.pid, a.query, a.state, c.relname::text FROM pg_locks l \
                         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                         LEFT JOIN pg_class c ON c.oid = l.relation \
                         WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_backend_pid() \
                         AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock') \
                         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                         ORDER BY a.xact_start NULLS LAST LIMIT 1",
                        &[],
                    )
                    .ok()??;
            let relation: Option<String> = r.get(3);
            let on = format!("on the table {}", relation.unwrap_or_else(|| "?".into()));
            (r, on)
        }
    };
    let pid: i32 = row.get(0);
    let query: Option<String> = row.get(1);
    let state: Option<String> = row.get(2);
    Some(describe(pid, query.as_deref(), state.as_deref(), &on))
}

/// `waited for a lock held by pid N (`query`, idle in transaction) on ...`.
fn describe(pid: i32, query: Option<&str>, state: Option<&str>, on: &str) -> String {
    let query = match query {
        None | Some("<insufficient privilege>") => {
            "its query is hidden from this role: grant it pg_read_all_stats".to_string()
        }
        Some(q) => {
            let flat = q.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut short: String = flat.chars().take(QUERY_CHARS).collect();
            if short.len() < flat.len() {
                short.push_str("...");
            }
            format!("`{short}`")
        }
    };
    let state = match state {
        Some(s) if !s.is_empty() && s != "active" => format!(", {s}"),
        _ => String::new(),
    };
    format!("waited for a lock held by pid {pid} ({query}{state}) {on}")
}

/// A name as PostgreSQL printed it, quoted as an identifier (it may be `schema.table`
/// only when PostgreSQL printed it so; the context prints the bare name).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_comes_out_of_the_context() {
        assert_eq!(
            row_of_context("while updating tuple (0,5) in relation \"orders\""),
            Some(("orders".into(), "(0,5)".into()))
        );
        assert_eq!(
            row_of_context(
                "while locking tuple (12,3) in relation \"sku\"\nSQL function \"x\" statement 1"
            ),
            Some(("sku".into(), "(12,3)".into()))
        );
        assert_eq!(row_of_context("PL/pgSQL function f() line 3"), None);
    }

    #[test]
    fn the_holder_reads_as_a_sentence() {
        assert_eq!(
            describe(
                42,
                Some("SELECT  *\n FROM orders FOR UPDATE"),
                Some("idle in transaction"),
                "on the row (0,1) of orders"
            ),
            "waited for a lock held by pid 42 (`SELECT * FROM orders FOR UPDATE`, idle in transaction) on the row (0,1) of orders"
        );
        assert!(
            describe(7, Some("<insufficient privilege>"), None, "on the table t")
                .contains("grant it pg_read_all_stats")
        );
    }
}
