"""The session fingerprint: what restore compares, the override, the cached weights hash, the
run-time check of what transformers caches."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_models import build_model, load, tiny_config, write_folder

from kvstore.engine import fingerprint, hf
from kvstore.engine.errors import CacheLayoutUnsupported
from kvstore.errors import FingerprintMismatch, InvalidRequest

OWNER = "alice"


@pytest.fixture
def saved(tiny_model, store):
    """A session of the tiny model (one turn)."""
    cache = hf.new_cache(tiny_model)
    out = tiny_model.generate(
        torch.arange(2, 40)[None], max_new_tokens=4, do_sample=False, **hf.cache_kwargs(tiny_model, cache)
    )
    return hf.save(store, "chat", tiny_model, cache, out[0], owner=OWNER).info


def _mismatch(store, model, **kwargs) -> str:
    with pytest.raises(FingerprintMismatch) as caught:
        hf.restore(store, "chat", model, owner=OWNER, **kwargs)
    return caught.value.reason


def test_the_fingerprint_holds_every_field(tiny_model, saved):
    model = saved.model
    assert (model.name, model.revision, model.attention_variant) == ("tiny", "local", hf.ATTENTION_VARIANT)
    assert model.weights_hash.startswith("blake2b:")
    assert model.tokenizer_hash.startswith("blake2b:") and model.chat_template_hash.startswith("blake2b:")
    assert saved.geometry.words() == (4, 64, 32, 0, 0, 512)


def test_other_weights_are_refused_naming_the_field_and_the_override_lets_them_through(tmp_path, store, saved):
    other = load(write_folder(tmp_path / "other" / "tiny", seed=5))  # same name, same tokenizer
    reason = _mismatch(store, other)
    assert "model.weights_hash" in reason
    assert "model.name" not in reason and "tokenizer" not in reason and "geometry" not in reason
    restored = hf.restore(store, "chat", other, owner=OWNER, override={"model.weights_hash"})
    assert restored.reused_tokens == saved.n_records


def test_the_same_weights_saved_again_are_recognized(tmp_path, tiny_model, tiny_folder, store, saved):
    copy = tmp_path / "copy" / "tiny"
    tiny_model.save_pretrained(copy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_folder / name, copy / name)
    restored = hf.restore(store, "chat", load(copy), owner=OWNER)
    assert restored.reused_tokens == saved.n_records


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("model.chat_template_hash", lambda config: config.update(chat_template="{{ messages[0]['content'] }}")),
        ("model.tokenizer_hash", lambda config: config.update(model_max_length=1024)),
    ],
)
def test_a_changed_tokenizer_or_chat_template_is_named(tmp_path, tiny_folder, store, saved, field, edit):
    copy = shutil.copytree(tiny_folder, tmp_path / "edited" / "tiny")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    edit(config)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    reason = _mismatch(store, load(copy))
    assert [part.split(":")[0].strip() for part in reason.split(": ", 1)[1].split(";")] == [field]


def test_geometry_tier_and_override_names_are_checked(tiny_model, store, saved):
    narrow = build_model(0, kv_lora_rank=32)
    assert "geometry.kv_lora: session 64, expected 32" in _mismatch(store, narrow)
    assert "tier: session f32 (v1, f32 values), expected fp8 (v2, e4m3 codes + f32 scale)" in _mismatch(
        store, tiny_model, tier="fp8"
    )
    with pytest.raises(InvalidRequest, match="cannot override"):
        hf.restore(store, "chat", tiny_model, owner=OWNER, override={"geometry.vocab"})


def test_a_model_without_a_folder_is_fingerprinted_by_its_parameters():
    first, same, other = build_model(0), build_model(0), build_model(1)
    info = hf.model_info(first)
    assert info.revision == "memory" and info.weights_hash.startswith("tensors:blake2b:")
    assert hf.model_info(same).weights_hash == info.weights_hash
    assert hf.model_info(other).weights_hash != info.weights_hash


def test_the_weights_hash_is_computed_once_per_folder_and_cached_on_disk(tmp_path, hash_cache):
    folder = write_folder(tmp_path / "m", seed=2, tokenizer=False)
    real = hf.weights_hash(folder)
    records = list((hash_cache / "weights").glob("*.json"))
    record = next(r for r in records if json.loads(r.read_text())["folder"] == str(folder.resolve()))
    # a later process reads the record instead of hashing the files again
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "hash": "blake2b:from-the-record"}))
    fingerprint._folder_hashes.clear()
    assert hf.weights_hash(folder) == "blake2b:from-the-record"
    # a weight file that changed (new mtime) is hashed again
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    fingerprint._folder_hashes.clear()
    assert hf.weights_hash(folder) == real
    with pytest.raises(InvalidRequest, match="no \\*.safetensors"):
        hf.weights_hash(tmp_path)


def test_models_that_cache_something_else_are_refused():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LongcatFlashConfig,
        LongcatFlashForCausalLM,
        MiniCPM3Config,
        MiniCPM3ForCausalLM,
    )

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    )
    with pytest.raises(CacheLayoutUnsupported, match="no kv_lora_rank"):
        hf.check_cache_layout(llama)
    # LongCat-Flash caches the normed latent times a LoRA scale: not the rows kvstore stores
    longcat = LongcatFlashForCausalLM(
        LongcatFlashConfig(
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_attention_heads=2,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=16,
            ffn_hidden_size=64,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
        )
    ).eval()
    with pytest.raises(CacheLayoutUnsupported, match="not the kv_a_layernorm output"):
        hf.check_cache_layout(longcat)
    # MiniCPM3 caches the DeepSeek latent with the non-interleaved rope layout: accepted
    minicpm = MiniCPM3ForCausalLM(
        MiniCPM3Config(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            intermediate_size=64,
        )
    ).eval()
    assert hf.check_cache_layout(minicpm).geometry.words() == (2, 32, 16, 0, 0, 256)


def test_a_sparse_indexer_model_is_refused():
    with pytest.raises(CacheLayoutUnsupported, match="indexer"):
        hf.geometry_of(tiny_config(index_topk=8, index_head_dim=16))
