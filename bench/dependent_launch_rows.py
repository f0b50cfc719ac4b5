"""Does programmatic dependent launch's overlap change any bit of a decode? (CUDA, sm_90+)

One tier per process: a tiny bf16 model's 48-token greedy decode through the compiled step in CUDA
graphs, alone and three sessions batched, built in turn as each BUILD names, then every pair of
builds compared bit for bit (tokens, and the first row where the ``.coli_kv`` rows differ):

    plain       the regions built without ``triton.enable_pdl`` (no waits in the code)
    pdl         built with it, the waits placed first (launches.wait_before_every_access), overlapped
    raw         built with it under inductor's own wait placement
    nowait      built with it and every wait planted out (the early triggers kept)
    <build>-seq the kernels of <build>, launched without the attribute (Triton's launcher told to
                drop it): nothing overlaps, the waits return at once

``pdl``, ``raw`` and ``nowait`` patch inductor process-wide, so they do not mix in one process; give
each process its own inductor cache (``TORCHINDUCTOR_CACHE_DIR``), since the placement is patched code
that a cached graph would not reflect (the engine keys its own; these builds do not).

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_pdl python3 bench/dependent_launch_rows.py fp8 pdl pdl-seq plain
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_raw python3 bench/dependent_launch_rows.py fp8 raw raw-seq
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch._dynamo

from kvstore.engine import launches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_waits import DroppedLaunches, greedy_rows  # noqa: E402 - the decode and launcher the GPU tests use


def first_difference(a: np.ndarray, b: np.ndarray) -> str:
    if len(a) != len(b):
        return f"{len(a)} against {len(b)} rows"
    differ = np.nonzero(a != b)[0]
    return "same" if differ.size == 0 else f"row {differ[0]} of {len(a)} ({differ.size} differ)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tier", choices=["fp8", "int4"])
    parser.add_argument("builds", nargs="+", help="plain, pdl, raw, nowait, each optionally with -seq")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args(argv)
    kinds = {b.removesuffix("-seq") for b in args.builds}
    if len(kinds - {"plain"}) > 1:
        parser.error("pdl, raw and nowait patch inductor process-wide: one of them per process")
    if "raw" in kinds or "nowait" in kinds:
        launches.wait_before_every_access = lambda: True  # inductor's own placement stays
    if "nowait" in kinds:
        from torch._inductor.codegen.triton import TritonKernel

        TritonKernel._handle_pdl_before_access = lambda self, *a, **k: None
    import triton.backends.nvidia.driver as driver

    dropped = DroppedLaunches()
    driver.CudaLauncher.launch_pdl = dropped.launch_pdl()
    runs = {}
    for build in args.builds:
        started = time.perf_counter()
        launches.DEPENDENT_LAUNCH = not build.startswith("plain")
        dropped.plain, dropped.dropped = build.endswith("-seq"), 0
        torch._dynamo.reset()
        runs[build] = greedy_rows(args.tier, args.steps)
        print(
            f"{args.tier} {build}: {time.perf_counter() - started:.0f} s, "
            f"launches with the attribute dropped: {dropped.dropped}",
            flush=True,
        )
    names = list(runs)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            a, b = runs[x], runs[y]
            batch = "; ".join(first_difference(p, q) for p, q in zip(a[3], b[3]))
            print(
                f"{args.tier} {x} against {y}: alone tokens {'same' if a[0] == b[0] else 'differ'}, "
                f"rows {first_difference(a[1], b[1])}; batched tokens {'same' if a[2] == b[2] else 'differ'}, "
                f"rows {batch}"
            )


if __name__ == "__main__":
    main()
