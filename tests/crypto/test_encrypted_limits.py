"""Sizes, usage and the disk limits of an encrypted store, with a sealed journal's real sizes (the
conformance suite's size-exact tests assume a plaintext journal's bytes)."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore.store
from crypto.support import KEK
from kvstore import tiers
from kvstore.errors import BudgetExceeded
from kvstore.formats import coli_kv
from kvstore.sealed import SEALED_HEADER_BYTES
from store.support import GEOMETRY, Rows, files_bytes, new_session


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


def test_a_restore_ring_opens_each_frame_once(tmp_path, monkeypatch):
    """A restore's ring reads an encrypted session in chunks that end on its frames, so each frame
    is decrypted once (a chunk ending inside a frame makes the next chunk open it again); so is a
    download's, but for the frame its first chunk cuts: that chunk holds exactly the records asked
    for (a server reads it before its answer starts), the next ones end on frames."""
    import kvstore.sealed as sealed_module
    from kvstore.engine.restore import ReaderBody, read_threads
    from kvstore.sealed import FrameCodec

    rec = coli_kv.record_bytes(GEOMETRY, tiers.FP8)
    monkeypatch.setattr(sealed_module, "FRAME_BYTES", 3 * rec)  # several records a frame, below a chunk
    rows = Rows(5)
    batches = [rows.make(n) for n in (7, 1, 1, 11, 2)]
    opened = []
    real_open_at = FrameCodec.open_at

    def counting(self, frame_header, body, buf, pos):
        opened.append(bytes(frame_header[:8]))  # first record and count: which frame
        return real_open_at(self, frame_header, body, buf, pos)

    monkeypatch.setattr(FrameCodec, "open_at", counting)
    with kvstore.store.open(tmp_path / "data", kek=KEK) as store:
        new_session(store)
        for batch in batches:
            store.append("chat", *batch)
        expected = rows.encode(store.get("chat", owner="alice").tier, *batches)
        journal = store.journal_path("chat", owner="alice")
        with open(journal, "rb") as handle:
            table = sealed_module.walk(handle.fileno(), rec, 22, journal.name)
        frames = len(table.firsts)
        with store.reader("chat", owner="alice") as reader:
            assert frames == 10  # [3, 3, 1], [1], [1], [3, 3, 3, 2], [2]: 5-record chunks cut some
            opened.clear()
            chunks = list(reader.iter_bytes(chunk_bytes=5 * rec))
            assert [len(c) // rec for c in chunks] == [5, 4, 3, 3, 5, 2] and all(len(c) % rec == 0 for c in chunks)
            assert b"".join(chunks) == expected
            heads = [bytes(h) for h in _frame_heads(journal, table)]
            assert sorted(opened) == sorted([*heads, heads[1]])  # each once, the one cut at record 5 twice

            starts = reader.chunk_starts(5)
            assert starts[0] == 0 and all(0 < b - a <= 5 for a, b in zip(starts, [*starts[1:], 22]))
            ends = {f + c for f, c in zip(table.firsts, table.counts)}
            assert set(starts[1:]) <= ends  # no frame is cut: each is smaller than a chunk
            opened.clear()
            ring = np.empty(5 * rec, dtype=np.uint8)
            got = b"".join(
                ring[: reader.read_into(ring, a, b - a) * rec].tobytes() for a, b in zip(starts, [*starts[1:], 22])
            )
            assert got == expected and len(opened) == len(set(opened)) == frames
            assert ReaderBody(reader).decrypts and read_threads(decrypting=True) >= read_threads()


def _frame_heads(journal, table):
    raw = journal.read_bytes()
    return [raw[o : o + 8] for o in table.offsets]
