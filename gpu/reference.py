"""Float64 reference of the decode-attention kernels, written from FORMAT.md rather than the kernels.

Rows are decoded to the values the file format defines (fp8: the e4m3 formula with the NaN codes
read as 0, times the row scale; int4: the Lloyd-Max level times ``radius / sqrt(n)``, un-rotated
back to the stored row), then attended with an exact two-pass softmax in float64. Used by the tests
and the benchmark to check every implementation.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvstore.gpu.rotation import sign_vector

__all__ = ["e4m3_table_f64", "int4_levels_f64", "reference_decode"]

# Decoded f64 elements kept between the score pass and the context pass (1 GiB).
_KEEP_ELEMENTS = 1 << 27

#: The 16 Lloyd-Max levels of FORMAT.md section 6, as the spec's f32 literals.
_LEVELS = np.array([-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
                    0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733], dtype=np.float32)


def e4m3_table_f64() -> np.ndarray:
    """f64[256]: e4m3 "fn" decode per FORMAT.md section 3; 0x7F and 0xFF (NaN) read as 0."""
    code = np.arange(256)
    exponent, mantissa = (code >> 3) & 15, (code & 7).astype(np.float64)
    value = np.where(exponent > 0, (1 + mantissa / 8) * np.exp2(exponent - 7.0), mantissa * 2.0**-9)
    table = np.where(code & 0x80, -value, value)
    table[0x7F] = table[0xFF] = 0.0
    return table


def int4_levels_f64() -> np.ndarray:
    """f64[16]: the Lloyd-Max levels (f32 literals widened)."""
    return _LEVELS.astype(np.float64)


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """f64[n, n]: the Sylvester Hadamard matrix over sqrt(n), which the spec's butterflies apply."""
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return (h / math.sqrt(n)).to(device)


def _decode_rows(tier: str, codes: torch.Tensor, scales: torch.Tensor, width: int) -> torch.Tensor:
    """f64[n, width]: the stored rows the codes stand for."""
    if tier == "fp8":
        table = torch.from_numpy(e4m3_table_f64()).to(codes.device)
        return table[codes.to(torch.int64)] * scales.to(torch.float64)[:, None]
    table = torch.from_numpy(int4_levels_f64()).to(codes.device)
    wide = codes.to(torch.int64)
    nibbles = torch.stack((wide & 15, wide >> 4), dim=-1).reshape(codes.shape[0], width)
    rotated = table[nibbles] * (scales.to(torch.float64) / math.sqrt(width))[:, None]
    # unrotate(y) = FWHT(y) * sign, with the transform written as a matrix product
    return (rotated @ _hadamard(width, codes.device)) * sign_vector(width, torch.float64, codes.device)


def reference_decode(
    tier: str,
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    lc_codes: torch.Tensor,
    lc_scales: torch.Tensor,
    rc_codes: torch.Tensor,
    rc_scales: torch.Tensor,
    seq_start: torch.Tensor,
    seq_len: torch.Tensor,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    n_selected: torch.Tensor | None = None,
    chunk_rows: int = 1 << 16,
) -> torch.Tensor:
    """Exact decode attention in float64.

    Parameters
    ----------
    tier : ``"fp8"`` or ``"tq-int4"``
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    lc_codes, lc_scales, rc_codes, rc_scales : cache rows, as for :func:`kvstore.gpu.mla_decode_fp8`
    seq_start, seq_len : i32[B]
    softmax_scale : float
    indices : i32[B, S], n_selected : i32[B], optional (selected-rows variant)
    chunk_rows : rows decoded at a time

    Returns
    -------
    f64[B, H, K] on the device of ``q_lat`` (zeros for a sequence with no rows)
    """
    batch, heads, kv_lora = q_lat.shape
    qk_rope = q_rope.shape[2]
    device = q_lat.device
    out = torch.zeros((batch, heads, kv_lora), dtype=torch.float64, device=device)
    starts = seq_start.cpu().tolist()
    lengths = seq_len.cpu().tolist()
    counts = n_selected.cpu().tolist() if indices is not None else None
    for b in range(batch):
        if indices is None:
            rows = torch.arange(starts[b], starts[b] + lengths[b], device=device, dtype=torch.int64)
        else:
            rows = indices[b, : counts[b]].to(device=device, dtype=torch.int64) + starts[b]
        if rows.numel() == 0:
            continue
        ql = q_lat[b].to(torch.float64)
        qr = q_rope[b].to(torch.float64)
        chunks = [rows[i : i + chunk_rows] for i in range(0, rows.numel(), chunk_rows)]
        # Keep the decoded latent rows for the second pass when they fit in the budget.
        keep = rows.numel() * kv_lora <= _KEEP_ELEMENTS
        latent = []
        score_parts = []
        for c in chunks:
            lat = _decode_rows(tier, lc_codes[c], lc_scales[c], kv_lora)
            score_parts.append(ql @ lat.T + qr @ _decode_rows(tier, rc_codes[c], rc_scales[c], qk_rope).T)
            if keep:
                latent.append(lat)
        scores = torch.cat(score_parts, dim=1) * softmax_scale
        weights = torch.exp(scores - scores.amax(dim=1, keepdim=True))
        weights /= weights.sum(dim=1, keepdim=True)
        column = 0
        for i, c in enumerate(chunks):
            lat = latent[i] if keep else _decode_rows(tier, lc_codes[c], lc_scales[c], kv_lora)
            out[b] += weights[:, column : column + c.numel()] @ lat
            column += c.numel()
    return out
