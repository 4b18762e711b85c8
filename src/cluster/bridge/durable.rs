//! The cluster's operations on the bridge's journal side (`--cluster`): a message answered
//! otherwise leaves its wait, a terminal event whose outcome record was not written is taken
//! back. Mounted as a child of `server/bridge/durable.rs`, whose fields it reads.
#![cfg(feature = "cluster")]

use super::super::ConnId;
use super::Durable;
use crate::message::Message;
use crate::server::frame::Frame;

impl Durable {
    /// The message of `tag` no longer waits for the journal (answered otherwise).
    pub(in crate::server::bridge) fn forget_waiting(&mut self, tag: u64) -> Option<Message> {
        self.waiting.remove(&tag)
    }

    /// The terminal event held for `seq`'s outcome record, taken out (the record was not
    /// written).
    pub(in crate::server::bridge) fn take_unjournaled(
        &mut self,
        seq: u64,
    ) -> Option<(ConnId, Frame)> {
        self.taken_outcomes.remove(&seq);
        self.unjournaled.remove(&seq)
    }

    /// Whether the runtime refused the message of `tag` and its `forget` record is pending.
    pub(in crate::server::bridge) fn is_forgetting(&self, tag: u64) -> bool {
        self.forgetting.contains_key(&tag)
    }

    /// Whether the terminal event of `seq` waits for its outcome record.
    pub(in crate::server::bridge) fn is_unjournaled(&self, seq: u64) -> bool {
        self.unjournaled.contains_key(&seq)
    }
}
