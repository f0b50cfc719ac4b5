"""The kernels of TQ codec 0, PolarQuant (arXiv 2502.02617; docs/FORMAT.md section 6), on feature-major blocks.

The rotated row is folded pairwise into angles (``atan2f``) and radii (``hypotf``) until one value
is left; level-1 angles take ``b1 = bits`` bits, deeper levels ``b2 = max(bits - 1, 1)``, each
quantized to its bin and written as one little-endian bit stream, level 1 first. Decoding splits
the radius back level by level with the cosine and sine of each bin centre (``cosf``/``sinf`` of
the C library, as the C engine computes them).

The row loop, the radii and the registry entries are :class:`kvstore.formats.tq.PolarCodec`'s.

Examples
--------
>>> import numpy as np
>>> codes = np.array([7, 0, 5, 1, 2, 3, 4, 6, 3, 0, 1, 2, 3, 1, 0], np.uint8)[:, None]  # n = 16, bits 3
>>> packed = _polar_pack(codes, 16, 3, 5)
>>> packed.shape, bool((_polar_unpack(packed, 16, 3) == codes).all())
((1, 5), True)
"""

from __future__ import annotations

import functools

import numpy as np

from kvstore.formats.tq_rotation import _rotate_columns, _unrotate_columns

__all__ = ["PI"]

#: pi as the spec's f32 literal ``3.14159265358979323846f``.
PI = np.float32(3.14159265358979323846)


def _polar_bits(bits: int) -> tuple[int, int]:
    """(bits of a level-1 angle, bits of a deeper angle)."""
    return bits, max(bits - 1, 1)


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
