"""Sizes, usage and the disk limits of an encrypted store, with a sealed journal's real sizes (the
conformance suite's size-exact tests assume a plaintext journal's bytes)."""

from __future__ import annotations

import pytest

import kvstore.store
from crypto.support import KEK
from kvstore.errors import BudgetExceeded
from kvstore.sealed import SEALED_HEADER_BYTES
from store.support import Rows, files_bytes, new_session


def sizes_agree(store):
    for info in store.list():
        path = store.journal_path(info.id) if info.state == "active" else store.archive_path(info.id)
        assert info.size_bytes == path.stat().st_size, (info.id, info.state)
    assert store.usage()["used_bytes"] == files_bytes(store.data_dir)


def test_every_size_the_index_keeps_is_the_files(tmp_path):
    rows = Rows(3)
    with kvstore.store.open(tmp_path / "data", kek=KEK) as store:
        assert new_session(store).size_bytes == SEALED_HEADER_BYTES
        store.append("chat", *rows.make(6))
        store.append("chat", *rows.make(6))
        sizes_agree(store)
        store.truncate("chat", 9)  # inside a frame: a rewrite
        sizes_agree(store)
        store.truncate("chat", 6)  # at a frame: in place
        sizes_agree(store)
        store.fork("chat", new_id="copy", at=4)
        store.park("copy")
        sizes_agree(store)
        store.unpark("copy")
        store.delete("chat")
        sizes_agree(store)


def test_the_hard_limit_counts_sealed_bytes(tmp_path):
    rows = Rows(4)
    with kvstore.store.open(tmp_path / "data", kek=KEK) as store:
        new_session(store)
        store.append("chat", *rows.make(10))
        used = store.usage()["used_bytes"]
    with kvstore.store.open(tmp_path / "data", kek=KEK, hard_limit_bytes=used + 50) as store:
        with pytest.raises(BudgetExceeded):
            store.append("chat", *rows.make(1))  # one record + a frame's 44 bytes cross it
        assert store.get("chat").n_records == 10 and store.usage()["used_bytes"] == used
        sizes_agree(store)
