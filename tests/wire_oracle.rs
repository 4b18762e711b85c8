//! The parser of a client line as it was before the typed parse (`src/wire/parse.rs`): the
//! line built into a `serde_json::Value`, its fields read out of the tree. Kept, for the tests
//! only, as the oracle the typed parse must agree with on every line, errors included.

use serde_json::{Map, Value};

use turnstile::ChatType;
use turnstile::MessageFields;
use turnstile::internal::wire::{ClientOp, LineError};

/// The first `max` characters of `s`.
fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Parses one line (without its newline).
fn parse_line(line: &[u8]) -> Result<ClientOp, LineError> {
    let value: Value = serde_json::from_slice(line)
        .map_err(|e| LineError::Malformed(format!("invalid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(LineError::Malformed("expected a JSON object".into()));
    };
    let op = match obj.get("op") {
        Some(Value::String(op)) => op.as_str(),
        Some(_) => return Err(LineError::Malformed("op must be a string".into())),
        None => return Err(LineError::Malformed("missing op".into())),
    };
    match op {
        "ping" => Ok(ClientOp::Ping),
        "hello" => {
            let field = |name: &str| match obj.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(LineError::Malformed(format!(
                    "hello: {name} must be a string"
                ))),
            };
            let acks = match obj.get("acks") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(LineError::Malformed("hello: acks must be a boolean".into()));
                }
            };
            Ok(ClientOp::Hello {
                platform: field("platform")?,
                token: field("token")?,
                acks,
            })
        }
        "delivered" => {
            let Some(Value::Array(ids)) = obj.get("ids") else {
                return Err(LineError::Malformed(
                    "delivered: ids must be an array of strings".into(),
                ));
            };
            let ids = ids
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(LineError::Malformed(
                        "delivered: ids must be an array of strings".into(),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(ClientOp::Delivered { ids })
        }
        "message" => parse_message(&obj),
        "link" => {
            let up = match obj.get("state") {
                Some(Value::String(s)) if s == "up" => true,
                Some(Value::String(s)) if s == "down" => false,
                _ => {
                    return Err(LineError::Malformed(
                        "link: state must be \"up\" or \"down\"".into(),
                    ));
                }
            };
            let detail = match obj.get("detail") {
                None | Some(Value::Null) => None,
                Some(Value::String(d)) => Some(truncate(d, 512).to_owned()),
                Some(_) => {
                    return Err(LineError::Malformed("link: detail must be a string".into()));
                }
            };
            Ok(ClientOp::Link { up, detail })
        }
        "may_use" => {
            let bad = |what: &str| LineError::Malformed(format!("may_use: {what}"));
            let id = match obj.get("id") {
                Some(Value::String(id)) if !id.is_empty() => id.clone(),
                _ => return Err(bad("id must be a non-empty string")),
            };
            let Some(Value::String(user_id)) = obj.get("user_id") else {
                return Err(bad("user_id must be a string"));
            };
            let optional = |name: &str| match obj.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(&format!("{name} must be a string or null"))),
            };
            Ok(ClientOp::MayUse {
                id,
                platform: optional("platform")?,
                user_id: user_id.clone(),
                chat_id: optional("chat_id")?,
            })
        }
        other => Err(LineError::Malformed(format!(
            "unknown op: {}",
            truncate(other, 64)
        ))),
    }
}

fn parse_message(obj: &Map<String, Value>) -> Result<ClientOp, LineError> {
    let id = match obj.get("id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        _ => {
            return Err(LineError::Malformed(
                "message: id must be a non-empty string".into(),
            ));
        }
    };
    let invalid = |detail: String| LineError::Invalid {
        id: id.clone(),
        detail,
    };
    let required = |name: &str| match obj.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(invalid(format!("{name} must be a string"))),
        None => Err(invalid(format!("{name} is required"))),
    };
    let optional = |name: &str| match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("{name} must be a string or null"))),
    };
    let chat_type = match optional("chat_type")? {
        None => ChatType::Dm,
        Some(t) => ChatType::parse(&t)
            .ok_or_else(|| invalid("chat_type must be one of dm, group, channel, thread".into()))?,
    };
    let meta = match obj.get("meta") {
        None | Some(Value::Null) => None,
        // Re-serialized compactly: the agent gets a canonical object, bounded by the line.
        Some(v @ Value::Object(_)) => Some(v.to_string()),
        Some(_) => return Err(invalid("meta must be a JSON object or null".into())),
    };
    Ok(ClientOp::Message(MessageFields {
        chat_id: required("chat_id")?,
        text: required("text")?,
        attachments: Vec::new(),
        platform: optional("platform")?,
        user_id: optional("user_id")?,
        user_name: optional("user_name")?,
        meta,
        thread_id: optional("thread_id")?,
        chat_type,
        id,
    }))
}

mod agreement {
    //! The typed parse answers every line as the `Value` parse did.

    use proptest::prelude::*;

    use turnstile::internal::wire::parse_line;

    /// Both parsers on `line`, required equal.
    fn agree(line: &[u8]) {
        let typed = parse_line(line);
        let oracle = super::parse_line(line);
        assert_eq!(typed, oracle, "line: {:?}", String::from_utf8_lossy(line));
    }

    /// Lines where a lax skip of the unread fields (`IgnoredAny`) or a typed struct would
    /// answer differently from `Value`.
    #[test]
    fn tricky_lines_agree_with_the_value_parse() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let lines: Vec<Vec<u8>> = vec![
            br#"{"op":"ping","x":1e400}"#.to_vec(),
            br#"{"op":"ping","x":-1e400}"#.to_vec(),
            br#"{"op":"ping","x":"\ud800"}"#.to_vec(),
            br#"{"op":"ping","x":"\udc00\ud800"}"#.to_vec(),
            br#"{"op":"ping","x":{"\ud800":1}}"#.to_vec(),
            br#"{"op":"ping","\ud800":1}"#.to_vec(),
            br#"{"op":"ping","x":"\q"}"#.to_vec(),
            b"{\"op\":\"ping\",\"x\":\"\xff\"}".to_vec(),
            b"{\"op\":\"ping\",\"\xc3\":0}".to_vec(),
            b"{\"op\":\"ping\",\"x\":\"a\tb\"}".to_vec(),
            format!(r#"{{"op":"ping","x":{}}}"#, deep(126)).into_bytes(),
            format!(r#"{{"op":"ping","x":{}}}"#, deep(127)).into_bytes(),
            format!(r#"{{"op":"ping","x":{}}}"#, deep(128)).into_bytes(),
            format!(r#"{{"op":"delivered","ids":["a",{}]}}"#, deep(127)).into_bytes(),
            format!(r#"{{"op":"message","id":"m","chat_id":"1","text":"t","meta":{{"a":{}}}}}"#, deep(126)).into_bytes(),
            format!(r#"{{"op":"message","id":"m","chat_id":"1","text":"t","meta":{{"a":{}}}}}"#, deep(127)).into_bytes(),
            deep(128).into_bytes(),
            deep(129).into_bytes(),
            br#"{"op":"message","id":1,"id":"m","chat_id":"1","text":"t"}"#.to_vec(),
            br#"{"op":"message","id":"m","id":1,"chat_id":"1","text":"t"}"#.to_vec(),
            br#"{"op":"message","op":"ping"}"#.to_vec(),
            br#"{"\u006fp":"ping"}"#.to_vec(),
            br#"{"op":"p\u0069ng"}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t","meta":{"b":1,"a":{"y":[1.50,2e3]},"b":"\u00e9"}}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t","meta":{"b":1} ,"meta":null}"#.to_vec(),
            br#"{"op":"delivered","ids":["a","b\n",3,"c"]}"#.to_vec(),
            br#"{"op":"delivered","ids":["a"],"ids":"a"}"#.to_vec(),
            // A good `ids` is kept (its strings, escaped or not), an empty one too.
            br#"{"op":"delivered","ids":["a","b\n"]}"#.to_vec(),
            br#"{"op":"delivered","ids":[]}"#.to_vec(),
            br#"{"op":"may_use","id":"q","user_id":"@b:hs","chat_id":"!r","platform":null}"#.to_vec(),
            br#"{"op":"may_use","id":"","user_id":"u"}"#.to_vec(),
            br#"{"op":"may_use","id":"q","user_id":3}"#.to_vec(),
            br#"{"op":"may_use","id":"q","user_id":"u","chat_id":1}"#.to_vec(),
            br#"{"op":"may_use","id":"q","user_id":"u","platform":[]}"#.to_vec(),
            // A negative number is a value of the wrong kind, not an absent field.
            br#"{"op":"message","id":"m","chat_id":-1,"text":"t"}"#.to_vec(),
            br#"{"op":"hello","acks":-1}"#.to_vec(),
            br#"{"op":"hello","acks":1,"platform":2,"token":3}"#.to_vec(),
            br#"{"op":"hello","platform":2,"token":3}"#.to_vec(),
            br#"{"op":"message","id":"m","text":1,"chat_type":"room","meta":1}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_type":7,"meta":1}"#.to_vec(),
            br#"{"op":"message","id":"","chat_id":1}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":1,"text":1}"#.to_vec(),
            br#"{"op":"message","text":1,"id":"m"}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t","thread_id":1,"user_id":2}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t"} x"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t"}{}"#.to_vec(),
            br#"{"op":"message","id":"m","chat_id":"1","text":"t""#.to_vec(),
            br#"{"op":null}"#.to_vec(),
            br#"{"op":["ping"]}"#.to_vec(),
            format!(r#"{{"op":"{}"}}"#, "é".repeat(70)).into_bytes(),
            b"".to_vec(),
            b"   ".to_vec(),
            b"\"op\"".to_vec(),
            b"null".to_vec(),
            b"18446744073709551616".to_vec(),
            b"{\"op\":\"ping\",}".to_vec(),
            b"{\"op\" \"ping\"}".to_vec(),
            b"{op:\"ping\"}".to_vec(),
            b"{\"op\":\"ping\",\"x\":01}".to_vec(),
            b"{\"op\":\"ping\",\"x\":tru}".to_vec(),
        ];
        for line in &lines {
            agree(line);
        }
    }

    /// JSON text of a string: plain, the protocol's words, or pieces with escapes, bad
    /// escapes, surrogates, raw control characters and non-ASCII.
    fn string() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-z0-9 ]{0,6}",
            Just("ping".to_string()),
            Just("hello".to_string()),
            Just("delivered".to_string()),
            Just("message".to_string()),
            Just("group".to_string()),
            Just("thread".to_string()),
            Just(r"\n".to_string()),
            Just(r#"\""#.to_string()),
            Just(r"\\".to_string()),
            Just(r"\u0041".to_string()),
            Just(r"\ud83d\ude00".to_string()),
            Just(r"\ud800".to_string()),
            Just(r"\udc00".to_string()),
            Just(r"\x".to_string()),
            Just("\t".to_string()),
            Just("é😀".to_string()),
        ];
        prop::collection::vec(piece, 0..4).prop_map(|p| format!("\"{}\"", p.concat()))
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| format!("{n:e}")),
            prop::sample::select(vec![
                "0",
                "-0",
                "1.5",
                "1e400",
                "-1e400",
                "18446744073709551616",
                "01",
                "1.",
                "-",
                "1e",
                "0.1e-5",
            ])
            .prop_map(str::to_string),
        ]
    }

    /// JSON text of any value, nested a few levels.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            4 => string(),
            2 => number(),
            1 => prop::sample::select(vec!["true", "false", "null", "nul", "[]", "{}"])
                .prop_map(str::to_string),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key(), inner), 0..4).prop_map(|kv| {
                    let kv: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", kv.join(","))
                }),
            ]
        })
    }

    /// A key: mostly one the protocol reads (also spelled with an escape), sometimes not.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => prop::sample::select(vec![
                "op", "id", "platform", "token", "acks", "ids", "chat_id", "chat_type",
                "user_id", "user_name", "meta", "thread_id", "text",
            ])
            .prop_map(|k| format!("\"{k}\"")),
            1 => Just(r#""\u006fp""#.to_string()),
            1 => string(),
        ]
    }

    /// A plausible value for `key`: of the right type more often than not.
    fn field() -> impl Strategy<Value = (String, String)> {
        key().prop_flat_map(|k| {
            let right = match k.as_str() {
                r#""op""# => prop::sample::select(vec![
                    r#""message""#,
                    r#""hello""#,
                    r#""delivered""#,
                    r#""ping""#,
                    r#""dance""#,
                ])
                .prop_map(str::to_string)
                .boxed(),
                r#""acks""# => prop::sample::select(vec!["true", "false", "null"])
                    .prop_map(str::to_string)
                    .boxed(),
                r#""ids""# => prop::collection::vec(string(), 0..4)
                    .prop_map(|v| format!("[{}]", v.join(",")))
                    .boxed(),
                r#""chat_type""# => prop::sample::select(vec![
                    r#""dm""#,
                    r#""group""#,
                    r#""channel""#,
                    r#""thread""#,
                    r#""room""#,
                ])
                .prop_map(str::to_string)
                .boxed(),
                _ => string().boxed(),
            };
            (Just(k), prop_oneof![3 => right, 1 => value()])
        })
    }

    /// An object line: fields (duplicates possible) with random spacing.
    fn object() -> impl Strategy<Value = String> {
        (prop::collection::vec(field(), 0..10), any::<bool>()).prop_map(|(fs, spaced)| {
            let sep = if spaced { " , " } else { "," };
            let colon = if spaced { " : " } else { ":" };
            let kv: Vec<String> = fs
                .into_iter()
                .map(|(k, v)| format!("{k}{colon}{v}"))
                .collect();
            format!("{{{}}}", kv.join(sep))
        })
    }

    /// A `message` whose every field is absent, null, of the right type or of a wrong one,
    /// in any order: which bad field is answered first.
    fn message() -> impl Strategy<Value = String> {
        let names = [
            "id",
            "chat_id",
            "text",
            "platform",
            "user_id",
            "user_name",
            "thread_id",
            "chat_type",
            "meta",
        ];
        let one = |name: &'static str| {
            let right = match name {
                "id" => prop::sample::select(vec![r#""m""#, r#""""#])
                    .prop_map(str::to_string)
                    .boxed(),
                "chat_type" => prop::sample::select(vec![r#""group""#, r#""room""#])
                    .prop_map(str::to_string)
                    .boxed(),
                "meta" => prop::sample::select(vec![r#"{"b":[1.0],"a":"é"}"#, "{}"])
                    .prop_map(str::to_string)
                    .boxed(),
                _ => string().boxed(),
            };
            prop_oneof![
                3 => right.prop_map(Some),
                1 => Just(None),
                1 => Just(Some("null".to_string())),
                1 => prop::sample::select(vec!["1", "true", "[]", "{}", r#"["x"]"#])
                    .prop_map(|v| Some(v.to_string())),
            ]
            .prop_map(move |v| v.map(|v| format!("\"{name}\":{v}")))
        };
        names
            .map(one)
            .to_vec()
            .prop_map(|fs| fs.into_iter().flatten().collect::<Vec<_>>())
            .prop_shuffle()
            .prop_map(|fs| format!(r#"{{"op":"message",{}}}"#, fs.join(",")).replace(",}", "}"))
    }

    /// A line: an object, another JSON value, or bytes; then, sometimes, damaged.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        let base = prop_oneof![
            4 => message().prop_map(String::into_bytes),
            8 => object().prop_map(String::into_bytes),
            1 => value().prop_map(String::into_bytes),
            1 => prop::collection::vec(any::<u8>(), 0..40),
        ];
        (base, 0u8..10, any::<prop::sample::Index>(), any::<u8>()).prop_map(
            |(mut line, damage, at, byte)| {
                let i = at.index(line.len() + 1);
                match damage {
                    0 => line.truncate(i),
                    1 => line.insert(i, byte),
                    2 => line.extend_from_slice(b" x"),
                    3 => {
                        line.insert(0, b'[');
                        line.push(b']');
                    }
                    _ => {}
                }
                line
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn any_line_gets_the_answer_the_value_parse_gave(line in line()) {
            agree(&line);
        }
    }
}
