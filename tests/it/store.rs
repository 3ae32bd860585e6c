//! Ack last, script by script: each store script is made to fail a write (a key of the
//! wrong type where it would write) and the message must still be where it was; once the
//! key is fixed, the same call finishes the job. Plus the screens: no message over the
//! size limit is ever returned to the worker.

use crate::support::*;
use delay_worker::delivery::{Delivery, Origin, Outcome, Settlement};
use delay_worker::keys::{Keys, Queue};
use delay_worker::source::Usable;
use delay_worker::store::{
    self, dead, list, stream, MoveReport, Pool, Settled, StoreError, Target,
};
use redis::{Connection, Value};
use std::time::{Duration, Instant};

const NOW: i64 = 1_800_000_000_000;
const MAX: usize = 64 * 1024;

fn keys() -> Keys {
    Keys::default()
}

fn is_wrong_type(r: &Result<impl std::fmt::Debug, StoreError>, key: &str) {
    match r {
        Err(StoreError::WrongType { key: k, .. }) => assert_eq!(k, key),
        other => panic!("expected a WRONGTYPE on {key}, got {other:?}"),
    }
}

fn set_string(con: &mut Connection, key: &str) {
    redis::cmd("SET")
        .arg(key)
        .arg("x")
        .query::<()>(con)
        .unwrap();
}

fn del(con: &mut Connection, key: &str) {
    redis::cmd("DEL").arg(key).query::<()>(con).unwrap();
}

fn zcard(con: &mut Connection, key: &str) -> usize {
    redis::cmd("ZCARD").arg(key).query(con).unwrap()
}

fn xlen(con: &mut Connection, key: &str) -> usize {
    redis::cmd("XLEN").arg(key).query(con).unwrap()
}

fn llen(con: &mut Connection, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(con).unwrap()
}

/// The data a key holds in the pool's data hash.
fn data_of(con: &mut Connection, k: &Keys, key: &str) -> String {
    redis::cmd("HGET").arg(&k.data).arg(key).query(con).unwrap()
}

fn hlen(con: &mut Connection, key: &str) -> usize {
    redis::cmd("HLEN").arg(key).query(con).unwrap()
}

fn pending(con: &mut Connection, k: &Keys) -> usize {
    stream::pending(con, k, 0, 10_000, None).unwrap().len()
}

fn schedule(con: &mut Connection, k: &Keys, key: &str, msg: &str) {
    store::push(con, k, key, msg, NOW - 1000).unwrap();
}

fn move_now(con: &mut Connection, k: &Keys) -> Result<MoveReport, StoreError> {
    move_at_most(con, k, 100)
}

/// One `move_due` call on our pool into the stream, at most `limit` members.
fn move_at_most(con: &mut Connection, k: &Keys, limit: usize) -> Result<MoveReport, StoreError> {
    move_at_most_at(con, k, NOW, limit)
}

/// One `move_due` call on `pool` into the stream at `now`, at most `limit` members.
fn move_from(
    con: &mut Connection,
    k: &Keys,
    pool: Pool<'_>,
    now: i64,
    limit: usize,
) -> Result<MoveReport, StoreError> {
    let target = Target::Stream {
        stream: &k.stream,
        dead: &k.dead,
    };
    store::move_due(con, pool, k, target, now.into(), limit, 60_000, MAX, 0)
}

/// [`move_at_most`] at another time.
fn move_at_most_at(
    con: &mut Connection,
    k: &Keys,
    now: i64,
    limit: usize,
) -> Result<MoveReport, StoreError> {
    let pool = Pool::Enveloped {
        pool: &k.pool,
        data: &k.data,
    };
    move_from(con, k, pool, now, limit)
}

const LEGACY: Pool<'static> = Pool::Legacy {
    pool: "delay:order_close",
    event: "order.timeout",
    cluster: false,
};

/// `store::settle` of one key set, at [`NOW`], as consumer `c1`.
fn settle(
    con: &mut Connection,
    k: &Keys,
    batch: &[Settlement],
) -> Result<store::SettleReport, StoreError> {
    store::settle(con, std::slice::from_ref(k), "c1", batch)
}

fn reading(k: &Keys) -> stream::Reading<'_> {
    stream::Reading {
        keys: k,
        consumer: "c1",
        max_bytes: MAX,
    }
}

/// `n` entries added to the stream of `k` (its group made), then read by `consumer`: the
/// ids it now has pending, oldest first.
fn pending_on(
    con: &mut Connection,
    k: &Keys,
    consumer: &str,
    n: usize,
    read: usize,
) -> Vec<String> {
    stream::ensure_group(con, k).unwrap();
    for i in 0..n {
        redis::cmd("XADD")
            .arg(&k.stream)
            .arg("*")
            .arg("msg")
            .arg(format!(r#"{{"event":"e","payload":{{"i":{i}}}}}"#))
            .query::<()>(con)
            .unwrap();
    }
    let reader = stream::Reading {
        keys: k,
        consumer,
        max_bytes: MAX,
    };
    stream::read(con, reader, read, ">")
        .unwrap()
        .deliveries
        .iter()
        .map(|d| d.stream_id().unwrap().to_string())
        .collect()
}

/// One entry moved into the stream and read by `c1`: pending on it.
fn one_pending(con: &mut Connection, k: &Keys, msg: &str) -> Delivery {
    stream::ensure_group(con, k).unwrap();
    schedule(con, k, "job-1", msg);
    assert_eq!(move_now(con, k).unwrap().moved, 1);
    let mut read = stream::read(con, reading(k), 10, ">").unwrap();
    assert_eq!(read.deliveries.len(), 1);
    read.deliveries.pop().unwrap()
}

#[test]
fn push_and_cancel_write_nothing_when_a_key_has_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    set_string(&mut con, &k.data);
    is_wrong_type(&store::push(&mut con, &k, "a", "{}", NOW), &k.data);
    assert_eq!(zcard(&mut con, &k.pool), 0, "no score without its data");
    del(&mut con, &k.data);
    store::push(&mut con, &k, "a", "{}", NOW).unwrap();
    set_string(&mut con, &k.data);
    is_wrong_type(&store::cancel(&mut con, &k, "a"), &k.data);
    assert_eq!(zcard(&mut con, &k.pool), 1, "still scheduled");
}

/// The plain commands on the stream (the reader's consumer listing, the trim's, the
/// pruner's pending look, the group's creation) name the key Redis's `WRONGTYPE` does not,
/// with the type it holds; a group removed with its stream says so, not "connection lost".
#[test]
fn plain_commands_on_a_stream_of_the_wrong_type_name_the_key() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    set_string(&mut con, &k.stream);
    is_wrong_type(&stream::consumers(&mut con, &k), &k.stream);
    is_wrong_type(&stream::pending(&mut con, &k, 0, 1, None), &k.stream);
    is_wrong_type(&stream::ensure_group(&mut con, &k), &k.stream);
    let e = stream::consumers(&mut con, &k).unwrap_err().to_string();
    assert!(
        e.contains(&format!("key {:?} holds a string, not a stream", k.stream)),
        "{e}"
    );
    del(&mut con, &k.stream);
    let e = stream::pending(&mut con, &k, 0, 1, None).unwrap_err();
    assert!(e.is_group_missing(), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("the consumer group is missing") && !text.contains("connection lost"),
        "{text}"
    );
}

#[test]
fn move_due_leaves_the_pool_alone_when_the_stream_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    schedule(&mut con, &k, "a", r#"{"event":"e","payload":{}}"#);
    set_string(&mut con, &k.stream);
    is_wrong_type(&move_now(&mut con, &k), &k.stream);
    assert_eq!(zcard(&mut con, &k.pool), 1, "still in the pool");
    let data: Option<String> = redis::cmd("HGET")
        .arg(&k.data)
        .arg("a")
        .query(&mut con)
        .unwrap();
    assert!(data.is_some(), "its data too");
    del(&mut con, &k.stream);
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 1);
    assert_eq!(xlen(&mut con, &k.stream), 1);
}

#[test]
fn move_due_keeps_a_member_it_cannot_bury_while_the_dead_letters_are_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    schedule(&mut con, &k, "good", r#"{"event":"e","payload":{}}"#);
    schedule(&mut con, &k, "big", &"b".repeat(MAX + 1));
    set_string(&mut con, &k.dead);
    let report = move_now(&mut con, &k).unwrap();
    assert_eq!(
        (report.moved, report.skipped),
        (1, 1),
        "the rest keeps moving"
    );
    assert_eq!(report.blocked.unwrap().key, k.dead);
    assert_eq!(zcard(&mut con, &k.pool), 1, "the big one waits in the pool");
    del(&mut con, &k.dead);
    let report = move_now(&mut con, &k).unwrap();
    assert_eq!(report.buried.len(), 1);
    assert_eq!((zcard(&mut con, &k.pool), xlen(&mut con, &k.dead)), (0, 1));
}

#[test]
fn move_due_buries_an_oversized_member_as_a_prefix_length_and_digest() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let big = format!(
        r#"{{"event":"e","payload":{{"x":"{}"}}}}"#,
        "y".repeat(10 << 20)
    );
    schedule(&mut con, &k, "big", &big);
    schedule(&mut con, &k, "small", r#"{"event":"e","payload":{}}"#);
    let report = move_now(&mut con, &k).unwrap();
    assert_eq!(report.moved, 1, "the rest keeps moving");
    assert_eq!(report.buried.len(), 1);
    assert!(
        report.buried[0].1.contains("too large"),
        "{:?}",
        report.buried
    );
    let entries = xrange(&mut con, &k.dead);
    let letter = &entries[0];
    assert_eq!(letter["length"], big.len().to_string());
    assert_eq!(letter["sha1"], sha1_hex(big.as_bytes()));
    assert_eq!(letter["msg"], big[..4096]);
    assert_eq!(letter["key"], "big");
    let bytes: i64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&k.dead)
        .query(&mut con)
        .unwrap();
    assert!(
        bytes < 64 * 1024,
        "no full copy in the dead letters: {bytes}"
    );
    assert_eq!(zcard(&mut con, &k.pool), 0);
}

#[test]
fn a_legacy_member_of_the_wrong_type_is_one_dead_letter_and_the_rest_moves() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    for i in 1..=4 {
        redis::cmd("SET")
            .arg(format!("close_order_{i}"))
            .arg(i)
            .query::<()>(&mut con)
            .unwrap();
    }
    redis::cmd("HSET")
        .arg("close_order_9")
        .arg("f")
        .arg("v")
        .query::<()>(&mut con)
        .unwrap();
    for i in [1, 2, 9, 3, 4] {
        redis::cmd("ZADD")
            .arg("delay:order_close")
            .arg(NOW - 1000 + i)
            .arg(format!("close_order_{i}"))
            .query::<()>(&mut con)
            .unwrap();
    }
    let report = move_from(&mut con, &k, LEGACY, NOW, 100).unwrap();
    assert_eq!(report.moved, 4);
    assert_eq!(report.buried.len(), 1);
    assert_eq!(report.buried[0].0, "close_order_9");
    assert!(report.buried[0].1.contains("holds a hash"));
    assert_eq!(zcard(&mut con, "delay:order_close"), 0);
    let kind: String = redis::cmd("TYPE")
        .arg("close_order_9")
        .query(&mut con)
        .unwrap();
    assert_eq!(kind, "hash", "the producer's key is left alone");
}

/// On a Cluster a legacy pool's members are read first and declared to the script; a
/// member whose key is in another hash slot than the pool is one dead letter saying so,
/// a member not due yet or gone meanwhile is left alone, and the batch limit holds.
#[test]
fn a_declared_legacy_pool_moves_its_tagged_members_and_buries_the_others() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = Keys::with_prefix("{close}");
    let pool_key = "{close}:delay:order_close";
    let pool = Pool::Legacy {
        pool: pool_key,
        event: "order.timeout",
        cluster: true,
    };
    let mut add = |member: &str, id: &str, score: i64| {
        redis::cmd("SET")
            .arg(member)
            .arg(id)
            .query::<()>(&mut con)
            .unwrap();
        redis::cmd("ZADD")
            .arg(pool_key)
            .arg(score)
            .arg(member)
            .query::<()>(&mut con)
            .unwrap();
    };
    for i in 1..=5 {
        add(
            &format!("{{close}}close_order_{i}"),
            &i.to_string(),
            NOW - 100 + i,
        );
    }
    add("close_order_9", "9", NOW - 50);
    // Seconds scores are read as their own kind.
    add("{close}close_order_7", "7", NOW / 1000 - 5);
    add("{close}close_order_8", "8", NOW + 60_000);

    let first = move_from(&mut con, &k, pool, NOW, 3).unwrap();
    assert_eq!(first.moved + first.buried.len(), 3, "{first:?}");
    let mut moved = first.moved;
    let mut buried = first.buried.clone();
    for _ in 0..5 {
        let r = move_from(&mut con, &k, pool, NOW, 3).unwrap();
        moved += r.moved;
        buried.extend(r.buried);
    }
    assert_eq!(moved, 6, "five tagged members and the seconds-score one");
    assert_eq!(buried.len(), 1, "{buried:?}");
    assert_eq!(buried[0].0, "close_order_9");
    assert!(buried[0].1.contains("another hash slot"), "{}", buried[0].1);
    let exists: bool = redis::cmd("EXISTS")
        .arg("close_order_9")
        .query(&mut con)
        .unwrap();
    assert!(exists, "the producer's key in another slot is left alone");
    // Only the member not due yet is left; the moved ones took their keys with them.
    let left: Vec<String> = redis::cmd("ZRANGE")
        .arg(pool_key)
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .unwrap();
    assert_eq!(left, vec!["{close}close_order_8".to_string()]);
    let entries = xrange(&mut con, &k.stream);
    let mut ids: Vec<i64> = entries
        .iter()
        .map(|e| {
            let v: serde_json::Value = serde_json::from_str(&e["msg"]).unwrap();
            v["payload"]["order_id"].as_i64().unwrap()
        })
        .collect();
    ids.sort();
    assert_eq!(ids, vec![1, 2, 3, 4, 5, 7]);
    let tagged_left: usize = (1..=7)
        .filter(|i| {
            redis::cmd("EXISTS")
                .arg(format!("{{close}}close_order_{i}"))
                .query::<bool>(&mut con)
                .unwrap()
        })
        .count();
    assert_eq!(tagged_left, 0);
}

#[test]
fn reads_hold_an_oversized_entry_back_while_the_dead_letters_are_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    stream::ensure_group(&mut con, &k).unwrap();
    for (key, msg) in [("big", "b".repeat(MAX + 1)), ("small", "{}".to_string())] {
        redis::cmd("XADD")
            .arg(&k.stream)
            .arg("*")
            .arg("msg")
            .arg(msg)
            .arg("key")
            .arg(key)
            .query::<()>(&mut con)
            .unwrap();
    }
    set_string(&mut con, &k.dead);
    let read = stream::read(&mut con, reading(&k), 10, ">").unwrap();
    assert_eq!(read.deliveries.len(), 1, "the small one is delivered");
    assert_eq!(read.blocked.unwrap().key, k.dead);
    assert_eq!(
        pending(&mut con, &k),
        2,
        "the big one stays pending, unread"
    );
    del(&mut con, &k.dead);
    let read = stream::read(&mut con, reading(&k), 10, "0").unwrap();
    assert_eq!(read.buried.len(), 1, "buried once the key is fixed");
    assert_eq!(
        pending(&mut con, &k),
        1,
        "only the small one, with its worker"
    );
}

#[test]
fn reads_never_return_an_oversized_entry() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    stream::ensure_group(&mut con, &k).unwrap();
    let big = vec![b'x'; 200_000];
    redis::cmd("XADD")
        .arg(&k.stream)
        .arg("*")
        .arg("msg")
        .arg(&big)
        .arg("key")
        .arg("by-hand")
        .query::<()>(&mut con)
        .unwrap();
    let read = stream::read(&mut con, reading(&k), 10, ">").unwrap();
    assert!(read.deliveries.is_empty());
    assert_eq!(read.buried.len(), 1);
    assert_eq!(pending(&mut con, &k), 0, "acknowledged after its letter");
    let letter = &xrange(&mut con, &k.dead)[0];
    assert_eq!(letter["length"], "200000");
    assert_eq!(letter["msg"].len(), 4096);
}

fn dead_of(d: &Delivery, reason: &str) -> Settlement {
    Settlement::new(
        d.clone(),
        Outcome::Dead {
            reason: reason.into(),
            event: String::new(),
            attempts: 1,
        },
    )
}

fn retry_of(d: &Delivery, msg: impl Into<Vec<u8>>, due_ms: i64) -> Settlement {
    Settlement::new(
        d.clone(),
        Outcome::Retry {
            msg: msg.into(),
            due_ms,
        },
    )
}

/// A job key with more dead letters than its index keeps (8): found from outside, once its
/// newer letters were requeued or purged, an older one went back while one past the index
/// was still dead. The index marks the key, and the requeue then looks in the letters.
#[test]
fn a_key_with_more_letters_than_its_index_keeps_requeues_an_older_one_only_when_no_newer_is_dead() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let mut letters = Vec::new();
    for i in 0..10 {
        let d = one_pending(
            &mut con,
            &k,
            &format!(r#"{{"event":"e","payload":{{"i":{i}}}}}"#),
        );
        assert_eq!(
            settle(&mut con, &k, &[dead_of(&d, "by hand")])
                .unwrap()
                .each
                .len(),
            1
        );
        let last: Vec<(String, std::collections::HashMap<String, String>)> =
            redis::cmd("XREVRANGE")
                .arg(&k.dead)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query(&mut con)
                .unwrap();
        letters.push(last[0].0.clone());
    }
    // The 8 newest purged: the index names none of the key's letters now.
    let newest: Vec<&str> = letters[2..].iter().map(String::as_str).collect();
    assert_eq!(store::dead::purge(&mut con, &k, &newest).unwrap(), 8);
    let msg = br#"{"event":"e","payload":{"i":0},"retry":0}"#;
    let oldest = (letters[0].as_str(), b"job-1".as_slice(), msg.as_slice());
    assert_eq!(
        store::dead::requeue(&mut con, &k, &[oldest], NOW).unwrap(),
        vec![store::dead::Requeued::KeyScheduled],
        "the second letter is still dead"
    );
    let second = (letters[1].as_str(), b"job-1".as_slice(), msg.as_slice());
    assert_eq!(
        store::dead::requeue(&mut con, &k, &[second], NOW).unwrap(),
        vec![store::dead::Requeued::Requeued]
    );
}

#[test]
fn settle_writes_the_dead_letter_and_the_retry_before_the_ack() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, "not json");
    let dead = dead_of(&d, "message is not JSON");
    // The defect this guards against: the ack went first, the dead letter failed, and
    // the message was nowhere.
    set_string(&mut con, &k.dead);
    let report = settle(&mut con, &k, std::slice::from_ref(&dead)).unwrap();
    assert_eq!(report.each, vec![Settled::Blocked]);
    assert_eq!(report.blocked.unwrap().key, k.dead);
    assert_eq!(pending(&mut con, &k), 1, "still pending");
    del(&mut con, &k.dead);
    let report = settle(&mut con, &k, &[dead]).unwrap();
    assert_eq!(report.each, vec![Settled::Applied]);
    assert_eq!(pending(&mut con, &k), 0);
    assert_eq!(xlen(&mut con, &k.dead), 1);

    // The retry path: the pool of the wrong type keeps the entry pending, and an ack in
    // the same batch still goes through.
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{}}"#);
    let retry = retry_of(&d, br#"{"event":"e","payload":{},"retry":1}"#.to_vec(), NOW);
    set_string(&mut con, &k.pool);
    let report = settle(&mut con, &k, std::slice::from_ref(&retry)).unwrap();
    assert_eq!(report.each, vec![Settled::Blocked]);
    assert_eq!(pending(&mut con, &k), 1);
    del(&mut con, &k.pool);
    let report = settle(&mut con, &k, std::slice::from_ref(&retry)).unwrap();
    assert_eq!(report.each, vec![Settled::Applied]);
    assert_eq!(zcard(&mut con, &k.pool), 1, "back in the pool");
    let again = settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(again.each, vec![Settled::AlreadySettled], "never twice");
    assert_eq!(zcard(&mut con, &k.pool), 1);
}

#[test]
fn burying_the_over_delivered_leaves_them_pending_when_the_dead_letters_are_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    one_pending(&mut con, &k, r#"{"event":"e","payload":{}}"#);
    // Delivered more often than a limit of 0.
    let over = stream::OverDelivered {
        only: None,
        min_idle: Duration::ZERO,
        max_deliveries: 0,
        scan: 10,
    };
    let stream::Looked {
        candidates: looked,
        blocked,
        ..
    } = stream::overdelivered(&mut con, reading(&k), over).unwrap();
    assert_eq!(looked.len(), 1);
    assert!(blocked.is_none());
    assert!(String::from_utf8_lossy(&looked[0].msg).contains(r#""payload":{}"#));
    assert_eq!(looked[0].key, b"job-1".to_vec());
    assert_eq!(looked[0].deliveries, 1);
    assert_eq!(pending(&mut con, &k), 1, "a look changes nothing");
    let dead = [(looked[0].id.clone(), stream::Verdict::Dead)];
    set_string(&mut con, &k.dead);
    let blocked = stream::overdelivered(&mut con, reading(&k), over)
        .unwrap()
        .blocked;
    assert_eq!(blocked.unwrap().key, k.dead, "a look names the key too");
    let out = stream::bury_overdelivered(&mut con, reading(&k), over, &dead).unwrap();
    assert!(out.buried.is_empty());
    assert_eq!(out.blocked.unwrap().key, k.dead);
    assert_eq!(pending(&mut con, &k), 1, "still pending");
    del(&mut con, &k.dead);
    // Buried, letter first, then acknowledged.
    let out = stream::bury_overdelivered(&mut con, reading(&k), over, &dead).unwrap();
    assert_eq!(out.buried.len(), 1);
    assert_eq!(pending(&mut con, &k), 0);
    assert_eq!(xlen(&mut con, &k.dead), 1);
    // Settled already: a second verdict on it does nothing.
    let again = stream::bury_overdelivered(&mut con, reading(&k), over, &dead).unwrap();
    assert_eq!((again.buried.len(), again.done), (0, 0));
    assert_eq!(xlen(&mut con, &k.dead), 1);

    // One whose job is done is acknowledged without a letter; one not looked at stays.
    one_pending(&mut con, &k, r#"{"event":"e","payload":{"n":1}}"#);
    one_pending(&mut con, &k, r#"{"event":"e","payload":{"n":2}}"#);
    let looked = stream::overdelivered(&mut con, reading(&k), over)
        .unwrap()
        .candidates;
    assert_eq!(looked.len(), 2);
    let done = [(looked[0].id.clone(), stream::Verdict::Done)];
    let out = stream::bury_overdelivered(&mut con, reading(&k), over, &done).unwrap();
    assert_eq!((out.buried.len(), out.done), (0, 1));
    assert_eq!(
        xlen(&mut con, &k.dead),
        1,
        "no letter for a job that was done"
    );
    assert_eq!(pending(&mut con, &k), 1, "the one without a verdict waits");
}

/// While the `starts` key holds another type an entry delivered more often than the limit
/// cannot be told from one killed processes held unrun: it is neither buried nor set back,
/// it stays pending and the key is named. Found from outside: the delivery count alone
/// decided, and 160 of 600 good jobs that never ran became dead letters under kills.
#[test]
fn over_delivered_entries_wait_while_the_starts_key_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{}}"#);
    let id = d.stream_id().unwrap().to_string();
    // Delivered four times, never started: held unrun by killed processes.
    delivered_and_started(&mut con, &k, "c1", &id, 4, None);
    let over = stream::OverDelivered {
        only: None,
        min_idle: Duration::ZERO,
        max_deliveries: 3,
        scan: 10,
    };
    set_string(&mut con, &k.starts);
    let looked = stream::overdelivered(&mut con, reading(&k), over).unwrap();
    assert_eq!(looked.blocked.unwrap().key, k.starts, "the key is named");
    assert_eq!(looked.forgiven, 0);
    let dead = [(id.clone(), stream::Verdict::Dead)];
    let out = stream::bury_overdelivered(&mut con, reading(&k), over, &dead).unwrap();
    assert!(out.buried.is_empty(), "{:?}", out.buried);
    assert_eq!(out.blocked.unwrap().key, k.starts);
    assert_eq!(xlen(&mut con, &k.dead), 0);
    assert_eq!(pending(&mut con, &k), 1, "still pending");
    // The key fixed: its job never started, so it is delivered again, not buried.
    del(&mut con, &k.starts);
    let looked = stream::overdelivered(&mut con, reading(&k), over).unwrap();
    assert!(looked.blocked.is_none());
    assert_eq!((looked.candidates.len(), looked.forgiven), (0, 1));
    assert_eq!(xlen(&mut con, &k.dead), 0);
}

/// An entry delivered more often than the limit whose job started fewer times than the
/// limit (counted starts: a first delivery's is not counted) is no poison message: held
/// unrun by killed processes, it stays, its delivery count set back to its starts. Found
/// from outside: with a first delivery taken as started, one real start after it made a
/// good job a dead letter under `--max-deliveries 2`. One whose job started as often as the
/// limit is named for the inbox look.
#[test]
fn an_entry_delivered_too_often_is_a_poison_message_only_if_its_job_started_that_often() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{}}"#);
    let id = d.stream_id().unwrap().to_string();
    let set = |con: &mut Connection, count: u64, started: u64| {
        delivered_and_started(con, &k, "c1", &id, count, Some(started));
    };
    let over = stream::OverDelivered {
        only: None,
        min_idle: Duration::ZERO,
        max_deliveries: 2,
        scan: 10,
    };
    set(&mut con, 3, 1);
    let looked = stream::overdelivered(&mut con, reading(&k), over).unwrap();
    assert_eq!((looked.candidates.len(), looked.forgiven), (0, 1));
    let p = stream::pending(&mut con, &k, 0, 10, None).unwrap();
    assert_eq!(p.len(), 1, "still pending");
    assert_eq!(p[0].deliveries, 1, "its count set back to its starts");

    set(&mut con, 3, 2);
    let looked = stream::overdelivered(&mut con, reading(&k), over).unwrap();
    assert_eq!((looked.candidates.len(), looked.forgiven), (1, 0));
}

/// [`an_entry_delivered_too_often_is_a_poison_message_only_if_its_job_started_that_often`]
/// in list mode: a message whose next fetch is over the limit is fetched again while its
/// job started fewer times than the limit, its fetch count set back.
#[test]
fn a_list_message_fetched_too_often_is_fetched_again_if_its_job_started_fewer_times() {
    let r = RedisServer::start();
    let mut con = r.con();
    let mut k = keys();
    k.queues = vec![delay_worker::keys::Queue::new("q", None)];
    let q = &k.queues[0];
    let msg = r#"{"event":"e","payload":{}}"#;
    redis::cmd("LPUSH")
        .arg(&q.name)
        .arg(msg)
        .query::<()>(&mut con)
        .unwrap();
    let digest = fetched_and_started(&mut con, q, msg, 2, 1);
    let f = list::fetch(&mut con, &k, "c1", 10, 2, MAX).unwrap();
    assert!(f.over.is_none());
    assert_eq!(f.messages.len(), 1, "fetched again");
    let count: u64 = redis::cmd("HGET")
        .arg(q.deliveries())
        .arg(&digest)
        .query(&mut con)
        .unwrap();
    assert_eq!(count, 2, "its starts and this fetch");
}

#[test]
fn a_dead_consumer_s_entries_are_all_taken_over_at_once() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    assert_eq!(
        pending_on(&mut con, &k, "dead-host", 2500, 5000).len(),
        2500
    );
    // Entries must be idle a second before they can be taken (a peer's fresh claim is
    // not stolen back): age them instead of sleeping.
    age_pending(&mut con, &k, "dead-host");
    // A live peer keeps its work.
    store::heartbeat(&mut con, &k, "dead-host", Duration::from_secs(10), "{}").unwrap();
    assert_eq!(
        stream::take_over(&mut con, &k, "c1", "dead-host", HAS_DB).unwrap(),
        None
    );
    redis::cmd("DEL")
        .arg(k.heartbeat("dead-host"))
        .query::<()>(&mut con)
        .unwrap();
    // Not by a peer without a usable database: they would only wait in its workers.
    assert_eq!(
        stream::take_over(&mut con, &k, "c1", "dead-host", NO_DB).unwrap(),
        None
    );
    let mut taken = 0;
    // A peer that has one just now need not have had it for a while: the dead host runs
    // nothing.
    let now = Usable {
        now: true,
        settled: false,
    };
    while let Some(t) = stream::take_over(&mut con, &k, "c1", "dead-host", now).unwrap() {
        assert!(!t.without_database);
        taken += t.ids.len();
        if t.ids.len() < stream::TAKE_OVER_BATCH {
            break;
        }
    }
    assert_eq!(taken, 2500, "every entry, whatever a channel's room");
    let mine = stream::pending(&mut con, &k, 0, 10_000, Some("c1")).unwrap();
    assert_eq!(mine.len(), 2500);
    assert!(
        stream::consumers(&mut con, &k)
            .unwrap()
            .iter()
            .all(|c| c.name != "dead-host"),
        "a dead consumer that owes nothing is forgotten"
    );
}

/// A live consumer that marked itself as having no usable PostgreSQL gives up its pending
/// entries to a peer that has one, and to no other; it stays in the group, and keeps
/// its work once the mark is gone.
#[test]
fn a_live_consumer_without_a_database_gives_its_entries_only_to_a_peer_with_one() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    assert_eq!(pending_on(&mut con, &k, "stuck-host", 30, 20).len(), 20);
    let stuck = stream::Reading {
        keys: &k,
        consumer: "stuck-host",
        max_bytes: MAX,
    };
    age_pending(&mut con, &k, "stuck-host");
    let ttl = Duration::from_secs(10);
    store::heartbeat(&mut con, &k, "stuck-host", ttl, "{}").unwrap();
    // Alive and unmarked: kept.
    assert_eq!(
        stream::take_over(&mut con, &k, "c1", "stuck-host", HAS_DB).unwrap(),
        None
    );
    store::mark_without_database(&mut con, &k, "stuck-host", true, ttl).unwrap();
    // A peer without a database either takes nothing, nor one that has had one only
    // since just now (it may be back from an outage of every process's).
    for u in [
        NO_DB,
        Usable {
            now: true,
            settled: false,
        },
    ] {
        assert_eq!(
            stream::take_over(&mut con, &k, "c1", "stuck-host", u).unwrap(),
            None
        );
    }
    let t = stream::take_over(&mut con, &k, "c1", "stuck-host", HAS_DB)
        .unwrap()
        .expect("a peer with a database takes them");
    assert!(t.without_database);
    assert_eq!(t.ids.len(), 20);
    assert_eq!(
        stream::pending(&mut con, &k, 0, 100, Some("c1"))
            .unwrap()
            .len(),
        20
    );
    assert!(
        stream::consumers(&mut con, &k)
            .unwrap()
            .iter()
            .any(|c| c.name == "stuck-host"),
        "a live consumer stays in the group"
    );
    // Back with a database: the mark goes, and what it reads next stays its own.
    store::mark_without_database(&mut con, &k, "stuck-host", false, ttl).unwrap();
    assert_eq!(
        stream::read(&mut con, stuck, 20, ">")
            .unwrap()
            .deliveries
            .len(),
        10
    );
    age_pending(&mut con, &k, "stuck-host");
    assert_eq!(
        stream::take_over(&mut con, &k, "c1", "stuck-host", HAS_DB).unwrap(),
        None
    );
    assert_eq!(
        stream::pending(&mut con, &k, 0, 100, Some("stuck-host"))
            .unwrap()
            .len(),
        10
    );
}

/// Entries a reader took over and has not delivered yet are delivered only while it still
/// owns them: one a peer took from it meanwhile (it had no usable PostgreSQL and was
/// marked so) stays the peer's, not claimed back to run twice.
#[test]
fn taken_over_entries_a_peer_took_meanwhile_are_not_claimed_back() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let ids = pending_on(&mut con, &k, "c1", 4, 4);
    // A peer takes two of them.
    redis::cmd("XCLAIM")
        .arg(&k.stream)
        .arg(&k.group)
        .arg("peer")
        .arg(0)
        .arg(&ids[..2])
        .arg("JUSTID")
        .query::<Value>(&mut con)
        .unwrap();
    let read = stream::claim_ids(&mut con, reading(&k), &ids).unwrap();
    let got: Vec<&str> = read
        .deliveries
        .iter()
        .map(|d| d.stream_id().unwrap())
        .collect();
    assert_eq!(got, ids[2..].iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(read.gone, 0);
    assert_eq!(
        stream::pending(&mut con, &k, 0, 10, Some("peer"))
            .unwrap()
            .len(),
        2,
        "the peer keeps its two"
    );
}

/// The counted starts of entries deleted from the stream while pending (no settle will
/// clear them) are forgotten when a reader finds them gone: by a claim of idle entries,
/// by a delivery of entries it took over, and by a re-read of its own pending ones.
#[test]
fn the_starts_of_entries_gone_from_the_stream_while_pending_are_forgotten() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let ids = pending_on(&mut con, &k, "c1", 4, 4);
    for id in &ids {
        redis::cmd("HSET")
            .arg(&k.starts)
            .arg(id)
            .arg(1)
            .query::<()>(&mut con)
            .unwrap();
    }
    let starts = |con: &mut Connection| -> Vec<String> {
        let mut f: Vec<String> = redis::cmd("HKEYS").arg(&k.starts).query(con).unwrap();
        f.sort();
        f
    };
    redis::cmd("XDEL")
        .arg(&k.stream)
        .arg(&ids[..3])
        .query::<()>(&mut con)
        .unwrap();
    // Re-read from this consumer's own pending entries (as at a start).
    let read = stream::read(&mut con, reading(&k), 1, "0").unwrap();
    assert_eq!(read.gone, 1);
    assert_eq!(starts(&mut con), ids[1..].to_vec());
    // Delivered after a take-over, by id.
    let read = stream::claim_ids(&mut con, reading(&k), &ids[1..2]).unwrap();
    assert_eq!((read.gone, read.deliveries.len()), (1, 0));
    assert_eq!(starts(&mut con), ids[2..].to_vec());
    // Claimed as idle: the deleted one forgotten, the one still there kept.
    let (read, _) = stream::autoclaim(&mut con, reading(&k), Duration::ZERO, "0-0", 10).unwrap();
    assert_eq!((read.gone, read.deliveries.len()), (1, 1));
    assert_eq!(starts(&mut con), ids[3..].to_vec());
}

/// A caller of `take_over` that has had a usable PostgreSQL for a while, and one that has
/// none.
const HAS_DB: Usable = Usable {
    now: true,
    settled: true,
};
const NO_DB: Usable = Usable {
    now: false,
    settled: false,
};

/// Marks every entry pending on `consumer` idle for a minute (XCLAIM ... IDLE).
pub fn age_pending(con: &mut Connection, k: &Keys, consumer: &str) {
    let ids: Vec<String> = stream::pending(con, k, 0, 100_000, Some(consumer))
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    for chunk in ids.chunks(500) {
        redis::cmd("XCLAIM")
            .arg(&k.stream)
            .arg(&k.group)
            .arg(consumer)
            .arg(0)
            .arg(chunk)
            .arg("IDLE")
            .arg(60_000)
            .arg("JUSTID")
            .query::<()>(con)
            .unwrap();
    }
}

fn list_keys() -> Keys {
    Keys {
        queues: vec![Queue::new("q", None)],
        ..Default::default()
    }
}

#[test]
fn fetch_holds_an_oversized_message_back_while_the_dead_list_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = list_keys();
    let q = &k.queues[0];
    // Fetched from the tail: "small" first, then the oversized one.
    for m in ["small", &"z".repeat(MAX + 1)] {
        redis::cmd("LPUSH")
            .arg(&q.name)
            .arg(m)
            .query::<()>(&mut con)
            .unwrap();
    }
    // Behind the oversized one, more: it must not hold them back.
    redis::cmd("LPUSH")
        .arg(&q.name)
        .arg("behind")
        .query::<()>(&mut con)
        .unwrap();
    set_string(&mut con, &q.dead);
    let f = list::fetch(&mut con, &k, "c1", 10, 3, MAX).unwrap();
    assert_eq!(
        f.messages,
        vec![(0, b"small".to_vec(), 1), (0, b"behind".to_vec(), 1)]
    );
    assert_eq!(f.blocked.unwrap().key, q.dead);
    assert_eq!(
        llen(&mut con, &q.name),
        1,
        "the oversized one waits in its queue"
    );
    del(&mut con, &q.dead);
    let f = list::fetch(&mut con, &k, "c1", 10, 3, MAX).unwrap();
    assert!(f.messages.is_empty());
    assert_eq!(f.buried.len(), 1, "then it is a dead letter, never read");
    let letter: String = redis::cmd("LINDEX")
        .arg(&q.dead)
        .arg(0)
        .query(&mut con)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&letter).unwrap();
    assert_eq!(v["length"], MAX + 1);
    assert_eq!(v["msg"].as_str().unwrap().len(), 4096);
    assert_eq!(llen(&mut con, &q.name), 0);
}

#[test]
fn fetch_skips_a_queue_whose_processing_list_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = list_keys();
    let q = &k.queues[0];
    redis::cmd("LPUSH")
        .arg(&q.name)
        .arg("m")
        .query::<()>(&mut con)
        .unwrap();
    set_string(&mut con, &q.processing("c1"));
    let f = list::fetch(&mut con, &k, "c1", 10, 3, MAX).unwrap();
    assert!(f.messages.is_empty());
    assert_eq!(f.blocked.unwrap().key, q.processing("c1"));
    assert_eq!(llen(&mut con, &q.name), 1, "still queued");
}

#[test]
fn list_settle_and_push_back_keep_messages_when_a_key_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = list_keys();
    let q = k.queues[0].clone();
    redis::cmd("LPUSH")
        .arg(&q.name)
        .arg("m1")
        .query::<()>(&mut con)
        .unwrap();
    list::fetch(&mut con, &k, "c1", 10, 3, MAX).unwrap();
    let d = Delivery {
        origin: Origin::List { queue: 0 },
        key: b"k".to_vec(),
        msg: b"m1".to_vec(),
        due_ms: None,
        received: Instant::now(),
        shard: 0,
        holder_gone: false,
        redelivered: false,
    };
    let dead = dead_of(&d, "r");
    set_string(&mut con, &q.dead);
    let report = settle(&mut con, &k, std::slice::from_ref(&dead)).unwrap();
    assert_eq!(report.each, vec![Settled::Blocked]);
    assert_eq!(llen(&mut con, &q.processing("c1")), 1, "still held");
    del(&mut con, &q.dead);

    // Push-back of a dead consumer's list with its queue of the wrong type: nothing moves.
    set_string(&mut con, &q.name);
    is_wrong_type(
        &list::requeue_processing(&mut con, &k, "c1", false, false),
        &q.name,
    );
    assert_eq!(llen(&mut con, &q.processing("c1")), 1);
    del(&mut con, &q.name);

    let report = settle(&mut con, &k, &[dead]).unwrap();
    assert_eq!(report.each, vec![Settled::Applied]);
    assert_eq!(llen(&mut con, &q.processing("c1")), 0);
    assert_eq!(llen(&mut con, &q.dead), 1);
}

#[test]
fn requeue_of_dead_letters_keeps_the_letter_when_the_pool_is_the_wrong_type() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let id: String = redis::cmd("XADD")
        .arg(&k.dead)
        .arg("*")
        .arg("msg")
        .arg("{}")
        .query(&mut con)
        .unwrap();
    set_string(&mut con, &k.pool);
    let letters: [(&str, &[u8], &[u8]); 1] = [(&id, b"job", b"{}")];
    is_wrong_type(&dead::requeue(&mut con, &k, &letters, NOW), &k.pool);
    assert_eq!(xlen(&mut con, &k.dead), 1, "the letter stays");
    del(&mut con, &k.pool);
    assert_eq!(
        dead::requeue(&mut con, &k, &letters, NOW).unwrap(),
        vec![dead::Requeued::Requeued]
    );
    assert_eq!((xlen(&mut con, &k.dead), zcard(&mut con, &k.pool)), (0, 1));
}

fn xrange(con: &mut Connection, key: &str) -> Vec<std::collections::HashMap<String, String>> {
    let v: Value = redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query(con)
        .unwrap();
    let Value::Array(entries) = v else {
        return Vec::new();
    };
    entries
        .into_iter()
        .filter_map(|e| match e {
            Value::Array(mut pair) => match pair.pop() {
                Some(Value::Array(f)) => Some(
                    f.chunks(2)
                        .map(|c| (store::value_to_string(&c[0]), store::value_to_string(&c[1])))
                        .collect(),
                ),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn members_waiting_for_their_data_do_not_hold_back_the_ones_due_after_them() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    // ZADD before HSET (allowed): due first, no data yet, inside the grace.
    for i in 0..5 {
        redis::cmd("ZADD")
            .arg(&k.pool)
            .arg(NOW - 3000 + i)
            .arg(format!("orphan-{i}"))
            .query::<()>(&mut con)
            .unwrap();
    }
    for i in 0..3 {
        store::push(&mut con, &k, &format!("good-{i}"), "{}", NOW - 1000).unwrap();
    }
    let report = move_at_most(&mut con, &k, 1).unwrap();
    assert_eq!(report.moved, 1, "past the five waiting ones: {report:?}");
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 2);
    assert_eq!(
        zcard(&mut con, &k.pool),
        5,
        "the five still wait for their data"
    );
}

#[test]
fn unburiable_members_do_not_hold_back_the_ones_due_after_them() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    for i in 0..3 {
        store::push(
            &mut con,
            &k,
            &format!("big-{i}"),
            "b".repeat(MAX + 1),
            NOW - 3000,
        )
        .unwrap();
    }
    for i in 0..4 {
        store::push(&mut con, &k, &format!("good-{i}"), "{}", NOW - 1000).unwrap();
    }
    set_string(&mut con, &k.dead);
    assert_eq!(move_at_most(&mut con, &k, 2).unwrap().moved, 2);
    assert_eq!(move_at_most(&mut con, &k, 2).unwrap().moved, 2);
    assert_eq!(zcard(&mut con, &k.pool), 3, "only the unburiable wait");
}

fn stream_messages(con: &mut Connection, k: &Keys) -> Vec<String> {
    xrange(con, &k.stream)
        .into_iter()
        .map(|e| e["msg"].clone())
        .collect()
}

#[test]
fn a_retry_keeps_its_job_id_and_a_copy_pushed_again_is_the_job_it_pushes() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{},"retry":0}"#);
    let first = delay_worker::message::stamp_of(&d.msg).expect("stamped on its first move");
    // The worker's retry: the same message with retry raised, the stamp in front.
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    let retry = retry_of(&d, env.next_retry().into_bytes(), NOW - 10);
    settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 1);
    let msgs = stream_messages(&mut con, &k);
    assert_eq!(
        delay_worker::message::stamp_of(msgs[1].as_bytes()).as_deref(),
        Some(first.as_str()),
        "a retry is the same job"
    );
    // A producer copies that message and pushes the key again: a new job, the one it
    // pushed. The same copy pushed again with the same due time is that job again (it
    // cannot be told from its move undone by a failover and done again); with another
    // due time it is a new one.
    for score in [NOW - 5, NOW - 5, NOW - 4] {
        redis::cmd("HSET")
            .arg(&k.data)
            .arg("job-1")
            .arg(&msgs[1])
            .query::<()>(&mut con)
            .unwrap();
        redis::cmd("ZADD")
            .arg(&k.pool)
            .arg(score)
            .arg("job-1")
            .query::<()>(&mut con)
            .unwrap();
        assert_eq!(move_now(&mut con, &k).unwrap().moved, 1);
    }
    let msgs = stream_messages(&mut con, &k);
    let ids: Vec<String> = msgs
        .iter()
        .map(|m| delay_worker::message::stamp_of(m.as_bytes()).unwrap())
        .collect();
    assert_eq!(msgs.len(), 5);
    assert_eq!(ids[0], ids[1], "the retry shares the first id");
    assert_ne!(ids[2], ids[0], "a copy pushed again is a job of its own");
    assert_eq!(ids[3], ids[2], "the same push again is the same job");
    assert_ne!(ids[4], ids[2], "another due time is another job");
    for m in &msgs {
        assert_eq!(m.matches("job_id").count(), 1, "one stamp, never two: {m}");
    }
}

/// What a replica that missed a move still holds of it: the member, its score and its
/// data, put back as they were (the retry record too, if there was one).
fn undo_move(
    con: &mut Connection,
    pool: &str,
    data: Option<(&str, &str, &str)>,
    key: &str,
    score: i64,
) {
    if let Some((hash, field, value)) = data {
        redis::cmd("HSET")
            .arg(hash)
            .arg(field)
            .arg(value)
            .query::<()>(con)
            .unwrap();
    }
    redis::cmd("ZADD")
        .arg(pool)
        .arg(score)
        .arg(key)
        .query::<()>(con)
        .unwrap();
}

/// The move script reads and forgets its page's members a chunk of keys per command: a
/// call larger than a chunk (500) moves each member once and leaves nothing behind.
#[test]
fn a_move_larger_than_a_chunk_moves_each_member_once_and_forgets_them() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let n = 1201;
    for i in 0..n {
        let msg = format!(r#"{{"event":"e","payload":{{"i":{i}}},"retry":0}}"#);
        schedule(&mut con, &k, &format!("job-{i}"), &msg);
    }
    assert_eq!(move_at_most(&mut con, &k, 2000).unwrap().moved, n);
    assert_eq!(zcard(&mut con, &k.pool), 0);
    let left: usize = redis::cmd("HLEN").arg(&k.data).query(&mut con).unwrap();
    assert_eq!(left, 0, "every moved member's data is forgotten");
    let keys: std::collections::HashSet<String> = xrange(&mut con, &k.stream)
        .into_iter()
        .map(|e| e["key"].clone())
        .collect();
    assert_eq!(keys.len(), n, "each member moved once");
}

/// A job's identity is a contract between mover versions: a move undone by a failover and
/// done again by another version's mover must stamp the same id, or the inbox takes the
/// job for a new one. Pinned here, as the first identity mover stamped them, for each form
/// of score (milliseconds and seconds, whole and fractional) and of data (a stamp already
/// in it, non-ASCII, an empty object).
#[test]
fn every_mover_version_stamps_the_same_identity() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let m = r#"{"event":"order.timeout","payload":{"order_id":1},"retry":0,"ts":1800000000}"#;
    let members = [
        ("order:1", "1800000000123", m),
        ("order:2", "1800000000", m),
        ("order:3", "1800000000.5", m),
        ("order:4", "1800000000123.25", m),
        ("order:5", "100000000000", m),
        ("order:6", "0.001", m),
        (
            "заказ:7",
            "1800000000124",
            r#"{"job_id":"1-2-3","event":"order.timeout","payload":{"order_id":"é"},"retry":0}"#,
        ),
        ("order:8", "1800000000125", "{}"),
    ];
    for (key, score, data) in members {
        redis::pipe()
            .cmd("HSET")
            .arg(&k.data)
            .arg(key)
            .arg(data)
            .cmd("ZADD")
            .arg(&k.pool)
            .arg(score)
            .arg(key)
            .query::<()>(&mut con)
            .unwrap();
    }
    assert_eq!(
        move_at_most_at(&mut con, &k, NOW + 1000, 100)
            .unwrap()
            .moved,
        members.len()
    );
    let stamps: Vec<(String, String)> = xrange(&mut con, &k.stream)
        .into_iter()
        .map(|e| {
            let id = delay_worker::message::stamp_of(e["msg"].as_bytes()).unwrap();
            (e["key"].clone(), id)
        })
        .collect();
    let pinned = [
        ("order:6", "1000-378187411-1148351012"),
        ("order:2", "1800000000000000-2009577876-2784676445"),
        ("order:3", "1800000000500000-3695721502-898702894"),
        ("order:5", "100000000000000-2194261265-911581870"),
        ("order:1", "1800000000123000-2700014361-2779182286"),
        ("order:4", "1800000000123000-3143464949-3002844368"),
        ("заказ:7", "1800000000124000-2149458393-2378938818"),
        ("order:8", "1800000000125000-3832632631-1177586303"),
    ];
    let pinned: Vec<(String, String)> = pinned
        .iter()
        .map(|(k, id)| (k.to_string(), id.to_string()))
        .collect();
    assert_eq!(stamps, pinned);
}

#[test]
fn a_move_undone_and_done_again_is_the_same_job_and_another_push_is_not() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let msg = r#"{"event":"e","payload":{"v":1},"retry":0,"ts":1800000000}"#;
    let stamps = |con: &mut Connection| -> Vec<String> {
        stream_messages(con, &k)
            .iter()
            .map(|m| delay_worker::message::stamp_of(m.as_bytes()).unwrap())
            .collect()
    };
    // Moved, the move undone (as on a replica that never received it), moved again a
    // second later by another mover's call: the same id, the same bytes.
    store::push(&mut con, &k, "job-1", msg, NOW - 1000).unwrap();
    move_now(&mut con, &k).unwrap();
    undo_move(
        &mut con,
        &k.pool,
        Some((&k.data, "job-1", msg)),
        "job-1",
        NOW - 1000,
    );
    assert_eq!(
        move_at_most_at(&mut con, &k, NOW + 1000, 10).unwrap().moved,
        1
    );
    let ids = stamps(&mut con);
    assert_eq!(
        ids[0], ids[1],
        "a move undone and done again is the same job"
    );
    let msgs = stream_messages(&mut con, &k);
    assert_eq!(msgs[0], msgs[1]);
    // The identity's form: the due time in µs, then two numbers of the digest; digits
    // and dashes only, which every worker version reads as a stamp.
    let parts: Vec<&str> = ids[0].split('-').collect();
    assert_eq!(parts.len(), 3, "{}", ids[0]);
    assert_eq!(parts[0], ((NOW - 1000) * 1000).to_string());
    assert!(parts
        .iter()
        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())));
    // The same key pushed again with other data, or another due time, in the same
    // millisecond: new jobs.
    let other = r#"{"event":"e","payload":{"v":2},"retry":0,"ts":1800000000}"#;
    store::push(&mut con, &k, "job-1", other, NOW - 1000).unwrap();
    move_now(&mut con, &k).unwrap();
    store::push(&mut con, &k, "job-1", msg, NOW - 999).unwrap();
    move_now(&mut con, &k).unwrap();
    // Another key with the same data and due time: another job (the inbox keys it by
    // its key too), and so is the same key in another pool.
    store::push(&mut con, &k, "job-2", msg, NOW - 1000).unwrap();
    move_now(&mut con, &k).unwrap();
    let ids = stamps(&mut con);
    let distinct: std::collections::HashSet<&String> = ids[1..].iter().collect();
    assert_eq!(distinct.len(), 4, "{ids:?}");

    // A retry's move undone: its record is undone with it, and still names its job.
    let retried = ids[4].clone();
    let d = {
        stream::ensure_group(&mut con, &k).unwrap();
        let mut read = stream::read(&mut con, reading(&k), 10, ">").unwrap();
        read.deliveries.pop().unwrap()
    };
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    assert_eq!(env.job_id.as_deref(), Some(retried.as_str()));
    let retry = env.next_retry();
    settle(
        &mut con,
        &k,
        &[retry_of(&d, retry.clone().into_bytes(), NOW - 10)],
    )
    .unwrap();
    let record: String = redis::cmd("HGET")
        .arg(&k.jobs)
        .arg("job-2")
        .query(&mut con)
        .unwrap();
    move_now(&mut con, &k).unwrap();
    undo_move(
        &mut con,
        &k.pool,
        Some((&k.data, "job-2", &retry)),
        "job-2",
        NOW - 10,
    );
    undo_move(
        &mut con,
        &k.pool,
        Some((&k.jobs, "job-2", &record)),
        "job-2",
        NOW - 10,
    );
    move_at_most_at(&mut con, &k, NOW + 1000, 10).unwrap();
    let ids = stamps(&mut con);
    assert_eq!(
        &ids[5..],
        &[retried.clone(), retried],
        "the retry stays its job"
    );
}

#[test]
fn a_legacy_move_undone_and_done_again_builds_the_same_message() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    // A legacy producer's push: the STRING key, then the member.
    let legacy = |con: &mut Connection, order_id: &str, score: i64| {
        redis::cmd("SET")
            .arg("close_order_7")
            .arg(order_id)
            .query::<()>(con)
            .unwrap();
        undo_move(con, "delay:order_close", None, "close_order_7", score);
    };
    legacy(&mut con, "7", NOW - 1000);
    assert_eq!(move_from(&mut con, &k, LEGACY, NOW, 10).unwrap().moved, 1);
    // The STRING key and the member back, as the replica had them; moved again seconds
    // later: the message built is the same, `ts` (its due time) included.
    legacy(&mut con, "7", NOW - 1000);
    assert_eq!(
        move_from(&mut con, &k, LEGACY, NOW + 5000, 10)
            .unwrap()
            .moved,
        1
    );
    // Pushed again with another due time, or with another order id in the key: new jobs.
    legacy(&mut con, "7", NOW - 500);
    move_from(&mut con, &k, LEGACY, NOW + 5000, 10).unwrap();
    legacy(&mut con, "8", NOW - 1000);
    move_from(&mut con, &k, LEGACY, NOW + 5000, 10).unwrap();
    let msgs = stream_messages(&mut con, &k);
    assert_eq!(msgs.len(), 4);
    assert_eq!(msgs[0], msgs[1], "the same job, byte for byte");
    let v: serde_json::Value = serde_json::from_str(&msgs[0]).unwrap();
    assert_eq!(v["ts"], (NOW - 1000) / 1000, "its ts is its due time");
    let ids: std::collections::HashSet<String> = msgs
        .iter()
        .map(|m| delay_worker::message::stamp_of(m.as_bytes()).unwrap())
        .collect();
    assert_eq!(ids.len(), 3, "{msgs:?}");
}

#[test]
fn a_retry_of_an_unstamped_message_stays_unstamped() {
    // A message written straight into the stream has no stamp: its identity is its key and
    // ts. Its retry (or its re-queue after a PostgreSQL crash) must keep that identity, not
    // get a stamp of its own, or a job that had committed would run again.
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    stream::ensure_group(&mut con, &k).unwrap();
    let msg = r#"{"event":"e","payload":{},"ts":17}"#;
    redis::cmd("XADD")
        .arg(&k.stream)
        .arg("*")
        .arg("msg")
        .arg(msg)
        .arg("key")
        .arg("by-hand")
        .query::<()>(&mut con)
        .unwrap();
    let d = stream::read(&mut con, reading(&k), 10, ">")
        .unwrap()
        .deliveries
        .pop()
        .unwrap();
    let again = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    assert_eq!(again.job_id, None);
    let retry = retry_of(&d, again.next_retry().into_bytes(), NOW - 10);
    settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 1);
    let moved = stream_messages(&mut con, &k).pop().unwrap();
    assert!(!moved.contains("job_id"), "{moved}");
}

#[test]
fn a_retry_never_overwrites_a_newer_push_of_its_key() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{"v":1},"retry":0}"#);
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    // The producer pushes the key again while the first job runs.
    let newer = r#"{"event":"e","payload":{"v":2}}"#;
    store::push(&mut con, &k, "job-1", newer, NOW + 60_000).unwrap();
    let retry = retry_of(&d, env.next_retry().into_bytes(), NOW);
    let report = settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(report.each, vec![Settled::Superseded]);
    let data = data_of(&mut con, &k, "job-1");
    assert_eq!(data, newer, "the newer push keeps its slot");
    let letter = &xrange(&mut con, &k.dead)[0];
    assert!(letter["reason"].contains("pushed again"), "{letter:?}");
    // The letter names the retry's event and its attempts, as every letter does (so
    // `worker dead list --event` finds it).
    assert_eq!(
        (letter["event"].as_str(), letter["attempts"].as_str()),
        ("e", "1"),
        "{letter:?}"
    );
    assert_eq!(pending(&mut con, &k), 0);
}

/// Found from outside: a producer that wrote the data of a new push (HSET) while the
/// key's job ran, and its ZADD only later, lost that data to the job's retry written back
/// in between, silently. The data there is a push under way: the retry is the dead letter.
#[test]
fn a_retry_never_overwrites_the_data_of_a_push_whose_score_is_yet_to_come() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{"v":1},"retry":0}"#);
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    let newer = r#"{"event":"e","payload":{"v":2},"retry":0}"#;
    redis::cmd("HSET")
        .arg(&k.data)
        .arg("job-1")
        .arg(newer)
        .query::<()>(&mut con)
        .unwrap();
    let retry = retry_of(&d, env.next_retry().into_bytes(), NOW);
    let report = settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(report.each, vec![Settled::Superseded]);
    let data = data_of(&mut con, &k, "job-1");
    assert_eq!(data, newer, "the newer push's data stays");
    let scheduled: Option<f64> = redis::cmd("ZSCORE")
        .arg(&k.pool)
        .arg("job-1")
        .query(&mut con)
        .unwrap();
    assert_eq!(scheduled, None, "the producer's ZADD schedules it");
    let letter = &xrange(&mut con, &k.dead)[0];
    assert!(letter["reason"].contains("pushed again"), "{letter:?}");
    assert!(letter["msg"].contains(r#""v":1"#), "{letter:?}");
    assert_eq!(pending(&mut con, &k), 0);
}

/// Found from outside: a key pushed again and moved while its older job ran (the older
/// job failing on a lock), then the older job's retry written back to the pool: the older
/// job ran after all, and the newer one's own retry became the "superseded" letter. The
/// older retry is the letter: the newer move of its key says so.
#[test]
fn the_retry_of_a_job_whose_key_was_pushed_and_moved_again_is_the_letter() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let old = one_pending(&mut con, &k, r#"{"event":"e","payload":{"v":1},"retry":0}"#);
    store::push(
        &mut con,
        &k,
        "job-1",
        r#"{"event":"e","payload":{"v":2},"retry":0}"#,
        NOW - 5,
    )
    .unwrap();
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 1);
    let new = stream::read(&mut con, reading(&k), 10, ">")
        .unwrap()
        .deliveries
        .pop()
        .unwrap();
    let old_env = delay_worker::message::Envelope::decode(&old.msg, MAX).unwrap();
    let retry = retry_of(&old, old_env.next_retry().into_bytes(), NOW);
    let report = settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(report.each, vec![Settled::Superseded]);
    let letter = &xrange(&mut con, &k.dead)[0];
    assert!(letter["msg"].contains(r#""v":1"#), "{letter:?}");
    // The newer job's own retry goes back to the pool.
    let new_env = delay_worker::message::Envelope::decode(&new.msg, MAX).unwrap();
    let retry = retry_of(&new, new_env.next_retry().into_bytes(), NOW + 60_000);
    let report = settle(&mut con, &k, &[retry]).unwrap();
    assert_eq!(report.each, vec![Settled::Applied]);
    let data = data_of(&mut con, &k, "job-1");
    assert!(data.contains(r#""v":2"#), "{data}");
    assert_eq!(pending(&mut con, &k), 0);
}

#[test]
fn a_push_over_a_waiting_retry_is_a_new_job_and_the_retry_is_reported() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{"v":1},"retry":0}"#);
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    let retry = retry_of(&d, env.next_retry().into_bytes(), NOW + 60_000);
    settle(&mut con, &k, &[retry]).unwrap();
    // The producer pushes the key again while the retry waits: a push reschedules.
    store::push(
        &mut con,
        &k,
        "job-1",
        r#"{"event":"e","payload":{"v":2}}"#,
        NOW - 5,
    )
    .unwrap();
    let report = move_now(&mut con, &k).unwrap();
    assert_eq!(report.moved, 1);
    assert_eq!(report.buried.len(), 1, "{report:?}");
    assert!(report.buried[0].1.contains("replaced"), "{report:?}");
    let msgs = stream_messages(&mut con, &k);
    let first = delay_worker::message::stamp_of(msgs[0].as_bytes());
    let second = delay_worker::message::stamp_of(msgs[1].as_bytes());
    assert_ne!(first, second, "a new job");
    // The letter holds the retry's own message, its event and its attempts (found from
    // outside: it held none, and the job's payload was nowhere), so it can be requeued
    // as the same job; the record and its copy are gone with the move.
    let letter = &xrange(&mut con, &k.dead)[0];
    let held = delay_worker::message::Envelope::decode(letter["msg"].as_bytes(), MAX).unwrap();
    assert_eq!(held.payload, serde_json::json!({"v": 1}), "{letter:?}");
    assert_eq!(held.job_id, first, "{letter:?}");
    assert_eq!(
        (letter["event"].as_str(), letter["attempts"].as_str()),
        ("e", "1"),
        "{letter:?}"
    );
    let left = hlen(&mut con, &k.jobs);
    assert_eq!(left, 0, "nothing of the retry is left beside the pool");
}

/// A cancel takes a waiting retry's record and its copy of the message with it.
#[test]
fn a_cancelled_retry_leaves_nothing_behind() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let d = one_pending(&mut con, &k, r#"{"event":"e","payload":{"v":1},"retry":0}"#);
    let env = delay_worker::message::Envelope::decode(&d.msg, MAX).unwrap();
    let retry = retry_of(&d, env.next_retry().into_bytes(), NOW + 60_000);
    settle(&mut con, &k, &[retry]).unwrap();
    let held = hlen(&mut con, &k.jobs);
    assert_eq!(held, 2, "the record and the copy");
    assert!(store::cancel(&mut con, &k, "job-1").unwrap());
    let left = hlen(&mut con, &k.jobs);
    assert_eq!(left, 0);
}

#[test]
fn a_legacy_member_never_touches_the_retry_record_of_its_key() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    // A retry of close_order_1 waits in our pool (stamped, with its record), due later.
    let retry = r#"{"job_id":"123-0","event":"order.timeout","payload":{"order_id":1},"retry":1}"#;
    store::push(&mut con, &k, "close_order_1", retry, NOW + 60_000).unwrap();
    redis::cmd("HSET")
        .arg(&k.jobs)
        .arg("close_order_1")
        .arg(format!("123-0 {}", sha1_hex(retry.as_bytes())))
        .query::<()>(&mut con)
        .unwrap();
    // Meanwhile the legacy producer schedules the same order again.
    redis::cmd("SET")
        .arg("close_order_1")
        .arg(1)
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("ZADD")
        .arg("delay:order_close")
        .arg(NOW - 5)
        .arg("close_order_1")
        .query::<()>(&mut con)
        .unwrap();
    let legacy = move_from(&mut con, &k, LEGACY, NOW, 10).unwrap();
    assert_eq!((legacy.moved, legacy.buried.len()), (1, 0), "{legacy:?}");
    // The retry, once due, is still the same job.
    move_at_most_at(&mut con, &k, NOW + 61_000, 10).unwrap();
    let msgs = stream_messages(&mut con, &k);
    assert_eq!(msgs.len(), 2);
    assert_eq!(
        delay_worker::message::stamp_of(msgs[1].as_bytes()).as_deref(),
        Some("123-0")
    );
    assert_ne!(
        delay_worker::message::stamp_of(msgs[0].as_bytes()).as_deref(),
        Some("123-0")
    );
}

/// Keeping held entries claimed (a worker waiting for its `--max-rate` slots) starts the
/// idle time of those the consumer still owns again and counts no delivery; an entry a
/// peer took over meanwhile stays the peer's, and one settled meanwhile stays settled.
#[test]
fn keeping_entries_claimed_takes_none_from_a_peer() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    stream::ensure_group(&mut con, &k).unwrap();
    for key in ["a", "b", "c"] {
        schedule(&mut con, &k, key, r#"{"event":"e","payload":{}}"#);
    }
    assert_eq!(move_now(&mut con, &k).unwrap().moved, 3);
    let read = stream::read(&mut con, reading(&k), 10, ">").unwrap();
    let ids: Vec<String> = read
        .deliveries
        .iter()
        .map(|d| match &d.origin {
            Origin::Stream { id } => id.clone(),
            Origin::List { .. } => unreachable!("a stream read"),
        })
        .collect();
    assert_eq!(ids.len(), 3);
    std::thread::sleep(Duration::from_millis(300));
    redis::cmd("XCLAIM")
        .arg(&k.stream)
        .arg(&k.group)
        .arg("c2")
        .arg(0)
        .arg(&ids[1])
        .arg("JUSTID")
        .query::<Value>(&mut con)
        .unwrap();
    redis::cmd("XACK")
        .arg(&k.stream)
        .arg(&k.group)
        .arg(&ids[2])
        .query::<i64>(&mut con)
        .unwrap();
    let all: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert_eq!(
        stream::keep_claimed(&mut con, &k, "c1", &all).unwrap(),
        vec![ids[0].clone()]
    );
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&k.stream)
        .arg(&k.group)
        .arg("-")
        .arg("+")
        .arg(10)
        .query(&mut con)
        .unwrap();
    assert_eq!(pending.len(), 2, "{pending:?}");
    let (id, owner, idle, deliveries) = &pending[0];
    assert_eq!((id, owner.as_str(), *deliveries), (&ids[0], "c1", 1));
    assert!(*idle < 300, "its idle time started again: {idle} ms");
    assert_eq!((&pending[1].0, pending[1].1.as_str()), (&ids[1], "c2"));
    assert!(stream::keep_claimed(&mut con, &k, "c1", &[])
        .unwrap()
        .is_empty());
}

/// The fleet's `--max-rate` schedules: one call takes a share's slots of every cap that
/// applies, on Redis's clock; after a quiet spell a burst is free at once, then each slot
/// waits its interval, and every cap taken goes on from the latest slot. Nothing is booked
/// further ahead than the horizon (the caller is told when to ask again), and a schedule
/// further ahead than that can be (a clock stepped back) starts again. A rates key of the
/// wrong type is named and left as it is.
#[test]
fn slots_are_taken_from_one_schedule_per_cap_on_redis_s_clock() {
    use delay_worker::manners::SlotTake;
    use delay_worker::store::Slots;
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    let burst = Duration::from_millis(100);
    let mut take = |horizon: u64, takes: &[SlotTake<'_>]| {
        store::take_slots(
            &mut con,
            &k.rates,
            burst,
            Duration::from_secs(horizon),
            takes,
        )
    };
    let booked = |s: Result<Slots, StoreError>| match s.unwrap() {
        Slots::Booked(d) => d.as_millis(),
        other => panic!("not booked: {other:?}"),
    };
    let all = |n| SlotTake {
        cap: "*",
        interval: Duration::from_millis(100),
        n,
    };
    // A slot `at` ms after the first take is booked that far ahead of it, less the time
    // since (however loaded the machine running the test), each rounded down to a ms.
    let first = Instant::now();
    let near = |booked: u128, at: u128| {
        let since = first.elapsed().as_millis();
        assert!(
            booked <= at && booked + since + 2 >= at,
            "booked {booked} ms ahead, {since} ms after the first take, for a slot at {at} ms"
        );
    };
    assert_eq!(booked(take(10, &[all(1)])), 0);
    near(booked(take(10, &[all(1)])), 100);
    let event = SlotTake {
        cap: "order.timeout",
        interval: Duration::from_millis(500),
        n: 1,
    };
    // Two more of the global cap (300 ms on) and one of the event's (its first, free at
    // once: after a quiet spell a cap slower than the burst has one slot free): the later
    // decides, and both go on from it.
    near(booked(take(10, &[all(2), event.clone()])), 300);
    let fields: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(&k.rates)
        .arg("*@100000")
        .arg("order.timeout@500000")
        .query(&mut r.con())
        .unwrap();
    assert!(fields[0].is_some(), "{fields:?}");
    assert_eq!(
        fields[0], fields[1],
        "every cap taken goes on from the latest slot"
    );
    near(booked(take(10, &[all(1)])), 400);
    near(booked(take(10, std::slice::from_ref(&event))), 800);
    // The cap on every job changed by a restart to 1 a minute, and back: each rate is a
    // schedule of its own, so the next start does not wait out the minute's slot.
    let slow = SlotTake {
        interval: Duration::from_secs(60),
        ..all(1)
    };
    assert_eq!(booked(take(1, std::slice::from_ref(&slow))), 0);
    // Its next slot is a minute off, further than the horizon of 1 s: nothing booked.
    match take(1, std::slice::from_ref(&slow)).unwrap() {
        Slots::NotYet(d) => assert!(d > Duration::from_secs(58), "{d:?}"),
        other => panic!("booked a minute ahead: {other:?}"),
    }
    let stored: String = redis::cmd("HGET")
        .arg(&k.rates)
        .arg("*@60000000")
        .query(&mut r.con())
        .unwrap();
    let back = booked(take(10, &[all(1)]));
    assert!(back <= 600, "{back}");
    // A schedule an hour ahead (a clock stepped back, a value written by hand) starts again.
    let hour_on = stored.parse::<i64>().unwrap() + 3_600_000_000;
    redis::cmd("HSET")
        .arg(&k.rates)
        .arg("*@60000000")
        .arg(hour_on)
        .query::<()>(&mut r.con())
        .unwrap();
    assert_eq!(booked(take(1, std::slice::from_ref(&slow))), 0);
    set_string(&mut r.con(), &k.rates);
    is_wrong_type(&take(10, &[event]), &k.rates);
}

/// A live peer without a usable PostgreSQL gives up its entries with its delivery of each
/// taken off the count: no handler could run them there (found from outside: a peer whose
/// database kept going read-only took the same jobs each cycle, and good jobs became dead
/// letters for too many deliveries). A dead peer's deliveries still count: an entry that
/// kills its consumer looks just like that.
#[test]
fn a_live_peer_without_a_database_gives_up_its_entries_without_its_delivery_counted() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = keys();
    pending_on(&mut con, &k, "stuck-host", 6, 6);
    let stuck = stream::Reading {
        keys: &k,
        consumer: "stuck-host",
        max_bytes: MAX,
    };
    // Delivered to it twice (its own pending read again, as after a reconnect).
    assert_eq!(
        stream::read(&mut con, stuck, 6, "0")
            .unwrap()
            .deliveries
            .len(),
        6
    );
    let counts = |con: &mut Connection, who: &str| -> Vec<u64> {
        stream::pending(con, &k, 0, 100, Some(who))
            .unwrap()
            .iter()
            .map(|p| p.deliveries)
            .collect()
    };
    assert_eq!(counts(&mut con, "stuck-host"), [2; 6]);
    age_pending(&mut con, &k, "stuck-host");
    let ttl = Duration::from_secs(10);
    store::heartbeat(&mut con, &k, "stuck-host", ttl, "{}").unwrap();
    store::mark_without_database(&mut con, &k, "stuck-host", true, ttl).unwrap();
    let t = stream::take_over(&mut con, &k, "c1", "stuck-host", HAS_DB)
        .unwrap()
        .expect("a peer with a database takes them");
    assert_eq!(t.ids.len(), 6);
    assert_eq!(counts(&mut con, "c1"), [1; 6], "one delivery taken off");

    // A dead peer's: every delivery still counts.
    pending_on(&mut con, &k, "dead-host", 4, 4);
    age_pending(&mut con, &k, "dead-host");
    let t = stream::take_over(&mut con, &k, "c1", "dead-host", HAS_DB)
        .unwrap()
        .expect("a dead peer's entries are taken");
    assert_eq!(t.ids.len(), 4);
    assert_eq!(counts(&mut con, "c1"), [1; 10]);
}

/// List mode: a live consumer without a usable PostgreSQL whose processing list is pushed
/// back has its fetch of each message taken off the message's delivery count; a dead
/// consumer's fetches still count.
#[test]
fn a_live_list_consumer_without_a_database_has_its_fetches_taken_off_the_count() {
    let r = RedisServer::start();
    let mut con = r.con();
    let k = list_keys();
    let q = &k.queues[0];
    for m in ["m1", "m2", "m3"] {
        redis::cmd("LPUSH")
            .arg(&q.name)
            .arg(m)
            .query::<()>(&mut con)
            .unwrap();
    }
    let counts = |con: &mut Connection| -> Vec<u64> {
        let mut v: Vec<u64> = redis::cmd("HVALS").arg(q.deliveries()).query(con).unwrap();
        v.sort();
        v
    };
    let ttl = Duration::from_secs(10);
    let fetched = |con: &mut Connection, who: &str| {
        list::fetch(con, &k, who, 10, 3, MAX)
            .unwrap()
            .messages
            .len()
    };
    // Fetched by host-a, then by host-b after host-a (dead) had them pushed back: counted.
    assert_eq!(fetched(&mut con, "host-a"), 3);
    list::requeue_processing(&mut con, &k, "host-a", true, true)
        .unwrap()
        .expect("a dead consumer's lists go back");
    assert_eq!(fetched(&mut con, "host-b"), 3);
    assert_eq!(counts(&mut con), [2, 2, 2]);
    // host-b alive, marked without a database: its fetch is taken off when they go back.
    store::heartbeat(&mut con, &k, "host-b", ttl, "{}").unwrap();
    store::mark_without_database(&mut con, &k, "host-b", true, ttl).unwrap();
    let back = list::requeue_processing(&mut con, &k, "host-b", true, true)
        .unwrap()
        .expect("a marked consumer's lists go back to a settled peer");
    assert_eq!((back.messages, back.without_database), (3, true));
    assert_eq!(counts(&mut con), [1, 1, 1]);
    // Again and again (a database that keeps going read-only): never more.
    assert_eq!(fetched(&mut con, "host-b"), 3);
    assert_eq!(counts(&mut con), [2, 2, 2]);
    list::requeue_processing(&mut con, &k, "host-b", true, true)
        .unwrap()
        .expect("pushed back again");
    assert_eq!(
        counts(&mut con),
        [1, 1, 1],
        "host-b's fetches never counted"
    );
}
