"""What a connector's save costs the serving step, in the step (``save_queue: 0``) and off it.

One process, a real store in a temporary folder: prompts of ``--tokens`` tokens with random f32 rows
of ``--layers`` layers x 576 values (DeepSeek-V3's row: kv_lora 512 + qk_rope 64) are saved

- **in the step**: ``PrefixCache.save`` (encode, the XXH3 tag, append with its fsyncs), as the vLLM
  connector's ``wait_for_save`` did before issue 38 and does with ``save_queue: 0``;
- **off the step**: ``SaveWriter.submit`` (what ``wait_for_save`` does now), then, untimed for the
  step, the writer's thread doing the same save; ``--prompts`` saves, the queue sized to hold them.

Printed: per prompt, the median time the step spends on the save each way, and the time the writer
took to make all of them durable. Usage::

    python bench/connector_saves.py [--tokens 2000] [--layers 2] [--prompts 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import tiers
from kvstore.connectors.prefix_cache import PrefixCache, model_fingerprint
from kvstore.connectors.save_writer import SaveWriter
from kvstore.formats.coli_kv import Geometry
from kvstore.store import SessionStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    geometry = Geometry(args.layers, 512, 64, 0, 0, 1 << 16)
    fingerprint = model_fingerprint(
        name="bench",
        revision="main",
        geometry=geometry,
        tier=tiers.F32,
        attention_variant="vllm-mla:float32",
        weights_hash="sampled-blake2b:bench",
    )
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((args.layers, args.tokens, 576)).astype(np.float32)
    prompts = [rng.integers(0, 1 << 16, size=args.tokens).astype(np.int32) for _ in range(2 * args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kvstore-saves-bench-") as folder:
        with SessionStore(Path(folder) / "kv") as store:
            cache = PrefixCache(store, "bench", fingerprint)
            in_step = []
            for prompt in prompts[: args.prompts]:
                started = time.perf_counter()
                assert cache.save(prompt, rows) is not None
                in_step.append(time.perf_counter() - started)
            writer = SaveWriter(cache, capacity=args.prompts)
            off_step = []
            began = time.perf_counter()
            for prompt in prompts[args.prompts :]:
                started = time.perf_counter()
                assert writer.submit(prompt, rows)
                off_step.append(time.perf_counter() - started)
            writer.flush()
            durable = time.perf_counter() - began
            writer.close()
            assert cache.stats.saves == 2 * args.prompts and cache.stats.save_skipped == 0
    mb = rows.nbytes / 1e6
    print(
        f"connector saves, {args.prompts} prompts of {args.tokens} tokens x {args.layers} layers ({mb:.1f} MB f32 each)"
    )
    print(f"in the step  (save_queue 0): median {statistics.median(in_step) * 1e3:8.2f} ms a prompt")
    print(
        f"off the step (SaveWriter):   median {statistics.median(off_step) * 1e3:8.3f} ms a prompt; "
        f"all {args.prompts} durable after {durable:.2f} s"
    )


if __name__ == "__main__":
    main()
