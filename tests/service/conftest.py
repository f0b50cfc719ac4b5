"""Fixtures for the service suite: a model folder, a private weights-hash cache, servers on demand."""

from __future__ import annotations

import pytest

from kvstore.engine.weights import write_random_model
from served import servers_on_demand
from service.support import Server


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, hash_cache):
    """What ``kvstore new-model models/tiny`` writes (a tiny random model with a byte tokenizer)."""
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture
def make_server(tmp_path, hash_cache):
    """Start servers on demand (restarts, other settings); all are stopped at the end."""

    def build(*extra: str, data=None, **options) -> Server:
        return Server(data or tmp_path / "data", *extra, **options)

    yield from servers_on_demand(build)
