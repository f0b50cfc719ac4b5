"""Cached kernel launches: the host side of a repeated call in a few microseconds.

A call of the CUDA backend whose operands (the queries, ``out`` and the operands of its
``LatentBatch``) have the shapes, dtypes and devices of an earlier call replays that call's launch
plan: the kernels, grids and shared memory, and argument buffers in which only the tensors'
addresses change. The buffers are passed to the driver's ``cuLaunchKernel`` directly (through
``ctypes``); cupy's generic argument handling, the planning and the workspace allocations (kept per
stream) are skipped. A plain call — a trusted batch, as the engine's caches make — does nothing
else on the host; a checked batch's call is checked first. The driver copies kernel arguments at
launch, so one buffer serves every call; a lock keeps two threads from filling it at once.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

__all__ = ["MAX_PLANS", "PackedLaunch", "ReplayedCall", "driver_launch", "function_pointer", "replayable", "signature"]

_DRIVER = None
_DRIVER_LOCK = threading.Lock()


def driver_launch():
    """``cuLaunchKernel`` from the CUDA driver library, or None where it cannot be loaded."""
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                try:
                    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
                except (OSError, AttributeError):
                    _DRIVER = False
                else:
                    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
                    fn.restype = ctypes.c_int
                    _DRIVER = fn
    return _DRIVER or None


def function_pointer(kernel) -> int | None:
    """The ``CUfunction`` handle behind a cupy kernel object, or None if it does not show one."""
    for owner in (getattr(kernel, "kernel", None), kernel):
        ptr = getattr(owner, "ptr", None)
        if isinstance(ptr, int) and ptr:
            return ptr
    return None


class PackedLaunch:
    """One kernel's launch with its arguments packed as the driver reads them.

    ``grid`` and ``block`` have up to three dimensions (the missing ones are 1); ``args`` are numpy
    scalars (``np.uint64`` for a device pointer, ``np.int32``, ``np.int64``, ``np.float32``) in the
    kernel's parameter order; :meth:`set_pointers` changes some in place.
    """

    def __init__(self, function: int, grid: tuple[int, ...], block: tuple[int, ...], smem: int, args):
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        # one 8-byte slot per argument: every parameter is at most 8 bytes and 8-byte aligned
        self._slots = (ctypes.c_uint64 * len(args))()
        packed = np.zeros(len(args), dtype=np.uint64)
        raw = packed.view(np.uint8)
        for i, value in enumerate(args):
            data = np.asarray(value)
            if data.dtype.itemsize > 8:
                raise TypeError(f"kernel argument {i} of {data.dtype} is wider than 8 bytes")
            raw[8 * i : 8 * i + data.dtype.itemsize] = np.frombuffer(data.tobytes(), dtype=np.uint8)
        ctypes.memmove(self._slots, packed.ctypes.data, packed.nbytes)
        base = ctypes.addressof(self._slots)
        self._params = (ctypes.c_void_p * len(args))(*[base + 8 * i for i in range(len(args))])
        # the driver call's fixed arguments, converted once
        self._head = (
            ctypes.c_void_p(function),
            *[ctypes.c_uint(v) for v in grid + block],
            ctypes.c_uint(int(smem)),
        )
        self._params_ptr = ctypes.cast(self._params, ctypes.c_void_p)
        self.grid, self.block, self.smem = grid, block, int(smem)

    def set_pointers(self, slots, addresses) -> None:
        """Write device addresses into the argument slots ``slots`` (in order)."""
        buffer = self._slots
        for slot, address in zip(slots, addresses):
            buffer[slot] = address

    def launch(self, driver, stream: int) -> None:
        status = driver(*self._head, stream, self._params_ptr, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA driver error {status}")


#: Most launch plans one backend keeps.
MAX_PLANS = 64
#: Operand slots of mla_decode_v2's parameters (q_lat, q_rope, lc, ls, rc, rs, seq_start, seq_len,
#: indices, n_selected) and of its workspaces (o_part, o_scale, lse, n_live); the merge's
#: workspaces and out.
_SPLIT_OPERANDS = (0, 1, 4, 5, 6, 7, 8, 9, 10, 11)
_SPLIT_WORKSPACES = (17, 18, 19, 20)
_MERGE_WORKSPACES = (0, 1, 2, 3)
_MERGE_OUT = (7,)


def signature(tier, softmax_scale, operands, out) -> tuple | None:
    """What a launch plan depends on besides addresses: tier, scale, each operand's shape, dtype,
    device index (-1 on the host) and contiguity; None when an operand is not a tensor.

    One flat tuple, hashed once (by the lookup): building and hashing a nested tuple per operand,
    and hashing it twice, cost about as much again as the launches (bench/gpu_host.py)."""
    # the tier by name: a str caches its hash, a frozen dataclass computes it in Python every time
    key = [getattr(tier, "name", tier), softmax_scale]
    try:
        hash(softmax_scale)
        for t in (out, *operands):
            if t is None:
                key.append(None)
            else:
                key += (t.shape, t.dtype, t.get_device(), t.is_contiguous())
    except (AttributeError, TypeError):
        return None
    return tuple(key)


def replayable(q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales, seq_start, seq_len, indices, n_selected):
    """A plan can be replayed when it used the operands as given (contiguous, int32 bounds on the
    device: nothing converted per call) and no value read on the host chose it."""
    for t in (q_lat, q_rope, lc_codes, lc_scales, rc_codes, rc_scales):
        if not t.is_contiguous():
            return False
    for t in (seq_start, seq_len, indices, n_selected):
        if t is not None and (t.device.type != "cuda" or t.dtype != torch.int32 or not t.is_contiguous()):
            return False
    return True


# torch's raw accessors where it has them (a CUDA build), looked up once: a replayed call reads both
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_RAW_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _raw_stream(index: int) -> int:
    """The current stream's handle on device ``index``."""
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


def _current_device() -> int:
    # CUDA is initialized: a plan exists only after a call that launched on it
    return _RAW_DEVICE() if _RAW_DEVICE is not None else torch.cuda.current_device()


class ReplayedCall:
    """A plain call replayed: new addresses in the packed arguments, workspaces kept per stream."""

    def __init__(self, backend, driver, split, merge, workspace, stream: int, wgmma_when_captured: bool = False):
        self.backend = backend
        #: the call takes the warpgroup-MMA kernels when captured in a CUDA graph (not this plan)
        self.wgmma_when_captured = wgmma_when_captured
        self.driver = driver
        self.split = split
        self.merge = merge
        self.workspaces = {stream: (workspace, [w.data_ptr() for w in workspace])}
        #: the stream whose workspace addresses the packed arguments hold (written once per switch)
        self.written = None
        self.lock = threading.Lock()

    def run(self, operands, out):
        addresses = [0 if t is None else t.data_ptr() for t in operands]
        # the kernels read 16-byte vectors from the queries and the row arrays
        if (addresses[0] | addresses[1] | addresses[2] | addresses[3] | addresses[4] | addresses[5]) & 15:
            return None
        index = operands[0].get_device()
        if _current_device() != index:
            return None
        stream = _raw_stream(index)
        found = self.workspaces.get(stream)
        if found is None:
            if len(self.workspaces) >= 8:
                return None
            workspace = tuple(torch.empty_like(w) for w in next(iter(self.workspaces.values()))[0])
            found = self.workspaces[stream] = (workspace, [w.data_ptr() for w in workspace])
        if out is None:
            out = torch.empty(operands[0].shape, dtype=torch.float32, device=operands[0].device)
        with self.lock:
            if self.written != stream:
                spaces = found[1]
                self.split.set_pointers(_SPLIT_WORKSPACES, spaces)
                self.merge.set_pointers(_MERGE_WORKSPACES, spaces)
                self.written = stream
            self.split.set_pointers(_SPLIT_OPERANDS, addresses)
            self.merge.set_pointers(_MERGE_OUT, (out.data_ptr(),))
            self.split.launch(self.driver, stream)
            self.merge.launch(self.driver, stream)
        self.backend.fast_calls += 1
        return out
