"""Prompts in the step (``kvstore.engine.scheduler``): a short prompt joins the batch inside a decode
step, its tokens entries of the step at consecutive positions, instead of a prefill forward of its own.

On by default where steps replay CUDA graphs, off elsewhere; here it is switched on for the CPU
engine, whose f32 steps give what a turn gets alone, and left to its default on CUDA. Steps are
counted, never timed.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.engine import Engine, preset, random_model
from kvstore.engine import scheduler as scheduler_module
from kvstore.engine.errors import GenerationError
from kvstore.engine.generate import SamplingParams
from kvstore.engine.scheduler import Scheduler, SchedulerLimits, TurnWork
from scheduled import drain

GREEDY = SamplingParams(0.0, 1.0, 0, None)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=4)


def context(vocab: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, vocab, n)


def alone(model, ids, max_new: int, tier: str) -> list[int]:
    return Engine(model, tier=tier).generate(ids, max_new_tokens=max_new, stop_tokens=()).tokens


def turn(engine, owner: str, ids, max_new: int, cache=None) -> TurnWork:
    return TurnWork(owner, cache or engine.new_cache(), np.asarray(ids), GREEDY, max_new, frozenset())


class StepSizes:
    """Records the entries of every step the scheduler runs (wrapping its real step function)."""

    def __init__(self, scheduler: Scheduler):
        self.sizes: list[int] = []
        real = scheduler._batches.step_function

        def recorded(pool, b, *inputs):
            self.sizes.append(b)
            return real(pool, b, *inputs)

        scheduler._batches.step_function = recorded


@pytest.mark.parametrize("tier", ["f32", "fp8"])
def test_prompts_arriving_together_ride_the_first_step_and_get_what_they_get_alone(model, tier):
    """A slot free for each: every prompt runs in the first decode step, no prefill forward at all,
    and each session's cache ends holding its whole conversation, each row under its token."""
    engine = Engine(model, tier=tier)
    vocab = model.config.vocab_size
    plan = [(5, 7), (17, 3), (12, 5), (1, 9), (23, 2), (9, 6)]  # (prompt tokens, tokens to generate)
    scheduler = Scheduler(engine, SchedulerLimits(max_batch=6, turn_deadline=None, step_tokens=72))
    sizes = StepSizes(scheduler)
    try:
        works = [turn(engine, f"o{i % 2}", context(vocab, n, seed=i), m) for i, (n, m) in enumerate(plan)]
        with scheduler._cv:  # one step sees them all (the loop waits on this lock)
            for work in works:
                scheduler.submit(work)
        outcomes = [drain(w)[1] for w in works]
    finally:
        scheduler.close()
    assert sizes.sizes[0] == sum(n for n, _ in plan)
    for work, (n, m), outcome in zip(works, plan, outcomes):
        assert outcome.tokens == alone(model, work.ids, m, tier)
        assert outcome.decoded and outcome.prefilled_tokens == n
        assert work.cache.length == n + m
        assert work.cache.tokens[: work.cache.length].tolist() == [*work.ids.tolist(), *outcome.tokens]
    status = scheduler.status()
    assert status["prefill_forwards"] == 0 and status["step_prompts"] == sum(1 for n, _ in plan if n > 1)


def test_a_step_carries_no_more_tokens_than_its_capacity(model):
    engine = Engine(model, tier="f32")
    vocab = model.config.vocab_size
    scheduler = Scheduler(engine, SchedulerLimits(max_batch=4, turn_deadline=None, step_tokens=24))
    sizes = StepSizes(scheduler)
    try:
        works = [turn(engine, "o", context(vocab, 10, seed=i), 3) for i in range(4)]
        with scheduler._cv:  # 40 prompt tokens arrive together (the loop waits on this lock)
            for work in works:
                scheduler.submit(work)
        results = [drain(w) for w in works]
    finally:
        scheduler.close()
    assert scheduler.step_capacity == 24
    # two prompts ride the first step, the other two the next one beside their two tokens
    assert sizes.sizes[:2] == [20, 22] and max(sizes.sizes) <= 24
    for work, (_, outcome) in zip(works, results):
        assert outcome.tokens == alone(model, work.ids, 3, "f32")
    assert scheduler.status()["prefill_forwards"] == 0


def test_a_prompt_after_many_rows_keeps_its_prefill_forward(model, monkeypatch):
    """Each entry of a riding prompt reads its session's rows on its own: past STEP_PROMPT_ROW_READS
    the prompt is prefilled in a forward, which reads them once per chunk."""
    engine = Engine(model, tier="f32")
    vocab = model.config.vocab_size
    history = context(vocab, 40, seed=9)
    cache = engine.new_cache()
    engine.prefill_into(cache, history, 0)
    monkeypatch.setattr(scheduler_module, "STEP_PROMPT_ROW_READS", 8 * 48)
    scheduler = Scheduler(engine, SchedulerLimits(max_batch=2, turn_deadline=None, step_tokens=64))
    try:
        short = turn(engine, "a", context(vocab, 4, seed=1), 2)  # 4 x 4 rows: rides
        scheduler.submit(short)
        drain(short)
        assert scheduler.status()["step_prompts"] == 1 and scheduler.status()["prefill_forwards"] == 0
        long = turn(engine, "b", context(vocab, 9, seed=2), 2, cache=cache)  # 9 x 49 rows: a forward
        scheduler.submit(long)
        _, outcome = drain(long)
    finally:
        scheduler.close()
    assert scheduler.status()["step_prompts"] == 1 and scheduler.status()["prefill_forwards"] == 1
    assert outcome.tokens == alone(model, np.concatenate([history, long.ids]), 2, "f32")


def test_size_classes_go_on_doubling_up_to_the_step_capacity(model):
    engine = Engine(model, tier="f32")
    padded = Scheduler(engine, SchedulerLimits(max_batch=6, pad_batches=True, step_tokens=40))
    assert padded.size_classes() == [1, 2, 4, 6, 8, 16, 32, 40]
    assert Scheduler(engine, SchedulerLimits(max_batch=6, pad_batches=True)).size_classes() == [1, 2, 4, 6]
    # prompts stay out of steps unless asked
    assert Scheduler(engine, SchedulerLimits(max_batch=6)).step_capacity == 6
    with pytest.raises(GenerationError, match="step_tokens"):
        SchedulerLimits(step_tokens=-1)


def test_the_server_setting_reaches_the_scheduler_and_refuses_a_negative_count(tmp_path):
    from kvstore.api.settings import Settings
    from kvstore.errors import ConfigError

    assert Settings(data_dir=tmp_path).scheduler_limits("cuda").step_tokens is None  # the engine's default
    assert Settings(data_dir=tmp_path, step_tokens=512).scheduler_limits("cuda").step_tokens == 512
    assert Settings(data_dir=tmp_path, step_tokens=0).scheduler_limits("cuda").step_tokens == 0
    with pytest.raises(ConfigError, match="step_tokens"):
        Settings(data_dir=tmp_path, step_tokens=-1)


def test_by_default_prompts_take_prefill_forwards_where_steps_replay_no_graphs(model):
    """The default (``step_tokens=None``) on the CPU engine: a step runs ``max_batch`` tokens at
    most and a prompt takes its prefill forward; asked for, the same turns ride."""
    engine = Engine(model, tier="f32")
    assert not engine.cuda_graphs
    for limits, rode in (
        (SchedulerLimits(max_batch=4, turn_deadline=None), 0),
        (SchedulerLimits(max_batch=4, turn_deadline=None, step_tokens=64), 2),
    ):
        scheduler = Scheduler(engine, limits)
        works = [turn(engine, f"o{i}", context(model.config.vocab_size, 5 + i, seed=60 + i), 3) for i in range(2)]
        try:
            with scheduler._cv:
                for work in works:
                    scheduler.submit(work)
            for work in works:
                drain(work)
        finally:
            scheduler.close()
        assert scheduler.step_capacity == (4 if not rode else 64)
        assert scheduler.status()["step_prompts"] == rode
        assert (scheduler.status()["prefill_forwards"] == 0) == bool(rode)


def test_padded_steps_with_riding_prompts_give_what_turns_get_alone(model):
    engine = Engine(model, tier="f32")
    vocab = model.config.vocab_size
    scheduler = Scheduler(engine, SchedulerLimits(max_batch=4, pad_batches=True, turn_deadline=None, step_tokens=32))
    sizes = StepSizes(scheduler)
    try:
        works = [turn(engine, f"o{i}", context(vocab, 3 + 4 * i, seed=20 + i), 4) for i in range(4)]
        with scheduler._cv:  # one step sees them all
            for work in works:
                scheduler.submit(work)
        results = [drain(w) for w in works]
    finally:
        scheduler.close()
    assert set(sizes.sizes) <= set(scheduler.size_classes())
    assert sizes.sizes[0] == 32  # 3 + 7 + 11 + 15 prompt tokens, padded to the class
    for work, (_, outcome) in zip(works, results):
        assert outcome.tokens == alone(model, work.ids, 4, "f32")


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["f32", "fp8"])
def test_on_cuda_prompts_ride_graph_replays_and_decode_what_forwards_do(tier):
    """By default (``STEP_TOKENS`` a step where steps replay graphs), prompts ride the steps' CUDA
    graph replays: eight turns arriving together run no prefill forward, and decode what the same
    turns decode when their prompts are prefilled by forwards (``step_tokens=0``); random weights:
    a near-tie may flip one."""
    import torch

    cfg = preset("tiny-512")
    engine = Engine(random_model(cfg, seed=5).to(torch.device("cuda")), tier=tier)
    plan = [(n, 12) for n in (3, 40, 17, 1, 64, 9, 120, 30)]
    outcomes = {}
    assert engine.cuda_graphs
    for step_tokens in (None, 0):
        scheduler = Scheduler(engine, SchedulerLimits(max_batch=8, turn_deadline=None, step_tokens=step_tokens))
        scheduler.warm()
        works = [turn(engine, f"o{i}", context(cfg.vocab_size, n, seed=40 + i), m) for i, (n, m) in enumerate(plan)]
        try:
            with scheduler._cv:
                for work in works:
                    scheduler.submit(work)
            outcomes[step_tokens] = [drain(w)[1].tokens for w in works]
        finally:
            scheduler.close()
        status = scheduler.status()
        if step_tokens is None:
            assert scheduler.step_capacity == scheduler_module.STEP_TOKENS == 512
            assert status["prefill_forwards"] == 0 and status["step_prompts"] == 7
        else:
            assert status["step_prompts"] == 0 and status["prefill_forwards"] >= 1
    same = sum(a == b for a, b in zip(outcomes[None], outcomes[0]))
    assert same >= len(plan) - 1, (outcomes[None], outcomes[0])
