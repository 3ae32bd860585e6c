//! The producer side: schedule and cancel delayed jobs (what `worker push` and
//! `worker cancel` call, and what a Rust service embeds).
//!
//! Writes exactly what the PHP producer writes: the message JSON into the
//! data hash and the job key into the pool, but in one atomic script, data first, so the
//! mover never sees a member without data. Scores are written in milliseconds.

use crate::keys::Keys;
use crate::message::Envelope;
use crate::store;
use redis::ConnectionLike;
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("the payload must be a JSON object")]
    PayloadNotObject,
    #[error("the event name must not be empty")]
    EmptyEvent,
    #[error("the job key must not be empty")]
    EmptyKey,
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// A job to schedule.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub event: String,
    pub payload: Value,
    /// Due time, unix milliseconds.
    pub due_ms: i64,
    /// Job key; `None` makes one the way the PHP producer does (`<secs>:<12 hex>`).
    /// A deterministic key (`order.timeout:SO1`) makes push idempotent and cancel easy.
    pub key: Option<String>,
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    pub key: String,
    pub due_ms: i64,
    /// The key was already scheduled and has been moved to the new due time.
    pub rescheduled: bool,
}

/// Schedules `job`. `now_ms` stamps the message's `ts`.
pub fn push(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    job: &NewJob,
    now_ms: i64,
) -> Result<Pushed, PushError> {
    let Value::Object(payload) = &job.payload else {
        return Err(PushError::PayloadNotObject);
    };
    if job.event.trim().is_empty() {
        return Err(PushError::EmptyEvent);
    }
    let key = match &job.key {
        Some(k) if k.is_empty() => return Err(PushError::EmptyKey),
        Some(k) => k.clone(),
        None => new_job_key(now_ms),
    };
    let msg = Envelope::new(&job.event, payload.clone(), now_ms / 1000).to_json();
    let rescheduled = store::push(con, keys, &key, &msg, job.due_ms)?;
    Ok(Pushed {
        key,
        due_ms: job.due_ms,
        rescheduled,
    })
}

/// Removes a scheduled job; `true` if it was there.
pub fn cancel(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    key: &str,
) -> Result<bool, crate::store::StoreError> {
    store::cancel(con, keys, key)
}

/// `<unix seconds>:<12 hex>`, the PHP producer's key shape.
pub fn new_job_key(now_ms: i64) -> String {
    format!(
        "{}:{:012x}",
        now_ms / 1000,
        fastrand::u64(..) & 0xffff_ffff_ffff
    )
}

/// Builds a payload object from `(name, value)` pairs; handy in tests and tools.
pub fn payload<const N: usize>(fields: [(&str, Value); N]) -> Value {
    let mut m = Map::new();
    for (k, v) in fields {
        m.insert(k.to_string(), v);
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    #[test]
    fn generated_keys_look_like_the_php_ones() {
        let k = super::new_job_key(1_768_764_300_123);
        let (secs, hex) = k.split_once(':').unwrap();
        assert_eq!(secs, "1768764300");
        assert_eq!(hex.len(), 12);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
