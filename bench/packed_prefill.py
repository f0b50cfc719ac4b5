"""Prompts of several sessions prefilled one after another vs packed into shared forwards.

What a server pays when many conversations send their next message at once: each prompt's
prefill alone (``Engine.prefill_into``, one forward per prompt: what the scheduler did before
packing) against the same prompts through ``Engine.prefill_many`` (the chunks of several sessions
in one forward of at most ``--budget`` tokens: what the scheduler does now, and
``Engine.generate_batch``). Every session starts with ``--cached`` rows (a resumed conversation) or
none. Both ways are timed on the same engine and prompts in one run, best of ``--repeat`` after a
warm-up; each session's next-token logits after both are compared (the greedy picks that agree and
the largest difference relative to the logits' scale), beside the same comparison between the
prompts prefilled alone in one chunk and in two — another valid order of the same sums, so the
spread rounding alone gives on this model and dtype.

Usage::

    python bench/packed_prefill.py --device cuda --preset v2-lite --sessions 1 4 16 64 --prompt 32
    python bench/packed_prefill.py --sessions 1 4 16 --prompt 32          # CPU box, tiny model
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvstore.engine import Engine, preset, random_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _caches(engine: Engine, n: int, cached: int, vocab: int):
    caches = [engine.new_cache() for _ in range(n)]
    if cached:
        history = np.random.default_rng(99).integers(2, vocab, cached)
        engine.prefill_into(caches[0], history, 0)
        rows = caches[0].export_rows()
        for cache in caches[1:]:
            cache.restore(rows)
    return caches


def _timed(engine: Engine, fn, n: int, cached: int, vocab: int, repeat: int):
    best, caches = float("inf"), []
    for _ in range(repeat + 1):  # the first run is the warm-up
        caches = _caches(engine, n, cached, vocab)
        _sync(engine.device)
        began = time.perf_counter()
        fn(caches)
        _sync(engine.device)
        best = min(best, time.perf_counter() - began)
    return best, caches


def _next_logits(engine: Engine, caches, probe: np.ndarray) -> torch.Tensor:
    """Each session's next-token logits after ``probe`` (f32[sessions, vocab])."""
    out = []
    for cache in caches:
        engine.prefill_packed([(cache, probe[:-1], cache.length)])
        logits = engine.model.forward_tokens(
            torch.from_numpy(probe[-1:]).to(engine.device), cache, cache.length, absorbed=True, logits="last"
        )
        out.append(logits.float().cpu())
    return torch.stack(out)


def _distance(a: torch.Tensor, b: torch.Tensor, n: int) -> str:
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    return f"{agree}/{n}, {float((a - b).abs().max() / a.abs().max()):.1e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "tiny-512", "v2-lite"))
    parser.add_argument("--tier", default="fp8")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=32, help="new tokens each session prefills")
    parser.add_argument("--cached", type=int, default=0, help="rows each session holds before its prompt")
    parser.add_argument("--budget", type=int, default=512, help="tokens per packed forward (a server's default)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--after", type=int, default=0, help="also time a short message after this many cached rows (0: skip)"
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    model = random_model(preset(args.preset), seed=0, device=device, dtype=dtype)
    engine = Engine(model, tier=args.tier, prefill_chunk=args.budget)
    vocab = model.config.vocab_size
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{name}, torch {torch.__version__}; {args.preset} ({dtype}), {args.tier} cache; "
        f"prompt {args.prompt} tokens after {args.cached} cached rows; forwards of at most {args.budget} tokens"
    )
    print(
        "| sessions | one after another | packed | speed-up | forwards | prompt tok/s packed "
        "| packed vs alone: next token the same; max Δlogit / max logit | alone in two chunks vs one: the same |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    probe = np.array([5, 6, 7], dtype=np.int64)
    for n in args.sessions:
        prompts = [np.random.default_rng(i).integers(2, vocab, args.prompt) for i in range(n)]

        def alone(caches, prompts=prompts):
            for cache, ids in zip(caches, prompts):
                engine.prefill_into(cache, ids, cache.length)

        forwards: list[int] = []

        def packed(caches, prompts=prompts, forwards=forwards):
            forwards.append(engine.prefill_many(list(zip(caches, prompts))))

        t_alone, c_alone = _timed(engine, alone, n, args.cached, vocab, args.repeat)
        t_packed, c_packed = _timed(engine, packed, n, args.cached, vocab, args.repeat)
        a, b = _next_logits(engine, c_alone, probe), _next_logits(engine, c_packed, probe)
        # the same prompts alone in chunks of half the prompt: another valid order of the same sums
        halves = _caches(engine, n, args.cached, vocab)
        for cache, ids in zip(halves, prompts):
            for h in range(0, ids.shape[0], max(1, ids.shape[0] // 2)):
                engine.prefill_into(cache, ids[h : h + max(1, ids.shape[0] // 2)], cache.length)
        c = _next_logits(engine, halves, probe)
        print(
            f"| {n} | {t_alone * 1e3:,.1f} ms | {t_packed * 1e3:,.1f} ms | {t_alone / t_packed:.2f}x | "
            f"{forwards[-1]} | {n * args.prompt / t_packed:,.0f} | {_distance(a, b, n)} | {_distance(a, c, n)} |"
        )
    if args.after:
        _short_after(engine, args.after, vocab)
    return 0


def _short_after(engine: Engine, rows: int, vocab: int) -> None:
    """A new message of a few tokens on a session of ``rows`` cached rows (the absorbed form): each
    length twice, so a cost paid once per length (a kernel built for a new shape) shows apart."""
    session = engine.new_cache()
    engine.prefill_into(session, np.random.default_rng(5).integers(2, vocab, rows), 0)
    print(f"\nA short message after {rows:,} cached rows (one session; each length twice):")
    print("| tokens | first call | again |")
    print("|---:|---:|---:|")
    for n in (2, 5, 17, 64):
        ids = np.random.default_rng(n).integers(2, vocab, n)
        times = []
        for _ in range(2):
            cache = session.copy()
            _sync(engine.device)
            began = time.perf_counter()
            engine.prefill_packed([(cache, ids, rows)])
            _sync(engine.device)
            times.append(time.perf_counter() - began)
        print(f"| {n} | {times[0] * 1e3:,.1f} ms | {times[1] * 1e3:,.1f} ms |")


if __name__ == "__main__":
    raise SystemExit(main())
