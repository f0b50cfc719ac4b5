"""Idempotency keys per append on the shared store: a retry carrying the key of an append that some
replica committed answers the first result and appends nothing, whichever replica it reaches; the
same key with other rows is refused. Two ``kvstore serve`` replicas over one real PostgreSQL and one
real S3 server, plus the store API with two stores standing for two replicas."""

from __future__ import annotations

import threading

import httpx
import psycopg
import pytest

from kvstore.errors import IdempotencyKeyReused, InvalidRequest
from kvstore.store.shared import BlobStore, SharedIndex, SharedStore
from kvstore.store.shared.store import RequestKey
from shared.rows import GEOMETRY, TIER, records
from shared.test_replicas import api_key, append, client, create, replicas, resume  # noqa: F401  (fixtures)

RAW = "application/octet-stream"


def keyed(http: httpx.Client, session_id: str, body: bytes, key: str, **params) -> httpx.Response:
    return http.post(
        f"/sessions/{session_id}/append",
        content=body,
        params=params,
        headers={"Content-Type": RAW, "Idempotency-Key": key},
    )


def test_a_retry_through_another_replica_after_an_unanswered_append_is_applied_once(
    replicas,  # noqa: F811
    api_key,  # noqa: F811
    index_url,
):
    first, second = replicas("r1"), replicas("r2")
    to_first, to_second = client(first, api_key), client(second, api_key)
    create(to_first, "chat")
    assert keyed(to_first, "chat", records(1, 0, 2), "k-0").status_code == 200
    lost: list[object] = []
    with psycopg.connect(index_url, autocommit=True) as other:
        with other.transaction():
            # r1's commit waits for this row lock; the client gives up before the answer comes
            other.execute("SELECT 1 FROM kv_sessions WHERE key = 'chat~alice' FOR NO KEY UPDATE")
            impatient = httpx.Client(
                base_url=first.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=httpx.Timeout(1.0)
            )

            def unanswered() -> None:
                try:
                    lost.append(keyed(impatient, "chat", records(1, 1, 3), "k-1"))
                except httpx.TimeoutException as exc:
                    lost.append(exc)

            thread = threading.Thread(target=unanswered)
            thread.start()
            thread.join(timeout=60)
            assert lost and isinstance(lost[0], httpx.TimeoutException)  # no answer: the client must retry
            # the retry through r2 waits for r1's lease, held until r1's commit is done
            retried: list[httpx.Response] = []
            retry = threading.Thread(target=lambda: retried.append(keyed(to_second, "chat", records(1, 1, 3), "k-1")))
            retry.start()
        # the row lock is gone: r1 commits (nobody reads its answer), then r2 finds the key
        retry.join(timeout=60)
        impatient.close()
    answer = retried[0]
    assert answer.status_code == 200, answer.text
    assert answer.json()["turn"] == [2, 5] and answer.json()["appended"] == 3
    assert answer.headers["Idempotent-Replayed"] == "true"
    assert resume(to_second, "chat") == records(1, 0, 2) + records(1, 1, 3)  # applied once
    # again through the first replica, and with another turn flag or other rows under the same key
    again = keyed(to_first, "chat", records(1, 1, 3), "k-1")
    assert (
        again.status_code == 200 and again.json()["turn"] == [2, 5] and again.headers["Idempotent-Replayed"] == "true"
    )
    for body, params in ((records(1, 1, 3), {"complete_turn": "false"}), (records(1, 2, 3), {})):
        reused = keyed(to_second, "chat", body, "k-1", **params)
        assert reused.status_code == 422 and reused.json()["error"] == "IdempotencyKeyReused", reused.text
    fresh = keyed(to_second, "chat", records(1, 2, 3), "k-2")
    assert fresh.status_code == 200 and fresh.json()["turn"] == [5, 8] and "Idempotent-Replayed" not in fresh.headers
    assert append(to_first, "chat", records(1, 3, 1)).json()["turn"] == [8, 9]  # no key: appended every time
    assert resume(to_first, "chat") == records(1, 0, 2) + records(1, 1, 3) + records(1, 2, 3) + records(1, 3, 1)
    for bad in (b"", b"x" * 256, b"with space", "é".encode()):
        refused = to_first.post(
            "/sessions/chat/append", content=records(1, 4, 1), headers={"Content-Type": RAW, "Idempotency-Key": bad}
        )
        assert refused.status_code == 400 and "idempotency key" in refused.json()["reason"], refused.text
    assert to_first.get("/sessions/chat").json()["n_records"] == 9  # nothing written by the refused ones
    to_first.close()
    to_second.close()


def test_a_key_whose_first_commit_failed_appends_once_through_another_replica(replicas, api_key, index_url):  # noqa: F811
    first, second = replicas("r1"), replicas("r2")
    to_first, to_second = client(first, api_key), client(second, api_key)
    create(to_first, "chat")
    with psycopg.connect(index_url, autocommit=True) as other:
        outcome: list[httpx.Response] = []
        with other.transaction():
            other.execute("SELECT 1 FROM kv_sessions WHERE key = 'chat~alice' FOR NO KEY UPDATE")
            thread = threading.Thread(target=lambda: outcome.append(keyed(to_first, "chat", records(1, 0, 2), "k")))
            thread.start()
            while True:  # r1's commit waits for the lock: kill its connection (the commit never happens)
                waiting = other.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'kvstore' AND wait_event_type = 'Lock'"
                ).fetchone()
                if waiting is not None:
                    break
            other.execute("SELECT pg_terminate_backend(%s)", (waiting[0],))
            thread.join(timeout=60)
    assert outcome[0].status_code == 503, outcome[0].text
    # r1 keeps its lease for the attempt in doubt: r2 waits it out (2 s), finds no result, appends
    answer = keyed(to_second, "chat", records(1, 0, 2), "k")
    assert answer.status_code == 200 and answer.json()["turn"] == [0, 2], answer.text
    assert "Idempotent-Replayed" not in answer.headers
    again = keyed(to_first, "chat", records(1, 0, 2), "k")  # r1 settles its doubt, then finds the key
    assert (
        again.status_code == 200 and again.json()["turn"] == [0, 2] and again.headers["Idempotent-Replayed"] == "true"
    )
    assert resume(to_first, "chat") == records(1, 0, 2)
    to_first.close()
    to_second.close()


@pytest.fixture
def two_stores(index_url, blobs_url, s3_server):
    """Two stores on one shared store: two replicas as the store API sees them."""
    opened = [
        SharedStore(SharedIndex(index_url), BlobStore(blobs_url, endpoint_url=s3_server.endpoint)) for _ in range(2)
    ]
    yield opened
    for store in opened:
        store.close()


def test_the_commit_records_the_key_with_the_result(two_stores):
    a, b = two_stores
    key = a.create("alice", GEOMETRY, TIER, session_id="chat")
    lease = a.acquire(key)
    first = a.append(lease, records(1, 0, 4), request=RequestKey("r-1"))
    a.release(lease)
    assert (first.start, first.end, first.replayed) == (0, 4, False)
    lease = b.acquire(key)
    replay = b.append(lease, records(1, 0, 4), request=RequestKey("r-1"))
    assert (replay.start, replay.end, replay.replayed, replay.object) == (0, 4, True, None)
    with pytest.raises(IdempotencyKeyReused):
        b.append(lease, records(1, 0, 4), complete=False, request=RequestKey("r-1"))
    b.release(lease)
    assert a.read_records(key) == (4, records(1, 0, 4))
    assert a.gc(grace=0).requests == 0  # keys are kept a day: a late retry still finds its result
    with pytest.raises(InvalidRequest):
        RequestKey("a\x00b")
