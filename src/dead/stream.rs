//! The dead-letter stream (stream mode; one a shard with `--shards N`): each letter an
//! entry, its id's time when it died.
//!
//! `--older-than` and `--newer-than` become the bounds of XRANGE, `--event` is checked per
//! letter. Letters are read a page at a time ([`Scan`]), so requeueing or purging a flood
//! never holds it all in memory; the status page reads newest first ([`newest`],
//! [`newest_sharded`]), a bounded number at a time.
//!
//! Requeue puts a message back into the delay pool, due now, with `retry` reset to 0 and
//! every other field kept, in one Lua call per batch that also deletes the dead letter
//! (`lua/requeue.lua`); the script re-reads each letter by id, so two operators requeueing
//! the same letters put each back once.

use super::{requeue_message, shard_id, Facts, Filter, Letter, RequeueReport, NEWEST_PAGE, PAGE};
use crate::keys::Keys;
use crate::store::stream::{id_ms, is_stream_id};
use crate::store::{self, value_to_string, StoreError};
use redis::{ConnectionLike as Con, RedisResult, Value};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// One dead letter as `settle.lua` writes it (`msg`, `reason`, `ts`, `event`, `key`,
/// `attempts`, `consumer`, `id`); other writers may leave fields out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Its id in the dead-letter stream; the time in it is when the message died.
    pub id: String,
    pub age_ms: i64,
    #[serde(flatten)]
    pub facts: Facts,
    /// `id`: the events-stream entry it was.
    pub entry_id: Option<String>,
    /// The message as the producer wrote it (it may not even be UTF-8).
    #[serde(serialize_with = "super::lossy")]
    pub msg: Vec<u8>,
    /// Fields this version does not know, as written.
    pub other: BTreeMap<String, String>,
}

impl DeadLetter {
    /// A letter with its id and age and no fields yet.
    pub(crate) fn blank(id: String, age_ms: i64) -> DeadLetter {
        DeadLetter {
            id,
            age_ms,
            facts: Facts::default(),
            entry_id: None,
            msg: Vec::new(),
            other: BTreeMap::new(),
        }
    }

    /// The key it goes back under: the job key, or its own id when a writer left that
    /// out (some key is needed, and the id is unique).
    pub fn job_key(&self) -> &[u8] {
        if self.facts.key.is_empty() {
            self.id.as_bytes()
        } else {
            &self.facts.key
        }
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
                "key" => d.facts.key = bytes,
                "event" => d.facts.event = text(),
                "reason" => d.facts.reason = text(),
                "attempts" => d.facts.attempts = text().parse().ok(),
                "ts" => d.facts.ts = text().parse().ok(),
                "consumer" => d.facts.consumer = Some(text()),
                "id" => d.entry_id = Some(text()),
                name => {
                    d.other.insert(name.to_string(), text());
                }
            }
        }
        if d.facts.event.is_empty() {
            d.facts.event = crate::message::event_of(&d.msg);
        }
        Some(d)
    }
}

impl Letter for DeadLetter {
    super::same_named_fields!();
    fn died_ms(&self) -> Option<i64> {
        Some(id_ms(&self.id).unwrap_or(0))
    }
    fn age_ms(&self) -> Option<i64> {
        Some(self.age_ms)
    }
    fn own_rows(&self, ts: bool) -> Vec<(String, String)> {
        let entry = self.entry_id.clone().unwrap_or_else(|| "-".into());
        let mut rows = vec![("entry".to_string(), entry)];
        rows.extend(ts.then(|| super::ts_row(self)));
        rows
    }
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
            .map(|a| now_ms.saturating_sub(super::millis(a)))
            .filter(|t| *t > 0)
            .map_or("-".to_string(), |t| t.to_string());
        let end = filter
            .older_than
            .map(|a| now_ms.saturating_sub(super::millis(a)));
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
    pub fn next_page(&mut self, con: &mut dyn Con) -> RedisResult<Option<Vec<DeadLetter>>> {
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
    con: &mut dyn Con,
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

/// The status page's view: up to `limit` letters matching `filter`, newest first, with an
/// id before `before` (exclusive; from the newest when `None`), looking at no more than
/// `budget` letters; and the id to continue from when more may follow (the last one
/// looked at).
pub fn newest(
    con: &mut dyn Con,
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
    con: &mut dyn Con,
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
    con: &mut dyn Con,
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
    con: &mut dyn Con,
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

/// Requeues `letters`, due at `now_ms`, one script call per [`PAGE`], unscreened.
pub fn requeue(
    con: &mut dyn Con,
    keys: &Keys,
    letters: &[DeadLetter],
    now_ms: i64,
) -> Result<RequeueReport, StoreError> {
    requeue_with(con, keys, letters, now_ms, None)
}

/// [`requeue`], each letter first held against `screen`: one that would die again at
/// once stays, with its reason (`refused`), and `--as-event` renames the rest.
/// A stream id (`<ms>-<seq>`) as numbers, for its order.
fn stream_id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

pub fn requeue_with(
    con: &mut dyn Con,
    keys: &Keys,
    letters: &[DeadLetter],
    now_ms: i64,
    screen: Option<&super::Screen>,
) -> Result<RequeueReport, StoreError> {
    let mut report = RequeueReport::default();
    let letters: Vec<DeadLetter> = match screen {
        None => letters.to_vec(),
        Some(sc) => letters
            .iter()
            .filter_map(|d| {
                if d.msg.is_empty() {
                    return Some(d.clone());
                }
                match sc.check(&d.msg, None) {
                    Ok(msg) => Some(DeadLetter { msg, ..d.clone() }),
                    Err(why) => {
                        report.refused.push((d.id.clone(), why.to_string()));
                        None
                    }
                }
            })
            .collect(),
    };
    let letters = &letters[..];
    // A letter without a message has nothing to put back: it would only die again.
    let (empty, letters): (Vec<&DeadLetter>, Vec<&DeadLetter>) =
        letters.iter().partition(|d| d.msg.is_empty());
    report.cannot.extend(empty.into_iter().map(|d| {
        (
            d.id.clone(),
            "it holds no message (an empty one, or an entry the worker did not write)".into(),
        )
    }));
    // Several letters of one job key (a retry a newer push replaced, then that push's own
    // job): the newest goes back, as the newer push won when they were pushed; the older
    // ones stay, as behind any key scheduled again (found from outside: a requeue by
    // filter put the older job back first and left the newer push's letter).
    let newest: HashMap<&[u8], &str> = letters.iter().fold(HashMap::new(), |mut m, d| {
        let id = m.entry(d.job_key()).or_insert(d.id.as_str());
        if stream_id_key(&d.id) > stream_id_key(id) {
            *id = d.id.as_str();
        }
        m
    });
    let (letters, older): (Vec<&DeadLetter>, Vec<&DeadLetter>) = letters
        .into_iter()
        .partition(|d| newest.get(d.job_key()) == Some(&d.id.as_str()));
    report
        .key_scheduled
        .extend(older.into_iter().map(|d| d.id.clone()));
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
        for ((d, code), (_, json)) in batch.iter().zip(codes).zip(&rewritten) {
            report.record(&d.id, code, *json);
        }
    }
    Ok(report)
}

/// Deletes `letters`; returns how many were still there.
pub fn purge(con: &mut dyn Con, keys: &Keys, letters: &[DeadLetter]) -> Result<u64, StoreError> {
    super::purged(
        letters,
        |d| d.id.as_str(),
        |ids| store::dead::purge(con, keys, ids),
    )
}

/// The shard and stream id of a dead-letter id given with `--shards`: `<shard>/<id>`, or a
/// bare id held by exactly one shard (one held by no shard is looked for in shard 0, where
/// it is not found). `Ok(Err(why))` for an id that names no shard: a shard out of range, not
/// an id, a bare id held by several shards. The id after `<shard>/` is not checked here.
pub fn locate(
    con: &mut dyn Con,
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

/// The oldest `limit` letters matching `filter` over all `shards`, oldest first, each with
/// its shard (for one id in several shards, the lowest shard first).
pub fn oldest_sharded(
    con: &mut dyn Con,
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

/// The matching dead letters of every shard, merged oldest first (as [`oldest_sharded`]
/// orders them), a page of each shard read at a time: for a walk that decides as it goes
/// how many more it wants.
pub struct OldestFirst<'a> {
    shards: Vec<(Scan<'a>, std::collections::VecDeque<DeadLetter>, bool)>,
}

impl<'a> OldestFirst<'a> {
    pub fn new(shards: &'a [Keys], filter: &'a Filter, now_ms: i64) -> OldestFirst<'a> {
        OldestFirst {
            shards: shards
                .iter()
                .map(|k| (Scan::new(k, filter, now_ms), Default::default(), false))
                .collect(),
        }
    }

    /// Up to `n` more letters, each with its shard; fewer only once every shard is read.
    pub fn next(&mut self, con: &mut dyn Con, n: usize) -> RedisResult<Vec<(usize, DeadLetter)>> {
        let mut out = Vec::new();
        while out.len() < n {
            for (scan, buf, done) in &mut self.shards {
                while buf.is_empty() && !*done {
                    match scan.next_page(con)? {
                        Some(page) => buf.extend(page),
                        None => *done = true,
                    }
                }
            }
            let Some(s) = (0..self.shards.len())
                .filter(|s| !self.shards[*s].1.is_empty())
                .min_by_key(|s| place(*s, &self.shards[*s].1[0].id))
            else {
                break;
            };
            if let Some(d) = self.shards[s].1.pop_front() {
                out.push((s, d));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead::{requeue_message, shard_id};

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
        // The last try's error goes with the tries: `worker trace` shows no retry history.
        let (m, _) = requeue_message(
            br#"{"event":"e","payload":{},"last_error":"lock","failed_at":17,"held_at":16,"waited_lock":true}"#,
        );
        let v: serde_json::Value = serde_json::from_slice(&m).unwrap();
        assert!(v.get("waited_lock").is_none(), "{v}");
        assert!(v.get("last_error").is_none(), "{v}");
        assert!(v.get("failed_at").is_none(), "{v}");
        assert!(v.get("held_at").is_none(), "{v}");
        assert_eq!(v["retry"], 0);
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
