"""The shared part of the TurboQuant codecs (docs/FORMAT.md section 5): the randomized Hadamard rotation.

Every v3 row is turned by the same rotation before it is quantized: a fixed +-1 sign vector (from
the spec's 32-bit hash of ``SEED ^ i``), then the fast Walsh-Hadamard transform in the spec's
butterfly order, then ``* (1/sqrtf(n))``; its radius (the row's L2 norm, summed in float64) is
stored beside the codes. Rows are processed feature-major in cache-sized chunks: a chunk of rows is
transposed to ``[n, rows]`` so that every butterfly stage is one contiguous vector operation over
the chunk's rows, with one f32 rounding per operation in the spec's order (bit-exact).

:mod:`kvstore.formats.tq` re-exports the public names; the codecs' own kernels are in
:mod:`~kvstore.formats.tq_int4` and :mod:`~kvstore.formats.tq_polar`.

Examples
--------
>>> import numpy as np
>>> rotate(np.array([3.0, -4.0, 0.0, 0.0], np.float32)).tolist()
[-3.5, 0.5, -3.5, 0.5]
>>> radius(np.array([[3.0, 4.0]], np.float32)).tolist(), encodable(96)
([5.0], False)
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from kvstore.formats.errors import FormatError

__all__ = [
    "MAX_WIDTH",
    "MIN_WIDTH",
    "RADIUS_CEIL",
    "RADIUS_FLOOR",
    "SEED",
    "encodable",
    "radius",
    "rotate",
    "sanitize_radii",
    "signs",
    "unrotate",
]

#: Widths the codecs encode; any other width stores all-zero bytes and radius 0.
MIN_WIDTH = 2
MAX_WIDTH = 2048
#: A radius not above this (zero, subnormal, NaN) makes the row inert: sqrtf(n)/radius overflows.
RADIUS_FLOOR = np.float32(1e-35)
#: A radius above this (an infinity in the row) makes the row inert too.
RADIUS_CEIL = np.float32(3.4e38)
SEED = 0x9E3779B9

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


def _apply_rows(x: np.ndarray, columns_op: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
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
