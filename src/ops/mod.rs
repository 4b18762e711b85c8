//! Operations: the HTTP endpoint (health, readiness, status, Prometheus metrics), systemd
//! notifications and the watchdog, hosted on the reactor next to the bridge server.

pub mod frontend;
pub mod http;
pub mod logfmt;
pub mod metrics;
pub mod notify;

pub use frontend::Ops;
