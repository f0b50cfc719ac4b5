"""Cache tiers: format arithmetic, device codecs byte-identical to kvstore.formats, growth, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.engine import CacheGeometry, make_cache, preset
from kvstore.engine.errors import CacheError, TierUnsupported
from kvstore.formats import coli_kv, fp8, q8, tq
from kvstore.gpu import codecs

GEOMETRIES = [CacheGeometry(4, 64, 32), CacheGeometry(27, 512, 64), CacheGeometry(61, 512, 64)]


def _rows(shape, seed=0) -> np.ndarray:
    """Rows over a wide dynamic range, with the special values the codecs must handle."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, (*shape[:-1], 1)))
    x = x.astype(np.float32).reshape(-1, shape[-1])
    x[0] = 0.0
    width = shape[-1]
    x[1, 0] = np.nan
    x[2] = 1e-39  # subnormal row
    x[3, 1 % width] = np.inf
    x[4, 2 % width] = -0.0
    x[5, 3 % width] = 1234.5
    return x.reshape(shape)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"L{g.n_layers}-K{g.kv_lora}-R{g.qk_rope}")
def test_bytes_per_token_matches_the_format_arithmetic(geometry):
    L, K, R = geometry.n_layers, geometry.kv_lora, geometry.qk_rope
    file_geometry = coli_kv.Geometry(L, K, R, 0, 0, 1000)

    def record_kv_bytes(tier):  # a record minus its token id
        return coli_kv.record_bytes(file_geometry, tier) - 4

    expected = {
        "f32": record_kv_bytes(tiers.F32),
        "bf16": L * (K + R) * 2,
        "fp8": record_kv_bytes(tiers.FP8),
        "int4": record_kv_bytes(tiers.INT4),
        **{f"polar{bits}": record_kv_bytes(tiers.polar(bits)) for bits in tiers.POLAR_BITS},
        "q8": L * (K + R + 2 * (K + R) // 32),
    }
    assert set(expected) == set(tiers.names())
    assert expected["fp8"] == L * (K + R + 8)
    assert expected["int4"] == L * (K // 2 + R // 2 + 8)
    for tier, want in expected.items():
        cache = make_cache(tier, geometry)
        assert cache.bytes_per_token == want, tier  # what the cache allocates
        assert geometry.bytes_per_token(tier) == want, tier  # what the tier table says


def test_fp8_device_encoder_reproduces_the_golden_encode_table(vectors):
    pairs = np.fromfile(vectors / "fp8_enc.bin", dtype=np.dtype([("x", "<f4"), ("code", "u1")]))
    got = codecs.fp8_encode(torch.from_numpy(np.ascontiguousarray(pairs["x"])))
    np.testing.assert_array_equal(got.numpy(), pairs["code"])


def test_fp8_tier_writes_the_bytes_of_formats_fp8():
    geometry = CacheGeometry(3, 64, 32)
    lc, rc = _rows((3, 40, 64), 1), _rows((3, 40, 32), 2)
    cache = make_cache("fp8", geometry)
    cache.prepare(0, 40)
    for layer in range(3):
        cache.write(layer, 0, torch.from_numpy(lc[layer]), torch.from_numpy(rc[layer]))
    cache.commit(0, np.arange(40))
    rows = cache.export_rows()
    for got_codes, got_scales, source in ((rows.lc, rows.lc_scales, lc), (rows.rc, rows.rc_scales, rc)):
        codes, scales = fp8.quantize_rows(source)
        np.testing.assert_array_equal(got_codes, codes)
        assert got_scales.tobytes() == scales.tobytes()


@pytest.mark.parametrize("width", [2, 16, 64, 512])
def test_int4_device_codec_is_byte_identical_to_formats_tq(width):
    x = _rows((700, width), width)
    codes, radii = tq.quantize_rows(x, tq.CODEC_INT4, 4)
    got_codes, got_radii = codecs.int4_quantize_rows(torch.from_numpy(x))
    np.testing.assert_array_equal(got_codes.numpy(), codes)
    assert got_radii.numpy().tobytes() == radii.tobytes()
    decoded = codecs.int4_dequantize_rows(torch.from_numpy(codes), torch.from_numpy(radii)).numpy()
    np.testing.assert_array_equal(decoded, tq.dequantize_rows(codes, radii, width, tq.CODEC_INT4, 4))


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
@pytest.mark.parametrize("width", [4, 64, 512])
def test_polar_device_codec_agrees_with_formats_tq(width, bits):
    """atan2/hypot/cos/sin differ by an ulp between libraries: codes agree on >= 99.9% of rows
    and decoding stays within 1e-5 of the row norm (the golden-vector contract)."""
    x = _rows((2000, width), 100 + width + bits)
    codes, radii = tq.quantize_rows(x, tq.CODEC_POLAR, bits)
    got_codes, got_radii = codecs.polar_quantize_rows(torch.from_numpy(x), bits)
    same_rows = (got_codes.numpy() == codes).all(axis=-1).mean()
    assert same_rows >= 0.999
    assert got_radii.numpy().tobytes() == radii.tobytes()
    want = tq.dequantize_rows(codes, radii, width, tq.CODEC_POLAR, bits)
    got = codecs.polar_dequantize_rows(torch.from_numpy(codes), torch.from_numpy(radii), width, bits).numpy()
    err = np.linalg.norm(got - want, axis=-1)
    assert (err <= 1e-5 * np.maximum(np.linalg.norm(want, axis=-1), 1e-30)).all()


def test_q8_device_codec_is_byte_identical_to_formats_q8():
    x = _rows((500, 64), 7)
    x[6, :32] = np.nan  # a block of NaN only
    x[7, 0] = 1e9  # a delta past fp16's range: the block is stored inert
    codes, deltas = q8.quantize_blocks(x)
    got_codes, got_deltas = codecs.q8_quantize_blocks(torch.from_numpy(x))
    np.testing.assert_array_equal(got_codes.numpy(), codes)
    assert got_deltas.numpy().tobytes() == deltas.tobytes()
    np.testing.assert_array_equal(
        codecs.q8_dequantize_blocks(got_codes, got_deltas).numpy(), q8.dequantize_blocks(codes, deltas)
    )


@pytest.mark.parametrize("tier", tiers.names())
def test_rows_read_back_through_the_tier_codec(tier):
    geometry = CacheGeometry(2, 64, 32)
    rng = np.random.default_rng(3)
    lc = rng.standard_normal((2, 10, 64)).astype(np.float32)
    rc = rng.standard_normal((2, 10, 32)).astype(np.float32)
    cache = make_cache(tier, geometry)
    cache.prepare(0, 10)
    for layer in range(2):
        cache.write(layer, 0, torch.from_numpy(lc[layer]), torch.from_numpy(rc[layer]))
    cache.commit(0, np.arange(10))
    _, got_l, got_r = cache.export_f32()
    bf16 = lambda x: torch.from_numpy(x).bfloat16().float().numpy()  # noqa: E731
    reference = {
        "f32": lambda x: x,
        "bf16": bf16,
        "fp8": lambda x: fp8.dequantize_rows(*fp8.quantize_rows(x)),
        "q8": lambda x: q8.dequantize_blocks(*q8.quantize_blocks(x)),
    }.get(
        tier,
        lambda x: tq.dequantize_rows(
            *tq.quantize_rows(x, cache.tier.codec, cache.tier.bits), x.shape[-1], cache.tier.codec, cache.tier.bits
        ),
    )
    np.testing.assert_allclose(got_l, reference(lc), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_r, reference(rc), rtol=1e-5, atol=1e-6)
    lc0, rc0 = cache.read(1, 10)
    np.testing.assert_array_equal(lc0.numpy(), got_l[1])
    np.testing.assert_array_equal(rc0.numpy(), got_r[1])


def test_growth_keeps_committed_rows_and_tokens():
    cache = make_cache("fp8", CacheGeometry(1, 64, 32), capacity=2)
    rng = np.random.default_rng(4)
    written = []
    for position in range(300):  # past several growth steps
        row_l = torch.from_numpy(rng.standard_normal((1, 64)).astype(np.float32))
        row_r = torch.from_numpy(rng.standard_normal((1, 32)).astype(np.float32))
        cache.prepare(position, 1)
        cache.write(0, position, row_l, row_r)
        cache.commit(position, [position % 97])
        written.append(row_l.numpy()[0])
    assert cache.length == 300 and cache.capacity >= 300
    np.testing.assert_array_equal(cache.tokens, np.arange(300) % 97)
    codes, _ = fp8.quantize_rows(np.stack(written))
    np.testing.assert_array_equal(cache.export_rows().lc[0], codes)


def test_prepare_truncates_and_refuses_gaps():
    cache = make_cache("f32", CacheGeometry(1, 64, 32))
    cache.prepare(0, 5)
    cache.commit(0, [1, 2, 3, 4, 5])
    with pytest.raises(CacheError):
        cache.prepare(6, 1)  # would leave position 5 without a row
    with pytest.raises(CacheError):
        cache.commit(6, [9])
    cache.prepare(3, 1)  # rewrite from position 3: rows 3.. are dropped
    assert cache.length == 3
    cache.commit(3, [7])
    np.testing.assert_array_equal(cache.tokens, [1, 2, 3, 7])
    with pytest.raises(CacheError):
        cache.export_rows(0, 10)


def test_copy_is_independent():
    cache = make_cache("int4", CacheGeometry(1, 64, 32))
    cache.prepare(0, 3)
    cache.write(0, 0, torch.ones(3, 64), torch.ones(3, 32))
    cache.commit(0, [1, 2, 3])
    clone = cache.copy()
    cache.prepare(1, 1)
    cache.write(0, 1, torch.zeros(1, 64), torch.zeros(1, 32))
    cache.commit(1, [9])
    assert clone.tokens.tolist() == [1, 2, 3]
    assert (clone.export_rows().lc_scales[0] > 0).all()
    assert cache.export_rows().lc_scales[0, 1] == 0


def test_tiers_refuse_geometries_they_cannot_hold():
    with pytest.raises(TierUnsupported, match="kv_lora: int4 needs power-of-two"):
        make_cache("int4", CacheGeometry(2, 48, 32))
    with pytest.raises(TierUnsupported, match="qk_rope: q8 .* multiples of 32"):
        make_cache("q8", CacheGeometry(2, 64, 16))
    with pytest.raises(tiers.UnknownTier, match="unknown tier 'fp4'"):
        make_cache("fp4", CacheGeometry(2, 64, 32))
    with pytest.raises(tiers.UnknownTier, match="bits does not apply to tier 'int4'"):
        make_cache("int4", CacheGeometry(2, 64, 32), bits=3)
    with pytest.raises(tiers.UnknownTier, match="bits does not apply to tier 'fp8'"):
        make_cache("fp8", CacheGeometry(2, 64, 32), bits=4)


def test_tiers_are_taken_by_object_or_canonical_name_and_old_names_warn():
    geometry = CacheGeometry(1, 64, 32)
    assert make_cache(tiers.polar(3), geometry).tier is tiers.polar(3)
    assert make_cache("polar3", geometry).tier is tiers.polar(3)
    assert make_cache("polar3", geometry, bits=3).tier is tiers.polar(3)
    for old, bits, new in (
        ("tq-int4", None, "int4"),
        ("tq-polar", 3, "polar3"),
        ("tq-polar", None, "polar4"),
        ("int8", None, "q8"),
    ):
        with pytest.warns(tiers.TierSpellingDeprecated, match=f"use '{new}'"):
            cache = make_cache(old, geometry, bits=bits)
        assert cache.tier is tiers.get(new)
        assert cache.tier.file_tier is (tiers.F32 if new == "q8" else cache.tier)


def test_v2_lite_geometry_is_held_by_every_tier():
    geometry = CacheGeometry.of(preset("v2-lite"))
    assert (geometry.n_layers, geometry.kv_lora, geometry.qk_rope) == (27, 512, 64)
    for tier in tiers.names():
        assert make_cache(tier, geometry).bytes_per_token == geometry.bytes_per_token(tier)


def test_fp8_restore_sanitizes_rows_handed_over_directly():
    from kvstore.engine import StoredRows

    rng = np.random.default_rng(8)
    codes = rng.integers(0, 256, (1, 6, 64)).astype(np.uint8)
    codes[0, 0, :4] = [0x7F, 0xFF, 0x01, 0x81]
    # 1e37 is below f32's limit but above 3.4e38/448, the largest scale an encoder writes: a reader
    # must treat it as corrupt (code 0x7E times 1e37 would decode to inf)
    scales = np.array([[1.0, np.nan, -2.0, np.inf, 1e37, 3.0]], np.float32)
    codes[0, 4, 0] = 0x7E
    rc = np.zeros((1, 6, 32), np.uint8)
    rows = StoredRows(np.arange(6, dtype=np.int32), 2, codes, rc, scales, np.ones((1, 6), np.float32))
    handed = codes.copy()
    cache = make_cache("fp8", CacheGeometry(1, 64, 32))
    cache.restore(rows)
    assert np.array_equal(codes, handed)  # sanitized on the device copy, never in the caller's rows
    _, lc, _ = cache.export_f32()
    clean = codes.copy()
    clean[fp8.nan_codes(clean)] = 0
    clean_scales = scales.copy()
    bad = fp8.bad_scales(scales)
    clean[bad] = 0
    clean_scales[bad] = 1.0
    np.testing.assert_array_equal(lc, fp8.dequantize_rows(clean, clean_scales))
    assert np.isfinite(lc).all()
