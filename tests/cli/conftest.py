"""Fixtures of the CLI suite: model folders written the way a user writes them, and small rows.

The CLI is the top of the stack, so its tests run every part end to end; what they need from the
other suites is rebuilt here from the shared helpers (``tiny_hf``, ``torch_threads``) rather than
imported from those suites' folders.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.formats.coli_kv import Geometry
from tiny_hf import build_hf_model
from torch_threads import one_torch_thread  # noqa: F401  (autouse)

#: A small MLA geometry with one indexer layer (rows of 32 + 8 values, indexer rows of 4).
GEOMETRY = Geometry(n_layers=2, kv_lora=32, qk_rope=8, index_hd=4, nic=1, vocab=1000)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, hash_cache):
    """What ``kvstore new-model DIR --preset tiny --seed 4`` writes (random weights, byte tokenizer)."""
    folder = tmp_path_factory.mktemp("models") / "tiny"
    assert main(["new-model", str(folder), "--preset", "tiny", "--seed", "4"]) == 0
    return folder


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """A tiny ``DeepseekV3ForCausalLM`` saved by transformers' ``save_pretrained``, with norms and
    routing biases perturbed (a misplaced cache row changes the logits) and a byte tokenizer."""
    from kvstore.engine.config import preset
    from kvstore.engine.tokenizer import write_byte_tokenizer

    folder = tmp_path_factory.mktemp("hf") / "tiny"
    build_hf_model("tiny").save_pretrained(folder)
    write_byte_tokenizer(folder, preset("tiny"))
    return folder


@pytest.fixture
def geometry() -> Geometry:
    return GEOMETRY


@pytest.fixture
def make_rows():
    """``make(n, seed)`` -> (tokens int32[n], L f32[2, n, 32], R f32[2, n, 8], I f32[1, n, 4]) of
    :data:`GEOMETRY`, random and deterministic per seed."""

    def make(n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        g = GEOMETRY
        tokens = rng.integers(0, g.vocab, n).astype(np.int32)
        L = rng.standard_normal((g.n_layers, n, g.kv_lora)).astype(np.float32)
        R = rng.standard_normal((g.n_layers, n, g.qk_rope)).astype(np.float32)
        index = rng.standard_normal((g.nic, n, g.index_hd)).astype(np.float32)
        return tokens, L, R, index

    return make
