//! `worker trace`: each state a job can be in, read back by its key against real servers
//! (scheduled, moved and not read, in flight, waiting for a retry, done, a no-op, a dead
//! letter, gone: pruned or never pushed), a sharded queue, list mode, a key pushed twice,
//! `--order`, the `--json` shape and the exit codes; and the indexes the trace reads from
//! emptied as the jobs settle.

use crate::support::*;
use delay_worker::keys::{Keys, Queue};
use delay_worker::now_ms;
use delay_worker::store::{self, At, Pool, Target};
use serde_json::Value;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const MAX: usize = 65_536;

/// `worker trace ARGS --json` (with `extra` flags): its exit code and its JSON.
fn trace(env: &Env, args: &[&str]) -> (i32, Value) {
    let mut all = vec!["trace"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = run_worker(&all, &env.redis.url(), &env.db.url);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "trace {args:?}: not JSON ({e}): {}{}",
            text(&out.stdout),
            text(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), json)
}

/// The jobs of a trace.
fn jobs(t: &Value) -> &Vec<Value> {
    t["jobs"].as_array().expect("jobs")
}

/// The only job of a trace.
fn only(t: &Value) -> &Value {
    let j = jobs(t);
    assert_eq!(j.len(), 1, "{t:#}");
    &j[0]
}

fn push(env: &Env, keys: &Keys, key: &str, event: &str, payload: Value, due_ms: i64) {
    let job = delay_worker::producer::NewJob {
        event: event.into(),
        payload,
        due_ms,
        key: Some(key.into()),
    };
    let now = delay_worker::now_ms();
    delay_worker::producer::push(&mut env.con(), keys, &job, now).unwrap();
}

fn move_due(env: &Env, keys: &Keys) -> store::MoveReport {
    let target = Target::Stream {
        stream: &keys.stream,
        dead: &keys.dead,
    };
    move_onto(env, keys, target)
}

/// The due jobs of `keys`' pool moved onto `target`.
fn move_onto(env: &Env, keys: &Keys, target: Target<'_>) -> store::MoveReport {
    let pool = Pool::Enveloped {
        pool: &keys.pool,
        data: &keys.data,
    };
    store::move_due(
        &mut env.con(),
        pool,
        keys,
        target,
        At::Server,
        100,
        60_000,
        MAX,
        0,
    )
    .unwrap()
}

fn hlen(env: &Env, key: &str) -> i64 {
    redis::cmd("HLEN").arg(key).query(&mut env.con()).unwrap()
}

/// A trace through the library, for waiting on a state.
fn state_of(env: &Env, key: &str) -> Vec<String> {
    let mut con = env.con();
    let mut db = env.db.client();
    let q = delay_worker::trace::Query::key(key, None);
    let now = delay_worker::now_ms();
    delay_worker::trace::gather(&mut con, Some(&mut db), &env.config, &q, now)
        .unwrap()
        .jobs
        .iter()
        .map(|j| j.state.name().to_string())
        .collect()
}

#[test]
fn never_pushed_scheduled_moved_and_in_flight_with_the_json_shape_and_exit_codes() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let now = now_ms();

    // Never pushed: exit 4, nothing found, and why.
    let (code, t) = trace(&env, &["order.timeout:SO404"]);
    assert_eq!(code, 4, "{t:#}");
    assert_eq!((t["found"].as_bool(), jobs(&t).len()), (Some(false), 0));
    assert!(
        t["gone"].as_str().unwrap().contains("never pushed"),
        "{t:#}"
    );
    let out = run_worker(
        &["trace", "order.timeout:SO404"],
        &env.redis.url(),
        &env.db.url,
    );
    assert_eq!(out.status.code(), Some(4));
    assert!(
        text(&out.stdout).contains("no trace"),
        "{}",
        text(&out.stdout)
    );

    // Scheduled: its pool and due time, and the id the mover will stamp.
    let due = now + 15 * 60_000;
    push(
        &env,
        &keys,
        "order.timeout:SO1",
        "order.timeout",
        serde_json::json!({"order_no": "SO1"}),
        due,
    );
    let (code, t) = trace(&env, &["order.timeout:SO1"]);
    assert_eq!(code, 0, "{t:#}");
    let j = only(&t);
    assert_eq!(j["state"], "scheduled");
    assert_eq!(j["pool"], "mq:delay:pool");
    assert_eq!(j["key"], "order.timeout:SO1");
    assert_eq!(j["event"], "order.timeout");
    assert_eq!(j["due_ms"].as_i64(), Some(due));
    assert!(
        j["job_id"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}", due * 1000)),
        "{j}"
    );
    // The shape scripts read.
    for f in [
        "query",
        "now_ms",
        "jobs",
        "notes",
        "inbox_since_ms",
        "found",
        "gone",
    ] {
        assert!(t.get(f).is_some(), "{f} in {t:#}");
    }
    for f in [
        "key", "shard", "event", "job_id", "due_ms", "state", "notes",
    ] {
        assert!(j.get(f).is_some(), "{f} in {j}");
    }
    assert_eq!(t["query"]["key"], "order.timeout:SO1");

    // Moved, not read yet: the entry the move wrote, with the same identity.
    push(
        &env,
        &keys,
        "order.timeout:SO2",
        "order.timeout",
        serde_json::json!({"order_no": "SO2"}),
        now - 1_000,
    );
    let (_, before) = trace(&env, &["order.timeout:SO2"]);
    let id = only(&before)["job_id"].as_str().unwrap().to_string();
    assert_eq!(only(&before)["state"], "scheduled");
    store::stream::ensure_group(&mut env.con(), &keys).unwrap();
    assert_eq!(move_due(&env, &keys).moved, 1);
    let (code, t) = trace(&env, &["order.timeout:SO2"]);
    assert_eq!(code, 0);
    let j = only(&t);
    assert_eq!(j["state"], "moved", "{t:#}");
    assert_eq!(j["stream"], "mq:events");
    assert_eq!(
        j["job_id"].as_str(),
        Some(id.as_str()),
        "the mover stamped the id trace said"
    );
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg("-")
        .arg("+")
        .query(&mut env.con())
        .unwrap();
    assert_eq!(j["entry"].as_str(), Some(entries[0].0.as_str()));
    assert!(j["moved_ms"].as_i64().unwrap() >= now - 1_000);
    // Too late to cancel: said so, with the entry (before: "no scheduled job" alone, as
    // for a key never pushed).
    let out = run_worker(
        &["cancel", "--key", "order.timeout:SO2"],
        &env.redis.url(),
        &env.db.url,
    );
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("it fell due and was moved to mq:events as entry")
            && said.contains(&entries[0].0),
        "{said}"
    );

    // In flight: read by a consumer, not acknowledged.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg("c9")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(&mut env.con())
        .unwrap();
    let (_, t) = trace(&env, &["order.timeout:SO2"]);
    let j = only(&t);
    assert_eq!(j["state"], "in_flight", "{t:#}");
    assert_eq!(
        (j["consumer"].as_str(), j["deliveries"].as_u64()),
        (Some("c9"), Some(1))
    );
    assert_eq!(j["alive"], false);
    redis::cmd("SET")
        .arg(keys.heartbeat("c9"))
        .arg("{}")
        .query::<()>(&mut env.con())
        .unwrap();
    let (_, t) = trace(&env, &["order.timeout:SO2"]);
    assert_eq!(only(&t)["alive"], true);
    let out = run_worker(
        &["trace", "order.timeout:SO2"],
        &env.redis.url(),
        &env.db.url,
    );
    let said = text(&out.stdout);
    assert!(
        said.contains("in flight on c9 (alive)") && said.contains(&id),
        "{said}"
    );

    // Bad input: exit 2, one line.
    for args in [
        &["trace"][..],
        &["trace", "k", "--order", "SO1"],
        &["trace", ""],
        &["trace", "--order", ""],
    ] {
        let out = run_worker(args, &env.redis.url(), &env.db.url);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(
            text(&out.stderr).lines().count(),
            1,
            "{}",
            text(&out.stderr)
        );
    }
}

#[test]
fn retrying_done_noop_and_dead_through_the_daemon_and_the_indexes_empty_as_jobs_settle() {
    let mut env = Env::new();
    // A handler that always meets contention: its job waits for a retry (10 s apart).
    let dir = HandlerDir::new(&[(
        "stuck.sql",
        "-- event: stuck.job\n-- requires: n\n\
         SELECT stuck($1)\n"
            .to_string(),
    )]);
    env.db
        .client()
        .batch_execute(
            "CREATE FUNCTION stuck(p jsonb) RETURNS void LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001'; END $$",
        )
        .unwrap();
    env.config.handlers_dir = Some(dir.0.clone());
    env.config.jobs.retry_base = Duration::from_secs(10);
    let keys = env.config.keys.clone();
    let orders = seed_orders(&env.db, 2);
    pay(&env.db, &orders[1..]);
    let now = now_ms();
    let (done, noop) = (
        format!("order.timeout:{}", orders[0].order_no),
        format!("order.timeout:{}", orders[1].order_no),
    );
    for key in [&done, &noop] {
        let no = key.split_once(':').unwrap().1;
        push(
            &env,
            &keys,
            key,
            "order.timeout",
            serde_json::json!({"order_no": no}),
            now,
        );
    }
    // A payload without its required field: a dead letter at once.
    push(
        &env,
        &keys,
        "order.timeout:bad",
        "order.timeout",
        serde_json::json!({}),
        now,
    );
    push(
        &env,
        &keys,
        "stuck:1",
        "stuck.job",
        serde_json::json!({"n": 1}),
        now,
    );
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the jobs settled", || {
        state_of(&env, &done) == ["done"]
            && state_of(&env, &noop) == ["done"]
            && state_of(&env, "order.timeout:bad") == ["dead"]
            && state_of(&env, "stuck:1") == ["retrying"]
    });
    daemon.stop();

    let (code, t) = trace(&env, &[&done]);
    assert_eq!(code, 0);
    let j = only(&t);
    assert_eq!(
        (j["state"].as_str(), j["outcome"].as_str()),
        (Some("done"), Some("done")),
        "{t:#}"
    );
    assert_eq!(j["consumer"], "c1");
    assert!(j["late_ms"].as_i64().unwrap() >= 0, "{j}");
    assert!(j["processed_ms"].as_i64().unwrap() >= now - 1_000, "{j}");
    assert!(
        j["job_id"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}", now * 1000)),
        "{j}"
    );

    let (_, t) = trace(&env, &[&noop]);
    assert_eq!(only(&t)["outcome"], "noop", "{t:#}");
    let out = run_worker(&["trace", &noop], &env.redis.url(), &env.db.url);
    assert!(
        text(&out.stdout).contains("a no-op"),
        "{}",
        text(&out.stdout)
    );

    let (_, t) = trace(&env, &["order.timeout:bad"]);
    let j = only(&t);
    assert_eq!(j["state"], "dead", "{t:#}");
    assert_eq!(j["dead"], "mq:dead-letter");
    assert!(!j["reason"].as_str().unwrap().is_empty(), "{j}");
    assert!(j["died_ms"].as_i64().unwrap() >= now - 1_000, "{j}");
    assert_eq!(j["consumer"], "c1");

    let (_, t) = trace(&env, &["stuck:1"]);
    let j = only(&t);
    assert_eq!(j["state"], "retrying", "{t:#}");
    assert_eq!(j["attempt"], 1);
    assert!(
        j["last_error"]
            .as_str()
            .unwrap()
            .contains("injected serialization failure"),
        "{j}"
    );
    assert!(j["next_ms"].as_i64().unwrap() > now, "{j}");
    assert_eq!(j["due_ms"].as_i64(), Some(now), "first due");

    // Every entry settled: the moved index holds nothing; the letters index the one letter.
    assert_eq!(hlen(&env, &keys.moved), 0);
    assert_eq!(hlen(&env, &keys.letters), 1);
    // Purged, the letter leaves the index too, and the key has no trace.
    let out = run_worker(&["dead", "purge", "--all"], &env.redis.url(), &env.db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(hlen(&env, &keys.letters), 0);
    let (code, _) = trace(&env, &["order.timeout:bad"]);
    assert_eq!(code, 4);
}

#[test]
fn a_key_pushed_twice_shows_each_job_and_a_pruned_one_is_gone() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let orders = seed_orders(&env.db, 2);
    let key = format!("order.timeout:{}", orders[0].order_no);
    let pruned = format!("order.timeout:{}", orders[1].order_no);
    let now = now_ms();
    for (k, o) in [(&key, &orders[0]), (&pruned, &orders[1])] {
        push(
            &env,
            &keys,
            k,
            "order.timeout",
            serde_json::json!({"order_no": o.order_no}),
            now,
        );
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "both done", || inbox_count(&env.db) == 2);
    daemon.stop();
    // Pushed again: a second job of the key, scheduled.
    let later = now + 15 * 60_000;
    push(
        &env,
        &keys,
        &key,
        "order.timeout",
        serde_json::json!({"order_no": orders[0].order_no}),
        later,
    );
    let (code, t) = trace(&env, &[&key]);
    assert_eq!(code, 0);
    let j = jobs(&t);
    assert_eq!(j.len(), 2, "{t:#}");
    assert_eq!(
        (j[0]["state"].as_str(), j[1]["state"].as_str()),
        (Some("done"), Some("scheduled"))
    );
    assert_ne!(j[0]["job_id"], j[1]["job_id"]);
    assert_eq!(j[1]["due_ms"].as_i64(), Some(later));
    let out = run_worker(&["trace", &key], &env.redis.url(), &env.db.url);
    assert!(
        text(&out.stdout).contains("2 jobs, oldest first"),
        "{}",
        text(&out.stdout)
    );

    // Done ten days ago and pruned after the 7 days' retention: gone.
    env.db
        .client()
        .execute(
            "UPDATE worker_inbox SET processed_at = now() - interval '10 days' WHERE job_key = $1",
            &[&pruned],
        )
        .unwrap();
    let stats = delay_worker::stats::Stats::default();
    let redis = delay_worker::store::Redis::from(redis::Client::open(env.redis.url()).unwrap());
    let never = delay_worker::Shutdown::new();
    delay_worker::prune::Pruner::new(&env.config, &stats, &redis)
        .pass(&never)
        .unwrap();
    let (code, t) = trace(&env, &[&pruned]);
    assert_eq!(code, 4, "{t:#}");
    assert!(t["gone"].as_str().unwrap().contains("done before"), "{t:#}");
    assert!(t["inbox_since_ms"].as_i64().is_some());
}

/// A key that has had more dead letters than its index keeps: the trace says older ones
/// may be there and are not shown (found from outside: it listed 9 of 10 jobs as all).
#[test]
fn a_key_with_letters_past_its_index_says_so() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let key = "order.timeout:RQ9";
    push(
        &env,
        &keys,
        key,
        "order.timeout",
        serde_json::json!({"order_no": "RQ9"}),
        now_ms() + 60_000,
    );
    // As the index marks a key once it drops one of its letters.
    let mark = |key: &str| {
        redis::cmd("HSET")
            .arg(&keys.letters)
            .arg(format!("older\n{key}"))
            .arg(1)
            .query::<()>(&mut env.con())
            .unwrap()
    };
    mark(key);
    let (_, t) = trace(&env, &[key]);
    assert!(
        t["notes"]
            .to_string()
            .contains("more dead letters than its index keeps"),
        "{t:#}"
    );
    // With no job the index names, that is not "no trace" (exit 4): the letters past the
    // index may be there (found from outside).
    let bare = "order.timeout:RQ10";
    mark(bare);
    let (code, t) = trace(&env, &[bare]);
    assert_eq!(code, 0, "{t:#}");
    let out = run_worker(&["trace", bare], &env.redis.url(), &env.db.url);
    let said = text(&out.stdout);
    assert!(!said.contains("no trace"), "{said}");
    assert!(
        said.contains("more dead letters than its index keeps"),
        "{said}"
    );
}

/// Found from outside: a push over a retry waiting in the pool showed only the new job
/// until the mover moved it (15 minutes in real use), the replaced retry nowhere. The new
/// job's trace says it replaced that retry and what becomes of it.
#[test]
fn a_push_over_a_waiting_retry_says_it_replaced_it() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let key = "order.timeout:R8";
    let retry = r#"{"event":"order.timeout","payload":{"order_no":"R8"},"retry":2,"ts":1,"job_id":"1700000000000000-aa-bb"}"#;
    let sha = sha1_smol::Sha1::from(retry).digest().to_string();
    // A retry as the settle writes it back: data, score, and its record with a copy.
    redis::pipe()
        .cmd("HSET")
        .arg(&keys.data)
        .arg(key)
        .arg(retry)
        .cmd("ZADD")
        .arg(&keys.pool)
        .arg(now_ms() + 30_000)
        .arg(key)
        .cmd("HSET")
        .arg(&keys.jobs)
        .arg(key)
        .arg(format!("1700000000000000-aa-bb {sha}"))
        .arg(format!("msg\n{key}"))
        .arg(retry)
        .query::<()>(&mut env.con())
        .unwrap();
    push(
        &env,
        &keys,
        key,
        "order.timeout",
        serde_json::json!({"order_no": "R8"}),
        now_ms() + 60_000,
    );
    let (code, t) = trace(&env, &[key]);
    assert_eq!(code, 0, "{t:#}");
    let j = only(&t);
    assert_eq!(j["state"].as_str(), Some("scheduled"), "{t:#}");
    assert!(
        j["notes"]
            .to_string()
            .contains("replaced a retry of job 1700000000000000-aa-bb"),
        "{t:#}"
    );
}

/// Found from outside: a letter of a retried job (its message carries when it first fell
/// due) requeued minutes after it died was traced as "overdue" by that long while due now.
/// A job scheduled again is traced as due at its score, its first due time in a note.
#[test]
fn a_requeued_retry_is_traced_as_due_when_it_was_requeued() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let key = "order.timeout:T1";
    let first_due = now_ms() - 6 * 60_000;
    let msg = format!(
        r#"{{"event":"order.timeout","payload":{{"order_no":"T1"}},"retry":3,"ts":1,"first_due":{first_due},"last_error":"lock timeout"}}"#
    );
    redis::cmd("XADD")
        .arg(&keys.dead)
        .arg("*")
        .arg(&["msg", &msg, "reason", "retries used up", "ts", "1"])
        .arg(&["event", "order.timeout", "key", key, "attempts", "4"])
        .query::<String>(&mut env.con())
        .unwrap();
    let before = now_ms();
    let out = run_worker(&["dead", "requeue"], &env.redis.url(), &env.db.url);
    assert!(
        text(&out.stdout).starts_with("requeued 1\n"),
        "{}",
        text(&out.stdout)
    );
    let (code, t) = trace(&env, &[key]);
    assert_eq!(code, 0, "{t:#}");
    let j = only(&t);
    assert_eq!(j["state"].as_str(), Some("scheduled"), "{t:#}");
    assert!(j["due_ms"].as_i64().unwrap() >= before - 1000, "{t:#}");
    assert!(
        j["notes"]
            .to_string()
            .contains("scheduled again (a requeue)"),
        "{t:#}"
    );
    let out = run_worker(&["trace", key], &env.redis.url(), &env.db.url);
    assert!(
        !text(&out.stdout).contains("overdue 6m"),
        "{}",
        text(&out.stdout)
    );
}

/// Found from outside: a job dead-lettered, a newer push of its key done, then the older
/// letter requeued: the trace listed the newer job first while saying "oldest first". The
/// jobs are ordered by when each was first due (the time its identity stamps).
#[test]
fn a_requeued_older_job_is_listed_before_the_newer_push_of_its_key() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let orders = seed_orders(&env.db, 1);
    let key = format!("order.timeout:{}", orders[0].order_no);
    let now = now_ms();
    // No order named: the handler cannot take it, a dead letter at once.
    push(
        &env,
        &keys,
        &key,
        "order.timeout",
        serde_json::json!({}),
        now - 2000,
    );
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the older job dead", || books(&env).dead == 1);
    push(
        &env,
        &keys,
        &key,
        "order.timeout",
        serde_json::json!({"order_no": orders[0].order_no}),
        now,
    );
    wait_until(WAIT, "the newer job done", || inbox_count(&env.db) == 1);
    daemon.stop();
    let out = run_worker(
        &["dead", "requeue", "--force"],
        &env.redis.url(),
        &env.db.url,
    );
    assert!(
        text(&out.stdout).starts_with("requeued 1\n"),
        "{}",
        text(&out.stdout)
    );
    let (code, t) = trace(&env, &[&key]);
    assert_eq!(code, 0, "{t:#}");
    let j = jobs(&t);
    assert_eq!(j.len(), 2, "{t:#}");
    assert_eq!(
        (j[0]["state"].as_str(), j[1]["state"].as_str()),
        (Some("scheduled"), Some("done")),
        "{t:#}"
    );
    let stamp = |j: &Value| -> i64 {
        j["job_id"]
            .as_str()
            .unwrap()
            .split('-')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(stamp(&j[0]) < stamp(&j[1]), "{t:#}");
}

#[test]
fn a_sharded_queue_is_traced_in_the_key_s_shard_or_found_in_another() {
    let mut env = Env::new();
    env.config.shards = 3;
    let now = now_ms();
    let mut homes = Vec::new();
    for i in 0..6 {
        let key = format!("order.timeout:SH{i}");
        let k = env.config.keys_for(key.as_bytes());
        push(
            &env,
            &k,
            &key,
            "order.timeout",
            serde_json::json!({"order_no": format!("SH{i}")}),
            now + 600_000,
        );
        homes.push((
            key,
            delay_worker::keys::shard_of(format!("order.timeout:SH{i}").as_bytes(), 3),
        ));
    }
    for (key, shard) in &homes {
        let (code, t) = trace(&env, &["--shards", "3", key]);
        assert_eq!(code, 0, "{t:#}");
        let j = only(&t);
        assert_eq!(j["shard"].as_u64(), Some(*shard as u64), "{t:#}");
        assert_eq!(j["pool"], format!("{{mq:{shard}}}:delay:pool"));
    }
    // A producer with another --shards put this key in a shard not its own.
    let key = "order.timeout:ELSEWHERE";
    let home = delay_worker::keys::shard_of(key.as_bytes(), 3);
    let other = env.config.shard_keys()[(home + 1) % 3].clone();
    push(
        &env,
        &other,
        key,
        "order.timeout",
        serde_json::json!({"order_no": "ELSEWHERE"}),
        now + 600_000,
    );
    let (code, t) = trace(&env, &["--shards", "3", key]);
    assert_eq!(code, 0, "{t:#}");
    assert_eq!(only(&t)["shard"].as_u64(), Some(((home + 1) % 3) as u64));
    assert!(
        t["notes"][0].as_str().unwrap().contains("another --shards"),
        "{t:#}"
    );
}

#[test]
fn an_order_is_found_by_the_keys_of_the_built_in_events() {
    let env = Env::new();
    let keys = env.config.keys.clone();
    let later = now_ms() + 600_000;
    push(
        &env,
        &keys,
        "order.timeout:SO77",
        "order.timeout",
        serde_json::json!({"order_no": "SO77"}),
        later,
    );
    push(
        &env,
        &keys,
        "payment.paid:SO77",
        "payment.paid",
        serde_json::json!({"order_no": "SO77"}),
        later + 1,
    );
    let (code, t) = trace(&env, &["--order", "SO77"]);
    assert_eq!(code, 0);
    let events: Vec<&str> = jobs(&t)
        .iter()
        .map(|j| j["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["order.timeout", "payment.paid"], "{t:#}");
    let (_, t) = trace(&env, &["--order", "SO77", "--event", "payment.paid"]);
    assert_eq!(only(&t)["key"], "payment.paid:SO77");
    let (code, _) = trace(&env, &["--order", "SO78"]);
    assert_eq!(code, 4);
}

/// The due jobs of `keys`' pool moved onto list queue `q` (dead list `q:dead`).
fn move_to_list(env: &Env, keys: &Keys) {
    let target = Target::List {
        queue: "q",
        dead: "q:dead",
    };
    move_onto(env, keys, target);
}

#[test]
fn list_mode_queued_and_processing() {
    let env = Env::new();
    let keys = Keys {
        queues: vec![Queue::new("q", None)],
        ..Keys::default()
    };
    let now = now_ms();
    push(
        &env,
        &keys,
        "order.timeout:L1",
        "order.timeout",
        serde_json::json!({"order_no": "L1"}),
        now - 1,
    );
    push(
        &env,
        &keys,
        "order.timeout:L2",
        "order.timeout",
        serde_json::json!({"order_no": "L2"}),
        now,
    );
    let list = ["--source", "list", "--queues", "q"];
    let (_, t) = trace(&env, &[&list[..], &["order.timeout:L1"]].concat());
    let id = only(&t)["job_id"].as_str().unwrap().to_string();
    move_to_list(&env, &keys);
    let (code, t) = trace(&env, &[&list[..], &["order.timeout:L2"]].concat());
    assert_eq!(code, 0);
    let j = only(&t);
    assert_eq!(
        (j["state"].as_str(), j["queue"].as_str()),
        (Some("queued"), Some("q")),
        "{t:#}"
    );
    assert_eq!(j["position"], 1, "L1 is fetched first");
    // Fetched by c7 (listed as a consumer, as the reader lists itself): in its processing
    // list.
    store::list::register_consumer(&mut env.con(), &keys, "c7").unwrap();
    let f = store::list::fetch(&mut env.con(), &keys, "c7", 1, 10, MAX).unwrap();
    assert_eq!(f.messages.len(), 1);
    let (_, t) = trace(&env, &[&list[..], &["--order", "L1"]].concat());
    let j = only(&t);
    assert_eq!(j["state"], "processing", "{t:#}");
    assert_eq!(
        (j["consumer"].as_str(), j["alive"].as_bool()),
        (Some("c7"), Some(false))
    );
    assert_eq!(j["job_id"].as_str(), Some(id.as_str()));
}

/// Found from outside: a member a producer scored `+inf`, or in microseconds (a due time
/// some 55,000 years out), made `worker trace` panic (exit 101) writing its due time. It is
/// a scheduled job like any other: exit 0, its due time written in milliseconds, and the
/// likely mistake named.
#[test]
fn a_member_scored_past_the_year_9999_is_traced_as_scheduled() {
    let env = Env::new();
    let keys = Keys::default();
    let micros = (now_ms() + 60_000) * 1000;
    for (key, score) in [
        ("order.timeout:SO-INF", "+inf".to_string()),
        ("order.timeout:SO-US", micros.to_string()),
    ] {
        redis::cmd("HSET")
            .arg(&keys.data)
            .arg(key)
            .arg(r#"{"event":"order.timeout","payload":{"order_no":"X"},"retry":0,"ts":1}"#)
            .query::<()>(&mut env.con())
            .unwrap();
        redis::cmd("ZADD")
            .arg(&keys.pool)
            .arg(&score)
            .arg(key)
            .query::<()>(&mut env.con())
            .unwrap();
        let out = run_worker(&["trace", key], &env.redis.url(), &env.db.url);
        let said = text(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{key}: {said}{}",
            text(&out.stderr)
        );
        assert!(
            said.contains("scheduled") && said.contains("past the year 9999"),
            "{key}: {said}"
        );
        let (code, t) = trace(&env, &[key]);
        assert_eq!(code, 0, "{t:#}");
        assert_eq!(jobs(&t).len(), 1, "{t:#}");
    }
}

/// List mode: a message fetched more than `--max-deliveries` times becomes a dead letter
/// that names its job key and event (from the message the mover moved), so the trace of the
/// key finds it dead. Found from outside: its letter named neither, `dead list` showed `-`
/// and the trace said "no trace" (exit 4) while the job sat in the dead list.
#[test]
fn a_list_message_dead_for_too_many_fetches_is_traced_by_its_key() {
    let env = Env::new();
    let keys = Keys {
        queues: vec![Queue::new("q", None)],
        ..Keys::default()
    };
    push(
        &env,
        &keys,
        "order.timeout:P1",
        "order.timeout",
        serde_json::json!({"order_no": "P1"}),
        now_ms() - 1,
    );
    move_to_list(&env, &keys);
    // Fetched by a consumer that dies each time (its own list pushed back at its restart).
    for _ in 0..2 {
        let f = store::list::fetch(&mut env.con(), &keys, "c7", 1, 2, MAX).unwrap();
        assert_eq!(f.messages.len(), 1);
        // Its job starts, and kills the consumer.
        redis::cmd("HINCRBY")
            .arg(keys.queues[0].deliveries())
            .arg(store::started_field(&f.messages[0].1))
            .arg(1)
            .query::<i64>(&mut env.con())
            .unwrap();
        store::list::requeue_processing(&mut env.con(), &keys, "c7", false, false).unwrap();
    }
    // The fetch stops at it; its job not in the inbox, it goes to the dead list.
    let f = store::list::fetch(&mut env.con(), &keys, "c7", 1, 2, MAX).unwrap();
    assert_eq!((f.messages.len(), f.buried.len()), (0, 0));
    let over = f.over.expect("fetched as often as the limit");
    assert_eq!(over.fetched, 2);
    let out =
        store::list::bury_fetched(&mut env.con(), &keys, "c7", &over, false, (2, MAX)).unwrap();
    assert_eq!((out.done, out.buried.len()), (false, 1));
    // Its WARN line names its job key.
    assert_eq!(out.buried[0].0, "order.timeout:P1");
    let letter: Value = serde_json::from_str(
        &redis::cmd("LINDEX")
            .arg("q:dead")
            .arg(0)
            .query::<String>(&mut env.con())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (letter["key"].as_str(), letter["event"].as_str()),
        (Some("order.timeout:P1"), Some("order.timeout")),
        "{letter}"
    );
    let list = ["--source", "list", "--queues", "q"];
    let (code, t) = trace(&env, &[&list[..], &["order.timeout:P1"]].concat());
    assert_eq!(code, 0, "{t:#}");
    assert_eq!(only(&t)["state"], "dead", "{t:#}");
}
