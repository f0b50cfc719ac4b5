"""Owner isolation in the embedded store: another owner's id is checked before any lock or file.

Ids are per owner (``<id>~<owner>`` keys, kvstore.migrations.index schema 4), so a request of
mallory for alice's ``mine`` looks up ``mine~mallory``: one index read, then the same
SessionNotFound as for an id nobody has — never alice's locks, never a wait, never a file.
"""

from __future__ import annotations

import os

import pytest

from kvstore import tiers
from kvstore.errors import SessionNotFound
from kvstore.locks import FileLock
from kvstore.store import SessionStore
from store.support import new_session


def test_another_owner_takes_no_lock_waits_for_none_and_leaves_no_file(tmp_path, rows):
    # lock_timeout=0: a call that went for alice's held locks would answer JournalLocked at once,
    # so SessionNotFound proves it never tried them (no timing needed)
    with SessionStore(tmp_path / "data", lock_timeout=0) as store:
        new_session(store, "mine")
        store.append("mine", *rows.make(3))
        key = store.get("mine").key
        calls = {
            "delete": lambda: store.delete("mine", owner="mallory"),
            "truncate": lambda: store.truncate("mine", 0, owner="mallory"),
            "append": lambda: store.append("mine", *rows.make(1), owner="mallory"),
            "append_records": lambda: store.append_records("mine", b"", owner="mallory"),
            "fork": lambda: store.fork("mine", new_id="copy", owner="mallory"),
            "park": lambda: store.park("mine", owner="mallory"),
            "unpark": lambda: store.unpark("mine", owner="mallory"),
            "repair": lambda: store.repair("mine", owner="mallory"),
            "migrate": lambda: store.migrate("mine", tiers.F32, owner="mallory"),
            "verify": lambda: store.verify("mine", owner="mallory"),
            "inspect": lambda: store.inspect("mine", owner="mallory"),
            "reader": lambda: store.reader("mine", owner="mallory"),
            "set_tags": lambda: store.set_tags("mine", ["x"], owner="mallory"),
        }
        # alice is mid-append (write lock) and mid-download (read lock, exclusive: nothing else gets it)
        with FileLock(store.locks / f"{key}.write", timeout=0), FileLock(store.locks / f"{key}.read", timeout=0):
            files = sorted(os.listdir(store.data_dir / "locks")) + sorted(os.listdir(store.journals))
            for name, call in calls.items():
                with pytest.raises(SessionNotFound) as refused:
                    call()
                assert refused.value.reason == "no session 'mine'", name
            assert sorted(os.listdir(store.data_dir / "locks")) + sorted(os.listdir(store.journals)) == files
        info = store.get("mine")
        assert (info.n_records, info.tags, info.state) == (3, (), "active") and store.verify("mine").ok
