//! Hostile input: every message crafted to break the decoder is dead-lettered with a precise
//! reason or handled as a no-op, odd scores and job keys are handled, and the worker keeps
//! working through it.

use crate::support::*;

use std::collections::HashMap;
use std::time::Duration;

fn dead_reasons(env: &Env) -> HashMap<String, String> {
    dead_letters(env)
        .into_iter()
        .map(|d| (d["key"].clone(), d["reason"].clone()))
        .collect()
}

const WAIT: Duration = Duration::from_secs(60);

/// Writes a job the way any producer could: raw bytes for key, message and score.
fn raw_push(env: &Env, key: &[u8], msg: &[u8], score: &str) {
    let mut con = env.con();
    redis::cmd("HSET")
        .arg(&env.config.keys.data)
        .arg(key)
        .arg(msg)
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("ZADD")
        .arg(&env.config.keys.pool)
        .arg(score)
        .arg(key)
        .query::<()>(&mut con)
        .unwrap();
}

#[test]
fn hostile_messages_are_dead_lettered_with_a_reason_or_are_no_ops() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 200);
    let nested = format!(
        r#"{{"event":"order.timeout","payload":{{"order_no":{}1{}}}}}"#,
        "[".repeat(500),
        "]".repeat(500)
    );
    let long_no = "S".repeat(20_000);
    let dead_cases: Vec<(&str, String, &str)> = vec![
        ("h-notjson", "{{{{".into(), "not JSON"),
        ("h-array", "[1,2,3]".into(), "not a JSON object"),
        (
            "h-event-type",
            r#"{"event":["order.timeout"],"payload":{}}"#.into(),
            "\"event\" is not",
        ),
        (
            "h-payload-type",
            r#"{"event":"order.timeout","payload":"SO1"}"#.into(),
            "\"payload\" is not a JSON object",
        ),
        (
            "h-retry-type",
            r#"{"event":"order.timeout","payload":{"order_no":"SO1"},"retry":"x"}"#.into(),
            "\"retry\"",
        ),
        (
            "h-no-payload",
            r#"{"event":"order.timeout"}"#.into(),
            "no \"payload\"",
        ),
        (
            "h-unknown",
            r#"{"event":"order.explode","payload":{}}"#.into(),
            "unknown event",
        ),
        (
            "h-id-object",
            r#"{"event":"order.timeout","payload":{"order_id":{"a":1}}}"#.into(),
            "invalid input syntax for type bigint",
        ),
        (
            "h-id-float",
            r#"{"event":"order.timeout","payload":{"order_id":1.5}}"#.into(),
            "invalid input syntax for type bigint",
        ),
        (
            "h-nul",
            r#"{"event":"order.timeout","payload":{"order_no":"SO\u0000X"}}"#.into(),
            "handler failed",
        ),
        ("h-deep", nested, "not JSON: recursion limit"),
        (
            "h-big",
            format!(
                r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}}}}"#,
                "x".repeat(70_000)
            ),
            "too large",
        ),
    ];
    let now = delay_worker::now_ms();
    for (k, msg, _) in &dead_cases {
        raw_push(&env, k.as_bytes(), msg.as_bytes(), &(now - 1).to_string());
    }
    raw_push(
        &env,
        b"h-utf8",
        &[b'{', b'"', 0xc3, 0x28, b'"', b'}'],
        &(now - 1).to_string(),
    );
    // No-ops: valid messages naming orders that do not exist, however odd their names.
    let noops: Vec<(&str, String)> = vec![
        (
            "h-sql",
            r#"{"event":"order.timeout","payload":{"order_no":"SO'; DROP TABLE orders; --"}}"#
                .into(),
        ),
        (
            "h-long",
            format!(r#"{{"event":"order.timeout","payload":{{"order_no":"{long_no}"}}}}"#),
        ),
        (
            "h-number-no",
            r#"{"event":"order.timeout","payload":{"order_no":12345}}"#.into(),
        ),
        (
            "h-unicode",
            r#"{"event":"order.timeout","payload":{"order_no":"注文\ud83d\ude00🙂"}}"#.into(),
        ),
    ];
    for (k, msg) in &noops {
        raw_push(&env, k.as_bytes(), msg.as_bytes(), &(now - 1).to_string());
    }
    // Scores: far past, negative and -inf are due; huge and +inf never are.
    let ok_msg = |o: &SeedOrder| {
        format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}}}}"#,
            o.order_no
        )
    };
    raw_push(&env, b"s-far-past", ok_msg(&orders[0]).as_bytes(), "1");
    raw_push(
        &env,
        b"s-negative",
        ok_msg(&orders[1]).as_bytes(),
        "-1000000000",
    );
    raw_push(&env, b"s-minus-inf", ok_msg(&orders[2]).as_bytes(), "-inf");
    raw_push(&env, b"s-huge", ok_msg(&orders[3]).as_bytes(), "1e300");
    raw_push(&env, b"s-plus-inf", ok_msg(&orders[4]).as_bytes(), "+inf");
    let nan: redis::RedisResult<()> = redis::cmd("ZADD")
        .arg(&env.config.keys.pool)
        .arg("nan")
        .arg("s-nan")
        .query(&mut env.con());
    assert!(nan.is_err(), "Redis itself refuses a NaN score");
    // Odd bytes in job keys.
    raw_push(
        &env,
        b"k-\x00\xff\n\"'\\ key",
        ok_msg(&orders[5]).as_bytes(),
        &(now - 1).to_string(),
    );
    raw_push(
        &env,
        "k-ключ-🔑".as_bytes(),
        ok_msg(&orders[6]).as_bytes(),
        &(now - 1).to_string(),
    );

    let daemon = Daemon::start(&env.config);
    let expected_done = noops.len() + 5;
    // The three PostgreSQL refuses (h-id-object, h-id-float, h-nul), refused together with
    // nothing changed after them, wait for a job of their event to change something.
    wait_until(WAIT, "the hostile batch", || {
        inbox_count(&env.db) as usize == expected_done
            && dead_reasons(&env).len() >= dead_cases.len() + 1 - 3
    });
    // The worker still works: a normal load after the hostile one, which shows the three
    // refusals were their own.
    push_timeouts(&env, &orders[7..], 0);
    wait_until(WAIT, "the normal load and the refused three", || {
        inbox_count(&env.db) as usize == expected_done + orders.len() - 7
            && dead_reasons(&env).len() == dead_cases.len() + 1
    });
    let report = daemon.stop();

    let reasons = dead_reasons(&env);
    for (k, _, want) in &dead_cases {
        let got = reasons
            .get(*k)
            .unwrap_or_else(|| panic!("{k} was not dead-lettered"));
        assert!(got.contains(want), "{k}: {got:?} should say {want:?}");
    }
    assert!(reasons["h-utf8"].contains("UTF-8"));
    assert_eq!(
        report.stats.dead as usize,
        dead_cases.len() + 1,
        "{}",
        report.stats
    );
    let mut db = env.db.client();
    let n: i64 = db
        .query_one("SELECT count(*) FROM orders", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 200, "the orders table is intact");
    let keys: Vec<String> = db
        .query(
            "SELECT job_key FROM worker_inbox WHERE job_key LIKE '\\\\x%' OR job_key LIKE 'k-%'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        keys.iter().any(|k| k.starts_with("\\x6b2d00ff")),
        "binary key kept as hex: {keys:?}"
    );
    assert!(keys.iter().any(|k| k == "k-ключ-🔑"), "{keys:?}");
    // Orders 3 and 4 have never-due scores and stay scheduled; every other one is cancelled.
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, o)| o)
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    let pushed = dead_cases.len() + 1 + noops.len() + 7 + (orders.len() - 7);
    assert_all_accounted(&env, &env.db, pushed);
    assert_eq!(books(&env).pool, 2);
}
