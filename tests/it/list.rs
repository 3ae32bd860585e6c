//! List mode: the order story, priority, crash recovery through heartbeats, raw messages,
//! the legacy pool, and payment.paid racing order.timeout.

use crate::support::*;
use delay_worker::config::{LegacyPool, Source};
use delay_worker::keys::Queue;
use delay_worker::source::list::ListReader;
use delay_worker::source::{Feed, Source as _};
use delay_worker::stats::Stats;
use delay_worker::Shutdown;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn list_env(queues: &[(&str, Option<&str>)]) -> Env {
    let mut env = Env::new();
    env.config.source = Source::List;
    env.config.keys.queues = queues.iter().map(|(n, e)| Queue::new(n, *e)).collect();
    env.config.mover.queue = queues.iter().position(|(_, e)| e.is_none()).unwrap_or(0);
    env
}

/// A list reader of consumer `c1` driven step by step, feeding a 4-slot channel; keep the
/// returned space sender alive while the reader runs.
fn step_reader<'a>(
    c: &'a delay_worker::Config,
    stats: &'a Stats,
) -> (
    ListReader<'a>,
    delay_worker::delivery::Take,
    crossbeam_channel::Sender<()>,
) {
    let (tx, rx) = delay_worker::delivery::channel(4, 1);
    let (space_tx, space_rx) = crossbeam_channel::bounded(1);
    // Lives as long as the test's process: the reader borrows it.
    let inbox = Box::leak(Box::new(delay_worker::source::done::InboxLook::new(
        delay_worker::db::Target::parse(&c.database_url).unwrap(),
        c.reader.heartbeat_ttl,
    )));
    let reader = ListReader::new(
        &c.keys,
        &c.reader,
        "c1",
        stats,
        Feed::new(tx, space_rx, stats),
        inbox,
    );
    (reader, rx, space_tx)
}

fn llen(env: &Env, key: &str) -> usize {
    redis::cmd("LLEN").arg(key).query(&mut env.con()).unwrap()
}

fn lpush(env: &Env, key: &str, msg: &str) {
    redis::cmd("LPUSH")
        .arg(key)
        .arg(msg)
        .query::<()>(&mut env.con())
        .unwrap();
}

/// Every queue and processing list of the test is empty (the work is settled).
fn lists_drained(env: &Env, consumers: &[&str]) -> bool {
    env.config.keys.queues.iter().all(|q| {
        llen(env, &q.name) == 0 && consumers.iter().all(|c| llen(env, &q.processing(c)) == 0)
    })
}

/// Every processing list and dead list of the test's queues is empty.
fn assert_lists_empty(env: &Env, consumers: &[&str]) {
    for q in &env.config.keys.queues {
        assert_eq!(llen(env, &q.name), 0, "queue {}", q.name);
        assert_eq!(llen(env, &q.dead), 0, "dead list {}", q.dead);
        for c in consumers {
            assert_eq!(
                llen(env, &q.processing(c)),
                0,
                "processing of {c} on {}",
                q.name
            );
        }
    }
}

fn list_args(env: &Env) -> Vec<String> {
    let q = &env.config.keys.queues;
    let mut a = vec![
        "--source".to_string(),
        "list".to_string(),
        "--queues".to_string(),
    ];
    a.push(
        q.iter()
            .filter(|q| q.raw_event.is_none())
            .map(|q| q.name.clone())
            .collect::<Vec<_>>()
            .join(","),
    );
    for q in q.iter().filter(|q| q.raw_event.is_some()) {
        a.push("--queue".into());
        a.push(format!("{}={}", q.name, q.raw_event.as_deref().unwrap()));
    }
    a
}

#[test]
fn the_order_story_in_list_mode() {
    let env = list_env(&[("normal", None)]);
    let orders = seed_orders(&env.db, 300);
    let paid: Vec<SeedOrder> = orders.iter().step_by(5).cloned().collect();
    pay(&env.db, &paid);
    push_timeouts(&env, &orders, 200);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every job", || inbox_count(&env.db) == 300);
    let report = daemon.stop();
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !paid.iter().any(|p| p.id == o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_eq!(report.stats.acked, 300, "{}", report.stats);
    assert_eq!(books(&env).pool, 0);
    assert_lists_empty(&env, &["c1"]);
}

#[test]
fn queues_are_taken_in_priority_order() {
    let env = list_env(&[("high", None), ("low", None)]);
    for i in 0..3 {
        lpush(
            &env,
            "low",
            &format!(r#"{{"event":"e","payload":{{"n":"low{i}"}}}}"#),
        );
    }
    for i in 0..3 {
        lpush(
            &env,
            "high",
            &format!(r#"{{"event":"e","payload":{{"n":"high{i}"}}}}"#),
        );
    }
    let stats = Stats::default();
    let c = &env.config;
    let (mut reader, rx, _space) = step_reader(c, &stats);
    let mut con = env.con();
    reader.start(&mut con, &Shutdown::new()).unwrap();
    assert_eq!(
        reader.poll(&mut con).unwrap(),
        4,
        "as many as the channel holds"
    );
    let got: Vec<String> = rx
        .try_iter()
        .map(|d| String::from_utf8(d.msg).unwrap())
        .collect();
    let order: Vec<&str> = got
        .iter()
        .map(|m| &m[m.find("\"n\":\"").unwrap() + 5..m.len() - 3])
        .collect();
    assert_eq!(
        order,
        ["high0", "high1", "high2", "low0"],
        "high first, each queue FIFO"
    );
    assert_eq!(llen(&env, &c.keys.queues[0].processing("c1")), 3);
    assert_eq!(llen(&env, &c.keys.queues[1].processing("c1")), 1);
    // With the high queue empty, a message on the low one waits no longer than a short
    // block on the high queue (not the whole block timeout).
    assert_eq!(reader.poll(&mut con).unwrap(), 2);
    lpush(&env, "low", r#"{"event":"e","payload":{"n":"late"}}"#);
    let t = std::time::Instant::now();
    let mut n = 0;
    while n == 0 {
        n = reader.poll(&mut con).unwrap();
    }
    assert!(t.elapsed() < c.reader.block, "waited {:?}", t.elapsed());
}

#[test]
fn a_killed_consumer_s_messages_are_recovered_by_a_peer_and_by_itself() {
    let env = list_env(&[("normal", None)]);
    let orders = seed_orders(&env.db, 1200);
    push_timeouts(&env, &orders, 0);
    let mut c1 = env.config.clone();
    c1.consumer = "host-a".into();
    let mut p = Proc::start(&c1, &list_args(&env));
    wait_until(WAIT, "load", || inbox_count(&env.db) > 150);
    p.kill9();
    let held = llen(&env, &env.config.keys.queues[0].processing("host-a"));
    // host-a never comes back: host-b takes its processing list once the heartbeat expires.
    let mut c2 = env.config.clone();
    c2.consumer = "host-b".into();
    let mut p2 = Proc::start(&c2, &list_args(&env));
    // Done means every job in the inbox *and* every list drained: host-a had committed
    // jobs it never acknowledged, which host-b must push back and settle as duplicates.
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 1200
            && books(&env).pool == 0
            && lists_drained(&env, &["host-a", "host-b"])
    });
    p2.signal(libc::SIGTERM);
    assert!(p2.wait(WAIT).success());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_lists_empty(&env, &["host-a", "host-b"]);
    eprintln!("host-a held {held} messages when killed");
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&env.config.keys.list_consumers)
        .query(&mut env.con())
        .unwrap();
    assert_eq!(
        members,
        vec!["host-b".to_string()],
        "the dead consumer is forgotten"
    );
}

/// A consumer that lives but whose database takes no writes (its sessions read-only)
/// while a peer's does: the peer pushes its processing list back a heartbeat's time after
/// its database watch found none, not after `--claim-idle`, and runs every job once. The
/// consumer stays in the SET: it lives.
#[test]
fn a_consumer_without_a_usable_database_has_its_messages_pushed_back_for_a_peer() {
    let env = list_env(&[("normal", None)]);
    let q = &env.config.keys.queues[0];
    let orders = seed_orders(&env.db, 305);
    // host-a reaches the database as a role of its own, turned read-only once it runs
    // (a worker refuses to start on a server that takes no writes).
    let role = format!("dw_ro_{}_{}", std::process::id(), line!());
    let _roles = Roles(vec![role.clone()]);
    let admin = |sql: String| env.db.client().batch_execute(&sql).unwrap();
    admin(format!(
        "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD 'ro-secret'"
    ));
    let mut a = env.config.clone();
    a.consumer = "host-a".into();
    a.database_url = pg_url(&role, "ro-secret", &env.db.name);
    let port = free_port();
    // One fetch each: host-a's fetch of what it gives back does not count, so host-b's is
    // the first (found from outside: a peer whose database kept going read-only fetched the
    // same messages once a cycle, and good jobs became dead letters for too many fetches).
    let once = ["--max-deliveries".to_string(), "1".to_string()];
    let mut args_a = list_args(&env);
    args_a.extend(once.clone());
    args_a.extend(["--metrics-addr".to_string(), format!("127.0.0.1:{port}")]);
    let mut pa = Proc::start(&a, &args_a);
    push_timeouts(&env, &orders[..10], 0);
    wait_until(WAIT, "host-a's first jobs", || inbox_count(&env.db) == 10);
    // Made read-only while its workers are in the middle of what it fetched (the orders
    // slow to update for that moment): they hold it. (Without a usable PostgreSQL it
    // fetches nothing new.)
    admin(
        "CREATE FUNCTION dw_slow() RETURNS trigger LANGUAGE plpgsql AS \
           $$BEGIN PERFORM pg_sleep(0.05); RETURN NEW; END$$; \
         CREATE TRIGGER dw_slow BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION dw_slow()"
            .to_string(),
    );
    push_timeouts(&env, &orders[10..300], 0);
    wait_until(WAIT, "host-a holding messages", || {
        llen(&env, &q.processing("host-a")) > 0
    });
    admin(format!(
        "ALTER ROLE {role} SET default_transaction_read_only = on; \
         SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ));
    admin("DROP TRIGGER dw_slow ON orders; DROP FUNCTION dw_slow()".to_string());
    let held = llen(&env, &q.processing("host-a"));
    let mut b = env.config.clone();
    b.consumer = "host-b".into();
    let mut args_b = list_args(&env);
    args_b.extend(once);
    let mut pb = Proc::start(&b, &args_b);
    wait_until(WAIT, "every job done by host-b", || {
        inbox_count(&env.db) == 300
            && books(&env).pool == 0
            && lists_drained(&env, &["host-a", "host-b"])
    });
    assert!(
        pa.child.try_wait().unwrap().is_none(),
        "host-a still runs: {}",
        pa.log()
    );
    assert!(
        pa.log().contains("no usable PostgreSQL"),
        "host-a said why it gave up {held} messages: {}",
        pa.log()
    );
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&env.config.keys.list_consumers)
        .query(&mut env.con())
        .unwrap();
    assert!(members.contains(&"host-a".to_string()), "{members:?}");
    // Back, host-a runs none of the messages its workers held that host-b pushed back and
    // ran (found from outside: every one ran again here, a duplicate each).
    admin(format!(
        "ALTER ROLE {role} RESET default_transaction_read_only; \
         SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ));
    wait_until(WAIT, "host-a green", || {
        http_get(port, "/healthz")
            .map(|(code, _, _)| code == 200)
            .unwrap_or(false)
    });
    push_timeouts(&env, &orders[300..], 0);
    wait_until(WAIT, "the last jobs done", || {
        inbox_count(&env.db) == 305 && lists_drained(&env, &["host-a", "host-b"])
    });
    std::thread::sleep(Duration::from_secs(2));
    let (_, _, metrics) = http_get(port, "/metrics").unwrap();
    let duplicates: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("delay_worker_jobs_total") && l.contains("outcome=\"duplicate\""))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    assert!(duplicates.is_empty(), "{duplicates:?}\n{}", pa.log());
    pa.signal(libc::SIGTERM);
    pb.signal(libc::SIGTERM);
    assert!(pa.wait(WAIT).success());
    assert!(pb.wait(WAIT).success());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_lists_empty(&env, &["host-a", "host-b"]);
}

#[test]
fn a_restarted_consumer_pushes_its_own_leftovers_back() {
    let env = list_env(&[("normal", None)]);
    let orders = seed_orders(&env.db, 800);
    push_timeouts(&env, &orders, 0);
    let mut p = Proc::start(&env.config, &list_args(&env));
    wait_until(WAIT, "load", || inbox_count(&env.db) > 100);
    p.kill9();
    let mut p = Proc::start(&env.config, &list_args(&env));
    wait_until(WAIT, "every job", || {
        inbox_count(&env.db) == 800 && books(&env).pool == 0 && lists_drained(&env, &["c1"])
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_lists_empty(&env, &["c1"]);
}

/// A stop under `--max-rate` in list mode: the jobs held for their slots stay in the
/// consumer's processing list, and the next start runs each once and empties it.
#[test]
fn a_capped_stop_leaves_the_held_jobs_in_the_processing_list() {
    let mut env = list_env(&[("normal", None)]);
    let processing = env.config.keys.queues[0].processing("c1");
    crate::consumer::a_capped_stop_leaves_the_held_jobs_pending(&mut env, |env| {
        llen(env, &processing)
    });
    assert_lists_empty(&env, &["c1"]);
}

/// [`crate::consumer::restarts_during_a_capped_drain_make_no_dead_letters`] in list mode:
/// the messages a stop leaves in the processing list are not counted as fetched.
#[test]
fn restarts_during_a_capped_drain_make_no_dead_letters_in_list_mode() {
    let mut env = list_env(&[("normal", None)]);
    let dead = env.config.keys.queues[0].dead.clone();
    crate::consumer::restarts_under_a_cap_make_no_dead_letters(&mut env, |env| llen(env, &dead));
    assert_lists_empty(&env, &["c1"]);
}

/// [`crate::consumer::kill_9_again_and_again_during_a_capped_drain_makes_no_dead_letters`]
/// in list mode, where every fetch counts: messages a killed consumer fetched ahead of its
/// workers are fetched again, not dead-lettered.
#[test]
fn kill_9_again_and_again_during_a_capped_drain_makes_no_dead_letters_in_list_mode() {
    let mut env = list_env(&[("normal", None)]);
    let args = list_args(&env);
    let processing = env.config.keys.queues[0].processing(&env.config.consumer);
    let dead = env.config.keys.queues[0].dead.clone();
    crate::consumer::kills_under_a_cap_make_no_dead_letters(
        &mut env,
        &args,
        |env| llen(env, &processing),
        |env| llen(env, &dead),
    );
}

#[test]
fn raw_payment_messages_pay_orders_and_late_ones_go_to_review() {
    let env = list_env(&[("normal", None), ("payment_queue", Some("payment.paid"))]);
    let orders = seed_orders(&env.db, 4);
    // orders[0] pending → paid; orders[1] cancelled by timeout first → review;
    // orders[2] already paid → no-op; a payment for a missing order → review.
    pay(&env.db, &orders[2..3]);
    let mut db = env.db.client();
    db.execute(
        "UPDATE orders SET status = 'cancelled', cancel_reason = 'timeout' WHERE id = $1",
        &[&orders[1].id],
    )
    .unwrap();
    for o in &orders[0..3] {
        lpush(
            &env,
            "payment_queue",
            &format!(r#"{{"order_no":"{}","amount":990}}"#, o.order_no),
        );
    }
    lpush(&env, "payment_queue", r#"{"order_no":"NOPE-1"}"#);
    lpush(&env, "payment_queue", "not json at all");
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "all payments", || {
        inbox_count(&env.db) == 4 && llen(&env, "payment_queue:dead") == 1
    });
    daemon.stop();
    let mut status = |id: i64| -> String {
        db.query_one("SELECT status FROM orders WHERE id = $1", &[&id])
            .unwrap()
            .get(0)
    };
    assert_eq!(status(orders[0].id), "paid");
    assert_eq!(status(orders[1].id), "cancelled");
    assert_eq!(status(orders[2].id), "paid");
    assert_eq!(status(orders[3].id), "pending");
    let reviews: Vec<(Option<i64>, String)> = db
        .query(
            "SELECT order_id, reason FROM payment_review ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(reviews.len(), 2, "{reviews:?}");
    assert!(reviews
        .iter()
        .any(|(id, r)| *id == Some(orders[1].id) && r.contains("cancelled (timeout)")));
    assert!(reviews
        .iter()
        .any(|(id, r)| id.is_none() && r.contains("does not exist")));
    let dead: String = redis::cmd("RPOP")
        .arg("payment_queue:dead")
        .query(&mut env.con())
        .unwrap();
    let dead: serde_json::Value = serde_json::from_str(&dead).unwrap();
    assert_eq!(dead["msg"], "not json at all");
    assert!(dead["reason"].as_str().unwrap().contains("not JSON"));
    assert_eq!(dead["queue"], "payment_queue");
    assert_lists_empty(&env, &["c1"]);
}

#[test]
fn the_legacy_pool_becomes_order_timeouts() {
    let mut env = list_env(&[("normal", None)]);
    env.config.mover.legacy = vec![LegacyPool {
        key: "delay:order_close".into(),
        event: "order.timeout".into(),
    }];
    let orders = seed_orders(&env.db, 50);
    let mut con = env.con();
    let now = delay_worker::now_ms();
    for (i, o) in orders.iter().enumerate() {
        // What the PHP does: zAdd('delay:order_close', $ms, 'close_order_'.$id); set(...).
        let member = format!("close_order_{}", o.id);
        // Some producers write the id zero-padded: still that order.
        let value = if i % 7 == 0 {
            format!("000{}", o.id)
        } else {
            o.id.to_string()
        };
        redis::cmd("SET")
            .arg(&member)
            .arg(value)
            .query::<()>(&mut con)
            .unwrap();
        let due = if i < 40 { now - 10 } else { now + 3_600_000 };
        redis::cmd("ZADD")
            .arg("delay:order_close")
            .arg(due)
            .arg(&member)
            .query::<()>(&mut con)
            .unwrap();
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the due ones", || inbox_count(&env.db) == 40);
    daemon.stop();
    let due: Vec<&SeedOrder> = orders.iter().take(40).collect();
    assert_accounting(&env.db, &orders, &due);
    let left: usize = redis::cmd("ZCARD")
        .arg("delay:order_close")
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 10);
    let gone: bool = redis::cmd("EXISTS")
        .arg(format!("close_order_{}", orders[0].id))
        .query(&mut con)
        .unwrap();
    assert!(!gone, "the STRING key goes with its member");
    let kept: bool = redis::cmd("EXISTS")
        .arg(format!("close_order_{}", orders[45].id))
        .query(&mut con)
        .unwrap();
    assert!(kept);
    assert_lists_empty(&env, &["c1"]);
}

#[test]
fn payment_racing_timeout_never_both_wins() {
    let env = list_env(&[("normal", None), ("payment_queue", Some("payment.paid"))]);
    let orders = seed_orders(&env.db, 400);
    let daemon = Daemon::start(&env.config);
    // Both sides at once for every order: the timeout falls due as the payment arrives.
    push_timeouts(&env, &orders, 0);
    for o in &orders {
        lpush(
            &env,
            "payment_queue",
            &format!(r#"{{"order_no":"{}"}}"#, o.order_no),
        );
    }
    wait_until(WAIT, "both events of every order", || {
        inbox_count(&env.db) == 800
    });
    daemon.stop();
    let mut db = env.db.client();
    let cancelled_ids: Vec<i64> = db
        .query("SELECT id FROM orders WHERE status = 'cancelled'", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let paid: i64 = db
        .query_one("SELECT count(*) FROM orders WHERE status = 'paid'", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        paid as usize + cancelled_ids.len(),
        400,
        "every order ends paid or cancelled"
    );
    let reviews: Vec<i64> = db
        .query("SELECT order_id FROM payment_review", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut a = cancelled_ids.clone();
    let mut b = reviews.clone();
    a.sort();
    b.sort();
    assert_eq!(
        a, b,
        "each cancelled order's payment is up for review, and only those"
    );
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| cancelled_ids.contains(&o.id))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
    eprintln!("{} paid first, {} cancelled first", paid, cancelled.len());
    assert_lists_empty(&env, &["c1"]);
}

#[test]
fn a_message_that_keeps_killing_its_consumer_goes_to_the_dead_list() {
    let mut env = list_env(&[("normal", None)]);
    env.config.reader.max_deliveries = 3;
    let poison = r#"{"event":"order.timeout","payload":{"order_no":"KILLS-ME"}}"#;
    lpush(&env, "normal", poison);
    let c = &env.config;
    let mut con = env.con();
    // A consumer fetches it and dies before settling, again and again: each start pushes
    // its leftovers back onto the queue.
    let mut fetched = 0;
    for _ in 0..6 {
        let stats = Stats::default();
        let (mut reader, rx, _space) = step_reader(c, &stats);
        reader.start(&mut con, &Shutdown::new()).unwrap();
        reader.poll(&mut con).unwrap();
        // Its job starts each time, and kills the consumer. A worker counts the start of
        // a job delivered before, not a first delivery's.
        let got: Vec<delay_worker::delivery::Delivery> = rx.try_iter().collect();
        fetched += got.len();
        let counted: Vec<&delay_worker::delivery::Delivery> =
            got.iter().filter(|d| d.redelivered).collect();
        delay_worker::store::started(&mut con, std::slice::from_ref(&c.keys), &counted, 1).unwrap();
    }
    // Its first start is not counted: it runs once more than the limit, as in stream mode.
    assert_eq!(
        fetched, 4,
        "delivered --max-deliveries + 1 times, then no more"
    );
    assert_eq!(llen(&env, "normal"), 0);
    assert_eq!(llen(&env, &c.keys.queues[0].processing("c1")), 0);
    let dead: String = redis::cmd("RPOP")
        .arg("normal:dead")
        .query(&mut con)
        .unwrap();
    let dead: serde_json::Value = serde_json::from_str(&dead).unwrap();
    assert_eq!(dead["msg"], poison);
    assert!(
        dead["reason"]
            .as_str()
            .unwrap()
            .contains("its job started 3 times since its first fetch"),
        "{dead}"
    );
    assert_eq!(dead["queue"], "normal");
    // Its event from the message; no job key (pushed by a producer, not moved from a pool).
    assert_eq!(
        (&dead["event"], &dead["key"]),
        (&serde_json::json!("order.timeout"), &serde_json::json!(""))
    );
    // A message that is settled clears its count.
    let n: usize = redis::cmd("HLEN")
        .arg(c.keys.queues[0].deliveries())
        .query(&mut con)
        .unwrap();
    assert_eq!(n, 0);
}

/// A job whose transaction committed is never also a dead letter, in list mode: a message
/// fetched `--max-deliveries` times without being settled whose job's inbox row is there
/// was done (its consumer was killed between the commit and the settle, as often as the
/// limit): it is taken off its queue without a letter; only one whose job never ran goes
/// to the dead list, unrun.
#[test]
fn a_message_fetched_too_often_whose_job_committed_is_taken_off_not_dead_lettered() {
    let mut env = list_env(&[("normal", None)]);
    env.config.reader.max_deliveries = 3;
    let orders = seed_orders(&env.db, 2);
    let msg = |o: &SeedOrder| {
        format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}},"ts":1}}"#,
            o.order_no
        )
    };
    let (done, never_ran) = (msg(&orders[0]), msg(&orders[1]));
    lpush(&env, "normal", &done);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the first order done", || {
        inbox_count(&env.db) == 1
            && llen(
                &env,
                &env.config.keys.queues[0].processing(&env.config.consumer),
            ) == 0
    });
    daemon.stop();

    // Both pushed back as if by consumers killed three times each, the first after its
    // job had committed.
    let c = &env.config;
    let mut con = env.con();
    for m in [&done, &never_ran] {
        lpush(&env, "normal", m);
        // Its job started each time: killed inside its transaction, or after its commit.
        fetched_and_started(&mut env.con(), &env.config.keys.queues[0], m, 3, 3);
    }
    let stats = Stats::default();
    let (mut reader, rx, _space) = step_reader(c, &stats);
    reader.start(&mut con, &Shutdown::new()).unwrap();
    for _ in 0..3 {
        reader.poll(&mut con).unwrap();
    }
    assert_eq!(rx.try_iter().count(), 0, "neither is fetched again");
    assert_eq!(llen(&env, "normal"), 0);
    let letters: Vec<String> = redis::cmd("LRANGE")
        .arg("normal:dead")
        .arg(0)
        .arg(-1)
        .query(&mut con)
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter: serde_json::Value = serde_json::from_str(&letters[0]).unwrap();
    assert_eq!(
        letter["msg"],
        never_ran.as_str(),
        "only the job that never ran"
    );
    assert!(
        letter["reason"]
            .as_str()
            .unwrap()
            .contains("its job started 3 times since its first fetch"),
        "{letter}"
    );
    assert_eq!(inbox_count(&env.db), 1);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

/// List mode: a message fetched `--max-deliveries` times whose job cannot be looked up in
/// the inbox (PostgreSQL cannot be asked) waits at its queue's tail, neither dead-lettered
/// nor fetched again, and the fetch stops there (the queue keeps its order); once the
/// inbox answers it is decided and the messages behind it go on.
#[test]
fn a_message_fetched_too_often_waits_while_the_inbox_cannot_be_asked() {
    use delay_worker::source::done::InboxLook;
    let mut env = list_env(&[("normal", None)]);
    env.config.reader.max_deliveries = 1;
    let c = &env.config;
    let mut con = env.con();
    let first = r#"{"event":"order.timeout","payload":{"order_no":"NEVER-RAN"},"ts":1}"#;
    let behind = r#"{"event":"order.timeout","payload":{"order_no":"BEHIND"},"ts":1}"#;
    lpush(&env, "normal", first);
    lpush(&env, "normal", behind);
    fetched_and_started(&mut env.con(), &env.config.keys.queues[0], first, 1, 1);
    let stats = Stats::default();
    let (tx, rx) = delay_worker::delivery::channel(4, 1);
    let (_space_tx, space_rx) = crossbeam_channel::bounded(1);
    let nowhere = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let nowhere = InboxLook::new(
        delay_worker::db::Target::parse(&nowhere).unwrap(),
        c.reader.heartbeat_ttl,
    );
    let mut reader = ListReader::new(
        &c.keys,
        &c.reader,
        "c1",
        &stats,
        Feed::new(tx, space_rx, &stats),
        &nowhere,
    );
    reader.start(&mut con, &Shutdown::new()).unwrap();
    for _ in 0..3 {
        reader.poll(&mut con).unwrap();
    }
    assert_eq!(rx.try_iter().count(), 0, "nothing fetched past it");
    assert_eq!(llen(&env, "normal"), 2, "both still queued");
    assert_eq!(
        llen(&env, "normal:dead"),
        0,
        "not a dead letter while it cannot be told"
    );
    drop(reader);

    let stats = Stats::default();
    let (mut reader, rx, _space) = step_reader(c, &stats);
    reader.start(&mut con, &Shutdown::new()).unwrap();
    for _ in 0..3 {
        reader.poll(&mut con).unwrap();
    }
    assert_eq!(llen(&env, "normal:dead"), 1, "decided: it never ran");
    let fetched: Vec<Vec<u8>> = rx.try_iter().map(|d| d.msg).collect();
    assert_eq!(
        fetched,
        vec![behind.as_bytes().to_vec()],
        "the one behind goes on"
    );
}

#[test]
fn a_consumer_killed_mid_transaction_and_restarted_loses_no_job_to_its_orphans() {
    // kill -9 while a slow job (2 s) is inside its transaction. At restart
    // the consumer's processing list goes back to its queue and each message is read again
    // while its orphaned transaction still runs: the copy waits the orphan out and runs
    // (the orphan rolls back: its client is gone). Taken for a duplicate and removed, it
    // would be lost with the rollback.
    let mut env = list_env(&[("normal", None)]);
    env.config.threads = 1;
    let dir = slow_order_timeout("2");
    let orders = seed_orders(&env.db, 8);
    let mut args = list_args(&env);
    args.extend([
        "--handlers-dir".to_string(),
        dir.0.display().to_string(),
        "--statement-timeout".into(),
        "10s".into(),
    ]);
    let mut p = Proc::start(&env.config, &args);
    push_timeouts(&env, &orders, 0);
    // One worker runs the jobs one after another (no set form): kill it with two of them
    // committed and the third inside its transaction.
    wait_until(WAIT, "a job inside its transaction after two done", || {
        inbox_count(&env.db) >= 2 && sleeping(&env.db) == 1
    });
    p.kill9();
    let mut p = Proc::start(&env.config, &args);
    wait_until(WAIT, "every job done by the restarted consumer", || {
        inbox_count(&env.db) == 8 && books(&env).pool == 0 && lists_drained(&env, &["c1"])
    });
    p.signal(libc::SIGTERM);
    assert!(p.wait(WAIT).success(), "{}", p.log());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_lists_empty(&env, &["c1"]);
}

/// A dead list of the wrong type is told by `/healthz` (503 naming it) while the worker is
/// idle, before any message needs it, as the stream's dead letters are, and green again
/// once it is removed; the jobs go through meanwhile. Found from outside: `/healthz` 200
/// for 10-24 s while `stats --check` was CRITICAL naming the key.
#[test]
fn a_dead_list_of_the_wrong_type_is_named_before_a_message_needs_it() {
    let mut env = list_env(&[("normal", None)]);
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let orders = seed_orders(&env.db, 2);
    let daemon = Daemon::start(&env.config);
    let body = || {
        http_get(port, "/healthz")
            .map(|(c, _, b)| (c, b))
            .unwrap_or((0, String::new()))
    };
    wait_until(WAIT, "/healthz green", || body().0 == 200);
    let dead = env.config.keys.queues[0].dead.clone();
    redis::cmd("SET")
        .arg(&dead)
        .arg("x")
        .query::<()>(&mut env.con())
        .unwrap();
    wait_until(WAIT, "a 503 naming the dead list", || {
        let (code, b) = body();
        code == 503 && b.contains(&dead)
    });
    // Nothing waits on it yet, and health does not say that something does.
    let (_, said) = body();
    assert!(
        said.contains("would stay where it is") && !said.contains("held back"),
        "{said}"
    );
    // Good jobs go through meanwhile; health stays red while the key is wrong.
    let msg = |o: &SeedOrder| {
        format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}}}}"#,
            o.order_no
        )
    };
    for o in &orders {
        lpush(&env, "normal", &msg(o));
    }
    wait_until(WAIT, "both orders done", || inbox_count(&env.db) == 2);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(body().0, 503, "red while the dead list is of another type");
    redis::cmd("DEL")
        .arg(&dead)
        .query::<()>(&mut env.con())
        .unwrap();
    wait_until(WAIT, "200 again", || body().0 == 200);
    daemon.stop();
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}
