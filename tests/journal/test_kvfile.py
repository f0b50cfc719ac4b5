import os
import stat
import struct

import numpy as np
import pytest

from kvstore import tiers
from kvstore.errors import CodecMismatch, FormatError, GeometryMismatch, JournalClosed, JournalLocked, JournalWriteError
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.journal import KVFile

GEOMETRY = Geometry(n_layers=3, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=500)
TIERS = [tiers.F32, tiers.BF16, tiers.FP8, tiers.INT4, tiers.polar(3)]


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GEOMETRY.vocab, n).astype(np.int32)
    L = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.kv_lora)).astype(np.float32)
    R = rng.standard_normal((GEOMETRY.n_layers, n, GEOMETRY.qk_rope)).astype(np.float32)
    I = rng.standard_normal((GEOMETRY.nic, n, GEOMETRY.index_hd)).astype(np.float32)
    return tokens, L, R, I


def expected_bytes(tier, *chunks):
    tokens = np.concatenate([c[0] for c in chunks])
    L = np.concatenate([c[1] for c in chunks], axis=1)
    R = np.concatenate([c[2] for c in chunks], axis=1)
    I = np.concatenate([c[3] for c in chunks], axis=1)
    return coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=tier.version, codec=tier.codec, bits=tier.bits)


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.describe())
def test_create_append_load_round_trip(tmp_path, tier):
    path = tmp_path / "s.coli_kv"
    first, second = rows(5, 1), rows(3, 2)
    with KVFile.create(path, GEOMETRY, tier) as journal:
        assert journal.n_records == 0
        assert journal.append(*first) == 5
        assert journal.append(*second) == 8
    assert path.read_bytes() == expected_bytes(tier, first, second)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with KVFile.open(path, geometry=GEOMETRY) as journal:
        records = journal.load()
    assert records.n == 8 and records.tier == tier


def test_create_never_clobbers(tmp_path):
    path = tmp_path / "s.coli_kv"
    KVFile.create(path, GEOMETRY, tiers.FP8).close()
    with pytest.raises(FileExistsError):
        KVFile.create(path, GEOMETRY, tiers.FP8)
    assert coli_kv.load(path).n == 0


def test_open_refuses_other_model_and_other_tier(tmp_path):
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        journal.append(*rows(2))
    other = Geometry(3, 32, 8, 4, 1, 501)
    with pytest.raises(GeometryMismatch, match="vocab"):
        KVFile.open(path, geometry=other)
    with pytest.raises(CodecMismatch, match="migrate"):
        KVFile.open(path, tier=tiers.INT4)
    with pytest.raises(CodecMismatch):
        KVFile.open(path, tier=tiers.F32)


@pytest.mark.parametrize("tier", [tiers.FP8, tiers.INT4, tiers.BF16], ids=lambda t: t.describe())
def test_lazy_upgrade_keeps_v1_until_first_append(tmp_path, tier):
    path = tmp_path / "s.coli_kv"
    first, second = rows(4, 3), rows(2, 4)
    with KVFile.create(path, GEOMETRY, tiers.F32) as journal:
        journal.append(*first)
    v1_bytes = path.read_bytes()
    with KVFile.open(path, geometry=GEOMETRY, tier=tier, writable=True) as journal:
        assert journal.upgrade_pending
        in_memory = journal.load()
        assert in_memory.tier == tier
        assert path.read_bytes() == v1_bytes  # untouched on load
        assert in_memory.records.tobytes() == expected_bytes(tier, first)[40:]
        journal.append(*second)
        assert not journal.upgrade_pending
    assert path.read_bytes() == expected_bytes(tier, first, second)


def test_upgrade_that_fails_to_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.F32) as journal:
        journal.append(*rows(4))
    before = path.read_bytes()
    journal = KVFile.open(path, tier=tiers.FP8, writable=True)

    def no_rename(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(JournalWriteError):
        journal.append(*rows(1, 9))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temp file removed
    journal.append(*rows(1, 9))
    journal.close()
    assert coli_kv.load(path).n == 5 and coli_kv.load(path).tier == tiers.FP8


def test_failed_fsync_keeps_the_commit_and_the_next_append_rewrites_the_tail(tmp_path, monkeypatch):
    path = tmp_path / "s.coli_kv"
    first, lost, third = rows(3, 1), rows(2, 2), rows(2, 3)
    journal = KVFile.create(path, GEOMETRY, tiers.FP8)
    journal.append(*first)
    real_fsync = os.fsync

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(JournalWriteError, match="committed records are intact"):
        journal.append(*lost)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert coli_kv.load(path).n == 3  # the data of `lost` may be on disk, but it is not committed
    assert journal.append(*third) == 5
    journal.close()
    assert path.read_bytes()[: 40 + 5 * coli_kv.load(path).header.rec_bytes] == expected_bytes(tiers.FP8, first, third)


def test_write_that_raises_half_way(tmp_path, monkeypatch):
    path = tmp_path / "s.coli_kv"
    first, second = rows(3, 5), rows(3, 6)
    journal = KVFile.create(path, GEOMETRY, tiers.F32)
    journal.append(*first)
    real_pwrite = os.pwrite
    calls = {"n": 0}

    def half_then_fail(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_pwrite(fd, bytes(data)[: len(data) // 2], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_fail)
    with pytest.raises(JournalWriteError):
        journal.append(*second)
    monkeypatch.undo()
    assert coli_kv.load(path).n == 3
    assert journal.append(*second) == 6
    journal.close()
    assert path.read_bytes() == expected_bytes(tiers.F32, first, second)


def test_crash_between_data_and_counter_is_invisible(tmp_path):
    path = tmp_path / "s.coli_kv"
    first, uncommitted = rows(3, 7), rows(2, 8)
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        journal.append(*first)
    # What a crash after the data fsync and before the counter write leaves behind.
    tail = expected_bytes(tiers.FP8, uncommitted)[40:]
    with open(path, "ab") as f:
        f.write(tail)
    records = coli_kv.load(path)
    assert records.n == 3 and records.problems.uncommitted == 2
    with KVFile.open(path, writable=True) as journal:
        assert journal.n_records == 3
        journal.append(*rows(1, 9))
    assert coli_kv.load(path).n == 4
    rec = coli_kv.load(path).header.rec_bytes
    assert path.read_bytes()[: 40 + 4 * rec] == expected_bytes(tiers.FP8, first, rows(1, 9))


def journal_rec(path):
    return coli_kv.load(path).header.rec_bytes


def test_truncate_clamps_to_committed_and_complete_records(tmp_path):
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        journal.append(*rows(5))
        assert journal.truncate(9) == 5
        assert journal.truncate(3) == 3
    assert coli_kv.load(path).n == 3
    assert os.path.getsize(path) == 40 + 3 * journal_rec(path)
    # Truncate inside a gap: the header claims 6 but only 3 records are physically there.
    blob = bytearray(path.read_bytes())
    struct.pack_into("<i", blob, 32, 6)
    path.write_bytes(bytes(blob))
    with KVFile.open(path, writable=True) as journal:
        assert journal.n_records == 3
        assert journal.truncate(5) == 3
    assert coli_kv.load(path).header.nrec == 3


def test_two_writers_never_interleave(tmp_path):
    path = tmp_path / "s.coli_kv"
    writer = KVFile.create(path, GEOMETRY, tiers.FP8)
    with pytest.raises(JournalLocked, match="another writer"):
        KVFile.open(path, writable=True, lock_timeout=0.05)
    with KVFile.open(path) as reader:  # readers take no lock
        assert reader.n_records == 0
        with pytest.raises(JournalClosed, match="read-only"):
            reader.append(*rows(1))
    writer.close()
    with KVFile.open(path, writable=True, lock_timeout=0.05) as second:
        assert second.append(*rows(1)) == 1


def test_append_records_validates_raw_bytes(tmp_path):
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        good = journal.encode(*rows(2))
        raw = good.tobytes()
        with pytest.raises(FormatError, match="whole number"):
            journal.append_records(raw[:-1])
        bad = good.copy()
        bad["token"][1] = GEOMETRY.vocab
        with pytest.raises(FormatError, match="token ids"):
            journal.append_records(bad.tobytes())
        bad = good.copy()
        bad["layers"]["Ls"][0, 1] = np.nan
        with pytest.raises(FormatError, match="scale"):
            journal.append_records(bad.tobytes())
        bad = good.copy()
        bad["layers"]["Rc"][1, 0, 3] = 0x7F
        with pytest.raises(FormatError, match="NaN codes"):
            journal.append_records(bad.tobytes())
        assert journal.n_records == 0
        assert journal.append_records(raw) == 2
    assert coli_kv.load(path).records.tobytes() == raw


def test_closed_handle_is_refused(tmp_path):
    journal = KVFile.create(tmp_path / "s.coli_kv", GEOMETRY, tiers.F32)
    journal.close()
    with pytest.raises(JournalClosed):
        journal.append(*rows(1))


@pytest.mark.parametrize("slice_values", [1, 500, 1 << 22])
def test_appended_rows_are_checked_a_slice_at_a_time_naming_the_bad_record(tmp_path, slice_values, monkeypatch):
    """The checks of an append run a slice of records at a time (their temporaries stay small): a
    bad row in any slice is refused naming its record in the whole upload, and nothing is written."""
    from kvstore.formats import nonfinite

    monkeypatch.setattr(nonfinite, "SLICE_VALUES", slice_values)
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.FP8) as journal:
        records = coli_kv.encode_records(GEOMETRY, tiers.FP8, *rows(30))
        scaled, coded = records.copy(), records.copy()
        scaled["layers"]["Rs"][23, 2] = 1e37  # past the bound every encoder keeps
        coded["layers"]["Lc"][17, 1, 5] = 0x7F  # an fp8 NaN code
        with pytest.raises(FormatError, match=r"record 23 \(token \d+\), layer 2"):
            journal.append_records(scaled)
        with pytest.raises(FormatError, match="fp8 NaN codes"):
            journal.append_records(coded)
        assert journal.n_records == 0
        assert journal.append_records(records) == 30
