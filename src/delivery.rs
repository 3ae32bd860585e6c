//! What travels from a reader to a worker ([`Delivery`]) and back to Redis ([`Settlement`]).
//!
//! A delivery remembers where it came from ([`Origin`]): a stream entry (acknowledged with
//! XACK) or a message in a list queue (held in this consumer's processing list, removed
//! with LREM). Workers decide an [`Outcome`] without caring which; `store::settle` applies
//! a batch of settlements to whichever source each came from.

use crossbeam_channel::{Receiver, RecvError, RecvTimeoutError, Sender, TryRecvError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// When the reader got it, or this consumer last claimed it again while it waited
    /// for a `--max-rate` slot (its idle time in Redis starts then).
    pub received: Instant,
    /// The shard (key set, `--shards`) it was read from; 0 when unsharded.
    pub shard: usize,
    /// Taken back from a consumer that is gone: this consumer's previous run (its own
    /// pending entries at start) or a host whose heartbeat expired. A transaction of its
    /// job still running then belongs to no live worker: it ends by itself, and nobody
    /// else will settle the entry (see `workers::session`, a job running elsewhere).
    pub holder_gone: bool,
    /// Delivered before: its consumer's previous run, a dead or stuck consumer, a list
    /// message pushed back. Only such a job's start is counted in Redis before its
    /// transaction ([`crate::keys::Keys::starts`]), a first delivery's is not: the count
    /// costs a round trip, and a drain's jobs are nearly all first deliveries (a message
    /// that kills its consumer runs once more than `--max-deliveries` for it).
    pub redelivered: bool,
}

impl Delivery {
    /// The stream entry id, for stream deliveries.
    pub fn stream_id(&self) -> Option<&str> {
        match &self.origin {
            Origin::Stream { id } => Some(id),
            Origin::List { .. } => None,
        }
    }

    /// When the message arrived where it was read from, on Redis's clock (unix ms): the
    /// time in its stream entry id (when it was added to the stream), or the time the
    /// mover's stamp in a list message begins with (its job's due time; an older mover's
    /// stamp: when it moved it); `None` when it has neither (a producer's own push onto a
    /// list).
    pub fn arrived_ms(&self) -> Option<i64> {
        match self.stream_id() {
            Some(id) => id.split('-').next()?.parse().ok(),
            None => crate::message::stamp_of(&self.msg)
                .and_then(|s| s.split('-').next()?.parse::<i64>().ok())
                .map(|us| us / 1000),
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

/// The reader → pool channel, bounded by `capacity` jobs. A read's deliveries go in as
/// chunks of at most `chunk` (what a worker runs together: a set, or a `--tx-batch`), so
/// a read of a few jobs wakes one worker that runs them as one set, rather than a worker
/// per job each running one (each wake-up, transaction and ack costs the same for one job
/// as for many). A read of more than a chunk is split evenly, a chunk per worker.
pub fn channel(capacity: usize, chunk: usize) -> (Hand, Take) {
    let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
    let queued = Arc::new(AtomicUsize::new(0));
    (
        Hand {
            tx,
            queued: queued.clone(),
            chunk: chunk.max(1),
            capacity: capacity.max(1),
        },
        {
            let (back_tx, back_rx) = crossbeam_channel::unbounded();
            Take {
                rx,
                queued,
                back_tx,
                back_rx,
            }
        },
    )
}

/// The reader's end of [`channel`].
#[derive(Clone)]
pub struct Hand {
    tx: Sender<Vec<Delivery>>,
    queued: Arc<AtomicUsize>,
    chunk: usize,
    capacity: usize,
}

/// The channel's receivers are gone: the pool has stopped.
#[derive(Debug)]
pub struct PoolGone;

impl Hand {
    /// Hands deliveries to the pool. The caller sends no more than the room left
    /// (`capacity - len`), so this never waits.
    pub fn send(&self, ds: Vec<Delivery>) -> Result<(), PoolGone> {
        let chunks = ds.len().div_ceil(self.chunk);
        let mut left = ds.len();
        let mut ds = ds.into_iter();
        for k in (1..=chunks).rev() {
            // Even chunks, in the order read: the next of `k` chunks takes its part of
            // what is left.
            let n = left.div_ceil(k);
            left -= n;
            let c: Vec<Delivery> = ds.by_ref().take(n).collect();
            self.queued.fetch_add(n, Ordering::Relaxed);
            if self.tx.send(c).is_err() {
                self.queued.fetch_sub(n, Ordering::Relaxed);
                return Err(PoolGone);
            }
        }
        Ok(())
    }

    /// Jobs in the channel.
    pub fn len(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most jobs the channel holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// The pool's end of [`channel`]: each receive takes one chunk. A worker gives back what
/// it will not run in its own transaction ([`Take::give_back`]): those chunks wait on a
/// side queue of their own that every receive looks at first, so the reader's bound and
/// the end of the channel (the reader gone) stay the main queue's.
#[derive(Clone)]
pub struct Take {
    rx: Receiver<Vec<Delivery>>,
    queued: Arc<AtomicUsize>,
    back_tx: Sender<Vec<Delivery>>,
    back_rx: Receiver<Vec<Delivery>>,
}

impl Take {
    fn took(&self, c: Vec<Delivery>) -> Vec<Delivery> {
        self.queued.fetch_sub(c.len(), Ordering::Relaxed);
        c
    }

    /// Puts deliveries back for any worker to take, in chunks of at most `chunk`, ahead
    /// of the reader's. Never waits.
    pub fn give_back(&self, ds: Vec<Delivery>, chunk: usize) {
        self.queued.fetch_add(ds.len(), Ordering::Relaxed);
        self.put_back(ds, chunk);
    }

    /// Sends deliveries counted as waiting to the side queue, in chunks of at most `chunk`.
    fn put_back(&self, ds: Vec<Delivery>, chunk: usize) {
        let mut ds = ds.into_iter().peekable();
        while ds.peek().is_some() {
            let c: Vec<Delivery> = ds.by_ref().take(chunk.max(1)).collect();
            // Unbounded, and this end holds its receiver: the send cannot fail.
            let _ = self.back_tx.send(c);
        }
    }

    /// Every delivery waiting now, the given-back ones and the reader's, handed to `f`
    /// and then put back ahead of the reader's in chunks of at most `chunk`. They count as
    /// waiting throughout, so the reader's room does not open meanwhile.
    pub fn rotate(&self, chunk: usize, f: impl FnOnce(&mut Vec<Delivery>)) {
        let mut all: Vec<Delivery> = Vec::new();
        while let Ok(c) = self.back_rx.try_recv() {
            all.extend(c);
        }
        while let Ok(c) = self.rx.try_recv() {
            all.extend(c);
        }
        if all.is_empty() {
            return;
        }
        f(&mut all);
        self.put_back(all, chunk);
    }

    fn given_back(&self) -> Option<Vec<Delivery>> {
        self.back_rx.try_recv().ok().map(|c| self.took(c))
    }

    /// A chunk from the reader's queue only, not one given back: under a `--max-rate`,
    /// where given-back jobs rotate among the workers, so that the reader's are taken
    /// (and claimed again when they have waited long) rather than left behind them.
    pub fn try_recv_read(&self) -> Result<Vec<Delivery>, TryRecvError> {
        self.rx.try_recv().map(|c| self.took(c))
    }

    pub fn try_recv(&self) -> Result<Vec<Delivery>, TryRecvError> {
        match self.given_back() {
            Some(c) => Ok(c),
            None => self.rx.try_recv().map(|c| self.took(c)),
        }
    }

    pub fn recv(&self) -> Result<Vec<Delivery>, RecvError> {
        self.recv_until(None).map_err(|_| RecvError)
    }

    pub fn recv_deadline(&self, at: Instant) -> Result<Vec<Delivery>, RecvTimeoutError> {
        self.recv_until(Some(at))
    }

    pub fn recv_timeout(&self, d: Duration) -> Result<Vec<Delivery>, RecvTimeoutError> {
        self.recv_until(Some(Instant::now() + d))
    }

    /// A chunk given back, else the first of either queue until `at` (`None`: no end).
    /// Disconnected only once the reader is gone and nothing given back is left.
    fn recv_until(&self, at: Option<Instant>) -> Result<Vec<Delivery>, RecvTimeoutError> {
        if let Some(c) = self.given_back() {
            return Ok(c);
        }
        let mut sel = crossbeam_channel::Select::new();
        let back = sel.recv(&self.back_rx);
        let main = sel.recv(&self.rx);
        let op = match at {
            None => sel.select(),
            Some(at) => sel
                .select_deadline(at)
                .map_err(|_| RecvTimeoutError::Timeout)?,
        };
        match op.index() {
            i if i == back => match op.recv(&self.back_rx) {
                Ok(c) => Ok(self.took(c)),
                Err(_) => Err(RecvTimeoutError::Disconnected),
            },
            i if i == main => match op.recv(&self.rx) {
                Ok(c) => Ok(self.took(c)),
                Err(_) => self.given_back().ok_or(RecvTimeoutError::Disconnected),
            },
            _ => unreachable!("two operations were selected on"),
        }
    }

    /// Every delivery waiting now, chunk after chunk.
    pub fn try_iter(&self) -> impl Iterator<Item = Delivery> + '_ {
        std::iter::from_fn(|| self.try_recv().ok()).flatten()
    }

    /// Jobs in the channel.
    pub fn len(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(i: usize) -> Delivery {
        Delivery {
            origin: Origin::Stream {
                id: format!("{i}-0"),
            },
            key: Vec::new(),
            msg: Vec::new(),
            due_ms: None,
            received: Instant::now(),
            shard: 0,
            holder_gone: false,
            redelivered: false,
        }
    }

    fn ids(c: &[Delivery]) -> Vec<&str> {
        c.iter().map(|d| d.stream_id().unwrap()).collect()
    }

    #[test]
    fn a_read_goes_in_even_chunks_in_order_and_is_counted() {
        let (hand, take) = channel(64, 4);
        hand.send((0..10).map(d).collect()).unwrap();
        assert_eq!((hand.len(), take.len()), (10, 10));
        assert_eq!(ids(&take.try_recv().unwrap()), ["0-0", "1-0", "2-0", "3-0"]);
        assert_eq!(ids(&take.try_recv().unwrap()), ["4-0", "5-0", "6-0"]);
        assert_eq!(take.len(), 3);
        assert_eq!(ids(&take.try_recv().unwrap()), ["7-0", "8-0", "9-0"]);
        assert!(take.try_recv().is_err());
        assert!(hand.is_empty());
        hand.send((0..3).map(d).collect()).unwrap();
        assert_eq!(
            take.try_recv().unwrap().len(),
            3,
            "a small read is one chunk"
        );
        hand.send(Vec::new()).unwrap();
        assert!(take.try_recv().is_err(), "nothing read, nothing sent");
        drop(take);
        assert!(hand.send(vec![d(1)]).is_err());
        assert_eq!(hand.len(), 0);
    }

    #[test]
    fn a_rotation_sees_every_waiting_delivery_and_keeps_them_counted() {
        let (hand, take) = channel(10, 4);
        hand.send((0..5).map(d).collect()).unwrap();
        take.give_back(vec![d(7)], 1);
        let mut seen = Vec::new();
        take.rotate(2, |all| {
            assert_eq!(
                hand.len(),
                6,
                "counted while rotated: the reader's room stays shut"
            );
            seen = ids(all).iter().map(|s| s.to_string()).collect();
        });
        assert_eq!(seen, ["7-0", "0-0", "1-0", "2-0", "3-0", "4-0"]);
        assert_eq!(take.len(), 6);
        assert_eq!(
            ids(&take.try_recv_read().unwrap_or_default()),
            Vec::<&str>::new()
        );
        assert_eq!(ids(&take.try_recv().unwrap()), ["7-0", "0-0"]);
        assert_eq!(take.try_iter().count(), 4);
        assert!(hand.is_empty());
        take.rotate(2, |_| panic!("nothing waits: not called"));
    }

    #[test]
    fn chunks_of_one_are_single_jobs() {
        let (hand, take) = channel(8, 1);
        hand.send((0..3).map(d).collect()).unwrap();
        for i in 0..3 {
            assert_eq!(ids(&take.try_recv().unwrap()), [format!("{i}-0")]);
        }
    }

    #[test]
    fn given_back_chunks_come_first_and_outlive_the_reader() {
        let (hand, take) = channel(10, 4);
        hand.send(vec![d(1), d(2)]).unwrap();
        let mine = take.recv().unwrap();
        assert_eq!(mine.len(), 2);
        take.give_back(vec![d(3), d(4), d(5)], 2);
        hand.send(vec![d(6)]).unwrap();
        assert_eq!(take.len(), 4, "given back counts against the room");
        let ids = |c: Vec<Delivery>| -> Vec<String> {
            c.iter()
                .map(|d| d.stream_id().unwrap().to_string())
                .collect()
        };
        assert_eq!(ids(take.recv().unwrap()), ["3-0", "4-0"]);
        drop(hand);
        assert_eq!(
            ids(take.recv_timeout(Duration::from_millis(10)).unwrap()),
            ["5-0"]
        );
        assert_eq!(ids(take.try_recv().unwrap()), ["6-0"]);
        assert!(matches!(
            take.recv_timeout(Duration::from_millis(10)),
            Err(RecvTimeoutError::Disconnected)
        ));
        assert!(take.is_empty());
    }
}
