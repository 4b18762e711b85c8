#!/usr/bin/env python3
"""Issue 21 rows 3 and 4, and the reactor's CPU per message: one run of `turnstile loadgen`
against a fresh `turnstile serve`, with the server's CPU per thread read from /proc at the end.

    python3 benches/parse_cpu.py BIN flood  [--data-dir]   # 2 x 10^5, 20 connections x 1,000
    python3 benches/parse_cpu.py BIN rounds [--data-dir]   # 1000 sessions x 5 rounds, W=64, D=20

The server and load generator are the BENCHMARKS.md "Durability: over TCP" commands (plus
`--listen`, `--status-file`, `--http-listen off`, a fresh data dir under /tmp). Prints one JSON
line: the load generator's report (messages or turns per second, ack and reply latency), the
server's CPU-seconds (whole process, reactor thread, journal thread), the reactor's and the
process's microseconds per message, and the load average before and after.
"""
import json, os, shutil, subprocess, sys, tempfile

def thread_cpu(pid):
    """CPU-seconds per thread name of `pid` (utime + stime)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        secs = (int(fields[11]) + int(fields[12])) / tick
        out[name] = round(out.get(name, 0.0) + secs, 3)
    return out

def main():
    binary, mode = sys.argv[1], sys.argv[2]
    durable = "--data-dir" in sys.argv[3:]
    tmp = tempfile.mkdtemp(prefix="p21-", dir="/tmp")
    status = os.path.join(tmp, "status.json")
    if mode == "flood":
        serve = ["--outbox-cap", "200000", "--outbox-bytes", "2147483648", "--max-reply-bytes", "1024"]
        gen = ["nice", "-n", "19", binary, "loadgen", "--flood", "--messages", "200000",
               "--sessions", "20000", "--connections", "20", "--window", "1000"]
        count = 200000
    else:
        serve = ["--turn-workers", "64", "--echo-delay-ms", "20", "--max-reply-bytes", "1024"]
        gen = [binary, "loadgen", "--sessions", "1000", "--rounds", "5", "--connections", "4",
               "--workers", "64", "--delay-ms", "20"]
        count = 5000
    if durable:
        serve += ["--data-dir", os.path.join(tmp, "data")]
    srv = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--http-listen", "off",
                            "--status-file", status] + serve, stdout=subprocess.PIPE,
                           env=dict(os.environ, RUST_LOG="warn"))
    addr = srv.stdout.readline().decode().split()[-1]
    load0 = os.getloadavg()[0]
    out = subprocess.run(gen + ["--addr", addr, "--status-file", status, "--server-pid",
                                str(srv.pid)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, check=True).stdout
    load1 = os.getloadavg()[0]
    cpu = thread_cpu(srv.pid)
    srv.kill()
    srv.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    report = json.loads(out)
    total = sum(cpu.values())
    reactor = cpu.get("turnstile-react", 0.0)
    print(json.dumps({"mode": mode, "durable": durable, "report": report,
                      "cpu_s": {"total": round(total, 3), "reactor": reactor,
                                "journal": cpu.get("turnstile-journ", 0.0)},
                      "us_per_msg": {"total": round(total / count * 1e6, 2),
                                     "reactor": round(reactor / count * 1e6, 2)},
                      "load": [load0, load1]}))

if __name__ == "__main__":
    main()
