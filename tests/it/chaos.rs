//! The chaos soak: a seeded, randomized schedule of faults over a realistic load of order
//! timeouts, ended by an exact oracle.
//!
//! From one `u64` seed a run draws its configuration (one Redis server or, for a third of
//! the seeds, a Redis Cluster of three masters with `--shards 3`; stream or list mode (a
//! Cluster: stream mode), 1-3 worker processes, with or without a legacy pool, with or
//! without a handler that fails transiently) and its schedule: which orders get a timeout
//! and when it is pushed and due (second and millisecond scores, integer and float `ts`,
//! reschedules, re-pushes of a key after its job ran), which orders are paid before or
//! during the run, the hostile messages among the good ones, and the faults: kill -9 (with
//! or without a restart), SIGTERM, a second SIGTERM during the drain, Redis client kills,
//! stalls and restarts, PostgreSQL crash restarts, backend terminate storms and connection
//! exhaustion, and keys of the wrong type for a while. On a Cluster: a shard's hash slot
//! resharded to another master while the workers run (one more per 40 s of schedule),
//! lasting 2 to 6 s (`MIGRATING`/`IMPORTING`, its keys moved with `MIGRATE` in one to three
//! steps, its pool first, then the rest and the slot given to the new master), client kills
//! on every master, a shard's master stalled, a shard's keys of the wrong type (never a
//! shard whose slot moves meanwhile), and no restart of the one server. The plan printed at
//! the start is a function of the seed and the length only: `DW_CHAOS_SEED=S
//! DW_CHAOS_SECONDS=N` replays it (the machine's timing does not replay; the schedule does).
//!
//! Each run has its own Redis (AOF, `appendfsync always`), or its own Cluster of six nodes
//! (topology.rs), and its own PostgreSQL cluster; the workers are the real binary, their
//! logs go to files. On a Cluster each shard has a producer thread of its own, so a shard
//! whose slot moves holds back only its own pushes, and the legacy pool and its members
//! carry shard 0's hash tag. After the schedule the faults stop, the workers drain until
//! nothing is due, delivered or held, then stop with SIGTERM (exit 0), and the oracle
//! counts: every unpaid order whose timeout was pushed is cancelled once, no paid or
//! untouched order is, stock and coupons are exact, and every pushed message is done
//! (inbox), dead-lettered with a reason, or still scheduled, key by key (on a Cluster read
//! from every shard's keys wherever the reshards left them). Hostile messages must all be
//! dead letters.
//!
//! `chaos_fixed_seeds` (plain `cargo test`) runs three short fixed seeds on one Redis, and
//! `chaos_cluster_fixed_seed` one short seed on a Cluster with a reshard; `chaos_seeded`
//! (ignored) is what `scripts/chaos.sh` runs with `DW_CHAOS_SEED` and `DW_CHAOS_SECONDS`;
//! `chaos_plan` (ignored) prints a seed's plan without running it. `DW_CHAOS_SKIP` takes
//! fault kinds out of a plan and leaves the rest as drawn (to find which kind a failure
//! needs). The workers log to `$DW_CHAOS_LOG_DIR` (default the temp dir), kept when a run
//! fails (or with `DW_CHAOS_KEEP_LOGS`); `DW_CHILD_LOG` is their `RUST_LOG` (default `warn`).

use crate::support::*;
use crate::topology::Cluster;
use delay_worker::keys::Keys;
use delay_worker::store::Con;
use postgres::NoTls;
use redis::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// Schedule length of each fixed-seed run of the default pass (`DW_CHAOS_SHORT_SECONDS`).
const SHORT_SECONDS: f64 = 9.0;
/// The default pass. Between them these seeds draw stream mode (27, 6), list mode with two
/// queues (10), the legacy pool (10, 6), the flaky handler (6), workers killed for good, and
/// every fault kind of one Redis server.
const FIXED_SEEDS: [u64; 3] = [27, 10, 6];
/// The default pass's seed on a Redis Cluster (a test of its own: the four seeds in one
/// test took over a minute on two cores): three worker processes, the legacy pool and the
/// flaky handler, shard 0's slot (the legacy pool's) resharded in three steps while a
/// worker is killed for good (its peers take over its entries), shard 1's data hash of the
/// wrong type, shard 2's master stalled.
const CLUSTER_FIXED_SEED: u64 = 35;

const LEGACY_POOL: &str = "delay:order_close";
const LEGACY_EVENT: &str = "order.timeout";
/// Cluster mode: `--shards` over the three masters, and the legacy pool with its member
/// keys under shard 0's hash tag (a legacy pool is served with shard 0).
const CLUSTER_SHARDS: usize = 3;
const CLUSTER_LEGACY_POOL: &str = "{mq:0}delay:order_close";
/// Cluster mode: how long a master stalls (`DEBUG SLEEP`), well below the cluster's node
/// timeout (2 s), so no failover starts.
const CLUSTER_STALL: &str = "0.8";
/// List mode: the queue the mover feeds, and a higher one producers LPUSH onto directly.
const NORMAL: &str = "normal";
const HIGH: &str = "high";
const MAX_MESSAGE_BYTES: usize = 8192;
/// Far-future messages are due this long after the start: still scheduled at the end.
const FAR_SECS: i64 = 3600;
const FLAKY_RATE: f64 = 0.1;
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long after the schedule an input may still be retried before the run gives up.
const INPUT_GRACE: f64 = 90.0;
/// libfaketime (Debian's `faketime`, which scripts/test.sh installs).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

#[test]
fn chaos_fixed_seeds() {
    let secs = env_f64("DW_CHAOS_SHORT_SECONDS").unwrap_or(SHORT_SECONDS);
    let mut failed = Vec::new();
    for seed in FIXED_SEEDS {
        if let Err(report) = run_seed(seed, secs) {
            failed.push(report);
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} chaos seeds failed\n\n{}",
        failed.len(),
        FIXED_SEEDS.len(),
        failed.join("\n\n")
    );
}

#[test]
fn chaos_cluster_fixed_seed() {
    let secs = env_f64("DW_CHAOS_SHORT_SECONDS").unwrap_or(SHORT_SECONDS);
    assert!(
        Plan::draw(CLUSTER_FIXED_SEED, secs, &[]).setup.cluster,
        "seed {CLUSTER_FIXED_SEED} draws a Redis Cluster"
    );
    if let Err(report) = run_seed(CLUSTER_FIXED_SEED, secs) {
        panic!("{report}");
    }
}

#[test]
#[ignore = "long soak: scripts/chaos.sh runs it with DW_CHAOS_SEED and DW_CHAOS_SECONDS"]
fn chaos_seeded() {
    let seed = match std::env::var("DW_CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("DW_CHAOS_SEED={s:?} is not a u64")),
        Err(_) => fastrand::u64(..),
    };
    let secs = env_f64("DW_CHAOS_SECONDS").unwrap_or(60.0);
    if let Err(report) = run_seed(seed, secs) {
        panic!("{report}");
    }
}

#[test]
#[ignore = "prints the plan of DW_CHAOS_SEED and DW_CHAOS_SECONDS without running it"]
fn chaos_plan() {
    let seed: u64 = std::env::var("DW_CHAOS_SEED")
        .expect("DW_CHAOS_SEED")
        .trim()
        .parse()
        .expect("DW_CHAOS_SEED is a u64");
    let secs = env_f64("DW_CHAOS_SECONDS").unwrap_or(60.0);
    println!("{}", Plan::draw(seed, secs, &skip_list()).describe());
}

fn env_f64(name: &str) -> Option<f64> {
    let v = std::env::var(name).ok()?;
    let secs: f64 = v
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name}={v:?} is not a number of seconds"));
    assert!(
        (3.0..=86_400.0).contains(&secs),
        "{name}: between 3 and 86400 seconds"
    );
    Some(secs)
}

// ---- the plan: everything drawn from the seed ------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Stream,
    List,
}

#[derive(Clone, Debug)]
struct Setup {
    /// A Redis Cluster of three masters (a replica each) with `--shards 3`, instead of
    /// one Redis server: stream mode, and reshards among the faults.
    cluster: bool,
    mode: Mode,
    /// `--threads` of each worker process.
    threads: Vec<usize>,
    /// `--legacy-pool delay:order_close=order.timeout`.
    legacy: bool,
    /// List mode: queues `high,normal` (direct LPUSHes onto `high`) instead of `normal`.
    two_queues: bool,
    /// order.timeout fails with a serialization failure for 10 % of runs (retries).
    flaky: bool,
    orders: usize,
    /// Each worker process's clock against Redis's (seconds; 0: not shifted), through
    /// libfaketime: due times are Redis's, so the books must not care.
    clocks: Vec<i64>,
}

impl Setup {
    fn draw(rng: &mut fastrand::Rng, secs: f64) -> Setup {
        let mode = if rng.bool() { Mode::Stream } else { Mode::List };
        let workers = rng.usize(1..=3);
        Setup {
            cluster: false,
            mode,
            threads: (0..workers).map(|_| rng.usize(2..=4)).collect(),
            legacy: rng.bool(),
            two_queues: mode == Mode::List && rng.bool(),
            flaky: rng.u32(..100) < 40,
            orders: ((secs * 150.0) as usize).clamp(2000, 20_000),
            clocks: Vec::new(),
        }
    }

    /// The workers' clock offsets, from a generator of their own (so that a seed's other
    /// draws stay what they were before clocks were drawn): each process's clock is
    /// Redis's, or up to 3 minutes ahead or behind.
    fn draw_clocks(&mut self, seed: u64) {
        let mut rng = fastrand::Rng::with_seed(seed ^ 0xC10C_C10C);
        self.clocks = self
            .threads
            .iter()
            .map(|_| match rng.u32(..3) {
                0 => 0,
                1 => rng.i64(1..=180),
                _ => -rng.i64(1..=180),
            })
            .collect();
    }

    /// Whether a seed runs on a Redis Cluster (a third of them), from a generator of its
    /// own, so the other draws of a seed that does not stay what they were before (the
    /// three of `FIXED_SEEDS` among them).
    fn draws_cluster(seed: u64) -> bool {
        fastrand::Rng::with_seed(seed ^ 0xC105_7E86).u32(..3) == 0
    }

    /// On a Redis Cluster: stream mode (`--shards` is stream mode's), and no direct pushes.
    fn on_cluster(&mut self) {
        self.cluster = true;
        self.mode = Mode::Stream;
        self.two_queues = false;
    }

    /// The key sets the workers serve: one, or each shard's.
    fn shard_keys(&self) -> Vec<Keys> {
        match self.cluster {
            false => vec![Keys::default()],
            true => Keys::default().sharded("mq", CLUSTER_SHARDS),
        }
    }

    fn legacy_pool(&self) -> &'static str {
        match self.cluster {
            false => LEGACY_POOL,
            true => CLUSTER_LEGACY_POOL,
        }
    }

    /// A legacy member's STRING key (on a Cluster in its pool's slot).
    fn legacy_key(&self, order_id: i64) -> String {
        match self.cluster {
            false => format!("close_order_{order_id}"),
            true => format!("{{mq:0}}close_order_{order_id}"),
        }
    }

    fn queues(&self) -> Vec<&'static str> {
        match (self.mode, self.two_queues) {
            (Mode::Stream, _) => vec![],
            (Mode::List, false) => vec![NORMAL],
            (Mode::List, true) => vec![HIGH, NORMAL],
        }
    }

    /// Where the dead letters of pushed messages go.
    fn dead_key(&self, keys: &Keys) -> String {
        match self.mode {
            Mode::Stream => keys.dead.clone(),
            Mode::List => format!("{NORMAL}:dead"),
        }
    }

    fn worker_args(&self, handlers: Option<&Path>) -> Vec<String> {
        let mut a: Vec<String> = [
            "--poll-interval",
            "20ms",
            "--block",
            "200ms",
            "--heartbeat-ttl",
            "2s",
            "--retry-base",
            "100ms",
            "--stats-interval",
            "10s",
            "--max-message-bytes",
        ]
        .map(String::from)
        .to_vec();
        a.push(MAX_MESSAGE_BYTES.to_string());
        if let Some(dir) = handlers {
            a.push("--handlers-dir".into());
            a.push(dir.display().to_string());
            for s in ["--max-retries", "20", "--retry-cap", "500ms"] {
                a.push(s.into());
            }
        }
        if self.mode == Mode::List {
            for s in ["--source", "list", "--queues"] {
                a.push(s.into());
            }
            a.push(self.queues().join(","));
            a.push("--mover-queue".into());
            a.push(NORMAL.into());
        }
        if self.legacy {
            a.push("--legacy-pool".into());
            a.push(format!("{}={LEGACY_EVENT}", self.legacy_pool()));
        }
        if self.cluster {
            a.push("--shards".into());
            a.push(CLUSTER_SHARDS.to_string());
        }
        a
    }
}

impl fmt::Display for Setup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.mode, self.cluster) {
            (Mode::Stream, true) => write!(
                f,
                "a Redis Cluster of 3 masters (a replica each), stream mode with --shards {CLUSTER_SHARDS}"
            )?,
            (Mode::Stream, false) => write!(f, "stream mode")?,
            (Mode::List, _) => write!(
                f,
                "list mode (queues {}, the mover feeds {NORMAL})",
                self.queues().join(",")
            )?,
        }
        let t: Vec<String> = self.threads.iter().map(|t| t.to_string()).collect();
        write!(
            f,
            ", {} worker process{} ({} threads)",
            self.threads.len(),
            if self.threads.len() == 1 { "" } else { "es" },
            t.join("+")
        )?;
        if self.legacy {
            write!(f, ", legacy pool {}={LEGACY_EVENT}", self.legacy_pool())?;
        }
        if self.flaky {
            write!(
                f,
                ", flaky handler ({:.0}% serialization failures, --max-retries 20)",
                FLAKY_RATE * 100.0
            )?;
        }
        if self.clocks.iter().any(|&c| c != 0) {
            let c: Vec<String> = self.clocks.iter().map(|c| format!("{c:+}s")).collect();
            write!(
                f,
                ", worker clocks {} off Redis's (libfaketime)",
                c.join("/")
            )?;
        }
        write!(f, ", {} orders", self.orders)
    }
}

/// Hostile messages: each must become a dead letter with a reason and cancel nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hostile {
    NotJson,
    NotUtf8,
    UnknownEvent,
    NoOrder,
    PayloadNotObject,
    TooLarge,
    DeepNesting,
}

const HOSTILE: [Hostile; 7] = [
    Hostile::NotJson,
    Hostile::NotUtf8,
    Hostile::UnknownEvent,
    Hostile::NoOrder,
    Hostile::PayloadNotObject,
    Hostile::TooLarge,
    Hostile::DeepNesting,
];

impl Hostile {
    fn name(self) -> &'static str {
        match self {
            Hostile::NotJson => "not JSON",
            Hostile::NotUtf8 => "not UTF-8",
            Hostile::UnknownEvent => "unknown event",
            Hostile::NoOrder => "payload without order_no/order_id",
            Hostile::PayloadNotObject => "payload not an object",
            Hostile::TooLarge => "over --max-message-bytes",
            Hostile::DeepNesting => "600-deep JSON",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// order.timeout through the delay pool, due during the run.
    Good,
    /// order.timeout due an hour after the start: still scheduled at the end.
    Far,
    /// The legacy pool: member `close_order_<id>`, STRING key holding the id.
    Legacy {
        far: bool,
    },
    /// List mode: an envelope LPUSHed straight onto the `high` queue.
    Direct,
    Hostile(Hostile),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Again {
    /// The key pushed again while still scheduled: one job, new due time.
    Reschedule,
    /// The key pushed again after its job was due: a new job (new `ts`).
    Repush,
}

#[derive(Clone, Debug)]
struct MsgPlan {
    class: Class,
    /// The order it names (hostile: an untouched order it must not cancel).
    order: usize,
    /// A PHP-style random key (`<secs>:<12 hex>`) instead of `order.timeout:<order_no>`.
    php_key: Option<u64>,
    /// Hostile messages: their number (key and nonce).
    id: usize,
    push_at: f64,
    /// Seconds after the start (far-future messages: `FAR_SECS`).
    due_at: f64,
    /// Unix seconds score, as PHP's `time() + 900`; otherwise milliseconds.
    secs_score: bool,
    /// `ts` with a fraction (quarters), as PHP's `microtime(true)`.
    float_ts: Option<u8>,
    by_id: bool,
    again: Option<Again>,
    /// Pushed by the driver as part of this fault (its index in `Plan::faults`), when it
    /// opens a window: `due_at` is then seconds after that push.
    trigger: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WrongKey {
    /// The dead letters' key (stream, or the mover queue's dead list in list mode).
    Dead,
    /// The delay pool's data HASH.
    Data,
}

#[derive(Clone, Debug)]
enum Fault {
    Kill9 {
        slot: usize,
        restart_after: Option<f64>,
    },
    Term {
        slot: usize,
        restart_after: f64,
    },
    DoubleTerm {
        slot: usize,
        gap: f64,
        restart_after: f64,
    },
    ClientKill,
    DebugSleep,
    RedisRestart,
    PgRestart {
        down: f64,
    },
    PgTerminate {
        rounds: usize,
    },
    PgExhaust,
    PgRelease,
    /// `default_transaction_read_only` on (a primary demoted), then off again.
    PgReadOnly,
    PgWritable,
    /// A shop transaction holding a row lock (`at`: which order, or which sku, as a share
    /// of the table) for `secs`, on a thread of its own.
    ShopLock {
        table: &'static str,
        at: f64,
        secs: f64,
    },
    /// A deploy renaming `orders.cancel_reason`, then renaming it back.
    RenameColumn,
    RestoreColumn,
    /// A key of shard `.1` (0 on one server) of the wrong type, then restored.
    WrongType(WrongKey, usize),
    Restore(WrongKey, usize),
    /// Cluster mode: the master serving a shard stalls (`DEBUG SLEEP`).
    StallMaster {
        shard: usize,
    },
    /// Cluster mode: a shard's hash slot starts to move (`IMPORTING` on the target,
    /// `MIGRATING` on its master) to another master (`to`: which of the others, by port),
    /// for `secs`; its keys move in `steps` steps, then the end moves the rest and gives
    /// the slot to the target.
    ReshardBegin {
        shard: usize,
        to: usize,
        steps: usize,
        secs: f64,
    },
    ReshardStep {
        shard: usize,
        step: usize,
        steps: usize,
    },
    ReshardEnd {
        shard: usize,
    },
}

impl Fault {
    fn describe(&self, setup: &Setup) -> String {
        let shards = setup.shard_keys();
        let key = |k: &WrongKey, shard: &usize| match k {
            WrongKey::Dead => setup.dead_key(&shards[*shard]),
            WrongKey::Data => shards[*shard].data.clone(),
        };
        match self {
            Fault::Kill9 {
                slot,
                restart_after: Some(r),
            } => format!("kill -9 w{slot}, restart after {r:.2}s"),
            Fault::Kill9 {
                slot,
                restart_after: None,
            } => format!("kill -9 w{slot}, never restarted (its peers take over)"),
            Fault::Term {
                slot,
                restart_after,
            } => format!("SIGTERM w{slot} (graceful, exit 0), restart after {restart_after:.2}s"),
            Fault::DoubleTerm {
                slot,
                gap,
                restart_after,
            } => format!(
                "SIGTERM w{slot}, again {:.0}ms later during the drain (exit 130), restart after {restart_after:.2}s",
                gap * 1000.0
            ),
            Fault::ClientKill if setup.cluster => {
                "redis CLIENT KILL TYPE normal on every master".into()
            }
            Fault::ClientKill => "redis CLIENT KILL TYPE normal".into(),
            Fault::DebugSleep => "redis DEBUG SLEEP 1 (stall)".into(),
            Fault::StallMaster { shard } => {
                format!("redis DEBUG SLEEP {CLUSTER_STALL} on the master of shard {shard} (stall)")
            }
            Fault::ReshardBegin { shard, to, steps, secs } => format!(
                "reshard shard {shard}'s slot to the {} other master for {secs:.2}s: IMPORTING, MIGRATING, its keys in {steps} step(s), then the rest and the slot",
                ["first", "second"][*to]
            ),
            Fault::ReshardStep { shard, step, steps } => {
                format!("reshard of shard {shard}: step {step} of {steps}, keys migrated (its pool first)")
            }
            Fault::ReshardEnd { shard } => {
                format!("reshard of shard {shard} ends: the rest of its keys migrated, the slot given to the new master")
            }
            Fault::RedisRestart => "redis kill -9 and restart (AOF, appendfsync always)".into(),
            Fault::PgRestart { down } => {
                format!("postgresql immediate shutdown, down {down:.2}s, restart")
            }
            Fault::PgTerminate { rounds } => format!(
                "postgresql pg_terminate_backend storm: the workers' backends, {rounds} rounds"
            ),
            Fault::PgExhaust => {
                "postgresql out of connections: hold every slot (and cut the workers')".into()
            }
            Fault::PgRelease => "postgresql connections released".into(),
            Fault::PgReadOnly => "postgresql default_transaction_read_only = on".into(),
            Fault::PgWritable => "postgresql writable again".into(),
            Fault::ShopLock { table, at, secs } => {
                format!("a shop transaction locks a row of {table} (at {:.0} %) for {secs:.2}s", at * 100.0)
            }
            Fault::RenameColumn => "ALTER TABLE orders RENAME cancel_reason (a deploy)".into(),
            Fault::RestoreColumn => "ALTER TABLE orders: cancel_reason back".into(),
            Fault::WrongType(k, i) => format!("SET {} to a string (wrong type)", key(k, i)),
            Fault::Restore(k, i) => format!("restore {} (DEL the string, put back what it held)", key(k, i)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Kill9,
    Kill9Forever,
    Term,
    DoubleTerm,
    ClientKill,
    DebugSleep,
    RedisRestart,
    PgRestart,
    PgTerminate,
    PgExhaust,
    PgReadOnly,
    ShopLock,
    Column,
    WrongDead,
    WrongData,
}

struct Plan {
    seed: u64,
    secs: f64,
    /// Fault kinds (and `float-ts`) taken out of the drawn plan (`DW_CHAOS_SKIP`).
    skip: Vec<String>,
    setup: Setup,
    /// Sorted by push time (stable: a key's first push comes before its later ones).
    msgs: Vec<MsgPlan>,
    /// (seconds after the start, order); negative: paid before the start.
    pays: Vec<(f64, usize)>,
    /// Sorted by time.
    faults: Vec<(f64, Fault)>,
}

fn r2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// What `DW_CHAOS_SKIP` may name: the fault kinds, float `ts` (all integer), the flaky
/// handler, re-pushes of a key after its due time, the workers' shifted clocks.
const SKIPPABLE: [&str; 20] = [
    "clock",
    "pg-read-only",
    "shop-lock",
    "column",
    "kill9",
    "kill9-forever",
    "term",
    "double-term",
    "client-kill",
    "debug-sleep",
    "redis-restart",
    "pg-restart",
    "pg-terminate",
    "pg-exhaust",
    "wrong-dead",
    "wrong-data",
    "reshard",
    "float-ts",
    "flaky",
    "repush",
];

impl Fault {
    fn kind(&self) -> &'static str {
        match self {
            Fault::Kill9 {
                restart_after: None,
                ..
            } => "kill9-forever",
            Fault::Kill9 { .. } => "kill9",
            Fault::Term { .. } => "term",
            Fault::DoubleTerm { .. } => "double-term",
            Fault::ClientKill => "client-kill",
            Fault::DebugSleep | Fault::StallMaster { .. } => "debug-sleep",
            Fault::RedisRestart => "redis-restart",
            Fault::PgRestart { .. } => "pg-restart",
            Fault::PgTerminate { .. } => "pg-terminate",
            Fault::PgExhaust | Fault::PgRelease => "pg-exhaust",
            Fault::PgReadOnly | Fault::PgWritable => "pg-read-only",
            Fault::ShopLock { .. } => "shop-lock",
            Fault::RenameColumn | Fault::RestoreColumn => "column",
            Fault::WrongType(WrongKey::Dead, _) | Fault::Restore(WrongKey::Dead, _) => "wrong-dead",
            Fault::WrongType(WrongKey::Data, _) | Fault::Restore(WrongKey::Data, _) => "wrong-data",
            Fault::ReshardBegin { .. } | Fault::ReshardStep { .. } | Fault::ReshardEnd { .. } => {
                "reshard"
            }
        }
    }
}

fn skip_list() -> Vec<String> {
    let list: Vec<String> = std::env::var("DW_CHAOS_SKIP")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    for k in &list {
        assert!(
            SKIPPABLE.contains(&k.as_str()),
            "DW_CHAOS_SKIP: {k:?} is not one of {}",
            SKIPPABLE.join(",")
        );
    }
    list
}

impl Plan {
    /// The plan of `seed`, less what `skip` names: everything else stays as drawn, so a
    /// failing seed can be replayed with one fault kind at a time taken out.
    fn draw(seed: u64, secs: f64, skip: &[String]) -> Plan {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut setup = Setup::draw(&mut rng, secs);
        if Setup::draws_cluster(seed) {
            setup.on_cluster();
        }
        let drawn = draw_faults(&mut rng, &setup, secs);
        let (mut msgs, pays) = draw_inputs(&mut rng, &setup, secs, &drawn);
        let skipped = |k: &str| skip.iter().any(|s| s == k);
        setup.flaky &= !skipped("flaky");
        if !skipped("clock") {
            setup.draw_clocks(seed);
        }
        if skipped("repush") {
            msgs.retain(|m| m.again != Some(Again::Repush));
        }
        let mut faults = Vec::new();
        let mut index = HashMap::new();
        for (i, (t, f)) in drawn.iter().enumerate() {
            if !skip.iter().any(|k| k == f.kind()) {
                index.insert(i, faults.len());
                faults.push((*t, f.clone()));
            }
        }
        for m in &mut msgs {
            if let Some(i) = m.trigger {
                match index.get(&i) {
                    Some(&j) => m.trigger = Some(j),
                    // Its fault is skipped: pushed by the producer at the fault's time.
                    None => {
                        m.trigger = None;
                        m.due_at = r2(m.push_at + m.due_at);
                    }
                }
            }
            if skipped("float-ts") {
                m.float_ts = None;
            }
        }
        Plan {
            seed,
            secs,
            skip: skip.to_vec(),
            setup,
            msgs,
            pays,
            faults,
        }
    }

    fn replay(&self) -> String {
        let (env, flag) = if self.skip.is_empty() {
            (String::new(), String::new())
        } else {
            let s = self.skip.join(",");
            (format!("DW_CHAOS_SKIP={s} "), format!(" --skip {s}"))
        };
        format!(
            "{env}DW_CHAOS_SEED={} DW_CHAOS_SECONDS={} cargo test --test it chaos::chaos_seeded -- --ignored --exact --nocapture   (or: scripts/chaos.sh --seed {} --seconds {} --minutes 0{flag})",
            self.seed, self.secs, self.seed, self.secs
        )
    }

    /// The seed, the configuration, the inputs in figures and one line per event.
    fn describe(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "chaos seed {} ({}s): {}",
            self.seed, self.secs, self.setup
        );
        if !self.skip.is_empty() {
            let _ = writeln!(s, "  skipping (DW_CHAOS_SKIP): {}", self.skip.join(","));
        }
        let _ = writeln!(s, "  replay: {}", self.replay());
        let count = |f: &dyn Fn(&MsgPlan) -> bool| self.msgs.iter().filter(|m| f(m)).count();
        let good = count(&|m| m.class == Class::Good && m.again.is_none());
        let _ = writeln!(
            s,
            "  inputs: {good} timeouts through the pool ({} second scores, {} float ts, {} reschedules, {} re-pushes after due), {} far-future, {} legacy ({} far), {} LPUSHed onto {HIGH}, {} hostile; {} orders paid before the start, {} during the run",
            count(&|m| m.class == Class::Good && m.secs_score),
            count(&|m| m.class == Class::Good && m.float_ts.is_some()),
            count(&|m| m.again == Some(Again::Reschedule)),
            count(&|m| m.again == Some(Again::Repush)),
            count(&|m| m.class == Class::Far),
            count(&|m| matches!(m.class, Class::Legacy { .. })),
            count(&|m| m.class == Class::Legacy { far: true }),
            count(&|m| m.class == Class::Direct),
            count(&|m| matches!(m.class, Class::Hostile(_))),
            self.pays.iter().filter(|p| p.0 < 0.0).count(),
            self.pays.iter().filter(|p| p.0 >= 0.0).count(),
        );
        let mut events: Vec<(f64, String)> = self
            .faults
            .iter()
            .map(|(t, f)| (*t, f.describe(&self.setup)))
            .collect();
        for m in &self.msgs {
            if let Class::Hostile(h) = m.class {
                let line = match m.trigger {
                    None => format!(
                        "push hostile #{} ({}), due +{:.2}s",
                        m.id,
                        h.name(),
                        m.due_at
                    ),
                    Some(_) => format!(
                        "  with it: hostile #{} ({}), due {:.2}s later",
                        m.id,
                        h.name(),
                        m.due_at
                    ),
                };
                events.push((m.push_at, line));
            }
        }
        for (i, (t, f)) in self.faults.iter().enumerate() {
            let burst = self
                .msgs
                .iter()
                .filter(|m| m.trigger == Some(i) && !matches!(m.class, Class::Hostile(_)))
                .count();
            if burst > 0 && matches!(f, Fault::WrongType(..)) {
                events.push((*t, format!("  with it: {burst} timeouts due at once, the key broken once they are moved")));
            }
        }
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (t, e) in events {
            let _ = writeln!(s, "  +{t:6.2}s  {e}");
        }
        s
    }
}

/// Places a window (wrong-type key, connections held) at or after `t`, after the previous
/// window of its kind; `None` when it no longer fits before `end`.
fn window(busy: &mut f64, t: f64, hold: f64, end: f64) -> Option<(f64, f64)> {
    let start = r2(t.max(*busy + 0.3));
    let hold = hold.min(end - start);
    if hold < 0.8 {
        return None;
    }
    *busy = r2(start + hold);
    Some((start, *busy))
}

fn draw_faults(rng: &mut fastrand::Rng, setup: &Setup, secs: f64) -> Vec<(f64, Fault)> {
    let workers = setup.threads.len();
    let count = ((secs / 1.5).round() as usize).max(6);
    let mut times: Vec<f64> = (0..count)
        .map(|_| r2(secs * (0.06 + 0.66 * rng.f64())))
        .collect();
    times.sort_by(f64::total_cmp);
    let end = secs * 0.88;
    let mut bag: Vec<Kind> = Vec::new();
    let mut forever: Vec<usize> = Vec::new();
    let (mut wrong_busy, mut pg_busy, mut column_busy) = (0.0, 0.0, 0.0);
    let mut out = Vec::new();
    // Cluster mode: the reshards first, one at a time (one more per 40 s of schedule),
    // each of a shard drawn, lasting 2 to 6 s: (start, end, shard).
    let mut reshards: Vec<(f64, f64, usize)> = Vec::new();
    if setup.cluster {
        let mut busy = 0.0;
        for _ in 0..1 + (secs / 40.0) as usize {
            let t = r2(secs * (0.08 + 0.5 * rng.f64()));
            let hold = 2.0 + 4.0 * rng.f64();
            let (shard, to, steps) = (
                rng.usize(..CLUSTER_SHARDS),
                rng.usize(..2),
                rng.usize(1..=3),
            );
            if let Some((a, b)) = window(&mut busy, t, hold, end) {
                out.push((
                    a,
                    Fault::ReshardBegin {
                        shard,
                        to,
                        steps,
                        secs: r2(b - a),
                    },
                ));
                for step in 1..=steps {
                    let at = r2(a + (b - a) * step as f64 / (steps + 1) as f64);
                    out.push((at, Fault::ReshardStep { shard, step, steps }));
                }
                out.push((b, Fault::ReshardEnd { shard }));
                reshards.push((a, b, shard));
            }
        }
    }
    // A stall of Redis: the one server, or the master of a shard drawn.
    let stall = |rng: &mut fastrand::Rng| match setup.cluster {
        false => Fault::DebugSleep,
        true => Fault::StallMaster {
            shard: rng.usize(..CLUSTER_SHARDS),
        },
    };
    for t in times {
        if bag.is_empty() {
            bag = vec![
                Kind::Kill9,
                Kind::Term,
                Kind::DoubleTerm,
                Kind::ClientKill,
                Kind::DebugSleep,
                Kind::RedisRestart,
                Kind::PgRestart,
                Kind::PgTerminate,
                Kind::PgExhaust,
                Kind::PgReadOnly,
                Kind::ShopLock,
                Kind::Column,
                Kind::WrongDead,
                Kind::WrongData,
            ];
            if workers > 1 && forever.len() + 1 < workers {
                bag.push(Kind::Kill9Forever);
            }
            if setup.cluster {
                // Restarting the one server from its AOF: not a Cluster's fault.
                bag.retain(|k| *k != Kind::RedisRestart);
            }
            rng.shuffle(&mut bag);
        }
        let kind = bag.pop().unwrap();
        let live: Vec<usize> = (0..workers).filter(|s| !forever.contains(s)).collect();
        let slot = live[rng.usize(..live.len())];
        let restart_after = r2(0.2 + 1.8 * rng.f64());
        match kind {
            Kind::Kill9 => out.push((
                t,
                Fault::Kill9 {
                    slot,
                    restart_after: Some(restart_after),
                },
            )),
            Kind::Kill9Forever => {
                let restart_after = if live.len() >= 2 {
                    forever.push(slot);
                    None
                } else {
                    Some(restart_after)
                };
                out.push((
                    t,
                    Fault::Kill9 {
                        slot,
                        restart_after,
                    },
                ))
            }
            Kind::Term => out.push((
                t,
                Fault::Term {
                    slot,
                    restart_after,
                },
            )),
            Kind::DoubleTerm => out.push((
                t,
                Fault::DoubleTerm {
                    slot,
                    gap: r2(0.02 + 0.28 * rng.f64()),
                    restart_after,
                },
            )),
            Kind::ClientKill => out.push((t, Fault::ClientKill)),
            Kind::DebugSleep => out.push((t, stall(rng))),
            Kind::RedisRestart => out.push((t, Fault::RedisRestart)),
            Kind::PgRestart => out.push((
                t,
                Fault::PgRestart {
                    down: r2(0.3 + 1.5 * rng.f64()),
                },
            )),
            Kind::PgTerminate => out.push((
                t,
                Fault::PgTerminate {
                    rounds: rng.usize(3..=10),
                },
            )),
            Kind::PgExhaust => match window(&mut pg_busy, t, 1.0 + 1.5 * rng.f64(), end) {
                Some((a, b)) => {
                    out.push((a, Fault::PgExhaust));
                    out.push((b, Fault::PgRelease));
                }
                None => out.push((t, Fault::ClientKill)),
            },
            Kind::PgReadOnly => match window(&mut pg_busy, t, 1.0 + 1.5 * rng.f64(), end) {
                Some((a, b)) => {
                    out.push((a, Fault::PgReadOnly));
                    out.push((b, Fault::PgWritable));
                }
                None => out.push((t, Fault::ClientKill)),
            },
            Kind::ShopLock => out.push((
                t,
                Fault::ShopLock {
                    table: if rng.bool() { "orders" } else { "sku" },
                    at: r2(rng.f64()),
                    secs: r2(0.5 + 2.0 * rng.f64()),
                },
            )),
            Kind::Column => match window(&mut column_busy, t, 1.0 + 1.5 * rng.f64(), end) {
                Some((a, b)) => {
                    out.push((a, Fault::RenameColumn));
                    out.push((b, Fault::RestoreColumn));
                }
                None => out.push((t, stall(rng))),
            },
            Kind::WrongDead | Kind::WrongData => {
                let k = if kind == Kind::WrongDead {
                    WrongKey::Dead
                } else {
                    WrongKey::Data
                };
                match window(&mut wrong_busy, t, 1.5 + 2.0 * rng.f64(), end) {
                    Some((a, b)) => {
                        // On a Cluster, a shard whose slot is not moving meanwhile (a key
                        // is restored where it is).
                        let shard = match setup.cluster {
                            false => Some(0),
                            true => {
                                let free: Vec<usize> = (0..CLUSTER_SHARDS)
                                    .filter(|&i| {
                                        !reshards.iter().any(|&(ra, rb, ri)| {
                                            ri == i && ra < b + 0.5 && a < rb + 0.5
                                        })
                                    })
                                    .collect();
                                (!free.is_empty()).then(|| free[rng.usize(..free.len())])
                            }
                        };
                        match shard {
                            Some(i) => {
                                out.push((a, Fault::WrongType(k, i)));
                                out.push((b, Fault::Restore(k, i)));
                            }
                            None => out.push((t, stall(rng))),
                        }
                    }
                    None => out.push((t, stall(rng))),
                }
            }
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

fn draw_inputs(
    rng: &mut fastrand::Rng,
    setup: &Setup,
    secs: f64,
    faults: &[(f64, Fault)],
) -> (Vec<MsgPlan>, Vec<(f64, usize)>) {
    let n = setup.orders;
    let mut idx: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut idx);
    let take = |idx: &mut Vec<usize>, k: usize| idx.split_off(idx.len() - k);
    let untouched = take(&mut idx, (n * 3 / 100).max(30));
    let far = take(&mut idx, n * 2 / 100);
    let legacy = take(&mut idx, if setup.legacy { n * 15 / 100 } else { 0 });
    let direct = take(&mut idx, if setup.two_queues { n * 5 / 100 } else { 0 });
    let good = idx;
    let (last_push, last_due) = (secs * 0.72, secs * 0.85);
    let when = |rng: &mut fastrand::Rng| {
        let push = if rng.u32(..100) < 20 {
            0.0
        } else {
            r2(last_push * rng.f64())
        };
        let delay = if rng.u32(..10) == 0 {
            0.0
        } else {
            secs * 0.25 * rng.f64()
        };
        (push, r2((push + delay).min(last_due)))
    };
    let plain = |class: Class, order: usize, push_at: f64, due_at: f64| MsgPlan {
        class,
        order,
        php_key: None,
        id: 0,
        push_at,
        due_at,
        secs_score: false,
        float_ts: None,
        by_id: false,
        again: None,
        trigger: None,
    };
    let styled = |rng: &mut fastrand::Rng, class, order, push_at, due_at| MsgPlan {
        php_key: (rng.u32(..100) < 30).then(|| rng.u64(..) & 0xffff_ffff_ffff),
        secs_score: rng.u32(..100) < 40,
        float_ts: (rng.u32(..100) < 25).then(|| rng.u8(1..=3)),
        by_id: rng.u32(..100) < 20,
        ..plain(class, order, push_at, due_at)
    };
    // (fault index, start, end, key, shard) of each wrong-type window.
    let windows: Vec<(usize, f64, f64, WrongKey, usize)> = faults
        .iter()
        .enumerate()
        .filter_map(|(i, (t, f))| match f {
            Fault::WrongType(k, shard) => {
                let end = faults
                    .iter()
                    .find(|(u, g)| *u >= *t && matches!(g, Fault::Restore(j, _) if j == k))
                    .map(|(u, _)| *u)
                    .unwrap_or(*t + 1.0);
                Some((i, *t, end, *k, *shard))
            }
            _ => None,
        })
        .collect();
    let mut msgs = Vec::new();
    let mut good = good.into_iter();
    // A burst the driver pushes, due at once, as it breaks the data key: jobs in flight
    // while it is broken (with the flaky handler their retries go back to the data hash).
    let burst = (n / 20).clamp(50, 200);
    for &(fi, ws, _, k, shard) in &windows {
        if k != WrongKey::Data {
            continue;
        }
        for o in good.by_ref().take(burst) {
            let mut m = MsgPlan {
                trigger: Some(fi),
                ..styled(rng, Class::Good, o, ws, 0.0)
            };
            if setup.cluster {
                // In the shard whose key breaks (a PHP-style key made so): the driver
                // never pushes into a shard whose slot is moving.
                let mut h = m.php_key.unwrap_or(0);
                while delay_worker::keys::shard_of(php_key(o, h).as_bytes(), CLUSTER_SHARDS)
                    != shard
                {
                    h = (h + 1) & 0xffff_ffff_ffff;
                }
                m.php_key = Some(h);
            }
            msgs.push(m);
        }
    }
    for o in good {
        let (push_at, due_at) = when(rng);
        let m = styled(rng, Class::Good, o, push_at, due_at);
        let r = rng.u32(..100);
        if r < 5 && due_at - push_at >= 1.5 {
            let push2 = r2(push_at + (due_at - push_at) * (0.2 + 0.5 * rng.f64()));
            let due2 = r2((push2 + secs * 0.2 * rng.f64()).clamp(push2, last_due));
            msgs.push(MsgPlan {
                push_at: push2,
                due_at: due2,
                secs_score: rng.bool(),
                again: Some(Again::Reschedule),
                ..m.clone()
            });
        } else if r < 10 && due_at + 1.2 <= last_push {
            let push2 = r2(due_at + 1.2 + (last_push - due_at - 1.2) * rng.f64());
            let due2 = r2((push2 + rng.f64()).min(last_due).max(push2));
            msgs.push(MsgPlan {
                push_at: push2,
                due_at: due2,
                again: Some(Again::Repush),
                ..m.clone()
            });
        }
        msgs.push(m);
    }
    for o in far {
        let push_at = r2(last_push * rng.f64());
        msgs.push(styled(rng, Class::Far, o, push_at, FAR_SECS as f64));
    }
    for o in legacy {
        let far = rng.u32(..100) < 5;
        let (push_at, due_at) = when(rng);
        let due_at = if far { FAR_SECS as f64 } else { due_at };
        msgs.push(plain(Class::Legacy { far }, o, push_at, due_at));
    }
    for o in direct {
        let push_at = r2(last_push * rng.f64());
        msgs.push(styled(rng, Class::Direct, o, push_at, push_at));
    }
    // Hostile messages, each naming an order nobody else touches: spread over the run, and
    // three the driver pushes as it breaks the dead letters' key, due inside the window:
    // (push, due, the window's fault and shard).
    type Hostiles = Vec<(f64, f64, Option<(usize, usize)>)>;
    let mut hostile_times: Hostiles = (0..((secs / 1.2) as usize).max(10))
        .map(|_| {
            let push = r2(last_push * rng.f64());
            (push, r2(push + 2.0 * rng.f64()), None)
        })
        .collect();
    for &(fi, ws, we, k, shard) in &windows {
        if k == WrongKey::Dead {
            for _ in 0..3 {
                let after = r2(0.15 + (we - ws - 0.8).max(0.1) * rng.f64());
                hostile_times.push((ws, after, Some((fi, shard))));
            }
        }
    }
    let first_kind = rng.usize(..HOSTILE.len());
    for (i, (push_at, due_at, trigger)) in hostile_times.into_iter().enumerate() {
        let kind = HOSTILE[(first_kind + i) % HOSTILE.len()];
        // On a Cluster one the driver pushes goes to the shard whose key breaks (never one
        // whose slot is moving): an id of its own that puts its key there.
        let id = match trigger {
            Some((_, shard)) if setup.cluster => (1_000_000_000 + 1000 * i..)
                .find(|&id| {
                    delay_worker::keys::shard_of(hostile_key(id).as_bytes(), CLUSTER_SHARDS)
                        == shard
                })
                .unwrap(),
            _ => i,
        };
        let trigger = trigger.map(|(fi, _)| fi);
        msgs.push(MsgPlan {
            id,
            // Milliseconds when pushed by the driver: due inside the window, not at a
            // whole second that may fall after it.
            secs_score: trigger.is_none() && rng.bool(),
            trigger,
            ..plain(
                Class::Hostile(kind),
                untouched[i % untouched.len()],
                push_at,
                due_at,
            )
        });
    }
    // Payments: before the start, or during the run (half of them close to the due time,
    // racing the timeout).
    let mut pays = Vec::new();
    for m in &msgs {
        if m.again.is_some() || matches!(m.class, Class::Hostile(_)) {
            continue;
        }
        let r = rng.u32(..100);
        if r < 15 {
            pays.push((-1.0, m.order));
        } else if r < 25 {
            let t = if rng.bool() && m.due_at < secs && m.trigger.is_none() {
                m.due_at + rng.f64() - 0.5
            } else {
                secs * 0.85 * rng.f64()
            };
            pays.push((r2(t.clamp(0.0, secs * 0.85)), m.order));
        }
    }
    for &o in &untouched {
        if rng.u32(..100) < 10 {
            pays.push((r2(secs * 0.85 * rng.f64()), o));
        }
    }
    msgs.sort_by(|a, b| a.push_at.total_cmp(&b.push_at));
    pays.sort_by(|a, b| a.0.total_cmp(&b.0));
    (msgs, pays)
}

// ---- running it -------------------------------------------------------------------------

/// What the run shares between the driver (faults), the producer and the payer threads.
struct Ctx<'a> {
    plan: &'a Plan,
    orders: &'a [SeedOrder],
    /// The key sets the workers serve: one, or each shard's (cluster mode).
    shards: Vec<Keys>,
    /// Cluster mode: the cluster (its masters, for the faults that aim at one).
    cluster: Option<&'a Cluster>,
    redis_url: String,
    db_url: String,
    start: Instant,
    start_ms: i64,
    /// Set when the driver unwinds, so the input threads stop at once.
    abort: AtomicBool,
    events: Mutex<Vec<(f64, String)>>,
}

impl Ctx<'_> {
    fn at(&self, t: f64) -> Instant {
        self.start + Duration::from_secs_f64(t.max(0.0))
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn note(&self, what: impl AsRef<str>) {
        self.note_at(self.now(), what);
    }

    fn note_at(&self, t: f64, what: impl AsRef<str>) {
        self.events
            .lock()
            .unwrap()
            .push((t, what.as_ref().to_string()));
    }

    fn events(&self) -> String {
        let mut ev = self.events.lock().unwrap().clone();
        ev.sort_by(|a, b| a.0.total_cmp(&b.0));
        ev.iter()
            .map(|(t, e)| format!("  +{t:6.2}s  {e}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn give_up(&self) -> bool {
        self.abort.load(Ordering::Relaxed) || self.now() > self.plan.secs + INPUT_GRACE
    }

    /// Sleeps until `t` after the start (the schedule's clock); `false` if aborted.
    fn wait_for(&self, t: f64) -> bool {
        let at = self.at(t);
        while Instant::now() < at {
            if self.abort.load(Ordering::Relaxed) {
                return false;
            }
            std::thread::sleep((at - Instant::now()).min(Duration::from_millis(50)));
        }
        true
    }

    fn order(&self, m: &MsgPlan) -> &SeedOrder {
        &self.orders[m.order]
    }

    /// The shard of a job key (0 on one server).
    fn shard_of(&self, key: &str) -> usize {
        delay_worker::keys::shard_of(key.as_bytes(), self.shards.len())
    }

    /// The key set a job key's push goes to.
    fn keys_for(&self, key: &str) -> &Keys {
        &self.shards[self.shard_of(key)]
    }

    /// The shard a message is pushed into: its key's, or shard 0's for a legacy member
    /// (its pool carries shard 0's tag).
    fn shard_of_msg(&self, m: &MsgPlan) -> usize {
        match (m.class, self.key_of(m)) {
            (Class::Legacy { .. }, _) | (_, None) => 0,
            (_, Some(k)) => self.shard_of(&k),
        }
    }

    /// The job key of a message (direct LPUSHes: from their bytes, see `direct_key`).
    fn key_of(&self, m: &MsgPlan) -> Option<String> {
        let o = self.order(m);
        Some(match m.class {
            Class::Good | Class::Far => match m.php_key {
                Some(h) => php_key(m.order, h),
                None => format!("order.timeout:{}", o.order_no),
            },
            Class::Legacy { .. } => self.plan.setup.legacy_key(o.id),
            Class::Hostile(_) => hostile_key(m.id),
            Class::Direct => return None,
        })
    }

    fn nonce(&self, id: usize) -> String {
        format!("chaosnonce-{:x}-{id}-end", self.plan.seed)
    }

    fn body_of(&self, m: &MsgPlan, ts: &str) -> Vec<u8> {
        let o = self.order(m);
        let no = &o.order_no;
        let env = |payload: String, extra: &str| {
            format!(r#"{{"event":"order.timeout","payload":{payload},"retry":0,"ts":{ts}{extra}}}"#)
        };
        let Class::Hostile(h) = m.class else {
            let payload = if m.by_id {
                format!(r#"{{"order_id":{}}}"#, o.id)
            } else {
                format!(r#"{{"order_no":"{no}"}}"#)
            };
            return env(payload, "").into_bytes();
        };
        let n = self.nonce(m.id);
        let tag = format!(r#","n":"{n}""#);
        match h {
            Hostile::NotJson => format!("not json {n} {{\"event\":\"order.timeout\"").into_bytes(),
            Hostile::NotUtf8 => {
                let mut b = format!(
                    r#"{{"event":"order.timeout","payload":{{"order_no":"{no}"}},"n":"{n}","x":""#
                )
                .into_bytes();
                b.extend_from_slice(&[0xc3, 0x28, 0xff]);
                b.extend_from_slice(br#""}"#);
                b
            }
            Hostile::UnknownEvent => format!(
                r#"{{"event":"order.explode","payload":{{"order_no":"{no}"}},"retry":0,"ts":{ts}{tag}}}"#
            )
            .into_bytes(),
            Hostile::NoOrder => env(format!(r#"{{"sku_id":1,"order":"{no}"}}"#), &tag).into_bytes(),
            Hostile::PayloadNotObject => env(format!(r#""{no}""#), &tag).into_bytes(),
            Hostile::TooLarge => env(
                format!(
                    r#"{{"order_no":"{no}","pad":"{}"}}"#,
                    "x".repeat(MAX_MESSAGE_BYTES + 1000)
                ),
                &tag,
            )
            .into_bytes(),
            Hostile::DeepNesting => env(
                format!(
                    r#"{{"order_no":"{no}","deep":{}1{}}}"#,
                    "[".repeat(600),
                    "]".repeat(600)
                ),
                &tag,
            )
            .into_bytes(),
        }
    }
}

/// A PHP producer's random job key (`<secs>:<12 hex>`) for an order.
fn php_key(order: usize, h: u64) -> String {
    format!("{}:{h:012x}", 1_768_764_300 + order)
}

fn hostile_key(id: usize) -> String {
    format!("chaos:hostile:{id}")
}

fn direct_key(body: &[u8]) -> String {
    format!("{HIGH}:sha1:{}", sha1_smol::Sha1::from(body).digest())
}

/// A Redis connection with timeouts, so no call of the test can hang: to the one server,
/// or to the cluster (each command routed by its key, as the worker's own connections).
fn rcon(url: &str) -> redis::RedisResult<Con> {
    let redis = delay_worker::store::Redis::open(url, None)
        .map_err(|e| redis::RedisError::from((redis::ErrorKind::Client, "url", e.0)))?;
    redis.connect_within(Duration::from_secs(2), Duration::from_secs(10))
}

/// A plain connection to the server on `port` (a master of the cluster), with timeouts.
fn node_con(port: u16) -> redis::RedisResult<redis::Connection> {
    let c = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(2))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    c.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(c)
}

/// Whether a failed command may have run (its reply was lost with the connection). A reply
/// from the server (WRONGTYPE, LOADING, ...) or a refused connection means it did not.
fn maybe_ran(e: &redis::RedisError) -> bool {
    e.code().is_none() && !e.is_connection_refusal()
}

fn pg_connect(url: &str) -> Result<postgres::Client, postgres::Error> {
    let mut cfg: postgres::Config = url.parse()?;
    cfg.connect_timeout(Duration::from_secs(3))
        .options("-c statement_timeout=10000")
        .application_name("chaos-test");
    cfg.connect(NoTls)
}

/// An operator's mistake: the key holds a string for a while. What it held is renamed
/// aside (the test itself destroys nothing) and comes back with `RESTORE`. Idempotent.
static BREAK: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' and redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('RENAME', KEYS[1], KEYS[2]) end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1",
    )
});

static RESTORE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"
if redis.call('TYPE', KEYS[1])['ok'] == 'string' then redis.call('DEL', KEYS[1]) end
if redis.call('EXISTS', KEYS[2]) == 1 then
  if redis.call('EXISTS', KEYS[1]) == 1 then return redis.error_reply('key and stash both exist') end
  redis.call('RENAME', KEYS[2], KEYS[1])
end
return 1",
    )
});

/// One push as it happened.
#[derive(Clone, Debug)]
struct PushRec {
    msg: usize,
    key: String,
    body: Vec<u8>,
    /// The push script said the key was already scheduled (a reschedule: the earlier
    /// message is replaced).
    existed: bool,
    /// A reply was lost and the push sent again: the first may have landed too.
    uncertain: bool,
    /// Refusals by the server (WRONGTYPE while the data key was broken, LOADING, TRYAGAIN
    /// while its shard's slot moved, ...).
    refused: u32,
    at: f64,
    /// When the push that landed was sent, and when its message is due (unix ms).
    sent_ms: i64,
    due_ms: i64,
}

#[derive(Default)]
struct Inputs {
    recs: Vec<PushRec>,
    problems: Vec<String>,
}

/// The producer of one shard (of the one key set on one server): pushes each of its
/// messages at its time, the way PHP would, retrying through outages until it lands, so a
/// shard whose slot moves holds back only its own pushes. (Messages of a fault are the
/// driver's.)
fn run_inputs(ctx: &Ctx, shard: usize) -> Inputs {
    let mut p = Producer::default();
    for (i, m) in ctx.plan.msgs.iter().enumerate() {
        if m.trigger.is_some() || ctx.shard_of_msg(m) != shard {
            continue;
        }
        if !ctx.wait_for(m.push_at) {
            break;
        }
        let due_ms = match m.class {
            Class::Far | Class::Legacy { far: true } => ctx.start_ms + FAR_SECS * 1000,
            _ => ctx.start_ms + (m.due_at * 1000.0) as i64,
        };
        p.push(ctx, i, due_ms);
    }
    p.out
}

#[derive(Default)]
struct Producer {
    con: Option<Con>,
    /// The last `ts` (whole seconds) of each key.
    last_ts: HashMap<String, i64>,
    out: Inputs,
}

impl Producer {
    /// Pushes message `i` due at `due_ms`, retrying until it lands (or the run gives up).
    fn push(&mut self, ctx: &Ctx, i: usize, due_ms: i64) {
        let m = &ctx.plan.msgs[i];
        let now_s = delay_worker::now_ms() / 1000;
        let key0 = ctx.key_of(m);
        // A later push of a key is a new message: a later `ts`, in whole seconds too.
        let ts_s = match key0.as_ref().and_then(|k| self.last_ts.get(k)) {
            Some(&prev) => now_s.max(prev + 1),
            None => now_s,
        };
        let ts = match m.float_ts {
            Some(q) => format!("{ts_s}.{}", ["", "25", "5", "75"][q as usize]),
            None => ts_s.to_string(),
        };
        let body = ctx.body_of(m, &ts);
        let key = key0.unwrap_or_else(|| direct_key(&body));
        self.last_ts.insert(key.clone(), ts_s);
        let score = if m.secs_score {
            (due_ms + 999).div_euclid(1000)
        } else {
            due_ms
        };
        let (mut uncertain, mut refused, mut sent_ms) = (false, 0, 0);
        let existed = loop {
            if ctx.give_up() {
                break None;
            }
            sent_ms = delay_worker::now_ms();
            let c = match self.con.as_mut() {
                Some(c) => c,
                None => match rcon(&ctx.redis_url) {
                    Ok(c) => self.con.insert(c),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                },
            };
            // Err(true): the push may have run (a reply lost); Err(false): it did not.
            let r: Result<bool, bool> = match m.class {
                Class::Legacy { .. } => redis::pipe()
                    .atomic()
                    .cmd("SET")
                    .arg(&key)
                    .arg(ctx.order(m).id)
                    .ignore()
                    .cmd("ZADD")
                    .arg(ctx.plan.setup.legacy_pool())
                    .arg(score)
                    .arg(&key)
                    .query::<(i64,)>(c)
                    .map(|(added,)| added == 0)
                    .map_err(|e| maybe_ran(&e)),
                Class::Direct => redis::cmd("LPUSH")
                    .arg(HIGH)
                    .arg(&body)
                    .query::<i64>(c)
                    .map(|_| false)
                    .map_err(|e| maybe_ran(&e)),
                // The store's push: a key of the wrong type is refused, nothing written.
                _ => delay_worker::store::push(c, ctx.keys_for(&key), &key, &body, score).map_err(
                    |e| {
                        use delay_worker::store::StoreError;
                        match e {
                            StoreError::Connection { source, .. }
                            | StoreError::Moving { source, .. }
                            | StoreError::Refused { source, .. } => maybe_ran(&source),
                            StoreError::WrongType { .. } => false,
                        }
                    },
                ),
            };
            match r {
                Ok(existed) => break Some(existed),
                Err(maybe) => {
                    if maybe {
                        uncertain = true;
                    } else {
                        refused += 1;
                    }
                    self.con = None;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        match existed {
            Some(existed) => self.out.recs.push(PushRec {
                msg: i,
                key,
                body,
                existed,
                uncertain,
                refused,
                at: ctx.now(),
                sent_ms,
                due_ms,
            }),
            None if ctx.abort.load(Ordering::Relaxed) => {}
            None => self.out.problems.push(format!(
                "the producer gave up pushing {key} (uncertain: {uncertain}, refused {refused} times)"
            )),
        }
    }
}

/// The shop's payments: `pending` → `paid`, racing the timeouts. Returns the orders whose
/// payment won (only this thread pays and only the worker cancels, so a lost reply is
/// settled by reading the status).
fn run_pays(ctx: &Ctx, pays: &[(f64, usize)], problems: &mut Vec<String>) -> Vec<usize> {
    let mut paid = Vec::new();
    let mut client: Option<postgres::Client> = None;
    for &(t, o) in pays {
        if !ctx.wait_for(t) {
            return paid;
        }
        let id = ctx.orders[o].id;
        let mut check = false;
        let won = loop {
            if ctx.give_up() {
                break None;
            }
            let c = match client.as_mut() {
                Some(c) => c,
                None => match pg_connect(&ctx.db_url) {
                    Ok(c) => client.insert(c),
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                },
            };
            if check {
                match c.query_one("SELECT status FROM orders WHERE id = $1", &[&id]) {
                    Ok(row) => match row.get::<_, String>(0).as_str() {
                        "paid" => break Some(true),
                        "pending" => {}
                        _ => break Some(false),
                    },
                    Err(_) => {
                        client = None;
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                }
            }
            match c.execute(
                "UPDATE orders SET status = 'paid', paid_at = now() WHERE id = $1 AND status = 'pending'",
                &[&id],
            ) {
                Ok(n) => break Some(n == 1),
                Err(_) => {
                    client = None;
                    check = true;
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        match won {
            Some(true) => paid.push(o),
            Some(false) => {}
            None if ctx.abort.load(Ordering::Relaxed) => return paid,
            None => problems.push(format!("the payer gave up paying order {id}")),
        }
    }
    paid
}

// ---- the worker processes, supervised as systemd would ----------------------------------

enum State {
    Running(Child),
    Stopping {
        child: Child,
        since: Instant,
        expect: &'static [i32],
        restart_after: Option<f64>,
    },
    /// `None`: killed for good, or stopped at the end.
    Down {
        restart_at: Option<Instant>,
    },
}

struct Slot {
    name: String,
    threads: usize,
    state: State,
    log: PathBuf,
    /// Where this incarnation's output starts in the log.
    offset: u64,
    starts: usize,
    spawned: Instant,
    /// How long after its start this incarnation got its SIGTERM, and whether it had
    /// passed its start checks then.
    signalled_after: Duration,
    ready_when_signalled: bool,
    forever: bool,
}

struct Workers<'a> {
    ctx: &'a Ctx<'a>,
    slots: Vec<Slot>,
    args: Vec<String>,
    /// Exits nobody asked for, codes nobody expected, hangs: failures.
    anomalies: Vec<String>,
    /// Starts refused with exit 1 and one line (a server unreachable at start): systemd
    /// restarts those, and so do we.
    refused: Vec<String>,
    /// The workers started under libfaketime, whose leftovers go at the end.
    faked: Vec<u32>,
}

impl<'a> Workers<'a> {
    fn new(ctx: &'a Ctx<'a>, dir: &Path, args: Vec<String>) -> Workers<'a> {
        let slots = ctx
            .plan
            .setup
            .threads
            .iter()
            .enumerate()
            .map(|(i, &threads)| Slot {
                name: format!("w{i}"),
                threads,
                state: State::Down { restart_at: None },
                log: dir.join(format!("w{i}.log")),
                offset: 0,
                starts: 0,
                spawned: Instant::now(),
                signalled_after: Duration::ZERO,
                ready_when_signalled: false,
                forever: false,
            })
            .collect();
        Workers {
            ctx,
            slots,
            args,
            anomalies: Vec::new(),
            refused: Vec::new(),
            faked: Vec::new(),
        }
    }

    fn spawn(&mut self, i: usize) -> State {
        let slot = &mut self.slots[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&slot.log)
            .expect("open the worker log");
        slot.offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
        match self.ctx.plan.setup.clocks.get(i) {
            Some(&c) if c != 0 => {
                cmd.env("LD_PRELOAD", FAKETIME)
                    .env("FAKETIME", format!("{c:+}s"))
                    .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
            }
            _ => {}
        }
        let child = cmd
            .env("REDIS_URL", &self.ctx.redis_url)
            .env("DATABASE_URL", &self.ctx.db_url)
            // The daemon's "starting:" line (info) says its start checks are over.
            .env(
                "RUST_LOG",
                format!(
                    "{},delay_worker::daemon=info",
                    std::env::var("DW_CHILD_LOG").unwrap_or_else(|_| "warn".into())
                ),
            )
            .env("RUST_BACKTRACE", "1")
            .env_remove("JOURNAL_STREAM")
            .args(["--consumer", &slot.name])
            .args(["--threads", &slot.threads.to_string()])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup the log file"))
            .stderr(log)
            .spawn()
            .expect("start the worker binary");
        if cmd.get_envs().any(|(k, _)| k == "LD_PRELOAD") {
            self.faked.push(child.id());
        }
        slot.starts += 1;
        slot.spawned = Instant::now();
        self.ctx
            .note(format!("{} started (pid {})", slot.name, child.id()));
        State::Running(child)
    }

    fn start_all(&mut self) {
        for i in 0..self.slots.len() {
            self.slots[i].state = self.spawn(i);
        }
    }

    /// This incarnation's output.
    fn output(&self, i: usize) -> String {
        let slot = &self.slots[i];
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&slot.log) {
            let _ = f.seek(SeekFrom::Start(slot.offset));
            let mut b = Vec::new();
            let _ = f.read_to_end(&mut b);
            s = String::from_utf8_lossy(&b).into_owned();
        }
        s
    }

    fn tail(text: &str, n: usize) -> String {
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n      ")
    }

    /// Whether this incarnation has passed its start checks (the daemon logs "starting:").
    fn ready(&self, i: usize) -> bool {
        self.output(i).contains("starting: ")
    }

    fn signalled(&mut self, i: usize) {
        self.slots[i].signalled_after = self.slots[i].spawned.elapsed();
        self.slots[i].ready_when_signalled = self.ready(i);
    }

    fn exited(&mut self, i: usize, status: ExitStatus, expected: Option<&[i32]>) {
        let name = self.slots[i].name.clone();
        let out = self.output(i);
        let ready = out.contains("starting: ");
        let line = out
            .lines()
            .rev()
            .find(|l| l.starts_with("worker: "))
            .unwrap_or("(no error line)")
            .to_string();
        let refusal = status.code() == Some(1) && !ready && !out.contains("panicked");
        match expected {
            Some(codes) if status.code().is_some_and(|c| codes.contains(&c)) => {
                self.ctx.note(format!("{name} exited: {status}"));
            }
            // A SIGTERM within moments of the start can come before the signal handler is
            // installed (the driver runs late and fires several events at once): the
            // default action, as for any process. Not the daemon's drain.
            Some(_)
                if std::os::unix::process::ExitStatusExt::signal(&status)
                    == Some(libc::SIGTERM)
                    && (!self.slots[i].ready_when_signalled
                        || self.slots[i].signalled_after < Duration::from_secs(1)) =>
            {
                self.ctx.note(format!(
                    "{name} died of the SIGTERM sent {:.0}ms after its start, before it could install its handler",
                    self.slots[i].signalled_after.as_secs_f64() * 1000.0
                ));
            }
            // Stopped during its start checks: they fail with exit 1 and one line (a signal
            // interrupting a blocked call reads "Interrupted system call"). Counted, not a
            // failure: the daemon had not started.
            Some(_) if refusal && !self.slots[i].ready_when_signalled => {
                self.ctx
                    .note(format!("{name} got its SIGTERM during its start checks: {line}"));
                self.refused.push(format!(
                    "+{:.2}s {name} (SIGTERM during the start checks): {line}",
                    self.ctx.now()
                ));
            }
            Some(codes) => self.anomalies.push(format!(
                "{name} exited with {status} after a signal (expected {codes:?}) at +{:.2}s; its last lines:\n      {}",
                self.ctx.now(),
                Self::tail(&out, 8)
            )),
            None if refusal => {
                // The daemon refuses to start when a server is unreachable (exit 1, one
                // line); systemd restarts it, and so does this.
                self.ctx.note(format!("{name} refused to start: {line}"));
                self.refused.push(format!("+{:.2}s {name}: {line}", self.ctx.now()));
            }
            None => self.anomalies.push(format!(
                "{name} exited on its own with {status} at +{:.2}s; its last lines:\n      {}",
                self.ctx.now(),
                Self::tail(&out, 12)
            )),
        }
    }

    /// Reaps exits, checks codes, restarts what is due for a restart.
    fn supervise(&mut self) {
        for i in 0..self.slots.len() {
            let state =
                std::mem::replace(&mut self.slots[i].state, State::Down { restart_at: None });
            let next = match state {
                State::Running(mut child) => match child.try_wait() {
                    Ok(Some(status)) => {
                        self.exited(i, status, None);
                        State::Down {
                            restart_at: Some(Instant::now() + Duration::from_millis(300)),
                        }
                    }
                    _ => State::Running(child),
                },
                State::Stopping {
                    mut child,
                    since,
                    expect,
                    restart_after,
                } => match child.try_wait() {
                    Ok(Some(status)) => {
                        self.exited(i, status, Some(expect));
                        State::Down {
                            restart_at: restart_after
                                .map(|s| Instant::now() + Duration::from_secs_f64(s)),
                        }
                    }
                    _ if since.elapsed() > STOP_TIMEOUT => {
                        let out = self.output(i);
                        self.anomalies.push(format!(
                            "{} did not exit within {STOP_TIMEOUT:?} of SIGTERM; killed. Its last lines:\n      {}",
                            self.slots[i].name,
                            Self::tail(&out, 8)
                        ));
                        let _ = child.kill();
                        let _ = child.wait();
                        State::Down {
                            restart_at: restart_after
                                .map(|s| Instant::now() + Duration::from_secs_f64(s)),
                        }
                    }
                    _ => State::Stopping {
                        child,
                        since,
                        expect,
                        restart_after,
                    },
                },
                State::Down {
                    restart_at: Some(t),
                } if Instant::now() >= t => self.spawn(i),
                s => s,
            };
            self.slots[i].state = next;
        }
    }

    /// Supervises until `until`.
    fn supervise_until(&mut self, until: Instant) {
        loop {
            self.supervise();
            let now = Instant::now();
            if now >= until {
                return;
            }
            std::thread::sleep((until - now).min(Duration::from_millis(20)));
        }
    }

    fn running(&mut self, slot: usize) -> Option<&mut Child> {
        match &mut self.slots[slot].state {
            State::Running(c) => Some(c),
            _ => None,
        }
    }

    fn kill9(&mut self, slot: usize, restart_after: Option<f64>) -> String {
        let forever = restart_after.is_none();
        let restart_at = restart_after.map(|s| Instant::now() + Duration::from_secs_f64(s));
        if forever {
            self.slots[slot].forever = true;
        }
        match std::mem::replace(&mut self.slots[slot].state, State::Down { restart_at }) {
            State::Running(mut c) => {
                let pid = c.id();
                let _ = c.kill();
                let _ = c.wait();
                format!("pid {pid} killed")
            }
            State::Stopping { child: mut c, .. } => {
                let pid = c.id();
                let _ = c.kill();
                let _ = c.wait();
                format!("pid {pid} killed during its drain")
            }
            State::Down { .. } if forever => "not running; it will not be restarted".into(),
            old @ State::Down { .. } => {
                self.slots[slot].state = old;
                "skipped: not running".into()
            }
        }
    }

    fn term(&mut self, slot: usize, second_after: Option<f64>, restart_after: f64) -> String {
        if self.running(slot).is_none() {
            return "skipped: not running".into();
        }
        let State::Running(child) = std::mem::replace(
            &mut self.slots[slot].state,
            State::Down { restart_at: None },
        ) else {
            unreachable!()
        };
        let pid = child.id() as i32;
        self.signalled(slot);
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let expect: &'static [i32] = match second_after {
            Some(gap) => {
                // The child is not reaped before the second signal, so the pid is still ours.
                std::thread::sleep(Duration::from_secs_f64(gap));
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
                // 0 if the drain finished before the second signal arrived.
                &[130, 0]
            }
            None => &[0],
        };
        self.slots[slot].state = State::Stopping {
            child,
            since: Instant::now(),
            expect,
            restart_after: Some(restart_after),
        };
        format!("pid {pid} signalled")
    }

    /// Every slot not killed for good comes back now.
    fn revive_all(&mut self) {
        for s in &mut self.slots {
            if let State::Down { restart_at } = &mut s.state {
                if !s.forever {
                    *restart_at = Some(Instant::now());
                }
            }
        }
        self.supervise();
    }

    fn all_up(&self) -> bool {
        self.slots
            .iter()
            .all(|s| s.forever || matches!(s.state, State::Running(_)))
    }

    /// SIGTERM to every running worker; each must drain and exit 0.
    fn stop_all(&mut self) {
        for i in 0..self.slots.len() {
            match std::mem::replace(&mut self.slots[i].state, State::Down { restart_at: None }) {
                State::Running(child) => {
                    self.signalled(i);
                    unsafe {
                        libc::kill(child.id() as i32, libc::SIGTERM);
                    }
                    self.slots[i].state = State::Stopping {
                        child,
                        since: Instant::now(),
                        expect: &[0],
                        restart_after: None,
                    };
                }
                State::Stopping {
                    child,
                    since,
                    expect,
                    ..
                } => {
                    self.slots[i].state = State::Stopping {
                        child,
                        since,
                        expect,
                        restart_after: None,
                    }
                }
                State::Down { .. } => {}
            }
        }
        while self
            .slots
            .iter()
            .any(|s| matches!(s.state, State::Stopping { .. }))
        {
            self.supervise();
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics in any incarnation's log.
    fn panics(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.slots {
            let text = std::fs::read_to_string(&s.log).unwrap_or_default();
            for l in text.lines().filter(|l| l.contains("panicked")) {
                out.push(format!("{}: {l}", s.name));
            }
        }
        out
    }
}

impl Drop for Workers<'_> {
    fn drop(&mut self) {
        for s in &mut self.slots {
            match &mut s.state {
                State::Running(c) | State::Stopping { child: c, .. } => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                State::Down { .. } => {}
            }
        }
        for &pid in &self.faked {
            forget_faketime(pid);
        }
    }
}

// ---- the faults -------------------------------------------------------------------------

/// A Redis command from the driver, retried while the connection fails (the commands are
/// idempotent or harmless to repeat).
fn redis_op<T>(
    ctx: &Ctx,
    mut f: impl FnMut(&mut Con) -> redis::RedisResult<T>,
) -> Result<T, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match rcon(&ctx.redis_url).and_then(|mut c| f(&mut c)) {
            Ok(v) => return Ok(v),
            Err(e) if e.code().is_none() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => return Err(format!("failed: {e}")),
        }
    }
}

fn wrong_key_name(ctx: &Ctx, k: WrongKey, shard: usize) -> String {
    match k {
        WrongKey::Dead => ctx.plan.setup.dead_key(&ctx.shards[shard]),
        WrongKey::Data => ctx.shards[shard].data.clone(),
    }
}

/// Where a broken key's value waits (on a Cluster in the key's slot: its hash tag is the
/// key's).
fn stash(key: &str) -> String {
    format!("chaos:stash:{key}")
}

fn restore(ctx: &Ctx, k: WrongKey, shard: usize) -> String {
    let key = wrong_key_name(ctx, k, shard);
    match redis_op(ctx, |c| RESTORE.key(&key).key(stash(&key)).invoke::<i64>(c)) {
        Ok(_) => "restored".into(),
        Err(e) => e,
    }
}

fn worker_backends(c: &mut postgres::Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'delay-worker'",
        &[],
    )
    .map(|r| r.get(0))
    .unwrap_or(-1)
}

/// Takes every free connection slot, then cuts the workers' connections and takes the
/// slots they free, until the workers hold none (they race for them).
fn exhaust(url: &str) -> (Vec<postgres::Client>, String) {
    let mut hog = Vec::new();
    while let Ok(c) = pg_connect(url) {
        hog.push(c);
        if hog.len() >= 200 {
            break;
        }
    }
    if hog.is_empty() {
        return (hog, "skipped: no connection to be had".into());
    }
    for _ in 0..100 {
        if worker_backends(&mut hog[0]) == 0 {
            break;
        }
        let _ = hog[0].execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'delay-worker'",
            &[],
        );
        // Termination is asynchronous: a moment for the backends to exit and free slots.
        std::thread::sleep(Duration::from_millis(20));
        while let Ok(c) = pg_connect(url) {
            hog.push(c);
        }
    }
    let left = worker_backends(&mut hog[0]);
    let note = format!("holding {} connections; the workers hold {left}", hog.len());
    (hog, note)
}

fn terminate_storm(url: &str, rounds: usize) -> String {
    let Ok(mut c) = pg_connect(url) else {
        return "skipped: no connection".into();
    };
    let mut total = 0i64;
    for _ in 0..rounds {
        total += c
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'delay-worker'",
                &[],
            )
            .map(|r| r.get::<_, i64>(0))
            .unwrap_or(0);
        std::thread::sleep(Duration::from_millis(150));
    }
    format!("{total} worker backends terminated")
}

/// Runs `statements` one by one (ALTER SYSTEM cannot share a transaction), trying again
/// until they all went through (the server may be restarting or out of connections).
fn until_done(url: &str, statements: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut tries = 0;
    loop {
        tries += 1;
        let r = pg_connect(url).and_then(|mut c| {
            for st in statements {
                c.batch_execute(st)?;
            }
            Ok(())
        });
        match r {
            Ok(()) => return format!("done ({tries} tries)"),
            Err(e) if Instant::now() > deadline => {
                panic!("{statements:?}: {}", delay_worker::db::error_text(&e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A shop transaction holding one row lock of `table` (the row at `at` of its ids) for
/// `secs`, then rolling back.
fn shop_lock(url: &str, table: &str, at: f64, secs: f64) -> String {
    let Ok(mut c) = pg_connect(url) else {
        return "skipped: no connection".into();
    };
    let r = (|| -> Result<Option<i64>, postgres::Error> {
        let mut t = c.transaction()?;
        let row = t.query_opt(
            &format!(
                "SELECT id FROM {table} ORDER BY id OFFSET (SELECT floor(count(*) * $1::float8)::bigint FROM {table}) LIMIT 1 FOR UPDATE"
            ),
            &[&at],
        )?;
        std::thread::sleep(Duration::from_secs_f64(secs));
        t.rollback()?;
        Ok(row.map(|r| r.get(0)))
    })();
    match r {
        Ok(Some(id)) => format!("held id {id}"),
        Ok(None) => "no row".into(),
        Err(e) => format!("failed: {e}"),
    }
}

fn debug_sleep(ctx: &Ctx) -> String {
    match rcon(&ctx.redis_url)
        .and_then(|mut c| redis::cmd("DEBUG").arg("SLEEP").arg(1).query::<()>(&mut c))
    {
        Ok(()) => "stalled 1s".into(),
        Err(e) => format!("failed: {e}"),
    }
}

/// The port of the master serving a shard's slot now.
fn master_of_shard(ctx: &Ctx, shard: usize) -> u16 {
    let cluster = ctx.cluster.expect("cluster mode");
    cluster.master_serving(delay_worker::keys::slot(&ctx.shards[shard].pool))
}

/// Cluster mode: the master of a shard stalls.
fn stall_master(ctx: &Ctx, shard: usize) -> String {
    let port = master_of_shard(ctx, shard);
    match node_con(port).and_then(|mut c| {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(CLUSTER_STALL)
            .query::<()>(&mut c)
    }) {
        Ok(()) => format!("{port} stalled {CLUSTER_STALL}s"),
        Err(e) => format!("{port} failed: {e}"),
    }
}

/// A reshard under way: the shard, its slot, and the masters it moves between.
#[derive(Clone, Copy)]
struct Reshard {
    shard: usize,
    slot: u16,
    from: u16,
    to: u16,
    /// Keys migrated so far, and in how many MIGRATE steps.
    moved: usize,
    steps: usize,
}

/// Runs the faults and keeps what a window holds open (connections, broken keys).
struct Driver<'a> {
    ctx: &'a Ctx<'a>,
    hog: Vec<postgres::Client>,
    broken: Vec<(WrongKey, usize)>,
    reshard: Option<Reshard>,
    /// Each reshard done, in a few words (for the summary).
    resharded: Vec<String>,
    /// Pushes the messages that belong to a fault.
    producer: Producer,
}

impl Driver<'_> {
    fn execute(
        &mut self,
        i: usize,
        f: &Fault,
        redis: Option<&mut RedisServer>,
        pg: &PgServer,
        workers: &mut Workers,
    ) {
        // (A stall, a terminate storm and a PostgreSQL restart take time of their own: they
        // run on threads of `run_seed`, so the schedule keeps its times.)
        let ctx = self.ctx;
        let began = ctx.now();
        let what = f.describe(&ctx.plan.setup);
        let note = match f {
            Fault::Kill9 {
                slot,
                restart_after,
            } => workers.kill9(*slot, *restart_after),
            Fault::Term {
                slot,
                restart_after,
            } => workers.term(*slot, None, *restart_after),
            Fault::DoubleTerm {
                slot,
                gap,
                restart_after,
            } => workers.term(*slot, Some(*gap), *restart_after),
            Fault::ClientKill if ctx.cluster.is_some() => client_kill_masters(ctx),
            Fault::ClientKill => redis_op(ctx, |c| {
                redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query::<i64>(c)
            })
            .map(|n| format!("{n} connections killed"))
            .unwrap_or_else(|e| e),
            Fault::RedisRestart => {
                redis.expect("one Redis server").restart();
                "back".into()
            }
            Fault::DebugSleep
            | Fault::StallMaster { .. }
            | Fault::PgRestart { .. }
            | Fault::PgTerminate { .. } => {
                unreachable!("run on a thread of run_seed")
            }
            Fault::ReshardBegin { shard, to, .. } => self.reshard_begin(*shard, *to),
            Fault::ReshardStep { step, steps, .. } => self.reshard_step(*step, *steps),
            Fault::ReshardEnd { .. } => self.reshard_end(),
            Fault::PgExhaust => {
                let (hog, note) = exhaust(&pg.url);
                self.hog = hog;
                note
            }
            Fault::PgRelease => {
                let n = self.hog.len();
                self.hog.clear();
                format!("{n} released")
            }
            Fault::PgReadOnly => until_done(
                &pg.url,
                &[
                    "ALTER SYSTEM SET default_transaction_read_only = on",
                    "SELECT pg_reload_conf()",
                ],
            ),
            Fault::PgWritable => until_done(
                &pg.url,
                &[
                    "ALTER SYSTEM RESET default_transaction_read_only",
                    "SELECT pg_reload_conf()",
                ],
            ),
            Fault::RenameColumn | Fault::RestoreColumn | Fault::ShopLock { .. } => {
                unreachable!("run on a thread of run_seed")
            }
            Fault::WrongType(k, shard) => self.break_key(i, *k, *shard),
            Fault::Restore(k, shard) => {
                self.broken.retain(|b| *b != (*k, *shard));
                restore(ctx, *k, *shard)
            }
        };
        ctx.note_at(began, format!("{what}: {note} ({:.2}s)", ctx.now() - began));
    }

    /// Breaks a key, with the messages of the fault: hostile ones due inside the window
    /// (dead key), or a burst in flight when it breaks (data key).
    fn break_key(&mut self, i: usize, k: WrongKey, shard: usize) -> String {
        let ctx = self.ctx;
        let key = wrong_key_name(ctx, k, shard);
        let mine: Vec<usize> = (0..ctx.plan.msgs.len())
            .filter(|&m| ctx.plan.msgs[m].trigger == Some(i))
            .collect();
        let first = self.producer.out.recs.len();
        if k == WrongKey::Data {
            for &m in &mine {
                self.producer.push(ctx, m, delay_worker::now_ms());
            }
            // Once moved (the mover reads the data hash) they are in flight. (On a Cluster
            // those of the shard whose key breaks; the others may be in a shard whose slot
            // is moving.)
            let keys: Vec<String> = self.producer.out.recs[first..]
                .iter()
                .map(|r| r.key.clone())
                .filter(|k| ctx.shard_of(k) == shard)
                .collect();
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                let left = rcon(&ctx.redis_url).and_then(|mut c| {
                    let mut p = redis::pipe();
                    for k in &keys {
                        p.cmd("ZSCORE").arg(&ctx.keys_for(k).pool).arg(k);
                    }
                    p.query::<Vec<Option<f64>>>(&mut c)
                });
                if left.is_ok_and(|l| l.iter().all(Option::is_none)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.broken.push((k, shard));
        let mut note = redis_op(ctx, |c| {
            BREAK
                .key(&key)
                .key(stash(&key))
                .arg("an operator's mistake")
                .invoke::<i64>(c)
        })
        .map(|_| "now a string".to_string())
        .unwrap_or_else(|e| e);
        if k == WrongKey::Dead {
            for &m in &mine {
                let due = delay_worker::now_ms() + (ctx.plan.msgs[m].due_at * 1000.0) as i64;
                self.producer.push(ctx, m, due);
            }
        }
        if !mine.is_empty() {
            let _ = write!(
                note,
                "; {} messages of its own pushed",
                self.producer.out.recs.len() - first
            );
        }
        note
    }

    /// Cluster mode: a shard's slot starts to move to another master (`to`: which of the
    /// others, by port).
    fn reshard_begin(&mut self, shard: usize, to: usize) -> String {
        let ctx = self.ctx;
        let cluster = ctx.cluster.expect("cluster mode");
        if let Some(r) = self.reshard {
            return format!("skipped: shard {}'s reshard is under way", r.shard);
        }
        let slot = delay_worker::keys::slot(&ctx.shards[shard].pool);
        let from = cluster.master_serving(slot);
        let mut others: Vec<u16> = cluster
            .masters()
            .into_iter()
            .filter(|&p| p != from)
            .collect();
        others.sort_unstable();
        let to = others[to % others.len()];
        cluster.begin_reshard(slot, from, to);
        self.reshard = Some(Reshard {
            shard,
            slot,
            from,
            to,
            moved: 0,
            steps: 0,
        });
        format!("slot {slot} MIGRATING on {from}, IMPORTING on {to}")
    }

    /// Cluster mode: a share of the moving slot's keys (the shard's pool first), so that
    /// its scripts meet their keys on both masters (`TRYAGAIN`), or only on the new one
    /// (`ASK`).
    fn reshard_step(&mut self, step: usize, steps: usize) -> String {
        let ctx = self.ctx;
        let cluster = ctx.cluster.expect("cluster mode");
        let Some(r) = self.reshard else {
            return "skipped: no reshard under way".into();
        };
        let k = &ctx.shards[r.shard];
        let first = [
            &k.pool, &k.data, &k.jobs, &k.stream, &k.dead, &k.moved, &k.letters,
        ];
        let mut keys = cluster.keys_in_slot(r.from, r.slot, 1_000_000);
        keys.sort_by_key(|key| {
            (
                first.iter().position(|f| *f == key).unwrap_or(first.len()),
                key.clone(),
            )
        });
        // This step's share of what is left: the end moves the last share.
        let n = keys.len().div_ceil(steps - step + 2);
        for chunk in keys[..n].chunks(500) {
            cluster.migrate_keys(r.from, r.to, chunk);
        }
        if let Some(r) = self.reshard.as_mut() {
            r.moved += n;
            r.steps += 1;
        }
        format!(
            "{n} of {} keys migrated{}",
            keys.len(),
            keys.first()
                .map(|k| format!(" (first {k})"))
                .unwrap_or_default()
        )
    }

    /// Cluster mode: the rest of the slot's keys move and the new master serves it.
    fn reshard_end(&mut self) -> String {
        let cluster = self.ctx.cluster.expect("cluster mode");
        let Some(r) = self.reshard.take() else {
            return "skipped: no reshard under way".into();
        };
        let left = cluster.keys_in_slot(r.from, r.slot, 1_000_000).len();
        cluster.end_reshard(r.slot, r.from, r.to);
        self.resharded.push(format!(
            "shard {} (slot {}, {} to {}: {} keys, {} step(s) while the workers ran, then {left})",
            r.shard, r.slot, r.from, r.to, r.moved, r.steps
        ));
        format!("{left} keys migrated, slot {} served by {}", r.slot, r.to)
    }

    /// Whatever the schedule left open is closed (it normally closes everything itself).
    fn close(&mut self) {
        if let Some(r) = self.reshard {
            let note = self.reshard_end();
            self.ctx
                .note(format!("end: the reshard of shard {}: {note}", r.shard));
        }
        for (k, shard) in std::mem::take(&mut self.broken) {
            let note = restore(self.ctx, k, shard);
            self.ctx.note(format!(
                "end: restore {}: {note}",
                wrong_key_name(self.ctx, k, shard)
            ));
        }
        if !self.hog.is_empty() {
            self.ctx
                .note(format!("end: {} held connections released", self.hog.len()));
            self.hog.clear();
        }
    }
}

/// Cluster mode: `CLIENT KILL TYPE normal` on every master.
fn client_kill_masters(ctx: &Ctx) -> String {
    let cluster = ctx.cluster.expect("cluster mode");
    let notes: Vec<String> = cluster
        .masters()
        .into_iter()
        .map(|port| {
            match node_con(port).and_then(|mut c| {
                redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query::<i64>(&mut c)
            }) {
                Ok(n) => format!("{port}: {n}"),
                Err(e) => format!("{port}: failed: {e}"),
            }
        })
        .collect();
    format!("connections killed: {}", notes.join(", "))
}

/// Sets the abort flag when the driver unwinds, so the input threads stop at once.
struct AbortOnUnwind<'a>(&'a AtomicBool);

impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

// ---- the books --------------------------------------------------------------------------

fn vtext(v: &Value) -> String {
    delay_worker::store::value_to_string(v)
}

/// A field of an XINFO reply (a flat array in RESP2, a map in RESP3).
fn field<'v>(v: &'v Value, name: &str) -> Option<&'v Value> {
    match v {
        Value::Array(items) => items
            .chunks(2)
            .find(|c| c.len() == 2 && vtext(&c[0]) == name)
            .map(|c| &c[1]),
        Value::Map(pairs) => pairs.iter().find(|(k, _)| vtext(k) == name).map(|(_, v)| v),
        _ => None,
    }
}

fn due_ms(score: f64) -> f64 {
    if score < 1e11 {
        score * 1000.0
    } else {
        score
    }
}

fn xpending(con: &mut dyn redis::ConnectionLike, keys: &Keys) -> redis::RedisResult<i64> {
    let v: Value = redis::cmd("XPENDING")
        .arg(&keys.stream)
        .arg(&keys.group)
        .query(con)?;
    Ok(match v {
        Value::Array(v) => match v.first() {
            Some(Value::Int(n)) => *n,
            _ => 0,
        },
        _ => 0,
    })
}

/// The stream's entries not yet delivered to the group, described; `None` if none.
fn undelivered(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
) -> redis::RedisResult<Option<String>> {
    let stream: Value = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(&keys.stream)
        .query(con)?;
    let last = field(&stream, "last-generated-id")
        .map(vtext)
        .unwrap_or_default();
    let len = field(&stream, "length").map(vtext).unwrap_or_default();
    let groups: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&keys.stream)
        .query(con)?;
    let Value::Array(groups) = groups else {
        return Ok(Some("no consumer group".into()));
    };
    let Some(g) = groups
        .iter()
        .find(|g| field(g, "name").map(vtext).as_deref() == Some(keys.group.as_str()))
    else {
        return Ok(Some("no consumer group".into()));
    };
    let delivered = field(g, "last-delivered-id").map(vtext).unwrap_or_default();
    Ok((len != "0" && delivered != last).then(|| {
        format!("stream entries not yet delivered (last {last}, delivered up to {delivered})")
    }))
}

fn llen(con: &mut dyn redis::ConnectionLike, key: &str) -> redis::RedisResult<i64> {
    redis::cmd("LLEN").arg(key).query(con)
}

/// Lists of list mode that must end empty: queues and every consumer's processing lists.
fn list_keys(ctx: &Ctx) -> Vec<String> {
    let mut out = Vec::new();
    for q in ctx.plan.setup.queues() {
        out.push(q.to_string());
        for i in 0..ctx.plan.setup.threads.len() {
            out.push(format!("{q}:processing:w{i}"));
        }
    }
    out
}

/// What is still moving: due members (or retries) in a pool, undelivered or pending stream
/// entries, messages on a queue or held in a processing list. Empty: quiescent.
fn in_flight(ctx: &Ctx, con: &mut Con) -> redis::RedisResult<Vec<String>> {
    let mut busy = Vec::new();
    let horizon = (ctx.start_ms + (FAR_SECS - 600) * 1000) as f64;
    let pools = ctx.shards.iter().map(|k| k.pool.as_str());
    for pool in pools.chain([ctx.plan.setup.legacy_pool()]) {
        let members: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(pool)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(con)?;
        let due: Vec<f64> = members
            .iter()
            .map(|(_, s)| due_ms(*s))
            .filter(|d| *d < horizon)
            .collect();
        if !due.is_empty() {
            let last = due.iter().copied().fold(f64::MIN, f64::max);
            busy.push(format!(
                "{} due or retrying in {pool} (the last due in {:.1}s)",
                due.len(),
                (last - delay_worker::now_ms() as f64) / 1000.0
            ));
        }
    }
    match ctx.plan.setup.mode {
        Mode::Stream => {
            for keys in &ctx.shards {
                let pending = xpending(con, keys)?;
                let of = match ctx.shards.len() {
                    1 => String::new(),
                    _ => format!(" in {}", keys.stream),
                };
                if pending > 0 {
                    busy.push(format!("{pending} pending{of}"));
                }
                if let Some(u) = undelivered(con, keys)? {
                    busy.push(format!("{u}{of}"));
                }
            }
        }
        Mode::List => {
            for k in list_keys(ctx) {
                let n = llen(con, &k)?;
                if n > 0 {
                    busy.push(format!("{n} on {k}"));
                }
            }
        }
    }
    Ok(busy)
}

struct DeadLetter {
    key: String,
    reason: String,
    /// The letter as stored (list mode) or its message (stream mode): nonces are found here.
    raw: Vec<u8>,
    place: String,
}

/// Everything the oracle counts, read once everything has stopped.
struct Books {
    inbox: HashMap<String, i64>,
    inbox_total: i64,
    dead: Vec<DeadLetter>,
    pool: HashMap<String, f64>,
    legacy_pool: HashMap<String, f64>,
    data_keys: HashSet<String>,
    pending: i64,
    undelivered: Option<String>,
    stream_len: i64,
    lists: Vec<(String, i64)>,
    deliveries: i64,
    statuses: HashMap<i64, (String, Option<String>)>,
}

fn read_books(ctx: &Ctx, db: &TestDb) -> Books {
    let mut con = rcon(&ctx.redis_url).expect("redis at the end");
    let mut pg = db.client();
    let mut inbox = HashMap::new();
    for r in pg
        .query(
            "SELECT job_key, count(*) FROM worker_inbox GROUP BY job_key",
            &[],
        )
        .unwrap()
    {
        inbox.insert(r.get::<_, String>(0), r.get::<_, i64>(1));
    }
    let inbox_total = inbox.values().sum();
    let mut statuses = HashMap::new();
    for r in pg
        .query("SELECT id, status, cancel_reason FROM orders", &[])
        .unwrap()
    {
        statuses.insert(r.get::<_, i64>(0), (r.get(1), r.get(2)));
    }
    let zset = |con: &mut Con, key: &str| -> HashMap<String, f64> {
        let v: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
            .arg(key)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query(con)
            .unwrap();
        v.into_iter()
            .map(|(m, s)| (String::from_utf8_lossy(&m).into_owned(), s))
            .collect()
    };
    // Each shard's keys where they live now (after any reshard), through the cluster's
    // routing: a job key is in one shard's pool and data.
    let mut pool = HashMap::new();
    let mut data_keys = HashSet::new();
    for keys in &ctx.shards {
        pool.extend(zset(&mut con, &keys.pool));
        let data: Vec<Vec<u8>> = redis::cmd("HKEYS").arg(&keys.data).query(&mut con).unwrap();
        data_keys.extend(data.iter().map(|k| String::from_utf8_lossy(k).into_owned()));
    }
    let legacy_pool = zset(&mut con, ctx.plan.setup.legacy_pool());
    let mut dead = Vec::new();
    let (mut pending, mut undel, mut stream_len, mut lists, mut deliveries) =
        (0, None::<String>, 0, Vec::new(), 0);
    match ctx.plan.setup.mode {
        Mode::Stream => {
            for keys in &ctx.shards {
                let v: Value = redis::cmd("XRANGE")
                    .arg(&keys.dead)
                    .arg("-")
                    .arg("+")
                    .query(&mut con)
                    .unwrap();
                if let Value::Array(entries) = v {
                    for e in entries {
                        let Value::Array(pair) = e else { continue };
                        let Some(Value::Array(f)) = pair.get(1) else {
                            continue;
                        };
                        let mut fields: HashMap<String, Vec<u8>> = HashMap::new();
                        for c in f.chunks(2) {
                            if let [k, Value::BulkString(b)] = c {
                                fields.insert(vtext(k), b.clone());
                            }
                        }
                        let s = |k: &str| {
                            String::from_utf8_lossy(fields.get(k).map(Vec::as_slice).unwrap_or(b""))
                                .into_owned()
                        };
                        dead.push(DeadLetter {
                            key: s("key"),
                            reason: s("reason"),
                            raw: fields.get("msg").cloned().unwrap_or_default(),
                            place: format!("{} {}", keys.dead, vtext(&pair[0])),
                        });
                    }
                }
                let p = xpending(&mut con, keys).unwrap_or(-1);
                pending = if p < 0 || pending < 0 {
                    -1
                } else {
                    pending + p
                };
                let u = undelivered(&mut con, keys).unwrap_or_else(|e| Some(e.to_string()));
                if let Some(u) = u {
                    let u = match ctx.shards.len() {
                        1 => u,
                        _ => format!("{}: {u}", keys.stream),
                    };
                    undel = Some(match undel {
                        Some(before) => format!("{before}; {u}"),
                        None => u,
                    });
                }
                stream_len += redis::cmd("XLEN")
                    .arg(&keys.stream)
                    .query::<i64>(&mut con)
                    .unwrap();
            }
        }
        Mode::List => {
            for q in ctx.plan.setup.queues() {
                let letters: Vec<Vec<u8>> = redis::cmd("LRANGE")
                    .arg(format!("{q}:dead"))
                    .arg(0)
                    .arg(-1)
                    .query(&mut con)
                    .unwrap();
                for raw in letters {
                    let j: serde_json::Value =
                        serde_json::from_str(&String::from_utf8_lossy(&raw)).unwrap_or_default();
                    let s = |k: &str| j[k].as_str().unwrap_or("").to_string();
                    let mut key = s("key");
                    if key.is_empty() {
                        // A letter of the fetch limit has no key: the job key is in the message.
                        key = serde_json::from_str::<serde_json::Value>(&s("msg"))
                            .ok()
                            .and_then(|m| m["job_key"].as_str().map(str::to_string))
                            .unwrap_or_default();
                    }
                    dead.push(DeadLetter {
                        key,
                        reason: s("reason"),
                        raw,
                        place: format!("{q}:dead"),
                    });
                }
                let n: i64 = redis::cmd("HLEN")
                    .arg(format!("{q}:deliveries"))
                    .query(&mut con)
                    .unwrap();
                deliveries += n;
            }
            for k in list_keys(ctx) {
                lists.push((k.clone(), llen(&mut con, &k).unwrap()));
            }
        }
    }
    Books {
        inbox,
        inbox_total,
        dead,
        pool,
        legacy_pool,
        data_keys,
        pending,
        undelivered: undel,
        stream_len,
        lists,
        deliveries,
        statuses,
    }
}

impl fmt::Display for Books {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "inbox {} rows ({} keys), dead letters {}, pool {} (data {}), legacy pool {}",
            self.inbox_total,
            self.inbox.len(),
            self.dead.len(),
            self.pool.len(),
            self.data_keys.len(),
            self.legacy_pool.len()
        )?;
        if self.lists.is_empty() {
            write!(
                f,
                ", stream {} entries, pending {}, {}",
                self.stream_len,
                self.pending,
                self.undelivered.as_deref().unwrap_or("all delivered")
            )
        } else {
            let held: i64 = self.lists.iter().map(|l| l.1).sum();
            write!(
                f,
                ", {held} messages on queues/processing lists, delivery counts left {}",
                self.deliveries
            )
        }
    }
}

// ---- the oracle -------------------------------------------------------------------------

/// What a job key must come to: `min..=max` jobs (done, dead or scheduled), from the pushes
/// as they happened.
struct Expect {
    class: Class,
    order: usize,
    min: i64,
    max: i64,
    pushes: Vec<usize>,
    nonce: Option<String>,
}

/// Failures by kind, each with a count and the first few examples.
#[derive(Default)]
struct Failures(BTreeMap<String, Vec<String>>);

impl Failures {
    fn add(&mut self, kind: impl Into<String>, example: impl Into<String>) {
        self.0.entry(kind.into()).or_default().push(example.into());
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Failures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (kind, ex) in &self.0 {
            writeln!(f, "  FAIL {} × {kind}", ex.len())?;
            for e in ex.iter().take(8) {
                writeln!(f, "      {e}")?;
            }
            if ex.len() > 8 {
                writeln!(f, "      ... and {} more", ex.len() - 8)?;
            }
        }
        Ok(())
    }
}

/// The first nonce in a dead letter, if any.
fn find_nonce(raw: &[u8]) -> Option<String> {
    let pat = b"chaosnonce-";
    let at = raw.windows(pat.len()).position(|w| w == pat)?;
    let rest = &raw[at..];
    let end = rest.windows(4).position(|w| w == b"-end").map(|p| p + 4)?;
    Some(String::from_utf8_lossy(&rest[..end]).into_owned())
}

fn oracle(
    ctx: &Ctx,
    db: &TestDb,
    recs: &[PushRec],
    paid: &HashSet<usize>,
    f: &mut Failures,
) -> (Books, String) {
    let plan = ctx.plan;
    let books = read_books(ctx, db);
    let mut exp: BTreeMap<String, Expect> = BTreeMap::new();
    for (ri, r) in recs.iter().enumerate() {
        let m = &plan.msgs[r.msg];
        let e = exp.entry(r.key.clone()).or_insert_with(|| Expect {
            class: m.class,
            order: m.order,
            min: 0,
            max: 0,
            pushes: Vec::new(),
            nonce: matches!(m.class, Class::Hostile(_)).then(|| ctx.nonce(m.id)),
        });
        e.pushes.push(ri);
        match m.class {
            // The same bytes are the same job, however often they were sent.
            Class::Direct => (e.min, e.max) = (1, 1),
            // A resent letter may die twice.
            Class::Hostile(_) => (e.min, e.max) = (1, 1 + r.uncertain as i64),
            // A resent legacy member (the same order id and due time) is the same job
            // as the first copy; the range still allows a second job, as when a job's
            // identity was made at move time.
            Class::Legacy { .. } if r.uncertain => {
                e.min += (e.max == 0) as i64;
                e.max += 1;
            }
            // A push whose reply was lost is sent again, the same bytes and due time: the
            // resend replaces the first copy while it is still scheduled, and once the
            // mover has taken the first copy it moves as the same job (a duplicate). A
            // later push may also have replaced the message before it. The range still
            // allows a second job, as when a job's identity was made at move time.
            Class::Good | Class::Far if r.uncertain => {
                if e.max == 0 {
                    e.min += 1;
                }
                e.max += 2;
            }
            _ if !r.existed => {
                e.min += 1;
                e.max += 1;
            }
            // The key was scheduled: its earlier message, replaced (one job), unless that
            // was due already, when what was scheduled may have been the re-queue of a job
            // that had committed (then this is a new job).
            _ => {
                let prev_due = e
                    .pushes
                    .len()
                    .checked_sub(2)
                    .map(|p| recs[e.pushes[p]].due_ms);
                if prev_due.is_none_or(|due| r.sent_ms + 1000 >= due) {
                    e.max += 1;
                }
            }
        }
    }
    // Dead letters by hostile nonce, then by job key.
    let mut dead_by_nonce: HashMap<String, Vec<usize>> = HashMap::new();
    let mut dead_by_key: HashMap<String, Vec<usize>> = HashMap::new();
    for (i, d) in books.dead.iter().enumerate() {
        if d.reason.trim().is_empty() {
            f.add(
                "dead letters without a reason",
                format!("{} key {:?}", d.place, d.key),
            );
        }
        match find_nonce(&d.raw) {
            Some(n) => dead_by_nonce.entry(n).or_default().push(i),
            None => dead_by_key.entry(d.key.clone()).or_default().push(i),
        }
    }
    let nonces: HashSet<&String> = exp.values().filter_map(|e| e.nonce.as_ref()).collect();
    for (n, letters) in &dead_by_nonce {
        if !nonces.contains(n) {
            f.add(
                "dead letters of hostile messages never pushed",
                format!("{n}: {}", books.dead[letters[0]].place),
            );
        }
    }
    let describe_pushes = |e: &Expect| -> String {
        e.pushes
            .iter()
            .map(|&ri| {
                let r = &recs[ri];
                let m = &plan.msgs[r.msg];
                let ts = serde_json::from_slice::<serde_json::Value>(&r.body)
                    .ok()
                    .map(|v| v["ts"].to_string())
                    .unwrap_or_else(|| "?".into());
                let due = match m.trigger {
                    Some(_) => format!("{:.2}s after the push", m.due_at),
                    None => format!("+{:.2}s", m.due_at),
                };
                format!(
                    "[pushed +{:.2}s{} ts {ts}, due {due} {}{}{}]",
                    r.at,
                    match m.again {
                        Some(Again::Reschedule) => " (reschedule)",
                        Some(Again::Repush) => " (re-push)",
                        None => "",
                    },
                    if m.secs_score { "s" } else { "ms" },
                    if r.existed {
                        ", the key was scheduled"
                    } else {
                        ""
                    },
                    if r.uncertain {
                        ", reply lost: sent again"
                    } else {
                        ""
                    },
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut due_orders: HashSet<usize> = HashSet::new();
    let (mut done, mut dead_ok, mut scheduled) = (0i64, 0usize, 0usize);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for (key, e) in &exp {
        let rows = books.inbox.get(key).copied().unwrap_or(0);
        let in_pool = match e.class {
            Class::Legacy { .. } => books.legacy_pool.contains_key(key),
            _ => books.pool.contains_key(key),
        } as i64;
        let letters: &[usize] = match &e.nonce {
            // An oversized message's letter keeps only its first 4 KiB, which may end
            // before the nonce: it is found by its job key then.
            Some(n) => dead_by_nonce
                .get(n)
                .or_else(|| dead_by_key.get(key))
                .map(Vec::as_slice)
                .unwrap_or(&[]),
            None => dead_by_key.get(key).map(Vec::as_slice).unwrap_or(&[]),
        };
        let dead = letters.len() as i64;
        let range = if e.min == e.max {
            e.min.to_string()
        } else {
            format!("{}..={}", e.min, e.max)
        };
        let detail = format!(
            "{key}: expected {range} job(s); done {rows}, dead {dead}, scheduled {in_pool} {}",
            describe_pushes(e)
        );
        match e.class {
            Class::Hostile(h) => {
                if rows > 0 {
                    f.add("hostile messages processed (inbox rows)", detail.clone());
                }
                if in_pool > 0 {
                    f.add(
                        "hostile messages still scheduled after their due time",
                        detail.clone(),
                    );
                }
                if dead < e.min {
                    f.add(
                        format!("hostile messages lost: no dead letter ({})", h.name()),
                        detail,
                    );
                } else if dead > e.max {
                    f.add("hostile messages dead-lettered more than once", detail);
                }
                dead_ok += letters.len();
                for &i in letters {
                    // Numbers out, so the same reason counts once.
                    let mut short = String::new();
                    for c in books.dead[i].reason.chars().take(50) {
                        if !c.is_ascii_digit() {
                            short.push(c);
                        } else if !short.ends_with('N') {
                            short.push('N');
                        }
                    }
                    *reasons.entry(format!("{}: {short}", h.name())).or_default() += 1;
                }
            }
            Class::Far | Class::Legacy { far: true } => {
                if in_pool != 1 || rows != 0 || dead != 0 {
                    f.add("far-future messages not exactly still scheduled", detail);
                }
                scheduled += in_pool as usize;
            }
            Class::Good | Class::Legacy { far: false } | Class::Direct => {
                due_orders.insert(e.order);
                // A retry whose key was pushed again before it ran is superseded by the
                // newer push (a push reschedules its key): a dead letter that says so, and
                // only for a key pushed more than once, counting a push sent again after
                // a lost reply (the first copy may have landed, moved and failed before
                // the resend scheduled the key again).
                let pushed_twice =
                    e.pushes.len() >= 2 || e.pushes.iter().any(|&p| recs[p].uncertain);
                for &i in letters {
                    let superseded = books.dead[i].reason.contains("pushed again");
                    if !superseded || !pushed_twice {
                        f.add(
                            "good messages dead-lettered",
                            format!(
                                "{key}: {} ({}) {}",
                                books.dead[i].reason,
                                books.dead[i].place,
                                describe_pushes(e)
                            ),
                        );
                    }
                }
                if in_pool > 0 {
                    f.add("due messages still scheduled at the end", detail.clone());
                }
                // A superseded retry may be one whose commit had happened (an ack turned
                // into a re-queue after a PostgreSQL crash): its letter makes up for a
                // missing job, never counts as a second one.
                let superseded = letters
                    .iter()
                    .filter(|&&i| books.dead[i].reason.contains("pushed again"))
                    .count() as i64;
                let firm = rows + in_pool + dead - superseded;
                let got = if firm < e.min {
                    (firm + superseded).min(e.min)
                } else {
                    firm
                };
                if got == 0 {
                    f.add(
                        "jobs lost: pushed and due, yet not done, not dead-lettered, not scheduled",
                        detail,
                    );
                } else if got < e.min {
                    let float = e
                        .pushes
                        .iter()
                        .all(|&ri| plan.msgs[recs[ri].msg].float_ts.is_some());
                    f.add(
                        format!(
                            "later jobs of a key lost: fewer done than pushed, each push with its own ts ({})",
                            if float { "float ts" } else { "integer ts" }
                        ),
                        detail,
                    );
                } else if got > e.max {
                    f.add(
                        "jobs done more than once (inbox rows beyond the jobs pushed)",
                        detail,
                    );
                }
                done += rows;
            }
        }
    }
    for (key, &rows) in &books.inbox {
        if !exp.contains_key(key) {
            f.add(
                "inbox rows for keys never pushed",
                format!("{key}: {rows} rows"),
            );
        }
    }
    for (key, letters) in &dead_by_key {
        if !exp.contains_key(key) {
            for &i in letters {
                let d = &books.dead[i];
                f.add(
                    "dead letters of messages never pushed",
                    format!("{} key {key:?}: {}", d.place, d.reason),
                );
            }
        }
    }
    for (key, score) in &books.pool {
        if !exp.contains_key(key) {
            f.add(
                "unknown members in the pool",
                format!("{key} score {score}"),
            );
        }
        if !books.data_keys.contains(key) {
            f.add("pool members without data", key.clone());
        }
    }
    for key in &books.data_keys {
        if !books.pool.contains_key(key) {
            f.add("data without a pool member", key.clone());
        }
    }
    for key in books.legacy_pool.keys() {
        if !exp.contains_key(key) {
            f.add("unknown members in the legacy pool", key.clone());
        }
    }
    // The legacy STRING keys go with their members.
    let mut con = rcon(&ctx.redis_url).expect("redis at the end");
    for (key, e) in &exp {
        if let Class::Legacy { .. } = e.class {
            let exists: bool = redis::cmd("EXISTS").arg(key).query(&mut con).unwrap();
            if exists != books.legacy_pool.contains_key(key) {
                f.add(
                    "legacy STRING keys not removed with their member (or removed without it)",
                    format!("{key}: exists {exists}"),
                );
            }
        }
    }
    if books.pending != 0 {
        f.add("entries left pending", format!("{} pending", books.pending));
    }
    if let Some(u) = &books.undelivered {
        f.add("entries never delivered", u.clone());
    }
    for (k, n) in &books.lists {
        if *n != 0 {
            f.add(
                "messages left on a queue or processing list",
                format!("{k}: {n}"),
            );
        }
    }
    // The shop: each order cancelled, paid or pending exactly as the pushes and payments
    // say; stock and coupons to the unit.
    let mut expected_cancelled: Vec<&SeedOrder> = Vec::new();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, o) in ctx.orders.iter().enumerate() {
        let want = if paid.contains(&i) {
            "paid"
        } else if due_orders.contains(&i) {
            expected_cancelled.push(o);
            "cancelled"
        } else {
            "pending"
        };
        *counts.entry(want).or_default() += 1;
        let (status, reason) = &books.statuses[&o.id];
        if status != want {
            f.add(
                format!("orders {status} that should be {want}"),
                o.order_no.clone(),
            );
        } else if want == "cancelled" && reason.as_deref() != Some("timeout") {
            f.add(
                "cancelled orders without reason timeout",
                o.order_no.clone(),
            );
        }
    }
    let cancelled_ids: HashSet<i64> = expected_cancelled.iter().map(|o| o.id).collect();
    let mut out: HashMap<i64, i64> = HashMap::new();
    for o in ctx.orders.iter().filter(|o| !cancelled_ids.contains(&o.id)) {
        for (sku, qty) in &o.items {
            *out.entry(*sku).or_default() += *qty as i64;
        }
    }
    let mut pg = db.client();
    for r in pg
        .query("SELECT id, stock FROM sku ORDER BY id", &[])
        .unwrap()
    {
        let (id, stock): (i64, i32) = (r.get(0), r.get(1));
        let want = START_STOCK as i64 - out.get(&id).copied().unwrap_or(0);
        if stock as i64 != want {
            f.add(
                "sku stock off",
                format!(
                    "sku {id}: stock {stock}, expected {want} (off by {})",
                    stock as i64 - want
                ),
            );
        }
    }
    let coupons: HashMap<i64, String> = pg
        .query("SELECT id, status FROM coupon_user", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for o in ctx.orders {
        if let Some(c) = o.coupon_id {
            let want = if cancelled_ids.contains(&o.id) {
                "unused"
            } else {
                "used"
            };
            if coupons[&c] != want {
                f.add(
                    format!("coupons {} that should be {want}", coupons[&c]),
                    format!("order {} coupon {c}", o.order_no),
                );
            }
        }
    }
    if f.is_empty() {
        // The fixture's own accounting agrees (it panics otherwise).
        assert_accounting(db, ctx.orders, &expected_cancelled);
    }
    let hostile = exp
        .values()
        .filter(|e| matches!(e.class, Class::Hostile(_)))
        .count();
    let reasons: Vec<String> = reasons.iter().map(|(r, n)| format!("{n}× {r}")).collect();
    let line = format!(
        "{} keys pushed ({} pushes, {} with a lost reply, {} refused while a key was broken or a slot moved); {done} jobs done, {dead_ok} dead letters for {hostile} hostile messages, {scheduled} still scheduled; orders: {} cancelled, {} paid, {} pending. Dead-letter reasons: {}",
        exp.len(),
        recs.len(),
        recs.iter().filter(|r| r.uncertain).count(),
        recs.iter().filter(|r| r.refused > 0).count(),
        counts.get("cancelled").unwrap_or(&0),
        counts.get("paid").unwrap_or(&0),
        counts.get("pending").unwrap_or(&0),
        reasons.join("; "),
    );
    (books, line)
}

// ---- one seed, start to end -------------------------------------------------------------

fn log_dir(seed: u64) -> PathBuf {
    let base = std::env::var_os("DW_CHAOS_LOG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("chaos-{seed}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the chaos log directory");
    dir
}

/// Runs one seed: `Ok` with a one-line summary, or `Err` with the whole report.
fn run_seed(seed: u64, secs: f64) -> Result<String, String> {
    let began = Instant::now();
    let plan = Plan::draw(seed, secs, &skip_list());
    let described = plan.describe();
    println!("{described}");
    let dir = log_dir(seed);

    let pg = PgServer::start(&[
        "-c max_connections=40",
        "-c superuser_reserved_connections=0",
    ]);
    let db = pg.db();
    // One server (AOF, restarted by a fault), or a Cluster whose masters may be stalled.
    let (mut redis, cluster) = match plan.setup.cluster {
        false => (
            Some(RedisServer::start_with(&[
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--enable-debug-command",
                "local",
            ])),
            None,
        ),
        true => (
            None,
            Some(Cluster::start_with(&["--enable-debug-command", "local"])),
        ),
    };
    let redis_url = match (&redis, &cluster) {
        (Some(r), _) => r.url(),
        (_, Some(c)) => c.url(),
        _ => unreachable!(),
    };
    let handlers = plan.setup.flaky.then(|| {
        db.client()
            .batch_execute(&format!(
                "CREATE FUNCTION chaos_flaky() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
                 BEGIN
                   IF random() < {FLAKY_RATE} THEN
                     RAISE EXCEPTION 'chaos: injected serialization failure' USING ERRCODE = '40001';
                   END IF;
                   RETURN true;
                 END $$"
            ))
            .unwrap();
        HandlerDir::new(&[(
            "order.timeout.sql",
            order_timeout_set_with(
                "flaky AS (SELECT chaos_flaky() AS ok)",
                "(SELECT ok FROM flaky)",
            ),
        )])
    });
    let orders = seed_orders(&db, plan.setup.orders);
    // Paid before the start: every one of them is still pending, so every payment wins.
    type Pays = Vec<(f64, usize)>;
    let (before, during): (Pays, Pays) = plan.pays.iter().copied().partition(|p| p.0 < 0.0);
    let before_orders: Vec<SeedOrder> = before.iter().map(|p| orders[p.1].clone()).collect();
    pay(&db, &before_orders);
    let mut paid: HashSet<usize> = before.iter().map(|p| p.1).collect();
    let ctx = Ctx {
        plan: &plan,
        orders: &orders,
        shards: plan.setup.shard_keys(),
        cluster: cluster.as_ref(),
        redis_url,
        db_url: db.url.clone(),
        start: Instant::now(),
        start_ms: delay_worker::now_ms(),
        abort: AtomicBool::new(false),
        events: Mutex::new(Vec::new()),
    };
    let ctx = &ctx;
    let mut problems = Vec::new();
    ctx.note(format!("{} orders paid before the start", paid.len()));

    let mut workers = Workers::new(
        ctx,
        &dir,
        plan.setup
            .worker_args(handlers.as_ref().map(|h| h.0.as_path())),
    );
    workers.start_all();
    let mut driver = Driver {
        ctx,
        hog: Vec::new(),
        broken: Vec::new(),
        reshard: None,
        resharded: Vec::new(),
        producer: Producer::default(),
    };
    let pg = &pg;
    let (mut inputs, paid_during, pay_problems) = std::thread::scope(|s| {
        let inputs: Vec<_> = (0..ctx.shards.len())
            .map(|shard| s.spawn(move || run_inputs(ctx, shard)))
            .collect();
        let payer = s.spawn(|| {
            let mut problems = Vec::new();
            let paid = run_pays(ctx, &during, &mut problems);
            (paid, problems)
        });
        let _abort = AbortOnUnwind(&ctx.abort);
        let mut pg_restart: Option<std::thread::ScopedJoinHandle<()>> = None;
        for (i, (t, f)) in plan.faults.iter().enumerate() {
            workers.supervise_until(ctx.at(*t));
            let began = ctx.now();
            let what = f.describe(&plan.setup);
            match *f {
                Fault::DebugSleep => {
                    s.spawn(move || ctx.note_at(began, format!("{what}: {}", debug_sleep(ctx))));
                }
                Fault::StallMaster { shard } => {
                    s.spawn(move || {
                        ctx.note_at(began, format!("{what}: {}", stall_master(ctx, shard)))
                    });
                }
                Fault::ShopLock { table, at, secs } => {
                    s.spawn(move || {
                        let note = shop_lock(&pg.url, table, at, secs);
                        ctx.note_at(began, format!("{what}: {note} ({:.2}s)", ctx.now() - began));
                    });
                }
                Fault::RenameColumn | Fault::RestoreColumn => {
                    // A thread of its own: the ALTER waits for every transaction on
                    // orders (a shop lock's included) and must end in success; a restore
                    // started before its rename is done tries again until it is.
                    let sql = if matches!(f, Fault::RenameColumn) {
                        "ALTER TABLE orders RENAME COLUMN cancel_reason TO cancel_reason_chaos"
                    } else {
                        "ALTER TABLE orders RENAME COLUMN cancel_reason_chaos TO cancel_reason"
                    };
                    // Not joined here: a restore may have to wait for a server turned
                    // read-only, which a later fault of this loop turns writable again.
                    // The scope joins it before the drain and the books.
                    s.spawn(move || {
                        let note = until_done(&pg.url, &[sql]);
                        ctx.note_at(began, format!("{what}: {note} ({:.2}s)", ctx.now() - began));
                    });
                }
                Fault::PgTerminate { rounds } => {
                    s.spawn(move || {
                        let note = terminate_storm(&pg.url, rounds);
                        ctx.note_at(began, format!("{what}: {note} ({:.2}s)", ctx.now() - began));
                    });
                }
                Fault::PgRestart { down } => {
                    // One restart at a time.
                    if let Some(h) = pg_restart.take() {
                        if let Err(e) = h.join() {
                            std::panic::resume_unwind(e);
                        }
                    }
                    pg_restart = Some(s.spawn(move || {
                        pg.crash_restart(Duration::from_secs_f64(down));
                        ctx.note_at(began, format!("{what}: back ({:.2}s)", ctx.now() - began));
                    }));
                }
                _ => driver.execute(i, f, redis.as_mut(), pg, &mut workers),
            }
        }
        workers.supervise_until(ctx.at(plan.secs));
        driver.close();
        ctx.note("schedule over: faults stopped");
        let mut all = Inputs::default();
        for h in inputs {
            let mut one = h.join().expect("a producer thread panicked");
            all.recs.append(&mut one.recs);
            all.problems.append(&mut one.problems);
        }
        let inputs = all;
        let (paid, problems) = payer.join().expect("the payer thread panicked");
        (inputs, paid, problems)
    });
    paid.extend(paid_during);
    inputs.recs.append(&mut driver.producer.out.recs);
    problems.extend(inputs.problems);
    problems.append(&mut driver.producer.out.problems);
    problems.extend(pay_problems);

    // Drain: every non-dead worker back, until nothing is due, delivered or held.
    workers.revive_all();
    let (schedule_over, drain_began) = (ctx.now(), Instant::now());
    // What the drain still waited on 10 s in, if it did (said in the summary).
    let mut slow_drain = String::new();
    // Quiescent twice in a row: one reading takes its keys one after another, so a job
    // can pass between two of them unseen (settled from pending into the pool after the
    // pool was read); the next reading finds it where it went.
    let mut quiet = 0;
    let stuck = loop {
        workers.supervise();
        let busy = rcon(&ctx.redis_url)
            .and_then(|mut c| in_flight(ctx, &mut c))
            .unwrap_or_else(|e| vec![format!("redis: {e}")]);
        quiet = match busy.is_empty() && workers.all_up() {
            true => quiet + 1,
            false => 0,
        };
        if quiet == 2 {
            break None;
        }
        if slow_drain.is_empty() && drain_began.elapsed() > Duration::from_secs(10) {
            slow_drain = format!("; 10 s into the drain: {}", busy.join(", "));
            ctx.note(format!("the drain still waits on: {}", busy.join(", ")));
        }
        if drain_began.elapsed() > QUIESCE_TIMEOUT {
            break Some(format!(
                "still busy {QUIESCE_TIMEOUT:?} after the schedule: {}",
                busy.join(", ")
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    ctx.note(format!(
        "drain over after {:.1}s{}",
        drain_began.elapsed().as_secs_f64(),
        if stuck.is_none() {
            ": quiescent"
        } else {
            ": NOT quiescent"
        }
    ));
    let drained = drain_began.elapsed().as_secs_f64();
    workers.stop_all();
    ctx.note("every worker stopped");

    let mut f = Failures::default();
    if let Some(s) = stuck {
        f.add("the run never came to rest", s);
    }
    for p in problems {
        f.add("the harness could not deliver its inputs", p);
    }
    for a in &workers.anomalies {
        f.add("worker processes misbehaved", a.clone());
    }
    for p in workers.panics() {
        f.add("panics in the worker logs", p);
    }
    let (books, summary) = oracle(ctx, &db, &inputs.recs, &paid, &mut f);
    let starts: usize = workers.slots.iter().map(|s| s.starts).sum();
    let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, f) in &plan.faults {
        if !matches!(
            f,
            Fault::PgRelease
                | Fault::Restore(..)
                | Fault::ReshardStep { .. }
                | Fault::ReshardEnd { .. }
        ) {
            *tally.entry(f.kind()).or_default() += 1;
        }
    }
    let skipped = ctx
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.1.contains("skipped: not running"))
        .count();
    let tally: Vec<String> = tally.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let resharded = match driver.resharded.is_empty() {
        true => String::new(),
        false => format!("; resharded: {}", driver.resharded.join(", ")),
    };
    let result = format!(
        "chaos seed {seed} ({secs}s): {} in {:.0}s (the schedule over at +{schedule_over:.0}s, drained in {drained:.1}s{slow_drain}) — faults: {} ({} of them on a worker not running){resharded}; {}; {starts} worker starts, {} refused at start ({} by a SIGTERM interrupting the start checks)",
        if f.is_empty() { "PASS" } else { "FAIL" },
        began.elapsed().as_secs_f64(),
        tally.join(", "),
        skipped,
        summary,
        workers.refused.len(),
        workers
            .refused
            .iter()
            .filter(|r| r.contains("Interrupted system call"))
            .count(),
    );
    println!("{result}");
    drop(workers);
    if f.is_empty() {
        if std::env::var_os("DW_CHAOS_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return Ok(result);
    }
    let events = ctx.events();
    Err(format!(
        "{described}\nwhat happened:\n{events}\n\nbooks: {books}\n{result}\n\n{f}\nworker logs: {}\nreplay: {}",
        dir.display(),
        plan.replay()
    ))
}
