#!/usr/bin/env python3
"""Issue 18 row 1: a quiet bridge's ping round trip while N connections flood `turnstile serve`.

    python3 benches/fair_ping.py target/release/turnstile N [seconds]
    python3 benches/fair_ping.py target/release/turnstile loadgen [seconds]

N flooder processes (nice 19) each write endless `delivered` lines (no answer) in 2 KiB
pieces, or (`loadgen`) `nice -n 19 turnstile loadgen --flood` with its default bounds runs
against the server; one quiet client pings every 20 ms and times each pong. Prints one JSON
line: ping p50/p99/max (ms), pongs, the load average, and the server's own loop lag and
service delays from its status file, taken in the same run.
"""
import json, os, socket, subprocess, sys, time, multiprocessing

def flooder(addr):
    os.nice(19)
    s = socket.create_connection(addr)
    chunk = b'{"op":"delivered","ids":[]}\n' * (2048 // 28)
    try:
        while True:
            s.sendall(chunk)
    except OSError:
        pass

def main():
    binary, mode = sys.argv[1], sys.argv[2]
    n = 0 if mode == "loadgen" else int(mode)
    secs = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    status = f"/dev/shm/fair-{os.getpid()}.json"
    srv = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--http-listen", "off",
                            "--status-file", status], stdout=subprocess.PIPE,
                           env=dict(os.environ, RUST_LOG="warn"))
    host, port = srv.stdout.readline().decode().split()[-1].rsplit(":", 1)
    addr = (host, int(port))
    procs = [multiprocessing.Process(target=flooder, args=(addr,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    gen = None
    if mode == "loadgen":
        gen = subprocess.Popen(["nice", "-n", "19", binary, "loadgen", "--flood", "--addr",
                                f"{host}:{port}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    q = socket.create_connection(addr)
    q.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = q.makefile("rb")
    rtts = []
    end = time.monotonic() + secs
    while time.monotonic() < end:
        t = time.monotonic()
        q.sendall(b'{"op":"ping"}\n')
        line = f.readline()
        assert b"pong" in line, line
        rtts.append((time.monotonic() - t) * 1000)
        time.sleep(0.02)
    load = os.getloadavg()
    time.sleep(0.3)
    st = json.load(open(status))
    for p in procs:
        p.kill()
    if gen:
        gen.kill()
    srv.kill()
    rtts.sort()
    q_ = lambda x: rtts[min(len(rtts) - 1, int(x * len(rtts)))]
    svc = (st.get("frontend") or {}).get("service")
    print(json.dumps({"flooders": mode, "pongs": len(rtts), "ping_ms": {"p50": round(q_(0.5), 3),
          "p99": round(q_(0.99), 3), "max": round(rtts[-1], 3)}, "loadavg_1m": load[0],
          "loop_lag_ms": st["loop_lag_ms"], "loop_lag_window_ms": st.get("loop_lag_window_ms"), "service": svc and {k: svc[k] for k in
          ("read_delay_ms", "write_delay_ms", "read_delay_recent_ms")}}))

if __name__ == "__main__":
    main()
