"""What the kvstore connector adds to vLLM's serving step while it saves (issue 38, item 1).

Real vLLM 0.32.0 (CPU build, its own venv), the tests' tiny DeepSeek-V3, ``--prompts`` distinct
prompts of ``--prompt-tokens`` tokens added at once, each generating ``--decode-tokens`` tokens,
stepped by hand (``llm.llm_engine.step()``, the engine core in this process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with every step timed. Two configurations, in alternating
rounds so both see the same machine: no connector, and the connector with a fresh store each
round (so every prompt misses and is saved: the step carries the device-to-host copies of
``save_kv_layer``, the scheduler's lookups and the hand-off to the background writer; the writer's
encode, write and fsync run beside the steps). Printed: per configuration the median over rounds of
the step time's median, p90 and max, the mean of the steps that prefilled (the saves ride on
those), and the whole run's time; then the ratios connector ÷ none. Usage::

    KVSTORE_VLLM_VENV=... python bench/vllm_steps.py [--prompts 8] [--prompt-tokens 2000]
        [--decode-tokens 32] [--rounds 3] [--tier f32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def inner(spec_path: str, out_path: str) -> None:
    """In vLLM's venv: the prompts stepped through one LLM, every step timed."""
    runner_spec = importlib.util.spec_from_file_location("kvstore_run_vllm", ROOT / "tests" / "vllm" / "run_vllm.py")
    assert runner_spec is not None and runner_spec.loader is not None
    runner = importlib.util.module_from_spec(runner_spec)
    runner_spec.loader.exec_module(runner)
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = runner.make_llm(spec)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["decode_tokens"], ignore_eos=True)
    # an untimed request first: the first forward builds what later ones reuse
    engine.add_request("warm-up", TokensPrompt(prompt_token_ids=spec["warm"]), params)
    while engine.has_unfinished_requests():
        engine.step()
    for i, tokens in enumerate(spec["prompts"]):
        engine.add_request(f"p{i}", TokensPrompt(prompt_token_ids=tokens), params)
    steps, prefill = [], []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - began)
        # a step whose outputs carry no token yet, or a request's first one, prefilled
        prefill.append(any(len(o.outputs[0].token_ids) <= 1 for o in outputs) or not outputs)
    total = time.perf_counter() - started
    if spec.get("stats_dir"):
        runner.wait_for_saves(spec["stats_dir"])
    Path(out_path).write_text(json.dumps({"steps": steps, "prefill": prefill, "total": total}))


def summary(run: dict) -> dict:
    steps = np.array(run["steps"])
    prefill = steps[np.array(run["prefill"], dtype=bool)]
    return {
        "median": float(np.median(steps)),
        "p90": float(np.percentile(steps, 90)),
        "max": float(steps.max()),
        "prefill_mean": float(prefill.mean()) if prefill.size else float("nan"),
        "total": run["total"],
        "steps": int(steps.size),
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--inner":
        inner(sys.argv[2], sys.argv[3])
        return
    from vllm_connector import VENV, in_vllm, make_model  # this folder's: the model, vLLM's venv and runner

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tier", default="f32")
    args = parser.parse_args()
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"vLLM's venv is missing at {VENV}: run tests/vllm/setup_venv.sh")
    rng = np.random.default_rng(38)
    prompts = [rng.integers(2, 512, size=args.prompt_tokens).tolist() for _ in range(args.prompts)]
    warm = rng.integers(2, 512, size=200).tolist()
    results: dict[str, list[dict]] = {"none": [], "connector": []}
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-steps-") as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp / "tiny-dsv3")
        for round_ in range(args.rounds):
            for label in ("none", "connector"):
                work = tmp / f"{label}-{round_}"
                work.mkdir()
                spec = {
                    "model": str(model),
                    "prompts": prompts,
                    "warm": warm,
                    "decode_tokens": args.decode_tokens,
                    "max_model_len": 4096,
                    "connector": None,
                }
                if label == "connector":
                    stats = str(work / "stats")
                    spec["connector"] = {"store": str(work / "kv"), "tier": args.tier, "stats_dir": stats}
                    spec["stats_dir"] = stats
                (work / "spec.json").write_text(json.dumps(spec))
                # the engine core in this process: step() times the step itself
                in_vllm(
                    Path(__file__),
                    work / "spec.json",
                    work / "out.json",
                    work,
                    "--inner",
                    VLLM_ENABLE_V1_MULTIPROCESSING="0",
                )
                results[label].append(summary(json.loads((work / "out.json").read_text())))
                if label == "connector":
                    counts = [json.loads(p.read_text()) for p in (work / "stats").glob("worker-*.json")]
                    results[label][-1]["saves"] = sum(c.get("saves", 0) for c in counts)
                    results[label][-1]["skipped"] = sum(c.get("save_skipped", 0) for c in counts)
    print(
        f"vLLM 0.32.0 (CPU), tiny DeepSeek-V3; {args.prompts} prompts x {args.prompt_tokens} tokens added at once, "
        f"{args.decode_tokens} tokens each; medians over {args.rounds} alternating rounds (tier {args.tier})"
    )
    print("config    | steps | step median ms | p90 ms | max ms | prefill-step mean ms | whole run s | saves (skipped)")
    medians = {}
    for label, runs in results.items():
        m = {key: statistics.median(r[key] for r in runs) for key in ("median", "p90", "max", "prefill_mean", "total")}
        medians[label] = m
        saves = "/".join(f"{r['saves']} ({r['skipped']})" if "saves" in r else "-" for r in runs)
        print(
            f"{label:9} | {runs[0]['steps']:5} | {m['median'] * 1e3:14.1f} | {m['p90'] * 1e3:6.1f} | "
            f"{m['max'] * 1e3:6.1f} | {m['prefill_mean'] * 1e3:20.1f} | {m['total']:11.2f} | {saves}"
        )
    a, b = medians["connector"], medians["none"]
    print(
        f"connector / none: step median {a['median'] / b['median']:.2f}x, p90 {a['p90'] / b['p90']:.2f}x, "
        f"prefill steps {a['prefill_mean'] / b['prefill_mean']:.2f}x, whole run {a['total'] / b['total']:.2f}x "
        "(issue 38: median step <= 1.1x)"
    )


if __name__ == "__main__":
    main()
