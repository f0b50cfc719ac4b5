"""The routed experts of one MoE layer at decode sizes, on a CUDA device: the Triton decode kernels
(:mod:`kvstore.engine.expert_kernels`) against torch's grouped GEMM on the same routes, and both
against the copy bandwidth measured in the same run.

Per case (geometry, tokens): the experts the routes hit, the bytes their weights hold (gate, up and
down of every hit expert: what a step must read), microseconds per call of the whole routed-experts
function replayed in a CUDA graph (sorting the pairs, the products, the weighted sum), that time as
a share of the copy bandwidth, and each path's relative error against an f32 per-expert loop.

    python bench/engine_experts.py            # the table (V2-Lite and V3 geometry, 1..64 tokens)
    python bench/engine_experts.py --sweep    # also the kernels' tiles on V2-Lite at 1 and 16 tokens
    python bench/engine_experts.py --shared   # also routed + shared experts: in the kernels vs apart

With ``--shared``, a second table times what a MoE layer's experts cost a decode step: the routed
kernels with the shared MLP as cuBLAS GEMMs of its own (gate and up as one, silu·up, down, the
sum), against the kernels running the shared experts too (``shared_as_experts``); bytes = the hit
experts' and the shared MLP's weights.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys

import torch
import torch.nn.functional as F

from kvstore.engine import expert_kernels
from kvstore.engine.moe import with_shared_columns

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_attention import _events_ms, copy_bandwidth  # noqa: E402

#: (name, experts, intermediate, hidden, experts per token)
GEOMETRIES = [("v2-lite", 64, 1408, 2048, 6), ("v3", 256, 2048, 7168, 8)]
#: shared experts of each geometry (of the routed experts' intermediate size)
SHARED = {"v2-lite": 2, "v3": 1}
TOKENS = (1, 4, 16, 64)
CALLS_PER_GRAPH = 10


def graph_us(fn) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, autotune nothing, warm the allocator
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return 1e3 * statistics.median(_events_ms(graph.replay, reps=20)) / CALLS_PER_GRAPH


def side_by_side(calls, ref, n_bytes: int, bw: float) -> tuple[list[float], list[float], list[float]]:
    """Each call's relative error against ``ref``, its µs per graph-replayed call, and the share of
    the copy bandwidth its ``n_bytes`` of weights make of that time (%)."""
    errs = [float((call().float() - ref).norm() / ref.norm()) for call in calls]
    times = [graph_us(call) for call in calls]
    return errs, times, [100 * n_bytes / (us * 1e-6) / bw for us in times]


def sweep_tiles(call, block_n, block_k, stages) -> list[tuple[float, dict[str, int]]]:
    """µs per graph-replayed ``call(**tiles)`` for every tile in the grid (4 warps), as (µs, tiles);
    a tile that does not fit is reported and left out."""
    rows = []
    for bn, bk, st in itertools.product(block_n, block_k, stages):
        tiles = dict(block_n=bn, block_k=bk, stages=st, warps=4)
        try:
            rows.append((graph_us(functools.partial(call, **tiles)), tiles))
        except Exception as exc:  # a tile that does not fit must not stop the sweep
            print(f"  sweep {tiles}: {type(exc).__name__}", flush=True)
    return rows


def grouped(x, top_idx, weights, gate_up, down):
    """The engine's grouped-GEMM path (RoutedExperts._grouped with gate and up fused)."""
    t, k = top_idx.shape
    inter = down.shape[2]
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    both = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(F.silu(both[:, :inter]) * both[:, inter:], down.transpose(1, 2), offs=offsets)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    return torch.bmm(weights.to(y.dtype)[:, None, :], y[inverse].view(t, k, -1))[:, 0]


def reference(x, top_idx, weights, gate_up, down):
    """f32 per-expert loop."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in top_idx.unique().tolist():
        tok, slot = (top_idx == e).nonzero(as_tuple=True)
        w = gate_up[e].float()
        h = xf[tok] @ w.T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (act @ down[e].float().T) * weights[tok, slot, None])
    return out


def routes(t: int, n_experts: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.stack([torch.randperm(n_experts, generator=gen, device="cuda")[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen, device="cuda")
    return top, weights


def measure(name, n_experts, inter, hidden, k, bw, sweep: bool) -> list[tuple]:
    """Print one table row per token count of this geometry; the sweep's rows, if asked."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate_up = (torch.randn(n_experts, 2 * inter, hidden, generator=gen, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(n_experts, hidden, inter, generator=gen, device="cuda") * 0.02).bfloat16()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    sweeps = []
    for t in TOKENS:
        top, weights = routes(t, n_experts, k, seed=t)
        x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
        hit = int(top.unique().numel())
        n_bytes = hit * 3 * inter * hidden * 2
        ref = reference(x, top, weights, gate_up, down)
        paths = (
            functools.partial(grouped, x, top, weights, gate_up, down),
            functools.partial(expert_kernels.routed_experts, x, top, weights, gate, up, down),
        )
        errs, (g_us, k_us), pct = side_by_side(paths, ref, n_bytes, bw)
        print(
            f"| {name} | {t} | {hit} | {n_bytes / 1e6:.0f} | {g_us:.1f} | {pct[0]:.0f}% | {k_us:.1f} | {pct[1]:.0f}% "
            f"| {g_us / k_us:.2f}x |  (rel err vs f32: grouped {errs[0]:.1e}, Triton {errs[1]:.1e})",
            flush=True,
        )
        if sweep and t in (1, 16):
            for us, tiles in sweep_tiles(paths[1], (32, 64, 128), (64, 128, 256), (3, 4, 5)):
                sweeps.append((t, us, *tiles.values(), 100 * n_bytes / (us * 1e-6) / bw))
    return sweeps


def measure_shared(name, n_experts, inter, hidden, k, n_shared, bw, sweep: bool) -> None:
    """Rows of the routed + shared table for this geometry (and, ``sweep``, the folded kernels' best
    tiles at 1 and 16 tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    gate_up = (torch.randn(n_experts, 2 * inter, hidden, generator=gen, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(n_experts, hidden, inter, generator=gen, device="cuda") * 0.02).bfloat16()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    s_gate_up = (torch.randn(2 * n_shared * inter, hidden, generator=gen, device="cuda") * 0.02).bfloat16()
    s_down = (torch.randn(hidden, n_shared * inter, generator=gen, device="cuda") * 0.02).bfloat16()
    s_gate, s_up = s_gate_up[: n_shared * inter], s_gate_up[n_shared * inter :]
    views = expert_kernels.shared_as_experts(s_gate, s_up, s_down, inter)

    def apart(x, top, weights, **tiles):
        both = F.linear(x, s_gate_up)
        shared = F.linear(F.silu(both[:, : n_shared * inter]) * both[:, n_shared * inter :], s_down)
        return expert_kernels.routed_experts(x, top, weights, gate, up, down, **tiles) + shared

    def folded(x, top, weights, **tiles):
        top, weights = with_shared_columns(top, weights, n_experts, n_shared)
        return expert_kernels.routed_experts(x, top, weights, gate, up, down, shared=views, **tiles)

    for t in TOKENS:
        if t * (k + n_shared) > expert_kernels.MAX_PAIRS:  # past the kernels' pairs: the layer keeps them apart
            continue
        top, weights = routes(t, n_experts, k, seed=t)
        x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
        hit = int(top.unique().numel())
        n_bytes = (hit + n_shared) * 3 * inter * hidden * 2
        xf = x.float()
        ref = reference(x, top, weights, gate_up, down) + (
            (F.silu(xf @ s_gate.float().T) * (xf @ s_up.float().T)) @ s_down.float().T
        )
        calls = [functools.partial(f, x, top, weights) for f in (apart, folded)]
        errs, (a_us, f_us), pct = side_by_side(calls, ref, n_bytes, bw)
        print(
            f"| {name} | {t} | {hit} + {n_shared} | {n_bytes / 1e6:.0f} | {a_us:.1f} | {pct[0]:.0f}% | {f_us:.1f} "
            f"| {pct[1]:.0f}% | {a_us / f_us:.2f}x |  (rel err vs f32: apart {errs[0]:.1e}, in the kernels {errs[1]:.1e})",
            flush=True,
        )
        if sweep and t in (1, 16):
            rows = sweep_tiles(calls[1], (16, 32, 64), (64, 128, 256), (2, 3, 4))
            for us, tiles in sorted(rows, key=lambda r: r[0])[:5]:
                print(
                    f"|   sweep, {t} tokens, in the kernels | {tiles} | {us:.1f} µs | {100 * n_bytes / (us * 1e-6) / bw:.0f}% |"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' tiles (V2-Lite, 1 and 16 tokens)")
    parser.add_argument("--geometries", nargs="+", default=[g[0] for g in GEOMETRIES])
    parser.add_argument("--shared", action="store_true", help="also routed + shared experts, in the kernels vs apart")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    print("| geometry | tokens | experts hit | MB of weights | grouped µs | % copy | Triton µs | % copy | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    sweeps = []
    for geometry in GEOMETRIES:
        if geometry[0] in args.geometries:
            sweeps += measure(*geometry, bw, args.sweep and geometry[0] == "v2-lite")
            torch.cuda.empty_cache()
    if args.shared:
        print(
            "\n| geometry | tokens | experts hit + shared | MB of weights | apart µs | % copy | in the kernels µs | % copy | speed-up |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for geometry in GEOMETRIES:
            if geometry[0] in args.geometries:
                measure_shared(*geometry, SHARED[geometry[0]], bw, args.sweep and geometry[0] == "v2-lite")
                torch.cuda.empty_cache()
    if sweeps:
        print("\n| tokens | block_n | block_k | stages | warps | µs | % copy |\n|---:|---:|---:|---:|---:|---:|---:|")
        for t in (1, 16):
            for row in sorted((r for r in sweeps if r[0] == t), key=lambda r: r[1])[:8]:
                print(f"| {t} | {row[2]} | {row[3]} | {row[4]} | {row[5]} | {row[1]:.1f} | {row[6]:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
