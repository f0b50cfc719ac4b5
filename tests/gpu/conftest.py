"""Keep the CPU tests of this folder running on machines without CUDA.

The suite-wide hook in ``tests/conftest.py`` skips items whose keywords contain ``gpu``; an item's
keywords include the names of its parent folders, so every test under ``tests/gpu`` matches, not
only those marked ``@pytest.mark.gpu``. This hook runs after it and lifts that skip from the items
here that carry no ``gpu`` marker (the registry, upload and torch-fallback tests, which need no GPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_REASON = "needs a CUDA device"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE not in Path(str(item.fspath)).resolve().parents or item.get_closest_marker("gpu") is not None:
            continue
        item.own_markers[:] = [
            mark for mark in item.own_markers if not (mark.name == "skip" and mark.kwargs.get("reason") == _REASON)
        ]
