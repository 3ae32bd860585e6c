//! PostgreSQL: the connection pool, schema migrations, and how errors are classified.
//!
//! The pool (r2d2) holds one connection per worker thread; each connection carries the
//! statement timeout from the config (set once at connect, not per job). Migrations are
//! embedded in the binary and applied in order, each in its own transaction, under an
//! advisory lock so several hosts starting at once apply each exactly once.

use postgres::error::SqlState;
use postgres::NoTls;
use r2d2_postgres::PostgresConnectionManager;
use std::time::Duration;

pub type Pool = r2d2::Pool<PostgresConnectionManager<NoTls>>;
pub type Conn = r2d2::PooledConnection<PostgresConnectionManager<NoTls>>;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("DATABASE_URL is not a valid PostgreSQL connection string: {0}")]
    BadUrl(postgres::Error),
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

/// Builds the pool. `size` connections at most; the pool waits at most `checkout` for one.
/// Fails fast (one readable line) if the server cannot be reached at all.
/// With `group_commit`, the sessions commit without waiting for the WAL flush
/// (`synchronous_commit=off`); the workers then make their commits durable with one
/// [`flush_wal`] before each batch of acks.
pub fn pool(
    url: &str,
    size: u32,
    statement_timeout: Duration,
    checkout: Duration,
    group_commit: bool,
) -> Result<Pool, DbError> {
    let mut cfg: postgres::Config = url.parse().map_err(DbError::BadUrl)?;
    let ms = statement_timeout.as_millis();
    // Every handler statement runs under the statement timeout, and a transaction left
    // idle by a stuck thread is ended by the server.
    let mut options = format!(
        "-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout={} -c client_min_messages=warning",
        ms * 4
    );
    if group_commit {
        options.push_str(" -c synchronous_commit=off");
    }
    cfg.options(&options);
    cfg.connect_timeout(Duration::from_secs(3));
    cfg.application_name("delay-worker");
    let manager = PostgresConnectionManager::new(cfg, NoTls);
    r2d2::Pool::builder()
        .max_size(size)
        .min_idle(Some(0))
        .connection_timeout(checkout)
        // r2d2 logs every failed connect attempt itself; the worker logs outages once.
        .error_handler(Box::new(r2d2::NopErrorHandler))
        .build(manager)
        .map_err(|e| DbError::Unreachable {
            url: crate::config::redact_url(url),
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

/// One plain connection (admin commands, migrations).
pub fn connect(url: &str) -> Result<postgres::Client, DbError> {
    let mut cfg: postgres::Config = url.parse().map_err(DbError::BadUrl)?;
    cfg.connect_timeout(Duration::from_secs(3));
    cfg.application_name("delay-worker");
    cfg.connect(NoTls).map_err(|e| DbError::Unreachable {
        url: crate::config::redact_url(url),
        reason: error_text(&e),
    })
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

/// Whether the failure is the database's, not the job's: the connection was lost, the
/// server is shutting down or restarting, or it is out of connections or resources. The
/// job is not at fault and is run again on a new connection without spending a retry.
pub fn is_connection_error(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    let Some(code) = e.code() else {
        // No SQLSTATE: an I/O or protocol error on the connection.
        return true;
    };
    let c = code.code();
    c.starts_with("08") // connection exception
        || c.starts_with("53") // insufficient resources (too many connections, ...)
        || c.starts_with("57P") // admin / crash shutdown, cannot connect now
}

/// Whether a failed job may succeed if tried again later: the connection errors above,
/// and deadlocks, serialization failures, lock and statement timeouts. Everything else
/// (bad SQL, constraint violations, bad input) is permanent.
pub fn is_transient(e: &postgres::Error) -> bool {
    let Some(code) = e.code() else {
        return true;
    };
    is_connection_error(e)
        || *code == SqlState::T_R_SERIALIZATION_FAILURE
        || *code == SqlState::T_R_DEADLOCK_DETECTED
        || *code == SqlState::LOCK_NOT_AVAILABLE
        || *code == SqlState::QUERY_CANCELED
}

/// The server's message with its SQLSTATE, or the client error.
pub fn error_text(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
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
            text
        }
    }
}
