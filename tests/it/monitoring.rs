//! The monitoring files of `scripts/monitoring/`: the alert rules pass `promtool check
//! rules` and their unit tests (each alert seen firing and quiet, and each firing case
//! failing without its rule), the Grafana dashboard is importable JSON, and every metric the
//! dashboard and the rules query is one the real worker binary serves on `/metrics`, so they
//! cannot drift from the code.
//!
//! promtool comes from `scripts/monitoring/promtool.sh` (PATH, or taken out of Debian's
//! `prometheus` package into target/tools when missing).

use crate::support::*;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/monitoring");

fn file(name: &str) -> String {
    let path = Path::new(DIR).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn promtool() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let out = Command::new("bash")
            .arg(Path::new(DIR).join("promtool.sh"))
            .output()
            .expect("run scripts/monitoring/promtool.sh");
        assert!(
            out.status.success(),
            "no promtool: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

fn run_promtool(args: &[&str], dir: &Path) -> Output {
    Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool")
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The alert names of alerts.yml, in order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_string())
        .collect()
}

/// alerts.yml without the rule of `alert` (from its `- alert:` line to the next one).
fn without_rule(rules: &str, alert: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in rules.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert: ") {
            skipping = name.trim() == alert;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn monitoring_alert_rules_pass_promtool_and_each_alert_is_tested_firing_and_quiet() {
    let rules = file("alerts.yml");
    let names = alert_names(&rules);
    assert!(names.len() >= 6, "too few alerts found: {names:?}");
    for required in [
        "DelayWorkerDown",
        "DelayWorkerNotLive",
        "DelayWorkerDeadLetters",
        "DelayWorkerJobsLate",
    ] {
        assert!(names.iter().any(|n| n == required), "no alert {required}");
    }

    let check = run_promtool(&["check", "rules", "alerts.yml"], Path::new(DIR));
    assert!(
        check.status.success(),
        "promtool check rules:\n{}",
        said(&check)
    );
    assert!(
        said(&check).contains(&format!("SUCCESS: {} rules found", names.len())),
        "promtool check rules:\n{}",
        said(&check)
    );
    let test = run_promtool(&["test", "rules", "alerts.test.yml"], Path::new(DIR));
    assert!(
        test.status.success(),
        "promtool test rules:\n{}",
        said(&test)
    );

    // Each alert has a case where it fires and one where it stays quiet.
    let tests = file("alerts.test.yml");
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    let mut current = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname: ") {
            current = Some(name.to_string());
        } else if let (Some(name), Some(exp)) = (&current, line.strip_prefix("exp_alerts:")) {
            assert!(
                names.contains(name),
                "alerts.test.yml tests an unknown alert {name}"
            );
            if exp.trim() == "[]" {
                quiet.insert(name.clone());
            } else {
                firing.insert(name.clone());
            }
            current = None;
        }
    }
    for name in &names {
        assert!(firing.contains(name), "no case where {name} fires");
        assert!(quiet.contains(name), "no case where {name} stays quiet");
    }

    // Without its rule, each alert's firing case fails: the tests do look at every rule.
    let dir =
        std::env::temp_dir().join(format!("dw-alerts-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("alerts.test.yml"), &tests).unwrap();
    for name in &names {
        std::fs::write(dir.join("alerts.yml"), without_rule(&rules, name)).unwrap();
        let out = run_promtool(&["test", "rules", "alerts.test.yml"], &dir);
        assert!(
            !out.status.success() && said(&out).contains(name.as_str()),
            "alerts.test.yml passes without the rule {name}:\n{}",
            said(&out)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn monitoring_dashboard_is_importable_grafana_json() {
    let dash: serde_json::Value =
        serde_json::from_str(&file("dashboard.json")).expect("dashboard.json is not JSON");
    assert_eq!(dash["uid"], "delay-worker");
    assert!(dash["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dash["schemaVersion"].as_u64().is_some());
    let vars = dash["templating"]["list"]
        .as_array()
        .expect("templating.list");
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus data source variable: the import would not ask for one"
    );
    let panels = dash["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(
            ids.insert(p["id"].as_u64().expect("panel id")),
            "panel id twice: {title}"
        );
        let g = &p["gridPos"];
        let (x, w, h) = (g["x"].as_u64(), g["w"].as_u64(), g["h"].as_u64());
        assert!(
            matches!((x, w, h), (Some(x), Some(w), Some(h)) if w > 0 && h > 0 && x + w <= 24),
            "bad gridPos of {title}: {g}"
        );
        if p["type"] == "row" || p["type"] == "text" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(
                refs.insert(t["refId"].as_str().expect("refId")),
                "{title}: refId twice"
            );
            assert!(
                t["expr"].as_str().is_some_and(|e| !e.is_empty()),
                "{title}: empty expr"
            );
            queries += 1;
        }
    }
    assert!(queries >= 10, "only {queries} queries");
}

/// Every PromQL expression of the dashboard (targets and variables) or of the alert rules.
fn dashboard_exprs() -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", serde_json::Value::String(s)) => {
                            out.push(s.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let dash: serde_json::Value = serde_json::from_str(&file("dashboard.json")).unwrap();
    let mut out = Vec::new();
    walk(&dash, &mut out);
    out
}

fn rule_exprs() -> Vec<String> {
    let rules = file("alerts.yml");
    let mut out = Vec::new();
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim_start().strip_prefix("expr:") else {
            continue;
        };
        if rest.trim() != "|" {
            out.push(rest.trim().to_string());
            continue;
        }
        // A block: the lines indented deeper than `expr:`.
        let indent = line.len() - line.trim_start().len();
        let mut block = String::new();
        while let Some(next) = lines.peek() {
            if next.trim().is_empty() || next.len() - next.trim_start().len() <= indent {
                break;
            }
            block.push_str(next.trim());
            block.push(' ');
            lines.next();
        }
        out.push(block);
    }
    out
}

/// Metric names in a PromQL expression: identifiers outside quotes that start with
/// `delay_worker_` or `process_`, or are `up` (Prometheus' own).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in expr.chars().chain([' ']) {
        if c == '"' {
            quoted = !quoted;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
            continue;
        }
        if word.starts_with("delay_worker_") || word.starts_with("process_") || word == "up" {
            names.insert(word.clone());
        }
        word.clear();
    }
    names
}

/// The label names of `by (...)` clauses and the `name="value"` matchers of an expression.
fn labels_used(expr: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut by = BTreeSet::new();
    for part in expr.split("by (").skip(1) {
        let list = part.split(')').next().unwrap_or("");
        by.extend(list.split(',').map(|l| l.trim().to_string()));
    }
    let mut matchers = BTreeSet::new();
    for (i, _) in expr.match_indices("=\"") {
        let name: String = expr[..i]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let value = expr[i + 2..].split('"').next().unwrap_or("");
        matchers.insert(format!("{name}=\"{value}\""));
    }
    (by, matchers)
}

#[test]
fn monitoring_queries_name_only_metrics_and_labels_the_worker_serves() {
    let env = Env::new();
    let port = free_port();
    let mut worker = Proc::start(
        &env.config,
        &["--metrics-addr".to_string(), format!("127.0.0.1:{port}")],
    );
    let mut body = String::new();
    wait_until(
        Duration::from_secs(60),
        "the worker's /metrics",
        || match http_get(port, "/metrics") {
            Ok((200, _, b)) => {
                body = b;
                true
            }
            _ => false,
        },
    );
    worker.signal(libc::SIGTERM);
    assert!(
        worker.wait(Duration::from_secs(30)).success(),
        "{}",
        worker.log()
    );

    // Sample names (histograms as _bucket, _sum, _count) and their label pairs.
    let mut served: HashMap<String, String> = HashMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = line[name_end..].rsplit_once(' ').map_or("", |(l, _)| l);
        served
            .entry(line[..name_end].to_string())
            .or_default()
            .push_str(labels);
    }
    assert!(served.contains_key("delay_worker_live"), "{body}");

    for (source, exprs) in [
        ("dashboard.json", dashboard_exprs()),
        ("alerts.yml", rule_exprs()),
    ] {
        let mut all = BTreeSet::new();
        for expr in &exprs {
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{source}: no metric in {expr}");
            let own: Vec<&String> = names.iter().filter(|n| *n != "up").collect();
            let (by, matchers) = labels_used(expr);
            for name in &names {
                assert!(
                    name == "up" || served.contains_key(name),
                    "{source} queries {name}, which the worker does not serve:\n{expr}"
                );
            }
            // Labels Prometheus adds (job, instance) and `le` of histograms aside, a label
            // grouped by or matched must be on one of the queried metrics.
            for label in by
                .iter()
                .filter(|l| !["job", "instance", "le"].contains(&l.as_str()))
            {
                assert!(
                    own.iter()
                        .any(|n| served[*n].contains(&format!("{label}=\""))),
                    "{source} groups by {label}, which {own:?} do not have:\n{expr}"
                );
            }
            for m in matchers
                .iter()
                .filter(|m| !m.starts_with("job=") && !m.starts_with("instance="))
            {
                assert!(
                    own.iter().any(|n| served[*n].contains(m.as_str())),
                    "{source} matches {m}, which {own:?} never have:\n{expr}"
                );
            }
            all.extend(names);
        }
        assert!(all.len() >= 6, "{source}: only {all:?}");
    }
}
