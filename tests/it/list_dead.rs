//! List mode's dead lists in the operator tools: `worker dead list|show|requeue|purge`
//! with the list-mode flags (filters, ids, letters that cannot go back, a newer push that
//! wins, requeues racing each other), a letter requeued after the fix and then done once
//! by the daemon, and `worker stats --check`'s list-mode levels.

use crate::support::*;
use delay_worker::config::Source;
use delay_worker::dead::list::{self as dead_list, ListLetter};
use delay_worker::dead::Filter;
use delay_worker::keys::{Keys, Queue};
use delay_worker::now_ms;
use redis::Connection;
use serde_json::{json, Value};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn lpush(con: &mut Connection, list: &str, v: &str) {
    redis::cmd("LPUSH")
        .arg(list)
        .arg(v)
        .query::<()>(con)
        .unwrap();
}

fn llen(con: &mut Connection, list: &str) -> usize {
    redis::cmd("LLEN").arg(list).query(con).unwrap()
}

fn lrange(con: &mut Connection, list: &str) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg(list)
        .arg(0)
        .arg(-1)
        .query(con)
        .unwrap()
}

/// The age in seconds a check line shows for a queue's oldest waiting message.
fn oldest(line: &str, queue: &str) -> u64 {
    let head = format!("queue {queue} ");
    let rest = &line[line.find(&head).expect(&head)..];
    let age = rest.split(", oldest ").nth(1).unwrap();
    age[..age.find('s').unwrap()].parse().unwrap()
}

/// A letter as `settle_list.lua` writes it.
fn letter(queue: &str, msg: &str, event: &str, key: &str, ts: i64) -> String {
    json!({
        "msg": msg, "reason": format!("handler failed for {key}"), "ts": ts, "event": event,
        "key": key, "attempts": 3, "consumer": "c1", "queue": queue
    })
    .to_string()
}

/// The worker binary against this Redis (no database needed), list-mode layout first.
fn dead(url: &str, args: &[&str]) -> std::process::Output {
    let mut a = vec![args[0], args[1]];
    a.extend([
        "--source",
        "list",
        "--queues",
        "normal",
        "--queue",
        "pay=payment.paid",
    ]);
    a.extend(&args[2..]);
    run_worker(&a, url, "postgres://unused")
}

fn stdout(o: &std::process::Output) -> String {
    assert!(
        o.status.code().is_some_and(|c| c <= 1),
        "{}",
        text(&o.stderr)
    );
    text(&o.stdout)
}

#[test]
fn dead_lists_are_listed_shown_requeued_once_and_purged() {
    let r = RedisServer::start();
    let mut con = r.con();
    let url = r.url();
    let keys = Keys {
        queues: vec![
            Queue::new("normal", None),
            Queue::new("pay", Some("payment.paid")),
        ],
        ..Keys::default()
    };
    let now_s = now_ms() / 1000;
    // A: died two hours ago after its retries, stamped by the mover.
    let msg_a = r#"{"job_id":"1700000000000000-1","job_key":"k-a","event":"order.timeout","payload":{"order_no":"SO-A"},"retry":3,"ts":1700000000,"trace":"x"}"#;
    lpush(
        &mut con,
        "normal:dead",
        &letter("normal", msg_a, "order.timeout", "k-a", now_s - 7200),
    );
    // B: ten seconds ago.
    let msg_b = r#"{"event":"coupon.expire","payload":{"coupon_id":7},"retry":0,"ts":1700000001}"#;
    lpush(
        &mut con,
        "normal:dead",
        &letter("normal", msg_b, "coupon.expire", "k-b", now_s - 10),
    );
    // C: an oversized message, buried by the real fetch script: it keeps 4 KiB of it.
    let big = format!(
        r#"{{"event":"order.timeout","payload":{{"pad":"{}"}}}}"#,
        "x".repeat(6000)
    );
    lpush(&mut con, "normal", &big);
    let fetched = delay_worker::store::list::fetch(&mut con, &keys, "c1", 10, 10, 5000).unwrap();
    assert_eq!((fetched.messages.len(), fetched.buried.len()), (0, 1));
    // D: a raw payment, whose own `retry` field is the producer's.
    let msg_d = r#"{"order_no":"SO-D","retry":7}"#;
    lpush(
        &mut con,
        "pay:dead",
        &letter("pay", msg_d, "payment.paid", "pay:sha1:d", now_s - 60),
    );

    // list: queue by queue, oldest first; every field.
    let listed: Value = serde_json::from_str(&stdout(&dead(&url, &["dead", "list", "--json"])))
        .expect("a JSON array");
    let listed = listed.as_array().unwrap();
    let field = |i: usize, f: &str| listed[i][f].clone();
    let queues: Vec<Value> = (0..4).map(|i| field(i, "queue")).collect();
    assert_eq!(
        queues,
        [
            json!("normal"),
            json!("normal"),
            json!("normal"),
            json!("pay")
        ]
    );
    assert_eq!(
        (field(0, "key"), field(1, "key"), field(3, "key")),
        (json!("k-a"), json!("k-b"), json!("pay:sha1:d"))
    );
    assert_eq!(
        (field(0, "event"), field(0, "attempts")),
        (json!("order.timeout"), json!(3))
    );
    assert_eq!(field(0, "msg"), json!(msg_a));
    assert_eq!(field(2, "length"), json!(big.len()));
    assert!(field(0, "age_ms").as_i64().unwrap() >= 7_199_000);
    let id = |i: usize| field(i, "id").as_str().unwrap().to_string();
    let (id_a, id_b, id_c, id_d) = (id(0), id(1), id(2), id(3));
    assert_eq!(id_a.len(), dead_list::ID_LEN);

    let table = stdout(&dead(&url, &["dead", "list"]));
    assert!(table.starts_with("ID "), "{table}");
    assert!(table.contains("QUEUE") && table.contains(&id_d), "{table}");
    let ids_of = |args: &[&str]| -> Vec<String> {
        let mut a = vec!["dead", "list", "--json"];
        a.extend_from_slice(args);
        let v: Value = serde_json::from_str(&stdout(&dead(&url, &a))).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .map(|l| l["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids_of(&["--event", "coupon.expire"]), [id_b.as_str()]);
    assert_eq!(ids_of(&["--older-than", "1h"]), [id_a.as_str()]);
    assert_eq!(
        ids_of(&["--newer-than", "30s"]),
        [id_b.clone(), id_c.clone()]
    );
    assert_eq!(ids_of(&["--limit", "1"]), [id_a.as_str()]);

    // show: by id or a prefix of it; exit 1 for none.
    let shown = stdout(&dead(&url, &["dead", "show", &id_a[..10]]));
    assert!(shown.contains("queue        normal"), "{shown}");
    assert!(shown.contains("\"retry\": 3"), "{shown}");
    let out = dead(&url, &["dead", "show", "0123456789abcdef"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "no dead letter 0123456789abcdef\n");
    let out = dead(&url, &["dead", "show", "1768764300123-0"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr).trim().lines().count(), 1);

    // A letter without its whole message stays, saying why.
    let out = stdout(&dead(&url, &["dead", "requeue", "--id", &id_c]));
    assert_eq!(
        out,
        format!(
            "requeued 0\nleft {id_c} in the dead letters: it keeps only the first 4096 bytes of a {}-byte message (over --max-message-bytes)\n",
            big.len()
        )
    );
    // A job key its producer pushed again: the newer push wins, the letter stays.
    redis::cmd("HSET")
        .arg(&keys.data)
        .arg("k-b")
        .arg("{}")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("ZADD")
        .arg(&keys.pool)
        .arg(1)
        .arg("k-b")
        .query::<()>(&mut con)
        .unwrap();
    let out = stdout(&dead(
        &url,
        &["dead", "requeue", "--event", "coupon.expire"],
    ));
    assert!(
        out.starts_with("requeued 0\nleft 1 in the dead letters: their job key is scheduled again"),
        "{out}"
    );
    redis::cmd("DEL")
        .arg(&keys.pool)
        .arg(&keys.data)
        .query::<()>(&mut con)
        .unwrap();
    assert_eq!(llen(&mut con, "normal"), 0);
    assert_eq!(llen(&mut con, "normal:dead"), 3);

    // Four requeues of A and B at once: each goes back once.
    let normal = &keys.queues[0];
    let all = dead_list::scan(&mut con, &keys, &Filter::default(), now_ms(), 10).unwrap();
    let ab: Vec<ListLetter> = all
        .into_iter()
        .filter(|l| l.id == id_a || l.id == id_b)
        .collect();
    assert_eq!(ab.len(), 2);
    let digest_b = sha1_hex(msg_b.as_bytes());
    redis::cmd("HSET")
        .arg(normal.deliveries())
        .arg(&digest_b)
        .arg(5)
        .query::<()>(&mut con)
        .unwrap();
    let reports: Vec<_> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..4)
            .map(|_| {
                let (keys, ab, mut con) = (&keys, &ab, r.con());
                s.spawn(move || dead_list::requeue(&mut con, keys, &keys.queues[0], ab).unwrap())
            })
            .collect();
        racers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut requeued: Vec<String> = reports.iter().flat_map(|r| r.requeued.clone()).collect();
    requeued.sort();
    let mut want = vec![id_a.clone(), id_b.clone()];
    want.sort();
    assert_eq!(requeued, want, "each letter went back exactly once");
    assert_eq!(reports.iter().map(|r| r.gone.len()).sum::<usize>(), 6);
    let back = lrange(&mut con, "normal");
    assert_eq!(back.len(), 2);
    assert_eq!(lrange(&mut con, "normal:dead").len(), 1, "only C is left");
    // A: retry reset, the mover's stamp still first, every other field kept; B as it was.
    let a = back.iter().find(|m| m.contains("SO-A")).unwrap();
    assert!(a.starts_with(r#"{"job_id":"1700000000000000-1","#), "{a}");
    let a: Value = serde_json::from_str(a).unwrap();
    assert_eq!(
        (&a["retry"], &a["job_key"], &a["trace"], &a["ts"]),
        (&json!(0), &json!("k-a"), &json!("x"), &json!(1700000000))
    );
    assert!(back.contains(&msg_b.to_string()));
    let left: bool = redis::cmd("HEXISTS")
        .arg(normal.deliveries())
        .arg(&digest_b)
        .query(&mut con)
        .unwrap();
    assert!(!left, "a requeued message's fetch count starts again");

    // The raw payment goes back byte for byte, its own `retry` untouched.
    let out = stdout(&dead(
        &url,
        &["dead", "requeue", "--id", &id_d, "--id", &id_d],
    ));
    assert_eq!(out, "requeued 1\n");
    assert_eq!(lrange(&mut con, "pay"), [msg_d]);
    let out = dead(&url, &["dead", "requeue", "--id", &id_d]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        format!("requeued 0\nno dead letter {id_d}\n")
    );

    // purge: refused without a scope; by age; then all.
    let out = dead(&url, &["dead", "purge"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stdout(&dead(&url, &["dead", "purge", "--older-than", "1h"])),
        "purged 0\n"
    );
    lpush(&mut con, "pay:dead", "not a letter");
    assert_eq!(
        stdout(&dead(&url, &["dead", "purge", "--all"])),
        "purged 2\n"
    );
    assert_eq!(
        llen(&mut con, "normal:dead") + llen(&mut con, "pay:dead"),
        0
    );
    assert_eq!(
        llen(&mut con, "normal") + llen(&mut con, "pay"),
        3,
        "nothing else touched"
    );
}

#[test]
fn a_requeued_list_letter_is_done_once_by_the_daemon() {
    let mut env = Env::new();
    env.config.source = Source::List;
    env.config.keys.queues = vec![Queue::new("normal", None)];
    env.config.mover.queue = 0;
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
    let mut con = env.con();
    wait_until(WAIT, "one dead letter, one order done", || {
        llen(&mut con, "normal:dead") == 1 && inbox_count(&env.db) == 1
    });
    daemon.stop();
    assert_accounting(&env.db, &orders, &[&orders[1]]);
    release.send(()).unwrap();
    h.join().unwrap();

    let url = env.redis.url();
    let layout = ["--source", "list", "--queues", "normal"];
    let run = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(layout);
        run_worker(&a, &url, "postgres://unused")
    };
    let listed: Value = serde_json::from_slice(&run(&["dead", "list", "--json"]).stdout).unwrap();
    let key = format!("order.timeout:{}", orders[0].order_no);
    assert_eq!(listed[0]["key"], key.as_str());
    let died: Value = serde_json::from_str(listed[0]["msg"].as_str().unwrap()).unwrap();
    assert_eq!(died["retry"], 1);
    let out = run(&["dead", "requeue", "--event", "order.timeout"]);
    assert_eq!(stdout(&out), "requeued 1\n");
    let back: Value = serde_json::from_str(&lrange(&mut con, "normal")[0]).unwrap();
    assert_eq!(
        (&back["retry"], &back["job_id"]),
        (&json!(0), &died["job_id"])
    );

    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the requeued order", || {
        inbox_count(&env.db) == 2
            && llen(&mut con, "normal") == 0
            && llen(&mut con, &env.config.keys.queues[0].processing("c1")) == 0
    });
    let report = daemon.stop();
    assert_eq!(
        (report.stats.dead, report.stats.acked),
        (0, 1),
        "{}",
        report.stats
    );
    assert_accounting(&env.db, &orders, &[&orders[0], &orders[1]]);
    assert_eq!(inbox_count(&env.db), 2, "one inbox row per job");
    assert_eq!(llen(&mut con, "normal:dead"), 0);
    assert_eq!(books(&env).pool, 0);
}

#[test]
fn check_holds_list_queues_against_their_levels() {
    let r = RedisServer::start();
    let mut con = r.con();
    let check = |flags: &[&str]| -> (i32, String) {
        let mut a = vec![
            "stats",
            "--check",
            "--expect-workers",
            "0",
            "--source",
            "list",
            "--queues",
            "q1,q2",
            "--queue",
            "raw=payment.paid",
        ];
        a.extend_from_slice(flags);
        let out = run_worker(&a, &r.url(), "postgres://unused");
        (out.status.code().unwrap(), text(&out.stdout))
    };
    let (code, line) = check(&[]);
    assert_eq!(code, 0, "{line}");
    assert!(
        line.starts_with("OK - queue q1 0 waiting, oldest 0s, queue q2 0 waiting"),
        "{line}"
    );

    let now = now_ms();
    // q1: the mover moved its oldest message 30 s ago (the stamp), an hour after its
    // producer wrote it (ts): it has waited 30 s. Two newer ones in front of it.
    let stamp = format!("{}-0", (now - 30_000) * 1000);
    lpush(
        &mut con,
        "q1",
        &format!(
            r#"{{"job_id":"{stamp}","job_key":"k1","event":"e","payload":{{}},"retry":0,"ts":{}}}"#,
            now / 1000 - 3600
        ),
    );
    for _ in 0..2 {
        let m = format!(r#"{{"event":"e","payload":{{}},"ts":{}}}"#, now / 1000);
        lpush(&mut con, "q1", &m);
    }
    // q2: pushed by a producer 45 s ago (a float `ts` as a string, as PHP may write it).
    let m = format!(
        r#"{{"event":"e","payload":{{}},"ts":"{}.5"}}"#,
        now / 1000 - 45
    );
    lpush(&mut con, "q2", &m);
    // raw: a producer's own JSON: its age cannot be known.
    lpush(&mut con, "raw", r#"{"order_no":"SO1","ts":1}"#);

    let (code, line) = check(&[]);
    assert_eq!(code, 0, "{line}");
    // Ages in seconds as the line shows them (the check runs a moment after `now`).
    assert!(
        (30..60).contains(&oldest(&line, "q1")),
        "the stamp, not the ts: {line}"
    );
    assert!((44..60).contains(&oldest(&line, "q2")), "{line}");
    assert!(
        line.contains("queue raw 1 waiting, oldest unknown (raw message)"),
        "{line}"
    );
    assert!(line.contains(" raw_oldest=U;60;600 "), "{line}");

    let (code, line) = check(&["--queue-length-warn", "2"]);
    assert_eq!(code, 1, "{line}");
    assert!(
        line.starts_with("WARNING - queue q1 3 waiting (warn > 2),"),
        "{line}"
    );
    let (code, line) = check(&["--queue-length-warn", "1", "--queue-length-crit", "2"]);
    assert_eq!(code, 2, "{line}");
    assert!(
        line.starts_with("CRITICAL - queue q1 3 waiting (crit > 2),"),
        "{line}"
    );

    let (code, line) = check(&["--queue-oldest-warn", "35s"]);
    assert_eq!(code, 1, "{line}");
    let segment = |q: &str| {
        let from = line.find(&format!("queue {q} ")).unwrap();
        let rest = &line[from..];
        rest[..rest.find(", queue ").or(rest.find(", mover")).unwrap()].to_string()
    };
    assert!(segment("q2").ends_with("s (warn > 35)"), "{line}");
    assert!(!segment("q1").contains("warn"), "q1 waited less: {line}");
    let (code, line) = check(&["--queue-oldest-warn", "10s", "--queue-oldest-crit", "20s"]);
    assert_eq!(code, 2, "{line}");
    assert!(line.contains("(crit > 20)"), "{line}");

    // Dead letters: an old one is not new; a fresh one is, on any queue's dead list.
    let old = letter("q1", "{}", "e", "k", now / 1000 - 3600);
    lpush(&mut con, "q1:dead", &old);
    let (code, line) = check(&[]);
    assert_eq!(code, 0, "{line}");
    assert!(
        line.contains("dead 0 new") && line.ends_with(" dead=1\n"),
        "{line}"
    );
    lpush(
        &mut con,
        "q2:dead",
        &letter("q2", "{}", "e", "k", now / 1000),
    );
    let (code, line) = check(&[]);
    assert_eq!(code, 1, "{line}");
    assert!(
        line.starts_with("WARNING - ") && line.contains("dead 1 new (warn > 0)"),
        "{line}"
    );
    let (code, line) = check(&["--dead-crit", "0"]);
    assert_eq!(code, 2, "{line}");
    let (code, line) = check(&["--dead-window", "2h", "--dead-warn", "5"]);
    assert_eq!(code, 0, "{line}");
    assert!(line.contains("dead 2 new"), "{line}");
}

/// Two letters of one job key in a dead list (a retry a newer push replaced, then that
/// push's own job): the newer goes back and the older stays while it is dead, as in stream
/// mode, whether the call requeues all or `--limit 1` (which passes over the older letter,
/// not one tried, to the newer). Before, list mode's requeue put both back, the replaced
/// job too, or with `--limit 1` the older alone.
#[test]
fn of_two_letters_of_one_key_in_a_dead_list_the_newer_goes_back() {
    let r = RedisServer::start();
    let mut con = r.con();
    let url = r.url();
    let now_s = now_ms() / 1000;
    let key = "order.timeout:SO-SHARED";
    let msg = |v: &str| {
        format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"SO-SHARED","v":"{v}"}},"retry":1,"ts":1}}"#
        )
    };
    // Another key's letter, the oldest, and one whose key is a prefix of the shared one.
    lpush(
        &mut con,
        "normal:dead",
        &letter(
            "normal",
            &msg("OTHER"),
            "order.timeout",
            "order.timeout:SO",
            now_s - 30,
        ),
    );
    lpush(
        &mut con,
        "normal:dead",
        &letter("normal", &msg("OLD"), "order.timeout", key, now_s - 20),
    );
    lpush(
        &mut con,
        "normal:dead",
        &letter("normal", &msg("NEW"), "order.timeout", key, now_s - 10),
    );
    // `--limit 2`: the other key's letter, then past the older letter to the newer.
    let said = stdout(&dead(&url, &["dead", "requeue", "--limit", "2"]));
    assert!(said.starts_with("requeued 2\n"), "{said}");
    assert!(said.contains("a newer letter of it is dead"), "{said}");
    let queued = lrange(&mut con, "normal");
    assert_eq!(queued.len(), 2, "{queued:?}");
    assert!(queued[0].contains(r#""v":"NEW""#), "{queued:?}");
    assert!(queued[1].contains(r#""v":"OTHER""#), "{queued:?}");
    let left = lrange(&mut con, "normal:dead");
    assert_eq!(left.len(), 1);
    assert!(left[0].contains(r#"\"v\":\"OLD\""#), "{left:?}");

    // Requeuing all of them at once does the same: the newer goes back, the older stays.
    redis::cmd("DEL")
        .arg("normal")
        .query::<()>(&mut con)
        .unwrap();
    lpush(
        &mut con,
        "normal:dead",
        &letter("normal", &msg("NEWEST"), "order.timeout", key, now_s - 5),
    );
    let said = stdout(&dead(&url, &["dead", "requeue"]));
    assert!(said.starts_with("requeued 1\n"), "{said}");
    let queued = lrange(&mut con, "normal");
    assert_eq!(queued.len(), 1, "{queued:?}");
    assert!(queued[0].contains(r#""v":"NEWEST""#), "{queued:?}");
    assert_eq!(llen(&mut con, "normal:dead"), 1);
}

/// A long dead list is requeued whole, a page at a time, and the rule holds among its
/// newest letters: the older letter of a key whose newer one is dead stays. (A requeue
/// looks from the tail for its letters and through the dead list's 10,000 newest for a
/// newer one, so a long list costs each call what lies behind its letters.)
#[test]
fn a_long_dead_list_is_requeued_whole_but_a_key_s_older_letter() {
    let r = RedisServer::start();
    let mut con = r.con();
    let url = r.url();
    let now_s = now_ms() / 1000;
    let mut pipe = redis::pipe();
    for i in 0..10_500 {
        let msg = format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"SO-{i}"}},"retry":1,"ts":1}}"#
        );
        let key = format!("order.timeout:SO-{i}");
        pipe.cmd("LPUSH")
            .arg("normal:dead")
            .arg(letter("normal", &msg, "order.timeout", &key, now_s - 60))
            .ignore();
    }
    pipe.query::<()>(&mut con).unwrap();
    for v in ["OLD", "NEW"] {
        let msg = format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"SO-K","v":"{v}"}},"retry":1,"ts":1}}"#
        );
        lpush(
            &mut con,
            "normal:dead",
            &letter(
                "normal",
                &msg,
                "order.timeout",
                "order.timeout:SO-K",
                now_s - 30,
            ),
        );
    }
    let said = stdout(&dead(&url, &["dead", "requeue"]));
    assert!(said.starts_with("requeued 10501\n"), "{said}");
    assert_eq!(llen(&mut con, "normal"), 10_501);
    let left = lrange(&mut con, "normal:dead");
    assert_eq!(left.len(), 1);
    assert!(left[0].contains(r#"\"v\":\"OLD\""#), "{left:?}");
    let queued = lrange(&mut con, "normal");
    assert!(
        queued[0].contains(r#""v":"NEW""#),
        "the newest went back last"
    );
}

/// One queue's dead list of another type (a string set by hand): `dead list` lists the
/// other queues' letters, names the key it could not read, and exits 1 (found from
/// outside: it printed only the error, hiding every other queue's letters).
#[test]
fn a_dead_list_of_the_wrong_type_is_named_and_the_others_are_listed() {
    let r = RedisServer::start();
    let mut con = r.con();
    let url = r.url();
    let now_s = now_ms() / 1000;
    let msg = r#"{"order_no":"SO-D","retry":0}"#;
    lpush(
        &mut con,
        "pay:dead",
        &letter("pay", msg, "payment.paid", "pay:sha1:d", now_s - 60),
    );
    redis::cmd("SET")
        .arg("normal:dead")
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    for json in [false, true] {
        let args: &[&str] = if json {
            &["dead", "list", "--json"]
        } else {
            &["dead", "list"]
        };
        let o = dead(&url, args);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
        let (out, err) = (text(&o.stdout), text(&o.stderr));
        assert!(out.contains("pay:sha1:d"), "{out}");
        assert!(
            err.contains("normal:dead") && err.contains("not a list"),
            "{err}"
        );
    }
}
