//! `worker handlers check --handlers-dir D`: every handler file of a directory read,
//! parsed and prepared against the database the way a worker prepares it, without
//! starting the daemon, so that a file can be checked before a reload or a restart.
//!
//! Each file is prepared in a transaction of its own that is rolled back (preparing changes
//! nothing, and a failure aborts only that transaction), under a short lock timeout so
//! that a table locked by a migration does not hang the check. One line per file: `ok` or
//! `FAILED` with the reason; exit 0 when every file is ok, 2 when one is not (bad input:
//! the files), 1 when the database cannot be reached.

use crate::config::Config;
use crate::handlers::sql::SqlHandler;
use crate::handlers::{Handler, Registry};
use postgres::types::Type;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

/// What became of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub file: String,
    /// The event it serves, when it parsed.
    pub event: Option<String>,
    /// Why it cannot run, `None` when it can.
    pub problem: Option<String>,
    /// What works but is worth knowing (a set form left out, a built-in replaced).
    pub notes: Vec<String>,
}

/// A directory that cannot be read: the whole check is bad input.
#[derive(Debug, thiserror::Error)]
#[error("--handlers-dir: {0}")]
pub struct BadDir(pub String);

/// Checks every `*.sql` file of `dir` against `config.database_url`.
pub fn check(config: &Config, dir: &Path) -> anyhow::Result<Vec<Checked>> {
    let files = SqlHandler::load_each(dir).map_err(|e| BadDir(e.to_string()))?;
    if files.is_empty() {
        return Err(BadDir(format!("{}: no *.sql files", dir.display())).into());
    }
    let mut client = crate::db::connect(&config.database_url)?;
    let builtin = Registry::builtin();
    let mut served: HashMap<String, String> = HashMap::new();
    let mut out = Vec::new();
    for (path, parsed) in files {
        let file = path.display().to_string();
        let h = match parsed {
            Ok(h) => h,
            Err(e) => {
                // The parser names the file by its name; the line names it already.
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let e = e.to_string();
                let e = e.strip_prefix(&format!("{name}: ")).unwrap_or(&e);
                out.push(Checked {
                    file,
                    event: None,
                    problem: Some(format!("does not parse: {e}")),
                    notes: Vec::new(),
                });
                continue;
            }
        };
        let event = h.event().to_string();
        let mut notes = Vec::new();
        if builtin.get(&event).is_some() {
            notes.push(format!("replaces the built-in handler of {event:?}"));
        }
        if let Some(earlier) = served.insert(event.clone(), file.clone()) {
            notes.push(format!(
                "{earlier} serves {event:?} too: this file, later in name order, wins"
            ));
        }
        let problem = prepare(&mut client, &h, &mut notes)?;
        out.push(Checked {
            file,
            event: Some(event),
            problem,
            notes,
        });
    }
    Ok(out)
}

/// Prepares `h`'s statements in a transaction rolled back: `Ok(Some(reason))` when one
/// does not prepare; `Err` only when the connection itself failed.
fn prepare(
    client: &mut postgres::Client,
    h: &SqlHandler,
    notes: &mut Vec<String>,
) -> anyhow::Result<Option<String>> {
    let mut tx = client.transaction()?;
    tx.batch_execute("SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '10s'")?;
    let mut problem = None;
    for (sql, types) in h.statements() {
        if let Err(e) = tx.prepare_typed(&sql, &types) {
            if e.as_db_error().is_none() {
                return Err(crate::db::DbError::Postgres(e).into());
            }
            problem = Some(format!("does not prepare: {}", crate::db::error_text(&e)));
            break;
        }
    }
    if problem.is_none() {
        if let Some(sql) = h.set_statement() {
            match tx.prepare_typed(&sql, &[Type::JSONB]) {
                Ok(st) => {
                    if let Some(shape) = crate::workers::session::set_shape(&st) {
                        notes.push(format!(
                            "its set form is not used, its jobs run one by one: {shape}"
                        ));
                    }
                }
                Err(e) if e.as_db_error().is_some() => {
                    problem = Some(format!(
                        "its set form does not prepare: {}",
                        crate::db::error_text(&e)
                    ));
                }
                Err(e) => return Err(crate::db::DbError::Postgres(e).into()),
            }
        }
    }
    // A failed statement left the transaction aborted; either way nothing is kept.
    tx.rollback()?;
    Ok(problem)
}

/// `worker handlers check`: the lines and the exit code.
pub fn run(config: &Config, dir: &Path, out: &mut impl Write) -> anyhow::Result<ExitCode> {
    let checked = check(config, dir)?;
    for c in &checked {
        let event = c.event.as_deref().unwrap_or("-");
        match &c.problem {
            None => writeln!(out, "ok      {event}  {}", c.file)?,
            Some(p) => writeln!(out, "FAILED  {event}  {}: {p}", c.file)?,
        }
        for n in &c.notes {
            writeln!(out, "        note: {n}")?;
        }
    }
    let failed = checked.iter().filter(|c| c.problem.is_some()).count();
    if failed == 0 {
        writeln!(out, "{} handler files ok", checked.len())?;
        Ok(ExitCode::SUCCESS)
    } else {
        writeln!(
            out,
            "{failed} of {} handler files cannot run: a worker holds their events' jobs until they do",
            checked.len()
        )?;
        Ok(ExitCode::from(2))
    }
}
