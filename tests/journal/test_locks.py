"""kvstore.locks: the one flock wrapper (journal writers and the session store) and the pid check."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import JournalLocked, PathRefused
from kvstore.formats.coli_kv import Geometry
from kvstore.journal import KVFile, writer_lock
from kvstore.locks import FileLock, pid_alive

GEOMETRY = Geometry(n_layers=1, kv_lora=32, qk_rope=8, index_hd=0, nic=0, vocab=100)


def test_exclusive_and_shared(tmp_path):
    path = tmp_path / "s.lock"
    with FileLock(path) as held:
        assert held.held and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(JournalLocked, match="busy: try later"):  # the waiter's reason
            FileLock(path, timeout=0, busy_reason="busy: try later").acquire()
        with pytest.raises(JournalLocked):
            FileLock(path, shared=True, timeout=0.02).acquire()
    assert not held.held
    with FileLock(path, shared=True), FileLock(path, shared=True, timeout=0):
        with pytest.raises(JournalLocked):
            FileLock(path, timeout=0).acquire()
    FileLock(path, timeout=0).acquire().release()


def test_a_waiter_follows_a_lock_file_unlinked_under_it(tmp_path):
    path = tmp_path / "s.write"
    first = FileLock(path).acquire()
    acquired = []
    waiter = threading.Thread(target=lambda: acquired.append(FileLock(path, timeout=5).acquire()))
    waiter.start()
    os.unlink(path)  # what delete does to a session's lock files
    first.release()
    waiter.join()
    second = acquired[0]
    assert second.held and os.path.exists(path)
    with pytest.raises(JournalLocked):  # one holder per name, on the inode the name now has
        FileLock(path, timeout=0).acquire()
    second.release()


def test_a_symbolic_link_is_never_followed(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "s.lock")
    with pytest.raises(PathRefused, match="symbolic link"):
        FileLock(tmp_path / "s.lock", timeout=0).acquire()
    assert target.read_bytes() == b"keep"


def test_the_journal_writer_lock_is_a_file_lock_on_its_sidecar(tmp_path):
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        assert journal.writable
        with pytest.raises(JournalLocked):
            FileLock(tmp_path / "s.coli_kv.lock", timeout=0).acquire()
        with pytest.raises(JournalLocked, match="s.coli_kv is being written by another writer"):
            with writer_lock(path, timeout=0):
                pass
    with writer_lock(path, timeout=0):
        with pytest.raises(JournalLocked):
            KVFile.open(path, writable=True, lock_timeout=0)
        with KVFile.open(path) as reader:  # readers take no lock
            assert reader.n_records == 0
    with KVFile.open(path, writable=True, lock_timeout=0) as journal:
        rows = np.zeros((1, 2, 32), np.float32), np.zeros((1, 2, 8), np.float32)
        assert journal.append(np.arange(2, dtype=np.int32), *rows) == 2


def test_pid_alive():
    assert pid_alive(os.getpid())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not pid_alive(int(child.stdout))
    assert pid_alive(1)  # init: exists, even where signalling it is not permitted
