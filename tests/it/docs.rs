//! The README's quick start, run as written against a redis-server and a PostgreSQL database
//! of the test's own: every block marked `<!-- quick-start -->` in order, its `worker ...`
//! lines by the shell with the built binary first in PATH and the test's `REDIS_URL` and
//! `DATABASE_URL` (the `export` lines name them), the daemon line (ending in `&`) as a child
//! stopped by SIGTERM at the end, the status page's address moved to a free port, and the
//! PHP block with `php` (Debian's php-cli and php-redis, as tests/it/php.rs) against the
//! test's Redis. Then the pushed order is cancelled once, and `/healthz` and the status page
//! answer. A line the test does not know how to run fails it, so the quick start and this
//! test change together.

use crate::quick_start::{self, Block};
use crate::support::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The status page's address in the quick start.
const METRICS_ADDR: &str = "127.0.0.1:9187";
/// The Redis address of the PHP block's `connect`.
const PHP_CONNECT: &str = "'127.0.0.1', 6379)";

struct Run {
    redis: RedisServer,
    db: TestDb,
    metrics_port: u16,
    path: String,
    daemon: Option<Proc>,
}

impl Run {
    fn shell(&self, line: &str) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(line)
            .current_dir(ROOT)
            .env("PATH", &self.path)
            .env("REDIS_URL", self.redis.url())
            .env("DATABASE_URL", &self.db.url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        cmd
    }

    fn sh(&mut self, block: &Block) {
        for line in quick_start::code(block) {
            if let Some(var) = line.strip_prefix("export ") {
                let name = var.split('=').next().unwrap();
                assert!(
                    name == "REDIS_URL" || name == "DATABASE_URL",
                    "quick start line {line:?}: the test sets only REDIS_URL and DATABASE_URL"
                );
                continue;
            }
            assert!(
                line.starts_with("worker "),
                "quick start line {line:?}: not a `worker` command, which this test runs"
            );
            let line = line.replace(METRICS_ADDR, &format!("127.0.0.1:{}", self.metrics_port));
            if let Some(daemon) = line.strip_suffix('&') {
                assert!(self.daemon.is_none(), "two daemons in the quick start");
                let cmd = self.shell(&format!("exec {}", daemon.trim()));
                self.daemon = Some(Proc::spawn(cmd));
                wait_until(Duration::from_secs(30), "the daemon's /healthz", || {
                    matches!(http_get(self.metrics_port, "/healthz"), Ok((200, _, _)))
                });
                continue;
            }
            let out = self.shell(&line).output().unwrap();
            assert!(
                out.status.success(),
                "quick start line {line:?} exited {:?}:\n{}{}",
                out.status.code(),
                text(&out.stdout),
                text(&out.stderr)
            );
            if line.trim() == "worker migrate" {
                // The shop's own order, as the quick start assumes one.
                self.db
                    .client()
                    .batch_execute("INSERT INTO orders (order_no) VALUES ('SO1')")
                    .unwrap();
            }
        }
    }

    fn php(&self, block: &Block) {
        let code = block.lines.join("\n");
        assert!(
            code.contains(PHP_CONNECT),
            "the PHP block no longer connects with {PHP_CONNECT}"
        );
        let code = code.replace(PHP_CONNECT, &format!("'127.0.0.1', {})", self.redis.port));
        let file = std::env::temp_dir().join(format!(
            "dw-quick-start-{}-{}.php",
            std::process::id(),
            free_port()
        ));
        std::fs::write(&file, code).unwrap();
        let out = Command::new("php")
            .arg(&file)
            .current_dir(ROOT)
            .output()
            .unwrap_or_else(|e| {
                panic!("php cannot run ({e}): scripts/test.sh installs php-cli and php-redis")
            });
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "the quick start's PHP failed:\n{}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
}

#[test]
fn the_readme_quick_start_runs_as_written() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let blocks = quick_start::blocks(&readme);
    assert!(
        blocks.iter().any(|b| b.lang == "php") && blocks.iter().any(|b| b.lang == "sh"),
        "the quick start has a sh and a php block"
    );
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_worker")).parent().unwrap();
    let mut run = Run {
        redis: RedisServer::start(),
        db: TestDb::empty(),
        metrics_port: free_port(),
        path: format!(
            "{}:{}",
            bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        ),
        daemon: None,
    };
    for b in &blocks {
        match b.lang.as_str() {
            "sh" => run.sh(b),
            "php" => run.php(b),
            other => panic!("README.md line {}: a quick-start block in {other}", b.line),
        }
    }
    assert!(run.daemon.is_some(), "the quick start starts no daemon");

    let status = |db: &TestDb| -> String {
        db.client()
            .query_one("SELECT status FROM orders WHERE order_no = 'SO1'", &[])
            .unwrap()
            .get(0)
    };
    wait_until(Duration::from_secs(60), "order SO1 cancelled", || {
        status(&run.db) == "cancelled"
    });
    let inbox: i64 = run
        .db
        .client()
        .query_one(
            "SELECT count(*) FROM worker_inbox WHERE job_key = 'order.timeout:SO1'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        inbox, 1,
        "one job for the key pushed from PHP and from the shell"
    );
    let (code, _, body) = http_get(run.metrics_port, "/").unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, _, body) = http_get(run.metrics_port, "/healthz").unwrap();
    assert_eq!(code, 200, "{body}");

    let mut daemon = run.daemon.take().unwrap();
    daemon.signal(libc::SIGTERM);
    let exit = daemon.wait(Duration::from_secs(30));
    assert_eq!(exit.code(), Some(0), "{}", daemon.log());
}
