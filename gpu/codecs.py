"""Row codecs in torch, on any device: the device-side twins of ``kvstore.formats`` fp8 / tq / q8.

Same arithmetic as the reference codecs (docs/FORMAT.md sections 3 to 7), in the same order, with torch
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

:func:`encode_tier`, :func:`decode_tier`, :func:`rotated_rows` and :func:`sanitize_tier_` take a tier
and go through its *torch twin*: one :class:`TorchTwin` per codec family of ``kvstore.formats``
(:class:`TorchFloat`, :class:`TorchFP8`, :class:`TorchInt4`, :class:`TorchPolar`, :class:`TorchQ8`),
registered against the family's class at the bottom of this module (:func:`register_torch_twin`)
and looked up by tier name (:func:`torch_twin`). On the host a twin encodes with the reference codec
of the tier itself (``Tier.quantize``: exact by definition).

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

from abc import ABC, abstractmethod

import numpy as np
import torch

from kvstore import tiers
from kvstore.formats import fp8, q8, tq
from kvstore.formats.codecs import RowCodec, registered_codecs
from kvstore.formats.errors import FormatError
from kvstore.formats.floats import BF16Codec, F32Codec
from kvstore.gpu.codec_tables import (
    E4M3_ANCHOR,
    E4M3_ANCHOR_BITS,
    E4M3_REBIAS,
    F32_2POW_M6_BITS,
    F32_448_BITS,
    F32_NAN_BITS,
    device_table,
    device_tensor,
    f32_quotient,
    fill_where,
)
from kvstore.gpu.tq_codecs import (
    encode_kernels,
    int4_dequantize_rows,
    int4_levels,
    int4_quantize_rows,
    int4_rotated_rows,
    polar_dequantize_rows,
    polar_quantize_rows,
    polar_rotated_rows,
    rotate,
    sanitize_tq_,
    sign_vector,
    unrotate,
    use_encode_kernels,
)

__all__ = [
    "FP8_MAX",
    "FP8_MAX_SCALE",
    "Q8_BLOCK",
    "TorchFP8",
    "TorchFloat",
    "TorchInt4",
    "TorchPolar",
    "TorchQ8",
    "TorchTwin",
    "as_tier",
    "decode_tier",
    "encode_kernels",
    "encode_tier",
    "encode_tier_pair",
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
    "register_torch_twin",
    "rotate",
    "rotated_rows",
    "sanitize_fp8_",
    "sanitize_tier_",
    "sanitize_tq_",
    "sign_vector",
    "torch_twin",
    "unrotate",
    "use_encode_kernels",
]

# -- fp8 e4m3 (docs/FORMAT.md section 3) ----------------------------------------------------------------

FP8_MAX = float(fp8.MAX)
#: The largest scale an encoder writes; a stored scale above it (or not above 0, or NaN) is corrupt.
FP8_MAX_SCALE = float(fp8.MAX_SCALE)
_AMAX_FLOOR = float(fp8.AMAX_FLOOR)
_AMAX_CEIL = float(fp8.AMAX_CEIL)
# step), and numpy scalars there become tensors it guards on.


def fp8_lut(device: torch.device | str) -> torch.Tensor:
    """The 256-entry decode table f32[256] of ``kvstore.formats.fp8.LUT`` on ``device`` (NaN codes read 0)."""
    device = torch.device(device)
    return device_table(("fp8-lut",), device, lambda: device_tensor(fp8.LUT, device))


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
    nan = magnitude > F32_NAN_BITS
    clamped = torch.clamp(magnitude, max=F32_448_BITS)
    # Round the f32 mantissa to 3 bits, ties to even; a carry bumps the exponent (spec's k == 16).
    code = ((clamped + 0x7FFFF + ((clamped >> 20) & 1)) >> 20) - E4M3_REBIAS
    small = magnitude < F32_2POW_M6_BITS
    anchor = torch.full_like(values, E4M3_ANCHOR, dtype=torch.float32)
    subnormal = (magnitude.view(torch.float32) + anchor).view(torch.int32) - E4M3_ANCHOR_BITS
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
    inv = f32_quotient(FP8_MAX, safe)
    codes = fp8_encode(x * inv[..., None])
    codes = torch.where(live[..., None], codes, torch.zeros_like(codes))
    scales = torch.where(live, f32_quotient(safe, FP8_MAX), one)
    return codes, scales


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


def sanitize_fp8_(
    codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/FORMAT.md section 4 on stored fp8 rows, in place: NaN codes (0x7F/0xFF) read 0; a row whose
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
    fill_where(codes, nan.view(torch.bool), 0)
    bad = ~((scales > 0) & (scales <= FP8_MAX_SCALE))
    if corrupt is not None:
        corrupt += bad.sum()
    fill_where(codes, bad.unsqueeze(-1), 0)
    fill_where(scales, bad, 1.0)
    return codes, scales


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


# -- by tier: one torch twin per codec family -------------------------------------------------------


class TorchTwin(ABC):
    """The device side of one ``kvstore.formats`` codec family: its rows encoded and decoded with
    torch ops on any device, as the family's reference codec encodes and decodes them.

    A twin serves every tier of its family (the PolarQuant twin every ``polarB``): each method
    takes the tier, whose fields (``bits``) say what the family needs. Twins are registered
    against the family's class (:func:`register_torch_twin`) and found by tier name
    (:func:`torch_twin`), a lookup ``torch.compile`` traces as a constant.

    Attributes
    ----------
    codes_dtype : the dtype of a row's codes or values on the device
    scales_dtype : the dtype of its scales, radii or deltas; None when a row has none
    host_reference : on the CPU, encode with the tier's reference codec (``Tier.quantize``, numpy)
    """

    codes_dtype: torch.dtype
    scales_dtype: torch.dtype | None = None
    host_reference: bool = True

    def encode(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f32 rows [..., n] -> (codes, scales or None) on the rows' device (see :func:`encode_tier`)."""
        if self.host_reference and rows.device.type == "cpu":
            codes, scales = tier.quantize(rows.detach().to(torch.float32).numpy())
            return torch.from_numpy(codes), None if scales is None else torch.from_numpy(scales)
        return self.quantize(tier, rows)

    @abstractmethod
    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f32 rows [..., n] -> (codes, scales or None), by torch ops on the rows' device."""

    @abstractmethod
    def dequantize(
        self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        """(codes, scales) -> f32 rows [..., width] on their device."""

    def rotated(self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
        """Rows decoded but left in the rotated domain (TQ families only)."""
        raise FormatError(f"{tier.name} rows are not stored rotated")

    def sanitize_(
        self, codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """docs/FORMAT.md section 4 on stored rows, in place (families with a per-row scale only)."""
        raise FormatError("these rows carry no stored scale to sanitize")


def _scales(tier: tiers.Tier, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        raise FormatError(f"{tier.name} rows need their scales to decode")
    return scales


def _bits(tier: tiers.Tier) -> int:
    if tier.bits is None:
        raise FormatError(f"{tier.name} has no bit width")
    return tier.bits


class TorchFloat(TorchTwin):
    """f32 and bf16 rows: values converted by torch (round to nearest even, as ``kvstore.tiers`` does)."""

    host_reference = False

    def __init__(self, dtype: torch.dtype):
        self.codes_dtype = dtype

    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rows.to(self.codes_dtype), None

    def dequantize(
        self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        return codes.float()


class TorchFP8(TorchTwin):
    """fp8 e4m3 codes + one f32 scale per row: :func:`fp8_quantize_rows`, :func:`fp8_dequantize_rows`."""

    codes_dtype = torch.uint8
    scales_dtype = torch.float32

    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return fp8_quantize_rows(rows)

    def dequantize(
        self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        return fp8_dequantize_rows(codes, _scales(tier, scales))

    def sanitize_(
        self, codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sanitize_fp8_(codes, scales, corrupt)


class _TorchTQ(TorchTwin):
    """What the TQ twins share: packed u8 codes + one f32 radius, rows of widths ``tq`` does not
    encode stored inert (they decode to zeros), the radius bound of :func:`sanitize_tq_`."""

    codes_dtype = torch.uint8
    scales_dtype = torch.float32

    def dequantize(
        self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        if not tq.encodable(width):  # such rows are written inert (docs/FORMAT.md section 5)
            return torch.zeros((*codes.shape[:-1], width), dtype=torch.float32, device=codes.device)
        return unrotate(self.rotated(tier, codes, _scales(tier, scales), width))

    def sanitize_(
        self, codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sanitize_tq_(codes, scales, corrupt)


class TorchInt4(_TorchTQ):
    """Rotated int4: :func:`int4_quantize_rows`, :func:`int4_rotated_rows`."""

    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return int4_quantize_rows(rows)

    def rotated(self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
        return int4_rotated_rows(codes, scales)


class TorchPolar(_TorchTQ):
    """PolarQuant at the tier's bits: :func:`polar_quantize_rows`, :func:`polar_rotated_rows`."""

    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return polar_quantize_rows(rows, _bits(tier))

    def rotated(self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
        return polar_rotated_rows(codes, scales, width, _bits(tier))


class TorchQ8(TorchTwin):
    """Q8_0 blocks: :func:`q8_quantize_blocks`, :func:`q8_dequantize_blocks`."""

    codes_dtype = torch.int8
    scales_dtype = torch.float16

    def quantize(self, tier: tiers.Tier, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return q8_quantize_blocks(rows)

    def dequantize(
        self, tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        return q8_dequantize_blocks(codes, _scales(tier, scales))


#: Tier name -> its family's twin (filled by :func:`register_torch_twin`).
_TWINS: dict[str, TorchTwin] = {}


def register_torch_twin(family: type[RowCodec], twin: TorchTwin) -> None:
    """Make ``twin`` the torch side of every registered codec of ``family`` (a ``kvstore.formats``
    codec class); a tier is then encoded and decoded on devices through it."""
    for name, codec in registered_codecs().items():
        if isinstance(codec, family):
            _TWINS[name] = twin


def torch_twin(tier: tiers.Tier | str) -> TorchTwin:
    """The torch twin of a tier (a ``kvstore.tiers.Tier`` or its name).

    Raises
    ------
    FormatError
        A tier whose family has no twin registered.
    """
    tier = as_tier(tier)
    # By name, not identity: inside torch.compile a frozen Tier is rebuilt as a constant, and an
    # ``is`` against the module's instance is then False.
    twin = _TWINS.get(tier.name)
    if twin is None:
        raise FormatError(f"no torch twin is registered for tier {tier.name!r}")
    return twin


def as_tier(tier: tiers.Tier | str) -> tiers.Tier:
    """A ``kvstore.tiers.Tier`` from a Tier or a name (old spellings warn, unknown names raise UnknownTier)."""
    return tier if isinstance(tier, tiers.Tier) else tiers.parse(tier)


def encode_tier(tier: tiers.Tier | str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """f32 rows -> the tier's fields on the rows' device, through the tier's :class:`TorchTwin`.

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
    return torch_twin(tier).encode(tier, rows)


def encode_tier_pair(
    tier: tiers.Tier | str, a: torch.Tensor, b: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`encode_tier` of two row sets of one leading shape (a layer's latent and rope rows):
    with :func:`use_encode_kernels` on, fp8 and int4 on CUDA encode both in one kernel
    (:mod:`kvstore.gpu.encode_kernels`, the same bytes)."""
    tier = as_tier(tier)
    kernels = encode_kernels() if a.device.type == "cuda" else None
    if (
        not tier.holds_values
        and kernels is not None
        and kernels.usable(tier.name, a, b)
        and a.shape[:-1] == b.shape[:-1]
    ):
        first, second = kernels.encode_rows(tier.name, (a, b))
        return first, second
    return encode_tier(tier, a), encode_tier(tier, b)


def decode_tier(tier: tiers.Tier | str, values: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    """The tier's fields -> f32 rows ``[..., width]`` on their device (the torch twins everywhere).

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    values, scales : as :func:`encode_tier` returns them
    width : n, the row width (TQ codes do not fix it)
    """
    tier = as_tier(tier)
    return torch_twin(tier).dequantize(tier, values, scales, width)


def rotated_rows(tier: tiers.Tier | str, codes: torch.Tensor, radii: torch.Tensor, width: int) -> torch.Tensor:
    """A TQ tier's rows decoded but left in the rotated domain (what attention reads): f32[..., width]."""
    tier = as_tier(tier)
    return torch_twin(tier).rotated(tier, codes, radii, width)


def sanitize_tier_(
    tier: tiers.Tier | str, codes: torch.Tensor, scales: torch.Tensor, corrupt: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sanitize_fp8_` or :func:`sanitize_tq_`, as the tier's family reads its stored rows.

    Parameters
    ----------
    tier : a file tier with a per-row scale (fp8, int4, polarB), or its name
    codes, scales, corrupt : as :func:`sanitize_fp8_` takes them

    Raises
    ------
    FormatError
        A tier whose rows carry no stored scale.
    """
    return torch_twin(tier).sanitize_(codes, scales, corrupt)


register_torch_twin(F32Codec, TorchFloat(torch.float32))
register_torch_twin(BF16Codec, TorchFloat(torch.bfloat16))
register_torch_twin(fp8.FP8Codec, TorchFP8())
register_torch_twin(tq.Int4Codec, TorchInt4())
register_torch_twin(tq.PolarCodec, TorchPolar())
register_torch_twin(q8.Q8Codec, TorchQ8())
