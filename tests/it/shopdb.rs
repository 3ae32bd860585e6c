//! The shop's own database misbehaving: a server that turns read-only, a failover to a
//! standby, the shop's locks, the shop's traffic locking in another order, a column
//! renamed by a deploy, a handler whose table is not there yet. Each ends with the books
//! (every unpaid order cancelled once, stock and coupons exact) and no dead letter for a
//! fault of the surroundings, and checks what health said while it lasted.

use crate::support::*;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(90);

fn all(orders: &[SeedOrder]) -> Vec<&SeedOrder> {
    orders.iter().collect()
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// The worker binary with `/healthz` on a free port, and that port.
pub(crate) fn start_with_health(env: &Env, extra: &[&str]) -> (Proc, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut a = args(&["--metrics-addr", &addr]);
    a.extend(args(extra));
    (Proc::start(&env.config, &a), port)
}

/// Processes of one prefix, consumers `<consumer>-<name>`, each with its `/healthz` port
/// and these flags, started and green.
pub(crate) fn start_named(env: &Env, names: &[&str], extra: &[&str]) -> Vec<(Proc, u16)> {
    start_named_as(&env.config, names, extra)
}

/// [`start_named`] with `config` (another role's database URL, say).
pub(crate) fn start_named_as(
    config: &delay_worker::Config,
    names: &[&str],
    extra: &[&str],
) -> Vec<(Proc, u16)> {
    let procs: Vec<(Proc, u16)> = names
        .iter()
        .map(|name| {
            let mut c = config.clone();
            c.consumer = format!("{}-{name}", config.consumer);
            let port = free_port();
            let addr = format!("127.0.0.1:{port}");
            let mut a = args(&["--metrics-addr", &addr]);
            a.extend(args(extra));
            (Proc::start(&c, &a), port)
        })
        .collect();
    for (_, port) in &procs {
        wait_until(WAIT, "/healthz green", || healthz(*port).0 == 200);
    }
    procs
}

/// `/healthz`: the status code and the body.
pub(crate) fn healthz(port: u16) -> (u16, String) {
    match http_get(port, "/healthz") {
        Ok((code, _, body)) => (code, body),
        Err(e) => (0, e.to_string()),
    }
}

/// One sample of `/metrics` by its full name with labels, e.g.
/// `delay_worker_jobs_total{event="order.timeout",outcome="held"}`.
pub(crate) fn metric(port: u16, name: &str) -> f64 {
    // Not up yet: no sample.
    let Ok((_, _, body)) = http_get(port, "/metrics") else {
        return -1.0;
    };
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// `worker stats --check`: its exit code and its line.
pub(crate) fn check(env: &Env) -> (i32, String) {
    let out = run_worker(
        &["stats", "--check"],
        &env.config.redis_url,
        &env.config.database_url,
    );
    (out.status.code().unwrap_or(-1), text(&out.stdout))
}

/// Asks `/healthz` every 200 ms for `span`: red (503) at every look, or a panic naming
/// how many were not.
fn red_throughout(port: u16, span: Duration) {
    let (since, mut looks, mut not_red) = (Instant::now(), 0, 0);
    while since.elapsed() < span {
        looks += 1;
        if healthz(port).0 != 503 {
            not_red += 1;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(not_red, 0, "not red in {not_red} of {looks} looks");
}

/// Waits until `stats --check` is CRITICAL with a line that holds `what`.
pub(crate) fn wait_check_critical(env: &Env, what: &str) {
    wait_until(
        WAIT,
        &format!("stats --check CRITICAL naming {what}"),
        || {
            let (code, line) = check(env);
            code == 2 && line.contains(what)
        },
    );
}

/// Stops the worker with SIGTERM; it must exit 0.
pub(crate) fn stop(mut w: Proc) {
    w.signal(libc::SIGTERM);
    let status = w.wait(Duration::from_secs(30));
    assert!(status.success(), "exit {status:?}: {}", w.log());
}

/// `/healthz` green again, the worker stopped, these orders cancelled once and the
/// rest left as they were, and no dead letter.
fn green_then_books(env: &Env, w: Proc, port: u16, orders: &[SeedOrder], cancelled: &[&SeedOrder]) {
    wait_until(WAIT, "/healthz green again", || healthz(port).0 == 200);
    stop(w);
    assert_accounting(&env.db, orders, cancelled);
    assert_eq!(books(env).dead, 0);
}

/// Every job done, the worker stopped, every order cancelled once with its stock and
/// coupon back, and no dead letter: the shop's locks are no fault of the jobs.
fn every_order_cancelled_once(env: &Env, w: Proc, orders: &[SeedOrder]) {
    wait_done(env, &env.db, orders.len() as i64);
    stop(w);
    assert_accounting(&env.db, orders, &all(orders));
    assert_eq!(books(env).dead, 0, "a shop lock is no fault of the job");
}

fn wait_done(env: &Env, db: &TestDb, n: i64) {
    wait_until(WAIT, "every job done", || {
        let b = books(env);
        inbox_count(db) == n && b.pool == 0 && b.stream_pending == 0
    });
}

/// Backends of the worker left in an aborted transaction: never one.
fn aborted_backends(db: &TestDb) -> i64 {
    db.client()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'delay-worker' \
             AND state = 'idle in transaction (aborted)'",
            &[],
        )
        .unwrap()
        .get(0)
}

#[test]
fn a_server_turned_read_only_holds_every_job_and_health_is_red_until_it_takes_writes() {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 300);
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[..100], 0);
    wait_done(&env, &env.db, 100);
    // Green before the fault (on a loaded machine a look may still be under way at the
    // last job: found once among the whole suite's parallel run).
    wait_until(WAIT, "/healthz green before the fault", || {
        healthz(port).0 == 200
    });

    // Read-only (as a primary demoted, or default_transaction_read_only switched on)
    // while jobs fall due: they wait, none is dead-lettered, health says why.
    pg.set_read_only(true);
    push_timeouts(&env, &orders[100..], 0);
    wait_until(WAIT, "/healthz red naming the read-only server", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("read-only")
    });
    wait_check_critical(&env, "no writable PostgreSQL");
    // A backend takes the new setting at its next command after the reload, so on a loaded
    // machine a set may still commit just after `set_read_only` (found once: 123 done): what
    // counts is that nothing commits once the worker has seen the server read-only.
    let done_when_red = inbox_count(&env.db);
    red_throughout(port, Duration::from_secs(3));
    assert_eq!(books(&env).dead, 0, "no dead letter for a read-only server");
    assert_eq!(
        inbox_count(&env.db),
        done_when_red,
        "nothing done while read-only"
    );
    // A worker started now, with the one host: one line and exit 1 (its unit starts it
    // again), not a worker at work on a read-only server.
    let mut second = env.config.clone();
    second.consumer = "second".into();
    let mut late = Proc::start(&second, &[]);
    assert_eq!(late.wait(WAIT).code(), Some(1), "{}", late.log());
    assert!(
        late.log().contains(
            "the server is read-only (a standby, or default_transaction_read_only is on)"
        ),
        "{}",
        late.log()
    );
    assert_eq!(
        metric(
            port,
            "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"dead\"}"
        ),
        0.0
    );

    pg.set_read_only(false);
    wait_done(&env, &env.db, 300);
    wait_until(WAIT, "/healthz green again", || healthz(port).0 == 200);
    wait_until(WAIT, "stats --check OK again", || check(&env).0 == 0);
    assert_eq!(aborted_backends(&env.db), 0, "no connection left aborted");
    stop(w);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// A synchronous standby gone (`synchronous_standby_names` naming one that is not
/// connected): every commit that waits for it waits, the workers' acknowledgements among
/// them, so every job waits, while the server takes writes and no statement times out.
/// Health is red naming it within seconds, none is dead-lettered, and once the setting is
/// changed every job runs once. A graceful stop meanwhile, whose jobs in hand wait for
/// their commit, exits after `--shutdown-timeout`, its jobs left for the next start.
/// Found from outside: a synchronous standby stopped for 40 s stopped every job with
/// `/healthz` 200 and `stats --check` OK throughout, and a SIGTERM meanwhile left the
/// process running until the standby was back.
#[test]
fn a_synchronous_standby_gone_holds_every_job_and_health_is_red_until_it_is_back() {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 200);
    let (mut w, port) = start_with_health(&env, &["--shutdown-timeout", "3s"]);
    push_timeouts(&env, &orders[..100], 0);
    wait_done(&env, &env.db, 100);
    wait_until(WAIT, "/healthz green before the fault", || {
        healthz(port).0 == 200
    });
    pg.set_synchronous_standby(Some("gone"));
    let gone = Instant::now();
    push_timeouts(&env, &orders[100..], 0);
    const TOLD: &str = "wait for their commit to reach a synchronous standby";
    wait_until(WAIT, "/healthz red naming the synchronous standby", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains(TOLD)
    });
    assert!(
        gone.elapsed() < delay_worker::dbwatch::SYNC_WAIT_CRIT + Duration::from_secs(5),
        "red {:?} after the standby went",
        gone.elapsed()
    );
    wait_check_critical(&env, TOLD);
    red_throughout(port, Duration::from_secs(2));
    let b = books(&env);
    assert_eq!(b.dead, 0, "a standby gone is no job's fault");
    assert!(
        b.pool + b.stream_pending > 0,
        "the jobs wait: {b:?} with {} done",
        inbox_count(&env.db)
    );
    w.signal(libc::SIGTERM);
    let stopping = Instant::now();
    assert_eq!(w.wait(WAIT).code(), Some(130), "{}", w.log());
    assert!(
        stopping.elapsed() < Duration::from_secs(3 + 5),
        "stopped {:?} after the signal",
        stopping.elapsed()
    );
    assert!(
        w.log()
            .contains("the jobs in hand are not finished 3 s after the SIGTERM"),
        "{}",
        w.log()
    );
    pg.set_synchronous_standby(None);
    let (w, port) = start_with_health(&env, &[]);
    wait_done(&env, &env.db, 200);
    wait_until(WAIT, "stats --check OK again", || check(&env).0 == 0);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// [`a_synchronous_standby_gone_holds_every_job_and_health_is_red_until_it_is_back`] with
/// the workers' sessions that wait for it ended every second (an operator's or a pooler's
/// `pg_terminate_backend`): no wait reaches [`delay_worker::dbwatch::SYNC_WAIT_CRIT`] and
/// each worker opens a new session at once, yet no acknowledgement goes through, so health
/// stays red. Found from outside: `/healthz` 200 for over 90 % of 20 s in which nothing
/// was acknowledged.
#[test]
fn a_synchronous_standby_gone_while_its_waiting_sessions_are_ended_again_and_again_is_red_throughout(
) {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 100);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green before the fault", || {
        healthz(port).0 == 200
    });
    pg.set_synchronous_standby(Some("gone"));
    let ending = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let ender = {
        let (url, ending) = (pg.url.clone(), ending.clone());
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
            while ending.load(std::sync::atomic::Ordering::Relaxed) {
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE wait_event = 'SyncRep' AND application_name LIKE 'delay-worker%'",
                    &[],
                )
                .unwrap();
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red", || healthz(port).0 == 503);
    red_throughout(port, Duration::from_secs(6));
    let b = books(&env);
    assert!(b.pool + b.stream_pending > 0, "the jobs wait: {b:?}");
    ending.store(false, std::sync::atomic::Ordering::Relaxed);
    ender.join().unwrap();
    pg.set_synchronous_standby(None);
    wait_done(&env, &env.db, 100);
    assert_eq!(books(&env).dead, 0, "a standby gone is no job's fault");
    green_then_books(&env, w, port, &orders, &all(&orders));
}

#[test]
fn a_single_host_url_to_a_server_restarted_as_a_standby_holds_until_it_is_promoted() {
    let (env, pg) = Env::on_own_postgres(&[]);
    let orders = seed_orders(&env.db, 200);
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[..100], 0);
    wait_done(&env, &env.db, 100);
    // The old primary comes back in recovery: it answers, and takes no writes.
    pg.restart_as_standby();
    push_timeouts(&env, &orders[100..], 0);
    wait_until(WAIT, "/healthz red naming the read-only server", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("read-only")
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(books(&env).dead, 0);
    assert_eq!(inbox_count(&env.db), 100);
    pg.promote();
    wait_done(&env, &env.db, 200);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A primary with a synchronous streaming standby, and a worker given both hosts.
struct Pair {
    primary: PgServer,
    standby: PgServer,
    url: String,
}

fn pair() -> Pair {
    let primary = PgServer::start(&[]);
    let standby = primary.standby();
    // Commits wait for the standby: a crash of the primary loses no acknowledged commit.
    primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'");
    primary.sql("SELECT pg_reload_conf()");
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        primary.port, standby.port
    );
    Pair {
        primary,
        standby,
        url,
    }
}

/// Pushes `orders` due over `spread`, a slice at a time, from now.
fn push_spread(env: &Env, orders: &[SeedOrder], spread: Duration) {
    let slices = 10;
    let per = orders.len().div_ceil(slices);
    for (i, chunk) in orders.chunks(per).enumerate() {
        let delay = spread.as_millis() as i64 * i as i64 / slices as i64;
        push_timeouts(env, chunk, delay);
    }
}

#[test]
fn a_crash_failover_to_a_promoted_standby_loses_nothing_and_dead_letters_nothing() {
    let mut env = Env::new();
    let p = pair();
    env.db = p.primary.db();
    env.config.database_url = p.url.clone();
    let orders = seed_orders(&env.db, 600);
    let (w, port) = start_with_health(&env, &[]);
    push_spread(&env, &orders, Duration::from_secs(4));
    wait_until(WAIT, "progress", || inbox_count(&env.db) > 100);
    p.primary.crash();
    let crashed = Instant::now();
    // A failover manager takes a few seconds to decide; the workers keep trying. (At 3 s
    // the promotion fell just before a retry of the pool's old 2.5 s rhythm, so it showed
    // 0.0-0.3 s where 4 s showed 1.3 s.)
    std::thread::sleep(Duration::from_secs(4));
    p.standby.promote();
    let promoted = Instant::now();
    let db = p.standby.db();
    let at_promotion = inbox_count(&db);
    wait_until(WAIT, "jobs flowing on the promoted standby", || {
        inbox_count(&db) > at_promotion
    });
    let flowing = promoted.elapsed();
    wait_done(&env, &db, 600);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    stop(w);
    assert_accounting(&db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0, "no dead letter for a failover");
    if std::env::var_os("DW_SHOW_TIMINGS").is_some() {
        eprintln!(
            "crash failover: promoted {:.1}s after the crash, jobs flowing {:.1}s after the promotion",
            (promoted - crashed).as_secs_f64(),
            flowing.as_secs_f64()
        );
    }
}

#[test]
fn a_primary_that_turns_read_only_first_then_a_promoted_standby_loses_nothing() {
    let mut env = Env::new();
    let p = pair();
    env.db = p.primary.db();
    env.config.database_url = p.url.clone();
    let orders = seed_orders(&env.db, 600);
    let (w, port) = start_with_health(&env, &[]);
    push_spread(&env, &orders, Duration::from_secs(4));
    wait_until(WAIT, "progress", || inbox_count(&env.db) > 100);
    // A switchover: the old primary stops taking writes, the standby catches up and is
    // promoted, and the old primary comes back as a (read-only) standby.
    p.primary.set_read_only(true);
    wait_until(WAIT, "/healthz red", || healthz(port).0 == 503);
    let held = inbox_count(&env.db);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        inbox_count(&env.db),
        held,
        "nothing done on a read-only primary"
    );
    assert_eq!(books(&env).dead, 0, "and nothing dead-lettered");
    p.standby.promote();
    let promoted = Instant::now();
    let db = p.standby.db();
    wait_until(WAIT, "jobs flowing on the promoted standby", || {
        inbox_count(&db) > held
    });
    let flowing = promoted.elapsed();
    p.primary.restart_as_standby();
    wait_done(&env, &db, 600);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    stop(w);
    assert_accounting(&db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0, "no dead letter for a switchover");
    if std::env::var_os("DW_SHOW_TIMINGS").is_some() {
        eprintln!(
            "read-only first: jobs flowing {:.1}s after the promotion",
            flowing.as_secs_f64()
        );
    }
}

/// Holds a row lock of `table` (`id`) in a transaction of its own until released.
fn hold_lock(
    db: &TestDb,
    table: &'static str,
    id: i64,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    hold_locks(db, table, vec![id])
}

/// [`hold_lock`] on several rows of one table, in one transaction.
fn hold_locks(
    db: &TestDb,
    table: &'static str,
    ids: Vec<i64>,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let url = db.url.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let mut t = c.transaction().unwrap();
        t.execute(
            &format!("SELECT 1 FROM {table} WHERE id = ANY($1) FOR UPDATE"),
            &[&ids],
        )
        .unwrap();
        ready_tx.send(()).unwrap();
        let _ = rx.recv();
        t.rollback().unwrap();
    });
    ready_rx.recv().unwrap();
    (tx, h)
}

/// Shop locks on an order and on a sku several orders share: those jobs wait (no dead
/// letter), counted and shown, `stats --check` warns of it while it lasts and no longer
/// once the last waiting job has gone through (found from outside: the warning outlived
/// it by a minute); then each is cancelled once.
#[test]
fn a_shop_lock_holds_its_order_and_the_orders_sharing_a_sku_then_they_are_cancelled_once() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 60);
    // The shop holds one order (a long SELECT ... FOR UPDATE) and one sku that several
    // orders share, much longer than --retry-base: the jobs come back again and again.
    let sku = orders[7].items[0].0;
    let sharing = orders
        .iter()
        .filter(|o| o.items.iter().any(|i| i.0 == sku))
        .count();
    assert!(sharing > 3, "{sharing} orders share the sku");
    let (release_order, h1) = hold_lock(&env.db, "orders", orders[0].id);
    let (release_sku, h2) = hold_lock(&env.db, "sku", sku);
    let (w, port) = start_with_health(
        &env,
        &[
            "--lock-timeout",
            "50ms",
            "--max-retries",
            "1",
            "--retry-cap",
            "300ms",
        ],
    );
    push_timeouts(&env, &orders, 0);
    // Everything that does not need the locked rows is done.
    wait_until(WAIT, "the unlocked orders", || {
        inbox_count(&env.db) as usize == orders.len() - sharing - 1
    });
    wait_until(WAIT, "the waiting jobs counted", || {
        metric(port, "delay_worker_jobs_waiting_on_contention") >= (sharing + 1) as f64
    });
    // Many retries later (more than --max-retries), still no dead letter: it waits.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(books(&env).dead, 0, "a shop lock is no fault of the job");
    let (_, _, page) = http_get(port, "/").unwrap();
    assert!(
        page.contains("wait on contention (the shop's locks, statement timeouts)"),
        "{page}"
    );
    let (code, line) = check(&env);
    assert!(code == 1 && line.contains("contention"), "{code} {line}");
    release_order.send(()).unwrap();
    release_sku.send(()).unwrap();
    h1.join().unwrap();
    h2.join().unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    wait_until(WAIT, "no job waiting", || {
        metric(port, "delay_worker_jobs_waiting_on_contention") == 0.0
    });
    // The warning goes with the last waiting job (it stayed a minute after the last retry).
    wait_until(
        Duration::from_secs(5),
        "stats --check without contention",
        || !check(&env).1.contains("contention"),
    );
    stop(w);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// The first order's first sku, and the orders that need it.
fn sharing_a_sku(orders: &[SeedOrder]) -> (i64, Vec<SeedOrder>) {
    let sku = orders[0].items[0].0;
    let sharing = orders
        .iter()
        .filter(|o| o.items.iter().any(|i| i.0 == sku))
        .cloned()
        .collect();
    (sku, sharing)
}

/// A row every due job needs, locked by the shop (a flash sale's sku held by a session
/// idle in its transaction): no job of the event changes anything, so the queue stands
/// still and the lock is the surroundings' as a whole table's is. Past `--retry-for` none
/// is dead-lettered, health turns red, a second's gap in the lock changes nothing, and
/// once the lock goes each order is cancelled once. (From outside: with `--retry-for
/// 15s`, 181 of 2,700 unpaid orders sharing a locked sku were dead letters, left
/// uncancelled.)
#[test]
fn a_row_every_job_needs_locked_past_the_retry_horizon_dead_letters_none() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 200);
    let (sku, sharing) = sharing_a_sku(&orders);
    let (release, holder) = hold_lock(&env.db, "sku", sku);
    let (w, port) = start_with_health(
        &env,
        &[
            "--max-retries",
            "1",
            "--retry-for",
            "2s",
            "--retry-cap",
            "1s",
        ],
    );
    push_timeouts(&env, &sharing, 0);
    // Red once no job of the event has changed anything for 30 s, many tries past the
    // horizon.
    wait_until(
        Duration::from_secs(60),
        "/healthz red for the standstill",
        || {
            assert_eq!(
                books(&env).dead,
                0,
                "a row every job needs is no job's fault"
            );
            let (code, body) = healthz(port);
            code == 503 && body.contains("has changed anything")
        },
    );
    assert_eq!(inbox_count(&env.db), 0);
    // Let go for a moment and taken again (a stock job re-locking the sku): the orders
    // that go through in the gap prove nothing of the lock for the ones that still wait
    // (found from outside: 260 of 900 unpaid orders were dead letters after a gap of 1 s).
    // A short gap: the jobs that waited are brought forward as the lock ends (its
    // holder's session seen out of its transaction), and in a gap of 300 ms every one
    // went through.
    release.send(()).unwrap();
    holder.join().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let (release, holder) = hold_lock(&env.db, "sku", sku);
    let through = inbox_count(&env.db);
    let again = Instant::now();
    while again.elapsed() < Duration::from_secs(8) {
        assert_eq!(books(&env).dead, 0, "a gap in the lock proves nothing");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        through < sharing.len() as i64,
        "{through} went through in the gap: none would be left to wait"
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    wait_done(&env, &env.db, sharing.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&sharing));
}

/// Two orders locked by the shop while the others fall due and go through: a lock wait is
/// the surroundings' fault however long it lasts, so past `--retry-for` neither is a dead
/// letter; `/healthz` turns red naming one, and once the locks go both are cancelled once.
/// (Before, the others' changes proved the locks the two jobs' own, and both were dead
/// letters; from outside, two skus the shop kept busy past `--retry-for 20s` left 15
/// unpaid orders dead-lettered and uncancelled.)
#[test]
fn rows_only_some_waiting_jobs_meet_are_waited_out_past_the_horizon_red_while_others_go_through() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 122);
    let locks = [
        lock_order(&env, orders[0].id),
        lock_order(&env, orders[1].id),
    ];
    let (w, port) = start_with_health(
        &env,
        &[
            "--lock-timeout",
            "50ms",
            "--max-retries",
            "2",
            "--retry-cap",
            "300ms",
            "--retry-for",
            "3s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders[..2], 0);
    for (i, o) in orders[2..].iter().enumerate() {
        push_timeouts(&env, std::slice::from_ref(o), 100 * i as i64);
    }
    let others: Vec<&SeedOrder> = orders[2..].iter().collect();
    wait_until(WAIT, "/healthz red past --retry-for", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("past --retry-for 3.0 s")
    });
    wait_until(WAIT, "the other orders", || {
        cancelled(&env.db, &others) == others.len()
    });
    // Well past the horizon, while the others went through: still waiting.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(books(&env).dead, 0, "a lock wait is never a dead letter");
    assert_eq!(healthz(port).0, 503, "red while the locks last");
    for (release, h) in locks {
        release.send(()).unwrap();
        h.join().unwrap();
    }
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// PostgreSQL without a connection slot for a new session (another client took them all)
/// while the workers keep their own: the jobs go through, `/healthz` answers 200 with the
/// warning and `stats --check` is a WARNING naming it, the two agreeing; once the workers'
/// sessions are cut too, so that none can get one back, both are red; once the slots are
/// free, green, and every order is cancelled once. (From outside: 503 for 57 s while the
/// jobs went through, and `stats --check` OK.)
#[test]
fn no_connection_slot_for_a_new_session_is_a_warning_while_the_workers_keep_theirs() {
    let (mut env, pg) = Env::on_own_postgres(&[
        "-c max_connections=14",
        "-c superuser_reserved_connections=0",
    ]);
    env.config.threads = 2;
    let orders = seed_orders(&env.db, 40);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let mut hogs = Vec::new();
    let take_every_slot = |hogs: &mut Vec<postgres::Client>| {
        while let Ok(c) = postgres::Client::connect(&pg.url, postgres::NoTls) {
            hogs.push(c);
        }
    };
    take_every_slot(&mut hogs);
    assert!(!hogs.is_empty(), "no slot was free");
    push_timeouts(&env, &orders[..20], 0);
    let done = |hogs: &mut Vec<postgres::Client>| -> i64 {
        hogs[0]
            .query_one("SELECT count(*) FROM worker_inbox", &[])
            .unwrap()
            .get(0)
    };
    wait_until(WAIT, "jobs through the workers' own sessions", || {
        done(&mut hogs) == 20
    });
    let slots = "no connection left for a new session";
    wait_until(WAIT, "/healthz 200 with the warning", || {
        let (code, body) = healthz(port);
        code == 200 && body.contains(slots)
    });
    wait_until(WAIT, "stats --check a WARNING naming it", || {
        let (code, line) = check(&env);
        code == 1 && line.contains(slots)
    });
    // The slots free again: both say so within seconds, not a minute later (found from
    // outside: `stats --check` kept the warning for 60 s after `/healthz` was plain ok).
    drop(std::mem::take(&mut hogs));
    wait_until(WAIT, "/healthz plain ok", || {
        healthz(port) == (200, "ok\n".into())
    });
    wait_until(Duration::from_secs(20), "stats --check OK", || {
        check(&env).0 == 0
    });
    take_every_slot(&mut hogs);
    // The workers' sessions cut, their slots taken as they free: a job due now finds none.
    for _ in 0..200 {
        let theirs: i64 = hogs[0]
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'delay-worker'",
                &[],
            )
            .unwrap()
            .get(0);
        if theirs == 0 {
            break;
        }
        hogs[0]
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = 'delay-worker'",
                &[],
            )
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        take_every_slot(&mut hogs);
    }
    push_timeouts(&env, &orders[20..], 0);
    wait_until(WAIT, "/healthz red", || healthz(port).0 == 503);
    wait_until(WAIT, "stats --check CRITICAL", || check(&env).0 == 2);
    drop(hogs);
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A process restarted while a job waits past `--retry-for` for a lock is red from its
/// start, before the job's next try: it counts the lock waiters an earlier run left in the
/// pool. (From outside: a restarted process was green for 20 s, until that try; the
/// retries' backoff reaches 30 s.)
#[test]
fn a_process_restarted_while_a_job_waits_past_the_horizon_for_a_lock_is_red_from_its_start() {
    let mut env = Env::new();
    // The job's next try 9-15 s after its first.
    env.config.jobs.retry_base = Duration::from_secs(12);
    let orders = seed_orders(&env.db, 2);
    let (release, holder) = lock_order(&env, orders[0].id);
    let flags = [
        "--lock-timeout",
        "50ms",
        "--max-retries",
        "1",
        "--retry-for",
        "1s",
    ];
    let red = |port| {
        let (code, body) = healthz(port);
        code == 503 && body.contains("past --retry-for 1.0 s") && body.contains(&orders[0].order_no)
    };
    let (w, port) = start_with_health(&env, &flags);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red past --retry-for", || red(port));
    stop(w);
    let key = format!("order.timeout:{}", orders[0].order_no);
    let retry_due: f64 = redis::cmd("ZSCORE")
        .arg(&env.config.keys.pool)
        .arg(&key)
        .query(&mut env.con())
        .unwrap();
    let (w, port) = start_with_health(&env, &flags);
    wait_until(WAIT, "/healthz red again after the restart", || red(port));
    let seen = delay_worker::now_ms();
    assert!(
        (seen as f64) < retry_due,
        "red only at the job's next try ({} ms after it was due)",
        seen as f64 - retry_due
    );
    assert_eq!(books(&env).dead, 0, "a lock wait is never a dead letter");
    release.send(()).unwrap();
    holder.join().unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A worker stopped (SIGSTOP, a frozen VM) while a lock stops every job of its event
/// comes back red: it forgets none of its waiting jobs for the time it did not run, so
/// the standstill is counted from before the pause. (From outside: green for 30 s more
/// after a 35 s pause, the queue standing still all along.)
#[test]
fn a_worker_paused_during_a_standstill_comes_back_red() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 60);
    let (sku, sharing) = sharing_a_sku(&orders);
    let (release, holder) = hold_lock(&env.db, "sku", sku);
    let (w, port) = start_with_health(&env, &["--retry-cap", "1s"]);
    push_timeouts(&env, &sharing, 0);
    wait_until(WAIT, "jobs waiting on the lock", || {
        metric(port, "delay_worker_jobs_waiting_on_contention") >= 2.0
    });
    w.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(32));
    w.signal(libc::SIGCONT);
    let back = Instant::now();
    wait_until(WAIT, "/healthz red for the standstill", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("has changed anything")
    });
    assert!(
        back.elapsed() < Duration::from_secs(10),
        "red only {:?} after the pause",
        back.elapsed()
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    wait_done(&env, &env.db, sharing.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&sharing));
}

/// A session of the shop's that is always running a statement, so that the workers see the
/// shop busy and yield, until the flag is set.
pub(crate) fn keep_the_shop_busy(
    db: &TestDb,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (url, flag) = (db.url.clone(), stop.clone());
    let h = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        // Ends too when the test's database goes (a failed test drops it).
        while !flag.load(std::sync::atomic::Ordering::Relaxed)
            && c.batch_execute("SELECT pg_sleep(0.2)").is_ok()
        {}
    });
    (stop, h)
}

/// [`keep_the_shop_busy`], once the worker with health on `port` is seen yielding to it.
pub(crate) fn keep_the_shop_busy_till_it_yields(
    db: &TestDb,
    port: u16,
) -> (
    std::sync::Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let busy = keep_the_shop_busy(db);
    wait_until(WAIT, "the workers yielding", || {
        metric(port, "delay_worker_yielding") == 1.0
    });
    busy
}

/// Pushes the orders' timeouts `per` at a time, each lot `every_ms` after the one before
/// (the first due now): each order's due time (local ms), by id.
fn push_due_in_turn(
    env: &Env,
    orders: &[SeedOrder],
    per: usize,
    every_ms: i64,
) -> std::collections::HashMap<i64, i64> {
    let pushed = delay_worker::now_ms();
    let mut due = std::collections::HashMap::new();
    for (i, chunk) in orders.chunks(per).enumerate() {
        let delay = i as i64 * every_ms;
        push_timeouts(env, chunk, delay);
        due.extend(chunk.iter().map(|o| (o.id, pushed + delay)));
    }
    due
}

/// How late (ms) each of these cancelled orders was cancelled, against its due time.
fn lateness(
    db: &TestDb,
    ids: impl Iterator<Item = i64>,
    due: &std::collections::HashMap<i64, i64>,
) -> Vec<i64> {
    let ids: Vec<i64> = ids.collect();
    db.client()
        .query(
            "SELECT id, (extract(epoch FROM cancelled_at) * 1000)::bigint FROM orders WHERE id = ANY($1)",
            &[&ids],
        )
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i64>(1) - due[&r.get::<_, i64>(0)])
        .collect()
}

/// How many of these orders are cancelled.
fn cancelled(db: &TestDb, orders: &[&SeedOrder]) -> usize {
    let ids: Vec<i64> = orders.iter().map(|o| o.id).collect();
    let n: i64 = db
        .probe(|c| {
            c.query_one(
                "SELECT count(*) FROM orders WHERE status = 'cancelled' AND id = ANY($1)",
                &[&ids],
            )
        })
        .get(0);
    n as usize
}

/// While the shop is busy the workers go into a transaction one at a time, and a
/// transaction waiting for a row lock must not keep the others out: a shop lock held for
/// long on a sku that a quarter of the due orders need holds up those orders only. (From
/// outside: with 5 of 50 skus locked for 60 s, the orders that needed no locked row were
/// cancelled 14 s late at the median and 50 s at p99, each waiting behind the locked
/// orders' lock timeouts and retries.)
#[test]
fn a_long_shop_lock_while_the_shop_is_busy_holds_up_only_the_orders_that_need_its_rows() {
    let mut env = Env::new();
    // The default: with the tests' 100 ms the locked orders' retries alone would keep
    // every worker waiting on the lock.
    env.config.jobs.retry_base = Duration::from_secs(1);
    let all = seed_orders(&env.db, 750);
    // First, without a lock on any order they need, a quarter of them (the control).
    let (first, orders) = all.split_at(250);
    // Then, one order in eleven locked by the shop, as an import or a report might.
    let held: Vec<i64> = orders.iter().step_by(11).map(|o| o.id).collect();
    let (release, holder) = hold_locks(&env.db, "orders", held.clone());
    let (quiet, shop) = keep_the_shop_busy(&env.db);
    // Retries of the locked orders at most 2 s apart, so that they end soon after the lock.
    let (w, port) = start_with_health(&env, &["--retry-cap", "2s"]);
    wait_until(WAIT, "the workers yielding", || {
        metric(port, "delay_worker_yielding") == 1.0
    });
    // Each order's lateness (when it was cancelled against when it was due): p50, p95, max.
    let quantiles = |orders: &[&SeedOrder], due: &std::collections::HashMap<i64, i64>| {
        let mut late = lateness(&env.db, orders.iter().map(|o| o.id), due);
        late.sort_unstable();
        let at = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
        (at(0.5), at(0.95), at(1.0))
    };
    // Due 50 a second beside the busy shop, over 5 s, then over 10 s while the lock is
    // held. One worker at a time in a transaction beside the busy shop, the machine's own
    // load tells: with nine other such tests on two cores, the free orders were 0.5–1.35 s
    // late at the median from run to run, and the suite failed so in CI. So they are
    // measured against the control's lateness just before, in the same surroundings.
    let first: Vec<&SeedOrder> = first.iter().collect();
    let due = push_due_in_turn(&env, &all[..250], 25, 500);
    wait_until(WAIT, "the control's orders cancelled", || {
        cancelled(&env.db, &first) == first.len()
    });
    let (c50, c95, cmax) = quantiles(&first, &due);
    let due = push_due_in_turn(&env, orders, 25, 500);
    let (locked, free): (Vec<&SeedOrder>, Vec<&SeedOrder>) =
        orders.iter().partition(|o| held.contains(&o.id));
    wait_until(WAIT, "the orders needing no locked row cancelled", || {
        cancelled(&env.db, &free) == free.len()
    });
    assert_eq!(cancelled(&env.db, &locked), 0, "the lock is still held");
    // Before, the latest was 9 s late, half of them over 1.8 s; now under 0.6 s on a
    // quiet machine, as late as the control's.
    let (p50, p95, latest) = quantiles(&free, &due);
    eprintln!(
        "lateness of the free orders: p50 {p50} ms, p95 {p95} ms, max {latest} ms; of the control's: p50 {c50} ms, p95 {c95} ms, max {cmax} ms"
    );
    assert!(
        p50 < c50 + 1_000 && p95 < c95 + 2_500,
        "the orders needing no locked row were cancelled late: p50 {p50} ms, p95 {p95} ms, max {latest} ms (the control's p50 {c50} ms, p95 {c95} ms)"
    );
    assert_eq!(
        metric(port, "delay_worker_yielding"),
        1.0,
        "the shop was busy"
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    quiet.store(true, std::sync::atomic::Ordering::Relaxed);
    shop.join().unwrap();
    every_order_cancelled_once(&env, w, &all);
}

/// A job that waited in vain for a lock waits a fifth of `--lock-timeout` at its next
/// tries: each try holds a worker for its whole wait, and while the shop holds rows that
/// many due jobs need, those jobs' retries kept the workers from the others. (Found in
/// the test: with a quarter of 2,000 orders due over 20 s waiting on a locked sku and 4
/// workers, the others were cancelled 5.4 s late at the median and 14.9 s at p99; 2.2
/// and 5.3 s now.) Here one worker, four orders locked, each try of theirs retried
/// about a second after it: at a whole second's wait their tries alone kept it busy,
/// and the orders due meanwhile waited behind them.
#[test]
fn the_retries_of_jobs_that_met_a_lock_wait_briefly_so_they_hold_no_worker_from_the_others() {
    let mut env = Env::new();
    env.config.threads = 1;
    env.config.jobs.retry_base = Duration::from_secs(1);
    let orders = seed_orders(&env.db, 44);
    let (locked, free) = orders.split_at(4);
    let held: Vec<i64> = locked.iter().map(|o| o.id).collect();
    let (release, holder) = hold_locks(&env.db, "orders", held);
    let (w, port) = start_with_health(
        &env,
        &[
            "--lock-timeout",
            "1s",
            "--set-size",
            "1",
            "--retry-cap",
            "1s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, locked, 0);
    wait_until(WAIT, "the locked orders waiting", || {
        metric(port, "delay_worker_jobs_waiting_on_contention") == 4.0
    });
    // Five a second for 8 s while the locked orders' tries go on.
    let due = push_due_in_turn(&env, free, 5, 1000);
    let free_refs: Vec<&SeedOrder> = free.iter().collect();
    wait_until(WAIT, "the orders needing no locked row cancelled", || {
        cancelled(&env.db, &free_refs) == free.len()
    });
    let late = lateness(&env.db, free.iter().map(|o| o.id), &due);
    let latest = late.iter().max().copied().unwrap_or(0);
    // Now a try of 200 ms at most; before, the worker fell further behind as the tries
    // came back, 2 s and more.
    assert!(
        latest < 1_500,
        "an order needing no locked row was cancelled {latest} ms late"
    );
    let locked_refs: Vec<&SeedOrder> = locked.iter().collect();
    assert_eq!(
        cancelled(&env.db, &locked_refs),
        0,
        "the lock is still held"
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    every_order_cancelled_once(&env, w, &orders);
}

/// A row the shop keeps busy without a pause, each of its transactions holding it briefly
/// but a waiter always finding others queued before it: a try that waits a fifth of
/// `--lock-timeout` never gets it, one that waits the whole of it does. So a job's brief
/// waits end at half of `--retry-for` (a minute at most), and it is cancelled while the
/// shop keeps the row busy. (With brief waits to the end it was a dead letter at the
/// horizon; since a lock wait is never one, it would wait on, red, for the rush to end.)
#[test]
fn a_row_the_shop_keeps_busy_past_the_brief_wait_is_waited_for_in_full_after_half_the_horizon() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let order = orders[0].id;
    // First one session holds the row past a whole lock timeout (the job's first try
    // fails), then three take turns holding it 200 ms each, so that a waiter always has
    // two or three before it: 400 ms and more.
    let (release, holder) = hold_locks(&env.db, "orders", vec![order]);
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let shop: Vec<_> = (0..3)
        .map(|_| {
            let (url, busy) = (env.db.url.clone(), busy.clone());
            std::thread::spawn(move || {
                let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
                while busy.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut t = c.transaction().unwrap();
                    t.execute("SELECT 1 FROM orders WHERE id = $1 FOR UPDATE", &[&order])
                        .unwrap();
                    t.batch_execute("SELECT pg_sleep(0.2)").unwrap();
                    t.commit().unwrap();
                }
            })
        })
        .collect();
    let (w, port) = start_with_health(
        &env,
        &[
            "--lock-timeout",
            "1s",
            "--retry-for",
            "4s",
            "--max-retries",
            "1",
            "--retry-cap",
            "300ms",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    std::thread::sleep(Duration::from_millis(1500));
    release.send(()).unwrap();
    holder.join().unwrap();
    // Before, every try after the first waited 200 ms, and at 4 s the job was a dead letter.
    wait_until(WAIT, "the order cancelled", || {
        cancelled(&env.db, &orders.iter().collect::<Vec<_>>()) == 1
    });
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    for t in shop {
        t.join().unwrap();
    }
    every_order_cancelled_once(&env, w, &orders);
}

/// Shop transactions that lock in another order than the worker's: a coupon, then the
/// skus of an order in descending id, then the order itself (paying it). Returns the
/// transactions done and those that failed.
fn shop_traffic(
    url: String,
    targets: Vec<(i64, Option<i64>, Vec<i64>)>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    paid: std::sync::Arc<std::sync::Mutex<Vec<i64>>>,
) -> (u64, Vec<String>) {
    let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let (mut done, mut failed) = (0, Vec::new());
    let mut i = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let (order, coupon, skus) = &targets[i % targets.len()];
        i += 1;
        let r = (|| -> Result<bool, postgres::Error> {
            let mut t = c.transaction()?;
            if let Some(coupon) = coupon {
                t.execute(
                    "SELECT 1 FROM coupon_user WHERE id = $1 FOR UPDATE",
                    &[coupon],
                )?;
            }
            for sku in skus.iter().rev() {
                t.execute("UPDATE sku SET updated_at = now() WHERE id = $1", &[sku])?;
            }
            // Every third one pays its order, if it is still pending.
            let paid_now = i % 3 == 0
                && t.execute(
                    "UPDATE orders SET status = 'paid', paid_at = now() WHERE id = $1 AND status = 'pending'",
                    &[order],
                )? == 1;
            if !paid_now {
                t.execute("SELECT 1 FROM orders WHERE id = $1 FOR UPDATE", &[order])?;
            }
            std::thread::sleep(Duration::from_millis(2));
            t.commit()?;
            Ok(paid_now)
        })();
        match r {
            Ok(p) => {
                done += 1;
                if p {
                    paid.lock().unwrap().push(*order);
                }
            }
            Err(e) => failed.push(e.to_string()),
        }
    }
    (done, failed)
}

/// Shop traffic locking in the opposite order beside a backlog drained in sets: no shop
/// transaction fails, every unpaid order is cancelled once. (600 orders: with 1,200 the
/// drain beside four shop sessions took up to 69 s on a loaded machine and ended the test
/// command's run.)
#[test]
fn shop_traffic_locking_in_the_opposite_order_never_fails_while_a_backlog_drains_in_sets() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 600);
    let targets: Vec<(i64, Option<i64>, Vec<i64>)> = orders
        .iter()
        .step_by(7)
        .map(|o| {
            let mut skus: Vec<i64> = o.items.iter().map(|i| i.0).collect();
            skus.sort_unstable();
            skus.dedup();
            (o.id, o.coupon_id, skus)
        })
        .collect();
    let stop_shop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let paid = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let shop: Vec<_> = (0..4)
        .map(|k| {
            let (url, stop, paid) = (env.db.url.clone(), stop_shop.clone(), paid.clone());
            let mut t = targets.clone();
            let n = t.len();
            t.rotate_left(k * n / 4);
            std::thread::spawn(move || shop_traffic(url, t, stop, paid))
        })
        .collect();
    let (w, port) = start_with_health(&env, &[]);
    // The workers see the shop's sessions busy and yield (one transaction at a time).
    wait_until(WAIT, "the workers yielding", || {
        metric(port, "delay_worker_yielding") == 1.0
    });
    push_timeouts(&env, &orders, 0);
    wait_done_or_paid(&env, &orders);
    stop_shop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut shop_done = 0;
    for h in shop {
        let (done, failed) = h.join().unwrap();
        assert!(
            failed.is_empty(),
            "the shop's transactions failed: {failed:?}"
        );
        shop_done += done;
    }
    assert!(shop_done > 0);
    wait_done(&env, &env.db, orders.len() as i64);
    stop(w);
    let paid: std::collections::HashSet<i64> = paid.lock().unwrap().iter().copied().collect();
    let cancelled: Vec<&SeedOrder> = orders.iter().filter(|o| !paid.contains(&o.id)).collect();
    assert_accounting(&env.db, &orders, &cancelled);
    assert_eq!(books(&env).dead, 0, "contention dead-letters nothing");
}

/// A shop trigger that records, for every order a committed transaction updates, that
/// transaction and the `lock_timeout` it ran under.
fn record_lock_waits(db: &TestDb) {
    db.client()
        .batch_execute(
            "CREATE TABLE lock_waits (order_id bigint, tx bigint, lock_timeout text); \
             CREATE FUNCTION record_lock_wait() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO lock_waits \
                VALUES (NEW.id, txid_current(), current_setting('lock_timeout')); \
                RETURN NULL; END $$; \
             CREATE TRIGGER record_lock_wait AFTER UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION record_lock_wait()",
        )
        .unwrap();
}

/// [`record_lock_waits`]'s transactions among these orders: (orders it updated, its
/// `lock_timeout`), one per transaction.
fn lock_waits(db: &TestDb, orders: &[SeedOrder]) -> Vec<(i64, String)> {
    let ids: Vec<i64> = orders.iter().map(|o| o.id).collect();
    db.client()
        .query(
            "SELECT count(*), min(lock_timeout) FROM lock_waits WHERE order_id = ANY($1) \
             GROUP BY tx HAVING min(lock_timeout) = max(lock_timeout)",
            &[&ids],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Each of `these` ran in a transaction of its own under this `lock_timeout`
/// ([`record_lock_waits`]), and every order was cancelled once, none dead-lettered.
fn each_alone_waited(env: &Env, orders: &[SeedOrder], these: &[SeedOrder], lock_timeout: &str) {
    let waits = lock_waits(&env.db, these);
    assert_eq!(waits.len(), these.len(), "{waits:?}");
    assert!(
        waits.iter().all(|(n, t)| *n == 1 && t == lock_timeout),
        "{waits:?}"
    );
    assert_accounting(&env.db, orders, &all(orders));
    assert_eq!(books(env).dead, 0, "a shop lock is no fault of the job");
}

/// Beside a busy shop a set waits 4 ms for a lock (a twenty-fifth of `--lock-timeout`), a
/// fifth while the shop is quiet. A set holds the rows it locked before the one it waits
/// for; with a few hot skus and shop payments locking them in the opposite order, sets
/// that waited 20 ms tipped a drain into a slow state that held the shop up (found from
/// outside: a shop at 200 tx/s on 10 shared skus fell to 25–89 tx/s for 15 s, p99 11–14 s;
/// `scripts/bench.sh shop --skus 10 --shop-rate 200 --shop-backlog 6000`: 4 of 5 runs at
/// p99 186–400 ms; none of 5 with the shorter wait).
#[test]
fn a_set_waits_briefly_for_a_lock_while_the_shop_is_busy() {
    let mut env = Env::new();
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 128);
    record_lock_waits(&env.db);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    // The shop busy: sessions running a statement most of the time.
    let stop_shop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shop: Vec<_> = (0..3)
        .map(|_| {
            let (url, stop) = (env.db.url.clone(), stop_shop.clone());
            std::thread::spawn(move || {
                let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    c.batch_execute("SELECT pg_sleep(0.02)").unwrap();
                }
            })
        })
        .collect();
    wait_until(WAIT, "the workers yielding", || {
        metric(port, "delay_worker_yielding") == 1.0
    });
    let (busy, quiet) = orders.split_at(64);
    push_timeouts(&env, busy, 0);
    wait_done(&env, &env.db, busy.len() as i64);
    stop_shop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in shop {
        h.join().unwrap();
    }
    wait_until(WAIT, "the workers no longer yielding", || {
        metric(port, "delay_worker_yielding") == 0.0
    });
    push_timeouts(&env, quiet, 0);
    wait_done(&env, &env.db, orders.len() as i64);
    stop(w);
    let sets = |waits: Vec<(i64, String)>| -> Vec<String> {
        waits
            .into_iter()
            .filter(|(n, _)| *n > 1)
            .map(|(_, t)| t)
            .collect()
    };
    let (busy_sets, quiet_sets) = (
        sets(lock_waits(&env.db, busy)),
        sets(lock_waits(&env.db, quiet)),
    );
    assert!(!busy_sets.is_empty() && !quiet_sets.is_empty());
    assert!(busy_sets.iter().all(|t| t == "4ms"), "{busy_sets:?}");
    assert!(quiet_sets.iter().all(|t| t == "20ms"), "{quiet_sets:?}");
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// Once a set meets a lock and is split, the event's single jobs wait a fifth of
/// `--lock-timeout` (20 ms) rather than all of it, for 10 s after its sets last met
/// contention: each held its own locks (the order, its skus) against the shop for 100 ms,
/// and with a few hot rows the split sets' single jobs kept the shop waiting (the tip-over
/// above).
#[test]
fn the_single_jobs_of_a_split_set_wait_briefly_for_a_lock() {
    let mut env = Env::new();
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 35);
    record_lock_waits(&env.db);
    let (set, lone) = orders.split_at(32);
    let (release, h) = hold_lock(&env.db, "orders", set[5].id);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, set, 0);
    wait_until(WAIT, "every order but the locked one", || {
        inbox_count(&env.db) == set.len() as i64 - 1
    });
    // Jobs due one at a time now run alone, each in a transaction of its own.
    for (n, o) in lone.iter().enumerate() {
        push_timeouts(&env, std::slice::from_ref(o), 0);
        wait_until(WAIT, "the lone job", || {
            inbox_count(&env.db) == (set.len() + n) as i64
        });
    }
    release.send(()).unwrap();
    h.join().unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    stop(w);
    each_alone_waited(&env, &orders, lone, "20ms");
}

/// An event whose sets were split down to single jobs grows them back as its single jobs
/// commit: a set size of 1 runs no set, and only a set's commit grew it, so it stayed at
/// 1 for good (found from outside: on 3 hot skus every later job of a 20,000-job drain
/// ran alone, the drain at 25–180 jobs/s).
#[test]
fn an_event_split_down_to_single_jobs_grows_its_sets_back() {
    let mut env = Env::new();
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 18);
    record_lock_waits(&env.db);
    let (pair, later) = orders.split_at(2);
    // A set of two, one of them locked: it is split, and the event's set size is 1.
    let (release, h) = hold_lock(&env.db, "orders", pair[0].id);
    let (w, port) = start_with_health(&env, &["--set-size", "2"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, pair, 0);
    wait_until(WAIT, "the unlocked one", || inbox_count(&env.db) == 1);
    release.send(()).unwrap();
    h.join().unwrap();
    wait_done(&env, &env.db, 2);
    push_timeouts(&env, later, 0);
    wait_done(&env, &env.db, orders.len() as i64);
    stop(w);
    let txs = lock_waits(&env.db, later);
    assert!(
        txs.iter().any(|(n, _)| *n == 2),
        "the later jobs ran in sets again: {txs:?}"
    );
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// While the shop is busy, one single job of a process at a time waits the whole
/// `--lock-timeout`; the others wait as briefly as a set. Each holds the rows it locked
/// before against the shop while it waits, and the shop queues behind it: with a backlog
/// over a minute overdue (past the brief waits of young jobs) on a few hot skus, every
/// worker's try waited the whole 100 ms and the shop fell to a few percent of its rate
/// for tens of seconds (found from outside; `scripts/bench.sh shop --skus 3 --shop-rate
/// 400 --shop-backlog 3000 --shop-overdue 2m`: the drain at 23 jobs/s, the shop's p99
/// 20 s; after, 202–1,002 jobs/s and 93–138 ms). Here an overdue job waits 2 s for a
/// locked order while the shop is busy, and 21 overdue jobs due meanwhile, alone each
/// (`--set-size 1`), wait 80 ms (before: 2 s each); the locked one is cancelled once the
/// lock goes.
#[test]
fn while_the_shop_is_busy_one_job_at_a_time_waits_the_whole_lock_timeout() {
    let mut env = Env::new();
    env.config.threads = 4;
    let orders = seed_orders(&env.db, 22);
    record_lock_waits(&env.db);
    let (locked, others) = orders.split_at(1);
    let (release, h) = hold_lock(&env.db, "orders", locked[0].id);
    let (w, port) = start_with_health(&env, &["--set-size", "1", "--lock-timeout", "2s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (quiet, shop) = keep_the_shop_busy_till_it_yields(&env.db, port);
    // Two minutes overdue: past the brief waits of young jobs.
    push_timeouts(&env, locked, -120_000);
    wait_until(WAIT, "the locked one waiting", || {
        lock_waiters(&env.db) == 1
    });
    push_timeouts(&env, others, -120_000);
    wait_until(WAIT, "the others done", || {
        inbox_count(&env.db) == others.len() as i64
    });
    release.send(()).unwrap();
    h.join().unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    quiet.store(true, std::sync::atomic::Ordering::Relaxed);
    shop.join().unwrap();
    stop(w);
    each_alone_waited(&env, &orders, others, "80ms");
}

/// While the shop is busy on the few skus every order shares, a set that misses its brief
/// wait for one is tried again whole before it is split: a set takes each sku once for all
/// its orders, and halves, down to single jobs, take it once each (measured beside the
/// shop's traffic on 3 skus: the drain went from 0.02–0.04× its rate alone to about half).
/// Here a shop session holds every sku when each lot of 32 orders falls due and lets them
/// go once the worker's set has waited for one and given up: each lot goes through in one
/// transaction after its miss (before: split at the miss, two or more each). The shop's turns
/// follow the worker's tries, not a clock, and are taken on the server: a shop that took
/// the skus 8 ms at a time, or one whose client let them go after seeing the try give up,
/// was late on a loaded machine (CI) and sets missed all four tries.
#[test]
fn while_the_shop_keeps_the_skus_busy_a_set_that_misses_its_brief_wait_is_tried_again_whole() {
    const LOTS: usize = 4;
    let mut env = Env::new();
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 32 * LOTS);
    record_lock_waits(&env.db);
    let (w, port) = start_with_health(&env, &["--set-size", "32"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (quiet, shop) = keep_the_shop_busy_till_it_yields(&env.db, port);
    let (ask, skus) = take_the_skus_from_each_first_try(&env.db);
    let mut done = 0;
    for lot in orders.chunks(32) {
        let (held, holding) = std::sync::mpsc::sync_channel(0);
        ask.send((lot[0].id, held)).unwrap();
        holding.recv().expect("the shop holding the skus");
        // Due together once all are pushed: one set.
        push_timeouts(&env, lot, 300);
        done += lot.len() as i64;
        wait_done(&env, &env.db, done);
    }
    drop(ask);
    let turned_away = skus.join().unwrap();
    quiet.store(true, std::sync::atomic::Ordering::Relaxed);
    shop.join().unwrap();
    stop(w);
    let waits = lock_waits(&env.db, &orders);
    let transactions = waits.len();
    assert!(
        turned_away >= LOTS && transactions <= LOTS + 2,
        "{} orders in {transactions} transactions, {turned_away} tries turned away: \
         sets split on the shop's brief locks ({waits:?})",
        orders.len()
    );
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0, "contention dead-letters nothing");
}

/// A shop session on a thread that, each time it is asked to (with an order of the lot
/// about to fall due), takes every sku (and says so), holds them until a worker's
/// transaction waits for one, then waits for that order, which the worker's set locked
/// before the skus, and lets everything go the moment it has it: as the set's try gives
/// up. All of it in one statement on the server, so a loaded machine cannot make it late
/// for the set's next try: how many tries it turned away.
fn take_the_skus_from_each_first_try(
    db: &TestDb,
) -> (
    std::sync::mpsc::SyncSender<(i64, std::sync::mpsc::SyncSender<()>)>,
    std::thread::JoinHandle<usize>,
) {
    let (ask, asked) = std::sync::mpsc::sync_channel::<(i64, std::sync::mpsc::SyncSender<()>)>(0);
    let url = db.url.clone();
    let h = std::thread::spawn(move || {
        let mut shop = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let mut probe = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let me: i32 = shop
            .query_one("SELECT pg_backend_pid()", &[])
            .unwrap()
            .get(0);
        let mut turned_away = 0;
        while let Ok((order, held)) = asked.recv() {
            std::thread::scope(|s| {
                let hold = s.spawn(|| {
                    shop.batch_execute(&format!(
                        "DO $$ DECLARE since timestamptz := clock_timestamp(); BEGIN \
                           PERFORM 1 FROM sku ORDER BY id FOR UPDATE; \
                           PERFORM pg_advisory_xact_lock(7707); \
                           LOOP \
                             EXIT WHEN EXISTS (SELECT 1 FROM pg_locks \
                               WHERE locktype = 'transactionid' AND NOT granted \
                               AND transactionid = pg_current_xact_id()::xid); \
                             IF clock_timestamp() - since > interval '60 s' THEN \
                               RAISE EXCEPTION 'no try of the worker waited for a sku'; \
                             END IF; \
                             PERFORM pg_sleep(0.0002); \
                           END LOOP; \
                           PERFORM 1 FROM orders WHERE id = {order} FOR UPDATE; \
                         END $$"
                    ))
                });
                wait_until(WAIT, "the shop holding the skus", || {
                    probe
                        .query_one(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                             AND objid = 7707 AND granted AND pid = $1",
                            &[&me],
                        )
                        .unwrap()
                        .get::<_, i64>(0)
                        == 1
                });
                held.send(()).unwrap();
                hold.join().unwrap().unwrap();
            });
            turned_away += 1;
        }
        turned_away
    });
    (ask, h)
}

/// A drain that keeps the shop waiting behind its sessions in most of the PostgreSQL
/// watch's looks over about 5 s is a warning, though each wait is brief (under the second
/// after which one held-up shop session is told). Here every sku update of the worker
/// takes 10 ms and the shop takes every sku again and again. The backlog lasts well past
/// those 5 s (300 orders drained in about 5 s and, on a loaded machine, ended before the
/// 20th look).
#[test]
fn a_shop_waiting_briefly_behind_the_drain_in_most_looks_is_warned_of() {
    let mut env = Env::new();
    env.config.threads = 2;
    let orders = seed_orders(&env.db, 800);
    env.db
        .client()
        .batch_execute(
            "CREATE FUNCTION slow_sku() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(0.01); RETURN NULL; END $$; \
             CREATE TRIGGER slow_sku AFTER UPDATE ON sku \
             FOR EACH ROW EXECUTE FUNCTION slow_sku()",
        )
        .unwrap();
    // A job waits up to 900 ms for its sku (under PostgreSQL's deadlock_timeout): with the
    // default 100 ms, on a loaded machine the jobs queued behind the shop timed out and went
    // back for their backoff, and the shop seldom waited behind the worker's sessions.
    let (w, port) = start_with_health(&env, &["--set-size", "1", "--lock-timeout", "900ms"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    const TOLD: &str = "waited for locks behind the worker's";
    assert!(!check(&env).1.contains(TOLD), "{}", check(&env).1);
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let shop = {
        let (url, busy) = (env.db.url.clone(), busy.clone());
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
            // A breath between its transactions: taking the skus back to back, on a loaded
            // machine the shop won every sku lock, the worker's jobs went back for their
            // backoff, and nothing waited behind the worker's sessions.
            while busy.load(std::sync::atomic::Ordering::Relaxed) {
                c.batch_execute("BEGIN; SELECT 1 FROM sku ORDER BY id FOR UPDATE; COMMIT")
                    .unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    push_timeouts(&env, &orders, 0);
    wait_until(
        WAIT,
        "stats --check warning of the shop held up often",
        || check(&env).1.contains(TOLD),
    );
    let (code, said) = check(&env);
    assert_eq!(code, 1, "a WARNING: {said}");
    assert_eq!(healthz(port).0, 200, "a warning, not red");
    busy.store(false, std::sync::atomic::Ordering::Relaxed);
    shop.join().unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    stop(w);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// Waits until every job has run (done, or a no-op for an order the shop paid).
fn wait_done_or_paid(env: &Env, orders: &[SeedOrder]) {
    wait_done(env, &env.db, orders.len() as i64);
}

/// The worker's own inbox renamed for a while (a migration gone wrong): the jobs are held,
/// red, none dead-lettered; the sessions that can no longer prepare its statement are
/// replaced, and once it is back every job is done once and health is green.
#[test]
fn the_inbox_renamed_for_a_while_holds_the_jobs_until_it_is_back() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 20);
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[..10], 0);
    wait_until(WAIT, "the first jobs done", || inbox_count(&env.db) == 10);
    let ddl = |sql: &str| env.db.client().batch_execute(sql).unwrap();
    ddl("ALTER TABLE worker_inbox RENAME TO worker_inbox_moved");
    push_timeouts(&env, &orders[10..], 0);
    wait_until(WAIT, "/healthz red", || healthz(port).0 == 503);
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(books(&env).dead, 0, "the inbox renamed is no job's fault");
    ddl("ALTER TABLE worker_inbox_moved RENAME TO worker_inbox");
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

#[test]
fn a_column_renamed_by_a_deploy_holds_the_jobs_names_the_error_and_they_run_once_it_is_back() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 300);
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[..100], 0);
    wait_done(&env, &env.db, 100);
    let mut c = env.db.client();
    c.batch_execute("ALTER TABLE orders RENAME COLUMN cancel_reason TO cancel_reason_old")
        .unwrap();
    push_timeouts(&env, &orders[100..], 0);
    wait_until(WAIT, "/healthz red naming the missing column", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("cancel_reason") && body.contains("42703")
    });
    wait_until(WAIT, "jobs held", || {
        metric(
            port,
            "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"held\"}",
        ) >= 1.0
    });
    wait_check_critical(&env, "42703");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(books(&env).dead, 0, "a schema in flux dead-letters nothing");
    assert_eq!(inbox_count(&env.db), 100);
    c.batch_execute("ALTER TABLE orders RENAME COLUMN cancel_reason_old TO cancel_reason")
        .unwrap();
    wait_done(&env, &env.db, 300);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

#[test]
fn a_handler_whose_table_is_missing_holds_only_its_own_jobs_until_the_table_comes() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 50);
    let dir = HandlerDir::new(&[(
        "loyalty.sql",
        "-- event: loyalty.points\n-- requires: user_id\n\
         INSERT INTO loyalty (user_id, points) VALUES (($1 ->> 'user_id')::bigint, 10)"
            .to_string(),
    )]);
    let (w, port) = start_with_health(&env, &["--handlers-dir", dir.0.to_str().unwrap()]);
    let now = delay_worker::now_ms();
    let mut con = env.con();
    for u in 0..20 {
        let job = delay_worker::producer::NewJob {
            event: "loyalty.points".into(),
            payload: serde_json::json!({ "user_id": u }),
            due_ms: now,
            key: Some(format!("loyalty:{u}")),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
    push_timeouts(&env, &orders, 0);
    // The order timeouts run; the loyalty jobs are held, health names the handler.
    wait_until(WAIT, "the order timeouts", || inbox_count(&env.db) == 50);
    wait_until(WAIT, "/healthz red naming the handler", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("loyalty.points") && body.contains("42P01")
    });
    assert_eq!(books(&env).dead, 0);
    env.db
        .client()
        .batch_execute("CREATE TABLE loyalty (user_id bigint, points int)")
        .unwrap();
    wait_done(&env, &env.db, 70);
    let points: i64 = env
        .db
        .client()
        .query_one("SELECT count(*) FROM loyalty", &[])
        .unwrap()
        .get(0);
    assert_eq!(points, 20, "each loyalty job once");
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// Due jobs that no mover takes (every process started with `--no-mover`): `/healthz` is
/// red naming the pool, and `stats --check` CRITICAL, until a process with a mover starts;
/// that process is not red for the lag it found at its start, and the jobs run once; the
/// red process turns green within seconds of the jobs being moved.
#[test]
fn due_jobs_no_mover_takes_turn_healthz_red_until_a_mover_runs() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 20);
    // Its watch's ordinary passes 10 s apart, as by default.
    let mut quiet = env.config.clone();
    quiet.stats_interval = Duration::from_secs(10);
    let port = free_port();
    let a = Proc::start(
        &quiet,
        &args(&[
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--no-mover",
            "--mover-lag-crit",
            "2s",
        ]),
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red naming the pool", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("due jobs wait unmoved") && body.contains("--no-mover")
    });
    wait_check_critical(&env, "mover lag");
    assert_eq!(inbox_count(&env.db), 0, "nothing moved, nothing done");
    assert_eq!(books(&env).pool, 20);

    // A process with a mover: it moves the overdue jobs at once and is not red for them.
    let mut with_mover = env.config.clone();
    with_mover.consumer = format!("{}-mover", env.config.consumer);
    let mover_port = free_port();
    let b = Proc::start(
        &with_mover,
        &args(&[
            "--metrics-addr",
            &format!("127.0.0.1:{mover_port}"),
            "--mover-lag-crit",
            "2s",
        ]),
    );
    wait_until(WAIT, "every job done", || {
        let (_, body) = healthz(mover_port);
        assert!(
            !body.contains("due jobs wait unmoved"),
            "the process with the mover is red for the lag it found: {body}"
        );
        inbox_count(&env.db) == 20 && books(&env).pool == 0
    });
    // Looked at again every second while red, not at the next ordinary pass (10 s).
    wait_until(Duration::from_secs(4), "/healthz green again soon", || {
        healthz(port).0 == 200
    });
    wait_until(WAIT, "/healthz of the mover's process green", || {
        healthz(mover_port).0 == 200
    });
    wait_until(WAIT, "stats --check OK again", || check(&env).0 == 0);
    stop(b);
    stop(a);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// A due member whose data is missing (a legacy producer's ZADD without its HSET) is the
/// pool's oldest. While no process runs a mover, `/healthz` says so (the member without
/// data must not hide that nothing moves the jobs behind it); once a mover runs, it says
/// the member has no data and waits out its grace, rather than blaming the movers, which
/// move the other jobs.
#[test]
fn an_overdue_member_without_data_is_named_as_such_not_as_a_missing_mover() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 5);
    let (a, port) = start_with_health(&env, &["--no-mover", "--mover-lag-crit", "1s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let due = delay_worker::now_ms() - 1_000;
    redis::cmd("ZADD")
        .arg(&env.config.keys.pool)
        .arg(due)
        .arg("order.timeout:no-data")
        .query::<()>(&mut env.con())
        .unwrap();
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red: no mover runs", || {
        let (code, body) = healthz(port);
        code == 503
            && body.contains("\"order.timeout:no-data\"")
            && body.contains("no live process runs a mover")
    });

    let mut with_mover = env.config.clone();
    with_mover.consumer = format!("{}-mover", env.config.consumer);
    let b = Proc::start(&with_mover, &args(&["--orphan-grace", "1h"]));
    wait_until(WAIT, "the other jobs done", || inbox_count(&env.db) == 5);
    wait_until(WAIT, "/healthz red naming the member without data", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("\"order.timeout:no-data\"") && body.contains("it has no data")
    });
    stop(b);
    stop(a);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// An older producer's pool (`--legacy-pool`) that only a `--no-mover` process knows of,
/// while a mover runs without it: `/healthz` names the pool and says no live mover moves
/// it (not that the movers are stuck); once a mover takes it, its order is cancelled once.
#[test]
fn a_legacy_pool_no_mover_serves_is_named_with_its_flag() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let legacy = "delay:order_close=order.timeout";
    let mover_only = |name: &str, extra: &[&str]| {
        let mut c = env.config.clone();
        c.consumer = format!("{}-{name}", env.config.consumer);
        Proc::start(&c, &args(extra))
    };
    let plain_mover = mover_only("plain", &[]);
    let (a, port) = start_with_health(
        &env,
        &[
            "--no-mover",
            "--mover-lag-crit",
            "1s",
            "--legacy-pool",
            legacy,
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    crate::legacy_stall::legacy_push(
        &mut env.con(),
        "delay:order_close",
        &format!("close_order_{}", orders[0].id),
        &orders[0].id.to_string(),
        delay_worker::now_ms(),
    );
    wait_until(WAIT, "/healthz red naming the legacy pool", || {
        let (code, body) = healthz(port);
        code == 503
            && body.contains("of the legacy pool \"delay:order_close\"")
            && body.contains("no live mover moves that pool")
    });
    stop(plain_mover);
    let legacy_mover = mover_only("legacy", &["--legacy-pool", legacy]);
    wait_until(WAIT, "the legacy order done", || inbox_count(&env.db) == 1);
    wait_until(WAIT, "/healthz green again", || healthz(port).0 == 200);
    stop(legacy_mover);
    stop(a);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

#[test]
fn every_sqlstate_class_has_an_owner() {
    use delay_worker::db::{classify_code, Fault};
    let cases = [
        (
            "25006",
            "cannot execute INSERT in a read-only transaction",
            Fault::Server,
        ),
        ("25P02", "current transaction is aborted", Fault::Server),
        (
            "57P01",
            "terminating connection due to administrator command",
            Fault::Server,
        ),
        ("08006", "connection failure", Fault::Server),
        ("53300", "too many clients", Fault::Server),
        (
            "40001",
            "canceling statement due to conflict with recovery",
            Fault::Server,
        ),
        ("40003", "statement completion unknown", Fault::Server),
        ("40001", "could not serialize access", Fault::Contention),
        ("40P01", "deadlock detected", Fault::Contention),
        (
            "55P03",
            "canceling statement due to lock timeout",
            Fault::Contention,
        ),
        (
            "57014",
            "canceling statement due to statement timeout",
            Fault::Contention,
        ),
        ("42703", "column \"x\" does not exist", Fault::Schema),
        ("42P01", "relation \"x\" does not exist", Fault::Schema),
        ("42883", "function x() does not exist", Fault::Schema),
        ("42501", "permission denied for table orders", Fault::Schema),
        (
            "0A000",
            "cached plan must not change result type",
            Fault::Schema,
        ),
        ("22P02", "invalid input syntax for type bigint", Fault::Job),
        ("23505", "duplicate key value", Fault::Job),
        ("23514", "violates check constraint", Fault::Job),
        ("P0001", "the handler's own RAISE", Fault::Job),
        ("40002", "deferred constraint at commit", Fault::Job),
        ("ZZ999", "a class nobody knows", Fault::Schema),
    ];
    for (code, message, fault) in cases {
        assert_eq!(classify_code(code, message), fault, "{code} {message}");
    }
}

/// A worker just started holds its sessions before its first job, so a backlog that meets
/// it does not start with every worker's backend forking and preparing at once beside the
/// shop's transactions.
#[test]
fn a_started_worker_opens_its_sessions_before_its_first_job() {
    let mut env = Env::new();
    env.config.threads = 4;
    let d = Daemon::start(&env.config);
    // Four workers' sessions and the PostgreSQL watch's connection; nothing was pushed.
    wait_until(Duration::from_secs(10), "every worker's session", || {
        worker_backends(&env.db) >= 5
    });
    let b = books(&env);
    assert_eq!((b.pool, b.stream_pending, b.dead), (0, 0, 0));
    d.stop();
}

/// A shop's lock on a table no due job needs (a migration's `ACCESS EXCLUSIVE` on
/// `aftersale`), held past two of the watch's handler prepares: those give up behind it,
/// so `/healthz` stays green and the orders' jobs run (found from outside: the watch's
/// check waited on the lock, which read as a server that takes no writes: 503, and under
/// systemd a watchdog restart).
#[test]
fn a_table_lock_no_job_needs_leaves_health_green() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 5);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (_, release, h) =
        crate::lock_holder::hold(&env, "LOCK TABLE aftersale IN ACCESS EXCLUSIVE MODE");
    push_timeouts(&env, &orders, 0);
    // The watch prepares every handler every 10 s.
    let until = Instant::now() + Duration::from_secs(25);
    while Instant::now() < until {
        let (code, body) = healthz(port);
        assert_eq!(code, 200, "while aftersale is locked: {body}");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(inbox_count(&env.db), 5, "the orders' jobs ran meanwhile");
    release.send(()).unwrap();
    h.join().unwrap();
    stop(w);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// After a fault of the surroundings has ended: every order's job done, `/healthz` green
/// within seconds, and the books exact with no dead letter.
pub(crate) fn every_job_once_and_green(env: &Env, w: Proc, port: u16, orders: &[SeedOrder]) {
    every_job_once_and_green_paid(env, w, port, orders, &[]);
}

/// [`every_job_once_and_green`], with the orders at `paid` (indexes) paid and so left.
fn every_job_once_and_green_paid(
    env: &Env,
    w: Proc,
    port: u16,
    orders: &[SeedOrder],
    paid: &[usize],
) {
    wait_done(env, &env.db, orders.len() as i64);
    wait_until(Duration::from_secs(10), "/healthz green again", || {
        healthz(port).0 == 200
    });
    stop(w);
    let cancelled: Vec<&SeedOrder> = (0..orders.len())
        .filter(|i| !paid.contains(i))
        .map(|i| &orders[i])
        .collect();
    assert_accounting(&env.db, orders, &cancelled);
    assert_eq!(books(env).dead, 0);
}

/// A table lock every job needs (`LOCK TABLE orders`, held past
/// `CONTENTION_STALL`): the jobs wait, none dead-lettered; once no job has gone through
/// for 30 s `/healthz` is red and `stats --check` CRITICAL, naming the standstill; both
/// green again soon after the lock ends, and every job runs once (found from outside:
/// `/healthz` stayed 200 through a 30 s lock that stopped every job).
#[test]
fn a_table_lock_that_stops_every_job_turns_health_red_until_jobs_go_through() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 10);
    // Retries 5 s apart at most, so the jobs run soon after the lock ends.
    let (w, port) = start_with_health(&env, &["--retry-cap", "5s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (_, release, h) =
        crate::lock_holder::hold(&env, "LOCK TABLE orders IN ACCESS EXCLUSIVE MODE");
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red naming the standstill", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("no job of order.timeout has changed anything")
    });
    wait_check_critical(&env, "no job of order.timeout has changed anything");
    assert_eq!(inbox_count(&env.db), 0, "nothing ran under the lock");
    assert_eq!(books(&env).dead, 0, "none dead-lettered for a lock");
    release.send(()).unwrap();
    h.join().unwrap();
    every_job_once_and_green(&env, w, port, &orders);
}

/// A table lock taken in the middle of a drain under `--max-rate`, held past
/// `CONTENTION_STALL`: `/healthz` turns red naming the standstill, even though the cap
/// brings the jobs back long after their retries fell due; none dead-lettered, with no
/// retry budget at all; every job runs once after the lock. Found from outside: with
/// `--max-rate 40/s` and `LOCK TABLE sku` taken 3 s into a drain of 400, `/healthz` stayed
/// 200 for 52 s while no job changed anything.
#[test]
fn a_table_lock_taken_mid_drain_under_a_max_rate_turns_health_red() {
    let mut env = Env::new();
    // The default backoff: retries 1, 2, 4, 8 s … apart.
    env.config.jobs.retry_base = Duration::from_secs(1);
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 400);
    let (w, port) = start_with_health(
        &env,
        &[
            "--max-rate",
            "40/s",
            "--max-retries",
            "0",
            "--retry-for",
            "0s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the drain under way", || inbox_count(&env.db) >= 80);
    let (_, release, h) = crate::lock_holder::hold(&env, "LOCK TABLE sku IN EXCLUSIVE MODE");
    // Told when the standstill comes (30 s after the last commit, before the lock), not at
    // a retry that the backoff and the cap put later, nor counted from when a capped
    // batch's results were gone through (it was 40 s, 10 s of it that lag).
    red_soon_after(&env, port, Instant::now());
    release.send(()).unwrap();
    h.join().unwrap();
    every_job_once_and_green(&env, w, port, &orders);
}

/// A lock on the worker's own group-commit table (`worker_flush`: a migration, an
/// operator's `LOCK TABLE`) holds every acknowledgement: the acks wait for the WAL flush,
/// `/healthz` red and `stats --check` CRITICAL naming the table and the session holding
/// it, and no job goes round the pool again. Found from outside: each ack became a
/// re-queue due at once, 46,050 deliveries for 2,000 jobs in 40 s, with health green.
#[test]
fn a_lock_on_the_group_commit_table_holds_the_acks_and_turns_health_red() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 50);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (pid, release, h) =
        crate::lock_holder::hold(&env, "LOCK TABLE worker_flush IN ACCESS EXCLUSIVE MODE");
    // All due at one moment: pushed one by one on a loaded machine, they trickled in, each
    // worker's acks waited with its first jobs, and the jobs after them waited for a worker.
    push_timeouts(&env, &orders, 1_500);
    let holder = format!("pid {pid}");
    wait_until(
        WAIT,
        "/healthz red naming worker_flush and its holder",
        || {
            let (code, body) = healthz(port);
            code == 503 && body.contains("worker_flush") && body.contains(&holder)
        },
    );
    wait_check_critical(&env, "worker_flush");
    wait_until(WAIT, "every job committed", || inbox_count(&env.db) == 50);
    std::thread::sleep(Duration::from_secs(3));
    let delivered = metric(port, "delay_worker_delivered_total");
    assert!(
        (50.0..=60.0).contains(&delivered),
        "{delivered} deliveries of 50 jobs under the lock: jobs went round again"
    );
    assert_eq!(books(&env).dead, 0, "none dead-lettered for a lock");
    release.send(()).unwrap();
    h.join().unwrap();
    every_job_once_and_green(&env, w, port, &orders);
}

/// The acks waiting for a locked `worker_flush` stay this process's: its entries are
/// claimed again while it waits, so that a second process does not take them for stuck
/// after `--claim-idle` and run them again, and a session lost during the lock (its
/// commits' durability in doubt) is answered by a flush on a new session that waits for
/// the lock too, then the inbox, not by sending every job round; that session lost as
/// well, and no new one to be had for seconds, it waits for one. Found from outside: a
/// 75 s lock beside a second process ran 80 of 80 jobs again there; a
/// `pg_terminate_backend` during a lock sent 60 of 60 back to the pool, a second one (or a
/// restart) 300 of 300.
#[test]
fn acks_waiting_for_a_locked_flush_are_neither_taken_by_a_peer_nor_sent_round() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 60);
    let procs = start_named(&env, &["a", "b"], &["--claim-idle", "4s"]);
    let (_, release, h) = crate::lock_holder::hold(&env, "LOCK TABLE worker_flush IN SHARE MODE");
    // All due at one moment (as above).
    push_timeouts(&env, &orders, 1_500);
    wait_until(WAIT, "every job committed", || inbox_count(&env.db) == 60);
    // Red where acks wait (one process may have read every job).
    wait_until(WAIT, "/healthz red naming worker_flush", || {
        procs.iter().any(|(_, port)| {
            let (code, body) = healthz(*port);
            code == 503 && body.contains("worker_flush")
        })
    });
    // The workers' sessions lost while their acks wait: the durability of their commits
    // is in doubt. Then the sessions that look it up lost too, and for 3 s no new one
    // can be had (a server restarting).
    let mut admin = postgres::Client::connect(&admin_url(), postgres::NoTls).unwrap();
    let terminate = |admin: &mut postgres::Client| {
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND application_name = 'delay-worker'",
                &[&env.db.name],
            )
            .unwrap()
    };
    terminate(&mut admin);
    std::thread::sleep(Duration::from_secs(2));
    // Not `set_connections`: the lock holder's session must stay.
    allow_connections(&env, false);
    terminate(&mut admin);
    std::thread::sleep(Duration::from_secs(3));
    allow_connections(&env, true);
    // Past two of `--claim-idle` in all: a peer would have taken the entries by now.
    std::thread::sleep(Duration::from_secs(5));
    let delivered: f64 = procs
        .iter()
        .map(|(_, port)| metric(*port, "delay_worker_delivered_total"))
        .sum();
    let retried: f64 = procs
        .iter()
        .map(|(_, port)| {
            metric(
                *port,
                "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"retry\"}",
            )
            .max(0.0)
        })
        .sum();
    assert_eq!(
        (delivered, retried),
        (60.0, 0.0),
        "deliveries and retries of 60 jobs under the lock"
    );
    release.send(()).unwrap();
    h.join().unwrap();
    wait_until(WAIT, "the stream settled", || {
        books(&env).stream_pending == 0
    });
    for (mut w, _) in procs {
        w.signal(libc::SIGTERM);
        assert!(w.wait(WAIT).success(), "{}", w.log());
    }
    let every: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &every);
    let b = books(&env);
    assert_eq!((b.pool, b.dead), (0, 0));
}

/// `/healthz` red and `stats --check` CRITICAL naming the standstill within 6 s of the 30
/// s standstill counted from `locked`, and no dead letter.
pub(crate) fn red_soon_after(env: &Env, port: u16, locked: Instant) {
    let standstill = "no job of order.timeout has changed anything for";
    wait_until(WAIT, "/healthz red naming the standstill", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains(standstill)
    });
    let red_after = locked.elapsed();
    assert!(
        red_after < delay_worker::stats::CONTENTION_STALL + Duration::from_secs(6),
        "red {red_after:?} after the lock"
    );
    wait_check_critical(env, standstill);
    assert_eq!(books(env).dead, 0, "none dead-lettered for a lock");
}

/// A table lock taken before a worker under a tight `--max-rate` starts, every due job
/// read at once: red when the standstill comes, with a warning before it. Found from
/// outside: under 3/s with 150 jobs, `/healthz` stayed 200, with no warning either, for
/// 42 s: each worker held a whole batch and paced it one job at a time, and what its jobs
/// met was known only at the batch's end.
#[test]
fn a_table_lock_met_by_a_tightly_capped_worker_turns_health_red_in_time() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 30);
    let (_, release, h) = crate::lock_holder::hold(&env, "LOCK TABLE sku IN EXCLUSIVE MODE");
    let locked = Instant::now();
    push_timeouts(&env, &orders, 0);
    let (w, port) = start_with_health(&env, &["--max-rate", "3/s", "--retry-cap", "5s"]);
    wait_until(WAIT, "a warning: jobs wait on contention", || {
        metric(port, "delay_worker_jobs_waiting_on_contention") >= 1.0
    });
    assert!(
        locked.elapsed() < Duration::from_secs(10),
        "the first wait told {:?} after the lock",
        locked.elapsed()
    );
    red_soon_after(&env, port, locked);
    release.send(()).unwrap();
    h.join().unwrap();
    every_job_once_and_green(&env, w, port, &orders);
}

/// [`a_table_lock_met_by_a_tightly_capped_worker_turns_health_red_in_time`] under a cap
/// whose slots are 30 s apart: each job that met the lock went back and then waited for
/// its next slot longer than a job another process ran is remembered, so none was left
/// waiting and `/healthz` stayed 200 through the whole standstill (found from outside
/// under 2/m, 3/m and 120/h). A job this process holds is not another's. The stop leaves
/// the held jobs pending, and an uncapped start runs each once.
#[test]
fn a_table_lock_met_under_a_cap_of_two_a_minute_turns_health_red_in_time() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 6);
    let (_, release, h) = crate::lock_holder::hold(&env, "LOCK TABLE sku IN EXCLUSIVE MODE");
    let locked = Instant::now();
    push_timeouts(&env, &orders, 0);
    let (mut w, port) = start_with_health(&env, &["--max-rate", "2/m", "--retry-cap", "5s"]);
    red_soon_after(&env, port, locked);
    release.send(()).unwrap();
    h.join().unwrap();
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
    let (w, port) = start_with_health(&env, &[]);
    every_job_once_and_green(&env, w, port, &orders);
}

/// A worker started while another transaction holds a lock on the inbox table (a
/// migration, a `LOCK TABLE`): it starts and waits, health red, and runs every job once
/// when the lock ends. Found from outside: it exited 1 with "cannot prepare the inbox
/// statement: canceling statement due to lock timeout", where a lock taken after the
/// start is waited out.
#[test]
fn a_worker_started_while_the_inbox_is_locked_waits_for_it() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 10);
    let (_, release, h) =
        crate::lock_holder::hold(&env, "LOCK TABLE worker_inbox IN ACCESS EXCLUSIVE MODE");
    push_timeouts(&env, &orders, 0);
    let (mut w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz red while the inbox is locked", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("lock timeout")
    });
    assert!(w.exited().is_none(), "exited: {}", w.log());
    assert_eq!(books(&env).dead, 0);
    release.send(()).unwrap();
    h.join().unwrap();
    every_job_once_and_green(&env, w, port, &orders);
}

/// A shop trigger that sleeps 2 s in each update of an order for which `when` (SQL over
/// `NEW`) holds: past a `--statement-timeout` of 1 s. Dropped with `DROP TRIGGER
/// slow_order ON orders`.
fn slow_order_updates(db: &TestDb, when: &str) {
    db.client()
        .batch_execute(&format!(
            "CREATE FUNCTION slow_order() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF {when} THEN PERFORM pg_sleep(2); END IF; RETURN NEW; END $$; \
             CREATE TRIGGER slow_order BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION slow_order()"
        ))
        .unwrap();
}

/// A shop trigger that makes every update of an order outlast `--statement-timeout`, held
/// past a short `--retry-for`: statement timeouts are no lock wait, so a job alone would be
/// a dead letter at the horizon, but every waiting job of the event meets it and none
/// changes anything, so the queue stands still and none is dead-lettered; once the trigger
/// goes every order is cancelled once.
#[test]
fn a_slow_trigger_every_job_meets_past_the_retry_horizon_dead_letters_none() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 30);
    let (w, port) = start_with_health(
        &env,
        &[
            "--statement-timeout",
            "500ms",
            "--retry-for",
            "3s",
            "--max-retries",
            "1",
            "--retry-cap",
            "1s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    slow_order_updates(&env.db, "true");
    push_timeouts(&env, &orders, 0);
    // Past the horizon and the standstill's span (at least 6 s) with retries a second
    // apart: a job charged alone would be a dead letter by now.
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(10) {
        assert_eq!(books(&env).dead, 0, "a slow trigger every job meets");
        std::thread::sleep(Duration::from_millis(200));
    }
    env.db
        .client()
        .batch_execute("DROP TRIGGER slow_order ON orders")
        .unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A shop trigger that makes every update of an order outlast `--statement-timeout`
/// (57014, contention by its SQLSTATE), held past `CONTENTION_STALL`, while paid orders'
/// jobs keep falling due one a second (they change nothing, update no order and so
/// commit): no job of the event changes anything, so `/healthz` turns red and `stats
/// --check` CRITICAL, naming the standstill, and stays red; none dead-lettered; once the
/// trigger goes every unpaid order is cancelled once. Found from outside: 50 s without a
/// cancellation, `/healthz` 200 and the check a WARNING throughout, since a set that ran
/// out of time was split in halves that each ran it out again (63 timeouts for a set of
/// 32, no job settled for a minute), and since the paid orders' no-ops counted as jobs
/// going through.
#[test]
fn a_trigger_slower_than_the_statement_timeout_turns_health_red_when_nothing_changes() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 90);
    let paid: Vec<usize> = (30..orders.len()).collect();
    let paid_orders: Vec<SeedOrder> = paid.iter().map(|&i| orders[i].clone()).collect();
    pay(&env.db, &paid_orders);
    // Retries 5 s apart at most, so the jobs run soon after the trigger goes.
    let (w, port) = start_with_health(&env, &["--statement-timeout", "1s", "--retry-cap", "5s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    slow_order_updates(&env.db, "true");
    push_timeouts(&env, &orders[..30], 0);
    // A paid order's job falls due every second, red or not, until they run out.
    let mut pushed = 0;
    let mut tick = || {
        if let Some(o) = paid_orders.get(pushed) {
            push_timeouts(&env, std::slice::from_ref(o), 0);
            pushed += 1;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let standstill = "no job of order.timeout has changed anything for";
    let red = |port: u16| {
        let (code, body) = healthz(port);
        code == 503 && body.contains(standstill)
    };
    let began = Instant::now();
    while !red(port) {
        assert!(
            began.elapsed() < WAIT,
            "no standstill reported within {WAIT:?}: {:?}",
            healthz(port)
        );
        tick();
    }
    assert!(
        inbox_count(&env.db) > 0,
        "the paid orders' no-ops went through meanwhile"
    );
    for _ in 0..3 {
        assert!(red(port), "red while the trigger stops every cancellation");
        tick();
    }
    wait_check_critical(&env, standstill);
    let cancelled: i64 = env
        .db
        .probe(|c| {
            c.query_one(
                "SELECT count(*) FROM orders WHERE status = 'cancelled'",
                &[],
            )
        })
        .get(0);
    assert_eq!(cancelled, 0, "no order cancelled past the trigger");
    assert_eq!(books(&env).dead, 0, "none dead-lettered for a slow trigger");
    env.db
        .client()
        .batch_execute("DROP TRIGGER slow_order ON orders")
        .unwrap();
    push_timeouts(&env, &paid_orders[pushed..], 0);
    every_job_once_and_green_paid(&env, w, port, &orders, &paid);
}

/// A shop trigger that refuses every update of an order (P0001, "maintenance").
fn refuse_every_order_update(db: &TestDb) {
    db.client()
        .batch_execute(
            "CREATE SEQUENCE refusals; \
             CREATE FUNCTION maintenance() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM nextval('refusals'); RAISE EXCEPTION 'maintenance'; END $$; \
             CREATE TRIGGER maintenance BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION maintenance()",
        )
        .unwrap();
}

/// Drops [`refuse_every_order_update`]'s trigger.
fn allow_order_updates(db: &TestDb) {
    db.client()
        .batch_execute("DROP TRIGGER maintenance ON orders")
        .unwrap();
}

/// A trigger the shop adds for a while that refuses every update of `orders` (`RAISE`,
/// P0001: the job's own fault by its SQLSTATE), while a quarter of the orders are paid
/// (their jobs change nothing and commit): no job of the event changes anything, so the
/// refusals are taken for the surroundings' fault: the jobs are held, `/healthz` red and
/// `stats --check` CRITICAL naming it, none dead-lettered; once the trigger is dropped
/// every unpaid order is cancelled once (found from outside: 2,700 jobs dead-lettered in
/// 2 s; then, with paid orders among them, a few dead-lettered and health flapping).
#[test]
fn a_trigger_refusing_every_job_holds_them_until_it_is_dropped() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 20);
    let paid: Vec<usize> = (0..orders.len()).step_by(4).collect();
    let paid_orders: Vec<SeedOrder> = paid.iter().map(|&i| orders[i].clone()).collect();
    pay(&env.db, &paid_orders);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    refuse_every_order_update(&env.db);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red naming the trigger's error", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("are held: they fail") && body.contains("P0001")
    });
    wait_check_critical(&env, "are held: they fail");
    // Red while it lasts, not flapping with the paid orders' no-ops.
    for _ in 0..12 {
        assert_eq!(healthz(port).0, 503, "red while the trigger refuses");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        inbox_count(&env.db),
        paid.len() as i64,
        "only the paid orders' no-ops"
    );
    assert_eq!(
        books(&env).dead,
        0,
        "none dead-lettered for the shop's trigger"
    );
    allow_order_updates(&env.db);
    every_job_once_and_green_paid(&env, w, port, &orders, &paid);
}

/// Jobs whose own data PostgreSQL refuses (`order_id` "abc": 22P02), twenty at once, among
/// a steady stream of good jobs, with two worker processes: each is a dead letter with its
/// reason within seconds, whichever process meets it, since the good jobs show that the
/// handler works (found from outside: bad jobs drained four every 5 s, a process that had
/// seen fewer than five of them dead-lettered jobs another held).
#[test]
fn refused_jobs_among_good_traffic_are_dead_letters_within_seconds_in_every_process() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 40);
    let (a, port) = start_with_health(&env, &[]);
    let mut other = env.config.clone();
    other.consumer = format!("{}-b", env.config.consumer);
    let b = Proc::start(&other, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    // The same refusal for each, word for word.
    let msg = r#"{"event":"order.timeout","payload":{"order_id":"abc"}}"#;
    for i in 0..20 {
        xadd(&env, &format!("order.timeout:abc{i}"), msg.as_bytes());
    }
    push_spread(&env, &orders, Duration::from_secs(8));
    let start = Instant::now();
    wait_until(WAIT, "twenty dead letters", || books(&env).dead == 20);
    // A refusal met before any good job has committed is held (back in 5 s): 2 s or 7 s
    // on a quiet machine; a loaded CI run took a second hold (12.2 s, when this bound
    // also waited for the good jobs spread over 8 s). Two holds and slack stay well short
    // of the 25 s that four every 5 s took.
    assert!(
        start.elapsed() < Duration::from_secs(16),
        "the refused jobs took {:?}",
        start.elapsed()
    );
    wait_until(WAIT, "every order done", || inbox_count(&env.db) == 40);
    stop(a);
    stop(b);
    assert_accounting(&env.db, &orders, &all(&orders));
    for d in dead_letters(&env) {
        assert!(d["reason"].contains("invalid input syntax"), "{d:?}");
    }
}

/// The held count of `order.timeout` on a worker's `/metrics`.
const HELD: &str = "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"held\"}";
const REFUSED_WAITING: &str = "delay_worker_jobs_refused_waiting{event=\"order.timeout\"}";

/// A shop trigger refusing every job, met one job at a time (a slow event) and across a
/// `kill -9` and restart: each job is held, red, none dead-lettered; once the trigger is
/// dropped every job runs once (found from outside: the first job of a slow event, and one
/// after each restart, was a dead letter within 3 s while `/healthz` said 200).
#[test]
fn a_trigger_met_one_job_at_a_time_and_across_a_restart_dead_letters_nothing() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 3);
    refuse_every_order_update(&env.db);
    let (mut w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[..1], 0);
    wait_until(WAIT, "the lone job looked at twice, red", || {
        let (code, body) = healthz(port);
        metric(port, HELD) >= 2.0 && code == 503 && body.contains("are held: they fail")
    });
    assert_eq!(books(&env).dead, 0, "a lone refusal proves nothing");
    w.kill9();
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[1..2], 0);
    wait_until(WAIT, "both jobs looked at again after the restart", || {
        metric(port, HELD) >= 4.0
    });
    assert_eq!(healthz(port).0, 503, "red while the trigger refuses");
    assert_eq!(books(&env).dead, 0, "none dead-lettered across the restart");
    allow_order_updates(&env.db);
    push_timeouts(&env, &orders[2..], 0);
    every_job_once_and_green(&env, w, port, &orders);
}

/// Updates [`refuse_every_order_update`]'s trigger has refused so far: counted in a
/// sequence, which a rollback does not undo. (PostgreSQL's own `xact_rollback` is no
/// measure here: a busy backend may hand in its counts seconds late, and the first
/// tries' hundreds of rollbacks were once counted in the window after them.)
fn refusals(db: &TestDb) -> i64 {
    db.probe(|c| {
        c.query_one(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM refusals",
            &[],
        )
        .map(|r| r.get(0))
    })
}

/// Three hundred jobs held by a trigger that refuses every update: while they wait, a
/// process runs one of them at a time as a probe (ten a second) and sends the others back
/// untried, so the shop's database sees a few failing transactions a second, not one per
/// held job every 5 s (found from outside: 5,000 held jobs were 1,000 failing transactions
/// a second); the first probe after the trigger is dropped lets every job run, once.
#[test]
fn held_jobs_cost_the_database_one_probe_at_a_time() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 300);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    refuse_every_order_update(&env.db);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "every job held, red", || {
        metric(port, HELD) >= 2.0 * orders.len() as f64 && healthz(port).0 == 503
    });
    let (held, refused) = (metric(port, HELD), refusals(&env.db));
    let began = Instant::now();
    wait_until(WAIT, "every held job back once more (on average)", || {
        metric(port, HELD) - held >= orders.len() as f64
    });
    let looked = metric(port, HELD) - held;
    let took = began.elapsed().as_secs_f64();
    let failed = refusals(&env.db) - refused;
    // Each look a transaction, that would be 300 or more; probes, at most ten a second
    // over the 5 s the jobs take to come back (longer on a loaded machine), at most about
    // 50. Bounded by the probes' rate over the time it took, not by the looks, which a
    // loaded machine slows while the probes keep their rate.
    let probes_at_most = 10.0 * took * 1.5 + 10.0;
    assert!(
        (failed as f64) <= probes_at_most && (failed as f64) < looked,
        "{failed} failing transactions for {looked} looks at {} held jobs in {took:.1} s",
        orders.len()
    );
    assert_eq!(books(&env).dead, 0);
    allow_order_updates(&env.db);
    every_job_once_and_green(&env, w, port, &orders);
}

/// A shop trigger refusing every row of `coupon_user` for a while (a table frozen during a
/// deploy) refuses the orders that give a coupon back while the others go through, which
/// proves the handler works: still none is a dead letter within `--refusal-grace`, and
/// once the trigger is dropped each order is cancelled once, health green. (From outside:
/// 20 s of it dead-lettered 482 of 1,600 unpaid orders, those with a coupon, left
/// uncancelled.)
#[test]
fn a_table_frozen_for_a_while_dead_letters_none_of_the_jobs_it_refuses() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 40);
    env.db
        .client()
        .batch_execute(
            "CREATE FUNCTION frozen() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'coupon_user is frozen for maintenance'; END $$; \
             CREATE TRIGGER frozen BEFORE UPDATE ON coupon_user \
             FOR EACH ROW EXECUTE FUNCTION frozen()",
        )
        .unwrap();
    let (w, port) = start_with_health(&env, &[]);
    // Falling due over 12 s: the orders without a coupon go through all along, proof that
    // the handler works at each refused job's next look.
    push_spread(&env, &orders, Duration::from_secs(12));
    let without: Vec<&SeedOrder> = orders.iter().filter(|o| o.coupon_id.is_none()).collect();
    // Each refused job is looked at again with the others' changes as proof: before, a
    // dead letter at its second look, 2 s on.
    let none_dead = || assert_eq!(books(&env).dead, 0, "a frozen table is no job's fault");
    wait_until(WAIT, "the refused jobs told, a warning", || {
        none_dead();
        let (code, line) = check(&env);
        code == 1 && line.contains("refused within the grace")
    });
    wait_until(WAIT, "the orders without a coupon cancelled", || {
        none_dead();
        cancelled(&env.db, &without) == without.len()
    });
    assert_eq!(books(&env).dead, 0, "a frozen table is no job's fault");
    assert_eq!(inbox_count(&env.db), without.len() as i64);
    env.db
        .client()
        .batch_execute("DROP TRIGGER frozen ON coupon_user; DROP FUNCTION frozen()")
        .unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A trigger refusing some orders for good ("under fraud review"), the jobs due with them
/// all gone through before their grace ends: each refused order is a dead letter once
/// `--refusal-grace` (10 s here) has passed since its first refusal, the proof being the
/// others' changes after that refusal, and the others are cancelled once. (From outside: 29
/// of 51 such orders were held, red, for `--retry-for`, since no job went through in the
/// last look of their grace. One refused after the last job of its event goes through
/// waits for the next, as documented.)
#[test]
fn orders_a_rule_refuses_for_good_are_dead_letters_after_the_grace_in_a_quiet_spell() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 14);
    let refused = [&orders[2], &orders[5]];
    env.db
        .client()
        .batch_execute(&format!(
            "CREATE FUNCTION fraud_review() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF NEW.id IN ({}, {}) THEN \
             RAISE EXCEPTION 'order % is under fraud review', NEW.id; END IF; \
             RETURN NEW; END $$; \
             CREATE TRIGGER fraud_review BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION fraud_review()",
            refused[0].id, refused[1].id
        ))
        .unwrap();
    let (w, port) = start_with_health(&env, &["--refusal-grace", "10s"]);
    // Due over 8 s: other orders go through seconds after each refused one's first
    // refusal, and none after the last look within the grace.
    push_spread(&env, &orders, Duration::from_secs(8));
    wait_until(WAIT, "the two refused orders dead letters", || {
        books(&env).dead == 2
    });
    for d in dead_letters(&env) {
        assert!(d["reason"].contains("under fraud review"), "{d:?}");
        assert!(d["reason"].contains("after its first refusal"), "{d:?}");
    }
    let others: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !refused.iter().any(|r| r.id == o.id))
        .collect();
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    stop(w);
    assert_accounting(&env.db, &orders, &others);
}

/// A shop rule switched on and off (a maintenance switch, on 2.5 s and off 0.5 s for 14 s)
/// refusing every cancellation while on, its message naming the order: the refused jobs
/// that go through in an off spell show that the rule comes and goes, so the others, whose
/// tries all met it on, are waited for past `--refusal-grace` (6 s here) and none is a dead
/// letter; once the switch stays off each order is cancelled once. (From outside: 3 s on
/// and off for 160 s dead-lettered 38 of 900 unpaid orders past the grace; 20 s on and 2 s
/// off, 145; with the order in the message, 14 s on and 2 s off, 42 of 80, where the same
/// rule with one message for all cost none; with a customer's name in it, a word without
/// a digit, 135 of 800.) The message here names the order and its customer.
#[test]
fn a_rule_switched_on_and_off_past_the_grace_dead_letters_none() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 30);
    env.db
        .client()
        .batch_execute(
            "CREATE TABLE maintenance (on_now boolean NOT NULL); \
             INSERT INTO maintenance VALUES (false); \
             CREATE FUNCTION maintenance() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF (SELECT on_now FROM maintenance) THEN \
             RAISE EXCEPTION 'order % of customer % is read-only during maintenance', \
             NEW.order_no, 'Cust' || translate(NEW.id::text, '0123456789', 'abcdefghij'); \
             END IF; \
             RETURN NEW; END $$; \
             CREATE TRIGGER maintenance BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION maintenance()",
        )
        .unwrap();
    let switch = |db: &TestDb, on: bool| {
        db.client()
            .execute("UPDATE maintenance SET on_now = $1", &[&on])
            .unwrap();
    };
    let (w, port) = start_with_health(&env, &["--refusal-grace", "6s"]);
    push_spread(&env, &orders, Duration::from_secs(4));
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(14) {
        switch(&env.db, true);
        std::thread::sleep(Duration::from_millis(2_500));
        switch(&env.db, false);
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(
            books(&env).dead,
            0,
            "a maintenance switch is no job's fault"
        );
    }
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A shop rule on `orders`: a trigger refusing, with a message naming the order, every
/// order listed in the table `frozen` ([`freeze`]).
fn frozen_orders_table(db: &TestDb) {
    db.client()
        .batch_execute(
            "CREATE TABLE frozen (order_no text PRIMARY KEY); \
             CREATE FUNCTION frozen() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF EXISTS (SELECT 1 FROM frozen WHERE order_no = NEW.order_no) THEN \
             RAISE EXCEPTION 'order % is frozen during the stock count', NEW.order_no; \
             END IF; RETURN NEW; END $$; \
             CREATE TRIGGER frozen BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION frozen()",
        )
        .unwrap();
}

/// Lists the order in `frozen` ([`frozen_orders_table`]), or takes it off.
fn freeze(db: &TestDb, o: &SeedOrder, on: bool) {
    let sql = match on {
        true => "INSERT INTO frozen VALUES ($1)",
        false => "DELETE FROM frozen WHERE order_no = $1",
    };
    db.client().execute(sql, &[&o.order_no]).unwrap();
}

/// No dead letter at any look over `span`: a rule seen to come and go is no job's fault.
fn no_dead_letter_for(env: &Env, span: Duration) {
    let began = Instant::now();
    while began.elapsed() < span {
        assert_eq!(
            books(env).dead,
            0,
            "a rule seen to come and go is no job's fault"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Whether the order's timeout job is in the inbox.
fn job_done(db: &TestDb, o: &SeedOrder) -> bool {
    db.client()
        .query_one(
            "SELECT count(*) FROM worker_inbox WHERE job_key = $1",
            &[&format!("order.timeout:{}", o.order_no)],
        )
        .unwrap()
        .get::<_, i64>(0)
        == 1
}

/// A rule seen to come and go in one process (an order it refused went through) is known
/// to the process after it: restarted within the grace of another order the rule still
/// refuses, the new process waits that order out past `--refusal-grace` (8 s here) instead
/// of dead-lettering it at the grace's end, and once the rule lets it go it is cancelled
/// once. Before, only the process that saw the lapse knew it.
#[test]
fn a_rule_seen_to_come_and_go_before_a_restart_holds_the_jobs_it_still_refuses() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 14);
    frozen_orders_table(&env.db);
    freeze(&env.db, &orders[0], true);
    freeze(&env.db, &orders[1], true);
    let grace = ["--refusal-grace", "8s"];
    let (a, _) = start_with_health(&env, &grace);
    push_timeouts(&env, &orders[..2], 0);
    // The others go through all along: proof that the rule refuses only these two.
    push_spread(&env, &orders[2..], Duration::from_secs(14));
    // Both refused at once, back for a second look in 2 s.
    wait_until(WAIT, "a job done", || inbox_count(&env.db) >= 1);
    std::thread::sleep(Duration::from_millis(1_000));
    // The rule lets the first go: at its second look (2 s after its refusal) it is
    // cancelled, a refusal seen to lapse.
    freeze(&env.db, &orders[0], false);
    wait_until(WAIT, "the first frozen order cancelled", || {
        job_done(&env.db, &orders[0])
    });
    stop(a);
    let (b, port) = start_with_health(&env, &grace);
    // The second's grace ends in this process, about 8 s after its first refusal in the
    // one before; a look after that comes within a few seconds more.
    no_dead_letter_for(&env, Duration::from_secs(14));
    assert!(
        !job_done(&env.db, &orders[1]),
        "the frozen order went through while frozen"
    );
    assert_eq!(metric(port, REFUSED_WAITING), 1.0);
    freeze(&env.db, &orders[1], false);
    wait_done(&env, &env.db, orders.len() as i64);
    // The gauge follows the commit the inbox shows (once in a full run it still read 1
    // as the inbox was read).
    wait_until(WAIT, "no refused job waiting", || {
        metric(port, REFUSED_WAITING) == 0.0
    });
    green_then_books(&env, b, port, &orders, &all(&orders));
}

/// A rule seen to come and go before a job's first refusal counts too: an order the rule
/// refused went through once it let go, then the rule refuses another order while other
/// jobs go through; past `--refusal-grace` (6 s here) that order waits rather than being a
/// dead letter, and once the rule lets it go it is cancelled once. (From outside, a switch
/// on 12 s and off 2 s: the jobs never refused that went through in an off spell proved
/// the refused ones' fault while no refused job looked in that spell; 10 dead letters in
/// one of two runs.)
#[test]
fn a_rule_seen_to_come_and_go_before_a_job_s_first_refusal_holds_it_past_the_grace() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 24);
    let (a, j) = (&orders[0], &orders[1]);
    frozen_orders_table(&env.db);
    freeze(&env.db, a, true);
    let (w, port) = start_with_health(&env, &["--refusal-grace", "6s"]);
    push_timeouts(&env, std::slice::from_ref(a), 0);
    push_spread(&env, &orders[2..8], Duration::from_secs(2));
    wait_until(WAIT, "the others done", || inbox_count(&env.db) >= 6);
    // The rule lets the first go: at its next look it is cancelled, a lapse.
    freeze(&env.db, a, false);
    wait_until(WAIT, "the first frozen order cancelled", || {
        job_done(&env.db, a)
    });
    // Then it refuses another while the others go through all along.
    freeze(&env.db, j, true);
    push_timeouts(&env, std::slice::from_ref(j), 0);
    push_spread(&env, &orders[8..], Duration::from_secs(12));
    no_dead_letter_for(&env, Duration::from_secs(14));
    assert!(
        !job_done(&env.db, j),
        "the frozen order went through while frozen"
    );
    freeze(&env.db, j, false);
    wait_done(&env, &env.db, orders.len() as i64);
    green_then_books(&env, w, port, &orders, &all(&orders));
}

/// A job a shop rule refuses (a trigger refusing one order), alone: held and red, since one
/// refusal cannot tell a rule refusing this job from one refusing every job; a dead letter
/// with its reason once a job of its event changes something in another process (here one
/// serving another key prefix on the same database), which only the inbox can tell this
/// one.
#[test]
fn a_refused_job_alone_is_held_until_a_job_of_its_event_changes_something_in_another_process() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 2);
    env.db
        .client()
        .batch_execute(&format!(
            "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN IF NEW.order_no = '{}' THEN RAISE EXCEPTION 'not this one'; END IF; \
             RETURN NEW; END $$; \
             CREATE TRIGGER refuse_one BEFORE UPDATE ON orders \
             FOR EACH ROW EXECUTE FUNCTION refuse_one()",
            orders[1].order_no
        ))
        .unwrap();
    // The refusal outlasts its grace (2 min by default) only in a test's seconds so.
    let (a, port) = start_with_health(&env, &["--refusal-grace", "6s"]);
    push_timeouts(&env, &orders[1..], 0);
    wait_until(WAIT, "the refused job looked at twice, red", || {
        metric(port, HELD) >= 2.0 && healthz(port).0 == 503
    });
    assert_eq!(books(&env).dead, 0);
    let mut other = env.config.clone();
    other.consumer = "elsewhere".into();
    let b = Proc::start(&other, &args(&["--key-prefix", "elsewhere"]));
    let keys = delay_worker::keys::Keys::with_prefix("elsewhere");
    let now = delay_worker::now_ms();
    let job = delay_worker::producer::NewJob {
        event: "order.timeout".into(),
        payload: serde_json::json!({ "order_no": orders[0].order_no }),
        due_ms: now,
        key: Some(format!("order.timeout:{}", orders[0].order_no)),
    };
    delay_worker::producer::push(&mut env.con(), &keys, &job, now).unwrap();
    wait_until(WAIT, "the other process's job done", || {
        inbox_count(&env.db) == 1
    });
    wait_until(WAIT, "the refused job a dead letter", || {
        books(&env).dead == 1
    });
    let dead = dead_letters(&env);
    assert!(dead[0]["reason"].contains("not this one"), "{dead:?}");
    assert!(
        dead[0]["reason"].contains("while other jobs of order.timeout went through"),
        "{dead:?}"
    );
    wait_until(Duration::from_secs(20), "/healthz green again", || {
        healthz(port).0 == 200
    });
    stop(b);
    stop(a);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

/// A job whose data the handler's own statement cannot take (an id no bigint holds, which
/// the error quotes: the payload's own value), alone, with no other job to prove
/// anything: a dead letter with its reason at its second look, health never red for it
/// (found from outside: such a job, following another refusal, was held for an hour).
#[test]
fn a_job_whose_data_the_handler_cannot_take_is_a_dead_letter_alone() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    // An id no bigint holds reaches PostgreSQL as written (not as 1e23), so the error
    // quotes the payload's own value: the job's data, a dead letter alone, health green.
    let huge = "99999999999999999999999";
    let id: serde_json::Value = serde_json::from_str(huge).unwrap();
    push_payload(
        &env,
        "order.timeout:huge",
        serde_json::json!({ "order_id": id }),
    );
    let mut codes = Vec::new();
    wait_until(WAIT, "the huge id a dead letter", || {
        codes.push(healthz(port).0);
        books(&env).dead == 1
    });
    assert!(
        codes.iter().all(|&c| c == 200),
        "health red for a bad job: {codes:?}"
    );
    let dead = dead_letters(&env);
    assert!(
        dead.iter()
            .any(|d| d["reason"].contains(&format!("\"{huge}\" is out of range"))),
        "{dead:?}"
    );
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the other order done", || inbox_count(&env.db) == 1);
    stop(w);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

/// A data exception that names no value (a sku the shop keeps at the integer's top as
/// "unlimited stock", so giving stock back overflows: `integer out of range`, 22003) met
/// the shop's stored row, not the job's data: the jobs that meet it are held, health red
/// naming the error (at every look, while more jobs of their event go through), and none is a dead
/// letter; once the row is mended they are done. Found from outside: every unpaid order
/// returning stock to such a sku was a dead letter a second after its first failure.
#[test]
fn a_row_the_shop_keeps_at_its_type_s_limit_holds_the_jobs_that_meet_it_red_until_mended() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 6);
    // The orders that share a sku with the first, and the others.
    let sku = orders[0].items[0].0;
    let (meet, others): (Vec<&SeedOrder>, Vec<&SeedOrder>) = orders
        .iter()
        .partition(|o| o.items.iter().any(|(s, _)| *s == sku));
    assert!(!others.is_empty(), "some orders need no stock of {sku}");
    // More orders, for good jobs pushed while the others are held.
    let seeded = seed_orders(&env.db, 40);
    let stock: i32 = env
        .db
        .client()
        .query_one("SELECT stock FROM sku WHERE id = $1", &[&sku])
        .unwrap()
        .get(0);
    env.db
        .client()
        .execute("UPDATE sku SET stock = 2147483647 WHERE id = $1", &[&sku])
        .unwrap();
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the others done, health red", || {
        inbox_count(&env.db) as usize == others.len() && healthz(port).0 == 503
    });
    let (_, body) = healthz(port);
    assert!(body.contains("22003"), "{body}");
    // Held through several tries (each a few seconds apart), none a dead letter, red
    // throughout while more good jobs of the event go through.
    let more: Vec<SeedOrder> = seeded
        .iter()
        .filter(|o| o.items.iter().all(|(s, _)| *s != sku))
        .take(12)
        .cloned()
        .collect();
    for chunk in more.chunks(2) {
        push_timeouts(&env, chunk, 0);
        for _ in 0..2 {
            let (code, body) = healthz(port);
            assert_eq!(code, 503, "red while the row is at its limit: {body}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    assert_eq!(books(&env).dead, 0, "{:?}", dead_letters(&env));
    wait_until(WAIT, "the good jobs done", || {
        inbox_count(&env.db) as usize == others.len() + more.len()
    });
    // Mended (the stock it would have had): every held job done, health green.
    env.db
        .client()
        .execute("UPDATE sku SET stock = $2 WHERE id = $1", &[&sku, &stock])
        .unwrap();
    wait_until(Duration::from_secs(30), "the held orders done", || {
        inbox_count(&env.db) as usize == orders.len() + more.len()
    });
    wait_until(WAIT, "/healthz green again", || healthz(port).0 == 200);
    assert_eq!(books(&env).dead, 0);
    stop(w);
    assert_eq!(meet.len() + others.len(), orders.len());
    let every: Vec<SeedOrder> = orders.iter().chain(&seeded).cloned().collect();
    let done: Vec<&SeedOrder> = orders.iter().chain(&more).collect();
    assert_accounting(&env.db, &every, &done);
}

/// Pushes a job of `order.timeout` with `payload` under `key`, due now.
fn push_payload(env: &Env, key: &str, payload: serde_json::Value) {
    let job = delay_worker::producer::NewJob {
        event: "order.timeout".into(),
        payload,
        due_ms: delay_worker::now_ms(),
        key: Some(key.into()),
    };
    delay_worker::producer::push(&mut env.con(), &env.config.keys, &job, job.due_ms).unwrap();
}

/// Bad jobs in a quiet shop, one at a time: the first is a dead letter alone; the second,
/// with no job changing anything since, is held; a good job proves the handler works and
/// the second goes; the third, alone again, is a dead letter without waiting for another
/// good job (its letter proven by the good job's change says nothing of the others; found
/// from outside: every lone bad job after a held one waited, red, for the next good job).
#[test]
fn bad_jobs_met_one_at_a_time_in_a_quiet_shop_are_dead_letters() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_payload(&env, "bad:1", serde_json::json!({ "order_id": "abc1" }));
    wait_until(WAIT, "the first bad job a dead letter", || {
        books(&env).dead == 1
    });
    push_payload(&env, "bad:2", serde_json::json!({ "order_id": "abc2" }));
    wait_until(WAIT, "the second held, red", || healthz(port).0 == 503);
    assert_eq!(books(&env).dead, 1);
    push_timeouts(&env, &orders, 0);
    wait_until(
        WAIT,
        "the second a dead letter once a job went through",
        || books(&env).dead == 2,
    );
    push_payload(&env, "bad:3", serde_json::json!({ "order_id": "abc3" }));
    wait_until(
        WAIT,
        "the third a dead letter with no good job after it",
        || books(&env).dead == 3,
    );
    stop(w);
    assert_accounting(&env.db, &orders, &[&orders[0]]);
}

/// A CHECK constraint the shop adds that casts `cancel_reason` to an enum without
/// `timeout`: every cancellation fails with 22P02 and no context.
fn add_casting_constraint(db: &TestDb) {
    db.client()
        .batch_execute(
            "CREATE TYPE reason AS ENUM ('manual'); \
             ALTER TABLE orders ADD CONSTRAINT reason_known \
             CHECK (cancel_reason IS NULL OR cancel_reason::reason IS NOT NULL)",
        )
        .unwrap();
}

/// Drops [`add_casting_constraint`]'s constraint and type.
fn drop_casting_constraint(db: &TestDb) {
    db.client()
        .batch_execute("ALTER TABLE orders DROP CONSTRAINT reason_known; DROP TYPE reason")
        .unwrap();
}

/// A CHECK constraint the shop adds that casts (`cancel_reason::reason`, an enum without
/// `timeout`) refuses every cancellation with 22P02 and no context, as the handler's own
/// cast of a bad payload would: since other jobs of the event are refused too, none is
/// taken for its own data. Held, red, none dead-lettered, and once the constraint is
/// dropped every order is cancelled once (found from outside: every job a dead letter
/// within 5 s, health green).
///
/// Then the worker is restarted (SIGTERM) and another process started beside it while
/// the jobs are held: neither has seen a refusal of its own, but the jobs say they were
/// held (`held_at`), so neither takes them for their data (found from outside: 160 of 200
/// jobs dead-lettered within a second of a restart, 2,010 with a fourth process added).
#[test]
fn a_constraint_that_casts_refusing_every_job_dead_letters_none() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 40);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    add_casting_constraint(&env.db);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "/healthz red naming the cast's error", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains("are held: they fail") && body.contains("22P02")
    });
    wait_until(WAIT, "every job looked at twice", || {
        metric(port, HELD) >= 2.0 * orders.len() as f64
    });
    assert_eq!(books(&env).dead, 0, "none dead-lettered for the constraint");
    // `worker trace` tells why a held job waits (while it waits in the pool).
    let key = format!("order.timeout:{}", orders[0].order_no);
    let q = delay_worker::trace::Query::key(&key, None);
    wait_until(WAIT, "worker trace: held since", || {
        let now = delay_worker::now_ms();
        let trace = delay_worker::trace::gather(&mut env.con(), None, &env.config, &q, now);
        trace
            .unwrap()
            .jobs
            .iter()
            .any(|j| j.notes.iter().any(|n| n.starts_with("held since")))
    });
    stop(w);
    let (w, port) = start_with_health(&env, &[]);
    let mut other = env.config.clone();
    other.consumer = format!("{}-b", env.config.consumer);
    let port_b = free_port();
    let b = Proc::start(
        &other,
        &args(&["--metrics-addr", &format!("127.0.0.1:{port_b}")]),
    );
    wait_until(WAIT, "every job back in one of the new processes", || {
        metric(port, HELD) + metric(port_b, HELD) >= orders.len() as f64 || books(&env).dead > 0
    });
    let red_if_held = |port| metric(port, HELD) == 0.0 || healthz(port).0 == 503;
    wait_until(WAIT, "red wherever jobs are held", || {
        red_if_held(port) && red_if_held(port_b)
    });
    assert_eq!(books(&env).dead, 0, "none dead-lettered across a restart");
    drop_casting_constraint(&env.db);
    wait_done(&env, &env.db, orders.len() as i64);
    stop(b);
    every_job_once_and_green(&env, w, port, &orders);
}

/// A CHECK constraint that casts, met by one job alone (a slow event: no other job of it
/// refused or going through): the error quotes `timeout`, the handler's own value, which
/// the job's payload does not hold, so the job is not taken for its data. Held, red,
/// not a dead letter, and its order cancelled once the constraint goes (before: a dead
/// letter at its second look, health green).
#[test]
fn a_constraint_that_casts_met_by_a_lone_job_holds_it() {
    lone_job_meets_a_casting_constraint(None, "\"timeout\"");
}

/// The same on a server whose messages are German, then French (`lc_messages`): the
/// value is quoted `»timeout«` or `« timeout »`, not between double quotes, and is read
/// all the same (before: a message with no double quote was taken for one quoting no
/// value, and the lone job was a dead letter at its second look, health green).
#[test]
fn a_constraint_that_casts_met_by_a_lone_job_holds_it_in_german_and_french() {
    lone_job_meets_a_casting_constraint(Some("de_DE.UTF-8"), "»timeout«");
    lone_job_meets_a_casting_constraint(Some("fr_FR.UTF-8"), "« timeout »");
}

/// One job alone meets [`add_casting_constraint`], its database's sessions speaking
/// `lc_messages` (the server's own when `None`), whose error quotes the value as
/// `quoted`: held, red, never a dead letter, and cancelled once when the constraint goes.
fn lone_job_meets_a_casting_constraint(lc_messages: Option<&str>, quoted: &str) {
    let env = Env::new();
    if let Some(lc) = lc_messages {
        env.db
            .client()
            .batch_execute(&format!(
                "ALTER DATABASE {} SET lc_messages = '{lc}'",
                env.db.name
            ))
            .unwrap_or_else(|e| {
                panic!("{lc}: {e:?} (scripts/services.sh start --fast makes the locale before it starts PostgreSQL)")
            });
    }
    let orders = seed_orders(&env.db, 1);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    add_casting_constraint(&env.db);
    push_timeouts(&env, &orders, 0);
    wait_until(
        WAIT,
        "/healthz red naming the cast's error, or a dead letter",
        || {
            let (code, body) = healthz(port);
            books(&env).dead > 0
                || code == 503 && body.contains("are held: they fail") && body.contains(quoted)
        },
    );
    // Its second look (2 s) is past, and a first hold's return (5 s) too.
    wait_until(WAIT, "the job held twice, or a dead letter", || {
        metric(port, HELD) >= 2.0 || books(&env).dead > 0
    });
    assert_eq!(
        books(&env).dead,
        0,
        "the lone job dead-lettered for the constraint"
    );
    drop_casting_constraint(&env.db);
    every_job_once_and_green(&env, w, port, &orders);
}

/// A CHECK constraint that casts the order's own number (`order_no::bigint`), so the
/// error quotes a value the job's payload holds: the first job met alone is a dead letter
/// (the documented gap), and the jobs after it are held, red, in a restarted process and
/// in a process of another name too, which have no refusal on record of their own but
/// find the record of the letter the rule cost, even once the dead letters are purged
/// (found from outside: one more dead letter per restart and per process, and after a
/// purge or a flood of other letters). Once the constraint goes, every held order is
/// cancelled once.
#[test]
fn a_rule_that_cost_a_letter_holds_the_next_jobs_across_restarts_and_processes() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 3);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    env.db
        .client()
        .batch_execute(
            "ALTER TABLE orders ADD CONSTRAINT no_numeric \
             CHECK (cancel_reason IS NULL OR order_no::bigint > 0)",
        )
        .unwrap();
    push_timeouts(&env, &orders[..1], 0);
    wait_until(WAIT, "the first job a dead letter", || {
        books(&env).dead == 1
    });
    stop(w);
    // The dead letters purged (a flood of others would push the letter out of view as
    // well): the record of the refusal stays.
    let _: () = redis::cmd("DEL")
        .arg(&env.config.keys.dead)
        .arg(&env.config.keys.letters)
        .query(&mut env.con())
        .unwrap();
    assert_eq!(books(&env).dead, 0, "purged");
    let held_in = |port: u16, what: &str| {
        wait_until(WAIT, what, || {
            (healthz(port).0 == 503 && metric(port, HELD) >= 2.0) || books(&env).dead > 0
        });
        assert_eq!(books(&env).dead, 0, "{what}: another dead letter");
    };
    let (w, port) = start_with_health(&env, &[]);
    push_timeouts(&env, &orders[1..2], 0);
    held_in(port, "the next job held after a restart");
    stop(w);
    let mut other = env.config.clone();
    other.consumer = format!("{}-b", env.config.consumer);
    let port_b = free_port();
    let b = Proc::start(
        &other,
        &args(&["--metrics-addr", &format!("127.0.0.1:{port_b}")]),
    );
    push_timeouts(&env, &orders[2..], 0);
    held_in(port_b, "the jobs held in a process of another name");
    env.db
        .client()
        .batch_execute("ALTER TABLE orders DROP CONSTRAINT no_numeric")
        .unwrap();
    wait_done(&env, &env.db, 2);
    stop(b);
    assert_eq!(books(&env).dead, 0);
    assert_accounting(&env.db, &orders, &[&orders[1], &orders[2]]);
}

/// A CHECK constraint that casts, with new jobs falling due every half second while it
/// holds the others, and the worker restarted twice (SIGTERM, then kill -9): jobs refused
/// on their first try while their event is held are marked held, so a restarted process,
/// which has seen no refusal of its own, takes none of them for its data; none is
/// dead-lettered and every order is cancelled once the constraint goes (found from
/// outside: 18-19 dead letters per restart).
#[test]
fn new_jobs_refused_during_a_hold_survive_restarts() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 60);
    let (mut w, mut port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    add_casting_constraint(&env.db);
    push_timeouts(&env, &orders[..20], 0);
    let mut next = 20;
    for restart in 0..2 {
        for _ in 0..8 {
            push_timeouts(&env, &orders[next..next + 2], 0);
            next += 2;
            std::thread::sleep(Duration::from_millis(500));
        }
        wait_until(WAIT, "red while the constraint refuses", || {
            healthz(port).0 == 503
        });
        if restart == 0 {
            stop(w);
        } else {
            w.kill9();
        }
        (w, port) = start_with_health(&env, &[]);
        for _ in 0..2 {
            push_timeouts(&env, &orders[next..next + 2], 0);
            next += 2;
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    assert_eq!(next, orders.len());
    // Every job back in the restarted process at least once.
    wait_until(WAIT, "the jobs held in the restarted process", || {
        metric(port, HELD) >= orders.len() as f64 || books(&env).dead > 0
    });
    assert_eq!(healthz(port).0, 503, "red while the constraint refuses");
    assert_eq!(books(&env).dead, 0, "none dead-lettered across restarts");
    drop_casting_constraint(&env.db);
    every_job_once_and_green(&env, w, port, &orders);
}

/// Two worker processes and a shop's lock on several orders: each process counts the jobs
/// it sent back, and once every job is done, whichever process ran it, neither still
/// counts or warns of one (found from outside: a job the other process committed stayed
/// counted, and warned of, for a minute or two).
#[test]
fn waiting_jobs_another_process_ran_are_not_counted_for_long() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 8);
    let flags = [
        "--lock-timeout",
        "50ms",
        "--max-retries",
        "1",
        "--retry-cap",
        "1s",
    ];
    let (a, port_a) = start_with_health(&env, &flags);
    let mut other = env.config.clone();
    other.consumer = format!("{}-b", env.config.consumer);
    let port_b = free_port();
    let mut b_flags = args(&["--metrics-addr", &format!("127.0.0.1:{port_b}")]);
    b_flags.extend(args(&flags));
    let b = Proc::start(&other, &b_flags);
    let locks: Vec<_> = orders[..5]
        .iter()
        .map(|o| hold_lock(&env.db, "orders", o.id))
        .collect();
    push_timeouts(&env, &orders, 0);
    let waiting = |port| metric(port, "delay_worker_jobs_waiting_on_contention");
    wait_until(WAIT, "both processes count waiting jobs", || {
        waiting(port_a) >= 1.0 && waiting(port_b) >= 1.0
    });
    std::thread::sleep(Duration::from_secs(3));
    for (release, h) in locks {
        release.send(()).unwrap();
        h.join().unwrap();
    }
    wait_done(&env, &env.db, orders.len() as i64);
    // Forgotten at most 15 s after its last retry fell due (1 s apart at most here).
    wait_until(
        Duration::from_secs(25),
        "no waiting job counted, no warning",
        || {
            waiting(port_a) == 0.0
                && waiting(port_b) == 0.0
                && !check(&env).1.contains("contention")
        },
    );
    stop(b);
    stop(a);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// `--max-rate order.timeout=20/s` over 120 due jobs: no second holds more than the cap
/// and the tenth of a second's burst it lets through after a quiet spell (found from
/// outside: whole sets of 32 ran at once, 43 jobs within 3 ms against 20 a second; the
/// average held); every order cancelled once.
#[test]
fn a_max_rate_holds_in_every_second_not_only_on_average() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 120);
    let (w, port) = start_with_health(&env, &["--max-rate", "order.timeout=20/s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_done(&env, &env.db, orders.len() as i64);
    let busiest = busiest_second(&env.db, None);
    assert!(
        busiest <= 20 + 2 + 2,
        "{busiest} jobs within one second against --max-rate 20/s"
    );
    every_job_once_and_green(&env, w, port, &orders);
}

/// A cap is the fleet's: three processes of one prefix started with `--max-rate
/// order.timeout=20/s` take their slots from one schedule in Redis and together run no
/// more than it in any second (before, each kept its own: 60 a second together).
#[test]
fn a_max_rate_is_the_fleet_s_however_many_processes_run() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 120);
    let procs = start_named(
        &env,
        &["a", "b", "c"],
        &["--max-rate", "order.timeout=20/s"],
    );
    // Timed from before the push: the first jobs run while the last are pushed (under
    // load the 120 pushes took long enough that the drain, timed from after them, seemed
    // to beat the cap).
    let pushed = Instant::now();
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "a third done", || inbox_count(&env.db) >= 40);
    // The cap, a burst of a tenth of a second's slots, a share taken ahead, and one slot
    // of a worker woken up to 50 ms after it under load: the window counts when each
    // transaction began, so a job started late falls into the next second beside that
    // second's own (25 and 26 under `-j 8`: two workers woken late; a fleet running each
    // process's own cap ran 60).
    let calm = busiest_second(&env.db, None);
    assert!(
        calm <= 20 + 2 + 2 + 3,
        "{calm} jobs within one second from three processes against --max-rate 20/s"
    );
    // The schedule lost mid-drain (deleted by hand): the slots booked before it run beside
    // the new one's, a quarter of a second's at most (with a second's, 80-120 a second
    // under 40/s for a second).
    let mut con = env.con();
    redis::cmd("DEL")
        .arg(&env.config.keys.rates)
        .query::<()>(&mut con)
        .unwrap();
    wait_done(&env, &env.db, orders.len() as i64);
    let took = pushed.elapsed();
    let busiest = busiest_second(&env.db, None);
    assert!(
        busiest <= 20 + 5 + 2 + 2 + 1,
        "{busiest} jobs within one second across the loss of the schedule"
    );
    assert!(
        took >= Duration::from_secs(5),
        "120 jobs at 20/s took {took:?}"
    );
    let every: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &every);
    for (mut p, _) in procs {
        p.signal(libc::SIGTERM);
        assert!(p.wait(WAIT).success(), "{}", p.log());
        assert!(!p.log().contains("ERROR"), "{}", p.log());
        assert!(
            !p.log().contains("alone until Redis answers"),
            "{}",
            p.log()
        );
    }
}

/// A cap holds through a PostgreSQL outage and a process stopped (SIGSTOP) while its
/// workers wait: their slots went by meanwhile, and they take new ones rather than run
/// every held share at once (before: 8 jobs within 0.1 s under 2/s when PostgreSQL came
/// back, 9 within a second after a SIGCONT).
#[test]
fn a_max_rate_holds_after_an_outage_and_a_stop() {
    let mut env = Env::new();
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 60);
    let (w, port) = start_with_health(&env, &["--max-rate", "4/s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "a capped start", || inbox_count(&env.db) >= 8);
    set_connections(&env, false);
    std::thread::sleep(Duration::from_secs(4));
    set_connections(&env, true);
    let before = inbox_count(&env.db);
    wait_until(WAIT, "jobs after the outage", || {
        inbox_count(&env.db) >= before + 8
    });
    w.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_secs(3));
    w.signal(libc::SIGCONT);
    wait_done(&env, &env.db, orders.len() as i64);
    let busiest = busiest_second(&env.db, None);
    assert!(
        busiest <= 4 + 1 + 1,
        "{busiest} jobs within one second against --max-rate 4/s"
    );
    stop_then_every_order_once(&env, w, &orders);
}

/// A cap on one event leaves the others on time: every worker holding a timeout while it
/// waits for its slot under `order.timeout=1/s`, coupons that fall due meanwhile run
/// within a slot or so, not after the timeouts (found from outside: up to 29 s late, one
/// after each timeout; 50 s with two processes; here 20 s before).
#[test]
fn an_event_s_cap_does_not_hold_the_other_events_behind_it() {
    let mut env = Env::new();
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 40);
    let (w, port) = start_with_health(&env, &["--max-rate", "order.timeout=1/s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the capped drain under way", || {
        inbox_count(&env.db) >= 5
    });
    let mut con = env.con();
    let due = delay_worker::now_ms();
    for i in 0..10 {
        let job = delay_worker::producer::NewJob {
            event: "coupon.expire".into(),
            // Coupons that are not there: no-ops, each an inbox row.
            payload: serde_json::json!({ "coupon_id": 900_000 + i }),
            due_ms: due,
            key: Some(format!("coupon.expire:{i}")),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, due).unwrap();
    }
    wait_until(WAIT, "every coupon", || {
        env.db.probe(|c| {
            c.query_one(
                "SELECT count(*) FROM worker_inbox WHERE event = 'coupon.expire'",
                &[],
            )
            .map(|r| r.get::<_, i64>(0))
        }) == 10
    });
    let late_ms: f64 = env.db.probe(|c| {
        c.query_one(
            "SELECT (extract(epoch FROM max(processed_at)) * 1000)::float8 FROM worker_inbox \
             WHERE event = 'coupon.expire'",
            &[],
        )
        .map(|r| r.get::<_, f64>(0))
    }) - due as f64;
    assert!(
        late_ms < 2_500.0,
        "the last coupon ran {late_ms} ms after its due time"
    );
    wait_done(&env, &env.db, 50);
    let _ = w;
    let timeouts: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, &orders, &timeouts);
}

/// Workers book the fleet's slots at most a second ahead: a process stopped while its
/// workers wait for slots under a slow cap leaves next to none of them unused, and the
/// next start runs a job at the cap's next slot (found from outside: under 6/m with 8
/// workers each had booked a slot, and the next start ran nothing for 100 s).
#[test]
fn a_restart_under_a_slow_cap_is_not_held_by_the_slots_the_stop_left() {
    let mut env = Env::new();
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 20);
    push_timeouts(&env, &orders, 0);
    let (mut w, _) = start_with_health(&env, &["--max-rate", "6/m"]);
    wait_until(WAIT, "the first job", || inbox_count(&env.db) >= 1);
    std::thread::sleep(Duration::from_secs(3));
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
    let before = inbox_count(&env.db);
    let (w, _) = start_with_health(&env, &["--max-rate", "6/m"]);
    let restarted = Instant::now();
    wait_until(WAIT, "a job after the restart", || {
        inbox_count(&env.db) > before
    });
    assert!(
        restarted.elapsed() < Duration::from_secs(15),
        "the next job ran {:?} after the restart, under 6/m",
        restarted.elapsed()
    );
    drop(w);
    let (w, port) = start_with_health(&env, &[]);
    every_job_once_and_green(&env, w, port, &orders);
}

/// While the fleet's schedules cannot be taken (here the rates key holds a string; the
/// same when Redis does not answer) a process keeps its cap by itself, says so once, and
/// takes the fleet's again once it can.
#[test]
fn a_max_rate_holds_in_each_process_while_the_fleet_s_schedules_cannot_be_taken() {
    let mut env = Env::new();
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 120);
    let rates = env.config.keys.rates.clone();
    let mut con = env.con();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let w = Proc::start_logging(
        &env.config,
        &args(&["--metrics-addr", &addr, "--max-rate", "order.timeout=20/s"]),
        "info",
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    // The fleet's, then (the key made a string mid-drain) this process's own, then the
    // fleet's again: no second over the cap at either switch.
    wait_until(WAIT, "a third done", || inbox_count(&env.db) >= 40);
    redis::cmd("SET")
        .arg(&rates)
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    let alone =
        "--max-rate kept by this process alone until the fleet's schedules in Redis can be taken";
    wait_until(WAIT, "the fall-back told", || w.log().contains(alone));
    assert!(w.log().contains(&rates), "the key is named: {}", w.log());
    wait_until(WAIT, "two thirds done", || inbox_count(&env.db) >= 80);
    redis::cmd("DEL").arg(&rates).query::<()>(&mut con).unwrap();
    wait_done(&env, &env.db, 120);
    let busiest = busiest_second(&env.db, None);
    assert!(busiest <= 20 + 2 + 2, "{busiest} jobs within one second");
    assert_eq!(w.log().matches(alone).count(), 1, "told once: {}", w.log());
    assert_eq!(
        w.log().matches("--max-rate is the fleet's again").count(),
        1,
        "{}",
        w.log()
    );
    let fields: i64 = redis::cmd("HLEN").arg(&rates).query(&mut con).unwrap();
    assert_eq!(fields, 1, "the event's schedule is in Redis again");
    stop_then_every_order_once(&env, w, &orders);
}

/// A shop trigger that slows every tenth order past `--statement-timeout`, with a retry
/// budget of one (`--max-retries 1 --retry-for 0`): a set that runs out of time cannot
/// tell which of its jobs was slow, so none of them is charged a retry for it (each goes
/// back at once, in smaller sets); only a job that runs out of time alone is. So no job
/// of an order the trigger leaves alone is dead-lettered, and each of those orders is
/// cancelled once; the slow orders end cancelled once or dead-lettered with the timeout
/// (their budget, alone), never both. Found from outside: the other orders waited for a
/// retry with the slow one (10.6 s late), each charged a retry for a neighbour's fault.
#[test]
fn jobs_sharing_a_set_with_a_slow_order_are_not_charged_for_it() {
    let mut env = Env::new();
    // One worker: no transaction of the worker's own waits on another's sku locks (a
    // lock wait is charged, as contention, and would blur what this test looks at).
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 60);
    let slow: Vec<usize> = (0..orders.len()).filter(|i| i % 10 == 1).collect();
    let (w, port) = start_with_health(
        &env,
        &[
            "--statement-timeout",
            "1s",
            "--max-retries",
            "1",
            "--retry-for",
            "0s",
            "--retry-cap",
            "2s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let slow_ids: Vec<String> = slow.iter().map(|&i| orders[i].id.to_string()).collect();
    slow_order_updates(&env.db, &format!("NEW.id IN ({})", slow_ids.join(",")));
    push_timeouts(&env, &orders, 0);
    let others = orders.len() - slow.len();
    let done_others = || -> i64 {
        env.db
            .probe(|c| {
                c.query_one(
                    &format!(
                        "SELECT count(*) FROM orders WHERE status = 'cancelled' AND id NOT IN ({})",
                        slow_ids.join(",")
                    ),
                    &[],
                )
            })
            .get(0)
    };
    wait_until(
        WAIT,
        "the other orders cancelled, or a dead letter of one",
        || {
            done_others() == others as i64
                || dead_letters(&env).iter().any(|d| {
                    !slow
                        .iter()
                        .any(|&i| d["key"] == format!("order.timeout:{}", orders[i].order_no))
                })
        },
    );
    let dead = dead_letters(&env);
    for d in &dead {
        assert!(
            slow.iter()
                .any(|&i| d["key"] == format!("order.timeout:{}", orders[i].order_no)),
            "{} dead-lettered for a neighbour's slowness: {}",
            d["key"],
            d["reason"]
        );
    }
    env.db
        .client()
        .batch_execute("DROP TRIGGER slow_order ON orders")
        .unwrap();
    // Every job settled: the slow orders cancelled, or dead letters of their own timeout.
    wait_until(WAIT, "every job settled", || {
        let b = books(&env);
        inbox_count(&env.db) + b.dead as i64 == orders.len() as i64
            && b.pool == 0
            && b.stream_pending == 0
    });
    stop(w);
    let dead: Vec<String> = dead_letters(&env)
        .iter()
        .map(|d| d["key"].clone())
        .collect();
    for d in dead_letters(&env) {
        assert!(
            d["reason"].contains("57014"),
            "{}: {}",
            d["key"],
            d["reason"]
        );
    }
    let cancelled: Vec<&SeedOrder> = orders
        .iter()
        .filter(|o| !dead.contains(&format!("order.timeout:{}", o.order_no)))
        .collect();
    assert_accounting(&env.db, &orders, &cancelled);
}

/// Stops `w` as systemd does (SIGTERM, exit 0); then every order was cancelled once.
fn stop_then_every_order_once(env: &Env, mut w: Proc, orders: &[SeedOrder]) {
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());
    let every: Vec<&SeedOrder> = orders.iter().collect();
    assert_accounting(&env.db, orders, &every);
}

/// The most rows of `event` (every event: `None`) in the inbox whose transactions began
/// within any one second.
fn busiest_second(db: &TestDb, event: Option<&str>) -> usize {
    let at: Vec<f64> = db
        .probe(|c| {
            c.query(
                "SELECT extract(epoch FROM processed_at)::float8 FROM worker_inbox \
                 WHERE $1::text IS NULL OR event = $1 ORDER BY 1",
                &[&event],
            )
        })
        .iter()
        .map(|r| r.get(0))
        .collect();
    (0..at.len())
        .map(|i| at[i..].iter().take_while(|&&t| t < at[i] + 1.0).count())
        .max()
        .unwrap_or(0)
}

/// Caps of two events under a global cap, eight workers, three events mixed in the
/// stream (the third capped by the global cap alone): no second holds more of an event
/// than its cap and a tenth of a second's share, nor more of all than the global cap
/// and its share (found from outside: `order.timeout=30/s` held 38 in a second under a
/// global `60/s`, and exactly its 33 without it).
#[test]
fn event_caps_hold_under_a_global_cap() {
    let mut env = Env::new();
    env.config.threads = 8;
    let orders = seed_orders(&env.db, 150);
    let (w, port) = start_with_health(
        &env,
        &[
            "--max-rate",
            "order.timeout=30/s,coupon.expire=20/s",
            "--max-rate",
            "60/s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let mut con = env.con();
    let now = delay_worker::now_ms();
    for (i, o) in orders.iter().enumerate() {
        // Coupons and after-sale requests that are not there: no-ops, each an inbox row.
        for (event, payload, key) in [
            (
                "order.timeout",
                serde_json::json!({ "order_no": o.order_no }),
                format!("order.timeout:{}", o.order_no),
            ),
            (
                "coupon.expire",
                serde_json::json!({ "coupon_id": 900_000 + i }),
                format!("coupon.expire:{i}"),
            ),
            (
                "aftersale.timeout",
                serde_json::json!({ "aftersale_id": 900_000 + i }),
                format!("aftersale.timeout:{i}"),
            ),
        ] {
            let job = delay_worker::producer::NewJob {
                event: event.into(),
                payload,
                due_ms: now,
                key: Some(key),
            };
            delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
        }
    }
    wait_done(&env, &env.db, 3 * orders.len() as i64);
    let seen = [
        busiest_second(&env.db, Some("order.timeout")),
        busiest_second(&env.db, Some("coupon.expire")),
        busiest_second(&env.db, None),
    ];
    assert!(
        seen[0] <= 30 + 3 + 1 && seen[1] <= 20 + 2 + 1 && seen[2] <= 60 + 6 + 1,
        "busiest seconds: order.timeout {}, coupon.expire {}, all {}",
        seen[0],
        seen[1],
        seen[2]
    );
    stop(w);
    assert_accounting(&env.db, &orders, &all(&orders));
    assert_eq!(books(&env).dead, 0);
}

/// A worker process paused inside a transaction (SIGSTOP, a VM frozen, a debugger) holds
/// the rows its set locked only until PostgreSQL ends its idle session,
/// `IDLE_IN_TRANSACTION` later, not four statement timeouts (20 s): the shop's own
/// `FOR UPDATE` on those rows goes through within seconds, and once the worker runs again
/// every job is done once. Found from outside: a shop transaction waited 19.88 s on a
/// stopped worker. What the operator is told is the pause, a warning, never "no writable
/// PostgreSQL" (found from outside: `stats --check` CRITICAL so after a 5 s SIGSTOP).
#[test]
fn a_worker_paused_inside_a_transaction_holds_the_shop_s_rows_for_seconds_only() {
    let mut env = Env::new();
    env.config.threads = 4;
    let orders = seed_orders(&env.db, 3000);
    let (w, port) = start_with_health(&env, &["--set-size", "1"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the drain under way", || inbox_count(&env.db) >= 50);
    let mut shop = env.db.client();
    stop_inside_a_transaction(&w, &mut shop);
    let started = Instant::now();
    shop.batch_execute("BEGIN; SELECT id FROM sku ORDER BY id FOR UPDATE; COMMIT")
        .unwrap();
    let waited = started.elapsed();
    // Stopped 5 s in all: the worker finds its session ended, as the server's 25P03 or
    // only as a connection closed.
    std::thread::sleep(Duration::from_secs(5).saturating_sub(started.elapsed()));
    w.signal(libc::SIGCONT);
    assert!(
        waited < delay_worker::db::IDLE_IN_TRANSACTION + Duration::from_secs(3),
        "the shop waited {waited:?} on a paused worker's rows"
    );
    told_as_the_pause(&env, w, port, &orders);
}

/// Stops the worker (SIGSTOP) until one of its sessions is seen idle inside a transaction
/// that wrote.
fn stop_inside_a_transaction(w: &Proc, shop: &mut postgres::Client) {
    let caught = (0..400).any(|_| {
        w.signal(libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(20));
        let idle: i64 = shop
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'delay-worker' AND state = 'idle in transaction' \
                 AND backend_xid IS NOT NULL",
                &[],
            )
            .unwrap()
            .get(0);
        if idle == 0 {
            w.signal(libc::SIGCONT);
            std::thread::sleep(Duration::from_millis(10));
        }
        idle > 0
    });
    assert!(caught, "no worker session caught inside a transaction");
}

/// After a worker stopped mid-transaction was let go on: what the operator is told for
/// 4 s is the pause, never "no writable PostgreSQL"; then every order is cancelled once.
fn told_as_the_pause(env: &Env, w: Proc, port: u16, orders: &[SeedOrder]) {
    let mut told = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        told.push(check(env).1);
        told.push(healthz(port).1);
    }
    wait_done(env, &env.db, orders.len() as i64);
    let log = w.log();
    stop_then_every_order_once(env, w, orders);
    assert!(
        !told.iter().any(|t| t.contains("no writable PostgreSQL")),
        "the pause was told as an outage: {told:?}"
    );
    assert!(
        told.iter()
            .any(|t| t.contains("paused inside a transaction"))
            && log.contains("paused inside a transaction"),
        "the pause was not told: {told:?}\n{log}"
    );
}

/// A worker's sessions ended while its process stood still, by anything (here an
/// operator's `pg_terminate_backend`, 57P01): back, the worker finds them ended or only
/// closed, and that is told as its pause, measured by its stall watch, not as an outage
/// of PostgreSQL (found from outside: after a 5 s SIGSTOP, `stats --check` CRITICAL "no
/// writable PostgreSQL: connection closed" for 2 s).
#[test]
fn a_session_ended_while_its_process_stood_still_is_told_as_the_pause() {
    let mut env = Env::new();
    env.config.threads = 4;
    let orders = seed_orders(&env.db, 3000);
    let (w, port) = start_with_health(&env, &["--set-size", "1"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders, 0);
    wait_until(WAIT, "the drain under way", || inbox_count(&env.db) >= 50);
    let mut shop = env.db.client();
    stop_inside_a_transaction(&w, &mut shop);
    shop.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'delay-worker' \
         AND state = 'idle in transaction'",
        &[],
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    w.signal(libc::SIGCONT);
    told_as_the_pause(&env, w, port, &orders);
}

/// The worker's sessions waiting for a lock now.
fn lock_waiters(db: &TestDb) -> i64 {
    db.probe(|c| {
        c.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'delay-worker' AND wait_event_type = 'Lock'",
            &[],
        )
    })
    .get(0)
}

/// A shop session that locks an order (`FOR UPDATE`) and commits, on a thread: its
/// backend's pid, and the thread.
fn shop_locks_order(db: &TestDb, id: i64) -> (i32, std::thread::JoinHandle<()>) {
    let mut shop = db.client();
    let pid: i32 = shop
        .query_one("SELECT pg_backend_pid()", &[])
        .unwrap()
        .get(0);
    let h = std::thread::spawn(move || {
        shop.batch_execute(&format!(
            "BEGIN; SELECT id FROM orders WHERE id = {id} FOR UPDATE; COMMIT"
        ))
        .unwrap();
    });
    (pid, h)
}

/// A shop transaction waiting behind a worker's for seconds (here a slow trigger on the
/// orders keeps the worker's transaction, which locked the order, open for 7 s; a drain on
/// rows near their capacity or a worker paused mid-transaction do the same) is told:
/// `stats --check` warns once a shop session has waited a second behind a worker's
/// session, `/healthz` is red from 5 s, and green again once it has gone. A shop session
/// waiting for the shop's own long lock, with a worker's job queued for the same row, is
/// not blamed on the worker. Found from outside: a drain on three hot skus held the shop's
/// transactions up for tens of seconds while health stayed green.
#[test]
fn a_shop_transaction_held_up_behind_the_worker_s_is_told() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 2);
    orders_slow_to_update(&env.db, 7.0);
    // A job waits 10 s for a lock: in the second part it is queued for the row before the
    // shop's second session, which then waits behind it and the shop's own lock.
    let (w, port) = start_with_health(
        &env,
        &[
            "--statement-timeout",
            "20s",
            "--set-size",
            "1",
            "--lock-timeout",
            "10s",
        ],
    );
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    push_timeouts(&env, &orders[..1], 0);
    wait_until(WAIT, "the worker inside the slow update", || {
        sleeping(&env.db) == 1
    });
    let (_, waiting) = shop_locks_order(&env.db, orders[0].id);
    const TOLD: &str = "the worker holds the shop up";
    wait_until(WAIT, "stats --check naming the shop held up", || {
        check(&env).1.contains(TOLD)
    });
    assert_eq!(check(&env).0, 1, "a WARNING first: {}", check(&env).1);
    wait_until(WAIT, "/healthz red naming the shop held up", || {
        let (code, body) = healthz(port);
        code == 503 && body.contains(TOLD)
    });
    let held = metric(port, "delay_worker_shop_held_up_seconds");
    assert!(held >= 4.0, "delay_worker_shop_held_up_seconds {held}");
    waiting.join().unwrap();
    wait_until(WAIT, "/healthz green once the shop went on", || {
        healthz(port).0 == 200
    });
    orders_quick_again(&env.db);
    // The shop's own long lock, a worker's job and another shop session queued on it.
    let (release, holder) = hold_locks(&env.db, "orders", vec![orders[1].id]);
    push_timeouts(&env, &orders[1..], 0);
    wait_until(WAIT, "the job waiting on the shop's lock", || {
        lock_waiters(&env.db) == 1
    });
    let (pid, waiting) = shop_locks_order(&env.db, orders[1].id);
    let mut told = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        told.push(check(&env).1);
        std::thread::sleep(Duration::from_millis(100));
    }
    release.send(()).unwrap();
    holder.join().unwrap();
    waiting.join().unwrap();
    every_order_cancelled_once(&env, w, &orders);
    // The first part's warning lasts its minute; none names this shop session.
    let named = format!("the shop's session {pid} ");
    assert!(
        told.iter().all(|t| !t.contains(&named)),
        "the shop's own lock was blamed on the worker: {told:?}"
    );
}

/// A worker's session lost in the middle of a batch whose first sets committed: the batch
/// runs again on a new session, and the jobs that had committed find their inbox rows and
/// change nothing, but they count as what they did (`done`), not as duplicates; the
/// books hold. Here the batch's set meets a shop's row lock and splits, its halves commit
/// one after another, and the session is ended while the last job waits for the lock.
/// Found from outside: `done` rose by 845 for 1,125 cancels under a SIGSTOP loop
/// (sessions ended by the idle-in-transaction timeout).
#[test]
fn jobs_committed_before_a_session_was_lost_count_as_done() {
    let mut env = Env::new();
    env.config.threads = 1;
    let orders = seed_orders(&env.db, 20);
    let last = orders.iter().map(|o| o.id).max().unwrap();
    let (w, port) = start_with_health(&env, &["--lock-timeout", "3s"]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let (release, holder) = lock_order(&env, last);
    push_timeouts(&env, &orders, 0);
    let mut admin = env.db.client();
    let waiting = |admin: &mut postgres::Client| -> i64 {
        admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND application_name = 'delay-worker' AND wait_event_type = 'Lock'",
                &[],
            )
            .unwrap()
            .get(0)
    };
    wait_until(WAIT, "halves committed, the last job waiting", || {
        inbox_count(&env.db) >= 10 && waiting(&mut admin) == 1
    });
    let before = inbox_count(&env.db);
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = 'delay-worker' \
             AND wait_event_type = 'Lock'",
            &[],
        )
        .unwrap();
    release.send(()).unwrap();
    holder.join().unwrap();
    wait_done(&env, &env.db, 20);
    let count = |outcome: &str| {
        metric(
            port,
            &format!("delay_worker_jobs_total{{event=\"order.timeout\",outcome=\"{outcome}\"}}"),
        )
        .max(0.0)
    };
    wait_until(WAIT, "every job counted", || {
        count("done") + count("duplicate") >= 20.0
    });
    assert_eq!(
        (count("done"), count("duplicate")),
        (20.0, 0.0),
        "{before} jobs committed before the session was lost"
    );
    stop_then_every_order_once(&env, w, &orders);
}

/// A measurement, not a check (ignored: run it with `--ignored --nocapture`, in release
/// for the figures in docs/design.md): 2,000 orders fall due over 20 s, a quarter of them
/// sharing a sku the shop holds locked throughout; it prints how late the others were
/// cancelled. `DW_MEASURE_THREADS` sets `--threads` (8, the default, if unset). It ends
/// with the books and no dead letter, as any test.
#[test]
#[ignore = "a measurement: prints the lateness beside a locked sku"]
fn lateness_beside_a_locked_sku_measured() {
    let threads = std::env::var("DW_MEASURE_THREADS").map_or(8, |s| s.parse().unwrap());
    let mut env = Env::new();
    env.config.jobs.retry_base = Duration::from_secs(1);
    env.config.threads = threads;
    let orders = seed_orders(&env.db, 2000);
    let (sku, sharing) = sharing_a_sku(&orders);
    let held: Vec<i64> = sharing.iter().map(|o| o.id).collect();
    let (release, holder) = hold_lock(&env.db, "sku", sku);
    let (w, port) = start_with_health(&env, &[]);
    wait_until(WAIT, "/healthz green", || healthz(port).0 == 200);
    let due = push_due_in_turn(&env, &orders, 50, 500);
    let free: Vec<&SeedOrder> = orders.iter().filter(|o| !held.contains(&o.id)).collect();
    wait_until(Duration::from_secs(300), "the others cancelled", || {
        cancelled(&env.db, &free) == free.len()
    });
    let took = delay_worker::now_ms() - due.values().min().copied().unwrap_or_default();
    let mut late = lateness(&env.db, free.iter().map(|o| o.id), &due);
    late.sort_unstable();
    let q = |p: f64| late[((late.len() - 1) as f64 * p) as usize];
    eprintln!(
        "--threads {threads}: {} of {} orders locked; the others cancelled {} ms after the first fell due (the last fell due at 19,500 ms), late by p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
        held.len(),
        orders.len(),
        took,
        q(0.5),
        q(0.9),
        q(0.99),
        late[late.len() - 1],
    );
    release.send(()).unwrap();
    holder.join().unwrap();
    every_order_cancelled_once(&env, w, &orders);
}

/// Found from outside: a producer that pushed a key again while its job waited in the
/// pool for a retry replaced the retry, and the retry's dead letter held no message: its
/// payload was nowhere and `dead requeue` left it (exit 0). Now the letter holds the
/// retry's message, named by its event and attempts, and a requeue once the newer push
/// has run does it once, as the same job.
#[test]
fn a_retry_a_raw_push_replaced_is_a_dead_letter_with_its_message_that_requeues_once() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 2);
    let (first, second) = (&orders[0], &orders[1]);
    let mut c = env.db.client();
    c.batch_execute("ALTER TABLE orders RENAME COLUMN cancel_reason TO cancel_reason_old")
        .unwrap();
    let (w, port) = start_with_health(&env, &[]);
    let key = "order.timeout:shared";
    let mut con = env.con();
    let raw_push = |con: &mut redis::Connection, order_no: &str| {
        let now = delay_worker::now_ms();
        let msg = serde_json::json!({
            "event": "order.timeout", "payload": {"order_no": order_no},
            "retry": 0, "ts": now / 1000,
        });
        redis::cmd("HSET")
            .arg(&env.config.keys.data)
            .arg(key)
            .arg(msg.to_string())
            .query::<()>(con)
            .unwrap();
        redis::cmd("ZADD")
            .arg(&env.config.keys.pool)
            .arg(now)
            .arg(key)
            .query::<()>(con)
            .unwrap();
    };
    raw_push(&mut con, &first.order_no);
    // Held for the schema (the column renamed), the job waits in the pool between tries.
    wait_until(WAIT, "the job held in the pool with its record", || {
        let recorded: bool = redis::cmd("HEXISTS")
            .arg(&env.config.keys.jobs)
            .arg(key)
            .query(&mut con)
            .unwrap();
        let waiting: Option<f64> = redis::cmd("ZSCORE")
            .arg(&env.config.keys.pool)
            .arg(key)
            .query(&mut con)
            .unwrap();
        recorded && waiting.is_some()
    });
    raw_push(&mut con, &second.order_no);
    c.batch_execute("ALTER TABLE orders RENAME COLUMN cancel_reason_old TO cancel_reason")
        .unwrap();
    wait_until(WAIT, "the newer push done, the retry a dead letter", || {
        inbox_count(&env.db) == 1 && books(&env).dead == 1
    });
    let letter = dead_letters(&env).pop().unwrap();
    assert!(letter["reason"].contains("replaced"), "{letter:?}");
    assert!(letter["msg"].contains(&first.order_no), "{letter:?}");
    assert_eq!(letter["event"], "order.timeout", "{letter:?}");
    let entries: redis::Value = redis::cmd("XRANGE")
        .arg(&env.config.keys.dead)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    let redis::Value::Array(entries) = entries else {
        panic!("{entries:?}")
    };
    let redis::Value::Array(entry) = &entries[0] else {
        panic!("{entries:?}")
    };
    let id = delay_worker::store::value_to_string(&entry[0]);
    let out = run_worker(
        &["dead", "requeue", "--id", &id],
        &env.config.redis_url,
        &env.db.url,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout).starts_with("requeued 1"),
        "{}",
        text(&out.stdout)
    );
    wait_done(&env, &env.db, 2);
    green_then_books(&env, w, port, &orders, &all(&orders));
    let left: i64 = redis::cmd("HLEN")
        .arg(&env.config.keys.jobs)
        .query(&mut con)
        .unwrap();
    assert_eq!(left, 0, "no record or copy left behind");
}
