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
            let q = without_literals(q);
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

/// A query with its data taken out, for a reason that lands in Redis, the dead letters and
/// the log: each string literal (`'...'`, `E'...'`, `$tag$...$tag$`) and each number
/// becomes `?`, and comments go. What is left is the statement's shape, its tables and
/// columns: `UPDATE orders SET note = ? WHERE id = ?`. A literal or a quoted name left open
/// (PostgreSQL cuts a long query's text at `track_activity_query_size`) runs to the end,
/// which is then `?` too: never printed half.
fn without_literals(q: &str) -> String {
    let b = q.as_bytes();
    let mut out = String::with_capacity(q.len());
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80;
    let mut i = 0;
    // Where the text not yet copied starts.
    let mut from = 0;
    while i < b.len() {
        let c = b[i];
        let prev_ident = i > 0 && ident(b[i - 1]);
        // The start and end (exclusive) of a literal or comment at i, and what replaces it.
        let cut: Option<(usize, usize, &str)> = if c == b'\'' {
            // E'...' has backslash escapes; the E is part of the literal.
            let escapes = i > 0 && matches!(b[i - 1], b'E' | b'e') && !(i > 1 && ident(b[i - 2]));
            let start = if escapes { i - 1 } else { i };
            let mut j = i + 1;
            loop {
                match b.get(j) {
                    None => break,
                    Some(b'\\') if escapes => j += 2,
                    Some(b'\'') if b.get(j + 1) == Some(&b'\'') => j += 2,
                    Some(b'\'') => {
                        j += 1;
                        break;
                    }
                    Some(_) => j += 1,
                }
            }
            Some((start, j.min(b.len()), "?"))
        } else if c == b'$' && !prev_ident {
            // $tag$ ... $tag$ (a parameter $1 is not one: no closing $ after digits).
            let tag_end = q[i + 1..].find('$').map(|k| i + 1 + k).filter(|&e| {
                b[i + 1..e]
                    .iter()
                    .all(|&t| t.is_ascii_alphabetic() || t == b'_')
            });
            tag_end.map(|e| {
                let tag = &q[i..=e];
                let end = q[e + 1..]
                    .find(tag)
                    .map_or(b.len(), |k| e + 1 + k + tag.len());
                (i, end, "?")
            })
        } else if c.is_ascii_digit() && !prev_ident {
            let mut j = i;
            while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'.') {
                j += 1;
            }
            Some((i, j, "?"))
        } else if c == b'-' && b.get(i + 1) == Some(&b'-') {
            Some((i, q[i..].find('\n').map_or(b.len(), |k| i + k), " "))
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            Some((
                i,
                q[i + 2..].find("*/").map_or(b.len(), |k| i + 2 + k + 2),
                " ",
            ))
        } else if c == b'"' {
            // A quoted identifier is kept as it is; one left open (pg_stat_activity cuts
            // a long query short) is not told from data, and goes.
            match q[i + 1..].find('"') {
                Some(k) => {
                    i += k + 2;
                    continue;
                }
                None => Some((i, b.len(), "?")),
            }
        } else {
            None
        };
        match cut {
            Some((start, end, with)) => {
                out.push_str(&q[from..start]);
                out.push_str(with);
                i = end;
                from = end;
            }
            None => i += 1,
        }
    }
    out.push_str(&q[from.min(q.len())..]);
    out
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
    fn a_holder_s_query_is_quoted_without_its_data() {
        let cases = [
            (
                "UPDATE users SET email = 'ann@example.com', age = 42 WHERE id = 7",
                "UPDATE users SET email = ?, age = ? WHERE id = ?",
            ),
            (
                "SELECT 'it''s', E'a\\'b', x1 FROM t",
                "SELECT ?, ?, x1 FROM t",
            ),
            (
                "SELECT $1, $body$secret 'x'$body$, $$card 4111$$ FROM \"t 9\"",
                "SELECT $1, ?, ? FROM \"t 9\"",
            ),
            (
                "SELECT 1.5 -- card 4111\nFROM t /* ssn 078-05-1120 */ WHERE a=3",
                "SELECT ?  \nFROM t   WHERE a=?",
            ),
            (
                "INSERT INTO t VALUES ('unterminated secret",
                "INSERT INTO t VALUES (?",
            ),
            ("SELECT e'x', be'y' FROM t", "SELECT ?, be? FROM t"),
            ("SELECT 'é ü', 'ok' FROM t2", "SELECT ?, ? FROM t2"),
        ];
        for (q, want) in cases {
            assert_eq!(without_literals(q), want, "{q}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Any text (quotes, dollars, backslashes, comments and multi-byte characters
        /// mixed) is cut without a panic.
        #[test]
        fn any_text_is_cut_without_panic(q in "[a-zE '$\\\\/*\n\"0-9é-]{0,80}") {
            let _ = without_literals(&q);
        }

        /// After any plain text, a literal's content never comes through.
        #[test]
        fn literals_never_come_through(q in "[a-zA-Z0-9_ ,=()*.é\n]{0,60}") {
            let secret = format!("{q} WHERE x = 'k3y' OR y = $s$p4ss$s$ OR z = E'\\'s3cr3t'");
            let out = without_literals(&secret);
            proptest::prop_assert!(
                !out.contains("k3y") && !out.contains("p4ss") && !out.contains("s3cr3t"),
                "{}",
                out
            );
        }
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
