//! The Bot API: the HTTP calls (behind [`BotApi`], so the renderer is tested with a
//! scripted one), how their answers are classified, and the token kept out of every error.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::platforms::secrets::{self, redact};

/// The longest `retry_after` honoured as given; a longer one is waited in this much.
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Longest API response body read (a full `getUpdates` batch of 100 updates fits).
const MAX_RESPONSE_BYTES: u64 = 32 << 20;

/// How a Bot API call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ApiError {
    /// 429: call nothing before this much time passed.
    RetryAfter(Duration),
    /// 401 or 404 on the bot's URL: the token is wrong. Fatal.
    Unauthorized(String),
    /// Another 4xx: this call will never work (chat gone, message not editable, …).
    Permanent(String),
    /// Network trouble or a 5xx: try again later.
    Transient(String),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::RetryAfter(d) => write!(f, "rate limited for {d:?}"),
            ApiError::Unauthorized(d) | ApiError::Permanent(d) | ApiError::Transient(d) => {
                f.write_str(d)
            }
        }
    }
}

/// The Bot API as the bridge uses it: one method call, JSON in, the `result` out.
pub(crate) trait BotApi {
    /// Calls `method` with `params`, waiting at most `timeout`.
    fn call(&mut self, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError>;
}

/// The real Bot API over ureq (a clone shares the connection pool).
#[derive(Clone)]
pub(crate) struct HttpBotApi {
    agent: ureq::Agent,
    base: String,
    token: Arc<str>,
}

impl HttpBotApi {
    /// A client of `base` (e.g. `https://api.telegram.org`) for the bot `token`.
    pub(crate) fn new(base: &str, token: &str) -> HttpBotApi {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("turnstile/", env!("CARGO_PKG_VERSION")))
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build();
        secrets::register(token);
        HttpBotApi {
            agent: ureq::Agent::new_with_config(config),
            base: base.trim_end_matches('/').to_owned(),
            token: token.into(),
        }
    }
}

impl BotApi for HttpBotApi {
    fn call(&mut self, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError> {
        let url = format!("{}/bot{}/{method}", self.base, self.token);
        let transient = |e: String| ApiError::Transient(redact(&e).into_owned());
        debug_redacted!("telegram: calling {method}");
        let response = self
            .agent
            .post(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("Content-Type", "application/json")
            .send(params.to_string())
            .map_err(|e| transient(format!("{method}: {e}")))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| transient(format!("{method}: reading the answer failed: {e}")))?;
        interpret(method, status, &body).map_err(|e| match e {
            ApiError::Transient(d) => ApiError::Transient(redact(&d).into_owned()),
            ApiError::Permanent(d) => ApiError::Permanent(redact(&d).into_owned()),
            ApiError::Unauthorized(d) => ApiError::Unauthorized(redact(&d).into_owned()),
            other => other,
        })
    }
}

/// Reads a Bot API answer: `{"ok":true,"result":…}` or `{"ok":false,"error_code":…,
/// "description":…,"parameters":{"retry_after":…}}`.
pub(crate) fn interpret(method: &str, status: u16, body: &str) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_str(body).map_err(|_| {
        let what = format!("{method}: HTTP {status} with a body that is not JSON");
        if (500..600).contains(&status) || status == 429 {
            ApiError::Transient(what)
        } else if status == 401 || status == 404 {
            ApiError::Unauthorized(format!("{what} (is the bot token right?)"))
        } else {
            ApiError::Transient(what)
        }
    })?;
    if v.get("ok").and_then(Value::as_bool) == Some(true) {
        return Ok(v.get("result").cloned().unwrap_or(Value::Null));
    }
    let code = v
        .get("error_code")
        .and_then(Value::as_u64)
        .unwrap_or(u64::from(status));
    let description = v
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("no description");
    let what = format!("{method}: {code} {description}");
    Err(match code {
        429 => {
            let secs = v
                .pointer("/parameters/retry_after")
                .and_then(Value::as_f64)
                .filter(|s| s.is_finite() && *s >= 0.0)
                .unwrap_or(1.0);
            ApiError::RetryAfter(Duration::from_secs_f64(secs).min(MAX_RETRY_AFTER))
        }
        401 | 404 => ApiError::Unauthorized(format!("{what} (is the bot token right?)")),
        400..=499 => ApiError::Permanent(what),
        _ => ApiError::Transient(what),
    })
}

/// A chat id as the Bot API takes it: a number when it is one.
pub(super) fn chat_param(chat_id: &str) -> Value {
    chat_id
        .parse::<i64>()
        .map_or_else(|_| json!(chat_id), |n| json!(n))
}

/// The `sendMessage` parameters for `text` in `chat_id`, replying to `reply_to` if given.
pub(super) fn send_params(chat_id: &str, text: &str, reply_to: Option<i64>) -> Value {
    let mut p = json!({"chat_id": chat_param(chat_id), "text": text});
    if let Some(r) = reply_to {
        p["reply_parameters"] = json!({"message_id": r, "allow_sending_without_reply": true});
    }
    p
}
