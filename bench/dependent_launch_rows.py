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
import time

import numpy as np
import torch
import torch._dynamo

from kvstore.engine import Engine, launches, preset, random_model
from kvstore.engine.batch import BatchSequence

CUDA = torch.device("cuda")


class _Launches:
    """Triton's CUDA launcher's ``launch_pdl``, made droppable: while ``plain`` is set, a launch
    that asked for the attribute goes without it (counted in ``dropped``)."""

    plain = False
    dropped = 0

    @classmethod
    def install(cls) -> None:
        import triton.backends.nvidia.driver as driver

        def launch_pdl(launcher):
            asked = launcher.__dict__.get("_launch_pdl", False)
            if asked and cls.plain:
                cls.dropped += 1
                return False
            return asked

        def ask(launcher, value):
            launcher.__dict__["_launch_pdl"] = value

        driver.CudaLauncher.launch_pdl = property(launch_pdl, ask)


def decode(tier: str, steps: int):
    cfg = preset("tiny-512")
    geometry = cfg.coli_geometry()
    rng = np.random.default_rng(5)
    prompt = rng.integers(2, cfg.vocab_size, 200)
    contexts = [rng.integers(2, cfg.vocab_size, n) for n in (40, 300, 1100)]
    model = random_model(cfg, seed=7, device=CUDA, dtype="bfloat16")
    engine = Engine(model, tier=tier)
    alone = engine.generate(prompt, max_new_tokens=steps, stop_tokens=())
    rows = engine.export_rows(0, engine.cache.length).record_array(geometry)
    batch = []
    for context in contexts:
        writer = Engine(model, tier=tier)
        writer.prefill(context[:-1])
        cache = engine.new_cache()
        cache.restore(writer.export_rows())
        batch.append(BatchSequence(cache, context[-1:]))
    together = engine.generate_batch(batch, max_new_tokens=steps, stop_tokens=())
    batch_rows = [seq.cache.export_rows().record_array(geometry) for seq in batch]
    return list(alone.tokens), rows, [list(t) for t in together.tokens], batch_rows


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
    _Launches.install()
    runs = {}
    for build in args.builds:
        started = time.perf_counter()
        launches.DEPENDENT_LAUNCH = not build.startswith("plain")
        _Launches.plain, _Launches.dropped = build.endswith("-seq"), 0
        torch._dynamo.reset()
        runs[build] = decode(args.tier, args.steps)
        print(
            f"{args.tier} {build}: {time.perf_counter() - started:.0f} s, "
            f"launches with the attribute dropped: {_Launches.dropped}",
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
