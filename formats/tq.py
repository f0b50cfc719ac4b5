"""TurboQuant row codecs of ``.coli_kv`` v3, exactly as docs/FORMAT.md sections 5 and 6 say.

Every row is turned by the same randomized Hadamard rotation (a fixed +-1 sign vector, then
the fast Walsh-Hadamard transform in the spec's butterfly order, then ``* (1/sqrtf(n))``) and
stored as packed codes plus one f32 radius (the row's L2 norm, summed in float64):

- codec 1, rotated int4 (``bits`` = 4): each rotated element scaled by ``sqrtf(n) / radius`` is
  replaced by the index of the nearest of 16 Lloyd-Max levels, two codes per byte;
- codec 0, PolarQuant (``bits`` 2..6): the rotated row is folded pairwise into angles
  (``atan2f``) and radii (``hypotf``) until one value is left; the angles are quantized per level
  and written as one little-endian bit stream.

Rows are processed feature-major in cache-sized chunks: a chunk of rows is transposed to
``[n, rows]`` so that every butterfly stage, angle level and code gather is a contiguous
vector operation over the chunk's rows. All arithmetic is f32 with one rounding per operation in
the order the spec gives, so int4 files are reproduced byte for byte.

Each codec is a registered row codec (:mod:`kvstore.formats.codecs`): :class:`Int4Codec` (tier
``int4``) and :class:`PolarCodec` (``polar2`` .. ``polar6``, one instance per bit width), both
:class:`TQCodec`, which owns the chunked row loop; :func:`tq_codec` finds one by codec id and bits.
The kernels live by concern — the rotation in :mod:`~kvstore.formats.tq_rotation`, the int4 codebook
in :mod:`~kvstore.formats.tq_int4`, the angles and bit streams in :mod:`~kvstore.formats.tq_polar` —
and this module re-exports their public names.

The public API is symmetric: :func:`encode` returns an :class:`Encoded` (packed codes, radii, and
the width, codec and bits they were made with) and :func:`decode` takes it back with nothing else.
Non-finite input is never stored (docs/FORMAT.md section 5: a row holding NaN or an infinity has no
finite radius and is stored as zeros); :func:`encode` counts it (``nonfinite``, ``rows_zeroed``),
warns (:class:`NonFiniteRows`) or refuses it (``nonfinite="raise"``). :func:`quantize_rows` and
:func:`dequantize_rows` are the spec's row kernels underneath, as the file layouts use them.

Examples
--------
>>> import numpy as np
>>> rows = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
>>> encoded = encode(rows)                     # rotated int4; encode(rows, CODEC_POLAR, 3): PolarQuant
>>> encoded.codes.shape, encoded.radii.shape, encoded.n, encoded.nonfinite
((4, 256), (4,), 512, 0)
>>> bool((np.linalg.norm(decode(encoded) - rows, axis=1) / encoded.radii < 0.12).all())
True
>>> codes, radii = quantize_rows(rows, CODEC_INT4, 4)
>>> codes.shape, codes.dtype.name, radii.shape
((4, 256), 'uint8', (4,))
>>> back = dequantize_rows(codes, radii, 512, CODEC_INT4, 4)
>>> rel_l2 = np.linalg.norm(back - rows, axis=1) / np.linalg.norm(rows, axis=1)
>>> bool((rel_l2 < 0.12).all())
True
>>> codes, radii = quantize_rows(rows, CODEC_POLAR, 4)
>>> back = dequantize_rows(codes, radii, 512, CODEC_POLAR, 4)
>>> bool((np.linalg.norm(back - rows, axis=1) / radii < 0.2).all())
True
>>> rotate(np.array([3.0, -4.0, 0.0, 0.0], np.float32)).tolist()
[-3.5, 0.5, -3.5, 0.5]
>>> row_bytes(512, CODEC_INT4, 4), row_bytes(512, CODEC_POLAR, 4)
(256, 224)
>>> quantize_rows(np.ones((2, 6), np.float32), CODEC_INT4, 4)[1].tolist()  # width 6: not a power of two
[0.0, 0.0]
>>> tq_codec(CODEC_POLAR, 3), tq_codec(CODEC_POLAR, 3).row_bytes(512)
(PolarCodec(bits=3), 164)
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvstore.formats.codecs import RowCodec, register_codec
from kvstore.formats.errors import FormatError, NonFiniteValues
from kvstore.formats.tq_int4 import (  # noqa: F401  (re-exported: the int4 kernels' public names)
    LEVELS,
    THRESHOLDS,
    _int4_decode_columns,
    _int4_encode_columns,
    _nearest_level,
)
from kvstore.formats.tq_polar import (  # noqa: F401  (re-exported: the PolarQuant kernels' public names)
    PI,
    _polar_bits,
    _polar_decode_columns,
    _polar_encode_columns,
    _polar_pack,
    _polar_unpack,
)
from kvstore.formats.tq_rotation import (  # noqa: F401  (re-exported: the rotation's public names)
    MAX_WIDTH,
    MIN_WIDTH,
    RADIUS_CEIL,
    RADIUS_FLOOR,
    SEED,
    _as_rows,
    _live,
    _radius_columns,
    _rows_per_chunk,
    encodable,
    radius,
    rotate,
    sanitize_radii,
    signs,
    unrotate,
)

__all__ = [
    "CODEC_INT4",
    "CODEC_POLAR",
    "LEVELS",
    "MAX_WIDTH",
    "MIN_WIDTH",
    "PI",
    "POLAR_BITS",
    "RADIUS_CEIL",
    "RADIUS_FLOOR",
    "SEED",
    "THRESHOLDS",
    "Encoded",
    "Int4Codec",
    "NonFiniteRows",
    "PolarCodec",
    "TQCodec",
    "decode",
    "dequantize_rows",
    "encodable",
    "encode",
    "quantize_rows",
    "radius",
    "rotate",
    "row_bytes",
    "sanitize_radii",
    "signs",
    "tq_codec",
    "unrotate",
]

CODEC_POLAR = 0
CODEC_INT4 = 1
#: Bit widths PolarQuant takes (codec 0); rotated int4 (codec 1) always takes 4.
POLAR_BITS = (2, 3, 4, 5, 6)


def tq_codec(codec: int, bits: int) -> TQCodec:
    """The registered codec of a v3 codec id and bit width (``PolarCodec(bits=3)`` for 0, 3).

    Raises
    ------
    FormatError
        An unknown codec id, or bits the codec does not take.
    """
    family = _FAMILIES.get(int(codec)) if _is_int(codec) else None
    if family is None:
        raise FormatError(f"unknown TQ codec {codec!r}: 0 is PolarQuant, 1 is rotated int4")
    found = _BY_BITS.get((family.tq_codec_id, int(bits))) if _is_int(bits) else None
    if found is None:
        raise FormatError(family.bits_problem(bits))
    return found


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def row_bytes(n: int, codec: int, bits: int) -> int:
    """Packed code bytes of one row of width ``n`` (the radius float not included).

    int4: ``n // 2``; PolarQuant: ``ceil(((n/2) * b1 + (n/2 - 1) * b2) / 8)``. Widths the codecs
    do not encode keep the same size (their bytes are all zero).

    Parameters
    ----------
    n : int
        Row width (>= 0).
    codec, bits : int
        ``CODEC_INT4`` with 4, or ``CODEC_POLAR`` with 2..6.

    Returns
    -------
    int
    """
    return tq_codec(codec, bits).payload_bytes(n)


def quantize_rows(x: np.ndarray, codec: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows to packed TQ codes and one f32 radius per row (the spec's kernel; :func:`encode`
    is the same with the width kept for :func:`decode` and non-finite input reported).

    A row whose width is not a power of two in 2..2048, or whose radius is not above 1e-35
    (zero, subnormal, holding a NaN) or is above 3.4e38 (holding an infinity), is stored inert:
    all-zero bytes and radius 0, as docs/FORMAT.md section 5 says, without a word.

    Parameters
    ----------
    x : f32[..., n]
    codec : int
        ``CODEC_INT4`` (bits must be 4) or ``CODEC_POLAR`` (bits 2..6).
    bits : int

    Returns
    -------
    codes : u8[..., row_bytes(n, codec, bits)]
    radii : f32[...]
    """
    return tq_codec(codec, bits).quantize(x)


def dequantize_rows(
    codes: np.ndarray, radii: np.ndarray, n: int, codec: int, bits: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`quantize_rows` (:func:`decode` needs no width: :class:`Encoded` carries it).

    Rows whose radius is not above 1e-35, is above 3.4e38 or is NaN decode as zeros, and so do
    all rows of a width the codecs do not encode. A radius within a factor sqrt(n) of f32's
    largest value can overflow in the butterflies, as the spec's f32 arithmetic does.

    Parameters
    ----------
    codes : u8[..., row_bytes(n, codec, bits)]
    radii : f32[...]
    n : int
        Row width.
    codec, bits : int
    out : f32[..., n], optional
        Written in place and returned.

    Returns
    -------
    f32[..., n]
    """
    return tq_codec(codec, bits).dequantize(codes, radii, n, out=out)


# ---------------------------------------------------------------- the symmetric public API


class NonFiniteRows(UserWarning):
    """:func:`encode` met NaN or infinite values: the rows holding them are stored as zeros
    (docs/FORMAT.md section 5). Send finite rows, or pass ``nonfinite="zero"`` (count quietly) or
    ``"raise"`` (refuse)."""


@dataclass(frozen=True, eq=False)
class Encoded:
    """Rows encoded by :func:`encode`: all :func:`decode` needs, and what encoding had to change.

    Attributes
    ----------
    codes : u8[..., row_bytes(n, codec, bits)], read-only
        Packed codes, one row of bytes per input row (the bytes a v3 record holds).
    radii : f32[...], read-only
        Each row's L2 norm; 0 for a row stored as zeros.
    n : int
        Row width.
    codec, bits : int
        ``CODEC_INT4`` with 4, or ``CODEC_POLAR`` with 2..6.
    nonfinite : int
        NaN and infinite values in the input (none is stored).
    rows_zeroed : int
        Rows stored as zeros because they held one.
    first_nonfinite : tuple of int or None
        Index of the first non-finite value in the input, in row-major order.

    Examples
    --------
    >>> import numpy as np
    >>> rows = np.ones((3, 8), np.float32)
    >>> rows[1, 2] = np.nan
    >>> encoded = encode(rows, CODEC_POLAR, 3, nonfinite="zero")
    >>> encoded.describe()
    '1 non-finite value (NaN or infinity), the first at (1, 2); 1 row stored as zeros'
    >>> decode(encoded)[1].tolist()
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """

    codes: np.ndarray
    radii: np.ndarray
    n: int
    codec: int
    bits: int
    nonfinite: int = 0
    rows_zeroed: int = 0
    first_nonfinite: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the rows encoded (and decoded): ``(*radii.shape, n)``."""
        return (*self.radii.shape, self.n)

    @property
    def nbytes(self) -> int:
        """Bytes stored: the codes and one f32 radius per row."""
        return int(self.codes.nbytes + self.radii.nbytes)

    def describe(self) -> str:
        """One line on the non-finite input, as the store's appends report it."""
        if not self.nonfinite:
            return "no non-finite values"
        return (
            f"{self.nonfinite} non-finite value{'s' * (self.nonfinite != 1)} (NaN or infinity), the first at "
            f"{self.first_nonfinite}; {self.rows_zeroed} row{'s' * (self.rows_zeroed != 1)} stored as zeros"
        )


_NONFINITE_POLICIES = ("warn", "zero", "raise")


def encode(rows: np.ndarray, codec: int = CODEC_INT4, bits: int = 4, *, nonfinite: str = "warn") -> Encoded:
    """Encode rows for :func:`decode`: packed codes, radii, and the geometry to decode them.

    Parameters
    ----------
    rows : f32[..., n], n a power of two in 2..2048
        Other dtypes are converted to f32 first.
    codec, bits : int
        ``CODEC_INT4`` with 4 (the default), or ``CODEC_POLAR`` with 2..6.
    nonfinite : {"warn", "zero", "raise"}
        A row holding NaN or an infinity is stored as zeros (docs/FORMAT.md section 5), counted in the
        result, and: ``"warn"`` (default) warns with :class:`NonFiniteRows`; ``"zero"`` does not;
        ``"raise"`` refuses the rows instead (:class:`~kvstore.formats.errors.NonFiniteValues`).

    Returns
    -------
    Encoded

    Raises
    ------
    FormatError
        A width the codecs do not encode (the spec would store such rows as zeros: refused here),
        a codec/bits pair that does not exist, an unknown ``nonfinite``.
    NonFiniteValues
        ``nonfinite="raise"`` and the rows hold NaN or infinity.

    Examples
    --------
    >>> import numpy as np
    >>> rows = np.arange(32, dtype=np.float32).reshape(2, 16)
    >>> encoded = encode(rows, CODEC_POLAR, 4)
    >>> encoded.shape, encoded.codes.shape, encoded.nbytes
    ((2, 16), (2, 7), 22)
    >>> decode(encoded).shape
    (2, 16)
    >>> rows[0, 3] = np.inf
    >>> encode(rows, nonfinite="raise")
    Traceback (most recent call last):
    ...
    kvstore.formats.errors.NonFiniteValues: 1 non-finite value (NaN or infinity), the first at (0, 3); refused, nothing encoded
    >>> encode(np.ones(6, np.float32))
    Traceback (most recent call last):
    ...
    kvstore.formats.errors.FormatError: TQ encodes rows whose width is a power of two in 2..2048, got 6
    """
    if nonfinite not in _NONFINITE_POLICIES:
        raise FormatError(f"nonfinite must be one of {', '.join(_NONFINITE_POLICIES)}, got {nonfinite!r}")
    tier_codec = tq_codec(codec, bits)
    rows = _as_rows(rows, "encode")
    n = rows.shape[-1]
    if not encodable(n):
        raise FormatError(f"TQ encodes rows whose width is a power of two in {MIN_WIDTH}..{MAX_WIDTH}, got {n}")
    bad = ~np.isfinite(rows)
    count = int(np.count_nonzero(bad))
    first = zeroed = None
    if count:
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
        zeroed = int(np.count_nonzero(bad.any(axis=-1)))
        found = f"{count} non-finite value{'s' * (count != 1)} (NaN or infinity), the first at {first}"
        if nonfinite == "raise":
            raise NonFiniteValues(f"{found}; refused, nothing encoded")
        if nonfinite == "warn":
            warnings.warn(
                f"{found}: {zeroed} row{'s' * (zeroed != 1)} stored as zeros (docs/FORMAT.md section 5)",
                NonFiniteRows,
                stacklevel=2,
            )
    codes, radii = tier_codec.quantize(rows)
    codes.setflags(write=False)
    radii.setflags(write=False)
    return Encoded(codes, radii, int(n), int(codec), int(bits), count, zeroed or 0, first)


def decode(encoded: Encoded, out: np.ndarray | None = None) -> np.ndarray:
    """Decode what :func:`encode` returned: ``f32[..., n]``, rows stored as zeros decode to zeros.

    Parameters
    ----------
    encoded : Encoded
    out : f32[..., n], optional
        Written in place and returned.

    Returns
    -------
    f32[..., n]

    Examples
    --------
    >>> import numpy as np
    >>> rows = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    >>> back = decode(encode(rows))
    >>> back.shape, back.dtype.name
    ((2, 3, 64), 'float32')
    """
    if not isinstance(encoded, Encoded):
        raise FormatError(
            f"decode takes what encode returned (an Encoded), got {type(encoded).__name__}; "
            "for codes and radii alone use dequantize_rows(codes, radii, n, codec, bits)"
        )
    return dequantize_rows(encoded.codes, encoded.radii, encoded.n, encoded.codec, encoded.bits, out=out)


# ---------------------------------------------------------------- the codecs, registered


@dataclass(frozen=True)
class TQCodec(RowCodec):
    """What both TurboQuant codecs share: rotated rows, packed u8 codes and one f32 radius per row.

    Rows are quantized feature-major, in chunks of :func:`~kvstore.formats.tq_rotation._rows_per_chunk`
    rows: each chunk is transposed to ``[n, rows]``, its radii summed, and the family's column
    kernels (:meth:`encode_columns`, :meth:`decode_columns`) run on it as vector operations.
    """

    bits: int = 4
    tq_codec_id: ClassVar[int]
    version: ClassVar[int] = 3
    rotated: ClassVar[bool] = True
    codes_dtype: ClassVar[np.dtype] = np.dtype("u1")
    scales_dtype: ClassVar[np.dtype | None] = np.dtype("<f4")
    scale_kind: ClassVar[str | None] = "radius"
    scale_damage: ClassVar[str | None] = "bad_radii"
    inert_scale: ClassVar[float] = 0.0
    decode_can_overflow: ClassVar[bool] = True

    @property
    def tq_codec(self) -> int | None:
        return self.tq_codec_id

    @property
    def header_tag(self) -> int:
        return (self.tq_codec_id << 8) | self.bits

    @classmethod
    @abstractmethod
    def bits_problem(cls, bits: object) -> str:
        """Why this family does not take ``bits`` (for :func:`tq_codec`)."""

    # ---- sizes
    @abstractmethod
    def code_bytes(self, n: int) -> int:
        """Packed code bytes of one row of width ``n`` (a non-negative int)."""

    def payload_bytes(self, width: int) -> int:
        if int(width) != width or width < 0:
            raise FormatError(f"row width must be a non-negative integer, got {width!r}")
        return self.code_bytes(int(width))

    def width_problem(self, width: int) -> str | None:
        if not encodable(width):
            return f"{self.name} needs power-of-two row widths in {MIN_WIDTH}..{MAX_WIDTH}, got {width}"
        return None

    # ---- the stored radius
    def corrupt_scales(self, scales: np.ndarray) -> np.ndarray:
        """:func:`sanitize_radii`'s mask: a radius not in ``[0, 3.4e38)``."""
        return sanitize_radii(scales)[1]

    @property
    def scale_range(self) -> str:
        return f"[0, {float(RADIUS_CEIL):.4g})"

    def zeroed_rows(self, rows: np.ndarray, nonfinite: np.ndarray) -> int:
        """Every row holding NaN or an infinity (it has no finite radius)."""
        return int(np.count_nonzero(nonfinite.any(axis=-1)))

    # ---- the column kernels of a family
    @abstractmethod
    def encode_columns(self, block: np.ndarray, scratch: np.ndarray, radii: np.ndarray, n_bytes: int) -> np.ndarray:
        """Packed codes ``u8[rows, n_bytes]`` of a feature-major block ``f32[n, rows]`` (may overwrite
        ``block`` and ``scratch``); ``radii`` f32[rows] are the rows' radii, inert rows included."""

    @abstractmethod
    def decode_columns(
        self, codes: np.ndarray, radii: np.ndarray, scratch: np.ndarray, block: np.ndarray
    ) -> np.ndarray:
        """Rows ``f32[n, rows]`` (in ``block`` or ``scratch``) of packed codes ``u8[rows, rb]``."""

    # ---- rows
    def quantize(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """f32[..., n] -> (codes u8[..., row_bytes(n)], radii f32[...]); see :func:`quantize_rows`."""
        x = _as_rows(rows, "quantize_rows")
        n = x.shape[-1]
        n_bytes = self.payload_bytes(n)
        flat = x.reshape(-1, n)
        codes = np.zeros((flat.shape[0], n_bytes), dtype=np.uint8)
        radii = np.zeros(flat.shape[0], dtype=np.float32)
        if encodable(n) and flat.shape[0]:
            step = _rows_per_chunk(n)
            scratch = np.empty(n * step, dtype=np.float32)
            with np.errstate(all="ignore"):  # inert rows are computed, then zeroed
                for start in range(0, flat.shape[0], step):
                    block = flat[start : start + step].T.copy()  # a copy: the butterflies run in place
                    chunk_radii = _radius_columns(block)
                    live = _live(chunk_radii)
                    if not live.any():
                        continue
                    work = scratch[: block.size].reshape(block.shape)
                    target = codes[start : start + step]
                    target[...] = self.encode_columns(block, work, chunk_radii, n_bytes)
                    target[~live] = 0
                    radii[start : start + step] = np.where(live, chunk_radii, np.float32(0.0))
        return codes.reshape(*x.shape[:-1], n_bytes), radii.reshape(x.shape[:-1])

    def dequantize(
        self,
        codes: np.ndarray,
        scales: np.ndarray | None = None,
        width: int | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Inverse of :meth:`quantize` (``scales`` are the radii, ``width`` = n is required); see
        :func:`dequantize_rows`."""
        if width is None:
            raise FormatError(f"{self.name} needs the row width to decode")
        n = width
        n_bytes = self.payload_bytes(n)
        codes = np.asarray(codes)
        if codes.dtype != np.uint8:
            raise FormatError(f"TQ codes must be uint8, got {codes.dtype}")
        if codes.ndim == 0 or codes.shape[-1] != n_bytes:
            raise FormatError(f"TQ codes of width {n} take {n_bytes} bytes per row, got shape {codes.shape}")
        radii = np.asarray(self._need_scales(scales), dtype=np.float32)
        if radii.shape != codes.shape[:-1]:
            raise FormatError(f"radii shape {radii.shape} does not match rows {codes.shape[:-1]}")
        shape = (*codes.shape[:-1], n)
        if out is None:
            out = np.empty(shape, dtype=np.float32)
        elif out.shape != shape or out.dtype != np.float32:
            raise FormatError(f"out must be f32{shape}, got {out.dtype}{out.shape}")
        if not encodable(n):
            out[...] = 0
            return out
        if not out.flags.c_contiguous:
            out[...] = self.dequantize(codes, radii, n)
            return out
        flat_codes = codes.reshape(-1, n_bytes)
        flat_radii = radii.reshape(-1)
        step = _rows_per_chunk(n)
        scratch = np.empty(n * step, dtype=np.float32)
        block_buffer = np.empty(n * step, dtype=np.float32)
        out_rows = out.reshape(-1, n)
        with np.errstate(all="ignore"):
            for start in range(0, flat_codes.shape[0], step):
                chunk_radii = flat_radii[start : start + step]
                live = _live(chunk_radii)
                chunk_radii = np.where(live, chunk_radii, np.float32(0.0))
                block = block_buffer[: n * chunk_radii.size].reshape(n, chunk_radii.size)
                work = scratch[: block.size].reshape(block.shape)
                rows = self.decode_columns(flat_codes[start : start + step], chunk_radii, work, block)
                # A zero radius already yields zeros except where a code met NaN/inf; be exact.
                rows[:, ~live] = 0
                out_rows[start : start + step] = rows.T
        return out


@dataclass(frozen=True)
class Int4Codec(TQCodec):
    """TQ codec 1, rotated int4 (``bits`` = 4): two Lloyd-Max codes per byte + the radius."""

    family: ClassVar[str] = "int4"
    tq_codec_id: ClassVar[int] = CODEC_INT4
    codec_name: ClassVar[str | None] = "int4"

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise FormatError(self.bits_problem(self.bits))

    @classmethod
    def bits_problem(cls, bits: object) -> str:
        return f"TQ codec 1 (rotated int4) takes bits = 4, got {bits!r}"

    @property
    def label(self) -> str:
        return "rotated int4 codes + radius"

    def code_bytes(self, n: int) -> int:
        return n // 2

    def encode_columns(self, block: np.ndarray, scratch: np.ndarray, radii: np.ndarray, n_bytes: int) -> np.ndarray:
        return _int4_encode_columns(block, scratch, radii).T

    def decode_columns(
        self, codes: np.ndarray, radii: np.ndarray, scratch: np.ndarray, block: np.ndarray
    ) -> np.ndarray:
        return _int4_decode_columns(np.ascontiguousarray(codes.T), radii, scratch, block)


@dataclass(frozen=True)
class PolarCodec(TQCodec):
    """TQ codec 0, PolarQuant at ``bits`` 2..6: one LSB-first bit stream of angle codes + the radius."""

    family: ClassVar[str] = "polar"
    tq_codec_id: ClassVar[int] = CODEC_POLAR
    codec_name: ClassVar[str | None] = "polar"

    def __post_init__(self) -> None:
        if not _is_int(self.bits) or self.bits not in POLAR_BITS:
            raise FormatError(self.bits_problem(self.bits))

    @classmethod
    def bits_problem(cls, bits: object) -> str:
        return f"TQ codec 0 (PolarQuant) takes bits in {POLAR_BITS[0]}..{POLAR_BITS[-1]}, got {bits!r}"

    @classmethod
    def variants(cls) -> tuple[RowCodec, ...]:
        return tuple(cls(bits) for bits in POLAR_BITS)

    @property
    def name(self) -> str:
        return f"polar{self.bits}"

    @property
    def label(self) -> str:
        return f"PolarQuant {self.bits}-bit codes + radius"

    def code_bytes(self, n: int) -> int:
        level1_bits, deeper_bits = _polar_bits(self.bits)
        pairs = n // 2
        total_bits = pairs * level1_bits + max(pairs - 1, 0) * deeper_bits
        return (total_bits + 7) // 8

    def encode_columns(self, block: np.ndarray, scratch: np.ndarray, radii: np.ndarray, n_bytes: int) -> np.ndarray:
        n = block.shape[0]
        return _polar_pack(_polar_encode_columns(block, scratch, self.bits), n, self.bits, n_bytes)

    def decode_columns(
        self, codes: np.ndarray, radii: np.ndarray, scratch: np.ndarray, block: np.ndarray
    ) -> np.ndarray:
        n = block.shape[0]
        return _polar_decode_columns(_polar_unpack(codes, n, self.bits), radii, scratch, block, self.bits)


register_codec(Int4Codec)
register_codec(PolarCodec)

#: The TQ families by v3 codec id, and their codecs by (codec id, bits): what :func:`tq_codec` reads.
_FAMILIES: dict[int, type[TQCodec]] = {family.tq_codec_id: family for family in (Int4Codec, PolarCodec)}
_BY_BITS: dict[tuple[int, int], TQCodec] = {
    (codec.tq_codec_id, codec.bits): codec
    for family in _FAMILIES.values()
    for codec in family.variants()
    if isinstance(codec, TQCodec)
}
