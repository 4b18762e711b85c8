#!/usr/bin/env python3
"""A bridge with delivery acknowledgements that keeps a ledger, to watch `--data-dir` at work.

    ledger_bridge.py ADDR LEDGER send N SESSIONS   # send N messages over SESSIONS chats
    ledger_bridge.py ADDR LEDGER resume            # reconnect, resend what got no answer,
                                                   # wait for every outcome, account for all

It says hello with "acks": true, confirms every terminal event with `delivered`, and records
in LEDGER (JSON) which ids were sent, acknowledged, refused and answered (each outcome it
received, and whether it was marked a redelivery). `send` stops when the gateway goes away
(kill -9 it); `resume` prints the accounting: every acknowledged message must have exactly
one outcome.
"""

import json
import os
import socket
import sys

TERMINAL = {"reply", "failed", "cancelled", "merged"}


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"sent": {}, "acked": [], "rejected": {}, "outcomes": {}}


def save(path, ledger):
    with open(path + ".tmp", "w") as f:
        json.dump(ledger, f)
    os.replace(path + ".tmp", path)


def connect(addr):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b'{"op":"hello","platform":"demo","acks":true}\n')
    return s


def pump(sock, ledger, done):
    """Reads lines into the ledger until `done(ledger)` or the connection ends."""
    acked = set(ledger["acked"])
    buf = b""
    while not done(ledger, acked):
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, OSError):
            chunk = b""
        if not chunk:
            ledger["acked"] = sorted(acked)
            return False
        buf += chunk
        *lines, buf = buf.split(b"\n")
        confirm = []
        for line in lines:
            v = json.loads(line)
            op, mid = v.get("op"), v.get("id")
            if op == "ack":
                acked.add(mid)
            elif op == "reject":
                ledger["rejected"][mid] = v.get("reason")
            elif op in TERMINAL:
                redelivery = v.pop("redelivery", False)
                ledger["outcomes"].setdefault(mid, []).append([json.dumps(v, sort_keys=True), redelivery])
                confirm.append(mid)
        if confirm:
            try:
                sock.sendall((json.dumps({"op": "delivered", "ids": confirm}) + "\n").encode())
            except OSError:
                pass
        ledger["acked"] = sorted(acked)
    return True


def message(mid, chat):
    return (json.dumps({"op": "message", "id": mid, "chat_id": chat, "text": mid}) + "\n").encode()


def main():
    addr, path, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
    ledger = load(path)
    sock = connect(addr)
    if cmd == "send":
        n, sessions = int(sys.argv[4]), int(sys.argv[5])
        out = b""
        for i in range(n):
            mid = f"m{i}"
            ledger["sent"][mid] = f"c{i % sessions}"
            out += message(mid, f"c{i % sessions}")
        try:
            sock.sendall(out)
        except OSError:
            pass
        pump(sock, ledger, lambda l, a: all(m in l["outcomes"] for m in l["sent"]))
        save(path, ledger)
        print(f"send: {len(ledger['sent'])} sent, {len(ledger['acked'])} acked, "
              f"{len(ledger['outcomes'])} outcomes received, {len(ledger['rejected'])} refused")
        return
    acked = set(ledger["acked"])
    unanswered = [m for m in ledger["sent"] if m not in acked and m not in ledger["rejected"]]
    acked_before = len(acked)
    sock.sendall(b"".join(message(m, ledger["sent"][m]) for m in unanswered))
    pump(sock, ledger, lambda l, a: all(m in a or m in l["rejected"] for m in l["sent"])
         and all(m in l["outcomes"] for m in a))
    save(path, ledger)
    acked = set(ledger["acked"])
    kinds, lost, twice, redelivered = {}, [], [], 0
    for m in acked:
        got = ledger["outcomes"].get(m, [])
        if not got:
            lost.append(m)
            continue
        if len({line for line, _ in got}) > 1:
            twice.append(m)
        redelivered += len(got) - 1
        v = json.loads(got[0][0])
        kind = v["op"] if v["op"] != "failed" else "failed: " + v["error"]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"resume: resent {len(unanswered)} unanswered; {len(ledger['sent'])} sent, "
          f"{acked_before} acked before the restart, {len(acked)} acked in all, "
          f"{len(ledger['rejected'])} refused")
    print("outcomes: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    print(f"lost: {len(lost)}; with two different outcomes: {len(twice)}; "
          f"copies marked redelivery (dropped as already handled): {redelivered}")
    sys.exit(1 if lost or twice else 0)


if __name__ == "__main__":
    main()
