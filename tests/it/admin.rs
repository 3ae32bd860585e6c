//! The operator tools: `worker stats` figures against hand-built states, `--check` levels
//! and exit codes, `--watch` ending on Ctrl-C, and the dead-letter tools (filters, show,
//! requeue through the real daemon, purge refusing without a scope).

use crate::support::*;
use delay_worker::admin::gather;
use delay_worker::dead::{self, Filter};
use delay_worker::keys::Keys;
use delay_worker::now_ms;
use redis::Connection;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const WINDOW: Duration = Duration::from_secs(300);

fn worker(redis: &str, args: &[&str]) -> Output {
    run_worker(args, redis, "postgres://unused")
}

/// XADD with an explicit id, so ages are exact.
fn xadd_at(con: &mut Connection, stream: &str, at_ms: i64, fields: &[(&str, &[u8])]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg(format!("{at_ms}-0"));
    for (f, v) in fields {
        cmd.arg(*f).arg(*v);
    }
    cmd.query(con).unwrap()
}

/// A dead letter as settle.lua writes it, died at `at_ms`.
fn add_dead(
    con: &mut Connection,
    keys: &Keys,
    at_ms: i64,
    event: &str,
    key: &str,
    msg: &str,
) -> String {
    let ts = (at_ms / 1000).to_string();
    xadd_at(
        con,
        &keys.dead,
        at_ms,
        &[
            ("msg", msg.as_bytes()),
            ("reason", format!("handler failed for {key}").as_bytes()),
            ("ts", ts.as_bytes()),
            ("event", event.as_bytes()),
            ("key", key.as_bytes()),
            ("attempts", b"3"),
            ("consumer", b"c1"),
            ("id", b"1-1"),
        ],
    )
}

fn zadd(con: &mut Connection, keys: &Keys, score: i64, key: &str, with_data: bool) {
    if with_data {
        redis::cmd("HSET")
            .arg(&keys.data)
            .arg(key)
            .arg(r#"{"event":"order.timeout","payload":{"order_id":1},"retry":0}"#)
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

fn xlen(con: &mut Connection, key: &str) -> u64 {
    redis::cmd("XLEN").arg(key).query(con).unwrap()
}

#[test]
fn stats_report_the_figures_of_a_known_state() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now = now_ms();
    let now_s = now / 1000;

    // Nothing there yet: zeros, not an error.
    let empty = gather(&mut con, &keys, now, WINDOW).unwrap();
    assert!(!empty.group.exists);
    assert_eq!(
        (empty.stream.length, empty.group.pending, empty.pool.size),
        (0, 0, 0)
    );
    assert_eq!((empty.pool.mover_lag_ms, empty.dead.length), (0, 0));

    // The pool: PHP seconds scores and millisecond scores, due and not. The oldest due
    // member has no data yet (a producer that wrote ZADD first).
    zadd(&mut con, &keys, now_s - 100, "s-old", false);
    zadd(&mut con, &keys, now_s - 10, "s-new", true);
    zadd(&mut con, &keys, now_s + 3600, "s-future", true);
    zadd(&mut con, &keys, now - 2000, "ms-due", true);
    zadd(&mut con, &keys, now + 60_000, "ms-future", true);

    // The stream: five entries, a minute old down to 20 s; a stream without its group
    // reads as zeros too.
    for i in 0..5 {
        xadd_at(
            &mut con,
            &keys.stream,
            now - 60_000 + i * 10_000,
            &[("msg", b"{}"), ("key", b"k")],
        );
    }
    let no_group = gather(&mut con, &keys, now, WINDOW).unwrap();
    assert_eq!((no_group.stream.length, no_group.group.exists), (5, false));
    delay_worker::store::stream::ensure_group(&mut con, &keys).unwrap();
    // A dead host holding three entries, a live consumer that acked its one.
    assert_eq!(xreadgroup(&mut con, &keys, "c-dead", 3).len(), 3);
    live_heartbeat(&mut con, &keys, "c-live", "1");
    let live = xreadgroup(&mut con, &keys, "c-live", 1);
    redis::cmd("XACK")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg(&live)
        .query::<()>(&mut con)
        .unwrap();

    // Dead letters: one an hour old, two within the window.
    add_dead(&mut con, &keys, now - 3_600_000, "order.timeout", "a", "{}");
    add_dead(&mut con, &keys, now - 60_000, "order.timeout", "b", "{}");
    add_dead(&mut con, &keys, now - 30_000, "coupon.expire", "c", "{}");

    let s = gather(&mut con, &keys, now, WINDOW).unwrap();
    assert_eq!(s.stream.length, 5);
    assert_eq!(s.stream.entries_added, Some(5));
    assert!(s.group.exists);
    assert_eq!((s.group.lag, s.group.entries_read), (Some(1), Some(4)));
    assert_eq!(s.group.pending, 3);
    assert_eq!(
        s.group.oldest_pending_id.as_deref(),
        Some(format!("{}-0", now - 60_000).as_str())
    );
    assert_eq!(s.group.oldest_pending_age_ms, Some(60_000));
    let c: Vec<(&str, u64, bool)> = s
        .consumers
        .iter()
        .map(|c| (c.name.as_str(), c.pending, c.heartbeat))
        .collect();
    assert_eq!(c, [("c-dead", 3, false), ("c-live", 0, true)]);
    assert_eq!(s.pool.size, 5);
    assert_eq!((s.pool.due, s.pool.due_seconds, s.pool.due_ms), (3, 2, 1));
    assert_eq!(s.pool.oldest_due_key.as_deref(), Some("s-old"));
    assert_eq!(s.pool.mover_lag_ms, now - (now_s - 100) * 1000);
    assert_eq!(s.pool.oldest_due_has_data, Some(false));
    assert_eq!(
        (s.dead.length, s.dead.new, s.dead.entries_added),
        (3, 2, Some(3))
    );
    assert_eq!(s.dead.newest_age_ms, Some(30_000));

    // The binary shows the same, as a table and as JSON.
    let out = worker(&r.url(), &["stats"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    for needle in [
        "pending 3",
        "due 3 (2 seconds, 1 ms scores)",
        "has no data yet",
        "c-dead",
        "dead host",
        "new 2 (last 5m)",
    ] {
        assert!(table.contains(needle), "{needle:?} in\n{table}");
    }
    let out = worker(&r.url(), &["stats", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["group"]["pending"], 3);
    assert_eq!(j["pool"]["due"], 3);
    assert_eq!(j["consumers"][0]["heartbeat"], false);
    assert_eq!(j["dead"]["new"], 2);
}

/// A live consumer's heartbeat key as a worker writes it (for a minute), with `value`: a
/// health record, or what an older worker wrote.
fn live_heartbeat(con: &mut Connection, keys: &Keys, consumer: &str, value: &str) {
    redis::cmd("SET")
        .arg(keys.heartbeat(consumer))
        .arg(value)
        .arg("EX")
        .arg(60)
        .query::<()>(con)
        .unwrap();
}

/// Runs `worker stats --check` with these keys and flags: (exit code, the line).
fn check(r: &RedisServer, prefix: &str, flags: &[&str]) -> (i32, String) {
    // Hand-built states without a worker: the queue's levels alone (the live workers'
    // figure has its own tests, operator.rs).
    let mut args = vec![
        "stats",
        "--check",
        "--expect-workers",
        "0",
        "--key-prefix",
        prefix,
    ];
    args.extend_from_slice(flags);
    let out = worker(&r.url(), &args);
    let line = text(&out.stdout);
    assert_eq!(line.lines().count(), 1, "one line: {line}");
    assert!(line.contains(" | pending="), "perfdata: {line}");
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    (out.status.code().unwrap(), line.trim().to_string())
}

#[test]
fn check_levels_and_exit_codes() {
    let r = RedisServer::start();
    let mut con = r.con();
    let now = now_ms();

    let (code, line) = check(&r, "empty", &[]);
    assert_eq!(code, 0, "{line}");
    assert!(
        line.starts_with("OK - pending 0, oldest 0s, mover lag 0.0s, dead 0 new | "),
        "{line}"
    );

    // Pending: 3 is fine by default; thresholds are flags.
    let k = Keys::with_prefix("pend");
    delay_worker::store::stream::ensure_group(&mut con, &k).unwrap();
    for i in 0..3 {
        xadd_at(&mut con, &k.stream, now - 5000 + i, &[("msg", b"{}")]);
    }
    xreadgroup(&mut con, &k, "c1", 10);
    assert_eq!(check(&r, "pend", &[]).0, 0);
    let (code, line) = check(&r, "pend", &["--pending-warn", "2"]);
    assert_eq!(code, 1, "{line}");
    assert!(
        line.starts_with("WARNING - pending 3 (warn > 2), "),
        "{line}"
    );
    assert!(line.contains("pending=3;2;1000"), "{line}");
    let (code, line) = check(&r, "pend", &["--pending-warn", "1", "--pending-crit", "2"]);
    assert_eq!(code, 2, "{line}");
    assert!(
        line.starts_with("CRITICAL - pending 3 (crit > 2), "),
        "{line}"
    );

    // The oldest pending entry, 11 minutes old: warning; past --oldest-crit: critical.
    let k = Keys::with_prefix("old");
    delay_worker::store::stream::ensure_group(&mut con, &k).unwrap();
    xadd_at(&mut con, &k.stream, now_ms() - 660_000, &[("msg", b"{}")]);
    xreadgroup(&mut con, &k, "c1", 10);
    let (code, line) = check(&r, "old", &[]);
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("oldest 11m0") && line.contains("s (warn > 600)"),
        "{line}"
    );
    assert_eq!(check(&r, "old", &["--oldest-crit", "10m"]).0, 2);

    // Mover lag: a member 2 s overdue is a warning, 10 s overdue is critical.
    let k = Keys::with_prefix("lag");
    zadd(&mut con, &k, now_ms() - 2000, "late", true);
    let (code, line) = check(&r, "lag", &[]);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("mover lag 2."), "{line}");
    zadd(&mut con, &k, now_ms() - 10_000, "later", true);
    let (code, line) = check(&r, "lag", &[]);
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("(crit > 5)"), "{line}");
    // A PHP seconds score counts the same.
    let k = Keys::with_prefix("lags");
    zadd(&mut con, &k, now / 1000 - 60, "php", true);
    assert_eq!(check(&r, "lags", &[]).0, 2);

    // Dead letters: an old one is not news; a new one is a warning; --dead-crit.
    let k = Keys::with_prefix("dead");
    add_dead(&mut con, &k, now - 3_600_000, "order.timeout", "a", "{}");
    assert_eq!(check(&r, "dead", &[]).0, 0);
    let (code, line) = check(&r, "dead", &["--dead-window", "2h"]);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("dead 1 new (warn > 0)"), "{line}");
    add_dead(&mut con, &k, now - 1000, "order.timeout", "b", "{}");
    assert_eq!(check(&r, "dead", &[]).0, 1);
    assert_eq!(check(&r, "dead", &["--dead-crit", "0"]).0, 2);
    assert_eq!(check(&r, "dead", &["--dead-warn", "1"]).0, 0);

    // Redis unreachable: UNKNOWN, exit 3, no password.
    let url = format!("redis://:hunter2@127.0.0.1:{}/", free_port());
    let out = worker(&url, &["stats", "--check"]);
    assert_eq!(out.status.code(), Some(3));
    let line = text(&out.stdout);
    assert!(line.starts_with("UNKNOWN - cannot reach Redis"), "{line}");
    assert_eq!(line.lines().count(), 1);
    assert!(!line.contains("hunter2"), "{line}");
    // Without --check an unreachable Redis is an ordinary one-line error.
    let out = worker(&url, &["stats"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr).trim().lines().count(), 1);
}

#[test]
fn watch_redraws_and_ends_on_ctrl_c_without_a_backtrace() {
    use std::io::Read;
    let r = RedisServer::start();
    let mut child = Command::new(env!("CARGO_BIN_EXE_worker"))
        .env("REDIS_URL", r.url())
        .env("RUST_BACKTRACE", "1")
        .args(["stats", "--watch"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    // Two frames: the second carries the rates.
    wait_until(Duration::from_secs(10), "two frames", || {
        while let Ok(b) = rx.try_recv() {
            seen.extend(b);
        }
        text(&seen).contains("rates")
    });
    assert!(text(&seen).contains("\x1b[2J"), "the screen is cleared");
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "--watch ignored Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status:?} {err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
}

#[test]
fn a_dead_letter_requeued_after_the_fix_goes_through_the_daemon() {
    let mut env = Env::new();
    env.config.jobs.statement_timeout = Duration::from_millis(150);
    env.config.jobs.max_retries = 1;
    // A deadlock is contention, which dead-letters only once --retry-for has passed too.
    env.config.jobs.retry_for = Duration::ZERO;
    env.config.jobs.retry_base = Duration::from_millis(50);
    let orders = seed_orders(&env.db, 2);
    // The cause: a shop trigger that fails the first order's handler as a deadlock until its
    // retries are used up.
    let (release, h) = deadlock_order(&env, orders[0].id);
    push_timeouts(&env, &orders, 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "one dead letter, one order done", || {
        books(&env).dead == 1 && inbox_count(&env.db) == 1
    });
    daemon.stop();
    assert_accounting(&env.db, &orders, &[&orders[1]]);
    // The fix.
    release.send(()).unwrap();
    h.join().unwrap();

    let url = env.redis.url();
    let out = worker(&url, &["dead", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let key = format!("order.timeout:{}", orders[0].order_no);
    assert_eq!(listed[0]["key"], key.as_str());
    assert_eq!(listed[0]["event"], "order.timeout");
    let id = listed[0]["id"].as_str().unwrap().to_string();
    let died: serde_json::Value = serde_json::from_str(listed[0]["msg"].as_str().unwrap()).unwrap();
    assert_eq!(died["retry"], 1);

    let out = worker(&url, &["dead", "requeue", "--event", "order.timeout"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "requeued 1");
    // Back in the pool under its job key, due now, retry reset, every other field kept.
    let mut con = env.con();
    let msg: String = redis::cmd("HGET")
        .arg(&env.config.keys.data)
        .arg(&key)
        .query(&mut con)
        .unwrap();
    let back: serde_json::Value = serde_json::from_str(&msg).unwrap();
    assert_eq!(back["retry"], 0);
    assert_eq!(
        (&back["ts"], &back["payload"], &back["event"]),
        (&died["ts"], &died["payload"], &died["event"])
    );
    let score: f64 = redis::cmd("ZSCORE")
        .arg(&env.config.keys.pool)
        .arg(&key)
        .query(&mut con)
        .unwrap();
    assert!(
        (score as i64 - now_ms()).abs() < 60_000,
        "due now, in ms: {score}"
    );
    assert_eq!(books(&env).dead, 0);
    // The same letter again: gone, so nothing goes back twice.
    let out = worker(&url, &["dead", "requeue", "--id", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        format!("requeued 0\nno dead letter {id}\n")
    );

    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the requeued order", || {
        let b = books(&env);
        inbox_count(&env.db) == 2 && b.pool == 0 && b.stream_pending == 0
    });
    let report = daemon.stop();
    assert_eq!(report.stats.dead, 0, "{}", report.stats);
    assert_accounting(&env.db, &orders, &[&orders[0], &orders[1]]);
    assert_eq!(books(&env).dead, 0);
}

#[test]
fn requeue_keeps_fields_respects_newer_pushes_and_goes_back_once() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now = now_ms();
    let a = add_dead(
        &mut con,
        &keys,
        now - 4000,
        "order.timeout",
        "k-a",
        r#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":3,"ts":17,"trace":"t-1"}"#,
    );
    let b = add_dead(&mut con, &keys, now - 3000, "", "k-b", "not json at all");
    let c = add_dead(
        &mut con,
        &keys,
        now - 2000,
        "order.timeout",
        "k-c",
        r#"{"event":"order.timeout","payload":{"order_no":"SO3"},"retry":3}"#,
    );
    let d = add_dead(
        &mut con,
        &keys,
        now - 1000,
        "order.timeout",
        "",
        r#"{"event":"order.timeout","payload":{"order_no":"SO4"},"retry":1}"#,
    );
    // k-c was pushed again since it died: the newer job wins.
    let job = delay_worker::producer::NewJob {
        event: "order.timeout".into(),
        payload: serde_json::json!({"order_no": "SO3", "fresh": true}),
        due_ms: now + 60_000,
        key: Some("k-c".into()),
    };
    delay_worker::producer::push(&mut con, &keys, &job, now).unwrap();

    let letters = dead::scan(&mut con, &keys, &Filter::default(), now, None).unwrap();
    assert_eq!(letters.len(), 4);
    let out = worker(&r.url(), &["dead", "requeue"]);
    // The letter that is not JSON would die again at once: refused (exit 1), the rest go.
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.starts_with("requeued 2\n"), "{said}");
    assert!(
        said.contains(&format!(
            "refused {b}, it would die again at once: not a whole message"
        )),
        "{said}"
    );
    assert!(said.contains(&format!("left 1 in the dead letters: their job key is scheduled again, or a newer letter of it is dead, and the newer push wins ({c})")), "{said}");
    // Forced, it goes back as written, with the warning.
    let out = worker(&r.url(), &["dead", "requeue", "--force", "--id", &b]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.starts_with("requeued 1\n"), "{said}");
    assert!(said.contains(&format!("1 of them not a JSON object, requeued as written: they will be dead-lettered again ({b})")), "{said}");

    let hget = |con: &mut Connection, k: &str| -> Option<String> {
        redis::cmd("HGET")
            .arg(&keys.data)
            .arg(k)
            .query(con)
            .unwrap()
    };
    let back: serde_json::Value = serde_json::from_str(&hget(&mut con, "k-a").unwrap()).unwrap();
    assert_eq!(
        (
            back["retry"].as_i64(),
            back["ts"].as_i64(),
            back["trace"].as_str()
        ),
        (Some(0), Some(17), Some("t-1"))
    );
    assert_eq!(hget(&mut con, "k-b").as_deref(), Some("not json at all"));
    assert!(
        hget(&mut con, "k-c").unwrap().contains("fresh"),
        "the newer push is untouched"
    );
    // No job key: the dead letter's id stands in.
    let back: serde_json::Value = serde_json::from_str(&hget(&mut con, &d).unwrap()).unwrap();
    assert_eq!(back["retry"], 0);
    let pool: u64 = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(pool, 4);
    let left = dead::scan(&mut con, &keys, &Filter::default(), now, None).unwrap();
    assert_eq!(
        left.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        [c.as_str()]
    );

    // Requeueing the same letters again (a second operator, a retried command): the
    // script re-reads each by id, so nothing goes back twice.
    let again = dead::requeue(&mut con, &keys, &letters, now).unwrap();
    assert!(again.requeued.is_empty());
    assert_eq!(again.gone, [a, b, d]);
    assert_eq!(again.key_scheduled, [c]);
    let pool: u64 = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!(pool, 4);
}

/// Four dead letters: 2 h, 30 min, 1 min and 10 s old; the last without an `event`
/// field (its message names it).
fn four_letters(con: &mut Connection, keys: &Keys, now: i64) -> [String; 4] {
    [
        add_dead(
            con,
            keys,
            now - 7_200_000,
            "order.timeout",
            "k1",
            r#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":3}"#,
        ),
        add_dead(
            con,
            keys,
            now - 1_800_000,
            "coupon.expire",
            "k2",
            r#"{"event":"coupon.expire","payload":{"coupon_id":2}}"#,
        ),
        add_dead(con, keys, now - 60_000, "order.timeout", "k3", "not json"),
        add_dead(
            con,
            keys,
            now - 10_000,
            "",
            "k4",
            r#"{"event":"aftersale.timeout","payload":{"aftersale_id":4}}"#,
        ),
    ]
}

#[test]
fn dead_letters_filter_by_event_and_age() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now = now_ms();
    let all = four_letters(&mut con, &keys, now);
    let [l1, _, l3, _] = &all;
    // Which of the four (1-based) a filter selects.
    let mut which = |event: Option<&str>, older_than: Option<u64>, newer_than: Option<u64>| {
        let f = Filter {
            event: event.map(str::to_string),
            older_than: older_than.map(Duration::from_secs),
            newer_than: newer_than.map(Duration::from_secs),
        };
        dead::scan(&mut con, &keys, &f, now, None)
            .unwrap()
            .iter()
            .map(|l| all.iter().position(|id| *id == l.id).unwrap() + 1)
            .collect::<Vec<_>>()
    };
    assert_eq!(which(None, None, None), [1, 2, 3, 4]);
    assert_eq!(which(Some("order.timeout"), None, None), [1, 3]);
    assert_eq!(
        which(Some("aftersale.timeout"), None, None),
        [4],
        "event read from the message"
    );
    assert_eq!(which(None, Some(3600), None), [1]);
    assert_eq!(which(None, None, Some(600)), [3, 4]);
    assert_eq!(which(None, Some(300), Some(3600)), [2]);
    assert_eq!(which(Some("order.timeout"), Some(600), None), [1]);
    assert!(which(None, Some(86_400), None).is_empty());

    // The binary: one line per letter under a header, --limit, --json.
    let out = worker(&r.url(), &["dead", "list", "--event", "order.timeout"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 3, "{listed}");
    assert!(
        lines[0].starts_with("ID ") && lines[0].ends_with("REASON"),
        "{listed}"
    );
    assert!(
        lines[1].starts_with(l1.as_str())
            && lines[1].contains(" 2h00m ")
            && lines[1].contains(" k1 "),
        "{listed}"
    );
    assert!(lines[1].ends_with("handler failed for k1"), "{listed}");
    assert!(
        lines[2].starts_with(l3.as_str()) && lines[2].contains(" 1m00s "),
        "{listed}"
    );
    let out = worker(&r.url(), &["dead", "list", "--limit", "1"]);
    let listed = text(&out.stdout);
    assert_eq!(listed.lines().count(), 3, "{listed}");
    assert!(
        listed.ends_with("... more not shown (--limit 1)\n"),
        "{listed}"
    );
    let out = worker(&r.url(), &["dead", "list", "--json", "--newer-than", "10m"]);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let j = j.as_array().unwrap();
    assert_eq!(j.len(), 2);
    assert_eq!(
        (j[0]["id"].as_str(), j[0]["msg"].as_str()),
        (Some(l3.as_str()), Some("not json"))
    );
    assert_eq!(
        (j[1]["event"].as_str(), j[1]["attempts"].as_u64()),
        (Some("aftersale.timeout"), Some(3))
    );
    let out = worker(&r.url(), &["dead", "list", "--event", "nope"]);
    assert_eq!(text(&out.stdout), "no dead letters\n");
}

#[test]
fn show_prints_every_field_and_the_message_pretty() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let [l1, _, l3, _] = four_letters(&mut con, &keys, now_ms());
    let out = worker(&r.url(), &["dead", "show", &l1]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    for needle in [
        &format!("dead letter  {l1}"),
        "event        order.timeout",
        "key          k1",
        "attempts     3",
        "reason       handler failed for k1",
        "consumer     c1",
        "entry        1-1",
        "(2h00m ago)",
        "message\n{\n",
        "\n    \"order_no\": \"SO1\"\n",
    ] {
        assert!(shown.contains(needle), "{needle:?} in\n{shown}");
    }
    let out = worker(&r.url(), &["dead", "show", &l3]);
    assert!(
        text(&out.stdout).contains("message (not JSON: "),
        "{}",
        text(&out.stdout)
    );
    let out = worker(&r.url(), &["dead", "show", "1-0"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "no dead letter 1-0\n");
    let out = worker(&r.url(), &["dead", "show", "nonsense"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("not a dead-letter id"), "{err}");
}

#[test]
fn purge_refuses_without_an_age_or_all() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    four_letters(&mut con, &keys, now_ms());
    for args in [
        &["dead", "purge"][..],
        &["dead", "purge", "--event", "order.timeout"],
    ] {
        let out = worker(&r.url(), args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains("--older-than"),
            "{}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty());
    }
    assert_eq!(xlen(&mut con, &keys.dead), 4, "nothing purged");
    let purge = |args: &[&str]| {
        let mut a = vec!["dead", "purge"];
        a.extend_from_slice(args);
        let out = worker(&r.url(), &a);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    assert_eq!(purge(&["--older-than", "1h"]), "purged 1\n");
    assert_eq!(purge(&["--older-than", "1h"]), "purged 0\n");
    assert_eq!(purge(&["--all", "--event", "coupon.expire"]), "purged 1\n");
    assert_eq!(xlen(&mut con, &keys.dead), 2);
    assert_eq!(purge(&["--all"]), "purged 2\n");
    assert_eq!(xlen(&mut con, &keys.dead), 0);
}

#[test]
fn stats_in_list_mode_show_queues_processing_and_dead_lists() {
    let r = RedisServer::start();
    let mut con = r.con();
    let mut keys = Keys::default();
    keys.queues = vec![
        delay_worker::keys::Queue::new("high", None),
        delay_worker::keys::Queue::new("payment_queue", Some("payment.paid")),
    ];
    let now = delay_worker::now_ms();
    let ts = now / 1000 - 90;
    // high: two waiting, the oldest pushed 90 s ago; host-a holds one; one dead.
    for (list, msg) in [
        (
            "high",
            format!(r#"{{"event":"e","payload":{{}},"ts":{ts}}}"#),
        ),
        (
            "high",
            format!(r#"{{"event":"e","payload":{{}},"ts":{}}}"#, ts + 60),
        ),
        ("high:processing:host-a", "{}".to_string()),
        ("high:dead", "{}".to_string()),
        ("payment_queue", r#"{"order_no":"SO1"}"#.to_string()),
    ] {
        redis::cmd("LPUSH")
            .arg(list)
            .arg(msg)
            .query::<()>(&mut con)
            .unwrap();
    }
    redis::cmd("SADD")
        .arg(&keys.list_consumers)
        .arg("host-a")
        .arg("host-b")
        .query::<()>(&mut con)
        .unwrap();
    let report = gather(&mut con, &keys, now, Duration::from_secs(300)).unwrap();
    assert_eq!(report.queues.len(), 2);
    let high = &report.queues[0];
    assert_eq!((high.name.as_str(), high.length, high.dead), ("high", 2, 1));
    assert_eq!(
        high.processing,
        vec![("host-a".to_string(), 1), ("host-b".to_string(), 0)]
    );
    let age = high.oldest_age_ms.unwrap();
    assert!(
        (89_000..=92_000).contains(&age),
        "oldest waiting message is 90 s old: {age}"
    );
    let pay = &report.queues[1];
    assert_eq!(
        (pay.length, pay.oldest_age_ms),
        (1, None),
        "raw messages carry no ts"
    );

    // The binary shows them with the list-mode flags.
    let out = worker(
        &r.url(),
        &[
            "stats",
            "--source",
            "list",
            "--queues",
            "high",
            "--queue",
            "payment_queue=payment.paid",
        ],
    );
    let text = text(&out.stdout);
    assert!(out.status.success(), "{}", self::text(&out.stderr));
    assert!(
        text.contains("queue   high") && text.contains("processing host-a 1"),
        "{text}"
    );
}

/// With `--shards`, a stream id is unique only within its shard: ids are written
/// `<shard>/<id>`, a bare id held by two shards is refused naming them, and a requeue of
/// one shard's letter touches no other shard's letter of the same id.
#[test]
fn dead_letter_ids_name_their_shard() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let shards = Keys::default().sharded("mq", 3);
    for k in &shards[1..] {
        add_letter(
            &mut con,
            &k.dead,
            "1796072452038-0",
            &format!("k-{}", k.dead),
        );
    }
    let w = |args: &[&str]| {
        let mut a = vec!["--shards", "3"];
        a.extend_from_slice(args);
        run_worker(&a, &r.url(), &db.url)
    };
    let out = w(&["dead", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let letters: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = letters.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["1/1796072452038-0", "2/1796072452038-0"]);

    let out = w(&["dead", "show", "1796072452038-0"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("shards [1, 2]"),
        "{}",
        text(&out.stderr)
    );
    let out = w(&["dead", "show", "2/1796072452038-0"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("k-{mq:2}:dead-letter"),
        "{}",
        text(&out.stdout)
    );

    let out = w(&["dead", "requeue", "--id", "1/1796072452038-0"]);
    assert!(
        out.status.success(),
        "{} {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let len =
        |c: &mut redis::Connection, k: &str| -> u64 { redis::cmd("XLEN").arg(k).query(c).unwrap() };
    assert_eq!(len(&mut con, &shards[1].dead), 0, "requeued");
    assert_eq!(
        len(&mut con, &shards[2].dead),
        1,
        "the other shard's letter stays"
    );
    let pooled: u64 = redis::cmd("ZCARD")
        .arg(&shards[1].pool)
        .query(&mut con)
        .unwrap();
    assert_eq!(pooled, 1, "back in its own shard's pool");
}

/// A dead letter of an `order.timeout` as the worker writes it, at `id`, for `job_key`.
fn add_letter(con: &mut redis::Connection, dead: &str, id: &str, job_key: &str) {
    redis::cmd("XADD")
        .arg(dead)
        .arg(id)
        .arg("msg")
        .arg(r#"{"event":"order.timeout","payload":{"order_no":"X"}}"#)
        .arg("reason")
        .arg("r")
        .arg("event")
        .arg("order.timeout")
        .arg("key")
        .arg(job_key)
        .arg("ts")
        .arg(1796072452)
        .query::<()>(con)
        .unwrap();
}

/// An entry of the dead-letter stream without a message (not one the worker wrote) is
/// left where it is by a requeue, with the reason, not put back to die again.
#[test]
fn a_letter_without_a_message_is_not_requeued() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let keys = Keys::default();
    let id: String = redis::cmd("XADD")
        .arg(&keys.dead)
        .arg("*")
        .arg("reason")
        .arg("written by hand")
        .query(&mut con)
        .unwrap();
    let out = run_worker(&["dead", "requeue"], &r.url(), &db.url);
    // Exit 1: a letter was left that could not be requeued (found from outside: 0 said
    // all was well).
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "requeued 0\nleft {id} in the dead letters: it holds no message (an empty one, or an entry the worker did not write)\n"
        )
    );
    let len: u64 = redis::cmd("XLEN").arg(&keys.dead).query(&mut con).unwrap();
    let pooled: u64 = redis::cmd("ZCARD").arg(&keys.pool).query(&mut con).unwrap();
    assert_eq!((len, pooled), (1, 0));
}

/// With `--shards N`, `dead list --limit` and `dead requeue --limit` count over all
/// shards, the oldest letters first whichever shard holds them.
#[test]
fn dead_letter_limits_span_the_shards() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let shards = Keys::default().sharded("mq", 3);
    let t = 1_796_072_452_000_u64;
    // 15 letters, each shard's interleaved in time with the others': shard s holds
    // t + 3k + s for k in 0..5.
    for k in 0..5 {
        for (s, keys) in shards.iter().enumerate() {
            let ms = t + 3 * k + s as u64;
            add_letter(&mut con, &keys.dead, &format!("{ms}-0"), &format!("k-{ms}"));
        }
    }
    let id = |n: u64| format!("{}/{}-0", n % 3, t + n);
    let w = |args: &[&str]| {
        let mut a = vec!["--shards", "3"];
        a.extend_from_slice(args);
        let out = run_worker(&a, &r.url(), &db.url);
        assert!(
            out.status.success(),
            "{args:?}: {} {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    };
    let listed = |args: &[&str]| -> Vec<String> {
        let mut a = vec!["dead", "list", "--json"];
        a.extend_from_slice(args);
        let letters: Vec<serde_json::Value> = serde_json::from_str(&w(&a)).unwrap();
        letters
            .iter()
            .map(|l| l["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        listed(&["--limit", "4"]),
        (0..4).map(id).collect::<Vec<_>>()
    );
    assert_eq!(listed(&[]), (0..15).map(id).collect::<Vec<_>>());
    let table = w(&["dead", "list", "--limit", "4"]);
    let rows: Vec<&str> = table.lines().skip(1).collect();
    assert_eq!(rows.len(), 5, "{table}");
    for (n, row) in rows[..4].iter().enumerate() {
        assert!(row.starts_with(&id(n as u64)), "{table}");
    }
    assert_eq!(rows[4], "... more not shown (--limit 4)");

    // The oldest two of all shards go back, one of shard 0 and one of shard 1.
    let said = w(&["dead", "requeue", "--limit", "2"]);
    assert!(said.starts_with("requeued 2\n"), "{said}");
    assert_eq!(listed(&[]), (2..15).map(id).collect::<Vec<_>>());
    let pooled = |c: &mut redis::Connection, s: usize| -> u64 {
        redis::cmd("ZCARD").arg(&shards[s].pool).query(c).unwrap()
    };
    assert_eq!(
        (0..3).map(|s| pooled(&mut con, s)).collect::<Vec<_>>(),
        [1, 1, 0]
    );
    // Named ids with a limit: the first ones named, whichever shards.
    let said = w(&[
        "dead",
        "requeue",
        "--limit",
        "2",
        "--id",
        &id(14),
        "--id",
        &id(3),
        "--id",
        &id(2),
    ]);
    assert!(said.starts_with("requeued 2\n"), "{said}");
    let mut left: Vec<String> = (2..14).filter(|n| *n != 3).map(id).collect();
    assert_eq!(listed(&[]), left);
    assert_eq!(
        (0..3).map(|s| pooled(&mut con, s)).collect::<Vec<_>>(),
        [2, 1, 1]
    );
    // A purge says what each shard lost.
    let said = w(&["dead", "purge", "--all", "--event", "order.timeout"]);
    assert_eq!(
        said,
        "shard 0 ({mq:0}:dead-letter): purged 3\n\
         shard 1 ({mq:1}:dead-letter): purged 4\n\
         shard 2 ({mq:2}:dead-letter): purged 4\n"
    );
    left.clear();
    assert_eq!(listed(&[]), left);
}

/// Going from one key set to `--shards N` is refused while the unsharded stream still
/// holds entries, read and unacknowledged or not read yet: they would never run.
#[test]
fn shards_are_refused_while_the_unsharded_stream_holds_work() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    for i in 0..3 {
        redis::cmd("XADD")
            .arg("mq:events")
            .arg("*")
            .arg("msg")
            .arg("{}")
            .arg("key")
            .arg(format!("k{i}"))
            .query::<()>(&mut con)
            .unwrap();
    }
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("mq:events")
        .arg("main")
        .arg("0")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("main")
        .arg("ghost")
        .arg("COUNT")
        .arg(2)
        .arg("STREAMS")
        .arg("mq:events")
        .arg(">")
        .query::<redis::Value>(&mut con)
        .unwrap();
    let out = run_worker(
        &[
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
        ],
        &r.url(),
        &db.url,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("the unsharded mq:events still holds 3 jobs"),
        "{}",
        text(&out.stderr)
    );
    let recorded: Option<String> = redis::cmd("GET").arg("mq:shards").query(&mut con).unwrap();
    assert_eq!(recorded, None);
}

/// `worker stats` on another host reads a pool held back for the readers against the
/// `--move-ahead` the live movers published in their health records, not its own flag's:
/// a daemon with a bound of 20,000 publishes it, and with that record in place the same
/// state (3,000 unread entries, due members a minute old) is the mover's lag; without it,
/// against the default 5,000 (held back from 2,500 on), the readers' backlog.
#[test]
fn stats_reads_a_held_pool_against_the_bound_the_movers_published() {
    let mut env = Env::new();
    env.config.mover.ahead = 20_000;
    let daemon = Daemon::start(&env.config);
    let beat = env.config.keys.heartbeat(&env.config.consumer);
    let mut con = env.con();
    let mut record = None;
    wait_until(WAIT, "the daemon's health record", || {
        record = redis::cmd("GET")
            .arg(&beat)
            .query::<Option<String>>(&mut con)
            .unwrap();
        record.is_some()
    });
    daemon.stop();
    let record = record.unwrap();
    let parsed = delay_worker::health::Record::parse(record.as_bytes()).unwrap();
    assert_eq!(parsed.move_ahead, Some(20_000), "{record}");

    let keys = Keys::with_prefix("ahead");
    delay_worker::store::stream::ensure_group(&mut con, &keys).unwrap();
    let now = now_ms();
    let mut p = redis::pipe();
    for _ in 0..3_001 {
        p.cmd("XADD")
            .arg(&keys.stream)
            .arg("*")
            .arg("msg")
            .arg("{}")
            .ignore();
    }
    p.query::<()>(&mut con).unwrap();
    // The live consumer took one; 3,000 wait for the readers.
    assert_eq!(xreadgroup(&mut con, &keys, "c-live", 1).len(), 1);
    for i in 0..5 {
        zadd(&mut con, &keys, now - 60_000, &format!("due-{i}"), true);
    }
    let figures = || -> (i64, i64) {
        let out = worker(
            &env.redis.url(),
            &["stats", "--json", "--key-prefix", "ahead"],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["group"]["lag"], 3_000, "{j}");
        (
            j["pool"]["mover_lag_ms"].as_i64().unwrap(),
            j["pool"]["readers_backlog_ms"].as_i64().unwrap(),
        )
    };
    // A live consumer of an older version (no record): the command's own bound.
    live_heartbeat(&mut con, &keys, "c-live", "1");
    let (lag, backlog) = figures();
    assert!(lag == 0 && backlog >= 60_000, "{lag} {backlog}");
    // The daemon's record: its bound of 20,000 is not near, so the mover is late.
    live_heartbeat(&mut con, &keys, "c-live", &record);
    let (lag, backlog) = figures();
    assert!(lag >= 60_000 && backlog == 0, "{lag} {backlog}");
}

/// A worker's key holding another type: `stats`, `dead list` and `trace` each end with
/// one line that names the key and the type it holds (Redis's `WRONGTYPE` names neither),
/// exit 1, no backtrace.
#[test]
fn the_tools_name_a_key_of_the_wrong_type() {
    let r = RedisServer::start();
    // `trace` reads the inbox too.
    let db = TestDb::new();
    let mut con = r.con();
    let k = Keys::default();
    let cases: [(&str, &str, &[&str]); 3] = [
        (&k.stream, "stream", &["stats"]),
        (&k.dead, "stream", &["dead", "list"]),
        (&k.pool, "zset", &["trace", "--order", "5"]),
    ];
    for (key, wanted, args) in cases {
        redis::cmd("SET")
            .arg(key)
            .arg("x")
            .query::<()>(&mut con)
            .unwrap();
        let out = run_worker(args, &r.url(), &db.url);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(&format!(
                "key {key:?} holds a string, not a {wanted}; rename or remove it"
            )) && !err.contains("WRONGTYPE")
                && err.lines().count() == 1,
            "{args:?}: {err}"
        );
        redis::cmd("DEL").arg(key).query::<()>(&mut con).unwrap();
    }
}

/// A dead letter of job key `order.timeout:shared` written by hand, its message naming
/// `order`; its id.
fn shared_letter(con: &mut redis::Connection, keys: &Keys, order: &str) -> String {
    let msg = format!(
        r#"{{"event":"order.timeout","payload":{{"order_no":"{order}"}},"retry":1,"ts":1}}"#
    );
    redis::cmd("XADD")
        .arg(&keys.dead)
        .arg("*")
        .arg(&["msg", &msg, "reason", "by hand", "ts", "1"])
        .arg(&["event", "order.timeout", "key", "order.timeout:shared"])
        .arg(&["attempts", "1"])
        .query(con)
        .unwrap()
}

/// A letter whose job key's data is there with no schedule (a producer's push cut between
/// its HSET and its ZADD) stays, and the requeue says so and what to do, exit 1: before,
/// it said the key was scheduled again, which nothing was. Once the field is gone it goes
/// back.
#[test]
fn a_letter_whose_key_has_data_but_no_schedule_stays_with_what_to_do() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let keys = Keys::default();
    let key = "order.timeout:shared";
    let id = shared_letter(&mut con, &keys, "OLD");
    redis::cmd("HSET")
        .arg(&keys.data)
        .arg(key)
        .arg(r#"{"event":"order.timeout","payload":{"order_no":"NEW"},"ts":1}"#)
        .query::<()>(&mut con)
        .unwrap();
    let out = run_worker(&["dead", "requeue", "--id", &id], &r.url(), &db.url);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("left {id} in the dead letters: its job key's data is in the delay pool's data hash with no schedule")),
        "{said}"
    );
    assert!(!said.contains("scheduled again"), "{said}");
    assert_eq!(xlen(&mut con, &keys.dead), 1);
    redis::cmd("HDEL")
        .arg(&keys.data)
        .arg(key)
        .query::<()>(&mut con)
        .unwrap();
    let out = run_worker(&["dead", "requeue", "--id", &id], &r.url(), &db.url);
    let said = text(&out.stdout);
    assert!(said.starts_with("requeued 1\n"), "{said}");
    assert_eq!(out.status.code(), Some(0), "{said}");
}

/// Found from outside: `--limit 1` took the oldest letter, the older of two of one job key,
/// and said "requeued 0" and went no further, so the key's newer letter never went back
/// by that command. A letter left because a newer one of its key wins is not one tried:
/// the call goes on to the newer letter and puts it back; the older stays, named.
#[test]
fn a_requeue_limited_to_one_passes_over_an_older_letter_to_its_key_s_newer_one() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let keys = Keys::default();
    let key = "order.timeout:shared";
    let older = shared_letter(&mut con, &keys, "OLD");
    let newer = shared_letter(&mut con, &keys, "NEW");
    // As the settle and the mover index each letter they write.
    redis::cmd("HSET")
        .arg(&keys.letters)
        .arg(key)
        .arg(format!("{older} {newer}"))
        .query::<()>(&mut con)
        .unwrap();
    // Named alone, the older letter stays while the newer is dead.
    let out = run_worker(&["dead", "requeue", "--id", &older], &r.url(), &db.url);
    let said = text(&out.stdout);
    assert!(said.starts_with("requeued 0\n"), "{said}");
    assert!(said.contains("a newer letter of it is dead"), "{said}");
    let out = run_worker(&["dead", "requeue", "--limit", "1"], &r.url(), &db.url);
    let said = text(&out.stdout);
    assert!(
        said.starts_with("requeued 1\n"),
        "{said}{}",
        text(&out.stderr)
    );
    assert!(
        said.contains(&format!(
            "a newer letter of it is dead, and the newer push wins ({older})"
        )),
        "{said}"
    );
    let data: String = redis::cmd("HGET")
        .arg(&keys.data)
        .arg(key)
        .query(&mut con)
        .unwrap();
    assert!(data.contains("NEW"), "{data}");
    let index: Option<String> = redis::cmd("HGET")
        .arg(&keys.letters)
        .arg(key)
        .query(&mut con)
        .unwrap();
    assert_eq!(
        index,
        Some(older.clone()),
        "the requeued letter left the index"
    );
    // The older letter stays while its key is scheduled again, whatever the limit.
    let out = run_worker(&["dead", "requeue", "--limit", "1"], &r.url(), &db.url);
    assert!(
        text(&out.stdout).starts_with("requeued 0\n"),
        "{}",
        text(&out.stdout)
    );
    let left: usize = redis::cmd("XLEN").arg(&keys.dead).query(&mut con).unwrap();
    assert_eq!(left, 1);
}

/// The same with `--shards`: the limit counts the letters tried over all shards, oldest
/// first, and one left for its key's newer letter is not one of them.
#[test]
fn a_sharded_requeue_limit_passes_over_letters_their_newer_ones_win_over() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let shards = Keys::default().sharded("mq", 3);
    let t = 1_796_072_452_000_u64;
    // Shard 1: two letters of one key, at t and t + 10; shard 0: another key at t + 5.
    add_letter(&mut con, &shards[1].dead, &format!("{t}-0"), "k-x");
    add_letter(&mut con, &shards[0].dead, &format!("{}-0", t + 5), "k-y");
    add_letter(&mut con, &shards[1].dead, &format!("{}-0", t + 10), "k-x");
    redis::cmd("HSET")
        .arg(&shards[1].letters)
        .arg("k-x")
        .arg(format!("{t}-0 {}-0", t + 10))
        .query::<()>(&mut con)
        .unwrap();
    let out = run_worker(
        &["--shards", "3", "dead", "requeue", "--limit", "2"],
        &r.url(),
        &db.url,
    );
    let said = text(&out.stdout);
    assert!(
        said.starts_with("requeued 2\n"),
        "{said}{}",
        text(&out.stderr)
    );
    assert!(
        said.contains(&format!("the newer push wins (1/{t}-0)")),
        "{said}"
    );
    let pooled = |c: &mut redis::Connection, s: usize| -> u64 {
        redis::cmd("ZCARD").arg(&shards[s].pool).query(c).unwrap()
    };
    assert_eq!(
        (0..3).map(|s| pooled(&mut con, s)).collect::<Vec<_>>(),
        [1, 1, 0]
    );
    let left: usize = redis::cmd("XLEN")
        .arg(&shards[1].dead)
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 1, "the older letter of k-x stays");
}

/// Found from outside: two letters of one job key (a retry a newer push replaced, then that
/// push's own job) requeued by a filter: the older went back first and the newer was left
/// behind its own key. The newest letter of a key goes back; the older stays.
#[test]
fn of_two_letters_of_one_key_the_newer_is_requeued() {
    let r = RedisServer::start();
    let db = TestDb::new();
    let mut con = r.con();
    let keys = Keys::default();
    let older = shared_letter(&mut con, &keys, "OLD");
    let newer = shared_letter(&mut con, &keys, "NEW");
    let out = run_worker(&["dead", "requeue"], &r.url(), &db.url);
    let said = text(&out.stdout);
    assert!(said.starts_with("requeued 1\n"), "{said}");
    assert!(said.contains(&older) && !said.contains(&newer), "{said}");
    let data: String = redis::cmd("HGET")
        .arg(&keys.data)
        .arg("order.timeout:shared")
        .query(&mut con)
        .unwrap();
    assert!(data.contains("NEW"), "{data}");
    let left: redis::Value = redis::cmd("XRANGE")
        .arg(&keys.dead)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    let redis::Value::Array(left) = left else {
        panic!("{left:?}")
    };
    assert_eq!(left.len(), 1, "the older letter stays");
    let redis::Value::Array(entry) = &left[0] else {
        panic!("{left:?}")
    };
    assert_eq!(delay_worker::store::value_to_string(&entry[0]), older);
}
