//! Who held the lock a job waited for: "waited for a lock held by pid N (running `query`)", added
//! to the reason of a job that failed on a lock timeout (SQLSTATE 55P03) or a statement
//! timeout (57014), so that the operator reads whose transaction to look at.
//!
//! PostgreSQL names the row a statement waited on in the error's context ("while updating
//! tuple (0,5) in relation \"orders\""). Once the job's transaction is rolled back, one
//! statement on the same connection asks who holds it: the row's `xmax` is the locking
//! transaction (or, for a row several transactions share-lock, a MultiXactId whose members
//! `pg_get_multixact_members` lists: of those whose lock blocks an update, the one that
//! began first is named, with how many share it), `pg_locks` gives the backend holding that transaction id, and
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
    /// A wait without a row that the look-up found another session's table lock for:
    /// a statement timeout that waited for a lock of a whole table, not a slow statement.
    pub table: bool,
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
        table: false,
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

/// One look-up: one statement (two for a row whose xmax names no lone holder).
fn look(client: &mut postgres::Client, wait: &LockWait) -> Option<String> {
    let row = match &wait.row {
        Some((relation, tid)) => {
            let xmax = format!(
                "(SELECT xmax FROM {} WHERE ctid = $1::text::tid)",
                quote_ident(relation)
            );
            // One transaction's lock: its xid in the row's xmax.
            let lone = format!(
                "SELECT l.pid, convert_to(a.query, 'SQL_ASCII'), a.state, 1::bigint \
                 FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'transactionid' AND l.granted AND l.transactionid = {xmax} \
                 LIMIT 1"
            );
            // A row share-locked by several (FOR SHARE, FOR KEY SHARE) has a MultiXactId
            // there instead, whose members hold it; for a plain xid this statement fails or
            // finds no holder. A handler's UPDATE (of no key column) waits for every lock
            // but FOR KEY SHARE ('keysh'): those members are named, the first to begin, and
            // counted; key-share members only when there are no others.
            let shared = format!(
                "SELECT l.pid, convert_to(a.query, 'SQL_ASCII'), a.state, \
                   count(*) FILTER (WHERE m.mode <> 'keysh') OVER () \
                 FROM pg_get_multixact_members({xmax}) m \
                 JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.transactionid = m.xid \
                 LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                 ORDER BY m.mode = 'keysh', a.xact_start NULLS LAST LIMIT 1"
            );
            match client.query_opt(&lone, &[tid]) {
                // A role with column grants reads a system column only when granted it.
                Err(e) if e.code() == Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
                    return Some(format!(
                        "whose lock it waited for is not known: this role may not read the \
                         row's xmax; grant SELECT (ctid, xmax) ON {relation}, as \
                         sql/grants.sql does"
                    ));
                }
                r => r
                    .ok()
                    .flatten()
                    .or_else(|| client.query_opt(&shared, &[tid]).ok().flatten()),
            }
        }
        None => None,
    };
    let (row, on) = match (row, &wait.row) {
        (Some(r), Some((relation, tid))) => {
            let sharers: i64 = r.try_get(3).unwrap_or(1);
            let shared = if sharers > 1 {
                format!(", which {sharers} transactions share: this one began first")
            } else {
                String::new()
            };
            (r, format!("on the row {tid} of {relation}{shared}"))
        }
        (None, Some(_)) => return None,
        (_, None) => {
            let r = client
                    .query_opt(
                        "SELECT l.pid, convert_to(a.query, 'SQL_ASCII'), a.state, c.relname::text FROM pg_locks l \
                         LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                         LEFT JOIN pg_class c ON c.oid = l.relation \
                         WHERE l.locktype = 'relation' AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid() \
                         AND l.mode IN ('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock') \
                         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                         ORDER BY a.xact_start NULLS LAST LIMIT 1",
                        &[],
                    )
                    .ok()??;
            let relation: Option<String> = r.try_get(3).ok().flatten();
            let on = format!("on the table {}", relation.unwrap_or_else(|| "?".into()));
            (r, on)
        }
    };
    // A prepared transaction (two-phase commit) holds its locks without a backend: no
    // pid, no query. The query comes as its stored bytes (`convert_to(.., 'SQL_ASCII')`
    // neither converts nor checks them): in a SQL_ASCII database they may be anything (a
    // shop's Latin-1 text), which would fail the whole row as text; read as well as it goes.
    let pid: Option<i32> = row.try_get(0).ok().flatten();
    let query: Option<Vec<u8>> = row.try_get(1).ok().flatten();
    let state: Option<String> = row.try_get(2).ok().flatten();
    let query = query.as_deref().map(String::from_utf8_lossy);
    Some(describe(pid, query.as_deref(), state.as_deref(), &on))
}

/// What [`holder_pid`] says of a lock held by a prepared transaction, which has no
/// session: no pid is 0.
pub const PREPARED_HOLDER: i32 = 0;

/// The pid a job's reason names as the holder of the lock it waited for
/// ([`describe`]'s words), [`PREPARED_HOLDER`] for a prepared transaction, if any.
pub fn holder_pid(reason: &str) -> Option<i32> {
    const HELD_BY: &str = "waited for a lock held by pid ";
    if reason.contains("waited for a lock held by a prepared transaction") {
        return Some(PREPARED_HOLDER);
    }
    let at = reason.find(HELD_BY)? + HELD_BY.len();
    let digits = reason[at..]
        .find(|c: char| !c.is_ascii_digit())
        .map_or(&reason[at..], |end| &reason[at..at + end]);
    digits.parse().ok()
}

/// `waited for a lock held by pid N (idle in transaction, its last statement `query`) on
/// ...`, or `(running `query`)` for a holder at work: `pg_stat_activity` shows a session's
/// current or last statement, which need not be the one that took the lock. Without a
/// pid, a prepared transaction's. `query` is `None` for another role's session seen
/// without `pg_read_all_stats`.
fn describe(pid: Option<i32>, query: Option<&str>, state: Option<&str>, on: &str) -> String {
    let Some(pid) = pid else {
        return format!(
            "waited for a lock held by a prepared transaction (two-phase commit: pg_prepared_xacts names it, COMMIT PREPARED or ROLLBACK PREPARED ends it) {on}"
        );
    };
    let query = match query {
        None | Some("<insufficient privilege>") => None,
        Some(q) => {
            let q = without_literals(q);
            let flat = q.split_whitespace().collect::<Vec<_>>().join(" ");
            let mut short: String = flat.chars().take(QUERY_CHARS).collect();
            if short.len() < flat.len() {
                short.push_str("...");
            }
            Some(short)
        }
    };
    const HIDDEN: &str = "its query is hidden from this role: grant it pg_read_all_stats";
    let what = match (state.filter(|s| !s.is_empty() && *s != "active"), query) {
        (None, Some(q)) => format!("running `{q}`"),
        (Some(s), Some(q)) => format!("{s}, its last statement `{q}`"),
        (None, None) => HIDDEN.to_string(),
        (Some(s), None) => format!("{s}, {HIDDEN}"),
    };
    format!("waited for a lock held by pid {pid} ({what}) {on}")
}

/// A query with its data taken out, for a reason that lands in Redis, the dead letters and
/// the log: each string literal (`'...'`, `E'...'`, `U&'...'`, `B'...'`, `$tag$...$tag$`)
/// and each number (`42`, `1e10`, `0x1F`, `1_000`) becomes `?`, and comments (`--`, nested
/// `/* */`) go. What is left is the statement's shape: its words, tables, columns, quoted
/// names and `$1` parameters (`UPDATE orders SET note = ? WHERE id = ?`). Read as
/// PostgreSQL's lexer reads it, token by token, and never printed half:
///
/// - a literal, comment or quoted name left open (PostgreSQL cuts a long query's text at
///   `track_activity_query_size`) runs to the end, which is then `?`;
/// - a backslash inside a plain `'...'` ends the text there too: whether it escapes the
///   quote after it depends on the holder's `standard_conforming_strings`, which another
///   session cannot see (`'O\'Brien, 12 Main St'` under `off`, PHP's `addslashes`).
fn without_literals(q: &str) -> String {
    let b = q.as_bytes();
    let n = b.len();
    let word_start = |c: u8| c.is_ascii_alphabetic() || c == b'_' || c >= 0x80;
    let word_part = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80;
    let mut out = String::with_capacity(n);
    // Where the text not yet copied starts.
    let mut from = 0;
    let cut = |out: &mut String, from: &mut usize, start: usize, end: usize, with: &str| {
        out.push_str(&q[*from..start]);
        out.push_str(with);
        *from = end;
    };
    let mut i = 0;
    while i < n {
        let c = b[i];
        if word_start(c) {
            // A word (a `$` inside is part of it), whole.
            let start = i;
            while i < n && (word_part(b[i]) || b[i] == b'$') {
                i += 1;
            }
            // E'...': the E is part of the literal, which has backslash escapes.
            if i < n && b[i] == b'\'' && i - start == 1 && matches!(b[start], b'E' | b'e') {
                let end = quoted_end(b, i, true);
                cut(&mut out, &mut from, start, end, "?");
                i = end;
            }
            continue;
        }
        let next = b.get(i + 1).copied();
        match c {
            b'\'' => {
                let end = quoted_end(b, i, false);
                cut(&mut out, &mut from, i, end, "?");
                i = end;
            }
            b'"' => {
                // A quoted name is kept as it is ("" inside is a quote); one left open goes.
                let mut j = i + 1;
                loop {
                    match b.get(j) {
                        Some(b'"') if b.get(j + 1) == Some(&b'"') => j += 2,
                        Some(b'"') => break,
                        Some(_) => j += 1,
                        None => break,
                    }
                }
                if j < n {
                    i = j + 1;
                } else {
                    cut(&mut out, &mut from, i, n, "?");
                    i = n;
                }
            }
            // A parameter, $1: kept, with the letters glued to it (`$1e` is one token to
            // PostgreSQL, an error: the `e` does not start an E'...'); a `$` after it
            // starts a dollar quote.
            b'$' if next.is_some_and(|d| d.is_ascii_digit()) => {
                i += 1;
                while i < n && word_part(b[i]) {
                    i += 1;
                }
            }
            b'$' => {
                // $tag$ ... $tag$: the tag is empty or a name without `$`.
                let mut j = i + 1;
                if j < n && word_start(b[j]) {
                    while j < n && word_part(b[j]) {
                        j += 1;
                    }
                }
                if j < n && b[j] == b'$' {
                    let tag = &q[i..=j];
                    let end = q[j + 1..].find(tag).map_or(n, |k| j + 1 + k + tag.len());
                    cut(&mut out, &mut from, i, end, "?");
                    i = end;
                } else {
                    i += 1;
                }
            }
            b'0'..=b'9' | b'.' if c != b'.' || next.is_some_and(|d| d.is_ascii_digit()) => {
                // A number in any of its forms: digits, letters (0x1F, 1e10), `_`, `.`, and
                // the sign of an exponent.
                let mut j = i;
                while j < n {
                    let d = b[j];
                    let sign = matches!(d, b'+' | b'-') && matches!(b[j - 1], b'e' | b'E');
                    if d.is_ascii_alphanumeric() || d == b'_' || d == b'.' || sign {
                        j += 1;
                    } else {
                        break;
                    }
                }
                cut(&mut out, &mut from, i, j, "?");
                i = j;
            }
            b'-' if next == Some(b'-') => {
                let end = q[i..].find(['\n', '\r']).map_or(n, |k| i + k);
                cut(&mut out, &mut from, i, end, " ");
                i = end;
            }
            b'/' if next == Some(b'*') => {
                // Comments nest.
                let (mut j, mut depth) = (i + 2, 1);
                while j < n && depth > 0 {
                    if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                        depth += 1;
                        j += 2;
                    } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                        depth -= 1;
                        j += 2;
                    } else {
                        j += 1;
                    }
                }
                let end = if depth == 0 { j } else { n };
                cut(&mut out, &mut from, i, end, " ");
                i = end;
            }
            _ => i += 1,
        }
    }
    out.push_str(&q[from..]);
    out
}

/// Where the `'...'` literal opening at `open` ends (after its closing quote), or the end
/// of the text: when it is left open, and for a backslash in a plain literal (see
/// [`without_literals`]). `escapes`: an `E'...'`, where a backslash escapes what follows.
fn quoted_end(b: &[u8], open: usize, escapes: bool) -> usize {
    let mut j = open + 1;
    while j < b.len() {
        match b[j] {
            b'\\' if escapes => j += 2,
            b'\\' => return b.len(),
            b'\'' if b.get(j + 1) == Some(&b'\'') => j += 2,
            b'\'' => return j + 1,
            _ => j += 1,
        }
    }
    b.len()
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
    fn the_holder_s_pid_comes_out_of_a_reason() {
        let reason = format!(
            "canceling statement due to lock timeout (55P03): {}",
            describe(
                Some(4242),
                Some("SELECT 1 FROM orders WHERE id = 7 FOR UPDATE"),
                Some("idle in transaction"),
                "on the row (0,7) of orders"
            )
        );
        assert_eq!(holder_pid(&reason), Some(4242));
        let prepared = describe(None, None, None, "on the table orders");
        assert_eq!(holder_pid(&prepared), Some(PREPARED_HOLDER));
        assert_eq!(
            holder_pid("canceling statement due to lock timeout (55P03)"),
            None
        );
    }

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
            // The outside pass's findings. standard_conforming_strings off (PHP's
            // addslashes): a backslash in a plain literal ends the text; so it does with
            // the setting on, where it cannot be told apart.
            (
                "UPDATE orders SET cancel_reason = 'customer O\\'Brien, 12 Main St, phone 555-0199' WHERE id = 96;",
                "UPDATE orders SET cancel_reason = ?",
            ),
            (
                "SELECT 1 FROM orders WHERE order_no NOT IN ('C:\\', 'SECB1') FOR UPDATE",
                "SELECT ? FROM orders WHERE order_no NOT IN (?",
            ),
            // Dollar tags with digits, non-ASCII letters, underscores; after a number or a
            // parameter.
            (
                "SELECT $x1$SECP1$x1$, $é$SECQ1$é$, $_$SECR1$_$, a$b FROM t",
                "SELECT ?, ?, ?, a$b FROM t",
            ),
            ("WHERE id = 1$$SECGG1$$ AND x = $2$tag$SECII2$tag$", "WHERE id = ?? AND x = $2?"),
            // `$1e` is one (bad) token: no E'...' starts in it.
            ("NOT IN ($1e'C:\\', 'SECGG2') AND $1E'x'", "NOT IN ($1e?"),
            // Comments nest; a line comment ends at \r too.
            (
                "SELECT 1 FROM orders /* outer /* inner */ SECJ1 alice */ WHERE id = 12",
                "SELECT ? FROM orders   WHERE id = ?",
            ),
            ("WHERE id = 64 -- note\r AND no <> 'S'", "WHERE id = ?  \r AND no <> ?"),
            // Numbers in every form.
            (
                "WHERE a <> 4111e15 AND 1e10 > .5 AND -42 < 1.5e-3 AND 7E+2 = x",
                "WHERE a <> ? AND ? > ? AND -? < ? AND ? = x",
            ),
            (
                "IN (0x5EC7E7, 0o777123, 0b101101, 1_234_567, 0X_BEEF)",
                "IN (?, ?, ?, ?, ?)",
            ),
            // Quoted names are kept, doubled quotes inside them too.
            (
                "SELECT 1 AS \"it's\", 'SECO1' AS \"a\"\"b\" FROM \"My Orders\"",
                "SELECT ? AS \"it's\", ? AS \"a\"\"b\" FROM \"My Orders\"",
            ),
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
            // Markers the plain text cannot spell (`~`, or longer than chance makes).
            let secret = format!(
                "{q} WHERE x = 'k~3y' OR y = $s1$p~4ss$s1$ OR z = E'\\'s~3cr3t' /* c /* 4c */ 0x5EC7E7A1 */ OR n = 4111222333e15 OR m = 0x5EC7E7A1 OR w = 'O\\'Br~13n, 12 Main'"
            );
            let out = without_literals(&secret);
            for data in ["k~3y", "p~4ss", "s~3cr3t", "5EC7E7A1", "4111222333", "Br~13n", "12 Main"] {
                proptest::prop_assert!(!out.contains(data), "{} in {}", data, out);
            }
        }
    }

    #[test]
    fn the_holder_reads_as_a_sentence() {
        assert_eq!(
            describe(
                Some(42),
                Some("SELECT  *\n FROM orders FOR UPDATE"),
                Some("idle in transaction"),
                "on the row (0,1) of orders"
            ),
            "waited for a lock held by pid 42 (idle in transaction, its last statement `SELECT * FROM orders FOR UPDATE`) on the row (0,1) of orders"
        );
        assert_eq!(
            describe(
                Some(42),
                Some("UPDATE sku SET stock = stock - 1"),
                Some("active"),
                "on the row (0,1) of sku"
            ),
            "waited for a lock held by pid 42 (running `UPDATE sku SET stock = stock - ?`) on the row (0,1) of sku"
        );
        assert!(describe(
            Some(7),
            Some("<insufficient privilege>"),
            None,
            "on the table t"
        )
        .contains("grant it pg_read_all_stats"));
        assert!(
            describe(Some(7), None, None, "on the table t").contains("grant it pg_read_all_stats")
        );
        assert_eq!(
            describe(None, None, None, "on the row (0,1) of orders"),
            "waited for a lock held by a prepared transaction (two-phase commit: pg_prepared_xacts names it, COMMIT PREPARED or ROLLBACK PREPARED ends it) on the row (0,1) of orders"
        );
    }
}
