//! The fault suite: each scenario runs under a real load of order timeouts and ends with
//! the accounting — every order that should be cancelled is cancelled once, stock and
//! coupons add up, and pushed = done + dead-lettered + still scheduled with nothing pending.
//! (Redis restarted with AOF, a PostgreSQL outage, kill -9 then restart and SIGTERM during
//! a burst are in consumer.rs; list-mode crashes in list.rs.)

use crate::support::*;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

fn all(orders: &[SeedOrder]) -> Vec<&SeedOrder> {
    orders.iter().collect()
}

#[test]
fn kill_9_five_times_in_a_row_during_a_backlog() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 3000);
    push_timeouts(&env, &orders, 0);
    for round in 0..5 {
        let before = inbox_count(&env.db);
        let mut p = Proc::start(&env.config, &[]);
        wait_until(WAIT, "progress", || {
            inbox_count(&env.db) >= before + 150
                || books(&env).pool == 0
                    && books(&env).stream_pending == 0
                    && inbox_count(&env.db) == 3000
        });
        p.kill9();
        eprintln!("round {round}: killed at {} done", inbox_count(&env.db));
    }
    let mut p = Proc::start(&env.config, &[]);
    wait_until(WAIT, "the rest", || {
        inbox_count(&env.db) == 3000 && books(&env).stream_pending == 0
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success());
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 3000);
    assert_eq!(books(&env).dead, 0);
}

#[test]
fn two_workers_one_killed_and_never_restarted() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 2000);
    let paid: Vec<SeedOrder> = orders.iter().step_by(3).cloned().collect();
    pay(&env.db, &paid);
    push_timeouts(&env, &orders, 0);
    let mut a = env.config.clone();
    a.consumer = "host-a".into();
    let mut b = env.config.clone();
    b.consumer = "host-b".into();
    let mut pa = Proc::start(&a, &[]);
    let mut pb = Proc::start(&b, &[]);
    wait_until(WAIT, "load", || inbox_count(&env.db) > 300);
    pa.kill9();
    // host-b takes over host-a's pending entries once host-a's heartbeat (2 s) expires,
    // without waiting for --claim-idle (60 s).
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 2000 && books(&env).stream_pending == 0
    });
    pb.signal(libc::SIGTERM);
    assert!(pb.wait(WAIT).success());
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_all_accounted(&env, &env.db, 2000);
}

#[test]
fn redis_client_connections_killed_mid_run() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1500);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    for _ in 0..5 {
        let before = inbox_count(&env.db);
        wait_until(WAIT, "progress", || {
            inbox_count(&env.db) > before || inbox_count(&env.db) == 1500
        });
        let mut con = env.con();
        let _: redis::Value = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query(&mut con)
            .unwrap_or(redis::Value::Nil);
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 1500 && books(&env).stream_pending == 0 && books(&env).pool == 0
    });
    let report = daemon.stop();
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 1500);
    assert_eq!(report.stats.dead, 0, "{}", report.stats);
}

#[test]
fn postgres_restarted_mid_run() {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 1500);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "progress", || inbox_count(&env.db) > 200);
    pg.crash_restart(Duration::from_millis(1500));
    wait_all_done(&env, 1500);
    let report = daemon.stop();
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 1500);
    assert_eq!(
        report.stats.dead, 0,
        "no job dead-lettered by an outage: {}",
        report.stats
    );
    // One set of counters, even when acks whose commits were in doubt became re-queues:
    // each move ended one way (a re-queued job whose commit survived comes back as a
    // duplicate), and no job counted as done twice.
    let s = report.stats;
    assert_eq!(
        s.moved,
        s.done + s.noop + s.duplicate + s.dead + s.retried,
        "{s}"
    );
    assert!(s.done <= 1500, "{s}");
}

/// PostgreSQL down for every process longer than a heartbeat: each marks itself as having
/// no usable database, and none takes the other's jobs while both are without one; back,
/// every job is done once, none is a dead letter, and the two processes' counters add up.
#[test]
fn postgres_down_for_two_processes_longer_than_a_heartbeat() {
    let (mut env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 2000);
    push_timeouts(&env, &orders, 0);
    // Maintenance every second, as a heartbeat of 2 s allows: a process back takes a
    // marked peer's jobs only after two passes, by which time a peer back too has taken its
    // mark away, even on a loaded machine.
    env.config.reader.block = Duration::from_secs(1);
    let mut a = env.config.clone();
    a.consumer = "host-a".into();
    let mut b = env.config.clone();
    b.consumer = "host-b".into();
    let (da, db) = (Daemon::start(&a), Daemon::start(&b));
    wait_until(WAIT, "progress", || inbox_count(&env.db) > 300);
    // Three heartbeats (2 s each in the tests) down.
    pg.crash_restart(Duration::from_secs(6));
    wait_all_done(&env, 2000);
    let reports = [da.stop(), db.stop()];
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 2000);
    // Each process's movers feed both: the counters add up over the two.
    let [a, b] = reports.map(|r| r.stats);
    assert_eq!((a.dead, b.dead), (0, 0), "{a}; {b}");
    let ended =
        |s: &delay_worker::stats::Snapshot| s.done + s.noop + s.duplicate + s.dead + s.retried;
    assert_eq!(a.moved + b.moved, ended(&a) + ended(&b), "{a}; {b}");
    assert!(a.done + b.done <= 2000, "{a}; {b}");
    // Neither took the other's jobs for want of a database: both were without one, and
    // both were back within two passes of each other.
    assert_eq!((a.reclaimed, b.reclaimed), (0, 0), "{a}; {b}");
}

#[test]
fn postgres_out_of_connections_for_a_while() {
    let (env, pg) = Env::on_own_postgres(&[
        "-c max_connections=12",
        "-c superuser_reserved_connections=0",
    ]);
    let orders = seed_orders(&env.db, 1500);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "progress", || inbox_count(&env.db) > 200);
    // Take every free connection slot, then cut the worker's connections: they cannot
    // come back until the slots are released.
    let mut hogs = Vec::new();
    while let Ok(c) = postgres::Client::connect(&pg.url, postgres::NoTls) {
        hogs.push(c);
    }
    // Cut the worker's connections and take the slots they free, until the worker holds
    // none (it races us for them).
    let worker_conns = |c: &mut postgres::Client| -> i64 {
        c.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'delay-worker'",
            &[],
        )
        .unwrap()
        .get(0)
    };
    for _ in 0..200 {
        if worker_conns(&mut hogs[0]) == 0 {
            break;
        }
        hogs[0]
            .execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'delay-worker'", &[])
            .unwrap();
        // Termination is asynchronous: give the backends a moment to exit and free slots.
        std::thread::sleep(Duration::from_millis(20));
        while let Ok(c) = postgres::Client::connect(&pg.url, postgres::NoTls) {
            hogs.push(c);
        }
    }
    assert_eq!(
        worker_conns(&mut hogs[0]),
        0,
        "the worker holds no connection"
    );
    let stalled = inbox_count_via(&mut hogs[0]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        inbox_count_via(&mut hogs[0]) - stalled < 50,
        "no connections, (almost) no progress"
    );
    drop(hogs);
    wait_all_done(&env, 1500);
    let report = daemon.stop();
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 1500);
    assert_eq!(report.stats.dead, 0, "{}", report.stats);
}

/// Waits until all `n` jobs are in the inbox with nothing pending or scheduled, printing
/// the books every 10 s so a stuck run shows where it stands.
fn wait_all_done(env: &Env, n: i64) {
    let mut last_report = std::time::Instant::now();
    wait_until(WAIT, "every job", || {
        let (done, b) = (inbox_count(&env.db), books(env));
        if last_report.elapsed() > Duration::from_secs(10) {
            last_report = std::time::Instant::now();
            eprintln!(
                "done {done}, pending {}, scheduled {}, dead {}",
                b.stream_pending, b.pool, b.dead
            );
        }
        done == n && b.stream_pending == 0 && b.pool == 0
    });
}

fn inbox_count_via(c: &mut postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM worker_inbox", &[])
        .unwrap()
        .get(0)
}

#[test]
fn a_handler_failing_transiently_for_30_percent_of_jobs() {
    retry_storm(Env::new());
}

#[test]
fn a_retry_storm_with_several_jobs_per_transaction() {
    // A failing job aborts its batch; each job of it then runs alone.
    let mut env = Env::new();
    env.config.jobs.tx_batch = 8;
    retry_storm(env);
}

fn retry_storm(mut env: Env) {
    // Serialization failures in 30 % of the runs.
    let _dir = failing_order_timeout(&mut env, 0.3, "40001", order_timeout_with);
    let orders = seed_orders(&env.db, 1000);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 1000 && books(&env).pool == 0 && books(&env).stream_pending == 0
    });
    let report = daemon.stop();
    eprintln!("{}", report.stats);
    assert!(
        report.stats.retried > 150,
        "a retry storm happened: {}",
        report.stats
    );
    assert_eq!(report.stats.dead, 0);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 1000);
}

#[test]
fn a_handler_slower_than_claim_idle_is_reclaimed_by_a_second_worker() {
    let mut env = Env::new();
    let dir = slow_order_timeout("CASE WHEN $1 ->> 'order_no' LIKE '%7' THEN 4 ELSE 0 END");
    env.config.handlers_dir = Some(dir.0.clone());
    env.config.reader.claim_idle = Duration::from_secs(1);
    env.config.jobs.statement_timeout = Duration::from_secs(10);
    // The fast jobs share five skus across two processes: on a loaded machine a sku's
    // lock can be held past the default 100 ms, a retry that is not this test's subject.
    // A second still times out the reclaimed copy's wait on the slow one's inbox row
    // (reclaimed after 1-2 s of the slow job's 4).
    env.config.jobs.lock_timeout = Duration::from_secs(1);
    let orders = seed_orders(&env.db, 100);
    let mut a = env.config.clone();
    a.consumer = "host-a".into();
    let mut b = env.config.clone();
    b.consumer = "host-b".into();
    let da = Daemon::start(&a);
    let db_ = Daemon::start(&b);
    push_timeouts(&env, &orders, 0);
    // A reclaimed copy's inbox insert waits on the slow copy's uncommitted row past
    // --lock-timeout: the job is running in another session, which decides it; the copy
    // is left pending (the same entry), neither retried nor dead-lettered.
    wait_until(WAIT, "every job", || {
        let b = books(&env);
        inbox_count(&env.db) == 100 && b.stream_pending == 0 && b.pool == 0
    });
    let ra = da.stop();
    let rb = db_.stop();
    let reclaimed = ra.stats.reclaimed + rb.stats.reclaimed;
    eprintln!("a: {}\nb: {}", ra.stats, rb.stats);
    assert!(reclaimed >= 1, "slow entries were reclaimed");
    assert_eq!(
        ra.stats.retried + rb.stats.retried,
        0,
        "a copy of a running job goes back to no pool"
    );
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 100);
}

#[test]
fn a_second_delivery_of_a_running_job_leaves_it_to_the_running_one() {
    // One job runs slowly (3 s) while its entry is reclaimed (claim idle 1 s) and its key
    // is pushed again, due later: the reclaimed copy waits on the running one's inbox
    // row. Were it sent back to the pool as contention, its retry would meet the newer
    // push and become a dead letter of a job that the running copy then commits.
    let mut env = Env::new();
    let dir = slow_order_timeout("CASE WHEN $1 ->> 'order_no' LIKE '%7' THEN 3 ELSE 0 END");
    env.config.handlers_dir = Some(dir.0.clone());
    env.config.reader.claim_idle = Duration::from_secs(1);
    env.config.jobs.statement_timeout = Duration::from_secs(10);
    let orders = seed_orders(&env.db, 10);
    let slow: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| o.order_no.ends_with('7'))
        .collect();
    assert_eq!(slow.len(), 1, "one slow order");
    let mut a = env.config.clone();
    a.consumer = "host-a".into();
    let mut b = env.config.clone();
    b.consumer = "host-b".into();
    let da = Daemon::start(&a);
    let db_ = Daemon::start(&b);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the slow job running", || sleeping(&env.db) > 0);
    // The producer pushes the slow order's key again while its job runs: a new job, due
    // in 4 s (after the slow one has committed).
    push_timeouts(
        &env,
        &slow.iter().map(|o| (*o).clone()).collect::<Vec<_>>(),
        4_000,
    );
    wait_until(
        WAIT,
        "both jobs of the slow key and every other job",
        || {
            let b = books(&env);
            inbox_count(&env.db) == 11 && b.stream_pending == 0 && b.pool == 0
        },
    );
    let ra = da.stop();
    let rb = db_.stop();
    eprintln!("a: {}\nb: {}", ra.stats, rb.stats);
    assert!(
        ra.stats.reclaimed + rb.stats.reclaimed >= 1,
        "the slow job's entry was reclaimed while it ran"
    );
    assert_eq!(
        dead_letters(&env),
        Vec::<HashMap<String, String>>::new(),
        "no dead letter"
    );
    assert_eq!(
        ra.stats.retried + rb.stats.retried,
        0,
        "nothing went back to the pool"
    );
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 11);
}

#[test]
fn a_commit_whose_durability_was_in_doubt_is_looked_up_not_sent_round_again() {
    // A worker commits a job (group commit: not yet flushed), then loses its PostgreSQL
    // connection before the flush that makes the ack safe. The server is fine and the
    // commit is there: on a new session the worker flushes and finds its inbox row, and
    // acknowledges it. Sent round the pool again instead, its retry would meet the newer
    // push of its key the producer made meanwhile, and be a dead letter of a job that was
    // done.
    use delay_worker::delivery::Outcome;
    use delay_worker::store::{self, stream, Pool, Target};
    use delay_worker::workers::Worker;
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let k = &env.config.keys;
    let mut con = env.con();
    stream::ensure_group(&mut con, k).unwrap();
    push_timeouts(&env, &orders, 0);
    let pool = Pool::Enveloped {
        pool: &k.pool,
        data: &k.data,
    };
    let target = Target::Stream {
        stream: &k.stream,
        dead: &k.dead,
    };
    let now = delay_worker::now_ms();
    let moved = store::move_due(
        &mut con,
        pool,
        k,
        target,
        (now + 1000).into(),
        10,
        60_000,
        65_536,
        0,
    )
    .unwrap();
    assert_eq!(moved.moved, 1);
    let reading = stream::Reading {
        keys: k,
        consumer: "c1",
        max_bytes: 65_536,
    };
    let d = stream::read(&mut con, reading, 10, ">")
        .unwrap()
        .deliveries
        .pop()
        .unwrap();

    let parts = WorkerParts::new(&env, delay_worker::handlers::Registry::builtin());
    assert!(env.config.jobs.group_commit, "group commit is the default");
    let ctx = parts.ctx(&env, k);
    let mut w = Worker::new(0, &ctx);
    let s = w.handle(d).expect("an outcome");
    assert_eq!(s.outcome, Outcome::Ack);
    // The producer pushes the key again (a new job, due later), and the worker's
    // connection goes before its flush.
    push_timeouts(&env, &orders, 60_000);
    let mut pg = env.db.client();
    let cut: i64 = pg
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'delay-worker'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(cut, 1, "the worker's connection cut");
    let mut outcomes = vec![s];
    w.settle(&mut outcomes);
    let counted = parts.stats.snapshot();
    assert_eq!(
        (counted.done, counted.retried, counted.dead),
        (1, 0, 0),
        "acknowledged as done, not sent round: {counted}"
    );
    let b = books(&env);
    assert_eq!(
        (b.stream_pending, b.dead, b.pool),
        (0, 0, 1),
        "the entry acknowledged, no dead letter, the newer push scheduled"
    );
    assert_eq!(dead_letters(&env), Vec::<HashMap<String, String>>::new());
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(inbox_count(&env.db), 1);
}

#[test]
fn a_worker_killed_mid_transaction_and_restarted_runs_its_jobs_once_the_orphans_end() {
    // kill -9 while a slow job (2 s) is inside its transaction: their
    // backends run on alone until their statements end. The restarted worker takes its own
    // pending entries back at once; each job's inbox insert meets its orphan's row. It waits
    // the orphan out and runs the job (the orphan rolls back: its client is gone), instead
    // of leaving the entry for --claim-idle (here 5 minutes) or sending it round the pool.
    let mut env = Env::new();
    env.config.threads = 1;
    let dir = slow_order_timeout("2");
    let orders = seed_orders(&env.db, 8);
    let args = [
        "--handlers-dir".to_string(),
        dir.0.display().to_string(),
        "--claim-idle".into(),
        "5m".into(),
        "--statement-timeout".into(),
        "10s".into(),
    ];
    let mut p = Proc::start(&env.config, &args);
    push_timeouts(&env, &orders, 0);
    // One worker runs the jobs one after another (no set form): kill it with two of them
    // committed and the third inside its transaction.
    wait_until(WAIT, "a job inside its transaction after two done", || {
        inbox_count(&env.db) >= 2 && sleeping(&env.db) == 1
    });
    p.kill9();
    let mut p = Proc::start(&env.config, &args);
    wait_until(WAIT, "every job done by the restarted worker", || {
        let b = books(&env);
        inbox_count(&env.db) == 8 && b.stream_pending == 0 && b.pool == 0
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    assert_eq!(books(&env).dead, 0);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_all_accounted(&env, &env.db, 8);
}

/// Dead letters over `--dead-rate-crit` in a minute: `/healthz` red and `stats --check`
/// CRITICAL naming the rate, green again once the minute has passed. (Here, not among the
/// shop's database tests, so that its minute starts early in a run of the whole suite
/// rather than end it.)
#[test]
fn dead_letters_faster_than_the_threshold_turn_healthz_red() {
    use crate::shopdb::{healthz, start_with_health, stop, wait_check_critical};
    let env = Env::new();
    let (w, port) = start_with_health(&env, &["--dead-rate-crit", "5"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    for i in 0..8 {
        // Messages that are not JSON: the job's own fault, a dead letter each.
        xadd(
            &env,
            &env.config.keys.stream,
            format!("not json {i}").as_bytes(),
        );
    }
    wait_until(WAIT, "the dead letters", || books(&env).dead == 8);
    wait_until(WAIT, "/healthz red naming the rate", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("dead letters in the last minute")
    });
    wait_check_critical(&env, "dead letters in the last minute");
    // Green once the last minute holds no more than the threshold: about a minute after
    // the letters, not a minute after the watch last counted too many (two minutes).
    wait_until(
        Duration::from_secs(90),
        "/healthz green once the letters are over a minute old",
        || healthz(port).0 == 200,
    );
    stop(w);
}

/// `/healthz` answers within 3 s whatever the servers do: a Redis, then a PostgreSQL, then
/// both, that accept connections and never answer (stopped with SIGSTOP, as a frozen VM or
/// a network black hole would be) are each a 503 naming the server (both: each named),
/// answered within the 3 s a probe often allows. Found from outside: the two asked one after the other, each reply of a
/// connection's setup allowed 2 s, a stopped Redis was a 503 at 3 s, which a client with a
/// 3 s timeout never saw. `stats --check` says UNKNOWN within its 3 s while Redis is
/// stopped. Back, 200, and every job done once.
#[test]
fn healthz_answers_within_three_seconds_while_a_server_never_answers() {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 20);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Proc::start(&env.config, &["--metrics-addr".to_string(), addr]);
    let healthz = || -> std::io::Result<(u16, String)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        std::io::Write::write_all(
            &mut s,
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )?;
        let mut raw = String::new();
        std::io::Read::read_to_string(&mut s, &mut raw)?;
        let code = raw.split_whitespace().nth(1).and_then(|c| c.parse().ok());
        Ok((code.unwrap_or(0), raw))
    };
    wait_until(WAIT, "/healthz green", || {
        healthz().is_ok_and(|(code, _)| code == 200)
    });
    push_timeouts(&env, &orders[..10], 0);
    wait_until(WAIT, "the first jobs done", || inbox_count(&env.db) == 10);
    let (redis, postgres) = (env.redis.pid(), pg.postmaster_pid());
    // What the answer must name: the server that does not answer; both, when neither does.
    for (server, pids, said) in [
        ("Redis", vec![redis], vec!["Redis did not answer"]),
        (
            "PostgreSQL",
            vec![postgres],
            vec!["PostgreSQL did not answer"],
        ),
        ("both", vec![redis, postgres], vec!["Redis", "PostgreSQL"]),
    ] {
        // Resumed however this ends: a failed assertion left the servers stopped, and the
        // test's own clean-up could not stop them.
        struct Resume<'a>(&'a [i32]);
        impl Drop for Resume<'_> {
            fn drop(&mut self) {
                for &pid in self.0 {
                    unsafe { libc::kill(pid, libc::SIGCONT) };
                }
            }
        }
        let resume = Resume(&pids);
        for &pid in &pids {
            unsafe { libc::kill(pid, libc::SIGSTOP) };
        }
        for _ in 0..3 {
            match healthz() {
                Ok((code, raw)) => {
                    assert!(
                        code == 503 && said.iter().all(|w| raw.contains(w)),
                        "{server} stopped: {raw}"
                    )
                }
                Err(e) => panic!("{server} stopped: no answer within 3 s: {e}"),
            }
        }
        if pids.contains(&redis) {
            // The monitoring check too: UNKNOWN within its deadline (3 s), before a
            // monitoring system's own timeout; it took about 6 s, a reply of the
            // connection's setup timing out after another.
            let asked = std::time::Instant::now();
            let (code, line) = crate::shopdb::check(&env);
            assert!(
                code == 3 && line.starts_with("UNKNOWN - no answer from Redis"),
                "{server} stopped: {code} {line}"
            );
            assert!(
                asked.elapsed() < Duration::from_secs(5),
                "{:?}",
                asked.elapsed()
            );
        }
        drop(resume);
        wait_until(WAIT, "/healthz green again", || {
            healthz().is_ok_and(|(code, _)| code == 200)
        });
    }
    push_timeouts(&env, &orders[10..], 0);
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 20);
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}
