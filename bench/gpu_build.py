"""What each GPU kernel takes of a multiprocessor, compiled on a machine with no GPU.

The CUDA kernels (``gpu/kernels/mla_decode.cu``) go through NVRTC (:mod:`kvstore.gpu.nvrtc`: the
compiler and options the backend uses through cupy) for each ``--arch``; per kernel, ptxas's
registers, spill stores / loads and stack, and for the split kernels the dynamic shared memory
and how many blocks of each fit an SM of 99 KB (sm_89, sm_120) and of 228 KB (sm_90, sm_100),
as :func:`kvstore.gpu.cuda_plan.fitting_m_tiles` plans them. With ``--gluon`` the warpgroup-MMA
kernels of ``gpu/wgmma_kernels.py`` are compiled by the installed Triton for sm_90a (they are
written for Triton 3.6) and read back with the ``cuobjdump`` Triton ships: registers, shared
memory, the SASS's local-memory loads and stores and its ``HGMMA`` instructions — the loop a
kernel change goes through before it costs device time. Usage::

    PYTHONPATH=. python3 bench/gpu_build.py [--arch sm_89,sm_90] [--geometry 512x64] [--gluon]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from kvstore.gpu import cuda_plan, nvrtc
from kvstore.gpu.cuda_build import kernel_source

#: Shared memory a block may have and an SM holds: the two classes of device the kernels run on.
SMALL, LARGE = nvrtc.DEVICE_SHARED_MEMORY["sm_89"], nvrtc.DEVICE_SHARED_MEMORY["sm_90"]


def cuda_table(arches: list[str], geometries: list[tuple[int, int]]) -> None:
    names = list(dict.fromkeys(n for k, r in geometries for n in cuda_plan.instantiations(k, r)))
    # split kernel -> (m-tiles, dynamic shared memory)
    smem = {
        cuda_plan.split_kernel(m, k, r, fmt, gather, v2): (m, need)
        for (v2, k, r, fmt), needs in nvrtc.split_shared_memory(kernel_source(), geometries).items()
        for m, need in needs.items()
        for gather in (False, True)
    }
    builds = {}
    for arch in arches:
        t0 = time.perf_counter()
        builds[arch] = nvrtc.compile_source(kernel_source(), names, arch)
        print(f"{arch}: {len(names)} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    cells = " | ".join(f"{a} regs | {a} spill st/ld | {a} stack" for a in arches)
    print(f"\n| kernel | {cells} | dynamic smem | blocks/SM at 99 KB | blocks/SM at 227 KB |")
    print("|---|" + "---:|" * (3 * len(arches) + 3))
    for name in names:
        if name.startswith("mla_split_smem"):  # the split kernels' shared-memory queries
            continue
        row = []
        for arch in arches:
            used = builds[arch].resources[name]
            row += [str(used.registers), f"{used.spill_stores}/{used.spill_loads}", str(used.stack)]
        if name in smem:
            m, need = smem[name]
            fits = [cuda_plan.fitting_m_tiles({m: need}, *limits).get(m, 0) for limits in (SMALL, LARGE)]
            row += [f"{need:,}", *map(str, fits)]
        else:
            row += ["", "", ""]
        print(f"| `{name}` | " + " | ".join(row) + " |")


def gluon_table() -> None:
    """The warpgroup-MMA kernels for sm_90a, fp8 and int4, through the installed Triton."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvstore.gpu import wgmma_kernels as wk

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    fn = wk._wide_split
    pointers = {
        "q16": "*fp16",
        "qmul": "*fp32",
        "lc": "*u8",
        "ls": "*fp32",
        "rc": "*u8",
        "rs": "*fp32",
        "seq_start": "*i32",
        "seq_len": "*i32",
        "part_ctx": "*fp32",
        "part_lse": "*fp32",
    }
    scalars = ("batch", "heads", "heads_pad", "programs")
    signature = {n: pointers.get(n, "i32" if n in scalars else "constexpr") for n in fn.arg_names}
    # as a launch specializes them: every pointer 16-byte aligned
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    print(f"\nTriton {triton.__version__}, sm_90a, {wk.__name__}._wide_split (per program):")
    print("| tier | registers | shared memory | local loads / stores (SASS) | HGMMA |")
    print("|---|---:|---:|---:|---:|")
    for int4 in (False, True):
        constants = dict(
            K=512,
            R=64,
            BP=1,
            BLOCK_H=wk.BLOCK_H,
            BLOCK_N=wk.BLOCK_N,
            MIN_TILES=wk.MIN_TILES,
            CONTEXT_WARPS=wk.CONTEXT_WARPS,
            CONTEXT_REGS=wk.CONTEXT_REGS,
            PRODUCER_WARPS=wk.PRODUCER_WARPS,
            PRODUCER_REGS=wk.PRODUCER_REGS,
            PREFETCH_TILES=wk.PREFETCH_TILES,
            INT4=int4,
        )
        kernel = triton.compile(
            GluonASTSource(fn, signature, constants, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": wk.SCORES_WARPS},
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
            sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)[1]
        ldl, stl = len(re.findall(r"\bLDL\b", sass)), len(re.findall(r"\bSTL\b", sass))
        hgmma = len(re.findall(r"\bHGMMA\.", sass))
        print(f"| {'int4' if int4 else 'fp8'} | {regs} | {kernel.metadata.shared:,} | {ldl} / {stl} | {hgmma} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_89,sm_90", help="real architectures to compile the CUDA kernels for")
    parser.add_argument("--geometry", default="512x64", help="kv_lora x qk_rope pairs, comma-separated")
    parser.add_argument("--gluon", action="store_true", help="also the warpgroup-MMA kernels (Triton 3.6)")
    args = parser.parse_args()
    geometries = [tuple(int(v) for v in g.split("x")) for g in args.geometry.split(",")]
    cuda_table(args.arch.split(","), geometries)
    if args.gluon:
        gluon_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
