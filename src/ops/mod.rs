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

// The cluster's families live in the cluster's wing (src/cluster/), mounted here.
pub(crate) mod access;
#[path = "../cluster/metrics.rs"]
mod cluster_metrics;
mod endpoint;
pub(crate) mod exposition;
pub(crate) mod history;
pub(crate) mod http;
pub(crate) mod layer;
pub(crate) mod metrics;
pub(crate) mod systemd;

#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use layer::{Ops, Reload, ReloadApplier, ReloadLoader, journal_ready};

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};

use crate::agent::{Agent, AgentFactory, AgentFailures, AgentUsage, ModelUsage};
use crate::message::SessionKey;

/// Factories replaced but still counted: their agents may live on and keep consuming.
const RETIRED_FACTORIES: usize = 8;
/// Distinct models kept in the folded totals; the rest are filed under [`OTHER_MODELS`].
const MAX_MODELS: usize = 64;
/// The model name of usage folded past [`MAX_MODELS`].
const OTHER_MODELS: &str = "(other)";

/// An agent factory that can be replaced while the runtime runs (a reload changing the agent's
/// command): agents created from then on come from the new one; agents alive keep running.
///
/// Usage stays monotonic across swaps: the last [`RETIRED_FACTORIES`] replaced factories are
/// still asked (their agents may still be working), and older ones are folded into fixed
/// totals when they leave that list (what their agents consume after that is not counted).
pub struct SwappableFactory {
    current: RwLock<Arc<dyn AgentFactory>>,
    retired: Mutex<Retired>,
}

#[derive(Default)]
struct Retired {
    recent: VecDeque<Arc<dyn AgentFactory>>,
    folded: BTreeMap<String, AgentUsage>,
    /// The failures of the factories folded away (`None`: none of them counted any).
    folded_failures: Option<AgentFailures>,
}

impl SwappableFactory {
    /// Starts with `factory`.
    pub fn new(factory: Arc<dyn AgentFactory>) -> Arc<SwappableFactory> {
        Arc::new(SwappableFactory {
            current: RwLock::new(factory),
            retired: Mutex::new(Retired::default()),
        })
    }

    /// Replaces the factory for agents created from now on.
    pub fn swap(&self, factory: Arc<dyn AgentFactory>) {
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(|e| e.into_inner()),
            factory,
        );
        let mut r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.recent.push_back(old);
        while r.recent.len() > RETIRED_FACTORIES {
            if let Some(oldest) = r.recent.pop_front() {
                for m in oldest.usage_by_model() {
                    r.fold(m);
                }
                if let Some(f) = oldest.failures() {
                    *r.folded_failures.get_or_insert_default() += f;
                }
            }
        }
    }

    fn get(&self) -> Arc<dyn AgentFactory> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Retired {
    fn fold(&mut self, m: ModelUsage) {
        let known = self.folded.contains_key(&m.model);
        let model = if known || self.folded.len() < MAX_MODELS {
            m.model
        } else {
            OTHER_MODELS.to_owned()
        };
        *self.folded.entry(model).or_default() += m.usage;
        debug_assert!(self.folded.len() <= MAX_MODELS + 1);
    }
}

/// Shares a swappable factory with the runtime.
impl AgentFactory for Arc<SwappableFactory> {
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
        self.get().create(session)
    }

    fn create_for(
        &self,
        session: &SessionKey,
        context: &crate::message::MessageContext,
    ) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
        self.get().create_for(session, context)
    }

    fn session_agent(&self, session: &SessionKey) -> Option<String> {
        self.get().session_agent(session)
    }

    fn agents(&self) -> Vec<crate::AgentFigures> {
        self.get().agents()
    }

    fn usage(&self) -> Option<AgentUsage> {
        let by_model = self.usage_by_model();
        if by_model.is_empty() {
            return None;
        }
        let mut total = AgentUsage::default();
        for m in by_model {
            total += m.usage;
        }
        Some(total)
    }

    /// The current factory's, the recent ones' and the folded ones' together: a counter
    /// stays monotonic across reloads.
    fn failures(&self) -> Option<AgentFailures> {
        let current = self.get();
        let r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let live = std::iter::once(&current).chain(r.recent.iter());
        live.filter_map(|f| f.failures())
            .chain(r.folded_failures)
            .reduce(|mut a, b| {
                a += b;
                a
            })
    }

    fn usage_by_model(&self) -> Vec<ModelUsage> {
        let current = self.get();
        let r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = r.folded.clone();
        let live = std::iter::once(&current).chain(r.recent.iter());
        for m in live.flat_map(|f| f.usage_by_model()) {
            *all.entry(m.model).or_default() += m.usage;
        }
        all.into_iter()
            .map(|(model, usage)| ModelUsage { model, usage })
            .collect()
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

    /// A factory counting a fixed usage under one model.
    struct Counted(&'static str, u64);
    impl AgentFactory for Counted {
        fn create(&self, _: &SessionKey) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
            Err("none".into())
        }
        fn usage(&self) -> Option<AgentUsage> {
            Some(AgentUsage {
                prompt_tokens: self.1,
                completion_tokens: 1,
            })
        }
        fn usage_by_model(&self) -> Vec<ModelUsage> {
            vec![ModelUsage {
                model: self.0.to_owned(),
                usage: self.usage().unwrap_or_default(),
            }]
        }
    }

    /// A factory whose agents keep consuming after it was replaced.
    struct Live(Arc<std::sync::atomic::AtomicU64>);
    impl AgentFactory for Live {
        fn create(&self, _: &SessionKey) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
            Err("none".into())
        }
        fn usage(&self) -> Option<AgentUsage> {
            Some(AgentUsage {
                prompt_tokens: self.0.load(std::sync::atomic::Ordering::Relaxed),
                completion_tokens: 0,
            })
        }
    }

    /// The last [`RETIRED_FACTORIES`] replaced factories are still asked (their agents may
    /// still be working); the one before is folded at what it had, and the list stays bounded.
    #[test]
    fn replaced_factories_are_asked_for_a_while_then_folded() {
        let tokens = Arc::new(std::sync::atomic::AtomicU64::new(5));
        let swap = SwappableFactory::new(Arc::new(Live(Arc::clone(&tokens))));
        let swap_arc = swap;
        let usage = |f: &Arc<SwappableFactory>| f.usage().map_or(0, |u| u.prompt_tokens);
        for i in 1..=RETIRED_FACTORIES {
            swap_arc.swap(Arc::new(Counted("x", 0)));
            tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Still among the recent: its agents' new consumption counts.
            assert_eq!(usage(&swap_arc), 5 + i as u64, "after {i} swaps");
        }
        swap_arc.swap(Arc::new(Counted("x", 0)));
        let folded_at = usage(&swap_arc);
        assert_eq!(folded_at, 5 + RETIRED_FACTORIES as u64);
        tokens.fetch_add(100, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            usage(&swap_arc),
            folded_at,
            "a folded factory is no longer asked"
        );
        for _ in 0..100 {
            swap_arc.swap(Arc::new(Counted("x", 0)));
        }
        let recent = swap_arc.retired.lock().map(|r| r.recent.len()).unwrap_or(0);
        assert_eq!(recent, RETIRED_FACTORIES);
    }

    /// Counters never go back when a reload swaps the factory, however many swaps, and each
    /// model keeps its own totals; the folded models are bounded.
    #[test]
    fn usage_stays_monotonic_and_per_model_across_swaps() {
        let swap = SwappableFactory::new(Arc::new(Counted("a", 10)));
        let mut last = 0;
        for i in 0..(RETIRED_FACTORIES + MAX_MODELS + 5) {
            let model: &'static str =
                Box::leak(format!("m{}", i % (MAX_MODELS + 3)).into_boxed_str());
            swap.swap(Arc::new(Counted(model, 1)));
            let total = swap.usage().expect("usage").prompt_tokens;
            assert!(
                total > last,
                "usage went from {last} to {total} at swap {i}"
            );
            last = total;
            let by_model = swap.usage_by_model();
            assert!(by_model.len() <= MAX_MODELS + 1 + RETIRED_FACTORIES + 1);
            assert_eq!(
                by_model.iter().map(|m| m.usage.prompt_tokens).sum::<u64>(),
                total
            );
        }
        let by_model = swap.usage_by_model();
        let a = by_model
            .iter()
            .find(|m| m.model == "a")
            .expect("model a kept");
        assert_eq!(a.usage.prompt_tokens, 10);
        assert!(by_model.iter().any(|m| m.model == OTHER_MODELS));
    }
}
