"""Fixtures for the transformers interop: a tiny DeepSeek-V3 model saved by ``save_pretrained``.

The model is ``transformers.DeepseekV3ForCausalLM`` with the engine's ``tiny`` geometry (4 layers,
the first dense and three MoE layers with group-limited routing, kv_lora 64, qk_rope 32, vocab
512), random weights, norms and routing biases perturbed so that a misplaced row changes the
logits. The folder also carries a byte-level tokenizer with a chat template.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_models and the worker module beside the tests
from hf_models import load, write_folder  # noqa: E402


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
