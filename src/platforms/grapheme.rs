//! Grapheme-cluster boundaries, by hand: the rules of Unicode's extended grapheme clusters
//! (UAX #29) that a cut of a chat reply can meet — CR LF, combining marks and the other
//! extending characters (variation selectors, emoji modifiers, tags, ZWJ), emoji ZWJ
//! sequences, regional-indicator pairs (flags). A cut the splitter makes is moved back to
//! such a boundary, so a ZWJ family emoji, a flag or a letter with its accent is never
//! split across two messages. (Hangul syllable and prepend rules are not needed: a Hangul
//! syllable is one precomposed `char`, and prepends are rare enough that a cut before
//! their base letter is harmless.)

/// Whether `c` extends the cluster before it (never starts one): combining marks of the
/// common scripts, variation selectors, ZWJ/ZWNJ, emoji skin-tone modifiers, tag characters.
fn is_extend(c: char) -> bool {
    matches!(u32::from(c),
        0x0300..=0x036F // combining diacritical marks
        | 0x0483..=0x0489 // Cyrillic
        | 0x0591..=0x05BD | 0x05BF | 0x05C1..=0x05C2 | 0x05C4..=0x05C5 | 0x05C7 // Hebrew
        | 0x0610..=0x061A | 0x064B..=0x065F | 0x0670 | 0x06D6..=0x06DC | 0x06DF..=0x06E4
        | 0x06E7..=0x06E8 | 0x06EA..=0x06ED // Arabic
        | 0x0900..=0x0903 | 0x093A..=0x094F | 0x0951..=0x0957 | 0x0962..=0x0963 // Devanagari
        | 0x0E31 | 0x0E34..=0x0E3A | 0x0E47..=0x0E4E // Thai
        | 0x1AB0..=0x1AFF | 0x1DC0..=0x1DFF // combining marks extended, supplement
        | 0x200C..=0x200D // ZWNJ, ZWJ
        | 0x20D0..=0x20FF // combining marks for symbols (keycap U+20E3)
        | 0x302A..=0x302F | 0x3099..=0x309A // CJK, kana voicing
        | 0xFE00..=0xFE0F // variation selectors
        | 0xFE20..=0xFE2F // combining half marks
        | 0x1F3FB..=0x1F3FF // emoji skin-tone modifiers
        | 0xE0020..=0xE007F // tags (subdivision flags)
        | 0xE0100..=0xE01EF // variation selectors supplement
    )
}

/// Whether `c` is an emoji a ZWJ joins to the one before it (Extended_Pictographic, by its
/// blocks).
fn is_pictographic(c: char) -> bool {
    matches!(u32::from(c),
        0x00A9 | 0x00AE | 0x203C | 0x2049 | 0x2122 | 0x2139 | 0x2194..=0x21AA
        | 0x231A..=0x23FF | 0x24C2 | 0x25AA..=0x25FE | 0x2600..=0x27BF | 0x2934..=0x2935
        | 0x2B05..=0x2B55 | 0x3030 | 0x303D | 0x3297 | 0x3299
        | 0x1F000..=0x1F1E5 | 0x1F200..=0x1F3FA | 0x1F400..=0x1FAFF | 0x1FC00..=0x1FFFD
    )
}

fn is_regional_indicator(c: char) -> bool {
    matches!(u32::from(c), 0x1F1E6..=0x1F1FF)
}

/// Whether byte offset `i` of `text` (a `char` boundary) is also a grapheme-cluster boundary.
pub(crate) fn is_boundary(text: &str, i: usize) -> bool {
    let (Some(before), Some(after)) = (text[..i].chars().next_back(), text[i..].chars().next())
    else {
        return true;
    };
    if before == '\r' && after == '\n' {
        return false;
    }
    if is_extend(after) {
        return false;
    }
    if before == '\u{200D}' && is_pictographic(after) {
        return false;
    }
    if is_regional_indicator(before) && is_regional_indicator(after) {
        // Flags pair up from the start of a run of indicators: no break inside a pair.
        let run = text[..i]
            .chars()
            .rev()
            .take_while(|&c| is_regional_indicator(c))
            .count();
        return run % 2 == 0;
    }
    true
}

/// The last grapheme boundary of `text` at or before byte offset `i` (a `char` boundary)
/// that is past 0; `i` itself when there is none (one cluster longer than the room: cut
/// inside it rather than make no progress).
pub(crate) fn boundary_at_or_before(text: &str, i: usize) -> usize {
    let mut at = i;
    while at > 0 && !is_boundary(text, at) {
        at = text[..at].char_indices().next_back().map_or(0, |(j, _)| j);
    }
    if at == 0 { i } else { at }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte offsets of every boundary inside `text`.
    fn cuts(text: &str) -> Vec<usize> {
        (1..text.len())
            .filter(|&i| text.is_char_boundary(i) && is_boundary(text, i))
            .collect()
    }

    #[test]
    fn clusters_hold_together() {
        let family = "👨\u{200D}👩\u{200D}👧\u{200D}👦";
        assert!(cuts(family).is_empty(), "a ZWJ family is one cluster");
        assert_eq!(cuts(&family.repeat(2)), [family.len()]);
        let heart = "❤\u{FE0F}";
        assert!(cuts(heart).is_empty(), "a variation selector stays");
        let accented = "e\u{301}";
        assert!(cuts(accented).is_empty(), "a combining mark stays");
        let thumbs = "👍\u{1F3FD}";
        assert!(cuts(thumbs).is_empty(), "a skin tone stays");
        // Three flags: cuts only between the pairs.
        let flags = "🇫🇷🇩🇪🇯🇵";
        assert_eq!(cuts(flags), [8, 16]);
        assert!(cuts("\r\n").is_empty());
        assert_eq!(cuts("ab"), [1]);
    }

    #[test]
    fn a_cut_moves_back_to_a_boundary_but_always_progresses() {
        let family = "👨\u{200D}👩\u{200D}👧\u{200D}👦";
        let two = family.repeat(2);
        // Inside the second family: back to its start.
        assert_eq!(boundary_at_or_before(&two, family.len() + 4), family.len());
        // Inside the first (and only) cluster: no boundary before it, the cut stays.
        assert_eq!(boundary_at_or_before(&two, 4), 4);
    }
}
