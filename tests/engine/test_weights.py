"""Weights: folder loading (single file, shards, fused experts), random init, tied heads, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstore.engine import load_model, preset, random_model, save_model, write_random_model
from kvstore.engine.errors import ModelConfigError, WeightsError


def _same_weights(a, b) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_random_init_is_deterministic_per_seed():
    cfg = preset("tiny")
    _same_weights(random_model(cfg, seed=4), random_model(cfg, seed=4))
    a, b = random_model(cfg, seed=4), random_model(cfg, seed=5)
    assert not torch.equal(a.model.layers[2].mlp.experts.down_proj, b.model.layers[2].mlp.experts.down_proj)
    # each tensor has its own stream: a different layer count leaves the shared tensors as they were
    fewer = random_model(cfg.replace(num_hidden_layers=2), seed=4)
    assert torch.equal(fewer.model.layers[1].self_attn.kv_b_proj.weight, a.model.layers[1].self_attn.kv_b_proj.weight)


def test_single_file_and_sharded_folders_load_the_same_model(tmp_path):
    model = random_model(preset("tiny-yarn"), seed=2)
    save_model(model, tmp_path / "single")
    save_model(model, tmp_path / "sharded", max_shard_bytes=256 << 10)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in index["weight_map"]
    _same_weights(load_model(tmp_path / "single"), model)
    _same_weights(load_model(tmp_path / "sharded"), model)


def test_fused_expert_layout_loads(tmp_path):
    """transformers >= 5 keeps experts fused: gate_up_proj [E, 2I, hidden] and down_proj [E, hidden, I]."""
    model = random_model(preset("tiny"), seed=3)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for layer in range(1, model.config.n_layers):
        experts = model.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(model.config.n_routed_experts):
            for which in ("gate_proj", "up_proj", "down_proj"):
                del tensors[f"{prefix}.{e}.{which}.weight"]
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([experts.gate_proj, experts.up_proj], dim=1).contiguous()
        tensors[f"{prefix}.down_proj"] = experts.down_proj.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _same_weights(load_model(tmp_path), model)


def test_tied_embeddings(tmp_path):
    cfg = preset("tiny").replace(tie_word_embeddings=True)
    model = random_model(cfg, seed=6)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_model(model, tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _same_weights(loaded, model)


def test_bf16_load_keeps_the_router_in_f32(tmp_path):
    write_random_model(tmp_path, "tiny", seed=1, tokenizer=False)
    model = load_model(tmp_path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_extra_layers_are_reported_not_loaded(tmp_path):
    model = random_model(preset("tiny"), seed=1)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    # a multi-token-prediction module: a layer past num_hidden_layers, experts included
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(4, 4)
    tensors["model.layers.4.mlp.experts.0.up_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert load_model(tmp_path).unused_weights == [
        "model.layers.4.eh_proj.weight",
        "model.layers.4.mlp.experts.0.up_proj.weight",
    ]


def test_missing_and_misshapen_tensors_are_refused(tmp_path):
    model = random_model(preset("tiny"), seed=1)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="kv_b_proj.*missing"):
        load_model(tmp_path)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="shape"):
        load_model(tmp_path)
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError):
        load_model(tmp_path)


def test_folders_without_weights_or_config(tmp_path):
    with pytest.raises(ModelConfigError):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        load_model(tmp_path)
