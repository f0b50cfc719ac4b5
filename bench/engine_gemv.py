"""The attention's projections at decode sizes on a CUDA device: the Triton kernel of
:mod:`kvstore.engine.gemv_kernels` (the input norm folded in) against inductor's reduction (what a
compiled step takes today: ``products.project_rows`` under ``torch.compile`` with the regions'
options) and cuBLAS (``F.linear`` after the norm), and all three against the copy bandwidth measured
in the same run.

Per V2-Lite shape (the fused input projection with its norm, 3,648 x 2,048; ``o_proj``, 2,048 x
2,048) and token count: µs per call replayed from a CUDA graph and per plain call, the weight's
bytes over that time as a share of the copy bandwidth, and the relative error against a float64
product of the same normed rows. Each call reads another copy of the weight (``--layers`` copies,
more than L2 holds), as a step's layers do.

    python bench/engine_gemv.py            # the table
    python bench/engine_gemv.py --sweep    # also the kernel's tiles (1 token), best first
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys

import torch
import torch.nn.functional as F

from kvstore.engine import gemv_kernels, products
from kvstore.engine.model import region_compile_options

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_attention import _events_ms, copy_bandwidth  # noqa: E402

#: (name, output rows, input columns, the input norm folded in, a bias)
SHAPES = [("input norm + q|kv_a", 3648, 2048, True, False), ("o_proj", 2048, 2048, False, False)]
#: calls per captured graph
CALLS = 27
EPS = 1e-6


def replayed_us(calls) -> float:
    """µs per call of the ``calls`` (callables) captured in turn into one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:  # compile, warm the allocator
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return 1e3 * statistics.median(_events_ms(graph.replay, reps=20)) / len(calls)


def plain_us(calls) -> float:
    """µs per call of the ``calls`` launched one after another from Python."""

    def all_calls() -> None:
        for call in calls:
            call()

    return 1e3 * statistics.median(_events_ms(all_calls, reps=10)) / len(calls)


def _kernel_call(x, norm, w):
    return gemv_kernels.project(x, w, norm=norm, eps=EPS)


def _reduction_call(compiled, x, w):
    return compiled(x, w)


def _cublas_call(normed, x, w):
    return F.linear(normed(x), w)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, default=8, help="copies of each weight, read in turn")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine_gemv: needs a CUDA device")
        return 0
    cuda = torch.device("cuda")
    bandwidth = copy_bandwidth()
    print(f"engine_gemv: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'shape':22s} {'tokens':>6s}  {'path':24s} {'graph µs':>9s} {'of copy':>8s} {'plain µs':>9s}  rel err")
    gen = torch.Generator().manual_seed(0)
    compiled = {}
    for name, n, k, with_norm, _ in SHAPES:
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(cuda, torch.bfloat16) for _ in range(args.layers)]
        g = (torch.rand(k, generator=gen) + 0.5).to(cuda, torch.bfloat16)
        n_bytes = n * k * 2

        def normed(x: torch.Tensor, g: torch.Tensor = g, with_norm: bool = with_norm, k: int = k) -> torch.Tensor:
            if not with_norm:
                return x
            return g * F.rms_norm(x.float(), (k,), eps=EPS).to(x.dtype)  # RMSNorm's CUDA path

        def reduction(x, w, normed=normed):
            return products.project_rows(normed(x), w)

        compiled[name] = torch.compile(reduction, options=region_compile_options(cuda), dynamic=False)
        for tokens in args.tokens:
            x = torch.randn(tokens, k, generator=gen).to(cuda, torch.bfloat16)
            want = normed(x).double() @ weights[0].double().T
            norm = g if with_norm else None
            paths = {
                "kernel (gemv_kernels)": functools.partial(_kernel_call, x, norm),
                "inductor reduction": functools.partial(_reduction_call, compiled[name], x),
                "cuBLAS after the norm": functools.partial(_cublas_call, normed, x),
            }
            for path, call in paths.items():
                err = float((call(weights[0]).double() - want).norm() / want.norm())
                calls = [functools.partial(call, weights[i % len(weights)]) for i in range(CALLS)]
                graph, plain = replayed_us(calls), plain_us(calls)
                share = n_bytes / (graph * 1e-6) / bandwidth
                print(f"{name:22s} {tokens:6d}  {path:24s} {graph:9.2f} {share:8.1%} {plain:9.2f}  {err:.1e}")
        if args.sweep:
            x = torch.randn(1, k, generator=gen).to(cuda, torch.bfloat16)
            rows = []
            for bn, bk, warps, stages in itertools.product([4, 8, 16, 32], [128, 256, 512, 1024], [2, 4, 8], [2, 3]):
                tiles = dict(block_n=bn, block_k=bk, warps=warps, stages=stages)
                calls = [
                    functools.partial(
                        gemv_kernels.project, x, weights[i % len(weights)], norm=g if with_norm else None, **tiles
                    )
                    for i in range(CALLS)
                ]
                try:
                    rows.append((replayed_us(calls), tiles))
                except Exception as error:  # a tile that does not fit (registers, shared memory)
                    print(f"  {tiles}: {type(error).__name__}")
            rows.sort(key=lambda row: row[0])
            print(f"  {name}, 1 token, tiles best first (defaults {gemv_kernels.BLOCK_N} x {gemv_kernels.BLOCK_K}):")
            for us, tiles in rows[:8]:
                print(f"    {us:7.2f} µs  {n_bytes / (us * 1e-6) / bandwidth:6.1%}  {tiles}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
