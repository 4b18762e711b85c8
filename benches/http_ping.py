#!/usr/bin/env python3
"""Issue 18 row 4: a bridge's ping round trip while N connections pipeline `/metrics` and
`/status` to the HTTP endpoint (`hammer`), or, as a control, while N processes burn the same
CPU without HTTP (`burn`), or with nothing else running (`none`).

    python3 benches/http_ping.py target/release/turnstile N hammer|burn|none [seconds]

Started from last round's measurement script (/work/measure/row4.py). The N processes run at
the default nice level, as a hostile local client would. One quiet client pings every 20 ms
and times each pong. Prints one JSON line: ping p50/p99/max (ms), pongs, the load average,
HTTP requests answered and bodies rendered (from `/status` after the run), the server's loop
lag and read delay, and the reactor thread's CPU share over the run (from /proc).
"""
import json, os, socket, subprocess, sys, time, multiprocessing

def burn(addr, stop):
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1

def hammer(addr, stop):
    req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /status HTTP/1.1\r\nHost: x\r\n\r\n" * 8
    while not stop.is_set():
        try:
            s = socket.create_connection(addr)
            s.settimeout(2)
            while not stop.is_set():
                s.sendall(req)
                s.recv(1 << 20)
        except OSError:
            pass

def reactor_ticks(pid):
    """utime + stime (clock ticks) of the thread named turnstile-reac*."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        if name.startswith("turnstile-reac"):
            fields = st[st.rindex(")") + 2:].split()
            return int(fields[11]) + int(fields[12])
    return None

def get(addr, path):
    s = socket.create_connection(addr)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while True:
        b = s.recv(1 << 16)
        if not b:
            break
        data += b
    return data.split(b"\r\n\r\n", 1)[1]

def main():
    binary, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    secs = float(sys.argv[4]) if len(sys.argv) > 4 else 5.0
    target = {"burn": burn, "hammer": hammer, "none": None}[mode]
    srv = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, RUST_LOG="warn"))
    host, port = srv.stdout.readline().decode().split()[-1].rsplit(":", 1)
    http = None
    for tok in srv.stdout.readline().decode().split():
        if tok.count(":") == 1 and tok[0].isdigit():
            http = tok
    hh, hp = http.rsplit(":", 1)
    haddr = (hh, int(hp))
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=target, args=(haddr, stop), daemon=True)
             for _ in range(n if target else 0)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    q = socket.create_connection((host, int(port)))
    q.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = q.makefile("rb")
    rtts = []
    t0, c0 = time.monotonic(), reactor_ticks(srv.pid)
    end = t0 + secs
    while time.monotonic() < end:
        t = time.monotonic()
        q.sendall(b'{"op":"ping"}\n')
        assert b"pong" in f.readline()
        rtts.append((time.monotonic() - t) * 1000)
        time.sleep(0.02)
    t1, c1 = time.monotonic(), reactor_ticks(srv.pid)
    load = os.getloadavg()[0]
    stop.set()
    for p in procs:
        p.kill()
    time.sleep(0.3)
    st = json.loads(get(haddr, "/status"))
    srv.kill()
    rtts.sort()
    qq = lambda x: rtts[min(len(rtts) - 1, int(x * len(rtts)))]
    fe = st.get("frontend") or {}
    h = fe.get("http") or {}
    svc = fe.get("service") or {}
    cpu = (c1 - c0) / os.sysconf("SC_CLK_TCK") / (t1 - t0) if c0 is not None and c1 is not None else None
    print(json.dumps({"mode": mode, "procs": n, "pongs": len(rtts), "p50": round(qq(.5), 2),
                      "p99": round(qq(.99), 2), "max": round(rtts[-1], 2), "load": round(load, 1),
                      "reactor_cpu": cpu and round(cpu, 2),
                      "http_requests": h.get("requests"), "renders": h.get("renders"),
                      "budget_spent": h.get("budget_spent"),
                      "loop_lag_p99": st["loop_lag_ms"]["p99"],
                      "read_delay_p99": (svc.get("read_delay_ms") or {}).get("p99")}))

if __name__ == "__main__":
    main()
