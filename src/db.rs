//! PostgreSQL: where it is and how to reach it ([`Target`]: the connection string with
//! libpq's TLS settings, every connection attempt under one deadline), the connection
//! pool, schema migrations, and how errors are classified.
//!
//! The pool (r2d2) holds one connection per worker thread; each connection carries the
//! statement timeout from the config (set once at connect, not per job). Migrations are
//! embedded in the binary and applied in order, each in its own transaction, under an
//! advisory lock so several hosts starting at once apply each exactly once.

use crate::conninfo;
use crate::tls::{self, PgTls, RootCert, SslMode};
use postgres::tls::MakeTlsConnect;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres_rustls::MakeRustlsConnect;

pub type Pool = r2d2::Pool<Manager>;
pub type Conn = r2d2::PooledConnection<Manager>;

/// The longest a whole connection attempt may take: TCP connect, TLS handshake,
/// authentication, up to the server's first "ready". A server that accepts the
/// connection and then says nothing is given up on after this.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// The TCP connect alone (per address tried), within [`HANDSHAKE_DEADLINE`].
const TCP_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The longest a worker's checkout waits for a connection. r2d2 tries a connection that
/// failed again after 0.2, 0.4, ... s, at most half this apart, whether or not anyone
/// waits: so through an outage a missing connection is tried every 0.5 s, and jobs flow
/// within about that once a standby is promoted (at 5 s, every 2.5 s: up to 2.5 s late).
pub const CHECKOUT: Duration = Duration::from_secs(1);

/// Connection attempts given up on that still wait for their server; past this many, a
/// new attempt fails at once instead of adding one more waiting thread.
const MAX_WAITING_ATTEMPTS: usize = 4;

/// The connection-string settings that are libpq's TLS settings, taken out before the
/// rest goes to the `postgres` crate (which knows only `sslmode=disable|prefer|require`).
const TLS_KEYS: &[&str] = &["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// libpq's `target_session_attrs`, read by the worker itself: the `postgres` crate knows
/// only `any`, `read-write` and `read-only`, and the worker needs a server it can write to
/// whatever the string says (see [`Target::parse`]).
const SESSION_ATTRS: &str = "target_session_attrs";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("DATABASE_URL is not a valid PostgreSQL connection string: {0}")]
    BadUrl(String),
    /// A TLS setting that cannot work (a file that cannot be read, a mode that needs a
    /// root certificate): bad input.
    #[error("DATABASE_URL: {0}")]
    BadTls(#[source] tls::SetupError),
    #[error("cannot reach PostgreSQL at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("migration {name} failed: {}", error_text(.error))]
    Migration {
        name: &'static str,
        error: postgres::Error,
    },
    #[error("postgres: {}", error_text(.0))]
    Postgres(postgres::Error),
}

// By hand rather than `#[from]`: the message above already carries the error's text, and
// a `source` would print it twice in the one-line error of `main`.
impl From<postgres::Error> for DbError {
    fn from(e: postgres::Error) -> Self {
        DbError::Postgres(e)
    }
}

/// A PostgreSQL server to connect to: the connection string parsed, its TLS settings
/// (libpq's `sslmode`, `sslrootcert`, `sslcert`, `sslkey`, in either form of the string)
/// turned into a rustls connector, the files read.
#[derive(Clone)]
pub struct Target {
    /// Everything but TLS; callers may add options, timeouts, the application name.
    pub config: postgres::Config,
    tls: MakeRustlsConnect,
    /// The TLS settings, as understood.
    pub tls_settings: PgTls,
    /// The connection string with its secrets hidden, for messages.
    pub shown: String,
    /// What to do about a password that seems to hold reserved characters unencoded,
    /// added to a failed connection's message.
    hint: Option<String>,
}

impl Target {
    /// Keeps every session's `search_path` at `path` ([`search_path_option`]); an empty
    /// one (none read at the start) leaves the server's.
    pub fn keep_search_path(&mut self, path: &str) {
        if !path.is_empty() {
            self.add_options(&search_path_option(path));
        }
    }

    /// Adds session options (`-c name=value ...`) after those the connection string
    /// gives (`options=-c search_path=shop`), which are kept; where both set one, these
    /// win (PostgreSQL applies them in order).
    pub fn add_options(&mut self, extra: &str) {
        let all = match self.config.get_options() {
            Some(own) if !own.trim().is_empty() => format!("{own} {extra}"),
            _ => extra.to_string(),
        };
        self.config.options(&all);
    }

    /// Parses a URL or `key=value` connection string. Without `sslmode`, `prefer` (as
    /// libpq; `verify-full` with `sslrootcert=system`).
    pub fn parse(url: &str) -> Result<Target, DbError> {
        let settings = if conninfo::is_url(url) {
            conninfo::query_settings(url)
        } else {
            conninfo::key_values(url)
        };
        // As libpq: a setting given twice counts with its last value.
        let get = |key: &str| {
            settings
                .iter()
                .rev()
                .find(|p| p.key == key)
                .map(|p| p.value.clone())
                .filter(|v| !v.is_empty())
        };
        let rest = conninfo::without(url, |k| TLS_KEYS.contains(&k) || k == SESSION_ATTRS);
        let hint = conninfo::percent_encoding_hint(url);
        let mut config: postgres::Config = rest.parse().map_err(|e: postgres::Error| {
            // libpq's key=value form quotes instead: a password with a blank, a quote or
            // a backslash that was not quoted breaks the string at it.
            let quoting = (!conninfo::is_url(url) && url.contains("password")).then(|| {
                r"a value with blanks, ' or \ goes in single quotes, with ' and \ escaped by a backslash: password='p s\'s'".to_string()
            });
            DbError::BadUrl(match hint.as_ref().or(quoting.as_ref()) {
                Some(hint) => format!("{}; {hint}", error_text(&e)),
                None => error_text(&e),
            })
        })?;
        // Every connection must take writes: a standby, or a primary turned read-only
        // (default_transaction_read_only), is skipped for the next host of a multi-host
        // string, and refused when it is the only one, as libpq's read-write does. So
        // `any` (libpq's default) and `primary` mean read-write here; asking for a
        // read-only server cannot work for a worker that writes.
        match get(SESSION_ATTRS).as_deref() {
            None | Some("any" | "read-write" | "primary") => {}
            Some(other) => {
                return Err(DbError::BadUrl(format!(
                    "target_session_attrs={other}: the worker writes, so it needs read-write (or any, or primary)"
                )))
            }
        }
        config.target_session_attrs(postgres::config::TargetSessionAttrs::ReadWrite);
        let root = get("sslrootcert").map(|v| {
            if v == "system" {
                RootCert::System
            } else {
                RootCert::File(PathBuf::from(v))
            }
        });
        let mode = match get("sslmode") {
            Some(m) => SslMode::parse(&m).map_err(DbError::BadTls)?,
            None if root == Some(RootCert::System) => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        if root == Some(RootCert::System) && mode != SslMode::VerifyFull {
            return Err(DbError::BadTls(tls::SetupError {
                setting: "sslrootcert",
                problem: format!(
                    "system needs sslmode=verify-full (or none), not {}",
                    mode.as_str()
                ),
            }));
        }
        let tls_settings = PgTls {
            mode,
            root,
            cert: get("sslcert").map(PathBuf::from),
            key: get("sslkey").map(PathBuf::from),
        };
        let tls = if mode == SslMode::Disable {
            tls::pg_connector(&PgTls {
                mode,
                root: None,
                cert: None,
                key: None,
            })
        } else {
            tls::pg_connector(&tls_settings)
        }
        .map_err(DbError::BadTls)?;
        // libpq uses no TLS on Unix sockets, whatever the mode.
        let all_unix = !config.get_hosts().is_empty()
            && config
                .get_hosts()
                .iter()
                .all(|h| !matches!(h, postgres::config::Host::Tcp(_)));
        config.ssl_mode(match mode {
            _ if all_unix => postgres::config::SslMode::Disable,
            SslMode::Disable => postgres::config::SslMode::Disable,
            SslMode::Prefer => postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                postgres::config::SslMode::Require
            }
        });
        // The string's own connect_timeout counts; the whole attempt stays within the
        // handshake deadline either way.
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(TCP_CONNECT_TIMEOUT);
        }
        config.application_name("delay-worker");
        Ok(Target {
            config,
            tls,
            tls_settings,
            shown: crate::config::redact_url(url),
            hint,
        })
    }

    /// One connection, without a deadline of its own (for callers that bound the wait
    /// themselves).
    pub fn connect(&self) -> Result<postgres::Client, postgres::Error> {
        self.config.connect(Tls {
            inner: self.tls.clone(),
            reached: None,
        })
    }

    /// One connection, the whole attempt within `deadline`. The attempt runs on a thread
    /// of its own; one given up on is left to finish by itself (at most
    /// [`MAX_WAITING_ATTEMPTS`] at a time). The error says why: refused, timed out (and
    /// whether the server accepted the connection), authentication, TLS.
    pub fn connect_within(&self, deadline: Duration) -> Result<postgres::Client, DbError> {
        const RUNNING: u8 = 0;
        const DONE: u8 = 1;
        const ABANDONED: u8 = 2;
        static WAITING: AtomicUsize = AtomicUsize::new(0);
        let waiting = WAITING.load(Ordering::SeqCst);
        if waiting >= MAX_WAITING_ATTEMPTS {
            return Err(self.unreachable(format!(
                "timed out: {waiting} earlier connection attempts still wait for the server to answer"
            )));
        }
        let reached = Arc::new(AtomicBool::new(false));
        let state = Arc::new(AtomicU8::new(RUNNING));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (config, st) = (self.config.clone(), state.clone());
        let tls = Tls {
            inner: self.tls.clone(),
            reached: Some(reached.clone()),
        };
        std::thread::Builder::new()
            .name("pg-connect".into())
            .spawn(move || {
                let _ = tx.send(config.connect(tls));
                if st.swap(DONE, Ordering::SeqCst) == ABANDONED {
                    WAITING.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| self.unreachable(format!("cannot start a connection attempt: {e}")))?;
        let result = match rx.recv_timeout(deadline) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                WAITING.fetch_add(1, Ordering::SeqCst);
                match state.compare_exchange(RUNNING, ABANDONED, Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => {
                        let secs = deadline.as_secs_f64();
                        return Err(self.unreachable(if reached.load(Ordering::SeqCst) {
                            format!("timed out: the server accepted the connection but did not answer within {secs}s")
                        } else {
                            format!("timed out: no connection within {secs}s")
                        }));
                    }
                    // It finished just now.
                    Err(_) => {
                        WAITING.fetch_sub(1, Ordering::SeqCst);
                        rx.recv()
                            .map_err(|_| self.unreachable("the connection attempt failed"))?
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(self.unreachable("the connection attempt failed"))
            }
        };
        result.map_err(|e| self.unreachable(error_text(&e)))
    }

    fn unreachable(&self, reason: impl Into<String>) -> DbError {
        let mut reason = reason.into();
        if let Some(hint) = &self.hint {
            reason.push_str("; ");
            reason.push_str(hint);
        }
        DbError::Unreachable {
            url: self.shown.clone(),
            reason,
        }
    }
}

/// The rustls connector, noting when a connection attempt has its TCP connection (the
/// `postgres` crate asks for the TLS connector right after the socket connects, in every
/// mode), so a deadline can tell a silent server from an unreachable one.
#[derive(Clone)]
struct Tls {
    inner: MakeRustlsConnect,
    reached: Option<Arc<AtomicBool>>,
}

impl<S> MakeTlsConnect<S> for Tls
where
    MakeRustlsConnect: MakeTlsConnect<S>,
{
    type Stream = <MakeRustlsConnect as MakeTlsConnect<S>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<S>>::TlsConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<S>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        if let Some(r) = &self.reached {
            r.store(true, Ordering::SeqCst);
        }
        self.inner.make_tls_connect(domain)
    }
}

/// A pooled connection: the client, and whether it must not be used again.
///
/// A connection that failed is thrown away, never handed back to the pool: it may sit in
/// an aborted transaction (every statement then fails with 25P02 until a ROLLBACK), on a
/// server that turned read-only, or half-way through a protocol exchange. Workers call
/// [`PgConn::discard`] before they drop it; the pool then closes it instead of keeping it.
pub struct PgConn {
    client: postgres::Client,
    discarded: bool,
}

impl PgConn {
    /// Marks the connection for closing when it goes back to the pool.
    pub fn discard(&mut self) {
        self.discarded = true;
    }
}

impl std::ops::Deref for PgConn {
    type Target = postgres::Client;
    fn deref(&self) -> &postgres::Client {
        &self.client
    }
}

impl std::ops::DerefMut for PgConn {
    fn deref_mut(&mut self) -> &mut postgres::Client {
        &mut self.client
    }
}

/// The pool's connection manager: every connection made under [`HANDSHAKE_DEADLINE`], and
/// checked to take writes when it is handed out.
pub struct Manager {
    target: Target,
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConn;
    type Error = DbError;

    fn connect(&self) -> Result<PgConn, DbError> {
        let mut client = self.target.connect_within(HANDSHAKE_DEADLINE)?;
        if let Some(why) = keep_session(&mut client)? {
            return Err(DbError::Unreachable {
                url: self.target.shown.clone(),
                reason: why.to_string(),
            });
        }
        Ok(PgConn {
            client,
            discarded: false,
        })
    }

    /// At every checkout (a worker's new session): the server still takes writes. One that
    /// turned read-only since the connection was made (a primary demoted, or
    /// `default_transaction_read_only` switched on) is left for a new connection, which
    /// goes to a writable host of the string or fails.
    fn is_valid(&self, conn: &mut PgConn) -> Result<(), DbError> {
        let rows = conn.client.simple_query("SHOW transaction_read_only")?;
        let read_only = rows.iter().any(|m| match m {
            postgres::SimpleQueryMessage::Row(r) => r.get(0) == Some("on"),
            _ => false,
        });
        if read_only {
            return Err(DbError::Unreachable {
                url: self.target.shown.clone(),
                reason: READ_ONLY.to_string(),
            });
        }
        Ok(())
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        conn.discarded || conn.client.is_closed()
    }
}

/// Undoes a role's or database's `idle_session_timeout` (PostgreSQL 14 and later; older
/// servers have none, and would refuse the name as a session option) on a session the
/// worker keeps between statements: the workers' and the database watch's. Found from
/// outside: `ALTER ROLE ... SET idle_session_timeout = '200ms'` ended the watch's session
/// between its looks, and `/healthz` said "no writable PostgreSQL: connection closed".
/// Also reads the session's `session_replication_role` (see [`keep_session`]).
const KEEP_SESSION: &str = "SELECT current_setting('session_replication_role'), \
     (SELECT set_config('idle_session_timeout', '0', false) \
       WHERE current_setting('server_version_num')::int >= 140000)";

/// What a session whose writes would pass the shop's triggers by is told.
pub const TRIGGERS_OFF: &str = "session_replication_role is not origin for the worker's \
     sessions (ALTER ROLE or ALTER DATABASE ... SET session_replication_role): the shop's \
     triggers (its rules, audits, foreign keys) would not fire for the worker's writes, and \
     the worker may not set it back; RESET it";

/// Runs [`KEEP_SESSION`] on a new session, and makes sure the shop's triggers fire for its
/// writes: a `session_replication_role` of `replica` (or `local`) set for the role or the
/// database turns off every ordinary trigger, so the shop's rules would be passed by
/// without a word (found from outside: orders a trigger refused were cancelled, an audit
/// trigger recorded none, health green). Set back to `origin` when the role may (a
/// superuser, or one granted `SET` on it); otherwise `Ok(Some(why))`: the session must not
/// be used, and the jobs wait, as on a read-only server.
pub fn keep_session(
    client: &mut postgres::Client,
) -> Result<Option<&'static str>, postgres::Error> {
    let rows = client.simple_query(KEEP_SESSION)?;
    let role = rows.iter().find_map(|m| match m {
        postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_string),
        _ => None,
    });
    if role.as_deref().is_none_or(|r| r == "origin") {
        return Ok(None);
    }
    match client.simple_query("SET session_replication_role = origin") {
        Ok(_) => Ok(None),
        Err(e) if e.code() == Some(&postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            Ok(Some(TRIGGERS_OFF))
        }
        Err(e) => Err(e),
    }
}

/// A `search_path` (`"$user", public`) with its `$user` settled as the start finds it: the
/// role's own schema (`user`, quoted) when it exists then, else left out; every other
/// entry as written. Kept as text, `$user` would take in a schema named after the
/// worker's role created later (or after a role a `SET role` takes), in the sessions
/// already open too (found from outside: a look-alike `orders` there made every job a
/// no-op, health green). Entries that do not resolve now (a schema not there yet, or one
/// the role may not use until a grant comes back) are kept: what the operator wrote.
pub fn settled_search_path(path: &str, user: &str, user_schema: bool) -> String {
    let mut entries = Vec::new();
    let mut entry = String::new();
    let mut quoted = false;
    for c in path.chars().chain(std::iter::once(',')) {
        match c {
            '"' => {
                quoted = !quoted;
                entry.push(c);
            }
            ',' if !quoted => {
                let e = entry.trim().to_string();
                entry.clear();
                match e.as_str() {
                    "" => {}
                    "$user" | "\"$user\"" => {
                        if user_schema {
                            entries.push(user.to_string());
                        }
                    }
                    _ => entries.push(e),
                }
            }
            c => entry.push(c),
        }
    }
    entries.join(", ")
}

/// The session option that keeps a session's `search_path` at `path` (what the start
/// saw: the role's and database's settings then, or the connection string's own), so that
/// a role's or database's `search_path` changed while the worker runs does not reach its
/// sessions: each table name of a job's transaction would be looked up anew in each new
/// session, and a look-alike table in front (found from outside: `ALTER ROLE ... SET
/// search_path = shadow, public` with a copy of `orders` in `shadow`) split the
/// transaction across schemas, the order cancelled in the copy and its stock and coupon
/// given back in `public`. Escaped for the startup packet (a space or a backslash).
pub fn search_path_option(path: &str) -> String {
    let escaped: String = path
        .chars()
        .flat_map(|c| match c {
            ' ' | '\\' | '\t' => vec!['\\', c],
            c => vec![c],
        })
        .collect();
    format!("-c search_path={escaped}")
}

/// What a connection to a server that takes no writes is told.
pub const READ_ONLY: &str =
    "the server is read-only (a standby, or default_transaction_read_only is on)";

/// How long a worker's session may stay idle inside a transaction before PostgreSQL ends
/// it. A worker never waits inside one (a transaction's statements follow each other at
/// once), so this only bounds how long a process paused mid-transaction (SIGSTOP, a VM
/// frozen, a debugger) holds the rows its set locked, which the shop's own transactions
/// wait on: the session ends, its transaction rolls back, and its jobs run again once the
/// worker is back, on a new connection.
pub const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(2);

/// The statement and lock timeouts of the workers' connections.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// `statement_timeout`: no handler statement runs longer.
    pub statement: Duration,
    /// `lock_timeout`: no statement waits longer for a row lock another transaction holds
    /// (a shop transaction). Short, so the worker yields to the shop instead of holding its
    /// own locks while it waits: the job goes back with backoff (see [`Fault::Contention`]).
    pub lock: Duration,
}

/// Builds the pool. `size` connections at most; the pool waits at most `checkout` for one.
/// Fails fast (one readable line) if the server cannot be reached at all.
/// With `group_commit`, the sessions commit without waiting for the WAL flush
/// (`synchronous_commit=off`); the workers then make their commits durable with one
/// [`flush_wal`] before each batch of acks.
pub fn pool(
    url: &str,
    size: u32,
    timeouts: Timeouts,
    checkout: Duration,
    group_commit: bool,
    search_path: Option<&str>,
) -> Result<Pool, DbError> {
    let mut target = Target::parse(url)?;
    if let Some(path) = search_path {
        target.keep_search_path(path);
    }
    let ms = timeouts.statement.as_millis();
    // Every handler statement runs under the statement and lock timeouts, and a
    // transaction left idle by a stopped process is ended by the server.
    let mut options = format!(
        "-c statement_timeout={ms} -c lock_timeout={} -c idle_in_transaction_session_timeout={} -c client_min_messages=warning",
        timeouts.lock.as_millis().clamp(1, ms.max(1)),
        IDLE_IN_TRANSACTION.as_millis()
    );
    if group_commit {
        options.push_str(" -c synchronous_commit=off");
    }
    target.add_options(&options);
    let shown = target.shown.clone();
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(checkout)
        // r2d2 logs every failed connect attempt itself; the worker logs outages once.
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .build(Manager { target })
        .map_err(|e| DbError::Unreachable {
            url: shown,
            reason: e.to_string(),
        })
}

/// Waits until every commit made so far on this server is durable: a transaction that
/// writes (one row of `worker_flush`, this worker's `slot`) and commits with
/// `synchronous_commit=on` waits for the WAL flush up to its own commit record, and the WAL
/// is one sequence, so every earlier commit of any session is flushed with it. (A commit
/// that wrote nothing, even with an xid, does not wait.) One round trip and at most one
/// fsync, whatever the number of asynchronous commits before it.
pub fn flush_wal(client: &mut postgres::Client, slot: &str) -> Result<(), postgres::Error> {
    // A literal, not a parameter, to keep it one round trip; the slot is our own name,
    // reduced to characters that need no escaping under any string setting.
    let slot: String = slot
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._/-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    client.batch_execute(&format!(
        "BEGIN; SET LOCAL synchronous_commit TO on; \
         INSERT INTO worker_flush (slot) VALUES ('{}') \
         ON CONFLICT (slot) DO UPDATE SET flushes = worker_flush.flushes + 1, flushed_at = now(); \
         COMMIT",
        slot
    ))
}

/// [`flush_wal`] without `worker_flush` (its grant lost in a migration, the table gone):
/// the same wait, made by a write the worker's own grants allow, one row of
/// `worker_inbox` updated to itself (`UPDATE (outcome)`, which a paid order's no-op needs
/// too) under `synchronous_commit=on`. A row another session holds is skipped, not waited
/// for. An empty inbox writes nothing and waits for nothing: it holds no commit of a job
/// either.
pub fn flush_wal_by_inbox(client: &mut postgres::Client) -> Result<(), postgres::Error> {
    client.batch_execute(
        "BEGIN; SET LOCAL synchronous_commit TO on; \
         UPDATE worker_inbox SET outcome = outcome WHERE ctid = \
         (SELECT ctid FROM worker_inbox LIMIT 1 FOR UPDATE SKIP LOCKED); \
         COMMIT",
    )
}

/// One plain connection (admin commands, migrations), within [`HANDSHAKE_DEADLINE`].
pub fn connect(url: &str) -> Result<postgres::Client, DbError> {
    Target::parse(url)?.connect_within(HANDSHAKE_DEADLINE)
}

/// One connection for the daemon's own short statements, within [`HANDSHAKE_DEADLINE`],
/// under its own `statement_timeout` and `lock_timeout` (both `timeout`) as session
/// options, so neither a role's or database's setting (`ALTER ROLE ... SET
/// statement_timeout = '1ms'`, which fails them on a busy server) nor the lack of one (a
/// lock held on the table forever) decides for them.
pub fn connect_bounded(url: &str, timeout: Duration) -> Result<postgres::Client, DbError> {
    let mut target = Target::parse(url)?;
    let ms = timeout.as_millis().max(1);
    target.add_options(&format!("-c statement_timeout={ms} -c lock_timeout={ms}"));
    target.connect_within(HANDSHAKE_DEADLINE)
}

/// The migrations, in the order they apply. Never edit an applied one: add a new file.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_shop_schema",
        include_str!("../sql/migrations/0001_shop_schema.sql"),
    ),
    (
        2,
        "0002_worker_inbox",
        include_str!("../sql/migrations/0002_worker_inbox.sql"),
    ),
    (
        3,
        "0003_payment_review",
        include_str!("../sql/migrations/0003_payment_review.sql"),
    ),
    (
        4,
        "0004_worker_flush",
        include_str!("../sql/migrations/0004_worker_flush.sql"),
    ),
    (
        5,
        "0005_inbox_job_id",
        include_str!("../sql/migrations/0005_inbox_job_id.sql"),
    ),
    (
        6,
        "0006_inbox_outcome",
        include_str!("../sql/migrations/0006_inbox_outcome.sql"),
    ),
];

/// Applies every migration not yet recorded in `worker_migrations`. Returns the names of
/// those applied now (empty when the schema is current).
pub fn migrate(client: &mut postgres::Client) -> Result<Vec<&'static str>, DbError> {
    // "already exists, skipping" notices are the normal case here, not news.
    client.batch_execute("SET client_min_messages = warning")?;
    // One migrator at a time (several hosts may start at once): concurrent
    // CREATE TABLE IF NOT EXISTS can still collide, so the lock covers everything.
    client.batch_execute("SELECT pg_advisory_lock(7300001)")?;
    let result = migrate_locked(client);
    let unlocked = client.batch_execute("SELECT pg_advisory_unlock(7300001)");
    let applied = result?;
    unlocked?;
    Ok(applied)
}

fn migrate_locked(client: &mut postgres::Client) -> Result<Vec<&'static str>, DbError> {
    client.batch_execute(
        "CREATE TABLE IF NOT EXISTS worker_migrations (
             version     integer PRIMARY KEY,
             name        text NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT now()
         )",
    )?;
    let mut applied = Vec::new();
    for &(version, name, sql) in MIGRATIONS {
        let mut tx = client.transaction()?;
        let done = tx
            .query_opt(
                "SELECT 1 FROM worker_migrations WHERE version = $1",
                &[&version],
            )?
            .is_some();
        if done {
            continue;
        }
        tx.batch_execute(sql)
            .map_err(|error| DbError::Migration { name, error })?;
        tx.execute(
            "INSERT INTO worker_migrations (version, name) VALUES ($1, $2)",
            &[&version, &name],
        )?;
        tx.commit()?;
        applied.push(name);
    }
    Ok(applied)
}

/// Whose fault a failed statement is: what becomes of the job follows from it, never from
/// where the failure showed. The table is docs/design.md's (Semantics, "Whose fault").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The connection or the server: lost, shutting down or starting, read-only (a standby,
    /// a demoted primary, `default_transaction_read_only`), out of connections or
    /// resources, a transaction left aborted, an outcome it could not report. The
    /// connection is thrown away; the job waits in its worker and runs again on a new
    /// one, no retry spent (a job that did commit finds its inbox row).
    Server,
    /// Other transactions: a lock or statement timeout, a deadlock, a serialization
    /// failure. The job goes back to the pool with backoff, for up to `--retry-for`.
    Contention,
    /// The schema or the privileges under the handler: a table, column or function that
    /// is missing (a deploy renaming it), a refused privilege, a handler's SQL that does
    /// not prepare. The job is held (back to the pool for a few seconds, no retry spent)
    /// and health is CRITICAL naming the error, until it works.
    Schema,
    /// The job itself: its data (a bad cast, a constraint it violates) or the handler's own
    /// refusal (`RAISE`). A dead letter at once.
    Job,
}

impl Fault {
    /// docs/design.md's word for it.
    pub fn describe(self) -> &'static str {
        match self {
            Fault::Server => "the server",
            Fault::Contention => "contention",
            Fault::Schema => "the schema",
            Fault::Job => "the job",
        }
    }
}

/// Classifies a failed statement, commit or connection (see [`Fault`]).
pub fn classify(e: &postgres::Error) -> Fault {
    if e.is_closed() {
        return Fault::Server;
    }
    match e.as_db_error() {
        Some(db) => classify_code(db.code().code(), db.message()),
        // No SQLSTATE: an I/O or protocol error on the connection.
        None => Fault::Server,
    }
}

/// [`classify`] by SQLSTATE, class by class (the first two characters), with the few codes
/// whose class does not say it. `message` only tells a hot standby's recovery conflict
/// from an ordinary serialization failure or deadlock: PostgreSQL gives both one code.
pub fn classify_code(code: &str, message: &str) -> Fault {
    match code {
        // Outcome unknown: rerun on a new connection, where the inbox tells.
        "40003" => return Fault::Server,
        "40001" | "40P01" if message.contains("conflict with recovery") => return Fault::Server,
        "40001" | "40P01" | "55P03" | "55006" | "57014" => return Fault::Contention,
        // A deferred constraint checked at commit: the job's data.
        "40002" => return Fault::Job,
        _ => {}
    }
    match code.get(..2).unwrap_or("") {
        // Connection exception; invalid transaction state (25006 read-only, 25P02 aborted,
        // 25P03 idle timeout); insufficient resources; operator intervention (shutdown,
        // crash, cannot connect now); system (I/O) error; the object not in a state to
        // serve (the database not accepting connections); internal error; a database or
        // prepared statement gone (a pooler reset the session); login refused (a password
        // changed); an FDW's remote server; a snapshot too old; config file error.
        "08" | "25" | "53" | "57" | "58" | "55" | "XX" | "3D" | "26" | "28" | "HV" | "72"
        | "F0" | "0B" | "2D" | "24" | "34" => Fault::Server,
        // Data exception, integrity constraint, cardinality, triggered data change, check
        // option, SQL routine, external routine, program limit (a payload too large for a
        // statement), PL/pgSQL (RAISE and its relatives).
        "22" | "23" | "21" | "27" | "44" | "2F" | "38" | "39" | "54" | "P0" => Fault::Job,
        // Syntax or access rule (undefined table, column, function; insufficient
        // privilege; a handler that does not parse), invalid schema name, feature not
        // supported (a cached plan that must change its result type), grantor and role
        // specifications, and any class not listed: the job waits and an operator is told,
        // rather than a dead letter for what may not be the job's fault.
        _ => Fault::Schema,
    }
}

/// A data exception (class `22`: a value that does not cast, an overflow, a division by
/// zero) raised by the statement itself, with no function or trigger in its context: the
/// statement a worker ran met the job's data, and no rule the shop adds (a trigger, a
/// function, a constraint: those carry a context or another class) is behind it. The one
/// context allowed is the JSON parser's own (`JSON data, line 1: ...`, English only): the
/// payload as the handler reads it (a `\u0000` PostgreSQL's text cannot hold, 22P05).
pub fn own_data(e: &postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        db.code().code().starts_with("22")
            && db
                .where_()
                .is_none_or(|w| w.starts_with("JSON data, line "))
    })
}

/// Whether the value a data exception's message quotes is the job's own: `reason` is
/// [`error_text`]'s `message (SQLSTATE)`, and the value between its first and last double
/// quote (`invalid input syntax for type bigint: "abc"`, `value "9e9" is out of range for
/// type integer`; a server whose `lc_messages` is German quotes `»abc«`, Spanish `«abc»`,
/// French `« abc »`) is one of `payload`'s values: one of its strings, whole; one of its
/// numbers, of exactly the same value (PostgreSQL prints `1e2` as `100`, `1e400` with
/// its 401 digits); or one of its objects or arrays, read as JSON and of the same values
/// (PostgreSQL prints a JSON value with its own spacing and key order). A message quoting
/// no value (`integer out of range`) says nothing against the job. A value the payload
/// does not hold (`invalid input value for enum reason: "timeout"`: the handler's own
/// constant, met by a CHECK constraint the shop added that casts, or a column whose type
/// a deploy changed) is not the job's data, and neither is a part of one of its strings
/// or a number merely near one of its numbers.
pub fn quotes_payload(reason: &str, payload: &serde_json::Value) -> bool {
    let Some(quoted) = quoted_value(reason) else {
        return true;
    };
    // French quotes with a space inside the guillemets (`« %s »`): the value is either.
    let unspaced = quoted
        .strip_prefix(' ')
        .and_then(|q| q.strip_suffix(' '))
        .filter(|_| reason.contains("« ") && reason.contains(" »"));
    std::iter::once(quoted)
        .chain(unspaced)
        .any(|q| payload_holds(payload, q))
}

/// A data exception the handler's own statement raised ([`own_data`]), not while
/// PostgreSQL read the payload as JSON, whose message quotes no value: `integer out of
/// range` (giving stock back to a row the shop keeps at the type's top), `division by
/// zero`, where `value "9e9" is out of range for type integer` quotes one. Nothing shows
/// that it met the job's data rather than the shop's stored rows.
pub fn stored_data(e: &postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        db.code().code().starts_with("22")
            && db.where_().is_none()
            && quoted_value(db.message()).is_none()
    })
}

/// The value a message quotes: between its first and last double quote (English and most
/// translations), else between PostgreSQL's German `»…«` or its Spanish and French
/// `«…»`. `None` when it quotes nothing.
fn quoted_value(reason: &str) -> Option<&str> {
    [('"', '"'), ('»', '«'), ('«', '»')]
        .into_iter()
        .find_map(|(open, close)| {
            let first = reason.find(open)?;
            let last = reason.rfind(close)?;
            let start = first + open.len_utf8();
            (last >= start).then(|| &reason[start..last])
        })
}

/// Whether `quoted` is one of `payload`'s values (see [`quotes_payload`]).
fn payload_holds(payload: &serde_json::Value, quoted: &str) -> bool {
    use serde_json::Value;
    let quoted_number = decimal(quoted.trim());
    let quoted_json = serde_json::from_str::<Value>(quoted).ok();
    fn holds(v: &Value, f: &mut dyn FnMut(&Value) -> bool) -> bool {
        f(v) || match v {
            Value::Array(a) => a.iter().any(|v| holds(v, f)),
            Value::Object(o) => o.values().any(|v| holds(v, f)),
            _ => false,
        }
    }
    holds(payload, &mut |v| match v {
        Value::String(s) => s == quoted,
        Value::Number(n) => quoted_number.is_some() && decimal(&n.to_string()) == quoted_number,
        Value::Array(_) | Value::Object(_) => quoted_json.as_ref().is_some_and(|q| same_json(v, q)),
        _ => false,
    })
}

/// Two JSON values alike, numbers compared by their exact value ([`decimal`]).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let x = decimal(&x.to_string());
            x.is_some() && x == decimal(&y.to_string())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// A decimal number's exact value as (negative, significant digits, exponent of the last
/// digit): `1.50`, `15e-1` and `0.150e1` alike; zero is `(false, "", 0)` whatever its
/// sign. `None` for anything else, or an exponent past `i64`.
fn decimal(text: &str) -> Option<(bool, String, i64)> {
    let (negative, rest) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole
            .bytes()
            .chain(fraction.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let digits = format!("{whole}{fraction}");
    let exponent = exponent.checked_sub(i64::try_from(fraction.len()).ok()?)?;
    let significant = digits.trim_start_matches('0');
    let kept = significant.trim_end_matches('0');
    if kept.is_empty() {
        return Some((false, String::new(), 0));
    }
    let zeros = i64::try_from(significant.len() - kept.len()).ok()?;
    Some((negative, kept.to_string(), exponent.checked_add(zeros)?))
}

/// The server's message with its SQLSTATE, or the client error.
pub fn error_text(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            if let Some(tls) = tls::describe(e, "sslrootcert") {
                return tls;
            }
            // "error connecting to server" alone does not say why: the cause (connection
            // refused, timed out, a TLS failure) is the error's source.
            let mut text = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                let c_text = c.to_string();
                if !text.contains(&c_text) {
                    text.push_str(": ");
                    text.push_str(&c_text);
                }
                cause = c.source();
            }
            // The `postgres` crate's words for a server the read-write check refused.
            if text.contains("database does not allow writes") {
                text.push_str(&format!(" ({READ_ONLY})"));
            }
            text
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{quotes_payload, search_path_option, settled_search_path, Target};

    /// A `search_path` with spaces and backslashes goes into the startup packet as one
    /// option: PostgreSQL splits the options at unescaped white space.
    /// `$user` is settled by whether the role's schema is there at the start; a comma
    /// inside a quoted name is the name's.
    #[test]
    fn a_search_path_s_user_is_settled_at_the_start() {
        assert_eq!(
            settled_search_path("\"$user\", public", "w", false),
            "public"
        );
        assert_eq!(
            settled_search_path("\"$user\", public", "w", true),
            "w, public"
        );
        assert_eq!(
            settled_search_path("$user,public", "\"W\"", true),
            "\"W\", public"
        );
        assert_eq!(
            settled_search_path("\"a,b\", shop , \"$user\"", "w", false),
            "\"a,b\", shop"
        );
        assert_eq!(settled_search_path("", "w", true), "");
    }

    #[test]
    fn a_search_path_is_one_session_option() {
        assert_eq!(
            search_path_option("\"$user\", public"),
            "-c search_path=\"$user\",\\ public"
        );
        assert_eq!(search_path_option("a\\b"), "-c search_path=a\\\\b");
    }
    use serde_json::json;

    /// The session options of a connection string are kept beside the worker's own, in
    /// both forms of the string (they were replaced: a shop's `search_path` was lost).
    #[test]
    fn a_connection_string_s_own_options_are_kept_beside_the_worker_s() {
        for url in [
            "postgres://u@127.0.0.1/shop?options=-c%20search_path%3Dshop",
            "host=127.0.0.1 user=u dbname=shop options='-c search_path=shop'",
        ] {
            let mut t = Target::parse(url).unwrap();
            t.add_options("-c lock_timeout=100");
            assert_eq!(
                t.config.get_options(),
                Some("-c search_path=shop -c lock_timeout=100"),
                "{url}"
            );
        }
        let mut t = Target::parse("postgres://u@127.0.0.1/shop").unwrap();
        t.add_options("-c lock_timeout=100");
        assert_eq!(t.config.get_options(), Some("-c lock_timeout=100"));
    }

    #[test]
    fn a_quoted_value_is_the_job_s_only_when_its_payload_holds_it() {
        let p = json!({"order_id": "abc", "note": "a \"b\" c", "tags": ["time out", "order_timeout_v2"]});
        let syntax = "invalid input syntax for type bigint: \"abc\" (22P02)";
        assert!(quotes_payload(syntax, &p));
        // The handler's constant: not a value of the payload, nor are parts of its
        // strings, nor its strings with their spaces taken out.
        let enum_ = "invalid input value for enum reason: \"timeout\" (22P02)";
        assert!(!quotes_payload(enum_, &p));
        assert!(!quotes_payload(enum_, &json!({"timeout": 900})));
        assert!(quotes_payload(enum_, &json!({"note": "timeout"})));
        // No value quoted: nothing against the job.
        assert!(quotes_payload("integer out of range (22003)", &p));
        // PostgreSQL's spacing and key order of a JSON value, numbers in it by value,
        // and a string's unescaped quotes.
        let object = json!({"order_id": {"b": [2, 3], "a": 1}});
        let msg = "invalid input syntax for type bigint: \"{\"a\": 1, \"b\": [2, 3]}\" (22P02)";
        assert!(quotes_payload(msg, &object));
        let array: serde_json::Value = serde_json::from_str(r#"{"order_id": [1e2]}"#).unwrap();
        assert!(quotes_payload(
            "invalid input syntax for type bigint: \"[100]\" (22P02)",
            &array
        ));
        assert!(quotes_payload(
            "invalid input syntax for type bigint: \"a \"b\" c\" (22P02)",
            &p
        ));
        assert!(quotes_payload(
            "invalid input syntax for type bigint: \" 12x \" (22P02)",
            &json!({"order_id": " 12x "})
        ));
        // Numbers by their exact value.
        let n = |text: &str| {
            serde_json::from_str::<serde_json::Value>(&format!("{{\"n\": {text}}}")).unwrap()
        };
        let range = |v: &str| format!("value \"{v}\" is out of range for type bigint (22003)");
        assert!(quotes_payload(
            "invalid input syntax for type bigint: \"1.50\" (22P02)",
            &n("1.5")
        ));
        assert!(quotes_payload(&range("100"), &n("1e2")));
        assert!(quotes_payload(
            &range(&format!("1{}", "0".repeat(400))),
            &n("1e400")
        ));
        assert!(quotes_payload(
            &range("6100000000000000000000"),
            &n("6.1e21")
        ));
        assert!(!quotes_payload(
            &range("6100000000000000000000"),
            &n("6100000000000000000001")
        ));
        assert!(!quotes_payload(
            &range("6600000000000000000000"),
            &n("6600000000000000000000.4")
        ));
        assert!(!quotes_payload(&range("7"), &n("8")));
        assert!(quotes_payload(&range("0"), &n("-0.0")));
        assert!(quotes_payload(&range("-12"), &n("-1.2e1")));
        assert!(!quotes_payload(&range("12"), &n("-12")));
    }

    #[test]
    fn a_translated_message_s_quoted_value_is_read_as_the_english_one() {
        // The messages as PostgreSQL 15's German, Spanish and French catalogues word them.
        let p = json!({"order_id": "abc", "n": 9000000000u64, "note": " 12x "});
        let own = [
            "ungültige Eingabesyntax für Typ bigint: »abc« (22P02)",
            "la sintaxis de entrada no es válida para tipo bigint: «abc» (22P02)",
            "syntaxe en entrée invalide pour le type bigint : « abc » (22P02)",
            "Wert »9000000000« ist außerhalb des gültigen Bereichs für Typ integer (22003)",
            "el valor «9000000000» está fuera de rango para el tipo integer (22003)",
            "la valeur « 9000000000 » est en dehors des limites pour le type integer (22003)",
            "syntaxe en entrée invalide pour le type bigint : «  12x  » (22P02)",
            "ungültige Eingabesyntax für Typ bigint: » 12x « (22P02)",
        ];
        for reason in own {
            assert!(quotes_payload(reason, &p), "{reason}");
        }
        let not_own = [
            "ungültiger Eingabewert für Enum reason: »timeout« (22P02)",
            "la sintaxis de entrada no es válida para el enum reason: «timeout» (22P02)",
            "valeur en entrée invalide pour le enum reason : « timeout » (22P02)",
            "valeur en entrée invalide pour le enum reason : « ab » (22P02)",
        ];
        for reason in not_own {
            assert!(!quotes_payload(reason, &p), "{reason}");
        }
        // Quoting nothing, in any language: nothing against the job.
        assert!(quotes_payload(
            "Integer außerhalb des gültigen Bereichs (22003)",
            &p
        ));
    }
}
