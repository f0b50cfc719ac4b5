"""The routed experts at decode sizes on CUDA: Triton kernels that read each hit expert's weights once.

A decode step carries one token per session (1-16 of them), each routed to its top-k experts: a hit
expert sees one to a few tokens, so its three products are matrix-vector products whose time is
reading that expert's weights. torch's grouped GEMM (CUTLASS, tiled for large M) read them at 55%
of the H200's copy bandwidth with 16 tokens, and sorting the pairs by expert for it (argsort,
scatter, cumsum, two gathers) cost more than the products with one token (``bench/engine_experts.py``).
Here nothing is sorted: each program reads the (token, expert) pairs' expert ids (at most
``MAX_PAIRS``) and picks out its own expert's pairs in registers.

1. ``GATE_UP``: one program per (expert, block of ``BLOCK_N`` intermediate columns) multiplies the
   rows of its expert's tokens by the gate rows and the up rows of its block and writes
   ``silu(gate) * up`` at each pair's place: f32 sums, one rounding to the model's dtype (the
   grouped path rounds gate and up first);
2. the down projection, the same kernel over those activations, each pair's output row at the
   pair's place, so a token's k outputs lie together for the weighted sum (one bmm, f32 sums).

A layer's shared MLP runs in the same two kernels (``shared``): viewed as experts of the routed
ones' size (:func:`shared_as_experts`, no copy), chosen by every token with weight 1, so its
weights are read by these programs instead of three GEMMs and an elementwise kernel of its own, and
its output joins the weighted sum.

A program whose expert no pair chose returns after reading the ids, and nothing is read back to the
host: a step stays capturable in a CUDA graph, and ``torch.compile`` traces the kernels as
user-defined Triton kernels — or, where the step's kernels launch dependently
(``launches.OWN_KERNELS_DEPENDENT``), calls them through custom ops that launch them so, each
waiting for the grid ahead of it before it touches memory. With fewer pairs than experts (one V2-Lite token: 8 pairs, 66 experts
with the shared ones), :data:`COMPACT_GRID` launches one program row per pair instead of one per
expert: program row ``s`` takes the ``s``-th distinct expert of the pairs (first occurrences, in
pair order), so most of the grid's programs, which would only read the ids and return, are not
launched at all. The tiles were picked by ``bench/engine_experts.py --sweep`` on the
H200.

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (the CPU tests use it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.engine import launches, products
from kvstore.gpu.dependent import gdc_wait, launch_options

__all__ = ["BLOCK_M", "COMPACT_GRID", "FOLD_MAX_PAIRS", "MAX_PAIRS", "route", "routed_experts", "shared_as_experts"]

#: Pairs per program pass (the tensor-core product's smallest M); an expert with more loops.
BLOCK_M = 16
#: Output columns per program.
BLOCK_N = 64
#: Reduction slice per pipeline stage.
BLOCK_K = 128
#: Pipeline stages of the weight tiles.
STAGES = 4
#: Warps per program.
WARPS = 4
#: A step of one token (one session's decode) takes narrower column blocks and fewer stages: twice
#: the programs, each holding less shared memory, over the few experts it hits. In the compiled
#: step on an H100, +1.2-2.1% tokens/s at 1k and +1.1-1.4% at 32k, fp8 and int4, where 16 sessions
#: lost 0.3-1.2% with them (``bench/engine_ab.py --variant "expert_kernels.BLOCK_N=32
#: expert_kernels.STAGES=3"``), so steps of more tokens keep the tiles above.
ONE_TOKEN_BLOCK_N = 32
ONE_TOKEN_STAGES = 3
#: Most (token, expert) pairs the kernels take (every program scans them all): past this (prefill)
#: the grouped GEMM, which reuses each weight tile over many rows, is the faster.
MAX_PAIRS = 512
#: Most pairs (shared experts' included) for which the kernels also run the shared experts: up to
#: 16 V2-Lite tokens (6 + 2 pairs each) they beat the shared MLP's own GEMMs (1.11x one token, 1.22x
#: four, 1.03x sixteen on an H100), at 64 tokens they lose (0.85x: every program scans 512 pairs).
FOLD_MAX_PAIRS = 128
#: With fewer (token, expert) pairs than experts, one program row per pair, each taking one of the
#: distinct experts the pairs hold, rather than one per expert: +0.6-1.2% tokens/s single-stream on
#: an H100, fp8 and int4, 1k and 32k (``bench/engine_ab.py --variant "expert_kernels.COMPACT_GRID=0"``).
COMPACT_GRID = True


@triton.jit
def _experts_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    w2_ptr,
    out_ptr,
    ws_ptr,
    ws2_ptr,
    n_routed,
    n_pairs,
    top_k,
    n_out,
    n_in,
    stride_x,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_out,
    GATE_UP: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    COMPACT: tl.constexpr,
    WAIT: tl.constexpr,
):
    if WAIT:  # launched dependently: nothing is touched before the grid ahead is done
        gdc_wait()  # pyright: ignore[reportOptionalCall]  (WAIT only where it exists)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    p = tl.arange(0, PAIRS)
    live = p < n_pairs
    ids = tl.load(ids_ptr + p, mask=live, other=-1)
    if COMPACT:
        # program row s: the s-th distinct expert of the pairs, by first occurrence ([PAIRS, PAIRS]
        # compares; PAIRS < the expert count here), or none (-1: no pair is its) past the last
        earlier = (ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None])
        first = live & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
        order = tl.cumsum(first.to(tl.int32), axis=0) - 1
        expert = tl.max(tl.where(first & (order == tl.program_id(0)), ids, -1), axis=0)
    else:
        expert = tl.program_id(0)
    # this expert's pairs, in pair order: rank[p] is pair p's place among them
    mine = (live & (ids == expert)).to(tl.int32)
    count = tl.sum(mine, axis=0)
    rank = tl.cumsum(mine, axis=0) - 1
    ks = tl.arange(0, BLOCK_K)
    expert = tl.maximum(expert, 0)  # no pair's when it was -1 (count 0): only the pointers below see it
    # experts past the routed ones are the shared experts, read from their own tensors (views of the
    # shared MLP's weights: nothing is copied); every token chose them, as the ids say
    if expert < n_routed:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        w2_base = w2_ptr + expert.to(tl.int64) * stride_we
        w_offset = cols[:, None] * stride_wn + ks[None, :]
    else:
        w_base = ws_ptr + (expert - n_routed).to(tl.int64) * stride_wse
        w2_base = ws2_ptr + (expert - n_routed).to(tl.int64) * stride_wse
        w_offset = cols[:, None] * stride_wsn + ks[None, :]
    for m0 in range(0, count, BLOCK_M):  # pyright: ignore[reportArgumentType]  (a Triton loop bound is a tensor)
        r = m0 + tl.arange(0, BLOCK_M)
        row_ok = r < count
        hit = (mine[None, :] > 0) & (rank[None, :] == r[:, None])  # [BLOCK_M, PAIRS]: one hit per live row
        pair = tl.sum(tl.where(hit, p[None, :], 0), axis=1).to(tl.int64)
        src = pair // top_k if GATE_UP else pair  # a token's row of x, or the pair's activation row
        x_rows = x_ptr + src[:, None] * stride_x + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            if EVEN_K:
                x_mask = row_ok[:, None]
                w_mask = col_ok[:, None]
            else:
                k_ok = (k0 + ks) < n_in
                x_mask = row_ok[:, None] & k_ok[None, :]
                w_mask = col_ok[:, None] & k_ok[None, :]
            xv = tl.load(x_rows + k0, mask=x_mask, other=0.0)
            w = tl.load(w_base + w_offset + k0, mask=w_mask, other=0.0)
            acc = tl.dot(xv, tl.trans(w), acc)
            if GATE_UP:
                w2 = tl.load(w2_base + w_offset + k0, mask=w_mask, other=0.0)
                acc2 = tl.dot(xv, tl.trans(w2), acc2)
        if GATE_UP:
            acc = acc * tl.sigmoid(acc) * acc2
        tl.store(
            out_ptr + pair[:, None] * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def _project(x, ids, top_k, w, w2, ws, ws2, out, gate_up: bool, block_n: int, block_k: int, stages: int, warps: int):
    tiles = (gate_up, block_n, block_k, stages, warps)
    if launches.own_kernels_dependent(x.device):
        torch.ops.kvstore.experts_project_dependently(x, ids, top_k, w, w2, ws, ws2, out, *tiles)
    else:
        _launch(x, ids, top_k, w, w2, ws, ws2, out, *tiles, dependent=False)


@torch.library.custom_op("kvstore::experts_project_dependently", mutates_args=("out",))
def _project_dependently(
    x: torch.Tensor,
    ids: torch.Tensor,
    top_k: int,
    w: torch.Tensor,
    w2: torch.Tensor,
    ws: torch.Tensor,
    ws2: torch.Tensor,
    out: torch.Tensor,
    gate_up: bool,
    block_n: int,
    block_k: int,
    stages: int,
    warps: int,
) -> None:
    """The kernel launched with programmatic dependent launch (``launches.OWN_KERNELS_DEPENDENT``):
    an op of its own, so that a compiled region calls it as it is rather than tracing it into a
    plain launch."""
    _launch(x, ids, top_k, w, w2, ws, ws2, out, gate_up, block_n, block_k, stages, warps, dependent=True)


def _launch(x, ids, top_k, w, w2, ws, ws2, out, gate_up, block_n, block_k, stages, warps, *, dependent: bool):
    n_experts, n_out, n_in = w.shape
    n_pairs = ids.numel()
    rows = n_experts + ws.shape[0]
    compact = COMPACT_GRID and n_pairs < rows
    _experts_kernel[(n_pairs if compact else rows, triton.cdiv(n_out, block_n))](
        x,
        ids,
        w,
        w2,
        out,
        ws,
        ws2,
        n_experts,
        n_pairs,
        top_k,
        n_out,
        n_in,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        ws.stride(0),
        ws.stride(1),
        out.stride(0),
        GATE_UP=gate_up,
        PAIRS=max(16, triton.next_power_of_2(n_pairs)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=n_in % block_k == 0,
        COMPACT=compact,
        WAIT=dependent,
        num_stages=stages,  # pyright: ignore[reportCallIssue]  (launch options, not kernel parameters)
        num_warps=warps,  # pyright: ignore[reportCallIssue]
        **launch_options(dependent),
    )


def routed_experts(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t)`` over each token's experts
    ``e = top_idx[t, j]``; ids ``E ..`` are the ``shared`` experts.

    Parameters
    ----------
    x : [T, hidden] (rows contiguous)
    top_idx : int[T, k] expert of each pair, T * k <= MAX_PAIRS
    weights : [T, k] routing weights
    gate, up : [E, I, hidden] (may be the two halves of one tensor); down : [E, hidden, I]
    shared : the shared experts as experts of the same shape, (gate [S, I, hidden], up [S, I,
        hidden], down [S, hidden, I]) — :func:`shared_as_experts` views a shared MLP's weights so;
        each token's routes then end with their columns, ids ``E .. E + S - 1`` and weight 1
        (:func:`route` with ``n_shared``, or :func:`kvstore.engine.moe.with_shared_columns`)
    block_n, block_k, stages, warps : the kernels' tiles (the benchmark's sweep varies them); by
        default the module's ``BLOCK_N``, ``BLOCK_K``, ``STAGES`` and ``WARPS`` as they are at the call
        (``ONE_TOKEN_BLOCK_N`` and ``ONE_TOKEN_STAGES`` for one token), so ``bench/engine_ab.py
        --variant "expert_kernels.BLOCK_N=32"`` reaches a compiled step

    Returns
    -------
    [T, hidden] in ``x``'s dtype
    """
    t, k = top_idx.shape
    inter, hidden = gate.shape[1], gate.shape[2]
    if shared is None:
        shared = (gate[:0], up[:0], down[:0])
    s_gate, s_up, s_down = shared
    if t * k > MAX_PAIRS:
        raise ValueError(f"{t * k} (token, expert) pairs: the decode kernels take at most {MAX_PAIRS}")
    if gate.stride() != up.stride() or gate.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("gate and up must share one layout, and every weight row must be contiguous")
    if (
        s_gate.shape[1:] != gate.shape[1:]
        or s_down.shape[1:] != down.shape[1:]
        or s_gate.stride() != s_up.stride()
        or s_gate.stride(-1) != 1
        or s_down.stride(-1) != 1
    ):
        raise ValueError("the shared experts must have the routed ones' shapes, gate and up one layout")
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = top_idx.reshape(-1).contiguous()
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    one = t == 1
    tiles = (
        block_n or (ONE_TOKEN_BLOCK_N if one else BLOCK_N),
        block_k or BLOCK_K,
        stages or (ONE_TOKEN_STAGES if one else STAGES),
        warps or WARPS,
    )
    _project(x, ids, k, gate, up, s_gate, s_up, act, True, *tiles)
    y = torch.empty((t * k, hidden), dtype=x.dtype, device=x.device)
    _project(act, ids, k, down, down, s_down, s_down, y, False, *tiles)
    # each token's k outputs weighted and summed (f32 accumulation, one rounding): in a compiled
    # step a reduction that fuses with what follows, else one bmm
    if products.as_reduction(x, any_tokens=True):
        return products.weighted_sum(weights.to(y.dtype), y.view(t, k, hidden))
    return torch.bmm(weights.to(y.dtype)[:, None, :], y.view(t, k, hidden))[:, 0]


def shared_as_experts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, inter: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shared MLP's weights (gate, up [S * inter, hidden], down [hidden, S * inter]) viewed as
    ``S`` experts of intermediate size ``inter`` — gate, up [S, inter, hidden], down [S, hidden,
    inter] — for :func:`routed_experts`' ``shared``: the MLP splits into S column blocks whose
    outputs add up to its own. Views, nothing copied."""
    hidden = gate.shape[1]
    if gate.shape[0] % inter or down.shape != (hidden, gate.shape[0]):
        raise ValueError(f"a shared MLP of {gate.shape[0]} columns is not a whole number of experts of {inter}")
    n = gate.shape[0] // inter
    as_experts = (gate.view(n, inter, hidden), up.view(n, inter, hidden))
    return (*as_experts, down.as_strided((n, hidden, inter), (inter, down.stride(0), down.stride(1))))


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    n_experts,
    stride_l,
    scale,
    TOP_K: tl.constexpr,
    N_SHARED: tl.constexpr,
    E_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    WAIT: tl.constexpr,
):
    if WAIT:  # launched dependently (as the experts' kernels)
        gdc_wait()  # pyright: ignore[reportOptionalCall]  (WAIT only where it exists)
    t = tl.program_id(0)
    e = tl.arange(0, E_BLOCK)
    ok = e < n_experts
    scores = tl.sigmoid(tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0))
    choice = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    if TOPK_GROUP < N_GROUP:  # group-limited: keep the experts of the groups whose two best sum highest
        per_group: tl.constexpr = E_BLOCK // N_GROUP
        grouped = tl.reshape(choice, (N_GROUP, per_group))
        j = tl.arange(0, per_group)
        best = tl.max(grouped, axis=1)
        first = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), grouped), axis=1)
        group_scores = best + second  # pyright: ignore[reportOperatorIssue]  (Triton tensors)
        g = tl.arange(0, N_GROUP)
        kept = tl.zeros((N_GROUP,), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):  # pyright: ignore[reportGeneralTypeIssues]  (a Triton loop)
            pick = tl.argmax(group_scores, axis=0)
            kept = tl.where(g == pick, 1, kept)
            group_scores = tl.where(g == pick, float("-inf"), group_scores)
        keep = tl.reshape(tl.broadcast_to(kept[:, None], (N_GROUP, per_group)), (E_BLOCK,))
        choice = tl.where(keep > 0, choice, float("-inf"))
    kk = tl.arange(0, K_BLOCK)
    chosen = tl.zeros((K_BLOCK,), dtype=tl.int64)
    picked = tl.zeros((K_BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # pyright: ignore[reportGeneralTypeIssues]  (the k best, one at a time)
        pick = tl.argmax(choice, axis=0)
        chosen = tl.where(kk == slot, pick.to(tl.int64), chosen)
        picked = tl.where(kk == slot, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), picked)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        picked = picked / (tl.sum(picked, axis=0) + 1e-20)
    picked = picked * scale
    # the shared experts follow, weight 1 (the experts' kernels run them as experts)
    chosen = tl.where((kk >= TOP_K) & (kk < TOP_K + N_SHARED), n_experts + kk - TOP_K, chosen)
    picked = tl.where((kk >= TOP_K) & (kk < TOP_K + N_SHARED), 1.0, picked)
    width: tl.constexpr = TOP_K + N_SHARED
    tl.store(ids_ptr + t * width + kk, chosen, mask=kk < width)
    tl.store(weights_ptr + t * width + kk, picked, mask=kk < width)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scale: float = 1.0,
    n_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's routing in one kernel: sigmoid scores, the group-limited top-k of the
    bias-corrected scores, their raw scores as weights (normalized when ``norm``) times ``scale`` —
    what :class:`kvstore.engine.moe.Router` computes from its logits — and, after each token's
    ``top_k`` experts, the ``n_shared`` shared experts (ids ``E ..``, weight 1).

    Parameters
    ----------
    logits : f32[T, E] (the router's products); bias : f32[E]

    Returns
    -------
    ids int64[T, top_k + n_shared] (each token's experts in descending order of choice), weights
    f32[T, top_k + n_shared]
    """
    t, n_experts = logits.shape
    if n_experts % n_group or not 0 < top_k <= n_experts:
        raise ValueError(f"{n_experts} experts cannot be routed top-{top_k} in {n_group} groups")
    e_block = triton.next_power_of_2(n_experts)
    if topk_group < n_group and (e_block != n_experts or n_group & (n_group - 1)):
        raise ValueError("group-limited routing here needs a power-of-two count of experts and of groups")
    width = top_k + n_shared
    ids = torch.empty((t, width), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, width), dtype=torch.float32, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    options = (top_k, n_shared, e_block, max(2, triton.next_power_of_2(width)), n_group, topk_group, bool(norm))
    if launches.own_kernels_dependent(logits.device):
        torch.ops.kvstore.route_dependently(logits, bias, ids, weights, float(scale), *options)
    else:
        _launch_route(logits, bias, ids, weights, float(scale), *options, dependent=False)
    return ids, weights


@torch.library.custom_op("kvstore::route_dependently", mutates_args=("ids", "weights"))
def _route_dependently(
    logits: torch.Tensor,
    bias: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    top_k: int,
    n_shared: int,
    e_block: int,
    k_block: int,
    n_group: int,
    topk_group: int,
    norm: bool,
) -> None:
    """The routing kernel launched with programmatic dependent launch (see :func:`_project_dependently`)."""
    options = (top_k, n_shared, e_block, k_block, n_group, topk_group, norm)
    _launch_route(logits, bias, ids, weights, scale, *options, dependent=True)


def _launch_route(
    logits, bias, ids, weights, scale, top_k, n_shared, e_block, k_block, n_group, topk_group, norm, *, dependent: bool
):
    _route_kernel[(logits.shape[0],)](
        logits,
        bias,
        ids,
        weights,
        logits.shape[1],
        logits.stride(0),
        scale,
        TOP_K=top_k,
        N_SHARED=n_shared,
        E_BLOCK=e_block,
        K_BLOCK=k_block,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        NORM=norm,
        WAIT=dependent,
        num_warps=1,  # pyright: ignore[reportCallIssue]
        **launch_options(dependent),
    )
