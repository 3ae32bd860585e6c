//! List mode (DESIGN §4): the BRPOPLPUSH reliable queue, for shops whose producers `LPUSH`.
//!
//! [`ListReader`] is the reader thread's [`Source`] in list mode. It owns one Redis
//! connection. Each step moves up to the channel's free room from the queues, in priority
//! order, into this consumer's processing list of each queue (one `fetch` script: the first
//! non-empty queue wins, as with BRPOP). When every queue is empty it blocks on the first
//! queue with BLMOVE: for `block` when there is one queue, for [`LOWER_QUEUE_WAIT`] when there
//! are several, so a message on a lower queue waits at most that long.
//!
//! Crash recovery: each consumer keeps a heartbeat key and is listed in a SET. At start a
//! consumer pushes its own leftover processing lists back onto their queues; every `block`
//! it looks for consumers whose heartbeat expired and pushes theirs back, in one atomic
//! script each, so exactly one peer does it. Success removes the message from the
//! processing list (LREM); retries and dead letters happen in the same script
//! ([`settle`]). Stops like the stream reader: returning drops the channel's sender.

use crate::config::ReaderConfig;
use crate::delivery::{Delivery, Origin, Outcome, Settlement};
use crate::keys::Keys;
use crate::reader::{due, heartbeat, Feed, Source, StepError};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use redis::{Connection, ConnectionLike, RedisResult, Script, Value};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

static FETCH: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/fetch.lua")));
static SETTLE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/settle_list.lua")));
static REQUEUE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/requeue_processing.lua")));

/// With several queues, how long the reader blocks on the first one before looking at the
/// others again: the longest a message on a lower queue waits while the higher are empty.
pub const LOWER_QUEUE_WAIT: Duration = Duration::from_millis(50);

pub struct ListReader<'a> {
    keys: &'a Keys,
    cfg: &'a ReaderConfig,
    consumer: &'a str,
    stats: &'a Stats,
    feed: Feed<'a>,
    /// KEYS of the fetch script: per queue its name, processing list, deliveries, dead list.
    fetch_keys: Vec<String>,
    last_maintenance: Option<Instant>,
}

impl<'a> ListReader<'a> {
    pub fn new(
        keys: &'a Keys,
        cfg: &'a ReaderConfig,
        consumer: &'a str,
        stats: &'a Stats,
        feed: Feed<'a>,
    ) -> Self {
        let fetch_keys = keys
            .queues
            .iter()
            .flat_map(|q| {
                [
                    q.name.clone(),
                    q.processing(consumer),
                    q.deliveries(),
                    q.dead.clone(),
                ]
            })
            .collect();
        ListReader {
            keys,
            cfg,
            consumer,
            stats,
            feed,
            fetch_keys,
            last_maintenance: None,
        }
    }

    /// A message with no `job_key` of ours (a producer's raw message) is keyed by its
    /// queue and digest: a redelivery of the same bytes is the same job for the inbox.
    fn delivery(&self, queue: usize, msg: Vec<u8>) -> Delivery {
        Delivery {
            key: job_key(&msg).unwrap_or_else(|| {
                let digest = sha1_smol::Sha1::from(&msg).digest();
                format!("{}:sha1:{digest}", self.keys.queues[queue].name).into_bytes()
            }),
            origin: Origin::List { queue },
            msg,
            due_ms: None,
            received: Instant::now(),
        }
    }

    fn fetch(&self, con: &mut Connection, max: usize) -> RedisResult<Vec<Delivery>> {
        let mut inv = FETCH.prepare_invoke();
        for k in &self.fetch_keys {
            inv.key(k);
        }
        inv.arg(max)
            .arg(self.cfg.max_deliveries)
            .arg(crate::now_ms() / 1000)
            .arg(self.consumer);
        for q in &self.keys.queues {
            inv.arg(&q.name);
        }
        let reply: Vec<Value> = inv.invoke(con)?;
        Ok(reply
            .chunks(2)
            .filter_map(|c| match c {
                [Value::Int(q), Value::BulkString(msg)] => {
                    Some(self.delivery(*q as usize, msg.clone()))
                }
                _ => None,
            })
            .collect())
    }

    /// Blocks on the first queue when all are empty.
    fn block(&self, con: &mut Connection) -> RedisResult<Vec<Delivery>> {
        let wait = if self.keys.queues.len() > 1 {
            LOWER_QUEUE_WAIT.min(self.cfg.block)
        } else {
            self.cfg.block
        };
        let q = &self.keys.queues[0];
        let msg: Option<Vec<u8>> = redis::cmd("BLMOVE")
            .arg(&q.name)
            .arg(q.processing(self.consumer))
            .arg("RIGHT")
            .arg("LEFT")
            .arg(wait.as_secs_f64())
            .query(con)?;
        Ok(msg.map(|m| vec![self.delivery(0, m)]).unwrap_or_default())
    }

    /// Pushes one consumer's processing lists back. `peer`: only if its heartbeat expired.
    /// Returns how many messages went back, or `None` if the peer turned out alive.
    fn requeue(
        &self,
        con: &mut Connection,
        consumer: &str,
        peer: bool,
    ) -> RedisResult<Option<usize>> {
        let mut inv = REQUEUE.prepare_invoke();
        for q in &self.keys.queues {
            inv.key(q.processing(consumer)).key(&q.name);
        }
        inv.key(&self.keys.list_consumers)
            .key(self.keys.heartbeat(consumer))
            .arg(consumer)
            .arg(if peer { "1" } else { "0" });
        let n: i64 = inv.invoke(con)?;
        Ok((n >= 0).then_some(n as usize))
    }

    /// Heartbeat, then the processing lists of consumers whose heartbeat expired.
    fn maintain(&mut self, con: &mut Connection) -> Result<(), StepError> {
        heartbeat(con, self.keys, self.consumer, self.cfg.heartbeat_ttl)?;
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg(&self.keys.list_consumers)
            .query(con)?;
        for c in members.iter().filter(|c| c.as_str() != self.consumer) {
            if let Some(n) = self.requeue(con, c, true)? {
                if n > 0 {
                    log::warn!(
                        "list reader: consumer {c:?} has no heartbeat; pushed its {n} unfinished messages back to their queues"
                    );
                    Stats::add(&self.stats.reclaimed, n as u64);
                }
            }
        }
        Ok(())
    }
}

impl Source for ListReader<'_> {
    fn role(&self) -> &'static str {
        "list reader"
    }

    fn io_timeout(&self) -> Duration {
        self.cfg.block + Duration::from_secs(5)
    }

    /// Registers this consumer, then pushes its own leftovers (from a previous run under
    /// the same name) back onto their queues, oldest at the tail, to be fetched again.
    fn start(&mut self, con: &mut Connection, _shutdown: &Shutdown) -> Result<usize, StepError> {
        heartbeat(con, self.keys, self.consumer, self.cfg.heartbeat_ttl)?;
        redis::cmd("SADD")
            .arg(&self.keys.list_consumers)
            .arg(self.consumer)
            .query::<()>(con)?;
        let n = self.requeue(con, self.consumer, false)?.unwrap_or(0);
        if n > 0 {
            log::info!(
                "list reader: pushed back {n} messages left in processing by a previous run of consumer {:?}",
                self.consumer
            );
        }
        Ok(n)
    }

    fn poll(&mut self, con: &mut Connection) -> Result<usize, StepError> {
        if due(&mut self.last_maintenance, self.cfg.block) {
            self.maintain(con)?;
        }
        let room = self.feed.room();
        if room == 0 {
            self.feed.wait_for_room(self.cfg.block);
            return Ok(0);
        }
        let mut got = self.fetch(con, room)?;
        if got.is_empty() {
            got = self.block(con)?;
        }
        self.feed.send(got)
    }
}

/// The `job_key` our mover puts into list messages; `None` for producers' raw messages.
fn job_key(msg: &[u8]) -> Option<Vec<u8>> {
    #[derive(serde::Deserialize)]
    struct K {
        job_key: Option<String>,
    }
    if !msg.starts_with(b"{") {
        return None;
    }
    serde_json::from_slice::<K>(msg)
        .ok()
        .and_then(|k| k.job_key)
        .map(String::into_bytes)
}

/// Applies a batch of list outcomes in one script call (see `lua/settle_list.lua`).
pub fn settle(
    con: &mut dyn ConnectionLike,
    keys: &Keys,
    consumer: &str,
    now_s: i64,
    batch: &[&Settlement],
) -> RedisResult<usize> {
    let mut inv = SETTLE.prepare_invoke();
    inv.key(&keys.pool).key(&keys.data);
    for q in &keys.queues {
        inv.key(q.processing(consumer))
            .key(&q.dead)
            .key(q.deliveries());
    }
    inv.arg(now_s).arg(consumer);
    for s in batch {
        let Origin::List { queue } = s.origin else {
            continue;
        };
        let name = keys.queues.get(queue).map_or("", |q| q.name.as_str());
        inv.arg(match s.outcome {
            Outcome::Ack => "A",
            Outcome::Retry { .. } => "R",
            Outcome::Dead { .. } => "D",
        })
        .arg(queue)
        .arg(name)
        .arg(s.key.as_slice())
        .arg(s.msg.as_slice());
        match &s.outcome {
            Outcome::Ack => inv.arg("").arg("").arg(0),
            Outcome::Retry { msg, due_ms } => inv.arg(msg.as_slice()).arg(*due_ms).arg(0),
            Outcome::Dead {
                reason,
                event,
                attempts,
            } => inv.arg(reason).arg(event).arg(*attempts),
        };
    }
    let n: i64 = inv.invoke(con)?;
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_job_key_comes_from_our_field_only() {
        assert_eq!(
            super::job_key(br#"{"job_key":"k1","event":"e"}"#),
            Some(b"k1".to_vec())
        );
        assert_eq!(super::job_key(br#"{"order_no":"SO1"}"#), None);
        assert_eq!(super::job_key(b"not json"), None);
    }
}
