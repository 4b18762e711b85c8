//! The server connection's bytes: TCP or TLS, and the thread reading lines from it.

use std::io::{self, Read};
use std::net::TcpStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::platforms::BridgeError;

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

type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// The writing side of a server connection: plain TCP, or TLS (shared with the reader, which
/// holds the lock only while data is there to read).
pub(super) enum Wire {
    Plain(TcpStream),
    Tls(Arc<Mutex<TlsStream>>),
}

/// How long a TLS read holds the stream's lock waiting for more bytes.
const TLS_READ_SLICE: Duration = Duration::from_millis(20);

/// The reading side of a TLS connection: waits for the socket in `poll(2)` without the lock,
/// then reads under it (and keeps reading while rustls has decrypted data buffered).
struct TlsReader {
    stream: Arc<Mutex<TlsStream>>,
    /// The descriptor polled: `_socket`'s, which this reader keeps open.
    fd: std::os::fd::RawFd,
    _socket: TcpStream,
    draining: bool,
}

impl Read for TlsReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.draining {
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, whose descriptor `_socket` keeps open.
            let rc = unsafe { libc::poll(&mut pfd, 1, 1000) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                return if e.kind() == io::ErrorKind::Interrupted {
                    Err(io::ErrorKind::WouldBlock.into())
                } else {
                    Err(e)
                };
            }
            if rc == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
        }
        let mut tls = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        match tls.read(buf) {
            Ok(n) => {
                self.draining = n > 0;
                Ok(n)
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            Err(e) => {
                self.draining = false;
                Err(e)
            }
        }
    }
}

/// The TLS settings: the roots of `ca_file` (PEM) if given, else the operating system's.
pub(crate) fn tls_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, BridgeError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let config = match ca_file {
        Some(path) => {
            use rustls_pki_types::CertificateDer;
            use rustls_pki_types::pem::PemObject;
            let bad = |e: &dyn std::fmt::Display| format!("--tls-ca-file {}: {e}", path.display());
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
                roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
            }
            if roots.is_empty() {
                return Err(bad(&"no certificate in it"));
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => {
            use rustls_platform_verifier::BuilderVerifierExt;
            builder
                .with_platform_verifier()
                .map_err(|e| format!("cannot load the system's certificates: {e}"))?
                .with_no_client_auth()
        }
    };
    Ok(Arc::new(config))
}

/// The host part of `HOST:PORT` (`[v6]:port` too), the name TLS checks the certificate for.
fn host_of(server: &str) -> &str {
    let host = server.rsplit_once(':').map_or(server, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Completes the TLS handshake on `socket` (bounded by the connect timeout).
fn tls_handshake(
    mut socket: TcpStream,
    server: &str,
    config: &Arc<rustls::ClientConfig>,
) -> Result<TlsStream, String> {
    let host = host_of(server);
    let name = rustls_pki_types::ServerName::try_from(host.to_owned())
        .map_err(|_| format!("{host} is not a name TLS can check a certificate for"))?;
    let mut conn = rustls::ClientConnection::new(Arc::clone(config), name)
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let io_err = |e: io::Error| format!("TLS handshake with {server} failed: {e}");
    socket
        .set_read_timeout(Some(CONNECT_TIMEOUT))
        .map_err(io_err)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut socket).map_err(io_err)?;
    }
    socket
        .set_read_timeout(Some(TLS_READ_SLICE))
        .map_err(io_err)?;
    Ok(rustls::StreamOwned::new(conn, socket))
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
                    log::warn!("irc: the server sent a line over {MAX_READ_LINE} bytes; cut");
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
    let tls = Arc::new(Mutex::new(tls_handshake(stream, server, config)?));
    let reader = TlsReader {
        stream: Arc::clone(&tls),
        fd: std::os::fd::AsRawFd::as_raw_fd(&reader),
        _socket: reader,
        draining: false,
    };
    Ok((Wire::Tls(tls), socket, Box::new(reader)))
}
