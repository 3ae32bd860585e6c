//! TLS to both servers, and the one line the worker says when a server cannot be reached,
//! refuses the handshake, refuses the login, or accepts the connection and never answers.
//!
//! Fixtures: a CA, a server certificate (localhost, 127.0.0.1) and a client certificate
//! (CN `certuser`) made with the `openssl` tool, plus a second CA that signed nothing here;
//! a redis-server with a TLS port next to its plain one (the plain one serves the test's
//! own fixtures); one private PostgreSQL cluster with `ssl=on`, shared by this module's
//! tests while any of them runs: `postgres` logs in without a password, `certuser` only
//! over TLS with its client certificate, `pwuser` with a SCRAM password.

use crate::support::*;
use delay_worker::db;
use postgres::NoTls;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

static DIRS: AtomicU32 = AtomicU32::new(0);

/// The certificates, in a directory of their own, removed on drop.
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "dw-pki-{}-{}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pki = Pki { dir };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        for (name, cn) in [("ca", "dw-test-ca"), ("other", "dw-other-ca")] {
            pki.openssl(
                &["req", "-x509"],
                &ec,
                &[
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.crt"),
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
        }
        let leaves = [
            (
                "server",
                "localhost",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            ),
            ("client", "certuser", "extendedKeyUsage=clientAuth\n"),
        ];
        for (serial, (name, cn, ext)) in leaves.into_iter().enumerate() {
            std::fs::write(
                pki.dir.join(format!("{name}.ext")),
                format!("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n{ext}"),
            )
            .unwrap();
            pki.openssl(
                &["req"],
                &ec,
                &[
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                    "-subj",
                    &format!("/CN={cn}"),
                ],
            );
            pki.openssl(
                &["x509", "-req"],
                &[],
                &[
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-set_serial",
                    &(serial + 2).to_string(),
                    "-days",
                    "2",
                    "-out",
                    &format!("{name}.crt"),
                    "-extfile",
                    &format!("{name}.ext"),
                ],
            );
        }
        // PostgreSQL reads its key only if its own user owns it, mode 0600.
        std::fs::copy(pki.dir.join("server.key"), pki.dir.join("pg-server.key")).unwrap();
        let chmod = Command::new("chmod")
            .arg("600")
            .arg(pki.dir.join("pg-server.key"))
            .status();
        assert!(chmod.unwrap().success());
        if unsafe { libc::geteuid() } == 0 {
            let chown = Command::new("chown")
                .arg("postgres:postgres")
                .arg(pki.dir.join("pg-server.key"))
                .status();
            assert!(chown.unwrap().success());
        }
        pki
    }

    fn openssl(&self, cmd: &[&str], key: &[&str], args: &[&str]) {
        let out = Command::new("openssl")
            .args(cmd)
            .args(key)
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("the openssl tool is not installed (Debian: apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {cmd:?}: {}",
            text(&out.stderr)
        );
    }

    /// The full path of one of the files.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The module's PostgreSQL with TLS, and its certificates. The server is stopped before
/// the files go (fields drop in order).
struct Shared {
    pg: PgServer,
    pki: Pki,
}

/// The one shared cluster, started by the first test that asks and stopped when the last
/// test holding it ends.
fn shared() -> Arc<Shared> {
    static SLOT: Mutex<Weak<Shared>> = Mutex::new(Weak::new());
    let mut slot = SLOT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = slot.upgrade() {
        return s;
    }
    let pki = Pki::new();
    let hba = pki.dir.join("pg_hba.conf");
    std::fs::write(
        &hba,
        "local all all trust\n\
         hostssl all certuser 127.0.0.1/32 cert\n\
         host all pwuser 127.0.0.1/32 scram-sha-256\n\
         host all postgres 127.0.0.1/32 trust\n",
    )
    .unwrap();
    let pg = PgServer::start(&[
        "-c ssl=on",
        &format!("-c ssl_cert_file={}", pki.path("server.crt")),
        &format!("-c ssl_key_file={}", pki.path("pg-server.key")),
        &format!("-c ssl_ca_file={}", pki.path("ca.crt")),
        &format!("-c hba_file={}", hba.display()),
    ]);
    postgres::Client::connect(&pg.url, NoTls)
        .unwrap()
        .batch_execute(
            "CREATE ROLE certuser LOGIN SUPERUSER; \
             SET password_encryption = 'scram-sha-256'; \
             CREATE ROLE pwuser LOGIN SUPERUSER PASSWORD 'right-horse'",
        )
        .unwrap();
    let s = Arc::new(Shared { pg, pki });
    *slot = Arc::downgrade(&s);
    s
}

impl Shared {
    /// A URL to the shared cluster as `user`, with query settings `q` (`{ca}`, `{other}`,
    /// `{cert}`, `{key}` stand for the files).
    fn url(&self, user: &str, q: &str) -> String {
        format!(
            "postgres://{user}@127.0.0.1:{}/postgres?{}",
            self.pg.port,
            self.files(q)
        )
    }

    fn files(&self, s: &str) -> String {
        s.replace("{ca}", &self.pki.path("ca.crt"))
            .replace("{other}", &self.pki.path("other.crt"))
            .replace("{cert}", &self.pki.path("client.crt"))
            .replace("{key}", &self.pki.path("client.key"))
    }
}

/// A redis-server with a TLS port (`--tls-auth-clients` as given) next to its plain one.
fn tls_redis(pki: &Pki, auth_clients: &str) -> (RedisServer, u16) {
    let port = free_port();
    let r = RedisServer::start_with(&[
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        &pki.path("server.crt"),
        "--tls-key-file",
        &pki.path("server.key"),
        "--tls-ca-cert-file",
        &pki.path("ca.crt"),
        "--tls-auth-clients",
        auth_clients,
    ]);
    (r, port)
}

/// Exit code `code` and one line on stderr, `worker: ...` containing `want`.
pub fn assert_line(out: &Output, code: i32, want: &str) -> String {
    let err = text(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    assert_eq!(lines.len(), 1, "one line expected: {err}");
    assert!(
        lines[0].starts_with("worker: ") && lines[0].contains(want),
        "expected {want:?} in: {err}"
    );
    lines[0].to_string()
}

/// Runs `cmd` to its end and returns its output; fails the test if it runs longer than
/// `cap` (a hang, not a slow machine: the cap is generous).
pub fn output_within(mut cmd: Command, cap: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the worker binary");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > cap {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {cap:?}; stderr so far: {}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn worker_cmd(args: &[&str], redis: &str, db: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_worker"));
    c.env("REDIS_URL", redis)
        .env("DATABASE_URL", db)
        .env("RUST_LOG", "warn")
        .env_remove("REDIS_CA_FILE")
        .env_remove("REDIS_CERT_FILE")
        .env_remove("REDIS_KEY_FILE")
        .args(args);
    c
}

fn run(args: &[&str], redis: &str, db: &str) -> Output {
    output_within(worker_cmd(args, redis, db), Duration::from_secs(60))
}

#[test]
fn the_order_story_runs_over_tls_to_both_servers() {
    let s = shared();
    let (redis, tls_port) = tls_redis(&s.pki, "yes");
    let db = s.pg.db();
    let mut config = delay_worker::Config::new(&redis.url(), &db.url);
    config.threads = 3;
    config.consumer = "tls".into();
    let env = Env { redis, db, config };

    // The worker sees only TLS: Redis by host name (DNS name in the certificate), with a
    // client certificate; PostgreSQL by address (IP name), verify-full, logged in by its
    // client certificate (pg_hba: hostssl ... cert).
    let mut wcfg = env.config.clone();
    wcfg.redis_url = format!("rediss://localhost:{tls_port}/");
    wcfg.database_url = s.url(
        "certuser",
        "sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}",
    );
    let redis_tls = [
        "--redis-ca-file".to_string(),
        s.pki.path("ca.crt"),
        "--redis-cert-file".into(),
        s.pki.path("client.crt"),
        "--redis-key-file".into(),
        s.pki.path("client.key"),
    ];
    let flags: Vec<&str> = redis_tls.iter().map(String::as_str).collect();

    let out = run(&["migrate"], &wcfg.redis_url, &wcfg.database_url);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "schema is current");

    let orders = seed_orders(&env.db, 24);
    pay(&env.db, &orders[..8]);
    push_timeouts(&env, &orders, 0);
    let metrics = free_port();
    let mut extra = redis_tls.to_vec();
    extra.extend(["--metrics-addr".into(), format!("127.0.0.1:{metrics}")]);
    let mut w = Proc::start(&wcfg, &extra);
    wait_until(Duration::from_secs(60), "every job done over TLS", || {
        inbox_count(&env.db) == orders.len() as i64
    });

    // Every connection of the worker is encrypted: PostgreSQL says so per backend, and
    // Redis lists the worker's clients on its TLS port (the fixtures use the plain one).
    let mut c = env.db.client();
    let row = c
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = 'certuser' AND a.application_name = 'delay-worker'",
            &[],
        )
        .unwrap();
    let (tls, plain): (i64, i64) = (row.get(0), row.get(1));
    assert!(tls >= 1 && plain == 0, "TLS {tls}, plain {plain}");
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut env.con())
        .unwrap();
    let on_tls = clients
        .lines()
        .filter(|l| l.contains(&format!("laddr=127.0.0.1:{tls_port} ")))
        .count();
    assert!(on_tls >= 2, "the worker's Redis clients: {clients}");

    // The health check opens its own connections, over TLS as well.
    let (code, _, body) = http_get(metrics, "/healthz").unwrap();
    assert_eq!(code, 200, "{body}");

    // An admin command over TLS with the same flags.
    let mut stats = vec!["stats", "--json"];
    stats.extend(&flags);
    let out = run(&stats, &wcfg.redis_url, &wcfg.database_url);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    w.signal(libc::SIGTERM);
    assert_eq!(
        w.wait(Duration::from_secs(30)).code(),
        Some(0),
        "{}",
        w.log()
    );
    let unpaid: Vec<&SeedOrder> = orders[8..].iter().collect();
    assert_accounting(&env.db, &orders, &unpaid);
    assert_all_accounted(&env, &env.db, orders.len());
}

#[test]
fn postgres_sslmodes_mean_what_libpq_means() {
    let s = shared();
    let wrong_host = |q: &str| {
        format!(
            "postgres://postgres@wrong.example:{}/postgres?hostaddr=127.0.0.1&{}",
            s.pg.port,
            s.files(q)
        )
    };
    let kv = s.files(&format!(
        "host=127.0.0.1 port={} user=certuser dbname=postgres sslmode = 'verify-full' \
         sslrootcert='{{ca}}' sslcert={{cert}} sslkey={{key}}",
        s.pg.port
    ));
    // (connection string, Ok(encrypted) or Err(part of the error line))
    let cases: Vec<(String, Result<bool, &str>)> = vec![
        (s.url("postgres", "sslmode=disable"), Ok(false)),
        // No sslmode: prefer, and this server offers TLS.
        (s.url("postgres", ""), Ok(true)),
        // require without a root certificate: encrypted, the certificate not checked.
        (s.url("postgres", "sslmode=require"), Ok(true)),
        // require with one: the chain is checked, as verify-ca.
        (
            s.url("postgres", "sslmode=require&sslrootcert={other}"),
            Err("TLS handshake failed: certificate signed by unknown authority"),
        ),
        (s.url("postgres", "sslmode=verify-ca&sslrootcert={ca}"), Ok(true)),
        (
            s.url("postgres", "sslmode=verify-ca&sslrootcert={other}"),
            Err("certificate signed by unknown authority (give the CA that signed the server's certificate with sslrootcert)"),
        ),
        // verify-ca checks the chain only; verify-full the host name too.
        (wrong_host("sslmode=verify-ca&sslrootcert={ca}"), Ok(true)),
        (
            wrong_host("sslmode=verify-full&sslrootcert={ca}"),
            Err("TLS handshake failed: the server's certificate is not valid for wrong.example (it names localhost, 127.0.0.1)"),
        ),
        (s.url("postgres", "sslmode=verify-full&sslrootcert={ca}"), Ok(true)),
        (
            s.url("postgres", "sslmode=verify-full&sslrootcert={other}"),
            Err("certificate signed by unknown authority"),
        ),
        // Client-certificate login (pg_hba `cert`), in both forms of the string.
        (
            s.url("certuser", "sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}"),
            Ok(true),
        ),
        (kv, Ok(true)),
        (
            s.url("certuser", "sslmode=verify-full&sslrootcert={ca}"),
            Err("connection requires a valid client certificate (28000)"),
        ),
    ];
    for (url, want) in cases {
        match (db::connect(&url), want) {
            (Ok(mut c), Ok(encrypted)) => {
                let ssl: bool = c
                    .query_one(
                        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                        &[],
                    )
                    .unwrap()
                    .get(0);
                assert_eq!(ssl, encrypted, "{url}");
            }
            (Err(e), Err(part)) => {
                let line = e.to_string();
                assert!(
                    line.starts_with("cannot reach PostgreSQL at ") && line.contains(part),
                    "{url}: expected {part:?} in {line}"
                );
            }
            (got, want) => panic!("{url}: expected {want:?}, got {:?}", got.err()),
        }
    }

    // Settings that cannot work are bad input, said before any connection.
    for (q, part) in [
        (
            "sslmode=verify-full",
            "sslrootcert: sslmode=verify-full needs sslrootcert=<CA file>",
        ),
        ("sslmode=allow", "sslmode: \"allow\" is not one of"),
        (
            "sslmode=require&sslrootcert=/nonexistent/ca.pem",
            "sslrootcert: cannot read /nonexistent/ca.pem",
        ),
        (
            "sslmode=require&sslrootcert={key}",
            "holds no PEM certificate",
        ),
        (
            "sslmode=require&sslcert={cert}",
            "sslkey: sslcert needs sslkey too",
        ),
        (
            "sslmode=require&sslrootcert=system&password=x",
            "sslrootcert: system needs sslmode=verify-full",
        ),
    ] {
        match db::Target::parse(&s.url("postgres", q)) {
            Err(e @ db::DbError::BadTls(_)) => {
                assert!(e.to_string().contains(part), "{q}: {e}")
            }
            Err(e) => panic!("{q}: not a TLS setting error: {e}"),
            Ok(_) => panic!("{q}: accepted"),
        }
    }
}

#[test]
fn a_refused_handshake_or_login_is_one_readable_line() {
    let s = shared();
    let (_redis, tls_port) = tls_redis(&s.pki, "yes");
    let pg_ok = s.url("postgres", "sslmode=disable");
    let rediss = format!("rediss://localhost:{tls_port}/");
    let ca = s.pki.path("ca.crt");

    // Redis: no CA given (the system's store does not know ours), then no client
    // certificate for a server that requires one.
    let out = run(&["cancel", "--key", "k"], &rediss, &pg_ok);
    assert_line(
        &out,
        1,
        &format!("cannot reach Redis at {rediss}: TLS handshake failed: certificate signed by unknown authority (give the CA that signed the server's certificate with --redis-ca-file)"),
    );
    let out = run(
        &["cancel", "--key", "k", "--redis-ca-file", &ca],
        &rediss,
        &pg_ok,
    );
    assert_line(
        &out,
        1,
        "TLS handshake failed: the server requires a client certificate",
    );

    // `#insecure`: encrypted without checking the certificate, and said so at start.
    let (crt, key) = (s.pki.path("client.crt"), s.pki.path("client.key"));
    let client_cert = ["--redis-cert-file", &crt, "--redis-key-file", &key];
    let mut args = vec!["cancel", "--key", "k"];
    args.extend(client_cert);
    let out = run(&args, &format!("{rediss}#insecure"), &pg_ok);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "no scheduled job k");
    assert!(
        text(&out.stderr).contains("#insecure: the Redis server's certificate is not checked"),
        "{}",
        text(&out.stderr)
    );

    // PostgreSQL: verify-full to a name the certificate does not carry.
    let wrong = format!(
        "postgres://postgres@wrong.example:{}/postgres?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={ca}",
        s.pg.port
    );
    let out = run(&["migrate"], &rediss, &wrong);
    assert_line(
        &out,
        1,
        "cannot reach PostgreSQL at postgres://postgres@wrong.example",
    );
    assert!(text(&out.stderr).contains("is not valid for wrong.example"));

    // A wrong password says so (SCRAM, over TLS), and is never shown; the right one logs in.
    let login = |pw: &str| {
        format!(
            "postgres://pwuser:{pw}@127.0.0.1:{}/postgres?sslmode=require",
            s.pg.port
        )
    };
    let out = run(&["migrate"], &rediss, &login("wrong-horse"));
    assert_line(
        &out,
        1,
        "password authentication failed for user \"pwuser\" (28P01)",
    );
    assert!(!text(&out.stderr).contains("wrong-horse"));
    let out = run(&["migrate"], &rediss, &login("right-horse"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    // Files that cannot work are bad input (exit 2), named as given.
    let out = run(
        &[
            "cancel",
            "--key",
            "k",
            "--redis-ca-file",
            "/nonexistent/ca.pem",
        ],
        &rediss,
        &pg_ok,
    );
    assert_line(&out, 2, "--redis-ca-file: cannot read /nonexistent/ca.pem");
    let out = output_within(
        {
            let mut c = worker_cmd(&["cancel", "--key", "k"], "redis://127.0.0.1:1/", &pg_ok);
            c.env("REDIS_CA_FILE", &ca);
            c
        },
        Duration::from_secs(60),
    );
    assert_line(
        &out,
        2,
        "REDIS_CA_FILE: is for TLS, but the Redis URL does not start with rediss://",
    );
    let out = run(
        &["migrate"],
        &rediss,
        &s.url(
            "postgres",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        ),
    );
    assert_line(
        &out,
        2,
        "DATABASE_URL: sslrootcert: cannot read /nonexistent/ca.pem",
    );
}

/// A TCP listener that accepts every connection and never writes a byte, until dropped.
struct SilentServer {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentServer {
    fn start() -> SilentServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((s, _)) => held.push(s),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        SilentServer {
            port,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn a_postgres_that_accepts_and_never_answers_is_given_up_on() {
    let silent = SilentServer::start();
    let redis = RedisServer::start();
    let url = format!("postgres://shop:hunter2@127.0.0.1:{}/shop", silent.port);
    // Both at once: each waits out the handshake deadline.
    let migrate = std::thread::spawn({
        let (r, u) = (redis.url(), url.clone());
        move || run(&["migrate"], &r, &u)
    });
    let daemon = run(&["run", "--threads", "1"], &redis.url(), &url);
    let migrate = migrate.join().unwrap();
    for out in [migrate, daemon] {
        let line = assert_line(
            &out,
            1,
            "cannot reach PostgreSQL at postgres://shop:***@127.0.0.1",
        );
        assert!(
            line.contains(
                "timed out: the server accepted the connection but did not answer within 5s"
            ),
            "{line}"
        );
        assert!(!line.contains("hunter2"), "{line}");
    }
}
