//! `worker handlers check --handlers-dir D`: every handler file of a directory read,
//! parsed and prepared against the database the way a worker prepares it, without
//! starting the daemon, so that a file can be checked before a reload or a restart.
//!
//! Each file is prepared in a transaction of its own that is rolled back (preparing changes
//! nothing, and a failure aborts only that transaction), under a short lock timeout so
//! that a table locked by a migration does not hang the check. One line per file: `ok` or
//! `FAILED` with the reason; exit 0 when every file is ok, 2 when one is not (bad input:
//! the files), 1 when the database cannot be reached.
//!
//! The check runs as whoever types it (root, usually), the service as its own user: a file
//! written 0600 by root reads fine here and stops the service at its next start. So each
//! file, the folder and the folders above it are also held against the mode bits for the
//! service's user (`--service-user`, `delay-worker` by default, skipped when no such user
//! exists; ACLs are not read), and a folder the hardened unit hides from the service
//! (`/home`, `/root`, `/run/user`, `/tmp`, `/var/tmp`) is noted.

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
    /// The problem stops the service at its start (a file it cannot read or parse), where
    /// one that only does not prepare has its event's jobs held.
    pub stops_service: bool,
    /// What works but is worth knowing (a set form left out, a built-in replaced).
    pub notes: Vec<String>,
}

/// A directory that cannot be read: the whole check is bad input.
#[derive(Debug, thiserror::Error)]
#[error("--handlers-dir: {0}")]
pub struct BadDir(pub String);

/// The service's user as the kernel checks it: uid and every group (primary first).
#[derive(Debug, Clone)]
pub struct ServiceUser {
    pub name: String,
    uid: u32,
    groups: Vec<u32>,
}

impl ServiceUser {
    /// The system user `name` with its groups, `None` when there is no such user.
    pub fn lookup(name: &str) -> Option<ServiceUser> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: getpwnam returns null or a pointer to a static record, read at once here,
        // before any other call could overwrite it (the check runs on one thread).
        let (uid, gid) = unsafe {
            let pw = libc::getpwnam(c.as_ptr());
            if pw.is_null() {
                return None;
            }
            ((*pw).pw_uid, (*pw).pw_gid)
        };
        let mut groups: Vec<libc::gid_t> = vec![0; 64];
        loop {
            let mut n = groups.len() as libc::c_int;
            // SAFETY: `groups` has room for `n` entries; getgrouplist writes at most that
            // many and sets `n` to how many there are (more than the room: it returns -1).
            let r = unsafe { libc::getgrouplist(c.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
            if r >= 0 {
                groups.truncate(n.max(0) as usize);
                break;
            }
            if n as usize <= groups.len() {
                groups = vec![gid];
                break;
            }
            groups.resize(n as usize, 0);
        }
        Some(ServiceUser {
            name: name.to_string(),
            uid,
            groups,
        })
    }

    /// Whether the mode bits give this user `want` (4 read, 1 search, 5 both) on a file
    /// with `meta`: the owner's bits if it owns it, else its groups', else the others'.
    fn may(&self, meta: &std::fs::Metadata, want: u32) -> bool {
        use std::os::unix::fs::MetadataExt;
        if self.uid == 0 {
            return true;
        }
        let mode = meta.mode();
        let bits = if meta.uid() == self.uid {
            mode >> 6
        } else if self.groups.contains(&meta.gid()) {
            mode >> 3
        } else {
            mode
        };
        bits & want == want
    }

    /// Why this user cannot do `want` on `path`, `None` when it can (or `path` cannot be
    /// read here at all: that is said elsewhere).
    fn refused(&self, path: &Path, want: u32, what: &str) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        if self.may(&meta, want) {
            return None;
        }
        let owner = user_name(meta.uid()).unwrap_or_else(|| meta.uid().to_string());
        Some(format!(
            "the service's user {} cannot {what} {} (mode {:04o}, owner {owner})",
            self.name,
            path.display(),
            meta.mode() & 0o7777
        ))
    }
}

/// The name of user `uid`, when it has one.
fn user_name(uid: u32) -> Option<String> {
    // SAFETY: as in `ServiceUser::lookup`: null or a static record, read at once.
    unsafe {
        let pw = libc::getpwuid(uid);
        if pw.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr((*pw).pw_name)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Folders the unit's hardening hides from the service (`ProtectHome=yes`,
/// `PrivateTmp=yes`).
const HIDDEN: &[(&str, &str)] = &[
    ("/home", "ProtectHome=yes"),
    ("/root", "ProtectHome=yes"),
    ("/run/user", "ProtectHome=yes"),
    ("/tmp", "PrivateTmp=yes"),
    ("/var/tmp", "PrivateTmp=yes"),
];

/// What stops `user` from reading the folder `dir`: a folder above it it may not search,
/// or the folder itself it may not list.
fn folder_refused(dir: &Path, user: &ServiceUser) -> Option<String> {
    let dir = std::fs::canonicalize(dir).ok()?;
    for above in dir.ancestors().skip(1) {
        if let Some(why) = user.refused(above, 1, "enter") {
            return Some(why);
        }
    }
    user.refused(&dir, 5, "list")
}

/// A note when the unit's hardening hides `dir` from the service.
fn hidden_note(dir: &Path) -> Option<String> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    HIDDEN
        .iter()
        .find(|(top, _)| dir.starts_with(top))
        .map(|(top, setting)| {
            format!(
                "under the unit's {setting} the service does not see {top}: put the handlers in a folder such as /etc/delay-worker/handlers"
            )
        })
}

/// Checks every `*.sql` file of `dir` against `config.database_url`, and each file's mode
/// against `user` (the service's, when it exists).
pub fn check(
    config: &Config,
    dir: &Path,
    user: Option<&ServiceUser>,
) -> anyhow::Result<Vec<Checked>> {
    let files = SqlHandler::load_each(dir).map_err(|e| BadDir(e.to_string()))?;
    if files.is_empty() {
        return Err(BadDir(format!("{}: no *.sql files", dir.display())).into());
    }
    if let Some(why) = user.and_then(|u| folder_refused(dir, u)) {
        return Err(BadDir(format!("{why}: the service would stop at it")).into());
    }
    let hidden = hidden_note(dir);
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
                    stops_service: true,
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
        notes.extend(hidden.clone());
        let mut problem = user.and_then(|u| u.refused(&path, 4, "read"));
        let stops_service = problem.is_some();
        if let Some(why) = &mut problem {
            why.push_str(": the service would stop at it (make it readable, e.g. chmod 0644)");
        } else {
            problem = prepare(&mut client, &h, &mut notes)?;
        }
        out.push(Checked {
            file,
            event: Some(event),
            problem,
            stops_service,
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

/// `worker handlers check`: the lines and the exit code. `service_user` is the user the
/// service runs as, checked when it exists.
pub fn run(
    config: &Config,
    dir: &Path,
    service_user: &str,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    let user = ServiceUser::lookup(service_user);
    if user.is_none() {
        writeln!(
            out,
            "note: no user {service_user:?} here: the files are not checked against the service's user (--service-user)"
        )?;
    }
    let checked = check(config, dir, user.as_ref())?;
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
    let files = |n: usize| if n == 1 { "file" } else { "files" };
    let failed = checked.iter().filter(|c| c.problem.is_some()).count();
    if failed == 0 {
        writeln!(out, "{} handler {} ok", checked.len(), files(checked.len()))?;
        return Ok(ExitCode::SUCCESS);
    }
    // A file that cannot be read or parsed stops the service at its start (and a reload
    // keeps the old set); one that parses but does not prepare has its event's jobs held.
    let stops = checked.iter().filter(|c| c.stops_service).count();
    let held = failed - stops;
    let mut why = Vec::new();
    if stops > 0 {
        why.push(format!(
            "{stops} would stop the service at its start (a reload keeps the handlers it has)"
        ));
    }
    if held > 0 && stops > 0 {
        why.push(format!(
            "a worker holds the jobs of the other {held} until they prepare"
        ));
    } else if held > 0 {
        why.push("a worker holds their events' jobs until they prepare".to_string());
    }
    writeln!(
        out,
        "{failed} of {} handler {} cannot run: {}",
        checked.len(),
        files(checked.len()),
        why.join("; ")
    )?;
    Ok(ExitCode::from(2))
}
