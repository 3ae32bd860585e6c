//! The worker behind Redis Sentinel (a master, one replica, three Sentinels; see
//! topology.rs): the order story through `redis+sentinel://`, the master SIGKILLed mid-run
//! and its replica promoted (the worker follows it and re-creates the consumer group the
//! new master lacks), a failover to a replica that missed every move (each job moved
//! again as the same job: a handler that is not idempotent by itself acts once), and what
//! asynchronous replication loses in a failover, measured push by push: an acknowledged
//! job is done once or lost, never twice, and a job whose push reached the replica
//! (`WAIT`) is never lost.

use crate::support::*;
use crate::topology::*;
use delay_worker::keys::Keys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(90);

/// Waits until nothing is scheduled, pending or unread on the current master, and `done`.
fn wait_settled(s: &Sentinel, k: &Keys, what: &str, mut done: impl FnMut() -> bool) {
    let mut last = std::time::Instant::now();
    wait_until(WAIT, what, || {
        let Some(mut con) = try_con(s.current_master()) else {
            return false;
        };
        let b = books_on(&mut con, k);
        if last.elapsed() > Duration::from_secs(10) {
            last = std::time::Instant::now();
            eprintln!(
                "scheduled {}, pending {}, dead {}, lag {:?}",
                b.pool,
                b.stream_pending,
                b.dead,
                group_lag(&mut con, k)
            );
        }
        b.pool == 0 && b.stream_pending == 0 && group_lag(&mut con, k) == Some(0) && done()
    });
}

#[test]
fn the_order_story_through_sentinel_then_a_failover_to_a_replica_without_the_group() {
    let mut s = Sentinel::start();
    let db = TestDb::new();
    let k = Keys::default();
    let orders = seed_orders(&db, 600);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&db, &paid);
    let (first, second) = orders.split_at(300);

    // The story: a few pushed with `worker push` through the Sentinels, the rest straight
    // to the master.
    for o in &first[..5] {
        let payload = format!(r#"{{"order_no":"{}"}}"#, o.order_no);
        let out = run_worker(
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
            &s.url(),
            &db.url,
        );
        assert!(out.status.success(), "push: {}", text(&out.stderr));
    }
    push_timeouts_on(&mut s.master_con(), &k, &first[5..], 300);
    let mut p = Proc::start(&config_for(&s.url(), &db, "c1"), &[]);
    wait_settled(&s, &k, "the first 300 jobs", || inbox_count(&db) == 300);
    let out = run_worker(&["stats", "--json"], &s.url(), &db.url);
    assert!(out.status.success(), "stats: {}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["group"]["pending"], 0, "{j}");
    assert_eq!(j["consumers"][0]["name"], "c1", "{j}");

    // The replica loses the consumer group: as if the master had created it and died
    // before sending it on. (A writable replica keeps its own writes to itself.)
    let mut replica = con_to(s.replica);
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("replica-read-only")
        .arg("no")
        .query::<()>(&mut replica)
        .unwrap();
    let destroyed: i64 = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&k.stream)
        .arg(&k.group)
        .query(&mut replica)
        .unwrap();
    assert_eq!(destroyed, 1);

    // More jobs, due over the next two seconds, each on the replica before the kill.
    let mut con = s.master_con();
    for (i, chunk) in second.chunks(50).enumerate() {
        // Due over the next two seconds.
        push_timeouts_on(&mut con, &k, chunk, 300 + 150 * i as i64);
    }
    assert!(
        replicated(&mut con, 10_000),
        "the pushes reached the replica"
    );
    wait_until(WAIT, "load", || inbox_count(&db) > 350);
    s.kill_master();
    let at_kill = inbox_count(&db);
    s.wait_failover();
    wait_settled(&s, &k, "every job after the failover", || {
        inbox_keys(&db).len() == 600
    });
    let groups: i64 = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&k.stream)
        .query::<Vec<redis::Value>>(&mut s.master_con())
        .unwrap()
        .len() as i64;
    assert_eq!(
        groups, 1,
        "the worker re-created the group on the new master"
    );
    let runs = stop_and_account(&mut p, &db, &orders, &paid);
    for o in &orders {
        assert_eq!(
            runs.get(&timeout_key(o)),
            Some(&1),
            "{} done once",
            o.order_no
        );
    }
    eprintln!("sentinel failover: killed at {at_kill} of 600 done; no job ran twice");
    let b = books_on(&mut s.master_con(), &k);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
}

/// Every move made after the replica was cut off is undone by the failover: the new master
/// still holds each member, its score and its data, and the worker moves each again as the
/// same job (its identity comes from them). So a handler that is not idempotent by itself
/// (a row per run) acts once, and every order is cancelled once.
#[test]
fn a_failover_to_a_replica_that_missed_every_move_runs_each_job_once() {
    use crate::identity::{inbox_rows, ledger, ledger_msg, php_push, runs, stamps};
    let mut s = Sentinel::start();
    let db = TestDb::new();
    let dir = ledger(&db);
    let k = Keys::default();
    let orders = seed_orders(&db, 30);
    let mut p = Proc::start(
        &config_for(&s.url(), &db, "c1"),
        &["--handlers-dir".into(), dir.0.display().to_string()],
    );
    // The worker is up, its consumer group on the replica too, before anything is due.
    wait_until(WAIT, "the worker's heartbeat", || {
        redis::cmd("EXISTS")
            .arg(k.heartbeat("c1"))
            .query::<bool>(&mut s.master_con())
            .unwrap_or(false)
    });
    let mut con = s.master_con();
    let now = delay_worker::now_ms();
    for i in 0..40 {
        let msg = ledger_msg(&format!("n{i}"), now / 1000);
        php_push(&mut con, &k, &format!("ledger:{i}"), &msg, now + 2500);
    }
    push_timeouts_on(&mut con, &k, &orders, 2500);
    assert!(
        replicated(&mut con, 10_000),
        "the pushes reached the replica"
    );
    cut_replica_link(s.master, s.replica);
    // Moved, run and acknowledged on the old master alone.
    wait_until(WAIT, "every job done on the old master", || {
        inbox_count(&db) == 70
    });
    let first = inbox_rows(&db);
    let on_replica: usize = redis::cmd("ZCARD")
        .arg(&k.pool)
        .query(&mut con_to(s.replica))
        .unwrap();
    assert_eq!(on_replica, 70, "the replica never received a move");
    s.kill_master();
    s.wait_failover();
    // Every member moves again on the new master, each a duplicate of its first run.
    wait_settled(&s, &k, "every job moved again", || {
        let mut con = s.master_con();
        redis::cmd("XLEN")
            .arg(&k.stream)
            .query::<usize>(&mut con)
            .unwrap_or(0)
            == 70
    });
    let again = stamps(&mut s.master_con(), &k);
    let runs_by_key = stop_and_account(&mut p, &db, &orders, &[]);
    assert_eq!(again.len(), 70);
    for (key, ids) in &again {
        assert_eq!(ids.len(), 1, "{key}: moved again once");
        assert_eq!(
            first[key][0].0, ids[0],
            "{key}: moved again as the same job"
        );
    }
    assert_eq!(inbox_rows(&db), first, "no inbox row added or changed");
    assert!(runs_by_key.values().all(|&n| n == 1));
    let ledger_runs = runs(&db);
    assert_eq!(ledger_runs.len(), 40);
    assert!(
        ledger_runs.values().all(|&n| n == 1),
        "each ledger job ran once: {ledger_runs:?}"
    );
    let b = books_on(&mut s.master_con(), &k);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
}

#[test]
fn after_a_switchover_the_worker_leaves_the_old_master_though_it_stays_a_master() {
    // The old master is never turned into a replica: a worker that went on writing there
    // would see nothing wrong, while the Sentinels (and every producer that asks them)
    // name the new master, and what it wrote there would be lost.
    let mut s = Sentinel::start_with_a_stubborn_master();
    let db = TestDb::new();
    let k = Keys::default();
    let orders = seed_orders(&db, 400);
    let paid: Vec<SeedOrder> = orders.iter().step_by(4).cloned().collect();
    pay(&db, &paid);
    // Due over the next two seconds, every push on the replica before anything runs.
    let mut con = s.master_con();
    for (i, chunk) in orders.chunks(40).enumerate() {
        push_timeouts_on(&mut con, &k, chunk, 200 * i as i64);
    }
    assert!(
        replicated(&mut con, 10_000),
        "the pushes reached the replica"
    );
    drop(con);
    let mut p = Proc::start(&config_for(&s.url(), &db, "c1"), &[]);
    wait_until(WAIT, "load", || inbox_count(&db) > 100);
    let (old, new) = (s.master, s.replica);
    s.switchover();
    let at_switch = inbox_count(&db);
    // The worker's heartbeat (refreshed every --block, 2 s TTL) moves to the new master
    // and lapses on the old one, which still says it is a master.
    let heartbeat = k.heartbeat("c1");
    let alive = |port: u16| -> bool {
        try_con(port).is_some_and(|mut c| {
            redis::cmd("EXISTS")
                .arg(&heartbeat)
                .query::<bool>(&mut c)
                .unwrap_or(false)
        })
    };
    wait_until(WAIT, "the worker's heartbeat on the new master", || {
        alive(new)
    });
    wait_until(
        WAIT,
        "the worker's heartbeat to lapse on the old master",
        || !alive(old),
    );
    assert_eq!(
        info(old, "replication").get("role").map(String::as_str),
        Some("master"),
        "the old master is still a master"
    );
    wait_settled(&s, &k, "every job after the switchover", || {
        inbox_keys(&db).len() == 400
    });
    let out = run_worker(&["stats", "--json"], &s.url(), &db.url);
    assert!(out.status.success(), "stats: {}", text(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["pool"]["size"], 0, "{j}");
    assert_eq!(j["group"]["pending"], 0, "{j}");
    let runs = stop_and_account(&mut p, &db, &orders, &paid);
    assert!(runs.values().all(|&n| n == 1), "no job ran twice");
    eprintln!("sentinel switchover {old} -> {new} at {at_switch} of 400 done; no job ran twice");
    let b = books_on(&mut s.master_con(), &k);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
}

/// One push attempt: the order, when it was sent, whether Redis acknowledged it, and
/// whether `WAIT 1` then confirmed it on the replica.
struct Attempt {
    order_no: String,
    sent: Instant,
    acked: bool,
    confirmed: bool,
}

/// What one pushing thread did, and whether it ran out of orders.
#[derive(Default)]
struct Pushes {
    attempts: Vec<Attempt>,
    finished: bool,
}

impl Pushes {
    fn acked(&self) -> usize {
        self.attempts.iter().filter(|a| a.acked).count()
    }

    /// Acknowledged pushes sent after `t`.
    fn acked_since(&self, t: Instant) -> usize {
        self.attempts
            .iter()
            .filter(|a| a.acked && a.sent > t)
            .count()
    }
}

/// Pushes each order's timeout (due `delay_ms` to 50 ms later) to whatever master the
/// Sentinels name, one every few milliseconds, until `stop`; with `confirm`, each push is
/// followed by `WAIT 1 100`. A push that fails (the master gone, the replica not yet promoted) is
/// recorded unacknowledged, and the next order goes to a fresh connection.
fn pusher(
    sentinels: Vec<u16>,
    orders: Vec<SeedOrder>,
    delay_ms: i64,
    confirm: bool,
    stop: Arc<AtomicBool>,
    out: Arc<Mutex<Pushes>>,
) {
    let k = Keys::default();
    let mut con: Option<redis::Connection> = None;
    for (i, o) in orders.iter().enumerate() {
        while con.is_none() {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            con = sentinels
                .iter()
                .find_map(|&p| Sentinel::master_seen_by(p))
                .and_then(try_con);
            if con.is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let c = con.as_mut().unwrap();
        let sent = Instant::now();
        let acked = push_timeout(c, &k, o, delay_ms + (i % 50) as i64).is_ok();
        let confirmed = acked && confirm && replicated(c, 100);
        out.lock().unwrap().attempts.push(Attempt {
            order_no: o.order_no.clone(),
            sent,
            acked,
            confirmed,
        });
        if !acked {
            con = None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    out.lock().unwrap().finished = true;
}

#[test]
fn pushes_across_a_failover_are_done_once_or_lost_and_replicated_ones_are_never_lost() {
    let mut s = Sentinel::start();
    let db = TestDb::new();
    let k = Keys::default();
    let orders = seed_orders(&db, 700);
    let mut p = Proc::start(&config_for(&s.url(), &db, "c1"), &[]);

    // Two producers: one fires pushes due in a second (those the old master takes after
    // its replica is cut off are still waiting when it dies), one confirms each push with
    // `WAIT 1`.
    let stop = Arc::new(AtomicBool::new(false));
    let fired = Arc::new(Mutex::new(Pushes::default()));
    let confirmed = Arc::new(Mutex::new(Pushes::default()));
    let threads: Vec<_> = [
        (orders[..450].to_vec(), 1000, false, fired.clone()),
        (orders[450..].to_vec(), 0, true, confirmed.clone()),
    ]
    .into_iter()
    .map(|(mine, delay_ms, confirm, out)| {
        let (sentinels, stop) = (s.sentinels.clone(), stop.clone());
        std::thread::spawn(move || pusher(sentinels, mine, delay_ms, confirm, stop, out))
    })
    .collect();
    let acked = |p: &Arc<Mutex<Pushes>>| p.lock().unwrap().acked();
    let acked_since = |p: &Arc<Mutex<Pushes>>, t| p.lock().unwrap().acked_since(t);
    let finished = |p: &Arc<Mutex<Pushes>>| p.lock().unwrap().finished;

    wait_until(WAIT, "pushes and jobs under way", || {
        acked(&fired) >= 150 && acked(&confirmed) >= 50 && inbox_count(&db) >= 100
    });
    let cut = cut_replica_link(s.master, s.replica);
    let done_at_cut = inbox_count(&db);
    // Pushes, moves and acks the replica never gets.
    wait_until(WAIT, "pushes and jobs after the cut", || {
        acked_since(&fired, cut) >= 50 && inbox_count(&db) > done_at_cut + 20
    });
    s.kill_master();
    let killed = Instant::now();
    // The jobs done by then: those moved again on the new master had their move undone.
    let done_at_kill: std::collections::HashSet<String> = inbox_keys(&db).into_keys().collect();
    let killed_ms = delay_worker::now_ms();
    s.wait_failover();
    // Pushing goes on against the new master for a while.
    wait_until(WAIT, "pushes to the new master", || {
        (acked_since(&fired, killed) >= 50 || finished(&fired))
            && (acked_since(&confirmed, killed) >= 10 || finished(&confirmed))
    });
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    wait_settled(&s, &k, "every job that exists", || true);
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());

    // Each order's fate, from the producers' records and the books.
    let moved_again = redis::cmd("XRANGE")
        .arg(&k.stream)
        .arg(killed_ms)
        .arg("+")
        .query::<Vec<(String, HashMap<String, String>)>>(&mut s.master_con())
        .unwrap()
        .iter()
        .filter(|(_, f)| done_at_kill.contains(&f["key"]))
        .count();
    let runs = inbox_keys(&db);
    let cancelled = cancelled_orders(&db);
    let (fired, confirmed) = (fired.lock().unwrap(), confirmed.lock().unwrap());
    let attempts: HashMap<&str, &Attempt> = fired
        .attempts
        .iter()
        .chain(&confirmed.attempts)
        .map(|a| (a.order_no.as_str(), a))
        .collect();
    let (mut acked, mut lost, mut in_window, mut window_lost, mut early_lost) = (0, 0, 0, 0, 0);
    let (mut unacked, mut unacked_done, mut again) = (0, 0, 0);
    for o in &orders {
        let done = runs.get(&timeout_key(o)).copied().unwrap_or(0);
        assert_eq!(
            done > 0,
            cancelled.contains(&o.order_no),
            "order {}: cancelled if and only if its job was done",
            o.order_no
        );
        again += (done > 1) as usize;
        let Some(a) = attempts.get(o.order_no.as_str()) else {
            assert_eq!(done, 0, "order {} was never pushed", o.order_no);
            continue;
        };
        if !a.acked {
            unacked += 1;
            unacked_done += (done > 0) as usize;
            continue;
        }
        acked += 1;
        lost += (done == 0) as usize;
        if a.confirmed {
            assert!(
                done > 0,
                "order {}: confirmed on the replica, lost",
                o.order_no
            );
        }
        if a.sent > cut && a.sent < killed {
            // Acknowledged by the old master after its replica was cut off: lost, unless
            // it ran before the master died.
            in_window += 1;
            window_lost += (done == 0) as usize;
        } else if a.sent > killed {
            assert!(
                done > 0,
                "order {}: pushed to the new master, lost",
                o.order_no
            );
        } else {
            early_lost += (done == 0) as usize;
        }
    }
    let confirmed_n = confirmed.attempts.iter().filter(|a| a.confirmed).count();
    eprintln!(
        "sentinel failover: {acked} pushes acknowledged, {confirmed_n} of them confirmed by \
         WAIT 1; {lost} lost: {window_lost} of the {in_window} acknowledged after the \
         replica's link was cut, {early_lost} before; {unacked} pushes failed ({unacked_done} of them done all \
         the same); {moved_again} job(s) done before the kill moved again after the failover, \
         {again} ran twice"
    );
    assert_eq!(
        again, 0,
        "a move undone by the failover moves again as the same job"
    );
    assert!(in_window >= 50, "the window held pushes");
    assert_eq!(lost, window_lost + early_lost);
    // Stock and coupons: each cancelled order gave back once.
    let all_cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| cancelled.contains(&o.order_no))
        .collect();
    assert_accounting(&db, &orders, &all_cancelled);
    assert_eq!(books_on(&mut s.master_con(), &k).dead, 0);
}

/// A Sentinel that accepts connections and never answers, listed first: each look-up
/// gives up on it after its deadline and asks the next, so `push`, `stats` and a graceful
/// stop of the daemon all finish (redis-rs's own Sentinel client waited for ever).
#[test]
fn a_sentinel_that_never_answers_costs_a_deadline_not_the_worker() {
    let s = Sentinel::start();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    {
        let (silent, held) = (silent.try_clone().unwrap(), held.clone());
        std::thread::spawn(move || {
            for c in silent.incoming().flatten() {
                held.lock().unwrap().push(c);
            }
        });
    }
    let url = s.url().replacen(
        "redis+sentinel://",
        &format!(
            "redis+sentinel://127.0.0.1:{},",
            silent.local_addr().unwrap().port()
        ),
        1,
    );
    let db = TestDb::new();
    let run = |args: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_worker"));
        cmd.args(args)
            .env("REDIS_URL", &url)
            .env("DATABASE_URL", &db.url)
            .env("RUST_LOG", "warn")
            // What the commands print is not looked at: a passing run stays quiet.
            .stdout(std::process::Stdio::null());
        let mut p = Proc::spawn(cmd);
        let status = p.wait(Duration::from_secs(60));
        (status, p.log())
    };
    let (status, log) = run(&[
        "push",
        "--event",
        "coupon.expire",
        "--payload",
        r#"{"coupon_id":1}"#,
        "--delay",
        "1h",
        "--key",
        "k1",
    ]);
    assert!(status.success(), "{log}");
    let scheduled: u64 = redis::cmd("ZCARD")
        .arg("mq:delay:pool")
        .query(&mut s.master_con())
        .unwrap();
    assert_eq!(
        scheduled, 1,
        "pushed to the master the other Sentinels name"
    );
    // No worker yet: the queue's figures alone.
    let (status, log) = run(&["stats", "--check", "--expect-workers", "0"]);
    assert!(status.success(), "{log}");

    let mut d = Proc::start(&config_for(&url, &db, "c1"), &[]);
    wait_until(WAIT, "the worker's reader to start", || {
        let mut con = s.master_con();
        redis::cmd("EXISTS")
            .arg(Keys::default().heartbeat("c1"))
            .query::<bool>(&mut con)
            .unwrap_or(false)
    });
    d.signal(libc::SIGTERM);
    let status = d.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", d.log());
}
