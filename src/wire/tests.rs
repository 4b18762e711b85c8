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
    assert_eq!(
        encode(&ServerOp::<&str>::Pong {
            max_line_bytes: None
        }),
        b"{\"op\":\"pong\"}\n"
    );
    assert_eq!(
        encode(&ServerOp::<&str>::Pong {
            max_line_bytes: Some(65_536)
        }),
        b"{\"op\":\"pong\",\"max_line_bytes\":65536}\n"
    );
}

#[test]
fn a_meta_that_is_not_json_is_written_as_a_string_the_server_refuses() {
    let mut m = MessageFields::new("m", "1", "hi");
    m.meta = Some("{not json".into());
    let line = ClientOp::Message(m).line();
    assert!(line.contains(r#""meta":"{not json""#), "{line}");
    assert_eq!(
        parse_line(line.as_bytes()),
        Err(LineError::Invalid {
            id: "m".into(),
            detail: "meta must be a JSON object or null".into()
        })
    );
}

#[test]
fn an_encoded_line_is_journaled_as_itself_and_sized_as_held() {
    // A short text: one encoded line, journaled as its head alone.
    let short = EncodedLine::text_op(TextOp::Reply { truncated: false }, "m", "s", "hi".into());
    let EncodedLine::Line(bytes) = &short else {
        panic!("a short text is encoded at once")
    };
    assert_eq!(
        bytes,
        b"{\"op\":\"reply\",\"id\":\"m\",\"session\":\"s\",\"text\":\"hi\"}\n"
    );
    assert_eq!(short.size(), bytes.len());
    let stored = short.to_stored();
    assert_eq!((&stored.head, stored.text.as_str()), (bytes, ""));
    assert!(stored.tail.is_empty());
    let EncodedLine::Line(back) = EncodedLine::from_stored(stored) else {
        panic!("a journaled short line reads back whole")
    };
    assert_eq!(&back, bytes);
    // A long text: the envelope around the raw text, journaled in its three parts.
    let long = "\"".repeat(EAGER_TEXT + 1);
    let line = EncodedLine::text_op(TextOp::Reply { truncated: true }, "m", "s", long.clone());
    let EncodedLine::Text { head, text, tail } = &line else {
        panic!("a long text is escaped on the way out")
    };
    assert_eq!(
        head,
        b"{\"op\":\"reply\",\"id\":\"m\",\"session\":\"s\",\"text\":\""
    );
    assert_eq!(
        (text, tail.as_slice()),
        (&long, b"\",\"truncated\":true}\n".as_slice())
    );
    assert_eq!(line.size(), head.len() + EAGER_TEXT + 1 + tail.len());
    let stored = line.to_stored();
    assert_eq!(
        (&stored.head, &stored.text, &stored.tail),
        (head, &long, tail)
    );
    let EncodedLine::Text {
        head: h2,
        text: t2,
        tail: l2,
    } = EncodedLine::from_stored(stored)
    else {
        panic!("a journaled long line reads back in its parts")
    };
    assert_eq!((&h2, &t2, &l2), (head, &long, tail));
}

mod round_trip {
    //! Every op one end writes, the other end reads back as itself: any text (unicode,
    //! quotes, backslashes, control characters, empty), any number.

    use proptest::prelude::*;
    use serde_json::{Map, Value};

    use super::super::*;
    use crate::message::ChatType;

    /// Text a field may hold, with the characters JSON escapes over-represented.
    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            Just(String::new()),
            "[\"\\\\/\u{0}-\u{1f}\u{7f}\u{2028}\u{2029}]{1,12}",
            "[a-zé😀 \"\\\\\n\t]{0,24}",
        ]
    }

    fn some_text() -> impl Strategy<Value = Option<String>> {
        prop::option::of(text())
    }

    fn chat_type() -> impl Strategy<Value = ChatType> {
        prop_oneof![
            Just(ChatType::Dm),
            Just(ChatType::Group),
            Just(ChatType::Channel),
            Just(ChatType::Thread),
        ]
    }

    /// A JSON object as the server keeps `meta`: serialized compactly, keys in order.
    fn meta() -> impl Strategy<Value = Option<String>> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            Just(Value::from(u64::MAX)),
            Just(Value::from(i64::MIN)),
            text().prop_map(Value::from),
        ];
        let value = leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map(text(), inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
            ]
        });
        prop::option::of(
            prop::collection::btree_map(text(), value, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect()).to_string()),
        )
    }

    fn message() -> impl Strategy<Value = MessageFields> {
        (
            (text(), some_text(), text(), chat_type()),
            (some_text(), some_text(), some_text(), meta(), text()),
        )
            .prop_filter("a message's id is not empty", |((id, ..), _)| {
                !id.is_empty()
            })
            .prop_map(
                |(
                    (id, platform, chat_id, chat_type),
                    (user_id, user_name, thread_id, meta, text),
                )| {
                    MessageFields {
                        id,
                        platform,
                        chat_id,
                        chat_type,
                        user_id,
                        user_name,
                        thread_id,
                        meta,
                        text,
                        attachments: Vec::new(),
                    }
                },
            )
    }

    fn client_op() -> impl Strategy<Value = ClientOp> {
        prop_oneof![
            (some_text(), some_text(), any::<bool>()).prop_map(|(platform, token, acks)| {
                ClientOp::Hello {
                    platform,
                    token,
                    acks,
                }
            }),
            prop::collection::vec(text(), 0..5).prop_map(|ids| ClientOp::Delivered { ids }),
            message().prop_map(ClientOp::Message),
            Just(ClientOp::Ping),
            (text(), some_text(), text(), some_text())
                .prop_filter("a query's id is not empty", |(id, ..)| !id.is_empty())
                .prop_map(|(id, platform, user_id, chat_id)| ClientOp::MayUse {
                    id,
                    platform,
                    user_id,
                    chat_id,
                }),
        ]
    }

    fn server_op() -> impl Strategy<Value = ServerOp> {
        prop_oneof![
            (text(), any::<bool>()).prop_map(|(id, allowed)| ServerOp::MayUse { id, allowed }),
            (text(), text(), text(), prop::option::of(any::<usize>())).prop_map(
                |(id, session, state, position)| ServerOp::Ack {
                    id,
                    session,
                    state,
                    position
                }
            ),
            (text(), some_text(), text(), text()).prop_map(|(id, session, reason, detail)| {
                ServerOp::Reject {
                    id,
                    session,
                    reason,
                    detail,
                }
            }),
            (text(), text(), text(), any::<bool>()).prop_map(|(session, platform, chat_id, on)| {
                ServerOp::Typing {
                    session,
                    platform,
                    chat_id,
                    on,
                }
            }),
            (
                text(),
                text(),
                text(),
                any::<bool>(),
                proptest::option::of(text()),
                proptest::collection::vec(attachment(), 0..3),
            )
                .prop_map(|(id, session, text, truncated, notice, attachments)| {
                    ServerOp::Reply {
                        id,
                        session,
                        text,
                        truncated,
                        notice,
                        attachments,
                    }
                }),
            (text(), text(), text()).prop_map(|(id, session, text)| ServerOp::Partial {
                id,
                session,
                text
            }),
            (text(), text(), text()).prop_map(|(id, session, reason)| ServerOp::Cancelled {
                id,
                session,
                reason
            }),
            (text(), text(), text()).prop_map(|(id, session, error)| ServerOp::Failed {
                id,
                session,
                error
            }),
            (text(), text(), text()).prop_map(|(id, session, into)| ServerOp::Merged {
                id,
                session,
                into
            }),
            text().prop_map(|detail| ServerOp::Error { detail }),
            proptest::option::of(1usize..1 << 30)
                .prop_map(|max_line_bytes| ServerOp::Pong { max_line_bytes }),
        ]
    }

    /// A file entry, any of its optional fields set or not.
    fn attachment() -> impl Strategy<Value = crate::Attachment> {
        (
            text(),
            text(),
            any::<u64>(),
            proptest::option::of(text()),
            proptest::option::of(text()),
            proptest::option::of(text()),
        )
            .prop_map(
                |(name, mime, size, sha256, path, skipped)| crate::Attachment {
                    name,
                    mime,
                    size,
                    sha256,
                    path,
                    skipped,
                },
            )
    }

    /// The op as the server holds it: its strings borrowed.
    fn borrowed(op: &ServerOp) -> ServerOp<&str> {
        match op {
            ServerOp::MayUse { id, allowed } => ServerOp::MayUse {
                id,
                allowed: *allowed,
            },
            ServerOp::Ack {
                id,
                session,
                state,
                position,
            } => ServerOp::Ack {
                id,
                session,
                state,
                position: *position,
            },
            ServerOp::Reject {
                id,
                session,
                reason,
                detail,
            } => ServerOp::Reject {
                id,
                session: session.as_deref(),
                reason,
                detail,
            },
            ServerOp::Typing {
                session,
                platform,
                chat_id,
                on,
            } => ServerOp::Typing {
                session,
                platform,
                chat_id,
                on: *on,
            },
            ServerOp::Reply {
                id,
                session,
                text,
                truncated,
                notice,
                attachments,
            } => ServerOp::Reply {
                id,
                session,
                text,
                truncated: *truncated,
                notice: notice.as_deref(),
                attachments: attachments.clone(),
            },
            ServerOp::Partial { id, session, text } => ServerOp::Partial { id, session, text },
            ServerOp::Cancelled {
                id,
                session,
                reason,
            } => ServerOp::Cancelled {
                id,
                session,
                reason,
            },
            ServerOp::Failed { id, session, error } => ServerOp::Failed { id, session, error },
            ServerOp::Merged { id, session, into } => ServerOp::Merged { id, session, into },
            ServerOp::Error { detail } => ServerOp::Error { detail },
            ServerOp::Pong { max_line_bytes } => ServerOp::Pong {
                max_line_bytes: *max_line_bytes,
            },
        }
    }

    /// The line the frame encoder writes for an op that carries a long text, as the socket
    /// gets it.
    fn streamed(op: &ServerOp) -> Option<Vec<u8>> {
        let body = match op {
            ServerOp::Reply {
                id,
                session,
                text,
                truncated,
                notice: None,
                attachments,
            } => EncodedLine::reply(id, session, text.clone(), *truncated, attachments),
            ServerOp::Partial { id, session, text } => {
                EncodedLine::text_op(TextOp::Partial, id, session, text.clone())
            }
            ServerOp::Failed { id, session, error } => {
                EncodedLine::text_op(TextOp::Failed, id, session, error.clone())
            }
            _ => return None,
        };
        Some(match body {
            EncodedLine::Line(line) => line,
            EncodedLine::Text { head, text, tail } => {
                let mut line = head;
                push_escaped(&mut line, &text);
                line.extend_from_slice(&tail);
                line
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn every_client_op_parses_back_to_itself(op in client_op()) {
            let line = op.line();
            prop_assert!(!line.contains('\n'), "one line: {line}");
            prop_assert_eq!(parse_line(line.as_bytes()), Ok(op));
        }

        #[test]
        fn every_server_op_parses_back_to_itself(op in server_op()) {
            let line = encode(&borrowed(&op));
            prop_assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
            let body = &line[..line.len() - 1];
            let read = ServerLine::parse(body).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&read, &ServerLine { op: op.clone(), redelivery: false });
            // Sent again, marked: the same op, known as a redelivery.
            let mut again = line[..line.len() - 2].to_vec();
            again.extend_from_slice(REDELIVERY_MARK);
            let read = ServerLine::parse(&again[..again.len() - 1])
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(read, ServerLine { op: op.clone(), redelivery: true });
            // The frame encoder writes a long-text op byte for byte as `encode` does.
            if let Some(streamed) = streamed(&op) {
                prop_assert_eq!(streamed, line);
            }
            // A reply's files are found in its line, journaled or not, marked or not (what
            // the spool deletes once it is delivered).
            if let ServerOp::Reply { id, session, text, truncated, notice: None, attachments } = &op {
                let mut frame = EncodedLine::reply(id, session, text.clone(), *truncated, attachments);
                let paths: Vec<String> = attachments.iter().filter_map(|a| a.path.clone()).collect();
                prop_assert_eq!(&frame.attachment_paths(), &paths);
                frame = EncodedLine::from_stored(frame.to_stored());
                if let EncodedLine::Text { tail, .. } = &mut frame {
                    tail.truncate(tail.len() - 2);
                    tail.extend_from_slice(REDELIVERY_MARK);
                }
                prop_assert_eq!(frame.attachment_paths(), paths);
            }
        }
    }
}

/// `attachments` (issue 36) is parsed into typed entries; anything else is refused
/// `invalid`, naming the field.
#[test]
fn a_message_carries_typed_attachments_and_bad_ones_are_invalid() {
    let sha = "ab".repeat(32);
    let line = format!(
        r#"{{"op":"message","id":"m","chat_id":"1","text":"t","attachments":[{{"name":"a.png","mime":"image/png","size":3,"sha256":"{sha}","path":"/s/a.png"}},{{"name":"b","size":9,"skipped":"too big"}}]}}"#
    );
    let ClientOp::Message(m) = parse_line(line.as_bytes()).expect("parsed") else {
        panic!("not a message");
    };
    assert_eq!(m.attachments.len(), 2);
    assert_eq!(m.attachments[0].path.as_deref(), Some("/s/a.png"));
    assert_eq!(m.attachments[1].skipped.as_deref(), Some("too big"));
    // Written back by a bridge, the line parses to the same fields.
    let again = parse_line(ClientOp::Message(m.clone()).line().as_bytes()).expect("again");
    assert_eq!(again, ClientOp::Message(m));
    for bad in [
        r#""x""#,
        r#"[1]"#,
        r#"[{"name":"a","size":-1}]"#,
        r#"{"name":"a"}"#,
    ] {
        let line =
            format!(r#"{{"op":"message","id":"m","chat_id":"1","text":"t","attachments":{bad}}}"#);
        match parse_line(line.as_bytes()) {
            Err(LineError::Invalid { detail, .. }) => {
                assert!(detail.starts_with("attachments must be a list"), "{detail}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}
