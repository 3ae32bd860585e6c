//! The metrics endpoint of the real binary under clients that connect and stall: `/healthz`
//! and `/metrics` still answer, a stalled client is dropped within the request deadline,
//! oversized requests are refused, a POST is told the methods a path takes, SIGTERM still
//! ends the worker at once, and a non-loopback `--metrics-addr` is warned about.

use crate::support::*;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Generous: the test fails instead of hanging, it does not measure.
const PROMPT: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(60);

/// The worker binary with `--metrics-addr addr`, logging at `warn` to its own file.
fn start(env: &Env, addr: &str) -> Proc {
    Proc::spawn(command(env, addr))
}

/// The command [`start`] runs. glibc's malloc settings are left to the worker: nothing of
/// `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES` comes from the test's own environment.
fn command(env: &Env, addr: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", &env.config.redis_url)
        .env("DATABASE_URL", &env.config.database_url)
        .env("RUST_LOG", "warn")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("MALLOC_ARENA_MAX")
        .env_remove("GLIBC_TUNABLES")
        .args(["--consumer", "c1", "--threads", "2", "--metrics-addr", addr])
        .stdin(Stdio::null());
    cmd
}

/// The malloc arenas (glibc) a process has besides the main one, from its memory map: each
/// lives in a reservation of its own, 64 MiB long and aligned to 64 MiB, mapped read-write
/// as far as it is used (`rw-p`) and inaccessible (`---p`) from there to its end.
fn arena_heaps(pid: u32) -> usize {
    const HEAP_MAX: u64 = 64 << 20;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    // (start, end, permissions, anonymous)
    let areas: Vec<(u64, u64, String, bool)> = maps
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (lo, hi) = f[0].split_once('-').unwrap();
            let addr = |a| u64::from_str_radix(a, 16).unwrap();
            (addr(lo), addr(hi), f[1].to_string(), f.len() == 5)
        })
        .collect();
    areas
        .windows(2)
        .filter(|w| {
            let (used, rest) = (&w[0], &w[1]);
            // The read-write part may have merged with an area just below the reservation.
            used.3
                && rest.3
                && used.2 == "rw-p"
                && rest.2 == "---p"
                && used.1 == rest.0
                && rest.1 % HEAP_MAX == 0
                && used.0 <= rest.1 - HEAP_MAX
        })
        .count()
}

/// 48 clients sending 10 requests each to `/metrics`, all at once: far more than the
/// connection threads. The status code of each, or why there was none.
fn flood(port: u16) -> Vec<Result<u16, String>> {
    let flood: Vec<_> = (0..48)
        .map(|_| {
            std::thread::spawn(move || {
                let mut codes = Vec::new();
                for _ in 0..10 {
                    let got = exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n");
                    codes.push(got.map(|r| r.0).map_err(|e| e.to_string()));
                }
                codes
            })
        })
        .collect();
    flood.into_iter().flat_map(|t| t.join().unwrap()).collect()
}

/// Sends `request` and reads the whole answer; an error if it takes longer than
/// [`PROMPT`] in all. Returns (status, head, body).
fn exchange(port: u16, request: &[u8]) -> std::io::Result<(u16, String, String)> {
    let start = Instant::now();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, PROMPT)?;
    s.set_read_timeout(Some(PROMPT))?;
    s.set_write_timeout(Some(PROMPT))?;
    s.write_all(request)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    if start.elapsed() > PROMPT {
        return Err(std::io::Error::new(
            ErrorKind::TimedOut,
            "answered too late",
        ));
    }
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, head.to_string(), body.to_string()))
}

fn get(port: u16, path: &str) -> (u16, String, String) {
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    exchange(port, req.as_bytes())
        .unwrap_or_else(|e| panic!("GET {path}: no answer within {PROMPT:?}: {e}"))
}

/// `n` connections that send `first` (maybe nothing) and then nothing more.
fn stallers(port: u16, n: usize, first: &[u8]) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(first).unwrap();
            s
        })
        .collect()
}

/// Every staller was let go by the server: its read ends (an answer, end of stream or a
/// reset) instead of waiting. Returns how many got a `408`.
fn all_let_go(conns: Vec<TcpStream>) -> usize {
    let mut timed_out = 0;
    for mut s in conns {
        s.set_read_timeout(Some(PROMPT)).unwrap();
        let mut got = Vec::new();
        match s.read_to_end(&mut got) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("a stalled client was held: {e}"),
        }
        if got.starts_with(b"HTTP/1.1 408") {
            timed_out += 1;
        }
    }
    timed_out
}

#[test]
fn metrics_endpoint_answers_while_clients_stall_and_stops_promptly() {
    let env = Env::new();
    let port = free_port();
    let mut worker = start(&env, &format!("127.0.0.1:{port}"));
    wait_until(WAIT, "the metrics endpoint", || {
        exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n").is_ok_and(|r| r.0 == 200)
    });

    // 50 clients that send one byte and stall, 10 that send nothing: far more than the
    // connection threads. Health and metrics still answer, on the first try.
    let mut stalled = stallers(port, 50, b"G");
    stalled.extend(stallers(port, 10, b""));
    // Stalled: a connection is closed to make room once it has sent no whole request for
    // 250 ms (one that has just connected may be a request about to be read).
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (code, _, body) = get(port, "/healthz");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    let (code, head, body) = get(port, "/metrics");
    assert_eq!(code, 200, "{head}");
    assert!(body.contains("\ndelay_worker_live 1\n"), "{body}");
    // And the stallers are let go: none holds a connection for long.
    all_let_go(stalled);

    // Fewer stallers than connection threads: each is answered 408 at the deadline.
    let late = stallers(port, 3, b"GET /metrics HTTP/1.1\r\n");
    assert_eq!(all_let_go(late), 3);

    // Size limits and methods.
    let big = format!(
        "GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    assert_eq!(exchange(port, big.as_bytes()).unwrap().0, 431);
    let post = b"POST /metrics HTTP/1.1\r\nContent-Length: 100000\r\n\r\n";
    assert_eq!(exchange(port, post).unwrap().0, 413);
    let (code, head, _) = exchange(
        port,
        b"POST /healthz HTTP/1.1\r\nContent-Length: 3\r\n\r\na=1",
    )
    .unwrap();
    assert_eq!(code, 405);
    assert!(head.contains("Allow: GET, HEAD"), "{head}");
    assert_eq!(exchange(port, b"garbage\r\n\r\n").unwrap().0, 400);
    assert_eq!(get(port, "/nope").0, 404);
    let (code, head, body) = exchange(port, b"HEAD /healthz HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!((code, body.as_str()), (200, ""), "{head}");
    assert!(head.contains("Content-Length: 3"), "{head}");

    // Loopback: no warning about authentication.
    assert!(
        !worker.log().contains("not a loopback address"),
        "{}",
        worker.log()
    );

    // SIGTERM with clients stalled on the endpoint: a graceful exit, promptly.
    let _held = (stallers(port, 20, b"G"), stallers(port, 5, b""));
    worker.signal(libc::SIGTERM);
    let status = worker.wait(Duration::from_secs(15));
    assert!(status.success(), "worker exited with {status}");

    // All interfaces: the same endpoint, and a warning at start.
    let port = free_port();
    let mut worker = start(&env, &format!("0.0.0.0:{port}"));
    wait_until(WAIT, "the metrics endpoint on 0.0.0.0", || {
        exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n").is_ok_and(|r| r.0 == 200)
    });
    let log = worker.log();
    assert!(
        log.contains(&format!(
            "--metrics-addr 0.0.0.0:{port} is not a loopback address"
        )),
        "{log}"
    );
    worker.signal(libc::SIGTERM);
    let status = worker.wait(Duration::from_secs(15));
    assert!(status.success(), "worker exited with {status}");
}

/// Clients that send part of a request or nothing, stall, and reconnect the moment they
/// are closed (or refused) keep every connection slot younger than the 250 ms after which
/// a staller makes room. A probe that sends its whole request still takes a staller's slot: every
/// probe is answered `200`.
#[test]
fn reconnecting_stallers_never_starve_a_probe() {
    let env = Env::new();
    let port = free_port();
    let mut worker = start(&env, &format!("127.0.0.1:{port}"));
    wait_until(WAIT, "the metrics endpoint", || {
        exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n").is_ok_and(|r| r.0 == 200)
    });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stallers: Vec<_> = (0..30)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut connections = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
                        continue;
                    };
                    connections += 1;
                    if i % 3 != 0 {
                        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ");
                    }
                    // Held until the server closes it (made room, refused, or 408).
                    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
                    let mut sink = [0u8; 512];
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match s.read(&mut sink) {
                            Ok(0) => break,
                            Ok(_) => {}
                            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                            Err(e) if e.kind() == ErrorKind::TimedOut => {}
                            Err(_) => break,
                        }
                    }
                }
                connections
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let codes: Vec<u16> = (0..20)
        .map(|i| {
            std::thread::sleep(Duration::from_millis(50));
            let path = if i % 2 == 0 { "/healthz" } else { "/metrics" };
            get(port, path).0
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let connections: usize = stallers.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(codes, [200; 20], "after {connections} staller connections");
    assert!(connections > 30, "the stallers reconnected: {connections}");
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
}

/// A flood of whole requests, far more than the connection threads: each gets an answer,
/// `200` or `503 busy`, never a connection closed unanswered. The connection threads, like
/// every thread of the worker, allocate from the process's two malloc arenas, unless the
/// operator sets `MALLOC_ARENA_MAX`.
#[test]
fn a_flood_of_whole_requests_gets_answers_never_an_empty_reply() {
    let env = Env::new();
    let port = free_port();
    let mut worker = start(&env, &format!("127.0.0.1:{port}"));
    wait_until(WAIT, "the metrics endpoint", || {
        exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n").is_ok_and(|r| r.0 == 200)
    });
    let codes = flood(port);
    let answered = codes
        .iter()
        .filter(|c| matches!(c, Ok(200) | Ok(503)))
        .count();
    assert_eq!(
        answered,
        codes.len(),
        "{:?}",
        codes
            .iter()
            .filter(|c| !matches!(c, Ok(200) | Ok(503)))
            .collect::<Vec<_>>()
    );
    assert!(codes.iter().any(|c| matches!(c, Ok(200))));
    // Roles, pool helpers and some 40 connection threads later: two arenas, the main one
    // and one more (main.rs).
    assert_eq!(arena_heaps(worker.child.id()), 1);
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());

    // The operator's MALLOC_ARENA_MAX is glibc's to apply: with 8, the threads spread over
    // arenas of their own (and the count above sees them).
    let port = free_port();
    let mut cmd = command(&env, &format!("127.0.0.1:{port}"));
    cmd.env("MALLOC_ARENA_MAX", "8");
    let mut worker = Proc::spawn(cmd);
    wait_until(WAIT, "the metrics endpoint", || {
        exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n").is_ok_and(|r| r.0 == 200)
    });
    assert!(flood(port).iter().any(|c| matches!(c, Ok(200))));
    let heaps = arena_heaps(worker.child.id());
    assert!(
        (1..=7).contains(&heaps),
        "{heaps} arenas besides the main one"
    );
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
}
