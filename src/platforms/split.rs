//! Splitting a reply into pieces a platform accepts: IRC counts bytes on the wire, Telegram
//! counts UTF-16 code units (4,096 per message).
//!
//! A cut prefers the last newline, then the last space, in the second half of the allowed
//! piece (so pieces are not needlessly short), then either anywhere in it, and falls back to a
//! hard cut. A cut is always between two `char`s: never inside a UTF-8 sequence, and so never
//! between the two halves of a UTF-16 surrogate pair.

/// The size limit of one piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Limit {
    /// At most this many bytes of UTF-8 (IRC). Below 4 it is taken as 4, so one `char`
    /// always fits.
    Bytes(usize),
    /// At most this many UTF-16 code units (Telegram). Below 2 it is taken as 2, so one
    /// `char` always fits.
    Utf16Units(usize),
}

/// Telegram's limit on a message's text.
pub(crate) const TELEGRAM_LIMIT: Limit = Limit::Utf16Units(4096);

impl Limit {
    fn size(self, c: char) -> usize {
        match self {
            Limit::Bytes(_) => c.len_utf8(),
            Limit::Utf16Units(_) => c.len_utf16(),
        }
    }

    fn max(self) -> usize {
        match self {
            Limit::Bytes(n) => n.max(4),
            Limit::Utf16Units(n) => n.max(2),
        }
    }

    /// The size of `text` in this limit's unit.
    #[cfg(test)]
    pub(crate) fn measure(self, text: &str) -> usize {
        match self {
            Limit::Bytes(_) => text.len(),
            Limit::Utf16Units(_) => text.encode_utf16().count(),
        }
    }
}

/// Splits `text` into pieces each within `limit`; concatenated, they are exactly `text` (a
/// newline or space cut at stays at the end of the piece before it). Empty text gives no
/// piece.
pub(crate) fn split(text: &str, limit: Limit) -> Vec<&str> {
    let max = limit.max();
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        // The longest prefix within the limit, ended at a char boundary.
        let mut used = 0;
        let mut end = rest.len();
        for (i, c) in rest.char_indices() {
            let size = limit.size(c);
            if used + size > max {
                end = i;
                break;
            }
            used += size;
        }
        if end == rest.len() {
            pieces.push(rest);
            break;
        }
        let window = &rest[..end];
        // The middle, moved back to a char boundary (slicing there must not panic).
        let mut half = window.len() / 2;
        while !window.is_char_boundary(half) {
            half -= 1;
        }
        let after =
            |sep: char, from: usize| window[from..].rfind(sep).map(|i| from + i + sep.len_utf8());
        let cut = after('\n', half)
            .or_else(|| after(' ', half))
            .or_else(|| after('\n', 0))
            .or_else(|| after(' ', 0))
            .unwrap_or(end);
        // Never inside a grapheme cluster (a ZWJ emoji, a flag, a letter and its accent),
        // unless one cluster alone is longer than the piece.
        let cut = super::grapheme::boundary_at_or_before(rest, cut);
        pieces.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    pieces
}

/// IRC lines for `text`, each at most `max_bytes` bytes: IRC carries no newline, so every
/// line of the text is split on its own; the space a line was cut at is dropped (IRC clients
/// show a line's trailing space as nothing anyway), blank lines are skipped, and control
/// characters IRC would misread (`\r`, NUL, CTCP's `\x01`) are removed.
pub(crate) fn irc_lines(text: &str, max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.split('\n') {
        // `\x01` too: an agent's text must never go out as CTCP (`\x01DCC SEND …\x01`).
        let clean: String = line
            .chars()
            .filter(|c| !matches!(c, '\r' | '\0' | '\x01'))
            .collect();
        if clean.trim().is_empty() {
            continue;
        }
        for piece in split(&clean, Limit::Bytes(max_bytes)) {
            let piece = piece.strip_suffix(' ').unwrap_or(piece);
            if !piece.trim().is_empty() {
                out.push(piece.to_owned());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cuts_prefer_newlines_then_spaces_then_chars() {
        assert_eq!(
            split("aaaa bbbb\ncccc dddd", Limit::Bytes(12)),
            ["aaaa bbbb\n", "cccc dddd"]
        );
        assert_eq!(
            split("aaaa bbbb cccc", Limit::Bytes(12)),
            ["aaaa bbbb ", "cccc"]
        );
        assert_eq!(split("abcdefghij", Limit::Bytes(4)), ["abcd", "efgh", "ij"]);
        assert!(split("", Limit::Bytes(10)).is_empty());
        assert_eq!(split("short", Limit::Bytes(10)), ["short"]);
    }

    #[test]
    fn never_cuts_inside_a_utf8_sequence() {
        // "é" is 2 bytes, "日" 3, "🎉" 4: a 5-byte limit cannot take "éé" + "日".
        let text = "éé日🎉日";
        let pieces = split(text, Limit::Bytes(5));
        assert_eq!(pieces, ["éé", "日", "🎉", "日"]);
        assert!(pieces.iter().all(|p| p.len() <= 5));
    }

    #[test]
    fn counts_utf16_units_and_never_splits_a_surrogate_pair() {
        // Each emoji is 2 UTF-16 units (a surrogate pair) but 4 bytes.
        let text = "🎉🎉🎉";
        assert_eq!(split(text, Limit::Utf16Units(5)), ["🎉🎉", "🎉"]);
        assert_eq!(split(text, Limit::Utf16Units(3)), ["🎉", "🎉", "🎉"]);
        // 4,096 units of "é" (1 unit, 2 bytes) fit one Telegram message.
        let long = "é".repeat(4096);
        assert_eq!(split(&long, TELEGRAM_LIMIT), [long.as_str()]);
        let longer = "é".repeat(4097);
        assert_eq!(split(&longer, TELEGRAM_LIMIT).len(), 2);
    }

    #[test]
    fn pieces_end_at_grapheme_boundaries() {
        // 27 bytes, 10 chars: a cut by bytes or chars alone lands inside it.
        let kiss = "👩\u{200D}❤\u{FE0F}\u{200D}💋\u{200D}👨";
        let text = kiss.repeat(20);
        for max in [30, 50, 64, 100, 200] {
            for p in split(&text, Limit::Bytes(max)) {
                assert_eq!(p.len() % kiss.len(), 0, "{max}: {p:?}");
                assert!(p.len() <= max);
            }
            for p in split(&text, Limit::Utf16Units(max)) {
                assert_eq!(p.len() % kiss.len(), 0, "{max}: {p:?}");
            }
        }
        // A cluster longer than the piece is still cut (progress before beauty).
        assert_eq!(split(kiss, Limit::Bytes(8)).concat(), kiss);
        assert_eq!(irc_lines("a\x01DCC SEND x\x01", 100), ["aDCC SEND x"]);
    }

    #[test]
    fn irc_lines_drop_newlines_and_the_cut_space() {
        assert_eq!(
            irc_lines("hello world\n\nsecond\r line", 8),
            ["hello", "world", "second", "line"]
        );
        assert!(irc_lines("\n \n", 10).is_empty());
    }

    proptest! {
        #[test]
        fn pieces_fit_and_reassemble(text in "(\\PC|\n| |🎉|é){0,300}", max in 1usize..40) {
            for limit in [Limit::Bytes(max), Limit::Utf16Units(max)] {
                let pieces = split(&text, limit);
                prop_assert_eq!(pieces.concat(), text.clone());
                for p in &pieces {
                    prop_assert!(!p.is_empty());
                    prop_assert!(limit.measure(p) <= limit.max());
                }
            }
        }

        #[test]
        fn irc_lines_fit_and_keep_every_word(words in prop::collection::vec("[a-zé日🎉]{1,8}", 0..60), max in 32usize..60) {
            let text = words.join(" ");
            let lines = irc_lines(&text, max);
            for l in &lines {
                prop_assert!(l.len() <= max);
            }
            // Words no longer than the limit are never cut, so joining with spaces restores it.
            prop_assert_eq!(lines.join(" "), text);
        }
    }
}
