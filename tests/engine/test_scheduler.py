"""The scheduler (``kvstore.engine.scheduler``): turns join and leave a batch between decode steps.

Every turn must get exactly what it gets decoding alone (greedy, f32 cache, CPU: token-identical,
as ``Engine.generate_batch`` is), however turns come and go, pause for fairness and resume; a long
prompt is prefilled in chunks between decode steps; an owner with nothing decoding gets a slot
within the documented number of steps; a cancelled turn keeps exactly the tokens its reader took.
Steps are counted, never timed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.engine import Engine, preset, random_model
from kvstore.engine.errors import GenerationError, ServerBusy
from kvstore.engine.generate import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerLimits, TurnWork
from scheduled import drain

GREEDY = SamplingParams(0.0, 1.0, 0, None)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=4)


@pytest.fixture
def engine(model):
    return Engine(model, tier="f32")


def context(vocab: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, vocab, n)


def alone(model, ids, max_new: int, tier: str = "f32") -> list[int]:
    return Engine(model, tier=tier).generate(ids, max_new_tokens=max_new, stop_tokens=()).tokens


def turn(engine, owner: str, ids, max_new: int, **kw) -> TurnWork:
    return TurnWork(owner, engine.new_cache(), np.asarray(ids), GREEDY, max_new, frozenset(), **kw)


def run_scheduler(engine, limits: SchedulerLimits) -> Scheduler:
    return Scheduler(engine, limits)


@pytest.mark.parametrize("step_tokens", [0, 64])
@pytest.mark.parametrize("tier", ["f32", "fp8", "int4", "q8"])
def test_turns_joining_and_leaving_get_what_they_get_alone(model, tier, step_tokens):
    """With ``step_tokens`` the first wave's prompts ride their first decode step (prompts in the
    step, tests/engine/test_step_prompts.py); the second arrives while the first decodes and is
    prefilled by forwards while every slot is taken, as it is without. A second-wave turn that
    arrives after a short first-wave turn has left finds a slot free and rides instead, and one
    whose first chunks were forwarded rides with the rest once a slot frees: how many do depends on
    the test thread's timing, so the forwards are watched — every second-wave turn no forward
    touched must have ridden, and no more can have than took part. The first wave is submitted
    under the scheduler's lock: submitted one by one, a test thread held up between two submits let
    the second wave take the last slot first (CI: the 40-token turn then waited and was forwarded)."""
    engine = Engine(model, tier=tier)
    forwarded: set[int] = set()  # id() of each cache a prefill forward ran a chunk of
    packed = engine.prefill_packed

    def watched(chunks, *args, **kw):
        forwarded.update(id(cache) for cache, _, _ in chunks)
        return packed(chunks, *args, **kw)

    engine.prefill_packed = watched
    vocab = model.config.vocab_size
    plan = [(5, 7), (17, 3), (40, 5), (1, 9), (23, 2), (9, 6)]  # (prompt tokens, tokens to generate)
    limits = SchedulerLimits(max_batch=3, prefill_chunk=8, turn_deadline=None, step_tokens=step_tokens)
    scheduler = run_scheduler(engine, limits)
    try:
        works = [turn(engine, f"o{i % 2}", context(vocab, n, seed=i), m) for i, (n, m) in enumerate(plan)]
        with scheduler._cv:  # the first wave arrives together: one step sees it all (the loop waits on this lock)
            for work in works[:3]:
                scheduler.submit(work)
        assert works[0].events.get(timeout=120)[0] == "token"  # the first wave decodes: the second joins it
        for work in works[3:]:
            scheduler.submit(work)
        results = [drain(w) for w in works]
    finally:
        scheduler.close()
    for i, (work, (n, m), (tokens, outcome)) in enumerate(zip(works, plan, results)):
        want = alone(model, work.ids, m, tier)
        assert outcome.tokens == want and outcome.finish_reason == "length" and outcome.decoded
        # the events carried every token (the first one of the first turn was read above)
        assert tokens == (want[1:] if i == 0 else want)
        # the session's cache holds the whole conversation: the prompt and every token, the last included
        assert work.cache.length == n + m
        assert work.cache.tokens.tolist() == [*work.ids.tolist(), *want]
    steps = scheduler.counters["steps"]
    assert steps < sum(m + 1 for _, m in plan)  # turns shared steps: a batch, not one after another
    if step_tokens:  # the first wave rode its first step; the second rode, was forwarded, or both
        # a one-token turn has nothing to prefill: it neither rides nor takes a forward
        second = [w for w, (n, _) in zip(works[3:], plan[3:]) if n > 1]
        untouched = [w for w in second if id(w.cache) not in forwarded]
        assert not any(id(w.cache) in forwarded for w in works[:3])
        assert 3 + len(untouched) <= scheduler.counters["step_prompts"] <= 3 + len(second)
        assert scheduler.counters["prefill_chunks"] >= len(second) - len(untouched)
    else:
        assert scheduler.counters["step_prompts"] == 0
        assert scheduler.counters["prefill_chunks"] >= sum(-(-(n - 1) // 8) for n, _ in plan if n > 1)


def test_short_prompts_arriving_together_share_prefill_forwards(model, engine):
    """Eight 5-token prompts submitted together, chunks of 16: their 4-token prefills run four to a
    forward (two forwards, not eight); while a turn decodes, prompts are prefilled one forward a
    step, packed (three 8-token chunks: two forwards over two steps). Every turn still gets its
    tokens alone."""
    vocab = model.config.vocab_size
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=8, prefill_chunk=16, turn_deadline=None))
    forwards: list[tuple[int, int]] = []  # (scheduler step, chunks) of each prefill forward
    packed = engine.prefill_packed

    def recording(chunks):
        forwards.append((scheduler.counters["steps"], len(chunks)))
        return packed(chunks)

    engine.prefill_packed = recording  # the real forward, counted
    try:
        works = [turn(engine, f"o{i % 3}", context(vocab, 5, seed=50 + i), 4) for i in range(8)]
        with scheduler._cv:  # one step sees them all: the loop waits on this lock
            for work in works:
                scheduler.submit(work)
        results = [drain(w) for w in works]
        assert [n for _, n in forwards] == [4, 4]
        forwards.clear()
        first = turn(engine, "p", context(vocab, 1, seed=70), 200)
        scheduler.submit(first)
        assert first.events.get(timeout=120)[0] == "token"  # it decodes from here on
        late = [turn(engine, f"q{i}", context(vocab, 9, seed=60 + i), 3) for i in range(3)]
        with scheduler._cv:
            for work in late:
                scheduler.submit(work)
        late_results = [drain(w) for w in late]
        first.cancel(delivered=1)
        scheduler.wake()
        drain(first)
    finally:
        scheduler.close()
    for work, (_, outcome) in zip([*works, *late], [*results, *late_results]):
        assert outcome.tokens == alone(model, work.ids, len(outcome.tokens)) and outcome.decoded
    assert sorted(n for _, n in forwards) == [1, 2] and forwards[0][0] != forwards[1][0]


def test_padded_batches_decode_in_size_classes_and_give_what_turns_get_alone(model, monkeypatch):
    """With ``pad_batches`` (the default where steps replay CUDA graphs) a step of n turns runs as a
    batch of the next power of two (at most max_batch), the extra slots writing a scratch row: every
    turn still gets exactly its tokens alone, and the steps come in size classes only — the classes
    a server's start runs once (``warm``), before any turn."""
    engine = Engine(model, tier="f32")
    vocab = model.config.vocab_size
    plan = [(5, 7), (17, 3), (40, 5), (1, 9), (23, 2), (9, 6)]
    scheduler = run_scheduler(
        engine, SchedulerLimits(max_batch=6, prefill_chunk=8, turn_deadline=None, pad_batches=True)
    )
    sizes: list[tuple[int, int]] = []
    step_function = scheduler._batches.step_function

    def recording(pool, b, tokens_in, positions_in, offsets_in):
        sizes.append((b, len(tokens_in)))
        return step_function(pool, b, tokens_in, positions_in, offsets_in)

    monkeypatch.setattr(scheduler._batches, "step_function", recording)
    prefills: list[tuple[int, int]] = []  # (start, tokens) of each prefill forward
    packed = engine.prefill_packed

    def prefill_recording(chunks):
        prefills.extend((start, len(ids)) for _, ids, start in chunks)
        return packed(chunks)

    monkeypatch.setattr(engine, "prefill_packed", prefill_recording)
    assert scheduler.warm() == [1, 2, 4, 6] and sizes == [(1, 1), (2, 2), (4, 4), (6, 6)]  # a start's warm-up
    # and a prefill of every power of two of tokens in the absorbed form (the routed experts' kernel classes)
    assert prefills == [(0, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32), (1, 64)]
    prefills.clear()
    assert scheduler.counters["steps"] == 0 and scheduler.counters["tokens"] == 0  # no turn's state
    sizes.clear()
    try:
        works = [turn(engine, f"o{i}", context(vocab, n, seed=i), m) for i, (n, m) in enumerate(plan)]
        for work in works:
            scheduler.submit(work)
        results = [drain(w) for w in works]
    finally:
        scheduler.close()
    for work, (n, m), (_, outcome) in zip(works, plan, results):
        assert outcome.tokens == alone(model, work.ids, m) and work.cache.length == n + m
    assert {b for b, _ in sizes} <= {1, 2, 4, 6} and all(b == k for b, k in sizes)
    assert any(b == 4 for b, _ in sizes) or any(b == 6 for b, _ in sizes)  # some step was padded up


def test_a_long_prompt_is_prefilled_between_decode_steps(model, engine):
    vocab = model.config.vocab_size
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=4, prefill_chunk=16, turn_deadline=None))
    try:
        decoding = turn(engine, "a", context(vocab, 4, 1), 40)
        scheduler.submit(decoding)
        assert decoding.events.get(timeout=120)[0] == "token"
        long_prompt = turn(engine, "b", context(vocab, 240, 2), 2)  # 15 chunks of 16
        scheduler.submit(long_prompt)
        drain(long_prompt)
        drain(decoding)
    finally:
        scheduler.close()
    assert long_prompt.ready_step - long_prompt.submitted_step >= 15  # one chunk per step
    assert long_prompt.ready_step < decoding.ended_step  # the prefill ran while the other turn decoded
    # the decoding turn had its decode step at every scheduler step of its life: never frozen
    assert decoding.slot_steps == decoding.ended_step - decoding.admitted_step + 1  # every step, both ends


def test_an_owner_with_nothing_decoding_gets_a_slot_at_the_next_step(model, engine):
    vocab = model.config.vocab_size
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=3, turn_deadline=None))
    try:
        flood = [turn(engine, "a", context(vocab, 3, 10 + i), 60) for i in range(5)]
        for work in flood:
            scheduler.submit(work)
        for work in flood[:3]:
            assert work.events.get(timeout=120)[0] == "token"  # three decode, two wait
        other = turn(engine, "b", context(vocab, 1, 20), 3)
        scheduler.submit(other)
        tokens, outcome = drain(other)
        # answered before the flooding owner's queued turns have run a single step
        assert all(w.phase != "done" for w in flood) and not flood[4].decoded
        results = [drain(w) for w in flood]
    finally:
        scheduler.close()
    assert other.waited_steps[0] <= 1 and outcome.tokens == alone(model, other.ids, 3)  # the next step
    assert scheduler.counters["preempted"] >= 1  # one of a's turns yielded its slot, then resumed
    for i, (work, (tokens, outcome)) in enumerate(zip(flood, results)):
        assert outcome.tokens == alone(model, work.ids, 60)  # paused and resumed: the same tokens
        assert tokens == outcome.tokens[1 if i < 3 else 0 :]  # (the first three's first token was read above)


def test_when_every_owner_holds_one_slot_a_waiting_owner_gets_one_within_the_batch_size(model, engine):
    vocab = model.config.vocab_size
    limits = SchedulerLimits(max_batch=2, turn_deadline=None)
    scheduler = run_scheduler(engine, limits)
    try:
        held = [turn(engine, owner, context(vocab, 2, i), 30) for i, owner in enumerate("ab")]
        for work in held:
            scheduler.submit(work)
        for work in held:
            assert work.events.get(timeout=120)[0] == "token"
        late = turn(engine, "c", context(vocab, 1, 9), 2)
        scheduler.submit(late)
        drain(late)
        for work in held:
            drain(work)
    finally:
        scheduler.close()
    assert late.waited_steps[0] <= limits.max_batch + 1  # counted from the step it arrived in
    assert all(w.ended_step > late.ended_step for w in held)  # never after a whole turn of someone else


def test_a_cancelled_turn_keeps_exactly_the_tokens_its_reader_took(model, engine):
    vocab = model.config.vocab_size
    scheduler = run_scheduler(engine, SchedulerLimits(turn_deadline=None))
    try:
        work = turn(engine, "a", context(vocab, 6, 3), 200)
        scheduler.submit(work)
        taken = [work.events.get(timeout=120)[1] for _ in range(3)]
        work.cancel(len(taken))
        scheduler.wake()
        _, outcome = drain(work)
    finally:
        scheduler.close()
    assert outcome.finish_reason == "cancelled" and outcome.tokens == taken
    assert work.cache.length == 6 + 3 and work.cache.tokens.tolist() == [*work.ids.tolist(), *taken]
    assert taken == alone(model, work.ids, 3)


def test_a_turn_cancelled_or_past_its_deadline_before_decoding_stores_nothing(model, engine):
    vocab = model.config.vocab_size
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=1, turn_deadline=None))
    try:
        first = turn(engine, "a", context(vocab, 3, 4), 50)
        scheduler.submit(first)
        assert first.events.get(timeout=120)[0] == "token"
        waiting = turn(engine, "a", context(vocab, 12, 5), 5)  # the one slot is a's: it waits
        waiting.cancel(0)
        scheduler.submit(waiting)
        late = turn(engine, "b", context(vocab, 12, 6), 5, deadline=time.monotonic() - 1)
        scheduler.submit(late)
        for work, reason in ((waiting, "cancelled"), (late, "deadline")):
            tokens, outcome = drain(work)
            assert (tokens, outcome.tokens, outcome.finish_reason, outcome.decoded) == ([], [], reason, False)
            assert work.cache.length == 0  # what prefill wrote is gone: the session is as it was
        first.cancel(1)
        drain(first)
    finally:
        scheduler.close()


def test_warm_is_nothing_without_padding_and_refused_once_turns_run(model, engine):
    assert run_scheduler(engine, SchedulerLimits(pad_batches=False)).warm() == []
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=2, pad_batches=True, turn_deadline=None))
    try:
        work = turn(engine, "o", context(model.config.vocab_size, 4, seed=1), 3000)  # still running below
        scheduler.submit(work)
        with pytest.raises(GenerationError):
            scheduler.warm()
        work.cancel(0)
        assert drain(work)[1].finish_reason == "cancelled"
    finally:
        scheduler.close()


def test_limits_refuse_a_turn_before_it_starts(engine):
    scheduler = run_scheduler(engine, SchedulerLimits(max_batch=1, max_queue=1, max_turns_per_owner=2))
    scheduler.reserve("a")
    scheduler.reserve("a")
    with pytest.raises(ServerBusy, match="max-turns-per-owner 2") as refused:
        scheduler.reserve("a")
    assert refused.value.retry_after >= 1
    with pytest.raises(ServerBusy, match="in flight"):
        scheduler.reserve("b")  # 1 decoding + 1 queued: the server is full
    scheduler.unreserve("a")
    scheduler.reserve("b")
    assert scheduler.counters["refused"] == 2
    with pytest.raises(GenerationError, match="cap of 4096"):
        scheduler.submit(turn(engine, "a", [5], 5000))


def test_a_turn_asking_no_tokens_stores_its_prompt_and_samples_nothing(model, engine):
    scheduler = run_scheduler(engine, SchedulerLimits(turn_deadline=None))
    try:
        work = turn(engine, "a", context(model.config.vocab_size, 9, 7), 0)
        scheduler.submit(work)
        tokens, outcome = drain(work)
    finally:
        scheduler.close()
    assert tokens == [] and outcome.tokens == [] and outcome.decoded and outcome.finish_reason == "length"
    assert work.cache.length == 9 and work.cache.tokens.tolist() == work.ids.tolist()


@pytest.mark.parametrize("reserved", [0, 4096])
def test_a_reserved_arena_holds_the_turns_without_growing(model, engine, reserved):
    """``arena_rows`` reserves the decode arena when the scheduler starts: turns whose rows fit never
    grow it (a growth moves every live row and, on a GPU, recaptures every size class's graph in
    the middle of everyone's turns); with nothing reserved the first turn grows it. Counted
    (``status()``, ``/metrics``), not timed."""
    vocab = model.config.vocab_size
    limits = SchedulerLimits(max_batch=3, prefill_chunk=64, turn_deadline=None, pad_batches=True, arena_rows=reserved)
    scheduler = run_scheduler(engine, limits)
    try:
        scheduler.warm()
        works = [turn(engine, f"o{i}", context(vocab, 300 + 200 * i, seed=i), 4) for i in range(3)]
        for work in works:
            scheduler.submit(work)
        results = [drain(w) for w in works]
        status = scheduler.status()
    finally:
        scheduler.close()
    for work, (_, outcome) in zip(works, results):
        assert outcome.tokens == alone(model, work.ids, 4)
    if reserved:
        assert status["arena_rows"] >= reserved and status["arena_growths"] == 0
    else:
        assert status["arena_growths"] >= 1 and status["arena_rows"] >= 300 + 200 * 2


def test_arena_rows_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(GenerationError, match="arena_rows"):
            SchedulerLimits(arena_rows=bad)
