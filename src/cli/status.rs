//! `turnstile status`: a human summary of a gateway's status snapshot, read from its status
//! file or its HTTP endpoint, and an exit code a probe can use.
//!
//! Exit codes: 0 healthy; 1 unhealthy (stale snapshot, draining, stopped, `/healthz` 503);
//! 2 usage; 3 no snapshot (missing or unreadable file, no server, not a turnstile status).

use super::units::Seconds;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde_json::Value;

use super::USAGE_ERROR;

/// Exit code when the gateway is unhealthy or its snapshot stale.
pub(crate) const UNHEALTHY: i32 = 1;
/// Exit code when there is no snapshot to judge.
pub(crate) const UNKNOWN: i32 = 3;
/// Response bytes read from the HTTP endpoint at most.
const MAX_RESPONSE: u64 = 4 << 20;

/// Flags of `status`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").args(["status_file", "http"])))]
pub(crate) struct StatusArgs {
    /// Read the snapshot from this status file (`serve --status-file`).
    #[arg(long)]
    status_file: Option<PathBuf>,
    /// Ask the gateway's HTTP endpoint at this address [default: 127.0.0.1:7879].
    #[arg(long)]
    http: Option<String>,
    /// Bearer token for the HTTP endpoint.
    #[arg(long, env = "TURNSTILE_AUTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A snapshot older than this is stale.
    #[arg(long, default_value = "2s")]
    max_age: Seconds,
    /// How long to wait for the HTTP endpoint.
    #[arg(long, default_value = "5s")]
    timeout: Seconds,
    #[command(flatten)]
    tls: crate::platforms::tls::ClientTlsArgs,
}

/// Prints the summary; returns the exit code.
pub(crate) fn run(args: StatusArgs) -> i32 {
    if args.max_age.0 <= 0.0 {
        eprintln!("turnstile status: --max-age must be a positive number of seconds");
        return USAGE_ERROR;
    }
    if args.timeout.0 <= 0.0 {
        eprintln!("turnstile status: --timeout must be a positive number of seconds");
        return USAGE_ERROR;
    }
    let (snapshot, probe) = match &args.status_file {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => (text, None),
            Err(e) => {
                eprintln!(
                    "turnstile status: cannot read the status file {}: {e}",
                    path.display()
                );
                return UNKNOWN;
            }
        },
        None => {
            let addr = args.http.as_deref().unwrap_or("127.0.0.1:7879");
            let timeout = Duration::from_secs_f64(args.timeout.0);
            let status = match get(addr, "/status", args.token.as_deref(), timeout, &args.tls) {
                Ok((200, body)) => body,
                Ok((401, _)) => {
                    eprintln!(
                        "turnstile status: {addr}: unauthorized (give the gateway's token with --token or TURNSTILE_AUTH_TOKEN)"
                    );
                    return UNKNOWN;
                }
                Ok((code, body)) => {
                    eprintln!(
                        "turnstile status: {addr}/status answered {code}: {}",
                        body.trim()
                    );
                    return UNKNOWN;
                }
                Err(e) => {
                    eprintln!("turnstile status: {addr}: {e}");
                    return UNKNOWN;
                }
            };
            let health = match get(addr, "/healthz", None, timeout, &args.tls) {
                Ok((200, _)) => Ok(()),
                Ok((code, body)) => Err(format!("/healthz answered {code}: {}", body.trim())),
                Err(e) => Err(format!("/healthz: {e}")),
            };
            (status, Some(health))
        }
    };
    let Ok(v) = serde_json::from_str::<Value>(&snapshot) else {
        eprintln!("turnstile status: not a turnstile status document (not JSON)");
        return UNKNOWN;
    };
    if v.get("state").and_then(Value::as_str).is_none() || v.get("ticks").is_none() {
        eprintln!("turnstile status: not a turnstile status document");
        return UNKNOWN;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    print!("{}", summary(&v, now));
    match verdict(&v, now, args.max_age.0, probe) {
        Ok(()) => {
            println!("verdict: healthy");
            0
        }
        Err(why) => {
            println!("verdict: unhealthy: {why}");
            UNHEALTHY
        }
    }
}

fn num(v: &Value, path: &[&str]) -> f64 {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .and_then(Value::as_f64)
        .unwrap_or(0.0)
}

/// Healthy: running, fresh, and (over HTTP) `/healthz` 200.
fn verdict(
    v: &Value,
    now_unix: f64,
    max_age: f64,
    probe: Option<Result<(), String>>,
) -> Result<(), String> {
    let state = v["state"].as_str().unwrap_or("?");
    if state != "running" {
        return Err(format!("state is {state}"));
    }
    let updated = num(v, &["process", "updated_unix_s"]);
    let age = now_unix - updated;
    if updated <= 0.0 || age > max_age {
        return Err(format!(
            "the snapshot is {age:.1} s old (stale past {max_age} s): the loop is wedged or the process is gone"
        ));
    }
    probe.unwrap_or(Ok(()))
}

fn bytes(n: f64) -> String {
    if n >= 1048576.0 {
        format!("{:.1} MiB", n / 1048576.0)
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// The human summary, one topic per line.
fn summary(v: &Value, now_unix: f64) -> String {
    let mut out = String::new();
    runtime_lines(&mut out, v, now_unix);
    if let Some(f) = v.get("frontend") {
        frontend_lines(&mut out, f);
    }
    out.push_str(&format!(
        "memory: {} resident\n",
        bytes(num(v, &["process", "rss_bytes"]))
    ));
    out
}

/// The reactor's own lines: state, loop lag, sessions, turns and messages, cleanups.
fn runtime_lines(out: &mut String, v: &Value, now_unix: f64) {
    let age = now_unix - num(v, &["process", "updated_unix_s"]);
    out.push_str(&format!(
        "state: {} (pid {}), uptime {:.1} s, snapshot {:.1} s old, {} ticks\n",
        v["state"].as_str().unwrap_or("?"),
        num(v, &["pid"]),
        num(v, &["uptime_s"]),
        age.max(0.0),
        num(v, &["ticks"]),
    ));
    out.push_str(&format!(
        "loop lag: last minute p50 {} ms, p99 {} ms, max {} ms; since start p99 {} ms, max {} ms\n",
        num(v, &["loop_lag_window_ms", "p50"]),
        num(v, &["loop_lag_window_ms", "p99"]),
        num(v, &["loop_lag_window_ms", "max"]),
        num(v, &["loop_lag_ms", "p99"]),
        num(v, &["loop_lag_ms", "max"]),
    ));
    out.push_str(&format!(
        "sessions: {} ({} running, {} queued messages, {} waiting for a worker), agents {} cached, {} parked\n",
        num(v, &["sessions", "total"]),
        num(v, &["sessions", "running"]),
        num(v, &["sessions", "queued_messages"]),
        num(v, &["sessions", "waiting_for_worker"]),
        num(v, &["sessions", "cached_agents"]),
        num(v, &["sessions", "parked_agents"]),
    ));
    out.push_str(&format!(
        "turns: {} running, {} completed, {} failed, {} cancelled, {} abandoned; messages {} accepted, {} rejected\n",
        num(v, &["turns", "in_flight"]),
        num(v, &["turns", "completed"]),
        num(v, &["turns", "failed"]),
        num(v, &["turns", "cancelled"]),
        num(v, &["turns", "abandoned"]),
        num(v, &["messages", "accepted"]),
        rejected(v),
    ));
    out.push_str(&format!(
        "cleanups: {} done, {} timed out, {} failed, {} queued, {} pending\n",
        num(v, &["cleanups", "done"]),
        num(v, &["cleanups", "timed_out"]),
        num(v, &["cleanups", "failed"]),
        num(v, &["cleanups", "queued"]),
        num(v, &["cleanups", "pending"]),
    ));
}

/// Messages rejected: the bridge counts every rejection (the runtime's included), by
/// reason; without a bridge, the runtime's total.
fn rejected(v: &Value) -> String {
    let Some(Value::Object(by_reason)) = v.get("frontend").and_then(|f| f.get("rejected")) else {
        return num(v, &["messages", "rejected"]).to_string();
    };
    let mut reasons: Vec<String> = by_reason
        .iter()
        .filter(|(_, n)| n.as_u64().unwrap_or(0) > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let total: u64 = by_reason.values().filter_map(Value::as_u64).sum();
    if reasons.is_empty() {
        total.to_string()
    } else {
        reasons.sort();
        format!("{total} ({})", reasons.join(", "))
    }
}

/// The frontend's lines: connections, then each platform's outbox.
fn frontend_lines(out: &mut String, f: &Value) {
    out.push_str(&format!(
        "connections: {} ({} unauthenticated), {} refused; http {} open; tls {}\n",
        num(f, &["connections"]),
        num(f, &["unauthenticated"]),
        num(f, &["connections_refused"]),
        num(f, &["http", "connections"]),
        if f.get("tls") == Some(&Value::Bool(true)) {
            "on"
        } else {
            "off"
        },
    ));
    if let Some(Value::Object(outboxes)) = f.get("outboxes") {
        let parts: Vec<String> = outboxes.iter().map(|(name, p)| outbox(name, p)).collect();
        let list = if parts.is_empty() {
            "none".to_owned()
        } else {
            parts.join("; ")
        };
        out.push_str(&format!("outboxes: {list}\n"));
    }
    if let Some(c) = f.get("cluster") {
        out.push_str(&cluster_line(c));
    }
}

/// A cluster member's line (`--cluster`): who it is and who is alive, what it owns, what
/// waits on other instances, ownership's changes, the stream reader.
fn cluster_line(c: &Value) -> String {
    let list = |key: &str| -> String {
        let items: Vec<String> = c[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if items.is_empty() {
            String::new()
        } else {
            format!(" ({})", items.join(" "))
        }
    };
    let rebalance = if c["rebalance"] == Value::Bool(true) {
        format!(
            "rebalancing (a drain at most {:.1} s): {} draining{}, drained {} partitions, {} messages",
            num(c, &["drain_ms"]) / 1000.0,
            c["draining"].as_array().map_or(0, Vec::len),
            list("draining"),
            num(c, &["drained_partitions"]),
            num(c, &["drained_messages"]),
        )
    } else {
        "no rebalancing".to_owned()
    };
    format!(
        "cluster: instance {}, {} live{}; owns {} of {} partitions{}; {} waiting for a remote outcome ({} early outcomes, {} dropped); partitions gained {}, lost {}, fenced {}; handed over {} partitions, {} messages; {rebalance}; reader {} failures, {} reconnects{}\n",
        c["instance"].as_str().unwrap_or("?"),
        c["live_instances"].as_array().map_or(0, Vec::len),
        list("live_instances"),
        num(c, &["owned_partitions"]),
        num(c, &["partitions"]),
        list("owned"),
        num(c, &["remote_waiting"]),
        num(c, &["early_outcomes"]),
        num(c, &["early_outcomes_dropped"]),
        num(c, &["gained"]),
        num(c, &["lost"]),
        num(c, &["fenced"]),
        num(c, &["handed_over_partitions"]),
        num(c, &["handed_over_messages"]),
        num(c, &["reader_failures"]),
        num(c, &["reader_reconnects"]),
        if c["reader_failing"] == Value::Bool(true) {
            ", failing"
        } else {
            ""
        },
    )
}

/// One platform's outbox: results waiting and owed, results held for want of room within
/// `--outbox-bytes`, and (when its bridge is away) how long and whether it is stale, with
/// the results dropped for it.
fn outbox(name: &str, p: &Value) -> String {
    let mut text = format!(
        "{name} {} waiting ({}), {} owed, {} held ({})",
        num(p, &["outbox_events"]),
        bytes(num(p, &["outbox_bytes"])),
        num(p, &["reserved_events"]),
        num(p, &["held_events"]),
        bytes(num(p, &["held_bytes"])),
    );
    if let Some(ms) = p.get("absent_ms").and_then(Value::as_f64) {
        text.push_str(&format!(", absent {:.1} s", ms / 1000.0));
    }
    if p.get("stale") == Some(&Value::Bool(true)) {
        text.push_str(", stale");
    }
    let dropped = num(p, &["stale_dropped"]);
    if dropped > 0.0 {
        text.push_str(&format!(", {dropped} stale dropped"));
    }
    text
}

/// A plain HTTP/1.1 GET with timeouts; the status code and body. Errors are in words.
fn get(
    addr: &str,
    path: &str,
    token: Option<&str>,
    timeout: Duration,
    tls: &crate::platforms::tls::ClientTlsArgs,
) -> Result<(u16, String), String> {
    let tls_config = tls.config()?;
    let sockaddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|e| format!("not an address: {e}"))?
        .next()
        .ok_or("not an address")?;
    let stream = TcpStream::connect_timeout(&sockaddr, timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => {
            "connection refused (is the gateway running with --http-listen here?)".to_owned()
        }
        std::io::ErrorKind::TimedOut => "timed out connecting".to_owned(),
        _ => format!("cannot connect: {e}"),
    })?;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let mut stream = tls.wrap(tls_config.as_ref(), stream, addr, timeout)?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .map_err(|e| format!("cannot send the request: {e}"))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_RESPONSE)
        .read_to_end(&mut raw)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "timed out waiting for the answer (is the gateway's loop wedged?)".to_owned()
            }
            _ => format!("reading the answer: {e}"),
        })?;
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head = match resp.parse(&raw) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return Err("not a turnstile server (no HTTP answer)".into()),
    };
    let code = resp.code.ok_or("not a turnstile server (no status code)")?;
    Ok((code, String::from_utf8_lossy(&raw[head..]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc(state: &str, updated: f64) -> Value {
        json!({"state": state, "ticks": 3, "process": {"updated_unix_s": updated}})
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(&doc("running", 100.0), 101.0, 2.0, None), Ok(()));
        assert!(
            verdict(&doc("running", 100.0), 102.5, 2.0, None)
                .unwrap_err()
                .contains("2.5 s old")
        );
        assert_eq!(
            verdict(&doc("draining", 100.0), 100.0, 2.0, None),
            Err("state is draining".into())
        );
        assert_eq!(
            verdict(&doc("running", 100.0), 100.0, 2.0, Some(Err("x".into()))),
            Err("x".into())
        );
        assert!(verdict(&doc("running", 0.0), 1.0, 2.0, None).is_err());
    }

    #[test]
    fn the_summary_counts_the_bridges_rejections() {
        let v = json!({"state": "running", "messages": {"accepted": 3, "rejected": 0},
            "frontend": {"rejected": {"invalid": 1, "backpressure": 0, "queue_full": 2}}});
        let text = summary(&v, 0.0);
        assert!(
            text.contains("messages 3 accepted, 3 (invalid 1, queue_full 2) rejected"),
            "{text}"
        );
        let v = json!({"state": "running", "messages": {"accepted": 3, "rejected": 4}});
        assert!(summary(&v, 0.0).contains("messages 3 accepted, 4 rejected"));
    }

    /// A cluster member's figures reach the summary on one line; without `--cluster`, none.
    #[test]
    fn the_summary_shows_the_cluster() {
        let v = json!({"state": "running", "frontend": {"cluster": {
            "instance": "a", "live_instances": ["a", "b"], "partitions": 8,
            "owned_partitions": 3, "owned": [0, 4, 7], "remote_waiting": 5, "gained": 6,
            "lost": 1, "fenced": 2, "handed_over_partitions": 3, "handed_over_messages": 9,
            "reader_failures": 4, "reader_reconnects": 1, "reader_failing": true,
            "early_outcomes": 7, "early_outcomes_dropped": 8, "rebalance": true,
            "drain_ms": 2500, "draining": [4], "drained_partitions": 2, "drained_messages": 11}}});
        let text = summary(&v, 0.0);
        assert!(
            text.contains(
                "cluster: instance a, 2 live (a b); owns 3 of 8 partitions (0 4 7); 5 waiting for a remote outcome (7 early outcomes, 8 dropped); partitions gained 6, lost 1, fenced 2; handed over 3 partitions, 9 messages; rebalancing (a drain at most 2.5 s): 1 draining (4), drained 2 partitions, 11 messages; reader 4 failures, 1 reconnects, failing\n"
            ),
            "{text}"
        );
        let v = json!({"state": "running", "frontend": {}});
        assert!(!summary(&v, 0.0).contains("cluster"));
    }

    /// Held results and the stale figures reach the human summary, per platform.
    #[test]
    fn the_summary_shows_held_results_and_stale_drops() {
        let v = json!({"state": "running", "frontend": {"outboxes": {
            "irc": {"outbox_events": 2, "outbox_bytes": 300, "reserved_events": 5,
                    "held_events": 3, "held_bytes": 3145728, "absent_ms": null,
                    "stale": false, "stale_dropped": 0},
            "telegram": {"outbox_events": 1000, "outbox_bytes": 2048, "reserved_events": 1000,
                    "held_events": 0, "held_bytes": 0, "absent_ms": 3_700_000,
                    "stale": true, "stale_dropped": 17}}}});
        let text = summary(&v, 0.0);
        assert!(
            text.contains(
                "outboxes: irc 2 waiting (300 B), 5 owed, 3 held (3.0 MiB); \
                 telegram 1000 waiting (2.0 KiB), 1000 owed, 0 held (0 B), absent 3700.0 s, \
                 stale, 17 stale dropped\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(bytes(10.0), "10 B");
        assert_eq!(bytes(2048.0), "2.0 KiB");
        assert_eq!(bytes(3.0 * 1048576.0), "3.0 MiB");
    }
}
