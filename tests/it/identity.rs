//! Job identity end to end: a job is what its producer wrote (the pool, the member, its
//! score, its data), so a move undone by a Redis restart that lost it and done again is
//! the same job, and each job's effect happens once even with a handler that is not
//! idempotent by itself; a key pushed again within a second with other data or another due
//! time is a new job; a retry, a held job and a requeued dead letter keep their identity;
//! messages stamped and inbox rows written by workers older than the identity are each
//! done once. And what each inbox row records besides: outcome, lateness, consumer. (The
//! failover to a replica that missed the moves is in sentinel.rs.)

use crate::support::*;
use delay_worker::keys::Keys;
use redis::Connection;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// A `--handlers-dir` handler that is not idempotent by itself: every run of `ledger.add`
/// inserts a row into `runs` (so the rows count the runs). A note `flaky:<how>` fails its
/// first run: `retry` with a serialization failure (contention: a retry), `held` with an
/// undefined column (a schema fault: held), `dead` with the handler's own `RAISE` (a dead
/// letter). Sequences count the runs, as a failed transaction does not undo them.
pub fn ledger(db: &TestDb) -> HandlerDir {
    db.client()
        .batch_execute(
            "CREATE TABLE runs (id bigserial PRIMARY KEY, note text NOT NULL);
             CREATE SEQUENCE flaky_retry; CREATE SEQUENCE flaky_held; CREATE SEQUENCE flaky_dead;
             CREATE FUNCTION flaky(note text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
             BEGIN
               IF note = 'flaky:retry' AND nextval('flaky_retry') = 1 THEN
                 RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001';
               ELSIF note = 'flaky:held' AND nextval('flaky_held') = 1 THEN
                 RAISE EXCEPTION 'injected missing column' USING ERRCODE = '42703';
               -- Refused at its first look and at its second (SECOND_LOOK): a dead letter.
               ELSIF note = 'flaky:dead' AND nextval('flaky_dead') <= 2 THEN
                 RAISE EXCEPTION 'injected refusal';
               END IF;
               RETURN true;
             END $$;",
        )
        .unwrap();
    HandlerDir::new(&[(
        "ledger.add.sql",
        "-- event: ledger.add\n-- requires: note\n\
         INSERT INTO runs (note) SELECT $1 ->> 'note' WHERE flaky($1 ->> 'note')\n"
            .to_string(),
    )])
}

/// A `ledger.add` message as the PHP producer writes it.
pub fn ledger_msg(note: &str, ts: i64) -> String {
    format!(r#"{{"event":"ledger.add","payload":{{"note":"{note}"}},"retry":0,"ts":{ts}}}"#)
}

/// The PHP producer's push: HSET, then ZADD.
pub fn php_push(con: &mut Connection, keys: &Keys, key: &str, msg: &str, score: i64) {
    redis::cmd("HSET")
        .arg(&keys.data)
        .arg(key)
        .arg(msg)
        .query::<()>(con)
        .unwrap();
    redis::cmd("ZADD")
        .arg(&keys.pool)
        .arg(score)
        .arg(key)
        .query::<()>(con)
        .unwrap();
}

/// How often each note's `ledger.add` ran.
pub fn runs(db: &TestDb) -> HashMap<String, i64> {
    db.client()
        .query("SELECT note, count(*) FROM runs GROUP BY note", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The `job_id` stamps of the stream's entries of each job key, in stream order.
pub fn stamps(con: &mut Connection, keys: &Keys) -> HashMap<String, Vec<String>> {
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for (_, f) in entries {
        let stamp = delay_worker::message::stamp_of(f["msg"].as_bytes()).unwrap_or_default();
        out.entry(f["key"].clone()).or_default().push(stamp);
    }
    out
}

/// Each job key's inbox rows: (job_id, outcome, late_ms, consumer).
type Row = (String, Option<String>, Option<i64>, Option<String>);

pub fn inbox_rows(db: &TestDb) -> HashMap<String, Vec<Row>> {
    let mut out: HashMap<String, Vec<Row>> = HashMap::new();
    for r in db
        .client()
        .query(
            "SELECT job_key, job_id, outcome, late_ms, consumer FROM worker_inbox",
            &[],
        )
        .unwrap()
    {
        out.entry(r.get(0))
            .or_default()
            .push((r.get(1), r.get(2), r.get(3), r.get(4)));
    }
    out
}

/// Whether `id` is the mover's identity form, `<due µs>-<a>-<b>`.
fn is_identity(id: &str) -> bool {
    let parts: Vec<&str> = id.split('-').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

fn xlen(con: &mut Connection, key: &str) -> usize {
    redis::cmd("XLEN").arg(key).query(con).unwrap()
}

/// Nothing scheduled, pending or unread, and `done`.
fn wait_settled(env: &Env, what: &str, mut done: impl FnMut() -> bool) {
    let k = &env.config.keys;
    wait_until(WAIT, what, || {
        let mut con = env.con();
        let b = books_on(&mut con, k);
        let lag: i64 = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&k.stream)
            .query::<Vec<HashMap<String, redis::Value>>>(&mut con)
            .ok()
            .and_then(|g| g.first().and_then(|g| g.get("lag").cloned()))
            .and_then(|v| redis::from_redis_value(v).ok())
            .unwrap_or(-1);
        b.pool == 0 && b.stream_pending == 0 && lag == 0 && done()
    });
}

#[test]
fn a_move_undone_by_a_redis_restart_that_lost_it_runs_each_job_once() {
    let mut env = Env::new();
    let dir = ledger(&env.db);
    env.config.handlers_dir = Some(dir.0.clone());
    let orders = seed_orders(&env.db, 20);
    let k = env.config.keys.clone();
    let mut con = env.con();
    let now = delay_worker::now_ms();
    for i in 0..30 {
        let msg = ledger_msg(&format!("n{i}"), now / 1000);
        php_push(&mut con, &k, &format!("ledger:{i}"), &msg, now - 1000);
    }
    push_timeouts(&env, &orders, -1000);
    // What a Redis that restarts having lost its last writes (an AOF under `appendfsync
    // everysec` whose last second never reached the disk) comes back with: a copy from
    // before anything moved.
    let dir_of: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("dir")
        .query(&mut con)
        .unwrap();
    let data_dir = std::path::PathBuf::from(&dir_of[1]);
    redis::cmd("SAVE").query::<()>(&mut con).unwrap();
    std::fs::copy(data_dir.join("dump.rdb"), data_dir.join("before.rdb")).unwrap();
    drop(con);

    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job done once", || {
        inbox_count(&env.db) == 50 && runs(&env.db).values().sum::<i64>() == 30
    });
    let first = inbox_rows(&env.db);
    env.redis.kill();
    std::fs::copy(data_dir.join("before.rdb"), data_dir.join("dump.rdb")).unwrap();
    env.redis.restart();
    // Every member is back in the pool (the stream and its group are not): the worker
    // reconnects, re-creates the group and moves each job again.
    wait_settled(&env, "every job moved again", || {
        xlen(&mut env.con(), &k.stream) == 50
    });
    let report = daemon.stop();

    // Moved again as the same jobs: each new entry carries the id its first run's inbox
    // row has, and each second run was a duplicate.
    let again = stamps(&mut env.con(), &k);
    assert_eq!(again.len(), 50);
    for (key, ids) in &again {
        assert_eq!(ids.len(), 1, "{key}: {ids:?}");
        assert!(is_identity(&ids[0]), "{key}: {ids:?}");
        assert_eq!(first[key].len(), 1, "{key}");
        assert_eq!(
            first[key][0].0, ids[0],
            "{key}: moved again as the same job"
        );
    }
    assert_eq!(report.stats.duplicate, 50, "{:?}", report.stats);
    assert_eq!(
        report.stats.done + report.stats.noop,
        50,
        "{:?}",
        report.stats
    );
    let runs = runs(&env.db);
    assert_eq!(runs.len(), 30);
    assert!(
        runs.values().all(|&n| n == 1),
        "each ledger job ran once: {runs:?}"
    );
    assert_eq!(inbox_rows(&env.db), first, "no inbox row added or changed");
    let all: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &all);
    assert_all_accounted(&env, &env.db, 50);
}

#[test]
fn a_key_pushed_again_within_a_second_with_other_data_or_another_due_time_is_a_new_job() {
    let mut env = Env::new();
    let dir = ledger(&env.db);
    env.config.handlers_dir = Some(dir.0.clone());
    let k = env.config.keys.clone();
    let mut con = env.con();
    let daemon = Daemon::start(&env.config);
    // The PHP producer within one second: `ts` and the due time in whole seconds, so the
    // pushes share their `ts` and (but for the second due time) their score.
    let s = delay_worker::now_ms() / 1000 - 5;
    let pushes = [
        ("again:data", "data-1", s),
        ("again:data", "data-2", s),
        ("again:due", "due", s),
        ("again:due", "due", s - 1),
        // The same data and due time again: the same job (nothing tells it from its move
        // undone and done again), its second run a duplicate.
        ("again:same", "same", s),
        ("again:same", "same", s),
    ];
    for (n, (key, note, score)) in pushes.iter().enumerate() {
        php_push(&mut con, &k, key, &ledger_msg(note, s), *score);
        wait_settled(&env, "the push to run", || {
            xlen(&mut env.con(), &k.stream) == n + 1
        });
    }
    let report = daemon.stop();
    assert_eq!(report.stats.duplicate, 1, "{:?}", report.stats);
    assert_eq!(report.stats.done, 5, "{:?}", report.stats);
    let runs = runs(&env.db);
    let want: HashMap<String, i64> = [("data-1", 1), ("data-2", 1), ("due", 2), ("same", 1)]
        .into_iter()
        .map(|(n, c)| (n.to_string(), c))
        .collect();
    assert_eq!(runs, want);
    let rows = inbox_rows(&env.db);
    for (key, jobs) in [("again:data", 2), ("again:due", 2), ("again:same", 1)] {
        let ids: std::collections::HashSet<&String> = rows[key].iter().map(|r| &r.0).collect();
        assert_eq!(ids.len(), jobs, "{key}: {rows:?}");
        assert!(ids.iter().all(|id| is_identity(id)), "{rows:?}");
    }
    let stamps = stamps(&mut con, &k);
    assert_eq!(stamps["again:same"][0], stamps["again:same"][1]);
    assert_all_accounted(&env, &env.db, 5);
}

#[test]
fn a_retry_a_held_job_and_a_requeued_dead_letter_keep_their_identity() {
    let mut env = Env::new();
    let dir = ledger(&env.db);
    env.config.handlers_dir = Some(dir.0.clone());
    // The refusal a dead letter at its second look, proven by the others' changes.
    env.config.jobs.refusal_grace = Duration::ZERO;
    let k = env.config.keys.clone();
    let mut con = env.con();
    let now = delay_worker::now_ms();
    let notes = ["flaky:retry", "flaky:held", "flaky:dead", "plain"];
    for note in notes {
        php_push(&mut con, &k, note, &ledger_msg(note, now / 1000), now - 100);
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the dead letter", || books(&env).dead == 1);
    let out = run_worker(
        &["dead", "requeue", "--event", "ledger.add"],
        &env.redis.url(),
        &env.db.url,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "requeued 1");
    // The held job comes back after SCHEMA_HOLD (5 s).
    wait_settled(&env, "every job done", || {
        runs(&env.db).len() == notes.len() && books(&env).dead == 0
    });
    let report = daemon.stop();
    assert!(report.stats.retried >= 1, "{:?}", report.stats);
    assert!(report.stats.held >= 1, "{:?}", report.stats);
    assert_eq!((report.stats.dead, report.stats.duplicate), (1, 0));

    let runs = runs(&env.db);
    assert!(runs.values().all(|&n| n == 1), "each ran once: {runs:?}");
    let stamps = stamps(&mut con, &k);
    let rows = inbox_rows(&env.db);
    for note in notes {
        let ids = &stamps[note];
        // The dead letter's job: its first look, its second look, its requeue.
        let moves = match note {
            "plain" => 1,
            "flaky:dead" => 3,
            _ => 2,
        };
        assert_eq!(ids.len(), moves, "{note}: {ids:?}");
        assert!(is_identity(&ids[0]), "{note}: {ids:?}");
        assert!(
            ids.iter().all(|id| id == &ids[0]),
            "{note}: one identity: {ids:?}"
        );
        assert_eq!(rows[note].len(), 1, "{note}: {rows:?}");
        assert_eq!(&rows[note][0].0, &ids[0], "{note}: its inbox row");
    }
    assert_all_accounted(&env, &env.db, notes.len());
}

#[test]
fn messages_and_inbox_rows_of_workers_older_than_the_identity_are_each_done_once() {
    let mut env = Env::new();
    let dir = ledger(&env.db);
    env.config.handlers_dir = Some(dir.0.clone());
    let k = env.config.keys.clone();
    let mut con = env.con();
    delay_worker::store::stream::ensure_group(&mut con, &k).unwrap();
    let now = delay_worker::now_ms();
    let ts = now / 1000 - 60;
    let stamped = |id: &str, note: &str, retry: u32| {
        format!(
            r#"{{"job_id":"{id}","event":"ledger.add","payload":{{"note":"{note}"}},"retry":{retry},"ts":{ts}}}"#
        )
    };
    // Inbox rows as an older worker wrote them: the key columns only.
    let old_row = |key: &str, id: &str| {
        env.db
            .client()
            .execute(
                "INSERT INTO worker_inbox (job_key, enqueued_at, event, job_id) VALUES ($1, $2, 'ledger.add', $3)",
                &[&key, &ts, &id],
            )
            .unwrap();
    };
    let xadd_entry = |con: &mut Connection, stream: &str, fields: &[(&str, &str)]| {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(stream).arg("*");
        for (f, v) in fields {
            cmd.arg(*f).arg(*v);
        }
        cmd.query::<String>(con).unwrap();
    };
    let due = (now - 1000).to_string();
    // Moved by an older mover (its stamp from the move's time), in the stream: one whose
    // job an older worker committed before it died unacknowledged, one not run yet.
    for (key, id, ran) in [
        ("old:entry:ran", "1796040000123456-0", true),
        ("old:entry:new", "1796040000123456-1", false),
    ] {
        let msg = stamped(id, key, 0);
        xadd_entry(
            &mut con,
            &k.stream,
            &[("msg", &msg), ("key", key), ("due", &due)],
        );
        if ran {
            old_row(key, id);
        }
    }
    // Written straight into the stream (no stamp): its identity is its key and `ts`.
    let bare = format!(
        r#"{{"event":"ledger.add","payload":{{"note":"old:bare:ran"}},"retry":0,"ts":{ts}}}"#
    );
    xadd_entry(
        &mut con,
        &k.stream,
        &[("msg", &bare), ("key", "old:bare:ran")],
    );
    old_row("old:bare:ran", "");
    // Retries an older worker wrote back to the pool, with its record of the job id: one
    // re-queued because its commit could not be confirmed durable (it had committed), one
    // of a job that had not.
    for (key, id, ran) in [
        ("old:retry:ran", "1796040000200000-3", true),
        ("old:retry:new", "1796040000200000-4", false),
    ] {
        let msg = stamped(id, key, 1);
        php_push(&mut con, &k, key, &msg, now - 500);
        redis::cmd("HSET")
            .arg(&k.jobs)
            .arg(key)
            .arg(format!("{id} {}", sha1_hex(msg.as_bytes())))
            .query::<()>(&mut con)
            .unwrap();
        if ran {
            old_row(key, id);
        }
    }
    // Dead letters of jobs an older mover stamped, requeued after the upgrade: one whose
    // job had committed (delivered too often, its consumer dying between commit and ack),
    // one that never ran.
    for (key, id, ran) in [
        ("old:dead:ran", "1796040000300000-5", true),
        ("old:dead:new", "1796040000300000-6", false),
    ] {
        let msg = stamped(id, key, 2);
        xadd_entry(
            &mut con,
            &k.dead,
            &[
                ("msg", &msg),
                ("reason", "delivered too often"),
                ("ts", &ts.to_string()),
                ("event", "ledger.add"),
                ("key", key),
                ("attempts", "3"),
                ("consumer", "old"),
            ],
        );
        if ran {
            old_row(key, id);
        }
    }
    // No worker runs yet to say it serves ledger.add: the handler files say it.
    let out = run_worker(
        &["dead", "requeue", "--handlers-dir", dir.0.to_str().unwrap()],
        &env.redis.url(),
        &env.db.url,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "requeued 2");

    let daemon = Daemon::start(&env.config);
    wait_settled(&env, "every job settled", || inbox_count(&env.db) == 7);
    let report = daemon.stop();
    assert_eq!(
        (report.stats.done, report.stats.duplicate),
        (3, 4),
        "{:?}",
        report.stats
    );
    let runs = runs(&env.db);
    let want: HashMap<String, i64> = ["old:entry:new", "old:retry:new", "old:dead:new"]
        .into_iter()
        .map(|n| (n.to_string(), 1))
        .collect();
    assert_eq!(
        runs, want,
        "each not yet run ran once, none that had ran again"
    );
    let rows = inbox_rows(&env.db);
    assert_eq!(rows.len(), 7);
    for (key, id) in [
        ("old:entry:new", "1796040000123456-1"),
        ("old:retry:new", "1796040000200000-4"),
        ("old:dead:new", "1796040000300000-6"),
    ] {
        assert_eq!(rows[key].len(), 1, "{key}: {rows:?}");
        assert_eq!(rows[key][0].0, id, "{key}: the old stamp is its identity");
        assert_eq!(rows[key][0].1.as_deref(), Some("done"));
    }
    for key in [
        "old:entry:ran",
        "old:bare:ran",
        "old:retry:ran",
        "old:dead:ran",
    ] {
        assert_eq!(rows[key].len(), 1, "{key}: {rows:?}");
        assert_eq!(rows[key][0].1, None, "{key}: the old row, as it was");
    }
    assert_all_accounted(&env, &env.db, 7);
}

#[test]
fn each_inbox_row_records_its_outcome_lateness_and_consumer_alone_in_sets_and_in_batches() {
    let mut env = Env::new();
    let orders = seed_orders(&env.db, 90);
    let paid: Vec<SeedOrder> = orders.iter().step_by(3).cloned().collect();
    pay(&env.db, &paid);
    let default_set = env.config.jobs.set_size;
    // (set size, jobs per transaction): alone, in sets, several in one transaction.
    let ways = [(1, 1), (default_set, 1), (1, 4)];
    for (chunk, (set_size, tx_batch)) in orders.chunks(30).zip(ways) {
        env.config.jobs.set_size = set_size;
        env.config.jobs.tx_batch = tx_batch;
        // A backlog two seconds late: due before the worker starts, so sets form.
        push_timeouts(&env, chunk, -2000);
        let before = inbox_count(&env.db);
        let daemon = Daemon::start(&env.config);
        wait_settled(&env, "the chunk done", || {
            inbox_count(&env.db) == before + 30
        });
        let report = daemon.stop();
        assert_eq!(report.stats.in_sets > 0, set_size > 1, "{:?}", report.stats);
    }
    let rows = inbox_rows(&env.db);
    for o in &orders {
        let row = &rows[&format!("order.timeout:{}", o.order_no)];
        assert_eq!(row.len(), 1);
        let (_, outcome, late, consumer) = &row[0];
        let want = if paid.iter().any(|p| p.id == o.id) {
            "noop"
        } else {
            "done"
        };
        assert_eq!(outcome.as_deref(), Some(want), "{}", o.order_no);
        let late = late.expect("the lateness is recorded");
        assert!(
            (2000..60_000).contains(&late),
            "{}: late {late} ms",
            o.order_no
        );
        assert_eq!(consumer.as_deref(), Some("c1"));
    }
    let unpaid: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &unpaid);
    assert_all_accounted(&env, &env.db, 90);
}
