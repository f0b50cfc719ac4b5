"""Codecs and the ``.coli_kv`` layouts: bytes <-> arrays, pure functions, numpy only.

Nothing here knows about files on disk as a policy (durability lives in ``kvstore.journal``),
sessions or devices. The tier vocabulary (``tiers``) is the table of row codecs.
"""

from kvstore.formats.errors import (  # noqa: F401
    BadHeader,
    BadMagic,
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    KVStoreError,
    TruncatedHeader,
    UnknownTier,
)
