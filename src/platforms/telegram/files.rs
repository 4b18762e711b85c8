//! A Telegram message's photo or document, fetched into the gateway's spool (issue 36):
//! `getFile` for its path, then the file itself, streamed and bounded
//! ([`crate::platforms::spool`]). A photo is the largest of its sizes within
//! `--max-attachment-bytes`. The Bot API serves files up to 20 MB; a larger one (or one past
//! a bound, or a failed download) reaches the agent named, with `skipped` saying why, and
//! is never fetched again.

use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

use super::CALL_TIMEOUT;
use super::api::{ApiError, BotApi, HttpBotApi};
use super::update::Update;
use crate::platforms::lenient::Lenient;
use crate::platforms::spool::{self, Offered};
use crate::{Attachment, AttachmentLimits};

/// How long one file's download may take.
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(300);

/// One size of a photo.
#[derive(Debug, Deserialize)]
pub(super) struct PhotoSize {
    file_id: String,
    #[serde(default)]
    file_size: Lenient<u64>,
    #[serde(default)]
    width: Lenient<u64>,
    #[serde(default)]
    height: Lenient<u64>,
}

/// A document (any file sent as one).
#[derive(Debug, Deserialize)]
pub(super) struct Document {
    file_id: String,
    #[serde(default)]
    file_name: Lenient<String>,
    #[serde(default)]
    mime_type: Lenient<String>,
    #[serde(default)]
    file_size: Lenient<u64>,
}

/// A file of the message: what to fetch (`None`: nothing fits), and what the entry says.
pub(super) struct Wanted {
    file_id: Option<String>,
    offered: Offered,
}

/// The files `update` carries: its photo (the largest size within the bound) and its
/// document.
pub(super) fn wanted(update: &Update, limits: &AttachmentLimits) -> Vec<Wanted> {
    let Some(m) = update.message.get() else {
        return Vec::new();
    };
    let mut files = Vec::new();
    if let Some(sizes) = m.photo.get().filter(|s| !s.is_empty()) {
        files.push(largest_photo(sizes, limits.max_file_bytes));
    }
    if let Some(d) = m.document.get() {
        files.push(Wanted {
            file_id: Some(d.file_id.clone()),
            offered: Offered {
                name: spool::clean_name(d.file_name.text().unwrap_or("document")),
                mime: d.mime_type.text().unwrap_or("").to_owned(),
                size: d.file_size.get().copied(),
            },
        });
    }
    files
}

fn largest_photo(sizes: &[PhotoSize], max: u64) -> Wanted {
    let area = |p: &PhotoSize| {
        let (w, h) = (p.width.get().copied(), p.height.get().copied());
        w.unwrap_or(0).saturating_mul(h.unwrap_or(0))
    };
    // Sizes without a file_size are taken to fit: the download's own bound still holds.
    let fits = |p: &&PhotoSize| p.file_size.get().is_none_or(|s| *s <= max);
    let best = sizes.iter().filter(fits).max_by_key(|p| area(p));
    let smallest = sizes.iter().min_by_key(|p| area(p));
    let chosen = best.or(smallest);
    Wanted {
        file_id: best.map(|p| p.file_id.clone()),
        offered: Offered {
            name: "photo.jpg".into(),
            mime: "image/jpeg".into(),
            size: chosen.and_then(|p| p.file_size.get().copied()),
        },
    }
}

/// Fetches `files` (of message `id`, `tg-<update>-<message>`) into the spool: one entry
/// each, with a path or saying why not. Past `--max-attachments` the rest are named only.
pub(super) fn fetch(
    api: &mut HttpBotApi,
    limits: &AttachmentLimits,
    id: &str,
    files: Vec<Wanted>,
) -> Vec<Attachment> {
    files
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            if i >= limits.max_files {
                return w
                    .offered
                    .skipped(format!("more than --max-attachments {}", limits.max_files));
            }
            let Some(file_id) = &w.file_id else {
                return w.offered.skipped(format!(
                    "larger than --max-attachment-bytes {}",
                    limits.max_file_bytes
                ));
            };
            if let Some(why) = w.offered.refused(limits) {
                return w.offered.skipped(why);
            }
            let name = format!("{id}-{i}{}", extension(&w.offered.name));
            match download(api, limits, file_id, &w.offered, &name) {
                Ok(entry) => entry,
                Err(e) => w.offered.skipped(format!("download failed: {e}")),
            }
        })
        .collect()
}

/// `getFile`, then the file streamed into the spool as `name`.
fn download(
    api: &mut HttpBotApi,
    limits: &AttachmentLimits,
    file_id: &str,
    offered: &Offered,
    name: &str,
) -> Result<Attachment, ApiError> {
    let file = api.call("getFile", &json!({"file_id": file_id}), CALL_TIMEOUT)?;
    let Some(path) = file.get("file_path").and_then(|p| p.as_str()) else {
        return Err(ApiError::Permanent(
            "getFile: no file_path (the file is not available)".into(),
        ));
    };
    // The size getFile reports may be the first one known.
    let offered = Offered {
        size: file
            .get("file_size")
            .and_then(serde_json::Value::as_u64)
            .or(offered.size),
        ..offered.clone()
    };
    if let Some(why) = offered.refused(limits) {
        return Ok(offered.skipped(why));
    }
    let mut body = api.download(path, DOWNLOAD_TIMEOUT)?;
    Ok(spool::store(limits, &offered, name, &mut body))
}

/// `.ext` of a file name when it is short and plain (agents and tools go by it), else none.
fn extension(name: &str) -> String {
    match name.rsplit_once('.') {
        Some((_, ext))
            if !ext.is_empty()
                && ext.len() <= 8
                && ext.bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            format!(".{}", ext.to_ascii_lowercase())
        }
        _ => String::new(),
    }
}

/// What the sender is told, once, of the files that did not reach the agent.
pub(super) fn notice(entries: &[Attachment]) -> Option<String> {
    let lines: Vec<String> = entries
        .iter()
        .filter_map(|a| Some(format!("{}: {}", a.name, a.skipped.as_deref()?)))
        .collect();
    (!lines.is_empty()).then(|| format!("[file(s) not passed on: {}]", lines.join("; ")))
}
