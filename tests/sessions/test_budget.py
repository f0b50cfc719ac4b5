"""Disk budget: LRU eviction, the hard limit, and the limit under concurrent threads and processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import BudgetExceeded, SessionNotFound
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Tier
from kvstore.sessions import SessionStore
from kvstore import tiers
from sessions.support import GEOMETRY, Rows, new_session

TESTS_DIR = Path(__file__).resolve().parents[1]
REC = coli_kv.record_bytes(GEOMETRY, tiers.FP8)


def files_bytes(data: Path) -> int:
    return sum(p.stat().st_size for folder in ("journals", "archive") for p in (data / folder).glob("*.coli_kv*") if not p.name.endswith(".lock"))


def test_hard_limit_refuses_and_writes_nothing(tmp_path):
    data = tmp_path / "data"
    limit = HEADER_BYTES + 10 * REC
    rows = Rows(1)
    with SessionStore(data, hard_limit_bytes=limit) as store:
        new_session(store)
        store.append("chat", *rows.make(6))
        before = store.journal_path("chat").read_bytes()
        with pytest.raises(BudgetExceeded, match="hard limit") as refused:
            store.append("chat", *rows.make(5))
        assert refused.value.http_status == 507
        assert store.journal_path("chat").read_bytes() == before and store.get("chat").n_records == 6
        store.append("chat", *rows.make(4))  # exactly fits
        assert store.usage()["used_bytes"] == limit == files_bytes(data)
        with pytest.raises(BudgetExceeded):
            new_session(store, "second")
        with pytest.raises(BudgetExceeded):
            store.fork("chat", new_id="copy")
        assert [s.id for s in store.list()] == ["chat"] and store.usage()["reserved_bytes"] == 0


def test_hard_limit_holds_under_concurrent_threads(tmp_path):
    data = tmp_path / "data"
    n_threads, turn = 8, 7
    limit = n_threads * HEADER_BYTES + 61 * turn * REC + REC  # not a multiple of anything the writers write
    with SessionStore(data, hard_limit_bytes=limit) as store:
        for i in range(n_threads):
            new_session(store, f"s{i}")
        successes = [0] * n_threads
        errors: list[BaseException] = []

        def writer(i: int) -> None:
            rows = Rows(100 + i)
            try:
                while True:
                    store.append(f"s{i}", *rows.make(turn))
                    successes[i] += 1
            except BudgetExceeded:
                return
            except BaseException as exc:  # anything else fails the test below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(successes) == 61  # every byte that fits was used, none past the limit
        for i in range(n_threads):
            assert store.get(f"s{i}").n_records == successes[i] * turn
        assert store.usage()["used_bytes"] == files_bytes(data) <= limit
        assert store.usage()["reserved_bytes"] == 0


def test_hard_limit_holds_across_processes(tmp_path):
    data = tmp_path / "data"
    n_procs, turn = 4, 5
    limit = n_procs * HEADER_BYTES + 23 * turn * REC
    with SessionStore(data, hard_limit_bytes=limit) as store:
        for i in range(n_procs):
            new_session(store, f"p{i}")
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from kvstore.errors import BudgetExceeded
        from kvstore.sessions import SessionStore
        from sessions.support import Rows
        store = SessionStore(Path(sys.argv[1]), hard_limit_bytes={limit})
        sid = sys.argv[2]
        rows = Rows(int(sys.argv[3]))
        done = 0
        try:
            while True:
                store.append(sid, *rows.make({turn}))
                done += 1
        except BudgetExceeded:
            print(done)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    children = [
        subprocess.Popen([sys.executable, "-c", code, str(data), f"p{i}", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(n_procs)
    ]
    counts = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0
        counts.append(int(out))
    assert sum(counts) == 23
    with SessionStore(data, hard_limit_bytes=limit) as store:
        assert [store.get(f"p{i}").n_records for i in range(n_procs)] == [c * turn for c in counts]
        assert store.usage()["used_bytes"] == files_bytes(data) <= limit


def test_reservations_of_dead_writers_are_released(tmp_path):
    data = tmp_path / "data"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    with SessionStore(data, hard_limit_bytes=HEADER_BYTES + 4 * REC) as store:
        new_session(store)
        with store.index.write() as txn:  # what a writer killed between reserve and commit leaves
            txn.put(b"0123456789abcdef", np.array([dead_pid, 10**9], dtype=">u8").tobytes(), db=store.index._db(b"reservations"))
        assert store.usage()["reserved_bytes"] == 10**9
        store.append("chat", *Rows(1).make(4))
        assert store.usage()["reserved_bytes"] == 0 and store.get("chat").n_records == 4


def compressible(n: int, seed: int):
    """Rows that zstd shrinks to almost nothing (the same row repeated), so parking frees space."""
    tokens, L, R, I = Rows(seed).make(n)
    return tokens, np.broadcast_to(L[:, :1], L.shape), np.broadcast_to(R[:, :1], R.shape), I * 0


def test_budget_parks_least_recently_used_then_deletes_parked(tmp_path):
    data = tmp_path / "data"
    size = HEADER_BYTES + 50 * REC
    with SessionStore(data, budget_bytes=3 * size) as store:
        for seed, sid in enumerate(("a", "b", "c")):
            new_session(store, sid)
            store.append(sid, *compressible(50, seed))
        assert [s.state for s in store.list()] == ["active"] * 3
        store.resume("a")  # a is now more recent than b and c
        new_session(store, "d")  # over budget by one header: b, the least recently used, is parked
        assert {s.id: s.state for s in store.list()} == {"a": "active", "b": "parked", "c": "active", "d": "active"}
        store.append("d", *compressible(50, 9))  # over again: c goes next, a stays
        assert {s.id: s.state for s in store.list()} == {"a": "active", "b": "parked", "c": "parked", "d": "active"}
        assert store.usage()["used_bytes"] <= 3 * size
        assert store.resume("c").reused_tokens == 50  # a parked session resumes: unparked, and a pays
        assert {s.id: s.state for s in store.list()} == {"a": "parked", "b": "parked", "c": "active", "d": "active"}
    with SessionStore(data, budget_bytes=size) as store:
        evicted = store.enforce_budget(keep=["d"])
        # c is the only active one not kept; then the parked ones go, least recently used first
        assert [(e.session_id, e.action) for e in evicted] == [
            ("c", "parked"),
            ("b", "deleted"),
            ("a", "deleted"),
            ("c", "deleted"),
        ]
        assert store.usage()["used_bytes"] <= size
        assert [s.id for s in store.list()] == ["d"] and store.resume("d").reused_tokens == 50
