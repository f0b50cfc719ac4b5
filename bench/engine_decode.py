"""Decode speed after a resume: plain steps vs CUDA-graph replays, per tier and context length.

For each tier and context length the cache is filled with the context's rows (random rows written
through the tier's encoder: decode time does not depend on their values) and the engine generates
``--tokens`` greedy tokens after it, three ways on CUDA: every kernel launched from Python
(``cuda_graphs=False``, "plain"), replayed from CUDA graphs of the eager step ("graphs"), and
replayed from CUDA graphs of the step whose elementwise regions ``torch.compile`` fused
("compiled", the engine's default on CUDA). The first graph step of a bucket includes its capture
(and, compiled, the first compilation of each shape), reported apart ("capture"); tokens/s is
measured over the steps after it.

Also printed: the bound of the hardware — reading the weights a token touches once (attention,
dense and shared layers, ``num_experts_per_tok`` routed experts, the LM head) plus the context's
cache rows, at the device-to-device copy bandwidth measured in the same run — as tokens/s; and the
peak device memory of each cache.

Usage::

    python bench/engine_decode.py --device cuda --preset v2-lite            # H200 figures
    python bench/engine_decode.py --preset tiny --lengths 256 1024 --tokens 8   # CPU smoke
    python bench/engine_decode.py ... --profile                             # torch.profiler top 10 (--profile-rows N)
    python bench/engine_decode.py --device cuda --preset v2-lite --batch 16  # + 16 sessions together
    python bench/engine_decode.py --device cuda --preset v2-lite --breakdown # + where a step's time goes

With ``--batch B``, B sessions of different context lengths (``--batch-lengths``, default spread
from 1k to 32k) decode together through ``Engine.generate_batch`` — one forward per step for all of
them — and the aggregate tokens/s is printed beside the single-sequence rows, plain and replayed.

With ``--breakdown``, 8 steps of each row are profiled (CUDA kernels through the profiler) and a
step's device time is split into weight reads (cuBLAS GEMMs and the routed experts' kernels),
attention (the MLA decode kernels), the rest (elementwise, norms, routing, copies) and the gaps
where no kernel ran (launches, the host), beside the time the weights and the cache rows take at
the copy bandwidth (on the CPU the same split of the leaf aten ops: indicative only).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from kvstore.engine import BatchSequence, CacheGeometry, Engine, launches, preset, products, random_model
from kvstore.engine import model as model_module
from kvstore.engine.graphs import bucket
from kvstore.engine.model import StepRegions
from kvstore.gpu import codecs

DEFAULT_TIERS = ("f32", "fp8", "int4")
#: How a step runs: kernels from Python, CUDA graphs of the eager step, of the compiled step.
MODES = ("plain", "graphs", "compiled")
#: Rows of torch.profiler's table that ``--profile`` prints (``--profile-rows``).
PROFILE_ROWS = 10


def _engine(model, mode: str, **kwargs) -> Engine:
    """An engine decoding in ``mode`` (the regions are the model's: set them for this mode)."""
    if mode == "compiled":
        model.compile_decode()
    else:
        model.regions = StepRegions.eager()
    return Engine(model, cuda_graphs=mode != "plain", compile_step=mode == "compiled", **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(engine: Engine, length: int, seed: int) -> np.ndarray:
    """Write ``length`` positions of random rows into the engine's cache (through its encoder)."""
    cache, cfg = engine.cache, engine.config
    cache.prepare(0, length)
    cache.reserve(bucket(length + 1))
    generator = torch.Generator(device=cache.device).manual_seed(seed)
    for start in range(0, length, 8192):
        n = min(8192, length - start)
        for layer in range(cfg.num_hidden_layers):
            lc = torch.randn(n, cfg.kv_lora_rank, device=cache.device, generator=generator)
            rc = torch.randn(n, cfg.qk_rope_head_dim, device=cache.device, generator=generator)
            cache.write(layer, start, lc, rc)
    tokens = np.random.default_rng(seed).integers(2, cfg.vocab_size, length)
    cache.commit(0, tokens)
    return tokens


def _decode(engine: Engine, first: int, n: int) -> tuple[list[int], float, float, torch.Tensor]:
    """Greedy steps after the cache: (tokens, seconds of the first step, seconds per later step,
    the first step's logits)."""
    device = engine.device
    token, tokens = first, []
    _sync(device)
    began = time.perf_counter()
    logits = engine.decode_logits(token, engine.cache.length)
    token = int(torch.argmax(logits))
    first_seconds = time.perf_counter() - began
    first_logits = logits.float().cpu()
    tokens.append(token)
    began = time.perf_counter()
    for _ in range(n - 1):
        logits = engine.decode_logits(token, engine.cache.length)
        token = int(torch.argmax(logits))  # the host needs each token: a sync per step, as a user sees
        tokens.append(token)
    return tokens, first_seconds, (time.perf_counter() - began) / max(1, n - 1), first_logits


def _distance(a: torch.Tensor, b: torch.Tensor) -> str:
    """max |a - b| and KL(softmax b || softmax a) of two logit vectors (b the reference)."""
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="sum")
    return f"max|d| {float((a - b).abs().max()):.3g} KL {float(kl):.2g}"


def _copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s (read + write bytes), best of 5."""
    if device.type != "cuda":
        return float("nan")
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        began = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() / best / 1e9


def _token_bytes(model, cfg, cache_bytes_per_token: int, length: int) -> int:
    """Bytes one decode step must read at least: the weights it uses once, plus the context's rows."""
    total = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:  # routed experts: only num_experts_per_tok of them per token
            total += p.numel() * p.element_size() * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif "embed_tokens" not in name:  # one embedding row is read, not the table
            total += p.numel() * p.element_size()
    return total + cache_bytes_per_token * length


def _batch_bytes(model, cfg, cache_bytes_per_token: int, lengths: list[int]) -> float:
    """Bytes a batched step must read at least: every weight once (routed experts: the expected
    number hit by ``len(lengths)`` tokens choosing ``num_experts_per_tok`` each), plus every row."""
    b, e, k = len(lengths), cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = e * (1 - (1 - k / e) ** b)  # expected distinct experts of B independent uniform choices
    total = 0.0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            total += p.numel() * p.element_size() * hit / e
        elif "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total + cache_bytes_per_token * sum(lengths)


def spread_lengths(n: int) -> list[int]:
    """``n`` context lengths spread evenly over 1k..32k: the sessions of a batched measurement."""
    return [int(x) for x in np.linspace(1024, 32768, n)]


def filled_sessions(model, tier: str, lengths: list[int]) -> list[tuple[Any, int, int]]:
    """One cache of ``tier`` per length, filled with random rows (:func:`_fill`, seed 1000 + its
    index): (cache, its last token, length), sessions to decode together."""
    sessions = []
    for i, length in enumerate(lengths):
        holder = Engine(model, tier=tier, cuda_graphs=False)
        context = _fill(holder, length, seed=1000 + i)
        sessions.append((holder.cache, int(context[-1]), length))
    return sessions


def _batched(
    model, cfg, tier: str, lengths: list[int], steps: int, mode: str, profile: bool = False, breakdown: bool = False
) -> tuple[float, float, list, dict[str, float] | None]:
    """B sessions decoding ``steps`` tokens together: (seconds per step, seconds of the first batch
    — its capture included —, the tokens of the timed batch, where 8 steps' device time goes or None)."""
    engine = _engine(model, mode, tier=tier)
    sessions = [(cache, token) for cache, token, _ in filled_sessions(model, tier, lengths)]
    timings = []
    for _ in range(2):  # the first batch captures the graph (when on); the second is timed
        batch = [BatchSequence(cache, [token]) for cache, token in sessions]
        _sync(engine.device)
        began = time.perf_counter()
        result = engine.generate_batch(batch, max_new_tokens=steps, stop_tokens=())
        _sync(engine.device)
        timings.append(time.perf_counter() - began)
        for (cache, _), length in zip(sessions, lengths):
            cache.truncate(length)  # back to the restored context for the next batch

    def eight_steps() -> None:  # from the restored contexts, and back to them
        engine.generate_batch([BatchSequence(c, [t]) for c, t in sessions], max_new_tokens=8, stop_tokens=())
        for (cache, _), length in zip(sessions, lengths):
            cache.truncate(length)

    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            eight_steps()
            _sync(engine.device)
        key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
        print(f"\n-- {tier}, {len(lengths)} sessions, {mode}: top {PROFILE_ROWS} of 8 batched steps")
        print(prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS, max_name_column_width=60))
    parts = _breakdown(eight_steps, engine.device, 8) if breakdown else None
    return timings[1] / result.steps, timings[0], result.tokens, parts


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How far two runs' greedy tokens agree: sequences identical, and the mean common prefix
    (random weights give near-flat logits, where a rounding difference may flip one argmax and
    everything after it)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return f"{same}/{len(a)} same, common prefix {np.mean(prefix):.1f}/{len(a[0])}"


# Kernel names by part of a decode step (lower case, substrings). Weight reads: cuBLAS/cuBLASLt
# GEMMs (the projections, the LM head, the absorbed W_UK/W_UV bmm) and the routed experts' Triton
# kernel; attention: the MLA decode kernels of kvstore.gpu (CUDA C++, Gluon, Triton). On the CPU the
# leaf aten ops stand in for kernels.
WEIGHT_KERNELS = (
    "gemm",
    "nvjet",
    "cutlass",
    "xmma",
    "cublas",
    "splitkreduce",
    "_experts_kernel",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
)
ATTENTION_KERNELS = ("mla_", "_wide_split", "_dense_split", "_dense_merge")
PARTS = ("weights", "attention", "other", "gaps")


def step_parts(kernels: list[tuple[str, float, float]], steps: int, *, disjoint: bool = False) -> dict[str, float]:
    """Microseconds per step of each part (:data:`PARTS`) and of the whole (``"step"``: first
    kernel's start to last kernel's end over ``steps`` steps), from ``(name, start, end)`` of every
    kernel in µs. Kernels that overlap (two streams) count in their part each; ``gaps`` is the span
    no kernel covered (``disjoint``: the span less every kernel's time, for spans that stand for
    ops' own times and may overlap as intervals)."""
    parts = dict.fromkeys(PARTS, 0.0)
    if not kernels:
        return {**parts, "step": 0.0, "kernels": 0.0}
    for name, start, end in kernels:
        low = name.lower()
        part = (
            "attention"
            if any(k in low for k in ATTENTION_KERNELS)
            else "weights"
            if any(k in low for k in WEIGHT_KERNELS)
            else "other"
        )
        parts[part] += end - start
    ordered = sorted((start, end) for _, start, end in kernels)
    if disjoint:
        busy = sum(end - start for start, end in ordered)
    else:  # the union of the intervals
        busy, (lo, hi) = 0.0, ordered[0]
        for start, end in ordered[1:]:
            if start > hi:
                busy, lo = busy + hi - lo, start
            hi = max(hi, end)
        busy += hi - lo
    span = max(end for _, _, end in kernels) - ordered[0][0]
    parts["gaps"] = span - busy
    return {**{k: v / steps for k, v in parts.items()}, "step": span / steps, "kernels": len(kernels) / steps}


def _kernels(prof, device: torch.device) -> list[tuple[str, float, float]]:
    """The profiled kernels (CUDA) as ``(name, start µs, end µs)``; on the CPU the aten ops, each
    as its own time (less its children's) from its start."""
    from torch.autograd import DeviceType

    out = []
    for event in prof.events():
        start = float(event.time_range.start)
        if device.type == "cuda":
            if event.device_type == DeviceType.CUDA:
                out.append((event.name, start, float(event.time_range.end)))
        elif event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            out.append((event.name, start, start + float(event.self_cpu_time_total)))
    return out


def _breakdown(run, device: torch.device, steps: int) -> dict[str, float]:
    """Where ``steps`` steps of ``run()`` spend their device time (:func:`step_parts`)."""
    from torch.profiler import ProfilerActivity, profile

    run()  # once unprofiled: nothing first-time (a capture, a plan) in the profile
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(device)
    return step_parts(_kernels(prof, device), steps, disjoint=device.type != "cuda")


def _parts_row(label: str, parts: dict[str, float], weights_us: float, rows_us: float) -> str:
    step = parts["step"] or float("nan")
    shares = "  ".join(f"{parts[k]:8.0f} {parts[k] / step:4.0%}" for k in PARTS)
    return f"{label:28s} {parts['step']:8.0f}  {shares}  {weights_us:9.0f}  {rows_us:8.0f}  {parts['kernels']:7.0f}"


BREAKDOWN_HEAD = (
    f"{'':28s} {'step µs':>8s}  "
    + "  ".join(f"{k:>13s}" for k in PARTS)
    + f"  {'weights@bw':>9s}  {'rows@bw':>8s}  {'kernels':>7s}"
)


def _profile(engine: Engine, first: int, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    token = first
    with profile(activities=activities) as prof:
        for _ in range(steps):
            token = int(torch.argmax(engine.decode_logits(token, engine.cache.length)))
    key = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS, max_name_column_width=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="weights (default f32 on cpu, bf16 on cuda)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--tiers", nargs="+", default=list(DEFAULT_TIERS))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per measurement")
    parser.add_argument(
        "--profile", action="store_true", help="print torch.profiler's top kernels of a decode step (--profile-rows)"
    )
    parser.add_argument("--profile-rows", type=int, default=10, help="rows of the profiler's table")
    parser.add_argument("--profile-prefill", type=int, metavar="N", help="also profile a cold prefill of N tokens")
    parser.add_argument(
        "--breakdown", action="store_true", help="split each row's step into weight reads, attention, the rest, gaps"
    )
    parser.add_argument("--batch", type=int, default=0, help="also decode this many sessions together")
    parser.add_argument("--batch-lengths", type=int, nargs="+", help="their context lengths (default 1k..32k)")
    parser.add_argument("--batch-only", action="store_true", help="skip the single-sequence rows")
    parser.add_argument("--modes", nargs="+", choices=MODES, help="on CUDA, a subset of the modes (default all)")
    parser.add_argument(
        "--grouped-experts", action="store_true", help="routed experts by grouped GEMM, not the Triton kernels"
    )
    parser.add_argument(
        "--shared-apart", action="store_true", help="shared experts by their own GEMMs, not the experts' kernels"
    )
    parser.add_argument(
        "--torch-routing", action="store_true", help="the router's top-k by torch's kernels, not the routing kernel"
    )
    parser.add_argument(
        "--torch-encode",
        action="store_true",
        help="the cache's new rows encoded by the torch twins and stored by index_copy_, not one Triton kernel",
    )
    parser.add_argument(
        "--reduced-tokens",
        type=int,
        default=products.REDUCED_TOKENS,
        help="compiled steps of at most this many tokens take the per-head and router products as "
        "reductions (0: cuBLAS's GEMMs for every step)",
    )
    parser.add_argument(
        "--gemm-projections",
        action="store_true",
        help="the attention's input and output projections as cuBLAS's GEMMs in every step, not as "
        "reductions in steps of at most --reduced-tokens tokens (products.REDUCED_PROJECTIONS off)",
    )
    parser.add_argument(
        "--layer-regions",
        action="store_true",
        help="compiled steps run each layer as its own regions, not its outputs with the next layer's inputs",
    )
    parser.add_argument(
        "--tuned-reductions",
        action="store_true",
        help="inductor tunes each compiled kernel's blocks by coordinate descent as it first runs "
        "(its coordinate_descent_tuning; TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1); on an H100 the step was "
        "4-5%% slower with it and took 2-6x longer to compile (BENCHMARKS.md)",
    )
    parser.add_argument(
        "--no-combo-kernels",
        action="store_true",
        help="compiled regions without inductor's combo kernels (model.COMBO_KERNELS off; on by default)",
    )
    parser.add_argument(
        "--plain-launches",
        action="store_true",
        help="compiled regions launch plainly, not with programmatic dependent launch "
        "(launches.DEPENDENT_LAUNCH off; it is on by default where available, sm_90+)",
    )
    args = parser.parse_args(argv)
    if args.tuned_reductions:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    launches.DEPENDENT_LAUNCH = not args.plain_launches
    codecs.use_encode_kernels(not args.torch_encode)
    products.REDUCED_TOKENS = args.reduced_tokens
    products.REDUCED_PROJECTIONS = not args.gemm_projections
    model_module.MERGED_REGIONS = not args.layer_regions
    model_module.COMBO_KERNELS = not args.no_combo_kernels
    global PROFILE_ROWS
    PROFILE_ROWS = args.profile_rows

    device = torch.device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    cfg = preset(args.preset)
    began = time.perf_counter()
    model = random_model(cfg, seed=0, device=device, dtype=dtype)
    model.use_expert_kernels(not args.grouped_experts, fold_shared=not args.shared_apart, route=not args.torch_routing)
    print(
        f"engine_decode: {args.preset} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, "
        f"kv_lora {cfg.kv_lora_rank}), {dtype} on {device}; model built in {time.perf_counter() - began:.1f} s"
    )
    if args.profile_prefill:
        from torch.profiler import ProfilerActivity, profile

        prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, args.profile_prefill)
        Engine(model, tier="f32").prefill(prompt[:512])  # warm-up
        engine = Engine(model, tier="f32")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        _sync(device)
        began = time.perf_counter()
        with profile(activities=activities) as prof:
            engine.prefill(prompt)
            _sync(device)
        print(
            f"\n-- prefill of {args.profile_prefill} tokens (f32 cache): {time.perf_counter() - began:.2f} s profiled"
        )
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))
        del engine
    bandwidth = _copy_bandwidth(device)
    if device.type == "cuda":
        print(f"device copy bandwidth: {bandwidth:.0f} GB/s")
    modes = tuple(args.modes or MODES) if device.type == "cuda" else ("plain",)
    rows = []
    breakdowns: list[str] = []
    weights_us = _token_bytes(model, cfg, 0, 0) / bandwidth / 1e3  # µs at the copy bandwidth (GB/s)
    for tier in args.tiers if not args.batch_only else ():
        for length in args.lengths:
            results = {}
            for mode in modes:
                engine = _engine(model, mode, tier=tier)
                context = _fill(engine, length, seed=length)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                tokens, first, per_step, logits = _decode(engine, int(context[-1]) % cfg.vocab_size, args.tokens)
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
                results[mode] = (tokens, first, per_step, peak, engine.cache.nbytes / 2**30, logits)
                if args.profile and length == args.lengths[0]:
                    print(f"\n-- {tier}, {length} rows, {mode}: top {PROFILE_ROWS} of 8 decode steps")
                    print(_profile(engine, tokens[-1], 8))
                if args.breakdown:
                    parts = _breakdown(_steps(engine, tokens[-1], 8), device, 8)
                    rows_us = CacheGeometry.of(cfg).bytes_per_token(tier) * length / bandwidth / 1e3
                    breakdowns.append(_parts_row(f"{tier} {length} {mode}", parts, weights_us, rows_us))
                del engine
            need = _token_bytes(model, cfg, CacheGeometry.of(cfg).bytes_per_token(tier), length)
            bound = bandwidth * 1e9 / need if bandwidth == bandwidth else float("nan")
            rows.append((tier, length, results, bound))
    print(
        "\ntier   context  "
        + "  ".join(f"{m + ' tok/s':>15s}" for m in modes)
        + "  first step (capture) ms  best vs HBM bound (tok/s)  cache GiB  peak GiB  tokens vs plain"
    )
    for tier, length, results, bound in rows:
        rates = {m: 1 / results[m][2] for m in modes}
        last = results[modes[-1]]
        same = "; ".join(
            f"{m}: {_agreement([results[m][0]], [results['plain'][0]])}, {_distance(results[m][5], results['plain'][5])}"
            for m in modes
            if m != "plain" and "plain" in results
        )
        same = same or "-"
        print(
            f"{tier:6s} {length:7d}  "
            + "  ".join(f"{rates[m]:15.1f}" for m in modes)
            + f"  {last[1] * 1e3:23.1f}  {rates[modes[-1]] / bound:9.1%} of {bound:7.0f}  {last[4]:9.2f}  {last[3]:8.2f}  {same}"
        )
    if args.batch:
        lengths = args.batch_lengths or spread_lengths(args.batch)
        if len(lengths) != args.batch:
            parser.error(f"--batch-lengths gives {len(lengths)} lengths for --batch {args.batch}")
        print(
            f"\n{args.batch} sessions together, contexts {min(lengths)}..{max(lengths)} "
            f"({sum(lengths)} rows), {args.tokens} tokens each"
        )
        print(
            "tier   mode      step ms  aggregate tok/s  per session tok/s  first batch s  vs HBM bound (tok/s)  tokens"
        )
        for tier in args.tiers:
            need = _batch_bytes(model, cfg, CacheGeometry.of(cfg).bytes_per_token(tier), lengths)
            bound = bandwidth * 1e9 / need * args.batch if bandwidth == bandwidth else float("nan")
            outputs = {}
            for mode in modes:
                step, first, outputs[mode], parts = _batched(
                    model,
                    cfg,
                    tier,
                    lengths,
                    args.tokens,
                    mode,
                    profile=args.profile and mode != "plain" and tier == args.tiers[0],
                    breakdown=args.breakdown,
                )
                if parts is not None:
                    rows_us = CacheGeometry.of(cfg).bytes_per_token(tier) * sum(lengths) / bandwidth / 1e3
                    batch_weights_us = _batch_bytes(model, cfg, 0, lengths) / bandwidth / 1e3
                    label = f"{tier} batch {args.batch} {mode}"
                    breakdowns.append(_parts_row(label, parts, batch_weights_us, rows_us))
                rate = args.batch / step
                same = "-" if mode == "plain" or "plain" not in outputs else _agreement(outputs[mode], outputs["plain"])
                print(
                    f"{tier:6s} {mode:8s}  {step * 1e3:7.2f}  {rate:15.1f}  {1 / step:17.1f}  "
                    f"{first:13.2f}  {rate / bound:9.1%} of {bound:7.0f}  {same}"
                )
    if breakdowns:
        print(
            "\nWhere a step's device time goes (µs per step, 8 profiled steps; the share of the step), "
            "beside the weights' and the rows' time at the copy bandwidth"
        )
        print(BREAKDOWN_HEAD)
        print("\n".join(breakdowns))
    return 0


def _steps(engine: Engine, first: int, n: int):
    """``n`` greedy steps from the cache's length as it is now, repeatable (the cache is cut back
    to that length first)."""
    start = engine.cache.length

    def run() -> None:
        engine.cache.truncate(start)
        token = first
        for _ in range(n):
            token = int(torch.argmax(engine.decode_logits(token, engine.cache.length)))

    return run


if __name__ == "__main__":
    raise SystemExit(main())
