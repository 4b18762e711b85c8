//! The server's last steps once the runtime has shut down: outcomes journaled, output
//! written, the `delivered` confirmations of what was written to `acks` bridges awaited and
//! journaled (issue 30 row 14: a result shown during the drain is not sent again after a
//! restart), the journal finished. Each step is bounded in time.

use std::time::{Duration, Instant};

use mio::{Events as MioEvents, Poll};

use super::lines::{Line, ReadOutcome};
use super::{BridgeServer, ConnId, READ_BUDGET};

/// How long one wait for readiness lasts at most, so the deadlines are checked.
const POLL_SLICE: Duration = Duration::from_millis(50);

impl BridgeServer {
    pub(super) fn shut_down(&mut self, poll: &mut Poll) {
        let deadline = Instant::now() + self.flush_budget;
        let mut events = MioEvents::with_capacity(64);
        // Outcomes written during shutdown wait for the journal first (with a journal, the
        // messages shutdown cut off have none: they stay for the next start).
        loop {
            self.on_journal();
            self.run_actions(None);
            let left = deadline.saturating_duration_since(Instant::now());
            if self.bridge.backlog().unjournaled == 0 || left.is_zero() {
                break;
            }
            let _ = poll.poll(&mut events, Some(left.min(Duration::from_millis(50))));
        }
        loop {
            let busy: Vec<ConnId> = self
                .sockets
                .ids()
                .into_iter()
                .filter(|&id| self.bridge.has_output(id))
                .collect();
            if busy.is_empty() {
                break;
            }
            for id in busy {
                let _ = self.write_conn(id);
            }
            self.run_actions(None);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let stuck = self
                    .sockets
                    .ids()
                    .into_iter()
                    .filter(|&id| self.bridge.has_output(id))
                    .count();
                log::warn!(
                    "shutdown: {stuck} connection(s) still had output after the flush budget"
                );
                break;
            }
            let _ = poll.poll(&mut events, Some(left.min(Duration::from_millis(50))));
        }
        self.await_confirmations(poll);
        if let Some(j) = &mut self.journal {
            // What the flush delivered is recorded; the thread writes what is queued.
            let (done, finished) = j.finish(self.flush_budget);
            for c in done {
                let report = self.cluster.report();
                self.bridge.journaled_with(c, report, self.now);
            }
            if !finished {
                log::error!(
                    "shutdown: the journal did not finish writing within {:?}",
                    self.flush_budget
                );
                self.journal_unfinished
                    .store(true, std::sync::atomic::Ordering::SeqCst);
            }
            let kept = self.bridge.backlog().kept_for_restart;
            if kept > 0 {
                log::info!(
                    "shutdown: {kept} message(s) left in the journal for the next start (queued, or cut off by --drain-timeout)"
                );
            }
        }
        // Two different waits, said apart: results an outbox holds for a bridge, and results
        // held back because their outcome record could not be written (a full disk).
        let backlog = self.bridge.backlog();
        let unrecorded = backlog.unjournaled;
        let outboxed = backlog.outboxed - unrecorded;
        if outboxed > 0 {
            log::warn!(
                "shutdown: {outboxed} terminal event(s) were still waiting in outboxes for a bridge to take them"
            );
        }
        if unrecorded > 0 {
            log::warn!(
                "shutdown: {unrecorded} result(s) were never sent: their outcome records could not be written (the next start recovers their messages as after a crash)"
            );
        }
        self.watchdog = None;
    }

    /// Waits, at most [`BridgeServer::delivery_wait`], for the `delivered` confirmations of
    /// the results written to `acks` connections, reading nothing else; what they confirm
    /// is journaled as delivered before the journal finishes.
    fn await_confirmations(&mut self, poll: &mut Poll) {
        let deadline = Instant::now() + self.delivery_wait;
        let mut events = MioEvents::with_capacity(64);
        loop {
            let ids: Vec<ConnId> = self.sockets.ids();
            for &id in &ids {
                self.read_confirmations(id);
            }
            self.run_actions(None);
            let waiting = self.bridge.backlog().awaiting_delivery;
            if waiting == 0 {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::warn!(
                    "shutdown: {waiting} result(s) written to bridges were not confirmed within {:?}; they are sent again after the restart, marked redelivery",
                    self.delivery_wait
                );
                return;
            }
            let _ = poll.poll(&mut events, Some(left.min(POLL_SLICE)));
        }
    }

    /// Reads what `id` sent and takes its `delivered` lines only.
    fn read_confirmations(&mut self, id: ConnId) {
        let Some(sock) = self.sockets.get_mut(id) else {
            return;
        };
        if sock.eof {
            return;
        }
        let max_line = self.bridge.config().max_line_bytes;
        let mut lines = std::mem::take(&mut self.lines);
        let outcome = sock
            .reader
            .read_lines(&mut sock.stream, READ_BUDGET, max_line, &mut lines);
        for line in lines.drain(..) {
            if let Line::Complete(bytes) = line {
                self.bridge.confirmation_line(id, &bytes);
            }
        }
        self.lines = lines;
        match outcome {
            ReadOutcome::Eof => {
                if let Some(s) = self.sockets.get_mut(id) {
                    s.eof = true;
                }
                self.bridge.read_closed(id);
            }
            ReadOutcome::Failed => {
                self.bridge.disconnected(id);
                self.drop_socket(id);
            }
            ReadOutcome::Drained | ReadOutcome::MoreLater => {}
        }
    }
}
