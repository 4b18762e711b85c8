//! What the bridge asks of its shell ([`Bridge::poll_action`]).

use super::ConnId;
use super::cluster;
use crate::core::TurnId;
use crate::journal::Record;
use crate::message::{Message, SessionKey};

/// What the bridge asks of its shell.
#[derive(Debug)]
pub enum Action {
    /// Submit to the runtime; its events come back through [`Bridge::event`] with `tag`.
    Submit {
        /// The route tag.
        tag: u64,
        /// The message.
        message: Message,
    },
    /// Close the connection's socket; the bridge has forgotten it.
    Close(ConnId),
    /// Reset the connection (close discarding unsent data): results written to it and not
    /// acknowledged went back to the outbox, so nothing more of them may reach the peer.
    Reset(ConnId),
    /// Write a record to the journal; accepted messages are confirmed through
    /// [`Bridge::journaled`].
    Journal(Record),
    /// With a journal, messages are submitted held (`Ctx::submit_held`): this turn's
    /// `started` record is durable, so it may now be handed to an agent
    /// (`Ctx::release_turn`).
    StartTurn(TurnId),
    /// `--cluster`: these sessions' partition is no longer this instance's: they leave the
    /// runtime (`Ctx::hand_over`); their messages' events are discarded from now on.
    HandOver(Vec<SessionKey>),
    /// `--cluster`: this drained partition may be released (its turns ended, its sessions
    /// were handed over): tell the journal thread (`ClusterLink::release_drained`).
    ReleasePartition(u32),
    /// `--cluster`: a request for the stream reader's connection (the hello registry, a
    /// forward of results and its answer; `Reader::request`). Without the feature, none
    /// can be made (`Infallible`).
    Cluster(cluster::Request),
    /// These files (in the spool, checked at admission) belong to messages whose route
    /// ended: delete them, off the reactor.
    ReleaseFiles(Vec<String>),
}
