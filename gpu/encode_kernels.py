"""A layer's new latent and rope rows encoded (fp8 or rotated int4) and stored on CUDA in one Triton kernel.

In a decode step the fp8 and int4 caches encode each layer's new rows and put them at their slots:
under ``torch.compile`` the torch twins (:mod:`kvstore.gpu.codecs`) are several kernels per row
width (int4: the radius's f64 reduction, the rotation's butterflies realized a few stages at a
time, the nearest level, the packing; a dozen), and the slots take four ``index_copy_`` more (codes
and scales of both widths). At one token per session those launches cost more than the work. Here
one program encodes one row in registers and writes its codes and scale straight to its slot, and
one launch does a layer's latent rows and rope rows together (``program_id(1)`` picks which).

Bit-exact with docs/FORMAT.md, as the twins are:

* fp8 (section 3): ``amax`` with NaN read as 0, ``448/amax`` and ``amax/448`` as correctly rounded
  f32 quotients (in f64, rounded once), ``x * inv`` then the e4m3 rounding in integer arithmetic
  on the f32 bits (ties to even, saturation at 448, the subnormal grid through an f32 anchor add);
* int4 (sections 5 and 6): the radius summed in f64, the butterflies in the spec's order, the
  ``1/sqrtf(n)`` and ``invstd`` products each rounded, the nearest of the 16 levels (first wins a
  tie). Triton fuses a product and a sum into one multiply-add by default, which would skip the
  rounding of ``y * invstd`` before the distances: that product is a ``mul.rn.f32`` no compiler
  fuses. (fp8's product feeds integer operations, never an add.)

``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors (numpy fuses nothing).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
import triton
import triton.language as tl

from kvstore.formats import fp8, tq
from kvstore.gpu import codec_tables
from kvstore.gpu.codec_tables import device_table, device_tensor
from kvstore.gpu.dependent import gdc_wait, launch_options

__all__ = ["FORMATS", "MAX_WIDTH", "encode_rows", "int4_encode", "usable"]

#: The widest row the spec's rotation takes (docs/FORMAT.md section 5); the kernel's bound for fp8 too.
MAX_WIDTH = 2048
#: Tier name -> the kernel's FORMAT (f32: the rows stored as they are, one kernel where
#: ``index_copy_`` took one per width).
FORMATS = {"fp8": 0, "int4": 1, "f32": 2}

# The bounds as the f32 values the comparisons use (a float constant meets an f32 tensor as f32).
_FP8_FLOOR = tl.constexpr(float(np.float32(fp8.AMAX_FLOOR)))
_FP8_CEIL = tl.constexpr(float(np.float32(fp8.AMAX_CEIL)))
_TQ_FLOOR = tl.constexpr(float(np.float32(tq.RADIUS_FLOOR)))
_TQ_CEIL = tl.constexpr(float(np.float32(tq.RADIUS_CEIL)))
# e4m3 from the f32 bits, as kvstore.gpu.codecs.fp8_encode computes it (codec_tables' constants)
_FP8_MAX = tl.constexpr(float(fp8.MAX))
_F32_NAN_BITS = tl.constexpr(codec_tables.F32_NAN_BITS)
_F32_448_BITS = tl.constexpr(codec_tables.F32_448_BITS)
_F32_2POW_M6_BITS = tl.constexpr(codec_tables.F32_2POW_M6_BITS)
_REBIAS = tl.constexpr(codec_tables.E4M3_REBIAS)
_ANCHOR = tl.constexpr(codec_tables.E4M3_ANCHOR)
_ANCHOR_BITS = tl.constexpr(codec_tables.E4M3_ANCHOR_BITS)


@triton.jit
def _product_rn(a, b, EXACT: tl.constexpr):
    """``a * b`` rounded once to f32 and never fused with what uses it."""
    if EXACT:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _fp8_row(x):
    """(codes u8[N], scale) of one f32 row."""
    magnitude = tl.abs(x)
    amax = tl.max(tl.where(magnitude != magnitude, 0.0, magnitude), axis=0)
    live = (amax > _FP8_FLOOR) & ~(amax > _FP8_CEIL)
    safe = tl.where(live, amax, 1.0)
    fp8_max = tl.full((), _FP8_MAX, tl.float64)
    inv = (fp8_max / safe.to(tl.float64)).to(tl.float32)
    bits = (x * inv).to(tl.int32, bitcast=True)
    m = bits & 0x7FFFFFFF
    clamped = tl.minimum(m, _F32_448_BITS)
    code = ((clamped + 0x7FFFF + ((clamped >> 20) & 1)) >> 20) - _REBIAS  # the mantissa to 3 bits, ties to even
    subnormal = (m.to(tl.float32, bitcast=True) + _ANCHOR).to(tl.int32, bitcast=True) - _ANCHOR_BITS
    code = tl.where(m < _F32_2POW_M6_BITS, subnormal, code)
    code = tl.where(m > _F32_NAN_BITS, 0, code | ((bits >> 24) & 0x80))  # NaN -> 0
    code = tl.where(live, code, 0)
    scale = tl.where(live, (safe.to(tl.float64) / fp8_max).to(tl.float32), 1.0)
    return code.to(tl.uint8), scale


@triton.jit
def _int4_row(x, signs_ptr, consts_ptr, levels_ptr, N: tl.constexpr, LOG_N: tl.constexpr, EXACT: tl.constexpr):
    """(codes u8[N / 2], radius) of one f32 row."""
    i = tl.arange(0, N)
    wide = x.to(tl.float64)
    radius = tl.sqrt(tl.sum(wide * wide, axis=0)).to(tl.float32)
    live = (radius > _TQ_FLOOR) & ~(radius > _TQ_CEIL)
    safe = tl.where(live, radius, 1.0)
    invstd = (tl.load(consts_ptr).to(tl.float64) / safe.to(tl.float64)).to(tl.float32)
    # the butterflies in the spec's order: stage ``length`` pairs a[j] with a[j + length] in every
    # block of 2 * length, (a + b, a - b) in place
    h = x * tl.load(signs_ptr + i)
    for stage in tl.static_range(LOG_N):  # pyright: ignore[reportGeneralTypeIssues]  (a Triton loop)
        # length 1 << stage (a constexpr is not reassigned across iterations: the shape is inline)
        blocks = tl.permute(tl.reshape(h, (N >> (stage + 1), 2, 1 << stage)), (0, 2, 1))
        a, b = tl.split(blocks)
        h = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (N,))
    z = _product_rn(h * tl.load(consts_ptr + 1), invstd, EXACT)
    best = tl.abs(z - tl.load(levels_ptr))
    index = tl.zeros((N,), dtype=tl.int32)
    for level in tl.static_range(1, 16):  # pyright: ignore[reportGeneralTypeIssues]  (a Triton loop)
        distance = tl.abs(z - tl.load(levels_ptr + level))
        closer = distance < best  # strict: the first level wins a tie
        index = tl.where(closer, level, index)
        best = tl.where(closer, distance, best)
    # a row near f32's limit overflows the butterflies: its distances are NaN, level 0 stands
    index = tl.where((z == z) & (tl.abs(z) < float("inf")), index, 0)
    index = tl.where(live, index, 0)  # an inert row: zero bytes
    low, high = tl.split(tl.reshape(index, (N // 2, 2)))
    return (low | (high << 4)).to(tl.uint8), tl.where(live, radius, 0.0)


@triton.jit
def _encode_row(
    x_ptr,
    stride,
    codes_ptr,
    scales_ptr,
    signs_ptr,
    consts_ptr,
    levels_ptr,
    positions_ptr,
    FORMAT: tl.constexpr,
    N: tl.constexpr,
    LOG_N: tl.constexpr,
    POSITIONS: tl.constexpr,
    EXACT: tl.constexpr,
):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * stride + tl.arange(0, N)).to(tl.float32)
    slot = tl.load(positions_ptr + row) if POSITIONS else row  # where the row goes
    if FORMAT == 2:  # f32: the values as they are, no scale
        tl.store(codes_ptr + slot * N + tl.arange(0, N), x)
    else:
        if FORMAT == 0:
            codes, scale = _fp8_row(x)
            tl.store(codes_ptr + slot * N + tl.arange(0, N), codes)
        else:
            codes, scale = _int4_row(x, signs_ptr, consts_ptr, levels_ptr, N, LOG_N, EXACT)
            tl.store(codes_ptr + slot * (N // 2) + tl.arange(0, N // 2), codes)
        tl.store(scales_ptr + slot, scale)


@triton.jit
def _encode_kernel(
    x0_ptr,
    stride0,
    codes0_ptr,
    scales0_ptr,
    signs0_ptr,
    consts0_ptr,
    x1_ptr,
    stride1,
    codes1_ptr,
    scales1_ptr,
    signs1_ptr,
    consts1_ptr,
    levels_ptr,
    positions_ptr,
    FORMAT: tl.constexpr,
    N0: tl.constexpr,
    LOG_N0: tl.constexpr,
    N1: tl.constexpr,
    LOG_N1: tl.constexpr,
    POSITIONS: tl.constexpr,
    EXACT: tl.constexpr,
    WAIT: tl.constexpr,
):
    if WAIT:  # launched dependently (kvstore.gpu.dependent): nothing is touched before the grid ahead is done
        gdc_wait()  # pyright: ignore[reportOptionalCall]  (WAIT only where it exists)
    if tl.program_id(1) == 0:
        _encode_row(
            x0_ptr, stride0, codes0_ptr, scales0_ptr, signs0_ptr, consts0_ptr, levels_ptr, positions_ptr,
            FORMAT, N0, LOG_N0, POSITIONS, EXACT,
        )  # fmt: skip
    else:
        _encode_row(
            x1_ptr, stride1, codes1_ptr, scales1_ptr, signs1_ptr, consts1_ptr, levels_ptr, positions_ptr,
            FORMAT, N1, LOG_N1, POSITIONS, EXACT,
        )  # fmt: skip


def usable(tier: str, *rows: torch.Tensor) -> bool:
    """Whether :func:`encode_rows` takes these rows here: a tier of :data:`FORMATS`, f32 / bf16 /
    f16 rows on CUDA, power-of-two widths from 2 up to :data:`MAX_WIDTH` (what the spec's rotation
    takes). The kernel itself also runs under Triton's interpreter, as the tests call it."""
    return tier in FORMATS and all(
        r.device.type == "cuda"
        and r.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and 2 <= r.shape[-1] <= MAX_WIDTH
        and r.shape[-1] & (r.shape[-1] - 1) == 0
        for r in rows
    )


def _constants(n: int, device: torch.device) -> torch.Tensor:
    """f32[2] on ``device``: ``sqrtf(n)``, ``1/sqrtf(n)`` as the spec rounds them (a device table:
    nothing is copied while a step is captured, and no f64 Python float reaches the interpreter)."""

    def build() -> torch.Tensor:
        sqrt_n = np.sqrt(np.float32(n))
        return device_tensor(np.array([sqrt_n, np.float32(1.0) / sqrt_n], np.float32), device)

    return device_table(("encode_constants", int(n)), device, build)


def encode_rows(
    tier: str,
    rows: tuple[torch.Tensor, ...],
    out: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] | None = None,
    positions: torch.Tensor | None = None,
    *,
    dependent: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The ``tier``'s fields (``fp8``, ``int4``: codes and scales; ``f32``: the values) of one or two
    row sets in one launch.

    Parameters
    ----------
    rows : one or two [..., n] tensors (f32, bf16 or f16; with two, the same leading shape)
    out : for each, (codes, scales or None for f32) to write into: contiguous [slots, width] and
        [slots] (a cache layer's buffers), with ``positions`` int64[rows] giving each row's slot;
        None: new tensors, row i at i
    dependent : launch with programmatic dependent launch (:mod:`kvstore.gpu.dependent`; CUDA sm_90+
        and a Triton with the wait: the caller checks), the kernel waiting first for the one ahead

    Returns
    -------
    For each row set, (codes u8[..., n] for fp8, u8[..., n/2] for int4, f32[..., n] for f32;
    scales f32[...], None for f32): the bytes ``kvstore.formats`` writes (``out`` itself when given).
    """
    if not 1 <= len(rows) <= 2 or (len(rows) == 2 and rows[0].shape[:-1] != rows[1].shape[:-1]):
        raise ValueError("encode_rows takes one or two row sets of one leading shape")
    if tier not in FORMATS:
        raise ValueError(f"encode_rows encodes {sorted(FORMATS)}, not {tier!r}")
    if (out is None) != (positions is None) or (out is not None and len(out) != len(rows)):
        raise ValueError("out and positions go together, one (codes, scales) per row set")
    int4, plain = tier == "int4", tier == "f32"
    codes_dtype = torch.float32 if plain else torch.uint8
    device = rows[0].device
    flats: list[torch.Tensor] = []
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for k, r in enumerate(rows):
        n = r.shape[-1]
        width = n // 2 if int4 else n
        flat = r.reshape(-1, n)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        flats.append(flat)
        if out is None:
            codes = torch.empty((*r.shape[:-1], width), dtype=codes_dtype, device=device)
            scales = None if plain else torch.empty(r.shape[:-1], dtype=torch.float32, device=device)
        else:
            codes, scales = out[k]
            if (
                codes.shape[-1] != width
                or codes.dtype != codes_dtype
                or not codes.is_contiguous()
                or (scales is None) != plain
                or (scales is not None and not scales.is_contiguous())
            ):
                raise ValueError(f"{tier} rows {n} wide are written into contiguous {codes_dtype} [slots, {width}]"
                                 + ("" if plain else " and f32 [slots] scales"))  # fmt: skip
        outputs.append((codes, scales))
    count = flats[0].shape[0]
    if count:
        from kvstore.gpu.tq_codecs import int4_levels, sign_vector

        second = 1 if len(rows) == 2 else 0
        args = []
        for k in (0, second):
            n = flats[k].shape[1]
            codes, scales = outputs[k]
            args += [flats[k], flats[k].stride(0), codes, codes if scales is None else scales]
            tables = (sign_vector(n, torch.float32, device), _constants(n, device)) if int4 else (flats[k],) * 2
            args += tables
        n0, n1 = flats[0].shape[1], flats[second].shape[1]
        _encode_kernel[(count, len(rows))](
            *args,
            int4_levels(device) if int4 else flats[0],  # pyright: ignore[reportCallIssue]  (args: 12 of them)
            flats[0] if positions is None else positions,  # pyright: ignore[reportCallIssue]
            FORMAT=FORMATS[tier],
            N0=n0,
            LOG_N0=n0.bit_length() - 1,
            N1=n1,
            LOG_N1=n1.bit_length() - 1,
            POSITIONS=positions is not None,
            EXACT=device.type == "cuda",
            WAIT=dependent,
            num_warps=4 if max(n0, n1) >= 512 else 1,  # pyright: ignore[reportCallIssue]
            # no product fused into a sum; torch.compile's wrapper takes no compile options (there
            # Triton's default holds and the mul.rn.f32 keeps int4's product unfused)
            **({} if torch.compiler.is_compiling() else {"enable_fp_fusion": False}),
            **launch_options(dependent),
        )
    return outputs


def int4_encode(*rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rotated int4 codes and radii of one or two sets of rows: :func:`encode_rows` for ``int4``."""
    return [(codes, cast(torch.Tensor, radii)) for codes, radii in encode_rows("int4", rows)]
