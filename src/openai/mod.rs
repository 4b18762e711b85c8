//! The built-in LLM agent: any server speaking OpenAI's chat-completions API (Ollama,
//! llama.cpp's server, vLLM, LM Studio, OpenAI and compatible hosted APIs), streamed, with a
//! bounded per-session conversation.
//!
//! One [`OpenAiAgent`] per session keeps the conversation: the system prompt, then the last
//! user/assistant exchanges, at most [`OpenAiConfig::history_turns`] of them and at most
//! [`OpenAiConfig::history_chars`] characters together with the system prompt and the new
//! message (oldest exchanges dropped first). Only a turn that completes adds its exchange; a
//! failed or cancelled turn leaves the history as it was. `/new` closes the agent, so the
//! next turn starts with an empty conversation.
//!
//! Each turn is one `POST {base}/chat/completions` with `"stream": true`, read as
//! server-sent events; the reply so far is published as partials. The request runs on the
//! turn worker with a blocking client (ureq) over a transport whose waits are cut in short
//! slices, so `/stop` lands within [`transport::SLICE`] plus a chunk's processing even while
//! the server is silent, and the abandoned connection is closed. 429 and 5xx answers are
//! retried (at most [`OpenAiConfig::max_retries`] times) after a backoff with jitter, or
//! after the server's `Retry-After`; each wait ends at once on cancellation.
//!
//! The API key is sent as a bearer token and is never logged nor put in an error: the
//! failure texts are scrubbed of it even if a server echoes it back.

mod sse;
mod transport;

use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{BufReader, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{Connector, RustlsConnector};

use crate::agent::{Agent, AgentFactory, AgentUsage, CancelToken, TurnError, TurnInput};
use crate::message::{MessageContext, SessionKey};
use crate::reactor::DEFAULT_MAX_REPLY_BYTES;
use sse::{Event, SseError, SseReader};
use transport::{CancellableConnector, is_cancel_error};

/// Default number of past user/assistant exchanges sent with each message.
pub(crate) const DEFAULT_HISTORY_TURNS: usize = 20;
/// Default character budget of a request's conversation (system prompt, kept exchanges and
/// the new message): about 6,000 tokens at ~4 characters a token, which leaves room for
/// the reply in the 8k context of small local models.
pub(crate) const DEFAULT_HISTORY_CHARS: usize = 24_000;
/// Default time to open a connection.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest silence of the server (before the first byte, or between two reads of
/// the stream). Local models can take long before the first token of a large prompt.
pub(crate) const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(120);
/// Retries after a 429 or 5xx answer.
pub(crate) const DEFAULT_MAX_RETRIES: u32 = 3;
/// First backoff before a retry without `Retry-After`; doubles each retry.
pub(crate) const DEFAULT_RETRY_BASE: Duration = Duration::from_secs(1);
/// A `Retry-After` longer than this is not waited for: the turn fails and says so.
pub(crate) const DEFAULT_MAX_RETRY_WAIT: Duration = Duration::from_secs(60);

/// The longest error body read for its message.
const MAX_ERROR_BODY: u64 = 16 * 1024;
/// The longest stream line accepted.
const MIN_LINE_BOUND: usize = 256 * 1024;

/// The bearer token. Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key; `None` when empty.
    pub fn new(key: impl Into<String>) -> Option<ApiKey> {
        let key = key.into();
        (!key.trim().is_empty()).then(|| ApiKey(key.trim().to_owned()))
    }

    /// Reads the key from the environment variable `name`; `Ok(None)` when it is unset or
    /// empty, `Err` when it is not UTF-8 (the message names the variable, never the value).
    pub fn from_env(name: &str) -> Result<Option<ApiKey>, String> {
        match std::env::var(name) {
            Ok(v) => Ok(ApiKey::new(v)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(format!("${name} is not valid UTF-8")),
        }
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(redacted)")
    }
}

/// Which certificate authorities an `https` base URL is checked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TlsRoots {
    /// The operating system's store (through rustls-platform-verifier): follows the
    /// machine's CA updates and private CAs.
    #[default]
    Platform,
    /// Mozilla's roots compiled into the binary (webpki-roots): for machines without a CA
    /// store (minimal containers).
    WebPki,
}

/// Settings of the OpenAI-compatible agent.
#[derive(Clone, Debug)]
pub struct OpenAiConfig {
    /// The API's base URL, e.g. `http://127.0.0.1:11434/v1`; requests go to
    /// `{base_url}/chat/completions`.
    pub base_url: String,
    /// The model name sent in every request.
    pub model: String,
    /// The bearer token, if the server needs one.
    pub api_key: Option<ApiKey>,
    /// The system prompt, first message of every request.
    pub system_prompt: Option<String>,
    /// Past user/assistant exchanges kept (0: none, every turn stands alone).
    pub history_turns: usize,
    /// Character budget of a request's conversation; oldest exchanges are dropped first.
    /// The system prompt and the new message are always sent.
    pub history_chars: usize,
    /// Prefix the sender and meta to the user's text (see [`user_content`]).
    pub sender_prefix: bool,
    /// Time to open a connection.
    pub connect_timeout: Duration,
    /// Longest silence of the server.
    pub read_timeout: Duration,
    /// Retries after a 429 or 5xx answer.
    pub max_retries: u32,
    /// First backoff without `Retry-After` (doubled each retry, plus up to 50 % jitter).
    pub retry_base: Duration,
    /// Longest `Retry-After` waited for.
    pub max_retry_wait: Duration,
    /// The reply stops being read past this many bytes (the turn worker then cuts it to
    /// its own bound and flags it truncated).
    pub max_reply_bytes: usize,
    /// Certificate authorities for `https`.
    pub tls_roots: TlsRoots,
}

impl OpenAiConfig {
    /// Settings for `model` at `base_url`, every other value at its default.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> OpenAiConfig {
        OpenAiConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            system_prompt: None,
            history_turns: DEFAULT_HISTORY_TURNS,
            history_chars: DEFAULT_HISTORY_CHARS,
            sender_prefix: false,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            read_timeout: DEFAULT_READ_TIMEOUT,
            max_retries: DEFAULT_MAX_RETRIES,
            retry_base: DEFAULT_RETRY_BASE,
            max_retry_wait: DEFAULT_MAX_RETRY_WAIT,
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            tls_roots: TlsRoots::Platform,
        }
    }
}

/// What every agent of a factory shares: settings, the HTTP client (and its connection
/// pool), the usage totals.
struct Shared {
    cfg: OpenAiConfig,
    url: String,
    http: ureq::Agent,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

impl Shared {
    /// `text` with the API key replaced, for anything that leaves the agent.
    fn scrub(&self, text: String) -> String {
        match &self.cfg.api_key {
            Some(ApiKey(k)) if text.contains(k.as_str()) => text.replace(k.as_str(), "[redacted]"),
            _ => text,
        }
    }
}

/// Creates one [`OpenAiAgent`] per session; reports the token totals of all of them.
#[derive(Clone)]
pub struct OpenAiFactory {
    shared: Arc<Shared>,
}

impl fmt::Debug for OpenAiFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiFactory")
            .field("url", &self.shared.url)
            .field("model", &self.shared.cfg.model)
            .finish()
    }
}

impl OpenAiFactory {
    /// Checks the settings and prepares the HTTP client.
    pub fn new(cfg: OpenAiConfig) -> Result<OpenAiFactory, String> {
        let base = cfg.base_url.trim().trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "base URL {base:?} must start with http:// or https://"
            ));
        }
        let url = format!("{base}/chat/completions");
        match url.parse::<ureq::http::Uri>() {
            Ok(u) if u.host().is_some_and(|h| !h.is_empty()) => {}
            _ => return Err(format!("base URL {base:?} is not a valid URL")),
        }
        if cfg.model.trim().is_empty() {
            return Err("the model name must not be empty".into());
        }
        if cfg.max_reply_bytes == 0 {
            return Err("max_reply_bytes must be at least 1".into());
        }
        if cfg.connect_timeout.is_zero() || cfg.read_timeout.is_zero() {
            return Err("the connect and read timeouts must be greater than zero".into());
        }
        let roots = match cfg.tls_roots {
            TlsRoots::Platform => ureq::tls::RootCerts::PlatformVerifier,
            TlsRoots::WebPki => ureq::tls::RootCerts::WebPki,
        };
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .max_idle_connections(256)
            .max_idle_connections_per_host(256)
            .user_agent(concat!("turnstile/", env!("CARGO_PKG_VERSION")))
            .tls_config(ureq::tls::TlsConfig::builder().root_certs(roots).build())
            .build();
        let connector = ().chain(CancellableConnector).chain(RustlsConnector::default());
        let http = ureq::Agent::with_parts(config, connector, DefaultResolver::default());
        log::info!(
            "openai agent: model {:?} at {url}, {}",
            cfg.model,
            if cfg.api_key.is_some() {
                "with an API key"
            } else {
                "without an API key"
            }
        );
        Ok(OpenAiFactory {
            shared: Arc::new(Shared {
                cfg,
                url,
                http,
                prompt_tokens: AtomicU64::new(0),
                completion_tokens: AtomicU64::new(0),
            }),
        })
    }

    /// The endpoint requests go to.
    pub fn url(&self) -> &str {
        &self.shared.url
    }

    /// A fresh agent for `session` (what [`AgentFactory::create`] returns, unboxed).
    pub fn agent(&self, session: &SessionKey) -> OpenAiAgent {
        OpenAiAgent {
            shared: Arc::clone(&self.shared),
            session: session.clone(),
            history: History::default(),
            usage: AgentUsage::default(),
            turns: 0,
        }
    }
}

impl AgentFactory for OpenAiFactory {
    fn create(&self, session: &SessionKey) -> Result<Box<dyn Agent>, crate::agent::AgentError> {
        Ok(Box::new(self.agent(session)))
    }

    fn usage(&self) -> Option<AgentUsage> {
        Some(AgentUsage {
            prompt_tokens: self.shared.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: self.shared.completion_tokens.load(Ordering::Relaxed),
        })
    }
}

/// A session's conversation: past exchanges, oldest first, with their character counts.
#[derive(Debug, Default)]
struct History {
    turns: VecDeque<Exchange>,
    chars: usize,
}

#[derive(Debug)]
struct Exchange {
    user: String,
    assistant: String,
    chars: usize,
}

impl History {
    /// Adds a completed exchange, then drops the oldest past either bound.
    fn push(&mut self, user: String, assistant: String, max_turns: usize, max_chars: usize) {
        let chars = user.chars().count() + assistant.chars().count();
        self.turns.push_back(Exchange {
            user,
            assistant,
            chars,
        });
        self.chars += chars;
        while self.turns.len() > max_turns || (self.chars > max_chars && !self.turns.is_empty()) {
            if let Some(old) = self.turns.pop_front() {
                self.chars -= old.chars;
            }
        }
    }

    /// The newest exchanges whose characters fit in `budget`, oldest first.
    fn fitting(&self, budget: usize) -> impl Iterator<Item = &Exchange> {
        let mut used = 0;
        let kept = self
            .turns
            .iter()
            .rev()
            .take_while(|e| {
                used += e.chars;
                used <= budget
            })
            .count();
        self.turns.iter().skip(self.turns.len() - kept)
    }
}

/// The user content sent for a message.
///
/// Without `sender_prefix` it is the text unchanged. With it, a first line names the
/// sender and carries the bridge's meta, then the text follows on the next line:
///
/// ```text
/// [from: Alice (id u42); meta: {"reply_to":"m7"}]
/// what about tomorrow?
/// ```
///
/// Parts that are absent are left out (`[from: id u42]`, `[meta: {…}]`); with no sender
/// and no meta the text is unchanged.
pub(crate) fn user_content(text: &str, ctx: &MessageContext, sender_prefix: bool) -> String {
    if !sender_prefix {
        return text.to_owned();
    }
    let from = match (ctx.user_name.as_deref(), ctx.user_id.as_deref()) {
        (Some(name), Some(id)) => Some(format!("from: {name} (id {id})")),
        (Some(name), None) => Some(format!("from: {name}")),
        (None, Some(id)) => Some(format!("from: id {id}")),
        (None, None) => None,
    };
    let meta = ctx.meta.as_deref().map(|m| format!("meta: {m}"));
    let parts: Vec<String> = from.into_iter().chain(meta).collect();
    if parts.is_empty() {
        text.to_owned()
    } else {
        format!("[{}]\n{text}", parts.join("; "))
    }
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: Vec<ChatMessage<'a>>,
    stream: bool,
    stream_options: StreamOptions,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// One session's agent: its conversation and the tokens its turns used.
pub struct OpenAiAgent {
    shared: Arc<Shared>,
    session: SessionKey,
    history: History,
    usage: AgentUsage,
    turns: u64,
}

impl fmt::Debug for OpenAiAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiAgent")
            .field("session", &self.session)
            .field("exchanges", &self.history.turns.len())
            .field("usage", &self.usage)
            .finish()
    }
}

/// A streamed reply.
struct Streamed {
    text: String,
    usage: Option<sse::Usage>,
}

/// Why a request ended without a reply.
enum Stop {
    Cancelled,
    Failed(String),
}

impl OpenAiAgent {
    /// Tokens this session's turns used so far.
    pub fn usage(&self) -> AgentUsage {
        self.usage
    }

    /// Past exchanges kept.
    pub fn history_len(&self) -> usize {
        self.history.turns.len()
    }

    /// The request body for `user` after the kept history.
    fn request_body(&self, user: &str) -> Vec<u8> {
        let cfg = &self.shared.cfg;
        let system = cfg.system_prompt.as_deref().filter(|s| !s.is_empty());
        let fixed = system.map_or(0, |s| s.chars().count()) + user.chars().count();
        let budget = cfg.history_chars.saturating_sub(fixed);
        let mut messages = Vec::with_capacity(2 + 2 * self.history.turns.len());
        if let Some(s) = system {
            messages.push(ChatMessage {
                role: "system",
                content: s,
            });
        }
        for e in self.history.fitting(budget) {
            messages.push(ChatMessage {
                role: "user",
                content: &e.user,
            });
            messages.push(ChatMessage {
                role: "assistant",
                content: &e.assistant,
            });
        }
        messages.push(ChatMessage {
            role: "user",
            content: user,
        });
        let req = ChatRequest {
            model: &cfg.model,
            messages,
            stream: true,
            stream_options: StreamOptions {
                include_usage: true,
            },
        };
        // Serializing strings and numbers into a Vec cannot fail.
        serde_json::to_vec(&req).unwrap_or_default()
    }

    /// Sends the request, retrying 429 and 5xx, and streams the reply.
    fn request(
        &self,
        body: &[u8],
        input: &TurnInput<'_>,
        cancel: &CancelToken,
    ) -> Result<Streamed, Stop> {
        let shared = &*self.shared;
        let cfg = &shared.cfg;
        let url = &shared.url;
        let mut attempt = 0;
        loop {
            if cancel.is_cancelled() {
                return Err(Stop::Cancelled);
            }
            let mut req = shared
                .http
                .post(url)
                .header("Content-Type", "application/json")
                .header("Accept", "text/event-stream");
            if let Some(ApiKey(key)) = &cfg.api_key {
                req = req.header("Authorization", format!("Bearer {key}"));
            }
            let response = match req.send(body) {
                Ok(r) => r,
                Err(e) if cancel.is_cancelled() || is_cancel_error(&e) => {
                    return Err(Stop::Cancelled);
                }
                Err(e) => return Err(Stop::Failed(describe(&e, url))),
            };
            let status = response.status().as_u16();
            if (200..300).contains(&status) {
                return self.stream(response, input, cancel);
            }
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(parse_retry_after);
            let message = {
                let mut body = response.into_body();
                let text = body
                    .with_config()
                    .limit(MAX_ERROR_BODY)
                    .lossy_utf8(true)
                    .read_to_string();
                if cancel.is_cancelled() {
                    return Err(Stop::Cancelled);
                }
                text.ok().and_then(|t| sse::error_message(&t))
            };
            let reason = message.clone().unwrap_or_else(|| {
                ureq::http::StatusCode::from_u16(status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("error")
                    .to_owned()
            });
            let retryable = status == 429 || (500..600).contains(&status);
            if retryable && attempt < cfg.max_retries {
                let Some(wait) = retry_wait(attempt, retry_after, cfg) else {
                    return Err(Stop::Failed(format!(
                        "{status} {reason} (from {url}; the server asks to retry after {} s, more than the {} s this agent waits)",
                        retry_after.map_or(0, |d| d.as_secs()),
                        cfg.max_retry_wait.as_secs()
                    )));
                };
                attempt += 1;
                log::warn!(
                    "session {}: {url} answered {status} {}; retry {attempt}/{} in {:.1} s",
                    self.session,
                    shared.scrub(reason),
                    cfg.max_retries,
                    wait.as_secs_f64()
                );
                if cancel.wait_timeout(wait) {
                    return Err(Stop::Cancelled);
                }
                continue;
            }
            let mut text = format!("{status} {reason} (from {url}");
            if status == 404 && message.is_none() {
                text.push_str(&format!(
                    "; check the base URL and the model {:?}",
                    cfg.model
                ));
            }
            if attempt > 0 {
                text.push_str(&format!("; gave up after {attempt} retries"));
            }
            text.push(')');
            return Err(Stop::Failed(text));
        }
    }

    /// Reads the event stream into the reply, publishing it as it grows.
    fn stream(
        &self,
        response: ureq::http::Response<ureq::Body>,
        input: &TurnInput<'_>,
        cancel: &CancelToken,
    ) -> Result<Streamed, Stop> {
        let cfg = &self.shared.cfg;
        let url = &self.shared.url;
        let max_line = cfg.max_reply_bytes.saturating_add(4096).max(MIN_LINE_BOUND);
        // Deltas arrive wrapped in JSON, several times their size; allow generously for
        // that and for chunks that carry no text, but not without end.
        let max_total = cfg.max_reply_bytes.saturating_mul(16).max(16 << 20);
        let reader = BufReader::with_capacity(16 * 1024, response.into_body().into_reader());
        let mut events = SseReader::new(reader, max_line, max_total);
        let mut text = String::new();
        let mut usage = None;
        let mut finished = false;
        let mut count = 0usize;
        let fail = |why: String| Err(Stop::Failed(why));
        loop {
            if cancel.is_cancelled() {
                return Err(Stop::Cancelled);
            }
            let data = match events.next_event() {
                Ok(Some(d)) => d,
                Ok(None) => break,
                Err(_) if cancel.is_cancelled() => return Err(Stop::Cancelled),
                Err(SseError::Io(e)) => {
                    let e = ureq::Error::from(e);
                    if is_cancel_error(&e) {
                        return Err(Stop::Cancelled);
                    }
                    return fail(format!(
                        "the stream from {url} broke after {} bytes of reply: {}",
                        text.len(),
                        describe(&e, url)
                    ));
                }
                Err(SseError::LineTooLong(n)) => {
                    return fail(format!(
                        "malformed stream from {url}: a line longer than {n} bytes"
                    ));
                }
                Err(SseError::TooMuch(n)) => {
                    return fail(format!(
                        "the stream from {url} went past {n} bytes without finishing"
                    ));
                }
                Err(SseError::NotUtf8) => {
                    return fail(format!("malformed stream from {url}: a line is not UTF-8"));
                }
            };
            count += 1;
            let chunk = match sse::decode(&data) {
                Ok(Event::Done) => {
                    finished = true;
                    break;
                }
                Ok(Event::Chunk(c)) => c,
                Err(why) => {
                    return fail(format!("malformed stream from {url}: event {count}: {why}"));
                }
            };
            if let Some(err) = chunk.error {
                let msg = err.message.unwrap_or_else(|| "no message".into());
                return fail(format!("{url} reported an error mid-stream: {msg}"));
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
            if let Some(choice) = chunk.choices.first() {
                if let Some(delta) = choice.delta.as_ref().and_then(|d| d.content.as_deref())
                    && !delta.is_empty()
                {
                    text.push_str(delta);
                    if text.len() > cfg.max_reply_bytes {
                        log::warn!(
                            "session {}: the reply from {url} passed {} bytes; the stream is cut there",
                            self.session,
                            cfg.max_reply_bytes
                        );
                        return Ok(Streamed { text, usage });
                    }
                    input.partials.publish(&text);
                }
                if choice.finish_reason.is_some() {
                    // The usage chunk and [DONE] may follow; a close from here on is fine.
                    finished = true;
                }
            }
        }
        if !finished {
            return fail(format!(
                "{url} closed the stream before it finished ({} bytes of reply received)",
                text.len()
            ));
        }
        // Read the end of the body (normally already sent) so the connection can be
        // reused; a server that keeps it open gets half a second, then it is closed.
        let _short = transport::watch(cancel, cfg.connect_timeout, Duration::from_millis(500));
        let mut sink = [0u8; 512];
        let mut inner = events.into_inner();
        for _ in 0..64 {
            match inner.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        Ok(Streamed { text, usage })
    }
}

impl Agent for OpenAiAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        let started = Instant::now();
        let cfg = &self.shared.cfg;
        let user = user_content(input.text, input.context, cfg.sender_prefix);
        let body = self.request_body(&user);
        let result = {
            let _watch = transport::watch(cancel, cfg.connect_timeout, cfg.read_timeout);
            self.request(&body, input, cancel)
        };
        match result {
            Ok(Streamed { text, usage }) => {
                self.turns += 1;
                if let Some(u) = usage {
                    let u = AgentUsage {
                        prompt_tokens: u.prompt_tokens,
                        completion_tokens: u.completion_tokens,
                    };
                    self.usage += u;
                    let s = &self.shared;
                    s.prompt_tokens
                        .fetch_add(u.prompt_tokens, Ordering::Relaxed);
                    s.completion_tokens
                        .fetch_add(u.completion_tokens, Ordering::Relaxed);
                }
                log::debug!(
                    "session {}: openai turn: {} bytes of request, {} bytes of reply, usage {:?}, {:?}",
                    self.session,
                    body.len(),
                    text.len(),
                    usage,
                    started.elapsed()
                );
                let cfg = &self.shared.cfg;
                self.history
                    .push(user, text.clone(), cfg.history_turns, cfg.history_chars);
                Ok(text)
            }
            Err(Stop::Cancelled) => Err(TurnError::Cancelled),
            Err(Stop::Failed(why)) => {
                let why = self.shared.scrub(why);
                log::warn!("session {}: openai turn failed: {why}", self.session);
                Err(TurnError::Failed(why.into()))
            }
        }
    }

    fn close(&mut self) -> Result<(), crate::agent::AgentError> {
        if self.turns > 0 {
            log::info!(
                "session {}: openai agent closed after {} turns: {} prompt + {} completion tokens",
                self.session,
                self.turns,
                self.usage.prompt_tokens,
                self.usage.completion_tokens
            );
        }
        Ok(())
    }
}

/// A user-facing description of a request error (never containing headers).
fn describe(e: &ureq::Error, url: &str) -> String {
    use std::io::ErrorKind as K;
    match e {
        ureq::Error::Io(io) => match io.kind() {
            K::ConnectionRefused => format!("cannot connect to {url}: connection refused"),
            K::TimedOut => format!("{url}: {io}"),
            K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => {
                format!("{url} closed the connection ({io})")
            }
            _ => format!("request to {url} failed: {io}"),
        },
        ureq::Error::HostNotFound => format!("cannot resolve the host of {url}"),
        ureq::Error::Timeout(t) => format!("{url}: timed out ({t})"),
        ureq::Error::Tls(_) | ureq::Error::Rustls(_) => format!("TLS with {url} failed: {e}"),
        ureq::Error::TooManyRedirects | ureq::Error::RedirectFailed => {
            format!("{url} answered with a redirect; point the base URL at the final address")
        }
        other => format!("request to {url} failed: {other}"),
    }
}

/// `Retry-After` in seconds (decimal allowed); HTTP dates are not honoured (`None`).
fn parse_retry_after(v: &str) -> Option<Duration> {
    let secs: f64 = v.trim().parse().ok()?;
    (secs.is_finite() && (0.0..1e9).contains(&secs)).then(|| Duration::from_secs_f64(secs))
}

/// A random fraction in [0, 1).
fn jitter() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// How long to wait before retry `attempt + 1`: the server's `Retry-After` plus up to
/// 250 ms of jitter, or `retry_base * 2^attempt` plus up to 50 % jitter. `None` when the
/// server asks for more than `max_retry_wait`.
fn retry_wait(attempt: u32, retry_after: Option<Duration>, cfg: &OpenAiConfig) -> Option<Duration> {
    match retry_after {
        Some(d) if d > cfg.max_retry_wait => None,
        Some(d) => Some(d + Duration::from_millis(250).mul_f64(jitter())),
        None => {
            let b = cfg.retry_base.saturating_mul(1u32 << attempt.min(16));
            Some((b + b.mul_f64(0.5 * jitter())).min(cfg.max_retry_wait))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_keeps_the_newest_exchanges_within_both_bounds() {
        let mut h = History::default();
        for i in 0..5 {
            h.push(format!("u{i}"), format!("a{i}"), 3, 1000);
        }
        let users: Vec<&str> = h.turns.iter().map(|e| e.user.as_str()).collect();
        assert_eq!(users, ["u2", "u3", "u4"]);
        assert_eq!(h.chars, 12);
        // 4 characters an exchange: a budget of 9 keeps two.
        let fit: Vec<&str> = h.fitting(9).map(|e| e.user.as_str()).collect();
        assert_eq!(fit, ["u3", "u4"]);
        assert_eq!(h.fitting(3).count(), 0);
        assert_eq!(h.fitting(12).count(), 3);
        // The stored history obeys the character budget too.
        h.push("x".repeat(10), "y".repeat(10), 3, 22);
        assert_eq!(h.turns.len(), 1);
        assert_eq!(h.chars, 20);
        h.push("big".repeat(20), String::new(), 3, 22);
        assert!(h.turns.is_empty() && h.chars == 0);
        // Exactly at the budget is within it.
        let mut h = History::default();
        h.push("ab".into(), "cd".into(), 3, 8);
        h.push("ef".into(), "gh".into(), 3, 8);
        assert_eq!((h.turns.len(), h.chars), (2, 8));
    }

    #[test]
    fn sender_prefix_follows_the_documented_rule() {
        let ctx = MessageContext {
            user_id: Some("u42".into()),
            user_name: Some("Alice".into()),
            meta: Some(r#"{"reply_to":"m7"}"#.into()),
        };
        assert_eq!(user_content("hi", &ctx, false), "hi");
        assert_eq!(
            user_content("hi", &ctx, true),
            "[from: Alice (id u42); meta: {\"reply_to\":\"m7\"}]\nhi"
        );
        let id_only = MessageContext {
            user_id: Some("u42".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &id_only, true), "[from: id u42]\nhi");
        let name_only = MessageContext {
            user_name: Some("Al".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &name_only, true), "[from: Al]\nhi");
        let meta_only = MessageContext {
            meta: Some("{}".into()),
            ..MessageContext::default()
        };
        assert_eq!(user_content("hi", &meta_only, true), "[meta: {}]\nhi");
        assert_eq!(user_content("hi", &MessageContext::default(), true), "hi");
    }

    #[test]
    fn retry_waits_honour_retry_after_and_back_off() {
        let cfg = OpenAiConfig::new("http://x/v1", "m");
        for _ in 0..50 {
            let w = retry_wait(0, Some(Duration::from_secs(2)), &cfg).expect("a wait");
            assert!(w >= Duration::from_secs(2) && w <= Duration::from_millis(2250));
            let b0 = retry_wait(0, None, &cfg).expect("a wait");
            assert!(b0 >= Duration::from_secs(1) && b0 <= Duration::from_millis(1500));
            let b2 = retry_wait(2, None, &cfg).expect("a wait");
            assert!(b2 >= Duration::from_secs(4) && b2 <= Duration::from_secs(6));
        }
        assert_eq!(retry_wait(0, Some(Duration::from_secs(61)), &cfg), None);
        assert!(retry_wait(0, Some(Duration::from_secs(60)), &cfg).is_some());
        // The jitter varies.
        let waits: std::collections::HashSet<Duration> =
            (0..20).filter_map(|_| retry_wait(1, None, &cfg)).collect();
        assert!(waits.len() > 1, "no jitter: {waits:?}");
        assert_eq!(
            retry_wait(30, None, &cfg),
            Some(cfg.max_retry_wait),
            "a long backoff is capped"
        );
        assert_eq!(parse_retry_after(" 1 "), Some(Duration::from_secs(1)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }

    #[test]
    fn factory_checks_its_settings() {
        assert!(OpenAiFactory::new(OpenAiConfig::new("ftp://x/v1", "m")).is_err());
        assert!(OpenAiFactory::new(OpenAiConfig::new("http://", "m")).is_err());
        assert!(OpenAiFactory::new(OpenAiConfig::new("http://h:1/v1", " ")).is_err());
        let f = OpenAiFactory::new(OpenAiConfig::new("http://h:1/v1/", "m")).expect("valid");
        assert_eq!(f.url(), "http://h:1/v1/chat/completions");
        assert_eq!(
            format!("{:?}", ApiKey::new("sk-secret")),
            "Some(ApiKey(redacted))"
        );
        assert_eq!(ApiKey::new("  "), None);
        let mut cfg = OpenAiConfig::new("http://h:1/v1", "m");
        cfg.api_key = ApiKey::new("sk-secret");
        let f = OpenAiFactory::new(cfg).expect("valid");
        let shown = format!(
            "{f:?} {:?}",
            f.agent(&SessionKey::dm("t", "1").expect("key"))
        );
        assert!(
            shown.contains("http://h:1/v1/chat/completions") && shown.contains("t:dm:1"),
            "{shown}"
        );
        assert!(!shown.contains("sk-secret"), "{shown}");
    }
}
