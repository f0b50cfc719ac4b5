"""NVRTC through ``ctypes``: the CUDA kernels compiled for a GPU architecture on a machine with no GPU.

The CUDA backend compiles ``kernels/mla_decode.cu`` at run time with NVRTC through cupy, for the
device it runs on. This module drives the same compiler with the same options for any
architecture, with no device and no cupy, so a machine without a GPU (CI, a laptop) can check
what each kernel instantiation takes of a multiprocessor: registers, spills, stack, static shared
memory from ptxas, and the dynamic shared memory a split kernel asks for (the value its
``mla_split_smem*`` query kernel stores, read from the PTX). ``tests/gpu/test_gpu_build.py`` holds
every instantiation the backend can ask for to the limits of the devices it runs on;
``bench/gpu_build.py`` prints the table.

The library is looked for in the ``nvidia-cuda-nvrtc`` wheel (the ``test`` extra installs it), then
under ``$CUDA_HOME`` or ``/usr/local/cuda``, then on the loader's path; ``KVSTORE_NVRTC`` names a
``libnvrtc.so`` file to use instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstore import config
from kvstore.gpu.cuda_plan import M_TILES, NVRTC_OPTIONS, generations, smem_query_kernel
from kvstore.gpu.errors import KernelBuildError

__all__ = [
    "DEVICE_SHARED_MEMORY",
    "Build",
    "KernelBuildError",
    "KernelResources",
    "compile_source",
    "library",
    "split_shared_memory",
    "stored_constant",
]

#: Shared memory a block may have (the opt-in limit) and an SM holds, bytes, by architecture
#: (CUDA programming guide, "Technical Specifications per Compute Capability"): what the backend
#: reads from a device at run time, for the checks made without one.
DEVICE_SHARED_MEMORY = {
    "sm_89": (101_376, 102_400),  # L4, L40S, RTX 4090
    "sm_90": (232_448, 233_472),  # H100, H200
    "sm_100": (232_448, 233_472),  # B200
    "sm_120": (101_376, 102_400),  # RTX 5090
}

#: Where the pip wheels put the library, newest CUDA first (relative to a ``sys.path`` entry).
_WHEEL_LIBS = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")


def _candidates() -> list[Path]:
    named = config.NVRTC.get()
    if named is not None:
        return [named]
    found = [Path(entry) / rel for entry in sys.path if entry for rel in _WHEEL_LIBS]
    for home in (config.CUDA_HOME.get(), Path("/usr/local/cuda")):
        if home is not None:
            found += sorted(Path(home, "lib64").glob("libnvrtc.so*"), reverse=True)
    system = ctypes.util.find_library("nvrtc")
    if system:
        found.append(Path(system))
    return found


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The NVRTC library, loaded once.

    Raises
    ------
    KernelBuildError
        No ``libnvrtc`` was found (install the ``nvidia-cuda-nvrtc`` wheel or a CUDA toolkit).
    """
    tried = []
    for path in _candidates():
        if not path.is_file() and path.is_absolute():
            tried.append(str(path))
            continue
        # NVRTC opens its builtins library by name at compile time: load the one beside it first
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
            if ".alt." not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            tried.append(f"{path} ({exc})")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        return lib
    raise KernelBuildError(
        "NVRTC not found (pip install nvidia-cuda-nvrtc, or set KVSTORE_NVRTC to a libnvrtc.so); tried: "
        + ", ".join(tried or ["nothing"])
    )


@dataclass(frozen=True)
class KernelResources:
    """What ptxas gave one kernel (bytes unless named otherwise)."""

    registers: int
    barriers: int
    stack: int
    spill_stores: int
    spill_loads: int
    static_shared: int


@dataclass(frozen=True)
class Build:
    """One NVRTC compilation: ``arch`` (``sm_90``: a cubin, with ptxas's report; ``compute_90``:
    PTX), the compiler's log, each name expression's mangled name, the PTX (virtual
    architectures only) and, per name expression, the kernel's resources (real ones only)."""

    arch: str
    log: str
    lowered: dict[str, str]
    ptx: str
    resources: dict[str, KernelResources]


def _check(lib: ctypes.CDLL, status: int, what: str, log: str = "") -> None:
    if status != 0:
        reason = lib.nvrtcGetErrorString(status).decode()
        raise KernelBuildError(f"NVRTC {what}: {reason}" + (f"\n{log}" if log else ""))


def _read(lib: ctypes.CDLL, prog: ctypes.c_void_p, size_fn: str, get_fn: str) -> bytes:
    size = ctypes.c_size_t()
    _check(lib, getattr(lib, size_fn)(prog, ctypes.byref(size)), size_fn)
    out = ctypes.create_string_buffer(size.value)
    _check(lib, getattr(lib, get_fn)(prog, out), get_fn)
    return out.raw[: size.value].rstrip(b"\0")


# ptxas's --verbose report of one entry function (CUDA 12 and 13)
_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'(?P<body>.*?)(?=Compiling entry function|\Z)", re.S)
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:.*?, (\d+) bytes smem)?")


def _resources(log: str) -> dict[str, KernelResources]:
    """Mangled name -> resources, from ptxas's verbose report in an NVRTC log."""
    out = {}
    for entry in _ENTRY.finditer(log):
        frame, used = _FRAME.search(entry["body"]), _USED.search(entry["body"])
        if frame is None or used is None:
            raise KernelBuildError(f"ptxas reported no resources for {entry['name']}:\n{entry['body']}")
        out[entry["name"]] = KernelResources(
            registers=int(used[1]),
            barriers=int(used[2] or 0),
            stack=int(frame[1]),
            spill_stores=int(frame[2]),
            spill_loads=int(frame[3]),
            static_shared=int(used[3] or 0),
        )
    return out


def compile_source(
    source: str, name_expressions: list[str], arch: str, options: tuple[str, ...] = NVRTC_OPTIONS
) -> Build:
    """Compile ``source`` with NVRTC for ``arch``, instantiating ``name_expressions``.

    Parameters
    ----------
    source : CUDA C++ (no headers beyond NVRTC's own)
    name_expressions : kernels to instantiate and report, as the backend names them
        (``"mla_decode_v2<4,512,64,0,false>"``)
    arch : a real architecture (``"sm_90"``: a cubin and ptxas's report per kernel) or a virtual
        one (``"compute_90"``: PTX)
    options : NVRTC options besides the architecture (default the backend's)

    Raises
    ------
    KernelBuildError
        NVRTC is missing or the source does not compile; the reason holds the log.
    """
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"mla_decode.cu", 0, None, None), "create")
    try:
        for name in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"name expression {name}")
        real = arch.startswith("sm_")
        argv = [f"--gpu-architecture={arch}", *options] + (["--ptxas-options=--verbose"] if real else [])
        status = lib.nvrtcCompileProgram(prog, len(argv), (ctypes.c_char_p * len(argv))(*[a.encode() for a in argv]))
        log = _read(lib, prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog").decode(errors="replace")
        _check(lib, status, f"could not compile for {arch}", log)
        lowered = {}
        for name in name_expressions:
            mangled = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(mangled)), f"lowered name {name}")
            value = mangled.value
            if value is None:
                raise KernelBuildError(f"NVRTC gave no lowered name for {name} ({arch})")
            lowered[name] = value.decode()
        ptx = "" if real else _read(lib, prog, "nvrtcGetPTXSize", "nvrtcGetPTX").decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    by_mangled = _resources(log) if real else {}
    resources = {name: by_mangled[m] for name, m in lowered.items() if m in by_mangled}
    if real and len(resources) != len(lowered):
        missing = sorted(set(lowered) - set(resources))
        raise KernelBuildError(f"ptxas reported no resources for {missing}")
    return Build(arch, log, lowered, ptx, resources)


def stored_constant(build: Build, name_expression: str) -> int:
    """The one integer a query kernel (``out[0] = <constant>``) stores, read from ``build``'s PTX."""
    mangled = build.lowered[name_expression]
    body = build.ptx.split(f".entry {mangled}(", 1)[1].split("\n}", 1)[0]
    values = set(re.findall(r"\bmov\.[bsu]32\s+%r\d+,\s*(\d+);", body)) | set(
        re.findall(r"\bst\.global\.[bsu]32\s+\[[^\]]+\],\s*(\d+);", body)
    )
    if len(values) != 1:
        raise KernelBuildError(f"{name_expression} does not store one constant (found {sorted(values)})")
    return int(values.pop())


def split_shared_memory(source: str, geometries: list[tuple[int, int]]) -> dict[tuple, dict[int, int]]:
    """(v2, kv_lora, qk_rope, fmt) -> m-tiles -> the dynamic shared memory (bytes) of the split
    kernel, for every generation and tier built at each (kv_lora, qk_rope): what
    :func:`kvstore.gpu.cuda_build.split_shared_memory` asks a device for, read from the PTX."""
    keys = [(v2, k, r, fmt) for k, r in geometries for v2 in generations(k) for fmt in (0, 1)]
    names = {(key, m): smem_query_kernel(m, *key[1:], key[0]) for key in keys for m in M_TILES}
    ptx = compile_source(source, list(names.values()), "compute_90")
    return {key: {m: stored_constant(ptx, names[key, m]) for m in M_TILES} for key in keys}
