//! The protocol's own tests: the parse's answers, and every op written by one end read back
//! by the other as itself.

use super::*;
use crate::message::ChatType;

#[test]
fn parses_a_full_message() {
    let line = br#"{"op":"message","id":"m-1","platform":"telegram","chat_id":"42","chat_type":"group","user_id":"7","thread_id":null,"text":"hi"}"#;
    let Ok(ClientOp::Message(m)) = parse_line(line) else {
        panic!("not a message")
    };
    assert_eq!(m.id, "m-1");
    assert_eq!(m.chat_type, ChatType::Group);
    assert_eq!(m.user_id.as_deref(), Some("7"));
    assert_eq!(m.thread_id, None);
    assert_eq!((m.user_name, m.meta), (None, None));
    let line = br#"{"op":"message","id":"m","chat_id":"1","text":"x","user_id":"7","user_name":"Ann","meta":{"reply_to": "m0"}}"#;
    let Ok(ClientOp::Message(m)) = parse_line(line) else {
        panic!("not a message")
    };
    assert_eq!(m.user_name.as_deref(), Some("Ann"));
    assert_eq!(m.meta.as_deref(), Some(r#"{"reply_to":"m0"}"#));
    let e = parse_line(br#"{"op":"message","id":"m","chat_id":"1","text":"x","meta":[1]}"#);
    assert!(matches!(e, Err(LineError::Invalid { detail, .. }) if detail.starts_with("meta")));
}

#[test]
fn platform_names_are_short_and_plain() {
    assert!(check_platform("telegram").is_ok());
    assert!(check_platform("my-bridge_2.0").is_ok());
    assert!(check_platform(&"a".repeat(64)).is_ok());
    assert!(check_platform(&"a".repeat(65)).is_err());
    assert!(check_platform("").is_err());
    assert!(check_platform("tele gram").is_err());
    assert!(check_platform("tg:1").is_err());
}

#[test]
fn malformed_lines_are_errors_and_bad_fields_are_invalid_naming_the_field() {
    assert!(
        matches!(parse_line(b"{nope"), Err(LineError::Malformed(d)) if d.starts_with("invalid JSON"))
    );
    assert!(matches!(parse_line(b"[1]"), Err(LineError::Malformed(d)) if d.contains("object")));
    assert!(
        matches!(parse_line(br#"{"op":"dance"}"#), Err(LineError::Malformed(d)) if d.contains("unknown op"))
    );
    assert!(
        matches!(parse_line(br#"{"x":1}"#), Err(LineError::Malformed(d)) if d.contains("missing op"))
    );
    let e = parse_line(br#"{"op":"message","id":"m","text":"hi"}"#);
    assert_eq!(
        e,
        Err(LineError::Invalid {
            id: "m".into(),
            detail: "chat_id is required".into()
        })
    );
    let e = parse_line(br#"{"op":"message","id":"m","chat_id":42,"text":"hi"}"#);
    assert_eq!(
        e,
        Err(LineError::Invalid {
            id: "m".into(),
            detail: "chat_id must be a string".into()
        })
    );
    let e =
        parse_line(br#"{"op":"message","id":"m","chat_id":"1","text":"hi","chat_type":"room"}"#);
    assert!(matches!(e, Err(LineError::Invalid { detail, .. }) if detail.starts_with("chat_type")));
}

#[test]
fn encodes_one_line_per_op() {
    let line = encode(&ServerOp::Ack {
        id: "m",
        session: "t:dm:1",
        state: "queued",
        position: Some(2),
    });
    assert_eq!(line, b"{\"op\":\"ack\",\"id\":\"m\",\"session\":\"t:dm:1\",\"state\":\"queued\",\"position\":2}\n");
    assert_eq!(encode(&ServerOp::Pong), b"{\"op\":\"pong\"}\n");
}
