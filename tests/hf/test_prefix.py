"""Partial restore: resume a new prompt from the longest stored prefix (the store's lookup)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvstore.engine import hf

OWNER = "alice"
NEW = 16


@pytest.fixture
def stored(tiny_model, store):
    """A 104-token conversation saved in v1, with a copy of its live cache."""
    cache = hf.new_cache(tiny_model)
    prompt = torch.randint(2, 512, (1, 100), generator=torch.Generator().manual_seed(8))
    out = tiny_model.generate(prompt, max_new_tokens=4, do_sample=False, **hf.cache_kwargs(tiny_model, cache))
    hf.save(store, "long", tiny_model, cache, out[0], owner=OWNER)
    return out[0], cache


def test_a_prompt_sharing_a_prefix_reuses_exactly_those_rows(tiny_model, store, stored):
    tokens, live = stored
    prompt = torch.cat([tokens[:80], torch.arange(300, 310)])
    restored = hf.restore_prefix(store, tiny_model, prompt, owner=OWNER)
    assert (restored.session_id, restored.reused_tokens, restored.prefilled_tokens(prompt.numel())) == ("long", 80, 10)
    np.testing.assert_array_equal(restored.tokens, tokens[:80].numpy())
    L, R = hf.cache_rows(tiny_model, restored.cache)
    L_live, R_live = hf.cache_rows(tiny_model, live, 0, 80)
    np.testing.assert_array_equal(L, L_live)
    np.testing.assert_array_equal(R, R_live)
    # continuing from the restored prefix is continuing from the live cache cut at 80
    cut = copy.deepcopy(live)
    cut.crop(-(hf.cache_length(live) - 80))
    ids = prompt[None]
    expected = tiny_model.generate(ids, max_new_tokens=NEW, do_sample=False, **hf.cache_kwargs(tiny_model, cut))
    got = tiny_model.generate(ids, max_new_tokens=NEW, do_sample=False, **hf.cache_kwargs(tiny_model, restored.cache))
    assert got.tolist() == expected.tolist()


def test_the_whole_stored_conversation_as_prompt_leaves_its_last_token_to_run(tiny_model, store, stored):
    tokens, _ = stored
    restored = hf.restore_prefix(store, tiny_model, tokens, owner=OWNER)
    assert restored.reused_tokens == tokens.numel() - 1


def test_no_shared_block_or_another_owner_restores_nothing(tiny_model, store, stored):
    tokens, _ = stored
    short = hf.restore_prefix(store, tiny_model, torch.cat([tokens[:40], torch.arange(300, 340)]), owner=OWNER)
    assert (short.reused_tokens, short.session_id, hf.cache_length(short.cache)) == (0, None, 0)
    assert hf.restore_prefix(store, tiny_model, tokens, owner="bob").reused_tokens == 0
    # a session in another tier is not this fingerprint's prefix
    assert hf.restore_prefix(store, tiny_model, tokens, owner=OWNER, tier="fp8").reused_tokens == 0
