//! Files in replies on Matrix (issue 36), a part of the engine (mounted into
//! `engine.rs`): once a result's text is shown, each file the agent attached is uploaded
//! (`POST /_matrix/media/v3/upload`) and posted as an `m.image` (an `image/*` type) or an
//! `m.file` event, in the message's thread if it has one; only then is the result confirmed
//! `delivered`. A file that cannot be sent (refused, or failing [`MAX_UPLOAD_TRIES`] times, or
//! an encrypted room, whose files are not uploaded in the clear) is told in the room in a line
//! of its own, never retried forever.

use serde_json::{Value, json};

use super::{GatewaySide, Homeserver, Post, SyncEngine};
use crate::Attachment;
use crate::attachments::human_size;
use crate::platforms::markdown::Piece;
use crate::platforms::matrix::api::ApiError;
use crate::platforms::matrix::threads::put_in_thread;

/// Tries of one file that failed for a reason that may pass (no answer, a 5xx, a rate
/// limit) before the room is told it could not be sent.
pub(crate) const MAX_UPLOAD_TRIES: u32 = 5;

/// A post's files and how far their sending got.
#[derive(Debug, Default)]
pub(super) struct PostFiles {
    files: Vec<Attachment>,
    /// The next file to send.
    next: usize,
    /// Its failed tries so far.
    tries: u32,
    /// Its `mxc://` URI once uploaded (a retry then only posts the event).
    uploaded: Option<String>,
}

impl PostFiles {
    pub(super) fn new(files: &[Attachment]) -> PostFiles {
        PostFiles {
            files: files.to_vec(),
            ..PostFiles::default()
        }
    }

    /// Every file is sent or given up.
    pub(super) fn done(&self) -> bool {
        self.next >= self.files.len()
    }

    fn advance(&mut self) {
        self.next += 1;
        self.tries = 0;
        self.uploaded = None;
    }
}

/// The event showing an uploaded file: `m.image` for an image, else `m.file`, in `thread`
/// (its root) when there is one.
pub(super) fn file_content(file: &Attachment, mxc: &str, thread: Option<&str>) -> Value {
    let msgtype = if file.mime.starts_with("image/") {
        "m.image"
    } else {
        "m.file"
    };
    let mut info = json!({"size": file.size});
    if !file.mime.is_empty() {
        info["mimetype"] = json!(file.mime);
    }
    let mut c = json!({
        "msgtype": msgtype,
        "body": file.name,
        "filename": file.name,
        "url": mxc,
        "info": info,
        "m.mentions": {},
    });
    if let Some(root) = thread {
        put_in_thread(&mut c, root, None);
    }
    c
}

impl<H: Homeserver> SyncEngine<H> {
    /// The text of `post` is shown: its next file goes (one upload and one event per step),
    /// or, with none left, the post is done.
    pub(super) fn send_file(
        &mut self,
        mut post: Post,
        now: std::time::Instant,
        gw: &mut impl GatewaySide,
    ) -> Result<(), ApiError> {
        let Some(file) = post.files.files.get(post.files.next).cloned() else {
            self.finish(&post, gw);
            return Ok(());
        };
        let mxc = match post.files.uploaded.clone() {
            Some(mxc) => mxc,
            None => match self.hs.upload(&post.room, &file) {
                Ok(Some(mxc)) => mxc,
                Ok(None) => {
                    let why = "an encrypted room: files are not uploaded unencrypted";
                    return self.file_given_up(post, &file, why, gw);
                }
                Err(e) => return self.file_failed(post, &file, &e, now, gw),
            },
        };
        post.files.uploaded = Some(mxc.clone());
        let txn = format!("{}-f{}", post.txn, post.files.next);
        let content = file_content(&file, &mxc, post.thread.as_deref());
        match self.hs.send(&post.room, &txn, &content) {
            Ok(_) => {
                self.backoff = std::time::Duration::ZERO;
                self.stats.messages += 1;
                debug_redacted!("matrix: room {}: file {} posted", post.room, file.name);
                post.files.advance();
                self.continue_post(post, gw);
                Ok(())
            }
            Err(e) => self.file_failed(post, &file, &e, now, gw),
        }
    }

    /// An upload or its event failed: tried again later while it may pass (up to
    /// [`MAX_UPLOAD_TRIES`]), else given up and told.
    fn file_failed(
        &mut self,
        mut post: Post,
        file: &Attachment,
        e: &ApiError,
        now: std::time::Instant,
        gw: &mut impl GatewaySide,
    ) -> Result<(), ApiError> {
        self.failed(&post.room, e, now)?;
        post.files.tries += 1;
        if e.is_transient() && post.files.tries < MAX_UPLOAD_TRIES {
            let room = post.room.clone();
            self.queue.requeue_urgent(&room, post);
            return Ok(());
        }
        warn_limited!(
            "matrix: room {}: file {} of the result of {} could not be sent: {e}; the room is told",
            post.room,
            file.name,
            post.id.as_deref().unwrap_or("a notice")
        );
        let why = if e.is_transient() {
            format!("failed {MAX_UPLOAD_TRIES} times: {e}")
        } else {
            e.to_string()
        };
        self.file_given_up(post, file, &why, gw)
    }

    /// A file that will not be sent: the room gets a line saying so (the post's next piece),
    /// and the post goes on with its next file.
    fn file_given_up(
        &mut self,
        mut post: Post,
        file: &Attachment,
        why: &str,
        gw: &mut impl GatewaySide,
    ) -> Result<(), ApiError> {
        let plain = format!(
            "(file not sent: {}, {}: {why})",
            file.name,
            human_size(file.size)
        );
        post.chunks.push(Piece {
            html: String::new(),
            plain,
        });
        post.files.advance();
        self.continue_post(post, gw);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(mime: &str) -> Attachment {
        Attachment {
            name: "cat.png".into(),
            mime: mime.into(),
            size: 3,
            sha256: None,
            path: Some("/spool/x".into()),
            skipped: None,
        }
    }

    /// An image is an `m.image`, anything else an `m.file`; in a thread the event is in it.
    #[test]
    fn an_image_is_an_m_image_and_a_thread_keeps_it() {
        let c = file_content(&file("image/png"), "mxc://hs/abc", None);
        assert_eq!(
            c,
            json!({"msgtype": "m.image", "body": "cat.png", "filename": "cat.png",
                "url": "mxc://hs/abc", "info": {"size": 3, "mimetype": "image/png"},
                "m.mentions": {}})
        );
        let c = file_content(&file("application/pdf"), "mxc://hs/abc", Some("$root"));
        assert_eq!(c["msgtype"], "m.file");
        assert_eq!(c["m.relates_to"]["rel_type"], "m.thread");
        assert_eq!(c["m.relates_to"]["event_id"], "$root");
    }
}
