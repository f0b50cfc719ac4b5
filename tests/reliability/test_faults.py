"""Fault injection: ENOSPC/EIO from every write-path system call, one call at a time.

Each operation is first run cleanly to count its calls, then re-run once per call with that call
failing (and, for writes, a short write before the failure). The operation must fail with a typed
error, leave the file exactly as it was before or exactly as the operation would have left it,
and the next successful append must complete the tail.
"""

import errno
import os

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import KVStoreError
from kvstore.export import export
from kvstore.filerewrite import migrate_file, repair_file
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Header
from kvstore.journal import KVFile
from reliability.workload import GEOMETRY, expected_records, turn_rows

PATCHED = ("pwrite", "write", "fsync", "fdatasync", "ftruncate", "replace", "link", "rename", "unlink")


class Faults:
    """Counts the wrapped calls; makes call number ``fail_at`` raise (after a short write)."""

    def __init__(self, monkeypatch, fail_at=None, code=errno.ENOSPC):
        self.calls = 0
        self.fail_at = fail_at
        self.code = code
        self.hit = None
        for name in PATCHED:
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                self.hit = name
                if name == "pwrite" and len(args[1]) > 1:
                    real(args[0], bytes(args[1])[: len(args[1]) // 2], args[2])  # a short write first
                raise OSError(self.code, os.strerror(self.code))
            return real(*args, **kwargs)

        return call


def fresh_journal(path, tier, turns=2, seed=1):
    if path.exists():
        path.unlink()
    with KVFile.create(path, GEOMETRY, tier) as journal:
        for t in range(turns):
            journal.append(*turn_rows(seed, t))


def count_calls(monkeypatch, action):
    with monkeypatch.context() as m:
        faults = Faults(m)
        action()
        return faults.calls


def sweep(monkeypatch, setup, action, check, record=None):
    """Run ``action`` once per call site with that call failing; ``check(raised)`` after each.

    ``record(faults=..., typed=...)`` receives the counts (the measured figures)."""
    setup()
    total = count_calls(monkeypatch, action)
    assert total > 0
    hits = set()
    typed = 0
    for k in range(1, total + 1):
        for code in (errno.ENOSPC, errno.EIO):
            setup()
            raised = None
            with monkeypatch.context() as m:
                faults = Faults(m, fail_at=k, code=code)
                try:
                    action()
                except KVStoreError as exc:
                    raised = exc
                except OSError as exc:  # an untyped error escaping is a defect
                    pytest.fail(f"call {k} ({faults.hit}) raised an untyped {exc!r}")
                hits.add(faults.hit)
            check(raised)
            typed += raised is not None
    if record is not None:
        record(faults_injected=2 * total, typed_errors=typed, data_lost=0)
    return total, hits


@pytest.mark.parametrize("tier", [tiers.F32, tiers.FP8, tiers.INT4], ids=lambda t: t.describe())
def test_append_faults(tmp_path, monkeypatch, figures, tier):
    path = tmp_path / "j.coli_kv"
    before = expected_records(1, 2, tier)
    after = expected_records(1, 3, tier)
    state = {}

    def setup():
        if "journal" in state:
            state["journal"].close()
        fresh_journal(path, tier)
        state["journal"] = KVFile.open(path, writable=True)

    def action():
        state["journal"].append(*turn_rows(1, 2))

    def check(raised):
        journal = state["journal"]
        loaded = coli_kv.load(path)
        if raised is not None:
            assert loaded.records.tobytes() == before.tobytes()
        else:
            assert loaded.records.tobytes() == after.tobytes()
        # The next append completes the tail (rewrites it rather than skipping it).
        if raised is not None:
            journal.append(*turn_rows(1, 2))
        journal.append(*turn_rows(1, 3))
        journal.close()
        assert coli_kv.load(path).records.tobytes() == expected_records(1, 4, tier).tobytes()

    total, hits = sweep(
        monkeypatch, setup, action, check, lambda **c: figures.add("journal_faults", f"append_{tier.describe()}", **c)
    )
    assert {"pwrite", "fsync"} <= hits


def test_truncate_faults(tmp_path, monkeypatch, figures):
    path = tmp_path / "j.coli_kv"
    tier = tiers.FP8
    full = expected_records(1, 3, tier)
    keep = 5
    state = {}

    def setup():
        if "journal" in state:
            state["journal"].close()
        fresh_journal(path, tier, turns=3)
        state["journal"] = KVFile.open(path, writable=True)

    def check(raised):
        loaded = coli_kv.load(path)
        assert loaded.n in ((full.shape[0],) if raised else ()) + (keep,)
        assert loaded.records.tobytes() == full[: loaded.n].tobytes()
        journal = state["journal"]
        assert journal.truncate(keep) == keep
        journal.append(*turn_rows(1, 9))
        journal.close()
        want = np.concatenate([full[:keep], expected_records(1, 1, tier, first_turn=9)])
        assert coli_kv.load(path).records.tobytes() == want.tobytes()

    sweep(
        monkeypatch,
        setup,
        lambda: state["journal"].truncate(keep),
        check,
        lambda **c: figures.add("journal_faults", "truncate", **c),
    )


@pytest.mark.parametrize("tier", [tiers.FP8, tiers.polar(4)], ids=lambda t: t.describe())
def test_lazy_upgrade_faults(tmp_path, monkeypatch, figures, tier):
    path = tmp_path / "j.coli_kv"
    v1 = expected_records(1, 2, tiers.F32)
    original = Header(GEOMETRY, tiers.F32, v1.shape[0]).to_bytes() + v1.tobytes()
    upgraded = expected_records(1, 3, tier)
    state = {}

    def setup():
        if "journal" in state:
            state["journal"].close()
        path.write_bytes(original)
        state["journal"] = KVFile.open(path, tier=tier, writable=True)

    def check(raised):
        loaded = coli_kv.load(path)
        if raised is not None and loaded.tier == tiers.F32:
            assert path.read_bytes() == original
        else:  # the rename happened (a failure after it, e.g. the directory fsync, is still reported)
            assert loaded.records.tobytes() == upgraded.tobytes()
        journal = state["journal"]
        if loaded.tier == tiers.F32:
            journal.append(*turn_rows(1, 2))
        journal.close()
        assert coli_kv.load(path).records.tobytes() == upgraded.tobytes()
        leftovers = [p.name for p in path.parent.iterdir() if ".tmp-" in p.name]
        assert leftovers == [], leftovers

    sweep(
        monkeypatch,
        setup,
        lambda: state["journal"].append(*turn_rows(1, 2)),
        check,
        lambda **c: figures.add("journal_faults", f"lazy_upgrade_{tier.describe()}", **c),
    )


def test_create_faults(tmp_path, monkeypatch, figures):
    path = tmp_path / "new.coli_kv"

    def setup():
        for p in tmp_path.iterdir():
            p.unlink()

    def check(raised):
        if path.exists():
            assert coli_kv.load(path).n == 0  # never a torn header
        leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert leftovers == []
        if not path.exists():
            KVFile.create(path, GEOMETRY, tiers.FP8).close()

    sweep(
        monkeypatch,
        setup,
        lambda: KVFile.create(path, GEOMETRY, tiers.FP8).close(),
        check,
        lambda **c: figures.add("journal_faults", "create", **c),
    )


def test_migrate_repair_export_faults(tmp_path, monkeypatch, figures):
    src = tmp_path / "src.coli_kv"
    rows = expected_records(3, 3, tiers.F32)
    src.write_bytes(Header(GEOMETRY, tiers.F32, rows.shape[0]).to_bytes() + rows.tobytes())
    original = src.read_bytes()
    dst = tmp_path / "dst.coli_kv"
    converted = expected_records(3, 3, tiers.FP8)
    want = Header(GEOMETRY, tiers.FP8, converted.shape[0]).to_bytes() + converted.tobytes()

    def check_migrate(raised):
        assert src.read_bytes() == original
        assert not dst.exists() or dst.read_bytes() == want

    def setup_migrate():
        dst.unlink(missing_ok=True)

    sweep(
        monkeypatch,
        setup_migrate,
        lambda: migrate_file(src, dst, tiers.FP8),
        check_migrate,
        lambda **c: figures.add("journal_faults", "migrate_file", **c),
    )

    damaged = bytearray(original)
    damaged += b"\x01" * 17  # a torn tail
    target = tmp_path / "rep.coli_kv"
    backup = tmp_path / "rep.coli_kv.bak"

    def setup_repair():
        target.write_bytes(bytes(damaged))
        backup.unlink(missing_ok=True)

    def check_repair(raised):
        assert target.read_bytes() in (bytes(damaged), original)
        assert not backup.exists() or backup.read_bytes() == bytes(damaged)

    sweep(
        monkeypatch,
        setup_repair,
        lambda: repair_file(target),
        check_repair,
        lambda **c: figures.add("journal_faults", "repair_file", **c),
    )

    out = tmp_path / "x.npz"

    def check_export(raised):
        if out.exists():
            with np.load(out) as z:
                assert z["L"].shape == (GEOMETRY.n_layers, rows.shape[0], GEOMETRY.kv_lora)

    sweep(
        monkeypatch,
        lambda: out.unlink(missing_ok=True),
        lambda: export(coli_kv.load(src), out),
        check_export,
        lambda **c: figures.add("journal_faults", "export", **c),
    )
