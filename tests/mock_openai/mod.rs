//! A scripted OpenAI-compatible server for tests and benchmarks: std `TcpListener` on
//! 127.0.0.1, real HTTP/1.1 (keep-alive, chunked transfer) and server-sent events.
//!
//! Each request takes the next scripted [`Reply`] (in arrival order, across connections);
//! an unscripted request gets a 500. Everything observable is reported on channels: the
//! requests (with arrival time, headers and JSON body) and [`Notice`]s (a reply fully sent,
//! a client that closed a held stream).
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};

/// How a streamed reply ends.
#[derive(Clone, Debug)]
pub enum End {
    /// `data: [DONE]`, then the chunked terminator; the connection stays open.
    Done,
    /// The socket is closed after the events, without the chunked terminator.
    Abort,
    /// Close-delimited body (`Connection: close`, no length): the events, then a clean EOF,
    /// without `[DONE]`.
    Eof,
    /// Nothing more is sent; the connection is held open and silent until the client
    /// closes it ([`Notice::ClientClosed`]).
    Hold,
    /// A one-character delta keeps coming every few milliseconds until the client closes
    /// the connection ([`Notice::ClientClosed`]).
    Endless,
    /// No content: an SSE comment and an empty delta every `ms` milliseconds until the
    /// client closes the connection ([`Notice::ClientClosed`]); [`Notice::Kept`] after
    /// each.
    Comments { ms: u64 },
}

/// A scripted answer.
#[derive(Clone, Debug)]
pub enum Reply {
    /// 200 with `text/event-stream`: each string is one event's data, in its own chunk.
    Stream { events: Vec<String>, end: End },
    /// Any status with headers and a body (`Content-Length` framed).
    Status {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
}

/// A request as the mock saw it.
#[derive(Clone, Debug)]
pub struct Request {
    /// When its last byte arrived.
    pub at: Instant,
    /// Header names lowercased.
    pub headers: HashMap<String, String>,
    /// The JSON body.
    pub body: serde_json::Value,
    /// The request line.
    pub line: String,
}

impl Request {
    /// `(role, content)` of each message sent.
    pub fn messages(&self) -> Vec<(String, String)> {
        self.body["messages"]
            .as_array()
            .map(|m| {
                m.iter()
                    .map(|x| {
                        (
                            x["role"].as_str().unwrap_or("").to_owned(),
                            x["content"].as_str().unwrap_or("").to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Something the mock noticed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The reply to request number `n` (counting from 0) was written, at `at`.
    Sent { n: usize, at: Instant },
    /// The client closed a connection the mock was holding or streaming on.
    ClientClosed { n: usize },
    /// A keep-alive (comment and empty delta) of request `n` was written.
    Kept { n: usize },
}

/// The running mock.
pub struct Mock {
    pub addr: SocketAddr,
    pub requests: Receiver<Request>,
    pub notices: Receiver<Notice>,
    script: Arc<Mutex<VecDeque<Reply>>>,
}

struct Shared {
    script: Arc<Mutex<VecDeque<Reply>>>,
    requests: Sender<Request>,
    notices: Sender<Notice>,
    count: Mutex<usize>,
}

impl Mock {
    /// Starts the mock with `script`; it runs until the test process ends.
    pub fn start(script: Vec<Reply>) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let addr = listener.local_addr().expect("local addr");
        let (rtx, rrx) = unbounded();
        let (ntx, nrx) = unbounded();
        let script = Arc::new(Mutex::new(VecDeque::from(script)));
        let shared = Arc::new(Shared {
            script: Arc::clone(&script),
            requests: rtx,
            notices: ntx,
            count: Mutex::new(0),
        });
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let shared = Arc::clone(&shared);
                thread::spawn(move || serve(conn, &shared));
            }
        });
        Mock {
            addr,
            requests: rrx,
            notices: nrx,
            script,
        }
    }

    /// The base URL to give the agent.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// `serve`'s flags for the openai agent against this mock (model `m`).
    pub fn agent_args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["--agent", "openai", "--model", "m", "--openai-base-url"]
            .map(str::to_owned)
            .into();
        args.push(self.base_url());
        args
    }

    /// Appends replies to the script.
    pub fn push(&self, replies: impl IntoIterator<Item = Reply>) {
        self.script.lock().expect("script").extend(replies);
    }

    /// The next request, waiting up to 20 s.
    pub fn next_request(&self) -> Request {
        self.requests
            .recv_timeout(Duration::from_secs(20))
            .expect("a request reached the mock")
    }

    /// Waits up to 20 s for a notice matching `pred`, skipping others.
    pub fn wait_notice(&self, pred: impl Fn(&Notice) -> bool) -> Notice {
        loop {
            let n = self
                .notices
                .recv_timeout(Duration::from_secs(20))
                .expect("a notice from the mock");
            if pred(&n) {
                return n;
            }
        }
    }
}

/// A streamed reply of `deltas`, then a usage chunk, then `[DONE]`.
pub fn stream(deltas: &[&str], prompt_tokens: u64, completion_tokens: u64) -> Reply {
    let mut events: Vec<String> = deltas.iter().map(|d| delta(d)).collect();
    events.push(
        r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#
            .to_owned(),
    );
    events.push(format!(
        r#"{{"id":"c","object":"chat.completion.chunk","choices":[],"usage":{{"prompt_tokens":{prompt_tokens},"completion_tokens":{completion_tokens},"total_tokens":{}}}}}"#,
        prompt_tokens + completion_tokens
    ));
    Reply::Stream {
        events,
        end: End::Done,
    }
}

/// One chunk's data carrying `text`.
pub fn delta(text: &str) -> String {
    let content = serde_json::to_string(text).expect("json string");
    format!(
        r#"{{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{{"index":0,"delta":{{"content":{content}}},"finish_reason":null}}]}}"#
    )
}

/// An error answer with OpenAI's error shape.
pub fn error(status: u16, message: &str, headers: &[(&str, &str)]) -> Reply {
    let body = serde_json::json!({"error": {"message": message, "type": "error", "code": null}});
    Reply::Status {
        status,
        headers: headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        body: body.to_string(),
    }
}

fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if reader.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
        }
    }
    let len: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        at: Instant::now(),
        headers,
        body: serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        line: line.trim_end().to_owned(),
    })
}

fn chunk(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    write!(out, "{:x}\r\n", data.len())?;
    out.write_all(data)?;
    out.write_all(b"\r\n")?;
    out.flush()
}

fn serve(conn: TcpStream, shared: &Shared) {
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut out = write_half;
    let mut reader = BufReader::new(conn);
    while let Some(req) = read_request(&mut reader) {
        let n = {
            let mut c = shared.count.lock().expect("count");
            *c += 1;
            *c - 1
        };
        let _ = shared.requests.send(req);
        let reply = shared.script.lock().expect("script").pop_front();
        let reply = reply.unwrap_or_else(|| error(500, "unscripted request", &[]));
        match reply {
            Reply::Status {
                status,
                headers,
                body,
            } => {
                let mut head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
                    body.len()
                );
                for (k, v) in headers {
                    head.push_str(&format!("{k}: {v}\r\n"));
                }
                head.push_str("\r\n");
                if out.write_all(head.as_bytes()).is_err()
                    || out.write_all(body.as_bytes()).is_err()
                {
                    return;
                }
                let _ = out.flush();
                let _ = shared.notices.send(Notice::Sent {
                    n,
                    at: Instant::now(),
                });
            }
            Reply::Stream { events, end } => {
                let eof = matches!(end, End::Eof);
                let head = if eof {
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                } else {
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                };
                if out.write_all(head.as_bytes()).is_err() {
                    return;
                }
                for e in &events {
                    let data = format!("data: {e}\n\n");
                    let ok = if eof {
                        out.write_all(data.as_bytes())
                            .and_then(|()| out.flush())
                            .is_ok()
                    } else {
                        chunk(&mut out, data.as_bytes()).is_ok()
                    };
                    if !ok {
                        return;
                    }
                }
                match end {
                    End::Done => {
                        let ok = chunk(&mut out, b"data: [DONE]\n\n").is_ok()
                            && out.write_all(b"0\r\n\r\n").is_ok()
                            && out.flush().is_ok();
                        if !ok {
                            return;
                        }
                        let _ = shared.notices.send(Notice::Sent {
                            n,
                            at: Instant::now(),
                        });
                    }
                    End::Abort | End::Eof => {
                        let _ = out.flush();
                        let _ = shared.notices.send(Notice::Sent {
                            n,
                            at: Instant::now(),
                        });
                        let _ = out.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    End::Hold => {
                        // Silent until the client goes away: a read returns 0 or fails.
                        let mut buf = [0u8; 256];
                        loop {
                            match reader.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(_) => {}
                            }
                        }
                        let _ = shared.notices.send(Notice::ClientClosed { n });
                        return;
                    }
                    End::Comments { ms } => {
                        let pace = crossbeam_channel::tick(Duration::from_millis(ms));
                        let empty = delta("");
                        for _ in 0..60_000 / ms.max(1) {
                            let kept = chunk(&mut out, b": keep-alive\n\n").is_ok()
                                && chunk(&mut out, format!("data: {empty}\n\n").as_bytes()).is_ok();
                            if !kept {
                                let _ = shared.notices.send(Notice::ClientClosed { n });
                                return;
                            }
                            let _ = shared.notices.send(Notice::Kept { n });
                            let _ = pace.recv();
                        }
                        return;
                    }
                    End::Endless => {
                        let pace = crossbeam_channel::tick(Duration::from_millis(5));
                        let d = delta(".");
                        // Bounded: a client that never closes ends the stream after a minute.
                        for _ in 0..12_000 {
                            if chunk(&mut out, format!("data: {d}\n\n").as_bytes()).is_err() {
                                let _ = shared.notices.send(Notice::ClientClosed { n });
                                return;
                            }
                            let _ = pace.recv();
                        }
                        return;
                    }
                }
            }
        }
    }
}
