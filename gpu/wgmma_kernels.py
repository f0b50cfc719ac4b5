"""Decode attention over fp8 code rows for 64 and more heads: warpgroup MMA on sm_90, in Gluon.

Opt-in (``KVSTORE_GPU_WGMMA=1``, or ``CudaBackend(wgmma=True)``): on the H200 these kernels match
the float64 reference like the ``mma.sync`` kernels of :mod:`kvstore.gpu.cuda_backend` but measure
8-15 % slower than them (docs/GPU.md, round 8), so the default stays there. They are kept as the
base of the warpgroup-MMA route, with the measurements that say where their time goes.

At 64 and more heads a decode step is bound by the tensor cores, not by the rows' bytes: per row,
2·H·(2K+R) flops against 584 bytes (fp8). Plain Triton keeps a 64-head query in registers beside
the 64 x 512 context and spills, so these kernels are written in Gluon (Triton's explicit-layout
dialect): the query, the converted row tile and the softmax weights live in shared memory, the
context in the accumulators of two warpgroups (256 output dims each).

``_wide_split``: one wave of programs per 64-head block, the head block varying fastest (the
programs of one split for every head block run side by side, so a split's rows come from HBM once
and from L2 for the other head blocks). Each program derives the plan of
:func:`kvstore.gpu.triton_backend._split_plan` from the live lengths and walks its split in
``BLOCK_N``-row tiles (``_attend``):

1. the codes of the tile after next are copied into a two-slot ring (cp.async);
2. scores = query · tileᵀ (the query in f16 with a power-of-two scale per head; latent and rope
   products apart, each times its row scales);
3. online softmax; the weights times the row scales go to shared memory in f16, scaled by a power
   of two per tile so small weights stay normal;
4. context += weights · tile (the tile's codes converted to f16, exact: e4m3 values are f16
   values); then the next tile's codes are converted from the ring into the MMA tile.

fp8 NaN codes (0x7F, 0xFF) read as 0 (FORMAT.md). Clearing them costs a pass over every code, so a
split runs as it is and only one whose softmax sums came out NaN runs again with the codes cleared.

The merge is :func:`kvstore.gpu.triton_backend.merge_partials` over the same plan.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kvstore.gpu import triton_backend

__all__ = ["BLOCK_H", "wide_decode"]

#: Heads per program: the M of a warpgroup MMA.
BLOCK_H = 64
#: Rows per tile.
BLOCK_N = 64
#: Warps per program: two warpgroups, each holding 256 of the context's 512 dims.
WARPS = 8
#: Programs per multiprocessor (each holds 224 KB of shared memory).
PROGRAMS_PER_SM = 1
#: Fewest tiles a split reads.
MIN_TILES = 1
#: Code columns converted at a time (256 measured 3-5 % faster than 128 on the H200).
CHUNK = 256


@gluon.jit
def _issue_tile(
    lc,
    rc,
    ring_l,
    ring_r,
    start,
    n0,
    hi,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CP_L: gl.constexpr,
    CP_R: gl.constexpr,
):
    """Start copying a tile's codes into a ring slot (cp.async, 16 bytes a thread) as one commit
    group; rows at or past ``hi`` are not read (their scores are masked)."""
    n_l = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP_L))
    k = gl.arange(0, K, layout=gl.SliceLayout(0, CP_L))
    async_copy.async_copy_global_to_shared(
        ring_l, lc + (start + n_l)[:, None] * K + k[None, :], mask=(n_l < hi)[:, None]
    )
    n_r = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP_R))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, CP_R))
    async_copy.async_copy_global_to_shared(
        ring_r, rc + (start + n_r)[:, None] * R + r[None, :], mask=(n_r < hi)[:, None]
    )
    async_copy.commit_group()


@gluon.jit
def _convert_tile(
    ring_l,
    ring_r,
    dst_l,
    dst_r,
    K: gl.constexpr,
    R: gl.constexpr,
    CHUNK: gl.constexpr,
    CLEAN: gl.constexpr,
    RAW_L: gl.constexpr,
    RAW_R: gl.constexpr,
):
    """A landed ring slot's codes to f16 in the MMA tile, ``CHUNK`` columns at a time (few registers
    live beside the context)."""
    for c in gl.static_range(K // CHUNK):
        raw = ring_l.slice(c * CHUNK, CHUNK, dim=1).load(RAW_L)
        dst_l.slice(c * CHUNK, CHUNK, dim=1).store(_e4m3_f16(raw, CLEAN))
    dst_r.store(_e4m3_f16(ring_r.load(RAW_R), CLEAN))


@gluon.jit
def _row_scales(ls, rs, start, n0, hi, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    n = n0 + gl.arange(0, BLOCK_N, layout=COL)
    return gl.load(ls + start + n, mask=n < hi, other=0.0), gl.load(rs + start + n, mask=n < hi, other=0.0)


@gluon.jit
def _e4m3_f16(raw, CLEAN: gl.constexpr):
    """e4m3 codes to f16 (exact); with CLEAN the NaN codes read as 0."""
    if CLEAN:
        raw = gl.where((raw & 0x7F) == 0x7F, 0, raw).to(gl.uint8)
    return raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)


@gluon.jit
def _scores(
    q_l, q_r, t_l, t_r, sc_l, sc_r, q_unscale, MMA_S: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr
):
    zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA_S)
    s_l = warpgroup_mma(q_l, t_l.permute((1, 0)), zero, is_async=True)
    s_r = warpgroup_mma(q_r, t_r.permute((1, 0)), zero, is_async=True)
    s_l, s_r = warpgroup_mma_wait(0, deps=[s_l, s_r])
    return (s_l * sc_l[None, :] + s_r * sc_r[None, :]) * q_unscale[:, None]


@gluon.jit
def _attend(
    rows,
    bufs,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CHUNK: gl.constexpr,
    CLEAN: gl.constexpr,
    RAW_L: gl.constexpr,
    RAW_R: gl.constexpr,
    CP_L: gl.constexpr,
    MMA_S: gl.constexpr,
    MMA_O: gl.constexpr,
):
    """Rows [lo, hi) of one sequence against the block's heads: (context over unit, peak, denom, unit).

    ``rows`` = (lc, ls, rc, rs, start, lo, hi); ``bufs`` = the shared-memory buffers and the query's
    unscale (q_l3, q_r3, q_unscale, t_l3, t_r3, p_sh, ring_l, ring_r)."""
    lc, ls, rc, rs, start, lo, hi = rows
    q_l3, q_r3, q_unscale, t_l3, t_r3, p_sh, ring_l, ring_r = bufs
    ROW_O: gl.constexpr = gl.SliceLayout(1, MMA_O)
    COL_S: gl.constexpr = gl.SliceLayout(0, MMA_S)
    t_l = t_l3.index(0)
    t_r = t_r3.index(0)
    # two tiles in flight; the first converted
    _issue_tile(lc, rc, ring_l.index(0), ring_r.index(0), start, lo, hi, K, R, BLOCK_N, CP_L, RAW_R)
    _issue_tile(lc, rc, ring_l.index(1), ring_r.index(1), start, lo + BLOCK_N, hi, K, R, BLOCK_N, CP_L, RAW_R)
    async_copy.wait_group(1)
    gl.thread_barrier()
    _convert_tile(ring_l.index(0), ring_r.index(0), t_l, t_r, K, R, CHUNK, CLEAN, RAW_L, RAW_R)
    sc_l, sc_r = _row_scales(ls, rs, start, lo, hi, BLOCK_N, COL_S)
    fence_async_shared()
    gl.thread_barrier()

    peak = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, MMA_S))
    denom = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, MMA_S))
    ctx = gl.zeros([BLOCK_H, K], gl.float32, MMA_O)
    unit = 1.0  # ctx holds the context over `unit` (the last tile's weight scale)
    ring = 0  # the ring slot of this tile (converted already); the next tile's is 1 - ring
    for n0 in range(lo, hi, BLOCK_N):
        # this tile's slot is free again: the tile after next into it
        _issue_tile(
            lc, rc, ring_l.index(ring), ring_r.index(ring), start, n0 + 2 * BLOCK_N, hi, K, R, BLOCK_N, CP_L, RAW_R
        )
        # the MMA operands at an index the compiler cannot fold: their descriptors are built here
        # rather than hoisted out of the loop, where 72 64-bit descriptors spill
        z = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [n0], dtype=gl.int32, is_pure=False, pack=1)
        s = _scores(
            q_l3.index(z), q_r3.index(z), t_l3.index(z), t_r3.index(z), sc_l, sc_r, q_unscale, MMA_S, BLOCK_H, BLOCK_N
        )
        n = n0 + gl.arange(0, BLOCK_N, layout=COL_S)
        s = gl.where((n < hi)[None, :], s, float("-inf"))
        new_peak = gl.maximum(peak, gl.max(s, 1))
        p = gl.exp2(s - new_peak[:, None])
        rescale = gl.exp2(peak - new_peak)
        denom = denom * rescale + gl.sum(p, 1)
        top = gl.max(sc_l, 0)
        top = gl.where(top > 0, top, 1.0)
        new_unit = top / 32768.0  # weights x row scale / top <= 1, times 2^15 in f16
        p_sh.store((p * (sc_l * (32768.0 / top))[None, :]).to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        acc = ctx * gl.convert_layout(rescale * (unit / new_unit), ROW_O)[:, None]
        ctx_tok = warpgroup_mma(p_sh, t_l3.index(z), acc, is_async=True)
        sc_l, sc_r = _row_scales(ls, rs, start, n0 + BLOCK_N, hi, BLOCK_N, COL_S)
        ctx = warpgroup_mma_wait(0, deps=[ctx_tok])
        # the next tile (issued a tile ago) into the MMA tile
        ring = 1 - ring
        async_copy.wait_group(1)
        gl.thread_barrier()
        _convert_tile(ring_l.index(ring), ring_r.index(ring), t_l, t_r, K, R, CHUNK, CLEAN, RAW_L, RAW_R)
        fence_async_shared()
        gl.thread_barrier()
        unit = new_unit
        peak = new_peak
    async_copy.wait_group(0)  # the copies past the split (zero-filled) land before the ring is reused
    gl.thread_barrier()
    return ctx, peak, denom, unit


@gluon.jit
def _store_partial(
    ctx,
    peak,
    denom,
    unit,
    hb,
    slot,
    programs,
    heads,
    part_ctx,
    part_lse,
    K: gl.constexpr,
    BLOCK_H: gl.constexpr,
    MMA_S: gl.constexpr,
    MMA_O: gl.constexpr,
):
    """The normalized partial context and the log2-sum-exp of the block's heads, in slot ``slot``."""
    ROW_O: gl.constexpr = gl.SliceLayout(1, MMA_O)
    ctx = ctx * gl.convert_layout(unit / denom, ROW_O)[:, None]
    h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    kk = gl.arange(0, K, layout=gl.SliceLayout(0, MMA_O))
    row_of = h.to(gl.int64) * programs + slot
    gl.store(part_ctx + row_of[:, None] * K + kk[None, :], ctx, mask=(h < heads)[:, None])
    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MMA_S))
    gl.store(part_lse + h_s.to(gl.int64) * programs + slot, peak + gl.log2(denom), mask=h_s < heads)


@gluon.jit
def _split_pass(
    rows,
    bufs,
    dest,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CHUNK: gl.constexpr,
    CLEAN: gl.constexpr,
    RAW_L: gl.constexpr,
    RAW_R: gl.constexpr,
    CP_L: gl.constexpr,
    MMA_S: gl.constexpr,
    MMA_O: gl.constexpr,
):
    """One pass over a split's rows, its partial stored (so no context stays live across a second
    pass: it would spill); returns the softmax sums."""
    hb, slot, programs, heads, part_ctx, part_lse = dest
    ctx, peak, denom, unit = _attend(rows, bufs, K, R, BLOCK_H, BLOCK_N, CHUNK, CLEAN, RAW_L, RAW_R, CP_L, MMA_S, MMA_O)
    _store_partial(ctx, peak, denom, unit, hb, slot, programs, heads, part_ctx, part_lse, K, BLOCK_H, MMA_S, MMA_O)
    return denom


@gluon.jit
def _wide_split(
    q_lat,
    q_rope,
    lc,
    ls,
    rc,
    rs,
    seq_start,
    seq_len,
    part_ctx,
    part_lse,
    stride_qb,
    stride_qh,
    stride_rb,
    stride_rh,
    batch,
    heads,
    programs,
    scale_log2,
    K: gl.constexpr,
    R: gl.constexpr,
    BP: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    MIN_TILES: gl.constexpr,
    CHUNK: gl.constexpr,
):
    gl.static_assert(K == 512, "two warpgroups of 256 context dims")
    # register layouts: code tiles 16 bytes per thread per row chunk; the two products' accumulators
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (CHUNK // 16), CHUNK // 16], [8, 1], [1, 0])
    RAW_R: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (R // 16), R // 16], [8, 1], [1, 0])
    CP_L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])
    RING: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    Q_L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0])
    PLAN: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA_S)
    SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SH_R: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * R if R < 64 else 128, element_bitwidth=16, rank=2)
    SH_P: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    hb = gl.program_id(0)
    slot = gl.program_id(1)
    # the plan (as triton_backend._split_plan): lengths -> this slot's sequence and rows
    seqs = gl.arange(0, BP, layout=PLAN)
    lengths = gl.maximum(gl.load(seq_len + seqs, mask=seqs < batch, other=0), 0)
    tiles = (lengths + BLOCK_N - 1) // BLOCK_N
    per_split = gl.maximum((gl.sum(tiles, 0) + programs - batch - 1) // (programs - batch), MIN_TILES)
    splits = (tiles + per_split - 1) // per_split
    first = gl.associative_scan(splits, 0, _add) - splits
    b = gl.max(gl.where((first <= slot) & (splits > 0) & (seqs < batch), seqs, -1), 0)
    split = slot - gl.sum(gl.where(seqs == b, first, 0), 0)
    length = gl.sum(gl.where(seqs == b, lengths, 0), 0)
    lo = split * (per_split * BLOCK_N)
    hi = gl.minimum(lo + per_split * BLOCK_N, length)
    if lo < hi:
        start = gl.load(seq_start + b).to(gl.int64)
        # the query: f16 with a power-of-two scale per head (max |q| just under 2^14) in shared memory
        hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_L))
        kq = gl.arange(0, K, layout=gl.SliceLayout(0, Q_L))
        rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_L))
        q = gl.load(
            q_lat + b * stride_qb + hq[:, None] * stride_qh + kq[None, :], mask=(hq < heads)[:, None], other=0.0
        )
        qr = gl.load(
            q_rope + b * stride_rb + hq[:, None] * stride_rh + rq[None, :], mask=(hq < heads)[:, None], other=0.0
        )
        amax = gl.maximum(gl.max(gl.abs(q), 1), gl.max(gl.abs(qr), 1))
        amax = gl.where(amax > 0, amax, 1.0)
        q_scale = gl.exp2(gl.floor(gl.log2(16384.0 / amax)))
        # [1, ...] buffers: the loop takes them at an index the compiler cannot fold (see _attend)
        q_l3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, K], SH_L)
        q_r3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, R], SH_R)
        q_l3.index(0).store((q * q_scale[:, None]).to(gl.float16))
        q_r3.index(0).store((qr * q_scale[:, None]).to(gl.float16))
        q_unscale = gl.convert_layout(scale_log2 / q_scale, ROW_S)
        t_l3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, K], SH_L)
        t_r3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_N, R], SH_R)
        p_sh = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], SH_P)
        ring_l = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, K], RING)
        ring_r = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, R], RING)

        rows = (lc, ls, rc, rs, start, lo, hi)
        bufs = (q_l3, q_r3, q_unscale, t_l3, t_r3, p_sh, ring_l, ring_r)
        dest = (hb, slot, programs, heads, part_ctx, part_lse)
        denom = _split_pass(rows, bufs, dest, K, R, BLOCK_H, BLOCK_N, CHUNK, False, RAW_L, RAW_R, CP_L, MMA_S, MMA_O)
        # fp8 NaN codes (0x7F, 0xFF) read as 0: clearing them costs a pass over every code, so the
        # split runs as it is, and only a split whose softmax sums came out NaN runs again with the
        # codes cleared
        if gl.max(gl.where(denom != denom, 1, 0), 0) > 0:
            _split_pass(rows, bufs, dest, K, R, BLOCK_H, BLOCK_N, CHUNK, True, RAW_L, RAW_R, CP_L, MMA_S, MMA_O)


@gluon.jit
def _add(a, b):
    return a + b


def wide_decode(q_lat, q_rope, lc, ls, rc, rs, seq_start, seq_len, softmax_scale: float, out, *, n_sm: int):
    """fp8 rows, 64+ heads: the split and merge kernels; ``out`` f32[B, H, K] gets the context."""
    batch, heads, k = q_lat.shape
    r = q_rope.shape[2]
    if lc.shape[0] == 0:
        return out.zero_()
    programs = triton_backend.programs_for(batch, heads, n_sm, BLOCK_H, PROGRAMS_PER_SM)
    bp = triton_backend._pow2(batch)
    part_ctx = torch.empty((heads, programs, k), dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty((heads, programs), dtype=torch.float32, device=q_lat.device)
    log2e = 1.4426950408889634
    _wide_split[(-(-heads // BLOCK_H), programs)](
        q_lat,
        q_rope,
        lc,
        ls,
        rc,
        rs,
        seq_start,
        seq_len,
        part_ctx,
        part_lse,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        batch,
        heads,
        programs,
        float(softmax_scale) * log2e,
        K=k,
        R=r,
        BP=bp,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        MIN_TILES=MIN_TILES,
        CHUNK=CHUNK,
        num_warps=WARPS,
    )
    return triton_backend.merge_partials(part_ctx, part_lse, seq_len, out, programs, BLOCK_N, MIN_TILES)
