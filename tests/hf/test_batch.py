"""Several sessions restored into one left-padded batched cache, continued, and saved back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import hf
from kvstore.errors import InvalidRequest, SessionNotFound

OWNER = "alice"
PROMPTS = (30, 45, 52)
TURNS = ([11, 12, 13], [21, 22, 23, 24, 25], [31])
NEW = 12


@pytest.fixture
def sessions(tiny_model, store):
    """Three sessions of different lengths, and their greedy continuations run one by one."""
    model = tiny_model
    generator = torch.Generator().manual_seed(21)
    ids, single = [], []
    for b, length in enumerate(PROMPTS):
        cache = hf.new_cache(model)
        out = model.generate(
            torch.randint(2, 512, (1, length), generator=generator),
            max_new_tokens=4,
            do_sample=False,
            **hf.cache_kwargs(model, cache),
        )
        hf.save(store, f"s{b}", model, cache, out[0], owner=OWNER)
        ids.append(f"s{b}")
    for b, sid in enumerate(ids):
        restored = hf.restore(store, sid, model, owner=OWNER)
        context = restored.input_ids(TURNS[b])
        out = model.generate(context, max_new_tokens=NEW, do_sample=False, **hf.cache_kwargs(model, restored.cache))
        single.append((restored, out[0, context.shape[1] :].tolist()))
    return ids, single


def test_batch_restore_equals_the_individual_restores(tiny_model, store, sessions):
    ids, single = sessions
    batch = hf.restore_batch(store, ids, tiny_model, owner=OWNER)
    lengths = [p + 4 for p in PROMPTS]
    width = max(lengths)
    assert batch.reused_tokens == lengths and hf.cache_length(batch.cache) == width
    assert batch.attention_mask.tolist() == [[0] * (width - n) + [1] * n for n in lengths]
    for b, (restored, _) in enumerate(single):
        np.testing.assert_array_equal(batch.tokens[b], restored.tokens)
        L, R = hf.cache_rows(tiny_model, batch.cache, batch_index=b)
        L1, R1 = hf.cache_rows(tiny_model, restored.cache, 0, restored.reused_tokens)  # it has been continued since
        pad = width - lengths[b]
        np.testing.assert_array_equal(L[:, pad:], L1)
        np.testing.assert_array_equal(R[:, pad:], R1)
        assert not L[:, :pad].any() and not R[:, :pad].any()


def test_a_batched_continuation_equals_the_individual_ones_and_saves_back(tiny_model, store, sessions):
    model = tiny_model
    ids, single = sessions
    batch = hf.restore_batch(store, ids, model, owner=OWNER)
    inputs = batch.inputs(TURNS)
    positions = inputs["position_ids"]
    for b, restored in enumerate(single):
        # each sequence continues at its own stored length
        assert positions[b, -1].item() == restored[0].reused_tokens + len(TURNS[b]) - 1
    out = model.generate(
        inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        max_new_tokens=NEW,
        do_sample=False,
        **hf.cache_kwargs(model, batch.cache),
    )
    for b, (_, tokens) in enumerate(single):
        assert out[b, inputs["input_ids"].shape[1] :].tolist() == tokens
    saved = hf.save_batch(store, ids, model, batch.cache, out, inputs["attention_mask"], owner=OWNER)
    for b, (restored, tokens) in enumerate(single):
        expected = np.concatenate([restored.tokens, TURNS[b], tokens])
        assert saved[b].n_records == expected.size and saved[b].appended == len(TURNS[b]) + NEW
        again = hf.restore(store, ids[b], model, owner=OWNER)
        np.testing.assert_array_equal(again.tokens, expected)  # no padding was stored
        L, _ = hf.cache_rows(model, again.cache)
        slots = inputs["attention_mask"][b].bool()
        full_mask = torch.cat([slots, torch.ones(NEW, dtype=torch.bool)])
        L_batch, _ = hf.cache_rows(model, batch.cache, batch_index=b, slots=full_mask)
        np.testing.assert_array_equal(L, L_batch)


def test_batch_restore_is_all_or_nothing(tiny_model, store, sessions):
    ids, _ = sessions
    with pytest.raises(SessionNotFound):
        hf.restore_batch(store, [ids[0], "missing", ids[1]], tiny_model, owner=OWNER)
    with pytest.raises(SessionNotFound):  # another owner's session is missing too
        hf.restore_batch(store, ids, tiny_model, owner="mallory")
    batch = hf.restore_batch(store, ids, tiny_model, owner=OWNER, upto=[10, None, 0])
    assert batch.reused_tokens == [10, PROMPTS[1] + 4, 0]
    with pytest.raises(InvalidRequest, match="at least one new token"):
        batch.inputs([[1], [2], []])
