"""Expiry on the shared store (PostgreSQL + S3): the expiry conformance suite on a real cluster and
moto's S3 server, and what only this backend has (the trigger keeping ``expires_ns``, objects
deleted as a delete's are, a fork's objects kept while its source expires, every replica sweeping)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

import kvstore.store
from conformance.expiry import HOUR, ExpiryConformance
from kvstore.store.shared.sessions import SharedSessionStore
from kvstore.store.values import storage_key
from shared.rows import GEOMETRY, TIER, records


class TestSharedExpiry(ExpiryConformance):
    backend = SharedSessionStore

    @pytest.fixture(autouse=True)
    def _servers(self, index_url, blobs_url, s3_server, monkeypatch):
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        self.index_url, self.blobs_url = index_url, blobs_url

    def make_store(self, path) -> Any:
        return kvstore.store.open(path, index_url=self.index_url, blobs_url=self.blobs_url, cache_bytes=0)

    def age(self, store, session_id, owner, seconds):
        key = storage_key(session_id, owner)
        store.index.run(
            "ageing a session",
            lambda conn: conn.execute(
                "UPDATE kv_sessions SET last_used_ns = last_used_ns - %s WHERE key = %s", (int(seconds * 1e9), key)
            ),
        )

    def stored_units(self, store, session_id, owner):
        key = storage_key(session_id, owner)

        def count(conn):
            rows = conn.execute("SELECT count(*) FROM kv_sessions WHERE key = %s", (key,)).fetchone()[0]
            objects = [r[0] for r in conn.execute("SELECT object FROM kv_segments WHERE key = %s", (key,))]
            return int(rows), objects

        rows, objects = store.index.run("counting a session's rows", count)
        return rows + len(objects)

    @contextlib.contextmanager
    def hold(self, store, session_id, owner):
        lease = store.shared.acquire(storage_key(session_id, owner), "another-replica")
        try:
            yield lease
        finally:
            store.shared.release(lease)


@pytest.fixture
def shared_store(index_url, blobs_url, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with SharedSessionStore(index_url, blobs_url, data_dir=None, cache_bytes=0) as store:
        yield store


def test_expired_objects_go_and_a_forks_shared_objects_stay(shared_store):
    store = shared_store
    store.create("alice", GEOMETRY, TIER, {"name": "m", "revision": "1"}, session_id="chat", ttl_s=HOUR)
    for seq, n in enumerate((3, 4)):
        store.append_records("chat", records(1, seq, n))
    fork = store.fork("chat", new_id="copy", owner="alice")
    assert fork.ttl_s == HOUR  # a fork keeps its source's own TTL
    store.set_ttl("copy", None, owner="alice")
    store.append_records("chat", records(1, 2, 2))
    objects = {s.object for s in store.shared.segments(storage_key("chat", "alice"))}
    shared = {s.object for s in store.shared.segments(storage_key("copy", "alice"))}
    assert len(objects) == 3 and shared < objects
    TestSharedExpiry().age(store, "chat", "alice", 2 * HOUR)
    assert [e.session_id for e in store.expire()] == ["chat"]
    blobs = store.shared.blobs
    assert all(blobs.size_of(name) is None for name in objects - shared)  # deleted as a delete deletes
    assert all(blobs.size_of(name) is not None for name in shared)  # the fork still lists them
    assert store.resume("copy").reused_tokens == 7


def test_the_trigger_keeps_expiry_on_every_write_and_replicas_share_it(shared_store, index_url, blobs_url):
    store = shared_store
    store.create("alice", GEOMETRY, TIER, {"name": "m", "revision": "1"}, session_id="chat")
    store.set_owner_ttl("alice", HOUR)
    with SharedSessionStore(index_url, blobs_url, data_dir=None, cache_bytes=0) as replica:
        assert replica.owner_ttl("alice") == HOUR
        first = replica.get("chat").expires_at
        assert first == pytest.approx(replica.get("chat").last_used + HOUR, abs=1e-3)
        replica.append_records("chat", records(1, 0, 3))  # the commit moves last_used_ns: the trigger follows
        after = store.get("chat")
        assert after.expires_at == pytest.approx(after.last_used + HOUR, abs=1e-3) and after.expires_at >= first
        TestSharedExpiry().age(store, "chat", "alice", 2 * HOUR)
        swept = replica.expire()
        assert [(e.session_id, e.owner) for e in swept] == [("chat", "alice")]
        assert store.expire() == [] and store.list() == []


def test_the_ttl_commands_on_a_shared_store(shared_store, index_url, blobs_url, capsys):
    """``kvstore sessions create --ttl``, ``owner-ttl`` and ``expire`` with ``--index --blobs``."""
    import json

    from kvstore.cli import main

    where = ["--index", index_url, "--blobs", blobs_url, "--json"]
    model = ["--model-name", "m", "--model-revision", "1", "--geometry", ",".join(map(str, GEOMETRY.words()))]
    assert main(["sessions", "create", "--id", "chat", "--tier", TIER.name, *model, "--ttl", "1h", *where]) == 0
    assert json.loads(capsys.readouterr().out)["ttl_s"] == HOUR
    assert main(["sessions", "owner-ttl", "default", "2h", *where]) == 0
    assert json.loads(capsys.readouterr().out) == {"owner": "default", "ttl_s": 2 * HOUR, "sessions": 0}
    TestSharedExpiry().age(shared_store, "chat", "default", 2 * HOUR)
    assert main(["sessions", "expire", *where]) == 0
    assert [e["session_id"] for e in json.loads(capsys.readouterr().out)] == ["chat"]
    assert shared_store.list() == [] and shared_store.owner_ttl("default") == 2 * HOUR
