"""A restore that fails leaves nothing half-built; a damaged tail is a miss, never served."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstore.engine import hf
from kvstore.errors import IntegrityError, InvalidRequest
from kvstore.formats import coli_kv

OWNER = "alice"


@pytest.fixture
def two_turns(tiny_model, store):
    """A session of two complete turns, and the rows it holds."""
    model = tiny_model
    cache = hf.new_cache(model)
    out = model.generate(torch.arange(2, 42)[None], max_new_tokens=4, do_sample=False, **hf.cache_kwargs(model, cache))
    first = hf.save(store, "chat", model, cache, out[0], owner=OWNER).n_records
    out = model.generate(
        torch.cat([out, torch.arange(50, 56)[None]], 1),
        max_new_tokens=4,
        do_sample=False,
        **hf.cache_kwargs(model, cache),
    )
    hf.save(store, "chat", model, cache, out[0], owner=OWNER)
    return first, hf.cache_rows(model, cache)


def _state(store, path):
    info = store.get("chat", owner=OWNER)
    return info.n_records, info.watermark, path.read_bytes()


def test_a_truncated_journal_fails_the_restore_and_changes_nothing(tiny_model, store, two_turns):
    before = hf.restore(store, "chat", tiny_model, owner=OWNER)  # the caller's live cache
    kept_L, kept_R = hf.cache_rows(tiny_model, before.cache)
    path = store.journal_path("chat")
    info = store.get("chat", owner=OWNER)
    # the file loses its last records behind the store's back (a disk or a tool outside kvstore)
    os.truncate(path, coli_kv.HEADER_BYTES + (info.n_records - 3) * info.record_bytes)
    state = _state(store, path)
    with pytest.raises(IntegrityError, match="ended inside record"):
        hf.restore(store, "chat", tiny_model, owner=OWNER)
    with pytest.raises(IntegrityError):
        hf.restore_batch(store, ["chat", "chat"], tiny_model, owner=OWNER)
    assert _state(store, path) == state  # neither the index nor the journal was touched
    L, R = hf.cache_rows(tiny_model, before.cache)
    np.testing.assert_array_equal(L, kept_L)
    np.testing.assert_array_equal(R, kept_R)
    # no reader was left holding the session: an exclusive operation goes through at once
    store.truncate("chat", 10, owner=OWNER)
    assert hf.restore(store, "chat", tiny_model, owner=OWNER).reused_tokens == 10


def test_a_checksum_mismatch_serves_only_the_turns_before_it(tiny_model, store, two_turns):
    first_turn, (L_live, R_live) = two_turns
    path = store.journal_path("chat")
    info = store.get("chat", owner=OWNER)
    # one flipped bit in the second turn's first L row: still a valid f32, so only the hash sees it
    offset = coli_kv.HEADER_BYTES + (first_turn + 1) * info.record_bytes + 4 + 8
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    unchecked = hf.restore(store, "chat", tiny_model, owner=OWNER)
    assert unchecked.reused_tokens == info.n_records and not unchecked.verified
    assert not np.array_equal(hf.cache_rows(tiny_model, unchecked.cache)[0], L_live)  # the flip is in the rows
    restored = hf.restore(store, "chat", tiny_model, owner=OWNER, verify=True)
    assert (restored.reused_tokens, restored.damaged_from, restored.verified) == (first_turn, first_turn, True)
    L, R = hf.cache_rows(tiny_model, restored.cache)
    np.testing.assert_array_equal(L, L_live[:, :first_turn])
    np.testing.assert_array_equal(R, R_live[:, :first_turn])


def test_a_bad_upto_is_refused_before_anything_is_read(tiny_model, store, two_turns):
    with pytest.raises(InvalidRequest, match="upto must be a non-negative"):
        hf.restore(store, "chat", tiny_model, owner=OWNER, upto=-1)
    assert hf.restore(store, "chat", tiny_model, owner=OWNER, upto=5).reused_tokens == 5
