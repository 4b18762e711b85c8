//! The agent's settings: the endpoint, the model, the key, the conversation's bounds, the
//! timeouts and retries.

use std::fmt;
use std::time::Duration;

use crate::reactor::DEFAULT_MAX_REPLY_BYTES;

/// Default number of past user/assistant exchanges sent with each message.
pub(crate) const DEFAULT_HISTORY_TURNS: usize = 20;
/// Default character budget of a request's conversation (system prompt, kept exchanges and
/// the new message): about 6,000 tokens at ~4 characters a token, which leaves room for
/// the reply in the 8k context of small local models.
pub(crate) const DEFAULT_HISTORY_CHARS: usize = 24_000;
/// Default time to open a connection.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default longest the server may go without sending content (before the first token, or
/// between two tokens); SSE comments, keep-alives and empty deltas do not count. Local
/// models can take long before the first token of a large prompt.
pub(crate) const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(120);
/// Default longest a request may take in all (connect, retries, the whole stream); below
/// the default turn timeout (600 s), so a dripping stream fails the turn with its reason.
pub(crate) const DEFAULT_STREAM_TIMEOUT: Duration = Duration::from_secs(300);
/// Default bytes of text files inlined in one message, all its files together: about 4,000
/// tokens, two thirds of the default `history_chars`, so the system prompt and the message
/// still fit beside it and the exchange that carries it is kept in the history (a larger
/// one would crowd the whole conversation out of the 8k context of small local models).
pub(crate) const DEFAULT_INLINE_TEXT_BYTES: usize = 16 * 1024;
/// Retries after a 429 or 5xx answer.
pub(crate) const DEFAULT_MAX_RETRIES: u32 = 3;
/// First backoff before a retry without `Retry-After`; doubles each retry.
pub(crate) const DEFAULT_RETRY_BASE: Duration = Duration::from_secs(1);
/// A `Retry-After` longer than this is not waited for: the turn fails and says so.
pub(crate) const DEFAULT_MAX_RETRY_WAIT: Duration = Duration::from_secs(60);

/// The bearer token. Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub(super) String);

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
    /// `{base_url}/chat/completions`, the path inserted before a query
    /// (`…/v1?api-version=X` → `…/v1/chat/completions?api-version=X`). Logs and errors show
    /// it with its userinfo and query redacted.
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
    /// Prefix the sender and meta to the user's text (the rule is in docs/agents.md: sender, then meta, then the text).
    pub sender_prefix: bool,
    /// Time to open a connection.
    pub connect_timeout: Duration,
    /// Longest the server may go without sending content (comments and empty deltas do not
    /// count).
    pub read_timeout: Duration,
    /// Longest a request may take in all: connect, retries and the whole stream.
    pub stream_timeout: Duration,
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
    /// Send a message's images (PNG, JPEG, GIF, WebP) to the model as `image_url` parts
    /// (base64 data URLs), for vision models; off (the default), they are named in the text.
    pub vision: bool,
    /// Bytes of a message's images sent at most, all together (the binary takes
    /// `--max-attachment-bytes`); an image past it is named instead. A request holds about
    /// 2.7 times this (base64, then the JSON body) while it is built.
    pub max_image_bytes: u64,
    /// Bytes of text files (`text/*`, JSON, XML, YAML, …) inlined in one message, all its
    /// files together; a file past it is cut (and says so), the next ones named.
    pub inline_text_bytes: usize,
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
            stream_timeout: DEFAULT_STREAM_TIMEOUT,
            max_retries: DEFAULT_MAX_RETRIES,
            retry_base: DEFAULT_RETRY_BASE,
            max_retry_wait: DEFAULT_MAX_RETRY_WAIT,
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            tls_roots: TlsRoots::Platform,
            vision: false,
            max_image_bytes: crate::attachments::DEFAULT_MAX_ATTACHMENT_BYTES,
            inline_text_bytes: DEFAULT_INLINE_TEXT_BYTES,
        }
    }
}
