//! A dead letter's message laid out for reading: JSON reindented, two spaces a level,
//! its keys in the order the producer wrote them (`worker dead show` parses and prints,
//! which sorts them). The layout walks the text once without recursion, so however deep
//! a hostile message nests, it costs no stack; it only runs on text `serde_json` accepts.

/// Nesting beyond this is shown as written (and not handed to `serde_json`, whose
/// recursion would otherwise run on the small stack of a connection thread).
const MAX_DEPTH: usize = 64;

/// `msg` reindented, or `None` when it is not JSON (or nests deeper than [`MAX_DEPTH`]).
pub fn json(msg: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(msg).ok()?;
    if depth(text) > MAX_DEPTH {
        return None;
    }
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    Some(reindent(text))
}

/// The deepest nesting of brackets outside strings.
fn depth(text: &str) -> usize {
    let (mut d, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for c in text.chars() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' | '[' => {
                d += 1;
                max = max.max(d);
            }
            '}' | ']' => d = d.saturating_sub(1),
            _ => {}
        }
    }
    max
}

fn newline(out: &mut String, depth: usize) {
    out.push('\n');
    for _ in 0..depth {
        out.push_str("  ");
    }
}

/// Valid JSON text, laid out again: one member per line, empty containers kept short.
fn reindent(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3 / 2);
    let (mut d, mut in_str, mut esc) = (0usize, false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if in_str {
            out.push(c);
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                match chars.peek() {
                    Some(&close @ ('}' | ']')) => {
                        out.push(close);
                        chars.next();
                    }
                    _ => {
                        d += 1;
                        newline(&mut out, d);
                    }
                }
            }
            '}' | ']' => {
                d = d.saturating_sub(1);
                newline(&mut out, d);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, d);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_laid_out_in_its_own_order() {
        let msg =
            br#"{"z":1,"event":"e","payload":{"a":[1, 2],"s":"x, {y}: \"q\"","e":{},"l":[]}}"#;
        assert_eq!(
            json(msg).unwrap(),
            "{\n  \"z\": 1,\n  \"event\": \"e\",\n  \"payload\": {\n    \"a\": [\n      1,\n      2\n    ],\n    \"s\": \"x, {y}: \\\"q\\\"\",\n    \"e\": {},\n    \"l\": []\n  }\n}"
        );
        assert_eq!(json(b"7").as_deref(), Some("7"));
        assert_eq!(json(b"{\"a\":"), None, "not JSON");
        assert_eq!(json(b"\xff"), None, "not UTF-8");
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(json(deep.as_bytes()), None, "too deep: as written");
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(json(ok.as_bytes()).is_some());
    }

    #[test]
    fn the_deepest_message_shown_fits_the_page_thread_s_stack() {
        let deep = format!(
            "{}1{}",
            "{\"a\":[".repeat(MAX_DEPTH / 2),
            "]}".repeat(MAX_DEPTH / 2)
        );
        let shown = std::thread::Builder::new()
            .stack_size(super::super::PAGE_STACK)
            .spawn(move || {
                (
                    json(deep.as_bytes()).is_some(),
                    crate::message::event_of(deep.as_bytes()),
                )
            })
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(shown, (true, String::new()));
    }
}
