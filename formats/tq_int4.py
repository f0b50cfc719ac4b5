"""The kernels of TQ codec 1, rotated int4 (docs/FORMAT.md section 6), on feature-major blocks.

Each rotated element scaled by ``sqrtf(n) / radius`` is replaced by the index of the nearest of 16
Lloyd-Max levels (first index on a tie, with the spec's f32 distances), two codes per byte: element
``2i`` in the low nibble, ``2i + 1`` in the high one. The nearest level is found without distances:
the 15 exact f32 decision points between consecutive levels are computed once (a bisection over the
ordered f32 values), and a uniform grid of cells narrows each value to one comparison.

The row loop, the radii and the registry entry are :class:`kvstore.formats.tq.Int4Codec`'s.

Examples
--------
>>> import numpy as np
>>> _nearest_level(np.array([0.0, 0.128, 3.0, -9.0], np.float32)).tolist()  # 0.0 ties: the first index
[7, 8, 15, 0]
"""

from __future__ import annotations

import numpy as np

from kvstore.formats.tq_rotation import _rotate_columns, _unrotate_columns

__all__ = ["LEVELS", "THRESHOLDS"]

#: The 16 Lloyd-Max levels of N(0, 1), ascending, as the f32 literals of the spec.
LEVELS = np.array(
    [-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
     0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733],
    dtype=np.float32,
)  # fmt: skip
LEVELS.setflags(write=False)


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
