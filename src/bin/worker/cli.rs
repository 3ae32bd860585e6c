//! Command-line flags and subcommands (clap derive), and their validation into [`Config`].
//!
//! Every flag has its doc comment as `--help` text. Each subcommand owns its flags: the
//! connection flags ([`ConnArgs`]: URLs and key names) are shared by all; the daemon's
//! ([`RunArgs`]) belong to `run` (also accepted without a subcommand, `worker --threads 8`)
//! and `bench`; the queue layout ([`QueueArgs`]) to those and `stats`. A subcommand
//! rejects a flag it does not use. Connection URLs come from flags or from `REDIS_URL` /
//! `DATABASE_URL` (a password in a flag is warned about: `ps` shows it), Redis's TLS files
//! from `--redis-ca-file`, `--redis-cert-file`, `--redis-key-file` or their variables. A
//! value that does not make sense (a URL, a TLS file that cannot be read) is a
//! [`CliError`] naming the flag as the user gave it; `main` prints it as one line and
//! exits 2.

use clap::{Args, Parser, Subcommand};
use delay_worker::config::{parse_delay, parse_duration};
use delay_worker::config::{
    Config, JobConfig, LegacyPool, MoverConfig, PruneConfig, ReaderConfig, RedisTls, Source,
    DEFAULT_MOVE_AHEAD, MOVE_AHEAD_BATCHES,
};
use delay_worker::keys::{KeyOverrides, Keys, Queue};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "worker",
    version,
    about = "Delayed business events from Redis, applied once in PostgreSQL",
    long_about = None,
    // `--threads -1` is a bad value of --threads, not an unknown flag `-1`.
    allow_negative_numbers = true
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon (the default when no subcommand is given).
    #[command(allow_negative_numbers = true)]
    Run(RunArgs),
    /// Apply the schema migrations (shop tables where absent, the worker's own tables).
    Migrate,
    /// Schedule a delayed job.
    #[command(allow_negative_numbers = true)]
    Push(PushArgs),
    /// Cancel a scheduled job by key; exits 1 if there was no such job.
    Cancel {
        /// The job key.
        #[arg(long)]
        key: String,
    },
    /// Queue figures (stream, group, consumers, pool, dead letters); --watch, --check.
    #[command(allow_negative_numbers = true)]
    Stats {
        // The command's own flags first: `--help` lists them before the headings.
        #[command(flatten)]
        args: delay_worker::admin::StatsArgs,
        #[command(flatten)]
        queues: QueueArgs,
    },
    /// List, show, requeue or purge the dead letters (list mode: the dead lists).
    #[command(allow_negative_numbers = true)]
    Dead(DeadCli),
    /// Where the jobs of a job key (or an order) are and what became of them; exit 4 if
    /// there is no trace of one.
    Trace {
        #[command(flatten)]
        queues: QueueArgs,
        #[command(flatten)]
        args: delay_worker::admin::trace::TraceArgs,
    },
    /// Handler files: `worker handlers check --handlers-dir D`.
    #[command(subcommand)]
    Handlers(HandlersCommand),
    /// Measure lateness and throughput against this machine's ceilings (destructive: use
    /// a bench database; scripts/bench.sh sets one up).
    #[command(allow_negative_numbers = true)]
    Bench {
        #[command(flatten)]
        args: Box<crate::bench::BenchArgs>,
        #[command(flatten)]
        run: RunArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum HandlersCommand {
    /// Read, parse and prepare every *.sql file of --handlers-dir against the database
    /// (each in a transaction rolled back), without starting the daemon: one line per
    /// file; exit 0 when all are ok, 2 when one is not, 1 when PostgreSQL cannot be
    /// reached.
    Check {
        /// Directory of the SQL handlers (*.sql) to check.
        #[arg(long)]
        handlers_dir: PathBuf,
        /// The user the service runs as (the unit's User=): each file, the folder and the
        /// folders above it must be readable by it, as the check's own user may read what
        /// the service cannot. Not checked when no such user exists.
        #[arg(long, default_value = "delay-worker", value_name = "USER")]
        service_user: String,
    },
}

#[derive(Args, Debug)]
pub struct PushArgs {
    /// Event name, e.g. order.timeout.
    #[arg(long)]
    pub event: String,
    /// Payload, a JSON object, e.g. '{"order_no":"SO1"}'.
    #[arg(long)]
    pub payload: String,
    /// Delay from now: a duration (900ms, 15m, 2h) or a bare number of seconds (1.5).
    #[arg(long, value_parser = parse_delay)]
    pub delay: Duration,
    /// Job key; a deterministic key (order.timeout:SO1) makes a second push reschedule.
    #[arg(long)]
    pub key: Option<String>,
    /// Directory of extra SQL handlers (*.sql), to check the event against.
    #[arg(long)]
    pub handlers_dir: Option<PathBuf>,
    /// Push even an event no handler has, or a payload missing a required field (the
    /// worker will dead-letter it unless a handler for it exists by then).
    #[arg(long)]
    pub unchecked: bool,
}

/// Where the servers are and what the keys are called.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Connection and key names (any subcommand)")]
pub struct ConnArgs {
    /// Redis URL: redis:// or rediss:// (TLS) for one server,
    /// redis+cluster://host:port,host:port for a Redis Cluster,
    /// redis+sentinel://host:port,host:port/<master-name> for a master found through
    /// Sentinel.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        global = true,
        hide_env_values = true
    )]
    pub redis_url: String,
    /// PostgreSQL URL or key=value connection string; TLS with libpq's sslmode,
    /// sslrootcert, sslcert, sslkey settings.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        global = true,
        hide_env_values = true
    )]
    pub database_url: String,
    /// CA certificates (PEM) that signed the Redis server's certificate, for a rediss://
    /// URL [default: the system's trust store].
    #[arg(long, env = "REDIS_CA_FILE", global = true, value_name = "PEM")]
    pub redis_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for a Redis server that asks for one (tls-auth-clients).
    #[arg(long, env = "REDIS_CERT_FILE", global = true, value_name = "PEM")]
    pub redis_cert_file: Option<PathBuf>,
    /// Private key (PEM, not encrypted) of --redis-cert-file.
    #[arg(long, env = "REDIS_KEY_FILE", global = true, value_name = "PEM")]
    pub redis_key_file: Option<PathBuf>,
    /// Prefix of every key name (use a hash tag such as '{mq}' on Redis Cluster).
    #[arg(long, default_value = delay_worker::keys::DEFAULT_PREFIX, global = true)]
    pub key_prefix: String,
    /// Delay pool ZSET [default: <prefix>:delay:pool].
    #[arg(long, global = true)]
    pub pool_key: Option<String>,
    /// Message HASH [default: <pool>:data].
    #[arg(long, global = true)]
    pub data_key: Option<String>,
    /// Events STREAM [default: <prefix>:events].
    #[arg(long, global = true)]
    pub stream_key: Option<String>,
    /// Consumer group [default: main].
    #[arg(long, global = true)]
    pub group: Option<String>,
    /// Dead-letter STREAM [default: <prefix>:dead-letter].
    #[arg(long, global = true)]
    pub dead_key: Option<String>,
    /// Split the pool, its data, the stream and the dead letters into this many key sets
    /// ({<prefix>:0}:delay:pool, ...), one hash slot each; a job key goes to shard
    /// crc32(key) mod N. Every worker and producer of one queue must give the same N.
    #[arg(long, env = "WORKER_SHARDS", default_value_t = 1, global = true)]
    pub shards: usize,
}

/// Where messages are read from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceArg {
    /// XREADGROUP on the events stream.
    Stream,
    /// Reliable fetch (LMOVE into a processing list) from list queues.
    List,
}

/// Where messages wait: the stream, or list queues; and older producers' pools. `--help`
/// shows the list-mode flags under a heading of their own, apart from the stream's.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Queue layout")]
pub struct QueueArgs {
    /// Read from the events stream or from list queues.
    #[arg(long, value_enum, default_value = "stream")]
    pub source: SourceArg,
    /// List mode: the queues, highest priority first (the first non-empty one wins).
    #[arg(
        help_heading = "List mode only (--source list)",
        long,
        value_delimiter = ','
    )]
    pub queues: Vec<String>,
    /// List mode: a queue of raw JSON (no envelope) standing for one event, as
    /// NAME=EVENT (e.g. payment_queue=payment.paid); added after --queues if not listed.
    #[arg(
        help_heading = "List mode only (--source list)",
        long = "queue",
        value_name = "NAME=EVENT"
    )]
    pub raw_queues: Vec<String>,
    /// List mode: the queue the mover pushes due messages onto [default: the first queue
    /// that is not raw].
    #[arg(help_heading = "List mode only (--source list)", long)]
    pub mover_queue: Option<String>,
    /// List mode: suffix of each queue's dead list.
    #[arg(
        help_heading = "List mode only (--source list)",
        long,
        default_value = ":dead"
    )]
    pub dead_suffix: String,
    /// An older producer's pool also moved, as KEY=EVENT (e.g.
    /// delay:order_close=order.timeout): a ZSET of keys whose STRING value is the order id.
    #[arg(long = "legacy-pool", value_name = "KEY=EVENT")]
    pub legacy_pools: Vec<String>,
}

/// `worker dead`: the dead-letter commands, with the queue layout: given list mode's
/// flags (`--source list --queues ...`, anywhere after `dead`) they work on the queues'
/// dead lists instead of the dead-letter stream.
#[derive(Debug, Clone)]
pub struct DeadCli {
    pub queues: QueueArgs,
    pub args: delay_worker::admin::DeadArgs,
}

impl std::ops::Deref for DeadCli {
    type Target = delay_worker::admin::DeadArgs;
    fn deref(&self) -> &Self::Target {
        &self.args
    }
}

/// The ids of the queue layout's flags under `dead`: their own, so that a value given
/// after `dead` is not taken for the daemon's flag of the same name before it.
fn dead_id(id: &str) -> &'static str {
    const IDS: [(&str, &str); 6] = [
        ("source", "dead-source"),
        ("queues", "dead-queues"),
        ("raw_queues", "dead-raw_queues"),
        ("mover_queue", "dead-mover_queue"),
        ("dead_suffix", "dead-dead_suffix"),
        ("legacy_pools", "dead-legacy_pools"),
    ];
    IDS.iter()
        .find(|(from, _)| *from == id)
        .map(|(_, to)| *to)
        .expect("every flag of QueueArgs has its id under `dead`")
}

impl clap::FromArgMatches for DeadCli {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let one = |id: &str| m.get_one::<String>(dead_id(id)).cloned();
        let many = |id: &str| {
            m.get_many::<String>(dead_id(id))
                .map(|v| v.cloned().collect())
                .unwrap_or_default()
        };
        Ok(DeadCli {
            queues: QueueArgs {
                source: m
                    .get_one::<SourceArg>(dead_id("source"))
                    .copied()
                    .unwrap_or(SourceArg::Stream),
                queues: many("queues"),
                raw_queues: many("raw_queues"),
                mover_queue: one("mover_queue"),
                dead_suffix: one("dead_suffix").unwrap_or_else(|| ":dead".into()),
                legacy_pools: many("legacy_pools"),
            },
            args: delay_worker::admin::DeadArgs::from_arg_matches(m)?,
        })
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for DeadCli {
    /// The queue layout's flags are global to `dead`, so they also go after `dead list`.
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let layout = QueueArgs::augment_args(clap::Command::new("layout"));
        let cmd = layout.get_arguments().fold(cmd, |cmd, a| {
            let id = dead_id(a.get_id().as_str());
            cmd.arg(
                a.clone()
                    .id(id)
                    .global(true)
                    .help_heading("Queue layout (list mode: the dead lists)"),
            )
        });
        delay_worker::admin::DeadArgs::augment_args(cmd)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// How the daemon runs.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Daemon")]
pub struct RunArgs {
    /// Worker threads; the PostgreSQL pool and the channel are sized from it. The flag,
    /// when given, wins over WORKER_THREADS (the systemd unit's environment file sets it).
    #[arg(
        long,
        env = "WORKER_THREADS",
        default_value = "8",
        value_name = "THREADS"
    )]
    pub threads: String,
    /// Stable consumer name in the group [default: the host name]. Give each process
    /// on one host its own.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Members moved per Lua call.
    #[arg(long, default_value_t = 500)]
    pub batch_size: usize,
    /// Longest mover sleep when nothing is due sooner.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// Members falling due within this window of each other move together (one call, one
    /// set); each waits at most this long past its due time for it. 0 moves each at once.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    pub move_window: Duration,
    /// A due member without data is removed as an orphan this long after its due time.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub orphan_grace: Duration,
    /// The mover moves no more while this many moved entries wait unread in the stream
    /// (its group's lag): a backlog leaves the pool as fast as the readers take it. 0: no
    /// bound; else at least 4 x --batch-size. List mode is not bounded. [default: 5000,
    /// or 4 x --batch-size when that is more]
    #[arg(long)]
    pub move_ahead: Option<usize>,
    /// Do not run a mover in this process (another process moves).
    #[arg(long)]
    pub no_mover: bool,
    /// Run even though Redis's maxmemory-policy may evict the worker's keys (allkeys-*),
    /// which loses scheduled jobs; logged as a warning at start (keys it does evict are
    /// critical all the same). Without it such a Redis is refused.
    #[arg(long)]
    pub allow_eviction: bool,
    /// XREADGROUP block timeout; also how often the reader does its maintenance.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub block: Duration,
    /// Reclaim entries idle this long on another consumer.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub claim_idle: Duration,
    /// Dead-letter entries delivered more than this many times.
    #[arg(long, default_value_t = 10)]
    pub max_deliveries: u64,
    /// TTL of this consumer's heartbeat key; peers take over its entries once expired.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub heartbeat_ttl: Duration,
    /// Trim acknowledged stream entries older than this (0 keeps all). Pending and
    /// undelivered entries are never trimmed; dead letters never automatically.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    pub retention: Duration,
    /// Delete worker_inbox rows older than this (0 keeps all). Must be longer than
    /// every way a job can arrive again, --retention included (see docs/design.md, "Inbox retention").
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    pub inbox_retention: Duration,
    /// Time between two inbox pruning passes (a pass works at most half of it).
    #[arg(long, default_value = "10s", value_parser = parse_duration, hide = true)]
    pub inbox_prune_interval: Duration,
    /// Inbox rows deleted per statement.
    #[arg(long, default_value_t = 250, hide = true)]
    pub inbox_prune_batch: usize,
    /// Pause between two inbox pruning batches.
    #[arg(long, default_value = "10ms", value_parser = parse_duration, hide = true)]
    pub inbox_prune_pause: Duration,
    /// Retries of a transient failure before the dead letters.
    #[arg(long, default_value_t = 3)]
    pub max_retries: u32,
    /// First retry delay; doubles with each retry.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub retry_base: Duration,
    /// Longest retry delay.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub retry_cap: Duration,
    /// PostgreSQL statement timeout of every handler statement.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub statement_timeout: Duration,
    /// Longest a job waits for a row lock another transaction (the shop's) holds; then
    /// it lets go of its own locks and tries again later. A set waits a fifth of it (a
    /// twenty-fifth while the shop is busy), and so do the single jobs of an event whose
    /// sets met contention within 10 s; while the shop is busy one single job at a time
    /// waits the whole of it.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub lock_timeout: Duration,
    /// A job that meets contention (locks, deadlocks) is retried with backoff for at
    /// least this long after its due time, and --max-retries times, before the dead
    /// letters. 0: --max-retries alone.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub retry_for: Duration,
    /// A job the database refuses (a trigger's RAISE, a constraint) while other jobs of
    /// its event go through is tried again for this long after its first refusal before
    /// it is a dead letter: a rule switched on for a while (a table frozen during a
    /// deploy) refuses some jobs and ends. 0: a dead letter at its second look.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub refusal_grace: Duration,
    /// Cap on the jobs run per second: N/s (or /m, /h) for all, EVENT=N/s for one event
    /// (repeat, or separate with commas) [default: no cap].
    #[arg(long, value_name = "[EVENT=]N/s", value_delimiter = ',')]
    pub max_rate: Vec<String>,
    /// Messages larger than this many bytes are dead-lettered unread.
    #[arg(long, default_value_t = 65536)]
    pub max_message_bytes: usize,
    /// Most jobs a worker runs in one transaction, each with its own inbox row (only jobs
    /// already waiting are batched; a failure reruns each job alone).
    #[arg(long, default_value_t = 1)]
    pub tx_batch: usize,
    /// Most jobs of one event, already waiting, a worker runs as one set through the
    /// handler's set form (one statement per table); 1 runs every job alone.
    #[arg(long, default_value_t = delay_worker::config::DEFAULT_SET_SIZE)]
    pub set_size: usize,
    /// Wait for the WAL flush at every job's commit instead of once per batch of acks
    /// (group commit is the default; an acknowledged job is durable either way).
    #[arg(long)]
    pub no_group_commit: bool,
    /// Directory of extra SQL handlers (*.sql).
    #[arg(long)]
    pub handlers_dir: Option<PathBuf>,
    /// Acknowledge this event without any database work (measures the queue engine alone).
    #[arg(long, hide = true)]
    pub noop_event: Vec<String>,
    /// How often to log the counters.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub stats_interval: Duration,
    /// /healthz answers 503 while this process wrote more dead letters than this in the
    /// last minute (0: never).
    #[arg(long, default_value_t = delay_worker::config::DEFAULT_DEAD_RATE_CRIT)]
    pub dead_rate_crit: u64,
    /// /healthz answers 503 while a due job waits in the pool unmoved longer than this
    /// (not counting jobs held back for busy readers): no process runs a mover, or the
    /// movers cannot keep up. The same figure as `stats --check`'s mover lag (0: never).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub mover_lag_crit: Duration,
    /// A graceful stop (SIGTERM, SIGINT) whose jobs in hand are not finished this long
    /// after the signal exits at once, as a second signal does: their statement or
    /// commit waits on a server that does not answer (a synchronous standby gone, a
    /// frozen server); unacknowledged jobs stay pending (0: wait however long).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
    /// Serve Prometheus metrics on /metrics and a health check on /healthz at this
    /// address, e.g. 127.0.0.1:9187 [default: off].
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// File holding the token (one line, mode 0600 or 0400) that unlocks the status
    /// page's requeue and purge [default: the page is read-only].
    #[arg(long, value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// A host name the status page answers to, besides IP addresses and localhost
    /// (repeat, or separate with commas), e.g. the name of this host in the browser's
    /// address bar.
    #[arg(long, value_name = "NAME", value_delimiter = ',')]
    pub status_host: Vec<String>,
    /// Last, so that its help headings (the queue layout, list mode) come after the
    /// daemon's own flags.
    #[command(flatten)]
    pub queues: QueueArgs,
}

#[derive(Debug, thiserror::Error)]
#[error("{flag}: {problem}")]
pub struct CliError {
    pub flag: &'static str,
    pub problem: String,
}

/// Splits `NAME=VALUE`; both sides must be non-empty.
fn split_pair(spec: &str, flag: &'static str) -> Result<(String, String), CliError> {
    match spec.split_once('=') {
        Some((a, b)) if !a.trim().is_empty() && !b.trim().is_empty() => {
            Ok((a.trim().to_string(), b.trim().to_string()))
        }
        _ => Err(CliError {
            flag,
            problem: format!("{spec:?} is not NAME=EVENT"),
        }),
    }
}

fn check(ok: bool, flag: &'static str, problem: &str) -> Result<(), CliError> {
    if ok {
        Ok(())
    } else {
        Err(CliError {
            flag,
            problem: problem.to_string(),
        })
    }
}

impl ConnArgs {
    pub fn keys(&self) -> Result<Keys, CliError> {
        check(
            !self.key_prefix.is_empty(),
            "--key-prefix",
            "must not be empty",
        )?;
        let o = KeyOverrides {
            pool: self.pool_key.clone(),
            data: self.data_key.clone(),
            stream: self.stream_key.clone(),
            group: self.group.clone(),
            dead: self.dead_key.clone(),
        };
        let keys = Keys::new(&self.key_prefix, &o);
        check(
            (1..=1024).contains(&self.shards),
            "--shards",
            "must be between 1 and 1024",
        )?;
        if self.shards > 1 {
            check(
                [&o.pool, &o.data, &o.stream, &o.dead].iter().all(|o| o.is_none()),
                "--shards",
                "names every key itself: leave out --pool-key, --data-key, --stream-key and --dead-key",
            )?;
            check(
                !self.key_prefix.contains(['{', '}']),
                "--shards",
                "puts a hash tag in every name itself: give --key-prefix without braces",
            )?;
        }
        Ok(keys)
    }
}

impl RunArgs {
    /// Every daemon flag at its default (what `push` or `dead` run with), from the one
    /// place the defaults are written: the `#[arg]`s above.
    pub fn defaults() -> RunArgs {
        use clap::{CommandFactory, FromArgMatches};
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            run: RunArgs,
        }
        let m = Only::command().get_matches_from(["worker"]);
        Only::from_arg_matches(&m)
            .map(|o| o.run)
            .expect("the daemon flags' defaults parse")
    }
}

impl Cli {
    /// The daemon flags this command runs with: its own, or the defaults with the queue
    /// layout `stats` was given.
    fn run_args(&self) -> std::borrow::Cow<'_, RunArgs> {
        use std::borrow::Cow;
        match &self.command {
            None => Cow::Borrowed(&self.run),
            Some(Command::Run(r)) | Some(Command::Bench { run: r, .. }) => Cow::Borrowed(r),
            Some(Command::Stats { queues, .. })
            | Some(Command::Dead(DeadCli { queues, .. }))
            | Some(Command::Trace { queues, .. }) => Cow::Owned(RunArgs {
                queues: queues.clone(),
                ..RunArgs::defaults()
            }),
            Some(_) => Cow::Owned(RunArgs::defaults()),
        }
    }

    /// [`Cli::config`], plus the checks that need to know where a value came from: a URL
    /// that does not parse is named as the user gave it (`--redis-url` or `REDIS_URL`).
    pub fn config_from(&self, m: &clap::ArgMatches) -> Result<Config, CliError> {
        if let Some(name) = m.subcommand_name() {
            // The daemon's flags are accepted before a subcommand only by clap's grammar.
            let daemon = RunArgs::augment_args(clap::Command::new("run"));
            let cli = <Cli as clap::CommandFactory>::command();
            // Whether the subcommand takes the flag too (`worker dead --source list`).
            let takes = |flag: &str| {
                cli.find_subcommand(name)
                    .is_some_and(|sub| sub.get_arguments().any(|a| a.get_long() == Some(flag)))
            };
            for arg in daemon.get_arguments() {
                let id = arg.get_id().as_str();
                if m.value_source(id) == Some(clap::parser::ValueSource::CommandLine) {
                    let flag = arg.get_long().unwrap_or(id);
                    let problem = if name == "run" || name == "bench" || takes(flag) {
                        format!("--{flag} goes after the subcommand: `worker {name} --{flag} ...`")
                    } else {
                        format!("--{flag} is a flag of the daemon (`worker run`), not of `worker {name}`")
                    };
                    return Err(CliError {
                        flag: "usage",
                        problem,
                    });
                }
            }
        }
        let source = |id: &str| {
            let sub = m.subcommand().map(|(_, s)| s);
            [sub, Some(m)]
                .into_iter()
                .flatten()
                .find_map(|mm| mm.value_source(id))
        };
        let mut config = self.config().map_err(|e| {
            // A bad WORKER_THREADS is named as the operator wrote it.
            if e.flag == "--threads"
                && source("threads") == Some(clap::parser::ValueSource::EnvVariable)
            {
                CliError {
                    flag: "WORKER_THREADS",
                    ..e
                }
            } else {
                e
            }
        })?;
        let given = |id: &str, flag: &'static str, var: &'static str| {
            if source(id) == Some(clap::parser::ValueSource::EnvVariable) {
                var
            } else {
                flag
            }
        };
        if let Err(e) = delay_worker::tls::redis_client(&config.redis_url, &config.redis_tls) {
            let flag = match e.setting {
                "--redis-ca-file" => given("redis_ca_file", "--redis-ca-file", "REDIS_CA_FILE"),
                "--redis-cert-file" => {
                    given("redis_cert_file", "--redis-cert-file", "REDIS_CERT_FILE")
                }
                "--redis-key-file" => given("redis_key_file", "--redis-key-file", "REDIS_KEY_FILE"),
                _ => given("redis_url", "--redis-url", "REDIS_URL"),
            };
            return Err(CliError {
                flag,
                problem: e.problem,
            });
        }
        // `migrate` and `handlers` touch PostgreSQL only.
        if delay_worker::store::Topology::of(&config.redis_url)
            == delay_worker::store::Topology::Cluster
            && !matches!(
                self.command,
                Some(Command::Migrate) | Some(Command::Handlers(_))
            )
        {
            for (i, keys) in config.shard_keys().iter().enumerate() {
                let mut names = keys.script_names();
                if i == 0 {
                    names.extend(config.mover.legacy.iter().map(|l| l.key.clone()));
                }
                if let Some(problem) = delay_worker::keys::slot_conflict(&names) {
                    return Err(CliError {
                        flag: "--key-prefix",
                        problem,
                    });
                }
            }
        }
        let db_flag = given("database_url", "--database-url", "DATABASE_URL");
        match delay_worker::db::Target::parse(&config.database_url) {
            Ok(t) if t.config.get_hosts().is_empty() => {
                return Err(CliError {
                    flag: db_flag,
                    problem: "names no host: e.g. postgres://shop:password@127.0.0.1:5432/shop"
                        .into(),
                })
            }
            Ok(_) => {}
            Err(delay_worker::db::DbError::BadTls(e)) => {
                return Err(CliError {
                    flag: db_flag,
                    problem: e.to_string(),
                })
            }
            Err(e) => {
                let detail = match e {
                    delay_worker::db::DbError::BadUrl(d) => d,
                    other => other.to_string(),
                };
                return Err(CliError {
                    flag: db_flag,
                    problem: format!(
                        "not a PostgreSQL URL or key=value string ({detail}): e.g. postgres://shop:password@127.0.0.1:5432/shop"
                    ),
                });
            }
        }
        if config.redis_url.ends_with("#insecure") {
            log::warn!(
                "{}: #insecure: the Redis server's certificate is not checked (encrypted, but anyone in the path can pose as the server); give its CA with --redis-ca-file instead",
                given("redis_url", "--redis-url", "REDIS_URL")
            );
        }
        // A command line is visible to every user of the host (ps, /proc/PID/cmdline).
        for (id, flag, var, url) in [
            ("redis_url", "--redis-url", "REDIS_URL", &config.redis_url),
            (
                "database_url",
                "--database-url",
                "DATABASE_URL",
                &config.database_url,
            ),
        ] {
            if source(id) == Some(clap::parser::ValueSource::CommandLine)
                && delay_worker::conninfo::has_password(url)
            {
                log::warn!(
                    "{flag} carries a password on the command line, where every user of this host can read it (ps, /proc/PID/cmdline): set {var} in the environment instead (for the systemd unit: /etc/delay-worker/worker.env, mode 0600)"
                );
            }
        }
        if let Some(Command::Push(p)) = &self.command {
            config.handlers_dir = p.handlers_dir.clone();
        }
        // The redacted URLs and the shard key sets, from the fields as set above.
        Ok(config.settled())
    }

    /// A command that reads or repairs the queues without running the daemon's roles.
    fn runs_no_mover(&self) -> bool {
        matches!(
            self.command,
            Some(Command::Stats { .. }) | Some(Command::Dead(_)) | Some(Command::Trace { .. })
        )
    }

    /// Validates the flags into a [`Config`].
    pub fn config(&self) -> Result<Config, CliError> {
        let run = self.run_args();
        let r: &RunArgs = &run;
        let q = &r.queues;
        // Read here rather than by clap, so that a value that is not a number is named
        // as WORKER_THREADS when it came from there, as a value out of range is.
        let threads = r.threads.trim().parse::<usize>().unwrap_or(0);
        check(
            (1..=1024).contains(&threads),
            "--threads",
            "must be a whole number between 1 and 1024",
        )?;
        check(r.batch_size >= 1, "--batch-size", "must be at least 1")?;
        check(
            r.poll_interval >= Duration::from_millis(1),
            "--poll-interval",
            "must be at least 1ms",
        )?;
        let least = MOVE_AHEAD_BATCHES.saturating_mul(r.batch_size);
        check(
            r.move_ahead.is_none_or(|a| a == 0 || a >= least),
            "--move-ahead",
            &format!(
                "must be 0 (no bound) or at least {MOVE_AHEAD_BATCHES} x --batch-size \
                 ({least}): a smaller bound leaves the readers idle while the mover waits \
                 for room"
            ),
        )?;
        check(
            r.move_window <= r.poll_interval,
            "--move-window",
            "must not be longer than --poll-interval",
        )?;
        check(
            r.block >= Duration::from_millis(10),
            "--block",
            "must be at least 10ms",
        )?;
        check(
            r.claim_idle >= Duration::from_secs(1),
            "--claim-idle",
            "must be at least 1s",
        )?;
        check(
            r.heartbeat_ttl > r.block,
            "--heartbeat-ttl",
            "must be longer than --block (the heartbeat is refreshed once per block)",
        )?;
        check(
            r.max_deliveries >= 1,
            "--max-deliveries",
            "must be at least 1",
        )?;
        check(
            r.statement_timeout >= Duration::from_millis(1),
            "--statement-timeout",
            "must be at least 1ms",
        )?;
        check(
            r.lock_timeout >= Duration::from_millis(5),
            "--lock-timeout",
            "must be at least 5ms",
        )?;
        let max_rates = r
            .max_rate
            .iter()
            .map(|spec| {
                delay_worker::manners::MaxRate::parse(spec).map_err(|problem| CliError {
                    flag: "--max-rate",
                    problem,
                })
            })
            .collect::<Result<Vec<_>, CliError>>()?;
        if let Some((_, dup)) = max_rates
            .iter()
            .enumerate()
            .find(|(i, r)| max_rates[..*i].iter().any(|o| o.event == r.event))
        {
            return Err(CliError {
                flag: "--max-rate",
                problem: format!(
                    "{} given twice: give one",
                    dup.event
                        .as_deref()
                        .map_or("the cap on every job".to_string(), |e| format!(
                            "a cap on {e}"
                        ))
                ),
            });
        }
        check(
            (1..=256).contains(&r.tx_batch),
            "--tx-batch",
            "must be between 1 and 256",
        )?;
        check(
            (1..=1000).contains(&r.set_size),
            "--set-size",
            "must be between 1 and 1000",
        )?;
        check(
            r.max_message_bytes >= 64,
            "--max-message-bytes",
            "must be at least 64",
        )?;
        if let Some(c) = &r.consumer {
            check(!c.trim().is_empty(), "--consumer", "must not be empty")?;
        }
        if !r.inbox_retention.is_zero() {
            check(
                r.inbox_retention >= Duration::from_secs(60),
                "--inbox-retention",
                "must be 0 (keep all) or at least 1m",
            )?;
            check(
                r.retention.is_zero() || r.inbox_retention > r.retention,
                "--inbox-retention",
                &format!(
                    "must be longer than --retention ({}): the stream's acknowledged entries can be delivered again while it keeps them",
                    humantime::format_duration(r.retention)
                ),
            )?;
        }
        check(
            r.inbox_prune_interval >= Duration::from_millis(10),
            "--inbox-prune-interval",
            "must be at least 10ms",
        )?;
        check(
            (1..=100_000).contains(&r.inbox_prune_batch),
            "--inbox-prune-batch",
            "must be between 1 and 100000",
        )?;
        let mut config = Config::new(&self.conn.redis_url, &self.conn.database_url);
        config.redis_tls = RedisTls {
            ca_file: self.conn.redis_ca_file.clone(),
            cert_file: self.conn.redis_cert_file.clone(),
            key_file: self.conn.redis_key_file.clone(),
        };
        config.keys = self.conn.keys()?;
        config.shards = self.conn.shards;
        config.shard_prefix = self.conn.key_prefix.clone();
        let legacy = q
            .legacy_pools
            .iter()
            .map(|spec| {
                let (key, event) = split_pair(spec, "--legacy-pool")?;
                Ok(LegacyPool { key, event })
            })
            .collect::<Result<Vec<_>, CliError>>()?;
        let mut mover_queue = 0;
        match q.source {
            SourceArg::Stream => {
                config.source = Source::Stream;
                check(
                    q.queues.is_empty() && q.raw_queues.is_empty() && q.mover_queue.is_none(),
                    "--queues",
                    "queues need --source list",
                )?;
            }
            SourceArg::List => {
                config.source = Source::List;
                check(
                    config.shards == 1,
                    "--shards",
                    "works in stream mode only: list queues are named by their producers",
                )?;
                let mut queues: Vec<Queue> = q
                    .queues
                    .iter()
                    .filter(|q| !q.trim().is_empty())
                    .map(|q| Queue::new(q.trim(), None))
                    .collect();
                for spec in &q.raw_queues {
                    let (name, event) = split_pair(spec, "--queue")?;
                    match queues.iter_mut().find(|q| q.name == name) {
                        Some(q) => q.raw_event = Some(event),
                        None => queues.push(Queue::new(&name, Some(&event))),
                    }
                }
                check(
                    !queues.is_empty(),
                    "--queues",
                    "list mode needs at least one queue",
                )?;
                for queue in &mut queues {
                    queue.dead = format!("{}{}", queue.name, q.dead_suffix);
                }
                mover_queue = match &q.mover_queue {
                    Some(name) => queues
                        .iter()
                        .position(|q| &q.name == name)
                        .ok_or(CliError {
                            flag: "--mover-queue",
                            problem: format!("{name:?} is not one of the queues"),
                        })?,
                    None => match queues.iter().position(|q| q.raw_event.is_none()) {
                        Some(i) => i,
                        // `stats` and `dead` run no mover: raw queues alone are fine.
                        None if self.runs_no_mover() => 0,
                        None => {
                            return Err(CliError {
                                flag: "--mover-queue",
                                problem: "every queue is raw; name the queue due messages go to"
                                    .into(),
                            })
                        }
                    },
                };
                config.keys.queues = queues;
            }
        }
        config.threads = threads;
        if let Some(c) = &r.consumer {
            config.consumer = c.clone();
        }
        config.mover = MoverConfig {
            batch: r.batch_size,
            poll: r.poll_interval,
            window: r.move_window,
            orphan_grace: r.orphan_grace,
            ahead: r
                .move_ahead
                .unwrap_or(DEFAULT_MOVE_AHEAD.max(MOVE_AHEAD_BATCHES.saturating_mul(r.batch_size))),
            queue: mover_queue,
            cluster: delay_worker::store::Topology::of(&self.conn.redis_url)
                == delay_worker::store::Topology::Cluster,
            legacy,
            max_message_bytes: r.max_message_bytes,
        };
        config.run_mover = !r.no_mover;
        config.allow_eviction = r.allow_eviction;
        config.reader = ReaderConfig {
            block: r.block,
            claim_idle: r.claim_idle,
            max_deliveries: r.max_deliveries,
            heartbeat_ttl: r.heartbeat_ttl,
            retention: r.retention,
            max_message_bytes: r.max_message_bytes,
        };
        config.jobs = JobConfig {
            max_retries: r.max_retries,
            retry_base: r.retry_base,
            retry_cap: r.retry_cap.max(r.retry_base),
            statement_timeout: r.statement_timeout,
            lock_timeout: r.lock_timeout.min(r.statement_timeout),
            retry_for: r.retry_for,
            refusal_grace: r.refusal_grace,
            max_rates,
            max_message_bytes: r.max_message_bytes,
            tx_batch: r.tx_batch,
            set_size: r.set_size,
            group_commit: !r.no_group_commit,
        };
        config.handlers_dir = r.handlers_dir.clone();
        config.noop_events = r.noop_event.clone();
        config.stats_interval = r.stats_interval.max(Duration::from_secs(1));
        config.dead_rate_crit = r.dead_rate_crit;
        config.mover_lag_crit = r.mover_lag_crit;
        config.shutdown_timeout = r.shutdown_timeout;
        if let Some(a) = r.metrics_addr {
            check(
                a.port() != 0,
                "--metrics-addr",
                "must name a port, e.g. 127.0.0.1:9187",
            )?;
        }
        config.metrics_addr = r.metrics_addr;
        for name in &r.status_host {
            check(
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-'),
                "--status-host",
                "a host name, like shop-1.example.com (no port, no scheme)",
            )?;
        }
        config.status_hosts = r
            .status_host
            .iter()
            .map(|n| n.to_ascii_lowercase())
            .collect();
        config.prune = PruneConfig {
            retention: r.inbox_retention,
            interval: r.inbox_prune_interval,
            batch: r.inbox_prune_batch,
            pause: r.inbox_prune_pause,
        };
        if let Some(path) = &r.admin_token_file {
            check(
                r.metrics_addr.is_some(),
                "--admin-token-file",
                "unlocks the status page's actions, which needs --metrics-addr",
            )?;
            config.admin_token = Some(delay_worker::config::AdminToken::read(path).map_err(
                |problem| CliError {
                    flag: "--admin-token-file",
                    problem,
                },
            )?);
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches};

    #[test]
    fn the_admin_flags_do_not_clash_with_the_global_ones() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("worker").chain(args.iter().copied())).unwrap()
    }

    fn config_of(args: &[&str]) -> Result<Config, CliError> {
        let argv = std::iter::once("worker").chain(args.iter().copied());
        let m = Cli::command().try_get_matches_from(argv).unwrap();
        Cli::from_arg_matches(&m).unwrap().config_from(&m)
    }

    #[test]
    fn daemon_flags_belong_to_run_and_connection_flags_go_anywhere() {
        let c = config_of(&["--threads", "3", "--poll-interval", "20ms"]).unwrap();
        assert_eq!((c.threads, c.mover.poll), (3, Duration::from_millis(20)));
        let c = config_of(&["run", "--threads", "3"]).unwrap();
        assert_eq!(c.threads, 3);
        let c = config_of(&["--key-prefix", "{mq}", "stats"]).unwrap();
        assert_eq!(c.keys.pool, "{mq}:delay:pool");
        let c = config_of(&["stats", "--key-prefix", "{mq}"]).unwrap();
        assert_eq!(c.keys.pool, "{mq}:delay:pool");
        let e = config_of(&["--threads", "3", "run"]).unwrap_err();
        assert!(
            e.problem.contains("--threads goes after the subcommand"),
            "{e}"
        );
        let e = config_of(&["--threads", "3", "stats"]).unwrap_err();
        assert!(
            e.problem.contains("--threads is a flag of the daemon"),
            "{e}"
        );
        let c = config_of(&["stats", "--source", "list", "--queues", "a"]).unwrap();
        assert_eq!(c.keys.queues[0].name, "a");
        // A flag the subcommand takes too is shown where it goes, not refused as the
        // daemon's alone (found from outside: `worker --source list dead list`).
        for cmd in [&["dead", "list"][..], &["stats"], &["trace", "k"]] {
            let args = [&["--source", "list", "--queues", "q"][..], cmd].concat();
            let e = config_of(&args).unwrap_err();
            let hint = format!(
                "--source goes after the subcommand: `worker {} --source",
                cmd[0]
            );
            assert!(e.problem.contains(&hint), "{e}");
        }
    }

    #[test]
    fn dead_takes_the_queue_layout_before_or_after_its_command() {
        for args in [
            &["dead", "list", "--source", "list", "--queues", "a,b"][..],
            &["dead", "--source", "list", "--queues", "a,b", "list"][..],
            &[
                "dead", "requeue", "--queues", "a,b", "--source", "list", "--limit", "1",
            ][..],
        ] {
            let c = config_of(args).unwrap();
            assert_eq!(c.source, Source::List, "{args:?}");
            let names: Vec<&str> = c.keys.queues.iter().map(|q| q.name.as_str()).collect();
            assert_eq!(names, ["a", "b"], "{args:?}");
        }
        // Raw queues alone: no mover runs here, so no mover queue is needed.
        let c = config_of(&[
            "dead",
            "list",
            "--source",
            "list",
            "--queue",
            "p=payment.paid",
        ])
        .unwrap();
        assert_eq!(c.keys.queues[0].dead, "p:dead");
        let c = config_of(&["stats", "--source", "list", "--queue", "p=payment.paid"]).unwrap();
        assert_eq!(c.keys.queues[0].raw_event.as_deref(), Some("payment.paid"));
        assert!(config_of(&["dead", "list"]).unwrap().keys.queues.is_empty());
        // Before the subcommand: shown where it goes.
        let e = config_of(&["--source", "list", "dead", "list"]).unwrap_err();
        assert!(
            e.problem.contains("--source goes after the subcommand"),
            "{e}"
        );
    }

    #[test]
    fn list_mode_queues_raw_queues_and_legacy_pools() {
        let c = parse(&[
            "--source",
            "list",
            "--queues",
            "high,normal",
            "--queue",
            "payment_queue=payment.paid",
            "--legacy-pool",
            "delay:order_close=order.timeout",
        ])
        .config()
        .unwrap();
        let names: Vec<&str> = c.keys.queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(names, ["high", "normal", "payment_queue"]);
        assert_eq!(c.keys.queues[2].raw_event.as_deref(), Some("payment.paid"));
        assert_eq!(c.keys.queues[1].dead, "normal:dead");
        assert_eq!(c.mover.queue, 0);
        assert_eq!(c.mover.legacy[0].event, "order.timeout");
        let e = parse(&["--source", "list", "--queue", "p=payment.paid"])
            .config()
            .unwrap_err();
        assert_eq!(e.flag, "--mover-queue");
        let e = parse(&["--queues", "a"]).config().unwrap_err();
        assert_eq!(e.flag, "--queues");
        let e = parse(&["--legacy-pool", "nope"]).config().unwrap_err();
        assert_eq!(e.flag, "--legacy-pool");
    }

    #[test]
    fn inbox_retention_outlasts_the_stream_s_or_is_off() {
        let c = parse(&[]).config().unwrap();
        assert_eq!(c.prune.retention, Duration::from_secs(7 * 24 * 3600));
        assert!(c.prune.enabled());
        let c = parse(&["--inbox-retention", "0"]).config().unwrap();
        assert!(!c.prune.enabled());
        let e = parse(&["--inbox-retention", "12h"]).config().unwrap_err();
        assert_eq!(e.flag, "--inbox-retention");
        assert!(e.problem.contains("longer than --retention (1day)"), "{e}");
        let c = parse(&["--inbox-retention", "12h", "--retention", "6h"])
            .config()
            .unwrap();
        assert_eq!(c.prune.retention, Duration::from_secs(12 * 3600));
        let e = parse(&["--inbox-retention", "30s", "--retention", "0"])
            .config()
            .unwrap_err();
        assert!(e.problem.contains("at least 1m"), "{e}");
        let c = parse(&[
            "--inbox-prune-interval",
            "200ms",
            "--inbox-prune-batch",
            "50",
        ])
        .config()
        .unwrap();
        assert_eq!(c.prune.interval, Duration::from_millis(200));
        assert_eq!(c.prune.batch, 50);
    }

    #[test]
    fn bad_values_name_their_flag() {
        let e = parse(&["--threads", "0"]).config().unwrap_err();
        assert!(e.to_string().starts_with("--threads:"), "{e}");
        let e = parse(&["--threads", "abc"]).config().unwrap_err();
        assert_eq!(
            e.to_string(),
            "--threads: must be a whole number between 1 and 1024"
        );
        let e = parse(&["--block", "5s", "--heartbeat-ttl", "2s"])
            .config()
            .unwrap_err();
        assert!(e.to_string().starts_with("--heartbeat-ttl:"), "{e}");
        assert!(Cli::try_parse_from(["worker", "--poll-interval", "soon"]).is_err());
    }
}
