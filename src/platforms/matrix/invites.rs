//! Invites: the bot joins a room only when whoever invited it may use it (the gateway's
//! access policy, asked with a `may_use` query: an admin, a user let in, or anyone on an open
//! platform); any other invite is declined (`/leave` on the invite) and logged once. The
//! joining thread does both, off the sync thread, fed through a bounded queue, so a flood of
//! invites (or a homeserver or gateway slow to answer) never holds the sync.

use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::api::{Api, ApiError};
use super::poll::stopped_during;
use super::sync::SyncState;

/// Asks whether `inviter` may use the bot, about `room`: `Ok(allowed)`, or `Err(why)` when
/// nothing could be told (the gateway away): then it is asked again.
pub(super) type Gate = Box<dyn Fn(&str, &str) -> Result<bool, String> + Send>;

/// Invites handed to the joiner per sync at most (and the joiner's queue).
const JOINS_PER_SYNC: usize = 16;
/// How long the joiner waits before asking the gateway again after no answer.
const ASK_AGAIN: Duration = Duration::from_secs(2);

/// What the homeserver is asked about a room the bot is invited to.
#[derive(Clone, Copy)]
enum Membership {
    Join,
    Leave,
}

/// Joins or leaves `room`, waiting out rate limits a few times; logs a failure. True when
/// done.
fn change(api: &Api, room: &str, to: Membership, stop: &Receiver<()>) -> bool {
    let what = match to {
        Membership::Join => "join",
        Membership::Leave => "decline the invite",
    };
    for _ in 0..5 {
        let done = match to {
            Membership::Join => api.join(room),
            Membership::Leave => api.leave(room),
        };
        match done {
            Ok(()) => return true,
            Err(ApiError::RateLimited(d)) => {
                if stopped_during(stop, d.min(Duration::from_secs(30))) {
                    return false;
                }
            }
            Err(e) => {
                warn_limited!("matrix: room {room}: could not {what}: {e}");
                return false;
            }
        }
    }
    warn_limited!("matrix: room {room}: could not {what}: rate limited five times");
    false
}

/// Whether the bot accepts the invite to `room` from `inviter`: asks the gateway until it
/// answers; `None` when the bridge stops first. An invite that does not say who sent it is
/// declined.
fn accepts(gate: &Gate, room: &str, inviter: Option<&str>, stop: &Receiver<()>) -> Option<bool> {
    let inviter = inviter?;
    loop {
        match gate(inviter, room) {
            Ok(allowed) => return Some(allowed),
            Err(e) => {
                warn_limited!(
                    "matrix: room {room}: cannot ask the gateway whether {inviter} may use the bot ({e}); asking again"
                );
                if stopped_during(stop, ASK_AGAIN) {
                    return None;
                }
            }
        }
    }
}

/// Acts on one invite: joins when the inviter may use the bot, else declines (logged once).
/// `None` when the bridge stops; else whether the bot joined.
fn answer_invite(
    api: &Api,
    gate: &Gate,
    room: &str,
    inviter: Option<&str>,
    stop: &Receiver<()>,
) -> Option<bool> {
    let who = inviter.unwrap_or("an unknown user");
    let accepted = match inviter {
        Some(_) => accepts(gate, room, inviter, stop)?,
        None => false,
    };
    if accepted {
        let joined = change(api, room, Membership::Join, stop);
        if joined {
            info_redacted!("matrix: joined room {room} (invited by {who})");
        }
        return Some(joined);
    }
    if change(api, room, Membership::Leave, stop) {
        warn_limited!(
            "matrix: room {room}: declined the invite from {who}: they may not use the bot (the gateway's access policy)"
        );
    }
    Some(false)
}

/// The joining thread's handle: invites (room, inviter) in, outcomes (room, joined) out.
pub(super) struct Joiner {
    rooms: Sender<(String, Option<String>)>,
    done: Receiver<(String, bool)>,
}

impl Joiner {
    /// Starts the joining thread; `None` (logged) when it cannot start: invites then wait.
    pub(super) fn start(api: &Api, stop: &Receiver<()>, gate: Gate) -> Option<Joiner> {
        let (rooms, rooms_rx) =
            crossbeam_channel::bounded::<(String, Option<String>)>(JOINS_PER_SYNC);
        let (done_tx, done) = crossbeam_channel::bounded(JOINS_PER_SYNC);
        let (api, stop) = (api.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("matrix-join".into())
            .spawn(move || {
                loop {
                    let (room, inviter) = crossbeam_channel::select! {
                        recv(rooms_rx) -> room => match room { Ok(r) => r, Err(_) => return },
                        recv(stop) -> _ => return,
                    };
                    let Some(ok) = answer_invite(&api, &gate, &room, inviter.as_deref(), &stop)
                    else {
                        return;
                    };
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
    pub(super) fn exchange(&self, state: &mut SyncState) {
        for (room, ok) in self.done.try_iter() {
            state.join_done(&room, ok);
        }
        let room_left = JOINS_PER_SYNC.saturating_sub(self.rooms.len());
        for (room, inviter) in state.take_joins(room_left) {
            if self.rooms.try_send((room.clone(), inviter)).is_err() {
                state.join_done(&room, false);
            }
        }
    }
}
