"""kvstore.formats.q8 against a literal reading of ggml's Q8_0 reference quantizer, and properties."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.formats import q8
from kvstore.formats.errors import FormatError


def reference_quantize(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0_ref, block by block; roundf done exactly in float64.

    blocks : f32[b, 32] of finite values (with amax / 127 inside fp16's range).
    """
    codes = np.zeros(blocks.shape, np.int8)
    deltas = np.zeros(blocks.shape[0], np.float16)
    for index, block in enumerate(blocks):
        amax = np.float32(0.0)
        for value in block:
            amax = np.fmax(amax, np.abs(value))
        d = np.float32(amax / np.float32(127.0))
        inverse = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        scaled = (block * inverse).astype(np.float64)  # the f32 product, then exact rounding
        codes[index] = np.copysign(np.floor(np.abs(scaled) + 0.5), scaled).astype(np.int8)
        deltas[index] = np.float16(d)
    return codes, deltas


def random_blocks(seed: int, n_blocks: int, log_scale_range: float = 20.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.uniform(-log_scale_range, min(log_scale_range, 13.0), (n_blocks, 1)))  # amax/127 < 65504
    return (rng.standard_normal((n_blocks, q8.BLOCK)) * scales).astype(np.float32)


def test_matches_the_reference_quantizer_bit_for_bit():
    blocks = random_blocks(0, 3000)
    codes, deltas = q8.quantize_blocks(blocks)
    expected_codes, expected_deltas = reference_quantize(blocks)
    np.testing.assert_array_equal(codes, expected_codes)
    np.testing.assert_array_equal(deltas[:, 0].view(np.uint16), expected_deltas.view(np.uint16))


def test_rounding_is_half_away_from_zero_exactly():
    # amax = 127 makes d = 1 and 1/d = 1: the scaled values are the inputs themselves.
    halves = np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)
    below = np.nextafter(halves, np.float32(-np.inf))
    above = np.nextafter(halves, np.float32(np.inf))
    probes = np.concatenate([halves, below, above, np.float32([0.49999997, -0.49999997, 0.5, -0.5, -0.0])])
    probes = np.concatenate([probes, np.zeros((-probes.size) % 31, np.float32)])
    blocks = np.concatenate([np.full((probes.size // 31, 1), 127.0, np.float32), probes.reshape(-1, 31)], axis=1)
    codes, deltas = q8.quantize_blocks(blocks)
    assert np.all(deltas == 1.0)
    scaled = blocks.astype(np.float64)
    expected = np.copysign(np.floor(np.abs(scaled) + 0.5), scaled)
    np.testing.assert_array_equal(codes, expected.astype(np.int8))
    # spot values: ties go away from zero, never to even
    head = q8.quantize_blocks(np.float32([127, 0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 126.5] + [0] * 24))[0]
    assert head[:8].tolist() == [127, 1, 2, 3, -1, -3, 0, 127]


@settings(max_examples=80, deadline=None)
@given(
    n_blocks=st.integers(1, 6),
    log_scale=st.floats(-20, 15),
    seed=st.integers(0, 2**32 - 1),
    leading=st.sampled_from([(), (2,), (1, 3)]),
)
def test_round_trip_error_is_half_a_delta(n_blocks, log_scale, seed, leading):
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((*leading, n_blocks * q8.BLOCK)) * np.exp(log_scale)).astype(np.float32)
    codes, deltas = q8.quantize_blocks(rows)
    assert codes.shape == rows.shape and codes.dtype == np.int8 and codes.flags.c_contiguous
    assert deltas.shape == (*leading, n_blocks) and deltas.dtype == np.float16
    decoded = q8.dequantize_blocks(codes, deltas)
    blocks = rows.reshape(-1, q8.BLOCK).astype(np.float64)
    amax = np.abs(blocks).max(axis=1)
    exact_delta = (amax.astype(np.float32) / np.float32(127)).astype(np.float64)
    half_delta = deltas.reshape(-1).astype(np.float64)
    # codes are rounded against the f32 delta, decoded with its fp16 rounding
    bound = 0.5 * exact_delta * (1 + 1e-5) + 127 * np.abs(half_delta - exact_delta) + 2.0**-22 * amax
    error = np.abs(decoded.reshape(-1, q8.BLOCK) - blocks)
    assert np.all(error <= bound[:, None])
    assert np.all(np.abs(codes) <= 127)


def test_edge_blocks():
    blocks = np.zeros((9, q8.BLOCK), np.float32)
    blocks[1] = 1e-40  # 1/d overflows f32: inert
    blocks[2, 3] = np.inf
    blocks[3, :] = -np.inf
    blocks[4] = np.float32(127 * 65520.0)  # amax / 127 rounds past fp16's largest value
    blocks[5] = np.nan  # NaN alone: amax 0
    blocks[6] = np.linspace(-3, 3, q8.BLOCK, dtype=np.float32)
    blocks[6, [4, 9]] = np.nan  # NaN among values: skipped by amax, coded 0
    blocks[7] = 1e-30  # a delta below fp16's subnormals: codes kept (as ggml), delta 0
    blocks[8] = np.float32(127 * 65504.0)  # the largest representable delta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codes, deltas = q8.quantize_blocks(blocks)
        decoded = q8.dequantize_blocks(codes, deltas)
    deltas = deltas[:, 0]
    for inert in (0, 1, 2, 3, 4, 5):
        assert not codes[inert].any() and deltas[inert] == 0 and not decoded[inert].any()
    clean = np.nan_to_num(blocks[6], nan=0.0)
    expected_codes, expected_delta = reference_quantize(clean[None, :])
    np.testing.assert_array_equal(codes[6], expected_codes[0])
    assert deltas[6] == expected_delta[0] and codes[6, 4] == 0 and codes[6, 9] == 0
    assert np.all(codes[7] == 127) and deltas[7] == 0 and not decoded[7].any()
    assert np.all(codes[8] == 127) and deltas[8] == np.float16(65504.0)
    assert np.all(np.isfinite(decoded))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=32, max_size=32))
def test_any_block_decodes_finite(values):
    block = np.array(values, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codes, deltas = q8.quantize_blocks(block)
        decoded = q8.dequantize_blocks(codes, deltas)
    assert np.all(np.isfinite(decoded))
    finite = np.isfinite(block)
    delta = np.abs(block).max() / np.float32(127)
    # inside ggml's defined range: a finite fp16 delta and a finite f32 inverse (or d == 0)
    if finite.all() and delta <= 65504 and (delta == 0 or delta > np.float32(1 / 3.4e38)):
        expected_codes, expected_deltas = reference_quantize(block[None, :])
        np.testing.assert_array_equal(codes, expected_codes[0])
        assert deltas[0] == expected_deltas[0]
    assert np.all(codes[~finite] == 0)


def test_chunk_boundaries_and_out():
    rows = random_blocks(5, 5000).reshape(-1, 4 * q8.BLOCK)  # more blocks than one chunk holds
    codes, deltas = q8.quantize_blocks(rows)
    sliced = [q8.quantize_blocks(rows[i : i + 3]) for i in range(0, rows.shape[0], 3)]
    np.testing.assert_array_equal(codes, np.concatenate([c for c, _ in sliced]))
    np.testing.assert_array_equal(deltas, np.concatenate([d for _, d in sliced]))
    decoded = q8.dequantize_blocks(codes, deltas)
    expected = codes.reshape(-1, q8.BLOCK).astype(np.float32) * deltas.reshape(-1, 1).astype(np.float32)
    np.testing.assert_array_equal(decoded.reshape(-1, q8.BLOCK), expected)
    out = np.empty(rows.shape, np.float32)
    assert q8.dequantize_blocks(codes, deltas, out=out) is out
    np.testing.assert_array_equal(out, decoded)
    strided = np.zeros((rows.shape[0], 2 * rows.shape[1]), np.float32)[:, ::2]
    q8.dequantize_blocks(codes, deltas, out=strided)
    np.testing.assert_array_equal(strided, decoded)
    transposed = np.ascontiguousarray(rows.T).T  # a non-contiguous input
    np.testing.assert_array_equal(q8.quantize_blocks(transposed)[0], codes)
    empty_codes, empty_deltas = q8.quantize_blocks(np.zeros((0, 64), np.float32))
    assert empty_codes.shape == (0, 64) and empty_deltas.shape == (0, 2)
    # four codes are one 32-bit word: the engine views the codes as int32 lanes
    assert codes.view(np.int32).shape == (rows.shape[0], rows.shape[1] // 4)


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(FormatError, match="multiple of 32"):
        q8.quantize_blocks(np.zeros((2, 48), np.float32))
    with pytest.raises(FormatError, match="axis"):
        q8.quantize_blocks(np.float32(1.0))
    codes, deltas = q8.quantize_blocks(np.ones((2, 64), np.float32))
    with pytest.raises(FormatError, match="int8"):
        q8.dequantize_blocks(codes.view(np.uint8), deltas)
    with pytest.raises(FormatError, match="float16"):
        q8.dequantize_blocks(codes, deltas.astype(np.float32))
    with pytest.raises(FormatError, match="deltas shape"):
        q8.dequantize_blocks(codes, deltas[:, :1])
    with pytest.raises(FormatError, match="multiple of 32"):
        q8.dequantize_blocks(codes[:, :40], deltas)
    with pytest.raises(FormatError, match="out"):
        q8.dequantize_blocks(codes, deltas, out=np.empty((2, 64), np.float64))
