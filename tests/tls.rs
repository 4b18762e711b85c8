//! TLS on the listeners, with the real binary: `serve --tls-cert --tls-key` answers the
//! bridge protocol and the HTTP endpoint over TLS (to a rustls client here, and to the
//! binary's own `send` and `status`), a client trusting another CA is refused with a clear
//! error, and SIGHUP swaps the certificate (a broken new pair keeps the old one). The
//! certificates are made at test time with `openssl`; reads have timeouts that only bound a
//! failing run.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

mod common;
mod snapshot_watch;
use common::gateway::{Serve, turnstile as bin};
use common::http::{get_request, parse_response};
use common::{eventually, holds};
use snapshot_watch::SnapshotWatch;

const WAIT: Duration = Duration::from_secs(20);

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("turnstile-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Runs openssl in `dir`; panics with its stderr when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    common::run_ok(
        Command::new("openssl").args(args).current_dir(dir),
        &format!("openssl {args:?}"),
    );
}

const EC: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

/// A test CA `<name>-ca.pem` and a `localhost` certificate it signed, `<name>-cert.pem` with
/// its key `<name>-key.pem` (EC keys: quick to make).
fn make_pair(dir: &Path, name: &str) {
    let f = |suffix: &str| format!("{name}-{suffix}");
    let subj = format!("/CN=turnstile test CA {name}");
    openssl(
        dir,
        &[
            &["req", "-x509"][..],
            &EC,
            &[
                "-keyout",
                &f("ca.key"),
                "-out",
                &f("ca.pem"),
                "-days",
                "2",
                "-subj",
                &subj,
            ],
        ]
        .concat(),
    );
    openssl(
        dir,
        &[
            &["req"][..],
            &EC,
            &[
                "-keyout",
                &f("key.pem"),
                "-out",
                &f("leaf.csr"),
                "-subj",
                "/CN=localhost",
            ],
        ]
        .concat(),
    );
    std::fs::write(
        dir.join("leaf.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .expect("ext file");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &f("leaf.csr"),
            "-CA",
            &f("ca.pem"),
            "-CAkey",
            &f("ca.key"),
            "-CAcreateserial",
            "-out",
            &f("cert.pem"),
            "-days",
            "2",
            "-extfile",
            "leaf.ext",
        ],
    );
}

fn path(dir: &Path, file: &str) -> String {
    dir.join(file).to_str().expect("utf-8 path").to_owned()
}

/// `serve` with TLS on free ports; its log lines (INFO) read.
type Gw = Serve;

impl Serve {
    fn start(cert: &str, key: &str) -> Gw {
        Gw::start_with(cert, key, &[])
    }

    fn start_with(cert: &str, key: &str, args: &[&str]) -> Gw {
        Serve::spawn_logged(
            Serve::local_command("127.0.0.1:0")
                .args(["--access-default", "open"])
                .args(["--tls-cert", cert, "--tls-key", key])
                .args(args)
                .env("RUST_LOG", "info")
                .env_remove("NOTIFY_SOCKET")
                .env_remove("WATCHDOG_USEC")
                .env_remove("TURNSTILE_AUTH_TOKEN"),
        )
    }

    /// The first log line (from now on) holding every one of `needles`; every line read on
    /// the way is returned too.
    fn log_until(&self, needles: &[&str]) -> (String, Vec<String>) {
        self.log().until(needles)
    }
}

/// A rustls client trusting the CA in `ca` only.
fn client_config(ca: &str) -> Arc<rustls::ClientConfig> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("ca file") {
        roots.add(cert.expect("ca cert")).expect("add root");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A TLS connection to `addr` checking the certificate for `localhost`, handshake done.
fn connect_tls(addr: &str, ca: &str) -> Result<Tls, std::io::Error> {
    let mut sock = TcpStream::connect(addr).expect("connect");
    sock.set_read_timeout(Some(WAIT)).expect("timeout");
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
    let mut conn = rustls::ClientConnection::new(client_config(ca), name).expect("client");
    while conn.is_handshaking() {
        conn.complete_io(&mut sock)?;
    }
    Ok(rustls::StreamOwned::new(conn, sock))
}

/// Sends a line of JSON and reads lines until one matches `pred`.
fn exchange(tls: &mut Tls, lines: &[Value], pred: impl Fn(&Value) -> bool) -> Value {
    for l in lines {
        writeln!(tls, "{l}").expect("write");
    }
    tls.flush().expect("flush");
    let mut reader = BufReader::new(tls);
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read a line");
        assert!(n > 0, "the gateway closed the connection");
        let v: Value = serde_json::from_str(&line).expect("json");
        if pred(&v) {
            return v;
        }
    }
}

/// `GET path` over TLS; the status code and body.
fn https_get(addr: &str, ca: &str, path: &str) -> (u16, String) {
    https_get_with(addr, ca, path, "")
}

/// [`https_get`] with `headers` (each ending in CRLF) added to the request.
fn https_get_with(addr: &str, ca: &str, path: &str, headers: &str) -> (u16, String) {
    let mut tls = connect_tls(addr, ca).expect("handshake");
    tls.write_all(get_request(path, headers).as_bytes())
        .expect("request");
    tls.flush().expect("flush");
    let mut raw = Vec::new();
    match tls.read_to_end(&mut raw) {
        Ok(_) => {}
        // A close without close_notify after a complete answer is still an answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
        Err(e) => panic!("reading the answer: {e}"),
    }
    let answer = parse_response(&raw).0;
    (answer.status, answer.body)
}

fn run(args: &[&str]) -> Output {
    bin()
        .args(args)
        .env_remove("TURNSTILE_AUTH_TOKEN")
        .output()
        .expect("run turnstile")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The bridge protocol and the HTTP endpoint over TLS: a hello and a message answered, a
/// /healthz and a /status that says TLS is on, both from a rustls client and from the
/// binary's own `send` and `status`; a plain client gets no protocol line.
#[test]
fn both_listeners_speak_tls_and_the_clients_use_it() {
    let dir = temp_dir("both");
    make_pair(&dir, "a");
    let ca = path(&dir, "a-ca.pem");
    let gw = Gw::start(&path(&dir, "a-cert.pem"), &path(&dir, "a-key.pem"));

    let mut tls = connect_tls(&gw.addr, &ca).expect("bridge handshake");
    let reply = exchange(
        &mut tls,
        &[
            json!({"op": "hello", "platform": "cli"}),
            json!({"op": "message", "id": "m1", "platform": "cli", "chat_id": "c", "text": "over tls"}),
        ],
        |v| v["op"] == "reply",
    );
    assert_eq!(reply["id"], "m1");
    assert_eq!(reply["text"], "over tls");

    let (code, body) = https_get(gw.http(), &ca, "/healthz");
    assert_eq!(code, 200, "{body}");
    let (code, body) = https_get(gw.http(), &ca, "/status");
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).expect("status json");
    assert_eq!(status["frontend"]["tls"], true, "{status}");
    assert_eq!(status["frontend"]["http"]["tls"], true, "{status}");

    let sent = run(&[
        "send",
        "--addr",
        &gw.addr,
        "--tls-ca",
        &ca,
        "--tls-name",
        "localhost",
        "--timeout",
        "20",
        "hello",
        "from",
        "send",
    ]);
    assert!(sent.status.success(), "send: {}", text(&sent.stderr));
    assert_eq!(text(&sent.stdout).trim(), "hello from send");

    let st = run(&[
        "status",
        "--http",
        gw.http(),
        "--tls-ca",
        &ca,
        "--tls-name",
        "localhost",
    ]);
    assert!(st.status.success(), "status: {}", text(&st.stderr));
    assert!(text(&st.stdout).contains("tls on"), "{}", text(&st.stdout));

    // A plain client's hello gets no answer in the clear: the bytes are not TLS.
    let mut plain = TcpStream::connect(&gw.addr).expect("connect");
    plain.set_read_timeout(Some(WAIT)).expect("timeout");
    // The gateway may close it before the write lands (it is not a TLS ClientHello): a
    // failed write is as good an answer as an empty read.
    let _ = writeln!(plain, "{}", json!({"op": "hello", "platform": "cli"}));
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(
        !text(&got).contains("\"op\""),
        "a plaintext answer: {}",
        text(&got)
    );
}

/// A client that trusts another CA is refused, and says why; the gateway goes on serving.
#[test]
fn a_client_with_the_wrong_ca_is_refused() {
    let dir = temp_dir("wrong-ca");
    make_pair(&dir, "a");
    make_pair(&dir, "b");
    let gw = Gw::start(&path(&dir, "a-cert.pem"), &path(&dir, "a-key.pem"));
    let wrong = path(&dir, "b-ca.pem");

    let err = connect_tls(&gw.addr, &wrong)
        .err()
        .unwrap_or_else(|| panic!("the handshake succeeded"));
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    let err = connect_tls(gw.http(), &wrong)
        .err()
        .unwrap_or_else(|| panic!("the handshake succeeded"));
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");

    let sent = run(&[
        "send",
        "--addr",
        &gw.addr,
        "--tls-ca",
        &wrong,
        "--tls-name",
        "localhost",
        "hi",
    ]);
    assert_eq!(sent.status.code(), Some(1));
    let stderr = text(&sent.stderr);
    assert!(
        stderr.contains("TLS handshake with") && stderr.contains("invalid peer certificate"),
        "{stderr}"
    );
    let st = run(&[
        "status",
        "--http",
        gw.http(),
        "--tls-ca",
        &wrong,
        "--tls-name",
        "localhost",
    ]);
    assert!(!st.status.success());
    assert!(
        text(&st.stderr).contains("invalid peer certificate"),
        "{}",
        text(&st.stderr)
    );
    // The refusals cost the gateway nothing: the right CA is still answered.
    let (code, _) = https_get(gw.http(), &path(&dir, "a-ca.pem"), "/healthz");
    assert_eq!(code, 200);
}

/// SIGHUP reads the pair again: new connections get the new certificate on both listeners;
/// a broken new pair is refused with an ERROR naming the file (not its contents) and the
/// certificate in force stays.
#[test]
fn sighup_swaps_the_certificate_and_a_broken_pair_keeps_the_old_one() {
    let dir = temp_dir("reload");
    make_pair(&dir, "a");
    make_pair(&dir, "b");
    let (cert, key) = (path(&dir, "cert.pem"), path(&dir, "key.pem"));
    std::fs::copy(dir.join("a-cert.pem"), &cert).expect("copy");
    std::fs::copy(dir.join("a-key.pem"), &key).expect("copy");
    let (ca_a, ca_b) = (path(&dir, "a-ca.pem"), path(&dir, "b-ca.pem"));
    let gw = Gw::start(&cert, &key);
    gw.log_until(&["TLS on both listeners"]);
    assert!(connect_tls(&gw.addr, &ca_a).is_ok());
    assert!(connect_tls(&gw.addr, &ca_b).is_err());

    std::fs::copy(dir.join("b-cert.pem"), &cert).expect("copy");
    std::fs::copy(dir.join("b-key.pem"), &key).expect("copy");
    gw.signal(libc::SIGHUP);
    gw.log_until(&["reload: applied"]);
    let mut tls = connect_tls(&gw.addr, &ca_b).expect("the new certificate on the bridge port");
    let pong = exchange(
        &mut tls,
        &[
            json!({"op": "hello", "platform": "cli"}),
            json!({"op": "ping"}),
        ],
        |v| v["op"] == "pong",
    );
    assert_eq!(pong["op"], "pong");
    assert_eq!(https_get(gw.http(), &ca_b, "/healthz").0, 200);
    assert!(connect_tls(&gw.addr, &ca_a).is_err(), "the old one is gone");
    assert!(
        connect_tls(gw.http(), &ca_a).is_err(),
        "the old one is gone"
    );

    // A key that is no PEM at all: refused, named, not quoted.
    let secret_line = "not-a-key-but-secret-material-0123456789";
    std::fs::write(&key, format!("{secret_line}\n")).expect("write");
    gw.signal(libc::SIGHUP);
    let (refused, seen) = gw.log_until(&["reload refused"]);
    assert!(
        refused.contains("ERROR") && refused.contains("--tls-key") && refused.contains(&key),
        "{refused}"
    );
    for line in seen.iter().chain([&refused]) {
        assert!(
            !line.contains(secret_line),
            "the key's contents logged: {line}"
        );
    }
    // A key that does not match the certificate: refused too.
    std::fs::copy(dir.join("a-key.pem"), &key).expect("copy");
    gw.signal(libc::SIGHUP);
    let (refused, _) = gw.log_until(&["reload refused"]);
    assert!(refused.contains("--tls-cert"), "{refused}");
    // B is still served.
    assert!(connect_tls(&gw.addr, &ca_b).is_ok());
    assert_eq!(https_get(gw.http(), &ca_b, "/healthz").0, 200);
}

/// Bad pairs stop start-up with the file named: a missing file, a key that does not match.
#[test]
fn a_bad_pair_at_start_up_is_an_error_naming_the_file() {
    let dir = temp_dir("startup");
    make_pair(&dir, "a");
    make_pair(&dir, "b");
    let check = |cert: &str, key: &str| {
        run(&[
            "serve",
            "--check-config",
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ])
    };
    let missing = path(&dir, "nope.pem");
    let out = check(&path(&dir, "a-cert.pem"), &missing);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&missing),
        "{}",
        text(&out.stderr)
    );
    let out = check(&path(&dir, "a-cert.pem"), &path(&dir, "b-key.pem"));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--tls-cert"),
        "{}",
        text(&out.stderr)
    );
    let out = check(&path(&dir, "a-cert.pem"), &path(&dir, "a-key.pem"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // The same keys in the config file.
    let cfg = dir.join("turnstile.toml");
    std::fs::write(
        &cfg,
        format!(
            "tls-cert = {:?}\ntls-key = {:?}\n",
            path(&dir, "a-cert.pem"),
            path(&dir, "b-key.pem")
        ),
    )
    .expect("write");
    let out = run(&[
        "serve",
        "--check-config",
        "--config",
        cfg.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("does not match") || text(&out.stderr).contains("--tls-cert"),
        "{}",
        text(&out.stderr)
    );
}

/// The least of a Telegram Bot API a bridge needs to come up: `getMe` answers the bot, a
/// `getUpdates` is held (no updates) until the test ends. For the gateway side of the bridge.
fn fake_bot_api() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (hold_tx, hold) = crossbeam_channel::bounded::<()>(0);
    std::thread::spawn(move || {
        // Held by this thread, so the held requests wait until the process ends.
        let _hold_tx = hold_tx;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let hold = hold.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 {
                        return;
                    }
                    let header = header.trim_end();
                    if header.is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':')
                        && name.eq_ignore_ascii_case("content-length")
                    {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0u8; length];
                let _ = reader.read_exact(&mut body);
                if !line.contains("/getMe") {
                    let _ = hold.recv();
                    return;
                }
                let body = json!({"ok": true, "result": {"id": 999, "is_bot": true,
                    "first_name": "Fake", "username": "fake_bot"}})
                .to_string();
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    url
}

/// A platform bridge (the gateway client every bridge shares) says its hello over TLS and
/// is answered; with the wrong CA it is refused, says why in a WARN, and keeps retrying.
#[test]
fn a_bridge_connects_over_tls_and_a_wrong_ca_is_refused() {
    let dir = temp_dir("bridge");
    make_pair(&dir, "a");
    make_pair(&dir, "b");
    // The gateway's status file says when a new snapshot exists (see the wait below).
    let snapshot_dir = dir.join("snapshots");
    std::fs::create_dir_all(&snapshot_dir).expect("snapshot dir");
    let snapshots = SnapshotWatch::new(&snapshot_dir);
    let status_file = path(&snapshot_dir, "status.json");
    let gw = Gw::start_with(
        &path(&dir, "a-cert.pem"),
        &path(&dir, "a-key.pem"),
        &["--status-file", &status_file],
    );
    let api = fake_bot_api();
    let bridge = |ca: &str| {
        bin()
            .args(["bridge", "telegram", "--gateway", &gw.addr])
            .args(["--gateway-tls-ca", ca, "--gateway-tls-name", "localhost"])
            .args(["--api-base", &api])
            .arg("--state-dir")
            .arg(dir.join(format!("state-{}", ca.len())))
            .env("TELEGRAM_BOT_TOKEN", "123:fake")
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the bridge")
    };
    let mut good = bridge(&path(&dir, "a-ca.pem"));
    let mut line = String::new();
    BufReader::new(good.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the ready line");
    assert_eq!(line.trim(), "ready: telegram as @fake_bot");
    // The status is a snapshot taken every tick: look again at each new snapshot until one
    // shows the bridge.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (code, body) = https_get(gw.http(), &path(&dir, "a-ca.pem"), "/status");
        assert_eq!(code, 200);
        let status: Value = serde_json::from_str(&body).expect("json");
        if status["frontend"]["outboxes"].get("telegram").is_some() {
            break;
        }
        assert!(
            snapshots.next_before(deadline),
            "no telegram platform: {status}"
        );
    }
    let _ = good.kill();
    let _ = good.wait();

    let mut wrong = bridge(&path(&dir, "b-ca.pem"));
    let mut log = BufReader::new(wrong.stderr.take().expect("stderr"));
    let warn = loop {
        let mut line = String::new();
        assert!(
            log.read_line(&mut line).expect("a log line") > 0,
            "the bridge ended"
        );
        if line.contains("TLS handshake") {
            break line;
        }
    };
    assert!(
        warn.contains("WARN")
            && warn.contains("invalid peer certificate")
            && warn.contains("reconnecting"),
        "{warn}"
    );
    let _ = wrong.kill();
    let _ = wrong.wait();
}

/// Replies far larger than the sockets can hold go through TLS whole and in order: 6 MB of
/// replies with nothing read until every message is sent, against at most 4 MiB of send
/// buffer (`tcp_wmem`'s maximum here) and a 32 KiB receive buffer, so the gateway's writes
/// meet `WouldBlock` and resume on the socket's writable edges (its output bound is raised
/// so that it keeps reading meanwhile).
#[test]
fn large_replies_cross_tls_backpressure_intact() {
    use std::os::fd::AsRawFd;
    let dir = temp_dir("large");
    make_pair(&dir, "a");
    let gw = Gw::start_with(
        &path(&dir, "a-cert.pem"),
        &path(&dir, "a-key.pem"),
        &["--max-write-buffer", "64MiB", "--turn-workers", "4"],
    );
    let mut sock = TcpStream::connect(&gw.addr).expect("connect");
    let small: libc::c_int = 32 * 1024;
    // SAFETY: setsockopt with a pointer to a local int and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    sock.set_read_timeout(Some(WAIT)).expect("timeout");
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
    let ca = path(&dir, "a-ca.pem");
    let mut conn = rustls::ClientConnection::new(client_config(&ca), name).expect("client");
    while conn.is_handshaking() {
        conn.complete_io(&mut sock).expect("handshake");
    }
    let mut tls = rustls::StreamOwned::new(conn, sock);
    let n = 100;
    let texts: Vec<String> = (0..n)
        .map(|i| format!("{i}:{}", "x".repeat(60_000)))
        .collect();
    let mut lines = vec![json!({"op": "hello", "platform": "cli"})];
    lines.extend(texts.iter().enumerate().map(|(i, t)| {
        json!({"op": "message", "id": format!("m{i}"), "platform": "cli",
            "chat_id": format!("c{i}"), "text": t})
    }));
    for l in &lines {
        writeln!(tls, "{l}").expect("write");
    }
    tls.flush().expect("flush");
    let mut reader = BufReader::new(tls);
    let mut replies = std::collections::BTreeMap::new();
    while replies.len() < n {
        let mut line = String::new();
        assert!(reader.read_line(&mut line).expect("a line") > 0, "closed");
        let v: Value = serde_json::from_str(&line).expect("json");
        if v["op"] == "reply" {
            replies.insert(v["id"].as_str().expect("id").to_owned(), v["text"].clone());
        }
    }
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(replies[&format!("m{i}")], *t, "m{i}");
    }
}

/// A handshake counts against the deadlines a connection already has: a client that
/// connects and never finishes its handshake is closed at the hello deadline (with a token)
/// on the bridge port and at the head timeout on the HTTP port.
#[test]
fn an_unfinished_handshake_is_closed_at_the_existing_deadlines() {
    let dir = temp_dir("deadline");
    make_pair(&dir, "a");
    let gw = Gw::start_with(
        &path(&dir, "a-cert.pem"),
        &path(&dir, "a-key.pem"),
        &[
            "--auth-token",
            "t",
            "--hello-timeout",
            "1",
            "--http-head-timeout",
            "1",
        ],
    );
    for addr in [gw.addr.as_str(), gw.http()] {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(WAIT)).expect("timeout");
        // Half a ClientHello's record header: the handshake cannot finish.
        sock.write_all(&[0x16, 0x03]).expect("write");
        let mut rest = Vec::new();
        let closed = match sock.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "{addr}: not closed by the deadline");
    }
    // A client that does finish is served as ever.
    assert_eq!(
        https_get(gw.http(), &path(&dir, "a-ca.pem"), "/healthz").0,
        200
    );
}

/// A leaf for `localhost` valid from `start` to `end` (`YYYYMMDDHHMMSSZ`), signed by a new
/// CA, as `<name>-cert.pem` (and its CA and key as [`make_pair`] names them): `openssl ca`
/// takes any dates, where `req`/`x509` only count days from now.
fn make_dated_pair(dir: &Path, name: &str, start: &str, end: &str) {
    make_pair(dir, name);
    let f = |suffix: &str| format!("{name}-{suffix}");
    std::fs::write(dir.join(f("index.txt")), "").expect("index");
    std::fs::write(dir.join(f("serial")), "01\n").expect("serial");
    std::fs::write(
        dir.join(f("ca.cnf")),
        format!(
            "[ca]\ndefault_ca = d\n[d]\ndatabase = {}\nnew_certs_dir = .\nserial = {}\n\
             default_md = sha256\npolicy = p\nunique_subject = no\ncopy_extensions = copy\n\
             [p]\ncommonName = supplied\n",
            f("index.txt"),
            f("serial")
        ),
    )
    .expect("ca config");
    openssl(
        dir,
        &[
            "ca",
            "-batch",
            "-notext",
            "-config",
            &f("ca.cnf"),
            "-cert",
            &f("ca.pem"),
            "-keyfile",
            &f("ca.key"),
            "-in",
            &f("leaf.csr"),
            "-out",
            &f("cert.pem"),
            "-startdate",
            start,
            "-enddate",
            end,
            "-extfile",
            "leaf.ext",
        ],
    );
}

/// A certificate is checked against the clock: an expired one and a not yet valid one stop
/// start-up (exit 2, the file and the date named); one that expires within 14 days starts
/// with a WARN and its `notAfter` in the status and the metrics (the series the alert rule
/// reads); SIGHUP with an expired pair is refused with an ERROR and the pair in force stays.
#[test]
fn a_certificate_outside_its_dates_is_refused_and_one_near_its_end_is_warned_of() {
    let dir = temp_dir("dates");
    make_dated_pair(&dir, "old", "20200101000000Z", "20200201000000Z");
    make_dated_pair(&dir, "future", "20600101000000Z", "20610101000000Z");
    // A serve that does start is killed after WAIT: the test fails, it does not hang.
    let serve = |name: &str| {
        let cert = path(&dir, &format!("{name}-cert.pem"));
        let key = path(&dir, &format!("{name}-key.pem"));
        let child = bin()
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--tls-cert", &cert, "--tls-key", &key])
            .env_remove("TURNSTILE_AUTH_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start turnstile serve");
        let pid = child.id() as i32;
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        let out = rx.recv_timeout(WAIT).unwrap_or_else(|_| {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("serve with the {name} pair started and ran")
        });
        (cert, out.expect("serve's output"))
    };
    let (cert, out) = serve("old");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains(&cert) && said.contains("expired on 2020-02-01"),
        "{said}"
    );
    let (cert, out) = serve("future");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let said = text(&out.stderr);
    assert!(
        said.contains(&cert) && said.contains("not valid before 2060-01-01"),
        "{said}"
    );

    // make_pair's certificates live two days: within the warning's 14.
    make_pair(&dir, "a");
    let (cert, key) = (path(&dir, "cert.pem"), path(&dir, "key.pem"));
    std::fs::copy(dir.join("a-cert.pem"), &cert).expect("copy");
    std::fs::copy(dir.join("a-key.pem"), &key).expect("copy");
    let ca = path(&dir, "a-ca.pem");
    let gw = Gw::start(&cert, &key);
    let (warn, _) = gw.log_until(&["certificate expires on"]);
    assert!(warn.contains("WARN") && warn.contains(&cert), "{warn}");
    let (code, body) = https_get(gw.http(), &ca, "/status");
    assert_eq!(code, 200);
    let status: Value = serde_json::from_str(&body).expect("status json");
    let not_after = status["frontend"]["tls_cert_not_after_unix_s"]
        .as_i64()
        .unwrap_or_else(|| panic!("no notAfter in {status}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!(
        now < not_after && not_after <= now + 3 * 86_400,
        "{not_after}"
    );
    let (code, metrics) = https_get(gw.http(), &ca, "/metrics");
    assert_eq!(code, 200);
    let gauge = "turnstile_tls_cert_expiry_seconds";
    assert!(
        metrics.lines().any(|l| l == format!("{gauge} {not_after}")),
        "{metrics}"
    );
    let alerts =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib/alerts.yml"))
            .expect("alerts");
    assert!(alerts.contains(gauge), "no alert rule reads {gauge}");

    // An expired pair on SIGHUP: refused, and the one in force still served.
    std::fs::copy(dir.join("old-cert.pem"), &cert).expect("copy");
    std::fs::copy(dir.join("old-key.pem"), &key).expect("copy");
    gw.signal(libc::SIGHUP);
    let (refused, _) = gw.log_until(&["reload refused"]);
    assert!(
        refused.contains("ERROR") && refused.contains("expired on 2020-02-01"),
        "{refused}"
    );
    assert!(connect_tls(&gw.addr, &ca).is_ok());
    assert_eq!(https_get(gw.http(), &ca, "/healthz").0, 200);
}

/// Without `--auth-token` (loopback), connections that never send a ClientHello cannot keep
/// a TLS bridge out: they fill `--max-connections`, and the handshake deadline (the hello
/// deadline, applied to an unfinished handshake with or without a token) closes them, so a
/// bridge that retries gets in within that deadline (1 s here, the sweep's 0.1 s on top).
#[test]
fn silent_connections_without_a_token_are_closed_at_the_handshake_deadline() {
    let dir = temp_dir("no-token-deadline");
    make_pair(&dir, "a");
    let ca = path(&dir, "a-ca.pem");
    let gw = Gw::start_with(
        &path(&dir, "a-cert.pem"),
        &path(&dir, "a-key.pem"),
        &["--max-connections", "20", "--hello-timeout", "1"],
    );
    // Held open for the whole test, never a byte sent.
    let silent: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(&gw.addr).expect("connect"))
        .collect();
    let started = std::time::Instant::now();
    eventually("the cap filled", WAIT, || {
        let (_, body) = https_get(gw.http(), &ca, "/status");
        let status: Value = serde_json::from_str(&body).expect("status json");
        holds(status, |s| s["frontend"]["connections"] == 20)
    });
    let full = started.elapsed();
    // A bridge that retries until it gets in.
    let mut tls = eventually("a TLS bridge got in", WAIT, || connect_tls(&gw.addr, &ca));
    let pong = exchange(
        &mut tls,
        &[
            json!({"op": "hello", "platform": "cli"}),
            json!({"op": "ping"}),
        ],
        |v| v["op"] == "pong",
    );
    assert_eq!(pong["op"], "pong");
    let admitted = started.elapsed();
    assert!(
        admitted < full + Duration::from_secs(5),
        "admitted after {admitted:?} (the cap full at {full:?})"
    );
    gw.log_until(&["did not finish their TLS handshake within 1s"]);
    drop(silent);
}

/// A plain TCP connection to `addr` from the local address `from` (any of 127.0.0.0/8).
fn connect_from(from: [u8; 4], addr: &str) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let to: std::net::SocketAddr = addr.parse().expect("an address");
    let sock = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    sock.bind(&std::net::SocketAddr::from((from, 0)).into())?;
    sock.connect(&to.into())?;
    Ok(sock.into())
}

/// Issue 33 row 1: sixteen addresses in sixteen /24s each hold as many connections waiting
/// for their hello as their prefix may (32: 512 in all, over the global 256) and re-open
/// every one that is closed, as fast as they notice. The bound: a bridge from another
/// address gets in on its first connection, every one of 8 times (each within `WAIT`),
/// because at the cap the oldest waiting connection of the largest prefix is closed for the
/// newcomer; the lines about refusals and evictions stay within their budget (10 at once,
/// then 1 a second), each later one telling how many were suppressed.
#[test]
fn a_spread_out_flood_of_silent_connections_cannot_lock_a_bridge_out() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let dir = temp_dir("spread-flood");
    make_pair(&dir, "a");
    let ca = path(&dir, "a-ca.pem");
    let gw = Gw::start_with(
        &path(&dir, "a-cert.pem"),
        &path(&dir, "a-key.pem"),
        // A hello deadline longer than the test: only eviction frees a slot.
        &["--auth-token", "t", "--hello-timeout", "120"],
    );
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let attackers: Vec<_> = (1..=16u8)
        .map(|i| {
            let (stop, opened, addr) = (stop.clone(), opened.clone(), gw.addr.clone());
            std::thread::spawn(move || {
                let mut held: Vec<TcpStream> = Vec::new();
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    // Drop what the gateway closed, then re-open up to the prefix's cap.
                    held.retain_mut(|s| {
                        matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                    });
                    while held.len() < 32 {
                        let Ok(s) = connect_from([127, i, 0, 1], &addr) else {
                            break;
                        };
                        s.set_nonblocking(true).expect("nonblocking");
                        held.push(s);
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    // Pacing only (a scan of 32 sockets), not ordering: the flood goes on.
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        })
        .collect();
    // The flood fills the cap before the first bridge tries.
    let started = std::time::Instant::now();
    eventually("the flood filled the cap", WAIT, || {
        let (_, body) = https_get_with(gw.http(), &ca, "/status", "Authorization: Bearer t\r\n");
        let status: Value = serde_json::from_str(&body).expect("status json");
        holds(status, |s| s["frontend"]["unauthenticated"] == 256)
    });
    let flood_start = opened.load(Ordering::Relaxed);
    let mut slowest = Duration::ZERO;
    for attempt in 0..8 {
        let t = std::time::Instant::now();
        let mut sock = connect_from([127, 250, 0, 1], &gw.addr).expect("connect");
        sock.set_read_timeout(Some(WAIT)).expect("timeout");
        let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
        let mut conn = rustls::ClientConnection::new(client_config(&ca), name).expect("client");
        while conn.is_handshaking() {
            if let Err(e) = conn.complete_io(&mut sock) {
                panic!("attempt {attempt}: the bridge's handshake failed: {e}");
            }
        }
        let mut tls = rustls::StreamOwned::new(conn, sock);
        let hello = json!({"op": "hello", "platform": "cli", "token": "t"});
        let pong = exchange(&mut tls, &[hello, json!({"op": "ping"})], |v| {
            v["op"] == "pong" || v["op"] == "error"
        });
        assert_eq!(pong["op"], "pong", "attempt {attempt}: {pong}");
        slowest = slowest.max(t.elapsed());
    }
    // The limiter tells how many it suppressed in its next line, a second after its burst:
    // the flood goes on until that line came (8 bridges in within the burst's second, on a
    // quiet machine, saw only the burst).
    let (told, mut lines) = gw.log().until(&["more suppressed)"]);
    lines.push(told);
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        a.join().expect("attacker");
    }
    let reopened = opened.load(Ordering::Relaxed) - flood_start;
    eprintln!("8 of 8 bridges in, slowest {slowest:?}; the flood re-opened {reopened} connections");
    assert!(reopened > 8, "the flood was not re-opening ({reopened})");
    lines.extend(gw.log().taken_now());
    let about = |l: &&String| l.contains("refused connection") || l.contains("(no hello yet)");
    let refusals: Vec<&String> = lines.iter().filter(about).collect();
    let budget = 10 + elapsed.as_secs() as usize + 2;
    assert!(
        refusals.len() <= budget,
        "{} refusal lines in {elapsed:?} (budget {budget}); first: {:#?}",
        refusals.len(),
        refusals.iter().take(5).collect::<Vec<_>>()
    );
    assert!(
        refusals.iter().any(|l| l.contains("more suppressed)")),
        "no line told of suppressed ones: {refusals:#?}"
    );
    assert!(
        lines.len() <= budget + 50,
        "{} log lines in all",
        lines.len()
    );
}
