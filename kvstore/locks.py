"""Advisory file locks (``flock``) and the "is this writer still running" check, for the whole package.

Two users, one mechanism:

- the journal (``kvstore.journal.KVFile``) takes an exclusive lock on its ``<file>.lock`` sidecar
  while it writes, so two writers never interleave (the sidecar survives the journal's renames);
- the session store (``kvstore.store``) takes per-session ``locks/<id>.write`` / ``.read`` locks
  and an ``evict.lock`` (the lock order is in the ``kvstore.store`` docstring).

Each lock opens its own file description, so two threads of one process exclude each other just
as two processes do. A lock file may be unlinked while someone waits on it (a session's files are
removed on delete): after acquiring, the holder checks that the path still names the inode it
locked and retries otherwise, so two holders can never each lock a different inode of one name.
A lock file is never followed through a symbolic link.

:func:`pid_alive` tells whether a process id still runs: space reservations and temporary files
carry their writer's pid, and those of a writer that was killed are released or removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from kvstore.errors import JournalLocked, PathRefused

LOCK_FILE_MODE = 0o600  # lock files sit beside private data: owner-only like it
_FIRST_PAUSE_S = 0.001
_LONGEST_PAUSE_S = 0.02


class FileLock:
    """An ``flock`` on ``path`` (created 0600 if missing), usable as a context manager.

    Parameters
    ----------
    path : the lock file
    shared : take a shared (reader) lock instead of an exclusive one
    timeout : seconds to wait; 0 tries once. On timeout :class:`JournalLocked` is raised with
        ``busy_reason``.
    busy_reason : the reason a timeout reports (what holds the lock and what to do)

    Raises
    ------
    JournalLocked : the lock stayed busy for ``timeout`` seconds
    PathRefused : ``path`` is a symbolic link
    """

    def __init__(
        self, path: str | os.PathLike, *, shared: bool = False, timeout: float = 10.0, busy_reason: str | None = None
    ):
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
        pause = _FIRST_PAUSE_S
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise JournalLocked(self.busy_reason) from None
                time.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE_S)
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

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_FILE_MODE)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise PathRefused(
                    f"the lock file {self.path.name} is a symbolic link; lock files must be regular files"
                ) from None
            raise

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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 probes without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True
