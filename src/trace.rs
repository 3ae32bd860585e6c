//! `worker trace`: where the jobs of one job key are now and what became of them, from
//! the places a job passes through, each read by its key or its id, never by scanning a
//! stream: the delay pool (scheduled, or waiting for a retry: `ZSCORE`, `HGET`), the
//! stream (moved: the entry the pool's `moved` index names; in flight: `XPENDING` of that
//! one entry), the dead letters (the ids the pool's `letters` index names) and
//! `worker_inbox` (done: its rows of that key, by the primary key). A key pushed again is
//! one job per push; each is listed, oldest first.
//!
//! With `--shards N` a key is looked for in its shard (`crc32(key) mod N`); if Redis holds
//! nothing of it there, in every other shard too (a producer with another N). In list mode
//! the queues, the processing lists and the dead lists have no index: at most
//! [`LIST_LOOK`] messages at each end of a list are looked at, and the trace says so when a
//! list is longer.
//!
//! `--order SO123` traces the keys `<event>:SO123` of the built-in events that act on an
//! order ([`ORDER_EVENTS`], payload `order_no` or `order_id`), the key `worker push` and the
//! producers of docs/producers.md give them; in list mode it also matches messages whose
//! payload names the order (a raw queue's messages have no key).
//!
//! This module gathers ([`gather`]); `admin/trace.rs` prints and the status page shows.

use crate::config::{Config, Source};
use crate::keys::Keys;
use crate::store::value_to_string;
use redis::{ConnectionLike, RedisResult, Value};
use serde::Serialize;
use serde_json::Value as Json;

/// The built-in events whose payload names an order (`order_no` or `order_id`).
pub const ORDER_EVENTS: &[&str] = &["order.timeout", "payment.paid"];
/// List mode: messages looked at, at most, at each end of a queue, processing list or
/// dead list.
pub const LIST_LOOK: usize = 1_000;
/// Inbox rows read per key, the newest.
pub const INBOX_ROWS: i64 = 50;

/// What to trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Query {
    /// The job key given, or `None` for `--order`.
    pub key: Option<String>,
    /// `--order`: the order number or id.
    pub order: Option<String>,
    /// `--event`: only jobs of this event (with `--order`: only its key).
    pub event: Option<String>,
}

impl Query {
    pub fn key(key: &str, event: Option<&str>) -> Query {
        Query {
            key: Some(key.to_string()),
            order: None,
            event: event.map(str::to_string),
        }
    }

    pub fn order(order: &str, event: Option<&str>) -> Query {
        Query {
            key: None,
            order: Some(order.to_string()),
            event: event.map(str::to_string),
        }
    }

    /// The job keys looked up.
    pub fn keys(&self) -> Vec<String> {
        match (&self.key, &self.order) {
            (Some(k), _) => vec![k.clone()],
            (None, Some(o)) => match &self.event {
                Some(e) => vec![format!("{e}:{o}")],
                None => ORDER_EVENTS.iter().map(|e| format!("{e}:{o}")).collect(),
            },
            (None, None) => Vec::new(),
        }
    }

    /// Why the query cannot be asked, in words (bad input).
    pub fn problem(&self) -> Option<&'static str> {
        match (&self.key, &self.order) {
            (Some(_), Some(_)) => Some("give a job key or --order, not both"),
            (None, None) => Some("give a job key, or --order with an order number"),
            (Some(k), None) if k.is_empty() => Some("the job key is empty"),
            (None, Some(o)) if o.is_empty() => Some("--order is empty"),
            _ => None,
        }
    }

    /// Whether a payload names the order asked for.
    fn names_order(&self, payload: &Json) -> bool {
        let Some(order) = &self.order else {
            return false;
        };
        ["order_no", "order_id"]
            .iter()
            .any(|f| match payload.get(f) {
                Some(Json::String(s)) => s == order,
                Some(Json::Number(n)) => n.to_string() == *order,
                _ => false,
            })
    }
}

/// The story of the jobs of a key (or an order).
#[derive(Debug, Clone, Serialize)]
pub struct Trace {
    pub query: Query,
    /// Redis's clock (unix ms), which every due time and age is on.
    pub now_ms: i64,
    /// Each job found, oldest first; empty when there is no trace at all (gone).
    pub jobs: Vec<Job>,
    /// What could not be looked at, or only in part (a list longer than the look, the
    /// inbox not reachable).
    pub notes: Vec<String>,
    /// The oldest inbox row's time (unix ms): a job done before it has had its row pruned.
    pub inbox_since_ms: Option<i64>,
    /// Why the inbox could not be read, if it could not: done jobs are then missing.
    pub inbox_error: Option<String>,
    /// A key traced has had more dead letters than its index keeps: older ones may be in
    /// the dead letters, not shown, so no job found is not no trace.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub older_letters: bool,
}

impl Trace {
    /// No job anywhere: never pushed (or cancelled), or done so long ago that its inbox
    /// row was pruned.
    pub fn gone(&self) -> bool {
        self.jobs.is_empty() && !self.older_letters
    }

    /// Why there is nothing, in words.
    pub fn gone_why(&self) -> String {
        let since = match self.inbox_since_ms {
            Some(ms) => format!(
                "done before {} (the oldest inbox row; older rows are pruned after --inbox-retention)",
                crate::text::fmt_time(ms)
            ),
            None => "done before the inbox's retention (the inbox is empty)".to_string(),
        };
        format!(
            "no trace: not in the delay pool, the stream, the dead letters or the inbox: never pushed, cancelled, or {since}"
        )
    }
}

/// One job: one push of its key (a retry, a redelivery, a requeue are the same job).
#[derive(Debug, Clone, Serialize)]
pub struct Job {
    pub key: String,
    /// The shard it was found in, with `--shards N`.
    pub shard: Option<usize>,
    pub event: Option<String>,
    /// Its identity (`<due µs>-<a>-<b>`), as the mover stamps it; `None` where nothing
    /// tells it (a legacy pool's member before its move, an unstamped message).
    pub job_id: Option<String>,
    /// When it was (first) due, unix ms on Redis's clock.
    pub due_ms: Option<i64>,
    #[serde(flatten)]
    pub state: State,
    /// Anything else worth knowing (an ack still under way, data not arrived yet).
    pub notes: Vec<String>,
}

/// Where a job is, or how it ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum State {
    /// In the delay pool, due at the job's `due_ms`.
    Scheduled { pool: String },
    /// Back in the delay pool after a failure, to run again at `next_ms`.
    Retrying {
        pool: String,
        /// Its `retry`: the retries it has had.
        attempt: u64,
        last_error: Option<String>,
        next_ms: i64,
    },
    /// In the stream, not delivered to a consumer yet.
    Moved {
        stream: String,
        entry: String,
        moved_ms: i64,
    },
    /// Delivered and not acknowledged yet.
    InFlight {
        stream: String,
        entry: String,
        moved_ms: i64,
        consumer: String,
        /// Whether the consumer's heartbeat is there (a dead one's entries are taken over).
        alive: bool,
        idle_ms: i64,
        deliveries: u64,
    },
    /// List mode: on its queue, waiting to be fetched (`position` 0 is fetched next).
    Queued { queue: String, position: usize },
    /// List mode: fetched, in a consumer's processing list.
    Processing {
        queue: String,
        consumer: String,
        alive: bool,
    },
    /// Its transaction committed (its inbox row).
    Done {
        processed_ms: i64,
        late_ms: Option<i64>,
        /// `done` or `noop`; `None` for a row an older worker wrote.
        outcome: Option<String>,
        consumer: Option<String>,
    },
    /// A dead letter.
    Dead {
        dead: String,
        id: String,
        reason: String,
        attempts: Option<u64>,
        died_ms: i64,
        consumer: Option<String>,
    },
}

impl State {
    /// The state's name, as `--json` writes it.
    pub fn name(&self) -> &'static str {
        match self {
            State::Scheduled { .. } => "scheduled",
            State::Retrying { .. } => "retrying",
            State::Moved { .. } => "moved",
            State::InFlight { .. } => "in_flight",
            State::Queued { .. } => "queued",
            State::Processing { .. } => "processing",
            State::Done { .. } => "done",
            State::Dead { .. } => "dead",
        }
    }
}

impl Job {
    /// When it was first due, for the order of the jobs (oldest first): the due time its
    /// identity stamps (kept through retries and a requeue), else the due time known, else
    /// when it got where it is. Found from outside: ordered by when each got where it is, a
    /// requeued older job was listed after the newer push of its key that had run.
    fn first_due_ms(&self) -> i64 {
        self.job_id
            .as_deref()
            .and_then(|id| id.split('-').next()?.parse::<i64>().ok())
            .map(|us| us / 1000)
            .or(self.due_ms)
            .unwrap_or_else(|| self.at_ms())
    }

    /// When it got where it is.
    fn at_ms(&self) -> i64 {
        match &self.state {
            State::Done { processed_ms, .. } => *processed_ms,
            State::Dead { died_ms, .. } => *died_ms,
            State::Moved { moved_ms, .. } | State::InFlight { moved_ms, .. } => *moved_ms,
            State::Retrying { next_ms, .. } => *next_ms,
            _ => self.due_ms.unwrap_or(i64::MAX),
        }
    }
}

/// A failure to read: Redis (or PostgreSQL for the inbox) refused or was lost.
pub type Result<T> = anyhow::Result<T>;

/// Gathers the trace of `q` at `now_ms` (Redis's clock). `db` reads the inbox; without
/// one (or when its query fails) the trace says so in a note and shows Redis's part.
pub fn gather(
    con: &mut dyn ConnectionLike,
    db: Option<&mut postgres::Client>,
    config: &Config,
    q: &Query,
    now_ms: i64,
) -> Result<Trace> {
    let mut t = Trace {
        query: q.clone(),
        now_ms,
        jobs: Vec::new(),
        notes: Vec::new(),
        inbox_since_ms: None,
        inbox_error: None,
        older_letters: false,
    };
    let keys = q.keys();
    let shards = config.shard_keys();
    for key in &keys {
        let home = crate::keys::shard_of(key.as_bytes(), config.shards);
        let mut found = redis_part(con, config, &shards[home], home, key, &mut t)?;
        if found == 0 && shards.len() > 1 {
            for (i, k) in shards.iter().enumerate().filter(|(i, _)| *i != home) {
                found += redis_part(con, config, k, i, key, &mut t)?;
            }
            if found > 0 {
                t.notes.push(format!(
                    "{key} belongs to shard {home} (crc32 mod {}) but was found in another: its producer uses another --shards",
                    shards.len()
                ));
            }
        }
    }
    if config.source == Source::List {
        list_part(con, config, &keys, q, &mut t)?;
    }
    t.inbox_error = match db {
        Some(db) => inbox_part(db, &keys, &mut t)
            .err()
            .map(|e| crate::text::one_line(&e)),
        None => Some("no connection to PostgreSQL".into()),
    };
    if let Some(e) = &q.event {
        t.jobs
            .retain(|j| j.event.as_deref().is_none_or(|je| je == e));
    }
    merge(&mut t.jobs);
    if config.shards <= 1 {
        for j in &mut t.jobs {
            j.shard = None;
        }
    }
    t.jobs.sort_by_key(|j| (j.first_due_ms(), j.at_ms()));
    Ok(t)
}

/// One job seen in more than one place: a job that committed while its entry is still
/// pending (its ack on its way) is done; one whose inbox row exists and that waits or runs
/// again (a commit whose durability could not be confirmed, a requeued letter of a job
/// that did commit) will change nothing.
fn merge(jobs: &mut Vec<Job>) {
    let done: Vec<(String, String, i64)> = jobs
        .iter()
        .filter_map(|j| match (&j.state, &j.job_id) {
            (State::Done { processed_ms, .. }, Some(id)) => {
                Some((j.key.clone(), id.clone(), *processed_ms))
            }
            _ => None,
        })
        .collect();
    let mut notes: Vec<(String, String, String)> = Vec::new();
    jobs.retain_mut(|j| {
        let Some(id) = j.job_id.clone() else {
            return true;
        };
        let Some((_, _, at)) = done
            .iter()
            .find(|(k, d, _)| *k == j.key && *d == id && !matches!(j.state, State::Done { .. }))
        else {
            return true;
        };
        match &j.state {
            State::InFlight {
                entry, consumer, ..
            } => {
                notes.push((
                    j.key.clone(),
                    id,
                    format!("committed; its entry {entry} is still pending on {consumer} (the ack is on its way)"),
                ));
                false
            }
            State::Processing { consumer, .. } => {
                notes.push((
                    j.key.clone(),
                    id,
                    format!("committed; still in {consumer}'s processing list (the settle is on its way)"),
                ));
                false
            }
            _ => {
                j.notes.push(format!(
                    "already done at {} (its inbox row): running it again changes nothing",
                    crate::text::fmt_time(*at)
                ));
                true
            }
        }
    });
    for (key, id, note) in notes {
        if let Some(j) = jobs.iter_mut().find(|j| {
            j.key == key
                && j.job_id.as_deref() == Some(&id)
                && matches!(j.state, State::Done { .. })
        }) {
            j.notes.push(note);
        }
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        Value::Nil => None,
        other => Some(value_to_string(other).into_bytes()),
    }
}

fn get(con: &mut dyn ConnectionLike, cmd: &str, key: &str, field: &str) -> RedisResult<Value> {
    redis::cmd(cmd).arg(key).arg(field).query(con)
}

/// A stream entry's (or dead letter's) fields, as written.
type Fields = Vec<(String, Vec<u8>)>;

fn fields(v: &Value) -> Fields {
    match v {
        Value::Array(kv) => kv
            .chunks_exact(2)
            .map(|c| (value_to_string(&c[0]), bytes(&c[1]).unwrap_or_default()))
            .collect(),
        Value::Map(kv) => kv
            .iter()
            .map(|(k, v)| (value_to_string(k), bytes(v).unwrap_or_default()))
            .collect(),
        _ => Vec::new(),
    }
}

fn field<'a>(f: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a [u8]> {
    f.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The one entry `id` of `stream`, its fields; `None` when it is gone.
fn entry(con: &mut dyn ConnectionLike, stream: &str, id: &str) -> RedisResult<Option<Fields>> {
    let v: Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg(id)
        .arg(id)
        .query(con)?;
    let Value::Array(items) = v else {
        return Ok(None);
    };
    Ok(items.first().and_then(|e| match e {
        Value::Array(pair) if pair.len() == 2 => Some(fields(&pair[1])),
        _ => None,
    }))
}

/// Redis's part of a key in one key set (shard `shard`): its pool, its moved entry, its
/// dead letters. Returns how many jobs it found.
fn redis_part(
    con: &mut dyn ConnectionLike,
    config: &Config,
    k: &Keys,
    shard: usize,
    key: &str,
    t: &mut Trace,
) -> Result<usize> {
    let before = t.jobs.len();
    let job = |event: Option<String>, job_id: Option<String>, due_ms, state, notes| Job {
        key: key.to_string(),
        shard: Some(shard),
        event,
        job_id,
        due_ms,
        state,
        notes,
    };
    // The delay pool.
    let score: Option<String> = redis::cmd("ZSCORE").arg(&k.pool).arg(key).query(con)?;
    if let Some(score) = score {
        let data = bytes(&get(con, "HGET", &k.data, key)?);
        let record = bytes(&get(con, "HGET", &k.jobs, key)?);
        let due = score_ms(&score);
        let pushed = match &data {
            None => job(
                None,
                None,
                Some(due),
                State::Scheduled {
                    pool: k.pool.clone(),
                },
                vec![format!(
                    "its data ({} {key}) has not arrived: after --orphan-grace past its due time it becomes a dead letter",
                    k.data
                )],
            ),
            Some(msg) => {
                let env: Json = serde_json::from_slice(msg).unwrap_or(Json::Null);
                let job_id = retry_id(record.as_deref(), msg)
                    .unwrap_or_else(|| Some(identity(&k.pool, key, &score, msg, due)));
                let retry = env.get("retry").and_then(Json::as_u64).unwrap_or(0);
                let last_error = env
                    .get(crate::message::LAST_ERROR)
                    .and_then(Json::as_str)
                    .map(str::to_string);
                let state = if retry > 0 || last_error.is_some() {
                    State::Retrying {
                        pool: k.pool.clone(),
                        attempt: retry,
                        last_error,
                        next_ms: due,
                    }
                } else {
                    State::Scheduled {
                        pool: k.pool.clone(),
                    }
                };
                let first_due = env.get(crate::message::FIRST_DUE).and_then(Json::as_i64);
                let event = env.get("event").and_then(Json::as_str).map(str::to_string);
                let mut notes = match env.get(crate::message::HELD_AT).and_then(Json::as_i64) {
                    Some(at) => vec![format!(
                        "held since {} for the surroundings' fault: PostgreSQL refused it, and when it was held no job of {} had changed anything since (as the process that held it saw); a dead letter only once one does after it fails, or after --retry-for",
                        crate::text::fmt_time(at),
                        event.as_deref().unwrap_or("its event")
                    )],
                    None => Vec::new(),
                };
                // A retry record of the key that does not match this data: a push replaced
                // a waiting retry, which the mover reports when it moves this push (found
                // from outside: until then the trace showed only the new job).
                if let Some(replaced) = replaced_retry(record.as_deref(), msg) {
                    notes.push(format!(
                        "this push replaced a retry of job {replaced} waiting in the pool: that retry becomes a dead letter, with its message, when this push is moved (a cancel of the key ends both)"
                    ));
                }
                // A job scheduled again after it first fell due (a requeued letter) runs
                // at its score: that is its due time here, the first one a note (found
                // from outside: a letter requeued 6 minutes after it died showed as
                // "overdue 6m" while due now).
                let due_ms = match (&state, first_due) {
                    (State::Scheduled { .. }, Some(first)) if first < due => {
                        notes.push(format!(
                            "first due {}; scheduled again (a requeue) for {}",
                            crate::text::fmt_time(first),
                            crate::text::fmt_time(due)
                        ));
                        due
                    }
                    _ => first_due.unwrap_or(due),
                };
                job(event, job_id, Some(due_ms), state, notes)
            }
        };
        t.jobs.push(pushed);
    }
    // Legacy pools: their members are job keys too (one set of keys: the first shard's).
    if shard == 0 {
        for l in &config.mover.legacy {
            let score: Option<String> = redis::cmd("ZSCORE").arg(&l.key).arg(key).query(con)?;
            if let Some(score) = score {
                t.jobs.push(job(
                    Some(l.event.clone()),
                    None,
                    Some(score_ms(&score)),
                    State::Scheduled {
                        pool: l.key.clone(),
                    },
                    Vec::new(),
                ));
            }
        }
    }
    // The stream entry of its latest move.
    if config.source == Source::Stream {
        if let Some(id) = bytes(&get(con, "HGET", &k.moved, key)?) {
            let id = text(&id);
            match entry(con, &k.stream, &id)? {
                Some(f) if field(&f, "key").is_none_or(|fk| fk == key.as_bytes()) => {
                    let msg = field(&f, "msg").unwrap_or_default();
                    let env: Json = serde_json::from_slice(msg).unwrap_or(Json::Null);
                    let event = env.get("event").and_then(Json::as_str).map(str::to_string);
                    let job_id = crate::message::stamp_of(msg);
                    let due = field(&f, "due")
                        .and_then(|d| text(d).parse::<i64>().ok())
                        .or_else(|| job_id.as_deref().and_then(stamp_due_ms));
                    let due = env
                        .get(crate::message::FIRST_DUE)
                        .and_then(Json::as_i64)
                        .or(due);
                    let moved_ms = crate::store::stream::id_ms(&id).unwrap_or(0);
                    let state = in_flight(con, k, &id, moved_ms)?;
                    t.jobs.push(job(event, job_id, due, state, Vec::new()));
                }
                _ => t.notes.push(format!(
                    "{key}'s last stream entry {id} ({}) is no longer there (trimmed or deleted)",
                    k.stream
                )),
            }
        }
    }
    // Its dead letters: those the index names (its newest); older ones are only counted as
    // there, by the index's own mark.
    if bytes(&get(con, "HGET", &k.letters, &format!("older\n{key}"))?).is_some() {
        t.older_letters = true;
        t.notes.push(format!(
            "{key} has had more dead letters than its index keeps (the 8 newest): older ones may be in the dead letters ({}) and are not shown; `worker dead list` lists every letter",
            k.dead
        ));
    }
    if let Some(ids) = bytes(&get(con, "HGET", &k.letters, key)?) {
        for id in text(&ids).split_whitespace() {
            let Some(f) = entry(con, &k.dead, id)? else {
                continue;
            };
            if field(&f, "key").is_some_and(|fk| fk != key.as_bytes()) {
                continue;
            }
            let msg = field(&f, "msg").unwrap_or_default();
            let env: Json = serde_json::from_slice(msg).unwrap_or(Json::Null);
            let event = field(&f, "event")
                .map(text)
                .filter(|e| !e.is_empty())
                .or_else(|| env.get("event").and_then(Json::as_str).map(str::to_string));
            let job_id = crate::message::stamp_of(msg);
            let due = env
                .get(crate::message::FIRST_DUE)
                .and_then(Json::as_i64)
                .or_else(|| job_id.as_deref().and_then(stamp_due_ms));
            let state = State::Dead {
                dead: k.dead.clone(),
                id: if config.shards > 1 {
                    format!("{shard}/{id}")
                } else {
                    id.to_string()
                },
                reason: field(&f, "reason").map(text).unwrap_or_default(),
                attempts: field(&f, "attempts").and_then(|a| text(a).parse().ok()),
                died_ms: crate::store::stream::id_ms(id).unwrap_or(0),
                consumer: field(&f, "consumer").map(text).filter(|c| !c.is_empty()),
            };
            t.jobs.push(job(event, job_id, due, state, Vec::new()));
        }
    }
    Ok(t.jobs.len() - before)
}

/// The state of a moved entry: in flight (its pending record: consumer, idle time,
/// deliveries) or not delivered yet.
fn in_flight(con: &mut dyn ConnectionLike, k: &Keys, id: &str, moved_ms: i64) -> Result<State> {
    let p: Value = redis::cmd("XPENDING")
        .arg(&k.stream)
        .arg(&k.group)
        .arg(id)
        .arg(id)
        .arg(1)
        .query(con)
        .or_else(|e| {
            // No group yet: nothing was ever read.
            if e.code() == Some("NOGROUP") {
                Ok(Value::Array(Vec::new()))
            } else {
                Err(e)
            }
        })?;
    let first = match &p {
        Value::Array(rows) => rows.first().cloned(),
        _ => None,
    };
    let Some(Value::Array(row)) = first else {
        return Ok(State::Moved {
            stream: k.stream.clone(),
            entry: id.to_string(),
            moved_ms,
        });
    };
    let consumer = row.get(1).map(value_to_string).unwrap_or_default();
    let num = |i: usize| match row.get(i) {
        Some(Value::Int(n)) => *n,
        Some(v) => value_to_string(v).parse().unwrap_or(0),
        None => 0,
    };
    let alive: bool = redis::cmd("EXISTS")
        .arg(k.heartbeat(&consumer))
        .query(con)?;
    Ok(State::InFlight {
        stream: k.stream.clone(),
        entry: id.to_string(),
        moved_ms,
        consumer,
        alive,
        idle_ms: num(2),
        deliveries: num(3).max(0) as u64,
    })
}

/// List mode: the queues, the processing lists of every consumer that has one, the dead
/// lists; at most [`LIST_LOOK`] messages at each end of each list.
fn list_part(
    con: &mut dyn ConnectionLike,
    config: &Config,
    keys: &[String],
    q: &Query,
    t: &mut Trace,
) -> Result<()> {
    let k = &config.keys;
    let matches = |msg: &Json| {
        msg.get("job_key")
            .and_then(Json::as_str)
            .is_some_and(|jk| keys.iter().any(|k| k == jk))
            || q.names_order(msg.get("payload").unwrap_or(&Json::Null))
    };
    let consumers: Vec<String> = redis::cmd("SMEMBERS").arg(&k.list_consumers).query(con)?;
    for queue in &k.queues {
        let raw = queue.raw_event.as_deref();
        // A raw queue's message is the payload itself.
        let found = |m: &Json| match raw {
            Some(_) => q.names_order(m),
            None => matches(m),
        };
        let event_of = |m: &Json| match raw {
            Some(e) => Some(e.to_string()),
            None => m.get("event").and_then(Json::as_str).map(str::to_string),
        };
        let key_of = |m: &Json| {
            m.get("job_key")
                .and_then(Json::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| keys.first().cloned().unwrap_or_default())
        };
        // The queue: position 0 is its tail, fetched next.
        for (pos, msg) in look(con, &queue.name, true, &mut t.notes)? {
            let m: Json = serde_json::from_slice(&msg).unwrap_or(Json::Null);
            if found(&m) {
                let state = State::Queued {
                    queue: queue.name.clone(),
                    position: pos,
                };
                t.jobs.push(list_job(key_of(&m), event_of(&m), &msg, state));
            }
        }
        for c in &consumers {
            let list = queue.processing(c);
            let mut held = Vec::new();
            for (_, msg) in look(con, &list, false, &mut t.notes)? {
                let m: Json = serde_json::from_slice(&msg).unwrap_or(Json::Null);
                if found(&m) {
                    held.push((m, msg));
                }
            }
            if held.is_empty() {
                continue;
            }
            let alive: bool = redis::cmd("EXISTS").arg(k.heartbeat(c)).query(con)?;
            for (m, msg) in held {
                let state = State::Processing {
                    queue: queue.name.clone(),
                    consumer: c.clone(),
                    alive,
                };
                t.jobs.push(list_job(key_of(&m), event_of(&m), &msg, state));
            }
        }
        // The dead list, newest first.
        for (_, letter) in look(con, &queue.dead, false, &mut t.notes)? {
            let l: Json = serde_json::from_slice(&letter).unwrap_or(Json::Null);
            let msg = l.get("msg").and_then(Json::as_str).unwrap_or_default();
            let m: Json = serde_json::from_str(msg).unwrap_or(Json::Null);
            let lkey = l.get("key").and_then(Json::as_str).unwrap_or_default();
            let hit = keys.iter().any(|k| k == lkey)
                || match raw {
                    Some(_) => q.names_order(&m),
                    None => q.names_order(m.get("payload").unwrap_or(&Json::Null)),
                };
            if !hit {
                continue;
            }
            let id = sha1_smol::Sha1::from(&letter).digest().to_string()[..16].to_string();
            let job_id = crate::message::stamp_of(msg.as_bytes());
            t.jobs.push(Job {
                key: if lkey.is_empty() {
                    key_of(&m)
                } else {
                    lkey.to_string()
                },
                shard: None,
                event: l
                    .get("event")
                    .and_then(Json::as_str)
                    .filter(|e| !e.is_empty())
                    .map(str::to_string)
                    .or_else(|| event_of(&m)),
                due_ms: job_id.as_deref().and_then(stamp_due_ms),
                job_id,
                state: State::Dead {
                    dead: queue.dead.clone(),
                    id,
                    reason: l
                        .get("reason")
                        .and_then(Json::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    attempts: l.get("attempts").and_then(Json::as_u64),
                    died_ms: l.get("ts").and_then(Json::as_i64).unwrap_or(0) * 1000,
                    consumer: l.get("consumer").and_then(Json::as_str).map(str::to_string),
                },
                notes: Vec::new(),
            });
        }
    }
    Ok(())
}

/// The messages of a list with their position (from the tail when `from_tail`, else from
/// the head), at most [`LIST_LOOK`] at each end; a note when the list is longer.
fn look(
    con: &mut dyn ConnectionLike,
    list: &str,
    from_tail: bool,
    notes: &mut Vec<String>,
) -> Result<Vec<(usize, Vec<u8>)>> {
    let len: usize = match redis::cmd("LLEN").arg(list).query(con) {
        Ok(n) => n,
        Err(e) if e.code() == Some("WRONGTYPE") => {
            notes.push(format!(
                "{list} holds another type than a list: not looked at"
            ));
            return Ok(Vec::new());
        }
        Err(e) => return Err(e.into()),
    };
    if len == 0 {
        return Ok(Vec::new());
    }
    let range = |con: &mut dyn ConnectionLike, a: isize, b: isize| -> RedisResult<Vec<Vec<u8>>> {
        redis::cmd("LRANGE").arg(list).arg(a).arg(b).query(con)
    };
    // Head index i is position len-1-i from the tail.
    let mut out: Vec<(usize, Vec<u8>)> = Vec::new();
    let head_pos = |i: usize| if from_tail { len - 1 - i } else { i };
    if len <= 2 * LIST_LOOK {
        for (i, m) in range(con, 0, -1)?.into_iter().enumerate() {
            out.push((head_pos(i), m));
        }
    } else {
        for (i, m) in range(con, 0, LIST_LOOK as isize - 1)?
            .into_iter()
            .enumerate()
        {
            out.push((head_pos(i), m));
        }
        let first = len - LIST_LOOK;
        for (i, m) in range(con, -(LIST_LOOK as isize), -1)?
            .into_iter()
            .enumerate()
        {
            out.push((head_pos(first + i), m));
        }
        notes.push(format!(
            "{list} holds {len} messages: only the {LIST_LOOK} at each end were looked at"
        ));
    }
    Ok(out)
}

/// The inbox rows of the keys: one done job each.
fn inbox_part(db: &mut postgres::Client, keys: &[String], t: &mut Trace) -> Result<()> {
    let rows = db.query(
        "SELECT job_key, job_id, event, (extract(epoch FROM processed_at) * 1000)::bigint,
                outcome, late_ms, consumer
           FROM worker_inbox WHERE job_key = ANY($1)
          ORDER BY processed_at DESC LIMIT $2",
        &[&keys, &INBOX_ROWS],
    )?;
    for r in rows {
        let job_id: String = r.get(1);
        let job_id = Some(job_id).filter(|j| !j.is_empty());
        t.jobs.push(Job {
            key: r.get(0),
            shard: None,
            event: Some(r.get(2)),
            due_ms: job_id.as_deref().and_then(stamp_due_ms),
            job_id,
            state: State::Done {
                processed_ms: r.get(3),
                late_ms: r.get(5),
                outcome: r.get(4),
                consumer: r.get(6),
            },
            notes: Vec::new(),
        });
    }
    let since: Option<i64> = db
        .query_one(
            "SELECT (extract(epoch FROM min(processed_at)) * 1000)::bigint FROM worker_inbox",
            &[],
        )?
        .get(0);
    t.inbox_since_ms = since;
    Ok(())
}

/// A pool score as unix ms: below 1e11 it is seconds.
fn score_ms(score: &str) -> i64 {
    let x: f64 = score.parse().unwrap_or(0.0);
    if x < 1e11 {
        (x * 1000.0) as i64
    } else {
        x as i64
    }
}

/// The due time in a stamp `<due µs>-<a>-<b>` (a new identity; an older mover's stamp
/// `<µs>-<n>` has the move's time there, close to it).
fn stamp_due_ms(id: &str) -> Option<i64> {
    id.split('-')
        .next()?
        .parse::<i64>()
        .ok()
        .map(|us| us / 1000)
}

/// The id a retry keeps: its record's, when the data is exactly the message it recorded
/// (`Some(None)` for one recorded unstamped); `None` when there is no such record.
fn retry_id(record: Option<&[u8]>, msg: &[u8]) -> Option<Option<String>> {
    let rec = text(record?);
    let (id, sha) = rec.split_once(' ')?;
    (sha == sha1_smol::Sha1::from(msg).digest().to_string())
        .then(|| Some(id.to_string()).filter(|i| i != "-"))
}

/// The job id of a retry record that does not match `msg` (a newer push replaced that
/// retry in the pool), `?` for a record that names none.
fn replaced_retry(record: Option<&[u8]>, msg: &[u8]) -> Option<String> {
    let rec = text(record?);
    let (id, sha) = rec.split_once(' ').unwrap_or((rec.as_str(), ""));
    (sha != sha1_smol::Sha1::from(msg).digest().to_string()).then(|| {
        if id == "-" || id.is_empty() {
            "?".to_string()
        } else {
            id.to_string()
        }
    })
}

/// The identity the mover will stamp on this member (`lua/move_due.lua`, `identity`).
fn identity(pool: &str, key: &str, score: &str, data: &[u8], due_ms: i64) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(
        format!(
            "dw-job-1\n{}:{pool}\n{}:{key}\n{}\n",
            pool.len(),
            key.len(),
            score_text(score)
        )
        .as_bytes(),
    );
    h.update(data);
    let hex = h.digest().to_string();
    let due_us = due_ms.clamp(0, 9_000_000_000_000) * 1000;
    let a = u64::from_str_radix(&hex[0..8], 16).unwrap_or(0);
    let b = u64::from_str_radix(&hex[8..16], 16).unwrap_or(0);
    format!("{due_us}-{a}-{b}")
}

/// A score as the move script writes it into the identity: whole numbers in full, others
/// as C's `%.17g`.
fn score_text(score: &str) -> String {
    let x: f64 = score.parse().unwrap_or(0.0);
    if x == x.floor() && x.abs() < 2f64.powi(53) {
        return format!("{}", x as i64);
    }
    g17(x)
}

/// C's `printf("%.17g", x)` for a finite `x`.
fn g17(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let sci = format!("{x:.16e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..17).contains(&exp) {
        let mant = trim_zeros(mant);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let decimals = (16 - exp).max(0) as usize;
    trim_zeros(&format!("{x:.decimals$}")).to_string()
}

fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

/// A job found in a list by its message: its stamp is its identity and says its due time.
fn list_job(key: String, event: Option<String>, msg: &[u8], state: State) -> Job {
    let job_id = crate::message::stamp_of(msg);
    Job {
        key,
        shard: None,
        event,
        due_ms: job_id.as_deref().and_then(stamp_due_ms),
        job_id,
        state,
        notes: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_read_as_the_move_script_writes_them() {
        assert_eq!(score_text("1768764300123"), "1768764300123");
        assert_eq!(score_text("1768764300"), "1768764300");
        assert_eq!(g17(1768764300.5), "1768764300.5");
        assert_eq!(g17(0.1), "0.10000000000000001");
        assert_eq!(g17(1e300), "1.0000000000000001e+300");
        assert_eq!(score_ms("1768764300.5"), 1_768_764_300_500);
        assert_eq!(score_ms("1768764300123"), 1_768_764_300_123);
        assert_eq!(
            stamp_due_ms("1768764300123000-1-2"),
            Some(1_768_764_300_123)
        );
    }

    #[test]
    fn an_order_is_traced_by_the_keys_of_the_built_in_events() {
        let q = Query::order("SO123", None);
        assert_eq!(q.keys(), ["order.timeout:SO123", "payment.paid:SO123"]);
        assert_eq!(
            Query::order("SO123", Some("order.timeout")).keys(),
            ["order.timeout:SO123"]
        );
        assert!(q.names_order(&serde_json::json!({"order_no": "SO123"})));
        assert!(Query::order("14", None).names_order(&serde_json::json!({"order_id": 14})));
        assert!(!q.names_order(&serde_json::json!({"order_no": "SO1234"})));
        assert!(Query::key("", None).problem().is_some());
        assert!(Query::key("k", None).problem().is_none());
    }
}
