//! A password with characters a URL reserves, not percent-encoded, in either URL (and
//! an unquoted one in PostgreSQL's key=value form): the one error line says to encode (or
//! quote) it, and never shows the password; the encoded URL works against the real
//! servers.

use crate::support::*;

const ENCODE: &str = "percent-encode them";

/// The one line of a failed run, checked for the hint and for the password.
fn line(out: &std::process::Output, code: i32, secret: &str) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!err.contains(secret), "password shown: {err}");
    err
}

#[test]
fn a_password_with_reserved_characters_is_told_to_be_percent_encoded() {
    let r = RedisServer::start();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("p@ss/1#x")
        .query(&mut r.con())
        .unwrap();
    let db = TestDb::new();
    let port = r
        .url()
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    let redis = |pw: &str| format!("redis://:{pw}@127.0.0.1:{port}/0");
    for (pw, chars) in [
        ("p@ss/1#x", "/ as %2F"),
        ("p#x", "# as %23"),
        ("p?x", "? as %3F"),
    ] {
        // Not a URL (2), or a host moved to part of the password (1): the hint either way.
        let out = run_worker(&["stats"], &redis(pw), &db.url);
        let code = out.status.code().filter(|c| [1, 2].contains(c));
        let err = line(&out, code.unwrap_or(-1), pw);
        assert!(err.contains(ENCODE) && err.contains(chars), "{err}");
    }
    let out = run_worker(&["stats"], &redis("p%zz"), &db.url);
    let err = line(&out, 1, "p%zz");
    assert!(err.contains("% as %25"), "{err}");
    // Encoded, it works.
    let out = run_worker(&["stats"], &redis("p%40ss%2F1%23x"), &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));

    // PostgreSQL: the host moves (a failed lookup) or the password is cut short.
    // With the password put into the test database's URL (its server trusts loopback, so
    // only a password that moves the host or breaks the URL fails).
    let pg = |pw: &str| {
        let (scheme, rest) = db.url.split_once("://").unwrap();
        let (user, host) = rest.split_once('@').unwrap();
        format!("{scheme}://{user}:{pw}@{host}")
    };
    for (pw, chars) in [
        ("s3/cr@t", "/ as %2F"),
        ("s3cr#t/x@y", "# as %23, / as %2F"),
    ] {
        let out = run_worker(&["migrate"], &r.url(), &pg(pw));
        let err = text(&out.stderr);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{err}");
        let err = line(&out, out.status.code().unwrap(), pw);
        assert!(err.contains(ENCODE) && err.contains(chars), "{err}");
    }
    let out = run_worker(&["migrate"], &r.url(), &pg("s3%2Fcr%40t"));
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The key=value form is quoted instead.
    let kv = "host=127.0.0.1 user=shop password=se cret";
    let out = run_worker(&["migrate"], &r.url(), kv);
    let err = line(&out, 2, "se cret");
    assert!(err.contains("goes in single quotes"), "{err}");
    // A URL without a password, or a well-formed one, gets no such hint.
    let out = run_worker(&["migrate"], &r.url(), &db.url);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run_worker(
        &["stats"],
        &format!("redis://127.0.0.1:{}/0", free_port()),
        &db.url,
    );
    assert!(!text(&out.stderr).contains(ENCODE), "{}", text(&out.stderr));
}
