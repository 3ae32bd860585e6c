//! `worker bench`: how late and how fast the worker is, measured next to the machine's own
//! ceilings (issue 7). `scripts/bench.sh` sets up private durable servers and calls this.
//!
//! The worker under test is this very binary, started as a child process (`worker run`),
//! so what is measured is the release daemon exactly as an operator runs it; this process
//! only produces load, watches, and does the books afterwards. One scenario at a time:
//!
//! ```text
//!  reset + seed the shop (set-based SQL, sql/bench/seed.sql)
//!  push: paced producer (steady-*) | bulk push per shard before the start (backlog, engine)
//!  child `worker run --threads N`   ◀── sampled: VmRSS every 100 ms, CPU from /proc
//!  wait until the pool and the stream are drained (Redis), bounded by --timeout
//!  stop the child; lateness from worker_inbox.processed_at; accounting → PASS / FAIL
//! ```
//!
//! Ceilings in the same run: `redis-benchmark` XADD and `pgbench` running the very
//! transaction `order.timeout` runs, at the same concurrency (`ceiling.rs`).
//!
//! On a Redis Cluster (`--redis-url redis+cluster://...`) and with `--shards N` every
//! step works per shard (load, reset, the drain, the stream's move times), Redis CPU is
//! read from every master, and each scenario reports how its jobs spread over the shards
//! and the masters serving their slots. The report ends with the model: from this run's
//! CPU per job, what N worker hosts and M masters would carry, and the one PostgreSQL
//! primary that caps them (`report::Model`).
//!
//! Nothing here asserts a timing: figures are measurements. Only the accounting (every
//! unpaid order cancelled once, stock and coupons exact, nothing left behind) passes or
//! fails, and the exit status is 1 when a scenario fails it.
//!
//! **Destructive**: every scenario truncates the shop tables of `DATABASE_URL` and
//! deletes the queue keys in `REDIS_URL`, so the bench refuses a database whose name does
//! not contain `bench`.
//!
//! Layout: `scenario.rs` the five flows; `load.rs` producing; `shop.rs` seeding, lateness
//! and accounting in SQL; `child.rs` the worker process and the /proc and Redis probes;
//! `ceiling.rs` redis-benchmark and pgbench; `report.rs` the table and the JSON;
//! `poll.rs` the status page loaded once a second during a steady run (`--poll-status`).

mod ceiling;
mod child;
mod load;
mod poll;
mod report;
mod scenario;
mod shop;
mod traffic;

use anyhow::{bail, Context, Result};
use delay_worker::config::{redact_url, Config};
use delay_worker::{daemon, db, Shutdown};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The scenarios of issue 7.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// --rate messages/s for --duration, delays 1 s to --max-delay, millisecond scores.
    SteadyMs,
    /// The same with whole-second scores, as the PHP producer writes them.
    SteadyS,
    /// --backlog-jobs order cancellations, all due before the worker starts.
    Backlog,
    /// --engine-jobs no-op messages, all due: push, move, read, ack; no database work.
    Engine,
    /// steady-ms twice over an inbox holding --prune-rows old rows: without pruning, then
    /// while the worker prunes them (not run by default: the fill takes minutes).
    Prune,
    /// The shop's own transactions at --shop-rate alone, then while the worker drains
    /// --shop-backlog timeouts, then that drain without the shop (not run by default).
    Shop,
}

impl Scenario {
    /// What runs when no scenario is named.
    pub const DEFAULT: [Scenario; 4] = [
        Scenario::SteadyMs,
        Scenario::SteadyS,
        Scenario::Backlog,
        Scenario::Engine,
    ];
    pub const ALL: [Scenario; 6] = [
        Scenario::SteadyMs,
        Scenario::SteadyS,
        Scenario::Backlog,
        Scenario::Engine,
        Scenario::Prune,
        Scenario::Shop,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::SteadyMs => "steady-ms",
            Scenario::SteadyS => "steady-s",
            Scenario::Backlog => "backlog",
            Scenario::Engine => "engine",
            Scenario::Prune => "prune",
            Scenario::Shop => "shop",
        }
    }
}

/// Flags of `worker bench`. The worker's own flags (`--threads`, `--batch-size`,
/// `--poll-interval`, `--block`, `--statement-timeout`, key names) are the global ones and
/// are passed on to the worker under test.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Bench")]
pub struct BenchArgs {
    /// Scenario to run; repeat or separate with commas [default: all but prune].
    #[arg(
        long = "scenario",
        value_name = "NAME",
        value_enum,
        value_delimiter = ','
    )]
    pub scenarios: Vec<Scenario>,
    /// Run every scenario.
    #[arg(long, conflicts_with = "scenarios")]
    pub all: bool,
    /// Steady scenarios: how long the producer pushes.
    #[arg(long, default_value = "30s", value_parser = at_least_1s)]
    pub duration: Duration,
    /// Steady scenarios: messages pushed per second (5 % of them duplicates).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: u32,
    /// Steady scenarios: the longest delay; delays are uniform from 1 s to this.
    #[arg(long, default_value = "30s", value_parser = at_least_1s)]
    pub max_delay: Duration,
    /// Backlog scenario: order cancellations already due when the worker starts.
    #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub backlog_jobs: u64,
    /// Engine scenario: no-op messages already due when the worker starts.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub engine_jobs: u64,
    /// Prune scenario: old inbox rows written before the runs (2,000 a second's worth,
    /// a day older than --inbox-retention).
    #[arg(long, default_value_t = 10_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub prune_rows: u64,
    /// Prune scenario: the worker's --inbox-prune-interval (a pass works at most half of
    /// it); its batch and pause are the worker flags --inbox-prune-batch and -pause.
    #[arg(long, default_value = "10s", value_parser = at_least_1s)]
    pub prune_interval: Duration,
    /// Shop scenario: the shop's transactions a second (payments locking coupon, skus in
    /// descending id, then the order; checkouts; reads), all clients together.
    #[arg(long, default_value_t = 300.0)]
    pub shop_rate: f64,
    /// Shop scenario: the shop's connections, each with its share of --shop-rate.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub shop_clients: u32,
    /// Shop scenario: order timeouts that fall due at once while the shop runs.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub shop_backlog: u64,
    /// Shop scenario: the shop's own pending orders (never pushed), which it pays.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub shop_orders: u64,
    /// Shop scenario: how long the shop runs alone before the backlog falls due.
    #[arg(long, default_value = "10s", value_parser = at_least_1s)]
    pub shop_alone: Duration,
    /// Shop scenario: the backlog's due time this long before its push (a backlog after
    /// an outage): it falls due as it is pushed, and jobs past a minute overdue are the
    /// ones that wait a whole --lock-timeout. 0: pushed 3 s ahead of its due time.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub shop_overdue: Duration,
    /// SKUs the seeded orders' lines are spread over (fewer: more row-lock contention).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub skus: u32,
    /// How long a scenario may run past its last due time before it is reported FAIL.
    #[arg(long, default_value = "5m", value_parser = at_least_1s)]
    pub timeout: Duration,
    /// pgbench run time of the PostgreSQL ceiling.
    #[arg(long, default_value = "10s", value_parser = at_least_1s)]
    pub ceiling_time: Duration,
    /// Pending orders seeded for the pgbench ceiling; each transaction cancels its own.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub ceiling_orders: u64,
    /// Steady scenarios: the worker serves its status page (--metrics-addr on a free
    /// loopback port) and the bench loads `/` once a second for the whole run.
    #[arg(long)]
    pub poll_status: bool,
    /// Skip the redis-benchmark and pgbench ceilings.
    #[arg(long, conflicts_with = "ceilings")]
    pub no_ceilings: bool,
    /// Which ceilings to measure: redis (redis-benchmark XADD; on a Redis Cluster
    /// `--cluster`, over every master), pgbench (both pgbench runs); repeat or separate
    /// with commas [default: both].
    #[arg(long, value_name = "NAME", value_enum, value_delimiter = ',')]
    pub ceilings: Vec<CeilingKind>,
    /// Where the JSON report goes [default: target/bench/<UTC date-time>.json].
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
}

/// A ceiling `--ceilings` can choose.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CeilingKind {
    Redis,
    Pgbench,
}

impl BenchArgs {
    /// Whether this ceiling is measured.
    pub fn measures(&self, c: CeilingKind) -> bool {
        !self.no_ceilings && (self.ceilings.is_empty() || self.ceilings.contains(&c))
    }
}

/// The bench empties and reseeds the shop tables: it runs only on a database whose name
/// says it is a benchmark's (contains `bench`, as `scripts/bench.sh`'s `dw_bench`).
fn dedicated_database(url: &str) -> Result<()> {
    let cfg: postgres::Config = url.parse().context("DATABASE_URL")?;
    let name = cfg.get_dbname().unwrap_or("");
    anyhow::ensure!(
        name.contains("bench"),
        "refusing to run: the benchmark empties the shop tables of database {name:?}; give it a database of its own whose name contains \"bench\" (scripts/bench.sh uses dw_bench)"
    );
    Ok(())
}

/// A duration flag of the bench: whole scenarios, so at least a second.
fn at_least_1s(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 5s, 2m)"))?;
    if d < Duration::from_secs(1) {
        return Err("must be at least 1s".into());
    }
    Ok(d)
}

impl BenchArgs {
    fn selected(&self) -> Vec<Scenario> {
        if self.all {
            return Scenario::ALL.to_vec();
        }
        if self.scenarios.is_empty() {
            return Scenario::DEFAULT.to_vec();
        }
        let mut out = Vec::new();
        for s in &self.scenarios {
            if !out.contains(s) {
                out.push(*s);
            }
        }
        out
    }
}

/// The pid of the worker child while one runs, for the second-signal path (which exits
/// at once and so skips the child's `Drop`). Written by `child.rs`, read by the handler.
static CHILD_PID: AtomicU32 = AtomicU32::new(0);

/// Runs the selected scenarios, prints the table, writes the JSON. Exit status 1 when a
/// scenario's accounting failed (or it could not run); timings never fail the run.
pub fn run(config: &Config, args: &BenchArgs) -> Result<ExitCode> {
    dedicated_database(&config.database_url)?;
    let stop = Shutdown::new();
    {
        let stop = stop.clone();
        delay_worker::signals::on_stop(move || {
            if stop.trigger() {
                let pid = CHILD_PID.load(Ordering::SeqCst);
                if pid != 0 {
                    child::kill_now(pid);
                }
                eprintln!("worker bench: second signal, exiting now");
                std::process::exit(130);
            }
            eprintln!("worker bench: interrupted; stopping the worker (signal again to exit now)");
        })
        .context("cannot install the signal handler")?;
    }

    let redis = delay_worker::connect::redis_client(config)?;
    let mut pg = db::connect(&config.database_url)?;
    shop::check_database(&mut pg)?;
    daemon::check_schema(&config.database_url)?;
    shop::prepare_tables(&mut pg)?;

    let out = match &args.out {
        Some(p) => p.clone(),
        None => PathBuf::from("target/bench").join(format!("{}.json", report::file_stamp())),
    };
    let out_dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("--out: cannot create {}", out_dir.display()))?;

    let env = report::Environment::read(config, &redis, &mut pg, args);
    env.print_header();

    let ceilings = ceiling::measure(config, args, &mut pg, &redis, &out_dir, &stop)?;
    ceilings.print();

    let shards = config.shard_keys();
    let ctx = scenario::Ctx {
        config,
        args,
        redis: &redis,
        shards: &shards,
        ceilings: &ceilings,
        out_dir: &out_dir,
        stop: &stop,
    };
    let mut results = Vec::new();
    for s in args.selected() {
        if stop.is_set() {
            bail!("interrupted");
        }
        println!("running {} ...", s.name());
        for r in scenario::run(&ctx, &mut pg, s) {
            println!("  {}: {}", r.name, r.one_line());
            results.push(r);
        }
    }
    if stop.is_set() {
        bail!("interrupted");
    }
    burst_note(&mut results, args);

    let report = report::Report::new(env, ceilings, results);
    report.print_table();
    report.write_json(&out)?;
    println!("JSON: {}", out.display());
    Ok(if report.all_passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Next to steady-s: how long one second's burst takes at the backlog's rate, the yardstick
/// of issue 7 for its p99 (a reference figure, not a check).
fn burst_note(results: &mut [report::ScenarioResult], args: &BenchArgs) {
    let backlog = results
        .iter()
        .find(|r| r.name == Scenario::Backlog.name())
        .and_then(|r| r.jobs_per_s);
    if let (Some(rate), Some(s)) = (
        backlog,
        results
            .iter_mut()
            .find(|r| r.name == Scenario::SteadyS.name()),
    ) {
        s.notes.push(format!(
            "one second's burst ({} jobs) takes {:.0} ms at the backlog rate",
            args.rate,
            args.rate as f64 * 1000.0 / rate
        ));
    }
}

/// The command line as given, URLs without their passwords (for the report).
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if a.contains("://") || a.contains("password=") {
                redact_url(&a)
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
