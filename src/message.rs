//! The message envelope of the wire contract (DESIGN §1) and its validation.
//!
//! `{"event": "order.timeout", "payload": {...}, "retry": 0, "ts": 1768764300}`.
//! Decoding never panics and never trusts the producer: every way a message can be wrong
//! is a [`Rejection`] whose text becomes the dead letter's `reason`. Unknown fields are
//! kept, so a retried message goes back to the pool as the producer wrote it, with only
//! `retry` raised.

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
    /// When the producer wrote it (unix seconds; 0 if absent). Part of the inbox key, so a
    /// job key re-used for a later push is a new job while a redelivery is not.
    pub ts: i64,
    /// The whole object as received, unknown fields included.
    raw: Map<String, Value>,
}

/// Why a message can never succeed. Permanent: it goes to the dead letters at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
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
        let raw = parse_object(bytes, limit)?;
        let event = match raw.get("event") {
            None | Some(Value::Null) => return Err(Rejection::MissingEvent),
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(_) => return Err(Rejection::BadEvent),
        };
        let payload = match raw.get("payload") {
            None | Some(Value::Null) => return Err(Rejection::MissingPayload),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(Rejection::BadPayload),
        };
        let retry = match raw.get("retry") {
            None | Some(Value::Null) => 0,
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(Rejection::BadRetry)?,
        };
        // `ts` is informational; a malformed one is treated as absent rather than
        // rejecting an otherwise good message.
        let ts = raw.get("ts").and_then(Value::as_i64).unwrap_or(0);
        Ok(Envelope {
            event,
            payload,
            retry,
            ts,
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
        raw.insert("payload".into(), payload.clone());
        raw.insert("retry".into(), Value::from(0));
        raw.insert("ts".into(), Value::from(ts));
        Envelope {
            event: event.to_string(),
            payload,
            retry: 0,
            ts,
            raw,
        }
    }

    /// The message to re-queue after a transient failure: the same object, unknown
    /// fields kept, `retry` raised by one.
    pub fn next_retry(&self) -> String {
        let mut raw = self.raw.clone();
        raw.insert("retry".into(), Value::from(self.retry.saturating_add(1)));
        Value::Object(raw).to_string()
    }

    pub fn to_json(&self) -> String {
        Value::Object(self.raw.clone()).to_string()
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
}
