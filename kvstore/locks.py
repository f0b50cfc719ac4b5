"""Advisory file locks (``flock``) and the "is this writer still running" check, for the whole package.

Two users, one mechanism:

- the journal (``kvstore.journal.KVFile``) takes an exclusive lock on its ``<file>.lock`` sidecar
  while it writes, so two writers never interleave (the sidecar survives the journal's renames, and
  is named after the journal's real path, so writers naming it through different links meet it);
- the session store (``kvstore.store``) takes per-session ``locks/<id>.write`` / ``.read`` locks
  and an ``evict.lock`` (the lock order is in the ``kvstore.store`` docstring).

Each lock opens its own file description, so two threads of one process exclude each other just
as two processes do. A lock file may be unlinked while someone waits on it (a session's files are
removed on delete): after acquiring, the holder checks that the path still names the inode it
locked and retries otherwise, so two holders can never each lock a different inode of one name.
A lock file is never followed through a symbolic link; given the file descriptor of its folder, it is
opened relative to it (``openat``), so a folder swapped for a link meanwhile cannot redirect it.

:func:`pid_alive` tells whether a process id still runs: space reservations and temporary files
carry their writer's pid, and those of a writer that was killed are released or removed.

How long a lock is waited for is one setting: :data:`DEFAULT_LOCK_TIMEOUT_S` is the default of every
lock, journal and store here (the service passes ``Settings.lock_timeout``, ``kvstore serve
--lock-timeout``, to its store, which passes it on). :func:`waits_capped` lowers every wait of the
calling thread for a block: the service runs store calls with ``waits_capped(0)`` and waits for a
busy session itself, asynchronously, so a request waiting for a lock holds no worker thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Iterator

from kvstore.errors import JournalLocked, PathRefused

LOCK_FILE_MODE = 0o600  # lock files sit beside private data: owner-only like it
_FIRST_PAUSE_S = 0.001
_LONGEST_PAUSE_S = 0.02
DEFAULT_LOCK_TIMEOUT_S = 10.0  # the one default wait for a busy lock (journal, session, store, service)

_wait_cap: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvstore_lock_wait_cap", default=None)


@contextlib.contextmanager
def waits_capped(seconds: float) -> Iterator[None]:
    """Within the block, no :class:`FileLock` of this thread (context) waits longer than ``seconds``.

    ``0`` makes every acquisition a single try: a busy lock raises :class:`JournalLocked` at once,
    and the caller decides how to wait (the service sleeps on its event loop, not in a thread).
    """
    token = _wait_cap.set(seconds)
    try:
        yield
    finally:
        _wait_cap.reset(token)


class FileLock:
    """An ``flock`` on ``path`` (created 0600 if missing), usable as a context manager.

    Parameters
    ----------
    path : the lock file
    shared : take a shared (reader) lock instead of an exclusive one
    timeout : seconds to wait; 0 tries once (:func:`waits_capped` may lower it). On timeout
        :class:`JournalLocked` is raised with ``busy_reason``.
    busy_reason : the reason a timeout reports (what holds the lock and what to do)
    dir_fd : an open descriptor of ``path``'s folder: the file is then opened, checked and created
        relative to it (``openat``), never through whatever ``path``'s folder names now

    Raises
    ------
    JournalLocked : the lock stayed busy for ``timeout`` seconds
    PathRefused : ``path`` is a symbolic link, or not a regular file
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        shared: bool = False,
        timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        busy_reason: str | None = None,
        dir_fd: int | None = None,
    ):
        self.path = Path(path)
        self.dir_fd = dir_fd
        self._name = self.path.name if dir_fd is not None else self.path  # what the system calls get
        self.shared = shared
        self.timeout = timeout
        self.busy_reason = busy_reason or f"{self.path.name} is held by another operation; try again later"
        self._fd = -1
        self.waited = False  # the last acquire found the lock busy and waited (counted by the store)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> "FileLock":
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
        cap = _wait_cap.get()
        deadline = time.monotonic() + (self.timeout if cap is None else min(self.timeout, cap))
        pause = _FIRST_PAUSE_S
        self.waited = False
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise JournalLocked(self.busy_reason) from None
                self.waited = True
                time.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE_S)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self._name, dir_fd=self.dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return self
            os.close(fd)  # the name was unlinked (and maybe recreated) while we waited: lock the new one

    def _open(self) -> int:
        # O_NONBLOCK: a FIFO put where the lock file belongs must not hang the open (it is refused below)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(self._name, flags, LOCK_FILE_MODE, dir_fd=self.dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise PathRefused(
                    f"the lock file {self.path.name} is a symbolic link; lock files must be regular files "
                    f"(nothing was opened through it; in a data folder, `kvstore verify --repair` removes the link)"
                ) from None
            if exc.errno == errno.EISDIR:
                raise PathRefused(
                    f"the lock file {self.path.name} is a folder; lock files must be regular files"
                ) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise PathRefused(f"the lock file {self.path.name} is not a regular file; lock files must be")
        return fd

    def unlink(self) -> None:
        """Remove the lock file's name (relative to ``dir_fd`` when given; a link is never followed)."""
        os.unlink(self._name, dir_fd=self.dir_fd)

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
