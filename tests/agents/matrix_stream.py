#!/usr/bin/env python3
"""A streaming process agent for the Matrix bridge tests (docs/agent-protocol.md).

`slow N MS`: N words, one partial every MS milliseconds (the pace of a model's tokens, slow
enough to `!stop` it), then the reply; a `cancel` ends it at once with an error.
`fence`: a partial inside an open code fence, then a Markdown reply with a fence longer than
one Matrix message.
`context`: the turn's session, chat type, user and meta as JSON.
Anything else: one partial, then the reply `echo: <text>` at once.
"""
import json, select, sys, time

def send(**line):
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()

pending = []

def read_line(timeout, queued=True):
    if queued and pending:
        return pending.pop(0)
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    if not ready:
        return None
    line = sys.stdin.readline()
    return line if line else "EOF"

while True:
    line = read_line(None)
    if line is None:
        continue
    if line == "EOF":
        break
    msg = json.loads(line)
    if msg["op"] == "close":
        break
    if msg["op"] != "turn":
        continue
    id, text = msg["id"], msg["text"]
    parts = text.split()
    if len(parts) == 3 and parts[0] == "slow":
        n, ms = int(parts[1]), int(parts[2])
        words, cancelled = [], False
        for i in range(n):
            words.append(f"w{i}")
            send(op="partial", id=id, text=" ".join(words))
            deadline = time.monotonic() + ms / 1000
            while not cancelled:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                got = read_line(left, queued=False)
                if got is None:
                    break
                if got == "EOF":
                    sys.exit(0)
                other = json.loads(got)
                if other.get("op") == "cancel" and other.get("id") == id:
                    cancelled = True
                else:
                    pending.append(got)
            if cancelled:
                break
        if cancelled:
            send(op="error", id=id, message="stopped")
        else:
            send(op="reply", id=id, text=" ".join(words))
    elif text == "fence":
        # A partial inside an unterminated fence, then a reply whose fence is longer than
        # one Matrix message, with raw HTML and a javascript: link to be escaped or dropped.
        send(op="partial", id=id, text="Intro:\n\n```rust\nlet x0")
        code = "".join("let x%d = %d;\n" % (n, n) for n in range(900))
        send(op="reply", id=id, text="Intro **bold** & <script>alert(1)</script> [site](https://e.org/?a=1&b=2) [bad](javascript:alert(1))\n\n```rust\n" + code + "```\n\n> quoted\n\n- one\n- two")
    elif text == "context":
        keys = ("session", "chat_type", "user_id", "user_name", "meta")
        send(op="reply", id=id, text=json.dumps({k: msg.get(k) for k in keys}, sort_keys=True))
    else:
        send(op="partial", id=id, text="echo:")
        send(op="reply", id=id, text=f"echo: {text}")
