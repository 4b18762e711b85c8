//! The bridge's platforms: for each, the connections that said hello for it, its outbox of
//! undelivered results, the reservations that keep the outbox from overflowing, the results
//! held until they fit, and its duplicate window. A platform is found by name in one place
//! ([`Platforms::get_mut`]); everything else asks this room by name.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use super::super::dedup::{DedupWindow, Fingerprint, Seen};
use super::super::frame::Frame;
use super::refusal::Refusal;
use super::status::PlatformStatus;
use super::{BridgeConfig, ConnId, TERMINAL_ENVELOPE};
use crate::wire::{EncodedLine as Body, check_platform};

/// Expired duplicate-window entries dropped per platform per housekeeping pass, so that a
/// mass expiry is spread over passes instead of stalling one.
const EXPIRY_BUDGET: usize = 4096;
/// Stale results dropped per housekeeping pass, for the same reason.
const STALE_BUDGET: usize = 4096;

struct Platform {
    /// Connections that said hello for it, oldest first.
    conns: Vec<ConnId>,
    outbox: VecDeque<Frame>,
    outbox_bytes: usize,
    /// Accepted (or submitted) messages whose terminal event is not yet written.
    reserved_events: usize,
    /// Each owed result's envelope plus the text of each result charged (released to a
    /// connection or the outbox and not yet delivered); never past `outbox_bytes` (but for
    /// what recovery restored under a lowered bound).
    reserved_bytes: usize,
    /// Results that exist but did not fit `outbox_bytes` (or came after one that did not),
    /// oldest first, with the connection each goes to: released in order as room frees.
    /// Each keeps its envelope reservation; its text is charged when it is released.
    held: VecDeque<(ConnId, Frame)>,
    /// Text bytes of the held results.
    held_bytes: usize,
    /// Since when no connection has said hello for it (noted by housekeeping).
    absent_since: Option<Duration>,
    /// Results dropped undelivered because it stayed absent (see [`Platforms::drop_stale`]).
    stale_dropped: u64,
    /// Messages a graceful shutdown left in the journal for the next process: still owed,
    /// so they keep their reservations until this process ends.
    kept: usize,
    dedup: DedupWindow,
}

impl Platform {
    fn holds_nothing(&self) -> bool {
        self.conns.is_empty()
            && self.outbox.is_empty()
            && self.held.is_empty()
            && self.reserved_events == 0
            && self.dedup.is_empty()
    }
}

/// How a new message stands with its platform's duplicate window.
pub(super) enum Claim {
    /// New: room is reserved for its result and it is pending under this tag.
    New(u64),
    /// Accepted within the window: a duplicate.
    Duplicate,
    /// A copy of the message submitted under this tag, still awaiting admission.
    CopyOf(u64),
}

/// Every platform known, by name, within `max_platforms`.
pub(super) struct Platforms {
    map: HashMap<Arc<str>, Platform>,
    max: usize,
    /// Outbox bytes an accepted message reserves (its envelope; its result's text is charged
    /// when the result exists).
    reserve: usize,
    /// The most a result may be charged: its text is cut at `max_reply_bytes`.
    largest: usize,
    outbox_cap: usize,
    outbox_bytes: usize,
    stale_after: Duration,
    stale_keep: usize,
    dedup_window: Duration,
    dedup_max: usize,
}

impl Platforms {
    pub(super) fn new(cfg: &BridgeConfig) -> Platforms {
        Platforms {
            map: HashMap::new(),
            max: cfg.max_platforms,
            reserve: TERMINAL_ENVELOPE,
            largest: cfg.max_reply_bytes.saturating_add(TERMINAL_ENVELOPE),
            outbox_cap: cfg.outbox_cap,
            outbox_bytes: cfg.outbox_bytes,
            stale_after: cfg.outbox_stale_after,
            stale_keep: cfg.outbox_stale_keep,
            dedup_window: cfg.dedup_window,
            dedup_max: cfg.dedup_max,
        }
    }

    /// The one lookup by name.
    fn get_mut(&mut self, name: &str) -> Option<&mut Platform> {
        self.map.get_mut(name)
    }

    /// The platform named `name`, created if there is room.
    pub(super) fn open(&mut self, name: &str) -> Option<Arc<str>> {
        if let Some((k, _)) = self.map.get_key_value(name) {
            return Some(k.clone());
        }
        if self.map.len() >= self.max {
            return None;
        }
        Some(self.insert(name))
    }

    /// The platform named `name`, created even past `max_platforms` (what the journal holds
    /// was admitted under the bound; a lowered bound must not lose it); `None` for a name
    /// that is not valid.
    pub(super) fn force(&mut self, name: &str) -> Option<Arc<str>> {
        if check_platform(name).is_err() {
            return None;
        }
        self.open(name).or_else(|| Some(self.insert(name)))
    }

    /// A new, empty platform named `name` (the caller checked the bound).
    fn insert(&mut self, name: &str) -> Arc<str> {
        let k: Arc<str> = name.into();
        let dedup = DedupWindow::new(self.dedup_window, self.dedup_max);
        let platform = Platform {
            conns: Vec::new(),
            outbox: VecDeque::new(),
            outbox_bytes: 0,
            reserved_events: 0,
            reserved_bytes: 0,
            held: VecDeque::new(),
            held_bytes: 0,
            absent_since: None,
            stale_dropped: 0,
            kept: 0,
            dedup,
        };
        self.map.insert(k.clone(), platform);
        k
    }

    /// Admission's platform step: `name` created if there is room, the id checked against
    /// its duplicate window, then (a new id) its outbox room and `gate` (what else must hold),
    /// and room reserved for its result under `new_tag()`.
    pub(super) fn claim(
        &mut self,
        name: &str,
        fp: Fingerprint,
        now: Duration,
        gate: impl FnOnce() -> Result<(), Refusal>,
        new_tag: impl FnOnce() -> u64,
    ) -> Result<(Arc<str>, Claim), Refusal> {
        let Some(key) = self.open(name) else {
            return Err(Refusal::platforms_full(self.max, name));
        };
        let (reserve, cap, cap_bytes) = (self.reserve, self.outbox_cap, self.outbox_bytes);
        let largest = self.largest;
        let (dedup_max, max) = (self.dedup_max, self.max);
        let Some(p) = self.get_mut(&key) else {
            return Err(Refusal::platforms_full(max, name));
        };
        match p.dedup.seen(fp, now) {
            Seen::Accepted => return Ok((key, Claim::Duplicate)),
            Seen::Pending(tag) => return Ok((key, Claim::CopyOf(tag))),
            Seen::New => {}
        }
        if p.dedup.is_full(now) {
            return Err(Refusal::dedup_full(&key, dedup_max));
        }
        if p.reserved_events >= cap {
            return Err(Refusal::outbox_cap(&key, p.reserved_events, cap));
        }
        // Room for its envelope now, and — so that a held result always fits once the
        // results ahead of it are delivered — for every owed envelope plus one largest result.
        let envelopes = p.reserved_events.saturating_add(1).saturating_mul(reserve);
        if !p.held.is_empty()
            || p.reserved_bytes.saturating_add(reserve) > cap_bytes
            || envelopes.saturating_add(largest) > cap_bytes
        {
            let held = p.held.len();
            return Err(Refusal::outbox_bytes(
                &key,
                p.reserved_bytes,
                held,
                cap_bytes,
                largest,
            ));
        }
        gate()?;
        let tag = new_tag();
        p.reserved_events += 1;
        p.reserved_bytes += reserve;
        p.dedup.pending(fp, tag);
        Ok((key, Claim::New(tag)))
    }

    /// A result now exists for a message of `name`, going to `origin`: its text is charged
    /// beyond the envelope reserved at admission and it is handed back to be sent — or, if
    /// that would pass `outbox_bytes` (or results held before it still wait), it is held,
    /// in order, until room frees ([`Platforms::release_held`]). Never dropped for room.
    pub(super) fn admit_result(
        &mut self,
        name: &str,
        origin: ConnId,
        frame: Frame,
    ) -> Option<(ConnId, Frame)> {
        debug_assert!(
            frame.body.size().saturating_sub(text_bytes(&frame.body)) <= self.reserve,
            "a terminal's envelope outgrew its reservation"
        );
        let (cap, reserve) = (self.outbox_bytes, self.reserve);
        let Some(p) = self.get_mut(name) else {
            return Some((origin, frame));
        };
        let text = text_bytes(&frame.body);
        if p.held.is_empty() && fits(p, text, cap, reserve) {
            p.reserved_bytes += text;
            return Some((origin, frame));
        }
        log::debug!(
            "platform {name}: a result of {text} bytes waits for room (--outbox-bytes {cap}; {} held)",
            p.held.len() + 1
        );
        p.held_bytes += text;
        p.held.push_back((origin, frame));
        None
    }

    /// Room freed on `name`: the held results that now fit, in order, charged, to be sent.
    pub(super) fn release_held(&mut self, name: &str) -> Vec<(ConnId, Frame)> {
        let (cap, reserve) = (self.outbox_bytes, self.reserve);
        let mut out = Vec::new();
        let Some(p) = self.get_mut(name) else {
            return out;
        };
        while let Some((_, f)) = p.held.front() {
            let text = text_bytes(&f.body);
            if !fits(p, text, cap, reserve) {
                break;
            }
            let Some(next) = p.held.pop_front() else {
                break;
            };
            p.held_bytes -= text;
            p.reserved_bytes += text;
            out.push(next);
        }
        out
    }

    /// Housekeeping: notes since when each platform has had no connection that said hello,
    /// and from each absent for at least `stale_after` drops its oldest waiting results
    /// (outbox, then held) beyond the newest `stale_keep`, releasing their room. What is
    /// dropped is returned (to log, count and take out of the journal); at most a budget
    /// per pass. Results on a connection, or not yet existing, are never dropped.
    pub(super) fn drop_stale(&mut self, now: Duration) -> Vec<(Arc<str>, Frame)> {
        let (after, keep, reserve) = (self.stale_after, self.stale_keep, self.reserve);
        let mut dropped = Vec::new();
        for (name, p) in &mut self.map {
            if !p.conns.is_empty() {
                p.absent_since = None;
                continue;
            }
            let since = *p.absent_since.get_or_insert(now);
            if now.saturating_sub(since) < after {
                continue;
            }
            while p.outbox.len() + p.held.len() > keep && dropped.len() < STALE_BUDGET {
                let text;
                let frame = if let Some(f) = p.outbox.pop_front() {
                    p.outbox_bytes -= f.body.size();
                    text = text_bytes(&f.body);
                    f
                } else if let Some((_, f)) = p.held.pop_front() {
                    p.held_bytes -= text_bytes(&f.body);
                    text = 0;
                    f
                } else {
                    break;
                };
                debug_assert!(p.reserved_events > 0 && p.reserved_bytes >= reserve + text);
                p.reserved_events -= 1;
                p.reserved_bytes = p.reserved_bytes.saturating_sub(reserve + text);
                p.stale_dropped += 1;
                dropped.push((name.clone(), frame));
            }
        }
        dropped
    }

    /// Whether `conn` said hello for `name`.
    pub(super) fn has_hello(&self, name: &str, conn: ConnId) -> bool {
        self.map.get(name).is_some_and(|p| p.conns.contains(&conn))
    }

    /// Room for one more result (recovery: past the cap, which admission already applied).
    pub(super) fn reserve(&mut self, name: &str) {
        let reserve = self.reserve;
        if let Some(p) = self.get_mut(name) {
            p.reserved_events += 1;
            p.reserved_bytes += reserve;
        }
    }

    /// A result was delivered (or its message refused before it had one: `None`): its room
    /// is free again.
    pub(super) fn unreserve(&mut self, name: &str, body: Option<&Body>) {
        let room = self.reserve + body.map_or(0, text_bytes);
        if let Some(p) = self.get_mut(name) {
            debug_assert!(p.reserved_events > 0 && p.reserved_bytes >= room);
            p.reserved_events -= 1;
            p.reserved_bytes = p.reserved_bytes.saturating_sub(room);
        }
    }

    /// A graceful shutdown left one of `name`'s messages in the journal: it keeps its
    /// reservation (see `kept`).
    pub(super) fn keep_for_restart(&mut self, name: &str) {
        if let Some(p) = self.get_mut(name) {
            p.kept += 1;
        }
    }

    /// The runtime accepted the message pending as `fp`: a duplicate from now on.
    pub(super) fn dedup_accepted(&mut self, name: &str, fp: Fingerprint, now: Duration) {
        if let Some(p) = self.get_mut(name) {
            p.dedup.accepted(fp, now);
        }
    }

    /// The message pending as `fp` was refused: a retry of its id is new.
    pub(super) fn dedup_forget(&mut self, name: &str, fp: Fingerprint) {
        if let Some(p) = self.get_mut(name) {
            p.dedup.forget(fp);
        }
    }

    /// Recovery: `fp` is a duplicate until `until`; with `if_new`, only if not already known.
    /// Whether it was added.
    pub(super) fn remember(
        &mut self,
        name: &str,
        fp: Fingerprint,
        until: Duration,
        now: Duration,
        if_new: bool,
    ) -> bool {
        let Some(p) = self.get_mut(name) else {
            return false;
        };
        if if_new && p.dedup.seen(fp, now) != Seen::New {
            return false;
        }
        p.dedup.remember(fp, until);
        true
    }

    /// Drops expired duplicate-window entries (a budget per platform) and the platforms
    /// that then hold nothing.
    pub(super) fn expire(&mut self, now: Duration) {
        let mut emptied = Vec::new();
        for (name, p) in &mut self.map {
            if p.dedup.expire(now, EXPIRY_BUDGET) > 0 && p.dedup.is_empty() {
                emptied.push(name.clone());
            }
        }
        for name in emptied {
            self.maybe_free(&name);
        }
    }

    /// A result for the platform's newest connection, at the back of its outbox.
    pub(super) fn push_outbox(&mut self, name: &str, frame: Frame) {
        if let Some(p) = self.get_mut(name) {
            p.outbox_bytes += frame.body.size();
            p.outbox.push_back(frame);
        }
    }

    /// A result a dying connection did not deliver, back at the front of its outbox.
    pub(super) fn push_outbox_front(&mut self, name: &str, frame: Frame) {
        if let Some(p) = self.get_mut(name) {
            p.outbox_bytes += frame.body.size();
            p.outbox.push_front(frame);
        }
    }

    /// The next result of the platform's outbox.
    pub(super) fn pop_outbox(&mut self, name: &str) -> Option<Frame> {
        let p = self.get_mut(name)?;
        let frame = p.outbox.pop_front()?;
        p.outbox_bytes -= frame.body.size();
        Some(frame)
    }

    pub(super) fn has_backlog(&self, name: &str) -> bool {
        self.map.get(name).is_some_and(|p| !p.outbox.is_empty())
    }

    /// `conn` said hello for `name`: it is the newest connection to feed.
    pub(super) fn attach(&mut self, name: &str, conn: ConnId) {
        if let Some(p) = self.get_mut(name) {
            p.conns.push(conn);
            // Present again: a later absence counts from its own start.
            p.absent_since = None;
        }
    }

    /// `conn` no longer takes the platform's results.
    pub(super) fn detach(&mut self, name: &str, conn: ConnId) {
        if let Some(p) = self.get_mut(name) {
            p.conns.retain(|&c| c != conn);
        }
    }

    /// The newest connection that said hello for `name`: its outbox feeds it.
    pub(super) fn newest_hello(&self, name: &str) -> Option<ConnId> {
        self.map.get(name)?.conns.last().copied()
    }

    /// Forgets a platform that holds nothing.
    pub(super) fn maybe_free(&mut self, name: &str) {
        if self.map.get(name).is_some_and(Platform::holds_nothing)
            && let Some(p) = self.map.remove(name)
        {
            debug_assert_eq!((p.outbox_bytes, p.reserved_bytes), (0, 0));
        }
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Results waiting in outboxes (held ones included).
    pub(super) fn outboxed(&self) -> usize {
        self.map
            .values()
            .map(|p| p.outbox.len() + p.held.len())
            .sum()
    }

    pub(super) fn status(&self, now: Duration) -> BTreeMap<String, PlatformStatus> {
        let after = self.stale_after;
        let one = |p: &Platform| {
            let absent = p.absent_since.map(|s| now.saturating_sub(s));
            PlatformStatus {
                connections: p.conns.len(),
                outbox_events: p.outbox.len(),
                outbox_bytes: p.outbox_bytes,
                reserved_events: p.reserved_events,
                reserved_bytes: p.reserved_bytes,
                held_events: p.held.len(),
                held_bytes: p.held_bytes,
                absent_ms: absent.map(|a| a.as_millis() as u64),
                stale: absent.is_some_and(|a| a >= after),
                stale_dropped: p.stale_dropped,
                dedup_ids: p.dedup.len(),
                // The connections' reports (`Bridge::status`).
                link: None,
            }
        };
        self.map
            .iter()
            .map(|(name, p)| (name.to_string(), one(p)))
            .collect()
    }

    /// The connections that said hello, with their platform.
    pub(super) fn hellos(&self) -> impl Iterator<Item = (&str, ConnId)> {
        self.map
            .iter()
            .flat_map(|(name, p)| p.conns.iter().map(move |&c| (&**name, c)))
    }

    /// Checks, in debug builds, this room's counts: `owed` is, per platform, the results
    /// held elsewhere (routes, connections, the journal) that each hold a reservation;
    /// `recovered` the messages recovery restored (which may exceed a lowered cap).
    pub(super) fn check(&self, owed: &HashMap<&str, usize>, recovered: usize) {
        debug_assert!(self.map.len() <= self.max);
        for (name, p) in &self.map {
            let bytes: usize = p.outbox.iter().map(|f| f.body.size()).sum();
            debug_assert_eq!(bytes, p.outbox_bytes, "platform {name} outbox bytes");
            let owed =
                owed.get(&**name).copied().unwrap_or(0) + p.outbox.len() + p.held.len() + p.kept;
            debug_assert_eq!(owed, p.reserved_events, "platform {name} reservations");
            let outboxed: usize = p.outbox.iter().map(|f| text_bytes(&f.body)).sum();
            debug_assert!(p.reserved_events * self.reserve + outboxed <= p.reserved_bytes);
            let held: usize = p.held.iter().map(|(_, f)| text_bytes(&f.body)).sum();
            debug_assert_eq!(held, p.held_bytes, "platform {name} held bytes");
            // Room is released to the held results as soon as it frees.
            debug_assert!(p.held.front().is_none_or(|(_, f)| !fits(
                p,
                text_bytes(&f.body),
                self.outbox_bytes,
                self.reserve
            )));
            // The global bound is never passed (recovery under a lowered bound aside).
            debug_assert!(
                p.reserved_bytes <= self.outbox_bytes || recovered > 0,
                "platform {name}: {} bytes held past --outbox-bytes {}",
                p.reserved_bytes,
                self.outbox_bytes
            );
            // Recovery may restore more than a lowered cap allows; admission never adds past it.
            debug_assert!(p.reserved_events <= self.outbox_cap.max(recovered));
            debug_assert!(p.dedup.len() <= self.dedup_max);
        }
    }
}

// The forwards' operations on outboxes (`--cluster`, `cluster/bridge/forward.rs`): results
// found, taken in and given away by their cluster tag ([`Frame::cluster`]).
#[cfg(feature = "cluster")]
impl Platforms {
    /// `--cluster`: the results of `tags` in `name`'s outbox are marked `redelivery`:
    /// offered to another instance, they may reach the platform from there first, and a
    /// copy sent from here afterwards must not look like a fresh answer.
    pub(super) fn mark_offered(&mut self, name: &str, tags: &[u64]) {
        if let Some(p) = self.map.get_mut(name) {
            for f in p.outbox.iter_mut().filter(|f| tags.contains(&f.cluster)) {
                let before = f.body.size();
                f.mark_redelivery();
                // The mark lengthens the line; the reservation (text bytes) is unchanged.
                p.outbox_bytes = p.outbox_bytes - before + f.body.size();
            }
        }
    }

    /// The platform's own name, if it is known.
    pub(super) fn key(&self, name: &str) -> Option<Arc<str>> {
        self.map.get_key_value(name).map(|(k, _)| k.clone())
    }

    /// `--cluster`: platforms with results in their outbox and no connection, each with its
    /// outbox results' cluster tags (those that have one), oldest first.
    pub(super) fn unattended(&self) -> Vec<(Arc<str>, Vec<u64>)> {
        self.map
            .iter()
            .filter(|(_, p)| p.conns.is_empty() && !p.outbox.is_empty())
            .map(|(name, p)| {
                let tags = p.outbox.iter().map(|f| f.cluster).filter(|&t| t != 0);
                (name.clone(), tags.collect())
            })
            .filter(|(_, tags): &(Arc<str>, Vec<u64>)| !tags.is_empty())
            .collect()
    }

    /// `--cluster`: every outbox result's cluster tag.
    pub(super) fn outboxed_tags(&self) -> std::collections::HashSet<u64> {
        self.map
            .values()
            .flat_map(|p| p.outbox.iter().map(|f| f.cluster))
            .filter(|&t| t != 0)
            .collect()
    }

    /// `--cluster`: whether `name`'s outbox (or held results) has the result of `tag`.
    pub(super) fn outbox_has(&self, name: &str, tag: u64) -> bool {
        self.map.get(name).is_some_and(|p| {
            p.outbox.iter().any(|f| f.cluster == tag)
                || p.held.iter().any(|(_, f)| f.cluster == tag)
        })
    }

    /// `--cluster`: how many more results `name` has room for within `--outbox-cap` and
    /// `--outbox-bytes` (none while results wait for room; a platform not known yet has
    /// the whole cap), for messages rebuilt here that another instance accepted
    /// (`cluster/bridge/room.rs`).
    pub(super) fn room_for(&self, name: &str) -> usize {
        let (reserve, cap, cap_bytes) = (self.reserve, self.outbox_cap, self.outbox_bytes);
        let Some(p) = self.map.get(name) else {
            return cap.min(cap_bytes / reserve.max(1));
        };
        if !p.held.is_empty() {
            return 0;
        }
        let bytes = cap_bytes.saturating_sub(p.reserved_bytes) / reserve.max(1);
        cap.saturating_sub(p.reserved_events).min(bytes)
    }

    /// `--cluster`: a result another instance forwards, taken into `name`'s outbox if it
    /// fits the platform's bounds as a new message's result would (`outbox_cap` events,
    /// `outbox_bytes` with its text charged now, nothing held before it); whether it did.
    pub(super) fn take_forwarded(&mut self, name: &str, frame: Frame) -> bool {
        let (reserve, cap, cap_bytes) = (self.reserve, self.outbox_cap, self.outbox_bytes);
        let Some(p) = self.get_mut(name) else {
            return false;
        };
        let room = reserve + text_bytes(&frame.body);
        if !p.held.is_empty()
            || p.reserved_events >= cap
            || p.reserved_bytes.saturating_add(room) > cap_bytes
        {
            return false;
        }
        p.reserved_events += 1;
        p.reserved_bytes += room;
        p.outbox_bytes += frame.body.size();
        p.outbox.push_back(frame);
        true
    }

    /// `--cluster`: the results of `tags` leave `name`'s outbox (another instance took
    /// them), their room released; returned.
    pub(super) fn remove_forwarded(
        &mut self,
        name: &str,
        tags: &std::collections::HashSet<u64>,
    ) -> Vec<Frame> {
        let reserve = self.reserve;
        let Some(p) = self.get_mut(name) else {
            return Vec::new();
        };
        let (gone, kept): (VecDeque<Frame>, VecDeque<Frame>) = std::mem::take(&mut p.outbox)
            .into_iter()
            .partition(|f| f.cluster != 0 && tags.contains(&f.cluster));
        p.outbox = kept;
        for f in &gone {
            let room = reserve + text_bytes(&f.body);
            debug_assert!(p.reserved_events > 0 && p.reserved_bytes >= room);
            p.outbox_bytes -= f.body.size();
            p.reserved_events -= 1;
            p.reserved_bytes = p.reserved_bytes.saturating_sub(room);
        }
        gone.into_iter().collect()
    }
}

/// Whether a result charged `text` more bytes fits `p`'s outbox bytes. One that does not
/// still fits when nothing else is charged beyond the envelopes: admission keeps every owed
/// envelope plus one largest result within the bound, so this only passes it for what
/// recovery restored under a lowered bound — and it keeps a held result from waiting forever.
fn fits(p: &Platform, text: usize, cap: usize, reserve: usize) -> bool {
    p.reserved_bytes.saturating_add(text) <= cap
        || p.reserved_bytes <= p.reserved_events.saturating_mul(reserve)
}

/// The bytes of a result charged when it exists (its envelope was reserved at admission):
/// a short result's whole line, a long one's text; the same before and after it is marked
/// a redelivery, so that what is charged is what is released.
fn text_bytes(body: &Body) -> usize {
    const MARK: &[u8] = b",\"redelivery\":true}\n";
    match body {
        Body::Line(l) if l.ends_with(MARK) => l.len() - (MARK.len() - 2),
        Body::Line(l) => l.len(),
        Body::Text { text, .. } => text.len(),
    }
}
