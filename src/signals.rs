//! The process's signals, through `signal-hook`: a thread of its own reads them as they
//! come (nothing runs inside a signal handler but signal-hook's own write to a pipe).
//!
//! The daemon ([`install`]):
//!
//! | signal | what the daemon does |
//! |---|---|
//! | SIGTERM, SIGINT, SIGQUIT | a graceful stop: drain what was read, acknowledge, exit 0; a second one of them exits at once (130), as does a stop not done within `--shutdown-timeout` |
//! | SIGHUP | never stops it: logged, and a reload of the handlers is requested ([`Shutdown::request_reload`], `daemon::reload`) |
//! | SIGUSR1 | a state report in the log ([`Shutdown::request_report`]) |
//! | SIGUSR2 | logged and ignored |
//!
//! SIGPIPE is ignored by the Rust runtime (a client gone is a write error); every other
//! signal keeps its default action (docs/operating.md, systemd, "Signals").
//!
//! The admin tools and the benchmark stop on SIGINT and SIGTERM ([`on_stop`]).

use crate::shutdown::Shutdown;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::Signals;

/// A signal's name for the log.
fn name(sig: i32) -> &'static str {
    match sig {
        SIGTERM => "SIGTERM",
        SIGINT => "SIGINT",
        SIGQUIT => "SIGQUIT",
        SIGHUP => "SIGHUP",
        SIGUSR1 => "SIGUSR1",
        SIGUSR2 => "SIGUSR2",
        _ => "a signal",
    }
}

/// The daemon's signals, as the table above says, acted on by a thread named `signals`
/// that lives as long as the process. `exit_now` runs before a second signal's exit, and
/// before the exit of a graceful stop still going `stop_within` after its signal
/// (`--shutdown-timeout`; zero: never): jobs in hand whose statement or commit the server
/// does not answer (a synchronous standby gone, a server frozen) held the stop until the
/// server came back (found from outside: a SIGTERM during a synchronous standby's outage
/// left the process running until it ended, a minute later).
pub fn install(
    shutdown: &Shutdown,
    stop_within: std::time::Duration,
    exit_now: impl Fn() + Send + Sync + 'static,
) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2])?;
    let shutdown = shutdown.clone();
    let exit_now = std::sync::Arc::new(exit_now);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                match sig {
                    SIGHUP => {
                        log::info!("SIGHUP received: reload requested (the daemon keeps running)");
                        shutdown.request_reload();
                    }
                    SIGUSR1 => shutdown.request_report(),
                    SIGUSR2 => log::info!(
                        "SIGUSR2 received: ignored (SIGUSR1 logs a state report, SIGHUP reloads, \
                         SIGTERM stops)"
                    ),
                    _ => {
                        if shutdown.trigger() {
                            eprintln!(
                                "worker: second signal ({}), exiting now; unacknowledged jobs stay pending",
                                name(sig)
                            );
                            exit_now();
                            std::process::exit(130);
                        }
                        log::info!(
                            "{} received: finishing the jobs in hand (signal again to exit now)",
                            name(sig)
                        );
                        if !stop_within.is_zero() {
                            let exit_now = exit_now.clone();
                            let sig = name(sig);
                            let _ = std::thread::Builder::new().name("stop-deadline".into()).spawn(
                                move || {
                                    std::thread::sleep(stop_within);
                                    log::warn!(
                                        "the jobs in hand are not finished {} s after the {sig} (--shutdown-timeout; a statement or commit the server does not answer): exiting now; unacknowledged jobs stay pending",
                                        stop_within.as_secs()
                                    );
                                    exit_now();
                                    std::process::exit(130);
                                },
                            );
                        }
                    }
                }
            }
        })?;
    Ok(())
}

/// Calls `f` on each SIGINT or SIGTERM, from a thread of its own (the admin tools' and the
/// benchmark's Ctrl-C).
pub fn on_stop(mut f: impl FnMut() + Send + 'static) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for _ in signals.forever() {
                f();
            }
        })?;
    Ok(())
}
