//! List mode: the reliable queue, for shops whose producers `LPUSH`.
//!
//! [`ListReader`] is the reader thread's [`Source`] in list mode. It owns one Redis
//! connection. Each step moves up to the channel's free room from the queues, in priority
//! order, into this consumer's processing list of each queue (one `fetch` script: the
//! first non-empty queue wins, as with BRPOP; a message over the size limit is
//! dead-lettered inside Redis). When every queue is empty it waits on the mover's doorbell
//! for at most [`IDLE_POLL`], so a message pushed by a producer waits at most that long.
//!
//! Crash recovery: each consumer keeps a heartbeat key and is listed in a SET. At start a
//! consumer pushes its own leftover processing lists back onto their queues; every `block`
//! it looks for consumers whose heartbeat expired and pushes all of theirs back at once,
//! in one atomic script each, so exactly one peer does it. Success removes the message
//! from the processing list; retries and dead letters are written first, in the same
//! script (`store::settle`). Stops like the stream reader: returning drops the sender.

use super::done::InboxLook;
use super::{due, Doorbell, Feed, Source, Standing, StepError, IDLE_POLL};
use crate::config::ReaderConfig;
use crate::delivery::{Delivery, Origin};
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store::list::Overfetched;
use crate::store::{self, list};
use std::time::{Duration, Instant};

/// The role under which dead lists of the wrong type are named before a message meets
/// them ([`Feed::would_block`]).
const DEAD_LISTS: &str = "list reader (dead lists)";

pub struct ListReader<'a> {
    keys: &'a Keys,
    cfg: &'a ReaderConfig,
    consumer: &'a str,
    stats: &'a Stats,
    feed: Feed<'a>,
    doorbell: Doorbell,
    last_maintenance: Option<Instant>,
    /// Whether this process has had a usable PostgreSQL, and its mark when not.
    standing: Standing,
    /// Asks whether the job of a message fetched too often is done before it is buried.
    inbox: &'a InboxLook,
    /// The inbox could not be asked: not again before then.
    look_after: Option<Instant>,
    /// A dead list of another type, found at the last maintenance: reported until it is
    /// fixed, whether or not a message needs it yet.
    dead_list_bad: bool,
}

impl<'a> ListReader<'a> {
    pub fn new(
        keys: &'a Keys,
        cfg: &'a ReaderConfig,
        consumer: &'a str,
        stats: &'a Stats,
        feed: Feed<'a>,
        inbox: &'a InboxLook,
    ) -> Self {
        ListReader {
            keys,
            cfg,
            consumer,
            stats,
            feed,
            doorbell: Doorbell::default(),
            last_maintenance: None,
            standing: Standing::default(),
            inbox,
            look_after: None,
            dead_list_bad: false,
        }
    }

    /// Waits on this doorbell between empty fetches (the daemon shares it with the mover).
    pub fn with_doorbell(mut self, doorbell: Doorbell) -> Self {
        self.doorbell = doorbell;
        self
    }

    /// A message with no `job_key` of ours (a producer's raw message) is keyed by its
    /// queue and digest: a redelivery of the same bytes is the same job for the inbox.
    fn delivery(&self, queue: usize, msg: Vec<u8>, fetched: u64) -> Delivery {
        Delivery {
            key: job_key(&msg).unwrap_or_else(|| {
                let digest = sha1_smol::Sha1::from(&msg).digest();
                let name = self.keys.queues.get(queue).map_or("", |q| q.name.as_str());
                format!("{name}:sha1:{digest}").into_bytes()
            }),
            origin: Origin::List { queue },
            msg,
            due_ms: None,
            received: Instant::now(),
            shard: 0,
            holder_gone: false,
            redelivered: fetched > 1,
        }
    }

    /// The message a fetch stopped at because fetching it would be once more than
    /// `--max-deliveries` (it kills its consumer, which restarts and pushes it back): taken
    /// off its queue when its job's inbox row is there (its consumer was stopped between
    /// the commit and the settle, as often as the limit: the job is done, never also a
    /// dead letter), otherwise dead-lettered. While the inbox cannot be asked it stays at
    /// its queue's tail, the fetch stopping there (the queues keep their order), asked
    /// again a `block` later. Whether it was settled.
    fn settle_overfetched(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        over: &Overfetched,
    ) -> Result<bool, StepError> {
        let d = self.delivery(over.queue, over.msg.clone(), over.fetched);
        let done = match crate::workers::inbox_id(self.keys, &d.origin, &d.key, &d.msg) {
            None => false,
            Some(_) if self.look_after.is_some_and(|t| Instant::now() < t) => return Ok(false),
            Some(id) => {
                let looked = self.inbox.done(std::slice::from_ref(&id));
                // The look may have taken seconds.
                self.heartbeat(con)?;
                match looked {
                    Ok(found) => found.contains(&id),
                    Err(e) => {
                        log::warn!(
                            "list reader: a message fetched {} times without being settled waits at its queue's tail: its job cannot be looked up in the inbox: {e}",
                            over.fetched
                        );
                        self.look_after = Some(Instant::now() + self.cfg.block);
                        return Ok(false);
                    }
                }
            }
        };
        self.look_after = None;
        let limits = (self.cfg.max_deliveries, self.cfg.max_message_bytes);
        let out = list::bury_fetched(con, self.keys, self.consumer, over, done, limits)?;
        if out.done {
            log::info!(
                "list reader: a message fetched {} times without being settled was done (its inbox row is there: its consumer stopped between the commit and the settle): taken off its queue, not dead-lettered",
                over.fetched
            );
        }
        self.feed.buried("list reader", &out.buried);
        if let Some(w) = out.blocked {
            self.feed.blocked("list reader", &w);
            return Ok(false);
        }
        Ok(true)
    }

    /// This consumer's heartbeat, with this process's health record in it.
    fn heartbeat(&self, con: &mut dyn redis::ConnectionLike) -> Result<(), StepError> {
        let record = crate::health::Record::of(self.stats).to_json();
        store::heartbeat(
            con,
            self.keys,
            self.consumer,
            self.cfg.heartbeat_ttl,
            &record,
        )?;
        Ok(())
    }

    /// Heartbeat, this process's [`Standing`], then the processing lists of consumers
    /// whose heartbeat expired (and of live ones marked as having no usable PostgreSQL,
    /// when this process has one).
    fn maintain(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<(), StepError> {
        self.heartbeat(con)?;
        // Each dead list's type, so that one of another type is told before a message
        // needs it, as the stream's dead letters are (found from outside: `/healthz` 200
        // for 10-24 s while `stats --check` was CRITICAL naming it).
        let bad = list::dead_lists_of_another_type(con, self.keys)?;
        self.dead_list_bad = !bad.is_empty();
        if self.dead_list_bad {
            self.feed.would_block(DEAD_LISTS, &bad);
        } else if self.stats.clear_problem(DEAD_LISTS, i64::MAX) {
            log::info!("{DEAD_LISTS}: every dead list is a list again");
        }
        let usable = self.standing.look(
            con,
            (self.keys, self.consumer, "list reader"),
            self.stats,
            self.cfg,
        )?;
        for c in list::consumers(con, self.keys)?
            .iter()
            .filter(|c| c.as_str() != self.consumer)
        {
            if let Some(back) = list::requeue_processing(con, self.keys, c, true, usable.settled)? {
                let n = back.messages;
                if n > 0 {
                    let why = if back.without_database {
                        "has had no usable PostgreSQL for a while"
                    } else {
                        "has no heartbeat"
                    };
                    log::warn!(
                        "list reader: consumer {c:?} {why}; pushed its {n} unfinished messages back to their queues"
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

    fn block(&self) -> Duration {
        self.cfg.block
    }

    fn heartbeat_ttl(&self) -> Duration {
        self.cfg.heartbeat_ttl
    }

    /// Registers this consumer, then pushes its own leftovers (from a previous run under
    /// the same name) back onto their queues, oldest at the tail, to be fetched again.
    fn start(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        _shutdown: &Shutdown,
    ) -> Result<usize, StepError> {
        self.heartbeat(con)?;
        list::register_consumer(con, self.keys, self.consumer)?;
        let n = list::requeue_processing(con, self.keys, self.consumer, false, false)?
            .map_or(0, |b| b.messages);
        if n > 0 {
            log::info!(
                "list reader: pushed back {n} messages left in processing by a previous run of consumer {:?}",
                self.consumer
            );
        }
        Ok(n)
    }

    fn poll(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        if due(&mut self.last_maintenance, self.cfg.block) {
            self.maintain(con)?;
        }
        let room = self.standing.wanted(self.feed.room());
        if room == 0 {
            self.feed.wait_for_room(self.cfg.block);
            return Ok(0);
        }
        let fetched = list::fetch(
            con,
            self.keys,
            self.consumer,
            room,
            self.cfg.max_deliveries,
            self.cfg.max_message_bytes,
        )?;
        self.feed.buried("list reader", &fetched.buried);
        let settled = match &fetched.over {
            Some(over) => self.settle_overfetched(con, over)?,
            None => false,
        };
        match fetched.blocked {
            Some(w) => self.feed.blocked("list reader", &w),
            // A fetch that did not fill the room looked at every queued message once
            // (one waiting for its dead list is rotated to its queue's head) and met no
            // such key: whatever held messages back is fixed.
            None if fetched.messages.len() < room
                && !self.dead_list_bad
                && self.stats.clear_problem("list reader", i64::MAX) =>
            {
                log::info!("list reader: the key that held messages back is fixed");
            }
            None => {}
        }
        if fetched.messages.is_empty() && fetched.buried.is_empty() && !settled {
            self.doorbell.wait(IDLE_POLL.min(self.cfg.block));
        }
        let got = fetched
            .messages
            .into_iter()
            .map(|(q, msg, fetched)| self.delivery(q, msg, fetched))
            .collect();
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
