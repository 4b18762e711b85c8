//! Discord's REST API as the bridge uses it: one call (behind [`Rest`], so the renderer is
//! tested with a scripted one), the rate limits as Discord publishes them, and 429s (per
//! bucket or global) turned into a time before which nothing is sent:
//!
//! - **Buckets**: a route's bucket is named by the `X-RateLimit-Bucket` hash of its answers;
//!   routes with the same hash share one bucket per top-level resource (the channel), so a
//!   post that empties it stops the edits too. A route whose hash is not known yet is its
//!   own bucket until its first answer names one.
//! - **Global**: at most [`GLOBAL_PER_SECOND`] calls in any second, counted before any 429:
//!   a call waits until the one [`GLOBAL_PER_SECOND`] calls back finished a second ago.
//!
//! The bot token travels in the `Authorization` header only and is never logged.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::platforms::replies::ReplyApi;
use crate::platforms::secrets::{self, redact};
use crate::platforms::split::Limit;

/// The longest wait a `retry_after` or bucket reset imposes at once.
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Longest answer body read.
const MAX_RESPONSE_BYTES: u64 = 4 << 20;
/// Time one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Buckets (and route hashes) remembered at most (past it the ones whose reset passed are
/// forgotten, then all).
const MAX_BUCKETS: usize = 4096;
/// Discord's global rate limit: requests a bot may make in any second.
pub(crate) const GLOBAL_PER_SECOND: usize = 50;

pub(crate) use crate::platforms::replies::CallError as RestError;

/// The REST API: `method` on `path` (under `/api/v10`) with an optional JSON body.
pub(crate) trait Rest {
    /// One call; the answer's JSON (`Null` for an empty body).
    fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, RestError>;
}

/// What a route's bucket allows, as its last answer said.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    remaining: u64,
    reset_at: Instant,
}

/// The real API over ureq.
pub(crate) struct HttpRest {
    agent: ureq::Agent,
    base: String,
    authorization: String,
    /// A route's template (its top-level resource left out) → its bucket's hash.
    hashes: HashMap<String, String>,
    /// A bucket (`hash:resource`, or the route while its hash is unknown) → what it allows.
    buckets: HashMap<String, Bucket>,
    global_until: Option<Instant>,
    /// When the newest [`GLOBAL_PER_SECOND`] calls finished, oldest first.
    finished: VecDeque<Instant>,
}

impl HttpRest {
    /// A client of `base` (e.g. `https://discord.com/api/v10`) for the bot `token`.
    pub(crate) fn new(base: &str, token: &str) -> HttpRest {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(CALL_TIMEOUT))
            .user_agent(concat!(
                "DiscordBot (https://github.com/turnstile, ",
                env!("CARGO_PKG_VERSION"),
                ")"
            ))
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                    .build(),
            )
            .build();
        secrets::register(token);
        HttpRest {
            agent: ureq::Agent::new_with_config(config),
            base: base.trim_end_matches('/').to_owned(),
            authorization: format!("Bot {token}"),
            hashes: HashMap::new(),
            buckets: HashMap::new(),
            global_until: None,
            finished: VecDeque::with_capacity(GLOBAL_PER_SECOND + 1),
        }
    }

    /// The bucket `route` counts against: its hash's, for its top-level resource, once an
    /// answer named the hash; the route itself before.
    fn bucket_key(&self, route: &str) -> String {
        let (template, resource) = split_resource(route);
        match self.hashes.get(&template) {
            Some(hash) => format!("{hash}:{resource}"),
            None => route.to_owned(),
        }
    }

    /// When the route (or everything) may be called again, if not now.
    fn blocked(&self, route: &str, now: Instant) -> Option<Instant> {
        let global = self.global_until.filter(|t| *t > now);
        let second = self
            .finished
            .front()
            .filter(|_| self.finished.len() >= GLOBAL_PER_SECOND)
            .map(|t| *t + Duration::from_secs(1))
            .filter(|t| *t > now);
        let bucket = self
            .buckets
            .get(&self.bucket_key(route))
            .filter(|b| b.remaining == 0 && b.reset_at > now)
            .map(|b| b.reset_at);
        global.max(second).max(bucket)
    }

    /// A call finished at `now` (answered or not: it may have reached Discord). Counted
    /// when it finished, after Discord counted it, so no second holds more than
    /// [`GLOBAL_PER_SECOND`] of them in Discord's count either.
    fn finished(&mut self, now: Instant) {
        self.finished.push_back(now);
        while self.finished.len() > GLOBAL_PER_SECOND {
            self.finished.pop_front();
        }
        debug_assert!(self.finished.len() <= GLOBAL_PER_SECOND);
    }

    /// What an answer said of `route`'s bucket: its hash (shared with other routes) and,
    /// if given, what it allows now.
    fn learn(&mut self, route: &str, hash: Option<&str>, bucket: Option<Bucket>, now: Instant) {
        if let Some(hash) = hash {
            let (template, _) = split_resource(route);
            if self.hashes.len() >= MAX_BUCKETS && !self.hashes.contains_key(&template) {
                self.hashes.clear();
            }
            self.hashes.insert(template, hash.to_owned());
        }
        if let Some(bucket) = bucket {
            let key = self.bucket_key(route);
            self.remember(key, bucket, now);
        }
    }

    fn remember(&mut self, key: String, bucket: Bucket, now: Instant) {
        if self.buckets.len() >= MAX_BUCKETS && !self.buckets.contains_key(&key) {
            self.buckets.retain(|_, b| b.reset_at > now);
            if self.buckets.len() >= MAX_BUCKETS {
                self.buckets.clear();
            }
        }
        self.buckets.insert(key, bucket);
        debug_assert!(self.buckets.len() <= MAX_BUCKETS);
    }
}

/// A route (`PATCH /channels/7/messages/:id`) as its template, the top-level resource left
/// out (`PATCH /channels/:resource/messages/:id`, what a bucket hash is named for), and that
/// resource (`7`; empty for a route without one).
fn split_resource(route: &str) -> (String, &str) {
    let mut parts: Vec<&str> = route.split('/').collect();
    if parts.len() >= 3 && matches!(parts[1], "channels" | "guilds" | "webhooks") {
        let resource = parts[2];
        parts[2] = ":resource";
        return (parts.join("/"), resource);
    }
    (route.to_owned(), "")
}

/// The rate-limit route of a call: its method and path, with a message id (a minor
/// parameter) left out, so that every message of a channel shares the channel's bucket.
pub(crate) fn route(method: &str, path: &str) -> String {
    let mut parts: Vec<&str> = path.split('/').collect();
    if parts.len() >= 5 && parts[1] == "channels" && parts[3] == "messages" {
        parts[4] = ":id";
    }
    format!("{method} {}", parts.join("/"))
}

/// Seconds in a header or a body, as a bounded duration.
fn seconds(value: Option<f64>) -> Option<Duration> {
    value
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Duration::from_secs_f64(s.min(MAX_RETRY_AFTER.as_secs_f64())))
}

impl Rest for HttpRest {
    fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, RestError> {
        let route = route(method, path);
        let now = Instant::now();
        if let Some(at) = self.blocked(&route, now) {
            return Err(RestError::Wait(at));
        }
        let url = format!("{}{path}", self.base);
        debug_redacted!("discord: {route}");
        let transient = |e: String| RestError::Transient(redact(&e).into_owned());
        let request = |m: &str| {
            ureq::http::Request::builder()
                .method(m)
                .uri(&url)
                .header("Authorization", &self.authorization)
                .header("Content-Type", "application/json")
        };
        let text = body.map(Value::to_string).unwrap_or_default();
        let request = request(method)
            .body(text)
            .map_err(|e| transient(format!("{route}: {e}")))?;
        let response = self.agent.run(request);
        self.finished(Instant::now());
        let response = response.map_err(|e| transient(format!("{route}: {e}")))?;
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let remaining = header("x-ratelimit-remaining").and_then(|v| v.parse::<u64>().ok());
        let reset_after = seconds(header("x-ratelimit-reset-after").and_then(|v| v.parse().ok()));
        let global_header = header("x-ratelimit-global").is_some_and(|v| v == "true");
        let retry_header = seconds(header("retry-after").and_then(|v| v.parse().ok()));
        let hash = header("x-ratelimit-bucket").filter(|h| !h.is_empty() && h.len() <= 256);
        let body = response
            .into_body()
            .with_config()
            .limit(MAX_RESPONSE_BYTES)
            .read_to_string()
            .map_err(|e| transient(format!("{route}: reading the answer failed: {e}")))?;
        let now = Instant::now();
        let bucket = remaining.zip(reset_after).map(|(remaining, after)| Bucket {
            remaining,
            reset_at: now + after,
        });
        self.learn(&route, hash.as_deref(), bucket, now);
        let value: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if status == 429 {
            let after = seconds(value.get("retry_after").and_then(Value::as_f64))
                .or(retry_header)
                .unwrap_or(Duration::from_secs(1));
            let until = now + after;
            let global =
                global_header || value.get("global").and_then(Value::as_bool) == Some(true);
            if global {
                self.global_until = Some(until);
            } else {
                let bucket = Bucket {
                    remaining: 0,
                    reset_at: until,
                };
                let key = self.bucket_key(&route);
                self.remember(key, bucket, now);
            }
            warn_limited!(
                "discord: {route} rate limited ({}) for {after:?}",
                if global { "global" } else { "route" }
            );
            return Err(RestError::Wait(until));
        }
        classify(&route, status, &value)
    }
}

/// Discord's limit on a message's content is 2,000 characters; counted in UTF-16 units the
/// pieces are never longer than that in any count Discord uses.
pub(crate) const DISCORD_LIMIT: Limit = Limit::Utf16Units(2000);

/// Replies on Discord: a message replying to the user's (`message_reference`), edited with
/// PATCH, mentioning nobody (`allowed_mentions` empty: whatever the agent wrote pings no one).
impl ReplyApi for HttpRest {
    fn limit(&self) -> Limit {
        DISCORD_LIMIT
    }

    fn reply_target(&self, id: &str) -> Option<String> {
        super::event::reply_target(id).map(str::to_owned)
    }

    fn post(
        &mut self,
        channel: &str,
        answers: Option<&str>,
        piece: Option<usize>,
        text: &str,
    ) -> Result<String, RestError> {
        let mut body = json!({"content": text, "allowed_mentions": {"parse": []}});
        if let Some(r) = answers.filter(|_| piece.unwrap_or(0) == 0) {
            body["message_reference"] = json!({"message_id": r, "fail_if_not_exists": false});
        }
        // A nonce (25 characters at most) Discord enforces: the same one again within a few
        // minutes returns the message already created.
        if let (Some(r), Some(i)) = (answers, piece) {
            let nonce = format!("{r}-{i}");
            if nonce.len() <= 25 {
                body["nonce"] = json!(nonce);
                body["enforce_nonce"] = json!(true);
            }
        }
        let answer = self.call(
            "POST",
            &format!("/channels/{channel}/messages"),
            Some(&body),
        )?;
        answer
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| RestError::Transient("the new message's answer has no id".into()))
    }

    fn edit(&mut self, channel: &str, message: &str, text: &str) -> Result<(), RestError> {
        let body = json!({"content": text, "allowed_mentions": {"parse": []}});
        let path = format!("/channels/{channel}/messages/{message}");
        self.call("PATCH", &path, Some(&body)).map(|_| ())
    }

    fn typing(&mut self, channel: &str) -> Result<(), RestError> {
        self.call("POST", &format!("/channels/{channel}/typing"), None)
            .map(|_| ())
    }

    fn delete(&mut self, channel: &str, message: &str) {
        let _ = self.call(
            "DELETE",
            &format!("/channels/{channel}/messages/{message}"),
            None,
        );
    }
}

/// A non-429 answer: its JSON, or how it failed.
fn classify(route: &str, status: u16, value: &Value) -> Result<Value, RestError> {
    if (200..300).contains(&status) {
        return Ok(value.clone());
    }
    let message = value
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message");
    let what = redact(&format!("{route}: HTTP {status}: {message}")).into_owned();
    Err(match status {
        401 => RestError::Unauthorized(format!("{what} (is the bot token right?)")),
        400..=499 => RestError::Permanent(what),
        _ => RestError::Transient(what),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_share_their_channels_route() {
        assert_eq!(
            route("PATCH", "/channels/7/messages/99"),
            "PATCH /channels/7/messages/:id"
        );
        assert_eq!(
            route("POST", "/channels/7/messages"),
            "POST /channels/7/messages"
        );
        assert_eq!(
            route("POST", "/channels/7/typing"),
            "POST /channels/7/typing"
        );
    }

    #[test]
    fn an_empty_bucket_blocks_its_route_until_its_reset_and_no_other() {
        let mut rest = HttpRest::new("http://127.0.0.1:9", "discord-unit-test-token-8f3a");
        let now = Instant::now();
        let reset_at = now + Duration::from_secs(2);
        rest.learn(
            "POST /channels/1/messages",
            None,
            Some(Bucket {
                remaining: 0,
                reset_at,
            }),
            now,
        );
        assert_eq!(
            rest.blocked("POST /channels/1/messages", now),
            Some(reset_at)
        );
        assert_eq!(rest.blocked("POST /channels/2/messages", now), None);
        assert_eq!(rest.blocked("POST /channels/1/messages", reset_at), None);
        rest.global_until = Some(now + Duration::from_secs(5));
        assert_eq!(
            rest.blocked("POST /channels/2/messages", now),
            Some(now + Duration::from_secs(5))
        );
    }

    #[test]
    fn routes_whose_answers_name_one_bucket_hash_share_it_per_channel() {
        let mut rest = HttpRest::new("http://127.0.0.1:9", "discord-unit-test-token-8f3a");
        let now = Instant::now();
        let reset_at = now + Duration::from_secs(5);
        let (post, edit) = (
            "POST /channels/1/messages",
            "PATCH /channels/1/messages/:id",
        );
        let room = |remaining| {
            Some(Bucket {
                remaining,
                reset_at,
            })
        };
        rest.learn(edit, Some("h1"), room(3), now);
        rest.learn(post, Some("h1"), room(0), now);
        assert_eq!(
            rest.blocked(edit, now),
            Some(reset_at),
            "the post emptied the bucket the edits share"
        );
        assert_eq!(rest.blocked("PATCH /channels/2/messages/:id", now), None);
        assert_eq!(rest.blocked("POST /channels/1/typing", now), None);
        assert_eq!(rest.blocked(edit, reset_at), None);
    }

    #[test]
    fn no_second_holds_more_than_fifty_finished_calls() {
        let mut rest = HttpRest::new("http://127.0.0.1:9", "discord-unit-test-token-8f3a");
        let t0 = Instant::now();
        let route = "POST /channels/1/messages";
        for i in 0..GLOBAL_PER_SECOND as u64 - 1 {
            rest.finished(t0 + Duration::from_millis(i));
        }
        let now = t0 + Duration::from_millis(100);
        assert_eq!(rest.blocked(route, now), None, "49 in the last second");
        rest.finished(now);
        assert_eq!(
            rest.blocked("POST /channels/2/messages", now),
            Some(t0 + Duration::from_secs(1)),
            "the 51st waits until the first is a second old"
        );
        assert_eq!(rest.blocked(route, t0 + Duration::from_secs(1)), None);
        assert_eq!(rest.finished.len(), GLOBAL_PER_SECOND);
    }

    #[test]
    fn the_top_level_resource_is_left_out_of_a_routes_template() {
        assert_eq!(
            split_resource("PATCH /channels/7/messages/:id"),
            ("PATCH /channels/:resource/messages/:id".to_owned(), "7")
        );
        assert_eq!(
            split_resource("GET /gateway/bot"),
            ("GET /gateway/bot".to_owned(), "")
        );
    }
}
