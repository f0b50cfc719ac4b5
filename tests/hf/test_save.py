"""save(): only new rows are appended, the stored rows are the cache's own, misuse is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import tiers
from kvstore.engine import hf
from kvstore.engine.errors import ConversationMismatch
from kvstore.errors import FingerprintMismatch, GeometryMismatch, InvalidRequest, SessionExists
from kvstore.formats import coli_kv

OWNER = "alice"


def _generate(model, ids, cache, n=6):
    return model.generate(
        torch.as_tensor(ids)[None] if torch.as_tensor(ids).ndim == 1 else ids,
        max_new_tokens=n,
        do_sample=False,
        **hf.cache_kwargs(model, cache),
    )


def test_save_after_every_turn_appends_only_the_new_rows(tiny_model, store):
    model = tiny_model
    generator = torch.Generator().manual_seed(3)
    cache = hf.new_cache(model)
    out = _generate(model, torch.randint(2, 512, (1, 20), generator=generator), cache)
    first = hf.save(store, "chat", model, cache, out[0], owner=OWNER)
    assert (first.appended, first.computed, first.n_records) == (26, 1, 26)
    again = hf.save(store, "chat", model, cache, out[0], owner=OWNER)
    assert (again.appended, again.computed, again.n_records) == (0, 0, 26)
    turn = torch.randint(2, 512, (1, 5), generator=generator)
    out2 = _generate(model, torch.cat([out, turn], 1), cache)
    second = hf.save(store, "chat", model, cache, out2[0], owner=OWNER)
    assert (second.appended, second.n_records) == (11, 37)
    # the journal holds exactly the live cache's rows and the conversation's tokens
    resumed = store.resume("chat", owner=OWNER)
    L, R, _ = resumed.arrays()
    live_L, live_R = hf.cache_rows(model, cache)
    np.testing.assert_array_equal(L, live_L)
    np.testing.assert_array_equal(R, live_R)
    np.testing.assert_array_equal(resumed.tokens, out2[0].numpy())
    assert store.verify("chat", owner=OWNER).ok


def test_save_without_extend_stores_the_cached_rows_only(tiny_model, store):
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    saved = hf.save(store, "rows-only", model, cache, out[0], owner=OWNER, extend=False)
    assert (saved.n_records, saved.computed) == (out.shape[1] - 1, 0)
    assert hf.cache_length(cache) == out.shape[1] - 1  # the caller's cache was not run further


def test_an_incomplete_turn_is_not_served_until_completed(tiny_model, store):
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    hf.save(store, "w", model, cache, out[0], owner=OWNER)
    out2 = _generate(model, torch.cat([out, torch.tensor([[7, 8, 9]])], 1), cache)
    hf.save(store, "w", model, cache, out2[0], owner=OWNER, complete_turn=False)
    assert hf.restore(store, "w", model, owner=OWNER).reused_tokens == out.shape[1]
    hf.save(store, "w", model, cache, out2[0], owner=OWNER)  # nothing new: marks the turn complete
    assert hf.restore(store, "w", model, owner=OWNER).reused_tokens == out2.shape[1]


def test_save_refuses_another_conversation(tiny_model, store):
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    hf.save(store, "chat", model, cache, out[0], owner=OWNER)
    other_cache = hf.new_cache(model)
    other = _generate(model, torch.arange(3, 31)[None], other_cache)
    with pytest.raises(ConversationMismatch, match="token 0 is 2 there, 3 here"):
        hf.save(store, "chat", model, other_cache, other[0], owner=OWNER)
    short_cache = hf.new_cache(model)
    short = _generate(model, torch.arange(2, 12)[None], short_cache, n=2)
    with pytest.raises(ConversationMismatch, match="holds 34 records but the cache only 12"):
        hf.save(store, "chat", model, short_cache, short[0], owner=OWNER)
    with pytest.raises(ConversationMismatch, match="only 3 tokens"):
        hf.save(store, "fresh", model, cache, out[0, :3], owner=OWNER)
    assert store.get("chat", owner=OWNER).n_records == 34  # nothing was appended by the refusals


def test_save_keeps_a_session_in_its_tier(tiny_model, store):
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    info = hf.save(store, "fp8", model, cache, out[0], owner=OWNER, tier="fp8").info
    assert info.tier == tiers.FP8
    assert hf.save(store, "fp8", model, cache, out[0], owner=OWNER).info.tier == tiers.FP8  # None: its own tier
    with pytest.raises(
        FingerprintMismatch, match=r"tier: session fp8 \(v2, e4m3 codes \+ f32 scale\), expected f32 \(v1"
    ):
        hf.save(store, "fp8", model, cache, out[0], owner=OWNER, tier="f32")
    with pytest.warns(tiers.TierSpellingDeprecated, match="tier 'v1' is deprecated: use 'f32'"):  # an old spelling
        with pytest.raises(FingerprintMismatch, match="tier: session fp8"):
            hf.save(store, "fp8", model, cache, out[0], owner=OWNER, tier="v1")
    with pytest.raises(InvalidRequest, match="'q8' is a cache tier"):
        hf.save(store, "q8", model, cache, out[0], owner=OWNER, tier="q8")


def test_save_refuses_bad_input(tiny_model, store):
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    with pytest.raises(InvalidRequest, match=r"ids in \[0, 512\)"):
        hf.save(store, "bad", model, cache, np.r_[out[0].numpy(), 9999], owner=OWNER)
    with pytest.raises(InvalidRequest, match="1-D"):
        hf.save(store, "bad", model, cache, np.zeros((2, 3), np.int64), owner=OWNER)
    batched = hf.new_cache(model)
    model(input_ids=torch.arange(2, 12).reshape(2, 5), use_cache=True, **hf.cache_kwargs(model, batched))
    with pytest.raises(InvalidRequest, match="save_batch"):
        hf.save(store, "bad", model, batched, torch.arange(2, 7), owner=OWNER)
    with pytest.raises(tiers.UnknownTier, match="unknown tier 'v9'"):
        hf.save(store, "bad", model, cache, out[0], owner=OWNER, tier="v9")


@pytest.mark.parametrize(("version", "codec", "bits"), [(1, None, None), (2, None, None), (3, 1, 4), (3, 0, 4)])
def test_a_coli_kv_file_loads_into_a_transformers_cache(tiny_model, tmp_path, version, codec, bits):
    """Rows decoded on the device equal the formats module's decoder (PolarQuant: to libm ulps)."""
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 30)[None], cache)
    L, R = hf.cache_rows(model, cache)
    path = tmp_path / "rows.coli_kv"
    coli_kv.write(
        path, out[0, : L.shape[1]].numpy().astype(np.int32), L, R, vocab=512, version=version, codec=codec, bits=bits
    )
    built = hf.cache_from_records(model, coli_kv.load(path))
    L_built, R_built = hf.cache_rows(model, built)
    reference_L, reference_R, _ = coli_kv.load(path).dequantize()  # the formats module's own decoder
    if codec == 0:
        np.testing.assert_allclose(L_built, reference_L, rtol=0, atol=1e-5)
        np.testing.assert_allclose(R_built, reference_R, rtol=0, atol=1e-5)
    else:
        np.testing.assert_array_equal(L_built, reference_L)
        np.testing.assert_array_equal(R_built, reference_R)
    assert (version == 1) == np.array_equal(L_built, L)
    other = tmp_path / "other.coli_kv"
    coli_kv.write(
        other,
        np.zeros(3, np.int32),
        np.zeros((4, 3, 64), np.float32),
        np.zeros((4, 3, 32), np.float32),
        vocab=600,
        version=1,
    )
    with pytest.raises(GeometryMismatch, match="vocab: file 600, expected 512"):
        hf.cache_from_records(model, coli_kv.load(other))


def test_an_id_taken_by_a_journal_the_index_does_not_list_is_refused_with_that_reason(tiny_model, store):
    """The id is taken by a journal without an index entry (a crash between the two): ``save``
    answers with the reason that says so, not ``SessionNotFound`` chained to ``SessionExists`` for
    the same step (issue 19)."""
    model = tiny_model
    cache = hf.new_cache(model)
    out = _generate(model, torch.arange(2, 12)[None], cache)
    hf.save(store, "kept", model, cache, out[0], owner=OWNER)
    kept = store.journal_path("kept", owner=OWNER)
    kept.with_name(kept.name.replace("kept", "taken", 1)).write_bytes(kept.read_bytes())
    with pytest.raises(SessionExists, match="exists without an index entry") as refused:
        hf.save(store, "taken", model, cache, out[0], owner=OWNER)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
