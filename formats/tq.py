# Over 500 lines: both TQ codecs share the rotation, the chunked feature-major layout and the bit streams; split, each half would reach into the other.
"""TurboQuant row codecs of ``.coli_kv`` v3, exactly as FORMAT.md sections 5 and 6 say.

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

The public API is symmetric: :func:`encode` returns an :class:`Encoded` (packed codes, radii, and
the width, codec and bits they were made with) and :func:`decode` takes it back with nothing else.
Non-finite input is never stored (FORMAT.md section 5: a row holding NaN or an infinity has no
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
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np

from kvstore.formats.errors import FormatError, NonFiniteValues

CODEC_POLAR = 0
CODEC_INT4 = 1
#: Widths the codecs encode; any other width stores all-zero bytes and radius 0.
MIN_WIDTH = 2
MAX_WIDTH = 2048
#: A radius not above this (zero, subnormal, NaN) makes the row inert: sqrtf(n)/radius overflows.
RADIUS_FLOOR = np.float32(1e-35)
#: A radius above this (an infinity in the row) makes the row inert too.
RADIUS_CEIL = np.float32(3.4e38)
SEED = 0x9E3779B9
PI = np.float32(3.14159265358979323846)

#: The 16 Lloyd-Max levels of N(0, 1), ascending, as the f32 literals of the spec.
LEVELS = np.array(
    [-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
     0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733],
    dtype=np.float32,
)  # fmt: skip
LEVELS.setflags(write=False)

# Elements per chunk: the working set (input, butterfly scratch, codes) stays in L2.
_CHUNK = 1 << 16
_UINT32 = np.uint32


def _mix(values: np.ndarray) -> np.ndarray:
    """The spec's 32-bit integer hash ``h``, on u32 arrays (wrap-around arithmetic)."""
    x = values + _UINT32(0x9E3779B9)
    x = (x ^ (x >> _UINT32(16))) * _UINT32(0x85EBCA6B)
    x = (x ^ (x >> _UINT32(13))) * _UINT32(0xC2B2AE35)
    return x ^ (x >> _UINT32(16))


@functools.lru_cache(maxsize=None)
def signs(n: int) -> np.ndarray:
    """The rotation's sign vector: ``-1`` where ``h(SEED ^ i)`` is odd, else ``+1``.

    Parameters
    ----------
    n : int
        Row width (>= 1).

    Returns
    -------
    f32[n], read-only (cached per width).

    Examples
    --------
    >>> signs(8).tolist()
    [-1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]
    """
    if int(n) != n or n < 1:
        raise FormatError(f"sign vector width must be a positive integer, got {n!r}")
    index = np.arange(int(n), dtype=_UINT32)
    odd = _mix(index ^ _UINT32(SEED)) & _UINT32(1)
    out = np.where(odd == 1, np.float32(-1.0), np.float32(1.0)).astype(np.float32)
    out.setflags(write=False)
    return out


def encodable(n: int) -> bool:
    """Whether the codecs encode rows of width ``n`` (a power of two in 2..2048)."""
    return MIN_WIDTH <= n <= MAX_WIDTH and n & (n - 1) == 0


def _check_codec(codec: int, bits: int) -> None:
    if codec == CODEC_INT4:
        if bits != 4:
            raise FormatError(f"TQ codec 1 (rotated int4) takes bits = 4, got {bits!r}")
    elif codec == CODEC_POLAR:
        if not (isinstance(bits, (int, np.integer)) and 2 <= bits <= 6):
            raise FormatError(f"TQ codec 0 (PolarQuant) takes bits in 2..6, got {bits!r}")
    else:
        raise FormatError(f"unknown TQ codec {codec!r}: 0 is PolarQuant, 1 is rotated int4")


def _polar_bits(bits: int) -> tuple[int, int]:
    """(bits of a level-1 angle, bits of a deeper angle)."""
    return bits, max(bits - 1, 1)


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
    _check_codec(codec, bits)
    if int(n) != n or n < 0:
        raise FormatError(f"row width must be a non-negative integer, got {n!r}")
    n = int(n)
    if codec == CODEC_INT4:
        return n // 2
    level1_bits, deeper_bits = _polar_bits(bits)
    pairs = n // 2
    total_bits = pairs * level1_bits + max(pairs - 1, 0) * deeper_bits
    return (total_bits + 7) // 8


def _check_width(n: int) -> None:
    if not encodable(n):
        raise FormatError(f"TQ rotation needs a power-of-two width in {MIN_WIDTH}..{MAX_WIDTH}, got {n}")


def _rows_per_chunk(n: int) -> int:
    return max(2, _CHUNK // max(n, 1))


def _fwht_columns(block: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Unnormalized FWHT along axis 0 of a feature-major block ``[n, rows]``.

    Each stage writes ``(a + b, a - b)`` for the pairs ``len`` apart, the spec's butterflies;
    every output is the same single f32 operation on the same operands as the in-place loop,
    so the result is bit-identical. Returns whichever of ``block``/``scratch`` holds the result.
    """
    n, rows = block.shape
    source, target = block, scratch
    span = 1
    while span < n:
        pairs_in = source.reshape(n // (2 * span), 2, span * rows)
        pairs_out = target.reshape(n // (2 * span), 2, span * rows)
        np.add(pairs_in[:, 0], pairs_in[:, 1], out=pairs_out[:, 0])
        np.subtract(pairs_in[:, 0], pairs_in[:, 1], out=pairs_out[:, 1])
        source, target = target, source
        span *= 2
    return source


def _inv_sqrt(n: int) -> np.float32:
    return np.float32(1.0) / np.sqrt(np.float32(n))


def _rotate_columns(block: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``FWHT(x * sign) * (1/sqrtf(n))`` on a feature-major block; may overwrite both buffers."""
    n = block.shape[0]
    block *= signs(n)[:, None]
    rotated = _fwht_columns(block, scratch)
    rotated *= _inv_sqrt(n)
    return rotated


def _unrotate_columns(block: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``FWHT(y) * (1/sqrtf(n)) * sign`` on a feature-major block; may overwrite both buffers."""
    n = block.shape[0]
    result = _fwht_columns(block, scratch)
    # (v * s) * +-1 == v * (+-s) exactly: one pass for the scale and the signs.
    result *= (signs(n) * _inv_sqrt(n))[:, None]
    return result


def _as_rows(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise FormatError(f"{what} needs at least one axis (the row)")
    return x


def _apply_rows(x: np.ndarray, columns_op) -> np.ndarray:
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape, dtype=np.float32)
    n = rows.shape[1]
    step = _rows_per_chunk(n)
    scratch = np.empty(n * step, dtype=np.float32)
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step].T.copy()  # a copy: the butterflies run in place
        result = columns_op(block, scratch[: block.size].reshape(block.shape))
        out[start : start + step] = result.T
    return out.reshape(x.shape)


def rotate(x: np.ndarray) -> np.ndarray:
    """Randomized Hadamard rotation ``FWHT(x * sign) * (1/sqrtf(n))``, in f32.

    Parameters
    ----------
    x : f32[..., n], n a power of two in 2..2048

    Returns
    -------
    f32[..., n]
    """
    x = _as_rows(x, "rotate")
    _check_width(x.shape[-1])
    return _apply_rows(x, _rotate_columns)


def unrotate(y: np.ndarray) -> np.ndarray:
    """Inverse of :func:`rotate`: ``FWHT(y) * (1/sqrtf(n)) * sign``, in f32.

    Parameters
    ----------
    y : f32[..., n], n a power of two in 2..2048

    Returns
    -------
    f32[..., n]
    """
    y = _as_rows(y, "unrotate")
    _check_width(y.shape[-1])
    return _apply_rows(y, _unrotate_columns)


def _radius_columns(block: np.ndarray) -> np.ndarray:
    """``sqrt(sum x_i^2)`` per column of ``[n, rows]``, squares and sum in f64, in index order."""
    squares = block.astype(np.float64)
    squares *= squares
    if squares.shape[1] < 2:
        # A single column would be coalesced into one contiguous (pairwise) reduction.
        total = np.add.accumulate(squares, axis=0)[-1]
    else:
        # Reducing axis 0 of a C-ordered [n, rows] block adds row after row: the C loop's order.
        total = np.add.reduce(squares, axis=0)
    return np.sqrt(total).astype(np.float32)


def radius(x: np.ndarray) -> np.ndarray:
    """Row norms as the encoder stores them: ``sqrt(sum x_i^2)`` in float64, cast to f32.

    The squares are of the unrotated row, formed in float64 and added in index order (the
    golden files pin all three choices).

    Parameters
    ----------
    x : f32[..., n]

    Returns
    -------
    f32[...]
    """
    x = _as_rows(x, "radius")
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty(rows.shape[0], dtype=np.float32)
    step = _rows_per_chunk(rows.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, rows.shape[0], step):
            out[start : start + step] = _radius_columns(np.ascontiguousarray(rows[start : start + step].T))
    return out.reshape(x.shape[:-1])


def _live(radii: np.ndarray) -> np.ndarray:
    """Rows the codecs encode/decode: ``radius > 1e-35`` and not ``> 3.4e38`` (NaN is inert)."""
    return (radii > RADIUS_FLOOR) & ~(radii > RADIUS_CEIL)


def sanitize_radii(radii: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sanitize-on-load for v3 radii: a radius not in ``[0, 3.4e38)`` becomes 0.

    Parameters
    ----------
    radii : f32[...]

    Returns
    -------
    clean : f32[...]
        A copy with the bad radii set to 0 (the row decodes to zeros).
    bad_mask : bool[...]
        Where a radius was replaced.

    Examples
    --------
    >>> import numpy as np
    >>> clean, bad = sanitize_radii(np.array([1.5, -1.0, np.nan, np.inf, 0.0], np.float32))
    >>> clean.tolist(), bad.tolist()
    ([1.5, 0.0, 0.0, 0.0, 0.0], [False, True, True, True, False])
    """
    radii = np.asarray(radii, dtype=np.float32)
    bad_mask = ~((radii >= 0) & (radii < RADIUS_CEIL))
    clean = np.where(bad_mask, np.float32(0.0), radii).astype(np.float32)
    return clean, bad_mask


# ---------------------------------------------------------------- rotated int4 (codec 1)


def _ordered_key(values: np.ndarray) -> np.ndarray:
    """f32 -> int64 keys in the same order as the floats (-0.0 and +0.0 share a key)."""
    bits = values.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _from_ordered_key(keys: np.ndarray) -> np.ndarray:
    bits = np.where(keys < 0, (-keys) | 0x80000000, keys).astype(np.uint32)
    return bits.view(np.float32)


def _level_thresholds() -> np.ndarray:
    """The 15 exact f32 decision points of the int4 codebook.

    ``thresholds[k]`` is the smallest f32 ``v`` whose spec distance to level k+1 is strictly
    below its distance to level k: ``|fl(v - L[k+1])| < |fl(v - L[k])|`` (f32 subtractions; a
    tie keeps the first index). The predicate flips once between the two levels, so a
    bisection over the ordered f32 values finds it.
    """
    lower, upper = LEVELS[:-1], LEVELS[1:]
    low_keys, high_keys = _ordered_key(lower), _ordered_key(upper)  # predicate false, true
    while (high_keys - low_keys > 1).any():
        middle = (low_keys + high_keys) // 2
        v = _from_ordered_key(middle)
        closer_above = np.abs(v - upper) < np.abs(v - lower)
        high_keys = np.where(closer_above, middle, high_keys)
        low_keys = np.where(closer_above, low_keys, middle)
    return _from_ordered_key(high_keys)


#: Exact f32 decision points between consecutive levels: code = #(thresholds <= v).
THRESHOLDS = _level_thresholds()
THRESHOLDS.setflags(write=False)

# A uniform grid of cells 1/64 wide over [-3, 3] (cell = int(64 v + 192), clipped) narrows each
# value to one cell; a cell holds at most one decision point, so the code is the cell's base
# level plus one comparison with that point (NaN where the cell holds none: never >=).
_CELLS_PER_UNIT = np.float32(64.0)
_CELL_OFFSET = np.float32(192.0)


def _cell_tables() -> tuple[np.ndarray, np.ndarray]:
    n_cells = int(2 * _CELL_OFFSET) + 1
    cell = np.arange(n_cells, dtype=np.float64)
    # 64 v + 192 is rounded in f32, which can move a value one cell over near an edge:
    # a decision point within this margin of a cell belongs to it too.
    margin = 2.0**-12
    left = (cell - float(_CELL_OFFSET)) / float(_CELLS_PER_UNIT) - margin
    right = (cell + 1 - float(_CELL_OFFSET)) / float(_CELLS_PER_UNIT) + margin
    points = THRESHOLDS.astype(np.float64)
    inside = (points[None, :] >= left[:, None]) & (points[None, :] <= right[:, None])
    centre = ((left + right) / 2).astype(np.float32)
    base = np.searchsorted(THRESHOLDS, centre, side="right")
    has_point = inside.any(axis=1)
    which = inside.argmax(axis=1)
    base = np.where(has_point, which, base).astype(np.uint8)
    point = np.where(has_point, THRESHOLDS[which], np.float32(np.nan)).astype(np.float32)
    base.setflags(write=False)
    point.setflags(write=False)
    return base, point


_CELL_BASE, _CELL_POINT = _cell_tables()


def _nearest_level(scaled: np.ndarray) -> np.ndarray:
    """Index of the nearest level, first index on a tie, with the spec's f32 distances.

    Parameters
    ----------
    scaled : f32 array, any shape
        Finite values get the exact spec answer, NaN gets 0 (every comparison with a NaN
        distance fails, so the first index stays). Infinities only come from rows that
        overflowed f32; :func:`_int4_encode_columns` settles those.

    Returns
    -------
    u8 array of the same shape, codes 0..15.
    """
    position = scaled * _CELLS_PER_UNIT
    position += _CELL_OFFSET
    cell = position.astype(np.intp)  # trunc; out-of-range cells are clipped by the takes
    codes = np.take(_CELL_BASE, cell, mode="clip")
    codes += scaled >= np.take(_CELL_POINT, cell, mode="clip")
    return codes


def _int4_encode_columns(block: np.ndarray, scratch: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """Codes ``u8[n/2, rows]`` of a feature-major block (rows of any liveness)."""
    n = block.shape[0]
    rotated = _rotate_columns(block, scratch)
    inv_std = np.sqrt(np.float32(n)) / radii
    rotated *= inv_std
    codes = _nearest_level(rotated)
    overflow = radii > np.float32(1e36)
    if overflow.any():
        # Near f32's limit the butterflies can overflow; the spec's argmin over NaN/inf
        # distances keeps the first level.
        codes[:, overflow] = np.where(np.isfinite(rotated[:, overflow]), codes[:, overflow], 0)
    packed = codes[1::2] << np.uint8(4)
    packed |= codes[0::2]
    return packed


def _int4_decode_columns(packed: np.ndarray, radii: np.ndarray, scratch: np.ndarray, block: np.ndarray) -> np.ndarray:
    """Rows ``f32[n, rows]`` from packed codes ``u8[n/2, rows]``."""
    n = block.shape[0]
    pairs = block.reshape(n // 2, 2, -1)
    np.take(LEVELS, packed & np.uint8(15), out=pairs[:, 0], mode="wrap")
    np.take(LEVELS, packed >> np.uint8(4), out=pairs[:, 1], mode="wrap")
    block *= radii / np.sqrt(np.float32(n))
    return _unrotate_columns(block, scratch)


# ---------------------------------------------------------------- PolarQuant (codec 0)


@functools.lru_cache(maxsize=1)
def _libm_cos_sin():
    """The C library's ``cosf``/``sinf`` (what the C engine calls), or None where unloadable."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("m")
    try:
        library = ctypes.CDLL(name)
        functions = (library.cosf, library.sinf)
    except (OSError, AttributeError, TypeError):
        return None
    for function in functions:
        function.restype = ctypes.c_float
        function.argtypes = [ctypes.c_float]
    return functions


def _cos_sin_f32(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf/sinf of a few f32 angles (a table of bin centres, at most 64 of them).

    The C library's own functions give the C engine's bits on the same libc (numpy's float32
    cos/sin are a separate approximation that differs in the last bit on ~17% of inputs);
    without a loadable libm the values are rounded from float64, within one ulp of any libm.
    """
    functions = _libm_cos_sin()
    if functions is None:
        wide = angles.astype(np.float64)
        return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
    cosf, sinf = functions
    values = angles.tolist()  # table construction, once per (width, bits): not a hot path
    return np.array([cosf(v) for v in values], np.float32), np.array([sinf(v) for v in values], np.float32)


@functools.lru_cache(maxsize=None)
def _polar_levels(
    n: int, bits: int
) -> tuple[tuple[int, int, int, np.float32, np.float32, np.ndarray, np.ndarray], ...]:
    """Per angle level: (code offset, count, bits, lo, bin width scale, cos table, sin table).

    Level 1 uses ``lo = -pi`` and ``q = floor((ang + pi) * (0.5/pi) * 2^b1)``; deeper levels
    ``q = floor((ang - lo) / (2w) * 2^b2)``. The decode tables hold cosf/sinf of every bin centre
    (a level has at most 64 bins), computed with the same f32 operations the spec writes.
    """
    level1_bits, deeper_bits = _polar_bits(bits)
    quarter_pi = PI / np.float32(4.0)
    levels = []
    offset = 0
    count = n // 2
    level = 1
    while count >= 1:
        level_bits = level1_bits if level == 1 else deeper_bits
        bins = np.float32(2**level_bits)
        q = np.arange(2**level_bits, dtype=np.float32)
        if level == 1:
            lo = -PI
            step = np.float32(0.5) / PI
            centres = -PI + (q + np.float32(0.5)) * (np.float32(2.0) * PI) / bins
        else:
            half_width = min(np.float32(1.5) / np.sqrt(np.float32(2.0 ** (level - 1))), quarter_pi)
            lo = quarter_pi - half_width
            step = np.float32(2.0) * half_width
            centres = lo + (q + np.float32(0.5)) * step / bins
        cos_table, sin_table = _cos_sin_f32(centres)
        cos_table.setflags(write=False)
        sin_table.setflags(write=False)
        levels.append((offset, count, level_bits, np.float32(lo), np.float32(step), cos_table, sin_table))
        offset += count
        count //= 2
        level += 1
    return tuple(levels)


def _polar_encode_columns(block: np.ndarray, scratch: np.ndarray, bits: int) -> np.ndarray:
    """Angle codes ``u8[n - 1, rows]`` in write order (level 1 first) of a feature-major block."""
    n, rows = block.shape
    values = _rotate_columns(block, scratch)
    codes = np.empty((n - 1, rows), dtype=np.uint8)
    angle = np.empty((n // 2, rows), dtype=np.float32)
    for index, (offset, count, level_bits, lo, step, _, _) in enumerate(_polar_levels(n, bits)):
        evens, odds = values[0 : 2 * count : 2], values[1 : 2 * count : 2]
        level_angle = angle[:count]
        np.arctan2(odds, evens, out=level_angle)
        if index == 0:
            level_angle += PI
            level_angle *= step
        else:
            level_angle -= lo
            level_angle /= step
        level_angle *= np.float32(2**level_bits)
        np.floor(level_angle, out=level_angle)
        # fmax maps NaN (a row that overflowed f32) to 0 instead of an undefined cast.
        np.fmax(level_angle, np.float32(0.0), out=level_angle)
        np.minimum(level_angle, np.float32(2**level_bits - 1), out=level_angle)
        codes[offset : offset + count] = level_angle
        # hypotf of the pair replaces it; the next level folds these radii.
        values = np.hypot(evens, odds)
    return codes


def _polar_decode_columns(
    codes: np.ndarray, radii: np.ndarray, scratch: np.ndarray, block: np.ndarray, bits: int
) -> np.ndarray:
    """Rows ``f32[n, rows]`` from angle codes ``u8[n - 1, rows]`` (write order)."""
    n, rows = block.shape
    levels = _polar_levels(n, bits)
    # Each level splits the values of the level below it: ping-pong between the two buffers
    # so that the values read are never the ones being written.
    buffers = (block, scratch) if len(levels) % 2 else (scratch, block)
    values = radii[None, :]
    for depth, (offset, count, _, _, _, cos_table, sin_table) in enumerate(reversed(levels)):
        level_codes = codes[offset : offset + count]
        target = buffers[depth % 2][: 2 * count].reshape(count, 2, rows)
        np.take(cos_table, level_codes, out=target[:, 0], mode="wrap")
        np.take(sin_table, level_codes, out=target[:, 1], mode="wrap")
        target *= values[:, None, :]
        values = buffers[depth % 2][: 2 * count]
    return _unrotate_columns(block, scratch)


def _pack_stream(codes: np.ndarray, bits: int) -> np.ndarray:
    """Feature-major codes ``u8[m, rows]`` (m a multiple of 8) -> LSB-first bytes ``u8[rows, m*bits/8]``.

    Eight codes of ``bits`` bits make ``bits`` whole bytes: they are summed into one u64 at
    shifts 0, bits, 2*bits, ... whose low ``bits`` little-endian bytes are the stream.
    """
    m, rows = codes.shape
    shifted = codes.reshape(m // 8, 8, rows).astype(np.uint64)
    shifted <<= (np.arange(8, dtype=np.uint64) * np.uint64(bits))[None, :, None]
    words = np.ascontiguousarray(np.add.reduce(shifted, axis=1).T)  # [rows, m/8]
    return words.view(np.uint8).reshape(rows, m // 8, 8)[:, :, :bits].reshape(rows, m * bits // 8)


def _unpack_stream(stream: np.ndarray, m: int, bits: int) -> np.ndarray:
    """Inverse of :func:`_pack_stream`: bytes ``u8[rows, m*bits/8]`` -> codes ``u8[m, rows]``."""
    rows = stream.shape[0]
    padded = np.zeros((rows, m // 8, 8), dtype=np.uint8)
    padded[:, :, :bits] = stream.reshape(rows, m // 8, bits)
    words = np.ascontiguousarray(padded.view(np.uint64)[:, :, 0].T)  # [m/8, rows]
    shifted = words[:, None, :] >> (np.arange(8, dtype=np.uint64) * np.uint64(bits))[None, :, None]
    shifted &= np.uint64((1 << bits) - 1)
    return shifted.astype(np.uint8).reshape(m, rows)


def _polar_pack(codes: np.ndarray, n: int, bits: int, n_bytes: int) -> np.ndarray:
    """Feature-major angle codes ``u8[n - 1, rows]`` -> the LSB-first bit stream ``u8[rows, rb]``."""
    level1_bits, deeper_bits = _polar_bits(bits)
    pairs = n // 2
    rows = codes.shape[1]
    if pairs % 8 == 0:
        # n >= 16: level 1 fills whole bytes, and the deeper codes plus one zero code do too.
        head = pairs * level1_bits // 8
        packed = np.empty((rows, n_bytes), dtype=np.uint8)
        packed[:, :head] = _pack_stream(codes[:pairs], level1_bits)
        deeper = np.zeros((pairs, rows), dtype=np.uint8)
        deeper[: pairs - 1] = codes[pairs:]
        packed[:, head:] = _pack_stream(deeper, deeper_bits)
        return packed
    # n < 16: a few bits per row, one bit per byte is cheap enough.
    code_bits = np.unpackbits(codes.T[:, :, None], axis=-1, bitorder="little")
    stream = np.zeros((rows, n_bytes * 8), dtype=np.uint8)
    head = pairs * level1_bits
    stream[:, :head] = code_bits[:, :pairs, :level1_bits].reshape(rows, head)
    tail = (pairs - 1) * deeper_bits
    stream[:, head : head + tail] = code_bits[:, pairs:, :deeper_bits].reshape(rows, tail)
    return np.packbits(stream, axis=-1, bitorder="little")


def _polar_unpack(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    """The bit stream ``u8[rows, rb]`` -> feature-major angle codes ``u8[n - 1, rows]``."""
    level1_bits, deeper_bits = _polar_bits(bits)
    pairs = n // 2
    rows = packed.shape[0]
    if pairs % 8 == 0:
        head = pairs * level1_bits // 8
        codes = np.empty((n - 1, rows), dtype=np.uint8)
        codes[:pairs] = _unpack_stream(packed[:, :head], pairs, level1_bits)
        codes[pairs:] = _unpack_stream(packed[:, head:], pairs, deeper_bits)[: pairs - 1]
        return codes
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    code_bits = np.zeros((rows, n - 1, 8), dtype=np.uint8)
    head = pairs * level1_bits
    code_bits[:, :pairs, :level1_bits] = stream[:, :head].reshape(rows, pairs, level1_bits)
    tail = (pairs - 1) * deeper_bits
    code_bits[:, pairs:, :deeper_bits] = stream[:, head : head + tail].reshape(rows, pairs - 1, deeper_bits)
    return np.ascontiguousarray(np.packbits(code_bits, axis=-1, bitorder="little")[:, :, 0].T)


# ---------------------------------------------------------------- row codecs


def quantize_rows(x: np.ndarray, codec: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows to packed TQ codes and one f32 radius per row (the spec's kernel; :func:`encode`
    is the same with the width kept for :func:`decode` and non-finite input reported).

    A row whose width is not a power of two in 2..2048, or whose radius is not above 1e-35
    (zero, subnormal, holding a NaN) or is above 3.4e38 (holding an infinity), is stored inert:
    all-zero bytes and radius 0, as FORMAT.md section 5 says, without a word.

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
    _check_codec(codec, bits)
    x = _as_rows(x, "quantize_rows")
    n = x.shape[-1]
    n_bytes = row_bytes(n, codec, bits)
    rows = x.reshape(-1, n)
    codes = np.zeros((rows.shape[0], n_bytes), dtype=np.uint8)
    radii = np.zeros(rows.shape[0], dtype=np.float32)
    if encodable(n) and rows.shape[0]:
        step = _rows_per_chunk(n)
        scratch = np.empty(n * step, dtype=np.float32)
        with np.errstate(all="ignore"):  # inert rows are computed, then zeroed
            for start in range(0, rows.shape[0], step):
                block = rows[start : start + step].T.copy()  # a copy: the butterflies run in place
                chunk_radii = _radius_columns(block)
                live = _live(chunk_radii)
                if not live.any():
                    continue
                work = scratch[: block.size].reshape(block.shape)
                if codec == CODEC_INT4:
                    chunk_codes = _int4_encode_columns(block, work, chunk_radii).T
                else:
                    chunk_codes = _polar_pack(_polar_encode_columns(block, work, bits), n, bits, n_bytes)
                target = codes[start : start + step]
                target[...] = chunk_codes
                target[~live] = 0
                radii[start : start + step] = np.where(live, chunk_radii, np.float32(0.0))
    return codes.reshape(*x.shape[:-1], n_bytes), radii.reshape(x.shape[:-1])


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
    _check_codec(codec, bits)
    n_bytes = row_bytes(n, codec, bits)
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise FormatError(f"TQ codes must be uint8, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] != n_bytes:
        raise FormatError(f"TQ codes of width {n} take {n_bytes} bytes per row, got shape {codes.shape}")
    radii = np.asarray(radii, dtype=np.float32)
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
    flat_codes = codes.reshape(-1, n_bytes)
    flat_radii = radii.reshape(-1)
    step = _rows_per_chunk(n)
    scratch = np.empty(n * step, dtype=np.float32)
    block_buffer = np.empty(n * step, dtype=np.float32)
    if not out.flags.c_contiguous:
        out[...] = dequantize_rows(codes, radii, n, codec, bits)
        return out
    out_rows = out.reshape(-1, n)
    with np.errstate(all="ignore"):
        for start in range(0, flat_codes.shape[0], step):
            chunk_radii = flat_radii[start : start + step]
            live = _live(chunk_radii)
            chunk_radii = np.where(live, chunk_radii, np.float32(0.0))
            block = block_buffer[: n * chunk_radii.size].reshape(n, chunk_radii.size)
            work = scratch[: block.size].reshape(block.shape)
            if codec == CODEC_INT4:
                packed = np.ascontiguousarray(flat_codes[start : start + step].T)
                rows = _int4_decode_columns(packed, chunk_radii, work, block)
            else:
                angle_codes = _polar_unpack(flat_codes[start : start + step], n, bits)
                rows = _polar_decode_columns(angle_codes, chunk_radii, work, block, bits)
            # A zero radius already yields zeros except where a code met NaN/inf; be exact.
            rows[:, ~live] = 0
            out_rows[start : start + step] = rows.T
    return out


# ---------------------------------------------------------------- the symmetric public API


class NonFiniteRows(UserWarning):
    """:func:`encode` met NaN or infinite values: the rows holding them are stored as zeros
    (FORMAT.md section 5). Send finite rows, or pass ``nonfinite="zero"`` (count quietly) or
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
        A row holding NaN or an infinity is stored as zeros (FORMAT.md section 5), counted in the
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
    _check_codec(codec, bits)
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
                f"{found}: {zeroed} row{'s' * (zeroed != 1)} stored as zeros (FORMAT.md section 5)",
                NonFiniteRows,
                stacklevel=2,
            )
    codes, radii = quantize_rows(rows, codec, bits)
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
