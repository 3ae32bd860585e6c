//! Handlers written as one SQL statement in a file.
//!
//! The file starts with comment lines that declare the handler:
//!
//! ```sql
//! -- event: order.timeout
//! -- requires: order_id|order_no
//! UPDATE ... WHERE id = ($1 ->> 'order_id')::bigint ...
//! ```
//!
//! `$1` is the payload as `jsonb`. The statement's row count (rows updated, or rows
//! returned by a final `SELECT`) says what happened: 0 is a no-op, more is applied.
//! `requires:` lists comma-separated groups of `|`-separated alternatives; without an
//! `event:` line the file name (less `.sql`) is the event.
//!
//! A line `-- set:` may follow the statement, and after it a second statement: the
//! handler's *set form*, which does the work of many jobs at once (see
//! [`Handler::set_statement`]). `$1` is then a `jsonb` array of
//! `{"i": <index>, "payload": <payload>}`, and the statement returns one row per job that
//! changed something, its index in the first column (`integer`). It must take its row
//! locks in one global order (for example `ORDER BY id ... FOR UPDATE` per table, tables
//! in the same order as the one-job statement), so that sets running at once never
//! deadlock each other.

use super::{Effect, Handler};
use postgres::types::Type;
use postgres::{Statement, Transaction};
use serde_json::Value;
use std::path::Path;

/// The built-in handlers, compiled in from `sql/handlers/`.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "order.timeout.sql",
        include_str!("../../sql/handlers/order.timeout.sql"),
    ),
    (
        "aftersale.timeout.sql",
        include_str!("../../sql/handlers/aftersale.timeout.sql"),
    ),
    (
        "coupon.expire.sql",
        include_str!("../../sql/handlers/coupon.expire.sql"),
    ),
    (
        "payment.paid.sql",
        include_str!("../../sql/handlers/payment.paid.sql"),
    ),
];

/// One file of a handler directory and what it parsed into.
pub type LoadedFile = (std::path::PathBuf, Result<SqlHandler, SqlHandlerError>);

#[derive(Debug, Clone)]
pub struct SqlHandler {
    event: String,
    /// The file it was read from (its name for a built-in one).
    file: String,
    required: Vec<Vec<String>>,
    sql: String,
    set_sql: Option<String>,
}

/// The line that starts a handler file's set form.
const SET_MARKER: &str = "-- set:";

#[derive(Debug, thiserror::Error)]
pub enum SqlHandlerError {
    #[error("{file}: no SQL after the header")]
    Empty { file: String },
    #[error("{file}: no SQL after the `-- set:` line")]
    EmptySet { file: String },
    #[error("{file}: the `-- event:` line names no event")]
    NoEvent { file: String },
    #[error("{file}: two `-- event:` lines ({first:?} and {second:?}): a file serves one event")]
    TwoEvents {
        file: String,
        first: String,
        second: String,
    },
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
}

impl SqlHandler {
    /// Parses a handler file's text; `file` names it in errors and gives the default event.
    pub fn parse(file: &str, text: &str) -> Result<SqlHandler, SqlHandlerError> {
        let (text, set_text) = split_set_form(text);
        let mut event = file.strip_suffix(".sql").unwrap_or(file).to_string();
        let mut named: Option<String> = None;
        let mut required = Vec::new();
        for line in text.lines() {
            let Some(comment) = line.trim().strip_prefix("--") else {
                continue;
            };
            let comment = comment.trim();
            if let Some(e) = comment.strip_prefix("event:") {
                let e = e.trim().to_string();
                if let Some(first) = named.replace(e.clone()) {
                    return Err(SqlHandlerError::TwoEvents {
                        file: file.to_string(),
                        first,
                        second: e,
                    });
                }
                event = e;
            } else if let Some(r) = comment.strip_prefix("requires:") {
                for group in r.split(',') {
                    let alts: Vec<String> = group
                        .split('|')
                        .map(|f| f.trim().to_string())
                        .filter(|f| !f.is_empty())
                        .collect();
                    if !alts.is_empty() {
                        required.push(alts);
                    }
                }
            }
        }
        if event.is_empty() {
            return Err(SqlHandlerError::NoEvent {
                file: file.to_string(),
            });
        }
        if !has_sql(text) {
            return Err(SqlHandlerError::Empty {
                file: file.to_string(),
            });
        }
        let set_sql = match set_text {
            Some(t) if has_sql(t) => Some(t.trim().trim_end_matches(';').to_string()),
            Some(_) => {
                return Err(SqlHandlerError::EmptySet {
                    file: file.to_string(),
                })
            }
            None => None,
        };
        Ok(SqlHandler {
            event,
            file: file.to_string(),
            required,
            sql: text.trim().trim_end_matches(';').to_string(),
            set_sql,
        })
    }

    /// The one-job statement.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The set form's statement, if the file has one.
    pub fn set_sql(&self) -> Option<&str> {
        self.set_sql.as_deref()
    }

    /// Loads every `*.sql` file of a directory, sorted by name.
    pub fn load_dir(dir: &Path) -> Result<Vec<SqlHandler>, SqlHandlerError> {
        Self::load_each(dir)?.into_iter().map(|(_, h)| h).collect()
    }

    /// Every `*.sql` file of `dir`, in name order, with what it parsed into: each file's
    /// own result, so that one broken file does not hide the others (`worker handlers
    /// check`). Only a directory that cannot be read fails the whole.
    pub fn load_each(dir: &Path) -> Result<Vec<LoadedFile>, SqlHandlerError> {
        let read_err = |source| SqlHandlerError::Read {
            file: dir.display().to_string(),
            source,
        };
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map_err(read_err)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "sql"))
            .collect();
        paths.sort();
        Ok(paths
            .into_iter()
            .map(|p| {
                let parsed = std::fs::read_to_string(&p)
                    .map_err(|source| SqlHandlerError::Read {
                        file: p.display().to_string(),
                        source,
                    })
                    .and_then(|text| {
                        let name = p.file_name().unwrap_or_default().to_string_lossy();
                        let mut h = SqlHandler::parse(&name, &text)?;
                        h.file = p.display().to_string();
                        Ok(h)
                    });
                (p, parsed)
            })
            .collect())
    }
}

/// The text before the `-- set:` line, and the set form after it.
fn split_set_form(text: &str) -> (&str, Option<&str>) {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim().starts_with(SET_MARKER) {
            return (&text[..at], Some(&text[at + line.len()..]));
        }
        at += line.len();
    }
    (text, None)
}

/// Whether a text holds a line that is neither blank nor a comment.
fn has_sql(text: &str) -> bool {
    text.lines()
        .any(|l| !l.trim().is_empty() && !l.trim().starts_with("--"))
}

impl Handler for SqlHandler {
    fn event(&self) -> &str {
        &self.event
    }

    fn source(&self) -> Option<&str> {
        // Built-in files are named without a directory.
        self.file.contains('/').then_some(self.file.as_str())
    }

    fn required(&self) -> &[Vec<String>] {
        &self.required
    }

    fn statements(&self) -> Vec<(String, Vec<Type>)> {
        vec![(self.sql.clone(), vec![Type::JSONB])]
    }

    fn set_statement(&self) -> Option<String> {
        self.set_sql.clone()
    }

    fn has_set_form(&self) -> bool {
        self.set_sql.is_some()
    }

    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        statements: &[Statement],
        payload: &Value,
    ) -> Result<Effect, postgres::Error> {
        let rows = tx.execute(&statements[0], &[payload])?;
        Ok(if rows > 0 {
            Effect::Applied
        } else {
            Effect::NoOp
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_declares_event_and_requirements() {
        let h = SqlHandler::parse(
            "x.sql",
            "-- event: a.b\n-- requires: id|no, user\nUPDATE t SET x = 1",
        )
        .unwrap();
        assert_eq!(h.event(), "a.b");
        assert_eq!(
            h.required(),
            &[
                vec!["id".to_string(), "no".to_string()],
                vec!["user".to_string()]
            ]
        );
        let h = SqlHandler::parse("c.d.sql", "SELECT 1").unwrap();
        assert_eq!(h.event(), "c.d");
        assert!(SqlHandler::parse("e.sql", "-- only a comment\n").is_err());
        // A header that names no event is refused, not a handler of "" that never runs.
        let e = SqlHandler::parse("f.sql", "-- event:\nSELECT 1").unwrap_err();
        assert_eq!(e.to_string(), "f.sql: the `-- event:` line names no event");
        assert!(SqlHandler::parse(".sql", "SELECT 1").is_err());
        let e = SqlHandler::parse("g.sql", "-- event: a\n-- event: b\nSELECT 1").unwrap_err();
        assert!(e.to_string().contains("two `-- event:` lines"), "{e}");
    }

    #[test]
    fn builtins_parse() {
        let r = crate::handlers::Registry::builtin();
        assert_eq!(
            r.events(),
            vec![
                "order.timeout",
                "aftersale.timeout",
                "coupon.expire",
                "payment.paid"
            ]
        );
        let (_, h) = r.get("order.timeout").unwrap();
        assert_eq!(h.required().len(), 1);
    }
}
