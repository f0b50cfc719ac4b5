"""The f32 / bf16 decode-attention kernels (Triton, :mod:`kvstore.gpu.triton_backend`) against the
torch path they replace and against the device's copy bandwidth, on a CUDA device.

Per case: microseconds per call replayed in a CUDA graph (what the engine's decode step pays), the
host time of a plain call (1,000 back-to-back calls, one synchronization), the bytes a call must
read (every attended row once) over the graph time as a share of the copy bandwidth measured in
the same run, the torch path's graph time on the same data, and the relative error against float64.

    python bench/gpu_dense.py                 # the table
    python bench/gpu_dense.py --sweep         # also tile rows x stages x warps on two cases
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from kvstore.gpu import registry, testing, triton_backend

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_attention import _cases, copy_bandwidth, time_kernel  # noqa: E402
from gpu_host import host_us  # noqa: E402

BATCH_LENGTHS = [
    1024,
    2048,
    3072,
    4096,
    6144,
    8192,
    10240,
    12288,
    14336,
    16384,
    20480,
    24576,
    26624,
    28672,
    30720,
    32768,
]
# bench/engine_decode.py --batch 16: 16 contexts spread over 1k..32k in a pool of 327,680 rows
ENGINE_LENGTHS = [int(n) for n in np.linspace(1024, 32768, 16)]
ENGINE_POOL = 327680
CASES = [  # (label, lengths, heads, rows past the sequences)
    ("1 x 1k", [1024], 16, 0),
    ("1 x 32k", [32768], 16, 0),
    ("1 x 32k in 64k rows", [32768], 16, 32768),  # a decode graph's bucket: lengths bounded by the rows
    ("1 x 128k", [131072], 16, 0),
    ("1 x 32k, 128 heads", [32768], 128, 0),
    ("16 ragged 1k..32k", BATCH_LENGTHS, 16, 0),
    # the engine's 16-session pool (bench/engine_decode.py --batch 16): room after the live rows
    ("16 sessions in a pool", ENGINE_LENGTHS, 16, ENGINE_POOL - sum(ENGINE_LENGTHS)),
]


def row_bytes(case) -> int:
    return sum(t.element_size() * t.shape[1] for t in (case.lc_codes, case.rc_codes))


def _padded(case, rows: int):
    """``case`` with ``rows`` more unused rows after its sequences (lengths stay on the device)."""
    if rows:
        case.lc_codes = torch.cat([case.lc_codes, case.lc_codes[:rows]])
        case.rc_codes = torch.cat([case.rc_codes, case.rc_codes[:rows]])
    return case


def run_case(tier, label, lengths, heads, copy_bw, seed, with_torch=True, pad_rows=0) -> dict:
    triton_be = registry.instance("triton", "cuda")
    cases = [_padded(c, pad_rows) for c in _cases(tier, lengths, heads, None, 2, seed)]
    got = testing.decode(cases[0], testing.poisoned_out(cases[0]), backend=triton_be)
    err = testing.relative_error(got, testing.reference(cases[0]))
    us = time_kernel(triton_be, cases)
    c = cases[0]
    out = testing.poisoned_out(c)
    # a plain call as the engine makes it: a trusted batch of its rows, then the entry point
    host = host_us(lambda: triton_be.decode(c.q_lat, c.q_rope, c.batch(trusted=True), c.softmax_scale, out), 1000)
    torch_us = time_kernel(registry.instance("torch", "cuda"), cases) if with_torch else float("nan")
    n_bytes = sum(lengths) * row_bytes(c)
    return {
        "tier": tier,
        "case": label,
        "graph_us": us,
        "plain_host_us": host,
        "torch_graph_us": torch_us,
        "bytes_GB_s": n_bytes / (us * 1e-6) / 1e9,
        "of_copy": n_bytes / (us * 1e-6) / copy_bw,  # the floor of bench/gpu_attention.py: bytes / copy bandwidth
        "rel_err": err,
    }


def sweep(copy_bw, seed) -> None:
    print("\nsweep: programs per SM x fewest tiles x merge dims x merge splits (f32, graph replay us)")
    print("| programs/SM | min tiles | merge dims | merge splits | 1 x 1k | 1 x 32k | 16 in a pool |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    knobs = ("PROGRAMS_PER_SM", "MIN_TILES", "MERGE_DIMS", "MERGE_SPLITS")
    saved = [getattr(triton_backend, name) for name in knobs]
    grid = [(2, 1, d, n) for d in (512, 128, 64, 32) for n in (16, 32)] + [(2, 2, 64, 16), (1, 1, 64, 16)]
    pad = ENGINE_POOL - sum(ENGINE_LENGTHS)
    for values in grid:
        for name, value in zip(knobs, values):
            setattr(triton_backend, name, value)
        cells = " | ".join(str(v) for v in values)
        try:
            a = run_case("f32", "1 x 1k", [1024], 16, copy_bw, seed, with_torch=False)
            b = run_case("f32", "1 x 32k", [32768], 16, copy_bw, seed, with_torch=False)
            c = run_case("f32", "16", ENGINE_LENGTHS, 16, copy_bw, seed, with_torch=False, pad_rows=pad)
        except Exception as exc:  # out of shared memory or registers for this combination
            print(f"| {cells} | {type(exc).__name__} | |", flush=True)
            continue
        print(f"| {cells} | {a['graph_us']:.1f} | {b['graph_us']:.1f} | {c['graph_us']:.1f} |", flush=True)
    for name, value in zip(knobs, saved):
        setattr(triton_backend, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep without the table")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tiers", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    parser.add_argument("--no-torch", action="store_true", help="skip the torch path's column")
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (bytes read + written)")
    print(
        "| tier | case | graph us | plain call host us | torch path graph us | speed-up | GB/s read | of copy bw | rel err |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for tier in args.tiers if not args.sweep_only else ():
        for label, lengths, heads, pad in CASES:
            r = run_case(tier, label, lengths, heads, copy_bw, args.seed, with_torch=not args.no_torch, pad_rows=pad)
            print(
                f"| {tier} | {label} | {r['graph_us']:.1f} | {r['plain_host_us']:.1f} | {r['torch_graph_us']:.1f} | "
                f"{r['torch_graph_us'] / r['graph_us']:.1f}x | {r['bytes_GB_s']:.0f} | {r['of_copy']:.0%} | "
                f"{r['rel_err']:.1e} |",
                flush=True,
            )
    if args.sweep or args.sweep_only:
        sweep(copy_bw, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
