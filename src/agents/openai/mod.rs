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
//! The API key is sent as a bearer token and is never logged nor put in an error. Chat users
//! get a short generic failure ("the model server is unavailable (HTTP 503)"); the details
//! go to the log (a WARN naming the session), with the endpoint's userinfo and query
//! redacted and any text from the server filtered (see [`redact`]: the key and the URL's
//! secrets case-insensitively, and key-like strings).
//!
//! [`OpenAiConfig::read_timeout`] is the longest the server may go without sending
//! content: SSE comments, keep-alives and empty deltas do not reset it. The whole request
//! (connect, retries, stream) ends after [`OpenAiConfig::stream_timeout`].

mod attach;
mod config;
mod history;
mod redact;
mod retry;
mod sse;
mod transport;

use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{Connector, RustlsConnector};

use crate::agent::{
    Agent, AgentFactory, AgentFailures, AgentUsage, CancelToken, TurnError, TurnInput,
};
use crate::journal::memory::MemoryLoader;
use crate::message::SessionKey;
use sse::{Event, SseError, SseReader};
use transport::{CancellableConnector, is_cancel_error};

pub use config::{ApiKey, OpenAiConfig, TlsRoots};
// The defaults `turnstile serve` shows in its help (feature `cli`).
use attach::{Content, UserTurn, user_turn};
#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_HISTORY_CHARS, DEFAULT_HISTORY_TURNS,
    DEFAULT_INLINE_TEXT_BYTES, DEFAULT_READ_TIMEOUT, DEFAULT_STREAM_TIMEOUT,
};
use history::{History, user_content};
use retry::{Refused, give_up_text, retry_wait, unavailable};

/// The longest stream line accepted.
const MIN_LINE_BOUND: usize = 256 * 1024;

/// What every agent of a factory shares: settings, the HTTP client (and its connection
/// pool), the usage totals.
struct Shared {
    cfg: OpenAiConfig,
    /// Where requests go (may hold credentials: never shown).
    request_url: String,
    /// The same, userinfo and query redacted: what logs and errors say.
    shown: String,
    /// The URL's userinfo and query values, filtered from any text.
    secrets: Vec<String>,
    http: ureq::Agent,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Failed requests: connect, status, stall ([`AgentFailures`]).
    failures: [AtomicU64; 3],
}

/// The index of a failure's kind in [`Shared::failures`].
const CONNECT: usize = 0;
const STATUS: usize = 1;
const STALL: usize = 2;

impl Shared {
    fn count_failure(&self, kind: usize) {
        self.failures[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// `text` with the API key, the URL's secrets and key-like strings replaced, for
    /// anything that leaves the agent.
    fn scrub(&self, text: &str) -> String {
        let mut secrets: Vec<&str> = self.secrets.iter().map(String::as_str).collect();
        if let Some(ApiKey(k)) = &self.cfg.api_key {
            secrets.push(k);
        }
        redact::scrub(text, &secrets)
    }
}

/// Creates one [`OpenAiAgent`] per session; reports the token totals of all of them.
#[derive(Clone)]
pub struct OpenAiFactory {
    shared: Arc<Shared>,
    /// Reads a session's stored conversation back (`--data-dir`); with it, agents hand
    /// their conversation to the journal after each reply.
    memory: Option<MemoryLoader>,
}

impl fmt::Debug for OpenAiFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiFactory")
            .field("url", &self.shared.shown)
            .field("model", &self.shared.cfg.model)
            .finish()
    }
}

impl OpenAiFactory {
    /// Checks the settings and prepares the HTTP client.
    pub fn new(cfg: OpenAiConfig) -> Result<OpenAiFactory, String> {
        let base = cfg.base_url.trim().trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err("the base URL must start with http:// or https://".into());
        }
        let redact::Endpoint {
            url,
            shown,
            secrets,
        } = redact::endpoint(base);
        match url.parse::<ureq::http::Uri>() {
            Ok(u) if u.host().is_some_and(|h| !h.is_empty()) => {}
            _ => return Err(format!("base URL {shown:?} is not a valid URL")),
        }
        if cfg.model.trim().is_empty() {
            return Err("the model name must not be empty".into());
        }
        if cfg.max_reply_bytes == 0 {
            return Err("max_reply_bytes must be at least 1".into());
        }
        if cfg.connect_timeout.is_zero()
            || cfg.read_timeout.is_zero()
            || cfg.stream_timeout.is_zero()
        {
            return Err("the connect, read and stream timeouts must be greater than zero".into());
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
            "openai agent: model {:?} at {shown}, {}",
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
                request_url: url,
                shown,
                secrets,
                http,
                prompt_tokens: AtomicU64::new(0),
                completion_tokens: AtomicU64::new(0),
                failures: Default::default(),
            }),
            memory: None,
        })
    }

    /// The same factory, its agents' conversations durable: each agent starts from the
    /// session's stored conversation (read by `load`) and hands its conversation to the
    /// journal after each reply, written with the turn's outcome.
    pub(crate) fn with_memory(self, load: MemoryLoader) -> OpenAiFactory {
        OpenAiFactory {
            memory: Some(load),
            ..self
        }
    }

    /// The endpoint requests go to, as shown: userinfo and query redacted.
    pub fn url(&self) -> &str {
        &self.shared.shown
    }

    /// A fresh agent for `session` (what [`AgentFactory::create`] returns, unboxed): with
    /// durable memory, its conversation is the one stored for the session (none if it
    /// cannot be read: logged, and the conversation starts anew).
    pub fn agent(&self, session: &SessionKey) -> OpenAiAgent {
        let cfg = &self.shared.cfg;
        let history = match &self.memory {
            None => History::default(),
            Some(load) => match load(session.as_str()) {
                Ok(exchanges) => History::restored(exchanges, cfg.history_turns, cfg.history_chars),
                Err(e) => {
                    log::warn!(
                        "session {session}: the stored conversation cannot be read ({e}); it starts anew"
                    );
                    History::default()
                }
            },
        };
        OpenAiAgent {
            shared: Arc::clone(&self.shared),
            session: session.clone(),
            history,
            durable: self.memory.is_some(),
            replied: false,
            usage: AgentUsage::default(),
            turns: 0,
            last_turn: None,
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

    fn failures(&self) -> Option<AgentFailures> {
        let read = |k: usize| self.shared.failures[k].load(Ordering::Relaxed);
        let mut f = AgentFailures::default();
        (f.connect, f.status, f.stall) = (read(CONNECT), read(STATUS), read(STALL));
        Some(f)
    }

    fn usage_by_model(&self) -> Vec<crate::agent::ModelUsage> {
        self.usage()
            .map(|usage| crate::agent::ModelUsage {
                model: self.shared.cfg.model.clone(),
                usage,
            })
            .into_iter()
            .collect()
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
    content: Content<'a>,
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
    /// Whether the conversation is handed to the journal after each reply.
    durable: bool,
    /// The last turn replied (and pushed its exchange) since the journal was handed the
    /// conversation.
    replied: bool,
    usage: AgentUsage,
    turns: u64,
    /// What the last turn's server reported (`None`: nothing, or nothing plausible).
    last_turn: Option<AgentUsage>,
}

impl fmt::Debug for OpenAiAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiAgent")
            .field("session", &self.session)
            .field("exchanges", &self.history.len())
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
    /// `user`: the short generic text the chat sees; `detail`: what the log says (scrubbed
    /// before it is logged).
    Failed {
        user: String,
        detail: String,
    },
}

fn failed(user: impl Into<String>, detail: String) -> Stop {
    Stop::Failed {
        user: user.into(),
        detail,
    }
}

/// What the chat sees of a malformed stream.
const MALFORMED: &str = "the model server sent a malformed reply";

impl OpenAiAgent {
    /// Tokens this session's turns used so far.
    pub fn usage(&self) -> AgentUsage {
        self.usage
    }

    /// Past exchanges kept.
    pub fn history_len(&self) -> usize {
        self.history.len()
    }

    /// The request body for `user` after the kept history.
    fn request_body(&self, user: &UserTurn) -> Vec<u8> {
        let cfg = &self.shared.cfg;
        let system = cfg.system_prompt.as_deref().filter(|s| !s.is_empty());
        // Images are not counted: the budget is the conversation's text.
        let fixed = system.map_or(0, |s| s.chars().count()) + user.text.chars().count();
        let budget = cfg.history_chars.saturating_sub(fixed);
        let mut messages = Vec::with_capacity(2 + 2 * self.history.len());
        if let Some(s) = system {
            messages.push(ChatMessage {
                role: "system",
                content: Content::Text(s),
            });
        }
        for e in self.history.fitting(budget) {
            messages.push(ChatMessage {
                role: "user",
                content: Content::Text(&e.user),
            });
            messages.push(ChatMessage {
                role: "assistant",
                content: Content::Text(&e.assistant),
            });
        }
        messages.push(ChatMessage {
            role: "user",
            content: user.content(),
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
        let url = &shared.shown;
        let mut attempt = 0;
        loop {
            if cancel.is_cancelled() {
                return Err(Stop::Cancelled);
            }
            transport::content_arrived();
            let mut req = shared
                .http
                .post(&shared.request_url)
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
                Err(e) => {
                    return Err(request_failed(
                        shared,
                        &e,
                        url,
                        "the model server could not be reached",
                    ));
                }
            };
            let status = response.status().as_u16();
            if (200..300).contains(&status) {
                return self.stream(response, input, cancel);
            }
            shared.count_failure(STATUS);
            let Refused {
                retry_after,
                message,
                reason,
            } = Refused::read(response, status, cancel)?;
            let retryable = status == 429 || (500..600).contains(&status);
            if retryable && attempt < cfg.max_retries {
                let Some(wait) = retry_wait(attempt, retry_after, cfg) else {
                    return Err(failed(
                        unavailable(status),
                        format!(
                            "{status} {reason} (from {url}; the server asks to retry after {} s, more than the {} s this agent waits)",
                            retry_after.map_or(0, |d| d.as_secs()),
                            cfg.max_retry_wait.as_secs()
                        ),
                    ));
                };
                attempt += 1;
                log::warn!(
                    "session {}: {url} answered {status} {}; retry {attempt}/{} in {:.1} s",
                    self.session,
                    shared.scrub(&reason),
                    cfg.max_retries,
                    wait.as_secs_f64()
                );
                if cancel.wait_timeout(wait) {
                    return Err(Stop::Cancelled);
                }
                continue;
            }
            let text = give_up_text(status, &reason, message.is_some(), url, cfg, attempt);
            return Err(failed(unavailable(status), text));
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
        let url = &self.shared.shown;
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
        loop {
            if cancel.is_cancelled() {
                return Err(Stop::Cancelled);
            }
            let Some(data) = next_data(&self.shared, &mut events, cancel, url, text.len())? else {
                break;
            };
            count += 1;
            let chunk = match sse::decode(data) {
                Ok(Event::Done) => {
                    finished = true;
                    break;
                }
                Ok(Event::Chunk(c)) => c,
                Err(why) => {
                    return Err(failed(
                        MALFORMED,
                        format!("malformed stream from {url}: event {count}: {why}"),
                    ));
                }
            };
            if let Some(err) = chunk.error {
                let msg = err.message.unwrap_or_else(|| "no message".into());
                return Err(failed(
                    "the model server reported an error",
                    format!("{url} reported an error mid-stream: {msg}"),
                ));
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
            if let Some(choice) = &chunk.choices.0 {
                if let Some(delta) = choice.delta.as_ref().and_then(|d| d.content.as_ref())
                    && !delta.0.is_empty()
                {
                    transport::content_arrived();
                    text.push_str(&delta.0);
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
            return Err(failed(
                "the model server ended the reply early",
                format!(
                    "{url} closed the stream before it finished ({} bytes of reply received)",
                    text.len()
                ),
            ));
        }
        drain_end(events.into_inner(), cancel, cfg.connect_timeout);
        Ok(Streamed { text, usage })
    }
}

impl Agent for OpenAiAgent {
    fn turn(&mut self, input: &TurnInput<'_>, cancel: &CancelToken) -> Result<String, TurnError> {
        let started = Instant::now();
        let cfg = &self.shared.cfg;
        let text = user_content(input.text, input.context, cfg.sender_prefix);
        let user = user_turn(text, input.context.attachments(), cfg);
        if !user.problems.is_empty() {
            log::warn!(
                "session {}: attachments named instead of sent: {}",
                self.session,
                user.problems.join("; ")
            );
        }
        let body = self.request_body(&user);
        log::debug!(
            "session {}: openai request: {} attachments, {} bytes of images",
            self.session,
            input.context.attachments().len(),
            user.image_bytes()
        );
        // The images live on in the body only, and the body only as long as the turn.
        let user = user.text;
        self.last_turn = None;
        let result = {
            let _watch = transport::watch(
                cancel,
                cfg.connect_timeout,
                cfg.read_timeout,
                Some(cfg.stream_timeout),
            );
            self.request(&body, input, cancel)
        };
        match result {
            Ok(Streamed { text, usage }) => {
                self.turns += 1;
                if let Some(u) = usage.filter(|u| {
                    let ok = AgentUsage::plausible(u.prompt_tokens, u.completion_tokens);
                    if !ok {
                        log::warn!(
                            "session {}: the model server reported implausible usage ({} prompt, {} completion tokens); not counted",
                            input.session,
                            u.prompt_tokens,
                            u.completion_tokens
                        );
                    }
                    ok
                }) {
                    let u = AgentUsage {
                        prompt_tokens: u.prompt_tokens,
                        completion_tokens: u.completion_tokens,
                    };
                    self.usage += u;
                    self.last_turn = Some(u);
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
                self.replied = true;
                Ok(text)
            }
            Err(Stop::Cancelled) => Err(TurnError::Cancelled),
            Err(Stop::Failed { user, detail }) => {
                let detail = self.shared.scrub(&detail);
                log::warn!(
                    "session {}: openai turn failed: {detail} (the chat sees: {user})",
                    self.session
                );
                Err(TurnError::Failed(user.into()))
            }
        }
    }

    fn turn_usage(&self) -> Option<AgentUsage> {
        self.last_turn
    }

    fn durable_memory(&mut self) -> Option<Vec<(String, String)>> {
        let replied = std::mem::take(&mut self.replied);
        (self.durable && replied).then(|| self.history.exchanges())
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

/// The next event's data of the stream; `None` at its end. `received`: bytes of reply so
/// far, for the error text.
fn next_data<'a, R: BufRead>(
    shared: &Shared,
    events: &'a mut SseReader<R>,
    cancel: &CancelToken,
    url: &str,
    received: usize,
) -> Result<Option<&'a str>, Stop> {
    let fail = |why: String| Err(failed(MALFORMED, why));
    match events.next_event() {
        Ok(data) => Ok(data),
        Err(_) if cancel.is_cancelled() => Err(Stop::Cancelled),
        Err(SseError::Io(e)) => {
            let e = ureq::Error::from(e);
            if is_cancel_error(&e) {
                return Err(Stop::Cancelled);
            }
            let Stop::Failed { user, detail } = request_failed(
                shared,
                &e,
                url,
                "the model server stopped sending the reply",
            ) else {
                return Err(Stop::Cancelled);
            };
            Err(failed(
                user,
                format!("the stream from {url} broke after {received} bytes of reply: {detail}"),
            ))
        }
        Err(SseError::LineTooLong(n)) => fail(format!(
            "malformed stream from {url}: a line longer than {n} bytes"
        )),
        Err(SseError::TooMuch(n)) => Err(failed(
            "the model server's reply was too long",
            format!("the stream from {url} went past {n} bytes without finishing"),
        )),
        Err(SseError::NotUtf8) => fail(format!("malformed stream from {url}: a line is not UTF-8")),
    }
}

/// Reads the end of the body (normally already sent) so the connection can be reused; a
/// server that keeps it open gets half a second, then it is closed.
fn drain_end(mut body: impl Read, cancel: &CancelToken, connect_timeout: Duration) {
    let _short = transport::watch(cancel, connect_timeout, Duration::from_millis(500), None);
    let mut sink = [0u8; 512];
    for _ in 0..64 {
        match body.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    // The body goes back (or is closed) while the short watch still holds.
    drop(body);
}

/// A failed request (counted by its kind): the chat's text (`generic`, or the stall or
/// deadline that ended it), and the details for the log.
fn request_failed(shared: &Shared, e: &ureq::Error, url: &str, generic: &str) -> Stop {
    let inner = match e {
        ureq::Error::Io(io) => io.get_ref(),
        _ => None,
    };
    let stalled = inner.is_some_and(|i| {
        i.downcast_ref::<transport::Stall>().is_some()
            || i.downcast_ref::<transport::StreamDeadline>().is_some()
    });
    shared.count_failure(if stalled { STALL } else { CONNECT });
    let user = if let Some(s) = inner.and_then(|i| i.downcast_ref::<transport::Stall>()) {
        format!(
            "the model server stalled (no reply content for {} s)",
            s.0.as_secs_f64()
        )
    } else if let Some(d) = inner.and_then(|i| i.downcast_ref::<transport::StreamDeadline>()) {
        format!(
            "the model server took longer than {} s to reply",
            d.0.as_secs_f64()
        )
    } else {
        generic.to_owned()
    };
    failed(user, describe(e, url))
}

/// A description of a request error for the log (never containing headers).
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

#[cfg(test)]
mod tests {
    use super::*;

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
