"""The peer's agent turn against the same mock as `cargo bench --bench openai`.

Runs hermes-agent 0.19.0's `AIAgent.run_conversation` (the agent the peer's gateway runs for
a message) for S sessions x R rounds, one thread and one AIAgent per session (as the peer's
gateway does, in its executor), against the mock child of benches/openai.rs (started here
with the same flags). Prints one JSON line: CPU per turn of this process (the mock is
another process) and the latency from the mock's last byte to `run_conversation` returning.

    ~/hermes-venv/bin/python benches/peer/hermes_agent_turns.py \
        --mock target/release/deps/openai-<hash> --sessions 100 --rounds 3 [--token-rate 100]
"""
import argparse, json, os, resource, subprocess, sys, tempfile, threading, time

os.environ.setdefault("HERMES_HOME", tempfile.mkdtemp(prefix="hermes-bench-"))


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 1)) - 1))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mock", required=True)
    p.add_argument("--sessions", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--token-rate", type=int, default=0)
    a = p.parse_args()
    mock = subprocess.Popen(
        [a.mock, "--mock-child", "--tokens", str(a.tokens), "--token-rate", str(a.token_rate)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(mock.stdout.readline().split()[1])
    done = {}

    def read_mock():
        for line in mock.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "done":
                done[parts[1]] = int(parts[2])
    threading.Thread(target=read_mock, daemon=True).start()

    from run_agent import AIAgent
    agents = [AIAgent(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", model="bench",
                      quiet_mode=True, enabled_toolsets=[], skip_context_files=True,
                      skip_memory=True) for _ in range(a.sessions)]
    replies = {}
    failures = []
    barrier = threading.Barrier(a.sessions + 1)
    end = threading.Barrier(a.sessions + 1)

    def session(i):
        history = None
        for r in range(a.warmup + a.rounds):
            if r == a.warmup:
                barrier.wait()
            tag = f"s{i}r{r}"
            try:
                res = agents[i].run_conversation(tag, conversation_history=history)
            except Exception as e:  # counted, so a crash never hangs the barriers
                res = {"failed": True, "error": repr(e)}
            now = time.monotonic_ns()
            if not res.get("completed") or res.get("failed"):
                failures.append((tag, res.get("error") or res.get("final_response")))
            history = res.get("messages")
            if r >= a.warmup:
                replies[tag] = now
        end.wait()

    threads = [threading.Thread(target=session, args=(i,)) for i in range(a.sessions)]
    for t in threads:
        t.start()
    barrier.wait()
    t0, (c0, s0) = time.monotonic(), cpu_s()
    end.wait()
    seconds = time.monotonic() - t0
    c1, s1 = cpu_s()
    turns = a.sessions * a.rounds
    time.sleep(0.5)  # let the mock's last reports arrive (not part of any figure)
    lat = [(t - done[k]) / 1e6 for k, t in replies.items() if k in done]
    mock.stdin.close()
    mock.wait()
    print(json.dumps({
        "system": "hermes-agent 0.19.0 AIAgent.run_conversation",
        "sessions": a.sessions, "rounds": a.rounds, "tokens_per_reply": a.tokens,
        "token_rate": a.token_rate, "turns": turns, "failures": len(failures),
        "seconds": round(seconds, 3), "turns_per_s": round(turns / seconds, 1),
        "cpu_us_per_turn": round((c1 - c0) / turns * 1e6),
        "cpu_system_share": round((s1 - s0) / max(c1 - c0, 1e-9), 2),
        "added_latency_ms": {"n": len(lat), "p50": round(pct(lat, 0.5), 3),
                             "p99": round(pct(lat, 0.99), 3), "max": round(max(lat, default=0), 3)},
    }))
    if failures:
        print("failures:", failures[:3], file=sys.stderr)


if __name__ == "__main__":
    main()
