"""Parking: a session's journal compressed into its archive (``kvstore.store.archive``), and back.

- **park**: the archive is written atomically, the index switches to ``parked``, the journal is
  unlinked. A crash before the switch leaves an archive the index does not name (removed on open);
  after it, a journal the index no longer names (removed on the next unpark or open). A session
  being read when the park starts is refused at once (``JournalLocked``), before any work.
- **unpark**: the reverse, byte for byte: the journal is restored atomically from the archive and
  checked against the index, the index switches to ``active``, the archive is unlinked.

Readers of a parked session (verify, lookup) stream its archive under the session's read lock, so
both directions take the read lock exclusively for the switch and the unlink.

A write to a session starts here too (:meth:`Parking.active` and :meth:`Parking.open_active`,
under its write lock): the record read again, a parked session unparked, a damaged one refused, the
journal opened and, when it disagrees with the index, settled by ``recovery`` — so a write sees an
active session whose journal and index agree.
"""

from __future__ import annotations

import os
import time

from kvstore.durable import fsync_dir, write_errors
from kvstore.errors import IntegrityError, SessionDamaged
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import HEADER_BYTES, Geometry
from kvstore.journal import KVFile
from kvstore.store import archive
from kvstore.store.budget import Reservations
from kvstore.store.context import JOURNAL_UNUSABLE, SessionHandle, StoreContext
from kvstore.store.index import refuse_damaged
from kvstore.store.recovery import Recovery
from kvstore.store.values import IndexRecord, Progress, geometry_of, public_id, stored_tier, tier_of


class Parking:
    """Park and unpark the sessions of one store (the caller holds the session's write lock)."""

    def __init__(self, ctx: StoreContext, reservations: Reservations, recovery: Recovery):
        self.ctx = ctx
        self._reservations = reservations
        self._recovery = recovery

    def active_locked(self, session_id: str, owner: str | None) -> IndexRecord:
        """The record of an active session, unparking it first if needed (write lock held)."""
        record = self.ctx.record(session_id, owner)
        if record["state"] == "parked":
            record = self.unpark_locked(session_id, owner, None)
        refuse_damaged(record)
        return record

    def active(self, session: SessionHandle) -> IndexRecord:
        """The session's record read again (``session.writing`` held), unparking it first if it is
        parked; a damaged session is refused."""
        record = self.ctx.index.current(session.key, session.owner)
        if record["state"] == "parked":
            record = self.unpark_locked(session.key, session.owner, None)
        refuse_damaged(record)
        return record

    def open_active(self, session: SessionHandle) -> tuple[IndexRecord, KVFile]:
        """:meth:`active`, then the journal opened for writing: a missing or mismatched one marks the
        session damaged, and one that disagrees with the index (an unacknowledged tail, a lost one)
        is settled by ``recovery.match_journal`` before the write. Close the journal (``with``)."""
        record = self.active(session)
        try:
            journal = self.ctx.open_journal_file(
                session.journal, Geometry(*record["geometry"]), stored_tier(record["tier"]), writable=True
            )
        except JOURNAL_UNUSABLE as exc:
            raise self.ctx.journal_damaged(session.key, exc) from None
        try:
            if not journal.holds(record["n_records"]):
                record = self._recovery.match_journal(record, journal)
        except BaseException:
            journal.close()
            raise
        return record, journal

    def park_locked(
        self, session_id: str, owner: str | None, progress: Progress | None, *, read_timeout: float | None = None
    ) -> IndexRecord:
        """Compress the journal into the archive, then switch the index (see the module docstring)."""
        ctx = self.ctx
        record = ctx.record(session_id, owner)
        if record["state"] == "parked":
            return record
        refuse_damaged(record)
        # The switch below needs the read lock exclusively. A reader holding it now (a download, a
        # verify) is met before the journal is compressed, not after: the park is refused at once
        # (JournalLocked, nothing done) instead of compressing everything, then waiting for the
        # reader while holding the write lock that the session's appends wait for.
        with ctx.reading(session_id, exclusive=True, timeout=0):
            pass
        journal_path, archive_path = ctx.journal_path(session_id), ctx.archive_path(session_id)
        with ctx.open_journal(record, writable=True) as journal:  # also keeps outside writers off
            record = self._recovery.match_journal(record, journal)
            # the journal's committed bytes as they are: an encrypted store's archive holds its
            # sealed frames (still encrypted at rest, restored byte for byte, bound to the session)
            length = journal.committed_bytes
            fd = ctx.open_journal_fd(session_id)
            try:
                with write_errors(
                    f"parking session {public_id(session_id)!r}", "the session is still active and its journal intact"
                ):
                    archive_path.unlink(missing_ok=True)  # a leftover of a park that crashed before its commit
                    size = archive.compress_journal(fd, length, archive_path, progress=progress)
            finally:
                os.close(fd)
            try:
                with ctx.reading(session_id, exclusive=True, timeout=read_timeout):
                    with ctx.index.write() as txn:
                        record = ctx.index.update(txn, session_id, state="parked", size_bytes=size, updated=time.time())
                    with write_errors(
                        f"session {public_id(session_id)!r} was parked, but removing its journal",
                        "its archive holds every record; the journal left behind is removed on the next unpark or store open",
                    ):
                        journal_path.unlink()
                        fsync_dir(ctx.journals)
            except BaseException:
                with ctx.index.read() as txn:
                    still_active = (ctx.index.get(txn, session_id) or {}).get("state") == "active"
                if still_active:
                    archive_path.unlink(missing_ok=True)
                raise
        return record

    def unpark_locked(self, session_id: str, owner: str | None, progress: Progress | None) -> IndexRecord:
        """Restore the journal from the archive, then switch the index (see the module docstring)."""
        ctx = self.ctx
        record = ctx.record(session_id, owner)
        if record["state"] != "parked":
            refuse_damaged(record)
            return record
        journal_path, archive_path = ctx.journal_path(session_id), ctx.archive_path(session_id)
        try:
            size = archive.content_size(archive_path)
        except FileNotFoundError:
            reason = f"the archive of parked session {public_id(session_id)!r} is missing"
            ctx.mark_damaged(session_id, reason)
            raise SessionDamaged(reason) from None
        geometry, tier = geometry_of(record), tier_of(record)
        expected = HEADER_BYTES + record["n_records"] * coli_kv.record_bytes(geometry, tier)
        if ctx.keyring is None and size != expected:  # a sealed journal's size counts its frames: checked below
            raise IntegrityError(
                f"the archive of {public_id(session_id)!r} holds {size} bytes, the index expects {expected}"
            )
        with self._reservations.reserve(size) as reservation:
            with write_errors(
                f"unparking session {public_id(session_id)!r}", "the session is still parked and its archive intact"
            ):
                journal_path.unlink(missing_ok=True)  # a leftover of an unpark that crashed before its commit
                archive.restore_journal(archive_path, journal_path, progress=progress)
            committed = False
            try:
                header = self._restored_header(session_id, journal_path)
                if header.geometry != geometry or header.tier != tier or header.nrec != record["n_records"]:
                    raise IntegrityError(
                        f"the archive of {public_id(session_id)!r} does not hold the journal its index entry describes"
                    )
                # Readers of a parked session (verify, lookup) stream its archive under the read
                # lock: switch to the journal and remove the archive only when none is reading.
                with ctx.reading(session_id, exclusive=True):
                    with ctx.index.write() as txn:
                        record = ctx.index.update(txn, session_id, state="active", size_bytes=size, updated=time.time())
                        self._reservations.settle(txn, reservation)
                    committed = True
                    with write_errors(
                        f"session {public_id(session_id)!r} was unparked, but removing its archive",
                        "its journal holds every record; the archive left behind is removed on the next park or store open",
                    ):
                        archive_path.unlink()
                        fsync_dir(ctx.archives)
            except BaseException:
                if not committed:
                    journal_path.unlink(missing_ok=True)
                raise
        return record

    def _restored_header(self, session_id: str, journal_path) -> coli_kv.Header:
        """The header of a journal just restored from its archive (nrec: its committed records)."""
        sealing = self.ctx.sealing(session_id)
        if sealing is None:
            return coli_kv.read_header(journal_path)[0]
        with KVFile.open(journal_path, sealing=sealing, follow_symlinks=False) as journal:
            return journal.load_header()
