//! Slack's Web API as the bridge uses it: a method call with a token, the answer's `ok`,
//! and the rate limits: a 429's `Retry-After` stops that method in that channel (every
//! method, for a call without a channel) until it passed, and `chat.postMessage` /
//! `chat.update` are paced to one a second per channel (the "special" limit of posting).
//! Tokens travel in the `Authorization` header only and are never logged.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::platforms::replies::{CallError, ReplyApi};
use crate::platforms::secrets::{self, redact};
use crate::platforms::split::Limit;

/// Slack shows 4,000 characters of a message well (40,000 are truncated): pieces stay
/// within it in any count.
pub(crate) const SLACK_LIMIT: Limit = Limit::Utf16Units(4000);
/// Least time between two posts (or two updates) in one channel.
pub(crate) const PER_CHANNEL: Duration = Duration::from_secs(1);
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_RESPONSE_BYTES: u64 = 4 << 20;
const MAX_WAIT: Duration = Duration::from_secs(300);
/// Routes whose next allowed call is remembered at most.
const MAX_ROUTES: usize = 4096;

/// The Web API client.
pub(crate) struct WebApi {
    agent: ureq::Agent,
    base: String,
    bot: String,
    app: String,
    /// Method (and channel) → no call before this.
    not_before: HashMap<String, Instant>,
}

impl WebApi {
    /// A client of `base` (`https://slack.com/api`) with the bot and app-level tokens.
    pub(crate) fn new(base: &str, bot_token: &str, app_token: &str) -> WebApi {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(CALL_TIMEOUT))
            .user_agent(concat!("turnstile/", env!("CARGO_PKG_VERSION")))
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build();
        secrets::register(bot_token);
        secrets::register(app_token);
        WebApi {
            agent: ureq::Agent::new_with_config(config),
            base: base.trim_end_matches('/').to_owned(),
            bot: format!("Bearer {bot_token}"),
            app: format!("Bearer {app_token}"),
            not_before: HashMap::new(),
        }
    }

    fn hold(&mut self, route: &str, until: Instant) {
        let now = Instant::now();
        if self.not_before.len() >= MAX_ROUTES {
            self.not_before.retain(|_, t| *t > now);
        }
        if self.not_before.len() < MAX_ROUTES {
            self.not_before.insert(route.to_owned(), until);
        }
    }

    /// Calls `method` with `body`, with the app-level token (`app`) or the bot's.
    pub(crate) fn call(
        &mut self,
        method: &str,
        body: &Value,
        app: bool,
    ) -> Result<Value, CallError> {
        let route = match body.get("channel").and_then(Value::as_str) {
            Some(c) => format!("{method} {c}"),
            None => method.to_owned(),
        };
        let now = Instant::now();
        if let Some(t) = self.not_before.get(&route).filter(|t| **t > now) {
            return Err(CallError::Wait(*t));
        }
        debug_redacted!("slack: {route}");
        let transient = |e: String| CallError::Transient(redact(&e).into_owned());
        let auth = if app { &self.app } else { &self.bot };
        let response = self
            .agent
            .post(&format!("{}/{method}", self.base))
            .header("Authorization", auth)
            .header("Content-Type", "application/json; charset=utf-8")
            .send(body.to_string())
            .map_err(|e| transient(format!("{method}: {e}")))?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Duration::from_secs_f64(s).min(MAX_WAIT));
        let text = response
            .into_body()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| transient(format!("{method}: reading the answer failed: {e}")))?;
        let now = Instant::now();
        if status == 429 {
            let until = now + retry_after.unwrap_or(PER_CHANNEL);
            self.hold(&route, until);
            warn_limited!("slack: {route} rate limited for {:?}", until - now);
            return Err(CallError::Wait(until));
        }
        if matches!(method, "chat.postMessage" | "chat.update") {
            self.hold(&route, now + PER_CHANNEL);
        }
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if value.get("ok").and_then(Value::as_bool) == Some(true) {
            return Ok(value);
        }
        let error = value
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("no error named");
        let what = redact(&format!("{method}: HTTP {status}: {error}")).into_owned();
        Err(match error {
            "invalid_auth" | "not_authed" | "account_inactive" | "token_revoked"
            | "token_expired" => CallError::Unauthorized(what),
            _ if status >= 500 || status == 0 => CallError::Transient(what),
            "ratelimited" => CallError::Wait(now + PER_CHANNEL),
            _ if (200..300).contains(&status) || (400..500).contains(&status) => {
                CallError::Permanent(what)
            }
            _ => CallError::Transient(what),
        })
    }
}

impl ReplyApi for WebApi {
    fn limit(&self) -> Limit {
        SLACK_LIMIT
    }

    fn reply_target(&self, id: &str) -> Option<String> {
        super::event::thread_of(id).map(str::to_owned)
    }

    /// Every piece goes in the thread of the message it answers.
    fn post(
        &mut self,
        channel: &str,
        answers: Option<&str>,
        _piece: Option<usize>,
        text: &str,
    ) -> Result<String, CallError> {
        let mut body = json!({"channel": channel, "text": text});
        if let Some(t) = answers {
            body["thread_ts"] = json!(t);
        }
        let answer = self.call("chat.postMessage", &body, false)?;
        answer
            .get("ts")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| CallError::Transient("chat.postMessage: no ts in the answer".into()))
    }

    fn edit(&mut self, channel: &str, message: &str, text: &str) -> Result<(), CallError> {
        let body = json!({"channel": channel, "ts": message, "text": text});
        self.call("chat.update", &body, false).map(|_| ())
    }

    /// Bots have no typing indicator in the Events API.
    fn typing(&mut self, _channel: &str) -> Result<(), CallError> {
        Ok(())
    }

    fn delete(&mut self, channel: &str, message: &str) {
        let _ = self.call(
            "chat.delete",
            &json!({"channel": channel, "ts": message}),
            false,
        );
    }
}
