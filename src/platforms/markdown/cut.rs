//! Filling pieces with rendered atoms, each piece within a platform's limit: a cut never
//! falls inside a tag or an entity (text is escaped as it is placed), the tags open at a
//! cut are closed at the end of the piece and opened again at the start of the next, and
//! room for those closing tags is kept free all along.
//!
//! Where a piece ends: before a tag whose whole span does not fit when the piece is more
//! than half full, else in text at the last newline, then the last space, of the room left
//! (in its second half first), never inside a grapheme cluster; a piece already holding
//! text is ended rather than cut mid-word. Tags are written only while opening them again
//! costs at most half a piece, so every new piece has room for text.

use super::write::{Atom, Tag};

/// How a piece's size is counted against its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// Bytes of the HTML plus bytes of the plain text (a Matrix event carries both).
    HtmlPlusPlainBytes,
    /// UTF-16 code units of the HTML (a Telegram message).
    HtmlUtf16,
}

impl Measure {
    fn cost(self, html: &str, plain: &str) -> usize {
        match self {
            Measure::HtmlPlusPlainBytes => html.len() + plain.len(),
            Measure::HtmlUtf16 => html.encode_utf16().count(),
        }
    }

    /// The cost of one character of text: its escaped form, and itself in the plain text.
    fn char_cost(self, c: char) -> usize {
        let escaped = match c {
            '&' => 5,
            '<' | '>' => 4,
            '"' => 6,
            c => match self {
                Measure::HtmlPlusPlainBytes => c.len_utf8(),
                Measure::HtmlUtf16 => c.len_utf16(),
            },
        };
        match self {
            Measure::HtmlPlusPlainBytes => escaped + c.len_utf8(),
            Measure::HtmlUtf16 => escaped,
        }
    }

    fn atom_cost(self, atom: &Atom) -> usize {
        match atom {
            Atom::Open(t) => self.cost(&t.open, &t.plain_open) + self.cost(t.close, &t.plain_close),
            Atom::Close => 0,
            Atom::Text(s) => s.chars().map(|c| self.char_cost(c)).sum(),
            Atom::Break { html, plain } => self.cost(html, plain),
        }
    }
}

/// One message's worth of a rendered reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Piece {
    /// The HTML (Matrix's `formatted_body`, Telegram's `text`).
    pub html: String,
    /// The plain text (Matrix's `body`; what Telegram shows of the HTML; IRC's text).
    pub plain: String,
}

/// A tag open at this point of the output.
struct Open<'a> {
    tag: &'a Tag,
    /// Whether its HTML was written (else only its plain parts are).
    written: bool,
}

struct Cutter<'a> {
    measure: Measure,
    limit: usize,
    max_tags: usize,
    stack: Vec<Open<'a>>,
    piece: Piece,
    /// The current piece's cost so far.
    used: usize,
    /// What closing every open tag will cost (kept free).
    reserved: usize,
    /// What opening every written open tag again costs.
    reopen: usize,
    /// Tags opened in the current piece (reopened ones included).
    tags: usize,
    /// Whether the piece holds anything besides tags opened again.
    content: bool,
    pieces: Vec<Piece>,
}

/// The pieces of `atoms`, each within `limit` (at least 64) as `measure` counts it, with at
/// most `max_tags` tags each.
pub(crate) fn cut(atoms: &[Atom], measure: Measure, limit: usize, max_tags: usize) -> Vec<Piece> {
    let spans = span_costs(atoms, measure);
    let mut c = Cutter {
        measure,
        limit: limit.max(64),
        max_tags: max_tags.max(super::MAX_DEPTH + 1),
        stack: Vec::new(),
        piece: Piece::default(),
        used: 0,
        reserved: 0,
        reopen: 0,
        tags: 0,
        content: false,
        pieces: Vec::new(),
    };
    for (i, atom) in atoms.iter().enumerate() {
        match atom {
            Atom::Open(tag) => c.open(tag, spans[i]),
            Atom::Close => c.close(),
            Atom::Text(s) => c.text(s),
            Atom::Break { html, plain } => c.fixed(html, plain),
        }
        debug_assert!(
            c.used + c.reserved <= c.limit,
            "a piece stays within its limit"
        );
    }
    while !c.stack.is_empty() {
        c.close();
    }
    c.flush();
    c.pieces
}

/// For each atom, the cost of its whole span: an open tag's up to its close, else its own.
fn span_costs(atoms: &[Atom], measure: Measure) -> Vec<usize> {
    let mut before = Vec::with_capacity(atoms.len() + 1);
    let mut total = 0usize;
    for a in atoms {
        before.push(total);
        total += measure.atom_cost(a);
    }
    before.push(total);
    let mut spans: Vec<usize> = atoms.iter().map(|a| measure.atom_cost(a)).collect();
    let mut opens = Vec::new();
    for (i, a) in atoms.iter().enumerate() {
        match a {
            Atom::Open(_) => opens.push(i),
            Atom::Close => {
                if let Some(o) = opens.pop() {
                    spans[o] = before[i + 1] - before[o];
                }
            }
            _ => {}
        }
    }
    spans
}

impl<'a> Cutter<'a> {
    fn fits(&self, cost: usize) -> bool {
        self.used + cost + self.reserved <= self.limit
    }

    fn open(&mut self, tag: &'a Tag, span: usize) {
        let m = self.measure;
        let open_html = m.cost(&tag.open, "");
        let close = m.cost(tag.close, &tag.plain_close);
        let written = self.reopen + open_html + self.reserved + close <= self.limit / 2;
        if written {
            let open = m.cost(&tag.open, &tag.plain_open);
            let whole_fits = self.fits(span);
            if (!whole_fits && self.used > self.limit / 2)
                || !self.fits(open + close)
                || self.tags + 1 > self.max_tags
            {
                self.flush();
            }
            self.piece.html.push_str(&tag.open);
            self.piece.plain.push_str(&tag.plain_open);
            self.used += open;
            self.reopen += open_html;
            self.reserved += close;
            self.tags += 1;
        } else {
            let open = m.cost("", &tag.plain_open);
            if !self.fits(open + m.cost("", &tag.plain_close)) {
                self.flush();
            }
            self.piece.plain.push_str(&tag.plain_open);
            self.used += open;
            self.reserved += m.cost("", &tag.plain_close);
        }
        self.content |= !tag.plain_open.is_empty();
        self.stack.push(Open { tag, written });
    }

    fn close(&mut self) {
        let Some(Open { tag, written }) = self.stack.pop() else {
            return;
        };
        let m = self.measure;
        if written {
            self.piece.html.push_str(tag.close);
            self.reopen -= m.cost(&tag.open, "");
            self.reserved -= m.cost(tag.close, &tag.plain_close);
            self.used += m.cost(tag.close, &tag.plain_close);
        } else {
            self.reserved -= m.cost("", &tag.plain_close);
            self.used += m.cost("", &tag.plain_close);
        }
        self.piece.plain.push_str(&tag.plain_close);
        self.content = true;
    }

    fn fixed(&mut self, html: &str, plain: &str) {
        let cost = self.measure.cost(html, plain);
        if !self.fits(cost) {
            self.flush();
        }
        self.piece.html.push_str(html);
        self.piece.plain.push_str(plain);
        self.used += cost;
        self.content = true;
    }

    fn push_text(&mut self, s: &str) {
        super::escape_into(&mut self.piece.html, s);
        self.piece.plain.push_str(s);
        self.used += s.chars().map(|c| self.measure.char_cost(c)).sum::<usize>();
        self.content = true;
    }

    fn text(&mut self, s: &str) {
        let mut rest = s;
        while !rest.is_empty() {
            let room = self.limit.saturating_sub(self.used + self.reserved);
            let mut spent = 0;
            let mut end = rest.len();
            for (i, c) in rest.char_indices() {
                let cost = self.measure.char_cost(c);
                if spent + cost > room {
                    end = i;
                    break;
                }
                spent += cost;
            }
            if end == rest.len() {
                self.push_text(rest);
                return;
            }
            let cut = match cut_point(rest, end) {
                Some(cut) => cut,
                // No good cut in what is left of this piece: the text starts the next one.
                None if self.content => {
                    self.flush();
                    continue;
                }
                // Progress before beauty: a word (or grapheme) longer than a piece is cut.
                None if end > 0 => end,
                None => rest.chars().next().map_or(rest.len(), char::len_utf8),
            };
            self.push_text(&rest[..cut]);
            rest = &rest[cut..];
            self.flush();
        }
    }

    /// Ends the current piece (if it holds anything): the open tags closed, and opened
    /// again at the start of the next.
    fn flush(&mut self) {
        if !self.content {
            return;
        }
        for open in self.stack.iter().rev().filter(|o| o.written) {
            self.piece.html.push_str(open.tag.close);
        }
        self.pieces.push(std::mem::take(&mut self.piece));
        self.tags = 0;
        for open in self.stack.iter().filter(|o| o.written) {
            self.piece.html.push_str(&open.tag.open);
            self.tags += 1;
        }
        self.used = self.measure.cost(&self.piece.html, "");
        debug_assert_eq!(self.used, self.reopen, "reopening costs what was counted");
        self.content = false;
    }
}

/// Where to cut `text` whose first `end` bytes fit: after the last newline, then the last
/// space, in the second half of them, then anywhere in them; at a grapheme boundary.
/// `None` when there is no such place.
fn cut_point(text: &str, end: usize) -> Option<usize> {
    let window = &text[..end];
    let mut half = window.len() / 2;
    while !window.is_char_boundary(half) {
        half -= 1;
    }
    let after = |sep: char, from: usize| window[from..].rfind(sep).map(|i| from + i + 1);
    let cut = after('\n', half)
        .or_else(|| after(' ', half))
        .or_else(|| after('\n', 0))
        .or_else(|| after(' ', 0))?;
    let cut = crate::platforms::grapheme::boundary_at_or_before(text, cut);
    (cut > 0).then_some(cut)
}

#[cfg(test)]
mod cut_point_tests {
    use super::cut_point;

    /// A text cut prefers the last newline in the second half of what fits, then the last
    /// space there, then the last newline or space anywhere, and never cuts at 0 (caught the
    /// survivors `/ 2` → `% 2` and `* 2` of the half-way point).
    #[test]
    fn a_cut_falls_at_the_last_newline_of_the_second_half_then_the_last_space() {
        // newline in the second half of the first 20 bytes: cut after it.
        let text = "aaaa bbbb ccc\ndd eeeeeeeeeeeeeee";
        assert_eq!(cut_point(text, 20), Some(14));
        // A newline only in the first half: the last space of the second half wins.
        let text = "aa\nbbbbbbbbb ccc dddddddddddddd";
        assert_eq!(cut_point(text, 20), Some(17));
        // Only a newline early on: it is still used rather than cutting a word.
        let text = "a\nbbbbbbbbbbbbbbbbbbbbbbbbbb";
        assert_eq!(cut_point(text, 20), Some(2));
        // No separator at all: no place to cut.
        assert_eq!(cut_point("bbbbbbbbbbbbbbbbbbbbbbbb", 20), None);
    }
}
