"""Typed errors of the device backends, on the ``KVStoreError`` root of ``kvstore.formats.errors``.

Each carries the reason shown to the user (the API returns it with the status
``kvstore.api.errors`` maps the class to) and subclasses the matching built-in, so callers that
only know ``ValueError``/``RuntimeError`` still catch them.
"""

from __future__ import annotations

from kvstore.formats.errors import KVStoreError

__all__ = ["AttentionInputError", "BackendUnavailable", "KernelBuildError", "KVStoreError"]


class AttentionInputError(KVStoreError, ValueError):
    """Decode-attention inputs with the wrong shape, dtype, device or range.

    The reason names the argument and the shape/dtype it takes; nothing was computed.
    """


class BackendUnavailable(KVStoreError, RuntimeError):
    """No registered backend can run on the requested device.

    ``reasons`` says why, per backend (a missing module, an unsupported tier or width); install
    what is missing or pick a tier/device a backend supports.
    """

    def __init__(self, reason: str, reasons: dict[str, list[str]] | None = None):
        super().__init__(reason)
        self.reasons = dict(reasons or {})


class KernelBuildError(KVStoreError, RuntimeError):
    """A kernel source did not compile, or its compiler is missing.

    The reason holds the compiler's log, or where the compiler was looked for and how to install it.
    """
