"""Decode attention over f32 and bf16 latent rows on CUDA, as Triton kernels (split-T flash decoding).

The CUDA kernels of :mod:`kvstore.gpu.cuda_backend` read fp8 and int4 codes; an f32 or bf16 cache
went through the torch path, which at 32k rows reads every row several times (scores, softmax,
context) or, under a CUDA graph, the whole power-of-two bucket of rows. Here each query's rows are
read once:

1. ``_dense_split``: one wave of programs per head block (``PROGRAMS_PER_SM`` per SM). Each
   program reads the lengths on the device and derives the same plan: the live rows' tiles divided
   over the wave, whole tiles per split, each sequence's splits numbered in turn. Program ``p``
   takes split ``p`` of that numbering, streams its ``BLOCK_N``-row tiles, scores them against
   every head of the block in one tensor-core product, keeps an online softmax and writes a
   normalized partial context and its log2-sum-exp in slot ``p``. Programs past the last split do
   nothing. The plan follows the lengths of each call, not a bound of them: a decode graph
   captured over a pool with room for later tokens divides only the rows that are live, and the
   call needs no synchronization.
2. ``_dense_merge``: one program per (head, sequence, ``MERGE_DIMS`` dims of the context) combines
   that sequence's slots (contiguous, from the same plan).

Numerics: the score and context products run on tensor cores in tf32 (10 explicit mantissa bits,
against bf16's 7: above the precision of the bf16 model that wrote the rows) with f32 accumulation
and an f32 softmax; the relative error against float64 is ~1e-3, the bound of the fp8 and int4
kernels. ``tf32x3`` (f32's bits from three tf32 products) measured 2.8x slower on the H200 (153.5
vs 54.7 us at 32k rows, 16 heads) and FMA ("ieee") 4x; an exact f32 product stays one switch away:
``KVSTORE_ATTENTION_BACKEND=torch``. A sequence with no rows gets a zero context.

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (the CPU tests use it); the backend
itself is declared for CUDA devices only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton
import triton.language as tl

from kvstore.gpu.inputs import LatentBatch
from kvstore.gpu.registry import AttentionBackend, spec_of
from kvstore.gpu.torch_backend import decode_torch

__all__ = ["TritonBackend", "dense_decode", "merge_partials", "plan_splits", "programs_for"]

# Tile rows, warps, stages and precision: the fastest of bench/gpu_dense.py --sweep on the
# H200 (16 heads, f32 rows, 32k rows and 16 ragged sequences).
#: Rows per tile of a split.
BLOCK_N = 16
#: Pipeline stages of the row tiles.
STAGES = 2
#: The products' precision (see the module's numerics).
PRECISION = "tf32"
#: Warps of a split program.
WARPS = 4
#: Heads per program (the tensor-core product's M; 16 is its smallest).
BLOCK_H = 16
#: Programs per multiprocessor of the one wave of split programs.
PROGRAMS_PER_SM = 2
#: Fewest tiles a split reads (a split's partial context is written and merged whatever its rows).
MIN_TILES = 1
#: Splits per step of a merge program (one loaded tile: MERGE_SPLITS x MERGE_DIMS).
MERGE_SPLITS = 16
#: Context dims per merge program (a power of two): a lone sequence's 16 heads merge in 8 x 16
#: programs rather than 16 that each walk every split over 512 dims (H200, f32, 32k rows: 47.7 us
#: a call against 74.8; bench/gpu_dense.py --sweep).
MERGE_DIMS = 64


@triton.jit
def _split_plan(seq_len, batch, programs, BP: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """The plan every program derives from the live lengths: each sequence's length, its splits
    and its first slot ([BP] vectors), and the tiles per split.

    The rows are divided over ``programs - batch`` programs, so that rounding each sequence's splits
    up (one partial split each) still fits ``programs``: one wave, whatever the lengths."""
    b = tl.arange(0, BP)
    lengths = tl.maximum(tl.load(seq_len + b, mask=b < batch, other=0), 0)
    tiles = (lengths + BLOCK_N - 1) // BLOCK_N
    per_split = tl.maximum((tl.sum(tiles, 0) + programs - batch - 1) // (programs - batch), MIN_TILES)
    splits = (tiles + per_split - 1) // per_split
    first = tl.cumsum(splits, 0) - splits
    return lengths, splits, first, per_split


@triton.jit
def _dense_split(
    q_lat,
    q_rope,
    lat,
    rope,
    seq_start,
    seq_len,
    part_ctx,
    part_lse,
    stride_qb,
    stride_qh,
    stride_rb,
    stride_rh,
    stride_lat,
    stride_rope,
    batch,
    heads,
    programs,
    scale_log2,
    K: tl.constexpr,
    R: tl.constexpr,
    KP: tl.constexpr,
    RP: tl.constexpr,
    BP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot = tl.program_id(0)  # the partial this program writes: live programs are 0 .. (their count - 1)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    lengths, splits, first, per_split = _split_plan(seq_len, batch, programs, BP, BLOCK_N, MIN_TILES)
    seqs = tl.arange(0, BP)
    # the sequence whose splits hold this slot: the last one starting at or before it, with splits
    b = tl.max(tl.where((first <= slot) & (splits > 0) & (seqs < batch), seqs, -1), 0)
    split = slot - tl.sum(tl.where(seqs == b, first, 0), 0)
    length = tl.sum(tl.where(seqs == b, lengths, 0), 0)  # 0 when no sequence has rows (b = -1)
    lo = split * (per_split * BLOCK_N)
    hi = tl.minimum(lo + per_split * BLOCK_N, length)
    if lo < hi:  # else a slot past the last sequence's splits: nothing to do, nothing read of it
        start = tl.load(seq_start + b).to(tl.int64)
        row_of = h.to(tl.int64) * programs + slot  # [BLOCK_H] partials: a head's slots are contiguous
        k = tl.arange(0, KP)
        r = tl.arange(0, RP)
        k_ok = k < K
        r_ok = r < R
        q = tl.load(
            q_lat + b * stride_qb + h[:, None] * stride_qh + k[None, :],
            mask=h_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        qr = tl.load(
            q_rope + b * stride_rb + h[:, None] * stride_rh + r[None, :],
            mask=h_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        peak = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        ctx = tl.zeros([BLOCK_H, KP], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            row = start + n
            # The score product reads the tile transposed ([K, N], as the product wants it) and the
            # context product reads it again row-major (from L1/L2): no transpose in registers.
            lt_t = tl.load(
                lat + row[None, :] * stride_lat + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
            ).to(tl.float32)
            rt_t = tl.load(
                rope + row[None, :] * stride_rope + r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0
            ).to(tl.float32)
            s = tl.dot(q, lt_t, input_precision=PRECISION)
            s += tl.dot(qr, rt_t, input_precision=PRECISION)
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
            new_peak = tl.maximum(peak, tl.max(s, 1))
            p = tl.exp2(s - new_peak[:, None])
            rescale = tl.exp2(peak - new_peak)
            denom = denom * rescale + tl.sum(p, 1)
            lt = tl.load(
                lat + row[:, None] * stride_lat + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            ).to(tl.float32)
            ctx = ctx * rescale[:, None] + tl.dot(p, lt, input_precision=PRECISION)
            peak = new_peak
        ctx = ctx / denom[:, None]
        tl.store(part_ctx + row_of[:, None] * KP + k[None, :], ctx, mask=h_ok[:, None] & k_ok[None, :])
        tl.store(part_lse + row_of, peak + tl.log2(denom), mask=h_ok)


@triton.jit
def _dense_merge(
    part_ctx,
    part_lse,
    seq_len,
    out,
    batch,
    heads,
    programs,
    K: tl.constexpr,
    KP: tl.constexpr,
    BP: tl.constexpr,
    SP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    MERGE_DIMS: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * heads + h: out is [B, H, K] contiguous
    b = bh // heads
    h = bh - b * heads
    _, splits, first, _ = _split_plan(seq_len, batch, programs, BP, BLOCK_N, MIN_TILES)
    seqs = tl.arange(0, BP)
    n_live = tl.where(seqs == b, splits, 0).sum(0)  # 0 for a sequence with no rows: a zero context
    slots = h * programs + tl.sum(tl.where(seqs == b, first, 0), 0).to(tl.int64)  # its first partial
    s = tl.arange(0, SP)
    lse = tl.load(part_lse + slots + s, mask=s < n_live, other=float("-inf"))
    peak = tl.max(lse, 0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # no rows at all: every weight is 0
    denom = tl.exp2(lse - peak).sum(0)
    k = tl.program_id(1) * MERGE_DIMS + tl.arange(0, MERGE_DIMS)
    acc = tl.zeros([MERGE_DIMS], tl.float32)
    for s0 in range(0, n_live, MERGE_SPLITS):
        c = s0 + tl.arange(0, MERGE_SPLITS)
        live = c < n_live
        w = tl.exp2(tl.load(part_lse + slots + c, mask=live, other=float("-inf")) - peak)
        part = tl.load(part_ctx + (slots + c)[:, None] * KP + k[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    acc = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out + bh * K + k, acc, mask=k < K)


def programs_for(batch: int, heads: int, n_sm: int, block_h: int | None = None, per_sm: int | None = None) -> int:
    """Split programs per head block: one wave of ``per_sm`` (default ``PROGRAMS_PER_SM``) per SM
    over the blocks of ``block_h`` (default ``BLOCK_H``) heads, at least twice the batch (half of
    them cover the sequences' partial last splits).

    Every program reads all ``batch`` lengths to derive the plan: 4 bytes per sequence, against the
    16-row tiles (36 KB each in f32) a working program streams; for a decode step's batches (tens
    to hundreds) that is noise, and it stays correct (if slower) for thousands."""
    head_blocks = -(-heads // (block_h or BLOCK_H))
    return max((n_sm * (per_sm or PROGRAMS_PER_SM)) // head_blocks, 2 * batch)


def plan_splits(lengths, heads: int, n_sm: int) -> tuple[int, list[int]]:
    """The kernels' plan for these lengths, computed on the host as each program computes it on the
    device (for tests and benchmarks): (rows per split, splits per sequence)."""
    programs = programs_for(len(lengths), heads, n_sm)
    tiles = [-(-max(n, 0) // BLOCK_N) for n in lengths]
    per_split = max(-(-sum(tiles) // (programs - len(lengths))), MIN_TILES)
    return per_split * BLOCK_N, [-(-t // per_split) for t in tiles]


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def dense_decode(q_lat, q_rope, lat, rope, seq_start, seq_len, softmax_scale: float, out, *, n_sm: int):
    """Launch the split and merge kernels: ``out`` f32[B, H, K] gets the attention context.

    ``lat`` / ``rope`` are f32 or bf16 [N, K] / [N, R] with unit column stride; ``seq_start`` /
    ``seq_len`` i32[B] on the rows' device, read only there (the call replays in a CUDA graph with
    any lengths).
    """
    batch, heads, k = q_lat.shape
    r = q_rope.shape[2]
    if lat.shape[0] == 0:  # no rows: every sequence is empty
        return out.zero_()
    programs = programs_for(batch, heads, n_sm)
    kp, rp, bp = _pow2(k), _pow2(r), _pow2(batch)
    part_ctx = torch.empty((heads, programs, kp), dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty((heads, programs), dtype=torch.float32, device=q_lat.device)
    log2e = 1.4426950408889634
    # a launcher takes Triton's launch options (num_warps, num_stages) beside the kernel's parameters
    split: Callable[..., Any] = _dense_split[(programs, -(-heads // BLOCK_H))]
    split(
        q_lat,
        q_rope,
        lat,
        rope,
        seq_start,
        seq_len,
        part_ctx,
        part_lse,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        lat.stride(0),
        rope.stride(0),
        batch,
        heads,
        programs,
        float(softmax_scale) * log2e,
        K=k,
        R=r,
        KP=kp,
        RP=rp,
        BP=bp,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        MIN_TILES=MIN_TILES,
        PRECISION=PRECISION,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return merge_partials(part_ctx, part_lse, seq_len, out, programs, BLOCK_N, MIN_TILES)


def merge_partials(part_ctx, part_lse, seq_len, out, programs: int, block_n: int, min_tiles: int):
    """Launch the merge of the partials a split kernel wrote under the plan of :func:`_split_plan`
    (``programs`` slots per head, ``block_n``-row tiles, ``min_tiles``): ``part_ctx``
    f32[H, programs, KP], ``part_lse`` f32[H, programs]; ``out`` f32[B, H, K] gets the contexts."""
    batch, heads, k = out.shape
    kp = part_ctx.shape[2]
    merge_dims = min(MERGE_DIMS, kp)
    merge: Callable[..., Any] = _dense_merge[(batch * heads, kp // merge_dims)]
    merge(
        part_ctx,
        part_lse,
        seq_len,
        out,
        batch,
        heads,
        programs,
        K=k,
        KP=kp,
        BP=_pow2(batch),
        SP=_pow2(programs),
        BLOCK_N=block_n,
        MIN_TILES=min_tiles,
        MERGE_SPLITS=MERGE_SPLITS,
        MERGE_DIMS=merge_dims,
        num_warps=4,
    )
    return out


class TritonBackend(AttentionBackend):
    """f32 and bf16 caches on CUDA: the split-T Triton kernels (the engine's path for those tiers)."""

    spec = spec_of("triton")

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.n_sm = torch.cuda.get_device_properties(self.device).multi_processor_count

    @classmethod
    def environment_reasons(cls, device: torch.device) -> list[str]:
        if device.type != "cuda" or not torch.cuda.is_available():
            return ["torch.cuda.is_available() is False"]
        if torch.cuda.get_device_capability(device) < (8, 0):
            return [f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0) (tf32 tensor cores)"]
        return []

    def decode(
        self,
        q_lat: torch.Tensor,
        q_rope: torch.Tensor,
        batch: LatentBatch,
        softmax_scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """f32 and bf16 rows through the kernels; another tier, selected rows, or rows the kernel
        cannot stride through (no copy is made) go the torch path."""
        if batch.checked:
            batch.check_call(q_lat, q_rope, softmax_scale, out)
        lc, rc = batch.lc_codes, batch.rc_codes
        if (
            batch.tier.name not in self.spec.tiers
            or batch.selected is not None
            or lc.stride(1) != 1
            or rc.stride(1) != 1
        ):
            return decode_torch(q_lat, q_rope, batch, softmax_scale, out)
        result = batch.output(out, q_lat.shape[1])
        device = batch.device
        q_l = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
        q_r = q_rope if q_rope.stride(2) == 1 else q_rope.contiguous()
        return dense_decode(
            q_l,
            q_r,
            lc,
            rc,
            batch.seq_start.to(device=device, non_blocking=True),
            batch.seq_len.to(device=device, non_blocking=True),
            softmax_scale,
            result,
            n_sm=self.n_sm,
        )
