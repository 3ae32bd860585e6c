//! What a requeue would send back only to die again: a dead letter screened against the
//! handlers before `worker dead requeue` (and the status page) puts it back.
//!
//! A letter is doomed when the worker would dead-letter it again at once, for a fault of
//! its own: its message is not a whole message (not JSON, no event, no payload object),
//! no handler has its event, or its payload lacks a field its handler requires. Those
//! are refused, each with its reason, unless the operator forces them; `--as-event NEW`
//! requeues a letter under a corrected event name (the same screen applies to the new
//! name). The rewrite keeps every other field, the job's identity (the mover's stamp)
//! and resets `retry`, as a requeue always does ([`super::requeue_message`]).

use crate::handlers::Registry;
use crate::message::{Envelope, Rejection};
use serde_json::Value;

/// Why a letter would die again at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Doomed {
    /// Not a whole message: the decoder's reason.
    Malformed(Rejection),
    /// No handler has this event.
    NoHandler { event: String, known: Vec<String> },
    /// The payload lacks a field its handler requires.
    MissingField { event: String, why: String },
    /// `--event` on a raw queue's message: its event is the queue's, not in the message.
    RawEvent { queue_event: String },
}

impl std::fmt::Display for Doomed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Doomed::Malformed(r) => write!(f, "not a whole message ({r})"),
            Doomed::NoHandler { event, known } => write!(
                f,
                "no handler for event {event:?} (known: {}; --as-event NAME requeues it under another, --handlers-dir names the worker's own)",
                known.join(", ")
            ),
            Doomed::MissingField { event, why } => write!(f, "{event}: {why}"),
            Doomed::RawEvent { queue_event } => write!(
                f,
                "a raw message of a {queue_event} queue carries no event to change"
            ),
        }
    }
}

/// The handlers a requeue is screened against, and the rewrite it asks for.
pub struct Screen<'a> {
    pub registry: &'a Registry,
    /// `--as-event NEW`: requeue under this event.
    pub new_event: Option<&'a str>,
    /// The size limit of a message (`--max-message-bytes`).
    pub limit: usize,
    /// `--force`: requeue even what would die again (the rename still applies).
    pub force: bool,
    /// Events the live workers say they serve (their health records): known even when
    /// `registry` lacks them, though their required fields cannot be checked here.
    pub served: &'a [String],
}

impl Screen<'_> {
    /// The message to requeue in place of `msg` (its event renamed when asked), or why
    /// it would die again. `raw_event` is a raw list queue's event (its messages are the
    /// payload alone).
    pub fn check(&self, msg: &[u8], raw_event: Option<&str>) -> Result<Vec<u8>, Doomed> {
        match self.verdict(msg, raw_event) {
            Err(Doomed::RawEvent { queue_event }) => Err(Doomed::RawEvent { queue_event }),
            Err(_) if self.force => Ok(self.rewritten(msg)),
            r => r,
        }
    }

    fn verdict(&self, msg: &[u8], raw_event: Option<&str>) -> Result<Vec<u8>, Doomed> {
        let envelope = match raw_event {
            Some(queue_event) => {
                if self.new_event.is_some() {
                    return Err(Doomed::RawEvent {
                        queue_event: queue_event.to_string(),
                    });
                }
                Envelope::decode_raw(msg, self.limit, queue_event)
            }
            None => Envelope::decode(msg, self.limit),
        }
        .map_err(Doomed::Malformed)?;
        let event = self.new_event.unwrap_or(&envelope.event);
        let served = self.served.iter().any(|e| e == event);
        let handler = self.registry.get(event);
        if handler.is_none() && served {
            // A live worker serves it (a handler file of its own): no fields to check.
            return Ok(self.rewritten(msg));
        }
        let Some((_, handler)) = handler else {
            let mut known: Vec<String> = self
                .registry
                .events()
                .into_iter()
                .map(String::from)
                .chain(self.served.iter().cloned())
                .collect();
            known.sort();
            known.dedup();
            return Err(Doomed::NoHandler {
                event: event.to_string(),
                known,
            });
        };
        envelope
            .require(handler.required())
            .map_err(|r| Doomed::MissingField {
                event: event.to_string(),
                why: r.to_string(),
            })?;
        Ok(self.rewritten(msg))
    }

    /// `msg` as it goes back: under the new event when one is asked for.
    fn rewritten(&self, msg: &[u8]) -> Vec<u8> {
        match self.new_event {
            None => msg.to_vec(),
            Some(new) => renamed(msg, new),
        }
    }
}

/// `msg` (a JSON object: it decoded) with its `event` replaced, the stamp kept first.
fn renamed(msg: &[u8], event: &str) -> Vec<u8> {
    let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(msg) else {
        return msg.to_vec();
    };
    m.insert("event".into(), Value::String(event.to_string()));
    let stamp = crate::message::stamp_of(msg);
    crate::message::to_wire(m, stamp.as_deref()).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn screen<'a>(r: &'a Registry, new_event: Option<&'a str>) -> Screen<'a> {
        Screen {
            registry: r,
            new_event,
            limit: 1 << 20,
            force: false,
            served: &[],
        }
    }

    #[test]
    fn refuses_what_would_die_again_and_says_why() {
        let r = Registry::builtin();
        let s = screen(&r, None);
        let ok = br#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":3,"ts":1}"#;
        assert_eq!(s.check(ok, None).unwrap(), ok.to_vec());
        let typo = br#"{"event":"order.timout","payload":{"order_no":"SO1"},"ts":1}"#;
        let e = s.check(typo, None).unwrap_err();
        assert!(matches!(&e, Doomed::NoHandler { event, .. } if event == "order.timout"));
        assert!(
            e.to_string()
                .contains("known: aftersale.timeout, coupon.expire, order.timeout, payment.paid"),
            "{e}"
        );
        let missing = br#"{"event":"order.timeout","payload":{"nothing":1},"ts":1}"#;
        let e = s.check(missing, None).unwrap_err();
        assert!(matches!(e, Doomed::MissingField { .. }), "{e}");
        assert!(e.to_string().starts_with("order.timeout: "), "{e}");
        let e = s.check(b"not json", None).unwrap_err();
        assert!(matches!(e, Doomed::Malformed(Rejection::NotJson(_))), "{e}");
        assert!(s.check(b"{\"payload\":{}}", None).is_err());
    }

    #[test]
    fn a_corrected_event_is_screened_and_written_with_everything_else_kept() {
        let r = Registry::builtin();
        let s = screen(&r, Some("order.timeout"));
        let typo = br#"{"event":"order.timout","payload":{"order_no":"SO1"},"retry":2,"ts":1,"trace":"x"}"#;
        let out: Value = serde_json::from_slice(&s.check(typo, None).unwrap()).unwrap();
        assert_eq!(out["event"], "order.timeout");
        assert_eq!(out["payload"]["order_no"], "SO1");
        assert_eq!(out["trace"], "x");
        assert_eq!(out["retry"], 2, "retry is reset by the requeue itself");
        let e = screen(&r, Some("order.timeot"))
            .check(typo, None)
            .unwrap_err();
        assert!(matches!(e, Doomed::NoHandler { .. }));
        // A raw queue's message: its event is the queue's.
        let raw = br#"{"order_no":"SO1"}"#;
        assert!(matches!(
            s.check(raw, Some("payment.paid")),
            Err(Doomed::RawEvent { .. })
        ));
    }

    #[test]
    fn force_requeues_what_would_die_and_still_renames() {
        let r = Registry::builtin();
        let mut s = screen(&r, None);
        s.force = true;
        assert_eq!(s.check(b"not json", None).unwrap(), b"not json".to_vec());
        s.new_event = Some("order.timeout");
        let typo = br#"{"event":"order.timout","payload":{}}"#;
        let out: Value = serde_json::from_slice(&s.check(typo, None).unwrap()).unwrap();
        assert_eq!(out["event"], "order.timeout");
    }

    #[test]
    fn an_event_a_live_worker_serves_is_known() {
        let r = Registry::builtin();
        let served = vec!["ledger.add".to_string()];
        let s = Screen {
            served: &served,
            ..screen(&r, None)
        };
        let msg = br#"{"event":"ledger.add","payload":{}}"#;
        assert_eq!(s.check(msg, None).unwrap(), msg.to_vec());
        assert!(screen(&r, None).check(msg, None).is_err());
    }

    #[test]
    fn the_stamp_stays_first_so_the_job_keeps_its_identity() {
        let r = Registry::builtin();
        let s = screen(&r, Some("order.timeout"));
        let with_stamp = crate::message::to_wire(
            serde_json::from_str(r#"{"event":"order.timout","payload":{"order_no":"SO1"}}"#)
                .unwrap(),
            Some("1700000000000000-12-34"),
        );
        assert!(crate::message::stamp_of(with_stamp.as_bytes()).is_some());
        let out = s.check(with_stamp.as_bytes(), None).unwrap();
        assert_eq!(
            crate::message::stamp_of(&out),
            crate::message::stamp_of(with_stamp.as_bytes())
        );
    }
}
