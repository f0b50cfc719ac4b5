"""Rows kept as floats: f32 (the ``.coli_kv`` v1 rows) and bf16 (the v4 rows, a kvstore extension).

f32 rows are stored as they are (``4n`` bytes, lossless). bf16 rows are the upper half of each f32,
rounded to nearest even as torch's conversion rounds (``2n`` bytes): a bf16 cache's rows journal as
they are, at half the bytes of f32 and without a change to any value (docs/FORMAT.md section 7).
Both are *value* tiers (:attr:`RowCodec.holds_values`): a stored element is a float, not a code, so
a non-finite one is written as 0 and counted, and a stored one is damage (``nan_values``).

Examples
--------
>>> import numpy as np
>>> rows = np.array([[1.0, -2.5, 3.1415927]], np.float32)
>>> F32Codec().decode(F32Codec().encode(rows)).tolist() == rows.tolist()
True
>>> codes, _ = BF16Codec().quantize(rows)
>>> codes.tolist(), BF16Codec().dequantize(codes).tolist()
([[16256, 49184, 16457]], [[1.0, -2.5, 3.140625]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvstore.formats.codecs import RowCodec, register_codec

__all__ = ["BF16Codec", "BF16_TAG", "F32Codec", "bf16_decode", "bf16_encode"]

#: Header word h7 of a v4 file: the bits of one stored value (docs/FORMAT.md section 1).
BF16_TAG = 16


def bf16_encode(rows: np.ndarray) -> np.ndarray:
    """f32[...] -> u16[...] bf16 bit patterns, round to nearest even (a NaN stays a NaN)."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x40)  # rounding could carry a NaN into an infinity
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_decode(codes: np.ndarray) -> np.ndarray:
    """u16[...] bf16 bit patterns -> f32[...] (exact)."""
    # order="C": a fresh array in row order whatever the codes' strides (a view of records)
    return (np.asarray(codes).astype(np.uint32, order="C") << np.uint32(16)).view(np.float32)


def _into(rows: np.ndarray, codes: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``rows`` as the result of a decode: written into ``out``, or never a view of ``codes``."""
    if out is None:
        return rows.copy() if rows is codes else rows
    out[...] = rows
    return out


@dataclass(frozen=True)
class F32Codec(RowCodec):
    """f32 values as they are (``.coli_kv`` v1): codes f32[..., n], no scales; lossless."""

    family: ClassVar[str] = "f32"
    version: ClassVar[int] = 1
    lossy: ClassVar[bool] = False
    holds_values: ClassVar[bool] = True
    codes_dtype: ClassVar[np.dtype] = np.dtype("<f4")
    code_damage: ClassVar[str | None] = "nan_values"

    @property
    def label(self) -> str:
        return "f32 values"

    @property
    def header_tag(self) -> int:
        return 0

    def payload_bytes(self, width: int) -> int:
        return 4 * width

    def width_of(self, total: int) -> int | None:
        return total // 4

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return np.ascontiguousarray(rows, dtype=np.float32), None

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return _into(np.asarray(codes, dtype=np.float32), codes, out)

    def bad_codes(self, codes: np.ndarray) -> np.ndarray | None:
        """Non-finite stored values (the encoder keeps them; the journal writes them as 0)."""
        return ~np.isfinite(codes)


@dataclass(frozen=True)
class BF16Codec(RowCodec):
    """bf16 values (``.coli_kv`` v4): codes u16[..., n] bit patterns, no scales.

    Lossy from f32 (one rounding to nearest even), lossless for rows that are already bf16 — a
    bf16 cache's — which is what the tier is for.
    """

    family: ClassVar[str] = "bf16"
    version: ClassVar[int] = 4
    holds_values: ClassVar[bool] = True
    codes_dtype: ClassVar[np.dtype] = np.dtype("<u2")
    code_damage: ClassVar[str | None] = "nan_values"

    @property
    def label(self) -> str:
        return "bf16 values"

    @property
    def header_tag(self) -> int:
        return BF16_TAG

    def payload_bytes(self, width: int) -> int:
        return 2 * width

    def width_of(self, total: int) -> int | None:
        return total // 2

    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return bf16_encode(np.asarray(rows, dtype=np.float32)), None

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        return _into(bf16_decode(codes), codes, out)

    def bad_codes(self, codes: np.ndarray) -> np.ndarray | None:
        """Non-finite stored values: an all-ones exponent (the journal writes such values as 0)."""
        return (np.asarray(codes, dtype=np.uint16) & np.uint16(0x7F80)) == np.uint16(0x7F80)


register_codec(F32Codec)
register_codec(BF16Codec)
