"""Expiry on the embedded store (LMDB + journals): the expiry conformance suite, and what only this
backend has (the ``expiry`` range in the index, files gone like a delete's, the schema step)."""

from __future__ import annotations

import time
from typing import Any

import kvstore.store
from conformance.expiry import HOUR, ExpiryConformance
from kvstore.migrations import index as schema
from kvstore.store import SessionStore
from kvstore.store.values import storage_key
from store.support import Rows, new_session


class TestEmbeddedExpiry(ExpiryConformance):
    backend = SessionStore

    def make_store(self, path) -> Any:
        return kvstore.store.open(path)

    def age(self, store, session_id, owner, seconds):
        key = storage_key(session_id, owner)
        with store.index.write() as txn:
            record = store.index.get(txn, key)
            moved = record["last_used_ns"] - int(seconds * 1e9)
            store.index.update(txn, key, last_used_ns=moved, last_used=moved / 1e9)

    def stored_units(self, store, session_id, owner):
        key = storage_key(session_id, owner)
        files = [store.journals / f"{key}.coli_kv", store.archives / f"{key}.coli_kv.zst"]
        with store.index.read() as txn:
            indexed = store.index.get(txn, key) is not None
        return sum(path.exists() for path in files) + indexed

    def hold(self, store, session_id, owner):
        return store._ctx.writing(storage_key(session_id, owner))


def test_the_sweep_reads_the_front_of_the_expiry_range(tmp_path):
    """The index keeps one ``expiry`` entry per session with a TTL, ordered by when it expires; the
    sweep reads no further than now, and a session without a TTL has no entry at all."""
    with SessionStore(tmp_path / "data") as store:
        new_session(store, "plain")
        for n in range(3):
            new_session(store, f"s{n}", ttl_s=(n + 1) * HOUR)
        store.set_owner_ttl("bob", HOUR)
        new_session(store, "b", owner="bob")
        with store.index.read() as txn, txn.cursor(db=store.index._db(schema.DB_EXPIRY)) as cursor:
            entries = [schema.expiry_entry(bytes(key)) for key in cursor.iternext(values=False)]
        assert [key for _, key in entries] == ["s0~alice", "b~bob", "s1~alice", "s2~alice"]  # b made after s0
        for when, key in entries:
            sid, owner = key.split("~")
            assert abs(when / 1e9 - store.get(sid, owner=owner).expires_at) < 1e-6
        now = time.time_ns()
        with store.index.read() as txn:
            assert store.index.expired_keys(txn, now, 100) == []
            assert store.index.expired_keys(txn, now + int(1.5 * HOUR * 1e9), 100) == ["s0~alice", "b~bob"]
            assert len(store.index.expired_keys(txn, now + int(10 * HOUR * 1e9), 2)) == 2
        store.delete("s1")
        store.set_ttl("s2", None, owner="alice")
        with store.index.read() as txn, txn.cursor(db=store.index._db(schema.DB_EXPIRY)) as cursor:
            keys = {schema.expiry_entry(bytes(key))[1] for key in cursor.iternext(values=False)}
        assert keys == {"s0~alice", "b~bob"}


def test_expired_files_go_as_a_delete_removes_them(tmp_path):
    with SessionStore(tmp_path / "data") as store:
        new_session(store, "chat", ttl_s=HOUR)
        store.append("chat", *Rows(1).make(5))
        new_session(store, "parked", ttl_s=HOUR)
        store.append("parked", *Rows(2).make(5))
        store.park("parked")
        journal, archive = store.journal_path("chat"), store.archive_path("parked")
        assert journal.exists() and archive.exists()
        suite = TestEmbeddedExpiry()
        suite.age(store, "chat", "alice", 2 * HOUR)
        suite.age(store, "parked", "alice", 2 * HOUR)
        assert {e.session_id for e in store.expire()} == {"chat", "parked"}
        assert not journal.exists() and not archive.exists()
        assert not any((store.locks).glob("chat~alice.*"))
        assert store.usage()["used_bytes"] == 0


def test_an_index_of_schema_5_gains_the_expiry_databases(tmp_path):
    with SessionStore(tmp_path / "data") as store:
        new_session(store, "chat")
        with store.index.write() as txn:
            txn.put(schema.SCHEMA_KEY, b"5", db=store.index._db(schema.DB_META))
    with SessionStore(tmp_path / "data") as store:
        assert store.schema_version() == schema.CURRENT_VERSION == 6
        assert store.get("chat").expires_at is None
        store.set_owner_ttl("alice", HOUR)
        assert store.get("chat").expires_at is not None


def test_a_session_being_read_is_kept_until_its_reader_closes(tmp_path):
    """A download holds the session's read lock: the sweep, which takes it without waiting, leaves
    the session for a later pass, and the reader serves every record."""
    with SessionStore(tmp_path / "data") as store:
        new_session(store, "chat", ttl_s=HOUR)
        store.append("chat", *Rows(3).make(6))
        suite = TestEmbeddedExpiry()
        with store.reader("chat") as reader:
            suite.age(store, "chat", "alice", 2 * HOUR)
            assert store.expire() == []
            assert reader.load().n == 6
        assert [e.session_id for e in store.expire()] == ["chat"]
