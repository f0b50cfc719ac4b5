"""Random decode-attention problems for the tests and the benchmark: fresh data, never zeros.

Rows of every tier: f32/bf16 Gaussian rows of random per-row magnitude; fp8 the same rows quantized
the way the v2 format does (``amax / 448`` scale, e4m3 round-to-nearest-even), with a few NaN codes
(0x7F/0xFF) planted so every check also covers the rule that they read as 0 (``nan_rate``; the
format's encoder never writes them, so the benchmark times NaN-free rows as well as planted ones);
int4 and PolarQuant random codes with random radii (a few rows inert, radius 0); Q8_0 random codes
with random deltas (a few blocks inert, delta 0). Sequences of a ragged batch sit at random offsets
of one row array, with unused rows between them, so ``seq_start`` is exercised too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvstore import tiers
from kvstore.formats.codecs import RowCodec
from kvstore.formats.floats import BF16Codec, F32Codec
from kvstore.formats.fp8 import FP8Codec
from kvstore.formats.q8 import Q8Codec
from kvstore.formats.tq import TQCodec
from kvstore.gpu.codecs import FP8_MAX, torch_twin
from kvstore.gpu.errors import AttentionInputError
from kvstore.gpu.inputs import LatentBatch, as_tier

__all__ = ["DecodeCase", "decode", "make_case", "poisoned_out", "ragged_lengths", "relative_error", "reference"]

# Rows generated per step (bounds the f32 temporaries on large caches).
_GEN_ROWS = 1 << 19


@dataclass
class DecodeCase:
    """One decode-attention problem: the queries, the cache rows of its tier and the sequences."""

    tier: tiers.Tier
    q_lat: torch.Tensor
    q_rope: torch.Tensor
    lc_codes: torch.Tensor
    lc_scales: torch.Tensor | None  # None for f32/bf16 rows
    rc_codes: torch.Tensor
    rc_scales: torch.Tensor | None
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    softmax_scale: float
    indices: torch.Tensor | None = None
    n_selected: torch.Tensor | None = None

    @property
    def selected(self) -> bool:
        return self.indices is not None

    def rows(self) -> tuple:
        """The row operands as the tier's decode function takes them (no scales for f32/bf16)."""
        if self.lc_scales is None:
            return self.lc_codes, self.rc_codes
        return self.lc_codes, self.lc_scales, self.rc_codes, self.rc_scales

    def batch(self, *, trusted: bool = False, ranges: bool = True) -> LatentBatch:
        """The case's rows and sequences as one :class:`~kvstore.gpu.inputs.LatentBatch`: checked
        (shapes, dtypes and devices, then, with ``ranges``, the bounds read on the host) or
        ``trusted`` (nothing checked, as the engine's caches make theirs). The widths are the queries'."""
        make = LatentBatch.trusted if trusted else LatentBatch
        batch = make(
            self.tier,
            self.lc_codes,
            self.lc_scales,
            self.rc_codes,
            self.rc_scales,
            self.seq_start,
            self.seq_len,
            kv_lora=self.q_lat.shape[2],
            qk_rope=self.q_rope.shape[2],
            indices=self.indices,
            n_selected=self.n_selected,
        )
        return batch.check_ranges() if ranges and not trusted else batch

    def rows_attended(self) -> int:
        """Cache rows the call reads (each selected entry counts once)."""
        if self.selected and self.n_selected is not None:
            return int(self.n_selected.to(torch.int64).sum())
        return int(self.seq_len.to(torch.int64).sum())

    def row_bytes(self) -> int:
        """Bytes of one cache row: latent + rope codes and their scales (``Tier.row_bytes``)."""
        return self.tier.row_bytes(self.q_lat.shape[2]) + self.tier.row_bytes(self.q_rope.shape[2])


def _gaussian_rows(n: int, width: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    rows = torch.randn((n, width), generator=gen, device=device)
    return rows * torch.exp2(torch.rand((n, 1), generator=gen, device=device) * 6 - 3)  # magnitudes 1/8..8


def _float_rows(
    tier: tiers.Tier, n: int, width: int, gen: torch.Generator, device: torch.device, nan_rate: float = 0.0
) -> tuple[torch.Tensor, None]:
    dtype = torch_twin(tier).codes_dtype
    rows = torch.empty((n, width), dtype=dtype, device=device)
    for lo in range(0, n, _GEN_ROWS):
        hi = min(n, lo + _GEN_ROWS)
        rows[lo:hi] = _gaussian_rows(hi - lo, width, gen, device).to(dtype)
    return rows, None


def _fp8_rows(
    tier: tiers.Tier, n: int, width: int, gen: torch.Generator, device: torch.device, nan_rate: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty((n, width), dtype=torch.uint8, device=device)
    scales = torch.empty(n, dtype=torch.float32, device=device)
    for lo in range(0, n, _GEN_ROWS):
        hi = min(n, lo + _GEN_ROWS)
        rows = _gaussian_rows(hi - lo, width, gen, device)
        amax = rows.abs().amax(dim=1)
        codes[lo:hi] = (rows * (FP8_MAX / amax)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        scales[lo:hi] = amax / FP8_MAX
    nan_at = torch.rand((n, width), generator=gen, device=device) < nan_rate
    nan_code = torch.where(torch.rand((n, width), generator=gen, device=device) < 0.5, 0x7F, 0xFF).to(torch.uint8)
    codes[nan_at] = nan_code[nan_at]
    return codes, scales


def _tq_rows(
    tier: tiers.Tier, n: int, width: int, gen: torch.Generator, device: torch.device, nan_rate: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (n, tier.payload_bytes(width)), generator=gen, device=device, dtype=torch.int32).to(
        torch.uint8
    )
    radii = math.sqrt(width) * (0.5 + 1.5 * torch.rand(n, generator=gen, device=device))
    radii[torch.rand(n, generator=gen, device=device) < 1e-3] = 0.0  # inert rows
    return codes, radii.to(torch.float32)


def _q8_rows(
    tier: tiers.Tier, n: int, width: int, gen: torch.Generator, device: torch.device, nan_rate: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(-127, 128, (n, width), generator=gen, device=device, dtype=torch.int32).to(torch.int8)
    blocks = tier.row_codec.scale_shape(width)
    deltas = torch.exp2(torch.rand((n, *blocks), generator=gen, device=device) * 6 - 10)  # 2^-10 .. 2^-4
    deltas[torch.rand((n, *blocks), generator=gen, device=device) < 1e-3] = 0.0  # inert blocks
    return codes, deltas.to(torch.float16)


RowMaker = Callable[
    [tiers.Tier, int, int, torch.Generator, torch.device, float], "tuple[torch.Tensor, torch.Tensor | None]"
]
#: How each codec family's random rows are made (a TQ family covers int4 and every polarB).
_ROW_MAKERS: dict[type[RowCodec], RowMaker] = {
    F32Codec: _float_rows,
    BF16Codec: _float_rows,
    FP8Codec: _fp8_rows,
    TQCodec: _tq_rows,
    Q8Codec: _q8_rows,
}


def _row_maker(tier: tiers.Tier) -> RowMaker:
    for family, make_rows in _ROW_MAKERS.items():
        if isinstance(tier.row_codec, family):
            return make_rows
    raise AttentionInputError(f"no random rows are made for tier {tier.name!r}")


def make_case(
    tier: tiers.Tier | str,
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
    tier : a ``kvstore.tiers.Tier`` or its name (every tier: f32, bf16, fp8, int4, polar2..6, q8)
    lengths : rows of each sequence (one query token per sequence)
    heads : query heads H
    kv_lora, qk_rope : row widths K, R
    device : where every tensor lives
    seed : generator seed (callers pass a fresh one per check)
    selected : S, the index columns of the selected-rows variant; ``None`` for dense attention.
        Each sequence selects ``min(S, length)`` distinct rows, the last sequence fewer (ragged).
    nan_rate : fraction of fp8 codes replaced by a NaN code (0x7F / 0xFF), which must read as 0
        (other tiers have no NaN codes)

    Returns
    -------
    DecodeCase
    """
    tier = as_tier(tier)
    for name, width in (("kv_lora", kv_lora), ("qk_rope", qk_rope)):
        problem = tier.width_problem(width)
        if problem is not None:
            raise AttentionInputError(f"{name}: {problem}")
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
    make_rows = _row_maker(tier)
    lc_codes, lc_scales = make_rows(tier, n_rows, kv_lora, gen, device, nan_rate)
    rc_codes, rc_scales = make_rows(tier, n_rows, qk_rope, gen, device, nan_rate)
    q_lat = torch.randn((batch, heads, kv_lora), generator=gen, device=device)
    q_rope = torch.randn((batch, heads, qk_rope), generator=gen, device=device)
    case = DecodeCase(
        tier,
        q_lat,
        q_rope,
        lc_codes,
        lc_scales,
        rc_codes,
        rc_scales,
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


def decode(case: DecodeCase, out: torch.Tensor | None = None, backend=None, *, trusted: bool = False) -> torch.Tensor:
    """The case through ``backend``'s entry point (default: the preferred backend of its device), on
    a checked batch or a ``trusted`` one (:meth:`DecodeCase.batch`)."""
    from kvstore.gpu.registry import get_backend

    backend = backend if backend is not None else get_backend(case.q_lat.device)
    return backend.decode(case.q_lat, case.q_rope, case.batch(trusted=trusted), case.softmax_scale, out)


def reference(case: DecodeCase) -> torch.Tensor:
    """The float64 reference output of the case."""
    from kvstore.gpu.reference import reference_decode

    return reference_decode(
        case.tier,
        case.q_lat,
        case.q_rope,
        case.lc_codes,
        case.lc_scales,
        case.rc_codes,
        case.rc_scales,
        case.seq_start,
        case.seq_len,
        case.softmax_scale,
        case.indices,
        case.n_selected,
    )


def poisoned_out(case: DecodeCase) -> torch.Tensor:
    """An output buffer filled with NaN, so any element a kernel fails to write shows up."""
    batch, heads, kv_lora = case.q_lat.shape
    return torch.full((batch, heads, kv_lora), float("nan"), dtype=torch.float32, device=case.q_lat.device)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64); ``inf`` if ``out`` holds a non-finite value.

    Where every attended row is inert (a radius or delta of 0, which random rows plant one time in
    a thousand) the reference is zero and has no scale: 0 for an exactly zero ``out``, else ``inf``.
    """
    out64 = out.to(torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    if not bool(ref.any()):
        return 0.0 if not bool(out64.any()) else math.inf
    return float(torch.linalg.vector_norm(out64 - ref) / torch.linalg.vector_norm(ref))
