"""The vLLM connector's cost inside a GPU step, without vLLM (issue 38, item 6).

A synthetic prefill step shaped like DeepSeek-V2-Lite's (27 layers; per layer the bf16 GEMMs of
its projections and of its active experts as dense GEMMs, and the write of the layer's latent rows
into a paged MLA cache ``[blocks, 16, 576]``), run with and without the connector's worker calls
between the layers, as vLLM makes them (``save_kv_layer`` after each layer's attention,
``wait_for_save`` at the end of the step: :class:`~kvstore.connectors.vllm_worker.PagedWorker`),
each step completing a new prompt that is saved to a real store (bf16 tier, background writer).
Times by CUDA events on the engine's stream and by the host's clock to the step's return; the
ratio is the connector's cost. Steps with and without alternate, after warm-up rounds.

    PYTHONPATH=. python3 bench/vllm_gpu_step.py --tokens 512 2048 --load 2048 8192 --steps 30

With ``--load``, steps of 512 tokens whose prompt's first rows are loaded (a hot-tier hit: pinned
host memory), each layer's attention waiting for its own layer's copies (``wait_for_layer_load``).
With ``--settle``, the writer finishes its saves before each step: what the connector's calls cost
the step by themselves, apart from its writer thread's work beside the step (the two differ where
the writer's Python holds the GIL the step's launches wait for). ``--widen``: the writer widens
the rows to f32 first, as the connector did before it handed over the cache's bf16 bits.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvstore import tiers
from kvstore.connectors.hot_tier import HotTier
from kvstore.connectors.prefix_cache import PrefixCache, model_fingerprint
from kvstore.connectors.save_writer import SaveWriter
from kvstore.connectors.vllm_worker import LoadSpec, PagedWorker, SaveSpec, paged_slots
from kvstore.formats.coli_kv import Geometry
from kvstore.store import SessionStore

LAYERS, HIDDEN, KV_LORA, QK_ROPE, HEADS = 27, 2048, 512, 64, 16
ACTIVE_FFN = 8 * 1408  # 6 routed + 2 shared experts of 1,408 each, as one dense GEMM pair
BLOCK = 16


class SyntheticModel:
    """Weights drawn once; :meth:`step` runs one prefill step of ``tokens`` tokens."""

    def __init__(self, device: torch.device):
        def w(i: int, o: int) -> torch.Tensor:
            return torch.randn(i, o, device=device, dtype=torch.bfloat16) / i**0.5

        self.layers = [
            {
                "q": w(HIDDEN, HEADS * 192),
                "kv_a": w(HIDDEN, KV_LORA + QK_ROPE),
                "kv_b": w(KV_LORA, HEADS * 256),
                "o": w(HEADS * 128, HIDDEN),
                "up": w(HIDDEN, 2 * ACTIVE_FFN),
                "down": w(ACTIVE_FFN, HIDDEN),
            }
            for _ in range(LAYERS)
        ]

    def step(
        self, x: torch.Tensor, caches: list[torch.Tensor], slots: torch.Tensor, between=None, before=None
    ) -> torch.Tensor:
        for i, p in enumerate(self.layers):
            if before is not None:
                before(i)  # vLLM calls wait_for_layer_load as the layer's attention starts
            q = x @ p["q"]
            latent = x @ p["kv_a"]
            caches[i].view(-1, KV_LORA + QK_ROPE)[slots] = latent  # the attention's cache write
            kv = latent[:, :KV_LORA] @ p["kv_b"]
            attn = (q[:, : HEADS * 128] * kv[:, : HEADS * 128]).contiguous()  # stands in for attention
            x = x + attn @ p["o"]
            if between is not None:
                between(i)  # vLLM calls save_kv_layer after the layer's attention
            h = x @ p["up"]
            x = x + (torch.nn.functional.silu(h[:, :ACTIVE_FFN]) * h[:, ACTIVE_FFN:]) @ p["down"]
        return x


class Bench:
    """One step length: the caches, the store, the worker, and a timed step with or without it.
    With ``loaded`` rows, the connector's step loads a stored prefix of that many rows (a hot-tier
    hit) before computing its ``n`` tokens; without, it saves its ``n`` tokens' rows."""

    def __init__(self, model: SyntheticModel, n: int, folder: Path, queue: int, loaded: int = 0, hot: int = 8 << 30):
        device = torch.device("cuda")
        self.model, self.n = model, n
        blocks, load_blocks = (n + BLOCK - 1) // BLOCK, (loaded + BLOCK - 1) // BLOCK
        self.caches = [
            torch.zeros(blocks + load_blocks + 8, BLOCK, KV_LORA + QK_ROPE, device=device, dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        self.block_ids = list(range(3, 3 + blocks))
        self.slots = paged_slots(self.block_ids, BLOCK, 0, n).to(device)
        self.x = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
        geometry = Geometry(LAYERS, KV_LORA, QK_ROPE, 0, 0, 102400)
        fingerprint = model_fingerprint(
            name="synthetic-v2-lite",
            revision="main",
            geometry=geometry,
            tier=tiers.BF16,
            attention_variant="vllm-mla:bfloat16",
            weights_hash="synthetic",
        )
        self.store = SessionStore(folder / "kv")
        self.cache = PrefixCache(self.store, "bench", fingerprint, hot=HotTier(hot) if hot else None)
        self.worker = PagedWorker(self.cache, geometry, BLOCK, SaveWriter(self.cache, queue))
        self.worker.register_kv_caches(dict(zip(self.names, self.caches, strict=True)))
        self.prompts = 0
        self.load = None
        if loaded:  # a stored prefix, in the hot tier (pinned host memory) after one load
            rows = torch.randn(LAYERS, loaded, KV_LORA + QK_ROPE).bfloat16().float().numpy()
            session = self.cache.save(np.arange(loaded) + 60000, rows)
            assert session is not None
            self.cache.load(session, 0, loaded)
            first = 3 + blocks
            self.load = LoadSpec("prefix", session, 0, loaded, list(range(first, first + load_blocks)))

    def _save_layer(self, save: SaveSpec, i: int) -> None:
        self.worker.save_layer([save], self.names[i], self.caches[i])

    def _wait_layer(self, i: int) -> None:
        self.worker.wait_for_layer(self.names[i])

    def run(self, with_connector: bool) -> tuple[float, float]:
        """One step: (µs by CUDA events, µs on the host until the step returned)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        if not with_connector:
            self.model.step(self.x, self.caches, self.slots)
        elif self.load is not None:  # the rest of a prompt whose prefix is loaded
            self.worker.start_load([self.load])
            self.model.step(self.x, self.caches, self.slots, before=self._wait_layer)
            self.worker.wait_for_save([], [])
        else:
            self.prompts += 1  # a new prompt each step: never "stored already"
            save = SaveSpec(f"r{self.prompts}", (np.arange(self.n) + self.prompts * 7).tolist(), self.block_ids)
            self.model.step(self.x, self.caches, self.slots, between=lambda i: self._save_layer(save, i))
            self.worker.wait_for_save([save], [])
        end.record()
        host = time.perf_counter() - began  # the step has returned: vLLM samples, then syncs
        end.synchronize()
        return start.elapsed_time(end) * 1e3, host * 1e6

    def close(self) -> None:
        self.worker.shutdown()
        self.store.close()


def measure(model: SyntheticModel, n: int, loaded: int, args: argparse.Namespace) -> str:
    """One table row: the median step with and without the connector, alternating."""
    with tempfile.TemporaryDirectory(dir=args.where) as folder:
        bench = Bench(model, n, Path(folder), args.queue, loaded, int(args.hot * (1 << 30)))
        if args.widen:  # the writer widens bf16 rows to f32 and the bf16 tier narrows them back
            bench.worker._save_bits = False
        try:
            for _ in range(5):  # warm-up: cuBLAS heuristics, the pinned allocator, the writer
                bench.run(False)
                bench.run(True)
            assert bench.worker.writer is not None
            bench.worker.writer.flush()
            stats = bench.cache.stats
            saved, skipped = stats.saves, stats.save_skipped
            plain, connected = [], []
            for _ in range(args.steps):
                if args.settle:
                    bench.worker.writer.flush()
                plain.append(bench.run(False))
                if args.settle:
                    bench.worker.writer.flush()
                connected.append(bench.run(True))
            bench.worker.writer.flush()
            saved, skipped = stats.saves - saved, stats.save_skipped - skipped
        finally:
            bench.close()
    gpu_plain, gpu_conn = (statistics.median(t[0] for t in ts) for ts in (plain, connected))
    host_plain, host_conn = (statistics.median(t[1] for t in ts) for ts in (plain, connected))
    what = f"load {loaded:,} rows" if loaded else f"save {saved} / skip {skipped}"
    return (
        f"| {n:,} | {what} | {gpu_plain:,.0f} µs | {gpu_conn:,.0f} µs | {gpu_conn / gpu_plain:.3f} "
        f"| {host_plain:,.0f} µs | {host_conn:,.0f} µs | {host_conn / host_plain:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="tokens a step computes")
    parser.add_argument("--load", type=int, nargs="*", default=[2048, 8192], help="prefix rows loaded (steps of 512)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    parser.add_argument("--queue", type=int, default=4, help="the writer's queue (save_queue)")
    parser.add_argument("--hot", type=float, default=8, help="the hot tier's budget in GiB (0: none)")
    parser.add_argument("--where", default=None, help="the store's folder (default: a temporary one)")
    parser.add_argument(
        "--settle",
        action="store_true",
        help="let the writer finish before every step: the connector's own cost in the step, without "
        "the writer's thread working beside it (the default runs steps back to back, as a busy server)",
    )
    parser.add_argument(
        "--widen",
        action="store_true",
        help="hand the writer f32 rows (widened on its thread, narrowed back by the bf16 tier) instead of "
        "the cache's bf16 bits: the connector before it saved bits, for a side-by-side",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    model = SyntheticModel(torch.device("cuda"))
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}; {LAYERS} layers, bf16, tier bf16")
    print(
        "| tokens computed | the connector's work | step, no connector (CUDA events) | with the connector | ratio "
        "| host: to the step's return, no connector | with | ratio |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        print(measure(model, n, 0, args), flush=True)
    for loaded in args.load:
        print(measure(model, 512, loaded, args), flush=True)


if __name__ == "__main__":
    main()
