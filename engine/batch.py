"""Several sessions decoding together: each step runs one token of every sequence in one forward.

Decoding sessions one after another reads every weight once per token of each; a batched step
reads them once for all of them, so a server with many live conversations gets many tokens per
weight read. The sessions' rows are packed into one cache (the *pool*): sequence ``b`` owns rows
``offsets[b] ..`` with room for its context and every token it may generate. A step writes each
sequence's new row in its region and the decode kernels read the ragged regions in one call
(``seq_start``/``seq_len``, :class:`kvstore.engine.model.StepSlots`); the routed experts run over
the step's (token, expert) pairs, each hit expert's weights read once for all its tokens (on CUDA
the kernels of :mod:`kvstore.engine.expert_kernels`).

On CUDA the step is captured once per (batch size, pool storage) and replayed; the pool is kept
between batches that fit it, so a server that decodes batch after batch captures once. Elsewhere
the same step runs from Python.

Sequences that finish early (a stop token, their own budget) stay in the batch until the longest
is done — their results ignore the extra steps, whose rows land in their own spare room — so the
step's shapes, and its graph, never change mid-batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvstore.engine.cache import LatentCache
from kvstore.engine.errors import GenerationError
from kvstore.engine.generate import SamplingParams, sample_next
from kvstore.engine.graphs import MIN_BUCKET, bucket, capture
from kvstore.engine.model import MLAForCausalLM, StepSlots

__all__ = ["BatchResult", "BatchSequence", "DecodeBatches"]


@dataclass
class BatchSequence:
    """One session of a batch: its cache (rows ``0 .. cache.length-1``, e.g. restored from a
    journal) and the tokens to run after them (at least one: the last one is run by the first
    batched step, the others are prefilled into ``cache`` first)."""

    cache: LatentCache
    tokens: Sequence[int]


@dataclass
class BatchResult:
    """What a batch generated: ``tokens[b]`` and ``finish_reasons[b]`` (``"stop"`` or ``"length"``)
    per sequence, in the order given; ``steps`` batched forwards ran; ``timings`` in seconds
    (``prefill``: the sequences' extra tokens, ``decode``: the batched steps)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens)


class DecodeBatches:
    """Batched decoding for one model and one cache tier; keeps its pool (and graphs) between batches.

    Parameters
    ----------
    model : MLAForCausalLM
    prefill : ``prefill([(cache, tokens), ...])`` runs each sequence's extra tokens into its cache
        before the batch (the engine's chunked prefill, chunks of several sequences packed into
        shared forwards: ``Engine.prefill_many``)
    cuda_graphs : on CUDA, replay each step from a graph
    """

    def __init__(self, model: MLAForCausalLM, prefill, *, cuda_graphs: bool = True):
        self.model = model
        self._prefill = prefill
        self.cuda_graphs = cuda_graphs
        self._pool: LatentCache | None = None
        self._graphs: dict[tuple, tuple] = {}
        self._graph_pool = None
        self.captures = 0

    def run(
        self,
        sequences: Sequence[BatchSequence],
        *,
        max_new_tokens: int,
        params: SamplingParams,
        stops: frozenset[int],
    ) -> BatchResult:
        """Generate up to ``max_new_tokens`` for every sequence; each cache ends holding its context
        and every generated token but the last (as :meth:`Engine.generate` leaves its cache)."""
        if not sequences:
            raise GenerationError("a batch needs at least one sequence")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1 in a batch, got {max_new_tokens}")
        first = sequences[0].cache
        for seq in sequences:
            if seq.cache.tier is not first.tier or seq.cache.device != first.device:
                raise GenerationError(
                    "every sequence of a batch must use one cache tier on one device: "
                    f"{seq.cache.tier.name} on {seq.cache.device} after {first.tier.name} on {first.device}"
                )
            if len(seq.tokens) < 1:
                raise GenerationError("every sequence of a batch needs at least one token to run")
        result = BatchResult([[] for _ in sequences], ["length"] * len(sequences))
        began = time.perf_counter()
        extra = [(seq.cache, np.asarray(seq.tokens, dtype=np.int64).reshape(-1)[:-1]) for seq in sequences]
        if len({id(seq.cache) for seq in sequences}) != len(sequences):
            raise GenerationError("every sequence of a batch needs a cache of its own")
        self._prefill([(cache, ids) for cache, ids in extra if ids.shape[0]])
        lengths = [seq.cache.length for seq in sequences]
        result.timings["prefill"] = time.perf_counter() - began
        began = time.perf_counter()
        try:
            self._decode(sequences, lengths, max_new_tokens, params, stops, result)
        finally:
            result.timings["decode"] = time.perf_counter() - began
        return result

    # -- the pool ---------------------------------------------------------------------------------------
    def _pool_for(self, template: LatentCache, rows: int) -> LatentCache:
        pool = self._pool
        if pool is None or pool.tier is not template.tier or pool.device != template.device or pool.capacity < rows:
            self._pool = pool = LatentCache(template.tier, template.geometry, template.device)
            # rounded up to an eighth of the next power of two: room for later batches a little
            # larger, without doubling the memory of a large one
            step = max(MIN_BUCKET, bucket(rows) // 8)
            pool.reserve(-(-rows // step) * step)
            self._graphs.clear()  # they captured the old pool's storage
            self._graph_pool = None
        return pool

    def _decode(self, sequences, lengths, max_new, params, stops, result) -> None:
        device = sequences[0].cache.device
        b = len(sequences)
        rooms = np.array(lengths, dtype=np.int64) + max_new
        offsets = np.concatenate(([0], np.cumsum(rooms)[:-1]))
        pool = self._pool_for(sequences[0].cache, int(rooms.sum()))
        for seq, offset, n in zip(sequences, offsets.tolist(), lengths):
            pool.copy_rows(seq.cache, 0, offset, n)
        tokens_in = torch.tensor([int(s.tokens[-1]) for s in sequences], dtype=torch.int64, device=device)
        positions_in = torch.tensor(lengths, dtype=torch.int64, device=device)
        offsets_in = torch.from_numpy(offsets).to(device)
        step = self.step_function(pool, b, tokens_in, positions_in, offsets_in)
        generator, _ = params.generator()
        ran = [[int(s.tokens[-1])] for s in sequences]  # tokens whose rows each step wrote
        live = np.ones(b, dtype=bool)
        for s in range(max_new):
            logits = step()
            if params.greedy:
                chosen = logits.argmax(dim=-1)
                picked = chosen.tolist()
            else:
                picked = [sample_next(logits[i], params, generator) for i in range(b)]
                chosen = torch.tensor(picked, dtype=torch.int64, device=device)
            result.steps += 1
            for i in np.flatnonzero(live).tolist():
                result.tokens[i].append(picked[i])
                if picked[i] in stops:
                    result.finish_reasons[i] = "stop"
                    live[i] = False
                elif s + 1 < max_new:
                    ran[i].append(picked[i])
            if not live.any() or s + 1 == max_new:
                break
            tokens_in.copy_(chosen)
            positions_in.add_(1)
        for seq, offset, n, run in zip(sequences, offsets.tolist(), lengths, ran):
            seq.cache.reserve(n + len(run))
            seq.cache.copy_rows(pool, offset + n, n, len(run))
            seq.cache.commit(n, run)

    def forget_graphs(self) -> None:
        """Drop every captured graph (their pool storage is being let go: a new one could be given
        the same first address and capacity, the key a graph is found by)."""
        self._graphs.clear()
        self._graph_pool = None

    def step_function(self, pool: LatentCache, b: int, tokens_in, positions_in, offsets_in):
        """A callable running one batched step from the input tensors, returning logits f32[B, vocab].

        ``pool`` holds the rows: sequence ``i`` reads rows ``offsets_in[i] .. + positions_in[i]`` and
        writes its token's row at ``offsets_in[i] + positions_in[i]``. On CUDA the step is captured
        once per (pool storage, ``b``) and replayed; the callable copies the current inputs in first.
        Also the continuous scheduler's step (:mod:`kvstore.engine.scheduler`)."""
        n_rows = pool.capacity

        def forward_from(tokens, positions, offsets):
            return lambda: self.model.decode_step(tokens, positions, pool, n_rows, StepSlots.packed(offsets, positions))

        if not (self.cuda_graphs and pool.device.type == "cuda"):
            return forward_from(tokens_in, positions_in, offsets_in)
        key = (*pool.storage_key, b)
        if key not in self._graphs:
            stale = [k for k in self._graphs if k[:2] != key[:2]]
            if stale:  # graphs of a pool storage that is gone: their memory pool goes with them
                for k in stale:
                    del self._graphs[k]
                self._graph_pool = None
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # the graph reads these exact tensors: kept with it, refilled for each batch
            inputs = (tokens_in.clone(), positions_in.clone(), offsets_in.clone())
            graph, logits = capture(forward_from(*inputs), pool.device, self._graph_pool)
            self.captures += 1
            self._graphs[key] = (graph, inputs, logits)
        graph, inputs, logits = self._graphs[key]

        # The caller updates its own tensors between steps: copy them in before each replay.
        def replay():
            for held, current in zip(inputs, (tokens_in, positions_in, offsets_in)):
                held.copy_(current)
            graph.replay()
            return logits

        return replay
