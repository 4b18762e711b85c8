//! A blocking WebSocket client connection (tungstenite over the socket or the rustls already
//! in the tree), read in slices so that its owner can keep timers (heartbeats) between reads.

use std::net::TcpStream;
use std::time::Duration;

use tungstenite::protocol::WebSocketConfig;

use super::tls::Duplex;

/// An open WebSocket.
pub(crate) type Socket = tungstenite::WebSocket<Box<dyn Duplex>>;

/// Largest message read: a platform's biggest event fits with room to spare; a larger one
/// ends the connection instead of growing memory without bound.
pub(crate) const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// How long one read waits for data before its caller looks at its timers.
pub(crate) const READ_SLICE: Duration = Duration::from_millis(100);

/// Opens `url` (`wss://` or, for tests, `ws://`): TCP, TLS for `wss` (the system's roots),
/// the WebSocket handshake, all within `timeout`. Reads then wait at most [`READ_SLICE`].
pub(crate) fn connect(url: &str, timeout: Duration) -> Result<Socket, String> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("wss://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("ws://") {
        (false, rest)
    } else {
        return Err(format!("{url} is not a ws:// or wss:// URL"));
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    if authority.is_empty() {
        return Err(format!("{url} names no host"));
    }
    let addr = if authority.rsplit_once(':').is_some_and(|(_, p)| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && !authority.ends_with(']')
    }) {
        authority.to_owned()
    } else {
        format!("{authority}:{}", if tls { 443 } else { 80 })
    };
    let socket = super::connect_tcp(&addr, timeout)?;
    let control = socket
        .try_clone()
        .map_err(|e| format!("socket setup failed: {e}"))?;
    let setup = |s: &TcpStream| -> std::io::Result<()> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))
    };
    setup(&socket).map_err(|e| format!("socket setup failed: {e}"))?;
    let stream: Box<dyn Duplex> = if tls {
        let config = super::tls::client_config(None, "wss")?;
        Box::new(super::tls::connect_stream(
            socket, &addr, None, &config, timeout,
        )?)
    } else {
        Box::new(socket)
    };
    let config = WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE_BYTES))
        .max_frame_size(Some(MAX_MESSAGE_BYTES));
    let (ws, _) = tungstenite::client::client_with_config(url, stream, Some(config))
        .map_err(|e| format!("WebSocket handshake with {addr} failed: {e}"))?;
    control
        .set_read_timeout(Some(READ_SLICE))
        .map_err(|e| format!("socket setup failed: {e}"))?;
    Ok(ws)
}

/// Whether a read error only means that no data came within [`READ_SLICE`].
pub(crate) fn is_idle(e: &tungstenite::Error) -> bool {
    matches!(e, tungstenite::Error::Io(io)
        if matches!(io.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
}
