//! SIGHUP reloads the `--handlers-dir` files without a restart: an edited handler takes
//! over at the workers' next batch, a file that does not parse keeps the old set, an edit
//! that does not prepare keeps the old version of its handler, and a new handler whose
//! table is not there yet holds its jobs (health names its file) until the table comes.

use crate::support::*;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn loyalty(points: i32) -> String {
    format!(
        "-- event: loyalty.points\n-- requires: user_id\n\
         INSERT INTO loyalty (user_id, points) VALUES (($1 ->> 'user_id')::bigint, {points})"
    )
}

/// Pushes `n` jobs of `event` for users `from..from + n`, due now.
fn push_users(env: &Env, event: &str, from: i64, n: i64) {
    let now = delay_worker::now_ms();
    let mut con = env.con();
    for u in from..from + n {
        let job = delay_worker::producer::NewJob {
            event: event.into(),
            payload: serde_json::json!({ "user_id": u }),
            due_ms: now,
            key: Some(format!("{event}:{u}")),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
}

/// Rows of `table` with these points.
fn rows(env: &Env, table: &str, points: i32) -> i64 {
    env.db
        .client()
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE points = $1"),
            &[&points],
        )
        .unwrap()
        .get(0)
}

fn healthz(port: u16) -> (u16, String) {
    match http_get(port, "/healthz") {
        Ok((code, _, body)) => (code, body),
        Err(e) => (0, e.to_string()),
    }
}

#[test]
fn sighup_reloads_the_handlers_and_a_broken_file_keeps_what_worked() {
    let env = Env::new();
    env.db
        .client()
        .batch_execute("CREATE TABLE loyalty (user_id bigint, points int)")
        .unwrap();
    let dir = HandlerDir::new(&[("loyalty.sql", loyalty(10))]);
    let port = free_port();
    let mut w = Proc::start_logging(
        &env.config,
        &[
            "--handlers-dir".to_string(),
            dir.0.display().to_string(),
            "--metrics-addr".to_string(),
            format!("127.0.0.1:{port}"),
        ],
        "info",
    );
    let done = |n: i64| {
        wait_until(WAIT, &format!("{n} jobs done"), || {
            let b = books(&env);
            inbox_count(&env.db) == n && b.pool == 0 && b.stream_pending == 0
        })
    };
    push_users(&env, "loyalty.points", 0, 5);
    done(5);
    assert_eq!(rows(&env, "loyalty", 10), 5);

    // An edited handler takes over without a restart.
    std::fs::write(dir.0.join("loyalty.sql"), loyalty(20)).unwrap();
    w.signal(libc::SIGHUP);
    wait_until(WAIT, "the reload logged", || {
        w.log().contains("SIGHUP: handlers reloaded")
    });
    push_users(&env, "loyalty.points", 100, 5);
    done(10);
    assert_eq!(rows(&env, "loyalty", 20), 5);

    // A file that does not parse: everything stays as it was.
    std::fs::write(dir.0.join("broken.sql"), "-- event: x\nSELECT 1\n-- set:\n").unwrap();
    w.signal(libc::SIGHUP);
    wait_until(WAIT, "the refusal logged", || {
        w.log().contains("the handlers stay as they were")
    });
    // ... and the operator is told, since the next start would stop at the file.
    let check = || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        (out.status.code(), text(&out.stdout))
    };
    wait_until(WAIT, "stats --check warning of the folder", || {
        let (code, line) = check();
        code == Some(1) && line.contains("handlers folder") && line.contains("broken.sql")
    });
    std::fs::remove_file(dir.0.join("broken.sql")).unwrap();

    // An edit that does not prepare keeps the working version of its handler; a new
    // handler whose table is missing is taken, its jobs held, health naming its file.
    std::fs::write(
        dir.0.join("loyalty.sql"),
        "-- event: loyalty.points\nINSERT INTO loyalty (user_id, pointz) VALUES (1, 2)",
    )
    .unwrap();
    std::fs::write(
        dir.0.join("badge.sql"),
        "-- event: badge.award\n-- requires: user_id\n\
         INSERT INTO badge (user_id, points) VALUES (($1 ->> 'user_id')::bigint, 1)",
    )
    .unwrap();
    w.signal(libc::SIGHUP);
    wait_until(WAIT, "the reload logged twice", || {
        w.log().matches("SIGHUP: handlers reloaded").count() == 2
    });
    assert!(
        w.log()
            .contains("the handler of \"loyalty.points\" stays as it was"),
        "{}",
        w.log()
    );
    push_users(&env, "loyalty.points", 200, 5);
    push_users(&env, "badge.award", 0, 4);
    // The loyalty jobs run; the badge jobs wait in the pool.
    wait_until(WAIT, "the loyalty jobs", || inbox_count(&env.db) == 15);
    assert_eq!(rows(&env, "loyalty", 20), 10, "the working version ran");
    wait_until(WAIT, "/healthz naming the new file", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("badge.sql") && body.contains("42P01")
    });
    assert_eq!(books(&env).dead, 0, "held, not dead-lettered");
    env.db
        .client()
        .batch_execute("CREATE TABLE badge (user_id bigint, points int)")
        .unwrap();
    done(19);
    assert_eq!(rows(&env, "badge", 1), 4);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    assert!(
        !check().1.contains("handlers folder"),
        "the folder loads again: {:?}",
        check()
    );

    // Three reloads later, the daemon still runs and stops as always.
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
    assert_eq!(books(&env).dead, 0);
}
