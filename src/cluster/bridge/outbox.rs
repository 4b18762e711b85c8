//! The cluster's operations on the platforms' room (`--cluster`): results found, marked,
//! taken in and given away by their cluster tag ([`Frame::cluster`]), for the forwards
//! (`forward.rs`). Mounted as a child of `server/bridge/platforms.rs`, whose fields it reads.
#![cfg(feature = "cluster")]

use std::collections::VecDeque;
use std::sync::Arc;

use super::{Platforms, text_bytes};
use crate::server::frame::Frame;

impl Platforms {
    /// The platform's own name, if it is known.
    pub(in crate::server::bridge) fn key(&self, name: &str) -> Option<Arc<str>> {
        self.map.get_key_value(name).map(|(k, _)| k.clone())
    }

    /// `--cluster`: platforms with results in their outbox and no connection, each with its
    /// outbox results' cluster tags (those that have one), oldest first.
    pub(in crate::server::bridge) fn unattended(&self) -> Vec<(Arc<str>, Vec<u64>)> {
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
    pub(in crate::server::bridge) fn outboxed_tags(&self) -> std::collections::HashSet<u64> {
        self.map
            .values()
            .flat_map(|p| p.outbox.iter().map(|f| f.cluster))
            .filter(|&t| t != 0)
            .collect()
    }

    /// `--cluster`: whether `name`'s outbox (or held results) has the result of `tag`.
    pub(in crate::server::bridge) fn outbox_has(&self, name: &str, tag: u64) -> bool {
        self.map.get(name).is_some_and(|p| {
            p.outbox.iter().any(|f| f.cluster == tag)
                || p.held.iter().any(|(_, f)| f.cluster == tag)
        })
    }

    /// `--cluster`: a result another instance forwards, taken into `name`'s outbox if it
    /// fits the platform's bounds as a new message's result would (`outbox_cap` events,
    /// `outbox_bytes` with its text charged now, nothing held before it); whether it did.
    pub(in crate::server::bridge) fn take_forwarded(&mut self, name: &str, frame: Frame) -> bool {
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
    pub(in crate::server::bridge) fn remove_forwarded(
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
