//! The endpoint's sans-IO half: one request head parsed from bytes, one response rendered
//! for it. Requests are parsed by `httparse`; only `GET` and `HEAD` without a body are
//! served, and `POST /access` (its arguments in the query, no body). `/access` and
//! `/history` are never open: they need the endpoint's token.

use std::io::Write;
use std::sync::Arc;

use crate::auth::Token as AuthToken;

/// Headers parsed per request; more is `431`.
const MAX_HEADERS: usize = 32;

/// A parsed request: what routing needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// `GET`, `HEAD`, …
    pub method: String,
    /// The path without its query.
    pub path: String,
    /// The query (after `?`), raw; empty without one.
    pub query: String,
    /// The bearer token of the `Authorization` header, if any.
    pub bearer: Option<String>,
    /// The client asked to close after this response (or speaks HTTP/1.0).
    pub close: bool,
    /// Bytes of the buffer the request took.
    pub len: usize,
}

/// The outcome of parsing the start of a connection's input.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// More bytes are needed.
    Incomplete,
    /// A complete request.
    Request(Request),
    /// A malformed or unacceptable request: answer with this status and close.
    Bad(u16, &'static str),
}

/// Parses one request head from `buf` (at most `max_head` bytes of it count).
pub(crate) fn parse_request(buf: &[u8], max_head: usize) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) if n <= max_head => n,
        Ok(httparse::Status::Complete(_)) => return Parsed::Bad(431, "request head too large"),
        Ok(httparse::Status::Partial) if buf.len() >= max_head => {
            return Parsed::Bad(431, "request head too large");
        }
        Ok(httparse::Status::Partial) => return Parsed::Incomplete,
        Err(httparse::Error::TooManyHeaders) => return Parsed::Bad(431, "too many headers"),
        Err(_) => return Parsed::Bad(400, "malformed request"),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Parsed::Bad(400, "malformed request");
    };
    let mut bearer = None;
    let mut close = version == 0;
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        let value = String::from_utf8_lossy(h.value);
        match name.as_str() {
            "content-length" if value.trim() != "0" => {
                return Parsed::Bad(400, "request bodies are not accepted");
            }
            "transfer-encoding" => return Parsed::Bad(400, "request bodies are not accepted"),
            "connection" => {
                let v = value.to_ascii_lowercase();
                if v.split(',').any(|t| t.trim() == "close") {
                    close = true;
                } else if v.split(',').any(|t| t.trim() == "keep-alive") {
                    close = false;
                }
            }
            "authorization" => {
                let v = value.trim();
                if v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer ") {
                    bearer = Some(v[7..].trim().to_owned());
                }
            }
            _ => {}
        }
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    Parsed::Request(Request {
        method: method.to_owned(),
        path: path.to_owned(),
        query: query.to_owned(),
        bearer,
        close,
        len,
    })
}

/// What the endpoint serves; implemented over the reactor's latest snapshot.
pub(crate) trait OpsSource {
    /// `Ok` while the gateway is live, else why not (`/healthz`).
    fn health(&self) -> Result<(), String>;
    /// `Ok` while the gateway takes traffic, else why not (`/readyz`).
    fn ready(&self) -> Result<(), String>;
    /// The status document (`/status`).
    fn status_json(&self) -> Vec<u8>;
    /// The Prometheus exposition (`/metrics`).
    fn metrics(&self) -> String;
    /// Which status snapshot `/status` and `/metrics` show: the same number, the same
    /// bodies (they are rendered once per snapshot); `None` renders every time.
    fn snapshot(&self) -> Option<u64> {
        None
    }
    /// `/status`'s body as bytes.
    fn status_bytes(&self) -> Arc<[u8]> {
        self.status_json().into()
    }
    /// `/metrics`'s body as bytes.
    fn metrics_bytes(&self) -> Arc<[u8]> {
        self.metrics().into_bytes().into()
    }
    /// `POST /access?QUERY`: an access policy admin command, its status and text
    /// (`404` where the gateway has no policy to run it on).
    fn access(&self, _query: &str) -> (u16, String) {
        no_access_policy()
    }
    /// `GET /history?session=KEY`: a session's stored conversation as export lines, or its
    /// status and why not (`404` where nothing is stored).
    fn history(&self, _query: &str) -> (u16, String) {
        crate::ops::history::no_history()
    }
}

/// `/access` where nothing applies the commands (an embedder's gateway without a policy).
pub(crate) fn no_access_policy() -> (u16, String) {
    (404, "no access policy here\n".into())
}

/// A response, ready to write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    /// The status code.
    pub status: u16,
    /// The bytes to write (head and body).
    pub bytes: Vec<u8>,
    /// Close the connection once written.
    pub close: bool,
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// A response's bytes; `head_only` leaves the body out (a `HEAD` request).
pub(crate) fn response(
    status: u16,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
    close: bool,
    head_only: bool,
) -> Response {
    let mut bytes = Vec::with_capacity(160 + body.len());
    let _ = write!(
        bytes,
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n",
        reason_phrase(status),
        body.len()
    );
    for (name, value) in extra {
        let _ = write!(bytes, "{name}: {value}\r\n");
    }
    bytes.extend_from_slice(if close {
        b"Connection: close\r\n\r\n"
    } else {
        b"Connection: keep-alive\r\n\r\n"
    });
    if !head_only {
        bytes.extend_from_slice(body);
    }
    Response {
        status,
        bytes,
        close,
    }
}

/// Plain text, the probes' and the refusals' bodies.
pub(super) const TEXT: &str = "text/plain; charset=utf-8";
const JSON: &str = "application/json";
/// JSON lines (`/history`).
const JSON_LINES: &str = "application/x-ndjson; charset=utf-8";
/// The Prometheus text exposition format's content type.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Answers one request. `token` is the configured auth token; `close` forces
/// `Connection: close` (the connection's last request).
pub(crate) fn respond(
    req: &Request,
    token: Option<&AuthToken>,
    source: &dyn OpsSource,
    close: bool,
) -> Response {
    let close = close || req.close;
    let head = req.method == "HEAD";
    if let Some(refusal) = refuse(req, token, close, head) {
        return refusal;
    }
    let probe = |r: Result<(), String>| match r {
        Ok(()) => response(200, TEXT, b"ok\n", &[], close, head),
        Err(why) => response(503, TEXT, format!("{why}\n").as_bytes(), &[], close, head),
    };
    match req.path.as_str() {
        "/healthz" => probe(source.health()),
        "/readyz" => probe(source.ready()),
        "/status" => response(200, JSON, &source.status_bytes(), &[], close, head),
        "/access" => {
            let (status, text) = source.access(&req.query);
            response(status, TEXT, text.as_bytes(), &[], close, head)
        }
        "/history" => {
            let (status, body) = source.history(&req.query);
            let kind = if status == 200 { JSON_LINES } else { TEXT };
            response(status, kind, body.as_bytes(), &[], close, head)
        }
        _ => response(
            200,
            METRICS_CONTENT_TYPE,
            &source.metrics_bytes(),
            &[],
            close,
            head,
        ),
    }
}

/// The answer to a request the endpoint does not serve: an unknown path (`404`), a method
/// other than `GET` or `HEAD` (`405`; `/access` takes only `POST`), a missing or wrong bearer
/// token (`401`, every path but `/healthz`), `/access` or `/history` on a gateway without a
/// token (`403`).
fn refuse(req: &Request, token: Option<&AuthToken>, close: bool, head: bool) -> Option<Response> {
    let known = matches!(
        req.path.as_str(),
        "/healthz" | "/readyz" | "/status" | "/metrics" | "/access" | "/history"
    );
    if !known {
        return Some(response(404, TEXT, b"not found\n", &[], close, head));
    }
    let (allowed, allow) = if req.path == "/access" {
        (req.method == "POST", "POST")
    } else {
        (req.method == "GET" || head, "GET, HEAD")
    };
    if !allowed {
        let allow = [("Allow", allow)];
        return Some(response(
            405,
            TEXT,
            b"method not allowed\n",
            &allow,
            close,
            head,
        ));
    }
    if matches!(req.path.as_str(), "/access" | "/history") && token.is_none() {
        // It changes who may use the agent, or shows what users said: never open, even on
        // a loopback address.
        let why = format!(
            "{} needs the gateway's auth token (--auth-token or TURNSTILE_AUTH_TOKEN)\n",
            req.path
        );
        return Some(response(403, TEXT, why.as_bytes(), &[], close, head));
    }
    let authorized = |t: &AuthToken| req.bearer.as_deref().is_some_and(|b| t.matches(b));
    if req.path != "/healthz" && token.is_some_and(|t| !authorized(t)) {
        let challenge = [("WWW-Authenticate", "Bearer")];
        return Some(response(
            401,
            TEXT,
            b"unauthorized\n",
            &challenge,
            close,
            head,
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::http::{MAX_CONNECTIONS_LIMIT, owns};
    use crate::tokens::{HTTP_CONNS, HTTP_LISTENER as LISTENER};
    use mio::Token;

    /// A test's answer to `/access` or `/history` for a query.
    type Answer = fn(&str) -> (u16, String);

    /// A source with fixed answers; `/access` and `/history` as the test sets them, or as a
    /// gateway without an access policy and a store (`None`).
    struct Fixed {
        healthy: bool,
        access: Option<Answer>,
        history: Option<Answer>,
    }

    impl Fixed {
        fn new(healthy: bool) -> Fixed {
            Fixed {
                healthy,
                access: None,
                history: None,
            }
        }
    }

    impl OpsSource for Fixed {
        fn health(&self) -> Result<(), String> {
            if self.healthy {
                Ok(())
            } else {
                Err("shutting down".into())
            }
        }
        fn ready(&self) -> Result<(), String> {
            Err("not yet".into())
        }
        fn status_json(&self) -> Vec<u8> {
            b"{\"state\":\"running\"}".to_vec()
        }
        fn metrics(&self) -> String {
            "turnstile_ticks_total 3\n".into()
        }
        fn access(&self, query: &str) -> (u16, String) {
            self.access
                .map_or_else(no_access_policy, |answer| answer(query))
        }
        fn history(&self, query: &str) -> (u16, String) {
            self.history
                .map_or_else(crate::ops::history::no_history, |answer| answer(query))
        }
    }

    fn req(text: &str) -> Request {
        match parse_request(text.as_bytes(), 8192) {
            Parsed::Request(r) => r,
            other => panic!("{other:?}"),
        }
    }

    fn answer(text: &str, token: Option<&AuthToken>, healthy: bool) -> (u16, String) {
        let r = respond(&req(text), token, &Fixed::new(healthy), false);
        (r.status, String::from_utf8(r.bytes).unwrap())
    }

    #[test]
    fn parses_a_get_with_query_bearer_and_connection_close() {
        let r = req(
            "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\nGET",
        );
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/metrics");
        assert_eq!(r.bearer.as_deref(), Some("s3cret"));
        assert!(r.close);
        assert_eq!(r.len, 87);
        assert!(!req("GET / HTTP/1.1\r\n\r\n").close);
        assert!(req("GET / HTTP/1.0\r\n\r\n").close);
        assert!(!req("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").close);
        assert_eq!(
            req("GET / HTTP/1.1\r\nAuthorization: Basic x\r\n\r\n").bearer,
            None
        );
    }

    #[test]
    fn incomplete_oversized_malformed_and_bodies() {
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\n", 8192),
            Parsed::Incomplete
        );
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\nX: aaaaaaaa", 16),
            Parsed::Bad(431, "request head too large")
        );
        assert_eq!(
            parse_request(b"GET / HTTP/1.1\r\nX: a\r\n\r\n", 20),
            Parsed::Bad(431, "request head too large")
        );
        let many: String = (0..40).map(|i| format!("H{i}: v\r\n")).collect();
        assert_eq!(
            parse_request(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes(), 8192),
            Parsed::Bad(431, "too many headers")
        );
        assert_eq!(
            parse_request(b"GE T / HTTP/1.1\r\n\r\n", 8192),
            Parsed::Bad(400, "malformed request")
        );
        assert_eq!(
            parse_request(b"POST /x HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 8192),
            Parsed::Bad(400, "request bodies are not accepted")
        );
        assert_eq!(
            parse_request(
                b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                8192
            ),
            Parsed::Bad(400, "request bodies are not accepted")
        );
        assert!(matches!(
            parse_request(b"GET /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 8192),
            Parsed::Request(_)
        ));
    }

    #[test]
    fn routes_methods_and_probes() {
        let (s, text) = answer("GET /healthz HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
        assert!(text.contains("Content-Length: 3\r\n"), "{text}");
        assert!(text.contains("Connection: keep-alive\r\n"), "{text}");
        let (s, text) = answer("GET /healthz HTTP/1.1\r\n\r\n", None, false);
        assert_eq!(s, 503);
        assert!(text.ends_with("shutting down\n"), "{text}");
        assert_eq!(answer("GET /readyz HTTP/1.1\r\n\r\n", None, true).0, 503);
        let (s, text) = answer("GET /status HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(
            text.contains("application/json") && text.ends_with("}"),
            "{text}"
        );
        let (s, text) = answer("GET /metrics HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(text.contains("version=0.0.4"), "{text}");
        assert!(text.ends_with("turnstile_ticks_total 3\n"), "{text}");
        assert_eq!(answer("GET /nope HTTP/1.1\r\n\r\n", None, true).0, 404);
        let (s, text) = answer("DELETE /status HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 405);
        assert!(text.contains("Allow: GET, HEAD\r\n"), "{text}");
        let (s, text) = answer("HEAD /healthz HTTP/1.1\r\n\r\n", None, true);
        assert_eq!(s, 200);
        assert!(
            text.ends_with("\r\n\r\n") && text.contains("Content-Length: 3"),
            "{text}"
        );
        let r = respond(
            &req("GET /healthz HTTP/1.1\r\n\r\n"),
            None,
            &Fixed::new(true),
            true,
        );
        assert!(r.close);
        assert!(
            String::from_utf8(r.bytes)
                .unwrap()
                .contains("Connection: close")
        );
    }

    #[test]
    fn the_token_guards_everything_but_healthz() {
        let t = AuthToken::new("s3cret");
        assert_eq!(
            answer("GET /healthz HTTP/1.1\r\n\r\n", Some(&t), true).0,
            200
        );
        for path in ["/readyz", "/status", "/metrics"] {
            let (s, text) = answer(&format!("GET {path} HTTP/1.1\r\n\r\n"), Some(&t), true);
            assert_eq!(s, 401, "{path}");
            assert!(text.contains("WWW-Authenticate: Bearer"), "{text}");
            let wrong = format!("GET {path} HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n");
            assert_eq!(answer(&wrong, Some(&t), true).0, 401, "{path}");
            let right = format!("GET {path} HTTP/1.1\r\nAuthorization: bearer s3cret\r\n\r\n");
            assert_ne!(answer(&right, Some(&t), true).0, 401, "{path}");
        }
        assert!(owns(LISTENER));
        assert!(owns(HTTP_CONNS.token(0)));
        assert!(owns(HTTP_CONNS.token(MAX_CONNECTIONS_LIMIT - 1)));
        assert!(!owns(Token(
            HTTP_CONNS.token(MAX_CONNECTIONS_LIMIT - 1).0 - 1
        )));
        assert!(!owns(crate::tokens::JOURNAL));
        assert!(!owns(Token(LISTENER.0 + 1)));
    }

    /// `/access` changes the policy: `POST` only (a `GET` is `405` naming `POST`), behind
    /// the token, its query handed to the source whole.
    #[test]
    fn access_is_a_post_behind_the_token() {
        let echo = Fixed {
            access: Some(|query| (200, format!("ran {query}"))),
            ..Fixed::new(true)
        };
        let t = AuthToken::new("s3cret");
        let ask = |text: &str| {
            let r = respond(&req(text), Some(&t), &echo, false);
            (r.status, String::from_utf8(r.bytes).unwrap())
        };
        let (s, text) = ask(
            "GET /access?platform=irc&command=users HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n",
        );
        assert_eq!(s, 405);
        assert!(text.contains("Allow: POST\r\n"), "{text}");
        assert_eq!(
            ask("POST /access?platform=irc&command=users HTTP/1.1\r\n\r\n").0,
            401
        );
        let (s, text) = ask(
            "POST /access?platform=irc&command=users HTTP/1.1\r\nAuthorization: Bearer s3cret\r\nContent-Length: 0\r\n\r\n",
        );
        assert_eq!(s, 200);
        assert!(text.ends_with("ran platform=irc&command=users"), "{text}");
        // Without a configured token, never served.
        let r = respond(&req("POST /access?x HTTP/1.1\r\n\r\n"), None, &echo, false);
        assert_eq!(r.status, 403);
    }

    /// `/history` shows what users said: `GET` behind the token, never open; its lines are
    /// JSON lines, its refusals text.
    #[test]
    fn history_is_a_get_behind_the_token() {
        let stored = Fixed {
            history: Some(|query| match query {
                "session=a:dm:1" => (200, "{\"user\":\"hi\"}\n".into()),
                _ => (400, "give session=KEY\n".into()),
            }),
            ..Fixed::new(true)
        };
        let t = AuthToken::new("s3cret");
        let ask = |text: &str, token| {
            let r = respond(&req(text), token, &stored, false);
            (r.status, String::from_utf8(r.bytes).unwrap())
        };
        let bearer = "Authorization: Bearer s3cret\r\n";
        let (s, text) = ask(
            &format!("GET /history?session=a:dm:1 HTTP/1.1\r\n{bearer}\r\n"),
            Some(&t),
        );
        assert_eq!(s, 200);
        assert!(
            text.contains("Content-Type: application/x-ndjson"),
            "{text}"
        );
        assert!(text.ends_with("\r\n\r\n{\"user\":\"hi\"}\n"), "{text}");
        let (s, text) = ask(&format!("GET /history HTTP/1.1\r\n{bearer}\r\n"), Some(&t));
        assert_eq!(s, 400);
        assert!(text.contains("text/plain") && text.ends_with("give session=KEY\n"));
        let (s, _) = ask("GET /history?session=a:dm:1 HTTP/1.1\r\n\r\n", Some(&t));
        assert_eq!(s, 401);
        let (s, text) = ask("GET /history?session=a:dm:1 HTTP/1.1\r\n\r\n", None);
        assert_eq!(s, 403);
        assert!(text.ends_with(
            "/history needs the gateway's auth token (--auth-token or TURNSTILE_AUTH_TOKEN)\n"
        ));
        let post = format!("POST /history?session=a:dm:1 HTTP/1.1\r\n{bearer}\r\n");
        assert_eq!(ask(&post, Some(&t)).0, 405);
        // A gateway storing nothing says so.
        let r = respond(
            &req(&format!(
                "GET /history?session=a:dm:1 HTTP/1.1\r\n{bearer}\r\n"
            )),
            Some(&t),
            &Fixed::new(true),
            false,
        );
        assert_eq!(r.status, 404);
    }
}
