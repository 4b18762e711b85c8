#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod agent;
pub mod child;
pub mod core;
pub mod exec;
pub mod key;
pub mod liveness;
pub mod message;
pub mod openai;
pub mod ops;
pub mod pool;
pub mod process;
pub mod reactor;
pub mod server;
pub mod workload;

pub use agent::{Agent, AgentFactory, AgentUsage, CancelToken, EchoAgent, TurnError, TurnInput};
pub use core::{
    AcceptState, BusyMode, CancelReason, EventKind, FailReason, MessageEvent, Outcome,
    RejectReason, ShutdownReport, TurnId,
};
pub use liveness::{RuntimeState, Status};
pub use message::{Body, ChatType, Command, InvalidInput, Message, SessionKey};
pub use reactor::{BuildError, Builder, EventSink, Events, Handle, Runtime, SubmitError};
