//! The containment tests: real processes under real leaders.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::bounded::LineTooLong;
use super::sys::{pidfd_open, pipe, wait_exited};
use super::tree::{open_child, stat_of};
use super::*;

/// The state letter of `pid` in /proc (`Z`: a zombie).
fn state_of(pid: i32) -> Option<u8> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = text.rsplit(')').next()?;
    rest.trim_start().bytes().next()
}

/// Whether `pid` is a running process (a zombie counts as dead).
fn running(pid: i32) -> bool {
    state_of(pid).is_some_and(|s| s != b'Z')
}

fn env() -> Vec<(String, String)> {
    AgentEnv::default().build(&[])
}

fn read_all(f: &mut File) -> String {
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    s
}

#[test]
fn the_command_runs_with_its_output_and_exit_status() {
    let mut c =
        ContainedChild::spawn("cat; echo out; echo err >&2; exit 3", &env()).expect("spawn");
    let mut stdin = c.stdin.take().expect("stdin");
    stdin.write_all(b"in\n").expect("write");
    drop(stdin);
    let mut out = c.stdout.take().expect("stdout");
    let mut err = c.stderr.take().expect("stderr");
    assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Code(3)));
    // The leader closes its pipes once it has reported: end of file without a kill.
    assert_eq!(read_all(&mut out), "in\nout\n");
    assert_eq!(read_all(&mut err), "err\n");
    assert!(c.kill());
    assert_eq!(c.try_exit(), Some(Exit::Code(3)));
}

#[test]
fn signals_and_a_killed_leader_are_reported() {
    let mut c = ContainedChild::spawn("kill -9 $$", &env()).expect("spawn");
    assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Signal(9)));
}

#[test]
fn an_agent_that_kills_its_leader_is_swept_up_by_the_subreaper_gateway() {
    become_subreaper().expect("prctl");
    // The command kills its own leader (its parent): nothing is reported, and the rest of
    // the agent is re-parented to this process, which kills it as a stray.
    let mut c =
        ContainedChild::spawn("echo $$; kill -9 $PPID; exec sleep 60", &env()).expect("spawn");
    let mut out = std::io::BufReader::new(c.stdout.take().expect("stdout"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).expect("pid line");
    let pid: i32 = line.trim().parse().expect("pid");
    assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Lost));
    assert!(running(pid));
    c.kill();
    let fd = pidfd_open(pid);
    let gone =
        fd.is_err() || fd.is_ok_and(|fd| wait_exited(&[fd.as_fd()], Duration::from_secs(20)));
    assert!(gone, "the escaped sleep survived");
    assert!(!running(pid), "the escaped sleep was not reaped");
}

#[test]
fn the_environment_is_the_allow_list_only() {
    // The gateway's environment as `build` would read it (not set on this process: a
    // `set_var` races the other tests' threads reading theirs).
    let gateway_env = |name: &str| {
        let value = match name {
            "PATH" => "/usr/bin:/bin",
            "HOME" => "/home/gateway",
            "TURNSTILE_AUTH_TOKEN" | "TURNSTILE_AUTH_TOKEN_CHILD_TEST" => "secret",
            "CHILD_TEST_PASSED" => "yes",
            "CHILD_TEST_HIDDEN" => "no",
            _ => return None,
        };
        Some(value.to_owned())
    };
    let env = AgentEnv::new(["CHILD_TEST_PASSED"])
        .expect("valid")
        .build_from(&[("TURNSTILE_SESSION", "s")], gateway_env);
    let mut c = ContainedChild::spawn("env", &env).expect("spawn");
    let mut out = c.stdout.take().expect("stdout");
    c.wait_exit(Duration::from_secs(20));
    let out = read_all(&mut out);
    // Nothing of this process's own environment either (cargo's CARGO_* variables).
    let mut got: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split('=').next())
        .filter(|n| !["PWD", "SHLVL", "_", "OLDPWD"].contains(n))
        .collect();
    let mut want = vec!["PATH", "HOME", "CHILD_TEST_PASSED", "TURNSTILE_SESSION"];
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want, "{out}");
    assert!(out.contains("CHILD_TEST_PASSED=yes\n"), "{out}");
    assert!(!out.contains("secret"));
    assert!(AgentEnv::new(["TURNSTILE_AUTH_TOKEN"]).is_err());
    assert!(AgentEnv::new(["A=B"]).is_err());
}

#[test]
fn a_setsid_double_forked_process_stays_in_the_tree_and_dies_with_it() {
    let mut c = ContainedChild::spawn(
        "setsid sh -c 'sleep 300 >/dev/null 2>&1 & echo $!' & wait; echo done",
        &env(),
    )
    .expect("spawn");
    let mut out = c.stdout.take().expect("stdout");
    assert_eq!(c.wait_exit(Duration::from_secs(20)), Some(Exit::Code(0)));
    let text = read_all(&mut out);
    let pid: i32 = text
        .lines()
        .next()
        .and_then(|l| l.parse().ok())
        .expect("pid");
    assert!(running(pid), "the sleep is running: {text}");
    let st = stat_of(pid).expect("stat");
    assert_eq!(
        st.ppid,
        c.leader_pid(),
        "re-parented to the leader, not init"
    );
    assert!(c.has_descendants());
    assert!(c.kill());
    assert!(!running(pid), "the detached sleep survived the kill");
}

#[test]
fn output_is_kept_up_to_its_cap_and_the_rest_drained() {
    let mut c = ContainedChild::spawn("head -c 5000000 /dev/zero", &env()).expect("spawn");
    let mut out = c.stdout.take().expect("stdout");
    set_nonblocking(out.as_fd()).expect("nonblocking");
    let mut buf = OutputBuf::new(1000);
    loop {
        let mut p = [pollin(out.as_raw_fd())];
        poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
        if buf.read_from(&mut out, READ_BUDGET).expect("read") == ReadState::Eof {
            break;
        }
    }
    assert_eq!(buf.total(), 5_000_000);
    assert_eq!(buf.kept(), &[0u8; 1000][..]);
    let buffered = buf.buffered();
    assert!(
        (1000..=1000).contains(&buffered),
        "{buffered} bytes buffered"
    );
    assert!(buf.truncated());
    assert_eq!(buf.into_vec().len(), 1000);
    // Output within the cap is kept whole and not flagged.
    let mut c = ContainedChild::spawn("printf abc", &env()).expect("spawn");
    let mut out = c.stdout.take().expect("stdout");
    set_nonblocking(out.as_fd()).expect("nonblocking");
    let mut buf = OutputBuf::new(3);
    while buf.read_from(&mut out, READ_BUDGET).expect("read") != ReadState::Eof {
        let mut p = [pollin(out.as_raw_fd())];
        poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
    }
    assert_eq!((buf.kept(), buf.truncated()), (&b"abc"[..], false));
}

/// A pipe with `data` written into it by a thread; the read end, non-blocking.
fn pipe_with(data: Vec<u8>) -> File {
    let (r, w) = pipe().expect("pipe");
    let mut w = File::from(w);
    thread::spawn(move || {
        let _ = w.write_all(&data);
    });
    let r = File::from(r);
    set_nonblocking(r.as_fd()).expect("nonblocking");
    r
}

/// Reads `r` to its end through `lines`, collecting lines (or the first error).
fn read_lines(
    lines: &mut LineBuf,
    r: &mut File,
    budget: usize,
) -> Result<Vec<Vec<u8>>, LineTooLong> {
    let mut got = Vec::new();
    loop {
        let state = lines.read_from(r, budget).expect("read");
        while let Some(line) = lines.next_line() {
            got.push(line?);
        }
        match state {
            ReadState::Eof => return Ok(got),
            ReadState::More => {}
            ReadState::WouldBlock => {
                let mut p = [pollin(r.as_raw_fd())];
                poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
            }
        }
    }
}

#[test]
fn only_a_live_child_of_the_given_parent_is_opened() {
    let me = std::process::id() as i32;
    let mut sleeper = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("spawn");
    let pid = sleeper.id() as i32;
    let st = stat_of(pid).expect("stat");
    assert_eq!(st.ppid, me);
    assert!(open_child(pid, me).is_some_and(|p| p.pid == pid));
    assert!(
        open_child(pid, 1).is_none(),
        "opened as the child of another parent"
    );
    let _ = sleeper.kill();
    // Exited but not reaped (a zombie): not live.
    let fd = pidfd_open(pid).expect("pidfd");
    assert!(wait_exited(&[fd.as_fd()], Duration::from_secs(20)));
    assert_eq!(state_of(pid), Some(b'Z'));
    assert!(open_child(pid, me).is_none(), "a zombie was taken for live");
    let _ = sleeper.wait();
    assert!(stat_of(pid).is_none());
}

#[test]
fn many_short_lines_pass_through_a_small_buffer() {
    // 20 MB of lines through a 1000-byte line limit: consumed lines are dropped from the
    // buffer, which never holds much more than one chunk.
    let line = b"0123456789".repeat(9);
    let mut data = Vec::new();
    while data.len() < 20_000_000 {
        data.extend_from_slice(&line);
        data.push(b'\n');
    }
    let n = data.len() / (line.len() + 1);
    let mut r = pipe_with(data);
    let mut lines = LineBuf::new(1000);
    let mut count = 0;
    let mut peak = 0;
    loop {
        let state = lines.read_from(&mut r, READ_BUDGET).expect("read");
        peak = peak.max(lines.buffered());
        while let Some(l) = lines.next_line() {
            assert_eq!(l.expect("short line"), line);
            count += 1;
        }
        if state == ReadState::Eof {
            break;
        }
        if state == ReadState::WouldBlock {
            let mut p = [pollin(r.as_raw_fd())];
            poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
        }
    }
    assert_eq!(count, n);
    // At least one chunk was read into it, and never much more.
    assert!(
        (64 * 1024..=1000 + 3 * 64 * 1024).contains(&peak),
        "{peak} bytes buffered"
    );
}

#[test]
fn a_line_of_exactly_the_limit_passes_and_one_byte_more_does_not() {
    let mut data = vec![b'a'; 100];
    data.push(b'\n');
    data.extend(vec![b'b'; 101]);
    data.push(b'\n');
    let mut r = pipe_with(data);
    let mut lines = LineBuf::new(100);
    let mut got = Vec::new();
    let err = loop {
        let state = lines.read_from(&mut r, READ_BUDGET).expect("read");
        match lines.next_line() {
            Some(Ok(l)) => got.push(l),
            Some(Err(e)) => break e,
            None if state == ReadState::Eof => panic!("no error for the long line"),
            None => {
                let mut p = [pollin(r.as_raw_fd())];
                poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
            }
        }
    };
    assert_eq!(got, vec![vec![b'a'; 100]]);
    assert_eq!(err, LineTooLong { max: 100 });
    // Without a newline: an unfinished line past the limit is refused too.
    let mut r = pipe_with(vec![b'c'; 5000]);
    let mut lines = LineBuf::new(100);
    assert_eq!(
        read_lines(&mut lines, &mut r, READ_BUDGET),
        Err(LineTooLong { max: 100 })
    );
    let mut r = pipe_with(vec![b'c'; 100]);
    let mut lines = LineBuf::new(100);
    assert_eq!(read_lines(&mut lines, &mut r, READ_BUDGET), Ok(vec![]));
}

#[test]
fn a_read_stops_at_its_budget_so_a_flood_cannot_hold_the_loop() {
    // 4 MB without a newline, under a 10 MB limit: each call reads about the budget.
    let (r, w) = pipe().expect("pipe");
    let mut w = File::from(w);
    // SAFETY: F_SETPIPE_SZ on a pipe we own; a larger pipe lets one read see more.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
    let writer = thread::spawn(move || {
        let _ = w.write_all(&vec![b'x'; 4 << 20]);
    });
    let mut r = File::from(r);
    set_nonblocking(r.as_fd()).expect("nonblocking");
    let mut lines = LineBuf::new(10 << 20);
    let mut p = [pollin(r.as_raw_fd())];
    poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
    let budget = 100_000;
    let _ = lines.read_from(&mut r, budget).expect("read");
    assert!(lines.pending() > 0);
    assert!(
        lines.pending() < budget + 64 * 1024,
        "{} bytes read for a budget of {budget}",
        lines.pending()
    );
    drop(r);
    let _ = writer.join();
}

#[test]
fn lines_are_split_and_an_overlong_one_is_refused_without_buffering_it() {
    let mut c = ContainedChild::spawn(
        "printf 'one\\ntwo\\n'; head -c 3000000 /dev/zero; echo",
        &env(),
    )
    .expect("spawn");
    let mut out = c.stdout.take().expect("stdout");
    set_nonblocking(out.as_fd()).expect("nonblocking");
    let mut lines = LineBuf::new(100_000);
    let mut got = Vec::new();
    let too_long = 'outer: loop {
        let mut p = [pollin(out.as_raw_fd())];
        poll(&mut p, Some(Duration::from_secs(20))).expect("poll");
        let state = lines.read_from(&mut out, READ_BUDGET).expect("read");
        while let Some(line) = lines.next_line() {
            match line {
                Ok(l) => got.push(String::from_utf8_lossy(&l).into_owned()),
                Err(e) => break 'outer Some(e),
            }
        }
        if state == ReadState::Eof {
            break None;
        }
    };
    assert_eq!(got, ["one", "two"]);
    assert_eq!(too_long, Some(LineTooLong { max: 100_000 }));
    assert!(
        lines.buffered() <= 100_000 + 3 * 64 * 1024,
        "{} bytes buffered",
        lines.buffered()
    );
}

#[test]
fn cancellation_wakes_a_poll_through_the_token_hook() {
    let token = crate::agent::CancelToken::new();
    let wake = Arc::new(Wake::new().expect("eventfd"));
    let w = Arc::clone(&wake);
    token.on_cancel(move || w.signal());
    let canceller = {
        let token = token.clone();
        thread::spawn(move || token.cancel())
    };
    let mut p = [pollin(wake.fd())];
    assert_eq!(
        poll(&mut p, Some(Duration::from_secs(20))).expect("poll"),
        1
    );
    canceller.join().expect("join");
}
