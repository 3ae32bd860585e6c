//! The benchmark's bulk load (`store::pool::push_many`, one script call per batch) and
//! `worker bench` on a Redis Cluster of three masters with `--shards 3`: the backlog
//! loaded per shard, the worker child started on the same URL and shards, the books
//! exact across shards, and each shard's jobs counted on the master serving its slot.

use crate::support::*;
use delay_worker::keys::{shard_of, slot, Keys};
use delay_worker::store::{self, StoreError};
use postgres::NoTls;
use redis::Connection;
use serde_json::Value as Json;
use std::time::Duration;

fn zcard(con: &mut Connection, key: &str) -> u64 {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

fn hget(con: &mut Connection, key: &str, field: &str) -> Option<String> {
    redis::cmd("HGET").arg(key).arg(field).query(con).unwrap()
}

#[test]
fn push_many_loads_in_batches_and_reschedules_a_key_pushed_again() {
    let redis = RedisServer::start();
    let mut con = redis.con();
    let k = Keys::default();
    let jobs = |n: usize, tag: &'static str| {
        (0..n).map(move |i| {
            (
                format!("job:{i}"),
                format!("{{\"m\":\"{tag}{i}\"}}"),
                i as i64,
            )
        })
    };
    // 2,500 jobs in calls of 1,000: three calls, the last one partial.
    let (pushed, again) = store::pool::push_many(&mut con, &k, jobs(2500, "a"), 1000).unwrap();
    assert_eq!((pushed, again), (2500, 0));
    assert_eq!(zcard(&mut con, &k.pool), 2500);
    let score: f64 = redis::cmd("ZSCORE")
        .arg(&k.pool)
        .arg("job:2499")
        .query(&mut con)
        .unwrap();
    assert_eq!(score, 2499.0);
    // The first 10 again: rescheduled with the newer message, not duplicated.
    let (pushed, again) = store::pool::push_many(&mut con, &k, jobs(10, "b"), 4).unwrap();
    assert_eq!((pushed, again), (10, 10));
    assert_eq!(zcard(&mut con, &k.pool), 2500);
    assert_eq!(
        hget(&mut con, &k.data, "job:3").as_deref(),
        Some("{\"m\":\"b3\"}")
    );
    assert_eq!(
        hget(&mut con, &k.data, "job:10").as_deref(),
        Some("{\"m\":\"a10\"}")
    );

    // A data key of another type: the call writes nothing and names the key.
    let other = Keys::with_prefix("other");
    redis::cmd("SET")
        .arg(&other.data)
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    let r = store::pool::push_many(&mut con, &other, jobs(3, "c"), 1000);
    match r {
        Err(StoreError::WrongType { key, .. }) => assert_eq!(key, other.data),
        r => panic!("expected a WRONGTYPE on {}, got {r:?}", other.data),
    }
    assert_eq!(zcard(&mut con, &other.pool), 0);
}

/// Three redis-servers made one cluster of three masters (no replicas), the slots in
/// three even ranges as `redis-cli --cluster create` gives them.
struct Cluster {
    nodes: Vec<RedisServer>,
}

impl Cluster {
    fn start() -> Cluster {
        // The bus port given, not the port + 10000 (a free port may be above 55535). A
        // port another test takes between its pick and the node's bind: pick again.
        let node = || {
            (0..5)
                .find_map(|_| {
                    let bus = free_port();
                    RedisServer::try_start_with(&[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-port",
                        &bus.to_string(),
                        "--appendonly",
                        "no",
                    ])
                    .map(|n| (n, bus))
                })
                .expect("a cluster node on a free port within 5 tries")
        };
        let (nodes, buses): (Vec<RedisServer>, Vec<u16>) = (0..3).map(|_| node()).unzip();
        let ranges = [(0, 5460), (5461, 10922), (10923, 16383)];
        for (n, (a, b)) in nodes.iter().zip(ranges) {
            redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(a)
                .arg(b)
                .query::<()>(&mut n.con())
                .unwrap();
        }
        let mut first = nodes[0].con();
        for (n, bus) in nodes.iter().zip(&buses).skip(1) {
            redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(n.port)
                .arg(bus)
                .query::<()>(&mut first)
                .unwrap();
        }
        wait_until(Duration::from_secs(20), "the cluster to be ok", || {
            nodes.iter().all(|n| {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut n.con())
                    .unwrap_or_default();
                info.contains("cluster_state:ok") && info.contains("cluster_known_nodes:3")
            })
        });
        Cluster { nodes }
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The node serving a slot (by the ranges above).
    fn node_of(&self, slot: u16) -> &RedisServer {
        &self.nodes[match slot {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        }]
    }
}

/// A migrated database whose name says it is a benchmark's (the bench refuses others),
/// dropped at the end.
struct BenchDb {
    name: String,
    url: String,
}

impl BenchDb {
    fn new(redis: &str) -> BenchDb {
        let name = format!("dwt_bench_{}", std::process::id());
        let admin = admin_url();
        let mut a = postgres::Client::connect(&admin, NoTls).unwrap();
        a.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .unwrap();
        a.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
        let url = format!("{base}/{name}");
        let out = run_worker(&["migrate"], redis, &url);
        assert!(out.status.success(), "migrate: {}", text(&out.stderr));
        BenchDb { name, url }
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        if let Ok(mut a) = postgres::Client::connect(&admin_url(), NoTls) {
            let _ = a.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

#[test]
fn the_bench_runs_on_a_three_master_cluster_with_shards() {
    let cluster = Cluster::start();
    let url = cluster.url();
    // `migrate` works on PostgreSQL only; one node's plain URL spares it the key checks.
    let db = BenchDb::new(&cluster.nodes[0].url());
    let dir = tempdir();
    let out_json = dir.join("report.json");
    let (engine_jobs, backlog_jobs) = (3000u64, 300u64);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_worker"))
        .env("REDIS_URL", &url)
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .env("DW_BENCH_WORKER_LOG", "warn")
        .args(["bench", "--scenario", "engine,backlog", "--no-ceilings"])
        .args(["--shards", "3", "--threads", "2", "--timeout", "60s"])
        .args(["--engine-jobs", &engine_jobs.to_string()])
        .args(["--backlog-jobs", &backlog_jobs.to_string()])
        .arg("--out")
        .arg(&out_json)
        .output()
        .unwrap();
    let shown = format!("{}\n{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "worker bench failed:\n{shown}");
    let report: Json = serde_json::from_slice(&std::fs::read(&out_json).unwrap()).unwrap();
    assert_eq!(
        report["environment"]["redis_topology"], "cluster",
        "{shown}"
    );
    assert_eq!(report["environment"]["redis_masters"], 3, "{shown}");
    assert_eq!(report["environment"]["shards"], 3, "{shown}");

    let shards = Keys::default().sharded("mq", 3);
    for (s, n) in report["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .zip([engine_jobs, backlog_jobs])
    {
        let name = s["name"].as_str().unwrap();
        assert_eq!(s["pass"], true, "{name}: {shown}");
        let spread = &s["spread"];
        let loads = spread["shards"].as_array().unwrap();
        assert_eq!(loads.len(), 3, "{name}: {spread}");
        // Each shard did exactly the jobs whose key crc32 puts in it, on its slot's master.
        let keys: Vec<String> = match name {
            "engine" => (1..=n).map(|i| format!("bench.noop:{i}")).collect(),
            _ => (1..=n).map(|i| format!("order.timeout:BO{i:09}")).collect(),
        };
        for (i, load) in loads.iter().enumerate() {
            let want = keys
                .iter()
                .filter(|k| shard_of(k.as_bytes(), 3) == i)
                .count() as u64;
            assert_eq!(load["jobs"], want, "{name} shard {i}: {spread}");
            let slot_i = slot(&shards[i].pool);
            assert_eq!(load["slot"], slot_i, "{name} shard {i}");
            let master = format!("127.0.0.1:{}", cluster.node_of(slot_i).port);
            assert_eq!(
                load["master"],
                master.as_str(),
                "{name} shard {i}: {spread}"
            );
        }
        let masters = spread["masters"].as_array().unwrap();
        assert_eq!(masters.len(), 3, "{spread}");
        let total: u64 = masters.iter().map(|m| m["jobs"].as_u64().unwrap()).sum();
        assert_eq!(total, n, "{name}: {spread}");
        assert!(
            masters.iter().all(|m| m["redis_cpu_s"].is_number()),
            "every master's CPU read: {spread}"
        );
    }
    let books = &report["scenarios"][1]["books"];
    assert_eq!(books["cancelled"], backlog_jobs, "{books}");
    assert_eq!(books["inbox_rows"], backlog_jobs, "{books}");
    assert!(report["model"]["lines"].as_array().unwrap().len() >= 4);

    // Nothing left in any shard: every pool drained on its own master.
    for k in &shards {
        let mut con = cluster.node_of(slot(&k.pool)).con();
        assert_eq!(zcard(&mut con, &k.pool), 0, "{}", k.pool);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "dw-bench-cluster-{}-{}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}
