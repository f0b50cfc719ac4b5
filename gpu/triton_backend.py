"""Decode attention over f32 and bf16 latent rows on CUDA, as Triton kernels (split-T flash decoding).

The CUDA kernels of :mod:`kvstore.gpu.cuda_backend` read fp8 and int4 codes; an f32 or bf16 cache
went through the torch path, which at 32k rows reads every row several times (scores, softmax,
context) or, under a CUDA graph, the whole power-of-two bucket of rows. Here each query's rows are
read once:

1. ``_dense_split``: one program per (split, sequence, head block) streams ``BLOCK_N``-row tiles of
   its share of the sequence, scores them against every head of the block in one tensor-core
   product, keeps an online softmax and writes a normalized partial context and its log2-sum-exp.
   A split past its sequence's end writes only ``-inf``. Lengths are read on the device, so the
   call needs no synchronization and replays in a CUDA graph.
2. ``_dense_merge``: one program per (head, sequence) combines the partials of the splits that
   hold rows (counted from the length on the device).

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

import torch
import triton
import triton.language as tl

from kvstore.gpu import inputs, launch
from kvstore.gpu.registry import AttentionBackend, spec_of
from kvstore.gpu.torch_backend import decode_torch

__all__ = ["TritonBackend", "dense_decode", "plan_splits"]

# Tile rows, warps, stages, precision and loads: the fastest of bench/gpu_dense.py --sweep on the
# H200 (16 heads, f32 rows, 32k rows and 16 ragged sequences).
#: Rows per tile of a split.
BLOCK_N = 16
#: Pipeline stages of the row tiles.
STAGES = 2
#: The products' precision (see the module's numerics).
PRECISION = "tf32"
#: Read each tile twice (transposed for the scores, row-major for the context) rather than
#: transpose it in registers.
TWO_LOADS = True
#: Warps of a split program.
WARPS = 4
#: Heads per program (the tensor-core product's M; 16 is its smallest).
BLOCK_H = 16
#: Most splits per sequence (the merge keeps them in one block).
MAX_SPLITS = 1024
#: Programs per multiprocessor one wave aims at.
PROGRAMS_PER_SM = 2
#: Splits per program of the merge (one loaded tile: MERGE_SPLITS x kv_lora).
MERGE_SPLITS = 16


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
    heads,
    n_splits,
    split_rows,
    scale_log2,
    K: tl.constexpr,
    R: tl.constexpr,
    KP: tl.constexpr,
    RP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    TWO_LOADS: tl.constexpr,
):
    split = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    start = tl.load(seq_start + b).to(tl.int64)
    length = tl.maximum(tl.load(seq_len + b), 0)
    lo = split * split_rows
    hi = tl.minimum(lo + split_rows, length)
    row_of = ((b * heads + h) * n_splits + split).to(tl.int64)  # [BLOCK_H] partial slots
    if lo >= hi:
        tl.store(part_lse + row_of, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
    else:
        k = tl.arange(0, KP)
        r = tl.arange(0, RP)
        k_ok = k < K
        r_ok = r < R
        q = tl.load(
            q_lat + b * stride_qb + h[:, None] * stride_qh + k[None, :], mask=h_ok[:, None] & k_ok[None, :], other=0.0
        )
        qr = tl.load(
            q_rope + b * stride_rb + h[:, None] * stride_rh + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0
        )
        peak = tl.full([BLOCK_H], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_H], tl.float32)
        ctx = tl.zeros([BLOCK_H, KP], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            row = start + n
            if TWO_LOADS:
                # The score product reads the tile transposed ([K, N], as the product wants it) and
                # the context product reads it again row-major (from L1/L2): no transpose in registers.
                lt_t = tl.load(
                    lat + row[None, :] * stride_lat + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
                ).to(tl.float32)
                rt_t = tl.load(
                    rope + row[None, :] * stride_rope + r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0
                ).to(tl.float32)
                s = tl.dot(q, lt_t, input_precision=PRECISION)
                s += tl.dot(qr, rt_t, input_precision=PRECISION)
            else:
                lt = tl.load(
                    lat + row[:, None] * stride_lat + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
                ).to(tl.float32)
                rt = tl.load(
                    rope + row[:, None] * stride_rope + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
                ).to(tl.float32)
                s = tl.dot(q, tl.trans(lt), input_precision=PRECISION)
                s += tl.dot(qr, tl.trans(rt), input_precision=PRECISION)
            s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
            new_peak = tl.maximum(peak, tl.max(s, 1))
            p = tl.exp2(s - new_peak[:, None])
            rescale = tl.exp2(peak - new_peak)
            denom = denom * rescale + tl.sum(p, 1)
            if TWO_LOADS:
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
    heads,
    n_splits,
    split_rows,
    K: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # b * heads + h: out is [B, H, K] contiguous
    # only the splits that hold rows: a plan bounded by the whole row array (lengths on the
    # device) has mostly empty ones
    length = tl.maximum(tl.load(seq_len + bh // heads), 0)
    n_live = tl.minimum((length + split_rows - 1) // split_rows, n_splits)
    s = tl.arange(0, SP)
    lse = tl.load(part_lse + bh * n_splits + s, mask=s < n_live, other=float("-inf"))
    peak = tl.max(lse, 0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # no rows at all: every weight is 0
    denom = tl.sum(tl.exp2(lse - peak), 0)
    k = tl.arange(0, KP)
    acc = tl.zeros([KP], tl.float32)
    for s0 in range(0, n_live, MERGE_SPLITS):
        c = s0 + tl.arange(0, MERGE_SPLITS)
        c_lse = tl.load(part_lse + bh * n_splits + c, mask=c < n_live, other=float("-inf"))
        live = c_lse > float("-inf")  # a split past the sequence wrote no context
        w = tl.where(live, tl.exp2(c_lse - peak), 0.0)
        part = tl.load(part_ctx + (bh * n_splits + c)[:, None] * KP + k[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    acc = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out + bh * K + k, acc, mask=k < K)


def plan_splits(batch: int, head_blocks: int, max_rows: int, mean_rows: float, n_sm: int) -> tuple[int, int]:
    """(splits per sequence, rows per split): enough programs for ``PROGRAMS_PER_SM`` per SM over
    the typical sequence, each split a whole number of tiles, at most :data:`MAX_SPLITS`."""
    tiles_mean = max(1, -(-int(mean_rows) // BLOCK_N))
    tiles_max = max(1, -(-max_rows // BLOCK_N))
    wanted = max(1, -(-(n_sm * PROGRAMS_PER_SM) // (batch * head_blocks)))
    per_split = max(1, -(-tiles_mean // wanted), -(-tiles_max // MAX_SPLITS))
    per_split = launch.one_wave_split(per_split, tiles_mean, batch, head_blocks, n_sm * PROGRAMS_PER_SM)
    return -(-tiles_max // per_split), per_split * BLOCK_N


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def dense_decode(q_lat, q_rope, lat, rope, seq_start, seq_len, softmax_scale: float, out, *, n_sm: int, lengths=None):
    """Launch the split and merge kernels: ``out`` f32[B, H, K] gets the attention context.

    ``lat`` / ``rope`` are f32 or bf16 [N, K] / [N, R] with unit column stride; ``seq_start`` /
    ``seq_len`` i32[B] on the rows' device; ``lengths`` the (longest, mean) sequence when the host
    knows them (else the plan is bounded by N).
    """
    batch, heads, k = q_lat.shape
    r = q_rope.shape[2]
    n_rows = lat.shape[0]
    if n_rows == 0:  # no rows: every sequence is empty
        return out.zero_()
    if lengths is None:  # lengths on the device: bounded by the rows (planning a lone sequence for
        # half of them, as a decode graph's power-of-two bucket may hold, measured slower: 84.6 vs
        # 54.2 us at 32k rows, and 62.3 vs 66.0 us at 32k live rows of 64k)
        max_rows, mean_rows = n_rows, n_rows / batch
    else:
        max_rows, mean_rows = lengths
    head_blocks = -(-heads // BLOCK_H)
    n_splits, split_rows = plan_splits(batch, head_blocks, max_rows, mean_rows, n_sm)
    kp, rp = _pow2(k), _pow2(r)
    part_ctx = torch.empty((batch, heads, n_splits, kp), dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty((batch, heads, n_splits), dtype=torch.float32, device=q_lat.device)
    log2e = 1.4426950408889634
    _dense_split[(n_splits, batch, head_blocks)](
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
        heads,
        n_splits,
        split_rows,
        float(softmax_scale) * log2e,
        K=k,
        R=r,
        KP=kp,
        RP=rp,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        PRECISION=PRECISION,
        TWO_LOADS=TWO_LOADS,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    _dense_merge[(batch * heads,)](
        part_ctx,
        part_lse,
        seq_len,
        out,
        heads,
        n_splits,
        split_rows,
        K=k,
        KP=kp,
        SP=_pow2(n_splits),
        MERGE_SPLITS=MERGE_SPLITS,
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

    def mla_decode_dense(self, q_lat, q_rope, lc, rc, seq_start, seq_len, softmax_scale, out=None, *, validate=True):
        tier = inputs.dense_tier(lc)
        problem = inputs.check_inputs(tier, q_lat, q_rope, lc, None, rc, None, seq_start, seq_len, softmax_scale, out)
        if lc.stride(1) != 1 or rc.stride(1) != 1:  # rows the kernel cannot stride through: no copy, the torch path
            return decode_torch(
                tier, q_lat, q_rope, lc, None, rc, None, seq_start, seq_len, softmax_scale, out, validate=validate
            )
        if validate:
            inputs.check_ranges(problem, seq_start, seq_len)
        result = inputs.prepare_out(out, problem)
        lengths = None
        if seq_len.device.type == "cpu":  # lengths on the host plan the splits exactly
            live = seq_len.clamp_min(0)
            lengths = (int(live.max()), float(live.to(torch.float32).mean()))
        device = problem.device
        q_l = q_lat if q_lat.stride(2) == 1 else q_lat.contiguous()
        q_r = q_rope if q_rope.stride(2) == 1 else q_rope.contiguous()
        return dense_decode(
            q_l,
            q_r,
            lc,
            rc,
            seq_start.to(device=device, non_blocking=True),
            seq_len.to(device=device, non_blocking=True),
            softmax_scale,
            result,
            n_sm=self.n_sm,
            lengths=lengths,
        )
