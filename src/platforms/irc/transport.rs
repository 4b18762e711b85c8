//! The server connection's bytes: TCP or TLS, and the thread reading lines from it.

use std::io::{self, Read};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::platforms::BridgeError;
pub(super) use crate::platforms::tls::Wire;
use crate::platforms::tls::{client_config_with, handshake};

/// than 512; anything past this is a broken server).
const MAX_READ_LINE: usize = 8192;
/// Time to connect to the IRC server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A write to the server blocked this long ends the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(15);

/// What the server-reading thread reports.
pub(super) enum ServerInput {
    Line(u64, String),
    Closed(u64, String),
}

/// The TLS settings: the roots of `ca_file` (PEM) if given, else the operating system's;
/// with `identity` (certificate, key PEM files), the client certificate offered (SASL
/// EXTERNAL).
pub(crate) fn tls_config(
    ca_file: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, BridgeError> {
    client_config_with(ca_file, "--tls-ca-file", identity)
}

/// Opens a TCP connection to the first of `addr`'s addresses that answers.
pub(super) fn open(addr: &str) -> Result<TcpStream, String> {
    super::super::connect_tcp(addr, CONNECT_TIMEOUT)
}

/// Reads server lines (bounded length, lossy UTF-8: IRC has no encoding rule) until the
/// connection ends.
pub(super) fn read_server(
    mut stream: Box<dyn Read + Send>,
    generation: u64,
    tx: &Sender<ServerInput>,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    let reason = loop {
        match stream.read(&mut chunk) {
            Ok(0) => break "the server closed the connection".to_owned(),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                let mut start = 0;
                while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
                    let line = String::from_utf8_lossy(&buf[start..start + nl]).into_owned();
                    start += nl + 1;
                    if tx.send(ServerInput::Line(generation, line)).is_err() {
                        return;
                    }
                }
                buf.drain(..start);
                if buf.len() > MAX_READ_LINE {
                    warn_limited!("irc: the server sent a line over {MAX_READ_LINE} bytes; cut");
                    buf.clear();
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break format!("reading from the server failed: {e}"),
        }
    };
    let _ = tx.send(ServerInput::Closed(generation, reason));
}

/// Readies a connected socket: Nagle off, the write timeout, TLS when configured. Returns
/// the writing side, the socket (to shut the connection down) and the reading side.
#[allow(clippy::type_complexity)]
pub(super) fn wire_up(
    stream: TcpStream,
    server: &str,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<(Wire, TcpStream, Box<dyn Read + Send>), String> {
    let setup = (|| -> io::Result<(TcpStream, TcpStream)> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        Ok((stream.try_clone()?, stream.try_clone()?))
    })();
    let (socket, reader) = setup.map_err(|e| format!("socket setup failed: {e}"))?;
    let Some(config) = tls else {
        return Ok((Wire::Plain(stream), socket, Box::new(reader)));
    };
    let (wire, reader) = handshake(stream, reader, server, None, config, CONNECT_TIMEOUT)?;
    Ok((wire, socket, Box::new(reader)))
}
