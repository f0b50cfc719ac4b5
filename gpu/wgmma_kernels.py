"""Decode attention over fp8 code rows for 64 and more heads: warpgroup MMA on sm_90, in Gluon.

On the H200 these kernels are 8-23 % faster than the ``mma.sync`` kernels of
:mod:`kvstore.gpu.cuda_backend` from 128k rows at 64 and 128 heads (CUDA-graph replays), within 7 %
of them at 32k rows, and match the float64 reference within the same bound (docs/GPU.md, round 9).
A CUDA backend left to choose runs them for dense fp8 calls of 64+ heads on sm_90 when Triton is
the release they are written for, for captured calls and long plain calls
(:func:`kvstore.gpu.cuda_plan.wgmma_for_call`: a plain call pays their three Triton launches).

At 64 and more heads a decode step is bound by the tensor cores, not by the rows' bytes: per row,
2·H·(2K+R) flops against 584 bytes (fp8). One program holds 64 heads (a warpgroup MMA's M) and a
split of one sequence's rows, and its warps are specialized (Gluon's ``warp_specialize``):

* the **scores warpgroup** (4 warps, the default partition) scores each 64-row tile against the
  query (``query · tileᵀ``, both operands in shared memory: the query in f16 with a power-of-two
  scale per head, the tile's codes converted to f16, exact), runs the online softmax, and hands
  the weights (f16, scaled by a power of two per tile) and the context's rescale to the context
  warpgroups through shared memory. Then, while they multiply, it fetches the next tile's codes
  (all its loads in flight at once), converts them into the other slot of a two-slot ring once
  that slot is free, and asks L2 for the tile after next;
* the **context warpgroups** (8 warps, 256 of the 512 context dims each) keep the context in their
  accumulators: per tile, ``context = context x rescale + weights · tile``.

Triton gives every partition the same register budget (65536 / 384 threads = 168): the context
warpgroups need 154 for their 128 accumulators, which leaves no room for a third, producer
warpgroup (at 512 threads the budget is 128) and no shared memory for a raw-code ring beside the
query and the two f16 tiles (224 KB). So the scores warpgroup fetches, and it does so after its
softmax, when its score accumulators are dead: fetching during the score product measured a third
slower, and issuing the loads before it spilled.

The split plan is derived on the device from the lengths (as the f32 kernels of
:mod:`kvstore.gpu.triton_backend`), so a CUDA graph replays at any lengths; the query is staged by
one small kernel before (``_stage_query``) and the partials merged by
:func:`kvstore.gpu.triton_backend.merge_partials` after.

fp8 NaN codes (0x7F, 0xFF) read as 0 (FORMAT.md). Clearing them costs several instructions per
code word, so tiles are converted as they are; a NaN code makes its row's scores NaN for every
head, and a tile whose scores show one is converted again with the codes cleared and scored again,
before its weights go out.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kvstore.gpu import triton_backend

__all__ = ["BLOCK_H", "wide_decode"]

#: Heads per program: the M of a warpgroup MMA.
BLOCK_H = 64
#: Rows per tile.
BLOCK_N = 64
#: Warps of the scores warpgroup (the default partition) and of the context warpgroups.
SCORES_WARPS = 4
CONTEXT_WARPS = 8
#: Registers per thread of every partition (Triton's cap for 384 threads).
PARTITION_REGS = 168
#: Programs per multiprocessor (each holds 226 KB of shared memory).
PROGRAMS_PER_SM = 1
#: Fewest tiles a split reads.
MIN_TILES = 1
#: How many tiles ahead the scores warpgroup asks L2 for a tile's rows (3 measured the same as 2).
PREFETCH_TILES = 2


@gluon.jit
def _opaque_zero(x):
    """0, at an index the compiler cannot fold: MMA operands taken at it have their 64-bit
    descriptors built in the loop rather than hoisted out of it, where they spill."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


# e4m3 codes to f16 by inline PTX, four codes per 32-bit word into two f16x2 words ($0, $1): a u8
# tensor operated on element by element would take a register per code
_CVT4 = """
    mov.b32 {lo, hi}, %s;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
"""
#: NaN codes kept (they convert to NaN)
_E4M3_KEPT = gl.constexpr("{ .reg .b16 lo, hi;" + _CVT4 % "$2" + "}")
#: NaN codes (0x7F, 0xFF) cleared: t = a code's low 7 bits xor 0x7F (0 for NaN); (t + 0x7F) | t has
#: bit 7 set where t != 0, no carry crossing bytes; prmt spreads each byte's bit 7 over the byte
_E4M3_CLEARED = gl.constexpr(
    """{ .reg .b32 t, nz; .reg .b16 lo, hi;
    and.b32 t, $2, 0x7F7F7F7F;
    xor.b32 t, t, 0x7F7F7F7F;
    add.u32 nz, t, 0x7F7F7F7F;
    or.b32 nz, nz, t;
    prmt.b32 nz, nz, 0, 0xBA98;
    and.b32 t, $2, nz;"""
    + _CVT4 % "t"
    + "}"
)


@gluon.jit
def _e4m3_words(raw, ASM: gl.constexpr):
    return gl.inline_asm_elementwise(ASM, "=r,=r,r", [raw], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _e4m3_f16(raw, CLEAN: gl.constexpr):
    """e4m3 codes to f16 (exact); with CLEAN the NaN codes (0x7F, 0xFF) read as 0, else they stay NaN."""
    if CLEAN:
        return _e4m3_words(raw, _E4M3_CLEARED)
    else:
        return _e4m3_words(raw, _E4M3_KEPT)


@gluon.jit
def _load_codes(
    codes, start, n0, hi, col0, STRIDE: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, RAW: gl.constexpr
):
    """Codes [n0, n0 + ROWS) x [col0, col0 + COLS) of rows ``STRIDE`` bytes wide; rows at or past
    ``hi`` read as 0."""
    n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, RAW))
    k = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, RAW))
    return gl.load(codes + (start + n)[:, None] * STRIDE + k[None, :], mask=(n < hi)[:, None], other=0)


@gluon.jit
def _prefetch_l2(base, LINES: gl.constexpr, L: gl.constexpr):
    """Ask L2 for ``LINES`` 128-byte lines from ``base`` (no registers held, nothing waited for)."""
    line = gl.arange(0, LINES, layout=L)
    gl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + line * 128], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _prefetch_tile(lc, rc, start, n0, hi, K: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr):
    """A tile's code rows into L2 ahead of its loads, when the tile starts before ``hi``."""
    PF: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if n0 < hi:
        _prefetch_l2(lc + (start + n0) * K, BLOCK_N * K // 128, PF)
        _prefetch_l2(rc + (start + n0) * R, BLOCK_N * R // 128, PF)


@gluon.jit
def _fetch_tile(lc, ls, rc, rs, start, n0, hi, K: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr):
    """A tile's codes and row scales from global memory into registers, every load in flight at
    once (74 registers): the rope codes, four quarters of the latent columns (each whole 128-byte
    swizzle blocks of the MMA tile), the latent and rope scales."""
    QC: gl.constexpr = K // 4
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (QC // 16), QC // 16], [4, 1], [1, 0])
    RAW_R: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (R // 16), R // 16], [4, 1], [1, 0])
    SC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    raw_r = _load_codes(rc, start, n0, hi, 0, R, BLOCK_N, R, RAW_R)
    raw0 = _load_codes(lc, start, n0, hi, 0, K, BLOCK_N, QC, RAW_L)
    raw1 = _load_codes(lc, start, n0, hi, QC, K, BLOCK_N, QC, RAW_L)
    raw2 = _load_codes(lc, start, n0, hi, 2 * QC, K, BLOCK_N, QC, RAW_L)
    raw3 = _load_codes(lc, start, n0, hi, 3 * QC, K, BLOCK_N, QC, RAW_L)
    n_s = n0 + gl.arange(0, BLOCK_N, layout=SC)
    s_l = gl.load(ls + start + n_s, mask=n_s < hi, other=0.0)
    s_r = gl.load(rs + start + n_s, mask=n_s < hi, other=0.0)
    return raw_r, raw0, raw1, raw2, raw3, s_l, s_r


@gluon.jit
def _put_tile(fetched, t_l, t_r, sc_sh, slot, K: gl.constexpr, CLEAN: gl.constexpr):
    """A fetched tile (:func:`_fetch_tile`) to f16 in ring slot ``slot``, with its row scales."""
    QC: gl.constexpr = K // 4
    raw_r, raw0, raw1, raw2, raw3, s_l, s_r = fetched
    dst_l = t_l.index(slot)
    t_r.index(slot).store(_e4m3_f16(raw_r, CLEAN))
    dst_l.slice(0, QC, dim=1).store(_e4m3_f16(raw0, CLEAN))
    dst_l.slice(QC, QC, dim=1).store(_e4m3_f16(raw1, CLEAN))
    dst_l.slice(2 * QC, QC, dim=1).store(_e4m3_f16(raw2, CLEAN))
    dst_l.slice(3 * QC, QC, dim=1).store(_e4m3_f16(raw3, CLEAN))
    sc_sh.index(2 * slot).store(s_l)
    sc_sh.index(2 * slot + 1).store(s_r)


@gluon.jit
def _softmax_step(s_l, s_r, sc_sh, hand, q_unscale, state, n0, hi, j, ring, BLOCK_N: gl.constexpr, MMA_S: gl.constexpr):
    """One tile's online-softmax step; the weights (f16) and the context's rescale go to the
    context warpgroups. ``state`` and the result: (peak, denom, unit), the context being held over
    ``unit``, the last tile's weight scale."""
    p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin = hand
    peak, denom, unit = state
    COL_S: gl.constexpr = gl.SliceLayout(0, MMA_S)
    sc_l = sc_sh.index(2 * ring).load(COL_S)
    sc_r = sc_sh.index(2 * ring + 1).load(COL_S)
    s = (s_l * sc_l[None, :] + s_r * sc_r[None, :]) * q_unscale[:, None]
    n = n0 + gl.arange(0, BLOCK_N, layout=COL_S)
    s = gl.where((n < hi)[None, :], s, float("-inf"))
    new_peak = gl.maximum(peak, gl.max(s, 1))
    p = gl.exp2(s - new_peak[:, None])
    rescale = gl.exp2(peak - new_peak)
    denom = denom * rescale + gl.sum(p, 1)
    top = gl.max(sc_l, 0)
    top = gl.where(top > 0, top, 1.0)
    new_unit = top / 32768.0  # weights x row scale / top <= 1, times 2^15 in f16
    p16 = (p * (sc_l * (32768.0 / top))[None, :]).to(gl.float16)
    # the context warpgroups are done with the previous weights
    mbarrier.wait(p_empty, (j & 1) ^ 1)
    p_sh.store(p16)
    alpha_sh.store(rescale * (unit / new_unit))
    fence_async_shared()
    mbarrier.arrive(p_full)
    return new_peak, denom, new_unit


@gluon.jit
def _scores_partition(
    query,
    rows,
    ring_bufs,
    hand,
    dest,
    part_lse,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PREFETCH_TILES: gl.constexpr,
):
    """The scores warpgroup (see the module): per tile, scores, softmax, weights out; then the
    next tile into the ring. At the end the log2-sum-exp, and the context's normalization for the
    context warpgroups. ``query``, ``rows``, ``ring_bufs``, ``hand``, ``dest``: see :func:`_wide_split`."""
    q_l3, q_r3, q_unscale = query
    lc, ls, rc, rs, start, lo, hi = rows
    t_l, t_r, sc_sh = ring_bufs
    p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin = hand
    hb, slot, programs, heads = dest
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA_S)
    peak = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    denom = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    unit = 1.0
    _prefetch_tile(lc, rc, start, lo + BLOCK_N, hi, K, R, BLOCK_N)
    _put_tile(_fetch_tile(lc, ls, rc, rs, start, lo, hi, K, R, BLOCK_N), t_l, t_r, sc_sh, 0, K, False)
    fence_async_shared()
    gl.thread_barrier()
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    j = 0
    redo = 0  # this tile is scored again, its NaN codes cleared
    while j < n_tiles:
        n0 = lo + j * BLOCK_N
        ring = j % 2
        z = _opaque_zero(j)
        zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA_S)
        s_l = warpgroup_mma(q_l3.index(z), t_l.index(ring).permute((1, 0)), zero, is_async=True)
        s_r = warpgroup_mma(q_r3.index(z), t_r.index(ring).permute((1, 0)), zero, is_async=True)
        s_l, s_r = warpgroup_mma_wait(0, deps=[s_l, s_r])
        if redo == 0 and gl.max(gl.max(gl.where((s_l != s_l) | (s_r != s_r), 1, 0), 1), 0) > 0:
            # the slot is this warpgroup's until the tile's weights go out
            _put_tile(_fetch_tile(lc, ls, rc, rs, start, n0, hi, K, R, BLOCK_N), t_l, t_r, sc_sh, ring, K, True)
            fence_async_shared()
            gl.thread_barrier()
            redo = 1
        else:
            redo = 0
            peak, denom, unit = _softmax_step(
                s_l, s_r, sc_sh, hand, q_unscale, (peak, denom, unit), n0, hi, j, ring, BLOCK_N, MMA_S
            )
            # while the context warpgroups multiply this tile: a later tile into L2, and the next
            # into the other slot once they are done with it (tile j - 1)
            _prefetch_tile(lc, rc, start, n0 + PREFETCH_TILES * BLOCK_N, hi, K, R, BLOCK_N)
            fetched = _fetch_tile(lc, ls, rc, rs, start, n0 + BLOCK_N, hi, K, R, BLOCK_N)
            # the ((j + 1) // 2)-th fill of that slot waits for the ((j - 1) // 2)-th release (none
            # before the first: the parity of a fresh barrier's previous phase passes at once)
            mbarrier.wait(empty.index(1 - ring), (((j + 1) // 2) & 1) ^ 1)
            _put_tile(fetched, t_l, t_r, sc_sh, 1 - ring, K, False)
            fence_async_shared()
            gl.thread_barrier()
            j += 1
    fin_sh.store(unit / denom)
    mbarrier.arrive(fin)
    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
    gl.store(part_lse + h_s.to(gl.int64) * programs + slot, peak + gl.log2(denom), mask=h_s < heads)


@gluon.jit
def _context_partition(
    ring_bufs, hand, lo, hi, dest, part_ctx, K: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr
):
    """The context warpgroups: context = context x rescale + weights · tile, per tile; at the end
    the normalized partial context in slot ``slot``."""
    t_l = ring_bufs[0]
    p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin = hand
    hb, slot, programs, heads = dest
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, K // 2, 16])
    ROW_O: gl.constexpr = gl.SliceLayout(1, MMA_O)
    ctx = gl.zeros([BLOCK_H, K], gl.float32, MMA_O)
    for j in range(gl.cdiv(hi - lo, BLOCK_N)):
        ring = j % 2
        mbarrier.wait(p_full, j & 1)
        acc = ctx * alpha_sh.load(ROW_O)[:, None]
        tok = warpgroup_mma(p_sh, t_l.index(ring), acc, is_async=True)
        ctx = warpgroup_mma_wait(0, deps=[tok])
        mbarrier.arrive(p_empty)
        mbarrier.arrive(empty.index(ring))
    mbarrier.wait(fin, 0)
    ctx = ctx * fin_sh.load(ROW_O)[:, None]
    h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_O)
    kk = gl.arange(0, K, layout=gl.SliceLayout(0, MMA_O))
    row_of = h.to(gl.int64) * programs + slot
    gl.store(part_ctx + row_of[:, None] * K + kk[None, :], ctx, mask=(h < heads)[:, None])


@gluon.jit
def _wide_split(
    q16,
    q_unscales,
    lc,
    ls,
    rc,
    rs,
    seq_start,
    seq_len,
    part_ctx,
    part_lse,
    batch,
    heads,
    heads_pad,
    programs,
    K: gl.constexpr,
    R: gl.constexpr,
    BP: gl.constexpr,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    MIN_TILES: gl.constexpr,
    CONTEXT_WARPS: gl.constexpr,
    PARTITION_REGS: gl.constexpr,
    PREFETCH_TILES: gl.constexpr,
):
    """One split of one sequence against one 64-head block (program (head block, slot))."""
    gl.static_assert(K == 512, "two context warpgroups of 256 dims each")
    PLAN: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    Q_R: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [4, 1], [1, 0])
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    SH_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SH_R: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * R if R < 64 else 128, element_bitwidth=16, rank=2)
    SH_P: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

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
        # the staged query into shared memory with cp.async (no registers held)
        q_l3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, K], SH_L)
        q_r3 = gl.allocate_shared_memory(gl.float16, [1, BLOCK_H, R], SH_R)
        hq = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_L))
        kq = gl.arange(0, K, layout=gl.SliceLayout(0, Q_L))
        hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, Q_R))
        rq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_R))
        q_row = (b * heads_pad + hq).to(gl.int64) * (K + R)
        async_copy.async_copy_global_to_shared(q_l3.index(0), q16 + q_row[:, None] + kq[None, :])
        r_row = (b * heads_pad + hr).to(gl.int64) * (K + R) + K
        async_copy.async_copy_global_to_shared(q_r3.index(0), q16 + r_row[:, None] + rq[None, :])
        async_copy.commit_group()
        hs = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MMA_S))
        q_unscale = gl.load(q_unscales + b * heads_pad + hs)
        # the two-slot ring of f16 tiles and their row scales; the weights and rescale handed over
        t_l = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, K], SH_L)
        t_r = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, R], SH_R)
        sc_sh = gl.allocate_shared_memory(gl.float32, [4, BLOCK_N], FLAT)
        p_sh = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], SH_P)
        alpha_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], FLAT)
        fin_sh = gl.allocate_shared_memory(gl.float32, [BLOCK_H], FLAT)
        # empty[s]: the context warpgroups are done with slot s; p_full / p_empty: the weights are
        # out / read; fin: the normalization is out
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(3):
            mbarrier.init(bars.index(i), count=1)
        p_full = bars.index(0)
        p_empty = bars.index(1)
        fin = bars.index(2)
        async_copy.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
        # the query; the split's rows; the ring; the hand-off buffers and barriers; where the
        # partial goes
        query = (q_l3, q_r3, q_unscale)
        rows = (lc, ls, rc, rs, start, lo, hi)
        ring_bufs = (t_l, t_r, sc_sh)
        hand = (p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin)
        dest = (hb, slot, programs, heads)
        gl.warp_specialize(
            [
                (
                    _scores_partition,
                    (query, rows, ring_bufs, hand, dest, part_lse, K, R, BLOCK_H, BLOCK_N, PREFETCH_TILES),
                ),
                (_context_partition, (ring_bufs, hand, lo, hi, dest, part_ctx, K, BLOCK_H, BLOCK_N)),
            ],
            [CONTEXT_WARPS],
            [PARTITION_REGS],
        )


@gluon.jit
def _stage_query(
    q_lat,
    q_rope,
    q16,
    q_unscales,
    stride_qb,
    stride_qh,
    stride_rb,
    stride_rh,
    heads,
    heads_pad,
    scale_log2,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_H: gl.constexpr,
):
    """64 heads of one sequence's query as the score product's operand: f16 with a power-of-two
    scale per head (max |q| just under 2^14) in q16[B, heads_pad, K + R], and per head the factor
    that takes a score back to log2 units. (In the split kernel the scores warpgroup would hold it
    in 256 registers a thread.)"""
    L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 2], [32 // (R // 2), R // 2], [8, 1], [1, 0])
    b = gl.program_id(1)
    hb = gl.program_id(0)
    h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L))
    k = gl.arange(0, K, layout=gl.SliceLayout(0, L))
    hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LR))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, LR))
    q = gl.load(q_lat + b * stride_qb + h[:, None] * stride_qh + k[None, :], mask=(h < heads)[:, None], other=0.0)
    qr = gl.load(q_rope + b * stride_rb + hr[:, None] * stride_rh + r[None, :], mask=(hr < heads)[:, None], other=0.0)
    amax = gl.maximum(gl.max(gl.abs(q), 1), gl.convert_layout(gl.max(gl.abs(qr), 1), gl.SliceLayout(1, L)))
    amax = gl.where(amax > 0, amax, 1.0)
    q_scale = gl.exp2(gl.floor(gl.log2(16384.0 / amax)))
    row = (b * heads_pad + h).to(gl.int64) * (K + R)
    gl.store(q16 + row[:, None] + k[None, :], (q * q_scale[:, None]).to(gl.float16))
    row_r = (b * heads_pad + hr).to(gl.int64) * (K + R) + K
    scale_r = gl.convert_layout(q_scale, gl.SliceLayout(1, LR))
    gl.store(q16 + row_r[:, None] + r[None, :], (qr * scale_r[:, None]).to(gl.float16))
    gl.store(q_unscales + b * heads_pad + h, scale_log2 / q_scale)


@gluon.jit
def _add(a, b):
    return a + b


def wide_decode(q_lat, q_rope, lc, ls, rc, rs, seq_start, seq_len, softmax_scale: float, out, *, n_sm: int):
    """fp8 rows, 64+ heads: the query staging, split and merge kernels; ``out`` f32[B, H, K] gets
    the context."""
    batch, heads, k = q_lat.shape
    r = q_rope.shape[2]
    if lc.shape[0] == 0:
        return out.zero_()
    device = q_lat.device
    blocks = -(-heads // BLOCK_H)
    heads_pad = blocks * BLOCK_H
    programs = triton_backend.programs_for(batch, heads, n_sm, BLOCK_H, PROGRAMS_PER_SM)
    q16 = torch.empty((batch, heads_pad, k + r), dtype=torch.float16, device=device)
    q_unscales = torch.empty((batch, heads_pad), dtype=torch.float32, device=device)
    part_ctx = torch.empty((heads, programs, k), dtype=torch.float32, device=device)
    part_lse = torch.empty((heads, programs), dtype=torch.float32, device=device)
    log2e = 1.4426950408889634
    _stage_query[(blocks, batch)](
        q_lat,
        q_rope,
        q16,
        q_unscales,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        heads,
        heads_pad,
        float(softmax_scale) * log2e,
        K=k,
        R=r,
        BLOCK_H=BLOCK_H,
        num_warps=8,
    )
    _wide_split[(blocks, programs)](
        q16,
        q_unscales,
        lc,
        ls,
        rc,
        rs,
        seq_start,
        seq_len,
        part_ctx,
        part_lse,
        batch,
        heads,
        heads_pad,
        programs,
        K=k,
        R=r,
        BP=triton_backend._pow2(batch),
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        MIN_TILES=MIN_TILES,
        CONTEXT_WARPS=CONTEXT_WARPS,
        PARTITION_REGS=PARTITION_REGS,
        PREFETCH_TILES=PREFETCH_TILES,
        num_warps=SCORES_WARPS,
    )
    return triton_backend.merge_partials(part_ctx, part_lse, seq_len, out, programs, BLOCK_N, MIN_TILES)
