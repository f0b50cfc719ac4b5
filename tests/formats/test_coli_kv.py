import struct

import numpy as np
import pytest

from golden import GEOMETRIES, V3_VARIANTS, read_expect, read_src
from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.formats.errors import BadHeader, BadMagic, CodecMismatch, GeometryMismatch, TruncatedHeader

TIERS = {"v1": tiers.F32, "v2": tiers.FP8, **{v: tiers.from_file(3, int(v[3]), int(v[5])) for v in V3_VARIANTS}}
EXACT = ["v1", "v2", "v3c1b4"]


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("variant", EXACT)
def test_writing_src_reproduces_the_file_byte_for_byte(vectors, name, variant):
    tokens, L, R, I = read_src(vectors, name)
    g, _ = GEOMETRIES[name]
    tier = TIERS[variant]
    blob = coli_kv.encode_file(g, tokens, L, R, I, version=tier.version, codec=tier.codec, bits=tier.bits)
    expected = (vectors / f"{name}.{variant}.coli_kv").read_bytes()
    assert len(blob) == len(expected)
    assert blob == expected


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("variant", EXACT)
def test_loading_dequantizes_bit_exactly(vectors, name, variant):
    tokens, L, R, I = read_src(vectors, name)
    records = coli_kv.load(vectors / f"{name}.{variant}.coli_kv")
    g, n = GEOMETRIES[name]
    assert records.geometry == g and records.n == n and records.tier == TIERS[variant]
    assert (records.tokens == tokens).all()
    got_L, got_R, got_I = records.dequantize()
    want_L, want_R = read_expect(vectors, name, variant)
    assert got_L.tobytes() == want_L.tobytes()
    assert got_R.tobytes() == want_R.tobytes()
    if g.nic:
        assert got_I.tobytes() == I.tobytes()
    else:
        assert got_I is None


def _rel_row_error(got, want):
    norms = np.linalg.norm(want.astype(np.float64), axis=-1)
    err = np.linalg.norm(got.astype(np.float64) - want, axis=-1)
    return np.where(norms > 0, err / np.where(norms > 0, norms, 1), err)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("variant", [v for v in V3_VARIANTS if v.startswith("v3c0")])
def test_polar_files_load_within_tolerance_and_codes_mostly_agree(vectors, name, variant):
    tokens, L, R, I = read_src(vectors, name)
    g, n = GEOMETRIES[name]
    records = coli_kv.load(vectors / f"{name}.{variant}.coli_kv")
    got_L, got_R, _ = records.dequantize()
    want_L, want_R = read_expect(vectors, name, variant)
    assert _rel_row_error(got_L, want_L).max() <= 1e-5
    assert _rel_row_error(got_R, want_R).max() <= 1e-5
    tier = TIERS[variant]
    ours = coli_kv.parse(coli_kv.encode_file(g, tokens, L, R, I, version=3, codec=tier.codec, bits=tier.bits))
    theirs = records.records["layers"]
    for field in ("Lc", "Rc"):
        same = (ours.records["layers"][field] == theirs[field]).all(axis=-1)
        assert same.mean() >= 0.999
    for field in ("Ls", "Rs"):  # the radius is computed exactly
        assert ours.records["layers"][field].tobytes() == theirs[field].tobytes()


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_torn_file_loads_the_committed_records(vectors, name):
    g, n = GEOMETRIES[name]
    records = coli_kv.load(vectors / f"{name}.v2.torn.coli_kv")
    assert records.n == n - 2
    assert records.problems.torn_tail_bytes > 0
    full = coli_kv.load(vectors / f"{name}.v2.coli_kv")
    torn_L = records.dequantize()[0]
    assert torn_L.tobytes() == full.dequantize()[0][:, : n - 2].tobytes()


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_overclaiming_header_is_clamped(vectors, name):
    g, n = GEOMETRIES[name]
    records = coli_kv.load(vectors / f"{name}.v1.overclaim.coli_kv")
    assert records.header.nrec == n + 3
    assert records.n == n
    assert records.problems.overclaim == 3
    assert any("claims 3 more" in m for m in records.problems.messages())


def _small_file(version=2, n=4, codec=None, bits=None):
    g = Geometry(2, 8, 4, 0, 0, 50)
    rng = np.random.default_rng(n)
    L = rng.standard_normal((2, n, 8)).astype(np.float32)
    R = rng.standard_normal((2, n, 4)).astype(np.float32)
    return g, bytearray(
        coli_kv.encode_file(g, np.arange(n, dtype=np.int32), L, R, version=version, codec=codec, bits=bits)
    )


def test_header_validation_order_and_typed_errors():
    g, blob = _small_file()
    with pytest.raises(TruncatedHeader):
        coli_kv.parse(bytes(blob[:39]))
    bad = bytearray(blob)
    bad[:8] = b"COLIKV9\0"
    with pytest.raises(BadMagic, match="magic"):
        coli_kv.parse(bytes(bad))
    for word, value, message in [
        (0, 0, "n_layers"),
        (0, -5, "n_layers"),
        (1, 1 << 30, "kv_lora"),
        (2, -1, "qk_rope"),
        (4, 3, "nic"),
        (3, 16, "index_hd"),
        (5, 0, "vocab"),
        (6, -1, "nrec"),
        (7, 0, "tag"),
    ]:
        bad = bytearray(blob)
        struct.pack_into("<i", bad, 8 + 4 * word, value)
        with pytest.raises(BadHeader, match=message):
            coli_kv.parse(bytes(bad))


def test_huge_claimed_count_allocates_nothing_beyond_the_file():
    g, blob = _small_file(n=3)
    struct.pack_into("<i", blob, 32, 2**31 - 1)
    records = coli_kv.parse(bytes(blob))
    assert records.n == 3 and records.problems.overclaim == 2**31 - 1 - 3


def test_v3_tags_are_checked():
    g, blob = _small_file(version=3, codec=1, bits=4)
    assert coli_kv.parse(bytes(blob)).tier == tiers.INT4
    for tag in [(1 << 8) | 3, (2 << 8) | 4, (0 << 8) | 7, (0 << 8) | 1]:
        bad = bytearray(blob)
        struct.pack_into("<i", bad, 36, tag)
        with pytest.raises(BadHeader):
            coli_kv.parse(bytes(bad))


def test_expected_geometry_and_tier_are_enforced():
    g, blob = _small_file()
    other = Geometry(2, 8, 4, 0, 0, 51)
    with pytest.raises(GeometryMismatch, match="vocab: file 50, expected 51"):
        coli_kv.parse(bytes(blob), expect=other)
    with pytest.raises(CodecMismatch, match="v2"):
        coli_kv.parse(bytes(blob), tier=tiers.F32)
    assert coli_kv.parse(bytes(blob), expect=g, tier=tiers.FP8).n == 4


def test_sanitize_on_load_v2():
    g, blob = _small_file(n=3)
    records = coli_kv.parse(bytes(blob))
    dtype = records.records.dtype
    rec = dtype.itemsize
    layer_off = dtype.fields["layers"][1]
    ldt = dtype.fields["layers"][0].base
    # record 1, layer 0: NaN scale -> inert row; record 2, layer 1: two NaN codes in Rc.
    struct.pack_into("<f", blob, 40 + rec + layer_off + ldt.fields["Ls"][1], float("nan"))
    rc_off = 40 + 2 * rec + layer_off + ldt.itemsize + ldt.fields["Rc"][1]
    blob[rc_off] = 0x7F
    blob[rc_off + 1] = 0xFF
    damaged = coli_kv.parse(bytes(blob))
    assert damaged.problems.bad_scales == 1 and damaged.problems.nan_codes == 2
    L, R, _ = damaged.dequantize()
    clean_L, clean_R, _ = records.dequantize()
    assert (L[0, 1] == 0).all() and np.array_equal(L[1], clean_L[1])
    assert R[1, 2, 0] == 0 and R[1, 2, 1] == 0 and np.array_equal(R[1, 2, 2:], clean_R[1, 2, 2:])
    codes, scales = damaged.quantized("R")
    assert codes[1, 2, 0] == 0 and codes[1, 2, 1] == 0
    codes, scales = damaged.quantized("L")
    assert (codes[0, 1] == 0).all() and scales[0, 1] == 1.0


def test_sanitize_on_load_v3_bad_radius():
    g, blob = _small_file(version=3, codec=1, bits=4, n=2)
    records = coli_kv.parse(bytes(blob))
    dtype = records.records.dtype
    layer_off = dtype.fields["layers"][1]
    ldt = dtype.fields["layers"][0].base
    struct.pack_into("<f", blob, 40 + layer_off + ldt.fields["Rs"][1], -1.0)
    damaged = coli_kv.parse(bytes(blob))
    assert damaged.problems.bad_radii == 1
    L, R, _ = damaged.dequantize()
    assert (R[0, 0] == 0).all()
    assert np.array_equal(L, records.dequantize()[0])


def test_encode_rejects_wrong_shapes_and_tokens():
    g = Geometry(2, 8, 4, 0, 0, 50)
    L = np.zeros((2, 3, 8), np.float32)
    R = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(GeometryMismatch):
        coli_kv.encode_records(g, tiers.FP8, np.arange(3), L[:, :, :7], R)
    with pytest.raises(Exception, match="token ids"):
        coli_kv.encode_records(g, tiers.FP8, np.array([1, 2, 50]), L, R)


SANITIZED = {
    "f32": ["zeroed 2 non-finite f32 values in Lc rows"],
    "bf16": ["zeroed 2 non-finite bf16 values in Lc rows"],
    "fp8": [
        "made 1 Lc rows with a bad scale inert",
        "made 1 Rc rows with a bad scale inert",
        "zeroed 3 NaN codes in Rc rows",
    ],
    "tq": ["made 1 Lc rows with a bad radius inert", "made 1 Rc rows with a bad radius inert"],
}


@pytest.mark.parametrize("tier", [t for t in tiers.TIERS.values() if t.in_file], ids=lambda t: t.name)
def test_sanitized_records_load_clean_and_say_what_changed(tier):
    g = Geometry(2, 64, 32, 8, 1, 50)
    rng = np.random.default_rng(7)
    L, R, I = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 4, 64), (2, 4, 32), (1, 4, 8)))
    image = coli_kv.encode_file(g, np.arange(4), L, R, I, version=tier.version, codec=tier.codec, bits=tier.bits)
    damaged = coli_kv.parse(image).records.copy()
    layers = damaged["layers"]
    if tier.row_codec.scaled:
        layers["Ls"][1, 0] = np.nan
        layers["Rs"][2, 1] = -1.0
    if tier is tiers.F32:
        layers["Lc"][3, 1, :2] = np.inf
    if tier is tiers.BF16:
        layers["Lc"][3, 1, :2] = (0x7F80, 0xFFC0)  # +inf, a NaN
    if tier is tiers.FP8:
        layers["Rc"][0, 0, :3] = 0x7F
    damaged["index"][2, 0, 5] = np.nan
    records = coli_kv.parse(image[:40] + damaged.tobytes())
    assert records.problems.damaged

    fixed, actions = records.sanitized()
    assert actions == [
        *SANITIZED[tier.name if tier.version != 3 else "tq"],
        "zeroed 1 non-finite f32 values in indexer rows",
    ]
    clean = coli_kv.parse(image[:40] + fixed.tobytes())
    assert not clean.problems.damaged
    assert not any(hit.any() for hit in clean.damaged_records().values())
    # What a load reads from the damaged rows is what the repaired rows hold (non-finite f32 values read 0).
    for got, want in zip(clean.dequantize(), records.dequantize()):
        assert want is not None and np.array_equal(got, np.where(np.isfinite(want), want, 0))
