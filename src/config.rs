//! The validated configuration every role reads.
//!
//! `cli.rs` parses raw flags; [`Config`] is what they become once checked, with defaults
//! that follow docs/operating.md (Flags). Nothing here touches the network. Errors name the flag or
//! variable they came from, and URLs are only ever shown through [`redact_url`].

use crate::conninfo;
use crate::keys::Keys;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

/// Where the worker reads from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// XREADGROUP on `keys.stream`.
    Stream,
    /// Reliable fetch from the list queues `keys.queues`, in priority order.
    List,
}

/// An older producer's pool the mover also serves: ZSET of keys whose STRING
/// value is an order id, all standing for `event`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegacyPool {
    pub key: String,
    pub event: String,
}

/// Files for TLS to Redis (a `rediss://` URL): the CA that signed the server's
/// certificate (the system's trust store when absent), and a client certificate and its
/// key for a server that asks for one (`tls-auth-clients yes`). PostgreSQL's TLS settings
/// live in its connection string (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisTls {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// `Debug` shows the URLs redacted (see the impl below).
#[derive(Clone)]
pub struct Config {
    pub redis_url: String,
    pub redis_tls: RedisTls,
    pub database_url: String,
    pub keys: Keys,
    /// `--shards`: the pool, its data, the stream and the dead letters split into this
    /// many hash-tagged key sets under `shard_prefix` (1: `keys` alone). See
    /// [`Config::shard_keys`].
    pub shards: usize,
    /// The `--key-prefix` the shard key sets are named from.
    pub shard_prefix: String,
    pub source: Source,
    /// Worker pool size; the PostgreSQL pool and the channel are sized from it.
    pub threads: usize,
    /// Stable consumer name in the group (host name by default), so a restarted process
    /// takes back its own pending entries at once.
    pub consumer: String,
    pub mover: MoverConfig,
    pub reader: ReaderConfig,
    pub jobs: JobConfig,
    /// Extra SQL handlers (`*.sql`) loaded at start.
    pub handlers_dir: Option<PathBuf>,
    /// Events acknowledged without any database work (benchmarks of the queue engine).
    pub noop_events: Vec<String>,
    /// How often the daemon logs its counters.
    pub stats_interval: Duration,
    /// Whether this process runs a mover thread (any number of processes may).
    pub run_mover: bool,
    /// `--allow-eviction`: start, and stay only WARNING, on a Redis whose
    /// `maxmemory-policy` may evict the worker's keys (refused otherwise, see `watch.rs`).
    pub allow_eviction: bool,
    /// Where `/metrics` and `/healthz` are served (`--metrics-addr`); off when `None`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Pruning of old `worker_inbox` rows (`prune.rs`).
    pub prune: PruneConfig,
    /// The status page's actions (requeue, purge) need this token (`--admin-token-file`);
    /// without one the page is read-only.
    pub admin_token: Option<AdminToken>,
    /// Host names the status page answers to besides IP addresses and `localhost`
    /// (`--status-host`), lower case.
    pub status_hosts: Vec<String>,
    /// `/healthz` is 503 while this process wrote more dead letters than this in the last
    /// minute (`--dead-rate-crit`); 0 turns it off.
    pub dead_rate_crit: u64,
    /// `/healthz` is 503 while the pool's oldest due member waits unmoved longer than
    /// this, the readers' backlog apart (`--mover-lag-crit`, the same figure and default
    /// as `worker stats --check`); zero turns it off.
    pub mover_lag_crit: Duration,
    /// A graceful stop not done this long after its signal exits at once, as a second
    /// signal does (`--shutdown-timeout`); zero waits for the jobs in hand however long.
    pub shutdown_timeout: Duration,
    /// What the users of the configuration need computed from the fields above, computed
    /// once ([`Config::settled`]).
    pub derived: Derived,
}

/// What every user of the configuration needs computed from its fields, so that none
/// computes it again: made by [`Config::new`], and again by [`Config::settled`], which the
/// daemon's start and each command call (a field changed after `new` counts from there).
#[derive(Clone, Debug, Default)]
pub struct Derived {
    /// `redis_url` without its secrets: how every message names the server.
    pub redis_shown: String,
    /// `database_url` without its secrets.
    pub database_shown: String,
    /// The key set of each shard, in shard order: `keys` itself when unsharded.
    pub shards: Vec<Keys>,
}

impl Derived {
    fn of(c: &Config) -> Derived {
        Derived {
            redis_shown: redact_url(&c.redis_url),
            database_shown: redact_url(&c.database_url),
            shards: c.shard_keys(),
        }
    }
}

/// The secret that unlocks the status page's actions, read from `--admin-token-file`.
/// `Debug` never shows it; [`AdminToken::matches`] compares in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

/// The shortest token taken.
pub const MIN_TOKEN_LEN: usize = 16;

impl AdminToken {
    /// Reads the token file: a regular file open to its owner only (mode 0600 or 0400,
    /// like `/etc/delay-worker/worker.env`), owned by the worker's user or root, holding one line of at least
    /// [`MIN_TOKEN_LEN`] printable ASCII characters without spaces. The error is one line
    /// naming the file and what to do.
    pub fn read(path: &std::path::Path) -> Result<AdminToken, String> {
        use std::os::unix::fs::PermissionsExt;
        let p = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {p}: {e}"))?;
        if !meta.is_file() {
            return Err(format!("{p} is not a file"));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "{p} is open to group or others (mode {mode:04o}): `chmod 600 {p}` (or 400), owned by the user the worker runs as"
            ));
        }
        // Whoever owns the file can change the token: the worker's own user, or root.
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let owner = std::os::unix::fs::MetadataExt::uid(&meta);
        if owner != euid && owner != 0 {
            return Err(format!(
                "{p} is owned by uid {owner}, not by the user the worker runs as (uid {euid}) or root: `chown {euid} {p}`"
            ));
        }
        if meta.len() > 1024 {
            return Err(format!(
                "{p} must hold one line, the token ({} bytes)",
                meta.len()
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {p}: {e}"))?;
        let line = text
            .strip_suffix('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .unwrap_or(&text);
        if line.contains(['\n', '\r']) {
            return Err(format!("{p} must hold one line, the token"));
        }
        AdminToken::new(line).map_err(|e| format!("{p}: {e}"))
    }

    /// A token from its text, checked as [`AdminToken::read`] checks a file's line.
    pub fn new(token: &str) -> Result<AdminToken, String> {
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the token must be printable ASCII without spaces".into());
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "the token has {} characters, at least {MIN_TOKEN_LEN} are needed (e.g. `openssl rand -hex 32`)",
                token.len()
            ));
        }
        Ok(AdminToken(token.to_string()))
    }

    /// Whether `given` is the token, compared in constant time (for tokens of the same
    /// length; a different length is told apart at once, which says nothing of the token).
    pub fn matches(&self, given: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        self.0.as_bytes().ct_eq(given).into()
    }
}

/// By hand, so that a config printed with `{:?}` never shows a password.
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("redis_url", &redact_url(&self.redis_url))
            .field("redis_tls", &self.redis_tls)
            .field("database_url", &redact_url(&self.database_url))
            .field("keys", &self.keys)
            .field("source", &self.source)
            .field("threads", &self.threads)
            .field("consumer", &self.consumer)
            .field("mover", &self.mover)
            .field("reader", &self.reader)
            .field("jobs", &self.jobs)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug)]
pub struct MoverConfig {
    /// Members moved per Lua call; a full batch loops at once.
    pub batch: usize,
    /// Longest sleep between two moves when nothing is due sooner.
    pub poll: Duration,
    /// Shortest sleep before a member due later: members falling due within this window
    /// move together in one call (and reach the workers together, as a set), at the cost
    /// of at most this much lateness. Zero moves each as soon as it is due.
    pub window: Duration,
    /// How long past its due time a member without data is left alone (a PHP producer
    /// may ZADD before HSET) before it is removed as an orphan.
    pub orphan_grace: Duration,
    /// How many moved entries may wait unread in the stream (its group's lag) before the
    /// mover moves more; 0: no bound (list mode is not bounded). A backlog then leaves the pool as
    /// fast as the readers of every host take it, not in one burst of Redis's core.
    pub ahead: usize,
    /// List mode: index in `keys.queues` of the queue due messages go to.
    pub queue: usize,
    /// Older producers' pools, moved as well.
    /// On a Redis Cluster: a legacy member whose key is in another hash slot than its
    /// pool is dead-lettered (one script cannot move it).
    pub cluster: bool,
    pub legacy: Vec<LegacyPool>,
    /// A member whose data is larger is dead-lettered instead of moved (the same figure
    /// as `JobConfig::max_message_bytes`).
    pub max_message_bytes: usize,
}

#[derive(Clone, Debug)]
pub struct ReaderConfig {
    /// XREADGROUP BLOCK; also the period of the reader's maintenance pass.
    pub block: Duration,
    /// Entries idle this long on another consumer are reclaimed (XAUTOCLAIM).
    pub claim_idle: Duration,
    /// Entries delivered more often than this go to the dead letters.
    pub max_deliveries: u64,
    /// TTL of this consumer's heartbeat key; peers take over our entries once it expires.
    pub heartbeat_ttl: Duration,
    /// Acknowledged stream entries older than this are trimmed (never a pending or
    /// undelivered one). Zero keeps everything.
    pub retention: Duration,
    /// An entry or list message larger than this is dead-lettered inside Redis, never
    /// read (the same figure as `JobConfig::max_message_bytes`).
    pub max_message_bytes: usize,
}

#[derive(Clone, Debug)]
pub struct JobConfig {
    /// Retries of a transient failure before the message is dead-lettered.
    pub max_retries: u32,
    /// First retry delay; doubles each retry.
    pub retry_base: Duration,
    /// Upper bound of the retry delay.
    pub retry_cap: Duration,
    /// PostgreSQL `statement_timeout` for every handler statement.
    pub statement_timeout: Duration,
    /// PostgreSQL `lock_timeout` of a job's statements (a set waits a fifth of it): the
    /// longest the worker waits for a row lock another transaction holds before it lets
    /// go of its own and tries later.
    pub lock_timeout: Duration,
    /// A job that meets contention retries for at least this long after it first fell
    /// due (and `max_retries` times) before it is dead-lettered.
    pub retry_for: Duration,
    /// A job the database refuses (a trigger's `RAISE`, a constraint) while other jobs of
    /// its event go through is a dead letter only once it has been refused for this long:
    /// a rule the shop switches on for a while (a table frozen for a deploy, a trigger
    /// toggled) refuses some jobs while others pass, and ends.
    pub refusal_grace: Duration,
    /// `--max-rate`: caps on the jobs run per second, overall or by event.
    pub max_rates: Vec<crate::manners::MaxRate>,
    /// Messages larger than this are dead-lettered unread.
    pub max_message_bytes: usize,
    /// Most jobs a worker runs in one transaction (only jobs already waiting are batched).
    pub tx_batch: usize,
    /// Most jobs of one event, already waiting, a worker runs as one set through the
    /// handler's set form (see `handlers::Handler::set_statement`); 1 turns sets off.
    pub set_size: usize,
    /// Commit jobs without waiting for the WAL flush and make them durable with one flush
    /// before each batch of acks (see `db::flush_wal`).
    pub group_commit: bool,
}

/// A set's lock timeout in ms, from `--lock-timeout`: a fifth of it, so a set that meets
/// the shop's locks gives way soon, to be tried again whole and then split
/// (`workers::session::SET_TRIES`). A single job of an event whose sets are
/// being split waits as long ([`crate::manners::Manners::splitting`]).
pub fn set_lock_ms(lock_timeout: Duration) -> u128 {
    (lock_timeout.as_millis() / 5).max(1)
}

/// A set's lock timeout in ms while the shop is busy (the workers yield,
/// [`crate::manners::Manners::yielding`]): a twenty-fifth of `--lock-timeout`, 4 ms by
/// default, about twice a shop transaction's own time. A set holds the rows it locked
/// before the one it waits for, and a shop transaction that locks in the opposite order
/// (skus in descending id) waits on the set while the set waits on it; with a few hot
/// rows every other shop transaction queues behind the two. A set waiting 20 ms there
/// tipped a drain into a slow state that held the shop up: measured with `scripts/bench.sh
/// shop --skus 10 --shop-rate 200 --shop-backlog 6000`, 4 of 5 runs at the shop's p99
/// 186–400 ms and the drain at 0.08–0.14× its rate alone; with 4 ms, none of 5, the p99
/// 9–11 ms and the drain 0.61–0.74× (docs/performance.md, "The shop's hot rows").
pub fn busy_set_lock_ms(lock_timeout: Duration) -> u128 {
    (lock_timeout.as_millis() / 25).max(1)
}

impl JobConfig {
    /// Most jobs a worker takes from the channel at once: a set, or a transaction's batch.
    pub fn take_size(&self) -> usize {
        self.tx_batch.max(self.set_size).max(1)
    }

    /// [`JobConfig::take_size`] under the caps of `manners`: no more than the global
    /// cap's share ([`crate::manners::Manners::global_share`]).
    pub fn take_size_under(&self, manners: &crate::manners::Manners) -> usize {
        let most = self.take_size();
        manners.global_share().map_or(most, |n| most.min(n))
    }
}

/// Default of `--move-window`: at 2,000 jobs/s with millisecond scores, about ten jobs per
/// move call, read and set instead of one, for at most 5 ms of lateness. Each of those is a
/// round trip, and round trips are what the worker's CPU goes to: 2 ms made it 0.11 s per
/// 1,000 jobs, 5 ms 0.073 (docs/performance.md).
pub const DEFAULT_MOVE_WINDOW: Duration = Duration::from_millis(5);

/// Default of `--set-size`: enough jobs per set that a backlog's commits and round trips
/// are shared (see docs/performance.md), few enough that a set's locks are brief.
pub const DEFAULT_SET_SIZE: usize = 32;

/// Default of `--lock-timeout`: a shop transaction holds its row locks for milliseconds,
/// so a job that waits longer meets a long lock (a shop's `SELECT ... FOR UPDATE`), and
/// waiting on would hold the job's own locks against the shop: it lets go and tries later.
/// Below PostgreSQL's `deadlock_timeout` (1 s), so in a lock cycle the worker gives way
/// first.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_millis(100);

/// Default of `--dead-rate-crit`: a healthy queue writes no dead letter at all; ten in a
/// minute is a producer or a handler gone wrong, to look at now rather than tomorrow.
pub const DEFAULT_DEAD_RATE_CRIT: u64 = 10;

/// Default of `--mover-lag-crit`, as `worker stats --check`'s: a due job that no mover
/// has taken for five seconds means no mover runs or the movers cannot keep up.
pub const DEFAULT_MOVER_LAG_CRIT: Duration = Duration::from_secs(5);

/// Default of `--shutdown-timeout`: half of the packaged unit's `TimeoutStopSec` (60 s),
/// so that the worker's own exit, which forgives the deliveries of the jobs it never ran,
/// comes before systemd's SIGKILL.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of `--retry-for`: an hour of a shop's lock, a long migration or a stuck
/// transaction, before a job that meets contention is given up on.
pub const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(3600);

/// Default of `--refusal-grace`: longer than a deploy's migration or a table frozen for
/// maintenance usually lasts, short enough that a job the shop's rules refuse for good is
/// told as a dead letter within minutes.
pub const DEFAULT_REFUSAL_GRACE: Duration = Duration::from_secs(120);

/// How old inbox rows are removed (`prune.rs`): one process at a time, in short batches.
#[derive(Clone, Debug)]
pub struct PruneConfig {
    /// Inbox rows whose `processed_at` is older than this are deleted. Zero: never.
    pub retention: Duration,
    /// Time from the start of one pass to the start of the next; a pass works at most
    /// half of it ([`PruneConfig::budget`]).
    pub interval: Duration,
    /// Rows deleted per statement (each its own short transaction).
    pub batch: usize,
    /// Pause between two batches, so the jobs' own transactions keep their latency.
    pub pause: Duration,
}

impl PruneConfig {
    /// Whether this process prunes at all.
    pub fn enabled(&self) -> bool {
        !self.retention.is_zero()
    }

    /// The longest a pass works before it leaves the rest to the next pass.
    pub fn budget(&self) -> Duration {
        self.interval / 2
    }
}

impl Default for PruneConfig {
    fn default() -> Self {
        PruneConfig {
            retention: Duration::from_secs(7 * 24 * 3600),
            interval: Duration::from_secs(10),
            batch: 250,
            pause: Duration::from_millis(10),
        }
    }
}

/// Durations in flags and thresholds: `100ms`, `2s`, `5m`, `24h`, `7d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    // humantime also reads months (`M`, `months`), weeks and years: a `15M` meant as
    // minutes would be 15 months. Only the units a delay of this worker needs are taken.
    let units_ok = s
        .split(|c: char| c.is_ascii_digit() || c == '.' || c.is_whitespace())
        .filter(|u| !u.is_empty())
        .all(|u| {
            matches!(
                u,
                "ns" | "us"
                    | "ms"
                    | "s"
                    | "sec"
                    | "secs"
                    | "m"
                    | "min"
                    | "mins"
                    | "h"
                    | "hr"
                    | "hrs"
                    | "hour"
                    | "hours"
                    | "d"
                    | "day"
                    | "days"
            )
        });
    if !units_ok {
        return Err(format!(
            "{s:?}: units are ms, s, m (minutes), h and d (examples: 100ms, 2s, 5m, 24h, 7d)"
        ));
    }
    humantime::parse_duration(s)
        .or_else(|e| humantime::parse_duration(&to_nanoseconds(s)).map_err(|_| e))
        .map_err(|e| format!("{e} (examples: 100ms, 2s, 5m, 24h, 7d)"))
}

/// Each term's fraction cut to the digits its unit carries down to a nanosecond
/// (`1.1818181818181819s` is `1.181818181s`): humantime refuses a fraction finer than a
/// nanosecond, which a delay computed by a program (a PHP float printed whole) often is.
fn to_nanoseconds(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(dot) = rest.find('.') {
        out.push_str(&rest[..=dot]);
        rest = &rest[dot + 1..];
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = rest[digits..].trim_start();
        let unit = &unit[..unit
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(unit.len())];
        let keep = match unit {
            "ns" => 0,
            "us" => 3,
            "ms" => 6,
            "m" | "min" | "mins" => 10,
            "h" | "hr" | "hrs" | "hour" | "hours" => 12,
            "d" | "day" | "days" => 13,
            _ => 9,
        };
        out.push_str(&rest[..digits.min(keep)]);
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// A delay: a duration with units (`900ms`, `15m`) or a bare number of seconds (`1.5`),
/// under 1e9 seconds.
pub fn parse_delay(s: &str) -> Result<Duration, String> {
    let d = match s.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && (0.0..1e9).contains(&secs) => Duration::from_secs_f64(secs),
        Ok(_) => return Err("must be between 0 and 1e9 seconds".into()),
        Err(_) => parse_duration(s)?,
    };
    if d.as_secs() >= 1_000_000_000 {
        return Err("must be under 1e9 seconds".into());
    }
    Ok(d)
}

/// `--move-ahead` by default (or [`MOVE_AHEAD_BATCHES`] of `--batch-size`, when more): ten
/// of the default batches, a third of a second of the fastest drain measured on one host,
/// looked at every 10 ms.
pub const DEFAULT_MOVE_AHEAD: usize = 5000;

/// `--move-ahead` is 0 or at least this many `--batch-size` batches: the mover refills a
/// whole batch once one fits and looks again every 10 ms, so a bound of a batch or two
/// left the readers idle between its looks (100 jobs a second at `--move-ahead 1`).
pub const MOVE_AHEAD_BATCHES: usize = 4;

/// `--max-message-bytes` by default.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 * 1024;

impl Default for MoverConfig {
    fn default() -> Self {
        MoverConfig {
            batch: 500,
            poll: Duration::from_millis(100),
            window: DEFAULT_MOVE_WINDOW,
            orphan_grace: Duration::from_secs(60),
            ahead: DEFAULT_MOVE_AHEAD,
            queue: 0,
            cluster: false,
            legacy: Vec::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

impl Default for ReaderConfig {
    fn default() -> Self {
        ReaderConfig {
            block: Duration::from_millis(2000),
            claim_idle: Duration::from_secs(60),
            max_deliveries: 10,
            heartbeat_ttl: Duration::from_secs(10),
            retention: Duration::from_secs(24 * 3600),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

impl Default for JobConfig {
    fn default() -> Self {
        JobConfig {
            max_retries: 3,
            retry_base: Duration::from_secs(1),
            retry_cap: Duration::from_secs(300),
            statement_timeout: Duration::from_secs(5),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            retry_for: DEFAULT_RETRY_FOR,
            refusal_grace: DEFAULT_REFUSAL_GRACE,
            max_rates: Vec::new(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            tx_batch: 1,
            set_size: DEFAULT_SET_SIZE,
            group_commit: true,
        }
    }
}

impl Config {
    /// The key set of each shard, in shard order: `keys` itself when unsharded. A job key
    /// lives in shard [`crate::keys::shard_of`]`(key, shards)`.
    pub fn shard_keys(&self) -> Vec<Keys> {
        self.keys.sharded(&self.shard_prefix, self.shards)
    }

    /// The key set a job key belongs to.
    pub fn keys_for(&self, job_key: &[u8]) -> Keys {
        if self.shards <= 1 {
            return self.keys.clone();
        }
        let i = crate::keys::shard_of(job_key, self.shards);
        self.keys
            .sharded(&self.shard_prefix, self.shards)
            .swap_remove(i)
    }

    /// A config with every default, for tests and library users.
    pub fn new(redis_url: &str, database_url: &str) -> Config {
        Config {
            redis_url: redis_url.to_string(),
            redis_tls: RedisTls::default(),
            database_url: database_url.to_string(),
            keys: Keys::default(),
            shards: 1,
            shard_prefix: crate::keys::DEFAULT_PREFIX.to_string(),
            source: Source::Stream,
            threads: 8,
            consumer: default_consumer_name(),
            mover: MoverConfig::default(),
            reader: ReaderConfig::default(),
            jobs: JobConfig::default(),
            handlers_dir: None,
            noop_events: Vec::new(),
            stats_interval: Duration::from_secs(60),
            run_mover: true,
            allow_eviction: false,
            metrics_addr: None,
            status_hosts: Vec::new(),
            dead_rate_crit: DEFAULT_DEAD_RATE_CRIT,
            mover_lag_crit: DEFAULT_MOVER_LAG_CRIT,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            prune: PruneConfig::default(),
            admin_token: None,
            derived: Derived::default(),
        }
        .settled()
    }

    /// The same configuration with [`Derived`] computed from its fields as they are now.
    pub fn settled(&self) -> Config {
        let mut c = self.clone();
        c.derived = Derived::of(&c);
        c
    }

    /// Sets the message size limit everywhere it is checked: the mover, the reader and the
    /// workers.
    pub fn set_max_message_bytes(&mut self, n: usize) {
        self.mover.max_message_bytes = n;
        self.reader.max_message_bytes = n;
        self.jobs.max_message_bytes = n;
    }

    /// Capacity of the reader -> pool channel. Two transactions' worth per worker keeps
    /// every worker fed while the reader is in a round trip, room for a full set per
    /// worker lets a backlog form whole sets, and the bound limits what a crash leaves
    /// pending.
    pub fn channel_capacity(&self) -> usize {
        self.threads * (2 * self.jobs.tx_batch.max(1)).max(self.jobs.set_size)
    }

    /// [`Config::channel_capacity`] under the caps of `manners`: no more than the global
    /// cap runs in a quarter of `--claim-idle`, so that no job waits for its slot long
    /// enough to be taken back as a stuck consumer's
    /// ([`crate::manners::Manners::global_runs_within`]).
    pub fn channel_capacity_under(&self, manners: &crate::manners::Manners) -> usize {
        let most = self.channel_capacity();
        manners
            .global_runs_within(self.reader.claim_idle / 4)
            .map_or(most, |n| most.min(n))
    }

    /// Size of the PostgreSQL pool: each worker holds one connection for its whole life
    /// (its prepared statements live there) and nothing else in the daemon checks one out.
    pub fn db_pool_size(&self) -> u32 {
        self.threads as u32
    }

    /// One line for the log, secrets redacted.
    pub fn summary(&self) -> String {
        let (stream, pool, shards) = if self.shards > 1 {
            let all = |k: &str| k.replacen(":0}", &format!(":0..{}}}", self.shards - 1), 1);
            let first = &self.derived.shards[0];
            (
                all(&first.stream),
                all(&first.pool),
                format!(" shards={}", self.shards),
            )
        } else {
            (
                self.keys.stream.clone(),
                self.keys.pool.clone(),
                String::new(),
            )
        };
        format!(
            "redis={} database={} stream={stream} group={} pool={pool}{shards} consumer={} threads={} batch={} poll={}ms block={}ms claim_idle={}s max_deliveries={} max_retries={} statement_timeout={}ms mover={}",
            self.derived.redis_shown,
            self.derived.database_shown,
            self.keys.group,
            self.consumer,
            self.threads,
            self.mover.batch,
            self.mover.poll.as_millis(),
            self.reader.block.as_millis(),
            self.reader.claim_idle.as_secs(),
            self.reader.max_deliveries,
            self.jobs.max_retries,
            self.jobs.statement_timeout.as_millis(),
            if self.run_mover { "on" } else { "off" },
        )
    }
}

/// The host name, which is stable across restarts of a systemd unit.
pub fn default_consumer_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "worker".to_string())
}

/// Hides every secret of a connection string, whatever its form, and keeps the rest
/// readable: the password of a URL's userinfo (`redis://:pw@h`, `redis://user:pw@h`,
/// `postgres://u:pw@h/db`), a `password` (or `pass`, `sslpassword`) in a URL's query, and
/// those settings of a libpq `key=value` string, quoted or not, with backslash escapes and
/// spaces around `=`. Each secret becomes `***`.
pub fn redact_url(url: &str) -> String {
    let mut hide: Vec<Range<usize>> = Vec::new();
    let secret = |p: &conninfo::Setting| conninfo::is_secret_key(&p.key) && !p.value.is_empty();
    if conninfo::is_url(url) {
        hide.extend(conninfo::url_password_range(url).filter(|r| !r.is_empty()));
        hide.extend(
            conninfo::query_settings(url)
                .iter()
                .filter(|p| secret(p))
                .map(|p| p.value_span.clone()),
        );
    } else {
        let settings = conninfo::key_values(url);
        hide.extend(
            settings
                .iter()
                .filter(|p| secret(p))
                .map(|p| p.value_span.clone()),
        );
        // Not a setting, but shaped like `user:password@host` (a URL without its scheme):
        // hidden all the same.
        let mut start = 0;
        for word in url.split(|c: char| c.is_ascii_whitespace()) {
            let range = start..start + word.len();
            start = range.end + 1;
            let in_setting = settings
                .iter()
                .any(|p| p.span.start <= range.start && range.end <= p.span.end);
            if let (false, Some(at)) = (in_setting, word.rfind('@')) {
                if let Some(colon) = word[..at].find(':') {
                    hide.push(range.start + colon + 1..range.start + at);
                }
            }
        }
    }
    hide.sort_by_key(|r| r.start);
    let mut out = String::with_capacity(url.len());
    let mut last = 0;
    for r in hide {
        if r.start < last {
            continue;
        }
        out.push_str(&url[last..r.start]);
        out.push_str("***");
        last = r.end;
    }
    out.push_str(&url[last..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_finer_than_a_nanosecond_is_cut_to_one() {
        assert_eq!(
            parse_delay("1.1818181818181819s"),
            Ok(Duration::from_nanos(1_181_818_181))
        );
        assert_eq!(
            parse_duration("2.1234567891ms"),
            Ok(Duration::from_nanos(2_123_456))
        );
        assert_eq!(
            parse_duration("1.00000000001m 0.5000000000001s"),
            Ok(Duration::from_nanos(60_000_000_000 + 500_000_000))
        );
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("1.5x").is_err());
    }

    #[test]
    fn the_admin_token_file_is_private_and_one_line() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("dw-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        let write = |text: &str, mode: u32| {
            std::fs::write(&file, text).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write("0123456789abcdef0123\n", 0o600);
        let t = AdminToken::read(&file).unwrap();
        assert!(t.matches(b"0123456789abcdef0123"));
        assert!(!t.matches(b"0123456789abcdef0124"));
        assert!(!t.matches(b"0123456789abcdef012"));
        assert!(!format!("{t:?}").contains("0123"));
        write("0123456789abcdef0123", 0o400);
        assert!(AdminToken::read(&file).is_ok(), "no newline, read-only");
        write("0123456789abcdef0123\n", 0o640);
        let e = AdminToken::read(&file).unwrap_err();
        assert!(e.contains("open to group or others (mode 0640)"), "{e}");
        write("0123456789abcdef0123\nsecond\n", 0o600);
        assert!(AdminToken::read(&file).unwrap_err().contains("one line"));
        write("short\n", 0o600);
        assert!(AdminToken::read(&file).unwrap_err().contains("at least 16"));
        write("0123456789 abcdef0123\n", 0o600);
        assert!(AdminToken::read(&file)
            .unwrap_err()
            .contains("without spaces"));
        let e = AdminToken::read(&dir.join("none")).unwrap_err();
        assert!(e.starts_with("cannot read "), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact_url("redis://:s3cret@127.0.0.1:6379/0"),
            "redis://:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("postgres://shop:s3cret@db:5432/shop"),
            "postgres://shop:***@db:5432/shop"
        );
        assert_eq!(
            redact_url("host=db user=shop password=s3cret dbname=shop"),
            "host=db user=shop password=*** dbname=shop"
        );
        assert_eq!(redact_url("redis://127.0.0.1/"), "redis://127.0.0.1/");
        let c = Config::new("redis://:pw1@h/", "postgres://u:pw2@h/d");
        assert!(!c.summary().contains("pw1") && !c.summary().contains("pw2"));
    }
}
