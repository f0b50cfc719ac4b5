"""``KVRecords.rows()``: every record decoded into one [n_layers, n, kv_lora + qk_rope] array, as
an MLA cache keeps a row — the same values as ``dequantize()``'s L and R joined, bad rows sanitized
the same way, for every file tier."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header, KVRecords

GEOMETRY = Geometry(n_layers=3, kv_lora=512, qk_rope=64, index_hd=0, nic=0, vocab=1000)


@pytest.mark.parametrize("name", [t.name for t in tiers.TIERS.values() if t.in_file])
def test_rows_are_dequantize_joined_for_every_file_tier(name):
    tier = tiers.get(name)
    rng = np.random.default_rng(3)
    L = rng.standard_normal((3, 40, 512)).astype(np.float32)
    R = rng.standard_normal((3, 40, 64)).astype(np.float32)
    records = coli_kv.encode_records(GEOMETRY, tier, rng.integers(0, 1000, 40), L, R)
    if tier.row_codec.scaled:  # a row with a scale no encoder writes: read as an inert row
        scales = records["layers"]["Ls"]
        scales[5, 1] = np.float32("inf")
    loaded = KVRecords(Header(GEOMETRY, tier, 40), records, HEADER_BYTES + records.nbytes)
    lat, rope, _ = loaded.dequantize()
    rows = loaded.rows()
    assert rows.shape == (3, 40, 576) and rows.dtype == np.float32 and rows.flags.c_contiguous
    np.testing.assert_array_equal(rows, np.concatenate([lat, rope], axis=-1))
    assert np.isfinite(rows).all()
