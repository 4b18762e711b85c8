//! The server's sockets by connection key, and their poll tokens.

use std::net::SocketAddr;

use mio::Token;

use super::ConnId;
use super::lines::LineReader;
use crate::tls::Transport;

/// A connection's poll token: its key's bits, kept clear of every fixed token and band.
pub(super) fn token(id: ConnId) -> Token {
    crate::tokens::conn_token(id.to_bits())
}

/// Sockets by their connection's key: a slot per key index, checked against the full key.
#[derive(Default)]
pub(super) struct SocketTable(Vec<Option<Socket>>);

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
}
