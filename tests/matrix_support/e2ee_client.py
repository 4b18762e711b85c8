#!/usr/bin/env python3
"""An independent encrypting Matrix client for the bridge's end-to-end tests: matrix-nio with
its E2E support (the `vodozemac` Python bindings), driven by JSON lines.

    e2ee_client.py BASE USER_ID (--token TOKEN | --password PW) STORE_DIR

stdin, one JSON object a line:
  {"op": "create", "invite": [mxid, ...], "plain": bool}   a private room, encrypted unless
                                            "plain" -> {"ev": "created", "room"}
  {"op": "encrypt", "room"}                 turns encryption on in a plain room -> {"ev": "encrypting"}
  {"op": "say", "room", "text"}             an encrypted message (keys shared first) -> {"ev": "sent", "event_id"}
  {"op": "say_late", "room", "text"}        encrypted with a new session whose key is held back -> "sent"
  {"op": "release"}                         sends the held keys -> {"ev": "released"}
stdout, one JSON object a line: {"ev": "ready", "device", "ed25519"}, and every room event the
client syncs: {"ev": "event", "room", "event_id", "sender", "type", "class", "decrypted",
"content"} (the decrypted content when it decrypted; nio copies a cleartext `m.relates_to` into
it), and for a decrypted event also "wire" (the `m.room.encrypted` content as the server
relayed it, ciphertext left out) and "payload" (the plaintext exactly as the sender encrypted
it, decrypted again here with the same room key), {"ev": "joined", "room", "user"} for joins, and
{"ev": "key_request", "sender", "content"} for each `m.room_key_request` it receives.
"""
import asyncio, json, sys, uuid

from nio import AsyncClient, AsyncClientConfig, RoomSendResponse, MegolmEvent, RoomMemberEvent
from nio.api import Api
import nio.crypto

def out(**line):
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()

async def main():
    if not nio.crypto.ENCRYPTION_ENABLED:
        sys.exit("matrix-nio has no E2E support here (install matrix-nio[e2e])")
    base, user, mode, secret, store = sys.argv[1:6]
    client = AsyncClient(base, user, store_path=store,
                         config=AsyncClientConfig(encryption_enabled=True, store_sync_tokens=True))
    if mode == "--token":
        client.access_token = secret
        who = await client.whoami()
        client.restore_login(user, who.device_id, secret)
    else:
        resp = await client.login(secret, device_name="second")
        if not hasattr(resp, "device_id"):
            sys.exit(f"login failed: {resp}")
    held = []
    # What each decrypted event was on the wire and inside the ciphertext (nio keeps neither).
    seen_encrypted = {}
    real_decrypt = client.olm.decrypt_megolm_event

    def spy_decrypt(event, room_id=None):
        session = client.olm.inbound_group_store.get(room_id or event.room_id,
                                                     event.sender_key, event.session_id)
        if session is not None:
            try:
                plaintext, _ = session.decrypt(event.ciphertext)
                wire = {k: v for k, v in event.source.get("content", {}).items() if k != "ciphertext"}
                seen_encrypted[event.event_id] = (wire, json.loads(plaintext))
            except Exception:
                pass  # nio's own decryption below reports the failure
        return real_decrypt(event, room_id)

    client.olm.decrypt_megolm_event = spy_decrypt

    async def maintain():
        if client.should_upload_keys:
            await client.keys_upload()
        if client.should_query_keys:
            await client.keys_query()
        if client.should_claim_keys:
            await client.keys_claim(client.get_users_for_key_claiming())
        await client.send_to_device_messages()

    async def sync_loop():
        while True:
            resp = await client.sync(timeout=2000)
            if not hasattr(resp, "rooms"):
                await asyncio.sleep(0.5)  # a failed sync: pace the retries
                continue
            for room_id, info in resp.rooms.join.items():
                for ev in info.timeline.events:
                    report(room_id, ev)
            for ev in resp.to_device_events:
                src = getattr(ev, "source", {}) or {}
                if src.get("type") == "m.room_key_request":
                    out(ev="key_request", sender=ev.sender, content=src.get("content", {}))
            await maintain()

    def report(room_id, ev):
        if isinstance(ev, RoomMemberEvent):
            if ev.membership == "join":
                out(ev="joined", room=room_id, user=ev.state_key)
            return
        content = ev.source.get("content", {})
        decrypted = bool(getattr(ev, "decrypted", False)) and not isinstance(ev, MegolmEvent)
        line = dict(ev="event", room=room_id, event_id=ev.event_id, sender=ev.sender,
                    type=ev.source.get("type"), cls=type(ev).__name__,
                    decrypted=decrypted, content=content)
        if decrypted and ev.event_id in seen_encrypted:
            line["wire"], line["payload"] = seen_encrypted.pop(ev.event_id)
        out(**line)

    async def ready_room(room_id):
        room = client.rooms[room_id]
        if not room.members_synced:
            await client.joined_members(room_id)
        if client.should_query_keys:
            await client.keys_query()

    async def handle(cmd):
        op = cmd["op"]
        if op == "create":
            state = [] if cmd.get("plain") else [{"type": "m.room.encryption", "state_key": "",
                                                   "content": {"algorithm": "m.megolm.v1.aes-sha2"}}]
            resp = await client.room_create(
                invite=cmd["invite"], is_direct=len(cmd["invite"]) == 1, initial_state=state)
            out(ev="created", room=resp.room_id)
        elif op == "encrypt":
            resp = await client.room_put_state(cmd["room"], "m.room.encryption",
                                               {"algorithm": "m.megolm.v1.aes-sha2"})
            out(ev="encrypting", event_id=getattr(resp, "event_id", None))
        elif op == "say":
            room_id = cmd["room"]
            await ready_room(room_id)
            resp = await client.room_send(room_id, "m.room.message",
                                          {"msgtype": "m.text", "body": cmd["text"]},
                                          ignore_unverified_devices=True)
            out(ev="sent", event_id=getattr(resp, "event_id", None), error=str(resp) if not hasattr(resp, "event_id") else None)
        elif op == "say_late":
            room_id = cmd["room"]
            await ready_room(room_id)
            missing = client.get_missing_sessions(room_id)
            if missing:
                await client.keys_claim(missing)
            room = client.rooms[room_id]
            for sharing_with, to_device in client.olm.share_group_session_parallel(
                    room_id, list(room.users.keys()), ignore_unverified_devices=True):
                held.append(to_device)
                client.olm.outbound_group_sessions[room_id].users_shared_with.update(sharing_with)
            client.olm.outbound_group_sessions[room_id].shared = True
            content = client.olm.group_encrypt(room_id, {"type": "m.room.message",
                                                          "content": {"msgtype": "m.text", "body": cmd["text"]}})
            method, path, data = Api.room_send(client.access_token, room_id, "m.room.encrypted", content, uuid.uuid4())
            resp = await client._send(RoomSendResponse, method, path, data, (room_id,))
            # The next plain `say` must not reuse this session (its key is held back).
            client.olm.outbound_group_sessions.pop(room_id, None)
            out(ev="sent", event_id=getattr(resp, "event_id", None))
        elif op == "release":
            for to_device in held:
                method, path, data = Api.to_device(client.access_token, "m.room.encrypted", to_device, uuid.uuid4())
                await client.send(method, path, data, headers={"Content-Type": "application/json"})
            held.clear()
            out(ev="released")

    await client.sync(timeout=0, full_state=True)
    await maintain()
    out(ev="ready", device=client.device_id, ed25519=client.olm.account.identity_keys["ed25519"])
    syncing = asyncio.ensure_future(sync_loop())
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        await handle(json.loads(line))
    syncing.cancel()
    await client.close()

asyncio.run(main())
