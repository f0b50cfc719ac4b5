"""Shortening and removing sessions, index first: a crash in between is finished by recovery.

- **cut** (truncate, repair, a journal that lost its tail): the index commits the shorter count
  (with the cut turn re-hashed and the prefix blocks past the new watermark dropped), then the
  journal is cut. A crash in between leaves journal records the index does not count: they are
  rolled back on open, as an unacknowledged append is.
- **delete**: the index hides the session (state ``deleting``), the files go, the entries go. A
  delete that stops after hiding is finished by the next delete of the id, a create or fork into
  it, or the next store open.
- **expiry** deletes the same way (``delete_locked(..., expired_at=)``, from the sweep
  ``Maintenance.expire``): the record is read again under both locks and the session is deleted only
  if it is still expired then (an append or resume since moved its expiry: it is kept). A create
  into the id of an expired session not yet swept deletes it first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvstore.durable import fsync_dir, write_errors
from kvstore.errors import SessionNotFound
from kvstore.journal import KVFile
from kvstore.migrations import index as schema
from kvstore.store.context import StoreContext
from kvstore.store.integrity import Integrity
from kvstore.store.values import IndexRecord, expired, public_id


def unlink_quietly(path: Path) -> None:
    """Remove a file whose removal is housekeeping only (a failure leaves a harmless leftover)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class Removal:
    """Cut and delete for the sessions of one store (the caller holds the session's write lock)."""

    def __init__(self, ctx: StoreContext, integrity: Integrity):
        self.ctx = ctx
        self._integrity = integrity

    def cut(
        self,
        record: IndexRecord,
        journal: KVFile,
        keep: int,
        *,
        complete: bool,
        watermark: int | None = None,
        problem: str | None = None,
    ) -> IndexRecord:
        """Index first, then journal: shorten a session to ``keep`` records (locks held).

        The watermark becomes ``min(watermark, keep)`` unless given; a turn cut by ``keep`` is
        checked against its hash and re-hashed (``complete`` is its new flag).
        """
        ctx = self.ctx
        sid = record["id"]
        with ctx.index.read() as txn:
            turns = ctx.index.turns(txn, sid)
        straddler = next((t for t in turns if t.start < keep < t.end), None)
        replacement = None
        if straddler is not None:
            replacement = self._integrity.rehash_prefix(record, straddler, keep, complete)
        new_wm = min(record["watermark"], keep) if watermark is None else min(watermark, keep)
        changes: dict[str, Any] = {
            "n_records": keep,
            "watermark": new_wm,
            "size_bytes": journal.size_after_truncate(keep),  # a sealed journal's frames too
            "updated": time.time(),
            "prefix_blocks": min(record["prefix_blocks"], new_wm // schema.PREFIX_BLOCK_TOKENS),
        }
        if problem is not None:
            changes["problem"] = problem
        with ctx.index.write() as txn:
            ctx.index.drop_turns_after(txn, sid, keep)
            if replacement is not None:
                ctx.index.put_turn(txn, sid, replacement)
            ctx.index.drop_prefix_blocks_from(txn, sid, changes["prefix_blocks"])
            record = ctx.index.update(txn, sid, **changes)
        journal.truncate(keep)
        return record

    def delete_locked(
        self,
        session_id: str,
        owner: str | None,
        *,
        read_timeout: float | None = None,
        expired_at: int | None = None,
    ) -> int | None:
        """Hide the session, remove its files, drop its entries (write lock held); returns the bytes
        it held.

        ``expired_at`` (ns since the epoch): delete only a session expired at that instant, checked
        on the record read under both locks; one whose expiry moved since (used again, its TTL
        changed) is left as it is, and None is returned.
        """
        ctx = self.ctx
        with ctx.reading(session_id, exclusive=True, timeout=read_timeout):
            with ctx.index.read() as txn:
                record = ctx.index.get(txn, session_id)
            # A session a failed delete already hid ("deleting") is finished by deleting it again.
            if record is None or (owner is not None and record["owner"] != owner):
                raise SessionNotFound(f"no session {public_id(session_id)!r}")
            if expired_at is not None and (record["state"] == "deleting" or not expired(record, expired_at)):
                return None
            freed = int(record["size_bytes"])
            if record["state"] != "deleting":
                with ctx.index.write() as txn:
                    ctx.index.update(txn, session_id, state="deleting")  # invisible from here on
            with write_errors(
                f"deleting session {public_id(session_id)!r}",
                "the session is hidden; deleting it again (or reopening the store) removes what is left",
            ):
                self.remove_files(session_id)
            with ctx.index.write() as txn:
                current = ctx.index.get(txn, session_id)
                if current is not None:
                    ctx.index.remove(txn, current)
        for suffix in (".read", ".write"):
            unlink_quietly(ctx.locks / f"{session_id}{suffix}")  # a lock file left behind is harmless
        return freed

    def finish_interrupted_delete(self, session_id: str) -> None:
        """Finish a delete that hid ``session_id`` but could not remove its files, or delete it if
        it expired and the sweep has not come yet (write lock held), so the id can be used again."""
        with self.ctx.index.read() as txn:
            record = self.ctx.index.get(txn, session_id)
        if record is None:
            return
        if record["state"] == "deleting":
            self.delete_locked(session_id, None)
        elif expired(record, now := time.time_ns()):
            self.delete_locked(session_id, None, expired_at=now)

    def remove_files(self, session_id: str) -> None:
        """Unlink the session's journal, archive and journal lock sidecar; make the unlinks durable."""
        ctx = self.ctx
        for path in (ctx.journal_path(session_id), ctx.archive_path(session_id)):
            path.unlink(missing_ok=True)
        (ctx.journals / f"{session_id}.coli_kv.lock").unlink(missing_ok=True)
        fsync_dir(ctx.journals)
        fsync_dir(ctx.archives)
