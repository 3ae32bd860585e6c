//! The status page's HTML. `maud` escapes every value put into the markup, so a dead
//! letter's event, key, reason or message shows as text whatever it holds; nothing here
//! writes unescaped text but the fixed style sheet. Every figure of `worker stats` carries
//! `data-k="<its JSON path>"` (and consumers, queues and chart points their own `data-`
//! attributes), so the tests read the same numbers a person reads.

use super::{chart, pretty, DEAD_BUDGET, DEAD_PER_PAGE, DEAD_WINDOW, REFRESH_S};
use crate::config::{Config, Source};
use crate::dead::list::{ListLetter, NewestPage};
use crate::dead::{self, shard_id, DeadLetter, Letter, RequeueReport};
use crate::figures::StatsReport;
use crate::stats::{Hour, Snapshot};
use crate::text::{clip, fmt_age, fmt_ms, fmt_time, or_dash};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use std::time::Duration;

const CSS: &str = r#"
:root{color-scheme:light dark}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:62rem;padding:.5rem .8rem 2rem}
nav{display:flex;flex-wrap:wrap;gap:.2rem 1rem;padding:.3rem 0;border-bottom:1px solid #8885}
h1{font-size:1.3rem;margin:.6rem 0 .2rem}
h2{font-size:1.05rem;margin:1.3rem 0 .3rem}
table{border-collapse:collapse;width:100%}
th,td{padding:.22rem .45rem;text-align:left;vertical-align:top;border-bottom:1px solid #8883}
th{font-weight:600}
.n{text-align:right;font-variant-numeric:tabular-nums}
.kv th{font-weight:normal;color:#777;width:45%}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(17rem,1fr));gap:0 1.5rem}
.wrap{overflow-x:auto}
.ok{color:#1a7f37}.bad{color:#cf222e}.muted{color:#777}
.box{border:1px solid #8886;border-radius:6px;padding:.5rem .7rem;margin:.6rem 0}
.box.bad{border-color:#cf222e}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#8881;padding:.6rem;border-radius:6px;margin:.3rem 0}
td.text{overflow-wrap:anywhere;min-width:8rem}
td.sel{width:1.5rem}
.letters td{padding:.4rem .45rem}
svg{display:block;width:100%;max-width:36rem;height:auto}
figure{margin:.5rem 0 1rem}
figcaption{font-size:.85rem;color:#777}
form.row{display:flex;flex-wrap:wrap;gap:.4rem;align-items:center;margin:.5rem 0}
input,button{font:inherit;padding:.25rem .5rem}
nav form.row{margin:0 0 0 auto}
"#;

/// The search box in every page's header: a job key or an order number, for `/trace`.
fn search_box() -> Markup {
    html! {
        form.row method="get" action="/trace" {
            input type="search" name="q" placeholder="job key or order number" aria-label="job key or order number";
            button type="submit" { "Trace" }
        }
    }
}

/// The page around `body`; the overview refreshes itself.
pub(super) fn layout(title: &str, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if refresh {
                    meta http-equiv="refresh" content=(REFRESH_S);
                }
                title { (title) " · delay-worker" }
                style { (PreEscaped(CSS)) }
            }
            body {
                nav {
                    a href="/" { "Status" }
                    a href="/dead" { "Dead letters" }
                    a href="/metrics" { "Metrics" }
                    a href="/healthz" { "Health" }
                    a href="/trace" { "Trace" }
                    (search_box())
                }
                (body)
            }
        }
    }
}

/// A page that only says something: an error, a letter not found.
pub fn message(title: &str, text: &str) -> Markup {
    layout(
        title,
        false,
        html! {
            h1 { (title) }
            p.box.bad { (text) }
        },
    )
}

/// A query string, each value encoded.
fn query(pairs: &[(&str, &str)]) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

fn count(v: Option<u64>) -> String {
    v.map_or("?".to_string(), |n| n.to_string())
}

fn secs(ms: i64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

/// What the overview shows.
pub struct Overview<'a> {
    pub config: &'a Config,
    pub report: &'a Result<StatsReport, String>,
    pub hour: &'a Hour,
    pub totals: &'a Snapshot,
    pub live: Result<(), String>,
    /// What holds jobs back besides liveness: jobs held by a schema fault, PostgreSQL
    /// not writable, dead letters faster than `--dead-rate-crit` (`health::Verdict::alerts`).
    pub alerts: Vec<String>,
    /// Jobs this process sent back after contention, and the one waiting longest.
    pub contention: (usize, Option<crate::stats::Waiter>),
    pub uptime: Duration,
    pub rss: Option<u64>,
    pub now_ms: i64,
    pub actions: bool,
}

pub fn overview(v: &Overview) -> Markup {
    let c = v.config;
    let body = html! {
        h1 { "delay-worker " span.muted { (c.consumer) } }
        p {
            @match &v.live {
                Ok(()) => { strong.ok data-k="live" { "Live" } }
                Err(why) => { strong.bad data-k="live" { "Not live" } ": " (why) }
            }
            " · " (fmt_time(v.now_ms)) " · refreshes every " (REFRESH_S) " s"
        }
        @for a in &v.alerts {
            p.box.bad data-k="alert" { (a) }
        }
        @if let (n, Some(w)) = &v.contention {
            p.box data-k="contention" {
                (n) " job(s) wait on contention (the shop's locks, statement timeouts); the longest, "
                (w.event) " " code { (clip(&w.key, 200)) } ", for "
                (crate::human_ms(v.now_ms - w.since_ms)) ": " (clip(&w.reason, 300))
            }
        }
        @match v.report {
            Err(e) => { p.box.bad { "Cannot read the queue figures: " (e) } }
            Ok(r) => { (queue_figures(r, c)) }
        }
        h2 { "This process, last hour" }
        (process(v))
        (chart::throughput(v.hour))
        (chart::lateness(v.hour))
        (footer(v.actions))
    };
    layout("Status", true, body)
}

fn footer(actions: bool) -> Markup {
    html! {
        p.muted {
            @if actions {
                "Requeue and purge on the dead-letter pages need the admin token (--admin-token-file)."
            } @else {
                "Read-only: start the worker with --admin-token-file to requeue and purge dead letters here."
            }
        }
    }
}

fn queue_figures(r: &StatsReport, c: &Config) -> Markup {
    let list = c.source == Source::List;
    html! {
        div.grid {
            @if !list {
                div {
                    h2 { "Stream" }
                    table.kv {
                        tr { th { "stream" } td { (r.stream.key) } }
                        tr { th { "length" } td.n data-k="stream.length" { (r.stream.length) } }
                        tr { th { "group" } td { (r.group.name) } }
                        @if r.group.exists {
                            tr { th { "lag" } td.n data-k="group.lag" { (count(r.group.lag)) } }
                            tr { th { "read" } td.n data-k="group.entries_read" { (count(r.group.entries_read)) } }
                            tr { th { "pending" } td.n data-k="group.pending" { (r.group.pending) } }
                            tr {
                                th { "oldest pending" }
                                td.n data-k="group.oldest_pending_age_ms" {
                                    (r.group.oldest_pending_age_ms.map_or("-".to_string(), fmt_age))
                                }
                            }
                        } @else {
                            tr { td colspan="2" { "not created yet (no worker has started on this stream)" } }
                        }
                    }
                }
            }
            div {
                h2 { "Delay pool" }
                table.kv {
                    tr { th { "pool" } td { (r.pool.key) } }
                    tr { th { "scheduled" } td.n data-k="pool.size" { (r.pool.size) } }
                    tr { th { "due, not moved" } td.n data-k="pool.due" { (r.pool.due) } }
                    tr {
                        th { "… s / ms scores" }
                        td.n { span data-k="pool.due_seconds" { (r.pool.due_seconds) } " / " span data-k="pool.due_ms" { (r.pool.due_ms) } }
                    }
                    tr {
                        th { "mover lag" }
                        td.n data-k="pool.mover_lag_ms" { (secs(r.pool.mover_lag_ms)) }
                    }
                    @if r.pool.oldest_due_has_data == Some(false) {
                        tr { td colspan="2" { "its oldest due member has no data yet" } }
                    }
                }
            }
            div {
                @if list {
                    h2 { "Dead-letter stream" }
                } @else {
                    h2 { a href="/dead" { "Dead letters" } }
                }
                table.kv {
                    tr { th { "stream" } td { (r.dead.key) } }
                    tr { th { "kept" } td.n data-k="dead.length" { (r.dead.length) } }
                    tr {
                        th { "new (last " (humantime::format_duration(DEAD_WINDOW)) ")" }
                        td.n data-k="dead.new" { (r.dead.new) }
                    }
                    tr {
                        th { "newest" }
                        td.n { (r.dead.newest_age_ms.map_or("-".to_string(), |a| format!("{} ago", fmt_age(a)))) }
                    }
                }
            }
        }
        @if !r.shards.is_empty() {
            h2 { "Shards " span.muted { "(the figures above are their total)" } }
            div.wrap {
                table {
                    tr {
                        th.n { "shard" } th.n { "scheduled" } th.n { "due" } th.n { "lag" }
                        th.n { "pending" } th.n { "oldest pending" } th.n { "mover lag" }
                        th.n { "dead" }
                    }
                    @for (i, s) in r.shards.iter().enumerate() {
                        tr data-shard=(i) {
                            td.n { (i) }
                            td.n data-k="pool.size" { (s.pool.size) }
                            td.n data-k="pool.due" { (s.pool.due) }
                            td.n data-k="group.lag" { (count(s.group.lag)) }
                            td.n data-k="group.pending" { (s.group.pending) }
                            td.n { (s.group.oldest_pending_age_ms.map_or("-".to_string(), fmt_age)) }
                            td.n data-k="pool.mover_lag_ms" { (secs(s.pool.mover_lag_ms)) }
                            td.n data-k="dead.length" { (s.dead.length) }
                        }
                    }
                }
            }
        }
        @if !list && !r.consumers.is_empty() {
            h2 { "Consumers" }
            div.wrap {
                table {
                    tr { th { "consumer" } th.n { "pending" } th.n { "idle" } th { "heartbeat" } }
                    @for cf in &r.consumers {
                        tr data-consumer=(cf.name) {
                            td { (cf.name) }
                            td.n data-k="pending" { (cf.pending) }
                            td.n { (fmt_age(cf.idle_ms as i64)) }
                            td data-k="heartbeat" {
                                @match (cf.heartbeat, cf.pending) {
                                    (true, _) if cf.without_database => { span.bad { "alive, no usable PostgreSQL (a peer that has one takes its entries)" } }
                                    (true, _) => { span.ok { "alive" } }
                                    (false, 0) => { "none" }
                                    (false, _) => { span.bad { "none (dead host: its entries wait for a takeover)" } }
                                }
                            }
                        }
                    }
                }
            }
        }
        @if !r.workers.is_empty() {
            h2 { "Workers " span.muted { "(as each one's heartbeat record says)" } }
            div.wrap {
                table {
                    tr { th { "worker" } th { "host" } th.n { "clock offset to Redis" } th { "problems" } }
                    @for w in &r.workers {
                        tr data-worker=(w.name) {
                            td { (w.name) }
                            @match &w.record {
                                None => { td { "?" } td.n { "?" } td { "(an older worker: no record)" } }
                                Some(rec) => {
                                    td { (rec.host) }
                                    td.n data-k="clock_offset_ms" {
                                        @match rec.clock_offset_ms {
                                            Some(o) if o.abs() > 1000 => { span.bad { (format!("{:+.3}s", o as f64 / 1000.0)) } }
                                            Some(o) => { (format!("{:+.3}s", o as f64 / 1000.0)) }
                                            None => { "not measured" }
                                        }
                                    }
                                    td data-k="problems" {
                                        @if rec.problems.is_empty() { span.ok { "none" } }
                                        @for p in &rec.problems {
                                            div { span.bad { "[" (p.severity) "] " } (p.role) ": " (p.what) }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        @if !r.queues.is_empty() {
            h2 { "Queues " span.muted { "(dead: their dead lists)" } }
            div.wrap {
                table {
                    tr {
                        th { "queue" } th.n { "waiting" } th.n { "oldest" } th { "processing" }
                        th.n { "dead" } th.n { "new dead" }
                    }
                    @for q in &r.queues {
                        @let held: Vec<String> = q.processing.iter().filter(|(_, n)| *n > 0).map(|(c, n)| format!("{c} {n}")).collect();
                        tr data-queue=(q.name) {
                            td { (q.name) }
                            td.n data-k="length" { (q.length) }
                            td.n {
                                @match (q.oldest_age_ms, q.oldest_unknown) {
                                    (Some(age), _) => { (fmt_age(age)) }
                                    (None, Some(why)) => { "? (" (why) ")" }
                                    (None, None) => { "-" }
                                }
                            }
                            td data-k="processing" {
                                @if held.is_empty() { "0" } @else { (held.join(", ")) }
                            }
                            td.n data-k="dead" {
                                a href={ "/dead?" (query(&[("queue", &q.name)])) } { (q.dead) }
                            }
                            td.n data-k="dead_new" { (q.dead_new) }
                        }
                    }
                }
            }
        }
    }
}

fn process(v: &Overview) -> Markup {
    let h = v.hour;
    let t = v.totals;
    let pct = |p: Option<f64>| p.map_or("-".to_string(), |ms| format!("≤ {}", fmt_ms(ms)));
    html! {
        div.grid {
            table.kv {
                tr { th { "committed" } td.n data-k="hour.committed" { (h.committed) } }
                tr { th { "retried" } td.n data-k="hour.retried" { (h.retried) } }
                tr { th { "dead-lettered" } td.n data-k="hour.dead" { (h.dead) } }
                tr { th { "lateness p50" } td.n data-k="hour.p50" { (pct(h.p50_ms)) } }
                tr { th { "lateness p95" } td.n data-k="hour.p95" { (pct(h.p95_ms)) } }
                tr { th { "lateness p99" } td.n data-k="hour.p99" { (pct(h.p99_ms)) } }
            }
            table.kv {
                tr { th { "since start" } td.n { (fmt_age(v.uptime.as_millis() as i64)) } }
                tr { th { "done / no-op / dup." } td.n { (t.done) " / " (t.noop) " / " (t.duplicate) } }
                tr { th { "retried / dead" } td.n { (t.retried) " / " (t.dead) } }
                tr { th { "moved" } td.n { (t.moved) } }
                tr { th { "resident memory" } td.n { (v.rss.map_or("?".to_string(), |b| format!("{:.1} MB", b as f64 / 1e6))) } }
            }
        }
    }
}

/// The token field and the two buttons of an action form.
fn action_buttons(what: &str) -> Markup {
    html! {
        div.row {
            label {
                "Admin token "
                input type="password" name="token" autocomplete="current-password" required;
            }
            button type="submit" formaction="/dead/requeue" { "Requeue " (what) }
            button type="submit" formaction="/dead/purge" { "Purge " (what) }
        }
    }
}

/// `inner` (a list with a checkbox per letter) in the form that requeues or purges the
/// letters ticked, when actions are on (`nonce`); as it is otherwise: no form at all.
fn selection_form(nonce: Option<&str>, hidden: &[(&str, String)], inner: Markup) -> Markup {
    match nonce {
        None => inner,
        Some(n) => html! {
            form method="post" action="/dead/requeue" {
                @for (k, v) in hidden {
                    input type="hidden" name=(k) value=(v);
                }
                input type="hidden" name="nonce" value=(n);
                (inner)
                (action_buttons("selected"))
            }
        },
    }
}

fn read_only_note() -> Markup {
    html! {
        p.muted { "Read-only: requeue and purge here need the worker started with --admin-token-file (or use worker dead requeue | purge)." }
    }
}

fn filter_form(event: Option<&str>, queue: Option<&str>) -> Markup {
    let all = match queue {
        Some(q) => format!("/dead?{}", query(&[("queue", q)])),
        None => "/dead".to_string(),
    };
    html! {
        form.row method="get" action="/dead" {
            @if let Some(q) = queue {
                input type="hidden" name="queue" value=(q);
            }
            label { "Event " input type="text" name="event" value=(event.unwrap_or("")); }
            button type="submit" { "Filter" }
            @if event.is_some() {
                a href=(all) { "all events" }
            }
        }
    }
}

/// One letter in a list, `id` as the page writes it: its checkbox when actions are on,
/// then when it died (the link to it, `href`), its event (a link to the list of that
/// event), key, shard, attempts and reason, on up to three short lines (narrow screens too).
fn letter_row(
    id: &str,
    href: &str,
    l: &dyn Letter,
    event_href: &str,
    shard: Option<usize>,
    nonce: Option<&str>,
) -> Markup {
    let f = l.facts();
    let died = l
        .age_ms()
        .map_or("? (no ts)".to_string(), |a| format!("{} ago", fmt_age(a)));
    let reason = if l.readable() {
        clip(&f.reason, 160)
    } else {
        "(not a letter the worker wrote)".to_string()
    };
    html! {
        tr data-letter=(id) {
            @if nonce.is_some() {
                td.sel { input type="checkbox" name="id" value=(id) aria-label="select"; }
            }
            td.text {
                div {
                    a href=(href) { (died) } " · "
                    a.event href=(event_href) { strong { (or_dash(&f.event)) } }
                }
                div.muted {
                    "key " span.key { (or_dash(&String::from_utf8_lossy(&f.key))) }
                    (facts(shard, f.attempts))
                }
                div.reason { (reason) }
            }
        }
    }
}

/// The end of a letter's key line: its shard (`--shards N`) and attempts, when known.
fn facts(shard: Option<usize>, attempts: Option<u64>) -> String {
    let mut s = String::new();
    if let Some(i) = shard {
        s.push_str(&format!(" · shard {i}"));
    }
    if let Some(n) = attempts {
        s.push_str(&format!(" · {n} attempts"));
    }
    s
}

/// The end of a list of letters: the link to older ones, the read-only note, how much a
/// page shows and looks at (and `more` to say).
fn page_end(older: Option<&str>, nonce: Option<&str>, more: &str) -> Markup {
    html! {
        @if let Some(href) = older {
            p { a href=(href) { "Older →" } }
        }
        @if nonce.is_none() { (read_only_note()) }
        p.muted { (DEAD_PER_PAGE) " a page; a page looks at " (DEAD_BUDGET) " letters at most." (more) }
    }
}

/// What the stream-mode list shows.
pub struct DeadStream<'a> {
    /// The dead-letter stream and its length; with `--shards N`, each shard's, in order.
    pub streams: &'a [(String, u64)],
    pub event: Option<&'a str>,
    pub before: Option<&'a str>,
    /// The letters, each with its shard when sharded.
    pub letters: &'a [(Option<usize>, DeadLetter)],
    pub next: Option<String>,
    /// The form nonce when actions are on.
    pub nonce: Option<&'a str>,
    /// With `--shards N`: a line for each shard whose letters cannot be read (its key
    /// holds another type).
    pub broken: &'a [String],
}

/// A letter's id as the pages write it: `<shard>/<id>` with `--shards N`.
fn letter_id(shard: Option<usize>, id: &str) -> String {
    match shard {
        Some(s) => shard_id(s, id),
        None => id.to_string(),
    }
}

pub fn dead_stream(v: &DeadStream) -> Markup {
    let event_link = |e: &str| format!("/dead?{}", query(&[("event", e)]));
    let older = v.next.as_deref().map(|next| {
        let mut q = vec![("before", next)];
        q.extend(v.event.map(|e| ("event", e)));
        format!("/dead?{}", query(&q))
    });
    let total: u64 = v.streams.iter().map(|(_, n)| n).sum();
    let body = html! {
        h1 { "Dead letters" }
        @if let [(key, length)] = v.streams {
            p { span data-k="dead.length" { (length) } " kept in " code { (key) } ", newest first"
                @if v.before.is_some() { " (older page)" } "." }
        } @else {
            p { span data-k="dead.length" { (total) } " kept in " (v.streams.len()) " shards, newest first"
                @if v.before.is_some() { " (older page)" } "; ids are written " code { "<shard>/<id>" } "." }
            p.muted {
                @for (i, (key, length)) in v.streams.iter().enumerate() {
                    @if i > 0 { " · " }
                    span data-shard=(i) {
                        "shard " (i) " " code { (key) } " "
                        span data-k={ "shards." (i) ".dead.length" } { (length) }
                    }
                }
            }
        }
        @for b in v.broken { p.box.bad data-k="dead.broken" { (b) } }
        (filter_form(v.event, None))
        @if v.letters.is_empty() {
            p { @if v.event.is_some() { "No dead letter of this event" } @else { "No dead letters" }
                @if v.next.is_some() { " among the " (DEAD_BUDGET) " looked at" } "." }
        } @else {
            (selection_form(v.nonce, &[], html! {
                table.letters {
                    @for (shard, d) in v.letters {
                        @let id = letter_id(*shard, &d.id);
                        (letter_row(
                            &id,
                            &format!("/dead/letter?{}", query(&[("id", &id)])),
                            d,
                            &event_link(&d.facts.event),
                            *shard,
                            v.nonce,
                        ))
                    }
                }
            }))
        }
        (page_end(older.as_deref(), v.nonce, ""))
    };
    layout("Dead letters", false, body)
}

/// What the list-mode list shows: one queue's dead list.
pub struct DeadListMode<'a> {
    /// Every queue and the length of its dead list.
    pub queues: Vec<(&'a str, u64)>,
    pub queue: &'a str,
    pub event: Option<&'a str>,
    /// Not the first page.
    pub older_page: bool,
    pub page: &'a NewestPage,
    pub nonce: Option<&'a str>,
}

pub fn dead_list_mode(v: &DeadListMode) -> Markup {
    let letters = &v.page.letters;
    // The next page goes on right after the last letter this one looked at.
    let older = v.page.next.as_ref().map(|next| {
        let n = next.older.to_string();
        let mut q = vec![("queue", v.queue), ("after", &next.id), ("older", &n)];
        q.extend(v.event.map(|e| ("event", e)));
        format!("/dead?{}", query(&q))
    });
    let event_link = |e: &str| format!("/dead?{}", query(&[("queue", v.queue), ("event", e)]));
    // A form's `at`: where its letters are looked for first.
    let from = letters.first().map_or(0, |(pos, _)| *pos);
    let body = html! {
        h1 { "Dead letters" }
        p {
            "Dead lists: "
            @for (i, (name, len)) in v.queues.iter().enumerate() {
                @if i > 0 { " · " }
                @if *name == v.queue {
                    strong { (name) " " span data-k="dead.length" { (len) } }
                } @else {
                    a href={ "/dead?" (query(&[("queue", name)])) } { (name) " " (len) }
                }
            }
        }
        (filter_form(v.event, Some(v.queue)))
        @if v.page.changed {
            p.box data-k="changed" { "The list changed since the previous page: the letter it ended with is no longer in its place (it was requeued or purged, or older letters were). This page goes on from that place; letters of the previous page may show again, none is left out." }
        }
        @if letters.is_empty() {
            p { "No dead letters here" @if v.older_page { " (older page)" } @if v.page.next.is_some() { " among the " (DEAD_BUDGET) " looked at" } "." }
        } @else {
            (selection_form(v.nonce, &[("queue", v.queue.to_string()), ("at", from.to_string())], html! {
                table.letters {
                    @for (pos, l) in letters {
                        (letter_row(
                            &l.id,
                            &format!("/dead/letter?{}", query(&[("queue", v.queue), ("id", &l.id), ("at", &pos.to_string())])),
                            l,
                            &event_link(&l.facts.event),
                            None,
                            v.nonce,
                        ))
                    }
                }
            }))
        }
        (page_end(older.as_deref(), v.nonce, " Identical letters share one id: selecting them acts on one."))
    };
    layout("Dead letters", false, body)
}

/// A message as text: reindented JSON, or as written.
fn message_block(msg: &[u8]) -> Markup {
    html! {
        @match pretty::json(msg) {
            Some(p) => { h2 { "Message" } pre data-k="msg" { (p) } }
            None => {
                h2 { "Message " span.muted { "(not JSON, as written)" } }
                pre data-k="msg" { (String::from_utf8_lossy(msg)) }
            }
        }
    }
}

fn rows(rows: &[(String, String)]) -> Markup {
    html! {
        table.kv {
            @for (k, v) in rows {
                tr { th { (k) } td.text data-k=(k) { (v) } }
            }
        }
    }
}

/// One stream-mode letter; `shard` is its shard and that shard's dead-letter stream with
/// `--shards N`.
pub fn stream_letter(d: &DeadLetter, shard: Option<(usize, &str)>, nonce: Option<&str>) -> Markup {
    let id = letter_id(shard.map(|(s, _)| s), &d.id);
    let mut fields = dead::rows(d, "id", id.clone(), false);
    if let Some((s, key)) = shard {
        fields.insert(1, ("shard".into(), format!("{s} ({key})")));
    }
    let form = vec![("id", id)];
    letter_page(
        d,
        &fields,
        form,
        nonce,
        ("/dead".into(), "← All dead letters".into()),
    )
}

pub fn list_letter(l: &ListLetter, at: usize, nonce: Option<&str>) -> Markup {
    let fields = dead::rows(l, "id", l.id.clone(), false);
    let form = vec![
        ("queue", l.queue.clone()),
        ("at", at.to_string()),
        ("id", l.id.clone()),
    ];
    let back = format!("/dead?{}", query(&[("queue", &l.queue)]));
    let back_text = format!("← All dead letters of {}", l.queue);
    letter_page(l, &fields, form, nonce, (back, back_text))
}

/// One letter's page: its fields and message (or, for an entry the worker did not write,
/// its bytes as stored), the form that requeues or purges it (its hidden fields `form`)
/// when actions are on, and the link back.
fn letter_page(
    l: &dyn Letter,
    fields: &[(String, String)],
    form: Vec<(&str, String)>,
    nonce: Option<&str>,
    (back, back_text): (String, String),
) -> Markup {
    let body = html! {
        h1 { "Dead letter" }
        @if l.readable() {
            (rows(fields))
            (message_block(l.msg()))
        } @else {
            p { "Not a letter the worker wrote (a JSON object with a \"msg\"); as stored:" }
            pre data-k="msg" { (String::from_utf8_lossy(l.as_stored())) }
        }
        @match nonce {
            Some(n) => {
                form method="post" action="/dead/requeue" {
                    input type="hidden" name="nonce" value=(n);
                    @for (name, value) in &form {
                        input type="hidden" name=(name) value=(value);
                    }
                    (action_buttons("this letter"))
                }
            }
            None => { (read_only_note()) }
        }
        p { a href=(back) { (back_text) } }
    };
    layout("Dead letter", false, body)
}

/// After a requeue or purge.
pub struct Done<'a> {
    pub title: String,
    pub report: Option<&'a RequeueReport>,
    pub purged: &'a [String],
    pub missing: &'a [String],
    /// Where the missing ids were looked for, when not everywhere.
    pub not_found: Option<&'a str>,
    pub back: String,
}

pub fn done(v: &Done) -> Markup {
    let list = |ids: &[String]| ids.join(", ");
    let body = html! {
        h1 data-k="done" { (v.title) }
        ul {
            @if let Some(r) = v.report {
                @if !r.requeued.is_empty() {
                    li data-k="requeued" { "Requeued, due now: " (list(&r.requeued)) }
                }
                @if !r.as_is.is_empty() {
                    li { "Not a JSON object, requeued as written (they will be dead-lettered again): " (list(&r.as_is)) }
                }
                @if !r.key_scheduled.is_empty() {
                    li { "Left in place, their job key is scheduled again, or a newer letter of it is dead, and the newer push wins: " (list(&r.key_scheduled)) }
                }
                @for (id, why) in &r.cannot {
                    li { "Left " (id) ": " (why) }
                }
                @for (id, why) in &r.refused {
                    li data-k="refused" { "Refused " (id) ", it would die again at once: " (why) " (fix the cause, or requeue it with `worker dead requeue --force`)" }
                }
                @if !r.gone.is_empty() {
                    li data-k="gone" { "Already requeued or purged by someone else: " (list(&r.gone)) }
                }
            }
            @if !v.purged.is_empty() {
                li data-k="purged" { "Deleted: " (list(v.purged)) }
            }
            @if !v.missing.is_empty() {
                li data-k="missing" {
                    @match v.not_found {
                        Some(why) => { (why.get(..1).unwrap_or("").to_uppercase()) (why.get(1..).unwrap_or("")) ": " }
                        None => { "No such dead letter (requeued or purged by someone else, or never there): " }
                    }
                    (list(v.missing))
                }
            }
        }
        p { a href=(v.back) { "← Dead letters" } }
    };
    layout(&v.title, false, body)
}
