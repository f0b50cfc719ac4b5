"""Issue 21: continuing a restored conversation never runs it twice.

transformers' ``generate`` runs ``input_ids[:, cache_length:]``; given an input the cache already
covers, it runs the whole input again on top of the cache, silently. ``restored.input_ids()`` with
no new turn hands the last stored token back instead (the cache gives up its row), and an input the
cache covers is refused by ``hf.prefill_length`` before ``generate``. The same continuation in a
new process: ``tests/hf/test_resume.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvstore.engine import hf
from kvstore.engine.errors import ConversationMismatch
from kvstore.errors import InvalidRequest

OWNER = "alice"
PROMPT, FIRST, NEW = 24, 6, 12
TURN = [301, 302, 303]


def _generate(model, ids, cache, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **hf.cache_kwargs(model, cache))


@pytest.fixture
def saved(tiny_model, store):
    """(prompt [1, P], the saved conversation int64[n], a copy of the live cache after save: n rows)."""
    prompt = torch.randint(2, 512, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    cache = hf.new_cache(tiny_model)
    out = _generate(tiny_model, prompt, cache, FIRST)
    hf.save(store, "chat", tiny_model, cache, out[0], owner=OWNER)
    return prompt, out[0], copy.deepcopy(cache)


def test_no_new_turn_hands_the_last_token_back_and_continues_exactly(tiny_model, store, saved):
    prompt, tokens, _ = saved
    n = tokens.numel()
    restored = hf.restore(store, "chat", tiny_model, owner=OWNER)
    assert restored.reused_tokens == hf.cache_length(restored.cache) == n
    ids = restored.input_ids()
    assert ids.tolist() == [tokens.tolist()]  # the conversation once, its last token to run
    assert hf.cache_length(restored.cache) == restored.reused_tokens == n - 1
    assert hf.prefill_length(restored.cache, ids) == restored.prefilled_tokens(ids.shape[1]) == 1
    assert restored.input_ids().tolist() == ids.tolist() and hf.cache_length(restored.cache) == n - 1  # once only
    L, R, _ = store.resume("chat", owner=OWNER).arrays()
    kept_L, kept_R = hf.cache_rows(tiny_model, restored.cache)
    np.testing.assert_array_equal(kept_L, L[:, : n - 1])  # the rows kept are the stored ones
    np.testing.assert_array_equal(kept_R, R[:, : n - 1])
    out = _generate(tiny_model, ids, restored.cache, NEW)
    uninterrupted = _generate(tiny_model, prompt, hf.new_cache(tiny_model), FIRST + NEW)
    assert out[0, n:].tolist() == uninterrupted[0, n:].tolist()


def test_a_new_turn_after_a_whole_restore_runs_only_the_turn(tiny_model, store, saved):
    _, tokens, live = saved
    n = tokens.numel()
    restored = hf.restore(store, "chat", tiny_model, owner=OWNER)
    ids = restored.input_ids(TURN)
    assert ids.tolist() == [tokens.tolist() + TURN]
    assert hf.cache_length(restored.cache) == restored.reused_tokens == n  # nothing handed back
    assert hf.prefill_length(restored.cache, ids) == restored.prefilled_tokens(ids.shape[1]) == len(TURN)
    out = _generate(tiny_model, ids, restored.cache, NEW)
    expected = _generate(tiny_model, ids, live, NEW)  # the live cache, never stored
    assert out.tolist() == expected.tolist()


def test_an_input_the_cache_already_covers_is_refused_before_generate(tiny_model, store, saved):
    _, tokens, _ = saved
    n = tokens.numel()
    restored = hf.restore(store, "chat", tiny_model, owner=OWNER)
    whole = torch.from_numpy(restored.tokens.astype(np.int64))[None]  # issue 21's input: the conversation again
    with pytest.raises(InvalidRequest, match=f"already holds a row for each of the {n} input tokens"):
        hf.prefill_length(restored.cache, whole)
    with pytest.raises(ConversationMismatch, match="not this input's cache"):
        hf.prefill_length(restored.cache, whole[:, :5])
    assert hf.cache_length(restored.cache) == n  # checking changes nothing
    assert hf.prefill_length(restored.cache, restored.input_ids([9])) == 1


def test_a_cache_continued_since_or_an_empty_conversation_is_refused(tiny_model, store, saved):
    restored = hf.restore(store, "chat", tiny_model, owner=OWNER)
    _generate(tiny_model, restored.input_ids(TURN), restored.cache, 2)  # the cache moves past restored.tokens
    with pytest.raises(ConversationMismatch, match="continued since"):
        restored.input_ids()
    with pytest.raises(ConversationMismatch, match="continued since"):
        restored.input_ids([7])
    empty = hf.restore(store, "chat", tiny_model, owner=OWNER, upto=0)
    with pytest.raises(InvalidRequest, match="nothing to continue"):
        empty.input_ids()
    assert empty.input_ids([5, 6]).tolist() == [[5, 6]]


def test_next_input_ids_for_a_cache_kept_by_hand(tiny_model):
    """What a chat loop that keeps its own cache and history calls (``kvstore hf-chat``)."""
    cache = hf.new_cache(tiny_model)
    out = _generate(tiny_model, torch.arange(2, 20)[None], cache, 3)
    rows = hf.cache_length(cache)
    assert rows == out.shape[1] - 1  # generate's last token has no row yet
    ids = hf.next_input_ids(cache, out[0])  # so nothing is handed back
    assert ids.tolist() == out.tolist() and hf.cache_length(cache) == rows
    tail = hf.next_input_ids(cache, out[0], [40, 41])
    assert tail.tolist() == [out[0].tolist() + [40, 41]] and hf.prefill_length(cache, tail) == 3
    with pytest.raises(InvalidRequest, match="1-D"):
        hf.next_input_ids(cache, out[0], [[1, 2], [3, 4]])
