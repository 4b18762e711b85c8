//! Which channels are threads, and of which channel. A `MESSAGE_CREATE` names only its
//! channel, so the threads are learnt from the Gateway's own events (the GUILDS intent):
//! a guild's active threads in `GUILD_CREATE` and `THREAD_LIST_SYNC`, `THREAD_CREATE` and
//! `THREAD_UPDATE` for new or joined ones, `THREAD_DELETE` for gone ones.

use std::collections::HashMap;

use serde_json::Value;

/// Threads remembered at most. Past it the memory starts again: a forgotten thread's
/// messages are answered as a channel of its own (still in the thread) until an event
/// names it again.
pub(crate) const MAX_THREADS: usize = 10_000;

/// Thread channel id → the channel it is in.
#[derive(Debug, Default)]
pub(crate) struct Threads {
    parent: HashMap<String, String>,
}

impl Threads {
    /// The channel thread `channel` is in, if it is a known thread.
    pub(crate) fn parent(&self, channel: &str) -> Option<&str> {
        self.parent.get(channel).map(String::as_str)
    }

    /// Learns from a dispatch `kind` with data `d` (every kind may come; most teach nothing).
    pub(crate) fn dispatch(&mut self, kind: &str, d: &Value) {
        match kind {
            "GUILD_CREATE" | "THREAD_LIST_SYNC" => {
                for thread in d
                    .get("threads")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.add(thread);
                }
            }
            "THREAD_CREATE" | "THREAD_UPDATE" => self.add(d),
            "THREAD_DELETE" => {
                if let Some(id) = d.get("id").and_then(Value::as_str) {
                    self.parent.remove(id);
                }
            }
            _ => {}
        }
    }

    /// A thread channel object: its id and parent, if it is a thread (types 10, 11, 12).
    fn add(&mut self, thread: &Value) {
        let text = |k: &str| thread.get(k).and_then(Value::as_str);
        let is_thread = matches!(thread.get("type").and_then(Value::as_u64), Some(10..=12));
        let (Some(id), Some(parent), true) = (text("id"), text("parent_id"), is_thread) else {
            return;
        };
        if self.parent.len() >= MAX_THREADS && !self.parent.contains_key(id) {
            self.parent.clear();
        }
        self.parent.insert(id.to_owned(), parent.to_owned());
        debug_assert!(self.parent.len() <= MAX_THREADS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn thread(id: &str, parent: &str) -> Value {
        json!({"id": id, "parent_id": parent, "type": 11, "guild_id": "9"})
    }

    #[test]
    fn threads_are_learnt_from_the_gateways_events_and_forgotten_when_deleted() {
        let mut t = Threads::default();
        t.dispatch(
            "GUILD_CREATE",
            &json!({"id": "9", "threads": [thread("88", "77")]}),
        );
        t.dispatch("THREAD_CREATE", &thread("89", "77"));
        // A text channel (type 0) is no thread.
        t.dispatch(
            "THREAD_CREATE",
            &json!({"id": "90", "parent_id": "1", "type": 0}),
        );
        t.dispatch(
            "THREAD_LIST_SYNC",
            &json!({"threads": [thread("91", "78")]}),
        );
        assert_eq!(t.parent("88"), Some("77"));
        assert_eq!(t.parent("89"), Some("77"));
        assert_eq!(t.parent("90"), None);
        assert_eq!(t.parent("91"), Some("78"));
        assert_eq!(t.parent("77"), None);
        t.dispatch(
            "THREAD_DELETE",
            &json!({"id": "88", "parent_id": "77", "type": 11}),
        );
        assert_eq!(t.parent("88"), None);
    }

    #[test]
    fn the_memory_of_threads_is_bounded() {
        let mut t = Threads::default();
        for i in 0..=MAX_THREADS {
            t.dispatch("THREAD_CREATE", &thread(&i.to_string(), "1"));
        }
        assert!(t.parent.len() <= MAX_THREADS);
        assert_eq!(t.parent(&MAX_THREADS.to_string()), Some("1"));
    }
}
