//! The quick start's code: every fenced block right after a line `<!-- quick-start -->` of a
//! document, with its language (`sh`, `php`). tests/docs.rs holds the Chinese quick start's
//! blocks to the README's; tests/it/docs.rs runs the README's against real servers.

/// One marked block.
pub struct Block {
    /// The fence's language: `sh` or `php`.
    pub lang: String,
    /// The lines between the fences.
    pub lines: Vec<String>,
    /// The line number (1-based) of the opening fence.
    pub line: usize,
}

/// The marked blocks of `text`, in order. A mark not followed by a fenced block panics.
pub fn blocks(text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "<!-- quick-start -->" {
            let fence = lines.get(i + 1).copied().unwrap_or("");
            assert!(
                fence.starts_with("```"),
                "line {}: a quick-start mark must be followed by a fenced block",
                i + 1
            );
            let lang = fence.trim_start_matches('`').trim().to_string();
            let mut body = Vec::new();
            let mut j = i + 2;
            while j < lines.len() && !lines[j].starts_with("```") {
                body.push(lines[j].to_string());
                j += 1;
            }
            out.push(Block {
                lang,
                lines: body,
                line: i + 2,
            });
            i = j;
        }
        i += 1;
    }
    out
}

/// A line without its comment (`#` for sh, `//` for php, outside quotes and after
/// whitespace or at the start), trimmed at the end.
pub fn without_comment(line: &str, lang: &str) -> String {
    let b = line.as_bytes();
    let mut quote: Option<u8> = None;
    for i in 0..b.len() {
        let c = b[i];
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == b'\'' || c == b'"' => quote = Some(c),
            None => {
                let starts = i == 0 || b[i - 1].is_ascii_whitespace();
                let comment = match lang {
                    "php" => c == b'/' && b.get(i + 1) == Some(&b'/') && starts,
                    _ => c == b'#' && starts,
                };
                if comment {
                    return line[..i].trim_end().to_string();
                }
            }
        }
    }
    line.trim_end().to_string()
}

/// The block's code lines: comments removed, blank lines left out.
pub fn code(block: &Block) -> Vec<String> {
    block
        .lines
        .iter()
        .map(|l| without_comment(l, &block.lang))
        .filter(|l| !l.trim().is_empty())
        .collect()
}
