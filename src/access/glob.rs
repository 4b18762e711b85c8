//! User and chat patterns of the `[access.<platform>]` tables: `*` matches any run of
//! characters, `?` one character, everything else itself (case-sensitive: platform ids are).

/// Longest pattern accepted.
const MAX_GLOB_BYTES: usize = 256;

/// A validated pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Glob(String);

impl Glob {
    /// Checks `pattern`: not empty, at most 256 bytes, no control characters, and not `*`
    /// alone with nothing else to match on (which would let everyone in: say `mode = "open"`).
    pub(crate) fn new(pattern: &str) -> Result<Glob, String> {
        if pattern.is_empty() || pattern.len() > MAX_GLOB_BYTES {
            return Err(format!(
                "{pattern:?}: a pattern is 1 to {MAX_GLOB_BYTES} bytes"
            ));
        }
        if pattern.chars().any(char::is_control) {
            return Err(format!("{pattern:?}: control characters"));
        }
        if pattern.chars().all(|c| c == '*') {
            return Err(format!(
                "{pattern:?} matches everyone: use mode = \"open\" instead"
            ));
        }
        Ok(Glob(pattern.to_owned()))
    }

    pub(crate) fn matches(&self, text: &str) -> bool {
        matches(self.0.as_bytes(), text.as_bytes())
    }
}

/// Iterative wildcard match with one backtrack point: linear in practice, never exponential.
fn matches(p: &[u8], t: &[u8]) -> bool {
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stars_and_marks_match_as_documented() {
        let g = |p: &str| Glob::new(p).expect("valid");
        assert!(g("@*:example.org").matches("@bob:example.org"));
        assert!(!g("@*:example.org").matches("@bob:example.org.evil"));
        assert!(g("@bob:example.org").matches("@bob:example.org"));
        assert!(!g("@bob:example.org").matches("@bobby:example.org"));
        assert!(g("nick!*@host?").matches("nick!u@host1"));
        assert!(!g("a*b*c").matches("aXbY"));
        assert!(g("a*b*c").matches("aXbYc"));
    }

    #[test]
    fn bad_patterns_are_refused_with_the_reason() {
        assert!(Glob::new("").is_err());
        assert!(Glob::new("**").expect_err("everyone").contains("open"));
        assert!(Glob::new("a\nb").is_err());
        assert!(Glob::new(&"x".repeat(300)).is_err());
    }

    proptest::proptest! {
        #[test]
        fn a_pattern_without_wildcards_matches_only_itself(a in "[a-z@:.]{1,12}", b in "[a-z@:.]{1,12}") {
            let g = Glob::new(&a).expect("valid");
            proptest::prop_assert_eq!(g.matches(&b), a == b);
            proptest::prop_assert!(g.matches(&a));
        }
    }
}
