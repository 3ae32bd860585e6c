//! The events stream and its consumer group: reads, claims, takeover, settle, trimming.
//!
//! Every read that hands messages to the worker runs inside a script that screens them
//! first (gone entries acknowledged, oversized ones dead-lettered in Redis), so the
//! worker never holds a message over `--max-message-bytes`.

use super::{
    int, pairs, query, run, script, value_to_string, Buried, StoreError, StoreResult, WrongType,
};
use crate::delivery::{Delivery, Origin, Outcome, Settlement};
use crate::keys::Keys;
use redis::{ConnectionLike, Script, Value};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

static READ: LazyLock<Script> = script!("read_stream.lua");
static CLAIM_IDS: LazyLock<Script> = script!("claim_ids.lua");
static AUTOCLAIM: LazyLock<Script> = script!("autoclaim.lua");
static TAKE_OVER: LazyLock<Script> = script!("take_over.lua");
static BURY: LazyLock<Script> = script!("bury_overdelivered.lua");
static SETTLE: LazyLock<Script> = script!("settle.lua");
static KEEP_CLAIMED: LazyLock<Script> = script!("keep_claimed.lua");
static FORGIVE: LazyLock<Script> = script!("forgive.lua");

/// Most ids one takeover call moves (the caller loops until the peer owes nothing).
pub const TAKE_OVER_BATCH: usize = 1000;

/// What a screened read handed over.
#[derive(Debug, Default)]
pub struct Read {
    pub deliveries: Vec<Delivery>,
    /// Pending entries whose stream entry was gone (trimmed or deleted): acknowledged.
    pub gone: usize,
    /// Entries sent to the dead letters instead (job key, reason): over the size limit.
    pub buried: Vec<(String, String)>,
    /// The dead-letter key, when it holds another type: oversized entries stay pending,
    /// undelivered, until it is fixed.
    pub blocked: Option<WrongType>,
}

/// The settings every read of this consumer shares.
#[derive(Debug, Clone, Copy)]
pub struct Reading<'a> {
    pub keys: &'a Keys,
    pub consumer: &'a str,
    pub max_bytes: usize,
}

impl Reading<'_> {
    fn invocation<'s>(&self, script: &'s Script) -> redis::ScriptInvocation<'s> {
        let mut inv = script.prepare_invoke();
        inv.key(&self.keys.stream)
            .key(&self.keys.dead)
            .key(&self.keys.moved)
            .key(&self.keys.letters)
            .key(&self.keys.starts)
            .arg(&self.keys.group)
            .arg(self.consumer);
        inv
    }
}

fn screened(reply: Value) -> Read {
    let Value::Array(mut parts) = reply else {
        return Read::default();
    };
    let mut deliveries = Vec::new();
    // Taken, not cloned: the entries are most of the reply.
    let entries = parts.get_mut(1).map(|v| std::mem::replace(v, Value::Nil));
    parse_entries(entries.unwrap_or(Value::Nil), &mut deliveries);
    Read {
        deliveries,
        gone: int(parts.first()) as usize,
        buried: pairs(parts.get(2)),
        blocked: WrongType::from_reply(parts.get(3)),
    }
}

/// Creates the group (from the start of the stream, so nothing written before the first
/// worker ever started is skipped) and the stream if missing.
pub fn ensure_group(con: &mut dyn ConnectionLike, keys: &Keys) -> StoreResult<()> {
    let mut cmd = redis::cmd("XGROUP");
    cmd.arg("CREATE")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg("0")
        .arg("MKSTREAM");
    match query::<Value>("create the consumer group", &cmd, con) {
        Ok(_) => Ok(()),
        Err(StoreError::Refused { source, .. }) if source.code() == Some("BUSYGROUP") => Ok(()),
        // The stream's key holds something else: the operator's to rename or remove.
        Err(e) => Err(e.naming(con, &keys.stream, "stream")),
    }
}

/// Reads up to `count` entries: new ones (`from` = `>`), or this consumer's own pending
/// entries after the id `from`. Never blocks.
pub fn read(
    con: &mut dyn ConnectionLike,
    r: Reading<'_>,
    count: usize,
    from: &str,
) -> StoreResult<Read> {
    let mut inv = r.invocation(&READ);
    inv.arg(count).arg(from).arg(r.max_bytes);
    Ok(screened(run("read the stream", &inv, con)?))
}

/// Delivers entries this consumer already owns (taken over from a dead peer), by id.
pub fn claim_ids(
    con: &mut dyn ConnectionLike,
    r: Reading<'_>,
    ids: &[String],
) -> StoreResult<Read> {
    if ids.is_empty() {
        return Ok(Read::default());
    }
    let mut inv = r.invocation(&CLAIM_IDS);
    inv.arg(r.max_bytes);
    for id in ids {
        inv.arg(id);
    }
    Ok(screened(run("deliver taken-over entries", &inv, con)?))
}

/// XAUTOCLAIM: up to `count` entries idle longer than `min_idle` on any consumer, from
/// `cursor`. Returns the read and the next cursor.
pub fn autoclaim(
    con: &mut dyn ConnectionLike,
    r: Reading<'_>,
    min_idle: Duration,
    cursor: &str,
    count: usize,
) -> StoreResult<(Read, String)> {
    let mut inv = r.invocation(&AUTOCLAIM);
    inv.arg(min_idle.as_millis() as u64)
        .arg(cursor)
        .arg(count)
        .arg(r.max_bytes);
    let reply = run("reclaim idle entries", &inv, con)?;
    let next = match &reply {
        Value::Array(parts) => parts.get(4).map(value_to_string),
        _ => None,
    };
    Ok((screened(reply), next.unwrap_or_else(|| "0-0".to_string())))
}

/// Starts the idle time of entries `consumer` holds again (XCLAIM to itself, JUSTID: no
/// content read, no delivery counted): entries a worker keeps waiting for their
/// `--max-rate` slots, so that no reader takes them back as a stuck consumer's. Only those
/// it still owns: one a peer took over meanwhile (this process was stopped past its
/// heartbeat, or had no usable PostgreSQL) stays the peer's. Returns the ids claimed
/// again: those `consumer` still owns.
pub fn keep_claimed(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    ids: &[&str],
) -> StoreResult<Vec<String>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut inv = KEEP_CLAIMED.prepare_invoke();
    inv.key(&keys.stream).arg(&keys.group).arg(consumer);
    for id in ids {
        inv.arg(*id);
    }
    Ok(match run("keep held entries claimed", &inv, con)? {
        Value::Array(ids) => ids.iter().map(value_to_string).collect(),
        _ => Vec::new(),
    })
}

/// Entries taken over from a peer by [`take_over`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenOver {
    /// The ids now owned by the caller; fewer than [`TAKE_OVER_BATCH`]: the peer owes
    /// nothing more (a dead one has been forgotten by the group).
    pub ids: Vec<String>,
    /// The peer is alive, but has had no usable PostgreSQL for a while
    /// ([`Keys::without_database`]); otherwise its heartbeat was gone.
    pub without_database: bool,
}

/// Moves pending entries of `peer` to `consumer`, at most [`TAKE_OVER_BATCH`] per call,
/// without reading them: if the peer's heartbeat is gone and `usable.now` says this
/// consumer has a usable PostgreSQL, or if the peer has marked itself as having none and
/// `usable.settled` says this consumer has had one for a while. `None` if the peer keeps
/// its work.
pub fn take_over(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    peer: &str,
    usable: crate::source::Usable,
) -> StoreResult<Option<TakenOver>> {
    let mut inv = TAKE_OVER.prepare_invoke();
    inv.key(&keys.stream)
        .key(keys.heartbeat(peer))
        .key(keys.without_database(peer))
        .arg(&keys.group)
        .arg(consumer)
        .arg(peer)
        .arg(TAKE_OVER_BATCH)
        .arg(if usable.settled { "1" } else { "0" })
        .arg(if usable.now { "1" } else { "0" });
    let Value::Array(reply) = run("take over a consumer's entries", &inv, con)? else {
        return Ok(Some(TakenOver {
            ids: Vec::new(),
            without_database: false,
        }));
    };
    if int(reply.first()) < 0 {
        return Ok(None);
    }
    Ok(Some(TakenOver {
        without_database: int(reply.get(1)) == 1,
        ids: reply.iter().skip(2).map(value_to_string).collect(),
    }))
}

/// At a graceful stop: this consumer's delivery of each entry it still has pending is
/// taken off the entry's delivery count (the stop's drain ran what it would: the rest were
/// read and never run, so a restart does not count toward `--max-deliveries`). Returns how
/// many entries that was.
pub fn forgive_left(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
) -> StoreResult<usize> {
    let mut from = "-".to_string();
    let mut total = 0;
    loop {
        let mut inv = FORGIVE.prepare_invoke();
        inv.key(&keys.stream)
            .arg(&keys.group)
            .arg(consumer)
            .arg(TAKE_OVER_BATCH)
            .arg(&from);
        let Value::Array(reply) = run("forgive the entries left at the stop", &inv, con)? else {
            return Ok(total);
        };
        let n = int(reply.first()).max(0) as usize;
        total += n;
        if n < TAKE_OVER_BATCH {
            return Ok(total);
        }
        from = format!("({}", reply.get(1).map(value_to_string).unwrap_or_default());
    }
}

/// Which entries to look at for [`overdelivered`] and [`bury_overdelivered`]: delivered
/// more than `max_deliveries` times, idle at least `min_idle`, only `only`'s when given,
/// among the first `scan` pending entries.
#[derive(Debug, Clone, Copy)]
pub struct OverDelivered<'a> {
    pub only: Option<&'a str>,
    pub min_idle: Duration,
    pub max_deliveries: u64,
    pub scan: usize,
}

/// An entry delivered more than the limit, named by [`overdelivered`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    /// Its job key (the entry id when it has none).
    pub key: Vec<u8>,
    /// Its message; empty when over the size limit or gone from the stream.
    pub msg: Vec<u8>,
    pub deliveries: u64,
}

/// What becomes of a [`Candidate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Its job's inbox row is there: it is acknowledged.
    Done,
    /// It goes to the dead letters.
    Dead,
}

fn over_invocation<'s>(
    r: Reading<'_>,
    o: OverDelivered<'_>,
    step: &str,
) -> redis::ScriptInvocation<'s> {
    let mut inv = BURY.prepare_invoke();
    inv.key(&r.keys.stream)
        .key(&r.keys.dead)
        .key(&r.keys.moved)
        .key(&r.keys.letters)
        .key(&r.keys.starts)
        .arg(&r.keys.group)
        .arg(o.only.unwrap_or(""))
        .arg(o.min_idle.as_millis() as u64)
        .arg(o.max_deliveries)
        .arg(r.max_bytes)
        .arg(o.scan)
        .arg(r.consumer)
        .arg(step);
    inv
}

/// What [`overdelivered`] found.
#[derive(Debug, Default)]
pub struct Looked {
    /// Entries whose job started as often as the limit: left as they are, for the caller
    /// to look their jobs up in the inbox.
    pub candidates: Vec<Candidate>,
    /// The dead-letter key, when it holds another type (then none can be buried).
    pub blocked: Option<WrongType>,
    /// Entries delivered more often than the limit whose job started less often (held
    /// unrun by processes killed meanwhile): their delivery counts set back to their starts.
    pub forgiven: usize,
}

/// The entries delivered more than the limit (see `lua/bury_overdelivered.lua`).
pub fn overdelivered(
    con: &mut dyn ConnectionLike,
    r: Reading<'_>,
    o: OverDelivered<'_>,
) -> StoreResult<Looked> {
    let what = "look at over-delivered entries";
    let Value::Array(reply) = run(what, &over_invocation(r, o, "look"), con)? else {
        return Ok(Looked::default());
    };
    let blocked = WrongType::from_reply(reply.get(1));
    let forgiven = int(reply.get(2)).max(0) as usize;
    let Some(Value::Array(found)) = reply.first() else {
        return Ok(Looked {
            blocked,
            forgiven,
            ..Looked::default()
        });
    };
    let bytes = |v: Option<&Value>| match v {
        Some(Value::BulkString(b)) => b.clone(),
        _ => Vec::new(),
    };
    let candidates = found
        .iter()
        .filter_map(|c| match c {
            Value::Array(f) => Some(Candidate {
                id: f.first().map(value_to_string).unwrap_or_default(),
                key: bytes(f.get(1)),
                msg: bytes(f.get(2)),
                deliveries: int(f.get(3)).max(0) as u64,
            }),
            _ => None,
        })
        .collect();
    Ok(Looked {
        candidates,
        blocked,
        forgiven,
    })
}

/// What [`bury_overdelivered`] did.
#[derive(Debug, Default)]
pub struct OverOutcome {
    /// (job key, reason) of each entry sent to the dead letters.
    pub buried: Buried,
    /// Entries acknowledged as done (their job had committed).
    pub done: usize,
    /// The dead-letter key, when it holds another type (then nothing is buried).
    pub blocked: Option<WrongType>,
}

/// Settles entries [`overdelivered`] named, by the caller's verdicts, inside Redis: those
/// done acknowledged, the others sent to the dead letters; one no longer over-delivered
/// and pending as `o` says (settled or claimed meanwhile) is left alone.
pub fn bury_overdelivered(
    con: &mut dyn ConnectionLike,
    r: Reading<'_>,
    o: OverDelivered<'_>,
    verdicts: &[(String, Verdict)],
) -> StoreResult<OverOutcome> {
    if verdicts.is_empty() {
        return Ok(OverOutcome::default());
    }
    let mut inv = over_invocation(r, o, "settle");
    for (id, v) in verdicts {
        inv.arg(id).arg(match v {
            Verdict::Done => "done",
            Verdict::Dead => "dead",
        });
    }
    let Value::Array(reply) = run("dead-letter over-delivered entries", &inv, con)? else {
        return Ok(OverOutcome::default());
    };
    Ok(OverOutcome {
        buried: pairs(reply.get(1)),
        blocked: WrongType::from_reply(reply.get(2)),
        done: int(reply.get(3)).max(0) as usize,
    })
}

/// The settle script for stream entries (see `lua/settle.lua`); the raw reply, parsed by
/// `store::settle`.
pub(super) fn settle(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    batch: &[&Settlement],
) -> StoreResult<Vec<Value>> {
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&keys.stream)
        .key(&keys.pool)
        .key(&keys.data)
        .key(&keys.dead)
        .key(&keys.jobs)
        .key(&keys.moved)
        .key(&keys.letters)
        .key(&keys.starts)
        .arg(&keys.group)
        .arg(consumer);
    for s in batch {
        let id = match &s.origin {
            Origin::Stream { id } => id.as_str(),
            Origin::List { .. } => "",
        };
        match &s.outcome {
            Outcome::Ack => inv
                .arg("A")
                .arg(id)
                .arg(s.key.as_slice())
                .arg("")
                .arg("")
                .arg("")
                .arg(0),
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
    match run("settle", &inv, con)? {
        Value::Array(v) => Ok(v),
        _ => Ok(Vec::new()),
    }
}

/// Parses an array of `[id, [field, value, ...]]` entries into deliveries.
fn parse_entries(v: Value, out: &mut Vec<Delivery>) {
    let Value::Array(entries) = v else { return };
    for e in entries {
        let Value::Array(mut pair) = e else { continue };
        if pair.len() != 2 {
            continue;
        }
        let body = pair.pop().unwrap_or(Value::Nil);
        let id = value_to_string(&pair[0]);
        let Value::Array(fields) = body else {
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
            let name: &[u8] = match &f {
                Value::BulkString(b) => b,
                _ => &[],
            };
            match name {
                b"msg" => msg = bytes,
                b"key" => key = Some(bytes),
                b"due" => {
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
            shard: 0,
            holder_gone: false,
            redelivered: false,
        });
    }
}

/// Trims acknowledged entries older than `retention` from the stream: XTRIM MINID to the
/// oldest of (now - retention, every group's oldest pending entry, every group's first
/// undelivered entry). So an entry still pending or not yet read by any group is never
/// trimmed. The bound is read first and trimmed to in one command: entries are only ever
/// appended after it and pending entries never move back, so it stays safe in between.
/// Exact trimming costs more than `~`, but this runs once a minute and `~` would keep a
/// small stream whole. Returns the entries removed.
pub fn trim_acknowledged(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    retention: Duration,
    now_ms: i64,
) -> StoreResult<u64> {
    if retention.is_zero() {
        return Ok(0);
    }
    let mut bound = StreamId::ms(now_ms - retention.as_millis() as i64);
    let mut cmd = redis::cmd("XINFO");
    cmd.arg("GROUPS").arg(&keys.stream);
    for g in xinfo("trim: groups", &cmd, &keys.stream, con)? {
        let fields = kv_fields(g);
        let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        let name = get("name").map(value_to_string).unwrap_or_default();
        // Entries after last-delivered-id have not been read by this group yet.
        if let Some(last) = get("last-delivered-id").map(value_to_string) {
            bound = bound.min(StreamId::parse(&last).next());
        }
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(&keys.stream).arg(&name);
        if let Value::Array(s) = query::<Value>("trim: pending", &cmd, con)? {
            if let Some(oldest) = s.get(1).map(value_to_string).filter(|s| !s.is_empty()) {
                bound = bound.min(StreamId::parse(&oldest));
            }
        }
    }
    let mut cmd = redis::cmd("XTRIM");
    cmd.arg(&keys.stream).arg("MINID").arg(bound.to_string());
    query("trim", &cmd, con)
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
pub fn kv_fields(v: Value) -> Vec<(String, Value)> {
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

/// An `XINFO` listing; empty for a stream whose key does not exist (removed, not yet
/// written again): it has no groups and no consumers.
fn xinfo(
    what: &'static str,
    cmd: &redis::Cmd,
    stream: &str,
    con: &mut dyn ConnectionLike,
) -> StoreResult<Vec<Value>> {
    match query::<Value>(what, cmd, con) {
        Ok(Value::Array(list)) => Ok(list),
        Ok(_) => Ok(Vec::new()),
        Err(StoreError::Refused { source, .. })
            if source.detail().is_some_and(|d| d.contains("no such key")) =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(e.naming(con, stream, "stream")),
    }
}

/// The group's consumers (read only).
pub fn consumers(con: &mut dyn ConnectionLike, keys: &Keys) -> StoreResult<Vec<ConsumerInfo>> {
    let mut cmd = redis::cmd("XINFO");
    cmd.arg("CONSUMERS").arg(&keys.stream).arg(&keys.group);
    // No stream: no consumers. The read that follows meets NOGROUP, and the reader's
    // start makes the stream and the group again.
    let mut out = Vec::new();
    for c in xinfo("list consumers", &cmd, &keys.stream, con)? {
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

/// Pending entries of the group (read only), of one consumer when given.
pub fn pending(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    min_idle_ms: u64,
    count: usize,
    consumer: Option<&str>,
) -> StoreResult<Vec<PendingEntry>> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(&keys.stream).arg(&keys.group);
    if min_idle_ms > 0 {
        cmd.arg("IDLE").arg(min_idle_ms);
    }
    cmd.arg("-").arg("+").arg(count);
    if let Some(c) = consumer {
        cmd.arg(c);
    }
    let reply = query::<Value>("list pending entries", &cmd, con);
    let Value::Array(list) = reply.map_err(|e| e.naming(con, &keys.stream, "stream"))? else {
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
/// The millisecond part of a stream id: when the entry was added.
pub fn id_ms(id: &str) -> Option<i64> {
    id.split('-').next()?.parse().ok()
}

/// A stream id as XRANGE takes it: `<ms>` or `<ms>-<seq>`, each part digits that fit in
/// 64 bits (Redis refuses a larger one).
pub fn is_stream_id(s: &str) -> bool {
    let mut parts = s.split('-');
    let digits = |p: Option<&str>| {
        p.is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u64>().is_ok())
    };
    digits(parts.next()) && parts.next().is_none_or(|p| digits(Some(p))) && parts.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids() {
        assert_eq!(id_ms("1768764300123-4"), Some(1_768_764_300_123));
        assert!(is_stream_id("1768764300123-4"));
        assert!(is_stream_id("1768764300123"));
        assert!(is_stream_id("18446744073709551615-18446744073709551615"));
        for bad in [
            "",
            "-",
            "1-",
            "-1",
            "a-1",
            "1-2-3",
            "1 2",
            "+1",
            "18446744073709551616",
            "99999999999999999999999-0",
            "1-18446744073709551616",
        ] {
            assert!(!is_stream_id(bad), "{bad:?}");
        }
    }
}
