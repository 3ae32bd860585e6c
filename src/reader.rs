//! The reader thread: stream entries into the bounded channel of the worker pool.
//!
//! Owns one Redis connection and the channel's only `Sender`. Each step reads with
//! XREADGROUP under a stable consumer name, never more entries than the channel has room
//! for (back-pressure: when it is full the reader waits for a worker to free a slot).
//! At start it first re-delivers its own pending entries (a restarted process recovers its
//! work at once). Every `block` it also does maintenance: refreshes its heartbeat key, takes
//! over at once the entries of consumers whose heartbeat expired (dead hosts), dead-letters
//! entries delivered more than `max_deliveries` times, and reclaims entries idle longer than
//! `claim_idle` (XAUTOCLAIM, which also drops pending entries whose stream entry is gone).
//!
//! Stops within one block timeout of shutdown by returning, which drops the `Sender`: the
//! workers drain what the channel holds and then see it disconnected.

use crate::backoff::Backoff;
use crate::config::ReaderConfig;
use crate::delivery::{Origin, Outcome, Settlement};
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store::{self, value_to_string};
use crossbeam_channel::{Receiver, Sender};
use redis::{Connection, RedisResult, Value};
use std::time::{Duration, Instant};

pub use crate::delivery::Delivery;

/// The pool's end of the channel, as a reader sees it. Owns the only `Sender`: dropping the
/// feed tells the workers there is no more work.
pub struct Feed<'a> {
    tx: Sender<Delivery>,
    /// A worker sends one token after taking a job, waking a reader that waits for room.
    space: Receiver<()>,
    capacity: usize,
    stats: &'a Stats,
}

impl<'a> Feed<'a> {
    pub fn new(tx: Sender<Delivery>, space: Receiver<()>, stats: &'a Stats) -> Feed<'a> {
        let capacity = tx.capacity().unwrap_or(1).max(1);
        Feed {
            tx,
            space,
            capacity,
            stats,
        }
    }

    /// How many deliveries the channel can take now.
    pub fn room(&self) -> usize {
        self.capacity.saturating_sub(self.tx.len())
    }

    /// Waits until a worker takes a job, at most `d`.
    pub fn wait_for_room(&self, d: Duration) {
        let _ = self.space.recv_timeout(d);
        // Every successful reader step ends here or in `send`: the watchdog's sign of life.
        Stats::beat(&self.stats.reader_beat_ms);
    }

    pub fn send(&self, entries: Vec<Delivery>) -> Result<usize, StepError> {
        Stats::beat(&self.stats.reader_beat_ms);
        let n = entries.len();
        for d in entries {
            self.tx.send(d).map_err(|_| StepError::PoolGone)?;
        }
        Stats::add(&self.stats.delivered, n as u64);
        Ok(n)
    }
}

/// Whether a periodic task is due (never run, or last run `every` ago); stamps it if so.
pub(crate) fn due(last: &mut Option<Instant>, every: Duration) -> bool {
    if last.is_some_and(|t| t.elapsed() < every) {
        return false;
    }
    *last = Some(Instant::now());
    true
}

/// Refreshes a consumer's heartbeat key: peers take over its work once the key expires.
pub fn heartbeat(
    con: &mut Connection,
    keys: &Keys,
    consumer: &str,
    ttl: Duration,
) -> RedisResult<()> {
    redis::cmd("SET")
        .arg(keys.heartbeat(consumer))
        .arg(crate::now_ms())
        .arg("PX")
        .arg(ttl.as_millis() as u64)
        .query::<()>(con)
}

pub struct Reader<'a> {
    keys: &'a Keys,
    cfg: &'a ReaderConfig,
    consumer: &'a str,
    stats: &'a Stats,
    feed: Feed<'a>,
    autoclaim_cursor: String,
    last_maintenance: Option<Instant>,
    last_trim: Option<Instant>,
}

/// Why a reader step stopped.
#[derive(Debug)]
pub enum StepError {
    /// Reconnect and back off.
    Redis(redis::RedisError),
    /// The channel's receivers are gone: the pool has stopped, so must the reader.
    PoolGone,
}

impl From<redis::RedisError> for StepError {
    fn from(e: redis::RedisError) -> Self {
        StepError::Redis(e)
    }
}

impl<'a> Reader<'a> {
    pub fn new(
        keys: &'a Keys,
        cfg: &'a ReaderConfig,
        consumer: &'a str,
        stats: &'a Stats,
        feed: Feed<'a>,
    ) -> Self {
        Reader {
            keys,
            cfg,
            consumer,
            stats,
            feed,
            autoclaim_cursor: "0-0".to_string(),
            last_maintenance: None,
            last_trim: None,
        }
    }

    /// Creates the group (from the start of the stream, so nothing written before the
    /// first worker ever started is skipped) and the stream if missing.
    pub fn ensure_group(con: &mut Connection, keys: &Keys) -> RedisResult<()> {
        let r: RedisResult<Value> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&keys.stream)
            .arg(&keys.group)
            .arg("0")
            .arg("MKSTREAM")
            .query(con);
        match r {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn room(&self) -> usize {
        self.feed.room()
    }

    fn send(&self, entries: Vec<Delivery>) -> Result<usize, StepError> {
        self.feed.send(entries)
    }

    fn heartbeat(&self, con: &mut Connection) -> RedisResult<()> {
        heartbeat(con, self.keys, self.consumer, self.cfg.heartbeat_ttl)
    }

    /// Start-up: group, heartbeat, then this consumer's own pending entries (left by a
    /// previous run of the same name), re-delivered before anything new.
    pub fn start(&mut self, con: &mut Connection, shutdown: &Shutdown) -> Result<usize, StepError> {
        Self::ensure_group(con, self.keys)?;
        self.heartbeat(con)?;
        self.dead_letter_overdelivered(con, 0, Some(self.consumer))?;
        let mut cursor = "0".to_string();
        let mut total = 0;
        while !shutdown.is_set() {
            let room = self.room();
            if room == 0 {
                self.feed.wait_for_room(self.cfg.block);
                self.heartbeat(con)?;
                continue;
            }
            let entries = self.xreadgroup(con, room, None, &cursor)?;
            let Some(last) = entries.last().and_then(Delivery::stream_id) else {
                break;
            };
            cursor = last.to_string();
            total += self.send(entries)?;
        }
        if total > 0 {
            log::info!("reader: re-delivered {total} entries left pending by a previous run of consumer {:?}", self.consumer);
        }
        Ok(total)
    }

    /// One step: maintenance when due, then one read of at most the channel's free room,
    /// blocking at most `block`. Returns how many entries it handed to the pool.
    pub fn poll(&mut self, con: &mut Connection) -> Result<usize, StepError> {
        let mut n = 0;
        if due(&mut self.last_maintenance, self.cfg.block) {
            n += self.maintain(con)?;
        }
        let room = self.room();
        if room == 0 {
            // Back-pressure: wait for a worker to take a job (or the block timeout).
            self.feed.wait_for_room(self.cfg.block);
            return Ok(n);
        }
        let entries = self.xreadgroup(con, room, Some(self.cfg.block), ">")?;
        n += self.send(entries)?;
        Ok(n)
    }

    /// Heartbeat, dead consumers, over-delivered entries, idle entries; in that order, so
    /// an entry over the delivery limit is dead-lettered rather than reclaimed once more.
    pub fn maintain(&mut self, con: &mut Connection) -> Result<usize, StepError> {
        self.heartbeat(con)?;
        let mut n = self.take_over_dead_consumers(con)?;
        self.dead_letter_overdelivered(con, self.cfg.claim_idle.as_millis() as u64, None)?;
        n += self.autoclaim(con)?;
        if due(&mut self.last_trim, TRIM_EVERY) {
            trim_acknowledged(con, self.keys, self.cfg.retention, crate::now_ms())?;
        }
        Ok(n)
    }

    fn xreadgroup(
        &self,
        con: &mut Connection,
        count: usize,
        block: Option<Duration>,
        id: &str,
    ) -> RedisResult<Vec<Delivery>> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.keys.group)
            .arg(self.consumer)
            .arg("COUNT")
            .arg(count);
        if let Some(b) = block {
            cmd.arg("BLOCK").arg(b.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(&self.keys.stream).arg(id);
        let reply: Value = cmd.query(con)?;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        if let Value::Array(streams) = reply {
            for s in streams {
                if let Value::Array(mut parts) = s {
                    if parts.len() == 2 {
                        parse_entries(parts.pop().unwrap_or(Value::Nil), &mut out, &mut gone);
                    }
                }
            }
        }
        if !gone.is_empty() {
            // Pending entries whose stream entry was deleted (trimmed): nothing to do.
            self.ack_ids(con, &gone)?;
        }
        Ok(out)
    }

    fn ack_ids(&self, con: &mut Connection, ids: &[String]) -> RedisResult<()> {
        log::warn!(
            "reader: {} pending entries no longer exist in the stream; cleared",
            ids.len()
        );
        redis::cmd("XACK")
            .arg(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(ids)
            .query::<()>(con)
    }

    /// Entries pending on consumers whose heartbeat key has expired are claimed at once.
    fn take_over_dead_consumers(&self, con: &mut Connection) -> Result<usize, StepError> {
        let consumers = consumers(con, self.keys)?;
        let others: Vec<_> = consumers
            .into_iter()
            .filter(|c| c.name != self.consumer)
            .collect();
        if others.is_empty() {
            return Ok(0);
        }
        let mut pipe = redis::pipe();
        for c in &others {
            pipe.cmd("EXISTS").arg(self.keys.heartbeat(&c.name));
        }
        let alive: Vec<bool> = pipe.query(con)?;
        let mut total = 0;
        for (c, alive) in others.iter().zip(alive) {
            if alive {
                continue;
            }
            if c.pending == 0 {
                // Gone and owing nothing: forget it (XREADGROUP recreates it if it returns).
                if c.idle_ms > self.cfg.claim_idle.as_millis() as u64 {
                    redis::cmd("XGROUP")
                        .arg("DELCONSUMER")
                        .arg(&self.keys.stream)
                        .arg(&self.keys.group)
                        .arg(&c.name)
                        .query::<()>(con)?;
                }
                continue;
            }
            let room = self.room();
            if room == 0 {
                break;
            }
            let ids: Vec<String> = pending(con, self.keys, 0, room, Some(&c.name))?
                .into_iter()
                .map(|p| p.id)
                .collect();
            if ids.is_empty() {
                continue;
            }
            // MIN-IDLE 1000: if a peer claimed the same entries a moment ago their idle
            // time was reset, and this claim skips them instead of stealing them back.
            let entries = self.xclaim(con, 1000, &ids)?;
            log::warn!(
                "reader: consumer {:?} has no heartbeat; took over {} of its {} pending entries",
                c.name,
                entries.len(),
                c.pending
            );
            Stats::add(&self.stats.reclaimed, entries.len() as u64);
            total += self.send(entries)?;
        }
        Ok(total)
    }

    fn xclaim(
        &self,
        con: &mut Connection,
        min_idle: u64,
        ids: &[String],
    ) -> RedisResult<Vec<Delivery>> {
        let reply: Value = redis::cmd("XCLAIM")
            .arg(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(self.consumer)
            .arg(min_idle)
            .arg(ids)
            .query(con)?;
        let mut out = Vec::new();
        let mut gone = Vec::new();
        parse_entries(reply, &mut out, &mut gone);
        Ok(out)
    }

    /// Entries delivered more than `max_deliveries` times (and idle at least `min_idle`
    /// ms) go to the dead letters: a message that keeps killing its consumer must not
    /// circle for ever.
    fn dead_letter_overdelivered(
        &self,
        con: &mut Connection,
        min_idle: u64,
        consumer: Option<&str>,
    ) -> Result<usize, StepError> {
        let over: Vec<PendingEntry> = pending(con, self.keys, min_idle, 500, consumer)?
            .into_iter()
            .filter(|p| p.deliveries > self.cfg.max_deliveries)
            .collect();
        if over.is_empty() {
            return Ok(0);
        }
        let ids: Vec<String> = over.iter().map(|p| p.id.clone()).collect();
        let entries = self.xclaim(con, 0, &ids)?;
        let batch: Vec<Settlement> = entries
            .into_iter()
            .map(|d| {
                let count = over
                    .iter()
                    .find(|p| d.stream_id() == Some(p.id.as_str()))
                    .map_or(0, |p| p.deliveries);
                let event = crate::workers::event_of(&d.msg);
                let reason = format!(
                    "delivered {count} times without being acknowledged (limit {})",
                    self.cfg.max_deliveries
                );
                Settlement::new(
                    d,
                    Outcome::Dead {
                        reason,
                        event,
                        attempts: count,
                    },
                )
            })
            .collect();
        let n = store::settle(
            con,
            self.keys,
            self.consumer,
            crate::now_ms() / 1000,
            &batch,
        )?;
        if n > 0 {
            log::warn!("reader: {n} entries dead-lettered after too many deliveries");
            Stats::add(&self.stats.dead, n as u64);
        }
        Ok(n)
    }

    /// XAUTOCLAIM entries idle longer than `claim_idle` on any consumer, as many as the
    /// channel has room for. Continues from where the last pass stopped.
    fn autoclaim(&mut self, con: &mut Connection) -> Result<usize, StepError> {
        let room = self.room();
        if room == 0 {
            return Ok(0);
        }
        let reply: Value = redis::cmd("XAUTOCLAIM")
            .arg(&self.keys.stream)
            .arg(&self.keys.group)
            .arg(self.consumer)
            .arg(self.cfg.claim_idle.as_millis() as u64)
            .arg(&self.autoclaim_cursor)
            .arg("COUNT")
            .arg(room)
            .query(con)?;
        let Value::Array(mut parts) = reply else {
            return Ok(0);
        };
        if parts.len() < 2 {
            return Ok(0);
        }
        let deleted = if parts.len() >= 3 { parts.pop() } else { None };
        let entries = parts.pop().unwrap_or(Value::Nil);
        self.autoclaim_cursor = value_to_string(&parts[0]);
        if let Some(Value::Array(d)) = deleted {
            if !d.is_empty() {
                log::warn!(
                    "reader: {} pending entries no longer exist in the stream; cleared",
                    d.len()
                );
            }
        }
        let mut out = Vec::new();
        let mut gone = Vec::new();
        parse_entries(entries, &mut out, &mut gone);
        if !out.is_empty() {
            log::warn!(
                "reader: reclaimed {} entries idle for over {}s",
                out.len(),
                self.cfg.claim_idle.as_secs()
            );
            Stats::add(&self.stats.reclaimed, out.len() as u64);
        }
        self.send(out)
    }
}

/// What the reader thread runs on: the stream ([`Reader`]) or the list queues
/// (`list::ListReader`). Both hand deliveries to the same pool.
pub trait Source {
    /// For log lines.
    fn role(&self) -> &'static str;
    /// Socket timeout: longer than the longest blocking read.
    fn io_timeout(&self) -> Duration;
    /// Start-up (and after a lost connection): take back this consumer's own pending work.
    fn start(&mut self, con: &mut Connection, shutdown: &Shutdown) -> Result<usize, StepError>;
    /// One step: maintenance when due, then one bounded, blocking read.
    fn poll(&mut self, con: &mut Connection) -> Result<usize, StepError>;
}

impl Source for Reader<'_> {
    fn role(&self) -> &'static str {
        "reader"
    }
    fn io_timeout(&self) -> Duration {
        // XREADGROUP blocks up to `block`; the socket must wait longer than that.
        self.cfg.block + Duration::from_secs(5)
    }
    fn start(&mut self, con: &mut Connection, shutdown: &Shutdown) -> Result<usize, StepError> {
        Reader::start(self, con, shutdown)
    }
    fn poll(&mut self, con: &mut Connection) -> Result<usize, StepError> {
        Reader::poll(self, con)
    }
}

/// The reader thread body: start-up recovery, then `poll` until shutdown. Redis errors back
/// off (capped, with jitter) and reconnect; the outage is logged once. Returning drops the
/// source and with it the channel's `Sender`.
pub fn run(mut source: impl Source, client: &redis::Client, stats: &Stats, shutdown: &Shutdown) {
    let role = source.role();
    let mut backoff = Backoff::new(role);
    let mut con: Option<Connection> = None;
    let mut started = false;
    while !shutdown.is_set() {
        let c = match con.as_mut() {
            Some(c) => c,
            None => match store::connect_with(client, source.io_timeout()) {
                Ok(c) => con.insert(c),
                Err(e) => {
                    stats.redis_failure(&backoff);
                    backoff.fail("cannot connect to redis", &e, shutdown);
                    continue;
                }
            },
        };
        let step = if started {
            source.poll(c)
        } else {
            source.start(c, shutdown).inspect(|_| started = true)
        };
        match step {
            Ok(_) => backoff.reset(),
            Err(StepError::PoolGone) => break,
            Err(StepError::Redis(e)) => {
                con = None;
                // A read whose reply was lost with the connection left messages pending on
                // us that no worker holds: take our pending work back after reconnecting,
                // as at start. Messages still in the pool come twice; the inbox and the
                // guarded settle scripts make that harmless.
                started = false;
                stats.redis_failure(&backoff);
                backoff.fail("read failed", &e, shutdown);
            }
        }
    }
    log::info!("{role}: stopped");
}

/// Parses an array of `[id, [field, value, ...]]` entries. Entries whose body is nil
/// (deleted while pending) go to `gone`.
fn parse_entries(v: Value, out: &mut Vec<Delivery>, gone: &mut Vec<String>) {
    let Value::Array(entries) = v else { return };
    for e in entries {
        let Value::Array(mut pair) = e else { continue };
        if pair.len() != 2 {
            continue;
        }
        let body = pair.pop().unwrap_or(Value::Nil);
        let id = value_to_string(&pair[0]);
        let Value::Array(fields) = body else {
            gone.push(id);
            continue;
        };
        let mut key = None;
        let mut due_ms = None;
        let mut msg = Vec::new();
        let mut it = fields.into_iter();
        while let (Some(f), Some(v)) = (it.next(), it.next()) {
            let bytes = match v {
                Value::BulkString(b) => b,
                other => value_to_string(&other).into_bytes(),
            };
            match value_to_string(&f).as_str() {
                "msg" => msg = bytes,
                "key" => key = Some(bytes),
                "due" => {
                    due_ms = std::str::from_utf8(&bytes)
                        .ok()
                        .and_then(|s| s.parse().ok())
                }
                _ => {}
            }
        }
        out.push(Delivery {
            key: key.unwrap_or_else(|| id.clone().into_bytes()),
            origin: Origin::Stream { id },
            msg,
            due_ms,
            received: Instant::now(),
        });
    }
}

/// How often the reader trims the stream; retention is counted in hours, so once a minute
/// is plenty.
const TRIM_EVERY: Duration = Duration::from_secs(60);

/// Trims acknowledged entries older than `retention` from the stream: XTRIM MINID to the
/// oldest of (now - retention, every group's oldest pending entry, every group's first
/// undelivered entry). So an entry still pending or not yet read by any group is never
/// trimmed. Exact trimming costs more than `~`, but this runs once a minute and `~` would
/// keep a small stream whole. Returns the entries removed.
pub fn trim_acknowledged(
    con: &mut Connection,
    keys: &Keys,
    retention: Duration,
    now_ms: i64,
) -> RedisResult<u64> {
    if retention.is_zero() {
        return Ok(0);
    }
    let mut bound = StreamId::ms(now_ms - retention.as_millis() as i64);
    let groups: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&keys.stream)
        .query(con)?;
    let Value::Array(groups) = groups else {
        return Ok(0);
    };
    for g in groups {
        let fields = kv_fields(g);
        let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        let name = get("name").map(value_to_string).unwrap_or_default();
        // Entries after last-delivered-id have not been read by this group yet.
        if let Some(last) = get("last-delivered-id").map(value_to_string) {
            bound = bound.min(StreamId::parse(&last).next());
        }
        let summary: Value = redis::cmd("XPENDING")
            .arg(&keys.stream)
            .arg(&name)
            .query(con)?;
        if let Value::Array(s) = summary {
            if let Some(oldest) = s.get(1).map(value_to_string).filter(|s| !s.is_empty()) {
                bound = bound.min(StreamId::parse(&oldest));
            }
        }
    }
    let removed: u64 = redis::cmd("XTRIM")
        .arg(&keys.stream)
        .arg("MINID")
        .arg(bound.to_string())
        .query(con)?;
    if removed > 0 {
        log::info!(
            "reader: trimmed {removed} acknowledged stream entries older than the retention"
        );
    }
    Ok(removed)
}

/// A stream entry id `ms-seq`, ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct StreamId(u64, u64);

impl StreamId {
    fn ms(ms: i64) -> StreamId {
        StreamId(ms.max(0) as u64, 0)
    }
    fn parse(s: &str) -> StreamId {
        let (a, b) = s.split_once('-').unwrap_or((s, "0"));
        StreamId(a.parse().unwrap_or(0), b.parse().unwrap_or(0))
    }
    fn next(self) -> StreamId {
        StreamId(self.0, self.1.saturating_add(1))
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// The field/value pairs of an XINFO reply entry (RESP2 flat array or RESP3 map).
fn kv_fields(v: Value) -> Vec<(String, Value)> {
    match v {
        Value::Array(kv) => {
            let mut out = Vec::new();
            let mut it = kv.into_iter();
            while let (Some(k), Some(val)) = (it.next(), it.next()) {
                out.push((value_to_string(&k), val));
            }
            out
        }
        Value::Map(kv) => kv
            .into_iter()
            .map(|(k, v)| (value_to_string(&k), v))
            .collect(),
        _ => Vec::new(),
    }
}

/// One consumer of the group, from XINFO CONSUMERS.
#[derive(Debug, Clone)]
pub struct ConsumerInfo {
    pub name: String,
    pub pending: u64,
    pub idle_ms: u64,
}

pub fn consumers(con: &mut Connection, keys: &Keys) -> RedisResult<Vec<ConsumerInfo>> {
    let reply: Value = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(&keys.stream)
        .arg(&keys.group)
        .query(con)?;
    let Value::Array(list) = reply else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for c in list {
        let fields = kv_fields(c);
        if fields.is_empty() {
            continue;
        }
        let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        let int = |name: &str| match get(name) {
            Some(Value::Int(n)) => *n as u64,
            _ => 0,
        };
        out.push(ConsumerInfo {
            name: get("name").map(value_to_string).unwrap_or_default(),
            pending: int("pending"),
            idle_ms: int("idle"),
        });
    }
    Ok(out)
}

/// One pending entry, from the extended form of XPENDING.
#[derive(Debug, Clone)]
pub struct PendingEntry {
    pub id: String,
    pub consumer: String,
    pub idle_ms: u64,
    pub deliveries: u64,
}

pub fn pending(
    con: &mut Connection,
    keys: &Keys,
    min_idle_ms: u64,
    count: usize,
    consumer: Option<&str>,
) -> RedisResult<Vec<PendingEntry>> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(&keys.stream).arg(&keys.group);
    if min_idle_ms > 0 {
        cmd.arg("IDLE").arg(min_idle_ms);
    }
    cmd.arg("-").arg("+").arg(count);
    if let Some(c) = consumer {
        cmd.arg(c);
    }
    let reply: Value = cmd.query(con)?;
    let Value::Array(list) = reply else {
        return Ok(Vec::new());
    };
    Ok(list
        .into_iter()
        .filter_map(|e| match e {
            Value::Array(f) if f.len() >= 4 => {
                let int = |v: &Value| match v {
                    Value::Int(n) => *n as u64,
                    _ => 0,
                };
                Some(PendingEntry {
                    id: value_to_string(&f[0]),
                    consumer: value_to_string(&f[1]),
                    idle_ms: int(&f[2]),
                    deliveries: int(&f[3]),
                })
            }
            _ => None,
        })
        .collect())
}
