//! TLS for the blocking clients: the gateway client (the bridges), `send`, `status`,
//! `loadgen`, and the IRC bridge's connection to its server. A client configuration from a
//! CA file (or the system's roots), the handshake with a deadline, and a connection shared
//! by a reading thread and a writer.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A client TLS connection over a blocking socket.
pub(crate) type TlsStream = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// The writing side of a connection: plain TCP, or TLS (shared with the reader, which holds
/// the lock only while data is there to read).
pub(crate) enum Wire {
    Plain(TcpStream),
    Tls(Arc<Mutex<TlsStream>>),
}

impl Wire {
    /// Ends the connection both ways (the reader sees it end).
    pub(crate) fn shutdown(&self) {
        match self {
            Wire::Plain(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Wire::Tls(tls) => {
                let tls = tls.lock().unwrap_or_else(|e| e.into_inner());
                let _ = tls.sock.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Wire::Plain(s) => s.write(buf),
            Wire::Tls(tls) => {
                let mut tls = tls.lock().unwrap_or_else(|e| e.into_inner());
                let n = tls.write(buf)?;
                // Each write goes out whole: a line must not wait in rustls for the next one.
                tls.flush()?;
                Ok(n)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Wire::Plain(s) => s.flush(),
            Wire::Tls(tls) => tls.lock().unwrap_or_else(|e| e.into_inner()).flush(),
        }
    }
}

/// How long a TLS read holds the stream's lock waiting for more bytes.
const TLS_READ_SLICE: Duration = Duration::from_millis(20);

/// The reading side of a TLS connection: waits for the socket in `poll(2)` without the lock,
/// then reads under it (and keeps reading while rustls has decrypted data buffered). Returns
/// `WouldBlock` after a second without data, so the caller can look at its timers.
pub(crate) struct TlsReader {
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
            // The peer closed without `close_notify`: the end of the stream all the same.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            Err(e) => {
                self.draining = false;
                Err(e)
            }
        }
    }
}

/// The TLS settings of a client: the roots of `ca_file` (PEM; `flag` names it in errors) if
/// given, else the operating system's.
pub(crate) fn client_config(
    ca_file: Option<&Path>,
    flag: &str,
) -> Result<Arc<rustls::ClientConfig>, String> {
    client_config_with(ca_file, flag, None)
}

/// [`client_config`], offering the certificate chain and key of the PEM files `identity`
/// (certificate, key) to a server that asks for one (IRC's SASL EXTERNAL). The key's
/// contents never reach an error.
pub(crate) fn client_config_with(
    ca_file: Option<&Path>,
    flag: &str,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let builder = match ca_file {
        Some(path) => {
            let bad = |e: &dyn std::fmt::Display| format!("{flag} {}: {e}", path.display());
            let mut roots = rustls::RootCertStore::empty();
            for cert in crate::tls::load_certs(path, flag).map_err(|e| e.to_string())? {
                roots.add(cert).map_err(|e| bad(&e))?;
            }
            builder.with_root_certificates(roots)
        }
        None => {
            use rustls_platform_verifier::BuilderVerifierExt;
            builder
                .with_platform_verifier()
                .map_err(|e| format!("cannot load the system's certificates: {e}"))?
        }
    };
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let certs =
                crate::tls::load_certs(cert, "--tls-client-cert").map_err(|e| e.to_string())?;
            let key = load_key(key)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("--tls-client-key does not fit --tls-client-cert: {e}"))?
        }
    };
    Ok(Arc::new(config))
}

/// The private key of the PEM file `path` (PKCS#8, PKCS#1 or SEC1); errors name the file,
/// never its contents.
fn load_key(path: &Path) -> Result<rustls::pki_types::PrivateKeyDer<'static>, String> {
    use rustls::pki_types::pem::PemObject;
    let bytes =
        std::fs::read(path).map_err(|e| format!("--tls-client-key {}: {e}", path.display()))?;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| {
        format!(
            "--tls-client-key {}: no private key (PKCS#8, PKCS#1 or SEC1 PEM) in it",
            path.display()
        )
    })
}

/// The host part of `HOST:PORT` (`[v6]:port` too), the name TLS checks the certificate for.
pub(crate) fn host_of(server: &str) -> &str {
    let host = server.rsplit_once(':').map_or(server, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Completes the TLS handshake with `addr` on `socket` within `timeout`, checking the
/// certificate for `name` (by default `addr`'s host). The error says what failed, and for a
/// certificate the server's chain does not lead to a trusted root, which setting to look at.
/// The socket's read timeout is left at `timeout`.
pub(crate) fn connect_stream(
    mut socket: TcpStream,
    addr: &str,
    name: Option<&str>,
    config: &Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<TlsStream, String> {
    let host = name.unwrap_or_else(|| host_of(addr));
    let server_name = rustls_pki_types::ServerName::try_from(host.to_owned())
        .map_err(|_| format!("{host} is not a name TLS can check a certificate for"))?;
    let mut conn = rustls::ClientConnection::new(Arc::clone(config), server_name)
        .map_err(|e| format!("TLS set-up failed: {e}"))?;
    let io_err = |e: io::Error| {
        let hint = if e.to_string().contains("invalid peer certificate") {
            " (is the CA file the one that signed the server's certificate, and the name one it is for?)"
        } else {
            ""
        };
        format!("TLS handshake with {addr} failed: {e}{hint}")
    };
    socket.set_read_timeout(Some(timeout)).map_err(io_err)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut socket).map_err(io_err)?;
    }
    Ok(rustls::StreamOwned::new(conn, socket))
}

/// [`connect_stream`], then the connection split for a reading thread and a writer: `reader`
/// is a clone of `socket`, polled without the lock.
pub(crate) fn handshake(
    socket: TcpStream,
    reader: TcpStream,
    addr: &str,
    name: Option<&str>,
    config: &Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<(Wire, TlsReader), String> {
    let stream = connect_stream(socket, addr, name, config, timeout)?;
    stream
        .sock
        .set_read_timeout(Some(TLS_READ_SLICE))
        .map_err(|e| format!("socket setup failed: {e}"))?;
    let tls = Arc::new(Mutex::new(stream));
    let reader = TlsReader {
        stream: Arc::clone(&tls),
        fd: std::os::fd::AsRawFd::as_raw_fd(&reader),
        _socket: reader,
        draining: false,
    };
    Ok((Wire::Tls(tls), reader))
}

/// A byte stream both ways: a socket, or TLS over one (`send`, `status`).
pub(crate) trait Duplex: Read + Write + Send {}
impl<T: Read + Write + Send> Duplex for T {}

/// The TLS flags of a command-line client: `--tls-ca` (turns TLS on) and `--tls-name`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct ClientTlsArgs {
    /// Connect over TLS (the gateway's `--tls-cert`), trusting the CA certificates of this
    /// PEM file.
    #[arg(long, value_name = "PEM")]
    pub(crate) tls_ca: Option<std::path::PathBuf>,
    /// The name the gateway's certificate must be for (default: the host of the address).
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    pub(crate) tls_name: Option<String>,
}

impl ClientTlsArgs {
    /// The client configuration, when `--tls-ca` is given.
    pub(crate) fn config(&self) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
        self.tls_ca
            .as_deref()
            .map(|ca| client_config(Some(ca), "--tls-ca"))
            .transpose()
    }

    /// `socket` as it is, or with TLS (`config` from [`ClientTlsArgs::config`]).
    pub(crate) fn wrap(
        &self,
        config: Option<&Arc<rustls::ClientConfig>>,
        socket: TcpStream,
        addr: &str,
        timeout: Duration,
    ) -> Result<Box<dyn Duplex>, String> {
        match config {
            None => Ok(Box::new(socket)),
            Some(c) => Ok(Box::new(connect_stream(
                socket,
                addr,
                self.tls_name.as_deref(),
                c,
                timeout,
            )?)),
        }
    }
}
