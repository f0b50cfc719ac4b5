"""The vLLM connector's worker side, without vLLM: loads into and saves from vLLM's paged MLA cache.

vLLM keeps one cache tensor per attention layer, ``[blocks, block_size, kv_lora + qk_rope]``: one
``.coli_kv`` row per token slot. :class:`PagedWorker` is what
:class:`~kvstore.connectors.vllm.KVStoreConnector` does on a worker, over the plans its scheduler
side makes (:class:`LoadSpec`, :class:`SaveSpec`); it needs torch, not vLLM, so it runs and is
tested on real CUDA tensors where vLLM is not installed (tests/vllm/test_paged_worker.py,
bench/vllm_gpu_step.py).

On a CUDA cache neither direction waits for the device inside the step. A load queues every
layer's host-to-device copy and scatter on a side stream (from pinned memory: a hot-tier entry as it
is, other rows staged once) and returns; each layer's attention waits only for its own layer
(``wait_for_layer_load``), so layer i+1 is copied while layer i computes. A save gathers the rows
of every prompt saved in the step, every layer's, into one device buffer on the engine's stream at
the step's end (``wait_for_save``; vLLM may reuse the blocks after the step), in one Triton launch
(:class:`kvstore.gpu.gather.LayerGather`; without Triton one ``index_select`` a layer as each
layer is handed over); the buffer then goes to pinned host memory in one transfer on the side
stream, in the cache's dtype, into a buffer of the worker's own pool (:class:`PinnedStaging`); the
background writer waits for that copy's event and encodes each prompt's rows — a bf16 cache's
rows for the bf16 tier (the default) copied into the records as their bits, other pairs widened to
f32 first.
Slot indices go to the device once per load or save, from pinned memory, so no copy in the forward
pass waits for the layers before it. On the CPU both are memory copies in the step.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.connectors.prefix_cache import LoadFailed, PrefixCache
from kvstore.connectors.save_writer import SaveWriter
from kvstore.connectors.tensors import rows_tensor
from kvstore.errors import ConfigError
from kvstore.formats.coli_kv import Geometry

logger = logging.getLogger(__name__)

__all__ = ["LoadSpec", "PagedWorker", "PinnedStaging", "SaveSpec", "layer_number", "paged_slots"]


@dataclass
class LoadSpec:
    """Rows ``[start, stop)`` of a stored session into the request's blocks."""

    req_id: str
    session_id: str
    start: int
    stop: int
    block_ids: list[int]


@dataclass
class SaveSpec:
    """A prompt whose prefill completes this step: its tokens and the blocks holding their rows."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]


def layer_number(name: str) -> int:
    """The first number in a layer's name (``model.layers.12.self_attn.attn`` -> 12), -1 if none."""
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else -1


def paged_slots(block_ids: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """Cache slots (block * block_size + offset) of token positions ``[start, stop)``."""
    positions = torch.arange(start, stop)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def _layer_gather(caches: list[torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """:class:`kvstore.gpu.gather.LayerGather` over ``caches`` (in layer order), or None where
    Triton is not installed or the caches differ in dtype, width or row stride (then the rows are
    gathered a layer at a time)."""
    try:
        from kvstore.gpu.gather import LayerGather
    except ImportError:  # Triton missing: vLLM installs it, a bare torch may not
        logger.info("kvstore connector: Triton is not installed; a save gathers its rows a layer at a time")
        return None
    try:
        return LayerGather(caches)
    except ValueError as exc:
        logger.info("kvstore connector: %s; a save gathers its rows a layer at a time", exc)
        return None


class PinnedStaging:
    """Pinned host buffers for the saves' device-to-host copies, owned by the worker and reused.

    A buffer asked of torch's pinned allocator each step was, once the writer let go of it, free for
    any pinned allocation of its size class, and the hot tier pins an entry of the same size for
    every save it keeps: so the step after a save often found no free block and allocated pinned
    memory inside the step (``cudaHostAlloc``, milliseconds for a 512-token prompt's 16 MB). Here a
    buffer goes back only to this pool, when the last object reading it is gone (``lend``), and a
    size class keeps at most ``keep`` free buffers.
    """

    def __init__(self, keep: int = 4, *, pin: bool = True):
        self.keep = keep
        self.pin = pin  # False: plain host memory (a machine without CUDA: the pool's own tests)
        self._free: dict[int, list[torch.Tensor]] = {}  # capacity in bytes -> free flat uint8 buffers
        self._lock = threading.Lock()  # taken by the step's thread, given back by the writer's
        #: buffers allocated (pinned memory asked of torch), and loans served from the pool
        self.allocated = 0
        self.reused = 0

    @staticmethod
    def capacity(nbytes: int) -> int:
        """The size class of ``nbytes``: the next power of two, at least 1 MiB."""
        return max(1 << 20, 1 << max(0, nbytes - 1).bit_length())

    def lend(self, shape: tuple[int, ...], dtype: torch.dtype, owner: object) -> torch.Tensor:
        """A pinned tensor of ``shape`` and ``dtype``, back in the pool once ``owner`` is collected
        (``owner`` must be what every reader of the tensor holds)."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = self.capacity(nbytes)
        with self._lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated += 1
        else:
            self.reused += 1
        weakref.finalize(owner, self._give, size, buffer)
        return buffer[:nbytes].view(dtype).view(shape)

    def _give(self, size: int, buffer: torch.Tensor) -> None:
        # a copy into it may still be in flight (a save skipped before its writer waited): the next
        # loan's copy is queued on the same side stream, after it, and read only after its own event
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < self.keep:
                free.append(buffer)


@dataclass
class _Staged:
    """Rows being copied out of the cache (the prompts saved in a step, every one's in one buffer;
    or a finished conversation's)."""

    # f32 [n_layers, n, width], what the writer saves: the memory of ``host`` (a CPU cache); None
    # on a GPU, where ``host`` is a pinned staging buffer the writer reads (as bf16 bits, or widened
    # to f32 by :meth:`part`, off the step)
    rows: np.ndarray | None
    # where the rows land on the host: on a GPU a buffer of the worker's PinnedStaging in the
    # cache's dtype (half the bytes over the bus for bf16), set by PagedWorker._stage
    host: torch.Tensor | None = None
    # a CUDA cache's rows gathered on the device on the engine's stream (every layer in one launch
    # at the step's end, or layer by layer without Triton), then copied to ``host`` in one transfer
    # on the side stream
    device: torch.Tensor | None = None
    filled: set[int] = field(default_factory=set)

    def part(
        self, a: int, b: int, copied: torch.cuda.Event | None, *, bits: bool = False
    ) -> tuple[np.ndarray, Callable[[], object] | None]:
        """Rows ``a .. b-1`` of every layer (one prompt of the step's buffer, or all of them) and what
        the writer calls before reading them (None: they hold their values now): waits for the
        device's copies and, for a narrower cache dtype, widens those rows into an array of their
        own, on the writer's thread — or with ``bits`` hands a bf16 cache's rows over as their u16
        bit patterns, a view of the staging buffer (the bf16 tier copies them as they are: no pass
        over the rows to widen them, none to narrow them back)."""
        if self.rows is not None:
            return self.rows[:, a:b], (None if copied is None else copied.synchronize)
        assert copied is not None and self.host is not None  # staged on a GPU
        if bits and self.host.dtype == torch.bfloat16:
            view = self.host[:, a:b].view(torch.int16).numpy().view(np.uint16)

            def landed() -> None:  # holds ``self``: the staging buffer is its loan, kept while the writer reads
                assert self.host is not None
                copied.synchronize()

            return view, landed
        rows = np.empty((self.host.shape[0], b - a, self.host.shape[2]), np.float32)

        def wait() -> None:  # holds ``self``: the staging buffer is its loan, not returned before this copy
            assert self.host is not None
            copied.synchronize()
            torch.from_numpy(rows).copy_(self.host[:, a:b])

        return rows, wait


@dataclass
class _StepRows:
    """What the prompts saved in one step hand over: every one's rows in one buffer, gathered in one
    launch (or one ``index_select`` a layer; never one per prompt: a short step is launch-bound, and
    each call the connector adds to it lengthens it), shipped in one transfer at the step's end."""

    staged: _Staged  # [n_layers, rows of every prompt, width]
    slots: torch.Tensor  # the cache slots of those rows, prompt after prompt (on the cache's device)
    spans: dict[str, tuple[int, int]]  # request -> its rows a .. b-1 of the buffer


class PagedWorker:
    """Loads stored rows into vLLM's per-layer caches and saves prompts' rows from them.

    Parameters
    ----------
    cache : the prefix cache the rows are loaded from and saved through (its counters count both)
    geometry : the model's MLA geometry (layers, kv_lora, qk_rope)
    block_size : tokens per cache block
    writer : the background writer saves go to (None: each save is written in the step)
    """

    def __init__(self, cache: PrefixCache, geometry: Geometry, block_size: int, writer: SaveWriter | None):
        self.cache = cache
        self.geometry = geometry
        self.block_size = block_size
        self.width = geometry.kv_lora + geometry.qk_rope
        self.writer = writer
        self._caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._device = torch.device("cpu")  # where the caches are (vLLM's worker keeps them on one device)
        self._side: torch.cuda.Stream | None = None  # carries the loads' and saves' copies (CUDA caches)
        self._step_rows: _StepRows | None = None  # the prompts' rows gathered this step
        # layers handed over this step, when every layer is gathered at the step's end (the step's
        # plan is made there too)
        self._handed: set[int] = set()
        self._layer_loaded: dict[str, torch.cuda.Event] = {}  # layer -> the end of its load copies, this step
        # host rows a queued load still reads (a hot-tier entry may be evicted meanwhile), with the
        # event after which they are free
        self._load_sources: list[tuple[torch.cuda.Event, object]] = []
        self._failed_blocks: set[int] = set()
        # requests whose load failed: their cache holds no stored rows where the load should have
        # put them, so the rows gathered for their prompt's save would be wrong KV
        self._load_failed: set[str] = set()
        self._sent: set[str] = set()  # finished requests whose conversation save is done
        self.staging = PinnedStaging()  # the saves' pinned host buffers (CUDA caches)
        # every layer's rows at a step's end in one launch (CUDA caches, with Triton); None: one
        # ``index_select`` a layer as each layer is handed over
        self._gather_all: Callable[..., torch.Tensor] | None = None
        # the store keeps bf16 rows as they are (the bf16 tier): a bf16 cache's saves go to the
        # writer as their bits
        self._save_bits = cache.native_dtype == np.uint16

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=layer_number)
        if len(names) != self.geometry.n_layers:
            raise ConfigError(
                f"kvstore connector: vLLM has {len(names)} attention layers, the model config {self.geometry.n_layers}"
            )
        for i, name in enumerate(names):
            cache = kv_caches[name]
            if cache.shape[-1] != self.width:
                raise ConfigError(
                    f"kvstore connector: layer {name} caches rows of {cache.shape[-1]} values, not {self.width}"
                )
            self._caches[name] = cache
            self._layer_of[name] = i
        if names:
            self._device = kv_caches[names[0]].device
        if self._device.type == "cuda":
            self._side = torch.cuda.Stream(device=self._device)
            self._gather_all = _layer_gather([self._caches[name] for name in names])

    def _engine_stream(self) -> torch.cuda.Stream:
        """The stream the engine queues its work on (CUDA caches)."""
        return torch.cuda.current_stream(self._device)

    @staticmethod
    def _rows_view(cache: torch.Tensor) -> torch.Tensor:
        """A layer's cache as ``[slots, width]`` (a view: writes land in the cache)."""
        return cache.view(-1, cache.shape[-1])

    def _device_slots(self, block_ids: list[int], start: int, stop: int, device: torch.device) -> torch.Tensor:
        return self._on_device(paged_slots(block_ids, self.block_size, start, stop), device)

    @staticmethod
    def _on_device(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return slots.to(device)
        # from pinned memory, asynchronously: a pageable copy would wait for the stream's earlier work
        return slots.pin_memory().to(device, non_blocking=True)

    # ------------------------------------------------------------------ loads (before the forward pass)
    def start_load(self, loads: Iterable[LoadSpec]) -> None:
        for load in loads:
            began = time.perf_counter()
            try:
                # only read below; a bf16 tier's rows as stored (bf16 into a bf16 cache: a plain copy)
                rows = self.cache.load(load.session_id, load.start, load.stop, view=True, native=True)
            except LoadFailed as exc:
                first, last = load.start // self.block_size, (load.stop - 1) // self.block_size
                self._failed_blocks.update(load.block_ids[first : last + 1])
                self._load_failed.add(load.req_id)
                logger.warning("kvstore connector: %s; vLLM recomputes those tokens", exc)
                continue
            if self._side is not None:
                self._load_async(load, rows)
            else:
                slots = self._device_slots(load.block_ids, load.start, load.stop, self._device)
                for name, cache in self._caches.items():
                    layer_rows = rows_tensor(rows[self._layer_of[name]]).to(device=self._device, dtype=cache.dtype)
                    self._rows_view(cache)[slots] = layer_rows
            # what a load costs against a raw read of the same stored bytes (bench/vllm_connector.py)
            self.cache.count(
                load_us=int((time.perf_counter() - began) * 1e6),
                loaded_bytes=(load.stop - load.start) * self.cache.record_bytes,
            )

    def _load_async(self, load: LoadSpec, rows: np.ndarray) -> None:
        """Queue a load's copies on the side stream, one event per layer (see :meth:`wait_for_layer`)."""
        assert self._side is not None
        self._release_load_sources()
        host = rows_tensor(rows)
        if not host.is_pinned():
            # an asynchronous copy needs pinned memory, and rows in order (a store's rows may be a
            # strided view of its records): one host copy
            host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
        # the blocks may have been another request's: what the engine queued on them comes first
        self._side.wait_stream(self._engine_stream())
        with torch.cuda.stream(self._side):
            slots = self._device_slots(load.block_ids, load.start, load.stop, self._device)
            for name, cache in self._caches.items():
                layer_rows = host[self._layer_of[name]].to(self._device, non_blocking=True).to(cache.dtype)
                self._rows_view(cache)[slots] = layer_rows
                self._layer_loaded[name] = torch.cuda.Event()
                self._layer_loaded[name].record(self._side)
            done = torch.cuda.Event()
            done.record(self._side)
        self._load_sources.append((done, (rows, host)))

    def _release_load_sources(self) -> None:
        """Let go of the host rows whose copies are done (an evicted hot-tier entry is freed then)."""
        self._load_sources = [(event, kept) for event, kept in self._load_sources if not event.query()]

    def wait_for_layer(self, layer_name: str) -> None:
        """Before a layer's attention: the engine's stream waits for that layer's loaded rows."""
        event = self._layer_loaded.pop(layer_name, None)
        if event is not None:
            self._engine_stream().wait_event(event)

    # ------------------------------------------------------------------ saves (during and after the forward pass)
    def _stage(self, n: int) -> _Staged:
        """Fresh memory for ``n`` tokens' rows of every layer (see :class:`_Staged`)."""
        shape = (self.geometry.n_layers, n, self.width)
        if self._side is None:
            rows = np.empty(shape, dtype=np.float32)
            return _Staged(rows, torch.from_numpy(rows))
        dtype = next(iter(self._caches.values())).dtype
        staged = _Staged(None, device=torch.empty(shape, dtype=dtype, device=self._device))
        staged.host = self.staging.lend(shape, dtype, staged)  # back to the pool when ``staged`` goes
        return staged

    def _copy_out(self, staged: _Staged, layer: int, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
        """A layer's rows at ``slots``: on a GPU gathered on the engine's stream into the device
        staging (one small kernel in the step), on the CPU copied to ``staged.host`` (widened)."""
        if staged.device is not None:
            torch.index_select(self._rows_view(kv_layer), 0, slots, out=staged.device[layer])
        else:
            assert staged.host is not None
            staged.host[layer].copy_(self._rows_view(kv_layer)[slots])

    def _ship(self, staged: list[_Staged]) -> torch.cuda.Event | None:
        """Copy the gathered rows of ``staged`` to the host, one transfer each, on the side stream
        after what the engine queued so far; an event after the copies (None on the CPU: the rows
        are there already)."""
        if self._side is None:
            return None
        self._side.wait_stream(self._engine_stream())
        with torch.cuda.stream(self._side):
            for one in staged:
                assert one.device is not None and one.host is not None  # gathered on a GPU, shipped once
                one.host.copy_(one.device, non_blocking=True)
                one.device.record_stream(self._side)  # freed once the side stream has read it
                one.device = None
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def save_layer(self, saves: Iterable[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        if self._gather_all is not None:
            # Gathered with every other layer at the step's end (wait_for_save), and planned there:
            # nothing in the step writes this layer's cache again, a launch a layer would cost the
            # step's host, and the plan's host time (slots, buffers) spent here, as the step's first
            # kernels are queued, would leave the device waiting; at the end the device is behind.
            self._handed.add(layer)
            return
        step = self._step_rows
        if step is None:  # the step's first layer: one buffer and one slot list for every prompt
            step = self._step_rows = self._plan_step(list(saves))
        self._copy_out(step.staged, layer, kv_layer, step.slots)
        step.staged.filled.add(layer)

    def _plan_step(self, saves: list[SaveSpec]) -> _StepRows:
        spans, slots, at = {}, [], 0
        for save in saves:
            n = len(save.tokens)
            spans[save.req_id] = (at, at + n)
            slots.append(paged_slots(save.block_ids, self.block_size, 0, n))
            at += n
        every = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        return _StepRows(self._stage(at), self._on_device(every, self._device), spans)

    def wait_for_save(self, saves: Iterable[SaveSpec], finished: Iterable[SaveSpec]) -> None:
        """End of a step: the finished conversations' rows, then the prompts gathered this step, go
        to the writer (which waits for their device copies, the step does not)."""
        saves = list(saves)
        step, self._step_rows = self._step_rows, None
        if self._handed:  # every layer gathered now, in one launch: the step's plan is made here
            step = self._plan_step(saves)
            step.staged.filled, self._handed = self._handed, set()
        for event in self._layer_loaded.values():  # a layer whose attention never waited: not past this step
            self._engine_stream().wait_event(event)
        self._layer_loaded.clear()
        self._release_load_sources()
        for save in finished:
            try:  # the blocks are held for this save: read every layer straight from the cache
                staged = self._gather(save.block_ids, len(save.tokens))
                rows, ready = staged.part(0, len(save.tokens), self._ship([staged]), bits=self._save_bits)
            except Exception as exc:  # never keep vLLM's blocks: a failed save is a future miss
                self.cache.count_save_error(f"{save.req_id}: {exc}")
                self._sent.add(save.req_id)
                self.cache.count(finished_done=1)
                continue
            self._save(save.tokens, rows, report=save.req_id, ready=ready)
        shipping = []
        for save in saves:
            if save.req_id in self._load_failed:
                # what was gathered holds the blocks the failed load left as they were; vLLM
                # recomputes them, and the conversation's save at the end holds the right rows
                self._load_failed.discard(save.req_id)
                continue
            # prompts whose layers were not all handed over are not saved: a partial row set would be wrong KV
            if step is not None and save.req_id in step.spans and len(step.staged.filled) == self.geometry.n_layers:
                shipping.append(save)
        if step is not None and shipping:
            if self._gather_all is not None:
                self._gather_all(step.slots, out=step.staged.device)
            copied = self._ship([step.staged])
            for save in shipping:
                rows, ready = step.staged.part(*step.spans[save.req_id], copied, bits=self._save_bits)
                self._save(save.tokens, rows, ready=ready)
        for save in finished:
            self._load_failed.discard(save.req_id)

    def _gather(self, block_ids: list[int], n: int) -> _Staged:
        """Rows of token positions ``[0, n)`` of every layer (on a GPU gathered on the device, to be
        shipped to the host by :meth:`_ship`)."""
        staged = self._stage(n)
        slots = self._device_slots(block_ids, 0, n, self._device)
        if self._gather_all is not None:
            self._gather_all(slots, out=staged.device)
            return staged
        for name, cache in self._caches.items():
            self._copy_out(staged, self._layer_of[name], cache, slots)
        return staged

    def _save(
        self, tokens: list[int], rows: np.ndarray, report: str | None = None, ready: Callable[[], object] | None = None
    ) -> None:
        """Hand rows to the background writer (skipped and counted when its queue is full), or save
        them now without one; ``report``: the finished request to report once the save is settled;
        ``ready``: what makes ``rows`` hold their values (waits for the device's copies)."""
        if self.writer is not None:
            self.writer.submit(tokens, rows, report, ready)
            return
        try:
            if ready is not None:
                ready()
            self.cache.save(tokens, rows)
        except Exception as exc:  # a failed save is a future miss, never a failed step
            self.cache.count_save_error(str(exc))
        if report is not None:
            self._sent.add(report)
            self.cache.count(finished_done=1)

    # ------------------------------------------------------------------ what vLLM asks after a step
    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose conversation is saved: vLLM frees their blocks now."""
        self._load_failed -= finished_req_ids  # finished with no save planned
        sent, self._sent = self._sent, set()
        if self.writer is not None:  # conversations whose save is durable, failed or given up
            sent |= self.writer.finished()
        return sent

    def load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        """Write the saves still queued, then stop the writer."""
        if self.writer is not None:
            self.writer.close(timeout=60.0)
