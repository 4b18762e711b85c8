//! The endpoint's own tests (sockets on loopback, a poll of their own).

use super::*;

/// Serves every path as healthy and ready.
struct Healthy;

impl OpsSource for Healthy {
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn ready(&self) -> Result<(), String> {
        Ok(())
    }
    fn status_json(&self) -> Vec<u8> {
        b"{}".to_vec()
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
    let source = Healthy;
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
            server.on_ready(event, now, &source);
        }
        server.on_wake(now);
        server.serve(now, &source);
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

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "more refused requests than requests")]
fn the_check_catches_counts_that_do_not_add_up() {
    let mut server =
        HttpServer::bind("127.0.0.1:0".parse().unwrap(), HttpConfig::default()).unwrap();
    server.stats.unauthorized = 1;
    server.check();
}
