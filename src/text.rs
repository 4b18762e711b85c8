//! The one UTF-8-safe cut: text shortened to a byte budget without splitting a character.

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
pub(crate) fn prefix(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    // At most three steps back: a UTF-8 sequence is at most four bytes.
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Cuts `text` in place to at most `max` bytes on a character boundary; whether it was cut.
pub(crate) fn truncate(text: &mut String, max: usize) -> bool {
    let keep = prefix(text, max).len();
    let cut = keep < text.len();
    text.truncate(keep);
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_never_splits_a_character() {
        let s = "aé€😀"; // 1 + 2 + 3 + 4 bytes
        let ends: Vec<usize> = (0..=s.len()).map(|m| prefix(s, m).len()).collect();
        assert_eq!(ends, [0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10]);
        assert_eq!(prefix(s, 100), s);
    }

    #[test]
    fn truncate_says_whether_it_cut() {
        let mut s = String::from("héllo");
        assert!(!truncate(&mut s, 6));
        assert_eq!(s, "héllo");
        assert!(truncate(&mut s, 2));
        assert_eq!(s, "h");
        assert!(truncate(&mut s, 0));
        assert_eq!(s, "");
    }
}
