//! An operator's first week: `stats --check` sees a worker that is not running, `worker
//! stats` splits the pool by event, `worker dead requeue` refuses letters that would die
//! again and requeues under a corrected event.

use crate::support::*;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// `worker stats --check` with these flags: its exit code and its line.
fn check(env: &Env, flags: &[&str]) -> (i32, String) {
    let mut a = vec!["stats", "--check"];
    a.extend_from_slice(flags);
    let out = run_worker(&a, &env.config.redis_url, &env.config.database_url);
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout).trim().to_string(),
    )
}

fn metric(port: u16, name: &str) -> Option<f64> {
    let (_, _, body) = http_get(port, "/metrics").ok()?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn check_is_critical_with_no_live_worker_before_any_job_is_due() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 3);
    // Due in an hour: nothing is overdue, so only the workers can tell.
    push_timeouts(&env, &orders, 3_600_000);

    let (code, line) = check(&env, &[]);
    assert_eq!(code, 2, "{line}");
    assert!(
        line.starts_with("CRITICAL - no worker is running (no consumer of group"),
        "{line}"
    );
    assert!(line.contains(" workers=0;1:;1: "), "{line}");
    // Left out on request: the queue alone is fine.
    assert_eq!(check(&env, &["--expect-workers", "0"]).0, 0);

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut w = Proc::start(&env.config, &["--metrics-addr".into(), addr]);
    wait_until(WAIT, "stats --check OK with the worker", || {
        check(&env, &[]).0 == 0
    });
    let (_, line) = check(&env, &[]);
    assert!(line.contains("workers 1 live"), "{line}");
    assert!(line.contains(" workers=1;1:;1: "), "{line}");
    let (code, line) = check(&env, &["--expect-workers", "2"]);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("workers 1 live (warn < 2)"), "{line}");
    wait_until(WAIT, "/metrics to count the live worker", || {
        metric(port, "delay_worker_live_workers") == Some(1.0)
    });

    // kill -9: no goodbye, only the heartbeat expiring (--heartbeat-ttl 2s).
    w.kill9();
    wait_until(WAIT, "stats --check CRITICAL: no worker", || {
        let (code, line) = check(&env, &[]);
        code == 2 && line.starts_with("CRITICAL - no worker is running")
    });
    // Nothing was lost while it was down: the three jobs wait in the pool.
    assert_eq!(books(&env).pool, 3);
    assert_eq!(inbox_count(&env.db), 0);
}

#[test]
fn check_counts_list_mode_workers() {
    let env = Env::new();
    let list = ["--source", "list", "--queues", "q1"];
    let (code, line) = check(&env, &list);
    assert_eq!(code, 2, "{line}");
    assert!(
        line.starts_with(
            "CRITICAL - no worker is running (no list-mode worker has a live heartbeat"
        ),
        "{line}"
    );
    let args: Vec<String> = list.iter().map(|s| s.to_string()).collect();
    let _w = Proc::start(&env.config, &args);
    wait_until(WAIT, "stats --check OK with the list-mode worker", || {
        check(&env, &list).0 == 0
    });
    assert!(check(&env, &list).1.contains("workers 1 live"));
}

#[test]
fn stats_splits_the_pool_by_event_with_each_next_due() {
    let env = Env::new();
    let (r, d) = (&env.config.redis_url, &env.config.database_url);
    for (event, payload, delay, key) in [
        (
            "order.timeout",
            r#"{"order_no":"SO1"}"#,
            "10m",
            "order.timeout:SO1",
        ),
        (
            "order.timeout",
            r#"{"order_no":"SO2"}"#,
            "20m",
            "order.timeout:SO2",
        ),
        (
            "coupon.expire",
            r#"{"coupon_id":7}"#,
            "2h",
            "coupon.expire:7",
        ),
    ] {
        let out = run_worker(
            &[
                "push",
                "--event",
                event,
                "--payload",
                payload,
                "--delay",
                delay,
                "--key",
                key,
            ],
            r,
            d,
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    // A member without data (a producer that wrote only the ZADD).
    let mut con = env.con();
    let keys = &env.config.keys;
    let _: () = redis::cmd("ZADD")
        .arg(&keys.pool)
        .arg(delay_worker::now_ms() + 7_200_000 * 2)
        .arg("orphan")
        .query(&mut con)
        .unwrap();

    let out = run_worker(&["stats"], r, d);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t = text(&out.stdout);
    let lines: Vec<&str> = t.lines().collect();
    let head = lines
        .iter()
        .position(|l| l.starts_with("event ") && l.contains("scheduled") && l.contains("next due"))
        .unwrap_or_else(|| panic!("a by-event table:\n{t}"));
    assert!(!lines[head].contains("the pool holds more"), "{t}");
    assert!(lines[head + 1].starts_with("order.timeout"), "{t}");
    assert!(
        lines[head + 1].contains("(in 9 min") || lines[head + 1].contains("(in 10 min"),
        "{t}"
    );
    assert!(lines[head + 2].starts_with("coupon.expire"), "{t}");
    assert!(lines[head + 3].starts_with("(no data)"), "{t}");

    let out = run_worker(&["stats", "--json"], r, d);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b = &j["by_event"];
    assert_eq!(b["complete"], true);
    assert_eq!(b["sampled"], 4);
    assert_eq!(b["events"][0]["event"], "order.timeout");
    assert_eq!(b["events"][0]["scheduled"], 2);
    assert_eq!(b["events"][0]["due"], 0);
    assert_eq!(b["events"][1]["event"], "coupon.expire");

    // More than the sample: said, and the read stays bounded.
    let mut p = redis::pipe();
    let now = delay_worker::now_ms();
    for i in 0..1200 {
        p.cmd("HSET")
            .arg(&keys.data)
            .arg(format!("bulk{i}"))
            .arg(r#"{"event":"order.timeout","payload":{"order_no":"X"}}"#)
            .ignore();
        p.cmd("ZADD")
            .arg(&keys.pool)
            .arg(now + 3_600_000 + i)
            .arg(format!("bulk{i}"))
            .ignore();
    }
    let _: () = p.query(&mut con).unwrap();
    let out = run_worker(&["stats", "--json"], r, d);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["by_event"]["complete"], false);
    assert_eq!(j["by_event"]["sampled"], 1000);
    let t = text(&run_worker(&["stats"], r, d).stdout);
    assert!(
        t.contains("(of the 1000 due soonest; the pool holds more)"),
        "{t}"
    );
}

/// `worker dead requeue` with the daemon's environment; (exit code, stdout).
fn requeue(env: &Env, flags: &[&str]) -> (i32, String) {
    let mut a = vec!["dead", "requeue"];
    a.extend_from_slice(flags);
    let out = run_worker(&a, &env.config.redis_url, &env.config.database_url);
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    (out.status.code().unwrap_or(-1), text(&out.stdout))
}

#[test]
fn a_requeue_that_would_die_again_is_refused_and_a_typo_goes_back_under_its_event() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 2);
    let (r, d) = (&env.config.redis_url, &env.config.database_url);
    let _w = Proc::start(&env.config, &[]);
    // A producer's typo in the event, a payload without the field its handler needs, and a
    // message that is not JSON: three letters of their own fault.
    let typo = format!(r#"{{"order_no":"{}"}}"#, orders[0].order_no);
    for (event, payload, key) in [
        ("order.timout", typo.as_str(), "order.timeout:typo"),
        ("order.timeout", r#"{"nothing":1}"#, "order.timeout:nofield"),
    ] {
        let out = run_worker(
            &[
                "push",
                "--unchecked",
                "--event",
                event,
                "--payload",
                payload,
                "--delay",
                "0s",
                "--key",
                key,
            ],
            r,
            d,
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let mut con = env.con();
    let keys = &env.config.keys;
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(&keys.data)
        .arg("raw")
        .arg("not json")
        .ignore()
        .cmd("ZADD")
        .arg(&keys.pool)
        .arg(delay_worker::now_ms())
        .arg("raw")
        .ignore()
        .query(&mut con)
        .unwrap();
    wait_until(WAIT, "three dead letters", || dead_letters(&env).len() == 3);

    // All of them: each refused, named with why; nothing moves; exit 1.
    let (code, out) = requeue(&env, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.starts_with("requeued 0\n"), "{out}");
    assert_eq!(out.matches("refused ").count(), 3, "{out}");
    assert!(
        out.contains("no handler for event \"order.timout\""),
        "{out}"
    );
    assert!(out.contains("order.timeout: "), "{out}");
    assert!(out.contains("not a whole message"), "{out}");
    assert!(out.contains("(--force requeues it anyway)"), "{out}");
    assert_eq!(dead_letters(&env).len(), 3);
    assert_eq!(books(&env).pool, 0);

    // The typo under its corrected event: back once, the order cancelled once.
    let (code, out) = requeue(
        &env,
        &["--event", "order.timout", "--as-event", "order.timeout"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("requeued 1\n"), "{out}");
    wait_until(WAIT, "the corrected job done", || inbox_count(&env.db) == 1);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
    // Again: nothing left of that event, nothing goes back twice.
    let (code, out) = requeue(
        &env,
        &["--event", "order.timout", "--as-event", "order.timeout"],
    );
    assert_eq!((code, out.as_str()), (0, "requeued 0\n"));
    // A corrected name that has no handler either is refused too.
    let (code, out) = requeue(
        &env,
        &["--event", "order.timeout", "--as-event", "order.timeot"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("no handler for event \"order.timeot\""),
        "{out}"
    );
    assert_eq!(dead_letters(&env).len(), 2);

    // --force: the one without its field goes back and dies again, as asked.
    let (code, out) = requeue(&env, &["--event", "order.timeout", "--force"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("requeued 1\n"), "{out}");
    wait_until(WAIT, "the forced letter dead again", || {
        let b = books(&env);
        b.pool == 0 && b.stream_pending == 0 && dead_letters(&env).len() == 2
    });
    assert_eq!(inbox_count(&env.db), 1);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

#[test]
fn a_check_that_cannot_read_its_url_is_unknown_on_its_line() {
    // A password with `/` and `@` not percent-encoded: the URL does not parse.
    let out = run_worker(
        &["stats", "--check"],
        "redis://:s3cr@t/x@127.0.0.1:1/",
        "postgres://unused",
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let line = text(&out.stdout);
    assert!(line.starts_with("UNKNOWN - "), "{line}");
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(
        !line.contains("s3cr"),
        "the password is never shown: {line}"
    );
    // Without --check, the usual bad-input line and exit 2.
    let out = run_worker(
        &["stats"],
        "redis://:s3cr@t/x@127.0.0.1:1/",
        "postgres://unused",
    );
    assert_eq!(out.status.code(), Some(2));
}
