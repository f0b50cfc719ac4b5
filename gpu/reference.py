"""Float64 reference of the decode-attention backends: rows decoded as the format defines them,
then an exact two-pass softmax in float64.

Rows are decoded to the values docs/FORMAT.md gives them: f32/bf16 rows widened; fp8 the e4m3 value
(``kvstore.formats.fp8.LUT``, exact in f32; the NaN codes read as 0) times the row scale; int4 the
Lloyd-Max level times ``radius / sqrt(n)``, un-rotated in float64 by the Hadamard matrix and the
signs of ``kvstore.formats.tq``; PolarQuant through the reference codec of ``kvstore.formats.tq``
(in f32, widened); Q8_0 the code times its f16 delta. Used by the tests and the benchmark to check
every backend, whatever order its sums take.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from kvstore import tiers
from kvstore.formats import fp8, q8, tq
from kvstore.formats.codecs import RowCodec
from kvstore.formats.errors import FormatError
from kvstore.formats.floats import BF16Codec, F32Codec
from kvstore.formats.fp8 import FP8Codec
from kvstore.formats.q8 import Q8Codec
from kvstore.formats.tq import Int4Codec
from kvstore.gpu.codecs import int4_levels, sign_vector
from kvstore.gpu.errors import AttentionInputError
from kvstore.gpu.inputs import as_tier

__all__ = ["e4m3_table_f64", "int4_levels_f64", "reference_decode"]

# Decoded f64 elements kept between the score pass and the context pass (1 GiB).
_KEEP_ELEMENTS = 1 << 27


def e4m3_table_f64() -> np.ndarray:
    """f64[256]: the e4m3 "fn" decode of docs/FORMAT.md section 3 (every value exact in f32); NaN codes read 0."""
    return fp8.LUT.astype(np.float64)


def int4_levels_f64() -> np.ndarray:
    """f64[16]: the Lloyd-Max levels (``tq.LEVELS``, the spec's f32 literals) widened."""
    return tq.LEVELS.astype(np.float64)


def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    """f64[n, n]: the Sylvester Hadamard matrix over sqrt(n), which the spec's butterflies apply."""
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return (h / math.sqrt(n)).to(device)


def _float_rows(codec: RowCodec, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    return codes.to(torch.float64)


def _fp8_rows(codec: RowCodec, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    table = torch.from_numpy(e4m3_table_f64()).to(codes.device)
    return table[codes.to(torch.int64)] * _scales(codec, scales).to(torch.float64)[:, None]


def _q8_rows(codec: RowCodec, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    blocks = codes.to(torch.float64).reshape(codes.shape[0], -1, q8.BLOCK)
    return (blocks * _scales(codec, scales).to(torch.float64)[:, :, None]).reshape(codes.shape[0], width)


def _int4_rows(codec: RowCodec, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    wide = codes.to(torch.int64)
    nibbles = torch.stack((wide & 15, wide >> 4), dim=-1).reshape(codes.shape[0], width)
    std = _scales(codec, scales).to(torch.float64) / math.sqrt(width)
    rotated = int4_levels(codes.device, torch.float64)[nibbles] * std[:, None]
    # unrotate(y) = FWHT(y) * sign, with the transform written as a matrix product
    return (rotated @ _hadamard(width, codes.device)) * sign_vector(width, torch.float64, codes.device)


def _host_codec_rows(codec: RowCodec, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    """The reference codec of ``kvstore.formats`` (in f32, widened): for families with no exact f64 form."""
    rows = codec.dequantize(codes.cpu().numpy(), None if scales is None else scales.cpu().numpy(), width)
    return torch.from_numpy(rows).to(device=codes.device, dtype=torch.float64)


def _scales(codec: RowCodec, scales: torch.Tensor | None) -> torch.Tensor:
    if scales is None:
        raise FormatError(f"{codec.name} rows need their scales to decode")
    return scales


RowDecoder = Callable[[RowCodec, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]
#: The exact float64 decoder of each codec family; PolarQuant (whose decode goes through cosf/sinf)
#: is decoded by its reference codec, :func:`_host_codec_rows`.
_DECODERS: dict[type[RowCodec], RowDecoder] = {
    F32Codec: _float_rows,
    BF16Codec: _float_rows,
    FP8Codec: _fp8_rows,
    Q8Codec: _q8_rows,
    Int4Codec: _int4_rows,
}


def _decode_rows(tier: tiers.Tier, codes: torch.Tensor, scales: torch.Tensor | None, width: int) -> torch.Tensor:
    """f64[n, width]: the stored rows the codes stand for."""
    codec = tier.row_codec
    return _DECODERS.get(type(codec), _host_codec_rows)(codec, codes, scales, width)


def reference_decode(
    tier: tiers.Tier | str,
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    lc_codes: torch.Tensor,
    lc_scales: torch.Tensor | None,
    rc_codes: torch.Tensor,
    rc_scales: torch.Tensor | None,
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
    tier : a ``kvstore.tiers.Tier`` or its name
    q_lat : f32[B, H, K];  q_rope : f32[B, H, R]
    lc_codes, lc_scales, rc_codes, rc_scales : cache rows in the tier's layout
        (:func:`kvstore.gpu.inputs.row_layout`; scales None for f32/bf16)
    seq_start, seq_len : i32[B]
    softmax_scale : float
    indices : i32[B, S], n_selected : i32[B], optional (selected-rows variant)
    chunk_rows : rows decoded at a time

    Returns
    -------
    f64[B, H, K] on the device of ``q_lat`` (zeros for a sequence with no rows)
    """
    tier = as_tier(tier)
    batch, heads, kv_lora = q_lat.shape
    qk_rope = q_rope.shape[2]
    device = q_lat.device
    out = torch.zeros((batch, heads, kv_lora), dtype=torch.float64, device=device)
    starts = seq_start.cpu().tolist()
    lengths = seq_len.cpu().tolist()
    counts: list[int] = []
    if indices is not None:
        if n_selected is None:
            raise AttentionInputError("indices need n_selected (the selected-rows variant takes both)")
        counts = n_selected.cpu().tolist()

    def decode(codes, scales, rows, width):
        return _decode_rows(tier, codes[rows], None if scales is None else scales[rows], width)

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
            lat = decode(lc_codes, lc_scales, c, kv_lora)
            score_parts.append(ql @ lat.T + qr @ decode(rc_codes, rc_scales, c, qk_rope).T)
            if keep:
                latent.append(lat)
        scores = torch.cat(score_parts, dim=1) * softmax_scale
        weights = torch.exp(scores - scores.amax(dim=1, keepdim=True))
        weights /= weights.sum(dim=1, keepdim=True)
        column = 0
        for i, c in enumerate(chunks):
            lat = latent[i] if keep else decode(lc_codes, lc_scales, c, kv_lora)
            out[b] += weights[:, column : column + c.numel()] @ lat
            column += c.numel()
    return out
