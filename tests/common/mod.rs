//! Shared test support: a deterministic driver for the sans-IO core, a log capture,
//! [`eventually`] for a state another thread or process changes on a clock of its own, and
//! a `serve` process's listening line and status file ([`gateway`]), a `GET` of its HTTP
//! endpoint ([`http`]).
#![allow(dead_code)]

pub mod eventually;
pub mod fifo;
pub mod gateway;
pub mod http;
pub mod sim;

pub use eventually::{eventually, holds};

use std::collections::HashMap;
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use turnstile::internal::core::{
    CleanupContext, CleanupId, Core, Effect, Input, TurnJob, TurnResult,
};
use turnstile::{CoreConfig, EventKind, MessageEvent, ShutdownReport, TurnId};
use turnstile::{Message, SessionKey};

/// Runs `command` to its end; panics naming `what`, with its stderr, unless it succeeded.
/// Its output.
#[track_caller]
pub fn run_ok(command: &mut Command, what: &str) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A simplified, comparable record of one effect.
#[derive(Clone, Debug, PartialEq)]
pub enum Fx {
    Event(MessageEvent),
    Started {
        turn: TurnId,
        slot: turnstile::internal::key::Key,
        session: String,
        id: String,
        input: String,
        /// The agent the core handed over (None: the worker creates one).
        agent: Option<u64>,
        /// The agent the turn runs with: the one handed over, or the one it created.
        agent_id: u64,
    },
    Cancel(TurnId),
    Abandoned(TurnId),
    Cleanup {
        job: CleanupId,
        agent: u64,
        context: CleanupContext,
        session: String,
    },
    Exceeded {
        job: CleanupId,
        context: CleanupContext,
        session: String,
    },
    CleanupFailed {
        job: CleanupId,
        context: CleanupContext,
    },
    Complete(ShutdownReport),
}

/// Drives a `Core<(), u64>`: routes are unit (events carry the message id), agents are
/// numbers so a test can follow each one. Plays the worker pools' part by hand.
pub struct Harness {
    pub core: Core<(), u64>,
    pub now: Duration,
    /// Turns started and not yet completed or abandoned.
    pub running: HashMap<TurnId, TurnJob<u64>>,
    /// Abandoned turns whose "thread" has not returned yet.
    pub stuck: HashMap<TurnId, TurnJob<u64>>,
    /// Cleanup jobs issued and not yet answered.
    pub cleanups: HashMap<CleanupId, u64>,
    /// Issued cleanup jobs whose `close()` has not started (when not started automatically).
    pub unstarted: Vec<CleanupId>,
    /// Report `CleanupStarted` for every issued job at once, as an idle pool would (default).
    pub auto_start_cleanups: bool,
    /// The agent each running turn has or created (the factory runs as the turn starts).
    pub agent_of: HashMap<TurnId, u64>,
    /// Every effect so far, in order.
    pub log: Vec<Fx>,
    next_agent: u64,
}

pub fn key(chat: &str) -> SessionKey {
    SessionKey::dm("test", chat).expect("valid key")
}

impl Harness {
    pub fn new(cfg: CoreConfig) -> Harness {
        Harness {
            core: Core::new(cfg, Duration::ZERO),
            now: Duration::ZERO,
            running: HashMap::new(),
            stuck: HashMap::new(),
            cleanups: HashMap::new(),
            unstarted: Vec::new(),
            auto_start_cleanups: true,
            agent_of: HashMap::new(),
            log: Vec::new(),
            next_agent: 0,
        }
    }

    pub fn step(&mut self, input: Input<(), u64>) -> Vec<Fx> {
        let mut fx = Vec::new();
        self.core.handle(self.now, input, &mut fx);
        let mut out = self.absorb(fx);
        out.extend(self.start_cleanups());
        out
    }

    /// Reports `close()` starting for the issued jobs, when that is automatic.
    fn start_cleanups(&mut self) -> Vec<Fx> {
        let mut out = Vec::new();
        while self.auto_start_cleanups && !self.unstarted.is_empty() {
            let job = self.unstarted.remove(0);
            let mut fx = Vec::new();
            self.core
                .handle(self.now, Input::CleanupStarted { job }, &mut fx);
            out.extend(self.absorb(fx));
        }
        out
    }

    /// Reports `close()` starting for the oldest issued job (a pool thread took it).
    pub fn start_cleanup(&mut self) -> Vec<Fx> {
        if self.unstarted.is_empty() {
            return Vec::new();
        }
        let job = self.unstarted.remove(0);
        self.step(Input::CleanupStarted { job })
    }

    /// Moves the clock forward and fires due timers.
    pub fn advance(&mut self, by: Duration) -> Vec<Fx> {
        self.now += by;
        let mut fx = Vec::new();
        self.core.advance(self.now, &mut fx);
        let mut out = self.absorb(fx);
        out.extend(self.start_cleanups());
        out
    }

    pub fn submit(&mut self, chat: &str, id: &str, text: &str) -> Vec<Fx> {
        let message = Message::new(id, key(chat), text).expect("valid message");
        self.step(Input::Submit { message, route: () })
    }

    /// Submits a held message: its turn, once claimed, waits for [`Harness::release`].
    pub fn submit_held(&mut self, chat: &str, id: &str, text: &str) -> Vec<Fx> {
        let message = Message::new(id, key(chat), text).expect("valid message");
        self.step(Input::SubmitHeld { message, route: () })
    }

    /// Releases the held turn claimed for message `id` (its start record is durable).
    pub fn release(&mut self, id: &str) -> Vec<Fx> {
        let turn = self.claimed(id).expect("a claimed turn");
        self.step(Input::Release { turn })
    }

    /// The turn claimed for message `id` (its `TurnStarted` event), if any.
    pub fn claimed(&self, id: &str) -> Option<TurnId> {
        self.events_of(id).into_iter().find_map(|k| match k {
            EventKind::TurnStarted(t) => Some(t),
            _ => None,
        })
    }

    /// The running turn of a session (panics if none).
    pub fn turn_of(&self, chat: &str) -> TurnId {
        let k = key(chat);
        *self
            .running
            .iter()
            .find(|(_, j)| j.session == k)
            .map(|(t, _)| t)
            .expect("a running turn")
    }

    /// Completes a turn (running or stuck) as its worker would, with the agent it was given
    /// or created when it started.
    pub fn complete(&mut self, turn: TurnId, result: TurnResult) -> Vec<Fx> {
        let job = self
            .running
            .remove(&turn)
            .or_else(|| self.stuck.remove(&turn))
            .expect("known turn");
        let agent = self.agent_of.remove(&turn).expect("the turn's agent");
        self.step(Input::TurnDone(job.done(Some(agent), result)))
    }

    /// Completes a session's running turn with an echo of its input.
    pub fn echo(&mut self, chat: &str) -> Vec<Fx> {
        let turn = self.turn_of(chat);
        let input = self.running[&turn].input.clone();
        self.complete(turn, TurnResult::Reply(input.into()))
    }

    pub fn finish_cleanup(&mut self, job: CleanupId, result: Result<(), String>) -> Vec<Fx> {
        self.cleanups.remove(&job);
        self.unstarted.retain(|&j| j != job);
        self.step(Input::CleanupDone { job, result })
    }

    /// Every event kind emitted for message `id`, in order.
    pub fn events_of(&self, id: &str) -> Vec<EventKind> {
        self.log
            .iter()
            .filter_map(|f| match f {
                Fx::Event(e) if &*e.id == id => Some(e.kind.clone()),
                _ => None,
            })
            .collect()
    }

    /// Terminal outcomes emitted for message `id`.
    pub fn outcomes_of(&self, id: &str) -> Vec<turnstile::Outcome> {
        self.events_of(id)
            .into_iter()
            .filter_map(|k| match k {
                EventKind::Finished(o) => Some(o),
                _ => None,
            })
            .collect()
    }

    fn absorb(&mut self, fx: Vec<Effect<(), u64>>) -> Vec<Fx> {
        let mut out = Vec::with_capacity(fx.len());
        for effect in fx {
            let f = match effect {
                Effect::Emit { event, .. } => Fx::Event(event),
                Effect::StartTurn(job) => {
                    let agent = job.agent.unwrap_or_else(|| {
                        self.next_agent += 1;
                        self.next_agent
                    });
                    self.agent_of.insert(job.turn, agent);
                    let f = Fx::Started {
                        turn: job.turn,
                        slot: job.slot,
                        session: job.session.to_string(),
                        id: job.message_id.to_string(),
                        input: job.input.clone(),
                        agent: job.agent,
                        agent_id: agent,
                    };
                    self.running.insert(job.turn, job);
                    f
                }
                Effect::CancelTurn(t) => Fx::Cancel(t),
                Effect::TurnAbandoned { turn, .. } => {
                    if let Some(job) = self.running.remove(&turn) {
                        self.stuck.insert(turn, job);
                    }
                    Fx::Abandoned(turn)
                }
                Effect::Cleanup(job) => {
                    self.cleanups.insert(job.job, job.agent);
                    self.unstarted.push(job.job);
                    Fx::Cleanup {
                        job: job.job,
                        agent: job.agent,
                        context: job.context,
                        session: job.session.to_string(),
                    }
                }
                Effect::CleanupExceeded {
                    job,
                    context,
                    session,
                } => {
                    self.cleanups.remove(&job);
                    Fx::Exceeded {
                        job,
                        context,
                        session: session.to_string(),
                    }
                }
                Effect::CleanupFailed { job, context, .. } => Fx::CleanupFailed { job, context },
                Effect::ShutdownComplete(r) => Fx::Complete(r),
            };
            self.log.push(f.clone());
            out.push(f);
        }
        out
    }
}

/// Captured log records: (level, message). Installed once per test binary.
pub struct Capture(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        if record.target().starts_with("turnstile") {
            let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
            v.push((record.level(), record.args().to_string()));
        }
    }
    fn flush(&self) {}
}

static CAPTURE: OnceLock<&'static Capture> = OnceLock::new();

/// Installs the capturing logger (idempotent) and returns it.
pub fn capture_logs() -> &'static Capture {
    CAPTURE.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        let _ = log::set_logger(c);
        log::set_max_level(log::LevelFilter::Debug);
        c
    })
}

impl Capture {
    /// Records at `level` whose text contains every one of `needles`.
    pub fn find(&self, level: log::Level, needles: &[&str]) -> Vec<String> {
        let v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.iter()
            .filter(|(l, m)| *l == level && needles.iter().all(|n| m.contains(n)))
            .map(|(_, m)| m.clone())
            .collect()
    }
}
