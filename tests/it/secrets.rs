//! Secrets stay secret: every form of connection string is shown with its password
//! hidden, and a password given on the command line (visible to every user in `ps`) is
//! warned about once, pointing to the environment.

use crate::support::*;
use crate::tls::{assert_line, output_within};
use delay_worker::config::redact_url;
use std::process::Command;
use std::time::Duration;

#[test]
fn every_form_of_connection_string_is_shown_without_its_password() {
    // (connection string, the secret, what must still be readable)
    let cases: &[(&str, &str, &[&str])] = &[
        // libpq URLs: userinfo, percent-escapes, unescaped `/` and `@` in the password.
        (
            "postgres://shop:s3cr3t@db.internal:5432/shop",
            "s3cr3t",
            &["postgres://shop:", "@db.internal:5432/shop"],
        ),
        (
            "postgresql://shop:p%40ss%2Fw0rd@db/shop?sslmode=verify-full",
            "p%40ss%2Fw0rd",
            &["shop:", "@db/shop?sslmode=verify-full"],
        ),
        (
            "postgres://shop:pa/ss@w0rd@db/shop",
            "pa/ss@w0rd",
            &["shop:", "@db/shop"],
        ),
        ("postgres://shop:pa/ss@w0rd@db/shop", "w0rd", &["@db/shop"]),
        // ... and in the query, first, last or alone, any case of the key.
        (
            "postgres://shop@db/shop?password=s3cr3t&sslmode=require",
            "s3cr3t",
            &["postgres://shop@db/shop?password=", "&sslmode=require"],
        ),
        (
            "postgres://shop@db/shop?sslmode=require&password=s3cr3t",
            "s3cr3t",
            &["sslmode=require&password="],
        ),
        (
            "postgres://db/shop?PassWord=s3cr3t",
            "s3cr3t",
            &["postgres://db/shop?PassWord="],
        ),
        (
            "postgres://db/shop?password=s3cr3t%20x&application_name=a",
            "s3cr3t",
            &["application_name=a"],
        ),
        // key=value: plain, quoted, spaces around `=`, escapes in and out of quotes.
        (
            "host=db user=shop password=s3cr3t dbname=shop",
            "s3cr3t",
            &["host=db user=shop password=", " dbname=shop"],
        ),
        (
            "host=db password='s3 cr3t' dbname=shop",
            "cr3t",
            &["host=db", "dbname=shop"],
        ),
        (
            "host=db password = 's3cr3t' dbname=shop",
            "s3cr3t",
            &["host=db", "dbname=shop"],
        ),
        (
            "host=db password= s3cr3t dbname=shop",
            "s3cr3t",
            &["host=db", "dbname=shop"],
        ),
        ("host=db password =s3cr3t", "s3cr3t", &["host=db"]),
        (
            r"host=db password='it\'s s3cr3t' user=shop",
            "s3cr3t",
            &["user=shop"],
        ),
        (
            r"host=db password='it\'s s3cr3t' user=shop",
            "it",
            &["user=shop"],
        ),
        (
            r"host=db password=s3\ cr3t user=shop",
            "cr3t",
            &["user=shop"],
        ),
        (
            r"host=db password='ends in \\' user=shop",
            "ends in",
            &["user=shop"],
        ),
        (
            "host=db password='never closed s3cr3t",
            "s3cr3t",
            &["host=db"],
        ),
        (
            "host=db sslpassword=s3cr3t sslkey=/k.pem",
            "s3cr3t",
            &["sslkey=/k.pem"],
        ),
        // Redis URLs: password only, user and password, TLS, a Unix socket's query.
        (
            "redis://:s3cr3t@127.0.0.1:6379/0",
            "s3cr3t",
            &["redis://:", "@127.0.0.1:6379/0"],
        ),
        (
            "redis://worker:s3cr3t@127.0.0.1:6379/0",
            "s3cr3t",
            &["redis://worker:", "@127.0.0.1:6379/0"],
        ),
        (
            "rediss://worker:s3cr3t@redis.internal:6380/#insecure",
            "s3cr3t",
            &["rediss://worker:", "@redis.internal:6380/#insecure"],
        ),
        (
            "redis+unix:///run/redis.sock?db=0&pass=s3cr3t",
            "s3cr3t",
            &["redis+unix:///run/redis.sock?db=0&pass="],
        ),
        // Not a URL, but shaped like one without its scheme.
        (
            "worker:s3cr3t@redis.internal:6379",
            "s3cr3t",
            &["worker:", "@redis.internal"],
        ),
    ];
    for (input, secret, readable) in cases {
        let shown = redact_url(input);
        assert!(!shown.contains(secret), "{input:?} shown as {shown:?}");
        assert!(shown.contains("***"), "{input:?} shown as {shown:?}");
        for part in *readable {
            assert!(
                shown.contains(part),
                "{part:?} lost: {input:?} -> {shown:?}"
            );
        }
    }
    // Nothing to hide: shown as given.
    for plain in [
        "postgres://shop@db:5432/shop?sslmode=verify-full&sslrootcert=/etc/ssl/ca.pem",
        "host=db user=shop dbname=shop sslmode=require",
        "redis://127.0.0.1:6379/0",
        "rediss://redis.internal:6380/",
    ] {
        assert_eq!(redact_url(plain), plain);
    }
}

/// The worker binary with a clean environment for its connection settings.
fn worker(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_worker"));
    for var in [
        "REDIS_URL",
        "DATABASE_URL",
        "REDIS_CA_FILE",
        "REDIS_CERT_FILE",
        "REDIS_KEY_FILE",
    ] {
        c.env_remove(var);
    }
    c.env("RUST_LOG", "warn").args(args);
    c
}

const WARNING: &str = "carries a password on the command line";

#[test]
fn a_password_on_the_command_line_is_warned_about_once_and_never_shown() {
    let dead = free_port();
    let redis_pw = format!("redis://:hunter2@127.0.0.1:{dead}/");
    let db_pw = format!("host=127.0.0.1 port={dead} user=shop password = 'hunter 3' dbname=shop");
    let cap = Duration::from_secs(60);

    // Given as flags: one warning each, naming the flag and where the password belongs.
    let out = output_within(
        worker(&[
            "cancel",
            "--key",
            "k",
            "--redis-url",
            &redis_pw,
            "--database-url",
            &db_pw,
        ]),
        cap,
    );
    let err = text(&out.stderr);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 2, "{err}");
    assert!(
        warnings[0].contains("WARN") && warnings[0].contains("--redis-url"),
        "{err}"
    );
    assert!(warnings[1].contains("--database-url"), "{err}");
    for w in &warnings {
        assert!(
            w.contains("ps")
                && w.contains("in the environment")
                && w.contains("/etc/delay-worker/worker.env"),
            "{w}"
        );
    }
    assert!(
        err.contains("REDIS_URL") && err.contains("DATABASE_URL"),
        "{err}"
    );
    // The run itself fails on the unreachable Redis: one line, password hidden.
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "cannot reach Redis at redis://:***@127.0.0.1:{dead}/"
        )),
        "{err}"
    );
    assert!(!err.contains("hunter"), "{err}");

    // From the environment: no warning. `migrate` reaches the PostgreSQL of the
    // connection string alone: its error line hides the quoted password.
    let mut c = worker(&["migrate"]);
    c.env("REDIS_URL", &redis_pw).env("DATABASE_URL", &db_pw);
    let out = output_within(c, cap);
    let line = assert_line(&out, 1, "cannot reach PostgreSQL at host=127.0.0.1");
    assert!(line.contains("password = ***"), "{line}");
    assert!(!text(&out.stderr).contains("hunter"));

    // A flag without a password: no warning.
    let out = output_within(
        worker(&[
            "migrate",
            "--database-url",
            &format!("postgres://shop@127.0.0.1:{dead}/shop"),
        ]),
        cap,
    );
    assert!(!text(&out.stderr).contains(WARNING));

    // A mistyped argument that clap quotes back is shown redacted too.
    let out = output_within(worker(&[&redis_pw]), cap);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !text(&out.stderr).contains("hunter2"),
        "{}",
        text(&out.stderr)
    );
}
