"""A connector's load of one stored prefix: from the hot tier in host memory vs from the store.

One process, a real store in a temporary folder: a prompt of ``--tokens`` tokens with random rows of
``--layers`` layers x 576 values (DeepSeek-V3's row: kv_lora 512 + qk_rope 64) is saved in each
``--tiers`` tier, then loaded whole ``--repeats`` times each way, in one loop (alternating, so both
see the same machine):

- **disk hit**: ``PrefixCache.load`` with no hot tier (``hot_bytes: 0``): the index's tag, the
  journal read (the OS page cache is warm after the first repeat: this is the store's best case),
  the XXH3-128 check and the decode into f32 rows;
- **hot hit**: ``PrefixCache.load`` with a hot tier that holds the prompt: the rows copied out of
  host memory;
- each again **as a worker takes them** (``view=True, native=True``: read-only, in the tier's own
  type): a hit is a view of the entry, and a value tier's (f32, bf16) disk load a view of the
  records read, nothing decoded.

Printed per tier: the median time of each and the f32 rows' bytes per second. Usage::

    python bench/connector_hot_tier.py [--tokens 2000] [--layers 2] [--repeats 20] [--tiers f32,fp8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore import tiers
from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import PrefixCache, model_fingerprint
from kvstore.formats.coli_kv import Geometry
from kvstore.store import SessionStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tiers", default="f32,fp8")
    args = parser.parse_args()
    geometry = Geometry(args.layers, 512, 64, 0, 0, 1 << 16)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((args.layers, args.tokens, 576)).astype(np.float32)
    prompt = rng.integers(0, 1 << 16, size=args.tokens).astype(np.int32)
    mb = rows.nbytes / 1e6
    print(f"connector loads of one {args.tokens}-token prompt x {args.layers} layers ({mb:.1f} MB of f32 rows)")
    with tempfile.TemporaryDirectory(prefix="kvstore-hot-bench-") as folder:
        with SessionStore(Path(folder) / "kv") as store:
            for name in args.tiers.split(","):
                fingerprint = model_fingerprint(
                    name="bench",
                    revision="main",
                    geometry=geometry,
                    tier=tiers.get(name),
                    attention_variant="vllm-mla:float32",
                    weights_hash="sampled-blake2b:bench",
                )
                disk = PrefixCache(store, "bench", fingerprint)
                hot = PrefixCache(store, "bench", fingerprint, hot=HotTier(4 * rows.nbytes))
                session = disk.save(prompt, rows)
                assert session is not None
                expected = disk.load(session, 0, args.tokens)
                assert hot.load(session, 0, args.tokens).tobytes() == expected.tobytes()  # kept by this load
                # as a worker takes them (``view``, ``native``): rows as the tier stores them (bf16's
                # bit patterns: half the bytes of f32), read-only — a hit a view of the entry, a
                # value tier's disk load a view of the records read (nothing decoded)
                timed: dict[str, list[float]] = {"disk": [], "hot": [], "disk, worker": [], "hot, worker": []}
                for _ in range(args.repeats):
                    for label, cache, taken in (
                        ("disk", disk, {}),
                        ("hot", hot, {}),
                        ("disk, worker", disk, {"view": True, "native": True}),
                        ("hot, worker", hot, {"view": True, "native": True}),
                    ):
                        started = time.perf_counter()
                        cache.load(session, 0, args.tokens, **taken)
                        timed[label].append(time.perf_counter() - started)
                assert hot.stats.hot_hits == 2 * args.repeats and hot.stats.hot_misses == 1
                d, m = statistics.median(timed["disk"]), statistics.median(timed["hot"])
                print(
                    f"{name:>5}: disk hit median {d * 1e3:7.2f} ms ({mb / 1e3 / d:6.2f} GB/s), "
                    f"hot hit median {m * 1e3:7.2f} ms ({mb / 1e3 / m:6.2f} GB/s): {d / m:5.1f}x"
                    f"; hot tier holds {hot.stats.hot_bytes / 1e6:.1f} MB"
                )
                d, m = statistics.median(timed["disk, worker"]), statistics.median(timed["hot, worker"])
                print(
                    f"{'':>5}  as a worker takes them ({hot.native_dtype}, read-only): disk {d * 1e3:7.2f} ms "
                    f"({mb / 1e3 / d:6.2f} GB/s of f32-equivalent rows), hot {m * 1e3:7.2f} ms"
                )


if __name__ == "__main__":
    main()
