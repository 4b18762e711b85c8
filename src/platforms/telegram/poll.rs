//! The polling thread: `getUpdates`, each message handed to the gateway, the offset moved
//! (and saved) once the gateway answered it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use serde_json::json;

use super::api::{ApiError, HttpBotApi};
use super::offset::OffsetStore;
use super::update::{MAX_UPDATES, Update, reply_target, update_to_message};
use super::{CALL_TIMEOUT, MAX_BACKOFF, TelegramConfig};
use crate::platforms::gateway::{Admission, Gateway, OutgoingMessage, SendError};

/// How long the poller waits for the gateway's answer before asking again.
const ANSWER_WAIT: Duration = Duration::from_secs(30);

/// What the poller tells the main thread.
pub(super) enum Inbound {
    /// The gateway refused a message: tell the chat.
    Rejected {
        chat_id: String,
        /// The forum topic the message was in.
        topic: Option<i64>,
        reply_to: Option<i64>,
        text: String,
    },
    /// The gateway queued a message behind a running turn: mark it ("I have it").
    Queued { chat_id: String, message_id: i64 },
    /// The poller cannot go on.
    Fatal(String),
}

/// Waits `d` unless `stop` is set first (checked every 100 ms: the poller has no channel to
/// select on while it also blocks in HTTP).
fn pause(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::park_timeout((until - now).min(Duration::from_millis(100)));
    }
}

#[allow(clippy::too_many_arguments)]
/// The update loop: poll, hand each message to the gateway, advance the offset once it was
/// answered, persist it.
pub(super) fn poll_updates(
    config: &TelegramConfig,
    mut api: HttpBotApi,
    gateway: &Gateway,
    store: &OffsetStore,
    mut offset: Option<i64>,
    bot_username: &str,
    stop: &AtomicBool,
    to_main: &Sender<Inbound>,
) {
    let mut backoff = Duration::from_secs(1);
    // The newest update handled: nothing at or below it runs again, even when the offset
    // cannot move past it (an id of 2^63 - 1 has no successor).
    let mut handled: Option<i64> = None;
    while !stop.load(Ordering::SeqCst) {
        let polled = get_updates(config, &mut api, offset, stop, &mut backoff, gateway);
        let updates = match polled {
            Polled::Updates(updates) => updates,
            Polled::Again => continue,
            Polled::Fatal(e) => {
                let _ = to_main.send(Inbound::Fatal(e));
                return;
            }
        };
        let mut news = false;
        for update in &updates {
            let update_id = update.update_id;
            if offset.is_some_and(|o| update_id < o) || handled.is_some_and(|h| update_id <= h) {
                continue;
            }
            news = true;
            if let Some(mut message) = update_to_message(update, bot_username) {
                debug_redacted!("telegram: update {update_id} from chat {}", message.chat_id);
                fetch_files(config, &mut api, update, &mut message, to_main);
                let Some(answer) = wait_for_answer(gateway, &message, update_id, stop) else {
                    return;
                };
                tell_rejection(&answer, &message, update_id, to_main);
                tell_queued(&answer, &message, to_main);
            } else {
                debug_redacted!(
                    "telegram: update {update_id} is not a text message to handle; skipped"
                );
            }
            handled = Some(update_id);
            let Some(next) = update_id.checked_add(1) else {
                warn_limited!(
                    "telegram: update id {update_id} has no successor; the offset stays below it"
                );
                continue;
            };
            offset = Some(next);
            if let Err(e) = store.save(next) {
                // The gateway's duplicate window still keeps a restart from running it twice
                // within its window.
                error_limited!("telegram: {e}");
            }
        }
        if !updates.is_empty() && !news {
            // Only updates already handled (an offset that cannot move past them): asking
            // again at once would spin.
            pause(stop, Duration::from_secs(1));
        }
    }
}

/// What one `getUpdates` gave.
enum Polled {
    /// The well-formed updates kept (possibly none).
    Updates(Vec<Update>),
    /// A failure waited out (or a stop): poll again.
    Again,
    /// The token was refused: the bridge cannot go on.
    Fatal(String),
}

/// One long poll from `offset`; a failure is waited out here (the rate limit's wait, or
/// `backoff`, which doubles).
fn get_updates(
    config: &TelegramConfig,
    api: &mut HttpBotApi,
    offset: Option<i64>,
    stop: &AtomicBool,
    backoff: &mut Duration,
    gateway: &Gateway,
) -> Polled {
    let mut params = json!({
        "timeout": config.poll_timeout.as_secs(),
        "allowed_updates": ["message"],
    });
    if let Some(o) = offset {
        params["offset"] = json!(o);
    }
    match api.get_updates(&params, config.poll_timeout + CALL_TIMEOUT) {
        Ok(u) if !u.not_a_list => {
            *backoff = Duration::from_secs(1);
            if u.dropped() > 0 {
                // One line per answer, however many updates it held.
                warn_limited!(
                    "telegram: getUpdates answered {} malformed update(s) and {} past the first {MAX_UPDATES}; skipped",
                    u.malformed,
                    u.over
                );
            }
            gateway.link(true, None);
            return Polled::Updates(u.items);
        }
        Ok(_) => {
            warn_limited!("telegram: getUpdates answered something that is not a list");
        }
        Err(ApiError::RetryAfter(d)) => {
            warn_limited!("telegram: getUpdates rate limited; waiting {d:?}");
            pause(stop, d);
            return Polled::Again;
        }
        Err(ApiError::Unauthorized(d)) => {
            return Polled::Fatal(format!("the Bot API refused the bot token: {d}"));
        }
        Err(e) => {
            warn_limited!("telegram: getUpdates failed: {e}; retrying in {backoff:?}");
            let why = format!("getUpdates failed: {e}");
            gateway.link(
                false,
                Some(super::super::secrets::redact(&why).into_owned()),
            );
        }
    }
    pause(stop, *backoff);
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    Polled::Again
}

/// Hands `message` to the gateway and waits for its answer, however long it takes (the
/// offset must not move before it); `None` when the bridge stops first.
fn wait_for_answer(
    gateway: &Gateway,
    message: &OutgoingMessage,
    update_id: i64,
    stop: &AtomicBool,
) -> Option<Admission> {
    loop {
        if stop.load(Ordering::SeqCst) {
            return None;
        }
        match gateway.send_and_wait(message, ANSWER_WAIT) {
            Ok(a) => return Some(a),
            Err(SendError::TimedOut) => {
                warn_limited!(
                    "telegram: no answer from the gateway for update {update_id} of chat {} yet; still waiting",
                    message.chat_id
                );
            }
            Err(SendError::TooManyPending(_)) => pause(stop, Duration::from_secs(1)),
            // It can never be sent: it ends here, refused, and the offset moves past it.
            Err(e @ SendError::TooLong { .. }) => {
                return Some(Admission::Rejected {
                    session: None,
                    reason: "invalid".into(),
                    detail: e.to_string(),
                });
            }
            Err(SendError::Closed) => return None,
        }
    }
}

/// The message's photo and document, fetched into the spool (issue 36); what could not be
/// is named in the entries and told to the chat once.
fn fetch_files(
    config: &TelegramConfig,
    api: &mut HttpBotApi,
    update: &Update,
    message: &mut OutgoingMessage,
    to_main: &Sender<Inbound>,
) {
    let limits = &config.gateway.attachments;
    let wanted = super::files::wanted(update, limits);
    if wanted.is_empty() {
        return;
    }
    message.attachments = super::files::fetch(api, limits, &message.id, wanted);
    if let Some(text) = super::files::notice(&message.attachments) {
        warn_limited!("telegram: message {}: {text}", message.id);
        let _ = to_main.send(Inbound::Rejected {
            chat_id: message.chat_id.clone(),
            topic: message.thread_id.as_deref().and_then(|t| t.parse().ok()),
            reply_to: reply_target(&message.id),
            text,
        });
    }
}

/// A rejected message is told to its chat (by the main thread, which owns the sending).
fn tell_rejection(
    answer: &Admission,
    message: &OutgoingMessage,
    update_id: i64,
    to_main: &Sender<Inbound>,
) {
    if let Admission::Rejected { reason, detail, .. } = answer {
        // The gateway never took its files: they are still the bridge's to delete.
        crate::platforms::spool::discard(&message.attachments);
        warn_limited!(
            "telegram: update {update_id} of chat {} rejected by the gateway: {reason} ({detail})",
            message.chat_id
        );
        let _ = to_main.send(Inbound::Rejected {
            chat_id: message.chat_id.clone(),
            topic: message.thread_id.as_deref().and_then(|t| t.parse().ok()),
            reply_to: reply_target(&message.id),
            text: format!("[not accepted ({reason}): {detail}]"),
        });
    }
}

/// A message queued behind a running turn is marked by the main thread; the lowest-priority
/// news, so it is dropped rather than waited for when the main thread is behind.
fn tell_queued(answer: &Admission, message: &OutgoingMessage, to_main: &Sender<Inbound>) {
    if let (Admission::Accepted { queued: true, .. }, Some(message_id)) =
        (answer, reply_target(&message.id))
    {
        let queued = Inbound::Queued {
            chat_id: message.chat_id.clone(),
            message_id,
        };
        if to_main.try_send(queued).is_err() {
            debug_redacted!("telegram: the main thread is behind; a queued message is not marked");
        }
    }
}
