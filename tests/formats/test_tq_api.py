"""The symmetric public API of kvstore.formats.tq: ``decode(encode(x))`` with nothing else, non-finite
input reported (counted, warned or refused) rather than zeroed silently, the golden vectors
reproduced through it, and the module's examples run as doctests (issue 19)."""

from __future__ import annotations

import dataclasses
import doctest
import warnings

import numpy as np
import pytest

from golden import GEOMETRIES, read_expect, read_src
from kvstore.formats import tq
from kvstore.formats.errors import FormatError, NonFiniteValues

TIERS = [(tq.CODEC_INT4, 4)] + [(tq.CODEC_POLAR, bits) for bits in range(2, 7)]


def _v3_records(vectors, name: str, codec: int, bits: int) -> np.ndarray:
    """The records of ``name.v3c{codec}b{bits}.coli_kv`` as docs/FORMAT.md section 2 lays them out."""
    geometry, n = GEOMETRIES[name]
    layer = np.dtype(
        [
            ("Lc", "u1", (tq.row_bytes(geometry.kv_lora, codec, bits),)),
            ("Lr", "<f4"),
            ("Rc", "u1", (tq.row_bytes(geometry.qk_rope, codec, bits),)),
            ("Rr", "<f4"),
        ]
    )
    fields = [("token", "<i4"), ("layers", layer, (geometry.n_layers,))]
    if geometry.nic:
        fields.append(("index", "<f4", (geometry.nic, geometry.index_hd)))
    raw = (vectors / f"{name}.v3c{codec}b{bits}.coli_kv").read_bytes()
    records = np.frombuffer(raw, np.dtype(fields), offset=40)
    assert len(records) == n
    return records


@pytest.mark.parametrize("codec,bits", TIERS)
def test_decode_takes_only_what_encode_returned(codec, bits):
    rows = np.random.default_rng(bits).standard_normal((3, 5, 128)).astype(np.float32)
    encoded = tq.encode(rows, codec, bits)
    assert (encoded.n, encoded.codec, encoded.bits, encoded.shape) == (128, codec, bits, rows.shape)
    assert encoded.codes.shape == (3, 5, tq.row_bytes(128, codec, bits))
    assert encoded.nbytes == encoded.codes.nbytes + 4 * 15
    back = tq.decode(encoded)
    # the same arithmetic as the spec's kernels, byte for byte
    codes, radii = tq.quantize_rows(rows, codec, bits)
    assert np.array_equal(encoded.codes, codes) and np.array_equal(encoded.radii.view(np.uint32), radii.view(np.uint32))
    expected = tq.dequantize_rows(codes, radii, 128, codec, bits)
    assert np.array_equal(back.view(np.uint32), expected.view(np.uint32))
    assert back.shape == rows.shape and back.dtype == np.float32
    # mean rel-L2 per tier (docs/FORMAT.md section 6 measures 0.096 for int4 and 0.147 for polar4)
    rel_l2 = np.linalg.norm(back - rows, axis=-1) / np.linalg.norm(rows, axis=-1)
    assert rel_l2.mean() < (0.12 if codec == tq.CODEC_INT4 else {2: 0.6, 3: 0.32, 4: 0.17, 5: 0.09, 6: 0.045}[bits])
    out = np.full(rows.shape, np.nan, np.float32)
    assert tq.decode(encoded, out=out) is out and np.array_equal(out, back)


def test_what_encode_returns_cannot_be_changed_behind_decode():
    encoded = tq.encode(np.ones((2, 16), np.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        encoded.n = 32  # type: ignore[misc]
    with pytest.raises(ValueError):
        encoded.codes[0, 0] = 1
    with pytest.raises(ValueError):
        encoded.radii[0] = 1.0


@pytest.mark.parametrize("codec,bits", TIERS)
def test_nonfinite_rows_are_counted_and_warned_about(codec, bits):
    rows = np.random.default_rng(7).standard_normal((4, 2, 32)).astype(np.float32)
    rows[1, 0, 5] = np.nan
    rows[1, 0, 9] = np.inf
    rows[3, 1, 0] = -np.inf
    with pytest.warns(
        tq.NonFiniteRows, match=r"3 non-finite values .* the first at \(1, 0, 5\): 2 rows stored as zeros"
    ):
        encoded = tq.encode(rows, codec, bits)
    assert (encoded.nonfinite, encoded.rows_zeroed, encoded.first_nonfinite) == (3, 2, (1, 0, 5))
    assert encoded.describe() == (
        "3 non-finite values (NaN or infinity), the first at (1, 0, 5); 2 rows stored as zeros"
    )
    back = tq.decode(encoded)
    assert np.isfinite(back).all()
    assert not back[1, 0].any() and not back[3, 1].any()  # docs/FORMAT.md section 5: those rows are zeros
    assert encoded.radii[1, 0] == 0 and encoded.radii[3, 1] == 0
    # the other rows are encoded as if nothing happened
    clean = rows.copy()
    clean[1, 0] = clean[3, 1] = 0
    assert np.array_equal(encoded.codes, tq.quantize_rows(clean, codec, bits)[0])


def test_nonfinite_policies_zero_is_quiet_and_raise_refuses():
    rows = np.ones((2, 8), np.float32)
    rows[1, 6] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = tq.encode(rows, nonfinite="zero")
        clean = tq.encode(np.ones((2, 8), np.float32))  # finite rows never warn
    assert (quiet.nonfinite, quiet.rows_zeroed, quiet.first_nonfinite) == (1, 1, (1, 6))
    assert (clean.nonfinite, clean.rows_zeroed, clean.first_nonfinite) == (0, 0, None)
    assert clean.describe() == "no non-finite values"
    with pytest.raises(NonFiniteValues, match=r"1 non-finite value \(NaN or infinity\), the first at \(1, 6\)"):
        tq.encode(rows, nonfinite="raise")
    with pytest.raises(FormatError, match="nonfinite must be one of warn, zero, raise"):
        tq.encode(rows, nonfinite="ignore")


def test_bad_input_is_refused_with_a_typed_error():
    with pytest.raises(FormatError, match="power of two in 2..2048, got 6"):
        tq.encode(np.ones((2, 6), np.float32))  # the spec kernel would store zeros without a word
    with pytest.raises(FormatError, match="bits in 2..6"):
        tq.encode(np.ones((2, 8), np.float32), tq.CODEC_POLAR, 7)
    with pytest.raises(FormatError, match="at least one axis"):
        tq.encode(np.float32(1.0))
    with pytest.raises(FormatError, match="decode takes what encode returned"):
        tq.decode(tq.quantize_rows(np.ones((2, 8), np.float32), tq.CODEC_INT4, 4))  # type: ignore[arg-type]
    encoded = tq.encode(np.ones((2, 8), np.float32))
    with pytest.raises(FormatError, match="out must be f32"):
        tq.decode(encoded, out=np.empty((2, 4), np.float32))


def test_no_rows_encode_and_decode_to_no_rows():
    encoded = tq.encode(np.empty((0, 64), np.float32), tq.CODEC_POLAR, 3)
    assert encoded.codes.shape == (0, tq.row_bytes(64, tq.CODEC_POLAR, 3))
    assert tq.decode(encoded).shape == (0, 64)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_golden_int4_files_are_reproduced_through_encode_and_decode(vectors, name):
    """The codes and radii of G.v3c1b4 come out of encode byte for byte, and decode gives the
    expected values bit for bit; the source's NaN element is reported, its row stored as zeros."""
    _, L, R, _ = read_src(vectors, name)
    records = _v3_records(vectors, name, tq.CODEC_INT4, 4)
    expect_L, expect_R = read_expect(vectors, name, "v3c1b4")
    reports = []
    for which, rows, expect in (("L", L, expect_L), ("R", R, expect_R)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            encoded = tq.encode(rows.transpose(1, 0, 2), tq.CODEC_INT4, 4)  # [n, layers, width], record order
        reports.append((which, encoded.nonfinite, encoded.rows_zeroed, len(caught)))
        stored = records["layers"]
        assert encoded.codes.tobytes() == np.ascontiguousarray(stored[which + "c"]).tobytes()
        assert encoded.radii.tobytes() == np.ascontiguousarray(stored[which + "r"]).tobytes()
        decoded = tq.decode(encoded).transpose(1, 0, 2)
        assert np.array_equal(decoded.view(np.uint32), expect.view(np.uint32))
    # tests/vectors/README.md: (R, layer 0, pos 4) holds a NaN element
    assert reports == [("L", 0, 0, 0), ("R", 1, 1, 1)]


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_golden_polar_files_decode_through_decode(vectors, bits):
    for name in GEOMETRIES:
        records = _v3_records(vectors, name, tq.CODEC_POLAR, bits)
        expect_L, _ = read_expect(vectors, name, f"v3c0b{bits}")
        stored = records["layers"]
        encoded = tq.Encoded(
            np.ascontiguousarray(stored["Lc"]), np.ascontiguousarray(stored["Lr"]), expect_L.shape[-1], 0, bits
        )
        decoded = tq.decode(encoded).transpose(1, 0, 2).astype(np.float64)
        error = np.linalg.norm(decoded - expect_L, axis=-1)
        assert np.all(error <= 1e-5 * np.linalg.norm(expect_L.astype(np.float64), axis=-1))


def test_the_module_examples_run_as_doctests():
    results = doctest.testmod(tq, optionflags=doctest.ELLIPSIS, raise_on_error=False)
    assert results.failed == 0
    # the examples of the module, encode, decode and Encoded at least
    assert results.attempted >= 20
    for name in ("encode", "decode", "Encoded"):
        assert ">>>" in (getattr(tq, name).__doc__ or ""), name
