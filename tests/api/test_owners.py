"""Owner isolation over HTTP: another owner's id answers exactly what a missing id answers, at once.

The issue: bob's DELETE of alice's session took alice's lock before the owner check, so it
answered 409 (saying the session exists) and held alice's appends up for the lock timeout. Ids are
per owner now (``<id>~<owner>``), and the owner is checked before any lock or file is touched.
"""

from __future__ import annotations

import dataclasses
import threading

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.locks import FileLock
from served import wait_job
from store.support import GEOMETRY, MODEL, Rows

RAW = {"Content-Type": "application/octet-stream"}
GEOMETRY_JSON = dataclasses.asdict(GEOMETRY)
ROWS = Rows(3)

#: bob's calls on a session id, and what each sends
CALLS = [
    ("DELETE", "", {}),
    ("POST", "/truncate", {"json": {"n_records": 0}}),
    ("POST", "/append", {"content": ROWS.encode(tiers.FP8, ROWS.make(1)), "headers": RAW}),
    ("POST", "/fork", {"json": {"id": "copy"}}),
    ("POST", "/park", {}),
    ("POST", "/unpark", {}),
    ("POST", "/file/repair", {}),
    ("POST", "/file/migrate", {"json": {"tier": "f32"}}),
    ("PATCH", "", {"json": {"tags": ["x"]}}),
    ("GET", "/verify", {}),
    ("GET", "/resume", {}),
    ("GET", "", {}),
]


def test_another_owners_id_answers_like_a_missing_one_without_waiting_for_its_lock(server, alice, bob):
    assert alice.post("/sessions", json={"id": "chat", "model": MODEL, "geometry": GEOMETRY_JSON}).status_code == 201
    assert alice.post("/sessions/chat/append", content=ROWS.encode(tiers.FP8, ROWS.make(3)), headers=RAW).is_success
    before = alice.get("/sessions/chat").json()
    locks = server.data / "locks"
    # alice is mid-append: her session's write lock is held (the server waits up to 10 s for it)
    with FileLock(locks / "chat~alice.write", timeout=0):
        files = sorted(p.name for p in locks.iterdir())
        for method, suffix, kwargs in CALLS:
            # A call that took alice's lock first could only answer 409 JournalLocked (after the lock
            # timeout): the lock stays held throughout, so a 404 means no lock was waited for.
            hidden = bob.request(method, f"/sessions/chat{suffix}", **kwargs)
            missing = bob.request(method, f"/sessions/nobody-has-this{suffix}", **kwargs)
            assert (hidden.status_code, hidden.json()["error"]) == (404, "SessionNotFound"), (method, suffix)
            assert hidden.json()["reason"].replace("chat", "X") == missing.json()["reason"].replace(
                "nobody-has-this", "X"
            )
            assert hidden.headers.keys() - {"date"} == missing.headers.keys() - {"date"}
        assert sorted(p.name for p in locks.iterdir()) == files  # bob's calls created no lock file
    # bob hammering alice's id never delays her appends
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            bob.delete("/sessions/chat")

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for _ in range(10):
            answer = alice.post("/sessions/chat/append", content=ROWS.encode(tiers.FP8, ROWS.make(1)), headers=RAW)
            assert answer.status_code == 200, answer.text
    finally:
        stop.set()
        thread.join()
    after = alice.get("/sessions/chat").json()
    assert after["n_records"] == before["n_records"] + 10 and after["tags"] == before["tags"] == []
    assert alice.get("/sessions/chat/verify").json()["ok"] is True


def test_two_owners_use_the_same_ids_and_never_meet(server, alice, bob):
    # Ids are per owner: a create or fork never tells one owner that another holds the id, and every
    # call of each owner reaches their own session only.
    body = {"id": "chat-1", "model": MODEL, "geometry": GEOMETRY_JSON}
    assert alice.post("/sessions", json=body).status_code == 201
    assert bob.post("/sessions", json=body).status_code == 201  # alice's chat-1 does not stand in his way
    again = alice.post("/sessions", json=body)
    assert (again.status_code, again.json()["reason"]) == (409, "session 'chat-1' already exists")  # her own
    rows = Rows(7)
    tokens = rows.rng.integers(0, 1000, 70)
    theirs = {"alice": rows.make(70, tokens), "bob": rows.make(66, tokens[:66])}  # one prompt, other rows
    clients = {"alice": alice, "bob": bob}
    for owner, client in clients.items():
        answer = client.post("/sessions/chat-1/append", content=ROWS.encode(tiers.FP8, theirs[owner]), headers=RAW)
        assert answer.json()["session"]["owner"] == owner
    assert sorted(p.name for p in (server.data / "journals").glob("*.coli_kv")) == [
        "chat-1~alice.coli_kv",
        "chat-1~bob.coli_kv",
    ]
    query = {"model": MODEL, "geometry": GEOMETRY_JSON, "tokens": tokens.tolist()}
    for owner, client in clients.items():
        match = client.post("/lookup", json=query).json()["match"]
        assert (match["session_id"], match["n_records"]) == ("chat-1", len(theirs[owner][0])), owner
        served = client.get("/sessions/chat-1/resume", params={"format": "coli_kv"})
        assert served.headers["content-disposition"] == 'attachment; filename="chat-1.coli_kv"'
        assert served.content[coli_kv.HEADER_BYTES :] == ROWS.encode(tiers.FP8, theirs[owner])
        fork = client.post("/sessions/chat-1/fork", json={"id": "branch", "at": 64})
        assert (fork.status_code, fork.json()["owner"], fork.json()["parent"]) == (201, owner, "chat-1")
        assert client.post("/sessions/chat-1/fork", json={"id": "chat-1"}).status_code == 409  # their own id
    wait_job(alice, alice.post("/sessions/chat-1/park").json(), expect="done")
    assert (alice.get("/sessions/chat-1").json()["state"], bob.get("/sessions/chat-1").json()["state"]) == (
        "parked",
        "active",
    )
    wait_job(alice, alice.post("/sessions/chat-1/unpark").json(), expect="done")
    assert bob.delete("/sessions/chat-1").status_code == 204
    assert bob.get("/sessions/chat-1").status_code == 404
    kept = alice.get("/sessions/chat-1").json()
    assert (kept["state"], kept["n_records"]) == ("active", 70) and alice.get("/sessions/chat-1/verify").json()["ok"]
    for owner, client in clients.items():
        listed = client.get("/sessions").json()["sessions"]
        assert {(s["id"], s["owner"]) for s in listed} == (
            {("chat-1", "alice"), ("branch", "alice")} if owner == "alice" else {("branch", "bob")}
        )
