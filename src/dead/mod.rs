//! The dead letters, one model for both kinds: the dead-letter stream of stream mode
//! (`stream.rs`; one a shard with `--shards N`) and list mode's dead lists (`list.rs`).
//! Reading (oldest first, a page at a time, for `worker dead`; newest first, a bounded
//! page, for the status page), finding letters by id, requeueing and purging them, each
//! one atomic change per batch of [`PAGE`]. Both `worker dead` (`admin/dead.rs`, the
//! terminal) and the status page (`status/`, HTML) drive this model and format on top of
//! it; [`Letter`] is what a letter of either kind shows alike.
//!
//! A letter's age is from when it died: the time in its stream id, or a list letter's
//! `ts`. The stream model's functions are also named here (`dead::scan`, `dead::fetch`,
//! ...), since stream mode is the default.

pub mod list;
pub mod screen;
pub mod stream;

pub use screen::{Doomed, Screen};
pub use stream::{
    fetch, locate, newest, newest_sharded, oldest_sharded, purge, requeue, requeue_with, scan,
    DeadLetter, OldestFirst, Place, Scan, ShardPage,
};

use crate::store::dead::Requeued;
use clap::Args;
use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::time::Duration;

/// Dead letters per read page and per requeue or purge script call: small enough that one
/// call holds Redis for well under a millisecond per letter.
pub const PAGE: usize = 100;

/// Letters per read of a newest-first page (the status page's): dead letters are small,
/// but one may hold up to `--max-message-bytes`, so a page read stays a few megabytes at
/// most.
pub const NEWEST_PAGE: usize = 50;

/// Which dead letters a command applies to. A dead letter's age is the time in its id.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Dead-letter options")]
pub struct Filter {
    /// Only dead letters of this event.
    #[arg(long)]
    pub event: Option<String>,
    /// Only dead letters older than this, e.g. 1h or 7d.
    #[arg(long, value_parser = crate::config::parse_duration)]
    pub older_than: Option<Duration>,
    /// Only dead letters newer than this, e.g. 10m.
    #[arg(long, value_parser = crate::config::parse_duration)]
    pub newer_than: Option<Duration>,
}

impl Filter {
    /// Whether a letter passes `--event` and the ages. A letter that cannot tell when it
    /// died (a list letter without `ts`) matches no age filter.
    pub fn matches(&self, l: &impl Letter, now_ms: i64) -> bool {
        let died = l.died_ms();
        self.event.as_ref().is_none_or(|e| *e == l.facts().event)
            && self
                .older_than
                .is_none_or(|a| died.is_some_and(|t| t <= now_ms - millis(a)))
            && self
                .newer_than
                .is_none_or(|a| died.is_some_and(|t| t >= now_ms - millis(a)))
    }
}

pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What every dead letter says, of either kind, as the worker's scripts write it (other
/// writers may leave fields out).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Facts {
    /// The `event` field, or the message's own when a writer left the field out.
    pub event: String,
    /// The job key (`key` field), bytes as written; empty when the writer had none.
    #[serde(serialize_with = "lossy")]
    pub key: Vec<u8>,
    /// How often the message was tried.
    pub attempts: Option<u64>,
    pub reason: String,
    /// `ts`: when it died, unix seconds.
    pub ts: Option<i64>,
    /// The consumer that gave up on it.
    pub consumer: Option<String>,
}

/// What a dead letter of either kind shows alike, for the terminal and for HTML.
pub trait Letter {
    /// Its id as the operator writes it (a stream id, or a list letter's digest).
    fn id(&self) -> &str;
    fn facts(&self) -> &Facts;
    /// When it died (unix ms), when known.
    fn died_ms(&self) -> Option<i64>;
    /// Since it died, when known.
    fn age_ms(&self) -> Option<i64>;
    /// The message it keeps.
    fn msg(&self) -> &[u8];
    /// Fields this version does not know, as written.
    fn other(&self) -> &BTreeMap<String, String>;
    /// Where it lives besides its key set: the queue of a list letter.
    fn place_rows(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Its own rows after the consumer: the stream entry it was; the size of a message cut
    /// short. `ts`: with the letter's `ts` row.
    fn own_rows(&self, ts: bool) -> Vec<(String, String)>;
    /// False for an entry that is not a letter as the worker writes them (its fields are
    /// blank; it is shown as stored).
    fn readable(&self) -> bool {
        true
    }
    /// Its bytes as stored, for one that is not [`readable`](Letter::readable).
    fn as_stored(&self) -> &[u8] {
        self.msg()
    }
}

/// The accessors of [`Letter`] that both kinds answer from fields of the same name.
macro_rules! same_named_fields {
    () => {
        fn id(&self) -> &str {
            &self.id
        }
        fn facts(&self) -> &Facts {
            &self.facts
        }
        fn msg(&self) -> &[u8] {
            &self.msg
        }
        fn other(&self) -> &BTreeMap<String, String> {
            &self.other
        }
    };
}
use same_named_fields;

/// Every field of a letter as (name, value) rows, in the order both `worker dead show` and
/// the letter's page show them: its id (under `id_name`), where it lives, when it died,
/// what it was, its own rows, then the fields this version does not know.
pub fn rows(l: &dyn Letter, id_name: &str, id: String, ts: bool) -> Vec<(String, String)> {
    let dash = |o: Option<String>| o.unwrap_or_else(|| "-".into());
    let died = match (l.died_ms(), l.age_ms()) {
        (Some(t), Some(age)) => format!(
            "{} ({} ago)",
            crate::text::fmt_time(t),
            crate::text::fmt_age(age)
        ),
        _ => "? (no ts)".into(),
    };
    let f = l.facts();
    let mut rows = vec![(id_name.to_string(), id)];
    rows.extend(l.place_rows());
    rows.extend([
        ("died".to_string(), died),
        ("event".into(), f.event.clone()),
        ("key".into(), String::from_utf8_lossy(&f.key).into_owned()),
        ("attempts".into(), dash(f.attempts.map(|n| n.to_string()))),
        ("reason".into(), f.reason.clone()),
        ("consumer".into(), dash(f.consumer.clone())),
    ]);
    rows.extend(l.own_rows(ts));
    rows.extend(l.other().iter().map(|(k, v)| (k.clone(), v.clone())));
    rows
}

/// The `ts` row of a letter.
fn ts_row(l: &dyn Letter) -> (String, String) {
    (
        "ts".into(),
        l.facts().ts.map_or("-".into(), |t| t.to_string()),
    )
}

pub(crate) fn lossy<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(b))
}

/// A dead-letter id of `--shards N` as the operator sees it: `<shard>/<id>`.
pub fn shard_id(shard: usize, id: &str) -> String {
    format!("{shard}/{id}")
}
/// The message to requeue and whether `retry` could be reset: a JSON object gets
/// `retry: 0` and no `last_error`, `failed_at`, `held_at`, `waited_lock`, `waited_since` or `refused_at`, with every other field kept (the same rewrite a retry
/// makes, see `Envelope::next_retry`); one whose `retry` is already 0 or absent (and no
/// `last_error`) goes back byte for byte; anything else goes back as written (it will be dead-lettered again).
pub fn requeue_message(msg: &[u8]) -> (Vec<u8>, bool) {
    match serde_json::from_slice::<serde_json::Value>(msg) {
        Ok(serde_json::Value::Object(mut m)) => {
            let fresh = m.get("retry").is_none_or(|r| r.as_u64() == Some(0));
            if fresh
                && !m.contains_key(crate::message::LAST_ERROR)
                && !m.contains_key(crate::message::FAILED_AT)
                && !m.contains_key(crate::message::HELD_AT)
                && !m.contains_key(crate::message::WAITED_LOCK)
                && !m.contains_key(crate::message::WAITED_SINCE)
                && !m.contains_key(crate::message::REFUSED_AT)
            {
                return (msg.to_vec(), true);
            }
            m.insert("retry".into(), 0.into());
            // A requeue starts its tries afresh: the last try's error is history.
            m.remove(crate::message::LAST_ERROR);
            m.remove(crate::message::FAILED_AT);
            m.remove(crate::message::HELD_AT);
            m.remove(crate::message::WAITED_LOCK);
            m.remove(crate::message::WAITED_SINCE);
            m.remove(crate::message::REFUSED_AT);
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

/// Why a letter stays when its job key's data is there with no schedule.
const DATA_UNSCHEDULED: &str = "its job key's data is in the delay pool's data hash with no schedule (a push under way, or one cut between its HSET and its ZADD): if it stays, finish that push (push the job again) or delete that field, then requeue";

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
    /// Left in the dead letters because they would die again at once (no handler for the
    /// event, a required field missing, not a whole message: [`Screen`]): (id, why).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<(String, String)>,
}

impl RequeueReport {
    pub fn add(&mut self, r: RequeueReport) {
        self.requeued.extend(r.requeued);
        self.as_is.extend(r.as_is);
        self.key_scheduled.extend(r.key_scheduled);
        self.gone.extend(r.gone);
        self.cannot.extend(r.cannot);
        self.refused.extend(r.refused);
    }

    /// The same, its ids written `<shard>/<id>`.
    pub fn in_shard(self, shard: usize) -> RequeueReport {
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
            refused: self
                .refused
                .into_iter()
                .map(|(id, why)| (shard_id(shard, &id), why))
                .collect(),
        }
    }

    /// Records what the store's script did with one letter; `json`: its message is a JSON
    /// object (else it went back as written).
    fn record(&mut self, id: &str, code: Requeued, json: bool) {
        let id = id.to_string();
        match code {
            Requeued::Requeued => {
                if !json {
                    self.as_is.push(id.clone());
                }
                self.requeued.push(id);
            }
            Requeued::KeyScheduled => self.key_scheduled.push(id),
            Requeued::DataUnscheduled => self.cannot.push((id, DATA_UNSCHEDULED.into())),
            Requeued::Gone => self.gone.push(id),
        }
    }
}

/// The letters found for ids named, in order, and the ids found nowhere; a letter found
/// that `keep` refuses (a filter) is neither. The same id twice is one letter.
pub fn sort_found<L>(
    ids: &[String],
    found: Vec<Option<L>>,
    keep: impl Fn(&L) -> bool,
) -> (Vec<L>, Vec<String>) {
    let mut letters = Vec::new();
    let mut missing = Vec::new();
    for (id, l) in ids.iter().zip(found) {
        match l {
            Some(l) if keep(&l) => letters.push(l),
            Some(_) => {}
            None => missing.push(id.clone()),
        }
    }
    (letters, missing)
}

/// Ids named once each, in the order given.
pub fn distinct(ids: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

/// What a purge does, a batch of [`PAGE`] at a time: each letter named as the store knows
/// it (`handle`), each batch deleted by `purge_batch`; the sum of what those say they
/// deleted.
fn purged<'l, L, H, E>(
    letters: &'l [L],
    handle: impl Fn(&'l L) -> H,
    mut purge_batch: impl FnMut(&[H]) -> Result<u64, E>,
) -> Result<u64, E> {
    let mut n = 0;
    for batch in letters.chunks(PAGE) {
        let named: Vec<H> = batch.iter().map(&handle).collect();
        n += purge_batch(&named)?;
    }
    Ok(n)
}
