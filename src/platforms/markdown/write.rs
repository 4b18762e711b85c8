//! The writers: `pulldown-cmark`'s events as a flat list of [`Atom`]s for one platform, the
//! platform's tags chosen and nested as it allows.

use pulldown_cmark::{CodeBlockKind, Event, HeadingLevel, LinkType, Options, Parser, TagEnd};

use super::{MAX_DEPTH, MAX_URL_BYTES, Target};

/// A tag of the output: its HTML, and what it adds to the plain text (a list item's marker
/// in Matrix's `body`, a link's URL after its text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub(crate) open: String,
    pub(crate) close: &'static str,
    pub(crate) plain_open: String,
    pub(crate) plain_close: String,
}

/// One unit of rendered output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Atom {
    /// A tag opens.
    Open(Tag),
    /// The innermost open tag closes.
    Close,
    /// Text shown as it is: the plain text is it, the HTML its escaped form. A piece may end
    /// inside it (between two graphemes).
    Text(String),
    /// A break that is one unit (Matrix's `<br>`, `<hr>`).
    Break {
        html: &'static str,
        plain: &'static str,
    },
}

/// A list item's nesting at most indented (deeper ones are indented as this).
const MAX_INDENT: usize = 8;

#[derive(Debug)]
enum Kind {
    /// A block (paragraph, heading, code, quote) or an inline span.
    Plain,
    List {
        next: u64,
        ordered: bool,
        items: u64,
    },
    Item,
    Quote,
    Link,
    Code,
}

#[derive(Debug)]
struct Frame {
    kind: Kind,
    /// Whether an [`Atom::Open`] was written (so its end writes [`Atom::Close`]).
    opened: bool,
    /// Text written at the end (a link's URL where its tag could not be).
    after: Option<String>,
}

struct Writer {
    target: Target,
    atoms: Vec<Atom>,
    frames: Vec<Frame>,
    /// Tags open now.
    depth: usize,
    /// Nothing written yet in the innermost container (no separator before its first block).
    at_start: bool,
    /// The text of the code block being read (written whole at its end).
    code: Option<String>,
    quotes: usize,
    links: usize,
}

/// `text`'s atoms for `target`.
pub(crate) fn atoms(text: &str, target: Target) -> Vec<Atom> {
    let mut w = Writer {
        target,
        atoms: Vec::new(),
        frames: Vec::new(),
        depth: 0,
        at_start: true,
        code: None,
        quotes: 0,
        links: 0,
    };
    for event in Parser::new_ext(text, Options::ENABLE_STRIKETHROUGH) {
        w.event(event);
    }
    debug_assert!(
        w.frames.is_empty() && w.depth == 0,
        "the parser balances its tags"
    );
    w.atoms
}

fn tag(open: impl Into<String>, close: &'static str) -> Option<Tag> {
    Some(Tag {
        open: open.into(),
        close,
        plain_open: String::new(),
        plain_close: String::new(),
    })
}

/// A code block's language as a class name: letters, digits and `+-_.#` only, at most 32.
fn language(info: &str) -> Option<String> {
    let word = info.split_whitespace().next()?;
    let ok = word.len() <= 32
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-_.#".contains(c));
    ok.then(|| word.to_owned())
}

/// The URL a link may keep on `target`: `http`, `https`, and `mailto` where the platform
/// takes it; an email autolink gains its `mailto:`. `None`: the link shows its text alone.
fn safe_url(target: Target, kind: LinkType, dest: &str) -> Option<String> {
    let url = if kind == LinkType::Email {
        format!("mailto:{dest}")
    } else {
        dest.to_owned()
    };
    let scheme = url.split_once(':')?.0.to_ascii_lowercase();
    let allowed = match target {
        Target::Telegram => matches!(scheme.as_str(), "http" | "https"),
        Target::Matrix | Target::Irc => matches!(scheme.as_str(), "http" | "https" | "mailto"),
    };
    let clean = !url.chars().any(|c| c.is_control() || c.is_whitespace());
    (allowed && clean && url.len() <= MAX_URL_BYTES).then_some(url)
}

impl Writer {
    fn event(&mut self, event: Event<'_>) {
        match event {
            Event::Start(t) => self.start(t),
            Event::End(t) => self.end(t),
            Event::Text(t) => match &mut self.code {
                Some(code) => code.push_str(&t),
                None => self.text(&t),
            },
            Event::Code(t) => {
                let allowed = match self.target {
                    Target::Matrix => true,
                    // Telegram nests no `code` in a link or a quote.
                    Target::Telegram => self.quotes + self.links == 0,
                    Target::Irc => false,
                };
                self.push(
                    Kind::Plain,
                    tag("<code>", "</code>").filter(|_| allowed),
                    None,
                );
                self.text(&t);
                self.pop();
            }
            Event::Html(t) | Event::InlineHtml(t) => self.text(&t),
            Event::SoftBreak | Event::HardBreak => match self.target {
                Target::Matrix => self.atom(Atom::Break {
                    html: "<br>",
                    plain: "\n",
                }),
                Target::Telegram | Target::Irc => self.text("\n"),
            },
            Event::Rule => {
                self.block_start();
                match self.target {
                    Target::Matrix => self.atom(Atom::Break {
                        html: "<hr>",
                        plain: "———",
                    }),
                    Target::Telegram | Target::Irc => self.text("———"),
                }
            }
            Event::TaskListMarker(done) => self.text(if done { "[x] " } else { "[ ] " }),
            Event::FootnoteReference(t) | Event::InlineMath(t) | Event::DisplayMath(t) => {
                self.text(&t)
            }
        }
    }

    fn start(&mut self, t: pulldown_cmark::Tag<'_>) {
        use pulldown_cmark::Tag as T;
        let matrix = self.target == Target::Matrix;
        let telegram = self.target == Target::Telegram;
        match t {
            T::Paragraph | T::HtmlBlock => {
                self.block_start();
                self.push(Kind::Plain, tag("<p>", "</p>").filter(|_| matrix), None);
            }
            T::Heading { level, .. } => {
                self.block_start();
                let t = match self.target {
                    Target::Matrix => heading(level),
                    Target::Telegram => tag("<b>", "</b>"),
                    Target::Irc => None,
                };
                self.push(Kind::Plain, t, None);
            }
            T::BlockQuote(_) => {
                self.block_start();
                let t = tag("<blockquote>", "</blockquote>")
                    .filter(|_| matrix || (telegram && self.quotes == 0));
                self.quotes += 1;
                self.push(Kind::Quote, t, None);
                self.at_start = true;
            }
            T::CodeBlock(kind) => {
                self.block_start();
                let lang = match kind {
                    CodeBlockKind::Fenced(info) => language(&info),
                    CodeBlockKind::Indented => None,
                };
                let allowed = matrix || (telegram && self.quotes == 0);
                let t = match lang {
                    Some(l) => tag(
                        format!("<pre><code class=\"language-{l}\">"),
                        "</code></pre>",
                    ),
                    None => tag("<pre><code>", "</code></pre>"),
                };
                self.push(Kind::Code, t.filter(|_| allowed), None);
                self.code = Some(String::new());
            }
            T::List(start) => {
                self.block_start();
                let t = match start {
                    _ if !matrix => None,
                    Some(1) => tag("<ol>", "</ol>"),
                    Some(n) => tag(format!("<ol start=\"{n}\">"), "</ol>"),
                    None => tag("<ul>", "</ul>"),
                };
                let kind = Kind::List {
                    next: start.unwrap_or(1),
                    ordered: start.is_some(),
                    items: 0,
                };
                self.push(kind, t, None);
            }
            T::Item => self.item(),
            T::Emphasis | T::Strong | T::Strikethrough => {
                let t = match (self.target, t) {
                    (Target::Irc, _) => None,
                    (Target::Matrix, T::Emphasis) => tag("<em>", "</em>"),
                    (Target::Matrix, T::Strong) => tag("<strong>", "</strong>"),
                    (Target::Matrix, _) => tag("<del>", "</del>"),
                    (Target::Telegram, T::Emphasis) => tag("<i>", "</i>"),
                    (Target::Telegram, T::Strong) => tag("<b>", "</b>"),
                    (Target::Telegram, _) => tag("<s>", "</s>"),
                };
                self.push(Kind::Plain, t, None);
            }
            T::Link {
                link_type,
                dest_url,
                ..
            }
            | T::Image {
                link_type,
                dest_url,
                ..
            } => self.link(link_type, &dest_url),
            _ => self.push(Kind::Plain, None, None),
        }
    }

    fn item(&mut self) {
        let lists = self
            .frames
            .iter()
            .filter(|f| matches!(f.kind, Kind::List { .. }))
            .count();
        let Some(Frame {
            kind:
                Kind::List {
                    next,
                    ordered,
                    items,
                },
            ..
        }) = self.frames.last_mut()
        else {
            self.push(Kind::Item, None, None);
            return;
        };
        let marker = if *ordered {
            format!("{next}. ")
        } else {
            "• ".to_owned()
        };
        *next = next.saturating_add(1);
        *items += 1;
        let first = *items == 1;
        let indent = "  ".repeat(lists.saturating_sub(1).min(MAX_INDENT));
        if !first {
            self.text("\n");
        }
        let prefix = format!("{indent}{marker}");
        if self.target == Target::Matrix {
            let t = tag("<li>", "</li>").map(|t| Tag {
                plain_open: prefix,
                ..t
            });
            self.push(Kind::Item, t, None);
        } else {
            self.push(Kind::Item, None, None);
            self.text(&prefix);
        }
        self.at_start = true;
    }

    fn link(&mut self, kind: LinkType, dest: &str) {
        let url = safe_url(self.target, kind, dest);
        // An autolink's text is its URL already.
        let auto = matches!(kind, LinkType::Autolink | LinkType::Email);
        let shown_url = url.clone().filter(|_| !auto).map(|u| format!(" <{u}>"));
        // No link inside a link (`[<https://x.org>](https://e.org)`): HTML forbids it and
        // the Bot API refuses the message; the inner one keeps its text.
        let allowed = self.links == 0
            && match self.target {
                Target::Matrix => true,
                Target::Telegram => self.quotes == 0,
                Target::Irc => false,
            };
        self.links += 1;
        match url {
            Some(u) if allowed => {
                let mut open = String::from("<a href=\"");
                super::escape_into(&mut open, &u);
                open.push_str("\">");
                let t = tag(open, "</a>").map(|t| Tag {
                    plain_close: if self.target == Target::Matrix {
                        shown_url.clone().unwrap_or_default()
                    } else {
                        String::new()
                    },
                    ..t
                });
                self.push(Kind::Link, t, shown_url);
            }
            _ => self.push(Kind::Link, None, shown_url),
        }
    }

    /// Opens a frame, writing `tag` if it may be (within [`MAX_DEPTH`]). `fallback` is
    /// what its end writes as text should the tag not be written.
    fn push(&mut self, kind: Kind, tag: Option<Tag>, fallback: Option<String>) {
        let tag = tag.filter(|_| self.depth < MAX_DEPTH);
        let opened = tag.is_some();
        let after = if opened { None } else { fallback };
        if let Some(t) = tag {
            self.depth += 1;
            self.atoms.push(Atom::Open(t));
        }
        self.frames.push(Frame {
            kind,
            opened,
            after,
        });
    }

    fn pop(&mut self) {
        let Some(frame) = self.frames.pop() else {
            return;
        };
        if let Some(after) = frame.after {
            self.text(&after);
        }
        if frame.opened {
            self.depth -= 1;
            self.atoms.push(Atom::Close);
        }
        match frame.kind {
            Kind::Quote => self.quotes -= 1,
            Kind::Link => self.links -= 1,
            _ => {}
        }
        self.at_start = false;
    }

    fn end(&mut self, t: TagEnd) {
        if t == TagEnd::CodeBlock
            && let Some(mut code) = self.code.take()
        {
            if code.ends_with('\n') {
                code.pop();
            }
            self.text(&code);
        }
        self.pop();
    }

    /// Before a block: a blank line after what came before it (a line break in a list
    /// item).
    fn block_start(&mut self) {
        if !self.at_start {
            let in_item = matches!(
                self.frames.last(),
                Some(Frame {
                    kind: Kind::Item,
                    ..
                })
            );
            self.text(if in_item { "\n" } else { "\n\n" });
        }
        self.at_start = false;
    }

    fn text(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        self.at_start = false;
        if let Some(Atom::Text(last)) = self.atoms.last_mut() {
            last.push_str(t);
        } else {
            self.atoms.push(Atom::Text(t.to_owned()));
        }
    }

    fn atom(&mut self, a: Atom) {
        self.at_start = false;
        self.atoms.push(a);
    }
}

fn heading(level: HeadingLevel) -> Option<Tag> {
    let (open, close) = match level {
        HeadingLevel::H1 => ("<h1>", "</h1>"),
        HeadingLevel::H2 => ("<h2>", "</h2>"),
        HeadingLevel::H3 => ("<h3>", "</h3>"),
        HeadingLevel::H4 => ("<h4>", "</h4>"),
        HeadingLevel::H5 => ("<h5>", "</h5>"),
        HeadingLevel::H6 => ("<h6>", "</h6>"),
    };
    tag(open, close)
}
