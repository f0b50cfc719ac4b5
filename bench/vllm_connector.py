"""The kvstore vLLM connector per tier (f32, fp8, int4), inside real vLLM processes.

One vLLM process per tier (CPU, the tests' tiny random DeepSeek-V3 in float32, embedded mode, a
fresh store folder), running one prompt after another:

1. a warm-up prompt (100 tokens);
2. a 2,000-token prompt, one generated token: **computed** (and saved), timed;
3. the same prompt again: **loaded** from the store (1,984 tokens), timed — time to first token,
   computed vs loaded, in the same run; and the first token's top-5 logprobs of both;
4. a 300-token prompt, 16 tokens generated, computed then loaded: the tokens compared.

Printed per tier: time to first token computed and loaded, the generated tokens that agree (loaded
vs computed, position by position until the first difference, and in all), the first token's
argmax agreement and max |Δ logprob| over the top-5 ids both runs report, and the bytes stored per
token (journal bytes on disk / stored tokens; per layer too). f32 is the control: its rows load
back exactly, so what differs there is vLLM's own arithmetic (the stored prefix is attended from
the cache, the computed one within the prefill).

``--service`` adds the f32 tier in service mode: the same process against a ``kvstore serve`` on
127.0.0.1 (rows over HTTP, verified by the server).

Needs vLLM's venv (tests/vllm/setup_venv.sh). Usage::

    python bench/vllm_connector.py [--tiers f32,fp8,int4] [--prompt-tokens 2000] [--service]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVSTORE_VLLM_VENV") or ROOT / ".vllm-venv")
RUNNER = ROOT / "tests" / "vllm" / "run_vllm.py"


def make_model(folder: Path) -> Path:
    spec = importlib.util.spec_from_file_location("kvstore_tiny_vllm_model", ROOT / "tests" / "vllm" / "tiny_model.py")
    assert spec is not None and spec.loader is not None
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.make_model(folder, seed=0)


def run(tmp: Path, model: Path, prompts: list[list[int]], limits: list[int], connector: dict) -> list[dict]:
    spec, out = tmp / "spec.json", tmp / "out.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": limits, "connector": connector}))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(VENV / "bin" / "python"), str(RUNNER), str(spec), str(out)],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
    )
    if done.returncode != 0:
        raise SystemExit((done.stdout + done.stderr)[-4000:])
    return json.loads(out.read_text())["results"]


def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(leading tokens equal, tokens equal in all)."""
    lead = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return lead, sum(x == y for x, y in zip(a, b))


def first_token_distance(computed: dict, loaded: dict) -> tuple[bool, float, int]:
    """(argmax equal, max |Δ logprob| over the top-k ids both report, how many ids they share)."""
    a, b = computed["first_logprobs"], loaded["first_logprobs"]
    shared = sorted(set(a) & set(b))
    delta = max((abs(a[k] - b[k]) for k in shared), default=float("nan"))
    return computed["tokens"][0] == loaded["tokens"][0], delta, len(shared)


def stored_bytes_per_token(store: Path) -> float:
    from kvstore.formats.coli_kv import HEADER_BYTES, read_header

    body = tokens = 0
    for path in (store / "journals").glob("*.coli_kv"):
        header, _ = read_header(path)
        body += path.stat().st_size - HEADER_BYTES
        tokens += header.nrec
    return body / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiers", default="f32,fp8,int4", help="comma-separated tiers to run")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the timed prompt's length")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens generated for the agreement check")
    parser.add_argument("--service", action="store_true", help="also f32 through a kvstore serve (service mode)")
    args = parser.parse_args()
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"vLLM's venv is missing at {VENV}: run tests/vllm/setup_venv.sh")
    rng = np.random.default_rng(2000)
    warm = rng.integers(2, 512, size=100).tolist()
    long = rng.integers(2, 512, size=args.prompt_tokens).tolist()
    short = rng.integers(2, 512, size=300).tolist()
    prompts = [warm, long, long, short, short]
    limits = [1, 1, 1, args.decode_tokens, args.decode_tokens]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = make_model(tmp / "tiny-dsv3")
        runs = [(tier, tier) for tier in args.tiers.split(",")] + ([("f32 service", "f32")] if args.service else [])
        for label, tier in runs:
            work = tmp / label.replace(" ", "-")
            work.mkdir()
            connector = {"store": str(work / "kv"), "tier": tier, "stats_dir": str(work / "stats")}
            server = None
            if label.endswith("service"):
                sys.path.insert(0, str(ROOT / "tests"))
                from served import ServeProcess

                key = "bench-key-0123456789abcdefghij"
                server = ServeProcess(work / "kv", env={"KVSTORE_API_KEYS": f"{key}:bench"}).start()
                connector = {"url": server.url, "api_key": key, "tier": tier, "stats_dir": str(work / "stats")}
            try:
                _, computed, loaded, short_computed, short_loaded = run(work, model, prompts, limits, connector)
            finally:
                if server is not None:
                    server.stop_cleanly()
            counts: dict[str, int] = {}
            for path in (work / "stats").glob("worker-*.json"):
                for key, value in json.loads(path.read_text()).items():
                    if isinstance(value, int):
                        counts[key] = counts.get(key, 0) + value
            same, delta, shared = first_token_distance(computed, loaded)
            lead, equal = agreement(short_computed["tokens"], short_loaded["tokens"])
            per_token = stored_bytes_per_token(work / "kv")
            rows.append(
                (label, computed["seconds"], loaded["seconds"], counts, same, delta, shared, lead, equal, per_token)
            )
    print(
        f"vLLM connector, tiny DeepSeek-V3 (2 layers, kv_lora 512, qk_rope 64), float32, CPU, {args.prompt_tokens}-token prompt"
    )
    print(
        "tier        | TTFT computed s | TTFT loaded s | loaded tok (both prompts) | first token same | max |Δlogprob| top-5 (shared) "
        f"| {args.decode_tokens} tokens: leading equal / equal | bytes/token (per layer)"
    )
    for tier, t_comp, t_load, counts, same, delta, shared, lead, equal, per_token in rows:
        print(
            f"{tier:11} | {t_comp:15.3f} | {t_load:13.3f} | {counts.get('loaded_tokens', 0):25} | {str(same):16} "
            f"| {delta:.2e} ({shared}) | {lead} / {equal} of {args.decode_tokens} | {per_token:.0f} ({(per_token - 4) / 2:.0f})"
        )


if __name__ == "__main__":
    main()
