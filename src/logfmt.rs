//! Log lines an operator can use: `key=value` fields in the text, and a JSON rendering of a
//! line (for `--log-format json`) that lifts those fields out.

use std::fmt;
use std::io::Read;
use std::time::Instant;

use serde_json::{Map, Value};

/// A field value in a log line: written bare when it is a plain word, else as a JSON string
/// (so a session key or id with spaces, quotes or `=` cannot forge another field).
pub(crate) struct Field<'a>(pub &'a str);

impl fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plain = !self.0.is_empty()
            && !self
                .0
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '=');
        if plain {
            f.write_str(self.0)
        } else {
            let quoted = serde_json::to_string(self.0).map_err(|_| fmt::Error)?;
            f.write_str(&quoted)
        }
    }
}

/// `text` cut to at most `max` characters, with `…` when cut.
pub(crate) fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// Keys of the JSON line that a field never overrides.
const RESERVED: [&str; 4] = ["ts", "level", "target", "msg"];

/// The `key=value` fields of a log message, in order: a key is lowercase letters and
/// underscores; a value is a bare word or a JSON string (as [`Field`] writes them).
pub(crate) fn fields(msg: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = msg;
    while !rest.is_empty() {
        // At the start of a word.
        let word_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let key_end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(rest.len());
        let mut consumed = word_end;
        if key_end > 0 && rest[key_end..].starts_with('=') {
            let key = &rest[..key_end];
            let value = &rest[key_end + 1..];
            if value.starts_with('"') {
                let mut it = serde_json::Deserializer::from_str(value).into_iter::<String>();
                if let Some(Ok(v)) = it.next() {
                    consumed = key_end + 1 + it.byte_offset();
                    out.push((key.to_owned(), v));
                }
            } else {
                let end = value.find(char::is_whitespace).unwrap_or(value.len());
                let v = value[..end].trim_end_matches([':', ',', ';']);
                out.push((key.to_owned(), v.to_owned()));
            }
        }
        rest = rest[consumed.min(rest.len())..].trim_start();
    }
    out
}

/// A log record as one JSON object: `ts`, `level`, `target`, `msg`, then the message's
/// fields (integers as numbers).
pub(crate) fn json_line(ts: &str, level: log::Level, target: &str, msg: &str) -> String {
    let mut m = Map::new();
    m.insert("ts".into(), Value::from(ts));
    m.insert("level".into(), Value::from(level.as_str()));
    m.insert("target".into(), Value::from(target));
    m.insert("msg".into(), Value::from(msg));
    for (k, v) in fields(msg) {
        if RESERVED.contains(&k.as_str()) || m.contains_key(&k) {
            continue;
        }
        let value = match v.parse::<u64>() {
            Ok(n) => Value::from(n),
            Err(_) => Value::from(v),
        };
        m.insert(k, value);
    }
    Value::Object(m).to_string()
}

/// Lines one rate-limited call site logs at once.
pub(crate) const WARN_BURST: f64 = 10.0;
/// Lines one rate-limited call site logs per second once its burst is used.
pub(crate) const WARN_PER_SEC: f64 = 1.0;

/// A budget of log lines: `burst` at once, then `per_sec` a second (a token bucket). What is
/// refused is counted, and the count handed to the next line allowed: one definition for
/// every flood a log must survive (an agent's stderr, a hostile platform server).
pub(crate) struct LogBudget {
    burst: f64,
    per_sec: f64,
    tokens: f64,
    /// When the tokens were last counted; `None` until the first line (a full bucket).
    refilled: Option<Instant>,
    dropped: u64,
}

impl LogBudget {
    /// A full budget.
    pub(crate) const fn new(burst: f64, per_sec: f64) -> LogBudget {
        LogBudget {
            burst,
            per_sec,
            tokens: burst,
            refilled: None,
            dropped: 0,
        }
    }

    /// Whether a line may be logged at `now`: `Some(n)`, with the `n` lines refused since the
    /// last one allowed; `None` (counted) when the budget is spent.
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        let elapsed = self
            .refilled
            .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.burst);
        self.refilled = Some(now);
        if self.tokens < 1.0 {
            self.dropped += 1;
            None
        } else {
            self.tokens -= 1.0;
            Some(std::mem::take(&mut self.dropped))
        }
    }

    /// Lines refused since the last one allowed.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// ` (N more suppressed)` after a rate-limited line, when some were; else nothing.
pub(crate) fn suppressed_note(suppressed: u64) -> String {
    if suppressed > 0 {
        format!(" ({suppressed} more suppressed)")
    } else {
        String::new()
    }
}

/// Reads `from` to its end as lines of at most `line_max` bytes (the rest of a longer line is
/// skipped and the line marked cut) and hands each line the `budget` allows to `emit`, with
/// the count of lines dropped since the last one emitted. Returns the lines dropped after the
/// last one emitted. One child's output stream (an agent's or a bridge's stderr) into the log,
/// bounded in memory by `line_max` and in log lines by the budget.
pub(crate) fn relay_lines(
    mut from: impl Read,
    line_max: usize,
    mut budget: LogBudget,
    mut emit: impl FnMut(&[u8], bool, u64),
) -> u64 {
    let mut line = Vec::new();
    let mut cut = false;
    let mut flush = |line: &mut Vec<u8>, cut: &mut bool, budget: &mut LogBudget| {
        if let Some(dropped) = budget.allow(Instant::now()) {
            emit(line, *cut, dropped);
        }
        line.clear();
        *cut = false;
    };
    let mut chunk = [0u8; 8192];
    loop {
        match from.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                for &b in &chunk[..n] {
                    if b == b'\n' {
                        flush(&mut line, &mut cut, &mut budget);
                    } else if line.len() < line_max {
                        line.push(b);
                    } else {
                        cut = true;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    if !line.is_empty() {
        flush(&mut line, &mut cut, &mut budget);
    }
    budget.dropped()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_bare_words_or_json_strings() {
        assert_eq!(Field("telegram:dm:42").to_string(), "telegram:dm:42");
        assert_eq!(Field("a b").to_string(), "\"a b\"");
        assert_eq!(Field("x=y").to_string(), "\"x=y\"");
        assert_eq!(Field("q\"").to_string(), "\"q\\\"\"");
        assert_eq!(Field("").to_string(), "\"\"");
        assert_eq!(Field("l\n").to_string(), "\"l\\n\"");
    }

    #[test]
    fn cut_marks_what_it_removed() {
        assert_eq!(cut("hello", 5), "hello");
        assert_eq!(cut("hello", 4), "hell…");
        assert_eq!(cut("héllo", 2), "hé…");
    }

    #[test]
    fn fields_are_lifted_from_a_message() {
        let msg = format!(
            "turn failed session={} id={} turn=7 outcome=failed:agent ms=12 error={}",
            Field("telegram:dm:42"),
            Field("m 1"),
            Field("exit status 2: boom")
        );
        assert_eq!(
            fields(&msg),
            vec![
                ("session".into(), "telegram:dm:42".into()),
                ("id".into(), "m 1".into()),
                ("turn".into(), "7".into()),
                ("outcome".into(), "failed:agent".into()),
                ("ms".into(), "12".into()),
                ("error".into(), "exit status 2: boom".into()),
            ]
        );
        assert_eq!(fields("no fields here: x"), vec![]);
        assert_eq!(
            fields("peer=1.2.3.4:5: closed"),
            vec![("peer".into(), "1.2.3.4:5".into())]
        );
        assert_eq!(fields("k=\"unterminated"), vec![]);
        assert_eq!(fields("a =b == c"), vec![], "no key, no field");
    }

    #[test]
    fn json_line_carries_the_fields() {
        let line = json_line(
            "2026-11-30T08:00:00.000Z",
            log::Level::Warn,
            "turnstile::reactor",
            "turn failed session=s id=i ms=12 msg=x level=y",
        );
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["ts"], "2026-11-30T08:00:00.000Z");
        assert_eq!(v["target"], "turnstile::reactor");
        assert_eq!(v["session"], "s");
        assert_eq!(v["id"], "i");
        assert_eq!(v["ms"], 12);
        assert_eq!(v["msg"], "turn failed session=s id=i ms=12 msg=x level=y");
        let v: Value =
            serde_json::from_str(&json_line("t", log::Level::Info, "x", "a=1 a=2")).unwrap();
        assert_eq!(v["a"], 1, "the first of two fields of a name wins");
    }

    #[test]
    fn a_log_budget_allows_a_burst_then_its_rate_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut b = LogBudget::new(3.0, 2.0);
        for _ in 0..3 {
            assert_eq!(b.allow(t0), Some(0));
        }
        assert_eq!(b.allow(t0), None);
        assert_eq!(b.allow(t0), None);
        assert_eq!(b.dropped(), 2);
        // Half a second earns one line, which reports the two refused.
        assert_eq!(b.allow(t0 + std::time::Duration::from_millis(500)), Some(2));
        assert_eq!(b.dropped(), 0);
        assert_eq!(suppressed_note(0), "");
        assert_eq!(suppressed_note(7), " (7 more suppressed)");
    }
}
