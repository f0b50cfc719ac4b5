"""Index schema versioning: an index written at schema version 1 is upgraded on open."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import lmdb
import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import IndexSchemaError
from kvstore.journal import KVFile
from kvstore.migrations import index as schema
from kvstore.store import Fingerprint, ModelInfo, SessionStore, archive
from store.support import GEOMETRY, MODEL, Rows, journal_body


def write_v1_index(data, sessions):
    """An index exactly as schema version 1 lays it out (see kvstore.migrations.index)."""
    (data / "index").mkdir(parents=True, mode=0o700)
    env = lmdb.open(str(data / "index"), max_dbs=schema.MAX_DBS, map_size=1 << 26)
    meta, records, turns = (env.open_db(name) for name in (b"meta", b"sessions", b"turns"))
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", b"1", db=meta)
        for record, session_turns in sessions:
            txn.put(record["id"].encode(), json.dumps(record).encode(), db=records)
            for start, end, digest in session_turns:
                key = record["id"].encode() + b"\0" + end.to_bytes(4, "big")
                txn.put(key, start.to_bytes(4, "big") + end.to_bytes(4, "big") + b"\x01" + digest, db=turns)
    env.close()


def v1_session(data, sid, owner, chunks, last_used):
    path = data / "journals" / f"{sid}.coli_kv"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    turns, count = [], 0
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        for chunk in chunks:
            encoded = journal.encode(*chunk)
            journal.append_records(encoded)
            turns.append((count, count + encoded.shape[0], hashlib.blake2b(encoded.tobytes(), digest_size=32).digest()))
            count += encoded.shape[0]
    record = {
        "id": sid,
        "owner": owner,
        "model": {
            **MODEL,
            "weights_hash": None,
            "tokenizer_hash": None,
            "chat_template_hash": None,
            "attention_variant": None,
        },
        "geometry": list(GEOMETRY.words()),
        "tier": {"version": 2, "codec": None, "bits": None},
        "n_records": count,
        "watermark": count,
        "created": last_used,
        "updated": last_used,
        "last_used": last_used,
        "size_bytes": path.stat().st_size,
        "tags": ["old"],
        "state": "active",
        "parent": None,
        "fork_point": None,
        "problem": None,
    }
    return record, turns


def test_upgrade_from_schema_1(tmp_path):
    data = tmp_path / "data"
    rows = Rows(1)
    tokens = rows.rng.integers(0, 1000, 200).astype(np.int32)
    old = [
        v1_session(data, "first", "alice", [rows.make(150, tokens[:150]), rows.make(50, tokens[150:])], 1000.0),
        v1_session(data, "second", "bob", [rows.make(70)], 2000.0),
    ]
    write_v1_index(data, old)
    seen = []
    with SessionStore(data, progress=lambda done, total: seen.append((done, total))) as store:
        assert store.index.version() == schema.CURRENT_VERSION and seen == [(k, 5) for k in range(1, 6)]
        assert [s.id for s in store.list(owner="alice")] == ["first"]
        assert store.get("first").tags == ("old",) and store.get("first").prefix_blocks == 3
        fingerprint = Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8)
        hit = store.lookup("alice", fingerprint, tokens)
        assert (hit.session_id, hit.matched_tokens) == ("first", 200)
        assert store.verify("first").ok and store.verify("second").ok
        assert store.usage()["used_bytes"] == sum(r["size_bytes"] for r, _ in old)
        with store.index.read() as txn:
            assert store.index.least_recently_used(txn) == ["first~alice", "second~bob"]
        store.append("first", *rows.make(3))
        assert store.resume("first").reused_tokens == 203
    with SessionStore(data) as store:  # reopening an upgraded index applies nothing
        assert store.index.version() == schema.CURRENT_VERSION and store.reconcile_actions == []


def test_an_index_from_a_newer_kvstore_is_refused(tmp_path):
    data = tmp_path / "data"
    write_v1_index(data, [])
    env = lmdb.open(str(data / "index"), max_dbs=schema.MAX_DBS)
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", str(schema.CURRENT_VERSION + 1).encode(), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(IndexSchemaError, match="newer"):
        SessionStore(data)
    with SessionStore(tmp_path / "fresh") as store:  # and the refused one was not left open
        assert store.index.version() == schema.CURRENT_VERSION


def test_schema_steps_are_numbered_and_named():
    assert [(s.source, s.target, s.name) for s in schema.plan(1)] == [
        (1, 2, "owner-and-lru-indexes"),
        (2, 3, "prefix-blocks"),
        (3, 4, "owner-scoped-ids"),
        (4, 5, "listing-and-counts"),
        (5, 6, "expiry"),
    ]
    with pytest.raises(IndexSchemaError):
        schema.plan(0)


def test_owner_scoped_ids_rename_the_files_and_a_crash_mid_step_is_finished_on_the_next_open(tmp_path, monkeypatch):
    data = tmp_path / "data"
    rows = Rows(1)
    tokens = rows.rng.integers(0, 1000, 130).astype(np.int32)
    first = v1_session(data, "first", "alice", [rows.make(130, tokens)], 1000.0)
    branch = v1_session(data, "branch", "alice", [rows.make(3)], 1500.0)
    branch[0]["parent"], branch[0]["fork_point"] = "first", 3
    chat = v1_session(data, "chat", "bob", [rows.make(2)], 2000.0)
    parked_rows = rows.make(4)
    parked = v1_session(data, "old", "bob", [parked_rows], 3000.0)
    journal, packed = data / "journals" / "old.coli_kv", data / "archive" / "old.coli_kv.zst"
    packed.parent.mkdir(mode=0o700)
    with open(journal, "rb") as source:  # parked as schema 1 parked it: only its archive is left
        archive.compress_journal(source.fileno(), journal.stat().st_size, packed)
    journal.unlink()
    parked[0].update(state="parked", size_bytes=packed.stat().st_size)
    write_v1_index(data, [first, branch, chat, parked])
    (data / "locks").mkdir(mode=0o700)
    (data / "locks" / "chat.write").write_bytes(b"")  # a lock file of the old layout
    step = schema.STEPS[3]

    def crash_before_commit(ctx):
        step.apply(ctx)  # files renamed, index entries re-keyed in the transaction...
        raise RuntimeError("killed")  # ...which never commits

    monkeypatch.setitem(schema.STEPS, 3, dataclasses.replace(step, apply=crash_before_commit))
    with pytest.raises(RuntimeError, match="killed"):
        SessionStore(data)
    monkeypatch.setitem(schema.STEPS, 3, step)
    names = sorted(p.name for p in (data / "journals").iterdir())
    assert names == ["branch~alice.coli_kv", "chat~bob.coli_kv", "first~alice.coli_kv"]
    with SessionStore(data) as store:
        assert store.index.version() == schema.CURRENT_VERSION
        assert [line for line in store.reconcile_actions if not line.startswith("disk usage")] == []  # none moved
        assert sorted(p.name for p in (data / "journals").glob("*.coli_kv")) == names
        assert not (data / "locks" / "chat.write").exists()
        assert [(s.id, s.key, s.parent) for s in store.list(owner="alice")] == [
            ("first", "first~alice", None),
            ("branch", "branch~alice", "first"),
        ]
        assert store.get("chat").owner == "bob" and store.verify("chat").ok and store.verify("first").ok
        assert [p.name for p in (data / "archive").iterdir()] == ["old~bob.coli_kv.zst"]
        assert store.get("old", owner="bob").state == "parked" and store.verify("old").ok
        assert store.unpark("old", owner="bob").state == "active" and not any((data / "archive").iterdir())
        assert journal_body(store, "old") == rows.encode(tiers.FP8, parked_rows)
        hit = store.lookup("alice", Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8), tokens)
        assert (hit.session_id, hit.matched_tokens) == ("first", 130)
        assert store.lookup("bob", Fingerprint(ModelInfo.from_dict(MODEL), GEOMETRY, tiers.FP8), tokens) is None
        # bob may now have a "first" of his own
        store.create("bob", GEOMETRY, tiers.FP8, MODEL, session_id="first")
        store.append("first", *rows.make(2), owner="bob")
        assert store.get("first", owner="alice").n_records == 130 and store.get("first", owner="bob").n_records == 2
        with store.index.read() as txn:
            assert store.index.least_recently_used(txn)[:3] == ["first~alice", "branch~alice", "chat~bob"]
