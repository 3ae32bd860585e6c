//! The status page of the real binary, looked at in headless Chromium (Debian's
//! `chromium`; `scripts/test.sh` installs it, and without it these tests fail rather
//! than skip): the figures a person reads match `worker stats --json` of the same
//! servers, the chart has the points of the jobs this run did, a dead letter holding
//! HTML and script shows as text, the forms are there only with `--admin-token-file`,
//! and a requeue through the page needs the token (the letter then goes back and is
//! done once, the books exact), a purge too. List mode's dead lists over plain HTTP,
//! and page loads while Redis stalls: bounded, and never in the way of `/healthz`.
//! With `--shards 3` the dead-letter pages merge the shards' letters, page through them
//! and act on each letter's own shard.
//! Few browser launches (each costs a second or two): five in one test, one in another.

use crate::support::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);
const TOKEN: &str = "3f9c2a61d0b84e7a9c55e1f0b2d4c6a8";
const HOSTILE_EVENT: &str = "<img src=x onerror=alert(2)>";
const HOSTILE_NOTE: &str = "<script>alert(1)</script>";
const HOSTILE_KEY: &str = "<b>hostile</b>";

// ---- the browser --------------------------------------------------------------------------

fn chromium() -> PathBuf {
    let found = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("chromium"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin/chromium")])
        .find(|p| p.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "chromium is not installed, and the status page tests need a real browser: \
             scripts/test.sh installs it (as root: apt-get install chromium)"
        )
    })
}

/// Runs headless Chromium on `url` with `args` and a fresh profile; fails the test if it
/// does not finish within a minute or exits with an error.
fn browser(args: &[String], url: &str) -> Output {
    let profile = crate::support::scratch_dir().join(format!(
        "dw-chromium-{}-{}",
        std::process::id(),
        crate::support::free_port()
    ));
    std::fs::create_dir_all(&profile).unwrap();
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = stdout.read_to_end(&mut b);
        b
    });
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > WAIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish with {url} within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = reader.join().unwrap();
    let mut stderr = Vec::new();
    let _ = child.stderr.take().unwrap().read_to_end(&mut stderr);
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        status.success(),
        "chromium {args:?} {url}: {status}\n{}",
        text(&stderr)
    );
    Output {
        status,
        stdout,
        stderr,
    }
}

/// The DOM of `url` after Chromium has parsed and laid it out.
fn dom(url: &str) -> String {
    let out = browser(&["--dump-dom".into()], url);
    let dom = text(&out.stdout);
    assert!(dom.contains("</html>"), "no page from {url}: {dom}");
    dom
}

/// A screenshot of `url` at `width` x `height`; returns the PNG's own size.
fn screenshot(url: &str, file: &Path, width: u32, height: u32) -> (u32, u32) {
    let _ = std::fs::remove_file(file);
    browser(
        &[
            format!("--screenshot={}", file.display()),
            format!("--window-size={width},{height}"),
        ],
        url,
    );
    let png = std::fs::read(file).expect("chromium wrote the screenshot");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

// ---- reading the DOM ------------------------------------------------------------------------

/// Text as a person reads it: tags dropped, entities decoded.
fn plain(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&nbsp;", " ")
        .replace("&amp;", "&")
}

/// The text of the first element at or after `from` whose start tag holds `attr`
/// (`data-k="pool.size"`), and where it ends.
fn text_at(dom: &str, from: usize, attr: &str) -> Option<(String, usize)> {
    let at = from + dom[from..].find(attr)?;
    let open = dom[..at].rfind('<')?;
    let name: String = dom[open + 1..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let body = at + dom[at..].find('>')? + 1;
    let close = body + dom[body..].find(&format!("</{name}>"))?;
    Some((plain(&dom[body..close]).trim().to_string(), close))
}

fn figure(dom: &str, key: &str) -> String {
    text_at(dom, 0, &format!("data-k=\"{key}\""))
        .unwrap_or_else(|| panic!("no figure {key} on the page:\n{dom}"))
        .0
}

/// Every value of attribute `name` in the DOM, in order.
fn attr_values(dom: &str, name: &str) -> Vec<String> {
    let needle = format!(" {name}=\"");
    dom.match_indices(&needle)
        .map(|(i, _)| {
            let v = &dom[i + needle.len()..];
            v[..v.find('"').unwrap()].to_string()
        })
        .collect()
}

/// A figure of `worker stats --json` as the page writes it: `?` for null.
fn json_figure(v: &serde_json::Value, path: &str) -> String {
    let mut x = v;
    for p in path.split('.') {
        x = &x[p];
    }
    match x {
        serde_json::Value::Null => "?".into(),
        other => other.to_string(),
    }
}

// ---- the worker ------------------------------------------------------------------------------

/// The worker binary on `port`, logging at info to its own file (shown only on failure).
fn start(env: &Env, consumer: &str, port: u16, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    cmd.env("REDIS_URL", &env.config.redis_url)
        .env("DATABASE_URL", &env.config.database_url)
        .env("RUST_LOG", "info")
        .env_remove("NOTIFY_SOCKET")
        .args(["--consumer", consumer, "--threads", "2"])
        .args([
            "--poll-interval",
            "20ms",
            "--block",
            "200ms",
            "--heartbeat-ttl",
            "2s",
        ])
        .args(["--retry-base", "100ms", "--stats-interval", "60s"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(extra)
        .stdin(Stdio::null());
    let p = Proc::spawn(cmd);
    wait_until(WAIT, "the status page to answer", || {
        http_get(port, "/healthz").is_ok_and(|r| r.0 == 200)
    });
    p
}

/// A token file of mode `mode` in a directory of its own.
fn token_file(mode: u32, body: &str) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("dw-token-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("admin.token");
    std::fs::write(&file, body).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
    (dir, file)
}

/// A POST of form fields (already encoded) with extra headers: (status, body).
fn post(port: u16, path: &str, body: &str, headers: &[(&str, String)]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_string())
}

fn form(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                        (b as char).to_string()
                    }
                    b => format!("%{b:02X}"),
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The dead-letter ids in the stream, oldest first.
fn dead_ids(env: &Env) -> Vec<String> {
    let mut con = env.con();
    let v: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&env.config.keys.dead)
        .arg("-")
        .arg("+")
        .query(&mut con)
        .unwrap();
    v.into_iter().map(|(id, _)| id).collect()
}

/// A counter of `/metrics`, summed over its labels.
fn metric(port: u16, name: &str) -> u64 {
    let (_, _, body) = http_get(port, "/metrics").unwrap();
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[test]
fn status_page_in_a_browser_stream_mode() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 12);
    // One order's handler fails as a deadlock (a shop trigger) until its retries are used
    // up: a dead letter that goes through once the trigger is gone.
    let (release, locker) = deadlock_order(&env, orders[0].id);
    push_timeouts(&env, &orders, 0);
    {
        let mut con = env.con();
        let now = delay_worker::now_ms();
        let job = delay_worker::producer::NewJob {
            event: HOSTILE_EVENT.into(),
            payload: serde_json::json!({ "note": HOSTILE_NOTE, "html": "<i>x</i> & \"y\"" }),
            due_ms: now,
            key: Some(HOSTILE_KEY.into()),
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
    let (token_dir, token) = token_file(0o600, &format!("{TOKEN}\n"));
    let port = free_port();
    let mut worker = start(
        &env,
        "c1",
        port,
        &[
            "--admin-token-file",
            token.to_str().unwrap(),
            "--statement-timeout",
            "150ms",
            "--max-retries",
            "1",
            // Contention dead-letters only once --retry-for has passed too.
            "--retry-for",
            "0",
        ],
    );
    wait_until(WAIT, "11 orders done and two dead letters", || {
        let b = books(&env);
        inbox_count(&env.db) == 11 && b.dead == 2 && b.pool == 0 && b.stream_pending == 0
    });
    let base = format!("http://127.0.0.1:{port}");

    // The overview, as the browser has it, against `worker stats --json` of the same
    // servers at the same (quiescent) moment.
    let page = dom(&format!("{base}/"));
    let out = run_worker(
        &["stats", "--json"],
        &env.config.redis_url,
        &env.config.database_url,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "stream.length",
        "group.lag",
        "group.entries_read",
        "group.pending",
        "pool.size",
        "pool.due",
        "pool.due_seconds",
        "pool.due_ms",
        "dead.length",
        "dead.new",
    ] {
        assert_eq!(figure(&page, key), json_figure(&stats, key), "{key}");
    }
    assert_eq!(figure(&page, "dead.length"), "2");
    assert_eq!(figure(&page, "group.pending"), "0");
    let consumers = stats["consumers"].as_array().unwrap();
    assert_eq!(consumers.len(), 1, "{stats}");
    let row = page.find("data-consumer=\"c1\"").expect("a row for c1");
    assert_eq!(
        text_at(&page, row, "data-k=\"pending\"").unwrap().0,
        consumers[0]["pending"].to_string()
    );
    assert_eq!(
        text_at(&page, row, "data-k=\"heartbeat\"").unwrap().0,
        "alive"
    );
    assert_eq!(consumers[0]["heartbeat"], true);
    // This process's last hour: the jobs of this run, and the chart drawn from them.
    assert_eq!(figure(&page, "hour.committed"), "11");
    assert_eq!(figure(&page, "hour.dead"), "2");
    assert_eq!(figure(&page, "hour.retried"), "1");
    assert!(
        figure(&page, "hour.p99").starts_with('≤'),
        "a lateness was recorded"
    );
    let svg = &page[page.find("<svg").expect("an inline SVG chart")..];
    let points = attr_values(svg, "points");
    let line = points.first().expect("a polyline");
    assert_eq!(line.split(' ').count(), 60, "one point per minute: {line}");
    let ys: Vec<f64> = line
        .split(' ')
        .map(|p| p.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert!(
        ys.iter().any(|y| *y != ys[0]),
        "the line rises where jobs ran: {line}"
    );
    let sum = |name: &str| -> u64 {
        attr_values(svg, name)
            .iter()
            .map(|v| v.parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(
        sum("data-committed"),
        11,
        "the chart's points hold this run's jobs"
    );
    assert_eq!(sum("data-dead"), 2);
    assert!(
        page.contains("<title>"),
        "each point says its figures on hover"
    );
    assert!(!page.contains("Read-only"), "actions are on with the token");

    // A screenshot at a phone's width: the page renders there (the picture in docs/operating.md is
    // made the same way).
    let shot = std::env::temp_dir().join(format!("dw-status-{port}.png"));
    let (w, h) = screenshot(&format!("{base}/"), &shot, 412, 1200);
    assert_eq!((w, h), (412, 1200));
    let _ = std::fs::remove_file(&shot);

    // The dead letters, newest first: the hostile one as text, with the requeue form.
    let list = dom(&format!("{base}/dead"));
    let ids = dead_ids(&env);
    assert_eq!(ids.len(), 2);
    let rows = attr_values(&list, "data-letter");
    let mut newest_first = ids.clone();
    newest_first.reverse();
    assert_eq!(rows, newest_first, "newest first");
    let shown = plain(&list);
    assert!(shown.contains(HOSTILE_EVENT), "{shown}");
    assert!(shown.contains(HOSTILE_KEY), "{shown}");
    assert!(!list.contains("<img") && !list.contains("<script") && !list.contains("<b>"));
    assert!(list.contains("action=\"/dead/requeue\""), "{list}");
    let nonce = attr_values(&list, "value")
        .into_iter()
        .find(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .expect("the form's nonce");
    assert!(list.contains(&format!("name=\"nonce\" value=\"{nonce}\"")));
    // The filter by event.
    let filtered = http_get(port, "/dead?event=order.timeout").unwrap().2;
    assert_eq!(attr_values(&filtered, "data-letter").len(), 1, "{filtered}");
    // Ids Redis would refuse are the request's fault; nothing is older than 0-0.
    let big = "99999999999999999999999-0";
    for (path, code) in [
        (format!("/dead?before={big}"), 400),
        ("/dead?before=1-99999999999999999999".to_string(), 400),
        (format!("/dead/letter?id={big}"), 400),
        ("/dead?before=%2B".to_string(), 400),
        ("/dead?before=0-0".to_string(), 200),
        ("/dead/letter?id=0-0".to_string(), 404),
    ] {
        let (got, _, page) = http_get(port, &path).unwrap();
        assert_eq!(got, code, "{path}: {page}");
        assert!(attr_values(&page, "data-letter").is_empty(), "{path}");
    }

    // The hostile letter in full: its message pretty-printed, every byte of it text.
    let dead = dead_letters(&env);
    let hostile = ids
        .iter()
        .zip(&dead)
        .find(|(_, d)| d["event"] == HOSTILE_EVENT)
        .map(|(id, _)| id.clone())
        .unwrap();
    let order_letter = ids.iter().find(|id| **id != hostile).unwrap().clone();
    let letter = dom(&format!("{base}/dead/letter?id={hostile}"));
    assert!(
        !letter.contains("<script") && !letter.contains("<img") && !letter.contains("<i>"),
        "no element came from the letter:\n{letter}"
    );
    assert_eq!(figure(&letter, "event"), HOSTILE_EVENT);
    assert_eq!(figure(&letter, "key"), HOSTILE_KEY);
    assert!(figure(&letter, "reason").contains(HOSTILE_EVENT));
    let msg = figure(&letter, "msg");
    assert!(
        msg.contains(&format!("\"note\": \"{HOSTILE_NOTE}\"")),
        "pretty-printed, as text: {msg}"
    );
    assert!(msg.contains(r#""html": "<i>x</i> & \"y\"""#), "{msg}");
    assert!(msg.lines().count() > 5, "one field a line: {msg}");

    // A second worker without the token: the same pages, read-only, no form; a POST with
    // the right token is refused there all the same.
    let ro_port = free_port();
    let mut ro = start(&env, "c2", ro_port, &["--no-mover"]);
    let ro_list = dom(&format!("http://127.0.0.1:{ro_port}/dead"));
    assert_eq!(attr_values(&ro_list, "data-letter").len(), 2);
    assert!(
        !ro_list.contains("<form method=\"post\"")
            && !ro_list.contains("type=\"password\"")
            && !ro_list.contains("type=\"checkbox\""),
        "{ro_list}"
    );
    assert!(plain(&ro_list).contains("Read-only"), "the page says so");
    let body = form(&[("id", &order_letter), ("token", TOKEN), ("nonce", &nonce)]);
    assert_eq!(post(ro_port, "/dead/requeue", &body, &[]).0, 403);
    ro.signal(libc::SIGTERM);
    assert!(ro.wait(WAIT).success());
    assert!(ro
        .log()
        .contains("refused POST /dead/requeue: the page is read-only"));

    // Refused: no token, a wrong one, the right token without this page's nonce, from
    // another origin. Nothing changes.
    let origin = ("Origin", base.clone());
    for (why, body, headers) in [
        (
            "no token",
            form(&[("id", &order_letter), ("nonce", &nonce)]),
            vec![origin.clone()],
        ),
        (
            "wrong token",
            form(&[
                ("id", &order_letter),
                ("nonce", &nonce),
                ("token", "3f9c2a61d0b84e7a9c55e1f0b2d4c6a9"),
            ]),
            vec![origin.clone()],
        ),
        (
            "wrong bearer",
            form(&[("id", &order_letter)]),
            vec![("Authorization", "Bearer not-the-token-at-all".to_string())],
        ),
        (
            "the right bearer with a wrong form token",
            form(&[("id", &order_letter), ("token", "not-the-token-at-all")]),
            vec![("Authorization", format!("Bearer {TOKEN}"))],
        ),
        (
            "stale nonce",
            form(&[
                ("id", &order_letter),
                ("nonce", "00112233445566778899aabbccddeeff"),
                ("token", TOKEN),
            ]),
            vec![origin.clone()],
        ),
        (
            "other origin",
            form(&[("id", &order_letter), ("nonce", &nonce), ("token", TOKEN)]),
            vec![("Origin", "http://evil.example".to_string())],
        ),
        (
            "other referer",
            form(&[("id", &order_letter), ("nonce", &nonce), ("token", TOKEN)]),
            vec![("Referer", "http://evil.example/page".to_string())],
        ),
    ] {
        let (code, said) = post(port, "/dead/requeue", &body, &headers);
        assert_eq!(code, 403, "{why}: {said}");
        let (code, _) = post(port, "/dead/purge", &body, &headers);
        assert_eq!(code, 403, "{why}");
    }
    assert_eq!(dead_ids(&env), ids, "nothing changed");
    assert_eq!(inbox_count(&env.db), 11);
    let log = worker.log();
    assert!(
        log.contains("status page: refused a requeue: wrong admin token"),
        "{log}"
    );
    assert!(
        log.contains("status page: refused a purge: no admin token"),
        "{log}"
    );

    // The fix, then the requeue as the form sends it: the letter goes back, is done once.
    release.send(()).unwrap();
    locker.join().unwrap();
    let body = form(&[("nonce", &nonce), ("id", &order_letter), ("token", TOKEN)]);
    let (code, said) = post(
        port,
        "/dead/requeue",
        &body,
        &[origin.clone(), ("Referer", format!("{base}/dead"))],
    );
    assert_eq!(code, 200, "{said}");
    assert_eq!(figure(&said, "done"), "Requeued 1 dead letter(s)");
    assert!(figure(&said, "requeued").contains(&order_letter), "{said}");
    wait_until(WAIT, "the requeued order done", || {
        let b = books(&env);
        inbox_count(&env.db) == 12 && b.pool == 0 && b.stream_pending == 0
    });
    assert_eq!(dead_ids(&env), vec![hostile.clone()]);
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    // The same form again: the letter is gone, nothing goes back twice.
    let (code, said) = post(port, "/dead/requeue", &body, std::slice::from_ref(&origin));
    assert_eq!(code, 200);
    assert!(
        plain(&said).contains(&format!(
            "No such dead letter (requeued or purged by someone else, or never there): {order_letter}"
        )),
        "{said}"
    );
    assert!(
        !worker.log().contains("requeued 0 dead letter"),
        "nothing requeued, no line saying so: {}",
        worker.log()
    );
    assert_eq!(
        metric(
            port,
            "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"duplicate\"}"
        ),
        0
    );
    // Counted once the worker has its settle call's answer, a moment after Redis has it.
    wait_until(WAIT, "12 done in /metrics", || {
        metric(
            port,
            "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"done\"}",
        ) == 12
    });

    // A requeue of a letter that would die again at once (no handler for its event) is
    // refused, with why, and changes nothing: the same refusal as `worker dead requeue`.
    let (code, said) = post(
        port,
        "/dead/requeue",
        &form(&[("id", &hostile)]),
        &[("Authorization", format!("Bearer {TOKEN}"))],
    );
    assert_eq!(code, 200, "{said}");
    assert!(
        plain(&said).contains(&format!(
            "Refused {hostile}, it would die again at once: no handler for event"
        )),
        "{said}"
    );
    assert_eq!(dead_ids(&env), vec![hostile.clone()]);

    // A purge with the token in a header (no form, no nonce; the scheme in lower case, as
    // RFC 7235 allows): the hostile letter goes.
    let (code, said) = post(
        port,
        "/dead/purge",
        &form(&[("id", &hostile)]),
        &[("Authorization", format!("bearer {TOKEN}"))],
    );
    assert_eq!(code, 200, "{said}");
    assert!(plain(&said).contains("Purged 1 dead letter(s)"), "{said}");
    assert!(dead_ids(&env).is_empty());
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    assert_eq!(inbox_count(&env.db), 12);

    let log = worker.log();
    assert!(
        log.contains(&format!(
            "status page: requeued 1 dead letter(s) of mq:dead-letter: {order_letter}"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "status page: purged 1 dead letter(s) of mq:dead-letter: {hostile}"
        )),
        "{log}"
    );
    assert!(!log.contains(TOKEN), "the token is never logged");
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
    let _ = std::fs::remove_dir_all(token_dir);
}

#[test]
fn status_page_list_mode_dead_lists() {
    let env = Env::new();
    let (token_dir, token) = token_file(0o400, TOKEN);
    let port = free_port();
    let layout = ["--source", "list", "--queues", "high,normal"];
    let mut args: Vec<&str> = layout.to_vec();
    args.extend(["--admin-token-file", token.to_str().unwrap()]);
    let mut worker = start(&env, "c1", port, &args);
    // A producer's direct push of an event no handler has: dead-lettered onto normal:dead.
    let msg = serde_json::json!({
        "event": HOSTILE_EVENT, "payload": { "note": HOSTILE_NOTE }, "ts": delay_worker::now_ms() / 1000
    })
    .to_string();
    let mut con = env.con();
    redis::cmd("LPUSH")
        .arg("normal")
        .arg(&msg)
        .query::<()>(&mut con)
        .unwrap();
    let dead_len = |con: &mut redis::Connection| -> u64 {
        redis::cmd("LLEN").arg("normal:dead").query(con).unwrap()
    };
    wait_until(WAIT, "the letter on normal:dead", || {
        dead_len(&mut con) == 1
    });

    // The queue figures are `worker stats --json`'s.
    let (code, _, page) = http_get(port, "/").unwrap();
    assert_eq!(code, 200);
    let mut stats_args = vec!["stats", "--json"];
    stats_args.extend(layout);
    let out = run_worker(&stats_args, &env.config.redis_url, &env.config.database_url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for q in stats["queues"].as_array().unwrap() {
        let name = q["name"].as_str().unwrap();
        let row = page
            .find(&format!("data-queue=\"{name}\""))
            .unwrap_or_else(|| panic!("a row for {name}: {page}"));
        for k in ["length", "dead", "dead_new"] {
            assert_eq!(
                text_at(&page, row, &format!("data-k=\"{k}\"")).unwrap().0,
                q[k].to_string(),
                "{name} {k}"
            );
        }
    }

    // The dead list of one queue, the letter in full, as text.
    let (code, _, list) = http_get(port, "/dead?queue=normal").unwrap();
    assert_eq!(code, 200, "{list}");
    let ids = attr_values(&list, "data-letter");
    assert_eq!(ids.len(), 1, "{list}");
    assert!(!list.contains("<img") && plain(&list).contains(HOSTILE_EVENT));
    let nonce = attr_values(&list, "value")
        .into_iter()
        .find(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .expect("the form's nonce");
    let (code, _, letter) = http_get(
        port,
        &format!("/dead/letter?queue=normal&id={}&at=0", ids[0]),
    )
    .unwrap();
    assert_eq!(code, 200, "{letter}");
    assert!(!letter.contains("<script"));
    assert!(figure(&letter, "msg").contains(HOSTILE_NOTE));
    let (_, _, other) = http_get(port, "/dead?queue=high").unwrap();
    assert!(attr_values(&other, "data-letter").is_empty());
    // Another queue's dead list of the wrong type: this queue's page still shows its
    // letter, and that queue's page names the key Redis refused.
    redis::cmd("SET")
        .arg("high:dead")
        .arg("x")
        .query::<()>(&mut con)
        .unwrap();
    let (code, _, list) = http_get(port, "/dead?queue=normal").unwrap();
    assert_eq!(
        (code, attr_values(&list, "data-letter")),
        (200, ids.clone())
    );
    let (code, _, other) = http_get(port, "/dead?queue=high").unwrap();
    assert_eq!(code, 503, "{other}");
    assert!(
        plain(&other).contains("Redis refused") && plain(&other).contains("high:dead"),
        "{other}"
    );
    redis::cmd("DEL")
        .arg("high:dead")
        .query::<()>(&mut con)
        .unwrap();

    // Requeue through the form: its event still has no handler, so it would only die
    // again: refused, with why, and left where it is.
    let origin = ("Origin", format!("http://127.0.0.1:{port}"));
    let body = form(&[
        ("queue", "normal"),
        ("at", "0"),
        ("id", &ids[0]),
        ("nonce", &nonce),
    ]);
    assert_eq!(
        post(port, "/dead/requeue", &body, std::slice::from_ref(&origin)).0,
        403,
        "no token"
    );
    assert_eq!(metric(port, "delay_worker_dead_letters_total"), 1);
    let body = form(&[
        ("queue", "normal"),
        ("at", "0"),
        ("id", &ids[0]),
        ("nonce", &nonce),
        ("token", TOKEN),
    ]);
    let (code, said) = post(port, "/dead/requeue", &body, std::slice::from_ref(&origin));
    assert_eq!(code, 200, "{said}");
    assert!(plain(&said).contains("Requeued 0 dead letter(s)"), "{said}");
    assert!(
        plain(&said).contains(&format!(
            "Refused {}, it would die again at once: no handler for event",
            ids[0]
        )),
        "{said}"
    );
    assert_eq!(dead_len(&mut con), 1);
    assert_eq!(metric(port, "delay_worker_dead_letters_total"), 1);

    // Purge it.
    let (_, _, list) = http_get(port, "/dead?queue=normal").unwrap();
    let ids = attr_values(&list, "data-letter");
    let body = form(&[
        ("queue", "normal"),
        ("id", &ids[0]),
        ("nonce", &nonce),
        ("token", TOKEN),
    ]);
    let (code, said) = post(port, "/dead/purge", &body, &[origin]);
    assert_eq!(code, 200, "{said}");
    assert!(plain(&said).contains("Purged 1 dead letter(s)"), "{said}");
    assert_eq!(dead_len(&mut con), 0);
    // Redis stalls (CLIENT PAUSE): a page waits for it at most its Redis timeout, one is
    // made at a time with three more waiting, the others are told so at once, and /healthz
    // still finds a connection thread and gives its own verdict.
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(4000)
        .arg("ALL")
        .query::<()>(&mut con)
        .unwrap();
    let loads: Vec<_> = (0..20)
        .map(|_| std::thread::spawn(move || http_get(port, "/")))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (_, _, health) = http_get(port, "/healthz").unwrap();
    assert!(!health.starts_with("busy"), "{health}");
    let answers: Vec<(u16, String)> = loads
        .into_iter()
        .map(|h| {
            let (code, _, body) = h.join().unwrap().unwrap();
            (code, body)
        })
        .collect();
    let busy = answers
        .iter()
        .filter(|(c, b)| *c == 503 && b.contains("the status page is busy"))
        .count();
    let made: Vec<&String> = answers
        .iter()
        .filter(|(c, _)| *c == 200)
        .map(|(_, b)| b)
        .collect();
    assert!(busy >= 1 && made.len() <= 4, "{answers:?}");
    assert!(
        made.iter()
            .any(|p| plain(p).contains("Cannot read the queue figures")),
        "the first page waited for Redis and says so: {made:?}"
    );
    for page in made {
        // Died once: its requeue above was refused, so it did not go round again.
        assert_eq!(figure(page, "hour.dead"), "1", "the process's own figures");
    }
    redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query::<()>(&mut con)
        .unwrap();
    assert_eq!(http_get(port, "/").unwrap().0, 200);

    let log = worker.log();
    assert!(
        log.contains("status page: requeue of normal:dead left 1 letter(s)")
            && log.contains("(refused: no handler for event"),
        "{log}"
    );
    assert!(
        log.contains("status page: purged 1 dead letter(s) of normal:dead"),
        "{log}"
    );
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
    let _ = std::fs::remove_dir_all(token_dir);
}

#[test]
fn admin_token_file_must_be_private_and_needs_the_metrics_address() {
    let (dir, open) = token_file(0o644, &format!("{TOKEN}\n"));
    let redis = "redis://127.0.0.1:1/";
    let db = "postgres://postgres@127.0.0.1:1/none";
    let path = open.to_str().unwrap();
    let out = run_worker(
        &["--metrics-addr", "127.0.0.1:9", "--admin-token-file", path],
        redis,
        db,
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr),
        format!(
            "worker: --admin-token-file: {path} is open to group or others (mode 0644): `chmod 600 {path}` (or 400), owned by the user the worker runs as\n"
        )
    );
    // Private, but another user's: that user could change the token.
    let (dir3, foreign) = token_file(0o600, &format!("{TOKEN}\n"));
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    let fpath = foreign.to_str().unwrap();
    let out = run_worker(
        &["--metrics-addr", "127.0.0.1:9", "--admin-token-file", fpath],
        redis,
        db,
    );
    assert_eq!(out.status.code(), Some(2));
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        text(&out.stderr),
        format!(
            "worker: --admin-token-file: {fpath} is owned by uid 65534, not by the user the worker runs as (uid {euid}) or root: `chown {euid} {fpath}`\n"
        )
    );
    let _ = std::fs::remove_dir_all(dir3);
    let (dir2, private) = token_file(0o600, "short\n");
    let out = run_worker(
        &[
            "--metrics-addr",
            "127.0.0.1:9",
            "--admin-token-file",
            private.to_str().unwrap(),
        ],
        redis,
        db,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("at least 16 are needed"),
        "{}",
        text(&out.stderr)
    );
    let out = run_worker(
        &["--admin-token-file", private.to_str().unwrap()],
        redis,
        db,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("needs --metrics-addr"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(dir2);
}

/// The `Older →` link of a dead-letter page, as a path.
fn older_link(page: &str) -> Option<String> {
    let at = page.find("Older →")?;
    let href = page[..at].rfind("href=\"")? + "href=\"".len();
    let end = href + page[href..].find('"')?;
    Some(page[href..end].replace("&amp;", "&"))
}

/// Every letter id of `/dead` (with `query`) over all its pages, following `Older →`,
/// and the number of pages.
fn walk_dead(port: u16, query: &str) -> (Vec<String>, usize) {
    let mut path = format!("/dead{query}");
    let mut ids = Vec::new();
    for pages in 1.. {
        let (code, _, page) = http_get(port, &path).unwrap();
        assert_eq!(code, 200, "{path}: {page}");
        ids.extend(attr_values(&page, "data-letter"));
        match older_link(&page) {
            Some(next) => path = next,
            None => return (ids, pages),
        }
        assert!(pages < 20, "no end of pages");
    }
    unreachable!()
}

/// With `--shards 3` the dead-letter pages show every shard's letters merged newest first,
/// ids written `<shard>/<id>` as `worker dead list --json` writes them, the total and each
/// shard's count; paging (with and without an event filter) passes every letter exactly
/// once however the shards' ids tie or interleave; a letter's page takes `<shard>/<id>` or
/// a bare id held by one shard; a requeue through the form acts on its shard (the job
/// runs once, the books exact) and a purge with ids of two shards deletes just those.
#[test]
fn status_page_dead_letters_of_shards() {
    use delay_worker::keys::{shard_of, Keys};
    let env = Env::new();
    let shards = Keys::default().sharded("mq", 3);
    let key_of = |o: &SeedOrder| format!("order.timeout:{}", o.order_no);
    let orders = seed_orders(&env.db, 12);
    let stuck = orders
        .iter()
        .find(|o| shard_of(key_of(o).as_bytes(), 3) == 2)
        .expect("an order of shard 2")
        .clone();
    let mut con = env.con();

    // Letters written with ids of the past: shards 0 and 1 the same ids, shard 2 ids in
    // between and some in the same milliseconds with a higher sequence.
    let t0 = delay_worker::now_ms() - 600_000;
    let letter = |con: &mut redis::Connection, shard: usize, id: &str, event: &str| {
        redis::cmd("XADD")
            .arg(&shards[shard].dead)
            .arg(id)
            .arg("msg")
            .arg(format!(r#"{{"event":"{event}","payload":{{}}}}"#))
            .arg("reason")
            .arg("written by the test")
            .arg("event")
            .arg(event)
            .arg("key")
            .arg(format!("{event}:{shard}:{id}"))
            .query::<String>(con)
            .unwrap();
    };
    for j in 0..40 {
        let ms = t0 + 2 * j;
        letter(&mut con, 0, &format!("{ms}-0"), "paging.a");
        letter(&mut con, 1, &format!("{ms}-0"), "paging.a");
        if j % 4 == 0 {
            letter(&mut con, 2, &format!("{ms}-5"), "paging.b");
        }
        letter(&mut con, 2, &format!("{}-0", ms + 1), "paging.b");
    }
    // Letters the worker makes: an order whose handler fails as a deadlock until a trigger goes
    // (shard 2), a message that is not JSON in shards 0 and 1, and one of HTML and script.
    let (release, locker) = deadlock_order(&env, stuck.id);
    let now = delay_worker::now_ms();
    for o in &orders {
        let job = delay_worker::producer::NewJob {
            event: "order.timeout".into(),
            payload: serde_json::json!({ "order_no": o.order_no }),
            due_ms: now,
            key: Some(key_of(o)),
        };
        let keys = &shards[shard_of(key_of(o).as_bytes(), 3)];
        delay_worker::producer::push(&mut con, keys, &job, now).unwrap();
    }
    for i in [0, 1] {
        delay_worker::store::push(&mut con, &shards[i], &format!("bad-{i}"), "not json", now)
            .unwrap();
    }
    let hostile = delay_worker::producer::NewJob {
        event: HOSTILE_EVENT.into(),
        payload: serde_json::json!({ "note": HOSTILE_NOTE }),
        due_ms: now,
        key: Some(HOSTILE_KEY.into()),
    };
    let hostile_shard = shard_of(HOSTILE_KEY.as_bytes(), 3);
    delay_worker::producer::push(&mut con, &shards[hostile_shard], &hostile, now).unwrap();

    let (token_dir, token) = token_file(0o600, TOKEN);
    let port = free_port();
    let mut worker = start(
        &env,
        "c1",
        port,
        &[
            "--shards",
            "3",
            "--admin-token-file",
            token.to_str().unwrap(),
            "--statement-timeout",
            "150ms",
            "--max-retries",
            "1",
            // Contention dead-letters only once --retry-for has passed too.
            "--retry-for",
            "0",
        ],
    );
    let quiet = |con: &mut redis::Connection, dead: usize| {
        let books: Vec<Books> = shards.iter().map(|k| books_on(con, k)).collect();
        books.iter().all(|b| b.pool == 0 && b.stream_pending == 0)
            && books.iter().map(|b| b.dead).sum::<usize>() == dead
    };
    wait_until(WAIT, "11 orders done and 134 dead letters", || {
        inbox_count(&env.db) == 11 && quiet(&mut con, 134)
    });

    // What `worker dead list --json` has, newest first: by stream id, then shard.
    let cli_letters = || -> Vec<serde_json::Value> {
        let out = run_worker(
            &["--shards", "3", "dead", "list", "--json", "--limit", "1000"],
            &env.config.redis_url,
            &env.config.database_url,
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let newest_first = |letters: &[serde_json::Value], event: Option<&str>| -> Vec<String> {
        let mut v: Vec<((u64, u64, u64), String)> = letters
            .iter()
            .filter(|l| event.is_none_or(|e| l["event"] == e))
            .map(|l| {
                let id = l["id"].as_str().unwrap();
                let (shard, bare) = id.split_once('/').unwrap();
                assert_eq!(shard, l["shard"].to_string(), "{l}");
                let (ms, seq) = bare.split_once('-').unwrap();
                let place = (
                    ms.parse().unwrap(),
                    seq.parse().unwrap(),
                    shard.parse().unwrap(),
                );
                (place, id.to_string())
            })
            .collect();
        v.sort();
        v.into_iter().rev().map(|(_, id)| id).collect()
    };
    let letters = cli_letters();
    assert_eq!(letters.len(), 134);
    let all = newest_first(&letters, None);

    // The overview's row per shard, against `worker stats --json`'s `shards` (quiescent).
    let (_, _, overview) = http_get(port, "/").unwrap();
    let out = run_worker(
        &["--shards", "3", "stats", "--json"],
        &env.config.redis_url,
        &env.config.database_url,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for i in 0..3 {
        let row = overview
            .find(&format!("data-shard=\"{i}\""))
            .unwrap_or_else(|| panic!("no row of shard {i}:\n{overview}"));
        for key in [
            "pool.size",
            "pool.due",
            "group.lag",
            "group.pending",
            "dead.length",
        ] {
            let shown = text_at(&overview, row, &format!("data-k=\"{key}\""))
                .unwrap()
                .0;
            assert_eq!(
                shown,
                json_figure(&stats["shards"][i], key),
                "shard {i} {key}"
            );
        }
    }

    // The list over plain HTTP: the total and each shard's count, then every page.
    let (_, _, first) = http_get(port, "/dead").unwrap();
    assert_eq!(figure(&first, "dead.length"), "134");
    for (i, keys) in shards.iter().enumerate() {
        let n = letters.iter().filter(|l| l["shard"] == i).count();
        assert_eq!(
            figure(&first, &format!("shards.{i}.dead.length")),
            n.to_string()
        );
        assert!(
            first.contains(&format!("<code>{}</code>", keys.dead)),
            "{first}"
        );
    }
    let shown = plain(&first);
    assert!(
        shown.contains(HOSTILE_EVENT) && shown.contains(HOSTILE_KEY),
        "{shown}"
    );
    assert!(!first.contains("<img") && !first.contains("<script") && !first.contains("<b>"));
    let (walked, pages) = walk_dead(port, "");
    assert_eq!(pages, 3, "50 a page");
    assert_eq!(walked, all, "every letter once, newest first");
    let (walked, pages) = walk_dead(port, "?event=paging.a");
    assert_eq!(pages, 2);
    assert_eq!(walked, newest_first(&letters, Some("paging.a")));
    assert_eq!(walked.len(), 80);
    // The browser renders the same first page.
    let page = dom(&format!("http://127.0.0.1:{port}/dead"));
    assert_eq!(attr_values(&page, "data-letter"), all[..50].to_vec());

    // One letter's page: `<shard>/<id>`, a bare id held by one shard, not by two.
    let stuck_letter = letters
        .iter()
        .find(|l| l["key"] == key_of(&stuck))
        .expect("the stuck order's letter");
    let stuck_id = stuck_letter["id"].as_str().unwrap().to_string();
    assert!(stuck_id.starts_with("2/"), "{stuck_id}");
    let path = |id: &str| format!("/dead/letter?id={}", id.replace('/', "%2F"));
    let (code, _, one) = http_get(port, &path(&stuck_id)).unwrap();
    assert_eq!(code, 200, "{one}");
    assert_eq!(figure(&one, "id"), stuck_id);
    assert_eq!(figure(&one, "key"), key_of(&stuck));
    assert_eq!(figure(&one, "shard"), format!("2 ({})", shards[2].dead));
    let (code, _, one) = http_get(port, &path(&format!("{}-0", t0 + 1))).unwrap();
    assert_eq!(code, 200, "{one}");
    assert_eq!(figure(&one, "id"), format!("2/{}-0", t0 + 1));
    let (code, _, one) = http_get(port, &path(&format!("{t0}-0"))).unwrap();
    assert_eq!(code, 400, "{one}");
    assert!(plain(&one).contains("shards [0, 1]"), "{one}");
    assert_eq!(http_get(port, &path("1-0")).unwrap().0, 404);
    assert_eq!(http_get(port, &path("3/1-0")).unwrap().0, 400);
    let big = "99999999999999999999999-0";
    assert_eq!(http_get(port, &path(&format!("0/{big}"))).unwrap().0, 400);
    for (before, code) in [
        (format!("0%2F{big}"), 400),
        ("0%2F0-0".to_string(), 200),
        ("2%2F0-0".to_string(), 200),
    ] {
        let (got, _, page) = http_get(port, &format!("/dead?before={before}")).unwrap();
        assert_eq!(got, code, "{before}: {page}");
        assert!(attr_values(&page, "data-letter").is_empty(), "{before}");
    }
    let hostile_id = letters
        .iter()
        .find(|l| l["event"] == HOSTILE_EVENT)
        .map(|l| l["id"].as_str().unwrap().to_string())
        .unwrap();
    let (code, _, one) = http_get(port, &path(&hostile_id)).unwrap();
    assert_eq!(code, 200);
    assert!(!one.contains("<script") && !one.contains("<img"), "{one}");
    assert_eq!(figure(&one, "event"), HOSTILE_EVENT);
    assert!(figure(&one, "msg").contains(HOSTILE_NOTE));

    // The fix, then a requeue through the form of the shard 2 letter and an id of shard 0
    // that is no letter: the letter leaves shard 2's stream and its job runs once.
    release.send(()).unwrap();
    locker.join().unwrap();
    let nonce = attr_values(&first, "value")
        .into_iter()
        .find(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .expect("the form's nonce");
    let origin = ("Origin", format!("http://127.0.0.1:{port}"));
    let body = form(&[
        ("nonce", &nonce),
        ("id", &stuck_id),
        ("id", "0/1-0"),
        ("token", TOKEN),
    ]);
    let (code, said) = post(port, "/dead/requeue", &body, std::slice::from_ref(&origin));
    assert_eq!(code, 200, "{said}");
    assert_eq!(figure(&said, "done"), "Requeued 1 dead letter(s)");
    assert!(figure(&said, "requeued").contains(&stuck_id), "{said}");
    assert!(figure(&said, "missing").contains("0/1-0"), "{said}");
    wait_until(WAIT, "the requeued order done", || {
        inbox_count(&env.db) == 12 && quiet(&mut con, 133)
    });
    let bare = stuck_id.split_once('/').unwrap().1;
    let left: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&shards[2].dead)
        .arg(bare)
        .arg(bare)
        .query(&mut con)
        .unwrap();
    assert!(left.is_empty(), "gone from shard 2's dead letters");
    assert_accounting(&env.db, &orders, &orders.iter().collect::<Vec<_>>());
    let done = "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"done\"}";
    let dup = "delay_worker_jobs_total{event=\"order.timeout\",outcome=\"duplicate\"}";
    assert_eq!((metric(port, done), metric(port, dup)), (12, 0));

    // A purge of one letter of shard 0 and one of shard 1 whose id shard 0 also holds.
    let bad0 = letters
        .iter()
        .find(|l| l["key"] == "bad-0")
        .map(|l| l["id"].as_str().unwrap().to_string())
        .unwrap();
    let twin = format!("1/{t0}-0");
    let (code, said) = post(
        port,
        "/dead/purge",
        &form(&[("id", &bad0), ("id", &twin)]),
        &[("Authorization", format!("Bearer {TOKEN}"))],
    );
    assert_eq!(code, 200, "{said}");
    assert_eq!(figure(&said, "done"), "Purged 2 dead letter(s)");
    let after = cli_letters();
    let mut expected: Vec<String> = all
        .iter()
        .filter(|id| ![&stuck_id, &bad0, &twin].contains(id))
        .cloned()
        .collect();
    assert_eq!(newest_first(&after, None), expected);
    assert!(
        expected.contains(&format!("0/{t0}-0")),
        "shard 0's twin stays"
    );
    let (walked, _) = walk_dead(port, "");
    assert_eq!(walked, std::mem::take(&mut expected));

    let log = worker.log();
    for line in [
        format!(
            "status page: requeued 1 dead letter(s) of {} (shard 2): {stuck_id}",
            shards[2].dead
        ),
        format!(
            "status page: requeue of {} (shard 0) left 1 letter(s): 0/1-0 (no such letter: requeued or purged by someone else, or never there)",
            shards[0].dead
        ),
        format!(
            "status page: purged 1 dead letter(s) of {} (shard 0): {bad0}",
            shards[0].dead
        ),
        format!(
            "status page: purged 1 dead letter(s) of {} (shard 1): {twin}",
            shards[1].dead
        ),
    ] {
        assert!(log.contains(&line), "{line}\n{log}");
    }
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
    let _ = std::fs::remove_dir_all(token_dir);
}

/// Redis stalled (`CLIENT PAUSE`): the page answers while the stall lasts, saying that
/// Redis did not answer, instead of waiting it out (redis-rs waits for every reply of a
/// pipeline, each up to the socket timeout); then it shows the figures again.
#[test]
fn the_page_answers_while_redis_stalls() {
    let env = Env::new();
    let port = free_port();
    let mut worker = start(&env, "pause-1", port, &[]);
    assert_eq!(http_get(port, "/").unwrap().0, 200);
    // A paused Redis does not take CLIENT UNPAUSE either: the pause runs out by itself.
    let pause = Duration::from_secs(15);
    let paused = Instant::now();
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause.as_millis() as u64)
        .arg("ALL")
        .query::<()>(&mut env.con())
        .unwrap();
    // The first load on the idle connection, then loads that need a new one.
    for path in ["/", "/dead", "/"] {
        let (code, _, page) = http_get(port, path).unwrap();
        let expected = if path == "/" { 200 } else { 503 };
        assert_eq!(code, expected, "{path}: {page}");
        assert!(plain(&page).contains("Redis"), "{path}: {page}");
    }
    assert!(
        paused.elapsed() < pause,
        "answered during the stall, not after it: {:?}",
        paused.elapsed()
    );
    wait_until(WAIT, "the figures again", || {
        http_get(port, "/").is_ok_and(|(c, _, p)| c == 200 && !p.contains("Cannot read"))
    });
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
}

/// GET `path` with `Host: host`: the status code.
fn get_as(port: u16, path: &str, host: &str) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The page answers to IP addresses, localhost and the names of `--status-host`, never
/// to another name pointed at its address (DNS rebinding): that page cannot read the
/// dead letters. `/healthz` and `/metrics` answer to any name.
#[test]
fn the_page_answers_only_to_its_own_host_names() {
    let env = Env::new();
    let port = free_port();
    let mut worker = start(
        &env,
        "host-1",
        port,
        &["--status-host", "Shop-1.example.com"],
    );
    for (path, host, code) in [
        ("/", "127.0.0.1", 200),
        ("/", "localhost", 200),
        ("/dead", "[::1]", 200),
        ("/", "shop-1.example.com", 200),
        ("/", "evil.example", 421),
        ("/dead", "evil.example", 421),
        ("/dead/letter?id=1-0", "127.0.0.1.evil.example", 421),
        ("/healthz", "evil.example", 200),
        ("/metrics", "evil.example", 200),
    ] {
        assert_eq!(
            get_as(port, path, &format!("{host}:{port}")),
            code,
            "{path} as {host}"
        );
    }
    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
    assert!(
        run_worker(
            &["--status-host", "http://x"],
            &env.config.redis_url,
            &env.config.database_url
        )
        .status
        .code()
            == Some(2)
    );
}

/// List mode's dead-letter pages (`--source list`): `Older →` goes on right after the last
/// letter looked at, so every letter that stays is shown exactly once, whether letters of
/// the first page are purged between two loads, the last one of it is (the page says the
/// list changed), or new ones arrive; each letter's event links to its filter; and a POST
/// finds a letter near its form's page beyond the first 2,000 letters, or says precisely
/// where it looked (and logs it).
#[test]
fn status_page_list_mode_pages_stay_stable() {
    let env = Env::new();
    let (token_dir, token) = token_file(0o600, TOKEN);
    let port = free_port();
    let args = [
        "--source",
        "list",
        "--queues",
        "rq",
        "--admin-token-file",
        token.to_str().unwrap(),
    ];
    let mut worker = start(&env, "c1", port, &args);
    let mut con = env.con();
    let now = delay_worker::now_ms() / 1000;
    // Letters k<from>..k<to>, pushed oldest first; their ids as the pages show them.
    let mut push = |from: usize, to: usize| -> Vec<String> {
        let letters: Vec<String> = (from..to)
            .map(|i| {
                format!(r#"{{"msg":"{{}}","reason":"r","ts":{now},"event":"e","key":"k{i}","attempts":1,"queue":"rq"}}"#)
            })
            .collect();
        redis::cmd("LPUSH")
            .arg("rq:dead")
            .arg(&letters)
            .query::<()>(&mut con)
            .unwrap();
        letters
            .iter()
            .map(|l| sha1_hex(l.as_bytes())[..16].to_string())
            .collect()
    };
    let bearer = ("Authorization", format!("Bearer {TOKEN}"));
    let purge = |ids: &[String], at: Option<&str>| -> (u16, String) {
        let mut fields = vec![("queue", "rq")];
        fields.extend(at.map(|a| ("at", a)));
        fields.extend(ids.iter().map(|id| ("id", id.as_str())));
        post(
            port,
            "/dead/purge",
            &form(&fields),
            std::slice::from_ref(&bearer),
        )
    };
    let ids_of = |path: &str| -> (Vec<String>, String) {
        let (code, _, page) = http_get(port, path).unwrap();
        assert_eq!(code, 200, "{path}: {page}");
        (attr_values(&page, "data-letter"), page)
    };
    // Each letter once: `shown` (after the first page) holds each of `expected` exactly once.
    let once = |shown: &[String], expected: &[String]| {
        let mut a = shown.to_vec();
        a.sort();
        let mut b = expected.to_vec();
        b.sort();
        assert_eq!(
            a,
            b,
            "shown {} letters, expected {}",
            shown.len(),
            expected.len()
        );
    };
    let mut all = push(0, 120); // oldest first
    all.reverse(); // newest first, as the pages show them

    // The first 10 of the first page purged before `Older →`.
    let (first, page) = ids_of("/dead?queue=rq");
    assert_eq!(first, all[..50]);
    assert!(
        page.contains("href=\"/dead?queue=rq&amp;event=e\""),
        "the event links to its filter: {page}"
    );
    assert!(older_link(&page).unwrap().contains("after="), "{page}");
    let (code, said) = purge(&first[..10], Some("0"));
    assert!(code == 200 && plain(&said).contains("Purged 10"), "{said}");
    all.drain(..10);
    let (rest, _) = walk_dead(port, &older_link(&page).unwrap()["/dead".len()..]);
    let mut shown = first[10..].to_vec();
    shown.extend(rest);
    once(&shown, &all);

    // New letters arrive between two loads: none of the first page's shows again.
    let (first, page) = ids_of("/dead?queue=rq");
    push(1000, 1030);
    let (rest, _) = walk_dead(port, &older_link(&page).unwrap()["/dead".len()..]);
    let mut shown = first.clone();
    shown.extend(rest);
    once(&shown, &all);
    all.splice(0..0, ids_of("/dead?queue=rq").0[..30].to_vec());

    // The letter the page ended with is purged: the next page says the list changed and
    // goes on from its place, leaving none out.
    let (first, page) = ids_of("/dead?queue=rq");
    let (code, said) = purge(&first[49..], None);
    assert!(code == 200 && plain(&said).contains("Purged 1"), "{said}");
    all.retain(|id| *id != first[49]);
    let next = older_link(&page).unwrap();
    let (_, older) = ids_of(&next);
    assert!(older.contains("data-k=\"changed\""), "{older}");
    let (rest, _) = walk_dead(port, &next["/dead".len()..]);
    let mut shown = first[..49].to_vec();
    shown.extend(rest);
    once(&shown, &all);

    // Beyond the first 2,000 letters: a form of the page at position 2050 acts on its last
    // letter; without `at` the letter is not found, and the answer and the log say where
    // it was looked for.
    push(2000, 4000);
    let (far, page) = ids_of("/dead?queue=rq&at=2050");
    assert_eq!(far.len(), 50, "{page}");
    assert!(page.contains("name=\"at\" value=\"2050\""), "{page}");
    let (code, said) = purge(&far[49..], None);
    assert_eq!(code, 200, "{said}");
    let where_ = "not found: already requeued or purged by someone else, or not in the first 2000 letters of rq:dead (or near position 0)";
    assert!(
        plain(&said).contains(&format!(
            "Not found: already requeued or purged by someone else, or not in the first 2000 letters of rq:dead (or near position 0): {}",
            far[49]
        )),
        "{said}"
    );
    assert!(
        worker
            .log()
            .contains(&format!("purge of rq:dead: {where_}: {}", far[49])),
        "{}",
        worker.log()
    );
    let (code, said) = purge(&far[49..], Some("2050"));
    assert!(code == 200 && plain(&said).contains("Purged 1"), "{said}");
    let len: usize = redis::cmd("LLEN").arg("rq:dead").query(&mut con).unwrap();
    assert_eq!(len, all.len() + 2000 - 1);

    worker.signal(libc::SIGTERM);
    assert!(worker.wait(WAIT).success());
    let _ = std::fs::remove_dir_all(token_dir);
}

// ---- the trace search --------------------------------------------------------------------

/// `/trace?q=...` of `q`, as Chromium lays it out.
fn trace_dom(port: u16, q: &str) -> String {
    let q: String = form_urlencoded::byte_serialize(q.as_bytes()).collect();
    dom(&format!("http://127.0.0.1:{port}/trace?q={q}"))
}

#[test]
fn status_page_trace_search_by_key_and_by_order_number_shown_as_text() {
    let env = Env::new();
    let orders = seed_orders(&env.db, 1);
    let no = orders[0].order_no.clone();
    let key = format!("order.timeout:{no}");
    let hostile = format!("order.timeout:{HOSTILE_EVENT}");
    let now = delay_worker::now_ms();
    let mut con = env.con();
    for (k, due) in [(&key, now), (&hostile, now + 15 * 60_000)] {
        let job = delay_worker::producer::NewJob {
            event: "order.timeout".into(),
            payload: serde_json::json!({ "order_no": HOSTILE_NOTE }),
            due_ms: due,
            key: Some(k.clone()),
        };
        let job = if *k == key {
            delay_worker::producer::NewJob {
                payload: serde_json::json!({ "order_no": no }),
                ..job
            }
        } else {
            job
        };
        delay_worker::producer::push(&mut con, &env.config.keys, &job, now).unwrap();
    }
    let port = free_port();
    let _worker = start(&env, "trace-page", port, &[]);
    wait_until(WAIT, "the order's timeout done", || {
        inbox_count(&env.db) == 1
    });

    // Every page has the search box.
    let overview = dom(&format!("http://127.0.0.1:{port}/"));
    assert!(overview.contains(r#"action="/trace""#), "{overview}");

    // By key: its job, done, with its consumer; the same words as `worker trace`.
    let page = trace_dom(port, &key);
    assert_eq!(attr_values(&page, "data-state"), ["done"], "{page}");
    let said = plain(&page);
    assert!(
        said.contains("done at") && said.contains("by trace-page"),
        "{said}"
    );
    let cli = run_worker(
        &["trace", &key],
        &env.config.redis_url,
        &env.config.database_url,
    );
    let line = text(&cli.stdout)
        .lines()
        .find(|l| l.trim_start().starts_with("done at"))
        .map(|l| l.trim().split(" (").next().unwrap().to_string())
        .expect("a done line");
    assert!(said.contains(&line), "{line} in {said}");

    // By order number: the key of the order's timeout.
    let page = trace_dom(port, &no);
    assert_eq!(attr_values(&page, "data-key"), [key.as_str()], "{page}");
    assert_eq!(attr_values(&page, "data-state"), ["done"]);

    // A key holding HTML is shown as text: no element made of it.
    let page = trace_dom(port, &hostile);
    assert_eq!(attr_values(&page, "data-state"), ["scheduled"], "{page}");
    assert!(
        !page.contains("<img") && !page.contains("<script>alert"),
        "{page}"
    );
    assert!(plain(&page).contains(&hostile), "{page}");

    // Nothing of it anywhere: said so.
    let page = trace_dom(port, "order.timeout:SO-NEVER");
    assert_eq!(attr_values(&page, "data-state"), ["gone"], "{page}");
    assert!(plain(&page).contains("never pushed"));
}
