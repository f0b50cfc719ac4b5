"""The session-store interface every backend implements, and the one factory callers get a backend from.

:class:`Store` is the interface: the calls the service's routes, the command line, the engine and
the connectors make, with the value types of :mod:`kvstore.store.values` and
:mod:`kvstore.store.results`. Two backends implement it: :class:`~kvstore.store.SessionStore`
(embedded: LMDB + journals in a data folder) and
:class:`~kvstore.store.shared.sessions.SharedSessionStore` (PostgreSQL + S3, imported only when a
shared store is opened). What a backend can do is data on its class, :attr:`Store.capabilities`
(names from :data:`CAPABILITIES`); a call needing a capability the backend lacks raises
:class:`~kvstore.errors.NotOnSharedStore` naming it, and changes nothing. :class:`Reader` is what
:meth:`Store.reader` returns on either backend.

:func:`open` picks the backend: a data folder alone is the embedded store, an index URL and a blobs
URL are the shared one. :func:`interface_drift` lists where a backend's methods differ from the
interface (the store conformance suite fails on any).
"""

from __future__ import annotations

import inspect
import os
import typing
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, TypeVar, overload

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.formats.coli_kv import Geometry, Header, KVRecords
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S
from kvstore.store.results import (
    AppendResult,
    CacheCounts,
    Eviction,
    Expiry,
    LookupResult,
    RepairReport,
    Resumed,
    SessionCounts,
    VerifyReport,
)
from kvstore.store.stats import StoreStats
from kvstore.store.values import Fingerprint, ModelInfo, Progress, SessionInfo
from kvstore.tiers import Tier

if TYPE_CHECKING:
    from kvstore.crypto.kek import KeyProvider
    from kvstore.store.session_store import SessionStore

#: Every capability a backend may declare in :attr:`Store.capabilities`, and the calls it covers.
CAPABILITIES: dict[str, str] = {
    "park": "park and unpark (a session's rows compressed, and back)",
    "repair": "repair (drop a torn tail and every record from the first bad turn on)",
    "migrate": "migrate (a session's rows rewritten in another tier)",
    "hard_limit": "a hard limit on the bytes stored (hard_limit_bytes)",
    "journal_files": "journal and archive files (journal_path, archive_path)",
}

#: Expired sessions one :meth:`Store.expire` call deletes at most (a sweep calls it again while a
#: batch comes back full).
EXPIRE_BATCH = 100

_StoreT = TypeVar("_StoreT", bound="Store")
_ReaderT = TypeVar("_ReaderT", bound="Reader")


class Reader(ABC):
    """An open, consistent view of a session's records ``[0, n_records)`` for resuming: what
    :meth:`Store.reader` returns. Close it (or use ``with``) to release what it holds.

    Attributes
    ----------
    info : SessionInfo — the session as it was when the reader opened
    n_records : records served (the watermark, or less after a failed verify) = reused tokens
    record_bytes : bytes per record
    verified : whether the turns were re-hashed before serving
    damaged_from : first record of the first bad turn, when verify found one
    """

    n_records: int
    record_bytes: int
    verified: bool
    damaged_from: int | None

    @property
    @abstractmethod
    def info(self) -> SessionInfo:
        """The session as it was when the reader opened."""

    @property
    def reused_tokens(self) -> int:
        return self.n_records

    @property
    def body_bytes(self) -> int:
        return self.n_records * self.record_bytes

    def header_bytes(self) -> bytes:
        """A ``.coli_kv`` header for the served records (nrec = ``n_records``)."""
        return Header(self.info.geometry, self.info.tier, self.n_records).to_bytes()

    @abstractmethod
    def iter_bytes(self, chunk_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The served records' raw bytes, in chunks of whole records (``chunk_bytes`` bytes at most
        when it holds one; None: the backend's own size). A chunk is bytes-like (``bytes`` or a
        ``memoryview``, which a server sends without copying it); it stays valid once the next is
        taken."""

    @abstractmethod
    def load(self, *, strict: bool = False) -> KVRecords:
        """All served records (KVRecords, ``n = n_records``); ``strict``: see :meth:`check_scales`."""

    @abstractmethod
    def read_into(self, out: np.ndarray, start: int, count: int) -> int:
        """Served records ``[start, start + count)`` into ``out`` (u8, at least ``count`` records
        long); returns ``count``."""

    @abstractmethod
    def iter_batches(self, batch_records: int, *, strict: bool = False) -> Iterator[KVRecords]:
        """Served records as KVRecords batches of ``batch_records`` each, the last one shorter."""

    @abstractmethod
    def check_scales(self, records: np.ndarray, first_record: int) -> None:
        """Refuse served records holding a scale or radius no encoder writes (``SessionDamaged``)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the reader holds (counted as one restore if records were read)."""

    def __enter__(self: _ReaderT) -> _ReaderT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(ABC):
    """Sessions of MLA latent KV rows: the interface both backends implement (see the module docstring).

    Session ids are per owner: every method that takes ``owner`` acts on that owner's session
    only, so another owner's session is missing (:class:`SessionNotFound`, the same reason as an id
    nobody has); ``owner=None`` acts as any owner and refuses an id several owners have
    (:class:`InvalidRequest`). Each backend documents its own behaviour on its class.
    """

    #: What this backend can do (names of :data:`CAPABILITIES`); the calls of a missing one raise
    #: :class:`~kvstore.errors.NotOnSharedStore` naming it.
    capabilities: ClassVar[frozenset[str]]
    #: Whether a resume re-hashes each turn it serves even without ``verify`` (a silent bit flip is
    #: then refused with ``IntegrityError`` instead of served).
    hashes_every_read: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = getattr(cls, "capabilities", None)
        if not isinstance(declared, frozenset) or not declared <= set(CAPABILITIES):
            raise TypeError(
                f"{cls.__name__}.capabilities must be a frozenset of {sorted(CAPABILITIES)}, got {declared!r}"
            )

    @classmethod
    def supports(cls, capability: str) -> bool:
        """Whether this backend has ``capability`` (a name of :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise InvalidRequest(f"unknown store capability {capability!r}: one of {sorted(CAPABILITIES)}")
        return capability in cls.capabilities

    @classmethod
    def lacks(cls) -> frozenset[str]:
        """The capabilities this backend does not have."""
        return frozenset(CAPABILITIES) - cls.capabilities

    def keys_destroyed_at(self, owner: str) -> float | None:
        """When ``owner``'s data keys were destroyed (``kvstore crypto shred``, seconds since the
        epoch) on a store encrypted at rest; None on a plaintext store or before any shred. Each
        backend's ``keyring`` answers (an embedded one with a ``stat``, a shared one with a query)."""
        keyring = getattr(self, "keyring", None)
        return None if keyring is None else keyring.shredded().get(owner)

    # ------------------------------------------------------------------ lifecycle, limits, counts
    @abstractmethod
    def close(self) -> None:
        """Release the backend's files and connections."""

    def __enter__(self: _StoreT) -> _StoreT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    @abstractmethod
    def data_dir(self) -> Path:
        """The store's local folder."""

    @property
    @abstractmethod
    def budget_bytes(self) -> int | None:
        """The soft budget kept by LRU eviction (None: no eviction)."""

    @property
    @abstractmethod
    def hard_limit_bytes(self) -> int | None:
        """Writes that would cross it are refused with ``BudgetExceeded`` (None: no limit)."""

    @property
    @abstractmethod
    def lock_timeout(self) -> float:
        """Seconds a write waits for a session another writer holds."""

    @property
    @abstractmethod
    def max_sessions_per_owner(self) -> int | None:
        """The most sessions one owner may have: a create or fork past it is refused with
        ``TooManySessions``, nothing created (None: no cap)."""

    @property
    @abstractmethod
    def stats(self) -> StoreStats:
        """This store's counts of lookups, restores, appends, lock waits and evictions."""

    @property
    @abstractmethod
    def reconcile_actions(self) -> list[str]:
        """What the store repaired when it opened (one line each)."""

    @abstractmethod
    def schema_version(self) -> int:
        """The version of the index's schema."""

    @abstractmethod
    def cache_counts(self) -> CacheCounts | None:
        """A local cache's counts (None: the backend keeps no cache)."""

    # ------------------------------------------------------------------ reading the index
    @abstractmethod
    def get(self, session_id: str, *, owner: str | None = None) -> SessionInfo:
        """The session as the index holds it."""

    @abstractmethod
    def list(
        self,
        *,
        owner: str | None = None,
        model_name: str | None = None,
        tags: Iterable[str] = (),
        state: str | None = None,
        fingerprint: Fingerprint | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> list[SessionInfo]:
        """Sessions matching every filter given (all ``tags`` must be present), oldest first
        (by creation time, then key).

        ``limit``: at most that many (a page; None: every one). ``after``: the :attr:`SessionInfo.cursor`
        of the last session of the page before; the list goes on from just after it, read from the
        index's order without reading the sessions before it (``InvalidCursor`` for text that is not
        a cursor). Paging through a store changed meanwhile gives every session that existed
        throughout exactly once; one created meanwhile comes at the end.
        """

    @abstractmethod
    def counts(self, *, owner: str | None = None) -> SessionCounts:
        """Sessions and their bytes by state and by tier, of ``owner`` (None: every owner), as the
        index keeps them: read without going through the sessions."""

    @abstractmethod
    def existing(self, session_ids: Iterable[str], *, owner: str) -> set[str]:
        """Which of ``session_ids`` ``owner`` has (one index read for them all, no scan)."""

    @abstractmethod
    def usage(self) -> dict[str, int | None]:
        """``used_bytes``, ``reserved_bytes``, ``budget_bytes``, ``hard_limit_bytes``."""

    def usage_by_tier(self) -> dict[str, dict[str, int]]:
        """Per tier name: ``{"bytes": ..., "sessions": ...}`` (:meth:`counts`' tiers)."""
        return {tier: entry.to_dict() for tier, entry in self.counts().by_tier.items()}

    # ------------------------------------------------------------------ writing
    @abstractmethod
    def create(
        self,
        owner: str,
        geometry: Geometry,
        tier: Tier,
        model: ModelInfo | dict[str, Any],
        *,
        session_id: str | None = None,
        tags: Iterable[str] = (),
        ttl_s: float | None = None,
    ) -> SessionInfo:
        """Create an empty session; ``ttl_s``: its own time-to-live (see :meth:`set_ttl`; None: its
        owner's, if any)."""

    @abstractmethod
    def append(
        self,
        session_id: str,
        tokens,
        L,
        R,
        I=None,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
        reject_nonfinite: bool = False,
    ) -> AppendResult:
        """Append rows (int32 tokens[k], f32 L[n_layers,k,kv_lora], R[n_layers,k,qk_rope], I), encoded
        in the session's tier."""

    @abstractmethod
    def append_records(
        self,
        session_id: str,
        records: np.ndarray | bytes | bytearray | memoryview,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
        reject_nonfinite: bool = False,
    ) -> AppendResult:
        """Append already-encoded records of the session's tier."""

    @abstractmethod
    def truncate(self, session_id: str, n_records: int, *, owner: str | None = None) -> SessionInfo:
        """Keep the first ``n_records`` records."""

    @abstractmethod
    def fork(
        self,
        session_id: str,
        *,
        at: int | None = None,
        new_id: str | None = None,
        owner: str | None = None,
        tags: Iterable[str] | None = None,
    ) -> SessionInfo:
        """A new session holding the first ``at`` records (default: the watermark)."""

    @abstractmethod
    def delete(self, session_id: str, *, owner: str | None = None) -> None:
        """Remove a session and everything stored for it."""

    @abstractmethod
    def set_tags(self, session_id: str, tags: Iterable[str], *, owner: str | None = None) -> SessionInfo:
        """Replace a session's tags."""

    # ------------------------------------------------------------------ expiry
    @abstractmethod
    def set_ttl(self, session_id: str, ttl_s: float | None, *, owner: str | None = None) -> SessionInfo:
        """Set a session's own time-to-live in seconds (None: drop it, its owner's applies, if any).

        A session expires ``ttl`` seconds after its last use (create, append, resume, this call):
        ``SessionInfo.expires_at``. An expired session is gone to every call at once
        (``SessionNotFound``, as a missing id), whether or not :meth:`expire` deleted it yet.
        """

    @abstractmethod
    def owner_ttl(self, owner: str) -> float | None:
        """``owner``'s default time-to-live in seconds (None: none)."""

    @abstractmethod
    def set_owner_ttl(self, owner: str, ttl_s: float | None) -> int:
        """Set (None: drop) the time-to-live of ``owner``'s sessions that have none of their own,
        counted from each one's last use; returns how many sessions it applies to now."""

    @abstractmethod
    def expire(self, *, limit: int = EXPIRE_BATCH) -> list[Expiry]:
        """Delete at most ``limit`` expired sessions, soonest expired first, as a delete does (their
        files or objects go); a session in use (a writer, a reader, a lease) or used again since it
        was found expired is kept. What was deleted (the sweep's metrics count it)."""

    # ------------------------------------------------------------------ resuming
    @abstractmethod
    def reader(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> Reader:
        """Open a session for resuming (unparking it if parked)."""

    @abstractmethod
    def resume(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> Resumed:
        """A session's records up to its watermark, in one load."""

    @abstractmethod
    def last_turn_digest(self, info: SessionInfo) -> bytes:
        """The hash of the session's last turn (b"" before the first)."""

    @abstractmethod
    def verify(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every turn against the hashes the index holds."""

    @abstractmethod
    def lookup(self, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
        """The owner's session (same fingerprint) sharing the longest token prefix with ``tokens``."""

    @abstractmethod
    def inspect(self, session_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """What the session's stored image holds: header fields, sizes, what a loader would neutralize."""

    # ------------------------------------------------------------------ parking, budget, file tools
    @abstractmethod
    def park(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Compress a session's rows (capability ``park``)."""

    @abstractmethod
    def unpark(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Store a parked session's rows plain again (capability ``park``)."""

    @abstractmethod
    def enforce_budget(self, *, keep: Iterable[str] = (), progress: Progress | None = None) -> list[Eviction]:
        """Evict least recently used sessions until the store fits ``budget_bytes``."""

    @abstractmethod
    def repair(
        self, session_id: str, *, owner: str | None = None, dry_run: bool = False, progress: Progress | None = None
    ) -> RepairReport:
        """Drop what cannot be trusted (capability ``repair``)."""

    @abstractmethod
    def migrate(
        self,
        session_id: str,
        tier: Tier,
        *,
        owner: str | None = None,
        progress: Progress | None = None,
    ) -> SessionInfo:
        """Rewrite a session's rows in another tier (capability ``migrate``)."""

    @abstractmethod
    def reconcile(self) -> list[str]:
        """Make the index agree with what is stored; one line per repair made."""

    @abstractmethod
    def journal_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """The session's journal file (capability ``journal_files``)."""

    @abstractmethod
    def archive_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """The session's archive file (capability ``journal_files``)."""


# ---------------------------------------------------------------------------- the factory
@overload
def open(
    data_dir: str | os.PathLike,
    *,
    index_url: None = None,
    blobs_url: None = None,
    budget_bytes: int | None = None,
    hard_limit_bytes: int | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    map_size: int | None = None,
    reconcile: bool = True,
    progress: Progress | None = None,
    lease_ttl: None = None,
    cache_bytes: None = None,
    create: bool = True,
    max_sessions_per_owner: int | None = None,
    kek: KeyProvider | None = None,
) -> SessionStore: ...


@overload
def open(
    data_dir: str | os.PathLike | None = None,
    *,
    index_url: str,
    blobs_url: str,
    budget_bytes: int | None = None,
    hard_limit_bytes: int | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    map_size: None = None,
    reconcile: bool = True,
    progress: None = None,
    lease_ttl: float | None = None,
    cache_bytes: int | None = None,
    create: bool = True,
    max_sessions_per_owner: int | None = None,
    kek: KeyProvider | None = None,
) -> Store: ...


@overload
def open(
    data_dir: str | os.PathLike | None = None,
    *,
    index_url: str | None = None,
    blobs_url: str | None = None,
    budget_bytes: int | None = None,
    hard_limit_bytes: int | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    map_size: int | None = None,
    reconcile: bool = True,
    progress: Progress | None = None,
    lease_ttl: float | None = None,
    cache_bytes: int | None = None,
    create: bool = True,
    max_sessions_per_owner: int | None = None,
    kek: KeyProvider | None = None,
) -> Store: ...


def open(
    data_dir: str | os.PathLike | None = None,
    *,
    index_url: str | None = None,
    blobs_url: str | None = None,
    budget_bytes: int | None = None,
    hard_limit_bytes: int | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    map_size: int | None = None,
    reconcile: bool = True,
    progress: Progress | None = None,
    lease_ttl: float | None = None,
    cache_bytes: int | None = None,
    create: bool = True,
    max_sessions_per_owner: int | None = None,
    kek: KeyProvider | None = None,
) -> Store:
    """Open the session store the arguments name: the one place a backend is chosen.

    Parameters
    ----------
    data_dir : the embedded store's folder (created 0700), required without ``index_url``; with it,
        the replica's local folder for its segment cache (None: no local folder, no cache)
    index_url, blobs_url : ``postgresql://USER@HOST:PORT/DB`` and ``s3://BUCKET/PREFIX``: both (the
        shared store; needs the ``shared`` extra) or neither (the embedded store)
    budget_bytes : soft budget kept by LRU eviction (None: none)
    hard_limit_bytes : writes that would cross it are refused with ``BudgetExceeded`` (None: none)
    lock_timeout : seconds a write waits for a session another writer (or replica) holds
    map_size : the embedded index's LMDB map size in bytes (None: its default); embedded only
    reconcile : repair the embedded index from the journals on open (the shared index has nothing
        to reconcile: a commit is one transaction)
    progress : ``(done, total)`` for the embedded index's schema upgrades on open; embedded only
    lease_ttl : seconds a shared write lease lasts (None: its default); shared only
    cache_bytes : the replica's segment cache budget (None: its default, 0: none); shared only
    create : make the embedded store when ``data_dir`` holds none (False: refuse, creating nothing)
    max_sessions_per_owner : the most sessions one owner may have; a create or fork past it is
        refused with ``TooManySessions`` (None: no cap)
    kek : the key-encryption key of a store encrypted at rest (``kvstore.crypto.KeyProvider``;
        docs/SECURITY.md): a new store is created encrypted, an encrypted one needs it (None: a
        plaintext store, unless the store or ``KVSTORE_ENCRYPT`` says otherwise: then the KEK the
        settings name); on a shared store the wrapped data keys live in the index, so every
        replica given the KEK sees them

    Returns
    -------
    Store — :class:`~kvstore.store.SessionStore` or
    :class:`~kvstore.store.shared.sessions.SharedSessionStore`; close it (or use ``with``).

    Raises
    ------
    InvalidRequest : one URL without the other, no data folder for the embedded store, an option
        of the other backend, a limit that is not a non-negative number of bytes (or, for the cap,
        a positive number of sessions); with ``create=False``, a data folder that holds no store
    """
    if (index_url is None) != (blobs_url is None):
        raise InvalidRequest("name both the shared index (index_url) and the object store (blobs_url), or neither")
    if index_url is not None and blobs_url is not None:
        given = [name for name, value in (("map_size", map_size), ("progress", progress)) if value is not None]
        if given:
            raise InvalidRequest(f"{', '.join(given)}: options of the embedded store, not of a shared one")
        from kvstore.store.shared.sessions import SharedSessionStore

        options: dict[str, Any] = {}
        if lease_ttl is not None:
            options["lease_ttl"] = lease_ttl
        if cache_bytes is not None:
            options["cache_bytes"] = cache_bytes
        return SharedSessionStore(
            index_url,
            blobs_url,
            data_dir=data_dir,
            lock_timeout=lock_timeout,
            budget_bytes=budget_bytes,
            hard_limit_bytes=hard_limit_bytes,
            max_sessions_per_owner=max_sessions_per_owner,
            kek=kek,
            **options,
        )
    given = [name for name, value in (("lease_ttl", lease_ttl), ("cache_bytes", cache_bytes)) if value is not None]
    if given:
        raise InvalidRequest(
            f"{', '.join(given)}: options of a shared store (index_url, blobs_url), not of a data folder"
        )
    if data_dir is None:
        raise InvalidRequest("name the store's data folder (or a shared store's index_url and blobs_url)")
    if not create:
        from kvstore.store.context import missing_store

        why = missing_store(data_dir)
        if why is not None:
            raise InvalidRequest(f"{data_dir}: no session store there ({why}); nothing was created")
    from kvstore.store.index import DEFAULT_MAP_SIZE
    from kvstore.store.session_store import SessionStore

    return SessionStore(
        data_dir,
        budget_bytes=budget_bytes,
        hard_limit_bytes=hard_limit_bytes,
        map_size=DEFAULT_MAP_SIZE if map_size is None else map_size,
        lock_timeout=lock_timeout,
        reconcile=reconcile,
        progress=progress,
        max_sessions_per_owner=max_sessions_per_owner,
        kek=kek,
    )


def check_session_cap(value: Any) -> int | None:
    """``max_sessions_per_owner`` as both backends take it: a positive integer, or None (no cap)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequest(f"max_sessions_per_owner must be a positive number of sessions, not {value!r}")
    return value


def check_page(limit: Any) -> int | None:
    """A list's ``limit`` as both backends take it: a positive integer, or None (every session)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1):
        raise InvalidRequest(f"limit must be a positive number of sessions, not {limit!r}")
    return None if limit is None else int(limit)


# ---------------------------------------------------------------------------- the interface, checked
def _parameters(function: Any) -> list[tuple[str, Any, Any, Any]]:
    """``(name, kind, default, annotation)`` of each parameter but ``self``, annotations resolved
    where the function's module can resolve them (else as written)."""
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # a name only imported for type checkers: compare the annotation as written
        hints = {}
    out = []
    for parameter in list(inspect.signature(function).parameters.values())[1:]:
        annotation = hints.get(parameter.name, parameter.annotation)
        out.append((parameter.name, parameter.kind, parameter.default, annotation))
    return out


def interface_drift(backend: type, interface: type = Store) -> list[str]:
    """Where ``backend`` differs from ``interface``: one line per interface method or property it
    does not implement, or implements with other parameters (names, kinds, defaults or annotations,
    in order; a return type may be narrower). Empty: the backend keeps the interface."""
    problems = []
    for name, declared in sorted(vars(interface).items()):
        # an abstract method or property (a property is abstract when its getter is), or the context manager
        if not getattr(declared, "__isabstractmethod__", False) and name not in ("__enter__", "__exit__"):
            continue
        found = inspect.getattr_static(backend, name, None)
        if found is None or getattr(found, "__isabstractmethod__", False):
            problems.append(f"{backend.__name__}.{name}: missing")
            continue
        if isinstance(declared, property):
            if not isinstance(found, property):
                problems.append(f"{backend.__name__}.{name}: a property in {interface.__name__}, not here")
            continue
        if not callable(found):
            problems.append(f"{backend.__name__}.{name}: not a method")
            continue
        ours, theirs = _parameters(declared), _parameters(found)
        if [p[:3] for p in ours] != [p[:3] for p in theirs]:
            problems.append(
                f"{backend.__name__}.{name}{inspect.signature(found)} differs from "
                f"{interface.__name__}.{name}{inspect.signature(declared)}"
            )
            continue
        for (pname, _, _, want), (_, _, _, got) in zip(ours, theirs):
            if got is not inspect.Parameter.empty and want is not inspect.Parameter.empty and got != want:
                problems.append(f"{backend.__name__}.{name}: parameter {pname} is {got!r}, the interface says {want!r}")
    return problems
