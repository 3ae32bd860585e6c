//! Requeue and purge from the status page, only with `--admin-token-file`.
//!
//! A POST to `/dead/requeue` or `/dead/purge` carries the letters' ids (`id`, repeated;
//! list mode also `queue` and the page position `at`) and is refused with `403`, changing
//! nothing, unless:
//! - its `Origin` and `Referer`, when sent, are this page's own (`http://<Host>`);
//! - it carries the admin token, in the form (`token`) or as `Authorization: Bearer`,
//!   compared in constant time;
//! - a token sent in the form comes with this process's form nonce (`nonce`, a random
//!   value made at start and put into every form), so only a form this page rendered
//!   can submit it. Another site can neither read the nonce nor know the token; a
//!   header it cannot send at all.
//!
//! The changes are those of `worker dead requeue | purge` (`admin::dead`, `dead::list`),
//! and each is logged with what it touched: requeues at info, purges and refusals at warn.

use super::{view, Page};
use crate::admin::dead::{self, RequeueReport};
use crate::admin::{self, is_stream_id};
use crate::config::{AdminToken, Source};
use crate::metrics::{Request, Response};

/// Letters one POST may name: one store script call's worth (`dead::PAGE`).
const MAX_IDS: usize = 100;

pub struct Actions {
    token: AdminToken,
    nonce: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requeue,
    Purge,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Requeue => "requeue",
            Kind::Purge => "purge",
        }
    }
}

/// A checked form.
struct Form {
    ids: Vec<String>,
    queue: Option<String>,
    at: usize,
}

/// A fresh random value, hex.
fn random_hex() -> String {
    let mut b = [0u8; 16];
    if let Err(e) = getrandom::getrandom(&mut b) {
        // Not the lock (the token is): only ties a form to this run.
        log::warn!(
            "status page: no system randomness for the form nonce ({e}); using a weaker one"
        );
        b.iter_mut().for_each(|x| *x = fastrand::u8(..));
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Actions {
    pub fn new(token: AdminToken) -> Actions {
        Actions {
            token,
            nonce: random_hex(),
        }
    }

    pub fn nonce(&self) -> &str {
        &self.nonce
    }

    pub fn handle(&self, page: &Page, req: &Request) -> Response {
        let kind = if req.path == "/dead/requeue" {
            Kind::Requeue
        } else {
            Kind::Purge
        };
        let form = match self.check(req) {
            Ok(f) => f,
            Err((status, why)) => {
                log::warn!("status page: refused a {}: {why}", kind.name());
                return Response::text(status, format!("{why}\n"));
            }
        };
        if page.config.source == Source::List {
            self.on_list(page, kind, &form)
        } else {
            self.on_stream(page, kind, &form)
        }
    }

    /// The form, once the request has passed every check; else the status and why.
    fn check(&self, req: &Request) -> Result<Form, (u16, String)> {
        let forbidden = |why: &str| Err((403, why.to_string()));
        // Same origin: a browser says where a form came from.
        let own = req.header("host").map(|h| format!("http://{h}"));
        if let Some(origin) = req.header("origin") {
            if own.as_deref() != Some(origin) {
                return forbidden(&format!("the request comes from another origin ({origin})"));
            }
        }
        if let Some(referer) = req.header("referer") {
            let ok = own
                .as_deref()
                .is_some_and(|o| referer == o || referer.starts_with(&format!("{o}/")));
            if !ok {
                return forbidden("the request comes from another page (Referer)");
            }
        }
        let form_type = req
            .content_type
            .as_deref()
            .is_some_and(|t| t.starts_with("application/x-www-form-urlencoded"));
        if !form_type && !req.body.is_empty() {
            return Err((
                415,
                "send the fields as a form (application/x-www-form-urlencoded)".into(),
            ));
        }
        let fields: Vec<(String, String)> =
            form_urlencoded::parse(&req.body).into_owned().collect();
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let bearer = req
            .header("authorization")
            .and_then(|a| a.strip_prefix("Bearer "))
            .map(str::trim);
        match (bearer, field("token")) {
            (Some(t), _) => {
                if !self.token.matches(t.as_bytes()) {
                    return forbidden("wrong admin token");
                }
            }
            (None, Some(t)) => {
                if !self.token.matches(t.as_bytes()) {
                    return forbidden("wrong admin token");
                }
                let nonce = field("nonce").unwrap_or("");
                let same: bool =
                    subtle::ConstantTimeEq::ct_eq(nonce.as_bytes(), self.nonce.as_bytes()).into();
                if !same {
                    return forbidden(
                        "the form is not from this worker's page (or the worker restarted since): reload the page",
                    );
                }
            }
            (None, None) => return forbidden("no admin token"),
        }
        let mut ids: Vec<String> = Vec::new();
        for (k, v) in &fields {
            if k == "id" && !v.is_empty() && !ids.contains(v) {
                ids.push(v.clone());
            }
        }
        if ids.is_empty() {
            return Err((400, "no dead letter selected (id)".into()));
        }
        if ids.len() > MAX_IDS {
            return Err((400, format!("at most {MAX_IDS} letters at once")));
        }
        Ok(Form {
            ids,
            queue: field("queue").map(str::to_string),
            at: field("at").and_then(|a| a.parse().ok()).unwrap_or(0),
        })
    }

    fn on_stream(&self, page: &Page, kind: Kind, form: &Form) -> Response {
        if let Some(bad) = form.ids.iter().find(|id| !is_stream_id(id)) {
            return Response::text(400, format!("{bad:?} is not a dead-letter id\n"));
        }
        let keys = &page.config.keys;
        let now = crate::now_ms();
        let done = page.with_redis(|con| {
            let found = dead::fetch(con, keys, &form.ids, now)?;
            let mut letters = Vec::new();
            let mut missing = Vec::new();
            for (id, d) in form.ids.iter().zip(found) {
                match d {
                    Some(d) => letters.push(d),
                    None => missing.push(id.clone()),
                }
            }
            let ids: Vec<String> = letters.iter().map(|d| d.id.clone()).collect();
            Ok(match kind {
                Kind::Requeue => (
                    Some(dead::requeue(con, keys, &letters, now)?),
                    ids,
                    0,
                    missing,
                ),
                Kind::Purge => (None, ids, dead::purge(con, keys, &letters)?, missing),
            })
        });
        match done {
            Ok((report, ids, purged, missing)) => finish(
                kind,
                &keys.dead,
                report,
                &ids,
                purged,
                missing,
                "/dead".into(),
            ),
            Err(e) => failed(kind, &e),
        }
    }

    fn on_list(&self, page: &Page, kind: Kind, form: &Form) -> Response {
        let Some(q) = form
            .queue
            .as_deref()
            .and_then(|n| page.config.keys.queues.iter().find(|q| q.name == n))
        else {
            return Response::text(400, "queue: not one of this worker's queues\n");
        };
        let mut ids = Vec::new();
        for id in &form.ids {
            match dead::list::parse_id(id) {
                Ok(id) => ids.push(id),
                Err(e) => return Response::text(400, format!("{}\n", admin::one_line(&e))),
            }
        }
        let now = crate::now_ms();
        let done = page.with_redis(|con| {
            let mut letters = Vec::new();
            let mut missing = Vec::new();
            for id in &ids {
                match dead::list::find_near(con, q, id, now, form.at, super::FIND_BUDGET)? {
                    Some(l) => letters.push(l),
                    None => missing.push(id.clone()),
                }
            }
            let found: Vec<String> = letters.iter().map(|l| l.id.clone()).collect();
            Ok(match kind {
                Kind::Requeue => (
                    Some(dead::list::requeue(con, &page.config.keys, q, &letters)?),
                    found,
                    0,
                    missing,
                ),
                Kind::Purge => (None, found, dead::list::purge(con, q, &letters)?, missing),
            })
        });
        let back = format!(
            "/dead?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair("queue", &q.name)
                .finish()
        );
        match done {
            Ok((report, found, purged, missing)) => {
                finish(kind, &q.dead, report, &found, purged, missing, back)
            }
            Err(e) => failed(kind, &e),
        }
    }
}

/// Logs what an action did and shows it.
fn finish(
    kind: Kind,
    key: &str,
    report: Option<RequeueReport>,
    found: &[String],
    purged: u64,
    missing: Vec<String>,
    back: String,
) -> Response {
    let title;
    let mut purged_ids: Vec<String> = Vec::new();
    match (&report, kind) {
        (Some(r), _) => {
            log::info!(
                "status page: requeued {} dead letter(s) of {key}: {}",
                r.requeued.len(),
                r.requeued.join(", ")
            );
            let left: Vec<String> = r
                .key_scheduled
                .iter()
                .map(|id| format!("{id} (job key scheduled again)"))
                .chain(r.cannot.iter().map(|(id, why)| format!("{id} ({why})")))
                .chain(r.gone.iter().map(|id| format!("{id} (already gone)")))
                .chain(missing.iter().map(|id| format!("{id} (no such letter)")))
                .collect();
            if !left.is_empty() {
                log::warn!(
                    "status page: requeue of {key} left {} letter(s): {}",
                    left.len(),
                    left.join(", ")
                );
            }
            title = format!("Requeued {} dead letter(s)", r.requeued.len());
        }
        (None, _) => {
            log::warn!(
                "status page: purged {purged} dead letter(s) of {key}: {}",
                found.join(", ")
            );
            if !missing.is_empty() {
                log::warn!(
                    "status page: purge of {key}: no such letter {}",
                    missing.join(", ")
                );
            }
            purged_ids = found.to_vec();
            title = format!("Purged {purged} dead letter(s)");
        }
    }
    super::html(
        200,
        view::done(&view::Done {
            title,
            report: report.as_ref(),
            purged: &purged_ids,
            missing: &missing,
            back,
        }),
    )
}

fn failed(kind: Kind, e: &anyhow::Error) -> Response {
    let line = admin::one_line(e);
    log::warn!("status page: {} failed: {line}", kind.name());
    super::html(
        503,
        view::message(&format!("The {} failed", kind.name()), &line),
    )
}
