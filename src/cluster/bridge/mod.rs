//! The bridge's cluster side (`--cluster`), mounted as the bridge's `cluster` module
//! (`server/bridge/mod.rs`), so that it works on the bridge's rooms without widening them.
//!
//! The seam: the bridge holds one [`ClusterSide`] beside its `Durable` (the cluster's state:
//! remote waits, owned partitions, hand-overs, orphans, drains, forwards, early outcomes).
//! `ClusterSide`'s own hooks, the same in both builds, take what they read as arguments and
//! return what the bridge is to do, never calling back:
//! - on an input: `handed_event` (a handed-over message's runtime event is discarded),
//!   `turn_gate` (a turn of a draining partition stays held; given the routes and the
//!   journal side), `hello` and `offers` (the requests for the reader to send);
//! - on the journal's report: `runs_here` (a held turn of an ended partition stays held),
//!   `silenced` (a result another instance sends: the bridge gives its reservation back)
//!   and `mark_foreign` (a result released by its outcome record);
//! - on a result's way out: `stamp`; on recovery: `rebound`; in the audit: `check` (the
//!   remote index against the routes, both ways) and `orphan_platforms`; in the status:
//!   `fill_status` (through `Bridge::cluster_status`).
//!
//! What the cluster side decides that is the bridge's own to carry out (close a finished
//! connection, submit, refuse, rebuild recovered messages, an action for the shell) it
//! returns as [`Effects`], in order; what it does on the bridge's rooms it does on the
//! [`Rooms`] the bridge lends it for one step (the routes, the journal side and the
//! delivery room). `Bridge::cluster_step` (reached from `journaled_with`, `tick` and, in a
//! cluster build, `arrived`) lends the rooms, runs a step and applies its effects; a step
//! whose later reads depend on an earlier effect (a refusal before the hand-overs, a
//! partition's rebuild before the next one's room is measured) ends there, and the bridge
//! asks for the next (`report_step`, `rebuild_next`).
//!
//! Without the `cluster` feature, `off.rs` is the no-op twin of all of it; with it:
//! - `side`: the state and its hooks;
//! - `report`: the cluster's part of a journal report, in steps;
//! - `handover`: a partition lost, fenced or drained leaves this instance;
//! - `arrival`: what the stream reader brought;
//! - `drain`: a planned release (a partition drained before it is handed over);
//! - `fence`: self-fencing (a partition past its lease's fence deadline is handed over);
//! - `forward`: results offered to, and taken from, the instance of a platform's newest hello
//!   (the outboxes' own operations by cluster tag are the platforms room's);
//! - `early`: outcomes from the stream that came before their message was known to wait;
//! - `elsewhere`: messages run here that another instance accepted, and who sends their
//!   results (their live origin, or this instance for an origin taken for dead);
//! - `order`: own accepts held behind the inbox of their partition (per-session order
//!   across instances);
//! - `lapse`: whether this instance may have been taken for dead (its results marked);
//! - `room`: rebuilt messages of owned partitions waiting for outbox room.

#[cfg(feature = "cluster")]
mod arrival;
#[cfg(feature = "cluster")]
mod drain;
#[cfg(feature = "cluster")]
mod early;
#[cfg(feature = "cluster")]
mod elsewhere;
#[cfg(feature = "cluster")]
mod fence;
#[cfg(feature = "cluster")]
mod forward;
#[cfg(feature = "cluster")]
mod handover;
#[cfg(feature = "cluster")]
mod lapse;
#[cfg(not(feature = "cluster"))]
mod off;
#[cfg(feature = "cluster")]
mod order;
#[cfg(feature = "cluster")]
mod report;
#[cfg(feature = "cluster")]
mod room;
#[cfg(feature = "cluster")]
mod side;

#[cfg(not(feature = "cluster"))]
pub(crate) use off::Report;
#[cfg(not(feature = "cluster"))]
pub(in crate::server) use off::{ClusterSide, Request};
#[cfg(feature = "cluster")]
pub(in crate::server) use side::ClusterSide;

/// The cluster's part of a journal report (`crate::cluster::ClusterReport`; without the
/// feature, nothing).
#[cfg(feature = "cluster")]
pub(crate) type Report = crate::cluster::ClusterReport;
/// A request of the bridge for the stream reader's connection (without the feature, none).
#[cfg(feature = "cluster")]
pub(in crate::server) type Request = crate::cluster::ClusterRequest;

use super::delivery::Delivery;
use super::durable::Durable;
use super::refusal::Refusal;
use super::routes::Routes;
use super::{Action, ConnId};
use crate::journal::{Recovered, RecoveredMessage};
use crate::message::Message;

/// The bridge's rooms the cluster side works on for one step, lent by the bridge.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))] // the no-op twin works on none
pub(in crate::server) struct Rooms<'a> {
    /// Messages in flight.
    pub(in crate::server) routes: &'a mut Routes,
    /// The journal side (with `--data-dir` or `--cluster`).
    pub(in crate::server) durable: Option<&'a mut Durable>,
    /// Connections and platforms, and the time of the input.
    pub(in crate::server) delivery: Delivery<'a>,
}

/// What the cluster side decided that the bridge carries out, in order.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))] // the no-op twin decides nothing
pub(in crate::server) enum Effect {
    /// A connection may have nothing left to do: closed if so (`Delivery::finish_if_done`).
    Finish(ConnId),
    /// A durable message goes to the runtime (`Bridge::submit`).
    Submit(u64, Message),
    /// A message is refused (`Bridge::refuse`).
    Refuse(u64, Refusal),
    /// A gained partition's messages are rebuilt as recovery rebuilds the journal
    /// (`Bridge::recover`, with the wall clock then).
    Recover(Recovered, u64),
    /// One message of an owned partition is rebuilt (`Bridge::recover_message`).
    Rebuild(RecoveredMessage),
    /// An action for the shell.
    Act(Action),
}

/// The cluster side's decisions of one step, in order.
pub(in crate::server) type Effects = Vec<Effect>;
