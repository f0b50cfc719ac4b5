"""Building the CUDA kernels at run time: ``kernels/mla_decode.cu`` through cupy ``RawModule``.

NVRTC compiles a module of the instantiations a call needs (``cuda_plan`` names them) on first use,
for the device's compute capability (``--gpu-architecture=sm_XY``); modules are cached in memory
and in cupy's on-disk cache. :func:`split_shared_memory` asks the compiled source how much dynamic
shared memory each split kernel takes, so the backend plans within the device's limits.
:mod:`kvstore.gpu.nvrtc` compiles the same source with the same options on a machine with no GPU.
"""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.gpu.cuda_plan import M_TILES, NVRTC_OPTIONS, smem_query_kernel

__all__ = [
    "KERNEL_FILE",
    "LOCK",
    "MIN_CAPABILITY",
    "compiled",
    "cupy_module",
    "cupy_stream",
    "kernel_source",
    "ptr",
    "split_shared_memory",
]

KERNEL_FILE = Path(__file__).resolve().parent / "kernels" / "mla_decode.cu"
#: Lowest compute capability: cvt.rn.f16x2.e4m3x2 needs sm_89.
MIN_CAPABILITY = (8, 9)
LOCK = threading.Lock()


def kernel_source() -> str:
    """The CUDA source of the kernels."""
    return KERNEL_FILE.read_text()


def cupy_module():
    # imported lazily: importing kvstore.gpu must not need it (nor the type gate's environment)
    import cupy  # pyright: ignore[reportMissingImports]

    return cupy


@functools.lru_cache(maxsize=None)
def compiled(name_expressions: tuple[str, ...], capability: tuple[int, int], device_index: int) -> tuple:
    """Compile (once) a module holding these template instantiations; their kernels, in order."""
    cupy = cupy_module()
    options = (f"--gpu-architecture=sm_{capability[0]}{capability[1]}", *NVRTC_OPTIONS)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(), options=options, name_expressions=name_expressions)
        return tuple(module.get_function(name) for name in name_expressions)


#: cupy's views of torch streams, by (device, stream handle); cupy's types are Any to the checker
_STREAMS: dict[tuple[int | None, int], Any] = {}


def cupy_stream(stream: torch.cuda.Stream, device_index: int | None) -> Any:
    """The cupy view of a torch stream (cached): kernels launch in the caller's stream order."""
    key = (device_index, stream.cuda_stream)
    found = _STREAMS.get(key)
    if found is None:
        cupy = cupy_module()
        try:  # the stream protocol (cupy >= 14 with a torch that exports __cuda_stream__)
            found = cupy.cuda.Stream.from_external(stream)
        except (AttributeError, TypeError, ValueError):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                found = cupy.cuda.ExternalStream(stream.cuda_stream, device_index)
        _STREAMS[key] = found
    return found


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel argument (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def split_shared_memory(v2: bool, kv_lora: int, qk_rope: int, fmt: int, capability, device: torch.device) -> dict:
    """m-tiles -> the dynamic shared memory (bytes) of the split kernel of this generation,
    geometry and format, as the compiled source's ``mla_split_smem*`` kernels report it (one
    module, one launch each, one synchronization)."""
    queries = compiled(
        tuple(smem_query_kernel(m, kv_lora, qk_rope, fmt, v2) for m in M_TILES), capability, device.index
    )
    answer = torch.zeros(len(M_TILES), dtype=torch.int32, device=device)
    cupy = cupy_module()
    with cupy.cuda.Device(device.index), cupy_stream(torch.cuda.current_stream(device), device.index):
        for i, query in enumerate(queries):
            query((1,), (1,), (np.uint64(answer.data_ptr() + 4 * i),))
    return dict(zip(M_TILES, answer.tolist()))
