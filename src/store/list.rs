//! List mode's queues: `fetch` into a per-consumer processing list, `settle` out of it,
//! and the push-back of a dead consumer's processing lists.

use super::{int, pairs, query, run, script, value_to_string, StoreResult, WrongType};
use crate::delivery::{Origin, Outcome, Settlement};
use crate::keys::Keys;
use redis::{ConnectionLike, Script, Value};
use std::sync::LazyLock;

static FETCH: LazyLock<Script> = script!("fetch.lua");
static SETTLE: LazyLock<Script> = script!("settle_list.lua");
static REQUEUE: LazyLock<Script> = script!("requeue_processing.lua");
static FORGIVE: LazyLock<Script> = script!("forgive_list.lua");
static BURY_FETCHED: LazyLock<Script> = script!("bury_fetched.lua");

/// What one fetch took.
#[derive(Debug, Default)]
pub struct Fetched {
    /// (queue index, message, how often it was fetched, this fetch included) in the order
    /// taken.
    pub messages: Vec<(usize, Vec<u8>, u64)>,
    /// Messages sent to the queue's dead list instead (queue, reason): over the size
    /// limit.
    pub buried: Vec<(String, String)>,
    /// A queue skipped because one of its keys holds another type.
    pub blocked: Option<WrongType>,
    /// The message the fetch stopped at, still at its queue's tail, because fetching it
    /// would be once more than the limit: for [`bury_fetched`], once its job is looked up.
    pub over: Option<Overfetched>,
}

/// A list message fetched as often as the limit allows without being settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overfetched {
    pub queue: usize,
    pub msg: Vec<u8>,
    /// How often it was fetched.
    pub fetched: u64,
}

/// What [`bury_fetched`] did.
#[derive(Debug, Default)]
pub struct BuriedFetched {
    /// Taken off its queue as done (its job had committed).
    pub done: bool,
    /// (its job key, or "queue " and the queue's name for a message without one; the
    /// reason) when it went to the dead list.
    pub buried: Vec<(String, String)>,
    /// The dead list, when it holds another type (then it stays where it is).
    pub blocked: Option<WrongType>,
}

/// Settles the message a fetch stopped at ([`Fetched::over`]): taken off its queue as done
/// (`done`: its job's inbox row is there) or sent to its dead list; nothing when it is no
/// longer at its queue's tail or over the limit (see `lua/bury_fetched.lua`).
pub fn bury_fetched(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    over: &Overfetched,
    done: bool,
    limits: (u64, usize),
) -> StoreResult<BuriedFetched> {
    let Some(q) = keys.queues.get(over.queue) else {
        return Ok(BuriedFetched::default());
    };
    let (max_deliveries, max_bytes) = limits;
    let mut inv = BURY_FETCHED.prepare_invoke();
    inv.key(&q.name)
        .key(q.deliveries())
        .key(&q.dead)
        .arg(&over.msg)
        .arg(if done { "done" } else { "dead" })
        .arg(max_deliveries)
        .arg(consumer)
        .arg(&q.name)
        .arg(max_bytes);
    let Value::Array(reply) = run("settle a message fetched too often", &inv, con)? else {
        return Ok(BuriedFetched::default());
    };
    Ok(BuriedFetched {
        done: int(reply.first()) == 1,
        buried: pairs(reply.get(1)),
        blocked: WrongType::from_reply(reply.get(2)),
    })
}

/// Moves up to `max` messages from the queues, in priority order, into `consumer`'s
/// processing lists (see `lua/fetch.lua`). Never blocks.
pub fn fetch(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    max: usize,
    max_deliveries: u64,
    max_bytes: usize,
) -> StoreResult<Fetched> {
    let mut inv = FETCH.prepare_invoke();
    for q in &keys.queues {
        inv.key(&q.name)
            .key(q.processing(consumer))
            .key(q.deliveries())
            .key(&q.dead);
    }
    inv.arg(max)
        .arg(max_deliveries)
        .arg(consumer)
        .arg(max_bytes);
    for q in &keys.queues {
        inv.arg(&q.name);
    }
    let Value::Array(reply) = run("fetch", &inv, con)? else {
        return Ok(Fetched::default());
    };
    let messages = match reply.get(1) {
        Some(Value::Array(items)) => items
            .chunks(3)
            .filter_map(|c| match c {
                [q, Value::BulkString(msg), n] => Some((
                    int(Some(q)) as usize,
                    msg.clone(),
                    int(Some(n)).max(0) as u64,
                )),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let over = match reply.get(4) {
        Some(Value::Array(o)) => match o.as_slice() {
            [q, Value::BulkString(msg), n, ..] => Some(Overfetched {
                queue: int(Some(q)).max(0) as usize,
                msg: msg.clone(),
                fetched: int(Some(n)).max(0) as u64,
            }),
            _ => None,
        },
        _ => None,
    };
    Ok(Fetched {
        messages,
        buried: pairs(reply.get(2)),
        blocked: WrongType::from_reply(reply.get(3)),
        over,
    })
}

/// The settle script for list messages (see `lua/settle_list.lua`); the raw reply,
/// parsed by `store::settle`.
pub(super) fn settle(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    batch: &[&Settlement],
) -> StoreResult<Vec<Value>> {
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&keys.pool).key(&keys.data).key(&keys.jobs);
    for q in &keys.queues {
        inv.key(q.processing(consumer))
            .key(&q.dead)
            .key(q.deliveries());
    }
    inv.arg(consumer);
    for s in batch {
        let queue = match s.origin {
            Origin::List { queue } => queue,
            Origin::Stream { .. } => 0,
        };
        let name = keys.queues.get(queue).map_or("", |q| q.name.as_str());
        inv.arg(match s.outcome {
            Outcome::Ack => "A",
            Outcome::Retry { .. } => "R",
            Outcome::Dead { .. } => "D",
        })
        .arg(queue)
        .arg(name)
        .arg(s.key.as_slice())
        .arg(s.msg.as_slice());
        match &s.outcome {
            Outcome::Ack => inv.arg("").arg("").arg(0),
            Outcome::Retry { msg, due_ms } => inv.arg(msg.as_slice()).arg(*due_ms).arg(0),
            Outcome::Dead {
                reason,
                event,
                attempts,
            } => inv.arg(reason).arg(event).arg(*attempts),
        };
    }
    match run("settle", &inv, con)? {
        Value::Array(v) => Ok(v),
        _ => Ok(Vec::new()),
    }
}

/// At this consumer's graceful stop: its fetch of each message still in its processing
/// lists is taken off the message's delivery count (the stop's drain ran what it would:
/// the rest were fetched and never run, so a restart does not count toward
/// `--max-deliveries`). The messages stay for the next start or a peer. Returns how many
/// there were.
pub fn forgive_left(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
) -> StoreResult<usize> {
    let mut inv = FORGIVE.prepare_invoke();
    for q in &keys.queues {
        inv.key(q.processing(consumer)).key(q.deliveries());
    }
    Ok(int(Some(&run(
        "forgive the messages left at the stop",
        &inv,
        con,
    )?))
    .max(0) as usize)
}

/// What [`requeue_processing`] pushed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushedBack {
    pub messages: usize,
    /// The peer is alive but has had no usable PostgreSQL for a while; otherwise its
    /// heartbeat was gone (or these were the caller's own lists).
    pub without_database: bool,
}

/// Pushes one consumer's processing lists back onto their queues. `peer`: only if its
/// heartbeat expired, or if it marked itself as having no usable PostgreSQL and `settled`
/// says the caller has had one for a while (its fetches of them then no longer count
/// toward `--max-deliveries`). Returns what went back, or `None` if the peer keeps them.
pub fn requeue_processing(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    peer: bool,
    settled: bool,
) -> StoreResult<Option<PushedBack>> {
    let mut inv = REQUEUE.prepare_invoke();
    for q in &keys.queues {
        inv.key(q.processing(consumer))
            .key(&q.name)
            .key(q.deliveries());
    }
    inv.key(&keys.list_consumers)
        .key(keys.heartbeat(consumer))
        .key(keys.without_database(consumer))
        .arg(consumer)
        .arg(if peer { "1" } else { "0" })
        .arg(if settled { "1" } else { "0" });
    Ok(match run("push back processing lists", &inv, con)? {
        Value::Array(v) => Some(PushedBack {
            messages: int(v.first()).max(0) as usize,
            without_database: int(v.get(1)) == 1,
        }),
        _ => None,
    })
}

/// Lists this consumer in the SET peers look in for processing lists to recover.
pub fn register_consumer(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
) -> StoreResult<()> {
    let mut cmd = redis::cmd("SADD");
    cmd.arg(&keys.list_consumers).arg(consumer);
    query("register the consumer", &cmd, con)
}

/// Every consumer that has (or had) processing lists (read only).
pub fn consumers(con: &mut dyn ConnectionLike, keys: &Keys) -> StoreResult<Vec<String>> {
    let mut cmd = redis::cmd("SMEMBERS");
    cmd.arg(&keys.list_consumers);
    let v: Value = query("list consumers", &cmd, con)?;
    Ok(match v {
        Value::Array(items) => items.iter().map(value_to_string).collect(),
        Value::Set(items) => items.iter().map(value_to_string).collect(),
        _ => Vec::new(),
    })
}

/// Whether each message (queue index, bytes) is still in `consumer`'s processing list of
/// its queue (one `LPOS` each, in one pipeline): one a peer pushed back to its queue (this
/// consumer had no usable PostgreSQL, and said so), or settled since, is not.
pub fn still_held(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    msgs: &[(usize, &[u8])],
) -> StoreResult<Vec<bool>> {
    if msgs.is_empty() {
        return Ok(Vec::new());
    }
    let mut p = redis::pipe();
    let mut asked = Vec::with_capacity(msgs.len());
    for (queue, msg) in msgs {
        // A queue this set does not have holds nothing of ours.
        let q = keys.queues.get(*queue);
        asked.push(q.is_some());
        if let Some(q) = q {
            p.cmd("LPOS").arg(q.processing(consumer)).arg(*msg);
        }
    }
    let v: Vec<Value> = if asked.contains(&true) {
        p.query(con)
            .map_err(|e| super::StoreError::from_redis("ask which messages are still held", e))?
    } else {
        Vec::new()
    };
    let mut answers = v.iter();
    Ok(asked
        .into_iter()
        .map(|a| a && matches!(answers.next(), Some(Value::Int(_))))
        .collect())
}

/// The queues' dead lists that hold another type than a LIST (one `TYPE` each): what a
/// message that must be dead-lettered would be held back by.
pub fn dead_lists_of_another_type(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
) -> StoreResult<Vec<WrongType>> {
    let mut bad = Vec::new();
    for q in &keys.queues {
        let found: String = query(
            "look at a dead list's type",
            redis::cmd("TYPE").arg(&q.dead),
            con,
        )?;
        if found != "list" && found != "none" {
            bad.push(WrongType {
                key: q.dead.clone(),
                found,
                wanted: "list".into(),
            });
        }
    }
    Ok(bad)
}
