//! Durations, sizes and addresses as an operator writes them, on the command line and in the
//! `--config` file alike — and in the form the help prints them, so a default copied from
//! `--help` is always accepted.
//!
//! - durations: `600` (seconds), `600s`, `1.5s`, `250ms`, `10m`, `2h`;
//! - sizes: `1048576` (bytes), `512B`, `64KiB`, `1MiB`, `256 MiB`, `1GiB` (binary units; the
//!   ambiguous `MB`/`M` are refused with a hint);
//! - addresses: `127.0.0.1:7878`, `[::1]:7878`, `localhost:7878` (names resolved once, at
//!   start-up).

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use serde::Deserialize;

/// Longest duration a setting may hold (about 31 years): past it `Duration` arithmetic in
/// deadlines could overflow.
const MAX_SECONDS: f64 = 1e9;

/// A duration setting, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Seconds(pub(crate) f64);

impl FromStr for Seconds {
    type Err = String;

    fn from_str(s: &str) -> Result<Seconds, String> {
        let t = s.trim();
        let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let scale = match unit {
            "" | "s" => 1.0,
            "ms" => 1e-3,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use ms, s, m or h, e.g. 1.5s, 10m)"
                ));
            }
        };
        let v: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a duration (e.g. 600, 600s, 10m, 1.5s)"))?;
        let v = v * scale;
        if !(0.0..=MAX_SECONDS).contains(&v) {
            return Err(format!(
                "{s:?} is out of range (0 to {MAX_SECONDS} seconds)"
            ));
        }
        Ok(Seconds(v))
    }
}

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}s", self.0)
    }
}

/// A size setting, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bytes(pub(crate) usize);

impl FromStr for Bytes {
    type Err = String;

    fn from_str(s: &str) -> Result<Bytes, String> {
        let t = s.trim();
        let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
        let (number, unit) = (t[..split].trim(), t[split..].trim());
        let scale: u64 = match unit {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "K" | "KB" | "kB" | "M" | "MB" | "G" | "GB" => {
                return Err(format!(
                    "{s:?}: {unit} is ambiguous; use KiB, MiB or GiB (powers of 1024) or bytes"
                ));
            }
            _ => {
                return Err(format!(
                    "{s:?}: unknown unit {unit:?} (use B, KiB, MiB or GiB, e.g. 256 MiB)"
                ));
            }
        };
        let bad = || format!("{s:?} is not a size (e.g. 1048576, 64KiB, 256 MiB)");
        let bytes = if scale == 1 {
            number.parse::<u64>().map_err(|_| bad())?
        } else {
            // `1.5MiB` is allowed; the result must be a whole number of bytes.
            let v: f64 = number.parse().map_err(|_| bad())?;
            let b = v * scale as f64;
            if !b.is_finite() || b < 0.0 || b.fract() != 0.0 || b > u64::MAX as f64 {
                return Err(bad());
            }
            b as u64
        };
        usize::try_from(bytes)
            .map(Bytes)
            .map_err(|_| format!("{s:?} is too large"))
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            n if n >= 1 << 30 && n % (1 << 30) == 0 => write!(f, "{} GiB", n >> 30),
            n if n >= 1 << 20 && n % (1 << 20) == 0 => write!(f, "{} MiB", n >> 20),
            n if n >= 1 << 10 && n % (1 << 10) == 0 => write!(f, "{} KiB", n >> 10),
            n => write!(f, "{n}"),
        }
    }
}

/// A listening address: `IP:PORT`, or `NAME:PORT` resolved when parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ListenAddr(pub(crate) SocketAddr);

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<ListenAddr, String> {
        let t = s.trim();
        if let Ok(a) = t.parse::<SocketAddr>() {
            return Ok(ListenAddr(a));
        }
        if !t.contains(':') {
            return Err(format!("{s:?}: expected HOST:PORT (e.g. 127.0.0.1:7878)"));
        }
        let mut addrs = t
            .to_socket_addrs()
            .map_err(|e| format!("{s:?}: cannot resolve: {e}"))?;
        addrs
            .next()
            .map(ListenAddr)
            .ok_or_else(|| format!("{s:?}: the name has no address"))
    }
}

/// A number (seconds or bytes) or a string with a unit, as TOML gives it.
#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Int(u64),
    Float(f64),
    Text(String),
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Seconds, D::Error> {
        let text = match Raw::deserialize(d)? {
            Raw::Int(n) => n.to_string(),
            Raw::Float(v) => v.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        let text = match Raw::deserialize(d)? {
            Raw::Int(n) => n.to_string(),
            Raw::Float(v) => v.to_string(),
            Raw::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ListenAddr, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: &str) -> Result<f64, String> {
        s.parse::<Seconds>().map(|v| v.0)
    }

    fn bytes(s: &str) -> Result<usize, String> {
        s.parse::<Bytes>().map(|v| v.0)
    }

    #[test]
    fn durations_in_every_documented_form() {
        assert_eq!(secs("600"), Ok(600.0));
        assert_eq!(secs("600s"), Ok(600.0));
        assert_eq!(secs("1.5s"), Ok(1.5));
        assert_eq!(secs("0.8s"), Ok(0.8));
        assert_eq!(secs("250ms"), Ok(0.25));
        assert_eq!(secs("10m"), Ok(600.0));
        assert_eq!(secs("2h"), Ok(7200.0));
        assert_eq!(secs(" 5 s "), Ok(5.0));
        for bad in ["", "s", "-1", "10x", "NaN", "inf", "1e10", "1.2.3"] {
            assert!(secs(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn sizes_in_every_documented_form() {
        assert_eq!(bytes("1048576"), Ok(1 << 20));
        assert_eq!(bytes("1MiB"), Ok(1 << 20));
        assert_eq!(bytes("256 MiB"), Ok(256 << 20));
        assert_eq!(bytes("64KiB"), Ok(64 << 10));
        assert_eq!(bytes("1.5KiB"), Ok(1536));
        assert_eq!(bytes("2GiB"), Ok(2 << 30));
        assert_eq!(bytes("512B"), Ok(512));
        let ambiguous = bytes("1MB").expect_err("MB is ambiguous");
        assert!(ambiguous.contains("MiB"), "{ambiguous}");
        for bad in ["", "MiB", "-1", "1.5", "0.3B", "1 TiB", "abc"] {
            assert!(bytes(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// What the help prints as a default is parsed back to the same value.
    #[test]
    fn the_printed_form_parses_back() {
        for v in [0.0, 0.8, 5.0, 600.0, 3600.0] {
            assert_eq!(Seconds(v).to_string().parse::<Seconds>(), Ok(Seconds(v)));
        }
        for n in [0, 1, 1000, 4096, 8192, 65536, 1 << 20, 256 << 20, 1 << 30] {
            assert_eq!(Bytes(n).to_string().parse::<Bytes>(), Ok(Bytes(n)));
        }
    }

    #[test]
    fn addresses_with_names_resolve() {
        assert_eq!(
            "127.0.0.1:7878".parse::<ListenAddr>().map(|a| a.0.port()),
            Ok(7878)
        );
        let local = "localhost:7878".parse::<ListenAddr>().expect("localhost");
        assert!(local.0.ip().is_loopback(), "{local:?}");
        assert!("localhost".parse::<ListenAddr>().is_err());
        assert!("127.0.0.1:99999".parse::<ListenAddr>().is_err());
    }

    #[test]
    fn toml_takes_numbers_and_strings() {
        #[derive(Deserialize)]
        struct T {
            a: Seconds,
            b: Seconds,
            c: Bytes,
            d: Bytes,
        }
        let t: T = toml::from_str("a = 5\nb = \"10m\"\nc = 4096\nd = \"1 MiB\"").expect("toml");
        assert_eq!((t.a.0, t.b.0, t.c.0, t.d.0), (5.0, 600.0, 4096, 1 << 20));
        assert!(toml::from_str::<T>("a = -1\nb = 1\nc = 1\nd = 1").is_err());
    }
}
