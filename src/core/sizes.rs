//! Pins the size of every per-session structure (issue 21 §2), so that a field added to the
//! session entry, the key or the index shows up here before it shows up in RSS, and checks
//! that an idle session keeps no queue buffer.

use super::*;

/// The layout of `slab`'s (private) entry type: a vacant slot links the free list.
#[allow(dead_code)]
enum SlabEntry<T> {
    Vacant(usize),
    Occupied(T),
}

type A = Box<dyn crate::Agent>;

#[test]
fn per_session_structures_keep_their_sizes() {
    use std::mem::size_of;
    let rows = [
        ("SessionKey", size_of::<SessionKey>(), 24),
        ("Session<(), A>", size_of::<Session<(), A>>(), 104),
        (
            "Session<Sender<MessageEvent>, A>",
            size_of::<Session<crossbeam_channel::Sender<MessageEvent>, A>>(),
            104,
        ),
        (
            "slab entry (u32, Session)",
            size_of::<SlabEntry<(u32, Session<(), A>)>>(),
            112,
        ),
        (
            "Option<Box<Running<()>>>",
            size_of::<Option<Box<Running<()>>>>(),
            8,
        ),
        ("AgentState<A>", size_of::<AgentState<A>>(), 32),
        (
            "VecDeque<Queued<()>>",
            size_of::<VecDeque<Queued<()>>>(),
            32,
        ),
        (
            "index entry (SessionKey, Key)",
            size_of::<(SessionKey, Key)>(),
            32,
        ),
        ("recency entry (u64, Key)", size_of::<(u64, Key)>(), 16),
        // Held only while a message waits, one per message; 8 bytes more since a message
        // may carry files (issue 36: one pointer, `None` for most messages).
        ("Queued<()>", size_of::<Queued<()>>(), 104),
        ("Running<()>", size_of::<Running<()>>(), 48),
    ];
    for (name, size, most) in rows {
        eprintln!("{name}: {size} bytes (at most {most})");
        assert!(size <= most, "{name} grew to {size} bytes (was {most})");
    }
}

fn session_of(core: &Core<(), u32>, key: &SessionKey) -> Key {
    *core.index.get(key).expect("the session holds a slot")
}

/// A queue that empties gives its buffer back, whether its message starts a turn or is
/// cancelled; the first waiting message reserves room for one, not `VecDeque`'s four.
#[test]
fn an_idle_session_keeps_no_queue_buffer() {
    let mut core: Core<(), u32> = Core::new(CoreConfig::default(), Duration::ZERO);
    let key = SessionKey::dm("test", "a").expect("key");
    let now = Duration::ZERO;
    let mut fx = Vec::new();
    let submit = |core: &mut Core<(), u32>, fx: &mut Vec<_>, text: &str, i: usize| {
        let message = Message::new(&format!("m{i}"), key.clone(), text).expect("message");
        core.handle(now, Input::Submit { message, route: () }, fx);
    };
    submit(&mut core, &mut fx, "x", 0);
    let job = fx
        .drain(..)
        .find_map(|f| match f {
            Effect::StartTurn(job) => Some(job),
            _ => None,
        })
        .expect("a turn started");
    let slot = session_of(&core, &key);
    assert_eq!(
        core.slots[slot].queue.capacity(),
        0,
        "the started message's"
    );
    // A follow-up waits behind the running turn: room for one.
    submit(&mut core, &mut fx, "y", 1);
    assert_eq!(core.slots[slot].queue.capacity(), 1);
    // The turn returns; the follow-up starts and the queue is empty again.
    let done = job.done(Some(7), TurnResult::Reply("ok".into()));
    core.handle(now, Input::TurnDone(done), &mut fx);
    assert_eq!(core.slots[slot].queue.capacity(), 0, "after the hand-over");
    // Cancelled messages leave no buffer either.
    submit(&mut core, &mut fx, "z", 2);
    submit(&mut core, &mut fx, "w", 3);
    assert!(core.slots[slot].queue.capacity() >= 2);
    submit(&mut core, &mut fx, "/stop", 4);
    assert_eq!(core.slots[slot].queue.len(), 0);
    assert_eq!(core.slots[slot].queue.capacity(), 0, "after /stop");
}
