//! Operating the worker: systemd notifications (readiness, watchdog, status, stopping) of
//! the real binary, the metrics and health endpoint during a run and a PostgreSQL outage,
//! the systemd unit under `systemd-analyze verify`, the install script's dry run, and
//! scripts/services.sh starting over what a cut-off start left behind.

use crate::support::*;
use std::collections::HashMap;
use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// A datagram socket standing in for systemd's notify socket.
struct NotifySocket {
    sock: UnixDatagram,
    dir: PathBuf,
}

impl NotifySocket {
    fn bind() -> NotifySocket {
        let dir =
            std::env::temp_dir().join(format!("dw-notify-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = UnixDatagram::bind(dir.join("notify")).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        NotifySocket { sock, dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("notify")
    }

    /// One datagram, or `None` after the socket's 100 ms read timeout.
    fn recv(&self) -> Option<String> {
        let mut buf = [0u8; 4096];
        match self.sock.recv(&mut buf) {
            Ok(n) => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => None,
            Err(e) => panic!("notify socket: {e}"),
        }
    }

    /// Receives datagrams until one satisfies `f` and returns it, with all received up to
    /// and including it; panics after `timeout`.
    fn until(
        &self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&str) -> bool,
    ) -> (String, Vec<String>) {
        let start = Instant::now();
        let mut seen = Vec::new();
        loop {
            assert!(
                start.elapsed() < timeout,
                "timed out waiting for {what}; got {seen:#?}"
            );
            if let Some(m) = self.recv() {
                seen.push(m.clone());
                if f(&m) {
                    return (m, seen);
                }
            }
        }
    }

    /// Everything received during `d`.
    fn collect(&self, d: Duration) -> Vec<String> {
        let start = Instant::now();
        let mut out = Vec::new();
        while start.elapsed() < d {
            out.extend(self.recv());
        }
        out
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The worker binary as a child, as support's `Proc` starts it, plus environment.
fn start_worker(env: &Env, vars: &[(&str, &str)], extra: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", &env.config.redis_url)
        .env("DATABASE_URL", &env.config.database_url)
        .env(
            "RUST_LOG",
            std::env::var("DW_CHILD_LOG").unwrap_or("warn".into()),
        )
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .args(["--consumer", &env.config.consumer])
        .args(["--threads", &env.config.threads.to_string()])
        .args(["--poll-interval", "20ms", "--block", "200ms"])
        .args(["--heartbeat-ttl", "2s", "--retry-base", "100ms"])
        .args(["--stats-interval", "1s"])
        .args(extra)
        .stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    Proc::spawn(cmd)
}

#[test]
fn ops_systemd_is_told_ready_pinged_while_live_and_told_stopping() {
    let mut env = Env::new();
    let orders = seed_orders(&env.db, 4);
    let notify = NotifySocket::bind();
    let socket = notify.path();
    let port = free_port();
    let mut worker = start_worker(
        &env,
        &[
            ("NOTIFY_SOCKET", socket.to_str().unwrap()),
            // Pings every 200 ms.
            ("WATCHDOG_USEC", "400000"),
        ],
        &["--metrics-addr", &format!("127.0.0.1:{port}")],
    );

    let (ready, _) = notify.until(WAIT, "READY=1", |m| m.contains("READY=1"));
    assert!(ready.contains("STATUS=done 0,"), "{ready}");

    push_timeouts(&env, &orders, 0);
    let (_, seen) = notify.until(WAIT, "a status with every job done", |m| {
        m.contains("STATUS=done 4,")
    });
    let pings = seen.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    assert!(pings >= 1, "no watchdog ping: {seen:#?}");
    let mut pings = 0;
    let (status, seen) = notify.until(WAIT, "two more pings", |m| {
        pings += m.contains("WATCHDOG=1") as u32;
        pings >= 2
    });
    assert!(
        status.contains("in channel 0") && status.contains("dead 0"),
        "{seen:#?}"
    );

    // Redis gone: reader and mover stop making progress, so the pings stop (systemd
    // would restart the unit after WatchdogSec) and the status says why.
    env.redis.kill();
    let (why, _) = notify.until(Duration::from_secs(30), "a not-live status", |m| {
        m.contains("not live")
    });
    assert!(why.contains("made no progress"), "{why}");
    assert!(!why.contains("WATCHDOG=1"), "{why}");
    let during = notify.collect(Duration::from_millis(1500));
    assert!(
        during.iter().all(|m| !m.contains("WATCHDOG=1")),
        "pinged during the outage: {during:#?}"
    );
    let m = samples(&http_get(port, "/metrics").unwrap().2);
    assert_eq!(m["delay_worker_live"], 0.0);
    let (code, _, why) = http_get(port, "/healthz").unwrap();
    assert!(code == 503 && why.contains("Redis"), "{code} {why}");
    env.redis.restart();
    notify.until(WAIT, "pings again after Redis came back", |m| {
        m.contains("WATCHDOG=1")
    });
    let m = samples(&http_get(port, "/metrics").unwrap().2);
    assert_eq!(m["delay_worker_live"], 1.0);
    // At least one outage each for the reader and the mover (counted once per outage,
    // not per attempt).
    let reconnects = m["delay_worker_redis_reconnects_total"];
    assert!((2.0..=4.0).contains(&reconnects), "{reconnects}");

    worker.signal(libc::SIGTERM);
    notify.until(WAIT, "STOPPING=1", |m| m.contains("STOPPING=1"));
    let status = worker.wait(WAIT);
    assert!(status.success(), "worker exited with {status}");
}

/// One HTTP/1.1 GET: status code, head, body.
/// The samples of an exposition, by `name{labels}`.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

#[test]
fn ops_metrics_count_jobs_and_healthz_follows_postgres() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 6);
    pay(&env.db, &orders[..2]);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut worker = start_worker(&env, &[], &["--metrics-addr", &addr]);
    wait_until(WAIT, "the metrics endpoint", || {
        http_get(port, "/healthz").is_ok()
    });

    push_timeouts(&env, &orders, 0);
    // One message no handler can take: a dead letter under the `_other` event.
    redis::cmd("XADD")
        .arg(&env.config.keys.stream)
        .arg("*")
        .arg("msg")
        .arg("not json")
        .arg("key")
        .arg("k-bad")
        .query::<String>(&mut env.con())
        .unwrap();
    wait_until(WAIT, "every job settled", || {
        let b = books(&env);
        inbox_count(&env.db) == 6 && b.stream_pending == 0 && b.dead == 1
    });
    // A job is counted once its settle has returned, a moment after Redis has it (a test
    // that read at once on a loaded machine saw `done` 0 with every job acknowledged).
    wait_until(WAIT, "the jobs counted", || {
        http_get(port, "/metrics").is_ok_and(|(_, _, body)| {
            let m = samples(&body);
            let n = |o: &str| {
                m.get(&format!(
                    "delay_worker_jobs_total{{event=\"order.timeout\",outcome=\"{o}\"}}"
                ))
                .copied()
                .unwrap_or(0.0)
            };
            n("done") + n("noop") >= 6.0
        })
    });

    let (code, head, body) = http_get(port, "/metrics").unwrap();
    assert_eq!(code, 200, "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let m = samples(&body);
    let v = |k: &str| {
        *m.get(k)
            .unwrap_or_else(|| panic!("no sample {k} in\n{body}"))
    };
    let jobs = |event: &str, outcome: &str| {
        v(&format!(
            "delay_worker_jobs_total{{event=\"{event}\",outcome=\"{outcome}\"}}"
        ))
    };
    assert_eq!(jobs("order.timeout", "done"), 4.0);
    assert_eq!(jobs("order.timeout", "noop"), 2.0);
    assert_eq!(jobs("order.timeout", "retry"), 0.0);
    assert_eq!(jobs("_other", "dead"), 1.0);
    // Lateness is recorded per committed job whose due time the mover wrote: all six.
    assert_eq!(v("delay_worker_lateness_seconds_count"), 6.0);
    assert_eq!(v("delay_worker_lateness_seconds_bucket{le=\"+Inf\"}"), 6.0);
    assert_eq!(
        v("delay_worker_handler_duration_seconds_count{event=\"order.timeout\"}"),
        6.0
    );
    assert!(v("delay_worker_moved_total") >= 6.0);
    assert_eq!(v("delay_worker_dead_letters_total"), 1.0);
    // The queue's own figures, read from Redis for the scrape: the letter is kept, nothing
    // is pending or due.
    assert_eq!(v("delay_worker_queue_up"), 1.0);
    assert_eq!(v("delay_worker_dead_letters"), 1.0);
    assert_eq!(v("delay_worker_dead_letters_recent"), 1.0);
    assert_eq!(v("delay_worker_stream_pending"), 0.0);
    assert_eq!(v("delay_worker_pool_due"), 0.0);
    assert_eq!(v("delay_worker_channel_depth"), 0.0);
    assert_eq!(
        v("delay_worker_channel_capacity"),
        env.config.channel_capacity() as f64
    );
    assert_eq!(
        v("delay_worker_db_pool_max_connections"),
        env.config.threads as f64
    );
    assert!(v("delay_worker_db_pool_connections") >= 1.0);
    assert_eq!(v("delay_worker_redis_reconnects_total"), 0.0);
    assert_eq!(v("delay_worker_live"), 1.0);
    assert!(v("process_resident_memory_bytes") > 1e6);

    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);
    assert_eq!(http_get(port, "/healthz").unwrap().2, "ok\n");
    assert_eq!(http_get(port, "/nope").unwrap().0, 404);

    // PostgreSQL refuses this database: the health check says so.
    set_connections(&env, false);
    let mut last = (0, String::new());
    wait_until(WAIT, "/healthz 503", || {
        let (code, _, body) = http_get(port, "/healthz").unwrap();
        last = (code, body);
        last.0 == 503
    });
    assert!(last.1.contains("PostgreSQL"), "{}", last.1);
    set_connections(&env, true);
    wait_until(WAIT, "/healthz 200 again", || {
        http_get(port, "/healthz").unwrap().0 == 200
    });

    // The metrics thread stops with the rest: a graceful exit, promptly.
    worker.signal(libc::SIGTERM);
    let status = worker.wait(Duration::from_secs(30));
    assert!(status.success(), "worker exited with {status}");
}

/// The unit file as installed, but with ExecStart pointing at the worker just built:
/// `systemd-analyze verify` fails on an ExecStart binary that does not exist, and
/// /usr/local/bin/worker does not on a build machine.
#[test]
fn ops_the_unit_passes_systemd_analyze_verify() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/worker.service"
    ))
    .unwrap();
    for line in [
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=30",
        "Restart=always",
        "User=delay-worker",
        "EnvironmentFile=/etc/delay-worker/worker.env",
        "ExecStart=/usr/local/bin/worker $WORKER_ARGS\n",
        "MemoryMax=256M",
        "CapabilityBoundingSet=\n",
    ] {
        assert!(unit.contains(line), "the unit lacks {line:?}");
    }
    let dir = std::env::temp_dir().join(format!("dw-unit-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("delay-worker.service");
    std::fs::write(
        &path,
        unit.replace(
            "ExecStart=/usr/local/bin/worker",
            &format!("ExecStart={}", env!("CARGO_BIN_EXE_worker")),
        ),
    )
    .unwrap();
    let out = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
    {
        Ok(out) => out,
        Err(e) => panic!(
            "systemd-analyze cannot run ({e}): install it with `apt-get install systemd` (scripts/services.sh install does)"
        ),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{text}"
    );
    // Unknown keys and bad values are only warnings to verify: any output fails the test.
    assert!(
        text.trim().is_empty(),
        "systemd-analyze verify warns:\n{text}"
    );
}

#[test]
fn ops_install_dry_run_prints_the_steps_and_changes_nothing() {
    let unit_dst = std::path::Path::new("/etc/systemd/system/delay-worker.service");
    let existed = unit_dst.exists();
    let out = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/install.sh"))
        .arg("--dry-run")
        .arg(env!("CARGO_BIN_EXE_worker"))
        .output()
        .expect("run bash");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "install.sh --dry-run failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in [
        "dry run",
        env!("CARGO_BIN_EXE_worker"),
        "/usr/local/bin/worker",
        "delay-worker",
        "/etc/delay-worker/worker.env",
        "/etc/systemd/system/delay-worker.service",
        "systemctl daemon-reload",
        "systemctl enable",
    ] {
        assert!(text.contains(step), "no {step:?} in:\n{text}");
    }
    // A fresh environment file is only a template: neither enabled (a reboot would
    // start it without its URLs) nor started; the last step says to do both.
    if !std::path::Path::new("/etc/delay-worker/worker.env").exists() {
        assert!(!text.contains("\n+ systemctl enable"), "{text}");
        assert!(!text.contains("\n    systemctl enable"), "{text}");
        assert!(
            text.contains("then: systemctl enable --now delay-worker.service"),
            "{text}"
        );
    }
    assert_eq!(unit_dst.exists(), existed, "a dry run installed the unit");
    let bad = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/install.sh"))
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown option --bogus"));
}

/// `scripts/services.sh` with a run directory and ports of the test's own.
fn services(run_dir: &std::path::Path, redis: u16, pg: u16, args: &[&str]) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services.sh"))
        .args(args)
        .env("DW_RUN_DIR", run_dir)
        .env("DW_REDIS_PORT", redis.to_string())
        .env("DW_PG_PORT", pg.to_string())
        .stdin(Stdio::null());
    cmd
}

/// What a start cut off mid-initdb leaves (a data directory holding files but no
/// PG_VERSION), and a memory directory of an earlier run that outlived its run directory,
/// do not stop the next start: it makes a new cluster. Three starts at once serialize on a
/// lock and all find the one pair of servers, which answer; stop ends both.
#[test]
fn ops_services_start_over_a_half_made_cluster_and_concurrent_starts_share_one() {
    let run_dir = std::env::temp_dir().join(format!("dw-services-{}", free_port()));
    let (redis, pg) = (free_port(), free_port());
    let shm = std::path::PathBuf::from(format!("/dev/shm/delay-worker-pg-{pg}"));
    struct Cleanup(Vec<std::path::PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for d in &self.0 {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let _cleanup = Cleanup(vec![run_dir.clone(), shm.clone()]);
    // An init cut off: files, no PG_VERSION.
    std::fs::create_dir_all(run_dir.join("pg/base")).unwrap();
    std::fs::write(run_dir.join("pg/postgresql.conf"), "# half written\n").unwrap();
    let run = |args: &[&str]| {
        let out = services(&run_dir, redis, pg, args).output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let stop = || {
        let _ = services(&run_dir, redis, pg, &["stop"]).output();
    };
    let starts: Vec<_> = (0..3)
        .map(|_| {
            services(&run_dir, redis, pg, &["start"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = starts
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let texts: Vec<String> = outs
        .iter()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .collect();
    let all_ok = outs.iter().all(|o| o.status.success());
    if !all_ok {
        stop();
    }
    assert!(all_ok, "a start failed:\n{}", texts.join("\n---\n"));
    let all = texts.join("\n");
    assert_eq!(
        all.matches("holds no finished cluster").count(),
        1,
        "the half-made cluster is replaced once:\n{all}"
    );
    assert!(run_dir.join("pg/PG_VERSION").exists(), "{all}");
    let (ok, status) = run(&["status"]);
    let url = format!("host=127.0.0.1 port={pg} user=postgres dbname=delay_worker");
    let answer = postgres::Client::connect(&url, postgres::NoTls)
        .and_then(|mut c| c.query_one("SELECT 1 + 1", &[]))
        .map(|row| row.get::<_, i32>(0));
    stop();
    assert!(
        ok && status.contains(&format!("redis: up on {redis}"))
            && status.contains(&format!("postgresql: up on {pg}")),
        "{status}"
    );
    assert_eq!(answer.ok(), Some(2), "the new cluster's database answers");

    // A --fast start whose run directory is new while /dev/shm kept an earlier run's files
    // for the same port.
    std::fs::remove_dir_all(&run_dir).unwrap();
    std::fs::create_dir_all(shm.join("base")).unwrap();
    std::fs::write(shm.join("PG_VERSION"), "15\n").unwrap();
    let (ok, text) = run(&["start", "--fast"]);
    let (_, status) = run(&["status"]);
    stop();
    assert!(ok, "{text}");
    assert!(
        status.contains(&format!("postgresql: up on {pg}")),
        "{status}"
    );
    let (_, status) = run(&["status"]);
    assert!(
        status.contains("redis: down") && status.contains("postgresql: down"),
        "stop left a server running:\n{status}"
    );
}
