# Gluon kernels: pyright reads its DSL (constexpr parameters, layouts, static_range, Triton 3.6 names) as plain Python.
# pyright: reportArgumentType=false, reportAssignmentType=false, reportGeneralTypeIssues=false
# pyright: reportOperatorIssue=false, reportAttributeAccessIssue=false
"""Decode attention over fp8 and rotated int4 code rows for 64 and more heads: warpgroup MMA on
sm_90, in Gluon.

On the H200 these kernels are faster than the ``mma.sync`` kernels of
:mod:`kvstore.gpu.cuda_backend` from 128k rows at 64 and 128 heads (CUDA-graph replays: fp8 14-23 %,
int4 28-38 %, so int4 runs at fp8's speed or better), within 3 % or faster at 32k rows,
and match the float64 reference within the same bound (docs/GPU-LOG.md, rounds 9 to 11). A CUDA backend
left to choose runs them for dense calls of 64+ heads on sm_90 when Triton is the release they are
written for, for captured calls and long plain calls
(:func:`kvstore.gpu.cuda_plan.wgmma_for_call`: a plain call pays their two Triton launches).

At 64 and more heads a decode step is bound by the tensor cores, not by the rows' bytes: per row,
2·H·(2K+R) flops against 584 bytes (fp8) or 296 (int4). One program holds 64 heads (a warpgroup
MMA's M) and a split of one sequence's rows, and its four warpgroups are specialized (Gluon's
``warp_specialize``):

* the **producer warpgroup** loads each 64-row tile's codes into registers (all its loads in
  flight at once, the tile two ahead asked of L2), and once the context warpgroups are done with
  the slot's previous tile, converts them to f16 into that slot of a two-slot ring (exact: e4m3
  values with NaN codes read as 0, or int4 levels) and signals the slot full;
* the **scores warpgroup** (the default partition) scores each tile against the query
  (``query · tileᵀ``, both operands in shared memory: the query in f16 with a power-of-two scale
  per head), runs the online softmax, and hands the weights (f16, scaled by a power of two per
  tile) and the context's rescale to the context warpgroups through shared memory;
* the **context warpgroups** (256 of the 512 context dims each) keep the context in their
  accumulators: per tile, ``context = context x rescale + weights · tile``.

Registers: 512 threads leave 128 a thread, but each warpgroup's partition sets its own
(``setmaxnreg``): the context warpgroups 160 for their 128 accumulators, the producer 88 for a
fetched tile (fp8 74), the scores warpgroup the remaining 104. ptxas checks each instruction
against the kernel's 128, so the context product is issued as m64n128 instructions (an m64n256's
accumulators alone are 128 registers). Shared memory holds the query and the two f16 tiles (224
KB), so the codes come through the producer's registers rather than a ring of their own.

The split plan is derived on the device from the lengths (as the f32 kernels of
:mod:`kvstore.gpu.triton_backend`), so a CUDA graph replays at any lengths; the caller stages the
query before (``mla_prep_query`` of the CUDA backend: f16 with power-of-two scales, rotated for
int4) and the partials are merged by :func:`kvstore.gpu.triton_backend.merge_partials` after.
int4 rows are attended in the rotated domain (docs/FORMAT.md section 5), so their context comes out
rotated and the caller un-rotates it (``mla_unrotate``).

fp8 NaN codes (0x7F, 0xFF) read as 0 (docs/FORMAT.md): the producer clears them as it converts (six
instructions per word of four codes, off the scores warpgroup's path).
"""

from __future__ import annotations

from typing import Any, Callable

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
#: Warps of the producer warpgroup.
PRODUCER_WARPS = 4
#: Registers per thread of the context warpgroups (128 accumulators; 152 spill) and of the producer
#: (a fetched tile: fp8 74, int4 42); the scores warpgroup gets the rest of the 65536.
CONTEXT_REGS = 160
PRODUCER_REGS = 88
#: Programs per multiprocessor (each holds 226 KB of shared memory).
PROGRAMS_PER_SM = 1
#: Fewest tiles a split reads.
MIN_TILES = 1
#: How many tiles ahead the producer asks L2 for a tile's rows (3 measured the same as 2).
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
#: NaN codes (0x7F, 0xFF) cleared: t = a code's low 7 bits xor 0x7F (0 for NaN); (t + 0x7F) | t has
#: bit 7 set where t != 0, no carry crossing bytes; prmt spreads each byte's bit 7 over the byte
_E4M3 = gl.constexpr(
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
def _e4m3_f16(raw):
    """e4m3 codes to f16 (exact), NaN codes (0x7F, 0xFF) read as 0."""
    return gl.inline_asm_elementwise(_E4M3, "=r,=r,r", [raw], dtype=gl.float16, is_pure=True, pack=4)


def _int4_table() -> tuple[int, int, int, int]:
    """The 8 level magnitudes (``tq.LEVELS[8:]``) in f16, as the low bytes of levels 0-3 and 4-7
    and the high bytes of levels 0-3 and 4-7: four words a ``prmt`` looks four 3-bit indices up in."""
    halves = np.float16(tq.LEVELS[8:]).view(np.uint16).astype(np.uint32)
    lo, hi = halves & 0xFF, halves >> 8
    words = [int(sum(int(b[i]) << (8 * (i % 4)) for i in range(r, r + 4))) for b in (lo, hi) for r in (0, 4)]
    return words[0], words[1], words[2], words[3]


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
def _to_f16(raw, INT4: gl.constexpr, ROWS: gl.constexpr, BYTES: gl.constexpr):
    if INT4:
        return _int4_f16(raw, ROWS, BYTES)
    else:
        return _e4m3_f16(raw)


@gluon.jit
def _put_tile(fetched, ring_bufs, slot, K: gl.constexpr, R: gl.constexpr, INT4: gl.constexpr):
    """A fetched tile (:func:`_fetch_tile`) to f16 in ring slot ``slot``, with its row scales."""
    t_l, t_r, sc_sh = ring_bufs
    QC: gl.constexpr = K // 4
    ROWS: gl.constexpr = t_l.shape[1]
    QB: gl.constexpr = QC // 2 if INT4 else QC
    RB: gl.constexpr = R // 2 if INT4 else R
    raw_r, raw0, raw1, raw2, raw3, s_l, s_r = fetched
    dst_l = t_l.index(slot)
    t_r.index(slot).store(_to_f16(raw_r, INT4, ROWS, RB))
    dst_l.slice(0, QC, dim=1).store(_to_f16(raw0, INT4, ROWS, QB))
    dst_l.slice(QC, QC, dim=1).store(_to_f16(raw1, INT4, ROWS, QB))
    dst_l.slice(2 * QC, QC, dim=1).store(_to_f16(raw2, INT4, ROWS, QB))
    dst_l.slice(3 * QC, QC, dim=1).store(_to_f16(raw3, INT4, ROWS, QB))
    sc_sh.index(2 * slot).store(s_l)
    sc_sh.index(2 * slot + 1).store(s_r)


@gluon.jit
def _softmax_step(
    s_l, s_r, sc_sh, hand, q_unscales, state, n0, hi, j, ring, BLOCK_N: gl.constexpr, MMA_S: gl.constexpr
):
    """One tile's online-softmax step; the weights (f16) and the context's rescale go to the
    context warpgroups. ``state`` and the result: (peak, denom, unit), the context being held over
    ``unit``, the last tile's weight scale."""
    p_sh, alpha_sh, fin_sh, empty, full, p_full, p_empty, fin = hand
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
):
    """The scores warpgroup (see the module): per tile, once the producer has filled its slot,
    scores, softmax, weights out. At the end the log2-sum-exp, and the context's normalization for
    the context warpgroups. ``query``, ``rows``, ``ring_bufs``, ``hand``, ``dest``: see
    :func:`_wide_split`."""
    q_l3, q_r3, q_unscales = query
    lc, ls, rc, rs, start, lo, hi = rows
    t_l, t_r, sc_sh = ring_bufs
    p_sh, alpha_sh, fin_sh, empty, full, p_full, p_empty, fin = hand
    hb, slot, programs, heads = dest
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, MMA_S)
    peak = gl.full([BLOCK_H], float("-inf"), gl.float32, ROW_S)
    denom = gl.zeros([BLOCK_H], gl.float32, ROW_S)
    unit = 1.0
    for j in range(gl.cdiv(hi - lo, BLOCK_N)):
        n0 = lo + j * BLOCK_N
        ring = j % 2
        z = _opaque_zero(j)
        mbarrier.wait(full.index(ring), (j // 2) & 1)
        zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, MMA_S)
        s_l = warpgroup_mma(q_l3.index(z), t_l.index(ring).permute((1, 0)), zero, is_async=True)
        s_r = warpgroup_mma(q_r3.index(z), t_r.index(ring).permute((1, 0)), zero, is_async=True)
        s_l, s_r = warpgroup_mma_wait(0, deps=[s_l, s_r])
        peak, denom, unit = _softmax_step(
            s_l, s_r, sc_sh, hand, q_unscales, (peak, denom, unit), n0, hi, j, ring, BLOCK_N, MMA_S
        )
    fin_sh.store(unit / denom)
    mbarrier.arrive(fin)
    h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW_S)
    gl.store(part_lse + h_s.to(gl.int64) * programs + slot, peak + gl.log2(denom), mask=h_s < heads)


@gluon.jit
def _producer_partition(
    rows,
    ring_bufs,
    hand,
    K: gl.constexpr,
    R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PREFETCH_TILES: gl.constexpr,
    INT4: gl.constexpr,
):
    """The producer warpgroup: each tile's codes into registers as soon as the previous tile is
    stored (asking L2 for the tile ``PREFETCH_TILES`` after it), then, once the context warpgroups
    are done with the slot's previous tile, converted to f16 into the slot (fp8 NaN codes cleared)
    and handed to the scores warpgroup."""
    lc, ls, rc, rs, start, lo, hi = rows
    p_sh, alpha_sh, fin_sh, empty, full, p_full, p_empty, fin = hand
    LB: gl.constexpr = K // 2 if INT4 else K  # code bytes of a row
    RB: gl.constexpr = R // 2 if INT4 else R
    for i in gl.static_range(1, PREFETCH_TILES):
        _prefetch_tile(lc, rc, start, lo + i * BLOCK_N, hi, LB, RB, BLOCK_N)
    for t in range(gl.cdiv(hi - lo, BLOCK_N)):
        # fetched and stored in one iteration: codes carried over the loop's back edge would be
        # held a byte per register
        n0 = lo + t * BLOCK_N
        fetched = _fetch_tile(rows, n0, K, R, BLOCK_N, INT4)
        _prefetch_tile(lc, rc, start, n0 + PREFETCH_TILES * BLOCK_N, hi, LB, RB, BLOCK_N)
        ring = t % 2
        # the (t // 2)-th fill of a slot waits for its (t // 2 - 1)-th release (none before the
        # first: the parity of a fresh barrier's previous phase passes at once)
        mbarrier.wait(empty.index(ring), ((t // 2) & 1) ^ 1)
        _put_tile(fetched, ring_bufs, ring, K, R, INT4)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index(ring))


@gluon.jit
def _context_partition(
    ring_bufs, hand, lo, hi, dest, part_ctx, K: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr
):
    """The context warpgroups: context = context x rescale + weights · tile, per tile; at the end
    the normalized partial context in slot ``slot``."""
    t_l = ring_bufs[0]
    p_sh, alpha_sh, fin_sh, empty, full, p_full, p_empty, fin = hand
    hb, slot, programs, heads = dest
    # m64n128 instructions, two per warpgroup and step: ptxas checks an instruction's registers
    # against the kernel's cap (128 at 512 threads), an m64n256's 154 would not pass
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, K // 4, 16])
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
    CONTEXT_REGS: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
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
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(empty.index(i), count=1)
            mbarrier.init(full.index(i), count=1)
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
        hand = (p_sh, alpha_sh, fin_sh, empty, full, p_full, p_empty, fin)
        dest = (hb, slot, programs, heads)
        gl.warp_specialize(
            [
                (
                    _scores_partition,
                    (query, rows, ring_bufs, hand, dest, part_lse, K, R, BLOCK_H, BLOCK_N),
                ),
                (_context_partition, (ring_bufs, hand, lo, hi, dest, part_ctx, K, BLOCK_H, BLOCK_N)),
                (_producer_partition, (rows, ring_bufs, hand, K, R, BLOCK_N, PREFETCH_TILES, INT4)),
            ],
            [CONTEXT_WARPS, PRODUCER_WARPS],
            [CONTEXT_REGS, PRODUCER_REGS],
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
    # a launcher takes Triton's launch options (num_warps) beside the kernel's parameters
    split: Callable[..., Any] = _wide_split[(heads_pad // BLOCK_H, programs)]
    split(
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
        CONTEXT_REGS=CONTEXT_REGS,
        PRODUCER_WARPS=PRODUCER_WARPS,
        PRODUCER_REGS=PRODUCER_REGS,
        PREFETCH_TILES=PREFETCH_TILES,
        INT4=bool(int4),
        num_warps=SCORES_WARPS,
    )
    return triton_backend.merge_partials(part_ctx, part_lse, seq_len, out, programs, BLOCK_N, MIN_TILES)
