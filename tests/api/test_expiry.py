"""Expiry through a real ``kvstore serve`` (uvicorn on 127.0.0.1, embedded store): the ``ttl_s`` of
``POST /sessions`` and ``PATCH /sessions/{id}``, ``expires_at`` in every session's JSON, 404 for an
expired session before the sweep, the server's sweep deleting its files, and the metrics.

Time passes the way the expiry suites make it pass (``tests/conformance/expiry.py``): the test
moves the session's last use back in the index behind the server's back (LMDB is shared between
processes), so nothing here waits for a TTL to run out; the only wait is for the server's sweep,
polled with a deadline.
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import tiers
from kvstore.store import SessionStore
from kvstore.store.values import storage_key
from store.support import MODEL, Rows

HOUR = 3600.0
RAW = "application/octet-stream"
GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}


def scrape(client: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of ``GET /metrics``, by name."""
    page = client.get("/metrics")
    assert page.status_code == 200, page.text
    return {s.name: s.value for f in text_string_to_metric_families(page.text) for s in f.samples if not s.labels}


def age(store: SessionStore, session_id: str, owner: str, seconds: float) -> None:
    """Move the session's last use ``seconds`` back (as tests/store/test_expiry.py does)."""
    key = storage_key(session_id, owner)
    with store.index.write() as txn:
        moved = store.index.get(txn, key)["last_used_ns"] - int(seconds * 1e9)
        store.index.update(txn, key, last_used_ns=moved, last_used=moved / 1e9)


def test_ttl_through_the_api_and_the_sweep_of_a_running_server(make_server, tmp_path):
    server = make_server("--expiry-sweep", "0.2")
    data = tmp_path / "data"
    with server.client() as alice, server.client("bob-key-0123456789abcdef") as bob:
        body = {"id": "chat", "model": MODEL, "geometry": GEOMETRY_JSON, "tier": "fp8", "ttl_s": HOUR}
        created = alice.post("/sessions", json=body)
        assert created.status_code == 201, created.text
        info = created.json()
        assert info["ttl_s"] == HOUR and info["expires_at"] == pytest.approx(info["last_used"] + HOUR, abs=1e-3)
        for bad in (0, -5, "1h", 1e12, True):
            refused = alice.post("/sessions", json={**body, "id": "other", "ttl_s": bad})
            assert refused.status_code == 422, refused.text
        plain = alice.post("/sessions", json={**body, "id": "plain", "ttl_s": None}).json()
        assert plain["ttl_s"] is None and plain["expires_at"] is None

        rows = Rows(1)
        records = rows.encode(tiers.FP8, rows.make(5))
        appended = alice.post("/sessions/chat/append", content=records, headers={"Content-Type": RAW})
        assert appended.status_code == 200, appended.text
        assert appended.json()["session"]["expires_at"] >= info["expires_at"]  # an append is a use

        longer = alice.patch("/sessions/chat", json={"ttl_s": 2 * HOUR}).json()
        assert longer["ttl_s"] == 2 * HOUR and longer["expires_at"] == pytest.approx(
            longer["last_used"] + 2 * HOUR, abs=1e-3
        )
        dropped = alice.patch("/sessions/chat", json={"ttl_s": None}).json()
        assert dropped["ttl_s"] is None and dropped["expires_at"] is None
        both = alice.patch("/sessions/chat", json={"ttl_s": HOUR, "tags": ["kept"]}).json()
        assert both["ttl_s"] == HOUR and both["tags"] == ["kept"]
        assert alice.patch("/sessions/chat", json={"tags": ["x"]}).json()["ttl_s"] == HOUR  # tags alone keep it
        for bad in ({}, {"ttl_s": 0}, {"ttl_s": "soon"}, {"tags": None}):
            assert alice.patch("/sessions/chat", json=bad).status_code == 422, bad
        assert bob.patch("/sessions/chat", json={"ttl_s": HOUR}).status_code == 404  # another owner's: missing
        before = scrape(alice)

        # an hour and more passes for "chat": the server refuses it at once, sweep or not
        with SessionStore(data, reconcile=False) as store:
            journal = store.journal_path("chat", owner="alice")
            assert journal.exists()
            age(store, "chat", "alice", 2 * HOUR)
        for answer in (
            alice.get("/sessions/chat"),
            alice.get("/sessions/chat/resume"),
            alice.post("/sessions/chat/append", content=records, headers={"Content-Type": RAW}),
            alice.patch("/sessions/chat", json={"ttl_s": HOUR}),
        ):
            assert answer.status_code == 404 and answer.json()["error"] == "SessionNotFound", answer.text
        assert [s["id"] for s in alice.get("/sessions").json()["sessions"]] == ["plain"]

        deadline = time.monotonic() + 30  # the server sweeps every 0.2 s
        while journal.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not journal.exists(), "the server's sweep did not delete the expired session's journal"
        after = scrape(alice)  # the sweep counts a deletion once its files are gone: wait for the count too
        while after["kvstore_expired_sessions_total"] == before["kvstore_expired_sessions_total"]:
            assert time.monotonic() < deadline, "the sweep deleted the journal but never counted it"
            time.sleep(0.05)
            after = scrape(alice)
        assert after["kvstore_expired_sessions_total"] - before["kvstore_expired_sessions_total"] == 1
        assert after["kvstore_expired_bytes_total"] - before["kvstore_expired_bytes_total"] == 40 + len(records)
        again = alice.post("/sessions", json=body)  # the id is free again
        assert again.status_code == 201 and again.json()["n_records"] == 0
