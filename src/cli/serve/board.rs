//! What serve knows of the bridges it supervises (`[[bridge]]` tables), for the status:
//! each supervisor writes its process's life here (started, exited, restarts, its last
//! ERROR line), and the status joins it with what the bridge itself said over the protocol
//! (its hello, and its `link` reports of its platform connection) into one state per bridge
//! (`frontend.bridges`, docs/operating.md).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use crate::liveness::{FrontendStatus, SupervisedBridge, SupervisedState, rfc3339_utc};

/// Bytes of a bridge's last ERROR line kept (cut at a character boundary).
const LAST_ERROR_MAX: usize = 512;

/// One bridge's process, as its supervisor sees it.
#[derive(Clone)]
struct Process {
    platform: &'static str,
    running: bool,
    restarts: u64,
    last_exit: Option<String>,
    last_error: Option<String>,
    /// When it was last started or exited.
    changed: SystemTime,
    /// The state shown last and since when: a state's `since` moves only when it changes.
    shown: Option<(SupervisedState, SystemTime)>,
}

/// The supervised bridges' board, shared by their supervisors (writers) and the status
/// (reader, on the reactor: each lock is held for a few field copies).
#[derive(Clone, Default)]
pub(super) struct Board(Arc<Mutex<Vec<Process>>>);

impl Board {
    /// One row per table, in order, each not yet started.
    pub(super) fn new(platforms: impl Iterator<Item = &'static str>) -> Board {
        let now = SystemTime::now();
        let rows = platforms
            .map(|platform| Process {
                platform,
                running: false,
                restarts: 0,
                last_exit: None,
                last_error: None,
                changed: now,
                shown: None,
            })
            .collect();
        Board(Arc::new(Mutex::new(rows)))
    }

    fn rows(&self) -> MutexGuard<'_, Vec<Process>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Table `index` (from 1) started a process; `again`: after an exit.
    pub(super) fn started(&self, index: usize, again: bool) {
        if let Some(p) = self.rows().get_mut(index - 1) {
            p.running = true;
            p.restarts += u64::from(again);
            p.changed = SystemTime::now();
        }
    }

    /// Table `index`'s process exited (`how`: its status).
    pub(super) fn exited(&self, index: usize, how: String) {
        if let Some(p) = self.rows().get_mut(index - 1) {
            p.running = false;
            p.last_exit = Some(how);
            p.changed = SystemTime::now();
        }
    }

    /// Table `index`'s process logged `line` at ERROR (redacted again here: its secrets
    /// never reach the status).
    pub(super) fn error_line(&self, index: usize, line: &str) {
        let line = crate::platforms::secrets::redact(line.trim_end());
        let mut end = line.len().min(LAST_ERROR_MAX);
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        if let Some(p) = self.rows().get_mut(index - 1) {
            p.last_error = Some(line[..end].to_owned());
        }
    }

    /// Adds `bridges` to the frontend's figures: each process's life joined with what its
    /// platform's connections said (`outboxes[platform]`: connections, `link`).
    pub(super) fn fill(&self, status: &mut FrontendStatus) {
        let now = SystemTime::now();
        let platforms = status.bridge.as_ref().map(|b| &b.outboxes);
        let mut rows = self.rows();
        status.bridges = rows
            .iter_mut()
            .enumerate()
            .map(|(i, p)| {
                let seen = platforms.and_then(|m| m.get(p.platform));
                let connected = seen.is_some_and(|s| s.connections > 0);
                let link = seen.and_then(|s| s.link.as_ref());
                let (state, reason) = match (p.running, connected, link) {
                    (false, _, _) => (SupervisedState::Backoff, None),
                    (true, true, Some(l)) if !l.up => {
                        (SupervisedState::Reconnecting, l.detail.clone())
                    }
                    (true, true, _) => (SupervisedState::Ready, None),
                    // It had said hello since its start, and its connection is gone.
                    (true, false, _)
                        if p.shown.is_some_and(|(s, _)| {
                            s != SupervisedState::Starting && s != SupervisedState::Backoff
                        }) =>
                    {
                        (
                            SupervisedState::Reconnecting,
                            Some("not connected to the gateway".to_owned()),
                        )
                    }
                    (true, false, _) => (SupervisedState::Starting, None),
                };
                let since = match p.shown {
                    Some((s, at)) if s == state && at >= p.changed => at,
                    _ => {
                        let at = if matches!(
                            state,
                            SupervisedState::Starting | SupervisedState::Backoff
                        ) {
                            p.changed
                        } else {
                            now
                        };
                        p.shown = Some((state, at));
                        at
                    }
                };
                SupervisedBridge {
                    index: i + 1,
                    platform: p.platform.to_owned(),
                    state,
                    reason,
                    restarts: p.restarts,
                    since: rfc3339_utc(since),
                    last_exit: p.last_exit.clone(),
                    last_error: p.last_error.clone(),
                }
            })
            .collect();
    }
}

/// Whether a line of a bridge's log (text or JSON format) is at ERROR.
pub(super) fn is_error_line(line: &[u8]) -> bool {
    let has = |needle: &[u8]| line.windows(needle.len()).any(|w| w == needle);
    has(b" ERROR ") || has(b"\"level\":\"ERROR\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::{BridgeStatus, LinkStatus, PlatformStatus};

    fn status(connections: usize, link: Option<LinkStatus>) -> FrontendStatus {
        let mut b = BridgeStatus::default();
        b.outboxes.insert(
            "matrix".into(),
            PlatformStatus {
                connections,
                link,
                ..PlatformStatus::default()
            },
        );
        FrontendStatus {
            bridge: Some(b),
            ..FrontendStatus::default()
        }
    }

    fn state(board: &Board, s: FrontendStatus) -> (SupervisedState, Option<String>) {
        let mut s = s;
        board.fill(&mut s);
        (s.bridges[0].state, s.bridges[0].reason.clone())
    }

    #[test]
    fn the_state_joins_the_process_with_what_the_bridge_reported() {
        let board = Board::new(["matrix"].into_iter());
        assert_eq!(state(&board, status(0, None)).0, SupervisedState::Backoff);
        board.started(1, false);
        assert_eq!(state(&board, status(0, None)).0, SupervisedState::Starting);
        assert_eq!(state(&board, status(1, None)).0, SupervisedState::Ready);
        let down = LinkStatus {
            up: false,
            detail: Some("homeserver unreachable".into()),
        };
        assert_eq!(
            state(&board, status(1, Some(down))),
            (
                SupervisedState::Reconnecting,
                Some("homeserver unreachable".into())
            )
        );
        let up = LinkStatus {
            up: true,
            detail: None,
        };
        assert_eq!(state(&board, status(1, Some(up))).0, SupervisedState::Ready);
        assert_eq!(
            state(&board, status(0, None)).0,
            SupervisedState::Reconnecting
        );
        board.exited(1, "exit status: 1".into());
        assert_eq!(state(&board, status(0, None)).0, SupervisedState::Backoff);
        board.started(1, true);
        let mut s = status(0, None);
        board.fill(&mut s);
        assert_eq!(s.bridges[0].state, SupervisedState::Starting);
        assert_eq!(s.bridges[0].restarts, 1);
        assert_eq!(s.bridges[0].last_exit.as_deref(), Some("exit status: 1"));
    }

    #[test]
    fn error_lines_are_told_in_both_formats() {
        assert!(is_error_line(
            b"[2026-01-01T00:00:00Z ERROR turnstile] boom"
        ));
        assert!(is_error_line(br#"{"ts":"x","level":"ERROR","msg":"boom"}"#));
        assert!(!is_error_line(
            b"[2026-01-01T00:00:00Z WARN turnstile] ERROR-ish"
        ));
    }
}
