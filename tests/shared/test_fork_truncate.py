"""Fork and truncate on replicas of the shared store: a fork copies segment rows in one transaction
(objects shared, immutable), a truncate is a fenced commit that drops rows; an object is deleted
only when no session lists it. Driven over HTTP through ``kvstore serve`` replicas (real
PostgreSQL, real S3), and compared with the embedded store answering the same requests."""

from __future__ import annotations

from typing import Any

import httpx

from served import ServeProcess
from shared.rows import rec_bytes, records
from shared.test_replicas import api_key, append, client, create, replicas, resume, shared_store  # noqa: F401  (fixtures)

RAW = "application/octet-stream"
VOLATILE = ("created", "updated", "last_used")  # times differ between any two runs


def turn(http: httpx.Client, session_id: str, body: bytes, complete: bool = True) -> list[int]:
    answer = http.post(
        f"/sessions/{session_id}/append",
        content=body,
        params={"complete_turn": str(complete).lower()},
        headers={"Content-Type": RAW},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["turn"]


def scenario(first: httpx.Client, second: httpx.Client) -> list[Any]:
    """The same requests for any store: writes through ``first``, reads through ``second``;
    returns every answer (status, body without times, resumed bytes)."""
    out: list[Any] = []

    def note(answer: httpx.Response) -> None:
        body = answer.json() if answer.content else None
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in VOLATILE}
        out.append((answer.status_code, body))

    create(first, "chat")
    turn(first, "chat", records(1, 0, 5))
    turn(first, "chat", records(1, 1, 4), complete=False)  # records 5..9: not a complete turn yet
    turn(first, "chat", records(1, 2, 3))  # ends the turn: watermark 12
    note(first.post("/sessions/chat/fork", json={"id": "mid", "at": 7, "tags": ["f"]}))  # cuts a segment
    note(first.post("/sessions/chat/fork", json={"id": "whole"}))  # at the watermark
    note(first.post("/sessions/chat/fork", json={"id": "empty", "at": 0}))
    note(first.post("/sessions/chat/fork", json={"id": "bad", "at": 13}))  # past the end
    note(first.post("/sessions/chat/fork", json={"id": "mid"}))  # exists
    note(first.post("/sessions/mid/truncate", json={"n_records": 99}))
    note(first.post("/sessions/chat/truncate", json={"n_records": 6}))  # cuts the incomplete turn
    note(first.post("/sessions/chat/truncate", json={"n_records": 6}))  # nothing to do
    turn(first, "chat", records(1, 3, 2))
    note(first.post("/sessions/whole/truncate", json={"n_records": 5}))  # at a segment's end
    turn(first, "whole", records(1, 4, 1), complete=False)
    note(first.post("/sessions/mid/fork", json={"id": "grandchild", "at": 6}))
    for session_id in ("chat", "mid", "whole", "empty", "grandchild"):
        note(second.get(f"/sessions/{session_id}"))
        out.append(resume(second, session_id))
        served = second.get(f"/sessions/{session_id}/resume", params={"format": "coli_kv"})
        out.append(served.content)
    return out


def test_fork_and_truncate_answer_as_the_embedded_store(replicas, api_key, tmp_path):  # noqa: F811
    a, b = replicas("r1"), replicas("r2")
    with client(a, api_key) as to_a, client(b, api_key) as to_b:
        shared = scenario(to_a, to_b)
    embedded = ServeProcess(tmp_path / "embedded", env={"KVSTORE_API_KEYS": f"{api_key}:alice"}).start()
    try:
        with client(embedded, api_key) as local:
            alone = scenario(local, local)
    finally:
        embedded.stop_cleanly()
    assert len(shared) == len(alone)
    for got, want in zip(shared, alone):
        assert got == want
    # spot checks of what the comparison covers
    statuses = [entry[0] for entry in shared[:8] if isinstance(entry, tuple)]
    assert statuses == [201, 201, 201, 400, 409, 400, 200, 200]
    mid = shared[0][1]
    assert (mid["n_records"], mid["watermark"], mid["parent"], mid["fork_point"], mid["tags"]) == (
        7,
        7,
        "chat",
        7,
        ["f"],
    )


def test_a_fork_made_on_one_replica_is_read_on_another_and_outlives_its_parent(
    replicas,  # noqa: F811
    api_key,  # noqa: F811
    shared_store,  # noqa: F811
):
    a, b = replicas("r1"), replicas("r2")
    with client(a, api_key) as to_a, client(b, api_key) as to_b:
        create(to_a, "chat")
        for seq in range(4):
            assert append(to_a, "chat", records(1, seq, 5)).status_code == 200
        forked = to_a.post("/sessions/chat/fork", json={"id": "copy", "at": 13})
        assert forked.status_code == 201, forked.text
        image = resume(to_b, "chat")
        assert resume(to_b, "copy") == image[: 13 * rec_bytes()]  # byte for byte, through the other replica
        objects = {s.object for s in shared_store.segments("chat~alice")}
        copied = {s.object for s in shared_store.segments("copy~alice")}
        assert len(objects & copied) == 2 and len(copied - objects) == 1  # two shared, the cut one new
        assert to_b.delete("/sessions/chat").status_code == 204
        shared_store.gc(grace=0)
        assert resume(to_a, "copy") == image[: 13 * rec_bytes()]  # the parent's delete left its objects
        assert {i.name for i in shared_store.blobs.list("seg")} == copied
        # truncate, then append: the dropped objects wait for GC, the kept rows are served
        truncated = to_b.post("/sessions/copy/truncate", json={"n_records": 3})
        assert truncated.status_code == 200 and truncated.json()["n_records"] == 3, truncated.text
        assert append(to_a, "copy", records(2, 0, 4)).json()["turn"] == [3, 7]
        assert resume(to_b, "copy") == image[: 3 * rec_bytes()] + records(2, 0, 4)
        listed = {s.object for s in shared_store.segments("copy~alice")}
        assert set(copied) - listed <= {i.name for i in shared_store.blobs.list("seg")}  # kept until GC
        report = shared_store.gc(grace=0)
        assert report.dropped == len(copied - listed)
        assert {i.name for i in shared_store.blobs.list("seg")} == listed
        assert resume(to_a, "copy") == image[: 3 * rec_bytes()] + records(2, 0, 4)
        verified = to_a.get("/sessions/copy/resume", params={"verify": "true"})
        assert verified.headers["X-KV-Verified"] == "true" and "X-KV-Damaged-From" not in verified.headers
