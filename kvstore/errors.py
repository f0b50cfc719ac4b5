"""Every typed error kvstore raises, in one place.

The format errors are defined in ``kvstore.formats.errors`` (that part imports nothing else) and
re-exported here. Each error subclasses the matching built-in too, so code that only knows
``KeyError``/``ValueError``/``OSError`` still catches it. ``reason`` is the one line the CLI prints
(exit code 2) and the API returns (with ``http_status``).
"""

from __future__ import annotations

from kvstore.formats.errors import (  # noqa: F401
    BadHeader,
    BadMagic,
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    KVStoreError,
    TruncatedHeader,
)


class JournalWriteError(KVStoreError, OSError):
    """A write or fsync failed. Committed records are intact; the next append rewrites the tail."""

    http_status = 507


class JournalLocked(KVStoreError, BlockingIOError):
    """Another writer holds the journal's lock."""

    http_status = 409


class JournalClosed(KVStoreError, ValueError):
    """The journal handle was closed."""


class PathRefused(KVStoreError, PermissionError):
    """A path resolves outside the folder it must stay in (traversal or a symlink out)."""

    http_status = 400


class SessionNotFound(KVStoreError, KeyError):
    http_status = 404

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.reason


class SessionExists(KVStoreError, ValueError):
    http_status = 409


class InvalidSessionId(KVStoreError, ValueError):
    http_status = 400


class BudgetExceeded(KVStoreError, OSError):
    """The store's hard disk limit would be crossed; nothing was written."""

    http_status = 507


class FingerprintMismatch(KVStoreError, ValueError):
    """A session was written by another model, tokenizer or cache tier than the one restoring it."""

    http_status = 409


class IntegrityError(KVStoreError, ValueError):
    """Stored rows do not match the hashes recorded when they were appended."""

    http_status = 409


class MigrationError(KVStoreError, ValueError):
    """No registered migration path, or a migration that would overwrite its source."""


# ---- session store and HTTP service ---------------------------------------------------------
from kvstore.migrations.index import IndexSchemaError  # noqa: E402,F401  (defined beside the schema steps)


class InvalidRequest(KVStoreError, ValueError):
    """An argument is out of range or malformed (a record count past the end, a bad upload)."""

    http_status = 400


class SessionDamaged(IntegrityError):
    """A session's journal or archive is missing or unreadable; the index keeps the reason."""


class IndexFull(KVStoreError, OSError):
    """The index's LMDB map is full: reopen the store with a larger ``map_size``."""

    http_status = 507


class BodyTooLarge(KVStoreError, ValueError):
    """A request body is larger than the service accepts."""

    http_status = 413


class UnsupportedMediaType(KVStoreError, ValueError):
    """A request body's Content-Type is not one the endpoint reads."""

    http_status = 415


class Unauthorized(KVStoreError, PermissionError):
    """A request carried no API key, or one the service does not know."""

    http_status = 401


class JobNotFound(KVStoreError, KeyError):
    http_status = 404

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.reason


class ConfigError(KVStoreError, ValueError):
    """A configuration file or variable (API keys, sizes) cannot be used as written."""


# ---- transformers interop (kvstore.engine.hf) -------------------------------------------------
class CacheLayoutUnsupported(KVStoreError, ValueError):
    """The transformers model (or version) does not cache the MLA latent rows kvstore stores."""

    http_status = 422


class ConversationMismatch(KVStoreError, ValueError):
    """The tokens or cache given do not continue the conversation the session holds."""

    http_status = 409


# ---- the engine joined to the session store (kvstore.engine.session, the generate endpoint) ----
class EngineNotLoaded(KVStoreError, RuntimeError):
    """The service runs without a model: generation needs ``kvstore serve --model DIR``."""

    http_status = 503


class RestoreFailed(KVStoreError, RuntimeError):
    """Restoring a session into the engine's cache failed (e.g. device memory); nothing changed."""

    http_status = 503
