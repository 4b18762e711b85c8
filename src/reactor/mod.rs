//! The reactor: one thread running a `mio` loop around the sans-IO [`Core`](crate::core::Core).
//!
//! It never runs agent code, never waits on a job and never touches the disk. The rooms:
//!
//! - `builder`: [`Builder`] validates the settings, wires the channels and starts the worker
//!   pools; `handle`: [`Handle`] submits, reads the status and asks for shutdown from any
//!   thread; `route`: where a message's events go.
//! - `event_loop`: [`Runtime`] and the `Reactor` it becomes on its thread, whose `turn()`
//!   drains completions and ingress, dispatches I/O readiness, applies effects, ticks the
//!   heartbeat and sleeps until the next deadline.
//! - `driver`: carries out the core's effects (turns to the turn pool, agent teardown to the
//!   cleanup pool, events to their sinks or the frontend); `observe`: what is logged and
//!   counted about them.
//! - `heartbeat`: the tick that measures the loop's lateness and builds the status snapshot.
//! - `workers`: what runs on the pool threads; `wake`: how other threads wake the loop;
//!   `deadline`: the timerfd; `frontend`: the trait a server implements to host its sockets
//!   on the loop.

#[cfg(feature = "async")]
mod async_agent;
#[cfg(feature = "async")]
mod async_api;
mod builder;
mod deadline;
mod driver;
mod event_loop;
mod frontend;
mod handle;
mod heartbeat;
mod observe;
mod procstat;
mod route;
mod wake;
mod workers;

pub use crate::tokens::FIRST_RESERVED_TOKEN;
#[cfg(feature = "async")]
pub use async_agent::{AgentFuture, AsyncAgent, AsyncAgentFactory, Spawn, Task};
#[cfg(feature = "async")]
pub use async_api::{Cancelled, EventStream, Submit, SubmitStream};
pub use builder::{BuildError, Builder};
#[cfg(feature = "cli")]
pub(crate) use builder::{DEFAULT_CLEANUP_WORKERS, DEFAULT_PARTIAL_INTERVAL};
pub use event_loop::{RunError, Runtime, RuntimeThread};
pub use frontend::{Ctx, Frontend, NoFrontend};
pub use handle::{Handle, SubmitError, WaitError};
pub use route::{EventSink, Events};
// The reply cap lives beside `Reply::bounded` in the core; the builder's default and the
// agents' options read it from here too.
pub use crate::core::DEFAULT_MAX_REPLY_BYTES;
