//! The two inline SVG charts of the overview, drawn from the last hour's minutes
//! (`stats::Hour`): jobs per minute, and lateness percentiles per minute on a log scale.
//! Each minute with something in it has a point with a `<title>` (its figures, shown on
//! hover) and `data-` attributes with the same numbers.

use crate::stats::{Hour, MinuteFigures};
use crate::text::fmt_ms;
use maud::{html, Markup};

const W: f64 = 420.0;
const H: f64 = 150.0;
const LEFT: f64 = 54.0;
const RIGHT: f64 = 10.0;
const TOP: f64 = 10.0;
const BOTTOM: f64 = 24.0;

const BLUE: &str = "#0969da";
const RED: &str = "#cf222e";
const ORANGE: &str = "#bc4c00";
const GRID: &str = "#8888";

fn x(i: usize, n: usize) -> f64 {
    LEFT + i as f64 * (W - LEFT - RIGHT) / (n.max(2) - 1) as f64
}

/// 1, 2 or 5 times a power of ten, at least `v`.
fn nice_ceiling(v: u64) -> u64 {
    let mut p = 1u64;
    loop {
        for m in [1, 2, 5] {
            if m * p >= v {
                return m * p;
            }
        }
        p = p.saturating_mul(10);
    }
}

/// `hh:mm` (UTC) of a minute's start.
fn hhmm(ms: i64) -> String {
    let m = ms.div_euclid(60_000).rem_euclid(1440);
    format!("{:02}:{:02}", m / 60, m % 60)
}

/// The time axis: ticks at 60, 30 and 0 minutes ago.
fn time_axis(minutes: &[MinuteFigures]) -> Markup {
    let n = minutes.len();
    let y = H - BOTTOM;
    html! {
        line x1=(LEFT) y1=(y) x2=(W - RIGHT) y2=(y) stroke=(GRID) {}
        @for (i, anchor, label) in [(0, "start", "−60 min"), (n / 2, "middle", "−30 min"), (n - 1, "end", "now")] {
            @if let Some(m) = minutes.get(i) {
                text x=(format!("{:.1}", x(i, n))) y=(H - 6.0) font-size="12" fill="currentColor" text-anchor=(anchor) {
                    (label) " · " (hhmm(m.start_ms))
                }
            }
        }
    }
}

/// Jobs committed (blue) and dead-lettered (red) per minute.
pub fn throughput(hour: &Hour) -> Markup {
    let m = &hour.minutes;
    let n = m.len();
    let top = nice_ceiling(
        m.iter()
            .map(|f| f.committed.max(f.dead))
            .max()
            .unwrap_or(0)
            .max(1),
    );
    let y = |v: u64| TOP + (H - TOP - BOTTOM) * (1.0 - v as f64 / top as f64);
    let points = |f: &dyn Fn(&MinuteFigures) -> u64| {
        m.iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i, n), y(f(v))))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let label = format!(
        "Jobs per minute over the last hour: {} committed, {} dead-lettered",
        hour.committed, hour.dead
    );
    html! {
        figure {
            svg.throughput viewBox=(format!("0 0 {W} {H}")) role="img" aria-label=(label) {
                @for v in [top, top / 2] {
                    line x1=(LEFT) y1=(format!("{:.1}", y(v))) x2=(W - RIGHT) y2=(format!("{:.1}", y(v))) stroke=(GRID) stroke-dasharray="3 3" {}
                    text x=(LEFT - 4.0) y=(format!("{:.1}", y(v) + 4.0)) font-size="12" fill="currentColor" text-anchor="end" { (v) }
                }
                text x=(LEFT - 4.0) y=(format!("{:.1}", y(0) + 4.0)) font-size="12" fill="currentColor" text-anchor="end" { "0" }
                (time_axis(m))
                polyline.committed points=(points(&|f| f.committed)) fill="none" stroke=(BLUE) stroke-width="2" stroke-linejoin="round" {}
                @if hour.dead > 0 {
                    polyline.dead points=(points(&|f| f.dead)) fill="none" stroke=(RED) stroke-width="1.5" {}
                }
                @for (i, f) in m.iter().enumerate() {
                    @if f.committed + f.retried + f.dead > 0 {
                        circle.minute cx=(format!("{:.1}", x(i, n))) cy=(format!("{:.1}", y(f.committed))) r="3.5" fill=(BLUE)
                            data-minute=(hhmm(f.start_ms)) data-committed=(f.committed) data-retried=(f.retried) data-dead=(f.dead) {
                            title {
                                (hhmm(f.start_ms)) " UTC: " (f.committed) " committed, " (f.retried) " retried, " (f.dead) " dead"
                            }
                        }
                    }
                }
            }
            figcaption {
                "Jobs committed per minute" @if hour.dead > 0 { " (blue) and dead-lettered (red)" } ", this process, last hour (times UTC)."
            }
        }
    }
}

/// Lateness p50 (blue) and p99 (orange) per minute, log scale from 1 ms.
pub fn lateness(hour: &Hour) -> Markup {
    let m = &hour.minutes;
    let n = m.len();
    if hour.late_count == 0 {
        return html! {
            p.muted { "Lateness: no committed job with a known due time in the last hour." }
        };
    }
    let max = m
        .iter()
        .filter_map(|f| f.p99_ms)
        .fold(1.0f64, f64::max)
        .max(10.0);
    let decades = libm::log10(max).ceil().max(1.0) as i32;
    let y = |ms: f64| {
        let l = libm::log10(ms.max(1.0)) / decades as f64;
        TOP + (H - TOP - BOTTOM) * (1.0 - l)
    };
    let line_d = |f: &dyn Fn(&MinuteFigures) -> Option<f64>| {
        let mut d = String::new();
        let mut drawing = false;
        for (i, v) in m.iter().enumerate() {
            match f(v) {
                Some(ms) => {
                    d.push_str(&format!(
                        "{}{:.1},{:.1} ",
                        if drawing { "L" } else { "M" },
                        x(i, n),
                        y(ms)
                    ));
                    drawing = true;
                }
                None => drawing = false,
            }
        }
        d
    };
    let label = format!(
        "Lateness per minute over the last hour: p50 {}, p99 {}",
        hour.p50_ms.map_or("-".into(), fmt_ms),
        hour.p99_ms.map_or("-".into(), fmt_ms)
    );
    html! {
        figure {
            svg.lateness viewBox=(format!("0 0 {W} {H}")) role="img" aria-label=(label) {
                @for k in 0..=decades {
                    @let ms = 10f64.powi(k);
                    line x1=(LEFT) y1=(format!("{:.1}", y(ms))) x2=(W - RIGHT) y2=(format!("{:.1}", y(ms))) stroke=(GRID) stroke-dasharray="3 3" {}
                    text x=(LEFT - 4.0) y=(format!("{:.1}", y(ms) + 4.0)) font-size="12" fill="currentColor" text-anchor="end" { (fmt_ms(ms)) }
                }
                (time_axis(m))
                path.p50 d=(line_d(&|f| f.p50_ms)) fill="none" stroke=(BLUE) stroke-width="2" {}
                path.p99 d=(line_d(&|f| f.p99_ms)) fill="none" stroke=(ORANGE) stroke-width="1.5" {}
                @for (i, f) in m.iter().enumerate() {
                    @if let Some(p50) = f.p50_ms {
                        circle cx=(format!("{:.1}", x(i, n))) cy=(format!("{:.1}", y(p50))) r="2.5" fill=(BLUE) {}
                    }
                    @if let (Some(p50), Some(p99)) = (f.p50_ms, f.p99_ms) {
                        circle cx=(format!("{:.1}", x(i, n))) cy=(format!("{:.1}", y(p99))) r="3" fill=(ORANGE)
                            data-minute=(hhmm(f.start_ms)) data-p50-ms=(p50) data-p99-ms=(p99) {
                            title {
                                (hhmm(f.start_ms)) " UTC: lateness p50 ≤ " (fmt_ms(p50)) ", p95 ≤ "
                                (f.p95_ms.map_or("-".into(), fmt_ms)) ", p99 ≤ " (fmt_ms(p99))
                                " (" (f.late_count) " jobs)"
                            }
                        }
                    }
                }
            }
            figcaption {
                "Lateness (commit time minus due time) per minute: p50 (blue) and p99 (orange), log scale."
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(1), 1);
        assert_eq!(nice_ceiling(3), 5);
        assert_eq!(nice_ceiling(7), 10);
        assert_eq!(nice_ceiling(101), 200);
        assert_eq!(nice_ceiling(4000), 5000);
    }
}
