"""int8 Q8_0 blocks, the engine's int8 cache tier (docs/FORMAT.md section 7): ggml's Q8_0 to the bit.

Values are cut into blocks of 32. A block's delta is ``d = amax / 127`` (f32), its codes are
``roundf(x * (1/d))`` (round half away from zero; all 0 when ``d == 0``) and the delta is kept
as fp16. Codes sit back to back in one int8 array (four codes are one aligned 32-bit word) and
the deltas in another, one per block. Decoding is ``code * float(delta)`` in f32.

Inputs ggml leaves undefined get a defined, inert answer: NaN elements do not raise a block's
amax and encode as 0; a block whose delta is not a finite fp16 (it holds an infinity, or
``amax / 127`` exceeds fp16's 65504) is stored as codes 0 and delta 0 rather than as an
infinite delta that would decode to inf/NaN.

Examples
--------
>>> import numpy as np
>>> x = np.arange(-16, 16, dtype=np.float32) / 4
>>> codes, deltas = quantize_blocks(x)
>>> codes[:4].tolist(), deltas.tolist()
([-127, -119, -111, -103], [0.031494140625])
>>> back = dequantize_blocks(codes, deltas)
>>> bool(np.abs(back - x).max() <= deltas.astype(np.float32).max() / 2 + 1e-3)
True
>>> quantize_blocks(np.zeros(32, np.float32))[1].tolist()
[0.0]
>>> Q8Codec().row_bytes(512), Q8Codec().scale_shape(512)
(544, (16,))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvstore.formats.codecs import RowCodec, register_codec
from kvstore.formats.errors import FormatError

#: Values per block (ggml's QK8_0).
BLOCK = 32
#: Largest code magnitude: ``d = amax / 127`` puts a block's largest value on +-127.
CODE_MAX = np.float32(127.0)
# roundf(v) == trunc(v + copysign(0.49999997f, v)) for every f32 |v| < 2^23: adding the float
# just below one half cannot carry v = k + 0.5 - ulp over k + 1, while v = k + 0.5 still
# reaches it (the sum rounds to nearest even, which is k + 1). Adding 0.5 itself would not.
_HALF_BELOW = np.nextafter(np.float32(0.5), np.float32(0.0))
_ONE = np.float32(1.0)
_MAGNITUDE_MASK = np.int32(0x7FFFFFFF)
_SIGN_MASK = np.int32(-(2**31))
_INF_BITS = np.int32(0x7F800000)
# Elements per chunk: the block temporaries stay in cache.
_CHUNK = 1 << 16


def _check_width(n: int) -> None:
    if n % BLOCK:
        raise FormatError(f"Q8_0 rows need a width that is a multiple of {BLOCK}, got {n}")


def _quantize_chunk(blocks: np.ndarray, codes: np.ndarray, deltas: np.ndarray) -> None:
    """Quantize ``f32[b, 32]`` (C-contiguous) into ``codes`` int8[b, 32] and ``deltas`` f16[b]."""
    # |x| as its bit pattern orders like the float (NaN above inf above finite), and an integer
    # max over 32 lanes is several times faster than numpy's NaN-aware float max.
    magnitude_bits = blocks.view(np.int32) & _MAGNITUDE_MASK
    amax_bits = magnitude_bits.max(axis=1)
    nan_blocks = amax_bits > _INF_BITS
    if nan_blocks.any():
        # A NaN does not raise amax (fmax semantics; ggml leaves NaN input undefined); a block of
        # NaN alone has amax 0.
        held = magnitude_bits[nan_blocks]
        held[held > _INF_BITS] = 0
        amax_bits[nan_blocks] = held.max(axis=1)
    delta = amax_bits.view(np.float32) / CODE_MAX
    half_delta = delta.astype(np.float16)
    inverse = np.zeros_like(delta)
    np.divide(_ONE, delta, out=inverse, where=delta != 0)
    # Inert: the delta is no finite fp16 (an infinity, or amax/127 > 65504), or 1/d overflows
    # f32 (amax below ~3.7e-37, where the fp16 delta is 0 anyway).
    inert = ~np.isfinite(half_delta) | np.isinf(inverse)
    scaled = blocks * inverse[:, None]
    # copysign(0.49999997, v) through the bits: v's sign bit on the constant's pattern.
    half = scaled.view(np.int32) & _SIGN_MASK
    half |= _HALF_BELOW.view(np.int32)
    scaled += half.view(np.float32)
    np.copyto(codes, scaled, casting="unsafe")  # the cast truncates toward zero
    if inert.any():
        codes[inert] = 0
        half_delta[inert] = 0
    if nan_blocks.any():
        held = codes[nan_blocks]
        held[np.isnan(blocks[nan_blocks])] = 0
        codes[nan_blocks] = held
    deltas[...] = half_delta


def quantize_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows to Q8_0: int8 codes and one fp16 delta per 32 values.

    Parameters
    ----------
    x : f32[..., n], n a multiple of 32

    Returns
    -------
    codes : int8[..., n]
    deltas : f16[..., n // 32]
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise FormatError("quantize_blocks needs at least one axis (the row)")
    n = x.shape[-1]
    _check_width(n)
    blocks = np.ascontiguousarray(x.reshape(-1, BLOCK))
    codes = np.empty(blocks.shape, dtype=np.int8)
    deltas = np.empty(blocks.shape[0], dtype=np.float16)
    step = _CHUNK // BLOCK
    with np.errstate(over="ignore", invalid="ignore"):  # infinite blocks are made inert
        for start in range(0, blocks.shape[0], step):
            _quantize_chunk(blocks[start : start + step], codes[start : start + step], deltas[start : start + step])
    return codes.reshape(x.shape), deltas.reshape(*x.shape[:-1], n // BLOCK)


def dequantize_blocks(codes: np.ndarray, deltas: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`quantize_blocks`: ``code * float(delta)`` in f32.

    Parameters
    ----------
    codes : int8[..., n], n a multiple of 32
    deltas : f16[..., n // 32]
    out : f32[..., n], optional
        Written in place and returned.

    Returns
    -------
    f32[..., n]
    """
    codes = np.asarray(codes)
    deltas = np.asarray(deltas)
    if codes.dtype != np.int8:
        raise FormatError(f"Q8_0 codes must be int8, got {codes.dtype}")
    if deltas.dtype != np.float16:
        raise FormatError(f"Q8_0 deltas must be float16, got {deltas.dtype}")
    if codes.ndim == 0:
        raise FormatError("dequantize_blocks needs at least one axis (the row)")
    n = codes.shape[-1]
    _check_width(n)
    expected = (*codes.shape[:-1], n // BLOCK)
    if deltas.shape != expected:
        raise FormatError(f"deltas shape {deltas.shape} does not match codes {codes.shape}: expected {expected}")
    if out is None:
        out = np.empty(codes.shape, dtype=np.float32)
    elif out.shape != codes.shape or out.dtype != np.float32:
        raise FormatError(f"out must be f32{codes.shape}, got {out.dtype}{out.shape}")
    if not out.flags.c_contiguous:
        out[...] = dequantize_blocks(codes, deltas)
        return out
    code_blocks = codes.reshape(-1, BLOCK)
    delta_column = deltas.reshape(-1, 1)
    out_blocks = out.reshape(-1, BLOCK)
    step = _CHUNK // BLOCK
    for start in range(0, code_blocks.shape[0], step):
        part = out_blocks[start : start + step]
        np.copyto(part, code_blocks[start : start + step])
        part *= delta_column[start : start + step].astype(np.float32)
    return out


@dataclass(frozen=True)
class Q8Codec(RowCodec):
    """Q8_0 blocks (an engine cache tier; journals as f32): codes int8[..., n], deltas f16[..., n/32]."""

    family: ClassVar[str] = "q8"
    version: ClassVar[int] = 1
    in_file: ClassVar[bool] = False
    codes_dtype: ClassVar[np.dtype] = np.dtype("i1")
    scales_dtype: ClassVar[np.dtype | None] = np.dtype("<f2")

    @property
    def label(self) -> str:
        return "Q8_0 int8 blocks + f16 deltas"

    def payload_bytes(self, width: int) -> int:
        return width

    def scale_shape(self, width: int) -> tuple[int, ...]:
        return (width // BLOCK,)

    def width_of(self, total: int) -> int | None:
        return total * BLOCK // (BLOCK + 2)

    def width_problem(self, width: int) -> str | None:
        if width % BLOCK:
            return f"q8 (Q8_0) needs row widths that are multiples of {BLOCK}, got {width}"
        return None

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return quantize_blocks(rows)

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return dequantize_blocks(codes, self._need_scales(scales), out=out)


register_codec(Q8Codec)
