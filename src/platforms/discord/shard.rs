//! The Discord Gateway connection (v10, JSON), on a thread of its own: Hello, heartbeats
//! (the first one jittered), Identify or Resume, dispatches, and every way a connection
//! ends, each answered as Discord's documentation says.
//!
//! - A heartbeat not acknowledged by the next beat is a **zombie** connection: it is closed
//!   (with a code that keeps the session) and the session is **resumed** on a new one at
//!   `resume_gateway_url` with the last sequence received; Discord replays what was missed.
//! - **Reconnect** (op 7) and **Invalid Session** (op 9, `d: true`) resume; op 9 with
//!   `d: false`, and the close codes 4007/4009, start a new session after 1–5 s.
//! - The close codes no retry can fix (4004 authentication failed, 4010–4012, 4013/4014
//!   intents) end the bridge with a message naming the fix.
//! - Identify is limited: at most one per [`IDENTIFY_INTERVAL`], and none while the
//!   `session_start_limit` is used up (waited out).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use serde_json::{Value, json};
use tungstenite::Message;
use tungstenite::protocol::CloseFrame;
use tungstenite::protocol::frame::coding::CloseCode;

use super::event::message_create;
use super::threads::Threads;
use crate::platforms::gateway::OutgoingMessage;
use crate::platforms::websocket::{self, Socket};

/// Guilds (the thread events), guild messages, direct messages and message content: the
/// intents the bridge needs.
pub(crate) const INTENTS: u64 = 1 | (1 << 9) | (1 << 12) | (1 << 15);
/// Least time between two Identify payloads (a `max_concurrency` of 1).
pub(crate) const IDENTIFY_INTERVAL: Duration = Duration::from_secs(5);
/// Time a connection, and its Hello, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// A session that can be resumed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Session {
    pub session_id: String,
    pub resume_url: String,
    /// The last sequence number received (for a resume after a restart: the last one whose
    /// messages the gateway has).
    pub seq: u64,
}

/// What the connection tells the bridge.
#[derive(Debug)]
pub(crate) enum Inbound {
    /// READY: a new session.
    Ready { session: Session },
    /// RESUMED: the session goes on.
    Resumed,
    /// A user's message for the gateway, with its dispatch's sequence number.
    Message { seq: u64, message: OutgoingMessage },
    /// The connection cannot go on: a close code no retry fixes.
    Fatal(String),
}

/// Where and how to connect.
#[derive(Clone)]
pub(crate) struct ShardConfig {
    /// `wss://gateway.discord.gg` (from `GET /gateway/bot`).
    pub url: String,
    pub token: String,
    /// The bot's user (`GET /users/@me`): its own messages and mentions are known by it.
    pub user_id: String,
    pub username: String,
    /// Identify allowed now (`session_start_limit.remaining`), and when that renews.
    pub starts_remaining: u64,
    pub starts_reset_after: Duration,
}

/// How one connection ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    Stop,
    /// Reconnect and resume.
    Resume(String),
    /// Reconnect and identify anew (after a pause of 1–5 s).
    NewSession(String),
    Fatal(String),
}

/// The connection's state across reconnections.
struct Shard<'a> {
    config: ShardConfig,
    session: Option<Session>,
    last_identify: Option<Instant>,
    starts_remaining: u64,
    starts_reset_at: Instant,
    to_main: &'a Sender<Inbound>,
    stop: &'a AtomicBool,
    /// The last sequence received, shared with the main thread (stored after the message
    /// it carries was handed over).
    last_seq: &'a AtomicU64,
    threads: Threads,
}

/// A number in [0, 1) that differs between calls (the heartbeat's jitter, the pause before a
/// new session): no cryptographic quality needed.
pub(crate) fn jitter() -> f64 {
    use std::hash::BuildHasher;
    let bits = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Waits `d` unless `stop` is set first.
fn pause(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            return;
        }
        std::thread::park_timeout((until - now).min(Duration::from_millis(50)));
    }
}

/// Runs the connection until `stop` is set or a fatal close; `session` (from the state
/// directory) is resumed first if given.
pub(crate) fn run_shard(
    config: ShardConfig,
    session: Option<Session>,
    to_main: &Sender<Inbound>,
    stop: &Arc<AtomicBool>,
    last_seq: &Arc<AtomicU64>,
) {
    let mut shard = Shard {
        starts_remaining: config.starts_remaining,
        starts_reset_at: Instant::now() + config.starts_reset_after,
        config,
        session,
        last_identify: None,
        to_main,
        stop,
        last_seq,
        threads: Threads::default(),
    };
    let mut backoff = Duration::from_secs(1);
    while !stop.load(Ordering::SeqCst) {
        let url = match &shard.session {
            Some(s) => s.resume_url.clone(),
            None => shard.config.url.clone(),
        };
        let url = format!("{}/?v=10&encoding=json", url.trim_end_matches('/'));
        let mut ws = match websocket::connect(&url, CONNECT_TIMEOUT) {
            Ok(ws) => ws,
            Err(e) => {
                warn_limited!(
                    "discord: cannot connect to the Gateway: {e}; retrying in {backoff:?}"
                );
                pause(stop, backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        let end = shard.converse(&mut ws);
        // Not 1000/1001: those would end the session; any other code keeps it resumable
        // (a restart with --state-dir resumes it too).
        let _ = ws.close(Some(CloseFrame {
            code: CloseCode::Library(4000),
            reason: "reconnecting".into(),
        }));
        let _ = ws.flush();
        match end {
            End::Stop => return,
            End::Fatal(e) => {
                let _ = to_main.send(Inbound::Fatal(e));
                return;
            }
            End::Resume(why) => {
                info_redacted!("discord: {why}; resuming");
                if shard.session.is_none() {
                    pause(stop, backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                } else {
                    backoff = Duration::from_secs(1);
                }
            }
            End::NewSession(why) => {
                info_redacted!("discord: {why}; starting a new session");
                shard.session = None;
                pause(stop, Duration::from_secs_f64(1.0 + 4.0 * jitter()));
            }
        }
    }
}

impl Shard<'_> {
    /// One connection: Hello, Identify or Resume, then heartbeats and dispatches until it
    /// ends.
    fn converse(&mut self, ws: &mut Socket) -> End {
        let interval = match self.hello(ws) {
            Ok(i) => i,
            Err(end) => return end,
        };
        let mut next_beat = Instant::now() + interval.mul_f64(jitter());
        let mut acked = true;
        if let Err(end) = self.introduce(ws) {
            return end;
        }
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return End::Stop;
            }
            let now = Instant::now();
            if now >= next_beat {
                if !acked {
                    return End::Resume(
                        "no heartbeat ACK since the last beat (zombie connection)".into(),
                    );
                }
                if let Err(e) = self.beat(ws) {
                    return End::Resume(e);
                }
                acked = false;
                next_beat = now + interval;
            }
            match ws.read() {
                Ok(Message::Text(text)) => {
                    let payload: Value = match serde_json::from_str(text.as_str()) {
                        Ok(v) => v,
                        Err(_) => {
                            warn_limited!("discord: a Gateway payload that is not JSON; skipped");
                            continue;
                        }
                    };
                    match payload.get("op").and_then(Value::as_u64) {
                        Some(0) => {
                            if let Err(end) = self.dispatch(&payload) {
                                return end;
                            }
                        }
                        Some(1) => {
                            if let Err(e) = self.beat(ws) {
                                return End::Resume(e);
                            }
                        }
                        Some(7) => {
                            return End::Resume("the Gateway asked to reconnect (op 7)".into());
                        }
                        Some(9) => {
                            return if payload.get("d").and_then(Value::as_bool) == Some(true) {
                                End::Resume("invalid session, resumable (op 9)".into())
                            } else {
                                End::NewSession("invalid session (op 9)".into())
                            };
                        }
                        Some(11) => acked = true,
                        _ => {}
                    }
                }
                Ok(Message::Close(frame)) => return closed(frame.map(|f| u16::from(f.code))),
                Ok(_) => {}
                Err(e) if websocket::is_idle(&e) => {
                    // A pong tungstenite queued goes out now.
                    let _ = ws.flush();
                }
                Err(e) => return End::Resume(format!("the Gateway connection failed: {e}")),
            }
        }
    }

    /// Waits for Hello (op 10): the heartbeat interval.
    fn hello(&self, ws: &mut Socket) -> Result<Duration, End> {
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return Err(End::Stop);
            }
            if Instant::now() >= deadline {
                return Err(End::Resume("no Hello from the Gateway in time".into()));
            }
            match ws.read() {
                Ok(Message::Text(text)) => {
                    let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
                    if v.get("op").and_then(Value::as_u64) == Some(10) {
                        let ms = v
                            .pointer("/d/heartbeat_interval")
                            .and_then(Value::as_u64)
                            .filter(|ms| *ms > 0)
                            .unwrap_or(41_250);
                        return Ok(Duration::from_millis(ms));
                    }
                }
                Ok(Message::Close(frame)) => return Err(closed(frame.map(|f| u16::from(f.code)))),
                Ok(_) => {}
                Err(e) if websocket::is_idle(&e) => {}
                Err(e) => return Err(End::Resume(format!("the Gateway connection failed: {e}"))),
            }
        }
    }

    /// Resume (op 6) the session if there is one, else Identify (op 2) within the limits.
    fn introduce(&mut self, ws: &mut Socket) -> Result<(), End> {
        let payload = if let Some(s) = &self.session {
            json!({"op": 6, "d": {"token": self.config.token, "session_id": s.session_id, "seq": s.seq}})
        } else {
            self.wait_for_identify()?;
            json!({"op": 2, "d": {
                "token": self.config.token,
                "intents": INTENTS,
                "properties": {"os": std::env::consts::OS, "browser": "turnstile", "device": "turnstile"},
            }})
        };
        send(ws, &payload).map_err(End::Resume)
    }

    /// Waits until an Identify is allowed (interval and start limit), then counts it.
    fn wait_for_identify(&mut self) -> Result<(), End> {
        let now = Instant::now();
        if now >= self.starts_reset_at && self.starts_remaining == 0 {
            // The limit renews daily; without a fresh count, allow one more per interval.
            self.starts_remaining = 1;
        }
        let mut until = self.last_identify.map(|t| t + IDENTIFY_INTERVAL);
        if self.starts_remaining == 0 {
            warn_limited!(
                "discord: the session start limit is used up; waiting {:?}",
                self.starts_reset_at.saturating_duration_since(now)
            );
            until = until.max(Some(self.starts_reset_at));
        }
        if let Some(until) = until {
            pause(self.stop, until.saturating_duration_since(now));
        }
        if self.stop.load(Ordering::SeqCst) {
            return Err(End::Stop);
        }
        self.starts_remaining = self.starts_remaining.saturating_sub(1);
        self.last_identify = Some(Instant::now());
        Ok(())
    }

    fn beat(&self, ws: &mut Socket) -> Result<(), String> {
        let seq = self.session.as_ref().map(|s| s.seq);
        send(ws, &json!({"op": 1, "d": seq}))
    }

    /// A dispatch (op 0): its sequence number kept, READY and MESSAGE_CREATE acted on.
    fn dispatch(&mut self, payload: &Value) -> Result<(), End> {
        let seq = payload.get("s").and_then(Value::as_u64);
        let kind = payload.get("t").and_then(Value::as_str).unwrap_or_default();
        let d = payload.get("d").unwrap_or(&Value::Null);
        self.threads.dispatch(kind, d);
        match kind {
            "READY" => {
                let field = |p: &str| d.pointer(p).and_then(Value::as_str).map(str::to_owned);
                let (Some(session_id), Some(resume_url)) =
                    (field("/session_id"), field("/resume_gateway_url"))
                else {
                    return Err(End::NewSession("a READY without its session".into()));
                };
                let session = Session {
                    session_id,
                    resume_url,
                    seq: seq.unwrap_or(0),
                };
                self.session = Some(session.clone());
                self.hand_over(Inbound::Ready { session })?;
            }
            "RESUMED" => {
                info_redacted!("discord: session resumed");
                self.hand_over(Inbound::Resumed)?;
            }
            "MESSAGE_CREATE" => {
                if let Some(seq) = seq
                    && let Some(message) = message_create(d, &self.config.user_id, &self.threads)
                {
                    debug_redacted!(
                        "discord: message {} in channel {}",
                        message.id,
                        message.chat_id
                    );
                    self.hand_over(Inbound::Message { seq, message })?;
                }
            }
            _ => {}
        }
        if let (Some(s), Some(session)) = (seq, self.session.as_mut()) {
            session.seq = session.seq.max(s);
            self.last_seq.fetch_max(s, Ordering::SeqCst);
        }
        Ok(())
    }

    fn hand_over(&self, inbound: Inbound) -> Result<(), End> {
        self.to_main.send(inbound).map_err(|_| End::Stop)
    }
}

/// A close frame's code, classified.
fn closed(code: Option<u16>) -> End {
    let Some(code) = code else {
        return End::Resume("the Gateway closed the connection".into());
    };
    match code {
        4004 => End::Fatal(
            "the Gateway refused the bot token (close 4004 authentication failed): set the bot's token from the Developer Portal (Bot → Reset Token) in DISCORD_BOT_TOKEN or the variable named by --token-env".into(),
        ),
        4010..=4012 => End::Fatal(format!(
            "the Gateway refused the connection's settings (close {code}); this build's Gateway settings do not fit the application"
        )),
        4013 | 4014 => End::Fatal(format!(
            "the Gateway refused the intents (close {code}): enable Message Content Intent under Bot → Privileged Gateway Intents in the Developer Portal"
        )),
        4007 | 4009 => End::NewSession(format!("the session cannot be resumed (close {code})")),
        _ => End::Resume(format!("the Gateway closed the connection (close {code})")),
    }
}

/// Writes one payload (never logged: an Identify carries the token).
fn send(ws: &mut Socket, payload: &Value) -> Result<(), String> {
    ws.send(Message::text(payload.to_string()))
        .map_err(|e| format!("writing to the Gateway failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_close_codes_no_retry_fixes_are_fatal() {
        for code in [4004, 4010, 4011, 4012, 4013, 4014] {
            assert!(matches!(closed(Some(code)), End::Fatal(_)), "{code}");
        }
        for code in [4007, 4009] {
            assert!(matches!(closed(Some(code)), End::NewSession(_)), "{code}");
        }
        for code in [1000, 1006, 4000, 4001, 4002, 4003, 4005, 4008] {
            assert!(matches!(closed(Some(code)), End::Resume(_)), "{code}");
        }
        assert!(matches!(closed(None), End::Resume(_)));
    }

    #[test]
    fn the_intents_are_guild_messages_direct_messages_and_message_content() {
        assert_eq!(INTENTS, 37_377);
    }

    #[test]
    fn jitter_stays_in_the_unit_interval() {
        for _ in 0..1000 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j), "{j}");
        }
    }
}
