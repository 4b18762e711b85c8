//! The server's sockets by connection key, and their poll tokens.

use std::net::SocketAddr;
use std::time::Duration;

use mio::Token;

use super::lines::LineReader;
use super::{BridgeServer, ConnId};
use crate::tls::Transport;

/// A connection's poll token: its key's bits, kept clear of every fixed token and band.
pub(super) fn token(id: ConnId) -> Token {
    crate::tokens::conn_token(id.to_bits())
}

/// Sockets by their connection's key: a slot per key index, checked against the full key.
#[derive(Default)]
pub(super) struct SocketTable(Vec<Option<Socket>>, Duration);

/// How often unfinished TLS handshakes are looked for.
const HANDSHAKE_SWEEP: Duration = Duration::from_millis(100);

impl SocketTable {
    pub(super) fn insert(&mut self, sock: Socket) {
        let i = sock.id.index();
        if self.0.len() <= i {
            self.0.resize_with(i + 1, || None);
        }
        debug_assert!(self.0[i].is_none(), "two live sockets for one key index");
        self.0[i] = Some(sock);
    }

    pub(super) fn get(&self, id: ConnId) -> Option<&Socket> {
        self.0.get(id.index())?.as_ref().filter(|s| s.id == id)
    }

    pub(super) fn get_mut(&mut self, id: ConnId) -> Option<&mut Socket> {
        self.0.get_mut(id.index())?.as_mut().filter(|s| s.id == id)
    }

    pub(super) fn remove(&mut self, id: ConnId) -> Option<Socket> {
        self.get(id)?;
        self.0[id.index()].take()
    }

    pub(super) fn ids(&self) -> Vec<ConnId> {
        self.0.iter().flatten().map(|s| s.id).collect()
    }

    /// TLS connections whose handshake is unfinished `timeout` after they were accepted
    /// (looked for at most every [`HANDSHAKE_SWEEP`]).
    fn late_handshakes(&mut self, now: Duration, timeout: Duration) -> Vec<ConnId> {
        if now < self.1 {
            return Vec::new();
        }
        self.1 = now + HANDSHAKE_SWEEP;
        let late = |s: &&Socket| s.stream.handshaking() && now >= s.opened + timeout;
        self.0.iter().flatten().filter(late).map(|s| s.id).collect()
    }
}

impl BridgeServer {
    /// Closes TLS connections that did not finish their handshake within the hello deadline,
    /// with or without a token (without one, the bridge sets no hello deadline of its own:
    /// a client that never sends its ClientHello would hold its slot for ever).
    pub(super) fn close_late_handshakes(&mut self) {
        let timeout = self.bridge.config().hello_timeout;
        let late = self.sockets.late_handshakes(self.now, timeout);
        if late.is_empty() {
            return;
        }
        log::warn!(
            "closing {} connection(s) that did not finish their TLS handshake within {timeout:?}",
            late.len()
        );
        for id in late {
            self.bridge.disconnected(id);
            self.drop_socket(id);
        }
    }
}

/// One connection's socket and its read state.
pub(super) struct Socket {
    pub(super) id: ConnId,
    pub(super) peer: SocketAddr,
    /// The socket, or TLS over it.
    pub(super) stream: Transport,
    pub(super) reader: LineReader,
    /// The bridge wanted no input (its output was over its bound); re-armed when it drains.
    pub(super) read_paused: bool,
    /// The peer shut down its side: read no more.
    pub(super) eof: bool,
    /// When it was accepted (the TLS handshake's deadline counts from here).
    pub(super) opened: Duration,
}
