//! Connection strings read as their clients read them: libpq's two forms (a URL,
//! `postgres://u:pw@host/db?sslmode=require`, or `key=value` settings,
//! `host=db password='it''s' sslmode=verify-full`) and Redis URLs.
//!
//! Two users: [`crate::config::redact_url`] hides the secrets of any of these forms
//! wherever a connection string is shown, and [`crate::db`] takes out the TLS settings
//! (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`) that the `postgres` crate does not know.
//! The readers are lenient: text that is not well-formed is still split as far as it
//! goes, so that a malformed string is redacted rather than shown whole.

use std::ops::Range;

/// Keys whose values are secrets, in either form and in URL queries.
const SECRET_KEYS: &[&str] = &["password", "pass", "sslpassword"];

/// Whether `key` (already decoded) names a secret.
pub fn is_secret_key(key: &str) -> bool {
    SECRET_KEYS.iter().any(|k| key.eq_ignore_ascii_case(k))
}

/// One setting of a connection string, with where it stands in the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The key, percent-decoded in a URL query.
    pub key: String,
    /// The value: unquoted and unescaped (key=value form) or percent-decoded (URL query).
    pub value: String,
    /// The whole setting (`key = 'value'`, or `key=value` of a query).
    pub span: Range<usize>,
    /// The value as written, quotes included.
    pub value_span: Range<usize>,
}

/// Whether `s` is in URL form (`scheme://...`) rather than `key=value` form.
pub fn is_url(s: &str) -> bool {
    let s = s.trim_start();
    match s.find("://") {
        Some(i) => {
            i > 0
                && s[..i]
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b))
        }
        None => false,
    }
}

/// The settings of a `key=value` connection string, in order (libpq's grammar: spaces
/// around `=` allowed; a value in single quotes may hold spaces; a backslash escapes the
/// next character, in or out of quotes). A word without `=` is skipped; an unterminated
/// quote runs to the end of the text.
pub fn key_values(s: &str) -> Vec<Setting> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        if i >= b.len() {
            break;
        }
        let start = i;
        while i < b.len() && !b[i].is_ascii_whitespace() && b[i] != b'=' {
            i += 1;
        }
        let key = s[start..i].to_string();
        let j = skip_ws(i);
        if j >= b.len() || b[j] != b'=' {
            // Not a setting: move on past this word.
            continue;
        }
        i = skip_ws(j + 1);
        let value_start = i;
        let mut value = Vec::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() {
                match b[i] {
                    b'\\' if i + 1 < b.len() => {
                        value.push(b[i + 1]);
                        i += 2;
                    }
                    b'\'' => {
                        i += 1;
                        break;
                    }
                    c => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                if b[i] == b'\\' && i + 1 < b.len() {
                    value.push(b[i + 1]);
                    i += 2;
                } else {
                    value.push(b[i]);
                    i += 1;
                }
            }
        }
        out.push(Setting {
            key,
            value: String::from_utf8_lossy(&value).into_owned(),
            span: start..i,
            value_span: value_start..i,
        });
    }
    out
}

/// Where the query of a URL stands (after `?`, up to a `#` or the end), or `None`.
pub fn query_range(s: &str) -> Option<Range<usize>> {
    let q = s.find('?')? + 1;
    let end = s[q..].find('#').map(|i| q + i).unwrap_or(s.len());
    Some(q..end)
}

/// The settings of a URL's query (`?a=1&b=2`), percent-decoded.
pub fn query_settings(s: &str) -> Vec<Setting> {
    let Some(q) = query_range(s) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut start = q.start;
    for part in s[q.clone()].split('&') {
        let span = start..start + part.len();
        start = span.end + 1;
        let (k, value_span) = match part.find('=') {
            Some(eq) => (&part[..eq], span.start + eq + 1..span.end),
            None => (part, span.end..span.end),
        };
        out.push(Setting {
            key: percent_decode(k),
            value: percent_decode(&s[value_span.clone()]),
            span,
            value_span,
        });
    }
    out
}

/// Where the password of a URL's userinfo stands (`scheme://user:PASSWORD@host`). The
/// userinfo runs to the last `@` before the query, so a password with an unescaped `@`
/// or `/` is still covered whole.
pub fn url_password_range(s: &str) -> Option<Range<usize>> {
    let rest_start = s.find("://")? + 3;
    let end = query_range(s).map(|q| q.start - 1).unwrap_or(s.len());
    let found = s[rest_start..end].rfind('@').and_then(|at| {
        let at = rest_start + at;
        let colon = rest_start + s[rest_start..at].find(':')?;
        Some(colon + 1..at)
    });
    // A `?` or `#` left unencoded in the password looks like the start of a query: the
    // password then runs to the last `@`, and is hidden whole all the same.
    found.or_else(|| unencoded_password_span(s).map(|(range, _)| range))
}

/// The password of a URL that seems to hold characters a URL reserves, unencoded, and
/// those characters: the text from the scheme to the last `@` is `user:password`, and the
/// password holds `@`, `/`, `?`, `#`, `[`, `]`, a blank, or a `%` that is not `%XX`. A
/// port followed by a path (`host:5432/db?...@...`) is not taken for a password.
fn unencoded_password_span(s: &str) -> Option<(Range<usize>, Vec<char>)> {
    let rest_start = s.find("://")? + 3;
    // An `@` in a query that follows a whole `user@host/path` is the query's.
    let mut end = s.len();
    if let Some(q) = s[rest_start..].find('?').map(|q| rest_start + q) {
        let before = &s[rest_start..q];
        if before
            .rfind('@')
            .is_some_and(|at| before[at..].contains('/'))
        {
            end = q;
        }
    }
    let at = rest_start + s[rest_start..end].rfind('@')?;
    let colon = rest_start + s[rest_start..at].find(':')?;
    let password = &s[colon + 1..at];
    let cut = password.find(['/', '?', '#']).unwrap_or(password.len());
    if !password[..cut].is_empty()
        && password[..cut].bytes().all(|b| b.is_ascii_digit())
        && password[cut..].starts_with('/')
    {
        return None;
    }
    let b = password.as_bytes();
    let mut found = Vec::new();
    for (i, c) in password.char_indices() {
        let bad = match c {
            '@' | '/' | '?' | '#' | '[' | ']' | ' ' | '\t' => true,
            '%' => {
                !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                    && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
            }
            _ => false,
        };
        if bad && !found.contains(&c) {
            found.push(c);
        }
    }
    (!found.is_empty()).then_some((colon + 1..at, found))
}

/// What to do when a URL's password seems to hold reserved characters unencoded (see
/// [`unencoded_password_span`]), for the error line of a URL that does not parse or
/// reaches the wrong host: `None` when it does not.
pub fn percent_encoding_hint(s: &str) -> Option<String> {
    if !is_url(s) {
        return None;
    }
    let (_, chars) = unencoded_password_span(s)?;
    let code = |c: char| match c {
        ' ' => "%20".to_string(),
        c => format!("%{:02X}", c as u32),
    };
    let list: Vec<String> = chars
        .iter()
        .map(|&c| match c {
            ' ' => "a space as %20".to_string(),
            '\t' => "a tab as %09".to_string(),
            c => format!("{c} as {}", code(c)),
        })
        .collect();
    Some(format!(
        "the password seems to hold characters a URL reserves: percent-encode them ({}), e.g. p@ss/1 is written p%40ss%2F1",
        list.join(", ")
    ))
}

/// `%XX` sequences decoded (others left as they are); invalid UTF-8 replaced.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether the connection string carries a password (in the userinfo of a URL, a query
/// setting, or a `key=value` setting).
pub fn has_password(s: &str) -> bool {
    if is_url(s) {
        url_password_range(s).is_some_and(|r| !r.is_empty())
            || query_settings(s)
                .iter()
                .any(|p| is_secret_key(&p.key) && !p.value.is_empty())
    } else {
        key_values(s)
            .iter()
            .any(|p| is_secret_key(&p.key) && !p.value.is_empty())
    }
}

/// `s` without the settings whose key `drop` accepts, in the form it was written. A URL
/// loses the query settings (and its `?` when none is left); a `key=value` string the
/// settings, the others kept as written.
pub fn without(s: &str, drop: impl Fn(&str) -> bool) -> String {
    if is_url(s) {
        let Some(q) = query_range(s) else {
            return s.to_string();
        };
        let kept: Vec<&str> = query_settings(s)
            .into_iter()
            .filter(|p| !drop(&p.key))
            .map(|p| &s[p.span])
            .filter(|part| !part.is_empty())
            .collect();
        let head = &s[..q.start - 1];
        let tail = &s[q.end..];
        if kept.is_empty() {
            format!("{head}{tail}")
        } else {
            format!("{head}?{}{tail}", kept.join("&"))
        }
    } else {
        let mut out = String::new();
        let mut last = 0;
        for p in key_values(s) {
            if drop(&p.key) {
                out.push_str(&s[last..p.span.start]);
                last = p.span.end;
            }
        }
        out.push_str(&s[last..]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_settings_follow_libpq() {
        let s = r"host=db  password = 'it\'s a \\secret' sslmode=verify-full dbname=sh\ op";
        let p = key_values(s);
        let kv: Vec<(&str, &str)> = p.iter().map(|p| (&*p.key, &*p.value)).collect();
        assert_eq!(
            kv,
            [
                ("host", "db"),
                ("password", r"it's a \secret"),
                ("sslmode", "verify-full"),
                ("dbname", "sh op")
            ]
        );
        assert_eq!(&s[p[1].value_span.clone()], r"'it\'s a \\secret'");
        assert_eq!(
            without(s, |k| k.starts_with("ssl")),
            r"host=db  password = 'it\'s a \\secret'  dbname=sh\ op"
        );
    }

    #[test]
    fn url_queries_and_userinfo() {
        let s = "postgres://u:p%40ss@h:5432/db?sslmode=verify-ca&application_name=x&sslrootcert=%2Fca.pem";
        let q = query_settings(s);
        assert_eq!(q[2].key, "sslrootcert");
        assert_eq!(q[2].value, "/ca.pem");
        assert_eq!(&s[url_password_range(s).unwrap()], "p%40ss");
        assert_eq!(
            without(s, |k| k.starts_with("ssl")),
            "postgres://u:p%40ss@h:5432/db?application_name=x"
        );
        assert_eq!(
            without("postgres://h/db?sslmode=require", |k| k == "sslmode"),
            "postgres://h/db"
        );
        assert!(has_password("redis://:pw@h/"));
        assert!(!has_password("redis://user@h/"));
        assert!(!has_password("redis://h/"));
        assert!(has_password("host=h password=x"));
        assert!(!has_password("host=h password=''"));
        assert!(has_password("postgres://h/db?password=x"));
    }
}

#[cfg(test)]
mod encoding_tests {
    use super::*;

    #[test]
    fn an_unencoded_password_is_seen_and_hidden() {
        let hint = |s: &str| percent_encoding_hint(s).unwrap_or_default();
        assert!(hint("redis://:p@ss/1@h:6379/0").contains("@ as %40, / as %2F"));
        assert!(hint("postgres://u:a?b@h/db").contains("? as %3F"));
        assert!(hint("postgres://u:100%@h/db").contains("% as %25"));
        for fine in [
            "redis://:p%40ss%2F1@h:6379/0",
            "postgres://u:pw@h:5432/db?application_name=a@b",
            "postgres://h:5432/db?application_name=a@b",
            "redis://h:6379/0",
            "host=h password=x",
        ] {
            assert_eq!(percent_encoding_hint(fine), None, "{fine}");
        }
        // A `?` in the password no longer reads as the start of the query: hidden whole.
        let s = "postgres://u:a?b@h/db";
        assert_eq!(url_password_range(s).map(|r| &s[r]), Some("a?b"));
    }
}
