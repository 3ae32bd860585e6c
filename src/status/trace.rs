//! `GET /trace?q=...`: the status page's search box, the trace of a job key or, when the
//! key has no trace, of an order number (`worker trace KEY`, then `worker trace --order
//! Q`), gathered by the same code ([`crate::trace::gather`]) and worded by the same
//! functions (`admin::trace`). Escaped as every page is (maud). The inbox is read on a
//! PostgreSQL connection made for the search (within [`DB_CONNECT`], each statement
//! within [`DB_STATEMENT`]); while PostgreSQL does not answer, the page shows Redis's
//! part and says so.

use super::{html, view, Page};
use crate::admin::trace::{asked, describe, due_line, heading};
use crate::http::Response;
use crate::trace::{Query, Trace};
use maud::{html, Markup};
use std::time::Duration;

/// A search's PostgreSQL connection is made within this.
pub const DB_CONNECT: Duration = Duration::from_secs(2);
/// Each of its statements runs within this.
pub const DB_STATEMENT: Duration = Duration::from_secs(2);
/// The longest search text taken.
const MAX_QUERY: usize = 1_000;

impl Page<'_> {
    /// The trace page: the search box, and the trace of `q` when given.
    pub(super) fn trace(&self, q: Option<&str>) -> Response {
        let Some(q) = q.map(str::trim).filter(|q| !q.is_empty()) else {
            return html(200, page(None));
        };
        if q.len() > MAX_QUERY {
            return super::bad_request(&format!("a search is at most {MAX_QUERY} bytes"));
        }
        let mut db = inbox(&self.config.database_url);
        let found = self.with_redis(|con| {
            let now = crate::figures::redis_now_ms(con, self.config)?;
            let mut t = crate::trace::gather(
                con,
                db.as_mut().ok(),
                self.config,
                &Query::key(q, None),
                now,
            )?;
            if t.gone() {
                let by_order = crate::trace::gather(
                    con,
                    db.as_mut().ok(),
                    self.config,
                    &Query::order(q, None),
                    now,
                )?;
                if !by_order.gone() {
                    t = by_order;
                }
            }
            Ok(t)
        });
        match found {
            Ok(mut t) => {
                if let Err(e) = &db {
                    t.inbox_error = Some(e.clone());
                }
                html(200, page(Some(&t)))
            }
            Err(e) => self.unavailable(&e),
        }
    }
}

/// A connection to read the inbox, or why there is none.
fn inbox(url: &str) -> Result<postgres::Client, String> {
    let mut c = crate::db::Target::parse(url)
        .map_err(|e| e.to_string())?
        .connect_within(DB_CONNECT)
        .map_err(|e| e.to_string())?;
    c.batch_execute(&format!(
        "SET statement_timeout = {}",
        DB_STATEMENT.as_millis()
    ))
    .map_err(|e| e.to_string())?;
    Ok(c)
}

fn page(t: Option<&Trace>) -> Markup {
    view::layout(
        "Trace",
        false,
        html! {
            h1 { "Trace" }
            @if let Some(t) = t {
                p data-k="asked" {
                    (asked(&t.query)) ": "
                    @match t.jobs.len() { 0 => { "no job" }, 1 => { "1 job" }, n => { (n) " jobs, oldest first" } }
                    span.muted { " (Redis's clock " (crate::admin::fmt_time(t.now_ms)) ")" }
                }
                @if t.gone() {
                    p.box data-state="gone" { (t.gone_why()) }
                }
                @for j in &t.jobs {
                    div.box data-state=(j.state.name()) data-job-id=[j.job_id.as_deref()] data-key=(j.key) {
                        strong { (heading(j, t.query.key.is_none())) }
                        p { (describe(j, t.now_ms)) }
                        @if let Some(d) = due_line(j, t.now_ms) { p.muted { (d) } }
                        @for n in &j.notes { p.muted { "note: " (n) } }
                    }
                }
                @for n in &t.notes { p.muted { "note: " (n) } }
                @if let Some(e) = &t.inbox_error {
                    p.box.bad { "The inbox (worker_inbox) could not be read, so done jobs are missing: " (e) }
                }
            } @else {
                p.muted { "A job key (order.timeout:SO123) or an order number (SO123): where each of its jobs is now, or how it ended, as worker trace shows it." }
            }
        },
    )
}
