"""TurboQuant rows in torch (docs/FORMAT.md sections 5 and 6): the randomized Hadamard rotation,
the radius bound, rotated int4 and PolarQuant, as :mod:`kvstore.formats.tq` computes them.

Part of the torch twins of :mod:`kvstore.gpu.codecs` (which re-exports every public name here);
the same exactness rules hold: every division is between two tensors on the device, and int4 is
bit-exact by construction while PolarQuant's ``atan2``/``hypot``/``cos``/``sin`` follow the device's
last-ulp behaviour.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore import tiers
from kvstore.formats import tq
from kvstore.gpu.codec_tables import device_table, device_tensor, f32_quotient, fill_where

__all__ = [
    "encode_kernels",
    "int4_dequantize_rows",
    "int4_levels",
    "int4_quantize_rows",
    "int4_rotated_rows",
    "polar_dequantize_rows",
    "polar_quantize_rows",
    "polar_rotated_rows",
    "rotate",
    "sanitize_tq_",
    "sign_vector",
    "unrotate",
    "use_encode_kernels",
]

# Python floats, not numpy scalars: torch.compile traces these codecs (the engine's compiled decode
# step), and numpy scalars there become tensors it guards on.
_RADIUS_FLOOR = float(tq.RADIUS_FLOOR)
_RADIUS_CEIL = float(tq.RADIUS_CEIL)


# -- TQ: the randomized Hadamard rotation (section 5) ----------------------------------------------


def sign_vector(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's +-1 signs (``kvstore.formats.tq.signs``) as ``dtype[n]`` on ``device``."""
    device = torch.device(device)
    return device_table(("sign", int(n), dtype), device, lambda: device_tensor(tq.signs(int(n)), device, dtype))


def _inv_sqrt(n: int, device: torch.device) -> torch.Tensor:
    """``1 / sqrtf(n)`` with one f32 rounding each, as the spec computes it (f32[1])."""
    return device_table(
        ("inv_sqrt", n),
        device,
        lambda: device_tensor(np.array([np.float32(1.0) / np.sqrt(np.float32(n))], np.float32), device),
    )


def _sqrt(n: int, device: torch.device) -> torch.Tensor:
    """``sqrtf(n)`` (f32[1])."""
    return device_table(
        ("sqrt", n), device, lambda: device_tensor(np.array([np.sqrt(np.float32(n))], np.float32), device)
    )


def int4_levels(device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 Lloyd-Max levels of ``kvstore.formats.tq.LEVELS`` as ``dtype[16]`` on ``device``."""
    device = torch.device(device)
    return device_table(("levels", dtype), device, lambda: device_tensor(tq.LEVELS, device, dtype))


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
    """docs/FORMAT.md section 4 on stored TQ rows, in place (``tq.sanitize_radii``): a radius not in
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
    fill_where(codes, bad.unsqueeze(-1), 0)
    fill_where(radii, bad, 0.0)
    return codes, radii


def int4_quantize_rows(
    rows: torch.Tensor, chunk_rows: int = 4096, *, kernel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated int4 (codec 1): codes u8[..., n/2] (even element in the low nibble), radii f32[...].

    ``invstd = sqrtf(n) / radius``; each element takes the nearest Lloyd-Max level of
    ``y * invstd`` (first index on a tie). Inert rows (and widths ``tq`` does not encode): zero
    bytes, radius 0. On CUDA one Triton kernel (:mod:`kvstore.gpu.encode_kernels`) encodes them;
    ``kernel=False`` keeps the torch ops (the tests and benchmarks compare the two).
    """
    x = rows.to(torch.float32)
    kernels = encode_kernels() if kernel and x.device.type == "cuda" else None
    if kernels is not None and kernels.usable("int4", x):  # one Triton kernel, the same bytes
        return kernels.int4_encode(x)[0]
    n = x.shape[-1]
    lead = x.shape[:-1]
    if not tq.encodable(n):
        return torch.zeros(*lead, n // 2, dtype=torch.uint8, device=x.device), torch.zeros(lead, device=x.device)
    flat = x.reshape(-1, n)
    radius, live = _radii(flat)
    codes = torch.empty(flat.shape[0], n // 2, dtype=torch.uint8, device=x.device)
    levels = int4_levels(x.device)
    safe = torch.where(live, radius, torch.ones_like(radius))
    invstd = f32_quotient(_sqrt(n, x.device), safe)
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


_ENCODE_KERNELS = None
#: Whether CUDA encodes run the Triton kernel (:func:`use_encode_kernels`): on since it was tested
#: and measured on an H100 (BENCHMARKS.md, "A decode step with fewer kernels"; docs/GPU.md).
_ENCODE_KERNELS_ON = True


def use_encode_kernels(enabled: bool) -> None:
    """Whether rows encoded on CUDA from now on (the decode step's writes of caches made after
    this, ``int4_quantize_rows``, ``encode_tier_pair``) take the one Triton kernel of
    :mod:`kvstore.gpu.encode_kernels` (the default) or the torch ops
    (``bench/engine_decode.py --torch-encode`` compares them). The bytes are the same either way."""
    global _ENCODE_KERNELS_ON
    _ENCODE_KERNELS_ON = bool(enabled)


def encode_kernels():
    """:mod:`kvstore.gpu.encode_kernels` where Triton runs and :func:`use_encode_kernels` allows
    it, else None; looked up once (a compiled decode step reads the cached answer)."""
    global _ENCODE_KERNELS
    if not _ENCODE_KERNELS_ON:
        return None
    if _ENCODE_KERNELS is None:
        _ENCODE_KERNELS = False
        from torch.utils._triton import has_triton

        if has_triton():
            from kvstore.gpu import encode_kernels as module

            _ENCODE_KERNELS = module
    return _ENCODE_KERNELS or None


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
                (
                    device_tensor(np.cos(wide).astype(np.float32), device),
                    device_tensor(np.sin(wide).astype(np.float32), device),
                )
            )
            count //= 2
            level += 1
        return tables

    return device_table(("polar", n, bits), device, build)


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
