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
from tiny_hf import build_hf_model, hf_config

HERE = Path(__file__).resolve().parent


def tiny_config(**changes):
    """transformers ``DeepseekV3Config`` of the engine's ``tiny`` preset (MoE layers 1..3)."""
    return hf_config("tiny", **changes)


def build_model(seed: int = 0, **changes):
    """A tiny DeepseekV3ForCausalLM with deterministic random weights (eval mode, f32)."""
    return build_hf_model("tiny", seed, **changes)


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
