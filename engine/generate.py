"""Generation: a model, one latent cache, prefix reuse, greedy/sampled decoding, streaming.

The engine takes the **whole context** (every token of the conversation so far, the new turn
included) and reuses the longest prefix its cache already holds: only the rest is prefilled. After
a restart, restoring the journaled rows into the cache therefore makes the next turn prefill only
its new tokens. ``prefilled_tokens`` and ``reused_tokens`` report that split for every call.

The last sampled token is not run through the model (its row would only be needed by the next
turn, which starts with it): after a call the cache holds the context plus all generated tokens but
the last, and the next call's context, which contains them all, reuses every cached row.

Examples
--------
>>> engine = Engine.from_preset("tiny", seed=0)
>>> first = engine.generate([5, 6, 7, 8], max_new_tokens=4, stop_tokens=())
>>> len(first.tokens), first.prefilled_tokens, first.reused_tokens
(4, 4, 0)
>>> again = engine.generate([5, 6, 7, 8, *first.tokens, 9], max_new_tokens=2, stop_tokens=())
>>> again.reused_tokens, again.prefilled_tokens
(7, 2)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generator, Iterator, Sequence

import numpy as np
import torch

from kvstore.engine.cache import LatentCache, make_cache
from kvstore.engine.config import ModelConfig, preset
from kvstore.engine.errors import CacheError, GenerationError, GeometryMismatch
from kvstore.engine.model import MLAForCausalLM, Segment
from kvstore.engine.rows import StoredRows
from kvstore.tiers import Tier

__all__ = ["Engine", "GenerationResult", "GenerationStream", "SamplingParams", "sample_next"]

#: Tokens per prefill forward by device (None picks): the CPU bounds activation memory; on CUDA a
#: prompt up to 32k tokens runs in one forward, whose square causal attention takes the fused kernel.
PREFILL_CHUNKS = {"cpu": 4096, "cuda": 32768}
DEFAULT_PREFILL_CHUNK: int | None = None

#: A chunk of at most this many tokens after cached rows runs in the absorbed (decode) form. The
#: plain form expands every cached row through ``kv_b_proj`` whatever the chunk's length, so a short
#: turn on a long session paid for its whole context (2 tokens after 32,768 rows: 647 ms of prefill
#: on an H100, 246 ms on the 2-core CPU box, during which a scheduler's other turns got no step);
#: the absorbed form reads each cached row once per new token. Past about this length (for
#: DeepSeek-V3's widths the flops cross near 170 tokens) the expansion is the cheaper one.
ABSORBED_CHUNK_TOKENS = 64


def pack_chunks(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Group chunks of ``sizes`` tokens, in order, into forwards of at most ``budget`` tokens each
    (a chunk larger than the budget goes alone): first fit, so a long chunk does not hold back
    the short ones behind it. Returns the chunks' indices per forward."""
    groups: list[list[int]] = []
    room: list[int] = []
    for i, size in enumerate(sizes):
        for g, left in enumerate(room):
            if size <= left:
                groups[g].append(i)
                room[g] -= size
                break
        else:
            groups.append([i])
            room.append(budget - size)
    return groups


def absorbs(tokens: int, start: int) -> bool:
    """Whether a forward of ``tokens`` new tokens at position ``start`` takes the absorbed form."""
    return tokens == 1 or (start > 0 and tokens <= ABSORBED_CHUNK_TOKENS)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    ``temperature`` 0 (or None) is greedy (arg-max, the lowest id on a tie). Otherwise the logits
    are divided by the temperature, cut to the ``top_k`` best (0: all) and to the smallest set whose
    probability reaches ``top_p``, and sampled with a CPU generator seeded by ``seed`` — the same
    seed gives the same tokens on any device.
    """

    temperature: float | None = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature is not None and (not np.isfinite(self.temperature) or self.temperature < 0):
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return not self.temperature

    def generator(self) -> tuple[torch.Generator | None, int | None]:
        """The CPU generator sampling draws from, and its seed (``seed``, or a random one when
        None); ``(None, None)`` when greedy."""
        if self.greedy:
            return None, None
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        return torch.Generator().manual_seed(seed), seed


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose one token id from logits f32[vocab] (on any device)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.detach().float().cpu() / float(params.temperature or 1.0)  # (not greedy: > 0)
    if params.top_k and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # keep a token while the probability before it is still short of top_p (the first always)
        keep = (torch.cumsum(sorted_probs, dim=0) - sorted_probs) < params.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs, 1, generator=generator).item())


@dataclass
class GenerationResult:
    """What one call produced.

    Attributes
    ----------
    tokens : generated ids (a stop token that ended the call is included)
    finish_reason : ``"stop"`` (a stop token) or ``"length"`` (max_new_tokens)
    prefilled_tokens : context tokens run through the model in this call
    reused_tokens : context tokens whose cached rows were reused
    seed : the seed sampling used (None when greedy)
    text : decoded text of ``tokens`` when the engine has a tokenizer
    timings : seconds spent in ``prefill`` and ``decode``
    """

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    seed: int | None = None
    text: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _asked(logits: torch.Tensor | None) -> torch.Tensor:
    """The logits of a run that asked for them (``"last"`` or ``"all"``: never None there)."""
    if logits is None:
        raise GenerationError("the model computed no logits for a run that asked for them")
    return logits


class GenerationStream:
    """An iterator of generated token ids; ``result`` holds the :class:`GenerationResult` once done."""

    def __init__(self, steps: Generator[int, None, GenerationResult], progress: GenerationResult):
        self._steps = steps
        self._progress = progress
        self._started = False
        self.result: GenerationResult | None = None

    @property
    def tokens(self) -> list[int]:
        """The tokens produced so far."""
        return list(self._progress.tokens)

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise GenerationError("a generation stream can be read only once")
        self._started = True
        self.result = yield from self._steps

    def close(self) -> None:
        """Stop early (the tokens produced so far stay in the cache)."""
        self._steps.close()

    def final(self) -> GenerationResult:
        """The :class:`GenerationResult` of a stream read to its end (``result`` is None before)."""
        if self.result is None:
            raise GenerationError("the generation stream was not read to its end")
        return self.result


class Engine:
    """A model and its latent cache: prefill with prefix reuse, then decode.

    Parameters
    ----------
    model : MLAForCausalLM
    cache : LatentCache, optional — default an empty ``tier`` cache on the model's device
    tokenizer : optional transformers tokenizer (text in/out)
    tier : the cache tier when ``cache`` is not given: a ``kvstore.tiers.Tier`` or its name (``f32``,
        ``bf16``, ``fp8``, ``int4``, ``polar2`` .. ``polar6``, ``q8``)
    bits : deprecated, for one release: the PolarQuant bits of the old ``tq-polar`` name
    prefill_chunk : tokens per prefill forward (bounds activation memory for long prompts); None:
        :data:`PREFILL_CHUNKS` of the cache's device
    cuda_graphs : on a CUDA device, replay each decode step from a CUDA graph
        (:mod:`kvstore.engine.graphs`); False runs every step's kernels from Python
    compile_step : with CUDA graphs, fuse each step's elementwise work with ``torch.compile``
        (:meth:`MLAForCausalLM.compile_decode`; the first step of each new shape compiles, tens of
        seconds once per process, then replays); False keeps the eager kernels
    """

    def __init__(
        self,
        model: MLAForCausalLM,
        cache: LatentCache | None = None,
        tokenizer=None,
        *,
        tier: Tier | str = "f32",
        bits: int | None = None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        cuda_graphs: bool = True,
        compile_step: bool = True,
    ):
        self.model = model
        self.config: ModelConfig = model.config
        self.cache = cache if cache is not None else make_cache(tier, self.config, model.device, bits=bits)
        self.tokenizer = tokenizer
        if prefill_chunk is None:
            prefill_chunk = PREFILL_CHUNKS.get(self.cache.device.type, PREFILL_CHUNKS["cpu"])
        if prefill_chunk < 1:
            raise GenerationError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self._graphs = None
        self._batches = None  # kvstore.engine.batch.DecodeBatches, made on the first batch
        #: decode steps on CUDA replay graphs (single sequence, batches and the scheduler alike)
        self.cuda_graphs = bool(cuda_graphs) and self.cache.device.type == "cuda"
        if self.cuda_graphs:
            from kvstore.engine.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(model, self.cache)
            if compile_step and model.regions.compiled is False:
                model.compile_decode()

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        tier: Tier | str = "f32",
        bits: int | None = None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> "Engine":
        """Load a Hugging Face model folder (and its tokenizer, when it has one)."""
        from kvstore.engine.tokenizer import load_tokenizer
        from kvstore.engine.weights import load_model

        model = load_model(folder, device=device, dtype=dtype)
        return cls(model, tokenizer=load_tokenizer(Path(folder)), tier=tier, bits=bits, prefill_chunk=prefill_chunk)

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        tier: Tier | str = "f32",
        bits: int | None = None,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> "Engine":
        """A random-weight model of a preset geometry (``tiny``, ``tiny-yarn``, ``v2-lite``)."""
        from kvstore.engine.weights import random_model

        model = random_model(preset(name), seed=seed, device=device, dtype=dtype)
        return cls(model, tier=tier, bits=bits, prefill_chunk=prefill_chunk)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # -- cache ----------------------------------------------------------------------------------------
    def restore(self, rows: StoredRows, *, allow_requantize: bool = False) -> None:
        """Load journaled rows held in host memory into the cache (all or nothing); conversions as
        :meth:`LatentCache.restore` makes them.

        On a device the rows take :meth:`restore_file`'s path (``engine.restore.RowsBody``: laid out
        as records into the pinned ring by several threads, uploaded once, split and sanitized on
        the device); on the CPU they are placed where they lie (:meth:`LatentCache.restore`).

        Raises
        ------
        GeometryMismatch, CodecMismatch, CacheError, GenerationError (token ids outside the vocabulary)
        """
        if self.device.type == "cpu":
            self._check_tokens(rows.tokens)
            self.cache.restore(rows, allow_requantize=allow_requantize)
            return
        from kvstore.engine.restore import RowsBody

        if rows.tokens.ndim != 1:
            raise CacheError(f"tokens must be 1-D, got shape {rows.tokens.shape}")
        body = RowsBody(rows, self.config.coli_geometry())
        self.cache.restore_body(body, allow_requantize=allow_requantize, check_tokens=self._check_tokens)

    def restore_file(
        self,
        path: str | os.PathLike,
        *,
        allow_requantize: bool = False,
        strict: bool = False,
        into: LatentCache | None = None,
    ) -> int:
        """Load a ``.coli_kv`` file into the cache (or ``into``, e.g. one of :meth:`new_cache`'s for a
        batch); returns the positions restored.

        A row whose stored scale/radius no encoder writes is made inert (zeros), as the file loader
        does; ``strict`` refuses the file instead, leaving the cache as it was.

        Raises
        ------
        GeometryMismatch
            The file is for another model (h0..h5 differ), with the differing fields.
        BadScale
            ``strict``, and a row's scale/radius is corrupt: the file and the record are named.
        """
        from kvstore.engine.restore import FileBody

        # The body is read straight into pinned memory and split on the device (engine/restore.py);
        # the token check runs before the new rows replace the cache's.
        cache = self.cache if into is None else into
        with FileBody(path, expect=self.config.coli_geometry(), strict=strict) as body:
            cache.restore_body(body, allow_requantize=allow_requantize, check_tokens=self._check_tokens)
        return cache.length

    def restore_records(self, records, *, allow_requantize: bool = False) -> int:
        """Load records already read (``KVRecords``, e.g. from a session reader) into the cache on
        its device (all or nothing); returns the positions restored.

        Raises
        ------
        GeometryMismatch, CodecMismatch, GenerationError (token ids outside the vocabulary)
        """
        from kvstore.engine.restore import MemoryBody

        expect = self.config.coli_geometry()
        if records.geometry != expect:
            raise GeometryMismatch(
                "the records are for another model: " + "; ".join(records.geometry.mismatches(expect))
            )
        body = MemoryBody(records)
        self.cache.restore_body(body, allow_requantize=allow_requantize, check_tokens=self._check_tokens)
        return self.cache.length

    def restore_reader(self, reader, *, allow_requantize: bool = False, into: LatentCache | None = None) -> int:
        """Load the served records of an open session reader (``SessionStore.reader``, either
        backend) into the cache (or ``into``, e.g. a resident session's), read straight into the
        restore's ring (pinned on CUDA) chunk by chunk while earlier chunks upload — as
        :meth:`restore_file` reads a file; all or nothing. Returns the positions restored.

        Raises
        ------
        GeometryMismatch, CodecMismatch, SessionDamaged (a scale no encoder writes), GenerationError
        (token ids outside the vocabulary), and whatever the reader raises
        """
        from kvstore.engine.restore import ReaderBody

        expect = self.config.coli_geometry()
        if reader.info.geometry != expect:
            raise GeometryMismatch(
                "the session is for another model: " + "; ".join(reader.info.geometry.mismatches(expect))
            )
        cache = self.cache if into is None else into
        cache.restore_body(ReaderBody(reader), allow_requantize=allow_requantize, check_tokens=self._check_tokens)
        return cache.length

    def export_rows(self, start: int = 0, stop: int | None = None) -> StoredRows:
        """Cached rows as the journal stores them (the tier's own version, raw codes)."""
        return self.cache.export_rows(start, stop)

    # -- forward passes ----------------------------------------------------------------------------------
    def _check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise GenerationError(
                f"token ids must be in [0, {self.config.vocab_size}), got {int(tokens.min())}..{int(tokens.max())}"
            )

    def _context(self, tokens) -> np.ndarray:
        if isinstance(tokens, str):
            if self.tokenizer is None:
                raise GenerationError("this model folder has no tokenizer: pass token ids, not text")
            tokens = self.tokenizer(tokens, add_special_tokens=True)["input_ids"]
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GenerationError("the context is empty: give at least one token")
        self._check_tokens(ids)
        return ids

    def _run(self, ids: np.ndarray, start: int, *, absorbed: bool, logits: str, cache: LatentCache | None = None):
        cache = self.cache if cache is None else cache
        cache.prepare(start, ids.shape[0])
        tensor = torch.from_numpy(ids).to(self.device)
        out = self.model.forward_tokens(tensor, cache, start, absorbed=absorbed, logits=logits)
        cache.commit(start, ids)
        return out

    def warm_graphs(self, max_context: int) -> int:
        """On CUDA: reserve the cache for ``max_context`` positions, capture the decode graph of every
        context bucket up to it and allocate once the buffers a restore of that size uses (a
        server's start-up), so no resume pays for a capture or an allocation. Returns the graphs
        captured (0 where graphs are off)."""
        if self._graphs is None or self._graphs.cache is not self.cache:
            return 0
        made = self._graphs.warm(max_context)
        # and the buffers a restore of that many rows uses, so the first resume pays no allocation
        from kvstore.engine.restore import RecordLayout, reserve_buffers

        layout = RecordLayout.of(self.config.coli_geometry(), self.cache.tier.file_tier)
        reserve_buffers(layout.rec_bytes, max_context, self.cache.device)
        self.cache.reserve_restore(max_context)
        return made

    def decode_logits(self, token: int, position: int) -> torch.Tensor:
        """Run one generated ``token`` at ``position`` (the cache's length) and commit its rows.

        Returns the next token's logits f32[vocab]: from a CUDA graph replay on CUDA (read them before
        the next call), from the plain absorbed step elsewhere.
        """
        if self._graphs is None or self._graphs.cache is not self.cache:
            return _asked(self._run(np.array([token], dtype=np.int64), position, absorbed=True, logits="last"))
        self.cache.prepare(position, 1)
        logits = self._graphs.logits(token, position)
        self.cache.commit(position, [token])
        return logits

    def prefill(self, tokens) -> tuple[torch.Tensor, int, int]:
        """Bring the cache to ``tokens`` (the whole context), reusing the cached common prefix.

        At least the last token is always run, to get its logits.

        Returns
        -------
        logits : f32[vocab] for the token after the context
        prefilled : tokens run through the model
        reused : tokens whose cached rows were kept
        """
        ids = self._context(tokens)
        cached = self.cache.tokens
        limit = min(cached.shape[0], ids.shape[0] - 1)
        differs = np.nonzero(cached[:limit] != ids[:limit])[0]
        reused = int(differs[0]) if differs.size else limit
        self.cache.truncate(reused)
        logits = None
        for a in range(reused, ids.shape[0], self.prefill_chunk):
            chunk = ids[a : a + self.prefill_chunk]
            # a single token takes the decode form, as it would when generated
            if chunk.shape[0] == 1 and self._graphs is not None:  # the one new token of a resume
                logits = self.decode_logits(int(chunk[0]), a)
            else:
                logits = self._run(chunk, a, absorbed=absorbs(chunk.shape[0], a), logits="last")
        return _asked(logits), ids.shape[0] - reused, reused

    def extend(self, tokens) -> int:
        """Run ``tokens`` after the cached ones without sampling (e.g. the last generated token of a
        turn, so a journal holds the whole conversation); returns how many were run."""
        ids = self._context(tokens)
        self.prefill_into(self.cache, ids, self.cache.length)
        return int(ids.shape[0])

    def score(self, tokens, *, start: int = 0, absorbed: bool = True) -> torch.Tensor:
        """Teacher-forced logits f32[T, vocab] for ``tokens`` placed at ``start`` (cache rows < start reused).

        Used for quality checks: with ``absorbed`` every position attends through the tier's decode
        backend, as in generation.
        """
        ids = self._context(tokens)
        self.cache.truncate(start)
        return _asked(self._run(ids, start, absorbed=absorbed, logits="all"))

    # -- generation ---------------------------------------------------------------------------------------
    def new_cache(self) -> LatentCache:
        """An empty cache of this engine's tier on its device: one session of a batch
        (:meth:`generate_batch`); fill it with ``cache.restore(rows)`` or :meth:`restore_file`."""
        return make_cache(self.cache.tier, self.config, self.cache.device)

    def generate_batch(
        self,
        sequences,
        *,
        max_new_tokens: int = 64,
        temperature: float | None = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
    ):
        """Decode several sessions together: one forward per step runs a token of each.

        Parameters
        ----------
        sequences : :class:`kvstore.engine.batch.BatchSequence` (a cache and the new tokens to run
            after its rows, e.g. a resumed session and its next turn), one per session
        max_new_tokens, temperature, top_p, top_k, seed, stop_tokens : as :meth:`stream`, for each

        Returns
        -------
        :class:`kvstore.engine.batch.BatchResult`; each cache then holds its context and the tokens
        generated but the last, ready to export or to continue.
        """
        from kvstore.engine.batch import DecodeBatches

        params = SamplingParams(temperature, top_p, top_k, seed)
        params.validate()
        for seq in sequences:
            self._check_tokens(np.asarray(seq.tokens, dtype=np.int64).reshape(-1))
        if self._batches is None:
            self._batches = DecodeBatches(self.model, self.prefill_many, cuda_graphs=self.cuda_graphs)
        stops = self.stops(stop_tokens)
        return self._batches.run(sequences, max_new_tokens=max_new_tokens, params=params, stops=stops)

    def stops(self, stop_tokens: Sequence[int] | None) -> frozenset[int]:
        """The ids that end generation: ``stop_tokens``, or the model's ``eos_token_id`` when None."""
        return frozenset(int(t) for t in (self.config.eos_token_id if stop_tokens is None else stop_tokens))

    def prefill_into(self, cache: LatentCache, ids: np.ndarray, start: int) -> None:
        """Run ``ids`` into ``cache`` from ``start`` in prefill chunks, computing no logits."""
        for a in range(0, ids.shape[0], self.prefill_chunk):
            chunk = ids[a : a + self.prefill_chunk]
            self._run(chunk, start + a, absorbed=absorbs(chunk.shape[0], start + a), logits="none", cache=cache)

    def prefill_many(self, parts: Sequence[tuple[LatentCache, np.ndarray]]) -> int:
        """Run each ``(cache, ids)`` after its cache's rows, as :meth:`prefill_into` would, packing
        chunks of different caches into shared forwards (:meth:`prefill_packed`) of at most
        ``prefill_chunk`` tokens. Each sequence is cut at the same places as alone, so it takes the
        same attention form chunk by chunk. Returns the forwards run."""
        chunks = [
            [
                (cache, ids[a : a + self.prefill_chunk], cache.length + a)
                for a in range(0, ids.shape[0], self.prefill_chunk)
            ]
            for cache, ids in parts
        ]
        forwards = 0
        for round_ in range(max((len(c) for c in chunks), default=0)):  # chunk k of every sequence, then k+1
            due = [c[round_] for c in chunks if round_ < len(c)]
            for group in pack_chunks([chunk.shape[0] for _, chunk, _ in due], self.prefill_chunk):
                self.prefill_packed([due[i] for i in group])
                forwards += 1
        return forwards

    def prefill_packed(self, chunks: Sequence[tuple[LatentCache, np.ndarray, int]]) -> None:
        """Run every ``(cache, ids, start)`` chunk in one forward (one chunk per cache), computing no
        logits; each cache then holds its rows up to ``start + len(ids)``. The caller bounds the
        tokens (activation memory grows with them). A failed forward commits nothing.

        Raises
        ------
        GenerationError (token ids outside the vocabulary: nothing is run)
        """
        for _, ids, _ in chunks:
            self._check_tokens(ids)
        if len(chunks) == 1:
            cache, ids, start = chunks[0]
            self._run(ids, start, absorbed=absorbs(ids.shape[0], start), logits="none", cache=cache)
            return
        segments = [
            Segment(cache, start, int(ids.shape[0]), absorbs(ids.shape[0], start)) for cache, ids, start in chunks
        ]
        # short new prompts first: the forward runs their attention in one call (Segment.shares_attention)
        order = sorted(range(len(chunks)), key=lambda i: not segments[i].shares_attention)
        chunks, segments = [chunks[i] for i in order], [segments[i] for i in order]
        for cache, ids, start in chunks:
            cache.prepare(start, ids.shape[0])
        tensor = torch.from_numpy(np.concatenate([ids for _, ids, _ in chunks])).to(self.device)
        self.model.forward_packed(tensor, segments)
        for cache, ids, start in chunks:
            cache.commit(start, ids)

    def stream(
        self,
        tokens,
        *,
        max_new_tokens: int = 64,
        temperature: float | None = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_tokens: Sequence[int] | None = None,
    ) -> GenerationStream:
        """Generate token by token; iterate the stream for ids, read ``stream.result`` at the end.

        Parameters
        ----------
        tokens : the whole context, as ids (or text when the engine has a tokenizer)
        max_new_tokens : at most this many tokens are generated
        temperature, top_p, top_k, seed : see :class:`SamplingParams`
        stop_tokens : ids that end generation (included in the output); None means the model's
            ``eos_token_id``, ``()`` none
        """
        params = SamplingParams(temperature, top_p, top_k, seed)
        params.validate()
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = self._context(tokens)
        stops = self.stops(stop_tokens)
        result = GenerationResult()
        return GenerationStream(self._steps(ids, params, max_new_tokens, stops, result), result)

    def generate(self, tokens, **kwargs) -> GenerationResult:
        """Like :meth:`stream`, collected: returns the :class:`GenerationResult`."""
        stream = self.stream(tokens, **kwargs)
        for _ in stream:
            pass
        return stream.final()

    def _steps(
        self, ids: np.ndarray, params: SamplingParams, max_new: int, stops: frozenset[int], result: GenerationResult
    ) -> Generator[int, None, GenerationResult]:
        generator, seed = params.generator()
        if seed is not None:
            result.seed = seed
        began = time.perf_counter()
        logits, result.prefilled_tokens, result.reused_tokens = self.prefill(ids)
        result.timings["prefill"] = time.perf_counter() - began
        began = time.perf_counter()
        try:
            for step in range(max_new):
                token = sample_next(logits, params, generator)
                result.tokens.append(token)
                yield token
                if token in stops:
                    result.finish_reason = "stop"
                    break
                if step + 1 < max_new:
                    logits = self.decode_logits(token, self.cache.length)
        finally:
            result.timings["decode"] = time.perf_counter() - began
            if self.tokenizer is not None:
                result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        return result
