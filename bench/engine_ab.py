"""Two or more settings of the decode step side by side in one process, their rounds interleaved.

Successive runs of ``bench/engine_decode.py`` on one GPU drift by a few percent (the copy bandwidth
each measures at its start moved by 4% between two runs in one call on an H100), more than a change
to one kernel of the step moves it. Here one model serves every variant: each variant sets its
switches (upper-case module attributes of ``kvstore.engine``'s ``products``, ``model``,
``launches`` and ``expert_kernels``, or ``inductor.<option>`` of ``torch._inductor.config``),
compiles the step's regions afresh (``compile_decode``) and captures its own engine's CUDA graph;
then the rounds run variant after variant, ``--tokens`` greedy steps each, and every variant's rate
is divided by the first variant's of the same round. The figure is the median of those ratios,
beside their range; the rates are medians over the rounds. ``--variant ""`` is the defaults.
"graphs" counts the graphs dynamo compiled while a variant's engine took its first steps: 0 where a
variant ran code compiled before (the same switches as an earlier one, or none that the regions
read).

    python3 bench/engine_ab.py --device cuda --preset v2-lite --tiers fp8 int4 --lengths 1024 32768 \\
        --batch 16 --variant "" --variant "products.REDUCED_PROJECTIONS=0"

"x16" in the context column is 16 sessions decoded together (their aggregate tok/s), lengths spread
evenly over 1k..32k; their caches are shared by the variants, each cut back before its run, but
each variant's engine holds a batch pool of its own, so 64 such sessions and two variants do not
fit an 80 GB card (alternate ``bench/engine_decode.py --batch 64 --batch-only`` runs instead).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import _engine, _fill, _steps, _sync, filled_sessions, spread_lengths  # noqa: E402

from kvstore.engine import (  # noqa: E402
    BatchSequence,
    expert_kernels,
    launches,
    preset,
    products,
    random_model,
)
from kvstore.engine import model as model_module  # noqa: E402
from kvstore.gpu import codecs  # noqa: E402

#: Modules whose upper-case attributes a variant may set; ``inductor.<option>`` sets one of
#: ``torch._inductor.config`` (dotted for its sections: ``inductor.triton.persistent_reductions=0``),
#: which the variant's own compile of the regions reads.
SWITCHES: dict[str, Any] = {
    "products": products,
    "model": model_module,
    "launches": launches,
    "expert_kernels": expert_kernels,
}


def _owner(module: str, attribute: str) -> tuple[Any, str]:
    """The object holding a switch and its last name (``inductor.triton.x`` -> config.triton, "x")."""
    if module == "inductor":
        import torch._inductor.config as inductor_config

        *path, last = attribute.split(".")
        owner: Any = inductor_config
        for part in path:
            owner = getattr(owner, part)
        return owner, last
    return SWITCHES[module], attribute


def parse_variant(text: str) -> dict[tuple[str, str], object]:
    """``"products.REDUCED_PROJECTIONS=0 model.MERGED_REGIONS=1"`` -> {(module, attribute): value}; the value
    takes the type of the attribute's current value (bool: 0/1/true/false, int, float)."""
    settings: dict[tuple[str, str], object] = {}
    for item in text.split():
        name, sep, raw = item.partition("=")
        module, dot, attribute = name.partition(".")
        known = module == "inductor" or (module in SWITCHES and attribute.isupper())
        if not sep or not dot or not known:
            raise ValueError(
                f"not a switch: {item!r} (module.ATTRIBUTE=value, module one of {sorted(SWITCHES)}, or inductor.option)"
            )
        try:
            owner, last = _owner(module, attribute)
            current = getattr(owner, last)
        except AttributeError:
            raise ValueError(f"not a switch: {item!r} ({module} has no {attribute})") from None
        if isinstance(current, bool):
            if raw.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{item!r}: {name} is a bool (0, 1, true, false)")
            value: object = raw.lower() in ("1", "true")
        else:
            value = type(current)(raw)
        settings[(module, attribute)] = value
    return settings


def apply(settings: dict[tuple[str, str], object], defaults: dict[tuple[str, str], object]) -> None:
    """Every switch any variant names back to its default, then this variant's."""
    for (module, attribute), value in {**defaults, **settings}.items():
        owner, last = _owner(module, attribute)
        setattr(owner, last, value)


def single(model, mode: str, tier: str, length: int, tokens: int) -> Callable[[int], float]:
    """One session of ``length`` rows in an engine of its own: a run of ``tokens`` (or, the first
    time, 2) greedy tokens from those rows (the cache cut back to them first), a host sync per token
    as a user's loop has; it returns tokens per second."""
    engine = _engine(model, mode, tier=tier)
    first = int(_fill(engine, length, seed=length)[-1])
    runs = {n: _steps(engine, first, n) for n in (2, tokens)}  # each cuts the cache back to `length`

    def run(n: int) -> float:
        _sync(engine.device)
        began = time.perf_counter()
        runs[n]()
        return n / (time.perf_counter() - began)

    return run


def batched(model, mode: str, tier: str, sessions: list[tuple[Any, int, int]]) -> Callable[[int], float]:
    """The ``sessions`` (cache, first token, length), shared by every variant, decoded together by an
    engine of this variant's own: a run of ``tokens`` steps from their lengths; it returns the
    aggregate tokens per second."""
    engine = _engine(model, mode, tier=tier)

    def run(tokens: int) -> float:
        for cache, _, length in sessions:
            cache.truncate(length)
        batch = [BatchSequence(cache, [token]) for cache, token, _ in sessions]
        _sync(engine.device)
        began = time.perf_counter()
        result = engine.generate_batch(batch, max_new_tokens=tokens, stop_tokens=())
        _sync(engine.device)
        return len(sessions) * result.steps / (time.perf_counter() - began)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tiers", nargs="+", default=["fp8"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per variant per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--batch",
        type=int,
        nargs="*",
        default=[],
        help="also this many sessions decoded together (lengths spread over 1k..32k), per number given",
    )
    parser.add_argument("--batch-only", action="store_true", help="skip the single-session rows")
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="switches of one variant, e.g. 'products.REDUCED_PROJECTIONS=0' ('' : the defaults); the first is the "
        "baseline of the ratios (default: '' and 'products.REDUCED_PROJECTIONS=0')",
    )
    parser.add_argument(
        "--skip-unknown",
        action="store_true",
        help="drop a variant (not the first) whose switch this torch or tree lacks, and say so, rather than stop",
    )
    args = parser.parse_args(argv)
    texts = args.variant if args.variant is not None else ["", "products.REDUCED_PROJECTIONS=0"]
    variants, kept = [], []
    for text in texts:
        try:
            variants.append(parse_variant(text))
            kept.append(text)
        except ValueError as error:
            if not args.skip_unknown or not variants:
                parser.error(str(error))
            print(f"engine_ab: skipped, {error}")
    texts = kept
    if len(variants) < 2:
        parser.error("give at least two --variant")
    defaults = {key: getattr(*_owner(*key)) for v in variants for key in v}
    codecs.use_encode_kernels(True)

    device = torch.device(args.device)
    cfg = preset(args.preset)
    model = random_model(cfg, seed=0, device=device, dtype="float32" if device.type == "cpu" else "bfloat16")
    model.use_expert_kernels(True)
    mode = "compiled" if device.type == "cuda" else "plain"
    labels = [t or "defaults" for t in texts]
    print(f"engine_ab: {args.preset} on {device} ({mode}), {args.rounds} rounds of {args.tokens} tokens per variant")
    print(
        f"{'tier':5s} {'context':>7s}  {'variant':40s} {'tok/s':>8s}  {'vs first':>8s}  {'ratio range':>13s}  capture s  graphs"
    )
    cases = [("single", n) for n in ([] if args.batch_only else args.lengths)] + [("batch", n) for n in args.batch]
    for tier in args.tiers:
        for kind, n in cases:
            sessions = filled_sessions(model, tier, spread_lengths(n)) if kind == "batch" else []
            runs, captures = [], []
            for settings in variants:
                apply(settings, defaults)
                run = (
                    single(model, mode, tier, n, args.tokens)
                    if kind == "single"
                    else batched(model, mode, tier, sessions)
                )
                graphs = counters["stats"]["unique_graphs"]
                began = time.perf_counter()
                run(2)  # compiles and captures under this variant's switches
                captures.append((time.perf_counter() - began, counters["stats"]["unique_graphs"] - graphs))
                runs.append(run)
            rates = np.zeros((args.rounds, len(variants)))
            for r in range(args.rounds):
                for i, (settings, run) in enumerate(zip(variants, runs)):
                    apply(settings, defaults)  # a new bucket would capture under these
                    rates[r, i] = run(args.tokens)
            apply({}, defaults)
            ratios = rates / rates[:, :1]
            context = f"{n:7d}" if kind == "single" else f"{'x' + str(n):>7s}"
            for i, label in enumerate(labels):
                spread = f"{ratios[:, i].min():.3f}-{ratios[:, i].max():.3f}"
                print(
                    f"{tier:5s} {context}  {label[:40]:40s} {np.median(rates[:, i]):8.1f}  "
                    f"{np.median(ratios[:, i]):8.3f}  {spread:>13s}  {captures[i][0]:9.1f}  {captures[i][1]:6d}"
                )
            del runs, sessions
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
