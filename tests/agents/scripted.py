#!/usr/bin/env python3
"""A process agent for the tests (docs/agent-protocol.md): each turn's text says what to do."""
import json, os, signal, subprocess, sys, time

if os.environ.get("SCRIPTED_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

def send(**line):
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


memory = []
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "close":
        if os.environ.get("SCRIPTED_IGNORE_CLOSE"):
            continue
        break
    if msg["op"] != "turn":
        continue
    id, text = msg["id"], msg["text"]
    cmd, _, arg = text.partition(" ")
    if cmd == "remember":
        memory.append(arg)
        send(op="reply", id=id, text=" | ".join(memory))
    elif cmd == "pid":
        send(op="reply", id=id, text=str(os.getpid()))
    elif cmd == "env":
        send(op="reply", id=id, text="\n".join(f"{k}={v}" for k, v in sorted(os.environ.items())))
    elif cmd == "context":
        keys = ("session", "user_id", "user_name", "meta", "chat_type", "platform", "chat_id")
        send(op="reply", id=id, text=json.dumps({k: msg.get(k) for k in keys}, sort_keys=True))
    elif cmd == "reply-then-exit":
        send(op="reply", id=id, text="bye")
        sys.exit(0)
    elif cmd == "crash":
        sys.exit(int(arg or 3))
    elif cmd == "garbage":
        print("this is not json", flush=True)
        time.sleep(300)
    elif cmd == "flood":
        sys.stdout.write("x" * int(arg))
        sys.stdout.flush()
        time.sleep(300)
    elif cmd == "stream":
        words = []
        for i in range(int(arg)):
            words.append(str(i))
            send(op="partial", id=id, text=" ".join(words))
            time.sleep(0.002)  # a token stream's pace; the test asserts no timing
        send(op="reply", id=id, text=" ".join(words))
    elif cmd == "fail":
        print("traceback with sk-SECRET123", file=sys.stderr, flush=True)
        send(op="error", id=id, message=arg)
    elif cmd == "unknown":
        send(op="thinking", id=id, text="hmm")
        send(op="partial", id="someone-else", text="stale partial")
        send(op="error", id="someone-else", message="stale error")
        send(op="reply", id="someone-else", text="stale")
        send(op="reply", id=id, text="ok")
    elif cmd == "partial":
        send(op="partial", id=id, text=arg)
        send(op="reply", id=id, text=arg)
    elif cmd == "size":
        send(op="reply", id=id, text=str(len(text)))
    elif cmd == "ignore-cancel":
        # Announce the turn has started (a FIFO the test reads), then never look at stdin.
        if arg:
            with open(arg, "w") as f:
                f.write("started\n")
        time.sleep(300)
    elif cmd == "honour-cancel":
        if arg:
            with open(arg, "w") as f:
                f.write("started\n")
        cancel = json.loads(sys.stdin.readline())
        send(op="error", id=cancel.get("id", id), message="stopped as asked")
    elif cmd == "detach":
        # A child in a session of its own, holding nothing of ours: it must still die with us.
        p = subprocess.Popen(["sleep", "300"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        send(op="reply", id=id, text=f"{os.getpid()} {p.pid}")
    elif cmd == "write-pid":
        with open(arg, "w") as f:
            f.write(f"{os.getpid()}\n")
        send(op="reply", id=id, text=str(os.getpid()))
    else:
        send(op="reply", id=id, text=text)

if os.environ.get("SCRIPTED_IGNORE_CLOSE"):
    time.sleep(300)  # ignores the end of stdin too: only signals end it
