//! The delay pool split by event, with each event's next due time (`worker stats`).
//!
//! The event of a member is in its data (the message's `event`), so a split of the whole
//! pool would read every message. This reads the [`SAMPLE`] members due soonest of each
//! shard's pool instead (two bounded `ZRANGEBYSCORE ... LIMIT`s, one per kind of score,
//! and one `HMGET` of their data, in one pipeline and one more round trip): the next due
//! time of each event among them is exact for every event that has a member among the
//! soonest, and the counts are those of the sample, which the report says when it is not
//! the whole pool.

use crate::keys::Keys;
use crate::store::value_to_string;
use redis::{RedisResult, Value};
use serde::Serialize;
use std::collections::BTreeMap;

/// Members looked at per shard: the ones due soonest.
pub const SAMPLE: usize = 1000;

/// The split of the pool's soonest members by event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ByEvent {
    /// Members looked at (every shard's soonest, at most [`SAMPLE`] each).
    pub sampled: u64,
    /// Whether they are the whole pool: the counts are then the pool's.
    pub complete: bool,
    /// By event name, the soonest due first.
    pub events: Vec<EventFigures>,
}

/// One event among the sampled members.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventFigures {
    /// The message's event; `(no data)` for a member whose data is missing, `(not JSON)`
    /// for data without an event.
    pub event: String,
    /// Its members among those sampled.
    pub scheduled: u64,
    /// Of those, already due (waiting for the mover).
    pub due: u64,
    /// Its soonest due time (unix ms, Redis's clock).
    pub next_due_ms: i64,
}

/// Reads the split at `now_ms` from each of `shards`' pools; `pool_size` is the pool's
/// total (every shard), to tell whether the sample is all of it.
pub fn gather(
    con: &mut dyn redis::ConnectionLike,
    shards: &[Keys],
    now_ms: i64,
    pool_size: u64,
) -> RedisResult<ByEvent> {
    let mut p = redis::pipe();
    for k in shards {
        // Seconds scores are below 1e11 and sort before every millisecond score: the
        // soonest of each kind, merged below (as lua/move_due.lua reads them).
        for (min, max) in [("-inf", "(1e11"), ("1e11", "+inf")] {
            p.cmd("ZRANGEBYSCORE")
                .arg(&k.pool)
                .arg(min)
                .arg(max)
                .arg("WITHSCORES")
                .arg("LIMIT")
                .arg(0)
                .arg(SAMPLE);
        }
    }
    let replies: Vec<Value> = p.query(con)?;
    let mut per_shard = Vec::new();
    for (k, pair) in shards.iter().zip(replies.chunks(2)) {
        let mut members: Vec<(String, i64)> = Vec::new();
        for (reply, scale) in pair.iter().zip([1000.0, 1.0]) {
            members.extend(with_scores(reply, scale));
        }
        members.sort_by_key(|(_, due)| *due);
        members.truncate(SAMPLE);
        per_shard.push((k, members));
    }
    let mut p = redis::pipe();
    for (k, members) in &per_shard {
        if members.is_empty() {
            continue;
        }
        let mut c = redis::cmd("HMGET");
        c.arg(&k.data);
        for (m, _) in members {
            c.arg(m);
        }
        p.add_command(c);
    }
    let data: Vec<Vec<Value>> = if per_shard.iter().any(|(_, m)| !m.is_empty()) {
        p.query(con)?
    } else {
        Vec::new()
    };
    let mut events: BTreeMap<String, EventFigures> = BTreeMap::new();
    let mut sampled = 0u64;
    let mut data = data.into_iter();
    for (_, members) in per_shard.iter().filter(|(_, m)| !m.is_empty()) {
        let values = data.next().unwrap_or_default();
        for ((_, due), v) in members
            .iter()
            .zip(values.iter().chain(std::iter::repeat(&Value::Nil)))
        {
            sampled += 1;
            let event = match v {
                Value::Nil => "(no data)".to_string(),
                v => match crate::message::event_of(value_to_string(v).as_bytes()) {
                    e if e.is_empty() => "(not JSON)".to_string(),
                    e => e,
                },
            };
            let f = events.entry(event.clone()).or_insert(EventFigures {
                event,
                scheduled: 0,
                due: 0,
                next_due_ms: *due,
            });
            f.scheduled += 1;
            f.due += u64::from(*due <= now_ms);
            f.next_due_ms = f.next_due_ms.min(*due);
        }
    }
    let mut events: Vec<EventFigures> = events.into_values().collect();
    events.sort_by(|a, b| (a.next_due_ms, &a.event).cmp(&(b.next_due_ms, &b.event)));
    Ok(ByEvent {
        sampled,
        complete: sampled >= pool_size,
        events,
    })
}

/// A `ZRANGEBYSCORE ... WITHSCORES` reply as (member, due ms); `scale` turns a score
/// into milliseconds.
fn with_scores(v: &Value, scale: f64) -> Vec<(String, i64)> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    items
        .chunks(2)
        .filter_map(|pair| {
            let member = value_to_string(pair.first()?);
            let score: f64 = match pair.get(1)? {
                Value::Double(d) => *d,
                other => value_to_string(other).parse().ok()?,
            };
            // `as` saturates: -inf or 1e300 is a very old or far due time, not UB.
            Some((member, (score * scale) as i64))
        })
        .collect()
}
