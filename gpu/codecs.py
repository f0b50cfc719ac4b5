# Over 500 lines: every tier's torch twin in one module, so that there is one rotation, one sanitize, one dequantizer.
"""Row codecs in torch, on any device: the device-side twins of ``kvstore.formats`` fp8 / tq / q8.

Same arithmetic as the reference codecs (FORMAT.md sections 3 to 7), in the same order, with torch
ops, so rows quantized on a GPU are the bytes the journal would have written from the same f32
rows. fp8 and int4 are bit-exact by construction (integer bit tricks, and only IEEE-exact f32 ops:
+, -, *, / between tensors, sqrt); PolarQuant goes through ``atan2``/``hypot``/``cos``/``sin``,
whose last-ulp behaviour is the device's, so its codes agree on all but rare bin-boundary elements.

Every constant comes from the format modules (``fp8.MAX``/``AMAX_FLOOR``/``AMAX_CEIL``/
``MAX_SCALE``, ``tq.signs``/``LEVELS``/``RADIUS_FLOOR``/``RADIUS_CEIL``, ``q8.BLOCK``/``CODE_MAX``)
and every tier from :mod:`kvstore.tiers`: there is one rotation, one fp8 scale bound and one
dequantizer per tier, used by the engine's caches, the device restore, the attention backends and
the reference.

Which function a tier takes:

==========  ===========================  ================================  ============================
tier        encode (f32 rows ->)         decode (-> f32 rows)              attention operands
==========  ===========================  ================================  ============================
f32, bf16   ``rows.to(dtype)``           ``rows.float()``                  the rows
fp8         :func:`fp8_quantize_rows`    :func:`fp8_dequantize_rows`       codes u8, scales f32
int4        :func:`int4_quantize_rows`   :func:`int4_dequantize_rows`      :func:`int4_rotated_rows`
polarB      :func:`polar_quantize_rows`  :func:`polar_dequantize_rows`     :func:`polar_rotated_rows`
q8          :func:`q8_quantize_blocks`   :func:`q8_dequantize_blocks`      codes int8, deltas f16
==========  ===========================  ================================  ============================

:func:`encode_tier` and :func:`decode_tier` pick them by tier; on the host :func:`encode_tier` calls
the reference codec of the tier itself (``Tier.quantize``: exact by definition).

Two pitfalls avoided on purpose: ``scalar / tensor`` in torch is ``reciprocal * scalar`` (two
roundings), and CUDA divides by a host scalar as a multiply by its reciprocal; every division here
is between two tensors on the device.

Examples
--------
>>> import torch
>>> x = torch.tensor([3.0, -4.0, 0.0, 0.0])
>>> rotate(x).tolist()
[-3.5, 0.5, -3.5, 0.5]
>>> torch.equal(unrotate(rotate(x)), x)
True
>>> codes, scales = encode_tier("fp8", torch.tensor([[0.5, -1.0, 2.0]]))
>>> decode_tier("fp8", codes, scales, 3).tolist()
[[0.5, -1.0, 2.0]]
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore import tiers
from kvstore.formats import fp8, q8, tq
from kvstore.formats.errors import FormatError

__all__ = [
    "FP8_MAX",
    "FP8_MAX_SCALE",
    "Q8_BLOCK",
    "as_tier",
    "decode_tier",
    "encode_tier",
    "fp8_dequantize_rows",
    "fp8_encode",
    "fp8_lut",
    "fp8_quantize_rows",
    "int4_dequantize_rows",
    "int4_levels",
    "int4_quantize_rows",
    "int4_rotated_rows",
    "polar_dequantize_rows",
    "polar_quantize_rows",
    "polar_rotated_rows",
    "q8_dequantize_blocks",
    "q8_quantize_blocks",
    "rotate",
    "rotated_rows",
    "sanitize_fp8_",
    "sanitize_tq_",
    "sign_vector",
    "unrotate",
]

# -- fp8 e4m3 (FORMAT.md section 3) ----------------------------------------------------------------

FP8_MAX = float(fp8.MAX)
#: The largest scale an encoder writes; a stored scale above it (or not above 0, or NaN) is corrupt.
FP8_MAX_SCALE = float(fp8.MAX_SCALE)
_AMAX_FLOOR = float(fp8.AMAX_FLOOR)
_AMAX_CEIL = float(fp8.AMAX_CEIL)
_F32_NAN_BITS = 0x7F800000  # magnitudes above this are NaN (IEEE 754)
_F32_MAX_BITS = int(np.float32(fp8.MAX).view(np.uint32))  # magnitudes at or above 448 saturate to 0x7E
_F32_2POW_M6_BITS = int(np.float32(2.0**-6).view(np.uint32))  # below 2^-6 the e4m3 grid is subnormal
_REBIAS = (127 - 7) << 3  # f32 exponent bias -> e4m3 bias, in (exp << 3 | mant) units
_ANCHOR = 16384.0  # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step
_ANCHOR_BITS = int(np.float32(_ANCHOR).view(np.uint32))
# Python floats, not numpy scalars: torch.compile traces these codecs (the engine's compiled decode
# step), and numpy scalars there become tensors it guards on.
_RADIUS_FLOOR = float(tq.RADIUS_FLOOR)
_RADIUS_CEIL = float(tq.RADIUS_CEIL)

# Small per-device tables (LUT, sign vectors, level tables), built once per (kind, width, device).
_tables: dict[tuple, object] = {}


def _device_key(device: torch.device) -> tuple[str, int | None]:
    return device.type, device.index


def _table(key: tuple, device: torch.device, build) -> object:
    full = (*key, *_device_key(device))
    value = _tables.get(full)
    if value is None:
        value = build()
        _tables[full] = value
    return value


def _tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a writable copy: the format's tables are read-only
    return tensor.to(device=device, dtype=dtype) if dtype is not None else tensor.to(device)


def fp8_lut(device: torch.device | str) -> torch.Tensor:
    """The 256-entry decode table f32[256] of ``kvstore.formats.fp8.LUT`` on ``device`` (NaN codes read 0)."""
    device = torch.device(device)
    return _table(("fp8-lut",), device, lambda: _tensor(fp8.LUT, device))


def fp8_encode(values: torch.Tensor) -> torch.Tensor:
    """Encode f32 values to e4m3 bytes (round to nearest even, saturate at +-448, NaN -> 0x00).

    Parameters
    ----------
    values : f32 tensor, any shape

    Returns
    -------
    u8 tensor of the same shape, byte-identical to ``kvstore.formats.fp8.encode``.
    """
    bits = values.contiguous().view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    nan = magnitude > _F32_NAN_BITS
    clamped = torch.clamp(magnitude, max=_F32_MAX_BITS)
    # Round the f32 mantissa to 3 bits, ties to even; a carry bumps the exponent (spec's k == 16).
    code = ((clamped + 0x7FFFF + ((clamped >> 20) & 1)) >> 20) - _REBIAS
    small = magnitude < _F32_2POW_M6_BITS
    anchor = torch.full_like(values, _ANCHOR, dtype=torch.float32)
    subnormal = (magnitude.view(torch.float32) + anchor).view(torch.int32) - _ANCHOR_BITS
    code = torch.where(small, subnormal, code)
    sign = (bits >> 24) & 0x80
    code = torch.where(nan, torch.zeros_like(code), code | sign)
    return code.to(torch.uint8)


def fp8_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8: scale = amax/448, codes = encode(x * (448/amax)); inert rows get codes 0, scale 1.

    Parameters
    ----------
    rows : f32[..., n]

    Returns
    -------
    codes : u8[..., n], scales : f32[...] — byte-identical to ``kvstore.formats.fp8.quantize_rows``.
    """
    x = rows.to(torch.float32)
    magnitude = x.abs()
    amax = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude).amax(dim=-1)
    live = (amax > _AMAX_FLOOR) & ~(amax > _AMAX_CEIL)
    one = torch.ones_like(amax)
    safe = torch.where(live, amax, one)
    inv = _f32_quotient(FP8_MAX, safe)
    codes = fp8_encode(x * inv[..., None])
    codes = torch.where(live[..., None], codes, torch.zeros_like(codes))
    scales = torch.where(live, _f32_quotient(safe, FP8_MAX), one)
    return codes, scales


def _f32_quotient(a, b) -> torch.Tensor:
    """The correctly rounded f32 quotient ``a / b`` of f32 values (tensors or floats), also inside
    ``torch.compile``: there a float division becomes a multiply by a reciprocal (divisor constant)
    or triton's approximate ``div.full.f32`` (2 ulp), either of which moves a scale's last bit off
    the format's. In f64 and rounded once to f32 the result is exact: an f32 quotient is never
    within f64 precision of an f32 rounding midpoint, so the double rounding cannot differ."""
    a = a.double() if isinstance(a, torch.Tensor) else float(a)
    b = b.double() if isinstance(b, torch.Tensor) else float(b)
    return (a / b).float()


def fp8_dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``lut[code] * scale`` in f32: codes u8[..., n], scales f32[...] -> f32[..., n].

    The NaN codes (0x7F/0xFF, never written by an encoder) read as 0, as ``fp8.LUT`` has them. On
    cpu/cuda the bytes are widened by torch's e4m3fn conversion (equal to the LUT everywhere else,
    and 1 byte read per value instead of an 8-byte gather index), then NaN is cleared.
    """
    if codes.device.type == "cpu":
        # numpy's table gather is about three times torch's e4m3 widening on the CPU, and the
        # table already reads the NaN codes as 0.
        rows = torch.from_numpy(np.take(fp8.LUT, codes.numpy(), mode="wrap"))
        rows *= scales[..., None]
        return rows
    if codes.device.type == "cuda":
        return codes.view(torch.float8_e4m3fn).float().nan_to_num_(0.0) * scales[..., None]
    return fp8_lut(codes.device)[codes.long()] * scales[..., None]


def _fill_where(t: torch.Tensor, mask: torch.Tensor, value: float) -> None:
    """``t[mask] = value`` in place. On the CPU skipped when nothing matches — the common case, as
    no encoder writes what sanitizing clears, and CPU ``masked_fill_`` is slow; on a device always,
    since asking would stall the pipeline on a device-to-host sync."""
    if t.device.type != "cpu" or bool(mask.any()):
        t.masked_fill_(mask, value)


def sanitize_fp8_(
    codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FORMAT.md section 4 on stored fp8 rows, in place: NaN codes (0x7F/0xFF) read 0; a row whose
    scale is corrupt (``kvstore.formats.fp8.bad_scales``: not in (0, 3.4e38/448], NaN included) is
    inert: codes 0, scale 1.

    Parameters
    ----------
    codes : u8[..., n];  scales : f32[...] (the same leading layout; views are fine)
    corrupt : an int64 scalar on the device, or None: the rows with a corrupt scale are added to it
        (a strict restore checks it once at the end, with no host pass over the rows)

    Returns
    -------
    (codes, scales), the same tensors.
    """
    nan = codes & 0x7F
    nan.eq_(0x7F)  # in place: 0/1 bytes, read as a bool mask without another tensor
    _fill_where(codes, nan.view(torch.bool), 0)
    bad = ~((scales > 0) & (scales <= FP8_MAX_SCALE))
    if corrupt is not None:
        corrupt += bad.sum()
    _fill_where(codes, bad.unsqueeze(-1), 0)
    _fill_where(scales, bad, 1.0)
    return codes, scales


# -- TQ: the randomized Hadamard rotation (section 5) ----------------------------------------------


def sign_vector(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's +-1 signs (``kvstore.formats.tq.signs``) as ``dtype[n]`` on ``device``."""
    device = torch.device(device)
    return _table(("sign", int(n), dtype), device, lambda: _tensor(tq.signs(int(n)), device, dtype))


def _inv_sqrt(n: int, device: torch.device) -> torch.Tensor:
    """``1 / sqrtf(n)`` with one f32 rounding each, as the spec computes it (f32[1])."""
    return _table(
        ("inv_sqrt", n),
        device,
        lambda: _tensor(np.array([np.float32(1.0) / np.sqrt(np.float32(n))], np.float32), device),
    )


def _sqrt(n: int, device: torch.device) -> torch.Tensor:
    """``sqrtf(n)`` (f32[1])."""
    return _table(("sqrt", n), device, lambda: _tensor(np.array([np.sqrt(np.float32(n))], np.float32), device))


def int4_levels(device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 Lloyd-Max levels of ``kvstore.formats.tq.LEVELS`` as ``dtype[16]`` on ``device``."""
    device = torch.device(device)
    return _table(("levels", dtype), device, lambda: _tensor(tq.LEVELS, device, dtype))


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last axis, the spec's butterfly order."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    length = 1
    while length < n:
        blocks = x.reshape(*lead, n // (2 * length), 2, length)
        a, b = blocks[..., 0, :], blocks[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        length *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``y = FWHT(x * sign) * (1/sqrtf(n))`` over the last axis: f32[..., n] -> f32[..., n].

    Orthonormal and symmetric: ``q . unrotate(y) = rotate(q) . y``, so queries are rotated once and
    TQ rows stay in the rotated domain.
    """
    n = x.shape[-1]
    return _fwht(x.float() * sign_vector(n, torch.float32, x.device)) * _inv_sqrt(n, x.device)


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``x = FWHT(y) * (1/sqrtf(n)) * sign``: the inverse of :func:`rotate` (f32[..., n])."""
    n = y.shape[-1]
    return (_fwht(y.float()) * _inv_sqrt(n, y.device)) * sign_vector(n, torch.float32, y.device)


def _radii(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row norms accumulated in f64 (f32 result) and the mask of rows that are not inert."""
    if x.device.type == "mps":  # no f64 on Metal: accumulate on the host
        radius = torch.from_numpy(np.sqrt(np.sum(np.square(x.cpu().double().numpy()), axis=-1)).astype(np.float32))
        radius = radius.to(x.device)
    else:
        radius = torch.sqrt(torch.sum(torch.square(x.double()), dim=-1)).float()
    live = (radius > _RADIUS_FLOOR) & ~(radius > _RADIUS_CEIL)
    return radius, live


def sanitize_tq_(
    codes: torch.Tensor, radii: torch.Tensor, corrupt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FORMAT.md section 4 on stored TQ rows, in place (``tq.sanitize_radii``): a radius not in
    [0, 3.4e38) becomes 0 and its row's codes 0.

    Parameters
    ----------
    codes : u8[..., rb];  radii : f32[...]
    corrupt : an int64 scalar on the device, or None: the rows with a corrupt radius are added to it

    Returns
    -------
    (codes, radii), the same tensors.
    """
    bad = ~((radii >= 0) & (radii < _RADIUS_CEIL))
    if corrupt is not None:
        corrupt += bad.sum()
    _fill_where(codes, bad.unsqueeze(-1), 0)
    _fill_where(radii, bad, 0.0)
    return codes, radii


def int4_quantize_rows(rows: torch.Tensor, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated int4 (codec 1): codes u8[..., n/2] (even element in the low nibble), radii f32[...].

    ``invstd = sqrtf(n) / radius``; each element takes the nearest Lloyd-Max level of
    ``y * invstd`` (first index on a tie). Inert rows (and widths ``tq`` does not encode): zero
    bytes, radius 0.
    """
    x = rows.to(torch.float32)
    n = x.shape[-1]
    lead = x.shape[:-1]
    if not tq.encodable(n):
        return torch.zeros(*lead, n // 2, dtype=torch.uint8, device=x.device), torch.zeros(lead, device=x.device)
    flat = x.reshape(-1, n)
    radius, live = _radii(flat)
    codes = torch.empty(flat.shape[0], n // 2, dtype=torch.uint8, device=x.device)
    levels = int4_levels(x.device)
    safe = torch.where(live, radius, torch.ones_like(radius))
    invstd = _f32_quotient(_sqrt(n, x.device), safe)
    for a in range(0, flat.shape[0], chunk_rows):  # bounds the [rows, n, 16] distance tensor
        b = min(flat.shape[0], a + chunk_rows)
        z = rotate(flat[a:b]) * invstd[a:b, None]
        index = torch.argmin(torch.abs(z[..., None] - levels), dim=-1)
        # a row near f32's limit can overflow the butterflies: its distances are NaN, level 0 wins
        index = torch.where(torch.isfinite(z), index, torch.zeros_like(index)).to(torch.uint8)
        codes[a:b] = index[:, 0::2] | (index[:, 1::2] << 4)
    codes.masked_fill_(~live[:, None], 0)  # not codes[~live]: a boolean index syncs (and breaks graph capture)
    radius = torch.where(live, radius, torch.zeros_like(radius))
    return codes.reshape(*lead, n // 2), radius.reshape(lead)


#: The two levels of every int4 byte: element 2i is the low nibble, 2i + 1 the high one. f32[256, 2]
_INT4_PAIRS = np.stack((tq.LEVELS[np.arange(256) & 15], tq.LEVELS[np.arange(256) >> 4]), axis=1)


def int4_rotated_rows(codes: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Decoded int4 rows still in the rotated domain: ``level[c] * radius / sqrtf(n)`` f32[..., n]."""
    n = codes.shape[-1] * 2
    std = radii.float() / _sqrt(n, codes.device)
    if codes.device.type == "cpu":
        # One numpy gather of both nibbles' levels per byte: several times torch's two-index path.
        rows = torch.from_numpy(np.take(_INT4_PAIRS, codes.numpy(), axis=0, mode="wrap").reshape(*codes.shape[:-1], n))
        rows *= std[..., None]
        return rows
    c = codes.long()
    index = torch.stack((c & 15, c >> 4), dim=-1).reshape(*codes.shape[:-1], n)
    return int4_levels(codes.device)[index] * std[..., None]


def int4_dequantize_rows(codes: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`int4_quantize_rows`: codes u8[..., n/2], radii f32[...] -> f32[..., n]."""
    return unrotate(int4_rotated_rows(codes, radii))


# -- PolarQuant (section 6) ------------------------------------------------------------------------


def _polar_window(level: int) -> tuple[float, float]:
    """(lo, 2w) of a level >= 2 angle bin, in f32 as the spec computes them."""
    quarter = tq.PI / np.float32(4)
    w = min(np.float32(1.5) / np.sqrt(np.float32(1 << (level - 1))), quarter)
    lo = quarter - np.float32(w)
    return float(np.float32(lo)), float(np.float32(2) * np.float32(w))


def _polar_bits(bits: int) -> tuple[int, int]:
    """(bits of a level-1 angle, bits of a deeper angle); raises UnknownTier outside 2..6."""
    tiers.polar(bits)
    return bits, max(bits - 1, 1)


def polar_quantize_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PolarQuant (codec 0): codes u8[..., rb] as one LSB-first bit stream, radii f32[...].

    Parameters
    ----------
    rows : f32[..., n]
    bits : 2..6

    Returns
    -------
    codes : u8[..., tq.row_bytes(n, CODEC_POLAR, bits)], radii : f32[...]
    """
    b1, b2 = _polar_bits(bits)
    x = rows.to(torch.float32)
    n = x.shape[-1]
    lead = x.shape[:-1]
    rb = tq.row_bytes(n, tq.CODEC_POLAR, bits)
    if not tq.encodable(n):
        return torch.zeros(*lead, rb, dtype=torch.uint8, device=x.device), torch.zeros(lead, device=x.device)
    flat = x.reshape(-1, n)
    radius, live = _radii(flat)
    r = rotate(flat)
    dev = x.device

    def f32(v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32, device=dev)

    pi = float(tq.PI)
    pieces = []
    level = 1
    while r.shape[-1] > 1:
        even, odd = r[:, 0::2], r[:, 1::2]
        angle = torch.atan2(odd, even)
        if level == 1:
            scaled = ((angle + f32(pi)) * f32(float(np.float32(0.5) / tq.PI))) * f32(float(1 << b1))
            q = torch.clamp(torch.floor(scaled), 0, (1 << b1) - 1)
            width = b1
        else:
            lo, two_w = _polar_window(level)
            q = torch.clamp(torch.floor(((angle - f32(lo)) / f32(two_w)) * f32(float(1 << b2))), 0, (1 << b2) - 1)
            width = b2
        pieces.append(_bits_lsb_first(q.to(torch.int64), width))
        r = torch.hypot(even, odd)
        level += 1
    stream = torch.cat(pieces, dim=-1)
    pad = rb * 8 - stream.shape[-1]
    if pad:
        stream = torch.cat((stream, torch.zeros(stream.shape[0], pad, dtype=stream.dtype, device=dev)), dim=-1)
    weights = 1 << torch.arange(8, device=dev, dtype=torch.int64)
    codes = (stream.view(-1, rb, 8) * weights).sum(-1).to(torch.uint8)
    codes.masked_fill_(~live[:, None], 0)  # not codes[~live]: a boolean index syncs (and breaks graph capture)
    radius = torch.where(live, radius, torch.zeros_like(radius))
    return codes.reshape(*lead, rb), radius.reshape(lead)


def _bits_lsb_first(values: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, m] integers -> [rows, m*width] bits, least-significant first."""
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    return ((values[..., None] >> shifts) & 1).reshape(values.shape[0], -1)


def _polar_tables(n: int, bits: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per angle level (level 1 first): cos and sin of every bin centre, f32[2^bits] each.

    Centres are computed with the spec's f32 operations in its order (level 1:
    ``-pi + (q + 0.5) * (2 pi) / 2^b1``; deeper: ``lo + (q + 0.5) * 2w / 2^b2``); their cos/sin
    are rounded from float64, within one ulp of any libm's ``cosf``/``sinf``.
    """

    def build() -> list[tuple[torch.Tensor, torch.Tensor]]:
        b1, b2 = _polar_bits(bits)
        tables = []
        count, level = n // 2, 1
        while count >= 1:
            level_bits = b1 if level == 1 else b2
            q = np.arange(1 << level_bits, dtype=np.float32)
            bins = np.float32(1 << level_bits)
            if level == 1:
                centres = -tq.PI + (q + np.float32(0.5)) * (np.float32(2.0) * tq.PI) / bins
            else:
                lo, two_w = _polar_window(level)
                centres = np.float32(lo) + (q + np.float32(0.5)) * np.float32(two_w) / bins
            wide = centres.astype(np.float64)
            tables.append(
                (_tensor(np.cos(wide).astype(np.float32), device), _tensor(np.sin(wide).astype(np.float32), device))
            )
            count //= 2
            level += 1
        return tables

    return _table(("polar", n, bits), device, build)


def polar_rotated_rows(codes: torch.Tensor, radii: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Decoded PolarQuant rows in the rotated domain f32[..., n] (before the inverse rotation).

    Parameters
    ----------
    codes : u8[..., rb];  radii : f32[...];  n : row width;  bits : 2..6
    """
    lead = codes.shape[:-1]
    rb = codes.shape[-1]
    dev = codes.device
    flat = codes.reshape(-1, rb).long()
    rows = flat.shape[0]
    stream = ((flat[..., None] >> torch.arange(8, device=dev)) & 1).reshape(rows, rb * 8)
    b1, b2 = _polar_bits(bits)
    level_codes = []
    offset = 0
    count, level = n // 2, 1
    while count >= 1:
        width = b1 if level == 1 else b2
        chunk = stream[:, offset : offset + count * width].view(rows, count, width)
        level_codes.append((chunk << torch.arange(width, device=dev)).sum(-1))
        offset += count * width
        count //= 2
        level += 1
    values = radii.reshape(rows, 1).float()
    for q, (cos_table, sin_table) in zip(reversed(level_codes), reversed(_polar_tables(n, bits, dev))):
        values = torch.stack((values * cos_table[q], values * sin_table[q]), dim=-1).reshape(rows, -1)
    return values.reshape(*lead, n)


def polar_dequantize_rows(codes: torch.Tensor, radii: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`polar_quantize_rows`: f32[..., n]."""
    return unrotate(polar_rotated_rows(codes, radii, n, bits))


# -- Q8_0 blocks (section 7) -----------------------------------------------------------------------

Q8_BLOCK = q8.BLOCK


def _check_q8_width(n: int) -> None:
    problem = tiers.Q8.width_problem(n)
    if problem is not None:
        raise FormatError(problem)


def q8_quantize_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0: per 32-value block ``d = amax/127`` (f32), codes ``roundf(x * (1/d))`` (half away
    from zero), ``d`` stored as fp16 — the bytes of ``kvstore.formats.q8.quantize_blocks``.

    NaN elements do not raise amax and encode as 0; a block whose delta is not a finite fp16 is
    stored inert (codes 0, delta 0), and so is a block whose delta rounds to fp16 zero (its
    ``1/d`` would overflow; the stored delta decodes it to zeros whatever the codes).

    Parameters
    ----------
    rows : f32[..., n] with n a multiple of 32

    Returns
    -------
    codes : int8[..., n], deltas : f16[..., n / 32]

    Raises
    ------
    FormatError
        A width that is no multiple of 32.
    """
    x = rows.to(torch.float32)
    n = x.shape[-1]
    _check_q8_width(n)
    blocks = x.reshape(*x.shape[:-1], n // Q8_BLOCK, Q8_BLOCK)
    magnitude = blocks.abs()
    nan = torch.isnan(blocks)
    amax = torch.where(nan, torch.zeros_like(magnitude), magnitude).amax(dim=-1)
    d = amax / torch.full_like(amax, float(q8.CODE_MAX))
    half = d.to(torch.float16)
    representable = torch.isfinite(half)
    d = torch.where(representable, d, torch.zeros_like(d))
    half = torch.where(representable, half, torch.zeros_like(half))
    nonzero = d != 0
    inv = torch.where(nonzero, torch.ones_like(d) / torch.where(nonzero, d, torch.ones_like(d)), torch.zeros_like(d))
    scaled = blocks * inv[..., None]
    # roundf: half away from zero, exactly (the fraction v - trunc(v) is exact in f32)
    whole = torch.trunc(scaled)
    rounded = whole + torch.where(torch.abs(scaled - whole) >= 0.5, torch.sign(scaled), torch.zeros_like(scaled))
    inert = nan | (half == 0)[..., None]
    code_max = float(q8.CODE_MAX)
    rounded = torch.where(inert, torch.zeros_like(rounded), torch.clamp(rounded, -code_max, code_max))
    return rounded.to(torch.int8).reshape(x.shape), half


def q8_dequantize_blocks(codes: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``code * delta`` per block: int8[..., n], f16[..., n/32] -> f32[..., n]."""
    n = codes.shape[-1]
    blocks = codes.reshape(*codes.shape[:-1], n // Q8_BLOCK, Q8_BLOCK).float()
    return (blocks * deltas.float()[..., None]).reshape(codes.shape)


# -- by tier -----------------------------------------------------------------------------------------


def as_tier(tier: tiers.Tier | str) -> tiers.Tier:
    """A ``kvstore.tiers.Tier`` from a Tier or a name (old spellings warn, unknown names raise UnknownTier)."""
    return tier if isinstance(tier, tiers.Tier) else tiers.parse(tier)


def encode_tier(tier: tiers.Tier | str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """f32 rows -> the tier's fields on the rows' device.

    On the host a quantized tier is encoded by its reference codec (``Tier.quantize``, vectorized
    numpy, exact by definition); on any other device by the torch twins above. f32/bf16 rows are
    converted by torch (round to nearest even, as ``kvstore.tiers`` does).

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    rows : f32[..., n]

    Returns
    -------
    (values, None) for f32 (f32[..., n]) and bf16 (bf16[..., n]); (codes u8[..., n], scales
    f32[...]) for fp8; (codes u8[..., rb], radii f32[...]) for int4/polarB; (codes int8[..., n],
    deltas f16[..., n/32]) for q8.
    """
    tier = as_tier(tier)
    # By name, not identity: inside torch.compile a frozen Tier is rebuilt as a constant, and an
    # ``is`` against the module's instance is then False (every tier would fall to the last branch).
    name = tier.name
    if name == tiers.F32.name:
        return rows.to(torch.float32), None
    if name == tiers.BF16.name:
        return rows.to(torch.bfloat16), None
    if rows.device.type == "cpu":
        codes, scales = tier.quantize(rows.detach().to(torch.float32).numpy())
        return torch.from_numpy(codes), torch.from_numpy(scales)
    if name == tiers.FP8.name:
        return fp8_quantize_rows(rows)
    if name == tiers.INT4.name:
        return int4_quantize_rows(rows)
    if name == tiers.Q8.name:
        return q8_quantize_blocks(rows)
    return polar_quantize_rows(rows, tier.bits)


def decode_tier(tier: tiers.Tier | str, values: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    """The tier's fields -> f32 rows ``[..., width]`` on their device (the torch twins everywhere).

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    values, scales : as :func:`encode_tier` returns them
    width : n, the row width (TQ codes do not fix it)
    """
    tier = as_tier(tier)
    if tier is tiers.F32 or tier is tiers.BF16:
        return values.float()
    if tier is tiers.FP8:
        return fp8_dequantize_rows(values, scales)
    if tier is tiers.Q8:
        return q8_dequantize_blocks(values, scales)
    if not tq.encodable(width):  # such rows are written inert (FORMAT.md section 5)
        return torch.zeros((*values.shape[:-1], width), dtype=torch.float32, device=values.device)
    if tier is tiers.INT4:
        return int4_dequantize_rows(values, scales)
    return polar_dequantize_rows(values, scales, width, tier.bits)


def rotated_rows(tier: tiers.Tier | str, codes: torch.Tensor, radii: torch.Tensor, width: int) -> torch.Tensor:
    """A TQ tier's rows decoded but left in the rotated domain (what attention reads): f32[..., width]."""
    tier = as_tier(tier)
    if tier is tiers.INT4:
        return int4_rotated_rows(codes, radii)
    if not tier.rotated:
        raise FormatError(f"{tier.name} rows are not stored rotated")
    return polar_rotated_rows(codes, radii, width, tier.bits)
