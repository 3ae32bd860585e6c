//! `worker dead list|show|requeue|purge`: the operator's hands on the dead letters, in the
//! terminal. What a letter is and how letters are read, found, requeued and purged is the
//! model's (`dead/`, which the status page drives too); this file holds the flags, picks
//! the key sets (each shard's with `--shards N`; in list mode, each queue's dead list) and
//! prints.

use super::write_json;
use crate::config::{Config, Source};
use crate::dead::{self, list as dl, DeadLetter, Filter, Letter, RequeueReport};
use crate::keys::Keys;
use crate::store::stream::is_stream_id;
use crate::text::{clip, fmt_age, or_dash};
use anyhow::Context;
use clap::{ArgGroup, Args, Subcommand};
use std::io::Write;
use std::process::ExitCode;

const READ: &str = "cannot read the dead letters";
const READ_LISTS: &str = "cannot read the dead lists";

/// List, show, requeue or purge the dead letters.
#[derive(Args, Debug, Clone)]
pub struct DeadArgs {
    #[command(subcommand)]
    pub command: DeadCommand,
}

#[derive(Subcommand, Debug, Clone)]
pub enum DeadCommand {
    /// One line per dead letter, oldest first: id, age, event, job key, attempts, reason.
    List(ListArgs),
    /// Every field of one dead letter, the message pretty-printed.
    Show(ShowArgs),
    /// Put dead letters back into the delay pool, due now, with `retry` reset to 0;
    /// all that match the filters, or those named by --id.
    Requeue(RequeueArgs),
    /// Delete dead letters; refuses to run without --older-than or --all.
    Purge(PurgeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ListArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Print a JSON array (every field; the message as a string).
    #[arg(long)]
    pub json: bool,
    /// Show at most this many (the oldest; with --shards, of all shards).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

#[derive(Args, Debug, Clone)]
pub struct ShowArgs {
    /// The dead letter's id, as `worker dead list` prints it.
    pub id: String,
    /// Print it as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug, Clone)]
pub struct RequeueArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Requeue this dead letter (repeat for several); the filters still apply.
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<String>,
    /// Requeue at most this many, the oldest first (e.g. 1, to try a fix on one); with
    /// --shards, over all shards.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Requeue under this event instead (a producer's typo: `--event order.timout
    /// --as-event order.timeout`); the letter is checked against the new event's handler.
    #[arg(long, value_name = "EVENT")]
    pub as_event: Option<String>,
    /// Requeue even letters that would die again at once (no handler for the event, a
    /// required field missing, not a whole message).
    #[arg(long)]
    pub force: bool,
    /// Directory of the worker's extra SQL handlers (*.sql), to check letters against
    /// (the built-in events are always known).
    #[arg(long, value_name = "DIR")]
    pub handlers_dir: Option<std::path::PathBuf>,
}

impl RequeueArgs {
    /// The handlers a letter is held against: the built-in ones and `--handlers-dir`'s.
    fn registry(&self) -> anyhow::Result<crate::handlers::Registry> {
        let mut r = crate::handlers::Registry::builtin();
        if let Some(dir) = &self.handlers_dir {
            for h in crate::handlers::sql::SqlHandler::load_dir(dir)
                .map_err(|e| super::handlers_check::BadDir(format!("--handlers-dir: {e}")))?
            {
                r.register(Box::new(h));
            }
        }
        Ok(r)
    }

    fn screen<'a>(
        &'a self,
        registry: &'a crate::handlers::Registry,
        limit: usize,
        served: &'a [String],
    ) -> dead::Screen<'a> {
        dead::Screen {
            registry,
            new_event: self.as_event.as_deref(),
            limit,
            force: self.force,
            served,
        }
    }
}

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("scope").required(true).args(["older_than", "all"])))]
pub struct PurgeArgs {
    #[command(flatten)]
    pub filter: Filter,
    /// Purge whatever their age (--event and --newer-than still apply).
    #[arg(long)]
    pub all: bool,
}

/// What every step of one command works with: its Redis connection, the time on Redis's
/// clock it reads ages and filters against, and where it prints.
struct Cmd<'a> {
    con: &'a mut dyn redis::ConnectionLike,
    now: i64,
    out: &'a mut dyn Write,
    /// `--max-message-bytes`: a requeued message is held to it as the worker would.
    max_message: usize,
    /// A requeue's: the built-in handlers and `--handlers-dir`'s, and the events the live
    /// workers serve (their heartbeats' records).
    registry: crate::handlers::Registry,
    served: Vec<String>,
}

pub(super) fn run(
    config: &Config,
    args: &DeadArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let mut con = super::connect(config)?;
    // Ages, filters and a requeue's due time on Redis's clock (which stamps a list
    // letter's `ts` too).
    let now = crate::figures::redis_now_ms(&mut con, config)?;
    // A requeue is held against the handlers: the files' and the live workers'.
    let (registry, served) = match &args.command {
        DeadCommand::Requeue(a) => (a.registry()?, served(&mut con, config, now)?),
        _ => (crate::handlers::Registry::default(), Vec::new()),
    };
    let r = &mut Cmd {
        con: &mut con,
        now,
        out,
        max_message: config.jobs.max_message_bytes,
        registry,
        served,
    };
    if config.source == Source::List {
        return on_lists(r, &config.keys, args);
    }
    let shards = &config.derived.shards;
    if shards.len() == 1 {
        return one_set(r, &config.keys, args);
    }
    // `--shards N`: ids are written `<shard>/<id>` (a stream id is unique only within its
    // shard's stream); a list and a requeue's `--limit` span all shards.
    match &args.command {
        DeadCommand::List(a) => {
            let letters =
                dead::oldest_sharded(r.con, shards, &a.filter, now, a.limit.saturating_add(1))
                    .context(READ)?;
            print_stream_list(
                letters.into_iter().map(|(s, d)| (Some(s), d)).collect(),
                a,
                r.out,
            )
        }
        DeadCommand::Show(a) => {
            let (shard, id) = locate_arg(r.con, r.now, shards, &a.id)?;
            let one = ShowArgs { id, json: a.json };
            show(r, &shards[shard], &one)
        }
        DeadCommand::Requeue(a) => requeue_sharded(r, shards, a),
        DeadCommand::Purge(_) => {
            for (i, keys) in shards.iter().enumerate() {
                write!(r.out, "shard {i} ({}): ", keys.dead)?;
                one_set(r, keys, args)?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One key set's dead-letter stream (the only one, or one shard's).
fn one_set(r: &mut Cmd, keys: &Keys, args: &DeadArgs) -> anyhow::Result<ExitCode> {
    match &args.command {
        DeadCommand::List(a) => {
            // One more than shown tells whether there are more.
            let letters = dead::scan(
                r.con,
                keys,
                &a.filter,
                r.now,
                Some(a.limit.saturating_add(1)),
            )
            .context(READ)?;
            print_stream_list(letters.into_iter().map(|d| (None, d)).collect(), a, r.out)
        }
        DeadCommand::Show(a) => show(r, keys, a),
        DeadCommand::Requeue(a) => requeue_cmd(r, keys, a),
        DeadCommand::Purge(a) => {
            let mut scan = dead::Scan::new(keys, &a.filter, r.now);
            let mut purged = 0;
            while let Some(page) = scan.next_page(r.con).context(READ)? {
                purged += dead::purge(r.con, keys, &page).context("cannot purge")?;
            }
            writeln!(r.out, "purged {purged}")?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Every queue's dead list (list mode).
fn on_lists(r: &mut Cmd, keys: &Keys, args: &DeadArgs) -> anyhow::Result<ExitCode> {
    match &args.command {
        DeadCommand::List(a) => {
            // A dead list of another type is told and left out; the others are listed.
            let bad =
                crate::store::list::dead_lists_of_another_type(r.con, keys).context(READ_LISTS)?;
            let readable = keys
                .queues
                .iter()
                .filter(|q| !bad.iter().any(|w| w.key == q.dead));
            let mut letters =
                dl::scan_queues(r.con, readable, &a.filter, r.now, a.limit.saturating_add(1))
                    .context(READ_LISTS)?;
            let more = letters.len() > a.limit;
            letters.truncate(a.limit);
            let code = if a.json {
                write_json(r.out, &letters)?;
                ExitCode::SUCCESS
            } else {
                let lines: Vec<Line> = letters
                    .iter()
                    .map(|l| (l.id.clone(), Some(l.queue.as_str()), l as &dyn Letter))
                    .collect();
                print_table(&lines, more.then_some(a.limit), r.out)?
            };
            for w in &bad {
                eprintln!("not read: {w}; rename or remove the key");
            }
            Ok(if bad.is_empty() {
                code
            } else {
                ExitCode::FAILURE
            })
        }
        DeadCommand::Show(a) => {
            let id = dl::parse_id(&a.id)?;
            let found = dl::find(r.con, keys, std::slice::from_ref(&id), r.now)?;
            let Some(Some(l)) = found.into_iter().next() else {
                writeln!(r.out, "no dead letter {}", a.id)?;
                return Ok(ExitCode::FAILURE);
            };
            if a.json {
                write_json(r.out, &l)?;
            } else if !l.readable {
                writeln!(r.out, "dead letter  {}", l.id)?;
                writeln!(r.out, "queue        {}", l.queue)?;
                writeln!(
                    r.out,
                    "not a letter the worker wrote (a JSON object with a \"msg\"), as stored\n{}",
                    String::from_utf8_lossy(&l.raw)
                )?;
            } else {
                print_letter(&l, r.out)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCommand::Requeue(a) => requeue_lists(r, keys, a),
        DeadCommand::Purge(a) => {
            let mut purged = 0;
            for q in &keys.queues {
                let mut walk = dl::Walk::new(q);
                while let Some(page) = walk.next_page(r.con, r.now).context(READ_LISTS)? {
                    let doomed: Vec<dl::ListLetter> = page
                        .into_iter()
                        .filter(|l| a.filter.matches(l, r.now))
                        .collect();
                    purged += dl::purge(r.con, q, &doomed).context("cannot purge")?;
                    // Each of them is gone r.now, by this purge or another one.
                    walk.removed(doomed.len());
                }
            }
            writeln!(r.out, "purged {purged}")?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `worker dead list` prints of stream letters (one more than `--limit` when there
/// are more), each with its shard when there are shards.
fn print_stream_list(
    mut letters: Vec<(Option<usize>, DeadLetter)>,
    a: &ListArgs,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let more = letters.len() > a.limit;
    letters.truncate(a.limit);
    if a.json {
        let mut all = Vec::with_capacity(letters.len());
        for (s, d) in &letters {
            let mut v = serde_json::to_value(d)?;
            if let (Some(s), Some(o)) = (s, v.as_object_mut()) {
                o.insert("id".into(), dead::shard_id(*s, &d.id).into());
                o.insert("shard".into(), (*s).into());
            }
            all.push(v);
        }
        write_json(out, &all)?;
        return Ok(ExitCode::SUCCESS);
    }
    let lines: Vec<Line> = letters
        .iter()
        .map(|(s, d)| {
            let id = s.map_or_else(|| d.id.clone(), |s| dead::shard_id(s, &d.id));
            (id, None, d as &dyn Letter)
        })
        .collect();
    print_table(&lines, more.then_some(a.limit), out)
}

/// A line of the table: the id as shown, the queue (list mode), the letter.
type Line<'a> = (String, Option<&'a str>, &'a dyn Letter);

/// The table of `worker dead list`; `cut`: the `--limit` that left more unshown.
fn print_table(
    lines: &[Line],
    cut: Option<usize>,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    let Some((_, first_queue, _)) = lines.first() else {
        writeln!(out, "no dead letters")?;
        return Ok(ExitCode::SUCCESS);
    };
    let keys: Vec<String> = lines
        .iter()
        .map(|(_, _, l)| String::from_utf8_lossy(&l.facts().key).into_owned())
        .collect();
    let width = |f: &dyn Fn(usize) -> usize, title: &str, cap: usize| {
        (0..lines.len())
            .map(f)
            .max()
            .unwrap_or(0)
            .max(title.len())
            .min(cap)
    };
    let wi = width(&|i| lines[i].0.len(), "ID", 40);
    let wq = width(
        &|i| lines[i].1.map_or(0, |q| q.chars().count()),
        "QUEUE",
        32,
    );
    let we = width(&|i| lines[i].2.facts().event.chars().count(), "EVENT", 32);
    let wk = width(&|i| keys[i].chars().count(), "KEY", 40);
    // The queue column, in list mode.
    let queue = |q: &str| match first_queue {
        Some(_) => format!("{:wq$}  ", clip(q, wq)),
        None => String::new(),
    };
    writeln!(
        out,
        "{:wi$}  {}{:>6}  {:we$}  {:wk$}  {:>8}  REASON",
        "ID",
        queue("QUEUE"),
        "AGE",
        "EVENT",
        "KEY",
        "ATTEMPTS"
    )?;
    for ((id, q, l), key) in lines.iter().zip(&keys) {
        writeln!(
            out,
            "{id:wi$}  {}{:>6}  {:we$}  {:wk$}  {:>8}  {}",
            queue(q.unwrap_or("")),
            l.age_ms().map_or("?".to_string(), fmt_age),
            clip(or_dash(&l.facts().event), we),
            clip(or_dash(key), wk),
            l.facts()
                .attempts
                .map_or("-".to_string(), |n| n.to_string()),
            if l.readable() {
                clip(&l.facts().reason, 60)
            } else {
                "(not a letter the worker wrote: see show)".to_string()
            },
        )?;
    }
    if let Some(limit) = cut {
        writeln!(out, "... more not shown (--limit {limit})")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Every field of a letter, then its message pretty-printed (or as written).
fn print_letter(l: &dyn Letter, out: &mut dyn Write) -> anyhow::Result<()> {
    let rows = dead::rows(l, "dead letter", l.id().to_string(), true);
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in &rows {
        writeln!(out, "{k:w$}  {v}")?;
    }
    match serde_json::from_slice::<serde_json::Value>(l.msg()) {
        Ok(v) => writeln!(out, "message\n{}", serde_json::to_string_pretty(&v)?)?,
        Err(e) => writeln!(
            out,
            "message (not JSON: {e}), as written\n{}",
            String::from_utf8_lossy(l.msg())
        )?,
    }
    Ok(())
}

fn show(r: &mut Cmd, keys: &Keys, a: &ShowArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        is_stream_id(&a.id),
        "{:?} is not a dead-letter id (like 1768764300123-0)",
        a.id
    );
    let found = dead::fetch(r.con, keys, std::slice::from_ref(&a.id), r.now).context(READ)?;
    let Some(Some(d)) = found.into_iter().next() else {
        writeln!(r.out, "no dead letter {}", a.id)?;
        return Ok(ExitCode::FAILURE);
    };
    if a.json {
        write_json(r.out, &d)?;
    } else {
        print_letter(&d, r.out)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The events the live workers serve, from the records in their heartbeat keys.
fn served(
    con: &mut dyn redis::ConnectionLike,
    config: &Config,
    now: i64,
) -> anyhow::Result<Vec<String>> {
    let report =
        crate::figures::gather_all(con, config, now, std::time::Duration::ZERO).context(READ)?;
    let mut events: Vec<String> = report
        .workers
        .into_iter()
        .filter_map(|w| w.record)
        .flat_map(|r| r.events)
        .collect();
    events.sort();
    events.dedup();
    Ok(events)
}

fn requeue_cmd(r: &mut Cmd, keys: &Keys, a: &RequeueArgs) -> anyhow::Result<ExitCode> {
    let sc = &a.screen(&r.registry, r.max_message, &r.served);
    if a.ids.is_empty() {
        let report = requeue_oldest(r.con, r.now, std::slice::from_ref(keys), a, sc, false)?;
        return print_report(&report, &[], r.out);
    }
    for id in &a.ids {
        anyhow::ensure!(
            is_stream_id(id),
            "--id: {id:?} is not a dead-letter id (like 1768764300123-0)"
        );
    }
    // The same id twice is one letter, not a second one "gone".
    let ids = dead::distinct(a.ids.iter().cloned());
    let found = dead::fetch(r.con, keys, &ids, r.now).context(READ)?;
    let (mut letters, missing) = dead::sort_found(&ids, found, |d| a.filter.matches(d, r.now));
    letters.truncate(a.limit.unwrap_or(usize::MAX));
    let done = dead::requeue_with(r.con, keys, &letters, r.now, Some(sc));
    print_report(&done.context("cannot requeue")?, &missing, r.out)
}

/// The matching letters of every shard (`shards`: one for an unsharded worker), oldest
/// first, back into their pools until `--limit` of them were tried. A letter left because
/// a newer push of its key wins (its key scheduled again, or a newer letter of it dead) was
/// not tried: it does not count, and the walk goes on to the letters after it, so `--limit
/// 1` puts back the newer letter of such a key (found from outside: it said "requeued 0"
/// and never reached the newer one). `sharded`: ids reported as `<shard>/<id>`.
fn requeue_oldest(
    con: &mut dyn redis::ConnectionLike,
    now: i64,
    shards: &[Keys],
    a: &RequeueArgs,
    sc: &dead::Screen,
    sharded: bool,
) -> anyhow::Result<RequeueReport> {
    let mut left = a.limit.unwrap_or(usize::MAX);
    let mut report = RequeueReport::default();
    let mut walk = dead::OldestFirst::new(shards, &a.filter, now);
    while left > 0 {
        let next = walk.next(con, left.min(REQUEUE_PAGE)).context(READ)?;
        if next.is_empty() {
            break;
        }
        for (s, keys, of_s) in grouped(shards, next, |i, _, (s, _)| *s == i) {
            let letters: Vec<DeadLetter> = of_s.into_iter().map(|(_, d)| d).collect();
            let done =
                dead::requeue_with(con, keys, &letters, now, Some(sc)).context("cannot requeue")?;
            left -= letters.len() - done.key_scheduled.len();
            report.add(if sharded { done.in_shard(s) } else { done });
        }
    }
    Ok(report)
}

/// How many letters a requeue by filter reads and puts back at a time.
const REQUEUE_PAGE: usize = 500;

/// `worker dead requeue` in list mode: by filter, queue by queue, oldest first; or the
/// letters named, each onto its own queue.
fn requeue_lists(r: &mut Cmd, keys: &Keys, a: &RequeueArgs) -> anyhow::Result<ExitCode> {
    let sc = &a.screen(&r.registry, r.max_message, &r.served);
    let mut left = a.limit.unwrap_or(usize::MAX);
    let mut report = RequeueReport::default();
    if a.ids.is_empty() {
        for q in &keys.queues {
            let mut walk = dl::Walk::new(q);
            while let Some(page) = (left > 0)
                .then(|| walk.next_page(r.con, r.now))
                .transpose()
                .context(READ_LISTS)?
                .flatten()
            {
                let mut chosen: Vec<dl::ListLetter> = page
                    .into_iter()
                    .filter(|l| a.filter.matches(l, r.now))
                    .collect();
                // As in stream mode, a letter a newer push of its key wins over was not
                // tried and does not count against `--limit`.
                while left > 0 && !chosen.is_empty() {
                    let rest = chosen.split_off(left.min(chosen.len()));
                    let done = dl::requeue_with(r.con, keys, q, &chosen, Some(sc))
                        .context("cannot requeue")?;
                    walk.removed(done.requeued.len() + done.gone.len());
                    left -= chosen.len() - done.key_scheduled.len();
                    report.add(done);
                    chosen = rest;
                }
            }
        }
        return print_report(&report, &[], r.out);
    }
    // The same id twice is one letter, not a second one "gone".
    let ids: Vec<String> = a
        .ids
        .iter()
        .map(|id| dl::parse_id(id).context("--id"))
        .collect::<anyhow::Result<_>>()?;
    let ids = dead::distinct(ids);
    let found = dl::find(r.con, keys, &ids, r.now)?;
    let (mut chosen, missing) = dead::sort_found(&ids, found, |l| a.filter.matches(l, r.now));
    chosen.truncate(left);
    for (_, q, of_q) in grouped(&keys.queues, chosen, |_, q, l| l.queue == q.name) {
        report.add(dl::requeue_with(r.con, keys, q, &of_q, Some(sc)).context("cannot requeue")?);
    }
    print_report(&report, &missing, r.out)
}

/// `worker dead requeue` with `--shards N`: each letter in its own shard, one report with
/// `<shard>/<id>` ids; `--limit` counts over all shards (the oldest, or the first ids named).
fn requeue_sharded(r: &mut Cmd, shards: &[Keys], a: &RequeueArgs) -> anyhow::Result<ExitCode> {
    let sc = &a.screen(&r.registry, r.max_message, &r.served);
    let mut report = RequeueReport::default();
    let mut missing = Vec::new();
    let chosen: Vec<(usize, DeadLetter)> = if !a.ids.is_empty() {
        let mut places = Vec::new();
        for given in &a.ids {
            let (s, id) = locate_arg(r.con, r.now, shards, given)?;
            anyhow::ensure!(
                is_stream_id(&id),
                "--id: {given:?} is not a dead-letter id (like 1/1768764300123-0)"
            );
            if !places.contains(&(s, id.clone())) {
                places.push((s, id));
            }
        }
        let mut chosen = Vec::new();
        for (s, id) in places {
            match dead::fetch(r.con, &shards[s], std::slice::from_ref(&id), r.now)
                .context(READ)?
                .pop()
                .flatten()
            {
                Some(d) if a.filter.matches(&d, r.now) => chosen.push((s, d)),
                Some(_) => {}
                None => missing.push(dead::shard_id(s, &id)),
            }
        }
        chosen.truncate(a.limit.unwrap_or(usize::MAX));
        chosen
    } else {
        // Oldest first over all shards, a page at a time, so a flood is never held in memory.
        report.add(requeue_oldest(r.con, r.now, shards, a, sc, true)?);
        Vec::new()
    };
    for (s, keys, of_s) in grouped(shards, chosen, |i, _, (s, _)| *s == i) {
        let letters: Vec<DeadLetter> = of_s.into_iter().map(|(_, d)| d).collect();
        let r =
            dead::requeue_with(r.con, keys, &letters, r.now, Some(sc)).context("cannot requeue")?;
        report.add(r.in_shard(s));
    }
    print_report(&report, &missing, r.out)
}

/// The letters of each group (a queue, a shard) that has some, in the groups' order, each
/// group with its number.
fn grouped<G, L>(
    groups: &[G],
    letters: Vec<L>,
    of: impl Fn(usize, &G, &L) -> bool,
) -> Vec<(usize, &G, Vec<L>)> {
    let mut out: Vec<(usize, &G, Vec<L>)> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| (i, g, Vec::new()))
        .collect();
    for l in letters {
        if let Some((_, _, of_g)) = out.iter_mut().find(|(i, g, _)| of(*i, g, &l)) {
            of_g.push(l);
        }
    }
    out.retain(|(_, _, of_g)| !of_g.is_empty());
    out
}

/// [`dead::locate`] for the CLI: an id that names no shard is an error.
fn locate_arg(
    con: &mut dyn redis::ConnectionLike,
    now: i64,
    shards: &[Keys],
    given: &str,
) -> anyhow::Result<(usize, String)> {
    dead::locate(con, shards, given, now)
        .context("cannot read the dead letters")?
        .map_err(anyhow::Error::msg)
}

/// What `worker dead requeue` prints; exit 1 when an id named was not found.
fn print_report(
    r: &RequeueReport,
    missing: &[String],
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    writeln!(out, "requeued {}", r.requeued.len())?;
    if !r.as_is.is_empty() {
        writeln!(
            out,
            "{} of them not a JSON object, requeued as written: they will be dead-lettered again ({})",
            r.as_is.len(),
            r.as_is.join(", ")
        )?;
    }
    if !r.key_scheduled.is_empty() {
        writeln!(
            out,
            "left {} in the dead letters: their job key is scheduled again, or a newer letter of it is dead, and the newer push wins ({})",
            r.key_scheduled.len(),
            r.key_scheduled.join(", ")
        )?;
    }
    for (id, why) in &r.cannot {
        writeln!(out, "left {id} in the dead letters: {why}")?;
    }
    for (id, why) in &r.refused {
        writeln!(
            out,
            "refused {id}, it would die again at once: {why} (--force requeues it anyway)"
        )?;
    }
    if !r.gone.is_empty() {
        writeln!(
            out,
            "skipped {} already requeued or purged by someone else",
            r.gone.len()
        )?;
    }
    for id in missing {
        writeln!(out, "no dead letter {id}")?;
    }
    Ok(
        if missing.is_empty() && r.refused.is_empty() && r.cannot.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}
