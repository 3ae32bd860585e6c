//! The stream reader: stream entries into the bounded channel of the worker pool.
//!
//! Owns one Redis connection and the channel's only `Sender` (through [`Feed`]). Each step
//! reads under a stable consumer name, never more entries than the channel has room for
//! (back-pressure: when it is full the reader waits for a worker to free a slot). Every
//! read is a store script that screens the entries (oversized ones are dead-lettered in
//! Redis), and none blocks: after an empty read the reader waits on the mover's doorbell.
//!
//! At start it first re-delivers its own pending entries (a restarted process recovers its
//! work at once). Every `block` it also does maintenance: refreshes its heartbeat key,
//! takes over at once every pending entry of consumers whose heartbeat expired (dead
//! hosts: claimed in batches whatever the channel's room, then served as its own pending
//! before anything new), dead-letters entries delivered more than `max_deliveries` times,
//! reclaims entries idle longer than `claim_idle` on live consumers, and trims old
//! acknowledged entries. Nothing here changes Redis state except through `store`.

use super::done::InboxLook;
use super::{due, Doorbell, Feed, Source, Standing, StepError, IDLE_POLL};
use crate::config::ReaderConfig;
use crate::delivery::Origin;
use crate::keys::Keys;
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::store::stream::{OverDelivered, Read, Reading, Verdict};
use crate::store::{self, stream};
use crate::workers::session::InboxId;
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Marks the deliveries of `read` as taken back from a consumer that is gone.
fn holder_gone(read: &mut Read) {
    for d in &mut read.deliveries {
        d.holder_gone = true;
        d.redelivered = true;
    }
}

/// How often the reader trims the stream; retention is counted in hours, so once a minute
/// is plenty.
const TRIM_EVERY: Duration = Duration::from_secs(60);

pub struct Reader<'a> {
    keys: &'a Keys,
    cfg: &'a ReaderConfig,
    consumer: &'a str,
    stats: &'a Stats,
    feed: Feed<'a>,
    doorbell: Doorbell,
    /// Ids taken over from dead consumers, now pending on us, not yet delivered.
    taken: VecDeque<String>,
    autoclaim_cursor: String,
    last_maintenance: Option<Instant>,
    last_trim: Option<Instant>,
    /// Which shard's key set this is (stamped on each delivery), and whether an empty
    /// read, or a full channel, waits itself (a [`Shards`] waits once for all of them).
    shard: usize,
    idle_wait: bool,
    /// The last read found fewer new entries than it asked for: it emptied the stream.
    drained: bool,
    /// The last step read nothing for want of room (a full channel, or this process
    /// marked as without a usable PostgreSQL).
    full: bool,
    /// The name a key of the wrong type that holds this reader's messages back is
    /// reported and logged under: `reader`, or `reader (shard i)` among several, so that
    /// one shard's clean pass never clears another's problem.
    name: String,
    /// A key of the wrong type held messages back since the current maintenance began.
    held: bool,
    /// The process's first start is done: own pending entries read after it (a
    /// reconnect) may be held by this very process's workers, not by a previous run.
    started_once: bool,
    /// Under a `--max-rate` ([`Reader::capped`]): a reconnect re-delivers none of this
    /// consumer's own pending entries.
    capped: bool,
    /// Whether this process has had a usable PostgreSQL, and its mark when not.
    standing: Standing,
    /// Asks whether the jobs of over-delivered entries are done before they are buried.
    inbox: &'a InboxLook,
}

impl<'a> Reader<'a> {
    pub fn new(
        keys: &'a Keys,
        cfg: &'a ReaderConfig,
        consumer: &'a str,
        stats: &'a Stats,
        feed: Feed<'a>,
        inbox: &'a InboxLook,
    ) -> Self {
        Reader {
            keys,
            cfg,
            consumer,
            stats,
            feed,
            doorbell: Doorbell::default(),
            taken: VecDeque::new(),
            autoclaim_cursor: "0-0".to_string(),
            last_maintenance: None,
            last_trim: None,
            shard: 0,
            idle_wait: true,
            drained: false,
            full: false,
            name: "reader".to_string(),
            held: false,
            started_once: false,
            capped: false,
            standing: Standing::default(),
            inbox,
        }
    }

    /// This reader serves shard `i` among several (see [`Shards`]).
    pub fn in_shard(mut self, i: usize) -> Self {
        self.shard = i;
        self.idle_wait = false;
        self.name = format!("reader (shard {i})");
        self
    }

    /// Waits on this doorbell between empty reads (the daemon shares it with the mover).
    pub fn with_doorbell(mut self, doorbell: Doorbell) -> Self {
        self.doorbell = doorbell;
        self
    }

    /// Under a `--max-rate` the workers hold many of this consumer's pending entries
    /// while they wait for slots (claimed again as they wait): a reconnect (a dropped
    /// connection, a Redis restart) re-delivers none of them, or each would run twice,
    /// each copy taking a slot (a Redis restart under 20/s: 222 duplicates of 400 jobs,
    /// and the exit line counting the copies as left pending). An entry whose read reply
    /// the lost connection took is reclaimed after `--claim-idle` instead.
    pub fn capped(mut self, capped: bool) -> Self {
        self.capped = capped;
        self
    }

    /// Refreshes this consumer's heartbeat, with this process's health record in it.
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

    fn reading(&self) -> Reading<'a> {
        Reading {
            keys: self.keys,
            consumer: self.consumer,
            max_bytes: self.cfg.max_message_bytes,
        }
    }

    /// Hands a screened read to the pool; logs what it cleared or dead-lettered.
    fn deliver(&mut self, mut read: Read) -> Result<usize, StepError> {
        for d in &mut read.deliveries {
            d.shard = self.shard;
        }
        if read.gone > 0 {
            log::warn!(
                "reader: {} pending entries no longer exist in the stream; cleared",
                read.gone
            );
        }
        self.feed.buried("reader", &read.buried);
        if let Some(w) = read.blocked {
            self.held = true;
            self.feed.blocked(&self.name, &w);
        }
        self.feed.send(read.deliveries)
    }

    /// Start-up: heartbeat, group, then this consumer's own pending entries (left by a
    /// previous run of the same name), re-delivered before anything new. The heartbeat
    /// comes first: a start that fails on the stream's key (of the wrong type until an
    /// operator's fix) keeps it alive, and no peer takes over the entries our workers hold.
    pub fn start(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        shutdown: &Shutdown,
    ) -> Result<usize, StepError> {
        self.heartbeat(con)?;
        stream::ensure_group(con, self.keys)?;
        // Those the inbox could not be asked about are not delivered again meanwhile: a
        // message that kills its consumer would run once more.
        let undecided = self.bury_overdelivered(con, Some(self.consumer), Duration::ZERO)?;
        let reread = !(self.capped && self.started_once);
        if reread {
            // Whatever was taken over before a reconnect is in our own pending now.
            self.taken.clear();
        }
        let mut cursor = "0".to_string();
        let mut total = 0;
        while reread && !shutdown.is_set() {
            let room = self.feed.room();
            if room == 0 {
                self.feed.wait_for_room(self.cfg.block);
                self.heartbeat(con)?;
                continue;
            }
            let mut read = stream::read(con, self.reading(), room, &cursor)?;
            if !self.started_once {
                holder_gone(&mut read);
            }
            let progress = read.gone + read.buried.len();
            if let Some(last) = read.deliveries.last().and_then(|d| d.stream_id()) {
                cursor = last.to_string();
            } else if progress == 0 {
                break;
            }
            read.deliveries
                .retain(|d| !d.stream_id().is_some_and(|id| undecided.contains(id)));
            total += self.deliver(read)?;
        }
        if total > 0 && !self.started_once {
            log::info!(
                "reader: re-delivered {total} entries left pending by a previous run of consumer {:?}",
                self.consumer
            );
        }
        self.started_once = !shutdown.is_set();
        Ok(total)
    }

    /// One step: maintenance when due, then one read of at most the channel's free room:
    /// entries taken over from dead consumers first, then new ones. After a read that
    /// emptied the stream it waits for the doorbell, at most [`IDLE_POLL`]: the mover rings
    /// it after adding entries, so reading the empty stream once more would only cost a
    /// round trip (under a steady trickle of jobs, one for every read that found some).
    /// Returns how many entries it handed to the pool.
    ///
    /// A key of the wrong type this reader reported is cleared only by a maintenance pass
    /// that met none: that pass always looks at the dead-letter key (the over-delivered
    /// entries), while a plain read meets it only when an entry needs it, so a read that
    /// met nothing proves nothing.
    pub fn poll(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        let mut n = 0;
        self.drained = false;
        if due(&mut self.last_maintenance, self.cfg.block) {
            self.held = false;
            n += self.maintain(con)?;
            if !self.held && self.stats.clear_problem(&self.name, i64::MAX) {
                log::info!("{}: the key that held messages back is fixed", self.name);
            }
        }
        let room = self.standing.wanted(self.feed.room());
        self.full = room == 0;
        if self.full {
            // Back-pressure: wait for a worker to take a job (or the block timeout); or
            // no usable PostgreSQL. Among shards, once for all of them.
            if self.idle_wait {
                self.feed.wait_for_room(self.cfg.block);
            }
            return Ok(n);
        }
        if !self.taken.is_empty() {
            let ids: Vec<String> = self.taken.drain(..room.min(self.taken.len())).collect();
            let mut read = stream::claim_ids(con, self.reading(), &ids)?;
            holder_gone(&mut read);
            Stats::add(&self.stats.reclaimed, read.deliveries.len() as u64);
            return Ok(n + self.deliver(read)?);
        }
        let read = stream::read(con, self.reading(), room, ">")?;
        let found = read.deliveries.len() + read.buried.len();
        if found == 0 {
            Stats::beat(&self.stats.reader_beat_ms);
        }
        self.drained = found < room;
        n += self.deliver(read)?;
        if self.drained && self.idle_wait {
            self.doorbell.wait(IDLE_POLL.min(self.cfg.block));
        }
        Ok(n)
    }

    /// Heartbeat, dead consumers, over-delivered entries, idle entries; in that order, so
    /// an entry over the delivery limit is dead-lettered rather than reclaimed once more;
    /// the last two only while this process has a usable PostgreSQL.
    pub fn maintain(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        self.heartbeat(con)?;
        let usable = self.standing.look(
            con,
            (self.keys, self.consumer, &self.name),
            self.stats,
            self.cfg,
        )?;
        self.take_over_dead_consumers(con, usable)?;
        // Without a usable PostgreSQL this process would only hold what it reclaims, and
        // count deliveries against entries that are not at fault: a peer that has one does
        // both (found from outside: a worker without one reclaimed its own idle entries
        // and an entry went to the dead letters for too many deliveries).
        // Nor does one reclaim idle entries while over-delivered ones wait for the inbox to
        // answer: it would run them once more.
        let n = if usable.now
            && self
                .bury_overdelivered(con, None, self.cfg.claim_idle)?
                .is_empty()
        {
            self.autoclaim(con)?
        } else {
            0
        };
        if due(&mut self.last_trim, TRIM_EVERY) {
            let removed = stream::trim_acknowledged(
                con,
                self.keys,
                self.cfg.retention,
                // Entry ids are Redis's time.
                self.stats.clock.now_ms(),
            )?;
            if removed > 0 {
                log::info!(
                    "reader: trimmed {removed} acknowledged stream entries older than the retention"
                );
            }
        }
        Ok(n)
    }

    /// Entries delivered more than `max_deliveries` times (and idle at least `min_idle`)
    /// go to the dead letters: a message that keeps killing its consumer must not circle
    /// for ever. One whose job is done (its inbox row is there: a process was killed
    /// between the commit and the ack as often as the limit) is acknowledged instead,
    /// never also a dead letter. Returns the ids left as they are because the inbox could
    /// not be asked (none when it could).
    fn bury_overdelivered(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        only: Option<&str>,
        min_idle: Duration,
    ) -> Result<HashSet<String>, StepError> {
        let over = OverDelivered {
            only,
            min_idle,
            max_deliveries: self.cfg.max_deliveries,
            scan: 500,
        };
        let looked = stream::overdelivered(con, self.reading(), over)?;
        if looked.forgiven > 0 {
            log::info!(
                "{}: {} entries delivered more than {} times whose jobs started fewer times (held unrun by processes that were stopped) stay, their delivery counts set back",
                self.name,
                looked.forgiven,
                self.cfg.max_deliveries
            );
        }
        let candidates = looked.candidates;
        if let Some(w) = looked.blocked {
            // None can be buried now; they stay pending, and reclaiming them would run
            // them once more.
            self.held = true;
            self.feed.blocked(&self.name, &w);
            return Ok(candidates.into_iter().map(|c| c.id).collect());
        }
        if candidates.is_empty() {
            return Ok(HashSet::new());
        }
        let ids: Vec<Option<InboxId>> = candidates
            .iter()
            .map(|c| {
                let origin = Origin::Stream { id: c.id.clone() };
                crate::workers::inbox_id(self.keys, &origin, &c.key, &c.msg)
            })
            .collect();
        let asked: Vec<InboxId> = ids.iter().flatten().cloned().collect();
        let looked = self.inbox.done(&asked);
        // The look may have taken seconds.
        self.heartbeat(con)?;
        let done = match looked {
            Ok(done) => done,
            Err(e) => {
                log::warn!(
                    "{}: {} entries delivered more than {} times wait: their jobs cannot be looked up in the inbox: {e}",
                    self.name,
                    candidates.len(),
                    self.cfg.max_deliveries
                );
                return Ok(candidates.into_iter().map(|c| c.id).collect());
            }
        };
        let verdicts: Vec<(String, Verdict)> = candidates
            .into_iter()
            .zip(&ids)
            .map(|(c, id)| match id {
                Some(id) if done.contains(id) => (c.id, Verdict::Done),
                _ => (c.id, Verdict::Dead),
            })
            .collect();
        let out = stream::bury_overdelivered(con, self.reading(), over, &verdicts)?;
        if out.done > 0 {
            log::info!(
                "{}: {} entries delivered more than {} times were done (their inbox rows are there: their process stopped between the commit and the acknowledgement): acknowledged, not dead-lettered",
                self.name,
                out.done,
                self.cfg.max_deliveries
            );
        }
        self.feed.buried("reader", &out.buried);
        if let Some(w) = out.blocked {
            self.held = true;
            self.feed.blocked(&self.name, &w);
        }
        Ok(HashSet::new())
    }

    /// Every pending entry of a consumer whose heartbeat key has expired becomes ours at
    /// once, in batches, whatever the channel's room: a dead host's work waits for no
    /// timeout; by a process that has a usable PostgreSQL, so they do not wait in workers
    /// that cannot run them. So do those of a live consumer marked as having none, when
    /// this process has had one for a while. The entries are delivered by later steps,
    /// before anything new.
    fn take_over_dead_consumers(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        usable: super::Usable,
    ) -> Result<(), StepError> {
        let others: Vec<stream::ConsumerInfo> = stream::consumers(con, self.keys)?
            .into_iter()
            .filter(|c| c.name != self.consumer)
            .collect();
        for c in others {
            let mut took = 0;
            let mut without_database = false;
            while let Some(t) = stream::take_over(con, self.keys, self.consumer, &c.name, usable)? {
                let n = t.ids.len();
                took += n;
                without_database = t.without_database;
                self.taken.extend(t.ids);
                if n < stream::TAKE_OVER_BATCH {
                    break;
                }
            }
            if took > 0 {
                let why = if without_database {
                    "has had no usable PostgreSQL for a while"
                } else {
                    "has no heartbeat"
                };
                log::warn!(
                    "reader: consumer {:?} {why}; took over its {took} pending entries",
                    c.name
                );
            }
        }
        Ok(())
    }

    /// XAUTOCLAIM entries idle longer than `claim_idle` on any consumer, as many as the
    /// channel has room for. Continues from where the last pass stopped.
    fn autoclaim(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        let room = self.feed.room();
        if room == 0 {
            return Ok(0);
        }
        let (read, cursor) = stream::autoclaim(
            con,
            self.reading(),
            self.cfg.claim_idle,
            &self.autoclaim_cursor,
            room,
        )?;
        self.autoclaim_cursor = cursor;
        let mut read = read;
        for d in &mut read.deliveries {
            d.redelivered = true;
        }
        if !read.deliveries.is_empty() {
            log::warn!(
                "reader: reclaimed {} entries idle for over {}s",
                read.deliveries.len(),
                self.cfg.claim_idle.as_secs()
            );
            Stats::add(&self.stats.reclaimed, read.deliveries.len() as u64);
        }
        self.deliver(read)
    }
}

impl Source for Reader<'_> {
    fn role(&self) -> &'static str {
        "reader"
    }
    fn block(&self) -> Duration {
        self.cfg.block
    }
    fn heartbeat_ttl(&self) -> Duration {
        self.cfg.heartbeat_ttl
    }
    fn start(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        shutdown: &Shutdown,
    ) -> Result<usize, StepError> {
        Reader::start(self, con, shutdown)
    }
    fn poll(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        Reader::poll(self, con)
    }
}

/// The reader over every shard (`--shards`): one [`Reader`] per key set, all on the
/// reader thread's one connection. Each step polls every shard once, starting from the
/// next one each time so no shard waits behind another, and waits for the doorbell only
/// when every shard's read emptied its stream.
///
/// A shard whose hash slot is moving or unserved (`StoreError::Moving`: `TRYAGAIN` while
/// it is resharded, `CLUSTERDOWN`), or one of whose keys holds the wrong type, holds back
/// only itself (a shard whose group is gone starts again): it is reported under its own
/// name (`reader (shard i)`, naming the code), skipped for a short backoff (at most
/// [`crate::mover::MOVING_BACKOFF`]) and tried again; its start is retried the same way.
/// The other shards keep being read.
pub struct Shards<'a> {
    readers: Vec<Reader<'a>>,
    doorbell: Doorbell,
    next: usize,
    /// Per shard: whether its start went through, and, while its slot is moving, the
    /// backoff and when to try again.
    started: Vec<bool>,
    held: Vec<(crate::backoff::Backoff, Option<Instant>)>,
    /// The daemon's, for a start retried from a later step.
    shutdown: Shutdown,
}

impl Shards<'_> {
    /// Shard `i`'s step failed because its slot is moving or one of its keys holds the
    /// wrong type: reported, and skipped a while.
    fn hold(&mut self, i: usize, e: &store::StoreError) {
        let r = &self.readers[i];
        let problem = format!(
            "its messages wait: {}",
            e.operator_problem().unwrap_or_else(|| e.to_string())
        );
        if r.stats.report_critical(&r.name, problem.clone()) {
            log::warn!("{}: {problem}; the other shards go on", r.name);
        }
        let (backoff, until) = &mut self.held[i];
        *until = Some(Instant::now() + backoff.next_delay().min(crate::mover::MOVING_BACKOFF));
    }

    /// Shard `i` answered again after its slot moved.
    fn release(&mut self, i: usize) {
        let (backoff, until) = &mut self.held[i];
        if until.take().is_some() {
            backoff.reset();
            let r = &self.readers[i];
            if r.stats.clear_problem(&r.name, i64::MAX) {
                log::info!("{}: its slot answers again", r.name);
            }
        }
    }

    /// One shard's step: its start first if it has not gone through yet.
    fn step(&mut self, i: usize, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        if self.held[i].1.is_some_and(|t| Instant::now() < t) {
            self.readers[i].drained = true;
            return Ok(0);
        }
        let result = if self.started[i] {
            self.readers[i].poll(con)
        } else {
            let shutdown = self.shutdown.clone();
            self.readers[i].start(con, &shutdown)
        };
        match result {
            Ok(n) => {
                self.started[i] = true;
                self.release(i);
                Ok(n)
            }
            // A slot moving, or a key of this shard of the wrong type: only this shard
            // waits, the others are read on.
            Err(StepError::Store(e)) if e.is_moving() || e.operator_problem().is_some() => {
                self.hold(i, &e);
                self.readers[i].drained = true;
                Ok(0)
            }
            // This shard's group is gone (its stream's key removed): its start makes it
            // again at the next step; the connection and the other shards are fine.
            Err(StepError::Store(e)) if e.is_group_missing() => {
                self.started[i] = false;
                self.readers[i].drained = true;
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }
}

impl<'a> Shards<'a> {
    pub fn new(readers: Vec<Reader<'a>>, doorbell: Doorbell) -> Self {
        let readers: Vec<Reader<'a>> = readers
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.in_shard(i))
            .collect();
        let n = readers.len();
        Shards {
            started: vec![false; n],
            held: (0..n)
                .map(|i| {
                    (
                        crate::backoff::Backoff::new(&format!("reader (shard {i})")),
                        None,
                    )
                })
                .collect(),
            readers,
            doorbell,
            next: 0,
            shutdown: Shutdown::new(),
        }
    }
}

impl Source for Shards<'_> {
    fn role(&self) -> &'static str {
        "reader"
    }
    fn block(&self) -> Duration {
        self.readers
            .first()
            .map_or(Duration::from_secs(1), |r| r.cfg.block)
    }
    fn heartbeat_ttl(&self) -> Duration {
        self.readers
            .first()
            .map_or(Duration::from_secs(10), |r| r.cfg.heartbeat_ttl)
    }
    fn start(
        &mut self,
        con: &mut dyn redis::ConnectionLike,
        shutdown: &Shutdown,
    ) -> Result<usize, StepError> {
        // After a lost connection every shard starts again (its own pending first).
        self.started.iter_mut().for_each(|s| *s = false);
        self.shutdown = shutdown.clone();
        let mut n = 0;
        for i in 0..self.readers.len() {
            n += self.step(i, con)?;
        }
        Ok(n)
    }
    fn poll(&mut self, con: &mut dyn redis::ConnectionLike) -> Result<usize, StepError> {
        let len = self.readers.len();
        let mut n = 0;
        for k in 0..len {
            n += self.step((self.next + k) % len, con)?;
        }
        self.next = (self.next + 1) % len.max(1);
        // One wait for the whole round: each shard waiting for room in turn made a round
        // of N shards take N blocks while the channel was full, so a shard's heartbeat
        // and its mark were refreshed only that often (found from outside: with 6
        // shards a live process's heartbeats lapsed and its peers took its entries as a
        // dead one's; marks came a block apart shard after shard).
        if self.readers.iter().all(|r| r.full) {
            if let Some(r) = self.readers.first() {
                r.feed.wait_for_room(self.block());
            }
        } else if self.readers.iter().all(|r| r.drained || r.full) {
            self.doorbell.wait(IDLE_POLL.min(self.block()));
        }
        Ok(n)
    }
}
