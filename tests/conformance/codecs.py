"""The suite every tier passes as a row codec (the numcodecs way: subclass, set ``tier``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.formats.errors import FormatError


class TierConformance:
    tier: tiers.Tier
    #: largest relative L2 error of a decoded Gaussian row
    tolerance: float
    widths = (32, 64, 512)

    def rows(self, n, count=17, seed=0):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((count, n)) * rng.uniform(0.01, 50, (count, 1))).astype(np.float32)

    def test_config_round_trips_through_json(self):
        config = json.loads(json.dumps(self.tier.get_config()))
        assert tiers.get_codec(config) is self.tier
        assert tiers.parse(self.tier.name) is self.tier

    @pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
    def test_shapes(self, lead):
        n = self.widths[0]
        count = int(np.prod(lead, dtype=int)) if lead else 1
        rows = self.rows(n, count=count).reshape(*lead, n)
        stored = self.tier.encode(rows)
        assert stored.dtype == np.uint8 and stored.shape == (*lead, self.tier.row_bytes(n))
        assert self.tier.decode(stored, n).shape == rows.shape
        codes, scales = self.tier.quantize(rows)
        assert codes.shape[:-1] == lead
        assert self.tier.dequantize(codes, scales, n).shape == rows.shape

    @pytest.mark.parametrize("n_index", [0, 1, 2])
    def test_round_trip_error(self, n_index):
        n = self.widths[n_index]
        rows = self.rows(n, seed=n)
        back = self.tier.decode(self.tier.encode(rows), n)
        rel = np.linalg.norm(back - rows, axis=-1) / np.linalg.norm(rows, axis=-1)
        assert rel.max() <= self.tolerance
        assert (rel.max() > 0) == self.tier.lossy

    def test_split_and_joined_forms_agree(self):
        n = self.widths[1]
        rows = self.rows(n, seed=3)
        codes, scales = self.tier.quantize(rows)
        assert np.array_equal(self.tier.dequantize(codes, scales, n), self.tier.decode(self.tier.encode(rows), n))

    def test_decode_into_out(self):
        n = self.widths[1]
        rows = self.rows(n)
        out = np.full(rows.shape, np.nan, np.float32)
        assert self.tier.decode(self.tier.encode(rows), n, out=out) is out
        assert np.isfinite(out).all()

    def test_zero_rows_decode_to_zero(self):
        n = self.widths[1]
        back = self.tier.decode(self.tier.encode(np.zeros((4, n), np.float32)), n)
        assert (back == 0).all()

    def test_wrong_byte_count_is_a_typed_error(self):
        n = self.widths[1]
        stored = self.tier.encode(self.rows(n, 2))
        with pytest.raises(FormatError):
            self.tier.decode(stored[..., :-1], n)

    def test_journal_tier_is_a_file_tier(self):
        file_tier = self.tier.file_tier
        assert file_tier.in_file and tiers.from_header(file_tier.version, file_tier.tag) is file_tier
        assert (file_tier is self.tier) == self.tier.in_file


class FileTierConformance(TierConformance):
    """Tiers with a ``.coli_kv`` version: a stored row is, byte for byte, the row inside a record."""

    def test_stored_rows_are_the_file_rows(self):
        geometry = Geometry(1, 64, 32, 0, 0, 10)
        L = self.rows(64, 3)[None]
        R = self.rows(32, 3, seed=5)[None]
        image = coli_kv.encode_file(
            geometry,
            np.arange(3, dtype=np.int32),
            L,
            R,
            version=self.tier.version,
            codec=self.tier.codec,
            bits=self.tier.bits,
        )
        records = coli_kv.parse(image)
        assert records.tier is self.tier
        assert records.header.rec_bytes == 4 + self.tier.row_bytes(64) + self.tier.row_bytes(32)
        row_bytes = np.frombuffer(records.records["layers"][:, 0].tobytes(), np.uint8).reshape(3, -1)
        assert np.array_equal(row_bytes[:, : self.tier.row_bytes(64)], self.tier.encode(L[0]))
        assert np.array_equal(row_bytes[:, self.tier.row_bytes(64) :], self.tier.encode(R[0]))
