"""Non-finite input rows: never stored as given, always counted, the first one named (issue 15, item 8)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv, nonfinite
from kvstore.formats.coli_kv import Geometry
from kvstore.formats.nonfinite import Sanitized

GEOMETRY = Geometry(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=1000)
TIERS = [tiers.F32, tiers.FP8, tiers.INT4, tiers.polar(3)]


def rows(n: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    g = GEOMETRY
    return (
        rng.integers(0, g.vocab, n).astype(np.int32),
        rng.standard_normal((g.n_layers, n, g.kv_lora)).astype(np.float32),
        rng.standard_normal((g.n_layers, n, g.qk_rope)).astype(np.float32),
        rng.standard_normal((g.nic, n, g.index_hd)).astype(np.float32),
    )


def poisoned():
    """Rows with a NaN in L (record 3, layer 1, element 7), +inf in R (record 2, layer 0, element 1),
    -inf in I (record 4) and a NaN in I (record 2): 4 values, the first at record 2 (R before I)."""
    tokens, L, R, I = rows()
    L[1, 3, 7] = np.nan
    R[0, 2, 1] = np.inf
    I[0, 4, 2] = -np.inf
    I[0, 2, 3] = np.nan
    return tokens, L, R, I


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.name)
def test_every_tier_counts_the_same_values_and_stores_none_of_them(tier):
    tokens, L, R, I = poisoned()
    records, found = coli_kv.encode_records_counted(GEOMETRY, tier, tokens, L, R, I)
    # f32 keeps the rest of each row; fp8 zeroes a row holding an infinity, int4/polar any row holding one
    zeroed = {1: 0, 2: 1, 3: 2}[tier.version]
    assert found == Sanitized(4, zeroed, (2, "R", 0, 1))
    assert "4 non-finite values (NaN or infinity), the first at record 2, R layer 0, element 1" in found.describe()
    spec = coli_kv.encode_records(GEOMETRY, tier, tokens, L, R, I)  # the C engine's encoder: f32 values as given
    assert np.isnan(spec["index"][2, 0, 3]) and not np.isnan(records["index"][2, 0, 3])
    assert (spec["layers"]["Lc"] == records["layers"]["Lc"]).all() == (tier.version != 1)
    image = coli_kv.Header(GEOMETRY, tier, 5).to_bytes() + records.tobytes()
    loaded = coli_kv.parse(image)
    assert loaded.problems.nan_values == 0 and loaded.problems.nan_codes == 0
    dL, dR, dI = loaded.dequantize()
    assert np.isfinite(dL).all() and np.isfinite(dR).all() and np.isfinite(dI).all()
    assert dI[0, 4, 2] == 0 and dI[0, 2, 3] == 0 and dI[0, 4, 1] == I[0, 4, 1]  # f32 values: one by one
    if tier.version == 1:
        assert dL[1, 3, 7] == 0 and dR[0, 2, 1] == 0 and dL[1, 3, 6] == L[1, 3, 6]
    else:
        assert not dR[0, 2].any()  # the row with +inf is stored as zeros by every quantized tier
    clean = coli_kv.encode_records_counted(GEOMETRY, tier, *rows())[1]
    assert clean == Sanitized() and clean.describe() == "no non-finite values"


def test_raw_f32_records_are_sanitized_on_a_copy():
    tokens, L, R, I = rows()
    good = coli_kv.encode_records(GEOMETRY, tiers.F32, tokens, L, R, I)
    raw = np.frombuffer(good.tobytes(), dtype=good.dtype).copy()
    raw["layers"]["Rc"][1, 0, 5] = -np.inf
    raw["index"][3, 0, 0] = np.nan
    frozen = np.frombuffer(raw.tobytes(), dtype=raw.dtype)  # read-only, like a request body
    fixed, found = nonfinite.sanitize_records(frozen, tiers.F32)
    assert found == Sanitized(2, 0, (1, "R", 0, 5)) and fixed is not frozen
    assert fixed["layers"]["Rc"][1, 0, 5] == 0 and fixed["index"][3, 0, 0] == 0
    assert not np.isfinite(frozen["layers"]["Rc"][1, 0, 5])  # the caller's bytes are untouched
    same, nothing = nonfinite.sanitize_records(good, tiers.F32)
    assert same is good and nothing == Sanitized()
    # quantized records: only the indexer rows are values; their codes are the journal's to refuse
    v2 = coli_kv.encode_records(GEOMETRY, tiers.FP8, tokens, L, R, I)
    v2["index"][0, 0, 1] = np.inf
    fixed, found = nonfinite.sanitize_records(v2, tiers.FP8)
    assert found == Sanitized(1, 0, (0, "I", 0, 1)) and fixed["index"][0, 0, 1] == 0


@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.name)
@pytest.mark.parametrize("slice_values", [1, 90, 300, 1 << 22])
def test_large_uploads_are_judged_a_slice_at_a_time_with_the_same_bytes_and_count(tier, slice_values, monkeypatch):
    """Encoding and sanitizing work a slice of records at a time (their temporaries stay a slice's
    size): whatever the slice, the records are byte for byte those of one pass and the count names
    the same first value, across slice boundaries."""
    tokens, L, R, I = rows(n=37, seed=4)
    L[1, 20, 7] = np.nan
    R[0, 11, 1] = np.inf
    I[0, 30, 2] = -np.inf
    I[0, 11, 3] = np.nan
    whole, whole_found = coli_kv.encode_records_counted(GEOMETRY, tier, tokens, L, R, I)
    raw = coli_kv.encode_records(GEOMETRY, tier, tokens, L, R, I)  # f32 fields kept as given
    whole_clean, whole_sanitized = nonfinite.sanitize_records(raw, tier)
    monkeypatch.setattr(nonfinite, "SLICE_VALUES", slice_values)
    sliced, found = coli_kv.encode_records_counted(GEOMETRY, tier, tokens, L, R, I)
    assert sliced.tobytes() == whole.tobytes() and found == whole_found
    assert found.first == (11, "R", 0, 1) and found.values == 4
    clean, sanitized = nonfinite.sanitize_records(raw, tier)
    assert clean.tobytes() == whole_clean.tobytes() and sanitized == whole_sanitized
    assert clean is not raw and np.isnan(raw["index"][11, 0, 3])  # the caller's records untouched
