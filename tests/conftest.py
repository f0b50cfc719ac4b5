"""Shared fixtures: the golden vectors, a private weights-hash cache, GPU skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore import config as settings

# The vectors live in ../shared/vectors beside the checkout; a copy inside the repository
# (tests/vectors) wins so CI on a bare clone has them too.
_HERE = Path(__file__).resolve().parent
_CANDIDATES = [_HERE / "vectors", _HERE.parent.parent / "shared" / "vectors"]


def vectors_dir() -> Path:
    for cand in _CANDIDATES:
        if (cand / "README.md").is_file():
            return cand
    raise FileNotFoundError(
        "golden vectors not found: expected tests/vectors/ or ../shared/vectors/ (never regenerated here)"
    )


@pytest.fixture(scope="session")
def vectors() -> Path:
    return vectors_dir()


@pytest.fixture(scope="session", autouse=True)
def hash_cache(tmp_path_factory):
    """Weights hashes are cached under KVSTORE_CACHE_DIR: keep the suite's (and its servers') out
    of the home folder."""
    folder = tmp_path_factory.mktemp("kvstore-cache")
    name = settings.CACHE_DIR.name
    previous = os.environ.get(name)
    os.environ[name] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = previous


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests either way
        has_cuda = False
    if not settings.LONG.get():
        long_only = pytest.mark.skip(reason="long run only (KVSTORE_LONG=1, make test-long)")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(long_only)
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder name
            item.add_marker(skip)


# Hypothesis: the default run is deterministic (CI must not flip on a fresh random draw); the long
# run (KVSTORE_LONG=1, `make test-long`) explores with fresh randomness and more examples. No
# deadline in either: a per-example time limit is a timing assertion, and on a shared 2-core runner
# it fails on load, not on behaviour (benchmarks time things; tests do not).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
_hypothesis_settings.register_profile("long", max_examples=2000, print_blob=True, deadline=None)
_hypothesis_settings.load_profile("long" if settings.LONG.get() else "ci")
