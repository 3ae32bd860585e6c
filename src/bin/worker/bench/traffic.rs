//! The shop's own traffic for the `shop` scenario: transactions at a fixed rate on the
//! bench's shop tables, beside the worker, timed as the shop's customers feel them.
//!
//! `clients` threads, each with a connection of its own and its share of `rate`, start a
//! transaction every `clients / rate` seconds on a fixed schedule (open loop: a late one
//! does not push the schedule back, so a slow database shows as latency, not as fewer
//! transactions asked for). Latency counts from the scheduled start. The mix, drawn per
//! transaction:
//!
//! - **payment** (50 %): the order's coupon locked, then its skus in *descending* id, then
//!   the order itself made `paid` if still pending — the lock order opposite to the
//!   worker's (orders, then skus ascending, then coupons), the shape that deadlocks with
//!   it. One payment in ten is for an order of the backlog, racing its timeout; a paid
//!   order is written to `bench_orders` in the same transaction, so the books know it;
//! - **checkout** (30 %): two skus' stock taken, in descending id, and a new pending order
//!   with its two lines;
//! - **browse** (20 %): an order with its lines, read.
//!
//! A failed transaction (a deadlock, a lock timeout) is counted and its error kept, as
//! the shop would see it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the traffic runs against.
#[derive(Debug, Clone)]
pub struct Plan {
    pub url: String,
    /// Transactions a second, all clients together.
    pub rate: f64,
    pub clients: usize,
    /// Orders the shop pays: its own (never pushed), and the backlog's (racing timeouts).
    pub shop_orders: (i64, i64),
    pub backlog_orders: (i64, i64),
    pub skus: u32,
}

/// One transaction.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Its scheduled start, from the run's start.
    pub at: Duration,
    /// From its scheduled start to its commit (or failure).
    pub latency: Duration,
    pub ok: bool,
    /// Which of the mix it was.
    pub kind: Kind,
}

/// The shop's transaction kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Payment,
    Checkout,
    Browse,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Payment, Kind::Checkout, Kind::Browse];

    fn name(self) -> &'static str {
        match self {
            Kind::Payment => "payment",
            Kind::Checkout => "checkout",
            Kind::Browse => "browse",
        }
    }
}

/// The traffic while it runs.
pub struct Running {
    started: Instant,
    stop: Arc<AtomicBool>,
    clients: Vec<std::thread::JoinHandle<(Vec<Sample>, Vec<String>)>>,
}

/// Starts the clients; they run until [`Running::stop`].
pub fn start(plan: &Plan) -> anyhow::Result<Running> {
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for k in 0..plan.clients {
        let mut c = postgres::Client::connect(&plan.url, postgres::NoTls)?;
        c.batch_execute("SET application_name = 'bench shop'; SET lock_timeout = '10s'")?;
        let (plan, stop) = (plan.clone(), stop.clone());
        clients.push(
            std::thread::Builder::new()
                .name(format!("shop-{k}"))
                .spawn(move || client(c, &plan, k as u64, started, &stop))?,
        );
    }
    Ok(Running {
        started,
        stop,
        clients,
    })
}

impl Running {
    /// When the traffic started: the origin of every sample's `at`.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Stops the clients; every transaction they ran, and the errors of the failed ones.
    pub fn stop(self) -> (Vec<Sample>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut samples = Vec::new();
        let mut errors = Vec::new();
        for c in self.clients {
            if let Ok((s, e)) = c.join() {
                samples.extend(s);
                errors.extend(e);
            }
        }
        samples.sort_by_key(|s| s.at);
        (samples, errors)
    }
}

fn client(
    mut c: postgres::Client,
    plan: &Plan,
    k: u64,
    started: Instant,
    stop: &AtomicBool,
) -> (Vec<Sample>, Vec<String>) {
    let interval = Duration::from_secs_f64(plan.clients as f64 / plan.rate);
    // The clients' schedules interleave instead of starting together.
    let offset = interval.mul_f64(k as f64 / plan.clients as f64);
    let mut rng = fastrand::Rng::with_seed(0x5eed + k);
    let (mut samples, mut errors) = (Vec::new(), Vec::new());
    for i in 0u32.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let at = offset + interval * i;
        let due = started + at;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let kind = match rng.u32(0..100) {
            0..50 => Kind::Payment,
            50..80 => Kind::Checkout,
            _ => Kind::Browse,
        };
        let r = match kind {
            Kind::Payment => {
                let (lo, hi) = if rng.u32(0..10) == 0 {
                    plan.backlog_orders
                } else {
                    plan.shop_orders
                };
                pay(&mut c, rng.i64(lo..=hi))
            }
            Kind::Checkout => {
                let a = rng.i64(1..=plan.skus as i64);
                let b = rng.i64(1..=plan.skus as i64);
                checkout(&mut c, a, b, rng.i32(1..=3))
            }
            Kind::Browse => {
                let (lo, hi) = plan.shop_orders;
                browse(&mut c, rng.i64(lo..=hi))
            }
        };
        let ok = match r {
            Ok(()) => true,
            Err(e) => {
                if errors.len() < 20 {
                    errors.push(delay_worker::db::error_text(&e));
                }
                false
            }
        };
        samples.push(Sample {
            at,
            latency: due.elapsed(),
            ok,
            kind,
        });
    }
    (samples, errors)
}

/// Coupon, then skus descending, then the order: paid if pending, recorded if so.
fn pay(c: &mut postgres::Client, order: i64) -> Result<(), postgres::Error> {
    let mut t = c.transaction()?;
    t.execute(
        "SELECT 1 FROM coupon_user WHERE id = (SELECT coupon_id FROM orders WHERE id = $1) FOR UPDATE",
        &[&order],
    )?;
    t.execute(
        "SELECT id FROM sku WHERE id IN (SELECT sku_id FROM order_items WHERE order_id = $1) ORDER BY id DESC FOR UPDATE",
        &[&order],
    )?;
    let paid = t.execute(
        "UPDATE orders SET status = 'paid', paid_at = now(), updated_at = now() WHERE id = $1 AND status = 'pending'",
        &[&order],
    )?;
    if paid == 1 {
        t.execute(
            "INSERT INTO bench_orders (order_id, paid) VALUES ($1, true) ON CONFLICT (order_id) DO UPDATE SET paid = true",
            &[&order],
        )?;
    }
    t.commit()
}

/// Two skus' stock taken (descending id) and a new pending order with the two lines.
fn checkout(c: &mut postgres::Client, a: i64, b: i64, qty: i32) -> Result<(), postgres::Error> {
    let (hi, lo) = (a.max(b), a.min(b));
    let mut t = c.transaction()?;
    for sku in [hi, lo] {
        t.execute(
            "UPDATE sku SET stock = stock - $2, updated_at = now() WHERE id = $1",
            &[&sku, &qty],
        )?;
    }
    let id: i64 = t
        .query_one(
            "INSERT INTO orders (order_no, status) VALUES ('SH' || nextval('orders_id_seq'), 'pending') RETURNING id",
            &[],
        )?
        .get(0);
    for sku in [hi, lo] {
        t.execute(
            "INSERT INTO order_items (order_id, sku_id, qty) VALUES ($1, $2, $3)",
            &[&id, &sku, &qty],
        )?;
    }
    t.commit()
}

fn browse(c: &mut postgres::Client, order: i64) -> Result<(), postgres::Error> {
    c.query(
        "SELECT o.status, i.sku_id, i.qty FROM orders o JOIN order_items i ON i.order_id = o.id WHERE o.id = $1",
        &[&order],
    )
    .map(|_| ())
}

/// The shop's figures over the samples scheduled within `[from, to)` of the run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    pub seconds: f64,
    pub offered_per_s: f64,
    /// Transactions that committed, a second.
    pub done_per_s: f64,
    pub failed: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// p50 and p99 (ms) of each kind of transaction: which kind the tail is made of.
    pub by_kind: Vec<(String, f64, f64)>,
    /// p99 (ms) of each whole second of the window, in order: when the tail happens.
    pub p99_by_second: Vec<f64>,
}

/// The `p` quantile of sorted `ms` (0 when empty).
fn quantile(ms: &[f64], p: f64) -> f64 {
    if ms.is_empty() {
        0.0
    } else {
        ms[((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1]
    }
}

/// The committed transactions' latencies (ms) among `window`, sorted.
fn sorted_ms<'a>(window: impl Iterator<Item = &'a &'a Sample>) -> Vec<f64> {
    let mut ms: Vec<f64> = window
        .filter(|s| s.ok)
        .map(|s| s.latency.as_secs_f64() * 1000.0)
        .collect();
    ms.sort_by(f64::total_cmp);
    ms
}

pub fn figures(samples: &[Sample], from: Duration, to: Duration, offered: f64) -> Figures {
    let window: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.at >= from && s.at < to)
        .collect();
    let seconds = (to - from).as_secs_f64();
    let ms = sorted_ms(window.iter());
    let q = |p: f64| quantile(&ms, p);
    let by_kind = Kind::ALL
        .iter()
        .map(|k| {
            let ms = sorted_ms(window.iter().filter(|s| s.kind == *k));
            (
                k.name().to_string(),
                quantile(&ms, 0.5),
                quantile(&ms, 0.99),
            )
        })
        .collect();
    let p99_by_second = (0..seconds.floor() as u64)
        .map(|i| {
            let (a, b) = (
                from + Duration::from_secs(i),
                from + Duration::from_secs(i + 1),
            );
            quantile(
                &sorted_ms(window.iter().filter(|s| s.at >= a && s.at < b)),
                0.99,
            )
        })
        .collect();
    Figures {
        by_kind,
        p99_by_second,
        seconds,
        offered_per_s: offered,
        done_per_s: ms.len() as f64 / seconds.max(1e-9),
        failed: window.iter().filter(|s| !s.ok).count() as u64,
        p50_ms: q(0.50),
        p99_ms: q(0.99),
        max_ms: ms.last().copied().unwrap_or(0.0),
    }
}
