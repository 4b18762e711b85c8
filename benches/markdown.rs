//! What rendering one reply costs a bridge: a 4 KB Markdown reply (a paragraph with
//! emphasis, code and a link, a list, a quote, a fenced code block) parsed, rendered and cut
//! into pieces for Matrix (HTML and body, 16,000 bytes a piece), Telegram (HTML, 4,096
//! UTF-16 units) and IRC (plain text). One JSON line per figure.
//! `cargo bench --bench markdown [-- --n N]`.

use std::hint::black_box;
use std::time::Instant;

use turnstile::internal::markdown::{Measure, Target, pieces, plain, telegram};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A reply of about 4 KB, shaped like a model's.
fn reply() -> String {
    let mut text = String::from(
        "# Answer\n\nThe **short** version: call `render()` once per piece, see \
         [the docs](https://example.org/docs?a=1&b=2) for *why*.\n\n\
         - first point, with `code`\n- second point\n  1. nested\n  2. items\n\n\
         > a quoted line, with <html> & entities\n\n```rust\n",
    );
    let mut n = 0;
    while text.len() < 3900 {
        text.push_str(&format!("let value_{n} = compute({n}) * 2; // step {n}\n"));
        n += 1;
    }
    text.push_str("```\n\nThat is all.");
    text
}

fn report(what: &str, n: u32, bytes: usize, start: Instant) {
    let per = start.elapsed() / n;
    println!(
        "{{\"bench\": \"markdown\", \"what\": \"{what}\", \"reply_bytes\": {bytes}, \"n\": {n}, \"us_per_reply\": {:.1}}}",
        per.as_secs_f64() * 1e6
    );
}

fn main() {
    let n: u32 = arg("--n")
        .and_then(|s| s.parse().ok())
        .unwrap_or(5_000)
        .max(1);
    let text = reply();
    let start = Instant::now();
    for _ in 0..n {
        black_box(pieces(
            black_box(&text),
            Target::Matrix,
            Measure::HtmlPlusPlainBytes,
            16_000,
            usize::MAX,
        ));
    }
    report(
        "matrix html + body, cut at 16000 bytes",
        n,
        text.len(),
        start,
    );
    let start = Instant::now();
    for _ in 0..n {
        black_box(telegram(black_box(&text)));
    }
    report(
        "telegram html, cut at 4096 utf-16 units",
        n,
        text.len(),
        start,
    );
    let start = Instant::now();
    for _ in 0..n {
        black_box(plain(black_box(&text)));
    }
    report("irc plain text", n, text.len(), start);
}
