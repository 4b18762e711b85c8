//! Telegram's HTML parse mode as the Bot API documents it, for tests: the Telegram fake
//! (tests/platforms_telegram.rs) parses what the bridge sends with it, and the renderer's
//! property tests (src/platforms/markdown/tests.rs) check every piece it makes against it.

/// Telegram's HTML parse mode as the Bot API documents it: only its tags (`b strong i em u
/// ins s strike del code pre a blockquote tg-spoiler`), closed in order; `&lt; &gt; &amp;
/// &quot;` and numeric entities, any other `&…;` or a raw `<` refused; nothing inside
/// `code` or `pre` (but `pre`'s one `code`); `a`, `code`, `pre`, `blockquote` never inside
/// one another (quotes not nested). The text shown, or why not.
pub(crate) fn parse_entities(html: &str) -> Result<String, String> {
    const TAGS: &[&str] = &[
        "b",
        "strong",
        "i",
        "em",
        "u",
        "ins",
        "s",
        "strike",
        "del",
        "code",
        "pre",
        "a",
        "blockquote",
        "tg-spoiler",
    ];
    const EXCLUSIVE: &[&str] = &["a", "code", "pre", "blockquote"];
    let mut shown = String::new();
    let mut stack: Vec<&str> = Vec::new();
    let mut rest = html;
    while let Some(c) = rest.chars().next() {
        let at = html.len() - rest.len();
        if c == '&' {
            // In bytes: the 12th may fall inside a character.
            let end = rest
                .bytes()
                .take(12)
                .position(|b| b == b';')
                .ok_or(format!("Unsupported HTML entity at byte offset {at}"))?;
            let decoded = match &rest[1..end] {
                "lt" => '<',
                "gt" => '>',
                "amp" => '&',
                "quot" => '"',
                e => e
                    .strip_prefix('#')
                    .and_then(|n| n.parse::<u32>().ok())
                    .and_then(char::from_u32)
                    .ok_or(format!("Unsupported HTML entity at byte offset {at}"))?,
            };
            shown.push(decoded);
            rest = &rest[end + 1..];
            continue;
        }
        if c != '<' {
            shown.push(c);
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let end = rest
            .find('>')
            .ok_or(format!("Unclosed start tag at byte offset {at}"))?;
        let inner = &rest[1..end];
        rest = &rest[end + 1..];
        if let Some(name) = inner.strip_prefix('/') {
            match stack.pop() {
                Some(open) if open == name.trim() => continue,
                open => {
                    return Err(format!(
                        "Unmatched end tag at byte offset {at}, expected \"</{}>\", found \"</{name}>\"",
                        open.unwrap_or("")
                    ));
                }
            }
        }
        let name = inner.split_whitespace().next().unwrap_or("");
        let attrs = inner[name.len()..].trim();
        let name = TAGS.iter().find(|t| **t == name).ok_or(format!(
            "Unsupported start tag \"{name}\" at byte offset {at}"
        ))?;
        let attrs_ok = match *name {
            "a" => {
                attrs.starts_with("href=\"")
                    && attrs.ends_with('"')
                    && attrs.matches('"').count() == 2
            }
            "code" => {
                attrs.is_empty()
                    || (attrs.starts_with("class=\"language-") && stack.last() == Some(&"pre"))
            }
            _ => attrs.is_empty(),
        };
        if !attrs_ok {
            return Err(format!(
                "bad attributes {attrs:?} of \"{name}\" at byte offset {at}"
            ));
        }
        let in_code = stack.iter().any(|t| *t == "code" || *t == "pre");
        let code_in_pre = *name == "code" && stack.last() == Some(&"pre");
        let clash = EXCLUSIVE.contains(name) && stack.iter().any(|t| EXCLUSIVE.contains(t));
        if (in_code || clash) && !code_in_pre {
            return Err(format!("\"{name}\" can't be nested at byte offset {at}"));
        }
        stack.push(name);
    }
    match stack.last() {
        Some(open) => Err(format!(
            "Can't find end tag corresponding to start tag \"{open}\""
        )),
        None => Ok(shown),
    }
}
