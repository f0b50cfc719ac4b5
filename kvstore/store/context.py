"""What every concern of one store shares: its folders, its index, its per-session locks, its limits.

The concern objects (budget, integrity, parking, recovery, ...) each hold this context and read and
change sessions through it: the confined paths of a session's files, the two locks of a session,
its index record (``index.current``, ``index.update``, :meth:`StoreContext.mark_damaged`) and its
open journal.

A migrate, an append or a resume starts with :meth:`StoreContext.session`: the request's id and
owner resolved once into a :class:`SessionHandle` (the key, the record that one index read found,
what the record names, the journal's confined path and the session's locks, not yet held), which
the module owning the operation carries to the journal and the index.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.crypto.kek import KeyProvider
from kvstore.crypto.keyring import Keyring, open_keyring
from kvstore.durable import fsync_dir, write_errors
from kvstore.errors import (
    CodecMismatch,
    FormatError,
    GeometryMismatch,
    IntegrityError,
    InvalidRequest,
    JournalLocked,
    PathRefused,
    SessionDamaged,
    SessionNotFound,
)
from kvstore.formats import coli_kv
from kvstore.formats.coli_kv import Geometry
from kvstore.journal import KVFile, open_regular
from kvstore.locks import FileLock
from kvstore.migrations import index as schema
from kvstore.sealed import Sealing
from kvstore.store import records
from kvstore.store.index import Index, visible
from kvstore.store.stats import StoreStats
from kvstore.store.values import (
    IndexRecord,
    Progress,
    geometry_of,
    public_id,
    storage_key,
    stored_tier,
    tier_of,
    validate_key,
    validate_session_id,
)
from kvstore.tiers import Tier

DIR_MODE = 0o700  # conversations are private: owner-only folders
# What a request that finds a session's lock busy is told (with the session's id).
WRITE_BUSY = "session {!r} is being changed by another request; try again"
READ_BUSY = "session {!r} is being read; try again when the download ends"
#: What opening a session's journal raises when the file is missing or is not the one its index
#: entry describes (the session is then marked damaged: StoreContext.journal_damaged).
JOURNAL_UNUSABLE = (FileNotFoundError, GeometryMismatch, CodecMismatch, FormatError)


def missing_store(data_dir: str | os.PathLike) -> str | None:
    """Why ``data_dir`` holds no session store (``"no such folder"``, ...), or None when it holds one:
    the folder with the index a store writes on its first open (``index/data.mdb``)."""
    root = Path(data_dir)
    if not root.exists():
        return "no such folder"
    if not root.is_dir():
        return "not a folder"
    if not (root / "index" / "data.mdb").is_file():
        return "a folder without a store's index/"
    return None


class SessionLock(FileLock):
    """A session's ``locks/<key>.write`` or ``.read``: its file exists only while the session does.

    Taken by a call for an id the index does not hold (one that never existed, a create or fork that
    failed, a delete that finished), the file is unlinked as the lock is released, so requests for
    missing ids leave nothing behind. Unlinking a held lock file is safe: a waiter that locked the
    unlinked inode sees the name no longer leads to it and locks the new file (``FileLock``). No
    holder of a missing session's lock is inside a critical section it shares with another: only
    create and fork add entries, under the write lock, and delete removes them under both locks.
    The file is named after the session's key (``<key>.write``), which is how the lock knows it.
    """

    def __init__(self, ctx: "StoreContext", path: Path, **options: Any):
        super().__init__(path, **options)
        self._ctx = ctx
        self._session_id = Path(path).name.rsplit(".", 1)[0]

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
                gone = not self._ctx.index.holds(self._session_id)
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


@dataclass(frozen=True)
class SessionHandle:
    """A session resolved once (:meth:`StoreContext.session`): what the operation on it carries.

    Attributes
    ----------
    key : the storage key ``<id>~<owner>`` (its files and index entries)
    id : the id its owner knows it by
    owner : the owner the request acts as (None: any owner)
    record : the index record as the resolving read found it (no lock held: a write reads it again
        under ``writing``)
    geometry, tier, record_bytes : what ``record`` names
    journal : ``journals/<key>.coli_kv`` (checked for links when it is opened:
        :meth:`StoreContext.open_journal_file`, :meth:`StoreContext.open_journal_reader`)
    writing : the session's write lock, not held
    reading : its read lock, shared (readers holding its files open), not held
    replacing : its read lock taken exclusively (to shrink, remove or replace the files), not held
    """

    key: str
    id: str
    owner: str | None
    record: IndexRecord
    geometry: Geometry
    tier: Tier
    record_bytes: int
    journal: Path
    writing: SessionLock
    reading: SessionLock
    replacing: SessionLock


class StoreContext:
    """The folders, index, locks and limits of the store rooted at ``data_dir``.

    Parameters
    ----------
    data_dir : the store's folder (created 0700 if missing)
    budget_bytes, hard_limit_bytes : the disk limits (validated by the caller; None: none)
    max_sessions_per_owner : the most sessions one owner may have (validated by the caller; None: no cap)
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
        max_sessions_per_owner: int | None = None,
        kek: KeyProvider | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.hard_limit_bytes = hard_limit_bytes
        self.max_sessions_per_owner = max_sessions_per_owner
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
        # encryption at rest (docs/SECURITY.md): None for a plaintext store; decided before the index exists
        self.keyring: Keyring | None = open_keyring(self.data_dir, kek)
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

    def sealing(self, session_id: str) -> Sealing | None:
        """What seals the session's files in an encrypted store (None in a plaintext one)."""
        return None if self.keyring is None else Sealing.for_key(self.keyring, validate_key(session_id))

    def open_journal_fd(self, session_id: str) -> int:
        """A read-only descriptor of the session's journal, opened relative to ``journals/`` without
        following a link: a link, folder or FIFO put there after the path was checked is
        :class:`PathRefused`, never read or waited on. ``FileNotFoundError`` when it is missing."""
        return self.open_journal_reader(self.journal_path(session_id))

    def open_journal_reader(self, path: Path) -> int:
        """:meth:`open_journal_fd` of the journal at ``path`` (``journals/<key>.coli_kv``)."""
        return open_regular(self._confined(self.journals, path.name), os.O_RDONLY, self.dir_fd(self.journals))

    # ------------------------------------------------------------------ locks (order: write, then read)
    def writing(self, session_id: str, timeout: float | None = None) -> FileLock:
        """The session's write lock (not yet held): one mutation of a session at a time."""
        return self._lock(self.locks / f"{session_id}.write", WRITE_BUSY.format(public_id(session_id)), timeout=timeout)

    def reading(self, session_id: str, *, exclusive: bool = False, timeout: float | None = None) -> FileLock:
        """The session's read lock (not yet held): shared by readers, exclusive to shrink or replace files."""
        busy = READ_BUSY.format(public_id(session_id))
        return self._lock(self.locks / f"{session_id}.read", busy, shared=not exclusive, timeout=timeout)

    def _lock(self, path: Path, busy_reason: str, *, shared: bool = False, timeout: float | None = None) -> SessionLock:
        return SessionLock(
            self,
            path,
            dir_fd=self.dir_fd(self.locks),
            shared=shared,
            timeout=self.lock_timeout if timeout is None else timeout,
            busy_reason=busy_reason,
        )

    # ------------------------------------------------------------------ index records
    def record(self, session_id: str, owner: str | None = None) -> IndexRecord:
        """The visible index record of the session keyed ``session_id`` (SessionNotFound otherwise)."""
        return self.index.current(validate_key(session_id), owner)

    def session(self, session_id: str, owner: str | None) -> SessionHandle:
        """``owner``'s session ``session_id`` resolved once (:meth:`resolve`'s one index read, no lock,
        no file opened): its key, record, geometry, tier, journal path and locks.

        Raises
        ------
        SessionNotFound, InvalidRequest, InvalidSessionId : as :meth:`resolve`
        """
        key, record = self._resolved(session_id, owner, hidden=False)
        geometry, tier = Geometry(*record["geometry"]), stored_tier(record["tier"])
        # the key comes from the index or from a validated id and owner: its file names stay in their folders
        return SessionHandle(
            key=key,
            id=session_id,
            owner=owner,
            record=record,
            geometry=geometry,
            tier=tier,
            record_bytes=coli_kv.record_bytes(geometry, tier),
            journal=self.journals / f"{key}.coli_kv",
            writing=self._lock(self.locks / f"{key}.write", WRITE_BUSY.format(session_id)),
            reading=self._lock(self.locks / f"{key}.read", READ_BUSY.format(session_id), shared=True),
            replacing=self._lock(self.locks / f"{key}.read", READ_BUSY.format(session_id)),
        )

    def resolve(self, session_id: str, owner: str | None, *, hidden: bool = False) -> str:
        """The storage key of ``owner``'s session ``session_id``: checked before any lock or file.

        Ids are per owner, so another owner's session is a key that does not exist: the same
        :class:`SessionNotFound`, from the same single index read, as an id nobody has. With
        ``owner=None`` (the command line acting as any owner) the id must name one owner's session;
        an id several owners have is refused (:class:`InvalidRequest`, naming them) rather than
        guessed. ``hidden`` also finds a session a failed delete hid (so deleting it finishes).
        """
        return self._resolved(session_id, owner, hidden=hidden)[0]

    def _resolved(self, session_id: str, owner: str | None, *, hidden: bool) -> tuple[str, IndexRecord]:
        """:meth:`resolve`, with the record its read found."""
        validate_session_id(session_id)
        with self.index.read() as txn:
            if owner is not None:
                key = storage_key(session_id, owner)
                found = [(key, self.index.get(txn, key))]
            else:
                found = self.index.keys_of_id(txn, session_id)
        shown = [(key, record) for key, record in found if visible(record, None)]
        if len(shown) > 1:
            owners = sorted(record["owner"] for _, record in shown)
            raise InvalidRequest(
                f"{len(shown)} owners have a session {session_id!r} ({', '.join(owners)}); name the owner (--owner)"
            )
        if shown:
            return shown[0]
        hidden_ones = [(key, record) for key, record in found if record is not None] if hidden else []
        if len(hidden_ones) == 1:
            return hidden_ones[0]
        raise SessionNotFound(f"no session {session_id!r}")

    @staticmethod
    def owner_of(session_id: str) -> str:
        """The owner part of a storage key."""
        return schema.key_owner(validate_key(session_id)) or ""

    def mark_damaged(self, session_id: str, reason: str) -> None:
        with self.index.write() as txn:
            record = self.index.get(txn, session_id)
            if record is not None and record["state"] != "deleting":
                self.index.update(txn, session_id, state="damaged", problem=reason)

    # ------------------------------------------------------------------ journals
    def open_journal(self, record: IndexRecord, *, writable: bool) -> KVFile:
        """The session's journal, checked against its index record; a missing or mismatched one marks
        the session damaged (:class:`SessionDamaged`)."""
        sid = record["id"]
        try:
            return self.open_journal_file(
                self.journals / f"{validate_key(sid)}.coli_kv", geometry_of(record), tier_of(record), writable=writable
            )
        except JOURNAL_UNUSABLE as exc:
            raise self.journal_damaged(sid, exc) from None

    def open_journal_file(self, path: Path, geometry: Geometry, tier: Tier, *, writable: bool) -> KVFile:
        """The journal at ``path`` (``journals/<key>.coli_kv``), confined (:class:`PathRefused` for a
        link or a non-file, or a replaced folder), opened relative to the folder opened with the
        store and checked against ``geometry`` and ``tier``; the caller turns
        :data:`JOURNAL_UNUSABLE` into :meth:`journal_damaged`."""
        return KVFile.open(
            self._confined(self.journals, path.name),
            geometry=geometry,
            tier=tier,
            writable=writable,
            lock_timeout=self.lock_timeout,
            follow_symlinks=False,
            dir_fd=self.dir_fd(self.journals),
            sealing=self.sealing(path.name.removesuffix(".coli_kv")),
        )

    def journal_damaged(self, session_id: str, failure: Exception) -> SessionDamaged:
        """Mark the session damaged for a journal that is missing or does not match its index entry
        (``failure``, one of :data:`JOURNAL_UNUSABLE`); the error to raise."""
        sid = session_id
        if isinstance(failure, FileNotFoundError):
            reason = f"the journal of session {sid!r} is missing"
        else:
            reason = (
                f"the journal of session {sid!r} does not match its index entry: {getattr(failure, 'reason', failure)}"
            )
        self.mark_damaged(sid, reason)
        return SessionDamaged(reason + "; the session is marked damaged (delete it, or restore the file and reopen)")

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

    def _tokens_for_schema(self, record: IndexRecord, n_records: int) -> np.ndarray | None:
        """A session's tokens for an index schema step (None when its files cannot give them)."""
        try:
            return records.tokens_of(self, record, n_records)
        except (OSError, IntegrityError, PathRefused):
            return None
