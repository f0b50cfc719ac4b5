"""Fixtures for the trust suite: real model folders, a real session store, the real engine.

Every engine here is the bundled engine on a ``kvstore new-model`` folder (the ``tiny`` preset:
4 layers, kv_lora 64, qk_rope 32, a byte-level tokenizer). Folders that must differ in one
fingerprint field only are siblings named ``tiny`` under different parents, so the model name
(the folder's name) stays the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.engine.session import SessionEngine
from kvstore.engine.tokenizer import load_tokenizer
from kvstore.engine.weights import load_model, write_random_model
from kvstore.store import SessionStore
from torch_threads import one_torch_thread  # noqa: F401  (autouse)
from trust.support import session_engine


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("a") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_folder):
    """(model, tokenizer) of the tiny folder, loaded once."""
    return load_model(tiny_folder), load_tokenizer(tiny_folder)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "data", lock_timeout=2.0) as opened:
        yield opened


@pytest.fixture
def chat(store, tiny_folder, tiny) -> SessionEngine:
    return session_engine(store, tiny_folder, tiny)
