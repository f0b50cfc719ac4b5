"""One journal, several names (issue 42, items 1 and 2).

The writer lock was a ``<path>.lock`` sidecar named after the path the caller gave, so a writer
through ``real/x.coli_kv`` and one through ``link.coli_kv`` (a symbolic link to it) both held "the"
lock: appends of 5, 3 and 4 records left 9 in the file, and the file looked clean. The sidecar is now
named after the journal's real path, so every alias meets the same lock; and a journal named through
a link is rewritten (a lazy upgrade) and created where the link leads, the link left as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import JournalLocked
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.journal import KVFile, real_path, writer_lock

GEOMETRY = Geometry(n_layers=2, kv_lora=16, qk_rope=8, index_hd=0, nic=0, vocab=100)


def rows(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, GEOMETRY.vocab, n),
        rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.kv_lora)).astype(np.float32),
        rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.qk_rope)).astype(np.float32),
    )


@pytest.fixture
def aliases(tmp_path):
    """``real/x.coli_kv`` (an empty fp8 journal), ``link.coli_kv`` -> it, and ``dir/x.coli_kv``
    through a linked folder ``dir`` -> ``real``."""
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "x.coli_kv"
    KVFile.create(real, GEOMETRY, tiers.FP8).close()
    link = tmp_path / "link.coli_kv"
    link.symlink_to("real/x.coli_kv")
    (tmp_path / "dir").symlink_to("real")
    return real, link, tmp_path / "dir" / "x.coli_kv"


def test_every_name_of_a_journal_meets_the_one_writer_lock(aliases):
    real, link, through_folder = aliases
    for first, second in ((real, link), (link, real), (real, through_folder), (through_folder, link)):
        with KVFile.open(first, writable=True):
            with pytest.raises(JournalLocked, match="x.coli_kv is being written by another writer"):
                KVFile.open(second, writable=True, lock_timeout=0)
            with pytest.raises(JournalLocked):
                with writer_lock(second, timeout=0):
                    pass
        with KVFile.open(second, writable=True, lock_timeout=0) as journal:  # free again
            assert journal.target == real_path(real)
    assert sorted(p.name for p in real.parent.iterdir()) == ["x.coli_kv", "x.coli_kv.lock"]
    assert not (link.parent / "link.coli_kv.lock").exists()


def test_two_writers_through_two_names_take_turns_and_lose_no_append(aliases):
    real, link, _ = aliases
    first = KVFile.open(real, writable=True)
    assert first.append(*rows(5, 1)) == 5
    second: list[int] = []

    def other_writer():
        with KVFile.open(link, writable=True, lock_timeout=30) as journal:  # waits for the first
            second.append(journal.append(*rows(3, 2)))

    thread = threading.Thread(target=other_writer)
    thread.start()
    time.sleep(0.3)
    assert second == []  # still waiting
    assert first.append(*rows(4, 3)) == 9
    first.close()
    thread.join(30)
    assert second == [12]
    loaded = coli_kv.load(real)
    assert loaded.n == 12 and not loaded.problems.damaged
    expected = np.concatenate([rows(5, 1)[0], rows(4, 3)[0], rows(3, 2)[0]])
    assert loaded.tokens.tolist() == expected.tolist()


def test_a_writer_in_another_process_is_kept_off_through_a_link(aliases):
    real, link, _ = aliases
    child = (
        "import sys\n"
        "from kvstore.errors import JournalLocked\n"
        "from kvstore.journal import KVFile\n"
        "try:\n"
        "    KVFile.open(sys.argv[1], writable=True, lock_timeout=0)\n"
        "except JournalLocked:\n"
        "    sys.exit(3)\n"
    )
    with KVFile.open(real, writable=True):
        done = subprocess.run([sys.executable, "-c", child, str(link)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr


def test_a_lazy_upgrade_through_a_link_rewrites_the_file_it_leads_to(tmp_path):
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "v1.coli_kv"
    with KVFile.create(real, GEOMETRY, tiers.F32) as journal:
        journal.append(*rows(4, 1))
    link = tmp_path / "talk.coli_kv"
    link.symlink_to(real)
    with KVFile.open(link, tier=tiers.FP8, writable=True) as journal:
        assert journal.append(*rows(2, 2)) == 6  # the first append rewrites the file as v2
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link is still the link
    loaded = coli_kv.load(real)
    assert loaded.tier == tiers.FP8 and loaded.n == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real", "talk.coli_kv"]  # no copy beside the link
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1.coli_kv", "v1.coli_kv.lock"]


def test_creating_through_a_link_to_no_file_creates_the_file_it_names(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "new.coli_kv"
    link.symlink_to("real/made.coli_kv")
    with KVFile.create(link, GEOMETRY, tiers.INT4) as journal:
        journal.append(*rows(3, 1))
    assert link.is_symlink() and coli_kv.load(tmp_path / "real" / "made.coli_kv").n == 3
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["made.coli_kv", "made.coli_kv.lock"]
