//! A runtime for chat-agent gateways: one reactor thread owns every session, agent turns and
//! agent teardown run on worker pools, and a heartbeat proves the loop is alive.
//!
//! Every conversation (a [`SessionKey`]) gets exactly one agent turn at a time; messages that
//! arrive mid-turn wait in order and are never dropped or run twice; a session's [`Agent`] is
//! cached between turns and closed off the loop.
//!
//! ```no_run
//! use std::time::Duration;
//! use turnstile::{Builder, EchoAgent, EventKind, Message, SessionKey};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (runtime, handle, events) = Builder::new(EchoAgent::factory(Duration::ZERO))
//!     .turn_workers(4)
//!     .build()?;
//! let reactor = runtime.spawn()?; // the loop, on a thread of its own
//! let alice = SessionKey::dm("telegram", "42")?;
//! handle.submit(Message::new("m1", alice, "hello")?)?;
//! loop {
//!     let event = events.recv_timeout(Duration::from_secs(10))?;
//!     if let EventKind::Finished(outcome) = event.kind {
//!         println!("{}: {outcome:?}", event.id);
//!         break;
//!     }
//! }
//! handle.shutdown();
//! let report = reactor.join()?;
//! assert!(report.clean);
//! # Ok(())
//! # }
//! ```
//!
//! The parts an embedder uses:
//!
//! - [`Builder`] → ([`Runtime`], [`Handle`]): settings, then the loop (run it on a thread of
//!   your own) and a handle to submit [`Message`]s, read [`Status`] and shut down.
//! - [`Agent`] / [`AgentFactory`]: your agent, one per session; [`EchoAgent`], [`ExecAgent`],
//!   [`ProcessAgent`] and (feature `openai`) `OpenAiFactory` are built in. With the `async`
//!   feature, `AsyncAgent` / `AsyncAgentFactory` are agents whose turns and close are futures,
//!   run on your executor (`Builder::new_async`).
//! - [`MessageEvent`]s come back on a channel ([`Events`]) or, with the `async` feature, as a
//!   stream; each accepted message ends with exactly one [`Outcome`].
//! - [`Frontend`] / [`Ctx`]: code hosted on the reactor thread next to the core, such as the
//!   bridge protocol's server ([`BridgeServer`]).
//! - [`Store`]: where `--data-dir`'s journal keeps messages ([`SqliteStore`] with the `sqlite`
//!   feature).
//!
//! The operator's guide — the `turnstile` binary, its flags, the bridge protocol and
//! production set-up — starts at the project's README and is indexed by reader in docs/README.md.
#![warn(missing_docs)]
#![warn(unreachable_pub)]

// timerfd, process groups, pidfds, PR_SET_CHILD_SUBREAPER and /proc: Linux only, said plainly
// rather than as a missing symbol deep in a build.
#[cfg(not(target_os = "linux"))]
compile_error!("turnstile runs on Linux only (it uses timerfd, pidfd, process groups and /proc)");

mod access;
mod agent;
mod agents;
mod attachments;
mod auth;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
mod cluster;
mod core;
mod histogram;
mod journal;
mod key;
mod liveness;
// Only the CLI renders JSON log lines; the reactor's WARN lines use its fields.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod logfmt;
mod message;
// The operations endpoint, systemd notification and the containment sweep at exit are the
// binary's (feature `cli`); without it they are compiled but unused.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod ops;
#[cfg(feature = "cli")]
mod platforms;
mod pool;
mod reactor;
mod server;
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod text;
mod tls;
mod tokens;
// The bridge protocol; some of it (a bridge's side) only the binary's bridges use.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod wire;

pub use access::{AccessConfig, AccessFigures};
pub use agent::{
    Agent, AgentError, AgentFactory, AgentFailures, AgentFigures, AgentUsage, CancelToken,
    EchoAgent, FnFactory, ModelUsage, Partials, TurnError, TurnInput,
};
pub use agents::exec::{ExecAgent, ExecOptions};
#[cfg(feature = "openai")]
pub use agents::openai::{ApiKey, OpenAiAgent, OpenAiConfig, OpenAiFactory, TlsRoots};
pub use agents::process::{ProcessAgent, ProcessOptions};
pub use attachments::{Attachment, AttachmentLimits};
pub use core::{
    AcceptState, BusyMode, CancelReason, CoreConfig, EventKind, FailReason, MessageEvent, Outcome,
    RejectReason, Reply, ShutdownReport, TurnId,
};
#[cfg(feature = "sqlite")]
pub use journal::SqliteStore;
pub use journal::{
    MemStore, MemoryUpdate, Record, Recovered, RecoveredMessage, Store, StoreError, StoreErrorKind,
    StoredMessage, StoredOutcome,
};
pub use liveness::{
    AttachmentsStatus, BridgeStatus, ClusterStatus, FrontendStatus, HistoryStatus, HttpStatus,
    JournalStatus, LinkStatus, PlatformStatus, RecoveryCounts, RuntimeState, ServiceStatus, Status,
    SupervisedBridge, SupervisedState,
};
pub use message::{Body, ChatType, Command, InvalidInput, Message, MessageContext, SessionKey};
#[cfg(feature = "async")]
pub use reactor::{
    AgentFuture, AsyncAgent, AsyncAgentFactory, Cancelled, EventStream, Spawn, Submit,
    SubmitStream, Task,
};
pub use reactor::{
    BuildError, Builder, Ctx, EventSink, Events, FIRST_RESERVED_TOKEN, Frontend, Handle,
    NoFrontend, RunError, Runtime, RuntimeThread, SubmitError, WaitError,
};
pub use server::{BridgeConfig, BridgeServer, ForcedStop, ServerConfig};
#[cfg(feature = "tls")]
pub use tls::{ServerTls, TlsError};
pub use wire::MessageFields;

/// The channel crate of [`EventSink`] and [`Events`], re-exported so an embedder uses the same
/// version.
pub use crossbeam_channel;
/// The poll crate of the [`Frontend`] trait, re-exported so a frontend uses the same version.
pub use mio;

/// Internals for the crate's own tests and benchmarks — not part of the API, no stability
/// promise (rustls keeps the same kind of door).
#[doc(hidden)]
pub mod internal {
    /// The sans-IO core's inner types (the public API has the rest).
    pub mod core {
        #[cfg(feature = "bench")]
        pub use crate::core::IdHasher;
        #[cfg(feature = "bench")]
        pub use crate::core::timers::TimerQueue;
        pub use crate::core::{
            AgentPhase, CleanupContext, CleanupId, Core, CoreStats, Effect, Input, SessionView,
            TurnJob, TurnResult,
        };
    }
    /// Generational slot keys.
    pub mod key {
        pub use crate::key::Key;
    }
    /// The journal's thread and test stores (its records and stores are public).
    pub mod journal {
        pub use crate::journal::memory::kept_conversation;
        pub use crate::journal::{Committed, FaultyStore, Journal, JournalConfig, Model, now_ms};
    }
    /// The cluster's store, ownership, reader and member link (`--cluster`).
    #[cfg(feature = "cluster")]
    pub mod cluster {
        pub use crate::cluster::{
            Accept, Acquire, Arrival, ClusterConfig, ClusterLink, ClusterReport, ClusterRequest,
            Done, FWD_MAXLEN, FwdEntry, Lease, LoadedPartition, Op, Ownership, Plan, Reader,
            RedisStore, Stream, StreamEntry, cluster_tag, partition_of, tag_parts,
        };
    }
    /// The sans-IO bridge protocol.
    pub mod server {
        pub use crate::server::bridge::{Backlog, TERMINAL_ENVELOPE};
        pub use crate::server::{Action, Bridge, ConnId, Flushed};
    }
    /// The bridge protocol's client side as the server parses it (`tests/wire_oracle.rs`
    /// holds the parse equal to the old `Value` parse).
    pub mod wire {
        pub use crate::wire::{ClientOp, LineError, parse_line};
    }
    /// The reactor's defaults.
    pub mod reactor {
        pub use crate::reactor::DEFAULT_MAX_REPLY_BYTES;
    }
    /// The bridges' Markdown renderer (`benches/markdown.rs`).
    #[cfg(feature = "cli")]
    pub mod markdown {
        pub use crate::platforms::markdown::{Measure, Piece, Target, pieces, plain, telegram};
    }
}
