"""Fixtures for the service suite: a model folder, a private weights-hash cache, servers on demand."""

from __future__ import annotations

import os

import pytest

from kvstore.engine.weights import write_random_model
from service.support import Server


@pytest.fixture(scope="session")
def hash_cache(tmp_path_factory):
    """Weights hashes are cached under KVSTORE_CACHE_DIR: keep the suite's (and its servers') out of ~."""
    folder = tmp_path_factory.mktemp("kvstore-cache")
    previous = os.environ.get("KVSTORE_CACHE_DIR")
    os.environ["KVSTORE_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("KVSTORE_CACHE_DIR", None)
    else:
        os.environ["KVSTORE_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, hash_cache):
    """What ``kvstore new-model models/tiny`` writes (a tiny random model with a byte tokenizer)."""
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture
def make_server(tmp_path, hash_cache):
    """Start servers on demand (restarts, other settings); all are stopped at the end."""
    started: list[Server] = []

    def make(*extra: str, data=None, **options) -> Server:
        running = Server(data or tmp_path / "data", *extra, **options).start()
        started.append(running)
        return running

    yield make
    for running in started:
        if running.process.poll() is None:
            running.stop()
