# Over 700 lines: one class implementing the whole store interface (the routes call it as they call the embedded store); its heavy parts already live beside it (reading, rewrites, transfer, upkeep, keys), what stays is each method's lease, fencing and index transaction, read together.
"""The session interface the service calls, over the shared backend (``kvstore serve --index --blobs``).

:class:`SharedSessionStore` implements the store interface (:class:`~kvstore.store.base.Store`)
the embedded :class:`~kvstore.store.SessionStore` implements — create, get, list, set_tags, delete,
append (raw records or arrays), reader / resume (a :class:`~kvstore.store.base.Reader`), usage,
stats — with the same value types (:mod:`kvstore.store.values`, :mod:`kvstore.store.results`), so
the routes do not know which backend they talk to — fork, truncate, prefix lookup, verify, inspect,
park, unpark, repair, migrate and both budgets included (the store conformance suite,
``tests/conformance/store.py``, runs on both; the maintenance operations are
:class:`~kvstore.store.shared.upkeep.Upkeep`'s). What it cannot have (journal, archive and lock
files: a session is objects; :attr:`SharedSessionStore.capabilities` lacks ``journal_files``)
raises :class:`NotOnSharedStore`, naming it (:func:`not_on_shared_store`).

Writes follow docs/SCALE.md: every append takes the session's lease (waiting up to
``lock_timeout`` while another replica holds it), uploads a segment, commits it fenced by the
lease's token, then releases the lease so the next append may come through any replica. An append
whose commit got no answer (PostgreSQL down) keeps its lease and the attempt in doubt: the
client's retry of the same bytes settles it, so it is appended exactly once; with an idempotency
key (:data:`CURRENT_REQUEST`) a retry through any other replica answers the first result too.

Why this file is over 700 lines: it is one class, the interface's ~50 methods each a short
delegation to the index, the segment store, the readers or the upkeep; the work itself lives in
those modules, and cutting the class would only split the interface across files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from kvstore import config as settings
from kvstore.crypto.kek import KeyProvider
from kvstore.errors import (
    InvalidRequest,
    KVStoreError,
    LeaseHeld,
    NotOnSharedStore,
    SessionExists,
    SessionNotFound,
    StaleLease,
    TooManySessions,
    Unavailable,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S
from kvstore.store.base import CAPABILITIES, EXPIRE_BATCH, Store, check_page, check_session_cap
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
    check_fingerprint,
    checked_override,
    finish_rotation,
    refuse_nonfinite,
)
from kvstore.store.shared import recode
from kvstore.store.shared.cache import DEFAULT_CACHE_BYTES, SegmentCache
from kvstore.store.shared.index import SharedIndex
from kvstore.store.shared.keys import SegmentSealer, SharedKeyring, attach
from kvstore.store.shared.reading import SharedReader, validated
from kvstore.store.shared.reports import inspect_session, longest_prefix, record_of, verify_session
from kvstore.store.shared.store import (
    DEFAULT_TTL_S,
    Lease,
    RequestKey,
    SharedStore,
    default_holder,
    fingerprint_key_of,
)
from kvstore.store.shared.upkeep import Upkeep
from kvstore.store.stats import StoreStats
from kvstore.store.values import (
    Fingerprint,
    ListCursor,
    ModelInfo,
    Progress,
    SessionFilter,
    SessionInfo,
    check_ttl,
    public_id,
    storage_key,
    validate_owner,
    validate_session_id,
    validate_tags,
)
from kvstore.tiers import Tier

log = logging.getLogger("kvstore.store")


@dataclass
class AppendRequest:
    """What the service knows of the append request being served: the client's idempotency key and,
    once answered, whether the answer was replayed from an earlier request with that key."""

    key: RequestKey
    replayed: bool = False


#: The idempotency key of the append request this context serves (set by the replica's HTTP layer
#: from ``Idempotency-Key``, read by :meth:`SharedSessionStore.append_records` and ``append``):
#: the routes call the same methods on both backends, so the key travels beside the call.
CURRENT_REQUEST: ContextVar[AppendRequest | None] = ContextVar("kvstore_append_request", default=None)

#: What the shared store serves, as :class:`NotOnSharedStore` reasons list it.
SERVED = (
    "create, list, get, tags, append, resume, truncate, fork, prefix lookup, verify, inspect, park, unpark, "
    "repair, migrate and delete"
)


def not_on_shared_store(what: str) -> NotOnSharedStore:
    """The one error for an operation the shared store does not have; ``what`` names it."""
    return NotOnSharedStore(
        f"{what} are not on the shared store (PostgreSQL + S3: a session is objects); a replica serves {SERVED} "
        "(docs/SCALE.md)"
    )


class SharedSessionStore(Store):
    """Sessions of the shared store, through the interface the service uses.

    Parameters
    ----------
    index_url : ``postgresql://USER@HOST:PORT/DB``
    blobs_url : ``s3://BUCKET/PREFIX`` (endpoint and credentials from ``AWS_*``)
    data_dir : the replica's local folder (created 0700): its cache of segment objects
        (:class:`~kvstore.store.shared.cache.SegmentCache`); nothing in it is needed to serve, so a
        replica may start with it empty; None: no local folder and no cache (a command-line tool's use)
    lease_ttl : seconds a write lease lasts; a replica killed mid-append holds a session that long
    lock_timeout : seconds an append waits for a lease another replica holds (then 409 LeaseHeld)
    cache_bytes : the cache's size budget (0: no cache)
    budget_bytes : the whole shared store's budget (None: none): after each write the least recently
        used sessions of every replica are deleted until the store fits it (:meth:`enforce_budget`)
    hard_limit_bytes : the whole shared store's hard limit (None: none): a write that would take it
        past is refused with :class:`BudgetExceeded`, nothing written (checked in the commit
        transaction, serialized across replicas; give every replica the same limit)
    max_sessions_per_owner : the most sessions one owner may have (None: no cap): a create or fork
        past it is refused with :class:`TooManySessions`, nothing created (counted by the index in
        the transaction that inserts the session, serialized per owner across replicas)

    Raises
    ------
    InvalidRequest : a limit that is not a non-negative number of bytes
    """

    capabilities = frozenset(CAPABILITIES) - {"journal_files"}  # a session is segment objects, not files
    hashes_every_read = True  # a segment is fetched whole and checked against its digest (docs/SCALE.md)

    def __init__(
        self,
        index_url: str,
        blobs_url: str,
        *,
        data_dir: str | os.PathLike | None = settings.DATA_DIR.value,
        lease_ttl: float = DEFAULT_TTL_S,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        budget_bytes: int | None = None,
        hard_limit_bytes: int | None = None,
        max_sessions_per_owner: int | None = None,
        kek: KeyProvider | None = None,
    ):
        for name, value in (("budget_bytes", budget_bytes), ("hard_limit_bytes", hard_limit_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidRequest(f"{name} must be a non-negative number of bytes")
        self._data_dir = Path(data_dir) if data_dir is not None else None
        if self._data_dir is not None:
            self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache = SegmentCache(self._data_dir, cache_bytes) if cache_bytes > 0 and self._data_dir is not None else None
        self.shared = SharedStore.connect(index_url, blobs_url, ttl=lease_ttl, cache=cache)
        self.shared.hard_limit = hard_limit_bytes
        self.shared.max_sessions = check_session_cap(max_sessions_per_owner)
        # encrypted at rest when the index says so (or a KEK makes a new store so): keys.attach. With
        # PostgreSQL down the replica starts anyway, as it does plaintext: the first write or sealed
        # read attaches (and, without the KEK an encrypted store needs, is refused then)
        self._keyring: SharedKeyring | None = None
        self._kek = kek
        self._attach_lock = threading.Lock()
        try:
            self._attach()
        except Unavailable:
            self.shared.pending = self._attach
        except BaseException:
            self.shared.close()
            raise
        self._lock_timeout = lock_timeout
        self.holder = default_holder()  # this replica, as the leases name it
        self._stats = StoreStats()
        self._budget_bytes = budget_bytes
        self._hard_limit_bytes = hard_limit_bytes
        self._upkeep = Upkeep(self)
        self._writers: dict[str, list] = {}  # key -> [lock, users]: one append per session at a time here
        self._writers_lock = threading.Lock()
        self._in_doubt: dict[str, Lease] = {}  # leases kept by an append whose commit got no answer

    def close(self) -> None:
        if self._keyring is not None:
            self._keyring.forget()
        self.shared.close()

    # ------------------------------------------------------------------ encryption at rest (kvstore.store.shared.keys)
    def _attach(self) -> None:
        with self._attach_lock:
            if self._keyring is None:
                self._keyring = attach(self.shared.index, self._kek)
                if self._keyring is not None:
                    self.shared.encrypt(SegmentSealer(self._keyring))
            self.shared.pending = None

    @property
    def keyring(self) -> SharedKeyring | None:
        """The owners' data keys of a store encrypted at rest, in the shared index (None: plaintext,
        or not known yet: PostgreSQL was down at open and nothing was written or read since)."""
        return self._keyring

    @property
    def encrypted(self) -> bool:
        return self.keyring is not None

    def _keys(self) -> SharedKeyring:
        if self.shared.pending is not None:
            self.shared.pending()
        keyring = self._keyring
        if keyring is None:
            raise InvalidRequest("this shared store is not encrypted at rest (open it with a KEK)")
        return keyring

    def key_versions_in_use(self, owner: str) -> dict[int, int]:
        """Data-key version -> how many of ``owner``'s segment rows are sealed under it."""
        validate_owner(owner)
        rows = self.shared.index.run(
            "counting sealed segments",
            lambda conn: conn.execute(
                "SELECT g.key_version, count(*) FROM kv_segments g JOIN kv_sessions s ON s.key = g.key "
                "WHERE s.owner = %s AND g.key_version IS NOT NULL GROUP BY g.key_version",
                (owner,),
            ).fetchall(),
        )
        return {int(v): int(n) for v, n in rows}

    def shred_owner(self, owner: str) -> int:
        """Destroy every data key of ``owner`` in the shared index (:meth:`SharedKeyring.shred`):
        every object of the owner, in the bucket, in every replica's cache and in every backup, is
        unreadable from then on, untouched; every replica stops serving it at its next request.
        Returns the key versions destroyed. The sessions stay listed (damaged on read) until deleted."""
        validate_owner(owner)
        return self._keys().shred(owner)

    def rotate_data_key(self, owner: str, *, rewrite: bool = True) -> dict[str, Any]:
        """A new data-key version for ``owner``: every object written from now on (appends, forks'
        cut segments, park, unpark, migrate) is sealed under it at once. With ``rewrite``, each of
        the owner's sessions then has its older objects resealed under it (``recode.reseal``), one
        session at a time under its lease (any replica keeps serving it, and every other session);
        versions no segment uses any longer are retired (destroyed). A session that could not be
        rewritten is named in ``skipped`` and keeps its version, which then stays."""
        keyring = self._keys()
        validate_owner(owner)
        version = keyring.rotate(owner)
        resealed, skipped = [], []
        for row in self.index.sessions(owner) if rewrite else ():
            key = str(row["key"])

            def again(lease: Lease) -> None:
                recode.reseal(self.shared, lease, version, hard_limit=self.hard_limit_bytes)

            try:
                self._under_lease(key, again)
                resealed.append(public_id(key))
            except KVStoreError as exc:
                skipped.append(f"{public_id(key)}: {exc.reason}")
        return finish_rotation(keyring, owner, version, self.key_versions_in_use(owner), resealed, skipped)

    def __enter__(self) -> "SharedSessionStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def lock_timeout(self) -> float:
        return self._lock_timeout

    @property
    def stats(self) -> StoreStats:
        return self._stats

    @property
    def max_sessions_per_owner(self) -> int | None:
        return self.shared.max_sessions

    @property
    def budget_bytes(self) -> int | None:
        return self._budget_bytes

    @property
    def hard_limit_bytes(self) -> int | None:
        return self._hard_limit_bytes

    @property
    def reconcile_actions(self) -> list[str]:
        """What the embedded store repairs on open: nothing here (see :meth:`reconcile`)."""
        return []

    def schema_version(self) -> int:
        """The shared index's schema version (``kv_meta.schema_version``)."""
        return self.index.version()

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise not_on_shared_store("a local folder (this store was opened without one: data_dir=None)")
        return self._data_dir

    @property
    def index(self) -> SharedIndex:
        return self.shared.index

    # ------------------------------------------------------------------ reading the index
    def _key(self, session_id: str, owner: str | None) -> str:
        if owner is not None:
            return storage_key(session_id, owner)
        keys = self.index.keys_of_id(validate_session_id(session_id))
        if not keys:
            raise SessionNotFound(f"no session {session_id!r}")
        if len(keys) > 1:
            owners = sorted(self.index.session(key)["owner"] for key in keys)
            raise InvalidRequest(
                f"{len(keys)} owners have a session {session_id!r} ({', '.join(owners)}); name the owner (--owner)"
            )
        return keys[0]

    def get(self, session_id: str, *, owner: str | None = None) -> SessionInfo:
        """The session as the shared index holds it now."""
        return SessionInfo.from_record(record_of(self.index.session(self._key(session_id, owner))))

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
        """Sessions matching every filter given, oldest first: keyset pages of the index's order
        (``(created_ns, key)`` after the cursor's), the state filtered by PostgreSQL, the others
        here, until ``limit`` match (see :meth:`Store.list`)."""
        wanted = SessionFilter.of(model_name, tags, state, fingerprint)
        limit = check_page(limit)
        position = ListCursor.decode(after) if after is not None else None
        start = (position.created_ns, position.key) if position is not None else None
        batch = None if limit is None else max(limit, 100)  # a filter may pass over rows: read ahead
        out: list[SessionInfo] = []
        while True:
            rows = self.index.sessions(owner, after=start, limit=batch, state=state)
            for row in rows:
                record = record_of(row)
                if wanted.matches(record):
                    out.append(SessionInfo.from_record(record))
                    if limit is not None and len(out) >= limit:
                        return out
            if batch is None or len(rows) < batch:
                return out
            start = (int(rows[-1]["created_ns"]), str(rows[-1]["key"]))

    def counts(self, *, owner: str | None = None) -> SessionCounts:
        """Sessions and bytes by state and tier (``owner``'s, or every owner's): one aggregate that
        PostgreSQL computes over the index (this process reads a row per state and tier)."""
        by_state: dict[str, tuple[int, int]] = {}
        by_tier: dict[str, tuple[int, int]] = {}
        for state, header, sessions, nbytes in self.index.counts(owner):
            tier = coli_kv.parse_header(header).tier.name
            for table, name in ((by_state, state), (by_tier, tier)):
                held = table.get(name, (0, 0))
                table[name] = (held[0] + sessions, held[1] + nbytes)
        return SessionCounts.of(by_state, by_tier)

    def existing(self, session_ids: Iterable[str], *, owner: str) -> set[str]:
        """Which of ``session_ids`` ``owner`` has (one query)."""
        keys = {storage_key(sid, validate_owner(owner)): sid for sid in session_ids}
        return {keys[key] for key in self.index.existing(list(keys))} if keys else set()

    def usage(self) -> dict[str, int | None]:
        """Bytes of every session's records and headers in the shared store (all replicas)."""
        used = sum(nbytes for _, _, nbytes in self.index.usage())
        return {
            "used_bytes": used,
            "reserved_bytes": 0,  # the hard limit is checked in the commit transaction: nothing is held before it
            "budget_bytes": self.budget_bytes,
            "hard_limit_bytes": self.hard_limit_bytes,
        }

    def cache_counts(self) -> CacheCounts | None:
        """This replica's segment cache: hits, misses, damaged copies refused, evictions, size
        (None without a cache); ``GET /metrics`` reports them."""
        return self.shared.cache.counts() if self.shared.cache is not None else None

    # ------------------------------------------------------------------ writing
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
        """Create an empty session (``SessionExists`` when the owner has one of that id); ``ttl_s``:
        its own time-to-live, in the same transaction."""
        checked = ModelInfo.from_dict(model)
        ttl_s = check_ttl(ttl_s)
        if session_id is not None:
            validate_session_id(session_id)
        extra = {"fingerprint": Fingerprint(checked, geometry, tier).key(), "parent": None, "fork_point": None}
        key = self.shared.create(owner, geometry, tier, checked, session_id, tags, extra=extra, ttl_s=ttl_s)
        self._after_write(key)
        return SessionInfo.from_record(record_of(self.index.session(key)))

    def set_tags(self, session_id: str, tags: Iterable[str], *, owner: str | None = None) -> SessionInfo:
        """Replace a session's tags."""
        key = self._key(session_id, owner)
        self.index.set_tags(key, validate_tags(tags), time.time_ns())
        return SessionInfo.from_record(record_of(self.index.session(key)))

    def delete(self, session_id: str, *, owner: str | None = None) -> None:
        """Drop the session from the index (its lease too: a writer's commit is then refused), then
        its objects."""
        self.shared.delete(self._key(session_id, owner))

    # ------------------------------------------------------------------ expiry
    def set_ttl(self, session_id: str, ttl_s: float | None, *, owner: str | None = None) -> SessionInfo:
        """Set (None: drop) a session's own time-to-live (a use: it expires that long from now); see
        :meth:`Store.set_ttl`. The row's expiry is recomputed by the index's trigger."""
        ttl_s = check_ttl(ttl_s)
        key = self._key(session_id, owner)
        self.index.set_ttl(key, None if ttl_s is None else int(round(ttl_s * 1e9)), time.time_ns())
        return SessionInfo.from_record(record_of(self.index.session(key)))

    def owner_ttl(self, owner: str) -> float | None:
        found = self.index.owner_ttl(validate_owner(owner))
        return None if found is None else found / 1e9

    def set_owner_ttl(self, owner: str, ttl_s: float | None) -> int:
        """Set (None: drop) ``owner``'s default time-to-live, for every replica; see :meth:`Store.set_owner_ttl`."""
        validate_owner(owner)
        ttl_s = check_ttl(ttl_s)
        return self.index.set_owner_ttl(owner, None if ttl_s is None else int(round(ttl_s * 1e9)), time.time_ns())

    def expire(self, *, limit: int = EXPIRE_BATCH) -> list[Expiry]:
        """Delete at most ``limit`` expired sessions of the whole shared store, soonest expired first:
        the keys read from the index's expiry order, then one transaction that locks them, reads
        their expiry and leases again and deletes those still expired and not written (a session
        with a live lease, or used since, is kept); then their objects, as a delete does. Replicas
        may sweep at once: a row another holds is skipped."""
        limit = check_page(limit) or EXPIRE_BATCH
        now_ns = time.time_ns()
        keys = self.index.expired_keys(now_ns, limit)
        swept: list[Expiry] = []
        for key, owner, expires_ns, freed, objects in self.index.expire(keys, now_ns):
            for name in objects:
                self.shared.blobs.delete(name)
            self.stats.expired(freed)
            swept.append(Expiry(public_id(key), owner, expires_ns / 1e9, freed))
        return swept

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
        """Rows encoded in the session's tier, then appended (:meth:`SessionStore.append`'s contract)."""
        info = self.get(session_id, owner=owner)
        encoded, found = coli_kv.encode_records_counted(info.geometry, info.tier, tokens, L, R, I)
        if reject_nonfinite:
            refuse_nonfinite(found)
        return self._append(info.key, info, encoded, complete_turn, found)

    def append_records(
        self,
        session_id: str,
        records: np.ndarray | bytes | bytearray | memoryview,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
        reject_nonfinite: bool = False,
    ) -> AppendResult:
        """Validate raw records of the session's tier, then append them as one segment.

        Acknowledged (returned) only after the commit transaction in PostgreSQL returned.

        Raises
        ------
        FormatError : not whole records, a token outside the vocabulary, a corrupt scale or NaN code
        NonFiniteValues : with ``reject_nonfinite``, rows holding NaN or infinity
        LeaseHeld : another replica kept the session's lease for ``lock_timeout`` seconds
        IndexUnavailable, BlobStoreUnavailable : a server is down; send the same rows again later
        """
        info = self.get(session_id, owner=owner)
        rows, found = validated(info.geometry, info.tier, records)
        if reject_nonfinite:
            refuse_nonfinite(found)
        return self._append(info.key, info, rows, complete_turn, found)

    def _append(self, key: str, info: SessionInfo, rows: np.ndarray, complete_turn: bool, found) -> AppendResult:
        started = time.perf_counter()
        if rows.shape[0] == 0:
            if complete_turn and info.watermark < info.n_records:
                self._under_lease(key, self._mark_complete)
            return AppendResult(self.get(public_id(key), owner=info.owner), 0, None, found)
        request = CURRENT_REQUEST.get()

        def write(lease: Lease):
            # a parked session is in use again; the row read before the append says so (no query
            # more per append: one parked since keeps this segment plain, which reads the same)
            if info.state == "parked":
                self._upkeep.unpark_leased(lease)
            return self.shared.append(lease, rows, complete=complete_turn, request=request.key if request else None)

        ack = self._under_lease(key, write)
        if ack.replayed and request is not None:
            request.replayed = True  # the HTTP layer says so (Idempotent-Replayed)
        self.stats.appended(time.perf_counter() - started)
        self._after_write(key)
        return AppendResult(
            self._after_commit(key, info, ack, complete_turn), ack.end - ack.start, (ack.start, ack.end), found
        )

    def _after_commit(self, key: str, before: SessionInfo, ack, complete_turn: bool) -> SessionInfo:
        """The session after an acknowledged append. The append is committed whatever happens
        next: a server that stops before the index is read again must not turn it into an error,
        since the client's retry of the same rows (without an idempotency key) would append them
        twice. The answer is then built from the commit's own result."""
        try:
            return self.get(public_id(key), owner=before.owner)
        except Unavailable as exc:
            log.warning("append committed; answering from the commit (index read failed: %s)", exc.reason)
        grown = ack.end - before.n_records
        now = time.time()
        return dataclasses.replace(
            before,
            n_records=ack.end,
            watermark=ack.end if complete_turn else min(before.watermark, ack.end),
            size_bytes=before.size_bytes + grown * coli_kv.record_bytes(before.geometry, before.tier),
            updated=now,
            last_used=now,
        )

    def _mark_complete(self, lease: Lease) -> None:
        """An empty append ending a turn: the watermark moves to the count, fenced like a commit."""
        row = self.index.session(lease.key)
        segments = self.shared.segments(lease.key)
        self.index.update_meta(
            lease.key,
            lease.token,
            record=row["record"],
            watermark=lease.n_records,
            created_ns=row["created_ns"],
            updated_ns=time.time_ns(),
            last_used_ns=time.time_ns(),
            complete=[segments[-1].first_record] if segments else [],
            blocks=self.shared.new_blocks(lease.key, row, lease.n_records, None, lease.n_records),
        )

    @contextmanager
    def _writing(self, key: str) -> Iterator[None]:
        """One append of ``key`` at a time in this replica (the entry goes with its last user)."""
        with self._writers_lock:
            entry = self._writers.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._writers_lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._writers[key]

    def _under_lease(self, key: str, body):
        """``body(lease)`` holding the session's lease; released after, so any replica may write next.

        A commit fenced because the lease ran out or was taken over published nothing: the lease is
        taken again and the body runs again (at the session's new end). A commit left without an
        answer keeps the lease (and the attempt in doubt) for the retry that settles it.
        """
        with self._writing(key):
            deadline = time.monotonic() + self.lock_timeout
            lease = self._in_doubt.pop(key, None)
            carry = lease
            for _ in range(3):
                try:
                    if lease is None:
                        lease = self._acquire(key, deadline, carry)
                    result = body(lease)
                except StaleLease:
                    carry, lease = lease, None
                    continue
                except BaseException as exc:
                    kept = lease if lease is not None else carry
                    if kept is not None and (isinstance(exc, Unavailable) or kept.in_doubt is not None):
                        self._in_doubt[key] = kept  # the attempt in doubt is settled by the next append
                    elif lease is not None:
                        self._release(key, lease)
                    raise
                self._release(key, lease)
                return result
            if carry is not None and carry.in_doubt is not None:
                self._in_doubt[key] = carry
            raise LeaseHeld(
                f"session {public_id(key)!r} was taken over by other replicas three times during one append; retry",
                retry_after=1.0,
            )

    def _acquire(self, key: str, deadline: float, carry: Lease | None) -> Lease:
        waited = False
        while True:
            try:
                return self.shared.acquire(key, self.holder, carry=carry)
            except LeaseHeld as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats.lock_timed_out()
                    raise
                if not waited:
                    self.stats.lock_waited()
                    waited = True
                # poll: the holder releases after each append; a dead one's lease runs out by itself
                time.sleep(min(left, max(0.005, min(exc.retry_after, 0.02 + 0.03 * random.random()))))

    def _release(self, key: str, lease: Lease) -> None:
        try:
            self.shared.release(lease)
        except Unavailable:
            self._in_doubt[key] = lease  # reused by the next append; it runs out by itself otherwise

    # ------------------------------------------------------------------ reading
    def reader(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> SharedReader:
        """Open a session for resuming: records ``[0, watermark)`` of one committed snapshot.

        ``verify`` re-hashes every segment served first (whole-object reads against the digests
        in the index); a mismatch is a miss from that segment on, as on the embedded store.
        """
        started = time.perf_counter()
        checked_override(override)  # a misspelt override is refused, a fingerprint given or not
        key = self._key(session_id, owner)
        row = self.index.session(key)
        if row["state"] == "parked":
            self._upkeep.unpark_for_reading(key)
            row = self.index.session(key)
        plan = self.index.read_plan(key)
        record = record_of(row)
        if expect is not None:
            check_fingerprint(record, expect, override)
        served = min(plan.watermark, plan.n_records)
        damaged_from = None
        if verify:
            bad = self.shared.first_damaged(key, plan, served)
            if bad is not None:
                damaged_from = bad
                served = max((s.end for s in plan.segments if s.end <= bad and s.complete), default=0)
        self.index.touch(key, time.time_ns())  # the global LRU
        info = SessionInfo.from_record(record)
        return SharedReader(self, info, plan, served, verify, damaged_from, time.perf_counter() - started)

    def resume(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> Resumed:
        """The served records in one load (see :meth:`reader`)."""
        with self.reader(session_id, owner=owner, verify=verify, expect=expect, override=override) as reader:
            return Resumed(reader.info, reader.load(), reader.n_records, reader.verified, reader.damaged_from)

    # ------------------------------------------------------------------ truncate, fork, verify, lookup, inspect
    def truncate(self, session_id: str, n_records: int, *, owner: str | None = None) -> SessionInfo:
        """Keep the first ``n_records`` records (the watermark becomes ``min(watermark, n)``): a
        commit under the session's lease that drops segment rows (a segment cut by ``n`` gets a new
        object with its first records); objects no session lists any more go to GC."""
        key = self._key(session_id, owner)

        def cut(lease: Lease) -> None:
            self._upkeep.unpark_leased(lease)
            self.shared.truncate(lease, n_records)

        self._under_lease(key, cut)
        return self.get(public_id(key), owner=self.index.session(key)["owner"])

    def fork(
        self,
        session_id: str,
        *,
        at: int | None = None,
        new_id: str | None = None,
        owner: str | None = None,
        tags: Iterable[str] | None = None,
    ) -> SessionInfo:
        """A new session holding the first ``at`` records (default: the watermark), published by one
        transaction that copies the segment rows (objects shared, immutable). The fork's watermark
        is ``min(source watermark, at)``; it belongs to the source's owner."""
        source = self._key(session_id, owner)
        row = self.index.session(source)
        new_key = storage_key(new_id if new_id is not None else uuid.uuid4().hex, row["owner"])
        if new_id is not None:
            validate_session_id(new_id)
        if new_key == source:
            raise SessionExists(f"session {public_id(new_key)!r} already exists")
        cap = self.shared.max_sessions
        if cap is not None and self.index.owner_sessions(row["owner"]) >= cap:  # before any upload
            raise TooManySessions(
                f"owner {row['owner']!r} has {cap} or more sessions, the most one owner may have "
                f"(--max-sessions-per-owner {cap}); nothing was created: delete sessions no longer needed"
            )
        stored = dict(row["record"] or {})
        record = {
            **stored,
            "fingerprint": fingerprint_key_of(row),
            "tags": validate_tags(stored.get("tags") or () if tags is None else tags),
            "parent": source,
        }
        self.shared.fork(source, new_key, at, record)
        self._after_write(new_key)
        return self.get(public_id(new_key), owner=row["owner"])

    def last_turn_digest(self, info: SessionInfo) -> bytes:
        """The digest of the session's last committed segment (b"" before the first): a truncate
        and an append of as many rows change it, so an engine's live cache is known to be stale."""
        segments = self.index.read_plan(info.key, max(info.n_records - 1, 0)).segments  # one row, not every turn's
        return segments[-1].digest if segments else b""

    def verify(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every committed segment (turn) of a session against the digest its commit recorded.

        Returns
        -------
        VerifyReport with the first turn whose bytes differ (a silent bit flip in an object), or
        ``ok=True``. ``progress(bytes_hashed, bytes_total)`` is called once, at the end.
        """
        return verify_session(self.shared, self._key(session_id, owner), progress)

    def lookup(self, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
        """The owner's session (same fingerprint) sharing the longest token prefix with ``tokens``
        (:func:`~kvstore.store.shared.reports.longest_prefix`: chain hashes matched in the index)."""
        found = longest_prefix(self.shared, owner, fingerprint, tokens)
        self.stats.lookup(hit=found is not None)
        return found

    def inspect(self, session_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """What the session's ``.coli_kv`` image holds: header fields, sizes, what a loader would
        neutralize (the embedded store's report; ``file`` names the segment objects' count and bytes)."""
        key = self._key(session_id, owner)
        return inspect_session(self.shared, key, SessionInfo.from_record(record_of(self.index.session(key))))

    # ------------------------------------------------------------------ what only the embedded store has
    def journal_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """Not on this backend: a session is segment objects, not a journal file (:class:`NotOnSharedStore`)."""
        raise not_on_shared_store("journal files (journal_path)")

    def archive_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """Not on this backend: nothing is archived (:class:`NotOnSharedStore`)."""
        raise not_on_shared_store("archive files (archive_path)")

    @property
    def journals(self) -> Path:
        raise not_on_shared_store("journal files (the journals folder)")

    @property
    def archives(self) -> Path:
        raise not_on_shared_store("archive files (the archive folder)")

    @property
    def locks(self) -> Path:
        raise not_on_shared_store("lock files (the locks folder; writers hold leases in PostgreSQL)")

    @property
    def lost_found(self) -> Path:
        raise not_on_shared_store("lost+found (journals are not on this backend)")

    def reconcile(self) -> list[str]:
        """Nothing to reconcile: a commit is one PostgreSQL transaction, so the index is never behind
        the objects (uncommitted uploads are GC's); no repair is made, none reported."""
        return []

    # ------------------------------------------------------------------ upkeep (kvstore.store.shared.upkeep)
    def park(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Compress the session's segment objects (state ``parked``; already parked: nothing to do).
        ``progress(bytes, total)`` counts its ``.coli_kv`` image."""
        key = self._key(session_id, owner)
        self._upkeep.park(key, progress)
        return self.get(public_id(key), owner=self.index.session(key)["owner"])

    def unpark(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Store a parked session's objects plain again (state ``active``); ``BudgetExceeded`` past the hard limit."""
        key = self._key(session_id, owner)
        self._upkeep.unpark(key, progress)
        return self.get(public_id(key), owner=self.index.session(key)["owner"])

    def repair(
        self, session_id: str, *, owner: str | None = None, dry_run: bool = False, progress: Progress | None = None
    ) -> RepairReport:
        """Drop every record from the first segment (turn) whose bytes differ from its digest on,
        recording the problem (``dry_run``: only report what would be dropped)."""
        return self._upkeep.repair(self._key(session_id, owner), dry_run, progress)

    def migrate(
        self, session_id: str, tier: Tier, *, owner: str | None = None, progress: Progress | None = None
    ) -> SessionInfo:
        """Re-encode every record in ``tier`` (new header, fingerprint and prefix blocks, one fenced
        commit); ``IntegrityError`` for a damaged session. ``progress(records, total)``."""
        key = self._key(session_id, owner)
        self._upkeep.migrate(key, tier, progress)
        return self.get(public_id(key), owner=self.index.session(key)["owner"])

    def enforce_budget(self, *, keep: Iterable[str] = (), progress: Progress | None = None) -> list[Eviction]:
        """Park the least recently used active sessions of the whole shared store (every replica's,
        the index's LRU), then delete the least recently used parked ones, until it fits
        ``budget_bytes``; what was evicted, in order. Sessions in ``keep`` (every owner's of those
        ids), sessions being written (a live lease) and damaged ones are skipped. ``progress`` is
        not called."""
        return self._upkeep.enforce_budget(keep)

    def _after_write(self, key: str) -> None:
        self._upkeep.after_write(key)
