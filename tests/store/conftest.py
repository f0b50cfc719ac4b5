"""Fixtures for the session store suites."""

from __future__ import annotations

import pytest

from kvstore.store import SessionStore
from store.support import Rows


@pytest.fixture
def rows():
    return Rows(1)


@pytest.fixture
def store(tmp_path):
    with SessionStore(tmp_path / "data") as opened:
        yield opened
