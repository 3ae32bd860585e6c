//! A `--handlers-dir` file whose table does not exist yet: `worker handlers check` names
//! it (exit 2) without starting anything; the daemon starts anyway, the built-in events
//! run, that event's jobs are held (not dead-lettered), `stats --check` is CRITICAL naming
//! the file and PostgreSQL's error, and all recovers once the table is there.

use crate::support::*;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn badge() -> String {
    "-- event: badge.award\n-- requires: user_id\n\
     INSERT INTO badge (user_id) VALUES (($1 ->> 'user_id')::bigint)"
        .to_string()
}

fn check(env: &Env, dir: &HandlerDir) -> (i32, String, String) {
    let out = check_on(env, dir, &env.db.url);
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

/// `worker handlers check --handlers-dir DIR` against the database at `db`.
fn check_on(env: &Env, dir: &HandlerDir, db: &str) -> std::process::Output {
    run_worker(
        &[
            "handlers",
            "check",
            "--handlers-dir",
            &dir.0.display().to_string(),
        ],
        &env.config.redis_url,
        db,
    )
}

#[test]
fn handlers_check_names_each_file_and_its_error() {
    let env = Env::new();
    let dir = HandlerDir::new(&[
        ("badge.sql", badge()),
        ("broken.sql", "-- event: x\nSELECT 1\n-- set:\n".into()),
        ("typo.sql", "-- event: typo\nSELEC 1".into()),
        (
            "points.sql",
            "-- event: points\nSELECT 1 WHERE ($1 ->> 'user_id') IS NOT NULL".into(),
        ),
    ]);
    let (code, out, err) = check(&env, &dir);
    assert_eq!(code, 2, "{out}{err}");
    let line = |name: &str| {
        out.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no line for {name}: {out}"))
            .to_string()
    };
    let b = line("badge.sql");
    assert!(b.starts_with("FAILED  badge.award"), "{b}");
    assert!(
        b.contains("relation \"badge\" does not exist (42P01)"),
        "{b}"
    );
    assert!(line("broken.sql").contains("does not parse: no SQL after the `-- set:` line"));
    assert!(line("typo.sql").contains("(42601)"), "{out}");
    assert!(line("points.sql").starts_with("ok      points"), "{out}");
    assert!(
        out.contains("3 of 4 handler files cannot run: 1 would stop the service at its start"),
        "{out}"
    );
    // Nothing was created or left behind by the check.
    let tables: i64 = env
        .db
        .client()
        .query_one("SELECT count(*) FROM pg_class WHERE relname = 'badge'", &[])
        .unwrap()
        .get(0);
    assert_eq!(tables, 0);

    // Once the table exists and the broken files are gone, every file is ok.
    env.db
        .client()
        .batch_execute("CREATE TABLE badge (user_id bigint)")
        .unwrap();
    std::fs::remove_file(dir.0.join("broken.sql")).unwrap();
    std::fs::remove_file(dir.0.join("typo.sql")).unwrap();
    let (code, out, err) = check(&env, &dir);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 handler files ok"), "{out}");

    // A directory that cannot be read is bad input (2), a PostgreSQL that cannot be
    // reached a runtime failure (1): one line each.
    let out = run_worker(
        &["handlers", "check", "--handlers-dir", "/no/such/dir"],
        &env.config.redis_url,
        &env.db.url,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).starts_with("worker: --handlers-dir: /no/such/dir: cannot read"));
    let dead_db = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let out = check_on(&env, &dir, &dead_db);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stderr).lines().count(),
        1,
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn handlers_check_reads_as_the_service_user_would() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let ok = "-- event: points\nSELECT 1 WHERE ($1 ->> 'user_id') IS NOT NULL".to_string();
    let dir = HandlerDir::new(&[
        ("ok.sql", ok.clone()),
        ("secret.sql", ok.replace("points", "secret")),
        ("noname.sql", "-- event:\nSELECT 1".into()),
    ]);
    let mode = |name: &str, m: u32| {
        std::fs::set_permissions(dir.0.join(name), std::fs::Permissions::from_mode(m)).unwrap()
    };
    mode("ok.sql", 0o644);
    mode("secret.sql", 0o600);
    // As the service's user (here `nobody`) would: the file written 0600 by root (who runs
    // this test) cannot be read by it, and the service would stop at it.
    let check_as = |user: &str| {
        let out = run_worker(
            &[
                "handlers",
                "check",
                "--handlers-dir",
                &dir.0.display().to_string(),
                "--service-user",
                user,
            ],
            &env.config.redis_url,
            &env.db.url,
        );
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    let (code, out, err) = check_as("nobody");
    assert_eq!(code, Some(2), "{out}{err}");
    let line = |out: &str, name: &str| {
        out.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no line for {name}: {out}"))
            .to_string()
    };
    let secret = line(&out, "secret.sql");
    assert!(
        secret.starts_with("FAILED  secret")
            && secret.contains("the service's user nobody cannot read")
            && secret.contains("(mode 0600, owner root)"),
        "{secret}"
    );
    assert!(line(&out, "ok.sql").starts_with("ok      points"), "{out}");
    // A header that names no event does not parse (before, it made a handler of "").
    assert!(
        line(&out, "noname.sql").contains("does not parse: the `-- event:` line names no event"),
        "{out}"
    );
    // The folder sits in /tmp, which the unit's PrivateTmp hides from the service.
    assert!(
        out.contains("note: under the unit's PrivateTmp=yes"),
        "{out}"
    );
    // No such user: not checked.
    std::fs::remove_file(dir.0.join("noname.sql")).unwrap();
    let (code, out, err) = check_as("no-such-user-here");
    assert_eq!(code, Some(0), "{out}{err}");
    // A folder the user may not list: the whole check is bad input, in one line.
    mode("secret.sql", 0o644);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    let (code, out, err) = check_as("nobody");
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(
        err.starts_with("worker: --handlers-dir: the service's user nobody cannot list")
            && err.contains("(mode 0700, owner root)"),
        "{err}"
    );
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, out, err) = check_as("nobody");
    assert_eq!(code, Some(0), "{out}{err}");
}

#[test]
fn a_handler_whose_table_is_missing_holds_its_jobs_and_the_rest_run() {
    let env = Env::new();
    let dir = HandlerDir::new(&[("badge.sql", badge())]);
    // `migrate` does not read the handlers: it works as ever.
    let out = run_worker(&["migrate"], &env.config.redis_url, &env.db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));

    let orders = seed_orders(&env.db, 3);
    push_timeouts(&env, &orders, 0);
    let now = delay_worker::now_ms();
    let mut con = env.con();
    for u in 0..4 {
        let job = delay_worker::producer::NewJob {
            event: "badge.award".into(),
            payload: serde_json::json!({ "user_id": u }),
            due_ms: now,
            key: Some(format!("badge.award:{u}")),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
    let mut w = Proc::start_logging(
        &env.config,
        &["--handlers-dir".to_string(), dir.0.display().to_string()],
        "info",
    );
    // The built-in event runs; the worker did not stop.
    wait_until(WAIT, "the order timeouts", || inbox_count(&env.db) == 3);
    assert!(w.child.try_wait().unwrap().is_none(), "{}", w.log());
    let stats_check = || {
        let out = run_worker(&["stats", "--check"], &env.config.redis_url, &env.db.url);
        (out.status.code().unwrap_or(-1), text(&out.stdout))
    };
    let mut last = String::new();
    wait_until(WAIT, "stats --check CRITICAL naming the file", || {
        let (code, out) = stats_check();
        last = out.clone();
        code == 2 && out.contains("badge.sql") && out.contains("42P01")
    });
    assert!(last.starts_with("CRITICAL"), "{last}");
    assert!(
        w.log()
            .contains("does not prepare, its jobs are held until it does"),
        "{}",
        w.log()
    );
    assert_eq!(books(&env).dead, 0, "held, not dead-lettered");

    // The table comes: the held jobs run, and the check is green again.
    env.db
        .client()
        .batch_execute("CREATE TABLE badge (user_id bigint)")
        .unwrap();
    wait_until(WAIT, "the badge jobs", || inbox_count(&env.db) == 7);
    wait_until(WAIT, "stats --check OK", || stats_check().0 == 0);
    let rows: i64 = env
        .db
        .client()
        .query_one("SELECT count(*) FROM badge", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 4);
    assert_eq!(books(&env).dead, 0);
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
}
