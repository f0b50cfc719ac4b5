"""A decode step's cache write for one layer, on a CUDA device: the one-kernel encode-and-store
(:mod:`kvstore.gpu.encode_kernels`, what ``LatentCache.write_at`` runs) against the torch twins'
encode and ``store_at`` (four ``index_copy_``), eager and ``torch.compile``d as the step ran them
before, and against peers measured in the same run: torch's own fp8 conversion of the same rows
(``x.to(torch.float8_e4m3fn)``, no scale, no store) and an empty kernel launch.

Per tier (fp8, int4, f32) and rows per call (1, 16, 64 sessions: a V2-Lite layer's 512 latent and
64 rope values each, bf16 as the model gives them): microseconds per call replayed in a CUDA graph
(what a decode step sees) and per plain call (host launch included), and the bytes of every path
compared with the kernel's.

    python bench/engine_encode.py
"""

from __future__ import annotations

import sys

import torch

from kvstore.engine import CacheGeometry, make_cache
from kvstore.engine.cache import encode_fields
from kvstore.gpu import codecs
from kvstore.tiers import TIERS

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from engine_experts import graph_us  # noqa: E402
from gpu_host import host_us  # noqa: E402

ROWS = (1, 16, 64)
GEOMETRY = CacheGeometry(n_layers=1, kv_lora=512, qk_rope=64)


def case(tier: str, rows: int, compiled) -> tuple[list[float], bool]:
    """(graph µs of the kernel, compiled twins, eager twins; plain µs of the kernel; graph µs of
    torch's fp8 cast) for one layer's write of ``rows`` rows, and whether the caches agree."""
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(rows)
    lc = torch.randn(rows, 512, device=cuda, generator=gen).to(torch.bfloat16)
    rc = torch.randn(rows, 64, device=cuda, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(256, device=cuda, generator=gen)[:rows]
    fused = make_cache(tier, GEOMETRY, cuda, capacity=256)
    twins = make_cache(tier, GEOMETRY, cuda, capacity=256)
    twins.write_kernels = None
    assert fused.write_kernels is not None, "no encode kernel for this tier here"

    def by_kernel():
        fused.write_at(0, slots, lc, rc)

    def by_twins():
        twins.store_at(0, slots, encode_fields(twins.tier, lc.float(), rc.float()))

    def by_compiled():
        twins.store_at(0, slots, compiled(tier, lc, rc))

    def by_cast():
        return lc.float().to(torch.float8_e4m3fn), rc.float().to(torch.float8_e4m3fn)

    times = [graph_us(by_kernel), graph_us(by_compiled), graph_us(by_twins), host_us(by_kernel, 200), graph_us(by_cast)]
    by_kernel()
    by_twins()
    names = ("lc", "rc") if fused.tier.holds_values else ("lc", "lc_scales", "rc", "rc_scales")
    return times, all(torch.equal(fused.field(n), twins.field(n)) for n in names)


def main() -> None:
    codecs.use_encode_kernels(True)  # the caches made here take the kernel (the default)
    compiled = torch.compile(lambda name, lc, rc: encode_fields(TIERS[name], lc.float(), rc.float()))
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    print("| tier | rows | kernel graph µs | twins compiled + store | twins eager + store | kernel plain µs "
          "| torch fp8 cast | empty launch | same bytes |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    empty = torch.empty(1, device="cuda")
    launch = graph_us(lambda: empty.zero_())
    for tier in ("fp8", "int4", "f32"):
        for rows in ROWS:
            times, same = case(tier, rows, compiled)
            cells = " | ".join(f"{t:.1f}" for t in (*times, launch))
            print(f"| {tier} | {rows} | {cells} | {'yes' if same else 'NO'} |")
    print("graph: a 10-call CUDA graph's replay / 10 (median of 20); plain: wall time per call, drained")


if __name__ == "__main__":
    main()
