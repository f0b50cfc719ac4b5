"""Codecs and the ``.coli_kv`` layouts: bytes <-> arrays, pure functions, numpy only.

Nothing here knows about files on disk as a policy (durability lives in ``kvstore.journal``),
sessions or devices. A row codec is one frozen class per family, registered by tier name in
``codecs`` (``floats``, ``fp8``, ``tq``, ``q8`` define them); the tier vocabulary (``tiers``) names
each registered codec. The ``.coli_kv`` layout is ``coli_kv`` (with ``layout`` and ``records``).
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
