//! The inbox pruner: old rows go, newer rows and the rows of pending entries stay, one
//! process prunes at a time, and jobs keep their once-only effect while it runs.

use crate::support::*;
use delay_worker::config::Config;
use delay_worker::prune::{Pass, PassReport, Pruner, PRUNE_LOCK};
use delay_worker::stats::Stats;
use delay_worker::Shutdown;
use redis::Value;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const HOUR: i64 = 3600;

/// Inserts `n` inbox rows `job_key = <prefix><i>`, processed `age_s` seconds ago (the
/// i-th a millisecond later than the one before), in one statement.
fn fill(db: &TestDb, prefix: &str, n: i64, age_s: i64) {
    db.client()
        .execute(
            "INSERT INTO worker_inbox (job_key, job_id, enqueued_at, event, processed_at)
             SELECT $1 || i, '', i, 'order.timeout',
                    now() - make_interval(secs => $2) + i * interval '1 millisecond'
               FROM generate_series(1, $3::bigint) i",
            &[&prefix, &(age_s as f64), &n],
        )
        .unwrap();
}

/// Inbox rows whose key starts with `prefix`.
fn rows(db: &TestDb, prefix: &str) -> i64 {
    db.client()
        .query_one(
            "SELECT count(*) FROM worker_inbox WHERE starts_with(job_key, $1)",
            &[&prefix],
        )
        .unwrap()
        .get(0)
}

fn prune_config(env: &Env, retention_s: u64, batch: usize) -> Config {
    let mut c = env.config.clone();
    c.prune.retention = Duration::from_secs(retention_s);
    c.prune.batch = batch;
    c.prune.pause = Duration::from_millis(1);
    c.prune.interval = Duration::from_secs(60);
    c
}

fn done(p: Pass) -> PassReport {
    match p {
        Pass::Done(r) => r,
        Pass::Skipped => panic!("the pass was skipped: another pruner held the lock"),
    }
}

#[test]
fn rows_older_than_the_retention_go_and_a_pending_entry_holds_the_cutoff_back() {
    let env = Env::new();
    let config = prune_config(&env, 2 * HOUR as u64, 7);
    let (stats, redis) = (
        Stats::default(),
        delay_worker::store::Redis::from(redis::Client::open(env.redis.url()).unwrap()),
    );
    let pruner = Pruner::new(&config, &stats, &redis);
    let never = Shutdown::new();

    // No stream, no group yet: nothing is pending, the pass works.
    fill(&env.db, "old:", 40, 10 * 24 * HOUR);
    fill(&env.db, "older-than-2h:", 5, 3 * HOUR);
    fill(&env.db, "within-2h:", 5, HOUR);
    fill(&env.db, "new:", 5, 60);
    let r = done(pruner.pass(&never).unwrap());
    assert_eq!(r.rows, 45, "{r:?}");
    assert_eq!(r.batches, 7, "45 rows in batches of 7: six full, one short");
    assert!(r.complete && r.held_by_pending.is_none(), "{r:?}");
    assert_eq!(stats.inbox_pruned.load(Relaxed), 45);
    assert_eq!(
        (rows(&env.db, "old:"), rows(&env.db, "older-than-2h:")),
        (0, 0)
    );
    assert_eq!((rows(&env.db, "within-2h:"), rows(&env.db, "new:")), (5, 5));
    let r = done(pruner.pass(&never).unwrap());
    assert_eq!((r.rows, r.batches, r.complete), (0, 1, true));

    // An entry moved 6 h ago is still pending: its job may still arrive again, so rows
    // from before it (less a few minutes' margin) go, and younger ones stay however old.
    let keys = &env.config.keys;
    let mut con = env.con();
    delay_worker::store::stream::ensure_group(&mut con, keys).unwrap();
    let moved_ms = delay_worker::now_ms() - 6 * HOUR * 1000;
    let id: String = redis::cmd("XADD")
        .arg(&keys.stream)
        .arg(format!("{moved_ms}-0"))
        .arg("msg")
        .arg("{}")
        .arg("key")
        .arg("k")
        .query(&mut con)
        .unwrap();
    let _: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg("c1")
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(&mut con)
        .unwrap();
    fill(&env.db, "before-the-entry:", 10, 7 * HOUR);
    fill(&env.db, "after-the-entry:", 10, 5 * HOUR);
    let r = done(pruner.pass(&never).unwrap());
    assert_eq!(r.rows, 10, "{r:?}");
    let held = r
        .held_by_pending
        .expect("the pending entry held the cutoff");
    assert!(
        held >= Duration::from_secs(6 * HOUR as u64 - 60),
        "{held:?}"
    );
    assert_eq!(rows(&env.db, "before-the-entry:"), 0);
    assert_eq!(rows(&env.db, "after-the-entry:"), 10);

    // Acknowledged: the retention alone decides again.
    let _: i64 = redis::cmd("XACK")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg(&id)
        .query(&mut con)
        .unwrap();
    let r = done(pruner.pass(&never).unwrap());
    assert_eq!((r.rows, r.held_by_pending), (10, None), "{r:?}");
    assert_eq!(rows(&env.db, "after-the-entry:"), 0);
    assert_eq!((rows(&env.db, "within-2h:"), rows(&env.db, "new:")), (5, 5));
    assert_eq!(stats.inbox_pruned.load(Relaxed), 65);
}

#[test]
fn one_pruner_at_a_time() {
    let env = Env::new();
    let config = prune_config(&env, HOUR as u64, 50);
    let redis = delay_worker::store::Redis::from(redis::Client::open(env.redis.url()).unwrap());
    let never = Shutdown::new();
    fill(&env.db, "old:", 20_000, 2 * HOUR);

    // Another process holds the lock: the pass skips at once, deleting nothing.
    let mut other = env.db.client();
    other
        .execute("SELECT pg_advisory_lock($1)", &[&PRUNE_LOCK])
        .unwrap();
    let stats = Stats::default();
    let p = Pruner::new(&config, &stats, &redis).pass(&never).unwrap();
    assert!(matches!(p, Pass::Skipped), "{p:?}");
    assert_eq!(rows(&env.db, "old:"), 20_000);
    other
        .execute("SELECT pg_advisory_unlock($1)", &[&PRUNE_LOCK])
        .unwrap();

    // Two pruners (each with its own connection, as two processes) pass in a loop until
    // the old rows are gone: the spans in which each held the lock never overlap, and
    // every row is deleted exactly once between them.
    let stats = [Stats::default(), Stats::default()];
    let reports: Vec<PassReport> = std::thread::scope(|s| {
        let handles: Vec<_> = stats
            .iter()
            .map(|st| {
                let (config, redis, never, db) = (&config, &redis, &never, &env.db);
                s.spawn(move || {
                    let pruner = Pruner::new(config, st, redis);
                    let mut mine = Vec::new();
                    while rows(db, "old:") > 0 {
                        match pruner.pass(never).unwrap() {
                            Pass::Done(r) => mine.push(r),
                            Pass::Skipped => std::thread::sleep(Duration::from_millis(5)),
                        }
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mut spans: Vec<_> = reports
        .iter()
        .map(|r| (r.locked_at, r.unlocked_at))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "two pruners held the lock at once: {:?}",
            w
        );
    }
    let pruned: u64 = reports.iter().map(|r| r.rows).sum();
    assert_eq!(pruned, 20_000);
    assert_eq!(
        stats[0].inbox_pruned.load(Relaxed) + stats[1].inbox_pruned.load(Relaxed),
        20_000
    );
    assert_eq!(inbox_count(&env.db), 0);
}

/// The stream entries as (key, msg), oldest first.
fn entries(env: &Env) -> Vec<(String, Vec<u8>)> {
    let mut con = env.con();
    let v: Value = redis::cmd("XRANGE")
        .arg(&env.config.keys.stream)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    let Value::Array(list) = v else {
        return Vec::new();
    };
    list.into_iter()
        .filter_map(|e| match e {
            Value::Array(mut pair) if pair.len() == 2 => {
                let fields = delay_worker::store::stream::kv_fields(pair.pop()?);
                let get = |name: &str| {
                    fields
                        .iter()
                        .find(|(k, _)| k == name)
                        .map(|(_, v)| match v {
                            Value::BulkString(b) => b.clone(),
                            other => delay_worker::store::value_to_string(other).into_bytes(),
                        })
                };
                Some((String::from_utf8(get("key")?).ok()?, get("msg")?))
            }
            _ => None,
        })
        .collect()
}

/// Entries the group has read and none pending.
fn settled(env: &Env, read: u64) -> bool {
    let mut con = env.con();
    let groups: Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&env.config.keys.stream)
        .query(&mut con)
        .unwrap();
    let Value::Array(gs) = groups else {
        return false;
    };
    gs.into_iter().any(|g| {
        let f = delay_worker::store::stream::kv_fields(g);
        let int = |n: &str| {
            f.iter()
                .find(|(k, _)| k == n)
                .and_then(|(_, v)| match v {
                    Value::Int(i) => Some(*i as u64),
                    _ => None,
                })
                .unwrap_or(u64::MAX)
        };
        int("entries-read") == read && int("pending") == 0
    })
}

#[test]
fn pruning_while_jobs_run_keeps_the_books_and_redeliveries_within_the_retention_dedupe() {
    let mut env = Env::new();
    env.config.prune.retention = Duration::from_secs(HOUR as u64);
    env.config.prune.interval = Duration::from_millis(200);
    env.config.prune.batch = 500;
    env.config.prune.pause = Duration::from_millis(1);
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    fill(&env.db, "old:", 20_000, 2 * HOUR);
    let orders = seed_orders(&env.db, 300);
    let paid: Vec<SeedOrder> = orders.iter().step_by(4).cloned().collect();
    pay(&env.db, &paid);
    let daemon = Daemon::start(&env.config);
    // Due while the pruner works through the old rows, a batch at a time.
    push_timeouts(&env, &orders[..150], 200);
    push_timeouts(&env, &orders[150..], 600);
    wait_until(WAIT, "every job done and the old rows pruned", || {
        rows(&env.db, "order.timeout:") == 300 && rows(&env.db, "old:") == 0
    });
    wait_until(WAIT, "every entry settled", || settled(&env, 300));

    // Three jobs arrive again (a lost ack, a replayed stream): their inbox rows are
    // within the retention, so each is a duplicate, not a second run.
    let again: Vec<(String, Vec<u8>)> = entries(&env).into_iter().take(3).collect();
    for (key, msg) in &again {
        xadd(&env, key, msg);
    }
    wait_until(WAIT, "the redeliveries settled", || settled(&env, 303));
    // What the retention protects against: a fourth job's row is made older than the
    // retention, the pruner removes it, and its redelivery runs the handler again (a
    // no-op for a cancelled order, a second effect for a handler that is not idempotent).
    let (key, msg) = entries(&env).into_iter().nth(3).unwrap();
    env.db
        .client()
        .execute(
            "UPDATE worker_inbox SET processed_at = now() - interval '2 hours' WHERE job_key = $1",
            &[&key],
        )
        .unwrap();
    wait_until(WAIT, "the backdated row pruned", || {
        rows(&env.db, &key) == 0
    });
    xadd(&env, &key, &msg);
    wait_until(WAIT, "the late redelivery settled", || settled(&env, 304));
    let (_, _, metrics) = http_get(port, "/metrics").unwrap();
    let report = daemon.stop();

    let s = report.stats;
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_eq!(s.duplicate, 3, "{s}");
    assert_eq!(s.done, cancelled.len() as u64, "{s}");
    assert_eq!(s.noop, 300 - cancelled.len() as u64 + 1, "{s}");
    assert_eq!((s.dead, s.retried), (0, 0), "{s}");
    assert_eq!(
        inbox_count(&env.db),
        300,
        "one row per job, the old rows gone"
    );
    let b = books(&env);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
    assert!(
        metrics.contains("\ndelay_worker_inbox_pruned_total 20001\n"),
        "{metrics}"
    );
}

#[test]
fn a_failing_pruner_holds_no_job_back_and_tries_again() {
    let mut env = Env::new();
    env.config.prune.retention = Duration::from_secs(HOUR as u64);
    env.config.prune.interval = Duration::from_millis(100);
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    fill(&env.db, "old:", 100, 2 * HOUR);
    // Every delete fails, as it would without the DELETE privilege.
    env.db
        .client()
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql
               AS $$ BEGIN RAISE EXCEPTION 'no deletes here'; END $$;
             CREATE TRIGGER refuse BEFORE DELETE ON worker_inbox
               FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .unwrap();
    let config = prune_config(&env, HOUR as u64, 10);
    let (stats, redis) = (
        Stats::default(),
        delay_worker::store::Redis::from(redis::Client::open(env.redis.url()).unwrap()),
    );
    let e = Pruner::new(&config, &stats, &redis)
        .pass(&Shutdown::new())
        .unwrap_err();
    assert!(e.to_string().contains("no deletes here (P0001)"), "{e}");

    let orders = seed_orders(&env.db, 20);
    let daemon = Daemon::start(&env.config);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "every job done", || {
        rows(&env.db, "order.timeout:") == 20
    });
    // Passes keep failing meanwhile; the daemon stays healthy.
    std::thread::sleep(Duration::from_millis(300));
    let (code, _, body) = http_get(port, "/healthz").unwrap();
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    assert_eq!(rows(&env.db, "old:"), 100);
    env.db
        .client()
        .batch_execute("DROP TRIGGER refuse ON worker_inbox")
        .unwrap();
    wait_until(WAIT, "the old rows pruned once deletes work", || {
        rows(&env.db, "old:") == 0
    });
    let report = daemon.stop();
    assert_eq!(report.stats.done, 20, "{}", report.stats);
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_eq!(inbox_count(&env.db), 20);
}
