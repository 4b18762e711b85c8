//! The built-in agents and the containment of their processes.
//!
//! - [`exec`]: each turn runs a shell command;
//! - [`process`]: one long-lived process per session, newline-delimited JSON;
//! - [`openai`] (feature `openai`): a chat-completions endpoint over HTTPS;
//! - [`child`]: how the first two run their commands (a leader per command, its process
//!   tree walked and killed, a registry for forced exits).

// The containment sweep at exit is the binary's (feature `cli`); without it, compiled but unused.
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) mod child;
pub(crate) mod exec;
#[cfg(feature = "openai")]
pub(crate) mod openai;
pub(crate) mod process;
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
pub(crate) mod routes;
