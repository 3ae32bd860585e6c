//! How the operator's surfaces write a value for people, the same in the terminal and on
//! the status page: an age, a time, a duration, a line clipped to fit, an error on one
//! line.

use std::time::Duration;

/// An age for people: `42s`, `3m05s`, `2h10m`, `3d04h`.
pub fn fmt_age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}d{:02}h", s / 86_400, s % 86_400 / 3600)
    }
}

/// The last millisecond RFC 3339 can write (9999-12-31T23:59:59.999Z).
const LAST_RFC3339_MS: i64 = 253_402_300_799_999;

/// Unix milliseconds as an RFC 3339 time (UTC, whole seconds). A time past the year 9999
/// (a producer's score in microseconds, `+inf`) is written as its milliseconds: RFC 3339
/// has no such year (found from outside: `worker trace` of a member scored `+inf`
/// panicked).
pub fn fmt_time(ms: i64) -> String {
    if ms > LAST_RFC3339_MS {
        return format!("{ms} ms after 1970 (past the year 9999: a score in microseconds?)");
    }
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Milliseconds for people: `0.8 ms`, `45 ms`, `2.5 s`, `3m05s`.
pub fn fmt_ms(ms: f64) -> String {
    if ms < 10.0 {
        format!("{ms:.1} ms")
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else if ms < 60_000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else {
        fmt_age(ms as i64)
    }
}

/// At most `max` characters on one line, `…` marking a cut.
pub fn clip(s: &str, max: usize) -> String {
    let s = s.replace(['\n', '\r', '\t'], " ");
    if s.chars().count() <= max {
        return s;
    }
    let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
    t.push('…');
    t
}

/// A blank field as `-`.
pub fn or_dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}

/// An error and its causes on one line, each said once, never a backtrace: how every
/// command of the binary reports a failure.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !line.contains(&c) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&c);
        }
    }
    line.replace('\n', " ")
}

/// What a caught panic said (its `&str` or `String` payload), or "unknown panic".
pub fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_a_person_would_write_them() {
        assert_eq!(fmt_age(-5), "0s");
        assert_eq!(fmt_age(999), "0s");
        assert_eq!(fmt_age(59_999), "59s");
        assert_eq!(fmt_age(185_000), "3m05s");
        assert_eq!(fmt_age(2 * 3_600_000 + 600_000), "2h10m");
        assert_eq!(fmt_age(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
    }

    #[test]
    fn a_time_past_the_year_9999_is_written_not_a_panic() {
        assert_eq!(fmt_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(fmt_time(LAST_RFC3339_MS), "9999-12-31T23:59:59Z");
        for ms in [LAST_RFC3339_MS + 1, 1_768_764_300_000_000, i64::MAX] {
            assert!(fmt_time(ms).starts_with(&format!("{ms} ms after 1970")));
        }
    }

    #[test]
    fn clip_marks_the_cut() {
        assert_eq!(clip("short", 10), "short");
        assert_eq!(clip("a\nb", 10), "a b");
        assert_eq!(clip("abcdefghijk", 5), "abcd…");
    }
}
