//! One legacy member, or one whole pool, that Redis refuses holds back nothing else: a
//! member whose key an ACL user may not read is one dead letter and its pool moves on; a
//! key the user may read but not delete moves once and stays; a pool whose call fails
//! backs off alone while our own pool and the other legacy pools keep their schedule.
//! Each test ends with the books: every pushed member moved once or dead-lettered once.

use crate::privilege::rules;
use crate::support::*;
use delay_worker::config::{LegacyPool, MoverConfig};
use delay_worker::keys::{Keys, Queue};
use delay_worker::mover::Mover;
use delay_worker::stats::Stats;
use delay_worker::{store, Shutdown};
use redis::{Connection, Value};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

const NOW: i64 = 1_768_764_300_500; // ms
const POOL: &str = "delay:order_close";
const EVENT: &str = "order.timeout";

/// An ACL user with the rules of `scripts/redis-acl/worker.acl` plus `extra`; its URL.
fn acl_user(r: &RedisServer, extra: &[&str]) -> String {
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("dw-mover")
        .arg("reset")
        .arg("on")
        .arg(">mover-secret")
        .arg(rules(&["worker.acl"]))
        .arg(extra)
        .query::<()>(&mut r.con())
        .unwrap();
    format!("redis://dw-mover:mover-secret@127.0.0.1:{}/", r.port)
}

fn connect(url: &str) -> Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

fn cfg(batch: usize, poll: Duration, legacy: &[&str]) -> MoverConfig {
    MoverConfig {
        batch,
        poll,
        legacy: legacy
            .iter()
            .map(|k| LegacyPool {
                key: k.to_string(),
                event: EVENT.to_string(),
            })
            .collect(),
        ..MoverConfig::default()
    }
}

/// The legacy producer: the STRING key holding the order id, then the pool member.
pub(crate) fn legacy_push(con: &mut Connection, pool: &str, member: &str, id: &str, score: i64) {
    redis::cmd("SET")
        .arg(member)
        .arg(id)
        .query::<()>(con)
        .unwrap();
    redis::cmd("ZADD")
        .arg(pool)
        .arg(score)
        .arg(member)
        .query::<()>(con)
        .unwrap();
}

fn our_push(con: &mut Connection, keys: &Keys, key: &str, due_ms: i64) {
    let msg = format!(r#"{{"event":"coupon.expire","payload":{{"coupon_id":1}},"k":"{key}"}}"#);
    store::push(con, keys, key, msg, due_ms).unwrap();
}

/// Every entry of a stream as its fields.
fn xrange(con: &mut Connection, key: &str) -> Vec<HashMap<String, String>> {
    let v: Value = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|e| match e {
            Value::Array(pair) => match &pair[1] {
                Value::Array(f) => Some(
                    f.chunks(2)
                        .map(|c| {
                            let s = store::value_to_string;
                            (s(&c[0]), s(&c[1]))
                        })
                        .collect(),
                ),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// Every denial Redis recorded, as (context, object) pairs.
fn acl_denials(con: &mut Connection) -> Vec<(String, String)> {
    let v: Value = redis::cmd("ACL").arg("LOG").query(con).unwrap();
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|e| match e {
            Value::Array(f) => {
                let m: HashMap<String, String> = f
                    .chunks(2)
                    .map(|c| (store::value_to_string(&c[0]), store::value_to_string(&c[1])))
                    .collect();
                Some((m["context"].clone(), m["object"].clone()))
            }
            _ => None,
        })
        .collect()
}

fn zcard(con: &mut Connection, key: &str) -> usize {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

fn exists(con: &mut Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query::<i64>(con).unwrap() == 1
}

/// Each of `pushed` is in `moved` or `dead` exactly once, and nothing else is.
fn assert_books(pushed: &[String], moved: &[String], dead: &[String]) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for k in moved.iter().chain(dead) {
        *seen.entry(k).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "moved or buried twice: {twice:?}");
    let pushed_set: HashSet<&str> = pushed.iter().map(String::as_str).collect();
    let seen_set: HashSet<&str> = seen.keys().copied().collect();
    assert_eq!(
        seen_set, pushed_set,
        "every pushed member moved or dead-lettered, nothing else"
    );
}

#[test]
fn a_legacy_member_outside_the_acl_rules_is_one_dead_letter_and_nothing_waits() {
    let r = RedisServer::start();
    let mut admin = r.con();
    let keys = Keys::default();
    // The rules of docs/security.md ("Least privilege") for this legacy pool: its key and `close_order_*`. Another
    // producer's member in the same pool is named outside them.
    let url = acl_user(&r, &[&format!("~{POOL}"), "~close_order_*"]);
    let mut pushed = Vec::new();
    for i in 1..=8 {
        let member = format!("close_order_{i}");
        legacy_push(
            &mut admin,
            POOL,
            &member,
            &i.to_string(),
            NOW - 1000 + i * 10,
        );
        pushed.push(member);
    }
    legacy_push(&mut admin, POOL, "refund_order_5", "5", NOW - 1000 + 45);
    pushed.push("refund_order_5".to_string());
    for i in 0..4 {
        let key = format!("ours-{i}");
        our_push(&mut admin, &keys, &key, NOW - 500);
        pushed.push(key);
    }

    let mut con = connect(&url);
    let stats = Stats::default();
    let c = cfg(3, Duration::from_millis(100), &[POOL]);
    let mover = Mover::new(&keys, &c, &stats);
    let mut ticks = Vec::new();
    loop {
        let (report, sleep) = mover.tick(&mut con, NOW).unwrap();
        let done = report.moved + report.buried.len() == 0;
        ticks.push((report, sleep));
        if done || ticks.len() > 20 {
            break;
        }
    }
    // Our pool moved its first batch in the first tick, next to the legacy pool's.
    assert_eq!(ticks[0].0.moved, 6, "{:?}", ticks[0]);
    assert!(
        ticks.iter().all(|(_, s)| *s <= c.poll),
        "no tick backed off: {ticks:?}"
    );
    let buried: Vec<_> = ticks.iter().flat_map(|(r, _)| r.buried.clone()).collect();
    assert_eq!(buried.len(), 1, "{buried:?}");

    // Redis really refused the key, inside the script.
    let denials = acl_denials(&mut admin);
    assert!(
        denials.contains(&("lua".to_string(), "refund_order_5".to_string())),
        "{denials:?}"
    );
    let letters = xrange(&mut admin, &keys.dead);
    assert_eq!(letters.len(), 1, "{letters:?}");
    let l = &letters[0];
    assert_eq!(
        (l["key"].as_str(), l["event"].as_str()),
        ("refund_order_5", EVENT)
    );
    let prefix = "legacy key refund_order_5 cannot be read: ";
    assert!(
        l["reason"].starts_with(prefix) && l["reason"].contains("access"),
        "the reason names the key and Redis's error: {l:?}"
    );
    assert_eq!(l["reason"], buried[0].1);
    // Left alone (a DEL would be refused too); only unscheduled.
    let kept: String = redis::cmd("GET")
        .arg("refund_order_5")
        .query(&mut admin)
        .unwrap();
    assert_eq!(kept, "5");

    let entries = xrange(&mut admin, &keys.stream);
    for e in &entries {
        if let Some(id) = e["key"].strip_prefix("close_order_") {
            let v: serde_json::Value = serde_json::from_str(&e["msg"]).unwrap();
            assert_eq!(v["event"], EVENT);
            assert_eq!(v["payload"]["order_id"].to_string(), id, "{e:?}");
            assert!(!exists(&mut admin, &e["key"]), "moved with its key");
        }
    }
    let moved: Vec<String> = entries.iter().map(|e| e["key"].clone()).collect();
    let dead: Vec<String> = letters.iter().map(|l| l["key"].clone()).collect();
    assert_books(&pushed, &moved, &dead);
    assert_eq!(
        (zcard(&mut admin, POOL), zcard(&mut admin, &keys.pool)),
        (0, 0)
    );
    let s = stats.snapshot();
    assert_eq!((s.moved, s.dead), (13, 1), "{s}");
    assert_eq!(stats.problem(delay_worker::now_ms()), None);
}

#[test]
fn a_legacy_key_the_user_may_read_but_not_delete_moves_once_and_stays() {
    let r = RedisServer::start();
    let mut admin = r.con();
    let keys = Keys {
        queues: vec![Queue::new("q", None)],
        ..Default::default()
    };
    // Read-only rights on the members' keys (`%R~`): the mover reads them, its DEL is
    // refused after the message was pushed.
    let url = acl_user(&r, &["~q", "~q:*", &format!("~{POOL}"), "%R~close_order_*"]);
    let mut pushed = Vec::new();
    for i in 1..=5 {
        let member = format!("close_order_{i}");
        legacy_push(&mut admin, POOL, &member, &i.to_string(), NOW - 100 + i);
        pushed.push(member);
    }
    our_push(&mut admin, &keys, "ours-0", NOW - 100);
    pushed.push("ours-0".to_string());

    let mut con = connect(&url);
    let stats = Stats::default();
    let c = cfg(2, Duration::from_millis(100), &[POOL]);
    let mover = Mover::new(&keys, &c, &stats);
    let mut undeleted = Vec::new();
    // Later ticks too: a member whose key stayed is never moved a second time.
    for at in [NOW, NOW, NOW, NOW, NOW + 1000, NOW + 60_000] {
        let (report, sleep) = mover.tick(&mut con, at).unwrap();
        assert!(report.buried.is_empty(), "{report:?}");
        assert!(sleep <= c.poll);
        undeleted.extend(report.undeleted);
    }
    let names: HashSet<&str> = undeleted.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names.len(), 5, "{undeleted:?}");
    assert!(undeleted.iter().all(|(_, e)| e.contains("access")));
    for i in 1..=5 {
        assert!(
            exists(&mut admin, &format!("close_order_{i}")),
            "left in place"
        );
    }

    let queue: Vec<String> = redis::cmd("LRANGE")
        .arg("q")
        .arg(0)
        .arg(-1)
        .query(&mut admin)
        .unwrap();
    let moved: Vec<String> = queue
        .iter()
        .map(|m| {
            let v: serde_json::Value = serde_json::from_str(m).unwrap();
            v["job_key"].as_str().unwrap().to_string()
        })
        .collect();
    let dead: Vec<String> = redis::cmd("LRANGE")
        .arg("q:dead")
        .arg(0)
        .arg(-1)
        .query(&mut admin)
        .unwrap();
    assert_books(&pushed, &moved, &dead);
    assert_eq!(zcard(&mut admin, POOL), 0);
    assert_eq!(stats.snapshot().moved, 6);
}

#[test]
fn a_legacy_pool_of_the_wrong_type_holds_back_only_itself() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let (a, b) = ("delay:a", "delay:b");
    redis::cmd("SET")
        .arg(a)
        .arg("not a pool")
        .query::<()>(&mut con)
        .unwrap();
    let mut pushed = Vec::new();
    for i in 0..3 {
        legacy_push(&mut con, b, &format!("b_{i}"), &i.to_string(), NOW - 10);
        our_push(&mut con, &keys, &format!("ours-{i}"), NOW - 10);
        pushed.extend([format!("b_{i}"), format!("ours-{i}")]);
    }
    let stats = Stats::default();
    let c = cfg(100, Duration::from_millis(100), &[a, b]);
    let mover = Mover::new(&keys, &c, &stats);

    // The tick succeeds: ours and the other legacy pool moved; the broken one is named.
    let (report, sleep) = mover.tick(&mut con, NOW).unwrap();
    assert_eq!(report.moved, 6, "{report:?}");
    assert!(sleep <= c.poll, "{sleep:?}");
    let problem = stats.problem(delay_worker::now_ms()).expect("reported");
    assert!(
        problem.contains("legacy pool delay:a") && problem.contains("holds a string"),
        "{problem}"
    );

    // Fixed by the operator; more work arrives everywhere.
    redis::cmd("DEL").arg(a).query::<()>(&mut con).unwrap();
    for i in 0..2 {
        legacy_push(&mut con, a, &format!("a_{i}"), &i.to_string(), NOW - 10);
        pushed.push(format!("a_{i}"));
    }
    legacy_push(&mut con, b, "b_3", "3", NOW);
    our_push(&mut con, &keys, "ours-3", NOW);
    pushed.extend(["b_3".to_string(), "ours-3".to_string()]);

    // A millisecond later the broken pool is still waiting out its own backoff (at least
    // 50 ms): it is not tried, the others are.
    let (report, _) = mover.tick(&mut con, NOW + 1).unwrap();
    assert_eq!(report.moved, 2, "{report:?}");
    assert_eq!(zcard(&mut con, a), 2);
    assert!(stats.problem(delay_worker::now_ms()).is_some());

    // After its backoff (30 s at most) it moves, and its problem is cleared.
    let (report, _) = mover.tick(&mut con, NOW + 30_001).unwrap();
    assert_eq!(report.moved, 2, "{report:?}");
    assert_eq!(stats.problem(delay_worker::now_ms()), None);

    let moved: Vec<String> = xrange(&mut con, &keys.stream)
        .iter()
        .map(|e| e["key"].clone())
        .collect();
    let dead: Vec<String> = xrange(&mut con, &keys.dead)
        .iter()
        .map(|e| e["key"].clone())
        .collect();
    assert_books(&pushed, &moved, &dead);
    assert_eq!(stats.snapshot().moved, 10);
}

#[test]
fn a_legacy_pool_broken_mid_run_does_not_delay_our_own() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let (a, b) = ("delay:a", "delay:b");
    let client = redis::Client::open(r.url()).unwrap();
    let stats = Stats::default();
    let c = cfg(100, Duration::from_millis(50), &[a, b]);
    let shutdown = Shutdown::new();
    let mut pushed = Vec::new();
    let gone = |con: &mut Connection, zset: &str, member: &str| {
        redis::cmd("ZSCORE")
            .arg(zset)
            .arg(member)
            .query::<Option<f64>>(con)
            .unwrap()
            .is_none()
    };
    let client = delay_worker::store::Redis::from(client.clone());
    std::thread::scope(|s| {
        let (keys, c, stats, shutdown, client) = (&keys, &c, &stats, &shutdown, &client);
        s.spawn(move || Mover::new(keys, c, stats).run(client, shutdown));
        // Stops the mover however this ends, a failed wait included.
        let _stop = StopOnDrop(shutdown);
        for i in 0..24 {
            if i == 4 {
                // The legacy pool's key is deleted and made again as another type.
                redis::cmd("DEL").arg(a).query::<()>(&mut con).unwrap();
                redis::cmd("SET")
                    .arg(a)
                    .arg("x")
                    .query::<()>(&mut con)
                    .unwrap();
                wait_until(Duration::from_secs(10), "the broken pool named", || {
                    stats
                        .problem(delay_worker::now_ms())
                        .is_some_and(|p| p.contains("delay:a"))
                });
            }
            if i == 16 {
                redis::cmd("DEL").arg(a).query::<()>(&mut con).unwrap();
            }
            let now = delay_worker::now_ms();
            if !(4..16).contains(&i) {
                legacy_push(&mut con, a, &format!("a_{i}"), &i.to_string(), now);
                pushed.push(format!("a_{i}"));
            }
            legacy_push(&mut con, b, &format!("b_{i}"), &i.to_string(), now);
            our_push(&mut con, keys, &format!("ours-{i}"), now);
            pushed.extend([format!("b_{i}"), format!("ours-{i}")]);
            // A backoff of the whole mover would reach 15-30 s within these rounds.
            wait_until(
                Duration::from_secs(10),
                "ours and the good legacy pool",
                || {
                    gone(&mut con, &keys.pool, &format!("ours-{i}"))
                        && gone(&mut con, b, &format!("b_{i}"))
                        && (i >= 4 || gone(&mut con, a, &format!("a_{i}")))
                },
            );
        }
        wait_until(Duration::from_secs(10), "the mended pool", || {
            zcard(&mut con, a) == 0 && stats.problem(delay_worker::now_ms()).is_none()
        });
    });
    let moved: Vec<String> = xrange(&mut con, &keys.stream)
        .iter()
        .map(|e| e["key"].clone())
        .collect();
    let dead: Vec<String> = xrange(&mut con, &keys.dead)
        .iter()
        .map(|e| e["key"].clone())
        .collect();
    assert_books(&pushed, &moved, &dead);
    assert_eq!(stats.snapshot().moved, pushed.len() as u64);
    assert_eq!(stats.snapshot().dead, 0);
}

struct StopOnDrop<'a>(&'a Shutdown);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.trigger();
    }
}

/// `worker stats --check` and `/metrics` count an overdue legacy member in the mover lag: a
/// stopped mover shows whichever pool it leaves behind.
#[test]
fn the_check_counts_a_legacy_pools_mover_lag() {
    let r = RedisServer::start();
    let mut con = r.con();
    let due = delay_worker::now_ms() - 60_000;
    let _: () = redis::pipe()
        .cmd("SET")
        .arg("close_order_27")
        .arg(27)
        .ignore()
        .cmd("ZADD")
        .arg("delay:order_close")
        .arg(due)
        .arg("close_order_27")
        .ignore()
        .query(&mut con)
        .unwrap();
    let args = [
        "stats",
        "--check",
        "--legacy-pool",
        "delay:order_close=order.timeout",
    ];
    let out = run_worker(&args, &r.url(), "postgres://unused");
    let line = text(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{line}");
    assert!(line.contains("mover lag 60"), "{line}");
    let out = run_worker(
        &["stats", "--check", "--expect-workers", "0"],
        &r.url(),
        "postgres://unused",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "our own pool is empty: {}",
        text(&out.stdout)
    );
    let out = run_worker(
        &args[..1]
            .iter()
            .chain(&args[2..])
            .copied()
            .collect::<Vec<_>>(),
        &r.url(),
        "postgres://unused",
    );
    assert!(
        text(&out.stdout).contains("legacy  delay:order_close"),
        "{}",
        text(&out.stdout)
    );
}
