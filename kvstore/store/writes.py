"""Writing sessions: create, append, truncate and fork, each in the store's commit order.

- **append**: the journal append is durable first (``KVFile``: data fsync, then its nrec fsync),
  then one index transaction records the new count, the turn's hash, the prefix blocks and the
  watermark. The append is acknowledged only after both; a crash in between leaves journal records
  the index does not know, rolled back on open, so a client that retries does not duplicate rows.
  It runs as one line: the session resolved once by the facade (a ``SessionHandle``), its write
  lock, ``Parking.open_active`` (the record read again, the journal opened and settled), the
  journal append, the index transaction, then the evictor.
- **truncate**: the index commits the shorter count first, then the journal is cut (``removal``).
- **create / fork**: the new file is published atomically first, then indexed; a file without an
  index entry is an unacknowledged creation (removed if empty, else moved to ``lost+found``). With
  a cap on an owner's sessions, both are refused (:class:`TooManySessions`) before any file is
  made, and again in the transaction that would index the new session (the count is the index's
  own, kept by every write, so two creates at once never both take the last place).

Every write reserves its bytes under the hard limit first and settles the reservation in the
transaction that commits it (``budget``).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from kvstore.durable import write_atomic
from kvstore.errors import FormatError, InvalidRequest, JournalWriteError, SessionExists, TooManySessions
from kvstore.formats import coli_kv, nonfinite
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header
from kvstore.formats.nonfinite import Sanitized
from kvstore.journal import KVFile
from kvstore.migrations import index as schema
from kvstore.sealed import SEALED_HEADER_BYTES, read_any_header, sealed_bytes_bound, write_sealed
from kvstore.store.budget import Evictor, Reservations
from kvstore.store.context import SessionHandle, StoreContext
from kvstore.store.index import Turn, refuse_damaged
from kvstore.store.integrity import Integrity, turn_digest
from kvstore.store.parking import Parking
from kvstore.store.prefix import block_tokens
from kvstore.store.records import COPY_CHUNK_BYTES, CountingChunks, bytes_view, record_chunks
from kvstore.store.recovery import Recovery
from kvstore.store.removal import Removal, unlink_quietly
from kvstore.store.results import AppendResult, refuse_nonfinite
from kvstore.store.values import (
    Fingerprint,
    IndexRecord,
    ModelInfo,
    SessionInfo,
    check_record_size,
    geometry_of,
    public_id,
    storage_key,
    tier_of,
    tier_record,
    validate_key,
    validate_owner,
    validate_tags,
)
from kvstore.tiers import Tier


class Writes:
    """Create, append, truncate and fork for the sessions of one store."""

    def __init__(
        self,
        ctx: StoreContext,
        reservations: Reservations,
        evictor: Evictor,
        integrity: Integrity,
        removal: Removal,
        recovery: Recovery,
        parking: Parking,
    ):
        self.ctx = ctx
        self._reservations = reservations
        self._evictor = evictor
        self._integrity = integrity
        self._removal = removal
        self._recovery = recovery
        self._parking = parking

    # ------------------------------------------------------------------ create
    def create(
        self,
        owner: str,
        geometry: Geometry,
        tier: Tier,
        model: ModelInfo | dict[str, Any],
        session_id: str | None,
        tags: Iterable[str],
    ) -> SessionInfo:
        """Create an empty session (its journal holds only the header), keyed ``<id>~<owner>``."""
        ctx = self.ctx
        validate_owner(owner)
        model = ModelInfo.from_dict(model)
        tags = validate_tags(tags)
        session_id = storage_key(session_id if session_id is not None else uuid.uuid4().hex, owner)
        check_record_size(geometry, tier)
        exists = f"session {public_id(session_id)!r} already exists"  # only ever the caller's own
        with ctx.index.read() as txn:
            self._refuse_past_cap(txn, owner)  # before any lock or file: a refusal leaves nothing
        with ctx.writing(session_id):
            path = ctx.journal_path(session_id)
            self._removal.finish_interrupted_delete(session_id)
            with ctx.index.read() as txn:
                if ctx.index.get(txn, session_id) is not None:
                    raise SessionExists(exists)
            self._clear_orphan(session_id, path)
            with self._reservations.reserve(SEALED_HEADER_BYTES if ctx.keyring else HEADER_BYTES) as reservation:
                sidecar = path.with_name(path.name + ".lock")  # the journal's writer lock (kvstore.journal)
                try:
                    created = KVFile.create(
                        path,
                        geometry,
                        tier,
                        lock_timeout=ctx.lock_timeout,
                        dir_fd=ctx.dir_fd(ctx.journals),
                        sealing=ctx.sealing(session_id),
                    )
                    created_bytes = created.size_bytes
                    created.close()
                except JournalWriteError:
                    unlink_quietly(sidecar)  # we held it: a refused create leaves no file behind
                    raise
                now_ns = time.time_ns()
                record: IndexRecord = {
                    "id": session_id,
                    "owner": owner,
                    "model": model.to_dict(),
                    "geometry": list(geometry.words()),
                    "tier": tier_record(tier),
                    "n_records": 0,
                    "watermark": 0,
                    "created": now_ns / 1e9,
                    "updated": now_ns / 1e9,
                    "last_used": now_ns / 1e9,
                    "last_used_ns": now_ns,
                    "size_bytes": created_bytes,  # the empty journal just created (never re-read by path)
                    "tags": tags,
                    "state": "active",
                    "parent": None,
                    "fork_point": None,
                    "problem": None,
                    "fingerprint": Fingerprint(model, geometry, tier).key(),
                    "prefix_blocks": 0,
                }
                try:
                    with ctx.index.write() as txn:
                        if ctx.index.get(txn, session_id) is not None:
                            raise SessionExists(exists)
                        self._refuse_past_cap(txn, owner)
                        ctx.index.put(txn, record)
                        self._reservations.settle(txn, reservation)
                except BaseException:
                    path.unlink(missing_ok=True)  # never indexed: nobody was told it exists
                    unlink_quietly(sidecar)
                    raise
        self._evictor.after_write(session_id)
        return SessionInfo.from_record(record)

    def _refuse_past_cap(self, txn, owner: str) -> None:
        """Raise :class:`TooManySessions` when ``owner`` already has the most sessions the store
        allows one owner (``max_sessions_per_owner``; None: no cap). The count is the index's own."""
        cap = self.ctx.max_sessions_per_owner
        if cap is None:
            return
        held = self.ctx.index.owner_count(txn, owner)
        if held >= cap:
            raise TooManySessions(
                f"owner {owner!r} has {held} sessions, the most one owner may have (--max-sessions-per-owner "
                f"{cap}); nothing was created: delete sessions no longer needed, then create again"
            )

    def _clear_orphan(self, session_id: str, path: Path) -> None:
        """A journal left by a creation that crashed before it was indexed: empty ones go."""
        if not path.exists():
            return
        try:
            empty = read_any_header(path).nrec == 0  # plaintext or sealed
        except (FormatError, OSError):
            empty = False
        if not empty:
            raise SessionExists(
                f"a journal for {public_id(session_id)!r} exists without an index entry; reopen the store to move it "
                "to lost+found"
            )
        path.unlink()

    # ------------------------------------------------------------------ append
    def append(
        self, session: SessionHandle, tokens, L, R, I, *, complete_turn: bool, reject_nonfinite: bool
    ) -> AppendResult:
        """Encode rows in the session's tier (``coli_kv.encode_records_counted``), then append them.

        The tier is the one the resolving read found: rows encoded for a tier a migrate has changed
        since are refused by the journal's validation, nothing written. Non-finite values are
        stored by the tier's rule and counted (``AppendResult.sanitized``), or refused with
        ``reject_nonfinite`` (:class:`NonFiniteValues`, before anything is written).
        """
        encoded, found = coli_kv.encode_records_counted(session.geometry, session.tier, tokens, L, R, I)
        if reject_nonfinite:
            refuse_nonfinite(found)
        return self.append_records(session, encoded, complete_turn=complete_turn, counted=found)

    def append_records(
        self,
        session: SessionHandle,
        records: np.ndarray | bytes | bytearray | memoryview,
        *,
        complete_turn: bool,
        reject_nonfinite: bool = False,
        counted: Sanitized | None = None,
    ) -> AppendResult:
        """Validate, then append: journal durable first, then one index transaction.

        Non-finite f32 values (v1 rows, indexer rows) are stored as 0 and counted, or refused with
        ``reject_nonfinite``; ``counted`` is the count of rows :meth:`append` encoded (already clean).
        """
        ctx, key = self.ctx, session.key
        with session.writing:
            record, journal = self._parking.open_active(session)
            with journal:
                found = counted
                if found is None:
                    records, found = self._sanitized(records, journal)
                    if reject_nonfinite:
                        refuse_nonfinite(found)
                rows = journal.validate_records(records)
                count = record["n_records"]
                if rows.shape[0] == 0:
                    record = self._mark_complete(record, journal) if complete_turn else record
                    return AppendResult(SessionInfo.from_record(record), 0, None, found)
                payload = bytes_view(rows)
                digest = turn_digest(payload)
                with self._reservations.reserve(journal.growth(len(payload))) as reservation:
                    total = journal.append_records(rows, validate=False)  # validated above
                    size = journal.size_bytes
                    new_wm = total if complete_turn else record["watermark"]
                    tokens = block_tokens(journal, rows, record["prefix_blocks"], count, new_wm)
                    now_ns = time.time_ns()
                    with ctx.index.write() as txn:
                        ctx.index.put_turn(txn, key, Turn(count, total, complete_turn, digest))
                        blocks = (
                            ctx.index.extend_prefix(txn, record, tokens)
                            if tokens is not None
                            else record["prefix_blocks"]
                        )
                        record = ctx.index.update(
                            txn,
                            key,
                            n_records=total,
                            watermark=new_wm,
                            size_bytes=size,
                            updated=now_ns / 1e9,
                            last_used=now_ns / 1e9,
                            last_used_ns=now_ns,
                            prefix_blocks=blocks,
                        )
                        self._reservations.settle(txn, reservation)
        self._evictor.after_write(key)
        return AppendResult(SessionInfo.from_record(record), total - count, (count, total), found)

    @staticmethod
    def _sanitized(
        records: np.ndarray | bytes | bytearray | memoryview, journal: KVFile
    ) -> tuple[np.ndarray | bytes | bytearray | memoryview, Sanitized]:
        """Raw records with their non-finite f32 values set to 0 (``formats.nonfinite.sanitize_records``).
        Bytes that are not whole records are passed on for the journal's validation to refuse."""
        dtype = coli_kv.record_dtype(journal.geometry, journal.tier)
        if not isinstance(records, np.ndarray):
            raw = memoryview(records).cast("B")
            if len(raw) % dtype.itemsize:
                return records, Sanitized()
            records = np.frombuffer(raw, dtype=dtype)
        elif records.dtype != dtype:
            return records, Sanitized()
        return nonfinite.sanitize_records(records, journal.tier)

    def _mark_complete(self, record: IndexRecord, journal: KVFile) -> IndexRecord:
        """Mark the rows appended so far as a complete turn (the watermark moves to the count)."""
        ctx = self.ctx
        sid = record["id"]
        if record["watermark"] == record["n_records"]:
            return record
        tokens = block_tokens(journal, None, record["prefix_blocks"], record["n_records"], record["n_records"])
        with ctx.index.write() as txn:
            turns = ctx.index.turns(txn, sid)
            if turns:
                ctx.index.put_turn(txn, sid, turns[-1]._replace(complete=True))
            blocks = ctx.index.extend_prefix(txn, record, tokens) if tokens is not None else record["prefix_blocks"]
            return ctx.index.update(txn, sid, watermark=record["n_records"], updated=time.time(), prefix_blocks=blocks)

    # ------------------------------------------------------------------ truncate
    def truncate(self, session_id: str, n_records: int, owner: str | None) -> SessionInfo:
        """Keep the first ``n_records`` records (the index commits first, then the journal is cut)."""
        ctx = self.ctx
        validate_key(session_id)
        if not isinstance(n_records, (int, np.integer)) or isinstance(n_records, bool) or n_records < 0:
            raise InvalidRequest("n_records must be a non-negative integer")
        n_records = int(n_records)
        with ctx.writing(session_id):
            record = self._parking.active_locked(session_id, owner)
            if n_records > record["n_records"]:
                raise InvalidRequest(
                    f"session {public_id(session_id)!r} holds {record['n_records']} records; "
                    f"cannot truncate to {n_records}"
                )
            with ctx.open_journal(record, writable=True) as journal:
                record = self._recovery.match_journal(record, journal)
                if n_records == record["n_records"]:
                    return SessionInfo.from_record(record)
                with ctx.reading(session_id, exclusive=True):
                    record = self._removal.cut(record, journal, n_records, complete=n_records <= record["watermark"])
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ fork
    def fork(
        self, session_id: str, at: int | None, new_id: str, owner: str | None, tags: Iterable[str] | None
    ) -> SessionInfo:
        """Copy the first ``at`` records into a new session (key ``new_id``, the source owner's),
        published atomically, then indexed."""
        ctx = self.ctx
        validate_key(session_id)
        validate_key(new_id)
        exists = f"session {public_id(new_id)!r} already exists"  # only ever the caller's own
        if new_id == session_id:
            raise SessionExists(exists)
        owner_of_fork = schema.key_owner(new_id) or ""
        with ctx.index.read() as txn:
            self._refuse_past_cap(txn, owner_of_fork)  # before any lock or file: a refusal leaves nothing
        with ctx.writing(new_id):
            self._removal.finish_interrupted_delete(new_id)
            with ctx.index.read() as txn:
                if ctx.index.get(txn, new_id) is not None:
                    raise SessionExists(exists)
            path = ctx.journal_path(new_id)
            self._clear_orphan(new_id, path)
            with ctx.reading(session_id):
                source = ctx.record(session_id, owner)
                refuse_damaged(source)
                at = source["watermark"] if at is None else at
                if not isinstance(at, (int, np.integer)) or isinstance(at, bool) or not 0 <= at <= source["n_records"]:
                    raise InvalidRequest(f"fork point must be in 0..{source['n_records']}, got {at!r}")
                at = int(at)
                geometry, tier = geometry_of(source), tier_of(source)
                rec_bytes = coli_kv.record_bytes(geometry, tier)
                new_wm = min(source["watermark"], at)
                with ctx.index.read() as txn:
                    turns = [t for t in ctx.index.turns(txn, session_id) if t.start < at]
                    blocks = min(source["prefix_blocks"], new_wm // schema.PREFIX_BLOCK_TOKENS)
                    chain = ctx.index.prefix_chain(txn, session_id, blocks)
                if turns and turns[-1].end > at:
                    turns[-1] = self._integrity.rehash_prefix(source, turns[-1], at, complete=at <= source["watermark"])
                size = HEADER_BYTES + at * rec_bytes
                if ctx.keyring is not None:  # at most: the copy's frames, one chunk of records at a time
                    size = sealed_bytes_bound(at * rec_bytes, rec_bytes, COPY_CHUNK_BYTES)
                with self._reservations.reserve(size) as reservation:
                    chunks = (np.frombuffer(c, np.uint8) for c in record_chunks(ctx, source, 0, at))
                    try:
                        sealing = ctx.sealing(new_id)
                        if sealing is None:
                            write_atomic(
                                path, Header(geometry, tier, at), CountingChunks(chunks, rec_bytes), replace=False
                            )
                        else:  # the copy is sealed anew: its own salt, bound to the fork's identity
                            size = write_sealed(
                                path,
                                sealing,
                                Header(geometry, tier, at),
                                CountingChunks(chunks, rec_bytes),
                                replace=False,
                            )
                    except FileExistsError:
                        raise
                    except BaseException:
                        # write_atomic can fail after publishing the copy (its directory fsync): the
                        # copy is ours and indexed nowhere, so take it back before reporting, or the
                        # same fork again would find an unindexed journal in its way.
                        unlink_quietly(path)
                        raise
                    now_ns = time.time_ns()
                    record: IndexRecord = {
                        **source,
                        "id": new_id,
                        "n_records": at,
                        "watermark": new_wm,
                        "created": now_ns / 1e9,
                        "updated": now_ns / 1e9,
                        "last_used": now_ns / 1e9,
                        "last_used_ns": now_ns,
                        "size_bytes": size,  # the copy write_atomic just wrote, header and records
                        "tags": validate_tags(source["tags"] if tags is None else tags),
                        "state": "active",
                        "parent": session_id,
                        "fork_point": at,
                        "problem": None,
                        "prefix_blocks": len(chain),
                    }
                    try:
                        with ctx.index.write() as txn:
                            self._refuse_past_cap(txn, owner_of_fork)
                            ctx.index.put(txn, record)
                            for turn in turns:
                                ctx.index.put_turn(txn, new_id, turn)
                            ctx.index.put_prefix_blocks(txn, new_id, 0, chain)
                            self._reservations.settle(txn, reservation)
                    except BaseException:
                        path.unlink(missing_ok=True)
                        raise
        self._evictor.after_write(new_id)
        return SessionInfo.from_record(record)
