//! The process's signals, through `signal-hook`: a thread of its own reads them as they
//! come (nothing runs inside a signal handler but signal-hook's own write to a pipe).
//!
//! The daemon ([`install`]):
//!
//! | signal | what the daemon does |
//! |---|---|
//! | SIGTERM, SIGINT, SIGQUIT | a graceful stop: drain what was read, acknowledge, exit 0; a second one of them exits at once (130) |
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
/// that lives as long as the process. `exit_now` runs before a second signal's exit.
pub fn install(shutdown: &Shutdown, exit_now: impl Fn() + Send + 'static) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2])?;
    let shutdown = shutdown.clone();
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
