"""The HTTP service's own errors, and the HTTP status of every error kvstore raises.

Nothing below ``api`` knows HTTP: the lower layers raise typed errors (``kvstore.formats.errors``,
``kvstore.migrations.errors``, ``kvstore.errors``, ``kvstore.gpu.errors``,
``kvstore.engine.errors``) and :data:`HTTP_STATUS` says which status each answers with. A class
without an entry takes its nearest base's (resolved along the MRO, so ``SessionDamaged`` answers
like ``IntegrityError``); the root ``KVStoreError`` answers ``400`` only as a last resort, and
``tests/api/test_errors.py`` checks every error class of the project has a status decided here.
The GPU backends' errors are listed by dotted name: ``kvstore.gpu`` imports torch, which the
service loads only with an engine (an error of a module never imported never reaches it).

Every error response is ``{"error": <class name>, "reason": <what happened and what to do>}``.
"""

from __future__ import annotations

import math

from kvstore.engine.errors import (
    CacheError,
    CacheLayoutUnsupported,
    ConversationMismatch,
    GenerationError,
    ModelConfigError,
    RestoreFailed,
    ServerBusy,
    TierUnsupported,
    WeightsError,
)
from kvstore.errors import (
    BlobStoreError,
    BudgetExceeded,
    CodecMismatch,
    ConfigError,
    FileUnreadable,
    FingerprintMismatch,
    FormatError,
    GeometryMismatch,
    IdempotencyKeyReused,
    IndexFull,
    IndexIOError,
    IndexSchemaError,
    IntegrityError,
    InvalidRequest,
    InvalidSessionId,
    JournalClosed,
    JournalLocked,
    JournalWriteError,
    KeyUnavailable,
    KVStoreError,
    LeaseHeld,
    MigrationError,
    NonFiniteValues,
    NotOnSharedStore,
    PathRefused,
    RecordCountMismatch,
    SegmentLost,
    SessionExists,
    SessionNotFound,
    StaleLease,
    TooManySessions,
    Unavailable,
)

__all__ = [
    "HTTP_STATUS",
    "BodyTooLarge",
    "DuplicateJSONKey",
    "EngineNotLoaded",
    "InvalidParameter",
    "JobNotFound",
    "JobQueueFull",
    "ModelNotFound",
    "ServiceBusy",
    "SessionBusy",
    "Unauthorized",
    "UnsupportedMediaType",
    "UploadsBusy",
    "http_status",
    "retry_after",
]


# ---- errors only the HTTP service raises ------------------------------------------------------
class BodyTooLarge(KVStoreError, ValueError):
    """A request body is larger than the service accepts (``--max-body``); nothing was read past it.

    Send the rows in smaller appends (each is its own durable write).
    """


class DuplicateJSONKey(KVStoreError, ValueError):
    """A JSON body names the same key twice in one object (``{"n": 100, "n": 0}``).

    Which one a reader keeps differs between parsers, so the body is refused, never guessed: send
    every key once.
    """


class ServiceBusy(KVStoreError, RuntimeError):
    """The service is at one of its documented capacity limits; nothing was done.

    The answer carries ``Retry-After`` (seconds, :attr:`retry_after`): send the request again then.
    The limits are settings (``kvstore serve --max-jobs``, ``--session-waiters``; docs/API.md).
    """

    def __init__(self, reason: str, retry_after: int = 1):
        super().__init__(reason)
        self.retry_after = max(1, int(retry_after))


class JobQueueFull(ServiceBusy):
    """As many park, unpark and migrate jobs as the service queues are already waiting or running
    (service-wide, or for this owner); no job was queued. Retry after ``Retry-After`` seconds."""


class SessionBusy(ServiceBusy):
    """As many requests as the service lets wait for one session are already waiting for it; this one
    was refused at once, before doing anything. Retry after ``Retry-After`` seconds."""


class UploadsBusy(ServiceBusy):
    """The request bodies the service is holding (uploads being read or decoded) already fill its
    budget (``kvstore serve --max-inflight-bytes``); this one was refused before its body was read.
    Retry after ``Retry-After`` seconds (503: the service, not the caller, is short of memory)."""


class UnsupportedMediaType(KVStoreError, ValueError):
    """A request body's Content-Type is not one the endpoint reads; the reason lists those it does."""


class Unauthorized(KVStoreError, PermissionError):
    """A request carried no API key, or one the service does not know.

    Send ``Authorization: Bearer <key>`` (or ``X-API-Key: <key>``) with a key from ``keys.json`` or
    ``KVSTORE_API_KEYS``.
    """


class JobNotFound(KVStoreError, KeyError):
    """No job has this id for this owner (jobs live in memory: a restart forgets them).

    List the owner's jobs with ``GET /jobs``.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.reason


class EngineNotLoaded(KVStoreError, RuntimeError):
    """The service runs without a model: generation needs ``kvstore serve --model DIR``.

    The one 5xx by design: the request is sound, this server has no engine.
    """


class InvalidParameter(InvalidRequest):
    """A request parameter has a value this service does not accept, or is one it does not implement.

    ``param`` names the parameter (``messages[2].content``, ``logprobs``), ``code`` says what kind
    of refusal it is (``unsupported_parameter``, ``context_length_exceeded``): the OpenAI-compatible
    routes return both in their error object. Nothing was done; the reason says what is accepted.
    """

    def __init__(self, reason: str, param: str | None = None, code: str | None = None):
        super().__init__(reason)
        self.param = param
        self.code = code


class ModelNotFound(KVStoreError, LookupError):
    """A request names a model this server does not serve (the ``model`` of an OpenAI-style request).

    ``GET /v1/models`` lists the one it serves: send its id.
    """


# ---- the status of every error ----------------------------------------------------------------
#: Error class (or its dotted name, for modules imported lazily) -> HTTP status. Subclasses
#: inherit their nearest listed base's status.
HTTP_STATUS: dict[type[KVStoreError] | str, int] = {
    KVStoreError: 400,  # the fallback: every class below has its status decided explicitly
    # formats and migrations
    FormatError: 422,  # bytes or a tier name that do not follow the spec (UnknownTier included)
    NonFiniteValues: 422,  # rows with NaN/inf under --reject-nonfinite
    GeometryMismatch: 409,
    CodecMismatch: 409,
    MigrationError: 400,
    IndexSchemaError: 503,  # the index needs another kvstore version: nothing the request can change
    # journal and store
    JournalWriteError: 507,
    JournalLocked: 409,
    JournalClosed: 400,
    PathRefused: 400,
    SessionNotFound: 404,
    SessionExists: 409,
    InvalidSessionId: 400,
    InvalidRequest: 400,
    BudgetExceeded: 507,
    TooManySessions: 409,  # the owner's sessions (--max-sessions-per-owner): no retry helps until some go
    FingerprintMismatch: 409,
    IntegrityError: 409,  # SessionDamaged too
    IndexFull: 507,
    IndexIOError: 507,  # LMDB's I/O error: a write rolled back, like a journal's EIO
    ConfigError: 400,
    FileUnreadable: 400,  # a path the caller named (the CLI's file tools); FileDamaged is a FormatError (422)
    # the shared backend (docs/SCALE.md)
    Unavailable: 503,  # PostgreSQL or the object store down: IndexUnavailable, BlobStoreUnavailable (retry_after)
    KeyUnavailable: 503,  # the store's key-encryption key is not the keyring's (rotated): give the server the new one
    BlobStoreError: 502,  # the object store refused a request a retry cannot fix
    LeaseHeld: 409,  # another replica writes the session now
    StaleLease: 409,  # fenced: another replica took the session over (LeaseExpired too)
    RecordCountMismatch: 409,
    IdempotencyKeyReused: 422,  # the key came first with another request (as the Idempotency-Key draft says)
    SegmentLost: 503,  # the upload was collected before its commit: sending it again works
    NotOnSharedStore: 501,  # what needs journal files, asked of a shared store (docs/SCALE.md)
    # gpu (by name: importing kvstore.gpu imports torch)
    "kvstore.gpu.errors.AttentionInputError": 422,
    "kvstore.gpu.errors.BackendUnavailable": 503,
    "kvstore.gpu.errors.KernelBuildError": 500,  # the server's kernel source or compiler is broken, not the request
    # raised inside a serving engine's connector (stored rows it cannot load: it recomputes them)
    "kvstore.connectors.prefix_cache.LoadFailed": 409,
    "kvstore.connectors.store_client.ServiceError": 502,  # the kvstore service it calls refused or is down
    # engine
    ModelConfigError: 422,
    WeightsError: 422,
    TierUnsupported: 422,
    CacheError: 409,
    GenerationError: 422,
    CacheLayoutUnsupported: 422,
    ConversationMismatch: 409,
    RestoreFailed: 503,
    ServerBusy: 429,  # the scheduler's turns in flight, for the owner or in all (retry_after)
    # the service's own
    BodyTooLarge: 413,
    ServiceBusy: 429,
    JobQueueFull: 429,
    SessionBusy: 429,
    UploadsBusy: 503,
    DuplicateJSONKey: 422,
    UnsupportedMediaType: 415,
    Unauthorized: 401,
    JobNotFound: 404,
    EngineNotLoaded: 503,
    InvalidParameter: 400,
    ModelNotFound: 404,
}


def retry_after(error: KVStoreError) -> int | None:
    """The ``Retry-After`` seconds of an answer to ``error`` (None: the header is not sent): a capacity
    limit (429), a server of the shared store down (503), another replica's write lease (409), or a
    session another request is changing past the lock timeout (409, one second: it is busy now)."""
    if isinstance(error, JournalLocked):
        return 1
    seconds = getattr(error, "retry_after", None)
    if not isinstance(error, (ServiceBusy, ServerBusy, Unavailable, LeaseHeld)) or seconds is None:
        return None
    return max(1, math.ceil(seconds))


def dotted_name(cls: type) -> str:
    """``module.QualifiedName`` of a class: how :data:`HTTP_STATUS` names lazily imported errors."""
    return f"{cls.__module__}.{cls.__qualname__}"


def status_entry(error: KVStoreError | type[KVStoreError]) -> type[KVStoreError] | str:
    """The :data:`HTTP_STATUS` key deciding ``error``'s status: its nearest listed base (or its name)."""
    cls = error if isinstance(error, type) else type(error)
    for base in cls.__mro__:
        if base in HTTP_STATUS:
            return base
        if dotted_name(base) in HTTP_STATUS:
            return dotted_name(base)
    raise TypeError(f"{cls.__name__} is not a KVStoreError")


def http_status(error: KVStoreError | type[KVStoreError]) -> int:
    """The HTTP status an error (instance or class) answers with.

    >>> http_status(SessionNotFound("no session 'x'")), http_status(IntegrityError)
    (404, 409)
    """
    return HTTP_STATUS[status_entry(error)]
