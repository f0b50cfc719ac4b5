"""Decode attention over fp8 and rotated int4 code rows for 64 and more heads: warpgroup MMA on
sm_90, in Gluon.

On the H200 these kernels are faster than the ``mma.sync`` kernels of
:mod:`kvstore.gpu.cuda_backend` from 128k rows at 64 and 128 heads (CUDA-graph replays: fp8 9-22 %,
int4 25-35 %, so int4 now runs at fp8's speed or better), within 6 % of them at 32k rows, and match
the float64 reference within the same bound (docs/GPU.md, rounds 9 and 10). A CUDA backend left to
choose runs them for dense calls of 64+ heads on sm_90 when Triton is the release they are written
for, for captured calls and long plain calls
(:func:`kvstore.gpu.cuda_plan.wgmma_for_call`: a plain call pays their two Triton launches).

At 64 and more heads a decode step is bound by the tensor cores, not by the rows' bytes: per row,
2·H·(2K+R) flops against 584 bytes (fp8) or 296 (int4). One program holds 64 heads (a warpgroup
MMA's M) and a split of one sequence's rows, and its warps are specialized (Gluon's
``warp_specialize``):

* the **scores warpgroup** (4 warps, the default partition) scores each 64-row tile against the
  query (``query · tileᵀ``, both operands in shared memory: the query in f16 with a power-of-two
  scale per head, the tile's codes converted to f16, exact: e4m3 values or int4 levels), runs the
  online softmax, and hands the weights (f16, scaled by a power of two per tile) and the context's
  rescale to the context warpgroups through shared memory. Then, while they multiply, it fetches the
  next tile's codes (all its loads in flight at once; int4's go out before the softmax), converts
  them into the other slot of a two-slot ring once that slot is free, and asks L2 for the tile after
  next;
* the **context warpgroups** (8 warps, 256 of the 512 context dims each) keep the context in their
  accumulators: per tile, ``context = context x rescale + weights · tile``.

Triton gives every partition the same register budget (65536 / 384 threads = 168): the context
warpgroups need 154 for their 128 accumulators, which leaves no room for a third, producer
warpgroup (at 512 threads the budget is 128) and no shared memory for a raw-code ring beside the
query and the two f16 tiles (224 KB). So the scores warpgroup fetches, and it does so after its
softmax, when its score accumulators are dead: fetching during the score product measured a third
slower, and issuing the loads before it spilled.

The split plan is derived on the device from the lengths (as the f32 kernels of
:mod:`kvstore.gpu.triton_backend`), so a CUDA graph replays at any lengths; the caller stages the
query before (``mla_prep_query`` of the CUDA backend: f16 with power-of-two scales, rotated for
int4) and the partials are merged by :func:`kvstore.gpu.triton_backend.merge_partials` after.
int4 rows are attended in the rotated domain (FORMAT.md section 5), so their context comes out
rotated and the caller un-rotates it (``mla_unrotate``).

fp8 NaN codes (0x7F, 0xFF) read as 0 (FORMAT.md). Clearing them costs several instructions per
code word, so tiles are converted as they are; a NaN code makes its row's scores NaN for every
head, and a tile whose scores show one is converted again with the codes cleared and scored again,
before its weights go out.
"""

from __future__ import annotations

import numpy as np
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

from kvstore.formats import tq
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


def _int4_table() -> tuple[int, int, int, int]:
    """The 8 level magnitudes (``tq.LEVELS[8:]``) in f16, as the low bytes of levels 0-3 and 4-7
    and the high bytes of levels 0-3 and 4-7: four words a ``prmt`` looks four 3-bit indices up in."""
    halves = np.float16(tq.LEVELS[8:]).view(np.uint16).astype(np.uint32)
    lo, hi = halves & 0xFF, halves >> 8
    return tuple(int(sum(int(b[i]) << (8 * (i % 4)) for i in range(r, r + 4))) for b in (lo, hi) for r in (0, 4))


# int4 codes to their f16 levels by inline PTX, 8 codes (a 32-bit word, element 2k in byte k's low
# nibble) into the levels of the low nibbles ($0, $1) and of the high nibbles ($2, $3). Levels are
# symmetric: level[c] = mag[c - 8] for c >= 8, -mag[7 - c] below, so the magnitude index is c ^ 7
# or c & 7 and the sign goes in after the lookup.
_INT4 = gl.constexpr(
    """{ .reg .b32 neg, flip, j, jh, la, ha, lb, hb, n4, t, ta, tb, tc, td;
    mov.b32 ta, 0x%08X; mov.b32 tb, 0x%08X; mov.b32 tc, 0x%08X; mov.b32 td, 0x%08X;
    not.b32 neg, $4;
    and.b32 neg, neg, 0x88888888;
    shr.u32 flip, neg, 3;
    sub.u32 flip, neg, flip;
    xor.b32 j, $4, flip;
    and.b32 j, j, 0x77777777;
    shr.u32 jh, j, 16;
    prmt.b32 la, ta, tb, j;
    prmt.b32 ha, tc, td, j;
    prmt.b32 lb, ta, tb, jh;
    prmt.b32 hb, tc, td, jh;
    shl.b32 n4, neg, 4;
    prmt.b32 t, n4, neg, 0x5140;
    and.b32 t, t, 0x80808080;
    or.b32 ha, ha, t;
    prmt.b32 t, n4, neg, 0x7362;
    and.b32 t, t, 0x80808080;
    or.b32 hb, hb, t;
    prmt.b32 $0, la, ha, 0x6240;
    prmt.b32 $1, lb, hb, 0x6240;
    prmt.b32 $2, la, ha, 0x7351;
    prmt.b32 $3, lb, hb, 0x7351;
}"""
    % _int4_table()
)


@gluon.jit
def _int4_f16(raw, ROWS: gl.constexpr, BYTES: gl.constexpr):
    """int4 code bytes u8[ROWS, BYTES] to their levels f16[ROWS, 2 * BYTES] (exact in f16)."""
    even, odd = gl.inline_asm_elementwise(
        _INT4, "=r,=r,=r,=r,r", [raw], dtype=(gl.float16, gl.float16), is_pure=True, pack=4
    )
    return gl.reshape(gl.join(even, odd), [ROWS, 2 * BYTES])


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
def _prefetch_tile(lc, rc, start, n0, hi, LB: gl.constexpr, RB: gl.constexpr, BLOCK_N: gl.constexpr):
    """A tile's code rows (``LB`` and ``RB`` bytes each) into L2 ahead of its loads, when the tile
    starts before ``hi``."""
    PF: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if n0 < hi:
        _prefetch_l2(lc + (start + n0) * LB, BLOCK_N * LB // 128, PF)
        _prefetch_l2(rc + (start + n0) * RB, BLOCK_N * RB // 128, PF)


@gluon.jit
def _fetch_tile(rows, n0, K: gl.constexpr, R: gl.constexpr, BLOCK_N: gl.constexpr, INT4: gl.constexpr):
    """A tile's codes and row scales from global memory into registers, every load in flight at
    once (fp8: 74 registers, int4: 42): the rope codes, four quarters of the latent codes (each
    whole 128-byte swizzle blocks of the f16 tile), the latent and rope row scales (int4: radius /
    sqrtf(n), the unit of its levels)."""
    lc, ls, rc, rs, start, lo, hi = rows
    LB: gl.constexpr = K // 2 if INT4 else K  # code bytes of a row
    RB: gl.constexpr = R // 2 if INT4 else R
    QB: gl.constexpr = LB // 4
    RAW_L: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (QB // 16), QB // 16], [4, 1], [1, 0])
    RAW_R: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (RB // 16), RB // 16], [4, 1], [1, 0])
    SC: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    raw_r = _load_codes(rc, start, n0, hi, 0, RB, BLOCK_N, RB, RAW_R)
    raw0 = _load_codes(lc, start, n0, hi, 0, LB, BLOCK_N, QB, RAW_L)
    raw1 = _load_codes(lc, start, n0, hi, QB, LB, BLOCK_N, QB, RAW_L)
    raw2 = _load_codes(lc, start, n0, hi, 2 * QB, LB, BLOCK_N, QB, RAW_L)
    raw3 = _load_codes(lc, start, n0, hi, 3 * QB, LB, BLOCK_N, QB, RAW_L)
    n_s = n0 + gl.arange(0, BLOCK_N, layout=SC)
    s_l = gl.load(ls + start + n_s, mask=n_s < hi, other=0.0)
    s_r = gl.load(rs + start + n_s, mask=n_s < hi, other=0.0)
    if INT4:
        s_l = s_l / gl.sqrt_rn(gl.full([BLOCK_N], K, gl.float32, SC))
        s_r = s_r / gl.sqrt_rn(gl.full([BLOCK_N], R, gl.float32, SC))
    return raw_r, raw0, raw1, raw2, raw3, s_l, s_r


@gluon.jit
def _to_f16(raw, CLEAN: gl.constexpr, INT4: gl.constexpr, ROWS: gl.constexpr, BYTES: gl.constexpr):
    if INT4:
        return _int4_f16(raw, ROWS, BYTES)
    else:
        return _e4m3_f16(raw, CLEAN)


@gluon.jit
def _put_tile(fetched, ring_bufs, slot, K: gl.constexpr, R: gl.constexpr, CLEAN: gl.constexpr, INT4: gl.constexpr):
    """A fetched tile (:func:`_fetch_tile`) to f16 in ring slot ``slot``, with its row scales."""
    t_l, t_r, sc_sh = ring_bufs
    QC: gl.constexpr = K // 4
    ROWS: gl.constexpr = t_l.shape[1]
    QB: gl.constexpr = QC // 2 if INT4 else QC
    RB: gl.constexpr = R // 2 if INT4 else R
    raw_r, raw0, raw1, raw2, raw3, s_l, s_r = fetched
    dst_l = t_l.index(slot)
    t_r.index(slot).store(_to_f16(raw_r, CLEAN, INT4, ROWS, RB))
    dst_l.slice(0, QC, dim=1).store(_to_f16(raw0, CLEAN, INT4, ROWS, QB))
    dst_l.slice(QC, QC, dim=1).store(_to_f16(raw1, CLEAN, INT4, ROWS, QB))
    dst_l.slice(2 * QC, QC, dim=1).store(_to_f16(raw2, CLEAN, INT4, ROWS, QB))
    dst_l.slice(3 * QC, QC, dim=1).store(_to_f16(raw3, CLEAN, INT4, ROWS, QB))
    sc_sh.index(2 * slot).store(s_l)
    sc_sh.index(2 * slot + 1).store(s_r)


@gluon.jit
def _softmax_step(
    s_l, s_r, sc_sh, hand, q_unscales, state, n0, hi, j, ring, BLOCK_N: gl.constexpr, MMA_S: gl.constexpr
):
    """One tile's online-softmax step; the weights (f16) and the context's rescale go to the
    context warpgroups. ``state`` and the result: (peak, denom, unit), the context being held over
    ``unit``, the last tile's weight scale."""
    p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin = hand
    peak, denom, unit = state
    COL_S: gl.constexpr = gl.SliceLayout(0, MMA_S)
    sc_l = sc_sh.index(2 * ring).load(COL_S)
    sc_r = sc_sh.index(2 * ring + 1).load(COL_S)
    u_l, u_r = q_unscales
    s = s_l * sc_l[None, :] * u_l[:, None] + s_r * sc_r[None, :] * u_r[:, None]
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
def _fill_slot(fetched, ring_bufs, empty, j, K: gl.constexpr, R: gl.constexpr, INT4: gl.constexpr):
    """Tile j + 1 (fetched) into ring slot (j + 1) % 2 once the context warpgroups are done with
    tile j - 1 there: the ((j + 1) // 2)-th fill of a slot waits for its ((j - 1) // 2)-th release
    (none before the first: the parity of a fresh barrier's previous phase passes at once)."""
    slot = (j + 1) % 2
    mbarrier.wait(empty.index(slot), (((j + 1) // 2) & 1) ^ 1)
    _put_tile(fetched, ring_bufs, slot, K, R, False, INT4)
    fence_async_shared()
    gl.thread_barrier()


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
    INT4: gl.constexpr,
):
    """The scores warpgroup (see the module): per tile, scores, softmax, weights out; then the
    next tile into the ring. At the end the log2-sum-exp, and the context's normalization for the
    context warpgroups. ``query``, ``rows``, ``ring_bufs``, ``hand``, ``dest``: see :func:`_wide_split`."""
    q_l3, q_r3, q_unscales = query
    lc, ls, rc, rs, start, lo, hi = rows
    t_l, t_r, sc_sh = ring_bufs
    LB: gl.constexpr = K // 2 if INT4 else K  # code bytes of a row
    RB: gl.constexpr = R // 2 if INT4 else R
    p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin = hand
    hb, slot, programs, heads = dest
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA_S)
    peak = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    denom = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    unit = 1.0
    _prefetch_tile(lc, rc, start, lo + BLOCK_N, hi, LB, RB, BLOCK_N)
    _put_tile(_fetch_tile(rows, lo, K, R, BLOCK_N, INT4), ring_bufs, 0, K, R, False, INT4)
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
        if INT4:
            # int4's loads take 42 registers, which fit beside the score accumulators: the next
            # tile's go out before the softmax and land during it (ptxas places them after the
            # product's wait), 5-7 % faster than after it. fp8's 74 spilled here (round 9), and
            # half of them here measured 5-7 % slower at 128 heads.
            _prefetch_tile(lc, rc, start, n0 + PREFETCH_TILES * BLOCK_N, hi, LB, RB, BLOCK_N)
            ahead = _fetch_tile(rows, n0 + BLOCK_N, K, R, BLOCK_N, INT4)
        s_l, s_r = warpgroup_mma_wait(0, deps=[s_l, s_r])
        if not INT4 and redo == 0 and gl.max(gl.max(gl.where((s_l != s_l) | (s_r != s_r), 1, 0), 1), 0) > 0:
            # the slot is this warpgroup's until the tile's weights go out
            _put_tile(_fetch_tile(rows, n0, K, R, BLOCK_N, INT4), ring_bufs, ring, K, R, True, INT4)
            fence_async_shared()
            gl.thread_barrier()
            redo = 1
        else:
            redo = 0
            peak, denom, unit = _softmax_step(
                s_l, s_r, sc_sh, hand, q_unscales, (peak, denom, unit), n0, hi, j, ring, BLOCK_N, MMA_S
            )
            # while the context warpgroups multiply this tile, the next into the other slot once
            # they are done with it (tile j - 1)
            if INT4:
                if j + 1 < n_tiles:
                    _fill_slot(ahead, ring_bufs, empty, j, K, R, INT4)
            else:
                # (after the last tile too, masked: skipping it measured 3 % slower for fp8)
                _prefetch_tile(lc, rc, start, n0 + PREFETCH_TILES * BLOCK_N, hi, LB, RB, BLOCK_N)
                _fill_slot(_fetch_tile(rows, n0 + BLOCK_N, K, R, BLOCK_N, INT4), ring_bufs, empty, j, K, R, INT4)
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
    qmul,
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
    INT4: gl.constexpr,
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
        q_mul = qmul + (b * heads_pad + hs).to(gl.int64) * 2
        q_unscales = (gl.load(q_mul), gl.load(q_mul + 1))
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
        query = (q_l3, q_r3, q_unscales)
        rows = (lc, ls, rc, rs, start, lo, hi)
        ring_bufs = (t_l, t_r, sc_sh)
        hand = (p_sh, alpha_sh, fin_sh, empty, p_full, p_empty, fin)
        dest = (hb, slot, programs, heads)
        gl.warp_specialize(
            [
                (
                    _scores_partition,
                    (query, rows, ring_bufs, hand, dest, part_lse, K, R, BLOCK_H, BLOCK_N, PREFETCH_TILES, INT4),
                ),
                (_context_partition, (ring_bufs, hand, lo, hi, dest, part_ctx, K, BLOCK_H, BLOCK_N)),
            ],
            [CONTEXT_WARPS],
            [PARTITION_REGS],
        )


@gluon.jit
def _add(a, b):
    return a + b


def wide_decode(q16, qmul, lc, ls, rc, rs, seq_start, seq_len, out, *, n_sm: int, int4: bool = False):
    """fp8 or rotated int4 rows, 64+ heads: the split and merge kernels. ``q16`` f16[B, Hp, K + R]
    and ``qmul`` f32[B, Hp, 2] are the query staged by ``mla_prep_query`` (per head: f16 with a
    power-of-two scale, the latent's and the rope's factors back to log2 units; rotated for int4),
    Hp a multiple of 64; ``out`` f32[B, H, K] gets the context (for int4 still rotated)."""
    batch, heads, k = out.shape
    r = q16.shape[2] - k
    heads_pad = q16.shape[1]
    if lc.shape[0] == 0:
        return out.zero_()
    device = q16.device
    programs = triton_backend.programs_for(batch, heads, n_sm, BLOCK_H, PROGRAMS_PER_SM)
    part_ctx = torch.empty((heads, programs, k), dtype=torch.float32, device=device)
    part_lse = torch.empty((heads, programs), dtype=torch.float32, device=device)
    _wide_split[(heads_pad // BLOCK_H, programs)](
        q16,
        qmul,
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
        INT4=bool(int4),
        num_warps=SCORES_WARPS,
    )
    return triton_backend.merge_partials(part_ctx, part_lse, seq_len, out, programs, BLOCK_N, MIN_TILES)
