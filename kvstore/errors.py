"""Typed errors of the journal, the session store and the configuration, with the lower layers' errors.

``from kvstore.errors import X`` works for every store-level error: the format errors (defined in
:mod:`kvstore.formats.errors`, the root of the hierarchy) and the migration errors (defined in
:mod:`kvstore.migrations.errors`) are re-exported here. The engine's, the GPU backends' and the
HTTP service's own errors live in ``kvstore.engine.errors``, ``kvstore.gpu.errors`` and
``kvstore.api.errors``.

Each error subclasses the matching built-in too, so code that only knows
``KeyError``/``ValueError``/``OSError`` still catches it. ``reason`` is the one line the CLI prints
(exit code 2) and the API returns, with the status ``kvstore.api.errors`` maps the class to.
"""

from __future__ import annotations

from kvstore.config import SettingError
from kvstore.formats.errors import (
    BadHeader,
    BadMagic,
    BadScale,
    CodecMismatch,
    EncryptedJournal,
    FormatError,
    GeometryMismatch,
    KVStoreError,
    NonFiniteValues,
    TruncatedHeader,
    UnknownTier,
)
from kvstore.migrations.errors import IndexSchemaError, MigrationError, NoMigrationPath

__all__ = [
    # re-exported from kvstore.formats.errors and kvstore.migrations.errors
    "BadHeader",
    "BadMagic",
    "BadScale",
    "CodecMismatch",
    "EncryptedJournal",
    "FormatError",
    "GeometryMismatch",
    "IndexSchemaError",
    "KVStoreError",
    "MigrationError",
    "NoMigrationPath",
    "NonFiniteValues",
    "TruncatedHeader",
    "UnknownTier",
    # defined here
    "BudgetExceeded",
    "ConfigError",
    "FileDamaged",
    "FileUnreadable",
    "FingerprintMismatch",
    "IndexFull",
    "IndexIOError",
    "IntegrityError",
    "InvalidCursor",
    "InvalidRequest",
    "InvalidSessionId",
    "JournalClosed",
    "JournalLocked",
    "JournalWriteError",
    "PathRefused",
    "SessionDamaged",
    "SessionExists",
    "SessionNotFound",
    "TooManySessions",
    # the shared backend (kvstore.store.shared, docs/SCALE.md)
    "BlobStoreError",
    "BlobStoreUnavailable",
    "IndexUnavailable",
    "LeaseExpired",
    "LeaseHeld",
    "NotOnSharedStore",
    "IdempotencyKeyReused",
    "RecordCountMismatch",
    "SegmentLost",
    "StaleLease",
    "Unavailable",
    "KeyShredded",
    "KeyUnavailable",
    "SealBroken",
]


# ---- the journal (kvstore.journal) ------------------------------------------------------------
class JournalWriteError(KVStoreError, OSError):
    """A write or fsync of a journal failed (a full or failing disk).

    Committed records are intact and nothing after them was acknowledged; free space or fix the
    disk and send the rows again (the next append rewrites the torn tail).
    """


class FileUnreadable(KVStoreError, OSError):
    """A file named by the caller cannot be read: it does not exist, is a folder (or a device, a
    FIFO), or may not be read.

    The reason names the path, what is wrong and what was expected there; nothing was read or written.
    """


class FileDamaged(FormatError):
    """A ``.coli_kv`` file is damaged (committed records missing or invalid, or a partial record at
    its end), and the command would have read it as if it were whole.

    The reason names each damage and where it is. ``kvstore repair`` keeps a ``.bak`` and fixes what
    can be fixed; ``--allow-damaged`` goes on with the records that are whole (and says how many were
    dropped). The CLI exits 1 (damaged) for it, not 2.
    """


class JournalLocked(KVStoreError, BlockingIOError):
    """Another writer holds the journal's (or session's) lock for longer than the lock timeout.

    Nothing was changed; retry once the other writer is done.
    """


class JournalClosed(KVStoreError, ValueError):
    """The journal handle was closed; open the journal again to use it."""


class PathRefused(KVStoreError, PermissionError):
    """A path resolves outside the folder it must stay in (traversal, or a symbolic link out).

    Nothing was read or written there; name a file inside the folder.
    """


# ---- the session store (kvstore.store) -----------------------------------------------------
class SessionNotFound(KVStoreError, KeyError):
    """No session has this id for this owner (another owner's session looks exactly as missing).

    List the owner's sessions to find the id, or create the session first.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.reason


class SessionExists(KVStoreError, ValueError):
    """A session with this id already exists (ids are unique in a store, across owners).

    Pick another id, or leave it out to have one generated.
    """


class InvalidSessionId(KVStoreError, ValueError):
    """A session id that is not 1-64 of ``[A-Za-z0-9_-]`` starting with a letter or digit.

    Nothing was looked up; use an id of that form.
    """


class InvalidRequest(KVStoreError, ValueError):
    """An argument is out of range or malformed (a record count past the end, a bad upload).

    The reason names the argument and what it takes; nothing was changed.
    """


class InvalidCursor(InvalidRequest):
    """A list's ``cursor`` is not one a list handed out (changed, cut short, or made up).

    Nothing was listed: pass the ``next_cursor`` of the page before unchanged, or none to start
    from the oldest session.
    """


class TooManySessions(KVStoreError, RuntimeError):
    """The owner already has as many sessions as the store allows one owner
    (``kvstore serve --max-sessions-per-owner``); nothing was created.

    Delete sessions the owner no longer needs (``DELETE /sessions/{id}``), or raise the limit.
    """


class BudgetExceeded(KVStoreError, OSError):
    """The store's hard disk limit would be crossed; nothing was written.

    Delete or park sessions, or raise the limit (``--hard-limit``).
    """


class FingerprintMismatch(KVStoreError, ValueError):
    """A session was written by another model, tokenizer or cache tier than the one restoring it.

    The reason names each field that differs; use the matching model, or override a field
    explicitly when you know the rows are still valid.
    """


class IntegrityError(KVStoreError, ValueError):
    """Stored rows do not match the hashes recorded when they were appended (a silent bit flip).

    The damaged turns are never served; ``repair`` cuts the session back to its last good turn.
    """


class SessionDamaged(IntegrityError):
    """A session's journal or archive is missing or unreadable; the index keeps the reason.

    ``repair`` keeps what can still be read, or delete the session.
    """


class IndexFull(KVStoreError, OSError):
    """The index cannot grow: its LMDB map is full, or the disk holding it is. Nothing was changed.

    The reason says which: reopen the store with a larger ``map_size`` (``kvstore serve
    --index-size``), or free space on that disk. Reads keep working meanwhile.
    """


class IndexIOError(KVStoreError, OSError):
    """LMDB could not open or write the index for another reason than space (an I/O error, a file
    under ``index/`` that is not an LMDB environment).

    A failed write was rolled back, so the index holds what it held before the call; check the disk
    and the files under ``index/``, then retry.
    """


# ---- the shared backend (kvstore.store.shared: PostgreSQL index + S3 objects, docs/SCALE.md) ----
class Unavailable(KVStoreError, ConnectionError):
    """A server the shared store needs cannot be reached now; nothing acknowledged was lost.

    Retry after :attr:`retry_after` seconds (the API answers 503 with ``Retry-After``); the store
    reconnects by itself.
    """

    def __init__(self, reason: str, retry_after: float = 1.0):
        super().__init__(reason)
        self.retry_after = retry_after


class IndexUnavailable(Unavailable):
    """PostgreSQL (the shared index) is down, restarting or unreachable; the call changed nothing
    that was acknowledged. Retry after ``retry_after`` seconds."""


class BlobStoreUnavailable(Unavailable):
    """The S3-compatible object store kept failing (5xx, timeouts, dropped connections) after the
    retries; no segment was committed. Retry after ``retry_after`` seconds."""


class BlobStoreError(KVStoreError, OSError):
    """The object store refused a request for a reason a retry cannot fix (no such bucket, access
    denied, an object that must not exist already does). The reason names the call and the answer."""


class LeaseHeld(KVStoreError, BlockingIOError):
    """Another replica holds the session's write lease; :attr:`retry_after` is the seconds left on it.

    Nothing was changed; retry then (a dead holder's lease expires by itself).
    """

    def __init__(self, reason: str, retry_after: float = 1.0):
        super().__init__(reason)
        self.retry_after = retry_after


class StaleLease(KVStoreError, PermissionError):
    """This writer's fencing token is no longer the session's lease token: another replica took the
    session over. The commit was refused and nothing was published; acquire the lease again."""


class LeaseExpired(StaleLease):
    """This writer's lease expired before it committed; nothing was published. Acquire it again."""


class RecordCountMismatch(KVStoreError, ValueError):
    """An append expected the session to hold another number of records than it does (another
    writer appended, or an earlier attempt of this one was committed). :attr:`current` is the count;
    nothing was written."""

    def __init__(self, reason: str, current: int):
        super().__init__(reason)
        self.current = current


class SegmentLost(KVStoreError, RuntimeError):
    """A segment's upload intent was collected as garbage before its commit (the writer was slower
    than the GC grace); nothing was published. Upload the rows again."""


class IdempotencyKeyReused(KVStoreError, ValueError):
    """An idempotency key was sent again with another request (other rows, or another turn flag)
    than the one it first came with; nothing was written. Send a new key with a new request."""


class NotOnSharedStore(KVStoreError, NotImplementedError):
    """The operation needs what only the embedded store has (journal, archive or lock files), not
    the shared one (PostgreSQL + S3); nothing was done. The reason names it; docs/SCALE.md lists
    what a replica serves."""


# ---- configuration ----------------------------------------------------------------------------
class ConfigError(KVStoreError, SettingError):
    """A configuration file or variable (API keys, sizes, the engine's tier) cannot be used as written.

    The reason names the setting and the form it takes. (A ``SettingError`` too: the error
    ``kvstore.config`` raises for a variable that does not parse, and a ``ValueError``.)
    """


# ---- encryption at rest (docs/SECURITY.md) ----------------------------------------------------
class SealBroken(IntegrityError):
    """Encrypted bytes failed authentication: a changed bit, a frame spliced or moved from another
    file, or another key. Nothing was decrypted into rows; the reason names the file and where.

    Restore the file from a backup, or cut the session back (``kvstore sessions repair``).
    ``first_record``: the first record of the refused frame, when known.
    """

    first_record: int | None = None


class KeyUnavailable(KVStoreError, PermissionError):
    """The key an encrypted store needs is not at hand: no key-encryption key given (``--kek-file``
    or ``KVSTORE_KEK``), another one than the keyring was wrapped with, or a store opened with
    encryption when it was created without (or the reverse). Nothing was read or written."""


class KeyShredded(SessionDamaged):
    """The owner's data keys were destroyed (``kvstore crypto shred``): the session's rows are
    unreadable by design, for good. Delete the session."""
