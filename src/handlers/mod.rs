//! Event handlers: what a job does in PostgreSQL.
//!
//! A handler runs inside the job's transaction (opened by `workers.rs`, which also records
//! the job in the inbox), under the connection's statement timeout. Most handlers are plain
//! SQL (see [`sql`]): a file per event, the payload bound as one `jsonb` parameter, the
//! required payload fields declared in its header. The built-in events (`order.timeout`,
//! `aftersale.timeout`, `coupon.expire`) are such files under `sql/handlers/`, compiled in;
//! an operator adds more with `--handlers-dir` and no Rust toolchain. A Rust handler
//! implements [`Handler`] for what SQL cannot say.
//!
//! Handlers are registered explicitly in a [`Registry`]; a message whose event has no
//! handler is dead-lettered. The daemon's registry sits in [`Handlers`], which SIGHUP
//! replaces with the `--handlers-dir` files read again (`daemon::reload`); each worker
//! sees the new one at its next batch and prepares it on a new session.

pub mod sql;

use postgres::types::Type;
use postgres::{Statement, Transaction};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// What a committed handler did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Changed something (an order cancelled, a coupon expired).
    Applied,
    /// Nothing to do: the order was paid, already cancelled, missing, ...
    NoOp,
}

pub trait Handler: Send + Sync {
    /// The `event` this handler serves.
    fn event(&self) -> &str;

    /// Where it comes from, for messages: its file for a `--handlers-dir` handler,
    /// `None` for a built-in one.
    fn source(&self) -> Option<&str> {
        None
    }

    /// Required payload fields: each group lists alternatives, one of which must be
    /// present (`[["order_id", "order_no"]]`). Checked before any database work; a miss
    /// is a permanent failure.
    fn required(&self) -> &[Vec<String>] {
        &[]
    }

    /// Whether the job needs a transaction at all. A handler that answers `false` is done
    /// without touching PostgreSQL (no inbox row either); only [`Noop`] does.
    fn needs_database(&self) -> bool {
        true
    }

    /// The SQL this handler runs with its parameter types, prepared once per connection;
    /// `handle` receives the statements in the same order.
    fn statements(&self) -> Vec<(String, Vec<Type>)>;

    /// The set form, if any: one statement that does the work of many jobs of this event
    /// at once, prepared once per connection with one `jsonb` parameter, an array of
    /// `{"i": <index>, "payload": <payload>}`. It returns a row per job that changed
    /// something, the job's index first (`integer`); the jobs it returns no row for did
    /// nothing. It takes every row lock in one global order, so concurrent sets never
    /// deadlock each other. Workers use it for jobs already waiting together (a backlog);
    /// a set that fails is run again job by job with [`Handler::handle`].
    fn set_statement(&self) -> Option<String> {
        None
    }

    /// Whether it has a set form ([`Handler::set_statement`]), asked without building it.
    fn has_set_form(&self) -> bool {
        self.set_statement().is_some()
    }

    /// Does the work inside `tx`. A transient database error (see `db::is_transient`)
    /// retries the job; any other error dead-letters it. The caller commits.
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        statements: &[Statement],
        payload: &Value,
    ) -> Result<Effect, postgres::Error>;
}

/// Acknowledges its event without any database work: the queue engine alone, for
/// benchmarks (`--noop-event`).
pub struct Noop(pub String);

impl Handler for Noop {
    fn event(&self) -> &str {
        &self.0
    }
    fn needs_database(&self) -> bool {
        false
    }
    fn statements(&self) -> Vec<(String, Vec<Type>)> {
        Vec::new()
    }
    fn handle(
        &self,
        _: &mut Transaction<'_>,
        _: &[Statement],
        _: &Value,
    ) -> Result<Effect, postgres::Error> {
        Ok(Effect::NoOp)
    }
}

/// The handlers of one daemon, by event. Read-only once built; shared by every worker.
#[derive(Default)]
pub struct Registry {
    /// Shared, so that a reload can keep a handler of the registry it replaces.
    handlers: Vec<Arc<dyn Handler>>,
    by_event: HashMap<String, usize>,
}

impl Registry {
    /// The built-in handlers.
    pub fn builtin() -> Registry {
        let mut r = Registry::default();
        for (name, text) in sql::BUILTIN {
            let h = sql::SqlHandler::parse(name, text).expect("built-in handler files are valid");
            r.register(Box::new(h));
        }
        r
    }

    /// Adds (or replaces) the handler of its event.
    pub fn register(&mut self, h: Box<dyn Handler>) {
        self.register_shared(Arc::from(h));
    }

    /// [`Registry::register`] of a handler another registry holds too.
    pub fn register_shared(&mut self, h: Arc<dyn Handler>) {
        let event = h.event().to_string();
        match self.by_event.get(&event) {
            Some(&i) => self.handlers[i] = h,
            None => {
                self.by_event.insert(event, self.handlers.len());
                self.handlers.push(h);
            }
        }
    }

    /// The handler of `event` and its index (the position of its statements in a
    /// session's cache).
    pub fn get(&self, event: &str) -> Option<(usize, &dyn Handler)> {
        self.by_event
            .get(event)
            .map(|&i| (i, self.handlers[i].as_ref()))
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn Handler> {
        self.handlers.iter().map(|h| h.as_ref())
    }

    /// Every handler, shared.
    pub fn shared(&self) -> impl Iterator<Item = Arc<dyn Handler>> + '_ {
        self.handlers.iter().cloned()
    }

    /// The handler of `event`, shared.
    pub fn shared_of(&self, event: &str) -> Option<Arc<dyn Handler>> {
        self.by_event.get(event).map(|&i| self.handlers[i].clone())
    }

    pub fn events(&self) -> Vec<&str> {
        self.handlers.iter().map(|h| h.event()).collect()
    }
}

/// The daemon's registry, replaceable while it runs (SIGHUP): every worker holds the one
/// of the generation it prepared, and takes the new one at its next batch.
pub struct Handlers {
    current: RwLock<Arc<Registry>>,
    /// Bumped by every [`Handlers::replace`].
    generation: AtomicU64,
}

impl Handlers {
    pub fn new(registry: Registry) -> Handlers {
        Handlers {
            current: RwLock::new(Arc::new(registry)),
            generation: AtomicU64::new(0),
        }
    }

    /// The registry now, and its generation.
    pub fn current(&self) -> (Arc<Registry>, u64) {
        let r = self.current.read().unwrap_or_else(|p| p.into_inner());
        (r.clone(), self.generation.load(Ordering::SeqCst))
    }

    /// The generation now: a worker whose registry is older takes [`Handlers::current`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    pub fn replace(&self, registry: Registry) {
        let mut r = self.current.write().unwrap_or_else(|p| p.into_inner());
        *r = Arc::new(registry);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}
