//! The scenarios. Each starts from empty queue keys and freshly seeded tables, runs
//! one worker child, waits (bounded) until Redis has nothing left to move, deliver or
//! acknowledge, reads the CPU and memory figures before stopping the child, then does
//! the books. A scenario that cannot run (the worker does not start, a server goes away)
//! becomes a FAIL row with the error; the next scenario still runs.

use super::ceiling::Ceilings;
use super::child::{self, QueueState, RssSampler, WorkerChild};
use super::load::{self, Scores, SteadyPlan};
use super::report::{CpuUse, Producer, PruneFigures, ScenarioResult, Spread};
use super::shop;
use super::{BenchArgs, Scenario};
use anyhow::{bail, Result};
use delay_worker::config::Config;
use delay_worker::keys::Keys;
use delay_worker::{store, Shutdown};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// What every scenario needs.
pub struct Ctx<'a> {
    pub config: &'a Config,
    pub args: &'a BenchArgs,
    pub redis: &'a delay_worker::store::Redis,
    /// The key set of each shard (`config.keys` alone without `--shards`).
    pub shards: &'a [Keys],
    pub ceilings: &'a Ceilings,
    pub out_dir: &'a Path,
    pub stop: &'a Shutdown,
}

/// One result per scenario; two for `prune` (its run without pruning, then with).
pub fn run(ctx: &Ctx, db: &mut postgres::Client, s: Scenario) -> Vec<ScenarioResult> {
    let r = match s {
        Scenario::SteadyMs => steady(ctx, db, s, Scores::Millis).map(|r| vec![r]),
        Scenario::SteadyS => steady(ctx, db, s, Scores::Seconds).map(|r| vec![r]),
        Scenario::Backlog => backlog(ctx, db, s).map(|r| vec![r]),
        Scenario::Engine => engine(ctx, db, s).map(|r| vec![r]),
        Scenario::Prune => prune(ctx, db),
        Scenario::Shop => shop_scenario(ctx, db),
    };
    r.unwrap_or_else(|e| vec![ScenarioResult::failed(s.name(), format!("{e:#}"))])
}

/// CPU counters of everything but the worker, at one moment.
struct Marks {
    bench: Option<u64>,
    redis: Option<BTreeMap<String, f64>>,
    postgres: Option<u64>,
    machine: Option<(u64, u64)>,
}

impl Marks {
    fn take(con: &mut delay_worker::store::Con, postmaster: Option<u32>) -> Marks {
        Marks {
            bench: child::own_cpu_ticks(),
            redis: child::redis_cpu_s(con),
            postgres: postmaster.and_then(child::postgres_ticks),
            machine: child::machine_ticks(),
        }
    }
}

/// CPU seconds between two readings of ticks.
fn ticks_s(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    Some((b? as f64 - a? as f64) / child::clk_tck())
}

/// The machine's busy share (%) between two readings of `child::machine_ticks`.
fn busy_pct(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> Option<f64> {
    match (a, b) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
            Some(b1.saturating_sub(b0) as f64 * 100.0 / (t1 - t0) as f64)
        }
        _ => None,
    }
}

/// The figures read from the worker while it still runs, and around it.
struct Measured {
    cpu: CpuUse,
    rss_peak_kb: u64,
    rss_per_s_kb: Vec<u64>,
    rss_hwm_kb: Option<u64>,
}

/// Reads the worker's figures, then stops it (gracefully, killed if it hangs).
fn finish(
    worker: WorkerChild,
    rss: RssSampler,
    before: &Marks,
    con: &mut delay_worker::store::Con,
    postmaster: Option<u32>,
) -> Measured {
    let after = Marks::take(con, postmaster);
    let cpu = CpuUse {
        worker_s: child::cpu_ticks(worker.pid).unwrap_or(0) as f64 / child::clk_tck(),
        worker_threads_s: child::thread_cpu(worker.pid),
        bench_s: ticks_s(before.bench, after.bench),
        redis_by_node_s: match (&before.redis, &after.redis) {
            (Some(a), Some(b)) => b
                .iter()
                .filter_map(|(node, v)| Some((node.clone(), v - a.get(node)?)))
                .collect(),
            _ => BTreeMap::new(),
        },
        redis_s: match (&before.redis, &after.redis) {
            (Some(a), Some(b)) if b.keys().all(|k| a.contains_key(k)) => {
                Some(b.iter().map(|(k, v)| v - a[k]).sum())
            }
            _ => None,
        },
        postgres_s: ticks_s(before.postgres, after.postgres),
        machine_busy_pct: busy_pct(before.machine, after.machine),
    };
    let rss_hwm_kb = child::status_kb(worker.pid, "VmHWM");
    let rss_per_s_kb = rss.finish();
    worker.stop();
    Measured {
        cpu,
        rss_peak_kb: rss_per_s_kb.iter().copied().max().unwrap_or(0),
        rss_per_s_kb,
        rss_hwm_kb,
    }
}

/// How the wait for the drain ended.
struct Drain {
    /// First time the stream held an entry (the mover's first batch).
    first_moved: Option<Instant>,
    /// When Redis had nothing left; `None` on timeout.
    done: Option<Instant>,
    /// Every shard together, and each.
    state: QueueState,
    shards: Vec<QueueState>,
}

/// Polls Redis every `every` until nothing is left to move, deliver or acknowledge, the
/// deadline passes, the worker exits or the bench is interrupted. With shards, a shard
/// seen drained is not asked again until every shard has been; then all are read once
/// more, so the bench's own polling costs Redis little more than one shard's.
fn wait_drained(
    worker: &mut WorkerChild,
    con: &mut delay_worker::store::Con,
    ctx: &Ctx,
    deadline: Instant,
    every: Duration,
) -> Result<Drain> {
    let mut first_moved = None;
    let n = ctx.shards.len();
    let mut last: Vec<QueueState> = vec![QueueState::default(); n];
    let mut todo: Vec<usize> = (0..n).collect();
    loop {
        if ctx.stop.is_set() {
            bail!("interrupted");
        }
        worker.check_alive()?;
        let full = todo.len() == n;
        let mut busy = Vec::new();
        for &i in &todo {
            let st = child::queue_state(con, &ctx.shards[i])?;
            if !st.drained() {
                busy.push(i);
            }
            last[i] = st;
        }
        let state = QueueState::total(&last);
        let now = Instant::now();
        if first_moved.is_none() && state.stream > 0 {
            first_moved = Some(now);
        }
        if busy.is_empty() {
            if full {
                return Ok(Drain {
                    first_moved,
                    done: Some(now),
                    state,
                    shards: last,
                });
            }
            // Every shard was seen drained: confirm all of them in one round, at once.
            todo = (0..n).collect();
            continue;
        }
        todo = busy;
        if now >= deadline {
            return Ok(Drain {
                first_moved,
                done: None,
                state,
                shards: last,
            });
        }
        std::thread::sleep(every);
    }
}

/// The worker's log file of a scenario (or of one run of it), next to the report.
fn log_path(ctx: &Ctx, name: &str) -> std::path::PathBuf {
    ctx.out_dir.join(format!("worker-{name}.log"))
}

/// Redis must hold nothing of the scenario afterwards.
fn queue_problems(q: &QueueState, timed_out: bool, timeout: Duration) -> Vec<String> {
    let mut p = Vec::new();
    if timed_out {
        p.push(format!(
            "not drained within --timeout {}s: {}",
            timeout.as_secs(),
            q.describe()
        ));
        return p;
    }
    if q.data != 0 {
        p.push(format!("{} messages left in the pool's hash", q.data));
    }
    if q.dead != 0 {
        p.push(format!("{} dead letters", q.dead));
    }
    p
}

/// How the work spread over shards and masters: for a Redis Cluster or several shards.
fn spread(
    ctx: &Ctx,
    con: &mut delay_worker::store::Con,
    drain: &Drain,
    cpu: &CpuUse,
) -> Option<Spread> {
    if ctx.shards.len() <= 1 && !con.is_cluster() {
        return None;
    }
    let masters = match child::masters(con) {
        Ok(m) => m,
        Err(e) => {
            log::warn!("cannot list the masters: {e:#}");
            return None;
        }
    };
    let jobs: Vec<u64> = drain.shards.iter().map(QueueState::delivered).collect();
    Some(Spread::new(
        ctx.shards,
        &jobs,
        &masters,
        &cpu.redis_by_node_s,
    ))
}

fn cpu_per_1k(cpu: &CpuUse, jobs: u64) -> Option<f64> {
    (jobs > 0).then(|| cpu.worker_s * 1000.0 / jobs as f64)
}

fn steady_plan(args: &BenchArgs, scores: Scores) -> SteadyPlan {
    SteadyPlan {
        rate: args.rate,
        duration: args.duration,
        max_delay: args.max_delay,
        scores,
        seed: 7,
    }
}

fn steady(
    ctx: &Ctx,
    db: &mut postgres::Client,
    s: Scenario,
    scores: Scores,
) -> Result<ScenarioResult> {
    let plan = steady_plan(ctx.args, scores);
    shop::reset(db)?;
    let seed_s = shop::seed(db, plan.messages(), ctx.args.skus)?;
    Ok(steady_run(ctx, db, s.name(), &plan, &[], seed_s)?.0)
}

/// One steady run on the seeded shop: the worker (with `extra` flags) started, the plan
/// produced, the drain awaited, the books done. Also returns how long the worker ran.
fn steady_run(
    ctx: &Ctx,
    db: &mut postgres::Client,
    name: &str,
    plan: &SteadyPlan,
    extra: &[&str],
    seed_s: Duration,
) -> Result<(ScenarioResult, Duration)> {
    let (config, args) = (ctx.config, ctx.args);
    let scores = plan.scores;
    let mut con = store::connect(ctx.redis)?;
    child::reset_queue(&mut con, ctx.shards)?;
    let postmaster = child::postmaster_pid(db);

    let page = if args.poll_status {
        Some(super::poll::free_addr()?)
    } else {
        None
    };
    let addr_flag = page.map(|a| a.to_string());
    let mut extra: Vec<&str> = extra.to_vec();
    if let Some(a) = &addr_flag {
        extra.extend(["--metrics-addr", a.as_str()]);
    }
    let mut worker = WorkerChild::spawn(config, &extra, &log_path(ctx, name))?;
    worker.wait_ready(&mut con, ctx.shards)?;
    let ready = Instant::now();
    let before = Marks::take(&mut con, postmaster);
    let rss = RssSampler::start(worker.pid);
    let poller = page.map(super::poll::Poller::start);
    let produced = load::steady(ctx.redis, &config.database_url, ctx.shards, plan, ctx.stop)?;
    let last_due_in =
        Duration::from_millis((produced.last_due_ms - delay_worker::now_ms()).max(0) as u64);
    let last_due = Instant::now() + last_due_in;
    let drain = wait_drained(
        &mut worker,
        &mut con,
        ctx,
        last_due + args.timeout,
        Duration::from_millis(20),
    )?;
    let polled = poller.map(|p| p.finish());
    let m = finish(worker, rss, &before, &mut con, postmaster);
    let spread = spread(ctx, &mut con, &drain, &m.cpu);
    let ran = ready.elapsed();

    let moved = child::moved_times(&mut con, ctx.shards)?;
    shop::record(db, &produced.dues, &moved, &produced.orders)?;
    let lateness = shop::lateness(db)?;
    let books = shop::books(db)?;
    let jobs = produced.dues.len() as u64;
    let mut problems = queue_problems(&drain.state, drain.done.is_none(), args.timeout);
    problems.extend(books.problems(jobs));
    let mut notes = Vec::new();
    if produced.paid_late > 0 {
        notes.push(format!(
            "{} payments found their order no longer pending",
            produced.paid_late
        ));
    }
    if produced.max_behind_ms > 100.0 {
        notes.push(format!(
            "the producer fell up to {:.0} ms behind its schedule",
            produced.max_behind_ms
        ));
    }
    notes.extend(polled);
    if scores == Scores::Seconds {
        notes.push(format!(
            "whole-second scores: about {} jobs fall due at each second",
            args.rate
        ));
    }
    let jobs_per_s = lateness.as_ref().and_then(|l| {
        let span = (l.last_processed_ms - l.first_processed_ms) / 1000.0;
        (span > 0.0).then(|| l.count as f64 / span)
    });
    let result = ScenarioResult {
        name: name.into(),
        jobs,
        orders: produced.orders.len() as u64,
        producer: Some(Producer {
            target_rate: args.rate as f64,
            achieved_rate: produced.achieved_rate,
            max_behind_ms: produced.max_behind_ms,
            duplicates: produced.duplicates,
            paid: produced.paid,
            pay_max_lag_ms: produced.pay_max_lag_ms,
        }),
        jobs_per_s,
        drain_s: drain
            .done
            .map(|d| d.saturating_duration_since(last_due).as_secs_f64()),
        drain_from: Some("last due time".into()),
        cpu_s_per_1k_jobs: cpu_per_1k(&m.cpu, jobs),
        spread,
        cpu: m.cpu,
        rss_peak_kb: Some(m.rss_peak_kb),
        rss_per_s_kb: m.rss_per_s_kb,
        rss_hwm_kb: m.rss_hwm_kb,
        lateness,
        books: Some(books),
        queue_after: Some(drain.state),
        seed_s: Some(seed_s.as_secs_f64()),
        pass: problems.is_empty(),
        problems,
        notes,
        ..Default::default()
    };
    Ok((result, ran))
}

/// Rows and seconds of the worker's "inbox: pruned N rows ... (S s)" log lines.
fn pass_lines(log: &Path) -> (u64, f64) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out = (0, 0.0);
    for line in text.lines() {
        let Some(rest) = line.split("inbox: pruned ").nth(1) else {
            continue;
        };
        let rows = rest.split(' ').next().and_then(|n| n.parse::<u64>().ok());
        let secs = rest
            .split(" batches (")
            .nth(1)
            .and_then(|t| t.split("s)").next())
            .and_then(|t| t.parse::<f64>().ok());
        if let (Some(r), Some(s)) = (rows, secs) {
            out.0 += r;
            out.1 += s;
        }
    }
    out
}

/// The steady-ms load twice over an inbox holding `--prune-rows` rows older than the
/// retention: first with pruning off (`prune-off`), then while the worker prunes them
/// (`prune`). The old rows are written once, in one statement, before both runs; between
/// the runs only the first run's own rows are removed, so both start from the same table.
fn prune(ctx: &Ctx, db: &mut postgres::Client) -> Result<Vec<ScenarioResult>> {
    let (config, args) = (ctx.config, ctx.args);
    let retention = config.prune.retention;
    if retention.is_zero() {
        bail!("the prune scenario needs --inbox-retention above 0");
    }
    let plan = steady_plan(args, Scores::Millis);
    let n = args.prune_rows;
    let mut con = store::connect(ctx.redis)?;
    child::reset_queue(&mut con, ctx.shards)?;
    shop::reset(db)?;
    println!("  writing {n} old inbox rows ...");
    let day = Duration::from_secs(24 * 3600);
    let fill_s = shop::fill_inbox(db, n, retention + day)?;
    println!("  written in {:.0} s", fill_s.as_secs_f64());
    let seed_s = shop::seed(db, plan.messages(), args.skus)?;
    let (base, _) = steady_run(
        ctx,
        db,
        "prune-off",
        &plan,
        &["--inbox-retention", "0"],
        seed_s,
    )?;

    shop::reset_keep_filler(db)?;
    let seed_s = shop::seed(db, plan.messages(), args.skus)?;
    let old_before = shop::inbox_older_than(db, retention)?;
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let (retention_s, interval, batch, pause) = (
        format!("{}s", retention.as_secs()),
        ms(args.prune_interval),
        config.prune.batch.to_string(),
        ms(config.prune.pause),
    );
    let (mut on, ran) = steady_run(
        ctx,
        db,
        "prune",
        &plan,
        &[
            "--inbox-retention",
            &retention_s,
            "--inbox-prune-interval",
            &interval,
            "--inbox-prune-batch",
            &batch,
            "--inbox-prune-pause",
            &pause,
        ],
        seed_s,
    )?;
    let remaining = shop::inbox_older_than(db, retention)?;
    let pruned = (old_before - remaining).max(0) as u64;
    // The first pass starts one interval after the worker.
    let pruning = ran.saturating_sub(args.prune_interval);
    let (pass_rows, pass_s) = pass_lines(&log_path(ctx, "prune"));
    let p99 = |r: &ScenarioResult| r.lateness.as_ref().map(|l| l.p99_ms);
    let figures = PruneFigures {
        rows_before: old_before as u64,
        pruned,
        remaining: remaining as u64,
        pruning_s: pruning.as_secs_f64(),
        rows_per_s: pruned as f64 / pruning.as_secs_f64().max(0.001),
        passes_rows_per_s: (pass_s > 0.0).then(|| pass_rows as f64 / pass_s),
        p99_without_ms: p99(&base),
        p99_with_ms: p99(&on),
        p99_delta_ms: p99(&on).zip(p99(&base)).map(|(a, b)| a - b),
        fill_s: fill_s.as_secs_f64(),
        batch: config.prune.batch,
        pause_ms: config.prune.pause.as_secs_f64() * 1000.0,
        interval_s: args.prune_interval.as_secs_f64(),
    };
    if pruned == 0 {
        on.pass = false;
        on.problems
            .push("the worker pruned no old inbox row during the run".into());
    }
    on.notes.push(format!(
        "{} old inbox rows (a day older than --inbox-retention) when the run started",
        old_before
    ));
    on.prune = Some(figures);
    Ok(vec![base, on])
}

fn backlog(ctx: &Ctx, db: &mut postgres::Client, s: Scenario) -> Result<ScenarioResult> {
    let (config, args) = (ctx.config, ctx.args);
    let n = args.backlog_jobs;
    let mut con = store::connect(ctx.redis)?;
    child::reset_queue(&mut con, ctx.shards)?;
    shop::reset(db)?;
    let seed_s = shop::seed(db, n, args.skus)?;
    let postmaster = child::postmaster_pid(db);
    let pushed_at = Instant::now();
    load::bulk_push(&mut con, ctx.shards, load::backlog_jobs(n))?;
    let push_s = pushed_at.elapsed().as_secs_f64();

    let before = Marks::take(&mut con, postmaster);
    let mut worker = WorkerChild::spawn(config, &[], &log_path(ctx, s.name()))?;
    let started = Instant::now();
    let spawned_ms = worker.spawned_ms;
    let rss = RssSampler::start(worker.pid);
    let drain = wait_drained(
        &mut worker,
        &mut con,
        ctx,
        started + args.timeout,
        Duration::from_millis(20),
    )?;
    let m = finish(worker, rss, &before, &mut con, postmaster);
    let spread = spread(ctx, &mut con, &drain, &m.cpu);

    // Every job was due before the worker existed: lateness is counted from its start.
    let dues: Vec<(String, i64)> = (1..=n as i64)
        .map(|id| (load::order_key(id), spawned_ms))
        .collect();
    let orders: Vec<(i64, bool)> = (1..=n as i64).map(|id| (id, false)).collect();
    let moved = child::moved_times(&mut con, ctx.shards)?;
    shop::record(db, &dues, &moved, &orders)?;
    let lateness = shop::lateness(db)?;
    let books = shop::books(db)?;
    let mut problems = queue_problems(&drain.state, drain.done.is_none(), args.timeout);
    problems.extend(books.problems(n));
    let jobs_per_s = lateness.as_ref().and_then(|l| {
        let span = (l.last_processed_ms - l.first_processed_ms) / 1000.0;
        (span > 0.0).then(|| l.count as f64 / span)
    });
    let tps = ctx.ceilings.pgbench_tps();
    let mut notes = vec!["lateness counted from the worker's start: it is the drain".into()];
    if let Some(l) = &lateness {
        notes.push(format!(
            "first commit {:.0} ms after the worker started (connect, schema check, prepare)",
            l.first_processed_ms - spawned_ms as f64
        ));
    }
    Ok(ScenarioResult {
        name: s.name().into(),
        jobs: n,
        orders: n,
        ceiling_ratio: jobs_per_s.zip(tps).map(|(j, t)| j / t),
        set_ceiling_ratio: jobs_per_s
            .zip(ctx.ceilings.pgbench_set_orders_per_s())
            .map(|(j, t)| j / t),
        ceiling: tps.map(|_| "pgbench order.timeout tps".into()),
        jobs_per_s,
        drain_s: drain
            .done
            .map(|d| d.saturating_duration_since(started).as_secs_f64()),
        drain_from: Some("worker start".into()),
        cpu_s_per_1k_jobs: cpu_per_1k(&m.cpu, n),
        spread,
        cpu: m.cpu,
        rss_peak_kb: Some(m.rss_peak_kb),
        rss_per_s_kb: m.rss_per_s_kb,
        rss_hwm_kb: m.rss_hwm_kb,
        lateness,
        books: Some(books),
        queue_after: Some(drain.state),
        seed_s: Some(seed_s.as_secs_f64()),
        push_s: Some(push_s),
        pass: problems.is_empty(),
        problems,
        notes,
        ..Default::default()
    })
}

/// One drain of the shop scenario: `n` timeouts (orders 1..=n, recorded unpaid) pushed due
/// at once into a running worker, drained; with `traffic` running beside it or not.
struct ShopDrain {
    result: ScenarioResult,
    /// When the backlog was pushed and when it was drained, from the traffic's start.
    window: Option<(Duration, Duration)>,
    samples: Vec<super::traffic::Sample>,
    errors: Vec<String>,
}

fn shop_drain(
    ctx: &Ctx,
    db: &mut postgres::Client,
    name: &str,
    plan: Option<&super::traffic::Plan>,
) -> Result<ShopDrain> {
    let (config, args) = (ctx.config, ctx.args);
    let n = args.shop_backlog;
    let mut con = store::connect(ctx.redis)?;
    child::reset_queue(&mut con, ctx.shards)?;
    shop::reset(db)?;
    let seed_s = shop::seed(db, n + args.shop_orders, args.skus)?;
    let orders: Vec<(i64, bool)> = (1..=n as i64).map(|id| (id, false)).collect();
    shop::record(db, &[], &std::collections::HashMap::new(), &orders)?;
    let postmaster = child::postmaster_pid(db);
    let traffic = plan.map(super::traffic::start).transpose()?;
    if traffic.is_some() && ctx.stop.wait(args.shop_alone) {
        bail!("interrupted");
    }
    let mut worker = WorkerChild::spawn(config, &[], &log_path(ctx, name))?;
    let rss = RssSampler::start(worker.pid);
    // The worker is up and idle before the backlog falls due.
    if ctx.stop.wait(Duration::from_secs(1)) {
        bail!("interrupted");
    }
    worker.check_alive()?;
    // The backlog is pushed ahead of its due time, so the window measured is the drain,
    // not the benchmark's own push of it (which took the cores for its first second or
    // two when it was pushed already due).
    let push_started = Instant::now();
    let lead = if args.shop_overdue.is_zero() {
        SHOP_BACKLOG_LEAD
    } else {
        Duration::ZERO
    };
    let due_ms =
        delay_worker::now_ms() + lead.as_millis() as i64 - args.shop_overdue.as_millis() as i64;
    load::bulk_push(&mut con, ctx.shards, load::backlog_jobs_due(n, due_ms))?;
    let push_s = push_started.elapsed();
    let pushed_at = push_started + lead;
    if ctx
        .stop
        .wait(pushed_at.saturating_duration_since(Instant::now()))
    {
        bail!("interrupted");
    }
    let before = Marks::take(&mut con, postmaster);
    let drain = wait_drained(
        &mut worker,
        &mut con,
        ctx,
        pushed_at + args.timeout,
        Duration::from_millis(20),
    )?;
    let window = traffic.as_ref().and_then(|t| {
        drain
            .done
            .map(|d| (pushed_at - t.started(), d - t.started()))
    });
    let (samples, errors) = traffic.map(|t| t.stop()).unwrap_or_default();
    let m = finish(worker, rss, &before, &mut con, postmaster);
    let dues: Vec<(String, i64)> = (1..=n as i64)
        .map(|id| (load::order_key(id), due_ms))
        .collect();
    let moved = child::moved_times(&mut con, ctx.shards)?;
    shop::record(db, &dues, &moved, &[])?;
    let lateness = shop::lateness(db)?;
    let books = shop::books(db)?;
    let (transactions, rows) = shop::inbox_transactions(db)?;
    let mut problems = queue_problems(&drain.state, drain.done.is_none(), args.timeout);
    problems.extend(books.problems(n));
    let jobs_per_s = lateness.as_ref().and_then(|l| {
        let span = (l.last_processed_ms - l.first_processed_ms) / 1000.0;
        (span > 0.0).then(|| l.count as f64 / span)
    });
    Ok(ShopDrain {
        result: ScenarioResult {
            name: name.into(),
            jobs: n,
            orders: n,
            jobs_per_s,
            drain_s: drain
                .done
                .map(|d| d.saturating_duration_since(pushed_at).as_secs_f64()),
            drain_from: Some("due time of the backlog".into()),
            cpu_s_per_1k_jobs: cpu_per_1k(&m.cpu, n),
            cpu: m.cpu,
            rss_peak_kb: Some(m.rss_peak_kb),
            rss_per_s_kb: m.rss_per_s_kb,
            rss_hwm_kb: m.rss_hwm_kb,
            lateness,
            books: Some(books),
            queue_after: Some(drain.state),
            seed_s: Some(seed_s.as_secs_f64()),
            pass: problems.is_empty(),
            problems,
            notes: vec![
                format!(
                    "lateness counted from the backlog's due time: it is the drain (pushed in {:.1} s, {:.0} s before it fell due{})",
                    push_s.as_secs_f64(),
                    SHOP_BACKLOG_LEAD.as_secs_f64(),
                    if push_s > SHOP_BACKLOG_LEAD {
                        ": the push was not done in time, and part of it is in the window"
                    } else {
                        ""
                    }
                ),
                format!(
                    "{transactions} transactions, {:.1} jobs each on average",
                    rows as f64 / transactions.max(1) as f64
                ),
            ],
            ..Default::default()
        },
        window,
        samples,
        errors,
    })
}

/// The shop beside the drain's database work alone: pgbench running the worker's set
/// transaction (sql/bench/order_timeout_set.pgbench, `--set-size` orders each) from one
/// client, as the worker runs one transaction at a time while the shop is busy, at the
/// rate the worker drained beside the shop, for as long as that drain took. No worker and
/// no Redis: the shop's p99 beside it is what the database's work at that rate costs the
/// shop on this machine, the ceiling the worker's own figure is read against.
fn shop_beside_pgbench(
    ctx: &Ctx,
    db: &mut postgres::Client,
    plan: &super::traffic::Plan,
    jobs_per_s: f64,
    secs: f64,
) -> Result<super::report::ShopPgbench> {
    let args = ctx.args;
    let size = ctx.config.jobs.set_size.max(1) as u64;
    let secs = secs.round().max(3.0) as u64;
    shop::reset(db)?;
    // Every set of the run cancels orders of its own (client 0 walks 1, 1 + size, ...).
    let orders = args
        .shop_backlog
        .max((jobs_per_s * secs as f64 * 1.2) as u64 + size);
    shop::seed(db, orders + args.shop_orders, args.skus)?;
    let wait_ms = delay_worker::config::busy_set_lock_ms(ctx.config.jobs.lock_timeout);
    let (tool, script) = super::ceiling::shop_set_script_at(ctx.out_dir, wait_ms)?;
    let plan = super::traffic::Plan {
        shop_orders: (orders as i64 + 1, (orders + args.shop_orders) as i64),
        backlog_orders: (1, orders as i64),
        ..plan.clone()
    };
    let traffic = super::traffic::start(&plan)?;
    if ctx.stop.wait(args.shop_alone) {
        bail!("interrupted");
    }
    let load = super::ceiling::Load {
        clients: 1,
        size,
        rate: Some(jobs_per_s / size as f64),
        retry_deadlocks: true,
    };
    let postmaster = child::postmaster_pid(db);
    let (pg0, m0) = (
        postmaster.and_then(child::postgres_ticks),
        child::machine_ticks(),
    );
    let from = traffic.started().elapsed();
    let run = super::ceiling::run_pgbench(&tool, ctx.config, &script, secs, load);
    let to = traffic.started().elapsed();
    let (pg1, m1) = (
        postmaster.and_then(child::postgres_ticks),
        child::machine_ticks(),
    );
    let (samples, errors) = traffic.stop();
    let pgbench = run?;
    let warm = Duration::from_secs(1).min(args.shop_alone / 2);
    let alone = super::traffic::figures(&samples, warm, args.shop_alone, args.shop_rate);
    let during = super::traffic::figures(&samples, from, to, args.shop_rate);
    Ok(super::report::ShopPgbench {
        orders_per_s: pgbench.tps * size as f64,
        size,
        seconds: secs,
        p99_ratio: during.p99_ms / alone.p99_ms.max(1e-9),
        postgres_s: ticks_s(pg0, pg1),
        machine_busy_pct: busy_pct(m0, m1),
        alone,
        during,
        errors,
        command: pgbench.command,
    })
}

/// How far ahead of its due time the shop scenario pushes its backlog.
const SHOP_BACKLOG_LEAD: Duration = Duration::from_secs(3);

/// The shop scenario: the shop's traffic alone for --shop-alone, then the backlog falls
/// due while it runs (both measured over the drain), then the same drain without the
/// shop. Two rows: `shop` (the drain beside the shop, with the shop's figures) and
/// `shop-drain-alone`.
fn shop_scenario(ctx: &Ctx, db: &mut postgres::Client) -> Result<Vec<ScenarioResult>> {
    let args = ctx.args;
    let n = args.shop_backlog as i64;
    let plan = super::traffic::Plan {
        url: ctx.config.database_url.clone(),
        rate: args.shop_rate,
        clients: args.shop_clients as usize,
        shop_orders: (n + 1, n + args.shop_orders as i64),
        backlog_orders: (1, n),
        skus: args.skus,
    };
    let mut beside = shop_drain(ctx, db, "shop", Some(&plan))?;
    let alone = shop_drain(ctx, db, "shop-drain-alone", None)?;
    let warm = Duration::from_secs(1).min(args.shop_alone / 2);
    let shop_alone =
        super::traffic::figures(&beside.samples, warm, args.shop_alone, args.shop_rate);
    let mut figures = super::report::ShopFigures {
        alone: shop_alone.clone(),
        drain_per_s: beside.result.jobs_per_s,
        drain_alone_per_s: alone.result.jobs_per_s,
        drain_ratio: beside
            .result
            .jobs_per_s
            .zip(alone.result.jobs_per_s)
            .map(|(a, b)| a / b),
        errors: beside.errors.clone(),
        ..Default::default()
    };
    match beside.window {
        Some((from, to)) => {
            let during = super::traffic::figures(&beside.samples, from, to, args.shop_rate);
            figures.kept_share = during.done_per_s / args.shop_rate;
            figures.p99_ratio = during.p99_ms / shop_alone.p99_ms.max(1e-9);
            figures.during = during;
        }
        None => beside
            .result
            .problems
            .push("the drain did not end: no figures of the shop during it".into()),
    }
    if let (Some(rate), Some(secs)) = (beside.result.jobs_per_s, beside.result.drain_s) {
        match shop_beside_pgbench(ctx, db, &plan, rate, secs) {
            Ok(p) => figures.pgbench = Some(p),
            Err(e) => figures.pgbench_error = Some(format!("{e:#}")),
        }
    }
    beside.result.shop = Some(figures);
    beside.result.pass = beside.result.problems.is_empty();
    Ok(vec![beside.result, alone.result])
}

fn engine(ctx: &Ctx, db: &mut postgres::Client, s: Scenario) -> Result<ScenarioResult> {
    let (config, args) = (ctx.config, ctx.args);
    let n = args.engine_jobs;
    let mut con = store::connect(ctx.redis)?;
    child::reset_queue(&mut con, ctx.shards)?;
    shop::reset(db)?;
    let postmaster = child::postmaster_pid(db);
    let pushed_at = Instant::now();
    load::bulk_push(&mut con, ctx.shards, load::engine_jobs(n))?;
    let push_s = pushed_at.elapsed().as_secs_f64();

    let before = Marks::take(&mut con, postmaster);
    let mut worker = WorkerChild::spawn(
        config,
        &["--noop-event", load::NOOP_EVENT],
        &log_path(ctx, s.name()),
    )?;
    let started = Instant::now();
    let rss = RssSampler::start(worker.pid);
    // Finer polling: the whole run takes seconds and its end is only seen here.
    let drain = wait_drained(
        &mut worker,
        &mut con,
        ctx,
        started + args.timeout,
        Duration::from_millis(5),
    )?;
    let m = finish(worker, rss, &before, &mut con, postmaster);
    let spread = spread(ctx, &mut con, &drain, &m.cpu);

    let mut problems = queue_problems(&drain.state, drain.done.is_none(), args.timeout);
    let delivered = drain.state.entries_read.unwrap_or(drain.state.stream);
    if drain.done.is_some() && delivered != n {
        problems.push(format!("{delivered} entries delivered for {n} messages"));
    }
    let inbox = shop::inbox_count(db)?;
    if inbox != 0 {
        problems.push(format!(
            "{inbox} inbox rows: no-op jobs must not touch the database"
        ));
    }
    let jobs_per_s = match (drain.first_moved, drain.done) {
        (Some(a), Some(b)) if b > a => Some(n as f64 / (b - a).as_secs_f64()),
        _ => None,
    };
    let xadd = ctx.ceilings.redis_xadd_per_s;
    Ok(ScenarioResult {
        name: s.name().into(),
        jobs: n,
        ceiling_ratio: jobs_per_s.zip(xadd).map(|(j, x)| j / x),
        ceiling: xadd.map(|_| "redis-benchmark XADD/s".into()),
        jobs_per_s,
        drain_s: drain
            .done
            .map(|d| d.saturating_duration_since(started).as_secs_f64()),
        drain_from: Some("worker start".into()),
        cpu_s_per_1k_jobs: cpu_per_1k(&m.cpu, n),
        spread,
        cpu: m.cpu,
        rss_peak_kb: Some(m.rss_peak_kb),
        rss_per_s_kb: m.rss_per_s_kb,
        rss_hwm_kb: m.rss_hwm_kb,
        queue_after: Some(drain.state),
        push_s: Some(push_s),
        pass: problems.is_empty(),
        problems,
        notes: vec![
            "no database: lateness is not measured (every job was due before the start); \
             jobs/s from the first move to the last ack, polled every 5 ms"
                .into(),
        ],
        ..Default::default()
    })
}
