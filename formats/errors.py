"""Typed errors of the file formats; ``kvstore.errors`` re-exports them with the rest.

Every error carries what happened and what the user can do about it. Each also subclasses
the matching built-in, so callers that only know ``ValueError`` still catch them.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose.

    ``reason`` is the one-line text the CLI prints (exit code 2) and the API returns (4xx).
    """

    http_status = 400

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class FormatError(KVStoreError, ValueError):
    """Bytes that do not follow the ``.coli_kv`` spec (or a codec's input contract)."""

    http_status = 422


class TruncatedHeader(FormatError):
    """Fewer than the 40 header bytes."""


class BadMagic(FormatError):
    """The first eight bytes are not a known ``COLIKV`` magic."""


class BadHeader(FormatError):
    """A header field is out of range or inconsistent (negative widths, unknown tag, ...)."""


class GeometryMismatch(KVStoreError, ValueError):
    """A file's model fingerprint (h0..h5) is not the one the caller expects."""

    http_status = 409


class CodecMismatch(KVStoreError, ValueError):
    """A file's version/codec/bits is not the active cache tier, and no migration was asked for."""

    http_status = 409
