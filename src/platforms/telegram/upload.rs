//! Files in replies (issue 36): which Bot API call sends a spool file (`sendPhoto` for an
//! image within the photo limit, else `sendDocument`), the published limits those calls
//! have for bots, and the `multipart/form-data` body that streams the file from the disk.

use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read};

use serde_json::Value;

use crate::Attachment;
use crate::attachments::human_size;

/// `sendPhoto`'s limit for bots: 10 MB (core.telegram.org/bots/api#sendphoto).
pub(crate) const PHOTO_LIMIT: u64 = 10 * 1000 * 1000;
/// The limit of every other upload by a bot: 50 MB (core.telegram.org/bots/api#sending-files).
pub(crate) const DOCUMENT_LIMIT: u64 = 50 * 1000 * 1000;
/// How long one upload may take (50 MB over a slow link).
pub(crate) const UPLOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);
/// Tries of one file that failed for a reason that may pass (network, 5xx, 429) before the
/// chat is told it could not be sent: an upload is never retried forever.
pub(crate) const MAX_UPLOAD_TRIES: u32 = 5;

/// The image types `sendPhoto` takes (others go as documents).
const PHOTO_TYPES: [&str; 4] = ["image/jpeg", "image/png", "image/gif", "image/webp"];

/// A reply's file waiting to be sent.
#[derive(Debug, Clone)]
pub(super) struct Outgoing {
    pub file: Attachment,
    /// Failed tries so far.
    pub tries: u32,
    /// `sendPhoto` refused it for good (its dimensions, say): sent as a document instead.
    pub as_document: bool,
}

impl Outgoing {
    pub(super) fn new(file: Attachment) -> Outgoing {
        Outgoing {
            file,
            tries: 0,
            as_document: false,
        }
    }

    /// The call and its file field, or why the file cannot be sent at all.
    pub(super) fn method(&self) -> Result<(&'static str, &'static str), String> {
        let f = &self.file;
        if f.path.is_none() {
            return Err("no file in the gateway's spool".into());
        }
        if !self.as_document && f.size <= PHOTO_LIMIT && PHOTO_TYPES.contains(&f.mime.as_str()) {
            return Ok(("sendPhoto", "photo"));
        }
        if f.size > DOCUMENT_LIMIT {
            return Err(format!(
                "larger than Telegram's {} MB limit for bots",
                DOCUMENT_LIMIT / 1_000_000
            ));
        }
        Ok(("sendDocument", "document"))
    }
}

/// The line the chat gets for a file that could not be sent.
pub(super) fn not_sent(file: &Attachment, why: &str) -> String {
    format!(
        "(file not sent: {}, {}: {why})",
        file.name,
        human_size(file.size)
    )
}

/// A `multipart/form-data` body: the parameters as fields, then the file, streamed.
pub(crate) struct Multipart {
    boundary: String,
    /// Bytes in all (the request's Content-Length).
    pub length: u64,
    /// The body, read as it is sent.
    pub body: Box<dyn Read + Send>,
}

impl Multipart {
    /// The body sending `params` and the spool file of `file` as field `field`.
    pub(crate) fn open(params: &Value, field: &str, file: &Attachment) -> io::Result<Multipart> {
        let path = file
            .path
            .as_deref()
            .ok_or_else(|| io::Error::other("no path"))?;
        let data = File::open(path)?;
        let size = data.metadata()?.len();
        let boundary = format!("turnstile-{:016x}{:016x}", random(), random());
        let mut head = String::new();
        if let Some(fields) = params.as_object() {
            for (name, value) in fields {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                head.push_str(&format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{text}\r\n"
                ));
            }
        }
        let mime = if file.mime.is_empty() {
            "application/octet-stream"
        } else {
            &file.mime
        };
        head.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{}\"\r\nContent-Type: {}\r\n\r\n",
            quoted(&file.name),
            quoted(mime)
        ));
        let tail = format!("\r\n--{boundary}--\r\n");
        let length = head.len() as u64 + size + tail.len() as u64;
        let body = io::Cursor::new(head.into_bytes())
            .chain(data.take(size))
            .chain(io::Cursor::new(tail.into_bytes()));
        Ok(Multipart {
            boundary,
            length,
            body: Box::new(body),
        })
    }

    /// The request's Content-Type.
    pub(crate) fn content_type(&self) -> String {
        format!("multipart/form-data; boundary={}", self.boundary)
    }
}

/// `text` fit for a quoted header parameter: no quotes, backslashes or control characters.
fn quoted(text: &str) -> String {
    text.chars()
        .filter(|c| !c.is_control())
        .map(|c| if c == '"' || c == '\\' { '\'' } else { c })
        .collect()
}

/// 64 random bits (the standard library's randomly seeded hasher): a boundary no file
/// can be made to contain in advance.
fn random() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(mime: &str, size: u64) -> Outgoing {
        Outgoing::new(Attachment {
            name: "a".into(),
            mime: mime.into(),
            size,
            sha256: None,
            path: Some("/spool/a".into()),
            skipped: None,
        })
    }

    /// The published limits pick the call: a photo up to 10 MB, a document up to 50 MB,
    /// nothing past that (the chat is told).
    #[test]
    fn the_call_follows_the_type_and_the_published_limits() {
        assert_eq!(
            file("image/png", PHOTO_LIMIT).method(),
            Ok(("sendPhoto", "photo"))
        );
        assert_eq!(
            file("image/png", PHOTO_LIMIT + 1).method(),
            Ok(("sendDocument", "document"))
        );
        assert_eq!(
            file("image/svg+xml", 10).method(),
            Ok(("sendDocument", "document"))
        );
        assert_eq!(
            file("text/plain", DOCUMENT_LIMIT).method(),
            Ok(("sendDocument", "document"))
        );
        let over = file("text/plain", DOCUMENT_LIMIT + 1).method();
        assert_eq!(
            over,
            Err("larger than Telegram's 50 MB limit for bots".into())
        );
        let mut refused = file("image/png", 10);
        refused.as_document = true;
        assert_eq!(refused.method(), Ok(("sendDocument", "document")));
    }

    #[test]
    fn a_multipart_body_has_the_fields_then_the_file_and_its_length() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("x");
        std::fs::write(&path, b"\x00bytes\r\n--").expect("write");
        let entry = Attachment {
            name: "a \"b\".txt".into(),
            mime: "text/plain".into(),
            size: 10,
            sha256: None,
            path: Some(path.to_string_lossy().into_owned()),
            skipped: None,
        };
        let params = serde_json::json!({"chat_id": 42, "message_thread_id": 7});
        let mut form = Multipart::open(&params, "document", &entry).expect("open");
        let mut body = Vec::new();
        form.body.read_to_end(&mut body).expect("read");
        assert_eq!(body.len() as u64, form.length);
        let text = String::from_utf8_lossy(&body);
        let b = &form.boundary;
        assert!(text.starts_with(&format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"chat_id\"\r\n\r\n42\r\n"
        )));
        assert!(text.contains("name=\"document\"; filename=\"a 'b'.txt\"\r\nContent-Type: text/plain\r\n\r\n\u{0}bytes\r\n--\r\n--"));
        assert!(text.ends_with(&format!("\r\n--{b}--\r\n")));
    }
}
