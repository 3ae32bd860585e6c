//! List mode's dead letters: the dead lists `<queue><dead-suffix>` of the queues named by
//! `--queues` and `--queue NAME=EVENT`.
//!
//! A list letter is a JSON object (`msg`, `reason`, `ts`, `event`, `key`, `attempts`,
//! `consumer`, `queue`, and for an oversized message `length` and `sha1`) pushed onto the
//! head of its dead list, so the tail holds the oldest. It has no id of its own, and an
//! index shifts whenever a letter is added or removed; so its id here is the start of the
//! SHA-1 of its bytes ([`ID_LEN`] hex digits, a longer or shorter prefix of at least
//! [`MIN_ID_LEN`] works too). `show`, `requeue --id` and `purge` find letters by reading
//! the list, then hand the store each letter's exact bytes, which its script looks for
//! again: whatever was pushed or removed meanwhile, it removes that letter or nothing.
//! A letter's age is its `ts` (when it died, unix seconds); a letter without one has no age
//! and matches no age filter. Letters are read a page at a time from the tail ([`Walk`]).
//!
//! Requeue pushes each message back onto its queue's head (as a producer pushes), in one
//! script call per batch that removes the letter in the same step
//! (`lua/requeue_list.lua`): `retry` reset to 0 and every other field kept (the mover's
//! `job_key` and `job_id` too, so the job keeps its identity and its inbox row still
//! counts), a raw queue's message byte for byte. A letter without a whole message stays
//! where it is ([`requeueable`]).

use super::{requeue_message, Facts, Filter, Letter, RequeueReport, NEWEST_PAGE, PAGE};
use crate::keys::{Keys, Queue};
use crate::store::{self, StoreError};
use anyhow::Context;
use redis::{ConnectionLike as Con, RedisResult};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// Hex digits of the SHA-1 a letter's id shows.
pub const ID_LEN: usize = 16;
/// The shortest prefix of that digest taken as an id.
pub const MIN_ID_LEN: usize = 8;

/// One letter of a dead list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListLetter {
    /// The first [`ID_LEN`] hex digits of the SHA-1 of the letter's bytes.
    pub id: String,
    /// The queue whose dead list holds it: where a requeue sends it.
    pub queue: String,
    /// Since it died (from `ts`); `None` when the letter has no `ts`.
    pub age_ms: Option<i64>,
    #[serde(flatten)]
    pub facts: Facts,
    /// A message over the size limit: its whole length (`msg` is only its start) ...
    pub length: Option<u64>,
    /// ... and its SHA-1.
    pub sha1: Option<String>,
    /// The message as it was delivered.
    #[serde(serialize_with = "super::lossy")]
    pub msg: Vec<u8>,
    /// Fields this version does not know, as written.
    pub other: BTreeMap<String, String>,
    /// False for an entry that is not a JSON object with a `msg` (pushed by hand?): shown
    /// as it is, never requeued.
    pub readable: bool,
    /// The letter is not UTF-8 (the message it keeps was not): read with the bad bytes
    /// replaced, so `msg` is not the message's exact bytes and it is never requeued.
    #[serde(skip)]
    pub replaced: bool,
    /// The letter's bytes, as the dead list holds them.
    #[serde(skip)]
    pub raw: Vec<u8>,
}

/// A JSON value as text: strings without their quotes.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl ListLetter {
    /// Parses one entry of `queue`'s dead list; never fails (see `readable`).
    pub fn parse(raw: Vec<u8>, queue: &str, now_ms: i64) -> ListLetter {
        let digest = sha1_smol::Sha1::from(&raw).digest().to_string();
        let mut l = ListLetter {
            id: digest[..ID_LEN].to_string(),
            queue: queue.to_string(),
            age_ms: None,
            facts: Facts::default(),
            length: None,
            sha1: None,
            msg: Vec::new(),
            other: BTreeMap::new(),
            readable: false,
            replaced: false,
            raw,
        };
        // The letter of a message that is not UTF-8 holds its bytes as they were inside
        // the JSON string: read it with those bytes replaced (U+FFFD) rather than not at
        // all. Requeue and purge go by the letter's exact bytes, so nothing is lost.
        let parsed = serde_json::from_slice::<Value>(&l.raw).or_else(|_| {
            l.replaced = std::str::from_utf8(&l.raw).is_err();
            serde_json::from_str::<Value>(&String::from_utf8_lossy(&l.raw))
        });
        let Ok(Value::Object(fields)) = parsed else {
            return l;
        };
        l.readable = fields.contains_key("msg");
        for (name, v) in &fields {
            match name.as_str() {
                "msg" => l.msg = text(v).into_bytes(),
                "key" => l.facts.key = text(v).into_bytes(),
                "event" => l.facts.event = text(v),
                "reason" => l.facts.reason = text(v),
                "ts" => {
                    l.facts.ts = v
                        .as_i64()
                        .or_else(|| text(v).trim().parse::<f64>().ok().map(|f| f as i64))
                }
                "attempts" => l.facts.attempts = v.as_u64(),
                "consumer" => l.facts.consumer = Some(text(v)),
                "length" => l.length = v.as_u64().filter(|n| *n > 0),
                "sha1" => l.sha1 = Some(text(v)).filter(|s| !s.is_empty()),
                "queue" if text(v) == queue => {}
                _ => {
                    l.other.insert(name.clone(), text(v));
                }
            }
        }
        if l.facts.event.is_empty() {
            l.facts.event = crate::message::event_of(&l.msg);
        }
        l.age_ms = l.facts.ts.map(|t| (now_ms - t.saturating_mul(1000)).max(0));
        l
    }

    /// Whether its id starts with `id` (lower-case hex).
    fn has_id(&self, id: &str) -> bool {
        sha1_smol::Sha1::from(&self.raw)
            .digest()
            .to_string()
            .starts_with(id)
    }
}

impl Letter for ListLetter {
    super::same_named_fields!();
    fn died_ms(&self) -> Option<i64> {
        self.facts.ts.map(|t| t.saturating_mul(1000))
    }
    fn age_ms(&self) -> Option<i64> {
        self.age_ms
    }
    fn place_rows(&self) -> Vec<(String, String)> {
        vec![("queue".into(), self.queue.clone())]
    }
    fn own_rows(&self, ts: bool) -> Vec<(String, String)> {
        let mut rows: Vec<(String, String)> = ts.then(|| super::ts_row(self)).into_iter().collect();
        rows.extend(self.length.map(|n| ("length".into(), n.to_string())));
        rows.extend(self.sha1.clone().map(|d| ("sha1".into(), d)));
        rows
    }
    fn readable(&self) -> bool {
        self.readable
    }
    fn as_stored(&self) -> &[u8] {
        &self.raw
    }
}

/// Deletes `letters` of `queue`'s dead list; returns how many were still there.
pub fn purge(con: &mut dyn Con, queue: &Queue, letters: &[ListLetter]) -> Result<u64, StoreError> {
    super::purged(
        letters,
        |l| l.raw.as_slice(),
        |raw| store::dead::purge_list(con, queue, raw),
    )
}

/// A walk over one dead list, oldest first, a page at a time from the tail. New letters
/// go onto the head and do not disturb it; letters the caller removes are reported with
/// [`Walk::removed`], so the next page starts right after those still there.
pub struct Walk<'a> {
    queue: &'a Queue,
    /// Letters at the tail already read and still there.
    behind: i64,
    done: bool,
}

impl<'a> Walk<'a> {
    pub fn new(queue: &'a Queue) -> Walk<'a> {
        Walk {
            queue,
            behind: 0,
            done: false,
        }
    }

    /// The next letters, oldest first; `None` once the list is exhausted.
    pub fn next_page(
        &mut self,
        con: &mut dyn Con,
        now_ms: i64,
    ) -> RedisResult<Option<Vec<ListLetter>>> {
        if self.done {
            return Ok(None);
        }
        let end = -(self.behind + 1);
        let mut raw: Vec<Vec<u8>> = redis::cmd("LRANGE")
            .arg(&self.queue.dead)
            .arg(end - (PAGE as i64 - 1))
            .arg(end)
            .query(con)?;
        if raw.len() < PAGE {
            self.done = true;
        }
        if raw.is_empty() {
            return Ok(None);
        }
        self.behind += raw.len() as i64;
        raw.reverse();
        Ok(Some(
            raw.into_iter()
                .map(|r| ListLetter::parse(r, &self.queue.name, now_ms))
                .collect(),
        ))
    }

    /// `n` letters of the pages read so far are no longer in the list.
    pub fn removed(&mut self, n: usize) {
        self.behind -= n as i64;
    }
}

/// The matching letters of every queue's dead list, queue by queue in the order given,
/// each oldest first; at most `limit`.
pub fn scan(
    con: &mut dyn Con,
    keys: &Keys,
    filter: &Filter,
    now_ms: i64,
    limit: usize,
) -> RedisResult<Vec<ListLetter>> {
    scan_queues(con, &keys.queues, filter, now_ms, limit)
}

/// [`scan`] of these queues' dead lists only.
pub fn scan_queues<'q>(
    con: &mut dyn Con,
    queues: impl IntoIterator<Item = &'q Queue>,
    filter: &Filter,
    now_ms: i64,
    limit: usize,
) -> RedisResult<Vec<ListLetter>> {
    let mut out = Vec::new();
    for q in queues {
        let mut walk = Walk::new(q);
        while out.len() < limit {
            let Some(page) = walk.next_page(con, now_ms)? else {
                break;
            };
            out.extend(page.into_iter().filter(|l| filter.matches(l, now_ms)));
        }
    }
    out.truncate(limit);
    Ok(out)
}

/// For each id, the letter it names: `Ok(None)` when no letter has it, an error when it
/// names different letters (a prefix too short). The same bytes twice are one letter.
pub fn find(
    con: &mut dyn Con,
    keys: &Keys,
    ids: &[String],
    now_ms: i64,
) -> anyhow::Result<Vec<Option<ListLetter>>> {
    let mut found: Vec<Option<ListLetter>> = vec![None; ids.len()];
    for q in &keys.queues {
        let mut walk = Walk::new(q);
        while let Some(page) = walk
            .next_page(con, now_ms)
            .context("cannot read the dead lists")?
        {
            for l in page {
                for (id, slot) in ids.iter().zip(found.iter_mut()) {
                    if !l.has_id(id) {
                        continue;
                    }
                    match slot {
                        Some(seen) if seen.raw != l.raw => {
                            anyhow::bail!(
                                "{id:?} names more than one dead letter; give more of its digits"
                            )
                        }
                        Some(_) => {}
                        None => *slot = Some(l.clone()),
                    }
                }
            }
        }
    }
    Ok(found)
}

/// Where a status page of a dead list ended: the last letter it looked at, by its id, and
/// how many letters were older than it then (its place counted from the tail). New
/// letters go onto the head and removing a letter never raises that count for any letter,
/// so every letter older than this one that is still there has a place below it: going
/// on from there skips none, whatever was pushed or removed in between.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct After {
    /// The letter's id (as [`parse_id`] gives it).
    pub id: String,
    /// Letters older than it when the page was read.
    pub older: usize,
}

/// Where a status page starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// At a position from the head (0: the newest letter).
    Head(usize),
    /// Right after a letter a previous page ended with.
    After(After),
}

/// A status page of one dead list, newest first.
#[derive(Debug, Default)]
pub struct NewestPage {
    /// The matching letters, each with its position from the head as read.
    pub letters: Vec<(usize, ListLetter)>,
    /// Where the next page starts, when more may follow.
    pub next: Option<After>,
    /// The page started after a letter that was no longer in its place (it was removed,
    /// or letters older than it were): it went on from that place, and letters of the
    /// previous page may show again; none is skipped.
    pub changed: bool,
}

/// `LLEN` and `LRANGE start stop` of `key` in one `MULTI`: one state of the list.
fn snapshot(
    con: &mut dyn Con,
    key: &str,
    start: i64,
    stop: i64,
) -> RedisResult<(usize, Vec<Vec<u8>>)> {
    redis::pipe()
        .atomic()
        .cmd("LLEN")
        .arg(key)
        .cmd("LRANGE")
        .arg(key)
        .arg(start)
        .arg(stop)
        .query(con)
}

/// The status page's view of `queue`'s dead list: newest first from `from`, up to
/// `limit` letters matching `filter`, looking at no more than `budget`. After a letter,
/// the page reads by places counted from the tail (see [`After`]), checking in each read
/// that the letter it goes on from is still in its place.
pub fn newest(
    con: &mut dyn Con,
    queue: &Queue,
    filter: &Filter,
    now_ms: i64,
    from: &Start,
    limit: usize,
    budget: usize,
) -> RedisResult<NewestPage> {
    let mut page = NewestPage::default();
    let mut looked = 0;
    let mut after = match from {
        Start::After(a) => Some(a.clone()),
        Start::Head(_) => None,
    };
    loop {
        let count = NEWEST_PAGE.min(budget.saturating_sub(looked));
        if count == 0 {
            return Ok(page);
        }
        // One state of the list: its length, the letters to look at, newest first, and
        // how many letters are older than the first of them.
        let (len, raw, first_older) = match &after {
            None => {
                let at = match from {
                    Start::Head(at) => *at,
                    Start::After(_) => 0,
                };
                let (len, raw) = snapshot(con, &queue.dead, at as i64, (at + count) as i64 - 1)?;
                (len, raw, len.saturating_sub(at + 1))
            }
            Some(a) => {
                // The letter's own place, then `count` older ones.
                let slot = -(a.older as i64) - 1;
                let stop = (slot + count as i64).min(-1);
                let (len, mut raw) = snapshot(con, &queue.dead, slot, stop)?;
                if a.older < len {
                    // What is in its place now: the letter itself, or the list changed.
                    let there = ListLetter::parse(raw.remove(0), &queue.name, now_ms);
                    if !there.has_id(&a.id) {
                        page.changed = true;
                    }
                    (len, raw, a.older.saturating_sub(1))
                } else {
                    // Fewer letters left than were older than it: each one left is older
                    // than it was; go on from the head.
                    page.changed = true;
                    let (len, raw) = snapshot(con, &queue.dead, 0, count as i64 - 1)?;
                    (len, raw, len.saturating_sub(1))
                }
            }
        };
        page.next = None;
        for (i, r) in raw.into_iter().enumerate() {
            let l = ListLetter::parse(r, &queue.name, now_ms);
            let older = first_older.saturating_sub(i);
            looked += 1;
            page.next = (older > 0).then(|| After {
                id: l.id.clone(),
                older,
            });
            if filter.matches(&l, now_ms) {
                page.letters.push((len.saturating_sub(older + 1), l));
                if page.letters.len() >= limit {
                    return Ok(page);
                }
            }
            if older == 0 {
                break;
            }
        }
        after = page.next.clone();
        if after.is_none() {
            return Ok(page);
        }
    }
}

/// For each id (as [`parse_id`] gives it), the letter of `queue`'s dead list it names,
/// looked for near where a page showed it first: from a page's length before position
/// `near` through `span` letters more (a letter's page: 1; a form: the letters its page
/// looked at), then from the head; at no more than `budget` letters from the head, and
/// `None` for an id not found within them. The same bytes several times are one letter.
pub fn find_near(
    con: &mut dyn Con,
    queue: &Queue,
    ids: &[String],
    now_ms: i64,
    (near, span): (usize, usize),
    budget: usize,
) -> RedisResult<Vec<Option<ListLetter>>> {
    let mut found: Vec<Option<ListLetter>> = vec![None; ids.len()];
    let start = near.saturating_sub(NEWEST_PAGE);
    let end = near.saturating_add(span).saturating_add(NEWEST_PAGE);
    // Near first; then from the head, but not again what was read near.
    let head = if start == 0 { end..budget } else { 0..budget };
    for range in [start..end, head] {
        let mut a = range.start;
        while a < range.end {
            let b = (a + NEWEST_PAGE).min(range.end);
            let raw: Vec<Vec<u8>> = redis::cmd("LRANGE")
                .arg(&queue.dead)
                .arg(a)
                .arg(b - 1)
                .query(con)?;
            let short = raw.len() < b - a;
            for r in raw {
                let l = ListLetter::parse(r, &queue.name, now_ms);
                for (id, slot) in ids.iter().zip(found.iter_mut()) {
                    if slot.is_none() && l.has_id(id) {
                        *slot = Some(l.clone());
                    }
                }
            }
            if found.iter().all(Option::is_some) {
                return Ok(found);
            }
            if short {
                break; // the end of the list
            }
            a = b;
        }
    }
    Ok(found)
}

/// An id as `worker dead list` prints it (or a prefix of it): hex digits, lower-cased.
pub fn parse_id(s: &str) -> anyhow::Result<String> {
    let id = s.trim().to_ascii_lowercase();
    anyhow::ensure!(
        (MIN_ID_LEN..=40).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{s:?} is not a list dead-letter id (like 3f2a9c01d4e5b6a7, as `worker dead list` shows)"
    );
    Ok(id)
}

/// The message a letter puts back onto its queue, and whether it is a JSON object; or
/// why it cannot go back: it keeps no message, only the start of an oversized one, or it
/// is not a letter the worker wrote.
pub fn requeueable(l: &ListLetter, q: &Queue) -> Result<(Vec<u8>, bool), String> {
    if !l.readable {
        return Err("not a dead letter as the worker writes them (a JSON object with a \"msg\"); see `worker dead show`".into());
    }
    if l.replaced {
        return Err("its message is not UTF-8, so the worker would only dead-letter it again; fix the producer, then purge it".into());
    }
    if l.msg.is_empty() {
        return Err("it keeps no message (the mover's letter of a member whose data never arrived, or of a retry replaced by a newer push)".into());
    }
    if let Some(len) = l.length.filter(|n| *n > l.msg.len() as u64) {
        return Err(format!(
            "it keeps only the first {} bytes of a {len}-byte message (over --max-message-bytes)",
            l.msg.len()
        ));
    }
    if q.raw_event.is_some() {
        // A raw queue's message is the payload itself: a `retry` in it is the producer's.
        let object = matches!(
            serde_json::from_slice::<Value>(&l.msg),
            Ok(Value::Object(_))
        );
        return Ok((l.msg.clone(), object));
    }
    Ok(requeue_message(&l.msg))
}

/// Requeues `letters`, all of `queue`'s dead list, one script call per [`PAGE`],
/// unscreened.
pub fn requeue(
    con: &mut dyn Con,
    keys: &Keys,
    queue: &Queue,
    letters: &[ListLetter],
) -> Result<RequeueReport, StoreError> {
    requeue_with(con, keys, queue, letters, None)
}

/// [`requeue`], each letter first held against `screen` (see `stream::requeue_with`).
pub fn requeue_with(
    con: &mut dyn Con,
    keys: &Keys,
    queue: &Queue,
    letters: &[ListLetter],
    screen: Option<&super::Screen>,
) -> Result<RequeueReport, StoreError> {
    let mut report = RequeueReport::default();
    let mut ready = Vec::new();
    for l in letters {
        let screened = match screen {
            None => Ok(None),
            Some(sc) => sc.check(&l.msg, queue.raw_event.as_deref()).map(Some),
        };
        match (requeueable(l, queue), screened) {
            (Err(why), _) => report.cannot.push((l.id.clone(), why)),
            (Ok(_), Err(why)) => report.refused.push((l.id.clone(), why.to_string())),
            (Ok(x), Ok(None)) => ready.push((l, x.0, x.1)),
            // Renamed (or as it was): the requeue's own rewrite on top.
            (Ok(_), Ok(Some(msg))) if queue.raw_event.is_some() => ready.push((l, msg, true)),
            (Ok(_), Ok(Some(msg))) => {
                let (msg, object) = super::requeue_message(&msg);
                ready.push((l, msg, object));
            }
        }
    }
    for batch in ready.chunks(PAGE) {
        let args: Vec<(&[u8], &[u8], &[u8])> = batch
            .iter()
            .map(|(l, msg, _)| (l.raw.as_slice(), l.facts.key.as_slice(), msg.as_slice()))
            .collect();
        let codes = store::dead::requeue_list(con, keys, queue, &args)?;
        for ((l, _, object), code) in batch.iter().zip(codes) {
            report.record(&l.id, code, *object);
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    #[test]
    fn a_letter_of_a_message_that_is_not_utf8_is_readable() {
        let mut raw = br#"{"msg":""#.to_vec();
        raw.extend_from_slice(b"\xff\xfegarbage");
        raw.extend_from_slice(
            br#"","reason":"message is not valid UTF-8","ts":1799999940,"key":"k2"}"#,
        );
        let l = ListLetter::parse(raw, "q", NOW);
        assert!(l.readable);
        assert_eq!(l.facts.reason, "message is not valid UTF-8");
        assert_eq!(l.age_ms, Some(60_000));
        assert_eq!(l.facts.key, b"k2");
        assert!(String::from_utf8_lossy(&l.msg).ends_with("garbage"));
        // Its message is read with the bad bytes replaced: never put back like that.
        assert!(l.replaced);
    }

    #[test]
    fn letters_parse_as_the_scripts_write_them() {
        let raw = br#"{"msg":"{\"event\":\"e\",\"payload\":{}}","reason":"boom","ts":1799999940,"event":"","key":"k1","attempts":3,"consumer":"c1","queue":"q","length":0,"sha1":""}"#;
        let l = ListLetter::parse(raw.to_vec(), "q", NOW);
        assert!(l.readable);
        assert_eq!(l.id.len(), ID_LEN);
        assert!(l.has_id(&l.id));
        assert_eq!(
            (l.facts.event.as_str(), l.facts.reason.as_str()),
            ("e", "boom")
        );
        assert_eq!(
            (l.facts.key.as_slice(), l.facts.attempts),
            (&b"k1"[..], Some(3))
        );
        assert_eq!((l.facts.ts, l.age_ms), (Some(1_799_999_940), Some(60_000)));
        assert_eq!((l.length, l.sha1.as_deref()), (None, None));
        assert!(l.other.is_empty(), "{:?}", l.other);
        let q = Queue::new("q", None);
        assert!(requeueable(&l, &q).is_ok());

        let f = |older: Option<u64>, newer: Option<u64>| Filter {
            event: None,
            older_than: older.map(std::time::Duration::from_secs),
            newer_than: newer.map(std::time::Duration::from_secs),
        };
        assert!(f(Some(59), None).matches(&l, NOW));
        assert!(!f(Some(61), None).matches(&l, NOW));
        assert!(f(None, Some(61)).matches(&l, NOW));
        assert!(!f(None, Some(59)).matches(&l, NOW));

        let bare = ListLetter::parse(b"{}".to_vec(), "q", NOW);
        assert!(!bare.readable && bare.age_ms.is_none());
        assert!(!f(Some(0), None).matches(&bare, NOW), "no ts, no age");
        assert!(requeueable(&bare, &q).is_err());
        let cut = ListLetter::parse(
            br#"{"msg":"{\"ev","length":70000,"sha1":"ab","ts":1}"#.to_vec(),
            "q",
            NOW,
        );
        assert!(requeueable(&cut, &q).unwrap_err().contains("first 4 bytes"));
        let none = ListLetter::parse(br#"{"msg":"","key":"k"}"#.to_vec(), "q", NOW);
        assert!(requeueable(&none, &q).unwrap_err().contains("no message"));
    }

    #[test]
    fn a_raw_queue_s_message_goes_back_byte_for_byte() {
        let raw = br#"{"msg":"{\"order_no\":\"SO1\",\"retry\":5}","ts":1}"#;
        let l = ListLetter::parse(raw.to_vec(), "pay", NOW);
        let q = Queue::new("pay", Some("payment.paid"));
        assert_eq!(
            requeueable(&l, &q).unwrap(),
            (br#"{"order_no":"SO1","retry":5}"#.to_vec(), true)
        );
        let q = Queue::new("pay", None);
        let (msg, _) = requeueable(&l, &q).unwrap();
        assert!(String::from_utf8(msg).unwrap().contains(r#""retry":0"#));
    }

    #[test]
    fn ids_are_hex_prefixes() {
        assert_eq!(parse_id(" 3F2A9C01D4E5B6A7 ").unwrap(), "3f2a9c01d4e5b6a7");
        for bad in ["", "3f2a9c0", "1768764300123-0", "xyzxyzxyz"] {
            assert!(parse_id(bad).is_err(), "{bad:?}");
        }
    }
}
