//! Child processes of the platform tests: they die with the test that started them, and a
//! [`Proc`] is killed when dropped, so no bridge or server outlives a failed run. A test
//! target adds the other methods it needs in an `impl Proc` of its own.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Only a failing run waits this long.
const WAIT: Duration = Duration::from_secs(60);

include!("../common/die_with_parent.rs");

/// A child process, killed and reaped when dropped.
pub struct Proc(pub Child);

impl Proc {
    /// Sends `sig` to the child.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, sig) }, 0);
    }

    /// SIGTERM, then the exit (bounded).
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit()
    }

    /// The exit (bounded): polled, since std offers no wait with a deadline.
    #[track_caller]
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the process did not exit within {WAIT:?}"
            );
            std::thread::park_timeout(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child's first line on its (piped) stdout, trimmed: read on a thread of its own, so a
/// child that says nothing fails the test after `within` instead of hanging it.
pub fn first_line(child: &mut Child, within: Duration) -> String {
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    rx.recv_timeout(within)
        .expect("first line")
        .trim()
        .to_owned()
}
