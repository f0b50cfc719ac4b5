"""The v4 file (bf16 rows): a bf16 cache's rows stored as they are, at half the bytes of f32.

What a user of a bf16 cache depends on: the rows come back bit for bit, the file is half the size
of the f32 one, readers that predate v4 (and the C engine, whose magics are v1..v3) refuse it as
unknown instead of misreading it, and migrating to v1 and back changes nothing.
"""

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.errors import BadMagic, CodecMismatch, FormatError, GeometryMismatch
from kvstore.formats import coli_kv, floats, layout
from kvstore.formats.coli_kv import Geometry
from kvstore.journal import KVFile
from kvstore.migrations import formats as migrations

GEOMETRY = Geometry(n_layers=3, kv_lora=64, qk_rope=16, index_hd=8, nic=1, vocab=1000)


def bf16_rows(n, seed=0):
    """Rows as a bf16 cache holds them (every value a bf16 value), widened to f32."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, GEOMETRY.vocab, n).astype(np.int32)
    L, R = (
        torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16().float().numpy()
        for shape in ((GEOMETRY.n_layers, n, GEOMETRY.kv_lora), (GEOMETRY.n_layers, n, GEOMETRY.qk_rope))
    )
    I = rng.standard_normal((GEOMETRY.nic, n, GEOMETRY.index_hd)).astype(np.float32)
    return tokens, L, R, I


def test_a_bf16_file_holds_bf16_rows_exactly_at_half_the_bytes_of_f32():
    tokens, L, R, I = bf16_rows(9)
    v4 = coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=4)
    v1 = coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=1)
    assert v4[:8] == b"COLIKV4\0" and coli_kv.parse_header(v4).tag == 16
    rows = GEOMETRY.n_layers * (GEOMETRY.kv_lora + GEOMETRY.qk_rope)
    # per record: token + rows at 2 bytes a value + the indexer rows (f32 in every version)
    assert coli_kv.parse_header(v4).rec_bytes == 4 + 2 * rows + 4 * GEOMETRY.nic * GEOMETRY.index_hd
    assert coli_kv.parse_header(v1).rec_bytes - coli_kv.parse_header(v4).rec_bytes == 2 * rows
    records = coli_kv.parse(v4, expect=GEOMETRY)
    got_L, got_R, got_I = records.dequantize()
    assert np.array_equal(got_L, L) and np.array_equal(got_R, R) and np.array_equal(got_I, I)
    assert np.array_equal(records.rows(), np.concatenate([L, R], axis=-1))
    codes, scales = records.quantized("L")  # the stored bit patterns, for a device to view as bf16
    assert scales is None and codes.dtype == np.uint16
    assert np.array_equal(codes, torch.from_numpy(L).bfloat16().view(torch.int16).numpy().view(np.uint16))


def test_f32_rows_are_rounded_once_as_torch_rounds_them():
    rng = np.random.default_rng(3)
    tokens = np.arange(4, dtype=np.int32)
    L = rng.standard_normal((3, 4, 64)).astype(np.float32)
    R = rng.standard_normal((3, 4, 16)).astype(np.float32)
    I = rng.standard_normal((1, 4, 8)).astype(np.float32)
    got_L, got_R, _ = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=4)).dequantize()
    assert np.array_equal(got_L, torch.from_numpy(L).bfloat16().float().numpy())
    assert np.array_equal(got_R, torch.from_numpy(R).bfloat16().float().numpy())


def test_readers_before_v4_refuse_the_file_as_unknown():
    """A reader with only the C engine's magics (kvstore before v4) stops at the magic, typed."""
    tokens, L, R, I = bf16_rows(2)
    v4 = coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=4)
    older = {magic: version for magic, version in layout.MAGICS.items() if version <= 3}
    assert v4[:8] not in older
    saved = dict(layout.MAGICS)
    try:
        layout.MAGICS.clear()
        layout.MAGICS.update(older)
        with pytest.raises(BadMagic, match="not a .coli_kv file"):
            coli_kv.parse_header(v4)
    finally:
        layout.MAGICS.clear()
        layout.MAGICS.update(saved)
    # and a v4 magic with another tag is refused, naming the word
    bad = v4[:36] + np.int32(0).tobytes() + v4[40:]
    with pytest.raises(FormatError, match=r"tag \(h7.*16 in a v4"):
        coli_kv.parse_header(bad)


def test_migrating_to_f32_and_back_changes_nothing():
    tokens, L, R, I = bf16_rows(700, seed=5)  # more than one migration chunk
    v4 = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=4))
    v1 = migrations.convert(v4, tiers.F32)
    assert not migrations.is_lossy(tiers.BF16, tiers.F32) and migrations.is_lossy(tiers.F32, tiers.BF16)
    as_v1 = coli_kv.parse(coli_kv.Header(GEOMETRY, tiers.F32, 700).to_bytes() + v1.tobytes())
    assert np.array_equal(as_v1.dequantize()[0], L)
    back = migrations.convert(as_v1, tiers.BF16)
    assert back.tobytes() == v4.records.tobytes()


def test_a_journal_refuses_non_finite_bf16_values_and_writes_counted_zeros(tmp_path):
    tokens, L, R, I = bf16_rows(3)
    path = tmp_path / "s.coli_kv"
    with KVFile.create(path, GEOMETRY, tiers.BF16) as journal:
        journal.append(tokens, L, R, I)
        records = journal.load().records.copy()
        records["layers"]["Rc"][1, 2, 0] = 0x7FC0  # a bf16 NaN
        with pytest.raises(FormatError, match="NaN or infinite"):
            journal.append_records(records[1:2])
        assert journal.n_records == 3
        L[0, 0, 0] = np.nan  # a value, not a code: the journal writes it as 0, as it does for f32
        journal.append(tokens, L, R, I)
        loaded = journal.load()
    assert loaded.n == 6 and loaded.dequantize()[0][0, 3, 0] == 0.0 and not loaded.problems.damaged


def test_values_hand_a_value_tiers_rows_over_as_stored():
    tokens, L, R, I = bf16_rows(5, seed=9)
    v4 = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=4))
    stored = v4.values()
    assert stored.dtype == np.uint16 and stored.shape == (3, 5, 80)
    assert np.array_equal(torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16).float().numpy(), v4.rows())
    v1 = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=1))
    assert v1.values().dtype == np.float32 and np.array_equal(v1.values(), v1.rows())
    fp8 = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=2))
    with pytest.raises(CodecMismatch, match="use rows"):
        fp8.values()


@pytest.mark.parametrize("version", [1, 4])
def test_a_value_tiers_rows_are_read_where_they_lie_in_the_records(version):
    """``values_view``: the rows ``values`` copies, as a read-only view of the records (a loader
    that only places them decodes nothing) — for any range of records, with indexer rows between."""
    tokens, L, R, I = bf16_rows(7, seed=4)
    loaded = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=version))
    view = loaded.values_view()
    assert view.dtype == loaded.values().dtype and np.array_equal(view, loaded.values())
    assert np.shares_memory(view, loaded.records) and not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0, 0] = 0
    assert np.array_equal(loaded.slice(2, 6).values_view(), loaded.values()[:, 2:6])
    assert loaded.slice(3, 3).values_view().shape == (3, 0, 80)
    fp8 = coli_kv.parse(coli_kv.encode_file(GEOMETRY, tokens, L, R, I, version=2))
    with pytest.raises(CodecMismatch, match="use rows"):
        fp8.values_view()


def test_records_from_bf16_bits_equal_those_from_the_f32_rows_they_widen_to():
    # a bf16 cache's rows handed over as their bits (no widening): every pattern, inf and NaN included
    geometry = Geometry(n_layers=3, kv_lora=64, qk_rope=16, index_hd=0, nic=0, vocab=1000)
    rng = np.random.default_rng(3)
    n = 40
    tokens = rng.integers(0, geometry.vocab, n).astype(np.int32)
    L = rng.integers(0, 1 << 16, (geometry.n_layers, n, geometry.kv_lora), dtype=np.uint16)
    R = rng.integers(0, 1 << 16, (geometry.n_layers, n, geometry.qk_rope), dtype=np.uint16)
    L[0, :4, :4] = [[0x7F80, 0xFF80, 0x7FC0, 0xFFFF]] * 4  # +inf, -inf, NaN, a NaN with payload
    R[2, -1, 0] = 0x8000  # -0 stays -0
    assert ((L & 0x7F80) == 0x7F80).sum() > 40  # random patterns hold more (1 in 256)
    from_bits = coli_kv.encode_bf16_records(geometry, tokens, L, R)
    widened = (floats.bf16_decode(L), floats.bf16_decode(R))
    from_f32, sanitized = coli_kv.encode_records_counted(geometry, tiers.BF16, tokens, *widened)
    assert sanitized.values > 40
    assert from_bits.dtype == from_f32.dtype and from_bits.tobytes() == from_f32.tobytes()
    assert from_bits["layers"]["Rc"][-1, 2, 0] == 0x8000


def test_bf16_bits_of_another_shape_or_dtype_are_refused():
    geometry = Geometry(n_layers=2, kv_lora=8, qk_rope=4, index_hd=0, nic=0, vocab=100)
    tokens = np.arange(5, dtype=np.int32)
    L, R = np.zeros((2, 5, 8), np.uint16), np.zeros((2, 5, 4), np.uint16)
    with pytest.raises(GeometryMismatch):
        coli_kv.encode_bf16_records(geometry, tokens, L[:, :4], R)
    with pytest.raises(GeometryMismatch):
        coli_kv.encode_bf16_records(geometry, tokens, L.astype(np.float32), R)
    with pytest.raises(GeometryMismatch):  # indexer rows have no bf16 form
        coli_kv.encode_bf16_records(GEOMETRY, tokens, L, R)
    with pytest.raises(FormatError):
        coli_kv.encode_bf16_records(geometry, tokens + 99, L, R)
