"""Disk budget of the embedded store across processes (the backend-agnostic budget tests are in
``tests/conformance/store.py``): the hard limit held by processes sharing one LMDB index, and the
reservations a killed writer leaves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES
from kvstore.store import SessionStore
from store.support import GEOMETRY, Rows, files_bytes, new_session

TESTS_DIR = Path(__file__).resolve().parents[1]
REC = coli_kv.record_bytes(GEOMETRY, tiers.FP8)


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
        from kvstore.store import SessionStore
        from store.support import Rows
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
        subprocess.Popen(
            [sys.executable, "-c", code, str(data), f"p{i}", str(i)], env=env, stdout=subprocess.PIPE, text=True
        )
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
            txn.put(
                b"0123456789abcdef",
                np.array([dead_pid, 10**9], dtype=">u8").tobytes(),
                db=store.index._db(b"reservations"),
            )
        assert store.usage()["reserved_bytes"] == 10**9
        store.append("chat", *Rows(1).make(4))
        assert store.usage()["reserved_bytes"] == 0 and store.get("chat").n_records == 4
