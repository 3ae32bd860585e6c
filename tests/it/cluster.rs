//! The worker on a real Redis Cluster (three masters, a replica each; see topology.rs):
//! the order story under `--key-prefix '{mq}'`, the operator commands against the cluster
//! URL, and the master serving the `{mq}` slot killed mid-run, its replica promoted. Each
//! test ends with the books: every order that should be cancelled is cancelled once,
//! stock and coupons add up, nothing is left scheduled or pending.

use crate::support::*;
use crate::topology::*;
use delay_worker::keys::Keys;
use std::collections::HashSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);
const PREFIX: &str = "{mq}";

fn keys() -> Keys {
    Keys::with_prefix(PREFIX)
}

/// The worker binary on `url` with this test's flags.
fn worker_on(url: &str, db: &TestDb, consumer: &str) -> Proc {
    Proc::start(
        &config_for(url, db, consumer),
        &["--key-prefix".into(), PREFIX.into()],
    )
}

/// `worker <args> --key-prefix {mq}` against the cluster, to completion.
fn admin(cluster: &Cluster, db: &TestDb, args: &[&str]) -> std::process::Output {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--key-prefix", PREFIX]);
    run_worker(&all, &cluster.url(), &db.url)
}

#[test]
fn the_order_story_on_a_cluster_with_the_operator_commands() {
    let cluster = Cluster::start();
    let db = TestDb::new();
    let k = keys();
    let orders = seed_orders(&db, 300);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&db, &paid);
    let (by_binary, by_client) = orders.split_at(10);
    // A few through `worker push` on the cluster URL, one of them cancelled again with
    // `worker cancel`; the rest straight to the master of the `{mq}` slot.
    for o in by_binary {
        let payload = format!(r#"{{"order_no":"{}"}}"#, o.order_no);
        let out = admin(
            &cluster,
            &db,
            &[
                "push",
                "--event",
                "order.timeout",
                "--payload",
                &payload,
                "--delay",
                "300ms",
                "--key",
                &timeout_key(o),
            ],
        );
        assert!(out.status.success(), "push: {}", text(&out.stderr));
    }
    let kept = &by_binary[1];
    assert!(!paid.iter().any(|p| p.id == kept.id));
    let out = admin(&cluster, &db, &["cancel", "--key", &timeout_key(kept)]);
    assert!(out.status.success(), "cancel: {}", text(&out.stderr));
    let out = admin(&cluster, &db, &["cancel", "--key", &timeout_key(kept)]);
    assert_eq!(out.status.code(), Some(1), "a second cancel finds nothing");
    let mut con = cluster.con_for(&k.pool);
    push_timeouts_on(&mut con, &k, by_client, 300);
    // A message that can only be a dead letter.
    delay_worker::store::push(&mut con, &k, "bad-1", "not json", delay_worker::now_ms()).unwrap();

    let mut p = worker_on(&cluster.url(), &db, "c1");
    wait_until(WAIT, "every job done and the dead letter", || {
        inbox_count(&db) == 299 && {
            let b = books_on(&mut con, &k);
            (b.pool, b.stream_pending, b.dead) == (0, 0, 1)
        }
    });

    // The operator commands against the cluster URL.
    let out = admin(&cluster, &db, &["stats", "--json"]);
    assert!(out.status.success(), "stats: {}", text(&out.stderr));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["pool"]["size"], 0, "{s}");
    assert_eq!(s["group"]["pending"], 0, "{s}");
    assert_eq!(s["dead"]["length"], 1, "{s}");
    assert_eq!(s["consumers"][0]["name"], "c1", "{s}");
    assert_eq!(s["consumers"][0]["heartbeat"], true, "{s}");
    let out = admin(&cluster, &db, &["stats", "--check"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "one new dead letter is a warning: {}",
        text(&out.stdout)
    );
    let out = admin(&cluster, &db, &["dead", "list", "--json"]);
    assert!(out.status.success(), "dead list: {}", text(&out.stderr));
    let letters: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(letters.as_array().map(Vec::len), Some(1), "{letters}");
    assert_eq!(letters[0]["key"], "bad-1");
    assert!(
        letters[0]["reason"].as_str().unwrap().contains("not JSON"),
        "{letters}"
    );

    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| o.id != kept.id && !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&db, &orders, &cancelled);
    let b = books_on(&mut con, &k);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 1));
}

#[test]
fn the_master_of_the_mq_slot_killed_mid_run_loses_nothing() {
    let mut cluster = Cluster::start();
    let db = TestDb::new();
    let k = keys();
    let orders = seed_orders(&db, 500);
    let paid: Vec<SeedOrder> = orders.iter().step_by(4).cloned().collect();
    pay(&db, &paid);
    // Due over the next two seconds, so the kill falls among moves, reads and acks.
    let mut con = cluster.con_for(&k.pool);
    for (i, chunk) in orders.chunks(50).enumerate() {
        push_timeouts_on(&mut con, &k, chunk, 200 * i as i64);
    }
    // Every push is on the replica before anything runs: what the failover may lose is
    // the worker's own writes, never a job.
    assert!(
        replicated(&mut con, 10_000),
        "the pushes reached the replica"
    );

    let mut p = worker_on(&cluster.url(), &db, "c1");
    wait_until(WAIT, "load", || inbox_count(&db) > 100);
    // The replica falls behind, then its master dies: the moves, reads and acks the
    // worker made in between are gone from the new master.
    let master = cluster.master_of(&k.pool);
    cut_replica_link(master, cluster.replica_of(master));
    let at_cut = inbox_count(&db);
    wait_until(WAIT, "jobs after the cut", || {
        inbox_count(&db) > at_cut + 20 || inbox_count(&db) == 500
    });
    let (killed, promoted) = cluster.kill_master_of(&k.pool);
    let at_kill = inbox_count(&db);
    cluster.wait_failover();
    assert_eq!(
        cluster.master_of(&k.pool),
        promoted,
        "the replica took over"
    );
    let mut con = con_to(promoted);
    let mut last = std::time::Instant::now();
    wait_until(WAIT, "every job after the failover", || {
        let (done, b) = (inbox_count(&db), books_on(&mut con, &k));
        if last.elapsed() > Duration::from_secs(10) {
            last = std::time::Instant::now();
            eprintln!(
                "done {done}, scheduled {}, pending {}, dead {}",
                b.pool, b.stream_pending, b.dead
            );
        }
        b.pool == 0
            && b.stream_pending == 0
            && group_lag(&mut con, &k) == Some(0)
            && inbox_keys(&db).len() == 500
    });
    let runs = stop_and_account(&mut p, &db, &orders, &paid);
    for o in &orders {
        assert!(runs.contains_key(&timeout_key(o)), "{} done", o.order_no);
    }
    let again = runs.values().filter(|&&n| n > 1).count();
    eprintln!(
        "cluster failover: replica cut off at {at_cut} of 500 done, master {killed} killed at \
         {at_kill}, replica {promoted} promoted; {again} job(s) ran twice"
    );
    assert_eq!(
        again, 0,
        "a move undone by the failover moves again as the same job"
    );
    let b = books_on(&mut con, &k);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
}

#[test]
fn three_shards_spread_over_the_masters_through_a_manual_failover() {
    let mut cluster = Cluster::start();
    let db = TestDb::new();
    let shards = Keys::default().sharded("mq", 3);
    let masters: Vec<u16> = shards.iter().map(|k| cluster.master_of(&k.pool)).collect();
    let distinct: HashSet<u16> = masters.iter().copied().collect();
    assert!(distinct.len() >= 2, "shards on masters {masters:?}");
    let orders = seed_orders(&db, 300);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&db, &paid);
    let shard = |o: &SeedOrder| delay_worker::keys::shard_of(timeout_key(o).as_bytes(), 3);
    let url = cluster.url();

    // The first jobs through `worker push --shards 3`, which records the count; the rest
    // straight to the master of each job's shard.
    for o in &orders[..6] {
        let payload = format!(r#"{{"order_no":"{}"}}"#, o.order_no);
        let key = timeout_key(o);
        let out = run_worker(
            &[
                "push",
                "--shards",
                "3",
                "--event",
                "order.timeout",
                "--payload",
                &payload,
                "--delay",
                "300ms",
                "--key",
                &key,
            ],
            &url,
            &db.url,
        );
        assert!(out.status.success(), "push: {}", text(&out.stderr));
        let scheduled: Option<f64> = redis::cmd("ZSCORE")
            .arg(&shards[shard(o)].pool)
            .arg(&key)
            .query(&mut con_to(masters[shard(o)]))
            .unwrap();
        assert!(scheduled.is_some(), "{key} in shard {}", shard(o));
    }
    let mut cons: Vec<redis::Connection> = masters.iter().map(|&m| con_to(m)).collect();
    let mut per_shard = [0usize; 3];
    for o in &orders {
        per_shard[shard(o)] += 1;
    }
    // Due over the next two seconds.
    for (i, o) in orders.iter().enumerate().skip(6) {
        let delay = 300 + 200 * (i % 10) as i64;
        push_timeout(&mut cons[shard(o)], &shards[shard(o)], o, delay).unwrap();
    }
    assert!(per_shard.iter().all(|&n| n > 50), "{per_shard:?}");
    // A dead letter in shards 0 and 2.
    for i in [0, 2] {
        let now = delay_worker::now_ms();
        delay_worker::store::push(
            &mut cons[i],
            &shards[i],
            &format!("bad-{i}"),
            "not json",
            now,
        )
        .unwrap();
    }

    let mut p = Proc::start(
        &config_for(&url, &db, "c1"),
        &["--shards".into(), "3".into()],
    );
    // Mid-run, the master of shard 0 hands its slots to its replica (MOVED for the
    // worker's next command there).
    wait_until(WAIT, "load", || inbox_count(&db) > 60);
    let (old, new) = cluster.switchover_of(&shards[0].pool);
    let at_switch = inbox_count(&db);
    let masters: Vec<u16> = shards.iter().map(|k| cluster.master_of(&k.pool)).collect();
    assert_eq!(masters[0], new);
    let mut cons: Vec<redis::Connection> = masters.iter().map(|&m| con_to(m)).collect();
    wait_until(WAIT, "every job done and the dead letters", || {
        inbox_count(&db) == 300
            && (0..3).all(|i| {
                let b = books_on(&mut cons[i], &shards[i]);
                (b.pool, b.stream_pending, b.dead) == (0, 0, usize::from(i != 1))
            })
    });

    let out = run_worker(&["stats", "--shards", "3", "--json"], &url, &db.url);
    assert!(out.status.success(), "stats: {}", text(&out.stderr));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut entries = 0;
    for i in 0..3 {
        let one = &s["shards"][i];
        let moved = per_shard[i] + usize::from(i != 1);
        assert_eq!(one["pool"]["key"], shards[i].pool.as_str(), "{one}");
        // Every job of the shard reached its stream; a job retried after meeting another
        // set's row lock (a lock timeout, on a busy machine) is moved again, as the same
        // key: one more entry.
        let (keys, n) = stream_keys(&mut cons[i], &shards[i].stream);
        assert_eq!(keys, moved, "shard {i}: {one}");
        assert_eq!(one["stream"]["entries_added"], n, "shard {i}: {one}");
        entries += n;
        assert_eq!(one["group"]["pending"], 0, "{one}");
        assert_eq!(one["dead"]["length"], usize::from(i != 1), "{one}");
    }
    assert_eq!(s["stream"]["entries_added"], entries, "the total: {s}");
    assert_eq!(s["dead"]["length"], 2, "{s}");
    let out = run_worker(&["stats", "--shards", "3"], &url, &db.url);
    let table = text(&out.stdout);
    assert!(table.contains("shard"), "{table}");
    let out = run_worker(&["dead", "list", "--shards", "3", "--json"], &url, &db.url);
    assert!(out.status.success(), "dead list: {}", text(&out.stderr));
    let letters: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut keys: Vec<&str> = letters
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    keys.sort();
    assert_eq!(keys, ["bad-0", "bad-2"]);

    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&db, &orders, &cancelled);
    eprintln!(
        "three shards: jobs {per_shard:?} on masters {masters:?}; shard 0's master {old} \
         handed over to {new} at {at_switch} of 300 done"
    );
}

/// How late each job of `of` ran (`worker_inbox.late_ms`, from its due time to its
/// transaction), by job key.
fn lateness(db: &TestDb, of: &[&SeedOrder]) -> Vec<i64> {
    let rows: std::collections::HashMap<String, Option<i64>> = db
        .client()
        .query("SELECT job_key, late_ms FROM worker_inbox", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    of.iter()
        .map(|o| {
            rows.get(&timeout_key(o))
                .copied()
                .flatten()
                .unwrap_or_else(|| panic!("{} done with its lateness", o.order_no))
        })
        .collect()
}

/// How long shard 2's slot stays in the middle of its reshard while the other shards take
/// a steady stream of jobs: long enough that the other shards held back with it would be
/// seconds late.
const HOLD: Duration = Duration::from_secs(6);
/// A job of shards 0 and 1 ran at most this late, before the reshard and during it (a
/// loaded 2-core machine running other tests: normally a few tens of milliseconds).
const LATE_BOUND_MS: i64 = 2_000;
/// During the reshard, the other shards' latest job ran at most this much later than
/// their latest before it.
const LATE_MARGIN_MS: i64 = 1_500;

#[test]
fn a_reshard_of_one_shard_s_slot_holds_back_only_that_shard() {
    let cluster = Cluster::start();
    let db = TestDb::new();
    let shards = Keys::default().sharded("mq", 3);
    let masters: Vec<u16> = shards.iter().map(|k| cluster.master_of(&k.pool)).collect();
    // Shard 2's slot moves to a master that serves none of the other shards.
    let from = masters[2];
    let all = cluster.masters();
    let to = *all
        .iter()
        .find(|p| !masters.contains(p))
        .or_else(|| all.iter().find(|p| **p != from))
        .unwrap();
    assert!(masters[0] != from && masters[1] != from, "{masters:?}");
    let orders = seed_orders(&db, 600);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&db, &paid);
    let shard = |o: &SeedOrder| delay_worker::keys::shard_of(timeout_key(o).as_bytes(), 3);
    let (held, others): (Vec<&SeedOrder>, Vec<&SeedOrder>) =
        orders.iter().partition(|o| shard(o) == 2);
    // The other shards' jobs: a batch due before the reshard, and a steady stream due
    // while shard 2 is held.
    let (before, during) = others.split_at(100);
    assert!(
        held.len() > 100 && during.len() > 250,
        "{} held, {} during",
        held.len(),
        during.len()
    );
    let url = cluster.url();
    let out = run_worker(&["stats", "--shards", "3"], &url, &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let port = free_port();
    let mut p = Proc::start(
        &config_for(&url, &db, "c1"),
        &[
            "--shards".into(),
            "3".into(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{port}"),
        ],
    );
    wait_until(WAIT, "the worker ready", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    let mut cons: Vec<redis::Connection> = masters.iter().map(|&m| con_to(m)).collect();
    let done = |of: &[&SeedOrder]| {
        let keys = inbox_keys(&db);
        of.iter()
            .filter(|o| keys.contains_key(&timeout_key(o)))
            .count()
    };
    // Before: the other shards' batch, due over the next second.
    for (i, o) in before.iter().enumerate() {
        let s = shard(o);
        push_timeout(&mut cons[s], &shards[s], o, 200 * (i % 5) as i64).unwrap();
    }
    wait_until(WAIT, "the batch before the reshard done", || {
        done(before) == before.len()
    });
    // Shard 2's jobs due in two seconds; then at once its slot starts to move, with its
    // pool already on the new master and the rest not yet: every script of shard 2 answers
    // TRYAGAIN.
    for o in &held {
        push_timeout(&mut cons[2], &shards[2], o, 2_000).unwrap();
    }
    let slot = cluster.slot_of(&shards[2].pool);
    cluster.begin_reshard(slot, from, to);
    cluster.migrate_keys(from, to, std::slice::from_ref(&shards[2].pool));
    let held_since = std::time::Instant::now();
    // During: a steady stream to the other shards over the hold, each job due 100 ms after
    // its push, pushed by a producer of its own while health is looked at.
    let stream = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut cons: Vec<redis::Connection> = masters.iter().map(|&m| con_to(m)).collect();
            let every = HOLD / during.len() as u32;
            for (i, o) in during.iter().enumerate() {
                let at = held_since + every * i as u32;
                std::thread::sleep(at.saturating_duration_since(std::time::Instant::now()));
                let s = shard(o);
                push_timeout(&mut cons[s], &shards[s], o, 100).unwrap();
            }
            held_since.elapsed()
        });
        // Health names the shard and the cause.
        wait_until(WAIT, "healthz naming shard 2 and TRYAGAIN", || {
            http_get(port, "/healthz").is_ok_and(|(c, _, b)| {
                c == 503 && b.contains("(shard 2)") && b.contains("TRYAGAIN")
            })
        });
        wait_until(WAIT, "stats --check naming shard 2 and TRYAGAIN", || {
            let out = run_worker(&["stats", "--shards", "3", "--check"], &url, &db.url);
            let line = text(&out.stdout);
            out.status.code() == Some(2) && line.contains("(shard 2)") && line.contains("TRYAGAIN")
        });
        producer.join().expect("the producer")
    });
    wait_until(WAIT, "the other shards' stream all done", || {
        done(during) == during.len()
    });
    assert_eq!(done(&held), 0, "shard 2 is held while its slot moves");
    let held_for = held_since.elapsed();
    // The other shards ran as late during the reshard as before it.
    let (late_before, late_during) = (lateness(&db, before), lateness(&db, during));
    let max = |l: &[i64]| l.iter().copied().max().unwrap();
    let median = |l: &[i64]| {
        let mut l = l.to_vec();
        l.sort_unstable();
        l[l.len() / 2]
    };
    let figures = format!(
        "shards 0 and 1, late before the reshard: median {} ms, max {} ms ({} jobs); during \
         it (shard 2 held {:.1} s, {} jobs pushed over {:.1} s): median {} ms, max {} ms",
        median(&late_before),
        max(&late_before),
        late_before.len(),
        held_for.as_secs_f64(),
        late_during.len(),
        stream.as_secs_f64(),
        median(&late_during),
        max(&late_during),
    );
    eprintln!("{figures}");
    assert!(held_for >= HOLD, "{figures}");
    assert!(
        max(&late_before) < LATE_BOUND_MS && max(&late_during) < LATE_BOUND_MS,
        "the other shards' jobs ran late: {figures}"
    );
    assert!(
        max(&late_during) <= max(&late_before) + LATE_MARGIN_MS,
        "the reshard held the other shards back: {figures}"
    );
    // The reshard ends: shard 2 catches up on its new master.
    cluster.end_reshard(slot, from, to);
    assert_eq!(cluster.master_of(&shards[2].pool), to);
    let mut cons: Vec<redis::Connection> = shards
        .iter()
        .map(|k| con_to(cluster.master_of(&k.pool)))
        .collect();
    wait_until(WAIT, "every job done", || {
        inbox_count(&db) == 600
            && (0..3).all(|i| {
                let b = books_on(&mut cons[i], &shards[i]);
                (b.pool, b.stream_pending, b.dead) == (0, 0, 0)
            })
    });
    wait_until(WAIT, "healthz green again", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    let runs = stop_and_account(&mut p, &db, &orders, &paid);
    assert!(runs.values().all(|&n| n == 1), "every job ran once");
}

/// The distinct job keys on `stream`, and its entries.
fn stream_keys(con: &mut redis::Connection, stream: &str) -> (usize, usize) {
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    let keys: std::collections::HashSet<String> = reply
        .ids
        .iter()
        .map(|e| e.get::<String>("key").expect("an entry's key"))
        .collect();
    (keys.len(), reply.ids.len())
}
