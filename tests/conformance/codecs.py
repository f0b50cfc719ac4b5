"""The suites every row codec passes (the numcodecs way: subclass, set ``codec`` or ``tier``).

:class:`CodecConformance` is run by every registered codec of ``kvstore.formats.codecs`` (one class
per family, each registered once): its registry entry and config, its sizes, its codes and scales,
its stored bytes, its scale bound, the golden vectors of its file version where there are some,
and its torch twin. :class:`TierConformance` (and :class:`FileTierConformance`) is run by every tier
of ``kvstore.tiers``: the same codec seen through the tier vocabulary and the ``.coli_kv`` records.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from golden import GEOMETRIES, V3_VARIANTS, read_expect, read_src
from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.codecs import RowCodec, codec_for, codec_from_config, registered_codecs
from kvstore.formats.coli_kv import Geometry
from kvstore.formats.errors import FormatError

#: The largest relative L2 error of a decoded Gaussian row, per tier name (a registered codec with
#: no entry fails ``test_every_codec_has_a_tolerance``).
TOLERANCE = {
    "f32": 0.0,
    "bf16": 0.005,
    "fp8": 0.06,
    "int4": 0.16,
    "q8": 0.01,
    "polar2": 0.7,
    "polar3": 0.35,
    "polar4": 0.18,
    "polar5": 0.09,
    "polar6": 0.05,
}
#: The golden file variants (tests/vectors): ``v1``, ``v2``, ``v3c{codec}b{bits}``.
GOLDEN_VARIANTS = ("v1", "v2", *V3_VARIANTS)


def golden_variant(codec: RowCodec) -> str | None:
    """The golden file variant holding ``codec``'s rows (``v3c0b3`` for polar3), None for cache-only codecs."""
    if not codec.in_file:
        return None
    return f"v{codec.version}" if codec.tq_codec is None else f"v{codec.version}c{codec.tq_codec}b{codec.bits}"


def _rel_row_error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per-row ``||got - want|| / ||want||`` (the error itself where ``want`` is a zero row)."""
    want = want.astype(np.float64)
    norms = np.linalg.norm(want, axis=-1)
    err = np.linalg.norm(got.astype(np.float64) - want, axis=-1)
    return np.where(norms > 0, err / np.where(norms > 0, norms, 1), err)


def _to_torch(torch, array: np.ndarray):
    """A numpy array as a tensor; bf16 bit patterns (u16) as a bf16 tensor."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _to_numpy(torch, tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class CodecConformance:
    """Set ``codec`` (a registered :class:`~kvstore.formats.codecs.RowCodec`), ``tolerance`` and
    ``exact`` (its arithmetic is IEEE-exact: golden vectors and the torch twin agree bit for bit;
    else within the spec's PolarQuant bounds)."""

    codec: RowCodec
    tolerance: float
    exact: bool = True
    widths = (32, 64, 512)

    def rows(self, n, count=17, seed=0):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((count, n)) * rng.uniform(0.01, 50, (count, 1))).astype(np.float32)

    # ---- the registry --------------------------------------------------------------------------
    def test_registered_once_under_its_tier_name(self):
        assert registered_codecs()[self.codec.name] is self.codec
        assert codec_for(self.codec.name) is self.codec
        assert self.codec in type(self.codec).variants()
        assert self.codec.codec_id == self.codec.name

    def test_config_round_trips_through_json(self):
        config = json.loads(json.dumps(self.codec.get_config()))
        assert codec_from_config(config) is self.codec
        with pytest.raises(FormatError):
            codec_from_config({**config, "level": 3})

    def test_the_tier_of_its_name_is_this_codec(self):
        tier = tiers.get(self.codec.name)
        assert tier.row_codec is self.codec
        c = self.codec
        assert (tier.version, tier.codec, tier.bits, tier.in_file, tier.lossy, tier.label, tier.rotated) == (
            c.version,
            c.tq_codec,
            c.bits,
            c.in_file,
            c.lossy,
            c.label,
            c.rotated,
        )

    # ---- sizes ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("n_index", [0, 1, 2])
    def test_sizes_add_up(self, n_index):
        n, c = self.widths[n_index], self.codec
        assert c.row_bytes(n) == c.payload_bytes(n) + c.scale_bytes(n)
        assert c.code_width(n) * c.codes_dtype.itemsize == c.payload_bytes(n)
        expected_scale = 0 if c.scales_dtype is None else int(np.prod(c.scale_shape(n))) * c.scales_dtype.itemsize
        assert c.scale_bytes(n) == expected_scale
        assert c.width_of(c.row_bytes(n)) in (n, None)
        assert c.width_problem(n) is None
        assert c.scaled == (c.scales_dtype is not None)

    @pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
    def test_codes_and_scales_have_the_declared_layout(self, lead):
        n, c = self.widths[1], self.codec
        count = int(np.prod(lead, dtype=int)) if lead else 1
        codes, scales = c.quantize(self.rows(n, count=count).reshape(*lead, n))
        assert codes.dtype == c.codes_dtype.newbyteorder("=") and codes.shape == (*lead, c.code_width(n))
        if c.scales_dtype is None:
            assert scales is None
        else:
            assert scales is not None
            assert scales.dtype == c.scales_dtype.newbyteorder("=") and scales.shape == (*lead, *c.scale_shape(n))

    # ---- stored bytes --------------------------------------------------------------------------
    def test_stored_bytes_are_the_codes_then_the_little_endian_scales(self):
        n, c = self.widths[1], self.codec
        rows = self.rows(n, 5)
        codes, scales = c.quantize(rows)
        parts = [np.ascontiguousarray(codes).view(np.uint8).reshape(5, -1)]
        if scales is not None:
            parts.append(np.ascontiguousarray(scales, scales.dtype.newbyteorder("<")).view(np.uint8).reshape(5, -1))
        stored = c.encode(rows)
        assert stored.dtype == np.uint8 and stored.shape == (5, c.row_bytes(n))
        assert np.array_equal(stored, np.concatenate(parts, axis=-1))

    @pytest.mark.parametrize("n_index", [0, 1, 2])
    def test_round_trip_error(self, n_index):
        n = self.widths[n_index]
        rows = self.rows(n, seed=n)
        back = self.codec.decode(self.codec.encode(rows), n)
        rel = np.linalg.norm(back - rows, axis=-1) / np.linalg.norm(rows, axis=-1)
        assert rel.max() <= self.tolerance
        assert (rel.max() > 0) == self.codec.lossy

    def test_split_and_joined_forms_agree(self):
        n, c = self.widths[2], self.codec
        rows = self.rows(n, seed=3)
        codes, scales = c.quantize(rows)
        assert np.array_equal(c.dequantize(codes, scales, n), c.decode(c.encode(rows), n))

    def test_decode_into_out(self):
        n = self.widths[1]
        out = np.full((17, n), np.nan, np.float32)
        assert self.codec.decode(self.codec.encode(self.rows(n)), n, out=out) is out
        assert np.isfinite(out).all()

    def test_wrong_byte_count_is_a_typed_error(self):
        n = self.widths[1]
        stored = self.codec.encode(self.rows(n, 2))
        with pytest.raises(FormatError):
            self.codec.decode(stored[..., :-1], n)
        with pytest.raises(FormatError):
            self.codec.decode(stored.view(np.int8), n)

    # ---- what an encoder writes, and what a reader neutralizes ---------------------------------
    def test_zero_rows_decode_to_zero(self):
        n = self.widths[1]
        assert (self.codec.decode(self.codec.encode(np.zeros((4, n), np.float32)), n) == 0).all()

    def test_the_encoder_writes_no_scale_or_code_a_reader_refuses(self):
        n, c = self.widths[2], self.codec
        codes, scales = c.quantize(self.rows(n, 64, seed=9))
        if scales is not None:
            assert not c.corrupt_scales(scales).any()
        bad = c.bad_codes(codes)
        assert bad is None or not bad.any()

    def test_an_inert_row_decodes_to_zeros(self):
        n, c = self.widths[1], self.codec
        if c.scale_kind is None:
            pytest.skip(f"{c.name} rows have no per-row scale")
        codes = np.zeros((3, c.code_width(n)), c.codes_dtype)
        scales = np.full(3, c.inert_scale, np.float32)
        assert (c.dequantize(codes, scales, n) == 0).all()
        assert not c.corrupt_scales(scales).any()

    def test_rows_stored_as_zeros_are_the_ones_counted(self):
        n, c = self.widths[1], self.codec
        rows = self.rows(n, 6, seed=4)
        rows[1, 5] = np.nan
        rows[3, 40] = np.inf
        rows[4, 0] = -np.inf
        nonfinite = ~np.isfinite(rows)
        with np.errstate(invalid="ignore"):
            back = c.decode(c.encode(rows), n)
        zeroed = int(np.count_nonzero((back == 0).all(axis=-1)))
        assert c.zeroed_rows(rows, nonfinite) == zeroed

    # ---- the file version's golden vectors -----------------------------------------------------
    @pytest.mark.parametrize("name", sorted(GEOMETRIES))
    def test_golden_vectors(self, vectors, name):
        variant = golden_variant(self.codec)
        if variant not in GOLDEN_VARIANTS:
            pytest.skip(f"no golden vectors hold {self.codec.name} rows")
        tokens, L, R, _ = read_src(vectors, name)
        records = coli_kv.load(vectors / f"{name}.{variant}.coli_kv")
        want_L, want_R = read_expect(vectors, name, variant)
        g = records.geometry
        split = self.codec.row_bytes(g.kv_lora)
        for layer in range(g.n_layers):
            stored = np.frombuffer(records.records["layers"][:, layer].tobytes(), np.uint8).reshape(records.n, -1)
            for part, src, want, width in (
                (stored[:, :split], L, want_L, g.kv_lora),
                (stored[:, split:], R, want_R, g.qk_rope),
            ):
                ours = self.codec.encode(src[layer])
                got = self.codec.decode(part, width)
                if self.exact:
                    assert np.array_equal(ours, part), (name, layer)
                    assert got.tobytes() == want[layer].tobytes(), (name, layer)
                else:  # the spec's PolarQuant bounds (cosf/sinf, atan2f/hypotf are the device's)
                    assert (ours == part).all(axis=-1).mean() >= 0.999, (name, layer)
                    assert _rel_row_error(got, want[layer]).max() <= 1e-5, (name, layer)

    # ---- the torch twin ------------------------------------------------------------------------
    def test_the_torch_twin_encodes_and_decodes_as_the_codec(self):
        torch = pytest.importorskip("torch")
        from kvstore.gpu import codecs as torch_codecs

        n, c = self.widths[2], self.codec
        tier = tiers.get(c.name)
        twin = torch_codecs.torch_twin(tier)
        rows = self.rows(n, 64, seed=5)
        codes, scales = c.quantize(rows)
        got_codes, got_scales = twin.quantize(tier, torch.from_numpy(rows))  # the device path, on the CPU
        assert got_codes.dtype == twin.codes_dtype and (got_scales is None) == (twin.scales_dtype is None)
        same_rows = (_to_numpy(torch, got_codes).reshape(64, -1) == codes.reshape(64, -1)).all(axis=-1)
        assert same_rows.mean() >= (1.0 if self.exact else 0.999)
        if scales is not None and got_scales is not None:
            assert got_scales.dtype == twin.scales_dtype
            assert np.array_equal(_to_numpy(torch, got_scales), scales)
        decoded = twin.dequantize(
            tier, _to_torch(torch, codes), None if scales is None else _to_torch(torch, scales), n
        ).numpy()
        want = c.dequantize(codes, scales, n)
        if self.exact:
            assert np.array_equal(decoded, want)
        else:
            assert _rel_row_error(decoded, want).max() <= 1e-5


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
