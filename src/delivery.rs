//! What travels from a reader to a worker ([`Delivery`]) and back to Redis ([`Settlement`]).
//!
//! A delivery remembers where it came from ([`Origin`]): a stream entry (acknowledged with
//! XACK) or a message in a list queue (held in this consumer's processing list, removed
//! with LREM). Workers decide an [`Outcome`] without caring which; `store::settle` applies
//! a batch of settlements to whichever source each came from.

use std::time::Instant;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A stream entry; the id is what XACK takes.
    Stream { id: String },
    /// A list queue, by its index in `Keys::queues`; the message sits in this consumer's
    /// processing list of that queue.
    List { queue: usize },
}

/// One message on its way to a worker.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub origin: Origin,
    /// Job key. Stream entries carry it (`key` field; a producer that XADDs by hand may
    /// leave it out, and the entry id stands in); list messages carry it in `job_key` when
    /// our mover wrote them, otherwise a digest of the message stands in.
    pub key: Vec<u8>,
    /// The message as written, bytes: it may not even be UTF-8.
    pub msg: Vec<u8>,
    /// Due time (unix ms) when the mover recorded it.
    pub due_ms: Option<i64>,
    /// When the reader got it.
    pub received: Instant,
    /// The shard (key set, `--shards`) it was read from; 0 when unsharded.
    pub shard: usize,
}

impl Delivery {
    /// The stream entry id, for stream deliveries.
    pub fn stream_id(&self) -> Option<&str> {
        match &self.origin {
            Origin::Stream { id } => Some(id),
            Origin::List { .. } => None,
        }
    }
}

/// How a message ends.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Done (or a duplicate): acknowledge.
    Ack,
    /// Transient failure: back to the delay pool as `msg` (its `retry` already raised), due at
    /// `due_ms`, atomically with the acknowledgement.
    Retry { msg: Vec<u8>, due_ms: i64 },
    /// Permanent failure, or retries used up: to the dead letters with the reason.
    Dead {
        reason: String,
        event: String,
        attempts: u64,
    },
}

/// A delivery with its outcome, ready to be applied in Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    pub origin: Origin,
    pub key: Vec<u8>,
    /// The message as delivered (what LREM must match, what a dead letter keeps).
    pub msg: Vec<u8>,
    pub outcome: Outcome,
    /// The job's event when known, for the counters (empty for undecodable messages).
    pub event: String,
    /// What an ack stands for (done, no-op, duplicate), counted once the ack is settled;
    /// an ack turned into a re-queue (its commit's durability unconfirmed) counts as that.
    pub counts_as: Option<crate::stats::JobOutcome>,
    /// The shard the delivery came from: where it is settled.
    pub shard: usize,
}

impl Settlement {
    pub fn new(d: Delivery, outcome: Outcome) -> Settlement {
        let event = match &outcome {
            Outcome::Dead { event, .. } => event.clone(),
            _ => String::new(),
        };
        Settlement {
            origin: d.origin,
            key: d.key,
            msg: d.msg,
            outcome,
            event,
            counts_as: None,
            shard: d.shard,
        }
    }

    /// An ack that counts as `o` once settled.
    pub fn ack(d: Delivery, event: &str, o: crate::stats::JobOutcome) -> Settlement {
        let mut s = Settlement::new(d, Outcome::Ack).with_event(event);
        s.counts_as = Some(o);
        s
    }

    pub fn with_event(mut self, event: &str) -> Settlement {
        self.event = event.to_string();
        self
    }

    pub fn is_ack(&self) -> bool {
        self.outcome == Outcome::Ack
    }
}
