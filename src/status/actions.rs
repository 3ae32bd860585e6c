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
//! The changes are those of `worker dead requeue | purge` (the dead-letter model, `dead/`),
//! and each is logged with what it touched: requeues at info, purges and refusals at warn.
//! With `--shards N` the ids are `<shard>/<id>` (or bare ids held by one shard), and each
//! shard's letters are changed in that shard and logged under its stream and number.

use super::{view, Page};
use crate::config::{AdminToken, Source};
use crate::dead::{self, RequeueReport};
use crate::http::{Request, Response};
use crate::keys::Keys;
use crate::store::stream::is_stream_id;

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
/// The token of an `Authorization: Bearer <token>` header; the scheme's name is
/// case-insensitive (RFC 7235), other schemes carry none.
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

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
        let bearer = req.header("authorization").and_then(bearer_token);
        match (bearer, field("token")) {
            (Some(t), form) => {
                // A wrong token is refused wherever it is, also next to a right one.
                if !self.token.matches(t.as_bytes())
                    || form.is_some_and(|f| !self.token.matches(f.as_bytes()))
                {
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
        if page.config.shards > 1 {
            return self.on_shards(page, kind, form);
        }
        if let Some(bad) = form.ids.iter().find(|id| !is_stream_id(id)) {
            return Response::text(400, format!("{bad:?} is not a dead-letter id\n"));
        }
        let keys = &page.config.keys;
        // A requeued letter is due now on the shared clock.
        let now = page.stats.clock.now_ms();
        let registry = page.registry();
        let screen = page.screen(&registry);
        match page.with_redis(|con| on_set(con, keys, kind, &form.ids, now, &screen)) {
            Ok(done) => finish(&keys.dead, done, "/dead".into()),
            Err(e) => failed(kind, &e, &[]),
        }
    }

    /// With `--shards N`: the ids are `<shard>/<id>`, or bare ids held by one shard
    /// (`dead::locate`); each shard's letters are requeued or purged in that shard, one
    /// shard after the other, each logged with its shard as it is done.
    fn on_shards(&self, page: &Page, kind: Kind, form: &Form) -> Response {
        let shards = &page.config.derived.shards;
        let now = page.stats.clock.now_ms();
        // Every id placed before anything changes: a form with one id that names no
        // shard changes nothing.
        let placed = page.with_redis(|con| {
            let mut out = Vec::new();
            for id in &form.ids {
                out.push(dead::locate(con, shards, id, now)?);
            }
            Ok(out)
        });
        let placed = match placed {
            Ok(p) => p,
            Err(e) => return failed(kind, &e, &[]),
        };
        let mut by_shard: Vec<Vec<String>> = vec![Vec::new(); shards.len()];
        for (given, p) in form.ids.iter().zip(placed) {
            match p {
                Ok((s, id)) if is_stream_id(&id) => {
                    if !by_shard[s].contains(&id) {
                        by_shard[s].push(id);
                    }
                }
                Ok(_) => {
                    return Response::text(400, format!("{given:?} is not a dead-letter id\n"))
                }
                Err(why) => return Response::text(400, format!("{why}\n")),
            }
        }
        let registry = page.registry();
        let screen = page.screen(&registry);
        let mut all = Done::default();
        let mut each: Vec<(usize, Done)> = Vec::new();
        for (s, ids) in by_shard.iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let keys = &shards[s];
            match page.with_redis(|con| on_set(con, keys, kind, ids, now, &screen)) {
                Ok(done) => {
                    let done = done.in_shard(s);
                    log_done(&format!("{} (shard {s})", keys.dead), &done);
                    each.push((s, done.clone()));
                    all.add(done);
                }
                Err(e) => {
                    let before: Vec<String> = each
                        .iter()
                        .map(|(s, d)| format!("shard {s}: {}", d.summary()))
                        .collect();
                    return failed(
                        kind,
                        &e.context(format!("shard {s} ({})", keys.dead)),
                        &before,
                    );
                }
            }
        }
        render(&all, "/dead".into())
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
                Err(e) => return Response::text(400, format!("{}\n", crate::text::one_line(&e))),
            }
        }
        let now = crate::now_ms();
        // Looked for near `at` (the form's page) through a page's letters, then from the
        // head, as a letter's page looks.
        let budget = super::FIND_BUDGET;
        let near = (form.at, super::DEAD_BUDGET);
        let registry = page.registry();
        let screen = page.screen(&registry);
        let done = page.with_redis(|con| {
            let found = dead::list::find_near(con, q, &ids, now, near, budget)?;
            let (letters, missing) = dead::sort_found(&ids, found, |_| true);
            let found: Vec<String> = letters.iter().map(|l| l.id.clone()).collect();
            let not_found = Some(format!(
                "not found: already requeued or purged by someone else, or not in the first {budget} letters of {} (or near position {})",
                q.dead, form.at
            ));
            Ok(match kind {
                Kind::Requeue => Done {
                    report: Some(dead::list::requeue_with(
                        con,
                        &page.config.keys,
                        q,
                        &letters,
                        Some(&screen),
                    )?),
                    found,
                    purged: 0,
                    missing,
                    not_found,
                },
                Kind::Purge => Done {
                    report: None,
                    found,
                    purged: dead::list::purge(con, q, &letters)?,
                    missing,
                    not_found,
                },
            })
        });
        let back = format!(
            "/dead?{}",
            form_urlencoded::Serializer::new(String::new())
                .append_pair("queue", &q.name)
                .finish()
        );
        match done {
            Ok(done) => finish(&q.dead, done, back),
            Err(e) => failed(kind, &e, &[]),
        }
    }
}

/// What one requeue or purge did on one key set, by letter id.
#[derive(Default, Clone)]
struct Done {
    /// A requeue's report; `None` for a purge.
    report: Option<RequeueReport>,
    /// The letters found (a purge deletes those).
    found: Vec<String>,
    /// How many a purge deleted.
    purged: u64,
    /// Ids named that are no letter.
    missing: Vec<String>,
    /// Where those were looked for, when not everywhere: list mode.
    not_found: Option<String>,
}

impl Done {
    /// The same with every id written `<shard>/<id>`.
    fn in_shard(self, shard: usize) -> Done {
        let q = |ids: Vec<String>| -> Vec<String> {
            ids.iter().map(|id| dead::shard_id(shard, id)).collect()
        };
        Done {
            report: self.report.map(|r| r.in_shard(shard)),
            found: q(self.found),
            purged: self.purged,
            missing: q(self.missing),
            not_found: self.not_found,
        }
    }

    fn add(&mut self, d: Done) {
        if let Some(r) = d.report {
            self.report
                .get_or_insert_with(RequeueReport::default)
                .add(r);
        }
        self.found.extend(d.found);
        self.purged += d.purged;
        self.missing.extend(d.missing);
    }

    /// What was done, in a few words.
    fn summary(&self) -> String {
        match &self.report {
            Some(r) => format!("requeued {}", r.requeued.join(", ")),
            None => format!("purged {}", self.found.join(", ")),
        }
    }
}

/// A requeue or purge of the dead letters `ids` of one key set's stream.
fn on_set(
    con: &mut dyn redis::ConnectionLike,
    keys: &Keys,
    kind: Kind,
    ids: &[String],
    now: i64,
    screen: &dead::Screen,
) -> anyhow::Result<Done> {
    let found = dead::fetch(con, keys, ids, now)?;
    let (letters, missing) = dead::sort_found(ids, found, |_| true);
    let found: Vec<String> = letters.iter().map(|d| d.id.clone()).collect();
    Ok(match kind {
        Kind::Requeue => Done {
            report: Some(dead::requeue_with(con, keys, &letters, now, Some(screen))?),
            found,
            purged: 0,
            missing,
            not_found: None,
        },
        Kind::Purge => Done {
            report: None,
            purged: dead::purge(con, keys, &letters)?,
            found,
            missing,
            not_found: None,
        },
    })
}

/// Logs what an action did and shows it.
fn finish(key: &str, done: Done, back: String) -> Response {
    log_done(key, &done);
    render(&done, back)
}

/// Logs what an action did to the letters of `key`: requeues at info, what a requeue
/// left and purges at warn.
fn log_done(key: &str, done: &Done) {
    let not_found = done
        .not_found
        .as_deref()
        .unwrap_or("no such letter: requeued or purged by someone else, or never there");
    match &done.report {
        Some(r) => {
            if !r.requeued.is_empty() {
                log::info!(
                    "status page: requeued {} dead letter(s) of {key}: {}",
                    r.requeued.len(),
                    r.requeued.join(", ")
                );
            }
            let left: Vec<String> = r
                .key_scheduled
                .iter()
                .map(|id| format!("{id} (job key scheduled again, or a newer letter of it dead)"))
                .chain(r.cannot.iter().map(|(id, why)| format!("{id} ({why})")))
                .chain(
                    r.refused
                        .iter()
                        .map(|(id, why)| format!("{id} (refused: {why})")),
                )
                .chain(r.gone.iter().map(|id| format!("{id} (already gone)")))
                .chain(done.missing.iter().map(|id| format!("{id} ({not_found})")))
                .collect();
            if !left.is_empty() {
                log::warn!(
                    "status page: requeue of {key} left {} letter(s): {}",
                    left.len(),
                    left.join(", ")
                );
            }
        }
        None => {
            if !done.found.is_empty() {
                log::warn!(
                    "status page: purged {} dead letter(s) of {key}: {}",
                    done.purged,
                    done.found.join(", ")
                );
            }
            if !done.missing.is_empty() {
                log::warn!(
                    "status page: purge of {key}: {not_found}: {}",
                    done.missing.join(", ")
                );
            }
        }
    }
}

/// The page after an action.
fn render(done: &Done, back: String) -> Response {
    let (title, purged): (String, &[String]) = match &done.report {
        Some(r) => (format!("Requeued {} dead letter(s)", r.requeued.len()), &[]),
        None => (
            format!("Purged {} dead letter(s)", done.purged),
            &done.found,
        ),
    };
    super::html(
        200,
        view::done(&view::Done {
            title,
            report: done.report.as_ref(),
            purged,
            missing: &done.missing,
            not_found: done.not_found.as_deref(),
            back,
        }),
    )
}

/// An action that failed; `before` what it had done on other shards first.
fn failed(kind: Kind, e: &anyhow::Error, before: &[String]) -> Response {
    let mut line = crate::text::one_line(e);
    if !before.is_empty() {
        line = format!("{line}; done before it failed: {}", before.join("; "));
    }
    log::warn!("status page: {} failed: {line}", kind.name());
    super::html(
        503,
        view::message(&format!("The {} failed", kind.name()), &line),
    )
}

#[cfg(test)]
mod tests {
    use super::bearer_token;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for h in ["Bearer t0k", "bearer t0k", "BEARER  t0k ", "\tBearer\tt0k"] {
            assert_eq!(bearer_token(h), Some("t0k"), "{h:?}");
        }
        for h in ["Basic dXNlcg==", "Bearer", "Bearert0k", ""] {
            assert_eq!(bearer_token(h), None, "{h:?}");
        }
    }
}
