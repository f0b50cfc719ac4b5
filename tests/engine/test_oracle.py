"""Oracle: our model against the real transformers DeepseekV3ForCausalLM on tiny random configs.

The transformers model is built with its own random init (norms and routing biases perturbed),
saved with ``save_pretrained`` and loaded by our loader. The presets have MoE layers with
group-limited routing; ``tiny`` has a direct q projection and plain rope, ``tiny-yarn`` q LoRA and
yarn rope with mscale, ``tiny-512`` is ``tiny`` at DeepSeek's latent widths (kv_lora 512, qk_rope
64), the model on which the CUDA kernels are checked against the CPU engine (tests/engine/test_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.engine import Engine, load_model, make_cache, write_random_model

PRESETS = ("tiny", "tiny-yarn", "tiny-512")
PROMPT_LEN = 64
LOGIT_RTOL = 1e-4


def _prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 11) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _our_logits(model, ids: torch.Tensor, absorbed: bool) -> tuple[torch.Tensor, object]:
    cache = make_cache("f32", model.config)
    cache.prepare(0, ids.shape[0])
    logits = model.forward_tokens(ids, cache, 0, absorbed=absorbed, logits="all")
    cache.commit(0, ids.numpy())
    return logits, cache


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_and_absorbed_logits_match_transformers(hf_models, name):
    hf, folder = hf_models[name]
    ours = load_model(folder)
    ids = _prompt(ours.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    plain, _ = _our_logits(ours, ids, absorbed=False)
    absorbed, _ = _our_logits(ours, ids, absorbed=True)
    print(f"\n{name}: plain rel {_relative(plain, ref):.2e}, absorbed rel {_relative(absorbed, ref):.2e}")
    assert _relative(plain, ref) <= LOGIT_RTOL
    assert _relative(absorbed, ref) <= LOGIT_RTOL
    assert torch.equal(plain.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", PRESETS)
def test_cached_rows_are_what_transformers_caches(hf_models, name):
    """Lc / Rc per layer equal DynamicCache's keys / values (transformers >= 5 caches the latent)."""
    hf, folder = hf_models[name]
    ours = load_model(folder)
    ids = _prompt(ours.config.vocab_size, seed=12)
    with torch.no_grad():
        out = hf(ids[None], use_cache=True)
    _, cache = _our_logits(ours, ids, absorbed=False)
    for layer in range(ours.config.n_layers):
        lc, rc = cache.read(layer, ids.shape[0])
        torch.testing.assert_close(lc, out.cache.layers[layer].keys[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rc, out.cache.layers[layer].values[0, 0], rtol=1e-6, atol=1e-6)


def _hf_greedy(hf, ids: torch.Tensor, n_new: int) -> list[int]:
    """transformers' own incremental decode: one forward per token over its DynamicCache."""
    with torch.no_grad():
        out = hf(ids[None], use_cache=True)
        tokens = []
        for _ in range(n_new):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return tokens


@pytest.mark.parametrize("name", PRESETS)
def test_32_greedy_tokens_identical(hf_models, name):
    hf, folder = hf_models[name]
    engine = Engine.from_folder(folder, tier="f32")
    ids = _prompt(engine.config.vocab_size, seed=13)
    expected = _hf_greedy(hf, ids, 32)
    result = engine.generate(ids.numpy(), max_new_tokens=32, stop_tokens=())
    assert result.tokens == expected
    assert result.prefilled_tokens == PROMPT_LEN and result.reused_tokens == 0


@pytest.mark.parametrize("name", PRESETS)
def test_absorbed_decode_equals_plain_attention(hf_models, name):
    """Token-by-token absorbed decode over the cache gives the logits of one plain pass."""
    _, folder = hf_models[name]
    model = load_model(folder)
    ids = _prompt(model.config.vocab_size, n=40, seed=14)
    plain, _ = _our_logits(model, ids, absorbed=False)
    cache = make_cache("f32", model.config)
    stepped = []
    for position in range(ids.shape[0]):
        cache.prepare(position, 1)
        stepped.append(model.forward_tokens(ids[position : position + 1], cache, position, absorbed=True))
        cache.commit(position, ids[position : position + 1].numpy())
    assert _relative(torch.stack(stepped), plain) <= 1e-5


def test_transformers_loads_a_folder_we_write(tmp_path):
    """write_random_model's folder (sharded here) is a valid transformers checkpoint of the same model."""
    from transformers import AutoModelForCausalLM

    folder = write_random_model(tmp_path / "model", "tiny-yarn", seed=3, tokenizer=False, max_shard_bytes=1 << 20)
    assert (folder / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = load_model(folder)
    ids = _prompt(ours.config.vocab_size, seed=15)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got, _ = _our_logits(ours, ids, absorbed=False)
    assert _relative(got, ref) <= LOGIT_RTOL


def test_long_prompt_chunked_prefill_matches_one_pass(hf_models, monkeypatch):
    """Prefill in token chunks, with query chunks inside SDPA, equals one unchunked pass."""
    from kvstore.engine import model as model_module

    _, folder = hf_models["tiny"]
    model = load_model(folder)
    ids = _prompt(model.config.vocab_size, n=700, seed=16).numpy()
    whole = Engine(model, prefill_chunk=4096)
    reference, _, _ = whole.prefill(ids)
    # a score budget small enough that every SDPA call is split into many query chunks
    monkeypatch.setattr(model_module, "_SCORE_BUDGET_BYTES", 4 * model.config.num_attention_heads * 700 * 16)
    chunked = Engine(model, prefill_chunk=97)
    logits, prefilled, reused = chunked.prefill(ids)
    assert (prefilled, reused) == (700, 0)
    assert _relative(logits, reference) <= 1e-5
    np.testing.assert_array_equal(chunked.cache.tokens, ids)
    _, lc_a, rc_a = whole.cache.export_f32()
    _, lc_b, rc_b = chunked.cache.export_f32()
    np.testing.assert_allclose(lc_b, lc_a, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rc_b, rc_a, rtol=1e-4, atol=1e-5)
