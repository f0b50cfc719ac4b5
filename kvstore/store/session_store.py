"""The :class:`SessionStore` facade: the embedded backend of :class:`~kvstore.store.base.Store`,
delegating to one object per concern.

It builds the shared :class:`~kvstore.store.context.StoreContext` and the concern objects over it
(the wiring is in ``__init__``), takes the locks that span concerns, and converts index records to
the public value types. A migrate, an append or a resume resolves the session once
(``StoreContext.session``) and hands the handle to the module that owns the operation. The
behaviour of each operation is documented where it is implemented; the package docstring
(``kvstore.store``) is the map.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from kvstore.crypto.kek import KeyProvider
from kvstore.crypto.keyring import Keyring
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.formats.coli_kv import Geometry
from kvstore.locks import DEFAULT_LOCK_TIMEOUT_S
from kvstore.sealed import SEALED_HEADER_BYTES, SealedHeader
from kvstore.store import archive
from kvstore.store.base import CAPABILITIES, EXPIRE_BATCH, Store, check_page, check_session_cap
from kvstore.store.budget import Evictor, Reservations
from kvstore.store.context import StoreContext
from kvstore.store.index import DEFAULT_MAP_SIZE, Index, visible
from kvstore.store.integrity import Integrity
from kvstore.store.maintenance import Maintenance
from kvstore.store.parking import Parking
from kvstore.store.prefix import Prefixes
from kvstore.store.reader import SessionReader
from kvstore.store.recovery import Recovery
from kvstore.store.removal import Removal
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
    finish_rotation,
)
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
    validate_tags,
)
from kvstore.store.writes import Writes
from kvstore.tiers import Tier


class SessionStore(Store):
    """Sessions of MLA latent KV rows: create, append, resume, fork, look up, park, evict.

    Parameters
    ----------
    data_dir : the store's folder (created 0700 if missing)
    budget_bytes : soft disk budget kept by LRU eviction (None: no eviction)
    hard_limit_bytes : writes that would cross it are refused with BudgetExceeded (None: no limit)
    map_size : the LMDB map size of the index in bytes
    lock_timeout : seconds an operation waits for a session another writer holds
    reconcile : repair the index from the journals on open (see ``kvstore.store.recovery``)
    progress : callback ``(done, total)`` for index schema upgrades on open
    max_sessions_per_owner : the most sessions one owner may have (None: no cap); a create or fork
        past it raises :class:`TooManySessions`, nothing created
    kek : the key-encryption key of a store encrypted at rest (docs/SECURITY.md; None: plaintext)

    Session ids are per owner: two owners may both have ``chat-1`` (the store keeps each under
    ``<id>~<owner>``, :attr:`SessionInfo.key`). Every method that takes ``owner`` looks up that
    owner's session only, before taking any lock or touching any file, so another owner's session
    is simply missing (:class:`SessionNotFound`, the same reason as for an id nobody has);
    ``owner=None`` acts as any owner, and refuses an id several owners have (:class:`InvalidRequest`)
    rather than pick one.

    The embedded backend has every capability of :data:`~kvstore.store.base.CAPABILITIES`; open it
    through :func:`kvstore.store.open` (a data folder).
    """

    capabilities = frozenset(CAPABILITIES)

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        budget_bytes: int | None = None,
        hard_limit_bytes: int | None = None,
        map_size: int = DEFAULT_MAP_SIZE,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        reconcile: bool = True,
        progress: Progress | None = None,
        max_sessions_per_owner: int | None = None,
        kek: KeyProvider | None = None,
    ):
        for name, value in (("budget_bytes", budget_bytes), ("hard_limit_bytes", hard_limit_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidRequest(f"{name} must be a non-negative number of bytes")
        ctx = StoreContext(
            data_dir,
            budget_bytes=budget_bytes,
            hard_limit_bytes=hard_limit_bytes,
            map_size=map_size,
            lock_timeout=lock_timeout,
            progress=progress,
            max_sessions_per_owner=check_session_cap(max_sessions_per_owner),
            kek=kek,
        )
        self._ctx = ctx
        # The concerns, each over the shared context, each given the ones it calls (no cycles).
        self._integrity = Integrity(ctx)
        self._reservations = Reservations(ctx)
        self._removal = Removal(ctx, self._integrity)
        self._recovery = Recovery(ctx, self._removal)
        self._parking = Parking(ctx, self._reservations, self._recovery)
        self._evictor = Evictor(ctx, self._parking, self._removal)
        self._prefixes = Prefixes(ctx)
        self._writes = Writes(
            ctx,
            self._reservations,
            self._evictor,
            self._integrity,
            self._removal,
            self._recovery,
            self._parking,
        )
        self._maintenance = Maintenance(
            ctx, self._reservations, self._evictor, self._integrity, self._removal, self._recovery, self._parking
        )
        self._reconcile_actions: list[str] = []
        if reconcile:
            try:
                self._reconcile_actions = self.reconcile()
            except BaseException:
                ctx.close()
                raise

    # ------------------------------------------------------------------ lifecycle, folders, limits
    def close(self) -> None:
        self._ctx.close()

    def __enter__(self) -> "SessionStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def reconcile_actions(self) -> list[str]:
        """What the reconcile on open repaired (one line each; empty when opened with ``reconcile=False``)."""
        return self._reconcile_actions

    def schema_version(self) -> int:
        """The LMDB index's schema version (``kvstore.migrations.index``)."""
        return self._ctx.index.version()

    def cache_counts(self) -> CacheCounts | None:
        """None: the embedded store reads its own files, it keeps no cache."""
        return None

    @property
    def data_dir(self) -> Path:
        return self._ctx.data_dir

    @property
    def journals(self) -> Path:
        return self._ctx.journals

    @property
    def archives(self) -> Path:
        return self._ctx.archives

    @property
    def locks(self) -> Path:
        return self._ctx.locks

    @property
    def lost_found(self) -> Path:
        return self._ctx.lost_found

    @property
    def index(self) -> Index:
        return self._ctx.index

    @property
    def keyring(self) -> Keyring | None:
        """The data keys of a store encrypted at rest (None: a plaintext store)."""
        return self._ctx.keyring

    @property
    def encrypted(self) -> bool:
        return self._ctx.keyring is not None

    @property
    def budget_bytes(self) -> int | None:
        return self._ctx.budget_bytes

    @property
    def hard_limit_bytes(self) -> int | None:
        return self._ctx.hard_limit_bytes

    @property
    def lock_timeout(self) -> float:
        return self._ctx.lock_timeout

    @property
    def max_sessions_per_owner(self) -> int | None:
        return self._ctx.max_sessions_per_owner

    def journal_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """``journals/<id>~<owner>.coli_kv`` (PathRefused if it is a symbolic link). With ``owner`` the
        path whether or not the session exists; without, the path of the one session of that id."""
        return self._ctx.journal_path(self._key(session_id, owner))

    def archive_path(self, session_id: str, *, owner: str | None = None) -> Path:
        """``archive/<id>~<owner>.coli_kv.zst`` (PathRefused if it is a symbolic link); see :meth:`journal_path`."""
        return self._ctx.archive_path(self._key(session_id, owner))

    def _key(self, session_id: str, owner: str | None) -> str:
        return storage_key(session_id, owner) if owner is not None else self._ctx.resolve(session_id, None, hidden=True)

    # ------------------------------------------------------------------ reading the index
    def get(self, session_id: str, *, owner: str | None = None) -> SessionInfo:
        """The session's index record."""
        return SessionInfo.from_record(self._ctx.record(self._ctx.resolve(session_id, owner), owner))

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
        """Sessions matching every filter given (all ``tags`` must be present), oldest first.

        Read in the index's creation order (``by_created`` for an owner, ``created`` for every
        owner: a cursor range scan from ``after``), each session's record read as it comes, until
        ``limit`` match: a page costs its own sessions (plus those a filter passes over), never the
        store's. See :meth:`Store.list` for ``limit`` and ``after``.
        """
        wanted = SessionFilter.of(model_name, tags, state, fingerprint)
        limit = check_page(limit)
        position = ListCursor.decode(after) if after is not None else None
        index = self._ctx.index
        out: list[SessionInfo] = []
        with index.read() as txn:
            start = (position.created_ns, position.key) if position is not None else None
            with contextlib.closing(index.listed(txn, owner, start)) as keys:
                for key in keys:
                    record = index.get(txn, key)
                    if visible(record, owner) and wanted.matches(record):
                        out.append(SessionInfo.from_record(record))
                        if limit is not None and len(out) >= limit:
                            break
        return out

    def counts(self, *, owner: str | None = None) -> SessionCounts:
        """Sessions and bytes by state and tier (``owner``'s, or every owner's): the index's
        ``counts``, kept by every write of a record, so a few keys are read whatever the store holds."""
        index = self._ctx.index
        with index.read() as txn:
            found = index.counts(txn, owner)
        return SessionCounts.of(found["state"], found["tier"])

    def existing(self, session_ids: Iterable[str], *, owner: str) -> set[str]:
        """Which of ``session_ids`` ``owner`` has: one ``by_owner`` key each, in one read."""
        keys = {storage_key(sid, validate_owner(owner)): sid for sid in session_ids}
        with self._ctx.index.read() as txn:
            return {keys[key] for key in self._ctx.index.owned(txn, owner, keys)}

    def usage(self) -> dict[str, int | None]:
        """Bytes the store holds (journals + archives), bytes reserved by writers, and the limits."""
        return self._reservations.usage()

    @property
    def stats(self) -> StoreStats:
        """This store's counts of lookups, restores, appends, lock waits and evictions (kvstore.store.stats)."""
        return self._ctx.stats

    # ------------------------------------------------------------------ writing (kvstore.store.writes)
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
        """Create an empty session (its journal holds only the header); ``ttl_s``: its own
        time-to-live, set right after (a crash in between leaves it without one: kept, not lost).

        Raises
        ------
        SessionExists, InvalidSessionId, BadHeader (a geometry no model has), BudgetExceeded
        """
        ttl_s = check_ttl(ttl_s)
        info = self._writes.create(owner, geometry, tier, model, session_id, tags)
        if ttl_s is None:
            return info
        return SessionInfo.from_record(self._maintenance.set_ttl(info.key, owner, ttl_s))

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
        """Append rows, encoded in the session's tier.

        Parameters
        ----------
        tokens : int32[k]
        L : f32[n_layers, k, kv_lora]
        R : f32[n_layers, k, qk_rope]
        I : f32[nic, k, index_hd], required when the model has indexer layers
        complete_turn : the rows end a turn: the watermark moves to the new count
        reject_nonfinite : refuse rows holding NaN or infinity (:class:`NonFiniteValues`, nothing
            written) instead of storing them by the tier's rule (f32 values and indexer values
            become 0; fp8 stores a NaN as 0 and a row with an infinity as zeros; int4/polar a row
            with either as zeros) and counting them in ``AppendResult.sanitized``
        """
        started = time.perf_counter()
        session = self._ctx.session(session_id, owner)
        result = self._writes.append(
            session, tokens, L, R, I, complete_turn=complete_turn, reject_nonfinite=reject_nonfinite
        )
        self._ctx.stats.appended(time.perf_counter() - started)
        return result

    def append_records(
        self,
        session_id: str,
        records: np.ndarray | bytes | bytearray | memoryview,
        *,
        complete_turn: bool = True,
        owner: str | None = None,
        reject_nonfinite: bool = False,
    ) -> AppendResult:
        """Append already-encoded records of the session's tier (raw ``.coli_kv`` record bytes, no header).

        The bytes are validated before anything is written (whole records, token ids in the
        vocabulary, no corrupt scale/radius or NaN code). Non-finite f32 values (v1 rows, indexer
        rows) are stored as 0 and counted in ``AppendResult.sanitized``, or refused with
        ``reject_nonfinite`` (see :meth:`append`). An empty call with ``complete_turn`` marks the
        rows appended so far as a complete turn.

        Returns
        -------
        AppendResult — acknowledged only after the journal and the index both committed.
        """
        started = time.perf_counter()
        session = self._ctx.session(session_id, owner)
        result = self._writes.append_records(
            session, records, complete_turn=complete_turn, reject_nonfinite=reject_nonfinite
        )
        self._ctx.stats.appended(time.perf_counter() - started)
        return result

    def truncate(self, session_id: str, n_records: int, *, owner: str | None = None) -> SessionInfo:
        """Keep the first ``n_records`` records (the watermark becomes ``min(watermark, n)``).

        The index commits first, then the journal is cut (see ``kvstore.store.removal``).
        """
        return self._writes.truncate(self._ctx.resolve(session_id, owner), n_records, owner)

    def fork(
        self,
        session_id: str,
        *,
        at: int | None = None,
        new_id: str | None = None,
        owner: str | None = None,
        tags: Iterable[str] | None = None,
    ) -> SessionInfo:
        """A new session holding a copy of the first ``at`` records (default: the watermark).

        The copy is published atomically, then indexed with the source's turn hashes (a turn cut
        by ``at`` is checked, then re-hashed) and prefix blocks. The fork's watermark is
        ``min(source watermark, at)``. The fork belongs to the source's owner.
        """
        source = self._ctx.resolve(session_id, owner)
        new_key = storage_key(new_id if new_id is not None else uuid.uuid4().hex, self._ctx.owner_of(source))
        return self._writes.fork(source, at, new_key, owner, tags)

    def delete(self, session_id: str, *, owner: str | None = None) -> None:
        """Remove a session, its files and its index entries (also one a failed delete hid)."""
        key = self._ctx.resolve(session_id, owner, hidden=True)
        with self._ctx.writing(key):
            self._removal.delete_locked(key, owner)

    def set_tags(self, session_id: str, tags: Iterable[str], *, owner: str | None = None) -> SessionInfo:
        """Replace a session's tags."""
        checked = validate_tags(tags)
        key = self._ctx.resolve(session_id, owner)
        with self._ctx.index.write() as txn:
            record = self._ctx.index.update(txn, key, tags=checked, updated=time.time())
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ expiry (kvstore.store.maintenance)
    def set_ttl(self, session_id: str, ttl_s: float | None, *, owner: str | None = None) -> SessionInfo:
        """Set (None: drop) a session's own time-to-live; see :meth:`Store.set_ttl`."""
        return SessionInfo.from_record(self._maintenance.set_ttl(self._ctx.resolve(session_id, owner), owner, ttl_s))

    def owner_ttl(self, owner: str) -> float | None:
        return self._maintenance.owner_ttl(owner)

    def set_owner_ttl(self, owner: str, ttl_s: float | None) -> int:
        """Set (None: drop) ``owner``'s default time-to-live; see :meth:`Store.set_owner_ttl`."""
        return self._maintenance.set_owner_ttl(owner, ttl_s)

    def expire(self, *, limit: int = EXPIRE_BATCH) -> list[Expiry]:
        """Delete at most ``limit`` expired sessions (their journals and archives), soonest expired
        first; see :meth:`Store.expire` and ``kvstore.store.maintenance``."""
        return self._maintenance.expire(check_page(limit) or EXPIRE_BATCH)

    # ------------------------------------------------------------------ resuming (kvstore.store.reader)
    def reader(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> SessionReader:
        """Open a session for resuming (unparking it if parked). Use as a context manager.

        Parameters
        ----------
        verify : re-hash the turns first; a mismatch is a miss: only the records before the
            first bad turn (down to a complete turn) are served
        expect : the fingerprint of the engine that will restore the rows; any field that differs
            raises :class:`FingerprintMismatch` naming it
        override : fields of ``expect`` not to compare (e.g. ``{"model.weights_hash"}`` for the
            same weights re-saved) — an explicit, documented escape hatch

        The reader serves records ``[0, reused_tokens)``; appends may continue meanwhile, and
        nothing that shrinks or replaces the journal runs until the reader is closed.
        """
        started = time.perf_counter()  # a restore's seconds count the unpark and the verify
        return SessionReader(
            self._ctx,
            self._integrity,
            self._ctx.session(session_id, owner),
            verify=verify,
            expect=expect,
            override=override,
            unpark=lambda: self.unpark(session_id, owner=owner),
            started=started,
        )

    def resume(
        self,
        session_id: str,
        *,
        owner: str | None = None,
        verify: bool = False,
        expect: Fingerprint | None = None,
        override: Iterable[str] = (),
    ) -> Resumed:
        """Load a session's records up to its watermark (see :meth:`reader` for the options).

        Returns
        -------
        Resumed — ``records`` (KVRecords of the served prefix), ``reused_tokens`` (how many records
        the engine need not prefill), ``damaged_from`` when ``verify`` found a bad turn.
        """
        with self.reader(session_id, owner=owner, verify=verify, expect=expect, override=override) as reader:
            records = reader.load()
        return Resumed(reader.info, records, reader.n_records, reader.verified, reader.damaged_from)

    def last_turn_digest(self, info: SessionInfo) -> bytes:
        """The hash of the session's last turn as the index holds it (b"" before the first): with
        the count and watermark, it tells whether the rows changed since ``info`` was read (an
        engine's live cache is then stale)."""
        with self.index.read() as txn:
            turns = self.index.turns(txn, info.key)
        return turns[-1].digest if turns else b""

    def verify(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> VerifyReport:
        """Re-hash every turn of a session (journal or archive) against the hashes in the index.

        ``progress(bytes_hashed, bytes_total)`` is called as the records are read.

        Returns
        -------
        VerifyReport with the first turn whose bytes differ (a silent bit flip the format cannot
        see), or ``ok=True``.
        """
        report = self._integrity.verify(self._ctx.resolve(session_id, owner), owner, progress)
        return dataclasses.replace(report, session_id=public_id(report.session_id))

    # ------------------------------------------------------------------ prefix lookup (kvstore.store.prefix)
    def lookup(self, owner: str, fingerprint: Fingerprint, tokens) -> LookupResult | None:
        """The owner's session (same fingerprint) sharing the longest token prefix with ``tokens``.

        Block-aligned chain hashes in the index find the candidates (a few key probes, no journal
        scan); the winners are then confirmed against their journal's (or archive's) tokens and
        the match extended past the last whole block. Matches are capped at each session's
        watermark; a query sharing fewer than one block (64 tokens) with every session finds none.
        """
        found = self._prefixes.lookup(owner, fingerprint, tokens)
        self._ctx.stats.lookup(hit=found is not None)
        return dataclasses.replace(found, session_id=public_id(found.session_id)) if found is not None else None

    # ------------------------------------------------------------------ parking and budget (parking, budget)
    def park(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Compress a session's journal into the archive (zstd) and free the journal.

        ``progress(bytes_done, bytes_total)`` is called as the journal is compressed. Parking a
        parked session does nothing.
        """
        key = self._ctx.resolve(session_id, owner)
        with self._ctx.writing(key):
            return SessionInfo.from_record(self._parking.park_locked(key, owner, progress))

    def unpark(self, session_id: str, *, owner: str | None = None, progress: Progress | None = None) -> SessionInfo:
        """Restore a parked session's journal from its archive (byte for byte) and free the archive."""
        key = self._ctx.resolve(session_id, owner)
        with self._ctx.writing(key):
            record = self._parking.unpark_locked(key, owner, progress)
        self._evictor.after_write(key)
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ encryption at rest (docs/SECURITY.md)
    def _keyring(self) -> Keyring:
        if self._ctx.keyring is None:
            raise InvalidRequest(f"the store in {self.data_dir} is not encrypted at rest (open it with a KEK)")
        return self._ctx.keyring

    def key_versions_in_use(self, owner: str) -> dict[int, int]:
        """Data-key version -> how many of ``owner``'s files (journals and archives) are sealed under it."""
        used: dict[int, int] = {}
        for info in self.list(owner=owner):
            record = self._ctx.index.current(info.key, owner)
            if record["state"] == "active":
                with open(self._ctx.journal_path(info.key), "rb") as f:
                    head = f.read(SEALED_HEADER_BYTES)
            elif record["state"] == "parked":
                head = archive.read_prefix(self._ctx.archive_path(info.key), SEALED_HEADER_BYTES)
            else:
                continue
            version = SealedHeader.parse(head, info.key).key_version
            used[version] = used.get(version, 0) + 1
        return used

    def rotate_data_key(self, owner: str) -> dict[str, Any]:
        """A new data-key version for ``owner`` (new files are sealed under it at once), then every
        one of the owner's sessions rewritten under it, one at a time under its write lock and its
        read lock held exclusively for the rename (other sessions, and this one before and after,
        keep being served); versions no file uses any longer are retired (destroyed).

        A parked session is unparked, resealed and parked again. Returns the new version, the
        sessions resealed, and the versions retired and still in use (a session that could not be
        locked or read is named in ``skipped`` and keeps its version, which is then not retired).
        """
        keyring = self._keyring()
        validate_owner(owner)
        version = keyring.rotate(owner)
        resealed, skipped = [], []
        for info in self.list(owner=owner):
            key = info.key
            try:
                with self._ctx.writing(key):
                    record = self._ctx.index.current(key, owner)
                    parked = record["state"] == "parked"
                    if parked:
                        record = self._parking.unpark_locked(key, owner, None)
                    if record["state"] != "active":
                        skipped.append(info.id)
                        continue
                    with self._ctx.open_journal(record, writable=True) as journal:
                        with self._ctx.reading(key, exclusive=True):
                            journal.reseal()  # an atomic rewrite: a new salt, the new version
                            size = journal.size_bytes
                        with self._ctx.index.write() as txn:
                            self._ctx.index.update(txn, key, size_bytes=size)
                    if parked:
                        self._parking.park_locked(key, owner, None)
                resealed.append(info.id)
            except (KVStoreError, OSError) as exc:
                skipped.append(f"{info.id}: {getattr(exc, 'reason', exc)}")
        return finish_rotation(keyring, owner, version, self.key_versions_in_use(owner), resealed, skipped)

    def shred_owner(self, owner: str) -> int:
        """Destroy every data key of ``owner`` (:meth:`Keyring.shred`): all of the owner's journals,
        archives and copies of them are unreadable from then on, untouched. Returns the number of
        key versions destroyed. The sessions stay indexed (damaged when next opened) until deleted."""
        validate_owner(owner)
        return self._keyring().shred(owner)

    def enforce_budget(self, *, keep: Iterable[str] = (), progress: Progress | None = None) -> list[Eviction]:
        """Evict until the store fits ``budget_bytes``: park the least recently used active sessions,
        then delete the least recently used parked ones. Sessions in ``keep`` and sessions another
        request is using are skipped (every owner's session of an id in ``keep``). Returns what was
        evicted, in order."""
        with self._ctx.index.read() as txn:
            kept = [key for sid in keep for key, _ in self._ctx.index.keys_of_id(txn, sid)]
        evicted = self._evictor.enforce(keep=kept, progress=progress)
        return [dataclasses.replace(e, session_id=public_id(e.session_id)) for e in evicted]

    # ------------------------------------------------------------------ file tools (kvstore.store.maintenance)
    def inspect(self, session_id: str, *, owner: str | None = None) -> dict[str, Any]:
        """What the session's file holds: header fields, sizes and what a loader would neutralize."""
        return self._maintenance.inspect(self._ctx.resolve(session_id, owner), owner)

    def repair(
        self, session_id: str, *, owner: str | None = None, dry_run: bool = False, progress: Progress | None = None
    ) -> RepairReport:
        """Make a session's journal and index agree and drop what cannot be trusted.

        Drops journal bytes past the acknowledged count (a torn or unacknowledged tail) and, when a
        turn's hash no longer matches, every record from that turn on (the damaged tail is never
        served); the watermark falls back to the last complete turn kept. ``dry_run`` reports
        without changing anything. ``progress(bytes_hashed, bytes_total)`` as the turns are re-hashed.
        """
        report = self._maintenance.repair(self._ctx.resolve(session_id, owner), owner, dry_run, progress)
        return dataclasses.replace(report, session_id=public_id(report.session_id))

    def migrate(
        self,
        session_id: str,
        tier: Tier,
        *,
        owner: str | None = None,
        progress: Progress | None = None,
    ) -> SessionInfo:
        """Convert a session's journal to another tier (lossy unless the target is v1).

        The turns are verified first (a damaged session is refused: repair it), the journal is
        rewritten atomically through ``kvstore.migrations``, and the index takes the new tier,
        fingerprint, turn hashes and prefix blocks in one transaction. ``progress(records_done,
        records_total)``.
        """
        return self._maintenance.migrate(self._ctx.session(session_id, owner), tier, progress)

    # ------------------------------------------------------------------ recovery (kvstore.store.recovery)
    def reconcile(self) -> list[str]:
        """Repair the index from the journals (run on open; safe while other processes use the store).

        Sessions another request holds are skipped (that request settles them). Returns one line
        per repair made.
        """
        return self._recovery.reconcile()
