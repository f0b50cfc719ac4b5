"""Random decode-attention problems for the tests and the benchmark: fresh data, never zeros.

fp8 rows are Gaussian rows of random per-row magnitude quantized the way the v2 format does
(``amax / 448`` scale, e4m3 round-to-nearest-even), with a few NaN codes (0x7F/0xFF) planted so
every check also covers the rule that they read as 0 (``nan_rate``; the format's encoder never
writes them, so the benchmark times NaN-free rows as well as planted ones). int4 rows are random codes with random
radii (a few rows inert, radius 0). Sequences of a ragged batch sit at random offsets of one row
array, with unused rows between them, so ``seq_start`` is exercised too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["DecodeCase", "decode", "make_case", "poisoned_out", "ragged_lengths", "relative_error", "reference"]

# Rows generated per step (bounds the f32 temporaries on large caches).
_GEN_ROWS = 1 << 19


@dataclass
class DecodeCase:
    """One decode-attention problem: inputs in the order the kernels take them."""

    tier: str
    q_lat: torch.Tensor
    q_rope: torch.Tensor
    lc_codes: torch.Tensor
    lc_scales: torch.Tensor
    rc_codes: torch.Tensor
    rc_scales: torch.Tensor
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    softmax_scale: float
    indices: torch.Tensor | None = None
    n_selected: torch.Tensor | None = None

    @property
    def selected(self) -> bool:
        return self.indices is not None

    def args(self) -> tuple:
        """Positional arguments of the matching ``mla_decode_*`` function (``out`` excluded)."""
        head = (self.q_lat, self.q_rope, self.lc_codes, self.lc_scales, self.rc_codes, self.rc_scales,
                self.seq_start, self.seq_len)
        if self.selected:
            return head + (self.indices, self.n_selected, self.softmax_scale)
        return head + (self.softmax_scale,)

    def rows_attended(self) -> int:
        """Cache rows the call reads (each selected entry counts once)."""
        if self.selected:
            return int(self.n_selected.to(torch.int64).sum())
        return int(self.seq_len.to(torch.int64).sum())

    def row_bytes(self) -> int:
        """Bytes of one cache row: latent + rope codes and their two f32 scales."""
        return self.lc_codes.shape[1] + self.rc_codes.shape[1] + 8


def _fp8_rows(n: int, width: int, gen: torch.Generator, device: torch.device,
              nan_rate: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty((n, width), dtype=torch.uint8, device=device)
    scales = torch.empty(n, dtype=torch.float32, device=device)
    for lo in range(0, n, _GEN_ROWS):
        hi = min(n, lo + _GEN_ROWS)
        rows = torch.randn((hi - lo, width), generator=gen, device=device)
        rows *= torch.exp2(torch.rand((hi - lo, 1), generator=gen, device=device) * 6 - 3)  # magnitudes 1/8..8
        amax = rows.abs().amax(dim=1)
        codes[lo:hi] = (rows * (448.0 / amax)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        scales[lo:hi] = amax / 448.0
    nan_at = torch.rand((n, width), generator=gen, device=device) < nan_rate
    nan_code = torch.where(torch.rand((n, width), generator=gen, device=device) < 0.5, 0x7F, 0xFF).to(torch.uint8)
    codes[nan_at] = nan_code[nan_at]
    return codes, scales


def _int4_rows(n: int, width: int, gen: torch.Generator, device: torch.device,
               nan_rate: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (n, width // 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    radii = math.sqrt(width) * (0.5 + 1.5 * torch.rand(n, generator=gen, device=device))
    radii[torch.rand(n, generator=gen, device=device) < 1e-3] = 0.0  # inert rows
    return codes, radii.to(torch.float32)


def make_case(
    tier: str,
    lengths: list[int],
    heads: int,
    *,
    kv_lora: int = 512,
    qk_rope: int = 64,
    device: torch.device | str = "cpu",
    seed: int = 0,
    selected: int | None = None,
    nan_rate: float = 1e-3,
) -> DecodeCase:
    """Build a random problem.

    Parameters
    ----------
    tier : ``"fp8"`` or ``"tq-int4"``
    lengths : rows of each sequence (one query token per sequence)
    heads : query heads H
    kv_lora, qk_rope : row widths K, R
    device : where every tensor lives
    seed : generator seed (callers pass a fresh one per check)
    selected : S, the index columns of the selected-rows variant; ``None`` for dense attention.
        Each sequence selects ``min(S, length)`` distinct rows, the last sequence fewer (ragged).
    nan_rate : fraction of fp8 codes replaced by a NaN code (0x7F / 0xFF), which must read as 0

    Returns
    -------
    DecodeCase
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    batch = len(lengths)
    gaps = torch.randint(0, 97, (batch,), generator=gen, device=device).cpu().tolist()
    starts, cursor = [], 0
    for length, gap in zip(lengths, gaps):
        cursor += gap
        starts.append(cursor)
        cursor += length
    n_rows = cursor + 13  # unused rows after the last sequence too
    make_rows = _fp8_rows if tier == "fp8" else _int4_rows
    lc_codes, lc_scales = make_rows(n_rows, kv_lora, gen, device, nan_rate)
    rc_codes, rc_scales = make_rows(n_rows, qk_rope, gen, device, nan_rate)
    q_lat = torch.randn((batch, heads, kv_lora), generator=gen, device=device)
    q_rope = torch.randn((batch, heads, qk_rope), generator=gen, device=device)
    case = DecodeCase(
        tier, q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(lengths, dtype=torch.int32, device=device),
        # scores of standard deviation ~2: a softmax that is neither flat nor one-hot
        softmax_scale=2.0 / math.sqrt(kv_lora + qk_rope),
    )
    if selected is not None:
        indices = torch.full((batch, selected), -1, dtype=torch.int32, device=device)
        counts = []
        for b, length in enumerate(lengths):  # one randperm per sequence
            count = min(selected, length) if b < batch - 1 or batch == 1 else min(selected, length) // 2
            picked = torch.randperm(length, generator=gen, device=device)[:count]
            indices[b, :count] = picked.to(torch.int32)
            counts.append(count)
        case.indices = indices
        case.n_selected = torch.tensor(counts, dtype=torch.int32, device=device)
    return case


def ragged_lengths(longest: int, batch: int, seed: int) -> list[int]:
    """``batch`` sequence lengths: the first ``longest``, one empty, one of a single row, the rest random."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [longest] + torch.randint(0, longest + 1, (batch - 1,), generator=gen).tolist()
    if batch >= 3:
        lengths[1], lengths[2] = 0, min(1, longest)
    return lengths[:batch]


def decode(case: DecodeCase, out: torch.Tensor | None = None, backend=None, **kwargs) -> torch.Tensor:
    """Run the kernel matching the case (tier, dense or selected) on ``backend`` (default: the device's)."""
    from kvstore import gpu

    name = {"fp8": "mla_decode_fp8", "tq-int4": "mla_decode_int4"}[case.tier] + ("_selected" if case.selected else "")
    function = getattr(backend, name) if backend is not None else getattr(gpu, name)
    return function(*case.args(), out, **kwargs)


def reference(case: DecodeCase) -> torch.Tensor:
    """The float64 reference output of the case."""
    from kvstore.gpu.reference import reference_decode

    return reference_decode(case.tier, *case.args()[:8], case.softmax_scale, case.indices, case.n_selected)


def poisoned_out(case: DecodeCase) -> torch.Tensor:
    """An output buffer filled with NaN, so any element a kernel fails to write shows up."""
    batch, heads, kv_lora = case.q_lat.shape
    return torch.full((batch, heads, kv_lora), float("nan"), dtype=torch.float32, device=case.q_lat.device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64); ``inf`` if ``out`` holds a non-finite value."""
    out64 = out.to(torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    return float(torch.linalg.vector_norm(out64 - ref) / torch.linalg.vector_norm(ref))
