//! The documentation held to the repository and the binary, without servers (fast): every
//! relative link of README.md and docs/**/*.md reaches a file and, with `#anchor`, a heading
//! of it (GitHub's anchors); every `--flag` they name is in the `--help` of the `worker`
//! binary or of one of its subcommands, or in the short list of other tools' flags below; the
//! README stays a front page whose Dependencies table names exactly the crates of
//! Cargo.toml; and the Chinese quick start runs the very commands of the README's.
//! The quick start's commands themselves run against real servers in tests/it/docs.rs.

#[path = "docs/quick_start.rs"]
mod quick_start;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The README stays a front page; longer text goes into docs/.
const README_MAX_LINES: usize = 250;

/// Flags the docs name that belong to other programs, each with the reason it is named.
const OTHER_TOOLS: &[(&str, &str)] = &[
    (
        "--call-graph",
        "perf record --call-graph dwarf (where the CPU went)",
    ),
    (
        "--cluster",
        "redis-cli --cluster create/reshard, redis-benchmark --cluster",
    ),
    ("--contents", "dpkg-deb --info/--contents (the .deb's test)"),
    ("--dry-run", "scripts/install.sh --dry-run"),
    (
        "--dump-dom",
        "chromium --headless --dump-dom (the status page's test)",
    ),
    (
        "--fast",
        "scripts/services.sh start --fast (the tests' servers)",
    ),
    (
        "--force-confold",
        "dpkg -i --force-confold (install.sh keeps worker.env)",
    ),
    (
        "--force-script-chrootless",
        "dpkg --root --force-script-chrootless (the .deb's test)",
    ),
    ("--headless", "chromium --headless (the status page's test)"),
    (
        "--ignored",
        "cargo test -- --ignored (a measurement the test command leaves out)",
    ),
    ("--info", "dpkg-deb --info/--contents (the .deb's test)"),
    ("--minutes", "scripts/chaos.sh --minutes N"),
    (
        "--no-reload",
        "systemctl --no-reload disable (the RPM's %preun)",
    ),
    (
        "--nocapture",
        "cargo test -- --nocapture (the test harness)",
    ),
    ("--now", "systemctl enable --now"),
    ("--out", "scripts/release.sh --out DIR"),
    ("--profile", "scripts/release.sh --profile glibc-check"),
    (
        "--release",
        "cargo build --release; scripts/rpm/build.sh --release 2",
    ),
    ("--replacepkgs", "rpm -U --replacepkgs (install.sh)"),
    (
        "--root",
        "dpkg --root, rpm --root (the package tests' throwaway roots)",
    ),
    ("--seed", "scripts/chaos.sh --seed S"),
    (
        "--stress-count",
        "cargo nextest run --stress-count N (a suite run N times over, in docs/tests.md)",
    ),
    (
        "--target",
        "cargo zigbuild --target x86_64-unknown-linux-gnu.2.17",
    ),
    ("--test", "cargo test --test it"),
    (
        "--version-info",
        "readelf --version-info (the glibc symbol check)",
    ),
];

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// README.md and every .md file under docs/, relative to the repository, sorted.
fn doc_files() -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = format!("{rel}/{name}");
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), &rel, out);
            } else if name.ends_with(".md") {
                out.push(rel);
            }
        }
    }
    let mut out = vec!["README.md".to_string()];
    walk(&Path::new(ROOT).join("docs"), "docs", &mut out);
    out.sort();
    out
}

/// `text` with every fenced code block blanked (its lines kept empty, so line numbers hold).
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for l in text.lines() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(l);
        }
        out.push('\n');
    }
    out
}

/// `text` (prose) with inline code spans removed; a span may cross a line break but not a
/// blank line.
fn without_inline_code(text: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    let mut prev_newline = false;
    for c in text.chars() {
        if c == '\n' {
            if prev_newline {
                in_code = false;
            }
            prev_newline = true;
            out.push(c);
            continue;
        }
        prev_newline = false;
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// GitHub's anchor of a heading: its text without markup, lower case, every character but
/// letters, digits, `-`, `_` and spaces removed, spaces made `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // [text](url) -> text
    while let Some(i) = rest.find('[') {
        text.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match (after.find("]("), after.find(')')) {
            (Some(j), Some(k)) if j < k => {
                text.push_str(&after[..j]);
                rest = &after[k + 1..];
            }
            _ => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a document's headings (a repeated one gets `-1`, `-2`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for l in prose(text).lines() {
        let t = l.trim_start_matches('#');
        if t.len() < l.len() && l.len() - t.len() <= 6 && t.starts_with(' ') {
            let s = slug(t.trim());
            let n = seen.entry(s.clone()).or_insert(0);
            out.insert(if *n == 0 {
                s.clone()
            } else {
                format!("{s}-{n}")
            });
            *n += 1;
        }
    }
    out
}

/// Every link target of a document's prose, with its line: `[text](target)` and the `src`
/// of an `<img>`.
fn links(text: &str) -> Vec<(usize, String)> {
    let t = without_inline_code(&prose(text));
    let line_of = |i: usize| t[..i].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (i, _) in t.match_indices("](") {
        let after = &t[i + 2..];
        let end = after.find(')').unwrap_or(after.len());
        out.push((line_of(i), after[..end].trim().to_string()));
    }
    for (i, _) in t.match_indices("src=\"") {
        let after = &t[i + 5..];
        let end = after.find('"').unwrap_or(after.len());
        out.push((line_of(i), after[..end].to_string()));
    }
    out
}

/// `base/rel` with `.` and `..` resolved, relative to the repository.
fn resolve(base: &Path, rel: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

#[test]
fn every_relative_link_resolves_to_a_file_and_a_heading() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        let text = read(&file);
        let dir = Path::new(&file).parent().unwrap().to_path_buf();
        for (line, target) in links(&text) {
            if target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let to = if path.is_empty() {
                PathBuf::from(&file)
            } else {
                resolve(&dir, path)
            };
            let full = Path::new(ROOT).join(&to);
            if !full.exists() {
                broken.push(format!("{file}:{line}: {target}: no file {}", to.display()));
                continue;
            }
            if let Some(anchor) = anchor {
                let to_text = std::fs::read_to_string(&full).unwrap_or_default();
                if !to.to_string_lossy().ends_with(".md") || !anchors(&to_text).contains(anchor) {
                    broken.push(format!(
                        "{file}:{line}: {target}: no heading #{anchor} in {}",
                        to.display()
                    ));
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} links found: is the parser right?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_github_s_rules() {
    assert_eq!(
        slug("`--check` for Nagios, Icinga, Zabbix or Sensu"),
        "--check-for-nagios-icinga-zabbix-or-sensu"
    );
    assert_eq!(
        slug("Dead letters: `worker dead ...`"),
        "dead-letters-worker-dead-"
    );
    assert_eq!(slug("Sharding: `--shards N`"), "sharding---shards-n");
    assert_eq!(
        slug("From PHP: the library in `clients/php/`"),
        "from-php-the-library-in-clientsphp"
    );
    assert_eq!(slug("worker_inbox"), "worker_inbox");
    assert_eq!(slug("运维的第一批命令"), "运维的第一批命令");
    let a = anchors("# A\n## B\n```\n## not a heading\n```\n### B\n");
    assert_eq!(a, ["a", "b", "b-1"].iter().map(|s| s.to_string()).collect());
}

/// Every `--flag` in `text`: `--` at the start of a word (not of a link's `#anchor`), then a
/// lower-case letter.
fn flags_in(text: &str) -> BTreeSet<String> {
    let b = text.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'-' || c == b'_';
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i + 2 < b.len() {
        if b[i] == b'-'
            && b[i + 1] == b'-'
            && b[i + 2].is_ascii_lowercase()
            && (i == 0 || !(word(b[i - 1]) || b[i - 1] == b'#'))
        {
            let mut j = i + 2;
            while j < b.len()
                && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-')
            {
                j += 1;
            }
            out.insert(text[i..j].trim_end_matches('-').to_string());
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_worker"))
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "worker {args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The subcommands a `--help` lists under "Commands:" (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every flag of `worker --help` and of each subcommand's, nested ones included.
fn help_flags() -> (BTreeSet<String>, usize) {
    let mut flags = BTreeSet::new();
    let mut todo: Vec<Vec<String>> = vec![vec![]];
    let mut seen = 0;
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let h = help(&args);
        seen += 1;
        flags.extend(flags_in(&h));
        for sub in subcommands(&h) {
            let mut p = path.clone();
            p.push(sub);
            todo.push(p);
        }
    }
    (flags, seen)
}

#[test]
fn every_flag_the_docs_name_exists_in_worker_help() {
    let (known, helps) = help_flags();
    assert!(helps > 5, "only {helps} --help pages: is the parser right?");
    for must in ["--threads", "--pending-warn", "--older-than", "--json"] {
        assert!(
            known.contains(must),
            "{must} not found in --help: {known:?}"
        );
    }
    let other: BTreeSet<&str> = OTHER_TOOLS.iter().map(|(f, _)| *f).collect();
    let mut unknown = Vec::new();
    let mut used_other = BTreeSet::new();
    for file in doc_files() {
        let text = read(&file);
        for (n, line) in text.lines().enumerate() {
            for f in flags_in(line) {
                if known.contains(&f) {
                    continue;
                }
                if other.contains(f.as_str()) {
                    used_other.insert(f);
                    continue;
                }
                unknown.push(format!("{file}:{}: {f}", n + 1));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "flags no `worker ... --help` knows (a flag renamed or gone? another tool's: add it \
         to OTHER_TOOLS with its reason):\n{}",
        unknown.join("\n")
    );
    let stale: Vec<&str> = other
        .iter()
        .filter(|f| !used_other.contains(**f) && !known.contains(**f))
        .copied()
        .collect();
    assert!(
        stale.is_empty(),
        "OTHER_TOOLS lists flags no doc names any more: {stale:?}"
    );
}

#[test]
fn the_readme_is_a_front_page_whose_dependencies_are_cargo_s() {
    let readme = read("README.md");
    let n = readme.lines().count();
    assert!(
        n <= README_MAX_LINES,
        "README.md has {n} lines (at most {README_MAX_LINES}): move the detail into docs/"
    );
    // The two commands, first thing.
    let top: Vec<&str> = readme.lines().take(6).collect();
    assert!(top[2].starts_with("```sh"), "{top:?}");
    assert!(top[3].starts_with("scripts/demo.sh "), "{top:?}");
    assert!(top[4].starts_with("scripts/test.sh "), "{top:?}");
    assert!(read(".ci/run").contains("exec scripts/test.sh"));

    let cargo = read("Cargo.toml");
    let deps: BTreeSet<String> = cargo
        .lines()
        .skip_while(|l| l.trim() != "[dependencies]")
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_string()))
        .filter(|k| !k.is_empty() && !k.starts_with('#'))
        .collect();
    assert!(deps.len() > 10, "{deps:?}");
    let table = readme
        .split("\n## Dependencies\n")
        .nth(1)
        .expect("README.md has a Dependencies section");
    let mut named = BTreeSet::new();
    for row in table.lines().take_while(|l| !l.starts_with("## ")) {
        let Some(first) = row.strip_prefix("| `") else {
            continue;
        };
        let first = first.split('|').next().unwrap();
        let crates = first.split('(').next().unwrap();
        for (k, part) in format!("`{crates}").split('`').enumerate() {
            if k % 2 == 1 {
                named.insert(part.to_string());
            }
        }
    }
    let missing: Vec<_> = deps.difference(&named).collect();
    let extra: Vec<_> = named.difference(&deps).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "README's Dependencies table and Cargo.toml's [dependencies] differ: not in the table \
         {missing:?}, not in Cargo.toml {extra:?}"
    );
}

#[test]
fn the_chinese_quick_start_runs_the_readme_s_commands() {
    let en = quick_start::blocks(&read("README.md"));
    let zh = quick_start::blocks(&read("docs/zh-CN/quick-start.md"));
    assert!(
        !en.is_empty(),
        "README.md has no <!-- quick-start --> block"
    );
    assert_eq!(
        en.iter().map(|b| &b.lang).collect::<Vec<_>>(),
        zh.iter().map(|b| &b.lang).collect::<Vec<_>>(),
        "the quick starts' marked blocks differ in number or kind"
    );
    for (e, z) in en.iter().zip(&zh) {
        assert_eq!(
            quick_start::code(e),
            quick_start::code(z),
            "README.md line {} and docs/zh-CN/quick-start.md line {} differ (comments aside)",
            e.line,
            z.line
        );
    }
}
