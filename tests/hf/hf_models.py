"""The tiny transformers model the interop tests share (imported by name: a module called
``conftest`` is ambiguous once several test folders have one).

``transformers.DeepseekV3ForCausalLM`` with the engine's ``tiny`` geometry (4 layers, the first dense
and three MoE layers with group-limited routing, kv_lora 64, qk_rope 32, vocab 512), random weights,
norms and routing biases perturbed so that a misplaced row changes the logits; the folder also carries
a byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvstore.engine.config import preset

HERE = Path(__file__).resolve().parent


def tiny_config(**changes):
    """transformers ``DeepseekV3Config`` of the engine's ``tiny`` preset (MoE layers 1..3)."""
    from transformers import DeepseekV3Config

    fields = preset("tiny").to_hf_dict()
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    fields.update(changes)
    return DeepseekV3Config(**fields)


def build_model(seed: int = 0, **changes):
    """A tiny DeepseekV3ForCausalLM with deterministic random weights (eval mode, f32)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_config(**changes)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)
    return model


def write_folder(folder: Path, seed: int = 0, *, tokenizer: bool = True, **changes) -> Path:
    """``save_pretrained`` a tiny model (and a byte tokenizer with a chat template) into ``folder``."""
    from kvstore.engine.tokenizer import write_byte_tokenizer

    build_model(seed, **changes).save_pretrained(folder)
    if tokenizer:
        write_byte_tokenizer(folder, preset("tiny"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        config_path.write_text(json.dumps(config, indent=2))
    return folder


def load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
