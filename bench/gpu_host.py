"""Host time of a plain (not graph-captured) decode-attention call, per backend, on one CUDA GPU.

What an engine that does not capture its step pays per call and layer: ``N`` back-to-back calls
timed with ``time.perf_counter`` and one synchronization at the end, so the figure is the host's
cost whenever it exceeds the kernels' (``--calls``, default 1,000). Each call makes its
``LatentBatch`` as a caller does: checked, ranges included (``checked``: one synchronization), or
trusted (``plain``: nothing checked, a cached launch plan replayed), and trusted with the plans off
(``no plan``). Beside them, the same calls' GPU time replayed from a CUDA graph, which is what a
captured step pays. Usage::

    PYTHONPATH=. python3 bench/gpu_host.py [--rows 32768] [--heads 16] [--backends cuda,torch] [--profile]

``--profile`` prints the top functions of cProfile over the plain calls of each backend.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time

import torch

from kvstore.gpu import registry, testing


def host_us(fn, calls: int) -> float:
    """Microseconds per call of ``calls`` back-to-back calls, synchronized once at the end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def graph_us(fn, per_graph: int = 16) -> float:
    """Microseconds per call replayed from a CUDA graph of ``per_graph`` calls (median of 15)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(15):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / per_graph)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tiers", default="fp8,int4")
    parser.add_argument("--backends", default="cuda")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    print(
        f"{'backend':8s} {'tier':5s} {'H':>4s} {'T':>8s} {'checked us':>11s} {'plain us':>9s} {'no plan us':>10s} {'graph us':>9s}"
    )
    for name in args.backends.split(","):
        backend = registry.instance(name, torch.device("cuda"))
        for tier in args.tiers.split(","):
            if tier not in backend.spec.tiers:
                continue
            case = testing.make_case(tier, [args.rows], args.heads, device="cuda", seed=7, nan_rate=0.0)
            out = testing.poisoned_out(case)
            ref = testing.reference(case)
            testing.decode(case, out, backend=backend)
            err = testing.relative_error(out, ref)
            checked = host_us(functools.partial(testing.decode, case, out, backend), args.calls)
            call = functools.partial(testing.decode, case, out, backend, trusted=True)
            plain = host_us(call, args.calls)
            replaying = getattr(backend, "replay", None)
            if replaying:  # the same calls with cached launch plans off (CudaBackend.replay)
                backend.replay = False
                unplanned = host_us(call, args.calls)
                backend.replay = True
            else:
                unplanned = float("nan")
            replay = graph_us(call)
            print(
                f"{name:8s} {tier:5s} {args.heads:4d} {args.rows:8d} {checked:11.1f} {plain:9.1f} {unplanned:10.1f} {replay:9.1f}"
                f"   (rel err {err:.1e})",
                flush=True,
            )
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    call()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
                print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
