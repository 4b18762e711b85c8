use std::time::Duration;

use super::flood::FloodBucket;
use super::wire::*;
use crate::message::{ChatType, SessionKey};

#[test]
fn parses_prefix_command_and_trailing() {
    let l = parse_line(":ann!~a@host PRIVMSG #chan :bot: hello there\r").expect("line");
    assert_eq!(l.prefix, Some("ann!~a@host"));
    assert_eq!(l.command, "PRIVMSG");
    assert_eq!(l.params, ["#chan", "bot: hello there"]);
    let l = parse_line("PING :irc.example").expect("line");
    assert_eq!((l.prefix, l.command), (None, "PING"));
    assert_eq!(l.params, ["irc.example"]);
    let l = parse_line("@time=x :srv 001 bot :Welcome bot!~b@h").expect("line");
    assert_eq!(l.command, "001");
    assert_eq!(l.params, ["bot", "Welcome bot!~b@h"]);
    assert_eq!(parse_line(""), None);
}

#[test]
fn channel_lines_need_the_address_and_dms_do_not() {
    let a = addressed("Bot", "ann", "#chan", "bot: !stop").expect("addressed");
    assert_eq!(
        a,
        Addressed {
            chat_id: "#chan".into(),
            chat_type: ChatType::Group,
            sender: "ann".into(),
            text: "/stop".into()
        }
    );
    assert_eq!(
        addressed("bot", "ann", "#chan", "bot, hi").expect("x").text,
        "hi"
    );
    assert_eq!(addressed("bot", "ann", "#chan", "hello bot"), None);
    // CTCP, also behind leading whitespace (issue 30 row 12).
    assert_eq!(addressed("bot", "ann", "bot", "\x01VERSION\x01"), None);
    assert_eq!(addressed("bot", "ann", "bot", " \x01DCC SEND x\x01"), None);
    assert_eq!(addressed("bot", "ann", "#chan", "botany: hi"), None);
    assert_eq!(addressed("bot", "ann", "#chan", "bot:"), None);
    let dm = addressed("bot", "ann", "bot", "!new").expect("dm");
    assert_eq!((dm.chat_id.as_str(), dm.chat_type), ("ann", ChatType::Dm));
    assert_eq!(dm.text, "/new");
    assert_eq!(addressed("bot", "ann", "bob", "hi"), None);
    assert_eq!(addressed("bot", "ann", "bot", "\x01VERSION\x01"), None);
}

#[test]
fn session_keys_route_results_to_their_chat() {
    let group = SessionKey::new("irc", ChatType::Group, "#chan", None, Some("ann"))
        .expect("key")
        .to_string();
    assert_eq!(
        route_of(&group),
        Some(ReplyTarget {
            target: "#chan".into(),
            addressee: Some("ann".into())
        })
    );
    let dm = SessionKey::dm("irc", "ann").expect("key").to_string();
    assert_eq!(
        route_of(&dm),
        Some(ReplyTarget {
            target: "ann".into(),
            addressee: None
        })
    );
    assert_eq!(route_of("nonsense"), None);
}

#[test]
fn relayed_lines_stay_within_512_bytes() {
    let source = "bot!~bot@localhost";
    let route = ReplyTarget {
        target: "#chan".into(),
        addressee: Some("ann".into()),
    };
    let text = "日本語のテキスト 🎉 ".repeat(200);
    let budget = text_budget(source.len(), &route.target);
    let lines = reply_lines(&route, &text, budget, 1000);
    assert!(lines.len() > 5);
    for l in &lines {
        let wire = format!(":{source} PRIVMSG {} :{l}\r\n", route.target);
        assert!(wire.len() <= IRC_MAX_LINE, "{} bytes", wire.len());
    }
    assert!(lines[0].starts_with("ann: "));
}

#[test]
fn long_replies_are_capped_with_a_note() {
    let route = ReplyTarget {
        target: "ann".into(),
        addressee: None,
    };
    let lines = reply_lines(&route, &"word ".repeat(1000), 100, 5);
    assert_eq!(lines.len(), 5);
    assert!(lines[4].contains("more bytes not shown"), "{}", lines[4]);
    assert_eq!(reply_lines(&route, "", 100, 5), ["[empty reply]"]);
}

#[test]
fn alternate_nicks_differ_from_the_base() {
    assert_eq!(alternate_nick("bot", 1), "bot_");
    assert_eq!(alternate_nick("bot", 2), "bot_2");
}

#[test]
fn the_flood_bucket_allows_a_burst_then_paces() {
    let mut b = FloodBucket::new(2, Duration::from_secs(1));
    let t0 = b.refilled_at();
    assert!(b.take(t0) && b.take(t0));
    assert!(!b.take(t0));
    assert!(!b.take(t0 + Duration::from_millis(500)));
    assert!(b.take(t0 + Duration::from_millis(1000)));
}
