//! A stand-in OpenAI-compatible server, to try `--agent openai` without a model.
//!
//! `cargo run --example openai_mock [-- --listen 127.0.0.1:0 --words-per-s 20]` prints
//! `listening on ADDR`; point the agent at `http://ADDR/v1`. It streams (word by word)
//! a reply that quotes the last user message and the earlier ones it was sent, so the
//! conversation memory is visible. A message containing "story" streams without end (for
//! trying `/stop`); the model `missing` answers 404; with `MOCK_API_KEY` set, a request
//! without that bearer token answers 401.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1).cloned()
}

fn main() {
    let listen = arg("--listen").unwrap_or_else(|| "127.0.0.1:0".into());
    let rate: f64 = arg("--words-per-s")
        .and_then(|v| v.parse().ok())
        .unwrap_or(20.0);
    let listener = match TcpListener::bind(&listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("openai_mock: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    if let Ok(addr) = listener.local_addr() {
        println!("listening on {addr}");
    }
    let _ = std::io::stdout().flush();
    let gap = Duration::from_secs_f64(1.0 / rate.max(0.1));
    for conn in listener.incoming().flatten() {
        thread::spawn(move || {
            let _ = serve(conn, gap);
        });
    }
}

fn serve(conn: TcpStream, gap: Duration) -> std::io::Result<()> {
    let mut out = conn.try_clone()?;
    let mut reader = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let (mut len, mut auth) = (0usize, String::new());
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 {
                return Ok(());
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => len = v.trim().parse().unwrap_or(0),
                    "authorization" => auth = v.trim().to_owned(),
                    _ => {}
                }
            }
        }
        let mut body = vec![0; len];
        reader.read_exact(&mut body)?;
        let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let model = req["model"].as_str().unwrap_or("");
        if let Ok(key) = std::env::var("MOCK_API_KEY")
            && auth != format!("Bearer {key}")
        {
            error(&mut out, 401, "invalid api key")?;
            continue;
        }
        if model == "missing" {
            error(
                &mut out,
                404,
                &format!("model \"{model}\" not found, try pulling it first"),
            )?;
            continue;
        }
        let users: Vec<&str> = req["messages"]
            .as_array()
            .map(|m| {
                m.iter()
                    .filter(|x| x["role"] == "user")
                    .filter_map(|x| x["content"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        let last = users.last().copied().unwrap_or("");
        let endless = last.contains("story");
        let mut text = format!("You said \"{last}\".");
        if users.len() > 1 {
            let earlier: Vec<String> = users[..users.len() - 1]
                .iter()
                .map(|u| format!("\"{u}\""))
                .collect();
            text.push_str(&format!(" Before that: {}.", earlier.join(", ")));
        }
        out.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        )?;
        let mut words = 0u64;
        let story = "once upon a time there was a gateway that streamed forever";
        let mut send_word = |out: &mut TcpStream, w: &str| -> std::io::Result<()> {
            let chunk = json!({"object": "chat.completion.chunk", "model": model,
                "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": null}]});
            words += 1;
            event(out, &chunk.to_string())?;
            thread::sleep(gap);
            Ok(())
        };
        if endless {
            for w in story.split(' ').cycle().take(100_000) {
                send_word(&mut out, &format!("{w} "))?;
            }
        }
        for (i, w) in text.split(' ').enumerate() {
            send_word(
                &mut out,
                &if i == 0 {
                    w.to_owned()
                } else {
                    format!(" {w}")
                },
            )?;
        }
        let done = json!({"object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        event(&mut out, &done.to_string())?;
        let prompt_tokens = body.len() as u64 / 4;
        let usage = json!({"object": "chat.completion.chunk", "model": model, "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": words,
                      "total_tokens": prompt_tokens + words}});
        event(&mut out, &usage.to_string())?;
        event(&mut out, "[DONE]")?;
        out.write_all(b"0\r\n\r\n")?;
        out.flush()?;
    }
}

fn event(out: &mut TcpStream, data: &str) -> std::io::Result<()> {
    let payload = format!("data: {data}\n\n");
    write!(out, "{:x}\r\n{payload}\r\n", payload.len())?;
    out.flush()
}

fn error(out: &mut TcpStream, status: u16, message: &str) -> std::io::Result<()> {
    let body = json!({"error": {"message": message, "type": "invalid_request_error"}}).to_string();
    write!(
        out,
        "HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()
}
