//! The agent contract, the cancellation token turns honour, and the built-in echo agent.
//!
//! Agents live on worker threads only: the reactor moves an agent into a turn job and gets it
//! back with the completion, so one agent never serves two turns at once.

use std::error::Error;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::message::{MessageContext, SessionKey};

/// What a turn is asked to do.
#[derive(Debug, Clone)]
pub struct TurnInput<'a> {
    /// The session.
    pub session: &'a SessionKey,
    /// The message the turn answers (the first one in merge mode).
    pub message_id: &'a str,
    /// The text (several joined by newlines in merge mode).
    pub text: &'a str,
    /// The sender and the bridge's metadata of that message.
    pub context: &'a MessageContext,
    /// Where the turn may publish its reply so far, for clients that show it growing.
    pub partials: &'a Partials,
}

/// Publishes a turn's partial reply: the whole text so far, not a delta.
///
/// Forwarding is throttled: a publish is forwarded only when the partial interval has passed
/// since the last forwarded one, otherwise it is dropped (a later publish carries newer text,
/// and the final reply always carries the whole text). Publishing never blocks on the
/// gateway. Cloneable and `Send`, so an agent may publish from a thread of its own.
#[derive(Clone, Default)]
pub struct Partials(Option<Arc<PartialsInner>>);

struct PartialsInner {
    interval: Duration,
    last: Mutex<Option<Instant>>,
    forward: Box<dyn Fn(String) + Send + Sync>,
}

impl fmt::Debug for Partials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(inner) => write!(f, "Partials(every {:?})", inner.interval),
            None => f.write_str("Partials(discarded)"),
        }
    }
}

impl Partials {
    /// A publisher that discards everything (tests, or a runtime without a listener).
    pub fn discard() -> Partials {
        Partials(None)
    }

    /// A publisher that hands at most one text per `interval` to `forward`.
    pub fn throttled(
        interval: Duration,
        forward: impl Fn(String) + Send + Sync + 'static,
    ) -> Partials {
        Partials(Some(Arc::new(PartialsInner {
            interval,
            last: Mutex::new(None),
            forward: Box::new(forward),
        })))
    }

    /// Publishes the reply so far; returns whether it was forwarded (false: throttled).
    pub fn publish(&self, text: &str) -> bool {
        let Some(inner) = &self.0 else { return false };
        {
            let mut last = inner.last.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if last.is_some_and(|t| now.duration_since(t) < inner.interval) {
                return false;
            }
            *last = Some(now);
        }
        (inner.forward)(text.to_owned());
        true
    }
}

/// An agent's failure: the text a chat is shown, and optionally the error behind it.
///
/// [`Display`](fmt::Display) is the message alone; [`source`](Error::source) is the error
/// behind it, which the runtime adds to its log lines (a turn's failure at DEBUG, a
/// `close()`'s in its WARN line) but never to what a chat sees. Built from a `String` or a
/// `&str` with `.into()`, or with [`AgentError::with_source`]. Two agent errors are equal
/// when their messages are.
#[derive(Clone)]
pub struct AgentError {
    message: String,
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl AgentError {
    /// A failure described by `message` alone.
    pub fn new(message: impl Into<String>) -> AgentError {
        AgentError {
            message: message.into(),
            source: None,
        }
    }

    /// A failure described by `message`, caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> AgentError {
        AgentError {
            message: message.into(),
            source: Some(Arc::from(source.into())),
        }
    }

    /// The text a chat is shown.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The message followed by each source's text (`message: cause: its cause`), for logs.
    pub(crate) fn chain(&self) -> String {
        let mut text = self.message.clone();
        let mut next = self.source();
        while let Some(e) = next {
            text.push_str(": ");
            text.push_str(&e.to_string());
            next = e.source();
        }
        text
    }
}

impl fmt::Debug for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("AgentError");
        d.field("message", &self.message);
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for AgentError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

impl PartialEq for AgentError {
    fn eq(&self, other: &AgentError) -> bool {
        self.message == other.message
    }
}

impl Eq for AgentError {}

impl From<String> for AgentError {
    fn from(message: String) -> AgentError {
        AgentError::new(message)
    }
}

impl From<&str> for AgentError {
    fn from(message: &str) -> AgentError {
        AgentError::new(message)
    }
}

/// Why a turn produced no reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TurnError {
    /// The turn stopped because its cancellation token fired.
    Cancelled,
    /// The turn failed; the chat is shown the error's message.
    Failed(AgentError),
}

impl fmt::Display for TurnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TurnError::Cancelled => f.write_str("cancelled"),
            TurnError::Failed(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl Error for TurnError {
    /// A failed turn's display is its [`AgentError`]'s, so its source is the agent error's.
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            TurnError::Cancelled => None,
            TurnError::Failed(e) => e.source(),
        }
    }
}

impl From<AgentError> for TurnError {
    fn from(e: AgentError) -> TurnError {
        TurnError::Failed(e)
    }
}

/// An AI agent serving one session. Both methods run on worker threads, never on the reactor.
pub trait Agent: Send + 'static {
    /// Runs one turn. Should return `Err(TurnError::Cancelled)` soon after `cancel` fires.
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError>;

    /// Releases the agent's resources. May block or hang; it runs on the cleanup pool under a
    /// deadline. An error or panic is logged and goes no further.
    fn close(&mut self) -> Result<(), AgentError> {
        Ok(())
    }

    /// The usage its last turn reported (an LLM's prompt and completion tokens), read on the
    /// worker right after `turn` returned a reply and carried with it ([`Reply::tokens`]),
    /// so the gateway's access policy can count a user's tokens (`tokens-per-day`). `None`
    /// (the default) when the agent does not count usage.
    ///
    /// [`Reply::tokens`]: crate::Reply::tokens
    fn turn_usage(&self) -> Option<AgentUsage> {
        None
    }

    /// The files its last turn attached to its reply, taken by the worker right after `turn`
    /// returned a reply and sent with it ([`Reply::attachments`](crate::Reply::attachments)).
    /// Each entry names a file in the gateway's spool (`path`, `size`, `sha256`): the bridge
    /// uploads it and the gateway deletes it once the reply is delivered. The exec and
    /// process agents take theirs from the turn's outbox (docs/agent-protocol.md); the
    /// default attaches nothing.
    fn turn_attachments(&mut self) -> Vec<crate::Attachment> {
        Vec::new()
    }

    /// The conversation to keep across restarts, (user, assistant) pairs oldest first: asked
    /// by the worker right after a turn that returned a reply, and journaled with that turn's
    /// outcome, in the same transaction. `None` (the default): nothing is kept. Only the
    /// built-in openai agent answers (with `--data-dir`: its factory reads it back).
    #[doc(hidden)]
    fn durable_memory(&mut self) -> Option<Vec<(String, String)>> {
        None
    }
}

/// Creates a fresh agent for a session; called on a turn worker.
pub trait AgentFactory: Send + Sync + 'static {
    /// A new agent for `session`, or why one could not be made (the turn then fails).
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, AgentError>;

    /// What the factory's agents have consumed so far, for the status snapshot; `None` (the
    /// default) when the agents do not count usage. Called on the reactor at every heartbeat,
    /// so it must be cheap and never block for long (read a few atomics).
    fn usage(&self) -> Option<AgentUsage> {
        None
    }

    /// Its agents' failed requests by kind, for the status and the metrics; `None` (the
    /// default) when its agents make no requests of their own. Cheap like `usage`.
    fn failures(&self) -> Option<AgentFailures> {
        None
    }

    /// [`AgentFactory::usage`] split by the model that consumed it, for the metrics
    /// (`turnstile_llm_tokens_total{model,direction}`); cheap like `usage`. The default files
    /// everything under the model `""`.
    fn usage_by_model(&self) -> Vec<ModelUsage> {
        self.usage()
            .map(|usage| {
                vec![ModelUsage {
                    model: String::new(),
                    usage,
                }]
            })
            .unwrap_or_default()
    }

    /// [`AgentFactory::create`] for the message that needs the agent: a factory that
    /// chooses among agents by the sender (a DM's key holds no user) reads it here. The
    /// default ignores the context.
    fn create_for(
        &self,
        session: &SessionKey,
        context: &MessageContext,
    ) -> Result<Box<dyn Agent>, AgentError> {
        let _ = context;
        self.create(session)
    }

    /// The name of the agent serving `session` now, for its `/status`; `None` (the default)
    /// when the factory has one kind of agent. Called on the reactor: cheap like `usage`.
    fn session_agent(&self, session: &SessionKey) -> Option<String> {
        let _ = session;
        None
    }

    /// Per named agent, its figures for the status and the metrics (`agent` label); empty
    /// (the default) for a factory of one agent. Cheap like `usage`.
    fn agents(&self) -> Vec<AgentFigures> {
        Vec::new()
    }
}

/// One named agent's figures (`agents` in the status; the `agent` label in the metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct AgentFigures {
    /// The agent's name (`default`: the top-level agent).
    pub name: String,
    /// Its kind: `echo`, `exec`, `process` or `openai`.
    pub kind: String,
    /// Sessions it serves now (their agents are live).
    pub sessions: u64,
    /// What its agents consumed, when it counts usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<AgentUsage>,
    /// Its failed model requests, when it makes requests of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failures: Option<AgentFailures>,
}

/// What one model consumed, as a factory reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelUsage {
    /// The model's name as the agent asks for it (`""`: the factory does not say).
    pub model: String,
    /// Its totals.
    pub usage: AgentUsage,
}

/// An agent factory's failed model requests so far, by kind (`agent_failures` in the status,
/// `turnstile_agent_failures_total{kind}` in the metrics; their rate is the recent failures).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct AgentFailures {
    /// No answer: the connection was refused, reset, timed out, or DNS or TLS failed.
    pub connect: u64,
    /// The server answered with a status other than 2xx (each answer, retries included).
    pub status: u64,
    /// The server stopped sending the reply (no content for the stall timeout), or took
    /// longer than the whole reply's deadline.
    pub stall: u64,
}

impl std::ops::AddAssign for AgentFailures {
    fn add_assign(&mut self, o: AgentFailures) {
        self.connect += o.connect;
        self.status += o.status;
        self.stall += o.stall;
    }
}

/// Totals an agent factory reports in the status snapshot (`agent_usage`), e.g. the tokens
/// an LLM agent's requests used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AgentUsage {
    /// Prompt (input) tokens.
    pub prompt_tokens: u64,
    /// Completion (output) tokens.
    pub completion_tokens: u64,
}

impl AgentUsage {
    /// Most tokens one turn may report; a server claiming more (one chunk of 2^64−1 once
    /// saturated the totals for good) is not counted.
    pub const MAX_TOKENS_PER_TURN: u64 = 1 << 32;

    /// Whether one turn's figures are believable enough to add to the totals.
    pub fn plausible(prompt_tokens: u64, completion_tokens: u64) -> bool {
        prompt_tokens <= Self::MAX_TOKENS_PER_TURN && completion_tokens <= Self::MAX_TOKENS_PER_TURN
    }
}

impl std::ops::AddAssign for AgentUsage {
    fn add_assign(&mut self, other: AgentUsage) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
    }
}

/// A closure is a factory; its error is anything that converts into an [`AgentError`] (a
/// `String`, a `&str`, an `AgentError`).
impl<F, E> AgentFactory for F
where
    F: Fn(&SessionKey) -> Result<Box<dyn Agent>, E> + Send + Sync + 'static,
    E: Into<AgentError>,
{
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, AgentError> {
        self(session).map_err(Into::into)
    }
}

/// An [`AgentFactory`] made from a closure that builds an agent for a session; see
/// [`Builder::from_fn`](crate::Builder::from_fn).
pub struct FnFactory<F>(pub F);

impl<F, A> AgentFactory for FnFactory<F>
where
    F: Fn(&SessionKey) -> A + Send + Sync + 'static,
    A: Agent,
{
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, AgentError> {
        Ok(Box::new((self.0)(session)))
    }
}

/// A turn's cancellation signal: set once by the reactor, observed by the agent.
///
/// Agents can poll [`CancelToken::is_cancelled`] or wait on it with a timeout, which returns
/// early when the token fires, so simulated work never outlives a cancel. With the `async`
/// feature, `CancelToken::cancelled()` is a future that resolves when it fires.
#[derive(Clone, Default)]
pub struct CancelToken(Arc<(Mutex<CancelState>, Condvar)>);

#[derive(Default)]
struct CancelState {
    fired: bool,
    /// Run once by `cancel()`: how a turn blocked in `poll(2)` (a child process's pipes) learns
    /// of the cancellation without polling the token.
    hooks: Vec<Box<dyn FnOnce() + Send>>,
    /// Tasks awaiting `cancelled()`, keyed so that a dropped future takes its waker out (an
    /// agent that `select!`s on a fresh future in a loop would otherwise grow this forever).
    #[cfg(feature = "async")]
    wakers: slab::Slab<std::task::Waker>,
}

impl CancelState {
    #[cfg(feature = "async")]
    fn take_wakers(&mut self) -> Vec<std::task::Waker> {
        std::mem::take(&mut self.wakers)
            .into_iter()
            .map(|(_, w)| w)
            .collect()
    }

    #[cfg(not(feature = "async"))]
    fn take_wakers(&mut self) -> Vec<std::task::Waker> {
        Vec::new()
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CancelToken({})", self.is_cancelled())
    }
}

impl CancelToken {
    /// A token that has not fired.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Fires the token and wakes every waiter. Idempotent.
    pub fn cancel(&self) {
        let (state, cond) = &*self.0;
        let (hooks, wakers) = {
            let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
            state.fired = true;
            (std::mem::take(&mut state.hooks), state.take_wakers())
        };
        cond.notify_all();
        // Outside the lock: an executor may poll the woken future at once, which locks.
        wakers.into_iter().for_each(std::task::Waker::wake);
        // Outside the lock, so a hook may look at the token.
        for hook in hooks {
            hook();
        }
    }

    /// Whether the token has fired.
    pub fn is_cancelled(&self) -> bool {
        self.0.0.lock().unwrap_or_else(|e| e.into_inner()).fired
    }

    /// Runs `hook` once when the token fires, or at once if it already has.
    ///
    /// The hook runs on the thread that cancels, which is the reactor: it must be quick and
    /// never block (writing to an eventfd is the intended use).
    pub fn on_cancel(&self, hook: impl FnOnce() + Send + 'static) {
        {
            let mut state = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
            if !state.fired {
                state.hooks.push(Box::new(hook));
                return;
            }
        }
        hook();
    }

    /// Waits until the token fires or `timeout` passes; returns true if it fired.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (state, cond) = &*self.0;
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        while !state.fired {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = match cond.wait_timeout(state, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        true
    }

    /// Whether the token has fired; if not, `waker` is woken when it does. `key` is the
    /// caller's registration: empty at first, kept across polls so a re-poll replaces the
    /// waker rather than adding one.
    #[cfg(feature = "async")]
    pub(crate) fn poll_fired(&self, key: &mut Option<usize>, waker: &std::task::Waker) -> bool {
        let mut state = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
        if state.fired {
            return true;
        }
        match key.and_then(|k| state.wakers.get_mut(k)) {
            Some(w) => w.clone_from(waker),
            None => *key = Some(state.wakers.insert(waker.clone())),
        }
        false
    }

    /// Takes out a registration made by [`CancelToken::poll_fired`].
    #[cfg(feature = "async")]
    pub(crate) fn forget_waker(&self, key: Option<usize>) {
        // After `cancel` the slab is empty (it took every waker), so this finds nothing.
        if let Some(k) = key {
            let mut state = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
            state.wakers.try_remove(k);
        }
    }
}

/// Replies with exactly its input; optionally takes `delay` per turn, ending early on cancel.
#[derive(Debug, Clone, Default)]
pub struct EchoAgent {
    delay: Duration,
}

impl EchoAgent {
    /// An echo agent whose turns take `delay` (zero: instant).
    pub fn new(delay: Duration) -> EchoAgent {
        EchoAgent { delay }
    }

    /// A factory of echo agents with the given per-turn delay.
    pub fn factory(delay: Duration) -> impl AgentFactory {
        move |_: &SessionKey| -> Result<Box<dyn Agent>, AgentError> {
            Ok(Box::new(EchoAgent::new(delay)))
        }
    }
}

impl Agent for EchoAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        if !self.delay.is_zero() && cancel.wait_timeout(self.delay) {
            return Err(TurnError::Cancelled);
        }
        Ok(input.text.to_owned())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn implausible_usage_is_not_counted() {
        assert!(AgentUsage::plausible(0, 0));
        assert!(AgentUsage::plausible(1 << 32, 1 << 32));
        assert!(!AgentUsage::plausible(u64::MAX, 1));
        assert!(!AgentUsage::plausible(1, (1 << 32) + 1));
    }

    use super::*;

    #[test]
    fn an_agent_error_shows_its_message_and_keeps_its_cause_for_the_log() {
        let plain: AgentError = "quota exhausted".into();
        assert_eq!(plain.to_string(), "quota exhausted");
        assert!(plain.source().is_none());
        assert_eq!(plain.chain(), "quota exhausted");
        let io = std::io::Error::other("connection reset");
        let caused = AgentError::with_source("the model is unreachable", io);
        assert_eq!(caused.to_string(), "the model is unreachable");
        assert_eq!(
            caused.source().map(|e| e.to_string()).as_deref(),
            Some("connection reset")
        );
        assert_eq!(caused.chain(), "the model is unreachable: connection reset");
        assert_eq!(
            caused,
            AgentError::new("the model is unreachable"),
            "equal by message"
        );
        let failed = TurnError::from(caused);
        assert_eq!(failed.to_string(), "the model is unreachable");
        assert_eq!(
            failed.source().map(|e| e.to_string()).as_deref(),
            Some("connection reset")
        );
    }

    #[test]
    fn a_closure_factory_may_fail_with_a_string_or_an_agent_error() {
        let key = SessionKey::dm("t", "1").unwrap();
        let by_string = |_: &SessionKey| -> Result<Box<dyn Agent>, String> { Err("no".into()) };
        let by_error =
            |_: &SessionKey| -> Result<Box<dyn Agent>, AgentError> { Err(AgentError::new("no")) };
        assert_eq!(by_string.create(&key).err(), Some(AgentError::new("no")));
        assert_eq!(by_error.create(&key).err(), Some(AgentError::new("no")));
    }

    fn input<'a>(key: &'a SessionKey, text: &'a str) -> TurnInput<'a> {
        static CONTEXT: std::sync::OnceLock<MessageContext> = std::sync::OnceLock::new();
        static PARTIALS: std::sync::OnceLock<Partials> = std::sync::OnceLock::new();
        TurnInput {
            session: key,
            message_id: "m",
            text,
            context: CONTEXT.get_or_init(MessageContext::default),
            partials: PARTIALS.get_or_init(Partials::discard),
        }
    }

    #[test]
    fn partials_are_throttled_to_one_per_interval_and_never_block() {
        // A test: a handful of sends.
        let (tx, rx) = crossbeam_channel::unbounded();
        let p = Partials::throttled(Duration::from_secs(3600), move |t| {
            let _ = tx.send(t);
        });
        assert!(p.publish("a"));
        assert!(
            !p.publish("ab"),
            "a second publish within the interval was forwarded"
        );
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec!["a".to_owned()]);
        let every = Partials::throttled(Duration::ZERO, |_| {});
        assert!(every.publish("a") && every.publish("ab"));
        assert!(!Partials::discard().publish("x"));
    }

    #[test]
    fn echo_replies_with_its_input() {
        let key = SessionKey::dm("t", "1").unwrap();
        let input = input(&key, "hello\nworld");
        let mut agent = EchoAgent::default();
        assert_eq!(
            agent.turn(&input, &CancelToken::new()),
            Ok("hello\nworld".to_owned())
        );
    }

    #[test]
    fn echo_delay_ends_early_when_cancelled() {
        let key = SessionKey::dm("t", "1").unwrap();
        let input = input(&key, "x");
        // An hour-long turn returns at once because the token already fired: if the delay
        // ignored cancellation this test would hang.
        let mut agent = EchoAgent::new(Duration::from_secs(3600));
        let token = CancelToken::new();
        token.cancel();
        assert_eq!(agent.turn(&input, &token), Err(TurnError::Cancelled));
    }

    #[test]
    fn on_cancel_hooks_run_once_when_the_token_fires_or_at_once_after() {
        // A test: two sends.
        let (tx, rx) = crossbeam_channel::unbounded();
        let token = CancelToken::new();
        let early = tx.clone();
        token.on_cancel(move || early.send("early").unwrap_or(()));
        assert!(rx.try_recv().is_err(), "a hook ran before the token fired");
        token.cancel();
        token.cancel();
        let late = tx.clone();
        token.on_cancel(move || late.send("late").unwrap_or(()));
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec!["early", "late"]);
    }

    #[test]
    fn cancel_wakes_a_waiter_on_another_thread() {
        let token = CancelToken::new();
        let waiter = {
            let token = token.clone();
            std::thread::spawn(move || token.wait_timeout(Duration::from_secs(3600)))
        };
        token.cancel();
        assert!(waiter.join().unwrap_or(false));
    }
}
