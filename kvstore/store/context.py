"""What every concern of one store shares: its folders, its index, its per-session locks, its limits.

The concern objects (budget, integrity, parking, recovery, ...) each hold this context and read and
change sessions through it: the confined paths of a session's files, the two locks of a session,
the index record (read it, update it in a transaction, mark it damaged) and its open journal.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from kvstore.errors import (
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    IntegrityError,
    PathRefused,
    SessionDamaged,
    SessionNotFound,
)
from kvstore.journal import KVFile
from kvstore.locks import FileLock
from kvstore.store import records
from kvstore.store.index import Index
from kvstore.store.values import Progress, geometry_of, tier_of, validate_session_id

DIR_MODE = 0o700  # conversations are private: owner-only folders


class StoreContext:
    """The folders, index, locks and limits of the store rooted at ``data_dir``.

    Parameters
    ----------
    data_dir : the store's folder (created 0700 if missing)
    budget_bytes, hard_limit_bytes : the disk limits (validated by the caller; None: none)
    map_size : the LMDB map size of the index in bytes
    lock_timeout : seconds an operation waits for a session another writer holds
    progress : callback ``(done, total)`` for index schema upgrades on open

    Raises
    ------
    PathRefused : one of the store's folders is a symbolic link
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        budget_bytes: int | None,
        hard_limit_bytes: int | None,
        map_size: int,
        lock_timeout: float,
        progress: Progress | None,
    ):
        self.budget_bytes = budget_bytes
        self.hard_limit_bytes = hard_limit_bytes
        self.lock_timeout = lock_timeout
        root = Path(data_dir)
        root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self.data_dir = root.resolve()
        self.journals = self._folder("journals")
        self.archives = self._folder("archive")
        self.locks = self._folder("locks")
        self.lost_found = self._folder("lost+found")
        self._folder("index")
        self.index = Index(
            self.data_dir / "index", map_size=map_size, tokens_of=self._tokens_for_schema, progress=progress
        )

    def close(self) -> None:
        self.index.close()

    # ------------------------------------------------------------------ paths
    def _folder(self, name: str) -> Path:
        path = self.data_dir / name
        if path.is_symlink():
            raise PathRefused(
                f"{path} is a symbolic link; the store's folders must be real folders inside {self.data_dir}"
            )
        path.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(path, DIR_MODE)
        return path

    def _confined(self, folder: Path, name: str) -> Path:
        path = folder / name
        # The name comes from a validated id, so only a symbolic link can lead out of the folder.
        if path.is_symlink():
            raise PathRefused(
                f"{folder.name}/{name} is a symbolic link; session files must be regular files in {folder}"
            )
        return path

    def journal_path(self, session_id: str) -> Path:
        return self._confined(self.journals, f"{validate_session_id(session_id)}.coli_kv")

    def archive_path(self, session_id: str) -> Path:
        return self._confined(self.archives, f"{validate_session_id(session_id)}.coli_kv.zst")

    # ------------------------------------------------------------------ locks (order: write, then read)
    def writing(self, session_id: str, timeout: float | None = None) -> FileLock:
        """The session's write lock (not yet held): one mutation of a session at a time."""
        return FileLock(
            self.locks / f"{session_id}.write",
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {session_id!r} is being changed by another request; try again",
        )

    def reading(self, session_id: str, *, exclusive: bool = False, timeout: float | None = None) -> FileLock:
        """The session's read lock (not yet held): shared by readers, exclusive to shrink or replace files."""
        return FileLock(
            self.locks / f"{session_id}.read",
            shared=not exclusive,
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {session_id!r} is being read; try again when the download ends",
        )

    # ------------------------------------------------------------------ index records
    @staticmethod
    def visible(record: dict | None, owner: str | None) -> TypeGuard[dict]:
        """Whether ``owner`` (None: anyone) may see ``record`` (a session being deleted is gone)."""
        return record is not None and record["state"] != "deleting" and (owner is None or record["owner"] == owner)

    def record(self, session_id: str, owner: str | None = None) -> dict:
        """The visible index record of ``session_id`` (SessionNotFound otherwise, owner or not)."""
        validate_session_id(session_id)
        with self.index.read() as txn:
            record = self.index.get(txn, session_id)
        if not self.visible(record, owner):
            raise SessionNotFound(f"no session {session_id!r}")
        return record

    def update(self, txn, session_id: str, **changes: Any) -> dict:
        """Re-read a record inside ``txn`` and apply ``changes`` (readers update last_used concurrently)."""
        current = self.index.get(txn, session_id)
        if current is None:
            raise SessionNotFound(f"no session {session_id!r}")
        updated = {**current, **changes}
        self.index.put(txn, updated, current)
        return updated

    def mark_damaged(self, session_id: str, reason: str) -> None:
        with self.index.write() as txn:
            record = self.index.get(txn, session_id)
            if record is not None and record["state"] != "deleting":
                self.update(txn, session_id, state="damaged", problem=reason)

    def touch(self, session_id: str) -> None:
        """Record a use of the session (its place in the LRU order)."""
        now_ns = time.time_ns()
        with self.index.write() as txn:
            record = self.index.get(txn, session_id)
            if record is not None and record["state"] != "deleting":
                self.update(txn, session_id, last_used=now_ns / 1e9, last_used_ns=now_ns)

    # ------------------------------------------------------------------ journals
    def open_journal(self, record: dict, *, writable: bool) -> KVFile:
        """The session's journal, checked against its index record; a missing or mismatched one marks
        the session damaged (:class:`SessionDamaged`)."""
        sid = record["id"]
        path = self.journal_path(sid)
        try:
            return KVFile.open(
                path,
                geometry=geometry_of(record),
                tier=tier_of(record),
                writable=writable,
                lock_timeout=self.lock_timeout,
            )
        except FileNotFoundError:
            reason = f"the journal of session {sid!r} is missing"
        except (GeometryMismatch, CodecMismatch, FormatError) as exc:
            reason = f"the journal of session {sid!r} does not match its index entry: {exc.reason}"
        self.mark_damaged(sid, reason)
        raise SessionDamaged(reason + "; the session is marked damaged (delete it, or restore the file and reopen)")

    def _tokens_for_schema(self, record: dict, n_records: int) -> np.ndarray | None:
        """A session's tokens for an index schema step (None when its files cannot give them)."""
        try:
            return records.tokens_of(self, record, n_records)
        except (OSError, IntegrityError, PathRefused):
            return None
