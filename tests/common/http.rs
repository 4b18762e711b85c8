//! The HTTP endpoint (`--http-listen`) seen by a client: one `GET` a connection
//! (`Connection: close`), its answer's status code, head and body. TLS tests send the same
//! request over their own stream and read the answer with [`parse_response`].

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Only a failing run waits this long for an answer.
const WAIT: Duration = Duration::from_secs(60);

/// One answer of the endpoint.
#[derive(Debug)]
pub struct Http {
    pub status: u16,
    /// The status line and the headers, without the blank line.
    pub head: String,
    pub body: String,
}

/// `GET path` on a fresh connection to `addr`, with the bearer `token` if given.
pub fn get(addr: &str, path: &str, token: Option<&str>) -> Http {
    let mut s = TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    s.write_all(get_request(path, &bearer(token)).as_bytes())
        .expect("request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the answer");
    parse_response(&raw).0
}

/// The `Authorization` header (CRLF-ended) for the bearer `token`; empty without one.
pub fn bearer(token: Option<&str>) -> String {
    token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default()
}

/// A `GET path` that closes its connection, with `headers` (each ending in CRLF).
pub fn get_request(path: &str, headers: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{headers}Connection: close\r\n\r\n")
}

/// A response from the start of `raw` (its body as long as its `Content-Length`), and the
/// bytes it took.
pub fn parse_response(raw: &[u8]) -> (Http, usize) {
    let text = String::from_utf8_lossy(raw);
    let end = text
        .find("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head: {text:?}"));
    let head = text[..end].to_owned();
    let status: u16 = head
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .expect("content length")
        .trim()
        .parse()
        .expect("length");
    let body = text[end + 4..end + 4 + len].to_owned();
    (Http { status, head, body }, end + 4 + len)
}
