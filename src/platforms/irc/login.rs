//! Logging in where a network requires it: the server password (`PASS`), SASL PLAIN or
//! EXTERNAL (the TLS client certificate; IRCv3 `CAP LS`/`CAP REQ :sasl`/`AUTHENTICATE`,
//! ended by `903` or a failure numeric, then `CAP END`), and NickServ `IDENTIFY` after the
//! welcome. The secrets come from environment
//! variables (never flags), are registered for redaction, and are never logged: a line
//! written is logged by its command word only.

use crate::platforms::secrets::Secret;

/// How the bot logs in; all optional.
#[derive(Clone, Debug, Default)]
pub(crate) struct Login {
    /// Sent as `PASS` before registration.
    pub server_password: Option<Secret>,
    /// SASL PLAIN: the account and its password.
    pub sasl_plain: Option<(String, Secret)>,
    /// SASL EXTERNAL: the server logs the bot in by its TLS client certificate.
    pub sasl_external: bool,
    /// Sent to NickServ as `IDENTIFY <password>` after the welcome.
    pub nickserv_password: Option<Secret>,
}

/// Where a connection's SASL exchange is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sasl {
    /// No SASL (not configured, or over: succeeded, failed, or not offered).
    Off,
    /// `CAP LS` sent; whether a line so far offered `sasl`.
    Listing { offered: bool },
    /// `CAP REQ :sasl` sent.
    Requested,
    /// `AUTHENTICATE PLAIN` (or `EXTERNAL`) sent, waiting for `AUTHENTICATE +`.
    Started,
    /// The credentials sent, waiting for `903` (or a failure).
    Sent,
}

impl Login {
    /// Refuses what would break a line: CR, LF or NUL in a secret or the account, an empty
    /// one. The error names the setting, never its value.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let bad = |s: &str| s.is_empty() || s.contains(['\r', '\n', '\0']);
        let named = [
            ("--server-password-env", self.server_password.as_ref()),
            ("--nickserv-password-env", self.nickserv_password.as_ref()),
            (
                "--sasl-password-env",
                self.sasl_plain.as_ref().map(|(_, p)| p),
            ),
        ];
        for (flag, secret) in named {
            if secret.is_some_and(|s| bad(s.expose())) {
                return Err(format!(
                    "{flag}: the secret is empty or holds CR, LF or NUL"
                ));
            }
        }
        if self
            .sasl_plain
            .as_ref()
            .is_some_and(|(a, _)| bad(a) || a.contains(' '))
        {
            return Err("--sasl-account is empty or holds a space, CR, LF or NUL".into());
        }
        if self.sasl_external && self.sasl_plain.is_some() {
            return Err("--sasl-external and --sasl-account: choose one SASL mechanism".into());
        }
        Ok(())
    }

    /// The lines that open a connection, before `NICK`/`USER`: `CAP LS 302` when SASL is
    /// configured, `PASS` when a server password is. With the SASL state to start from.
    pub(super) fn opening(&self) -> (Vec<String>, Sasl) {
        let mut lines = Vec::new();
        let mut sasl = Sasl::Off;
        if self.sasl_plain.is_some() || self.sasl_external {
            lines.push("CAP LS 302".to_owned());
            sasl = Sasl::Listing { offered: false };
        }
        if let Some(p) = &self.server_password {
            lines.push(format!("PASS :{}", p.expose()));
        }
        (lines, sasl)
    }

    /// The NickServ identification to send after the welcome, if configured.
    pub(super) fn identify(&self) -> Option<String> {
        self.nickserv_password
            .as_ref()
            .map(|p| format!("PRIVMSG NickServ :IDENTIFY {}", p.expose()))
    }

    /// A `CAP`, `AUTHENTICATE` or SASL numeric line in state `sasl`: the lines to answer
    /// with and the next state. `params` are the line's parameters.
    pub(super) fn step(
        &self,
        sasl: Sasl,
        command: &str,
        params: &[&str],
        server: &str,
    ) -> (Vec<String>, Sasl) {
        let end = || vec!["CAP END".to_owned()];
        match (sasl, command) {
            (Sasl::Listing { offered }, "CAP") if params.get(1) == Some(&"LS") => {
                let caps = params.last().copied().unwrap_or("");
                let offered = offered
                    || caps
                        .split(' ')
                        .any(|c| c == "sasl" || c.starts_with("sasl="));
                // `CAP * LS * :…` says more lines follow.
                if params.len() >= 4 && params[2] == "*" {
                    return (Vec::new(), Sasl::Listing { offered });
                }
                if offered {
                    (vec!["CAP REQ :sasl".to_owned()], Sasl::Requested)
                } else {
                    warn_limited!("irc {server}: the server offers no SASL; going on without it");
                    (end(), Sasl::Off)
                }
            }
            (Sasl::Requested, "CAP") if params.get(1) == Some(&"ACK") => {
                let mechanism = if self.sasl_external {
                    "EXTERNAL"
                } else {
                    "PLAIN"
                };
                (vec![format!("AUTHENTICATE {mechanism}")], Sasl::Started)
            }
            (Sasl::Requested, "CAP") if params.get(1) == Some(&"NAK") => {
                warn_limited!("irc {server}: the server refused the SASL capability");
                (end(), Sasl::Off)
            }
            (Sasl::Started, "AUTHENTICATE") if params.first() == Some(&"+") => {
                if self.sasl_external {
                    // No authorization identity: the one the certificate names.
                    return (vec!["AUTHENTICATE +".to_owned()], Sasl::Sent);
                }
                let Some((account, password)) = &self.sasl_plain else {
                    return (end(), Sasl::Off);
                };
                (authenticate_plain(account, password.expose()), Sasl::Sent)
            }
            (_, "903") => {
                info_redacted!("irc {server}: SASL login succeeded");
                (end(), Sasl::Off)
            }
            (Sasl::Off, _) => (Vec::new(), Sasl::Off),
            (_, "902" | "904" | "905" | "906" | "908") => {
                error_limited!(
                    "irc {server}: SASL login failed ({command}: {}); going on without it",
                    params.last().copied().unwrap_or("")
                );
                (end(), Sasl::Off)
            }
            (state, _) => (Vec::new(), state),
        }
    }
}

/// The `AUTHENTICATE` lines carrying PLAIN's `account\0account\0password`, base64 in chunks
/// of 400 bytes (a last chunk of exactly 400 is followed by `+`).
fn authenticate_plain(account: &str, password: &str) -> Vec<String> {
    let payload = base64(format!("{account}\0{account}\0{password}").as_bytes());
    let mut lines: Vec<String> = payload
        .as_bytes()
        .chunks(400)
        .map(|c| format!("AUTHENTICATE {}", String::from_utf8_lossy(c)))
        .collect();
    if payload.len().is_multiple_of(400) {
        lines.push("AUTHENTICATE +".to_owned());
    }
    lines
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ABC[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(
            base64(b"jilles\0jilles\0sesame"),
            "amlsbGVzAGppbGxlcwBzZXNhbWU="
        );
    }

    #[test]
    fn the_sasl_exchange_follows_the_ircv3_steps() {
        let login = Login {
            sasl_plain: Some(("jilles".into(), Secret::new("sesame".into()))),
            ..Login::default()
        };
        let (open, s) = login.opening();
        assert_eq!(open, ["CAP LS 302"]);
        let (out, s) = login.step(s, "CAP", &["*", "LS", "*", "multi-prefix"], "x");
        assert!(out.is_empty());
        let (out, s) = login.step(s, "CAP", &["*", "LS", "sasl=PLAIN,EXTERNAL"], "x");
        assert_eq!(out, ["CAP REQ :sasl"]);
        let (out, s) = login.step(s, "CAP", &["*", "ACK", "sasl"], "x");
        assert_eq!(out, ["AUTHENTICATE PLAIN"]);
        let (out, s) = login.step(s, "AUTHENTICATE", &["+"], "x");
        assert_eq!(out, ["AUTHENTICATE amlsbGVzAGppbGxlcwBzZXNhbWU="]);
        let (out, s) = login.step(s, "903", &["bot", "SASL authentication successful"], "x");
        assert_eq!(
            (out.as_slice(), s),
            (["CAP END".to_owned()].as_slice(), Sasl::Off)
        );
        // Not offered: CAP END at once.
        let (_, s) = login.opening();
        let (out, s) = login.step(s, "CAP", &["*", "LS", "multi-prefix"], "x");
        assert_eq!(
            (out.as_slice(), s),
            (["CAP END".to_owned()].as_slice(), Sasl::Off)
        );
        // EXTERNAL: the certificate is the credential, the response empty.
        let external = Login {
            sasl_external: true,
            ..Login::default()
        };
        let (open, s) = external.opening();
        assert_eq!(open, ["CAP LS 302"]);
        let (_, s) = external.step(s, "CAP", &["*", "LS", "sasl=EXTERNAL"], "x");
        let (out, s) = external.step(s, "CAP", &["*", "ACK", "sasl"], "x");
        assert_eq!(out, ["AUTHENTICATE EXTERNAL"]);
        let (out, s) = external.step(s, "AUTHENTICATE", &["+"], "x");
        assert_eq!(
            (out.as_slice(), s),
            (["AUTHENTICATE +".to_owned()].as_slice(), Sasl::Sent)
        );
        // A long password: 400-byte chunks, a trailing `+` after an exact multiple.
        let lines = authenticate_plain("a", &"p".repeat(296));
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1], "AUTHENTICATE +");
    }
}
