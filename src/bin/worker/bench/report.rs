//! What the bench reports: the environment (date, machine, servers, settings), the
//! ceilings, one [`ScenarioResult`] per scenario; printed as a table and written as JSON
//! (the same structs, serialized).

use super::ceiling::{Ceilings, SET_ORDERS};
use super::child::QueueState;
use super::shop::{Books, Lateness};
use super::BenchArgs;
use anyhow::{Context, Result};
use delay_worker::config::Config;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    /// UTC, ISO 8601.
    pub date: String,
    pub command: String,
    pub worker_version: String,
    /// `git describe`-like commit of the working tree, when there is one.
    pub git: Option<String>,
    pub nproc: usize,
    /// /proc/loadavg's 1, 5 and 15 minute figures when the bench started: how quiet the
    /// machine was.
    pub load_average: String,
    pub cpu_model: String,
    pub memory_mb: u64,
    pub kernel: String,
    pub redis_version: String,
    /// `server` or `cluster`, and the masters the bench found (1 for one server).
    pub redis_topology: String,
    pub redis_masters: usize,
    /// `--shards` and `--key-prefix` of the worker under test.
    pub shards: usize,
    pub key_prefix: String,
    pub postgres_version: String,
    /// PostgreSQL durability settings: the figures mean what they say only with fsync on.
    pub postgres_settings: BTreeMap<String, String>,
    pub threads: usize,
    pub tx_batch: usize,
    pub batch_size: usize,
    pub poll_interval_ms: u128,
    pub move_window_ms: u128,
    pub set_size: usize,
    pub rate: u32,
    pub duration_s: f64,
    pub max_delay_s: f64,
    pub skus: u32,
    /// Where lateness is measured to, and its caveat.
    pub lateness_note: String,
}

impl Environment {
    pub fn read(
        config: &Config,
        redis: &delay_worker::store::Redis,
        db: &mut postgres::Client,
        args: &BenchArgs,
    ) -> Environment {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == "model name").then(|| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let memory_mb = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            })
            .map(|kb| kb / 1024)
            .unwrap_or(0);
        let mut con = redis.connect().ok();
        let redis_version = con
            .as_mut()
            .and_then(|c| super::child::info_by_node(c, "server").ok())
            .and_then(|nodes| {
                let mut v: Vec<String> = nodes
                    .values()
                    .filter_map(|i| super::child::info_field(i, "redis_version"))
                    .map(str::to_string)
                    .collect();
                v.dedup();
                (!v.is_empty()).then(|| v.join(", "))
            })
            .unwrap_or_else(|| "unknown".into());
        let redis_masters = con
            .as_mut()
            .and_then(|c| super::child::masters(c).ok())
            .map_or(0, |m| m.len());
        let show = |db: &mut postgres::Client, name: &str| -> String {
            db.query_one(&format!("SHOW {name}"), &[])
                .map(|r| r.get::<_, String>(0))
                .unwrap_or_else(|_| "?".into())
        };
        let postgres_version = show(db, "server_version");
        let mut postgres_settings = BTreeMap::new();
        for s in [
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "shared_buffers",
            "max_connections",
        ] {
            postgres_settings.insert(s.to_string(), show(db, s));
        }
        let git = std::process::Command::new("git")
            .args(["describe", "--always", "--dirty"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        Environment {
            date: utc(delay_worker::now_ms() / 1000, true),
            command: super::command_line(),
            worker_version: env!("CARGO_PKG_VERSION").to_string(),
            git,
            load_average: std::fs::read_to_string("/proc/loadavg")
                .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
                .unwrap_or_default(),
            nproc: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            memory_mb,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            redis_version,
            redis_topology: match redis.topology() {
                delay_worker::store::Topology::Cluster => "cluster",
                delay_worker::store::Topology::Sentinel => "sentinel",
                delay_worker::store::Topology::Single => "server",
            }
            .into(),
            redis_masters,
            shards: config.shards,
            key_prefix: config.shard_prefix.clone(),
            postgres_version,
            postgres_settings,
            threads: config.threads,
            tx_batch: config.jobs.tx_batch,
            batch_size: config.mover.batch,
            poll_interval_ms: config.mover.poll.as_millis(),
            move_window_ms: config.mover.window.as_millis(),
            set_size: config.jobs.set_size,
            rate: args.rate,
            duration_s: args.duration.as_secs_f64(),
            max_delay_s: args.max_delay.as_secs_f64(),
            skus: args.skus,
            lateness_note: "lateness = worker_inbox.processed_at (the job's transaction start, \
                            just before its commit) minus the due time the bench pushed; \
                            backlog: minus the worker's start (every job was already due)"
                .into(),
        }
    }

    pub fn print_header(&self) {
        println!(
            "delay-worker bench {}  {}{}",
            self.worker_version,
            self.date,
            self.git
                .as_deref()
                .map(|g| format!("  git {g}"))
                .unwrap_or_default()
        );
        println!(
            "machine: {} × {}, {} MB RAM, Linux {}; load average {}",
            self.nproc, self.cpu_model, self.memory_mb, self.kernel, self.load_average
        );
        let s = &self.postgres_settings;
        let get = |k: &str| s.get(k).map(String::as_str).unwrap_or("?");
        println!(
            "servers: Redis {} ({}), PostgreSQL {} (fsync={}, synchronous_commit={}, shared_buffers={})",
            self.redis_version,
            if self.redis_topology == "cluster" {
                format!("a cluster of {} masters", self.redis_masters)
            } else {
                format!("one {}", self.redis_topology)
            },
            self.postgres_version,
            get("fsync"),
            get("synchronous_commit"),
            get("shared_buffers")
        );
        println!(
            "worker: --key-prefix {} --shards {} --threads {} --tx-batch {} --set-size {} --batch-size {} --poll-interval {}ms --move-window {}ms",
            self.key_prefix,
            self.shards,
            self.threads,
            self.tx_batch,
            self.set_size,
            self.batch_size,
            self.poll_interval_ms,
            self.move_window_ms
        );
        println!("command: {}", self.command);
    }
}

/// What a run measured of the two servers alone, as the report prints it.
impl Ceilings {
    pub fn print(&self) {
        match (self.redis_xadd_per_s, &self.redis_error) {
            (Some(v), _) => println!(
                "ceiling: redis XADD {}/s ({})",
                n0(v),
                self.redis_xadd_command
                    .as_deref()
                    .unwrap_or("redis-benchmark")
            ),
            (None, Some(e)) => println!("ceiling: redis XADD unavailable: {e}"),
            _ => {}
        }
        match (&self.pgbench, &self.pgbench_error) {
            (Some(p), _) => {
                println!(
                    "ceiling: pgbench order.timeout {} tps ({} clients, avg latency {} ms; {} of {} transactions cancelled an order, {} failed; warm-up run {} tps)",
                    n0(p.tps),
                    p.clients,
                    p.latency_avg_ms.map(|v| format!("{v:.2}")).unwrap_or("?".into()),
                    p.cancelled,
                    p.transactions,
                    p.failed,
                    p.warmup_tps.map(n0).unwrap_or("-".into())
                );
                if p.cancelled < p.transactions {
                    println!("  note: some transactions found no pending order left; raise --ceiling-orders");
                }
            }
            (None, Some(e)) => println!("ceiling: pgbench unavailable: {e}"),
            _ => {}
        }
        match (&self.pgbench_set, &self.pgbench_set_error) {
            (Some(p), _) => println!(
                "ceiling: pgbench order.timeout in sets of {} {} tps = {} orders/s ({} clients, avg latency {} ms; {} of {} orders cancelled, {} failed; warm-up run {} tps)",
                SET_ORDERS,
                n0(p.tps),
                n0(p.tps * SET_ORDERS as f64),
                p.clients,
                p.latency_avg_ms.map(|v| format!("{v:.2}")).unwrap_or("?".into()),
                p.cancelled,
                p.transactions * SET_ORDERS as i64,
                p.failed,
                p.warmup_tps.map(n0).unwrap_or("-".into())
            ),
            (None, Some(e)) => println!("ceiling: pgbench sets unavailable: {e}"),
            _ => {}
        }
    }
}

/// CPU used while a scenario ran.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CpuUse {
    /// The worker process, from its start to the moment everything was done.
    pub worker_s: f64,
    /// The worker's CPU by thread role (workers, reader, mover, other).
    pub worker_threads_s: BTreeMap<String, f64>,
    /// This bench process (the producer) over the same span.
    pub bench_s: Option<f64>,
    /// Every Redis server together (on a Redis Cluster, the sum over its masters).
    pub redis_s: Option<f64>,
    /// Each server's part, by node (`redis` for one server, `host:port` of each master).
    pub redis_by_node_s: BTreeMap<String, f64>,
    pub postgres_s: Option<f64>,
    /// The whole machine's busy share over the span, all cores (100 % = every core busy).
    pub machine_busy_pct: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Producer {
    pub target_rate: f64,
    pub achieved_rate: f64,
    pub max_behind_ms: f64,
    pub duplicates: u64,
    pub paid: u64,
    pub pay_max_lag_ms: f64,
}

/// The prune scenario's figures: what the worker pruned while the steady load ran, and
/// the load's lateness p99 next to the same run without pruning.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PruneFigures {
    /// Inbox rows older than the retention when the run started, pruned during it, left.
    pub rows_before: u64,
    pub pruned: u64,
    pub remaining: u64,
    /// From the first pass (one interval after the worker was ready) to the worker's
    /// stop: what `rows_per_s` is counted over (passes and the waits between them).
    pub pruning_s: f64,
    pub rows_per_s: f64,
    /// Within the passes alone (batches and pauses), from the worker's log lines.
    pub passes_rows_per_s: Option<f64>,
    pub p99_without_ms: Option<f64>,
    pub p99_with_ms: Option<f64>,
    pub p99_delta_ms: Option<f64>,
    /// How long the one INSERT of the old rows took.
    pub fill_s: f64,
    /// The worker's --inbox-prune-batch, --inbox-prune-pause, --inbox-prune-interval.
    pub batch: usize,
    pub pause_ms: f64,
    pub interval_s: f64,
}

/// One shard's share of a scenario's work.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShardLoad {
    pub shard: usize,
    /// Its pool's key and hash slot, and the master serving that slot.
    pub pool: String,
    pub slot: u16,
    pub master: String,
    /// Stream entries its group was given (each job once, a retry again).
    pub jobs: u64,
}

/// One master's share: the jobs of its shards and the CPU its server used meanwhile.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MasterLoad {
    pub addr: String,
    pub shards: Vec<usize>,
    pub jobs: u64,
    pub redis_cpu_s: Option<f64>,
    /// CPU milliseconds per job of its shards.
    pub redis_cpu_ms_per_job: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Spread {
    pub shards: Vec<ShardLoad>,
    pub masters: Vec<MasterLoad>,
    /// The busiest shard's jobs over the idlest's (1.0 is even).
    pub shard_max_over_min: Option<f64>,
    /// The same for masters: the busiest master is the one that limits a cluster.
    pub master_max_over_min: Option<f64>,
    /// The busiest master's share of all jobs (1 ÷ masters when even).
    pub busiest_master_share: Option<f64>,
}

impl Spread {
    /// Builds the figures from each shard's jobs, the masters and each node's CPU.
    pub fn new(
        shards: &[delay_worker::keys::Keys],
        jobs: &[u64],
        masters: &[super::child::Master],
        cpu_by_node: &BTreeMap<String, f64>,
    ) -> Spread {
        let mut out = Spread::default();
        for (i, (k, n)) in shards.iter().zip(jobs).enumerate() {
            let slot = delay_worker::keys::slot(&k.pool);
            let master = masters
                .iter()
                .find(|m| m.serves(slot))
                .map_or("?".to_string(), |m| m.addr.clone());
            out.shards.push(ShardLoad {
                shard: i,
                pool: k.pool.clone(),
                slot,
                master,
                jobs: *n,
            });
        }
        for m in masters {
            let mine: Vec<&ShardLoad> = out.shards.iter().filter(|s| s.master == m.addr).collect();
            let jobs: u64 = mine.iter().map(|s| s.jobs).sum();
            // A node that has never met another one lists itself as ":port" in CLUSTER
            // NODES; INFO's replies name it by the address the client reached it at.
            let (addr, cpu) = match cpu_by_node.get(&m.addr) {
                Some(c) => (m.addr.clone(), Some(*c)),
                None if m.addr.starts_with(':') => cpu_by_node
                    .iter()
                    .find(|(node, _)| node.ends_with(&m.addr))
                    .map_or((m.addr.clone(), None), |(node, c)| (node.clone(), Some(*c))),
                None => (m.addr.clone(), None),
            };
            out.masters.push(MasterLoad {
                addr,
                shards: mine.iter().map(|s| s.shard).collect(),
                jobs,
                redis_cpu_s: cpu,
                redis_cpu_ms_per_job: cpu.filter(|_| jobs > 0).map(|c| c * 1000.0 / jobs as f64),
            });
        }
        for (m, resolved) in masters.iter().zip(&out.masters) {
            for sh in out.shards.iter_mut().filter(|s| s.master == m.addr) {
                sh.master = resolved.addr.clone();
            }
        }
        let ratio = |v: Vec<u64>| {
            let (max, min) = (v.iter().max()?, v.iter().min()?);
            (*min > 0).then(|| *max as f64 / *min as f64)
        };
        out.shard_max_over_min = ratio(out.shards.iter().map(|s| s.jobs).collect());
        out.master_max_over_min = ratio(out.masters.iter().map(|m| m.jobs).collect());
        let total: u64 = out.masters.iter().map(|m| m.jobs).sum();
        out.busiest_master_share = out
            .masters
            .iter()
            .map(|m| m.jobs)
            .max()
            .filter(|_| total > 0)
            .map(|m| m as f64 / total as f64);
        out
    }

    fn lines(&self) -> Vec<String> {
        let opt2 = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        let (min, max) = (
            self.shards.iter().map(|s| s.jobs).min().unwrap_or(0),
            self.shards.iter().map(|s| s.jobs).max().unwrap_or(0),
        );
        let mut out = vec![format!(
            "spread: {} shards on {} masters; jobs per shard min {} max {} (max/min {}); per master max/min {}",
            self.shards.len(),
            self.masters.len(),
            n0(min as f64),
            n0(max as f64),
            opt2(self.shard_max_over_min),
            opt2(self.master_max_over_min)
        )];
        for m in &self.masters {
            out.push(format!(
                "master {}: shards {:?}, {} jobs, Redis CPU {} s = {} ms per job",
                m.addr,
                m.shards,
                n0(m.jobs as f64),
                opt2(m.redis_cpu_s),
                m.redis_cpu_ms_per_job
                    .map_or("-".to_string(), |v| format!("{v:.4}"))
            ));
        }
        out
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ScenarioResult {
    pub name: String,
    /// Job keys pushed.
    pub jobs: u64,
    /// Orders pushed (duplicates excluded); 0 for engine.
    pub orders: u64,
    pub producer: Option<Producer>,
    pub lateness: Option<Lateness>,
    /// Jobs per second: first to last commit (order scenarios) or first move to drained
    /// (engine).
    pub jobs_per_s: Option<f64>,
    /// From the worker's start (backlog, engine) or the last due time (steady) to drained.
    pub drain_s: Option<f64>,
    /// What `drain_s` is counted from: "worker start" or "last due time".
    pub drain_from: Option<String>,
    /// `jobs_per_s` over its ceiling: backlog ÷ pgbench tps, engine ÷ redis XADD/s.
    pub ceiling_ratio: Option<f64>,
    /// Backlog only: `jobs_per_s` over the set-based pgbench ceiling (orders/s).
    pub set_ceiling_ratio: Option<f64>,
    pub ceiling: Option<String>,
    pub cpu: CpuUse,
    pub cpu_s_per_1k_jobs: Option<f64>,
    /// Largest VmRSS sampled every 100 ms, and VmHWM at the end, in kB.
    pub rss_peak_kb: Option<u64>,
    pub rss_hwm_kb: Option<u64>,
    /// Largest VmRSS of each second of the run, kB: flat or growing.
    pub rss_per_s_kb: Vec<u64>,
    pub books: Option<Books>,
    pub queue_after: Option<QueueState>,
    pub seed_s: Option<f64>,
    pub push_s: Option<f64>,
    /// The prune scenario's run with pruning.
    pub prune: Option<PruneFigures>,
    /// How the work spread over the shards and the masters holding them (shown for a
    /// Redis Cluster or `--shards` above 1).
    pub spread: Option<Spread>,
    /// The shop scenario: the shop's own figures alone and while the worker drained.
    pub shop: Option<ShopFigures>,
    pub pass: bool,
    /// Why it failed; empty on PASS.
    pub problems: Vec<String>,
    /// Observations worth reading next to the figures.
    pub notes: Vec<String>,
}

impl ScenarioResult {
    pub fn failed(name: &str, why: String) -> ScenarioResult {
        ScenarioResult {
            name: name.to_string(),
            pass: false,
            problems: vec![why],
            ..Default::default()
        }
    }

    pub fn one_line(&self) -> String {
        let mut s = format!(
            "{}: {} jobs, {} jobs/s",
            if self.pass { "PASS" } else { "FAIL" },
            self.jobs,
            self.jobs_per_s.map(n0).unwrap_or("-".into())
        );
        if let Some(l) = &self.lateness {
            s.push_str(&format!(
                ", lateness p50 {} p99 {} max {} ms",
                ms(l.p50_ms),
                ms(l.p99_ms),
                ms(l.max_ms)
            ));
        }
        for p in &self.problems {
            s.push_str(&format!("; {p}"));
        }
        s
    }
}

/// N worker hosts and M Redis masters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Deployment {
    pub hosts: u32,
    pub masters: u32,
    /// Jobs a second without database work: min(N × host (engine), M × master × balance).
    pub queue_jobs_per_s: f64,
    /// Order cancellations a second: min(N × host (backlog), M × master × balance, the
    /// primary); absent without a backlog run.
    pub orders_per_s: Option<f64>,
}

/// What N worker hosts and M Redis masters would carry, from CPU per job: a master runs
/// its commands on one core, so it carries 1 ÷ (Redis CPU per job) jobs a second of its
/// shards' work; a worker host with K cores carries K ÷ (worker CPU per job); every job's
/// transaction commits on the one PostgreSQL primary, which no shard count divides.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Model {
    /// Redis CPU ms per job, over every master: the engine scenario (move, read, ack at
    /// full speed), the backlog scenario (the same for order cancellations).
    pub redis_ms_per_job: Option<f64>,
    pub redis_ms_per_job_backlog: Option<f64>,
    /// The engine's busiest master per job of its own shards.
    pub redis_ms_per_job_busiest_master: Option<f64>,
    /// Worker CPU ms per job: backlog (order.timeout, the real work) and engine (no-op).
    pub worker_ms_per_job: Option<f64>,
    pub worker_ms_per_job_engine: Option<f64>,
    /// PostgreSQL CPU ms per job (backlog).
    pub postgres_ms_per_job: Option<f64>,
    /// Jobs a second one master, one worker host (of this machine's cores) and the
    /// primary's CPU (the same cores) would carry.
    pub per_master_jobs_per_s: Option<f64>,
    pub per_host_jobs_per_s: Option<f64>,
    /// What the one worker process of this run moved (engine): its reader and its mover
    /// each make one round trip at a time, so a host reaches its CPU figure only with
    /// several processes.
    pub one_process_jobs_per_s: Option<f64>,
    pub primary_cpu_jobs_per_s: Option<f64>,
    /// The primary's measured ceilings on this machine (pgbench, one order per
    /// transaction and sets of 8).
    pub primary_pgbench_tps: Option<f64>,
    pub primary_pgbench_set_orders_per_s: Option<f64>,
    /// What the primary carried in this run's backlog scenario (the worker's sets of up
    /// to --set-size and group commit), sharing this machine's cores with the rest.
    pub primary_backlog_jobs_per_s: Option<f64>,
    /// The figure the deployments are capped at: the highest of the three measured above
    /// (else the CPU figure), and which one it is.
    pub primary_jobs_per_s: Option<f64>,
    pub primary_basis: String,
    /// Mean over busiest master load (1.0 even), measured when the run had several masters.
    pub master_balance: Option<f64>,
    pub host_cores: usize,
    /// A few deployments and what they would carry.
    pub deployments: Vec<Deployment>,
    pub lines: Vec<String>,
}

impl Model {
    pub fn new(
        env: &Environment,
        ceilings: &Ceilings,
        scenarios: &[ScenarioResult],
    ) -> Option<Model> {
        let find = |name: &str| {
            scenarios
                .iter()
                .find(|s| s.name == name && s.pass && s.jobs > 0)
        };
        let engine = find("engine");
        let backlog = find("backlog");
        if engine.is_none() && backlog.is_none() {
            return None;
        }
        let per_job = |s: Option<&ScenarioResult>, f: fn(&CpuUse) -> Option<f64>| {
            s.and_then(|s| f(&s.cpu).map(|c| c * 1000.0 / s.jobs as f64))
        };
        let k = env.nproc.max(1);
        let mut m = Model {
            redis_ms_per_job: per_job(engine, |c| c.redis_s),
            redis_ms_per_job_backlog: per_job(backlog, |c| c.redis_s),
            redis_ms_per_job_busiest_master: engine.and_then(|e| {
                let sp = e.spread.as_ref()?;
                let busiest = sp.masters.iter().max_by_key(|m| m.jobs)?;
                busiest.redis_cpu_ms_per_job
            }),
            worker_ms_per_job: per_job(backlog, |c| Some(c.worker_s)),
            one_process_jobs_per_s: engine.and_then(|e| e.jobs_per_s),
            worker_ms_per_job_engine: per_job(engine, |c| Some(c.worker_s)),
            postgres_ms_per_job: per_job(backlog, |c| c.postgres_s),
            primary_pgbench_tps: ceilings.pgbench_tps(),
            primary_pgbench_set_orders_per_s: ceilings.pgbench_set_orders_per_s(),
            master_balance: engine.and_then(|e| {
                let sp = e.spread.as_ref()?;
                (sp.masters.len() > 1)
                    .then(|| Some(1.0 / sp.masters.len() as f64 / sp.busiest_master_share?))?
            }),
            host_cores: k,
            ..Default::default()
        };
        let rate = |ms: Option<f64>, cores: usize| {
            ms.filter(|v| *v > 0.0).map(|v| cores as f64 * 1000.0 / v)
        };
        let redis_ms = m
            .redis_ms_per_job_busiest_master
            .or(m.redis_ms_per_job)
            .or(m.redis_ms_per_job_backlog);
        m.per_master_jobs_per_s = rate(redis_ms, 1);
        m.per_host_jobs_per_s = rate(m.worker_ms_per_job.or(m.worker_ms_per_job_engine), k);
        m.primary_cpu_jobs_per_s = rate(m.postgres_ms_per_job, k);
        m.primary_backlog_jobs_per_s = backlog.and_then(|b| b.jobs_per_s);
        // The primary's figure: the most it was measured to carry on this machine.
        let measured = [
            (m.primary_backlog_jobs_per_s, "the worker's backlog"),
            (m.primary_pgbench_set_orders_per_s, "pgbench in sets"),
            (m.primary_pgbench_tps, "pgbench one order per transaction"),
        ];
        let best = measured
            .iter()
            .filter_map(|(v, what)| v.map(|v| (v, *what)))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let (primary, basis) = match (best, m.primary_cpu_jobs_per_s) {
            (Some((v, what)), _) => (Some(v), what),
            (None, Some(c)) => (Some(c), "its CPU per job"),
            (None, None) => (None, "not measured"),
        };
        m.primary_jobs_per_s = primary;
        m.primary_basis = basis.to_string();
        let balance = m.master_balance.unwrap_or(1.0);
        let engine_host = rate(m.worker_ms_per_job_engine, k);
        let backlog_host = rate(m.worker_ms_per_job, k);
        if let (Some(host), Some(master)) = (engine_host, m.per_master_jobs_per_s) {
            for (n, mm) in [(1u32, 1u32), (2, 3), (4, 3), (8, 6)] {
                let masters = mm as f64 * master * if mm > 1 { balance } else { 1.0 };
                m.deployments.push(Deployment {
                    hosts: n,
                    masters: mm,
                    queue_jobs_per_s: (n as f64 * host).min(masters),
                    orders_per_s: backlog_host.map(|h| {
                        let c = (n as f64 * h).min(masters);
                        primary.map_or(c, |p| c.min(p))
                    }),
                });
            }
        }
        m.lines = m.describe();
        Some(m)
    }

    fn describe(&self) -> Vec<String> {
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
        let rate = |v: Option<f64>| v.map_or("-".to_string(), n0);
        let k = self.host_cores;
        let mut out = vec![
            format!(
                "Redis: {} ms CPU per job over every master (engine: move, read, ack{}; backlog {}) → one master carries ~{} jobs/s",
                ms(self.redis_ms_per_job),
                self.redis_ms_per_job_busiest_master
                    .map_or(String::new(), |v| format!("; the busiest master {v:.4} per job of its shards")),
                ms(self.redis_ms_per_job_backlog),
                rate(self.per_master_jobs_per_s)
            ),
            format!(
                "worker: {} ms CPU per job (backlog, order.timeout; engine {}) → one {k}-core host carries ~{} jobs/s, with several worker processes: the one process of this run moved {} jobs/s (engine), its reader and mover making one round trip at a time",
                ms(self.worker_ms_per_job),
                ms(self.worker_ms_per_job_engine),
                rate(self.per_host_jobs_per_s),
                rate(self.one_process_jobs_per_s)
            ),
            format!(
                "PostgreSQL: {} ms CPU per job (backlog) → a primary of its own with {k} cores ~{} jobs/s by CPU; measured on this machine, sharing its cores: pgbench {} tps one order per transaction, {} orders/s in sets of {}, the worker's backlog {} jobs/s",
                ms(self.postgres_ms_per_job),
                rate(self.primary_cpu_jobs_per_s),
                rate(self.primary_pgbench_tps),
                rate(self.primary_pgbench_set_orders_per_s),
                SET_ORDERS,
                rate(self.primary_backlog_jobs_per_s)
            ),
        ];
        if !self.deployments.is_empty() {
            let list = self
                .deployments
                .iter()
                .map(|d| {
                    format!(
                        "N={} M={}: {}{}",
                        d.hosts,
                        d.masters,
                        n0(d.queue_jobs_per_s),
                        d.orders_per_s
                            .map_or(String::new(), |o| format!(" / {}", n0(o)))
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            out.push(format!(
                "N worker hosts ({k} cores each) and M masters (balance {}) carry, jobs/s without database work / order cancellations (capped by the primary): {list}",
                self.master_balance.map_or(
                    "1, assumed: one master in this run".to_string(),
                    |b| format!("{b:.2} measured: mean over busiest master")
                )
            ));
        }
        out.push(format!(
            "the one real limit: one PostgreSQL primary (every job's transaction commits there; shards, masters and worker hosts do not divide it): {} jobs/s on this machine's {k} cores ({})",
            rate(self.primary_jobs_per_s),
            self.primary_basis
        ));
        out
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub environment: Environment,
    pub ceilings: Ceilings,
    pub scenarios: Vec<ScenarioResult>,
    /// Capacity beyond this machine, from this run's CPU per job (when engine or
    /// backlog ran).
    pub model: Option<Model>,
}

impl Report {
    pub fn new(
        environment: Environment,
        ceilings: Ceilings,
        scenarios: Vec<ScenarioResult>,
    ) -> Report {
        let model = Model::new(&environment, &ceilings, &scenarios);
        Report {
            environment,
            ceilings,
            scenarios,
            model,
        }
    }

    pub fn all_passed(&self) -> bool {
        self.scenarios.iter().all(|s| s.pass)
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        let f = std::fs::File::create(path)
            .with_context(|| format!("--out: cannot write {}", path.display()))?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(f), self)
            .with_context(|| format!("cannot write {}", path.display()))
    }

    pub fn print_table(&self) {
        println!();
        println!(
            "{:<10} {:>7} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>6}",
            "scenario",
            "jobs",
            "produced/s",
            "jobs/s",
            "×ceiling",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "max ms",
            "CPU s/1k",
            "RSS MB",
            "books"
        );
        for s in &self.scenarios {
            let l = s.lateness.as_ref();
            let lat = |f: fn(&Lateness) -> f64| l.map(|l| ms(f(l))).unwrap_or("-".into());
            println!(
                "{:<10} {:>7} {:>11} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>6}",
                s.name,
                s.jobs,
                s.producer
                    .as_ref()
                    .map(|p| n0(p.achieved_rate))
                    .unwrap_or("-".into()),
                s.jobs_per_s.map(n0).unwrap_or("-".into()),
                s.ceiling_ratio
                    .map(|r| format!("{r:.2}"))
                    .unwrap_or("-".into()),
                lat(|l| l.p50_ms),
                lat(|l| l.p95_ms),
                lat(|l| l.p99_ms),
                lat(|l| l.max_ms),
                s.cpu_s_per_1k_jobs
                    .map(|c| format!("{c:.3}"))
                    .unwrap_or("-".into()),
                s.rss_peak_kb
                    .map(|kb| format!("{:.1}", kb as f64 / 1024.0))
                    .unwrap_or("-".into()),
                if s.pass { "PASS" } else { "FAIL" }
            );
        }
        println!();
        if let Some(p) = &self.ceilings.pgbench {
            println!(
                "ceilings: pgbench order.timeout {} tps at {} clients; in sets of {}: {} orders/s; redis XADD {}/s",
                n0(p.tps),
                p.clients,
                SET_ORDERS,
                self.ceilings
                    .pgbench_set_orders_per_s()
                    .map(n0)
                    .unwrap_or("-".into()),
                self.ceilings.redis_xadd_per_s.map(n0).unwrap_or("-".into())
            );
        } else if let Some(x) = self.ceilings.redis_xadd_per_s {
            println!("ceilings: redis XADD {}/s; pgbench unavailable", n0(x));
        }
        println!("{}", self.environment.lateness_note);
        for s in &self.scenarios {
            println!("{}:", s.name);
            for line in s.details() {
                println!("  {line}");
            }
        }
        if let Some(m) = &self.model {
            println!("model (CPU per job measured in this run; a Redis master runs commands on one core, a worker host uses all its cores):");
            for line in &m.lines {
                println!("  {line}");
            }
        }
    }
}

/// The shop scenario's figures: the shop alone, the shop during the drain, and the drain
/// with and without the shop beside it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShopFigures {
    pub alone: super::traffic::Figures,
    pub during: super::traffic::Figures,
    /// Jobs a second of the drain beside the shop, and of the same drain without it.
    pub drain_per_s: Option<f64>,
    pub drain_alone_per_s: Option<f64>,
    /// The targets: the shop keeps >= 95 % of its offered rate and a p99 within 2x of its
    /// p99 alone while the worker drains, and the drain keeps >= 0.5x its rate alone.
    pub kept_share: f64,
    pub p99_ratio: f64,
    pub drain_ratio: Option<f64>,
    /// The first errors of the shop's failed transactions.
    pub errors: Vec<String>,
    /// The shop beside the drain's database work alone, the machine's own figure.
    pub pgbench: Option<ShopPgbench>,
    pub pgbench_error: Option<String>,
}

/// The shop beside pgbench running the worker's set transaction at the drain's rate from
/// one client (`scenario.rs`, `shop_beside_pgbench`), in a run of its own.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ShopPgbench {
    /// Orders pgbench cancelled a second, `size` a transaction, for `seconds`.
    pub orders_per_s: f64,
    pub size: u64,
    pub seconds: u64,
    /// The shop before pgbench started (its own alone figure) and while it ran.
    pub alone: super::traffic::Figures,
    pub during: super::traffic::Figures,
    pub p99_ratio: f64,
    /// PostgreSQL's CPU seconds and the machine's busy share while pgbench ran.
    pub postgres_s: Option<f64>,
    pub machine_busy_pct: Option<f64>,
    pub errors: Vec<String>,
    pub command: String,
}

impl ShopFigures {
    fn lines(&self) -> Vec<String> {
        let f = |x: &super::traffic::Figures| {
            format!(
                "{} tx/s of {} offered, p50 {} / p99 {} / max {} ms, {} failed",
                n0(x.done_per_s),
                n0(x.offered_per_s),
                ms(x.p50_ms),
                ms(x.p99_ms),
                ms(x.max_ms),
                x.failed
            )
        };
        let met = |ok: bool| if ok { "met" } else { "NOT met" };
        let mut out = vec![
            format!("shop alone ({:.0} s): {}", self.alone.seconds, f(&self.alone)),
            format!(
                "shop while the worker drains ({:.1} s): {}",
                self.during.seconds,
                f(&self.during)
            ),
            format!(
                "  by kind, p50 / p99 ms alone -> while draining: {}",
                self.alone
                    .by_kind
                    .iter()
                    .zip(&self.during.by_kind)
                    .map(|((k, a50, a99), (_, d50, d99))| format!(
                        "{k} {} / {} -> {} / {}",
                        ms(*a50),
                        ms(*a99),
                        ms(*d50),
                        ms(*d99)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            format!(
                "  p99 ms in each second of the drain: {}",
                self.during
                    .p99_by_second
                    .iter()
                    .map(|x| ms(*x))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            format!(
                "targets: the shop keeps {:.0} % of its rate (>= 95 %: {}), its p99 is {:.2}x alone (<= 2x: {})",
                self.kept_share * 100.0,
                met(self.kept_share >= 0.95),
                self.p99_ratio,
                met(self.p99_ratio <= 2.0)
            ),
        ];
        if let (Some(d), Some(a), Some(r)) =
            (self.drain_per_s, self.drain_alone_per_s, self.drain_ratio)
        {
            out.push(format!(
                "drain: {} jobs/s beside the shop, {} alone: {r:.2}x (>= 0.5x: {})",
                n0(d),
                n0(a),
                met(r >= 0.5)
            ));
        }
        for e in self.errors.iter().take(3) {
            out.push(format!("a failed shop transaction: {e}"));
        }
        if let Some(p) = &self.pgbench {
            out.push(format!(
                "the machine's own: the shop beside the same database work without the worker (pgbench, 1 client, sets of {}, {} orders/s for {} s), in a run of its own:",
                p.size,
                n0(p.orders_per_s),
                p.seconds
            ));
            out.push(format!("  shop alone: {}", f(&p.alone)));
            out.push(format!("  shop beside pgbench: {}", f(&p.during)));
            out.push(format!(
                "  p99 {:.2}x alone; the worker's {:.2}x is {:.2}x of it. CPU s: postgres {}; machine busy {} %",
                p.p99_ratio,
                self.p99_ratio,
                self.p99_ratio / p.p99_ratio.max(1e-9),
                p.postgres_s.map_or("-".into(), |s| format!("{s:.2}")),
                p.machine_busy_pct.map_or("-".into(), |s| format!("{s:.0}"))
            ));
            for e in p.errors.iter().take(3) {
                out.push(format!("  a failed shop transaction: {e}"));
            }
        }
        if let Some(e) = &self.pgbench_error {
            out.push(format!(
                "the machine's own figure (pgbench beside the shop) failed: {e}"
            ));
        }
        out
    }
}

impl ScenarioResult {
    /// The lines under the table: where the CPU went, the producer, problems, notes.
    fn details(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(sh) = &self.shop {
            out.extend(sh.lines());
        }
        if let (Some(one), Some(set)) = (self.ceiling_ratio, self.set_ceiling_ratio) {
            out.push(format!(
                "throughput: {one:.2} × the one-order pgbench ceiling, {set:.2} × the set-based one (sets of {})",
                SET_ORDERS
            ));
        }
        if let Some(p) = &self.producer {
            out.push(format!(
                "producer: {} msg/s asked, {} achieved, at most {} ms behind schedule; {} duplicates; {} orders paid, at most {} ms after their push",
                n0(p.target_rate),
                n0(p.achieved_rate),
                ms(p.max_behind_ms),
                p.duplicates,
                p.paid,
                ms(p.pay_max_lag_ms)
            ));
        }
        if let Some(l) = &self.lateness {
            let part = |v: Option<[f64; 3]>| {
                v.map(|[a, b, c]| format!("p50 {} / p99 {} / max {} ms", ms(a), ms(b), ms(c)))
                    .unwrap_or("-".into())
            };
            out.push(format!(
                "lateness split: due → on the stream (mover) {}; stream → transaction {}",
                part(l.to_stream_ms),
                part(l.stream_to_commit_ms)
            ));
        }
        let c = &self.cpu;
        if c.worker_s > 0.0 {
            let threads = c
                .worker_threads_s
                .iter()
                .map(|(k, v)| format!("{k} {v:.2}"))
                .collect::<Vec<_>>()
                .join(", ");
            let opt = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or("?".into());
            out.push(format!(
                "CPU s: worker {:.2} ({threads}); redis {}; postgres {}; bench {}; machine busy {} of {} cores",
                c.worker_s,
                opt(c.redis_s),
                opt(c.postgres_s),
                opt(c.bench_s),
                c.machine_busy_pct
                    .map(|v| format!("{v:.0} %"))
                    .unwrap_or("?".into()),
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            ));
        }
        if let Some(sp) = &self.spread {
            out.extend(sp.lines());
        }
        let mut times = Vec::new();
        if let Some(v) = self.seed_s {
            times.push(format!("seed {v:.1} s"));
        }
        if let Some(v) = self.push_s {
            times.push(format!("push {v:.1} s"));
        }
        if let Some(v) = self.drain_s {
            times.push(format!(
                "drained {v:.2} s after the {}",
                self.drain_from.as_deref().unwrap_or("start")
            ));
        }
        if let Some(kb) = self.rss_hwm_kb {
            times.push(format!("VmHWM {:.1} MB", kb as f64 / 1024.0));
        }
        // Second 0 is the start-up; the first full second and the last show the trend.
        if let (Some(a), Some(b)) = (self.rss_per_s_kb.get(1), self.rss_per_s_kb.last()) {
            times.push(format!(
                "RSS {:.1} MB at 1 s, {:.1} MB at {} s",
                *a as f64 / 1024.0,
                *b as f64 / 1024.0,
                self.rss_per_s_kb.len() - 1
            ));
        }
        if !times.is_empty() {
            out.push(times.join("; "));
        }
        if let Some(p) = &self.prune {
            let opt = |v: Option<f64>| v.map(ms).unwrap_or("-".into());
            out.push(format!(
                "pruning: {} of {} old inbox rows in {:.0} s = {} rows/s ({} rows/s within the passes), {} remain (batch {}, pause {} ms, a pass every {} s, working at most half of it; the rows written in {:.0} s)",
                n0(p.pruned as f64),
                n0(p.rows_before as f64),
                p.pruning_s,
                n0(p.rows_per_s),
                p.passes_rows_per_s.map(n0).unwrap_or("-".into()),
                n0(p.remaining as f64),
                p.batch,
                ms(p.pause_ms),
                p.interval_s,
                p.fill_s
            ));
            out.push(format!(
                "lateness p99 {} ms while pruning, {} ms without (prune-off): {}{} ms",
                opt(p.p99_with_ms),
                opt(p.p99_without_ms),
                if p.p99_delta_ms.unwrap_or(0.0) >= 0.0 {
                    "+"
                } else {
                    ""
                },
                opt(p.p99_delta_ms)
            ));
        }
        if let Some(b) = &self.books {
            out.push(format!(
                "books: {} cancelled of {} expected, {} inbox rows",
                b.cancelled, b.expected_cancelled, b.inbox_rows
            ));
        }
        for n in &self.notes {
            out.push(format!("note: {n}"));
        }
        for p in &self.problems {
            out.push(format!("FAIL: {p}"));
        }
        out
    }
}

/// A number without decimals, thousands separated by commas.
pub fn n0(v: f64) -> String {
    let s = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if v < 0.0 && s != "0" {
        out.insert(0, '-');
    }
    out
}

/// Milliseconds: one decimal below 100, none above.
pub fn ms(v: f64) -> String {
    if v.abs() < 100.0 {
        format!("{v:.1}")
    } else {
        n0(v)
    }
}

/// `2026-01-18T10:30:00Z` (`iso`) or `2026-01-18T103000Z` (for file names).
pub fn utc(unix_s: i64, iso: bool) -> String {
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (h, mi, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    if iso {
        format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
    } else {
        format!("{y:04}-{m:02}-{d:02}T{h:02}{mi:02}{s:02}Z")
    }
}

/// The default report's file name stem.
pub fn file_stamp() -> String {
    utc(delay_worker::now_ms() / 1000, false)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_and_numbers() {
        assert_eq!(super::utc(0, true), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc(1_768_764_300, true), "2026-01-18T19:25:00Z");
        assert_eq!(super::utc(951_782_400, false), "2000-02-29T000000Z");
        assert_eq!(super::n0(1234567.4), "1,234,567");
        assert_eq!(super::n0(999.0), "999");
        assert_eq!(super::ms(4.26), "4.3");
    }
}
