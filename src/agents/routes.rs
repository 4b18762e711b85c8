//! Several agents in one gateway: a [`RouteTable`] picks, for each new session's agent, the
//! first `[[route]]` whose conditions all hold (platform, chat type, chat glob, user glob),
//! else the top-level agent, and creates the agent with that one's factory.
//!
//! The pick is made once, when the session's agent is created (its first message, after
//! `/new`, after an idle close), and kept by the agent itself ([`RoutedAgent`]): a reload
//! that changes the routes applies to new sessions only. A session whose agent was removed
//! by a reload finishes its turn; at its next message its agent is closed and the current
//! routes pick again. The live picks are counted per agent name in [`Picks`], shared by
//! every table of the process (a gauge that survives reloads), bounded by the live agents.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock, Weak};

use crate::agent::{
    Agent, AgentError, AgentFactory, AgentFailures, AgentFigures, AgentUsage, CancelToken,
    ModelUsage, TurnError, TurnInput,
};
use crate::message::{ChatType, MessageContext, SessionKey};

/// The label of the top-level agent (the one no route names).
pub(crate) const DEFAULT_AGENT: &str = "default";

/// Most `[[agent]]` tables (each one a metric label).
pub(crate) const MAX_AGENTS: usize = 64;
/// Most `[[route]]` tables (each message's first agent creation walks them).
pub(crate) const MAX_ROUTES: usize = 1024;

/// A `*`/`?` pattern over a whole id (`*`: any run of characters, `?`: one character).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Glob(String);

impl Glob {
    pub(crate) fn new(pattern: &str) -> Glob {
        Glob(pattern.to_owned())
    }

    /// Whether the pattern matches all of `text`.
    pub(crate) fn matches(&self, text: &str) -> bool {
        let (p, t): (Vec<char>, Vec<char>) = (self.0.chars().collect(), text.chars().collect());
        // Iterative wildcard match with one backtrack point: linear in practice, never
        // exponential on a hostile id.
        let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
        while ti < t.len() {
            if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
                pi += 1;
                ti += 1;
            } else if pi < p.len() && p[pi] == '*' {
                star = Some(pi);
                mark = ti;
                pi += 1;
            } else if let Some(s) = star {
                pi = s + 1;
                mark += 1;
                ti = mark;
            } else {
                return false;
            }
        }
        p[pi..].iter().all(|&c| c == '*')
    }
}

/// One `[[route]]`: each condition given must hold; `agent` is an index into the table's
/// agents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) platform: Option<String>,
    pub(crate) chat_type: Option<ChatType>,
    pub(crate) chat: Option<Glob>,
    pub(crate) user: Option<Glob>,
    pub(crate) agent: usize,
}

impl Route {
    /// Whether the route has no condition (it matches every session).
    pub(crate) fn is_catch_all(&self) -> bool {
        self.platform.is_none()
            && self.chat_type.is_none()
            && self.chat.is_none()
            && self.user.is_none()
    }

    /// The user is the group session's own, else the sender of the message that creates
    /// the agent (a DM's key holds no user).
    fn matches(&self, key: &SessionKey, sender: Option<&str>) -> bool {
        let user = key.user_id().or(sender);
        self.platform.as_deref().is_none_or(|p| p == key.platform())
            && self.chat_type.is_none_or(|c| c == key.chat_type())
            && self.chat.as_ref().is_none_or(|g| g.matches(key.chat_id()))
            && self
                .user
                .as_ref()
                .is_none_or(|g| user.is_some_and(|u| g.matches(u)))
    }
}

/// A named agent of a table: its label, its kind (for the status) and its factory.
pub(crate) struct NamedAgent {
    pub(crate) name: Arc<str>,
    pub(crate) kind: &'static str,
    pub(crate) factory: Arc<dyn AgentFactory>,
}

/// Live agents per agent name, and which agent serves each live session; one per process,
/// shared by every table a reload makes.
#[derive(Default)]
pub(crate) struct Picks {
    state: Mutex<PickState>,
    /// The table in force, for a session whose agent a reload removed.
    current: RwLock<Weak<RouteTable>>,
}

#[derive(Default)]
struct PickState {
    next_id: u64,
    /// Per session, its live agents (normally one; a reset's old one may still be closing).
    sessions: HashMap<SessionKey, Vec<(u64, Arc<str>)>>,
    live: BTreeMap<Arc<str>, u64>,
}

impl Picks {
    fn register(&self, session: &SessionKey, name: &Arc<str>) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.next_id += 1;
        let id = s.next_id;
        let entry = s.sessions.entry(session.clone()).or_default();
        entry.push((id, Arc::clone(name)));
        *s.live.entry(Arc::clone(name)).or_default() += 1;
        id
    }

    fn unregister(&self, session: &SessionKey, id: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = s.sessions.get_mut(session) else {
            debug_assert!(false, "an unregistered agent dropped");
            return;
        };
        let Some(at) = list.iter().position(|(i, _)| *i == id) else {
            return;
        };
        let (_, name) = list.remove(at);
        if list.is_empty() {
            s.sessions.remove(session);
        }
        if let Some(n) = s.live.get_mut(&name) {
            *n -= 1;
            if *n == 0 {
                // Bounded by the names with live agents, whatever the reloads named.
                s.live.remove(&name);
            }
        }
    }

    /// The agent serving `session` now (its newest live one).
    fn of(&self, session: &SessionKey) -> Option<Arc<str>> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.sessions
            .get(session)
            .and_then(|l| l.last().map(|(_, n)| Arc::clone(n)))
    }

    fn live(&self, name: &str) -> u64 {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.live.get(name).copied().unwrap_or(0)
    }

    /// Makes `table` the one in force (after a reload's every check passed).
    pub(crate) fn install(&self, table: &Arc<RouteTable>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(table);
    }

    fn current(&self) -> Option<Arc<RouteTable>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .upgrade()
    }
}

/// The agents (index 0: the top-level one) and the routes choosing among them.
pub(crate) struct RouteTable {
    agents: Vec<NamedAgent>,
    routes: Vec<Route>,
    picks: Arc<Picks>,
}

impl RouteTable {
    /// A table whose first agent is the top-level one; every route's index is in range.
    pub(crate) fn new(agents: Vec<NamedAgent>, routes: Vec<Route>, picks: Arc<Picks>) -> Self {
        debug_assert!(!agents.is_empty() && agents.len() <= MAX_AGENTS + 1);
        debug_assert!(routes.iter().all(|r| r.agent < agents.len()));
        RouteTable {
            agents,
            routes,
            picks,
        }
    }

    /// The agent the first matching route names, else the top-level one.
    fn pick(&self, key: &SessionKey, sender: Option<&str>) -> &NamedAgent {
        let i = self
            .routes
            .iter()
            .find(|r| r.matches(key, sender))
            .map_or(0, |r| r.agent);
        &self.agents[i]
    }

    fn has(&self, name: &str) -> bool {
        self.agents.iter().any(|a| &*a.name == name)
    }

    fn create_routed(
        &self,
        session: &SessionKey,
        sender: Option<&str>,
    ) -> Result<RoutedAgent, AgentError> {
        let chosen = self.pick(session, sender);
        log::debug!("session {session}: agent {}", chosen.name);
        let inner = chosen.factory.create(session)?;
        let id = self.picks.register(session, &chosen.name);
        Ok(RoutedAgent {
            inner: Some(inner),
            name: Arc::clone(&chosen.name),
            session: session.clone(),
            id,
            picks: Arc::clone(&self.picks),
        })
    }
}

impl AgentFactory for RouteTable {
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, AgentError> {
        Ok(Box::new(self.create_routed(session, None)?))
    }

    fn create_for(
        &self,
        session: &SessionKey,
        context: &MessageContext,
    ) -> Result<Box<dyn Agent>, AgentError> {
        Ok(Box::new(
            self.create_routed(session, context.user_id.as_deref())?,
        ))
    }

    fn usage(&self) -> Option<AgentUsage> {
        self.agents
            .iter()
            .filter_map(|a| a.factory.usage())
            .reduce(|mut a, b| {
                a += b;
                a
            })
    }

    fn failures(&self) -> Option<AgentFailures> {
        self.agents
            .iter()
            .filter_map(|a| a.factory.failures())
            .reduce(|mut a, b| {
                a += b;
                a
            })
    }

    fn usage_by_model(&self) -> Vec<ModelUsage> {
        let mut by_model: BTreeMap<String, AgentUsage> = BTreeMap::new();
        for m in self.agents.iter().flat_map(|a| a.factory.usage_by_model()) {
            *by_model.entry(m.model).or_default() += m.usage;
        }
        by_model
            .into_iter()
            .map(|(model, usage)| ModelUsage { model, usage })
            .collect()
    }

    fn session_agent(&self, session: &SessionKey) -> Option<String> {
        self.picks.of(session).map(|n| n.to_string())
    }

    fn agents(&self) -> Vec<AgentFigures> {
        self.agents
            .iter()
            .map(|a| AgentFigures {
                name: a.name.to_string(),
                kind: a.kind.to_owned(),
                sessions: self.picks.live(&a.name),
                usage: a.factory.usage(),
                failures: a.factory.failures(),
            })
            .collect()
    }
}

/// A session's agent with the name of the route's pick; unregisters itself when dropped.
struct RoutedAgent {
    /// `None` only while a removed agent is being replaced.
    inner: Option<Box<dyn Agent>>,
    name: Arc<str>,
    session: SessionKey,
    id: u64,
    picks: Arc<Picks>,
}

impl RoutedAgent {
    /// A reload removed this agent's table: close it, and let the routes in force pick again.
    fn replace_if_removed(&mut self, sender: Option<&str>) -> Result<(), AgentError> {
        let Some(table) = self.picks.current() else {
            return Ok(());
        };
        if table.has(&self.name) {
            return Ok(());
        }
        log::debug!(
            "session {}: agent {} was removed by a reload; closing it, the routes pick again",
            self.session,
            self.name
        );
        if let Some(mut old) = self.inner.take()
            && let Err(e) = old.close()
        {
            log::warn!(
                "session {}: closing removed agent {}: {}",
                self.session,
                self.name,
                e.chain()
            );
        }
        let next = table.create_routed(&self.session, sender)?;
        // `next` registered itself; this one's registration goes with the swap below.
        let old = std::mem::replace(self, next);
        drop(old);
        Ok(())
    }
}

impl Agent for RoutedAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        self.replace_if_removed(input.context.user_id.as_deref())?;
        match &mut self.inner {
            Some(agent) => agent.turn(input, cancel),
            None => Err(AgentError::new("agent unavailable").into()),
        }
    }

    fn close(&mut self) -> Result<(), AgentError> {
        match &mut self.inner {
            Some(agent) => agent.close(),
            None => Ok(()),
        }
    }

    // The wrapper is invisible: the access policy's token count, the durable conversation and
    // the files attached are the routed agent's own.
    fn turn_usage(&self) -> Option<AgentUsage> {
        self.inner.as_ref().and_then(|a| a.turn_usage())
    }

    fn durable_memory(&mut self) -> Option<Vec<(String, String)>> {
        self.inner.as_mut().and_then(|a| a.durable_memory())
    }

    fn turn_attachments(&mut self) -> Vec<crate::Attachment> {
        self.inner
            .as_mut()
            .map(|a| a.turn_attachments())
            .unwrap_or_default()
    }
}

impl Drop for RoutedAgent {
    fn drop(&mut self) {
        self.picks.unregister(&self.session, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_ids() {
        let g = Glob::new("dev-*");
        assert!(g.matches("dev-") && g.matches("dev-ops"));
        assert!(!g.matches("a-dev-ops") && !g.matches("dev"));
        assert!(Glob::new("*").matches("") && Glob::new("a?c").matches("abc"));
        assert!(!Glob::new("a?c").matches("ac"));
        assert!(Glob::new("*:example.org").matches("!room:example.org"));
        assert!(Glob::new("a*b*c").matches("axxbyyc") && !Glob::new("a*b*c").matches("axxbyy"));
        // A hostile id against many stars ends (no exponential backtracking).
        let long = "a".repeat(10_000);
        assert!(!Glob::new("*a*a*a*a*a*a*b").matches(&long));
    }

    fn echo(name: &str) -> NamedAgent {
        let reply = name.to_owned();
        NamedAgent {
            name: name.into(),
            kind: "echo",
            factory: Arc::new(move |_: &SessionKey| -> Result<Box<dyn Agent>, String> {
                Ok(Box::new(Fixed(reply.clone())))
            }),
        }
    }

    struct Fixed(String);
    impl Agent for Fixed {
        fn turn(&mut self, _: &TurnInput<'_>, _: &CancelToken) -> Result<String, TurnError> {
            Ok(self.0.clone())
        }
        fn turn_usage(&self) -> Option<AgentUsage> {
            Some(AgentUsage {
                prompt_tokens: 3,
                completion_tokens: 4,
            })
        }
        fn durable_memory(&mut self) -> Option<Vec<(String, String)>> {
            Some(vec![("q".into(), self.0.clone())])
        }
    }

    /// A routed agent reports its inner agent's usage and conversation (the access budget
    /// and the durable memory would otherwise see nothing of a routed openai agent).
    #[test]
    fn a_routed_agent_passes_on_its_usage_and_its_memory() {
        let picks = Arc::new(Picks::default());
        let table = RouteTable::new(vec![echo(DEFAULT_AGENT)], Vec::new(), Arc::clone(&picks));
        let key = SessionKey::dm("cli", "x").expect("key");
        let mut agent = table.create(&key).expect("agent");
        let usage = agent.turn_usage().expect("usage passed on");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (3, 4));
        assert_eq!(
            agent.durable_memory(),
            Some(vec![("q".to_owned(), DEFAULT_AGENT.to_owned())])
        );
    }

    fn route(
        platform: Option<&str>,
        chat: Option<&str>,
        user: Option<&str>,
        agent: usize,
    ) -> Route {
        Route {
            platform: platform.map(str::to_owned),
            chat_type: None,
            chat: chat.map(Glob::new),
            user: user.map(Glob::new),
            agent,
        }
    }

    /// First match wins, each condition must hold, no match → the top-level agent; a DM's
    /// user is the sender; the live picks are counted per name and released on drop.
    #[test]
    fn the_first_matching_route_picks_and_the_pick_is_counted() {
        let picks = Arc::new(Picks::default());
        let table = RouteTable::new(
            vec![echo(DEFAULT_AGENT), echo("a"), echo("b")],
            vec![
                route(Some("irc"), Some("dev-*"), None, 1),
                route(None, Some("dev-*"), None, 2),
                route(None, None, Some("alice"), 1),
                Route {
                    chat_type: Some(ChatType::Group),
                    ..route(None, None, None, 2)
                },
            ],
            Arc::clone(&picks),
        );
        assert!(route(None, None, None, 0).is_catch_all());
        for one in [
            route(Some("irc"), None, None, 0),
            route(None, Some("*"), None, 0),
            route(None, None, Some("*"), 0),
            Route {
                chat_type: Some(ChatType::Dm),
                ..route(None, None, None, 0)
            },
        ] {
            assert!(!one.is_catch_all(), "{one:?}");
        }
        let dm = |p: &str, c: &str| SessionKey::dm(p, c).expect("key");
        let name = |k: &SessionKey, who: Option<&str>| table.pick(k, who).name.to_string();
        assert_eq!(name(&dm("irc", "dev-x"), None), "a");
        assert_eq!(name(&dm("matrix", "dev-x"), None), "b");
        assert_eq!(name(&dm("matrix", "ops"), None), DEFAULT_AGENT);
        assert_eq!(name(&dm("matrix", "ops"), Some("alice")), "a");
        let group = |user| SessionKey::new("matrix", ChatType::Group, "ops", None, Some(user));
        assert_eq!(name(&group("bob").expect("key"), None), "b");
        // A group session's own user counts, not the sender.
        assert_eq!(name(&group("alice").expect("key"), Some("bob")), "a");
        let key = dm("matrix", "dev-y");
        let agent = table.create(&key).expect("agent");
        assert_eq!(table.session_agent(&key).as_deref(), Some("b"));
        let live = |n: &str| {
            table
                .agents()
                .into_iter()
                .find(|f| f.name == n)
                .map(|f| f.sessions)
        };
        assert_eq!(live("b"), Some(1));
        drop(agent);
        assert_eq!((live("b"), table.session_agent(&key)), (Some(0), None));
    }
}
