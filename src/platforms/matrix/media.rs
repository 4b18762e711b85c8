//! A Matrix message's file (`m.image`, `m.file`, `m.audio`, `m.video`) fetched into the
//! gateway's spool (issue 36): through the authenticated media API with the bot's token
//! ([`Api::download`]), streamed and bounded ([`crate::platforms::spool`]). A file past a
//! bound, or one that cannot be fetched (a malformed key, a hash that does not match, a
//! failed download), reaches the agent named, with `skipped` saying why, and is never
//! fetched again. An encrypted room's file is decrypted as it streams
//! ([`super::encrypted_file`]).

use serde::Deserialize;

use super::answer::Content;
use super::api::Api;
use super::encrypted_file::{Decrypting, Sealed};
use crate::platforms::lenient::Lenient;
use crate::platforms::spool::{self, Offered};
use crate::{Attachment, AttachmentLimits};

/// The message types that carry a file.
const FILE_TYPES: [&str; 4] = ["m.image", "m.file", "m.audio", "m.video"];

/// `info` of a file message: what the sender's client said of the file.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct MediaInfo {
    #[serde(default)]
    mimetype: Lenient<String>,
    #[serde(default)]
    size: Lenient<u64>,
}

/// A file a message carries, before it is fetched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Media {
    /// `mxc://server/id` (an encrypted room's file's is in `content.file`).
    url: Option<String>,
    /// An encrypted room's file: what decrypts it.
    encrypted: Option<Sealed>,
    offered: Offered,
    /// Its entry once fetched (with a path, or saying why not).
    pub(super) fetched: Option<Attachment>,
}

/// The file of a message of type `msgtype`, if it carries one.
pub(super) fn of(msgtype: &str, content: &Content) -> Option<Media> {
    if !FILE_TYPES.contains(&msgtype) {
        return None;
    }
    let info = content.info.get();
    let name = content
        .filename
        .text()
        .or(content.body.text())
        .unwrap_or("file");
    let file = content.file.get();
    let url = content.url.text().or_else(|| file.and_then(|f| f.url()));
    let encrypted = file.map(|f| f.sealed());
    Some(Media {
        url: url.map(str::to_owned),
        encrypted,
        offered: Offered {
            name: spool::clean_name(name),
            mime: info
                .and_then(|i| i.mimetype.text())
                .unwrap_or("")
                .to_owned(),
            size: info.and_then(|i| i.size.get().copied()),
        },
        fetched: None,
    })
}

/// Fetches `media` of the event `event_id` into the spool: its entry, with a path or
/// saying why not (kept in `media.fetched` too).
pub(super) fn fetch_into(
    api: &Api,
    limits: &AttachmentLimits,
    event_id: &str,
    media: &mut Media,
) -> Attachment {
    let entry = fetch(api, limits, event_id, media);
    media.fetched = Some(entry.clone());
    entry
}

fn fetch(api: &Api, limits: &AttachmentLimits, event_id: &str, media: &Media) -> Attachment {
    let offered = &media.offered;
    let Some((server, id)) = media.url.as_deref().and_then(mxc) else {
        return offered.skipped("a malformed file URL: not fetched".into());
    };
    let key = match &media.encrypted {
        None => None,
        Some(Sealed::Key(key)) => Some(key),
        Some(Sealed::Malformed) => {
            return offered.skipped("an encrypted file with a malformed key".into());
        }
    };
    if let Some(why) = offered.refused(limits) {
        return offered.skipped(why);
    }
    let name = spool_name(event_id);
    match (api.download(server, id), key) {
        (Ok(mut body), None) => spool::store(limits, offered, &name, &mut body),
        (Ok(body), Some(key)) => {
            spool::store(limits, offered, &name, &mut Decrypting::new(body, key))
        }
        (Err(e), _) => offered.skipped(format!("download failed: {e}")),
    }
}

/// `mxc://server/id` → (server, id).
fn mxc(url: &str) -> Option<(&str, &str)> {
    let (server, id) = url.strip_prefix("mxc://")?.split_once('/')?;
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:[]".contains(&b))
    };
    (plain(server) && plain(id)).then_some((server, id))
}

/// The spool file of an event: its id made a plain file name (an event id is `$` and
/// base64, which may hold `/` and `+`).
fn spool_name(event_id: &str) -> String {
    let plain: String = event_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(120)
        .collect();
    format!("mx-{plain}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_mxc_urls_are_fetched_and_spool_names_are_one_component() {
        assert_eq!(
            mxc("mxc://hs.example/AbC_12"),
            Some(("hs.example", "AbC_12"))
        );
        for bad in [
            "https://x/y",
            "mxc://hs/../etc",
            "mxc://hs/a/b",
            "mxc:///x",
            "mxc://hs/",
        ] {
            assert_eq!(mxc(bad), None, "{bad}");
        }
        let name = spool_name("$a/b+c=:hs");
        assert_eq!(name, "mx-_a_b_c__hs");
    }
}
