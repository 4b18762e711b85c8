//! IRC lines: parsing what the server sends, and formatting replies so each line stays
//! within 512 bytes as the server relays it.

use std::str::FromStr;

use crate::message::{ChatType, SessionKey};
use crate::platforms::map_command;
use crate::platforms::split::irc_lines;

/// Longest IRC line on the wire, CRLF included (RFC 1459/2812).
pub(crate) const IRC_MAX_LINE: usize = 512;

/// One parsed IRC line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct IrcLine<'a> {
    /// The source (`nick!user@host` or a server name), without the colon.
    pub prefix: Option<&'a str>,
    /// The command or numeric, e.g. `PRIVMSG`, `001`.
    pub command: &'a str,
    /// The parameters; the trailing one (after ` :`) may contain spaces.
    pub params: Vec<&'a str>,
}

/// Parses one IRC line (without CRLF); IRCv3 tags are skipped. `None` for an empty line.
pub(crate) fn parse_line(line: &str) -> Option<IrcLine<'_>> {
    let mut rest = line.trim_end_matches(['\r', '\n']);
    if rest.starts_with('@') {
        rest = rest.split_once(' ').map_or("", |(_, r)| r);
    }
    let mut prefix = None;
    if let Some(p) = rest.strip_prefix(':') {
        let (pre, r) = p.split_once(' ')?;
        prefix = Some(pre);
        rest = r;
    }
    let rest = rest.trim_start_matches(' ');
    let (head, trailing) = match rest.split_once(" :") {
        Some((h, t)) => (h, Some(t)),
        None => match rest.strip_prefix(':') {
            Some(t) => ("", Some(t)),
            None => (rest, None),
        },
    };
    let mut words = head.split(' ').filter(|w| !w.is_empty());
    let command = words.next()?;
    let mut params: Vec<&str> = words.collect();
    params.extend(trailing);
    Some(IrcLine {
        prefix,
        command,
        params,
    })
}

/// The nick of a `nick!user@host` prefix.
pub(super) fn nick_of(prefix: &str) -> &str {
    prefix.split(['!', '@']).next().unwrap_or(prefix)
}

/// The `n`th alternate of a taken nick: `NICK_`, then `NICK_2`, `NICK_3`, …
pub(crate) fn alternate_nick(base: &str, n: u32) -> String {
    if n <= 1 {
        format!("{base}_")
    } else {
        format!("{base}_{n}")
    }
}

/// Where a chat line came from and what it asked, once it is for the bot.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Addressed {
    /// The chat: the channel, or the sender's nick for a private message.
    pub chat_id: String,
    /// `group` in a channel, `dm` in private.
    pub chat_type: ChatType,
    /// The sender's nick.
    pub sender: String,
    /// The text with the address removed and `!` commands mapped.
    pub text: String,
}

/// Decides whether a PRIVMSG from `sender` to `target` is for the bot (`own_nick`): a private
/// message, or a channel line starting with `own_nick:` / `own_nick,` (IRC nicks compare
/// case-insensitively). CTCP (`\x01…`) and empty texts are not.
pub(crate) fn addressed(
    own_nick: &str,
    sender: &str,
    target: &str,
    text: &str,
) -> Option<Addressed> {
    // CTCP (`\x01…`), also behind leading whitespace.
    if text.trim_start().starts_with('\x01') {
        return None;
    }
    let is_channel = target.starts_with(['#', '&', '+', '!']);
    let (chat_id, chat_type, body) = if is_channel {
        let head = text.get(..own_nick.len())?;
        if !head.eq_ignore_ascii_case(own_nick) {
            return None;
        }
        let rest = &text[own_nick.len()..];
        let body = rest.strip_prefix([':', ','])?;
        (target.to_owned(), ChatType::Group, body)
    } else if target.eq_ignore_ascii_case(own_nick) {
        (sender.to_owned(), ChatType::Dm, text)
    } else {
        return None;
    };
    let body = body.trim();
    if body.is_empty() {
        return None;
    }
    Some(Addressed {
        chat_id,
        chat_type,
        sender: sender.to_owned(),
        text: map_command(body).into_owned(),
    })
}

/// Where a result goes: the PRIVMSG target and, in a channel, whom to address. Built from the
/// session key, so results owed from before a restart of the bridge find their chat too.
#[derive(Debug, PartialEq, Eq, Clone)]
pub(crate) struct ReplyTarget {
    /// Channel or nick.
    pub target: String,
    /// The nick the first line starts with (`nick: `), in a channel.
    pub addressee: Option<String>,
}

/// The route of a session key (`irc:group:#chan:user:ann` → `#chan`, addressed to `ann`;
/// `irc:dm:ann` → `ann`).
pub(crate) fn route_of(session: &str) -> Option<ReplyTarget> {
    let key = SessionKey::from_str(session).ok()?;
    Some(match key.chat_type() {
        ChatType::Group => ReplyTarget {
            target: key.chat_id().to_owned(),
            addressee: key.user_id().map(str::to_owned),
        },
        _ => ReplyTarget {
            target: key.chat_id().to_owned(),
            addressee: None,
        },
    })
}

/// Bytes of text one PRIVMSG to `target` may carry so that the line the server relays —
/// `:<source> PRIVMSG <target> :<text>\r\n`, `source` being `nick!user@host` — stays within
/// 512 bytes.
pub(crate) fn text_budget(source_len: usize, target: &str) -> usize {
    let overhead = 1 + source_len + 1 + "PRIVMSG ".len() + target.len() + " :".len() + 2;
    IRC_MAX_LINE.saturating_sub(overhead)
}

/// A reply as the PRIVMSG texts to send, at most `max_lines` (the last one then says what
/// was left out).
pub(crate) fn reply_lines(
    route: &ReplyTarget,
    text: &str,
    budget: usize,
    max_lines: usize,
) -> Vec<String> {
    let text = match &route.addressee {
        Some(nick) => format!("{nick}: {text}"),
        None => text.to_owned(),
    };
    let mut lines = irc_lines(&text, budget.max(16));
    if lines.is_empty() {
        lines.push("[empty reply]".into());
    }
    let max_lines = max_lines.max(2);
    if lines.len() > max_lines {
        let left: usize = lines[max_lines - 1..].iter().map(String::len).sum();
        lines.truncate(max_lines - 1);
        lines.push(format!(
            "[{left} more bytes not shown: the reply is too long for IRC]"
        ));
    }
    lines
}

/// Source length to assume before the server told it: the nick, a 10-byte user with `~`,
/// and a 63-byte host (the longest DNS label run a server shows).
pub(super) fn conservative_source_len(nick: &str) -> usize {
    nick.len() + 1 + 11 + 1 + 63
}
