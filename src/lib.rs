#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// timerfd, process groups, pidfds, PR_SET_CHILD_SUBREAPER and /proc: Linux only, said plainly
// rather than as a missing symbol deep in a build.
#[cfg(not(target_os = "linux"))]
compile_error!("turnstile runs on Linux only (it uses timerfd, pidfd, process groups and /proc)");

pub mod agent;
pub mod child;
pub mod core;
pub mod exec;
pub mod journal;
pub mod key;
pub mod liveness;
pub mod message;
pub mod openai;
pub mod ops;
pub mod platforms;
mod pool;
pub mod process;
pub mod reactor;
pub mod server;

pub use agent::{
    Agent, AgentFactory, AgentUsage, CancelToken, EchoAgent, FnFactory, Partials, TurnError,
    TurnInput,
};
pub use core::{
    AcceptState, BusyMode, CancelReason, EventKind, FailReason, MessageEvent, Outcome,
    RejectReason, Reply, ShutdownReport, TurnId,
};
pub use liveness::{RuntimeState, Status};
pub use message::{Body, ChatType, Command, InvalidInput, Message, MessageContext, SessionKey};
pub use reactor::{BuildError, Builder, EventSink, Events, Handle, Runtime, SubmitError};
#[cfg(feature = "async")]
pub use reactor::{Cancelled, EventStream, Submit, SubmitStream};
pub use server::ForcedStop;

/// The channel crate of [`EventSink`] and [`Events`], re-exported so an embedder uses the same
/// version.
pub use crossbeam_channel;
/// The poll crate of the [`Frontend`](reactor::Frontend) trait, re-exported so a frontend
/// uses the same version.
pub use mio;
