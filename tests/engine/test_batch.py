"""Several sessions decoding together (``Engine.generate_batch``).

A batched step runs one token of every sequence in one forward over one packed cache: each
sequence must get exactly what it gets decoding alone — its tokens, and afterwards its cache rows —
whatever the other sequences' lengths, and however early some of them stop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import BatchSequence, Engine, GenerationError, preset, random_model

LENGTHS = (5, 17, 40, 1)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=4)


def contexts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def alone(model, tier, context, **kw):
    engine = Engine(model, tier=tier)
    result = engine.generate(context, **kw)
    return result.tokens, engine.cache


def resumed(engine, model, tier, context, keep: int) -> BatchSequence:
    """A session whose first ``keep`` tokens are in a cache restored from a journal's rows."""
    writer = Engine(model, tier=tier)
    if keep:
        writer.prefill(context[:keep])
    cache = engine.new_cache()
    cache.restore(writer.export_rows())
    return BatchSequence(cache, context[keep:])


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4", "q8"])
def test_each_sequence_gets_what_it_gets_alone(model, tier):
    engine = Engine(model, tier=tier)
    ctxs = contexts(model.config.vocab_size)
    keeps = [n - min(n, 3) for n in LENGTHS]  # 0..3 new tokens per session after its restored rows
    batch = [resumed(engine, model, tier, c, k) for c, k in zip(ctxs, keeps)]
    got = engine.generate_batch(batch, max_new_tokens=7, stop_tokens=())
    assert got.steps == 7 and got.finish_reasons == ["length"] * len(ctxs)
    for context, seq, tokens in zip(ctxs, batch, got.tokens):
        want, cache = alone(model, tier, context, max_new_tokens=7, stop_tokens=())
        assert tokens == want
        # the cache holds the context and every generated token but the last, as generate leaves it
        assert np.array_equal(seq.cache.tokens, cache.tokens)
        for ours, theirs in zip(seq.cache.export_f32()[1:], cache.export_f32()[1:]):
            # A batched matmul sums in another order than a single token's: a row may differ in its
            # last bits, and a quantized tier may then round one element to the neighbouring code.
            off, scale = np.abs(ours - theirs), np.abs(theirs).max()
            assert np.mean(off > 1e-3 * scale) < 0.01 and off.max() <= 0.05 * scale


def test_a_sequence_that_stops_early_keeps_its_result_while_the_others_go_on(model):
    engine = Engine(model, tier="fp8")
    ctxs = contexts(model.config.vocab_size, (9, 30), seed=3)
    free = [alone(model, "fp8", c, max_new_tokens=8, stop_tokens=())[0] for c in ctxs]
    stop = free[0][2]  # the first sequence's third token ends it
    assert stop not in free[1]
    batch = [BatchSequence(engine.new_cache(), c) for c in ctxs]
    got = engine.generate_batch(batch, max_new_tokens=8, stop_tokens=[stop])
    assert got.tokens[0] == free[0][: free[0].index(stop) + 1] and got.finish_reasons[0] == "stop"
    assert got.tokens[1] == free[1] and got.finish_reasons[1] == "length"
    assert batch[0].cache.length == len(ctxs[0]) + len(got.tokens[0]) - 1
    # the session continues from its cache as if it had decoded alone
    continued = Engine(model, cache=batch[0].cache).generate(ctxs[0] + got.tokens[0], max_new_tokens=3)
    assert (continued.reused_tokens, continued.prefilled_tokens) == (len(ctxs[0]) + len(got.tokens[0]) - 1, 1)


def test_sampling_with_a_seed_is_reproducible(model):
    engine = Engine(model, tier="int4")
    ctxs = contexts(model.config.vocab_size, (6, 12))
    runs = []
    for _ in range(2):
        batch = [BatchSequence(engine.new_cache(), c) for c in ctxs]
        runs.append(engine.generate_batch(batch, max_new_tokens=5, temperature=0.9, seed=11, stop_tokens=()).tokens)
    assert runs[0] == runs[1] and all(len(t) == 5 for t in runs[0])


def test_a_batch_refuses_what_it_cannot_run(model):
    engine = Engine(model, tier="fp8")
    with pytest.raises(GenerationError, match="at least one sequence"):
        engine.generate_batch([])
    with pytest.raises(GenerationError, match="at least one token"):
        engine.generate_batch([BatchSequence(engine.new_cache(), [])])
    other = Engine(model, tier="int4").new_cache()
    with pytest.raises(GenerationError, match="one cache tier"):
        engine.generate_batch([BatchSequence(engine.new_cache(), [3]), BatchSequence(other, [4])])
    with pytest.raises(GenerationError, match=r"token ids must be in \[0, "):
        engine.generate_batch([BatchSequence(engine.new_cache(), [model.config.vocab_size])])


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_cuda_batches_replay_one_graph_and_agree_with_the_plain_step(tier):
    """16 sessions of different lengths on CUDA: the graph replays give the plain batched steps'
    tokens, twice in a row with one capture (the pool and its graph are kept between batches)."""
    cfg = preset("tiny-512")
    gpu_model = random_model(cfg, seed=5).to("cuda")
    lengths = [int(n) for n in np.random.default_rng(7).integers(1, 1500, 16)]
    ctxs = contexts(cfg.vocab_size, lengths, seed=8)
    graphs, plain = Engine(gpu_model, tier=tier), Engine(gpu_model, tier=tier, cuda_graphs=False)
    for _ in range(2):
        a = graphs.generate_batch(
            [BatchSequence(graphs.new_cache(), c) for c in ctxs], max_new_tokens=12, stop_tokens=()
        )
        b = plain.generate_batch([BatchSequence(plain.new_cache(), c) for c in ctxs], max_new_tokens=12, stop_tokens=())
        same = sum(x == y for x, y in zip(a.tokens, b.tokens))
        assert same >= 15, (a.tokens, b.tokens)  # random weights: a near-tie may flip one argmax
    assert graphs._batches.captures == 1 and plain._batches.captures == 0
    assert torch.cuda.is_available()
