"""Typed errors of the engine, on the ``KVStoreError`` base of ``kvstore.formats.errors``.

Each carries the reason shown to the user (the CLI prints it, the API returns it with
``http_status``) and subclasses the matching built-in so ``except ValueError`` still works.
"""

from __future__ import annotations

from kvstore.formats.errors import CodecMismatch, GeometryMismatch, KVStoreError

__all__ = [
    "CacheError",
    "CodecMismatch",
    "GenerationError",
    "GeometryMismatch",
    "KVStoreError",
    "ModelConfigError",
    "TierUnsupported",
    "WeightsError",
]


class ModelConfigError(KVStoreError, ValueError):
    """A ``config.json`` the engine cannot run: wrong architecture, missing or inconsistent fields."""

    http_status = 422


class WeightsError(KVStoreError, ValueError):
    """A model folder whose tensors are missing, misshapen or in a layout the loader does not know."""

    http_status = 422


class TierUnsupported(KVStoreError, ValueError):
    """A cache tier that cannot hold this model's rows (e.g. TQ needs power-of-two widths)."""

    http_status = 422


class CacheError(KVStoreError, ValueError):
    """A cache operation out of range: a write past the rows held, a restore of inconsistent rows."""

    http_status = 409


class GenerationError(KVStoreError, ValueError):
    """Bad generation arguments: empty prompt, token ids outside the vocabulary, top_p not in (0, 1]."""

    http_status = 422
