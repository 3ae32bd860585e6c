//! The systemd unit's command line and its environment file, edited the way docs/operating.md ("systemd")
//! says (threads changed in `WORKER_THREADS`, a flag added to `WORKER_ARGS`, even
//! `--threads` there): the file reads the same to bash (`set -a; . worker.env`) as to
//! systemd's `EnvironmentFile=` (its rules, below), and the unit's exact `ExecStart`,
//! expanded with it as systemd expands it, runs the worker with the new settings against
//! real servers. `install.sh --dry-run` of a file that is not there fails in one line.

use crate::support::*;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// An environment file read as systemd's `EnvironmentFile=` reads it (systemd's
/// `parse_env_file`, src/basic/env-file.c): `#` or `;` starts a comment line; `KEY=VALUE`
/// with blanks around the key and before the value skipped; an unquoted value ends at the
/// line's end, its trailing blanks dropped, a backslash taking the next character as it is
/// (a backslash-newline joins lines); `'...'` is taken as written; in `"..."` a backslash
/// escapes only `"`, `\`, `` ` ``, `$` (and a newline); a quote may follow or precede
/// unquoted text (`a'b c'` is `ab c`). No `$` expansion of any kind.
fn systemd_env_file(text: &str) -> BTreeMap<String, String> {
    #[derive(PartialEq, Clone, Copy)]
    enum S {
        PreKey,
        Key,
        PreValue,
        Value,
        ValueEscape,
        Single,
        Double,
        DoubleEscape,
        Comment,
        CommentEscape,
    }
    let mut out = BTreeMap::new();
    let (mut key, mut value) = (String::new(), String::new());
    // Length of `value` up to its last character that was not trailing blank.
    let mut keep = 0usize;
    let mut s = S::PreKey;
    let mut push = |key: &mut String, value: &mut String, keep: usize| {
        value.truncate(keep);
        let k = key.trim().to_string();
        if !k.is_empty() {
            out.insert(k, std::mem::take(value));
        }
        key.clear();
        value.clear();
    };
    for c in text.chars().chain(std::iter::once('\n')) {
        let blank = c == ' ' || c == '\t';
        s = match s {
            S::PreKey if c == '#' || c == ';' => S::Comment,
            S::PreKey if blank || c == '\n' || c == '\r' => S::PreKey,
            S::PreKey => {
                key.push(c);
                S::Key
            }
            S::Key if c == '\n' => {
                key.clear();
                S::PreKey
            }
            S::Key if c == '=' => {
                keep = 0;
                S::PreValue
            }
            S::Key => {
                key.push(c);
                S::Key
            }
            S::PreValue | S::Value if c == '\n' => {
                push(&mut key, &mut value, keep);
                S::PreKey
            }
            S::PreValue | S::Value if c == '\'' => S::Single,
            S::PreValue | S::Value if c == '"' => S::Double,
            S::PreValue | S::Value if c == '\\' => S::ValueEscape,
            S::PreValue if blank => S::PreValue,
            S::PreValue | S::Value => {
                value.push(c);
                if !blank {
                    keep = value.len();
                }
                S::Value
            }
            S::ValueEscape if c == '\n' => S::Value,
            S::ValueEscape => {
                value.push(c);
                keep = value.len();
                S::Value
            }
            S::Single if c == '\'' => S::Value,
            S::Single => {
                value.push(c);
                keep = value.len();
                S::Single
            }
            S::Double if c == '"' => S::Value,
            S::Double if c == '\\' => S::DoubleEscape,
            S::Double => {
                value.push(c);
                keep = value.len();
                S::Double
            }
            S::DoubleEscape => {
                if c != '\n' {
                    if !"\"\\`$".contains(c) {
                        value.push('\\');
                    }
                    value.push(c);
                }
                keep = value.len();
                S::Double
            }
            S::Comment if c == '\\' => S::CommentEscape,
            S::Comment if c == '\n' => S::PreKey,
            S::Comment | S::CommentEscape => S::Comment,
        };
    }
    out
}

/// The same file read by bash as docs/operating.md says (`set -a; . FILE`): the variables it
/// set, as the shell exported them.
fn bash_env_file(path: &std::path::Path, keys: &[&String]) -> BTreeMap<String, String> {
    let mut script = format!("set -eu; set -a; . {}; set +a\n", path.display());
    for k in keys {
        script.push_str(&format!("printf '%s\\0%s\\0' {k} \"${{{k}}}\"\n"));
    }
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "bash: {}", text(&out.stderr));
    let fields: Vec<String> = out
        .stdout
        .split(|b| *b == 0)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    fields
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].clone(), c[1].clone()))
        .collect()
}

/// The unit's `Environment=` lines and its `ExecStart=` words, as written.
fn unit() -> (BTreeMap<String, String>, Vec<String>) {
    let text = std::fs::read_to_string(format!("{ROOT}/scripts/worker.service")).unwrap();
    let mut env = BTreeMap::new();
    let mut exec = Vec::new();
    for line in text.lines() {
        if let Some(kv) = line.strip_prefix("Environment=") {
            let (k, v) = kv.split_once('=').unwrap();
            env.insert(k.to_string(), v.to_string());
        } else if let Some(cmd) = line.strip_prefix("ExecStart=") {
            exec = cmd.split_whitespace().map(str::to_string).collect();
        }
    }
    assert!(!exec.is_empty(), "the unit has no ExecStart");
    (env, exec)
}

/// `ExecStart`'s words expanded as systemd does: a word `$NAME` becomes the variable's
/// value split at whitespace (nothing when it is unset or empty), `${NAME}` one word.
fn expand(words: &[String], env: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    for w in words {
        if let Some(name) = w.strip_prefix("${").and_then(|n| n.strip_suffix('}')) {
            out.push(env.get(name).cloned().unwrap_or_default());
        } else if let Some(name) = w.strip_prefix('$') {
            if let Some(v) = env.get(name) {
                out.extend(v.split_whitespace().map(str::to_string));
            }
        } else {
            assert!(!w.contains('$'), "a variable inside a word: {w}");
            out.push(w.clone());
        }
    }
    out
}

/// The template edited as docs/operating.md says: both URLs filled in, `WORKER_THREADS` changed,
/// the `WORKER_ARGS` line uncommented with these flags inside its quotes.
fn edited(template: &str, redis: &str, db: &str, threads: &str, args: &str) -> String {
    let mut saw_args = false;
    let lines: Vec<String> = template
        .lines()
        .map(|l| {
            if l.starts_with("#REDIS_URL=") {
                format!("REDIS_URL='{redis}'")
            } else if l.starts_with("#DATABASE_URL=") {
                format!("DATABASE_URL='{db}'")
            } else if l.starts_with("WORKER_THREADS=") {
                format!("WORKER_THREADS='{threads}'")
            } else if l.starts_with("#WORKER_ARGS='") {
                saw_args = true;
                format!("WORKER_ARGS='{args}'")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(saw_args, "the template has no #WORKER_ARGS='...' line");
    lines.join("\n") + "\n"
}

/// Reads `file` both ways, checks they agree, and starts the unit's command line with it.
fn start_unit(file: &std::path::Path) -> Proc {
    let text = std::fs::read_to_string(file).unwrap();
    let systemd = systemd_env_file(&text);
    let keys: Vec<&String> = systemd.keys().collect();
    assert_eq!(
        bash_env_file(file, &keys),
        systemd,
        "bash and systemd differ"
    );
    let (mut env, exec) = unit();
    env.extend(systemd);
    let mut words = expand(&exec, &env);
    assert_eq!(words[0], "/usr/local/bin/worker");
    words[0] = env!("CARGO_BIN_EXE_worker").to_string();
    let mut cmd = Command::new(&words[0]);
    cmd.args(&words[1..])
        .env_clear()
        .envs(&env)
        .stdin(std::process::Stdio::null());
    Proc::spawn(cmd)
}

#[test]
fn the_template_reads_the_same_to_bash_and_to_systemd() {
    let path = std::path::PathBuf::from(format!("{ROOT}/scripts/worker.env"));
    let text = std::fs::read_to_string(&path).unwrap();
    let systemd = systemd_env_file(&text);
    assert_eq!(systemd.get("WORKER_THREADS").map(String::as_str), Some("8"));
    assert_eq!(systemd.get("RUST_LOG").map(String::as_str), Some("info"));
    let keys: Vec<&String> = systemd.keys().collect();
    assert_eq!(bash_env_file(&path, &keys), systemd);
    // The rules themselves, on the cases a careless edit makes.
    let rules = systemd_env_file(
        "A=plain  \n B = 'x y'\nC=\"q \\$HOME \\n\"\n# D=no\n;E=no\nF=a'b c'd\nG=\\#h\n",
    );
    let want: BTreeMap<String, String> = [
        ("A", "plain"),
        ("B", "x y"),
        ("C", "q $HOME \\n"),
        ("F", "ab cd"),
        ("G", "#h"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(rules, want);
}

#[test]
fn the_unit_s_command_line_runs_with_the_edited_environment_file() {
    let env = Env::new();
    let template = std::fs::read_to_string(format!("{ROOT}/scripts/worker.env")).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "dw-unit-env-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("worker.env");
    let orders = seed_orders(&env.db, 4);

    // Threads changed, a flag added: the worker runs with both.
    let port = free_port();
    std::fs::write(
        &file,
        edited(
            &template,
            &env.config.redis_url,
            &env.db.url,
            "3",
            &format!("--metrics-addr 127.0.0.1:{port}"),
        ),
    )
    .unwrap();
    // The tools run with the same file in a shell, as docs/operating.md says.
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -a; . {}; {} migrate",
            file.display(),
            env!("CARGO_BIN_EXE_worker")
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "schema is current");
    let mut w = start_unit(&file);
    wait_until(WAIT, "the start logged", || w.log().contains("threads=3 "));
    wait_until(WAIT, "/metrics on the added address", || {
        http_get(port, "/metrics").is_ok_and(|(code, _, _)| code == 200)
    });
    push_timeouts(&env, &orders[..2], 0);
    wait_until(WAIT, "two jobs done", || inbox_count(&env.db) == 2);
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());

    // `--threads` added to WORKER_ARGS too (the natural edit): that one wins, no exit 2.
    let port = free_port();
    std::fs::write(
        &file,
        edited(
            &template,
            &env.config.redis_url,
            &env.db.url,
            "3",
            &format!("--metrics-addr 127.0.0.1:{port} --threads 5"),
        ),
    )
    .unwrap();
    let mut w = start_unit(&file);
    wait_until(WAIT, "the start logged", || w.log().contains("threads=5 "));
    push_timeouts(&env, &orders[2..], 0);
    wait_until(WAIT, "four jobs done", || inbox_count(&env.db) == 4);
    w.signal(libc::SIGTERM);
    assert!(w.wait(WAIT).success(), "{}", w.log());

    // A WORKER_THREADS that makes no sense, out of range or not a number, is named as
    // written, one line, exit 2.
    for bad in ["0", "abc"] {
        std::fs::write(
            &file,
            edited(&template, &env.config.redis_url, &env.db.url, bad, ""),
        )
        .unwrap();
        let mut w = start_unit(&file);
        let status = w.wait(WAIT);
        assert_eq!(status.code(), Some(2), "{}", w.log());
        assert!(
            w.log()
                .trim_end()
                .ends_with("worker: WORKER_THREADS: must be a whole number between 1 and 1024"),
            "{bad}: {}",
            w.log()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn install_dry_run_fails_when_its_input_is_missing() {
    for missing in ["/no/such/worker", "/no/such/delay-worker_1_amd64.deb"] {
        let out = Command::new("bash")
            .arg(format!("{ROOT}/scripts/install.sh"))
            .args(["--dry-run", missing])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("install: no "), "{err}");
        assert!(err.contains(missing), "{err}");
        assert!(!text(&out.stdout).contains("done"), "{}", text(&out.stdout));
    }
}

#[test]
fn install_dry_run_fails_where_a_real_run_would_refuse() {
    // A binary install on a host where the package is installed: the real run refuses at
    // once; the dry run notes it, shows the rest, and fails at the end the same way.
    let bin = std::env::temp_dir().join(format!("dw-dpkg-says-installed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin).unwrap();
    let query = bin.join("dpkg-query");
    std::fs::write(&query, "#!/bin/sh\nprintf 'install ok installed'\n").unwrap();
    std::fs::set_permissions(&query, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = Command::new("bash")
        .arg(format!("{ROOT}/scripts/install.sh"))
        .args(["--dry-run", env!("CARGO_BIN_EXE_worker")])
        .env("PATH", path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&bin);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.trim_end().ends_with(
            "install: a real run would stop here: delay-worker is installed as a package \
             (/usr/bin/worker): install a newer package, or remove it first (dpkg -r delay-worker)"
        ),
        "{err}"
    );
    assert!(!text(&out.stdout).contains("done"), "{}", text(&out.stdout));
}
