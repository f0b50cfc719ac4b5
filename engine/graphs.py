"""Decode steps replayed from CUDA graphs: the host launches one graph per token, not ~40 kernels
per layer.

A plain decode step on CUDA is bound by the host: every layer launches its projections, the
router, the experts, the cache write and the attention kernels one by one (the attention call alone
costs ~150 µs of Python and cupy), and the GPU waits between them. :class:`DecodeGraphs` captures
:meth:`MLAForCausalLM.decode_step` — whose token and position live in device memory and whose
shapes are fixed by the cache's capacity — once per capacity bucket, and replays it.

Buckets: a step at context ``n`` reads the first ``bucket(n)`` rows (the next power of two, at
least ``MIN_BUCKET``), and the kernels skip the rows past the sequence's length; one graph per
bucket. A graph is keyed by the cache's storage (:attr:`LatentCache.storage_key`) too: a growth
that moves the buffers captures again, while a restore that fits copies its rows into the buffers
and keeps every graph. :meth:`DecodeGraphs.warm` reserves the buffers for a longest context and
captures every bucket up to it ahead of time (what a server does at start), so that the first token
after a resume is a replay. Graphs of one engine share one memory pool.

Only CUDA captures graphs; elsewhere :meth:`Engine.decode_logits` runs the plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MIN_BUCKET", "DecodeGraphs", "bucket", "capture"]

#: Fewest rows a captured step reads: below this, one graph serves every short context.
MIN_BUCKET = 1024


def bucket(rows: int) -> int:
    """The capacity a context of ``rows`` positions is decoded with: a power of two >= MIN_BUCKET."""
    capacity = MIN_BUCKET
    while capacity < rows:
        capacity *= 2
    return capacity


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    token: torch.Tensor  # int64[1], the step's input (written before each replay)
    position: torch.Tensor  # int64[1]
    logits: torch.Tensor  # f32[1, vocab], the step's output (overwritten by each replay)


class DecodeGraphs:
    """The CUDA-graph decode steps of one model and one cache.

    Parameters
    ----------
    model : MLAForCausalLM on a CUDA device
    cache : its LatentCache (same device)
    """

    def __init__(self, model, cache):
        self.model = model
        self.cache = cache
        self.device = model.device
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = None
        self.captures = 0  # how many graphs were captured (a bench and test figure)

    def logits(self, token: int, position: int) -> torch.Tensor:
        """The next token's logits f32[vocab] after ``token`` at ``position``; writes its rows.

        The returned tensor is the graph's output buffer: read it before the next call.
        """
        rows = bucket(position + 1)
        self.cache.reserve(rows)
        key = (*self.cache.storage_key, rows)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture_for(key, token, position, rows, replay=True)
        else:
            captured.token.fill_(token)
            captured.position.fill_(position)
            captured.graph.replay()
        return captured.logits[0]

    def warm(self, max_context: int) -> int:
        """Reserve the cache's buffers for ``max_context`` positions and capture every bucket up to
        it; returns the graphs captured. The warm-up steps write only rows past the cache's length
        (never committed ones)."""
        self.cache.reserve(bucket(max_context))
        position = self.cache.length
        made = 0
        rows = bucket(position + 1)
        while rows <= bucket(max_context):
            key = (*self.cache.storage_key, rows)
            if key not in self._graphs:
                self._capture_for(key, 0, position, rows, replay=False)
                made += 1
            rows *= 2
        return made

    def _capture_for(self, key, token: int, position: int, rows: int, *, replay: bool) -> _Captured:
        # A new storage invalidates every graph of the old one (their buffers are gone). Dropped
        # graphs take their memory pool with them: later graphs get a new one (capturing into a
        # pool whose graphs were destroyed trips the caching allocator).
        kept = {k: v for k, v in self._graphs.items() if k[:2] == key[:2]}
        if len(kept) != len(self._graphs):
            self._pool = None
        self._graphs = kept
        captured = self._capture(token, position, rows, replay=replay)
        self._graphs[key] = captured
        return captured

    def _capture(self, token: int, position: int, n_rows: int, *, replay: bool) -> _Captured:
        device = self.device
        token_in = torch.full((1,), token, dtype=torch.int64, device=device)
        position_in = torch.full((1,), position, dtype=torch.int64, device=device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, logits = capture(
            lambda: self.model.decode_step(token_in, position_in, self.cache, n_rows), device, self._pool
        )
        if replay:
            graph.replay()  # the capture only recorded the step: run it for this token
        self.captures += 1
        return _Captured(graph, token_in, position_in, logits)


def capture(step, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture ``step()`` (a decode step reading its inputs from device tensors) into a graph using
    the memory ``pool``; returns the graph and the step's output buffer.

    The step runs twice on a side stream first, so allocations and lazy initialisations happen
    outside the capture; it writes the step's real rows, which the replays write again identically.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
