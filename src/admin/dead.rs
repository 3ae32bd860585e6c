//! `worker dead list|show|requeue|purge`: the operator's hands on the dead-letter stream.
//!
//! A dead letter's age is the time in its stream id (when it died); `--older-than` and
//! `--newer-than` become the bounds of XRANGE, `--event` is checked per letter. Letters
//! are read a page at a time ([`Scan`]), so requeueing or purging a flood never holds it
//! all in memory.
//!
//! Requeue puts a message back into the delay pool, due now, with `retry` reset to 0 and
//! every other field kept, in one Lua call per batch that also deletes the dead letter
//! (`lua/requeue.lua`); the script re-reads each letter by id, so two operators requeueing
//! the same letters put each back once.
//!
//! In list mode (`--source list --queues ...`) the same commands work on the queues' dead
//! lists instead: see [`list`].

use super::write_json;
use crate::config::Config;
use crate::keys::Keys;
use crate::store::dead::Requeued;
use crate::store::stream::{id_ms, is_stream_id};
use crate::store::{self, value_to_string, StoreError};
use crate::text::{clip, fmt_age, fmt_time, or_dash};
use anyhow::Context;
use clap::{ArgGroup, Args, Subcommand};
use redis::{RedisResult, Value};
use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

pub mod list;

/// Dead letters per XRANGE page and per requeue script call: small enough that one call
/// holds Redis for well under a millisecond per letter.
const PAGE: usize = 100;

/// List, show, requeue or purge the dead letters.
#[derive(Args, Debug, Clone)]
pub struct DeadArgs {
    #[command(subcommand)]
    pub command: DeadCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum DeadCommand {
    /// One line per dead letter, oldest first: id, age, event, job key, attempts, reason.
    List(ListArgs),
    /// Every field of one dead letter, the message pretty-printed.
    Show(ShowArgs),
    /// Put dead letters back into the delay pool, due now, with `retry` reset to 0;
    /// all that match the filters, or those named by --id.
    Requeue(RequeueArgs),
    /// Delete dead letters; refuses to run without --older-than or --all.
    Purge(PurgeArgs),
}

/// Which dead letters a command applies to. A dead letter's age is the time in its id.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Dead-letter options")]
pub struct Filter {
    /// Only dead letters of this event.
    #[arg(long)]
    pub event: Option<String>,
    /// Only dead letters older than this, e.g. 1h or 7d.
    #[arg(long, value_parser = super::parse_duration)]
    pub older_than: Option<Duration>,
    /// Only dead letters newer than this, e.g. 10m.
    #[arg(long, value_parser = super::parse_duration)]
    pub newer_than: Option<Duration>,
}

#[derive(Args, Debug, Clone)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Print a JSON array (every field; the message as a string).
    #[arg(long)]
    pub json: bool,
    /// Show at most this many (the oldest; with --shards, of all shards).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

#[derive(Args, Debug, Clone)]
pub struct ShowArgs {
    /// The dead letter's id, as `worker dead list` prints it.
    pub id: String,
    /// Print it as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct RequeueArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Requeue this dead letter (repeat for several); the filters still apply.
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<String>,
    /// Requeue at most this many, the oldest first (e.g. 1, to try a fix on one); with
    /// --shards, over all shards.
    #[arg(long)]
    pub limit: Option<usize>,
}

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("scope").required(true).args(["older_than", "all"])))]
pub struct PurgeArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Purge whatever their age (--event and --newer-than still apply).
    #[arg(long)]
    pub all: bool,
}

/// One dead letter as `settle.lua` writes it (`msg`, `reason`, `ts`, `event`, `key`,
/// `attempts`, `consumer`, `id`); other writers may leave fields out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Its id in the dead-letter stream; the time in it is when the message died.
    pub id: String,
    pub age_ms: i64,
    /// The `event` field, or the message's own when a writer left the field out.
    pub event: String,
    /// The job key (`key` field), bytes as written.
    #[serde(serialize_with = "lossy")]
    pub key: Vec<u8>,
    /// How often the message was tried.
    pub attempts: Option<u64>,
    pub reason: String,
    /// `ts`: when it died, unix seconds.
    pub ts: Option<i64>,
    /// The consumer that gave up on it.
    pub consumer: Option<String>,
    /// `id`: the events-stream entry it was.
    pub entry_id: Option<String>,
    /// The message as the producer wrote it (it may not even be UTF-8).
    #[serde(serialize_with = "lossy")]
    pub msg: Vec<u8>,
    /// Fields this version does not know, as written.
    pub other: BTreeMap<String, String>,
}

fn lossy<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(b))
}

impl DeadLetter {
    /// A letter with its id and age and no fields yet.
    fn blank(id: String, age_ms: i64) -> DeadLetter {
        DeadLetter {
            id,
            age_ms,
            event: String::new(),
            key: Vec::new(),
            attempts: None,
            reason: String::new(),
            ts: None,
            consumer: None,
            entry_id: None,
            msg: Vec::new(),
            other: BTreeMap::new(),
        }
    }

    /// The key it goes back under: the job key, or its own id when a writer left that
    /// out (some key is needed, and the id is unique).
    pub fn job_key(&self) -> &[u8] {
        if self.key.is_empty() {
            self.id.as_bytes()
        } else {
            &self.key
        }
    }

    fn at_ms(&self) -> i64 {
        id_ms(&self.id).unwrap_or(0)
    }

    /// Parses one `[id, [field, value, ...]]` entry; `None` for an entry deleted meanwhile.
    fn parse(entry: &Value, now_ms: i64) -> Option<DeadLetter> {
        let Value::Array(pair) = entry else {
            return None;
        };
        let id = value_to_string(pair.first()?);
        let Some(Value::Array(fields)) = pair.get(1) else {
            return None;
        };
        let age_ms = id_ms(&id).map_or(0, |t| (now_ms - t).max(0));
        let mut d = DeadLetter::blank(id, age_ms);
        for kv in fields.chunks_exact(2) {
            let bytes = match &kv[1] {
                Value::BulkString(b) => b.clone(),
                other => value_to_string(other).into_bytes(),
            };
            let text = || String::from_utf8_lossy(&bytes).into_owned();
            match value_to_string(&kv[0]).as_str() {
                "msg" => d.msg = bytes,
                "key" => d.key = bytes,
                "event" => d.event = text(),
                "reason" => d.reason = text(),
                "attempts" => d.attempts = text().parse().ok(),
                "ts" => d.ts = text().parse().ok(),
                "consumer" => d.consumer = Some(text()),
                "id" => d.entry_id = Some(text()),
                name => {
                    d.other.insert(name.to_string(), text());
                }
            }
        }
        if d.event.is_empty() {
            d.event = crate::message::event_of(&d.msg);
        }
        Some(d)
    }
}

impl Filter {
    /// The `--event` check; the ages are the XRANGE bounds (see [`Scan`]), and are
    /// checked here too for letters fetched by id.
    pub fn matches(&self, d: &DeadLetter, now_ms: i64) -> bool {
        self.event.as_ref().is_none_or(|e| *e == d.event)
            && self
                .older_than
                .is_none_or(|a| d.at_ms() <= now_ms - millis(a))
            && self
                .newer_than
                .is_none_or(|a| d.at_ms() >= now_ms - millis(a))
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A walk over the dead letters matching a filter, oldest first, a page at a time. The
/// cursor is exclusive of the last id seen, so deleting what was read (purge, requeue)
/// does not disturb it.
pub struct Scan<'a> {
    keys: &'a Keys,
    filter: &'a Filter,
    now_ms: i64,
    start: String,
    end: String,
    done: bool,
}

impl<'a> Scan<'a> {
    pub fn new(keys: &'a Keys, filter: &'a Filter, now_ms: i64) -> Scan<'a> {
        // A bare millisecond time is `<ms>-0` as a start and `<ms>-<max>` as an end, so
        // both bounds are inclusive of their millisecond.
        let start = filter
            .newer_than
            .map(|a| now_ms.saturating_sub(millis(a)))
            .filter(|t| *t > 0)
            .map_or("-".to_string(), |t| t.to_string());
        let end = filter.older_than.map(|a| now_ms.saturating_sub(millis(a)));
        Scan {
            keys,
            filter,
            now_ms,
            start,
            done: end.is_some_and(|t| t < 0),
            end: end.map_or("+".to_string(), |t| t.to_string()),
        }
    }

    /// The next matching letters; `None` once the stream is exhausted. A page may be
    /// empty when none of its letters matched `--event`.
    pub fn next_page(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
    ) -> RedisResult<Option<Vec<DeadLetter>>> {
        if self.done {
            return Ok(None);
        }
        let reply: Value = redis::cmd("XRANGE")
            .arg(&self.keys.dead)
            .arg(&self.start)
            .arg(&self.end)
            .arg("COUNT")
            .arg(PAGE)
            .query(con)?;
        let entries = match reply {
            Value::Array(e) => e,
            _ => Vec::new(),
        };
        if entries.len() < PAGE {
            self.done = true;
        }
        let page: Vec<DeadLetter> = entries
            .iter()
            .filter_map(|e| DeadLetter::parse(e, self.now_ms))
            .collect();
        match page.last() {
            Some(last) => self.start = format!("({}", last.id),
            None => {
                self.done = true;
                return Ok(None);
            }
        }
        Ok(Some(
            page.into_iter()
                .filter(|d| self.filter.matches(d, self.now_ms))
                .collect(),
        ))
    }
}

/// The matching dead letters, oldest first, at most `limit`.
pub fn scan(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    filter: &Filter,
    now_ms: i64,
    limit: Option<usize>,
) -> RedisResult<Vec<DeadLetter>> {
    let limit = limit.unwrap_or(usize::MAX);
    let mut scan = Scan::new(keys, filter, now_ms);
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(page) = scan.next_page(con)? else {
            break;
        };
        out.extend(page);
    }
    out.truncate(limit);
    Ok(out)
}

/// Letters per XREVRANGE of [`newest`]: dead letters are small, but one may hold up to
/// `--max-message-bytes`, so a page read for the status page stays a few megabytes at most.
const NEWEST_PAGE: usize = 50;

/// The status page's view: up to `limit` letters matching `filter`, newest first, with an
/// id before `before` (exclusive; from the newest when `None`), looking at no more than
/// `budget` letters; and the id to continue from when more may follow (the last one
/// looked at).
pub fn newest(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    filter: &Filter,
    now_ms: i64,
    before: Option<&str>,
    limit: usize,
    budget: usize,
) -> RedisResult<(Vec<DeadLetter>, Option<String>)> {
    let end = match before {
        None => "+".to_string(),
        Some(b) => match older_than(b) {
            Some(end) => end,
            None => return Ok((Vec::new(), None)),
        },
    };
    newest_from(con, keys, filter, now_ms, end, limit, budget)
}

/// The XREVRANGE end of the ids older than `id`: `(<id>`; `None` for `0-0`, older than
/// which there is nothing (and which Redis refuses as an exclusive end).
fn older_than(id: &str) -> Option<String> {
    (place(0, id) != (0, 0, 0)).then(|| format!("({id}"))
}

/// [`newest`] from `end`, an XREVRANGE end (`+`, `<id>` or `(<id>`).
fn newest_from(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    filter: &Filter,
    now_ms: i64,
    mut end: String,
    limit: usize,
    budget: usize,
) -> RedisResult<(Vec<DeadLetter>, Option<String>)> {
    let mut out = Vec::new();
    let mut looked = 0;
    loop {
        let count = NEWEST_PAGE.min(budget.saturating_sub(looked));
        if count == 0 {
            return Ok((out, end.strip_prefix('(').map(str::to_string)));
        }
        let reply: Value = redis::cmd("XREVRANGE")
            .arg(&keys.dead)
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(count)
            .query(con)?;
        let entries = match reply {
            Value::Array(e) => e,
            _ => Vec::new(),
        };
        looked += entries.len();
        let exhausted = entries.len() < count;
        for e in &entries {
            let Some(d) = DeadLetter::parse(e, now_ms) else {
                continue;
            };
            end = format!("({}", d.id);
            if filter.matches(&d, now_ms) {
                out.push(d);
                if out.len() >= limit {
                    return Ok((out, end.strip_prefix('(').map(str::to_string)));
                }
            }
        }
        if exhausted {
            return Ok((out, None));
        }
    }
}

/// A dead-letter id of `--shards N` as the operator sees it: `<shard>/<id>`.
pub fn shard_id(shard: usize, id: &str) -> String {
    format!("{shard}/{id}")
}

/// A letter's shard and stream id.
pub type Place = (usize, String);

/// Letters, each with its shard, and the place to continue from.
pub type ShardPage = (Vec<(usize, DeadLetter)>, Option<Place>);

/// Where a letter stands in the newest-first order over several shards: its stream id
/// (time, then sequence; a bare `<ms>` is the last of its millisecond, as XREVRANGE reads
/// it), then its shard, since one stream id may be in several shards.
fn place(shard: usize, id: &str) -> (u64, u64, usize) {
    let mut parts = id.split('-');
    let ms = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let seq = parts.next().map_or(u64::MAX, |p| p.parse().unwrap_or(0));
    (ms, seq, shard)
}

/// [`newest`] over the dead letters of several shards (`--shards N`), merged newest first:
/// by stream id, whose time is when the letter died, and for one id in several shards the
/// highest shard first. Up to `limit` letters matching `filter` that come after `before`
/// (a `(shard, id)` place, exclusive; from the newest when `None`), each with its shard;
/// and the place to continue from when more may follow. Looks at no more than `budget`
/// letters in all: `budget / N` a shard, at least one. `shards` are the shards to read,
/// each with its number (the status page leaves out one whose key holds another type).
///
/// Each shard is read from `before` down, to its limit or its share of the budget; the
/// last letter a shard looked at is its frontier. Every letter at or above the highest
/// frontier of the shards with more to read has been looked at in every shard, so the
/// page is the matching letters down to that frontier (the first `limit` of them), and
/// the next page starts after its last letter, or after the frontier: no letter is
/// shown twice or passed over, whatever ids the shards share.
pub fn newest_sharded(
    con: &mut dyn redis::ConnectionLike,
    shards: &[(usize, &Keys)],
    filter: &Filter,
    now_ms: i64,
    before: Option<(usize, &str)>,
    limit: usize,
    budget: usize,
) -> RedisResult<ShardPage> {
    let share = (budget / shards.len().max(1)).max(1);
    let mut all: Vec<(usize, DeadLetter)> = Vec::new();
    let mut frontier: Option<Place> = None;
    for &(s, keys) in shards {
        // The letters of shard `s` after (`before_shard`, `id`): those with a lower id, and
        // in a lower shard also the one with that id.
        let end = match before {
            None => "+".to_string(),
            Some((bs, id)) if s < bs => id.to_string(),
            Some((_, id)) => match older_than(id) {
                Some(end) => end,
                None => continue,
            },
        };
        let (letters, next) = newest_from(con, keys, filter, now_ms, end, limit, share)?;
        if let Some(n) = next {
            if frontier
                .as_ref()
                .is_none_or(|(fs, f)| place(s, &n) > place(*fs, f))
            {
                frontier = Some((s, n));
            }
        }
        all.extend(letters.into_iter().map(|d| (s, d)));
    }
    Ok(merge_newest(all, frontier, limit))
}

/// The page of [`newest_sharded`] from each shard's letters and the highest frontier.
fn merge_newest(
    mut all: Vec<(usize, DeadLetter)>,
    frontier: Option<Place>,
    limit: usize,
) -> ShardPage {
    all.sort_by_key(|(s, d)| std::cmp::Reverse(place(*s, &d.id)));
    if let Some((fs, f)) = &frontier {
        let floor = place(*fs, f);
        all.retain(|(s, d)| place(*s, &d.id) >= floor);
    }
    if all.len() > limit {
        all.truncate(limit);
        let last = all.last().map(|(s, d)| (*s, d.id.clone()));
        return (all, last);
    }
    (all, frontier)
}

/// The dead letters with these ids, in order; `None` for an id not there.
pub fn fetch(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    ids: &[String],
    now_ms: i64,
) -> RedisResult<Vec<Option<DeadLetter>>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut p = redis::pipe();
    for id in ids {
        p.cmd("XRANGE").arg(&keys.dead).arg(id).arg(id);
    }
    let replies: Vec<Value> = p.query(con)?;
    Ok(replies
        .iter()
        .map(|r| match r {
            Value::Array(e) => e.first().and_then(|e| DeadLetter::parse(e, now_ms)),
            _ => None,
        })
        .collect())
}

/// The message to requeue and whether `retry` could be reset: a JSON object gets
/// `retry: 0` with every other field kept (the same rewrite a retry makes, see
/// `Envelope::next_retry`); one whose `retry` is already 0 or absent goes back byte for
/// byte; anything else goes back as written (it will be dead-lettered again).
pub fn requeue_message(msg: &[u8]) -> (Vec<u8>, bool) {
    match serde_json::from_slice::<serde_json::Value>(msg) {
        Ok(serde_json::Value::Object(mut m)) => {
            if m.get("retry").is_none_or(|r| r.as_u64() == Some(0)) {
                return (msg.to_vec(), true);
            }
            m.insert("retry".into(), 0.into());
            // The job keeps its identity: the mover's stamp stays first, where it looks.
            let stamp = crate::message::stamp_of(msg);
            (
                crate::message::to_wire(m, stamp.as_deref()).into_bytes(),
                true,
            )
        }
        _ => (msg.to_vec(), false),
    }
}

/// What a requeue did, by dead-letter id.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct RequeueReport {
    /// Back in the delay pool, due now, and gone from the dead letters.
    pub requeued: Vec<String>,
    /// Of those, messages that are not a JSON object, requeued as written.
    pub as_is: Vec<String>,
    /// Left in the dead letters because their job key is scheduled again: a producer
    /// pushed it anew since, and the newer message wins.
    pub key_scheduled: Vec<String>,
    /// Already gone when the script ran: requeued or purged by someone else.
    pub gone: Vec<String>,
    /// Left in the dead letters because there is no whole message to requeue: (id, why).
    /// A letter without a message; in list mode also one that keeps only a prefix of an
    /// oversized message, or an entry that is not a letter as the worker writes them.
    pub cannot: Vec<(String, String)>,
}

impl RequeueReport {
    fn add(&mut self, r: RequeueReport) {
        self.requeued.extend(r.requeued);
        self.as_is.extend(r.as_is);
        self.key_scheduled.extend(r.key_scheduled);
        self.gone.extend(r.gone);
        self.cannot.extend(r.cannot);
    }

    /// The same, its ids written `<shard>/<id>`.
    fn in_shard(self, shard: usize) -> RequeueReport {
        let ids = |v: Vec<String>| v.iter().map(|id| shard_id(shard, id)).collect();
        RequeueReport {
            requeued: ids(self.requeued),
            as_is: ids(self.as_is),
            key_scheduled: ids(self.key_scheduled),
            gone: ids(self.gone),
            cannot: self
                .cannot
                .into_iter()
                .map(|(id, why)| (shard_id(shard, &id), why))
                .collect(),
        }
    }

    /// What `worker dead requeue` prints; exit 1 when an id named was not found.
    fn print(&self, missing: &[String], out: &mut dyn Write) -> anyhow::Result<ExitCode> {
        writeln!(out, "requeued {}", self.requeued.len())?;
        if !self.as_is.is_empty() {
            writeln!(
                out,
                "{} of them not a JSON object, requeued as written: they will be dead-lettered again ({})",
                self.as_is.len(),
                self.as_is.join(", ")
            )?;
        }
        if !self.key_scheduled.is_empty() {
            writeln!(
                out,
                "left {} in the dead letters: their job key is scheduled again and the newer push wins ({})",
                self.key_scheduled.len(),
                self.key_scheduled.join(", ")
            )?;
        }
        for (id, why) in &self.cannot {
            writeln!(out, "left {id} in the dead letters: {why}")?;
        }
        if !self.gone.is_empty() {
            writeln!(
                out,
                "skipped {} already requeued or purged by someone else",
                self.gone.len()
            )?;
        }
        for id in missing {
            writeln!(out, "no dead letter {id}")?;
        }
        Ok(if missing.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    }
}

/// Requeues `letters`, due at `now_ms`, one script call per [`PAGE`].
pub fn requeue(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    letters: &[DeadLetter],
    now_ms: i64,
) -> Result<RequeueReport, StoreError> {
    let mut report = RequeueReport::default();
    // A letter without a message has nothing to put back: it would only die again.
    let (empty, letters): (Vec<&DeadLetter>, Vec<&DeadLetter>) =
        letters.iter().partition(|d| d.msg.is_empty());
    report.cannot.extend(empty.into_iter().map(|d| {
        (
            d.id.clone(),
            "it holds no message (an empty one, or an entry the worker did not write)".into(),
        )
    }));
    for batch in letters.chunks(PAGE) {
        let rewritten: Vec<(Vec<u8>, bool)> =
            batch.iter().map(|d| requeue_message(&d.msg)).collect();
        let keys_of: Vec<Vec<u8>> = batch.iter().map(|d| d.job_key().to_vec()).collect();
        let args: Vec<(&str, &[u8], &[u8])> = batch
            .iter()
            .zip(&rewritten)
            .zip(&keys_of)
            .map(|((d, (msg, _)), key)| (d.id.as_str(), key.as_slice(), msg.as_slice()))
            .collect();
        let codes = store::dead::requeue(con, keys, &args, now_ms)?;
        for ((d, code), (_, is_json)) in batch.iter().zip(codes).zip(&rewritten) {
            let id = d.id.clone();
            match code {
                Requeued::Requeued => {
                    if !is_json {
                        report.as_is.push(id.clone());
                    }
                    report.requeued.push(id);
                }
                Requeued::KeyScheduled => report.key_scheduled.push(id),
                Requeued::Gone => report.gone.push(id),
            }
        }
    }
    Ok(report)
}

/// Deletes `letters`; returns how many were still there.
pub fn purge(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    letters: &[DeadLetter],
) -> Result<u64, StoreError> {
    let mut n = 0;
    for batch in letters.chunks(PAGE) {
        let ids: Vec<&str> = batch.iter().map(|d| d.id.as_str()).collect();
        n += store::dead::purge(con, keys, &ids)?;
    }
    Ok(n)
}

pub(super) fn run(
    config: &Config,
    args: &DeadArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    if config.source == crate::config::Source::List {
        return list::run(config, args, out);
    }
    let mut con = super::connect(config)?;
    // Ages, filters and a requeue's due time on Redis's clock.
    let now = crate::figures::redis_now_ms(&mut con, config)?;
    let shards = config.shard_keys();
    if shards.len() == 1 {
        return one_set(&mut con, &config.keys, args, now, out);
    }
    // `--shards N`: ids are written `<shard>/<id>` (a stream id is unique only within its
    // shard's stream); a list and a requeue's `--limit` span all shards.
    match &args.command {
        DeadCommand::List(a) => list_sharded(&mut con, &shards, a, now, out),
        DeadCommand::Show(a) => {
            let (shard, id) = locate_arg(&mut con, &shards, &a.id, now)?;
            let one = ShowArgs { id, json: a.json };
            show(&mut con, &shards[shard], &one, now, out)
        }
        DeadCommand::Requeue(a) => requeue_sharded(&mut con, &shards, a, now, out),
        DeadCommand::Purge(_) => {
            for (i, keys) in shards.iter().enumerate() {
                write!(out, "shard {i} ({}): ", keys.dead)?;
                one_set(&mut con, keys, args, now, out)?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `worker dead requeue` with `--shards N`: each letter in its own shard, one report with
/// `<shard>/<id>` ids; `--limit` counts over all shards (the oldest, or the first ids named).
fn requeue_sharded(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    a: &RequeueArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let read = "cannot read the dead letters";
    let mut report = RequeueReport::default();
    let mut missing = Vec::new();
    let chosen: Vec<(usize, DeadLetter)> = if !a.ids.is_empty() {
        let mut places = Vec::new();
        for given in &a.ids {
            let (s, id) = locate_arg(con, shards, given, now)?;
            anyhow::ensure!(
                is_stream_id(&id),
                "--id: {given:?} is not a dead-letter id (like 1/1768764300123-0)"
            );
            if !places.contains(&(s, id.clone())) {
                places.push((s, id));
            }
        }
        let mut chosen = Vec::new();
        for (s, id) in places {
            match fetch(con, &shards[s], std::slice::from_ref(&id), now)
                .context(read)?
                .pop()
                .flatten()
            {
                Some(d) if a.filter.matches(&d, now) => chosen.push((s, d)),
                Some(_) => {}
                None => missing.push(shard_id(s, &id)),
            }
        }
        chosen.truncate(a.limit.unwrap_or(usize::MAX));
        chosen
    } else if let Some(limit) = a.limit {
        oldest_sharded(con, shards, &a.filter, now, limit).context(read)?
    } else {
        // All of them: a page at a time, so a flood is never held in memory.
        for (s, keys) in shards.iter().enumerate() {
            let mut scan = Scan::new(keys, &a.filter, now);
            while let Some(page) = scan.next_page(con).context(read)? {
                let r = requeue(con, keys, &page, now).context("cannot requeue")?;
                report.add(r.in_shard(s));
            }
        }
        Vec::new()
    };
    for (s, keys) in shards.iter().enumerate() {
        let letters: Vec<DeadLetter> = chosen
            .iter()
            .filter(|(c, _)| *c == s)
            .map(|(_, d)| d.clone())
            .collect();
        if !letters.is_empty() {
            let r = requeue(con, keys, &letters, now).context("cannot requeue")?;
            report.add(r.in_shard(s));
        }
    }
    report.print(&missing, out)
}

/// The shard and stream id of a dead-letter id given with `--shards`: `<shard>/<id>`, or a
/// bare id held by exactly one shard (one held by no shard is looked for in shard 0, where
/// it is not found). `Ok(Err(why))` for an id that names no shard: a shard out of range, not
/// an id, a bare id held by several shards. The id after `<shard>/` is not checked here.
pub fn locate(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    given: &str,
    now: i64,
) -> RedisResult<Result<(usize, String), String>> {
    if let Some((shard, id)) = given.split_once('/') {
        return Ok(match shard.parse().ok().filter(|s| *s < shards.len()) {
            Some(shard) => Ok((shard, id.to_string())),
            None => Err(format!(
                "{given:?}: the shard before '/' must be 0 to {}",
                shards.len() - 1
            )),
        });
    }
    if !is_stream_id(given) {
        return Ok(Err(format!(
            "{given:?} is not a dead-letter id (like 2/1768764300123-0)"
        )));
    }
    let mut holders = Vec::new();
    for (i, keys) in shards.iter().enumerate() {
        let found = fetch(con, keys, &[given.to_string()], now)?;
        if matches!(found.first(), Some(Some(_))) {
            holders.push(i);
        }
    }
    Ok(match holders.as_slice() {
        [one] => Ok((*one, given.to_string())),
        [] => Ok((0, given.to_string())),
        many => Err(format!(
            "{given:?} is a dead letter in shards {many:?}: name one, e.g. {}",
            shard_id(many[0], given)
        )),
    })
}

/// [`locate`] for the CLI: an id that names no shard is an error.
fn locate_arg(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    given: &str,
    now: i64,
) -> anyhow::Result<(usize, String)> {
    locate(con, shards, given, now)
        .context("cannot read the dead letters")?
        .map_err(anyhow::Error::msg)
}

/// One key set's dead letters (the only one, or one shard's).
fn one_set(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    args: &DeadArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    match &args.command {
        DeadCommand::List(a) => list(con, keys, a, now, out),
        DeadCommand::Show(a) => show(con, keys, a, now, out),
        DeadCommand::Requeue(a) => requeue_cmd(con, keys, a, now, out),
        DeadCommand::Purge(a) => {
            let mut scan = Scan::new(keys, &a.filter, now);
            let mut purged = 0;
            while let Some(page) = scan
                .next_page(con)
                .context("cannot read the dead letters")?
            {
                purged += purge(con, keys, &page).context("cannot purge")?;
            }
            writeln!(out, "purged {purged}")?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn list(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    a: &ListArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    // One more than shown tells whether there are more.
    let letters = scan(con, keys, &a.filter, now, Some(a.limit.saturating_add(1)))
        .context("cannot read the dead letters")?;
    print_list(letters.into_iter().map(|d| (None, d)).collect(), a, out)
}

/// `worker dead list` with `--shards N`: the oldest `--limit` letters of all shards, in
/// the order of their ids (when they died), ids written `<shard>/<id>`.
fn list_sharded(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    a: &ListArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let letters = oldest_sharded(con, shards, &a.filter, now, a.limit.saturating_add(1))
        .context("cannot read the dead letters")?;
    print_list(
        letters.into_iter().map(|(s, d)| (Some(s), d)).collect(),
        a,
        out,
    )
}

/// The oldest `limit` letters matching `filter` over all `shards`, oldest first, each with
/// its shard (for one id in several shards, the lowest shard first).
fn oldest_sharded(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    filter: &Filter,
    now: i64,
    limit: usize,
) -> RedisResult<Vec<(usize, DeadLetter)>> {
    let mut all = Vec::new();
    for (s, keys) in shards.iter().enumerate() {
        all.extend(
            scan(con, keys, filter, now, Some(limit))?
                .into_iter()
                .map(|d| (s, d)),
        );
    }
    all.sort_by_key(|(s, d)| place(*s, &d.id));
    all.truncate(limit);
    Ok(all)
}

/// What `worker dead list` prints of `letters` (one more than `--limit` when there are
/// more), each with its shard when there are shards.
fn print_list(
    mut letters: Vec<(Option<usize>, DeadLetter)>,
    a: &ListArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let more = letters.len() > a.limit;
    letters.truncate(a.limit);
    if a.json {
        let mut all = Vec::with_capacity(letters.len());
        for (s, d) in &letters {
            let mut v = serde_json::to_value(d)?;
            if let (Some(s), Some(o)) = (s, v.as_object_mut()) {
                o.insert("id".into(), shard_id(*s, &d.id).into());
                o.insert("shard".into(), (*s).into());
            }
            all.push(v);
        }
        write_json(out, &all)?;
        return Ok(ExitCode::SUCCESS);
    }
    let ids: Vec<String> = letters
        .iter()
        .map(|(s, d)| s.map_or_else(|| d.id.clone(), |s| shard_id(s, &d.id)))
        .collect();
    let letters: Vec<&DeadLetter> = letters.iter().map(|(_, d)| d).collect();
    if letters.is_empty() {
        writeln!(out, "no dead letters")?;
        return Ok(ExitCode::SUCCESS);
    }
    let width = |f: &dyn Fn(&DeadLetter) -> usize, title: &str, cap: usize| {
        letters
            .iter()
            .map(|d| f(d))
            .max()
            .unwrap_or(0)
            .max(title.len())
            .min(cap)
    };
    let keys_shown: Vec<String> = letters
        .iter()
        .map(|d| String::from_utf8_lossy(&d.key).into_owned())
        .collect();
    let wi = ids
        .iter()
        .map(String::len)
        .max()
        .unwrap_or(0)
        .clamp("ID".len(), 40);
    let we = width(&|d| d.event.chars().count(), "EVENT", 32);
    let wk = keys_shown
        .iter()
        .map(|k| k.chars().count())
        .max()
        .unwrap_or(0)
        .clamp("KEY".len(), 40);
    writeln!(
        out,
        "{:wi$}  {:>6}  {:we$}  {:wk$}  {:>8}  REASON",
        "ID", "AGE", "EVENT", "KEY", "ATTEMPTS"
    )?;
    for ((d, key), id) in letters.iter().zip(&keys_shown).zip(&ids) {
        writeln!(
            out,
            "{:wi$}  {:>6}  {:we$}  {:wk$}  {:>8}  {}",
            id,
            fmt_age(d.age_ms),
            clip(or_dash(&d.event), we),
            clip(or_dash(key), wk),
            d.attempts.map_or("-".to_string(), |n| n.to_string()),
            clip(&d.reason, 60),
        )?;
    }
    if more {
        writeln!(out, "... more not shown (--limit {})", a.limit)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn show(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    a: &ShowArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        is_stream_id(&a.id),
        "{:?} is not a dead-letter id (like 1768764300123-0)",
        a.id
    );
    let found = fetch(con, keys, std::slice::from_ref(&a.id), now)
        .context("cannot read the dead letters")?;
    let Some(Some(d)) = found.into_iter().next() else {
        writeln!(out, "no dead letter {}", a.id)?;
        return Ok(ExitCode::FAILURE);
    };
    if a.json {
        write_json(out, &d)?;
        return Ok(ExitCode::SUCCESS);
    }
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let mut rows: Vec<(String, String)> = vec![
        ("dead letter".into(), d.id.clone()),
        (
            "died".into(),
            format!("{} ({} ago)", fmt_time(d.at_ms()), fmt_age(d.age_ms)),
        ),
        ("event".into(), d.event.clone()),
        ("key".into(), String::from_utf8_lossy(&d.key).into_owned()),
        (
            "attempts".into(),
            d.attempts.map_or("-".into(), |n| n.to_string()),
        ),
        ("reason".into(), d.reason.clone()),
        ("consumer".into(), opt(&d.consumer)),
        ("entry".into(), opt(&d.entry_id)),
        ("ts".into(), d.ts.map_or("-".into(), |t| t.to_string())),
    ];
    rows.extend(d.other.iter().map(|(k, v)| (k.clone(), v.clone())));
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in &rows {
        writeln!(out, "{k:w$}  {v}")?;
    }
    match serde_json::from_slice::<serde_json::Value>(&d.msg) {
        Ok(v) => writeln!(out, "message\n{}", serde_json::to_string_pretty(&v)?)?,
        Err(e) => writeln!(
            out,
            "message (not JSON: {e}), as written\n{}",
            String::from_utf8_lossy(&d.msg)
        )?,
    }
    Ok(ExitCode::SUCCESS)
}

fn requeue_cmd(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    a: &RequeueArgs,
    now: i64,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let read = "cannot read the dead letters";
    let limit = a.limit.unwrap_or(usize::MAX);
    let mut missing = Vec::new();
    let mut report = RequeueReport::default();
    if a.ids.is_empty() {
        let mut scan = Scan::new(keys, &a.filter, now);
        let mut left = limit;
        while left > 0 {
            let Some(mut page) = scan.next_page(con).context(read)? else {
                break;
            };
            page.truncate(left);
            left -= page.len();
            report.add(requeue(con, keys, &page, now).context("cannot requeue")?);
        }
    } else {
        for id in &a.ids {
            anyhow::ensure!(
                is_stream_id(id),
                "--id: {id:?} is not a dead-letter id (like 1768764300123-0)"
            );
        }
        // The same id twice is one letter, not a second one "gone".
        let mut ids = a.ids.clone();
        let mut seen = std::collections::HashSet::new();
        ids.retain(|id| seen.insert(id.clone()));
        let found = fetch(con, keys, &ids, now).context(read)?;
        let mut letters = Vec::new();
        for (id, d) in ids.iter().zip(found) {
            match d {
                Some(d) if a.filter.matches(&d, now) => letters.push(d),
                Some(_) => {}
                None => missing.push(id.clone()),
            }
        }
        letters.truncate(limit);
        report.add(requeue(con, keys, &letters, now).context("cannot requeue")?);
    }
    report.print(&missing, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeue_resets_retry_and_keeps_everything_else() {
        let (m, ok) =
            requeue_message(br#"{"event":"e","payload":{"a":1},"retry":3,"ts":7,"trace":"x"}"#);
        assert!(ok);
        let v: serde_json::Value = serde_json::from_slice(&m).unwrap();
        assert_eq!(v["retry"], 0);
        assert_eq!(
            (v["ts"].as_i64(), v["trace"].as_str()),
            (Some(7), Some("x"))
        );
        assert_eq!(v["payload"]["a"], 1);
        let raw = br#"{"payload":{},"event":"e"}"#;
        assert_eq!(
            requeue_message(raw),
            (raw.to_vec(), true),
            "nothing to reset: as written"
        );
        assert_eq!(requeue_message(b"nope"), (b"nope".to_vec(), false));
        assert_eq!(requeue_message(b"[1]"), (b"[1]".to_vec(), false));
    }

    fn letter(id: &str) -> DeadLetter {
        DeadLetter::blank(id.into(), 0)
    }

    #[test]
    fn shards_merge_newest_first_down_to_the_highest_frontier() {
        let ids = |p: &ShardPage| -> Vec<String> {
            p.0.iter().map(|(s, d)| shard_id(*s, &d.id)).collect()
        };
        let all = vec![
            (0, letter("5-0")),
            (0, letter("3-0")),
            (1, letter("5-0")),
            (1, letter("4-2")),
            (2, letter("4-10")),
            (2, letter("1-0")),
        ];
        // Shard 1 has more below 4-2: nothing under it is shown yet, and the next page
        // starts after it.
        let page = merge_newest(all.clone(), Some((1, "4-2".into())), 50);
        assert_eq!(ids(&page), ["1/5-0", "0/5-0", "2/4-10", "1/4-2"]);
        assert_eq!(page.1, Some((1, "4-2".to_string())));
        // All read: every letter, and no next page.
        let page = merge_newest(all.clone(), None, 50);
        assert_eq!(ids(&page).len(), 6);
        assert_eq!(page.1, None);
        // A full page ends at its last letter, its shard included.
        let page = merge_newest(all, None, 2);
        assert_eq!(ids(&page), ["1/5-0", "0/5-0"]);
        assert_eq!(page.1, Some((0, "5-0".to_string())));
        assert!(
            place(0, "5") > place(1, "5-7"),
            "a bare ms is its millisecond's last"
        );
    }
}
