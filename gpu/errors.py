"""Typed errors of the device backends, on the ``KVStoreError`` base of ``kvstore.formats.errors``.

Each carries the reason shown to the user and subclasses the matching built-in, so callers that
only know ``ValueError``/``RuntimeError`` still catch them.
"""

from __future__ import annotations

from kvstore.formats.errors import KVStoreError

__all__ = ["AttentionInputError", "BackendUnavailable", "KVStoreError"]


class AttentionInputError(KVStoreError, ValueError):
    """Decode-attention inputs with the wrong shape, dtype, device or range."""

    http_status = 422


class BackendUnavailable(KVStoreError, RuntimeError):
    """No registered backend can run on the requested device; ``reasons`` says why, per backend."""

    http_status = 503

    def __init__(self, reason: str, reasons: dict[str, list[str]] | None = None):
        super().__init__(reason)
        self.reasons = dict(reasons or {})
