//! turnstile: a runtime for chat-agent gateways.
//!
//! One reactor thread owns every session; agent turns and agent teardown run on worker pools;
//! a heartbeat proves the loop is alive. See the README for the architecture.

#![warn(missing_docs)]

pub mod agent;
pub mod core;
pub mod liveness;
pub mod message;
pub mod pool;
pub mod reactor;

pub use agent::{Agent, AgentFactory, CancelToken, EchoAgent, TurnError, TurnInput};
pub use core::{
    AcceptState, BusyMode, CancelReason, EventKind, FailReason, MessageEvent, Outcome,
    RejectReason, ShutdownReport, TurnId,
};
pub use liveness::{RuntimeState, Status};
pub use message::{Body, ChatType, Command, InvalidInput, Message, SessionKey};
pub use reactor::{BuildError, Builder, EventSink, Events, Handle, Runtime, SubmitError};
