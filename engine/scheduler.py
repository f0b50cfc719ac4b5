# Over 700 lines: one state machine — admission, fairness, prefill forwards, prompts riding steps, the decode step and the arena its turns' regions live in all move TurnWork through its phases and share the step's counts, and are reviewed together.
"""One scheduler owns the device: every turn in flight decodes in one batch (continuous batching).

Turns are submitted as :class:`TurnWork` (a session's resident cache, the new tokens, the sampling
parameters) from any thread; one scheduler thread runs them. Each **scheduler step**:

1. settles turns cancelled or past their deadline while they wait;
2. gives the free decode slots (``max_batch``) to turns whose prompt is prefilled, round-robin
   over owners (the owner with the fewest turns decoding first), and, when none is free, makes room
   for an owner that has nothing decoding (fairness, below);
3. runs **one prefill forward** of at most ``prefill_chunk`` prompt tokens, owners in turn — so a
   long prompt is prefilled between decode steps, never freezing the others. Each turn's prompt is
   cut in chunks of ``prefill_chunk`` tokens (the same cuts as a turn alone); the forward packs the
   next chunk of as many waiting turns as fit (``Engine.prefill_packed``): many short prompts
   arriving together cost about one forward, not one each (a forward of a 32-token prompt and one
   of 512 tokens take about the same time on a GPU: the weights are read once either way);
4. runs **one batched decode step** over every turn holding a slot: one forward, one token each —
   and, with ``step_tokens``, the whole prompt of each short turn that joins the batch in this step
   (**prompts in the step**, below).

The rows of the turns holding a slot live in one cache, the *arena*, each turn in a region of its
own (its session's rows copied in when it joins, the rows it wrote copied back to its session's
cache when it leaves), so a step is one ragged batch (``StepSlots.packed``; on CUDA a graph per
(arena storage, batch size), :meth:`kvstore.engine.batch.DecodeBatches.step_function`). A turn's
last prompt token is the input of its first decode step; each sampled token is the input of the
next; the step after its last token writes that token's row and the turn leaves, so its session's
cache then holds the whole conversation.

**Prompts in the step.** On a GPU a prefill forward runs from Python, kernel after kernel: one of
32 tokens costs what one of 512 does (about 70 ms for the V2-Lite geometry on an H100, 5-6 decode
steps), and while turns arrive one by one each of them paid one such forward, with every decoding
turn waiting on it. A decode step is a graph replay over one ragged batch, and nothing in it needs
one token per turn: a prompt of ``T`` tokens is ``T`` entries of the step, its rows written at
consecutive positions of the turn's region before any entry attends (each layer writes every
entry's row, then attends), each token reading its own rows up to its position, which is causal
attention. So a turn whose rest of prompt is short (:attr:`SchedulerLimits.step_tokens`, and its
tokens times its rows at most ``STEP_PROMPT_ROW_READS``: each entry reads its rows on its own)
joins the arena with its prompt unrun and runs all of it in the next step, the last token's logits
giving its first token. The step is padded to a size class as usual; the classes go on doubling
past ``max_batch`` up to ``step_tokens``. Longer prompts keep the prefill forwards above. It is on
by default where steps replay CUDA graphs (``STEP_TOKENS``; H100 runs: a 32k session's first token
among 15 decoding turns 289 -> 120-143 ms, 16 streaming clients 0.85x -> 0.99x the in-process batch)
and off elsewhere (a CPU engine's prefill is compute-bound; switched on, its f32 steps still give
what a turn gets alone).

**Fairness.** A turn whose owner has nothing decoding gets a decode slot at the next step if one is
free or an owner holds two slots or more (that owner's most recently admitted turn yields: it is
paused, its rows copied back, and resumes later where it stopped); otherwise within ``max_batch``
steps (a turn keeps its slot at least that many steps before it yields to such an owner). So a
waiting owner never waits for a whole turn of someone else. Steps are counted per turn
(:attr:`TurnWork.waited_steps`): the tests assert on them, never on timings.

**Limits** (:class:`SchedulerLimits`): slots, the turns one owner may have in flight and the turns
the server queues (beyond them :class:`~kvstore.engine.errors.ServerBusy`, which the API answers
with 429 and ``Retry-After``), the largest ``max_new_tokens``, a deadline per turn. A cancelled turn
(its client left) stops at the next step, keeping exactly the tokens its reader took.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from kvstore.engine.cache import LatentCache
from kvstore.engine.errors import GenerationError, ServerBusy
from kvstore.engine.generate import ABSORBED_CHUNK_TOKENS, Engine, SamplingParams, pack_chunks, sample_next

__all__ = ["SchedulerLimits", "Scheduler", "TurnWork", "Outcome", "STEP_PROMPT_ROW_READS", "STEP_TOKENS"]

log = logging.getLogger(__name__)

#: The most (token, row) reads a prompt riding a decode step may add per layer: each of its entries
#: reads its session's rows on its own (a prefill forward's attention reads them once per chunk), so
#: a long session's prompt keeps the prefill forward past this: 32 tokens after 32k rows ride, 512
#: after 2k (about 0.6 GB per layer at most in fp8, most of it from L2: the entries read the same rows).
STEP_PROMPT_ROW_READS = 1 << 20

#: A step's tokens where steps replay CUDA graphs and ``step_tokens`` is not given: an H100 run of
#: bench/serve_bench.py (BENCHMARKS.md, issue 37) measured 16 streaming clients at 0.99x the
#: in-process batch with it against 0.85x with every prompt in prefill forwards, 64 at 0.72x / 0.47x.
STEP_TOKENS = 512


@dataclass(frozen=True)
class SchedulerLimits:
    """What one scheduler allows (``kvstore serve`` flags in brackets).

    Attributes
    ----------
    max_batch : turns decoding together, the decode slots (``--max-batch``)
    max_queue : turns in flight beyond the slots, server-wide (``--max-queue``)
    max_turns_per_owner : turns one owner may have in flight (``--max-turns-per-owner``)
    max_new_tokens : the most tokens one turn may ask for (``--max-new-tokens``)
    turn_deadline : seconds a turn may run (from its submission) before it is stopped
        (``finish_reason == "deadline"``); None: no deadline (``--turn-deadline``)
    prefill_chunk : prompt tokens per prefill chunk and per prefill forward (one forward per
        scheduler step while turns decode, packing the chunks of several turns)
    pad_batches : decode ``n`` turns as a batch of the next power of two (at most ``max_batch``),
        the extra slots writing one scratch row nobody reads, so a CUDA graph and a compiled step
        serve each size class instead of each count turns come and go through (log2(max_batch) + 1
        captures, not max_batch); None: on where steps replay CUDA graphs
    arena_rows : rows of the decode arena (the decoding turns' rows, on the engine's device)
        reserved when the scheduler starts (``--arena-rows``); it grows past them when the turns
        need more, which moves every live row and outdates every captured graph, so the step that
        grows it is slow for everyone (0: nothing reserved, grown as needed)
    step_tokens : the most tokens one decode step runs, its decoding turns' one each and the
        prompts joining it in the step (``--step-tokens``); a prompt rides a step when it fits what
        the decoding turns leave (0: prompts never ride, a step runs ``max_batch`` tokens at most);
        None: ``STEP_TOKENS`` where steps replay CUDA graphs, 0 elsewhere
    """

    max_batch: int = 16
    max_queue: int = 64
    max_turns_per_owner: int = 8
    max_new_tokens: int = 4096
    turn_deadline: float | None = 600.0
    prefill_chunk: int = 512
    pad_batches: bool | None = None
    arena_rows: int = 0
    step_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_batch", "max_turns_per_owner", "max_new_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GenerationError(f"{name} must be a positive integer, not {value!r}")
        for name in ("max_queue", "arena_rows", "step_tokens"):
            value = getattr(self, name)
            if name == "step_tokens" and value is None:
                continue  # the engine's default (Scheduler)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GenerationError(f"{name} must be an integer >= 0, not {value!r}")
        if self.turn_deadline is not None and not self.turn_deadline > 0:
            raise GenerationError(f"turn_deadline must be a positive number of seconds, not {self.turn_deadline!r}")


@dataclass
class Outcome:
    """How a turn's generation ended: the tokens its reader took, why it stopped, what it cost."""

    tokens: list[int]
    finish_reason: str  # stop, length, cancelled, deadline
    prefilled_tokens: int
    decoded: bool  # it had a decode step: the cache holds its prompt (and tokens) rows
    seed: int | None
    timings: dict[str, float]
    error: BaseException | None = None


@dataclass(eq=False)
class TurnWork:
    """One turn for the scheduler: run ``ids`` after the rows of ``cache``, then generate.

    ``events`` receives ``("token", id)`` per generated token and one ``("end", Outcome)``.
    """

    owner: str
    cache: LatentCache
    ids: np.ndarray  # int64[T >= 1]: the new turn (the last one runs in the first decode step)
    params: SamplingParams
    max_new: int
    stops: frozenset[int]
    # a C queue: its reader (a thread per streamed turn) wakes once a step, and queue.Queue's
    # Python-level condition held the GIL for a tenth of a 64-client round's samples on an H100
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    deadline: float | None = None
    # -- scheduler state ------------------------------------------------------------------------
    phase: str = "prefill"  # prefill -> ready -> decode (-> ready when paused) -> done
    start: int = 0  # the cache's length when the turn began (its served rows)
    prefilled: int = 0  # of ids[:-1]
    generated: list[int] = field(default_factory=list)
    sampling: bool = True  # False once the turn wants no more tokens (its last row is still to write)
    next_input: int = 0
    position: int = 0  # where next_input goes in the session
    offset: int = 0  # the region's first arena row
    room: int = 0  # the region's rows
    admitted_step: int = -1  # the step it last got a slot at
    slot_steps: int = 0  # steps in its current slot
    ready_step: int = -1  # the step its prompt was prefilled at (or it was paused)
    waited_steps: list[int] = field(default_factory=list)  # steps from ready to a slot, each time
    step_prompt: np.ndarray | None = None  # the prompt's rest, run by its first step (prompts in the step)
    submitted_step: int = -1
    ended_step: int = -1
    decoded: bool = False
    finish: str | None = None
    cancel_at: int | None = None  # tokens the reader took when it cancelled
    generator: Any = None
    seed: int | None = None
    began: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})

    def cancel(self, delivered: int) -> None:
        """Stop at the next step, keeping the first ``delivered`` tokens (those the reader took)."""
        if self.cancel_at is None:
            self.cancel_at = delivered


class _Arena:
    """The cache the decoding turns' rows live in, in regions given out first-fit."""

    def __init__(self, template: LatentCache, rows: int = 0, on_grow: Callable[[], None] | None = None):
        self.template = template
        self.on_grow = on_grow
        self.cache = LatentCache(template.tier, template.geometry, template.device)
        self.free: list[tuple[int, int]] = []  # (offset, rows), sorted by offset
        self.capacity = 0
        if rows > 0:  # reserved up front: a growth moves every live row and outdates every graph
            self.cache.reserve(rows)
            self.capacity = self.cache.capacity
            self._give_back(0, self.capacity)

    def allocate(self, rows: int, live: list[TurnWork]) -> int:
        for i, (offset, size) in enumerate(self.free):
            if size >= rows:
                self.free[i : i + 1] = [(offset + rows, size - rows)] if size > rows else []
                return offset
        # grow: the old regions keep their offsets; the new room is one free block at the end
        # doubled: each growth recaptures the graph of every size class the turns then reach
        new_capacity = max(rows + self.capacity, 2 * self.capacity, 1024)
        grown = LatentCache(self.template.tier, self.template.geometry, self.template.device)
        grown.reserve(new_capacity)
        for work in live:  # the rows each decoding turn has (its session's and those it wrote)
            grown.copy_rows(self.cache, work.offset, work.offset, work.position)
        self.cache = grown
        if self.on_grow is not None:
            self.on_grow()
        tail = (self.capacity, grown.capacity - self.capacity)
        self.capacity = grown.capacity
        self._give_back(*tail)
        return self.allocate(rows, live)

    def release(self, offset: int, rows: int) -> None:
        self._give_back(offset, rows)

    def _give_back(self, offset: int, rows: int) -> None:
        if rows <= 0:
            return
        self.free.append((offset, rows))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged


class Scheduler:
    """The decode loop of one engine: turns join between steps, finished ones leave.

    Parameters
    ----------
    engine : the model (its ``prefill_into`` runs prompt chunks into a session's cache)
    limits : :class:`SchedulerLimits`
    """

    def __init__(self, engine: Engine, limits: SchedulerLimits | None = None):
        from kvstore.engine.batch import DecodeBatches

        self.engine = engine
        self.limits = limits or SchedulerLimits(prefill_chunk=engine.prefill_chunk)
        self._batches = DecodeBatches(engine.model, engine.prefill_many, cuda_graphs=engine.cuda_graphs)
        self._cv = threading.Condition()
        self._works: list[TurnWork] = []  # submitted, not done (any phase)
        self._owners: deque[str] = deque()  # round-robin order of owners with work
        self._inflight: dict[str, int] = {}  # owner -> turns begun and not closed
        self._arena: _Arena | None = None
        self._pad_row: int | None = None  # the arena's scratch row that padded slots write
        pad = self.limits.pad_batches
        self._pad = engine.cuda_graphs if pad is None else pad
        step_tokens = self.limits.step_tokens
        if step_tokens is None:  # prompts ride where a prefill forward is a string of launches
            step_tokens = STEP_TOKENS if engine.cuda_graphs else 0
        #: tokens one step may run (decoding turns' and riding prompts'); max_batch when prompts never ride
        self.step_capacity = max(self.limits.max_batch, step_tokens) if step_tokens else self.limits.max_batch
        self._prompts_ride = bool(step_tokens)
        self._sizes = self._size_classes()  # fixed by the limits: every step pads to one of them
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: steps run, tokens generated, prefill chunks run and the forwards that ran them, prompts
        #: run inside a decode step, turns paused for fairness, turns refused, times the decode arena
        #: grew
        self.counters = {
            "steps": 0,
            "tokens": 0,
            "prefill_chunks": 0,
            "prefill_forwards": 0,
            "step_prompts": 0,
            "preempted": 0,
            "refused": 0,
            "arena_growths": 0,
        }
        #: seconds in prefill forwards and in decode steps (the device's time and the host's)
        self.seconds = {"prefill": 0.0, "decode": 0.0}

    # ------------------------------------------------------------------ admission (any thread)
    def reserve(self, owner: str) -> None:
        """Count a turn of ``owner`` in flight, or refuse it (:class:`ServerBusy`) past the limits."""
        limits = self.limits
        with self._cv:
            mine = self._inflight.get(owner, 0)
            total = sum(self._inflight.values())
            if mine >= limits.max_turns_per_owner:
                self.counters["refused"] += 1
                raise ServerBusy(
                    f"owner {owner!r} has {mine} turns in flight, the most this server runs for one owner "
                    f"(--max-turns-per-owner {limits.max_turns_per_owner}); retry when one ends",
                    retry_after=1,
                )
            if total >= limits.max_batch + limits.max_queue:
                self.counters["refused"] += 1
                raise ServerBusy(
                    f"the server has {total} turns in flight ({limits.max_batch} decoding, {limits.max_queue} "
                    "queued at most); retry shortly",
                    retry_after=1,
                )
            self._inflight[owner] = mine + 1

    def unreserve(self, owner: str) -> None:
        with self._cv:
            left = self._inflight.get(owner, 0) - 1
            if left > 0:
                self._inflight[owner] = left
            else:
                self._inflight.pop(owner, None)

    def submit(self, work: TurnWork) -> None:
        """Queue a turn (its owner reserved): it runs on the scheduler thread from the next step."""
        ids = np.asarray(work.ids, dtype=np.int64).reshape(-1)
        if ids.size < 1:
            raise GenerationError("a turn needs at least one token to run")
        if work.max_new > self.limits.max_new_tokens:
            raise GenerationError(
                f"max_new_tokens {work.max_new} is over this server's cap of {self.limits.max_new_tokens} "
                "(--max-new-tokens)"
            )
        work.ids = ids
        work.start = work.cache.length
        work.sampling = work.max_new > 0  # none asked: the step only writes the prompt's last row
        work.generator, work.seed = work.params.generator()
        if work.deadline is None and self.limits.turn_deadline is not None:
            work.deadline = time.monotonic() + self.limits.turn_deadline
        work.phase = "prefill" if ids.shape[0] > 1 else "ready"
        with self._cv:
            work.submitted_step = self.counters["steps"]
            if work.phase == "ready":
                work.ready_step = work.submitted_step
            self._works.append(work)
            if work.owner not in self._owners:
                self._owners.append(work.owner)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvstore-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wake(self) -> None:
        """Look at the turns again now (a cancel arrived)."""
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the loop (turns still in flight end as cancelled)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def status(self) -> dict[str, Any]:
        """Turns decoding and waiting, per phase, with the counters (``/metrics``)."""
        with self._cv:
            phases = {"prefill": 0, "ready": 0, "decode": 0}
            for work in self._works:
                phases[work.phase] = phases.get(work.phase, 0) + 1
            arena = self._arena
            return {
                **phases,
                "in_flight": sum(self._inflight.values()),
                "owners": len(self._inflight),
                "arena_rows": arena.capacity if arena is not None else 0,
                **self.counters,
                **{f"{phase}_seconds": value for phase, value in self.seconds.items()},
            }

    def _arena_grew(self) -> None:
        self.counters["arena_growths"] += 1

    # ------------------------------------------------------------------ the loop (its own thread)
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._works and not self._stopping:
                    self._cv.wait()
                stopping = self._stopping
                works, self._works = (self._works, []) if stopping else ([], self._works)
            if stopping:
                for work in works:  # nothing of an unfinished turn is kept
                    work.cache.truncate(work.start)
                    work.decoded = False
                    self._end(work, "cancelled")
                return
            try:
                self._step()
            except BaseException as exc:  # the engine failed: every turn in flight gets the error
                log.exception("the scheduler's step failed")
                with self._cv:
                    works, self._works = self._works, []
                for work in works:
                    self._end(work, "error", error=exc)
                self._arena = self._pad_row = None
                self._batches.forget_graphs()  # they captured the arena let go here

    def _step(self) -> None:
        with self._cv:
            works = list(self._works)
        now = time.monotonic()
        for work in works:  # 1. turns that end before their next step
            if work.phase == "decode":
                continue
            if work.cancel_at is not None or (work.deadline is not None and now >= work.deadline):
                self._leave_waiting(work, "cancelled" if work.cancel_at is not None else "deadline")
        with self._cv:
            works = [w for w in self._works if w.phase != "done"]
        self._admit(works)  # 2. slots
        decoding = [w for w in works if w.phase == "decode"]
        prefilling = [w for w in works if w.phase == "prefill"]
        if len(decoding) < self.limits.max_batch:  # a slot is free: short prompts ride the next step
            prefilling = [w for w in prefilling if not self._rides(w)]
        if prefilling:  # 3. prefill: one forward, or, with nothing decoding, a chunk of every turn
            self._prefill(self._fair_order(prefilling), every_turn=not decoding)
        if decoding:  # 4. decode
            self._decode(decoding)
        self.counters["steps"] += 1

    # ------------------------------------------------------------------ slots and fairness
    def _fair_order(self, works: list[TurnWork]) -> list[TurnWork]:
        """``works`` one per owner in round-robin order, then again, oldest first within an owner."""
        by_owner: dict[str, deque[TurnWork]] = {}
        for work in works:
            by_owner.setdefault(work.owner, deque()).append(work)
        with self._cv:
            order = [o for o in self._owners if o in by_owner]
            if order:  # the next call starts one owner later
                self._owners.rotate(-1)
        out = []
        while by_owner:
            for owner in list(order):
                queue_of = by_owner.get(owner)
                if queue_of:
                    out.append(queue_of.popleft())
                    if not queue_of:
                        del by_owner[owner]
        return out

    def _rides(self, work: TurnWork) -> bool:
        """Whether the rest of ``work``'s prompt may run inside a decode step (prompts in the step)."""
        if not self._prompts_ride or work.phase != "prefill":
            return False
        rest = self._entries(work)
        return rest <= self.step_capacity - 1 and rest * (work.cache.length + rest) <= STEP_PROMPT_ROW_READS

    def _admit(self, works: list[TurnWork]) -> None:
        active = [w for w in works if w.phase == "decode"]
        ready = [w for w in works if w.phase == "ready" or self._rides(w)]
        if not ready:
            return
        slots = self.limits.max_batch
        entries = len(active)  # the step's tokens so far: one per decoding turn
        counts: dict[str, int] = {}
        for work in active:
            counts[work.owner] = counts.get(work.owner, 0) + 1
        # owners with the fewest turns decoding first; round-robin among equals
        waiting = sorted(self._fair_order(ready), key=lambda w: counts.get(w.owner, 0))
        for work in waiting:
            needs = self._entries(work)
            if len(active) >= slots:
                if counts.get(work.owner, 0):
                    continue  # an owner already decoding waits for a free slot
                victim = self._victim(active, counts)
                freed = self._entries(victim) if victim is not None else 0
                if victim is None or entries - freed + needs > self.step_capacity:
                    continue
                self._pause(victim)
                active.remove(victim)
                counts[victim.owner] -= 1
                entries -= freed
            elif entries + needs > self.step_capacity:
                continue  # a prompt that does not fit this step's tokens rides a later one
            self._join(work, active)
            active.append(work)
            entries += needs
            counts[work.owner] = counts.get(work.owner, 0) + 1

    @staticmethod
    def _entries(work: TurnWork) -> int:
        """Tokens ``work`` runs in the step it joins or holds a slot in: the rest of its prompt
        while that is unrun (it rides the step), else one."""
        if work.phase == "prefill" or work.step_prompt is not None:
            return work.ids.shape[0] - work.prefilled
        return 1

    def _victim(self, active: list[TurnWork], counts: dict[str, int]) -> TurnWork | None:
        """The turn that yields its slot to an owner with nothing decoding, or None (wait)."""
        crowded = [w for w in active if counts.get(w.owner, 0) >= 2]
        if crowded:
            return max(crowded, key=lambda w: w.admitted_step)
        ripe = [w for w in active if w.slot_steps >= self.limits.max_batch]
        return max(ripe, key=lambda w: w.slot_steps) if ripe else None

    def _join(self, work: TurnWork, active: list[TurnWork]) -> None:
        """Give ``work`` a region of the arena holding its session's rows; it decodes from this step."""
        if self._arena is None:
            self._arena = _Arena(work.cache, self.limits.arena_rows, self._arena_grew)
        arena = self._arena
        if work.phase == "prefill":  # the rest of its prompt runs in the coming step
            work.step_prompt = work.ids[work.prefilled :]
            work.ready_step = work.submitted_step  # its wait counts from its submission
        rows_left = (work.max_new - len(work.generated)) + self._entries(work)
        work.position = work.cache.length
        work.room = work.position + rows_left
        work.offset = arena.allocate(work.room, active)
        arena.cache.copy_rows(work.cache, 0, work.offset, work.position)
        if not work.decoded:
            work.next_input = int(work.ids[-1])
        work.phase = "decode"
        work.waited_steps.append(self.counters["steps"] - work.ready_step)
        work.admitted_step = self.counters["steps"]
        work.slot_steps = 0

    def _pause(self, work: TurnWork) -> None:
        """Take ``work``'s slot back: the rows it wrote go to its session's cache; it resumes later
        (a prompt that joined to ride this step and has not run goes back to waiting as it was)."""
        self._copy_back(work, work.position)
        if work.step_prompt is not None:
            work.step_prompt = None
            work.phase = "prefill"
            work.waited_steps.pop()
            return
        work.phase = "ready"
        work.ready_step = self.counters["steps"]
        self.counters["preempted"] += 1

    def _copy_back(self, work: TurnWork, stop: int) -> None:
        """Rows ``cache.length .. stop`` of the turn's region into its session's cache; the region is freed."""
        arena, cache = self._arena, work.cache
        assert arena is not None  # a decoding turn has a region
        first = cache.length
        if stop > first:
            cache.reserve(stop)
            cache.copy_rows(arena.cache, work.offset + first, first, stop - first)
            # the tokens each row was computed for: the prompt's, then the generated ones
            lo, hi, prompt = first - work.start, stop - work.start, work.ids.shape[0]
            ran = work.ids[lo:hi].tolist() + work.generated[max(0, lo - prompt) : max(0, hi - prompt)]
            cache.commit(first, ran)
        arena.release(work.offset, work.room)

    # ------------------------------------------------------------------ prefill and decode
    def _prefill(self, works: list[TurnWork], every_turn: bool) -> None:
        """The next chunk of each of ``works`` (in fair order), packed into forwards of at most
        ``prefill_chunk`` tokens (first fit, so the first turn's chunk always runs in the first);
        only the first forward unless ``every_turn``."""
        size = self.limits.prefill_chunk
        seen: set[int] = set()
        chunks = []
        for work in works:
            if id(work.cache) not in seen:  # one chunk per cache in a forward
                seen.add(id(work.cache))
                chunks.append((work, work.ids[:-1][work.prefilled : work.prefilled + size]))
        groups = pack_chunks([chunk.shape[0] for _, chunk in chunks], size)
        for group in groups if every_turn else groups[:1]:
            began = time.perf_counter()
            members = [chunks[i] for i in group]
            self.engine.prefill_packed([(work.cache, chunk, work.cache.length) for work, chunk in members])
            elapsed = time.perf_counter() - began
            self.seconds["prefill"] += elapsed
            self.counters["prefill_forwards"] += 1
            for work, chunk in members:
                work.prefilled += chunk.shape[0]
                work.timings["prefill"] += elapsed
                self.counters["prefill_chunks"] += 1
                if work.prefilled >= work.ids.shape[0] - 1:
                    work.phase = "ready"
                    work.ready_step = self.counters["steps"]

    def _decode(self, active: list[TurnWork]) -> None:
        arena = self._arena
        assert arena is not None  # turns decode only after joining it
        began = time.perf_counter()
        # one entry per decoding turn, a riding prompt's tokens at consecutive positions; ``last[i]``
        # is turn i's last entry, whose logits give its next token
        runs = [w.step_prompt if w.step_prompt is not None else (w.next_input,) for w in active]
        counts = np.fromiter((len(run) for run in runs), dtype=np.int64, count=len(runs))
        last = np.cumsum(counts) - 1
        n = int(counts.sum())
        first_positions = np.fromiter((w.position for w in active), dtype=np.int64, count=len(active))
        tokens = np.concatenate([np.asarray(run, dtype=np.int64) for run in runs])
        positions = np.repeat(first_positions - (last + 1 - counts), counts) + np.arange(n)
        offsets = np.repeat(np.fromiter((w.offset for w in active), dtype=np.int64, count=len(active)), counts)
        extra = self._padding(n)
        if extra:
            if self._pad_row is None:
                self._pad_row = arena.allocate(1, active)  # may grow the arena: before reading its cache
            tokens = np.concatenate([tokens, np.zeros(extra, dtype=np.int64)])
            positions = np.concatenate([positions, np.zeros(extra, dtype=np.int64)])
            offsets = np.concatenate([offsets, np.full(extra, self._pad_row, dtype=np.int64)])
        device = arena.cache.device
        tokens_in, positions_in, offsets_in = (torch.from_numpy(a).to(device) for a in (tokens, positions, offsets))
        step = self._batches.step_function(arena.cache, n + extra, tokens_in, positions_in, offsets_in)
        logits = step()
        sampling = [i for i, w in enumerate(active) if w.sampling]
        picked: dict[int, int] = {}
        greedy = [i for i in sampling if active[i].params.greedy]
        if greedy:
            chosen = logits[torch.from_numpy(last[greedy]).to(device)].argmax(dim=-1).tolist()
            picked.update(zip(greedy, chosen))
        for i in sampling:
            if i not in picked:
                work = active[i]
                picked[i] = sample_next(logits[int(last[i])], work.params, work.generator)
        elapsed = time.perf_counter() - began
        self.seconds["decode"] += elapsed
        now = time.monotonic()
        for i, work in enumerate(active):
            if work.step_prompt is not None:  # its prompt ran in this step
                work.timings["prefill"] += elapsed
                work.position += work.step_prompt.shape[0]
                work.prefilled = work.ids.shape[0] - 1
                work.step_prompt = None
                self.counters["step_prompts"] += 1
            else:
                work.timings["decode"] += elapsed
                work.position += 1
            work.slot_steps += 1
            work.decoded = True
            if i not in picked:  # its last token's row is written: it leaves
                self._leave_decoding(work)
                continue
            token = picked[i]
            work.generated.append(token)
            work.next_input = token
            self.counters["tokens"] += 1
            work.events.put(("token", token))
            if token in work.stops:
                work.finish = "stop"
            elif len(work.generated) >= work.max_new:
                work.finish = "length"
            elif work.deadline is not None and now >= work.deadline:
                work.finish = "deadline"
            if work.finish is not None:
                work.sampling = False
        for work in active:  # a reader that left: stop at this step, keeping what it took
            if work.phase == "decode" and work.cancel_at is not None:
                self._cancel_decoding(work)

    def _padding(self, n: int) -> int:
        """Entries added to a step of ``n`` (at most the step's capacity): up to its size class."""
        return next((size - n for size in self._sizes if size >= n), 0)

    def size_classes(self) -> list[int]:
        """The batch sizes steps run at when padding (1, 2, 4, ... and max_batch; on past it up to
        the step's capacity when prompts ride steps); [] when not."""
        return list(self._sizes)

    def _size_classes(self) -> list[int]:
        if not self._pad:
            return []
        sizes, size = [], 1
        while size < self.limits.max_batch:
            sizes.append(size)
            size *= 2
        sizes.append(self.limits.max_batch)
        size = 1 << self.limits.max_batch.bit_length()  # the next power of two past max_batch
        while size < self.step_capacity:
            sizes.append(size)
            size *= 2
        return sorted({*sizes, self.step_capacity})

    def warm(self) -> list[int]:
        """One decode step of every size class on a scratch arena, before any turn (a server's
        start): each class's compiled step and CUDA graph are made now, not in the middle of the
        first turns that reach it (seconds each on a GPU). Every slot reads nothing and writes one
        scratch row; the arena stays the one turns decode in. Returns the sizes run ([] when steps
        are not padded)."""
        sizes = self.size_classes()
        if not sizes:
            return []
        with self._cv:
            if self._works:
                raise GenerationError("warm() runs before the scheduler's first turn")
        arena = _Arena(self.engine.new_cache(), self.limits.arena_rows, self._arena_grew)
        row = arena.allocate(1, [])
        device = arena.cache.device
        for size in sizes:
            zeros = torch.zeros(size, dtype=torch.int64, device=device)
            offsets = torch.full((size,), row, dtype=torch.int64, device=device)
            self._batches.step_function(arena.cache, size, zeros, zeros.clone(), offsets)()
        # The turns decode in this arena (its scratch row the padding's): its graphs stay the ones
        # replayed. A new arena of the same size would be keyed like this one (first field's
        # address, capacity) and could be handed the freed blocks in another order.
        self._arena, self._pad_row = arena, row
        self._warm_prefill()
        return sizes

    def _warm_prefill(self) -> None:
        """Prefill forwards of 1, 2, 4, ... ABSORBED_CHUNK_TOKENS tokens after one cached row, on a
        scratch cache. On CUDA a forward of few tokens runs the routed experts' Triton kernels,
        built for each power of two of its (token, expert) pairs (``expert_kernels.PAIRS``); the
        decode step's compiled region has copies of its own. On an H100 the first short message
        of a new class after 32k rows took 0.57-0.95 s, the same again 78 ms
        (``bench/packed_prefill.py --after``), and in a server every other turn waited that long.
        Powers of two of the tokens reach every class of pairs up to the chunk's."""
        scratch = self.engine.new_cache()
        self.engine.prefill_packed([(scratch, np.zeros(1, dtype=np.int64), 0)])
        tokens = 2
        while tokens <= ABSORBED_CHUNK_TOKENS:
            self.engine.prefill_packed([(scratch, np.zeros(tokens, dtype=np.int64), 1)])
            tokens *= 2

    def _cancel_decoding(self, work: TurnWork) -> None:
        keep = min(work.cancel_at or 0, len(work.generated))
        written = work.position - work.start - work.ids.shape[0]  # generated tokens whose row is written
        del work.generated[keep:]
        work.finish = "cancelled"
        if written >= keep:
            self._leave_decoding(work)
        else:  # its last kept token still needs its row: one more step, sampling nothing
            work.sampling = False
            work.next_input = work.generated[-1]

    def _leave_decoding(self, work: TurnWork) -> None:
        stop = work.start + work.ids.shape[0] + len(work.generated)  # the prompt and every kept token
        self._copy_back(work, stop)
        self._end(work, work.finish or "length")

    def _leave_waiting(self, work: TurnWork, reason: str) -> None:
        """End a turn that holds no slot: a paused one keeps what it generated (its rows are in its
        cache); one that never decoded stores nothing (the prefilled rows are dropped)."""
        if work.decoded:
            keep = len(work.generated) if work.cancel_at is None else min(work.cancel_at, len(work.generated))
            written = work.cache.length - work.start - work.ids.shape[0]
            if written < keep:  # its last kept token's row is missing: let it take one more slot
                del work.generated[keep:]
                work.sampling, work.next_input, work.finish = False, work.generated[-1], reason
                return
            del work.generated[keep:]
            work.cache.truncate(work.start + work.ids.shape[0] + keep)
        else:
            work.cache.truncate(work.start)
        self._end(work, reason)

    def _end(self, work: TurnWork, reason: str, error: BaseException | None = None) -> None:
        with self._cv:
            if work in self._works:
                self._works.remove(work)
            if not any(w.owner == work.owner for w in self._works) and work.owner in self._owners:
                self._owners.remove(work.owner)
        work.phase = "done"
        work.ended_step = self.counters["steps"]
        work.timings["generate"] = time.perf_counter() - work.began
        work.events.put(
            (
                "end",
                Outcome(
                    list(work.generated),
                    reason,
                    int(work.ids.shape[0]) if work.decoded else work.prefilled,
                    work.decoded,
                    work.seed,
                    dict(work.timings),
                    error,
                ),
            )
        )
