//! A message's attachments as the model receives them: images as `image_url` parts (data
//! URLs, with [`OpenAiConfig::vision`]), text files inlined up to
//! [`OpenAiConfig::inline_text_bytes`], every other file named in the text.
//!
//! The files are read here, on the turn's worker (never on the reactor), each read bounded
//! by what it may still add: a file that grew past its entry's size is cut, not read whole.
//! What the history keeps of a turn is its text alone: an image stays there as its
//! placeholder (`[image: NAME]`), never as its bytes; an inlined text file stays as the text
//! the model saw, within the history's own bounds.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::Path;

use base64::engine::general_purpose::STANDARD;
use base64::write::EncoderStringWriter;
use serde::Serialize;

use super::config::OpenAiConfig;
use crate::Attachment;

/// The user's message as sent: its text (the message, then a line or a block per file:
/// what the history keeps) and the images beside it, as data URLs.
#[derive(Debug, Default)]
pub(super) struct UserTurn {
    pub(super) text: String,
    images: Vec<String>,
    /// What went wrong reading the files (for the log; the model is told in the text).
    pub(super) problems: Vec<String>,
}

/// A message's `content`: a string, or parts when images go with it.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum Content<'a> {
    Text(&'a str),
    Parts(Vec<Part<'a>>),
}

/// One part of a message with images.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum Part<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: ImageUrl<'a> },
}

#[derive(Serialize)]
pub(super) struct ImageUrl<'a> {
    url: &'a str,
}

impl UserTurn {
    /// The message's `content`: its text alone, or a text part then one part per image.
    pub(super) fn content(&self) -> Content<'_> {
        if self.images.is_empty() {
            return Content::Text(&self.text);
        }
        let images = self.images.iter().map(|url| Part::ImageUrl {
            image_url: ImageUrl { url },
        });
        Content::Parts(
            std::iter::once(Part::Text { text: &self.text })
                .chain(images)
                .collect(),
        )
    }

    /// Bytes of image data (base64) this message carries.
    pub(super) fn image_bytes(&self) -> usize {
        self.images.iter().map(String::len).sum()
    }
}

/// `text` followed by what the model gets of each of `files`, within `cfg`'s bounds.
pub(super) fn user_turn(text: String, files: &[Attachment], cfg: &OpenAiConfig) -> UserTurn {
    let mut turn = UserTurn {
        text,
        ..UserTurn::default()
    };
    let mut image_budget = cfg.max_image_bytes;
    let mut text_budget = cfg.inline_text_bytes as u64;
    for file in files {
        let block = match (&file.path, kind_of(file)) {
            (None, _) => named(file, Some(&format!("not received: {}", skipped(file)))),
            (Some(path), Kind::Image) if cfg.vision => {
                match read_image(Path::new(path), image_budget) {
                    Ok(Image::Sent(url, bytes)) => {
                        image_budget -= bytes;
                        turn.images.push(url);
                        placeholder(&file.name)
                    }
                    Ok(Image::OverBudget) => named(
                        file,
                        Some(&format!(
                            "not sent: the message's images would pass {} bytes",
                            cfg.max_image_bytes
                        )),
                    ),
                    Ok(Image::Unrecognized) => {
                        named(file, Some("not sent: not a PNG, JPEG, GIF or WebP image"))
                    }
                    Err(e) => unreadable(&mut turn.problems, file, &e),
                }
            }
            (Some(_), Kind::Text) if text_budget == 0 => named(
                file,
                Some(&format!(
                    "not inlined: the message's {} bytes of inlined text are used",
                    cfg.inline_text_bytes
                )),
            ),
            (Some(path), Kind::Text) => match read_text(Path::new(path), text_budget) {
                Ok(Some(inlined)) => {
                    text_budget -= inlined.shown;
                    inline(file, &inlined)
                }
                Ok(None) => named(file, Some("not inlined: not UTF-8 text")),
                Err(e) => unreadable(&mut turn.problems, file, &e),
            },
            (Some(_), _) => named(file, None),
        };
        if !turn.text.is_empty() {
            turn.text.push_str("\n\n");
        }
        turn.text.push_str(&block);
    }
    turn
}

/// What a file is to the model.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Image,
    Text,
    Other,
}

/// The kind of a file: by its media type, or by its name's extension when the type says
/// nothing (`turnstile send --attach` gives none). An image's first bytes and a text's UTF-8
/// are checked when it is read, so a wrong guess is named, never sent as what it is not.
fn kind_of(file: &Attachment) -> Kind {
    let mime = file.mime.trim();
    if !(mime.is_empty() || mime.eq_ignore_ascii_case("application/octet-stream")) {
        return kind(mime);
    }
    let ext = file
        .name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "png" | "jpg" | "jpeg" | "gif" | "webp" => Kind::Image,
        "txt" | "md" | "csv" | "tsv" | "log" | "json" | "jsonl" | "xml" | "yaml" | "yml"
        | "toml" | "ini" | "html" | "css" | "js" | "ts" | "py" | "rs" | "go" | "c" | "h"
        | "cpp" | "java" | "sh" | "sql" | "diff" | "patch" => Kind::Text,
        _ => Kind::Other,
    }
}

/// The kind of a media type (`type/subtype`, parameters and case ignored).
fn kind(mime: &str) -> Kind {
    let essence = mime.split(';').next().unwrap_or_default().trim();
    let essence = essence.to_ascii_lowercase();
    match essence.as_str() {
        "image/png" | "image/jpeg" | "image/jpg" | "image/gif" | "image/webp" => Kind::Image,
        "application/json"
        | "application/xml"
        | "application/yaml"
        | "application/x-yaml"
        | "application/toml"
        | "application/javascript"
        | "application/x-sh"
        | "application/sql" => Kind::Text,
        m if m.starts_with("text/") || m.ends_with("+json") || m.ends_with("+xml") => Kind::Text,
        _ => Kind::Other,
    }
}

/// An image's line in the text: what the history keeps of it.
fn placeholder(name: &str) -> String {
    format!("[image: {name}]")
}

/// A file named, not sent: `[attached: NAME, MIME, SIZE bytes]`, with why when there is a
/// reason beyond its kind.
fn named(file: &Attachment, why: Option<&str>) -> String {
    let mime = shown_mime(file);
    match why {
        None => format!("[attached: {}, {mime}, {} bytes]", file.name, file.size),
        Some(why) => format!(
            "[attached: {}, {mime}, {} bytes; {why}]",
            file.name, file.size
        ),
    }
}

/// The file's media type as the model reads it.
fn shown_mime(file: &Attachment) -> &str {
    if file.mime.is_empty() {
        "unknown type"
    } else {
        &file.mime
    }
}

fn skipped(file: &Attachment) -> &str {
    file.skipped.as_deref().unwrap_or("no file")
}

/// A file the spool should hold but that cannot be read: named, and the problem kept for
/// the log.
fn unreadable(problems: &mut Vec<String>, file: &Attachment, e: &io::Error) -> String {
    problems.push(format!("{:?} cannot be read: {e}", file.name));
    named(file, Some("not sent: it cannot be read"))
}

/// An inlined text file's block.
fn inline(file: &Attachment, t: &Inlined) -> String {
    let end = if t.shown < t.size {
        format!(
            "[end of {}: cut, the first {} of {} bytes shown]",
            file.name, t.shown, t.size
        )
    } else {
        format!("[end of {}]", file.name)
    };
    format!(
        "[file: {}, {}, {} bytes]\n{}\n{end}",
        file.name,
        shown_mime(file),
        t.size,
        t.text
    )
}

/// An image as read.
enum Image {
    /// Its data URL, and its size in bytes.
    Sent(String, u64),
    /// Larger than what the message's images may still add.
    OverBudget,
    /// Its first bytes are not those of a PNG, JPEG, GIF or WebP file.
    Unrecognized,
}

/// The image at `path` as a data URL of the type its first bytes show, if it is at most
/// `budget` bytes.
fn read_image(path: &Path, budget: u64) -> io::Result<Image> {
    let mut file = File::open(path)?;
    let size = file.metadata()?.len();
    if size > budget {
        return Ok(Image::OverBudget);
    }
    let mut head = [0u8; 12];
    let n = read_up_to(&mut file, &mut head)?;
    let Some(mime) = sniff(&head[..n]) else {
        return Ok(Image::Unrecognized);
    };
    let mut url = String::with_capacity(32 + (size as usize).div_ceil(3) * 4);
    url.push_str("data:");
    url.push_str(mime);
    url.push_str(";base64,");
    let mut encoder = EncoderStringWriter::from_consumer(&mut url, &STANDARD);
    encoder.write_all(&head[..n])?;
    // A file that grew since its size was read is read no further than the budget allows.
    let rest = io::copy(
        &mut (&mut file).take(budget.saturating_sub(n as u64) + 1),
        &mut encoder,
    )?;
    encoder.into_inner();
    let read = n as u64 + rest;
    if read > budget {
        return Ok(Image::OverBudget);
    }
    Ok(Image::Sent(url, read))
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The image type `head` (a file's first 12 bytes) starts like.
fn sniff(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if head.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if head.len() >= 12 && head.starts_with(b"RIFF") && &head[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// A text file as inlined.
#[derive(Debug)]
struct Inlined {
    text: String,
    /// Bytes of it shown.
    shown: u64,
    /// Its size.
    size: u64,
}

/// The start of the text file at `path`, at most `budget` bytes of it, cut at a character's
/// boundary; `None` when it is not UTF-8.
fn read_text(path: &Path, budget: u64) -> io::Result<Option<Inlined>> {
    let file = File::open(path)?;
    let size = file.metadata()?.len();
    let mut bytes = Vec::with_capacity(size.min(budget) as usize);
    file.take(budget).read_to_end(&mut bytes)?;
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        // Invalid bytes only where the budget cut a character in two: cut before it.
        Err(e) if e.utf8_error().error_len().is_none() => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).unwrap_or_default()
        }
        Err(_) => return Ok(None),
    };
    let shown = text.len() as u64;
    debug_assert!(shown <= budget, "{shown} > {budget}");
    Ok(Some(Inlined {
        text,
        shown,
        size: size.max(shown),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, mime: &str, path: &Path) -> Attachment {
        Attachment {
            name: name.into(),
            mime: mime.into(),
            size: std::fs::metadata(path).map_or(0, |m| m.len()),
            sha256: None,
            path: Some(path.display().to_string()),
            skipped: None,
        }
    }

    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR-rest";

    #[test]
    fn kinds_follow_the_media_type() {
        assert_eq!(kind("image/PNG"), Kind::Image);
        assert_eq!(kind("text/plain; charset=utf-8"), Kind::Text);
        assert_eq!(kind("application/ld+json"), Kind::Text);
        assert_eq!(kind("application/json"), Kind::Text);
        assert_eq!(kind("image/svg+xml"), Kind::Text);
        assert_eq!(kind("application/pdf"), Kind::Other);
        assert_eq!(kind("image/tiff"), Kind::Other);
        assert_eq!(kind(""), Kind::Other);
        let by_name = |name: &str, mime: &str| {
            kind_of(&Attachment {
                name: name.into(),
                mime: mime.into(),
                size: 0,
                sha256: None,
                path: None,
                skipped: Some("x".into()),
            })
        };
        assert_eq!(by_name("a.PNG", ""), Kind::Image);
        assert_eq!(by_name("notes.md", "application/octet-stream"), Kind::Text);
        assert_eq!(by_name("notes.md", "application/pdf"), Kind::Other);
        assert_eq!(by_name("archive.tar", ""), Kind::Other);
        assert_eq!(by_name("README", ""), Kind::Other);
    }

    #[test]
    fn sniffing_knows_the_four_types() {
        assert_eq!(sniff(PNG), Some("image/png"));
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        assert_eq!(sniff(b"GIF89a.."), Some("image/gif"));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBP"), Some("image/webp"));
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVE"), None);
        assert_eq!(sniff(b"<svg"), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn images_stay_within_the_message_budget_and_are_checked_for_their_type() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.png");
        let b = dir.path().join("b.png");
        let fake = dir.path().join("fake.png");
        std::fs::write(&a, PNG).expect("write");
        std::fs::write(&b, PNG).expect("write");
        std::fs::write(&fake, b"nope").expect("write");
        let mut cfg = OpenAiConfig::new("http://h/v1", "m");
        cfg.vision = true;
        // Room for one of the two.
        cfg.max_image_bytes = PNG.len() as u64 + 5;
        let files = [
            entry("a.png", "image/png", &a),
            entry("b.png", "image/png", &b),
            entry("fake.png", "image/png", &fake),
        ];
        let turn = user_turn("look".into(), &files, &cfg);
        assert_eq!(turn.images.len(), 1);
        assert!(turn.images[0].starts_with("data:image/png;base64,iVBORw0KGgo"));
        let n = PNG.len();
        assert_eq!(
            turn.text,
            format!(
                "look\n\n[image: a.png]\n\n[attached: b.png, image/png, {n} bytes; not sent: the message's images would pass {} bytes]\n\n[attached: fake.png, image/png, 4 bytes; not sent: not a PNG, JPEG, GIF or WebP image]",
                n + 5
            )
        );
        // Exactly at the budget is within it.
        cfg.max_image_bytes = 2 * n as u64;
        assert_eq!(user_turn(String::new(), &files, &cfg).images.len(), 2);
    }

    #[test]
    fn text_is_inlined_within_the_budget_and_cut_at_a_character() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = dir.path().join("t.txt");
        let u = dir.path().join("u.txt");
        let bin = dir.path().join("bin.txt");
        std::fs::write(&t, "héllo").expect("write"); // 6 bytes
        std::fs::write(&u, "second").expect("write");
        std::fs::write(&bin, b"\xff\xfe\0x").expect("write");
        let mut cfg = OpenAiConfig::new("http://h/v1", "m");
        let files = [
            entry("t.txt", "text/plain", &t),
            entry("u.txt", "text/plain", &u),
        ];
        // 2 bytes cut "é" in two: only "h" is shown, and the next file gets the 1 left.
        cfg.inline_text_bytes = 2;
        let turn = user_turn(String::new(), &files, &cfg);
        assert_eq!(
            turn.text,
            "[file: t.txt, text/plain, 6 bytes]\nh\n[end of t.txt: cut, the first 1 of 6 bytes shown]\n\n\
             [file: u.txt, text/plain, 6 bytes]\ns\n[end of u.txt: cut, the first 1 of 6 bytes shown]"
        );
        cfg.inline_text_bytes = 6;
        let turn = user_turn(String::new(), &files, &cfg);
        assert!(
            turn.text
                .starts_with("[file: t.txt, text/plain, 6 bytes]\nhéllo\n[end of t.txt]\n\n")
        );
        assert!(turn.text.ends_with("[attached: u.txt, text/plain, 6 bytes; not inlined: the message's 6 bytes of inlined text are used]"));
        let turn = user_turn(String::new(), &[entry("bin.txt", "text/plain", &bin)], &cfg);
        assert_eq!(
            turn.text,
            "[attached: bin.txt, text/plain, 4 bytes; not inlined: not UTF-8 text]"
        );
    }

    #[test]
    fn missing_and_skipped_files_are_named_with_why() {
        let mut cfg = OpenAiConfig::new("http://h/v1", "m");
        cfg.vision = true;
        let gone = Attachment {
            name: "gone.png".into(),
            mime: "image/png".into(),
            size: 9,
            sha256: None,
            path: Some("/nonexistent/gone.png".into()),
            skipped: None,
        };
        let skipped = Attachment {
            name: "big.bin".into(),
            mime: String::new(),
            size: 1 << 30,
            sha256: None,
            path: None,
            skipped: Some("larger than 20971520 bytes".into()),
        };
        let turn = user_turn("x".into(), &[gone, skipped], &cfg);
        assert_eq!(
            turn.text,
            "x\n\n[attached: gone.png, image/png, 9 bytes; not sent: it cannot be read]\n\n\
             [attached: big.bin, unknown type, 1073741824 bytes; not received: larger than 20971520 bytes]"
        );
        assert_eq!(
            turn.problems,
            ["\"gone.png\" cannot be read: No such file or directory (os error 2)"]
        );
        assert!(turn.images.is_empty());
    }
}
