//! Set-based execution: jobs of one event already waiting together run through the
//! handler's set form, one statement per table; each job keeps its own outcome, a set that
//! fails is run again job by job, and concurrent sets never deadlock each other.

use crate::support::*;
use delay_worker::producer::{push, NewJob};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn push_one(env: &Env, event: &str, payload: serde_json::Value, key: String) {
    let now = delay_worker::now_ms();
    let job = NewJob {
        event: event.into(),
        payload,
        due_ms: now,
        key: Some(key),
    };
    push(&mut env.con(), &env.config.keys, &job, now).unwrap();
}

#[test]
fn a_backlog_runs_in_sets_and_every_job_keeps_its_own_outcome() {
    let mut env = Env::new();
    env.config.threads = 4;
    // Every set locks most of the 5 skus, so sets of 4 workers queue for them; on a
    // loaded machine a wait may pass the default 5 s lock timeout, and a job that retries
    // is not what this test is about.
    env.config.jobs.statement_timeout = Duration::from_secs(30);
    let orders = seed_orders(&env.db, 400);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&env.db, &paid);
    // A backlog: everything is due before the worker starts, so sets form at once.
    push_timeouts(&env, &orders, 0);
    // The same orders again by id under other keys (no second effect), an order that does
    // not exist (no-op), and a payload the set statement cannot cast: that set fails, runs
    // again job by job, and only the bad job is dead-lettered.
    for o in orders.iter().take(40) {
        push_one(
            &env,
            "order.timeout",
            serde_json::json!({ "order_id": o.id }),
            format!("again:{}", o.order_no),
        );
    }
    push_one(
        &env,
        "order.timeout",
        serde_json::json!({ "order_no": "SO-NOT-THERE" }),
        "order.timeout:missing".into(),
    );
    push_one(
        &env,
        "order.timeout",
        serde_json::json!({ "order_id": "12abc" }),
        "order.timeout:bad".into(),
    );
    let pushed = 400 + 40 + 2;
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job settled", || {
        let b = books(&env);
        inbox_count(&env.db) as usize + b.dead == pushed as usize
            && b.pool == 0
            && b.stream_pending == 0
    });
    let report = daemon.stop();
    let s = report.stats;
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_eq!(s.done, cancelled.len() as u64, "{s}");
    assert_eq!(s.noop, pushed as u64 - 1 - cancelled.len() as u64, "{s}");
    assert_eq!(s.dead, 1, "{s}");
    // Sets lock orders, skus and coupons each in id order: 4 workers over 5 shared skus
    // never deadlock, so nothing needed a retry.
    assert_eq!(s.retried, 0, "{s}");
    assert!(s.in_sets >= 100, "the backlog ran in sets: {s}");
    let letters = dead_letters(&env);
    assert!(
        letters[0]["reason"].contains("invalid input syntax"),
        "{letters:?}"
    );
    assert_all_accounted(&env, &env.db, pushed as usize);
}

/// Whether the group has read every entry of the stream.
fn all_read(env: &Env) -> bool {
    let k = &env.config.keys;
    let mut con = env.con();
    let last: String = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(&k.stream)
        .query::<std::collections::HashMap<String, redis::Value>>(&mut con)
        .ok()
        .and_then(|m| redis::from_redis_value(m.get("last-generated-id")?.clone()).ok())
        .unwrap_or_default();
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&k.stream)
        .query(&mut con)
        .unwrap_or_default();
    groups.iter().any(|g| {
        g.get("last-delivered-id")
            .and_then(|v| redis::from_redis_value::<String>(v.clone()).ok())
            == Some(last.clone())
    })
}

#[test]
fn a_redelivered_set_changes_nothing_the_second_time() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 20);
    let msgs: Vec<String> = orders
        .iter()
        .map(|o| {
            format!(
                r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}},"retry":0,"ts":1768764300,"job_id":"1768764300000000-{}"}}"#,
                o.order_no, o.id
            )
        })
        .collect();
    // Each job twice in a row in the stream: a set holding both copies acts once.
    for (o, m) in orders.iter().zip(&msgs) {
        xadd(&env, &format!("order.timeout:{}", o.order_no), m.as_bytes());
        xadd(&env, &format!("order.timeout:{}", o.order_no), m.as_bytes());
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "both copies of each", || {
        inbox_count(&env.db) == 20 && books(&env).stream_pending == 0
    });
    let first = daemon.stop();
    // And all of them once more, after they committed: every one a duplicate.
    for (o, m) in orders.iter().zip(&msgs) {
        xadd(&env, &format!("order.timeout:{}", o.order_no), m.as_bytes());
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the redeliveries", || {
        all_read(&env) && books(&env).stream_pending == 0
    });
    let second = daemon.stop();
    assert_eq!(
        (first.stats.done, first.stats.duplicate),
        (20, 20),
        "{}",
        first.stats
    );
    assert_eq!(
        (second.stats.done, second.stats.duplicate),
        (0, 20),
        "{}",
        second.stats
    );
    assert!(first.stats.in_sets > 0, "{}", first.stats);
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}

#[test]
fn failing_sets_are_split_and_each_job_retries_on_its_own() {
    let mut env = Env::new();
    // Deadlocks in four runs of five, sets and single jobs alike: a set that meets one at
    // each of its tries is split in halves (down to single jobs), and a single job that
    // meets one retries. (In every other run, a set got through at its second try.)
    let _dir = failing_order_timeout(&mut env, 0.8, "40P01", order_timeout_set_with);
    let orders = seed_orders(&env.db, 600);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        let b = books(&env);
        inbox_count(&env.db) == 600 && b.pool == 0 && b.stream_pending == 0
    });
    let report = daemon.stop();
    let s = report.stats;
    assert!(s.retried > 0, "jobs retried alone: {s}");
    assert!(s.in_sets > 0, "sets committed too: {s}");
    assert_eq!((s.done, s.dead), (600, 0), "{s}");
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_all_accounted(&env, &env.db, 600);
}

#[test]
fn aftersale_and_coupon_sets_act_once_each() {
    let env = Env::new();
    let mut c = env.db.client();
    c.batch_execute(
        "INSERT INTO orders (id, order_no, status) VALUES (900001, 'AS-ORDER', 'paid');
         INSERT INTO aftersale (id, order_id, status, deadline_at)
         SELECT g, 900001, CASE WHEN g % 4 = 0 THEN 'rejected' ELSE 'pending' END,
                CASE WHEN g % 7 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 minute' END
           FROM generate_series(1, 100) g;
         INSERT INTO coupon_user (id, user_id, status, expire_at)
         SELECT 800000 + g, g, CASE WHEN g % 3 = 0 THEN 'used' ELSE 'unused' END,
                CASE WHEN g % 11 = 0 THEN now() + interval '1 day' ELSE now() - interval '1 minute' END
           FROM generate_series(1, 100) g;",
    )
    .unwrap();
    for id in 1..=100i64 {
        push_one(
            &env,
            "aftersale.timeout",
            serde_json::json!({ "aftersale_id": id }),
            format!("aftersale.timeout:{id}"),
        );
        push_one(
            &env,
            "coupon.expire",
            serde_json::json!({ "coupon_id": 800000 + id }),
            format!("coupon.expire:{id}"),
        );
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        let b = books(&env);
        inbox_count(&env.db) == 200 && b.pool == 0 && b.stream_pending == 0
    });
    let report = daemon.stop();
    let approved = (1..=100).filter(|g| g % 4 != 0 && g % 7 != 0).count() as i64;
    let expired = (1..=100).filter(|g| g % 3 != 0 && g % 11 != 0).count() as i64;
    let mut count = |sql: &str| -> i64 { c.query_one(sql, &[]).unwrap().get(0) };
    assert_eq!(
        count("SELECT count(*) FROM aftersale WHERE status = 'approved'"),
        approved
    );
    assert_eq!(
        count("SELECT count(*) FROM aftersale WHERE status = 'pending'"),
        (1..=100).filter(|g| g % 4 != 0 && g % 7 == 0).count() as i64
    );
    assert_eq!(
        count("SELECT count(*) FROM coupon_user WHERE status = 'expired'"),
        expired
    );
    let s = report.stats;
    assert_eq!(s.done, (approved + expired) as u64, "{s}");
    assert_eq!(s.noop, 200 - (approved + expired) as u64, "{s}");
    assert!(s.in_sets > 0, "{s}");
}

#[test]
fn set_size_1_runs_every_job_alone() {
    let mut env = Env::new();
    env.config.jobs.set_size = 1;
    let orders = seed_orders(&env.db, 50);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 50 && books(&env).stream_pending == 0
    });
    let s = daemon.stop().stats;
    assert_eq!((s.done, s.in_sets), (50, 0), "{s}");
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}

fn coupon_handler(set_returning: &str) -> String {
    format!(
        "-- event: coupon.expire
-- requires: coupon_id
UPDATE coupon_user SET status = 'expired' WHERE id = ($1 ->> 'coupon_id')::bigint AND status = 'unused'
-- set:
WITH jobs AS (SELECT (j ->> 'i')::integer AS i, j -> 'payload' AS p FROM jsonb_array_elements($1) j)
UPDATE coupon_user u SET status = 'expired' FROM jobs
 WHERE u.id = (jobs.p ->> 'coupon_id')::bigint AND u.status = 'unused'
RETURNING {set_returning}
"
    )
}

fn coupons(env: &Env, n: i64) {
    env.db
        .client()
        .batch_execute(&format!(
            "INSERT INTO coupon_user (id, user_id, status) SELECT 700000 + g, g, 'unused' FROM generate_series(1, {n}) g"
        ))
        .unwrap();
    for id in 1..=n {
        push_one(
            env,
            "coupon.expire",
            serde_json::json!({ "coupon_id": 700000 + id }),
            format!("coupon.expire:{id}"),
        );
    }
}

#[test]
fn a_set_form_that_breaks_its_contract_is_named_at_start_and_its_jobs_run_job_by_job() {
    // Its first column is not the index: the start names the reason, and the jobs run
    // alone through the one-job form (a broken set form takes no event down).
    let mut env = Env::new();
    let text_index = HandlerDir::new(&[("c.sql", coupon_handler("jobs.i::text"))]);
    coupons(&env, 40);
    let dir = text_index.0.display().to_string();
    env.config.threads = 1;
    let mut w = Proc::start(&env.config, &["--handlers-dir".to_string(), dir]);
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 40 && books(&env).stream_pending == 0 && books(&env).pool == 0
    });
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success());
    assert!(
        w.log().contains("must return the job's index first"),
        "{}",
        w.log()
    );
    assert_eq!(books(&env).dead, 0);

    // An index the set was not given: every set fails and its jobs run alone, each with
    // the right outcome.
    let mut env = Env::new();
    let out_of_range = HandlerDir::new(&[("c.sql", coupon_handler("jobs.i + 1000"))]);
    env.config.handlers_dir = Some(out_of_range.0.clone());
    coupons(&env, 60);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 60 && books(&env).stream_pending == 0 && books(&env).pool == 0
    });
    let s = daemon.stop().stats;
    assert_eq!((s.done, s.noop, s.in_sets), (60, 0, 0), "{s}");
}

#[test]
fn set_size_1_turns_sets_off_whatever_tx_batch() {
    let mut env = Env::new();
    env.config.jobs.set_size = 1;
    env.config.jobs.tx_batch = 8;
    coupons(&env, 40);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 40 && books(&env).stream_pending == 0 && books(&env).pool == 0
    });
    let s = daemon.stop().stats;
    assert_eq!((s.done, s.in_sets), (40, 0), "{s}");
}

#[test]
fn a_payload_naming_two_orders_cancels_one_alone_or_in_a_set() {
    for set_size in [1, 32] {
        let mut env = Env::new();
        env.config.jobs.set_size = set_size;
        let orders = seed_orders(&env.db, 30);
        // 29 ordinary jobs, so a set forms, and one naming order 0 by id and order 1 by no.
        push_timeouts(&env, &orders[2..], 0);
        push_one(
            &env,
            "order.timeout",
            serde_json::json!({ "order_id": orders[0].id, "order_no": orders[1].order_no }),
            "both".into(),
        );
        let daemon = Daemon::start(&env.config);
        wait_until(WAIT, "every job", || {
            inbox_count(&env.db) == 29 && books(&env).stream_pending == 0
        });
        daemon.stop();
        let cancelled: Vec<&SeedOrder> = orders.iter().filter(|o| o.id != orders[1].id).collect();
        assert_accounting(&env.db, &orders, &cancelled);
    }
}

#[test]
fn jobs_of_a_handler_without_a_set_form_that_come_together_run_side_by_side() {
    // Twelve slow jobs (0.5 s each) of a handler without a set form fall due together and
    // come in one read. The worker that takes them keeps one and gives the rest back, so
    // the four workers run them side by side: before, one worker ran all twelve, one after
    // another, while the other three idled (and no ack went out until the last).
    let mut env = Env::new();
    let dir = slow_order_timeout("0.5");
    env.config.handlers_dir = Some(dir.0.clone());
    env.config.threads = 4;
    env.config.jobs.statement_timeout = Duration::from_secs(10);
    let orders = seed_orders(&env.db, 12);
    let daemon = Daemon::start(&env.config);
    // Four idle workers: their sessions and the PostgreSQL watch's connection open (on a
    // busy machine a worker still connecting takes no job, and the others run them all).
    wait_until(WAIT, "every worker's session", || {
        worker_backends(&env.db) >= 5
    });
    push_timeouts(&env, &orders, 0);
    let mut most = 0;
    wait_until(WAIT, "every job", || {
        most = most.max(sleeping(&env.db));
        let b = books(&env);
        inbox_count(&env.db) == 12 && b.pool == 0 && b.stream_pending == 0
    });
    daemon.stop();
    assert!(
        most >= 3,
        "at most {most} of the jobs ran at once on 4 workers"
    );
    let cancelled: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_all_accounted(&env, &env.db, 12);
}
