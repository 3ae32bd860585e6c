//! The PHP producer library (`clients/php/`) against the real worker, with Debian's
//! `php-cli` and `php-redis` (scripts/test.sh installs them): its own tests
//! (`clients/php/tests/run.php`, against a redis-server of their own and one with a
//! replica), a shop's pushes, cancels and reschedules done by the daemon with the books
//! exact (unsharded with a legacy pool, with `--shards 3`, and on a Redis Cluster through
//! `\RedisCluster` with durable pushes), and the shard formula, key names and messages held
//! to `delay_worker::keys` and `worker push` through the vectors file both sides read
//! (`clients/php/tests/vectors.json`). Each test starts its own servers; the PHP scripts'
//! output is shown only when one fails.

use crate::support::*;
use crate::topology::{config_for, stop_and_account, Cluster};
use delay_worker::config::LegacyPool;
use delay_worker::keys::{shard_of, KeyOverrides, Keys};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

const PHP_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/php");
const WAIT: Duration = Duration::from_secs(30);

/// `php ARGS` in clients/php; panics with everything it said unless it succeeded.
fn php(args: &[&str], env: &[(&str, String)]) -> String {
    let mut cmd = Command::new("php");
    cmd.args(args).current_dir(PHP_DIR);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out: Output = cmd.output().unwrap_or_else(|e| {
        panic!("php cannot run ({e}): scripts/test.sh installs php-cli and php-redis (apt-get)")
    });
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "php {args:?} failed:\n{said}");
    text(&out.stdout)
}

/// Runs clients/php/tests/shop.php with this plan (see its header); returns what each
/// step returned.
fn shop_plan(plan: &Value) -> Vec<Value> {
    let path = std::env::temp_dir().join(format!(
        "dw-php-plan-{}-{}.json",
        std::process::id(),
        free_port()
    ));
    std::fs::write(&path, plan.to_string()).unwrap();
    let out = php(&["tests/shop.php", path.to_str().unwrap()], &[]);
    let _ = std::fs::remove_file(&path);
    let results: Vec<Value> =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("shop.php said {out:?}: {e}"));
    assert_eq!(
        results.len(),
        plan["steps"].as_array().unwrap().len(),
        "{out}"
    );
    results
}

/// shop.php with these steps on one server.
fn shop(redis: &RedisServer, prefix: &str, shards: usize, steps: &[Value]) -> Vec<Value> {
    shop_plan(
        &json!({"redis_port": redis.port, "prefix": prefix, "shards": shards, "steps": steps}),
    )
}

#[test]
fn php_library_tests_pass_against_redis_and_a_replica() {
    let plain = RedisServer::start();
    // No 5 s wait for more replicas before the first sync.
    let master = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
    let port = master.port.to_string();
    let _replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let mut con = master.con();
    wait_until(Duration::from_secs(10), "the replica to be in sync", || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut con)
            .unwrap();
        info.contains("state=online")
    });
    let out = php(
        &["tests/run.php"],
        &[
            ("DW_TEST_REDIS_PORT", plain.port.to_string()),
            ("DW_TEST_REPLICATED_PORT", port),
        ],
    );
    assert!(out.trim_end().ends_with(" passed, 0 failed"), "{out}");
}

/// What a test order's timeout goes through, by the order's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// push, due at once: runs.
    Due,
    /// pushAt, due 5 s ago: runs.
    DueAt,
    /// push, due in an hour, then cancel: never runs.
    Cancelled,
    /// push, due in an hour, then rescheduled to now: runs.
    BroughtForward,
    /// push, due at once, then rescheduled to an hour from now: waits in the pool.
    PutOff,
    /// pushed twice (an hour, then at once): one job, runs once.
    PushedAgain,
    /// the legacy pool, due at once: runs with {"order_id": id}.
    Legacy,
    /// the legacy pool, due in an hour, then cancelLegacy: never runs.
    LegacyCancelled,
    /// due at once, but the order is paid first: runs and changes nothing.
    Paid,
    /// never pushed; a cancel and a reschedule of its key find nothing.
    Never,
}

const FATES: [Fate; 10] = [
    Fate::Due,
    Fate::DueAt,
    Fate::Cancelled,
    Fate::BroughtForward,
    Fate::PutOff,
    Fate::PushedAgain,
    Fate::Legacy,
    Fate::LegacyCancelled,
    Fate::Paid,
    Fate::Never,
];

const LEGACY_POOL: &str = "delay:order_close";
const HOUR_MS: i64 = 3_600_000;

fn key_of(o: &SeedOrder) -> String {
    format!("order.timeout:{}", o.order_no)
}

fn member_of(o: &SeedOrder) -> String {
    format!("close_order_{}", o.id)
}

/// The shop's story through the PHP library: 60 orders, each with one of [`FATES`]; the
/// daemon then runs; every order whose timeout ran unpaid is cancelled once, the cancelled
/// and never-pushed ones are untouched, stock and coupons add up, and Redis holds exactly
/// the put-off jobs.
fn shop_story(shards: usize) {
    let mut env = Env::new();
    env.config.mover.legacy = vec![LegacyPool {
        key: LEGACY_POOL.into(),
        event: "order.timeout".into(),
    }];
    env.config.shards = shards;
    let orders = seed_orders(&env.db, 60);
    let fate = |i: usize| FATES[i % FATES.len()];
    let push = |o: &SeedOrder, delay_ms: i64| {
        json!({"op": "push", "event": "order.timeout", "payload": {"order_no": o.order_no},
               "delay_ms": delay_ms, "key": key_of(o)})
    };
    let mut steps = Vec::new();
    for (i, o) in orders.iter().enumerate() {
        let key = key_of(o);
        match fate(i) {
            Fate::Due | Fate::Paid => steps.push(push(o, 0)),
            Fate::DueAt => steps.push(json!({"op": "push_at", "event": "order.timeout",
                "payload": {"order_no": o.order_no}, "due_in_ms": -5000, "key": key})),
            Fate::Cancelled => {
                steps.push(push(o, HOUR_MS));
                steps.push(json!({"op": "cancel", "key": key}));
            }
            Fate::BroughtForward => {
                steps.push(push(o, HOUR_MS));
                steps.push(json!({"op": "reschedule", "key": key, "due_in_ms": 0}));
            }
            Fate::PutOff => {
                steps.push(push(o, 0));
                steps.push(json!({"op": "reschedule", "key": key, "due_in_ms": HOUR_MS}));
            }
            Fate::PushedAgain => {
                steps.push(push(o, HOUR_MS));
                steps.push(push(o, 0));
            }
            Fate::Legacy => steps.push(json!({"op": "push_legacy", "pool": LEGACY_POOL,
                "member": member_of(o), "order_id": o.id, "due_in_ms": 0})),
            Fate::LegacyCancelled => {
                steps.push(json!({"op": "push_legacy", "pool": LEGACY_POOL,
                    "member": member_of(o), "order_id": o.id, "due_in_ms": HOUR_MS}));
                steps.push(json!({"op": "cancel_legacy", "pool": LEGACY_POOL,
                    "member": member_of(o)}));
            }
            Fate::Never => {
                steps.push(json!({"op": "cancel", "key": key}));
                steps.push(json!({"op": "reschedule", "key": key, "due_in_ms": 0}));
            }
        }
    }
    let results = shop(&env.redis, "mq", shards, &steps);

    // Each step said what it did: pushes into the shard of crc32(key) mod N.
    let mut pushed_again = 0;
    for (step, result) in steps.iter().zip(&results) {
        match step["op"].as_str().unwrap() {
            "push" | "push_at" => {
                let key = step["key"].as_str().unwrap();
                let set = env.config.keys_for(key.as_bytes());
                assert_eq!(result["key"], key);
                assert_eq!(result["pool"], set.pool.as_str(), "{key}");
                assert_eq!(result["shard"], shard_of(key.as_bytes(), shards), "{key}");
                if result["rescheduled"] == true {
                    pushed_again += 1;
                }
            }
            "push_legacy" => {
                assert_eq!(result["pool"], LEGACY_POOL);
                assert_eq!(result["rescheduled"], false);
            }
            "cancel" | "reschedule" | "cancel_legacy" => {
                let key = step["key"].as_str().or(step["member"].as_str()).unwrap();
                let never = key_never(&orders, key, fate);
                assert_eq!(result, &json!(!never), "{step} said {result}");
            }
            op => panic!("{op}"),
        }
    }
    assert_eq!(
        pushed_again, 6,
        "the second push of each pushed-again key reschedules it"
    );

    // Before the daemon: each job in its shard's pool, its message beside it.
    let mut con = env.con();
    for (i, o) in orders.iter().enumerate() {
        let set = env.config.keys_for(key_of(o).as_bytes());
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(&set.pool)
            .arg(key_of(o))
            .query(&mut con)
            .unwrap();
        let data: bool = redis::cmd("HEXISTS")
            .arg(&set.data)
            .arg(key_of(o))
            .query(&mut con)
            .unwrap();
        let scheduled = !matches!(
            fate(i),
            Fate::Cancelled | Fate::Legacy | Fate::LegacyCancelled | Fate::Never
        );
        assert_eq!(
            (score.is_some(), data),
            (scheduled, scheduled),
            "{:?} {}",
            fate(i),
            key_of(o)
        );
    }

    let paid: Vec<SeedOrder> = orders
        .iter()
        .enumerate()
        .filter(|(i, _)| fate(*i) == Fate::Paid)
        .map(|(_, o)| o.clone())
        .collect();
    pay(&env.db, &paid);
    let runs: BTreeSet<String> = orders
        .iter()
        .enumerate()
        .filter_map(|(i, o)| match fate(i) {
            Fate::Due | Fate::DueAt | Fate::BroughtForward | Fate::PushedAgain | Fate::Paid => {
                Some(key_of(o))
            }
            Fate::Legacy => Some(member_of(o)),
            _ => None,
        })
        .collect();
    assert_eq!(runs.len(), 36);

    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the due jobs to be done", || {
        inbox_count(&env.db) as usize >= runs.len()
    });
    daemon.stop();

    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            matches!(
                fate(*i),
                Fate::Due | Fate::DueAt | Fate::BroughtForward | Fate::PushedAgain | Fate::Legacy
            )
        })
        .map(|(_, o)| o)
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    let done: BTreeSet<String> = env
        .db
        .client()
        .query("SELECT job_key FROM worker_inbox", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        done, runs,
        "the jobs done are the jobs that fell due, each once"
    );
    assert_eq!(inbox_count(&env.db) as usize, runs.len());

    // Redis: only the put-off jobs wait, each in its shard; nothing pending or dead.
    let mut waiting = BTreeSet::new();
    for set in env.config.shard_keys() {
        let b = books_on(&mut con, &set);
        assert_eq!((b.stream_pending, b.dead), (0, 0), "{}", set.pool);
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&set.pool)
            .arg(0)
            .arg(-1)
            .query(&mut con)
            .unwrap();
        for m in members {
            assert_eq!(env.config.keys_for(m.as_bytes()).pool, set.pool, "{m}");
            waiting.insert(m);
        }
    }
    let put_off: BTreeSet<String> = orders
        .iter()
        .enumerate()
        .filter(|(i, _)| fate(*i) == Fate::PutOff)
        .map(|(_, o)| key_of(o))
        .collect();
    assert_eq!(waiting, put_off);
    let legacy: usize = redis::cmd("ZCARD")
        .arg(LEGACY_POOL)
        .query(&mut con)
        .unwrap();
    assert_eq!(legacy, 0);
    for (i, o) in orders.iter().enumerate() {
        if matches!(fate(i), Fate::Legacy | Fate::LegacyCancelled) {
            let left: bool = redis::cmd("EXISTS")
                .arg(member_of(o))
                .query(&mut con)
                .unwrap();
            assert!(!left, "{} is left", member_of(o));
        }
    }
}

/// Whether `key` (a job key or a legacy member) belongs to an order that never had a job.
fn key_never(orders: &[SeedOrder], key: &str, fate: impl Fn(usize) -> Fate) -> bool {
    orders
        .iter()
        .position(|o| key_of(o) == key || member_of(o) == key)
        .map(|i| fate(i) == Fate::Never)
        .unwrap_or_else(|| panic!("no order has {key}"))
}

#[test]
fn php_pushes_cancels_and_reschedules_are_done_by_the_worker_with_exact_books() {
    shop_story(1);
}

#[test]
fn php_pushes_into_three_shards_are_done_by_the_worker_with_exact_books() {
    shop_story(3);
}

/// One key of the vectors file.
struct Vector {
    note: String,
    key: Vec<u8>,
    crc32: u32,
    shard: BTreeMap<String, usize>,
}

fn vectors() -> (Vec<usize>, Vec<Vector>, Vec<Value>) {
    let path = Path::new(PHP_DIR).join("tests/vectors.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let shards = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap() as usize)
        .collect();
    let keys = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            let hex = k["hex"].as_str().unwrap();
            Vector {
                note: k["note"].as_str().unwrap().to_string(),
                key: (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect(),
                crc32: k["crc32"].as_u64().unwrap() as u32,
                shard: serde_json::from_value(k["shard"].clone()).unwrap(),
            }
        })
        .collect();
    (shards, keys, v["layouts"].as_array().unwrap().clone())
}

/// The vectors the PHP tests read hold for `delay_worker::keys` too: the shard of every key
/// (empty, non-ASCII, not UTF-8, 4 KiB) for every count, and the key names of each layout.
#[test]
fn php_vectors_agree_with_the_worker_keys() {
    let (shards, keys, layouts) = vectors();
    assert!(keys.len() >= 10 && shards.len() >= 5);
    assert!(keys.iter().any(|k| k.key.is_empty()));
    assert!(keys.iter().any(|k| std::str::from_utf8(&k.key).is_err()));
    assert!(keys.iter().any(|k| k.key.len() >= 4096));
    for k in &keys {
        assert_eq!(crc32fast::hash(&k.key), k.crc32, "{}", k.note);
        assert_eq!(shard_of(&k.key, 1), 0);
        for n in &shards {
            assert_eq!(
                shard_of(&k.key, *n),
                k.shard[&n.to_string()],
                "{} among {n}",
                k.note
            );
        }
    }
    for l in &layouts {
        let prefix = l["prefix"].as_str().unwrap();
        let n = l["shards"].as_u64().unwrap() as usize;
        let o = KeyOverrides {
            pool: l["pool_key"].as_str().map(String::from),
            data: l["data_key"].as_str().map(String::from),
            ..Default::default()
        };
        let base = Keys::new(prefix, &o);
        let set = &base.sharded(prefix, n)[l["shard"].as_u64().unwrap() as usize];
        assert_eq!(set.pool, l["pool"], "{l}");
        assert_eq!(set.data, l["data"], "{l}");
        assert_eq!(set.jobs, l["jobs"], "{l}");
        assert_eq!(set.shard_count, l["shard_count"], "{l}");
    }
}

/// `worker push --shards 16` and the PHP library, each on a Redis of its own, put every
/// vector key a command line can carry into the same shard's pool with the same message.
#[test]
fn php_pushes_land_where_worker_push_puts_them_with_the_same_message() {
    const N: usize = 16;
    let (_, keys, _) = vectors();
    let keys: Vec<(&Vector, &str)> = keys
        .iter()
        .filter_map(|k| Some((k, std::str::from_utf8(&k.key).ok()?)))
        .filter(|(_, s)| !s.is_empty())
        .collect();
    assert!(keys.len() >= 8);
    let by_worker = RedisServer::start();
    let by_php = RedisServer::start();
    let payload = r#"{"order_no":"SO1"}"#;
    for (_, key) in &keys {
        let out = run_worker(
            &[
                "push",
                "--shards",
                &N.to_string(),
                "--event",
                "order.timeout",
                "--payload",
                payload,
                "--delay",
                "1h",
                "--key",
                key,
            ],
            &by_worker.url(),
            "postgres://unused@127.0.0.1:1/unused",
        );
        assert!(
            out.status.success(),
            "worker push {key:?}: {}",
            text(&out.stderr)
        );
    }
    let steps: Vec<Value> = keys
        .iter()
        .map(|(_, key)| {
            json!({"op": "push", "event": "order.timeout", "payload": {"order_no": "SO1"},
                   "delay_ms": HOUR_MS, "key": key})
        })
        .collect();
    // The worker recorded 16 shards: the PHP producer with 16 agrees with it.
    let mut con = by_php.con();
    redis::cmd("SET")
        .arg("mq:shards")
        .arg(N)
        .query::<()>(&mut con)
        .unwrap();
    shop(&by_php, "mq", N, &steps);

    let sets = Keys::default().sharded("mq", N);
    let find = |r: &RedisServer, key: &str| -> (usize, String) {
        let mut con = r.con();
        let mut found = Vec::new();
        for (i, set) in sets.iter().enumerate() {
            let msg: Option<String> = redis::cmd("HGET")
                .arg(&set.data)
                .arg(key)
                .query(&mut con)
                .unwrap();
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg(&set.pool)
                .arg(key)
                .query(&mut con)
                .unwrap();
            if let (Some(msg), Some(_)) = (msg, score) {
                found.push((i, msg));
            }
        }
        assert_eq!(
            found.len(),
            1,
            "{key:?} is not in exactly one shard: {found:?}"
        );
        found.pop().unwrap()
    };
    // `ts` is the second of each push; the rest byte for byte.
    let without_ts = |msg: &str| -> String {
        let (head, ts) = msg.rsplit_once(",\"ts\":").unwrap();
        assert!(ts.trim_end_matches('}').parse::<i64>().is_ok(), "{msg}");
        head.to_string()
    };
    for (v, key) in &keys {
        let (worker_shard, worker_msg) = find(&by_worker, key);
        let (php_shard, php_msg) = find(&by_php, key);
        assert_eq!(worker_shard, v.shard[&N.to_string()], "{}", v.note);
        assert_eq!(php_shard, worker_shard, "{}", v.note);
        assert_eq!(without_ts(&php_msg), without_ts(&worker_msg), "{}", v.note);
        assert_eq!(
            without_ts(&php_msg),
            r#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":0"#
        );
    }
}

/// On a Redis Cluster (three masters, each with a replica) with `\\RedisCluster`: the
/// `{mq}` layout, tagged legacy members (an untagged one is refused, nothing written), a
/// durable push confirmed by the slot's replica (WAIT goes to the master written to), and
/// the worker with `--key-prefix {mq}` on the cluster URL doing the jobs, the books exact.
#[test]
fn php_on_a_redis_cluster_pushes_durably_and_the_worker_does_the_jobs() {
    let cluster = Cluster::start();
    let db = TestDb::new();
    let orders = seed_orders(&db, 20);
    let pool = "{mq}delay:order_close";
    let mut steps = Vec::new();
    for o in &orders[..10] {
        steps.push(json!({"op": "push", "event": "order.timeout",
            "payload": {"order_no": o.order_no}, "delay_ms": 0, "key": key_of(o)}));
    }
    for o in &orders[10..15] {
        steps.push(json!({"op": "push_legacy", "pool": pool,
            "member": format!("{{mq}}close_order_{}", o.id), "order_id": o.id, "due_in_ms": 0}));
    }
    for o in &orders[15..18] {
        steps.push(json!({"op": "push", "event": "order.timeout",
            "payload": {"order_no": o.order_no}, "delay_ms": HOUR_MS, "key": key_of(o)}));
        steps.push(json!({"op": "cancel", "key": key_of(o)}));
    }
    steps.push(
        json!({"op": "push_legacy", "pool": pool, "member": member_of(&orders[18]),
        "order_id": orders[18].id, "due_in_ms": 0, "expect_error": "InvalidJobException"}),
    );
    let seeds: Vec<String> = cluster
        .url()
        .trim_start_matches("redis+cluster://")
        .split(',')
        .map(String::from)
        .collect();
    let results = shop_plan(&json!({"cluster": seeds, "prefix": "{mq}", "shards": 1,
        "wait": [1, 5000], "steps": steps}));
    for (step, result) in steps.iter().zip(&results) {
        match step["op"].as_str().unwrap() {
            "cancel" => assert_eq!(result, &json!(true)),
            _ if step.get("expect_error").is_some() => {
                assert_eq!(result, &json!({"error": "InvalidJobException"}))
            }
            _ => assert_eq!(result["replicas"], 1, "{step}: {result}"),
        }
    }
    let keys = Keys::with_prefix("{mq}");
    let mut con = cluster.con_for(&keys.pool);
    let scheduled: usize = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(scheduled, 10);
    let untagged: bool = redis::cmd("EXISTS")
        .arg(member_of(&orders[18]))
        .query(&mut cluster.con_for(&member_of(&orders[18])))
        .unwrap();
    assert!(!untagged, "the refused member was written");

    let config = config_for(&cluster.url(), &db, "c1");
    let mut p = Proc::start(
        &config,
        &[
            "--key-prefix".into(),
            "{mq}".into(),
            "--legacy-pool".into(),
            format!("{pool}=order.timeout"),
        ],
    );
    wait_until(WAIT, "the pushed jobs to be done", || {
        inbox_count(&db) >= 15
    });
    let paid: Vec<SeedOrder> = orders[15..].to_vec();
    let ran = stop_and_account(&mut p, &db, &orders, &paid);
    assert_eq!(ran.len(), 15, "{ran:?}");
    assert!(ran.values().all(|n| *n == 1), "{ran:?}");
    let b = books_on(&mut con, &keys);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
    let legacy: usize = redis::cmd("ZCARD").arg(pool).query(&mut con).unwrap();
    assert_eq!(legacy, 0);
}
