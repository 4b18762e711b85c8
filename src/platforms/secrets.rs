//! The one redaction of the bridges' secrets (tokens, passwords): every form of a secret a
//! server may echo back — raw, percent-encoded, either half, in any ASCII case — replaced with
//! `<redacted>`. Every log line of the bridges (the `*_limited!`/`*_redacted!` macros) and
//! every error a bridge returns pass through [`redact`].

use std::borrow::Cow;
use std::sync::RwLock;

/// What a secret's forms are replaced with.
const MARK: &str = "<redacted>";
/// A half shorter than this is not a secret of its own (it would redact common words).
const MIN_PART: usize = 6;

/// The lower-cased forms of every registered secret, longest first.
static FORMS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Registers `secret` (ignored when empty): from now on each of its forms is redacted.
pub(crate) fn register(secret: &str) {
    if secret.is_empty() {
        return;
    }
    let mut forms = FORMS.write().unwrap_or_else(|e| e.into_inner());
    for form in forms_of(secret) {
        if !forms.contains(&form) {
            forms.push(form);
        }
    }
    forms.sort_by_key(|f| std::cmp::Reverse(f.len()));
}

/// A secret (a password, a token) as configured: registered for redaction when made, shown
/// as `<redacted>` by `Debug`, its text only through [`Secret::expose`].
#[derive(Clone)]
pub(crate) struct Secret(String);

impl Secret {
    /// Keeps `text` and registers it for redaction.
    pub(crate) fn new(text: String) -> Secret {
        register(&text);
        Secret(text)
    }

    /// The secret's text, for the one place it is sent.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(MARK)
    }
}

/// `secret`'s forms, lower-cased: itself, its two halves (at a `:` when it has one, like a
/// Telegram token, else at the middle), and each of those percent-encoded.
fn forms_of(secret: &str) -> Vec<String> {
    let mut parts = vec![secret.to_owned()];
    let halves = match secret.split_once(':') {
        Some((a, b)) => (a, b),
        None => {
            let mut mid = secret.len() / 2;
            while !secret.is_char_boundary(mid) {
                mid += 1;
            }
            secret.split_at(mid)
        }
    };
    for half in [halves.0, halves.1] {
        if half.len() >= MIN_PART {
            parts.push(half.to_owned());
        }
    }
    let mut forms = Vec::new();
    for p in parts {
        let encoded = percent_encoded(&p);
        forms.push(p.to_ascii_lowercase());
        if encoded != p {
            forms.push(encoded.to_ascii_lowercase());
        }
    }
    forms
}

/// `s` percent-encoded as a URL would carry it (everything but RFC 3986's unreserved
/// characters).
fn percent_encoded(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `text` with every form of every registered secret replaced (ASCII case ignored).
pub(crate) fn redact(text: &str) -> Cow<'_, str> {
    let forms = FORMS.read().unwrap_or_else(|e| e.into_inner());
    redact_with(text, &forms)
}

fn redact_with<'t>(text: &'t str, forms: &[String]) -> Cow<'t, str> {
    if forms.is_empty() {
        return Cow::Borrowed(text);
    }
    let lower = text.to_ascii_lowercase();
    // Byte ranges to replace, merged; the forms are longest first, so a whole token wins
    // over its halves.
    let mut hits: Vec<(usize, usize)> = Vec::new();
    for form in forms {
        let mut from = 0;
        while let Some(at) = lower[from..].find(form.as_str()) {
            let start = from + at;
            hits.push((start, start + form.len()));
            from = start + form.len();
        }
    }
    if hits.is_empty() {
        return Cow::Borrowed(text);
    }
    hits.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (start, end) in hits {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut done = 0;
    for (start, end) in merged {
        out.push_str(&text[done..start]);
        out.push_str(MARK);
        done = end;
    }
    out.push_str(&text[done..]);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forms(secrets: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = secrets.iter().flat_map(|s| forms_of(s)).collect();
        all.sort_by_key(|f| std::cmp::Reverse(f.len()));
        all
    }

    #[test]
    fn every_form_of_a_token_is_redacted() {
        let f = forms(&["123456789:AAE-Secret_Half"]);
        for leak in [
            "url /bot123456789:AAE-Secret_Half/getMe",
            "url /bot123456789%3AAAE-Secret_Half/getMe",
            "url /bot123456789%3aaae-secret_half/getMe",
            "the secret half AAE-Secret_Half alone",
            "the id half 123456789 alone",
            "UPPER 123456789:AAE-SECRET_HALF",
        ] {
            let out = redact_with(leak, &f);
            assert!(!out.to_ascii_lowercase().contains("secret_half"), "{out}");
            assert!(!out.contains("123456789"), "{out}");
            assert!(out.contains(MARK), "{out}");
        }
        let f = forms(&["syt_Ym90_QWxhZGRpbjpvcGVu_3fRs1"]);
        let out = redact_with("HTTP 500: Bearer syt_Ym90_QWxhZGRpbjpvcGVu_3fRs1 bad", &f);
        assert_eq!(out, "HTTP 500: Bearer <redacted> bad");
        let out = redact_with("half: QWxhZGRpbjpvcGVu_3fRs1", &f);
        assert!(!out.contains("3fRs1"), "{out}");
        assert_eq!(redact_with("nothing here", &f), "nothing here");
        assert_eq!(redact_with("é and ü stay", &f), "é and ü stay");
    }
}
