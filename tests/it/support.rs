//! Shared fixtures: a private `redis-server` per test, a PostgreSQL database per test
//! cloned from a migrated template, the shop's seed data and its accounting, and the
//! daemon run in-process or as a child process.
//!
//! A missing service is a loud failure: the tests never skip.

#![allow(dead_code)]

use delay_worker::{daemon, db, Config, Shutdown};
use postgres::NoTls;
use redis::Value;
use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

/// Where a test's own servers keep their files: `/dev/shm` when it is a memory file
/// system with 2 GiB free, else the temporary directory. On ext4 an initdb took 1.5 s of
/// CPU against 0.6 s in memory, most of it the kernel creating its files.
pub fn scratch_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        let shm = PathBuf::from("/dev/shm");
        let path = std::ffi::CString::new("/dev/shm").unwrap();
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        let roomy = unsafe { libc::statfs(path.as_ptr(), &mut st) } == 0
            && st.f_type as i64 == TMPFS_MAGIC
            && (st.f_bavail as u64).saturating_mul(st.f_bsize as u64) >= 2 << 30;
        if roomy {
            shm
        } else {
            std::env::temp_dir()
        }
    })
    .clone()
}

/// A loopback port free now, below the kernel's ephemeral range: a port the kernel hands
/// out (port 0) may be taken, before the server that was to have it binds it, by the
/// outgoing connection of another test's server (a replica to its master), and that
/// server then exits at start ("Address already in use"). Drawn at random, so tests
/// starting at once rarely draw the same one.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768)
        .max(12_000);
    loop {
        let port = fastrand::u16(10_000..low);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Polls `f` every 20 ms until it holds; panics with `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A connection kept for a test's polls, opened again once when a call on it fails (the
/// server killed, restarted or failed over since).
pub struct Kept<C>(Mutex<Option<C>>);

impl<C> Default for Kept<C> {
    fn default() -> Self {
        Kept(Mutex::new(None))
    }
}

impl<C> Kept<C> {
    /// `f` on the kept connection, or on one `open` makes when there is none or `f`
    /// failed on it; panics when `f` fails on a new one too.
    fn with<T, E: std::fmt::Debug>(
        &self,
        open: impl FnOnce() -> C,
        f: impl Fn(&mut C) -> Result<T, E>,
    ) -> T {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = kept.as_mut() {
            if let Ok(v) = f(c) {
                return v;
            }
        }
        *kept = None;
        let mut c = open();
        let v = f(&mut c).expect("a probe of the test's server");
        *kept = Some(c);
        v
    }

    /// Closes the kept connection, if any.
    fn forget(&mut self) {
        drop(self.0.get_mut().map(Option::take));
    }
}

/// A redis-server of this test's own, on a free loopback port, killed on drop.
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
    /// The connection [`RedisServer::probe`] keeps for the test's polls.
    probe: Kept<redis::Connection>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Extra `redis-server` arguments, e.g. `["--appendonly", "yes"]`.
    pub fn start_with(extra: &[&str]) -> RedisServer {
        let mut r = RedisServer::unstarted(extra);
        r.spawn();
        r
    }

    /// A server on a free port in a directory of its own, not started yet.
    fn unstarted(extra: &[&str]) -> RedisServer {
        let dir = scratch_dir().join(unique("dw-redis"));
        std::fs::create_dir_all(&dir).unwrap();
        RedisServer {
            port: free_port(),
            dir,
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            probe: Kept::default(),
        }
    }

    /// It answers a PING.
    fn answers(&self) -> bool {
        redis::Client::open(self.url().as_str())
            .and_then(|c| c.get_connection())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// [`RedisServer::start_with`], or `None` when the server exits at once (a port taken
    /// by another test between its pick and the server's bind): the caller picks again.
    pub fn try_start_with(extra: &[&str]) -> Option<RedisServer> {
        let mut r = RedisServer::unstarted(extra);
        r.launch();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(Ok(Some(_))) = r.child.as_mut().map(|c| c.try_wait()) {
                r.child = None;
                return None;
            }
            if r.answers() {
                return Some(r);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("timed out waiting for redis-server to answer");
    }

    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--dir"])
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is not installed: run scripts/services.sh install");
        self.child = Some(child);
    }

    fn spawn(&mut self) {
        self.launch();
        wait_until(Duration::from_secs(10), "redis-server to answer", || {
            self.answers()
        });
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// `f` on one connection kept for the test's polls (the books, every 20 ms): a
    /// connection of its own per poll was most of what a waiting test cost.
    pub fn probe<T>(&self, f: impl Fn(&mut redis::Connection) -> redis::RedisResult<T>) -> T {
        self.probe.with(|| self.con(), f)
    }

    /// The server's process id (for SIGSTOP: a server that accepts connections and never
    /// answers).
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("the server runs").id() as i32
    }

    pub fn con(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .expect("connect to the test redis")
    }

    /// Kills the server (SIGKILL) without waiting for anything.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills and starts again on the same port and directory (keeps an AOF if enabled).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The admin URL of the shared test PostgreSQL (scripts/services.sh starts it).
/// New connections to this test's database allowed or refused (`ALTER DATABASE ...
/// ALLOW_CONNECTIONS`); the open ones stay.
pub fn allow_connections(env: &Env, allow: bool) {
    let mut admin = postgres::Client::connect(&admin_url(), postgres::NoTls).unwrap();
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} WITH ALLOW_CONNECTIONS {allow}",
            env.db.name
        ))
        .unwrap();
}

/// A PostgreSQL outage for this test's database (`false`: no new connection, every open
/// one cut), or its end (`true`).
pub fn set_connections(env: &Env, allow: bool) {
    allow_connections(env, allow);
    if !allow {
        let mut admin = postgres::Client::connect(&admin_url(), postgres::NoTls).unwrap();
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&env.db.name],
            )
            .unwrap();
    }
}

pub fn admin_url() -> String {
    std::env::var("DW_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5439/postgres".to_string())
}

fn admin() -> postgres::Client {
    let url = admin_url();
    postgres::Client::connect(&url, NoTls).unwrap_or_else(|e| {
        panic!("PostgreSQL for the tests is not reachable at {url}: {e}; run scripts/services.sh start")
    })
}

fn template_name() -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (v, name, sql) in db::MIGRATIONS {
        (v, name, sql).hash(&mut h);
    }
    format!("dw_template_{:x}", h.finish())
}

/// Creates (once, across processes) a database with every migration applied.
fn template() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        let name = template_name();
        let mut a = admin();
        a.execute("SELECT pg_advisory_lock(7300002)", &[]).unwrap();
        let exists = a
            .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
            .unwrap()
            .is_some();
        if !exists {
            a.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
            let mut c = postgres::Client::connect(&db_url(&name), NoTls).unwrap();
            db::migrate(&mut c).unwrap();
        }
        a.execute("SELECT pg_advisory_unlock(7300002)", &[])
            .unwrap();
        name
    })
}

fn db_url(name: &str) -> String {
    let admin = admin_url();
    let base = admin.rsplit_once('/').map(|(b, _)| b).unwrap_or(&admin);
    format!("{base}/{name}")
}

/// How a test database is cloned from the template: `FILE_COPY` (PostgreSQL 15 and
/// later) copies the template's files, where the default `WAL_LOG` writes each of its
/// blocks through the WAL: 250 ms of the server's CPU per clone against 35 ms, taken
/// under the clones' lock.
fn clone_strategy(a: &mut postgres::Client) -> &'static str {
    let version: i32 = a
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .unwrap()
        .get(0);
    if version >= 150_000 {
        " STRATEGY FILE_COPY"
    } else {
        ""
    }
}

/// A database of this test's own, migrated, dropped on drop.
pub struct TestDb {
    pub name: String,
    pub url: String,
    /// Dropped on drop (false for a private server's default database).
    owned: bool,
    /// The session [`TestDb::probe`] keeps for the test's polls.
    probe: Kept<postgres::Client>,
}

impl TestDb {
    pub fn new() -> TestDb {
        let template = template();
        let name = unique("dwt");
        let mut a = admin();
        // CREATE DATABASE ... TEMPLATE fails while another session is connected to the
        // template; the advisory lock orders the clones against the template's creation.
        a.execute("SELECT pg_advisory_lock(7300002)", &[]).unwrap();
        let strategy = clone_strategy(&mut a);
        let r = a.batch_execute(&format!(
            "CREATE DATABASE {name} TEMPLATE {template}{strategy}"
        ));
        a.execute("SELECT pg_advisory_unlock(7300002)", &[])
            .unwrap();
        r.unwrap();
        TestDb::named(name, true)
    }

    /// The database `name` on the tests' server; dropped on drop when `owned`.
    fn named(name: String, owned: bool) -> TestDb {
        TestDb {
            url: db_url(&name),
            name,
            owned,
            probe: Kept::default(),
        }
    }

    /// `f` on one session kept for the test's polls (the inbox's rows, every 20 ms): a
    /// session of its own per poll cost PostgreSQL about 5 ms of CPU each, a quarter of a
    /// core for a test that waits.
    pub fn probe<T>(&self, f: impl Fn(&mut postgres::Client) -> Result<T, postgres::Error>) -> T {
        self.probe.with(|| self.client(), f)
    }

    /// A migrated database in `SQL_ASCII`, as older shops have them: text is stored as
    /// the client's bytes, whatever their encoding.
    pub fn sql_ascii() -> TestDb {
        let name = unique("dwa");
        admin()
            .batch_execute(&format!(
                "CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
            ))
            .unwrap();
        let db = TestDb::named(name, true);
        db::migrate(&mut db.client()).unwrap();
        db
    }

    /// `psql` on this database, as a child with its stdin piped: what it is sent runs in
    /// one session (bytes as they are: `PGCLIENTENCODING=SQL_ASCII`).
    pub fn psql(&self) -> std::process::Child {
        Command::new(pg_bin().join("psql"))
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", &self.url])
            .env("PGCLIENTENCODING", "SQL_ASCII")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("psql")
    }

    /// A database with nothing in it (for migration tests).
    pub fn empty() -> TestDb {
        let name = unique("dwe");
        admin()
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        TestDb::named(name, true)
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, NoTls).expect("connect to the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // The probe's session ends first: no session of ours is left for DROP to end.
        self.probe.forget();
        if !self.owned {
            return;
        }
        if let Ok(mut a) = postgres::Client::connect(&admin_url(), NoTls) {
            let _ = a.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ));
        }
    }
}

/// Redis + PostgreSQL + a config pointing at both, with fast test timings.
pub struct Env {
    pub redis: RedisServer,
    pub db: TestDb,
    pub config: Config,
}

impl Env {
    pub fn new() -> Env {
        let _ = env_logger::builder().is_test(true).try_init();
        let redis = RedisServer::start();
        let db = TestDb::new();
        let mut config = Config::new(&redis.url(), &db.url);
        config.threads = 4;
        config.consumer = "c1".into();
        config.mover.poll = Duration::from_millis(20);
        config.reader.block = Duration::from_millis(200);
        config.reader.heartbeat_ttl = Duration::from_secs(2);
        config.jobs.retry_base = Duration::from_millis(100);
        config.stats_interval = Duration::from_secs(1);
        Env { redis, db, config }
    }

    pub fn con(&self) -> redis::Connection {
        self.redis.con()
    }

    /// An environment whose PostgreSQL is a private server of its own, started with
    /// `extra` settings (for restarts, stops and server settings no other test may see).
    pub fn on_own_postgres(extra: &[&str]) -> (Env, PgServer) {
        let mut env = Env::new();
        let pg = PgServer::start(extra);
        env.db = pg.db();
        env.config.database_url = pg.url.clone();
        (env, pg)
    }
}

/// The daemon running in this process on its own threads.
pub struct Daemon {
    pub shutdown: Shutdown,
    handle: Option<std::thread::JoinHandle<Result<daemon::Report, daemon::DaemonError>>>,
}

impl Daemon {
    pub fn start(config: &Config) -> Daemon {
        let shutdown = Shutdown::new();
        let (c, s) = (config.clone(), shutdown.clone());
        let handle = std::thread::spawn(move || daemon::run(&c, &s));
        Daemon {
            shutdown,
            handle: Some(handle),
        }
    }

    /// Graceful stop; returns the daemon's report.
    pub fn stop(mut self) -> daemon::Report {
        self.shutdown.trigger();
        self.handle
            .take()
            .unwrap()
            .join()
            .expect("daemon thread panicked")
            .expect("daemon failed")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown.trigger();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The `worker` binary as a child process (for kill -9 and signals). Its log goes to a
/// file of its own, printed only if the test fails: a passing run is quiet.
pub struct Proc {
    pub child: Child,
    log: PathBuf,
}

impl Proc {
    pub fn start(config: &Config, extra: &[String]) -> Proc {
        Proc::start_logging(
            config,
            extra,
            &std::env::var("DW_CHILD_LOG").unwrap_or("warn".into()),
        )
    }

    /// [`Proc::start`] with this `RUST_LOG` (for a test that reads info lines).
    pub fn start_logging(config: &Config, extra: &[String], rust_log: &str) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
        cmd.env("REDIS_URL", &config.redis_url)
            .env("DATABASE_URL", &config.database_url)
            .env("RUST_LOG", rust_log)
            .args(["--consumer", &config.consumer])
            .args(["--threads", &config.threads.to_string()])
            .args([
                "--poll-interval",
                "20ms",
                "--block",
                "200ms",
                "--heartbeat-ttl",
                "2s",
            ])
            .args([
                "--retry-base",
                &format!("{}ms", config.jobs.retry_base.as_millis()),
            ])
            .args([
                "--stats-interval",
                &format!("{}ms", config.stats_interval.as_millis()),
            ])
            .args(extra)
            .stdin(Stdio::null());
        Proc::spawn(cmd)
    }

    /// Starts `cmd` (the worker binary with its flags) with its stderr in a log file.
    pub fn spawn(mut cmd: Command) -> Proc {
        let log = std::env::temp_dir().join(unique("dw-worker-log"));
        let file = std::fs::File::create(&log).expect("create the child's log file");
        let child = cmd.stderr(file).spawn().expect("start the worker binary");
        Proc { child, log }
    }

    /// What the child logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// The exit status if the child has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Waits for exit; panics after `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                start.elapsed() < timeout,
                "worker did not exit in {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "---- log of worker {} ----\n{}",
                self.child.id(),
                self.log()
            );
        }
        let _ = std::fs::remove_file(&self.log);
        forget_faketime(self.child.id());
    }
}

/// Removes what libfaketime leaves in `/dev/shm` for the process `pid` once it has ended:
/// a process under it made a semaphore and a shared memory object of its own, removed
/// only by a normal exit, so each worker the tests killed left two behind.
pub fn forget_faketime(pid: u32) {
    let _ = std::fs::remove_file(format!("/dev/shm/faketime_shm_{pid}"));
    let _ = std::fs::remove_file(format!("/dev/shm/sem.faketime_sem_{pid}"));
}

// ---- the shop ---------------------------------------------------------------------------

pub const SKUS: i64 = 5;
pub const START_STOCK: i32 = 1_000_000;

/// One seeded order: what its cancellation must give back.
#[derive(Debug, Clone)]
pub struct SeedOrder {
    pub id: i64,
    pub order_no: String,
    pub coupon_id: Option<i64>,
    /// (sku_id, qty) lines; a sku may appear twice.
    pub items: Vec<(i64, i32)>,
}

/// Seeds `n` pending orders, each with 1-3 lines over `SKUS` skus (some repeating a sku)
/// and every other one with a used coupon. Stock is taken out for every line, as the shop
/// did when the order was placed.
pub fn seed_orders(db: &TestDb, n: usize) -> Vec<SeedOrder> {
    let mut c = db.client();
    let mut tx = c.transaction().unwrap();
    let have: i64 = tx
        .query_one("SELECT count(*) FROM sku", &[])
        .unwrap()
        .get(0);
    if have == 0 {
        for _ in 0..SKUS {
            tx.execute("INSERT INTO sku (stock) VALUES ($1)", &[&START_STOCK])
                .unwrap();
        }
    }
    let skus: Vec<i64> = tx
        .query("SELECT id FROM sku ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let base: i64 = tx
        .query_one("SELECT count(*) FROM orders", &[])
        .unwrap()
        .get(0);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let k = base as usize + i;
        let coupon_id: Option<i64> = k.is_multiple_of(2).then(|| {
            tx.query_one(
                "INSERT INTO coupon_user (user_id, status, used_at) VALUES ($1, 'used', now()) RETURNING id",
                &[&(k as i64)],
            )
            .unwrap()
            .get(0)
        });
        let order_no = format!("SO{k:08}");
        let id: i64 = tx
            .query_one(
                "INSERT INTO orders (order_no, coupon_id) VALUES ($1, $2) RETURNING id",
                &[&order_no, &coupon_id],
            )
            .unwrap()
            .get(0);
        let mut items = vec![(skus[k % skus.len()], (k % 3 + 1) as i32)];
        if k % 3 == 1 {
            items.push((skus[(k + 1) % skus.len()], 2));
        }
        if k % 5 == 2 {
            // The same sku on two lines: both must come back.
            items.push((skus[k % skus.len()], 1));
        }
        for (sku, qty) in &items {
            tx.execute(
                "INSERT INTO order_items (order_id, sku_id, qty) VALUES ($1, $2, $3)",
                &[&id, sku, qty],
            )
            .unwrap();
            tx.execute(
                "UPDATE sku SET stock = stock - $2 WHERE id = $1",
                &[sku, qty],
            )
            .unwrap();
        }
        out.push(SeedOrder {
            id,
            order_no,
            coupon_id,
            items,
        });
    }
    tx.commit().unwrap();
    out
}

/// Marks orders paid (their coupon stays used, their stock stays out).
pub fn pay(db: &TestDb, orders: &[SeedOrder]) {
    let mut c = db.client();
    for o in orders {
        c.execute(
            "UPDATE orders SET status = 'paid', paid_at = now() WHERE id = $1 AND status = 'pending'",
            &[&o.id],
        )
        .unwrap();
    }
}

/// Checks the books: every order in `cancelled` is cancelled with reason `timeout`, every
/// other order is not; each sku's stock equals its start minus the lines of orders that
/// are not cancelled; each coupon of a cancelled order is unused, every other used.
pub fn assert_accounting(db: &TestDb, all: &[SeedOrder], cancelled: &[&SeedOrder]) {
    let mut c = db.client();
    let cancelled_ids: std::collections::HashSet<i64> = cancelled.iter().map(|o| o.id).collect();
    let rows = c
        .query("SELECT id, status, cancel_reason FROM orders", &[])
        .unwrap();
    let mut by_id = std::collections::HashMap::new();
    for r in rows {
        let id: i64 = r.get(0);
        let status: String = r.get(1);
        let reason: Option<String> = r.get(2);
        by_id.insert(id, (status, reason));
    }
    let mut expected_stock: std::collections::HashMap<i64, i64> = std::collections::HashMap::new();
    for o in all {
        let (status, reason) = &by_id[&o.id];
        if cancelled_ids.contains(&o.id) {
            assert_eq!(
                status, "cancelled",
                "order {} should be cancelled",
                o.order_no
            );
            assert_eq!(reason.as_deref(), Some("timeout"));
        } else {
            assert_ne!(
                status, "cancelled",
                "order {} must not be cancelled",
                o.order_no
            );
            for (sku, qty) in &o.items {
                *expected_stock.entry(*sku).or_default() += *qty as i64;
            }
        }
    }
    for r in c.query("SELECT id, stock FROM sku", &[]).unwrap() {
        let id: i64 = r.get(0);
        let stock: i32 = r.get(1);
        let out = expected_stock.get(&id).copied().unwrap_or(0);
        assert_eq!(
            stock as i64,
            START_STOCK as i64 - out,
            "stock of sku {id} does not add up"
        );
    }
    for o in all {
        if let Some(cid) = o.coupon_id {
            let status: String = c
                .query_one("SELECT status FROM coupon_user WHERE id = $1", &[&cid])
                .unwrap()
                .get(0);
            let want = if cancelled_ids.contains(&o.id) {
                "unused"
            } else {
                "used"
            };
            assert_eq!(status, want, "coupon of order {}", o.order_no);
        }
    }
}

/// Redis-side bookkeeping of one test's keys.
#[derive(Debug)]
pub struct Books {
    pub pool: usize,
    pub stream_pending: usize,
    pub dead: usize,
}

pub fn books(env: &Env) -> Books {
    env.redis.probe(|con| try_books_on(con, &env.config.keys))
}

/// The Redis side of the books, read on `con` (the server holding `keys`).
pub fn books_on(con: &mut redis::Connection, keys: &delay_worker::keys::Keys) -> Books {
    try_books_on(con, keys).unwrap()
}

fn try_books_on(
    con: &mut redis::Connection,
    keys: &delay_worker::keys::Keys,
) -> redis::RedisResult<Books> {
    let pool: usize = redis::cmd("ZCARD").arg(&keys.pool).query(con)?;
    let dead: usize = redis::cmd("XLEN").arg(&keys.dead).query(con)?;
    let pending: redis::Value = redis::cmd("XPENDING")
        .arg(&keys.stream)
        .arg(&keys.group)
        .query(con)
        .or_else(|e| {
            // No group yet: nothing pending. A lost connection is the probe's to mend.
            if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                Err(e)
            } else {
                Ok(redis::Value::Nil)
            }
        })?;
    let stream_pending = match pending {
        redis::Value::Array(v) => match v.first() {
            Some(redis::Value::Int(n)) => *n as usize,
            _ => 0,
        },
        _ => 0,
    };
    Ok(Books {
        pool,
        stream_pending,
        dead,
    })
}

/// Pushes an `order.timeout` for each order, due `delay_ms` from now, keyed by order.
pub fn push_timeouts(env: &Env, orders: &[SeedOrder], delay_ms: i64) {
    push_timeouts_to(&mut env.con(), &env.config.keys, orders, delay_ms);
}

/// [`push_timeouts`] through `con` under `keys` (a Redis other than the env's).
pub fn push_timeouts_to(
    con: &mut redis::Connection,
    keys: &delay_worker::keys::Keys,
    orders: &[SeedOrder],
    delay_ms: i64,
) {
    let now = delay_worker::now_ms();
    for o in orders {
        let job = delay_worker::producer::NewJob {
            event: "order.timeout".into(),
            payload: serde_json::json!({ "order_no": o.order_no }),
            due_ms: now + delay_ms,
            key: Some(format!("order.timeout:{}", o.order_no)),
        };
        delay_worker::producer::push(con, keys, &job, now).unwrap();
    }
}

/// Rows in the inbox.
pub fn inbox_count(db: &TestDb) -> i64 {
    db.probe(|c| c.query_one("SELECT count(*) FROM worker_inbox", &[]))
        .get(0)
}

// ---- a PostgreSQL server of the test's own (for restarts and connection exhaustion) -----

fn pg_bin() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed: run scripts/services.sh install")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("pg_ctl").exists())
        .collect();
    dirs.sort();
    dirs.pop()
        .expect("no PostgreSQL server binaries under /usr/lib/postgresql")
}

/// Runs a PostgreSQL tool as the `postgres` user when we are root (the server refuses root).
fn pg_cmd(tool: &str) -> Command {
    let path = pg_bin().join(tool);
    if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        Command::new(path)
    }
}

/// A private PostgreSQL cluster on a free port, migrated, stopped on drop.
pub struct PgServer {
    pub port: u16,
    dir: PathBuf,
    pub url: String,
}

impl PgServer {
    pub fn start(extra: &[&str]) -> PgServer {
        let dir = scratch_dir().join(unique("dw-pg"));
        std::fs::create_dir_all(&dir).unwrap();
        if unsafe { libc::geteuid() } == 0 {
            let ok = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&dir)
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let out = pg_cmd("initdb")
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8"])
            .output()
            .expect("initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let mut opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} -c fsync=off",
            dir.display()
        );
        for e in extra {
            opts.push(' ');
            opts.push_str(e);
        }
        std::fs::write(dir.join("opts"), &opts).unwrap();
        let pg = PgServer {
            port,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
        };
        pg.ctl(&["start", "-w", "-t", "60"]);
        let mut c = postgres::Client::connect(&pg.url, NoTls).unwrap();
        db::migrate(&mut c).unwrap();
        pg
    }

    fn ctl(&self, args: &[&str]) {
        let opts = std::fs::read_to_string(self.dir.join("opts")).unwrap();
        let out = pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .arg("-o")
            .arg(opts)
            .args(args)
            .output()
            .expect("pg_ctl");
        assert!(
            out.status.success(),
            "pg_ctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The postmaster's process id (for SIGSTOP: a server whose sessions go on and that
    /// takes no new one).
    pub fn postmaster_pid(&self) -> i32 {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap();
        pid.lines().next().unwrap().trim().parse().unwrap()
    }

    /// Crash-stops the server (immediate shutdown: no clean checkpoint, recovery from WAL
    /// on start), then starts it again on the same port.
    pub fn crash_restart(&self, down_for: Duration) {
        self.ctl(&["stop", "-m", "immediate", "-w"]);
        std::thread::sleep(down_for);
        self.ctl(&["start", "-w", "-t", "60"]);
    }

    /// A streaming standby of this server (`pg_basebackup -R`), on a port of its own,
    /// started and caught up.
    pub fn standby(&self) -> PgServer {
        let dir = scratch_dir().join(unique("dw-pg-standby"));
        std::fs::create_dir_all(&dir).unwrap();
        if unsafe { libc::geteuid() } == 0 {
            assert!(Command::new("chown")
                .arg("postgres:postgres")
                .arg(&dir)
                .status()
                .unwrap()
                .success());
        }
        let out = pg_cmd("pg_basebackup")
            .arg("-D")
            .arg(dir.join("data"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-R", "-X", "stream", "--no-sync"])
            .output()
            .expect("pg_basebackup");
        assert!(
            out.status.success(),
            "pg_basebackup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let opts = std::fs::read_to_string(self.dir.join("opts"))
            .unwrap()
            .replace(&format!("-p {}", self.port), &format!("-p {port}"))
            .replace(
                &format!("-k {}", self.dir.display()),
                &format!("-k {}", dir.display()),
            );
        std::fs::write(dir.join("opts"), &opts).unwrap();
        let pg = PgServer {
            port,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            dir,
        };
        pg.ctl(&["start", "-w", "-t", "60"]);
        pg
    }

    /// A superuser statement on this server.
    pub fn sql(&self, statement: &str) {
        let mut c = postgres::Client::connect(&self.url, NoTls).unwrap();
        c.batch_execute(statement)
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }

    /// Turns `default_transaction_read_only` on or off for the whole server (ALTER
    /// SYSTEM and a reload): every session's next transaction takes it.
    pub fn set_read_only(&self, on: bool) {
        self.sql(if on {
            "ALTER SYSTEM SET default_transaction_read_only = on"
        } else {
            "ALTER SYSTEM RESET default_transaction_read_only"
        });
        self.sql("SELECT pg_reload_conf()");
    }

    /// Names a synchronous standby (`synchronous_standby_names`, ALTER SYSTEM and a
    /// reload: one that is not connected makes every commit that waits for it wait), or
    /// none.
    pub fn set_synchronous_standby(&self, name: Option<&str>) {
        self.sql(&match name {
            Some(n) => format!("ALTER SYSTEM SET synchronous_standby_names = '{n}'"),
            None => "ALTER SYSTEM RESET synchronous_standby_names".to_string(),
        });
        self.sql("SELECT pg_reload_conf()");
    }

    /// Promotes a standby and waits until it takes writes.
    pub fn promote(&self) {
        self.ctl(&["promote", "-w", "-t", "60"]);
    }

    /// Stops the server (immediate: as a crash).
    pub fn crash(&self) {
        self.ctl(&["stop", "-m", "immediate", "-w"]);
    }

    /// Stops the server cleanly and starts it again as a standby without a primary to
    /// follow: it answers, read-only, as an old primary restarted in recovery does.
    pub fn restart_as_standby(&self) {
        self.ctl(&["stop", "-m", "fast", "-w"]);
        std::fs::write(self.dir.join("data").join("standby.signal"), "").unwrap();
        if unsafe { libc::geteuid() } == 0 {
            let _ = Command::new("chown")
                .arg("postgres:postgres")
                .arg(self.dir.join("data").join("standby.signal"))
                .status();
        }
        self.ctl(&["start", "-w", "-t", "60"]);
    }

    /// The same shape as `TestDb`, for the shop fixtures.
    pub fn db(&self) -> TestDb {
        TestDb {
            name: "postgres".into(),
            url: self.url.clone(),
            owned: false,
            probe: Kept::default(),
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["stop", "-m", "immediate", "-w"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A directory of SQL handlers for `--handlers-dir`, removed on drop.
pub struct HandlerDir(pub PathBuf);

impl HandlerDir {
    pub fn new(files: &[(&str, String)]) -> HandlerDir {
        let dir = std::env::temp_dir().join(unique("dw-handlers"));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        HandlerDir(dir)
    }
}

impl Drop for HandlerDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The built-in order.timeout's one-job form (without its set form, so every job runs
/// alone) with an extra CTE spliced in front (`name AS (...)`), which the `target` CTE
/// references so it runs: how a test injects failures or slowness into the real handler.
pub fn order_timeout_with(cte: &str, condition: &str) -> String {
    let sql = include_str!("../../sql/handlers/order.timeout.sql");
    let (one, _set) = sql
        .split_once("\n-- set:")
        .expect("order.timeout has a set form");
    let one = one.replacen("WITH target AS (", &format!("WITH {cte}, target AS ("), 1);
    let one = one.replacen(
        "\n    -- A payload naming both",
        &format!("\n      AND {condition}\n    -- A payload naming both"),
        1,
    );
    assert!(
        one.contains(condition),
        "the condition went into the one-job form"
    );
    one
}

/// A handler directory whose order.timeout (the one-job form alone: every job runs by
/// itself) sleeps `seconds` (an SQL expression, which may read the payload `$1`) before
/// it cancels: a slow handler.
pub fn slow_order_timeout(seconds: &str) -> HandlerDir {
    HandlerDir::new(&[(
        "order.timeout.sql",
        order_timeout_with(
            &format!("slow AS (SELECT pg_sleep({seconds}) AS s)"),
            "(SELECT true FROM slow)",
        ),
    )])
}

/// Backends of `db` matching `condition` (on `pg_stat_activity`).
fn backends(db: &TestDb, condition: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE {condition} AND datname = current_database()"
    );
    db.probe(|c| c.query_one(&sql, &[])).get(0)
}

/// Backends of `db` sleeping in a slow handler's `pg_sleep`.
pub fn sleeping(db: &TestDb) -> i64 {
    backends(db, "wait_event = 'PgSleep'")
}

/// The worker's backends on `db` (its sessions and the PostgreSQL watch's connection).
pub fn worker_backends(db: &TestDb) -> i64 {
    backends(db, "application_name = 'delay-worker'")
}

/// [`order_timeout_with`] and the built-in set form with the same CTE spliced in front,
/// which its `locked` CTE references (the condition must not use `$1`: in the set form it
/// is the array of jobs).
pub fn order_timeout_set_with(cte: &str, condition: &str) -> String {
    let sql = include_str!("../../sql/handlers/order.timeout.sql");
    let (_, set) = sql
        .split_once("\n-- set:")
        .expect("order.timeout has a set form");
    let set = set.replacen("WITH jobs AS (", &format!("WITH {cte}, jobs AS ("), 1);
    let set = set.replacen(
        "     WHERE o.status = 'pending'\n     ORDER BY o.id",
        &format!("     WHERE o.status = 'pending' AND {condition}\n     ORDER BY o.id"),
        1,
    );
    assert!(
        set.contains(condition),
        "the condition went into the set form"
    );
    format!("{}\n-- set:{set}", order_timeout_with(cte, condition))
}

/// A handler directory whose order.timeout (`handler`: [`order_timeout_with`] or
/// [`order_timeout_set_with`]) fails transiently with SQLSTATE `code` for a `rate` share of
/// its runs, and a config that retries it often and fast: a retry storm. The failures are
/// spread evenly over the statements in the order they run (a sequence counts them, and
/// a failed transaction does not undo it), so a run with few statements, a few sets, fails
/// its share too.
pub fn failing_order_timeout(
    env: &mut Env,
    rate: f64,
    code: &str,
    handler: fn(&str, &str) -> String,
) -> HandlerDir {
    env.db
        .client()
        .batch_execute(&format!(
            "CREATE SEQUENCE chaos_runs;
             CREATE FUNCTION chaos() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
             DECLARE n bigint := nextval('chaos_runs');
             BEGIN
               IF floor(n * {rate}) > floor((n - 1) * {rate}) THEN
                 RAISE EXCEPTION 'injected failure {code}' USING ERRCODE = '{code}';
               END IF;
               RETURN true;
             END $$"
        ))
        .unwrap();
    let dir = HandlerDir::new(&[(
        "order.timeout.sql",
        handler("chaos AS (SELECT chaos() AS ok)", "(SELECT ok FROM chaos)"),
    )]);
    env.config.handlers_dir = Some(dir.0.clone());
    env.config.jobs.max_retries = 12;
    env.config.jobs.retry_base = Duration::from_millis(20);
    env.config.jobs.retry_cap = Duration::from_millis(200);
    dir
}

/// Pushed = done + dead-lettered + still scheduled, and nothing stuck pending.
pub fn assert_all_accounted(env_redis: &Env, db: &TestDb, pushed: usize) {
    let b = books(env_redis);
    let done = inbox_count(db) as usize;
    assert_eq!(b.stream_pending, 0, "nothing stuck pending");
    assert_eq!(
        done + b.dead + b.pool,
        pushed,
        "pushed {pushed} = done {done} + dead {} + scheduled {}",
        b.dead,
        b.pool
    );
}

// ---- dead letters, raw stream entries, row locks ----------------------------------------

/// Every dead letter as a field map.
pub fn dead_letters(env: &Env) -> Vec<HashMap<String, String>> {
    let mut con = env.con();
    let v: Value = redis::cmd("XRANGE")
        .arg(&env.config.keys.dead)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    let mut out = Vec::new();
    if let Value::Array(entries) = v {
        for e in entries {
            if let Value::Array(pair) = e {
                if let Value::Array(f) = &pair[1] {
                    let s: Vec<String> =
                        f.iter().map(delay_worker::store::value_to_string).collect();
                    out.push(s.chunks(2).map(|c| (c[0].clone(), c[1].clone())).collect());
                }
            }
        }
    }
    out
}

pub fn xadd(env: &Env, key: &str, msg: &[u8]) {
    let mut con = env.con();
    redis::cmd("XADD")
        .arg(&env.config.keys.stream)
        .arg("*")
        .arg("msg")
        .arg(msg)
        .arg("key")
        .arg(key)
        .query::<String>(&mut con)
        .unwrap();
}

/// A shop trigger that fails every update of this order as a deadlock (SQLSTATE 40P01)
/// until told, then is dropped: contention that is no lock wait, so its job is retried for
/// `--retry-for` and then dead-lettered (a lock wait never is: [`lock_order`]).
pub fn deadlock_order(
    env: &Env,
    id: i64,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    env.db
        .client()
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION dw_test_deadlock() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN RAISE EXCEPTION 'deadlock detected (a test trigger)' USING ERRCODE = '40P01'; END $$; \
             CREATE TRIGGER dw_test_deadlock_{id} BEFORE UPDATE ON orders FOR EACH ROW \
             WHEN (OLD.id = {id}) EXECUTE FUNCTION dw_test_deadlock()"
        ))
        .unwrap();
    let url = env.db.url.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let _ = rx.recv();
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        c.batch_execute(&format!("DROP TRIGGER dw_test_deadlock_{id} ON orders"))
            .unwrap();
    });
    (tx, h)
}

/// Holds a row lock on an order so the handler hits its lock timeout.
pub fn lock_order(
    env: &Env,
    id: i64,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let url = env.db.url.clone();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let mut t = c.transaction().unwrap();
        t.execute("SELECT 1 FROM orders WHERE id = $1 FOR UPDATE", &[&id])
            .unwrap();
        ready_tx.send(()).unwrap();
        let _ = rx.recv();
        t.rollback().unwrap();
    });
    ready_rx.recv().unwrap();
    (tx, h)
}

/// Runs the `worker` binary to completion with these servers (backtraces enabled, so a
/// panic would show in the output the tests check).
pub fn run_worker(args: &[&str], redis: &str, db: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_worker"))
        .env("REDIS_URL", redis)
        .env("DATABASE_URL", db)
        .env("RUST_BACKTRACE", "1")
        .args(args)
        .output()
        .unwrap()
}

/// Process output as text.
/// The SHA-1 of `b` in hex, as Redis's `sha1hex` writes it.
pub fn sha1_hex(b: &[u8]) -> String {
    sha1_smol::Sha1::from(b).digest().to_string()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A plain HTTP GET on loopback: (status, head, body).
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    std::io::Write::write_all(
        &mut s,
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut raw = String::new();
    std::io::Read::read_to_string(&mut s, &mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, head.to_string(), body.to_string()))
}

/// Reads up to `count` new entries of the group as `consumer`, without acknowledging them;
/// their ids.
pub fn xreadgroup(
    con: &mut redis::Connection,
    keys: &delay_worker::keys::Keys,
    consumer: &str,
    count: usize,
) -> Vec<String> {
    let reply: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(&keys.group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(&keys.stream)
        .arg(">")
        .query(con)
        .unwrap();
    let mut ids = Vec::new();
    if let redis::Value::Array(streams) = reply {
        for s in streams {
            if let redis::Value::Array(parts) = s {
                if let Some(redis::Value::Array(entries)) = parts.get(1) {
                    for e in entries {
                        if let redis::Value::Array(pair) = e {
                            ids.push(delay_worker::store::value_to_string(&pair[0]));
                        }
                    }
                }
            }
        }
    }
    ids
}

/// A PostgreSQL URL for `user` on the test server (the shared server trusts local users;
/// the password is set on the role all the same, as a real deployment would).
pub fn pg_url(user: &str, password: &str, db: &str) -> String {
    let cfg: postgres::Config = admin_url().parse().expect("DW_TEST_DATABASE_URL parses");
    let host = match cfg.get_hosts().first() {
        Some(postgres::config::Host::Tcp(h)) => h.clone(),
        other => panic!("the test PostgreSQL must be reached over TCP, not {other:?}"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    format!("postgres://{user}:{password}@{host}:{port}/{db}")
}

/// The roles of one test, dropped with it (after its database).
pub struct Roles(pub Vec<String>);

impl Drop for Roles {
    fn drop(&mut self) {
        if let Ok(mut a) = postgres::Client::connect(&admin_url(), NoTls) {
            for r in &self.0 {
                let _ = a.batch_execute(&format!("DROP ROLE IF EXISTS {r}"));
            }
        }
    }
}

/// Every update of the test's orders made to take `seconds` (a trigger), so a worker stays
/// inside its transactions; [`orders_quick_again`] takes it away.
pub fn orders_slow_to_update(db: &TestDb, seconds: f64) {
    db.client()
        .batch_execute(&format!(
            "CREATE FUNCTION dw_slow() RETURNS trigger LANGUAGE plpgsql AS \
               $$BEGIN PERFORM pg_sleep({seconds}); RETURN NEW; END$$; \
             CREATE TRIGGER dw_slow BEFORE UPDATE ON orders FOR EACH ROW EXECUTE FUNCTION dw_slow()"
        ))
        .unwrap();
}

pub fn orders_quick_again(db: &TestDb) {
    db.client()
        .batch_execute("DROP TRIGGER dw_slow ON orders; DROP FUNCTION dw_slow()")
        .unwrap();
}

/// Records list message `msg` of queue `q` as fetched `fetched` times without being
/// settled, its job started `started` times after its first fetch (as the workers count
/// starts); the field of its fetch count.
pub fn fetched_and_started(
    con: &mut redis::Connection,
    q: &delay_worker::keys::Queue,
    msg: &str,
    fetched: u64,
    started: u64,
) -> String {
    let started_field = delay_worker::store::started_field(msg.as_bytes());
    let digest = started_field.trim_start_matches("started:").to_string();
    redis::cmd("HSET")
        .arg(q.deliveries())
        .arg(&digest)
        .arg(fetched)
        .arg(&started_field)
        .arg(started)
        .query::<()>(con)
        .unwrap();
    digest
}

/// What a [`delay_worker::workers::Worker`] driven by hand in a test needs, owned: a pool
/// of one PostgreSQL connection to the test's database, the handlers of `registry`, no
/// `--max-rate`, fresh stats.
pub struct WorkerParts {
    pub db: db::Pool,
    pub manners: delay_worker::manners::Manners,
    pub handlers: delay_worker::handlers::Handlers,
    pub redis: delay_worker::store::Redis,
    pub stats: delay_worker::stats::Stats,
    pub shutdown: Shutdown,
    pub drain: delay_worker::workers::Drain,
}

impl WorkerParts {
    pub fn new(env: &Env, registry: delay_worker::handlers::Registry) -> WorkerParts {
        let db = db::pool(
            &env.db.url,
            1,
            db::Timeouts {
                statement: Duration::from_secs(5),
                lock: Duration::from_millis(100),
            },
            Duration::from_secs(5),
            false,
            None,
        )
        .unwrap();
        WorkerParts {
            db,
            manners: delay_worker::manners::Manners::unlimited(32),
            handlers: delay_worker::handlers::Handlers::new(registry),
            redis: redis::Client::open(env.redis.url()).unwrap().into(),
            stats: delay_worker::stats::Stats::default(),
            shutdown: Shutdown::new(),
            drain: delay_worker::workers::Drain::default(),
        }
    }

    /// The context of a worker of consumer `c1` on `keys`, with `env`'s job settings.
    pub fn ctx<'a>(
        &'a self,
        env: &'a Env,
        keys: &'a delay_worker::keys::Keys,
    ) -> delay_worker::workers::PoolContext<'a> {
        delay_worker::workers::PoolContext {
            keys,
            claim_idle: env.config.reader.claim_idle,
            shards: std::slice::from_ref(keys),
            jobs: &env.config.jobs,
            consumer: "c1",
            handlers: &self.handlers,
            manners: &self.manners,
            stats: &self.stats,
            db: &self.db,
            redis: &self.redis,
            shutdown: &self.shutdown,
            drain: &self.drain,
        }
    }
}

/// Records stream entry `id` as delivered `delivered` times to `consumer` (XCLAIM with
/// RETRYCOUNT, its content not read), and, when given, its job as started `started`
/// times in the pool's `starts` HASH, as workers killed that often would leave it.
pub fn delivered_and_started(
    con: &mut redis::Connection,
    keys: &delay_worker::keys::Keys,
    consumer: &str,
    id: &str,
    delivered: u64,
    started: Option<u64>,
) {
    redis::cmd("XCLAIM")
        .arg(&keys.stream)
        .arg(&keys.group)
        .arg(consumer)
        .arg(0)
        .arg(id)
        .arg("RETRYCOUNT")
        .arg(delivered)
        .arg("JUSTID")
        .query::<Value>(con)
        .unwrap();
    if let Some(started) = started {
        redis::cmd("HSET")
            .arg(&keys.starts)
            .arg(id)
            .arg(started)
            .query::<()>(con)
            .unwrap();
    }
}
