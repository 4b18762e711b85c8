//! What flows into the gateway: session keys, messages and commands.

use std::fmt;
use std::sync::Arc;

/// The kind of chat a message came from; it decides how the session key is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChatType {
    /// A one-to-one conversation.
    Dm,
    /// A group chat; keyed per user by default.
    Group,
    /// A broadcast channel.
    Channel,
    /// A thread inside a chat; shared by everyone in it.
    Thread,
}

impl ChatType {
    /// The stable lowercase name used in rendered keys and the wire protocol.
    pub fn as_str(self) -> &'static str {
        match self {
            ChatType::Dm => "dm",
            ChatType::Group => "group",
            ChatType::Channel => "channel",
            ChatType::Thread => "thread",
        }
    }

    /// Parses `dm`, `group`, `channel` or `thread`.
    pub fn parse(s: &str) -> Option<ChatType> {
        match s {
            "dm" => Some(ChatType::Dm),
            "group" => Some(ChatType::Group),
            "channel" => Some(ChatType::Channel),
            "thread" => Some(ChatType::Thread),
            _ => None,
        }
    }
}

/// Why a session key or message could not be built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidInput {
    /// The field at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: &'static str,
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

impl std::error::Error for InvalidInput {}

/// Longest accepted identifier (platform, chat, thread, user, message id).
pub(crate) const MAX_ID_BYTES: usize = 256;

fn check_id(field: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() {
        return Err(InvalidInput {
            field,
            problem: "must not be empty",
        });
    }
    if value.len() > MAX_ID_BYTES {
        return Err(InvalidInput {
            field,
            problem: "longer than 256 bytes",
        });
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidInput {
            field,
            problem: "contains a control character",
        });
    }
    Ok(())
}

/// Identifies one conversation. Cheap to clone (one shared allocation), hashed by its
/// rendered form.
///
/// Rendered as `platform:chat_type:chat_id[:thread:<id>][:user:<id>]`, with `%` and `:`
/// inside components percent-encoded so distinct keys never render alike (`telegram:dm:42`).
#[derive(Clone)]
pub struct SessionKey {
    /// The rendered key. When a component needed escaping it is followed by NUL and the raw
    /// components, NUL-separated (components cannot contain NUL: control characters are
    /// refused); otherwise the components are read off the rendered form itself, so a
    /// common key is its rendered text and nothing else (issue 21: bytes per session).
    text: Arc<str>,
    /// SipHash of the rendered key under a per-process random key, computed once (maps
    /// re-hash on growth without touching the key text, and unequal keys compare fast),
    /// with its lowest bit replaced by [`RAW_PARTS`]. Equal rendered forms have equal
    /// components, so equal keys still have equal values here.
    hash: u64,
}

/// The bit of [`SessionKey::hash`] saying that raw components follow the rendered form.
const RAW_PARTS: u64 = 1;

fn key_hasher() -> &'static std::collections::hash_map::RandomState {
    static HASHER: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    HASHER.get_or_init(std::collections::hash_map::RandomState::new)
}

impl PartialEq for SessionKey {
    fn eq(&self, other: &SessionKey) -> bool {
        self.hash == other.hash && (Arc::ptr_eq(&self.text, &other.text) || self.text == other.text)
    }
}

impl Eq for SessionKey {}

/// Component positions after the rendered key.
const PLATFORM: usize = 1;
const CHAT_TYPE: usize = 2;
const CHAT_ID: usize = 3;
const THREAD_ID: usize = 4;
const USER_ID: usize = 5;

impl SessionKey {
    /// Builds a key. Group chats are keyed per user (as the reference gateway does): the user
    /// id is part of a group key and ignored for every other chat type, so a DM or a thread is
    /// one conversation whoever writes in it.
    pub fn new(
        platform: &str,
        chat_type: ChatType,
        chat_id: &str,
        thread_id: Option<&str>,
        user_id: Option<&str>,
    ) -> Result<SessionKey, InvalidInput> {
        check_id("platform", platform)?;
        check_id("chat_id", chat_id)?;
        if let Some(t) = thread_id {
            check_id("thread_id", t)?;
        }
        let user_id = if chat_type == ChatType::Group {
            user_id
        } else {
            None
        };
        if let Some(u) = user_id {
            check_id("user_id", u)?;
        }
        let parts = [
            platform,
            chat_type.as_str(),
            chat_id,
            thread_id.unwrap_or(""),
            user_id.unwrap_or(""),
        ];
        let escaped = parts.iter().any(|p| p.contains(['%', ':']));
        let raw_len: usize = if escaped {
            parts.iter().map(|p| p.len() + 1).sum()
        } else {
            0
        };
        let mut text = String::with_capacity(
            platform.len() + chat_id.len() + 24 + if escaped { 2 * raw_len } else { 0 },
        );
        push_escaped(&mut text, platform);
        text.push(':');
        text.push_str(chat_type.as_str());
        text.push(':');
        push_escaped(&mut text, chat_id);
        if let Some(t) = thread_id {
            text.push_str(":thread:");
            push_escaped(&mut text, t);
        }
        if let Some(u) = user_id {
            text.push_str(":user:");
            push_escaped(&mut text, u);
        }
        let hash = std::hash::BuildHasher::hash_one(key_hasher(), &text[..]);
        let hash = if escaped {
            for part in parts {
                text.push('\0');
                text.push_str(part);
            }
            hash | RAW_PARTS
        } else {
            hash & !RAW_PARTS
        };
        debug_assert!(!escaped || text.len() == text.find('\0').unwrap_or(0) + raw_len);
        Ok(SessionKey {
            text: text.into(),
            hash,
        })
    }

    /// A direct-message key: `platform:dm:chat_id`.
    pub fn dm(platform: &str, chat_id: &str) -> Result<SessionKey, InvalidInput> {
        SessionKey::new(platform, ChatType::Dm, chat_id, None, None)
    }

    fn part(&self, index: usize) -> &str {
        if self.hash & RAW_PARTS != 0 {
            return self.text.split('\0').nth(index).unwrap_or("");
        }
        // Nothing was escaped: the rendered form's fields are the components, and a `:`
        // only ever separates them.
        let mut fields = self.text.split(':');
        match index {
            PLATFORM => fields.next().unwrap_or(""),
            CHAT_TYPE => fields.nth(1).unwrap_or(""),
            CHAT_ID => fields.nth(2).unwrap_or(""),
            _ => {
                let label = if index == THREAD_ID { "thread" } else { "user" };
                let mut labelled = fields.skip(3);
                while let (Some(l), Some(value)) = (labelled.next(), labelled.next()) {
                    if l == label {
                        return value;
                    }
                }
                ""
            }
        }
    }

    /// The stable rendered form.
    pub fn as_str(&self) -> &str {
        if self.hash & RAW_PARTS != 0 {
            self.text.split('\0').next().unwrap_or("")
        } else {
            &self.text
        }
    }
    /// The platform name.
    pub fn platform(&self) -> &str {
        self.part(PLATFORM)
    }
    /// The chat type.
    pub fn chat_type(&self) -> ChatType {
        ChatType::parse(self.part(CHAT_TYPE)).unwrap_or(ChatType::Dm)
    }
    /// The chat id.
    pub fn chat_id(&self) -> &str {
        self.part(CHAT_ID)
    }
    /// The thread id, if the session is a thread.
    pub fn thread_id(&self) -> Option<&str> {
        Some(self.part(THREAD_ID)).filter(|t| !t.is_empty())
    }
    /// The user id, present only for per-user group sessions.
    pub fn user_id(&self) -> Option<&str> {
        Some(self.part(USER_ID)).filter(|u| !u.is_empty())
    }
}

impl std::hash::Hash for SessionKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Equal keys have equal rendered forms, hence equal precomputed hashes.
        state.write_u64(self.hash);
    }
}

/// A hasher for maps keyed by [`SessionKey`]: it passes the key's precomputed SipHash
/// through instead of hashing it again.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct KeyHashBuilder;

/// The pass-through hasher of [`KeyHashBuilder`].
#[derive(Default, Debug)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-SessionKey input: fold the bytes in (FNV-1a).
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

impl std::hash::BuildHasher for KeyHashBuilder {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

fn push_escaped(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            c => out.push(c),
        }
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn unescape(s: &str) -> Result<String, InvalidInput> {
    let bad = InvalidInput {
        field: "session key",
        problem: "has a % that is not %25 or %3A",
    };
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let code = rest.get(at..at + 3).ok_or(bad)?;
        out.push(match code {
            "%25" => '%',
            "%3A" => ':',
            _ => return Err(bad),
        });
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses the rendered form (`platform:chat_type:chat_id[:thread:<id>][:user:<id>]`), so a key
/// read from a log line or the status round-trips: `key.to_string().parse() == Ok(key)`.
impl std::str::FromStr for SessionKey {
    type Err = InvalidInput;

    fn from_str(s: &str) -> Result<SessionKey, InvalidInput> {
        let malformed = |problem| InvalidInput {
            field: "session key",
            problem,
        };
        let mut parts = s.split(':');
        let (Some(platform), Some(chat_type), Some(chat_id)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed("is not platform:chat_type:chat_id"));
        };
        let chat_type = ChatType::parse(chat_type).ok_or(malformed("has an unknown chat type"))?;
        let (mut thread, mut user) = (None, None);
        while let Some(label) = parts.next() {
            let value = parts
                .next()
                .ok_or(malformed("has a label without a value"))?;
            match label {
                "thread" if thread.is_none() && user.is_none() => thread = Some(unescape(value)?),
                "user" if user.is_none() && chat_type == ChatType::Group => {
                    user = Some(unescape(value)?)
                }
                _ => return Err(malformed("has an unexpected or misplaced component")),
            }
        }
        SessionKey::new(
            &unescape(platform)?,
            chat_type,
            &unescape(chat_id)?,
            thread.as_deref(),
            user.as_deref(),
        )
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionKey({})", self.as_str())
    }
}

/// A control command: it bypasses the queue and never reaches the agent as text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// Cancel the running turn and every queued message.
    Stop,
    /// Stop, then close the session's agent so the next message gets a fresh one.
    Reset,
    /// Report the session's state, running time and queue depth.
    Status,
}

impl Command {
    /// Recognises `/stop`, `/new`, `/reset` and `/status` (optionally followed by whitespace
    /// and arguments, or by `@botname` as Telegram sends them). Anything else is not a command.
    pub fn parse(text: &str) -> Option<Command> {
        let word = text.split_whitespace().next()?;
        let word = word.split('@').next().unwrap_or(word);
        match word {
            "/stop" => Some(Command::Stop),
            "/new" | "/reset" => Some(Command::Reset),
            "/status" => Some(Command::Status),
            _ => None,
        }
    }

    /// The command's name without the slash.
    pub fn name(self) -> &'static str {
        match self {
            Command::Stop => "stop",
            Command::Reset => "reset",
            Command::Status => "status",
        }
    }
}

/// What a message asks for: an agent turn on its text, or a command.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Body {
    /// Text for the agent.
    Text(String),
    /// A control command.
    Command(Command),
}

/// Largest accepted `meta` object, serialized (16 KiB).
pub(crate) const MAX_META_BYTES: usize = 16 * 1024;

fn check_meta_size(meta: &str) -> Result<(), InvalidInput> {
    if meta.len() > MAX_META_BYTES {
        return Err(InvalidInput {
            field: "meta",
            problem: "larger than 16 KiB",
        });
    }
    Ok(())
}

/// Who sent a message and what the platform said about it, whatever the chat type. Agents
/// see it in [`crate::TurnInput`]. Cheap to clone (shared strings).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MessageContext {
    /// The sender's id on the platform.
    pub user_id: Option<Arc<str>>,
    /// The sender's display name.
    pub user_name: Option<Arc<str>>,
    /// A JSON object from the bridge (reply-to, attachments, anything the platform adds),
    /// serialized; at most 16 KiB.
    pub meta: Option<Arc<str>>,
    /// Files sent with the message, in the gateway's spool (or skipped, saying why): see
    /// [`Attachment`](crate::Attachment). `None` for most messages (one pointer wide: a
    /// message stays small); read it with [`MessageContext::attachments`].
    pub attachments: Option<Arc<Vec<crate::Attachment>>>,
}

impl MessageContext {
    /// The message's files (empty when it has none).
    pub fn attachments(&self) -> &[crate::Attachment] {
        self.attachments.as_deref().map_or(&[], Vec::as_slice)
    }
}

/// One inbound message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Opaque id, unique per origin; every event about this message carries it.
    pub id: Arc<str>,
    /// The conversation it belongs to.
    pub session: SessionKey,
    /// Text or command.
    pub body: Body,
    /// Sender and platform metadata.
    pub context: MessageContext,
}

impl Message {
    /// A chat message: text starting with `/stop`, `/new`, `/reset` or `/status` becomes a
    /// command, anything else is agent text.
    pub fn new(id: &str, session: SessionKey, text: &str) -> Result<Message, InvalidInput> {
        let body = match Command::parse(text) {
            Some(cmd) => Body::Command(cmd),
            None => Body::Text(text.to_owned()),
        };
        Message::with_body(id, session, body)
    }

    /// A message with an explicit body (no command parsing).
    pub fn with_body(id: &str, session: SessionKey, body: Body) -> Result<Message, InvalidInput> {
        check_id("id", id)?;
        Ok(Message {
            id: id.into(),
            session,
            body,
            context: MessageContext::default(),
        })
    }

    /// Names the sender (any chat type; for groups the session key also carries the id).
    pub fn from_user(
        mut self,
        user_id: &str,
        user_name: Option<&str>,
    ) -> Result<Message, InvalidInput> {
        check_id("user_id", user_id)?;
        if let Some(name) = user_name {
            check_id("user_name", name)?;
        }
        self.context.user_id = Some(user_id.into());
        self.context.user_name = user_name.map(Into::into);
        Ok(self)
    }

    /// Attaches platform metadata: `meta` must be a JSON object of at most
    /// 16 KiB once serialized.
    pub fn with_meta(self, meta: &str) -> Result<Message, InvalidInput> {
        check_meta_size(meta)?;
        match serde_json::from_str::<serde_json::Value>(meta) {
            Ok(serde_json::Value::Object(_)) => self.with_object_meta(meta),
            _ => Err(InvalidInput {
                field: "meta",
                problem: "must be a JSON object",
            }),
        }
    }

    /// Attaches files (the bridge's entries, checked by the caller against the spool).
    pub fn with_attachments(mut self, attachments: Vec<crate::Attachment>) -> Message {
        self.context.attachments = (!attachments.is_empty()).then(|| Arc::new(attachments));
        self
    }

    /// Attaches metadata its caller already parsed as a JSON object (the bridge protocol's
    /// line parse), so that it is not parsed again: only its size is checked.
    pub(crate) fn with_object_meta(mut self, meta: &str) -> Result<Message, InvalidInput> {
        check_meta_size(meta)?;
        self.context.meta = Some(meta.into());
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_render_stably_and_never_collide_through_separators() {
        let k = SessionKey::dm("telegram", "42").unwrap();
        assert_eq!(k.as_str(), "telegram:dm:42");
        let a = SessionKey::new("matrix", ChatType::Group, "!a:b", None, Some("u")).unwrap();
        let b = SessionKey::new("matrix", ChatType::Group, "!a", Some("b"), Some("u")).unwrap();
        assert_eq!(a.as_str(), "matrix:group:!a%3Ab:user:u");
        assert_ne!(a, b);
        assert_ne!(a.as_str(), b.as_str());
    }

    #[test]
    fn group_keys_are_per_user_and_threads_are_shared() {
        let g1 = SessionKey::new("slack", ChatType::Group, "C1", None, Some("u1")).unwrap();
        let g2 = SessionKey::new("slack", ChatType::Group, "C1", None, Some("u2")).unwrap();
        assert_ne!(g1, g2);
        let t1 = SessionKey::new("slack", ChatType::Thread, "C1", Some("T"), Some("u1")).unwrap();
        let t2 = SessionKey::new("slack", ChatType::Thread, "C1", Some("T"), Some("u2")).unwrap();
        assert_eq!(t1, t2);
        assert_eq!(t1.user_id(), None);
        assert_eq!(t1.thread_id(), Some("T"));
        assert_eq!(
            (g1.platform(), g1.chat_id(), g1.user_id()),
            ("slack", "C1", Some("u1"))
        );
        assert_eq!(g1.chat_type(), ChatType::Group);
    }

    /// A key whose components needed no escaping is its rendered text alone (one small
    /// allocation, issue 21); one that did keeps the raw components too, and both give
    /// every component back.
    #[test]
    fn a_key_stores_its_components_only_when_escaping_changed_them() {
        let plain =
            SessionKey::new("slack", ChatType::Group, "C1", Some("T.1"), Some("u1")).expect("key");
        assert_eq!(plain.text.len(), plain.as_str().len());
        assert_eq!(plain.as_str(), "slack:group:C1:thread:T.1:user:u1");
        let escaped =
            SessionKey::new("m%", ChatType::Group, "!a:b", Some("t"), Some("u:")).expect("key");
        assert!(escaped.text.len() > escaped.as_str().len());
        assert_eq!(escaped.as_str(), "m%25:group:!a%3Ab:thread:t:user:u%3A");
        for (key, parts) in [
            (&plain, ("slack", "C1", Some("T.1"), Some("u1"))),
            (&escaped, ("m%", "!a:b", Some("t"), Some("u:"))),
        ] {
            let got = (
                key.platform(),
                key.chat_id(),
                key.thread_id(),
                key.user_id(),
            );
            assert_eq!(got, parts);
            assert_eq!(key.chat_type(), ChatType::Group);
        }
        let dm = SessionKey::dm("telegram", "42").expect("key");
        assert_eq!((dm.thread_id(), dm.user_id()), (None, None));
        assert_eq!(dm.text.len(), "telegram:dm:42".len());
    }

    #[test]
    fn bad_identifiers_are_rejected_with_the_field_named() {
        let e = SessionKey::dm("", "1").unwrap_err();
        assert_eq!(e.field, "platform");
        let e = SessionKey::dm("tg", "a\nb").unwrap_err();
        assert_eq!(e.field, "chat_id");
        let k = SessionKey::dm("tg", "1").unwrap();
        assert_eq!(Message::new("", k, "hi").unwrap_err().field, "id");
    }

    #[test]
    fn sender_and_meta_are_validated() {
        let k = SessionKey::dm("tg", "1").unwrap();
        let m = Message::new("m", k.clone(), "hi")
            .unwrap()
            .from_user("7", Some("Ann"))
            .unwrap()
            .with_meta(r#"{"reply_to":"m0"}"#)
            .unwrap();
        assert_eq!(m.context.user_id.as_deref(), Some("7"));
        assert_eq!(m.context.user_name.as_deref(), Some("Ann"));
        assert_eq!(m.context.meta.as_deref(), Some(r#"{"reply_to":"m0"}"#));
        let bad = |meta: &str| Message::new("m", k.clone(), "hi").unwrap().with_meta(meta);
        assert_eq!(bad("[1]").unwrap_err().field, "meta");
        assert_eq!(bad("{").unwrap_err().field, "meta");
        let big = format!(r#"{{"x":"{}"}}"#, "a".repeat(MAX_META_BYTES));
        assert_eq!(bad(&big).unwrap_err().problem, "larger than 16 KiB");
        let at_limit = format!(r#"{{"x":"{}"}}"#, "a".repeat(MAX_META_BYTES - 8));
        assert!(bad(&at_limit).is_ok());
        let e = Message::new("m", k, "hi").unwrap().from_user("", None);
        assert_eq!(e.unwrap_err().field, "user_id");
    }

    #[test]
    fn commands_are_recognised_only_as_the_leading_word() {
        assert_eq!(Command::parse("/stop"), Some(Command::Stop));
        assert_eq!(Command::parse("  /new please"), Some(Command::Reset));
        assert_eq!(Command::parse("/reset@mybot"), Some(Command::Reset));
        assert_eq!(Command::parse("/status"), Some(Command::Status));
        assert_eq!(Command::parse("/stopper"), None);
        assert_eq!(Command::parse("please /stop"), None);
        assert_eq!(Command::parse(""), None);
    }

    #[test]
    fn keys_parse_back_from_their_rendered_form() {
        let keys = [
            SessionKey::dm("telegram", "42").unwrap(),
            SessionKey::new(
                "matrix",
                ChatType::Group,
                "!a:b%c",
                Some("t:1"),
                Some("u%:"),
            )
            .unwrap(),
            SessionKey::new("slack", ChatType::Channel, "C1", Some("169.2"), None).unwrap(),
            SessionKey::new("x", ChatType::Group, "g", None, None).unwrap(),
        ];
        for key in keys {
            let parsed: SessionKey = key.to_string().parse().unwrap();
            assert_eq!(parsed, key);
            assert_eq!(
                (parsed.thread_id(), parsed.user_id()),
                (key.thread_id(), key.user_id())
            );
        }
    }

    #[test]
    fn malformed_keys_are_refused_with_the_reason() {
        for (text, problem) in [
            ("telegram", "is not platform:chat_type:chat_id"),
            ("telegram:dm", "is not platform:chat_type:chat_id"),
            ("telegram:room:1", "has an unknown chat type"),
            ("telegram:dm:1:thread", "has a label without a value"),
            (
                "telegram:dm:1:user:7",
                "has an unexpected or misplaced component",
            ),
            (
                "x:group:1:user:7:thread:2",
                "has an unexpected or misplaced component",
            ),
            (
                "x:dm:1:thread:2:thread:3",
                "has an unexpected or misplaced component",
            ),
            (
                "x:dm:1:color:red",
                "has an unexpected or misplaced component",
            ),
            ("x:dm:1%", "has a % that is not %25 or %3A"),
            ("x:dm:1%2", "has a % that is not %25 or %3A"),
            ("x:dm:%41", "has a % that is not %25 or %3A"),
        ] {
            let err = text.parse::<SessionKey>().unwrap_err();
            assert_eq!(err.problem, problem, "{text}");
        }
        // Components are still checked as SessionKey::new checks them.
        assert_eq!("x:dm:".parse::<SessionKey>().unwrap_err().field, "chat_id");
    }

    proptest::proptest! {
        #[test]
        fn any_valid_key_round_trips(
            platform in "[a-z%:]{1,6}",
            chat in "[0-9a-z%:!]{1,8}",
            thread in proptest::option::of("[0-9%:.]{1,5}"),
            user in proptest::option::of("[a-z%:]{1,5}"),
            group in proptest::bool::ANY,
        ) {
            let chat_type = if group { ChatType::Group } else { ChatType::Dm };
            let key = SessionKey::new(&platform, chat_type, &chat, thread.as_deref(), user.as_deref()).unwrap();
            let parsed: SessionKey = key.to_string().parse().unwrap();
            proptest::prop_assert_eq!(&parsed, &key);
            let user = if group { user.as_deref() } else { None };
            proptest::prop_assert_eq!(
                (key.platform(), key.chat_id(), key.thread_id(), key.user_id()),
                (platform.as_str(), chat.as_str(), thread.as_deref(), user)
            );
        }
    }
}
