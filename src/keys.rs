//! Every Redis name the worker touches, built in one place.
//!
//! Defaults follow the wire contract with the existing PHP producers. A prefix replaces the
//! leading `mq` of every name, so a Redis Cluster deployment passes `--key-prefix '{mq}'`
//! and all keys land in one hash slot, which the Lua scripts need (they declare every key
//! they touch in `KEYS`). Each name can also be set on its own.

/// The resolved key names. Built once from the config; cloned into each role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    /// ZSET: member = job key, score = due time (unix seconds or milliseconds).
    pub pool: String,
    /// HASH: job key -> message JSON.
    pub data: String,
    /// HASH: job key -> "<job id> <sha1>" of a retry waiting in the pool, so the retry
    /// keeps its job id (`<pool>:jobs`; written by the settle scripts, read by the mover);
    /// and `msg\n<job key>` -> a copy of that retry's message, for its dead letter when a
    /// push overwrites the data before the retry runs.
    pub jobs: String,
    /// HASH: job key -> id of the stream entry its latest move wrote, until that entry is
    /// settled (`<pool>:moved`; kept by the move, settle and bury scripts), so `worker
    /// trace` finds a moved job's entry without reading the stream.
    pub moved: String,
    /// HASH: job key -> the ids of its newest dead letters, space-separated, oldest first
    /// (`<pool>:letters`; at most 8, kept by the scripts that write, requeue and purge
    /// dead letters), so `worker trace` finds them without reading the dead letters.
    pub letters: String,
    /// HASH: stream entry id -> in how many of its transactions the job of an entry
    /// delivered before began and its process died before seeing it end (`<pool>:starts`;
    /// counted by the workers as each such transaction begins and taken back once they see
    /// it end, a first delivery's start not counted; cleared when the entry is
    /// settled). An entry delivered more than `--max-deliveries` times
    /// is a poison message (it kills its consumer) only when its job started that many
    /// times more: a process killed while it held the entry unrun
    /// (read ahead, waiting for its `--max-rate` slot) is not the entry's fault. List
    /// mode keeps the same count in each queue's deliveries HASH, under
    /// `started:<sha1 of the message>`.
    pub starts: String,
    /// HASH: event -> `<unix ms> <job key>`: when (Redis's clock) a job of it was last
    /// taken for its data without proof (a dead letter at its second look), and which
    /// (`<pool>:refused`; written by the worker that dead-letters it),
    /// so that a process with no refusal of its own on record (restarted, another host)
    /// does not take the next such job for its data while a shop rule refuses them all.
    /// Also `lapse\n<event>` -> `<unix ms> <a refusal's first words>`: when a job the
    /// shop's rule had refused last went through, so that every process waits out a rule
    /// that comes and goes past `--refusal-grace`, not only the one that saw it. And
    /// `lock-ended\n<event>` -> `<unix ms>`: when a process last saw the lock its event's
    /// waiting jobs waited for end, so that a process that did not name that lock's
    /// holder brings its own waiters forward too (shard 0's, written by the mover).
    pub refused: String,
    /// HASH: `--max-rate` schedule (`<cap>@<interval µs>`, the cap `*` for every job, else
    /// an event) -> when its next slot is free, unix microseconds on Redis's clock
    /// (`<pool>:rates`; shard 0's serves every shard), so that every process of the prefix
    /// keeps one cap together.
    pub rates: String,
    /// STREAM the mover appends due messages to, fields `msg` and `key`.
    pub stream: String,
    /// Consumer group on `stream`.
    pub group: String,
    /// STREAM of dead letters, fields `msg`, `reason`, `ts`, `event`, `key`, ...
    pub dead: String,
    /// Prefix of the per-consumer heartbeat keys (`<prefix>:<consumer>`).
    pub heartbeat_prefix: String,
    /// List mode: the queues in priority order (empty in stream mode).
    pub queues: Vec<Queue>,
    /// List mode: SET of the consumer names that have processing lists, so a peer can
    /// find the lists of a consumer that died.
    pub list_consumers: String,
    /// STRING: how many shards the keys of this prefix are split into (`<prefix>:shards`,
    /// absent for one unsharded set). Written once; every process checks its `--shards`
    /// against it.
    pub shard_count: String,
}

/// One list queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Queue {
    /// The LIST producers push onto, used as is (PHP writes `payment_queue`).
    pub name: String,
    /// Set when the queue carries raw JSON of one event instead of the envelope.
    pub raw_event: Option<String>,
    /// Where its dead letters go (`<name>:dead` by default).
    pub dead: String,
}

impl Queue {
    pub fn new(name: &str, raw_event: Option<&str>) -> Queue {
        Queue {
            name: name.to_string(),
            raw_event: raw_event.map(str::to_string),
            dead: format!("{name}:dead"),
        }
    }

    /// HASH of delivery counts by message digest: how often a message was fetched without
    /// being settled (a message that kills its consumer comes back after every restart).
    pub fn deliveries(&self) -> String {
        format!("{}:deliveries", self.name)
    }

    /// The processing list of one consumer on this queue: messages it holds.
    pub fn processing(&self, consumer: &str) -> String {
        format!("{}:processing:{consumer}", self.name)
    }
}

/// Optional per-name overrides; `None` means "derive from the prefix".
#[derive(Clone, Debug, Default)]
pub struct KeyOverrides {
    pub pool: Option<String>,
    pub data: Option<String>,
    pub stream: Option<String>,
    pub group: Option<String>,
    pub dead: Option<String>,
}

pub const DEFAULT_PREFIX: &str = "mq";

impl Keys {
    pub fn new(prefix: &str, o: &KeyOverrides) -> Keys {
        let pool = o
            .pool
            .clone()
            .unwrap_or_else(|| format!("{prefix}:delay:pool"));
        Keys {
            data: o.data.clone().unwrap_or_else(|| format!("{pool}:data")),
            jobs: format!("{pool}:jobs"),
            moved: format!("{pool}:moved"),
            letters: format!("{pool}:letters"),
            starts: format!("{pool}:starts"),
            refused: format!("{pool}:refused"),
            rates: format!("{pool}:rates"),
            pool,
            stream: o
                .stream
                .clone()
                .unwrap_or_else(|| format!("{prefix}:events")),
            group: o.group.clone().unwrap_or_else(|| "main".to_string()),
            dead: o
                .dead
                .clone()
                .unwrap_or_else(|| format!("{prefix}:dead-letter")),
            heartbeat_prefix: format!("{prefix}:consumer"),
            queues: Vec::new(),
            list_consumers: format!("{prefix}:list-consumers"),
            shard_count: format!("{prefix}:shards"),
        }
    }

    /// The key sets of `n` shards: shard `i` is the default layout under the prefix
    /// `{<prefix>:<i>}`, so each set is one hash slot of its own on a Redis Cluster
    /// (`{mq:0}:delay:pool`, `{mq:0}:events`, ...). One shard is these keys themselves.
    pub fn sharded(&self, prefix: &str, n: usize) -> Vec<Keys> {
        if n <= 1 {
            return vec![self.clone()];
        }
        (0..n)
            .map(|i| {
                let mut k = Keys::with_prefix(&format!("{{{prefix}:{i}}}"));
                k.group = self.group.clone();
                k.shard_count = self.shard_count.clone();
                k
            })
            .collect()
    }

    /// Every name the scripts of this set use together (a sample heartbeat stands for the
    /// heartbeat keys), for the one-slot check on a Redis Cluster.
    pub fn script_names(&self) -> Vec<String> {
        let mut names = vec![
            self.pool.clone(),
            self.data.clone(),
            self.jobs.clone(),
            self.moved.clone(),
            self.letters.clone(),
            self.stream.clone(),
            self.dead.clone(),
            self.heartbeat("any"),
            self.without_database("any"),
        ];
        if !self.queues.is_empty() {
            names.push(self.list_consumers.clone());
        }
        for q in &self.queues {
            names.extend([
                q.name.clone(),
                q.dead.clone(),
                q.deliveries(),
                q.processing("any"),
            ]);
        }
        names
    }

    /// The contract's defaults (`mq:delay:pool`, ...).
    pub fn with_prefix(prefix: &str) -> Keys {
        Keys::new(prefix, &KeyOverrides::default())
    }

    /// The heartbeat key of one consumer: exists while that consumer is alive.
    pub fn heartbeat(&self, consumer: &str) -> String {
        format!("{}:{consumer}:alive", self.heartbeat_prefix)
    }

    /// Exists while that consumer is alive but has had no usable PostgreSQL for a
    /// heartbeat's time: a peer that has one takes over its pending entries, as a dead
    /// consumer's (`store::stream::take_over`).
    pub fn without_database(&self, consumer: &str) -> String {
        format!("{}:{consumer}:no-database", self.heartbeat_prefix)
    }
}

/// The shard of a job key among `n`: `crc32(key) mod n`, CRC-32 as zlib, PHP's `crc32()`
/// and MySQL's `CRC32()` compute it (IEEE, the one almost every library means).
pub fn shard_of(job_key: &[u8], n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    (crc32fast::hash(job_key) % n as u32) as usize
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag (the text between
/// the first `{` and the next `}`, when not empty) or of the whole name, mod 16384.
pub fn slot(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &b[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(b)) % 16384
}

/// On a Redis Cluster every key one script touches must share a hash slot: the first
/// pair of `names` that does not, in words, or `None`.
pub fn slot_conflict(names: &[String]) -> Option<String> {
    let first = names.first()?;
    let want = slot(first);
    names.iter().find(|n| slot(n) != want).map(|n| {
        format!(
            "on a Redis Cluster the keys a script uses together must share one hash slot, \
             but {first:?} is in slot {want} and {n:?} in slot {}: put one hash tag in every \
             name (e.g. --key-prefix '{{mq}}', queue names such as '{{mq}}payment_queue')",
            slot(n)
        )
    })
}

impl Default for Keys {
    fn default() -> Self {
        Keys::with_prefix(DEFAULT_PREFIX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_wire_contract() {
        let k = Keys::default();
        assert_eq!(k.pool, "mq:delay:pool");
        assert_eq!(k.data, "mq:delay:pool:data");
        assert_eq!(k.stream, "mq:events");
        assert_eq!(k.group, "main");
        assert_eq!(k.dead, "mq:dead-letter");
    }

    #[test]
    fn a_hash_tag_prefix_reaches_every_key() {
        let k = Keys::with_prefix("{mq}");
        for name in [&k.pool, &k.data, &k.stream, &k.dead] {
            assert!(name.starts_with("{mq}:"), "{name}");
        }
        assert!(k.heartbeat("h1").starts_with("{mq}:"));
    }

    #[test]
    fn slots_follow_redis_cluster() {
        // Vectors from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot("123456789"), 12739);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), 8363);
        assert_eq!(slot("foo{{bar}}zap"), 4015);
        assert_eq!(slot("{bar"), 4015);
        assert!(slot_conflict(&Keys::with_prefix("{mq}").script_names()).is_none());
        let e = slot_conflict(&Keys::default().script_names()).unwrap();
        assert!(e.contains("--key-prefix '{mq}'"), "{e}");
    }

    #[test]
    fn shards_are_tagged_and_chosen_by_crc32() {
        let k = Keys::default().sharded("mq", 3);
        assert_eq!(k.len(), 3);
        assert_eq!(k[2].pool, "{mq:2}:delay:pool");
        assert_eq!(k[2].stream, "{mq:2}:events");
        assert_eq!(k[2].shard_count, "mq:shards");
        for s in &k {
            assert!(slot_conflict(&s.script_names()).is_none());
        }
        // The test vector of docs/scaling.md (Sharding): PHP's crc32('order:1001') % 3.
        assert_eq!(crc32fast::hash(b"order:1001"), 0xdf03_51ab);
        assert_eq!(shard_of(b"order:1001", 3), 1);
        assert_eq!(shard_of(b"anything", 1), 0);
        assert_eq!(Keys::default().sharded("mq", 1), vec![Keys::default()]);
    }

    #[test]
    fn each_name_can_be_overridden() {
        let o = KeyOverrides {
            pool: Some("p".into()),
            stream: Some("s".into()),
            ..Default::default()
        };
        let k = Keys::new("mq", &o);
        assert_eq!((k.pool.as_str(), k.data.as_str()), ("p", "p:data"));
        assert_eq!(k.stream, "s");
    }
}
