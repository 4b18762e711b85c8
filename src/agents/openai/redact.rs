//! Keeping secrets out of chats and logs: the endpoint as shown (userinfo and query
//! redacted), the request URL (the path inserted before the query), and a filter for any
//! text that came from the server.
//!
//! The filter replaces with `[redacted]`, ASCII-case-insensitively: the API key, the base
//! URL's userinfo password and query values (each at least 4 characters), and key-like
//! strings: `sk-` followed by 8 or more of `[A-Za-z0-9_-]`, the token after `Bearer ` or
//! `Basic `, and any run of 32 or more characters of `[A-Za-z0-9+/=_-]` (base64, hex,
//! JWT parts). Ordinary words and model names are shorter or contain other characters.

/// What replaces a secret.
pub(super) const REDACTED: &str = "[redacted]";

/// The endpoint of a base URL: `url` is what requests go to (`{base path}/chat/completions`
/// then the base's query), `shown` the same with userinfo and query replaced, `secrets`
/// the userinfo and the query values.
pub(super) struct Endpoint {
    pub(super) url: String,
    pub(super) shown: String,
    pub(super) secrets: Vec<String>,
}

/// Splits `base` (already checked to start with `http://` or `https://`).
pub(super) fn endpoint(base: &str) -> Endpoint {
    let base = base.split('#').next().unwrap_or(base);
    let (before_query, query) = match base.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (base, None),
    };
    let before_query = before_query.trim_end_matches('/');
    let (scheme, rest) = before_query
        .split_once("://")
        .unwrap_or(("http", before_query));
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let mut secrets = Vec::new();
    let host = match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            secrets.push(userinfo.to_owned());
            if let Some((user, pass)) = userinfo.split_once(':') {
                secrets.push(user.to_owned());
                secrets.push(pass.to_owned());
            }
            host
        }
        None => authority,
    };
    let userinfo_shown = if host.len() == authority.len() {
        String::new()
    } else {
        format!("{REDACTED}@")
    };
    let url = match query {
        Some(q) => format!("{scheme}://{authority}{path}/chat/completions?{q}"),
        None => format!("{scheme}://{authority}{path}/chat/completions"),
    };
    let shown = match query {
        Some(q) => {
            for pair in q.split('&') {
                let value = pair.split_once('=').map_or(pair, |(_, v)| v);
                secrets.push(value.to_owned());
            }
            format!("{scheme}://{userinfo_shown}{host}{path}/chat/completions?{REDACTED}")
        }
        None => format!("{scheme}://{userinfo_shown}{host}{path}/chat/completions"),
    };
    secrets.retain(|s| s.len() >= 4);
    Endpoint {
        url,
        shown,
        secrets,
    }
}

/// `text` with every secret (case-insensitively) and every key-like string replaced.
pub(super) fn scrub(text: &str, secrets: &[&str]) -> String {
    let mut out = text.to_owned();
    for s in secrets.iter().filter(|s| !s.is_empty()) {
        out = replace_ignore_case(&out, s);
    }
    key_like(&out)
}

fn replace_ignore_case(text: &str, needle: &str) -> String {
    let hay = text.to_ascii_lowercase();
    let needle = needle.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut from = 0;
    while let Some(i) = hay[from..].find(&needle) {
        let at = from + i;
        out.push_str(&text[from..at]);
        out.push_str(REDACTED);
        from = at + needle.len();
    }
    out.push_str(&text[from..]);
    out
}

fn token_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'=' | b'_' | b'-' | b'.' | b'~')
}

fn run_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'=' | b'_' | b'-')
}

/// Replaces `sk-…`, `Bearer …`/`Basic …` tokens and long base64/hex runs.
fn key_like(text: &str) -> String {
    let b = text.as_bytes();
    let lower = text.to_ascii_lowercase();
    let lb = lower.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let mut copied = 0;
    while i < b.len() {
        let boundary = i == 0 || !run_char(b[i - 1]);
        // `Bearer X` / `Basic X`: the token after the scheme.
        let scheme = ["bearer ", "basic "]
            .into_iter()
            .find(|p| boundary && lb[i..].starts_with(p.as_bytes()));
        if let Some(p) = scheme {
            let start = i + p.len();
            let end = start + b[start..].iter().take_while(|&&c| token_char(c)).count();
            if end > start {
                out.push_str(&text[copied..start]);
                out.push_str(REDACTED);
                copied = end;
                i = end;
                continue;
            }
        }
        if boundary && run_char(b[i]) {
            let end = i + b[i..].iter().take_while(|&&c| run_char(c)).count();
            let word = &lb[i..end];
            if word.len() >= 32 || (word.starts_with(b"sk-") && word.len() >= 11) {
                out.push_str(&text[copied..i]);
                out.push_str(REDACTED);
                copied = end;
            }
            i = end;
            continue;
        }
        i += 1;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_puts_the_path_before_the_query_and_shows_neither_secret() {
        let e = endpoint("http://admin:PASS1@host:8/v1?api-version=2024-01&api-key=SECRET");
        assert_eq!(
            e.url,
            "http://admin:PASS1@host:8/v1/chat/completions?api-version=2024-01&api-key=SECRET"
        );
        assert_eq!(
            e.shown,
            "http://[redacted]@host:8/v1/chat/completions?[redacted]"
        );
        assert!(e.secrets.iter().any(|s| s == "SECRET"));
        assert!(e.secrets.iter().any(|s| s == "PASS1"));
        let plain = endpoint("https://h/v1/");
        assert_eq!(plain.url, "https://h/v1/chat/completions");
        assert_eq!(plain.shown, plain.url);
        assert!(plain.secrets.is_empty());
        assert_eq!(endpoint("http://h:1").url, "http://h:1/chat/completions");
    }

    #[test]
    fn secrets_and_key_like_strings_are_filtered_whatever_their_case() {
        let s = scrub(
            "bad key SK-TEST-KEY-123 for MyKey-Abc",
            &["sk-test-key-123", "mykey-abc"],
        );
        assert_eq!(s, "bad key [redacted] for [redacted]");
        assert_eq!(
            scrub("got Authorization: Bearer abc.def-1 ok", &[]),
            "got Authorization: Bearer [redacted] ok"
        );
        assert_eq!(scrub("key sk-abcdefgh1 x", &[]), "key [redacted] x");
        let hex = "0123456789abcdef0123456789abcdef";
        assert_eq!(scrub(&format!("id: {hex}."), &[]), "id: [redacted].");
        let ordinary = "model llama-3.1-8b not found (HTTP 404), try again";
        assert_eq!(scrub(ordinary, &[]), ordinary);
        assert_eq!(scrub("ünïcode ok", &["x"]), "ünïcode ok");
    }
}
