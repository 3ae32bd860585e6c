//! The mover: second and millisecond scores, the orphan grace, batching, racing movers,
//! and stopping between batches.

use crate::support::*;
use delay_worker::config::MoverConfig;
use delay_worker::keys::Keys;
use delay_worker::mover::Mover;
use delay_worker::stats::Stats;
use delay_worker::Shutdown;
use redis::Connection;
use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const NOW: i64 = 1_768_764_300_500; // ms

fn add(con: &mut Connection, keys: &Keys, key: &str, score: f64, with_data: bool) {
    if with_data {
        let msg = format!(
            r#"{{"event":"coupon.expire","payload":{{"coupon_id":1}},"retry":0,"ts":0,"k":"{key}"}}"#
        );
        redis::cmd("HSET")
            .arg(&keys.data)
            .arg(key)
            .arg(msg)
            .query::<()>(con)
            .unwrap();
    }
    redis::cmd("ZADD")
        .arg(&keys.pool)
        .arg(score)
        .arg(key)
        .query::<()>(con)
        .unwrap();
}

/// (key, msg) of every stream entry.
fn stream(con: &mut Connection, keys: &Keys) -> Vec<(String, String)> {
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    let mut out = Vec::new();
    if let redis::Value::Array(entries) = v {
        for e in entries {
            if let redis::Value::Array(pair) = e {
                if let redis::Value::Array(f) = &pair[1] {
                    let s: Vec<String> =
                        f.iter().map(delay_worker::store::value_to_string).collect();
                    let get = |n: &str| {
                        s.iter()
                            .position(|x| x == n)
                            .map(|i| s[i + 1].clone())
                            .unwrap()
                    };
                    out.push((get("key"), get("msg")));
                }
            }
        }
    }
    out
}

fn cfg(batch: usize) -> MoverConfig {
    MoverConfig {
        batch,
        poll: Duration::from_millis(100),
        orphan_grace: Duration::from_secs(60),
        ..MoverConfig::default()
    }
}

#[test]
fn seconds_and_millisecond_scores_are_both_understood() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now_s = (NOW / 1000) as f64;
    add(&mut con, &keys, "php-due", now_s, true); // seconds, due this second
    add(&mut con, &keys, "php-past", now_s - 3600.0, true);
    add(&mut con, &keys, "ms-due", (NOW - 1) as f64, true);
    add(&mut con, &keys, "negative", -5.0, true); // far past: due
    add(&mut con, &keys, "php-later", now_s + 2.0, true); // due in 1.5 s
    add(&mut con, &keys, "ms-later", (NOW + 700) as f64, true); // due in 0.7 s
    add(&mut con, &keys, "huge", 1e300, true); // never due
    let stats = Stats::default();
    let c = cfg(100);
    let mover = Mover::new(&keys, &c, &stats);
    let (report, sleep) = mover.tick(&mut con, NOW).unwrap();
    assert_eq!(report.moved, 4);
    let moved: HashSet<String> = stream(&mut con, &keys)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let want: HashSet<String> = ["php-due", "php-past", "ms-due", "negative"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(moved, want);
    assert_eq!(report.next_due_ms, Some(NOW + 700));
    assert_eq!(
        sleep,
        Duration::from_millis(100),
        "capped by the poll interval"
    );

    let (report, sleep) = mover.tick(&mut con, NOW + 650).unwrap();
    assert_eq!(
        (report.moved, sleep),
        (0, Duration::from_millis(50)),
        "sleeps until the next due"
    );
    let (report, _) = mover.tick(&mut con, NOW + 700).unwrap();
    assert_eq!(report.moved, 1);
    let (report, _) = mover.tick(&mut con, NOW + 1500).unwrap();
    assert_eq!(report.moved, 1, "the seconds score is due at its second");
    let left: Vec<String> = redis::cmd("ZRANGE")
        .arg(&keys.pool)
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .unwrap();
    assert_eq!(left, vec!["huge".to_string()]);
    let data: usize = redis::cmd("HLEN").arg(&keys.data).query(&mut con).unwrap();
    assert_eq!(data, 1, "moved members take their data with them");
    // The message travels unchanged, unknown fields included.
    let (_, msg) = &stream(&mut con, &keys)[0];
    assert!(msg.contains(r#""k":"#), "{msg}");
}

#[test]
fn a_member_without_data_waits_out_the_grace_then_is_an_orphan() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let stats = Stats::default();
    let c = cfg(100);
    let mover = Mover::new(&keys, &c, &stats);
    // The PHP producer's ZADD arrived, its HSET not yet.
    add(&mut con, &keys, "late-data", (NOW - 1000) as f64, false);
    add(&mut con, &keys, "never-data", (NOW - 1000) as f64, false);
    let (report, sleep) = mover.tick(&mut con, NOW).unwrap();
    assert_eq!((report.moved, report.skipped), (0, 2));
    assert!(report.buried.is_empty());
    assert_eq!(sleep, c.poll, "no spinning on members waiting for data");

    // The HSET arrives: the member moves normally.
    redis::cmd("HSET")
        .arg(&keys.data)
        .arg("late-data")
        .arg(r#"{"event":"e","payload":{}}"#)
        .query::<()>(&mut con)
        .unwrap();
    let (report, _) = mover.tick(&mut con, NOW + 10).unwrap();
    assert_eq!((report.moved, report.skipped), (1, 1));

    // Still inside the grace: kept. Past it: dead-lettered with the reason, then removed.
    let (report, _) = mover.tick(&mut con, NOW - 1000 + 59_000).unwrap();
    assert_eq!(report.skipped, 1);
    let (report, _) = mover.tick(&mut con, NOW - 1000 + 61_000).unwrap();
    assert_eq!(report.buried.len(), 1);
    assert_eq!(report.buried[0].0, "never-data");
    assert!(
        report.buried[0].1.contains("no data"),
        "{:?}",
        report.buried
    );
    assert_eq!(stats.snapshot().dead, 1);
    let dead: usize = redis::cmd("XLEN").arg(&keys.dead).query(&mut con).unwrap();
    assert_eq!(dead, 1, "an orphan is a dead letter, never a silent drop");
    let n: usize = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(n, 0);
}

#[test]
fn a_full_batch_loops_at_once() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    for i in 0..25 {
        add(&mut con, &keys, &format!("k{i}"), (NOW - 5) as f64, true);
    }
    let stats = Stats::default();
    let c = cfg(10);
    let mover = Mover::new(&keys, &c, &stats);
    let (r1, s1) = mover.tick(&mut con, NOW).unwrap();
    let (r2, s2) = mover.tick(&mut con, NOW).unwrap();
    let (r3, s3) = mover.tick(&mut con, NOW).unwrap();
    assert_eq!((r1.moved, r2.moved, r3.moved), (10, 10, 5));
    assert_eq!((s1, s2), (Duration::ZERO, Duration::ZERO));
    assert_eq!(s3, c.poll);
}

#[test]
fn racing_movers_move_each_message_exactly_once() {
    let r = RedisServer::start();
    let keys = Keys::default();
    let n = 6000;
    {
        let mut con = r.con();
        let mut pipe = redis::pipe();
        for i in 0..n {
            // Half seconds scores, half milliseconds, all due.
            let score = if i % 2 == 0 {
                (NOW / 1000 - 10) as f64
            } else {
                (NOW - i) as f64
            };
            pipe.cmd("HSET")
                .arg(&keys.data)
                .arg(format!("job{i}"))
                .arg(format!(r#"{{"n":{i}}}"#))
                .ignore();
            pipe.cmd("ZADD")
                .arg(&keys.pool)
                .arg(score)
                .arg(format!("job{i}"))
                .ignore();
        }
        pipe.query::<()>(&mut con).unwrap();
    }
    let movers = 3;
    let barrier = Arc::new(Barrier::new(movers));
    let stats = Stats::default();
    let c = cfg(200);
    std::thread::scope(|s| {
        for _ in 0..movers {
            let (barrier, keys, c, stats, r) = (barrier.clone(), &keys, &c, &stats, &r);
            s.spawn(move || {
                let mut con = r.con();
                let mover = Mover::new(keys, c, stats);
                barrier.wait();
                loop {
                    let (report, _) = mover.tick(&mut con, NOW).unwrap();
                    if report.moved == 0 {
                        break;
                    }
                }
            });
        }
    });
    let mut con = r.con();
    let entries = stream(&mut con, &keys);
    assert_eq!(
        entries.len(),
        n as usize,
        "every message once in the stream"
    );
    let unique: HashSet<&String> = entries.iter().map(|(k, _)| k).collect();
    assert_eq!(unique.len(), n as usize, "no message twice");
    for (k, msg) in &entries {
        let v: serde_json::Value = serde_json::from_str(msg).unwrap();
        assert_eq!(v["n"].to_string(), k[3..], "data travels with its key");
        assert!(
            msg.starts_with(r#"{"job_id":""#),
            "stamped on its first move: {msg}"
        );
    }
    let ids: HashSet<String> = entries
        .iter()
        .map(|(_, m)| serde_json::from_str::<serde_json::Value>(m).unwrap()["job_id"].to_string())
        .collect();
    assert_eq!(ids.len(), n as usize, "every move a job id of its own");
    assert_eq!(stats.snapshot().moved, n as u64);
    let left: usize = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    let data: usize = redis::cmd("HLEN").arg(&keys.data).query(&mut con).unwrap();
    assert_eq!((left, data), (0, 0));
}

#[test]
fn a_mover_stopped_between_batches_loses_nothing() {
    let r = RedisServer::start();
    let keys = Keys::default();
    let n = 3000usize;
    let now = delay_worker::now_ms();
    {
        let mut con = r.con();
        let mut pipe = redis::pipe();
        for i in 0..n {
            pipe.cmd("HSET")
                .arg(&keys.data)
                .arg(format!("job{i}"))
                .arg("{}")
                .ignore();
            pipe.cmd("ZADD")
                .arg(&keys.pool)
                .arg(now - 1000)
                .arg(format!("job{i}"))
                .ignore();
        }
        pipe.query::<()>(&mut con).unwrap();
    }
    let client = redis::Client::open(r.url()).unwrap();
    let stats = Stats::default();
    let c = MoverConfig {
        batch: 50,
        // Long poll: shutdown must wake the sleeping mover, not the poll timer.
        poll: Duration::from_secs(120),
        orphan_grace: Duration::from_secs(60),
        ..MoverConfig::default()
    };
    let shutdown = Shutdown::new();
    let started = Instant::now();
    let client = delay_worker::store::Redis::from(client.clone());
    std::thread::scope(|s| {
        let (keys, c, stats, shutdown, client) = (&keys, &c, &stats, &shutdown, &client);
        s.spawn(move || Mover::new(keys, c, stats).run(client, shutdown));
        wait_until(Duration::from_secs(10), "a first batch", || {
            stats.snapshot().moved > 0
        });
        shutdown.trigger();
    });
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "shutdown woke the mover"
    );
    let mut con = r.con();
    let moved: usize = redis::cmd("XLEN")
        .arg(&keys.stream)
        .query(&mut con)
        .unwrap();
    let left: usize = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    let data: usize = redis::cmd("HLEN").arg(&keys.data).query(&mut con).unwrap();
    assert_eq!(moved + left, n, "nothing lost between batches");
    assert_eq!(left, data, "every member still waiting keeps its data");

    // A new mover finishes the job, each message once.
    let stats2 = Stats::default();
    let mover = Mover::new(&keys, &c, &stats2);
    while mover
        .tick(&mut con, delay_worker::now_ms())
        .unwrap()
        .0
        .moved
        > 0
    {}
    let entries = stream(&mut con, &keys);
    let unique: HashSet<&String> = entries.iter().map(|(k, _)| k).collect();
    assert_eq!((entries.len(), unique.len()), (n, n));
}

#[test]
fn the_mover_sleeps_until_the_next_due_member_not_the_poll_interval() {
    let r = RedisServer::start();
    let keys = Keys::default();
    let mut con = r.con();
    let stats = Stats::default();
    let c = MoverConfig {
        batch: 100,
        poll: Duration::from_secs(5),
        orphan_grace: Duration::from_secs(60),
        ..MoverConfig::default()
    };
    add(&mut con, &keys, "soon", (NOW + 40) as f64, true);
    let (_, sleep) = Mover::new(&keys, &c, &stats).tick(&mut con, NOW).unwrap();
    assert_eq!(sleep, Duration::from_millis(40));
}

/// Entries of the stream no reader of the group has taken yet (its lag, as stats reads it).
fn unread(con: &mut Connection, keys: &Keys) -> i64 {
    let f = delay_worker::figures::gather(con, keys, NOW, Duration::from_secs(300)).unwrap();
    f.group.lag.unwrap() as i64
}

/// A reader taking `n` entries of the group (no ack: only the lag matters).
fn take(con: &mut Connection, keys: &Keys, n: usize) -> usize {
    xreadgroup(con, keys, "r", n).len()
}

/// The consumer group, created as the reader creates it, and `n` members due now.
fn group_and_due(con: &mut Connection, keys: &Keys, n: usize) {
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg("$")
        .arg("MKSTREAM")
        .query::<()>(con)
        .unwrap();
    add_due(con, keys, n);
}

fn add_due(con: &mut Connection, keys: &Keys, n: usize) {
    for i in 0..n {
        add(con, keys, &format!("k{i}"), (NOW - 5) as f64, true);
    }
}

#[test]
fn the_mover_moves_no_further_ahead_of_the_readers_than_move_ahead() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    group_and_due(&mut con, &keys, 100);
    let stats = Stats::default();
    let c = MoverConfig {
        ahead: 30,
        ..cfg(10)
    };
    let mover = Mover::new(&keys, &c, &stats);
    // Whole batches up to the bound, then nothing while it is full.
    let moved: Vec<usize> = (0..4)
        .map(|_| mover.tick(&mut con, NOW).unwrap().0.moved)
        .collect();
    assert_eq!(moved, [10, 10, 10, 0]);
    let (report, sleep) = mover.tick(&mut con, NOW).unwrap();
    assert!(report.cut, "{report:?}");
    assert_eq!(sleep, delay_worker::mover::AHEAD_WAIT);
    assert_eq!(unread(&mut con, &keys), 30);
    // The members held back are the readers' backlog, not the mover's lag: stats shows
    // them as such (stats --check holds them against its `oldest` thresholds).
    let mut config = delay_worker::config::Config::new(&r.url(), "postgres://unused/db");
    config.mover.ahead = 30;
    let at = NOW + 10_000;
    let window = Duration::from_secs(300);
    let f = delay_worker::figures::gather_all(&mut con, &config, at, window).unwrap();
    assert_eq!(
        (f.pool.mover_lag_ms, f.pool.readers_backlog_ms),
        (0, 10_005)
    );
    // Below half of the bound the mover is not held back: the lag is the mover's.
    config.mover.ahead = 61;
    let f = delay_worker::figures::gather_all(&mut con, &config, at, window).unwrap();
    assert_eq!(
        (f.pool.mover_lag_ms, f.pool.readers_backlog_ms),
        (10_005, 0)
    );
    // A whole batch once one fits: 21 unread, nothing; 20, a batch.
    assert_eq!(take(&mut con, &keys, 9), 9);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 0);
    assert_eq!(take(&mut con, &keys, 1), 1);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 10);
    // Readers and mover to the end: the bound always held, every member moved once.
    let mut read = 10;
    for _ in 0..200 {
        mover.tick(&mut con, NOW).unwrap();
        assert!(unread(&mut con, &keys) <= 30);
        read += take(&mut con, &keys, 7);
        if read == 100 {
            break;
        }
    }
    assert_eq!(read, 100);
    let entries = stream(&mut con, &keys);
    let keys_moved: HashSet<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!((entries.len(), keys_moved.len()), (100, 100));
    let left: i64 = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(left, 0);
}

#[test]
fn without_a_bound_or_a_group_the_mover_moves_every_due_member() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    add_due(&mut con, &keys, 100);
    let stats = Stats::default();
    // No group yet (nothing has read the stream): the mover does not wait for one.
    let c = MoverConfig {
        ahead: 30,
        ..cfg(50)
    };
    let mover = Mover::new(&keys, &c, &stats);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 50);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 50);
    // With a group and --move-ahead 0: no bound either.
    let keys2 = Keys::with_prefix("other");
    group_and_due(&mut con, &keys2, 100);
    let c = MoverConfig {
        ahead: 0,
        ..cfg(100)
    };
    let mover = Mover::new(&keys2, &c, &stats);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 100);
    assert_eq!(unread(&mut con, &keys2), 100);
}

#[test]
fn a_lag_redis_cannot_say_leaves_the_mover_unbounded_not_stuck() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    group_and_due(&mut con, &keys, 50);
    let stats = Stats::default();
    let c = MoverConfig {
        ahead: 40,
        ..cfg(10)
    };
    let mover = Mover::new(&keys, &c, &stats);
    assert_eq!(mover.tick(&mut con, NOW).unwrap().0.moved, 10);
    // An unread entry deleted by hand: Redis cannot say the group's lag any more.
    let last: Vec<(String, Vec<String>)> = redis::cmd("XREVRANGE")
        .arg(&keys.stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(&mut con)
        .unwrap();
    let id = &last[0].0;
    redis::cmd("XDEL")
        .arg(&keys.stream)
        .arg(id)
        .query::<()>(&mut con)
        .unwrap();
    // Redis cannot say how many are unread: the mover is not bounded then (held as if
    // full, it would wait for good, the lag coming back only with a new entry read), and
    // nothing stalls.
    let lag = delay_worker::figures::gather(&mut con, &keys, NOW, Duration::from_secs(300))
        .unwrap()
        .group
        .lag;
    assert_eq!(lag, None);
    let mut moved = 0;
    for _ in 0..10 {
        moved += mover.tick(&mut con, NOW).unwrap().0.moved;
    }
    assert_eq!(moved, 40);
    let left: i64 = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(left, 0);
}
