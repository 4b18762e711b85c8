//! The endpoint's own tests (sockets on loopback, a poll of their own).

use super::*;

/// Serves every path as healthy and ready, `/status` with a body of `status_len` bytes.
struct Healthy {
    status_len: usize,
}

/// Healthy, with a `/status` of two bytes.
const HEALTHY: Healthy = Healthy { status_len: 2 };

/// Healthy, with a `/status` body far larger than a socket's buffers: its answer stays
/// part-written while the client does not read.
const HUGE_STATUS: Healthy = Healthy {
    status_len: 32 << 20,
};

impl OpsSource for Healthy {
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn ready(&self) -> Result<(), String> {
        Ok(())
    }
    fn status_json(&self) -> Vec<u8> {
        vec![b' '; self.status_len]
    }
    fn metrics(&self) -> String {
        String::new()
    }
}

/// Drives `server` as its thread would (poll, events, wake, pass) until `done` holds for
/// its figures; fails naming `what` after 10 s.
fn drive_until(
    server: &mut HttpServer,
    poll: &mut mio::Poll,
    what: &str,
    done: impl Fn(&HttpStatus) -> bool,
) {
    drive_with(server, poll, &HEALTHY, what, done);
}

/// [`drive_until`] with another source.
fn drive_with(
    server: &mut HttpServer,
    poll: &mut mio::Poll,
    source: &dyn OpsSource,
    what: &str,
    done: impl Fn(&HttpStatus) -> bool,
) {
    let mut events = mio::Events::with_capacity(16);
    let now = Duration::from_secs(1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done(&server.stats) {
        assert!(
            std::time::Instant::now() < deadline,
            "never saw {what}: {:?}",
            server.stats
        );
        poll.poll(&mut events, Some(Duration::from_millis(50)))
            .unwrap();
        for event in &events {
            server.on_ready(event, now, source);
        }
        server.on_wake(now);
        server.serve(now, source);
    }
}

#[test]
#[cfg(debug_assertions)]
fn the_endpoint_keeps_its_invariants_through_accept_and_requests() {
    let mut poll = mio::Poll::new().unwrap();
    let cfg = HttpConfig {
        max_connections: 2,
        ..HttpConfig::default()
    };
    let mut server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    server.register(poll.registry()).unwrap();
    server.check();
    let addr = server.local_addr().unwrap();
    let mut clients: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    clients[0]
        .write_all(b"GET /healthz HTTP/1.1\r\n\r\nGET /nope HTTP/1.1\r\n\r\n")
        .unwrap();
    drive_until(&mut server, &mut poll, "an eviction", |st| st.evicted >= 1);
    assert_eq!(server.status().connections, 2);
    assert_eq!(server.stats.refused, 0);
    server.close_all();
    server.check();
}

/// Issue 18 row 3, a churner on the probe's own address: a probe whose request has
/// arrived is not "idle" because its pass has not come yet. The probe and four silent
/// connections from the same address land in one accept batch, over a per-peer cap of
/// 2; the probe is answered and the evictions take silent ones (it was evicted first, as
/// the oldest connection with nothing written, before its socket was looked at).
#[test]
fn a_probe_whose_request_arrived_is_not_evicted_for_a_churner_on_its_address() {
    let mut poll = mio::Poll::new().unwrap();
    let cfg = HttpConfig {
        max_per_peer: 2,
        ..HttpConfig::default()
    };
    let mut server = HttpServer::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    server.register(poll.registry()).unwrap();
    let addr = server.local_addr().unwrap();
    let mut probe = std::net::TcpStream::connect(addr).unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let silent: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    drive_until(&mut server, &mut poll, "the probe's answer", |st| {
        st.requests >= 1
    });
    // The probe was answered as room was sought, and closed (`Connection: close`): that
    // made room for the third; the fourth and fifth evicted the silent ones.
    assert_eq!(server.stats.evicted, 2, "{:?}", server.stats);
    let mut answer = String::new();
    probe.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(silent);
}

/// A server on `addr` with `cfg`, registered with a poll of its own.
fn serving(addr: &str, cfg: HttpConfig) -> (HttpServer, mio::Poll, SocketAddr) {
    let poll = mio::Poll::new().unwrap();
    let mut server = HttpServer::bind(addr.parse().unwrap(), cfg).unwrap();
    server.register(poll.registry()).unwrap();
    let at = server.local_addr().unwrap();
    (server, poll, at)
}

/// Whether the server closed `s` (its read answers end of stream; still open, it would
/// block). Reads what was sent before.
fn closed_by_server(s: &mut std::net::TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Sends a keep-alive request on `s` and reads its whole answer (`/healthz`'s is small).
fn served_once(s: &mut std::net::TcpStream) {
    s.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"ok\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

/// The eviction order: an idle keep-alive connection (answered, nothing sent since) goes
/// before a silent one, even a younger one before an older: it has had its answer, while
/// the silent one may be a request still on its way.
#[test]
fn an_idle_keep_alive_connection_is_evicted_before_an_older_silent_one() {
    let cfg = HttpConfig {
        max_connections: 2,
        ..HttpConfig::default()
    };
    let (mut server, mut poll, addr) = serving("127.0.0.1:0", cfg);
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    let mut kept_alive = std::net::TcpStream::connect(addr).unwrap();
    kept_alive
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let s0 = &mut server;
    std::thread::scope(|s| {
        let client = s.spawn(|| served_once(&mut kept_alive));
        drive_until(s0, &mut poll, "the answer", |st| {
            st.requests >= 1 && client.is_finished()
        });
        client.join().unwrap();
    });
    let _third = std::net::TcpStream::connect(addr).unwrap();
    drive_until(&mut server, &mut poll, "an eviction", |st| st.evicted >= 1);
    assert!(
        closed_by_server(&mut kept_alive),
        "the idle keep-alive one goes"
    );
    assert!(!closed_by_server(&mut silent), "the older silent one stays");
}

/// A connection with only part of a head is one that "never completed a head": the oldest
/// of those is evicted (its read finds nothing more), not a younger silent one.
#[test]
fn the_oldest_connection_with_a_partial_head_is_evicted_before_a_younger_silent_one() {
    let cfg = HttpConfig {
        max_connections: 2,
        ..HttpConfig::default()
    };
    let (mut server, mut poll, addr) = serving("127.0.0.1:0", cfg);
    let mut partial = std::net::TcpStream::connect(addr).unwrap();
    partial
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    let _third = std::net::TcpStream::connect(addr).unwrap();
    drive_until(&mut server, &mut poll, "an eviction", |st| st.evicted >= 1);
    assert!(closed_by_server(&mut partial), "the partial head goes");
    assert!(
        !closed_by_server(&mut silent),
        "the younger silent one stays"
    );
    assert_eq!(server.stats.requests, 0);
}

/// A connection answered while room is sought whose answer is still being written (its
/// client is not reading) is mid-response: never the victim, the next candidate is.
#[test]
fn a_connection_answered_mid_search_whose_answer_is_part_written_is_not_evicted() {
    let cfg = HttpConfig {
        max_connections: 2,
        ..HttpConfig::default()
    };
    let (mut server, mut poll, addr) = serving("127.0.0.1:0", cfg);
    let mut reader = std::net::TcpStream::connect(addr).unwrap();
    reader.write_all(b"GET /status HTTP/1.1\r\n\r\n").unwrap();
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    let _third = std::net::TcpStream::connect(addr).unwrap();
    drive_with(&mut server, &mut poll, &HUGE_STATUS, "an eviction", |st| {
        st.evicted >= 1
    });
    assert!(closed_by_server(&mut silent), "the silent one goes");
    assert_eq!(server.status().connections, 2);
    let mut head = [0u8; 12];
    reader.set_nonblocking(false).unwrap();
    reader.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "the part-written answer goes on");
}

/// At a peer's cap the victim is that peer's own: another peer's idle connection, older
/// and first in the eviction order, is not touched (the peers are `::1` and IPv4
/// loopback, mapped, on one dual-stack socket).
#[test]
fn at_a_peers_cap_only_that_peers_connections_are_candidates() {
    let cfg = HttpConfig {
        max_per_peer: 2,
        ..HttpConfig::default()
    };
    let (mut server, mut poll, addr) = serving("[::]:0", cfg);
    let port = addr.port();
    let mut other = std::net::TcpStream::connect(("::1", port)).unwrap();
    other
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let s0 = &mut server;
    std::thread::scope(|s| {
        let client = s.spawn(|| served_once(&mut other));
        drive_until(s0, &mut poll, "the other peer's answer", |st| {
            st.requests >= 1 && client.is_finished()
        });
        client.join().unwrap();
    });
    let mut first = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _second = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _third = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    drive_until(&mut server, &mut poll, "an eviction", |st| st.evicted >= 1);
    assert!(closed_by_server(&mut first), "the peer's oldest goes");
    assert!(
        !closed_by_server(&mut other),
        "another peer's idle one stays"
    );
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "more refused requests than requests")]
fn the_check_catches_counts_that_do_not_add_up() {
    let mut server =
        HttpServer::bind("127.0.0.1:0".parse().unwrap(), HttpConfig::default()).unwrap();
    server.stats.unauthorized = 1;
    server.check();
}
