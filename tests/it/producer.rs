//! Push, reschedule and cancel write exactly the wire contract.

use crate::support::*;
use delay_worker::keys::Keys;
use delay_worker::producer::{self, NewJob};
use serde_json::json;

#[test]
fn push_writes_data_and_score_and_reschedules_by_key() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::default();
    let now = 1_768_764_300_000;
    let job = NewJob {
        event: "order.timeout".into(),
        payload: json!({"order_no": "SO1"}),
        due_ms: now + 900_000,
        key: Some("order.timeout:SO1".into()),
    };
    let p = producer::push(&mut con, &keys, &job, now).unwrap();
    assert!(!p.rescheduled);
    let score: i64 = redis::cmd("ZSCORE")
        .arg("mq:delay:pool")
        .arg("order.timeout:SO1")
        .query(&mut con)
        .unwrap();
    assert_eq!(score, now + 900_000);
    let msg: String = redis::cmd("HGET")
        .arg("mq:delay:pool:data")
        .arg("order.timeout:SO1")
        .query(&mut con)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&msg).unwrap();
    assert_eq!(
        v,
        json!({"event": "order.timeout", "payload": {"order_no": "SO1"}, "retry": 0, "ts": 1_768_764_300})
    );

    // Same key again: moved to the new time, still one job.
    let later = NewJob {
        due_ms: now + 60_000,
        ..job.clone()
    };
    assert!(
        producer::push(&mut con, &keys, &later, now)
            .unwrap()
            .rescheduled
    );
    let n: usize = redis::cmd("ZCARD")
        .arg("mq:delay:pool")
        .query(&mut con)
        .unwrap();
    assert_eq!(n, 1);
    let score: i64 = redis::cmd("ZSCORE")
        .arg("mq:delay:pool")
        .arg("order.timeout:SO1")
        .query(&mut con)
        .unwrap();
    assert_eq!(score, now + 60_000);

    // Cancel says whether the job existed, and removes score and data together.
    assert!(producer::cancel(&mut con, &keys, "order.timeout:SO1").unwrap());
    assert!(!producer::cancel(&mut con, &keys, "order.timeout:SO1").unwrap());
    let n: usize = redis::cmd("ZCARD")
        .arg("mq:delay:pool")
        .query(&mut con)
        .unwrap();
    let h: usize = redis::cmd("HLEN")
        .arg("mq:delay:pool:data")
        .query(&mut con)
        .unwrap();
    assert_eq!((n, h), (0, 0));
}

#[test]
fn generated_keys_are_unique_and_bad_jobs_are_refused() {
    let r = RedisServer::start();
    let mut con = r.con();
    let keys = Keys::with_prefix("{shop1}");
    let now = delay_worker::now_ms();
    let mut seen = std::collections::HashSet::new();
    for i in 0..200 {
        let job = NewJob {
            event: "coupon.expire".into(),
            payload: json!({"coupon_id": i}),
            due_ms: now,
            key: None,
        };
        seen.insert(producer::push(&mut con, &keys, &job, now).unwrap().key);
    }
    assert_eq!(seen.len(), 200);
    let n: usize = redis::cmd("ZCARD")
        .arg("{shop1}:delay:pool")
        .query(&mut con)
        .unwrap();
    assert_eq!(n, 200);

    let bad = NewJob {
        event: "x".into(),
        payload: json!([1]),
        due_ms: now,
        key: None,
    };
    assert!(matches!(
        producer::push(&mut con, &keys, &bad, now),
        Err(producer::PushError::PayloadNotObject)
    ));
}
