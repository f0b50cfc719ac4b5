"""What every concern of one store shares: its folders, its index, its per-session locks, its limits.

The concern objects (budget, integrity, parking, recovery, ...) each hold this context and read and
change sessions through it: the confined paths of a session's files, the two locks of a session,
the index record (read it, update it in a transaction, mark it damaged) and its open journal.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from kvstore.errors import (
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    IndexFull,
    IndexIOError,
    IntegrityError,
    InvalidRequest,
    JournalLocked,
    PathRefused,
    SessionDamaged,
    SessionNotFound,
)
from kvstore.journal import KVFile, fsync_dir, open_regular, write_errors
from kvstore.locks import FileLock
from kvstore.migrations import index as schema
from kvstore.store import records
from kvstore.store.index import Index
from kvstore.store.stats import StoreStats
from kvstore.store.values import (
    Progress,
    geometry_of,
    public_id,
    storage_key,
    tier_of,
    validate_key,
    validate_session_id,
)

DIR_MODE = 0o700  # conversations are private: owner-only folders


class SessionLock(FileLock):
    """A session's ``locks/<id>.write`` or ``.read``: its file exists only while the session does.

    Taken by a call for an id the index does not hold (one that never existed, a create or fork that
    failed, a delete that finished), the file is unlinked as the lock is released, so requests for
    missing ids leave nothing behind. Unlinking a held lock file is safe: a waiter that locked the
    unlinked inode sees the name no longer leads to it and locks the new file (``FileLock``). No
    holder of a missing session's lock is inside a critical section it shares with another: only
    create and fork add entries, under the write lock, and delete removes them under both locks.
    """

    def __init__(self, ctx: "StoreContext", session_id: str, path: Path, **options: Any):
        super().__init__(path, **options)
        self._ctx = ctx
        self._session_id = session_id

    def acquire(self) -> "SessionLock":
        try:
            super().acquire()
        except JournalLocked:
            if self.waited:  # a single try (timeout 0) that met a busy lock is not a timeout
                self._ctx.stats.lock_waited()
                self._ctx.stats.lock_timed_out()
            raise
        if self.waited:
            self._ctx.stats.lock_waited()
        return self

    def release(self) -> None:
        if self.held and self._sole_holder():
            try:
                gone = not self._ctx.indexed(self._session_id)
            except Exception:  # the index is closed or failing: a lock file left behind is harmless
                gone = False
            if gone:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
        super().release()

    def _sole_holder(self) -> bool:
        """Hold the file exclusively, and its name still leads to it: only then may it be unlinked.

        A shared holder that unlinked while another reader still held the file could, between its
        index check and the unlink, remove the name of a new file that a create-then-truncate had
        just locked exclusively; the next reader would lock a third file and read beside the
        truncate. Upgrading without waiting fails while any other reader holds the file (flock drops
        the shared lock then, as the release would), so the last reader out removes it.
        """
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino
        except OSError:  # BlockingIOError: another holder; FileNotFoundError: already unlinked
            return False


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

    Each of the store's folders is opened once (``O_NOFOLLOW``) and kept open: lock files and
    journals are opened relative to those descriptors (``openat``), and a session file's path is
    handed out only while its folder is still the one opened (:meth:`_confined`), so a folder swapped
    for a link while the store runs never leads a write out of the data folder.
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
        self.stats = StoreStats()  # what operators see in GET /metrics (kvstore.store.stats)
        root = Path(data_dir)
        try:
            root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except FileExistsError:  # mkdir's exist_ok only forgives a folder
            raise PathRefused(
                f"the data folder {root} is not a folder (a file, or a symbolic link that leads nowhere or loops)"
            ) from None
        self.data_dir = root.resolve()
        self._folders: dict[Path, tuple[int, int, int]] = {}  # folder -> (descriptor, device, inode)
        try:
            self.journals = self._folder("journals")
            self.archives = self._folder("archive")
            self.locks = self._folder("locks")
            self.lost_found = self._folder("lost+found")
            self._folder("index")
            self.index = Index(
                self.data_dir / "index",
                map_size=map_size,
                tokens_of=self._tokens_for_schema,
                move_files=self._move_files_for_schema,
                progress=progress,
            )
        except BaseException:
            self._close_folders()
            raise

    def close(self) -> None:
        self.index.close()
        self._close_folders()

    def _close_folders(self) -> None:
        folders, self._folders = self._folders, {}
        for fd, _, _ in folders.values():
            os.close(fd)

    # ------------------------------------------------------------------ paths
    def _folder(self, name: str) -> Path:
        path = self.data_dir / name
        if path.is_symlink():
            raise PathRefused(
                f"{path} is a symbolic link; the store's folders must be real folders inside {self.data_dir}"
            )
        try:
            path.mkdir(mode=DIR_MODE, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):
            raise PathRefused(f"{path} is not a folder; the store keeps its {name} there") from None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise PathRefused(f"{path} is a symbolic link; the store's folders must be real folders") from None
        os.fchmod(fd, DIR_MODE)
        status = os.fstat(fd)
        self._folders[path] = (fd, status.st_dev, status.st_ino)
        return path

    def dir_fd(self, folder: Path) -> int:
        """The descriptor of one of the store's folders, open since the store opened."""
        return self._folders[folder][0]

    def _check_folder(self, folder: Path) -> None:
        """Refuse a folder that is no longer the one the store opened (replaced by a link or another folder)."""
        _, device, inode = self._folders[folder]
        try:
            status = os.lstat(folder)
            same = stat.S_ISDIR(status.st_mode) and (status.st_dev, status.st_ino) == (device, inode)
        except OSError:
            same = False
        if not same:
            raise PathRefused(
                f"{folder} was replaced while the store was open (by a symbolic link or another folder); "
                f"nothing was opened through it: put the folder back and restart the store"
            )

    def _confined(self, folder: Path, name: str) -> Path:
        path = folder / name
        # The name comes from a validated id, so only a symbolic link can lead out of the folder:
        # the folder itself (swapped while the store runs) or the file.
        self._check_folder(folder)
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return path
        if stat.S_ISLNK(mode):
            raise PathRefused(
                f"{folder.name}/{name} is a symbolic link; session files must be regular files in {folder}"
            )
        if not stat.S_ISREG(mode):
            raise PathRefused(f"{folder.name}/{name} is not a regular file; session files must be regular files")
        return path

    # Below this point a ``session_id`` is a storage key (``<id>~<owner>``, values.storage_key): the
    # facade turns the id and owner of a request into one with resolve() before any lock is taken.
    def journal_path(self, session_id: str) -> Path:
        return self._confined(self.journals, f"{validate_key(session_id)}.coli_kv")

    def archive_path(self, session_id: str) -> Path:
        return self._confined(self.archives, f"{validate_key(session_id)}.coli_kv.zst")

    def open_journal_fd(self, session_id: str) -> int:
        """A read-only descriptor of the session's journal, opened relative to ``journals/`` without
        following a link: a link, folder or FIFO put there after the path was checked is
        :class:`PathRefused`, never read or waited on. ``FileNotFoundError`` when it is missing."""
        return open_regular(self.journal_path(session_id), os.O_RDONLY, self.dir_fd(self.journals))

    # ------------------------------------------------------------------ locks (order: write, then read)
    def writing(self, session_id: str, timeout: float | None = None) -> FileLock:
        """The session's write lock (not yet held): one mutation of a session at a time."""
        return SessionLock(
            self,
            session_id,
            self.locks / f"{session_id}.write",
            dir_fd=self.dir_fd(self.locks),
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {public_id(session_id)!r} is being changed by another request; try again",
        )

    def reading(self, session_id: str, *, exclusive: bool = False, timeout: float | None = None) -> FileLock:
        """The session's read lock (not yet held): shared by readers, exclusive to shrink or replace files."""
        return SessionLock(
            self,
            session_id,
            self.locks / f"{session_id}.read",
            dir_fd=self.dir_fd(self.locks),
            shared=not exclusive,
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=f"session {public_id(session_id)!r} is being read; try again when the download ends",
        )

    def indexed(self, session_id: str) -> bool:
        """Whether the index holds an entry for ``session_id`` (in any state)."""
        with self.index.read() as txn:
            return self.index.get(txn, session_id) is not None

    # ------------------------------------------------------------------ index records
    @staticmethod
    def visible(record: dict | None, owner: str | None) -> TypeGuard[dict]:
        """Whether ``owner`` (None: anyone) may see ``record`` (a session being deleted is gone)."""
        return record is not None and record["state"] != "deleting" and (owner is None or record["owner"] == owner)

    def record(self, session_id: str, owner: str | None = None) -> dict:
        """The visible index record of the session keyed ``session_id`` (SessionNotFound otherwise)."""
        validate_key(session_id)
        with self.index.read() as txn:
            record = self.index.get(txn, session_id)
        if not self.visible(record, owner):
            raise SessionNotFound(f"no session {public_id(session_id)!r}")
        return record

    def resolve(self, session_id: str, owner: str | None, *, hidden: bool = False) -> str:
        """The storage key of ``owner``'s session ``session_id``: checked before any lock or file.

        Ids are per owner, so another owner's session is a key that does not exist: the same
        :class:`SessionNotFound`, from the same single index read, as an id nobody has. With
        ``owner=None`` (the command line acting as any owner) the id must name one owner's session;
        an id several owners have is refused (:class:`InvalidRequest`, naming them) rather than
        guessed. ``hidden`` also finds a session a failed delete hid (so deleting it finishes).
        """
        validate_session_id(session_id)
        with self.index.read() as txn:
            if owner is not None:
                key = storage_key(session_id, owner)
                found = [(key, self.index.get(txn, key))]
            else:
                found = self.index.keys_of_id(txn, session_id)
        shown = [(key, record) for key, record in found if record is not None and self.visible(record, None)]
        if len(shown) > 1:
            owners = sorted(record["owner"] for _, record in shown)
            raise InvalidRequest(
                f"{len(shown)} owners have a session {session_id!r} ({', '.join(owners)}); name the owner (--owner)"
            )
        if shown:
            return shown[0][0]
        hidden_ones = [key for key, record in found if record is not None] if hidden else []
        if len(hidden_ones) == 1:
            return hidden_ones[0]
        raise SessionNotFound(f"no session {session_id!r}")

    @staticmethod
    def owner_of(session_id: str) -> str:
        """The owner part of a storage key."""
        return schema.key_owner(validate_key(session_id)) or ""

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
        """Record a use of the session (its place in the LRU order).

        Best effort: a read is not refused because a full or failing index cannot move the session
        up the eviction order (the read itself needed no index write).
        """
        now_ns = time.time_ns()
        try:
            with self.index.write() as txn:
                record = self.index.get(txn, session_id)
                if record is not None and record["state"] != "deleting":
                    self.update(txn, session_id, last_used=now_ns / 1e9, last_used_ns=now_ns)
        except (IndexFull, IndexIOError):
            pass

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
                follow_symlinks=False,
                dir_fd=self.dir_fd(self.journals),
            )
        except FileNotFoundError:
            reason = f"the journal of session {sid!r} is missing"
        except (GeometryMismatch, CodecMismatch, FormatError) as exc:
            reason = f"the journal of session {sid!r} does not match its index entry: {exc.reason}"
        self.mark_damaged(sid, reason)
        raise SessionDamaged(reason + "; the session is marked damaged (delete it, or restore the file and reopen)")

    def _move_files_for_schema(self, old_key: str, new_key: str) -> None:
        """Rename a session's journal and archive for an index schema step; drop its old lock files
        (nothing holds them: the index is upgraded before the store is used)."""
        for folder, suffix in ((self.journals, ".coli_kv"), (self.archives, ".coli_kv.zst")):
            old, new = self._confined(folder, old_key + suffix), self._confined(folder, new_key + suffix)
            with write_errors(f"renaming {folder.name}/{old.name} for the index upgrade", "nothing was upgraded"):
                if old.exists() and not new.exists():
                    os.rename(old, new)
                    fsync_dir(folder)
        for stale in (self.locks / f"{old_key}.write", self.locks / f"{old_key}.read"):
            stale.unlink(missing_ok=True)
        (self.journals / f"{old_key}.coli_kv.lock").unlink(missing_ok=True)

    def _tokens_for_schema(self, record: dict, n_records: int) -> np.ndarray | None:
        """A session's tokens for an index schema step (None when its files cannot give them)."""
        try:
            return records.tokens_of(self, record, n_records)
        except (OSError, IntegrityError, PathRefused):
            return None
