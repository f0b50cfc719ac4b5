"""Typed errors of the migrations (file conversions and index schema steps), on the root of
:mod:`kvstore.formats.errors`; ``kvstore.errors`` re-exports them with the store's own.
"""

from __future__ import annotations

from kvstore.formats.errors import KVStoreError

__all__ = ["IndexSchemaError", "MigrationError", "NoMigrationPath"]


class MigrationError(KVStoreError, ValueError):
    """A migration cannot run as asked: no conversion between the two tiers, a source that is not a
    file, or a destination that would overwrite the source (pick another destination, or ``--force``
    to replace an existing one)."""


class NoMigrationPath(MigrationError):
    """No registered step converts between the two tiers; the reason names both.

    Steps convert between the file tiers (``f32``, ``fp8``, ``int4``, ``polar2`` .. ``polar6``):
    a cache-only tier (``bf16``, ``q8``) has no file of its own to convert to or from.
    """


class IndexSchemaError(KVStoreError, RuntimeError):
    """The session index was written by a newer kvstore, or an upgrade step cannot run.

    The index is never rewritten in that case: run the kvstore version that wrote it, or upgrade
    this one.
    """
