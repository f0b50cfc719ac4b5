"""Row codecs in torch, on the cache's device: fp8 e4m3 (v2), TQ int4 / PolarQuant (v3), Q8_0.

These are the device-side twins of ``kvstore.formats.fp8`` / ``tq`` / ``q8`` (FORMAT.md sections
3, 5, 6, 7): same arithmetic, in the same order, with torch ops, so rows quantized while decoding on
a GPU are the bytes the journal would have written from the same f32 rows. fp8 and int4 are
bit-exact by construction (integer bit tricks, and only IEEE-exact f32 ops: +, -, *, / between
tensors, sqrt); PolarQuant goes through ``atan2``/``hypot``/``cos``/``sin``, whose last-ulp
behaviour is the device's, so its codes agree on all but rare bin-boundary elements.

The cache encodes through :func:`encode_fp8`, :func:`encode_int4`, :func:`encode_polar` and
:func:`encode_q8`: on the host they call the ``kvstore.formats`` reference codecs themselves
(vectorized in cache-sized chunks, and exact by definition); on any other device the torch twins.

Two pitfalls this module avoids on purpose: ``scalar / tensor`` in torch is ``reciprocal * scalar``
(two roundings), and CUDA divides by a host scalar as a multiply by its reciprocal; every division
here is between two tensors on the device.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvstore.engine.errors import TierUnsupported
from kvstore.formats import fp8 as fp8_format

# -- fp8 e4m3 ------------------------------------------------------------------------------------

FP8_MAX = 448.0
FP8_AMAX_FLOOR = float(np.float32(1e-35))
FP8_AMAX_CEIL = float(np.float32(3.4e38))
_F32_NAN_BITS = 0x7F800000
_F32_448_BITS = 0x43E00000  # magnitudes at or above 448 saturate to 0x7E
_F32_2POW_M6_BITS = 0x3C800000  # 2^-6: below it the e4m3 grid is subnormal
_REBIAS = (127 - 7) << 3
_ANCHOR = 16384.0  # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step
_ANCHOR_BITS = 0x46800000

_luts: dict[tuple[str, int | None], torch.Tensor] = {}


def fp8_lut(device: torch.device) -> torch.Tensor:
    """The 256-entry decode table f32[256] on ``device`` (NaN codes decode as 0)."""
    key = (device.type, device.index)
    lut = _luts.get(key)
    if lut is None:
        lut = torch.from_numpy(np.array(fp8_format.LUT)).to(device)
        _luts[key] = lut
    return lut


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
    clamped = torch.clamp(magnitude, max=_F32_448_BITS)
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
    live = (amax > FP8_AMAX_FLOOR) & ~(amax > FP8_AMAX_CEIL)
    one = torch.ones_like(amax)
    safe = torch.where(live, amax, one)
    inv = torch.full_like(safe, FP8_MAX) / safe
    codes = fp8_encode(x * inv[..., None])
    codes = torch.where(live[..., None], codes, torch.zeros_like(codes))
    scales = torch.where(live, safe / torch.full_like(safe, FP8_MAX), one)
    return codes, scales


def fp8_dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``lut[code] * scale`` in f32: codes u8[..., n], scales f32[...] -> f32[..., n].

    Codes must be sanitized (no NaN code 0x7F/0xFF, which the encoder never writes and loading
    clears): on cpu/cuda the bytes are widened by torch's e4m3fn conversion, which equals the LUT
    everywhere else and reads 1 byte per value instead of an 8-byte gather index.
    """
    if codes.device.type in ("cpu", "cuda"):
        return codes.view(torch.float8_e4m3fn).float() * scales[..., None]
    lut = fp8_lut(codes.device)
    return lut[codes.long()] * scales[..., None]


def fp8_sanitize(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FORMAT.md section 4 on stored rows: NaN codes read as 0; a row whose scale is not in
    (0, 3.4e38) is inert (codes 0, scale 1)."""
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)
    bad = ~((scales > 0) & (scales < FP8_AMAX_CEIL))
    codes = torch.where(bad[..., None], torch.zeros_like(codes), codes)
    return codes, torch.where(bad, torch.ones_like(scales), scales)


# -- TQ: randomized Hadamard rotation (section 5) --------------------------------------------------

TQ_SEED = 0x9E3779B9
INT4_LEVELS = np.array(
    [-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
     0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733],
    dtype=np.float32,
)  # fmt: skip
PI_F32 = float(np.float32(3.14159265358979323846))
CODEC_POLAR = 0
CODEC_INT4 = 1

_consts: dict[tuple, torch.Tensor] = {}


def tq_width_ok(n: int) -> bool:
    """TQ rows need a power-of-two width in 2..2048 (otherwise a row encodes inert)."""
    return 2 <= n <= 2048 and n & (n - 1) == 0


def _hash32(x: np.ndarray) -> np.ndarray:
    x = (x.astype(np.uint64) + 0x9E3779B9) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _const(kind: str, n: int, device: torch.device) -> torch.Tensor:
    key = (kind, n, device.type, device.index)
    value = _consts.get(key)
    if value is None:
        if kind == "sign":
            i = np.arange(n, dtype=np.uint64)
            array = np.where(_hash32(np.uint64(TQ_SEED) ^ i) & 1, -1.0, 1.0).astype(np.float32)
        elif kind == "inv_sqrt":  # 1 / sqrtf(n), one f32 rounding each
            array = np.array([np.float32(1.0) / np.sqrt(np.float32(n))], dtype=np.float32)
        elif kind == "sqrt":
            array = np.array([np.sqrt(np.float32(n))], dtype=np.float32)
        elif kind == "levels":
            array = INT4_LEVELS
        else:  # pragma: no cover - internal keys only
            raise KeyError(kind)
        value = torch.from_numpy(np.ascontiguousarray(array)).to(device)
        _consts[key] = value
    return value


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


def tq_rotate(x: torch.Tensor) -> torch.Tensor:
    """``y = FWHT(x * sign) * (1/sqrtf(n))`` over the last axis (f32)."""
    n = x.shape[-1]
    return _fwht(x.float() * _const("sign", n, x.device)) * _const("inv_sqrt", n, x.device)


def tq_unrotate(y: torch.Tensor) -> torch.Tensor:
    """``x = FWHT(y) * (1/sqrtf(n)) * sign``: the inverse of :func:`tq_rotate`."""
    n = y.shape[-1]
    return (_fwht(y.float()) * _const("inv_sqrt", n, y.device)) * _const("sign", n, y.device)


def _radii(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row norms accumulated in f64 (f32 result) and the mask of rows that are not inert."""
    if x.device.type == "mps":  # no f64 on Metal: accumulate on the host
        radius = torch.from_numpy(np.sqrt(np.sum(np.square(x.cpu().double().numpy()), axis=-1)).astype(np.float32))
        radius = radius.to(x.device)
    else:
        radius = torch.sqrt(torch.sum(torch.square(x.double()), dim=-1)).float()
    live = (radius > FP8_AMAX_FLOOR) & ~(radius > FP8_AMAX_CEIL)
    return radius, live


def tq_row_bytes(n: int, codec: int, bits: int) -> int:
    """Packed bytes of one row of ``n`` values (without the radius)."""
    if codec == CODEC_INT4:
        return n // 2
    b1, b2 = bits, max(bits - 1, 1)
    return ((n // 2) * b1 + (n // 2 - 1) * b2 + 7) // 8


def int4_quantize_rows(rows: torch.Tensor, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated int4 (codec 1): codes u8[..., n/2] (even element in the low nibble), radii f32[...].

    ``invstd = sqrtf(n) / radius``; each element takes the nearest Lloyd-Max level of
    ``y * invstd`` (first index on a tie). Inert rows: zero bytes, radius 0.
    """
    x = rows.to(torch.float32)
    n = x.shape[-1]
    lead = x.shape[:-1]
    if not tq_width_ok(n):
        return torch.zeros(*lead, n // 2, dtype=torch.uint8, device=x.device), torch.zeros(lead, device=x.device)
    flat = x.reshape(-1, n)
    radius, live = _radii(flat)
    codes = torch.empty(flat.shape[0], n // 2, dtype=torch.uint8, device=x.device)
    levels = _const("levels", 16, x.device)
    sqrt_n = _const("sqrt", n, x.device)
    safe = torch.where(live, radius, torch.ones_like(radius))
    invstd = sqrt_n / safe
    for a in range(0, flat.shape[0], chunk_rows):  # bounds the [rows, n, 16] distance tensor
        b = min(flat.shape[0], a + chunk_rows)
        z = tq_rotate(flat[a:b]) * invstd[a:b, None]
        index = torch.argmin(torch.abs(z[..., None] - levels), dim=-1)
        # a row near f32's limit can overflow the butterflies: its distances are NaN, level 0 wins
        index = torch.where(torch.isfinite(z), index, torch.zeros_like(index)).to(torch.uint8)
        codes[a:b] = index[:, 0::2] | (index[:, 1::2] << 4)
    codes[~live] = 0
    radius = torch.where(live, radius, torch.zeros_like(radius))
    return codes.reshape(*lead, n // 2), radius.reshape(lead)


def int4_rotated_rows(codes: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Decoded int4 rows still in the rotated domain: ``level[c] * radius / sqrtf(n)`` f32[..., n]."""
    n = codes.shape[-1] * 2
    std = radii.float() / _const("sqrt", n, codes.device)
    levels = _const("levels", 16, codes.device)
    c = codes.long()
    index = torch.stack((c & 15, c >> 4), dim=-1).reshape(*codes.shape[:-1], n)
    return levels[index] * std[..., None]


def int4_dequantize_rows(codes: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`int4_quantize_rows`: f32[..., n]."""
    return tq_unrotate(int4_rotated_rows(codes, radii))


def _polar_levels(n: int) -> int:
    return int(math.log2(n))


def _polar_window(level: int) -> tuple[float, float]:
    """(lo, 2w) of a level >= 2 angle bin, in f32 as the spec computes them."""
    w = min(np.float32(1.5) / np.sqrt(np.float32(1 << (level - 1))), np.float32(PI_F32) / np.float32(4))
    lo = np.float32(PI_F32) / np.float32(4) - np.float32(w)
    return float(np.float32(lo)), float(np.float32(2) * np.float32(w))


def polar_quantize_rows(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PolarQuant (codec 0): codes u8[..., rb] as one LSB-first bit stream, radii f32[...]."""
    if not 2 <= bits <= 6:
        raise TierUnsupported(f"PolarQuant takes 2..6 bits, got {bits}")
    x = rows.to(torch.float32)
    n = x.shape[-1]
    lead = x.shape[:-1]
    rb = tq_row_bytes(n, CODEC_POLAR, bits)
    if not tq_width_ok(n):
        return torch.zeros(*lead, rb, dtype=torch.uint8, device=x.device), torch.zeros(lead, device=x.device)
    flat = x.reshape(-1, n)
    radius, live = _radii(flat)
    r = tq_rotate(flat)
    b1, b2 = bits, max(bits - 1, 1)
    dev = x.device

    def f32(v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32, device=dev)

    pieces = []
    level = 1
    while r.shape[-1] > 1:
        even, odd = r[:, 0::2], r[:, 1::2]
        angle = torch.atan2(odd, even)
        if level == 1:
            scaled = ((angle + f32(PI_F32)) * f32(float(np.float32(0.5) / np.float32(PI_F32)))) * f32(float(1 << b1))
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
    weights = (1 << torch.arange(8, device=dev, dtype=torch.int64))
    codes = (stream.view(-1, rb, 8) * weights).sum(-1).to(torch.uint8)
    codes[~live] = 0
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
    key = ("polar", n, bits, device.type, device.index)
    tables = _consts.get(key)
    if tables is None:
        b1, b2 = bits, max(bits - 1, 1)
        pi = np.float32(PI_F32)
        tables = []
        count, level = n // 2, 1
        while count >= 1:
            level_bits = b1 if level == 1 else b2
            q = np.arange(1 << level_bits, dtype=np.float32)
            bins = np.float32(1 << level_bits)
            if level == 1:
                centres = -pi + (q + np.float32(0.5)) * (np.float32(2.0) * pi) / bins
            else:
                lo, two_w = _polar_window(level)
                centres = np.float32(lo) + (q + np.float32(0.5)) * np.float32(two_w) / bins
            wide = centres.astype(np.float64)
            tables.append(
                (
                    torch.from_numpy(np.cos(wide).astype(np.float32)).to(device),
                    torch.from_numpy(np.sin(wide).astype(np.float32)).to(device),
                )
            )
            count //= 2
            level += 1
        _consts[key] = tables
    return tables


def polar_rotated_rows(codes: torch.Tensor, radii: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Decoded PolarQuant rows in the rotated domain f32[..., n] (before the inverse rotation)."""
    lead = codes.shape[:-1]
    rb = codes.shape[-1]
    dev = codes.device
    flat = codes.reshape(-1, rb).long()
    rows = flat.shape[0]
    stream = ((flat[..., None] >> torch.arange(8, device=dev)) & 1).reshape(rows, rb * 8)
    b1, b2 = bits, max(bits - 1, 1)
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
    return tq_unrotate(polar_rotated_rows(codes, radii, n, bits))


# -- Q8_0 blocks (section 7) -----------------------------------------------------------------------

Q8_BLOCK = 32


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
    """
    x = rows.to(torch.float32)
    n = x.shape[-1]
    if n % Q8_BLOCK:
        raise TierUnsupported(f"Q8_0 needs a row width that is a multiple of {Q8_BLOCK}, got {n}")
    blocks = x.reshape(*x.shape[:-1], n // Q8_BLOCK, Q8_BLOCK)
    magnitude = blocks.abs()
    nan = torch.isnan(blocks)
    amax = torch.where(nan, torch.zeros_like(magnitude), magnitude).amax(dim=-1)
    d = amax / torch.full_like(amax, 127.0)
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
    rounded = torch.where(inert, torch.zeros_like(rounded), torch.clamp(rounded, -127, 127))
    return rounded.to(torch.int8).reshape(x.shape), half


def q8_dequantize_blocks(codes: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``code * delta`` per block: int8[..., n], f16[..., n/32] -> f32[..., n]."""
    n = codes.shape[-1]
    blocks = codes.reshape(*codes.shape[:-1], n // Q8_BLOCK, Q8_BLOCK).float()
    return (blocks * deltas.float()[..., None]).reshape(codes.shape)


# -- the tier encoders: the reference codecs on the host, the torch twins on a device ---------------


def _host(rows: torch.Tensor) -> np.ndarray:
    return rows.detach().to(torch.float32).numpy()


def encode_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows (codes u8[..., n], scales f32[...]) on the rows' device."""
    if rows.device.type == "cpu":
        codes, scales = fp8_format.quantize_rows(_host(rows))
        return torch.from_numpy(codes), torch.from_numpy(scales)
    return fp8_quantize_rows(rows)


def encode_int4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated-int4 rows (codes u8[..., n/2], radii f32[...]) on the rows' device."""
    if rows.device.type == "cpu":
        from kvstore.formats import tq

        codes, radii = tq.quantize_rows(_host(rows), CODEC_INT4, 4)
        return torch.from_numpy(codes), torch.from_numpy(radii)
    return int4_quantize_rows(rows)


def encode_polar(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PolarQuant rows (codes u8[..., rb], radii f32[...]) on the rows' device."""
    if rows.device.type == "cpu":
        from kvstore.formats import tq

        codes, radii = tq.quantize_rows(_host(rows), CODEC_POLAR, bits)
        return torch.from_numpy(codes), torch.from_numpy(radii)
    return polar_quantize_rows(rows, bits)


def encode_q8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows (codes int8[..., n], deltas f16[..., n/32]) on the rows' device."""
    if rows.device.type == "cpu":
        from kvstore.formats import q8

        if rows.shape[-1] % Q8_BLOCK:
            raise TierUnsupported(f"Q8_0 needs a row width that is a multiple of {Q8_BLOCK}, got {rows.shape[-1]}")
        codes, deltas = q8.quantize_blocks(_host(rows))
        return torch.from_numpy(codes), torch.from_numpy(deltas)
    return q8_quantize_blocks(rows)
