//! Several agents in one gateway (issue 35 item 2), black-box: the real binary with
//! `[[agent]]` and `[[route]]` tables of exec agents that print their name, driven by
//! `turnstile send --platform … --chat … --user …`; a route change by SIGHUP; the status,
//! the metrics and `/status`; `--check-config`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::eventually;
use common::gateway::{Serve, turnstile};

const WAIT: Duration = Duration::from_secs(30);

fn bin() -> Command {
    let mut command = turnstile();
    command.env_remove("TURNSTILE_AUTH_TOKEN");
    command
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("turnstile-routes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Three exec agents printing their names; routes by platform, by chat glob, by user.
/// (The file's `agent` key is the `[[agent]]` array: the top-level agent comes from flags.)
const TABLES: &str = r#"
[[agent]]
name = "one"
kind = "exec"
agent-cmd = "echo one"

[[agent]]
name = "two"
kind = "exec"
agent-cmd = "echo two"

[[agent]]
name = "three"
kind = "exec"
agent-cmd = "echo three"

[[route]]
platform = "matrix"
chat = "!support:*"
agent = "one"

[[route]]
chat = "dev-*"
agent = "two"

[[route]]
platform = "irc"
user = "ops-*"
agent = "three"
"#;

struct Gw {
    serve: Serve,
}

impl Gw {
    fn start(config: &Path) -> Gw {
        let serve = Serve::spawn_logged(
            Serve::local_command("127.0.0.1:0")
                .args(["--access-default", "open"])
                .args(["--agent", "exec", "--agent-cmd", "echo top", "--config"])
                .arg(config)
                .env("RUST_LOG", "info")
                .env_remove("TURNSTILE_AUTH_TOKEN"),
        );
        Gw { serve }
    }

    /// `turnstile send` from `user` in `chat` of `platform`: the reply's text.
    fn send(&self, platform: &str, chat: &str, user: &str, text: &str) -> String {
        let out = common::run_ok(
            bin()
                .args(["send", "--addr", &self.serve.addr, "--timeout", "60s"])
                .args(["--platform", platform, "--chat", chat, "--user", user, text]),
            &format!("send {platform} {chat} {user}"),
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn get(&self, path: &str) -> String {
        common::http::get(self.serve.http(), path, None).body
    }

    fn sighup(&self) {
        self.serve.signal(libc::SIGHUP);
    }

    fn log_line(&self, needles: &[&str]) -> String {
        self.serve.log().until(needles).0
    }
}

/// Routes choose different exec agents by platform, by chat glob and by the sender; the
/// first match wins; no match goes to the top-level agent.
#[test]
fn routes_choose_agents_by_platform_chat_and_user() {
    let dir = temp_dir("choose");
    let cfg = dir.join("turnstile.toml");
    std::fs::write(&cfg, TABLES).expect("write");
    let gw = Gw::start(&cfg);
    assert_eq!(
        gw.send("matrix", "!support:example.org", "@a:x", "hi"),
        "one"
    );
    // The same chat on another platform is not the support room.
    assert_eq!(
        gw.send("telegram", "!support:example.org", "1", "hi"),
        "top"
    );
    // `dev-*` on any platform; on matrix the first route does not match this chat.
    assert_eq!(gw.send("matrix", "dev-ops", "@a:x", "hi"), "two");
    assert_eq!(
        gw.send("irc", "dev-web", "ops-bob", "hi"),
        "two",
        "first match wins"
    );
    // By the sender on irc (a DM's key holds no user: the sender's id is matched).
    assert_eq!(gw.send("irc", "bob", "ops-bob", "hi"), "three");
    assert_eq!(gw.send("irc", "carol", "carol", "hi"), "top");
    assert_eq!(gw.send("slack", "C1", "U1", "hi"), "top");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `/status` names the session's agent; the status and the metrics carry each agent's live
/// sessions under its name (bounded by the tables: one entry per agent).
#[test]
fn status_and_metrics_name_the_agents() {
    let dir = temp_dir("status");
    let cfg = dir.join("turnstile.toml");
    std::fs::write(&cfg, TABLES).expect("write");
    let gw = Gw::start(&cfg);
    assert_eq!(gw.send("matrix", "dev-a", "u", "hi"), "two");
    assert_eq!(gw.send("matrix", "dev-b", "u", "hi"), "two");
    assert_eq!(gw.send("matrix", "lobby", "u", "hi"), "top");
    let status = gw.send("matrix", "dev-a", "u", "/status");
    assert!(status.ends_with("; agent two"), "{status}");
    let status = gw.send("matrix", "lobby", "u", "/status");
    assert!(status.ends_with("; agent default"), "{status}");
    // The status is the reactor's last heartbeat snapshot (up to one tick old): read it
    // until it counts the three sessions just served.
    let json = eventually("the status counts the three sessions", WAIT, || {
        let json: serde_json::Value =
            serde_json::from_str(&gw.get("/status")).expect("status json");
        if json["sessions"]["total"].as_u64() >= Some(3) {
            Ok(json)
        } else {
            Err(json)
        }
    });
    let agents = json["agents"].as_array().expect("agents in the status");
    let names: Vec<&str> = agents.iter().filter_map(|a| a["name"].as_str()).collect();
    assert_eq!(names, ["default", "one", "two", "three"]);
    let sessions = |name: &str| {
        agents
            .iter()
            .find(|a| a["name"] == name)
            .map(|a| (a["kind"].clone(), a["sessions"].clone()))
    };
    assert_eq!(sessions("two"), Some(("exec".into(), 2.into())));
    assert_eq!(sessions("default"), Some(("exec".into(), 1.into())));
    assert_eq!(sessions("one"), Some(("exec".into(), 0.into())));
    let metrics = gw.get("/metrics");
    assert!(
        metrics.contains("turnstile_agent_sessions{agent=\"two\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("turnstile_agent_sessions{agent=\"default\"} 1"),
        "{metrics}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGHUP reloads the routes and agents: a session keeps the agent it has while a new
/// session gets the new route; a session whose agent the reload removed gets the routes in
/// force at its next message; a broken file keeps the set in force.
#[test]
fn a_reload_routes_new_sessions_and_keeps_each_session_s_agent() {
    let dir = temp_dir("reload");
    let cfg = dir.join("turnstile.toml");
    let config = |two_route: &str, with_one: bool| {
        let one = if with_one {
            "[[agent]]\nname = \"one\"\nkind = \"exec\"\nagent-cmd = \"echo one\"\n"
        } else {
            ""
        };
        let one_route = if with_one {
            "[[route]]\nchat = \"keep-*\"\nagent = \"one\"\n"
        } else {
            ""
        };
        format!(
            "{one}\
             [[agent]]\nname = \"two\"\nkind = \"exec\"\nagent-cmd = \"echo two\"\n\
             {one_route}[[route]]\nchat = \"{two_route}\"\nagent = \"two\"\n"
        )
    };
    std::fs::write(&cfg, config("a-*", true)).expect("write");
    let gw = Gw::start(&cfg);
    assert_eq!(gw.send("telegram", "b-1", "u", "hi"), "top");
    assert_eq!(gw.send("telegram", "keep-1", "u", "hi"), "one");

    // The route to `two` now covers `b-*`: the session b-1 keeps its agent, b-2 is new.
    std::fs::write(&cfg, config("b-*", true)).expect("write");
    gw.sighup();
    gw.log_line(&["reload: applied"]);
    assert_eq!(gw.send("telegram", "b-1", "u", "again"), "top", "kept");
    assert_eq!(gw.send("telegram", "b-2", "u", "hi"), "two", "new route");
    // `/new` starts a new session: it takes the route in force.
    gw.send("telegram", "b-1", "u", "/new");
    assert_eq!(gw.send("telegram", "b-1", "u", "hi"), "two", "after /new");

    // `one` removed: keep-1's agent is closed at its next message, the routes pick again.
    std::fs::write(&cfg, config("keep-*", false)).expect("write");
    gw.sighup();
    gw.log_line(&["reload: applied"]);
    assert_eq!(
        gw.send("telegram", "keep-1", "u", "hi"),
        "two",
        "removed agent"
    );

    // A broken table is refused; the set in force stays.
    std::fs::write(&cfg, "[[route]]\nchat = \"*\"\nagent = \"nobody\"\n").expect("write");
    gw.sighup();
    let refused = gw.log_line(&["reload refused"]);
    assert!(
        refused.contains("ERROR") && refused.contains("nobody"),
        "{refused}"
    );
    assert_eq!(gw.send("telegram", "keep-2", "u", "hi"), "two");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--check-config` checks every table, exit 2 naming the table and what is wrong.
#[test]
fn check_config_names_the_wrong_table() {
    let dir = temp_dir("check");
    let cfg = dir.join("turnstile.toml");
    let check = |text: &str| {
        std::fs::write(&cfg, text).expect("write");
        let out = bin()
            .args(["serve", "--check-config", "--config"])
            .arg(&cfg)
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let agent = "[[agent]]\nname = \"a\"\nkind = \"exec\"\nagent-cmd = \"echo a\"\n";
    let (code, err) = check(&format!("{agent}[[route]]\nchat = \"x\"\nagent = \"b\"\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("[[route]] #1") && err.contains("\"b\""),
        "{err}"
    );
    let (code, err) = check(&format!("{agent}{agent}"));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("[[agent]] \"a\": a second table"), "{err}");
    let (code, err) = check(&format!(
        "{agent}[[route]]\nagent = \"a\"\n[[route]]\nchat = \"x\"\nagent = \"a\"\n"
    ));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("[[route]] #2") && err.contains("never match"),
        "{err}"
    );
    let (code, err) = check(&format!("{agent}model = \"m\"\n"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("[[agent]] \"a\"") && err.contains("\"model\"") && err.contains("exec"),
        "{err}"
    );
    let (code, err) = check("[[agent]]\nname = \"p\"\nkind = \"process\"\n");
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("[[agent]] \"p\"") && err.contains("agent-cmd"),
        "{err}"
    );
    let (code, err) = check(&format!("{agent}[[route]]\nchat = \"x\"\nagent = \"a\"\n"));
    assert_eq!(code, Some(0), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
