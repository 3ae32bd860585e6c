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

#[derive(Debug, Clone)]
pub struct SqlHandler {
    event: String,
    required: Vec<Vec<String>>,
    sql: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SqlHandlerError {
    #[error("{file}: no SQL after the header")]
    Empty { file: String },
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
}

impl SqlHandler {
    /// Parses a handler file's text; `file` names it in errors and gives the default event.
    pub fn parse(file: &str, text: &str) -> Result<SqlHandler, SqlHandlerError> {
        let mut event = file.strip_suffix(".sql").unwrap_or(file).to_string();
        let mut required = Vec::new();
        for line in text.lines() {
            let Some(comment) = line.trim().strip_prefix("--") else {
                continue;
            };
            let comment = comment.trim();
            if let Some(e) = comment.strip_prefix("event:") {
                event = e.trim().to_string();
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
        let has_sql = text
            .lines()
            .any(|l| !l.trim().is_empty() && !l.trim().starts_with("--"));
        if !has_sql {
            return Err(SqlHandlerError::Empty {
                file: file.to_string(),
            });
        }
        Ok(SqlHandler {
            event,
            required,
            sql: text.to_string(),
        })
    }

    /// Loads every `*.sql` file of a directory, sorted by name.
    pub fn load_dir(dir: &Path) -> Result<Vec<SqlHandler>, SqlHandlerError> {
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
        paths
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(p).map_err(|source| SqlHandlerError::Read {
                    file: p.display().to_string(),
                    source,
                })?;
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                SqlHandler::parse(&name, &text)
            })
            .collect()
    }
}

impl Handler for SqlHandler {
    fn event(&self) -> &str {
        &self.event
    }

    fn required(&self) -> &[Vec<String>] {
        &self.required
    }

    fn statements(&self) -> Vec<(String, Vec<Type>)> {
        vec![(self.sql.clone(), vec![Type::JSONB])]
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
