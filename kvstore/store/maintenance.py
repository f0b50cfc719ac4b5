"""The file tools on stored sessions (inspect, repair, migrate) and expiry.

- **inspect** reports what a session's file holds (header, sizes, what a loader would neutralize).
- **repair** makes the journal and the index agree and drops what cannot be trusted: bytes past
  the acknowledged count and, from the first turn whose hash no longer matches, every record on.
- **migrate** converts a session to another tier: the turns are verified first, the journal is
  rewritten atomically through ``kvstore.migrations``, and the index takes the new tier,
  fingerprint, turn hashes and prefix blocks in one transaction. It runs as one line: the session
  resolved once by the facade (a ``SessionHandle``), its write lock, ``Parking.open_active`` (the
  record read again, the journal opened and settled), the turns read and checked against the
  loaded records, the rewrite under the exclusive read lock, the index transaction, the evictor.
- **expiry**: a session's own time-to-live (``set_ttl``) and an owner's default (``set_owner_ttl``),
  counted from the session's last use (its ``last_used_ns``: create, append, resume, a TTL change);
  the index keeps ``expires_ns`` in each record and an ``expiry`` range ordered by it. An expired
  session is invisible at once (``index.visible``); ``expire`` deletes a batch of them, soonest
  expired first, each under its two locks taken without waiting (one in use is left for a later
  sweep) and only if it is still expired when read again under them (``Removal.delete_locked``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import zstandard

from kvstore.durable import PreviousImage, write_atomic
from kvstore.errors import IntegrityError, JournalLocked, JournalWriteError, SessionNotFound
from kvstore.filetools import Scan, scan_stream
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry, Header
from kvstore.journal import open_regular
from kvstore.migrations import formats as format_migrations
from kvstore.migrations import index as schema
from kvstore.sealed import read_any_header, sealed_bytes_bound, write_sealed
from kvstore.store import archive
from kvstore.store.budget import Evictor, Reservations
from kvstore.store.context import JOURNAL_UNUSABLE, SessionHandle, StoreContext
from kvstore.store.integrity import Integrity, TurnHasher, complete_end, first_bad_turn
from kvstore.store.parking import Parking
from kvstore.store.records import bytes_view, sealed_source
from kvstore.store.recovery import Recovery
from kvstore.store.removal import Removal
from kvstore.store.results import Expiry, RepairReport, records_report
from kvstore.store.values import (
    Fingerprint,
    IndexRecord,
    ModelInfo,
    Progress,
    SessionInfo,
    check_record_size,
    check_ttl,
    public_id,
    stored_tier,
    tier_record,
    validate_key,
    validate_owner,
)
from kvstore.tiers import Tier

#: Compressed bytes read from an archive at a time while it is inspected.
ARCHIVE_READ_BYTES = 256 << 10


class Maintenance:
    """Inspect, repair and migrate the sessions of one store."""

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

    def inspect(self, session_id: str, owner: str | None) -> dict[str, Any]:
        """What the session's file holds: header fields, sizes and what a loader would neutralize.

        The journal (or the parked archive, decompressed as it is read) is judged a chunk at a time
        (``filetools.scan_stream``): a call holds one chunk (``filetools.CHUNK_BYTES``) and what
        judging a slice of it takes, whatever the session's size.
        """
        ctx = self.ctx
        ctx.record(session_id, owner)
        with ctx.reading(session_id):
            record = ctx.record(session_id, owner)
            out: dict[str, Any] = {"session": SessionInfo.from_record(record).to_dict()}
            with ctx.index.read() as txn:
                out["turns"] = len(ctx.index.turns(txn, session_id))
            if ctx.keyring is not None and record["state"] in ("active", "parked"):
                scan, out["file"] = _scan_sealed(ctx, record)  # the records decrypted, as a journal holds them
            elif record["state"] == "active":
                path = ctx.journal_path(session_id)
                scan = _scan_journal(ctx.open_journal_fd(session_id))
                out["file"] = {"path": f"journals/{path.name}", "bytes": scan.file_size}
            elif record["state"] == "parked":
                path = ctx.archive_path(session_id)
                scan, archive_bytes = _scan_archive(path)
                out["file"] = {"path": f"archive/{path.name}", "bytes": archive_bytes, "journal_bytes": scan.file_size}
            else:
                out["file"] = None
                out["problems"] = [record.get("problem")]
                return out
        out.update(records_report(scan))
        return out

    def repair(
        self, session_id: str, owner: str | None, dry_run: bool, progress: Progress | None = None
    ) -> RepairReport:
        """Drop a torn or unacknowledged tail and every record from the first bad turn on."""
        ctx = self.ctx
        validate_key(session_id)
        with ctx.writing(session_id):
            record = self._parking.active_locked(session_id, owner)
            with ctx.open_journal(record, writable=True) as journal, ctx.reading(session_id, exclusive=True):
                actions: list[str] = []
                on_disk, indexed = journal.n_records, record["n_records"]
                limit = min(on_disk, indexed)
                if on_disk > indexed:
                    actions.append(f"drop {on_disk - indexed} unacknowledged records past record {indexed}")
                elif on_disk < indexed:
                    actions.append(f"the journal holds {on_disk} of the {indexed} indexed records: shorten the index")
                extra = journal.size_bytes - journal.committed_bytes  # a sealed journal's frames included
                if extra > 0:
                    actions.append(f"cut {extra} bytes past the last committed record")
                with ctx.index.read() as txn:
                    whole = [t for t in ctx.index.turns(txn, session_id) if t.end <= limit]
                _, bad = self._integrity.check_turns(record, whole, limit, progress)
                keep = whole[bad].start if bad is not None else (whole[-1].end if whole else 0)
                first_bad = {"turn": bad, "start": whole[bad].start, "end": whole[bad].end} if bad is not None else None
                why = None
                if keep < limit:
                    why = (
                        f"turn {bad} (records {whole[bad].start}..{whole[bad].end}) does not match its hash"
                        if bad is not None
                        else "records not covered by a turn hash"
                    )
                    actions.append(f"drop records {keep}..{limit}: {why}")
                if not dry_run and actions:
                    if keep < indexed:
                        record = self._removal.cut(
                            record,
                            journal,
                            keep,
                            complete=False,
                            watermark=complete_end(whole, keep, record),
                            problem=f"repaired: {why or 'the journal was shorter than the index'}",
                        )
                    else:
                        journal.truncate(indexed)  # also cuts a torn tail
                        with ctx.index.write() as txn:
                            record = ctx.index.update(txn, session_id, size_bytes=journal.size_bytes)
        dropped = (indexed - keep) + max(on_disk - indexed, 0)
        return RepairReport(session_id, dry_run, actions, keep, dropped, first_bad)

    def migrate(self, session: SessionHandle, tier: Tier, progress: Progress | None) -> SessionInfo:
        """Convert a session's journal to another tier (see the module docstring)."""
        ctx, key = self.ctx, session.key
        with session.writing:
            record = self._parking.active(session)
            source_tier, geometry = stored_tier(record["tier"]), Geometry(*record["geometry"])
            if tier == source_tier:
                return SessionInfo.from_record(record)
            check_record_size(geometry, tier)
            format_migrations.plan(source_tier, tier)
            try:
                journal = ctx.open_journal_file(session.journal, geometry, source_tier, writable=True)
            except JOURNAL_UNUSABLE as exc:
                raise ctx.journal_damaged(key, exc) from None
            with journal:
                if not journal.holds(record["n_records"]):
                    record = self._recovery.match_journal(record, journal)
                with ctx.index.read() as txn:
                    turns = ctx.index.turns(txn, key)
                records = journal.load().slice(0, record["n_records"])
                if journal.upgrade_pending:  # loaded in the active tier: hash the bytes as stored
                    _, bad = self._integrity.check_turns(record, turns, record["n_records"])
                else:  # the records just loaded are the journal's bytes
                    stored = [bytes_view(records.records)]
                    _, bad = first_bad_turn(turns, record["n_records"], stored, records.header.rec_bytes)
                if bad is not None:
                    raise IntegrityError(
                        f"turn {bad} of session {session.id!r} does not match its hash; repair the session before migrating"
                    )
                new_rec_bytes = coli_kv.record_bytes(geometry, tier)
                total = records.n
                done = [0]

                def step(n: int, _total: int) -> None:
                    done[0] += n
                    if progress is not None:
                        progress(min(done[0], total), total)

                hasher = TurnHasher(turns, new_rec_bytes)
                chunks = hasher.wrap(format_migrations.convert_chunks(records, tier, progress=step))
                size = HEADER_BYTES + total * new_rec_bytes
                if ctx.keyring is not None:
                    size = sealed_bytes_bound(total * new_rec_bytes, new_rec_bytes, 1 << 20)
                with (
                    self._reservations.reserve(size) as reservation,
                    session.replacing,
                    PreviousImage(journal.path) as previous,
                ):
                    unsynced = None
                    try:
                        sealing = ctx.sealing(key)
                        if sealing is None:
                            write_atomic(journal.path, Header(geometry, tier, total), chunks, replace=True)
                        else:  # an encrypted store: the new tier's records sealed anew (kvstore.sealed)
                            size = write_sealed(
                                journal.path, sealing, Header(geometry, tier, total), chunks, replace=True
                            )
                    except JournalWriteError as exc:
                        if read_any_header(journal.path).tier != tier:
                            raise  # the old journal is in place: nothing changed
                        # The rename happened and a later step (the directory fsync) failed: the
                        # journal is in the new tier now, so the index must follow it before the
                        # failure is reported (else the next call finds a journal it cannot open).
                        unsynced = exc
                    new_turns = hasher.turns()
                    model = ModelInfo.from_dict(record["model"])
                    fingerprint = Fingerprint(model, geometry, tier).key()
                    hashes = schema.chain_hashes(
                        schema.chain_seed(record["owner"], fingerprint), records.tokens[: record["watermark"]]
                    )
                    try:
                        with ctx.index.write() as txn:
                            ctx.index.drop_turns_after(txn, key, -1)
                            for turn in new_turns:
                                ctx.index.put_turn(txn, key, turn)
                            ctx.index.drop_prefix_blocks_from(txn, key, 0)
                            ctx.index.put_prefix_blocks(txn, key, 0, hashes)
                            record = ctx.index.update(
                                txn,
                                key,
                                tier=tier_record(tier),
                                fingerprint=fingerprint,
                                prefix_blocks=len(hashes),
                                size_bytes=size,  # what write_atomic wrote (``journal`` holds the old file)
                                updated=time.time(),
                            )
                            self._reservations.settle(txn, reservation)
                    except BaseException:
                        # The index (full, failing) still describes the old journal: put it back,
                        # or the next call would find a journal in a tier its entry does not name.
                        previous.restore()
                        raise
                    if unsynced is not None:
                        raise JournalWriteError(
                            f"session {session.id!r} was migrated to {tier.describe()}, but syncing the journal's folder failed "
                            f"({unsynced.__cause__}); a power loss now may bring the old journal back (the store follows whichever it finds)"
                        ) from unsynced
                    try:
                        previous.discard()
                    except OSError as exc:  # committed: the call took effect, and says what is left over
                        raise JournalWriteError(
                            f"session {session.id!r} was migrated to {tier.describe()}, but removing the previous "
                            f"journal kept during the rewrite (journals/{previous.link_name}) failed ({exc.strerror or exc}); "
                            f"`kvstore verify --repair` or the next start of the store removes it"
                        ) from exc
        self._evictor.after_write(key)
        return SessionInfo.from_record(record)

    # ------------------------------------------------------------------ expiry
    def set_ttl(self, key: str, owner: str | None, ttl_s: float | None) -> IndexRecord:
        """Set (None: drop) the session's own time-to-live under its write lock; the change is a use
        of the session, so it expires ``ttl_s`` seconds from now (or by its owner's TTL)."""
        ttl_s = check_ttl(ttl_s)
        ctx = self.ctx
        with ctx.writing(key):
            ctx.record(key, owner)  # gone (expired, swept, deleted) while the lock was awaited: 404
            now_ns = time.time_ns()
            with ctx.index.write() as txn:
                return ctx.index.update(txn, key, ttl_s=ttl_s, last_used=now_ns / 1e9, last_used_ns=now_ns)

    def set_owner_ttl(self, owner: str, ttl_s: float | None) -> int:
        """Set (None: drop) ``owner``'s default time-to-live; returns how many of its sessions (those
        without a TTL of their own) now expire by it, counted from each one's last use."""
        validate_owner(owner)
        ttl_s = check_ttl(ttl_s)
        with self.ctx.index.write() as txn:
            return self.ctx.index.set_owner_ttl(txn, owner, ttl_s)

    def owner_ttl(self, owner: str) -> float | None:
        validate_owner(owner)
        with self.ctx.index.read() as txn:
            return self.ctx.index.owner_ttl(txn, owner)

    def expire(self, limit: int) -> list[Expiry]:
        """Delete at most ``limit`` expired sessions, soonest expired first (see the module docstring)."""
        ctx = self.ctx
        now_ns = time.time_ns()
        with ctx.index.read() as txn:
            keys = ctx.index.expired_keys(txn, now_ns, limit)
            expiries = {key: (ctx.index.get(txn, key) or {}).get("expires_ns") for key in keys}
        swept: list[Expiry] = []
        for key in keys:
            try:
                with ctx.writing(key, timeout=0):
                    freed = self._removal.delete_locked(key, None, read_timeout=0, expired_at=now_ns)
            except (JournalLocked, SessionNotFound):
                continue  # in use (a writer, a reader), or deleted meanwhile: a later sweep sees it again
            if freed is None:
                continue  # used again since the expiry range was read: kept
            ctx.stats.expired(freed)
            when = expiries.get(key)
            swept.append(Expiry(public_id(key), ctx.owner_of(key), (when or now_ns) / 1e9, freed))
        return swept


# ---------------------------------------------------------------------------- inspect, a chunk at a time
def _scan_sealed(ctx: StoreContext, record: IndexRecord) -> tuple[Scan, dict[str, Any]]:
    """Judge an encrypted store's session as its plaintext journal image (decrypted in memory),
    and name its file with the bytes it takes on disk."""
    with sealed_source(ctx, record) as source:
        image = source.header.to_bytes() + source.read_range(0, source.n_records)
    offset = 0

    def readinto(view: memoryview) -> int:
        nonlocal offset
        n = min(len(view), len(image) - offset)
        view[:n] = image[offset : offset + n]
        offset += n
        return n

    scan = scan_stream(readinto, size=len(image))
    if record["state"] == "active":
        path = ctx.journal_path(record["id"])
        return scan, {"path": f"journals/{path.name}", "bytes": path.stat().st_size}
    path = ctx.archive_path(record["id"])
    return scan, {"path": f"archive/{path.name}", "bytes": path.stat().st_size, "journal_bytes": len(image)}


def _scan_journal(fd: int) -> Scan:
    """Judge the journal open at ``fd`` (closed here) up to its size when opened."""
    try:
        size, offset = os.fstat(fd).st_size, 0

        def readinto(view: memoryview) -> int:
            nonlocal offset
            n = os.preadv(fd, [view[: max(0, size - offset)]], offset) if offset < size else 0
            offset += n
            return n

        return scan_stream(readinto, size=size)
    finally:
        os.close(fd)


def _scan_archive(path: Path) -> tuple[Scan, int]:
    """Judge a parked session's journal as its archive decompresses, a chunk at a time; returns the
    scan and the archive's size. The frame's recorded size bounds what is allocated, its checksum is
    checked at the end (a damaged archive is :class:`IntegrityError`, as ``archive`` reads it)."""
    journal_bytes = archive.content_size(path)
    fd = open_regular(path, os.O_RDONLY, what="an archive")
    try:
        with os.fdopen(fd, "rb") as raw:
            archive_bytes = os.fstat(raw.fileno()).st_size
            with zstandard.ZstdDecompressor().stream_reader(raw, read_size=ARCHIVE_READ_BYTES) as stream:
                return scan_stream(stream.readinto, size=journal_bytes), archive_bytes
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"archive {path.name} is damaged ({exc}); it cannot be restored") from None
