//! The five ways a message was lost, stalled or mistaken before the store layer acked
//! last, each as the outsider reproduced it, run end to end against the daemon. Every
//! test ends with the books: nothing lost, nothing twice.

use crate::store::age_pending;
use crate::support::*;
use delay_worker::config::LegacyPool;
use delay_worker::source::{stream::Reader, Feed};
use delay_worker::stats::Stats;
use delay_worker::store;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// Entries pending in the group (without `books`, which reads the dead letters too); 0
/// before the daemon created the group.
fn pending_total(env: &Env) -> usize {
    store::stream::pending(&mut env.con(), &env.config.keys, 0, 1000, None)
        .map(|p| p.len())
        .unwrap_or(0)
}

/// Defect 1: `SET mq:dead-letter x` while a malformed message falls due: it must wait, pending,
/// while the health checks say what is wrong, and reach the dead letters once the key is
/// fixed.
#[test]
fn a_dead_letter_key_of_the_wrong_type_loses_nothing_and_turns_health_red() {
    let mut env = Env::new();
    env.config.reader.claim_idle = Duration::from_secs(1);
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let mut con = env.con();
    let k = env.config.keys.clone();
    redis::cmd("SET")
        .arg(&k.dead)
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    store::push(&mut con, &k, "bad-1", "not json", delay_worker::now_ms()).unwrap();
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "the entry pending, not lost", || {
        pending_total(&env) == 1
    });
    wait_until(WAIT, "/healthz to say why", || {
        http_get(port, "/healthz")
            .map(|(code, _, body)| code == 503 && body.contains(&k.dead))
            .unwrap_or(false)
    });
    let check = run_worker(&["stats", "--check"], &env.redis.url(), &env.db.url);
    assert_eq!(check.status.code(), Some(2), "{}", text(&check.stdout));
    assert!(
        text(&check.stdout).contains("CRITICAL"),
        "{}",
        text(&check.stdout)
    );
    // Still pending after several settle attempts.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pending_total(&env), 1);

    redis::cmd("DEL")
        .arg(&k.dead)
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "the dead letter", || {
        dead_letters(&env).len() == 1 && pending_total(&env) == 0
    });
    let report = daemon.stop();
    let letter = &dead_letters(&env)[0];
    assert_eq!(letter["key"], "bad-1");
    assert!(letter["reason"].contains("not JSON"), "{letter:?}");
    assert_eq!(report.stats.dead, 1, "counted once, when written");
    assert_eq!(books(&env).pool, 0);
}

/// `SET mq:events x`: a stream key of the wrong type. At start the worker refuses with one
/// line naming the key (not "cannot reach Redis"). Made wrong while it runs, the key holds
/// every job back (the mover's moves and the reader's reads fail on it) while the health
/// checks name it; once the operator removes it, the jobs run within the short wait of an
/// operator's fix (`FIX_BACKOFF`, 2 s), not the half minute an outage's backoff grows to:
/// after 15 s of failures that backoff waits 6-26 s, and every job with it. The group the
/// removed key took with it is made again at once (`NOGROUP` is no outage). The reader
/// keeps its heartbeat meanwhile (found from outside: it lapsed, and a peer took over the
/// entries this worker's pool held).
#[test]
fn a_stream_key_of_the_wrong_type_is_named_and_taken_up_soon_after_the_fix() {
    let mut env = Env::new();
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let orders = seed_orders(&env.db, 20);
    let mut con = env.con();
    let k = env.config.keys.clone();
    let wrong = |con: &mut redis::Connection| {
        redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(&k.stream)
            .cmd("SET")
            .arg(&k.stream)
            .arg("x")
            .query::<()>(con)
            .unwrap()
    };
    wrong(&mut con);
    let refused = run_worker(&["--consumer", "c1"], &env.redis.url(), &env.db.url);
    assert_eq!(refused.status.code(), Some(1));
    let line = text(&refused.stderr);
    assert!(
        line.contains(&format!(
            "key \"{}\" holds a string, not a stream",
            k.stream
        )) && !line.contains("cannot reach"),
        "{line}"
    );
    redis::cmd("DEL")
        .arg(&k.stream)
        .query::<()>(&mut con)
        .unwrap();

    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "/healthz green", || {
        http_get(port, "/healthz")
            .map(|(code, _, _)| code == 200)
            .unwrap_or(false)
    });
    wrong(&mut con);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz to name the key", || {
        http_get(port, "/healthz")
            .map(|(code, _, body)| code == 503 && body.contains(&k.stream))
            .unwrap_or(false)
    });
    // The reader backs off on the key but keeps its heartbeat (2 s here): a peer must not
    // take over its pending entries as a dead consumer's.
    let heartbeat = k.heartbeat(&env.config.consumer);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(15) {
        let alive: bool = redis::cmd("EXISTS")
            .arg(&heartbeat)
            .query(&mut con)
            .unwrap();
        assert!(alive, "the heartbeat lapsed while the reader backed off");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        inbox_count(&env.db),
        0,
        "nothing runs while the key is wrong"
    );
    assert_eq!(books(&env).pool, 20);
    redis::cmd("DEL")
        .arg(&k.stream)
        .query::<()>(&mut con)
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "every job done within 10 s of the fix",
        || inbox_count(&env.db) == 20,
    );
    wait_until(WAIT, "/healthz green again", || {
        http_get(port, "/healthz")
            .map(|(code, _, _)| code == 200)
            .unwrap_or(false)
    });
    daemon.stop();
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    let b = books(&env);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
}

/// With `--shards 3`, shard 1's stream key made the wrong type while the worker runs holds
/// back only shard 1's jobs: the other shards' are read and done meanwhile (found from
/// outside: the whole reader backed off, and no shard's job ran until the fix). Once the
/// key is removed, shard 1's group is made again and its jobs run.
#[test]
fn a_shards_stream_key_of_the_wrong_type_holds_back_only_that_shard() {
    let env = Env::new();
    let mut config = env.config.clone();
    config.shards = 3;
    let port = free_port();
    config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let shards = config.shard_keys();
    let orders = seed_orders(&env.db, 30);
    let daemon = Daemon::start(&config);
    let healthz = || http_get(port, "/healthz").unwrap_or((0, String::new(), String::new()));
    wait_until(WAIT, "/healthz green", || healthz().0 == 200);
    let mut con = env.con();
    redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg(&shards[1].stream)
        .cmd("SET")
        .arg(&shards[1].stream)
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    let in_shard = push_due_in_shards(&mut con, &config, &orders);
    assert!(in_shard.iter().all(|&n| n > 0), "{in_shard:?}");
    wait_until(
        WAIT,
        "shards 0 and 2 done, /healthz naming shard 1's key",
        || {
            let (code, _, body) = healthz();
            inbox_count(&env.db) == in_shard[0] + in_shard[2]
                && code == 503
                && body.contains(&shards[1].stream)
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        inbox_count(&env.db),
        in_shard[0] + in_shard[2],
        "shard 1's jobs wait"
    );
    redis::cmd("DEL")
        .arg(&shards[1].stream)
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 30);
    wait_until(WAIT, "/healthz green again", || healthz().0 == 200);
    daemon.stop();
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    for keys in &shards {
        let b = books_on(&mut con, keys);
        assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
    }
}

/// `n` jobs `j0`, `j1`, ... with `msg(i)`, due a second ago, moved onto the stream.
fn on_the_stream(env: &Env, con: &mut redis::Connection, n: usize, msg: impl Fn(usize) -> String) {
    let k = &env.config.keys;
    for i in 0..n {
        let due = delay_worker::now_ms() - 1000;
        store::push(con, k, &format!("j{i}"), msg(i), due).unwrap();
    }
    let mover_stats = Stats::default();
    let mover = delay_worker::mover::Mover::new(k, &env.config.mover, &mover_stats);
    while mover.tick(con, delay_worker::now_ms()).unwrap().0.moved > 0 {}
}

/// Defect 2: A dead host's pending entries are taken over in one maintenance pass, however small
/// the survivor's channel.
#[test]
fn a_dead_consumer_is_taken_over_at_once_not_a_channel_at_a_time() {
    let env = Env::new();
    let mut con = env.con();
    let k = env.config.keys.clone();
    store::stream::ensure_group(&mut con, &k).unwrap();
    on_the_stream(&env, &mut con, 150, |_| {
        r#"{"event":"e","payload":{}}"#.to_string()
    });
    let dead = store::stream::Reading {
        keys: &k,
        consumer: "host-a",
        max_bytes: 1 << 20,
    };
    assert_eq!(
        store::stream::read(&mut con, dead, 1000, ">")
            .unwrap()
            .deliveries
            .len(),
        150
    );
    age_pending(&mut con, &k, "host-a");

    let stats = Stats::default();
    let (tx, rx) = delay_worker::delivery::channel(8, 1);
    let (_space_tx, space_rx) = crossbeam_channel::bounded(1);
    let inbox = delay_worker::source::done::InboxLook::new(
        delay_worker::db::Target::parse(&env.db.url).unwrap(),
        env.config.reader.heartbeat_ttl,
    );
    let mut reader = Reader::new(
        &k,
        &env.config.reader,
        "host-b",
        &stats,
        Feed::new(tx, space_rx, &stats),
        &inbox,
    );
    reader.maintain(&mut con).unwrap();
    let mine = store::stream::pending(&mut con, &k, 0, 1000, Some("host-b")).unwrap();
    assert_eq!(mine.len(), 150, "all of host-a's entries at once");
    // And they are served as our own pending, channel by channel.
    let mut got = 0;
    while got < 150 {
        reader.poll(&mut con).unwrap();
        while let Ok(chunk) = rx.try_recv() {
            got += chunk.len();
        }
    }
    assert_eq!(got, 150);
    assert_eq!(stats.snapshot().reclaimed, 150);
}

/// Entries over `--max-deliveries` whose jobs cannot be looked up in the inbox (PostgreSQL
/// cannot be asked) wait: neither dead-lettered (one may have committed) nor delivered again,
/// by the start's re-read or by a reclaim (one may kill its consumer); once the inbox
/// answers they are decided (here none ran: dead letters).
#[test]
fn over_delivered_entries_wait_while_the_inbox_cannot_be_asked() {
    use delay_worker::db::Target;
    use delay_worker::source::done::InboxLook;
    let env = Env::new();
    let mut con = env.con();
    let k = env.config.keys.clone();
    let mut cfg = env.config.reader.clone();
    cfg.max_deliveries = 1;
    store::stream::ensure_group(&mut con, &k).unwrap();
    on_the_stream(&env, &mut con, 3, |i| {
        format!(r#"{{"event":"e","payload":{{"n":{i}}}}}"#)
    });
    // Delivered to c1 twice: once more than a limit of 1.
    let c1 = store::stream::Reading {
        keys: &k,
        consumer: "c1",
        max_bytes: 1 << 20,
    };
    assert_eq!(
        store::stream::read(&mut con, c1, 10, ">")
            .unwrap()
            .deliveries
            .len(),
        3
    );
    let again = store::stream::read(&mut con, c1, 10, "0")
        .unwrap()
        .deliveries;
    assert_eq!(again.len(), 3);
    // Each time its job started.
    let started: Vec<&delay_worker::delivery::Delivery> = again.iter().collect();
    for _ in 0..2 {
        store::started(&mut con, std::slice::from_ref(&k), &started, 1).unwrap();
    }

    let reader_on = |inbox: &InboxLook, con: &mut redis::Connection| {
        let stats = Stats::default();
        let (tx, rx) = delay_worker::delivery::channel(8, 1);
        let (_space_tx, space_rx) = crossbeam_channel::bounded(1);
        let mut reader = Reader::new(
            &k,
            &cfg,
            "c1",
            &stats,
            Feed::new(tx, space_rx, &stats),
            inbox,
        );
        reader
            .start(con, &delay_worker::shutdown::Shutdown::new())
            .unwrap();
        // Idle long enough to be reclaimed: the maintenance pass looks at them too.
        age_pending(con, &k, "c1");
        reader.maintain(con).unwrap();
        drop(reader);
        rx.try_iter().count()
    };
    // Nothing listens there.
    let nowhere = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let nowhere = InboxLook::new(Target::parse(&nowhere).unwrap(), cfg.heartbeat_ttl);
    assert_eq!(reader_on(&nowhere, &mut con), 0, "none delivered again");
    assert_eq!(
        books(&env).dead,
        0,
        "none dead-lettered while the inbox cannot be asked"
    );
    let pending = |con: &mut redis::Connection| {
        store::stream::pending(con, &k, 0, 100, Some("c1"))
            .unwrap()
            .len()
    };
    assert_eq!(pending(&mut con), 3);

    let inbox = InboxLook::new(Target::parse(&env.db.url).unwrap(), cfg.heartbeat_ttl);
    assert_eq!(reader_on(&inbox, &mut con), 0);
    assert_eq!(
        books(&env).dead,
        3,
        "decided once the inbox answers: none ran"
    );
    assert_eq!(pending(&mut con), 0);
}

/// The inbox look keeps its connection between looks, and makes a new one when the kept
/// one has gone (its session ended by the server: a restart, an administrator, a failover)
/// rather than leave entries undecided for a pass.
#[test]
fn the_inbox_look_makes_a_new_connection_when_its_kept_one_has_gone() {
    use delay_worker::source::done::InboxLook;
    use delay_worker::workers::session::InboxId;
    let env = Env::new();
    let look = InboxLook::new(
        delay_worker::db::Target::parse(&env.db.url).unwrap(),
        env.config.reader.heartbeat_ttl,
    );
    let id = InboxId {
        key: "k".into(),
        ts: 1,
        job_id: String::new(),
    };
    let sessions = || -> i64 {
        env.db
            .client()
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'delay-worker'",
                &[],
            )
            .unwrap()
            .get(0)
    };
    assert!(look.done(std::slice::from_ref(&id)).unwrap().is_empty());
    assert!(look.done(std::slice::from_ref(&id)).unwrap().is_empty());
    assert_eq!(sessions(), 1, "one connection, kept");
    env.db
        .client()
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'delay-worker'",
            &[],
        )
        .unwrap();
    wait_until(WAIT, "its session gone", || sessions() == 0);
    assert!(
        look.done(std::slice::from_ref(&id)).is_ok(),
        "answered on a new connection"
    );
    assert_eq!(sessions(), 1);
}

/// Defect 3: Messages of 10 MB never enter the worker: the mover dead-letters them inside Redis
/// with a prefix, their length and a digest.
#[test]
fn ten_megabyte_messages_are_dead_letters_of_a_few_kilobytes() {
    let env = Env::new();
    let mut con = env.con();
    let k = env.config.keys.clone();
    let orders = seed_orders(&env.db, 5);
    let big = format!(
        r#"{{"event":"order.timeout","payload":{{"order_no":"{}","pad":"{}"}}}}"#,
        orders[0].order_no,
        "p".repeat(10 << 20)
    );
    for i in 0..3 {
        store::push(
            &mut con,
            &k,
            &format!("big-{i}"),
            &big,
            delay_worker::now_ms(),
        )
        .unwrap();
    }
    push_timeouts(&env, &orders[1..], 0);
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "all settled", || {
        inbox_count(&env.db) == 4 && dead_letters(&env).len() == 3
    });
    let report = daemon.stop();
    assert_eq!(report.stats.delivered, 4, "only the small ones were read");
    for letter in dead_letters(&env) {
        assert!(letter["reason"].contains("too large"), "{letter:?}");
        assert_eq!(letter["length"], big.len().to_string());
        assert_eq!(letter["sha1"], sha1_hex(big.as_bytes()));
        assert_eq!(letter["msg"].len(), 4096);
    }
    let cancelled: Vec<&SeedOrder> = orders[1..].iter().collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_eq!(books(&env).pool, 0);
}

/// Defect 4: One `close_order_*` key holding a hash in a legacy pool is one dead letter; every
/// other member moves, and the books add up.
#[test]
fn one_bad_legacy_member_does_not_stall_its_pool() {
    let mut env = Env::new();
    env.config.mover.legacy = vec![LegacyPool {
        key: "delay:order_close".into(),
        event: "order.timeout".into(),
    }];
    let orders = seed_orders(&env.db, 20);
    let mut con = env.con();
    let now = delay_worker::now_ms();
    redis::cmd("HSET")
        .arg("close_order_bad")
        .arg("id")
        .arg("1")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("ZADD")
        .arg("delay:order_close")
        .arg(now - 100)
        .arg("close_order_bad")
        .query::<()>(&mut con)
        .unwrap();
    for o in &orders {
        let member = format!("close_order_{}", o.id);
        redis::cmd("SET")
            .arg(&member)
            .arg(o.id)
            .query::<()>(&mut con)
            .unwrap();
        redis::cmd("ZADD")
            .arg("delay:order_close")
            .arg(now - 50)
            .arg(&member)
            .query::<()>(&mut con)
            .unwrap();
    }
    let daemon = Daemon::start(&env.config);
    wait_until(WAIT, "every good member", || inbox_count(&env.db) == 20);
    let report = daemon.stop();
    let all: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &all);
    let letters = dead_letters(&env);
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0]["key"], "close_order_bad");
    assert!(
        letters[0]["reason"].contains("holds a hash"),
        "{:?}",
        letters[0]
    );
    let left: usize = redis::cmd("ZCARD")
        .arg("delay:order_close")
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 0);
    // One set of counters: every member that left the pool ended one way.
    let s = report.stats;
    assert_eq!(s.moved, 21);
    assert_eq!(s.moved, s.done + s.noop + s.duplicate + s.dead + s.retried);
}

/// Defect 5: PHP's `microtime(true)` writes `"ts": 1796040000.25`; the same job key pushed again
/// with the same `ts` is a new job, while a redelivery is not.
#[test]
fn a_job_key_pushed_again_within_the_same_second_is_a_new_job() {
    let env = Env::new();
    let mut con = env.con();
    let k = env.config.keys.clone();
    let orders = seed_orders(&env.db, 2);
    let daemon = Daemon::start(&env.config);
    for (round, ts) in ["1796040000.25", r#""1796040000.25""#].iter().enumerate() {
        let msg = format!(
            r#"{{"event":"order.timeout","payload":{{"order_no":"{}"}},"retry":0,"ts":{ts}}}"#,
            orders[0].order_no
        );
        // The PHP producer: HSET, then ZADD with a second score.
        redis::cmd("HSET")
            .arg(&k.data)
            .arg("order.timeout:same")
            .arg(&msg)
            .query::<()>(&mut con)
            .unwrap();
        redis::cmd("ZADD")
            .arg(&k.pool)
            .arg(delay_worker::now_ms() / 1000 - 1)
            .arg("order.timeout:same")
            .query::<()>(&mut con)
            .unwrap();
        wait_until(WAIT, "the push to run", || {
            inbox_count(&env.db) == round as i64 + 1
        });
    }
    let report = daemon.stop();
    assert_eq!(report.stats.duplicate, 0, "a new push is not a duplicate");
    assert_eq!((report.stats.done, report.stats.noop), (1, 1));
    let rows: Vec<(i64, String)> = env
        .db
        .client()
        .query(
            "SELECT enqueued_at, job_id FROM worker_inbox WHERE job_key = 'order.timeout:same'",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows.len(), 2);
    assert!(
        rows.iter()
            .all(|(ts, id)| *ts == 1796040000 && !id.is_empty()),
        "{rows:?}"
    );
    assert_ne!(rows[0].1, rows[1].1);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

/// Defect 1 in list mode: the dead list of the wrong type holds the message in the
/// processing list (not lost), and the worker settles it once the key is fixed, without a
/// restart.
#[test]
fn list_mode_holds_a_dead_letter_back_until_its_dead_list_is_fixed() {
    let mut env = Env::new();
    env.config.source = delay_worker::config::Source::List;
    env.config.keys.queues = vec![delay_worker::keys::Queue::new("q", None)];
    let mut con = env.con();
    redis::cmd("SET")
        .arg("q:dead")
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("LPUSH")
        .arg("q")
        .arg("not json")
        .query::<()>(&mut con)
        .unwrap();
    let daemon = Daemon::start(&env.config);
    let held = |con: &mut redis::Connection| -> usize {
        redis::cmd("LLEN")
            .arg("q:processing:c1")
            .query(con)
            .unwrap()
    };
    wait_until(WAIT, "the message held in processing", || {
        held(&mut env.con()) == 1
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(held(&mut con), 1, "still held, not lost");
    redis::cmd("DEL")
        .arg("q:dead")
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "the dead letter", || {
        let n: usize = redis::cmd("LLEN")
            .arg("q:dead")
            .query(&mut env.con())
            .unwrap();
        n == 1
    });
    let report = daemon.stop();
    assert_eq!(held(&mut con), 0);
    assert_eq!(report.stats.dead, 1);
}

/// `/healthz` names the key an operator must fix (not "the mover made no progress"), and
/// turns green again soon after it is fixed.
#[test]
fn healthz_names_the_wrong_key_and_recovers_once_it_is_fixed() {
    let mut env = Env::new();
    let port = free_port();
    env.config.metrics_addr = Some(format!("127.0.0.1:{port}").parse().unwrap());
    let mut con = env.con();
    let k = env.config.keys.clone();
    redis::cmd("SET")
        .arg(&k.data)
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    redis::cmd("ZADD")
        .arg(&k.pool)
        .arg(1)
        .arg("j")
        .query::<()>(&mut con)
        .unwrap();
    let daemon = Daemon::start(&env.config);
    let body = || {
        http_get(port, "/healthz")
            .map(|(c, _, b)| (c, b))
            .unwrap_or((0, String::new()))
    };
    wait_until(WAIT, "a 503 naming the key", || {
        let (code, b) = body();
        code == 503 && b.contains(&k.data)
    });
    // Still naming it well past the mover's stall threshold.
    std::thread::sleep(Duration::from_secs(3));
    let (code, b) = body();
    assert_eq!(code, 503);
    assert!(b.contains(&k.data), "{b}");
    redis::cmd("DEL")
        .arg(&k.data)
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "200 again", || body().0 == 200);
    daemon.stop();
    // The member without data (due in 1970) is an orphan: a dead letter with its reason.
    let letters = dead_letters(&env);
    assert_eq!(letters.len(), 1);
    assert!(letters[0]["reason"].contains("no data"), "{:?}", letters[0]);
    assert_eq!(books(&env).pool, 0);
}

/// With `--shards 3`, shard 1's dead-letter key holding a list (`RPUSH {mq:1}:dead-letter
/// junk`): `stats --check` is CRITICAL naming the key and its shard, `/healthz` is 503
/// naming it, the log says so once (no "fixed" line every `--block` while it lasts), the
/// status page names it and still shows the other shards' letters, the other shards' jobs
/// run, and once the key is removed shard 1's held letter is written: every job once.
#[test]
fn a_shards_dead_letter_key_of_the_wrong_type_is_named_and_held_until_fixed() {
    let env = Env::new();
    let mut config = env.config.clone();
    config.shards = 3;
    let shards = config.shard_keys();
    let mut con = env.con();
    redis::cmd("RPUSH")
        .arg(&shards[1].dead)
        .arg("junk")
        .query::<()>(&mut con)
        .unwrap();
    let orders = seed_orders(&env.db, 9);
    let now = delay_worker::now_ms();
    let in_shard = push_due_in_shards(&mut con, &config, &orders);
    assert!(
        in_shard[1] > 0,
        "a good job in the broken shard: {in_shard:?}"
    );
    // One message that must become a dead letter in each shard.
    let bad: Vec<String> = (0..3)
        .map(|s| {
            (0..)
                .map(|n| format!("bad-{n}"))
                .find(|k| delay_worker::keys::shard_of(k.as_bytes(), 3) == s)
                .unwrap()
        })
        .collect();
    for (s, key) in bad.iter().enumerate() {
        store::push(&mut con, &shards[s], key, "not json", now).unwrap();
    }

    let port = free_port();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", &config.redis_url)
        .env("DATABASE_URL", &config.database_url)
        .env("RUST_LOG", "info")
        .env_remove("NOTIFY_SOCKET")
        .args(["--consumer", "c1", "--threads", "2", "--shards", "3"])
        .args(["--poll-interval", "20ms", "--block", "200ms"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::null());
    let mut worker = Proc::spawn(cmd);
    // Not `books_on`: the broken shard's XLEN would fail.
    let pending = |s: usize| {
        store::stream::pending(&mut env.con(), &shards[s], 0, 1000, None)
            .map(|p| p.len())
            .unwrap_or(0)
    };
    wait_until(
        WAIT,
        "the other shards' jobs done, shard 1's letter held",
        || {
            inbox_count(&env.db) == orders.len() as i64
                && [0, 2]
                    .iter()
                    .all(|&s| books_on(&mut env.con(), &shards[s]).dead == 1 && pending(s) == 0)
                && pending(1) == 1
        },
    );
    let healthz = || http_get(port, "/healthz").unwrap_or((0, String::new(), String::new()));
    wait_until(WAIT, "/healthz 503 naming the key", || {
        let (code, _, body) = healthz();
        code == 503 && body.contains(&shards[1].dead)
    });

    let check = run_worker(
        &["stats", "--check", "--shards", "3"],
        &env.redis.url(),
        &env.db.url,
    );
    let line = text(&check.stdout);
    assert_eq!(check.status.code(), Some(2), "{line}");
    assert!(line.starts_with("CRITICAL"), "{line}");
    assert!(
        line.contains(&format!("{:?} (shard 1)", shards[1].dead)),
        "{line}"
    );

    let (code, _, page) = http_get(port, "/dead").unwrap();
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("data-k=\"dead.broken\""), "{page}");
    assert!(page.contains("(shard 1) holds a list"), "{page}");
    for s in [0, 2] {
        assert!(
            page.contains(&format!(">{}<", bad[s])),
            "shard {s}'s letter: {page}"
        );
    }
    let (_, _, overview) = http_get(port, "/").unwrap();
    assert!(overview.contains("Redis refused"), "{overview}");
    assert!(overview.contains("(shard 1) holds a list"), "{overview}");
    assert!(overview.contains("Not live"), "{overview}");

    // While the key stays wrong: no "fixed" line, and no repeat before 30 s (the reader
    // looks at the key every --block, 200 ms).
    let seen = worker.log().len();
    std::thread::sleep(Duration::from_secs(2));
    let log = worker.log();
    let window = &log[seen..];
    assert!(!window.contains("fixed"), "{window}");
    assert!(window.matches("held back").count() <= 1, "{window}");
    assert_eq!(pending(1), 1, "still held, not lost");
    assert_eq!(healthz().0, 503);

    redis::cmd("DEL")
        .arg(&shards[1].dead)
        .query::<()>(&mut con)
        .unwrap();
    wait_until(WAIT, "shard 1's letter written, /healthz green", || {
        books_on(&mut env.con(), &shards[1]).dead == 1 && pending(1) == 0 && healthz().0 == 200
    });
    wait_until(WAIT, "the reader's fixed line", || {
        worker
            .log()
            .contains("reader (shard 1): the key that held messages back is fixed")
    });
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success(), "{}", worker.log());
    let log = worker.log();
    assert_eq!(
        log.matches("reader (shard 1): messages are held back")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches("is fixed").count(), 1, "{log}");
    for (s, keys) in shards.iter().enumerate() {
        let b = books_on(&mut con, keys);
        assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 1), "shard {s}");
        let letters: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&keys.dead)
            .arg("-")
            .arg("+")
            .query(&mut con)
            .unwrap();
        let key = &letters[0].1.iter().find(|(f, _)| f == "key").unwrap().1;
        assert_eq!(key, &bad[s], "shard {s}");
    }
    assert_eq!(inbox_count(&env.db), orders.len() as i64);
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}

/// An `order.timeout` due now for each order, each to its shard's keys (`config.shards`
/// of them); how many went to each shard.
fn push_due_in_shards(
    con: &mut redis::Connection,
    config: &delay_worker::Config,
    orders: &[SeedOrder],
) -> Vec<i64> {
    let now = delay_worker::now_ms();
    let mut in_shard = vec![0i64; config.shards];
    for o in orders {
        let key = format!("order.timeout:{}", o.order_no);
        in_shard[delay_worker::keys::shard_of(key.as_bytes(), config.shards)] += 1;
        let keys = config.keys_for(key.as_bytes());
        let job = delay_worker::producer::NewJob {
            event: "order.timeout".into(),
            payload: serde_json::json!({ "order_no": o.order_no }),
            due_ms: now,
            key: Some(key),
        };
        delay_worker::producer::push(con, &keys, &job, now).unwrap();
    }
    in_shard
}

/// With `--shards 6` and a full channel (the one worker inside slow transactions), the
/// reader waits for room once a round, not once a shard: every shard's heartbeat stays
/// alive. Found from outside: each shard waited a `--block` in turn, so a round took six,
/// a live process's heartbeats lapsed and its peers took its entries as a dead one's (and
/// its no-database marks came a block apart, shard after shard).
#[test]
fn a_full_channel_lets_no_shard_s_heartbeat_lapse() {
    let env = Env::new();
    let mut config = env.config.clone();
    config.shards = 6;
    config.threads = 1;
    config.reader.block = Duration::from_millis(300);
    config.reader.heartbeat_ttl = Duration::from_secs(1);
    let shards = config.shard_keys();
    let orders = seed_orders(&env.db, 300);
    orders_slow_to_update(&env.db, 0.05);
    let daemon = Daemon::start(&config);
    let mut con = env.con();
    push_due_in_shards(&mut con, &config, &orders);
    wait_until(WAIT, "the first jobs under way", || {
        shards.iter().any(|k| {
            redis::cmd("XLEN")
                .arg(&k.stream)
                .query::<u64>(&mut env.con())
                .unwrap()
                > 0
        })
    });
    std::thread::sleep(Duration::from_millis(500));
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        for (i, k) in shards.iter().enumerate() {
            let alive: bool = redis::cmd("EXISTS")
                .arg(k.heartbeat("c1"))
                .query(&mut con)
                .unwrap();
            assert!(alive, "shard {i}'s heartbeat lapsed");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    orders_quick_again(&env.db);
    wait_until(WAIT, "every job done", || inbox_count(&env.db) == 300);
    let s = daemon.stop().stats;
    assert_eq!(s.duplicate, 0, "{s}");
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
}
