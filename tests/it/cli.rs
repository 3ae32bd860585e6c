//! The binary: push and cancel from the shell, and one readable line for every bad flag or
//! unreachable server (no panic, no backtrace, no password).

use crate::support::*;
use std::process::Output;

fn worker(args: &[&str], redis: &str, db: &str) -> Output {
    run_worker(args, redis, db)
}

#[test]
fn push_and_cancel_from_the_command_line() {
    let r = RedisServer::start();
    let url = r.url();
    let out = worker(
        &[
            "push",
            "--event",
            "order.timeout",
            "--payload",
            r#"{"order_no":"SO9"}"#,
            "--delay",
            "900",
            "--key",
            "order.timeout:SO9",
        ],
        &url,
        "postgres://unused",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("scheduled order.timeout:SO9"));
    let out = worker(
        &[
            "push",
            "--event",
            "order.timeout",
            "--payload",
            r#"{"order_no":"SO9"}"#,
            "--delay",
            "60",
            "--key",
            "order.timeout:SO9",
        ],
        &url,
        "postgres://unused",
    );
    assert!(text(&out.stdout).starts_with("rescheduled order.timeout:SO9"));
    let out = worker(
        &["cancel", "--key", "order.timeout:SO9"],
        &url,
        "postgres://unused",
    );
    assert_eq!(out.status.code(), Some(0));
    let out = worker(
        &["cancel", "--key", "order.timeout:SO9"],
        &url,
        "postgres://unused",
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "cancel says the job was not there"
    );
    assert_eq!(
        text(&out.stdout).trim(),
        "no scheduled job order.timeout:SO9"
    );
}

fn assert_one_line(out: &Output, code: i32, needle: &str) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line, got: {err}");
    assert!(err.contains(needle), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
}

#[test]
fn bad_flags_and_unreachable_servers_give_one_readable_line() {
    let dead_port = free_port();
    let redis_down = format!("redis://:hunter2@127.0.0.1:{dead_port}/");
    let db_down = format!("postgres://shop:hunter2@127.0.0.1:{dead_port}/shop");

    let out = worker(&["--threads", "0"], &redis_down, &db_down);
    assert_one_line(&out, 2, "--threads");
    let out = worker(&["--poll-interval", "soon"], &redis_down, &db_down);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--poll-interval"));
    let out = worker(
        &["push", "--event", "e", "--payload", "{nope", "--delay", "1"],
        &redis_down,
        &db_down,
    );
    assert_one_line(&out, 1, "--payload");

    let out = worker(&["--threads", "2"], &redis_down, &db_down);
    assert_one_line(&out, 1, "cannot reach Redis");
    assert!(!text(&out.stderr).contains("hunter2"), "password printed");

    let r = RedisServer::start();
    let out = worker(&["--threads", "2"], &r.url(), &db_down);
    assert_one_line(&out, 1, "cannot reach PostgreSQL");
    assert!(!text(&out.stderr).contains("hunter2"), "password printed");

    let out = worker(&["migrate"], &r.url(), &db_down);
    assert_one_line(&out, 1, "cannot reach PostgreSQL");

    let out = worker(&["--threads", "2"], "not a url", &db_down);
    assert_one_line(&out, 1, "REDIS_URL");
}

#[test]
fn an_unmigrated_database_is_refused_with_the_fix() {
    let r = RedisServer::start();
    let db = TestDb::empty();
    let out = worker(&["--threads", "1"], &r.url(), &db.url);
    assert_one_line(&out, 1, "run `worker migrate`");
}
