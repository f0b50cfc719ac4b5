"""kvstore.formats.tq against the golden vectors, a literal reading of docs/FORMAT.md 5-6, and properties."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.formats import tq
from kvstore.formats.errors import FormatError

# ----------------------------------------------------------------- golden vectors
# Geometries from tests/vectors/README.md: n_layers, kv_lora, qk_rope, index_hd, nic, vocab, records.
GEOMETRIES = {
    "small": (3, 64, 16, 0, 0, 1000, 7),
    "glm": (2, 512, 64, 32, 1, 151552, 6),
}
POLAR_BITS = (2, 3, 4, 6)
CASES = [(name, 1, 4) for name in GEOMETRIES] + [(name, 0, bits) for name in GEOMETRIES for bits in POLAR_BITS]


def spec_row_bytes(n: int, codec: int, bits: int) -> int:
    """rb(n) as docs/FORMAT.md section 6 writes it (independent of tq.row_bytes)."""
    if codec == 1:
        return n // 2
    b1, b2 = bits, max(bits - 1, 1)
    return math.ceil(((n // 2) * b1 + (n // 2 - 1) * b2) / 8)


def v3_record_dtype(name: str, codec: int, bits: int) -> np.dtype:
    """docs/FORMAT.md section 2's v3 record, packed (the radius floats are unaligned)."""
    n_layers, kv_lora, qk_rope, index_hd, nic, _, _ = GEOMETRIES[name]
    layer = np.dtype(
        [
            ("Lc", "u1", (spec_row_bytes(kv_lora, codec, bits),)),
            ("Lr", "<f4"),
            ("Rc", "u1", (spec_row_bytes(qk_rope, codec, bits),)),
            ("Rr", "<f4"),
        ]
    )
    fields = [("token", "<i4"), ("layers", layer, (n_layers,))]
    if nic:
        fields.append(("index", "<f4", (nic, index_hd)))
    return np.dtype(fields)


def load_source(vectors, name: str):
    """tokens int32[n], L f32[n_layers, n, kv_lora], R f32[n_layers, n, qk_rope], I f32[nic, n, index_hd]."""
    n_layers, kv_lora, qk_rope, index_hd, nic, _, n = GEOMETRIES[name]
    raw = (vectors / f"{name}.src.f32").read_bytes()
    sizes = [n, n_layers * n * kv_lora, n_layers * n * qk_rope, nic * n * index_hd]
    assert len(raw) == 4 * sum(sizes), "src file size does not match the README geometry"
    words = np.frombuffer(raw, dtype="<f4")
    tokens = np.frombuffer(raw, dtype="<i4", count=n)
    bounds = np.cumsum(sizes)
    L = words[bounds[0] : bounds[1]].reshape(n_layers, n, kv_lora)
    R = words[bounds[1] : bounds[2]].reshape(n_layers, n, qk_rope)
    I = words[bounds[2] : bounds[3]].reshape(nic, n, index_hd)
    return tokens, L, R, I


def load_v3(vectors, name: str, codec: int, bits: int):
    """(header words int32[8], records) of G.v3c{codec}b{bits}.coli_kv."""
    raw = (vectors / f"{name}.v3c{codec}b{bits}.coli_kv").read_bytes()
    assert raw[:8] == b"COLIKV3\0"
    header = np.frombuffer(raw, dtype="<i4", count=8, offset=8)
    dtype = v3_record_dtype(name, codec, bits)
    assert (len(raw) - 40) % dtype.itemsize == 0, "record size disagrees with the file"
    return header, raw[40:], np.frombuffer(raw, dtype=dtype, offset=40)


def load_expect(vectors, name: str, codec: int, bits: int):
    n_layers, kv_lora, qk_rope, _, _, _, n = GEOMETRIES[name]
    values = np.fromfile(vectors / f"{name}.v3c{codec}b{bits}.expect.f32", dtype="<f4")
    split = n_layers * n * kv_lora
    return values[:split].reshape(n_layers, n, kv_lora), values[split:].reshape(n_layers, n, qk_rope)


def stored_rows(records, which: str):
    """codes u8[n_layers, n, rb], radii f32[n_layers, n] of the L or R rows."""
    layers = records["layers"]
    return (
        np.ascontiguousarray(layers[which + "c"].transpose(1, 0, 2)),
        np.ascontiguousarray(layers[which + "r"].T),
    )


@pytest.mark.parametrize("name,codec,bits", CASES)
def test_vector_header_and_record_size(vectors, name, codec, bits):
    header, _, records = load_v3(vectors, name, codec, bits)
    n_layers, kv_lora, qk_rope, index_hd, nic, vocab, n = GEOMETRIES[name]
    assert header.tolist() == [n_layers, kv_lora, qk_rope, index_hd, nic, vocab, n, (codec << 8) | bits]
    assert len(records) == n
    assert tq.row_bytes(kv_lora, codec, bits) == spec_row_bytes(kv_lora, codec, bits)
    assert tq.row_bytes(qk_rope, codec, bits) == spec_row_bytes(qk_rope, codec, bits)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_int4_vector_file_written_byte_for_byte(vectors, name):
    """Every record of G.v3c1b4 rebuilt from src: codes and radius bytes identical."""
    tokens, L, R, I = load_source(vectors, name)
    _, body, records = load_v3(vectors, name, 1, 4)
    rebuilt = np.zeros(len(records), dtype=records.dtype)
    rebuilt["token"] = tokens
    for which, rows in (("L", L), ("R", R)):
        codes, radii = tq.quantize_rows(rows.transpose(1, 0, 2), tq.CODEC_INT4, 4)
        rebuilt["layers"][which + "c"] = codes
        rebuilt["layers"][which + "r"] = radii
    if "index" in records.dtype.names:
        rebuilt["index"] = I.transpose(1, 0, 2)
    assert rebuilt.tobytes() == body


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_int4_vector_dequantizes_bit_exactly(vectors, name):
    _, L, R, _ = load_source(vectors, name)
    _, _, records = load_v3(vectors, name, 1, 4)
    expect_L, expect_R = load_expect(vectors, name, 1, 4)
    for which, width, expect in (("L", L.shape[-1], expect_L), ("R", R.shape[-1], expect_R)):
        codes, radii = stored_rows(records, which)
        decoded = tq.dequantize_rows(codes, radii, width, tq.CODEC_INT4, 4)
        np.testing.assert_array_equal(decoded.view(np.uint32), expect.view(np.uint32))


@pytest.mark.parametrize("name,bits", [(name, bits) for name in GEOMETRIES for bits in POLAR_BITS])
def test_polar_vector_dequantizes_within_tolerance(vectors, name, bits):
    _, _, records = load_v3(vectors, name, 0, bits)
    expect_L, expect_R = load_expect(vectors, name, 0, bits)
    for which, expect in (("L", expect_L), ("R", expect_R)):
        codes, radii = stored_rows(records, which)
        decoded = tq.dequantize_rows(codes, radii, expect.shape[-1], tq.CODEC_POLAR, bits)
        error = np.linalg.norm((decoded - expect).astype(np.float64), axis=-1)
        norm = np.linalg.norm(expect.astype(np.float64), axis=-1)
        assert np.all(error <= 1e-5 * norm), f"rel-L2 up to {np.max(error / np.maximum(norm, 1e-30)):.3g}"


@pytest.mark.parametrize("name,bits", [(name, bits) for name in GEOMETRIES for bits in POLAR_BITS])
def test_polar_vector_codes_and_radii_from_source(vectors, name, bits):
    _, L, R, _ = load_source(vectors, name)
    _, _, records = load_v3(vectors, name, 0, bits)
    agreeing = total = 0
    for which, rows in (("L", L), ("R", R)):
        codes, radii = tq.quantize_rows(rows, tq.CODEC_POLAR, bits)
        stored_codes, stored_radii = stored_rows(records, which)
        # The radius is plain f64 arithmetic: exact. The codes go through atan2f.
        np.testing.assert_array_equal(radii.view(np.uint32), stored_radii.view(np.uint32))
        agreeing += int(np.all(codes == stored_codes, axis=-1).sum())
        total += codes.shape[0] * codes.shape[1]
    assert agreeing >= 0.999 * total, f"only {agreeing}/{total} rows agree"


def test_vector_special_rows_are_inert(vectors):
    """README's special rows: all-zero and subnormal rows store radius 0; the NaN row too."""
    for name in GEOMETRIES:
        _, _, records = load_v3(vectors, name, 1, 4)
        _, L_radii = stored_rows(records, "L")
        _, R_radii = stored_rows(records, "R")
        assert L_radii[0, 1] == 0 and L_radii[1, 3] == 0 and R_radii[0, 4] == 0
        _, L, R, _ = load_source(vectors, name)
        _, radii = tq.quantize_rows(L, tq.CODEC_INT4, 4)
        assert radii[0, 1] == 0 and radii[1, 3] == 0 and radii[0, 2] > 1234


# ----------------------------------------------------------------- literal spec references
# Straight transcriptions of docs/FORMAT.md's loops, slow and obviously right, to check the fast path.


def reference_hash(x: int) -> int:
    mask = 0xFFFFFFFF
    x = (x + 0x9E3779B9) & mask
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & mask
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & mask
    return x ^ (x >> 16)


def reference_fwht(row: np.ndarray) -> np.ndarray:
    a = row.astype(np.float32).copy()
    n = a.size
    length = 1
    while length < n:
        for i in range(0, n, 2 * length):
            for j in range(i, i + length):
                a[j], a[j + length] = a[j] + a[j + length], a[j] - a[j + length]
        length *= 2
    return a * (np.float32(1.0) / np.sqrt(np.float32(n)))


def reference_radius(row: np.ndarray) -> np.float32:
    total = 0.0
    for value in row.tolist():  # python floats: float64 squares, added in index order
        total += value * value
    return np.float32(math.sqrt(total))


def reference_polar_stream(codes_by_level, b1: int, b2: int, n_bytes: int) -> bytes:
    """LSB-first bit stream, level 1 first, written with python integers."""
    stream, position = 0, 0
    for level, codes in enumerate(codes_by_level):
        width = b1 if level == 0 else b2
        for code in codes:
            stream |= int(code) << position
            position += width
    return stream.to_bytes(n_bytes, "little")


@pytest.mark.parametrize("n", [2, 8, 64, 512, 2048])
def test_signs_match_the_spec_hash(n):
    expected = [-1.0 if reference_hash(0x9E3779B9 ^ i) & 1 else 1.0 for i in range(n)]
    assert tq.signs(n).tolist() == expected
    assert tq.signs(n) is tq.signs(n)  # cached
    with pytest.raises(ValueError):
        tq.signs(n)[0] = 2.0  # the cached vector is read-only


@pytest.mark.parametrize("n", [2, 4, 16, 128])
def test_rotate_matches_the_literal_butterflies_bit_for_bit(n):
    rows = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32) * np.float32(3.7)
    expected = np.stack([reference_fwht(row * tq.signs(n)) for row in rows])
    np.testing.assert_array_equal(tq.rotate(rows).view(np.uint32), expected.view(np.uint32))
    expected_back = np.stack([reference_fwht(row) * tq.signs(n) for row in rows])
    np.testing.assert_array_equal(tq.unrotate(rows).view(np.uint32), expected_back.view(np.uint32))


@pytest.mark.parametrize("n_rows", [1, 2, 3, 700])
def test_radius_is_float64_sequential_sum_of_float64_squares(n_rows):
    # Wide dynamic range, so that f32 squares or pairwise summation would show.
    rng = np.random.default_rng(n_rows)
    rows = (rng.standard_normal((n_rows, 512)) * np.exp(rng.uniform(-30, 30, (n_rows, 512)))).astype(np.float32)
    # A row whose sum sits on an f32 tie: added in order, the 2^-54 squares are each lost to
    # rounding and the radius rounds to 1.0; summed any other way they tip it to 1 + 2^-23.
    tie_row = np.full(512, 2.0**-27, np.float32)
    tie_row[:4] = [1.0, 2.0**-12, 2.0**-12, 2.0**-24]
    rows[0] = tie_row
    expected = np.array([reference_radius(row) for row in rows], dtype=np.float32)
    assert expected[0] == 1.0
    np.testing.assert_array_equal(tq.radius(rows).view(np.uint32), expected.view(np.uint32))
    codes, radii = tq.quantize_rows(rows, tq.CODEC_INT4, 4)
    np.testing.assert_array_equal(radii.view(np.uint32), expected.view(np.uint32))


def test_int4_threshold_and_cell_edges_match_brute_force():
    """Nearest level, first index on a tie, with f32 distances, at every decision point."""
    around_points = (
        (tq.THRESHOLDS.view(np.int32)[:, None] + np.arange(-400, 400, dtype=np.int32)).ravel().view(np.float32)
    )
    edges = ((np.arange(385) - 192) / 64).astype(np.float32)
    steps = np.arange(1, 40, dtype=np.float32)[None, :] * np.spacing(np.abs(edges) + np.float32(1e-30))[:, None]
    around_edges = np.concatenate([edges, (edges[:, None] + steps).ravel(), (edges[:, None] - steps).ravel()])
    spread = np.random.default_rng(0).uniform(-50, 50, 200_000).astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 7.4e-9, -7.4e-9, 2.733, -2.733, 46.0, -46.0], np.float32)
    values = np.concatenate([around_points, around_edges, spread, specials])
    brute = np.abs(values[:, None] - tq.LEVELS[None, :]).argmin(axis=1)  # argmin keeps the first
    np.testing.assert_array_equal(tq._nearest_level(values), brute)
    with np.errstate(invalid="ignore"):  # the spec's argmin over NaN distances keeps index 0
        assert tq._nearest_level(np.array([np.nan], np.float32)).tolist() == [0]


def test_inputs_are_never_modified():
    """The butterflies run in place on a private copy, also for a single row (an [n, 1] view)."""
    for rows in (gaussian_rows(1, 1, 64, 0.0), gaussian_rows(1, 5, 64, 0.0)):
        before = rows.copy()
        tq.rotate(rows)
        tq.unrotate(rows)
        tq.radius(rows)
        for codec, bits in CODECS:
            codes, radii = tq.quantize_rows(rows, codec, bits)
            codes_before = codes.copy()
            tq.dequantize_rows(codes, radii, 64, codec, bits)
            np.testing.assert_array_equal(codes, codes_before)
        np.testing.assert_array_equal(rows, before)


def test_int4_matches_literal_encoder_on_random_rows():
    rng = np.random.default_rng(7)
    for n in (2, 16, 256):
        rows = (rng.standard_normal((40, n)) * rng.uniform(0.01, 100, (40, 1))).astype(np.float32)
        codes, radii = tq.quantize_rows(rows, tq.CODEC_INT4, 4)
        for row, row_codes, row_radius in zip(rows, codes, radii):
            scaled = reference_fwht(row * tq.signs(n)) * (np.sqrt(np.float32(n)) / reference_radius(row))
            nearest = np.abs(scaled[:, None] - tq.LEVELS[None, :]).argmin(axis=1).astype(np.uint8)
            packed = nearest[0::2] | (nearest[1::2] << 4)
            assert row_radius == reference_radius(row)
            assert row_codes.tobytes() == packed.tobytes()


@pytest.mark.parametrize("n,bits", [(2, 2), (4, 3), (8, 6), (16, 2), (64, 4), (512, 5)])
def test_polar_matches_literal_encoder(n, bits):
    rows = np.random.default_rng(n + bits).standard_normal((6, n)).astype(np.float32)
    codes, _ = tq.quantize_rows(rows, tq.CODEC_POLAR, bits)
    b1, b2 = bits, max(bits - 1, 1)
    pi = np.float32(3.14159265358979323846)
    for row, row_codes in zip(rows, codes):
        r = reference_fwht(row * tq.signs(n))
        m, level, levels = n, 1, []
        while m > 1:
            level_codes = []
            for j in range(m // 2):
                ang = np.arctan2(r[2 * j + 1], r[2 * j])
                if level == 1:
                    q = np.floor((ang + pi) * (np.float32(0.5) / pi) * np.float32(2**b1))
                    q = min(max(int(q), 0), 2**b1 - 1)
                else:
                    w = min(np.float32(1.5) / np.sqrt(np.float32(2 ** (level - 1))), pi / np.float32(4))
                    lo = pi / np.float32(4) - w
                    q = np.floor((ang - lo) / (np.float32(2) * w) * np.float32(2**b2))
                    q = min(max(int(q), 0), 2**b2 - 1)
                level_codes.append(q)
                r[j] = np.hypot(r[2 * j], r[2 * j + 1])
            levels.append(level_codes)
            m //= 2
            level += 1
        assert row_codes.tobytes() == reference_polar_stream(levels, b1, b2, row_codes.size)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 1024])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_polar_bit_stream_round_trips_any_codes(n, bits):
    """pack/unpack (word-wise for n >= 16, bit-wise below) agree with the literal stream."""
    b1, b2 = bits, max(bits - 1, 1)
    rng = np.random.default_rng(n * 7 + bits)
    n_rows = 5
    level1 = rng.integers(0, 2**b1, (n // 2, n_rows), dtype=np.uint8)
    deeper = rng.integers(0, 2**b2, (n // 2 - 1, n_rows), dtype=np.uint8)
    codes = np.concatenate([level1, deeper])  # feature-major, write order
    n_bytes = tq.row_bytes(n, tq.CODEC_POLAR, bits)
    packed = tq._polar_pack(codes, n, bits, n_bytes)
    for row in range(n_rows):
        expected = reference_polar_stream([level1[:, row], deeper[:, row]], b1, b2, n_bytes)
        assert packed[row].tobytes() == expected
    np.testing.assert_array_equal(tq._polar_unpack(packed, n, bits), codes)


# ----------------------------------------------------------------- properties

WIDTHS = [2**k for k in range(1, 12)]
CODECS = [(tq.CODEC_INT4, 4)] + [(tq.CODEC_POLAR, bits) for bits in range(2, 7)]


def gaussian_rows(seed: int, n_rows: int, n: int, log_scale: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_rows, n)) * np.exp(log_scale)).astype(np.float32)


def rel_l2(decoded: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.linalg.norm((decoded - rows).astype(np.float64), axis=-1) / np.linalg.norm(
        rows.astype(np.float64), axis=-1
    )


def polar_nominal(bits: int) -> float:
    """Mean rel-L2 of PolarQuant on Gaussian rows: ~0.57 at 2 bits, halving per bit."""
    return 0.62 / 2 ** (bits - 2)


@pytest.mark.parametrize("codec,bits", CODECS)
def test_round_trip_error_on_gaussian_rows_matches_the_spec(codec, bits):
    rows = gaussian_rows(3, 300, 512, 0.0)
    codes, radii = tq.quantize_rows(rows, codec, bits)
    errors = rel_l2(tq.dequantize_rows(codes, radii, 512, codec, bits), rows)
    if codec == tq.CODEC_INT4:
        assert 0.08 < errors.mean() < 0.105  # the spec measures ~0.096
    else:
        assert 0.5 * polar_nominal(bits) < errors.mean() < polar_nominal(bits)  # ~0.147 at 4 bits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    log2_n=st.integers(1, 11),
    n_rows=st.integers(1, 9),
    log_scale=st.floats(-60, 60),
    seed=st.integers(0, 2**32 - 1),
    case=st.sampled_from(CODECS),
)
def test_round_trip_bounds_any_width_and_scale(log2_n, n_rows, log_scale, seed, case):
    codec, bits = case
    n = 2**log2_n
    rows = gaussian_rows(seed, n_rows, n, log_scale)
    codes, radii = tq.quantize_rows(rows, codec, bits)
    assert codes.shape == (n_rows, tq.row_bytes(n, codec, bits)) and codes.dtype == np.uint8
    np.testing.assert_array_equal(radii, tq.radius(rows))
    errors = rel_l2(tq.dequantize_rows(codes, radii, n, codec, bits), rows)
    bound = 0.26 if codec == tq.CODEC_INT4 else 2.0 * polar_nominal(bits)
    assert np.all(errors < bound), f"rel-L2 {errors.max():.3f} over {bound:.3f}"


@settings(max_examples=60, deadline=None)
@given(
    log2_n=st.integers(1, 11),
    seed=st.integers(0, 2**32 - 1),
    log_scale=st.floats(-80, 80),
)
def test_unrotate_inverts_rotate_within_f32_rounding(log2_n, seed, log_scale):
    n = 2**log2_n
    rows = gaussian_rows(seed, 3, n, log_scale)
    rotated = tq.rotate(rows)
    back = tq.unrotate(rotated)
    norms = np.linalg.norm(rows.astype(np.float64), axis=-1)
    slack = 2e-7 * (log2_n + 1) * norms + 1e-44 * n  # a few ulps per butterfly stage
    assert np.all(np.linalg.norm((back - rows).astype(np.float64), axis=-1) <= slack)
    assert np.allclose(np.linalg.norm(rotated.astype(np.float64), axis=-1), norms, rtol=2e-6 * (log2_n + 1))


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=16, max_size=16),
    case=st.sampled_from(CODECS),
)
def test_any_f32_row_encodes_and_decodes_without_garbage(values, case):
    """Hostile rows (NaN, inf, extremes): either inert or live, never NaN/undefined codes."""
    codec, bits = case
    row = np.array(values, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning leaks out
        codes, radii = tq.quantize_rows(row, codec, bits)
        decoded = tq.dequantize_rows(codes, radii, 16, codec, bits)
    true_radius = tq.radius(row)
    live = np.all(np.isfinite(row)) and 1e-35 < true_radius <= 3.4e38
    if live:
        assert radii == true_radius
    else:
        assert radii == 0 and not codes.any() and not decoded.any()
    if radii < 1e36:  # far from f32's limit, nothing in the butterflies can overflow
        assert np.all(np.isfinite(decoded))


@pytest.mark.parametrize("codec,bits", CODECS)
@pytest.mark.parametrize("n", WIDTHS)
def test_every_power_of_two_width_round_trips(n, codec, bits):
    rows = gaussian_rows(n, 4, n, 0.0)
    codes, radii = tq.quantize_rows(rows, codec, bits)
    assert codes.shape == (4, tq.row_bytes(n, codec, bits))
    assert np.all(radii > 0)
    bound = 0.3 if codec == tq.CODEC_INT4 else 2.0 * polar_nominal(bits)
    assert np.all(rel_l2(tq.dequantize_rows(codes, radii, n, codec, bits), rows) < bound)


@pytest.mark.parametrize("codec,bits", CODECS)
@pytest.mark.parametrize("n", [1, 3, 6, 12, 100, 513, 4096])
def test_unsupported_widths_encode_and_decode_as_zeros(n, codec, bits):
    rows = gaussian_rows(1, 3, n, 0.0)
    codes, radii = tq.quantize_rows(rows, codec, bits)
    assert codes.shape == (3, tq.row_bytes(n, codec, bits))
    assert not codes.any() and not radii.any()
    junk = np.full(codes.shape, 0xA5, np.uint8)
    assert not tq.dequantize_rows(junk, np.ones(3, np.float32), n, codec, bits).any()
    with pytest.raises(FormatError):
        tq.rotate(rows)


@pytest.mark.parametrize("codec,bits", CODECS)
def test_edge_rows_are_inert(codec, bits):
    n = 64
    rows = np.zeros((6, n), dtype=np.float32)
    rows[1] = 1e-39  # subnormal: radius ~8e-39, not above 1e-35
    rows[2, 5] = np.inf
    rows[3, 7] = np.nan
    rows[4, :] = -np.inf
    rows[5] = gaussian_rows(5, 1, n, -69.0)[0]  # |x| ~ 1e-30: tiny but above the floor, live
    codes, radii = tq.quantize_rows(rows, codec, bits)
    assert not codes[:5].any() and not radii[:5].any()
    assert radii[5] > 0
    decoded = tq.dequantize_rows(codes, radii, n, codec, bits)
    assert not decoded[:5].any()
    assert rel_l2(decoded[5:], rows[5:])[0] < (0.3 if codec == tq.CODEC_INT4 else 2.0 * polar_nominal(bits))


@pytest.mark.parametrize("codec,bits", CODECS)
def test_huge_rows_keep_their_scale(codec, bits):
    rows = gaussian_rows(9, 8, 256, 80.0)  # |x| ~ 5e34, radius ~ 8e35
    codes, radii = tq.quantize_rows(rows, codec, bits)
    decoded = tq.dequantize_rows(codes, radii, 256, codec, bits)
    assert np.all(np.isfinite(decoded))
    assert np.all(rel_l2(decoded, rows) < (0.3 if codec == tq.CODEC_INT4 else 2.0 * polar_nominal(bits)))
    # At the edge of f32 the butterflies overflow; the codes are still defined.
    edge = np.full((1, 256), 1e37, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        edge_codes, edge_radii = tq.quantize_rows(edge, codec, bits)
    assert edge_radii[0] == tq.radius(edge)[0] and edge_codes.shape == (1, tq.row_bytes(256, codec, bits))


@pytest.mark.parametrize("codec,bits", CODECS)
def test_corrupt_radii_decode_as_zeros(codec, bits):
    rows = gaussian_rows(2, 6, 32, 0.0)
    codes, radii = tq.quantize_rows(rows, codec, bits)
    radii[:5] = [np.nan, -1.0, np.inf, 1e-36, np.nextafter(np.float32(3.4e38), np.float32(np.inf))]
    decoded = tq.dequantize_rows(codes, radii, 32, codec, bits)
    assert not decoded[:5].any() and decoded[5].any()


def test_sanitize_radii():
    radii = np.array([1.5, 0.0, -0.0, -1.0, np.nan, np.inf, 3.4e38, 3.3e38, 1e-40], np.float32)
    clean, bad = tq.sanitize_radii(radii)
    assert bad.tolist() == [False, False, False, True, True, True, True, False, False]
    assert clean.dtype == np.float32
    np.testing.assert_array_equal(clean, np.where(bad, 0, radii))


@pytest.mark.parametrize("codec,bits", CODECS)
def test_shapes_chunks_and_out(codec, bits):
    """Any leading shape; results do not depend on where chunk boundaries fall."""
    n = 64
    rows = gaussian_rows(4, 2600, n, 0.0)  # more rows than one chunk holds
    codes, radii = tq.quantize_rows(rows, codec, bits)
    row_codes = np.concatenate([tq.quantize_rows(rows[i : i + 7], codec, bits)[0] for i in range(0, 2600, 7)])
    np.testing.assert_array_equal(codes, row_codes)
    cube_codes, cube_radii = tq.quantize_rows(rows.reshape(2, 1300, n), codec, bits)
    np.testing.assert_array_equal(cube_codes.reshape(codes.shape), codes)
    np.testing.assert_array_equal(cube_radii.reshape(radii.shape), radii)
    decoded = tq.dequantize_rows(codes, radii, n, codec, bits)
    out = np.empty((2, 1300, n), np.float32)
    assert tq.dequantize_rows(cube_codes, cube_radii, n, codec, bits, out=out) is out
    np.testing.assert_array_equal(out.reshape(decoded.shape), decoded)
    strided = np.zeros((2600, 2 * n), np.float32)[:, ::2]  # a non-contiguous out
    tq.dequantize_rows(codes, radii, n, codec, bits, out=strided)
    np.testing.assert_array_equal(strided, decoded)
    empty_codes, empty_radii = tq.quantize_rows(np.zeros((0, n), np.float32), codec, bits)
    assert empty_codes.shape == (0, tq.row_bytes(n, codec, bits)) and empty_radii.shape == (0,)
    assert tq.dequantize_rows(empty_codes, empty_radii, n, codec, bits).shape == (0, n)
    single_codes, single_radius = tq.quantize_rows(rows[0], codec, bits)
    assert single_radius.shape == () and np.array_equal(single_codes, codes[0])


def test_invalid_codec_and_bits_are_refused_with_a_reason():
    rows = np.ones((1, 8), np.float32)
    for codec, bits in [(1, 3), (1, 2), (0, 1), (0, 7), (2, 4), (-1, 4)]:
        with pytest.raises(FormatError, match="codec"):
            tq.quantize_rows(rows, codec, bits)
        with pytest.raises(FormatError, match="codec"):
            tq.row_bytes(8, codec, bits)
        with pytest.raises(FormatError, match="codec"):
            tq.dequantize_rows(np.zeros((1, 4), np.uint8), np.ones(1, np.float32), 8, codec, bits)
    with pytest.raises(FormatError):
        tq.row_bytes(-2, tq.CODEC_INT4, 4)
    with pytest.raises(FormatError):
        tq.quantize_rows(np.float32(1.0), tq.CODEC_INT4, 4)


def test_dequantize_validates_its_inputs():
    codes, radii = tq.quantize_rows(np.ones((3, 16), np.float32), tq.CODEC_INT4, 4)
    with pytest.raises(FormatError, match="uint8"):
        tq.dequantize_rows(codes.astype(np.int16), radii, 16, tq.CODEC_INT4, 4)
    with pytest.raises(FormatError, match="bytes per row"):
        tq.dequantize_rows(codes[:, :4], radii, 16, tq.CODEC_INT4, 4)
    with pytest.raises(FormatError, match="radii"):
        tq.dequantize_rows(codes, radii[:2], 16, tq.CODEC_INT4, 4)
    with pytest.raises(FormatError, match="out"):
        tq.dequantize_rows(codes, radii, 16, tq.CODEC_INT4, 4, out=np.empty((3, 16), np.float64))


def test_row_bytes_formulas():
    assert tq.row_bytes(512, tq.CODEC_INT4, 4) == 256
    assert [tq.row_bytes(512, tq.CODEC_POLAR, b) for b in range(2, 7)] == [96, 160, 224, 288, 352]
    assert [tq.row_bytes(64, tq.CODEC_POLAR, b) for b in range(2, 7)] == [12, 20, 28, 36, 44]
    assert tq.row_bytes(2, tq.CODEC_POLAR, 6) == 1
    assert tq.row_bytes(0, tq.CODEC_POLAR, 4) == 0
