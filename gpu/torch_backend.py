"""Pure-torch decode attention (dequantize + matmul): the fallback without cupy/CUDA, and Metal.

Rows are dequantized chunk by chunk (``lut[code] * scale`` for fp8, ``level[code] * radius /
sqrt(n)`` in the rotated domain for int4) and attended with an online softmax, so memory stays
bounded at any context length. f32 throughout; the same code runs on ``cpu``, ``cuda`` and
``mps`` (no float64, no custom kernels).

The Metal backend (:class:`MpsBackend`) is this implementation on torch's ``mps`` device, chosen
automatically on Apple hardware. It cannot be exercised on the Linux machines this project is
tested on: the tests cover everything up to the device call (the same code on the CPU, and the
backend's reasons when ``mps`` is absent).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np
import torch

from kvstore.formats import fp8, tq
from kvstore.gpu import inputs
from kvstore.gpu.registry import AttentionBackend, spec_of
from kvstore.gpu.rotation import rotate, unrotate

__all__ = ["MpsBackend", "TorchBackend", "decode_torch"]

# Rows dequantized per step: bounds the f32 rows and the [H, rows] scores held at once.
CHUNK_ROWS = 16384


@functools.lru_cache(maxsize=8)
def _table(which: str, device_key: str) -> torch.Tensor:
    values = fp8.LUT if which == "fp8" else tq.LEVELS
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(torch.device(device_key))


def _dequant_fp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = _table("fp8", str(codes.device))
    return lut[codes.to(torch.int64)] * scales[:, None]


def _dequant_int4(codes: torch.Tensor, radii: torch.Tensor, width: int) -> torch.Tensor:
    """Rows in the rotated domain: ``level[c] * radius / sqrt(width)``; element 2k is byte k's low nibble."""
    levels = _table("int4", str(codes.device))
    wide = codes.to(torch.int32)
    nibbles = torch.stack((wide & 15, wide >> 4), dim=-1).reshape(codes.shape[0], width)
    std = radii / math.sqrt(width)
    return levels[nibbles.to(torch.int64)] * std[:, None]


def _attend(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    n_rows: int,
    rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    softmax_scale: float,
) -> torch.Tensor:
    """Online-softmax attention of one query (f32[H, K], f32[H, R]) over rows fetched in chunks."""
    heads, kv_lora = q_lat.shape
    running_max = torch.full((heads, 1), float("-inf"), dtype=torch.float32, device=q_lat.device)
    denom = torch.zeros((heads, 1), dtype=torch.float32, device=q_lat.device)
    ctx = torch.zeros((heads, kv_lora), dtype=torch.float32, device=q_lat.device)
    for begin in range(0, n_rows, CHUNK_ROWS):
        lat, rope = rows(begin, min(n_rows, begin + CHUNK_ROWS))
        scores = (q_lat @ lat.T + q_rope @ rope.T) * softmax_scale
        new_max = torch.maximum(running_max, scores.amax(dim=1, keepdim=True))
        weights = torch.exp(scores - new_max)
        rescale = torch.exp(running_max - new_max)
        denom = denom * rescale + weights.sum(dim=1, keepdim=True)
        ctx = ctx * rescale + weights @ lat
        running_max = new_max
    return torch.where(denom > 0, ctx / denom.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(ctx))


def decode_torch(
    tier: str,
    q_lat,
    q_rope,
    lc_codes,
    lc_scales,
    rc_codes,
    rc_scales,
    seq_start,
    seq_len,
    softmax_scale: float,
    out=None,
    indices=None,
    n_selected=None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Decode attention with torch ops for either tier, dense or over selected rows.

    Parameters
    ----------
    tier : ``"fp8"`` or ``"tq-int4"``
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    lc_codes, lc_scales, rc_codes, rc_scales : the cache rows (see :func:`kvstore.gpu.mla_decode_fp8`)
    seq_start, seq_len : i32[B]
    softmax_scale : float
    out : f32[B, H, K], optional
    indices : i32[B, S], n_selected : i32[B], optional (selected-rows variant)
    validate : check sequence and index ranges (reads them on the host)

    Returns
    -------
    f32[B, H, K]
    """
    problem = inputs.check_inputs(tier, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len,
                                  softmax_scale, out, indices, n_selected)
    if validate:
        inputs.check_ranges(problem, seq_start, seq_len, indices, n_selected)
    result = inputs.prepare_out(out, problem)
    starts = seq_start.cpu().tolist()
    lengths = seq_len.cpu().tolist()
    counts = n_selected.cpu().tolist() if indices is not None else None
    k, r = problem.kv_lora, problem.qk_rope
    rotated = tier == "tq-int4"
    q_l = rotate(q_lat) if rotated else q_lat
    q_r = rotate(q_rope) if rotated else q_rope

    def dequant(rows_index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        if rotated:
            return (_dequant_int4(lc_codes[rows_index], lc_scales[rows_index], k),
                    _dequant_int4(rc_codes[rows_index], rc_scales[rows_index], r))
        return (_dequant_fp8(lc_codes[rows_index], lc_scales[rows_index]),
                _dequant_fp8(rc_codes[rows_index], rc_scales[rows_index]))

    for b in range(problem.batch):  # one sequence at a time; rows within it are vectorized
        start, length = int(starts[b]), max(int(lengths[b]), 0)
        if indices is None:
            n_rows = length

            def rows(lo: int, hi: int, start=start) -> tuple[torch.Tensor, torch.Tensor]:
                return dequant(slice(start + lo, start + hi))
        else:
            n_rows = min(max(int(counts[b]), 0), problem.selected)
            picked = indices[b, :n_rows].to(device=problem.device, dtype=torch.int64) + start

            def rows(lo: int, hi: int, picked=picked) -> tuple[torch.Tensor, torch.Tensor]:
                return dequant(picked[lo:hi])

        ctx = _attend(q_l[b], q_r[b], n_rows, rows, float(softmax_scale))
        result[b] = unrotate(ctx) if rotated else ctx
    return result


class TorchBackend(AttentionBackend):
    """Dequantize + matmul with torch ops on the CPU (or on CUDA when the CUDA kernels cannot run)."""

    spec = spec_of("torch")

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        if device.type == "cuda" and not torch.cuda.is_available():
            return ["torch.cuda.is_available() is False"]
        return []

    def mla_decode_fp8(self, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len,
                       softmax_scale, out=None, *, validate=True):
        return decode_torch("fp8", q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len,
                            softmax_scale, out, validate=validate)

    def mla_decode_int4(self, q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len,
                        softmax_scale, out=None, *, validate=True):
        return decode_torch("tq-int4", q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len,
                            softmax_scale, out, validate=validate)

    def mla_decode_fp8_selected(self, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start,
                                seq_len, indices, n_selected, softmax_scale, out=None, *, validate=True):
        return decode_torch("fp8", q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len,
                            softmax_scale, out, indices, n_selected, validate=validate)

    def mla_decode_int4_selected(self, q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start,
                                 seq_len, indices, n_selected, softmax_scale, out=None, *, validate=True):
        return decode_torch("tq-int4", q_lat, q_rope, lc_codes, lc_radii, rc_codes, rc_radii, seq_start, seq_len,
                            softmax_scale, out, indices, n_selected, validate=validate)


class MpsBackend(TorchBackend):
    """The torch implementation on Apple's Metal through torch's ``mps`` device (untested here)."""

    spec = spec_of("mps")

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_built():
            return ["this torch build has no MPS (Metal) support"]
        if not mps.is_available():
            return ["torch.backends.mps.is_available() is False (no Apple GPU, or macOS older than 12.3)"]
        return []
