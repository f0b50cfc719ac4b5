"""The data folder as a hostile or careless hand may leave it: links, loops, stale sidecars, files back.

- A symbolic link where a store file belongs (the index's ``data.mdb``/``lock.mdb``, a lock file,
  a journal) is never opened through, never created through: a typed ``PathRefused`` or, for a lock
  file, the link is removed on open (it locks nothing). A data folder that loops or is a file is
  refused the same way. Nothing outside the data folder is ever written.
- Stale sidecars are not damage: lock files of sessions that no longer exist, a journal lock whose
  journal is gone, dead writers' temporary files are removed on open (and by ``verify --repair``);
  a held one is left to its holder.
- A session marked damaged because a file was missing or a link stood in its place is looked at
  again on every open: once the file is back, regular, for the same model and re-hashing to the
  turns the index recorded, the session is what it was; a file that came back changed stays refused.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from kvstore import tiers
from kvstore.errors import PathRefused, SessionDamaged
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.locks import FileLock
from kvstore.store import SessionStore
from store.support import GEOMETRY, MODEL, Rows, new_session

LOOP = "loop"
OUT = "out"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant_link(path, kind: str, outside) -> None:
    """A symbolic link at ``path``: to a file outside the data folder, or to itself (a loop)."""
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(outside if kind == OUT else path.name, path)


def outside_untouched(outside, before: bytes | None) -> bool:
    if before is None:
        return not os.path.lexists(outside)
    return outside.read_bytes() == before


def session_with_turns(data, rows: Rows, turns: int = 2) -> tuple[str, bytes]:
    """``chat`` (alice, fp8) with ``turns`` appended turns; returns its key and its journal's bytes."""
    with SessionStore(data) as store:
        new_session(store)
        for _ in range(turns):
            store.append("chat", *rows.make(5))
        return key_of(store, "chat"), store.journal_path("chat").read_bytes()


def key_of(store: SessionStore, session_id: str) -> str:
    """The name the store gives a session's files (its storage key)."""
    return store.journal_path(session_id).name[: -len(".coli_kv")]


# ---------------------------------------------------------------------------- links and loops
@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
@pytest.mark.parametrize("kind", [OUT, "out-existing", LOOP])
@pytest.mark.parametrize("existing_store", [False, True], ids=["new", "existing"])
def test_a_link_where_an_index_file_belongs_is_refused_and_nothing_goes_through_it(
    tmp_path, name, kind, existing_store
):
    data, outside = tmp_path / "data", tmp_path / "outside.mdb"
    if existing_store:
        with SessionStore(data) as store:
            new_session(store)
    (data / "index").mkdir(parents=True, exist_ok=True)
    before = None
    if kind == "out-existing":
        outside.write_bytes(b"not an lmdb file, and not kvstore's to write")
        before = outside.read_bytes()
    plant_link(data / "index" / name, LOOP if kind == LOOP else OUT, outside)
    with pytest.raises(PathRefused, match=f"index/{name} is a symbolic link"):
        SessionStore(data)
    assert outside_untouched(outside, before)
    assert os.path.islink(data / "index" / name)  # refused, not "fixed": the index is the operator's to look at


@pytest.mark.parametrize("make", ["folder", "fifo"])
def test_an_index_file_that_is_not_a_regular_file_is_refused(tmp_path, make):
    index = tmp_path / "data" / "index"
    index.mkdir(parents=True)
    if make == "folder":
        (index / "data.mdb").mkdir()
    else:
        os.mkfifo(index / "data.mdb")
    with pytest.raises(PathRefused, match="index/data.mdb is not a regular file"):
        SessionStore(tmp_path / "data")


@pytest.mark.parametrize("kind", ["loop", "file", "dangling"])
def test_a_data_folder_that_loops_or_is_not_a_folder_is_refused(tmp_path, kind):
    data = tmp_path / "data"
    if kind == "loop":
        os.symlink("data", data)
    elif kind == "file":
        data.write_bytes(b"")
    else:
        os.symlink(tmp_path / "missing" / "nowhere", data)
    with pytest.raises(PathRefused, match="is not a folder"):
        SessionStore(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("kind", [OUT, LOOP])
def test_a_link_where_a_journal_lock_belongs_never_damages_the_session(tmp_path, kind):
    data, outside, rows = tmp_path / "data", tmp_path / "outside.lock", Rows(3)
    key, image = session_with_turns(data, rows)
    sidecar = data / "journals" / f"{key}.coli_kv.lock"
    plant_link(sidecar, kind, outside)
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.state, info.problem) == ("active", None)
        assert any("symbolic link where a lock file belongs" in line for line in store.reconcile_actions)
        assert not os.path.islink(sidecar)
        store.append("chat", *rows.make(4))
        assert store.get("chat").n_records == 14
        assert store.journal_path("chat").read_bytes()[HEADER_BYTES:].startswith(image[HEADER_BYTES:])
    assert not os.path.lexists(outside)


def test_a_link_where_a_journal_lock_belongs_is_refused_while_the_store_runs(store, rows, tmp_path):
    new_session(store)
    store.append("chat", *rows.make(3))
    outside = tmp_path / "outside.lock"
    sidecar = store.journal_path("chat").with_name(f"{key_of(store, 'chat')}.coli_kv.lock")
    plant_link(sidecar, OUT, outside)
    with pytest.raises(PathRefused, match="verify --repair"):
        store.append("chat", *rows.make(2))
    assert store.get("chat").state == "active" and not outside.exists()
    assert any("symbolic link" in line for line in store.reconcile())  # what `kvstore verify --repair` runs
    store.append("chat", *rows.make(2))
    assert store.get("chat").n_records == 5


@pytest.mark.parametrize("suffix", [".write", ".read"])
@pytest.mark.parametrize("kind", [OUT, LOOP])
def test_a_link_where_a_session_lock_belongs_is_removed_on_open(tmp_path, suffix, kind):
    data, outside, rows = tmp_path / "data", tmp_path / "outside", Rows(4)
    key, _ = session_with_turns(data, rows)
    plant_link(data / "locks" / f"{key}{suffix}", kind, outside)
    with SessionStore(data) as store:
        store.append("chat", *rows.make(1))
        store.park("chat")
        store.unpark("chat")
        assert store.get("chat").n_records == 11
    assert not os.path.lexists(outside)


@pytest.mark.parametrize("kind", [OUT, LOOP])
def test_a_linked_journal_damages_its_session_not_the_store(tmp_path, kind):
    data, outside, rows = tmp_path / "data", tmp_path / "outside.coli_kv", Rows(5)
    key, image = session_with_turns(data, rows)
    with SessionStore(data) as store:
        store.create("bob", GEOMETRY, store.get("chat").tier, MODEL, session_id="other")
    journal = data / "journals" / f"{key}.coli_kv"
    moved = tmp_path / "kept.coli_kv"
    os.replace(journal, moved)
    plant_link(journal, kind, outside)
    with SessionStore(data) as store:  # one hostile file never keeps the store from opening
        info = store.get("chat")
        assert info.state == "damaged" and "symbolic link" in info.problem
        assert store.get("other").state == "active"
        with pytest.raises(SessionDamaged, match="symbolic link"):
            store.resume("chat")
    assert not os.path.lexists(outside)
    os.unlink(journal)
    os.replace(moved, journal)
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.state, info.problem, info.n_records) == ("active", None, 10)
        assert store.resume("chat").records.record_bytes() == image[HEADER_BYTES:]


@pytest.mark.parametrize("folder", ["locks", "journals", "archive"])
def test_a_folder_swapped_for_a_link_while_the_store_runs_leads_nothing_outside(tmp_path, folder):
    """Lock files and journals are opened relative to the folders the store opened (``openat``);
    a session file's path is handed out only while its folder is still that folder."""
    data, outside, moved, rows = tmp_path / "data", tmp_path / "outside", tmp_path / "moved", Rows(13)
    outside.mkdir()
    with SessionStore(data) as store:
        new_session(store)
        store.append("chat", *rows.make(3))
        new_session(store, "parked")
        store.append("parked", *rows.make(2))
        store.park("parked")
        image = store.journal_path("chat").read_bytes()
        os.replace(data / folder, moved)
        os.symlink(outside, data / folder)
        calls = {
            "append": lambda: store.append("chat", *rows.make(1)),
            "resume": lambda: store.resume("chat"),
            "verify": lambda: store.verify("chat"),
            "park": lambda: store.park("chat"),
            "unpark": lambda: store.unpark("parked"),
            "create": lambda: new_session(store, "new"),
        }
        refused = []
        for name, call in calls.items():
            try:
                call()
            except PathRefused as exc:
                assert f"{data / folder} was replaced" in exc.reason, exc.reason
                refused.append(name)
        if folder == "locks":
            assert refused == []  # the locks are taken in the folder the store opened, wherever it is now
        else:
            assert refused, "a call went through the swapped folder"
        assert sorted(p.name for p in outside.iterdir()) == []
        assert all(store.get(sid).state in ("active", "parked") for sid in ("chat", "parked"))
    os.unlink(data / folder)
    os.replace(moved, data / folder)
    with SessionStore(data) as store:
        assert {store.get(sid).problem for sid in ("chat", "parked")} == {None}
        if store.get("chat").state == "parked":
            store.unpark("chat")
        store.append("chat", *rows.make(1))
        assert store.journal_path("chat").read_bytes()[HEADER_BYTES:].startswith(image[HEADER_BYTES:])


@pytest.mark.parametrize("place", ["locks/.write", "locks/.read", "journals/.coli_kv.lock", "journals/.coli_kv"])
@pytest.mark.parametrize("kind", ["empty_folder", "full_folder", "fifo"])
def test_something_not_a_file_where_a_session_file_belongs_is_refused_never_waited_on(tmp_path, place, kind):
    data, rows = tmp_path / "data", Rows(12)
    key, image = session_with_turns(data, rows)
    folder, suffix = place.split("/")
    target = data / folder / f"{key}{suffix}"
    kept = tmp_path / "kept"
    if os.path.lexists(target):
        os.replace(target, kept)
    if kind == "fifo":
        os.mkfifo(target)  # opened for reading, it would wait for a writer forever
    else:
        target.mkdir()
        if kind == "full_folder":
            (target / "something").write_bytes(b"not kvstore's")
    with SessionStore(data, reconcile=False) as store:  # as a running store meets it
        needing = {  # the calls that open the file in that place
            ".write": [lambda: store.append("chat", *rows.make(1))],
            ".read": [lambda: store.park("chat")],
            ".coli_kv.lock": [lambda: store.append("chat", *rows.make(1))],
            ".coli_kv": [lambda: store.append("chat", *rows.make(1)), lambda: store.resume("chat")],
        }[suffix]
        for call in needing:
            with pytest.raises(PathRefused, match="not a regular file|is a folder"):
                call()
    with SessionStore(data) as store:  # opening never fails on it
        info = store.get("chat")
        removable = suffix != ".coli_kv" and kind != "full_folder"
        if suffix == ".coli_kv":
            assert info.state == "damaged" and "not a regular file" in info.problem
        else:
            assert (info.state, info.problem) == ("active", None)
            assert os.path.isfile(target) or not os.path.lexists(target) if removable else target.is_dir()
    if target.is_dir():
        shutil.rmtree(target)
    elif os.path.lexists(target):
        os.unlink(target)
    if kept.exists():
        os.replace(kept, target)
    with SessionStore(data) as store:
        assert (store.get("chat").state, store.get("chat").problem) == ("active", None)
        store.append("chat", *rows.make(1))
        assert store.journal_path("chat").read_bytes()[HEADER_BYTES:].startswith(image[HEADER_BYTES:])


# ---------------------------------------------------------------------------- stale sidecars
def test_stale_sidecars_are_removed_on_open_and_live_ones_kept(tmp_path):
    data, rows = tmp_path / "data", Rows(6)
    key, _ = session_with_turns(data, rows)
    ghost = key.replace("chat", "ghost", 1)  # a session that does not exist (deleted, or never created)
    locks, journals = data / "locks", data / "journals"
    for path in (locks / f"{ghost}.write", locks / f"{ghost}.read", journals / f"{ghost}.coli_kv.lock"):
        path.write_bytes(b"")
    pid = dead_pid()
    stale_temps = [locks / f".x.tmp-{pid}-1", data / f".keys.json.tmp-{pid}-2"]
    live_temp = data / f".keys.json.tmp-{os.getpid()}-3"  # this process still runs: its file stays
    for path in (*stale_temps, live_temp):
        path.write_bytes(b"half")
    kept = [locks / f"{key}.write", journals / f"{key}.coli_kv.lock"]
    for path in kept:
        path.touch()
    with SessionStore(data) as store:
        actions = store.reconcile_actions
        assert store.get("chat").state == "active"
    assert any(f"lock files of {ghost!r}" in line for line in actions), actions
    assert any(f"journals/{ghost}.coli_kv.lock" in line for line in actions), actions
    assert sum("left by a writer that no longer runs" in line for line in actions) == 2, actions
    assert sorted(p.name for p in locks.iterdir() if ghost in p.name) == []
    assert not (journals / f"{ghost}.coli_kv.lock").exists()
    assert not any(p.exists() for p in stale_temps) and live_temp.exists()
    assert all(p.exists() for p in kept)
    with SessionStore(data) as store:
        assert store.reconcile_actions == []


def test_a_stale_lock_someone_holds_is_left_to_them(tmp_path):
    data = tmp_path / "data"
    key, _ = session_with_turns(data, Rows(10), turns=0)
    ghost = key.replace("chat", "ghost", 1)  # no such session
    held = data / "locks" / f"{ghost}.write"
    with FileLock(held, timeout=0):  # another open file description: the store's try fails
        with SessionStore(data) as store:
            assert store.reconcile_actions == []
            assert held.exists()
    with SessionStore(data) as store:
        assert store.reconcile_actions == [f"removed the lock files of {ghost!r} in locks/: no such session"]
    assert not held.exists()


@pytest.mark.parametrize("holder", ["journal_lock", "session_lock"])
def test_a_live_processs_temporary_journal_file_goes_only_once_nobody_holds_the_journal(tmp_path, holder):
    """A temporary file of a journal whose writer still runs (e.g. the previous journal a migrate
    kept and could not remove) is removed once neither the session's write lock nor the journal's
    writer lock is held: every writer of such a file holds one of them."""
    data = tmp_path / "data"
    key, image = session_with_turns(data, Rows(14))
    journal = data / "journals" / f"{key}.coli_kv"
    temp = journal.with_name(f".{journal.name}.tmp-{os.getpid()}-7")  # this process runs: no dead pid
    temp.write_bytes(image)
    lock = journal.with_name(journal.name + ".lock") if holder == "journal_lock" else data / "locks" / f"{key}.write"
    with FileLock(lock, timeout=0):  # a rewrite in flight, as another process would hold it
        with SessionStore(data) as store:
            assert not any(temp.name in line for line in store.reconcile_actions)
        assert temp.exists()
    with SessionStore(data) as store:
        assert f"removed journals/{temp.name}: a temporary file no writer holds" in store.reconcile_actions
        assert store.get("chat").state == "active"
        assert store.journal_path("chat").read_bytes() == image
    assert not temp.exists()


def test_a_dangling_journal_lock_beside_a_session_marked_damaged_is_cleaned_and_the_session_given_back(tmp_path):
    """The session marked damaged while a dangling link stood where its journal's lock belongs (as
    the journal's open used to fail on it) is active again on the next open, and the link is gone."""
    data, outside, rows = tmp_path / "data", tmp_path / "outside" / "nowhere.lock", Rows(15)
    key, image = session_with_turns(data, rows)
    journal = data / "journals" / f"{key}.coli_kv"
    os.replace(journal, tmp_path / "kept")
    with SessionStore(data) as store:
        assert store.get("chat").state == "damaged"
    os.replace(tmp_path / "kept", journal)
    plant_link(journal.with_name(journal.name + ".lock"), OUT, outside)  # dangling: its folder does not exist
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.state, info.problem) == ("active", None), info
        assert any("symbolic link where a lock file belongs" in line for line in store.reconcile_actions)
        store.append("chat", *rows.make(2))
    assert not os.path.islink(journal.with_name(journal.name + ".lock"))
    assert not os.path.lexists(outside.parent)


# ---------------------------------------------------------------------------- damage that goes away
def test_a_damaged_session_whose_journal_comes_back_is_active_again(tmp_path):
    data, rows = tmp_path / "data", Rows(7)
    key, image = session_with_turns(data, rows, turns=3)
    journal = data / "journals" / f"{key}.coli_kv"
    backup = tmp_path / "backup.coli_kv"
    os.replace(journal, backup)
    with SessionStore(data) as store:
        assert store.get("chat").state == "damaged"
    shutil.copyfile(backup, journal)
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.state, info.problem, info.n_records, info.watermark) == ("active", None, 15, 15)
        assert any("sound again" in line for line in store.reconcile_actions)
        assert store.verify("chat").ok
        assert store.resume("chat").records.record_bytes() == image[HEADER_BYTES:]
        store.append("chat", *rows.make(2))


@pytest.mark.parametrize("change", ["flipped", "other_model", "both_files"])
def test_a_file_that_comes_back_changed_keeps_the_session_damaged(tmp_path, change):
    data, rows = tmp_path / "data", Rows(8)
    key, image = session_with_turns(data, rows, turns=3)
    journal = data / "journals" / f"{key}.coli_kv"
    journal.unlink()
    with SessionStore(data) as store:
        problem = store.get("chat").problem
    if change == "flipped":
        damaged = bytearray(image)
        damaged[HEADER_BYTES + 40] ^= 0x10
        journal.write_bytes(bytes(damaged))
    elif change == "other_model":
        with SessionStore(tmp_path / "elsewhere") as other:
            other.create("alice", dataclasses.replace(GEOMETRY, vocab=2000), tiers.FP8, MODEL, session_id="chat")
            shutil.copyfile(other.journal_path("chat"), journal)
    else:
        journal.write_bytes(image)
        (data / "archive" / f"{key}.coli_kv.zst").write_bytes(b"which one is the truth?")
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.state, info.problem) == ("damaged", problem)
        with pytest.raises(SessionDamaged):
            store.resume("chat")


def test_a_parked_session_whose_archive_comes_back_is_parked_again(tmp_path):
    data, rows = tmp_path / "data", Rows(9)
    key, image = session_with_turns(data, rows)
    with SessionStore(data) as store:
        store.park("chat")
    archive = data / "archive" / f"{key}.coli_kv.zst"
    backup = tmp_path / "backup.zst"
    os.replace(archive, backup)
    with SessionStore(data) as store:
        with pytest.raises(SessionDamaged):
            store.unpark("chat")
        assert store.get("chat").state == "damaged"
    os.replace(backup, archive)
    with SessionStore(data) as store:
        assert (store.get("chat").state, store.get("chat").problem) == ("parked", None)
        store.unpark("chat")
        assert store.resume("chat").records.record_bytes() == image[HEADER_BYTES:]
