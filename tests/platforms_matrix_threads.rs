//! Issue 35 rows 3–5 against a **real Synapse** (see tests/platforms_matrix.rs): Matrix
//! threads as sessions answered in the thread, a DM that gains a third member keeping its
//! conversation, and the read receipt a message queued behind a running turn gets.
//!
//! The real `turnstile serve` runs a process agent with a memory (each reply names its
//! session and everything said in it so far), so a conversation kept or lost shows in the
//! text. Nothing sleeps to order events: `wait` turns block on a FIFO the test writes, and
//! every wait is a receive with a deadline fed by the human's long-polling `/sync`.

mod common;
mod matrix_support;

mod child_support;
use child_support::{Proc, die_with_parent};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use crossbeam_channel::bounded;
use serde_json::{Value, json};

use matrix_support::{Seen, Synapse, User, WAIT, edit_of, enc, http, synapse};

const GATEWAY_TOKEN: &str = "gateway-token-for-the-threads-test";

/// The agent: remembers its session's texts; `wait` blocks on the FIFO first.
const AGENT: &str = r#"
import json, sys
fifo = sys.argv[1]
memory = []
def out(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("op") == "close":
        break
    if m.get("op") != "turn":
        continue
    i, t = m["id"], m["text"]
    if t == "wait":
        out({"op": "partial", "id": i, "text": "waiting"})
        open(fifo).read()
    memory.append(t)
    out({"op": "reply", "id": i, "text": "%s | so far: %s" % (m["session"], " / ".join(memory))})
"#;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// `turnstile serve` with the agent, and a bridge with a `--state-dir`.
struct Rig {
    _serve: Proc,
    _bridge: Proc,
    fifo: PathBuf,
    _dir: tempfile::TempDir,
}

fn rig(hs: &Synapse, bot: &User) -> Rig {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("agent.py");
    std::fs::write(&script, AGENT).expect("agent");
    let fifo = dir.path().join("go.fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo")
            .success()
    );
    let port = free_port();
    let cmd = format!("exec python3 {} {}", script.display(), fifo.display());
    let mut serve = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--http-listen", "off", "--access-default", "open"])
            .args(["--agent", "process", "--agent-cmd", &cmd])
            .args(["--partial-interval", "0.05"])
            .env("RUST_LOG", "warn")
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    )
    .spawn()
    .expect("start serve");
    let first = first_line(serve.stdout.take().expect("stdout"));
    assert!(first.starts_with("listening on "), "{first}");
    let log = std::fs::File::create(dir.path().join("bridge.log")).expect("log");
    let mut bridge = die_with_parent(
        Command::new(env!("CARGO_BIN_EXE_turnstile"))
            .args([
                "bridge",
                "matrix",
                "--gateway",
                &format!("127.0.0.1:{port}"),
            ])
            .args(["--homeserver", &hs.base])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env("MATRIX_ACCESS_TOKEN", &bot.token)
            .env("TURNSTILE_AUTH_TOKEN", GATEWAY_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(log),
    )
    .spawn()
    .expect("start bridge");
    let ready = first_line(bridge.stdout.take().expect("stdout"));
    assert!(ready.starts_with("ready: matrix"), "{ready}");
    Rig {
        _serve: Proc(serve),
        _bridge: Proc(bridge),
        fifo,
        _dir: dir,
    }
}

fn first_line(stdout: std::process::ChildStdout) -> String {
    let (tx, rx) = bounded(1);
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line.trim_end().to_owned());
    });
    rx.recv_timeout(WAIT).expect("a first line")
}

impl Rig {
    /// Lets a `wait` turn go on (bounded).
    fn go(&self) {
        let fifo = self.fifo.clone();
        let (tx, rx) = bounded(1);
        std::thread::spawn(move || {
            let r = std::fs::OpenOptions::new()
                .write(true)
                .open(&fifo)
                .and_then(|mut f| f.write_all(b"go"));
            let _ = tx.send(r);
        });
        rx.recv_timeout(WAIT)
            .expect("the agent waited")
            .expect("write");
    }
}

/// `user` says `text` in `room`, in the thread rooted at `root` when given (as Element
/// sends it: the fallback reply to the thread's latest event, here the root).
fn say(user: &User, room: &str, text: &str, root: Option<&str>) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let txn = format!(
        "th{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    );
    let mut content = json!({"msgtype": "m.text", "body": text});
    if let Some(r) = root {
        content["m.relates_to"] = json!({"rel_type": "m.thread", "event_id": r,
            "is_falling_back": true, "m.in_reply_to": {"event_id": r}});
    }
    let path = format!("/rooms/{}/send/m.room.message/{txn}", enc(room));
    let v = user.call("PUT", &path, Some(&content)).expect("send");
    v["event_id"].as_str().expect("event_id").to_owned()
}

/// The bot's new message answering `event` (not an edit): its event id and content.
fn answer(seen: &mut matrix_support::Watcher, bot: &str, event: &str) -> (String, Value) {
    let i = seen.until("the bot's answer", |s| {
        matches!(s, Seen::Event(ev, _) if ev["sender"] == bot
            && ev["content"]["m.relates_to"]["m.in_reply_to"]["event_id"] == event
            && ev["content"]["m.relates_to"]["rel_type"] != "m.replace")
    });
    let Seen::Event(ev, _) = &seen.log[i] else {
        unreachable!()
    };
    (
        ev["event_id"].as_str().expect("id").to_owned(),
        ev["content"].clone(),
    )
}

/// Waits until the bot's message `original` shows exactly `text` (itself or by an edit).
fn shows(seen: &mut matrix_support::Watcher, original: &str, text: &str) {
    seen.until(&format!("{original} showing {text:?}"), |s| {
        let Seen::Event(ev, _) = s else { return false };
        let shown = if ev["event_id"] == original {
            ev["content"]["body"].as_str()
        } else {
            edit_of(ev, original)
        };
        shown == Some(text)
    });
}

/// The session key of a Matrix room as the agent prints it (`:` in the id escaped).
fn room_key(kind: &str, room: &str) -> String {
    format!(
        "matrix:{kind}:{}",
        room.replace('%', "%25").replace(':', "%3A")
    )
}

fn joined_bot(hs: &'static Synapse) -> (User, User, String, matrix_support::Watcher) {
    let bot = hs.register("bot", "Turnstile Bot");
    let human = hs.register("ann", "Ann");
    hs.unlimit(&bot);
    let room = human.create_room(&[&bot.mxid]);
    let seen = human.watch(&room);
    (bot, human, room, seen)
}

fn wait_joined(seen: &mut matrix_support::Watcher, who: &str) {
    seen.until("a join", |s| {
        matches!(s, Seen::Event(ev, _) if ev["type"] == "m.room.member"
            && ev["state_key"] == who && ev["content"]["membership"] == "join")
    });
}

/// Issue 35 rows 3 and 5: a thread is a conversation of its own, answered in the thread
/// (the reply, its edits); `!new` in the thread resets only it; a message queued behind
/// the thread's running turn gets the bot's read receipt while it waits.
#[test]
fn issue35_a_thread_is_its_own_conversation_answered_in_the_thread_and_a_queued_message_is_receipted()
 {
    let Some(hs) = synapse() else { return };
    let (bot, human, room, mut seen) = joined_bot(hs);
    let rig = rig(hs, &bot);
    wait_joined(&mut seen, &bot.mxid);
    let dm = room_key("dm", &room);

    let root = say(&human, &room, "root", None);
    let (a_root, _) = answer(&mut seen, &bot.mxid, &root);
    shows(&mut seen, &a_root, &format!("{dm} | so far: root"));

    // A long turn in the thread: its reply starts in the thread.
    let wait = say(&human, &room, "wait", Some(&root));
    let (a_wait, content) = answer(&mut seen, &bot.mxid, &wait);
    let rel = &content["m.relates_to"];
    assert_eq!(rel["rel_type"], "m.thread", "{content}");
    assert_eq!(rel["event_id"], root.as_str(), "{content}");
    assert_eq!(rel["is_falling_back"], true, "{content}");
    // Queued behind it: the human sees the bot's read receipt on it before its turn.
    let queued = say(&human, &room, "queued", Some(&root));
    receipt_seen(&human, &room, &bot.mxid, &queued);
    rig.go();
    let thread = format!("{dm}:thread:{root}");
    shows(&mut seen, &a_wait, &format!("{thread} | so far: wait"));
    let edit = seen
        .events()
        .find_map(|(_, ev)| edit_of(ev, &a_wait).map(|_| ev.clone()))
        .expect("the wait reply was edited");
    assert_eq!(edit["content"]["m.relates_to"]["rel_type"], "m.replace");
    let (a_queued, content) = answer(&mut seen, &bot.mxid, &queued);
    assert_eq!(content["m.relates_to"]["event_id"], root.as_str());
    shows(
        &mut seen,
        &a_queued,
        &format!("{thread} | so far: wait / queued"),
    );

    // `!new` in the thread resets the thread's conversation and nothing else.
    let new = say(&human, &room, "!new", Some(&root));
    let (_, content) = answer(&mut seen, &bot.mxid, &new);
    assert_eq!(content["m.relates_to"]["rel_type"], "m.thread", "{content}");
    let t2 = say(&human, &room, "t2", Some(&root));
    let (a_t2, _) = answer(&mut seen, &bot.mxid, &t2);
    shows(&mut seen, &a_t2, &format!("{thread} | so far: t2"));
    let main2 = say(&human, &room, "main2", None);
    let (a_main2, content) = answer(&mut seen, &bot.mxid, &main2);
    assert!(content["m.relates_to"]["rel_type"].is_null(), "{content}");
    shows(&mut seen, &a_main2, &format!("{dm} | so far: root / main2"));
}

/// Waits (a long-polling `/sync` of the human's, bounded) until the bot's `m.read` receipt
/// on `event` reaches the human.
fn receipt_seen(human: &User, room: &str, bot: &str, event: &str) {
    let filter = enc(&json!({"room": {"rooms": [room], "timeline": {"limit": 1}}}).to_string());
    let url = |since: Option<&str>| {
        let since = since
            .map(|s| format!("&since={}", enc(s)))
            .unwrap_or_default();
        format!(
            "{}/_matrix/client/v3/sync?timeout=10000&filter={filter}{since}",
            human.base
        )
    };
    let deadline = Instant::now() + WAIT;
    let mut since: Option<String> = None;
    while Instant::now() < deadline {
        let v = http("GET", &url(since.as_deref()), Some(&human.token), None).expect("sync");
        since = v["next_batch"].as_str().map(str::to_owned);
        let ephemeral = &v["rooms"]["join"][room]["ephemeral"]["events"];
        let seen =
            ephemeral.as_array().into_iter().flatten().any(|ev| {
                ev["type"] == "m.receipt" && ev["content"][event]["m.read"][bot].is_object()
            });
        if seen {
            return;
        }
    }
    panic!("the bot's read receipt on {event} never reached the human");
}

/// Issue 35 row 4: a DM that gains a third member keeps its conversation for the user
/// who had it; the newcomer gets a conversation of their own.
#[test]
fn issue35_a_dm_that_gains_a_third_member_keeps_its_conversation() {
    let Some(hs) = synapse() else { return };
    let (bot, human, room, mut seen) = joined_bot(hs);
    let _rig = rig(hs, &bot);
    wait_joined(&mut seen, &bot.mxid);
    let dm = room_key("dm", &room);
    let a = say(&human, &room, "a", None);
    let (a_a, _) = answer(&mut seen, &bot.mxid, &a);
    shows(&mut seen, &a_a, &format!("{dm} | so far: a"));

    let third = hs.register("cy", "Cy");
    human
        .call(
            "POST",
            &format!("/rooms/{}/invite", enc(&room)),
            Some(&json!({"user_id": third.mxid})),
        )
        .expect("invite");
    third
        .call(
            "POST",
            &format!("/rooms/{}/join", enc(&room)),
            Some(&json!({})),
        )
        .expect("join");
    wait_joined(&mut seen, &third.mxid);

    let b = say(&human, &room, "b", None);
    let (a_b, _) = answer(&mut seen, &bot.mxid, &b);
    shows(&mut seen, &a_b, &format!("{dm} | so far: a / b"));
    let c = say(&third, &room, "c", None);
    let (a_c, _) = answer(&mut seen, &bot.mxid, &c);
    let group = format!(
        "{}:user:{}",
        room_key("group", &room),
        third.mxid.replace(':', "%3A")
    );
    shows(&mut seen, &a_c, &format!("{group} | so far: c"));
}
