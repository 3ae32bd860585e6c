//! The one module that changes Redis state: every transition is one atomic Lua script
//! (`src/lua/`), or one single command, named after what it does.
//!
//! - [`pool`]: `push`, `cancel`, `move_due` (delay pool → stream or list queue);
//! - [`stream`]: the consumer group's reads, claims, takeover of dead consumers, `settle`
//!   of stream entries, the over-delivered to the dead letters, trimming;
//! - [`list`]: list mode's `fetch`, `settle` and the push-back of processing lists;
//! - [`dead`]: the operator's requeue and purge of dead letters;
//! - here: connections, heartbeats, [`settle`] of a mixed batch, and [`StoreError`].
//!
//! **Ack last.** Every script checks the types of the keys it writes before its first
//! write (Redis does not roll back a script that fails half-way), writes a message into
//! its next place first and removes it from where it was last. A failure anywhere leaves
//! the message where it was; running the same call again finishes the job. No message
//! over `--max-message-bytes` is ever returned to the worker: the scripts that read
//! messages dead-letter such a message inside Redis (a prefix, its length, a digest).
//!
//! Each script declares the keys it writes in `KEYS`, so it runs unchanged on Redis
//! Cluster once the key names share a hash tag (see `keys.rs`); legacy pools are the
//! exception (their STRING keys are named by the pool's members). Scripts are sent by SHA
//! (EVALSHA) and loaded on the first `NOSCRIPT`, so a call is one round trip.

pub mod dead;
pub mod link;
pub mod list;
pub mod pool;
pub mod stream;

use crate::delivery::{Origin, Settlement};
use crate::keys::Keys;
use redis::{ConnectionLike, RedisError, Value};
use std::time::Duration;

pub use link::{Con, Redis, Topology, CONNECT_TIMEOUT};
pub use pool::{cancel, move_due, push, At, MoveReport, Pool, Target, LOST_DATA};

/// A script of `src/lua/`, with the shared prelude (type checks, the size screen) in
/// front of it.
macro_rules! script {
    ($file:literal) => {
        std::sync::LazyLock::new(|| {
            redis::Script::new(concat!(
                include_str!("../lua/prelude.lua"),
                include_str!(concat!("../lua/", $file))
            ))
        })
    };
}
pub(crate) use script;

/// Why a Redis state change did not happen. Built from redis-rs's error kind, never from
/// the text of a message.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The connection broke, timed out or was refused, the server is still loading, or a
    /// failover is under way (`READONLY`, `MASTERDOWN`, a group missing on a promoted
    /// replica): reconnect, start again and back off.
    #[error("{what}: {}", lost(.source))]
    Connection {
        what: &'static str,
        source: RedisError,
    },
    /// On a Redis Cluster, the hash slot of these keys is being resharded (`TRYAGAIN`:
    /// some of a script's keys have moved, the others not yet; `ASK`, `MOVED` after the
    /// client's own redirects) or has no master serving it (`CLUSTERDOWN`). It holds back
    /// only the key set of that slot (one shard): the connection is fine, the other shards
    /// go on, and this one is tried again after a short backoff. The code is in the text.
    #[error("{what}: its hash slot is moving or unserved ({code}): {source}")]
    Moving {
        what: &'static str,
        code: &'static str,
        source: RedisError,
    },
    /// A key holds another type than the one the worker keeps there. Nothing was
    /// written; an operator must rename or remove the key.
    #[error("{what}: key {key:?} holds a {found}, not a {wanted}; rename or remove it")]
    WrongType {
        what: &'static str,
        key: String,
        found: String,
        wanted: String,
    },
    /// Redis refused the command or the script failed (out of memory, no permission, a
    /// bug): the step wrote nothing it has not finished (ack last); it is tried again.
    #[error("{what}: redis refused: {source}")]
    Refused {
        what: &'static str,
        source: RedisError,
    },
}

impl StoreError {
    pub fn from_redis(what: &'static str, source: RedisError) -> StoreError {
        let moving = match source.kind() {
            redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain) => Some("TRYAGAIN"),
            redis::ErrorKind::Server(redis::ServerErrorKind::Ask) => Some("ASK"),
            redis::ErrorKind::Server(redis::ServerErrorKind::Moved) => Some("MOVED"),
            redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown) => Some("CLUSTERDOWN"),
            _ => None,
        };
        if let Some(code) = moving {
            return StoreError::Moving { what, code, source };
        }
        let lost = source.is_io_error()
            || source.is_connection_dropped()
            || source.is_connection_refusal()
            || source.is_timeout()
            || matches!(
                source.kind(),
                redis::ErrorKind::Server(
                    redis::ServerErrorKind::BusyLoading
                        // A failover: this node was demoted, or the cluster is moving.
                        | redis::ServerErrorKind::ReadOnly
                        | redis::ServerErrorKind::MasterDown
                )
            )
            // A promoted replica that never saw the group: start again, which creates it
            // (from the start of the stream, so nothing is skipped).
            || source.code() == Some("NOGROUP");
        if lost {
            StoreError::Connection { what, source }
        } else {
            StoreError::Refused { what, source }
        }
    }

    /// The connection is unusable: drop it and connect again.
    pub fn is_connection(&self) -> bool {
        matches!(self, StoreError::Connection { .. })
    }

    /// The key set's hash slot is moving or unserved: only that shard waits.
    pub fn is_moving(&self) -> bool {
        matches!(self, StoreError::Moving { .. })
    }

    /// The problem an operator must act on, for health checks; `None` for outages. A key
    /// of the wrong type, as a script names it or as Redis refuses a plain command on it.
    pub fn operator_problem(&self) -> Option<String> {
        match self {
            StoreError::WrongType { .. } => Some(self.to_string()),
            StoreError::Refused { source, .. } if source.code() == Some("WRONGTYPE") => {
                Some(format!("{self}; rename or remove the key"))
            }
            _ => None,
        }
    }

    /// A plain command's `WRONGTYPE` on `key` as [`StoreError::WrongType`], which names the
    /// key (Redis's refusal does not) and the type it holds (read with `TYPE`); any other
    /// error as it was.
    pub fn naming(self, con: &mut dyn ConnectionLike, key: &str, wanted: &str) -> StoreError {
        match self {
            StoreError::Refused { what, source } if source.code() == Some("WRONGTYPE") => {
                let found = redis::cmd("TYPE")
                    .arg(key)
                    .query::<String>(con)
                    .unwrap_or_else(|_| "value of another type".into());
                StoreError::WrongType {
                    what,
                    key: key.to_string(),
                    found,
                    wanted: wanted.to_string(),
                }
            }
            e => e,
        }
    }

    /// The consumer group is gone (the stream's key was removed, or a promoted replica
    /// never had it): a new start creates it, so there is no outage to wait out.
    pub fn is_group_missing(&self) -> bool {
        matches!(self, StoreError::Connection { source, .. } if source.code() == Some("NOGROUP"))
    }
}

/// Why a connection-class error sent the role back to connect and start again.
fn lost(source: &RedisError) -> String {
    if source.code() == Some("NOGROUP") {
        format!(
            "the consumer group is missing (its stream's key was removed, or a promoted \
             replica never had it); starting again makes it: {source}"
        )
    } else {
        format!("connection lost: {source}")
    }
}

/// A key that holds another type, as the scripts report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrongType {
    pub key: String,
    pub found: String,
    pub wanted: String,
}

impl WrongType {
    fn parse(v: &[Value]) -> Option<WrongType> {
        match v {
            [k, f, w, ..] => Some(WrongType {
                key: value_to_string(k),
                found: value_to_string(f),
                wanted: value_to_string(w),
            }),
            _ => None,
        }
    }

    /// `{key, found, wanted}` as a script returns it; `None` for `{}` or nothing.
    pub(crate) fn from_reply(v: Option<&Value>) -> Option<WrongType> {
        match v {
            Some(Value::Array(items)) => WrongType::parse(items),
            _ => None,
        }
    }

    pub fn into_error(self, what: &'static str) -> StoreError {
        StoreError::WrongType {
            what,
            key: self.key,
            found: self.found,
            wanted: self.wanted,
        }
    }
}

impl std::fmt::Display for WrongType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "key {:?} holds a {}, not a {}",
            self.key, self.found, self.wanted
        )
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// (job key or queue, reason) of each message a script sent to the dead letters itself.
pub type Buried = Vec<(String, String)>;

/// Runs a script invocation: a `{'WRONGTYPE', key, found, wanted}` reply becomes
/// [`StoreError::WrongType`], any other reply is returned.
pub(crate) fn run(
    what: &'static str,
    inv: &redis::ScriptInvocation<'_>,
    con: &mut dyn ConnectionLike,
) -> StoreResult<Value> {
    let v: Value = inv
        .invoke(con)
        .map_err(|e| StoreError::from_redis(what, e))?;
    checked(what, v)
}

/// A script's reply, or the [`StoreError::WrongType`] it stands for.
pub(crate) fn checked(what: &'static str, v: Value) -> StoreResult<Value> {
    if let Value::Array(items) = &v {
        if items.first().map(value_to_string).as_deref() == Some("WRONGTYPE") {
            let w = WrongType::parse(&items[1..]).unwrap_or(WrongType {
                key: String::new(),
                found: String::new(),
                wanted: String::new(),
            });
            return Err(w.into_error(what));
        }
    }
    Ok(v)
}

/// One single command, with its error classified.
pub(crate) fn query<T: redis::FromRedisValue>(
    what: &'static str,
    cmd: &redis::Cmd,
    con: &mut dyn ConnectionLike,
) -> StoreResult<T> {
    cmd.query(con).map_err(|e| StoreError::from_redis(what, e))
}

pub(crate) fn int(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::Int(n)) => *n,
        Some(other) => value_to_string(other).parse().unwrap_or(0),
        None => 0,
    }
}

/// `{key, reason, key, reason, ...}` of the messages a script sent to the dead letters.
pub(crate) fn pairs(v: Option<&Value>) -> Buried {
    let Some(Value::Array(items)) = v else {
        return Vec::new();
    };
    items
        .chunks(2)
        .map(|c| {
            (
                value_to_string(&c[0]),
                c.get(1).map(value_to_string).unwrap_or_default(),
            )
        })
        .collect()
}

/// What became of one settlement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// This call applied it: acknowledged, and the retry or dead letter written first.
    Applied,
    /// A retry whose job key was pushed again meanwhile: the newer push keeps the key, so
    /// this call wrote a dead letter ("retry superseded") instead, then acknowledged.
    Superseded,
    /// It was no longer pending: a peer settled it first (after a reclaim).
    AlreadySettled,
    /// Its destination key holds another type: it stays pending, nothing written.
    Blocked,
}

/// What one [`settle`] call did, in the order of the batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettleReport {
    pub each: Vec<Settled>,
    /// The key that blocked a settlement, if one did.
    pub blocked: Option<WrongType>,
    /// A shard whose hash slot is moving or unserved, if one was: its settlements are
    /// [`Settled::Blocked`] (left where they were, tried again), the other shards' done.
    pub moving: Option<String>,
}

impl SettleReport {
    pub fn applied(&self) -> usize {
        self.each
            .iter()
            .filter(|s| matches!(s, Settled::Applied | Settled::Superseded))
            .count()
    }

    /// Codes as the settle scripts return them (1, 0, -1), then the blocking key.
    fn extend_from(&mut self, reply: &[Value], n: usize) -> Vec<Settled> {
        let codes: Vec<Settled> = reply
            .iter()
            .take(n)
            .map(|v| match int(Some(v)) {
                1 => Settled::Applied,
                2 => Settled::Superseded,
                -1 => Settled::Blocked,
                _ => Settled::AlreadySettled,
            })
            .collect();
        if self.blocked.is_none() {
            self.blocked = WrongType::parse(reply.get(n..).unwrap_or(&[]));
        }
        codes
    }
}

static COUNT_STARTS: std::sync::LazyLock<redis::Script> = script!("count_starts.lua");

/// The field of a queue's deliveries HASH that counts the starts of a list message's job
/// (see [`Keys::starts`]).
pub fn started_field(msg: &[u8]) -> String {
    format!("started:{}", sha1_smol::Sha1::from(msg).digest())
}

/// The field that counts the starts of `d`'s job in its HASH (see [`Keys::starts`]): its
/// stream entry's id, or a list message's [`started_field`].
pub fn starts_field(d: &crate::delivery::Delivery) -> String {
    match &d.origin {
        Origin::Stream { id } => id.clone(),
        Origin::List { .. } => started_field(&d.msg),
    }
}

/// The HASH and field that count the starts of `d`'s job (see [`Keys::starts`]), and its
/// shard; `None` for a list message of a queue not configured.
fn starts_slot(shards: &[Keys], d: &crate::delivery::Delivery) -> Option<(usize, String, String)> {
    let shard = if d.shard < shards.len() { d.shard } else { 0 };
    let keys = &shards[shard];
    match &d.origin {
        Origin::Stream { .. } => Some((shard, keys.starts.clone(), starts_field(d))),
        Origin::List { queue } => keys
            .queues
            .get(*queue)
            .map(|q| (shard, q.deliveries(), starts_field(d))),
    }
}

/// Changes the count of starts of the job of each delivery by `delta` (see
/// [`Keys::starts`] and `lua/count_starts.lua`): `1` as their transaction begins, `-1` once
/// it has ended, `0` to read the counts. One round trip per shard. Returns each job's
/// count after the change, in order (`None`: not counted, its HASH of another type).
pub fn started(
    con: &mut dyn ConnectionLike,
    shards: &[Keys],
    deliveries: &[&crate::delivery::Delivery],
    delta: i64,
) -> StoreResult<Vec<Option<u64>>> {
    /// One shard's count: the HASHes it counts in, and (1-based index of its HASH, field,
    /// position of the delivery) of each job.
    struct Count {
        shard: usize,
        hashes: Vec<String>,
        fields: Vec<(usize, String, usize)>,
    }
    // One call per shard: a shard's keys share a hash slot, two shards' do not.
    let mut counts: Vec<Count> = Vec::new();
    for (at_d, d) in deliveries.iter().enumerate() {
        let Some((shard, hash, field)) = starts_slot(shards, d) else {
            continue;
        };
        let at = match counts.iter().position(|c| c.shard == shard) {
            Some(at) => at,
            None => {
                counts.push(Count {
                    shard,
                    hashes: Vec::new(),
                    fields: Vec::new(),
                });
                counts.len() - 1
            }
        };
        let c = &mut counts[at];
        let k = match c.hashes.iter().position(|h| *h == hash) {
            Some(k) => k,
            None => {
                c.hashes.push(hash);
                c.hashes.len() - 1
            }
        };
        c.fields.push((k + 1, field, at_d));
    }
    let mut out = vec![None; deliveries.len()];
    for c in counts {
        let mut inv = COUNT_STARTS.prepare_invoke();
        for h in &c.hashes {
            inv.key(h);
        }
        inv.arg(delta);
        for (k, f, _) in &c.fields {
            inv.arg(k).arg(f);
        }
        let reply = run("count the jobs started", &inv, con)?;
        let Value::Array(ns) = reply else { continue };
        for ((_, _, at_d), n) in c.fields.iter().zip(&ns) {
            out[*at_d] = u64::try_from(int(Some(n))).ok();
        }
    }
    Ok(out)
}

/// Applies a batch of outcomes, one script call per source kind (stream entries, list
/// messages). See [`SettleReport`] for what each settlement became.
pub fn settle(
    con: &mut dyn ConnectionLike,
    shards: &[Keys],
    consumer: &str,
    batch: &[Settlement],
) -> StoreResult<SettleReport> {
    type Part<'b> = Vec<(usize, &'b Settlement)>;
    let mut report = SettleReport {
        each: vec![Settled::AlreadySettled; batch.len()],
        blocked: None,
        moving: None,
    };
    // One script per shard and kind: a shard's keys share a hash slot, two shards' do not.
    let mut parts: Vec<(usize, bool, Part<'_>)> = Vec::new();
    for (i, s) in batch.iter().enumerate() {
        let is_stream = matches!(s.origin, Origin::Stream { .. });
        match parts
            .iter_mut()
            .find(|(shard, st, _)| *shard == s.shard && *st == is_stream)
        {
            Some((_, _, part)) => part.push((i, s)),
            None => parts.push((s.shard, is_stream, vec![(i, s)])),
        }
    }
    for (shard, is_stream, part) in parts {
        let keys = shards.get(shard).unwrap_or(&shards[0]);
        let items: Vec<&Settlement> = part.iter().map(|(_, s)| *s).collect();
        let reply = if is_stream {
            stream::settle(con, keys, consumer, &items)
        } else {
            list::settle(con, keys, consumer, &items)
        };
        let reply = match reply {
            Ok(r) => r,
            // One shard's slot moving holds back that shard's outcomes only.
            Err(e) if e.is_moving() && shards.len() > 1 => {
                for (i, _) in &part {
                    report.each[*i] = Settled::Blocked;
                }
                report.moving = Some(format!("shard {shard} ({}): {e}", keys.pool));
                continue;
            }
            Err(e) => return Err(e),
        };
        let codes = report.extend_from(&reply, items.len());
        for ((i, _), code) in part.iter().zip(codes) {
            report.each[*i] = code;
        }
    }
    Ok(report)
}

/// Refreshes a consumer's heartbeat key: peers take over its work once the key expires
/// (they ask only whether it exists). Its value is the process's health record
/// (`health.rs`), which the operator's tools read.
pub fn heartbeat(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    ttl: Duration,
    record: &str,
) -> StoreResult<()> {
    let mut cmd = redis::cmd("SET");
    cmd.arg(keys.heartbeat(consumer))
        .arg(record)
        .arg("PX")
        .arg(ttl.as_millis().max(1) as u64);
    query("heartbeat", &cmd, con)
}

/// Marks `consumer` as alive without a usable PostgreSQL (for `ttl`), so that a peer
/// with one takes over its pending entries; `false` takes the mark away.
pub fn mark_without_database(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    on: bool,
    ttl: Duration,
) -> StoreResult<()> {
    let key = keys.without_database(consumer);
    let cmd = if on {
        let mut c = redis::cmd("SET");
        c.arg(&key)
            .arg(1)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64);
        c
    } else {
        let mut c = redis::cmd("DEL");
        c.arg(&key);
        c
    };
    query("mark a consumer without a database", &cmd, con)
}

/// Redis's clock (`TIME`), unix microseconds, read on the server that holds `key` (on a
/// Redis Cluster, each master has its own clock and decides for its own slots).
pub fn server_time_us(con: &mut dyn ConnectionLike, key: &str) -> StoreResult<i64> {
    let mut inv = TIME.prepare_invoke();
    inv.key(key);
    let v = run("read the server's clock", &inv, con)?;
    let parts: Vec<i64> = match v {
        Value::Array(items) => items
            .iter()
            .map(|p| value_to_string(p).parse().unwrap_or(0))
            .collect(),
        _ => Vec::new(),
    };
    match parts.as_slice() {
        [s, us, ..] => Ok(s.saturating_mul(1_000_000).saturating_add(*us)),
        _ => Err(StoreError::Refused {
            what: "read the server's clock",
            source: RedisError::from((redis::ErrorKind::Parse, "TIME answered no time")),
        }),
    }
}

/// One round trip of [`server_time_us`] with this host's clock read on either side: what
/// `clock::Sample` measures the offset from.
pub fn clock_sample(con: &mut dyn ConnectionLike, key: &str) -> StoreResult<crate::clock::Sample> {
    let host_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or(0)
    };
    let before_us = host_us();
    let server_us = server_time_us(con, key)?;
    Ok(crate::clock::Sample {
        before_us,
        server_us,
        after_us: host_us(),
    })
}

/// What Redis says of its memory (`INFO memory`, read on the server that holds `key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Memory {
    /// `maxmemory-policy`: what Redis does when `maxmemory` is reached.
    pub policy: String,
    /// `maxmemory` in bytes (0: no limit).
    pub max: u64,
    /// `used_memory` in bytes.
    pub used: u64,
    /// `evicted_keys` of `INFO stats`: keys evicted since the server started or its last
    /// `CONFIG RESETSTAT` (`None`: an ACL user refused `INFO stats`).
    pub evicted: Option<u64>,
    /// `aof_enabled` of `INFO persistence`: whether Redis writes an append-only file
    /// (`None`: refused, as above).
    pub aof: Option<bool>,
    /// `run_id` of `INFO server`: changes when Redis restarts (and its counts with it).
    pub run_id: Option<String>,
}

impl Memory {
    /// Whether the policy may evict keys the worker keeps (its pool, data and streams have
    /// no TTL, so only the `allkeys-*` policies reach them; `volatile-*` evict only keys
    /// with a TTL, such as the heartbeats).
    pub fn evicts_data(&self) -> bool {
        self.policy.starts_with("allkeys-")
    }

    /// Keys this server has evicted (since it started or its last `CONFIG RESETSTAT`)
    /// that may have been the worker's: any, unless the policy now is a `volatile-*` one,
    /// which evicts only keys with a TTL (under `noeviction` a count above zero was evicted
    /// under an earlier policy, which may have been an `allkeys-*` one).
    pub fn evicted_data(&self) -> Option<u64> {
        self.evicted
            .filter(|n| *n > 0 && !self.policy.starts_with("volatile-"))
    }

    /// Used memory as a share of `maxmemory` (`None` without a limit).
    pub fn fill(&self) -> Option<f64> {
        (self.max > 0).then(|| self.used as f64 / self.max as f64)
    }
}

/// `INFO memory` of the server that holds `key`, with `evicted_keys` of `INFO stats`, from a
/// script (so that a Cluster routes it by the key, and an ACL user needs only
/// `+info|memory`, not `CONFIG GET`; `+info|stats` for the evictions).
pub fn memory(con: &mut dyn ConnectionLike, key: &str) -> StoreResult<Memory> {
    let mut inv = INFO_MEMORY.prepare_invoke();
    inv.key(key);
    let text = value_to_string(&run("read INFO memory", &inv, con)?);
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    Ok(Memory {
        policy: field("maxmemory_policy").unwrap_or_default(),
        max: field("maxmemory").and_then(|v| v.parse().ok()).unwrap_or(0),
        used: field("used_memory")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        evicted: field("evicted_keys").and_then(|v| v.parse().ok()),
        aof: field("aof_enabled").map(|v| v == "1"),
        run_id: field("run_id"),
    })
}

/// The two read-only scripts of [`server_time_us`] and [`memory`]: keyed, so a Cluster
/// sends them to the master of that key's slot.
static TAKE_SLOTS: std::sync::LazyLock<redis::Script> = script!("take_slots.lua");

/// Takes the slots of a share of jobs from the fleet's `--max-rate` schedules in `rates`
/// (`take_slots.lua`, on Redis's clock): how long until the jobs may run. A schedule is
/// one cap at one rate (`order.timeout@50000`: its interval in microseconds), so a cap
/// changed by a restart starts a schedule of its own rather than waiting out slots the
/// old rate spaced (an hour apart under `1/h`).
pub fn take_slots(
    con: &mut dyn ConnectionLike,
    rates: &str,
    burst: Duration,
    horizon: Duration,
    takes: &[crate::manners::SlotTake<'_>],
) -> StoreResult<Slots> {
    let mut inv = TAKE_SLOTS.prepare_invoke();
    inv.key(rates)
        .arg(burst.as_micros() as u64)
        .arg(horizon.as_micros() as u64);
    for t in takes {
        let interval = t.interval.as_micros().max(1) as u64;
        inv.arg(format!("{}@{interval}", t.cap))
            .arg(interval)
            .arg(t.n);
    }
    let reply = run("take --max-rate slots", &inv, con)?;
    // The script answers {booked, microseconds} (a key of the wrong type is an error).
    let v = match reply {
        Value::Array(v) => v,
        _ => Vec::new(),
    };
    let micros = Duration::from_micros(int(v.get(1)).max(0) as u64);
    Ok(if int(v.first()) == 1 {
        Slots::Booked(micros)
    } else {
        Slots::NotYet(micros)
    })
}

/// What [`take_slots`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slots {
    /// Booked: the jobs may run after this long (zero: now).
    Booked(Duration),
    /// Nothing booked, the slots being further off than the horizon: ask again after this.
    NotYet(Duration),
}

static TIME: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new("return redis.call('TIME')"));
static INFO_MEMORY: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    // `INFO stats`, `persistence` and `server` under pcall: an ACL user given only
    // `+info|memory` still has the policy watched.
    redis::Script::new(
        "local s = redis.pcall('INFO', 'stats') \
             if type(s) ~= 'string' then s = '' end \
             local p = redis.pcall('INFO', 'persistence') \
             if type(p) ~= 'string' then p = '' end \
             local v = redis.pcall('INFO', 'server') \
             if type(v) ~= 'string' then v = '' end \
             return redis.call('INFO', 'memory') .. '\\r\\n' .. s .. '\\r\\n' .. p .. '\\r\\n' .. v",
    )
});

/// Removes a consumer's heartbeat at shutdown, so peers take over whatever it still has
/// pending at once instead of after the heartbeat's expiry.
pub fn forget_heartbeat(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
) -> StoreResult<()> {
    let mut cmd = redis::cmd("DEL");
    cmd.arg(keys.heartbeat(consumer));
    query("forget heartbeat", &cmd, con)
}

/// Deletes keys outright. Only for keys nothing else owns: the benchmark's own queue
/// and scratch keys, before and after a scenario.
pub fn delete_keys(con: &mut dyn ConnectionLike, names: &[&str]) -> StoreResult<()> {
    let mut cmd = redis::cmd("DEL");
    cmd.arg(names);
    query("delete keys", &cmd, con)
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

/// Opens a connection whose reads and writes time out after `io_timeout`, so a Redis that
/// stops answering cannot hang a thread past shutdown.
pub fn connect_with(client: &Redis, io_timeout: Duration) -> redis::RedisResult<Con> {
    client.connect_with(io_timeout)
}

/// A connection for short commands (scripts, acks): 10 s I/O timeout.
pub fn connect(client: &Redis) -> redis::RedisResult<Con> {
    client.connect()
}

/// How the shards recorded in Redis (`<prefix>:shards`) compare with `--shards`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardLayout {
    /// They agree (or nothing is recorded and one shard is asked for).
    Agrees,
    /// Another count is recorded: every process of one queue must use the same one.
    Differs { recorded: usize },
    /// More than one shard is asked for while the unsharded pool still holds jobs.
    UnshardedJobs { pool: String, jobs: u64 },
}

/// Checks `n` shards against the count recorded under `base.shard_count`. With `claim`,
/// records `n` when nothing is recorded yet (a worker's start, a push), so that a later
/// process with another count is refused. One shard with nothing recorded writes nothing:
/// the unsharded layout is the default.
pub fn check_shards(
    con: &mut dyn ConnectionLike,
    base: &Keys,
    n: usize,
    claim: bool,
) -> StoreResult<ShardLayout> {
    let get = |con: &mut dyn ConnectionLike| -> StoreResult<Option<usize>> {
        let v: Option<String> = redis::cmd("GET")
            .arg(&base.shard_count)
            .query(con)
            .map_err(|e| StoreError::from_redis("read the shard count", e))?;
        Ok(v.and_then(|v| v.trim().parse().ok()))
    };
    let recorded = get(con)?;
    match recorded {
        Some(r) if r == n => return Ok(ShardLayout::Agrees),
        Some(r) => return Ok(ShardLayout::Differs { recorded: r }),
        None if n == 1 => return Ok(ShardLayout::Agrees),
        None => {}
    }
    let jobs: u64 = redis::cmd("ZCARD")
        .arg(&base.pool)
        .query(con)
        .or_else(|e| {
            if e.code() == Some("WRONGTYPE") {
                Ok(0)
            } else {
                Err(e)
            }
        })
        .map_err(|e| StoreError::from_redis("count the unsharded pool", e))?;
    if jobs > 0 {
        return Ok(ShardLayout::UnshardedJobs {
            pool: base.pool.clone(),
            jobs,
        });
    }
    // Entries of the unsharded stream not delivered yet, or delivered and not acknowledged.
    let groups: redis::RedisResult<Vec<std::collections::HashMap<String, Value>>> =
        redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&base.stream)
            .query(con);
    let waiting: u64 = match groups {
        Ok(groups) => groups
            .iter()
            .map(|g| {
                let n = |f: &str| {
                    g.get(f)
                        .and_then(|v| redis::from_redis_value::<u64>(v.clone()).ok())
                        .unwrap_or(0)
                };
                n("pending") + n("lag")
            })
            .sum(),
        Err(e) if e.code() == Some("WRONGTYPE") || e.to_string().contains("no such key") => 0,
        Err(e) => return Err(StoreError::from_redis("read the unsharded stream", e)),
    };
    if waiting > 0 {
        return Ok(ShardLayout::UnshardedJobs {
            pool: base.stream.clone(),
            jobs: waiting,
        });
    }
    if !claim {
        return Ok(ShardLayout::Agrees);
    }
    let set: Option<String> = redis::cmd("SET")
        .arg(&base.shard_count)
        .arg(n)
        .arg("NX")
        .query(con)
        .map_err(|e| StoreError::from_redis("record the shard count", e))?;
    if set.is_some() {
        return Ok(ShardLayout::Agrees);
    }
    // Another process recorded a count first.
    match get(con)? {
        Some(r) if r != n => Ok(ShardLayout::Differs { recorded: r }),
        _ => Ok(ShardLayout::Agrees),
    }
}
