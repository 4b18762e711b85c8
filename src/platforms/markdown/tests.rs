use super::*;
use proptest::prelude::*;

// The Bot API's HTML parse mode, as the Telegram fake of the bridge tests parses it.
#[path = "../../../tests/telegram_html/mod.rs"]
mod telegram_html;
use telegram_html::parse_entities;

fn matrix(text: &str) -> Piece {
    let mut p = pieces(
        text,
        Target::Matrix,
        Measure::HtmlPlusPlainBytes,
        1 << 20,
        usize::MAX,
    );
    assert!(p.len() <= 1, "{p:?}");
    p.pop().unwrap_or_default()
}

fn tg(text: &str) -> String {
    telegram(text).concat()
}

/// Checks `html` is well formed: every `<` starts a tag of `allowed`, tags balance, every
/// `&` starts one of the four entities. The tags' names, in order.
fn well_formed(html: &str, allowed: &[&str]) -> Result<Vec<String>, String> {
    let mut stack: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find(['<', '&', '>']) {
        let at = &rest[i..];
        if at.starts_with('>') {
            return Err(format!("a raw '>' in {html:?}"));
        }
        if let Some(after) = at.strip_prefix('&') {
            let ok = ["amp;", "lt;", "gt;", "quot;"]
                .iter()
                .any(|e| after.starts_with(e));
            if !ok {
                return Err(format!("a raw '&' in {html:?}"));
            }
            rest = after;
            continue;
        }
        let end = at
            .find('>')
            .ok_or_else(|| format!("an unclosed tag in {html:?}"))?;
        let inner = &at[1..end];
        if inner.contains('<') || inner.contains('"') && inner.matches('"').count() != 2 {
            return Err(format!("a broken tag {inner:?} in {html:?}"));
        }
        let (closing, body) = match inner.strip_prefix('/') {
            Some(b) => (true, b),
            None => (false, inner),
        };
        let name = body.split(' ').next().unwrap_or_default().to_owned();
        if !allowed.contains(&name.as_str()) {
            return Err(format!("tag {name:?} not allowed in {html:?}"));
        }
        if !closing && name == "a" && stack.iter().any(|t| t == "a") {
            return Err(format!("a link inside a link in {html:?}"));
        }
        if closing {
            if stack.pop().as_deref() != Some(name.as_str()) {
                return Err(format!("</{name}> closes nothing in {html:?}"));
            }
        } else if !matches!(name.as_str(), "br" | "hr") {
            stack.push(name.clone());
            names.push(name);
        }
        rest = &at[end + 1..];
    }
    if stack.is_empty() {
        Ok(names)
    } else {
        Err(format!("{stack:?} left open in {html:?}"))
    }
}

const MATRIX_TAGS: &[&str] = &[
    "p",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "strong",
    "em",
    "del",
    "code",
    "pre",
    "blockquote",
    "ul",
    "ol",
    "li",
    "a",
    "br",
    "hr",
];
const TELEGRAM_TAGS: &[&str] = &["b", "i", "u", "s", "code", "pre", "a", "blockquote"];

#[test]
fn each_construct_renders_for_matrix_with_a_plain_body() {
    let p = matrix("# Title\n\nSome *em*, **strong**, ~~gone~~ and `x < y`.");
    assert_eq!(
        p.html,
        "<h1>Title</h1>\n\n<p>Some <em>em</em>, <strong>strong</strong>, <del>gone</del> and <code>x &lt; y</code>.</p>"
    );
    assert_eq!(p.plain, "Title\n\nSome em, strong, gone and x < y.");
    let p = matrix("```rust\nfn main() {}\n```");
    assert_eq!(
        p.html,
        "<pre><code class=\"language-rust\">fn main() {}</code></pre>"
    );
    assert_eq!(p.plain, "fn main() {}");
    let p = matrix("- a\n- b\n  1. c\n  2. d\n\n> quoted\n\n[site](https://e.org/?a=1&b=2)");
    assert_eq!(
        p.html,
        "<ul><li>a</li>\n<li>b\n<ol><li>c</li>\n<li>d</li></ol></li></ul>\n\n<blockquote><p>quoted</p></blockquote>\n\n<p><a href=\"https://e.org/?a=1&amp;b=2\">site</a></p>"
    );
    assert_eq!(
        p.plain,
        "• a\n• b\n  1. c\n  2. d\n\nquoted\n\nsite <https://e.org/?a=1&b=2>"
    );
    assert_eq!(
        matrix("3. three\n4. four").html,
        "<ol start=\"3\"><li>three</li>\n<li>four</li></ol>"
    );
    assert_eq!(
        matrix("line one\nline two").html,
        "<p>line one<br>line two</p>"
    );
}

#[test]
fn each_construct_renders_for_telegram_with_its_own_tags() {
    assert_eq!(
        tg("# Title\n\n*em* **strong** ~~gone~~ `x<y` & more"),
        "<b>Title</b>\n\n<i>em</i> <b>strong</b> <s>gone</s> <code>x&lt;y</code> &amp; more"
    );
    assert_eq!(
        tg("```py\nprint(1)\n```\n\n- a\n- b\n\n1. one\n2. two"),
        "<pre><code class=\"language-py\">print(1)</code></pre>\n\n• a\n• b\n\n1. one\n2. two"
    );
    assert_eq!(
        tg("> a [link](https://e.org) and `code`\n> > nested"),
        "<blockquote>a link &lt;https://e.org&gt; and code\n\nnested</blockquote>"
    );
    assert_eq!(
        tg("[a **b**](http://e.org)"),
        "<a href=\"http://e.org\">a <b>b</b></a>"
    );
    // Telegram takes no mailto link: its text and address stay readable.
    assert_eq!(tg("[me](mailto:a@b.c)"), "me");
    assert_eq!(tg("<a@b.c>"), "a@b.c");
}

#[test]
fn irc_gets_the_text_without_markup_and_links_with_their_url() {
    assert_eq!(
        plain(
            "**Bold** and _it_, `code`, [site](https://e.org), <https://x.org>\n\n```\nlet a = 1;\n```"
        ),
        "Bold and it, code, site <https://e.org>, https://x.org\n\nlet a = 1;"
    );
    assert_eq!(plain("1. a\n   - b"), "1. a\n  • b");
}

#[test]
fn raw_html_and_unsafe_links_are_escaped_or_dropped() {
    let hostile = "<script>alert(1)</script>\n\nhi <b onclick=x>x</b> [click](javascript:alert(1)) [d](data:text/html,x) ![i](javascript:x)";
    let p = matrix(hostile);
    assert!(!p.html.contains("<script"), "{}", p.html);
    assert!(!p.html.contains("<b "), "{}", p.html);
    assert!(!p.html.to_lowercase().contains("javascript"), "{}", p.html);
    assert!(!p.html.contains("data:"), "{}", p.html);
    assert!(
        p.html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{}",
        p.html
    );
    well_formed(&p.html, MATRIX_TAGS).expect("well formed");
    let t = tg(hostile);
    assert!(t.contains("&lt;b onclick=x&gt;"), "{t}");
    assert!(!t.to_lowercase().contains("javascript"), "{t}");
    well_formed(&t, TELEGRAM_TAGS).expect("well formed");
    // An attribute cannot be broken out of.
    let p = matrix("[x](https://e.org/\"onmouseover=\"alert(1))");
    well_formed(&p.html, MATRIX_TAGS).expect("well formed");
    assert!(!p.html.contains("\" onmouseover"), "{}", p.html);
    let p = matrix("```rust\" onclick=\"x\nbody\n```");
    assert_eq!(p.html, "<pre><code>body</code></pre>");
    // A link inside a link (an autolink as a link's text): one link, the inner one's text.
    let nested = "[<https://x.org>](https://e.org/)";
    assert_eq!(
        matrix(nested).html,
        "<p><a href=\"https://e.org/\">https://x.org</a></p>"
    );
    assert_eq!(tg(nested), "<a href=\"https://e.org/\">https://x.org</a>");
    assert_eq!(parse_entities(&tg(nested)).as_deref(), Ok("https://x.org"));
}

#[test]
fn unterminated_markup_renders_safely_and_an_open_fence_is_an_open_code_block() {
    // A partial cut mid-fence: the code block runs to the end, no backticks shown.
    let p = matrix("Here:\n\n```python\ndef f():\n    return");
    assert_eq!(
        p.html,
        "<p>Here:</p>\n\n<pre><code class=\"language-python\">def f():\n    return</code></pre>"
    );
    assert_eq!(
        tg("```python\ndef f("),
        "<pre><code class=\"language-python\">def f(</code></pre>"
    );
    for text in [
        "**bold",
        "*it",
        "`code",
        "[link](http://e.org",
        "> quote\n> ```\n",
        "~~s",
        "<b>",
        "&amp",
    ] {
        well_formed(&matrix(text).html, MATRIX_TAGS).expect("matrix");
        well_formed(&tg(text), TELEGRAM_TAGS).expect("telegram");
    }
    assert_eq!(tg("**bold"), "**bold");
    assert_eq!(tg("a & b <c>"), "a &amp; b &lt;c&gt;");
    // Entities before wide characters (the parser reads a few bytes ahead for the `;`).
    assert_eq!(parse_entities(&tg("& 🎉🎉🎉")).as_deref(), Ok("& 🎉🎉🎉"));
}

#[test]
fn deep_nesting_is_bounded_and_keeps_its_text() {
    let quotes = format!("{}deep", ">".repeat(5000));
    let p = matrix(&quotes);
    let tags = well_formed(&p.html, MATRIX_TAGS).expect("well formed");
    assert!(tags.len() <= MAX_DEPTH, "{} tags", tags.len());
    assert!(p.plain.ends_with("deep"));
    let lists = "- ".repeat(2000) + "x";
    let p = matrix(&lists);
    well_formed(&p.html, MATRIX_TAGS).expect("well formed");
    assert!(p.plain.ends_with('x'));
    assert!(
        p.plain.len() < 40_000,
        "indentation is bounded: {}",
        p.plain.len()
    );
    let stars = format!("{}x{}", "*".repeat(3000), "*".repeat(3000));
    for piece in telegram(&stars) {
        well_formed(&piece, TELEGRAM_TAGS).expect("telegram");
    }
    let brackets = "[".repeat(5000) + &"](http://e.org)".repeat(100);
    well_formed(&matrix(&brackets).html, MATRIX_TAGS).expect("well formed");
}

#[test]
fn a_fence_split_across_pieces_is_closed_and_reopened_with_its_language() {
    let code: String = (0..400).map(|i| format!("let x{i} = {i};\n")).collect();
    let text = format!("Intro **bold**.\n\n```rust\n{code}```\n\nAfter.");
    let pieces = telegram(&text);
    assert!(pieces.len() >= 2, "{}", pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        assert!(p.encode_utf16().count() <= 4096);
        well_formed(p, TELEGRAM_TAGS).expect("well formed");
        if i > 0 && i + 1 < pieces.len() {
            assert!(p.starts_with("<pre><code class=\"language-rust\">"), "{p}");
            assert!(p.ends_with("</code></pre>"), "{p}");
        }
        // Cut between lines of code, not inside one.
        if i + 1 < pieces.len() {
            assert!(p.ends_with(";\n</code></pre>"), "{p}");
        }
    }
    assert!(pieces[0].starts_with("Intro <b>bold</b>."));
    let m = super::pieces(
        &text,
        Target::Matrix,
        Measure::HtmlPlusPlainBytes,
        3000,
        usize::MAX,
    );
    assert!(m.len() >= 3);
    for p in &m[1..m.len() - 1] {
        assert!(
            p.html.starts_with("<pre><code class=\"language-rust\">"),
            "{}",
            p.html
        );
        assert!(p.html.len() + p.plain.len() <= 3000);
    }
    let plain: String = m.iter().map(|p| p.plain.as_str()).collect();
    assert_eq!(plain, matrix(&text).plain);
}

#[test]
fn telegram_pieces_keep_under_the_tag_bound() {
    let text = "**b** ".repeat(1000);
    let pieces = telegram(&text);
    assert!(pieces.len() >= 10);
    for p in &pieces {
        let tags = well_formed(p, TELEGRAM_TAGS).expect("well formed");
        assert!(tags.len() <= TELEGRAM_MAX_TAGS, "{}", tags.len());
    }
}

/// One piece of Markdown or HTML syntax, or a word.
fn markdown_atom() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("*"),
        Just("**"),
        Just("_"),
        Just("`"),
        Just("```rust\n"),
        Just("```\n"),
        Just("\n"),
        Just("\n\n"),
        Just("- "),
        Just("1. "),
        Just("> "),
        Just("# "),
        Just("["),
        Just("]"),
        Just("(https://e.org/a?b=1&c=2)"),
        Just("(javascript:x)"),
        Just("<script>"),
        Just("</b>"),
        Just("&"),
        Just("&amp;"),
        Just("\""),
        Just("~~"),
        Just("    "),
        Just("word "),
        Just("longerword"),
        Just("é"),
        Just("🎉"),
        Just("👩\u{200D}💻"),
        Just("<https://x.org>"),
        Just("\\"),
    ]
}

fn markdownish() -> impl Strategy<Value = String> {
    prop::collection::vec(markdown_atom(), 0..200).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn any_input_renders_to_well_formed_pieces_within_the_limit(
        text in markdownish(),
        limit in 256usize..2000,
    ) {
        for (target, measure, allowed) in [
            (Target::Matrix, Measure::HtmlPlusPlainBytes, MATRIX_TAGS),
            (Target::Telegram, Measure::HtmlUtf16, TELEGRAM_TAGS),
        ] {
            let whole = super::pieces(&text, target, measure, usize::MAX / 4, usize::MAX);
            prop_assert!(whole.len() <= 1);
            let pieces = super::pieces(&text, target, measure, limit, TELEGRAM_MAX_TAGS);
            for p in &pieces {
                let size = match measure {
                    Measure::HtmlPlusPlainBytes => p.html.len() + p.plain.len(),
                    Measure::HtmlUtf16 => p.html.encode_utf16().count(),
                };
                prop_assert!(size <= limit, "{} > {limit}: {:?}", size, p.html);
                let tags = well_formed(&p.html, allowed);
                prop_assert!(tags.is_ok(), "{:?}", tags);
                prop_assert!(tags.unwrap_or_default().len() <= TELEGRAM_MAX_TAGS);
                prop_assert!(!p.html.contains("<script"));
            }
            let concat: String = pieces.iter().map(|p| p.plain.as_str()).collect();
            let full = whole.first().map(|p| p.plain.clone()).unwrap_or_default();
            prop_assert_eq!(concat, full);
        }
    }
}

/// Arbitrary text (any characters, control ones and lone markup included) cut into short
/// runs between the Markdown and HTML the renderer must defuse: unterminated, nested, raw.
fn hostile() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => any::<String>().prop_map(|s| s.chars().take(12).collect::<String>()),
        4 => markdown_atom().prop_map(str::to_owned),
        1 => Just("<b>".to_owned()),
        1 => Just("<pre><code>".to_owned()),
        1 => Just("&#60;&lt".to_owned()),
        1 => Just("```\n".to_owned()),
        1 => Just("> ".repeat(20)),
        1 => Just("**_~~`".to_owned()),
        // Nested: a link in a link, code in a link or a quote, a fence in a list in a quote.
        1 => Just("[<https://x.org> *e* `c`](https://e.org)".to_owned()),
        1 => Just("> - ```\n".to_owned()),
        1 => Just("> [`c`](https://e.org)".to_owned()),
    ];
    prop::collection::vec(piece, 0..80).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Issue 36 row 4 (Telegram): from any input, every piece parses under the Bot API's
    /// rules (its tags only, balanced, nested as it allows, every `<`, `>`, `&` of the text
    /// escaped), shows exactly the piece's plain text (nothing lost, nothing injected),
    /// and stays within the message's limit and the tag bound, split or not.
    #[test]
    fn telegram_html_from_any_input_parses_as_the_bot_api_does_in_every_piece(
        text in prop_oneof![any::<String>(), hostile()],
        limit in 64usize..1024,
    ) {
        for (limit, pieces) in [
            (4096, super::pieces(&text, Target::Telegram, Measure::HtmlUtf16, 4096, TELEGRAM_MAX_TAGS)),
            (limit, super::pieces(&text, Target::Telegram, Measure::HtmlUtf16, limit, TELEGRAM_MAX_TAGS)),
        ] {
            for p in &pieces {
                let shown = parse_entities(&p.html);
                prop_assert_eq!(shown.as_deref(), Ok(p.plain.as_str()), "html {:?}", p.html);
                prop_assert!(p.html.encode_utf16().count() <= limit);
                let tags = well_formed(&p.html, TELEGRAM_TAGS);
                prop_assert!(tags.is_ok(), "{:?}", tags);
                prop_assert!(tags.unwrap_or_default().len() <= TELEGRAM_MAX_TAGS);
            }
        }
        for html in telegram(&text) {
            prop_assert!(parse_entities(&html).is_ok_and(|shown| !shown.trim().is_empty()), "{:?}", html);
        }
    }

    /// Issue 36 row 4 (Matrix): from any input, the formatted body has only the safe set's
    /// tags, balanced, its text escaped, in one piece or split.
    #[test]
    fn matrix_html_from_any_input_is_well_formed_in_every_piece(
        text in prop_oneof![any::<String>(), hostile()],
        limit in 256usize..2048,
    ) {
        let whole = matrix(&text);
        prop_assert!(well_formed(&whole.html, MATRIX_TAGS).is_ok(), "{:?}", whole.html);
        for p in super::pieces(&text, Target::Matrix, Measure::HtmlPlusPlainBytes, limit, usize::MAX) {
            prop_assert!(p.html.len() + p.plain.len() <= limit);
            let tags = well_formed(&p.html, MATRIX_TAGS);
            prop_assert!(tags.is_ok(), "{:?}", tags);
        }
    }
}
