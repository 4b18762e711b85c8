//! Subcommands of the binary.

pub mod bridge;
pub mod loadgen;
pub mod send;
pub mod serve;
pub mod status;

/// Exit code for bad flags or configuration (as clap uses).
pub const USAGE_ERROR: i32 = 2;
