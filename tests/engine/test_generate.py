"""Generation: prefix reuse, sampling, stop tokens, streaming, text in/out, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import Engine, preset, random_model, write_random_model
from kvstore.engine.errors import GenerationError
from kvstore.engine.generate import SamplingParams, sample_next


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=9)


def _prompt(n=20, seed=0):
    return np.random.default_rng(seed).integers(2, 512, n).tolist()


def test_prefix_reuse_counts(model):
    engine = Engine(model)
    prompt = _prompt()
    first = engine.generate(prompt, max_new_tokens=5, stop_tokens=())
    assert (first.prefilled_tokens, first.reused_tokens) == (20, 0)
    assert engine.cache.length == 24
    # the next turn contains the whole conversation: every cached row is reused
    context = prompt + first.tokens + [7, 8]
    second = engine.generate(context, max_new_tokens=3, stop_tokens=())
    assert (second.prefilled_tokens, second.reused_tokens) == (3, 24)
    # an edit in the middle of the conversation: only the prefix before it is reused
    edited = context[:10] + [99] + context[11:]
    third = engine.generate(edited, max_new_tokens=1, stop_tokens=())
    assert (third.prefilled_tokens, third.reused_tokens) == (len(edited) - 10, 10)
    # the same context again: the last token is run once more to get its logits
    again = engine.generate(edited, max_new_tokens=1, stop_tokens=())
    assert (again.prefilled_tokens, again.reused_tokens) == (1, len(edited) - 1)
    assert again.tokens == third.tokens


def test_reuse_gives_the_tokens_of_a_cold_start(model):
    warm = Engine(model)
    prompt = _prompt(seed=1)
    first = warm.generate(prompt, max_new_tokens=6, stop_tokens=())
    context = prompt + first.tokens + _prompt(5, seed=2)
    got = warm.generate(context, max_new_tokens=10, stop_tokens=())
    cold = Engine(model).generate(context, max_new_tokens=10, stop_tokens=())
    assert got.tokens == cold.tokens


def test_sampling_is_reproducible_by_seed(model):
    engine = Engine(model)
    kwargs = dict(max_new_tokens=12, temperature=1.5, top_p=0.95, stop_tokens=())
    a = engine.generate(_prompt(), seed=123, **kwargs)
    b = Engine(model).generate(_prompt(), seed=123, **kwargs)
    c = engine.generate(_prompt(), seed=124, **kwargs)
    assert a.tokens == b.tokens and a.seed == 123
    assert a.tokens != c.tokens
    unseeded = engine.generate(_prompt(), **kwargs)
    assert unseeded.seed is not None
    assert engine.generate(_prompt(), seed=unseeded.seed, **kwargs).tokens == unseeded.tokens


def test_tight_nucleus_or_top_k_1_is_greedy(model):
    greedy = Engine(model).generate(_prompt(), max_new_tokens=8, stop_tokens=()).tokens
    assert (
        Engine(model).generate(_prompt(), max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=1, stop_tokens=()).tokens
        == greedy
    )
    assert (
        Engine(model).generate(_prompt(), max_new_tokens=8, temperature=1.0, top_k=1, seed=1, stop_tokens=()).tokens
        == greedy
    )


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=0.75)
    drawn = {sample_next(logits, params, generator) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.75 needs the second token; the rest are cut
    params = SamplingParams(temperature=1.0, top_k=3)
    assert {sample_next(logits, params, generator) for _ in range(300)} == {0, 1, 2}


def test_stop_tokens_end_generation(model):
    free = Engine(model).generate(_prompt(), max_new_tokens=10, stop_tokens=()).tokens
    stop = free[3]
    first = free.index(stop)
    stopped = Engine(model).generate(_prompt(), max_new_tokens=10, stop_tokens=[stop])
    assert stopped.tokens == free[: first + 1]
    assert stopped.finish_reason == "stop"
    assert Engine(model).generate(_prompt(), max_new_tokens=10, stop_tokens=()).finish_reason == "length"


def test_streaming_yields_the_tokens_as_they_come(model):
    engine = Engine(model)
    stream = engine.stream(_prompt(), max_new_tokens=6, stop_tokens=())
    seen = []
    for token in stream:
        seen.append(token)
        # each token is out before the next step runs: the cache lags the stream by one token
        assert engine.cache.length == 20 + len(seen) - 1
    assert stream.result.tokens == seen
    assert seen == Engine(model).generate(_prompt(), max_new_tokens=6, stop_tokens=()).tokens
    with pytest.raises(GenerationError, match="only once"):
        list(stream)


def test_text_in_and_out_with_the_folders_tokenizer(tmp_path):
    folder = write_random_model(tmp_path, "tiny", seed=2, tokenizer=True)
    engine = Engine.from_folder(folder)
    text = "héllo wörld, 123"
    ids = engine.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert engine.tokenizer.decode(ids) == text
    result = engine.generate(text, max_new_tokens=5, stop_tokens=())
    assert result.prefilled_tokens == len(ids)
    assert result.text == engine.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert isinstance(result.text, str)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda e: e.generate([], max_new_tokens=1), "empty"),
        (lambda e: e.generate([1, 512], max_new_tokens=1), "token ids"),
        (lambda e: e.generate([-1], max_new_tokens=1), "token ids"),
        (lambda e: e.generate([1], top_p=0.0), "top_p"),
        (lambda e: e.generate([1], temperature=-1.0), "temperature"),
        (lambda e: e.generate([1], top_k=-2), "top_k"),
        (lambda e: e.generate([1], max_new_tokens=-1), "max_new_tokens"),
        (lambda e: e.generate("text without a tokenizer"), "no tokenizer"),
    ],
)
def test_bad_arguments_are_refused(model, call, message):
    engine = Engine(model)
    with pytest.raises(GenerationError, match=message):
        call(engine)
    assert engine.cache.length == 0


@pytest.mark.parametrize("tier", ["f32", "bf16", "fp8", "q8", "int4", "polar4"])
def test_bf16_weights_run_every_tier(tier):
    """The GPU configuration (bf16 weights, f32 attention math) on CPU: close to the f32 model
    with the same cache tier."""
    cfg = preset("tiny")
    f32_model = random_model(cfg, seed=9)
    bf16_model = random_model(cfg, seed=9, dtype="bfloat16")
    assert bf16_model.model.layers[2].mlp.experts.up_proj.dtype == torch.bfloat16
    prompt = _prompt(seed=3)
    reference, _, _ = Engine(f32_model, tier=tier).prefill(prompt)
    engine = Engine(bf16_model, tier=tier)
    logits, _, _ = engine.prefill(prompt)
    assert logits.dtype == torch.float32
    assert float((logits - reference).abs().max() / reference.abs().max()) < 0.1
    result = engine.generate(prompt + [4], max_new_tokens=4, stop_tokens=())
    assert len(result.tokens) == 4 and result.reused_tokens == len(prompt)


@pytest.mark.parametrize("tier", ["f32", "fp8"])
def test_a_short_turn_on_a_long_session_attends_its_rows_in_the_absorbed_form(model, monkeypatch, tier):
    """A new message of a few tokens after many cached rows runs in the absorbed form (each cached
    row read once per new token), not the plain one (every cached row expanded through kv_b_proj
    whatever the message's length): the plain form is never entered, and the rows and logits are
    the plain form's within f32 rounding (the same tokens)."""
    from kvstore.engine import model as model_module
    from kvstore.engine.generate import ABSORBED_CHUNK_TOKENS, absorbs

    assert absorbs(1, 0) and absorbs(ABSORBED_CHUNK_TOKENS, 1) and not absorbs(ABSORBED_CHUNK_TOKENS + 1, 1)
    assert not absorbs(8, 0)  # a first prompt: nothing cached to expand
    history, message = _prompt(400, seed=3), _prompt(6, seed=4)
    plain, absorbed = Engine(model, tier=tier), Engine(model, tier=tier)
    for engine in (plain, absorbed):
        engine.prefill_into(engine.cache, np.asarray(history), 0)
    # the reference: the same message run in the plain form
    plain._run(np.asarray(message[:-1]), 400, absorbed=False, logits="none", cache=plain.cache)
    calls = []
    real_plain = model_module.MLAttention._plain
    monkeypatch.setattr(model_module.MLAttention, "_plain", lambda *a, **k: calls.append(1) or real_plain(*a, **k))
    absorbed.prefill_into(absorbed.cache, np.asarray(message[:-1]), 400)
    assert calls == []  # no layer expanded the 400 cached rows
    assert absorbed.cache.length == plain.cache.length == 405
    if tier == "f32":  # (fp8 codes may sit one step apart at a rounding edge: the tokens below)
        rows_a, rows_p = absorbed.cache.export_rows(), plain.cache.export_rows()
        np.testing.assert_allclose(rows_a.lc[:, 400:], rows_p.lc[:, 400:], rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    got = absorbed.generate(history + message, max_new_tokens=8, stop_tokens=())
    want = plain.generate(history + message, max_new_tokens=8, stop_tokens=())
    assert got.reused_tokens == want.reused_tokens == 405
    assert got.tokens == want.tokens
