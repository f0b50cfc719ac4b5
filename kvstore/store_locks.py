"""Advisory file locks for the session store (``flock``), shared across threads and processes.

Each lock opens its own file description, so two threads of one process exclude each other just
as two processes do. A lock file may be unlinked while someone waits on it (a session's files are
removed on delete): after acquiring, the holder checks that the path still names the inode it
locked and retries otherwise, so two holders can never each lock a different inode of one name.

Locks the store takes, always in this order (never the reverse, so they cannot deadlock):

1. ``locks/<id>.write`` exclusive — one mutation of a session at a time (append, truncate,
   park, unpark, fork into it, migrate, repair, delete).
2. ``locks/<id>.read`` — shared by readers that hold a journal open (resume streams, verify,
   fork sources, prefix confirmation); exclusive for the operations that shrink, remove or
   replace the journal, so a reader never sees bytes vanish under it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from kvstore.errors import JournalLocked

LOCK_FILE_MODE = 0o600


class FileLock:
    """An ``flock`` on ``path`` (created 0600 if missing).

    Parameters
    ----------
    path : the lock file
    shared : take a shared (reader) lock instead of an exclusive one
    timeout : seconds to wait; 0 tries once. On timeout :class:`JournalLocked` is raised with
        ``busy_reason``.
    """

    def __init__(self, path: str | os.PathLike, *, shared: bool = False, timeout: float = 10.0, busy_reason: str | None = None):
        self.path = Path(path)
        self.shared = shared
        self.timeout = timeout
        self.busy_reason = busy_reason or f"{self.path.name} is held by another operation; try again later"
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> "FileLock":
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_FILE_MODE)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise JournalLocked(self.busy_reason) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return self
            os.close(fd)  # the name was unlinked (and maybe recreated) while we waited: lock the new one

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass
