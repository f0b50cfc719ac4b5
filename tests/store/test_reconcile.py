"""Crashes between the journal and the index, injected in a real child process, then a reopen."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import SessionDamaged, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.journal import KVFile
from kvstore.store import SessionStore
from store.support import Rows, journal_body, new_session

TESTS_DIR = Path(__file__).resolve().parents[1]
CRASH = 9


def run_child(data: Path, body: str, *, check_crash: bool = True) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter with ``store``, ``rows`` (Rows(1)) and ``new_session`` ready."""
    code = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from kvstore.store import SessionStore
        from store.support import Rows, new_session
        store = SessionStore(Path(sys.argv[1]))
        rows = Rows(1)
        """
    ) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code, str(data)], env=env, capture_output=True, text=True, timeout=120)
    if check_crash:
        assert done.returncode == CRASH, done.stderr
    return done


def test_crash_after_journal_append_before_index_commit_rolls_back(tmp_path):
    data = tmp_path / "data"
    run_child(
        data,
        """
        new_session(store)
        store.append("chat", *rows.make(5))
        from kvstore.store.index import Index
        Index.put_turn = lambda *a, **k: os._exit(9)
        store.append("chat", *rows.make(3))
        """,
    )
    rows = Rows(1)
    first, second = rows.make(5), rows.make(3)
    assert coli_kv.load(data / "journals" / "chat~alice.coli_kv").n == 8  # the journal committed the 3 records
    with SessionStore(data) as store:
        assert any("rolled back 3 unacknowledged records" in line for line in store.reconcile_actions)
        info = store.get("chat")
        assert (info.n_records, info.watermark, info.size_bytes) == (5, 5, HEADER_BYTES + 5 * info.record_bytes)
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, first)
        store.append("chat", *second)  # the client's retry does not duplicate rows
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, first, second)
        assert store.verify("chat").ok


def test_crash_between_truncate_commit_and_cut_finishes_the_cut(tmp_path):
    data = tmp_path / "data"
    run_child(
        data,
        """
        new_session(store)
        store.append("chat", *rows.make(6))
        store.append("chat", *rows.make(6))
        from kvstore.journal import KVFile
        KVFile.truncate = lambda *a, **k: os._exit(9)
        store.truncate("chat", 4)
        """,
    )
    rows = Rows(1)
    first = rows.make(6)
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.n_records, info.watermark) == (4, 4)
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, first)[: 4 * info.record_bytes]
        assert store.verify("chat").ok


@pytest.mark.parametrize(
    "patch, expected_state",
    [
        # the archive is written, the index still says active: the archive is a leftover
        (
            "Index.update = lambda self, txn, sid, **c: os._exit(9) if c.get('state') == 'parked' else original(self, txn, sid, **c)",
            "active",
        ),
        # the index says parked, the journal was not unlinked yet: the journal is the leftover
        (
            "import pathlib; pathlib.Path.unlink = lambda self, *a, **k: os._exit(9) if self.name.endswith('.coli_kv') else None",
            "parked",
        ),
    ],
    ids=["before-commit", "after-commit"],
)
def test_crash_during_park(tmp_path, patch, expected_state):
    data = tmp_path / "data"
    run_child(
        data,
        f"""
        new_session(store)
        store.append("chat", *rows.make(30))
        from kvstore.store.index import Index
        original = Index.update
        {patch}
        store.park("chat")
        """,
    )
    rows = Rows(1)
    expected = rows.encode(tiers.FP8, rows.make(30))
    with SessionStore(data) as store:
        info = store.get("chat")
        assert info.state == expected_state
        assert store.journal_path("chat", owner="alice").exists() == (expected_state == "active")
        assert store.archive_path("chat", owner="alice").exists() == (expected_state == "parked")
        assert store.usage()["used_bytes"] == info.size_bytes
        assert store.resume("chat").records.record_bytes() == expected
        assert store.verify("chat").ok


def test_crash_during_unpark_before_commit(tmp_path):
    data = tmp_path / "data"
    run_child(
        data,
        """
        new_session(store)
        store.append("chat", *rows.make(30))
        store.park("chat")
        from kvstore.store.index import Index
        original = Index.update
        Index.update = lambda self, txn, sid, **c: os._exit(9) if c.get("state") == "active" else original(self, txn, sid, **c)
        store.unpark("chat")
        """,
    )
    rows = Rows(1)
    with SessionStore(data) as store:
        assert any("interrupted park/unpark" in line for line in store.reconcile_actions)
        assert store.get("chat").state == "parked" and not store.journal_path("chat", owner="alice").exists()
        assert store.unpark("chat").state == "active"
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, rows.make(30))


def test_crash_during_delete_is_finished_on_open(tmp_path):
    data = tmp_path / "data"
    run_child(
        data,
        """
        new_session(store)
        store.append("chat", *rows.make(3))
        from kvstore.store.removal import Removal
        Removal.remove_files = lambda *a: os._exit(9)
        store.delete("chat")
        """,
    )
    with SessionStore(data) as store:
        assert any("interrupted delete" in line for line in store.reconcile_actions)
        with pytest.raises(SessionNotFound):
            store.get("chat")
        assert not store.journal_path("chat", owner="alice").exists() and store.usage()["used_bytes"] == 0


def test_unindexed_journals_are_removed_when_empty_and_kept_otherwise(tmp_path):
    data = tmp_path / "data"
    run_child(
        data,
        """
        from kvstore.store.index import Index
        Index.put = lambda *a, **k: os._exit(9)
        new_session(store)
        """,
    )
    assert (data / "journals" / "chat~alice.coli_kv").exists()
    rows = Rows(1)
    stray = data / "journals" / "stray.coli_kv"
    with KVFile.create(stray, rows.geometry, tiers.FP8) as journal:
        journal.append(*rows.make(2))
    (data / "journals" / ".chat.coli_kv.tmp-999999999-1").write_bytes(b"partial")
    with SessionStore(data) as store:
        assert not store.journal_path("chat", owner="alice").exists() and not stray.exists()
        kept = list((data / "lost+found").iterdir())
        assert len(kept) == 1 and coli_kv.load(kept[0]).n == 2
        assert not (data / "journals" / ".chat.coli_kv.tmp-999999999-1").exists()
        assert new_session(store).n_records == 0


def test_a_journal_that_lost_its_tail_clamps_the_index_to_whole_turns(tmp_path):
    data = tmp_path / "data"
    rows = Rows(1)
    chunks = [rows.make(5), rows.make(5), rows.make(5)]
    with SessionStore(data) as store:
        new_session(store)
        for chunk in chunks:
            store.append("chat", *chunk)
    with KVFile.open(data / "journals" / "chat~alice.coli_kv", writable=True) as journal:
        journal.truncate(12)  # outside kvstore: the third turn is now partial
    with SessionStore(data) as store:
        info = store.get("chat")
        assert (info.n_records, info.watermark) == (10, 10) and "kept the 10" in info.problem
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, *chunks[:2])
        assert store.verify("chat").ok


def test_a_missing_journal_marks_the_session_damaged(tmp_path):
    data = tmp_path / "data"
    with SessionStore(data) as store:
        new_session(store)
        store.append("chat", *Rows(1).make(3))
    (data / "journals" / "chat~alice.coli_kv").unlink()
    with SessionStore(data) as store:
        info = store.get("chat")
        assert info.state == "damaged" and "missing" in info.problem
        with pytest.raises(SessionDamaged, match="missing"):
            store.resume("chat")
        with pytest.raises(SessionDamaged):
            store.append("chat", *Rows(2).make(1))
        store.delete("chat")
        assert store.list() == []


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_mid_conversation_loses_no_acknowledged_turn(tmp_path, trial):
    data = tmp_path / "data"
    rng = random.Random(trial)
    sizes = [rng.randint(1, 40) for _ in range(200)]
    code = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from kvstore.store import SessionStore
        from store.support import Rows, new_session
        store = SessionStore(Path(sys.argv[1]))
        rows = Rows(1)
        new_session(store)
        print("ack 0", flush=True)
        total = 0
        for n in {sizes!r}:
            total = store.append("chat", *rows.make(n)).info.n_records
            print("ack", total, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    child = subprocess.Popen([sys.executable, "-c", code, str(data)], env=env, stdout=subprocess.PIPE, text=True)
    stop_after = rng.randint(2, 25)
    acked = 0
    for _ in range(stop_after):
        line = child.stdout.readline()
        if not line:
            break
        acked = int(line.split()[1])
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    rows = Rows(1)
    expected_chunks = [rows.make(n) for n in sizes]
    boundaries = np.cumsum([0] + sizes)
    with SessionStore(data) as store:
        info = store.get("chat")
        assert info.n_records >= acked and info.n_records in boundaries
        kept = int(np.searchsorted(boundaries, info.n_records))
        assert journal_body(store, "chat") == rows.encode(tiers.FP8, *expected_chunks[:kept])
        assert store.verify("chat").ok and info.watermark == info.n_records
