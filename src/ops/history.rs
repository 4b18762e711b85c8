//! `GET /history?session=KEY` on the HTTP endpoint: a session's stored conversation (the
//! openai agent's durable history, `serve --data-dir` or `--cluster`) as export lines, while
//! the gateway runs (`turnstile history export --http`).
//!
//! Answered on the endpoint's thread through the store's memory loader, the one the agents
//! read their conversation with (the journal's own connection, or Redis), never on the
//! reactor: one row read, which may wait for the journal's commit in progress. Behind the
//! endpoint's token, and never open (a conversation is what users said).

use crate::journal::memory::{MemoryLoader, export_lines};
use crate::message::SessionKey;

/// Bytes of a session key taken from a query (a key is far shorter).
const MAX_KEY_BYTES: usize = 4096;

/// The endpoint's side: reads stored conversations.
pub(crate) struct HistoryDesk {
    load: MemoryLoader,
}

impl HistoryDesk {
    /// Reads through `load`.
    pub(crate) fn new(load: MemoryLoader) -> HistoryDesk {
        HistoryDesk { load }
    }

    /// The answer to `GET /history?session=KEY`: `200` with the export lines (none for a
    /// session with no stored conversation), `400` for a bad or missing key, `500` when the
    /// store cannot be read.
    pub(crate) fn answer(&self, query: &str) -> (u16, String) {
        let session = match session_of(query) {
            Ok(s) => s,
            Err(why) => return (400, format!("{why}\n")),
        };
        match (self.load)(session.as_str()) {
            Ok(exchanges) => {
                log::debug!(
                    "history: session={session} exported ({} exchanges) over HTTP",
                    exchanges.len()
                );
                (200, export_lines(session.as_str(), &exchanges))
            }
            Err(e) => {
                // Only the token's holder can ask, once per request: a store failing.
                log::warn!("history: session={session}: cannot read the stored conversation: {e}");
                (500, format!("cannot read the stored conversation: {e}\n"))
            }
        }
    }
}

/// `/history` where no conversation is stored (no `--data-dir` nor `--cluster`).
pub(crate) fn no_history() -> (u16, String) {
    (
        404,
        "no stored conversations here (the gateway runs without --data-dir or --cluster)\n".into(),
    )
}

/// The session key of a `/history` query (`session=KEY`, percent-decoded), checked as a key
/// (the form the status and the logs show).
fn session_of(query: &str) -> Result<SessionKey, String> {
    let mut session = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "session" if session.is_none() => session = Some(value),
            "session" => return Err("session: given twice".into()),
            _ => return Err(format!("unknown parameter {:?}", cut(key))),
        }
    }
    let raw = session.ok_or("give session=KEY")?;
    if raw.len() > MAX_KEY_BYTES * 3 {
        return Err(format!("session: over {MAX_KEY_BYTES} bytes"));
    }
    let text = super::access::percent_decode(raw).ok_or("session: bad percent-encoding")?;
    if text.len() > MAX_KEY_BYTES {
        return Err(format!("session: over {MAX_KEY_BYTES} bytes"));
    }
    text.parse::<SessionKey>()
        .map_err(|e| format!("session {:?}: {e}", cut(&text)))
}

/// At most 64 characters of what a client sent, for an answer.
fn cut(s: &str) -> &str {
    s.char_indices().nth(64).map_or(s, |(at, _)| &s[..at])
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::ops::access::percent_encode;

    fn desk() -> HistoryDesk {
        HistoryDesk::new(Arc::new(|session: &str| match session {
            "cli:dm:local" => Ok(vec![("hi".to_owned(), "hello".to_owned())]),
            "cli:dm:broken" => Err("the stored conversation fails its checksum".to_owned()),
            _ => Ok(Vec::new()),
        }))
    }

    /// A known session's lines, an unknown session's none, a key refused with why, a store
    /// failure a 500 saying so.
    #[test]
    fn answers_lines_nothing_or_why_not() {
        let desk = desk();
        let (status, body) = desk.answer("session=cli%3Adm%3Alocal");
        assert_eq!(status, 200);
        assert_eq!(
            body,
            "{\"session\":\"cli:dm:local\",\"user\":\"hi\",\"assistant\":\"hello\"}\n"
        );
        assert_eq!(desk.answer("session=cli:dm:nobody"), (200, String::new()));
        let (status, why) = desk.answer("session=cli:dm:broken");
        assert_eq!(status, 500);
        assert!(why.contains("fails its checksum"), "{why}");
        for (query, said) in [
            ("", "give session=KEY"),
            ("session=nope", "is not platform:chat_type:chat_id"),
            ("session=cli:weird:1", "unknown chat type"),
            ("session=%zz", "bad percent-encoding"),
            ("session=a:dm:1&session=b:dm:2", "given twice"),
            ("user=x", "unknown parameter"),
        ] {
            let (status, why) = desk.answer(query);
            assert_eq!(status, 400, "{query}: {why}");
            assert!(why.contains(said), "{query}: {why}");
        }
        let long = percent_encode(&format!("cli:dm:{}", "x".repeat(MAX_KEY_BYTES)));
        let (status, why) = desk.answer(&format!("session={long}"));
        assert_eq!((status, why.trim()), (400, "session: over 4096 bytes"));
    }
}
