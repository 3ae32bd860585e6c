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
    /// keeps its job id (`<pool>:jobs`; written by the settle scripts, read by the mover).
    pub jobs: String,
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
        }
    }

    /// The contract's defaults (`mq:delay:pool`, ...).
    pub fn with_prefix(prefix: &str) -> Keys {
        Keys::new(prefix, &KeyOverrides::default())
    }

    /// The heartbeat key of one consumer: exists while that consumer is alive.
    pub fn heartbeat(&self, consumer: &str) -> String {
        format!("{}:{consumer}:alive", self.heartbeat_prefix)
    }
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
