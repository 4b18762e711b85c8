//! The Bot API: the HTTP calls (behind [`BotApi`], so the renderer is tested with a
//! scripted one), how their answers are classified, and the token kept out of every error.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::update::Updates;
use crate::platforms::lenient::Lenient;
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

    /// Calls `method` (`sendPhoto`, `sendDocument`) with `params` and the spool file of
    /// `file` as the multipart field `field`, streamed from the disk (issue 36).
    fn upload(
        &mut self,
        method: &str,
        params: &Value,
        field: &str,
        file: &crate::Attachment,
        timeout: Duration,
    ) -> Result<Value, ApiError>;
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

impl HttpBotApi {
    /// Posts `params` to `method`: the answer's status and body (at most
    /// [`MAX_RESPONSE_BYTES`]).
    fn post(
        &mut self,
        method: &str,
        params: &Value,
        timeout: Duration,
    ) -> Result<(u16, String), ApiError> {
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
        Ok((status, body))
    }

    /// `getUpdates` with `params`, read typed and bounded ([`Updates`]): a huge answer costs
    /// its body and at most [`super::update::MAX_UPDATES`] updates, never a tree of it.
    pub(crate) fn get_updates(
        &mut self,
        params: &Value,
        timeout: Duration,
    ) -> Result<Updates, ApiError> {
        let (status, body) = self.post("getUpdates", params, timeout)?;
        interpret("getUpdates", status, &body).map_err(redacted)
    }
}

impl HttpBotApi {
    /// The file at `file_path` (from `getFile`) as a stream: read it in pieces, never whole
    /// (issue 36). A status other than 200 is an error.
    pub(crate) fn download(
        &mut self,
        file_path: &str,
        timeout: Duration,
    ) -> Result<impl std::io::Read + use<>, ApiError> {
        let url = format!("{}/file/bot{}/{file_path}", self.base, self.token);
        let transient = |e: String| ApiError::Transient(redact(&e).into_owned());
        debug_redacted!("telegram: downloading a file");
        let response = self
            .agent
            .get(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .call()
            .map_err(|e| transient(format!("file download: {e}")))?;
        match response.status().as_u16() {
            200 => Ok(response.into_body().into_reader()),
            s @ 400..=499 => Err(ApiError::Permanent(format!("file download: HTTP {s}"))),
            s => Err(ApiError::Transient(format!("file download: HTTP {s}"))),
        }
    }
}

impl BotApi for HttpBotApi {
    fn call(&mut self, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError> {
        let (status, body) = self.post(method, params, timeout)?;
        interpret(method, status, &body).map_err(redacted)
    }

    fn upload(
        &mut self,
        method: &str,
        params: &Value,
        field: &str,
        file: &crate::Attachment,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let form = super::upload::Multipart::open(params, field, file)
            .map_err(|e| ApiError::Permanent(format!("{method}: the file cannot be read: {e}")))?;
        let url = format!("{}/bot{}/{method}", self.base, self.token);
        let transient = |e: String| ApiError::Transient(redact(&e).into_owned());
        debug_redacted!(
            "telegram: calling {method} with a file of {} bytes",
            file.size
        );
        let content_type = form.content_type();
        let length = form.length;
        let response = self
            .agent
            .post(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .header("Content-Type", &content_type)
            .header("Content-Length", &length.to_string())
            .send(ureq::SendBody::from_owned_reader(form.body))
            .map_err(|e| transient(format!("{method}: {e}")))?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| transient(format!("{method}: reading the answer failed: {e}")))?;
        interpret(method, status, &body).map_err(redacted)
    }
}

/// `e` with every form of a secret redacted from its text.
fn redacted(e: ApiError) -> ApiError {
    match e {
        ApiError::Transient(d) => ApiError::Transient(redact(&d).into_owned()),
        ApiError::Permanent(d) => ApiError::Permanent(redact(&d).into_owned()),
        ApiError::Unauthorized(d) => ApiError::Unauthorized(redact(&d).into_owned()),
        other => other,
    }
}

/// A Bot API answer: `{"ok":true,"result":…}` or `{"ok":false,"error_code":…,
/// "description":…,"parameters":{"retry_after":…}}`; the rest skipped unread.
#[derive(Deserialize)]
struct Answer<T> {
    #[serde(default)]
    ok: Lenient<bool>,
    result: Option<T>,
    #[serde(default)]
    error_code: Lenient<u64>,
    #[serde(default)]
    description: Lenient<String>,
    #[serde(default)]
    parameters: Lenient<Parameters>,
}

#[derive(Deserialize)]
struct Parameters {
    #[serde(default)]
    retry_after: Lenient<f64>,
}

/// Reads a Bot API answer into its `result` as a `T` (the default `T` when there is none).
pub(crate) fn interpret<T: DeserializeOwned + Default>(
    method: &str,
    status: u16,
    body: &str,
) -> Result<T, ApiError> {
    let v: Answer<T> = serde_json::from_str(body).map_err(|_| {
        let what = format!("{method}: HTTP {status} with a body that is not JSON");
        if (500..600).contains(&status) || status == 429 {
            ApiError::Transient(what)
        } else if status == 401 || status == 404 {
            ApiError::Unauthorized(format!("{what} (is the bot token right?)"))
        } else {
            ApiError::Transient(what)
        }
    })?;
    if v.ok.get() == Some(&true) {
        return Ok(v.result.unwrap_or_default());
    }
    let code = v.error_code.get().copied().unwrap_or(u64::from(status));
    // Cut: a server's text reaches the log, and one answer may be 32 MiB.
    let description = crate::logfmt::cut(v.description.text().unwrap_or("no description"), 300);
    let what = format!("{method}: {code} {description}");
    Err(match code {
        429 => {
            let secs = v
                .parameters
                .get()
                .and_then(|p| p.retry_after.get().copied())
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
