#!/usr/bin/env python3
"""Issue 22's benchmarks: several `turnstile serve --cluster` instances on one Redis.

    python3 benches/cluster_serve.py BIN throughput K [MESSAGES]   # K instances, one flood each
    python3 benches/cluster_serve.py BIN takeover RUNS [LEASE_MS]  # kill -9 the owner RUNS times
    python3 benches/cluster_serve.py BIN kill [SESSIONS] [PER_SESSION] # 3 instances, kill -9 one mid-load

Each run starts its own redis-server (`--appendonly yes --appendfsync always`, a private port
and directory under /dev/shm; `TURNSTILE_REDIS_SERVER` names the binary, default
`redis-server`) and its own instances (echo agent, 64 partitions).

`throughput`: K instances; one `turnstile loadgen --flood` per instance, all at once
(MESSAGES each, default 20,000, 20 connections x 100 in flight, 1,000 sessions shared by all),
started once rebalancing has shared the partitions out when K > 1 (`BENCH_NO_SPREAD=1`: at
once, while the first instance still holds them all and drains most of them under the load);
prints one JSON line: the aggregate acked-and-answered messages per second (all messages over
the wall time from the first flood's start to the last one's end), each flood's ack and
answer latency p50/p99, Redis's, the instances' and the load generators' CPU per message,
Redis's script calls and commands (those the scripts call included) per message, how many of
the cores were busy (every process, `/proc/stat`), the load average. `BENCH_COMMANDSTATS=1`:
Redis's per-command calls and µs; `BENCH_THREADS=1`: each instance's CPU per message by
thread; `BENCH_STATUS=1`: each instance's queues every second; `BENCH_PERF=DIR`: `perf record`
of Redis, each instance and each loadgen into DIR (`BENCH_PERF_GRAPH=dwarf,8192` for Redis,
which has no frame pointers).

`kill`: the closing note's terminal session. Three instances, the load started once
rebalancing has shared the partitions out (each holds at least 20 of 64; not waited for
when `BENCH_SERVE_ARGS` turns rebalancing off, so that the first holds all); on each, two bridge
connections (`hello` with `acks`, confirming every terminal line with `delivered`) send
SESSIONS x PER_SESSION messages (default 300 x 10; each session sticks to one connection and
sends its messages in order, up to 4 unanswered per session; echo agent taking 20 ms). When a
third of the messages are answered, the instance holding the most partitions is killed with
SIGKILL; its two connections reconnect to the survivors and send again every message not
acked (a real bridge does the same). Counts at the end, from what the bridges saw and from
Redis: acked, answered (distinct ids with a terminal line), lost (acked, never answered),
answered twice (marked `redelivery` or not), outcome-stream entries per message (more than
one: a second outcome written), out of order (a session's results on one connection not in
send order), and the takeover time (kill to every lease held by a survivor).

`takeover`: two instances; the one holding every partition is killed with SIGKILL and the
time until the survivor holds all 64 leases is measured (Redis polled every 5 ms with one
MGET); the killed one is started again (it gains nothing while the other holds everything:
nothing is free) and the roles swap. Prints one JSON line per kill and a summary: takeover
p50/p99/max against the lease.
"""
import collections, json, os, resource, shutil, signal, socket, subprocess, sys, tempfile, threading, time

PARTITIONS = 64


def cpu_s(pid):
    """User + system CPU seconds of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu():
    """(busy, total) jiffies of every core since boot (`/proc/stat`): idle and iowait are not busy."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def thread_cpu(pid):
    """CPU seconds of each thread of a live process, by thread name (summed per name)."""
    out = collections.Counter()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st.rsplit(")", 1)[1].split()
        out[name] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Redis:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ts-cluster-bench-", dir="/dev/shm")
        self.port = free_port()
        binary = os.environ.get("TURNSTILE_REDIS_SERVER", "redis-server")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.f = self.sock.makefile("rb")

    def command(self, *args):
        out = b"*%d\r\n" % len(args)
        for a in args:
            a = a.encode() if isinstance(a, str) else a
            out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return self.reply()

    def reply(self):
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)[:-2]
            return data.decode()
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise RuntimeError(rest.decode())
        return rest.decode()

    def holders(self):
        keys = ["ts:{p%d}:lease" % p for p in range(PARTITIONS)]
        return [None if v is None else v.rsplit(":", 1)[0] for v in self.command("MGET", *keys)]

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def instance(binary, redis, name, lease_ms, extra=()):
    if os.environ.get("BENCH_STATUS"):
        extra = (*extra, "--status-file", os.path.join(redis.dir, f"{name}.status.json"))
    p = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--http-listen", "off",
         "--cluster", f"redis://127.0.0.1:{redis.port}", "--instance-id", name,
         "--lease-ms", str(lease_ms), "--turn-workers", "8", *extra,
         *os.environ.get("BENCH_SERVE_ARGS", "").split()],
        stdout=subprocess.PIPE, stderr=open(os.environ.get("BENCH_SERVE_LOG", os.devnull), "ab"),
        env=dict(os.environ, RUST_LOG=os.environ.get("BENCH_RUST_LOG", "warn")))
    addr = p.stdout.readline().decode().split()[-1]
    return p, addr


def wait_all_held(redis, by=None, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = redis.holders()
        if all(x is not None for x in h) and (by is None or all(x == by for x in h)):
            return h
        time.sleep(0.005)
    raise RuntimeError(f"partitions not all held (by {by}): {redis.holders()}")


def wait_spread(redis, names, timeout=30.0):
    """Until every partition is held and each instance holds what the fair share leaves it
    (each wants ceil(N/k), so the least is N - (k-1) * ceil(N/k): 20 of 64 with three)."""
    share = -(-PARTITIONS // len(names))
    least = PARTITIONS - (len(names) - 1) * share
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = redis.holders()
        held = collections.Counter(h)
        if None not in held and all(held.get(n, 0) >= least for n in names):
            return held
        time.sleep(0.005)
    raise RuntimeError(f"partitions not spread over {names}: {collections.Counter(redis.holders())}")


def profile(targets):
    """`BENCH_PERF=DIR`: `perf record -g` of each (name, pid) into DIR/name.data while the
    floods run (`perf report -i DIR/i0.data --no-children` reads one)."""
    out = os.environ.get("BENCH_PERF")
    if not out:
        return []
    os.makedirs(out, exist_ok=True)
    graph = os.environ.get("BENCH_PERF_GRAPH", "fp")  # `dwarf,16384`: Redis has no frame pointers
    return [subprocess.Popen(["perf", "record", "-q", "-F", "499", "--call-graph", graph, "-p", str(pid),
                              "-o", os.path.join(out, f"{name}.data")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets]


def snapshots(d, k):
    """`BENCH_STATUS`: where each instance's messages are, every second of the run."""
    while True:
        time.sleep(1)
        for i in range(k):
            try:
                with open(os.path.join(d, f"i{i}.status.json")) as f:
                    st = json.load(f)
            except (OSError, ValueError):
                continue
            fe, c = st.get("frontend", {}), st.get("cluster") or st.get("frontend", {}).get("cluster") or {}
            j = fe.get("journal") or {}
            print(f"  i{i}: sessions {st['sessions']['total']} running {st['sessions']['running']} "
                  f"queued {st['sessions']['queued_messages']} held {st['turns']['held']} "
                  f"in_flight {st['turns']['in_flight']} journal queued {j.get('queued_records')} "
                  f"pending {j.get('pending_durable')} unjournaled {j.get('unjournaled_outcomes')} "
                  f"awaiting {fe.get('awaiting_delivery')} cluster "
                  + json.dumps({x: y for x, y in c.items() if isinstance(y, int) and y}), file=sys.stderr)


def command_calls(redis):
    """Calls of each command since Redis started (`INFO commandstats`), by command name."""
    calls = {}
    for line in redis.command("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, stats = line[len("cmdstat_"):].split(":", 1)
            calls[name] = int(stats.split("calls=")[1].split(",")[0])
    return calls


def throughput(binary, k, messages):
    redis = Redis()
    procs = []
    try:
        for i in range(k):
            procs.append(instance(binary, redis, f"i{i}", 3000))
            if i == 0:
                wait_all_held(redis)
        # The steady state of K instances: the floods start once rebalancing (the default)
        # has shared the partitions out, not while the first one still holds them all
        # (`BENCH_NO_SPREAD=1`: at once, as before 2026-12-05).
        if k > 1 and "false" not in os.environ.get("BENCH_SERVE_ARGS", "") \
                and not os.environ.get("BENCH_NO_SPREAD"):
            wait_spread(redis, [f"i{i}" for i in range(k)])
        # The loadgens' CPU: the children reaped while they ran (only the floods are).
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0 = machine_cpu()
        t0 = time.monotonic()
        floods = [subprocess.Popen(
            [binary, "loadgen", "--flood", "--addr", addr, "--messages", str(messages),
             "--sessions", "1000", "--connections", "20", "--window", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _, addr in procs]
        if os.environ.get("BENCH_STATUS"):
            threading.Thread(target=snapshots, args=(redis.dir, k), daemon=True).start()
        perfs = profile([("redis", redis.proc.pid)] + [(f"i{i}", p.pid) for i, (p, _) in enumerate(procs)]
                        + [(f"loadgen{i}", f.pid) for i, f in enumerate(floods)])
        outs = [f.communicate() for f in floods]
        for out, err in outs:
            if not out.strip():
                sys.exit(f"a flood failed: {err.decode(errors='replace')[-400:]!r}")
        reports = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outs]
        wall = time.monotonic() - t0
        for p in perfs:
            p.send_signal(signal.SIGINT)
            p.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy1 = machine_cpu()
        loadgens_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        total = messages * k
        calls = command_calls(redis)
        print(json.dumps({
            "instances": k, "messages": messages * k, "seconds": round(wall, 3),
            "msgs_per_s": round(messages * k / wall),
            "per_flood_msgs_per_s": [round(r["messages_per_s"]) for r in reports],
            "ack_ms_p50_p99": [[r["ack_latency_ms"]["p50"], r["ack_latency_ms"]["p99"]] for r in reports],
            "answer_ms_p50_p99": [[r["latency_ms"]["p50"], r["latency_ms"]["p99"]] for r in reports],
            "redis_cpu_us_per_msg": round(cpu_s(redis.proc.pid) * 1e6 / total, 1),
            "instances_cpu_us_per_msg": round(sum(cpu_s(p.pid) for p, _ in procs) * 1e6 / total, 1),
            # The load generators are on the same cores: their CPU is part of what they carry.
            "loadgens_cpu_us_per_msg": round(loadgens_cpu * 1e6 / total, 1),
            # Script calls, and Redis commands (those the scripts call included), per message.
            "redis_scripts_per_msg": round(calls.get("evalsha", 0) / total, 2),
            "redis_commands_per_msg": round(
                sum(n for c, n in calls.items() if c not in ("evalsha", "info")) / total, 2),
            # How busy the cores were (every process on the machine, the kernel's included):
            # below all of them, something other than CPU paced the run.
            "machine_busy_cores": round((busy1[0] - busy0[0]) / (busy1[1] - busy0[1]) * os.cpu_count(), 2),
            "load": os.getloadavg()[0],
        }), flush=True)
        if os.environ.get("BENCH_STATUS"):
            time.sleep(1.2)  # the status file is written every second
            for i in range(k):
                with open(os.path.join(redis.dir, f"i{i}.status.json")) as f:
                    st = json.load(f)
                j = st.get("frontend", {}).get("journal") or {}
                print(f"i{i} journal batches {j.get('batches')} (a batch per "
                      f"{round(wall * 1000 / max(1, j.get('batches') or 1), 2)} ms of the run)", file=sys.stderr)
        if os.environ.get("BENCH_THREADS"):
            for i, (p, _) in enumerate(procs):
                threads = thread_cpu(p.pid)
                print(f"i{i} threads, CPU us/msg: " + ", ".join(
                    f"{n} {round(c * 1e6 / total, 1)}" for n, c in threads.most_common(8)), file=sys.stderr)
        if os.environ.get("BENCH_COMMANDSTATS"):
            stats = redis.command("INFO", "commandstats")
            rows = [l for l in stats.splitlines() if l.startswith("cmdstat_")]
            rows.sort(key=lambda l: -int(l.split("usec=")[1].split(",")[0]))
            print("\n".join(r for r in rows if "failed_calls=0" not in r or rows.index(r) < 12), file=sys.stderr)
            print(redis.command("INFO", "errorstats"), file=sys.stderr)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
        redis.stop()


def takeover(binary, runs, lease_ms):
    redis = Redis()
    live = {}
    # Without rebalancing, so that one instance holds everything and each kill moves all 64.
    still = ("--cluster-rebalance", "false")
    try:
        live["a"] = instance(binary, redis, "a", lease_ms, still)
        wait_all_held(redis, by="a")
        live["b"] = instance(binary, redis, "b", lease_ms, still)
        owner, other, times = "a", "b", []
        for n in range(runs):
            time.sleep(lease_ms / 1000 / 3 * 2)  # the other has heartbeated and renewed
            p, _ = live.pop(owner)
            t0 = time.monotonic()
            p.send_signal(signal.SIGKILL)
            wait_all_held(redis, by=other, timeout=lease_ms / 1000 * 5 + 5)
            t = (time.monotonic() - t0) * 1000
            p.wait()
            times.append(t)
            print(json.dumps({"kill": n + 1, "takeover_ms": round(t), "lease_ms": lease_ms,
                              "load": os.getloadavg()[0]}), flush=True)
            name = f"{owner}{n + 1}"
            live[name] = instance(binary, redis, name, lease_ms, still)
            owner, other = other, name
        times.sort()
        pct = lambda q: round(times[min(len(times) - 1, int(q * len(times)))])
        print(json.dumps({"kills": runs, "lease_ms": lease_ms, "takeover_ms_p50": pct(0.5),
                          "takeover_ms_p99": pct(0.99), "takeover_ms_max": round(times[-1]),
                          "takeover_ms_min": round(times[0]), "over_lease_p99_ms":
                          pct(0.99) - lease_ms}), flush=True)
    finally:
        for p, _ in live.values():
            p.kill()
            p.wait()
        redis.stop()


class Bridge:
    """One bridge connection with `acks`: sends its sessions' messages in order, confirms
    every terminal line, records what it saw in the shared `seen`."""

    TERMINAL = {"reply", "cancelled", "failed", "merged"}

    def __init__(self, name, addr, sessions, per_session, seen, lock):
        self.name, self.sessions, self.per = name, sessions, per_session
        self.seen, self.lock = seen, lock
        self.acked, self.next = set(), {s: 0 for s in sessions}
        self.inflight = collections.defaultdict(set)
        # Writes come from this bridge's reader and from others' (a result of one of its
        # sessions can arrive on another connection after a takeover).
        self.wlock = threading.RLock()
        for s in sessions:
            seen["sender"][s] = self
        self.connect(addr)

    def connect(self, addr):
        with self.wlock:
            host, port = addr.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.f = self.sock.makefile("rb")
            self.sock.sendall(b'{"op":"hello","platform":"demo","acks":true}\n')
            # Every message not acked goes again (the window refills from the oldest).
            for s in self.sessions:
                self.inflight[s] = {i for i in self.inflight[s] if (s, i) in self.acked}
            self.fill()

    def send(self, s, i):
        line = json.dumps({"op": "message", "id": f"{s}-{i}", "chat_id": s, "text": f"{s}:{i}"})
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError:
            pass  # its instance died: sent again after the reconnect

    def answered(self, s, i):
        """A result of one of this bridge's sessions arrived (here or elsewhere)."""
        with self.wlock:
            self.inflight[s].discard(i)
            self.fill()

    def fill(self):
        with self.wlock:
            self._fill()

    def _fill(self):
        for s in self.sessions:
            # Unacked ones first, in order (after a reconnect), then new ones.
            for i in range(self.next[s]):
                if (s, i) not in self.acked and i not in self.inflight[s]:
                    self.inflight[s].add(i)
                    self.send(s, i)
            while len(self.inflight[s]) < 4 and self.next[s] < self.per:
                i = self.next[s]
                self.next[s] += 1
                self.inflight[s].add(i)
                self.send(s, i)

    def run(self, stop):
        while not stop.is_set():
            try:
                line = self.f.readline()
            except OSError:
                line = b""
            if not line:
                return "closed"
            m = json.loads(line)
            op, mid = m.get("op"), m.get("id")
            if op == "ack" and mid:
                s, i = mid.rsplit("-", 1)
                self.acked.add((s, int(i)))
                with self.lock:
                    self.seen["acked"].add(mid)
            elif op == "reject":
                s, i = mid.rsplit("-", 1)
                with self.lock:
                    self.seen["rejects"][m.get("reason")] += 1
                self.answered(s, int(i))
            elif op in self.TERMINAL:
                s, i = mid.rsplit("-", 1)
                with self.wlock:
                    self.sock.sendall(json.dumps({"op": "delivered", "ids": [mid]}).encode() + b"\n")
                with self.lock:
                    self.seen["results"][mid].append((self.name, op, m.get("text"),
                                                      bool(m.get("redelivery"))))
                    self.seen["order"][(self.name, s)].append(int(i))
                    done = len(self.seen["results"])
                self.seen["sender"][s].answered(s, int(i))
                if done >= self.seen["total"]:
                    stop.set()
        return "stopped"


def kill_demo(binary, sessions, per_session):
    redis = Redis()
    procs = {}
    seen = {"acked": set(), "results": collections.defaultdict(list),
            "order": collections.defaultdict(list), "rejects": collections.Counter(),
            "sender": {},
            "total": sessions * per_session}
    lock, stop = threading.Lock(), threading.Event()
    try:
        for name in ("i0", "i1", "i2"):
            procs[name] = instance(binary, redis, name, 3000, ["--echo-delay-ms", "20"])
            if name == "i0":
                wait_all_held(redis)
        if "false" not in os.environ.get("BENCH_SERVE_ARGS", ""):
            wait_spread(redis, list(procs))  # rebalancing (the default) shares them out
        names = [f"s{k}" for k in range(sessions)]
        bridges, threads = [], {}
        for n, (iname, (_, addr)) in enumerate(sorted(procs.items())):
            for c in range(2):
                k = n * 2 + c
                b = Bridge(f"{iname}/{c}", addr, names[k::6], per_session, seen, lock)
                bridges.append((iname, b))
        for iname, b in bridges:
            t = threading.Thread(target=b.run, args=(stop,), daemon=True)
            t.start()
            threads[b.name] = t
        # Mid-load: a third answered (acks run ahead of answers by each session's window).
        while len(seen["results"]) < seen["total"] // 3:
            time.sleep(0.01)
        held = collections.Counter(redis.holders())
        victim = max(procs, key=lambda n: held.get(n, 0))
        t0 = time.monotonic()
        procs[victim][0].send_signal(signal.SIGKILL)
        procs[victim][0].wait()
        acked_at_kill = len(seen["acked"])
        print(f"$ kill -9 {victim}  # held {held.get(victim, 0)} of {PARTITIONS} partitions; "
              f"{acked_at_kill} acked, {len(seen['results'])} answered so far", flush=True)
        survivors = [n for n in procs if n != victim]
        for k, (iname, b) in enumerate(bridges):
            if iname == victim:
                threads[b.name].join(timeout=10)
                b.connect(procs[survivors[k % 2]][1])
                t = threading.Thread(target=b.run, args=(stop,), daemon=True)
                t.start()
                threads[b.name] = t
        timeline, last = [], None
        while True:
            h = redis.holders()
            counts = collections.Counter("-" if x is None else x for x in h)
            if counts != last:
                timeline.append((round((time.monotonic() - t0) * 1000), dict(counts)))
                last = counts
            if not any(x == victim or x is None for x in h):
                break
            time.sleep(0.005)
        takeover = time.monotonic() - t0
        if os.environ.get("BENCH_TIMELINE"):
            for t, c in timeline:
                print(f"  +{t} ms: {c}", file=sys.stderr)
        print(f"takeover: every partition held by {'/'.join(survivors)} "
              f"{takeover * 1000:.0f} ms after the kill (lease 3000 ms)", flush=True)
        stop.wait(timeout=120)
        time.sleep(0.5)
        res = seen["results"]
        acked = seen["acked"]
        lost = sorted(m for m in acked if m not in res)
        twice = {m: r for m, r in res.items() if len(r) > 1}
        unmarked = [m for m, r in twice.items() if sum(1 for x in r if not x[3]) > 1]
        contradicting = [m for m, r in res.items() if len({(x[1], x[2]) for x in r}) > 1]
        wrong = [m for m, r in res.items()
                 if any(x[1] == "reply" and x[2] != m.replace("-", ":") for x in r)]
        ops = collections.Counter(r[0][1] for r in res.values())
        out_of_order = sum(1 for v in seen["order"].values()
                           if [i for i in v] != sorted(v) and len(set(v)) == len(v))
        per_seq = collections.Counter()
        for p in range(PARTITIONS):
            for e in redis.command("XRANGE", "ts:{p%d}:out" % p, "-", "+"):
                f = e[1]
                per_seq[(p, f[f.index("seq") + 1])] += 1
        second_outcomes = sum(1 for v in per_seq.values() if v > 1)
        print(json.dumps({
            "sent": seen["total"], "acked": len(acked), "answered": len(res),
            "lost": len(lost), "answered_twice": len(twice),
            "answered_twice_unmarked": len(unmarked), "contradicting": len(contradicting),
            "wrong_text": len(wrong), "terminal_ops": dict(ops), "outcome_entries": sum(per_seq.values()),
            "second_outcomes": second_outcomes, "out_of_order_sessions": out_of_order,
            "rejects": dict(seen["rejects"]), "takeover_ms": round(takeover * 1000),
            "load": os.getloadavg()[0]}), flush=True)
        if lost:
            print("lost:", lost[:20], file=sys.stderr)
    finally:
        stop.set()
        for p, _ in procs.values():
            p.kill()
            p.wait()
        redis.stop()


def main():
    binary, mode = sys.argv[1], sys.argv[2]
    if mode == "throughput":
        throughput(binary, int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 20000)
    elif mode == "kill":
        kill_demo(binary, int(sys.argv[3]) if len(sys.argv) > 3 else 300,
                  int(sys.argv[4]) if len(sys.argv) > 4 else 10)
    elif mode == "takeover":
        takeover(binary, int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 3000)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
