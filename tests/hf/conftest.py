"""Fixtures for the transformers interop: a tiny DeepSeek-V3 model saved by ``save_pretrained``.

The model is ``transformers.DeepseekV3ForCausalLM`` with the engine's ``tiny`` geometry (4 layers,
the first dense and three MoE layers with group-limited routing, kv_lora 64, qk_rope 32, vocab
512), random weights, norms and routing biases perturbed so that a misplaced row changes the
logits. The folder also carries a byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from kvstore.engine.config import preset

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the worker module beside the tests


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


@pytest.fixture(scope="session", autouse=True)
def private_hash_cache(tmp_path_factory):
    """Weights hashes are cached under KVSTORE_CACHE_DIR: keep the suite's out of the home folder."""
    folder = tmp_path_factory.mktemp("kvstore-cache")
    previous = os.environ.get("KVSTORE_CACHE_DIR")
    os.environ["KVSTORE_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("KVSTORE_CACHE_DIR", None)
    else:
        os.environ["KVSTORE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_folder):
    return load(tiny_folder)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are dominated by per-op overhead: one intra-op thread is faster and steadier."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def store(tmp_path):
    from kvstore.sessions import SessionStore

    with SessionStore(tmp_path / "data", lock_timeout=2.0) as opened:
        yield opened
