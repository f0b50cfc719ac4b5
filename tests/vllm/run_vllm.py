"""Runs prompts through one vLLM process (offline ``LLM``) with the kvstore connector, for the tests.

Run with vLLM's venv: ``python run_vllm.py SPEC.json OUT.json``. SPEC holds ``model`` (a folder),
``prompts`` (lists of token ids, run one after another so each sees what the previous stored; an
entry ``{"after": i, "extra": [...]}`` continues prompt ``i``'s conversation: its tokens, the
tokens generated for it, then ``extra``), ``max_tokens`` (one for all, or one per prompt),
``connector`` (the ``kv_connector_extra_config``, or null for no connector), ``metrics`` (true:
vLLM's stats on, and OUT gets vLLM's own ``vllm:kvstore_*`` counters) and ``torch_rotary`` (default
true: vLLM's torch rotary op, ``custom_ops: ["-rotary_embedding"]``, the configuration docs/VLLM.md
gives; false: vLLM CPU's own rotary kernel, which ignores the rope key's token stride, so the rows a
prefill computes depend on how the prompt was chunked).
OUT gets, per prompt, the prompt, the generated token ids and the first generated token's top logprobs.
With a connector that keeps counters (``stats_dir``), each prompt is followed by a wait until the
connector's background writer has settled every save handed to it and every finished request's
conversation save the scheduler asked for (``save_pending == 0``, ``finished_done ==
finished_planned``), so the next prompt finds what this one stored.
vLLM spawns workers, so everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# How long to wait for the connector's saves to settle before going on regardless (a stuck writer
# then shows as a test's missing save, not as a hang).
SETTLE_S = 120.0


def saves_settled(stats_dir: str) -> bool:
    """Whether the connector processes' counters show no save queued or being written, and every
    conversation save the scheduler asked for settled by a worker."""
    totals = {"save_pending": 0, "finished_planned": 0, "finished_done": 0}
    for path in Path(stats_dir).glob("*.json"):
        try:
            counts = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced atomically, but a file may be gone between the calls
            return False
        for name in totals:
            totals[name] += int(counts.get(name, 0))
    return totals["save_pending"] == 0 and totals["finished_done"] == totals["finished_planned"]


def wait_for_saves(stats_dir: str | None) -> None:
    if stats_dir is None:
        return
    deadline = time.monotonic() + SETTLE_S
    while not saves_settled(stats_dir) and time.monotonic() < deadline:
        time.sleep(0.01)


def make_llm(spec: dict):
    """vLLM's offline ``LLM`` for ``spec`` (see the module's docstring), as the tests run it."""
    from vllm.config import KVTransferConfig

    from vllm import LLM

    transfer = None
    if spec.get("connector") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.connectors.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        block_size=16,
        # the reference CPU MLA kernel runs float32 (the AMX one, preferred where the CPU has AMX,
        # takes bf16/fp16 weights only)
        attention_backend="CPU_MLA",
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        seed=0,
        # on CPU this is the share of the machine's memory vLLM reserves: the tiny model needs little
        gpu_memory_utilization=spec.get("memory_share", 0.1),
        kv_transfer_config=transfer,
        # exact loads on CPU (docs/VLLM.md): vLLM CPU's rotary kernel reads MLA's strided rope key wrong
        compilation_config={"custom_ops": ["-rotary_embedding"]} if spec.get("torch_rotary", True) else None,
        disable_log_stats=not spec.get("metrics", False),
    )
    return llm


def main(spec_path: str, out_path: str) -> None:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = make_llm(spec)
    limits = spec["max_tokens"]
    if isinstance(limits, int):
        limits = [limits] * len(spec["prompts"])
    results = []
    for entry, limit in zip(spec["prompts"], limits, strict=True):
        if isinstance(entry, dict):  # a next turn of an earlier prompt's conversation
            earlier = results[entry["after"]]
            tokens = earlier["prompt"] + earlier["tokens"] + entry["extra"]
        else:
            tokens = entry
        params = SamplingParams(temperature=0.0, max_tokens=limit, logprobs=5)
        started = time.perf_counter()
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        wait_for_saves((spec.get("connector") or {}).get("stats_dir"))
        completion = output.outputs[0]
        first = completion.logprobs[0] if completion.logprobs else {}
        results.append(
            {
                "prompt": list(tokens),
                "tokens": list(completion.token_ids),
                "first_logprobs": {str(k): v.logprob for k, v in first.items()},
                "seconds": seconds,
            }
        )
    counters = {}
    if spec.get("metrics"):
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:kvstore_"):
                name = metric.name.removeprefix("vllm:kvstore_")
                counters[name] = counters.get(name, 0) + int(getattr(metric, "value", 0))
    with open(out_path, "w") as f:
        json.dump({"results": results, "vllm_metrics": counters}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
