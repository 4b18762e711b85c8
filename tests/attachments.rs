//! Attachments through the real binary (issue 36): a bridge names files it put in the
//! gateway's spool, the exec agent reads them (`TURNSTILE_ATTACHMENTS`, the sha256 it
//! computes matching the entries'), their files leave the spool once the message's route
//! ended, a path outside the spool is refused `invalid`, and the files an earlier run left
//! are swept at start-up.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use common::eventually;
use common::gateway::Serve;

const WAIT: Duration = Duration::from_secs(60);

/// The exec agent: for each entry, its name, whether the sha256 of the file at its path is
/// the entry's, and the first line of the file.
const AGENT: &str = r#"python3 -c '
import hashlib, json, os
out = []
for a in json.loads(os.environ["TURNSTILE_ATTACHMENTS"]):
    data = open(a["path"], "rb").read()
    out.append([a["name"], a["mime"], hashlib.sha256(data).hexdigest() == a["sha256"], data[:5].decode("latin-1")])
print(json.dumps(out))
'"#;

type Server = Serve;

impl Serve {
    fn start(args: &[&str]) -> Server {
        Serve::spawn(
            Serve::local_command("off")
                .args(["--agent", "exec", "--agent-cmd", AGENT])
                .args(args)
                .env("RUST_LOG", "warn")
                .stderr(Stdio::inherit()),
        )
    }
}

struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(addr: &str) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("timeout");
        let mut c = Client {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        c.send(&json!({"op": "hello", "platform": "tg"}));
        c
    }

    fn send(&mut self, v: &Value) {
        self.writer
            .write_all((v.to_string() + "\n").as_bytes())
            .expect("write");
    }

    /// The next line about a message (typing indicators skipped).
    fn next(&mut self) -> Value {
        loop {
            let mut line = String::new();
            assert!(
                self.reader.read_line(&mut line).expect("read") > 0,
                "closed"
            );
            let v: Value = serde_json::from_str(&line).expect("json");
            if v["op"] != "typing" {
                return v;
            }
        }
    }
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8(out.stdout).expect("utf-8")[..64].to_owned()
}

fn entry(path: &Path, name: &str, mime: &str) -> Value {
    let size = std::fs::metadata(path).expect("file").len();
    json!({"name": name, "mime": mime, "size": size, "sha256": sha256(path),
           "path": path.to_str().expect("utf-8 path")})
}

#[test]
fn the_exec_agent_reads_the_files_and_they_leave_the_spool_after_the_turn() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = tmp.path().join("spool");
    std::fs::create_dir(&spool).expect("spool");
    let orphan = spool.join("left-by-a-crash.bin");
    std::fs::write(&orphan, b"stale").expect("orphan");
    let server = Server::start(&["--attachments-dir", spool.to_str().expect("utf-8")]);
    assert!(
        !orphan.exists(),
        "an orphan of an earlier run is swept at start-up"
    );

    let spool = spool.canonicalize().expect("canonical");
    let (png, txt) = (spool.join("m1-0.png"), spool.join("m1-1.txt"));
    std::fs::write(&png, b"\x89PNG\r\n\x1a\nnot really").expect("png");
    std::fs::write(&txt, b"hello, agent\n").expect("txt");
    let mut c = Client::connect(&server.addr);
    c.send(
        &json!({"op": "message", "id": "m1", "chat_id": "1", "text": "see attached",
                   "attachments": [entry(&png, "cat.png", "image/png"),
                                   entry(&txt, "notes.txt", "text/plain")]}),
    );
    assert_eq!(c.next()["op"], "ack");
    let reply = c.next();
    assert_eq!(reply["op"], "reply", "{reply}");
    let seen: Value = serde_json::from_str(reply["text"].as_str().expect("text")).expect("json");
    assert_eq!(
        seen,
        json!([
            ["cat.png", "image/png", true, "\u{89}PNG\r"],
            ["notes.txt", "text/plain", true, "hello"]
        ])
    );
    // The janitor deletes on a thread of its own.
    eventually(
        "the files leave the spool once the reply is out",
        WAIT,
        || !png.exists() && !txt.exists(),
    );

    // A hostile bridge: a file outside the spool, directly or through a link inside it.
    // The test's own secret beside the spool (never a file of the machine's: a check that
    // failed would hand it to the janitor to delete).
    let secret = spool.parent().expect("parent").join("secret.txt");
    std::fs::write(&secret, "not for the agent").expect("secret");
    std::os::unix::fs::symlink(&secret, spool.join("link")).expect("symlink");
    let passwd = secret.as_path();
    for (id, path) in [("m2", passwd.to_path_buf()), ("m3", spool.join("link"))] {
        let mut e = entry(passwd, "passwd", "text/plain");
        e["path"] = json!(path.to_str().expect("utf-8"));
        c.send(
            &json!({"op": "message", "id": id, "chat_id": "1", "text": "read this",
                       "attachments": [e]}),
        );
        let refused = c.next();
        assert_eq!(
            (&refused["op"], &refused["reason"]),
            (&json!("reject"), &json!("invalid"))
        );
        let detail = refused["detail"].as_str().expect("detail");
        assert!(
            detail.contains("not inside the gateway's attachments directory"),
            "{detail}"
        );
    }
}

/// `turnstile send --attach` copies the file into the gateway's spool (on the gateway's host)
/// and names it: the agent reads it, sha256 matching.
#[test]
fn send_attach_copies_a_file_into_the_spool_for_the_agent() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let spool = tmp.path().join("spool");
    let server = Server::start(&["--attachments-dir", spool.to_str().expect("utf-8")]);
    let file = tmp.path().join("report.csv");
    std::fs::write(&file, b"a,b\n1,2\n").expect("file");
    let out = common::run_ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["send", "--addr", &server.addr, "--attach"])
            .arg(&file)
            .arg("--attachments-dir")
            .arg(&spool)
            .arg("here is the report"),
        "send",
    );
    let seen: Value = serde_json::from_slice(&out.stdout).expect("the agent's answer");
    assert_eq!(seen, json!([["report.csv", "", true, "a,b\n1"]]));
}
