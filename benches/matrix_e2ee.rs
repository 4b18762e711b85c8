//! What an encrypted Matrix message costs the bridge in CPU, with the primitives it uses
//! (`vodozemac`): sealing one reply (Megolm encrypt of a 1 KB event, base64), opening one
//! human message (base64, Megolm decrypt), and sharing a room key with one device (Olm
//! encrypt). One JSON line per figure. `cargo bench --bench matrix_e2ee [-- --n N]`.

use std::time::Instant;

use vodozemac::megolm::{GroupSession, InboundGroupSession, MegolmMessage, SessionConfig};
use vodozemac::olm::{Account, SessionConfig as OlmConfig};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn report(what: &str, n: u32, start: Instant) {
    let per = start.elapsed() / n;
    println!(
        "{{\"bench\": \"matrix_e2ee\", \"what\": \"{what}\", \"n\": {n}, \"us_per_op\": {:.1}}}",
        per.as_secs_f64() * 1e6
    );
}

fn main() {
    let n: u32 = arg("--n").and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let body = "x".repeat(1000);
    let plain = format!(
        r#"{{"type":"m.room.message","room_id":"!r:hs","content":{{"msgtype":"m.text","body":"{body}"}}}}"#
    );
    let mut out = GroupSession::new(SessionConfig::version_1());
    let mut inbound = InboundGroupSession::new(&out.session_key(), SessionConfig::version_1());

    let start = Instant::now();
    let mut sealed = Vec::with_capacity(n as usize);
    for _ in 0..n {
        sealed.push(out.encrypt(&plain).to_base64());
    }
    report("megolm encrypt 1 KB + base64", n, start);

    let start = Instant::now();
    for c in &sealed {
        let m = MegolmMessage::from_base64(c).expect("decodes");
        let p = inbound.decrypt(&m).expect("decrypts");
        assert_eq!(p.plaintext.len(), plain.len());
    }
    report("megolm base64 + decrypt 1 KB", n, start);

    let bot = Account::new();
    let mut human = Account::new();
    human.generate_one_time_keys(1);
    let otk = *human.one_time_keys().values().next().expect("a key");
    let mut olm = bot
        .create_outbound_session(OlmConfig::version_1(), human.curve25519_key(), otk)
        .expect("session");
    let key = out.session_key().to_base64();
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(olm.encrypt(&key).expect("encrypts"));
    }
    report("olm encrypt of a room key (one device)", n, start);
}
