"""ModelConfig parsing and the rope/softmax arithmetic, checked against transformers itself."""

from __future__ import annotations

import json

import pytest
import torch

from kvstore.engine import ModelConfig, preset
from kvstore.engine.errors import ModelConfigError
from kvstore.engine.rotary import rope_inv_freq

# The shape of DeepSeek-V3's own config.json: rope_theta at the top, legacy "rope_scaling".
LEGACY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "topk_method": "noaux_tc",
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _hf(raw: dict):
    from transformers import DeepseekV3Config

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dtype")}
    return DeepseekV3Config(**fields)


CASES = {
    "legacy-yarn": LEGACY_V3,
    "tiny": preset("tiny").to_hf_dict(),
    "tiny-yarn": preset("tiny-yarn").to_hf_dict(),
    "v2-lite": preset("v2-lite").to_hf_dict(),
    "linear": {
        **preset("tiny").to_hf_dict(),
        "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope_and_softmax_scale_match_transformers(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    raw = CASES[case]
    ours = ModelConfig.from_dict(json.loads(json.dumps(raw)))
    hf_config = _hf(json.loads(json.dumps(raw)))
    rotary = DeepseekV3RotaryEmbedding(hf_config)
    inv_freq, attention_scaling = rope_inv_freq(ours)
    torch.testing.assert_close(inv_freq, rotary.inv_freq, rtol=0, atol=0)
    assert attention_scaling == pytest.approx(rotary.attention_scaling, rel=1e-12)
    hf_attention = DeepseekV3Attention(hf_config, layer_idx=0)
    assert ours.softmax_scale() == pytest.approx(hf_attention.scaling, rel=1e-12)


def test_legacy_fields_parse():
    cfg = ModelConfig.from_dict(LEGACY_V3)
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and cfg.rope.theta == 10000
    assert cfg.rope.original_max_position_embeddings == 4096
    assert cfg.q_lora_rank == 96 and cfg.eos_token_id == (1,)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    geometry = cfg.coli_geometry()
    assert (geometry.n_layers, geometry.kv_lora, geometry.qk_rope, geometry.nic, geometry.vocab) == (3, 64, 32, 0, 1024)


def test_round_trip_through_config_json(tmp_path):
    for name in ("tiny", "tiny-yarn", "v2-lite"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(preset(name).to_hf_dict()))
        assert ModelConfig.from_file(path) == preset(name)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "llama"}, "not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
        ({"n_group": 3}, "must divide"),
        ({"n_group": 16}, "at least 2 experts"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "exceeds"),
        ({"qk_rope_head_dim": 31}, "even"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"kv_lora_rank": 0}, "positive"),
        ({"eos_token_id": 5000}, "outside the vocabulary"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type"),
        ({"topk_group": None}, "non-negative integer"),
        ({"first_k_dense_replace": -1}, "non-negative integer"),
    ],
)
def test_configs_the_engine_cannot_run_are_refused_with_a_reason(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**LEGACY_V3, **change})


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ModelConfigError, match="unknown preset"):
        preset("huge")


def test_every_preset_is_offered_by_new_model():
    """``kvstore new-model --preset`` offers every named geometry."""
    import argparse

    from kvstore.cli import build_parser
    from kvstore.engine.config import PRESETS

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    option = next(a for a in commands.choices["new-model"]._actions if "--preset" in a.option_strings)
    assert tuple(option.choices) == tuple(PRESETS)
