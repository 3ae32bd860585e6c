//! What an operator reads: `worker push` says when in human units (against a real Redis),
//! and each subcommand's `--help` shows list mode's flags apart from the rest.

use crate::support::*;

#[test]
fn push_says_when_in_human_units() {
    let r = RedisServer::start();
    for (delay, said) in [
        ("7d", "due in 7 d"),
        ("90m", "due in 1 h 30 min"),
        ("1.5", "due in 1.5 s"),
    ] {
        let out = run_worker(
            &[
                "push",
                "--event",
                "order.timeout",
                "--payload",
                r#"{"order_no":"SO1"}"#,
                "--delay",
                delay,
                "--key",
                "order.timeout:SO1",
            ],
            &r.url(),
            "postgres://unused",
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(
            text(&out.stdout).trim().ends_with(said),
            "{}",
            text(&out.stdout)
        );
    }
}

/// The help's sections: heading → the flags under it.
fn sections(help: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for line in help.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            out.push((line.trim_end_matches(':').to_string(), Vec::new()));
        } else if let Some(flag) = line.trim_start().strip_prefix("--") {
            let name = flag.split([' ', '<']).next().unwrap_or("").to_string();
            if let Some(last) = out.last_mut() {
                last.1.push(name);
            }
        }
    }
    out
}

#[test]
fn help_shows_list_mode_flags_apart() {
    for cmd in [&["stats", "--help"][..], &["run", "--help"][..]] {
        let out = run_worker(cmd, "redis://127.0.0.1:1/", "postgres://unused");
        assert!(out.status.success());
        let s = sections(&text(&out.stdout));
        let under = |flag: &str| {
            s.iter()
                .find(|(_, flags)| flags.iter().any(|f| f == flag))
                .map(|(h, _)| h.clone())
                .unwrap_or_else(|| panic!("{flag} not in {cmd:?} --help"))
        };
        for flag in ["queues", "queue", "mover-queue", "dead-suffix"] {
            assert_eq!(under(flag), "List mode only (--source list)", "{cmd:?}");
        }
        assert_eq!(under("source"), "Queue layout");
        assert_eq!(
            under("redis-url"),
            "Connection and key names (any subcommand)"
        );
        if cmd[0] == "stats" {
            assert_eq!(under("json"), "Options");
            assert_eq!(under("pending-warn"), "Check thresholds (--check)");
            assert!(under("queue-length-warn").contains("list mode only"));
        } else {
            assert_eq!(under("threads"), "Daemon");
        }
    }
}
