import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstore.formats import fp8
from kvstore.formats.errors import FormatError


def test_encoder_reproduces_every_vector_pair(vectors):
    pairs = np.fromfile(vectors / "fp8_enc.bin", dtype=np.uint8).reshape(-1, 5)
    assert pairs.shape[0] == 200_028
    values = pairs[:, :4].copy().view("<f4").ravel()
    expected = pairs[:, 4]
    got = fp8.encode(values)
    mismatched = np.nonzero(got != expected)[0]
    assert mismatched.size == 0, f"first mismatches: {values[mismatched[:5]]} -> {got[mismatched[:5]]}"


def test_decode_table_is_e4m3fn():
    assert fp8.LUT[0x7E] == 448.0 and fp8.LUT[0xFE] == -448.0
    assert fp8.LUT[0x08] == 2.0**-6 and fp8.LUT[0x01] == 2.0**-9
    assert fp8.LUT[0x7F] == 0.0 and fp8.LUT[0xFF] == 0.0  # NaN codes are inert
    assert np.isfinite(fp8.LUT).all()
    # Every non-NaN code round-trips through the encoder.
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    assert (fp8.encode(fp8.decode(codes)) == codes).all()


def test_encode_specials():
    x = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 449.0, 464.0, 465.0, -1e30, 2.0**-10, 2.0**-9 * 1.5],
        dtype=np.float32,
    )
    assert fp8.encode(x).tolist() == [0x00, 0x80, 0x7E, 0xFE, 0x00, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x02]


def test_encode_keeps_shape_and_rejects_non_u8_decode():
    x = np.random.default_rng(0).standard_normal((3, 4, 5)).astype(np.float32)
    assert fp8.encode(x).shape == (3, 4, 5)
    with pytest.raises(FormatError):
        fp8.decode(np.zeros(3, dtype=np.int32))


def test_quantize_rows_special_rows():
    rows = np.array(
        [
            [0.0, 0.0, 0.0, 0.0],  # all zero -> inert
            [1e-39, -1e-39, 0.0, 0.0],  # subnormal amax -> inert
            [1.0, np.inf, 2.0, 3.0],  # inf -> inert
            [np.nan, 1.0, -2.0, 0.5],  # NaN does not raise amax, encodes as 0
            [1234.5, -0.0, 1.0, -1.0],
        ],
        dtype=np.float32,
    )
    codes, scales = fp8.quantize_rows(rows)
    assert (codes[:3] == 0).all() and (scales[:3] == 1.0).all()
    assert scales[3] == np.float32(2.0) / np.float32(448.0)
    assert codes[3, 0] == 0 and fp8.decode(codes[3:4, 2])[0] == -448.0
    assert codes[4, 1] == 0x80  # -0.0 keeps its sign
    back = fp8.dequantize_rows(codes, scales)
    assert back[4, 0] == np.float32(448.0) * (np.float32(1234.5) / np.float32(448.0))


finite_rows = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=40),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
)


@settings(max_examples=200, deadline=None)
@given(finite_rows)
def test_row_round_trip_error_is_bounded(rows):
    codes, scales = fp8.quantize_rows(rows)
    assert codes.shape == rows.shape and scales.shape == rows.shape[:-1]
    back = fp8.dequantize_rows(codes, scales)
    amax = np.abs(rows).max(axis=-1, keepdims=True)
    live = amax > 1e-35
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus the subnormal step
    # (2^-9 of the scaled range, i.e. amax/448 * 2^-9) near zero.
    bound = np.abs(rows) * 2.0**-4 + amax / 448.0 * 2.0**-9 * 1.0001
    err = np.abs(back - rows)
    assert (err[np.broadcast_to(live, rows.shape)] <= bound[np.broadcast_to(live, rows.shape)]).all()
    assert (back[np.broadcast_to(~live, rows.shape)] == 0).all()
    # The largest element of a live row decodes within 2^-4 of itself (amax maps to code 448).
    assert np.all(np.abs(back).max(axis=-1)[live[..., 0]] <= amax[live] * (1 + 2.0**-4))


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.sampled_from([32, 64, 128])),
        elements=st.floats(-100, 100, width=32),
    )
)
def test_grouped_scales(rows):
    codes, scales = fp8.quantize_rows(rows, group_size=32)
    assert scales.shape == (rows.shape[0], rows.shape[1] // 32)
    back = fp8.dequantize_rows(codes, scales, group_size=32)
    groups = rows.reshape(rows.shape[0], -1, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    bound = np.abs(groups) * 2.0**-4 + amax / 448.0 * 2.0**-9 * 1.0001
    live = np.broadcast_to(amax > 1e-35, groups.shape)  # tinier groups are stored inert (zeros)
    back = back.reshape(groups.shape)
    assert (np.abs(back - groups)[live] <= bound[live]).all()
    assert (back[~live] == 0).all()
    # A per-row quantization is the grouped one with a single group.
    c1, s1 = fp8.quantize_rows(rows)
    c2, s2 = fp8.quantize_rows(rows, group_size=rows.shape[1])
    assert (c1 == c2).all() and (s1 == s2[:, 0]).all()


def test_group_size_must_divide_the_row():
    with pytest.raises(FormatError):
        fp8.quantize_rows(np.ones((2, 48), np.float32), group_size=32)


def test_dequantize_out_parameter_and_bad_shapes():
    rows = np.random.default_rng(1).standard_normal((10, 64)).astype(np.float32)
    codes, scales = fp8.quantize_rows(rows)
    out = np.full((10, 64), np.nan, np.float32)
    assert fp8.dequantize_rows(codes, scales, out=out) is out
    assert np.isfinite(out).all()
    with pytest.raises(FormatError):
        fp8.dequantize_rows(codes, scales[:5])
    with pytest.raises(FormatError):
        fp8.dequantize_rows(codes, scales, out=np.empty((10, 63), np.float32))


def test_large_inputs_cross_chunk_boundaries():
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((3000, 576)) * rng.uniform(1e-3, 1e3, (3000, 1))).astype(np.float32)
    codes, scales = fp8.quantize_rows(rows)
    # Compare against the scalar definition on a sample, element by element.
    sample = rng.integers(0, 3000, 20)
    for r in sample:
        inv = np.float32(448.0) / np.abs(rows[r]).max()
        assert (fp8.encode(rows[r] * inv) == codes[r]).all()
    back = fp8.dequantize_rows(codes, scales)
    assert (back == fp8.LUT[codes] * scales[:, None]).all()
