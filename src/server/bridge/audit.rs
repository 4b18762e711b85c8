//! The bridge's debug-build audit: each room's invariants, and every count across rooms
//! against what it counts (a child module, so it reads the bridge's fields directly).

use std::collections::HashMap;

use super::routes::Phase;
use super::{Bridge, Durable};

/// Checks, in debug builds, each room's invariants and that every count across rooms
/// matches what it counts: each reservation is a route, a result on a connection, or a
/// result in an outbox (or waiting for its outcome record).
pub(super) fn check(b: &Bridge) {
    // O(state): skipped in release builds, and past a small size so that debug builds of
    // large scenarios stay fast.
    let outboxed = b.platforms.outboxed() + b.durable.as_ref().map_or(0, Durable::unjournaled);
    if !cfg!(debug_assertions) || b.routes.len() + b.conns.len() + outboxed > 1_000 {
        return;
    }
    b.conns.check();
    b.routes.check();
    let mut owed: HashMap<&str, usize> = HashMap::new();
    for r in b.routes.values() {
        *owed.entry(&*r.platform).or_insert(0) += 1;
        debug_assert!(b.platforms.contains(&r.platform));
    }
    let held = b.conns.terminals_by_platform();
    let journaled = b.durable.iter().flat_map(|d| d.terminals_by_platform());
    let orphans = b.cluster.orphan_platforms();
    for p in held.chain(journaled).chain(orphans) {
        *owed.entry(p).or_insert(0) += 1;
    }
    for (id, c) in b.conns.iter() {
        let sent = b.routes.values().filter(|r| r.conn == id).count();
        debug_assert_eq!(sent, c.outstanding, "connection {} outstanding", id);
        if let Some(p) = &c.platform {
            debug_assert!(b.platforms.has_hello(p, id));
        }
    }
    for (name, c) in b.platforms.hellos() {
        let conn = b.conns.get(c);
        debug_assert!(conn.is_some_and(|conn| conn.platform.as_deref() == Some(name)));
    }
    if let Some(d) = &b.durable {
        d.check(&b.routes);
    }
    // Each route's phase agrees with the index that holds it in that phase, both ways
    // (`Durable::check` and `ClusterSide::check` look from the other side).
    let d = b.durable.as_ref();
    for (tag, r) in b.routes.tags() {
        let waiting = d.is_some_and(|d| d.is_waiting(tag));
        debug_assert_eq!(r.phase == Phase::Journaling, waiting, "message {tag} phase");
        let forgetting = d.is_some_and(|d| d.is_forgetting(tag));
        debug_assert_eq!(
            r.phase == Phase::Refusing,
            forgetting,
            "message {tag} phase"
        );
    }
    b.cluster.check(&b.routes);
    let recovered = b.durable.as_ref().map_or(0, Durable::recovered);
    b.platforms.check(&owed, recovered);
}
