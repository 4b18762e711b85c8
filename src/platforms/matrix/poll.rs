//! The sync thread: long-polls `/sync`, joins the rooms invited to, and hands human
//! messages to the main loop.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::MatrixConfig;
use super::answer::SyncAnswer;
use super::api::{Api, ApiError};
use super::crypto::Unreadable;
use super::invites::{Gate, Joiner};
use super::rooms::RoomKinds;
use super::sync;
use super::sync::{ChatKind, HumanMessage, Incoming, SyncState};

/// What the sync thread hands to the main loop.
pub(super) enum FromSync {
    /// The first sync is done (the backlog skipped): the bridge is ready.
    Ready,
    /// The messages of the sync batch ending with this `next_batch` were all handed over.
    Batch(String),
    Message(HumanMessage, ChatKind),
    Refused {
        room: String,
        event_id: String,
        why: String,
    },
    /// The homeserver answered (true) or a sync failed (false, why): for the gateway's
    /// status (`link`).
    Link(bool, Option<String>),
    Fatal(String),
}

/// Hands `msg` to the main loop, or gives up when the bridge stops (its end of `stop` is
/// dropped) while the channel is full: a blocked send never holds a stopping bridge. False
/// when it was not handed over.
fn send_or_stop(tx: &Sender<FromSync>, stop: &Receiver<()>, msg: FromSync) -> bool {
    crossbeam_channel::select! {
        send(tx, msg) -> sent => sent.is_ok(),
        recv(stop) -> _ => false,
    }
}

/// Waits `d`, or less if the bridge stops (its end of `stop` is dropped); true when it did.
pub(super) fn stopped_during(stop: &Receiver<()>, d: Duration) -> bool {
    !matches!(stop.recv_timeout(d), Err(RecvTimeoutError::Timeout))
}

/// Long-polls `/sync`. The first sync learns the rooms (its events are the backlog); with a
/// stored position (`resume`) the next one continues from there, so what was written while
/// the bridge was down is answered. Invites go to a joiner that asks `gate` first.
// The sync thread's whole world, handed over once at its start (as Telegram's poller).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_sync(
    api: &Api,
    me: &str,
    config: &MatrixConfig,
    tx: &Sender<FromSync>,
    mut resume: Option<String>,
    stop: &Receiver<()>,
    crypto: Option<&super::crypto::Shared>,
    gate: Gate,
) {
    let mut state = SyncState::new(me, config.max_rooms, 10_000);
    let mut kinds = super::rooms::RoomKinds::open(config.state_dir.as_deref());
    let joiner = Joiner::start(api, stop, gate);
    let mut since: Option<String> = None;
    let mut backoff = Duration::ZERO;
    let first_filter = sync::filter(1);
    let filter = sync::filter(100);
    let first_timeout = first_sync_timeout();
    // What was last told of the homeserver connection (told only when it changes).
    let mut link_up: Option<bool> = None;
    loop {
        let (f, timeout) = match since {
            None => (&first_filter, first_timeout),
            Some(_) => (&filter, config.sync_timeout),
        };
        let first = since.is_none();
        let fetched = fetch(
            api,
            since.as_deref(),
            f,
            timeout,
            &mut backoff,
            crypto,
            first,
        );
        let (answer, unreadable) = match tell_link(fetched, &mut link_up, tx, stop) {
            Step::Read(v, unreadable) => (v, unreadable),
            Step::Again => continue,
            Step::Stop => return,
        };
        if answer.dropped() > 0 {
            // One line per answer, however many rooms or events it held.
            warn_limited!(
                "matrix: a sync answer held {} malformed or surplus room(s) and event(s); skipped",
                answer.dropped()
            );
        }
        let Some(next) = answer.next_batch.text() else {
            warn_limited!("matrix: a sync answer without next_batch; trying again");
            if stopped_during(stop, Duration::from_secs(1)) {
                return;
            }
            continue;
        };
        let items = state.absorb(&answer);
        debug_redacted!(
            "matrix: sync {} → {next}: {} item(s)",
            since.as_deref().unwrap_or("(first)"),
            items.len()
        );
        let resuming = first && resume.is_some();
        since = match resume.take().filter(|_| first) {
            Some(stored) => {
                info_redacted!("matrix: continuing from the stored sync position");
                // The learning sync's events come again from the stored position.
                state.forget_seen();
                Some(stored)
            }
            None => Some(next.to_owned()),
        };
        let told = unreadable.into_iter().map(|u| Incoming::Refused {
            room: u.room,
            event_id: u.event_id,
            why: super::crypto::UNREADABLE_NOTICE.to_owned(),
        });
        for item in items.into_iter().chain(told) {
            if !forward(
                api,
                &config.gateway.attachments,
                (&mut state, &mut kinds),
                (tx, stop),
                item,
            ) {
                return;
            }
        }
        if let Some(j) = &joiner {
            j.exchange(&mut state);
        }
        if first && !send_or_stop(tx, stop, FromSync::Ready) {
            return;
        }
        if !resuming && !send_or_stop(tx, stop, FromSync::Batch(next.to_owned())) {
            return;
        }
    }
}

/// What the sync loop does after one fetch.
enum Step {
    /// Read this answer (and tell the rooms these events cannot be read).
    Read(Box<SyncAnswer>, Vec<Unreadable>),
    /// Ask again (after the wait the fetch asked for).
    Again,
    /// The bridge is stopping or the token was refused.
    Stop,
}

/// Tells the bridge the homeserver connection's state when it changes (`link_up`), and
/// waits out a retry.
fn tell_link(
    fetched: Fetched,
    link_up: &mut Option<bool>,
    tx: &Sender<FromSync>,
    stop: &Receiver<()>,
) -> Step {
    match fetched {
        Fetched::Answer(v, unreadable) => {
            if *link_up != Some(true) && !send_or_stop(tx, stop, FromSync::Link(true, None)) {
                return Step::Stop;
            }
            *link_up = Some(true);
            Step::Read(v, unreadable)
        }
        Fetched::Retry(wait, why) => {
            if let Some(why) = why {
                if *link_up != Some(false)
                    && !send_or_stop(tx, stop, FromSync::Link(false, Some(why)))
                {
                    return Step::Stop;
                }
                *link_up = Some(false);
            }
            if stopped_during(stop, wait) {
                Step::Stop
            } else {
                Step::Again
            }
        }
        Fetched::Fatal(why) => {
            send_or_stop(tx, stop, FromSync::Fatal(why));
            Step::Stop
        }
    }
}

/// Synapse caches a sync answer for two minutes by its request (user, device, since,
/// timeout, filter, …): a restarted bridge's first sync, identical to its predecessor's,
/// would get that stale answer (an invite since joined, an old position). A first sync
/// returns at once whatever its timeout, so a timeout of this process's own makes the
/// request new.
fn first_sync_timeout() -> Duration {
    let unique = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
        .wrapping_add(u64::from(std::process::id()));
    Duration::from_millis(1 + unique % 100_000)
}

/// What one sync request came to.
enum Fetched {
    /// The answer, read after the encryption pass (when there is one), and the encrypted
    /// events that pass says the room must now be told it cannot read.
    Answer(Box<SyncAnswer>, Vec<Unreadable>),
    /// A rate limit or a failure (and why, redacted): ask again after this wait (the caller
    /// waits, so that a stopping bridge ends it).
    Retry(Duration, Option<String>),
    /// The token was refused: nothing more can be done.
    Fatal(String),
}

/// The largest sync answer the encryption pass reads (it reads the answer whole, to decrypt
/// events in place); a larger one is read typed and bounded without it, its room keys and
/// encrypted events unread (a WARN says so; the rooms are told, as for any missing key).
const CRYPTO_PASS_MAX_BYTES: usize = 8 << 20;

fn fetch(
    api: &Api,
    since: Option<&str>,
    filter: &str,
    timeout: Duration,
    backoff: &mut Duration,
    crypto: Option<&super::crypto::Shared>,
    first: bool,
) -> Fetched {
    let read = api.sync_text(since, filter, timeout).and_then(|text| {
        let (text, unreadable) = match crypto {
            Some(c) => crypto_pass(api, c, text, first),
            None => (text, Vec::new()),
        };
        Ok((Api::parse_sync(&text)?, unreadable))
    });
    match read {
        Ok((v, unreadable)) => {
            *backoff = Duration::ZERO;
            Fetched::Answer(Box::new(v), unreadable)
        }
        Err(e) if e.is_unauthorized() => {
            Fetched::Fatal(format!("the homeserver refused the access token ({e})"))
        }
        Err(ApiError::RateLimited(d)) => {
            info_redacted!("matrix: sync rate limited, waiting {d:?}");
            Fetched::Retry(d.min(Duration::from_secs(60)), None)
        }
        Err(e) => {
            *backoff = (*backoff * 2).clamp(Duration::from_millis(500), Duration::from_secs(30));
            warn_limited!("matrix: sync failed: {e}; trying again in {backoff:?}");
            let why = super::super::secrets::redact(&format!("sync failed: {e}")).into_owned();
            Fetched::Retry(*backoff, Some(why))
        }
    }
}

/// Decrypts what an answer holds for the bot (room keys in to-device events, encrypted room
/// events in place) before it is read typed; bounded by [`CRYPTO_PASS_MAX_BYTES`].
fn crypto_pass(
    api: &Api,
    crypto: &super::crypto::Shared,
    text: String,
    first: bool,
) -> (String, Vec<Unreadable>) {
    if text.len() > CRYPTO_PASS_MAX_BYTES {
        warn_limited!(
            "matrix: a sync answer of {} bytes is past the encryption pass's {CRYPTO_PASS_MAX_BYTES} bytes; its room keys and encrypted events are not read",
            text.len()
        );
        return (text, Vec::new());
    }
    let Ok(mut sync) = serde_json::from_str::<serde_json::Value>(&text) else {
        // Not JSON: the typed read refuses it and the sync is asked again.
        return (text, Vec::new());
    };
    let unreadable =
        super::crypto::lock(crypto).on_sync(api, &mut sync, first, std::time::Instant::now());
    (sync.to_string(), unreadable)
}

/// The message's file fetched into the spool (issue 36); what could not be is told to the
/// room once, before the message goes on. False when the bridge has gone.
fn fetch_media(
    api: &Api,
    files: &crate::AttachmentLimits,
    m: &mut super::sync::HumanMessage,
    tx: &Sender<FromSync>,
    stop: &Receiver<()>,
) -> bool {
    let Some(media) = m.media.as_mut() else {
        return true;
    };
    let entry = super::media::fetch_into(api, files, &m.event_id, media);
    match &entry.skipped {
        None => true,
        Some(why) => {
            let why = format!("file not passed on: {}: {why}", entry.name);
            let (room, event_id) = (m.room.clone(), m.event_id.clone());
            send_or_stop(
                tx,
                stop,
                FromSync::Refused {
                    room,
                    event_id,
                    why,
                },
            )
        }
    }
}

/// Acts on one item of a sync: joins an invite, or passes a message (with its room's chat
/// kind) or a refusal to the bridge. False when the bridge has gone.
fn forward(
    api: &Api,
    files: &crate::AttachmentLimits,
    (state, kinds): (&mut SyncState, &mut RoomKinds),
    (tx, stop): (&Sender<FromSync>, &Receiver<()>),
    item: Incoming,
) -> bool {
    match item {
        Incoming::Invite { room, inviter } => {
            // Joined (or declined) by the joiner, off this thread; the bound counts it from
            // now on.
            state.queue_invite(&room, inviter.as_deref());
            true
        }
        Incoming::Message(mut m) => {
            if !fetch_media(api, files, &mut m, tx, stop) {
                return false;
            }
            if let Some(kind) = kinds.known(&m.room, &m.sender) {
                return send_or_stop(tx, stop, FromSync::Message(m, kind));
            }
            let joined = match state.joined(&m.room) {
                Some(n) => Some(n),
                None => match api.joined_count(&m.room) {
                    Ok(n) => {
                        state.set_joined(&m.room, n);
                        Some(n)
                    }
                    Err(e) => {
                        warn_limited!(
                            "matrix: room {}: member count unknown ({e}); taken as a group",
                            m.room
                        );
                        None
                    }
                },
            };
            // Decided once, at the room's first message: a member joining later moves nothing.
            let kind = kinds.decide(&m.room, &m.sender, joined);
            send_or_stop(tx, stop, FromSync::Message(m, kind))
        }
        Incoming::Refused {
            room,
            event_id,
            why,
        } => send_or_stop(
            tx,
            stop,
            FromSync::Refused {
                room,
                event_id,
                why,
            },
        ),
    }
}
