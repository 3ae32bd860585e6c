//! The message envelope of the wire contract and its validation.
//!
//! `{"event": "order.timeout", "payload": {...}, "retry": 0, "ts": 1768764300}`.
//! Decoding never panics and never trusts the producer: every way a message can be wrong
//! is a [`Rejection`] whose text becomes the dead letter's `reason`. Unknown fields are
//! kept, so a retried message goes back to the pool as the producer wrote it, with only
//! `retry` raised.
//!
//! **Job identity.** Each time a message leaves the pool the mover stamps a `job_id` as
//! its first field (`lua/move_due.lua`): the same id for a retry, a held job or a requeued
//! dead letter going round again (the script that wrote it back remembered it), otherwise
//! the identity of what the producer wrote: `<due µs>-<a>-<b>`, from a digest of the
//! pool, the member, its score and its data. So a move undone by a failover and done
//! again is the same job, while the same key pushed again with other data or another due
//! time, even within the same second, is a new one. A job is its key plus that id (plus
//! `ts`); stamps of older movers (`<µs>-<n>`, from the move's time) are read the same way.
//! Only the exact prefix `{"job_id":"<digits and dashes>"` is the stamp ([`stamp_of`]); a
//! `job_id` elsewhere is a field like any other. `ts` may be an integer, a float or
//! a numeric string (PHP's `time()` and `microtime(true)` both occur).

use serde_json::{Map, Value};
use std::fmt;

/// A decoded, structurally valid message.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub event: String,
    /// Always a JSON object.
    pub payload: Value,
    /// How many times this message has been retried after a transient failure.
    pub retry: u32,
    /// When the producer wrote it (unix seconds, rounded down; 0 if absent or not a
    /// number). Part of the inbox key.
    pub ts: i64,
    /// The mover's stamp, the job's identity (see the module header); `None` for messages
    /// never moved by a mover that stamps (a producer's raw list message, a hand-written
    /// stream entry).
    pub job_id: Option<String>,
    /// When the job first fell due (unix ms), written by the worker into a message it
    /// sends back to the pool (a retry, a job held): lateness and the contention horizon
    /// count from it. `None` for a message never sent back.
    pub first_due: Option<i64>,
    /// The object as received, unknown fields included, but for `payload` (held above, so
    /// a job's payload is not copied on its way to the handler; [`Envelope::whole`] puts
    /// it back for a message sent on).
    raw: Map<String, Value>,
}

/// Why a message can never succeed. Permanent: it goes to the dead letters at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    Empty,
    TooLarge { size: usize, limit: usize },
    NotUtf8,
    NotJson(String),
    NotAnObject,
    MissingEvent,
    BadEvent,
    MissingPayload,
    BadPayload,
    BadRetry,
    UnknownEvent(String),
    MissingField { event: String, fields: String },
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Empty => write!(
                f,
                "message is empty (a stream entry without a \"msg\" field?)"
            ),
            Rejection::TooLarge { size, limit } => {
                write!(f, "message too large: {size} bytes, limit {limit}")
            }
            Rejection::NotUtf8 => write!(f, "message is not valid UTF-8"),
            Rejection::NotJson(e) => write!(f, "message is not JSON: {e}"),
            Rejection::NotAnObject => write!(f, "message is not a JSON object"),
            Rejection::MissingEvent => write!(f, "message has no \"event\""),
            Rejection::BadEvent => write!(f, "\"event\" is not a non-empty string"),
            Rejection::MissingPayload => write!(f, "message has no \"payload\""),
            Rejection::BadPayload => write!(f, "\"payload\" is not a JSON object"),
            Rejection::BadRetry => write!(f, "\"retry\" is not a non-negative integer"),
            Rejection::UnknownEvent(e) => write!(f, "unknown event {e:?}"),
            Rejection::MissingField { event, fields } => {
                write!(f, "payload of {event:?} is missing {fields}")
            }
        }
    }
}

/// Size limit, UTF-8, JSON, and an object at the top: what every message must pass.
fn parse_object(bytes: &[u8], limit: usize) -> Result<Map<String, Value>, Rejection> {
    if bytes.is_empty() {
        return Err(Rejection::Empty);
    }
    if bytes.len() > limit {
        return Err(Rejection::TooLarge {
            size: bytes.len(),
            limit,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|_| Rejection::NotUtf8)?;
    // serde_json refuses nesting deeper than 128 levels, so hostile depth is an error
    // here, not a stack overflow.
    let value: Value = serde_json::from_str(text).map_err(|e| Rejection::NotJson(e.to_string()))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(Rejection::NotAnObject),
    }
}

impl Envelope {
    /// Decodes and checks the envelope. `limit` is the size limit in bytes.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Envelope, Rejection> {
        let mut raw = parse_object(bytes, limit)?;
        let event = match raw.get("event") {
            None | Some(Value::Null) => return Err(Rejection::MissingEvent),
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(_) => return Err(Rejection::BadEvent),
        };
        let payload = match raw.remove("payload") {
            None | Some(Value::Null) => return Err(Rejection::MissingPayload),
            Some(p @ Value::Object(_)) => p,
            Some(_) => return Err(Rejection::BadPayload),
        };
        let retry = match raw.get("retry") {
            None | Some(Value::Null) => 0,
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(Rejection::BadRetry)?,
        };
        // A malformed `ts` is treated as absent rather than rejecting a good message.
        let ts = raw.get("ts").map_or(0, unix_seconds);
        let job_id = stamp_of(bytes);
        let first_due = raw.get(FIRST_DUE).and_then(Value::as_i64);
        Ok(Envelope {
            event,
            payload,
            retry,
            ts,
            job_id,
            first_due,
            raw,
        })
    }

    /// A raw message of a list queue that carries one event without the envelope
    /// (`--queue payment_queue=payment.paid`): the whole JSON object is the payload.
    pub fn decode_raw(bytes: &[u8], limit: usize, event: &str) -> Result<Envelope, Rejection> {
        Ok(Envelope::new(event, parse_object(bytes, limit)?, 0))
    }

    /// A new message as our producer writes it.
    pub fn new(event: &str, payload: Map<String, Value>, ts: i64) -> Envelope {
        let mut raw = Map::new();
        raw.insert("event".into(), Value::String(event.to_string()));
        let payload = Value::Object(payload);
        raw.insert("retry".into(), Value::from(0));
        raw.insert("ts".into(), Value::from(ts));
        Envelope {
            event: event.to_string(),
            payload,
            retry: 0,
            ts,
            job_id: None,
            first_due: None,
            raw,
        }
    }

    /// The message to re-queue after a transient failure: the same object, unknown
    /// fields kept, `retry` raised by one.
    /// `job_id` stays the first field, as the mover checks it there.
    pub fn next_retry(&self) -> String {
        let mut raw = self.whole();
        raw.insert("retry".into(), Value::from(self.retry.saturating_add(1)));
        to_wire(raw, self.job_id.as_deref())
    }

    /// The message to send back to the pool: the same object, unknown fields kept, with
    /// `retry` and `first_due` as given (`first_due` already there is kept).
    pub fn requeued(&self, retry: u32, first_due: i64) -> String {
        let mut raw = self.whole();
        raw.insert("retry".into(), Value::from(retry));
        raw.insert(
            FIRST_DUE.into(),
            Value::from(self.first_due.unwrap_or(first_due)),
        );
        to_wire(raw, self.job_id.as_deref())
    }

    /// [`Envelope::requeued`] with why it goes back (`last_error`, cut at
    /// [`LAST_ERROR_CHARS`]), for `worker trace`, and when it failed (`failed_at`, unix
    /// ms on Redis's clock); without them when the message would outgrow `limit` (the
    /// mover would bury it).
    pub fn requeued_after(
        &self,
        retry: u32,
        first_due: i64,
        error: &str,
        failed_at: i64,
        limit: usize,
    ) -> String {
        self.requeued_waiting(retry, first_due, (error, failed_at), false, limit)
    }

    /// [`Envelope::requeued_after`], saying whether the job waited in vain for a lock
    /// another transaction held (`waited_lock`): its next try may wait less long
    /// ([`Envelope::waited_lock`]).
    pub fn requeued_waiting(
        &self,
        retry: u32,
        first_due: i64,
        (error, failed_at): (&str, i64),
        waited_lock: bool,
        limit: usize,
    ) -> String {
        let plain = self.requeued(retry, first_due);
        let mut raw = self.whole();
        raw.insert("retry".into(), Value::from(retry));
        raw.insert(
            FIRST_DUE.into(),
            Value::from(self.first_due.unwrap_or(first_due)),
        );
        let cut: String = error.chars().take(LAST_ERROR_CHARS).collect();
        raw.insert(LAST_ERROR.into(), Value::from(cut));
        raw.insert(FAILED_AT.into(), Value::from(failed_at));
        match waited_lock {
            true => {
                raw.insert(WAITED_LOCK.into(), Value::from(true));
                let since = self.waited_since().unwrap_or(failed_at);
                raw.insert(WAITED_SINCE.into(), Value::from(since));
            }
            false => {
                raw.remove(WAITED_LOCK);
                raw.remove(WAITED_SINCE);
            }
        };
        let with = to_wire(raw, self.job_id.as_deref());
        if with.len() > limit {
            plain
        } else {
            with
        }
    }

    /// The failure a worker wrote when it last sent the message back (cut to
    /// `LAST_ERROR_CHARS`), if any.
    pub fn last_error(&self) -> Option<&str> {
        self.raw.get(LAST_ERROR).and_then(Value::as_str)
    }

    /// Whether the job's last try waited in vain for a lock another transaction held (a
    /// lock or statement timeout), as the worker that sent it back wrote it.
    pub fn waited_lock(&self) -> bool {
        self.raw.get(WAITED_LOCK).and_then(Value::as_bool) == Some(true)
    }

    /// Since when the job's tries have waited in vain for a lock, one after another (unix
    /// ms on Redis's clock): its first such failure, as the workers that sent it back
    /// wrote it. A process started during a lock counts a standstill from the earliest of
    /// these it finds in the pool.
    pub fn waited_since(&self) -> Option<i64> {
        if !self.waited_lock() {
            return None;
        }
        self.raw.get(WAITED_SINCE).and_then(Value::as_i64)
    }

    /// When the job last failed (unix ms on Redis's clock), as the worker that sent it
    /// back wrote it, if it did.
    pub fn failed_at(&self) -> Option<i64> {
        self.raw.get(FAILED_AT).and_then(Value::as_i64)
    }

    /// When a worker first held the job as the surroundings' fault (unix ms on Redis's
    /// clock): a shop rule refused it and no job of its event had shown the fault to be
    /// the job's own. Such a job is a dead letter only on proof.
    pub fn held_at(&self) -> Option<i64> {
        self.raw.get(HELD_AT).and_then(Value::as_i64)
    }

    /// When the database first refused the job with the refusal it met last (unix ms on
    /// Redis's clock), as the worker that sent it back wrote it: a refusal that lasts
    /// `--refusal-grace` while other jobs of its event go through is the job's own.
    pub fn refused_at(&self) -> Option<i64> {
        self.raw.get(REFUSED_AT).and_then(Value::as_i64)
    }

    /// Writes [`Envelope::refused_at`]: a refusal other than the one it met last.
    pub fn mark_refused(&mut self, at_ms: i64) {
        self.raw.insert(REFUSED_AT.into(), Value::from(at_ms));
    }

    /// Writes [`Envelope::held_at`], unless the message already says so.
    pub fn mark_held(&mut self, at_ms: i64) {
        self.raw
            .entry(HELD_AT)
            .or_insert_with(|| Value::from(at_ms));
    }

    /// The whole object: what was received (or made), `payload` included.
    fn whole(&self) -> Map<String, Value> {
        let mut raw = self.raw.clone();
        raw.insert("payload".into(), self.payload.clone());
        raw
    }

    pub fn to_json(&self) -> String {
        to_wire(self.whole(), self.job_id.as_deref())
    }

    /// Checks that the payload names each group of `required` fields: every group is a
    /// list of alternatives (`order_id|order_no`), at least one of which must be present
    /// and not null.
    pub fn require(&self, required: &[Vec<String>]) -> Result<(), Rejection> {
        for group in required {
            let present = group
                .iter()
                .any(|f| !matches!(self.payload.get(f.as_str()), None | Some(Value::Null)));
            if !present {
                return Err(Rejection::MissingField {
                    event: self.event.clone(),
                    fields: group.join(" or "),
                });
            }
        }
        Ok(())
    }
}

/// The field of a message sent back to the pool that says when its job first fell due.
pub const FIRST_DUE: &str = "first_due";

/// The field of a message sent back to the pool that says why (the failure's reason):
/// what `worker trace` shows of a job waiting for a retry.
pub const LAST_ERROR: &str = "last_error";

/// The field of a message sent back to the pool that says when it failed (unix ms, Redis's
/// clock): a refused job's proof is a job of its event that changed something after it.
pub const FAILED_AT: &str = "failed_at";

/// The field of a message sent back to the pool whose job waited in vain for a lock
/// (`true`): [`Envelope::waited_lock`].
pub const WAITED_LOCK: &str = "waited_lock";

/// The field of a message sent back to the pool whose job waited in vain for a lock at
/// its last tries, one after another: since when (unix ms, Redis's clock;
/// [`Envelope::waited_since`]).
pub const WAITED_SINCE: &str = "waited_since";

/// The field of a message sent back to the pool that says when a worker first held its job
/// as the surroundings' fault (unix ms, Redis's clock; [`Envelope::held_at`]).
pub const HELD_AT: &str = "held_at";

/// The field of a message sent back to the pool that says when the database first refused
/// its job with the refusal it met last (unix ms, Redis's clock; [`Envelope::refused_at`]).
pub const REFUSED_AT: &str = "refused_at";

/// The longest `last_error` kept, in characters.
pub const LAST_ERROR_CHARS: usize = 300;

/// The mover's stamp: the id of `{"job_id":"<digits and dashes>"` at the very start of a
/// message, followed by `,` or `}`; `None` for anything else.
pub fn stamp_of(msg: &[u8]) -> Option<String> {
    let rest = msg.strip_prefix(br#"{"job_id":""#)?;
    let end = rest
        .iter()
        .position(|b| !(b.is_ascii_digit() || *b == b'-'))?;
    let (id, after) = rest.split_at(end);
    match after {
        [b'"', b',' | b'}', ..] if !id.is_empty() => String::from_utf8(id.to_vec()).ok(),
        _ => None,
    }
}

/// A message object as text, with the mover's stamp `stamp` (when given) as its first
/// field, where the mover looks for it; any other `job_id` field makes way for it.
pub fn to_wire(mut raw: Map<String, Value>, stamp: Option<&str>) -> String {
    let Some(id) = stamp else {
        return Value::Object(raw).to_string();
    };
    raw.remove("job_id");
    let rest = Value::Object(raw).to_string();
    let head = format!("{{\"job_id\":{}", Value::from(id));
    match rest.as_str() {
        "{}" => head + "}",
        _ => head + "," + &rest[1..],
    }
}

/// `ts` as unix seconds: an integer, a float (rounded down) or a numeric string; 0 for
/// anything else.
fn unix_seconds(v: &Value) -> i64 {
    let f = match v {
        Value::Number(n) => match n.as_i64() {
            Some(i) => return i,
            None => n.as_f64(),
        },
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    match f {
        Some(f) if f.is_finite() && f.abs() < 9.0e15 => f.floor() as i64,
        _ => 0,
    }
}

/// The best-effort event name of a raw message, for dead letters of undecodable ones.
pub fn event_of(msg: &[u8]) -> String {
    if msg.len() > 1 << 20 {
        return String::new();
    }
    serde_json::from_slice::<Value>(msg)
        .ok()
        .and_then(|v| v.get("event").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Result<Envelope, Rejection> {
        Envelope::decode(s.as_bytes(), 1024)
    }

    #[test]
    fn decodes_the_contract_and_keeps_unknown_fields() {
        let e = d(r#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":1,"ts":17,"trace":"x"}"#)
            .unwrap();
        assert_eq!((e.event.as_str(), e.retry, e.ts), ("order.timeout", 1, 17));
        let again: Value = serde_json::from_str(&e.next_retry()).unwrap();
        assert_eq!(again["retry"], 2);
        assert_eq!(again["trace"], "x");
        assert_eq!(again["payload"]["order_no"], "SO1");
    }

    #[test]
    fn every_malformed_shape_has_a_reason() {
        assert!(matches!(d("nope"), Err(Rejection::NotJson(_))));
        assert_eq!(d("[1]"), Err(Rejection::NotAnObject));
        assert_eq!(d(r#"{"payload":{}}"#), Err(Rejection::MissingEvent));
        assert_eq!(d(r#"{"event":5,"payload":{}}"#), Err(Rejection::BadEvent));
        assert_eq!(d(r#"{"event":"e"}"#), Err(Rejection::MissingPayload));
        assert_eq!(
            d(r#"{"event":"e","payload":[1]}"#),
            Err(Rejection::BadPayload)
        );
        assert_eq!(
            d(r#"{"event":"e","payload":{},"retry":-1}"#),
            Err(Rejection::BadRetry)
        );
        assert_eq!(
            Envelope::decode(&[b'{', 0xff, b'}'], 10),
            Err(Rejection::NotUtf8)
        );
        assert!(matches!(
            Envelope::decode(&[b' '; 11], 10),
            Err(Rejection::TooLarge {
                size: 11,
                limit: 10
            })
        ));
        let deep = "[".repeat(10_000) + &"]".repeat(10_000);
        assert!(matches!(
            Envelope::decode(deep.as_bytes(), 1 << 20),
            Err(Rejection::NotJson(_))
        ));
    }

    #[test]
    fn ts_may_be_an_integer_a_float_or_a_numeric_string() {
        let ts = |t: &str| {
            d(&format!(r#"{{"event":"e","payload":{{}},"ts":{t}}}"#))
                .unwrap()
                .ts
        };
        assert_eq!(ts("1796040000"), 1796040000);
        assert_eq!(ts("1796040000.25"), 1796040000);
        assert_eq!(ts(r#""1796040000.75""#), 1796040000);
        assert_eq!(ts(r#""1796040000""#), 1796040000);
        assert_eq!(ts(r#""soon""#), 0);
        assert_eq!(ts("1e300"), 0);
        assert_eq!(ts("null"), 0);
    }

    #[test]
    fn a_message_sent_back_says_it_waited_for_a_lock_until_a_try_waits_for_none() {
        let e = d(r#"{"event":"e","payload":{}}"#).unwrap();
        let m = e.requeued_waiting(1, 5, ("lock timeout", 7), true, 1000);
        let back = d(&m).unwrap();
        assert!(back.waited_lock(), "{m}");
        // It has waited for a lock since its first such failure, at every try after it.
        assert_eq!(back.waited_since(), Some(7));
        let twice = d(&back.requeued_waiting(2, 5, ("lock timeout", 8), true, 1000)).unwrap();
        assert_eq!(twice.waited_since(), Some(7));
        let again = twice.requeued_after(3, 5, "deadlock", 9, 1000);
        let again = d(&again).unwrap();
        assert!(!again.waited_lock() && again.waited_since().is_none());
        let anew = d(&again.requeued_waiting(4, 5, ("lock timeout", 10), true, 1000)).unwrap();
        assert_eq!(anew.waited_since(), Some(10));
    }

    #[test]
    fn a_message_sent_back_says_why_while_it_fits() {
        let e = d(r#"{"job_id":"17-3","event":"e","payload":{},"retry":0}"#).unwrap();
        let m = e.requeued_after(1, 5, &"x".repeat(400), 7, 1000);
        assert!(m.starts_with(r#"{"job_id":"17-3","#), "{m}");
        let v: Value = serde_json::from_str(&m).unwrap();
        assert_eq!(v[LAST_ERROR].as_str().map(str::len), Some(LAST_ERROR_CHARS));
        assert_eq!(
            (
                v["retry"].as_i64(),
                v[FIRST_DUE].as_i64(),
                v[FAILED_AT].as_i64()
            ),
            (Some(1), Some(5), Some(7))
        );
        assert_eq!(d(&m).unwrap().failed_at(), Some(7));
        // Too large with the reason: sent back without it.
        assert_eq!(e.requeued_after(1, 5, "boom", 7, 60), e.requeued(1, 5));
    }

    #[test]
    fn a_retry_keeps_the_job_id_first() {
        let e = d(r#"{"job_id":"17-3","event":"e","payload":{},"retry":0,"a":1}"#).unwrap();
        assert_eq!(e.job_id.as_deref(), Some("17-3"));
        let r = e.next_retry();
        assert!(r.starts_with(r#"{"job_id":"17-3","#), "{r}");
        let again = d(&r).unwrap();
        assert_eq!((again.job_id.as_deref(), again.retry), (Some("17-3"), 1));
        let bare = d(r#"{"event":"e","payload":{}}"#).unwrap();
        assert_eq!(bare.job_id, None);
        assert!(!bare.next_retry().contains("job_id"));
        assert_eq!(to_wire(Map::new(), Some("1-2")), r#"{"job_id":"1-2"}"#);
        // Only the exact prefix is the stamp.
        assert_eq!(
            stamp_of(br#"{"job_id":"17-3","a":1}"#).as_deref(),
            Some("17-3")
        );
        assert_eq!(stamp_of(br#"{"job_id":"17-3"}"#).as_deref(), Some("17-3"));
        assert_eq!(stamp_of(br#"{"a":1,"job_id":"17-3"}"#), None);
        assert_eq!(stamp_of(br#"{"job_id":"x"}"#), None);
        assert_eq!(stamp_of(br#"{"job_id":"1\"2"}"#), None);
        assert_eq!(stamp_of(br#"{ "job_id":"1"}"#), None);
    }

    #[test]
    fn the_identity_stamp_reads_as_every_stamp_did() {
        // `stamp_of` is the parser older workers have too: the mover's identity form
        // (`<due µs>-<a>-<b>`) is digits and dashes, so they read it as a stamp.
        let id = "1800000000000000-123-4294967295";
        let m = format!(r#"{{"job_id":"{id}","event":"e","payload":{{}},"retry":0}}"#);
        assert_eq!(stamp_of(m.as_bytes()).as_deref(), Some(id));
        let e = d(&m).unwrap();
        assert!(e
            .next_retry()
            .starts_with(&format!(r#"{{"job_id":"{id}","#)));
        assert!(e
            .requeued(0, 17)
            .starts_with(&format!(r#"{{"job_id":"{id}","#)));
    }

    #[test]
    fn required_fields_accept_any_alternative() {
        let e = d(r#"{"event":"order.timeout","payload":{"order_id":7}}"#).unwrap();
        let req = vec![vec!["order_id".to_string(), "order_no".to_string()]];
        assert!(e.require(&req).is_ok());
        let e = d(r#"{"event":"order.timeout","payload":{"order_id":null}}"#).unwrap();
        assert_eq!(
            e.require(&req).unwrap_err().to_string(),
            "payload of \"order.timeout\" is missing order_id or order_no"
        );
    }

    mod props {
        //! Decoding never panics and never trusts the bytes: arbitrary bytes and arbitrary
        //! JSON (deep, odd numbers, unknown fields) either decode or give a reason, and a
        //! decoded message survives the retry round trip with its identity.
        use super::super::*;
        use proptest::prelude::*;

        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>().prop_map(
                    |f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
                ),
                ".{0,12}".prop_map(Value::from),
            ];
            leaf.prop_recursive(6, 64, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        fn check_round_trip(env: &Envelope) {
            let next = env.next_retry();
            let again = Envelope::decode(next.as_bytes(), usize::MAX).expect("a retry decodes");
            assert_eq!(again.event, env.event);
            assert_eq!(again.payload, env.payload);
            assert_eq!(again.retry, env.retry.saturating_add(1));
            assert_eq!(again.job_id, env.job_id, "a retry is the same job");
            assert_eq!(again.ts, env.ts);
            if let Some(id) = &env.job_id {
                assert!(next.starts_with(&format!("{{\"job_id\":{}", Value::from(id.as_str()))));
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                if let Ok(env) = Envelope::decode(&bytes, 64 * 1024) {
                    let _ = env.require(&[vec!["order_id".into(), "order_no".into()]]);
                    check_round_trip(&env);
                }
                if let Ok(env) = Envelope::decode_raw(&bytes, 64 * 1024, "payment.paid") {
                    Envelope::decode(env.next_retry().as_bytes(), usize::MAX).expect("raw re-queues");
                }
                let _ = event_of(&bytes);
            }

            #[test]
            fn arbitrary_json_decodes_or_names_its_reason(
                v in json(),
                event in prop_oneof![Just(None), ".{0,10}".prop_map(Some)],
                payload in prop_oneof![Just(None), json().prop_map(Some)],
                ts in prop_oneof![Just(Value::Null), any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)), any::<i64>().prop_map(Value::from), "[0-9.]{0,14}".prop_map(Value::from)],
                job_id in prop_oneof![Just(None), "[0-9-]{1,20}".prop_map(Some)],
            ) {
                let mut m = match v { Value::Object(m) => m, other => { let mut m = Map::new(); m.insert("x".into(), other); m } };
                if let Some(e) = event { m.insert("event".into(), Value::from(e)); }
                if let Some(p) = payload { m.insert("payload".into(), p); }
                m.insert("ts".into(), ts);
                if let Some(id) = &job_id { m.insert("job_id".into(), Value::from(id.as_str())); }
                let stamp = job_id.clone();
                m.remove("job_id");
                let text = to_wire(m, stamp.as_deref());
                match Envelope::decode(text.as_bytes(), 1 << 20) {
                    Ok(env) => check_round_trip(&env),
                    Err(r) => prop_assert!(!r.to_string().is_empty()),
                }
            }
        }
    }
}
