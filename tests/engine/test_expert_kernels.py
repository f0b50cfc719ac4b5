"""The routed experts' decode kernels (kvstore.engine.expert_kernels) on the CPU, through Triton's
interpreter (``TRITON_INTERPRET=1``, in a child process because the variable is read at import).

Against an f32 per-expert loop: one token, experts hit by more pairs than one pass takes, widths
that are not multiples of the tiles, experts no token chose, gate and up as separate tensors or as
halves of one, and a layer's shared MLP run by the same kernels as experts every token chose. The interpreter's bf16 products are wrong in Triton 3.x (a 16x16 bf16 ``tl.dot``
gives ~1e10 on random data), so here the dtypes are f32 and f16; bf16 runs on the GPU
(tests/engine/test_graphs.py).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_INTERPRETED = textwrap.dedent(
    """
    import json
    import torch
    import torch.nn.functional as F
    from kvstore.engine.expert_kernels import routed_experts, shared_as_experts
    from kvstore.engine.moe import with_shared_columns

    def loop(x, top, w, gate, up, down):
        out = torch.zeros(x.shape)
        for t in range(x.shape[0]):
            for j in range(top.shape[1]):
                e = int(top[t, j])
                h = F.silu(gate[e].float() @ x[t].float()) * (up[e].float() @ x[t].float())
                out[t] += w[t, j] * (down[e].float() @ h)
        return out

    report = []
    gen = torch.Generator().manual_seed(5)
    cases = [  # (tokens, experts, per token, intermediate, hidden, dtype, fused gate/up, tiles)
        (1, 8, 2, 64, 128, "float32", True, {}),
        (40, 4, 3, 48, 80, "float32", False, {"block_n": 32, "block_k": 32}),  # 30 pairs an expert
        (7, 16, 2, 40, 72, "float16", True, {"block_n": 16, "block_k": 64}),  # experts left unhit
        (3, 8, 8, 32, 64, "float16", False, {}),  # every expert, every token
    ]
    for t, e, k, inter, hidden, dtype, fused, tiles in cases:
        dt = getattr(torch, dtype)
        if fused:
            gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1).to(dt)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        else:
            gate = (torch.randn(e, inter, hidden, generator=gen) * 0.1).to(dt)
            up = (torch.randn(e, inter, hidden, generator=gen) * 0.1).to(dt)
        down = (torch.randn(e, hidden, inter, generator=gen) * 0.1).to(dt)
        x = torch.randn(t, hidden, generator=gen).to(dt)
        top = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        got = routed_experts(x, top, w, gate, up, down, **tiles)
        want = loop(x, top, w, gate, up, down)
        report.append({
            "case": f"T{t} E{e} k{k} I{inter} H{hidden} {dtype}",
            "dtype": str(got.dtype).removeprefix("torch."),
            "shape": list(got.shape),
            "err": float((got.float() - want).norm() / want.norm()),
        })
    # a shared MLP of S experts' width run by the kernels beside the routed experts: what the layer
    # computes is the routed sum plus the MLP's own output (an f32 MLP as the reference)
    for t, e, k, n_shared, inter, hidden, dtype in [(1, 8, 2, 2, 64, 128, "float32"), (5, 8, 3, 1, 48, 80, "float16")]:
        dt = getattr(torch, dtype)
        gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen) * 0.1).to(dt)
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        down = (torch.randn(e, hidden, inter, generator=gen) * 0.1).to(dt)
        s_gate_up = (torch.randn(2 * n_shared * inter, hidden, generator=gen) * 0.1).to(dt)  # one tensor, two halves
        s_gate, s_up = s_gate_up[: n_shared * inter], s_gate_up[n_shared * inter :]
        s_down = (torch.randn(hidden, n_shared * inter, generator=gen) * 0.1).to(dt)
        x = torch.randn(t, hidden, generator=gen).to(dt)
        top = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        routes = with_shared_columns(top, w, e, n_shared)
        got = routed_experts(x, *routes, gate, up, down, shared=shared_as_experts(s_gate, s_up, s_down, inter))
        xf = x.float()
        mlp = (F.silu(xf @ s_gate.float().T) * (xf @ s_up.float().T)) @ s_down.float().T
        want = loop(x, top, w, gate, up, down) + mlp
        report.append({
            "case": f"T{t} E{e} k{k} S{n_shared} I{inter} H{hidden} {dtype} shared",
            "dtype": str(got.dtype).removeprefix("torch."),
            "shape": list(got.shape),
            "err": float((got.float() - want).norm() / want.norm()),
            "shared_err": float((got.float() - loop(x, top, w, gate, up, down)).norm() / want.norm()),
        })
    # the routing kernel against the Router module (its logits handed over): the same experts per
    # token, the same weights; group-limited (tiny-like: 8 experts in 2 groups, 1 kept) and not
    from kvstore.engine.config import ModelConfig
    from kvstore.engine.expert_kernels import route
    from kvstore.engine.moe import Router

    for e, k, n_group, topk_group, norm, n_shared in [(8, 2, 2, 1, True, 1), (64, 6, 1, 1, False, 2), (16, 4, 4, 2, True, 0)]:
        cfg = ModelConfig(
            hidden_size=32, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=norm, routed_scaling_factor=2.5,
        )
        router = Router(cfg)
        with torch.no_grad():
            router.weight.normal_(generator=gen)
            router.e_score_correction_bias.normal_(generator=gen).mul_(0.1)
        x = torch.randn(9, 32, generator=gen)
        want_ids, want_w = router(x)
        ids, w = route(
            F.linear(x, router.weight), router.e_score_correction_bias, k, n_group=n_group, topk_group=topk_group,
            norm=norm, scale=2.5, n_shared=n_shared,
        )
        same = bool(torch.equal(ids[:, :k].sort(dim=1).values, want_ids.sort(dim=1).values))
        by_id = torch.zeros(9, e).scatter_(1, want_ids, want_w)
        report.append({
            "case": f"route E{e} k{k} groups {n_group}/{topk_group} norm {norm} shared {n_shared}",
            "dtype": "float32",
            "same_experts": same,
            "err": float((w[:, :k] - by_id.gather(1, ids[:, :k])).abs().max() / want_w.abs().max()),
            "shared_ids": ids[:, k:].tolist() == [list(range(e, e + n_shared))] * 9,
            "shared_weights": bool(torch.all(w[:, k:] == 1.0)),
        })
    print(json.dumps(report))
    """
)


@pytest.mark.parametrize("compact", [False, True], ids=["a-row-per-expert", "a-row-per-pair"])
def test_kernels_under_the_interpreter_match_the_f32_loop(compact):
    """Both grids: one program row per expert, and (expert_kernels.COMPACT_GRID) one per pair where
    the pairs are fewer than the experts (cases 1, 3 and the first shared one), each row taking one
    of the distinct experts the pairs hold."""
    script = f"import kvstore.engine.expert_kernels as _ek\n_ek.COMPACT_GRID = {compact}\n" + _INTERPRETED
    report = run_interpreted(script)
    assert len(report) == 9
    for row in report:
        if row["case"].startswith("route"):
            assert row["same_experts"] and row["shared_ids"] and row["shared_weights"], row
        bound = 1e-5 if row["dtype"] == "float32" else 2e-3  # f16: its rounding of act and of the output
        assert row["err"] < bound, row
        if "shared_err" in row:  # the shared experts' part is there: without it the answer is far off
            assert row["shared_err"] > 100 * bound, row


def test_mismatched_layouts_and_too_many_pairs_are_refused():
    import torch

    from kvstore.engine.expert_kernels import MAX_PAIRS, routed_experts

    w = torch.zeros(4, 8, 8)
    too_many = torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="at most"):
        routed_experts(torch.zeros(MAX_PAIRS + 1, 8), too_many, torch.ones(MAX_PAIRS + 1, 1), w, w, w)

    gate_up = torch.zeros(4, 16, 8)
    up = torch.zeros(4, 8, 8)  # contiguous [E, I, hidden]: strides differ from the fused half
    with pytest.raises(ValueError, match="layout"):
        routed_experts(
            torch.zeros(2, 8),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            gate_up[:, :8],
            up,
            torch.zeros(4, 8, 8),
        )

    from kvstore.engine.expert_kernels import shared_as_experts
    from kvstore.engine.moe import with_shared_columns

    with pytest.raises(ValueError, match="whole number"):  # 12 columns are not experts of 8
        shared_as_experts(torch.zeros(12, 8), torch.zeros(12, 8), torch.zeros(8, 12), 8)
    shared = shared_as_experts(torch.zeros(16, 8), torch.zeros(16, 8), torch.zeros(8, 16), 8)
    with pytest.raises(ValueError, match="at most"):  # the shared experts' pairs count too
        n = MAX_PAIRS // 3 + 1
        routes = with_shared_columns(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1), 4, 2)
        routed_experts(torch.zeros(n, 8), *routes, w, w, w, shared=shared)


def test_the_module_tiles_at_the_call_reach_both_kernels(monkeypatch):
    """The tiles default to the module's BLOCK_N, BLOCK_K, STAGES and WARPS as they are when the
    experts run — what a variant of bench/engine_ab.py sets — a step of one token to its own
    ONE_TOKEN_BLOCK_N and ONE_TOKEN_STAGES, and a caller's own tiles win."""
    import torch

    from kvstore.engine import expert_kernels

    launched = []
    monkeypatch.setattr(expert_kernels, "_project", lambda *args: launched.append(args[-4:]))
    monkeypatch.setattr(expert_kernels, "BLOCK_N", 32)
    monkeypatch.setattr(expert_kernels, "WARPS", 8)
    w = torch.zeros(4, 8, 8)
    x, top, weights = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    expert_kernels.routed_experts(x, top, weights, w, w, w)
    expert_kernels.routed_experts(x, top, weights, w, w, w, block_n=16, stages=2)
    tiles = (32, expert_kernels.BLOCK_K, expert_kernels.STAGES, 8)
    assert launched == [tiles, tiles, (16, tiles[1], 2, 8), (16, tiles[1], 2, 8)]
    launched.clear()
    monkeypatch.setattr(expert_kernels, "ONE_TOKEN_BLOCK_N", 16)
    monkeypatch.setattr(expert_kernels, "ONE_TOKEN_STAGES", 5)
    expert_kernels.routed_experts(x[:1], top[:1], weights[:1], w, w, w)
    expert_kernels.routed_experts(x[:1], top[:1], weights[:1], w, w, w, block_n=64, stages=2)
    one = (16, tiles[1], 5, 8)
    assert launched == [one, one, (64, tiles[1], 2, 8), (64, tiles[1], 2, 8)]


@pytest.mark.parametrize("kernel", ["experts", "route"])
def test_a_dependently_launched_kernel_waits_before_it_touches_memory(kernel):
    """Compiled by Triton for an H100/H200 target here (no GPU): with ``WAIT`` (how a dependent
    launch runs them, launches.OWN_KERNELS_DEPENDENT) the kernel's first PTX instruction that reads
    or writes global memory comes after its ``griddepcontrol.wait``, so it cannot read what the grid
    before it is still writing, nor overwrite what that grid still reads; without ``WAIT`` (a plain
    launch) it has none."""
    from kernel_waits import can_compile_for_sm90, compile_for_sm90, ptx_accesses_before_the_wait
    from kvstore.engine import expert_kernels

    if not can_compile_for_sm90():
        pytest.skip("this Triton has no ptxas")
    if kernel == "experts":
        fn = expert_kernels._experts_kernel
        types = {"ids_ptr": "*i64"}
        constants = dict(GATE_UP=True, PAIRS=16, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN_K=True, COMPACT=True)
        options = {"num_warps": 4, "num_stages": 4}
    else:
        fn = expert_kernels._route_kernel
        types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "scale": "fp32"}
        constants = dict(TOP_K=6, N_SHARED=2, E_BLOCK=64, K_BLOCK=8, N_GROUP=1, TOPK_GROUP=1, NORM=True)
        options = {"num_warps": 1}
    for wait in (True, False):
        ptx = compile_for_sm90(fn, types, {**constants, "WAIT": wait}, launch_pdl=wait, **options)["ptx"]
        if wait:
            assert ptx_accesses_before_the_wait(ptx) is None, kernel
        else:
            assert "griddepcontrol" not in ptx, kernel
