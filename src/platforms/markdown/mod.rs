//! One Markdown renderer for the bridges: an agent's reply (a CommonMark subset: emphasis,
//! strong, strikethrough, code spans, fenced code blocks with their language, lists nested
//! and ordered, links, block quotes, headings) as each platform formats it, cut into pieces
//! at the platform's limit.
//!
//! - **Matrix**: `formatted_body` in `org.matrix.custom.html`, only tags of the spec's
//!   recommended safe set (`p h1–h6 strong em del code pre blockquote ul ol li a br hr`,
//!   attributes `href`, `start`, `class="language-…"`), and the plain `body` beside it.
//! - **Telegram**: `parse_mode: HTML` with Telegram's own tags (`b i s code pre a
//!   blockquote`), nested only as the Bot API allows (nothing inside `code`/`pre`; no
//!   `code`, `pre` or `a` inside a quote or a link; quotes not nested), and at most
//!   [`TELEGRAM_MAX_TAGS`] tags per message.
//! - **IRC**: plain text, the markup removed, a link as `text <url>`.
//!
//! Raw HTML in a reply is text: escaped, never passed through. A link keeps its URL only
//! for `http`, `https` and (Matrix) `mailto`; any other scheme (`javascript:`, `data:`) shows
//! its text alone. Nesting deeper than [`MAX_DEPTH`] tags keeps its text without more tags.
//!
//! Parsing is `pulldown-cmark`'s; [`write`] turns its events into a flat list of atoms
//! (tags and text) for one platform, and [`cut`] fills pieces with them: a piece never ends
//! inside a tag or an entity, and the tags open at a cut are closed at the end of the
//! piece and opened again (a code block with its language) at the start of the next. A
//! partial renders the same way: CommonMark ends an unterminated fence at the end of the
//! text, so a streamed code block shows as an open code block, not as backticks.

mod cut;
#[cfg(test)]
mod tests;
mod write;

pub use cut::{Measure, Piece};

/// Tags opened inside one another at most; deeper ones keep their text, not their tag.
pub(crate) const MAX_DEPTH: usize = 16;
/// Tags (entities) in one Telegram message at most: a conservative bound, far below what a
/// 4,096-unit message shows anyway.
pub(crate) const TELEGRAM_MAX_TAGS: usize = 100;
/// A link's URL longer than this shows as text (a piece reopens an open link's tag).
pub(crate) const MAX_URL_BYTES: usize = 2048;

/// Whether a bridge renders the agent's Markdown (`--format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    /// Markdown rendered as the platform formats it.
    #[default]
    Markdown,
    /// The text as the agent wrote it, asterisks and all.
    Plain,
}

/// The platform a reply is rendered for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `org.matrix.custom.html` and a plain body.
    Matrix,
    /// The Bot API's HTML.
    Telegram,
    /// Plain text.
    Irc,
}

/// `text` rendered for `target` and cut into pieces each within `limit` as `measure`
/// counts it (`max_tags` tags at most per piece). Empty text gives no piece.
pub fn pieces(
    text: &str,
    target: Target,
    measure: Measure,
    limit: usize,
    max_tags: usize,
) -> Vec<Piece> {
    let atoms = write::atoms(text, target);
    cut::cut(&atoms, measure, limit, max_tags)
}

/// `text` as plain text (IRC): the markup removed, links as `text <url>`.
pub fn plain(text: &str) -> String {
    let atoms = write::atoms(text, Target::Irc);
    cut::cut(
        &atoms,
        Measure::HtmlPlusPlainBytes,
        usize::MAX / 4,
        usize::MAX,
    )
    .into_iter()
    .map(|p| p.plain)
    .collect()
}

/// Telegram's pieces of `text`: its HTML, each within the 4,096 UTF-16 units of a message.
pub fn telegram(text: &str) -> Vec<String> {
    pieces(
        text,
        Target::Telegram,
        Measure::HtmlUtf16,
        4096,
        TELEGRAM_MAX_TAGS,
    )
    .into_iter()
    // Telegram refuses a message that shows nothing.
    .filter(|p| !p.plain.trim().is_empty())
    .map(|p| p.html)
    .collect()
}

/// `text` escaped for HTML: `&`, `<`, `>`, `"` as entities.
pub(crate) fn escape_into(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
}
