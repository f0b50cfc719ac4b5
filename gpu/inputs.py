"""Input checks shared by every backend: shapes, dtypes, devices, then (optionally) value ranges.

The shape checks read only metadata. :func:`check_ranges` reads the sequence bounds and the
selection indices, which costs one device-to-host synchronization when they live on a GPU; the
public functions run it unless called with ``validate=False`` (the CUDA kernels never read outside
the row arrays either way: rows outside them are skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvstore import tiers
from kvstore.gpu.errors import AttentionInputError

__all__ = [
    "DecodeProblem",
    "RowLayout",
    "as_tier",
    "check_inputs",
    "check_ranges",
    "dense_tier",
    "prepare_out",
    "row_layout",
]


@dataclass(frozen=True)
class DecodeProblem:
    """The geometry of one decode-attention call, read from its inputs."""

    tier: tiers.Tier
    batch: int
    heads: int
    kv_lora: int
    qk_rope: int
    n_rows: int
    selected: int | None  # index columns S of the selected-rows variant, else None
    device: torch.device


@dataclass(frozen=True)
class RowLayout:
    """How one row of a tier reaches a decode function: its values/codes, and its scale part."""

    codes_dtype: torch.dtype
    code_width: int
    scales_dtype: torch.dtype | None  # None: the tier has no scales (f32, bf16)
    scales_shape: tuple[int, ...]  # trailing shape of one row's scales: () or (width // 32,)


_SHORT = {torch.uint8: "u8", torch.int8: "i8", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def row_layout(tier: tiers.Tier, width: int) -> RowLayout:
    """The operand layout of rows of ``width`` values in ``tier`` (``kvstore.tiers`` sizes)."""
    if tier is tiers.F32:
        return RowLayout(torch.float32, width, None, ())
    if tier is tiers.BF16:
        return RowLayout(torch.bfloat16, width, None, ())
    if tier is tiers.Q8:
        return RowLayout(torch.int8, width, torch.float16, (tier.scale_bytes(width) // 2,))
    return RowLayout(torch.uint8, tier.payload_bytes(width), torch.float32, ())


def _need(cond: bool, reason: str | Callable[[], str]) -> None:
    # A message that formats tensors is passed as a lambda: formatted only when the check fails,
    # so a plain call pays for comparisons, not for strings.
    if not cond:
        raise AttentionInputError(reason() if callable(reason) else reason)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"


def _tensor(name: str, t, dtype: torch.dtype, ndim: int) -> None:
    _need(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch tensor, got {_describe(t)}")
    _need(t.dtype == dtype, lambda: f"{name} must be {str(dtype).replace('torch.', '')}, got {_describe(t)}")
    _need(t.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got {_describe(t)}")


def as_tier(tier: tiers.Tier | str) -> tiers.Tier:
    """The tier of a Tier or a name; a name that is no tier is an AttentionInputError."""
    if isinstance(tier, tiers.Tier):
        return tier
    try:
        return tiers.parse(tier)
    except tiers.UnknownTier as exc:
        raise AttentionInputError(exc.reason) from None


def dense_tier(rows) -> tiers.Tier:
    """The tier of dense (unquantized) rows, from their dtype: bf16 for bfloat16 rows, else f32."""
    return tiers.BF16 if getattr(rows, "dtype", None) == torch.bfloat16 else tiers.F32


def check_inputs(
    tier: tiers.Tier | str,
    q_lat,
    q_rope,
    lc_codes,
    lc_scales,
    rc_codes,
    rc_scales,
    seq_start,
    seq_len,
    softmax_scale,
    out=None,
    indices=None,
    n_selected=None,
) -> DecodeProblem:
    """Check shapes, dtypes and devices; return the call's geometry.

    Parameters
    ----------
    tier : a ``kvstore.tiers.Tier`` or its name
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    lc_codes : the latent rows as :func:`row_layout` says: f32[N, K] (f32), bf16[N, K] (bf16),
        u8[N, K] (fp8), u8[N, rb(K)] (int4, polarB), i8[N, K] (q8)
    lc_scales : f32[N] (fp8 scales, TQ radii), f16[N, K/32] (q8 deltas), None (f32, bf16)
    rc_codes, rc_scales : the rope rows, the same with R
    seq_start, seq_len : i32[B] (on the query's device or on the CPU)
    softmax_scale : finite float
    out : f32[B, H, K] on the query's device, optional
    indices : i32[B, S], n_selected : i32[B] (selected-rows variant only)

    Raises
    ------
    AttentionInputError
        With the first problem found.
    """
    tier = as_tier(tier)
    _tensor("q_lat", q_lat, torch.float32, 3)
    _tensor("q_rope", q_rope, torch.float32, 3)
    batch, heads, kv_lora = q_lat.shape
    qk_rope = q_rope.shape[2]
    _need(
        q_rope.shape[:2] == q_lat.shape[:2],
        lambda: f"q_rope {_describe(q_rope)} does not match q_lat {_describe(q_lat)}",
    )
    _need(batch >= 1 and heads >= 1 and kv_lora >= 1 and qk_rope >= 1, lambda: f"empty query {_describe(q_lat)}")
    device = q_lat.device
    for name, width in (("kv_lora", kv_lora), ("qk_rope", qk_rope)):
        problem = tier.width_problem(width)
        _need(problem is None, lambda: f"{name}: {problem}")
    layouts = (
        ("lc", lc_codes, lc_scales, row_layout(tier, kv_lora)),
        ("rc", rc_codes, rc_scales, row_layout(tier, qk_rope)),
    )
    n_rows = lc_codes.shape[0] if isinstance(lc_codes, torch.Tensor) else 0
    for prefix, codes, scales, layout in layouts:
        _tensor(f"{prefix}_codes", codes, layout.codes_dtype, 2)
        _need(
            codes.shape[1] == layout.code_width,
            lambda: (
                f"{prefix}_codes must be {_SHORT[layout.codes_dtype]}[N, {layout.code_width}] for {tier.name}, "
                f"got {_describe(codes)}"
            ),
        )
        _need(codes.shape[0] == n_rows, lambda: f"{prefix}_codes has {codes.shape[0]} rows, lc_codes {n_rows}")
        _need(codes.device == device, lambda: f"{prefix}_codes is on {codes.device}, q_lat on {device}")
        if layout.scales_dtype is None:
            _need(scales is None, lambda: f"{tier.name} rows have no scales, got {prefix}_scales {_describe(scales)}")
            continue
        _tensor(f"{prefix}_scales", scales, layout.scales_dtype, 1 + len(layout.scales_shape))
        _need(
            tuple(scales.shape[1:]) == layout.scales_shape,
            lambda: (
                f"{prefix}_scales must be {_SHORT[layout.scales_dtype]}[N{''.join(f', {d}' for d in layout.scales_shape)}] "
                f"for {tier.name}, got {_describe(scales)}"
            ),
        )
        _need(scales.shape[0] == n_rows, lambda: f"{prefix}_scales has {scales.shape[0]} rows, lc_codes {n_rows}")
        _need(scales.device == device, lambda: f"{prefix}_scales is on {scales.device}, q_lat on {device}")
    _need(q_rope.device == device, lambda: f"q_rope is on {q_rope.device}, q_lat on {device}")
    for name, t in (("seq_start", seq_start), ("seq_len", seq_len)):
        _tensor(name, t, torch.int32, 1)
        _need(t.shape[0] == batch, lambda: f"{name} must be i32[{batch}], got {_describe(t)}")
        _need(
            t.device == device or t.device.type == "cpu",
            lambda: f"{name} must be on {device} or the CPU, got {t.device}",
        )
    selected = None
    if indices is not None or n_selected is not None:
        _tensor("indices", indices, torch.int32, 2)
        _tensor("n_selected", n_selected, torch.int32, 1)
        _need(indices.shape[0] == batch, lambda: f"indices must be i32[{batch}, S], got {_describe(indices)}")
        _need(n_selected.shape[0] == batch, lambda: f"n_selected must be i32[{batch}], got {_describe(n_selected)}")
        for name, t in (("indices", indices), ("n_selected", n_selected)):
            _need(
                t.device == device or t.device.type == "cpu",
                lambda: f"{name} must be on {device} or the CPU, got {t.device}",
            )
        selected = int(indices.shape[1])
    _need(
        isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale),
        lambda: f"softmax_scale must be a finite float, got {softmax_scale!r}",
    )
    if out is not None:
        _need(
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and tuple(out.shape) == (batch, heads, kv_lora)
            and out.device == device
            and out.is_contiguous(),
            lambda: f"out must be a contiguous f32[{batch}, {heads}, {kv_lora}] on {device}, got {_describe(out)}",
        )
    return DecodeProblem(tier, batch, heads, kv_lora, qk_rope, n_rows, selected, device)


def check_ranges(problem: DecodeProblem, seq_start, seq_len, indices=None, n_selected=None) -> None:
    """Check that every sequence lies inside the row arrays and every selected index inside its sequence.

    Reads the values (one synchronization when they are on a GPU).

    Raises
    ------
    AttentionInputError
    """
    start = seq_start.to(torch.int64)
    length = seq_len.to(torch.int64)
    problems = torch.stack(
        [
            (length < 0).any(),
            (start < 0).any(),
            (start + length > problem.n_rows).any(),
        ]
    )
    if indices is not None:
        n_sel = n_selected.to(device=indices.device, dtype=torch.int64)
        columns = torch.arange(indices.shape[1], device=indices.device)
        used = columns[None, :] < n_sel[:, None]
        limit = length.to(indices.device)[:, None]
        bad_index = used & ((indices < 0) | (indices.to(torch.int64) >= limit))
        problems = torch.cat(
            [
                problems.to(indices.device),
                torch.stack([((n_sel < 0) | (n_sel > indices.shape[1])).any(), bad_index.any()]),
            ]
        )
    flags = problems.cpu().tolist()
    _need(not flags[0], "seq_len holds a negative length")
    _need(not flags[1], "seq_start holds a negative row")
    _need(not flags[2], lambda: f"a sequence runs past the {problem.n_rows} cache rows (seq_start + seq_len > N)")
    if indices is not None:
        _need(not flags[3], lambda: f"n_selected must lie in 0..{indices.shape[1]}")
        _need(not flags[4], "indices hold a row outside its sequence (each must be in 0..seq_len-1)")


def prepare_out(out: torch.Tensor | None, problem: DecodeProblem) -> torch.Tensor:
    """``out`` itself, or a new f32[B, H, K] on the query's device."""
    if out is None:
        return torch.empty((problem.batch, problem.heads, problem.kv_lora), dtype=torch.float32, device=problem.device)
    return out
