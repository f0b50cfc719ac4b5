"""The tier vocabulary: every tier passes the codec conformance suite; names, old spellings, headers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from conformance.codecs import TOLERANCE, FileTierConformance, TierConformance
from kvstore import tiers
from kvstore.formats import q8, tq
from kvstore.formats.errors import BadHeader, FormatError


def _suite(tier: tiers.Tier) -> type:
    base = FileTierConformance if tier.in_file else TierConformance
    return type(f"Test_{tier.name}", (base,), {"tier": tier, "tolerance": TOLERANCE[tier.name]})


# One test class per tier of the table: a tier added to the vocabulary is tested without a line here.
for _tier in tiers.TIERS.values():
    globals()[f"Test_{_tier.name}"] = _suite(_tier)


def test_every_tier_has_a_tolerance():
    assert set(TOLERANCE) == set(tiers.TIERS)


def test_the_vocabulary():
    assert tiers.names() == ["f32", "bf16", "fp8", "int4", "polar2", "polar3", "polar4", "polar5", "polar6", "q8"]
    assert tiers.names(in_file=False) == ["q8"]
    assert [t.lossy for t in (tiers.F32, tiers.BF16, tiers.FP8, tiers.INT4, tiers.Q8)] == [
        False,
        True,
        True,
        True,
        True,
    ]
    assert tiers.BF16.file_tier is tiers.BF16 and tiers.Q8.file_tier is tiers.F32
    # a bf16 journal is v4, tag 16: a magic the C engine (and kvstore before v4) refuses as unknown
    assert (tiers.BF16.version, tiers.BF16.tag) == (4, 16)
    assert [t.holds_values for t in (tiers.F32, tiers.BF16, tiers.FP8, tiers.INT4, tiers.Q8)] == [
        True,
        True,
        False,
        False,
        True,  # its journal's: f32
    ]


@pytest.mark.parametrize(
    "name, width, expected",
    [
        ("f32", 512, 2048),
        ("bf16", 512, 1024),
        ("fp8", 512, 516),
        ("int4", 512, 260),
        ("polar4", 512, tq.row_bytes(512, tq.CODEC_POLAR, 4) + 4),
        ("q8", 512, 512 + 32),
    ],
)
def test_row_bytes_are_the_format_arithmetic(name, width, expected):
    assert tiers.get(name).row_bytes(width) == expected


@pytest.mark.parametrize("bits", tiers.POLAR_BITS)
def test_polar_row_bytes(bits):
    assert tiers.polar(bits).row_bytes(512) == -(-(256 * bits + 255 * max(bits - 1, 1)) // 8) + 4


@pytest.mark.parametrize(
    "text, codec, bits, name",
    [
        ("v1", None, None, "f32"),
        ("v2", None, None, "fp8"),
        ("v3", None, None, "int4"),
        ("v3", "polar", 3, "polar3"),
        ("v3", "int4", 4, "int4"),
        ("v3", "polar", None, "polar4"),
        ("tq-int4", None, None, "int4"),
        ("tq-polar", None, 5, "polar5"),
        ("tq-polar", None, None, "polar4"),
        ("polar-3", None, None, "polar3"),
        ("v3:polar:2", None, None, "polar2"),
        ("v3:int4:4", None, None, "int4"),
        ("int8", None, None, "q8"),
        ("polar", None, 6, "polar6"),
    ],
)
def test_old_spellings_resolve_with_a_warning(text, codec, bits, name):
    tier, note = tiers.resolve(text, codec=codec, bits=bits)
    assert tier.name == name and note is not None and repr(name) in note
    with pytest.warns(tiers.TierSpellingDeprecated, match=f"use '{name}'"):
        assert tiers.parse(text, codec=codec, bits=bits) is tier


@pytest.mark.parametrize("name", tiers.names())
def test_canonical_names_resolve_silently(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tiers.parse(name).name == name
        assert tiers.parse(name.upper()).name == name


@pytest.mark.parametrize(
    "text, codec, bits",
    [
        ("fp9", None, None),
        ("v4", None, None),
        ("v2", "polar", None),
        ("v3", "int4", 3),
        ("polar7", None, None),
        ("v3", "zfp", None),
        ("polar3", None, 4),
        ("fp8", None, 4),
        ("tq-polar", None, 9),
        ("v3:polar:3", None, 4),
    ],
)
def test_unknown_or_inconsistent_names_are_typed_errors(text, codec, bits):
    with pytest.raises(tiers.UnknownTier):
        tiers.resolve(text, codec=codec, bits=bits)


def test_not_a_string_is_refused():
    with pytest.raises(tiers.UnknownTier):
        tiers.resolve(3)


@pytest.mark.parametrize("tier", [t for t in tiers.TIERS.values() if t.in_file], ids=lambda t: t.name)
def test_header_tags_round_trip(tier):
    assert tiers.from_header(tier.version, tier.tag) is tier
    assert tiers.from_file(tier.version, tier.codec, tier.bits) is tier


@pytest.mark.parametrize("version, tag", [(1, 1), (2, 0), (3, (1 << 8) | 3), (3, (2 << 8) | 4), (3, 7), (4, 0)])
def test_bad_header_tags(version, tag):
    with pytest.raises(BadHeader):
        tiers.from_header(version, tag)


def test_width_problems():
    assert tiers.INT4.width_problem(512) is None and "power-of-two" in tiers.INT4.width_problem(96)
    assert tiers.Q8.width_problem(64) is None and "multiples of 32" in tiers.Q8.width_problem(48)
    assert tiers.FP8.width_problem(7) is None


def test_bf16_rounds_like_a_bf16_cast():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    rows = np.concatenate(
        [
            rng.standard_normal(4096).astype(np.float32) * 1e3,
            np.array([np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.4e38], np.float32),
        ]
    )
    codes, _ = tiers.BF16.quantize(rows)
    expect = torch.from_numpy(rows).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(codes, expect)
    assert np.isnan(tiers.BF16.dequantize(tiers.BF16.quantize(np.array([np.nan], np.float32))[0])).all()


def test_q8_tier_is_the_q8_codec():
    rows = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    codes, deltas = tiers.Q8.quantize(rows)
    expect_codes, expect_deltas = q8.quantize_blocks(rows)
    assert np.array_equal(codes, expect_codes) and np.array_equal(deltas, expect_deltas)


def test_codec_configs():
    assert tiers.get_codec({"id": "int4"}) is tiers.INT4
    with pytest.warns(tiers.TierSpellingDeprecated):
        assert tiers.get_codec({"id": "tq-polar", "bits": 3}) is tiers.polar(3)
    with pytest.raises(FormatError):
        tiers.get_codec({"id": "fp8", "group": 3})
    with pytest.raises(FormatError):
        tiers.get_codec({"id": "zfp"})
