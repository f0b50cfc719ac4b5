"""Fixtures for the transformers interop: a tiny DeepSeek-V3 model saved by ``save_pretrained``.

The model is ``transformers.DeepseekV3ForCausalLM`` with the engine's ``tiny`` geometry (4 layers,
the first dense and three MoE layers with group-limited routing, kv_lora 64, qk_rope 32, vocab
512), random weights, norms and routing biases perturbed so that a misplaced row changes the
logits. The folder also carries a byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_models and the worker module beside the tests
from hf_models import load, write_folder  # noqa: E402

from torch_threads import one_torch_thread  # noqa: E402, F401  (autouse)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_folder):
    return load(tiny_folder)


@pytest.fixture
def store(tmp_path):
    from kvstore.store import SessionStore

    with SessionStore(tmp_path / "data", lock_timeout=2.0) as opened:
        yield opened
