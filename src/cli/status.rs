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

use crate::liveness::{ClusterStatus, FrontendStatus, PlatformStatus, RuntimeState, Status};

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
            let status = match request(
                "GET",
                addr,
                "/status",
                args.token.as_deref(),
                timeout,
                &args.tls,
            ) {
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
            let health = match request("GET", addr, "/healthz", None, timeout, &args.tls) {
                Ok((200, _)) => Ok(()),
                Ok((code, body)) => Err(format!("/healthz answered {code}: {}", body.trim())),
                Err(e) => Err(format!("/healthz: {e}")),
            };
            (status, Some(health))
        }
    };
    let status = match parse(snapshot) {
        Ok(status) => status,
        Err(why) => {
            eprintln!("turnstile status: not a turnstile status document{why}");
            return UNKNOWN;
        }
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    print!("{}", summary(&status, now));
    match verdict(&status, now, args.max_age.0, probe) {
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

/// The snapshot, typed: the very [`Status`] the gateway wrote. Its names (version,
/// rejection reasons) are `&'static str`, borrowed from the document, so the document is
/// leaked: this process reads one snapshot and exits. The error is the text that follows
/// "not a turnstile status document".
fn parse(snapshot: String) -> Result<Status, &'static str> {
    let text: &'static str = Box::leak(snapshot.into_boxed_str());
    serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => "",
        _ => " (not JSON)",
    })
}

/// Healthy: running, fresh, and (over HTTP) `/healthz` 200.
fn verdict(
    s: &Status,
    now_unix: f64,
    max_age: f64,
    probe: Option<Result<(), String>>,
) -> Result<(), String> {
    if s.state != RuntimeState::Running {
        return Err(format!("state is {}", state_name(s.state)));
    }
    let updated = s.process.updated_unix_s;
    let age = now_unix - updated;
    if updated <= 0.0 || age > max_age {
        return Err(format!(
            "the snapshot is {age:.1} s old (stale past {max_age} s): the loop is wedged or the process is gone"
        ));
    }
    probe.unwrap_or(Ok(()))
}

/// The state as the snapshot spells it (`running`, `draining`, ...).
fn state_name(state: RuntimeState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
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
fn summary(s: &Status, now_unix: f64) -> String {
    let mut out = String::new();
    runtime_lines(&mut out, s, now_unix);
    if let Some(f) = &s.frontend {
        frontend_lines(&mut out, f);
    }
    out.push_str(&format!(
        "memory: {} resident\n",
        bytes(s.process.rss_bytes as f64)
    ));
    out
}

/// The reactor's own lines: state, loop lag, sessions, turns and messages, cleanups.
fn runtime_lines(out: &mut String, s: &Status, now_unix: f64) {
    let age = now_unix - s.process.updated_unix_s;
    out.push_str(&format!(
        "state: {} (pid {}), uptime {:.1} s, snapshot {:.1} s old, {} ticks\n",
        state_name(s.state),
        s.pid,
        s.uptime_s,
        age.max(0.0),
        s.ticks,
    ));
    let (window, since_start) = (&s.loop_lag_window_ms, &s.loop_lag_ms);
    out.push_str(&format!(
        "loop lag: last minute p50 {} ms, p99 {} ms, max {} ms; since start p99 {} ms, max {} ms\n",
        window.p50, window.p99, window.max, since_start.p99, since_start.max,
    ));
    let n = &s.sessions;
    out.push_str(&format!(
        "sessions: {} ({} running, {} queued messages, {} waiting for a worker), agents {} cached, {} parked\n",
        n.total, n.running, n.queued_messages, n.waiting_for_worker, n.cached_agents, n.parked_agents,
    ));
    let t = &s.turns;
    out.push_str(&format!(
        "turns: {} running, {} completed, {} failed, {} cancelled, {} abandoned; messages {} accepted, {} rejected\n",
        t.in_flight,
        t.completed,
        t.failed,
        t.cancelled,
        t.abandoned,
        s.messages.accepted,
        rejected(s),
    ));
    if let Some(f) = &s.agent_failures {
        out.push_str(&format!(
            "model requests failed: {} connect, {} status, {} stall\n",
            f.connect, f.status, f.stall
        ));
    }
    let c = &s.cleanups;
    out.push_str(&format!(
        "cleanups: {} done, {} timed out, {} failed, {} queued, {} pending\n",
        c.done, c.timed_out, c.failed, c.queued, c.pending,
    ));
}

/// Messages rejected: the bridge counts every rejection (the runtime's included), by
/// reason; without a bridge, the runtime's total.
fn rejected(s: &Status) -> String {
    let Some(bridge) = s.frontend.as_ref().and_then(|f| f.bridge.as_ref()) else {
        return s.messages.rejected.to_string();
    };
    let mut reasons: Vec<String> = bridge
        .rejected
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let total: u64 = bridge.rejected.values().sum();
    if reasons.is_empty() {
        total.to_string()
    } else {
        reasons.sort();
        format!("{total} ({})", reasons.join(", "))
    }
}

/// The frontend's lines: connections, then each platform's outbox.
fn frontend_lines(out: &mut String, f: &FrontendStatus) {
    let b = f.bridge.clone().unwrap_or_default();
    out.push_str(&format!(
        "connections: {} ({} unauthenticated), {} refused; http {} open; tls {}\n",
        b.connections,
        b.unauthenticated,
        b.connections_refused,
        f.http.as_ref().map_or(0, |h| h.connections),
        if b.tls { "on" } else { "off" },
    ));
    for sb in &f.bridges {
        out.push_str(&supervised_line(sb));
    }
    let Some(bridge) = &f.bridge else {
        return;
    };
    let parts: Vec<String> = bridge
        .outboxes
        .iter()
        .map(|(name, p)| outbox(name, p))
        .collect();
    let list = if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join("; ")
    };
    out.push_str(&format!("outboxes: {list}\n"));
    let a = &bridge.access;
    if !a.refused.is_empty() || a.pending_codes > 0 {
        let refused: Vec<String> = a.refused.iter().map(|(k, n)| format!("{k} {n}")).collect();
        out.push_str(&format!(
            "access: {} pairing code(s) pending, {} user(s) remembered; refused: {}\n",
            a.pending_codes,
            a.users_remembered,
            if refused.is_empty() {
                "none".to_owned()
            } else {
                refused.join(", ")
            },
        ));
    }
    if let Some(c) = &bridge.cluster {
        out.push_str(&cluster_line(c));
    }
}

/// A supervised bridge's line: `bridge #1 (matrix): reconnecting since … (why); 2 restarts,
/// last exit …; last error: …`.
fn supervised_line(b: &crate::liveness::SupervisedBridge) -> String {
    let state = serde_json::to_value(b.state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let mut line = format!(
        "bridge #{} ({}): {state} since {}",
        b.index, b.platform, b.since
    );
    if let Some(r) = &b.reason {
        line.push_str(&format!(" ({r})"));
    }
    line.push_str(&format!("; {} restarts", b.restarts));
    if let Some(e) = &b.last_exit {
        line.push_str(&format!(", last exit {e}"));
    }
    if let Some(e) = &b.last_error {
        line.push_str(&format!("; last error: {e}"));
    }
    line.push('\n');
    line
}

/// ` (a b c)`, or nothing for an empty list.
fn listed<T: std::fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        String::new()
    } else {
        let items: Vec<String> = items.iter().map(T::to_string).collect();
        format!(" ({})", items.join(" "))
    }
}

/// A cluster member's line (`--cluster`): who it is and who is alive, what it owns, what
/// waits on other instances, ownership's changes, the stream reader.
fn cluster_line(c: &ClusterStatus) -> String {
    let rebalance = if c.rebalance {
        format!(
            "rebalancing (a drain at most {:.1} s): {} draining{}, drained {} partitions, {} messages",
            c.drain_ms as f64 / 1000.0,
            c.draining.len(),
            listed(&c.draining),
            c.drained_partitions,
            c.drained_messages,
        )
    } else {
        "no rebalancing".to_owned()
    };
    format!(
        "cluster: instance {}, {} live{}; owns {} of {} partitions{}; {} waiting for a remote outcome ({} early outcomes, {} dropped); partitions gained {}, lost {}, fenced {}; handed over {} partitions, {} messages; {rebalance}; reader {} failures, {} reconnects{}\n",
        c.instance,
        c.live_instances.len(),
        listed(&c.live_instances),
        c.owned_partitions,
        c.partitions,
        listed(&c.owned),
        c.remote_waiting,
        c.early_outcomes,
        c.early_outcomes_dropped,
        c.gained,
        c.lost,
        c.fenced,
        c.handed_over_partitions,
        c.handed_over_messages,
        c.reader_failures,
        c.reader_reconnects,
        if c.reader_failing { ", failing" } else { "" },
    )
}

/// One platform's outbox: results waiting and owed, results held for want of room within
/// `--outbox-bytes`, and (when its bridge is away) how long and whether it is stale, with
/// the results dropped for it.
fn outbox(name: &str, p: &PlatformStatus) -> String {
    let mut text = format!(
        "{name} {} waiting ({}), {} owed, {} held ({})",
        p.outbox_events,
        bytes(p.outbox_bytes as f64),
        p.reserved_events,
        p.held_events,
        bytes(p.held_bytes as f64),
    );
    if let Some(ms) = p.absent_ms {
        text.push_str(&format!(", absent {:.1} s", ms as f64 / 1000.0));
    }
    if p.stale {
        text.push_str(", stale");
    }
    if p.stale_dropped > 0 {
        text.push_str(&format!(", {} stale dropped", p.stale_dropped));
    }
    text
}

/// A plain HTTP/1.1 request without a body (`GET`, or `POST` for `/access`) with timeouts;
/// the status code and body. Errors are in words.
pub(super) fn request(
    method: &str,
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
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
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
    let body = &raw[head..];
    // Past MAX_RESPONSE (or a connection cut): never a part taken for the whole.
    let length = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| {
            std::str::from_utf8(h.value)
                .ok()?
                .trim()
                .parse::<usize>()
                .ok()
        });
    if let Some(length) = length
        && body.len() < length
    {
        return Err(format!(
            "the answer was cut short: {} of its {length} bytes read (at most {MAX_RESPONSE})",
            body.len()
        ));
    }
    Ok((code, String::from_utf8_lossy(body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::{BridgeStatus, HttpStatus, ProcessInfo};

    fn doc(state: RuntimeState, updated: f64) -> Status {
        Status {
            state,
            ticks: 3,
            process: ProcessInfo {
                updated_unix_s: updated,
                ..ProcessInfo::default()
            },
            ..Status::default()
        }
    }

    fn with_bridge(bridge: BridgeStatus) -> Status {
        Status {
            frontend: Some(FrontendStatus {
                bridge: Some(bridge),
                ..FrontendStatus::default()
            }),
            ..doc(RuntimeState::Running, 0.0)
        }
    }

    #[test]
    fn the_access_policy_shows_when_it_refused_anything() {
        let quiet = summary(&with_bridge(BridgeStatus::default()), 0.0);
        assert!(!quiet.contains("access:"), "{quiet}");
        let mut b = BridgeStatus::default();
        b.access.refused.insert("matrix:pairing".into(), 3);
        b.access.pending_codes = 2;
        let s = summary(&with_bridge(b), 0.0);
        assert!(
            s.contains(
                "access: 2 pairing code(s) pending, 0 user(s) remembered; refused: matrix:pairing 3"
            ),
            "{s}"
        );
    }

    #[test]
    fn verdicts() {
        let running = doc(RuntimeState::Running, 100.0);
        assert_eq!(verdict(&running, 101.0, 2.0, None), Ok(()));
        assert!(
            verdict(&running, 102.5, 2.0, None)
                .unwrap_err()
                .contains("2.5 s old")
        );
        assert_eq!(
            verdict(&doc(RuntimeState::Draining, 100.0), 100.0, 2.0, None),
            Err("state is draining".into())
        );
        assert_eq!(
            verdict(&running, 100.0, 2.0, Some(Err("x".into()))),
            Err("x".into())
        );
        assert!(verdict(&doc(RuntimeState::Running, 0.0), 1.0, 2.0, None).is_err());
    }

    /// What the gateway writes is what `status` reads back, field for field; a document
    /// that is not a snapshot, or not JSON, is refused in words.
    #[test]
    fn the_snapshot_reads_back_typed() {
        let mut bridge = BridgeStatus {
            connections: 2,
            tls: true,
            cluster: Some(ClusterStatus {
                instance: "a".into(),
                owned: vec![1, 3],
                ..ClusterStatus::default()
            }),
            ..BridgeStatus::default()
        };
        bridge.rejected.insert("queue_full", 4);
        bridge.outboxes.insert(
            "irc".into(),
            PlatformStatus {
                absent_ms: Some(1500),
                stale_dropped: 2,
                ..PlatformStatus::default()
            },
        );
        let mut status = with_bridge(bridge);
        status.version = "1.2.3";
        status.rejected_by_reason.insert("overloaded", 1);
        if let Some(f) = &mut status.frontend {
            f.http = Some(HttpStatus {
                connections: 5,
                ..HttpStatus::default()
            });
        }
        let text = serde_json::to_string(&status).unwrap();
        assert_eq!(parse(text), Ok(status));
        let bare = doc(RuntimeState::Stopped, 9.0);
        assert_eq!(parse(serde_json::to_string(&bare).unwrap()), Ok(bare));
        assert_eq!(parse(r#"{"state": "running"}"#.into()), Err(""));
        assert_eq!(parse("{".into()), Err(" (not JSON)"));
    }

    #[test]
    fn the_summary_counts_the_bridges_rejections() {
        let mut bridge = BridgeStatus::default();
        bridge.rejected.insert("invalid", 1);
        bridge.rejected.insert("backpressure", 0);
        bridge.rejected.insert("queue_full", 2);
        let mut s = with_bridge(bridge);
        s.messages.accepted = 3;
        let text = summary(&s, 0.0);
        assert!(
            text.contains("messages 3 accepted, 3 (invalid 1, queue_full 2) rejected"),
            "{text}"
        );
        let mut s = doc(RuntimeState::Running, 0.0);
        s.messages.accepted = 3;
        s.messages.rejected = 4;
        assert!(summary(&s, 0.0).contains("messages 3 accepted, 4 rejected"));
    }

    /// A cluster member's figures reach the summary on one line; without `--cluster`, none.
    #[test]
    fn the_summary_shows_the_cluster() {
        let cluster = ClusterStatus {
            instance: "a".into(),
            live_instances: vec!["a".into(), "b".into()],
            partitions: 8,
            owned_partitions: 3,
            owned: vec![0, 4, 7],
            remote_waiting: 5,
            gained: 6,
            lost: 1,
            fenced: 2,
            handed_over_partitions: 3,
            handed_over_messages: 9,
            reader_failures: 4,
            reader_reconnects: 1,
            reader_failing: true,
            early_outcomes: 7,
            early_outcomes_dropped: 8,
            rebalance: true,
            drain_ms: 2500,
            draining: vec![4],
            drained_partitions: 2,
            drained_messages: 11,
            ..ClusterStatus::default()
        };
        let s = with_bridge(BridgeStatus {
            cluster: Some(cluster),
            ..BridgeStatus::default()
        });
        let text = summary(&s, 0.0);
        assert!(
            text.contains(
                "cluster: instance a, 2 live (a b); owns 3 of 8 partitions (0 4 7); 5 waiting for a remote outcome (7 early outcomes, 8 dropped); partitions gained 6, lost 1, fenced 2; handed over 3 partitions, 9 messages; rebalancing (a drain at most 2.5 s): 1 draining (4), drained 2 partitions, 11 messages; reader 4 failures, 1 reconnects, failing\n"
            ),
            "{text}"
        );
        let s = with_bridge(BridgeStatus::default());
        assert!(!summary(&s, 0.0).contains("cluster"));
    }

    /// Held results and the stale figures reach the human summary, per platform.
    #[test]
    fn the_summary_shows_held_results_and_stale_drops() {
        let mut bridge = BridgeStatus::default();
        bridge.outboxes.insert(
            "irc".into(),
            PlatformStatus {
                outbox_events: 2,
                outbox_bytes: 300,
                reserved_events: 5,
                held_events: 3,
                held_bytes: 3145728,
                ..PlatformStatus::default()
            },
        );
        bridge.outboxes.insert(
            "telegram".into(),
            PlatformStatus {
                outbox_events: 1000,
                outbox_bytes: 2048,
                reserved_events: 1000,
                absent_ms: Some(3_700_000),
                stale: true,
                stale_dropped: 17,
                ..PlatformStatus::default()
            },
        );
        let text = summary(&with_bridge(bridge), 0.0);
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
