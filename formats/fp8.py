"""fp8 e4m3 ("fn": no infinities, max +-448) exactly as docs/FORMAT.md section 3 says.

Scalar ``encode``/``decode`` over arrays of any shape, and per-row (or grouped) quantization:
a row's scale is ``amax / 448`` so its largest element lands on the largest code.

Examples
--------
>>> import numpy as np
>>> encode(np.array([1.0, -0.0, 448.0, 465.0, np.nan], dtype=np.float32)).tolist()
[56, 128, 126, 126, 0]
>>> decode(np.array([56, 0x7E, 0x7F, 0x01], dtype=np.uint8)).tolist()
[1.0, 448.0, 0.0, 0.001953125]
>>> codes, scales = quantize_rows(np.array([[0.5, -1.0, 2.0]], dtype=np.float32))
>>> dequantize_rows(codes, scales).tolist()
[[0.5, -1.0, 2.0]]
>>> FP8Codec().row_bytes(512), FP8Codec().scale_range
(516, '(0, 7.589e+35]')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvstore.formats.codecs import RowCodec, register_codec
from kvstore.formats.errors import FormatError

MAX = np.float32(448.0)
#: Rows whose amax is not above this (all zero, subnormal) are stored inert: 448/amax would overflow.
AMAX_FLOOR = np.float32(1e-35)
#: Rows whose amax is above this hold an infinity (or a value no scale can represent).
AMAX_CEIL = np.float32(3.4e38)
SATURATED = np.uint8(0x7E)


def _decode_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    exponent = (codes >> 3) & 15
    mantissa = (codes & 7).astype(np.float64)
    magnitude = np.where(
        exponent > 0,
        (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0),
        mantissa * 2.0**-9,
    )
    table = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    table[0x7F] = 0.0  # the NaN codes decode as 0: inert, never poison a dot product
    table[0xFF] = 0.0
    return table


#: decode lookup table, f32[256]; the NaN codes 0x7F/0xFF map to 0.
LUT = _decode_table()
LUT.setflags(write=False)


def decode(codes: np.ndarray) -> np.ndarray:
    """Decode fp8 e4m3 bytes.

    Parameters
    ----------
    codes : u8 array, any shape

    Returns
    -------
    f32 array of the same shape (NaN codes decode as 0).
    """
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise FormatError(f"fp8 codes must be uint8, got {codes.dtype}")
    return LUT[codes]


def encode(values: np.ndarray) -> np.ndarray:
    """Encode f32 values to fp8 e4m3 bytes, round to nearest even, saturating at +-448.

    NaN encodes as 0x00, +-inf and |x| > 448 as ``0x7E | sign``, -0.0 as 0x80.

    Parameters
    ----------
    values : array, any shape (cast to f32)

    Returns
    -------
    u8 array of the same shape.
    """
    x = np.ascontiguousarray(values, dtype=np.float32)
    flat = x.reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint8)
    # Chunks small enough that the temporaries stay in cache.
    for start in range(0, flat.size, _CHUNK):
        _encode_chunk(flat[start : start + _CHUNK], out[start : start + _CHUNK])
    return out.reshape(x.shape)


_CHUNK = 1 << 16
_NAN_BITS = np.uint32(0x7F800000)  # magnitudes above this are NaN
_REBIAS = np.uint32((127 - 7) << 3)  # f32 exponent bias -> e4m3 bias, in (exp << 3 | mant) units
_SUBNORMAL_ANCHOR = np.float32(16384.0)  # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step


def _encode_chunk(x: np.ndarray, out: np.ndarray) -> None:
    bits = x.view(np.uint32)
    magnitude_bits = bits & np.uint32(0x7FFFFFFF)
    # Normal range: round the f32 mantissa to 3 bits, ties to even, in integer arithmetic.
    # A carry out of the mantissa bumps the exponent: the spec's `k == 16` case.
    code = magnitude_bits + np.uint32(0x7FFFF)
    code += (magnitude_bits >> 20) & np.uint32(1)
    code >>= 20
    np.minimum(code, _REBIAS + 0x7E, out=code)  # above 448 (and inf) saturates to 0x7E
    code -= _REBIAS
    # |x| < 2^-6: adding 2^14 rounds |x| to a multiple of 2^-9 (ties to even); the low
    # mantissa bits are then k, and k = 8 lands exactly on the first normal code 0x08.
    magnitude = magnitude_bits.view(np.float32)
    small = magnitude < np.float32(2.0**-6)
    with np.errstate(invalid="ignore", over="ignore"):
        subnormal = (magnitude + _SUBNORMAL_ANCHOR).view(np.uint32) - _SUBNORMAL_ANCHOR.view(np.uint32)
    np.copyto(code, subnormal, where=small)
    code[magnitude_bits > _NAN_BITS] = 0
    np.bitwise_or(code.astype(np.uint8), ((bits >> 24) & np.uint32(0x80)).astype(np.uint8), out=out)
    out[magnitude_bits > _NAN_BITS] = 0  # NaN -> 0x00, sign dropped


def _group_view(x: np.ndarray, group_size: int | None) -> np.ndarray:
    """[..., n] -> [..., n // gs, gs] (a row is one group when ``group_size`` is None)."""
    n = x.shape[-1]
    if group_size is None:
        return x[..., None, :]
    if group_size <= 0 or n % group_size:
        raise FormatError(f"group size {group_size} does not divide the row width {n}")
    return x.reshape(*x.shape[:-1], n // group_size, group_size)


def quantize_rows(rows: np.ndarray, group_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows to fp8 codes with one f32 scale per row (or per ``group_size`` elements).

    NaN elements do not raise a row's amax and encode as 0. A row whose amax is not above
    1e-35 (all zero or subnormal) or is above 3.4e38 (holds an infinity) is stored inert:
    all codes 0 and scale 1.0.

    Parameters
    ----------
    rows : f32[..., n]
    group_size : int, optional
        One scale per ``group_size`` consecutive elements (must divide n). The v2 file format
        uses one scale per row (None).

    Returns
    -------
    codes : u8[..., n]
    scales : f32[...] (per row) or f32[..., n // group_size] (grouped)
    """
    x = np.asarray(rows, dtype=np.float32)
    if x.ndim == 0:
        raise FormatError("quantize_rows needs at least one axis (the row)")
    groups = _group_view(x, group_size)
    # fmax ignores NaN (returns the other operand), matching the C loop's `if (a > amax)`.
    amax = np.fmax.reduce(np.abs(groups), axis=-1, initial=np.float32(0.0))
    live = (amax > AMAX_FLOOR) & ~(amax > AMAX_CEIL)
    safe_amax = np.where(live, amax, np.float32(1.0)).astype(np.float32)
    inv = (MAX / safe_amax).astype(np.float32)
    codes = encode(groups * inv[..., None])
    codes[~live] = 0
    scales = np.where(live, (safe_amax / MAX).astype(np.float32), np.float32(1.0)).astype(np.float32)
    codes = codes.reshape(x.shape)
    if group_size is None:
        scales = scales[..., 0]
    return codes, scales


def dequantize_rows(
    codes: np.ndarray, scales: np.ndarray, group_size: int | None = None, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`quantize_rows`: ``lut[code] * scale`` in f32.

    Parameters
    ----------
    codes : u8[..., n]
    scales : f32[...] (per row) or f32[..., n // group_size]
    out : f32[..., n], optional
        Written in place and returned.

    Returns
    -------
    f32[..., n]
    """
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise FormatError(f"fp8 codes must be uint8, got {codes.dtype}")
    scales = np.asarray(scales, dtype=np.float32)
    if group_size is None:
        if scales.shape != codes.shape[:-1]:
            raise FormatError(f"scales shape {scales.shape} does not match rows {codes.shape[:-1]}")
        expanded = scales[..., None]
    else:
        expected = (*codes.shape[:-1], codes.shape[-1] // max(group_size, 1))
        if scales.shape != expected or codes.shape[-1] % group_size:
            raise FormatError(f"grouped scales shape {scales.shape} does not match {expected}")
        expanded = np.repeat(scales, group_size, axis=-1)
    if out is None:
        out = np.empty(codes.shape, dtype=np.float32)
    elif out.shape != codes.shape or out.dtype != np.float32:
        raise FormatError(f"out must be f32{codes.shape}, got {out.dtype}{out.shape}")
    if codes.ndim == 1:
        np.take(LUT, codes, out=out, mode="wrap")
        out *= expanded
        return out
    # Chunks along the first axis keep the gather and the scale pass in cache; `mode="wrap"`
    # (a no-op for u8 indices) avoids numpy's buffered bounds-checking path.
    per_row = max(1, int(np.prod(codes.shape[1:])))
    step = max(1, _CHUNK // per_row)
    for start in range(0, codes.shape[0], step):
        part = out[start : start + step]
        np.take(LUT, codes[start : start + step], out=part, mode="wrap")
        part *= expanded[start : start + step]
    return out


#: The largest scale the encoder can write (amax <= 3.4e38): anything above it is corrupt, and
#: 448 * scale would overflow f32 for part of that range.
MAX_SCALE = AMAX_CEIL / MAX


def bad_scales(scales: np.ndarray) -> np.ndarray:
    """Mask of scales a loader must treat as corrupt.

    docs/FORMAT.md: not (0 < s < 3.4e38), NaN included. Stricter here: a scale above 3.4e38/448, which
    no encoder writes, is corrupt too, so a damaged file never decodes to infinities.
    """
    s = np.asarray(scales, dtype=np.float32)
    return ~((s > 0) & (s <= MAX_SCALE))


def nan_codes(codes: np.ndarray) -> np.ndarray:
    """Mask of the NaN codes (0x7F / 0xFF), which the encoder never writes."""
    return (np.asarray(codes) & 0x7F) == 0x7F


@dataclass(frozen=True)
class FP8Codec(RowCodec):
    """fp8 e4m3 codes + one f32 scale per row (``.coli_kv`` v2): codes u8[..., n], scales f32[...]."""

    family: ClassVar[str] = "fp8"
    version: ClassVar[int] = 2
    codes_dtype: ClassVar[np.dtype] = np.dtype("u1")
    scales_dtype: ClassVar[np.dtype | None] = np.dtype("<f4")
    scale_kind: ClassVar[str | None] = "scale"
    scale_damage: ClassVar[str | None] = "bad_scales"
    code_damage: ClassVar[str | None] = "nan_codes"
    inert_scale: ClassVar[float] = 1.0

    @property
    def label(self) -> str:
        return "e4m3 codes + f32 scale"

    @property
    def header_tag(self) -> int:
        return 1

    def payload_bytes(self, width: int) -> int:
        return width

    def width_of(self, total: int) -> int | None:
        return total - 4

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return quantize_rows(rows)

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return dequantize_rows(codes, self._need_scales(scales), out=out)

    def corrupt_scales(self, scales: np.ndarray) -> np.ndarray:
        """:func:`bad_scales`: not in ``(0, 3.4e38/448]``, NaN included (``lut[0x7E] * scale`` stays finite)."""
        return bad_scales(scales)

    @property
    def scale_range(self) -> str:
        return f"(0, {float(MAX_SCALE):.4g}]"

    def bad_codes(self, codes: np.ndarray) -> np.ndarray | None:
        return nan_codes(codes)

    def zeroed_rows(self, rows: np.ndarray, nonfinite: np.ndarray) -> int:
        """Rows holding an infinity (their amax is out of range); a NaN alone encodes as code 0."""
        return int(np.count_nonzero(np.isinf(rows).any(axis=-1)))


register_codec(FP8Codec)
