//! One clock, and a Redis that keeps what it is given: the real binary with its host
//! clock shifted by libfaketime (Debian's `faketime`) 120 s ahead and 120 s behind Redis's,
//! an evicting Redis refused at start and turned CRITICAL at runtime, memory near
//! `maxmemory` a warning, and a pool member whose data vanished reported as lost data.
//! Each test ends with the books.

use crate::support::*;
use delay_worker::keys::Keys;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The worker binary as `Proc::start` runs it, with `env` added (libfaketime) and its log
/// at info.
fn worker(env: &Env, extra: &[&str], vars: &[(&str, &str)]) -> Proc {
    assert!(
        std::path::Path::new(FAKETIME).exists() || vars.is_empty(),
        "{FAKETIME} is missing: apt-get install faketime (scripts/test.sh installs it)"
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", &env.config.redis_url)
        .env("DATABASE_URL", &env.config.database_url)
        .env("RUST_LOG", "info")
        .args(["--consumer", "c1", "--threads", "4"])
        .args(["--poll-interval", "20ms", "--block", "200ms"])
        .args(["--heartbeat-ttl", "2s", "--stats-interval", "1s"])
        .args(extra)
        .stdin(std::process::Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    Proc::spawn(cmd)
}

/// Redis's clock, unix ms.
fn redis_ms(con: &mut redis::Connection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query(con).unwrap();
    s * 1000 + us / 1000
}

/// Pushes an order's timeout due `delay_ms` after now on Redis's clock.
fn push_on_redis_clock(env: &Env, orders: &[SeedOrder], delay_ms: i64) {
    let mut con = env.con();
    let now = redis_ms(&mut con);
    for o in orders {
        let job = delay_worker::producer::NewJob {
            event: "order.timeout".into(),
            payload: serde_json::json!({ "order_no": o.order_no }),
            due_ms: now + delay_ms,
            key: Some(format!("order.timeout:{}", o.order_no)),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
}

/// (entry id ms, due ms) of every stream entry: when the mover moved it, on Redis's
/// clock, and when it was due.
fn moves(env: &Env) -> Vec<(i64, i64)> {
    let v: Vec<(String, std::collections::HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&env.config.keys.stream)
        .arg("-")
        .arg("+")
        .query(&mut env.con())
        .unwrap();
    v.into_iter()
        .map(|(id, f)| {
            let at: i64 = id.split('-').next().unwrap().parse().unwrap();
            (at, f["due"].parse().unwrap())
        })
        .collect()
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{body}"))
}

/// A worker whose host clock is `shift` (`+120s`, `-120s`) off Redis's: no order is
/// cancelled before its due time on Redis's clock, none is late by the shift, paid ones
/// stay paid, and the skew shows in the log, `/metrics` and `stats --check`.
fn shifted(shift: &str, offset_sign: f64) {
    let env = Env::new();
    let orders = seed_orders(&env.db, 120);
    let paid: Vec<SeedOrder> = orders.iter().step_by(6).cloned().collect();
    pay(&env.db, &paid);
    // Due over the next 1 to 3 s on Redis's clock.
    for (i, chunk) in orders.chunks(30).enumerate() {
        push_on_redis_clock(&env, chunk, 1_000 + 600 * i as i64);
    }
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut p = worker(
        &env,
        &["--metrics-addr", &addr],
        &[
            ("LD_PRELOAD", FAKETIME),
            ("FAKETIME", shift),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    // Every job done well within the shift: none waits for the host's clock.
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 120);
    for (moved_at, due) in moves(&env) {
        assert!(
            moved_at >= due,
            "moved at {moved_at}, {} ms before its due time {due} on Redis's clock",
            due - moved_at
        );
    }
    let want = if offset_sign < 0.0 {
        "s ahead of Redis's"
    } else {
        "s behind Redis's"
    };
    wait_until(WAIT, "the skew in the log", || {
        p.log().contains("clock: this host's clock is 1") && p.log().contains(want)
    });
    let (code, _, body) = http_get(port, "/metrics").unwrap();
    assert_eq!(code, 200);
    let offset = metric(&body, "delay_worker_clock_offset_seconds");
    assert!(
        (offset - offset_sign * 120.0).abs() < 5.0,
        "offset {offset} for {shift}"
    );
    // Lateness on the shared clock: seconds at most, not the shift.
    let late = metric(&body, "delay_worker_lateness_seconds_sum")
        / metric(&body, "delay_worker_lateness_seconds_count");
    assert!(late < 60.0, "mean lateness {late}s");
    wait_until(WAIT, "stats --check to name the offset", || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        let line = text(&out.stdout);
        out.status.code() == Some(2) && line.contains("clock offset") && line.contains("(c1)")
    });
    let out = run_worker(&["stats"], &env.config.redis_url, &env.db.url);
    let table = text(&out.stdout);
    assert!(
        table.contains("120.0") || table.contains("119.9"),
        "{table}"
    );

    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_all_accounted(&env, &env.db, 120);
    assert_eq!(
        books(&env).dead,
        0,
        "no dead letter for a fault of the surroundings"
    );
}

#[test]
fn a_worker_120s_ahead_cancels_no_order_early_and_says_so() {
    shifted("+120s", -1.0);
}

#[test]
fn a_worker_120s_behind_cancels_no_order_late_and_says_so() {
    shifted("-120s", 1.0);
}

/// A worker 120 s ahead of Redis restarted with jobs of its own pending (taken back the
/// moment it starts) while a deploy has renamed a column the handler needs: each is held,
/// back in the pool due in 5 s on Redis's clock, not 125 s, and once the column is back
/// each is done with its lateness on Redis's clock, however soon after the start it ran
/// (the clock is measured before the roles start); every order cancelled once.
#[test]
fn a_worker_ahead_restarted_with_jobs_pending_holds_and_times_them_on_redis_s_clock() {
    use delay_worker::config::MoverConfig;
    use delay_worker::mover::Mover;
    use delay_worker::stats::Stats;
    use delay_worker::store::At;
    let env = Env::new();
    let keys = &env.config.keys;
    let orders = seed_orders(&env.db, 300);
    let rename = |from: &str, to: &str| {
        env.db
            .client()
            .batch_execute(&format!("ALTER TABLE orders RENAME COLUMN {from} TO {to}"))
            .unwrap()
    };
    rename("cancel_reason", "cancel_reason_deployed");
    // Due now, moved and read by consumer c1, which then died: pending for it.
    push_on_redis_clock(&env, &orders, 0);
    let mut con = env.con();
    let (stats, cfg) = (Stats::default(), MoverConfig::default());
    let mover = Mover::new(keys, &cfg, &stats);
    while books(&env).pool > 0 {
        mover.tick(&mut con, At::Server).unwrap();
    }
    delay_worker::store::stream::ensure_group(&mut con, keys).unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg("c1")
        .arg("COUNT")
        .arg(1000)
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(&mut con)
        .unwrap();
    assert_eq!(books(&env).stream_pending, 300);
    let mut p = worker(
        &env,
        &[],
        &[
            ("LD_PRELOAD", FAKETIME),
            ("FAKETIME", "+120s"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    wait_until(WAIT, "every job held back in the pool", || {
        let b = books(&env);
        b.pool == 300 && b.stream_pending == 0
    });
    let now = redis_ms(&mut con);
    let due: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&keys.pool)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query(&mut con)
        .unwrap();
    let latest = due.iter().map(|(_, s)| *s as i64).max().unwrap();
    assert!(
        latest <= now + 10_000,
        "a held job is due {:.1} s from now on Redis's clock (a hold is 5 s)",
        (latest - now) as f64 / 1000.0
    );
    rename("cancel_reason_deployed", "cancel_reason");
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 300);
    let late: i64 = env
        .db
        .client()
        .query_one("SELECT max(late_ms) FROM worker_inbox", &[])
        .unwrap()
        .get(0);
    assert!(late < 60_000, "a job ran {late} ms late on Redis's clock");
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    let all: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &all);
}

#[test]
fn the_move_is_decided_on_redis_s_clock() {
    use delay_worker::config::MoverConfig;
    use delay_worker::mover::Mover;
    use delay_worker::stats::Stats;
    use delay_worker::store::At;
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now = redis_ms(&mut con);
    for (key, due) in [("due", now - 1), ("later", now + 60_000)] {
        let msg = r#"{"event":"e","payload":{},"retry":0,"ts":0}"#;
        delay_worker::store::push(&mut con, &keys, key, msg, due).unwrap();
    }
    let stats = Stats::default();
    let cfg = MoverConfig::default();
    let mover = Mover::new(&keys, &cfg, &stats);
    // The host's clock says nothing: an injected clock 120 s ahead would move both,
    let (report, _) = mover.tick(&mut con, At::Server).unwrap();
    assert_eq!(report.moved, 1, "only the member due on Redis's clock");
    assert!((report.now_ms - now).abs() < 5_000, "{}", report.now_ms);
    assert_eq!(report.next_due_ms, Some(now + 60_000));
    // ... as the tests' injected clock shows.
    let (report, _) = mover.tick(&mut con, now + 120_000).unwrap();
    assert_eq!((report.moved, report.now_ms), (1, now + 120_000));
}

#[test]
fn an_evicting_redis_is_refused_at_start_and_runs_only_when_allowed() {
    let env = Env::new();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query::<()>(&mut env.con())
        .unwrap();
    let out = run_worker(&["--threads", "2"], &env.config.redis_url, &env.db.url);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("maxmemory-policy is allkeys-lru") && err.contains("--allow-eviction"),
        "{err}"
    );
    // With the flag it runs, says so loudly, and its health stays green but for a warning.
    let orders = seed_orders(&env.db, 20);
    push_on_redis_clock(&env, &orders, 0);
    let mut p = worker(&env, &["--allow-eviction"], &[]);
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 20);
    assert!(
        p.log()
            .contains("--allow-eviction: running although maxmemory-policy is allkeys-lru"),
        "{}",
        p.log()
    );
    wait_until(WAIT, "stats --check to warn", || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        // Its own reading of INFO memory: CRITICAL; the worker's record: a warning.
        text(&out.stdout).contains("redis maxmemory-policy allkeys-lru")
            && text(&out.stdout).contains("worker c1: redis:")
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_all_accounted(&env, &env.db, 20);
}

#[test]
fn a_policy_changed_at_runtime_turns_health_red_and_memory_near_full_warns() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 60);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut p = worker(&env, &["--metrics-addr", &addr], &[]);
    push_on_redis_clock(&env, &orders[..30], 0);
    wait_until(WAIT, "the first jobs", || inbox_count(&env.db) == 30);
    wait_until(WAIT, "healthz green", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    let mut con = env.con();
    let set = config_set;
    set(&mut con, "maxmemory-policy", "allkeys-lru");
    wait_until(WAIT, "healthz 503 naming the policy", || {
        http_get(port, "/healthz")
            .is_ok_and(|(c, _, b)| c == 503 && b.contains("maxmemory-policy is allkeys-lru"))
    });
    // The worker's record (refreshed every --block) names it; Redis's own INFO too.
    wait_until(
        WAIT,
        "stats --check CRITICAL naming the worker's problem",
        || {
            let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
            let line = text(&out.stdout);
            out.status.code() == Some(2)
                && line.contains("worker c1: redis: maxmemory-policy is allkeys-lru")
        },
    );
    // Jobs go on meanwhile: the watchdog is not withheld for what a restart cannot fix.
    push_on_redis_clock(&env, &orders[30..45], 0);
    wait_until(WAIT, "jobs while red", || inbox_count(&env.db) == 45);
    set(&mut con, "maxmemory-policy", "noeviction");
    wait_until(WAIT, "healthz green again", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    // Memory near maxmemory: a warning, not a failure.
    let used = info_field(&mut con, "used_memory");
    set(&mut con, "maxmemory", &(used + used / 20).to_string());
    wait_until(WAIT, "stats --check to warn of memory", || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        out.status.code() == Some(1) && text(&out.stdout).contains("redis memory")
    });
    set(&mut con, "maxmemory", "0");
    push_on_redis_clock(&env, &orders[45..], 0);
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 60);
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_all_accounted(&env, &env.db, 60);
    assert_eq!(books(&env).dead, 0);
}

/// Found from outside: a Redis without persistence, restarted, lost every scheduled job,
/// and nothing had said it would. A start on a Redis that writes no append-only file says
/// so, once, in one warning; on one that does, nothing.
#[test]
fn a_start_on_a_redis_without_an_append_only_file_warns_once() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 4);
    // A run that does two jobs: its log.
    let run = |env: &Env, orders: &[SeedOrder], done: i64| {
        push_on_redis_clock(env, orders, 0);
        let mut p = worker(env, &[], &[]);
        wait_until(WAIT, "the jobs done", || inbox_count(&env.db) == done);
        p.signal(libc::SIGTERM);
        assert!(p.wait(WAIT).success(), "{}", p.log());
        p.log()
    };
    let log = run(&env, &orders[..2], 2);
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("appendonly is off"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(
        said[0].contains("WARN") && said[0].contains("appendfsync always"),
        "{log}"
    );
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("appendonly")
        .arg("yes")
        .query::<()>(&mut env.con())
        .unwrap();
    let log = run(&env, &orders[2..], 4);
    assert!(!log.contains("appendonly is off"), "{log}");
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}

/// Found from outside: an evicting policy set at runtime evicted the whole pool (its data
/// and the stream too), then set back to `noeviction`: every check went green, and the
/// jobs were gone without a trace. Keys evicted under a policy that reaches the worker's
/// keys are critical until the count is reset (`CONFIG RESETSTAT`), in the running worker
/// and in one started after the fact, and `stats --check` says so on its own.
#[test]
fn keys_evicted_under_an_allkeys_policy_stay_critical_until_the_count_is_reset() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 40);
    let (lost, later) = orders.split_at(20);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut p = worker(&env, &["--metrics-addr", &addr], &[]);
    wait_until(WAIT, "healthz green", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    push_on_redis_clock(&env, lost, 60 * 60_000);
    let mut con = env.con();
    let cfg = config_set;
    let used = info_field(&mut con, "used_memory");
    cfg(&mut con, "maxmemory", &(used + 300_000).to_string());
    cfg(&mut con, "maxmemory-policy", "allkeys-random");
    let filler = "x".repeat(60_000);
    let pool = env.config.keys.pool.clone();
    for i in 0.. {
        let left: i64 = redis::cmd("EXISTS").arg(&pool).query(&mut con).unwrap();
        if left == 0 {
            break;
        }
        assert!(i < 20_000, "Redis never evicted the pool");
        redis::cmd("SET")
            .arg(format!("cache:{i}"))
            .arg(&filler)
            .query::<()>(&mut con)
            .unwrap();
    }
    cfg(&mut con, "maxmemory-policy", "noeviction");
    cfg(&mut con, "maxmemory", "0");
    let said_evicted = |b: &str| b.contains("Redis evicted") && b.contains("CONFIG RESETSTAT");
    wait_until(WAIT, "healthz red naming the evictions", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, b)| c == 503 && said_evicted(&b))
    });
    let check = || run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
    let out = check();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(said_evicted(&text(&out.stdout)), "{}", text(&out.stdout));
    // It stays red with the policy mended, and in a worker started after the fact.
    std::thread::sleep(Duration::from_secs(3));
    assert!(http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 503));
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    let mut p = worker(&env, &["--metrics-addr", &addr], &[]);
    wait_until(WAIT, "a new worker red from its start", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, b)| c == 503 && said_evicted(&b))
    });
    // Jobs go on meanwhile.
    push_on_redis_clock(&env, later, 0);
    wait_until(WAIT, "the later jobs done", || inbox_count(&env.db) == 20);
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "healthz green once the count is reset", || {
        http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200)
    });
    let out = check();
    assert!(!said_evicted(&text(&out.stdout)), "{}", text(&out.stdout));
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    // The evicted jobs' orders are untouched (nothing done early or twice); the later
    // ones cancelled once.
    assert_accounting(&env.db, &orders, &later.iter().collect::<Vec<_>>());
}

/// Fills Redis past `maxmemory` (the used memory plus 300 KB) under `policy` until at
/// least one key is evicted, then sets `after` and lifts the limit: one pipeline, well
/// inside one of the worker's looks.
fn evict_between_looks(con: &mut redis::Connection, policy: &str, after: &str, ttl: bool) {
    let used = info_field(con, "used_memory");
    let filler = "x".repeat(100_000);
    let mut p = redis::pipe();
    p.cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used + 300_000)
        .ignore();
    p.cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .ignore();
    for i in 0..12 {
        let c = p.cmd("SET").arg(format!("filler:{i}")).arg(&filler);
        if ttl {
            c.arg("EX").arg(3600);
        }
        c.ignore();
    }
    p.cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(after)
        .ignore();
    p.cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).ignore();
    let before = evicted_keys(con);
    // A SET refused (OOM) does not stop the pipeline: the last two commands run.
    let _ = p.query::<()>(con);
    assert!(evicted_keys(con) > before, "Redis evicted nothing");
}

fn evicted_keys(con: &mut redis::Connection) -> u64 {
    info_field(con, "evicted_keys")
}

/// `CONFIG SET name value`.
fn config_set(con: &mut redis::Connection, name: &str, value: &str) {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query::<()>(con)
        .unwrap()
}

/// A number of `INFO` (all sections).
fn info_field(con: &mut redis::Connection, name: &str) -> u64 {
    let info: String = redis::cmd("INFO").query(con).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Found from outside, in the running workers: an `allkeys-*` policy set and taken back
/// (to `volatile-lru`) between two of the worker's looks left it green, a Redis restart
/// turned it green again, a worker run with `--allow-eviction` stayed green, and keys
/// evicted under `volatile-lru` (only keys with a TTL) turned it red once the policy went
/// back to `noeviction`. Keys that go between two looks count unless the policy was
/// `volatile-*` at both; `--allow-eviction` changes nothing to that; a Redis restart does
/// not clear them, `CONFIG RESETSTAT` does.
#[test]
fn evictions_between_two_looks_are_told_by_the_running_worker_whatever_follows() {
    let mut env = Env::new();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let red = |port: u16| {
        http_get(port, "/healthz").is_ok_and(|(c, _, b)| c == 503 && b.contains("Redis evicted"))
    };
    let green = |port: u16| http_get(port, "/healthz").is_ok_and(|(c, _, _)| c == 200);
    let mut p = worker(&env, &["--metrics-addr", &addr, "--allow-eviction"], &[]);
    wait_until(WAIT, "healthz green", || green(port));
    // Only keys with a TTL evicted, under volatile-lru throughout (seen by a look before
    // and after): nothing of the worker's; the policy then back to noeviction.
    let mut con = env.con();
    let policy = |con: &mut redis::Connection, v: &str| config_set(con, "maxmemory-policy", v);
    policy(&mut con, "volatile-lru");
    std::thread::sleep(Duration::from_millis(2_500));
    evict_between_looks(&mut con, "volatile-lru", "volatile-lru", true);
    std::thread::sleep(Duration::from_millis(2_500));
    policy(&mut con, "noeviction");
    std::thread::sleep(Duration::from_millis(2_500));
    assert!(
        green(port),
        "keys with a TTL evicted under volatile-lru are no loss"
    );
    // allkeys-random and back to volatile-lru within one look: red, --allow-eviction or not.
    evict_between_looks(&mut con, "allkeys-random", "volatile-lru", false);
    wait_until(WAIT, "healthz red naming the evictions", || red(port));
    // A Redis restart resets its count, not what this worker saw.
    drop(con);
    env.redis.restart();
    std::thread::sleep(Duration::from_millis(3_000));
    assert!(
        red(port),
        "a Redis restart does not clear the evictions seen"
    );
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    // A worker started now sees a count of 0: the restart took it.
    let mut p = worker(&env, &["--metrics-addr", &addr], &[]);
    wait_until(WAIT, "a new worker green", || green(port));
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
}

#[test]
fn data_that_vanished_is_lost_data_with_its_key_and_due_time() {
    // A Redis that evicts only keys with a TTL (the worker's keys have none, so it runs),
    // made to evict: then the data hash vanishes, as an allkeys policy would make it.
    let env = Env::new();
    let mut con = env.con();
    let cfg = config_set;
    cfg(&mut con, "maxmemory-policy", "volatile-lru");
    let orders = seed_orders(&env.db, 12);
    let (lost, kept) = orders.split_at(5);
    push_on_redis_clock(&env, lost, 500);
    let info = info_field;
    let used = info(&mut con, "used_memory");
    cfg(&mut con, "maxmemory", &(used + 400_000).to_string());
    let filler = "x".repeat(20_000);
    for i in 0.. {
        if info(&mut con, "evicted_keys") > 0 {
            break;
        }
        assert!(i < 10_000, "Redis never evicted");
        redis::cmd("SET")
            .arg(format!("cache:{i}"))
            .arg(&filler)
            .arg("EX")
            .arg(3600)
            .query::<()>(&mut con)
            .unwrap();
    }
    cfg(&mut con, "maxmemory", "0");
    redis::cmd("DEL")
        .arg(&env.config.keys.data)
        .query::<()>(&mut con)
        .unwrap();
    let mut p = worker(&env, &["--orphan-grace", "1s"], &[]);
    wait_until(WAIT, "the lost members dead-lettered", || {
        books(&env).dead == 5
    });
    push_on_redis_clock(&env, kept, 0);
    wait_until(WAIT, "the other jobs done", || inbox_count(&env.db) == 7);
    for l in dead_letters(&env) {
        let reason = &l["reason"];
        assert!(
            reason.starts_with("lost data: the message due at "),
            "{reason}"
        );
        assert!(l["key"].starts_with("order.timeout:"), "{l:?}");
    }
    wait_until(WAIT, "the lost data logged", || {
        p.log().contains("lost their data")
    });
    let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
    let line = text(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{line}");
    assert!(line.contains("lost data 5"), "{line}");
    // The worker's record names it too, from its next heartbeat on.
    wait_until(WAIT, "stats --check naming the worker's problem", || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        text(&out.stdout).contains("worker c1: mover (lost data)")
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    // The kept orders cancelled once, the lost ones untouched (their jobs are dead letters).
    assert_accounting(&env.db, &orders, &kept.iter().collect::<Vec<_>>());
    assert_all_accounted(&env, &env.db, 12);
}

#[test]
fn signals_of_a_legacy_host_never_kill_the_daemon_silently() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 31);
    let mut p = worker(&env, &[], &[]);
    wait_until(WAIT, "the daemon started", || p.log().contains("starting:"));
    push_on_redis_clock(&env, &orders[..10], 0);
    wait_until(WAIT, "the first jobs", || inbox_count(&env.db) == 10);
    // A producer whose clock runs 120 s ahead: its message's ts is later than its arrival.
    let mut con = env.con();
    let now = redis_ms(&mut con);
    let job = delay_worker::producer::NewJob {
        event: "order.timeout".into(),
        payload: serde_json::json!({ "order_no": orders[30].order_no }),
        due_ms: now,
        key: Some(format!("order.timeout:{}", orders[30].order_no)),
    };
    delay_worker::producer::push(&mut con, &env.config.keys, &job, now + 120_000).unwrap();
    wait_until(WAIT, "the producer's job", || inbox_count(&env.db) == 11);
    wait_until(WAIT, "the producer's clock in the log", || {
        p.log().contains("a producer's clock runs ahead")
    });

    p.signal(libc::SIGHUP);
    wait_until(WAIT, "the reload logged", || {
        p.log()
            .contains("SIGHUP: no --handlers-dir, nothing to reload")
    });
    p.signal(libc::SIGUSR1);
    wait_until(WAIT, "the state report", || {
        let log = p.log();
        log.contains("state: reader last step")
            && log.contains("state: clock offset to Redis")
            && log.contains("producers seen ahead: 1 message(s), largest lead 1")
            && log.contains("state: counters moved=11")
    });
    p.signal(libc::SIGUSR2);
    wait_until(WAIT, "SIGUSR2 logged", || {
        p.log().contains("SIGUSR2 received: ignored")
    });
    // Still running: the next jobs are done.
    assert!(p.child.try_wait().unwrap().is_none(), "{}", p.log());
    push_on_redis_clock(&env, &orders[10..30], 0);
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 31);
    // SIGQUIT: a graceful stop, as SIGTERM.
    p.signal(libc::SIGQUIT);
    let status = p.wait(WAIT);
    assert!(status.success(), "{status:?}: {}", p.log());
    assert!(p
        .log()
        .contains("SIGQUIT received: finishing the jobs in hand"));
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_all_accounted(&env, &env.db, 31);
}
