"""Where the v2 decode kernel's time goes: time it with stages left out, on the same data.

Each *ablation* is the kernel source with one stage removed by a text edit (the edited kernels
compute wrong results and are only timed); the differences between their times and the full
kernel's place the time of each stage inside one launch, which a profiler's stall samples only
hint at. The table also keeps the variants tried and not adopted (``pv-alu``, ``prefetchN``,
``offsetN``: correct kernels, so their error column is meaningful), and ``@FILE`` times another
version of the kernel source beside this one (an A/B on the same data). Usage::

    python bench/gpu_stages.py [--tiers fp8,int4] [--heads 16] [--rows 131072,1048576] [--batch 1]
        [--only full,pv-alu]

``--wgmma`` does the same for the warpgroup-MMA kernels of ``gpu/wgmma_kernels.py`` (64+ heads,
sm_90, Triton 3.6): their ablations are edits of that module's source (:data:`WGMMA_ABLATIONS`),
loaded as a module of its own and run through the CUDA backend (query staging and un-rotation
included)::

    python bench/gpu_stages.py --wgmma --tiers fp8,int4 --heads 64,128 --rows 131072,1048576

``--batch B`` (B > 1) times ragged batches of B sequences, the longest ``--rows`` rows (the
benchmark's ragged case).

Prints, per problem: µs, % of the copy bandwidth and the relative error against float64 of every
variant (an ablation's error is large by construction).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstore.gpu import cuda_build, testing, wgmma_kernels
from kvstore.gpu.cuda_backend import CudaBackend

sys.path.insert(0, __import__("os").path.dirname(__file__))
from gpu_attention import _cases, copy_bandwidth, time_kernel  # noqa: E402

#: name -> [(old text, new text), ...]; every old text must occur in the source exactly once.
#: Names combine with "+" (edits applied in order).
_LOOP = "        if (blk + 1 < blk1) issue(blk + 1, buf ^ 1);\n"
_PV_CVT = """                        const u32 pr = prmt(v[q], 0u, 0x3120u);  // (r, 2n) (r+1, 2n) | (r, 2n+1) (r+1, 2n+1)
                        bf[4 * jb + 2 * sub][half] = e4m3_lo_to_f16x2(pr);
                        bf[4 * jb + 2 * sub + 1][half] = e4m3_hi_to_f16x2(pr);"""
_PV_ALU = """                        const u32 lo = prmt(v[q], 0u, 0x2404u), hi = prmt(v[q], 0u, 0x3414u);
                        bf[4 * jb + 2 * sub][half] = (lo & 0x80008000u) | ((lo >> 1) & 0x3F803F80u);
                        bf[4 * jb + 2 * sub + 1][half] = (hi & 0x80008000u) | ((hi >> 1) & 0x3F803F80u);"""


def _prefetch(distance: int) -> list[tuple[str, str]]:
    """One thread asks the copy engine to bring tile blk + distance into L2 (three bulk
    prefetches: latent codes, rope codes, both scale runs rounded out to 16 bytes)."""
    body = """
        if (!GATHER && tid == 0 && PB < blk1) {
            const long long pbase = start + (long long)PB * BN;
            const int pvalid = (int)min((long long)min(T - PB * BN, BN), n_rows - pbase);
            if (pvalid > 0) {
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(lc + pbase * C::KB), "r"(pvalid * C::KB) : "memory");
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(rc + pbase * C::RB), "r"(pvalid * C::RB) : "memory");
            }
        }
"""
    first = "    for (int PB = blk0 + 2; PB < blk0 + %d; ++PB) {%s    }\n" % (distance, body)
    step = "    {const int PB = blk + %d;%s}\n" % (distance, body)
    return [("    issue(blk0, 0);\n", "    issue(blk0, 0);\n" + first), (_LOOP, _LOOP + step)]


ABLATIONS: dict[str, list[tuple[str, str]]] = {
    "full": [],
    # the fp8 NaN-score test after the softmax (the tiles here hold no NaN codes)
    "no-nan-check": [("if (FMT == 1 || attempt > 0 || *nan_s != blk + 1) break;", "break;")],
    # code bytes fed to the mma as f16 bits (no e4m3 / int4 conversion anywhere)
    "no-convert": [
        ("if (FMT == 1 || attempt > 0 || *nan_s != blk + 1) break;", "break;"),
        (
            "__device__ __forceinline__ u32 e4m3_lo_to_f16x2(u32 w) {\n    u32 r;",
            "__device__ __forceinline__ u32 e4m3_lo_to_f16x2(u32 w) {\n    return w;\n    u32 r;",
        ),
        (
            "__device__ __forceinline__ u32 e4m3_hi_to_f16x2(u32 w) {\n    u32 r;",
            "__device__ __forceinline__ u32 e4m3_hi_to_f16x2(u32 w) {\n    return w;\n    u32 r;",
        ),
        (
            "__device__ __forceinline__ void int4x8_to_f16(u32 w, const LevelTable& lt, u32* out) {",
            "__device__ __forceinline__ void int4x8_to_f16(u32 w, const LevelTable& lt, u32* out) {\n"
            "    out[0] = w; out[1] = w ^ 1u; out[2] = w ^ 2u; out[3] = w ^ 3u; return;",
        ),
    ],
    "no-pv": [("            pv(buf);\n        }\n    }\n", "        }\n    }\n")],
    # (stale scores may be NaN: the NaN-score test goes too, or the rare path would run)
    "no-qk": [("if (FMT == 1 || attempt > 0 || *nan_s != blk + 1) break;", "break;"), ("            qk(buf);\n", "\n")],
    # the tile loop only waits for its copies and issues the next ones
    "loads-only": [(_LOOP, _LOOP + "        continue;\n")],
    # no tiles at all: query prep, epilogue and merge only
    "empty": [
        ("    issue(blk0, 0);\n", ""),
        (
            "    for (int blk = blk0; blk < blk1; ++blk) {\n        const int buf = (blk - blk0) & 1;",
            "    for (int blk = blk0; blk < blk0; ++blk) {\n        const int buf = (blk - blk0) & 1;",
        ),
    ],
    # the merge launches but returns at once
    "merge-idle": [
        (
            "    const int h = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;",
            "    if (n_splits > 0) return;\n"
            "    const int h = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;",
        )
    ],
    # partial contexts are not written
    "no-store": [
        (
            "        float amax = 0.0f;\n",
            "        if (__all_sync(FULL_MASK, v[0] != 1234.5f)) continue;\n        float amax = 0.0f;\n",
        )
    ],
    # candidates (checked against float64):
    # fp8 P.V fragments converted with integer ops (the e4m3 bits shifted into f16's, which is the
    # value times 2^-8, exact) instead of the conversion unit; the epilogue multiplies by 2^8. Q.K^T
    # keeps cvt so NaN codes still show as NaN scores (the tile is cleared before P.V reads it).
    "pv-alu": [
        (_PV_CVT, _PV_ALU),
        (
            "const float vs = FMT == 1 ? rsqrtf((float)K) : 1.0f;",
            "const float vs = FMT == 1 ? rsqrtf((float)K) : 256.0f;",
        ),
    ],
    # odd splits start later, so the two blocks of an SM run their phases out of step
    "offset500": [("    issue(blk0, 0);\n", "    if (split & 1) __nanosleep(500);\n    issue(blk0, 0);\n")],
    "offset1500": [("    issue(blk0, 0);\n", "    if (split & 1) __nanosleep(1500);\n    issue(blk0, 0);\n")],
    "prefetch2": _prefetch(2),
    "prefetch3": _prefetch(3),
    "prefetch4": _prefetch(4),
}


#: The stages of the table in docs/GPU-LOG.md ("Where the time goes", round 3).
TABLE = ("full", "no-convert", "no-qk", "no-pv", "loads-only", "empty", "empty+merge-idle")


_QK = """        s_l = warpgroup_mma(q_l3.index(z), t_l.index(ring).permute((1, 0)), zero, is_async=True)
        s_r = warpgroup_mma(q_r3.index(z), t_r.index(ring).permute((1, 0)), zero, is_async=True)
"""
_QK_WAIT = "        s_l, s_r = warpgroup_mma_wait(0, deps=[s_l, s_r])\n"
_PV = """        tok = warpgroup_mma(p_sh, t_l.index(ring), acc, is_async=True)
        ctx = warpgroup_mma_wait(0, deps=[tok])
"""
#: Edits of gpu/wgmma_kernels.py: (old, new) text pairs, or ("", code) to append code to the module
#: (a later definition of a name replaces the kernel's when it is compiled).
WGMMA_ABLATIONS: dict[str, list[tuple[str, str]]] = {
    "full": [],
    # codes stored as they come (moves instead of the e4m3 conversion / the int4 lookup)
    "no-convert": [
        ("", '_E4M3 = gl.constexpr("mov.b32 $0, $2; mov.b32 $1, $2;")\n'),
        ("", '_INT4 = gl.constexpr("mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;")\n'),
    ],
    # the producer stores only the row scales (its code loads, conversions and stores are gone); it
    # still waits for each slot and signals it full
    "no-fetch": [
        (
            "        _put_tile(fetched, ring_bufs, ring, K, R, INT4)\n",
            "        ring_bufs[2].index(2 * ring).store(fetched[5])\n"
            "        ring_bufs[2].index(2 * ring + 1).store(fetched[6])\n",
        )
    ],
    "no-qk": [(_QK, "        s_l = zero + z.to(gl.float32)\n        s_r = zero\n"), (_QK_WAIT, "")],
    "no-pv": [(_PV, "        ctx = acc\n")],
}

#: The stages of the round-11 table in docs/GPU-LOG.md.
WGMMA_TABLE = ("full", "no-convert", "no-fetch", "no-qk", "no-pv", "no-fetch+no-qk", "no-fetch+no-qk+no-pv")


def wgmma_variant(name: str, folder: Path):
    """gpu/wgmma_kernels.py with the named edits, imported as a module of its own."""
    source = _edited(Path(wgmma_kernels.__file__).read_text(), name, WGMMA_ABLATIONS)
    stem = "wgmma_" + name.replace("+", "_").replace("-", "_")
    path = folder / f"{stem}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _kernels_from(module):
    """The CUDA backend imports kvstore.gpu.wgmma_kernels when it calls them: this module instead."""
    sys.modules["kvstore.gpu.wgmma_kernels"] = module
    try:
        yield
    finally:
        sys.modules["kvstore.gpu.wgmma_kernels"] = wgmma_kernels


class _VariantBackend:
    """A backend whose calls run one variant of the warpgroup-MMA kernels."""

    def __init__(self, module):
        self.inner = CudaBackend(torch.device("cuda"), wgmma=True)
        self.module = module

    def decode(self, q_lat, q_rope, batch, softmax_scale, out=None):
        with _kernels_from(self.module):
            return self.inner.decode(q_lat, q_rope, batch, softmax_scale, out)


def patched(name: str) -> str:
    """The kernel source with the named edits; ``@PATH`` is the source in that file instead (an
    earlier version of the kernels, timed beside this one: the Python side must match)."""
    if name.startswith("@"):
        return open(name[1:]).read()
    return _edited(cuda_build.KERNEL_FILE.read_text(), name, ABLATIONS)


def _edited(source: str, name: str, ablations: dict[str, list[tuple[str, str]]]) -> str:
    """``source`` with the edits of ``name`` (ablation names joined by "+") applied in order: each
    old text must occur exactly once; an empty old text appends the new one."""
    for old, new in (edit for part in name.split("+") for edit in ablations[part]):
        if not old:
            source += "\n\n" + new
            continue
        count = source.count(old)
        if count != 1:
            raise SystemExit(f"ablation text found {count} times (the kernel changed?): {old[:60]!r}")
        source = source.replace(old, new)
    return source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", default="fp8,int4")
    parser.add_argument("--heads", default="16")
    parser.add_argument("--rows", default="131072,1048576")
    parser.add_argument("--batch", type=int, default=1, help="sequences per problem (ragged when > 1)")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated ablation names, '+' to combine, or @FILE sources (default: the "
        "docs/GPU-LOG.md table); 'all' for every one",
    )
    parser.add_argument("--wgmma", action="store_true", help="the warpgroup-MMA kernels' ablations")
    parser.add_argument("--nan-rate", type=float, default=0.0, help="share of fp8 code bytes planted as NaN")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"device: {props.name}; copy {copy_bw / 1e12:.2f} TB/s; seed {args.seed}", flush=True)
    table, every = (WGMMA_TABLE, WGMMA_ABLATIONS) if args.wgmma else (TABLE, ABLATIONS)
    names = list(every) if args.only == "all" else (args.only or ",".join(table)).split(",")
    folder = Path(tempfile.mkdtemp(prefix="gpu_stages_"))
    variants = {name: wgmma_variant(name, folder) for name in names} if args.wgmma else {}
    original = cuda_build.kernel_source
    problems = [
        (tier, int(h), int(t))
        for tier in args.tiers.split(",")
        for h in args.heads.split(",")
        for t in args.rows.split(",")
    ]
    print(f"{'problem':24s} " + " ".join(f"{n:>18s}" for n in names), flush=True)
    for i, (tier, heads, rows) in enumerate(problems):
        lengths = [rows] if args.batch == 1 else testing.ragged_lengths(rows, args.batch, args.seed)
        probe = testing.make_case(tier, lengths, heads, device="cuda", seed=args.seed + i, nan_rate=args.nan_rate)
        n_bytes = probe.rows_attended() * probe.row_bytes()
        cache_bytes = probe.lc_codes.numel() + probe.rc_codes.numel() + 8 * probe.lc_codes.shape[0]
        n_sets = max(1, min(16, math.ceil(3 * props.L2_cache_size / cache_bytes)))
        cases = [probe] + _cases(tier, lengths, heads, None, n_sets - 1, args.seed + 100 + i, args.nan_rate)
        ref = testing.reference(probe)
        cells = []
        for name in names:
            if args.wgmma:
                backend = _VariantBackend(variants[name])
            else:
                source = patched(name)
                cuda_build.kernel_source = lambda source=source: source
                cuda_build.compiled.cache_clear()
                backend = CudaBackend(torch.device("cuda"), variant="v2")
            err = testing.relative_error(testing.decode(probe, testing.poisoned_out(probe), backend=backend), ref)
            us = time_kernel(backend, cases)
            pct = 100.0 * n_bytes / (us * 1e-6) / copy_bw
            cells.append(f"{us:8.1f} {pct:4.0f}% {err:5.0e}"[:18].rjust(18))
        shape = f"T{rows}" if args.batch == 1 else f"{args.batch}xT{rows}"
        print(f"{tier:5s} H{heads:<4d} {shape:14s} " + " ".join(cells), flush=True)
        del cases, probe
        torch.cuda.empty_cache()
    cuda_build.kernel_source = original
    cuda_build.compiled.cache_clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
