//! turnstile: a runtime for chat-agent gateways.
//!
//! One reactor thread owns every session; agent turns and agent teardown run on worker pools;
//! a heartbeat proves the loop is alive. See the README for the architecture.

#![warn(missing_docs)]

pub mod core;
pub mod message;
pub mod agent;
pub mod pool;
pub mod liveness;
