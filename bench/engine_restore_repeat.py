"""Restore the same 32k-token file into one engine several times: the first restore vs the steady state.

An engine's first restore allocates its staging buffers (and the reader's pinned ring); later ones
reuse them. For fp8 and int4 on a V2-Lite-geometry bf16 model: four restores of a 32k-token file
into an engine with warmed CUDA graphs and into one without, then the first step after the last.

    PYTHONPATH=. python3 bench/engine_restore_repeat.py      # CUDA only
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decode import _fill  # noqa: E402

from kvstore.engine import Engine, preset, random_model  # noqa: E402

LENGTH = 32768
RESTORES = 4


def _seconds(fn) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def main() -> int:
    cfg = preset("v2-lite")
    model = random_model(cfg, seed=0, device="cuda", dtype="bfloat16")
    geometry = cfg.coli_geometry()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "session.coli_kv"
        for tier in ("fp8", "int4"):
            source = Engine(model, tier=tier, cuda_graphs=False)
            _fill(source, LENGTH, 1)
            path.write_bytes(source.export_rows().encode_file(geometry))
            del source
            for graphs in (True, False):
                engine = Engine(model, tier=tier, cuda_graphs=graphs)
                if graphs:
                    engine.warm_graphs(LENGTH + 1)
                restores = [_seconds(lambda engine=engine: engine.restore_file(path)) for _ in range(RESTORES)]
                step = _seconds(lambda engine=engine: int(engine.decode_logits(5, engine.cache.length).argmax()))
                print(
                    f"{tier} {'graphs' if graphs else 'plain'} restore ms {[round(s * 1e3, 1) for s in restores]} "
                    f"first step ms {step * 1e3:.1f}"
                )
                del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
