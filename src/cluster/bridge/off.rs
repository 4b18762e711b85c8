//! The no-op twin of the bridge's cluster side, for a build without the `cluster` feature:
//! the same hooks, each doing nothing (see `mod.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use super::super::ConnId;
use super::super::durable::Durable;
use super::super::routes::{Phase, Routes, no_conn};
use super::{Effects, Rooms};
use crate::core::EventKind;
use crate::journal::Committed;
use crate::message::SessionKey;
use crate::server::frame::Frame;

/// No cluster report without the feature: always `None` (a public type, as
/// `Bridge::journaled_with` is public).
pub(crate) type Report = Option<Infallible>;
/// No request for a stream reader without the feature.
pub(in crate::server) type Request = Infallible;

/// Not a cluster member: no state.
#[derive(Default)]
pub(in crate::server) struct ClusterSide {}

impl ClusterSide {
    /// Every held turn runs here.
    pub(in crate::server) fn runs_here(&self, _tag: u64, _routes: &Routes) -> bool {
        true
    }

    /// No cluster part in a journal report.
    pub(in crate::server) fn take_report(&mut self, _report: Report) {}

    /// No step of a cluster report.
    pub(in crate::server) fn report_step(
        &mut self,
        _c: &mut Committed,
        _rooms: Rooms<'_>,
    ) -> Option<Effects> {
        None
    }

    /// No partition to hand over or drain.
    pub(in crate::server) fn after_report(&mut self, _rooms: Rooms<'_>) -> Effects {
        Effects::new()
    }

    /// No rebuilt message waits for room.
    pub(in crate::server) fn rebuild_next(&mut self, _rooms: Rooms<'_>) -> Option<Effects> {
        None
    }

    /// No message waits for another instance: none in phase `Remote`.
    pub(in crate::server) fn check(&self, routes: &Routes) {
        debug_assert!(routes.values().all(|r| r.phase != Phase::Remote));
    }

    /// No result waits for another instance.
    pub(in crate::server) fn orphan_platforms(&self) -> std::iter::Empty<&str> {
        std::iter::empty()
    }

    /// No message is handed over: none of its events is discarded.
    pub(in crate::server) fn handed_event(&mut self, _tag: u64, _kind: &EventKind) -> bool {
        false
    }

    /// No partition drains: every turn may start.
    pub(in crate::server) fn turn_gate(
        &mut self,
        _tag: u64,
        _session: &SessionKey,
        _routes: &Routes,
        _durable: Option<&Durable>,
    ) -> bool {
        false
    }

    /// No rebuilt message waits for room: admission's gate is open.
    pub(in crate::server) fn outbox_gate(
        &self,
        _platform: &str,
        _cap: usize,
    ) -> Result<(), super::super::refusal::Refusal> {
        Ok(())
    }

    /// No hello registry.
    pub(in crate::server) fn hello(&self, _platform: &Arc<str>) -> Option<Request> {
        None
    }

    /// No forwards.
    pub(in crate::server) fn offer(&mut self, _rooms: Rooms<'_>) -> Effects {
        Effects::new()
    }

    /// No result is another instance's.
    pub(in crate::server) fn mark_foreign(&mut self, frame: Frame, _routes: &Routes) -> Frame {
        frame
    }

    /// No result is another instance's to send.
    pub(in crate::server) fn silenced(&mut self, _seq: u64) -> bool {
        false
    }

    /// No cluster tag.
    pub(in crate::server) fn stamp(&self, frame: Frame) -> Frame {
        frame
    }

    /// No lease to fence.
    pub(in crate::server) fn fence(&mut self, _rooms: Rooms<'_>) -> Effects {
        Effects::new()
    }

    /// No lease to fence.
    pub(in crate::server) fn next_fence(&self) -> Option<Duration> {
        None
    }

    /// No message waits for a rebuilt partition.
    pub(in crate::server) fn rebound(&mut self, _tag: u64) -> ConnId {
        no_conn()
    }
}
