//! The worker under test as a child process, and the probes the bench reads while it
//! runs: /proc (CPU, resident memory, per-thread CPU), Redis (is everything drained?)
//! and the CPU of the Redis and PostgreSQL servers.
//!
//! [`WorkerChild`] kills its process on drop, so an error anywhere in a scenario never
//! leaves a worker running; a normal stop is SIGTERM (the graceful drain) then SIGKILL
//! after [`STOP_GRACE`].

use super::CHILD_PID;
use anyhow::{bail, Context, Result};
use delay_worker::config::Config;
use delay_worker::keys::Keys;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How long a stopped worker gets to drain and exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long a starting worker gets to write its first heartbeat.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Resident memory is sampled this often.
const RSS_EVERY: Duration = Duration::from_millis(100);

/// The consumer name of the worker under test.
pub const CONSUMER: &str = "bench";

pub struct WorkerChild {
    child: Option<Child>,
    pub pid: u32,
    log: PathBuf,
    /// Unix ms just before the process was started.
    pub spawned_ms: i64,
}

impl WorkerChild {
    /// Starts `worker run` (this binary) with the config's worker flags plus `extra`,
    /// stdout and stderr into `log`.
    pub fn spawn(config: &Config, extra: &[&str], log: &Path) -> Result<WorkerChild> {
        let exe = std::env::current_exe().context("cannot find the worker binary")?;
        let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone()?;
        let k = &config.keys;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut cmd = Command::new(&exe);
        // URLs by environment, so no password shows in `ps`.
        cmd.env("REDIS_URL", &config.redis_url)
            .env("DATABASE_URL", &config.database_url)
            .env(
                "RUST_LOG",
                std::env::var("DW_BENCH_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("JOURNAL_STREAM")
            .arg("run")
            .args(["--consumer", CONSUMER])
            .args(["--threads", &config.threads.to_string()])
            .args(["--batch-size", &config.mover.batch.to_string()])
            .args(["--poll-interval", &ms(config.mover.poll)])
            .args(["--move-window", &ms(config.mover.window)])
            .args(["--block", &ms(config.reader.block)])
            .args(["--heartbeat-ttl", &ms(config.reader.heartbeat_ttl)])
            .args(["--statement-timeout", &ms(config.jobs.statement_timeout)])
            .args(["--tx-batch", &config.jobs.tx_batch.to_string()])
            .args(["--set-size", &config.jobs.set_size.to_string()])
            .args(["--lock-timeout", &ms(config.jobs.lock_timeout)])
            .args([
                "--retry-for",
                &format!("{}s", config.jobs.retry_for.as_secs()),
            ])
            .args(["--key-prefix", &config.shard_prefix, "--group", &k.group])
            .args(["--shards", &config.shards.to_string()]);
        if config.shards <= 1 {
            // Each name as the bench has it; a sharded worker names every key itself.
            cmd.args(["--pool-key", &k.pool, "--data-key", &k.data])
                .args(["--stream-key", &k.stream, "--dead-key", &k.dead]);
        }
        for r in &config.jobs.max_rates {
            let rate = format!("{}/s", r.per_second);
            cmd.arg("--max-rate").arg(match &r.event {
                Some(e) => format!("{e}={rate}"),
                None => rate,
            });
        }
        cmd.args(["--stats-interval", "5s"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let spawned_ms = delay_worker::now_ms();
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        let pid = child.id();
        CHILD_PID.store(pid, Ordering::SeqCst);
        Ok(WorkerChild {
            child: Some(child),
            pid,
            log: log.to_path_buf(),
            spawned_ms,
        })
    }

    /// Fails with the worker's last log line if it has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        let Some(c) = self.child.as_mut() else {
            bail!("the worker is not running");
        };
        if let Some(status) = c.try_wait()? {
            self.child = None;
            bail!(
                "the worker exited ({status}): {} (log: {})",
                last_line(&self.log),
                self.log.display()
            );
        }
        Ok(())
    }

    /// Waits until the worker's reader has written its heartbeat: it has connected,
    /// checked the schema, prepared its handlers and joined the group. With shards, the
    /// last shard's heartbeat (the reader starts them in order).
    pub fn wait_ready(
        &mut self,
        con: &mut delay_worker::store::Con,
        shards: &[Keys],
    ) -> Result<()> {
        let started = Instant::now();
        let key = shards.last().context("no key set")?.heartbeat(CONSUMER);
        loop {
            self.check_alive()?;
            let up: bool = redis::cmd("EXISTS").arg(&key).query(con)?;
            if up {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "the worker wrote no heartbeat within {}s (log: {})",
                    START_TIMEOUT.as_secs(),
                    self.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`STOP_GRACE`].
    pub fn stop(mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        signal(self.pid, "TERM");
        let started = Instant::now();
        while started.elapsed() < STOP_GRACE {
            if let Ok(Some(_)) = c.try_wait() {
                CHILD_PID.store(0, Ordering::SeqCst);
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        log::warn!("the worker did not stop within {STOP_GRACE:?}; killing it");
        let _ = c.kill();
        let _ = c.wait();
        CHILD_PID.store(0, Ordering::SeqCst);
    }
}

impl Drop for WorkerChild {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // Errors only mean it has already gone.
            let _ = c.kill();
            let _ = c.wait();
            CHILD_PID.store(0, Ordering::SeqCst);
        }
    }
}

/// SIGKILL from the signal handler (std has only `Child::kill`, which needs the handle).
pub fn kill_now(pid: u32) {
    signal(pid, "KILL");
}

/// `kill -<sig> <pid>`: the standard library sends only SIGKILL, and a graceful stop
/// needs SIGTERM. Failure only means the process is gone.
fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)");
    line.chars().take(400).collect()
}

// ---- /proc ------------------------------------------------------------------------------

/// Clock ticks per second of the /proc CPU figures (`getconf CLK_TCK`, 100 on Linux).
pub fn clk_tck() -> f64 {
    static TCK: OnceLock<f64> = OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The fields of a /proc stat line after `(comm)`: index 0 is the state, 1 the ppid,
/// 11 utime, 12 stime, 13 cutime, 14 cstime.
fn stat_fields(path: &str) -> Option<(String, Vec<u64>)> {
    let s = std::fs::read_to_string(path).ok()?;
    let open = s.find('(')?;
    let close = s.rfind(')')?;
    let comm = s[open + 1..close].to_string();
    let fields = s[close + 1..]
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    Some((comm, fields))
}

/// utime + stime of a process (all its threads), in ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let (_, f) = stat_fields(&format!("/proc/{pid}/stat"))?;
    Some(f.get(11)? + f.get(12)?)
}

/// This process's CPU (the producer), in ticks.
pub fn own_cpu_ticks() -> Option<u64> {
    cpu_ticks(std::process::id())
}

/// CPU seconds per thread role of the worker: `workers` (the pool), `reader`, `mover`,
/// `other` (main, metrics, ...). Read just before the worker is stopped.
pub fn thread_cpu(pid: u32) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let path = format!("{}/stat", t.path().display());
        let Some((comm, f)) = stat_fields(&path) else {
            continue;
        };
        let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
        let role = if comm.starts_with("worker-") {
            "workers"
        } else if comm == "reader" || comm == "mover" {
            comm.as_str()
        } else {
            "other"
        };
        *out.entry(role.to_string()).or_insert(0.0) += ticks as f64 / clk_tck();
    }
    out
}

/// A line of /proc/<pid>/status in kB (`VmRSS`, `VmHWM`).
pub fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Busy and total jiffies of the whole machine (/proc/stat), for its load in %.
pub fn machine_ticks() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest is already in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// Samples the worker's VmRSS every [`RSS_EVERY`] on its own thread; `finish` returns
/// the largest sample of each second, in kB (its max is the peak; the series shows
/// whether memory stays flat). Stops with `finish` or when the process is gone.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<Vec<u64>>>,
}

impl RssSampler {
    pub fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        // A failed spawn only costs the memory figures.
        let handle = std::thread::Builder::new()
            .name("bench-rss".into())
            .spawn(move || {
                let t0 = Instant::now();
                let mut per_s: Vec<u64> = Vec::new();
                while !s.load(Ordering::Relaxed) {
                    let Some(kb) = status_kb(pid, "VmRSS") else {
                        break;
                    };
                    let sec = t0.elapsed().as_secs() as usize;
                    if per_s.len() <= sec {
                        per_s.resize(sec + 1, 0);
                    }
                    per_s[sec] = per_s[sec].max(kb);
                    std::thread::sleep(RSS_EVERY);
                }
                per_s
            })
            .ok();
        RssSampler { stop, handle }
    }

    pub fn finish(mut self) -> Vec<u64> {
        self.halt()
    }

    fn halt(&mut self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The PostgreSQL server's pid, from its `postmaster.pid` (local servers only).
pub fn postmaster_pid(db: &mut postgres::Client) -> Option<u32> {
    let dir: String = db.query_one("SHOW data_directory", &[]).ok()?.get(0);
    let text = std::fs::read_to_string(Path::new(&dir).join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}

/// CPU ticks of the whole PostgreSQL server: the postmaster, its live children, and the
/// children that have exited (their CPU is in the postmaster's cutime/cstime).
pub fn postgres_ticks(postmaster: u32) -> Option<u64> {
    let (_, f) = stat_fields(&format!("/proc/{postmaster}/stat"))?;
    let mut ticks: u64 = f.iter().skip(11).take(4).sum();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some((_, f)) = stat_fields(&format!("/proc/{pid}/stat")) {
            if f.get(1) == Some(&(postmaster as u64)) {
                ticks += f.iter().skip(11).take(4).sum::<u64>();
            }
        }
    }
    Some(ticks)
}

/// The text of `INFO <section>` of every server behind the connection, by node: one
/// server's under `"redis"`, each master's of a Redis Cluster under its address (redis-rs
/// sends INFO to every master and answers with a map of node to reply).
pub fn info_by_node(
    con: &mut delay_worker::store::Con,
    section: &str,
) -> Result<BTreeMap<String, String>> {
    let v: redis::Value = redis::cmd("INFO").arg(section).query(con)?;
    let mut out = BTreeMap::new();
    match v {
        redis::Value::Map(nodes) => {
            for (node, reply) in &nodes {
                if let (Some(n), Some(r)) = (text(Some(node)), info_text(reply)) {
                    out.insert(n, r);
                }
            }
        }
        other => {
            out.insert(
                "redis".to_string(),
                info_text(&other).context("INFO: no text in the reply")?,
            );
        }
    }
    Ok(out)
}

fn info_text(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::VerbatimString { text, .. } => Some(text.clone()),
        other => text(Some(other)),
    }
}

/// `field:value` of an INFO text.
pub fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim())
    })
}

/// CPU seconds of each Redis server (INFO cpu: user + sys, main process and children),
/// by node as [`info_by_node`] names them: on a Redis Cluster, every master.
pub fn redis_cpu_s(con: &mut delay_worker::store::Con) -> Option<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for (node, info) in info_by_node(con, "cpu").ok()? {
        let sys: f64 = info_field(&info, "used_cpu_sys")?.parse().ok()?;
        let user: f64 = info_field(&info, "used_cpu_user")?.parse().ok()?;
        out.insert(node, sys + user);
    }
    Some(out)
}

/// A master of the Redis the bench runs on and the hash slots it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Master {
    /// `host:port` as INFO's replies name it (`"redis"` for one server).
    pub addr: String,
    pub slots: Vec<(u16, u16)>,
}

impl Master {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }
}

/// The masters: one server is one master holding every slot; a Redis Cluster's come
/// from `CLUSTER NODES`.
pub fn masters(con: &mut delay_worker::store::Con) -> Result<Vec<Master>> {
    if !con.is_cluster() {
        return Ok(vec![Master {
            addr: "redis".into(),
            slots: vec![(0, 16383)],
        }]);
    }
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(con)?;
    Ok(parse_cluster_nodes(&nodes))
}

/// The masters of a `CLUSTER NODES` reply (`<id> <ip:port@cport[,hostname]> <flags>
/// <master> <ping> <pong> <epoch> <state> <slot>...`), in address order.
pub fn parse_cluster_nodes(nodes: &str) -> Vec<Master> {
    let mut out: Vec<Master> = nodes
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = f.get(2)?;
            if !flags.split(',').any(|x| x == "master") || flags.contains("fail") {
                return None;
            }
            let addr = f.get(1)?.split(['@', ',']).next()?.to_string();
            let slots = f
                .iter()
                .skip(8)
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(Master { addr, slots })
        })
        .collect();
    out.sort_by(|a, b| a.addr.cmp(&b.addr));
    out
}

// ---- Redis: is everything drained? ------------------------------------------------------

/// The queue as the bench sees it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct QueueState {
    /// Members still in the delay pool / messages in its hash.
    pub pool: u64,
    pub data: u64,
    /// Entries in the stream.
    pub stream: u64,
    /// Entries read by the group (Redis 7), when known.
    pub entries_read: Option<u64>,
    /// Delivered but not acknowledged.
    pub pending: u64,
    /// Whether the stream has entries the group has not been given yet.
    pub undelivered: bool,
    pub dead: u64,
}

impl QueueState {
    /// The figures of several shards added up (a field unknown in one is unknown).
    pub fn total(shards: &[QueueState]) -> QueueState {
        let mut t = QueueState {
            entries_read: Some(0),
            ..Default::default()
        };
        for s in shards {
            t.pool += s.pool;
            t.data += s.data;
            t.stream += s.stream;
            t.entries_read = t.entries_read.zip(s.entries_read).map(|(a, b)| a + b);
            t.pending += s.pending;
            t.undelivered |= s.undelivered;
            t.dead += s.dead;
        }
        t
    }

    /// Entries the group has been given: the shard's share of the work.
    pub fn delivered(&self) -> u64 {
        self.entries_read.unwrap_or(self.stream)
    }

    /// Nothing left to move, deliver or acknowledge.
    pub fn drained(&self) -> bool {
        self.pool == 0 && self.pending == 0 && !self.undelivered
    }

    pub fn describe(&self) -> String {
        format!(
            "pool {}, stream {} (undelivered: {}), pending {}, dead letters {}",
            self.pool,
            self.stream,
            if self.undelivered { "yes" } else { "no" },
            self.pending,
            self.dead
        )
    }
}

fn field<'a>(v: &'a redis::Value, name: &str) -> Option<&'a redis::Value> {
    use redis::Value;
    let is = |k: &Value| match k {
        Value::BulkString(b) => b == name.as_bytes(),
        Value::SimpleString(s) => s == name,
        _ => false,
    };
    match v {
        Value::Array(items) => items
            .chunks(2)
            .find(|kv| kv.len() == 2 && is(&kv[0]))
            .map(|kv| &kv[1]),
        Value::Map(pairs) => pairs.iter().find(|(k, _)| is(k)).map(|(_, v)| v),
        _ => None,
    }
}

fn text(v: Option<&redis::Value>) -> Option<String> {
    match v? {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

pub fn queue_state(con: &mut delay_worker::store::Con, keys: &Keys) -> Result<QueueState> {
    let (pool, data, dead, exists): (u64, u64, u64, bool) = redis::pipe()
        .cmd("ZCARD")
        .arg(&keys.pool)
        .cmd("HLEN")
        .arg(&keys.data)
        .cmd("XLEN")
        .arg(&keys.dead)
        .cmd("EXISTS")
        .arg(&keys.stream)
        .query(con)?;
    let mut st = QueueState {
        pool,
        data,
        dead,
        ..Default::default()
    };
    if !exists {
        return Ok(st);
    }
    let info: redis::Value = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(&keys.stream)
        .query(con)?;
    st.stream = text(field(&info, "length"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let last_generated = text(field(&info, "last-generated-id")).unwrap_or_default();
    let groups: redis::Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&keys.stream)
        .query(con)?;
    let list = match &groups {
        redis::Value::Array(g) => g.as_slice(),
        _ => &[],
    };
    let group = list
        .iter()
        .find(|g| text(field(g, "name")).as_deref() == Some(keys.group.as_str()));
    match group {
        Some(g) => {
            st.pending = text(field(g, "pending"))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            st.entries_read = text(field(g, "entries-read")).and_then(|s| s.parse().ok());
            let delivered = text(field(g, "last-delivered-id")).unwrap_or_default();
            st.undelivered = st.stream > 0 && delivered != last_generated;
        }
        None => st.undelivered = st.stream > 0,
    }
    Ok(st)
}

/// Job key -> when the mover appended it to the stream (its entry id's milliseconds, Redis
/// clock), the first time if it was retried. Splits lateness into the mover's part and
/// the rest.
pub fn moved_times(
    con: &mut delay_worker::store::Con,
    shards: &[Keys],
) -> Result<std::collections::HashMap<String, i64>> {
    let mut out = std::collections::HashMap::new();
    for keys in shards {
        moved_times_of(con, keys, &mut out)?;
    }
    Ok(out)
}

fn moved_times_of(
    con: &mut delay_worker::store::Con,
    keys: &Keys,
    out: &mut std::collections::HashMap<String, i64>,
) -> Result<()> {
    const PAGE: usize = 5000;
    let mut start = "-".to_string();
    loop {
        let page: redis::Value = redis::cmd("XRANGE")
            .arg(&keys.stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(PAGE)
            .query(con)?;
        let redis::Value::Array(entries) = page else {
            break;
        };
        let mut last = None;
        for e in &entries {
            let redis::Value::Array(parts) = e else {
                continue;
            };
            let (Some(id), Some(fields)) = (text(parts.first()), parts.get(1)) else {
                continue;
            };
            let ms = id.split('-').next().and_then(|m| m.parse::<i64>().ok());
            if let (Some(key), Some(ms)) = (text(field(fields, "key")), ms) {
                out.entry(key).or_insert(ms);
            }
            last = Some(id);
        }
        match last {
            Some(id) if entries.len() == PAGE => start = format!("({id}"),
            _ => break,
        }
    }
    Ok(())
}

/// Deletes the queue keys of every shard, the bench consumer's heartbeats and the
/// recorded shard count: a scenario starts empty, with any `--shards`. One call per
/// shard: on a Redis Cluster each shard's keys share a slot, two shards' do not.
pub fn reset_queue(con: &mut delay_worker::store::Con, shards: &[Keys]) -> Result<()> {
    for keys in shards {
        let heartbeat = keys.heartbeat(CONSUMER);
        delay_worker::store::delete_keys(
            con,
            &[
                &keys.pool,
                &keys.data,
                &keys.jobs,
                &keys.stream,
                &keys.dead,
                &heartbeat,
            ],
        )
        .context("cannot reset the queue keys")?;
    }
    if let Some(k) = shards.first() {
        delay_worker::store::delete_keys(con, &[&k.shard_count])
            .context("cannot reset the shard count")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{parse_cluster_nodes, Master};

    #[test]
    fn masters_come_from_cluster_nodes() {
        // A lone node that has met no other lists itself as ":port"; replicas, failed
        // masters and slots being moved ("[...]") are left out.
        let nodes = "\
07c3 127.0.0.1:7412@17412 master - 0 1700000000000 2 connected 5461-10922 7000
e7d1 :7401@17401 myself,master - 0 0 1 connected 0-5460 [5461->-07c3]
a1b2 127.0.0.1:7413@17413,host3 slave 07c3 0 1700000000000 2 connected
c3d4 127.0.0.1:7414@17414 master,fail - 0 1700000000000 3 disconnected 10923-16383
";
        let m = parse_cluster_nodes(nodes);
        assert_eq!(
            m,
            vec![
                Master {
                    addr: "127.0.0.1:7412".into(),
                    slots: vec![(5461, 10922), (7000, 7000)],
                },
                Master {
                    addr: ":7401".into(),
                    slots: vec![(0, 5460)],
                },
            ]
        );
        assert!(m[1].serves(5460) && !m[1].serves(5461) && m[0].serves(7000));
    }
}
