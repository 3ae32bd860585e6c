//! Retention trims acknowledged stream entries and never a pending or undelivered one.

use crate::support::*;
use delay_worker::store::stream::{ensure_group, trim_acknowledged};
use redis::Value;
use std::time::Duration;

fn ids(con: &mut redis::Connection, stream: &str) -> Vec<String> {
    let v: Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    match v {
        Value::Array(es) => es
            .iter()
            .filter_map(|e| match e {
                Value::Array(p) => Some(delay_worker::store::value_to_string(&p[0])),
                _ => None,
            })
            .collect(),
        _ => vec![],
    }
}

#[test]
fn retention_never_trims_a_pending_or_undelivered_entry() {
    let r = RedisServer::start();
    let keys = delay_worker::keys::Keys::default();
    let mut con = r.con();
    let now = delay_worker::now_ms();
    let old = now - 48 * 3600 * 1000;
    for i in 1..=4 {
        redis::cmd("XADD")
            .arg(&keys.stream)
            .arg(format!("{old}-{i}"))
            .arg("msg")
            .arg("{}")
            .query::<String>(&mut con)
            .unwrap();
    }
    redis::cmd("XADD")
        .arg(&keys.stream)
        .arg(format!("{now}-0"))
        .arg("msg")
        .arg("{}")
        .query::<String>(&mut con)
        .unwrap();
    ensure_group(&mut con, &keys).unwrap();
    // Three read, the first acked, two left pending; the fourth never read.
    let _: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg("x")
        .arg("COUNT")
        .arg(3)
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(&mut con)
        .unwrap();
    redis::cmd("XACK")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg(format!("{old}-1"))
        .query::<i64>(&mut con)
        .unwrap();

    let day = Duration::from_secs(24 * 3600);
    assert_eq!(trim_acknowledged(&mut con, &keys, day, now).unwrap(), 1);
    assert_eq!(
        ids(&mut con, &keys.stream),
        vec![
            format!("{old}-2"),
            format!("{old}-3"),
            format!("{old}-4"),
            format!("{now}-0")
        ],
        "pending and undelivered entries stay"
    );

    // Everything old acknowledged: trimmed up to the retention, the recent entry kept.
    let _: Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg("x")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(&mut con)
        .unwrap();
    for i in 2..=4 {
        redis::cmd("XACK")
            .arg(&keys.stream)
            .arg(&keys.group)
            .arg(format!("{old}-{i}"))
            .query::<i64>(&mut con)
            .unwrap();
    }
    redis::cmd("XACK")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg(format!("{now}-0"))
        .query::<i64>(&mut con)
        .unwrap();
    assert_eq!(trim_acknowledged(&mut con, &keys, day, now).unwrap(), 3);
    assert_eq!(ids(&mut con, &keys.stream), vec![format!("{now}-0")]);
    // Zero retention keeps everything.
    assert_eq!(
        trim_acknowledged(
            &mut con,
            &keys,
            Duration::ZERO,
            now + day.as_millis() as i64
        )
        .unwrap(),
        0
    );
}
