"""A park that meets a reader is refused before any work (issue 42, item 10).

Parking switches the index and removes the journal under the session's read lock, taken
exclusively. Before the fix a park started while a download held the read lock compressed the whole
journal first, then waited for the reader for the lock timeout while holding the session's write
lock, and failed ``JournalLocked``: the owner's appends meanwhile waited for that write lock and got
``409``. Now the lock is checked before the work: the park fails at once and compresses nothing.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore import tiers
from kvstore.errors import JournalLocked
from kvstore.store import SessionStore
from store.support import GEOMETRY, MODEL, Rows

LOCK_TIMEOUT_S = 3.0


def test_a_park_during_a_download_is_refused_before_compressing_and_appends_go_on(tmp_path):
    rows = Rows(0)
    with SessionStore(tmp_path / "data", lock_timeout=LOCK_TIMEOUT_S) as store:
        store.create("alice", GEOMETRY, tiers.FP8, MODEL, session_id="s")
        store.append_records("s", rows.encode(tiers.FP8, rows.make(40)))
        compressed: list[int] = []
        with store.reader("s") as download:  # holds the session's read lock, as a download does
            started = time.monotonic()
            with pytest.raises(JournalLocked, match="is being read"):
                store.park("s", progress=lambda done, total: compressed.append(done))
            refused_after = time.monotonic() - started
            # the owner's append meanwhile: the write lock was given back at once
            appended: list[object] = []
            writer = threading.Thread(
                target=lambda: appended.append(store.append_records("s", rows.encode(tiers.FP8, rows.make(3))))
            )
            writer.start()
            writer.join(LOCK_TIMEOUT_S * 2)
            assert download.n_records == 40
        assert compressed == []  # nothing was compressed
        assert refused_after < LOCK_TIMEOUT_S / 3, refused_after
        assert len(appended) == 1 and store.get("s").n_records == 43 and store.get("s").state == "active"
        assert not list((tmp_path / "data" / "archive").glob("*"))  # no archive, no temporary file
        # once the download ends the park goes through
        assert store.park("s").state == "parked"
