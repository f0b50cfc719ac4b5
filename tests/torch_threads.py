"""The one-intra-op-thread fixture of the suites that run tiny models (imported by their conftests)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models are dominated by per-op overhead: one intra-op thread is faster and steadier
    on a shared CI box. The previous setting is restored for the rest of the session."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
