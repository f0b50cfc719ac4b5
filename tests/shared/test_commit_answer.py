"""An append committed just before the index stops is answered, and its retry does not double it.

Found by the chaos run (bench/scale_chaos.py): the answer of a committed append was built by reading
the session from PostgreSQL again; when PostgreSQL stopped between the commit and that read, the
committed append answered 503, and the documented retry of the same rows (no idempotency key)
appended them a second time. Here the index is made unavailable at exactly that instant: the
first read of the session after the commit raises the error PostgreSQL's absence raises.
"""

from __future__ import annotations

import pytest

from kvstore.errors import IndexUnavailable
from kvstore.store.shared.sessions import SharedSessionStore
from shared.rows import GEOMETRY, TIER, records
from store.support import MODEL


@pytest.fixture
def store(tmp_path, index_url, blobs_url, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    with SharedSessionStore(index_url, blobs_url, data_dir=tmp_path, cache_bytes=0) as opened:
        yield opened


def test_an_append_committed_before_the_index_stops_answers_from_its_commit(store, monkeypatch):
    store.create("alice", GEOMETRY, TIER, MODEL, session_id="chat")
    store.append_records("chat", records(0, 0, 3), owner="alice")
    committed = {"done": False, "failed": 0}
    append, session = store.shared.append, store.index.session

    def append_then_mark(*args, **kwargs):
        ack = append(*args, **kwargs)
        committed["done"] = True
        return ack

    def session_after_commit(key):
        if committed["done"] and not committed["failed"]:
            committed["failed"] += 1
            raise IndexUnavailable("the shared index is unreachable", retry_after=1.0)
        return session(key)

    monkeypatch.setattr(store.shared, "append", append_then_mark)
    monkeypatch.setattr(store.index, "session", session_after_commit)
    result = store.append_records("chat", records(0, 1, 2), owner="alice")
    assert committed["failed"] == 1, "the index must have failed after the commit"
    assert result.turn == (3, 5) and result.info.n_records == 5 and result.info.watermark == 5
    monkeypatch.undo()
    after = store.get("chat", owner="alice")
    assert (after.n_records, after.watermark, after.size_bytes) == (5, 5, result.info.size_bytes)
    _, body = store.shared.read_records(after.key)
    assert body == records(0, 0, 3) + records(0, 1, 2)  # once: nothing for a client to retry
