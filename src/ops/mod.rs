//! Operations: the HTTP endpoint (health, readiness, status, Prometheus metrics), systemd
//! notifications and the watchdog, hosted on the reactor next to the bridge server.
//!
//! The top of the crate below the CLI: nothing under the reactor, the server or the status
//! imports from here.
//!
//! - `layer`: [`Ops`], the frontend wrapping the bridge server; health, readiness, reload.
//! - `http`: the endpoint (sans-IO request and response, and its mio shell).
//! - `metrics`: the Prometheus text rendered from a [`crate::Status`].
//! - `systemd`: `sd_notify(3)` and the watchdog's pace.

pub(crate) mod http;
pub(crate) mod layer;
pub(crate) mod metrics;
pub(crate) mod systemd;

#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use layer::{Ops, Reload, ReloadApplier, ReloadLoader, journal_ready};

use std::sync::{Arc, RwLock};

use crate::agent::{Agent, AgentFactory, AgentUsage};
use crate::message::SessionKey;

/// An agent factory that can be replaced while the runtime runs (a reload changing the agent's
/// command): agents created from then on come from the new one; agents alive keep running.
pub struct SwappableFactory {
    current: RwLock<Arc<dyn AgentFactory>>,
}

impl SwappableFactory {
    /// Starts with `factory`.
    pub fn new(factory: Arc<dyn AgentFactory>) -> Arc<SwappableFactory> {
        Arc::new(SwappableFactory {
            current: RwLock::new(factory),
        })
    }

    /// Replaces the factory for agents created from now on.
    pub fn swap(&self, factory: Arc<dyn AgentFactory>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = factory;
    }

    fn get(&self) -> Arc<dyn AgentFactory> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Shares a swappable factory with the runtime.
impl AgentFactory for Arc<SwappableFactory> {
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
        self.get().create(session)
    }

    fn usage(&self) -> Option<AgentUsage> {
        self.get().usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_swapped_factory_makes_the_new_agents() {
        let a: Arc<dyn AgentFactory> =
            Arc::new(|_: &SessionKey| -> Result<Box<dyn Agent>, String> { Err("first".into()) });
        let b: Arc<dyn AgentFactory> = Arc::new(crate::EchoAgent::factory(Duration::ZERO));
        let swap = SwappableFactory::new(a);
        let key = SessionKey::dm("t", "1").unwrap();
        assert_eq!(
            swap.create(&key).err().map(|e| e.to_string()).as_deref(),
            Some("first")
        );
        swap.swap(b);
        assert!(swap.create(&key).is_ok());
        assert_eq!(swap.usage(), None);
    }
}
