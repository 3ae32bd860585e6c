//! The operator's changes to the dead letters: requeue into the delay pool, purge; and
//! for list mode's dead lists, requeue onto the queue, purge.

use super::{run, script, StoreResult};
use crate::keys::{Keys, Queue};
use redis::{ConnectionLike, Script, Value};
use std::sync::LazyLock;

static REQUEUE: LazyLock<Script> = script!("requeue.lua");
static REQUEUE_LIST: LazyLock<Script> = script!("requeue_list.lua");
static PURGE: LazyLock<Script> = script!("purge.lua");

/// A read-only script for `worker stats`: how many entries of a stream have an id at or
/// after ARGV[1], up to ARGV[2], counted server side (see `lua/count_since.lua`).
pub const COUNT_SINCE_LUA: &str = include_str!("../lua/count_since.lua");

/// A read-only script for `worker stats`: how many letters of a dead list died at or
/// after ARGV[1] (unix seconds), up to ARGV[2] looked at (see `lua/count_list_since.lua`).
pub const COUNT_LIST_SINCE_LUA: &str = include_str!("../lua/count_list_since.lua");

/// What became of one letter in [`requeue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeued {
    /// Back in the delay pool, due at the given time, and gone from the dead letters.
    Requeued,
    /// Already gone: requeued or purged by someone else.
    Gone,
    /// Its job key is scheduled again (pushed anew since), or a newer letter of it is dead:
    /// the letter stays.
    KeyScheduled,
    /// Its job key's data is in the data hash with no schedule in the pool: a push under
    /// way, or one cut between its HSET and its ZADD. The letter stays.
    DataUnscheduled,
}

/// Puts letters `(id, job key, message)` back into the delay pool due at `due_ms`, each
/// in one step with its XDEL (pool first, XDEL last), in one script call.
pub fn requeue(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    letters: &[(&str, &[u8], &[u8])],
    due_ms: i64,
) -> StoreResult<Vec<Requeued>> {
    let mut inv = REQUEUE.prepare_invoke();
    inv.key(&keys.dead)
        .key(&keys.pool)
        .key(&keys.data)
        .key(&keys.jobs)
        .key(&keys.letters)
        .arg(due_ms);
    for (id, key, msg) in letters {
        inv.arg(*id).arg(*key).arg(*msg);
    }
    Ok(requeued(run("requeue dead letters", &inv, con)?))
}

/// Deletes dead letters by id, and each from the `letters` index, in one script call;
/// returns how many were still there.
pub fn purge(con: &mut dyn ConnectionLike, keys: &Keys, ids: &[&str]) -> StoreResult<u64> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut inv = PURGE.prepare_invoke();
    inv.key(&keys.dead).key(&keys.letters);
    for id in ids {
        inv.arg(*id);
    }
    let reply = run("purge dead letters", &inv, con)?;
    Ok(match reply {
        Value::Array(v) => super::int(v.first()).max(0) as u64,
        _ => 0,
    })
}

/// Puts letters `(letter bytes, job key or empty, message)` of `queue`'s dead list back
/// onto the queue (LPUSH), each in one step with its LREM from the dead list (queue first,
/// LREM last), in one script call; the letter is named by its exact bytes.
pub fn requeue_list(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    queue: &Queue,
    letters: &[(&[u8], &[u8], &[u8])],
) -> StoreResult<Vec<Requeued>> {
    let mut inv = REQUEUE_LIST.prepare_invoke();
    inv.key(&queue.dead)
        .key(&queue.name)
        .key(queue.deliveries())
        .key(&keys.pool)
        .key(&keys.data);
    for (letter, key, msg) in letters {
        inv.arg(*letter).arg(*key).arg(*msg);
    }
    Ok(requeued(run("requeue dead letters", &inv, con)?))
}

/// Deletes letters from a dead list by their exact bytes, one LREM each, all in one
/// MULTI; returns how many were still there.
pub fn purge_list(
    con: &mut dyn ConnectionLike,
    queue: &Queue,
    letters: &[&[u8]],
) -> StoreResult<u64> {
    if letters.is_empty() {
        return Ok(0);
    }
    let mut p = redis::pipe();
    p.atomic();
    for letter in letters {
        p.cmd("LREM").arg(&queue.dead).arg(1).arg(*letter);
    }
    let removed: Vec<u64> = p
        .query(con)
        .map_err(|e| super::StoreError::from_redis("purge dead letters", e))?;
    Ok(removed.iter().sum())
}

/// A requeue script's reply: a code per letter, in order (1 back, -1 its key scheduled
/// again, 0 gone).
fn requeued(reply: Value) -> Vec<Requeued> {
    let Value::Array(codes) = reply else {
        return Vec::new();
    };
    codes
        .iter()
        .map(|c| match super::int(Some(c)) {
            1 => Requeued::Requeued,
            -1 => Requeued::KeyScheduled,
            -2 => Requeued::DataUnscheduled,
            _ => Requeued::Gone,
        })
        .collect()
}
