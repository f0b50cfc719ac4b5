"""The root of kvstore's exception hierarchy and the errors of the file formats.

Every error kvstore raises on purpose is a :class:`KVStoreError`. Each layer keeps its own in one
module, on this root: ``kvstore.formats.errors`` (here: bytes and layouts),
``kvstore.migrations.errors``, ``kvstore.errors`` (journal, store, configuration; it re-exports the
lower layers' errors), ``kvstore.gpu.errors``, ``kvstore.engine.errors`` and ``kvstore.api.errors``
(the HTTP layer, which also holds the status every error maps to: nothing below ``api`` knows
HTTP). Every error carries what happened and what the user can do about it, and also subclasses
the matching built-in, so callers that only know ``ValueError`` still catch them.
"""

from __future__ import annotations

__all__ = [
    "BadHeader",
    "BadScale",
    "BadMagic",
    "CodecMismatch",
    "FormatError",
    "GeometryMismatch",
    "KVStoreError",
    "NonFiniteValues",
    "TruncatedHeader",
]


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose.

    ``reason`` is the one line shown to the user: the CLI prints it (exit code 2), the API returns
    it with the status :func:`kvstore.api.errors.http_status` gives the error's class.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class FormatError(KVStoreError, ValueError):
    """Bytes that do not follow the ``.coli_kv`` spec (or a codec's input contract).

    The reason names the field or byte range at fault; ``kvstore inspect`` shows the whole header
    and ``kvstore repair`` cuts a damaged tail.
    """


class TruncatedHeader(FormatError):
    """Fewer than the 40 header bytes: the file was cut before its header was written whole.

    Nothing in it can be recovered; restore it from another copy.
    """


class BadMagic(FormatError):
    """The first eight bytes are not a known ``COLIKV`` magic: this is not a ``.coli_kv`` file
    (or one written by a newer kvstore)."""


class EncryptedJournal(BadMagic):
    """The file is a journal encrypted at rest (magic ``COLIKVE\0``, docs/SECURITY.md): its rows
    cannot be read without its owner's key, and no ``.coli_kv`` reader misreads it.

    Export the session through the service (``kvstore export --data DIR --session ID``, or the
    HTTP resume download), which hands out a plaintext ``.coli_kv``.
    """


class BadHeader(FormatError):
    """A header field is out of range or inconsistent (negative widths, an unknown tag, ...).

    The reason names the field; a header is never repaired in place.
    """


class UnknownTier(FormatError):
    """A tier name (or file version/codec/bits) that is not in the vocabulary of ``kvstore.tiers``.

    The reason lists the known names: ``f32``, ``bf16``, ``fp8``, ``int4``, ``polar2`` .. ``polar6``, ``q8``.
    """


class BadScale(FormatError):
    """A stored row's fp8 scale or TurboQuant radius is one no encoder writes (the file is damaged),
    and the reader was asked to be strict. The reason names the file, the record, the layer and row.

    Read without ``strict``, such a row is made inert (zeros, never infinities) and counted in
    ``KVRecords.problems``; ``kvstore inspect`` shows where, ``kvstore repair`` neutralizes it.
    """


class NonFiniteValues(FormatError):
    """Rows to store hold NaN or infinite values, and the store was asked to refuse them
    (``reject_nonfinite``; ``kvstore serve --reject-nonfinite``). Nothing was written.

    The reason counts them and names the first (record, L/R/I, layer, element). Send finite rows,
    or let the store keep them as the tier's rule says (the default), which the append counts.
    """


class GeometryMismatch(KVStoreError, ValueError):
    """A file's (or upload's) model fingerprint h0..h5 is not the one the caller expects.

    The rows were written for another model shape: use a session of this model, or the model the
    rows were written by.
    """


class CodecMismatch(KVStoreError, ValueError):
    """A file's tier (version/codec/bits) is not the active cache tier, and no migration was asked for.

    Migrate the file (``kvstore migrate --tier NAME``) or run with the file's tier.
    """
