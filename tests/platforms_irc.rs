//! `turnstile bridge irc` end to end against a real IRC server: ngircd (Debian's `ngircd`),
//! started by the test with its own config on a free local port, the real `turnstile serve`
//! with an exec agent, the real bridge, and a "human" speaking raw IRC over TCP.
//!
//! Without ngircd installed the tests say so and pass, except under `.ci/run`, which sets
//! `TURNSTILE_REQUIRE_REAL_SERVERS=1`: there a missing server fails them.
//!
//! Nothing sleeps to order events: every wait is a read with a deadline (bounded polling only
//! for ngircd's port to open).

mod child_support;
mod common;
use child_support::{Proc, die_with_parent};
use common::{eventually, holds};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded};
use serde_json::{Value, json};

/// Only a failing run waits this long.
const WAIT: Duration = Duration::from_secs(60);

/// The agent's long reply: multi-byte words (2-, 3- and 4-byte UTF-8) in one paragraph,
/// about 6 KB, so it needs many IRC lines.
fn long_reply() -> String {
    let words = [
        "héllo",
        "wörld",
        "日本語",
        "テキスト",
        "🎉",
        "naïve",
        "κόσμε",
        "Ünïcödé",
        "🦀rust",
        "ok",
    ];
    (0..600)
        .map(|i| words[i % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn ngircd_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join("ngircd"))
        .find(|p| p.is_file())
}

/// ngircd, or `None` (after saying why) when the test may skip.
fn require_ngircd() -> Option<PathBuf> {
    match ngircd_path() {
        Some(p) => Some(p),
        None if std::env::var("TURNSTILE_REQUIRE_REAL_SERVERS").as_deref() == Ok("1") => {
            panic!(
                "ngircd is not installed but TURNSTILE_REQUIRE_REAL_SERVERS=1 (.ci/run installs it: apt-get install -y ngircd)"
            )
        }
        None => {
            // Straight to stderr, past the test harness's capture, so the skip is seen.
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: ngircd is not installed (apt-get install -y ngircd); this IRC test needs a real server"
            );
            None
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Lines of a child's stdout, on a channel (the first one is the `ready:`/`listening` line).
fn stdout_lines(child: &mut Child) -> Receiver<String> {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = bounded(64);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

struct Setup {
    _dir: tempfile::TempDir,
    _ircd: Proc,
    irc_port: u16,
    serve: Option<Proc>,
    gateway: String,
}

impl Setup {
    fn start(ngircd: &Path) -> Setup {
        Setup::start_with(ngircd, None)
    }

    /// With `tls`, ngircd also listens with TLS on that port, its certificate (for
    /// `localhost`) signed by the test CA in `ca.pem`.
    fn start_with(ngircd: &Path, tls: Option<u16>) -> Setup {
        Setup::start_opts(ngircd, tls, None)
    }

    /// With `password`, ngircd asks every client for it (`PASS`).
    fn start_opts(ngircd: &Path, tls: Option<u16>, password: Option<&str>) -> Setup {
        let dir = tempfile::tempdir().expect("tempdir");
        let irc_port = free_port();
        let conf = dir.path().join("ngircd.conf");
        let mut text = format!(
            "[Global]\nName = irc.turnstile.test\nInfo = turnstile test server\n\
             Listen = 127.0.0.1\nPorts = {irc_port}\nPidFile = {pid}\nMotdPhrase = test\n\
             [Limits]\nMaxNickLength = 30\nPingTimeout = 120\nPongTimeout = 20\n\
             [Options]\nPAM = no\nDNS = no\nIdent = no\n",
            pid = dir.path().join("ngircd.pid").display()
        );
        if let Some(pw) = password {
            text = text.replacen("[Limits]", &format!("Password = {pw}\n[Limits]"), 1);
        }
        if let Some(port) = tls {
            make_certificates(dir.path());
            text.push_str(&format!(
                "[SSL]\nCertFile = {}\nKeyFile = {}\nPorts = {port}\n",
                dir.path().join("cert.pem").display(),
                dir.path().join("key.pem").display()
            ));
        }
        std::fs::write(&conf, text).expect("write conf");
        let ircd = Proc(
            die_with_parent(
                Command::new(ngircd)
                    .arg("-n")
                    .arg("-f")
                    .arg(&conf)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .spawn()
            .expect("start ngircd"),
        );
        // Bounded polling: ngircd tells nobody when it listens.
        for port in std::iter::once(irc_port).chain(tls) {
            eventually(&format!("ngircd opens port {port}"), WAIT, || {
                TcpStream::connect(("127.0.0.1", port)).is_ok()
            });
        }
        let reply = dir.path().join("reply.txt");
        std::fs::write(&reply, long_reply()).expect("reply");
        std::fs::write(dir.path().join("markdown.txt"), MARKDOWN).expect("markdown");
        let mut setup = Setup {
            _dir: dir,
            _ircd: ircd,
            irc_port,
            serve: None,
            gateway: String::new(),
        };
        setup.start_serve("127.0.0.1:0", &[]);
        setup
    }

    /// The exec agent: `slow` runs 30 s (after leaving a `started` file), `dm…` and `ping…`
    /// get short answers, `markdown` the [`MARKDOWN`] reply, anything else the long reply.
    fn agent_cmd(&self) -> String {
        let dir = self._dir.path();
        format!(
            "text=$(cat); case \"$text\" in slow*) touch '{started}'; exec sleep 30;; dm*) echo \"dm answer: $text\";; ping*) echo pong;; markdown*) cat '{markdown}';; *) cat '{reply}';; esac",
            started = dir.join("started").display(),
            markdown = dir.join("markdown.txt").display(),
            reply = dir.join("reply.txt").display()
        )
    }

    /// (Re)starts `turnstile serve` on `listen`; the gateway address is kept in `gateway`.
    fn start_serve(&mut self, listen: &str, extra: &[&str]) {
        self.serve = None;
        let agent = self.agent_cmd();
        let mut serve = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["serve", "--listen", listen, "--http-listen", "off"])
                .args(["--access-default", "open"])
                .args(["--agent", "exec", "--agent-cmd", &agent])
                .args(extra)
                .env("RUST_LOG", "warn")
                .env_remove("TURNSTILE_AUTH_TOKEN")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("start serve");
        let first = stdout_lines(&mut serve)
            .recv_timeout(WAIT)
            .expect("listening line");
        self.gateway = first
            .strip_prefix("listening on ")
            .expect("listening line")
            .to_owned();
        self.serve = Some(Proc(serve));
    }

    /// Starts `turnstile bridge irc` and waits for its `ready:` line.
    fn bridge(&self, nick: &str) -> (Proc, String) {
        let server = format!("127.0.0.1:{}", self.irc_port);
        self.bridge_with(nick, &["--server", &server])
    }

    /// Starts the bridge with these server flags.
    fn bridge_with(&self, nick: &str, server: &[&str]) -> (Proc, String) {
        self.bridge_env(nick, server, &[])
    }

    /// Starts the bridge with these server flags and environment variables.
    fn bridge_env(&self, nick: &str, server: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
        let mut child = die_with_parent(
            Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(["bridge", "irc", "--gateway", &self.gateway])
                .args(server)
                .args(["--nick", nick, "--channel", "#test"])
                // The default pacing (a burst of 5, then a line a second) is slower than
                // ngircd's own (about 0.4 s a line here), so the test sees the bridge's.
                .args(["--max-reply-lines", "100"])
                .env("RUST_LOG", "info")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit()),
        )
        .spawn()
        .expect("start the bridge");
        let lines = stdout_lines(&mut child);
        let ready = lines.recv_timeout(WAIT).expect("the bridge's ready line");
        (Proc(child), ready)
    }
}

/// A raw IRC client: the human in the channel.
struct Human {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Human {
    fn connect(port: u16, nick: &str, channel: Option<&str>) -> Human {
        Human::connect_as(port, nick, nick, channel)
    }

    /// With `user` as the USER name (the `user` of `nick!user@host`).
    fn connect_as(port: u16, nick: &str, user: &str, channel: Option<&str>) -> Human {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut h = Human {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        h.send(&format!("NICK {nick}"));
        h.send(&format!("USER {user} 0 * :test human"));
        h.until(|l| l.split(' ').nth(1) == Some("001"));
        if let Some(channel) = channel {
            h.send(&format!("JOIN {channel}"));
            // 366: end of the names list, the join is complete.
            h.until(|l| l.split(' ').nth(1) == Some("366"));
        }
        h
    }

    fn send(&mut self, line: &str) {
        write!(self.writer, "{line}\r\n").expect("write");
    }

    /// The next raw line, CRLF included, as bytes (so a broken UTF-8 sequence is seen).
    fn raw_line(&mut self) -> Vec<u8> {
        let mut buf = Vec::new();
        let n = self
            .reader
            .read_until(b'\n', &mut buf)
            .expect("a line before the timeout");
        assert!(n > 0, "the server closed the connection");
        buf
    }

    /// Reads until a line matches (answering PINGs); returns it without CRLF.
    fn until(&mut self, pred: impl Fn(&str) -> bool) -> String {
        loop {
            let raw = self.raw_line();
            let line = String::from_utf8(raw).expect("valid UTF-8");
            let line = line.trim_end_matches(['\r', '\n']).to_owned();
            if let Some(token) = line.strip_prefix("PING ") {
                self.send(&format!("PONG {token}"));
                continue;
            }
            if pred(&line) {
                return line;
            }
        }
    }

    /// The next PRIVMSG from `from` to `to`: (wire length with CRLF, its text).
    fn privmsg_from(&mut self, from: &str, to: &str) -> (usize, String) {
        loop {
            let raw = self.raw_line();
            let len = raw.len();
            let line = String::from_utf8(raw).expect("every wire line is valid UTF-8");
            let line = line.trim_end_matches(['\r', '\n']);
            if let Some(token) = line.strip_prefix("PING ") {
                self.send(&format!("PONG {token}"));
                continue;
            }
            let Some(rest) = line.strip_prefix(&format!(":{from}!")) else {
                continue;
            };
            let Some((_, after)) = rest.split_once(&format!(" PRIVMSG {to} :")) else {
                continue;
            };
            return (len, after.to_owned());
        }
    }
}

#[test]
fn a_long_multibyte_reply_arrives_split_within_512_bytes_and_stop_and_dms_are_answered() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let setup = Setup::start(&ngircd);
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    // Someone already has the bot's nick: the bridge must take an alternate.
    let _squatter = Human::connect(setup.irc_port, "turnbot", None);
    let (mut bridge, ready) = setup.bridge("turnbot");
    assert_eq!(ready, "ready: irc as turnbot_");
    let bot = "turnbot_";

    human.send(&format!("PRIVMSG #test :{bot}: tell me a long story"));
    let expected = format!("human: {}", long_reply());
    let mut lines = Vec::new();
    let mut arrivals = Vec::new();
    while lines.iter().map(|l: &String| l.len() + 1).sum::<usize>() < expected.len() {
        let (wire_len, text) = human.privmsg_from(bot, "#test");
        arrivals.push(Instant::now());
        assert!(wire_len <= 512, "a relayed line of {wire_len} bytes");
        lines.push(text);
    }
    assert!(lines.len() >= 10, "only {} lines", lines.len());
    assert_eq!(lines.join(" "), expected, "the reply reassembles exactly");
    // Paced: a burst of 5, then a line a second, so the last line cannot arrive sooner than
    // this after the first (a lower bound only: load can only slow it).
    let paced = Duration::from_secs(1) * (lines.len() as u32 - 5);
    let spread = arrivals[arrivals.len() - 1] - arrivals[0];
    assert!(
        spread >= paced.mul_f64(0.9),
        "{} lines in {spread:?}: not paced",
        lines.len()
    );

    // A running turn stopped with `!stop`: the stop is answered, then the turn's end.
    human.send(&format!("PRIVMSG #test :{bot}: slow one"));
    human.send(&format!("PRIVMSG #test :{bot}: !stop"));
    let (_, answer) = human.privmsg_from(bot, "#test");
    assert!(
        answer.starts_with("human: stop: cancelled the running turn"),
        "{answer}"
    );
    let (_, ended) = human.privmsg_from(bot, "#test");
    assert_eq!(ended, "human: [cancelled: stopped]");

    // A private message is a dm, answered privately without an address.
    human.send(&format!("PRIVMSG {bot} :dm hello"));
    let (_, dm) = human.privmsg_from(bot, "human");
    assert_eq!(dm, "dm answer: dm hello");

    bridge.signal(libc::SIGTERM);
    let status = bridge.wait_exit();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
}

/// A reply in Markdown, as a model writes one.
const MARKDOWN: &str = "**Bold** and `code`, [site](https://e.org) <b>raw</b>\n\n```rust\nlet a = 1;\n```\n\n1. one\n   - two";

/// Issue 36 row 4 (IRC): a Markdown reply arrives as plain text, the markup removed, a link
/// as `text <url>`, the raw HTML left as the text it is.
#[test]
fn a_markdown_reply_arrives_as_plain_text_without_its_markup() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let setup = Setup::start(&ngircd);
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    let (mut bridge, ready) = setup.bridge("mdbot");
    assert_eq!(ready, "ready: irc as mdbot");
    human.send("PRIVMSG #test :mdbot: markdown please");
    let lines: Vec<String> = (0..4)
        .map(|_| human.privmsg_from("mdbot", "#test").1)
        .collect();
    assert_eq!(
        lines,
        [
            "human: Bold and code, site <https://e.org> <b>raw</b>",
            "let a = 1;",
            "1. one",
            "  • two",
        ]
    );
    bridge.signal(libc::SIGTERM);
    assert!(bridge.wait_exit().success());
    // `--format plain`: the text exactly as the agent wrote it.
    let server = format!("127.0.0.1:{}", setup.irc_port);
    let (mut bridge, ready) =
        setup.bridge_with("rawbot", &["--server", &server, "--format", "plain"]);
    assert_eq!(ready, "ready: irc as rawbot");
    human.send("PRIVMSG #test :rawbot: markdown please");
    let first = human.privmsg_from("rawbot", "#test").1;
    assert_eq!(
        first,
        "human: **Bold** and `code`, [site](https://e.org) <b>raw</b>"
    );
    bridge.signal(libc::SIGTERM);
    assert!(bridge.wait_exit().success());
}

/// A bridge-protocol client straight to the gateway: the turn latency without IRC.
fn gateway_turn(addr: &str, id: &str) -> Duration {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut writer = stream.try_clone().expect("clone");
    let mut reader = BufReader::new(stream);
    writeln!(writer, "{}", json!({"op":"hello","platform":"direct"})).expect("hello");
    let started = Instant::now();
    writeln!(
        writer,
        "{}",
        json!({"op":"message","id":id,"chat_id":"bench","text":"ping"})
    )
    .expect("message");
    loop {
        let mut line = String::new();
        assert!(reader.read_line(&mut line).expect("line") > 0, "closed");
        let v: Value = serde_json::from_str(&line).expect("json");
        if v["op"] == "reply" && v["id"] == id {
            return started.elapsed();
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The figure the issue asks for: human's message → first bot line, beside the gateway's own
/// turn latency (median of 5 each). Printed; run with `--nocapture` to see it.
#[test]
fn irc_bridge_added_latency_is_measured() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let setup = Setup::start(&ngircd);
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    let (_bridge, ready) = setup.bridge("latbot");
    assert_eq!(ready, "ready: irc as latbot");
    let mut through_irc = Vec::new();
    let mut direct = Vec::new();
    for i in 0..5 {
        let started = Instant::now();
        human.send(&format!("PRIVMSG #test :latbot: ping {i}"));
        let (_, text) = human.privmsg_from("latbot", "#test");
        through_irc.push(started.elapsed());
        assert_eq!(text, "human: pong");
        direct.push(gateway_turn(&setup.gateway, &format!("direct-{i}")));
    }
    // ngircd's own share: the same two relays (human -> bot, bot -> human) between two raw
    // clients, the second answering at once.
    let mut echoer = Human::connect(setup.irc_port, "echoer", Some("#test"));
    let mut relay = Vec::new();
    for i in 0..5 {
        let started = Instant::now();
        human.send(&format!("PRIVMSG #test :echoer: ping {i}"));
        echoer.privmsg_from("human", "#test");
        echoer.send("PRIVMSG #test :human: pong");
        human.privmsg_from("echoer", "#test");
        relay.push(started.elapsed());
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (irc, gw, relay) = (median(through_irc), median(direct), median(relay));
    println!(
        "latency (median of 5): human -> first bot line through IRC {:.1} ms; gateway turn alone {:.1} ms; ngircd's two relays alone {:.1} ms; so the bridge adds {:.1} ms",
        ms(irc),
        ms(gw),
        ms(relay),
        ms(irc) - ms(gw) - ms(relay)
    );
}

/// Bounded polling for a file another process creates.
fn wait_for_file(path: &Path) {
    eventually(&format!("{} appears", path.display()), WAIT, || {
        path.exists()
    });
}

#[test]
fn the_bridge_reconnects_to_a_restarted_gateway_and_shows_its_owed_result_once() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let mut setup = Setup::start(&ngircd);
    let data = setup._dir.path().join("data");
    let data = data.to_str().expect("a UTF-8 temp path").to_owned();
    let listen = format!("127.0.0.1:{}", free_port());
    setup.start_serve(&listen, &["--data-dir", &data]);
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    let (_bridge, ready) = setup.bridge("rebot");
    assert_eq!(ready, "ready: irc as rebot");

    human.send("PRIVMSG #test :rebot: slow");
    wait_for_file(&setup._dir.path().join("started"));
    // The gateway is killed mid-turn (SIGKILL, no goodbye) and started again on its journal:
    // the bridge reconnects by itself and gets the result it is owed.
    setup.start_serve(&listen, &["--data-dir", &data]);
    let (_, owed) = human.privmsg_from("rebot", "#test");
    assert_eq!(owed, "human: [failed: interrupted by restart]");
    // Answered normally afterwards, and the owed result was not shown a second time.
    human.send("PRIVMSG #test :rebot: ping");
    let (_, next) = human.privmsg_from("rebot", "#test");
    assert_eq!(next, "human: pong");
}

/// Issue 32: a nick is anyone's to take, so the access policy matches the sender's whole
/// `nick!user@host` mask (the bridge sends it as `meta.mask`): with `allow` naming the user
/// part, the real alice is answered and an impostor who took her nick is refused.
#[test]
fn an_allowlist_on_the_mask_answers_alice_and_refuses_an_impostor_with_her_nick() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let mut setup = Setup::start(&ngircd);
    let config = setup._dir.path().join("access.toml");
    std::fs::write(
        &config,
        "[access.irc]\nmode = \"allowlist\"\nallow = [\"alice!*alice@*\"]\n",
    )
    .expect("config");
    setup.start_serve(
        "127.0.0.1:0",
        &["--config", config.to_str().expect("utf-8")],
    );
    let mut alice = Human::connect_as(setup.irc_port, "alice", "alice", Some("#test"));
    let (_bridge, ready) = setup.bridge("gatebot");
    assert_eq!(ready, "ready: irc as gatebot");
    alice.send("PRIVMSG #test :gatebot: ping");
    let (_, answer) = alice.privmsg_from("gatebot", "#test");
    assert_eq!(answer, "alice: pong");
    alice.send("QUIT :bye");
    // The server's goodbye: the nick is released once it has answered the QUIT.
    alice.until(|l| l.starts_with("ERROR"));
    drop(alice);
    // The nick is free again; someone else takes it.
    let mut impostor = Human::connect_as(setup.irc_port, "alice", "mallory", Some("#test"));
    impostor.send("PRIVMSG #test :gatebot: ping");
    let (_, refused) = impostor.privmsg_from("gatebot", "#test");
    assert!(
        refused.starts_with("alice: This bot is private"),
        "{refused}"
    );
}

/// A test CA and a `localhost` certificate it signed (EC keys: quick to make), with openssl.
fn make_certificates(dir: &Path) {
    let run = |args: &[&str]| {
        common::run_ok(
            Command::new("openssl").args(args).current_dir(dir),
            &format!("openssl {args:?}"),
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    run(&[
        &["req", "-x509"][..],
        &ec,
        &[
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=turnstile test CA",
        ],
    ]
    .concat());
    run(&[
        &["req"][..],
        &ec,
        &[
            "-keyout",
            "key.pem",
            "-out",
            "leaf.csr",
            "-subj",
            "/CN=localhost",
        ],
    ]
    .concat());
    std::fs::write(
        dir.join("leaf.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .expect("ext file");
    run(&[
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "cert.pem",
        "-days",
        "2",
        "-extfile",
        "leaf.ext",
    ]);
}

#[test]
fn with_tls_the_bridge_verifies_the_server_and_is_answered() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let tls_port = free_port();
    let setup = Setup::start_with(&ngircd, Some(tls_port));
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    let ca = setup._dir.path().join("ca.pem");
    let ca = ca.to_str().expect("a UTF-8 temp path");
    let server = format!("localhost:{tls_port}");
    let (_bridge, ready) = setup.bridge_with(
        "tlsbot",
        &["--server", &server, "--tls", "--tls-ca-file", ca],
    );
    assert_eq!(ready, "ready: irc as tlsbot");
    human.send("PRIVMSG #test :tlsbot: ping");
    let (_, text) = human.privmsg_from("tlsbot", "#test");
    assert_eq!(text, "human: pong");

    // Without the test CA the certificate is refused: no connection, a clear WARN.
    let log = setup._dir.path().join("untrusting.log");
    let mut child = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["bridge", "irc", "--gateway", &setup.gateway])
            .args(["--server", &server, "--tls", "--nick", "untrusting"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log")),
    )
    .spawn()
    .expect("start the bridge");
    let stdout = stdout_lines(&mut child);
    let _child = Proc(child);
    eventually("the TLS refusal logged", WAIT, || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        holds(text, |t| {
            t.contains("TLS handshake with") && t.contains("certificate")
        })
    });
    assert!(
        stdout.try_recv().is_err(),
        "an unverified server must not make it ready"
    );
}

/// Issue 30 row 13: ngircd configured with a server password (`[Global] Password`) refuses a
/// client without `PASS`; the bridge, given the password in a variable
/// (`--server-password-env`, never a flag), registers, joins and is answered. On main
/// f41b273 the flag did not exist (and the bridge sent no `PASS`).
#[test]
fn with_a_server_password_the_bridge_logs_in_to_ngircd() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let setup = Setup::start_opts(&ngircd, None, Some("hunter2-server-pw"));
    let server = format!("127.0.0.1:{}", setup.irc_port);
    let (_bridge, ready) = setup.bridge_env(
        "pwbot",
        &[
            "--server",
            &server,
            "--server-password-env",
            "IRC_TEST_SERVER_PW",
        ],
        &[("IRC_TEST_SERVER_PW", "hunter2-server-pw")],
    );
    assert_eq!(ready, "ready: irc as pwbot");
    // Without the password ngircd refuses a client.
    let stream = TcpStream::connect(("127.0.0.1", setup.irc_port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut stranger = Human {
        reader: BufReader::new(stream.try_clone().expect("clone")),
        writer: stream,
    };
    stranger.send("NICK eve");
    stranger.send("USER eve 0 * :no password");
    let refused = stranger.until(|l| l.starts_with("ERROR") || l.split(' ').nth(1) == Some("001"));
    assert!(refused.starts_with("ERROR"), "{refused}");
    // A human with the password too: the bot answers a private message.
    let stream = TcpStream::connect(("127.0.0.1", setup.irc_port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut human = Human {
        reader: BufReader::new(stream.try_clone().expect("clone")),
        writer: stream,
    };
    human.send("PASS hunter2-server-pw");
    human.send("NICK ann");
    human.send("USER ann 0 * :test human");
    human.until(|l| l.split(' ').nth(1) == Some("001"));
    human.send("PRIVMSG pwbot :dm hello");
    let answer = human.until(|l| l.contains("PRIVMSG ann :"));
    assert!(answer.contains("dm answer: dm hello"), "{answer}");
}

/// Issue 30 row 4, fair output: a long reply in `#test` is being paced out (a line every
/// 2 s) when the same human's private message is answered. The bridge's outbox is one queue
/// per target served in turn, so the one-line DM answer goes out within one pacing
/// interval: among the first lines after the long reply's first, not behind all of it. Both
/// targets' lines reach the one human's socket, so their order is the server's. On main
/// f41b273 one FIFO held the DM answer behind the whole reply (23.5 s measured with the
/// default pacing).
#[test]
fn a_one_line_answer_to_another_target_is_not_held_behind_a_long_reply() {
    let Some(ngircd) = require_ngircd() else {
        return;
    };
    let setup = Setup::start(&ngircd);
    let mut human = Human::connect(setup.irc_port, "human", Some("#test"));
    let server = format!("127.0.0.1:{}", setup.irc_port);
    let pacing = ["--flood-burst", "1", "--flood-interval", "2"];
    let (mut bridge, ready) = setup.bridge_with(
        "fairbot",
        &[&["--server", server.as_str()][..], &pacing].concat(),
    );
    assert_eq!(ready, "ready: irc as fairbot");
    human.send("PRIVMSG #test :fairbot: tell me a long story");
    let (_, first) = human.privmsg_from("fairbot", "#test");
    assert!(first.starts_with("human: "), "{first}");
    // The reply is being paced out; now a DM with a one-line answer.
    human.send("PRIVMSG fairbot :dm quick");
    let mut channel_lines_before = 0;
    loop {
        let line = human.until(|l| l.starts_with(":fairbot!") && l.contains(" PRIVMSG "));
        if line.contains(" PRIVMSG human :") {
            assert!(line.ends_with(":dm answer: dm quick"), "{line}");
            break;
        }
        channel_lines_before += 1;
    }
    eprintln!("channel lines between the first and the DM answer: {channel_lines_before}");
    // One pacing interval is one line; the agent's own time may let another pass.
    assert!(
        channel_lines_before <= 2,
        "the DM answer waited behind {channel_lines_before} lines of the other reply"
    );
    bridge.signal(libc::SIGTERM);
    let status = bridge.wait_exit();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
}
