//! The `worker` binary: parse flags, install the signal handler, run, map the result to an
//! exit code. Every error is one line on stderr.
//!
//! Exit codes (the README's table): 0 done (or a graceful shutdown), 1 a runtime failure
//! (a server unreachable, a job not found by `cancel`), 2 bad input of any kind (a flag, a
//! URL, a payload, an unknown event, a payload missing a required field), 130 a second
//! signal during shutdown. `stats --check` has its own: 0 OK, 1 WARNING, 2 CRITICAL,
//! 3 UNKNOWN; `trace` exits 4 when there is no trace of the job.

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
mod bench;
mod cli;

use cli::{Cli, Command, HandlersCommand, PushArgs};
use delay_worker::{admin, daemon, db, producer, Config, Shutdown};
use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    limit_malloc_arenas();
    init_logging();
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m).map(|c| (c, m)));
    let (cli, matches) = match parsed {
        Ok(p) => p,
        Err(e) if e.exit_code() == 0 => {
            // --help and --version, to stdout.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap may quote an argument it did not expect, a mistyped URL among them.
            eprintln!(
                "worker: {}",
                delay_worker::config::redact_url(&clap_line(&e))
            );
            return ExitCode::from(2);
        }
    };
    let config = match cli.config_from(&matches) {
        Ok(c) => c,
        // A monitoring check that cannot look (a URL that does not parse, in the
        // environment it was given) is UNKNOWN, on the line the plugin reads.
        Err(e) if matches!(cli.command, Some(Command::Stats { ref args, .. }) if args.check) => {
            println!("UNKNOWN - {e}");
            return ExitCode::from(3);
        }
        Err(e) => {
            eprintln!("worker: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        None | Some(Command::Run(_)) => run(&config),
        Some(Command::Migrate) => migrate(&config),
        Some(Command::Push(ref args)) => push(&config, args),
        Some(Command::Cancel { ref key }) => cancel(&config, key),
        Some(Command::Stats { ref args, .. }) => admin::stats(&config, args),
        Some(Command::Dead(ref args)) => admin::dead(&config, args),
        Some(Command::Trace { ref args, .. }) => admin::trace(&config, args),
        Some(Command::Bench { ref args, .. }) => bench::run(&config, args),
        Some(Command::Handlers(HandlersCommand::Check {
            ref handlers_dir,
            ref service_user,
        })) => admin::handlers_check::run(
            &config,
            handlers_dir,
            service_user,
            &mut std::io::stdout().lock(),
        ),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("worker: {}", admin::one_line(&e));
            if e.downcast_ref::<BadInput>().is_some()
                || e.downcast_ref::<admin::trace::BadQuery>().is_some()
                || e.downcast_ref::<admin::handlers_check::BadDir>().is_some()
            {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// A handler file that cannot be read or parsed is bad input, named by its flag (exit 2);
/// any other error passes as it is.
fn handlers_dir(e: daemon::DaemonError) -> anyhow::Error {
    match e {
        daemon::DaemonError::Handler(h) => BadInput(format!("--handlers-dir: {h}")).into(),
        e @ daemon::DaemonError::UnknownCapEvent { .. } => BadInput(e.to_string()).into(),
        other => other.into(),
    }
}

/// Input that can never work (exit 2), as opposed to a server that failed (exit 1).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct BadInput(String);

/// clap's error as one line: its first paragraph joined, without the `error: ` tag (the
/// usage and the `--help` hint that follow are left out; `--help` is one flag away).
fn clap_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let para: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let line = para.join(" ");
    line.strip_prefix("error: ").unwrap_or(&line).to_string()
}

/// Most malloc arenas of the process (glibc), unless the operator chose a number: see
/// [`limit_malloc_arenas`].
const MALLOC_ARENAS: i32 = 2;

/// At most [`MALLOC_ARENAS`] malloc arenas for the whole process, unless `MALLOC_ARENA_MAX`
/// (or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`) says otherwise. By default glibc gives
/// threads that allocate at the same time arenas of their own, up to 8 per core, and each
/// arena keeps what was freed in it for reuse: the daemon's threads (workers, mover, reader,
/// pruner, the pool's helpers, metrics connections) took 15 arenas on 2 cores, holding
/// 0.7–1.1 MB more than two after 10 minutes (docs/performance.md, "The status page, polled"). One arena
/// saves ~0.1 MB more but cost 10–15 % more worker CPU per job on the backlog (threads
/// waiting on its lock); two cost nothing measurable. Called first, before any thread
/// exists.
fn limit_malloc_arenas() {
    let chosen = std::env::var_os("MALLOC_ARENA_MAX").is_some()
        || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.arena_max"));
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if !chosen {
        // SAFETY: sets one malloc parameter; no other thread exists yet.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS) };
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (chosen, MALLOC_ARENAS);
}

/// env_logger with `RUST_LOG` (default `info`). Under systemd (JOURNAL_STREAM set)
/// journald stamps each line itself, so our timestamp is left out.
fn init_logging() {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        b.format(|buf, r| {
            writeln!(
                buf,
                "<{}>{}: {}",
                syslog_level(r.level()),
                r.target(),
                r.args()
            )
        });
    }
    b.init();
}

fn syslog_level(l: log::Level) -> u8 {
    match l {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let shutdown = Shutdown::new();
    let settled = config.settled();
    delay_worker::signals::install(&shutdown, config.shutdown_timeout, move || {
        daemon::forgive_at_exit(&settled)
    })
    .context("cannot install the signal handler")?;
    daemon::run(config, &shutdown).map_err(handlers_dir)?;
    Ok(ExitCode::SUCCESS)
}

fn migrate(config: &Config) -> anyhow::Result<ExitCode> {
    let mut client = db::connect(&config.database_url)?;
    let applied = db::migrate(&mut client)?;
    if applied.is_empty() {
        println!("schema is current");
    } else {
        for name in applied {
            println!("applied {name}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn redis(config: &Config) -> anyhow::Result<delay_worker::store::Con> {
    Ok(delay_worker::connect::redis_connection(config)?)
}

fn push(config: &Config, args: &PushArgs) -> anyhow::Result<ExitCode> {
    let payload: serde_json::Value = serde_json::from_str(&args.payload)
        .map_err(|e| BadInput(format!("--payload is not valid JSON: {e}")))?;
    if !payload.is_object() {
        return Err(BadInput("--payload must be a JSON object".into()).into());
    }
    if !args.unchecked {
        check_job(config, &args.event, &payload)?;
    }
    let mut con = redis(config)?;
    delay_worker::connect::check_shards(config, &mut con, true)?;
    // Due `--delay` after now on Redis's clock, which decides when it is due.
    let now = delay_worker::figures::redis_now_ms(&mut con, config)?;
    // The key first: it names the shard.
    let key = args
        .key
        .clone()
        .unwrap_or_else(|| producer::new_job_key(now));
    let keys = config.keys_for(key.as_bytes());
    let job = producer::NewJob {
        event: args.event.clone(),
        payload,
        due_ms: now + args.delay.as_millis() as i64,
        key: Some(key),
    };
    let pushed = producer::push(&mut con, &keys, &job, now).map_err(|e| match e {
        producer::PushError::Store(e) => anyhow::Error::new(e),
        // The job itself is wrong (an empty key or event): bad input.
        input => BadInput(format!("--key or --event: {input}")).into(),
    })?;
    println!(
        "{} {} due in {}",
        if pushed.rescheduled {
            "rescheduled"
        } else {
            "scheduled"
        },
        pushed.key,
        delay_worker::human_ms(args.delay.as_millis() as i64)
    );
    Ok(ExitCode::SUCCESS)
}

/// What a worker would dead-letter at once, refused before it is pushed: an event no
/// handler has, a payload without a field its handler requires.
fn check_job(config: &Config, event: &str, payload: &serde_json::Value) -> anyhow::Result<()> {
    let registry = daemon::registry(config).map_err(handlers_dir)?;
    let Some((_, handler)) = registry.get(event) else {
        return Err(BadInput(format!(
            "--event: no handler for {event:?} (known: {}; --unchecked pushes it anyway)",
            registry.events().join(", ")
        ))
        .into());
    };
    let map = payload.as_object().cloned().unwrap_or_default();
    delay_worker::message::Envelope::new(event, map, 0)
        .require(handler.required())
        .map_err(|r| BadInput(format!("--payload: {r} (--unchecked pushes it anyway)")))?;
    Ok(())
}

/// Removes a scheduled job (one waiting for a retry or held is scheduled too). One that
/// has fallen due and been moved is not, and still runs: that is said, with its entry (a
/// handler finds an order paid meanwhile and leaves it).
fn cancel(config: &Config, key: &str) -> anyhow::Result<ExitCode> {
    let mut con = redis(config)?;
    let keys = config.keys_for(key.as_bytes());
    if producer::cancel(&mut con, &keys, key)? {
        println!("cancelled {key}");
        return Ok(ExitCode::SUCCESS);
    }
    let moved: Option<String> = redis::cmd("HGET")
        .arg(&keys.moved)
        .arg(key)
        .query(&mut con)
        .ok()
        .flatten();
    match moved {
        Some(entry) => println!(
            "no scheduled job {key}: it fell due and was moved to {} as entry {entry}, so it \
             runs now or soon (`worker trace {key}` says where it is)",
            keys.stream
        ),
        None => println!("no scheduled job {key}"),
    }
    Ok(ExitCode::FAILURE)
}
