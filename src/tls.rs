//! TLS for the listeners (the bridge server's and the HTTP endpoint's): a certificate chain
//! and key loaded from PEM files ([`ServerTls`]), and [`Transport`], a connection's bytes
//! either plain or through a rustls `ServerConnection`.
//!
//! Everything here is non-blocking, for the reactor: [`Transport`]'s `Read` takes what the
//! socket has (`read_tls`, `process_new_packets`) and hands out plaintext; its `Write` takes
//! plaintext only when the ciphertext already queued has gone to the socket, so the socket's
//! backpressure reaches the caller as `WouldBlock` and rustls never buffers more than one
//! write's worth. A handshake sends no line, so the listeners' own deadlines close one that
//! does not finish in time: the HTTP head timeout, and on the bridge port the hello deadline
//! (`--hello-timeout`), which the server applies to an unfinished handshake whether or not a
//! token is set (without one a connection needs no hello, but still its handshake); its
//! bytes are bounded by rustls (a handshake message is at most 64 KiB; junk is an error).
//!
//! A certificate is checked against the clock when it is loaded: an expired or not yet valid
//! one is an error (so start-up refuses it, and a reload keeps the pair in force), and one
//! that expires within [`EXPIRY_WARNING`] is logged at WARN. Its dates are read from the DER
//! by the small bounded reader in `validity`.
//!
//! The key's contents never leave [`ServerTls::from_pem_files`]: errors name the file and what
//! is wrong with it, never a line of it (rustls-pki-types' PEM errors quote the offending
//! line, so they are reworded here).

use std::io::{self, Read, Write};

use mio::net::TcpStream;

#[cfg(feature = "cli")]
pub(crate) use imp::load_certs;
#[cfg(feature = "tls")]
mod validity;
#[cfg(feature = "tls")]
pub use imp::{ServerTls, TlsError};

/// Without the `tls` feature nothing makes a [`ServerTls`]: a connection is always plain.
#[cfg(not(feature = "tls"))]
#[derive(Clone, Debug)]
pub(crate) struct ServerTls(());

#[cfg(not(feature = "tls"))]
impl ServerTls {
    /// Without TLS there is no certificate.
    pub(crate) fn not_after_unix_s(&self) -> Option<i64> {
        None
    }
}

/// How long before its `notAfter` a certificate being loaded is logged at WARN.
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
const EXPIRY_WARNING: std::time::Duration = std::time::Duration::from_secs(14 * 86_400);

/// Largest certificate or key file read (a certificate chain is a few KiB).
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
const MAX_PEM_BYTES: u64 = 1 << 20;

/// A connection's bytes: the socket itself, or TLS over it.
pub(crate) enum Transport {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS (boxed: a `ServerConnection` is about a kilobyte).
    #[cfg(feature = "tls")]
    Tls(Box<imp::TlsConn>),
}

impl Transport {
    /// An accepted socket, with TLS when the listener has a certificate.
    pub(crate) fn accept(stream: TcpStream, tls: Option<&ServerTls>) -> io::Result<Transport> {
        match tls {
            None => Ok(Transport::Plain(stream)),
            #[cfg(feature = "tls")]
            Some(t) => Ok(Transport::Tls(Box::new(imp::TlsConn::new(t, stream)?))),
            #[cfg(not(feature = "tls"))]
            Some(ServerTls(())) => Ok(Transport::Plain(stream)),
        }
    }

    /// The socket (to register it, ask how much it has unacknowledged, reset it).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Transport::Plain(s) => s,
            #[cfg(feature = "tls")]
            Transport::Tls(t) => &t.sock,
        }
    }

    /// The socket, mutably (to register and deregister it).
    pub(crate) fn tcp_mut(&mut self) -> &mut TcpStream {
        match self {
            Transport::Plain(s) => s,
            #[cfg(feature = "tls")]
            Transport::Tls(t) => &mut t.sock,
        }
    }

    /// A TLS connection whose handshake has not finished (plain: never).
    pub(crate) fn handshaking(&self) -> bool {
        match self {
            Transport::Plain(_) => false,
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.conn.is_handshaking(),
        }
    }

    /// Whether this connection is TLS.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn is_tls(&self) -> bool {
        !matches!(self, Transport::Plain(_))
    }

    /// Writes what TLS has queued (handshake records, the tail of a write) as far as the
    /// socket takes it; `Ok` when the socket would block. Plain: nothing to do.
    pub(crate) fn flush_tls(&mut self) -> io::Result<()> {
        match self {
            Transport::Plain(_) => Ok(()),
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.write_pending(),
        }
    }

    /// Ciphertext queued in TLS and not yet on the socket (no figure of what the peer has).
    pub(crate) fn tls_queued(&self) -> bool {
        match self {
            Transport::Plain(_) => false,
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.conn.wants_write(),
        }
    }

    /// Ends the write side: TLS says `close_notify` first (best effort, never blocking).
    pub(crate) fn shutdown_write(&mut self) {
        #[cfg(feature = "tls")]
        if let Transport::Tls(t) = self {
            t.conn.send_close_notify();
            let _ = t.write_pending();
        }
        let _ = self.tcp().shutdown(std::net::Shutdown::Write);
    }
}

impl Read for Transport {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => s.read(buf),
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Transport {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => s.write(buf),
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.write(buf),
        }
    }

    /// The frame writer hands whole frames as slices: one syscall for many on a plain socket.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Transport::Plain(s) => s.write_vectored(bufs),
            #[cfg(feature = "tls")]
            Transport::Tls(t) => t.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_tls()
    }
}

#[cfg(feature = "tls")]
mod imp {
    use std::fmt;
    use std::io::{self, Read, Write};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use mio::net::TcpStream;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};

    use super::validity::{self, Validity};
    use super::{EXPIRY_WARNING, MAX_PEM_BYTES};

    /// Why a certificate or key could not be loaded: names the file, never quotes it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct TlsError(String);

    impl fmt::Display for TlsError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for TlsError {}

    /// A listener's certificate chain and private key (feature `tls`): what
    /// [`BridgeServer::set_tls`](crate::BridgeServer::set_tls) serves. Cheap to clone (the
    /// rustls configuration is shared); its `Debug` shows the certificate's path only.
    #[derive(Clone)]
    pub struct ServerTls {
        pub(super) config: Arc<rustls::ServerConfig>,
        cert: PathBuf,
        validity: Validity,
    }

    impl fmt::Debug for ServerTls {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ServerTls")
                .field("cert", &self.cert)
                .finish_non_exhaustive()
        }
    }

    /// A regular file of at most [`MAX_PEM_BYTES`], read whole.
    fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, TlsError> {
        let bad = |e: &dyn fmt::Display| TlsError(format!("{what} {}: {e}", path.display()));
        let meta = std::fs::metadata(path).map_err(|e| bad(&e))?;
        if !meta.is_file() {
            return Err(bad(&"not a regular file"));
        }
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_PEM_BYTES + 1).read_to_end(&mut bytes))
            .map_err(|e| bad(&e))?;
        if bytes.len() as u64 > MAX_PEM_BYTES {
            return Err(bad(&format_args!("larger than {MAX_PEM_BYTES} bytes")));
        }
        Ok(bytes)
    }

    /// A PEM error in words that quote nothing of the file.
    fn pem_error(e: &rustls_pki_types::pem::Error) -> &'static str {
        use rustls_pki_types::pem::Error;
        match e {
            Error::MissingSectionEnd { .. } => "a PEM section has no END line",
            Error::IllegalSectionStart { .. } => "a PEM BEGIN line is malformed",
            Error::Base64Decode(_) => "a PEM section is not valid base64",
            Error::NoItemsFound => "no PEM section of the expected kind in it",
            _ => "not a readable PEM file",
        }
    }

    /// The certificates of a PEM file (a CA bundle, a chain), at least one.
    pub(crate) fn load_certs(
        path: &Path,
        what: &str,
    ) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let bytes = read_pem(path, what)?;
        let bad = |e: &str| TlsError(format!("{what} {}: {e}", path.display()));
        let certs = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(pem_error(&e)))?;
        if certs.is_empty() {
            return Err(bad("no certificate (BEGIN CERTIFICATE) in it"));
        }
        Ok(certs)
    }

    impl ServerTls {
        /// Loads a certificate chain (PEM, the server's certificate first) and its private key
        /// (PEM: PKCS#8, PKCS#1 or SEC1). The errors name the file; a key that does not match
        /// the certificate is an error here, not at the first handshake, and so is a
        /// certificate outside its validity (expired or not yet valid: the error names the
        /// date). One that expires within 14 days loads with a WARN.
        pub fn from_pem_files(cert: &Path, key: &Path) -> Result<ServerTls, TlsError> {
            let certs = load_certs(cert, "--tls-cert")?;
            let validity = validity::validity(certs[0].as_ref()).ok_or_else(|| {
                TlsError(format!(
                    "--tls-cert {}: the certificate's validity dates cannot be read",
                    cert.display()
                ))
            })?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            if let Some(warning) = check_validity(cert, validity, now)? {
                log::warn!("{warning}");
            }
            let key_bytes = read_pem(key, "--tls-key")?;
            let key_der = PrivateKeyDer::from_pem_slice(&key_bytes)
                .map_err(|e| TlsError(format!("--tls-key {}: {}", key.display(), pem_error(&e))))?;
            drop(key_bytes);
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError(format!("TLS set-up failed: {e}")))?
                .with_no_client_auth()
                .with_single_cert(certs, key_der)
                .map_err(|e| {
                    TlsError(format!(
                        "--tls-cert {} with --tls-key {}: {e}",
                        cert.display(),
                        key.display()
                    ))
                })?;
            Ok(ServerTls {
                config: Arc::new(config),
                cert: cert.to_owned(),
                validity,
            })
        }

        /// The certificate file it was loaded from.
        pub fn cert_path(&self) -> &Path {
            &self.cert
        }

        /// The certificate's `notAfter`, in seconds since the Unix epoch.
        pub(crate) fn not_after_unix_s(&self) -> Option<i64> {
            Some(self.validity.not_after)
        }
    }

    /// The certificate at `path` against the clock (`now`, seconds since the epoch): an
    /// error outside its validity, a warning within [`EXPIRY_WARNING`] of its end.
    pub(super) fn check_validity(
        path: &Path,
        v: Validity,
        now: i64,
    ) -> Result<Option<String>, TlsError> {
        let path = path.display();
        if now < v.not_before {
            return Err(TlsError(format!(
                "--tls-cert {path}: the certificate is not valid before {} (clients would refuse it)",
                validity::date(v.not_before)
            )));
        }
        if now > v.not_after {
            return Err(TlsError(format!(
                "--tls-cert {path}: the certificate expired on {} (clients would refuse it)",
                validity::date(v.not_after)
            )));
        }
        let left = v.not_after - now;
        Ok((left < EXPIRY_WARNING.as_secs() as i64).then(|| {
            format!(
                "--tls-cert {path}: the certificate expires on {} (in {} h); renew it and send SIGHUP",
                validity::date(v.not_after),
                left / 3_600
            )
        }))
    }

    /// One TLS connection over a non-blocking socket.
    pub(crate) struct TlsConn {
        pub(super) conn: rustls::ServerConnection,
        pub(super) sock: TcpStream,
        /// The socket reported end of stream.
        eof: bool,
    }

    impl TlsConn {
        pub(super) fn new(tls: &ServerTls, sock: TcpStream) -> io::Result<TlsConn> {
            let conn =
                rustls::ServerConnection::new(Arc::clone(&tls.config)).map_err(io::Error::other)?;
            Ok(TlsConn {
                conn,
                sock,
                eof: false,
            })
        }

        /// Writes queued ciphertext until the socket would block.
        pub(super) fn write_pending(&mut self) -> io::Result<()> {
            while self.conn.wants_write() {
                match self.conn.write_tls(&mut self.sock) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }

        /// Plaintext, reading and decrypting what the socket has until some is there; the
        /// socket's `WouldBlock` when it has none. End of stream is `Ok(0)`, with or without
        /// `close_notify` (a line protocol acts only on complete lines: a cut one is dropped).
        pub(super) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            loop {
                match self.conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                    Err(e) => return Err(e),
                }
                if self.eof {
                    return Ok(0);
                }
                match self.conn.read_tls(&mut self.sock) {
                    Ok(0) => self.eof = true,
                    Ok(_) => {}
                    Err(e) => return Err(e),
                }
                if let Err(e) = self.conn.process_new_packets() {
                    // The alert rustls queued tells the peer why.
                    let _ = self.write_pending();
                    log::debug!("tls: {e}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                }
                // Handshake replies go out as soon as they exist.
                self.write_pending()?;
            }
        }

        /// Takes plaintext only once earlier ciphertext is on the socket (backpressure).
        pub(super) fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.write_vectored(&[io::IoSlice::new(buf)])
        }

        /// As [`TlsConn::write`], for several slices at once.
        pub(super) fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
            self.write_pending()?;
            if self.conn.wants_write() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = self.conn.writer().write_vectored(bufs)?;
            self.write_pending()?;
            if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
                // rustls' own buffer is full (a handshake still running): wait for the socket.
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        }
    }
}

#[cfg(all(test, feature = "tls"))]
mod tests {
    use super::imp::check_validity;
    use super::validity::Validity;
    use std::path::Path;

    /// Outside the window: an error naming the file and the date; near its end: a warning.
    #[test]
    fn a_certificate_is_checked_against_the_clock() {
        let v = Validity {
            not_before: 1_000_000,
            not_after: 1_000_000 + 30 * 86_400,
        };
        let path = Path::new("/etc/t/cert.pem");
        let early = check_validity(path, v, v.not_before - 1).expect_err("not yet valid");
        assert!(early.to_string().contains("/etc/t/cert.pem"), "{early}");
        assert!(
            early.to_string().contains("not valid before 1970-01-12"),
            "{early}"
        );
        let late = check_validity(path, v, v.not_after + 1).expect_err("expired");
        assert!(late.to_string().contains("expired on 1970-02-11"), "{late}");
        assert_eq!(check_validity(path, v, v.not_before), Ok(None));
        assert_eq!(check_validity(path, v, v.not_after - 14 * 86_400), Ok(None));
        let warn = check_validity(path, v, v.not_after - 14 * 86_400 + 1)
            .expect("valid")
            .expect("a warning");
        assert!(warn.contains("expires on 1970-02-11"), "{warn}");
    }
}
