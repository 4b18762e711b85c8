//! A real Synapse for the Matrix bridge tests: a homeserver.yaml generated in a temp dir
//! (SQLite, a free port on 127.0.0.1, no federation, a registration shared secret,
//! `bcrypt_rounds: 4`, Synapse's **default rate limits**), started once per test binary, and
//! a small Client-Server client for the test's users.
//!
//! Synapse comes from the venv `.ci/synapse.sh` makes (`$TURNSTILE_SYNAPSE_VENV`, default
//! `target/synapse-venv`). Missing: [`synapse`] returns `None` after printing why, or panics
//! when `TURNSTILE_REQUIRE_REAL_SERVERS=1` (as `.ci/run` sets).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use serde_json::{Value, json};

use crate::common::eventually;

/// Only a failing run waits this long.
pub const WAIT: Duration = Duration::from_secs(60);

pub struct Synapse {
    pub base: String,
    python: PathBuf,
    secret: String,
    admin: String,
    _dir: tempfile::TempDir,
}

pub fn venv() -> PathBuf {
    std::env::var_os("TURNSTILE_SYNAPSE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/synapse-venv"))
        })
}

/// The shared Synapse, started on first use; `None` (after saying why) when it is not
/// installed and the test may skip.
pub fn synapse() -> Option<&'static Synapse> {
    static SYNAPSE: OnceLock<Option<Synapse>> = OnceLock::new();
    SYNAPSE
        .get_or_init(|| {
            let python = venv().join("bin/python");
            let installed = python.is_file()
                && Command::new(&python)
                    .args(["-c", "import synapse"])
                    .status()
                    .is_ok_and(|s| s.success());
            if !installed {
                if std::env::var("TURNSTILE_REQUIRE_REAL_SERVERS").as_deref() == Ok("1") {
                    panic!(
                        "Synapse is not installed in {} but TURNSTILE_REQUIRE_REAL_SERVERS=1 (.ci/run installs it with .ci/synapse.sh)",
                        venv().display()
                    );
                }
                eprintln!(
                    "SKIPPED: Synapse is not installed in {} (run .ci/synapse.sh, or set TURNSTILE_SYNAPSE_VENV); this Matrix test needs a real homeserver",
                    venv().display()
                );
                return None;
            }
            Some(start(python))
        })
        .as_ref()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn start(python: PathBuf) -> Synapse {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().display().to_string();
    let port = free_port();
    let secret = format!("secret-{}", std::process::id());
    let config = format!(
        r#"server_name: "localhost"
pid_file: {d}/homeserver.pid
listeners:
  - port: {port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: {d}/homeserver.db
log_config: {d}/log.yaml
media_store_path: {d}/media
signing_key_path: {d}/signing.key
registration_shared_secret: "{secret}"
report_stats: false
bcrypt_rounds: 4
trusted_key_servers: []
suppress_key_server_warning: true
federation_domain_whitelist: []
macaroon_secret_key: "macaroon-{secret}"
form_secret: "form-{secret}"
enable_metrics: false
"#
    );
    let log = format!(
        r#"version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(levelname)s - %(message)s'
handlers:
  file:
    class: logging.FileHandler
    filename: {d}/synapse.log
    formatter: precise
root:
  level: WARNING
  handlers: [file]
disable_existing_loggers: false
"#
    );
    std::fs::write(dir.path().join("homeserver.yaml"), config).expect("write config");
    std::fs::write(dir.path().join("log.yaml"), log).expect("write log config");
    let cfg = dir.path().join("homeserver.yaml");
    crate::common::run_ok(
        Command::new(&python)
            .args(["-m", "synapse.app.homeserver", "--config-path"])
            .arg(&cfg)
            .arg("--generate-keys"),
        "synapse --generate-keys",
    );
    // The process must outlive every test of the binary and die with it: it is started by a
    // thread that never ends (PR_SET_PDEATHSIG fires when the starting thread exits).
    let (tx, rx) = crossbeam_channel::bounded(1);
    let py = python.clone();
    let cfg2 = cfg.clone();
    let out = dir.path().join("stdout.log");
    std::thread::spawn(move || {
        let mut command = Command::new(&py);
        command
            .args(["-m", "synapse.app.homeserver", "--config-path"])
            .arg(&cfg2)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("log file"))
            .stderr(Stdio::inherit());
        // SAFETY: prctl(2) only, async-signal-safe, between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start synapse");
        let _ = tx.send(child.id());
        let _keep = child;
        loop {
            std::thread::park();
        }
    });
    rx.recv().expect("synapse started");
    let base = format!("http://127.0.0.1:{port}");
    // Bounded polling of the real server until it listens.
    eventually(
        &format!("Synapse listens (see {}/synapse.log)", dir.path().display()),
        WAIT,
        || {
            http(
                "GET",
                &format!("{base}/_matrix/client/versions"),
                None,
                None,
            )
        },
    );
    eprintln!("synapse up at {base} after {:?}", started.elapsed());
    let mut s = Synapse {
        base,
        python,
        secret,
        admin: String::new(),
        _dir: dir,
    };
    s.admin = s.register_raw("admin", true).1;
    s
}

/// One HTTP request; the JSON answer, or the status and body of an error.
pub fn http(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<Value, (u16, String)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(90)))
        .build()
        .into();
    let mut b = ureq::http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        b = b.header("Authorization", format!("Bearer {t}"));
    }
    let response = match body {
        Some(v) => agent.run(
            b.header("Content-Type", "application/json")
                .body(v.to_string())
                .expect("request"),
        ),
        None => agent.run(b.body(()).expect("request")),
    };
    let mut response = response.map_err(|e| (0, e.to_string()))?;
    let status = response.status().as_u16();
    let mut text = String::new();
    response
        .body_mut()
        .as_reader()
        .read_to_string(&mut text)
        .map_err(|e| (status, e.to_string()))?;
    if (200..300).contains(&status) {
        serde_json::from_str(&text).map_err(|e| (status, format!("{e}: {text}")))
    } else {
        Err((status, text))
    }
}

pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

static USER_SEQ: AtomicU64 = AtomicU64::new(0);

impl Synapse {
    fn hmac_sha1(&self, msg: &[u8]) -> String {
        let mut child = Command::new(&self.python)
            .args([
                "-c",
                "import hmac,hashlib,sys; print(hmac.new(sys.argv[1].encode(), sys.stdin.buffer.read(), hashlib.sha1).hexdigest())",
                &self.secret,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(msg)
            .expect("write");
        let out = child.wait_with_output().expect("hmac");
        String::from_utf8(out.stdout)
            .expect("utf8")
            .trim()
            .to_owned()
    }

    fn register_raw(&self, name: &str, admin: bool) -> (String, String) {
        let url = format!("{}/_synapse/admin/v1/register", self.base);
        let nonce = http("GET", &url, None, None).expect("nonce")["nonce"]
            .as_str()
            .expect("nonce")
            .to_owned();
        let password = "pw-not-used";
        let mut msg = Vec::new();
        for part in [
            nonce.as_str(),
            name,
            password,
            if admin { "admin" } else { "notadmin" },
        ] {
            if !msg.is_empty() {
                msg.push(0);
            }
            msg.extend_from_slice(part.as_bytes());
        }
        let mac = self.hmac_sha1(&msg);
        let v = http(
            "POST",
            &url,
            None,
            Some(&json!({"nonce": nonce, "username": name, "password": password, "admin": admin, "mac": mac})),
        )
        .expect("register");
        (
            v["user_id"].as_str().expect("user_id").to_owned(),
            v["access_token"].as_str().expect("token").to_owned(),
        )
    }

    /// A new user (a unique name from `prefix`), with a display name.
    pub fn register(&self, prefix: &str, display: &str) -> User {
        let n = USER_SEQ.fetch_add(1, Ordering::SeqCst);
        let name = format!("{prefix}{}x{n}", std::process::id());
        let (mxid, token) = self.register_raw(&name, false);
        let user = User {
            base: self.base.clone(),
            mxid,
            token,
        };
        user.call(
            "PUT",
            &format!("/profile/{}/displayname", enc(&user.mxid)),
            Some(&json!({"displayname": display})),
        )
        .expect("display name");
        user
    }

    /// Lifts the message rate limit of `user` (the tests about streaming; the rate-limit
    /// test keeps Synapse's defaults).
    pub fn unlimit(&self, user: &User) {
        http(
            "POST",
            &format!(
                "{}/_synapse/admin/v1/users/{}/override_ratelimit",
                self.base,
                enc(&user.mxid)
            ),
            Some(&self.admin),
            Some(&json!({"messages_per_second": 0, "burst_count": 0})),
        )
        .expect("override ratelimit");
    }
}

pub struct User {
    pub base: String,
    pub mxid: String,
    pub token: String,
}

static TXN: AtomicU64 = AtomicU64::new(0);

impl User {
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, (u16, String)> {
        http(
            method,
            &format!("{}/_matrix/client/v3{path}", self.base),
            Some(&self.token),
            body,
        )
    }

    /// Creates a private room inviting `invite`.
    pub fn create_room(&self, invite: &[&str]) -> String {
        let v = self
            .call(
                "POST",
                "/createRoom",
                Some(&json!({"preset": "private_chat", "invite": invite})),
            )
            .expect("createRoom");
        v["room_id"].as_str().expect("room_id").to_owned()
    }

    /// Sends a text message; its event id.
    pub fn say(&self, room: &str, text: &str) -> String {
        let txn = format!(
            "t{}-{}",
            std::process::id(),
            TXN.fetch_add(1, Ordering::SeqCst)
        );
        let v = self
            .call(
                "PUT",
                &format!("/rooms/{}/send/m.room.message/{txn}", enc(room)),
                Some(&json!({"msgtype": "m.text", "body": text})),
            )
            .expect("send");
        v["event_id"].as_str().expect("event_id").to_owned()
    }

    /// Follows `room` with /sync from now on: timeline and typing events, each stamped with
    /// the instant it arrived.
    pub fn watch(&self, room: &str) -> Watcher {
        let first = self
            .call("GET", "/sync?timeout=0", None)
            .expect("first sync");
        let mut since = first["next_batch"].as_str().expect("next_batch").to_owned();
        let (tx, rx): (Sender<Seen>, Receiver<Seen>) = unbounded();
        let base = self.base.clone();
        let token = self.token.clone();
        let room = room.to_owned();
        std::thread::spawn(move || {
            let filter = enc(
                &json!({"room": {"rooms": [room.clone()], "timeline": {"limit": 200}}}).to_string(),
            );
            loop {
                let url = format!(
                    "{base}/_matrix/client/v3/sync?timeout=10000&filter={filter}&since={}",
                    enc(&since)
                );
                let Ok(v) = http("GET", &url, Some(&token), None) else {
                    return;
                };
                let at = Instant::now();
                if let Some(next) = v["next_batch"].as_str() {
                    since = next.to_owned();
                }
                let r = &v["rooms"]["join"][&room];
                for ev in r["timeline"]["events"].as_array().into_iter().flatten() {
                    if tx.send(Seen::Event(ev.clone(), at)).is_err() {
                        return;
                    }
                }
                for ev in r["ephemeral"]["events"].as_array().into_iter().flatten() {
                    if ev["type"] == "m.typing" {
                        let users = ev["content"]["user_ids"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|u| u.as_str().map(str::to_owned))
                            .collect();
                        if tx.send(Seen::Typing(users, at)).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Watcher {
            rx,
            log: Vec::new(),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Seen {
    Event(Value, Instant),
    Typing(Vec<String>, Instant),
}

/// What the human saw, in order, and a way to wait for more.
pub struct Watcher {
    rx: Receiver<Seen>,
    pub log: Vec<Seen>,
}

impl Watcher {
    /// Waits (bounded) until something seen matches; returns its index in `log`.
    pub fn until(&mut self, what: &str, mut pred: impl FnMut(&Seen) -> bool) -> usize {
        if let Some(i) = self.log.iter().position(&mut pred) {
            return i;
        }
        let deadline = Instant::now() + WAIT;
        loop {
            match self.rx.recv_deadline(deadline) {
                Ok(s) => {
                    self.log.push(s);
                    if pred(self.log.last().expect("just pushed")) {
                        return self.log.len() - 1;
                    }
                }
                Err(_) => panic!(
                    "never saw {what} within {WAIT:?}; saw:\n{}",
                    self.transcript()
                ),
            }
        }
    }

    /// Like [`until`](Self::until), looking only at events after index `after`.
    pub fn until_after(
        &mut self,
        after: usize,
        what: &str,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> usize {
        let mut i = after;
        // Scan forward from `after`, waiting for more as needed.
        loop {
            while i + 1 < self.log.len() {
                i += 1;
                if let Seen::Event(ev, _) = &self.log[i]
                    && pred(ev)
                {
                    return i;
                }
            }
            let deadline = Instant::now() + WAIT;
            match self.rx.recv_deadline(deadline) {
                Ok(s) => self.log.push(s),
                Err(_) => panic!(
                    "never saw {what} within {WAIT:?}; saw:\n{}",
                    self.transcript()
                ),
            }
        }
    }

    pub fn events(&self) -> impl Iterator<Item = (usize, &Value)> {
        self.log.iter().enumerate().filter_map(|(i, s)| match s {
            Seen::Event(v, _) => Some((i, v)),
            Seen::Typing(..) => None,
        })
    }

    pub fn at(&self, i: usize) -> Instant {
        match &self.log[i] {
            Seen::Event(_, at) | Seen::Typing(_, at) => *at,
        }
    }

    /// The room as the human saw it, one line per event.
    pub fn transcript(&self) -> String {
        let mut out = String::new();
        for s in &self.log {
            match s {
                Seen::Typing(users, _) => out.push_str(&format!("  (typing: {users:?})\n")),
                Seen::Event(ev, _) => {
                    let c = &ev["content"];
                    let sender = ev["sender"].as_str().unwrap_or("?");
                    let sender = sender.split(':').next().unwrap_or(sender);
                    let line = if ev["type"] == "m.room.message" {
                        let rel = &c["m.relates_to"];
                        if rel["rel_type"] == "m.replace" {
                            format!(
                                "{sender} edits: {:?}",
                                c["m.new_content"]["body"].as_str().unwrap_or("")
                            )
                        } else if rel["m.in_reply_to"].is_object() {
                            format!(
                                "{sender} replies ({}): {:?}",
                                c["msgtype"].as_str().unwrap_or(""),
                                c["body"].as_str().unwrap_or("")
                            )
                        } else {
                            format!("{sender}: {:?}", c["body"].as_str().unwrap_or(""))
                        }
                    } else if ev["type"] == "m.room.member" {
                        format!(
                            "{} {}",
                            ev["state_key"].as_str().unwrap_or("?"),
                            c["membership"].as_str().unwrap_or("?")
                        )
                    } else {
                        format!("({})", ev["type"].as_str().unwrap_or("?"))
                    };
                    out.push_str("  ");
                    out.push_str(&line);
                    out.push('\n');
                }
            }
        }
        out
    }
}

/// Whether `ev` is a message of `sender` replying to `event`.
pub fn replies_to(ev: &Value, sender: &str, event: &str) -> bool {
    ev["type"] == "m.room.message"
        && ev["sender"] == sender
        && ev["content"]["m.relates_to"]["m.in_reply_to"]["event_id"] == event
}

/// Whether `ev` is an edit of `original`; the edit's new text.
pub fn edit_of<'a>(ev: &'a Value, original: &str) -> Option<&'a str> {
    (ev["type"] == "m.room.message"
        && ev["content"]["m.relates_to"]["rel_type"] == "m.replace"
        && ev["content"]["m.relates_to"]["event_id"] == original)
        .then(|| ev["content"]["m.new_content"]["body"].as_str())
        .flatten()
}
