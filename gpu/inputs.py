"""Input checks shared by every backend: shapes, dtypes, devices, then (optionally) value ranges.

The shape checks read only metadata. :func:`check_ranges` reads the sequence bounds and the
selection indices, which costs one device-to-host synchronization when they live on a GPU; the
public functions run it unless called with ``validate=False`` (the CUDA kernels never read outside
the row arrays either way: rows outside them are skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.gpu.errors import AttentionInputError

__all__ = ["DecodeProblem", "check_inputs", "check_ranges", "prepare_out"]


@dataclass(frozen=True)
class DecodeProblem:
    """The geometry of one decode-attention call, read from its inputs."""

    tier: str
    batch: int
    heads: int
    kv_lora: int
    qk_rope: int
    n_rows: int
    selected: int | None  # index columns S of the selected-rows variant, else None
    device: torch.device


def _is_pow2(n: int) -> bool:
    return 2 <= n <= 2048 and n & (n - 1) == 0


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise AttentionInputError(reason)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"


def _tensor(name: str, t, dtype: torch.dtype, ndim: int) -> None:
    _need(isinstance(t, torch.Tensor), f"{name} must be a torch tensor, got {_describe(t)}")
    _need(t.dtype == dtype, f"{name} must be {str(dtype).replace('torch.', '')}, got {_describe(t)}")
    _need(t.dim() == ndim, f"{name} must have {ndim} dimensions, got {_describe(t)}")


def check_inputs(
    tier: str,
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
    tier : ``"fp8"`` or ``"tq-int4"``
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    lc_codes : u8[N, K] (fp8) or u8[N, K/2] (int4);  lc_scales : f32[N] (scales or radii)
    rc_codes : u8[N, R] (fp8) or u8[N, R/2] (int4);  rc_scales : f32[N]
    seq_start, seq_len : i32[B] (on the query's device or on the CPU)
    softmax_scale : finite float
    out : f32[B, H, K] on the query's device, optional
    indices : i32[B, S], n_selected : i32[B] (selected-rows variant only)

    Raises
    ------
    AttentionInputError
        With the first problem found.
    """
    _need(tier in ("fp8", "tq-int4"), f"tier must be 'fp8' or 'tq-int4', got {tier!r}")
    _tensor("q_lat", q_lat, torch.float32, 3)
    _tensor("q_rope", q_rope, torch.float32, 3)
    batch, heads, kv_lora = q_lat.shape
    qk_rope = q_rope.shape[2]
    _need(q_rope.shape[:2] == q_lat.shape[:2], f"q_rope {_describe(q_rope)} does not match q_lat {_describe(q_lat)}")
    _need(batch >= 1 and heads >= 1 and kv_lora >= 1 and qk_rope >= 1, f"empty query {_describe(q_lat)}")
    device = q_lat.device
    for name, t in (("lc_codes", lc_codes), ("rc_codes", rc_codes)):
        _tensor(name, t, torch.uint8, 2)
    for name, t in (("lc_scales", lc_scales), ("rc_scales", rc_scales)):
        _tensor(name, t, torch.float32, 1)
    n_rows = lc_codes.shape[0]
    if tier == "fp8":
        widths = (kv_lora, qk_rope)
    else:
        _need(_is_pow2(kv_lora), f"rotated int4 needs a power-of-two kv_lora in 2..2048, got {kv_lora}")
        _need(_is_pow2(qk_rope), f"rotated int4 needs a power-of-two qk_rope in 2..2048, got {qk_rope}")
        widths = (kv_lora // 2, qk_rope // 2)
    _need(lc_codes.shape[1] == widths[0], f"lc_codes must be u8[N, {widths[0]}] for {tier}, got {_describe(lc_codes)}")
    _need(rc_codes.shape[1] == widths[1], f"rc_codes must be u8[N, {widths[1]}] for {tier}, got {_describe(rc_codes)}")
    for name, t in (("rc_codes", rc_codes), ("lc_scales", lc_scales), ("rc_scales", rc_scales)):
        _need(t.shape[0] == n_rows, f"{name} has {t.shape[0]} rows, lc_codes {n_rows}")
    for name, t in (("q_rope", q_rope), ("lc_codes", lc_codes), ("lc_scales", lc_scales),
                    ("rc_codes", rc_codes), ("rc_scales", rc_scales)):
        _need(t.device == device, f"{name} is on {t.device}, q_lat on {device}")
    for name, t in (("seq_start", seq_start), ("seq_len", seq_len)):
        _tensor(name, t, torch.int32, 1)
        _need(t.shape[0] == batch, f"{name} must be i32[{batch}], got {_describe(t)}")
        _need(t.device == device or t.device.type == "cpu", f"{name} must be on {device} or the CPU, got {t.device}")
    selected = None
    if indices is not None or n_selected is not None:
        _tensor("indices", indices, torch.int32, 2)
        _tensor("n_selected", n_selected, torch.int32, 1)
        _need(indices.shape[0] == batch, f"indices must be i32[{batch}, S], got {_describe(indices)}")
        _need(n_selected.shape[0] == batch, f"n_selected must be i32[{batch}], got {_describe(n_selected)}")
        for name, t in (("indices", indices), ("n_selected", n_selected)):
            _need(t.device == device or t.device.type == "cpu", f"{name} must be on {device} or the CPU, got {t.device}")
        selected = int(indices.shape[1])
    _need(isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale),
          f"softmax_scale must be a finite float, got {softmax_scale!r}")
    if out is not None:
        _need(isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == (batch, heads, kv_lora)
              and out.device == device and out.is_contiguous(),
              f"out must be a contiguous f32[{batch}, {heads}, {kv_lora}] on {device}, got {_describe(out)}")
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
    problems = torch.stack([
        (length < 0).any(),
        (start < 0).any(),
        (start + length > problem.n_rows).any(),
    ])
    if indices is not None:
        n_sel = n_selected.to(device=indices.device, dtype=torch.int64)
        columns = torch.arange(indices.shape[1], device=indices.device)
        used = columns[None, :] < n_sel[:, None]
        limit = length.to(indices.device)[:, None]
        bad_index = used & ((indices < 0) | (indices.to(torch.int64) >= limit))
        problems = torch.cat([
            problems.to(indices.device),
            torch.stack([((n_sel < 0) | (n_sel > indices.shape[1])).any(), bad_index.any()]),
        ])
    flags = problems.cpu().tolist()
    _need(not flags[0], "seq_len holds a negative length")
    _need(not flags[1], "seq_start holds a negative row")
    _need(not flags[2], f"a sequence runs past the {problem.n_rows} cache rows (seq_start + seq_len > N)")
    if indices is not None:
        _need(not flags[3], f"n_selected must lie in 0..{indices.shape[1]}")
        _need(not flags[4], "indices hold a row outside its sequence (each must be in 0..seq_len-1)")


def prepare_out(out: torch.Tensor | None, problem: DecodeProblem) -> torch.Tensor:
    """``out`` itself, or a new f32[B, H, K] on the query's device."""
    if out is None:
        return torch.empty((problem.batch, problem.heads, problem.kv_lora), dtype=torch.float32, device=problem.device)
    return out
