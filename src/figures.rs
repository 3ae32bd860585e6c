//! The queue's figures: what `worker stats` shows, read from Redis, and the one source of
//! them for every surface: `worker stats` (table, `--json`, `--watch`), `stats --check`,
//! the queue gauges of `/metrics` and the status page's overview. Formatting is theirs.
//!
//! [`gather`] reads every figure in two pipelined round trips and reports a missing stream
//! or group as zeros, not as an error: a queue nobody has used yet is empty, not broken.
//! Ages and lags are on Redis's clock ([`redis_now_ms`]), never a host's own.
//! [`by_event`] splits the pool by event (for `worker stats` alone: two more round trips).

pub mod by_event;

use crate::config::Config;
use crate::keys::Keys;
use crate::store::stream::id_ms;
use crate::store::value_to_string;
use redis::{RedisError, RedisResult, Value};
use serde::Serialize;
use std::time::Duration;

/// Everything `worker stats` shows, read at `now_ms`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatsReport {
    /// When the figures were read (unix ms); ages below are relative to it.
    pub now_ms: i64,
    pub stream: StreamFigures,
    pub group: GroupFigures,
    /// The group's consumers, as XINFO CONSUMERS lists them.
    pub consumers: Vec<ConsumerFigures>,
    pub pool: PoolFigures,
    pub dead: DeadFigures,
    /// List mode (`--source list --queues ...`): each queue; empty in stream mode.
    pub queues: Vec<QueueFigures>,
    /// The older producers' pools (`--legacy-pool`), each; their mover lag counts in
    /// `pool.mover_lag_ms` too.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub legacy: Vec<LegacyFigures>,
    /// `--shards N`: each shard's own figures, in shard order; the report's own figures
    /// are then their total (counts added, ages and lags the largest).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<StatsReport>,
    /// Every live worker (its heartbeat key exists) and the health record it published
    /// there (`health.rs`): its clock offset to Redis and its problems. `None` for a
    /// worker of an older version, which wrote no record.
    pub workers: Vec<WorkerHealth>,
    /// `worker stats` only: the pool's soonest members split by event
    /// ([`by_event`]); `None` in `--check`, `/metrics` and the page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_event: Option<by_event::ByEvent>,
}

/// One live worker as its heartbeat key describes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerHealth {
    /// Its consumer name.
    pub name: String,
    pub record: Option<crate::health::Record>,
}

impl StatsReport {
    /// The total of several shards' reports: counts added, the oldest ages and largest
    /// lags kept, consumers merged by name; each report kept in `shards`.
    fn total(shards: Vec<StatsReport>) -> StatsReport {
        let mut t = shards[0].clone();
        let name = |k: &str| {
            // `{mq:0}:events` stands for `{mq:0..N-1}:events`.
            k.replacen(":0}", &format!(":0..{}}}", shards.len() - 1), 1)
        };
        t.stream.key = name(&t.stream.key);
        t.pool.key = name(&t.pool.key);
        t.dead.key = name(&t.dead.key);
        let add_opt = |a: Option<u64>, b: Option<u64>| Some(a? + b?);
        for s in &shards[1..] {
            t.stream.length += s.stream.length;
            t.stream.entries_added = add_opt(t.stream.entries_added, s.stream.entries_added);
            t.group.exists &= s.group.exists;
            t.group.lag = add_opt(t.group.lag, s.group.lag);
            t.group.entries_read = add_opt(t.group.entries_read, s.group.entries_read);
            t.group.pending += s.group.pending;
            if s.group.oldest_pending_age_ms > t.group.oldest_pending_age_ms {
                t.group.oldest_pending_age_ms = s.group.oldest_pending_age_ms;
                t.group.oldest_pending_id = s.group.oldest_pending_id.clone();
            }
            for c in &s.consumers {
                match t.consumers.iter_mut().find(|x| x.name == c.name) {
                    Some(x) => {
                        x.pending += c.pending;
                        x.idle_ms = x.idle_ms.min(c.idle_ms);
                        x.heartbeat &= c.heartbeat;
                    }
                    None => t.consumers.push(c.clone()),
                }
            }
            t.pool.size += s.pool.size;
            t.pool.due += s.pool.due;
            t.pool.due_seconds += s.pool.due_seconds;
            t.pool.due_ms += s.pool.due_ms;
            t.pool.readers_backlog_ms = t.pool.readers_backlog_ms.max(s.pool.readers_backlog_ms);
            if s.pool.mover_lag_ms > t.pool.mover_lag_ms {
                t.pool.mover_lag_ms = s.pool.mover_lag_ms;
                t.pool.oldest_due_key = s.pool.oldest_due_key.clone();
                t.pool.oldest_due_at_ms = s.pool.oldest_due_at_ms;
                t.pool.oldest_due_has_data = s.pool.oldest_due_has_data;
            }
            t.dead.length += s.dead.length;
            t.dead.entries_added = add_opt(t.dead.entries_added, s.dead.entries_added);
            t.dead.new += s.dead.new;
            t.dead.newest_age_ms = match (t.dead.newest_age_ms, s.dead.newest_age_ms) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            };
            t.legacy.extend(s.legacy.iter().cloned());
            t.dead.lost += s.dead.lost;
            for w in &s.workers {
                if !t.workers.iter().any(|x| x.name == w.name) {
                    t.workers.push(w.clone());
                }
            }
        }
        t.shards = shards;
        t
    }
}

/// One older producer's pool (`--legacy-pool KEY=EVENT`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LegacyFigures {
    pub key: String,
    /// ZCARD: every member, due or not.
    pub size: u64,
    /// Members due at `now_ms` and not moved yet.
    pub due: u64,
    /// How overdue its oldest due member is (0 when nothing is due).
    pub mover_lag_ms: i64,
}

/// One list queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueFigures {
    pub name: String,
    /// Messages waiting in the queue.
    pub length: u64,
    /// Messages held by each known consumer (its processing list), including consumers
    /// that died and whose lists a peer has not pushed back yet.
    pub processing: Vec<(String, u64)>,
    /// The queue's dead list.
    pub dead: u64,
    /// Letters of the dead list that died within the dead window (their `ts`), counted
    /// up to 10,000 letters looked at.
    pub dead_new: u64,
    /// Of those, letters of lost data (a pool member whose data vanished).
    pub dead_lost: u64,
    /// How long the oldest waiting message has waited (see [`waiting_since_ms`]); `None`
    /// when the queue is empty or its age cannot be known.
    pub oldest_age_ms: Option<i64>,
    /// Why the oldest waiting message's age cannot be known, when it cannot.
    pub oldest_unknown: Option<&'static str>,
}

/// When a waiting list message started to wait, unix ms: the time its mover's stamp
/// begins with (`job_id`: its job's due time, or when an older mover pushed it; a message
/// retried through the pool keeps its first stamp, so its age includes its retries), else
/// its `ts` (when the producer wrote it). `Err(why)` when it has neither: a raw queue's
/// messages are the producer's own JSON, and a `ts` in them is not ours to read.
pub fn waiting_since_ms(msg: &[u8], raw: bool) -> Result<i64, &'static str> {
    if raw {
        return Err("raw message");
    }
    let stamped = crate::message::stamp_of(msg)
        .and_then(|id| id.split('-').next()?.parse::<i64>().ok())
        .filter(|us| *us > 0);
    if let Some(us) = stamped {
        return Ok(us / 1000);
    }
    let ts = serde_json::from_slice::<serde_json::Value>(msg)
        .ok()
        .and_then(|v| match v.get("ts")? {
            serde_json::Value::Number(n) => n.as_f64(),
            serde_json::Value::String(s) => s.trim().parse::<f64>().ok(),
            _ => None,
        })
        .filter(|t| t.is_finite() && *t > 0.0 && *t < 9.0e12);
    match ts {
        Some(t) => Ok((t * 1000.0) as i64),
        None => Err("no job_id or ts in it"),
    }
}

/// Dead-list letters looked at, at most, to count the new ones: a check stays quick
/// whatever the flood.
pub const LIST_DEAD_NEW_CAP: u64 = 10_000;

/// Letters slightly older than the window still do not end the count of new ones: the
/// writers' clocks (each worker host's) differ a little.
const LIST_DEAD_CLOCK_SLACK_S: i64 = 60;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamFigures {
    pub key: String,
    /// XLEN: entries in the stream, acknowledged or not (until trimmed).
    pub length: u64,
    /// Entries ever added (Redis 7+; `None` on older servers): unlike the length it
    /// never shrinks, so `--watch` derives moved/s from it.
    pub entries_added: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupFigures {
    pub name: String,
    /// False until the first worker created the group (the figures below are then 0).
    pub exists: bool,
    /// Entries not yet delivered to any consumer (`None` when Redis cannot tell).
    pub lag: Option<u64>,
    /// Entries delivered to the group so far (`None` when Redis cannot tell).
    pub entries_read: Option<u64>,
    /// Delivered, not yet acknowledged.
    pub pending: u64,
    /// The oldest pending entry and how long ago it was added to the stream.
    pub oldest_pending_id: Option<String>,
    pub oldest_pending_age_ms: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsumerFigures {
    pub name: String,
    pub pending: u64,
    /// Since the consumer last read or claimed.
    pub idle_ms: u64,
    /// Its heartbeat key exists: the process is alive. A consumer without one that still
    /// holds pending entries is a dead host whose work the reader takes over.
    pub heartbeat: bool,
    /// Its no-database mark exists: alive, but without a usable PostgreSQL for a while, so
    /// a peer that has one takes over its pending entries.
    pub without_database: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolFigures {
    pub key: String,
    /// ZCARD: every scheduled member, due or not.
    pub size: u64,
    /// Members due at `now_ms` but not moved yet: `due_seconds + due_ms`.
    pub due: u64,
    /// Of those, members with a seconds score (the PHP producer) ...
    pub due_seconds: u64,
    /// ... and with a milliseconds score.
    pub due_ms: u64,
    /// The member that has been due longest, and its due time (unix ms).
    pub oldest_due_key: Option<String>,
    pub oldest_due_at_ms: Option<i64>,
    /// How overdue that member is: the mover lag (0 when nothing is due, and while the
    /// readers hold the mover back: see `readers_backlog_ms`).
    pub mover_lag_ms: i64,
    /// How overdue that member is while the stream holds at least half of `--move-ahead`
    /// entries no reader has taken yet (its group's lag): due members then wait in the pool
    /// by design (the mover moves no further ahead), the readers' backlog and not the
    /// mover's lag. 0 otherwise. `stats --check` holds it against the `oldest` thresholds.
    pub readers_backlog_ms: i64,
    /// Whether that member's message is in the data hash. A member without data is a
    /// producer that wrote ZADD before HSET (or never wrote HSET); the mover leaves it
    /// alone for `--orphan-grace`, so it counts in the lag until then.
    pub oldest_due_has_data: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadFigures {
    pub key: String,
    /// XLEN: dead letters kept.
    pub length: u64,
    /// Dead letters ever added (Redis 7+): `--watch` derives dead/s from it.
    pub entries_added: Option<u64>,
    /// Dead letters whose id is within `window_ms` of `now_ms` (counted up to 100000).
    pub new: u64,
    /// Of those, letters of lost data: pool members whose data vanished (an evicting
    /// Redis, a deleted data hash), each named with its key and due time in its reason.
    pub lost: u64,
    pub window_ms: i64,
    /// Age of the newest dead letter.
    pub newest_age_ms: Option<i64>,
}

/// Counting new dead letters stops here, so a flood cannot make a check slow.
const DEAD_NEW_CAP: u64 = 100_000;

/// Counts stream entries from an id on, server side: a check must not download every
/// dead letter just to count them.
const COUNT_SINCE: &str = crate::store::dead::COUNT_SINCE_LUA;
/// The same for a dead list, by the letters' `ts`.
const COUNT_LIST_SINCE: &str = crate::store::dead::COUNT_LIST_SINCE_LUA;

/// Reads every figure at `now_ms`: one pipelined round trip for the keys, a second one
/// for the consumers' heartbeats and the oldest due member's data. A missing stream,
/// group or key reads as zeros; any other Redis error is returned.
pub fn gather(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    now_ms: i64,
    dead_window: Duration,
) -> RedisResult<StatsReport> {
    let window_ms = i64::try_from(dead_window.as_millis()).unwrap_or(i64::MAX);
    // Seconds scores are below 1e11 and sort before every millisecond score, so each
    // kind is one score range, exactly as the mover reads them (lua/move_due.lua).
    let now_s = format!("{}.{:03}", now_ms.div_euclid(1000), now_ms.rem_euclid(1000));
    let mut p = redis::pipe();
    p.ignore_errors();
    p.cmd("XLEN").arg(&keys.stream);
    p.cmd("XINFO").arg("STREAM").arg(&keys.stream);
    p.cmd("XINFO").arg("GROUPS").arg(&keys.stream);
    p.cmd("XPENDING").arg(&keys.stream).arg(&keys.group);
    p.cmd("XINFO")
        .arg("CONSUMERS")
        .arg(&keys.stream)
        .arg(&keys.group);
    p.cmd("ZCARD").arg(&keys.pool);
    p.cmd("ZCOUNT").arg(&keys.pool).arg("-inf").arg(&now_s);
    p.cmd("ZCOUNT").arg(&keys.pool).arg("1e11").arg(now_ms);
    p.cmd("ZRANGEBYSCORE")
        .arg(&keys.pool)
        .arg("-inf")
        .arg(&now_s)
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(0)
        .arg(1);
    p.cmd("ZRANGEBYSCORE")
        .arg(&keys.pool)
        .arg("1e11")
        .arg(now_ms)
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(0)
        .arg(1);
    p.cmd("XLEN").arg(&keys.dead);
    p.cmd("XINFO").arg("STREAM").arg(&keys.dead);
    p.cmd("EVAL")
        .arg(COUNT_SINCE)
        .arg(1)
        .arg(&keys.dead)
        .arg(now_ms.saturating_sub(window_ms).max(0))
        .arg(DEAD_NEW_CAP);
    let r: Vec<Value> = p.query(con)?;
    let mut r = r.into_iter();
    let mut next = || r.next().unwrap_or(Value::Nil);

    let stream_len = uint(Some(&ok(next())?));
    let stream_info = absent_ok(next())?;
    let groups = absent_ok(next())?;
    let xpending = absent_ok(next())?;
    let xconsumers = absent_ok(next())?;
    let pool_size = uint(Some(&ok(next())?));
    let due_seconds = uint(Some(&ok(next())?)).unwrap_or(0);
    let due_ms = uint(Some(&ok(next())?)).unwrap_or(0);
    let first_secs = first_with_score(&ok(next())?, 1000.0);
    let first_ms = first_with_score(&ok(next())?, 1.0);
    let dead_len = uint(Some(&ok(next())?));
    let dead_info = absent_ok(next())?;
    let (dead_new, dead_lost) = counted(&ok(next())?);

    let stream = StreamFigures {
        key: keys.stream.clone(),
        length: stream_len.unwrap_or(0),
        entries_added: stream_info
            .as_ref()
            .and_then(|v| uint(field(&pairs(v), "entries-added"))),
    };

    let group_info = groups.as_ref().and_then(|g| match g {
        Value::Array(list) => list
            .iter()
            .map(pairs)
            .find(|p| field(p, "name").map(value_to_string).as_deref() == Some(&keys.group))
            .map(|p| (uint(field(&p, "lag")), uint(field(&p, "entries-read")))),
        _ => None,
    });
    let (pending, oldest_pending_id) = match &xpending {
        Some(Value::Array(s)) => (
            uint(s.first()).unwrap_or(0),
            s.get(1)
                .filter(|v| !matches!(v, Value::Nil))
                .map(value_to_string),
        ),
        _ => (0, None),
    };
    let group = GroupFigures {
        name: keys.group.clone(),
        exists: group_info.is_some(),
        lag: group_info.and_then(|g| g.0),
        entries_read: group_info.and_then(|g| g.1),
        pending,
        oldest_pending_age_ms: oldest_pending_id
            .as_deref()
            .and_then(id_ms)
            .map(|t| (now_ms - t).max(0)),
        oldest_pending_id,
    };

    let mut consumers: Vec<ConsumerFigures> = match &xconsumers {
        Some(Value::Array(list)) => list
            .iter()
            .map(|c| {
                let p = pairs(c);
                ConsumerFigures {
                    name: field(&p, "name").map(value_to_string).unwrap_or_default(),
                    pending: uint(field(&p, "pending")).unwrap_or(0),
                    idle_ms: uint(field(&p, "idle")).unwrap_or(0),
                    heartbeat: false,
                    without_database: false,
                }
            })
            .collect(),
        _ => Vec::new(),
    };

    // The member due longest, whichever kind of score it has.
    let oldest_due = match (first_secs, first_ms) {
        (Some(a), Some(b)) => Some(if a.1 <= b.1 { a } else { b }),
        (a, b) => a.or(b),
    };

    // Second round trip: what only the first one could name.
    let mut oldest_due_has_data = None;
    let mut workers = Vec::new();
    if !consumers.is_empty() || oldest_due.is_some() {
        let mut p = redis::pipe();
        for c in &consumers {
            p.cmd("GET").arg(keys.heartbeat(&c.name));
            p.cmd("EXISTS").arg(keys.without_database(&c.name));
        }
        if let Some((key, _)) = &oldest_due {
            // Whether it still is a member, asked after: a mover may move it (its data
            // with it) between the two round trips.
            p.cmd("HEXISTS").arg(&keys.data).arg(key);
            p.cmd("ZSCORE").arg(&keys.pool).arg(key);
        }
        let r: Vec<Value> = p.query(con)?;
        let mut r = r.iter();
        for c in &mut consumers {
            if let Some(record) = heartbeat(r.next()) {
                c.heartbeat = true;
                workers.push(WorkerHealth {
                    name: c.name.clone(),
                    record,
                });
            }
            c.without_database = matches!(r.next(), Some(Value::Int(1)));
        }
        if oldest_due.is_some() {
            let has_data = uint(r.next()).unwrap_or(0) > 0;
            let still_member = !matches!(r.next(), None | Some(Value::Nil));
            oldest_due_has_data = data_flag(has_data, still_member);
        }
    }

    let overdue_ms = oldest_due
        .as_ref()
        .map_or(0, |(_, at)| (now_ms - at).max(0));
    let pool = PoolFigures {
        key: keys.pool.clone(),
        size: pool_size.unwrap_or(0),
        due: due_seconds + due_ms,
        due_seconds,
        due_ms,
        mover_lag_ms: overdue_ms,
        readers_backlog_ms: 0,
        oldest_due_at_ms: oldest_due.as_ref().map(|(_, at)| *at),
        oldest_due_key: oldest_due.map(|(k, _)| k),
        oldest_due_has_data,
    };

    let dead_pairs = dead_info.as_ref().map(pairs).unwrap_or_default();
    let newest_dead_id = match field(&dead_pairs, "last-entry") {
        Some(Value::Array(e)) => e.first().map(value_to_string),
        _ => None,
    };
    let dead = DeadFigures {
        key: keys.dead.clone(),
        length: dead_len.unwrap_or(0),
        entries_added: uint(field(&dead_pairs, "entries-added")),
        new: dead_new,
        lost: dead_lost,
        window_ms,
        newest_age_ms: newest_dead_id
            .as_deref()
            .and_then(id_ms)
            .map(|t| (now_ms - t).max(0)),
    };

    let queues = gather_queues(con, keys, now_ms, window_ms, &mut workers)?;
    Ok(StatsReport {
        now_ms,
        stream,
        group,
        consumers,
        pool,
        dead,
        queues,
        legacy: Vec::new(),
        shards: Vec::new(),
        workers,
        by_event: None,
    })
}

/// A heartbeat key's value read with GET: `None` when the key does not exist (no live
/// worker), else the worker's record if it wrote one.
fn heartbeat(v: Option<&Value>) -> Option<Option<crate::health::Record>> {
    match v {
        Some(Value::BulkString(b)) => Some(crate::health::Record::parse(b)),
        Some(Value::SimpleString(s)) => Some(crate::health::Record::parse(s.as_bytes())),
        Some(Value::Int(_)) => Some(None),
        _ => None,
    }
}

/// A count script's `{count, lost}`.
fn counted(v: &Value) -> (u64, u64) {
    match v {
        Value::Array(items) => (
            uint(items.first()).unwrap_or(0),
            uint(items.get(1)).unwrap_or(0),
        ),
        other => (uint(Some(other)).unwrap_or(0), 0),
    }
}

/// Redis's clock (unix ms) on the server of the first shard's pool: the one clock the
/// figures are read against, so that no host's own clock makes a lag or an age.
pub fn redis_now_ms(con: &mut dyn redis::ConnectionLike, config: &Config) -> RedisResult<i64> {
    let key = config
        .derived
        .shards
        .first()
        .map(|k| k.pool.clone())
        .unwrap_or_default();
    crate::store::server_time_us(con, &key)
        .map(|us| us.div_euclid(1000))
        .map_err(|e| match e {
            crate::store::StoreError::Connection { source, .. }
            | crate::store::StoreError::Moving { source, .. }
            | crate::store::StoreError::Refused { source, .. } => source,
            other => RedisError::from((redis::ErrorKind::Client, "TIME", other.to_string())),
        })
}

/// Whether the oldest due member has its data, from `HEXISTS` and then `ZSCORE`: a member
/// no longer in the pool was moved (with its data) in between, and says nothing.
fn data_flag(has_data: bool, still_member: bool) -> Option<bool> {
    (has_data || still_member).then_some(has_data)
}

/// Whether a stream whose group has `lag` entries no reader has taken holds its mover back
/// (`--move-ahead`, `ahead`): the mover moves a whole batch whenever one fits under the
/// bound, so from half of it on the due members in the pool wait for the readers.
fn readers_behind(lag: Option<u64>, ahead: usize) -> bool {
    ahead > 0 && lag.is_some_and(|l| l > 0 && l as usize >= ahead.div_ceil(2))
}

/// The `--move-ahead` the live movers published (`health::Record::move_ahead`), else
/// `own` (this command's flag): unbounded (0) if any mover is, else the largest bound, up
/// to which some mover still moves.
fn movers_ahead(workers: &[WorkerHealth], own: usize) -> usize {
    let published: Vec<usize> = workers
        .iter()
        .filter_map(|w| w.record.as_ref()?.move_ahead)
        .collect();
    if published.contains(&0) {
        0
    } else {
        published.into_iter().max().unwrap_or(own)
    }
}

/// A shard's report with its due members counted as the readers' backlog instead of the
/// mover's lag while its stream holds the mover back ([`readers_behind`]), against the
/// live movers' bound ([`movers_ahead`]).
fn held_for_readers(mut r: StatsReport, own: usize) -> StatsReport {
    let ahead = movers_ahead(&r.workers, own);
    if readers_behind(r.group.lag, ahead) {
        r.pool.readers_backlog_ms = r.pool.mover_lag_ms;
        r.pool.mover_lag_ms = 0;
    }
    r
}

/// [`gather`], and every `--legacy-pool` of `config` (one more pipelined round trip when
/// there are any): their mover lag counts in the report's, so a mover that stopped shows
/// whichever pool it leaves behind.
pub fn gather_all(
    con: &mut dyn redis::ConnectionLike,
    config: &Config,
    now_ms: i64,
    dead_window: Duration,
) -> RedisResult<StatsReport> {
    let shards = &config.derived.shards;
    let ahead = config.mover.ahead;
    let mut report = if shards.len() > 1 {
        let each = shards
            .iter()
            .map(|k| gather(con, k, now_ms, dead_window).map(|r| held_for_readers(r, ahead)))
            .collect::<RedisResult<Vec<_>>>()?;
        StatsReport::total(each)
    } else {
        held_for_readers(gather(con, &config.keys, now_ms, dead_window)?, ahead)
    };
    let pools = &config.mover.legacy;
    if pools.is_empty() {
        return Ok(report);
    }
    let now_s = format!("{}.{:03}", now_ms.div_euclid(1000), now_ms.rem_euclid(1000));
    let mut p = redis::pipe();
    for l in pools {
        p.cmd("ZCARD").arg(&l.key);
        p.cmd("ZCOUNT").arg(&l.key).arg("-inf").arg(&now_s);
        p.cmd("ZCOUNT").arg(&l.key).arg("1e11").arg(now_ms);
        // The oldest seconds score, then the oldest millisecond score (seconds scores sort
        // first, so each kind is looked up in its own range).
        p.cmd("ZRANGEBYSCORE")
            .arg(&l.key)
            .arg("-inf")
            .arg("(1e11")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(1);
        p.cmd("ZRANGEBYSCORE")
            .arg(&l.key)
            .arg("1e11")
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(1);
    }
    let replies: Vec<Value> = p.query(con)?;
    for (l, r) in pools.iter().zip(replies.chunks(5)) {
        let n = |v: &Value| redis::from_redis_value::<u64>(v.clone()).unwrap_or(0);
        let first_due_ms = |v: &Value, seconds: bool| -> Option<i64> {
            let (_, score): (String, f64) =
                redis::from_redis_value::<Vec<(String, f64)>>(v.clone())
                    .ok()?
                    .into_iter()
                    .next()?;
            Some(if seconds {
                (score * 1000.0) as i64
            } else {
                score as i64
            })
        };
        let lag = [first_due_ms(&r[3], true), first_due_ms(&r[4], false)]
            .into_iter()
            .flatten()
            .map(|due| now_ms - due)
            .max()
            .unwrap_or(0)
            .max(0);
        if readers_behind(report.group.lag, movers_ahead(&report.workers, ahead)) {
            report.pool.readers_backlog_ms = report.pool.readers_backlog_ms.max(lag);
        } else {
            report.pool.mover_lag_ms = report.pool.mover_lag_ms.max(lag);
        }
        report.legacy.push(LegacyFigures {
            key: l.key.clone(),
            size: n(&r[0]),
            due: n(&r[1]) + n(&r[2]),
            mover_lag_ms: lag,
        });
    }
    Ok(report)
}

/// List mode's figures: two round trips (the consumers, then every length at once).
fn gather_queues(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    now_ms: i64,
    window_ms: i64,
    workers: &mut Vec<WorkerHealth>,
) -> RedisResult<Vec<QueueFigures>> {
    if keys.queues.is_empty() {
        return Ok(Vec::new());
    }
    let mut consumers: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&keys.list_consumers)
        .query(con)?;
    consumers.sort();
    let mut p = redis::pipe();
    for q in &keys.queues {
        p.cmd("LLEN").arg(&q.name);
        p.cmd("LLEN").arg(&q.dead);
        // The tail is the oldest: consumers take from the right.
        p.cmd("LINDEX").arg(&q.name).arg(-1);
        p.cmd("EVAL")
            .arg(COUNT_LIST_SINCE)
            .arg(1)
            .arg(&q.dead)
            .arg(now_ms.saturating_sub(window_ms).div_euclid(1000))
            .arg(LIST_DEAD_NEW_CAP)
            .arg(LIST_DEAD_CLOCK_SLACK_S);
        for c in &consumers {
            p.cmd("LLEN").arg(q.processing(c));
        }
    }
    // The list consumers' heartbeats (their health records), unless stream consumers
    // were read already.
    let read_heartbeats = workers.is_empty();
    if read_heartbeats {
        for c in &consumers {
            p.cmd("GET").arg(keys.heartbeat(c));
        }
    }
    let r: Vec<Value> = p.query(con)?;
    let mut r = r.into_iter();
    let mut next = || r.next().unwrap_or(Value::Nil);
    let queues = keys
        .queues
        .iter()
        .map(|q| {
            let length = uint(Some(&next())).unwrap_or(0);
            let dead = uint(Some(&next())).unwrap_or(0);
            let (oldest_age_ms, oldest_unknown) = match next() {
                Value::BulkString(b) => match waiting_since_ms(&b, q.raw_event.is_some()) {
                    Ok(since) => (Some((now_ms - since).max(0)), None),
                    Err(why) => (None, Some(why)),
                },
                _ => (None, None),
            };
            let (dead_new, dead_lost) = counted(&next());
            let processing = consumers
                .iter()
                .map(|c| (c.clone(), uint(Some(&next())).unwrap_or(0)))
                .collect();
            QueueFigures {
                name: q.name.clone(),
                length,
                processing,
                dead,
                dead_new,
                dead_lost,
                oldest_age_ms,
                oldest_unknown,
            }
        })
        .collect();
    if read_heartbeats {
        for c in &consumers {
            if let Some(record) = heartbeat(Some(&next())) {
                workers.push(WorkerHealth {
                    name: c.clone(),
                    record,
                });
            }
        }
    }
    Ok(queues)
}

/// A pipelined reply, or its error.
fn ok(v: Value) -> RedisResult<Value> {
    match v {
        Value::ServerError(e) => Err(RedisError::from(e)),
        v => Ok(v),
    }
}

/// Like [`ok`], but "no such key" (XINFO on a missing stream) and NOGROUP (XPENDING or
/// XINFO CONSUMERS before the group exists) are `None`: nothing there yet.
fn absent_ok(v: Value) -> RedisResult<Option<Value>> {
    match v {
        Value::ServerError(e)
            if e.code() == "NOGROUP" || e.details().is_some_and(|d| d.contains("no such key")) =>
        {
            Ok(None)
        }
        v => ok(v).map(Some),
    }
}

/// The member and due time (unix ms) of a `ZRANGEBYSCORE .. WITHSCORES LIMIT 0 1` reply;
/// `scale` turns the score into milliseconds.
fn first_with_score(v: &Value, scale: f64) -> Option<(String, i64)> {
    let Value::Array(items) = v else { return None };
    let member = value_to_string(items.first()?);
    let score: f64 = match items.get(1)? {
        Value::Double(d) => *d,
        other => value_to_string(other).parse().ok()?,
    };
    // `as` saturates: a score of -inf or 1e300 becomes a very old or far due time, not UB.
    Some((member, (score * scale) as i64))
}

/// Throughput between two reports, per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rates {
    /// Entries added to the stream: what the mover moved (plus direct XADDs).
    pub moved: f64,
    /// Entries acknowledged: growth of entries-read minus pending (`None` when Redis
    /// cannot tell entries-read).
    pub acked: Option<f64>,
    /// Dead letters added.
    pub dead: f64,
}

/// Rates between `prev` and `cur`; `None` when no time passed.
pub fn rates(prev: &StatsReport, cur: &StatsReport) -> Option<Rates> {
    let secs = (cur.now_ms - prev.now_ms) as f64 / 1000.0;
    if secs <= 0.0 {
        return None;
    }
    // The counters that never shrink where the server has them; lengths otherwise
    // (trimming and purging shrink those, hence the clamp at zero).
    let grew = |a: Option<u64>, b: Option<u64>, la: u64, lb: u64| match (a, b) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => lb.saturating_sub(la),
    } as f64
        / secs;
    let acked = |r: &StatsReport| {
        r.group
            .entries_read
            .map(|n| n as i64 - r.group.pending as i64)
    };
    Some(Rates {
        moved: grew(
            prev.stream.entries_added,
            cur.stream.entries_added,
            prev.stream.length,
            cur.stream.length,
        ),
        acked: match (acked(prev), acked(cur)) {
            (Some(a), Some(b)) => Some((b - a).max(0) as f64 / secs),
            _ => None,
        },
        dead: grew(
            prev.dead.entries_added,
            cur.dead.entries_added,
            prev.dead.length,
            cur.dead.length,
        ),
    })
}

/// The worker's keys that exist with another type than the one it keeps there (a stray
/// `SET` by hand, a name clash): the worker stops moving, reading or settling what needs
/// them, so the check is CRITICAL, naming each. With `--shards N` every shard's keys are
/// looked at, and each one found says its shard. Read only (TYPE).
pub fn wrong_types(
    con: &mut dyn redis::ConnectionLike,
    config: &Config,
) -> redis::RedisResult<Vec<String>> {
    let k = &config.keys;
    let shards = &config.derived.shards;
    let sharded = shards.len() > 1;
    // (key, type wanted, its shard when sharded)
    let mut want: Vec<(&str, &str, Option<usize>)> = Vec::new();
    for (i, s) in shards.iter().enumerate() {
        let shard = sharded.then_some(i);
        want.push((&s.pool, "zset", shard));
        want.push((&s.data, "hash", shard));
        want.push((&s.stream, "stream", shard));
        want.push((&s.dead, "stream", shard));
    }
    for q in &k.queues {
        want.push((&q.name, "list", None));
        want.push((&q.dead, "list", None));
    }
    for l in &config.mover.legacy {
        want.push((&l.key, "zset", None));
    }
    let mut p = redis::pipe();
    for (key, _, _) in &want {
        p.cmd("TYPE").arg(*key);
    }
    let found: Vec<String> = p.query(con)?;
    Ok(want
        .iter()
        .zip(found)
        .filter(|((_, w, _), f)| f != "none" && f != w)
        .map(|((key, w, shard), f)| match shard {
            Some(i) => format!("key {key:?} (shard {i}) holds a {f}, not a {w}"),
            None => format!("key {key:?} holds a {f}, not a {w}"),
        })
        .collect())
}

/// The field/value pairs of an XINFO reply: a flat array in RESP2, a map in RESP3.
fn pairs(v: &Value) -> Vec<(String, &Value)> {
    match v {
        Value::Array(kv) => kv
            .chunks_exact(2)
            .map(|c| (value_to_string(&c[0]), &c[1]))
            .collect(),
        Value::Map(kv) => kv.iter().map(|(k, v)| (value_to_string(k), v)).collect(),
        _ => Vec::new(),
    }
}

fn field<'a>(pairs: &'a [(String, &'a Value)], name: &str) -> Option<&'a Value> {
    pairs.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
}

/// A non-negative integer reply; `None` for nil (XINFO's "cannot tell") or anything else.
fn uint(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_moved_between_the_two_reads_is_not_flagged_as_without_data() {
        // HEXISTS, then ZSCORE.
        assert_eq!(data_flag(true, true), Some(true));
        assert_eq!(data_flag(false, true), Some(false));
        // Gone from the pool by the second read: moved with its data, not an orphan.
        assert_eq!(data_flag(false, false), None);
        assert_eq!(data_flag(true, false), Some(true));
    }

    #[test]
    fn the_readers_hold_the_mover_back_from_half_of_the_bound() {
        // The bound the live movers published wins over this command's own: unbounded if
        // any mover is, else the largest; the command's own without any record of one.
        let w = |name: &str, ahead: Option<usize>| WorkerHealth {
            name: name.into(),
            record: Some(crate::health::Record {
                at_ms: 0,
                host: "h".into(),
                pid: 1,
                version: "0".into(),
                clock_offset_ms: None,
                clock_error_ms: None,
                producer_ahead: 0,
                producer_lead_max_ms: 0,
                problems: Vec::new(),
                events: Vec::new(),
                move_ahead: ahead,
            }),
        };
        let old = WorkerHealth {
            name: "old".into(),
            record: None,
        };
        assert_eq!(movers_ahead(&[], 5_000), 5_000);
        assert_eq!(movers_ahead(&[old.clone(), w("a", None)], 5_000), 5_000);
        assert_eq!(
            movers_ahead(&[w("a", Some(20_000)), w("b", Some(8_000)), old], 5_000),
            20_000
        );
        assert_eq!(
            movers_ahead(&[w("a", Some(20_000)), w("b", Some(0))], 5_000),
            0
        );
        assert!(!readers_behind(Some(2_499), 5_000));
        assert!(readers_behind(Some(2_500), 5_000));
        assert!(!readers_behind(Some(5_000), 0));
        assert!(!readers_behind(None, 5_000));
        assert!(!readers_behind(Some(0), 1));
    }
}
