"""Regressions for what the store fault sweeps found, each pinned to the one failing call.

- park/unpark/delete let a raw ``OSError`` out (an HTTP 500) when a write-path call failed;
- a delete that hid the session but could not remove its files left the id unusable (404 on
  delete, 409 on create) until the store was reopened;
- a fork whose folder fsync failed left its published copy unindexed, so the same fork again
  was refused until the store was reopened;
- a migrate whose folder fsync failed after the rename left the index on the old tier: the
  next call marked the session damaged, for good;
- verify read a session's count and its turns in two transactions (an append in between looked
  like damage), and unpark removed the archive under a reader of it.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from kvstore.api.errors import http_status
from kvstore.errors import JournalLocked, JournalWriteError, SessionNotFound
from kvstore.store import SessionStore
from reliability.store_checks import check_served, snapshot, visible
from reliability.store_workload import OWNER, TIER_NAMES, StoreModel, perform
from reliability.workload import turn_rows

SEED = 88


class FailAfter:
    """Make the first ``os.<name>`` call after an ``os.<after>`` call (or the first at all) fail;
    with ``path``, only a call on a path ending so."""

    def __init__(
        self, monkeypatch, name: str, after: str | None = None, *, path: str | None = None, code: int = errno.EIO
    ):
        self.armed = after is None
        self.failed = False
        real = getattr(os, name)

        def failing(*args, **kwargs):
            if self.armed and not self.failed and (path is None or os.fspath(args[0]).endswith(path)):
                self.failed = True
                raise OSError(code, os.strerror(code))
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, failing)
        if after is not None:
            real_after = getattr(os, after)

            def arming(*args, **kwargs):
                result = real_after(*args, **kwargs)
                self.armed = True
                return result

            monkeypatch.setattr(os, after, arming)


@pytest.fixture
def store_and_model(tmp_path):
    model = StoreModel(SEED)
    with SessionStore(tmp_path / "data") as store:
        model = perform(store, model, "create", ["s", "v2"])
        for step in (1, 2):
            model = perform(store, model, "append", ["s", str(step), "1"])
        yield store, model


def test_delete_that_cannot_remove_files_is_finished_by_the_next_call(store_and_model, monkeypatch):
    store, model = store_and_model
    with monkeypatch.context() as m:
        fault = FailAfter(m, "unlink")
        with pytest.raises(JournalWriteError, match="deleting it again") as raised:
            store.delete("s")
    assert fault.failed and http_status(raised.value) == 507
    assert store.list() == []
    with pytest.raises(SessionNotFound):
        store.get("s")
    store.delete("s")  # the same call again finishes it
    assert not store.journal_path("s", owner=OWNER).exists()
    # and after another failed delete, the id can be created again at once
    model = perform(store, model.apply("delete", ["s"]), "create", ["s", "v2"])
    model = perform(store, model, "append", ["s", "3", "1"])
    with monkeypatch.context() as m:
        FailAfter(m, "unlink")
        with pytest.raises(JournalWriteError):
            store.delete("s")
    model = perform(store, model.apply("delete", ["s"]), "create", ["s", "v2"])
    assert visible(store) == model.sessions and store.get("s").n_records == 0


def test_fork_whose_folder_sync_fails_leaves_no_unindexed_copy(store_and_model, monkeypatch):
    store, model = store_and_model
    with monkeypatch.context() as m:
        fault = FailAfter(m, "fsync", after="link")  # the copy is linked into place, then its folder sync fails
        with pytest.raises(JournalWriteError):
            store.fork("s", at=5, new_id="f")
    assert fault.failed
    assert not store.journal_path("f", owner=OWNER).exists() and [i.id for i in store.list()] == ["s"]
    model = perform(store, model, "fork", ["s", "f", "5"])  # the same fork again completes
    assert snapshot(store) == model.sessions


def test_migrate_whose_folder_sync_fails_keeps_the_session_usable(store_and_model, monkeypatch):
    store, model = store_and_model
    with monkeypatch.context() as m:
        fault = FailAfter(m, "fsync", after="replace")  # renamed over the old journal, then the folder sync fails
        with pytest.raises(JournalWriteError, match="was migrated"):
            store.migrate("s", TIER_NAMES["int4"])
    assert fault.failed
    model = model.apply("migrate", ["s", "int4"])
    assert store.get("s").state == "active" and store.get("s").tier == TIER_NAMES["int4"]
    model = perform(store, model, "append", ["s", "3", "1"])  # was: SessionDamaged, for good
    assert snapshot(store) == model.sessions
    check_served(store, model.sessions)


@pytest.mark.parametrize("kind", ["park", "unpark"])
def test_park_and_unpark_failures_are_typed(store_and_model, monkeypatch, kind):
    store, model = store_and_model
    if kind == "unpark":
        model = perform(store, model, "park", ["s"])
    old_file = f"journals/s~{OWNER}.coli_kv" if kind == "park" else f"archive/s~{OWNER}.coli_kv.zst"
    with monkeypatch.context() as m:
        fault = FailAfter(m, "unlink", path=old_file)  # committed: the new file is the truth, the old one cannot go
        with pytest.raises(JournalWriteError) as raised:
            perform(store, model, kind, ["s"])
    assert fault.failed and http_status(raised.value) == 507
    model = model.apply(kind, ["s"])  # the call took effect: its file is the truth
    assert visible(store) == model.sessions
    other = "unpark" if kind == "park" else "park"
    model = perform(store, model, other, ["s"])  # the leftover is cleared by the next call
    model = perform(store, model, "append", ["s", "4", "1"])
    assert snapshot(store) == model.sessions
    check_served(store, model.sessions)


def _in_a_thread(call):
    """Run ``call`` in another thread (as another request would) and return what it returned or raised."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return outcome[0]


def test_verify_during_an_append_reads_one_snapshot(tmp_path, monkeypatch):
    """Regression (long concurrency run): verify read the count, then the turns in another
    transaction; an append committing in between made a sound session look damaged
    ({'start': 2013, 'end': 1989})."""
    data = tmp_path / "data"
    model = StoreModel(SEED)
    with SessionStore(data) as store, SessionStore(data) as other:
        model = perform(store, model, "create", ["s", "v2"])
        for step in (1, 2):
            model = perform(store, model, "append", ["s", str(step), "1"])
        real_read = store.index.read
        reads, appended = [], []

        def read_then_an_append():
            txn = real_read()
            reads.append(txn)
            # reads: the facade resolving the id, verify's own check, then its read under the lock
            if len(reads) == 3:  # verify's read under its lock has begun: another request appends now
                appended.append(_in_a_thread(lambda: other.append("s", *turn_rows(SEED, 3))))
            return txn

        monkeypatch.setattr(store.index, "read", read_then_an_append)
        report = store.verify("s")
        monkeypatch.undo()
        assert not isinstance(appended[0], BaseException), appended
        assert report.ok and report.n_records == model.sessions["s"].n_records, report
        assert store.verify("s").ok and store.get("s").n_records > report.n_records


def test_unpark_waits_for_a_reader_of_the_archive(tmp_path, monkeypatch):
    """Regression: unpark removed the archive without the read lock, so a verify (or lookup) of the
    parked session that had just read its record opened a file that was gone (a raw
    FileNotFoundError, HTTP 500)."""
    data = tmp_path / "data"
    model = StoreModel(SEED)
    with SessionStore(data) as store, SessionStore(data, lock_timeout=0) as other:
        model = perform(store, model, "create", ["s", "v2"])
        model = perform(store, model, "append", ["s", "1", "1"])
        model = perform(store, model, "park", ["s"])
        real_turns = store.index.turns
        unparked = []

        def turns_while_unparked(txn, session_id):
            if not unparked:  # another request unparks while verify is about to read the archive
                unparked.append(_in_a_thread(lambda: other.unpark("s")))
            return real_turns(txn, session_id)

        monkeypatch.setattr(store.index, "turns", turns_while_unparked)
        report = store.verify("s")
        monkeypatch.undo()
        assert report.ok
        assert isinstance(unparked[0], JournalLocked), unparked  # it waits for the reader (here: no wait, a clear busy)
        assert store.get("s").state == "parked"
        model = perform(other, model, "unpark", ["s"])
        assert snapshot(store) == model.sessions
