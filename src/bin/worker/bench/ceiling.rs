//! The ceilings every figure is compared with, measured in the same run on the same
//! servers:
//!
//! - Redis: `redis-benchmark -n 200000 -P 16 -q XADD bench:stream '*' msg x`, the rate
//!   at which this Redis appends to a stream (the engine scenario's ceiling);
//! - PostgreSQL: `pgbench` running the very transaction the worker runs for one
//!   `order.timeout` job (sql/bench/order_timeout.pgbench filled in with the handler's
//!   SQL), at `--threads` clients, prepared statements as the worker's, against freshly
//!   seeded pending orders so each transaction really cancels one (the backlog
//!   scenario's ceiling). A discarded warm-up run goes first: a fresh cluster's first
//!   write load is much slower (WAL segments created, caches cold);
//! - PostgreSQL, set-based: the same work 8 orders per transaction, as the worker's set
//!   form does it (sql/bench/order_timeout_set.pgbench): the database's real limit for a
//!   backlog.
//!
//! A missing tool is not fatal: that ceiling is reported as unavailable with the reason.

use super::{shop, BenchArgs, CeilingKind};
use anyhow::{bail, Context, Result};
use delay_worker::config::Config;
use delay_worker::handlers::sql::SqlHandler;
use delay_worker::Shutdown;
use redis::ConnectionAddr;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;

const PGBENCH_TEMPLATE: &str = include_str!("../../../../sql/bench/order_timeout.pgbench");
const PGBENCH_SET_TEMPLATE: &str = include_str!("../../../../sql/bench/order_timeout_set.pgbench");
const ORDER_TIMEOUT_SQL: &str = include_str!("../../../../sql/handlers/order.timeout.sql");
/// Orders per transaction of the set-based ceiling.
pub const SET_ORDERS: u64 = 8;

#[derive(Debug, Clone, Default, Serialize)]
pub struct PgbenchFigures {
    pub tps: f64,
    pub transactions: i64,
    pub failed: i64,
    /// Orders the run cancelled: equal to `transactions` when every transaction found a
    /// pending order of its own (else raise --ceiling-orders).
    pub cancelled: i64,
    pub latency_avg_ms: Option<f64>,
    /// The discarded warm-up run before it (a fresh cluster is slower at first).
    pub warmup_tps: Option<f64>,
    pub clients: usize,
    pub command: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Ceilings {
    pub redis_xadd_per_s: Option<f64>,
    /// How the XADD ceiling was measured (one server, or `--cluster` over every master).
    pub redis_xadd_command: Option<String>,
    pub redis_error: Option<String>,
    pub pgbench: Option<PgbenchFigures>,
    pub pgbench_error: Option<String>,
    /// The same work in sets of [`SET_ORDERS`] orders per transaction.
    pub pgbench_set: Option<PgbenchFigures>,
    pub pgbench_set_error: Option<String>,
}

impl Ceilings {
    pub fn pgbench_tps(&self) -> Option<f64> {
        self.pgbench.as_ref().map(|p| p.tps)
    }

    /// Orders the set-based ceiling cancelled per second.
    pub fn pgbench_set_orders_per_s(&self) -> Option<f64> {
        self.pgbench_set.as_ref().map(|p| p.tps * SET_ORDERS as f64)
    }
}

/// XADDs redis-benchmark sends.
const XADD_REQUESTS: u32 = 200_000;
const XADD_KEY: &str = "bench:stream";
/// On a Redis Cluster: redis-benchmark puts a tag of each node in place of `{tag}`.
const XADD_KEY_CLUSTER: &str = "bench:{tag}:stream";
const XADD_KEY_PATTERN: &str = "bench:{*}:stream";

pub fn measure(
    config: &Config,
    args: &BenchArgs,
    db: &mut postgres::Client,
    redis: &delay_worker::store::Redis,
    out_dir: &Path,
    stop: &Shutdown,
) -> Result<Ceilings> {
    let mut c = Ceilings::default();
    if args.measures(CeilingKind::Redis) {
        println!("ceiling: redis-benchmark XADD ...");
        match redis_xadd(config, redis) {
            Ok((v, command)) => {
                c.redis_xadd_per_s = Some(v);
                c.redis_xadd_command = Some(command);
            }
            Err(e) => c.redis_error = Some(format!("{e:#}")),
        }
    }
    if stop.is_set() {
        bail!("interrupted");
    }
    if !args.measures(CeilingKind::Pgbench) {
        return Ok(c);
    }
    println!(
        "ceiling: pgbench order.timeout, {} clients, {}s after a {}s warm-up ({} orders seeded each) ...",
        config.threads,
        args.ceiling_time.as_secs(),
        WARMUP_SECS.min(args.ceiling_time.as_secs()),
        args.ceiling_orders
    );
    match pgbench(config, args, db, out_dir, Shape::One) {
        Ok(f) => c.pgbench = Some(f),
        Err(e) => c.pgbench_error = Some(format!("{e:#}")),
    }
    if stop.is_set() {
        bail!("interrupted");
    }
    println!(
        "ceiling: pgbench order.timeout sets of {SET_ORDERS}, {} clients, {}s after a warm-up ...",
        config.threads,
        args.ceiling_time.as_secs(),
    );
    match pgbench(config, args, db, out_dir, Shape::Set) {
        Ok(f) => c.pgbench_set = Some(f),
        Err(e) => c.pgbench_set_error = Some(format!("{e:#}")),
    }
    Ok(c)
}

/// A tool on PATH, or the newest PostgreSQL server's bin directory for pgbench.
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    if let Some(p) = std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
    {
        return Some(p);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.is_file())
        .collect();
    dirs.sort_by_key(|p| {
        p.components()
            .nth(4)
            .and_then(|c| c.as_os_str().to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.pop()
}

/// The XADD ceiling and the command that measured it. On a Redis Cluster
/// `redis-benchmark --cluster` spreads its clients over every master (the `{tag}` in the
/// key name is replaced by a tag of each client's node): the cluster's aggregate.
fn redis_xadd(config: &Config, redis: &delay_worker::store::Redis) -> Result<(f64, String)> {
    let tool = find_tool("redis-benchmark")
        .context("redis-benchmark not found (Debian package redis-tools)")?;
    let mut cmd = Command::new(tool);
    let (info, key) = match redis {
        delay_worker::store::Redis::Single(client) => {
            (client.get_connection_info().clone(), XADD_KEY)
        }
        delay_worker::store::Redis::Cluster(_) => {
            let masters = super::child::masters(&mut redis.connect()?)?;
            if masters.len() > 1 {
                cmd.arg("--cluster");
                (seed_node(&config.redis_url)?, XADD_KEY_CLUSTER)
            } else {
                // redis-benchmark --cluster refuses a cluster of one node: it holds
                // every slot, so plain commands to it are the same thing.
                (seed_node(&config.redis_url)?, XADD_KEY)
            }
        }
        delay_worker::store::Redis::Sentinel(_) => {
            bail!("redis-benchmark: the bench measures the ceiling on a server or a cluster, not through Sentinel")
        }
    };
    match info.addr() {
        ConnectionAddr::Tcp(host, port) => {
            cmd.args(["-h", host, "-p", &port.to_string()]);
        }
        ConnectionAddr::Unix(path) => {
            cmd.arg("-s").arg(path);
        }
        _ => bail!("redis-benchmark: TLS connections are not supported by the bench"),
    }
    let r = info.redis_settings();
    if let Some(user) = r.username() {
        cmd.args(["--user", user]);
    }
    if let Some(pw) = r.password() {
        // By environment (redis-cli and redis-benchmark read it), not in `ps`.
        cmd.env("REDISCLI_AUTH", pw);
    }
    if matches!(redis, delay_worker::store::Redis::Single(_)) {
        cmd.args(["--dbnum", &r.db().to_string()]);
    }
    cmd.args(["-n", &XADD_REQUESTS.to_string(), "-P", "16", "-q"])
        .args(["XADD", key, "*", "msg", "x"]);
    let shown = format!(
        "redis-benchmark {}",
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = cmd.output().context("cannot run redis-benchmark")?;
    let mut con = redis.connect()?;
    if cmd.get_args().any(|a| a == "--cluster") {
        // One stream per master, each under the tag redis-benchmark chose for it.
        let made: Vec<String> = redis::cmd("KEYS").arg(XADD_KEY_PATTERN).query(&mut con)?;
        for k in &made {
            delay_worker::store::delete_keys(&mut con, &[k.as_str()])?;
        }
    } else {
        delay_worker::store::delete_keys(&mut con, &[XADD_KEY])?;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "redis-benchmark failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    // "XADD bench:stream * msg x: 465116.25 requests per second, p50=1.015 msec"
    let rate = stdout
        .split(['\r', '\n'])
        .filter_map(|l| {
            let (before, _) = l.split_once(" requests per second")?;
            before.rsplit(' ').next()?.parse::<f64>().ok()
        })
        .next_back()
        .with_context(|| format!("no rate in the redis-benchmark output: {}", stdout.trim()))?;
    Ok((rate, shown))
}

/// The first node of a `redis+cluster://` URL, with the URL's user and password.
fn seed_node(url: &str) -> Result<redis::ConnectionInfo> {
    use redis::IntoConnectionInfo;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    let (auth, hosts) = match rest.rfind('@') {
        Some(i) => (&rest[..=i], &rest[i + 1..]),
        None => ("", rest),
    };
    let first = hosts.split(',').next().unwrap_or("");
    format!("redis://{auth}{first}/")
        .as_str()
        .into_connection_info()
        .context("the cluster URL's first node")
}

/// Which transaction a pgbench ceiling runs: one order, or a set of [`SET_ORDERS`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    One,
    Set,
}

/// A statement without its comment lines (they mention `$1` and `;`).
fn without_comments(sql: &str) -> String {
    let lines: Vec<&str> = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--") && !l.trim().is_empty())
        .collect();
    lines
        .join("\n")
        .trim_end()
        .trim_end_matches(';')
        .to_string()
}

fn order_timeout() -> SqlHandler {
    SqlHandler::parse("order.timeout.sql", ORDER_TIMEOUT_SQL).expect("the built-in handler parses")
}

/// The pgbench script: the template with the handler's statement, its `$1` built from
/// `:id`.
pub fn pgbench_script() -> String {
    let handler = without_comments(order_timeout().sql())
        .replace("$1", "jsonb_build_object('order_id', :id::bigint)");
    PGBENCH_TEMPLATE.replace("@ORDER_TIMEOUT@", &handler)
}

/// The set-based pgbench script: the template with the handler's set form, its `$1` the
/// array of the `:size` jobs from `:id` (`-D size=N`).
pub fn pgbench_set_script() -> String {
    let set = order_timeout()
        .set_sql()
        .map(without_comments)
        .expect("order.timeout has a set form");
    let jobs = "(SELECT jsonb_agg(jsonb_build_object('i', g - :id::bigint, 'payload', jsonb_build_object('order_id', g))) \
         FROM generate_series(:id::bigint, :id::bigint + :size::bigint - 1) g)";
    PGBENCH_SET_TEMPLATE.replace("@ORDER_TIMEOUT_SET@", &set.replace("$1", jobs))
}

fn pgbench(
    config: &Config,
    args: &BenchArgs,
    db: &mut postgres::Client,
    out_dir: &Path,
    shape: Shape,
) -> Result<PgbenchFigures> {
    let tool = find_tool("pgbench").context(
        "pgbench not found (Debian: postgresql-contrib or the postgresql server package)",
    )?;
    let (name, text, orders) = match shape {
        Shape::One => (
            "order_timeout.pgbench",
            pgbench_script(),
            args.ceiling_orders,
        ),
        // A set transaction cancels 8 orders at several times the one-order rate.
        Shape::Set => (
            "order_timeout_set.pgbench",
            pgbench_set_script(),
            args.ceiling_orders * SET_ORDERS / 2,
        ),
    };
    let script = out_dir.join(name);
    std::fs::write(&script, text).with_context(|| format!("cannot write {}", script.display()))?;
    let secs = args.ceiling_time.as_secs().max(1);

    // Warm-up, discarded: the first write load on a fresh cluster pays for creating WAL
    // segments and for cold caches (we saw 3,800 tps cold against 6,700 warm on the same
    // machine). The ceiling is the steady state, as the scenarios after it see it.
    let load = Load {
        clients: config.threads,
        size: SET_ORDERS,
        rate: None,
        retry_deadlocks: false,
    };
    shop::reset(db)?;
    shop::seed(db, orders, args.skus)?;
    let warmup = run_pgbench(&tool, config, &script, WARMUP_SECS.min(secs), load)?;

    shop::reset(db)?;
    shop::seed(db, orders, args.skus)?;
    let mut f = run_pgbench(&tool, config, &script, secs, load)?;
    f.warmup_tps = Some(warmup.tps);
    f.cancelled = shop::cancelled_count(db)?;
    Ok(f)
}

/// Seconds of the discarded warm-up run.
const WARMUP_SECS: u64 = 5;

/// How a pgbench run loads the database.
#[derive(Clone, Copy)]
pub struct Load {
    pub clients: usize,
    /// Orders per transaction of the set script (`-D size`; the one-order script has none).
    pub size: u64,
    /// Transactions a second, all clients together (`-R`); `None`: as fast as it can.
    pub rate: Option<f64>,
    /// A transaction that deadlocks is run again (`--max-tries`) rather than stopping
    /// its client.
    pub retry_deadlocks: bool,
}

/// The set-based script as the shop scenario runs it beside the shop, written into
/// `out_dir`, and pgbench. A set of the worker that meets the shop's locks gives up within
/// its short lock timeout (`wait_ms`) and is tried again; so does this one: a deadlock
/// with a payment (which locks in the opposite order) is found after `wait_ms`
/// (`deadlock_timeout`, which needs a superuser, as the bench's own cluster has), and
/// pgbench runs the transaction again (`--max-tries`, [`Load::retry_deadlocks`]) instead
/// of stopping. Without it the shop's payment waited the server's whole second.
pub fn shop_set_script_at(out_dir: &Path, wait_ms: u128) -> Result<(PathBuf, PathBuf)> {
    let tool = find_tool("pgbench").context(
        "pgbench not found (Debian: postgresql-contrib or the postgresql server package)",
    )?;
    let script = out_dir.join("order_timeout_set_beside_shop.pgbench");
    std::fs::write(&script, pgbench_shop_set_script(wait_ms))
        .with_context(|| format!("cannot write {}", script.display()))?;
    Ok((tool, script))
}

/// The set-based script with `deadlock_timeout` at `wait_ms` (see [`shop_set_script_at`]).
fn pgbench_shop_set_script(wait_ms: u128) -> String {
    pgbench_set_script().replacen(
        "\nBEGIN;\n",
        &format!(
            "\nBEGIN;\nSET LOCAL deadlock_timeout = '{}ms';\n",
            wait_ms.max(1)
        ),
        1,
    )
}

/// One pgbench run of the script.
pub fn run_pgbench(
    tool: &Path,
    config: &Config,
    script: &Path,
    secs: u64,
    load: Load,
) -> Result<PgbenchFigures> {
    let pg: postgres::Config = config.database_url.parse()?;
    let clients = load.clients;
    let jobs = clients.min(2);
    let mut cmd = Command::new(tool);
    for h in pg.get_hosts().iter().take(1) {
        match h {
            postgres::config::Host::Tcp(s) => cmd.env("PGHOST", s),
            postgres::config::Host::Unix(p) => cmd.env("PGHOST", p),
        };
    }
    if let Some(port) = pg.get_ports().first() {
        cmd.env("PGPORT", port.to_string());
    }
    if let Some(u) = pg.get_user() {
        cmd.env("PGUSER", u);
    }
    if let Some(pw) = pg.get_password() {
        cmd.env("PGPASSWORD", String::from_utf8_lossy(pw).into_owned());
    }
    if let Some(d) = pg.get_dbname() {
        cmd.env("PGDATABASE", d);
    }
    let mut argv = vec![
        "-n".to_string(),
        "-M".into(),
        "prepared".into(),
        "-c".into(),
        clients.to_string(),
        "-j".into(),
        jobs.to_string(),
        "-T".into(),
        secs.to_string(),
        "-D".into(),
        format!("clients={clients}"),
        "-D".into(),
        "n=0".into(),
        "-D".into(),
        format!("size={}", load.size),
        "-f".into(),
        script.display().to_string(),
    ];
    if let Some(r) = load.rate {
        argv.extend(["-R".into(), format!("{r:.1}")]);
    }
    if load.retry_deadlocks {
        argv.extend(["--max-tries".into(), "1000".into()]);
    }
    let out = cmd.args(&argv).output().context("cannot run pgbench")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err
            .lines()
            .find(|l| l.contains("error"))
            .unwrap_or(err.trim());
        bail!("pgbench failed ({}): {line}", out.status);
    }
    let number_after = |label: &str| -> Option<f64> {
        stdout.lines().find_map(|l| {
            let rest = l.trim().strip_prefix(label)?;
            rest.trim()
                .split(|c: char| c.is_whitespace() || c == '/')
                .next()?
                .parse()
                .ok()
        })
    };
    Ok(PgbenchFigures {
        tps: number_after("tps =").context("no tps in the pgbench output")?,
        transactions: number_after("number of transactions actually processed:").unwrap_or(0.0)
            as i64,
        failed: number_after("number of failed transactions:").unwrap_or(0.0) as i64,
        latency_avg_ms: number_after("latency average ="),
        clients,
        command: format!(
            "{} {}",
            tool.file_name().unwrap_or_default().to_string_lossy(),
            argv.join(" ")
        ),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pgbench_script_holds_the_handler_with_id_for_the_payload() {
        let s = super::pgbench_script();
        assert!(!s.contains("@ORDER_TIMEOUT@"));
        assert!(!s.contains("$1"));
        assert!(s.contains("jsonb_build_object('order_id', :id::bigint) ->> 'order_id'"));
        assert!(s.contains("UPDATE orders o"));
        assert!(s.trim_end().ends_with("COMMIT;"));
        assert!(!s.contains("jsonb_array_elements"), "the one-job form only");
        let s = super::pgbench_set_script();
        assert!(!s.contains('@') && !s.contains("$1"));
        assert!(s.contains("FROM jsonb_array_elements((SELECT jsonb_agg("));
        assert!(s.contains(":id::bigint + :size::bigint - 1) g"));
        assert!(s.trim_end().ends_with("COMMIT;"));
        let shop = super::pgbench_shop_set_script(20);
        assert_eq!(
            shop,
            s.replacen(
                "\nBEGIN;\n",
                "\nBEGIN;\nSET LOCAL deadlock_timeout = '20ms';\n",
                1
            )
        );
        assert_ne!(shop, s, "the BEGIN line is found");
    }
}
