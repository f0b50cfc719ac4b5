"""Rows a connector loaded, as a torch tensor for the engine's cache (imported by the torch-side
connectors only: :mod:`~kvstore.connectors.prefix_cache` stays numpy-only)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["rows_tensor"]


def rows_tensor(rows: np.ndarray) -> torch.Tensor:
    """``rows`` as a tensor sharing its memory, for reading only: f32 rows as f32, a bf16 tier's
    bit patterns (u16, ``PrefixCache.load(native=True)``) as bf16 — no conversion either way.

    A hot-tier entry is read-only, which torch warns about on every wrap (it cannot protect the
    memory; the callers only copy out of it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if rows.dtype == np.uint16:
            return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(rows)
