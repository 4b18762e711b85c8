//! The sync thread: long-polls `/sync`, joins the rooms invited to, and hands human
//! messages to the main loop.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::MatrixConfig;
use super::api::{Api, ApiError};
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
fn stopped_during(stop: &Receiver<()>, d: Duration) -> bool {
    !matches!(stop.recv_timeout(d), Err(RecvTimeoutError::Timeout))
}

/// Joins `room`, waiting out rate limits a few times; logs the outcome. True when joined.
fn join(api: &Api, room: &str, stop: &Receiver<()>) -> bool {
    for _ in 0..5 {
        match api.join(room) {
            Ok(()) => {
                info_redacted!("matrix: joined room {room}");
                return true;
            }
            Err(ApiError::RateLimited(d)) => {
                if stopped_during(stop, d.min(Duration::from_secs(30))) {
                    return false;
                }
            }
            Err(e) => {
                warn_limited!("matrix: room {room}: could not join: {e}");
                return false;
            }
        }
    }
    warn_limited!("matrix: room {room}: could not join: rate limited five times");
    false
}

/// Invites handed to the joiner per sync at most (and the joiner's queue).
const JOINS_PER_SYNC: usize = 16;

/// Joins rooms off the sync thread: a thread of its own, fed through a bounded queue, so a
/// flood of invites (or a homeserver slow to answer joins) never holds the sync.
struct Joiner {
    rooms: Sender<String>,
    done: Receiver<(String, bool)>,
}

impl Joiner {
    /// Starts the joining thread; `None` (logged) when it cannot start: invites then wait.
    fn start(api: &Api, stop: &Receiver<()>) -> Option<Joiner> {
        let (rooms, rooms_rx) = crossbeam_channel::bounded::<String>(JOINS_PER_SYNC);
        let (done_tx, done) = crossbeam_channel::bounded(JOINS_PER_SYNC);
        let (api, stop) = (api.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("matrix-join".into())
            .spawn(move || {
                loop {
                    let room = crossbeam_channel::select! {
                        recv(rooms_rx) -> room => match room { Ok(r) => r, Err(_) => return },
                        recv(stop) -> _ => return,
                    };
                    let ok = join(&api, &room, &stop);
                    crossbeam_channel::select! {
                        send(done_tx, (room, ok)) -> sent => if sent.is_err() { return },
                        recv(stop) -> _ => return,
                    }
                }
            });
        match spawned {
            Ok(_) => Some(Joiner { rooms, done }),
            Err(e) => {
                error_limited!(
                    "matrix: cannot start the joining thread: {e}; invites are not joined"
                );
                None
            }
        }
    }

    /// Takes the joiner's outcomes into `state`, then hands it as many queued invites as its
    /// queue has room for (never blocking the sync).
    fn exchange(&self, state: &mut SyncState) {
        for (room, ok) in self.done.try_iter() {
            state.join_done(&room, ok);
        }
        let room_left = JOINS_PER_SYNC.saturating_sub(self.rooms.len());
        for room in state.take_joins(room_left) {
            if self.rooms.try_send(room.clone()).is_err() {
                state.join_done(&room, false);
            }
        }
    }
}

/// Long-polls `/sync`. The first sync learns the rooms (its events are the backlog); with a
/// stored position (`resume`) the next one continues from there, so what was written while
/// the bridge was down is answered.
pub(super) fn run_sync(
    api: &Api,
    me: &str,
    config: &MatrixConfig,
    tx: &Sender<FromSync>,
    mut resume: Option<String>,
    stop: &Receiver<()>,
    crypto: Option<&super::crypto::Shared>,
) {
    let mut state = SyncState::new(me, config.max_rooms, 10_000);
    let joiner = Joiner::start(api, stop);
    let mut since: Option<String> = None;
    let mut backoff = Duration::ZERO;
    let first_filter = sync::filter(1);
    let filter = sync::filter(100);
    let first_timeout = first_sync_timeout();
    loop {
        let (f, timeout) = match since {
            None => (&first_filter, first_timeout),
            Some(_) => (&filter, config.sync_timeout),
        };
        let answer = match fetch(api, since.as_deref(), f, timeout, &mut backoff) {
            Fetched::Answer(v) => v,
            Fetched::Retry(wait) => {
                if stopped_during(stop, wait) {
                    return;
                }
                continue;
            }
            Fetched::Fatal(why) => {
                send_or_stop(tx, stop, FromSync::Fatal(why));
                return;
            }
        };
        let first = since.is_none();
        let mut answer = answer;
        let unreadable = crypto.map_or_else(Vec::new, |c| {
            super::crypto::lock(c).on_sync(api, &mut answer, first, std::time::Instant::now())
        });
        let Some(next) = answer["next_batch"].as_str() else {
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
            if !forward(api, &mut state, tx, stop, item) {
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
    Answer(serde_json::Value),
    /// A rate limit or a failure: ask again after this wait (the caller waits, so that a
    /// stopping bridge ends it).
    Retry(Duration),
    /// The token was refused: nothing more can be done.
    Fatal(String),
}

fn fetch(
    api: &Api,
    since: Option<&str>,
    filter: &str,
    timeout: Duration,
    backoff: &mut Duration,
) -> Fetched {
    match api.sync(since, filter, timeout) {
        Ok(v) => {
            *backoff = Duration::ZERO;
            Fetched::Answer(v)
        }
        Err(e) if e.is_unauthorized() => {
            Fetched::Fatal(format!("the homeserver refused the access token ({e})"))
        }
        Err(ApiError::RateLimited(d)) => {
            info_redacted!("matrix: sync rate limited, waiting {d:?}");
            Fetched::Retry(d.min(Duration::from_secs(60)))
        }
        Err(e) => {
            *backoff = (*backoff * 2).clamp(Duration::from_millis(500), Duration::from_secs(30));
            warn_limited!("matrix: sync failed: {e}; trying again in {backoff:?}");
            Fetched::Retry(*backoff)
        }
    }
}

/// Acts on one item of a sync: joins an invite, or passes a message (with its room's chat
/// kind) or a refusal to the bridge. False when the bridge has gone.
fn forward(
    api: &Api,
    state: &mut SyncState,
    tx: &Sender<FromSync>,
    stop: &Receiver<()>,
    item: Incoming,
) -> bool {
    match item {
        Incoming::Invite(room) => {
            // Joined by the joiner, off this thread; the bound counts it from now on.
            state.queue_invite(&room);
            true
        }
        Incoming::Message(m) => {
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
            let kind = joined.map_or(ChatKind::Group, ChatKind::from_joined);
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
