//! The delay pool: `push`, `cancel` and `move_due` (one script each, see `src/lua/`).

use super::{int, pairs, run, script, StoreResult, WrongType};
use crate::keys::Keys;
use redis::{ConnectionLike, Script, Value};
use std::sync::LazyLock;

static PUSH: LazyLock<Script> = script!("push.lua");
static PUSH_BATCH: LazyLock<Script> = script!("push_batch.lua");
static CANCEL: LazyLock<Script> = script!("cancel.lua");
static MOVE_DUE: LazyLock<Script> = script!("move_due.lua");
static HASTEN: LazyLock<Script> = script!("hasten.lua");

/// Schedules `msg` under `key` at `score`, data before score. Returns `true` when the key
/// was already scheduled (the job is rescheduled, not duplicated).
pub fn push(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    key: &str,
    msg: impl AsRef<[u8]>,
    score: i64,
) -> StoreResult<bool> {
    let mut inv = PUSH.prepare_invoke();
    inv.key(&keys.pool)
        .key(&keys.data)
        .key(&keys.jobs)
        .arg(key)
        .arg(msg.as_ref())
        .arg(score);
    Ok(int(Some(&run("push", &inv, con)?)) == 1)
}

/// [`push`] for many jobs `(key, message, score)` of one key set, `per_call` jobs per
/// script call (`push_batch.lua`): each call is one atomic step and one round trip, on a
/// Redis Cluster too (the set's keys share one hash slot). For loading a backlog; a
/// sharded queue loads each shard's jobs with that shard's keys. Returns how many were
/// pushed and how many of them were already scheduled (rescheduled, not duplicated).
pub fn push_many(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    jobs: impl Iterator<Item = (String, String, i64)>,
    per_call: usize,
) -> StoreResult<(u64, u64)> {
    let per_call = per_call.max(1);
    let (mut pushed, mut again) = (0u64, 0u64);
    let mut batch: Vec<(String, String, i64)> = Vec::with_capacity(per_call);
    let mut send = |batch: &mut Vec<(String, String, i64)>| -> StoreResult<()> {
        let mut inv = PUSH_BATCH.prepare_invoke();
        inv.key(&keys.pool).key(&keys.data).key(&keys.jobs);
        for (key, msg, score) in batch.iter() {
            inv.arg(key).arg(msg).arg(*score);
        }
        again += int(Some(&run("push", &inv, con)?)) as u64;
        pushed += batch.len() as u64;
        batch.clear();
        Ok(())
    };
    for job in jobs {
        batch.push(job);
        if batch.len() == per_call {
            send(&mut batch)?;
        }
    }
    if !batch.is_empty() {
        send(&mut batch)?;
    }
    Ok((pushed, again))
}

/// Brings forward to now the retries `(job key, score, SHA-1 of the message in hex)` of
/// jobs whose lock is gone, each only while it is that very retry, not yet due
/// (`hasten.lua`). Returns the job keys brought forward.
pub fn hasten(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    retries: &[(&str, i64, &str)],
) -> StoreResult<Vec<String>> {
    let mut inv = HASTEN.prepare_invoke();
    inv.key(&keys.pool).key(&keys.data);
    for (key, score, sha) in retries {
        inv.arg(*key).arg(*score).arg(*sha);
    }
    let reply = run("hasten", &inv, con)?;
    Ok(redis::from_redis_value::<Vec<String>>(reply).unwrap_or_default())
}

/// Removes a scheduled job. Returns `true` if it existed.
pub fn cancel(con: &mut dyn ConnectionLike, keys: &Keys, key: &str) -> StoreResult<bool> {
    let mut inv = CANCEL.prepare_invoke();
    inv.key(&keys.pool).key(&keys.data).key(&keys.jobs).arg(key);
    Ok(int(Some(&run("cancel", &inv, con)?)) == 1)
}

/// The clock a move decides "due" by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    /// Redis's own (`TIME`, read inside the script): what the worker always uses, so that
    /// no worker host's clock decides when a job is due.
    Server,
    /// This time (unix ms): the tests' injected clock.
    Ms(i64),
}

impl From<i64> for At {
    fn from(ms: i64) -> At {
        At::Ms(ms)
    }
}

/// The first words of the reason of a member whose data vanished (see `lua/move_due.lua`).
pub const LOST_DATA: &str = "lost data";

/// What one `move_due` call did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MoveReport {
    /// The time the call decided by (unix ms): Redis's clock, or the injected one.
    pub now_ms: i64,
    pub moved: usize,
    /// Due members without data, still inside the orphan grace period.
    pub skipped: usize,
    /// Due time (unix ms) of the earliest member not yet due.
    pub next_due_ms: Option<i64>,
    /// Members sent to the dead letters instead (job key, reason): data over the size
    /// limit, a legacy key of another type or that Redis refuses to read (an ACL user's
    /// key patterns leave it out), or no data past the grace.
    pub buried: Vec<(String, String)>,
    /// The dead-letter key, when it holds another type: members that should have been
    /// buried stay in the pool (counted in `skipped`) until it is fixed.
    pub blocked: Option<WrongType>,
    /// Legacy keys whose member left the pool (moved or buried) but that Redis refused to
    /// delete (key, Redis's error): an ACL user allowed to read them but not to write.
    /// They stay as they are; nothing schedules them again.
    pub undeleted: Vec<(String, String)>,
    /// The call moved less than it could have because the stream holds `ahead` entries
    /// no reader has taken yet (its group's lag).
    pub cut: bool,
}

/// Where the mover puts due messages, and where the members it cannot move go.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// XADD to this stream (fields `msg`, `key`, `due`); dead letters to `dead` (STREAM).
    Stream { stream: &'a str, dead: &'a str },
    /// LPUSH onto this list queue (the job key goes into the message as `job_key`); dead
    /// letters onto the queue's `dead` LIST.
    List { queue: &'a str, dead: &'a str },
}

/// A delay pool to move from.
#[derive(Debug, Clone, Copy)]
pub enum Pool<'a> {
    /// Ours: ZSET of job keys plus the HASH of messages.
    Enveloped { pool: &'a str, data: &'a str },
    /// An older producer's: ZSET of keys, each a STRING key holding an order id, all
    /// standing for one event. `cluster`: on a Redis Cluster, where a member whose key is
    /// in another hash slot than the pool cannot be moved by one script.
    Legacy {
        pool: &'a str,
        event: &'a str,
        cluster: bool,
    },
}

/// The due members of a legacy pool, up to `limit` of each score kind (seconds, then
/// milliseconds), as the scan of the script would take them. A pool key of another type
/// reads as none: the script then reports it.
fn legacy_candidates(
    con: &mut dyn ConnectionLike,
    pool: &str,
    now_ms: i64,
    limit: usize,
) -> StoreResult<Vec<String>> {
    let now_s = format!("{}.{:03}", now_ms.div_euclid(1000), now_ms.rem_euclid(1000));
    let mut out = Vec::new();
    for (min, max) in [
        ("-inf".to_string(), now_s.to_string()),
        ("1e11".to_string(), now_ms.to_string()),
    ] {
        let got: redis::RedisResult<Vec<String>> = redis::cmd("ZRANGEBYSCORE")
            .arg(pool)
            .arg(min)
            .arg(max)
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query(con);
        match got {
            Ok(m) => out.extend(m),
            Err(e) if e.code() == Some("WRONGTYPE") => return Ok(Vec::new()),
            Err(e) => return Err(super::StoreError::from_redis("read a legacy pool", e)),
        }
    }
    Ok(out)
}

/// Moves up to `limit` members of `pool` due at `at` (Redis's clock, or an injected time)
/// to `target`, in one atomic script. `ours` are our pool's keys: its jobs HASH (retries
/// keep their job id through it) and the `moved` and `letters` indexes `worker trace`
/// reads (a legacy pool's jobs are indexed under ours too). `ahead` (0: no bound) is how
/// many entries the stream may hold that no reader of `ours.group` has taken yet: the
/// call moves no more than fills it to that (`--move-ahead`; a list queue is not
/// bounded).
#[allow(clippy::too_many_arguments)]
pub fn move_due(
    con: &mut dyn ConnectionLike,
    pool: Pool<'_>,
    ours: &Keys,
    target: Target<'_>,
    at: At,
    limit: usize,
    orphan_grace_ms: i64,
    max_bytes: usize,
    ahead: usize,
) -> StoreResult<MoveReport> {
    let (zset, data, legacy) = match pool {
        Pool::Enveloped { pool, data } => (pool, data, ""),
        // The data slot is unused for a legacy pool; the pool key keeps KEYS well formed.
        Pool::Legacy { pool, event, .. } => (pool, pool, event),
    };
    // A legacy pool's members are keys of their own. On a Cluster, a script may touch only
    // the keys it declares: the due members are read first and declared (the script
    // checks that each is still a due member), and members in another hash slot than the
    // pool go as arguments (the script can only bury them). On one server the script
    // scans the pool itself and reaches each member's key under `redis.pcall`, so a key
    // an ACL user may not read or delete is that member's problem alone: declared, it
    // would refuse the whole call.
    let (mut declared, mut foreign) = (Vec::new(), Vec::new());
    let mut declares = false;
    if let Pool::Legacy {
        pool,
        cluster: true,
        ..
    } = pool
    {
        declares = true;
        let slot = crate::keys::slot(pool);
        // Read on the clock the script decides by; it checks each candidate again.
        let now_ms = match at {
            At::Ms(ms) => ms,
            At::Server => super::server_time_us(con, pool)?.div_euclid(1000),
        };
        for m in legacy_candidates(con, pool, now_ms, limit)? {
            if crate::keys::slot(&m) != slot {
                foreign.push(m);
            } else {
                declared.push(m);
            }
        }
    }
    let (target_key, dead, mode) = match target {
        Target::Stream { stream, dead } => (stream, dead, "stream"),
        Target::List { queue, dead } => (queue, dead, "list"),
    };
    let mut inv = MOVE_DUE.prepare_invoke();
    inv.key(zset)
        .key(data)
        .key(target_key)
        .key(dead)
        .key(&ours.jobs)
        .key(&ours.moved)
        .key(&ours.letters)
        .arg(match at {
            At::Server => String::new(),
            At::Ms(ms) => ms.to_string(),
        })
        .arg(limit)
        .arg(orphan_grace_ms)
        .arg(mode)
        .arg(legacy)
        .arg(max_bytes)
        .arg(if declares { "declared" } else { "" })
        .arg(ahead)
        .arg(&ours.group);
    if declares {
        for m in &declared {
            inv.key(m);
        }
        for m in &foreign {
            inv.arg(m);
        }
    }
    let Value::Array(reply) = run("move_due", &inv, con)? else {
        return Ok(MoveReport::default());
    };
    let next = int(reply.get(2));
    Ok(MoveReport {
        now_ms: int(reply.get(6)),
        moved: int(reply.first()) as usize,
        skipped: int(reply.get(1)) as usize,
        next_due_ms: (next >= 0).then_some(next),
        buried: pairs(reply.get(3)),
        blocked: WrongType::from_reply(reply.get(4)),
        undeleted: pairs(reply.get(5)),
        cut: int(reply.get(7)) == 1,
    })
}

/// A retry waiting in the pool ([`retries_page`]): its job key, its due time (the pool's
/// score as unix ms) and its message, either absent when it left the pool meanwhile.
#[derive(Debug, Clone, PartialEq)]
pub struct WaitingRetry {
    pub key: String,
    pub due_ms: Option<i64>,
    pub msg: Option<Vec<u8>>,
}

/// One page of the retries waiting in the pool: the jobs HASH scanned from `cursor`
/// (`HSCAN`, about `count` fields), then each one's score and message in one pipeline.
/// Reads only. Returns the next cursor (0: the scan is over) and the page.
pub fn retries_page(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    cursor: u64,
    count: usize,
) -> StoreResult<(u64, Vec<WaitingRetry>)> {
    let (next, fields): (u64, Vec<Vec<u8>>) = redis::cmd("HSCAN")
        .arg(&keys.jobs)
        .arg(cursor)
        .arg("COUNT")
        .arg(count)
        .query(con)
        .map_err(|e| super::StoreError::from_redis("scan the retries", e))?;
    // Field, value, field, value: the job keys are the fields, beside the copies of the
    // retries' messages (`msg\n<job key>`, see `remember_job` in the scripts' prelude).
    let names: Vec<String> = fields
        .into_iter()
        .step_by(2)
        .filter(|f| !f.starts_with(b"msg\n"))
        .filter_map(|f| String::from_utf8(f).ok())
        .collect();
    if names.is_empty() {
        return Ok((next, Vec::new()));
    }
    let mut p = redis::pipe();
    p.cmd("HMGET").arg(&keys.data).arg(&names);
    for k in &names {
        p.cmd("ZSCORE").arg(&keys.pool).arg(k);
    }
    let (msgs, scores): (Vec<Option<Vec<u8>>>, Vec<Option<f64>>) = {
        let mut replies: Vec<Value> = p
            .query(con)
            .map_err(|e| super::StoreError::from_redis("read the retries", e))?;
        let scores = replies
            .split_off(1.min(replies.len()))
            .into_iter()
            .map(|v| redis::from_redis_value::<Option<f64>>(v).ok().flatten())
            .collect();
        let msgs = replies
            .pop()
            .and_then(|v| redis::from_redis_value(v).ok())
            .unwrap_or_default();
        (msgs, scores)
    };
    let page = names
        .into_iter()
        .enumerate()
        .map(|(i, key)| WaitingRetry {
            key,
            due_ms: scores.get(i).copied().flatten().map(|s| {
                // Seconds scores are below 1e11.
                if s < 1e11 {
                    (s * 1000.0) as i64
                } else {
                    s as i64
                }
            }),
            msg: msgs.get(i).cloned().flatten(),
        })
        .collect();
    Ok((next, page))
}
