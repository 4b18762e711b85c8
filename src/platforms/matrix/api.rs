//! The few Client-Server API calls the Matrix bridge makes, over ureq (blocking).
//!
//! The access token travels only in the `Authorization` header: it is never part of a URL,
//! a log line or an error text ([`ApiError`] carries the path, the status and the server's
//! `errcode`/`error`, nothing of the request's headers).

use std::fmt;
use std::io::Read;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use super::answer::SyncAnswer;
use crate::platforms::lenient::Lenient;

/// The most a response body may hold (a sync of many busy rooms stays well under it).
const MAX_BODY: u64 = 32 * 1024 * 1024;

/// Why a request failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ApiError {
    /// 429 `M_LIMIT_EXCEEDED`: wait this long (from `retry_after_ms`, or `Retry-After`).
    RateLimited(Duration),
    /// The server answered with an error status.
    Status {
        /// The request, as `METHOD /path` (room ids included, never a token).
        what: String,
        /// The HTTP status.
        status: u16,
        /// The Matrix `errcode`, when the body had one.
        errcode: String,
        /// The Matrix `error` text, cut to 300 bytes.
        error: String,
    },
    /// No answer: connection refused, reset, timed out, TLS.
    Transport(String),
    /// A 2xx answer that was not the JSON expected.
    BadResponse(String),
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::RateLimited(d) => write!(f, "rate limited: retry after {d:?}"),
            ApiError::Status {
                what,
                status,
                errcode,
                error,
            } => write!(f, "{what}: HTTP {status} {errcode} {error}"),
            ApiError::Transport(e) | ApiError::BadResponse(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for ApiError {}

impl ApiError {
    /// Whether trying again later may succeed (no answer, or a server-side error).
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            ApiError::RateLimited(_) | ApiError::Transport(_) => true,
            ApiError::Status { status, .. } => *status >= 500,
            ApiError::BadResponse(_) => false,
        }
    }

    /// Whether the access token was refused (no point going on).
    pub(crate) fn is_unauthorized(&self) -> bool {
        matches!(self, ApiError::Status { status: 401, .. })
            || matches!(self, ApiError::Status { errcode, .. } if errcode == "M_UNKNOWN_TOKEN")
    }
}

/// Percent-encodes `s` for one URL path segment or query value (everything but RFC 3986's
/// unreserved characters).
pub(crate) fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A homeserver spoken to with one access token.
#[derive(Clone)]
pub(crate) struct Api {
    http: ureq::Agent,
    base: String,
    auth: String,
}

/// An error answer's fields the bridge reads.
#[derive(Default, Deserialize)]
struct ErrorAnswer {
    #[serde(default)]
    errcode: Lenient<String>,
    #[serde(default)]
    error: Lenient<String>,
    #[serde(default)]
    retry_after_ms: Lenient<u64>,
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Api").field("base", &self.base).finish()
    }
}

impl Api {
    /// A client of the homeserver at `base` (`http://` or `https://`); every request is
    /// bounded by `timeout` in all (a sync's long poll must fit in it).
    pub(crate) fn new(base: &str, access_token: &str, timeout: Duration) -> Result<Api, String> {
        let base = base.trim().trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "homeserver URL {base:?} must start with http:// or https://"
            ));
        }
        match format!("{base}/_matrix/client/versions").parse::<ureq::http::Uri>() {
            Ok(u) if u.host().is_some_and(|h| !h.is_empty()) => {}
            _ => return Err(format!("homeserver URL {base:?} is not a valid URL")),
        }
        if access_token.is_empty()
            || access_token
                .bytes()
                .any(|b| b.is_ascii_control() || b == b' ')
        {
            return Err("the access token is empty or holds spaces or control characters".into());
        }
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_global(Some(timeout))
            .user_agent(concat!("turnstile/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Api {
            http: ureq::Agent::new_with_config(config),
            base,
            auth: format!("Bearer {access_token}"),
        })
    }

    /// The homeserver's base URL.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// One request to `/_matrix/client/v3{path}` (`path` already encoded, query included):
    /// its answer, a JSON object.
    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let (what, status, text) = self.request(method, path, body)?;
        match serde_json::from_str::<Value>(&text) {
            Ok(v) if v.is_object() => Ok(v),
            _ => Err(ApiError::BadResponse(format!(
                "{what}: HTTP {status} with a body that is not a JSON object"
            ))),
        }
    }

    /// One request to `/_matrix/client/v3{path}`: what it was (for error texts), the status
    /// and the body of a 2xx answer; any other answer as its error.
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(String, u16, String), ApiError> {
        let url = format!("{}/_matrix/client/v3{path}", self.base);
        // What error texts name: the method and the path without its query (a filter or a
        // sync token adds nothing useful and may be long).
        let what = format!("{method} {}", path.split('?').next().unwrap_or(path));
        let builder = ureq::http::Request::builder()
            .method(method)
            .uri(&url)
            .header("Authorization", &self.auth)
            .header("Accept", "application/json");
        let result = match body {
            Some(b) => {
                let request = builder
                    .header("Content-Type", "application/json")
                    .body(b.to_string())
                    .map_err(|e| ApiError::BadResponse(format!("{what}: bad request: {e}")))?;
                self.http.run(request)
            }
            None => {
                let request = builder
                    .body(())
                    .map_err(|e| ApiError::BadResponse(format!("{what}: bad request: {e}")))?;
                self.http.run(request)
            }
        };
        let response = result.map_err(|e| ApiError::Transport(describe(&e, &what)))?;
        self.answer(what, response)
    }

    /// A response as [`Api::request`] returns it: what it was, the status and the body of a
    /// 2xx answer; any other answer as its error.
    fn answer(
        &self,
        what: String,
        mut response: ureq::http::Response<ureq::Body>,
    ) -> Result<(String, u16, String), ApiError> {
        let status = response.status().as_u16();
        let retry_header = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0 && *s < 1e6)
            .map(Duration::from_secs_f64);
        let mut text = String::new();
        response
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .reader()
            .read_to_string(&mut text)
            .map_err(|e| ApiError::Transport(format!("{what}: reading the answer failed: {e}")))?;
        if (200..300).contains(&status) {
            return Ok((what, status, text));
        }
        // An error answer: only its three fields are read (typed, however large the body).
        let parsed: ErrorAnswer = serde_json::from_str(&text).unwrap_or_default();
        let errcode = parsed.errcode.text().unwrap_or("").to_owned();
        if status == 429 || errcode == "M_LIMIT_EXCEEDED" {
            let wait = parsed
                .retry_after_ms
                .get()
                .copied()
                .map(Duration::from_millis)
                .or(retry_header)
                .unwrap_or(Duration::from_secs(1));
            return Err(ApiError::RateLimited(wait));
        }
        let error = parsed.error.text().map(|s| cut(s, 300)).unwrap_or_default();
        Err(ApiError::Status {
            what,
            status,
            errcode,
            error,
        })
    }

    /// The media `mxc://{server}/{media_id}` as a stream (never read whole), through the
    /// authenticated media API (`/_matrix/client/v1/media/download`, which needs the bot's
    /// token), falling back to `/_matrix/media/v3/download` on a server without it.
    pub(crate) fn download(
        &self,
        server: &str,
        media_id: &str,
    ) -> Result<Box<dyn std::io::Read + Send>, ApiError> {
        let tail = format!("{}/{}", enc(server), enc(media_id));
        for prefix in [
            "/_matrix/client/v1/media/download/",
            "/_matrix/media/v3/download/",
        ] {
            let url = format!("{}{prefix}{tail}", self.base);
            let what = format!("GET {prefix}…");
            let response = self
                .http
                .get(&url)
                .header("Authorization", &self.auth)
                .call()
                .map_err(|e| ApiError::Transport(describe(&e, &what)))?;
            let status = response.status().as_u16();
            match status {
                200 => return Ok(Box::new(response.into_body().into_reader())),
                // An older server does not know the first endpoint.
                404 | 405 | 400 if prefix.contains("/v1/") => continue,
                _ => {
                    return Err(ApiError::Status {
                        what,
                        status,
                        errcode: String::new(),
                        error: String::new(),
                    });
                }
            }
        }
        Err(ApiError::BadResponse(
            "media download: no endpoint answered".into(),
        ))
    }

    /// `POST /_matrix/media/v3/upload` of the spool file of `file`, streamed from the disk
    /// (issue 36): its `mxc://` URI.
    pub(crate) fn upload(&self, file: &crate::Attachment) -> Result<String, ApiError> {
        let what = "POST /_matrix/media/v3/upload".to_owned();
        let bad = |e: String| ApiError::BadResponse(format!("{what}: {e}"));
        let path = file.path.as_deref().ok_or_else(|| bad("no file".into()))?;
        let data = std::fs::File::open(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let size = data
            .metadata()
            .map_err(|e| bad(format!("cannot read it: {e}")))?
            .len();
        let mime = if file.mime.is_empty() {
            "application/octet-stream"
        } else {
            &file.mime
        };
        let url = format!(
            "{}/_matrix/media/v3/upload?filename={}",
            self.base,
            enc(&file.name)
        );
        let response = self
            .http
            .post(&url)
            .header("Authorization", &self.auth)
            .header("Content-Type", mime)
            .header("Content-Length", &size.to_string())
            .send(ureq::SendBody::from_owned_reader(data.take(size)))
            .map_err(|e| ApiError::Transport(describe(&e, &what)))?;
        let (what, status, text) = self.answer(what, response)?;
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        v["content_uri"]
            .as_str()
            .filter(|u| u.starts_with("mxc://"))
            .map(str::to_owned)
            .ok_or_else(|| {
                ApiError::BadResponse(format!("{what}: HTTP {status} without a content_uri"))
            })
    }

    /// `GET /account/whoami`: the token's user id.
    pub(crate) fn whoami(&self) -> Result<String, ApiError> {
        let v = self.call("GET", "/account/whoami", None)?;
        v["user_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiError::BadResponse("whoami: no user_id in the answer".into()))
    }

    /// `GET /sync`, long polling up to `timeout` when `since` is given.
    pub(crate) fn sync_text(
        &self,
        since: Option<&str>,
        filter: &str,
        timeout: Duration,
    ) -> Result<String, ApiError> {
        let mut path = format!(
            "/sync?filter={}&timeout={}",
            enc(filter),
            timeout.as_millis()
        );
        if let Some(s) = since {
            path.push_str("&since=");
            path.push_str(&enc(s));
        }
        let (_, _, text) = self.request("GET", &path, None)?;
        Ok(text)
    }

    /// A sync answer's text read typed and bounded: a huge answer costs its text and what is
    /// kept of it.
    pub(crate) fn parse_sync(text: &str) -> Result<SyncAnswer, ApiError> {
        serde_json::from_str(text).map_err(|_| {
            ApiError::BadResponse("GET /sync: a body that is not a sync answer".to_owned())
        })
    }

    /// `POST /rooms/{room}/join`.
    pub(crate) fn join(&self, room: &str) -> Result<(), ApiError> {
        self.call(
            "POST",
            &format!("/rooms/{}/join", enc(room)),
            Some(&json!({})),
        )
        .map(drop)
    }

    /// `POST /rooms/{room}/leave`: leaves a room, or declines an invite to it.
    pub(crate) fn leave(&self, room: &str) -> Result<(), ApiError> {
        self.call(
            "POST",
            &format!("/rooms/{}/leave", enc(room)),
            Some(&json!({})),
        )
        .map(drop)
    }

    /// `GET /rooms/{room}/joined_members`: how many members are joined.
    pub(crate) fn joined_count(&self, room: &str) -> Result<u64, ApiError> {
        let v = self.call("GET", &format!("/rooms/{}/joined_members", enc(room)), None)?;
        v["joined"]
            .as_object()
            .map(|m| m.len() as u64)
            .ok_or_else(|| ApiError::BadResponse("joined_members: no `joined` object".into()))
    }

    /// `PUT /rooms/{room}/send/m.room.message/{txn}`: the new event's id. Sending again with
    /// the same `txn` (after no answer) does not post twice: the server returns the first
    /// event.
    pub(crate) fn send_message(
        &self,
        room: &str,
        txn: &str,
        content: &Value,
    ) -> Result<String, ApiError> {
        self.send_event(room, "m.room.message", txn, content)
    }

    /// `PUT /rooms/{room}/send/{kind}/{txn}` (an encrypted room's events are
    /// `m.room.encrypted`): the new event's id, idempotent by `txn` as [`Api::send_message`].
    pub(crate) fn send_event(
        &self,
        room: &str,
        kind: &str,
        txn: &str,
        content: &Value,
    ) -> Result<String, ApiError> {
        let v = self.call(
            "PUT",
            &format!("/rooms/{}/send/{}/{}", enc(room), enc(kind), enc(txn)),
            Some(content),
        )?;
        v["event_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiError::BadResponse("send: no event_id in the answer".into()))
    }

    /// `PUT /rooms/{room}/typing/{user}`.
    pub(crate) fn typing(
        &self,
        room: &str,
        user: &str,
        on: bool,
        timeout: Duration,
    ) -> Result<(), ApiError> {
        let body = if on {
            json!({"typing": true, "timeout": timeout.as_millis() as u64})
        } else {
            json!({"typing": false})
        };
        self.call(
            "PUT",
            &format!("/rooms/{}/typing/{}", enc(room), enc(user)),
            Some(&body),
        )
        .map(drop)
    }

    /// Moves the bot's read receipt (`m.read`, unthreaded) in `room` to `event`.
    pub(crate) fn receipt(&self, room: &str, event: &str) -> Result<(), ApiError> {
        let path = format!("/rooms/{}/receipt/m.read/{}", enc(room), enc(event));
        self.call("POST", &path, Some(&json!({}))).map(drop)
    }
}

/// `s` cut to at most `max` bytes on a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn describe(e: &ureq::Error, what: &str) -> String {
    use std::io::ErrorKind as K;
    match e {
        ureq::Error::Io(io) => match io.kind() {
            K::ConnectionRefused => {
                format!("{what}: cannot connect to the homeserver: connection refused")
            }
            K::TimedOut => format!("{what}: timed out"),
            _ => format!("{what}: {io}"),
        },
        ureq::Error::HostNotFound => format!("{what}: cannot resolve the homeserver's host"),
        ureq::Error::Timeout(t) => format!("{what}: timed out ({t})"),
        other => format!("{what}: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_ids_and_tokens_are_encoded_as_one_segment() {
        assert_eq!(enc("!abc:example.org"), "%21abc%3Aexample.org");
        assert_eq!(enc("a/b?c&d é"), "a%2Fb%3Fc%26d%20%C3%A9");
    }

    #[test]
    fn bad_homeserver_urls_and_tokens_are_refused_clearly() {
        let t = Duration::from_secs(1);
        let e = Api::new("matrix.org", "tok", t).unwrap_err();
        assert!(e.contains("must start with http"), "{e}");
        let e = Api::new("http://bad host", "tok", t).unwrap_err();
        assert!(e.contains("not a valid URL"), "{e}");
        let e = Api::new("http://h", "to k", t).unwrap_err();
        assert!(e.contains("access token"), "{e}");
        assert!(!e.contains("to k"), "the token is never echoed: {e}");
        let api = Api::new("http://h:8008/", "secret-token", t).expect("valid");
        assert_eq!(api.base(), "http://h:8008");
        assert!(!format!("{api:?}").contains("secret-token"));
    }

    #[test]
    fn cut_keeps_characters_whole() {
        assert_eq!(cut("héllo", 2), "h");
        assert_eq!(cut("héllo", 3), "hé");
        assert_eq!(cut("abc", 10), "abc");
    }
}
