"""Restore a resumed session's quantized rows from host arrays into a device cache.

On CUDA the bytes go through a small ring of pinned (page-locked) host buffers: the host copies
chunk i+1 into one buffer while the copy engine moves chunk i out of the other with an asynchronous
``cudaMemcpyAsync`` on a side stream, so the PCIe transfer runs at pinned speed without pinning the
whole (possibly memory-mapped) source. The caller's current stream is made to wait for the side
stream on the device (no host synchronization), so kernels launched afterwards see the rows.
Elsewhere (CPU, Apple ``mps``) the arrays are copied with plain torch copies.

Examples
--------
>>> import numpy as np
>>> rows = restore_quantized_rows(
...     "fp8", np.ones((3, 8), np.uint8), np.ones(3, np.float32),
...     np.ones((3, 4), np.uint8), np.ones(3, np.float32), "cpu", capacity=5)
>>> rows.n_rows, tuple(rows.lc_codes.shape), rows.lc_codes.device.type
(3, (5, 8), 'cpu')
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvstore import tiers
from kvstore.formats import coli_kv
from kvstore.gpu import codecs
from kvstore.gpu.errors import AttentionInputError
from kvstore.gpu.inputs import as_tier

__all__ = ["PinnedUploader", "QuantizedRows", "restore_quantized_rows"]

_NP_TO_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32}


class QuantizedRows(NamedTuple):
    """A device cache of quantized rows: ``capacity`` rows allocated, the first ``n_rows`` restored.

    ``lc_scales``/``rc_scales`` hold the fp8 scales or the TQ (int4, polarB) radii.
    """

    lc_codes: torch.Tensor
    lc_scales: torch.Tensor
    rc_codes: torch.Tensor
    rc_scales: torch.Tensor
    n_rows: int


class PinnedUploader:
    """Host-to-device copies through a reusable ring of pinned buffers on a side stream.

    Parameters
    ----------
    device : target device (``cuda``: pinned ring; anything else: plain copies)
    chunk_bytes : size of each pinned buffer
    n_buffers : buffers in the ring (2: one filled by the host while the other is in flight)
    """

    def __init__(self, device: torch.device | str, *, chunk_bytes: int = 16 << 20, n_buffers: int = 2):
        self.device = torch.device(device)
        if chunk_bytes < 1 or n_buffers < 1:
            raise AttentionInputError(f"chunk_bytes and n_buffers must be positive, got {chunk_bytes}, {n_buffers}")
        self.chunk_bytes = int(chunk_bytes)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = torch.cuda.Stream(self.device)
            self._buffers = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(n_buffers)
            ]
            self._views = [buf.numpy() for buf in self._buffers]
            self._done = [torch.cuda.Event() for _ in range(n_buffers)]
            self._used = [False] * n_buffers
            self._next = 0

    def copy_into(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Copy host array ``src`` into the leading elements of device tensor ``dst`` (same dtype).

        Parameters
        ----------
        dst : contiguous tensor on the uploader's device with at least ``src.size`` elements
        src : numpy array (any layout; read once, chunk by chunk)
        """
        src = np.asarray(src)
        if _NP_TO_TORCH.get(src.dtype) != dst.dtype:
            raise AttentionInputError(f"cannot copy {src.dtype} rows into a {dst.dtype} tensor")
        if not dst.is_contiguous() or dst.numel() < src.size:
            raise AttentionInputError(f"destination {tuple(dst.shape)} cannot hold {src.shape}")
        flat_src = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        flat_dst = dst.reshape(-1)[: src.size].view(torch.uint8)
        if not self._cuda:
            flat_dst.copy_(torch.from_numpy(flat_src.copy()))
            return
        for offset in range(0, flat_src.size, self.chunk_bytes):
            slot = self._next
            self._next = (slot + 1) % len(self._buffers)
            if self._used[slot]:
                self._done[slot].synchronize()  # the copy that last read this buffer has finished
            count = min(self.chunk_bytes, flat_src.size - offset)
            np.copyto(self._views[slot][:count], flat_src[offset : offset + count])
            with torch.cuda.stream(self.stream):
                flat_dst[offset : offset + count].copy_(self._buffers[slot][:count], non_blocking=True)
                self._done[slot].record(self.stream)
            self._used[slot] = True

    def finish(self) -> None:
        """Make the caller's current stream wait (on the device) for every copy issued so far."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def _rows(name: str, array, dtype: np.dtype, ndim: int) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype != dtype or array.ndim != ndim:
        shape = "[N, width]" if ndim == 2 else "[N]"
        raise AttentionInputError(f"{name} must be a {dtype}{shape} array, got {array.dtype}{list(array.shape)}")
    return array


def restore_quantized_rows(
    tier: tiers.Tier | str,
    lc_codes: np.ndarray,
    lc_scales: np.ndarray,
    rc_codes: np.ndarray,
    rc_scales: np.ndarray,
    device: torch.device | str,
    *,
    capacity: int | None = None,
    uploader: PinnedUploader | None = None,
    strict: bool = False,
    source: str = "the uploaded rows",
    first_record: int = 0,
    layer: int = 0,
) -> QuantizedRows:
    """Upload a session's quantized rows (one layer) into new device tensors.

    Stored rows may come from a damaged file: as every reader does (docs/FORMAT.md section 4, the one
    bound of ``Tier.corrupt_scales``), a row whose scale/radius no encoder writes is made inert on
    the device and NaN fp8 codes read 0 (``kvstore.gpu.codecs.sanitize_fp8_``/``sanitize_tq_``), so
    a scale of 1e37 on code 0x7E never decodes to inf. ``strict`` refuses such rows instead,
    before anything is allocated (:class:`~kvstore.formats.errors.BadScale` naming ``source`` and
    the record: row ``i`` is record ``first_record + i`` of layer ``layer``).

    Parameters
    ----------
    tier : a tier of u8 codes and one f32 scale per row, as a ``kvstore.tiers.Tier`` or its name:
        ``"fp8"`` (codes u8[N, K], scales), ``"int4"`` (codes u8[N, K/2], radii) or ``"polar2"`` ..
        ``"polar6"`` (codes u8[N, rb(K)], radii)
    lc_codes : u8[N, payload bytes of K];  lc_scales : f32[N]
    rc_codes : u8[N, payload bytes of R];  rc_scales : f32[N]
    device : target device
    capacity : rows to allocate (>= N) so that decoding can append without reallocating
    uploader : a :class:`PinnedUploader` to reuse (its pinned ring); one is made when omitted
    strict, source, first_record, layer : see above

    Returns
    -------
    QuantizedRows
        Device tensors of ``capacity`` rows, the first N restored (rows past N uninitialized).
    """
    tier = as_tier(tier)
    if not (tier.in_file and tier.version in (2, 3)):
        quantized = [name for name in tiers.names(in_file=True) if tiers.get(name).row_codec.scaled]
        raise AttentionInputError(f"tier must be one of {quantized} (u8 codes + f32 scales), got {tier.name!r}")
    lc_codes = _rows("lc_codes", lc_codes, np.dtype(np.uint8), 2)
    rc_codes = _rows("rc_codes", rc_codes, np.dtype(np.uint8), 2)
    lc_scales = _rows("lc_scales", lc_scales, np.dtype(np.float32), 1)
    rc_scales = _rows("rc_scales", rc_scales, np.dtype(np.float32), 1)
    n_rows = lc_codes.shape[0]
    for name, array in (("rc_codes", rc_codes), ("lc_scales", lc_scales), ("rc_scales", rc_scales)):
        if array.shape[0] != n_rows:
            raise AttentionInputError(f"{name} has {array.shape[0]} rows, lc_codes {n_rows}")
    allocated = n_rows if capacity is None else int(capacity)
    if allocated < n_rows:
        raise AttentionInputError(f"capacity {allocated} is below the {n_rows} rows to restore")
    if strict:
        coli_kv.check_row_scales(
            tier, lc_scales[:, None], rc_scales[:, None], source=source, first_record=first_record, first_layer=layer
        )
    device = torch.device(device)
    uploader = uploader or PinnedUploader(device)
    if uploader.device.type != device.type or (device.index is not None and uploader.device != device):
        raise AttentionInputError(f"uploader copies to {uploader.device}, not {device}")
    device = uploader.device
    stream_ctx = torch.cuda.stream(uploader.stream) if device.type == "cuda" else None
    shapes = ((allocated, lc_codes.shape[1]), (allocated,), (allocated, rc_codes.shape[1]), (allocated,))
    dtypes = (torch.uint8, torch.float32, torch.uint8, torch.float32)
    if stream_ctx is not None:
        with stream_ctx:  # allocated on the side stream that writes them
            tensors = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
    else:
        tensors = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
    for dst, src in zip(tensors, (lc_codes, lc_scales, rc_codes, rc_scales)):
        uploader.copy_into(dst, src)
    uploader.finish()
    # on the caller's stream, which now waits for the copies: the same sanitize as every reader
    codecs.sanitize_tier_(tier, tensors[0][:n_rows], tensors[1][:n_rows])
    codecs.sanitize_tier_(tier, tensors[2][:n_rows], tensors[3][:n_rows])
    if device.type == "cuda":
        consumer = torch.cuda.current_stream(device)
        for t in tensors:
            t.record_stream(consumer)  # the allocator must not recycle them while the consumer reads
    return QuantizedRows(*tensors, n_rows=n_rows)
