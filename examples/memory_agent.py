#!/usr/bin/env python3
"""A turnstile process agent (docs/agent-protocol.md) that remembers its session.

turnstile serve --agent process --agent-cmd 'python3 examples/memory_agent.py'
"""
import json, sys

def send(**line):
    print(json.dumps(line), flush=True)

memory = []  # this session's messages: the process lives as long as the session's agent
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "turn":
        memory.append(msg["text"])
        reply = f"you said {msg['text']!r}; so far: {' / '.join(memory)}"
        send(op="partial", id=msg["id"], text=reply[: len(reply) // 2])  # streamed, optional
        send(op="reply", id=msg["id"], text=reply)
    elif msg["op"] == "close":
        break  # save `memory` here if it should outlive the process
    # "cancel": turns here are instant, so there is never anything to stop
