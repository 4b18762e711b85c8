//! Frontends: code hosted on the reactor thread next to the core, such as the TCP bridge
//! server. A frontend owns its mio sources and submits messages whose events come back to it
//! on the same thread, with no channel in between.

use std::sync::Arc;
use std::time::Duration;

use mio::event::Event;
use mio::{Poll, Registry};

use super::route::Route;
use super::workers::BoxAgent;
use crate::core::{Core, Effect, Input, MessageEvent, TurnId};
use crate::liveness::{FrontendStatus, Status};
use crate::message::{Message, SessionKey};

/// What a frontend may do during a reactor step.
pub struct Ctx<'a> {
    now: Duration,
    core: &'a mut Core<Route, BoxAgent>,
    fx: &'a mut Vec<Effect<Route, BoxAgent>>,
    shutdown: bool,
    reload: bool,
}

impl<'a> Ctx<'a> {
    pub(super) fn new(
        now: Duration,
        core: &'a mut Core<Route, BoxAgent>,
        fx: &'a mut Vec<Effect<Route, BoxAgent>>,
    ) -> Ctx<'a> {
        Ctx {
            now,
            core,
            fx,
            shutdown: false,
            reload: false,
        }
    }

    /// The reactor's clock (time since the loop started).
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Submits a message; its events come back through [`Frontend::deliver`] with `tag`.
    pub fn submit(&mut self, message: Message, tag: u64) {
        let input = Input::Submit {
            message,
            route: Route::Local(tag),
        };
        self.core.handle(self.now, input, self.fx);
    }

    /// Submits a message whose turn, once claimed, waits for [`Ctx::release_turn`] before it
    /// is handed to a worker (its `TurnStarted` event comes at the claim): how a journaling
    /// frontend makes a turn's start durable before the agent runs.
    pub fn submit_held(&mut self, message: Message, tag: u64) {
        let input = Input::SubmitHeld {
            message,
            route: Route::Local(tag),
        };
        self.core.handle(self.now, input, self.fx);
    }

    /// `--cluster`: these sessions leave the runtime (their partition is another
    /// instance's): their messages end `cancelled: handed_over` ([`Input::HandOver`]).
    pub fn hand_over(&mut self, sessions: Vec<SessionKey>) {
        self.core
            .handle(self.now, Input::HandOver { sessions }, self.fx);
    }

    /// Hands the held turn `turn` to a worker (ignored if it already ended).
    pub fn release_turn(&mut self, turn: TurnId) {
        self.core.handle(self.now, Input::Release { turn }, self.fx);
    }

    /// Whether the runtime is shutting down (or asked to, by this step or before).
    pub fn shutting_down(&self) -> bool {
        self.shutdown || self.core.is_shutting_down()
    }

    /// Asks for the configuration to be re-read (SIGHUP); a frontend hosting the reload
    /// (the ops frontend) takes the request with [`Ctx::take_reload_request`].
    pub fn request_reload(&mut self) {
        self.reload = true;
    }

    /// Whether a reload was asked for in this step (and forgets the request).
    pub fn take_reload_request(&mut self) -> bool {
        std::mem::take(&mut self.reload)
    }

    /// The settings a reload may change, as in force.
    pub fn tunables(&self) -> crate::core::Tunables {
        self.core.tunables()
    }

    /// Changes the settings a reload may change, for what comes next.
    pub fn retune(&mut self, t: crate::core::Tunables) {
        self.core.retune(t);
    }

    /// Starts a graceful shutdown.
    pub fn request_shutdown(&mut self) {
        self.shutdown = true;
    }

    pub(super) fn shutdown_requested(&self) -> bool {
        self.shutdown
    }
}

/// Code hosted on the reactor. Every method runs on the reactor thread and must not block.
pub trait Frontend {
    /// Registers the frontend's sources, with tokens below [`FIRST_RESERVED_TOKEN`](crate::FIRST_RESERVED_TOKEN).
    fn register(&mut self, registry: &Registry) -> std::io::Result<()>;

    /// A readiness event for one of the frontend's tokens.
    fn on_ready(&mut self, event: &Event, ctx: &mut Ctx<'_>);

    /// Called once per loop iteration after readiness events: continue unfinished work and
    /// fire the frontend's own timers. Returns when it next needs the loop (`Some(now)` or
    /// earlier: at once).
    fn on_wake(&mut self, ctx: &mut Ctx<'_>) -> Option<Duration>;

    /// An event for a message submitted with `tag`.
    fn deliver(&mut self, tag: u64, event: MessageEvent);

    /// Writes buffered output; called once per loop iteration after all deliveries.
    fn flush(&mut self);

    /// Called once shutdown has completed, to flush output (bounded in time).
    fn finish(&mut self, poll: &mut Poll);

    /// A heartbeat tick produced `status` (already published). For work that must follow
    /// the loop's own pulse, such as the systemd watchdog.
    fn on_tick(&mut self, status: &Arc<Status>) {
        let _ = status;
    }

    /// The frontend's own figures for the status snapshot (its `frontend` field), asked at
    /// every heartbeat tick: `None` (the default) leaves the field out. A frontend of an
    /// embedder's own reports its figures in [`FrontendStatus::custom`]; the bridge server
    /// and the operations endpoint fill the typed fields the metrics read.
    fn status(&self) -> Option<FrontendStatus> {
        None
    }

    /// Whether the frontend registered sources (sockets, signals, timers of its own). A
    /// busy loop polls for their readiness with a zero timeout on every pass, so that a
    /// ready socket waits one pass; a frontend with none ([`NoFrontend`]) returns `false`
    /// and spares the loop that syscall. Defaults to `true`.
    fn has_sources(&self) -> bool {
        true
    }
}

/// The frontend of a runtime used only through [`super::Handle`]s.
pub struct NoFrontend;

impl Frontend for NoFrontend {
    fn register(&mut self, _: &Registry) -> std::io::Result<()> {
        Ok(())
    }
    fn on_ready(&mut self, _: &Event, _: &mut Ctx<'_>) {}
    fn on_wake(&mut self, _: &mut Ctx<'_>) -> Option<Duration> {
        None
    }
    fn deliver(&mut self, _: u64, _: MessageEvent) {}
    fn flush(&mut self) {}
    fn finish(&mut self, _: &mut Poll) {}
    fn has_sources(&self) -> bool {
        false
    }
}
