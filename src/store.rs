//! The Redis side of every state change, one atomic Lua script each (DESIGN §2).
//!
//! Named after the transition they make: [`push`], [`cancel`], [`move_due`], [`settle`].
//! Each script declares every key it touches in `KEYS`, so the scripts run unchanged on
//! Redis Cluster once the key names share a hash tag (see `keys.rs`). Scripts are sent
//! by SHA (EVALSHA) and loaded on the first `NOSCRIPT`, so a call is one round trip.

use crate::delivery::{Origin, Outcome, Settlement};
use crate::keys::Keys;
use redis::{ConnectionLike, RedisResult, Script, Value};
use std::sync::LazyLock;

static PUSH: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/push.lua")));
static CANCEL: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/cancel.lua")));
static MOVE_DUE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/move_due.lua")));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/settle.lua")));

/// Schedules `msg` under `key` at `score`, data before score. Returns `true` when the key
/// was already scheduled (the job is rescheduled, not duplicated).
pub fn push(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    key: &str,
    msg: &str,
    score: i64,
) -> RedisResult<bool> {
    let existed: i64 = PUSH
        .key(&keys.pool)
        .key(&keys.data)
        .arg(key)
        .arg(msg)
        .arg(score)
        .invoke(con)?;
    Ok(existed == 1)
}

/// Removes a scheduled job. Returns `true` if it existed.
pub fn cancel(con: &mut dyn ConnectionLike, keys: &Keys, key: &str) -> RedisResult<bool> {
    let existed: i64 = CANCEL
        .key(&keys.pool)
        .key(&keys.data)
        .arg(key)
        .invoke(con)?;
    Ok(existed == 1)
}

/// What one `move_due` call did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MoveReport {
    pub moved: usize,
    /// Due members without data, still inside the orphan grace period.
    pub skipped: usize,
    /// Due time (unix ms) of the earliest member not yet due.
    pub next_due_ms: Option<i64>,
    /// Members removed because their data never arrived.
    pub orphans: Vec<String>,
}

/// Where the mover puts due messages.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// XADD to this stream (fields `msg`, `key`, `due`).
    Stream(&'a str),
    /// LPUSH onto this list queue (the job key goes into the message as `job_key`).
    List(&'a str),
}

/// A delay pool to move from.
#[derive(Debug, Clone, Copy)]
pub enum Pool<'a> {
    /// Ours: ZSET of job keys plus the HASH of messages.
    Enveloped { pool: &'a str, data: &'a str },
    /// An older producer's: ZSET of keys, each a STRING key holding an order id, all
    /// standing for one event.
    Legacy { pool: &'a str, event: &'a str },
}

/// Moves up to `limit` members of `pool` due at `now_ms` to `target`, in one atomic script.
pub fn move_due(
    con: &mut dyn ConnectionLike,
    pool: Pool<'_>,
    target: Target<'_>,
    now_ms: i64,
    limit: usize,
    orphan_grace_ms: i64,
) -> RedisResult<MoveReport> {
    let now_s = format!("{}.{:03}", now_ms.div_euclid(1000), now_ms.rem_euclid(1000));
    let (zset, data, legacy) = match pool {
        Pool::Enveloped { pool, data } => (pool, data, ""),
        // The data slot is unused for a legacy pool; the pool key keeps KEYS well formed.
        Pool::Legacy { pool, event } => (pool, pool, event),
    };
    let (target_key, mode) = match target {
        Target::Stream(k) => (k, "stream"),
        Target::List(k) => (k, "list"),
    };
    let reply: Vec<Value> = MOVE_DUE
        .key(zset)
        .key(data)
        .key(target_key)
        .arg(now_ms)
        .arg(now_s)
        .arg(limit)
        .arg(orphan_grace_ms)
        .arg(mode)
        .arg(legacy)
        .arg(now_ms.div_euclid(1000))
        .invoke(con)?;
    let int = |v: Option<&Value>| match v {
        Some(Value::Int(n)) => *n,
        _ => 0,
    };
    let next = int(reply.get(2));
    Ok(MoveReport {
        moved: int(reply.first()) as usize,
        skipped: int(reply.get(1)) as usize,
        next_due_ms: (next >= 0).then_some(next),
        orphans: reply.iter().skip(3).map(value_to_string).collect(),
    })
}

/// Applies a batch of outcomes, one script call per source kind (stream entries, list
/// messages). Returns how many messages this call acknowledged; messages a peer already
/// settled are skipped.
pub fn settle(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    now_s: i64,
    batch: &[Settlement],
) -> RedisResult<usize> {
    let (stream, list): (Vec<&Settlement>, Vec<&Settlement>) = batch
        .iter()
        .partition(|s| matches!(s.origin, Origin::Stream { .. }));
    let mut n = 0;
    if !stream.is_empty() {
        n += settle_stream(con, keys, consumer, now_s, &stream)?;
    }
    if !list.is_empty() {
        n += crate::list::settle(con, keys, consumer, now_s, &list)?;
    }
    Ok(n)
}

fn settle_stream(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    now_s: i64,
    batch: &[&Settlement],
) -> RedisResult<usize> {
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&keys.stream)
        .key(&keys.pool)
        .key(&keys.data)
        .key(&keys.dead)
        .arg(&keys.group)
        .arg(now_s)
        .arg(consumer);
    for s in batch {
        let Origin::Stream { id } = &s.origin else {
            continue;
        };
        match &s.outcome {
            Outcome::Ack => inv.arg("A").arg(id).arg("").arg("").arg("").arg("").arg(0),
            Outcome::Retry { msg, due_ms } => inv
                .arg("R")
                .arg(id)
                .arg(s.key.as_slice())
                .arg(msg.as_slice())
                .arg(*due_ms)
                .arg("")
                .arg(0),
            Outcome::Dead {
                reason,
                event,
                attempts,
            } => inv
                .arg("D")
                .arg(id)
                .arg(s.key.as_slice())
                .arg(s.msg.as_slice())
                .arg(reason)
                .arg(event)
                .arg(*attempts),
        };
    }
    let n: i64 = inv.invoke(con)?;
    Ok(n as usize)
}

/// Bytes of a reply as text (lossy), for ids and log lines.
pub fn value_to_string(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(n) => n.to_string(),
        Value::Okay => "OK".to_string(),
        _ => String::new(),
    }
}

/// How long a connect may take before it counts as "unreachable".
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Opens a connection whose reads and writes time out after `io_timeout`, so a Redis that
/// stops answering cannot hang a thread past shutdown.
pub fn connect_with(
    client: &redis::Client,
    io_timeout: std::time::Duration,
) -> RedisResult<redis::Connection> {
    let con = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
    con.set_read_timeout(Some(io_timeout))?;
    con.set_write_timeout(Some(io_timeout))?;
    Ok(con)
}

/// A connection for short commands (scripts, acks): 10 s I/O timeout.
pub fn connect(client: &redis::Client) -> RedisResult<redis::Connection> {
    connect_with(client, std::time::Duration::from_secs(10))
}
