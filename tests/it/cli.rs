//! The binary: push and cancel from the shell, and one readable line for every bad flag or
//! unreachable server (no panic, no backtrace, no password).

use crate::support::*;
use std::process::Output;
use std::time::Duration;

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
    assert_eq!(
        text(&out.stdout).trim(),
        "scheduled order.timeout:SO9 due in 15 min"
    );
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
    assert_eq!(
        text(&out.stdout).trim(),
        "rescheduled order.timeout:SO9 due in 1 min"
    );
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
    // A bound under four batches left the readers idle between the mover's looks.
    let out = worker(&["--move-ahead", "100"], &redis_down, &db_down);
    assert_one_line(&out, 2, "--move-ahead");
    assert!(
        text(&out.stderr).contains("(2000)"),
        "{}",
        text(&out.stderr)
    );
    let out = worker(&["--poll-interval", "soon"], &redis_down, &db_down);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--poll-interval"));
    let out = worker(
        &["push", "--event", "e", "--payload", "{nope", "--delay", "1"],
        &redis_down,
        &db_down,
    );
    assert_one_line(&out, 2, "--payload");

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
    assert_one_line(&out, 2, "REDIS_URL");
}

/// A `--max-rate` that caps one thing twice (the last one won, silently) or names an
/// event no handler serves (a typo ran that event uncapped): one line, exit 2.
#[test]
fn a_max_rate_given_twice_or_for_no_handler_s_event_is_refused() {
    let dead_port = free_port();
    let redis_down = format!("redis://127.0.0.1:{dead_port}/");
    let db_down = format!("postgres://shop@127.0.0.1:{dead_port}/shop");
    let out = worker(&["--max-rate", "2/s,3/s"], &redis_down, &db_down);
    assert_one_line(&out, 2, "--max-rate: the cap on every job given twice");
    let out = worker(
        &[
            "--max-rate",
            "order.timeout=2/s",
            "--max-rate",
            "order.timeout=1/s",
        ],
        &redis_down,
        &db_down,
    );
    assert_one_line(&out, 2, "--max-rate: a cap on order.timeout given twice");
    let r = RedisServer::start();
    let db = TestDb::new();
    assert_eq!(
        worker(&["migrate"], &r.url(), &db.url).status.code(),
        Some(0)
    );
    let out = worker(&["--max-rate", "order.timout=1/s"], &r.url(), &db.url);
    assert_one_line(&out, 2, "no handler serves \"order.timout\" (handlers: ");
    assert!(
        text(&out.stderr).contains("order.timeout"),
        "{}",
        text(&out.stderr)
    );
}

/// The README's exit-code table, row by row (the second signal's 130 is
/// `consumer::a_second_signal_exits_at_once_and_the_next_start_recovers`, `stats --check`'s
/// codes are in admin.rs, `handlers check`'s in handlers_check.rs).
#[test]
fn every_row_of_the_exit_code_table() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let (url, dburl) = (r.url(), db.url.clone());
    let dead_port = free_port();
    let redis_down = format!("redis://127.0.0.1:{dead_port}/");
    let push = |extra: &[&str]| {
        let mut a = vec!["push", "--event", "order.timeout", "--delay", "15m"];
        a.extend_from_slice(extra);
        worker(&a, &url, &dburl)
    };
    let delayed = |delay: &str| {
        worker(
            &[
                "push",
                "--event",
                "order.timeout",
                "--payload",
                r#"{"order_no":"SO1"}"#,
                "--delay",
                delay,
            ],
            &url,
            &dburl,
        )
    };
    // 0: done.
    let out = push(&["--payload", r#"{"order_no":"SO1"}"#, "--key", "k1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        worker(&["cancel", "--key", "k1"], &url, &dburl)
            .status
            .code(),
        Some(0)
    );
    assert_eq!(worker(&["migrate"], &url, &dburl).status.code(), Some(0));
    // `migrate` needs no Redis, so no one-slot check of a Cluster's key names either.
    let cluster_down = format!("redis+cluster://127.0.0.1:{dead_port}");
    assert_eq!(
        worker(&["migrate"], &cluster_down, &dburl).status.code(),
        Some(0)
    );
    // 1: a runtime failure.
    let out = worker(&["cancel", "--key", "k1"], &url, &dburl);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout).trim(), "no scheduled job k1");
    assert_one_line(
        &worker(&["stats"], &redis_down, &dburl),
        1,
        "Connection refused",
    );
    let unmigrated = TestDb::empty();
    assert_one_line(
        &worker(&["--threads", "1"], &url, &unmigrated.url),
        1,
        "worker migrate",
    );
    // 2: bad input, one line naming what is wrong.
    let rows: Vec<(Output, &str)> = vec![
        (worker(&["--no-such-flag"], &url, &dburl), "--no-such-flag"),
        (
            worker(&["push", "--threads", "4"], &url, &dburl),
            "--threads",
        ),
        (
            worker(&["dead", "list", "--tx-batch", "9"], &url, &dburl),
            "--tx-batch",
        ),
        (
            worker(&["--threads", "4", "stats"], &url, &dburl),
            "--threads",
        ),
        (worker(&["--block", "soon"], &url, &dburl), "--block"),
        (worker(&["--threads", "-1"], &url, &dburl), "--threads"),
        (
            worker(&["--database-url", "", "migrate"], &url, &dburl),
            "--database-url: names no host",
        ),
        (
            worker(&["--redis-url", "notaurl", "stats"], &url, &dburl),
            "--redis-url",
        ),
        (worker(&["stats"], "notaurl", &dburl), "REDIS_URL"),
        (
            worker(
                &[
                    "--database-url",
                    "postgres://u@127.0.0.1:notaport/db",
                    "migrate",
                ],
                &url,
                &dburl,
            ),
            "--database-url",
        ),
        (push(&["--payload", "not json"]), "--payload"),
        (
            push(&["--payload", r#"{"order_no":"SO1"}"#, "--key", ""]),
            "job key must not be empty",
        ),
        (push(&["--payload", "[1]"]), "--payload"),
        (
            push(&["--payload", r#"{"user":1}"#]),
            "missing order_id or order_no",
        ),
        (
            worker(
                &[
                    "push",
                    "--event",
                    "no.such.event",
                    "--payload",
                    "{}",
                    "--delay",
                    "1",
                ],
                &url,
                &dburl,
            ),
            "no handler for \"no.such.event\"",
        ),
        (
            delayed("5 parsecs"),
            "invalid value '5 parsecs' for '--delay",
        ),
        // `M` is months to humantime: a typo for minutes is refused, not a year away.
        (delayed("15M"), "units are ms, s, m (minutes), h and d"),
        (worker(&["--shards", "0", "stats"], &url, &dburl), "--shards"),
        (
            worker(&["stats", "--shards", "2", "--pool-key", "p"], &url, &dburl),
            "--shards: names every key itself",
        ),
        (
            worker(&["stats", "--shards", "2", "--key-prefix", "{mq}"], &url, &dburl),
            "--shards: puts a hash tag in every name itself",
        ),
        (
            worker(
                &["--shards", "2", "--source", "list", "--queues", "q"],
                &url,
                &dburl,
            ),
            "--shards: works in stream mode only",
        ),
        // A Cluster needs one slot per script, checked before anything is connected.
        (
            worker(
                &["stats"],
                &format!("redis+cluster://127.0.0.1:{dead_port},127.0.0.1:{dead_port}"),
                &dburl,
            ),
            "--key-prefix: on a Redis Cluster the keys a script uses together must share one hash slot",
        ),
        (
            worker(
                &["--key-prefix", "{mq}", "--legacy-pool", "delay:order_close=order.timeout"],
                &format!("redis+cluster://127.0.0.1:{dead_port}"),
                &dburl,
            ),
            "\"delay:order_close\" in slot",
        ),
        (
            worker(&["stats"], &format!("redis+sentinel://127.0.0.1:{dead_port}"), &dburl),
            "names no master",
        ),
    ];
    for (out, needle) in &rows {
        assert_one_line(out, 2, needle);
    }
    // --unchecked pushes what a handler may exist for later.
    let out = worker(
        &[
            "push",
            "--event",
            "no.such.event",
            "--payload",
            "{}",
            "--delay",
            "1",
            "--unchecked",
        ],
        &url,
        &dburl,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // The shard count is recorded by the first push; another count is refused (exit 1),
    // naming the recorded one.
    let sharded = |args: &[&str]| {
        let mut a = vec!["--key-prefix", "sh"];
        a.extend_from_slice(args);
        worker(&a, &url, &dburl)
    };
    let out = sharded(&[
        "push",
        "--shards",
        "3",
        "--event",
        "x",
        "--payload",
        "{}",
        "--delay",
        "1m",
        "--unchecked",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_one_line(
        &sharded(&["stats", "--shards", "2"]),
        1,
        "Redis records 3 shards (sh:shards)",
    );
    assert_one_line(
        &sharded(&["stats"]),
        1,
        "--shards 1: Redis records 3 shards",
    );
    let out = sharded(&["stats", "--shards", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("{sh:0..2}:delay:pool   size 1"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn push_help_fits_on_one_screen_and_shows_only_its_flags() {
    let out = worker(&["push", "--help"], "redis://unused", "postgres://unused");
    let help = text(&out.stdout);
    assert!(
        help.lines().count() <= 40,
        "{} lines:\n{help}",
        help.lines().count()
    );
    assert!(
        !help.contains("--threads") && !help.contains("--tx-batch"),
        "{help}"
    );
    assert!(
        help.contains("--redis-url") && help.contains("--delay"),
        "{help}"
    );
    let out = worker(&["stats", "--help"], "redis://unused", "postgres://unused");
    assert!(!text(&out.stdout).contains("--threads"));
}

#[test]
fn an_unmigrated_database_is_refused_with_the_fix() {
    let r = RedisServer::start();
    let db = TestDb::empty();
    let out = worker(&["--threads", "1"], &r.url(), &db.url);
    assert_one_line(&out, 1, "run `worker migrate`");
}

#[test]
fn a_redis_that_never_answers_says_so() {
    // Accepts connections and never answers: the start-up check must give up and say why.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming().flatten() {
            held.push(c);
        }
    });
    let out = worker(
        &["stats"],
        &format!("redis://:hunter2@127.0.0.1:{port}/"),
        "postgres://unused",
    );
    assert_one_line(&out, 1, "no answer within the timeout");
    assert!(!text(&out.stderr).contains("hunter2"));

    // A signal while the daemon's start-up check waits on it is a graceful stop (exit 0),
    // not a failure: nothing was read yet.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", format!("redis://127.0.0.1:{port}/"))
        .env("DATABASE_URL", "postgres://unused")
        .env("RUST_LOG", "info")
        .args(["--threads", "1"]);
    let mut daemon = Proc::spawn(cmd);
    // Well inside the start-up check's own timeout (seconds), which the line above shows.
    std::thread::sleep(Duration::from_millis(500));
    daemon.signal(libc::SIGTERM);
    let status = daemon.wait(Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{}", daemon.log());
    assert!(
        daemon.log().contains("stopped during start-up"),
        "{}",
        daemon.log()
    );
}
