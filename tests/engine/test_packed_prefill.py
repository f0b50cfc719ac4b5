"""A packed prefill (``Engine.prefill_many`` / ``prefill_packed``): the chunks of several sessions in
one forward give each session the rows it gets prefilled alone.

f32 rows agree to rounding (the projections run over more rows at once), so a quantized tier's
codes are the same but for values rounded across a code boundary; greedy continuations are
token-identical. Forwards are counted,
never timed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import Engine, preset, random_model
from kvstore.engine.errors import GenerationError
from kvstore.engine.generate import pack_chunks
from kvstore.engine.model import SHARED_ATTENTION_TOKENS, Segment


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=4)


def test_pack_chunks_first_fit_keeps_order_and_puts_an_oversized_chunk_alone():
    assert pack_chunks([], 16) == []
    assert pack_chunks([4, 4, 4, 4], 16) == [[0, 1, 2, 3]]
    # 16 fills the first forward; the short ones behind it share the second
    assert pack_chunks([16, 5, 1, 3], 16) == [[0], [1, 2, 3]]
    # a chunk that fits an earlier forward goes there (first fit), not after a long one
    assert pack_chunks([10, 12, 6, 4], 16) == [[0, 2], [1, 3]]
    assert pack_chunks([40, 2], 16) == [[0], [1]]  # larger than the budget: alone
    for sizes in ([3, 9, 14, 1, 8, 8, 2], [16] * 5, [1] * 40):
        groups = pack_chunks(sizes, 16)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in g) <= 16 or len(g) == 1 for g in groups)
        assert all(g == sorted(g) for g in groups)


def _sessions(engine: Engine, vocab: int):
    """Four sessions: new with a prompt of three chunks, cached rows + a short (absorbed) chunk,
    cached rows + one token, new with a short prompt."""
    rng = np.random.default_rng(7)
    cached = (0, 20, 10, 0)
    adds = [rng.integers(2, vocab, n) for n in (37, 5, 1, 3)]
    caches = []
    for n in cached:
        cache = engine.new_cache()
        if n:
            engine.prefill_into(cache, np.arange(2, 2 + n), 0)
        caches.append(cache)
    return caches, adds


@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "int4", "q8"])
def test_prefill_many_gives_each_session_its_rows_alone_in_fewer_forwards(model, tier):
    engine = Engine(model, tier=tier, prefill_chunk=16)
    vocab = model.config.vocab_size
    alone, adds = _sessions(engine, vocab)
    for cache, ids in zip(alone, adds):
        engine.prefill_into(cache, ids, cache.length)
    packed, _ = _sessions(engine, vocab)
    forwards = engine.prefill_many(list(zip(packed, adds)))
    chunks = sum(-(-ids.shape[0] // 16) for ids in adds)
    assert forwards == 4 < chunks == 6  # round 0: [16], [5, 1, 3]; then one chunk each
    g = engine.config.coli_geometry()
    for a, b in zip(alone, packed):
        ra, rb = a.export_rows(), b.export_rows()
        assert ra.tokens.tolist() == rb.tokens.tolist() and b.length == a.length
        for x, y in zip(ra.dequantize(g.kv_lora, g.qk_rope), rb.dequantize(g.kv_lora, g.qk_rope)):
            if tier == "f32":
                np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
            else:
                # rounding moves a value across a code boundary now and then, and a moved value
                # in a layer's rows moves the next layer's a little (prefill reads the rows back
                # through the tier); rows at wrong positions or of the wrong session differ everywhere
                moved = ~np.isclose(y, x, rtol=1e-4, atol=1e-5)
                assert moved.mean() < 0.1, f"{moved.sum()} of {moved.size} values differ"
    # and each session continues as it would have alone
    for a, b in zip(alone, packed):
        continued = []
        for cache in (a, b):
            twin = Engine(model, tier=tier)
            twin.cache.restore(cache.export_rows())
            continued.append(twin.generate(twin.cache.tokens.tolist(), max_new_tokens=6, stop_tokens=()).tokens)
        assert continued[0] == continued[1]


def test_a_packed_forward_takes_one_chunk_per_cache_and_counts_its_tokens(model):
    engine = Engine(model, tier="f32")
    cache = engine.new_cache()
    cache.prepare(0, 8)
    ids = torch.full((6,), 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="one chunk per cache"):
        engine.model.forward_packed(ids, [Segment(cache, 0, 3, False), Segment(cache, 3, 3, False)])
    other = engine.new_cache()
    other.prepare(0, 8)
    with pytest.raises(ValueError, match="hold 5 tokens"):
        engine.model.forward_packed(ids, [Segment(cache, 0, 3, False), Segment(other, 0, 2, False)])
    assert cache.length == 0 and other.length == 0  # nothing committed


def test_a_failed_packed_forward_commits_nothing(model):
    engine = Engine(model, tier="f32")
    kept = engine.new_cache()
    engine.prefill_into(kept, np.arange(2, 12), 0)
    before = kept.export_rows()
    fresh = engine.new_cache()
    bad = np.array([2, 3, model.config.vocab_size + 5])  # past the embedding table
    with pytest.raises(GenerationError, match="token ids"):
        engine.prefill_packed([(kept, np.array([4, 5]), kept.length), (fresh, bad, 0)])
    assert fresh.length == 0
    # the committed rows of the other session stay as they were
    after = kept.export_rows()
    assert after.tokens.tolist() == before.tokens.tolist()
    np.testing.assert_array_equal(after.lc, before.lc)


@pytest.mark.parametrize("tier", ["f32", "fp8", "int4"])
def test_new_prompts_share_one_masked_attention_and_each_sees_only_its_own_tokens(model, tier):
    """New prompts of up to SHARED_ATTENTION_TOKENS share one attention call per layer (masked to
    each prompt's own tokens); a one-token prompt (absorbed form), a longer one and a resumed one
    in the same forward keep calls of their own. Each gets its rows alone; two sessions given the
    same prompt get the same rows (nothing leaks between prompts)."""
    engine = Engine(model, tier=tier, prefill_chunk=1024)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(11)
    lengths = [9, 1, 40, SHARED_ATTENTION_TOKENS + 2, 17, 33]
    prompts = [rng.integers(2, vocab, n) for n in lengths]
    prompts.append(prompts[0].copy())  # the same prompt twice
    history = np.arange(2, 30)

    def sessions():
        caches = [engine.new_cache() for _ in range(len(prompts) + 1)]
        engine.prefill_into(caches[-1], history, 0)  # a resumed session: a chunk after cached rows
        return caches

    extra = rng.integers(2, vocab, 70)
    alone, packed = sessions(), sessions()
    for cache, ids in zip(alone, [*prompts, extra]):
        engine.prefill_into(cache, ids, cache.length)
    assert engine.prefill_many(list(zip(packed, [*prompts, extra]))) == 1
    g = engine.config.coli_geometry()
    for a, b in zip(alone, packed):
        for x, y in zip(
            a.export_rows().dequantize(g.kv_lora, g.qk_rope), b.export_rows().dequantize(g.kv_lora, g.qk_rope)
        ):
            if tier == "f32":
                np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
            else:
                assert (~np.isclose(y, x, rtol=1e-4, atol=1e-5)).mean() < 0.1
    twins = [packed[0].export_rows(), packed[len(prompts) - 1].export_rows()]
    assert np.array_equal(twins[0].lc, twins[1].lc) and np.array_equal(twins[0].rc, twins[1].rc)
